"""Checkpoints: safetensors and JSON only, written so that a crash at any point leaves either the
previous state or the new one, never a half-written folder that looks whole. How a run starts in
its folder (refuse, resume, overwrite), its id and its lock are ``flowgrpo/run_folder.py``'s.

Layout of ``<run>/``::

    run.json                          the run's id (random hex) and name, written at its start
    metrics.jsonl                     one JSON record a line, flushed and fsynced per record
    config.yaml                       the config (secrets redacted)
    checkpoints/<iteration>/          one complete checkpoint (below)
    checkpoints/best/, best.json      the best evaluation's checkpoint (run.select_best_on; the
                                      same layout, never pruned) and its iteration and value
    checkpoints/.tmp-*, .old-*        a save or removal in progress; swept at the next start

Layout of ``checkpoints/<iteration>/``::

    pytorch_lora_weights.safetensors  LoRA in diffusers/PEFT format (pipe.load_lora_weights(dir))
    trainable.safetensors             every trainable tensor by parameter name (exact resume)
    optimizer.safetensors + .json     optimiser tensors / hyper-parameters and step counters
    engine/                           under FSDP / DeepSpeed instead of the two above: the
                                      engine's sharded model and optimiser state (its own format,
                                      read back only by ``--resume`` of the same run)
    ema.safetensors                   EMA shadow weights (when enabled)
    reference.safetensors             the KL reference's trainable tensors after a refresh
                                      (training.gardo.refresh_every / refresh_kl)
    rng.safetensors                   torch CPU RNG state
    trainer_state.json                iteration, EMA counters, run id, the resume signature
    COMPLETE.json                     written last: every other file with its size and sha256

A save writes everything into ``.tmp-<iteration>``, fsyncs every file and folder, writes the
marker, and renames the folder into place (an existing folder of the same iteration is renamed
aside first and deleted only once the new one is in). ``list_checkpoints`` (and so ``--resume
latest`` and rotation) sees only folders whose marker matches their files. Nothing is ever
unpickled.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from flowgrpo.errors import InputError

MARKER = "COMPLETE.json"
STATE = "trainer_state.json"
RUN_FILE = "run.json"
METRICS = "metrics.jsonl"
LOCK = ".lock"
TMP_PREFIX = ".tmp-"          # a save (or a removal) in progress: always safe to delete
OLD_PREFIX = ".old-"          # the previous folder of an iteration being re-saved
ENGINE_PREFIX = ".engine-"    # a sharded engine's state before it moves into its checkpoint
SUPERSEDED = "superseded"     # checkpoints after a resumed one, set aside (never deleted)
REFERENCE = "reference.safetensors"   # the refreshed KL reference (training.gardo)
ALGORITHM = "algorithm.safetensors"   # the training algorithm's tensors (old policy: nft, dgpo)
BEST = "best"                 # checkpoints/best/: the best evaluation's (run.select_best_on)
BEST_RECORD = "best.json"     # checkpoints/best.json: its iteration, metric and value
# Test hook: seconds to sleep after each file of a save, so that a test can kill the process
# in the middle of one (tests/test_reliability.py). Unset in normal use.
FAULT_SLEEP_ENV = "FLOWGRPO_FAULT_SAVE_SLEEP"


# --------------------------------------------------------------------------- durable writes

def fsync_path(path: Path, directory: bool = False) -> None:
    """Flush ``path`` (a file, or a folder's entries) to the disk. Folders: some platforms and
    network filesystems cannot fsync a directory (EINVAL, or no O_DIRECTORY); the rename is then
    as durable as that filesystem makes it, which is all one can ask of it."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder), directory=True)


def write_json_atomic(path: Path, value: Any) -> None:
    """``path`` holds the old JSON or the new one, never a prefix: write a temp file, fsync it,
    rename it over ``path``, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open(tmp, "w") as f:
        f.write(json.dumps(value, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent, directory=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_list(root: Path) -> dict[str, Path]:
    """Every file under ``root`` but the marker, by its '/'-separated relative path."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            relative = path.relative_to(root).as_posix()
            if relative != MARKER:
                out[relative] = path
    return dict(sorted(out.items()))


def _fault_pause() -> None:
    seconds = os.environ.get(FAULT_SLEEP_ENV)
    if seconds:
        time.sleep(float(seconds))


def remove_dir(path: Path) -> None:
    """Delete a folder so that a crash midway leaves no partly-deleted folder under its name:
    rename it to a ``.tmp-`` name (atomic), then delete that."""
    doomed = path.with_name(f"{TMP_PREFIX}del-{path.name}-{secrets.token_hex(4)}")
    os.replace(path, doomed)
    fsync_path(path.parent, directory=True)
    shutil.rmtree(doomed)


# --------------------------------------------------------------------------- save / load

def _optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    for index, entries in meta["scalars"].items():
        state.setdefault(int(index), {}).update(entries)
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(directory: str | Path, *, iteration: int, trainable: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer | None, ema_state: dict[str, torch.Tensor] | None,
                    ema_counters: dict[str, int] | None,
                    save_lora: Callable[[str], None] | None = None, extra: dict | None = None,
                    engine_dir: str | Path | None = None,
                    tensor_files: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write checkpoint ``directory`` atomically and durably (see the module docstring).
    ``save_lora(dir)`` writes the user-facing weights; ``engine_dir`` (a sharded engine's
    ``save_state`` folder) moves in as ``engine/`` before the marker is written;
    ``tensor_files`` (file name -> tensors) are more safetensors files, e.g. ``REFERENCE``."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f"{TMP_PREFIX}{directory.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if optimizer is not None:   # None: a sharded engine saves both in its own format
        save_file({k: v.detach().contiguous().cpu() for k, v in trainable.items()},
                  str(tmp / "trainable.safetensors"))
        _fault_pause()
        opt_tensors, opt_meta = _optimizer_to_flat(optimizer)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(opt_meta))
        _fault_pause()
    if ema_state is not None:
        save_file({k: v.contiguous().cpu() for k, v in ema_state.items()}, str(tmp / "ema.safetensors"))
        _fault_pause()
    save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    for name, tensors in (tensor_files or {}).items():
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / name))
        _fault_pause()
    if save_lora is not None:
        save_lora(str(tmp))
        _fault_pause()
    if engine_dir is not None:
        os.replace(engine_dir, tmp / "engine")
    state = {"iteration": iteration, "ema": ema_counters, **(extra or {})}
    (tmp / STATE).write_text(json.dumps(state, indent=2))
    _fsync_tree(tmp)
    _fault_pause()
    # The marker goes last: a folder with a marker whose sizes match has every byte on disk.
    files = {name: {"bytes": path.stat().st_size, "sha256": _sha256(path)}
             for name, path in _file_list(tmp).items()}
    with open(tmp / MARKER, "w") as f:
        f.write(json.dumps({"format": 1, "iteration": iteration, "files": files}, indent=2))
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp, directory=True)
    _fault_pause()
    if directory.exists():
        # Re-saving an iteration: the old folder stays whole (under .old-) until the new one is
        # in place; a crash in between is repaired by sweep_stale at the next start.
        aside = directory.with_name(f"{OLD_PREFIX}{directory.name}")
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(directory, aside)
        _fault_pause()
        os.replace(tmp, directory)
        fsync_path(directory.parent, directory=True)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, directory)
        fsync_path(directory.parent, directory=True)
    return directory


