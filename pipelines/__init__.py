"""Model adapters: one per family, each implementing ``pipelines.base.FlowModel``.

``load_model(family, path_or_hub_id, ...)`` is the one entry point the trainer and the CLIs use.
Families map to their adapter class by dotted path, imported on first use, so listing them
imports nothing heavy.
"""
from __future__ import annotations

import importlib
import os

import torch

from flowgrpo.model import Conditioning, FlowModel

# family -> "module:Class" of its adapter (each class has a ``from_pretrained`` classmethod).
MODEL_FAMILIES: dict[str, str] = {
    "sd3": "pipelines.sd3:SD3Model",
    "flux": "pipelines.flux:FluxModel",
    "flux_kontext": "pipelines.flux_kontext:FluxKontextModel",
    "wan": "pipelines.wan:WanModel",
    "qwen_image": "pipelines.qwen_image:QwenImageModel",
    "qwen_image_edit": "pipelines.qwen_image_edit:QwenImageEditModel",
    "toy": "pipelines.toy:ToyFlowModel",
}

# family -> "module:Class" of its options dataclass (for CLIs that print option help texts).
MODEL_OPTIONS: dict[str, str] = {
    "sd3": "pipelines.sd3:SD3Options",
    "flux": "pipelines.flux:FluxOptions",
    "flux_kontext": "pipelines.flux:FluxOptions",
    "wan": "pipelines.wan:WanOptions",
    "qwen_image": "pipelines.qwen_image:QwenImageOptions",
    "qwen_image_edit": "pipelines.qwen_image:QwenImageOptions",
    "toy": "pipelines.toy:ToyOptions",
}


def _import(dotted: str) -> type:
    module, name = dotted.split(":")
    return getattr(importlib.import_module(module), name)


def model_class(family: str) -> type:
    """The adapter class of ``family``."""
    if family not in MODEL_FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known families are {sorted(MODEL_FAMILIES)}")
    return _import(MODEL_FAMILIES[family])


def options_class(family: str) -> type:
    """The options dataclass of ``family``."""
    if family not in MODEL_OPTIONS:
        raise ValueError(f"unknown model family {family!r}; known families are {sorted(MODEL_OPTIONS)}")
    return _import(MODEL_OPTIONS[family])


def check_model_source(family: str, path_or_hub_id: str | os.PathLike,
                       field: str = "model.path") -> None:
    """One clear ``InputError`` (the model, the likely cause, the fix) when ``family``'s model
    cannot be loaded from ``path_or_hub_id``, before any weights are read
    (``pipelines.base.check_model_source``); the toy family's folders are checked by its loader."""
    model_class(family)            # an unknown family names the known ones
    if family == "toy":
        return
    from pipelines.base import check_model_source as check

    check(path_or_hub_id, family, field)


def load_model(family: str, path_or_hub_id: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", options: dict | None = None) -> FlowModel:
    """Load a ``family`` model from a local diffusers folder or a hub id.

    ``dtype`` is the transformer's compute dtype (text encoders and VAE follow it unless the
    options say otherwise); ``options`` are the family's options dataclass fields as a dict
    (e.g. ``{"height": 512, "width": 512}`` for "sd3"); unknown keys raise ValueError naming the
    valid ones. Everything is validated before any weights are read.
    """
    cls = model_class(family)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (got {dtype!r})")
    return cls.from_pretrained(os.fspath(path_or_hub_id), dtype=dtype, device=device, options=options)


__all__ = ["Conditioning", "FlowModel", "MODEL_FAMILIES", "MODEL_OPTIONS", "check_model_source",
           "load_model", "model_class", "options_class"]
