"""Float media <-> 8-bit pixels, one convention for grids, files, rewards and the reward server:
floats in [0, 1] with channels third-from-last (..., 3, H, W) <-> uint8 (..., H, W, 3), clamped
and rounded to the nearest of the 256 levels (what PNG stores)."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_uint8(media: Tensor) -> np.ndarray:
    """(..., 3, H, W) floats in [0, 1] -> (..., H, W, 3) uint8, clamped and rounded."""
    if media.dim() < 3 or media.shape[-3] != 3:
        raise ValueError(f"media must have shape (..., 3, H, W) (got {tuple(media.shape)})")
    pixels = (media.detach().float().cpu().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    return pixels.movedim(-3, -1).contiguous().numpy()


def from_uint8(pixels: np.ndarray) -> Tensor:
    """(..., H, W, 3) uint8 -> (..., 3, H, W) float32 in [0, 1]."""
    tensor = torch.from_numpy(np.array(pixels, dtype=np.uint8, copy=True)).float() / 255.0
    return tensor.movedim(-1, -3).contiguous()
