"""Policy losses: the clipped surrogate for flow transitions (the LM token loss is
``flowgrpo/token_losses.py``).

Pure functions on tensors; the maths is done in float32 (or float64 when given float64) whatever
the input dtype. Notation: sigma the current noise level, sigma_next the next
(smaller) one, D = sigma - sigma_next > 0, ``mean_d`` the mean over all non-batch dimensions, a
transition x -> x' is Gaussian N(mean, std^2 I) with ``std`` of shape (B,), and ``logp`` is its
log-density averaged over dims (``reduce="mean"`` in ``flowgrpo.sde``).

Flow transitions
    ``policy_loss``            PPO clipped surrogate with per-sample weights
    ``ratio_norm_log_ratio``        GRPO-Guard RatioNorm log-ratio
    ``dt_reweight_step_weights``     GRPO-Guard 1/D gradient reweighting
    ``batch_mean_dt_weights``  GRPO-Guard's released 1/mean_b(sqrt D)^2 loss scale
    ``std_over_sqrt_dt_weights``  Flow-GRPO's Wan loss scale mean_b(s) / mean_b(sqrt D)
    ``noise_aware_weights``    TempFlow-GRPO's step std over the schedule's mean step std
    ``region_policy_loss``     the same per region of the latents (Edit-GRPO's locality)
    ``fixed_region_shares``    its region weights at a fixed edit / rest ratio
    ``signal_region_shares``   its region weights over the regions whose advantage is not 0
    ``rectification_weights``  Flash-GRPO temporal rectification kappa
    ``flow_kl``                KL to the reference policy per dim
    ``region_flow_kl``         the same over a region of the latents (an edit's keep region)
    ``gated_kl``               the KL's mean over the rows a gate lets in (GARDO)
"""
from __future__ import annotations

import torch
from torch import Tensor

# training.kl_convention: which std flow_kl divides by (see flow_kl).
KL_CONVENTIONS = ("exact", "flow_grpo")


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 ratios are too coarse)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_shape(tensor: Tensor, name: str, shape: tuple[int, ...], what: str) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(tensor).__name__})")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {what} = {shape} (got {tuple(tensor.shape)})")


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0 <= clip_low <= 1:
        raise ValueError(f"clip_low must be in [0, 1] so that 1 - clip_low >= 0 (got {clip_low})")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0 (got {clip_high})")


def _mean_over_dims(x: Tensor) -> Tensor:
    """(B, ...) -> (B,): mean over every non-batch dimension."""
    return x.reshape(x.shape[0], -1).mean(dim=1)


def _check_sigmas(sigma: Tensor, sigma_next: Tensor) -> None:
    if sigma.dim() != 1:
        raise ValueError(f"sigma must have shape (B,) (got {tuple(sigma.shape)})")
    _check_shape(sigma_next, "sigma_next", tuple(sigma.shape), "(B,) like sigma")
    if bool((sigma_next >= sigma).any()):
        raise ValueError("sigma_next must be < sigma for every sample (the schedule runs from 1 to 0); "
                         "pass each trained step's own (sigma, sigma_next)")


