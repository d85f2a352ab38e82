"""Sections of a run that one process or every process runs, with the failure of any process
raised on every process (instead of the others waiting at the next collective until the group
times out)."""
from __future__ import annotations

from typing import Any, Callable

from accelerate.utils import broadcast_object_list

from flowgrpo.errors import InputError
from flowgrpo.policy import gather_rows


def main_only(accelerator, section: str, work: Callable[[], Any]) -> Any:
    """Run ``work`` on the main process and hand its result to every process. When it raises,
    every process raises (the main process its own error, the others one naming it) instead
    of waiting for the main process at the next collective until the group times out."""
    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = work()
        except Exception as err:   # noqa: BLE001 (re-raised below, on every process)
            error = err
    if accelerator.num_processes > 1:
        message = None if error is None else f"{type(error).__name__}: {error}"
        shared = broadcast_object_list([message, result if error is None else None,
                                        isinstance(error, InputError)], from_process=0)
        if shared[0] is not None and error is None:
            # A bad input stays a bad input on every process (one line from the CLI, not a
            # traceback per process); anything else is a failure with its own traceback.
            kind = InputError if shared[2] else RuntimeError
            raise kind(f"the main process failed in {section}: {shared[0]}")
        result = shared[1]
    if error is not None:
        raise error
    return result


def everywhere(accelerator, section: str, work: Callable[[], Any]) -> Any:
    """Run ``work`` on every process. When it raises on any process, every process raises
    (its own error, or one naming the process that failed) instead of waiting at the next
    collective. ``work`` must reach its own collectives on every process."""
    result, error = None, None
    try:
        result = work()
    except Exception as err:   # noqa: BLE001 (re-raised below, on every process)
        error = err
    if accelerator.num_processes > 1:
        own = None if error is None else \
            f"process {accelerator.process_index}: {type(error).__name__}: {error}"
        failed = [m for m in gather_rows([own], accelerator) if m]
        if failed and error is None:
            raise RuntimeError(f"{section} failed on another process ({failed[0]})")
    if error is not None:
        raise error
    return result
