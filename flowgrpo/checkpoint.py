"""Checkpoints: safetensors and JSON only, written to a temp folder and renamed into place.

Layout of ``checkpoints/<iteration>/``::

    pytorch_lora_weights.safetensors  LoRA in diffusers/PEFT format (pipe.load_lora_weights(dir))
    trainable.safetensors             every trainable tensor by parameter name (exact resume)
    optimizer.safetensors + .json     optimiser tensors / hyper-parameters and step counters
    engine/                           under FSDP / DeepSpeed instead of the two above: the
                                      engine's sharded model and optimiser state (its own format,
                                      read back only by ``--resume`` of the same run)
    ema.safetensors                   EMA shadow weights (when enabled)
    rng.safetensors                   torch CPU RNG state
    trainer_state.json                iteration, EMA counters, config name
Nothing is ever unpickled.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


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
                    ema_counters: dict[str, int] | None, save_lora=None, extra: dict | None = None
                    ) -> Path:
    """Write checkpoint ``directory`` atomically. ``save_lora(dir)`` writes the diffusers LoRA file."""
    directory = Path(directory)
    tmp = directory.with_name(f".tmp-{directory.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if optimizer is not None:   # None: a sharded engine saves both in its own format
        save_file({k: v.detach().contiguous().cpu() for k, v in trainable.items()},
                  str(tmp / "trainable.safetensors"))
        opt_tensors, opt_meta = _optimizer_to_flat(optimizer)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(opt_meta))
    if ema_state is not None:
        save_file({k: v.contiguous().cpu() for k, v in ema_state.items()}, str(tmp / "ema.safetensors"))
    save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    if save_lora is not None:
        save_lora(str(tmp))
    state = {"iteration": iteration, "ema": ema_counters, **(extra or {})}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def load_checkpoint(directory: str | Path, require_trainable: bool = True) -> dict:
    """Read a checkpoint folder into plain tensors/dicts (no unpickling). ``require_trainable``
    False: a sharded engine's checkpoint, whose weights and optimiser live in ``engine/``."""
    directory = Path(directory)
    required = ["trainer_state.json", "rng.safetensors"]
    if require_trainable:
        required += ["trainable.safetensors", "optimizer.safetensors", "optimizer.json"]
    missing = [name for name in required if not (directory / name).is_file()]
    if missing:
        raise ValueError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)}")
    out = {
        "trainable": None, "optimizer": None,
        "state": json.loads((directory / "trainer_state.json").read_text()),
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


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.isdigit()
             and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name))


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """``latest`` -> newest checkpoint of the run (None if there is none); else the given folder."""
    if resume == "latest":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"--resume {resume}: no such checkpoint folder (use 'latest' or a path to "
                         f"runs/<name>/checkpoints/<iteration>)")
    return path


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
