"""Advantages from rewards: group baselines, three scalings, GDPO multi-reward, NaN masking.

Every function takes the batch already gathered across processes, so statistics (means, stds)
are those of the whole batch. A group is the set of samples generated for one prompt; it is
identified by ``group_ids`` (any int64 values, not necessarily contiguous or sorted), never by
the prompt text, so two groups with identical prompts stay apart.

A reward of NaN means "no score": the sample gets advantage 0 and is left out of every statistic.
The maths runs in float64 (the batch is small) and the advantages come back as float32.

Scalings (``scale``), with mean_g and std_g over the valid rewards of the sample's group:

- ``"group"``: (r - mean_g) / (std_g + eps)             Flow-GRPO per-prompt, GRPO, TRL "group"
- ``"batch"``: (r - mean_g) / (std_batch + eps)         Flow-GRPO ``global_std``, TRL "batch"
- ``"none"``:  r - mean_g                               Dr. GRPO, TRL "none"

A group whose valid rewards are all equal (or that has fewer than two of them) carries no
signal: its advantages are exactly 0 under every scaling and it is counted in
``zero_std_fraction``.
"""
from __future__ import annotations

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")
DECOUPLED_MODES = ("gdpo", "sum_then_normalize")
# rewards.aggregation: "weighted_sum" (group-normalise the weighted total), "decoupled" (GDPO:
# ``decoupled_advantages``), "decoupled_sum" (MixGRPO's advantage_aggr: GDPO without the final
# batch normalisation). PER_COMPONENT: those built from each weighted component apart.
REWARD_AGGREGATIONS = ("weighted_sum", "decoupled", "decoupled_sum")
PER_COMPONENT = ("decoupled", "decoupled_sum")


def mask_nonfinite(scores: Tensor) -> tuple[Tensor, int]:
    """``scores`` with +-inf replaced by NaN ("no score") and how many were replaced.

    The one rule for non-finite rewards: an infinite score is as unusable as a missing one (one
    inf makes its group's mean and std inf, every advantage of the batch NaN, and the whole
    update a no-op), so it is masked exactly like NaN: advantage 0, left out of every statistic
    and counted in ``reward/nan_count``."""
    infinite = torch.isinf(scores)
    count = int(infinite.sum())
    if count:
        scores = torch.where(infinite, torch.full_like(scores, float("nan")), scores)
    return scores, count


def _check_common(group_ids: Tensor, batch: int, ddof: int, eps: float, clip: float | None) -> None:
    if group_ids.dim() != 1 or group_ids.shape[0] != batch:
        raise ValueError(f"group_ids must have shape ({batch},) like the rewards "
                         f"(got {tuple(group_ids.shape)})")
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor (got {group_ids.dtype}); "
                        "use torch.long group indices")
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 (population std) or 1 (unbiased std) (got {ddof})")
    if eps < 0:
        raise ValueError(f"eps must be >= 0 (got {eps})")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 or None for no clipping (got {clip})")


def _check_rewards(rewards: Tensor, name: str) -> None:
    if not isinstance(rewards, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(rewards).__name__})")
    if rewards.dim() != 1:
        raise ValueError(f"{name} must have shape (B,) (got {tuple(rewards.shape)})")
    if not rewards.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, NaN marking missing scores "
                        f"(got {rewards.dtype})")


def _masked_std(values: Tensor, valid: Tensor, ddof: int) -> Tensor:
    """Scalar std of ``values`` (B,) over ``valid`` (B,) bool; 0 when fewer than ddof + 1 (and
    fewer than 2) valid values."""
    count = valid.sum()
    mean = torch.where(valid, values, 0).sum() / count.clamp(min=1)
    squares = torch.where(valid, (values - mean) ** 2, 0).sum()
    var = squares / (count - ddof).clamp(min=1)
    return torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))