def checkpoint_problem(directory: str | Path, verify_hashes: bool = False) -> str | None:
    """Why ``directory`` is not a complete checkpoint (None when it is): no or unreadable
    marker, a listed file missing or of another size (or, with ``verify_hashes``, another
    sha256), or an unreadable trainer_state.json."""
    directory = Path(directory)
    if not directory.is_dir():
        return "no such folder"
    try:
        marker = json.loads((directory / MARKER).read_text())
        files = marker["files"]
    except FileNotFoundError:
        return f"no {MARKER} (the save did not finish, or it predates completion markers)"
    except (ValueError, KeyError, TypeError) as err:
        return f"unreadable {MARKER} ({err})"
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {entry['bytes']} were written"
        if verify_hashes and _sha256(path) != entry["sha256"]:
            return f"{name} differs from what was written (sha256)"
    try:
        state = json.loads((directory / STATE).read_text())
        iteration = int(state["iteration"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {STATE} ({err})"
    if iteration != marker.get("iteration"):
        return f"{STATE} says iteration {iteration}, {MARKER} {marker.get('iteration')}"
    return None


def read_state(directory: str | Path) -> dict:
    """trainer_state.json of a checkpoint; InputError naming the file when it cannot be read."""
    path = Path(directory) / STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"checkpoint {directory}: cannot read {STATE} ({err}); resume from "
                         f"another checkpoint") from None
    if not isinstance(state, dict) or "iteration" not in state:
        raise InputError(f"checkpoint {directory}: {STATE} has no iteration; resume from "
                         f"another checkpoint")
    return state


def load_checkpoint(directory: str | Path, require_trainable: bool = True,
                    verify_hashes: bool = False) -> dict:
    """Read a checkpoint folder into plain tensors/dicts (no unpickling). ``require_trainable``
    False: a sharded engine's checkpoint, whose weights and optimiser live in ``engine/``. A
    folder with a completion marker is checked against it first: sizes, and with
    ``verify_hashes`` every sha256 (``open_run`` does that once, on the main process, for the
    checkpoint it picks; hashing on every process would read a large checkpoint N times)."""
    directory = Path(directory)
    if (directory / MARKER).is_file():
        problem = checkpoint_problem(directory, verify_hashes=verify_hashes)
        if problem:
            raise InputError(f"checkpoint {directory} is damaged: {problem}; resume from an "
                             f"earlier checkpoint (--resume <its folder>)")
    required = [STATE, "rng.safetensors"]
    if require_trainable:
        required += ["trainable.safetensors", "optimizer.safetensors", "optimizer.json"]
    missing = [name for name in required if not (directory / name).is_file()]
    if missing:
        raise InputError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)}")
    out = {
        "trainable": None, "optimizer": None,
        "state": read_state(directory),
        "rng": load_file(str(directory / "rng.safetensors"))["torch_cpu"],
        "ema": None,
    }
    if (directory / "trainable.safetensors").is_file():
        out["trainable"] = load_file(str(directory / "trainable.safetensors"))
        out["optimizer"] = _optimizer_from_flat(
            load_file(str(directory / "optimizer.safetensors")),
            json.loads((directory / "optimizer.json").read_text()))
    if (directory / "ema.safetensors").is_file():
        out["ema"] = load_file(str(directory / "ema.safetensors"))
    return out


