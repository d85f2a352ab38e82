"""Run folders: deciding how a run starts in its folder (a new run, refused without --resume /
--overwrite, resumed from a checkpoint of this run or another, emptied for --overwrite), the
run's id, sweeping what a crash left, setting later checkpoints aside, and the lock that keeps
two processes out of one folder. The checkpoints inside it are ``flowgrpo/checkpoint.py``'s.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from flowgrpo.checkpoint import (ENGINE_PREFIX, LOCK, MARKER, METRICS, OLD_PREFIX, RUN_FILE,
                                 SUPERSEDED, TMP_PREFIX, checkpoint_problem, fsync_path,
                                 list_checkpoints, numbered_checkpoints, read_state, remove_dir,
                                 write_json_atomic)
from flowgrpo.errors import InputError
from flowgrpo.user_files import folder_blocker, unwritable_folder


def sweep_stale(run_dir: str | Path) -> list[str]:
    """Clean up after a crash: delete unfinished saves and removals (``.tmp-*``, ``.engine-*``);
    an ``.old-<n>`` left by a crash while re-saving iteration n goes back to ``<n>`` when the new
    ``<n>`` did not make it in, and is deleted when it did. Returns what was done, for the log."""
    root = Path(run_dir) / "checkpoints"
    notes: list[str] = []
    for entry in Path(run_dir).glob(f"{TMP_PREFIX}*"):   # write_json_atomic / metrics rewrites
        if entry.is_file():
            entry.unlink()
    if not root.is_dir():
        return notes
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() and not entry.name.startswith(TMP_PREFIX):
            continue
        if entry.name.startswith((TMP_PREFIX, ENGINE_PREFIX)):
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            notes.append(f"removed {entry.name} (an unfinished save from an earlier process)")
        elif entry.name.startswith(OLD_PREFIX):
            target = root / entry.name[len(OLD_PREFIX):]
            if checkpoint_problem(target) is None or checkpoint_problem(entry) is not None:
                shutil.rmtree(entry)
                notes.append(f"removed {entry.name} (replaced by a complete {target.name})")
            else:
                if target.exists():
                    remove_dir(target)
                os.replace(entry, target)
                notes.append(f"restored checkpoint {target.name} (its re-save did not finish)")
    if notes:
        fsync_path(root, directory=True)
    return notes


def run_contents(run_dir: str | Path) -> list[str]:
    """What makes ``run_dir`` hold a run: a non-empty metrics.jsonl, anything in checkpoints/."""
    run_dir = Path(run_dir)
    found = []
    metrics = run_dir / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS)
    root = run_dir / "checkpoints"
    if root.is_dir() and any(root.iterdir()):
        found.append("checkpoints/")
    return found


def read_run_id(run_dir: str | Path) -> str | None:
    try:
        value = json.loads((Path(run_dir) / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def _empty_run_folder(run_dir: Path) -> None:
    """--overwrite: delete everything in the run folder but its lock. Refused for a folder that
    does not look like a run's, so a wrong name cannot empty an unrelated folder."""
    ours = {RUN_FILE, METRICS, "config.yaml", "checkpoints", LOCK}
    entries = [e for e in run_dir.iterdir() if e.name != LOCK]
    if entries and not any(e.name in ours for e in entries):
        raise InputError(f"--overwrite: {run_dir} does not look like a flowgrpo run folder (no "
                         f"{RUN_FILE}, {METRICS} or checkpoints/), so it is not emptied: choose "
                         f"another run name or empty it yourself")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    fsync_path(run_dir, directory=True)


def _set_aside_newer(run_dir: Path, iteration: int) -> list[str]:
    """Complete checkpoints after the one a run resumes from belong to the abandoned
    continuation: move them to checkpoints/superseded-<time>/ so that ``--resume latest`` and
    rotation see only this continuation's (nothing is deleted)."""
    newer = [p for p in list_checkpoints(run_dir) if int(p.name) > iteration]
    if not newer:
        return []
    aside = _superseded_folder(run_dir)
    for path in newer:
        os.replace(path, aside / path.name)
    fsync_path(run_dir / "checkpoints", directory=True)
    return [f"checkpoints {', '.join(p.name for p in newer)} came after the resumed iteration "
            f"{iteration}: moved to {aside} (delete it when you no longer need them)"]


def _superseded_folder(run_dir: str | Path) -> Path:
    """A new, empty ``checkpoints/superseded-<time>[-n]/`` (two set-asides within one second
    get folders of their own, so neither overwrites the other's)."""
    root = Path(run_dir) / "checkpoints"
    stem = f"{SUPERSEDED}-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, count = root / stem, 1
    while aside.exists():
        count += 1
        aside = root / f"{stem}-{count}"
    aside.mkdir()
    return aside