def _group_statistics(rewards: Tensor, valid: Tensor, group_index: Tensor, num_groups: int,
                      ddof: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group mean, std and "carries no signal" flag over the valid rewards.

    rewards (B,) float64 with anything in invalid slots; valid (B,) bool; group_index (B,) in
    [0, num_groups). Returns mean_g (G,), std_g (G,), zero_std_g (G,) bool. A group is zero-std
    when it has fewer than 2 valid rewards or when they are all equal (max == min, exact, so
    rounding in the mean cannot turn equal rewards into eps-scaled noise).
    """
    filled = torch.where(valid, rewards, 0)
    weight = valid.to(rewards.dtype)
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, group_index, weight)
    total = torch.zeros_like(count).index_add_(0, group_index, filled)
    mean = total / count.clamp(min=1)
    deviation = torch.where(valid, rewards - mean[group_index], 0)
    squares = torch.zeros_like(count).index_add_(0, group_index, deviation ** 2)
    std = (squares / (count - ddof).clamp(min=1)).sqrt()

    valid_index = group_index[valid]
    valid_rewards = rewards[valid]
    high = torch.zeros_like(count).scatter_reduce(0, valid_index, valid_rewards, "amax", include_self=False)
    low = torch.zeros_like(count).scatter_reduce(0, valid_index, valid_rewards, "amin", include_self=False)
    zero_std = (count < 2) | (high == low)
    std = torch.where(zero_std, torch.zeros_like(std), std)
    return mean, std, zero_std


def _advantage_stats(advantages: Tensor, valid: Tensor) -> dict[str, float]:
    """Mean, population std and max |.| of the advantages of the valid samples (0 when none)."""
    if not bool(valid.any()):
        return {"adv_mean": 0.0, "adv_std": 0.0, "adv_abs_max": 0.0}
    kept = advantages[valid].double()
    return {"adv_mean": kept.mean().item(),
            "adv_std": kept.std(correction=0).item(),
            "adv_abs_max": kept.abs().max().item()}


def group_advantages(rewards: Tensor, group_ids: Tensor, *, scale: str = "group", ddof: int = 0,
                     eps: float = 1e-4, clip: float | None = 5.0) -> tuple[Tensor, dict[str, float]]:
    """Group-relative advantages.

    Args:
        rewards: (B,) float, NaN = no score.
        group_ids: (B,) integer group label of each sample (any values).
        scale: ``"group"`` | ``"batch"`` | ``"none"`` (see the module docstring).
        ddof: 0 for the population std (Flow-GRPO), 1 for the unbiased std (DanceGRPO, TRL).
        eps: added to the std before dividing.
        clip: advantages are clamped to [-clip, clip]; None for no clamp (Flow-GRPO uses 5).

    Returns:
        advantages (B,) float32 on the rewards' device, 0 where the reward is NaN or the group
        carries no signal; and stats (python floats):
        ``nan_count`` (NaN rewards), ``num_groups``, ``zero_std_fraction`` (fraction of groups
        whose valid rewards have zero std or number fewer than 2), ``adv_mean``, ``adv_std``
        (population) and ``adv_abs_max`` over the samples with a valid reward, after clipping.
    """
    _check_rewards(rewards, "rewards")
    _check_common(group_ids, rewards.shape[0], ddof, eps, clip)
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES} (got {scale!r})")

    values = rewards.detach().to(torch.float64)
    valid = ~torch.isnan(values)
    unique_ids, group_index = torch.unique(group_ids.to(values.device), return_inverse=True)
    num_groups = unique_ids.shape[0]
    mean_g, std_g, zero_std_g = _group_statistics(values, valid, group_index, num_groups, ddof)

    centred = values - mean_g[group_index]
    if scale == "group":
        advantages = centred / (std_g[group_index] + eps)
    elif scale == "batch":
        advantages = centred / (_masked_std(values, valid, ddof) + eps)
    else:
        advantages = centred
    keep = valid & ~zero_std_g[group_index]
    advantages = torch.where(keep, advantages, torch.zeros_like(advantages))
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    advantages = advantages.to(torch.float32)

    stats = {"nan_count": float((~valid).sum().item()),
             "zero_std_fraction": zero_std_g.double().mean().item() if num_groups else 0.0,
             "num_groups": float(num_groups)}
    stats.update(_advantage_stats(advantages, valid))
    return advantages, stats


def decoupled_advantages(rewards: dict[str, Tensor], weights: dict[str, float], group_ids: Tensor, *,
                         mode: str = "gdpo", ddof: int = 0, eps: float = 1e-4, clip: float | None = 5.0,
                         batch_normalize: bool = True,
                         scale: str = "group") -> tuple[Tensor, dict[str, float]]:
    """Advantages from several named rewards.

    ``mode="gdpo"`` (GDPO): each reward k gets its own group z-score A_k (``scale="group"``
    maths, with reward k's own NaN mask, eps and ddof, no clip); S = sum_k w_k A_k; then, if
    ``batch_normalize``, A = (S - mean_B S) / (std_B S + eps) over the valid samples (std with
    ``ddof``). ``batch_normalize=False`` is MixGRPO's ``advantage_aggr`` (A = S).
    ``mode="sum_then_normalize"`` (Flow-GRPO / TRL multi-reward): total = sum_k w_k r_k, then
    ``group_advantages(total, group_ids, scale=scale, ...)``. ``batch_normalize`` is unused here
    and ``scale`` is only valid in this mode (GDPO's per-reward scaling is fixed to "group").

    A sample with NaN in any component gets advantage 0 and is left out of the batch statistics
    of S (and of the total's statistics). Finally A is clamped to [-clip, clip] when clip is set.

    Args:
        rewards: name -> (B,) float tensor, NaN = no score.
        weights: name -> float, the same names as ``rewards``.
        group_ids: (B,) integer group labels.

    Returns:
        advantages (B,) float32 and stats: ``nan_count`` (samples with any NaN), ``num_groups``,
        ``zero_std_fraction`` (GDPO: groups in which every component has zero std;
        sum_then_normalize: groups whose total has zero std), ``adv_mean``, ``adv_std``,
        ``adv_abs_max``, and for each component ``<name>/nan_count``,
        ``<name>/zero_std_fraction``, ``<name>/mean`` (mean valid reward).
    """
    if mode not in DECOUPLED_MODES:
        raise ValueError(f"mode must be one of {DECOUPLED_MODES} (got {mode!r})")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES} (got {scale!r})")
    if mode == "gdpo" and scale != "group":
        raise ValueError(f"scale={scale!r} only applies to mode='sum_then_normalize'; GDPO z-scores "
                         "each reward per group (use scale='group' or mode='sum_then_normalize')")
    if not rewards:
        raise ValueError("rewards must hold at least one named reward tensor (got an empty dict)")
    if set(rewards) != set(weights):
        raise ValueError(f"weights must have exactly the keys of rewards: missing "
                         f"{sorted(set(rewards) - set(weights))}, unknown {sorted(set(weights) - set(rewards))}")
    names = sorted(rewards)
    for name in names:
        _check_rewards(rewards[name], f"rewards[{name!r}]")
    batch = rewards[names[0]].shape[0]
    for name in names:
        if rewards[name].shape[0] != batch:
            raise ValueError(f"rewards[{name!r}] has {rewards[name].shape[0]} samples but "
                             f"rewards[{names[0]!r}] has {batch}; all components need shape (B,)")
    _check_common(group_ids, batch, ddof, eps, clip)

    device = rewards[names[0]].device
    values = {name: rewards[name].detach().to(device=device, dtype=torch.float64) for name in names}
    valid = torch.ones(batch, dtype=torch.bool, device=device)
    for name in names:
        valid &= ~torch.isnan(values[name])

    stats: dict[str, float] = {}
    if mode == "sum_then_normalize":
        total = sum(float(weights[name]) * values[name] for name in names)
        advantages, total_stats = group_advantages(total, group_ids, scale=scale, ddof=ddof, eps=eps, clip=clip)
        stats.update(total_stats)
        for name in names:
            _, component_stats = group_advantages(values[name], group_ids, scale="group", ddof=ddof,
                                                  eps=eps, clip=None)
            stats.update(_component_stats(name, values[name], component_stats))
        return advantages, stats

    unique_ids, group_index = torch.unique(group_ids.to(device), return_inverse=True)
    combined = torch.zeros(batch, dtype=torch.float64, device=device)
    no_signal = torch.ones(unique_ids.shape[0], dtype=torch.bool, device=device)
    for name in names:
        component, component_stats = group_advantages(values[name], group_ids, scale="group", ddof=ddof,
                                                      eps=eps, clip=None)
        combined += float(weights[name]) * component.to(torch.float64)
        component_valid = ~torch.isnan(values[name])
        _, _, zero_std_g = _group_statistics(values[name], component_valid, group_index,
                                             unique_ids.shape[0], ddof)
        no_signal &= zero_std_g
        stats.update(_component_stats(name, values[name], component_stats))

    if batch_normalize:
        count = valid.sum().clamp(min=1)
        mean = torch.where(valid, combined, 0).sum() / count
        combined = (combined - mean) / (_masked_std(combined, valid, ddof) + eps)
    advantages = torch.where(valid, combined, torch.zeros_like(combined))
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    advantages = advantages.to(torch.float32)

    stats.update({"nan_count": float((~valid).sum().item()),
                  "zero_std_fraction": no_signal.double().mean().item(),
                  "num_groups": float(unique_ids.shape[0])})
    stats.update(_advantage_stats(advantages, valid))
    return advantages, stats


def _component_stats(name: str, values: Tensor, component_stats: dict[str, float]) -> dict[str, float]:
    finite = values[~torch.isnan(values)]
    return {f"{name}/nan_count": component_stats["nan_count"],
            f"{name}/zero_std_fraction": component_stats["zero_std_fraction"],
            f"{name}/mean": finite.mean().item() if finite.numel() else float("nan")}