def numbered_checkpoints(run_dir: str | Path) -> list[Path]:
    """The numbered folders under ``run_dir/checkpoints``, complete or not, by iteration."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()),
                  key=lambda p: int(p.name))


def _legacy_readable(directory: Path) -> bool:
    """A checkpoint written before completion markers: usable when its trainer_state.json reads
    and names its own iteration (an empty or torn one, the failure without fsync, does not)."""
    try:
        state = json.loads((directory / STATE).read_text())
        return int(state["iteration"]) == int(directory.name)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run (``checkpoint_problem`` is None), oldest first.

    A run folder none of whose checkpoints has a completion marker was written before markers
    existed: its checkpoints with a readable trainer_state.json are listed instead, so that old
    runs can still be resumed and inspected. Once a folder holds one marked checkpoint, unmarked
    ones are skipped (they are then the remains of something else)."""
    numbered = numbered_checkpoints(run_dir)
    complete = [p for p in numbered if checkpoint_problem(p) is None]
    if complete or any((p / MARKER).exists() for p in numbered):
        return complete
    return [p for p in numbered if _legacy_readable(p)]


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """Read-only: "latest" -> the newest complete checkpoint (InputError when there is none),
    "auto" -> the newest or None, else the given folder (InputError when it does not exist).
    ``open_run`` does this and the run-folder checks; this is for loading a checkpoint alone."""
    if resume in ("latest", "auto"):
        found = list_checkpoints(run_dir)
        if not found and resume == "latest":
            raise InputError(f"--resume latest: {Path(run_dir) / 'checkpoints'} holds no "
                             f"complete checkpoint; start without --resume or with --resume auto")
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise InputError(f"--resume {resume}: no such checkpoint folder (give 'latest', 'auto' or "
                         f"a path to runs/<name>/checkpoints/<iteration>)")
    return path


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (0 = all). Only complete ones count and only
    complete ones go, so the newest complete (and finite: ``Trainer.save`` refuses non-finite
    weights) checkpoint always stays; an incomplete folder is left for the user to look at."""
    if keep <= 0:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        remove_dir(old)
