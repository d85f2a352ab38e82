"""Model adapters: one per family, each implementing ``flowgrpo.model.FlowModel``.

``load_model(family, path_or_hub_id, ...)`` is the one entry point the trainer and the CLIs use.
Families map to their adapter class by dotted path, imported on first use, so listing them
imports nothing heavy. This registry owns the family names and their options:
``check_model_config`` checks a config's ``model.family`` and ``model.options`` at config load.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from flowgrpo.checks import choice
from flowgrpo.dotted import import_dotted
from flowgrpo.errors import ConfigError
from flowgrpo.model import Conditioning, FlowModel
from pipelines.sources import check_model_source as check_diffusers_source
from pipelines.options import parse_options

# family -> "module:Class" of its adapter (each class has a ``from_pretrained`` classmethod and
# its options dataclass as ``options_class``).
MODEL_FAMILIES: dict[str, str] = {
    "sd3": "pipelines.sd3:SD3Model",
    "flux": "pipelines.flux:FluxModel",
    "flux_kontext": "pipelines.flux_kontext:FluxKontextModel",
    "flux2": "pipelines.flux2:Flux2Model",
    "wan": "pipelines.wan:WanModel",
    "wan_i2v": "pipelines.wan_i2v:WanI2VModel",
    "qwen_image": "pipelines.qwen_image:QwenImageModel",
    "qwen_image_edit": "pipelines.qwen_image_edit:QwenImageEditModel",
    "qwen_image_edit_plus": "pipelines.qwen_image_edit_plus:QwenImageEditPlusModel",
    "z_image": "pipelines.z_image:ZImageModel",
    "hunyuan_video": "pipelines.hunyuan_video:HunyuanVideoModel",
    "ltx2": "pipelines.ltx2:LTX2Model",
    "toy": "pipelines.toy:ToyFlowModel",
}

def model_class(family: str) -> type:
    """The adapter class of ``family``."""
    if family not in MODEL_FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known families are {sorted(MODEL_FAMILIES)}")
    return import_dotted(MODEL_FAMILIES[family], "model family")


def options_class(family: str) -> type:
    """The options dataclass of ``family`` (its adapter's ``options_class``)."""
    return model_class(family).options_class


def check_model_source(family: str, path_or_hub_id: str | os.PathLike,
                       field: str = "model.path") -> None:
    """One clear ``InputError`` (the model, the likely cause, the fix) when ``family``'s model
    cannot be loaded from ``path_or_hub_id``, before any weights are read
    (``pipelines.sources.check_model_source``); the toy family's folders are checked by its loader."""
    model_class(family)            # an unknown family names the known ones
    if family == "toy":
        return
    check_diffusers_source(path_or_hub_id, family, field)


def check_model_config(family: str, options: Mapping[str, Any]) -> None:
    """``model.family`` and ``model.options`` of a config, at config load: the family is one of
    ``MODEL_FAMILIES`` and the options parse into its options dataclass (names, types, ranges).
    What needs the checkpoint (sizes against its VAE and patch size, options of one variant
    such as Wan2.2's) is checked when it loads. Raises ConfigError naming the field."""
    choice(family, tuple(MODEL_FAMILIES), "model.family")
    try:
        parse_options(options_class(family), dict(options), family)
    except (TypeError, ValueError) as err:
        message = str(err)   # the options' own messages name "options.<key>"
        raise ConfigError(f"model.{message}" if message.startswith("options.")
                          else f"model.options: {message}") from None


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


__all__ = ["Conditioning", "FlowModel", "MODEL_FAMILIES", "check_model_config",
           "check_model_source", "load_model", "model_class", "options_class"]
