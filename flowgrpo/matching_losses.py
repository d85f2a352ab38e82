"""Losses of the algorithms that train on final samples instead of denoising transitions.

DiffusionNFT, AWM, DGPO and Diffusion-DPO keep only each rollout's final sample x0 (and its
reward). At update time they re-noise x0 by the forward process at a noise level sigma,

    x_sigma = (1 - sigma) x0 + sigma eps,        target velocity  v* = eps - x0,

and compare the policy's velocity there with v* (the flow-matching regression of pretraining)
or with another policy's velocity. Pure functions on tensors, float32 maths (float64 when given
float64). Shapes: B rows, ``...`` the latents' own dimensions, ``mean_d`` the mean over them.

    ``noised_latents``         x_sigma and v* from (x0, eps, sigma)
    ``velocity_error``         mean_d (v - v*)^2 per row: the flow-matching (DSM) error
    ``nft_reward_weight``      DiffusionNFT's r = clip(A / A_max / 2 + 1/2, 0, 1)
    ``nft_loss``               DiffusionNFT's implicit positive / negative policy loss per row
    ``awm_log_prob``           AWM's weighted negative matching error (its "log-prob")
    ``dgpo_loss``              DGPO's group preference loss
    ``diffusion_dpo_loss``     Diffusion-DPO's pairwise loss per pair
    ``gdro_implicit_rewards``  GDRO's implicit reward of each sample
    ``gdro_loss``              GDRO's listwise loss per group (cross-entropy or Plackett-Luce)
    ``old_policy_decay``       the ramped EMA decay of the "old" policy (DiffusionNFT, DGPO)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")


def _dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _per_row(sigma: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, ..., 1) broadcastable to ``like``."""
    if sigma.dim() != 1 or sigma.shape[0] != like.shape[0]:
        raise ValueError(f"sigma must have shape (B,) = ({like.shape[0]},) "
                         f"(got {tuple(sigma.shape)})")
    return sigma.reshape(-1, *([1] * (like.dim() - 1)))


def _mean_d(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], -1).mean(dim=1)


