"""The reward interface and the name registry (DESIGN.md: reward_models/).

A reward maps media to one float per sample; NaN means "no score" and is masked downstream.
Rewards that produce several named scores (e.g. the toy verifier's exact verdict and partial
credit) also implement ``components``; ``MultiReward`` logs each component separately.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class RewardModel(Protocol):
    name: str

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """media: images (B, 3, H, W) or videos (B, F, 3, H, W), float in [0, 1].
        Returns (B,) float32 on CPU; NaN where the sample cannot be scored."""


# name -> "module:Class". Lazy strings so that listing names imports nothing heavy.
REGISTRY: dict[str, str] = {}


def register_reward(name: str) -> Callable[[type], type]:
    """Class decorator: ``@register_reward("jpeg_compressibility")``. Built-in rewards are also
    listed in ``REGISTRY`` by dotted path so they resolve without being imported first."""

    def wrap(cls: type) -> type:
        REGISTRY[name] = f"{cls.__module__}:{cls.__qualname__}"
        cls.name = name
        return cls

    return wrap