def set_aside(run_dir: str | Path, name: str) -> Path:
    """Move ``checkpoints/<name>`` to ``checkpoints/superseded-<time>/<name>`` (nothing is
    deleted); returns where it went."""
    root = Path(run_dir) / "checkpoints"
    aside = _superseded_folder(run_dir)
    os.replace(root / name, aside / name)
    fsync_path(root, directory=True)
    return aside / name


def check_run_folder(run_dir: str | Path) -> None:
    """InputError unless this process can make ``run_dir`` and write in it: a file where it or
    an ancestor should be a folder (run.output_dir given a file), or a folder without write
    permission (a read-only mount, another user's run) would otherwise fail at the first write,
    after the model has loaded (or, on --resume, halfway into the start). Writes nothing."""
    run_dir = Path(run_dir)
    blocker = folder_blocker(run_dir)
    if blocker is not None:
        raise InputError(f"run folder {run_dir} cannot be made: {blocker} is a file, not a "
                         f"folder; set run.output_dir (and name) to a folder")
    locked = unwritable_folder(run_dir)
    if locked is None:
        return
    why = "not writable by this user, or on a read-only filesystem"
    if locked == Path(os.path.abspath(run_dir)):
        raise InputError(f"run folder {run_dir} is {why}; training writes its lock, checkpoints "
                         f"and metrics there: make it writable, or set run.output_dir to a "
                         f"writable folder (--resume {run_dir / 'checkpoints'}/<iteration> "
                         f"continues this run's checkpoint there)")
    raise InputError(f"run folder {run_dir} cannot be made: {locked} is {why}; make it "
                     f"writable, or set run.output_dir to a writable folder")


