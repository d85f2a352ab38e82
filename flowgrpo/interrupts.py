"""Stopping a run on a signal: the scheduler's "you will be killed soon" (SIGTERM, or the signal
chosen with ``sbatch --signal``) and Ctrl-C (SIGINT) become a saved checkpoint, one line, and an
exit code of 128 + the signal's number, instead of lost iterations and a traceback.

How a signal is honoured (``StopSignals``):
- The handler only records the first signal. The trainer looks at the record at safe points of
  its loop (before a rollout, after an update, after an evaluation), where the weights, the EMA
  and the optimiser hold a complete iteration, so the checkpoint it writes there resumes exactly.
  An update is never cut: a checkpoint of a half-applied update could not be resumed exactly.
- On one process, a signal that arrives during a rollout or an evaluation abandons it at once
  (``abandonable``): the handler raises ``StopRequested``, which derives from BaseException so that
  a reward's ``except Exception`` cannot swallow it. Several processes cannot do that: a process
  that leaves a rollout early would leave the others waiting in the next collective. They agree
  instead (``agreed_signal``: the largest signal number any process received) at the same safe
  points, so one signal to any process stops all of them at the same iteration.
- A second signal more than ``DUPLICATE_WINDOW_S`` after the first exits at once (``os._exit``)
  without saving. Nothing is corrupted by that: a checkpoint becomes visible only when complete
  (``checkpoint.py``), and the metrics log drops a torn last line on resume. A second signal
  within the window is the same request delivered twice (a launcher forwarding the signal that
  also reached its workers, as torchrun's agent and accelerate's launcher do) and is ignored.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from flowgrpo.errors import RunStopped

# The signals ``run.save_on_signal`` may name: the ones schedulers and terminals send to ask a
# process to end. SIGKILL and SIGSTOP cannot be caught.
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
# Two deliveries of one request (the launcher forwards what the scheduler also sent the workers)
# arrive milliseconds apart; a person pressing Ctrl-C twice takes longer.
DUPLICATE_WINDOW_S = 2.0


def exit_code(signum: int) -> int:
    """The shell's code for "ended by signal ``signum``" (143 for SIGTERM, 130 for SIGINT):
    what schedulers and shells already read as "stopped from outside", not as a failure."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequested(BaseException):
    """Raised by the signal handler inside an ``abandonable`` section (one process only)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


class Preempted(RunStopped):
    """The run stopped on a signal after saving ``checkpoint`` (or with nothing to save)."""

    def __init__(self, signum: int, message: str, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = exit_code(signum)
        self.quiet = quiet   # processes other than the main one exit without a second line


class StopSignals:
    """Handlers for ``names`` (``run.save_on_signal``) while a run trains; see the module
    docstring. ``may_abandon``: whether a signal may cut a rollout or an evaluation short (one
    process; several must agree first)."""

    def __init__(self, names: Sequence[str], may_abandon: bool) -> None:
        self.signals = [getattr(signal, name) for name in names]
        self.may_abandon = may_abandon
        self.received: int | None = None
        self._received_at = 0.0
        self._abandonable = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Take over the signals (Python lets only the main thread set handlers; elsewhere, as
        in a notebook's worker thread, the run keeps the default handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._received_at = signum, now
            if self._abandonable:
                self._abandonable = False
                raise StopRequested(signum)
            return
        if now - self._received_at < DUPLICATE_WINDOW_S:
            return
        os.write(2, (f"flowgrpo train: second signal ({signal_name(signum)}): exiting now "
                     f"without saving; the last complete checkpoint is kept\n").encode())
        os._exit(exit_code(signum))

    @contextmanager
    def abandonable(self) -> Iterator[None]:
        """A section (rollout, evaluation) that a signal may cut short, on one process: the
        signal raises ``StopRequested`` in it, and entering it after a signal raises at once."""
        if not self.may_abandon:
            yield
            return
        if self.received is not None:
            raise StopRequested(self.received)
        self._abandonable = True
        try:
            yield
        finally:
            self._abandonable = False


def agreed_signal(accelerator, local: int | None) -> int | None:
    """The signal every process acts on: the largest number any process received (None when
    none did). A collective on several processes: every process must call it at the same point."""
    if accelerator.num_processes == 1:
        return local
    flag = torch.tensor([local or 0], dtype=torch.int64, device=accelerator.device)
    agreed = int(accelerator.gather(flag).max())
    return agreed or None
