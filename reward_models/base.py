"""The reward interface and the name registry.

A reward maps media to one float per sample; NaN means "no score" and is masked downstream.
+-inf means the same: ``as_score_vector``, which every reward's output passes through, turns it
into NaN (``mask_nonfinite``).
Rewards that produce several named scores (e.g. the toy verifier's exact verdict and partial
credit) also implement ``components``; ``MultiReward`` logs each component separately.

Optional attributes a reward class may define (all read with ``getattr``, none required):

- ``components(media, prompts, metadata) -> dict[str, Tensor]``: several named (B,) scores;
  ``__call__`` then returns the main one.
- ``main_component: str``: which key of ``components`` equals ``__call__``'s result, so that a
  caller needing both runs the model once.
- ``score_and_components(media, prompts, metadata) -> (Tensor, dict[str, Tensor])``: both at once
  (the remote client has this: one HTTP request returns both).
- ``video_native: bool``: the reward scores videos (B, F, 3, H, W) itself; otherwise
  ``load_reward`` scores each frame as an image and aggregates.
- ``score_gradient(media, prompts, metadata) -> (Tensor, Tensor)``: the main score (B,) and its
  gradient with respect to the media (the media's shape): a differentiable reward, which
  ``sampling.reward_guidance`` (``flowgrpo/guided_sde.py``, Euphonium) can steer rollouts with.
- ``groupwise = True`` with ``score_groups(media, prompts, metadata, group_ids) -> (Tensor,
  dict[str, Tensor])``: the reward compares the members of each group (``reward_models.group``:
  ``win_rate``, ``group_rank``); ``score_with_components`` calls it when given group ids.
"""
from __future__ import annotations

import warnings
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

from flowgrpo.advantages import mask_nonfinite


@runtime_checkable
class RewardModel(Protocol):
    name: str

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """media: images (B, 3, H, W) or videos (B, F, 3, H, W), float in [0, 1].
        Returns (B,) float32 on CPU; NaN where the sample cannot be scored."""


# name -> "module:Class". Lazy strings so that listing names imports nothing heavy.
REGISTRY: dict[str, str] = {
    "aesthetic": "reward_models.aesthetic:AestheticReward",
    "clip_score": "reward_models.clip_score:ClipScoreReward",
    "pickscore": "reward_models.pickscore:PickScoreReward",
    "ocr": "reward_models.ocr:OcrReward",
    "jpeg_compressibility": "reward_models.jpeg:JpegCompressibilityReward",
    "jpeg_incompressibility": "reward_models.jpeg:JpegIncompressibilityReward",
    "hpsv2": "reward_models.adapters:HpsV2Reward",
    "imagereward": "reward_models.adapters:ImageRewardReward",
    "temporal_consistency": "reward_models.temporal:TemporalConsistencyReward",
    "remote": "reward_models.remote:RemoteReward",
    "geneval_toy": "reward_models.geneval_toy:GenevalToyReward",
    "toy_edit": "reward_models.toy_edit:ToyEditReward",
    "toy_artifacts": "reward_models.toy_quality:ToyArtifactsReward",
    "ensemble": "reward_models.ensemble:EnsembleReward",
    "toy_proxy": "reward_models.toy_proxy:ToyProxyReward",
    "win_rate": "reward_models.group:WinRateReward",
    "group_rank": "reward_models.group:GroupRankReward",
}


def register_reward(name: str) -> Callable[[type], type]:
    """Class decorator: ``@register_reward("jpeg_compressibility")``. Built-in rewards are also
    listed in ``REGISTRY`` by dotted path so they resolve without being imported first."""

    def wrap(cls: type) -> type:
        REGISTRY[name] = f"{cls.__module__}:{cls.__qualname__}"
        cls.name = name
        return cls

    return wrap


def is_groupwise(reward) -> bool:
    """Whether a reward scores whole groups (``groupwise = True``), looked up through the
    loader's wrapper (``ManagedReward.inner``)."""
    return bool(getattr(getattr(reward, "inner", reward), "groupwise", False))


def score_with_components(reward, media: Tensor, prompts: list[str],
                          metadata: list[dict], group_ids: Tensor | None = None
                          ) -> tuple[Tensor, dict[str, Tensor]]:
    """The main score (B,) and the named components {key: (B,)} of any reward, running its model
    once where the reward says how (``score_and_components`` or ``main_component``).
    Rewards without ``components`` return an empty dict. ``group_ids`` (B,): a groupwise reward
    scores the groups with ``score_groups`` (other rewards ignore them); without them it gives
    what it says it gives outside a group (``reward_models.group``: NaN and its components)."""
    if group_ids is not None and is_groupwise(reward):
        inner = getattr(reward, "inner", reward)
        name = getattr(reward, "name", type(inner).__name__)
        main, parts = inner.score_groups(media, prompts, metadata, group_ids)
        batch = len(prompts)
        return as_score_vector(main, batch, name), {
            k: as_score_vector(v, batch, f"{name}.{k}") for k, v in parts.items()}
    both = getattr(reward, "score_and_components", None)
    if callable(both):
        main, parts = both(media, prompts, metadata)
        return main, dict(parts)
    components = getattr(reward, "components", None)
    if not callable(components):
        return reward(media, prompts, metadata), {}
    parts = dict(components(media, prompts, metadata))
    main_key = getattr(reward, "main_component", None)
    if main_key is not None:
        if main_key not in parts:
            raise ValueError(f"reward {getattr(reward, 'name', reward)!r}: main_component "
                             f"{main_key!r} is not among its components {sorted(parts)}")
        return parts[main_key], parts
    return reward(media, prompts, metadata), parts


def as_score_vector(values, batch: int, reward_name: str) -> Tensor:
    """Coerce a reward's output (tensor, array or list) to a (batch,) float32 CPU tensor, or raise
    a ValueError naming the reward when the shape is wrong. +-inf become NaN (``mask_nonfinite``)
    with a warning naming the reward: every reward's output passes here (``ManagedReward`` and the
    LM policy's text rewards), so this is where non-finite scores turn into missing ones."""
    scores = torch.as_tensor(values).detach().to(device="cpu", dtype=torch.float32)
    if scores.ndim == 2 and scores.shape[1] == 1:
        scores = scores[:, 0]
    if scores.shape != (batch,):
        raise ValueError(f"reward {reward_name!r} returned shape {tuple(scores.shape)}; "
                         f"expected ({batch},), one score per sample")
    scores, infinite = mask_nonfinite(scores)
    if infinite:
        # No count in the text: Python shows a given warning once per process, not per batch;
        # the per-iteration count is the trainer's reward/nan_count.
        warnings.warn(f"reward {reward_name!r} returned +-inf for some samples; they are "
                      f"treated as missing (NaN): advantage 0, counted in reward/nan_count",
                      RuntimeWarning, stacklevel=2)
    return scores
