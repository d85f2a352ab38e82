"""Rewards for tests/test_reliability.py (loaded by dotted path, like a user's own)."""
from __future__ import annotations

from typing import Any

from torch import Tensor


class InfAndNaNByPrompt:
    """Brightness, except in the groups of two prompts: the first two rows of a call whose prompt
    contains "inf" score +inf and -inf, the first row whose prompt contains "nan" scores NaN
    (one call is one group when rollout_batch_size == group_size). Other prompts score their
    brightness."""

    name = "inf_nan"

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        out = media.flatten(1).mean(1).float()
        bad = {"inf": [float("inf"), float("-inf")], "nan": [float("nan")]}
        for row, prompt in enumerate(prompts):
            for key, values in bad.items():
                if key in prompt and values:
                    out[row] = values.pop(0)
        return out


class BrightnessWithOptions:
    """Brightness that takes any options (so a config can carry secret-named ones)."""

    name = "brightness_options"

    def __init__(self, **options: Any) -> None:
        self.options = options

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return media.flatten(1).mean(1).float()
