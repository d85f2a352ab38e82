"""Checkpoints as users hand them to ``flowgrpo sample | eval | grid``: ``base``, a trainer
checkpoint folder (``pytorch_lora_weights.safetensors`` in the diffusers/PEFT format, or a full
``transformer/``), or a run folder (its newest checkpoint). Resolved, checked against the base
model (family, LoRA modules and shapes) before any weights load, and applied for sampling.
The trainer's own checkpoint format (exact resume) is ``flowgrpo/checkpoint.py``.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from flowgrpo.checkpoint import list_checkpoints

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
LORA_ADAPTER_NAME = "flowgrpo_checkpoint"
BASE = "base"


# ================================================================================ checkpoints
@dataclass
class Checkpoint:
    """A column of a comparison: the base model or a trainer checkpoint.

    kind: "base" (no weights), "lora" (``path/pytorch_lora_weights.safetensors``) or "full"
    (``path/transformer/``, a ``from_pretrained`` folder). label: what grids and reports show."""

    label: str
    kind: str
    path: Path | None = None


def _checkpoint_label(path: Path) -> str:
    if path.parent.name == "checkpoints":
        return f"{path.parent.parent.name}@{path.name}"
    return path.name or str(path)


def resolve_checkpoint(text: str) -> Checkpoint:
    """``base`` (any case), a checkpoint folder, or a run folder (-> its newest checkpoint)."""
    if text.lower() == BASE:
        return Checkpoint(label=BASE, kind="base")
    path = Path(text)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {text} does not exist (give runs/<name>/checkpoints/"
                                f"<iteration>, a run folder, or 'base')")
    if not path.is_dir():
        raise ValueError(f"checkpoint {text} is a file; give the folder that holds "
                         f"{LORA_WEIGHTS_NAME} or transformer/")
    if not (path / LORA_WEIGHTS_NAME).is_file() and not (path / "transformer").is_dir():
        found = list_checkpoints(path)
        if found:
            path = found[-1]
    if (path / LORA_WEIGHTS_NAME).is_file():
        return Checkpoint(label=_checkpoint_label(path), kind="lora", path=path)
    if (path / "transformer" / "config.json").is_file():
        return Checkpoint(label=_checkpoint_label(path), kind="full", path=path)
    raise FileNotFoundError(f"checkpoint {text} holds neither {LORA_WEIGHTS_NAME} (LoRA) nor "
                            f"transformer/config.json (full fine-tune), nor a checkpoints/ folder")


def unique_labels(checkpoints: list[Checkpoint]) -> None:
    """Make labels distinct in place ("x", "x (2)", ...)."""
    seen: dict[str, int] = {}
    for checkpoint in checkpoints:
        count = seen.get(checkpoint.label, 0) + 1
        seen[checkpoint.label] = count
        if count > 1:
            checkpoint.label = f"{checkpoint.label} ({count})"


def run_config(checkpoint: Path) -> tuple[dict, Path] | None:
    """The YAML config of the run a trainer checkpoint belongs to (``runs/<name>/config.yaml``
    for ``runs/<name>/checkpoints/<iteration>``) and its path, or None."""
    if checkpoint.parent.name != "checkpoints":
        return None
    path = checkpoint.parent.parent / "config.yaml"
    if not path.is_file():
        return None
    data = yaml.safe_load(path.read_text())
    return (data, path) if isinstance(data, dict) else None


def declared_family(checkpoint: Path) -> tuple[str, str] | None:
    """(family, source file) the checkpoint's run declares: ``trainer_state.json["family"]``, else
    ``model.family`` of the run's ``config.yaml`` (``runs/<name>/config.yaml``); None if neither."""
    state = checkpoint / "trainer_state.json"
    if state.is_file():
        family = json.loads(state.read_text()).get("family")
        if family:
            return str(family), str(state)
    found = run_config(checkpoint)
    if found is not None:
        family = (found[0].get("model") or {}).get("family")
        if family:
            return str(family), str(found[1])
    return None


