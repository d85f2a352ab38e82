"""Small rewards and builders shared by trainer tests (loaded by dotted path, like a user's own)."""
from __future__ import annotations

import torch
from torch import Tensor


class Brightness:
    """Mean pixel value: a smooth, cheap, real reward for learning tests."""

    name = "brightness"

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return media.flatten(1).mean(1).float()


class NaNForFirst:
    """Brightness, but NaN for the first sample of each call (tests NaN masking)."""

    name = "nan_first"

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        out = media.flatten(1).mean(1).float()
        out[0] = float("nan")
        return out