def policy_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, clip_low: float, clip_high: float, *,
                weights: Tensor | None = None, log_ratio: Tensor | None = None) -> Tensor:
    """PPO clipped surrogate over a batch of transitions.

    ratio r = exp(logp - logp_old), or exp(log_ratio) when ``log_ratio`` is given (e.g. from
    ``ratio_norm_log_ratio``; logp and logp_old are then only checked for shape). Per sample
    l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and

        loss = sum_i w_i l_i / #{i : w_i > 0}      (loss = 0 when every weight is 0)

    i.e. the mean of w l over the rows that count. Rows with w = 0 (padding, masked samples)
    contribute neither value nor gradient, even if their log-ratio is inf/NaN. The weights keep
    their absolute scale (the loss is not divided by sum(w)): a micro-batch often holds a single
    timestep, and a sum(w) normaliser would cancel any per-timestep weight. Normalise weights to
    mean 1 over all the trained (row, step) pairs of an iteration instead (see
    ``dt_reweight_step_weights``). The clip is PPO's: once the ratio has left the range on the side the
    advantage pushes towards, that sample's gradient is exactly 0.

    Args:
        logp, logp_old: (B,) log-probs of the trained transitions under the current and the
            rollout policy (logp_old without gradient).
        advantages: (B,).
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        weights: (B,) >= 0 per-sample weights; default ones.
        log_ratio: (B,) log r to use instead of logp - logp_old.

    Returns the scalar loss. Its diagnostics are ``surrogate_stats`` of the same tensors (the
    trainer computes them once over all replay batches of an update). Shapes are checked here;
    weight values are not (a host sync per call on GPU): rows with w <= 0 are masked, and
    ``check_weights`` rejects negative or non-finite weights once per iteration.
    """
    _check_clip(clip_low, clip_high)
    if logp.dim() != 1:
        raise ValueError(f"logp must have shape (B,) (got {tuple(logp.shape)})")
    batch = (logp.shape[0],)
    _check_shape(logp_old, "logp_old", batch, "(B,) like logp")
    _check_shape(advantages, "advantages", batch, "(B,) like logp")
    dtype = _compute_dtype(logp, logp_old, advantages)
    if log_ratio is None:
        log_ratio = _data(logp, dtype, keep_grad=True) - _data(logp_old, dtype)
    else:
        _check_shape(log_ratio, "log_ratio", batch, "(B,) like logp")
        log_ratio = _data(log_ratio, dtype, keep_grad=True)
    if weights is None:
        weights = torch.ones(batch, dtype=dtype, device=logp.device)
    else:
        _check_shape(weights, "weights", batch, "(B,) like logp")
        weights = _data(weights, dtype)
    advantages = _data(advantages, dtype)

    return _ClippedSurrogate.apply(log_ratio, advantages, weights, clip_low, clip_high)


class _ClippedSurrogate(torch.autograd.Function):
    """The loss of ``policy_loss`` from (B,) log_ratio, advantages, weights (or (B, K) parts of
    rows, ``region_policy_loss``: the count is then of rows with any part weighted), with the
    closed-form gradient

        d loss / d log r_i = -w_i A_i r_i / #{w > 0}   where w_i > 0 and A r <= A clip(r),
                             0                          elsewhere (clipped on the side A pushes).

    Inside the clip range this is the gradient autograd gives the same ops (there A r ==
    A clip(r) and torch.minimum's two halves add up to the unclipped one). Exactly on an edge of
    the range, autograd's clamp passes nothing and the result is half of it; here the ratio has
    not left the range, so the edge keeps the full unclipped gradient. One autograd node instead
    of about ten: the trainer calls this once per replay batch, and at CPU sizes each node costs
    as much as its arithmetic (benchmarks/overhead.py). max(-A r, -A clip r) is computed as
    -min(A r, A clip r). A row with w = 0 gets r = 1 before the surrogate and 0 after it, so an
    inf/NaN log-ratio or advantage there gives neither a NaN value nor a NaN gradient.
    """

    @staticmethod
    def forward(ctx, log_ratio, advantages, weights, clip_low, clip_high):
        kept = weights > 0
        ratio = torch.exp(torch.where(kept, log_ratio, 0.0))
        scaled = advantages * ratio
        scaled_clipped = advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
        # Rows count, not their parts: (B, K) inputs are K parts of each row (region_policy_loss).
        count = (kept if kept.dim() == 1 else kept.any(dim=1)).sum().clamp(min=1)
        per_sample = torch.where(kept, weights * torch.minimum(scaled, scaled_clipped), 0.0)
        active = kept & (scaled <= scaled_clipped)
        ctx.save_for_backward(torch.where(active, -weights * scaled / count, 0.0))
        return -per_sample.sum() / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (gradient,) = ctx.saved_tensors
        return grad * gradient, None, None, None, None


