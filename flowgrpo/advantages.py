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
                         batch_normalize: bool = True, scale: str = "group",
                         component_scales: dict[str, Tensor] | None = None
                         ) -> tuple[Tensor, dict[str, float]]:
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

    ``component_scales`` (name -> (B,), e.g. ``saturation_weights``) multiplies each weight per
    sample: w_k becomes w_k * c_{k,i} in S (GDPO) or in the total (sum_then_normalize).

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
    if component_scales is not None and set(component_scales) != set(rewards):
        raise ValueError(f"component_scales must have exactly the keys of rewards (got "
                         f"{sorted(component_scales)}, rewards {names})")

    device = rewards[names[0]].device
    values = {name: rewards[name].detach().to(device=device, dtype=torch.float64) for name in names}

    def weight(name: str) -> float | Tensor:
        if component_scales is None:
            return float(weights[name])
        return float(weights[name]) * component_scales[name].to(device=device, dtype=torch.float64)

    valid = torch.ones(batch, dtype=torch.bool, device=device)
    for name in names:
        valid &= ~torch.isnan(values[name])

    stats: dict[str, float] = {}
    if mode == "sum_then_normalize":
        total = sum(weight(name) * values[name] for name in names)
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
        combined += weight(name) * component.to(torch.float64)
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


def region_advantages(edit_rewards: Tensor, keep_rewards: Tensor, group_ids: Tensor, *,
                      scale: str = "group", ddof: int = 0, eps: float = 1e-4,
                      clip: float | None = 5.0) -> tuple[Tensor, dict[str, float]]:
    """Advantages per region for the locality-preserving loss (Edit-GRPO): column 0 the edit
    objective's (``group_advantages`` of ``edit_rewards``, applied where the edit should act),
    column 1 the preservation objective's (of ``keep_rewards``, applied elsewhere). Each column
    is normalised within the groups on its own, with its own NaN mask and zero-std groups, so a
    group in which every sample kept the source equally well carries no preservation signal.

    Args:
        edit_rewards, keep_rewards: (B,) float, NaN = no score.
        group_ids: (B,) integer group labels.
        scale, ddof, eps, clip: as ``group_advantages``.

    Returns:
        advantages (B, 2) float32, and stats: ``edit/<stat>`` and ``keep/<stat>`` of each
        column's ``group_advantages``, ``zero_std_fraction`` (groups without signal in either
        column) and ``nan_count`` (samples with either reward NaN).
    """
    _check_rewards(edit_rewards, "edit_rewards")
    _check_rewards(keep_rewards, "keep_rewards")
    if keep_rewards.shape != edit_rewards.shape:
        raise ValueError(f"keep_rewards {tuple(keep_rewards.shape)} must have the shape of "
                         f"edit_rewards {tuple(edit_rewards.shape)}")
    edit, edit_stats = group_advantages(edit_rewards, group_ids, scale=scale, ddof=ddof, eps=eps,
                                        clip=clip)
    keep, keep_stats = group_advantages(keep_rewards, group_ids, scale=scale, ddof=ddof, eps=eps,
                                        clip=clip)
    stats = {f"edit/{k}": v for k, v in edit_stats.items()}
    stats.update({f"keep/{k}": v for k, v in keep_stats.items()})
    values = torch.stack([edit_rewards, keep_rewards]).detach().to(torch.float64)
    _, group_index = torch.unique(group_ids.to(values.device), return_inverse=True)
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    silent = torch.ones(num_groups, dtype=torch.bool, device=values.device)
    for column in values:
        valid = ~torch.isnan(column)
        silent &= _group_statistics(column, valid, group_index, num_groups, ddof)[2]
    stats["zero_std_fraction"] = silent.double().mean().item() if num_groups else 0.0
    stats["nan_count"] = float(torch.isnan(values).any(dim=0).sum().item())
    stats["num_groups"] = float(num_groups)
    return torch.stack([edit, keep], dim=1), stats


def _component_stats(name: str, values: Tensor, component_stats: dict[str, float]) -> dict[str, float]:
    finite = values[~torch.isnan(values)]
    return {f"{name}/nan_count": component_stats["nan_count"],
            f"{name}/zero_std_fraction": component_stats["zero_std_fraction"],
            f"{name}/mean": finite.mean().item() if finite.numel() else float("nan")}


# --------------------------------------------------------------------------- guards
# Guards against reward hacking that act on the gathered batch (docs/design.md, "Guards against
# reward hacking"): which samples the KL applies to, diversity-aware amplification, saturation
# weights of reward components. Pure functions; the trainer calls them once per iteration.