def noised_latents(clean: Tensor, noise: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
    """The forward process at ``sigma``: (x_sigma, v*) with x_sigma = (1 - sigma) x0 + sigma eps
    and v* = eps - x0, the velocity a flow-matching model regresses onto.

    clean, noise: (B, ...); sigma: (B,) in [0, 1]. Returns two (B, ...) tensors in the compute
    dtype."""
    if noise.shape != clean.shape:
        raise ValueError(f"noise must have the shape of clean {tuple(clean.shape)} "
                         f"(got {tuple(noise.shape)})")
    dtype = _dtype(clean, noise, sigma)
    clean, noise = clean.to(dtype), noise.to(dtype)
    s = _per_row(sigma.to(dtype), clean)
    return (1.0 - s) * clean + s * noise, noise - clean


def velocity_error(velocity: Tensor, target: Tensor) -> Tensor:
    """(B,) mean_d (v - v*)^2: the flow-matching error of each row (DGPO's and Diffusion-DPO's
    "DSM loss"; also the velocity KL between two policies, v* the other one's velocity)."""
    if velocity.shape != target.shape:
        raise ValueError(f"velocity {tuple(velocity.shape)} and target {tuple(target.shape)} "
                         f"must have the same shape")
    dtype = _dtype(velocity, target)
    return _mean_d((velocity.to(dtype) - target.to(dtype)) ** 2)


def nft_reward_weight(advantages: Tensor, adv_max: float) -> Tensor:
    """DiffusionNFT's optimality weight r in [0, 1], (B,): the advantage clipped to
    [-adv_max, adv_max] and mapped linearly, r = clip(A / adv_max / 2 + 1/2, 0, 1): +adv_max
    -> 1 (only the positive policy), -adv_max -> 0 (only the negative one), 0 -> 1/2."""
    if adv_max <= 0:
        raise ValueError(f"adv_max must be > 0 (got {adv_max})")
    clipped = advantages.clamp(-adv_max, adv_max)
    return (clipped / adv_max / 2.0 + 0.5).clamp(0.0, 1.0)


def _x0_space_error(x0_prediction: Tensor, clean: Tensor) -> Tensor:
    """(B,) mean_d (x0_hat - x0)^2 / w with DiffusionNFT's adaptive weight
    w = max(mean_d |x0_hat - x0|, 1e-5), detached (computed in float64 as in the reference)."""
    with torch.no_grad():
        weight = (x0_prediction.detach().double() - clean.double()).abs()
        weight = _mean_d(weight).clamp(min=1e-5).to(x0_prediction.dtype)
    return _mean_d((x0_prediction - clean) ** 2) / weight


def nft_loss(velocity: Tensor, velocity_old: Tensor, latents: Tensor, clean: Tensor,
             sigma: Tensor, reward_weight: Tensor, beta: float, adv_max: float) -> Tensor:
    """DiffusionNFT's policy loss of each row, (B,).

    With the implicit policies v+ = beta v + (1 - beta) v_old (positive) and
    v- = (1 + beta) v_old - beta v (negative), their x0 predictions x0(v) = x_sigma - sigma v, and
    the adaptive weight of ``_x0_space_error`` (detached, so each term has the gradient of a
    per-row normalised squared error):

        l = adv_max * [ r err(x0(v+)) + (1 - r) err(x0(v-)) ] / beta

    (the reference scales by adv_max and divides by beta). At r = 1/2 (a zero advantage) the
    gradient vanishes at v = v_old; at r = 1 the loss is minimal where v+ is the target, i.e.
    v = v_old + (v* - v_old) / beta.

    velocity: (B, ...) the policy's v at x_sigma (with grad); velocity_old: the old policy's
    (no grad); latents: x_sigma; clean: x0; sigma: (B,); reward_weight: (B,) r of
    ``nft_reward_weight``; beta > 0; adv_max > 0.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (got {beta})")
    for name, tensor in (("velocity_old", velocity_old), ("latents", latents), ("clean", clean)):
        if tensor.shape != velocity.shape:
            raise ValueError(f"{name} must have the velocity's shape {tuple(velocity.shape)} "
                             f"(got {tuple(tensor.shape)})")
    dtype = _dtype(velocity, latents, clean)
    v, v_old = velocity.to(dtype), velocity_old.detach().to(dtype)
    x_t, x0 = latents.to(dtype), clean.to(dtype)
    s = _per_row(sigma.to(dtype), x0)
    positive = beta * v + (1.0 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v
    r = reward_weight.to(dtype)
    loss = (r * _x0_space_error(x_t - s * positive, x0)
            + (1.0 - r) * _x0_space_error(x_t - s * negative, x0)) / beta
    return adv_max * loss


def awm_log_prob(velocity: Tensor, target: Tensor, sigma: Tensor, weighting: str = "uniform",
                 power: float = 0.25) -> Tensor:
    """AWM's per-row "log-prob" of a sample at one noise level, (B,): minus its flow-matching
    error e = mean_d (v - v*)^2, weighted by the noise level (Flow-Factory's weightings):

        uniform  -e            t   -sigma e           t2  -sigma^2 e
        huber    -sigma (sqrt(e + 1e-10) - 1e-5)
        ghuber   -sigma ((e + 1e-10)^p - 1e-10^p) / p       (p = ``power``)

    Used as log pi in the clipped surrogate, its gradient at ratio 1 is the advantage-weighted
    flow-matching gradient: AWM is pretraining's loss on the policy's own samples, weighted by
    their advantages. Computed in float64 as in the reference."""
    error = velocity_error(velocity.double(), target.double())
    t = sigma.double()
    if weighting == "uniform":
        out = -error
    elif weighting == "t":
        out = -error * t
    elif weighting == "t2":
        out = -error * t ** 2
    elif weighting == "huber":
        out = -(torch.sqrt(error + 1e-10) - 1e-5) * t
    elif weighting == "ghuber":
        if power <= 0:
            raise ValueError(f"power must be > 0 (got {power})")
        out = -((error + 1e-10) ** power - 1e-10 ** power) * t / power
    else:
        raise ValueError(f"weighting must be one of {AWM_WEIGHTINGS} (got {weighting!r})")
    return out.to(_dtype(velocity, target))


def dgpo_loss(error: Tensor, error_ref: Tensor, advantages: Tensor, group_index: Tensor,
              beta: float, group_size: int, weights: Tensor | None = None) -> Tensor:
    """DGPO's group preference loss, a scalar.

    Per group g, the detached preference argument z_g = beta / G sum_{i in g} A_i (e_i - e_ref_i)
    (e the policy's flow-matching error of sample i, e_ref the reference's at the same x_sigma,
    G = ``group_size``), and

        loss = sum_i w_i sigmoid(z_g(i)) A_i e_i / #{w > 0}     (sigmoid detached)

    For one group of G rows this has the gradient (1/beta) d/dtheta [-log sigmoid(-z)]: a DPO
    of the whole group in which samples with positive advantage should have the lower error.

    error: (B,) with grad; error_ref: (B,) no grad; advantages: (B,); group_index: (B,) int64
    group of each row (any labels); weights: (B,) >= 0 (default ones; 0 masks a row from the
    loss, not from its group's z)."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (got {beta})")
    for name, tensor in (("error_ref", error_ref), ("advantages", advantages),
                         ("group_index", group_index)):
        if tensor.shape != error.shape or error.dim() != 1:
            raise ValueError(f"{name} must have shape (B,) like error {tuple(error.shape)} "
                             f"(got {tuple(tensor.shape)})")
    dtype = _dtype(error, error_ref)
    adv = advantages.to(dtype)
    with torch.no_grad():
        labels, inverse = torch.unique(group_index, return_inverse=True)
        terms = adv * beta * (error.detach().to(dtype) - error_ref.to(dtype)) / group_size
        sums = torch.zeros(len(labels), dtype=dtype, device=error.device)
        sums.index_add_(0, inverse.to(error.device), terms)
        gate = torch.sigmoid(sums)[inverse.to(error.device)]
    if weights is None:
        weights = torch.ones_like(adv)
    weights = weights.to(dtype)
    count = (weights > 0).sum().clamp(min=1)
    return (weights * gate * adv * error.to(dtype)).sum() / count


def diffusion_dpo_loss(error_chosen: Tensor, error_rejected: Tensor, error_ref_chosen: Tensor,
                       error_ref_rejected: Tensor, beta: float) -> Tensor:
    """Diffusion-DPO's loss of each pair, (P,):

        -log sigmoid(-beta / 2 [(e_w - e_ref_w) - (e_l - e_ref_l)])

    (e the flow-matching errors of the chosen w and rejected l sample at the same sigma and
    noise). log 2 when the policy equals the reference; lower when the policy's error drops on
    the chosen sample relative to the rejected one."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (got {beta})")
    shape = error_chosen.shape
    for tensor in (error_rejected, error_ref_chosen, error_ref_rejected):
        if tensor.shape != shape:
            raise ValueError(f"the four errors must share one shape (P,) (got "
                             f"{tuple(shape)} and {tuple(tensor.shape)})")
    dtype = _dtype(error_chosen, error_rejected)
    margin = ((error_chosen.to(dtype) - error_ref_chosen.to(dtype))
              - (error_rejected.to(dtype) - error_ref_rejected.to(dtype)))
    return -F.logsigmoid(-0.5 * beta * margin)


GDRO_LOSSES = ("cross_entropy", "plackett_luce")


def gdro_implicit_rewards(error: Tensor, error_ref: Tensor, beta: float) -> Tensor:
    """GDRO's implicit reward of each sample, (B,): s = -beta (e - e_ref), e = mean_d (v_theta -
    v*)^2 and e_ref = mean_d (v_ref - v*)^2 at the same x_sigma (the Diffusion-DPO log-ratio
    surrogate of one sample). 0 while the policy is the reference; up when the policy's error on
    the sample drops below the reference's."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (got {beta})")
    if error.shape != error_ref.shape or error.dim() != 1:
        raise ValueError(f"error and error_ref must share one shape (B,) (got "
                         f"{tuple(error.shape)} and {tuple(error_ref.shape)})")
    dtype = _dtype(error, error_ref)
    return -beta * (error.to(dtype) - error_ref.to(dtype))


def gdro_loss(implicit: Tensor, rewards: Tensor, valid: Tensor, tau: float,
              form: str = "cross_entropy") -> Tensor:
    """GDRO's listwise loss of each group, (N,), from the implicit rewards of its members.

    implicit: (N, G) implicit rewards s (``gdro_implicit_rewards``) of the N groups' G members;
    rewards: (N, G) their explicit rewards; valid: (N, G) bool, the members that take part (a
    member with a non-finite reward does not). Over the valid members of a group:

        cross_entropy   -sum_i p_i log softmax(s)_i,   p = softmax(r / tau)
        plackett_luce   -sum_k [s_pi(k) - log sum_{j >= k} exp s_pi(j)]

    with pi the members ordered by reward, best first (ties in row order). At s = 0 (the policy
    is the reference) the cross-entropy is log n and the Plackett-Luce loss log n! for n valid
    members; Plackett-Luce depends on the rewards only through their order (tau unused). A group
    with fewer than 2 valid members gives 0."""
    if form not in GDRO_LOSSES:
        raise ValueError(f"form must be one of {GDRO_LOSSES} (got {form!r})")
    if implicit.dim() != 2 or rewards.shape != implicit.shape or valid.shape != implicit.shape:
        raise ValueError(f"implicit, rewards and valid must share one shape (N, G) (got "
                         f"{tuple(implicit.shape)}, {tuple(rewards.shape)}, {tuple(valid.shape)})")
    if form == "cross_entropy" and tau <= 0:
        raise ValueError(f"tau must be > 0 (got {tau})")
    dtype = _dtype(implicit)
    s = implicit.to(dtype)
    valid = valid.to(torch.bool) & torch.isfinite(rewards)
    # a finite stand-in for -inf: exp underflows to 0, and no inf - inf makes a NaN gradient
    blocked = torch.tensor(torch.finfo(dtype).min / 4, dtype=dtype, device=s.device)
    if form == "cross_entropy":
        r = torch.where(valid, rewards.to(dtype), torch.zeros((), dtype=dtype, device=s.device))
        target = torch.softmax(torch.where(valid, r / tau, blocked), dim=1)
        log_q = torch.log_softmax(torch.where(valid, s, blocked), dim=1)
        terms = torch.where(valid, target * log_q, torch.zeros_like(s))
        loss = -terms.sum(dim=1)
    else:
        # best first; invalid members last (their terms are dropped)
        key = torch.where(valid, rewards.to(dtype), blocked)
        order = torch.sort(key, dim=1, descending=True, stable=True).indices
        s_sorted = torch.gather(torch.where(valid, s, blocked), 1, order)
        keep = torch.gather(valid, 1, order)
        # log sum_{j >= k} exp s_pi(j): a cumulative logsumexp from the end
        tails = torch.logcumsumexp(s_sorted.flip(1), dim=1).flip(1)
        terms = torch.where(keep, tails - s_sorted, torch.zeros_like(s_sorted))
        loss = terms.sum(dim=1)
    enough = valid.sum(dim=1) >= 2
    return torch.where(enough, loss, torch.zeros_like(loss))


def old_policy_decay(step: int, flat_steps: int, ramp_rate: float, max_decay: float) -> float:
    """The EMA decay of the "old" policy after ``step`` optimiser steps: 0 for the first
    ``flat_steps`` steps (old = the current policy), then min((step - flat_steps) * ramp_rate,
    max_decay). old <- decay old + (1 - decay) current. DiffusionNFT's schedules are (0, 0.001,
    0.5) and (75, 0.0075, 0.999); DGPO's is (0, 0.001, 0.3)."""
    if step < flat_steps:
        return 0.0
    return min((step - flat_steps) * ramp_rate, max_decay)


def logit_normal_sigmas(count: int, low: float, high: float, generator: torch.Generator
                        ) -> Tensor:
    """(count,) noise levels sigmoid(N(0, 1)) mapped into [low, high] (SD3's training density)."""
    return low + (high - low) * torch.sigmoid(torch.randn(count, generator=generator))


def discrete_sigma_choices(schedule: Tensor, fraction: float) -> Tensor:
    """The rollout schedule's noise levels a discrete draw picks from: the first
    max(1, round(N * fraction)) of its N non-zero levels (fraction 1: every step the sampler
    visited; 0.5: the noisier half)."""
    levels = schedule[:-1]
    count = max(1, int(math.floor(len(levels) * fraction + 1e-9)))
    return levels[:count]