def region_policy_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, shares: Tensor,
                       clip_low: float, clip_high: float, *, weights: Tensor | None = None
                       ) -> Tensor:
    """The clipped surrogate with one advantage per region of the latents (Edit-GRPO's
    locality-preserving signals): the edit reward's advantage where the edit should act, the
    preservation reward's elsewhere.

    Each row's step log-prob is split into K region parts (``sde.region_log_probs``: region
    means of the per-element log-density, shares s_ik summing to 1), each with its own ratio
    r_ik = exp(logp_ik - logp_old_ik), clipped like ``policy_loss``'s, and its own advantage:

        loss = sum_i w_i sum_k s_ik l_ik / #{i : w_i > 0},
        l_ik = max(-A_ik r_ik, -A_ik clip(r_ik, 1 - clip_low, 1 + clip_high))

    At r = 1 the gradient is that of -sum_d A_k(d) l_d / n: each element's log-density is pushed
    by the advantage of its own region (the Gaussian factorises, so this is exact). With every
    mask weight 1 (shares (1, 0)) it is ``policy_loss`` with the first advantage; a part with
    share 0 contributes neither value nor gradient.

    Args:
        logp, logp_old: (B, K) region log-probs under the current and the rollout policy.
        advantages: (B, K) per region; shares: (B, K) >= 0, each row summing to 1.
        weights: (B,) >= 0 per-row weights (step weights, padding), default ones.

    Returns the scalar loss.
    """
    _check_clip(clip_low, clip_high)
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape (B, K) (got {tuple(logp.shape)})")
    shape = tuple(logp.shape)
    _check_shape(logp_old, "logp_old", shape, "(B, K) like logp")
    _check_shape(advantages, "advantages", shape, "(B, K) like logp")
    _check_shape(shares, "shares", shape, "(B, K) like logp")
    dtype = _compute_dtype(logp, logp_old, advantages)
    log_ratio = _data(logp, dtype, keep_grad=True) - _data(logp_old, dtype)
    part_weights = _data(shares, dtype)
    if weights is not None:
        _check_shape(weights, "weights", (shape[0],), "(B,) like logp's rows")
        part_weights = part_weights * _data(weights, dtype)[:, None]
    return _ClippedSurrogate.apply(log_ratio, _data(advantages, dtype), part_weights, clip_low,
                                   clip_high)


def fixed_region_shares(shares: Tensor, edit_weight: float) -> Tensor:
    """Region weights for ``region_policy_loss`` that do not follow the regions' areas
    (``training.locality.edit_weight``), in place of the area shares.

    shares: (B, 2) >= 0, the area shares of ``sde.region_log_probs`` (column 0 the edit region).
    Returns (B, 2): ``(edit_weight, 1 - edit_weight)`` on rows with both regions, and the area
    shares' (1, 0) or (0, 1) on rows with one (so a mask of ones or zeros is still the scalar
    loss). Per element the edit advantage then acts with ``edit_weight / |edit region|`` instead
    of the area weighting's 1 / n: an object of 5% of the image gets 5% of a row's weight under
    the area shares, and 0.5 / 0.05 = 10x that per element with edit_weight 0.5. With Adam only
    the ratio of the two regions' signals matters, not the loss's overall scale.
    """
    if shares.dim() != 2 or shares.shape[1] != 2:
        raise ValueError(f"shares must have shape (B, 2) (got {tuple(shares.shape)})")
    if not 0.0 < edit_weight < 1.0:
        raise ValueError(f"edit_weight must be in (0, 1) (got {edit_weight})")
    both = (shares > 0).all(dim=1, keepdim=True)
    fixed = torch.tensor([edit_weight, 1.0 - edit_weight], dtype=shares.dtype,
                         device=shares.device).expand_as(shares)
    return torch.where(both, fixed, (shares > 0).to(shares.dtype))