def kl_gate_weights(uncertainty: Tensor, fraction: float) -> Tensor:
    """GARDO's gate: the KL applies to the samples whose reward is least trusted.

    k = floor(fraction * B + 1/2) (the nearest integer, halves up); t = the k-th largest
    uncertainty; a sample is gated in (weight 1) when u >= t, else out (weight 0). Ties with
    the k-th value are all gated, so a tie can gate more than k samples; the rule depends only on
    the values (not their order), so every process given the gathered batch agrees. NaN counts
    as the largest uncertainty (a sample whose uncertainty cannot be computed is not trusted).
    ``fraction`` 0 gates nothing; 1 gates every sample (the plain KL).

    Args:
        uncertainty: (B,) float, higher = less trusted.
        fraction: q in [0, 1].

    Returns:
        (B,) float32 of 1.0 (gated) and 0.0 on the uncertainty's device.
    """
    _check_rewards(uncertainty, "uncertainty")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1] (got {fraction})")
    batch = uncertainty.shape[0]
    count = min(batch, int(fraction * batch + 0.5))
    if count == 0:
        return torch.zeros(batch, dtype=torch.float32, device=uncertainty.device)
    values = uncertainty.detach().to(torch.float64)
    values = torch.where(torch.isnan(values), torch.full_like(values, float("inf")), values)
    threshold = torch.topk(values, count).values[-1]
    return (values >= threshold).to(torch.float32)


def win_rate(rewards: Tensor) -> Tensor:
    """Each sample's win rate in the batch: the share of the other valid samples it beats, ties
    counting one half, (B,) float64 in [0, 1]; NaN where the reward is NaN, and 0.5 for a lone
    valid sample."""
    _check_rewards(rewards, "rewards")
    values = rewards.detach().to(torch.float64)
    valid = ~torch.isnan(values)
    others = valid.sum() - 1
    below = (values[None, :] < values[:, None]) & valid[None, :]
    tied = (values[None, :] == values[:, None]) & valid[None, :]
    wins = below.sum(dim=1) + 0.5 * (tied.sum(dim=1) - 1)     # a valid sample ties itself
    rate = torch.where(others > 0, wins / others.clamp(min=1), torch.full_like(values, 0.5))
    return torch.where(valid, rate, torch.full_like(values, float("nan")))


def win_rate_gap(trained: Tensor, auxiliary: list[Tensor]) -> Tensor:
    """GARDO's uncertainty of the trained reward, (B,) float64 in [-1, 1]:

        U_i = winrate(trained)_i - mean_k winrate(auxiliary_k)_i

    over the batch: high when the trained reward ranks a sample far above where the auxiliary
    rewards (models not optimised against) rank it, the signature of a hacked sample. NaN where
    any of the rewards is NaN.

    Args:
        trained: (B,) the reward the advantages come from (the total).
        auxiliary: K >= 1 tensors (B,) of other rewards, e.g. weight-0 components.
    """
    if not auxiliary:
        raise ValueError("auxiliary must hold at least one reward tensor (B,)")
    for index, values in enumerate(auxiliary):
        if values.shape != trained.shape:
            raise ValueError(f"auxiliary[{index}] has shape {tuple(values.shape)}; every reward "
                             f"needs the trained reward's shape {tuple(trained.shape)}")
    auxiliary_rate = torch.stack([win_rate(values) for values in auxiliary]).mean(dim=0)
    return win_rate(trained) - auxiliary_rate


