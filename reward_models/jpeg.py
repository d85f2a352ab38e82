"""JPEG (in)compressibility (DDPO's sanity-check rewards).

Encoded size of each image as a JPEG at ``quality`` (95) with Pillow, in kB (1 kB = 1000 bytes).
``jpeg_incompressibility`` = +size (rewards detail/noise), ``jpeg_compressibility`` = -size
(rewards flat, simple images; always <= 0). Prompts are ignored.
"""
from __future__ import annotations

import io

import torch
from PIL import Image
from torch import Tensor

from .base import register_reward
from flowgrpo.pixels import to_uint8


def jpeg_size_kb(media: Tensor, quality: int = 95) -> Tensor:
    """(B, 3, H, W) floats in [0, 1] -> (B,) JPEG sizes in kB (1000 bytes) at ``quality``."""
    sizes = []
    for image in to_uint8(media):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


def _check_quality(quality: int) -> int:
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an int in [1, 100] (got {quality!r})")
    return quality


@register_reward("jpeg_compressibility")
class JpegCompressibilityReward:
    """-(JPEG size in kB): higher = compresses better."""

    def __init__(self, quality: int = 95):
        self.quality = _check_quality(quality)

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return -jpeg_size_kb(media, self.quality)


@register_reward("jpeg_incompressibility")
class JpegIncompressibilityReward:
    """+(JPEG size in kB): higher = compresses worse."""

    def __init__(self, quality: int = 95):
        self.quality = _check_quality(quality)

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return jpeg_size_kb(media, self.quality)