def signal_region_shares(shares: Tensor, advantages: Tensor) -> Tensor:
    """Region weights for ``region_policy_loss`` in which a region without signal gives its share
    to the sample's other regions (``training.locality.silent_share: reassign``).

    A part whose advantage is exactly 0 (its reward equal across the group, e.g. the
    preservation score of an edit that never disturbs anything) contributes no gradient whatever
    its share; with area shares it still takes its share of the row, so the row's other region is
    pushed with only its own small area share. Here its share goes to the row's parts with a
    non-zero advantage, in proportion to their shares: the row keeps the gradient direction and
    loses nothing, the live parts weigh what the whole row would. Rows whose parts are all silent,
    or have no live part with a share, keep ``shares`` (they contribute nothing either way).

    shares: (B, K) >= 0, each row summing to 1 (area shares or ``fixed_region_shares``);
    advantages: (B, K) per region. Returns (B, K), each row summing to 1.
    """
    if shares.dim() != 2 or advantages.shape != shares.shape:
        raise ValueError(f"shares and advantages must both have shape (B, K) (got "
                         f"{tuple(shares.shape)} and {tuple(advantages.shape)})")
    live = shares * ((advantages != 0) & (shares > 0)).to(shares.dtype)
    total = live.sum(dim=1, keepdim=True)
    return torch.where(total > 0, live / total.clamp_min(torch.finfo(shares.dtype).tiny), shares)


def _data(tensor: Tensor, dtype: torch.dtype, keep_grad: bool = False) -> Tensor:
    """``tensor`` in ``dtype``, detached unless ``keep_grad``; no op when nothing changes."""
    if not keep_grad and tensor.requires_grad:
        tensor = tensor.detach()
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def check_weights(weights: Tensor) -> None:
    """Raise if any per-sample loss weight is negative (or NaN): one host sync."""
    if not bool((weights >= 0).all()):
        raise ValueError("weights must be >= 0 (a negative weight flips the advantage's sign)")


def surrogate_stats(log_ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
                    weights: Tensor | None = None) -> dict[str, Tensor]:
    """PPO diagnostics of a batch of transitions, detached 0-d tensors over the rows with w > 0.

    log_ratio, advantages, weights: (B,) (weights default ones). Returns ``clip_fraction`` (ratio
    outside [1 - clip_low, 1 + clip_high]), ``clip_fraction_active`` (outside on the side the
    advantage pushes towards, where the gradient is zeroed), ``ratio_mean``, ``ratio_min``,
    ``ratio_max`` and ``approx_kl`` = mean((r - 1) - log r), the k3 estimate of KL(old || new).
    With no row kept: fractions and ``approx_kl`` 0, ratios 1. The trainer calls this once per
    update on the concatenated rows of every replay batch, so min / max / means are over the
    whole update rather than averages of per-batch values.
    """
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        dtype = log_ratio.dtype
        kept = torch.ones_like(log_ratio, dtype=torch.bool) if weights is None else weights > 0
        log_ratio = torch.where(kept, log_ratio, torch.zeros_like(log_ratio))
        advantages = advantages.detach().to(dtype)
        r = torch.exp(log_ratio)
        low, high = r < 1 - clip_low, r > 1 + clip_high
        active = (low & (advantages < 0)) | (high & (advantages > 0))
        count = kept.sum().clamp(min=1).to(dtype)

        def kept_mean(x: Tensor) -> Tensor:
            return torch.where(kept, x.to(dtype), torch.zeros_like(r)).sum() / count

        any_kept = kept.any()
        one = torch.ones((), dtype=dtype, device=r.device)
        return {
            "clip_fraction": kept_mean(low | high),
            "clip_fraction_active": kept_mean(active),
            "ratio_mean": torch.where(any_kept, kept_mean(r), one),
            "ratio_min": torch.where(any_kept, torch.where(kept, r, torch.full_like(r, torch.inf)).min(),
                                     one),
            "ratio_max": torch.where(any_kept, torch.where(kept, r, torch.full_like(r, -torch.inf)).max(),
                                     one),
            "approx_kl": kept_mean((r - 1) - log_ratio),
        }