def diversity_weights(features: Tensor, group_ids: Tensor, advantages: Tensor
                      ) -> tuple[Tensor, dict[str, float]]:
    """GARDO's diversity-aware shaping weights: a positive advantage is scaled by how far the
    sample lies from its nearest group neighbour, relative to the group's average.

        d_i = min_{j != i, same group} (1 - cos(f_i, f_j))      (nearest-neighbour distance)
        w_i = d_i / mean_{j in group} d_j    where A_i > 0
        w_i = 1                              where A_i <= 0, the group has one sample, or every
                                             d in it is 0 (identical samples)

    so within a group the weights of its samples average 1 over all members, a positive sample
    more distinct than average is amplified (w > 1) and a near-duplicate is damped (w < 1);
    negative advantages are left alone (GARDO shapes only the samples it rewards). A zero
    feature vector has cosine 0 to every other (distance 1).

    Args:
        features: (B, D) float feature of each sample's media (any feature space).
        group_ids: (B,) integer group labels.
        advantages: (B,) the advantages to be shaped (only their sign is read).

    Returns:
        weights (B,) float32 on the advantages' device, and stats (python floats) over the
        samples with A > 0: ``diversity_weight_mean``, ``diversity_weight_max``,
        ``diversity_amplified_share`` (share with w > 1).
    """
    if features.dim() != 2 or features.shape[0] != advantages.shape[0]:
        raise ValueError(f"features must have shape (B, D) with B = {advantages.shape[0]} "
                         f"(got {tuple(features.shape)})")
    _check_rewards(advantages, "advantages")
    _check_common(group_ids, advantages.shape[0], 0, 0.0, None)
    unit = torch.nn.functional.normalize(features.detach().to(torch.float64), dim=1)
    group_ids = group_ids.to(unit.device)
    nearest = torch.zeros(unit.shape[0], dtype=torch.float64, device=unit.device)
    relative = torch.ones_like(nearest)
    for group in torch.unique(group_ids):
        members = (group_ids == group).nonzero().flatten()
        if members.numel() < 2:
            continue
        block = unit[members]
        distance = (1.0 - block @ block.T).clamp(0.0, 2.0)
        distance.fill_diagonal_(float("inf"))
        closest = distance.min(dim=1).values
        nearest[members] = closest
        average = closest.mean()
        if average > 0:
            relative[members] = closest / average
    positive = (advantages.detach() > 0).to(unit.device)
    weights = torch.where(positive, relative, torch.ones_like(relative)).to(torch.float32)
    shaped = weights[positive]
    stats = {"diversity_weight_mean": shaped.double().mean().item() if shaped.numel() else 1.0,
             "diversity_weight_max": shaped.max().item() if shaped.numel() else 1.0,
             "diversity_amplified_share":
                 (shaped > 1).double().mean().item() if shaped.numel() else 0.0}
    return weights.to(advantages.device), stats


def saturation_weights(rewards: dict[str, Tensor], group_ids: Tensor, *, ratio: float,
                       ddof: int = 0) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Per-group weights of reward components that no longer separate a group (after the idea of
    TaRoS: a saturated component should stop dominating the advantage; the paper's own rule was
    not available, so this is the rule of this code base):

        s_{g,k} = min(1, std_{g,k} / (ratio * std_{B,k}))      (0 when std_{B,k} = 0)

    with std_{g,k} the std of component k's valid values in group g (0 with fewer than two, or
    when they are all equal) and std_{B,k} its std over the whole batch's valid values, both with
    ``ddof``. A component constant within a group gets weight 0 there; a group whose spread is
    at least ``ratio`` times the batch spread keeps the full weight (so with equal spreads and
    ratio <= 1 the weights are the plain ones); in between the weight falls linearly.

    Args:
        rewards: name -> (B,) float, NaN = no score.
        group_ids: (B,) integer group labels.
        ratio: in (0, 1], the share of the batch spread below which a group's weight shrinks.

    Returns:
        name -> (B,) float64 per-sample weight s_{g(i),k}, and stats: ``saturation/<name>/weight``
        (mean over groups) and ``saturation/<name>/zero_share`` (share of groups with s = 0).
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1] (got {ratio})")
    if not rewards:
        raise ValueError("rewards must hold at least one named reward tensor")
    names = sorted(rewards)
    batch = rewards[names[0]].shape[0]
    for name in names:
        _check_rewards(rewards[name], f"rewards[{name!r}]")
        if rewards[name].shape[0] != batch:
            raise ValueError(f"rewards[{name!r}] has {rewards[name].shape[0]} samples but "
                             f"rewards[{names[0]!r}] has {batch}; all components need shape (B,)")
    _check_common(group_ids, batch, ddof, 0.0, None)
    device = rewards[names[0]].device
    unique_ids, group_index = torch.unique(group_ids.to(device), return_inverse=True)
    weights: dict[str, Tensor] = {}
    stats: dict[str, float] = {}
    for name in names:
        values = rewards[name].detach().to(torch.float64)
        valid = ~torch.isnan(values)
        _, std_g, _ = _group_statistics(values, valid, group_index, unique_ids.shape[0], ddof)
        std_batch = _masked_std(values, valid, ddof)
        per_group = torch.where(std_batch > 0,
                                (std_g / (ratio * std_batch)).clamp(max=1.0),
                                torch.zeros_like(std_g))
        weights[name] = per_group[group_index]
        stats[f"saturation/{name}/weight"] = per_group.mean().item()
        stats[f"saturation/{name}/zero_share"] = (per_group == 0).double().mean().item()
    return weights, stats