def lora_metadata(checkpoint: Path) -> dict | None:
    """The LoraConfig fields (keys prefixed "transformer.", as ``load_lora_adapter`` expects) of a
    checkpoint's LoRA: the file's own adapter metadata, else, for a file saved without it (loaders
    would then assume alpha = rank), rank and alpha from the run's ``config.yaml``
    (``model.lora``) with the target modules read from the keys. None when neither is known."""
    file = checkpoint / LORA_WEIGHTS_NAME
    with safe_open(str(file), framework="pt") as handle:
        raw = (handle.metadata() or {}).get("lora_adapter_metadata")
        ranks = {tuple(handle.get_slice(k).get_shape())[0] for k in handle.keys()
                 if k.endswith(".lora_A.weight")}
    if raw:
        return json.loads(raw)
    found = run_config(checkpoint)
    lora = ((found[0].get("model") or {}).get("lora") or {}) if found else {}
    if not {"rank", "alpha"} <= set(lora) or ranks != {lora["rank"]}:
        return None
    return {"transformer.r": lora["rank"], "transformer.lora_alpha": lora["alpha"],
            "transformer.target_modules": sorted(lora_module_shapes(file))}


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the headers of ``files`` (no tensor data is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def transformer_weight_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """Parameter shapes of a local model folder's ``transformer/`` (headers only); None when the
    model is not a local folder with safetensors weights."""
    folder = Path(os.path.expanduser(model_path)) / "transformer"
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    return safetensors_shapes(files) if files else None


def lora_module_shapes(lora_file: Path) -> dict[str, tuple[int, int]]:
    """Transformer module -> (out_features, in_features) that a diffusers-format LoRA file adapts
    (keys ``transformer.<module>.lora_A.weight`` (r, in) / ``.lora_B.weight`` (out, r))."""
    shapes = safetensors_shapes([lora_file])
    modules: dict[str, list[int]] = {}
    for key, shape in shapes.items():
        match = re.fullmatch(r"transformer\.(.+)\.lora_([AB])\.weight", key)
        if not match or len(shape) != 2:
            continue
        entry = modules.setdefault(match[1], [-1, -1])
        if match[2] == "A":
            entry[1] = shape[1]
        else:
            entry[0] = shape[0]
    return {module: (out, inp) for module, (out, inp) in modules.items()}


def lora_mismatches(lora: dict[str, tuple[int, int]], base: dict[str, tuple[int, ...]]) -> list[str]:
    """Why each LoRA module cannot apply to a transformer with parameter shapes ``base``."""
    problems = []
    for module, (out, inp) in sorted(lora.items()):
        weight = base.get(f"{module}.weight")
        if weight is None:
            problems.append(f"the model has no module {module}")
        elif len(weight) != 2 or (out >= 0 and weight[0] != out) or (inp >= 0 and weight[1] != inp):
            problems.append(f"{module} is {tuple(weight)} in the model but the LoRA adapts "
                            f"({out}, {inp})")
    return problems


def lora_parts(model) -> list[tuple[str, object]]:
    """(LoRA file name, module it loads into) of each part of ``model`` a checkpoint carries:
    the transformer, or what the adapter lists (``model.lora_parts()``; Wan2.2: one file per
    expert)."""
    own = getattr(model, "lora_parts", None)
    return own() if callable(own) else [(LORA_WEIGHTS_NAME, model.transformer)]


def present_lora_parts(model, checkpoint: Checkpoint) -> list[tuple[str, object]]:
    """The ``lora_parts`` whose file the checkpoint holds (an expert that did not train has
    none); the main one must be there (``resolve_checkpoint`` found the checkpoint by it)."""
    parts = lora_parts(model)
    return [parts[0]] + [(name, module) for name, module in parts[1:]
                         if (checkpoint.path / name).is_file()]


def full_parts(model) -> list[tuple[str, object, str]]:
    """(checkpoint sub-folder, owner, attribute) of each module a full fine-tune replaces: the
    transformer, or what the adapter lists (``model.full_parts()``)."""
    own = getattr(model, "full_parts", None)
    return own() if callable(own) else [("transformer", model, "transformer")]


def check_checkpoint(checkpoint: Checkpoint, family: str, model_path: str,
                     model=None) -> None:
    """Raise ValueError if ``checkpoint`` was trained on another family or does not fit the
    model (LoRA modules/shapes, or full weights' names/shapes).

    Before the model loads (``model`` None) the checkpoint's main part is checked against the
    local folder's transformer headers (skipped for hub ids); with the loaded ``model``, every
    part against the module it goes into."""
    if checkpoint.kind == "base":
        return
    declared = declared_family(checkpoint.path)
    if declared is not None and declared[0] != family:
        raise ValueError(f"checkpoint {checkpoint.path} was trained on model family "
                         f"{declared[0]!r} (per {declared[1]}) but --model is {family!r}; pass the "
                         f"model it was trained on")
    if model is None:
        shapes = transformer_weight_shapes(model_path)
        if shapes is None:
            return
        parts = [(LORA_WEIGHTS_NAME if checkpoint.kind == "lora" else "transformer", shapes)]
    elif checkpoint.kind == "lora":
        parts = [(name, module_shapes(module)) for name, module in present_lora_parts(
            model, checkpoint)]
    else:
        parts = [(folder, module_shapes(getattr(owner, attribute)))
                 for folder, owner, attribute in full_parts(model)]
    for name, base_shapes in parts:
        if checkpoint.kind == "lora":
            lora = lora_module_shapes(checkpoint.path / name)
            if not lora:
                raise ValueError(f"checkpoint {checkpoint.path}: {name} holds no transformer "
                                 f"LoRA (keys 'transformer.<module>.lora_A/B.weight')")
            problems = lora_mismatches(lora, base_shapes)
            if problems:
                raise ValueError(f"checkpoint {checkpoint.path} does not fit --model {family}:"
                                 f"{model_path}: {len(problems)} of {len(lora)} LoRA modules of "
                                 f"{name} do not match ({problems[0]}); was it trained on another "
                                 f"model?")
            continue
        files = sorted((checkpoint.path / name).glob("*.safetensors"))
        if not files:
            raise ValueError(f"checkpoint {checkpoint.path}/{name} has no .safetensors weights")
        full = safetensors_shapes(files)
        differ = sorted(k for k in set(full) | set(base_shapes) if full.get(k) != base_shapes.get(k))
        if differ:
            key = differ[0]
            raise ValueError(f"checkpoint {checkpoint.path}/{name} does not fit --model "
                             f"{family}:{model_path}: {len(differ)} parameters differ (e.g. {key}: "
                             f"{full.get(key)} vs {base_shapes.get(key)} in the model)")


def module_shapes(module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.state_dict().items()}


@contextmanager
def checkpoint_applied(model, checkpoint: Checkpoint) -> Iterator[None]:
    """Within the block, ``model`` carries ``checkpoint``'s weights: a LoRA adapter loaded with
    diffusers' ``load_lora_adapter`` (deleted afterwards, leaving the exact base weights; a file
    without adapter metadata gets rank/alpha from its run's config.yaml), or the full fine-tuned
    transformer swapped in for ``model.transformer``."""
    if checkpoint.kind == "base":
        yield
        return
    if checkpoint.kind == "lora":
        metadata = lora_metadata(checkpoint.path)
        if metadata is None:
            warnings.warn(f"checkpoint {checkpoint.path}: the LoRA file has no adapter metadata "
                          f"and no run config.yaml gives model.lora.rank/alpha; loading with "
                          f"alpha = rank", stacklevel=2)
        loaded = []
        try:
            for name, module in present_lora_parts(model, checkpoint):
                if not hasattr(module, "load_lora_adapter"):
                    raise TypeError(f"{type(module).__name__} has no load_lora_adapter; LoRA "
                                    f"checkpoints need a diffusers transformer")
                module.load_lora_adapter(load_file(str(checkpoint.path / name)),
                                         prefix="transformer", adapter_name=LORA_ADAPTER_NAME,
                                         metadata=metadata)
                loaded.append(module)
            yield
        finally:
            for module in loaded:
                module.delete_adapters(LORA_ADAPTER_NAME)
        return
    swapped = []
    try:
        for folder, owner, attribute in full_parts(model):
            live = getattr(owner, attribute)
            full = type(live).from_pretrained(str(checkpoint.path / folder),
                                              torch_dtype=model.dtype)
            model.configure_transformer(full.eval())
            setattr(owner, attribute, full)
            swapped.append((owner, attribute, live))
        yield
    finally:
        for owner, attribute, live in reversed(swapped):
            setattr(owner, attribute, live)