def ratio_norm_log_ratio(logp: Tensor, logp_old: Tensor, mean: Tensor, mean_old: Tensor,
                         std: Tensor) -> Tensor:
    """GRPO-Guard RatioNorm log-ratio, (B,).

        b = mean_d((mean - mean_old)^2) / (2 std^2)
        log r_hat = (logp - logp_old + b) * std

    With x' = mean_old + std * eps this equals mean_d(eps * (mean - mean_old)): the negative bias
    of the raw log-ratio is removed and its scale no longer depends on the step's std.

    Args:
        logp, logp_old: (B,) mean-over-dims Gaussian log-densities of x' under the current policy
            N(mean, std^2) and the rollout policy N(mean_old, std^2).
        mean: (B, ...) transition mean under the current policy (carries the gradient).
        mean_old: (B, ...) transition mean at rollout time (detached).
        std: (B,) total transition std, > 0.
    """
    if logp.dim() != 1:
        raise ValueError(f"logp must have shape (B,) (got {tuple(logp.shape)})")
    batch = (logp.shape[0],)
    _check_shape(logp_old, "logp_old", batch, "(B,) like logp")
    _check_shape(std, "std", batch, "(B,) like logp")
    if mean.shape[0] != logp.shape[0] or mean.dim() < 2:
        raise ValueError(f"mean must have shape (B, ...) with B = {logp.shape[0]} (got {tuple(mean.shape)})")
    _check_shape(mean_old, "mean_old", tuple(mean.shape), "mean's shape")
    if bool((std <= 0).any()):
        raise ValueError("std must be > 0 for every sample: RatioNorm only applies to stochastic "
                         "transitions (drop ODE steps from the trained steps)")
    dtype = _compute_dtype(logp, logp_old, mean, std)
    std = std.detach().to(dtype)
    bias = _mean_over_dims((mean.to(dtype) - mean_old.detach().to(dtype)) ** 2) / (2 * std ** 2)
    return (logp.to(dtype) - logp_old.detach().to(dtype) + bias) * std


def dt_reweight_step_weights(sigma: Tensor, sigma_next: Tensor, *, normalize: bool = True) -> Tensor:
    """GRPO-Guard gradient reweighting, (B,): w = 1 / D with D = sigma - sigma_next = -dt.

    With ``normalize`` (default) the weights are divided by their mean over the given batch so
    they average 1 and the learning rate keeps its meaning. Normalise over every trained
    (row, step) pair of the iteration, not per micro-batch: when a micro-batch holds a single
    timestep its own mean would turn every weight into 1. So either call this once on all the
    iteration's (sigma, sigma_next) pairs and index the result, or call it per micro-batch with
    ``normalize=False`` and divide by that iteration-wide mean yourself.

    Args:
        sigma, sigma_next: (B,) noise levels of each sample's trained step, sigma_next < sigma.
    """
    _check_sigmas(sigma, sigma_next)
    dtype = _compute_dtype(sigma, sigma_next)
    inverse_step = 1.0 / (sigma.to(dtype) - sigma_next.to(dtype))
    return inverse_step / inverse_step.mean() if normalize else inverse_step


def rectification_weights(sigma: Tensor, sigma_next: Tensor, std: Tensor, *, normalize: bool = True) -> Tensor:
    """Flash-GRPO temporal rectification kappa, (B,), for the Flow-GRPO SDE.

    The Flow-GRPO transition has mean x + [v + s^2/(2 sigma) (x + (1 - sigma) v)] dt and std
    S = s sqrt(D), so d mean / d v = c_v = dt (1 + s^2 (1 - sigma) / (2 sigma)) per element and,
    at x' = mean + S eps, d log pi / d v = c_v eps / S. The magnitude per unit eps is

        |c_v| / S = sqrt(D) / s + s sqrt(D) (1 - sigma) / (2 sigma)

    and kappa = S / |c_v| equalises the gradient scale across timesteps. s is recovered from the
    total std as s = S / sqrt(D). The same formula holds for the DanceGRPO SDE (s = eta), not
    for CPS. With ``normalize`` (default) kappa is divided by its mean over the given batch
    (Flash-GRPO: kappa / mean_batch(kappa)); as for ``dt_reweight_step_weights``, that batch must
    span the iteration's trained timesteps, not one micro-batch of a single timestep.

    Args:
        sigma, sigma_next: (B,) noise levels of each sample's trained step, sigma_next < sigma.
        std: (B,) total transition std S (``Transition.std``), > 0.
    """
    _check_sigmas(sigma, sigma_next)
    _check_shape(std, "std", tuple(sigma.shape), "(B,) like sigma")
    if bool((std <= 0).any()):
        raise ValueError("std must be > 0 for every sample: rectification applies to SDE steps only")
    dtype = _compute_dtype(sigma, sigma_next, std)
    sigma, sigma_next, std = sigma.to(dtype), sigma_next.to(dtype), std.detach().to(dtype)
    step = sigma - sigma_next
    noise_scale = std / step.sqrt()
    grad_magnitude = step.sqrt() / noise_scale + noise_scale * step.sqrt() * (1 - sigma) / (2 * sigma)
    kappa = 1.0 / grad_magnitude
    return kappa / kappa.mean() if normalize else kappa


