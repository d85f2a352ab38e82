"""Adapters for reward packages with their own loaders: HPSv2 (``pip install hpsv2``) and
ImageReward (``pip install image-reward``). They download their own weights on first use.
Without the package, constructing the reward raises an ImportError that names it.
"""
from __future__ import annotations

import importlib

import torch
from PIL import Image
from torch import Tensor

from .base import register_reward
from flowgrpo.pixels import to_uint8


def _require(module: str, pip_name: str, reward: str):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"reward {reward!r} needs the {pip_name} package: "
                          f"pip install {pip_name}") from error


def _as_pil(media: Tensor) -> list[Image.Image]:
    return [Image.fromarray(image) for image in to_uint8(media)]


def _one_float(value) -> float:
    """A package's score for one image (float, 1-element list/array/tensor) as a float."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"expected one score per image (got {len(value)})")
        value = value[0]
    return float(torch.as_tensor(value).reshape(-1)[0])


@register_reward("hpsv2")
class HpsV2Reward:
    """Human Preference Score v2 via ``hpsv2.score(image, prompt, hps_version=...)``."""

    def __init__(self, version: str = "v2.1"):
        if version not in ("v2.0", "v2.1"):
            raise ValueError(f"hpsv2 version must be 'v2.0' or 'v2.1' (got {version!r})")
        self.hpsv2 = _require("hpsv2", "hpsv2", "hpsv2")
        self.version = version

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        scores = [_one_float(self.hpsv2.score(image, prompt, hps_version=self.version))
                  for image, prompt in zip(_as_pil(media), prompts)]
        return torch.tensor(scores, dtype=torch.float32)


@register_reward("imagereward")
class ImageRewardReward:
    """ImageReward via ``ImageReward.load(model, device=...)`` and ``model.score(prompt, image)``."""

    def __init__(self, model: str = "ImageReward-v1.0", device: str | torch.device = "cpu"):
        package = _require("ImageReward", "image-reward", "imagereward")
        self.model = package.load(model, device=str(device))

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        scores = [_one_float(self.model.score(prompt, [image]))
                  for image, prompt in zip(_as_pil(media), prompts)]
        return torch.tensor(scores, dtype=torch.float32)
