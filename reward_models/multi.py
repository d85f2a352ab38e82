"""Several rewards at once: every component for logging and GDPO, and their weighted sum.

Output keys: ``<key>`` for each reward's main score, where ``<key>`` is the spec's ``label`` or
else the reward's name (its class's ``name`` attribute, else the registered name, else the class
name for a ``"module:Class"`` path); ``<key>.<component>`` for each named component of rewards that have
``components`` (logged only: not weighted, not in ``weights``); ``"total"`` = sum over rewards of
``weight * main score`` (rewards with weight 0 are left out), NaN for a sample where any weighted
score is NaN or the sum is not finite. Scores of +-inf arrive here as NaN already
(``base.as_score_vector``).

``aggregation`` tells the trainer how to turn this into advantages:
``"weighted_sum"``: group-normalise ``"total"``; ``"decoupled"`` (GDPO): normalise each key of
``weights`` separately, combine with those weights and normalise the sum over the batch;
``"decoupled_sum"`` (MixGRPO's ``advantage_aggr``): the same without the final normalisation
(flowgrpo.advantages.decoupled_advantages).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from flowgrpo.advantages import REWARD_AGGREGATIONS, mask_nonfinite

from .base import is_groupwise, score_with_components
from .loading import ManagedReward, _split_spec, load_reward

AGGREGATIONS = REWARD_AGGREGATIONS   # how the trainer turns the scores into advantages
TOTAL_KEY = "total"


class MultiReward:
    """``MultiReward([{"name": "ocr", "weight": 1.0}, {"name": "aesthetic", "weight": 0.1}])``.

    Each spec is what ``load_reward`` takes plus ``weight`` (float, default 1.0) and ``label``
    (the output key, default the name; needed when one reward appears twice)."""

    def __init__(self, specs: list[dict | str], aggregation: str = "weighted_sum", *,
                 device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
                 load: Callable[[dict | str], Any] | None = None):
        """``load(spec)`` builds one reward (with a ``name``); default ``load_reward`` on
        ``device`` / ``dtype`` (image and video rewards). Text rewards pass
        ``reward_models.text.load_text_reward``."""
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS} (got {aggregation!r})")
        if isinstance(specs, (str, dict)) or not specs:
            raise ValueError("MultiReward needs a non-empty list of reward specs")
        self.aggregation = aggregation
        self.rewards: dict[str, ManagedReward | Any] = {}
        self._weights: dict[str, float] = {}
        for spec in specs:
            name, options = _split_spec(spec)
            weight = options.get("weight", 1.0)
            if not isinstance(weight, (int, float)) or isinstance(weight, bool) \
                    or not math.isfinite(weight):
                raise ValueError(f"reward {name!r}: weight must be a finite number "
                                 f"(got {weight!r})")
            reward = load_reward(spec, device=device, dtype=dtype) if load is None else load(spec)
            key = options.get("label", reward.name)
            if not isinstance(key, str) or not key or "." in key or key == TOTAL_KEY:
                raise ValueError(f"reward key {key!r} must be a non-empty string without '.' "
                                 f"and not {TOTAL_KEY!r}; set 'label' in the spec")
            if key in self.rewards:
                raise ValueError(f"reward {key!r} appears twice; give each a distinct 'label'")
            self.rewards[key] = reward
            self._weights[key] = float(weight)

    @classmethod
    def from_config(cls, specs: list[dict | str], aggregation: str = "weighted_sum", *,
                    device: str | torch.device = "cpu",
                    dtype: torch.dtype | str = torch.float32) -> "MultiReward":
        """From a config's list of specs (e.g. YAML ``rewards: [{name: ocr, weight: 1}]``)."""
        return cls(list(specs), aggregation, device=device, dtype=dtype)

    @property
    def weights(self) -> dict[str, float]:
        """Main-score key -> weight, the inputs of the weighted sum and of GDPO advantages."""
        return dict(self._weights)

    @property
    def name(self) -> str:
        return "+".join(self.rewards)

    @property
    def groupwise(self) -> bool:
        """Whether a reward compares the members of a group (``reward_models.group``): then the
        caller scores whole groups at once and passes their ``group_ids``."""
        return any(is_groupwise(reward) for reward in self.rewards.values())

    def __call__(self, media: Tensor | list[str], prompts: list[str],
                 metadata: list[dict] | None = None,
                 group_ids: Tensor | None = None) -> dict[str, Tensor]:
        """Every reward's main score and components, and ``"total"``; each (B,) float32 CPU.
        ``media``: images / videos, or completions (strings) for text rewards. ``group_ids``
        (B,): each sample's group, for groupwise rewards (whole groups only); without them a
        groupwise reward's main score is NaN (``reward_models.group``)."""
        out: dict[str, Tensor] = {}
        for key, reward in self.rewards.items():
            main, parts = score_with_components(reward, media, prompts, metadata, group_ids)
            out[key] = main
            for part, values in parts.items():
                out[f"{key}.{part}"] = values
        out[TOTAL_KEY] = weighted_total({k: out[k] for k in self._weights}, self._weights)
        return out


def weighted_total(scores: dict[str, Tensor], weights: dict[str, float]) -> Tensor:
    """sum_k w_k * scores[k] over keys with w_k != 0; each (B,) -> (B,). NaN propagates from any
    weighted score; zero-weight scores are skipped so that their NaN does not."""
    keys = [k for k, w in weights.items() if w != 0.0]
    if not keys:
        return torch.zeros_like(next(iter(scores.values())), dtype=torch.float32)
    total = weights[keys[0]] * scores[keys[0]].float()
    for key in keys[1:]:
        total = total + weights[key] * scores[key].float()
    # Finite scores can still overflow float32 in the sum (a large weight times a large score);
    # such a sample has no usable total, like one whose score is missing.
    return mask_nonfinite(total)[0]