def batch_mean_dt_weights(sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """GRPO-Guard's released gradient reweighting, (B,): every row of the batch gets
    1 / mean_b(sqrt(D))^2, D = sigma - sigma_next (its loss divides the batch's policy loss by
    ``sqrt_dt.mean() ** 2``). Not normalised: on a batch of one step this is 1/D, the absolute
    scale ``dt_reweight_step_weights`` normalises away.

    Args:
        sigma, sigma_next: (B,) noise levels of each row's trained step, sigma_next < sigma.
    """
    _check_sigmas(sigma, sigma_next)
    dtype = _compute_dtype(sigma, sigma_next)
    root = (sigma.to(dtype) - sigma_next.to(dtype)).sqrt()
    return torch.full_like(root, 1.0) / root.mean().square()


def std_over_sqrt_dt_weights(step_std: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """Flow-GRPO's Wan loss scale, (B,): every row of the batch gets
    mean_b(s) / mean_b(sqrt(D)), s the step's ``std_dev_t`` without sqrt(dt) (``sde.anchor_std``)
    and D = sigma - sigma_next (its Wan loop multiplies the batch's policy loss by
    ``std_dev_t.mean() / sqrt_dt.mean()``). On a batch of one step this is S / D for the step's
    total std S = s sqrt(D).

    Args:
        step_std: (B,) s of each row's step, > 0.
        sigma, sigma_next: (B,) noise levels of each row's trained step, sigma_next < sigma.
    """
    _check_sigmas(sigma, sigma_next)
    _check_shape(step_std, "step_std", tuple(sigma.shape), "(B,) like sigma")
    dtype = _compute_dtype(sigma, sigma_next, step_std)
    root = (sigma.to(dtype) - sigma_next.to(dtype)).sqrt()
    scale = step_std.detach().to(dtype).mean() / root.mean()
    return torch.full_like(root, 1.0) * scale


def noise_aware_weights(step_std: Tensor, schedule_std: Tensor) -> Tensor:
    """TempFlow-GRPO's noise-aware weights, (B,): w = S / mean_k(S_k).

    S is the total std of each row's SDE step (sigma_t sqrt(dt) in the paper; ``Transition.std``)
    and S_k the total std of every step k the schedule trains (TempFlow-GRPO: every step but the
    last). The mean over the schedule, not over a batch, makes the weights a fixed function of
    the step: its reference multiplies each step's clipped surrogate by 2.25 std, 2.25 being 1 /
    the mean step std of SD3.5-M's 10-step schedule at a = 0.7 (about 0.444), so that the weights
    average 1 over the trained steps and the policy loss keeps Flow-GRPO's scale against the KL
    (which it leaves unweighted). Early, noisy steps weigh more; equal stds give 1 everywhere.

    Args:
        step_std: (B,) S of each row's step, >= 0.
        schedule_std: (K,) S_k of the schedule's trained steps, with a mean > 0.
    """
    if step_std.ndim != 1:
        raise ValueError(f"step_std must be (B,) (got shape {tuple(step_std.shape)})")
    if schedule_std.ndim != 1 or schedule_std.numel() == 0:
        raise ValueError(f"schedule_std must be a non-empty (K,) tensor "
                         f"(got shape {tuple(schedule_std.shape)})")
    dtype = _compute_dtype(step_std, schedule_std)
    scale = schedule_std.detach().to(dtype).mean()
    if not bool(scale > 0) or bool((schedule_std < 0).any()) or bool((step_std < 0).any()):
        raise ValueError("noise-aware weights need stds >= 0 whose schedule mean is > 0 (an SDE "
                         "with sampling.noise_level > 0)")
    return step_std.detach().to(dtype) / scale.to(step_std.device)


def flow_kl(mean: Tensor, mean_ref: Tensor, std: Tensor) -> Tensor:
    """KL(N(mean, std^2 I) || N(mean_ref, std^2 I)) divided by the number of dims, (B,):

        mean_d((mean - mean_ref)^2) / (2 std^2)

    Conventions (``KL_CONVENTIONS``, chosen by ``training.kl_convention``): "exact" passes the
    transition's total std S = s sqrt(D), D = sigma - sigma_next; "flow_grpo" passes the anchor's
    ``std_dev_t`` (``sde.anchor_std``: s = S / sqrt(D) for the SDE kinds), which is Flow-GRPO's
    KL loss ``((mean - mean_ref)^2).mean() / (2 std_dev_t^2)``, i.e. the exact KL times D. On
    SD3's 10-step schedule D is 0.04..0.25 at the trained steps, so a beta copied from Flow-GRPO
    is 4..25 times stronger under "exact".

    Args:
        mean: (B, ...) transition mean under the policy (carries the gradient).
        mean_ref: (B, ...) transition mean under the reference policy (detached).
        std: (B,) the std the KL divides by (see above), > 0.
    """
    if mean.dim() < 2:
        raise ValueError(f"mean must have shape (B, ...) (got {tuple(mean.shape)})")
    _check_shape(mean_ref, "mean_ref", tuple(mean.shape), "mean's shape")
    _check_shape(std, "std", (mean.shape[0],), "(B,)")
    dtype = _compute_dtype(mean, std)
    std = std.detach().to(dtype)
    return _mean_over_dims((mean.to(dtype) - mean_ref.detach().to(dtype)) ** 2) / (2 * std ** 2)


def _region_weights(region: Tensor, latents: Tensor, dtype: torch.dtype) -> Tensor:
    """Region weights broadcast to ``latents``' shape, detached, in ``dtype`` on its device;
    ValueError when they do not broadcast or leave [0, 1]."""
    try:
        weights = torch.broadcast_to(region.detach().to(device=latents.device, dtype=dtype),
                                     latents.shape)
    except RuntimeError:
        raise ValueError(f"region shape {tuple(region.shape)} does not broadcast to the latents "
                         f"{tuple(latents.shape)}") from None
    if bool((weights < 0).any()) or bool((weights > 1).any()):
        raise ValueError("region weights must be in [0, 1]")
    return weights


def region_flow_kl(mean: Tensor, mean_ref: Tensor, std: Tensor, region: Tensor) -> Tensor:
    """``flow_kl`` over a region of the latents only, (B,):

        sum_d w_d (mean_d - mean_ref_d)^2 / (2 std^2 sum_d w_d)

    with region weights w_d in [0, 1] (``training.locality.keep_kl_beta``: the preservation
    region, where an edit should leave the image as the reference policy draws it). The
    Gaussian factorises over elements, so this is the KL of the region's elements per element;
    with w = 1 everywhere it is ``flow_kl``. A row with an empty region (sum_d w_d = 0: a
    one-object toy edit has nothing to keep) is 0 and gives no gradient.

    Args:
        mean: (B, ...) transition mean under the policy (carries the gradient).
        mean_ref: (B, ...) under the reference policy (detached).
        std: (B,) the std the KL divides by (``flow_kl``'s conventions), > 0.
        region: weights broadcastable to ``mean`` (e.g. (B, 1, H, W) for (B, C, H, W)).
    """
    if mean.dim() < 2:
        raise ValueError(f"mean must have shape (B, ...) (got {tuple(mean.shape)})")
    _check_shape(mean_ref, "mean_ref", tuple(mean.shape), "mean's shape")
    _check_shape(std, "std", (mean.shape[0],), "(B,)")
    dtype = _compute_dtype(mean, std)
    weights = _region_weights(region, mean, dtype)
    squared = (mean.to(dtype) - mean_ref.detach().to(dtype)) ** 2
    sums = (weights * squared).reshape(mean.shape[0], -1).sum(dim=1)
    sizes = weights.reshape(mean.shape[0], -1).sum(dim=1)
    std = std.detach().to(dtype)
    return sums / (2 * std ** 2 * sizes.clamp(min=torch.finfo(dtype).tiny))


def gated_kl(kl: Tensor, weights: Tensor) -> Tensor:
    """The KL term of a replay batch under GARDO's gate, a scalar:

        sum_i w_i kl_i / #{i : w_i > 0}      (0 when no row is gated in)

    the mean of w kl over the rows the gate lets in (w = 1 in, 0 out), the normaliser
    ``policy_loss`` uses for its rows. With every w = 1 it is kl.mean(), the ungated KL. Rows with
    w = 0 contribute neither value nor gradient (a NaN kl there does not reach the value).

    Args:
        kl: (B,) per-row KL (``flow_kl``), carries the gradient.
        weights: (B,) >= 0 gate weights (detached).
    """
    if kl.dim() != 1:
        raise ValueError(f"kl must have shape (B,) (got {tuple(kl.shape)})")
    _check_shape(weights, "weights", tuple(kl.shape), "(B,) like kl")
    weights = weights.detach().to(device=kl.device, dtype=kl.dtype)
    kept = weights > 0
    total = torch.where(kept, weights * kl, torch.zeros_like(kl)).sum()
    return total / kept.sum().clamp(min=1).to(kl.dtype)


def velocity_anchor(velocity: Tensor, velocity_ref: Tensor) -> Tensor:
    """(B,) mean over non-batch dims of (velocity - velocity_ref)^2, in float32: the
    untrained-step anchoring penalty (``training.anchor_beta``). velocity, velocity_ref (B, ...).
    Zero where the policy predicts what the reference does; its gradient flows into ``velocity``
    only (the reference is a constant)."""
    diff = velocity.float() - velocity_ref.detach().float()
    return diff.pow(2).flatten(1).mean(dim=1)


def source_preserving_target(sample: Tensor, source: Tensor, keep: Tensor) -> Tensor:
    """(B, ...) the clean latents an edit should have produced where it should keep the source:

        keep * source + (1 - keep) * sample

    sample: (B, ...) latents of the policy's own edits (detached); source: (B, ...) latents of
    their source images; keep: preservation weights in [0, 1] broadcastable to them (1 = the
    source must reappear there, ``training.locality.keep_source_beta``). Elsewhere (the edit
    region, and what no region covers) the target is the sample itself."""
    _check_shape(source, "source", tuple(sample.shape), "sample's shape")
    keep = keep.detach().to(sample)
    return keep * source.detach().to(sample) + (1.0 - keep) * sample.detach()


def region_flow_matching(velocity: Tensor, noise: Tensor, target: Tensor, region: Tensor
                         ) -> Tensor:
    """(B,) the flow-matching loss over a region of the latents, per element of the region:

        sum_d w_d (v_d - (noise_d - target_d))^2 / sum_d w_d

    for x_sigma = (1 - sigma) target + sigma noise, where the velocity that carries x_sigma to
    ``target`` is noise - target (``training.locality.keep_source_beta``: the preservation
    region regressed onto the source). With w = 1 everywhere it is the rectified-flow loss's
    per-row mean; a row with an empty region (sum_d w_d = 0) is 0 and gives no gradient, and
    elements with w_d = 0 give none either.

    Args:
        velocity: (B, ...) the policy's velocity at x_sigma (carries the gradient).
        noise, target: (B, ...) the noise and clean latents x_sigma was made of.
        region: weights in [0, 1] broadcastable to ``velocity`` (e.g. (B, 1, H, W)).
    """
    if velocity.dim() < 2:
        raise ValueError(f"velocity must have shape (B, ...) (got {tuple(velocity.shape)})")
    _check_shape(noise, "noise", tuple(velocity.shape), "velocity's shape")
    _check_shape(target, "target", tuple(velocity.shape), "velocity's shape")
    weights = _region_weights(region, velocity, torch.float32)
    residual = velocity.float() - (noise.detach().float() - target.detach().float())
    rows = velocity.shape[0]
    sums = (weights * residual.pow(2)).reshape(rows, -1).sum(dim=1)
    sizes = weights.reshape(rows, -1).sum(dim=1)
    return sums / sizes.clamp(min=torch.finfo(torch.float32).tiny)
