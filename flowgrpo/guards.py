"""What the guards against reward hacking need besides their maths (``advantages.py``,
``losses.py``): the feature of the media that diversity is measured in, the check of the reward
keys a guard names once the rewards have loaded, and the per-sample uncertainty the KL gate
ranks. docs/design.md, "Guards against reward hacking"."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from flowgrpo.advantages import win_rate_gap
from flowgrpo.config import TrainConfig, check_reward_key
from flowgrpo.dotted import import_dotted
from flowgrpo.errors import ConfigError


def pixel_features(media: Tensor, size: int = 16) -> Tensor:
    """(B, 3, H, W) images or (B, F, 3, H, W) videos in [0, 1] -> (B, D) float32 CPU features:
    each frame average-pooled to ``size`` x ``size`` (D = 3 size^2, times F for videos). Cheap,
    needs no weights, and two renders that differ only in pixel noise stay close."""
    if media.dim() not in (4, 5):
        raise ValueError(f"media must be (B, 3, H, W) or (B, F, 3, H, W) (got {tuple(media.shape)})")
    frames = media.flatten(0, 1) if media.dim() == 5 else media
    pooled = torch.nn.functional.adaptive_avg_pool2d(frames.float(), (size, size))
    return pooled.reshape(media.shape[0], -1).cpu()


def load_feature_extractor(config: TrainConfig) -> Callable[[Tensor], Tensor]:
    """The diversity feature of ``training.gardo.diversity_features``: ``pixel_features``, or an
    instance of the user's ``package.module:Class`` built with ``diversity_feature_options``."""
    g = config.training.gardo
    if g.diversity_features == "pixels":
        size = g.diversity_feature_size
        return lambda media: pixel_features(media, size)
    try:
        cls = import_dotted(g.diversity_features, "feature")
        extractor = cls(**g.diversity_feature_options)
    except (ImportError, ValueError, TypeError) as err:
        raise ConfigError(f"training.gardo.diversity_features: cannot build "
                          f"{g.diversity_features!r} with diversity_feature_options "
                          f"{g.diversity_feature_options}: {err}") from err
    if not callable(extractor):
        raise ConfigError(f"training.gardo.diversity_features: {g.diversity_features!r} builds "
                          f"an object that is not callable; give a class whose instances map "
                          f"(B, ...) media to (B, D) features")
    return extractor


def media_features(extractor: Callable[[Tensor], Tensor], media: Tensor) -> Tensor:
    """``extractor(media)`` checked to be (B, D) and returned as float32 CPU."""
    with torch.no_grad():
        features = torch.as_tensor(extractor(media)).detach().float().cpu()
    if features.dim() != 2 or features.shape[0] != media.shape[0]:
        raise ValueError(f"training.gardo.diversity_features returned shape "
                         f"{tuple(features.shape)} for {media.shape[0]} samples; it must return "
                         f"(B, D)")
    return features


def check_gate_keys(config: TrainConfig, known: dict[str, tuple[str, ...] | None] | None) -> None:
    """The keys the KL gate names (``kl_gate_key``, ``kl_gate_auxiliary``) must be among the
    reward outputs ``known`` (key -> its component names, None where they are known only once
    the reward loads; ``known`` None: nothing to check yet). Called at config load with what the
    config tells (``config.reward_output_keys``) and again once the rewards load."""
    g = config.training.gardo
    if known is None:
        return
    if g.kl_gate_key:
        check_reward_key(g.kl_gate_key, "training.gardo.kl_gate_key", known)
    for i, key in enumerate(g.kl_gate_auxiliary):
        check_reward_key(key, f"training.gardo.kl_gate_auxiliary[{i}]", known)


def check_guard_keys(config: TrainConfig, reward) -> None:
    """After the rewards load (before the model): ``check_gate_keys`` against the outputs of
    ``reward`` (a ``MultiReward``). A component is checked where the reward declares its
    ``component_names`` (the ensemble does); otherwise it is checked at the first iteration
    (``gate_uncertainty``)."""
    g = config.training.gardo
    if not (g.kl_gate_key or g.kl_gate_auxiliary):
        return
    check_gate_keys(config, loaded_reward_keys(reward))


def loaded_reward_keys(reward) -> dict[str, tuple[str, ...] | None]:
    """The outputs of a loaded ``MultiReward``: key -> its declared components (``None``: a
    reward with components it does not declare, checked when it first scores; ``()``: none),
    plus "total"."""
    known: dict[str, tuple[str, ...] | None] = {"total": ()}
    for key, managed in reward.rewards.items():
        inner = getattr(managed, "inner", managed)
        declared = getattr(inner, "component_names", None)
        if declared is not None:
            known[key] = tuple(declared)
        else:
            known[key] = None if callable(getattr(managed, "components", None)) else ()
    return known


def gate_uncertainty(config: TrainConfig, gathered: dict[str, Tensor]) -> Tensor:
    """(B,) uncertainty the KL gate ranks, from the gathered rewards: the ``kl_gate_key``
    output, or GARDO's win-rate gap of the total against the ``kl_gate_auxiliary`` outputs."""
    g = config.training.gardo
    wanted = [g.kl_gate_key] if g.kl_gate_key else list(g.kl_gate_auxiliary)
    for index, key in enumerate(wanted):
        if key not in gathered:
            field_name = ("training.gardo.kl_gate_key" if g.kl_gate_key
                          else f"training.gardo.kl_gate_auxiliary[{index}]")
            raise ConfigError(f"{field_name}: the rewards output no {key!r}; they output "
                              f"{', '.join(sorted(gathered))}: use one of them")
    if g.kl_gate_key:
        return gathered[g.kl_gate_key]
    return win_rate_gap(gathered["total"], [gathered[key] for key in wanted])