def open_run(run_dir: str | Path, *, resume: str | None, overwrite: bool,
             signature: dict[str, Any], name: str) -> dict[str, Any]:
    """Decide how a run starts in ``run_dir`` before anything loads, or raise InputError.

    - A folder holding a run (``run_contents``) is refused unless ``resume`` or ``overwrite``
      (which empties it first).
    - ``resume``: "latest" (newest complete checkpoint; an error when there is none), "auto"
      (the newest, or a fresh start when there is none), or a checkpoint folder (any run's: an
      explicit path is the way to continue from another run's checkpoint).
    - "latest"/"auto" refuse a checkpoint whose run id differs from the folder's run.json.
    - Any resume refuses a checkpoint whose stored ``signature`` (model, LoRA layout, plan)
      differs from ``signature``, naming the fields.

    Also sweeps stale temporary folders and writes run.json. Returns {"run_id", "checkpoint"
    (str or None), "notes" (lines for the log)}."""
    run_dir = Path(run_dir)
    check_run_folder(run_dir)
    if resume is not None and overwrite:
        raise InputError("--resume and --overwrite contradict each other: --resume continues the "
                         "run in the folder, --overwrite deletes it; give one")
    explicit = resume is not None and resume not in ("latest", "auto")
    if explicit and not Path(resume).is_dir():
        raise InputError(f"--resume {resume}: no such checkpoint folder (give 'latest', 'auto' or "
                         f"a path to runs/<name>/checkpoints/<iteration>)")
    held = run_contents(run_dir)
    if held and resume is None and not overwrite:
        raise InputError(f"run folder {run_dir} already holds a run ({' and '.join(held)}): pass "
                         f"--resume latest to continue it (--resume auto: continue if it has a "
                         f"checkpoint, else start again), --overwrite to delete it and start "
                         f"again, or give the run another name (name=...)")
    if overwrite and run_dir.is_dir():
        _empty_run_folder(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    notes = sweep_stale(run_dir)
    folder_id = read_run_id(run_dir)
    checkpoint: Path | None = None
    if resume in ("latest", "auto"):
        found = list_checkpoints(run_dir)
        # The newest whose files still hash to what was written (read once, here, on the main
        # process; the other processes then only check sizes): a damaged newest checkpoint
        # falls back to the one before it instead of failing the resume.
        for candidate in reversed(found):
            damage = (checkpoint_problem(candidate, verify_hashes=True)
                      if (candidate / MARKER).exists() else None)
            if damage is None:
                checkpoint = candidate
                break
            notes.append(f"checkpoint {candidate.name} is damaged ({damage}): resuming from an "
                         f"earlier one")
        if found and checkpoint is None:
            raise InputError(f"--resume {resume}: every checkpoint in {run_dir / 'checkpoints'} "
                             f"is damaged (see above); --overwrite starts the run again")
        if not found and resume == "latest":
            skipped = [f"{p.name} ({checkpoint_problem(p)})" for p in numbered_checkpoints(run_dir)]
            raise InputError(
                f"--resume latest: {run_dir / 'checkpoints'} holds no complete checkpoint"
                + (f" (skipped: {'; '.join(skipped)}; give such a folder's path to --resume to "
                   f"use it anyway)" if skipped else "")
                + ": start without --resume (--overwrite if the folder holds a run), or with "
                  "--resume auto, which starts from scratch when there is nothing to resume")
        legacy = []
        for path in numbered_checkpoints(run_dir):
            if path not in found:
                notes.append(f"skipped incomplete checkpoint {path.name}: "
                             f"{checkpoint_problem(path)}")
            elif not (path / MARKER).exists():
                legacy.append(path.name)
        if legacy:
            notes.append(f"checkpoints {', '.join(legacy)} predate completion markers: used "
                         f"because their trainer_state.json reads")
    elif explicit:
        checkpoint = Path(resume)
        problem = checkpoint_problem(checkpoint, verify_hashes=True)
        if problem and (checkpoint / MARKER).exists():
            raise InputError(f"--resume {resume}: the checkpoint is damaged ({problem}); resume "
                             f"from another one")
        if problem:
            read_state(checkpoint)   # unreadable state: an error; a missing marker: a note
            notes.append(f"checkpoint {checkpoint} is not marked complete ({problem}); it is "
                         f"used because you named it")
    run_id = None
    if checkpoint is not None:
        state = read_state(checkpoint)
        saved_id = state.get("run_id")
        if not explicit and folder_id and saved_id and saved_id != folder_id:
            raise InputError(f"checkpoint {checkpoint} belongs to run {saved_id}, but "
                             f"{run_dir / RUN_FILE} says this folder holds run {folder_id}: "
                             f"the checkpoint was copied in from another run. Pass its folder "
                             f"explicitly (--resume {checkpoint}) to continue from it anyway")
        saved_signature = state.get("signature")
        if isinstance(saved_signature, dict):
            changed = [f"{key}: checkpoint {saved_signature[key]!r}, config {value!r}"
                       for key, value in signature.items()
                       if key in saved_signature and saved_signature[key] != value]
            if changed:
                raise InputError(f"cannot resume from {checkpoint}: the config changed what its "
                                 f"weights were trained for ({'; '.join(changed)}). Put these "
                                 f"values back, or start a new run (another name, or "
                                 f"--overwrite)")
        else:
            notes.append(f"checkpoint {checkpoint} stores no resume signature (written by an "
                         f"older version): the model, LoRA layout and plan are not compared")
        inside = checkpoint.resolve().parent == (run_dir / "checkpoints").resolve()
        # Continuing this folder's run keeps its id; an explicit checkpoint of another run in a
        # new folder starts a new run (a fork) with a new id.
        run_id = folder_id or (saved_id if inside else None)
        notes += _set_aside_newer(run_dir, int(state["iteration"]))
    run_id = run_id or secrets.token_hex(8)
    if run_id != folder_id:
        write_json_atomic(run_dir / RUN_FILE, {"run_id": run_id, "name": name,
                                               "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return {"run_id": run_id, "checkpoint": None if checkpoint is None else str(checkpoint),
            "notes": notes}


class RunLock:
    """An exclusive lock on a run folder while a process trains in it (``flock`` on
    ``<run>/.lock``): a second process of the same run, say a requeued job whose predecessor
    still runs, fails at its start instead of interleaving its checkpoints with the first's. The
    kernel drops the lock when the process dies, kill -9 included. Where the filesystem has no
    locks the run goes on unlocked (with a note)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK
        self.note: str | None = None
        self._file = None

    def acquire(self) -> None:
        try:
            import fcntl   # POSIX only
        except ImportError:     # not POSIX: no advisory locks to take
            self.note = "no file locks on this platform: the run folder is not locked"
            return
        check_run_folder(self.path.parent)   # the lock is the run's first write
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path, "a+")
        except OSError as err:   # what check_run_folder cannot foresee (a folder named .lock)
            raise InputError(f"cannot create the run folder's lock file {self.path} "
                             f"({err.strerror or err}): training writes there; fix the run "
                             f"folder or set run.output_dir to a writable folder") from None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise InputError(f"run folder {self.path.parent} is in use by another training "
                             f"process (it holds {self.path}); wait for it to end or stop it, "
                             f"or give this run another name") from None
        except OSError as err:
            handle.close()
            self.note = f"cannot lock {self.path} ({err}): the run folder is not locked"
            return
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            self._file.close()   # closing the file drops the flock
            self._file = None
