"""Flow-transition losses: clipped surrogate, GRPO-Guard, Flash-GRPO rectification, KL."""
from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.losses import (check_weights, flow_kl, ratio_norm_log_ratio, dt_reweight_step_weights, policy_loss,
                             rectification_weights, surrogate_stats)

LOG_2PI = math.log(2 * math.pi)


def _gaussian_logp_mean(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """(B,) per-element Gaussian log-density of x under N(mean, std^2), averaged over dims."""
    std = std.view(-1, *([1] * (x.dim() - 1)))
    density = -((x - mean) ** 2) / (2 * std ** 2) - torch.log(std) - 0.5 * LOG_2PI
    return density.flatten(1).mean(dim=1)


# ---------------------------------------------------------------- policy_loss
def loss_and_stats(logp, logp_old, advantages, clip_low, clip_high, weights=None, log_ratio=None):
    """policy_loss and the surrogate_stats of the same tensors (as the trainer pairs them)."""
    loss = policy_loss(logp, logp_old, advantages, clip_low, clip_high, weights=weights,
                       log_ratio=log_ratio)
    ratio = (logp.detach() - logp_old) if log_ratio is None else log_ratio.detach()
    return loss, surrogate_stats(ratio, advantages, clip_low, clip_high, weights)



def test_policy_loss_closed_form():
    logp = torch.tensor([0.0, 0.3, -0.3, 0.05, -0.02])
    logp_old = torch.zeros(5)
    advantages = torch.tensor([1.0, 2.0, -1.5, -1.0, 0.5])
    clip_low, clip_high = 0.1, 0.2
    weights = torch.tensor([1.0, 2.0, 1.0, 0.5, 3.0])
    loss, stats = loss_and_stats(logp, logp_old, advantages, clip_low, clip_high, weights=weights)

    expected_terms, kl = [], []
    for lp, a in zip(logp.tolist(), advantages.tolist()):
        r = math.exp(lp)
        expected_terms.append(max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high)))
        kl.append(r - 1 - lp)
    expected = sum(w * t for w, t in zip(weights.tolist(), expected_terms)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # exp(0.3) > 1.2 and exp(-0.3) < 0.9 are outside the range; both on the side that zeroes the gradient
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)
    assert stats["clip_fraction_active"].item() == pytest.approx(2 / 5)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.3), rel=1e-6)
    assert stats["ratio_min"].item() == pytest.approx(math.exp(-0.3), rel=1e-6)
    assert stats["ratio_mean"].item() == pytest.approx(sum(math.exp(x) for x in logp.tolist()) / 5, rel=1e-6)
    assert stats["approx_kl"].item() == pytest.approx(sum(kl) / 5, rel=1e-5)
    assert not any(v.requires_grad for v in stats.values())


def test_surrogate_stats_over_concatenated_batches_equal_the_whole_batch():
    """The trainer computes the stats once on the concatenated rows of all replay batches: they
    must be those of one policy_loss call on the whole batch, with masked rows left out."""
    gen = torch.Generator().manual_seed(3)
    logp = torch.randn(12, generator=gen) * 0.2
    advantages = torch.randn(12, generator=gen)
    weights = torch.tensor([1.0, 0.0, 2.0] * 4)
    _, whole = loss_and_stats(logp, torch.zeros(12), advantages, 0.1, 0.15, weights=weights)
    parts = [slice(0, 5), slice(5, 7), slice(7, 12)]
    joined = surrogate_stats(torch.cat([logp[p] for p in parts]), torch.cat([advantages[p] for p in parts]),
                             0.1, 0.15, torch.cat([weights[p] for p in parts]))
    for key, value in whole.items():
        torch.testing.assert_close(joined[key], value)
    kept = logp[weights > 0]
    assert joined["ratio_max"].item() == pytest.approx(math.exp(kept.max().item()), rel=1e-6)
    empty = surrogate_stats(logp, advantages, 0.1, 0.1, torch.zeros(12))
    assert {k: v.item() for k, v in empty.items()} == {
        "clip_fraction": 0.0, "clip_fraction_active": 0.0, "ratio_mean": 1.0, "ratio_min": 1.0,
        "ratio_max": 1.0, "approx_kl": 0.0}


def test_surrogate_stats_leave_out_masked_rows():
    """Closed form over the kept rows only: the masked row's huge log-ratio must not count."""
    log_ratio = torch.tensor([0.0, 0.5, -0.5, 10.0])
    advantages = torch.tensor([1.0, 1.0, 1.0, 1.0])
    stats = surrogate_stats(log_ratio, advantages, 0.2, 0.2, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    kept = [0.0, 0.5, -0.5]
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3)
    assert stats["clip_fraction_active"].item() == pytest.approx(1 / 3)   # only r > 1.2 with A > 0
    assert stats["ratio_mean"].item() == pytest.approx(sum(math.exp(x) for x in kept) / 3, rel=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.5), rel=1e-6)
    assert stats["ratio_min"].item() == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert stats["approx_kl"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in kept) / 3, rel=1e-5)


def test_on_policy_gradient_step_increases_logp_of_positive_advantage():
    logp_old = torch.tensor([-1.3, -0.7])
    logp = logp_old.clone().requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0])
    loss, stats = loss_and_stats(logp, logp_old, advantages, 1e-4, 1e-4)
    assert stats["ratio_mean"].item() == 1.0
    loss.backward()
    # d loss / d logp = -A / B at ratio 1
    torch.testing.assert_close(logp.grad, torch.tensor([-0.5, 1.0]))
    stepped = logp.detach() - 0.1 * logp.grad
    assert stepped[0] > logp_old[0] and stepped[1] < logp_old[1]


@pytest.mark.parametrize(
    "log_ratio, advantage, zero_gradient",
    [(0.5, 1.0, True),     # ratio above 1 + clip with A > 0: clipped
     (-0.5, -1.0, True),   # ratio below 1 - clip with A < 0: clipped
     (0.5, -1.0, False),   # above the range but A < 0: the unclipped (worse) term is kept
     (-0.5, 1.0, False),   # below the range but A > 0: kept
     (0.01, 1.0, False)])  # inside the range
def test_clip_zeroes_gradient_only_on_the_pushed_side(log_ratio, advantage, zero_gradient):
    logp = torch.tensor([log_ratio], requires_grad=True)
    loss = policy_loss(logp, torch.zeros(1), torch.tensor([advantage]), 0.2, 0.2)
    loss.backward()
    if zero_gradient:
        assert logp.grad.item() == 0.0
    else:
        assert logp.grad.item() == pytest.approx(-advantage * math.exp(log_ratio), rel=1e-6)


def test_zero_weight_rows_contribute_nothing_even_when_non_finite():
    logp = torch.tensor([0.01, 50_000.0, -0.02], requires_grad=True)     # exp(5e4) overflows
    logp_old = torch.zeros(3)
    advantages = torch.tensor([1.0, float("nan"), -1.0])
    weights = torch.tensor([2.0, 0.0, 1.0])
    loss, stats = loss_and_stats(logp, logp_old, advantages, 0.2, 0.2, weights=weights)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[1].item() == 0.0
    subset = policy_loss(logp.detach()[[0, 2]], logp_old[[0, 2]], advantages[[0, 2]], 0.2, 0.2,
                            weights=weights[[0, 2]])
    assert loss.item() == pytest.approx(subset.item(), rel=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.01), rel=1e-6)


def test_weights_keep_their_scale_across_micro_batches():
    # A micro-batch of one timestep: its weights are all equal, yet they must still scale the loss
    # (a sum(w) normaliser would cancel them and silently disable per-timestep reweighting).
    logp = torch.tensor([0.01, -0.02, 0.03])
    advantages = torch.tensor([1.0, -0.5, 2.0])
    plain = policy_loss(logp, torch.zeros(3), advantages, 0.2, 0.2)
    weighted = policy_loss(logp, torch.zeros(3), advantages, 0.2, 0.2, weights=torch.full((3,), 3.0))
    assert weighted.item() == pytest.approx(3.0 * plain.item(), rel=1e-6)
    empty = policy_loss(logp, torch.zeros(3), advantages, 0.2, 0.2, weights=torch.zeros(3))
    assert empty.item() == 0.0


def test_policy_loss_uses_given_log_ratio():
    logp = torch.zeros(3)
    log_ratio = torch.tensor([0.1, -0.1, 0.0])
    advantages = torch.tensor([1.0, 1.0, 1.0])
    loss, stats = loss_and_stats(logp, logp, advantages, 0.5, 0.5, log_ratio=log_ratio)
    assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.1) + 1) / 3, rel=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.1), rel=1e-6)


def _autograd_surrogate(log_ratio, advantages, weights, clip_low, clip_high):
    """The clipped surrogate as plain autograd ops: the reference for the closed-form gradient."""
    kept = weights > 0
    ratio = torch.exp(torch.where(kept, log_ratio, torch.zeros_like(log_ratio)))
    per_sample = torch.maximum(-advantages * ratio,
                               -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
    per_sample = torch.where(kept, per_sample, torch.zeros_like(per_sample))
    return (weights * per_sample).sum() / kept.sum().clamp(min=1)


def test_policy_loss_closed_form_gradient_equals_autograd():
    """Rows inside the clip range, clipped on either side for either sign of A, A = 0, and a
    zero-weight row with an overflowing log-ratio: value and gradient equal autograd over the
    plain ops. Exactly on an edge of the range the unclipped gradient is kept whole, where
    autograd's clamp/minimum conventions give half of it."""
    clip_low, clip_high = 0.2, 0.3
    log_ratio = torch.tensor([0.0, 0.05, -0.1, 0.5, 0.5, -0.5, -0.5, 0.1, 800.0],
                             dtype=torch.float64)
    advantages = torch.tensor([1.0, -2.0, 0.5, 1.0, -1.0, 1.0, -1.0, 0.0, 1.0],
                              dtype=torch.float64)
    weights = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    ours = log_ratio.clone().requires_grad_()
    reference = log_ratio.clone().requires_grad_()
    loss = policy_loss(ours, torch.zeros_like(log_ratio), advantages, clip_low, clip_high,
                          weights=weights)
    expected = _autograd_surrogate(reference, advantages, weights, clip_low, clip_high)
    loss.backward()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(ours.grad, reference.grad, rtol=1e-12, atol=0)
    # clipped on the side A pushes: exactly 0; the others move
    assert ours.grad[[3, 6]].abs().sum() == 0 and (ours.grad[[4, 5]] != 0).all()
    assert torch.isfinite(ours.grad).all() and ours.grad[-1] == 0
    for edge, advantage in ((1 - clip_low, 1.0), (1 + clip_high, -1.0)):
        at_edge = torch.tensor([math.log(edge)], dtype=torch.float64, requires_grad=True)
        loss = policy_loss(at_edge, torch.zeros(1, dtype=torch.float64),
                              torch.tensor([advantage], dtype=torch.float64), clip_low, clip_high)
        loss.backward()
        assert at_edge.grad.item() == pytest.approx(-advantage * math.exp(at_edge.item()), rel=1e-12)


def test_policy_loss_rejects_bad_arguments():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(x, x, x, -0.1, 0.1)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(2), 0.1, 0.1)
    with pytest.raises(ValueError, match="weights must be >= 0"):
        check_weights(torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="weights must be >= 0"):
        check_weights(torch.tensor([1.0, float("nan"), 1.0]))
    # policy_loss itself checks shapes, not weight values (the trainer checks an iteration's
    # weights once): rows with w <= 0 are masked, not flipped
    loss = policy_loss(x, x, torch.ones(3), 0.1, 0.1, weights=torch.tensor([1.0, -1.0, 1.0]))
    assert loss.item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="weights"):
        policy_loss(x, x, x, 0.1, 0.1, weights=torch.ones(2))


# ---------------------------------------------------------------- GRPO-Guard


def test_guard_log_ratio_equals_noise_projection():
    generator = torch.Generator().manual_seed(0)
    shape = (4, 3, 5, 5)
    mean_old = torch.randn(shape, generator=generator, dtype=torch.float64)
    mean = mean_old + 0.05 * torch.randn(shape, generator=generator, dtype=torch.float64)
    std = torch.tensor([0.7, 0.2, 0.05, 0.01], dtype=torch.float64)
    eps = torch.randn(shape, generator=generator, dtype=torch.float64)
    sample = mean_old + std.view(-1, 1, 1, 1) * eps
    logp = _gaussian_logp_mean(sample, mean, std)
    logp_old = _gaussian_logp_mean(sample, mean_old, std)
    log_ratio = ratio_norm_log_ratio(logp, logp_old, mean, mean_old, std)
    expected = (eps * (mean - mean_old)).flatten(1).mean(dim=1)
    torch.testing.assert_close(log_ratio, expected, rtol=1e-9, atol=1e-12)
    # the raw log-ratio is biased by -b and scaled by 1/std; the guard removes both
    raw = logp - logp_old
    assert not torch.allclose(raw, expected, rtol=1e-2, atol=1e-3)


def test_guard_log_ratio_is_zero_on_policy():
    mean = torch.randn(2, 8)
    std = torch.tensor([0.3, 0.1])
    logp = torch.tensor([-0.2, 0.4])
    assert ratio_norm_log_ratio(logp, logp, mean, mean, std).abs().max().item() == 0.0


def test_guard_step_weights_are_inverse_step_sizes_with_unit_mean():
    sigma = torch.tensor([1.0, 0.96013, 0.46488, 0.27805])
    sigma_next = torch.tensor([0.96013, 0.91335, 0.27805, 0.00893])
    inverse = 1 / (sigma - sigma_next)
    torch.testing.assert_close(dt_reweight_step_weights(sigma, sigma_next, normalize=False), inverse)
    weights = dt_reweight_step_weights(sigma, sigma_next)
    torch.testing.assert_close(weights, inverse / inverse.mean())
    assert weights.mean().item() == pytest.approx(1.0, rel=1e-6)
    with pytest.raises(ValueError, match="sigma_next must be < sigma"):
        dt_reweight_step_weights(sigma_next, sigma)


# ---------------------------------------------------------------- Flash-GRPO rectification


def _flow_sde_logp_grad_wrt_velocity(sigma: float, sigma_next: float, noise_level: float) -> tuple[float, float]:
    """|d log pi / d v| per element at unit noise for the Flow-GRPO SDE, by autograd;
    also returns the transition's total std."""
    sigma_tilde = sigma_next if sigma == 1.0 else sigma
    s = noise_level * math.sqrt(sigma / (1 - sigma_tilde))
    step = sigma - sigma_next
    total_std = s * math.sqrt(step)
    dt = -step
    x = torch.randn(1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    velocity = torch.randn(1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                           requires_grad=True)
    eps_hat = x + (1 - sigma) * velocity
    mean = x + (velocity + s ** 2 / (2 * sigma) * eps_hat) * dt
    sample = (mean + total_std * torch.ones_like(mean)).detach()      # unit noise
    density = -((sample - mean) ** 2) / (2 * total_std ** 2) - math.log(total_std) - 0.5 * LOG_2PI
    (grad,) = torch.autograd.grad(density.sum(), velocity)
    assert torch.allclose(grad, grad[0, 0].expand_as(grad))
    return abs(grad[0, 0].item()), total_std


def test_rectification_weights_are_inverse_autograd_sensitivity():
    sigmas = [1.0, 0.96013, 0.79037, 0.46488, 0.27805]
    sigmas_next = [0.96013, 0.91335, 0.70728, 0.27805, 0.00893]
    noise_level = 0.7
    grads, stds = zip(*(_flow_sde_logp_grad_wrt_velocity(a, b, noise_level) for a, b in zip(sigmas, sigmas_next)))
    sigma = torch.tensor(sigmas, dtype=torch.float64)
    sigma_next = torch.tensor(sigmas_next, dtype=torch.float64)
    std = torch.tensor(stds, dtype=torch.float64)
    kappa = rectification_weights(sigma, sigma_next, std, normalize=False)
    expected = 1 / torch.tensor(grads, dtype=torch.float64)
    torch.testing.assert_close(kappa, expected, rtol=1e-9, atol=0)
    normalised = rectification_weights(sigma, sigma_next, std)
    torch.testing.assert_close(normalised, expected / expected.mean(), rtol=1e-9, atol=0)
    # Flow-GRPO: at step 0 the total std is exactly the noise level
    assert stds[0] == pytest.approx(noise_level)


# ---------------------------------------------------------------- KL


def test_flow_kl_is_gaussian_kl_per_dim():
    generator = torch.Generator().manual_seed(0)
    shape = (3, 2, 4, 4)
    mean = torch.randn(shape, generator=generator, dtype=torch.float64)
    mean_ref = mean + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
    std = torch.tensor([0.5, 0.1, 1.3], dtype=torch.float64)
    kl = flow_kl(mean, mean_ref, std)
    scale = std.view(-1, 1, 1, 1).expand(shape)
    policy = torch.distributions.Independent(torch.distributions.Normal(mean, scale), 3)
    reference = torch.distributions.Independent(torch.distributions.Normal(mean_ref, scale), 3)
    expected = torch.distributions.kl_divergence(policy, reference) / (2 * 4 * 4)
    torch.testing.assert_close(kl, expected)
    assert flow_kl(mean, mean, std).abs().max().item() == 0.0


def test_flow_kl_under_flow_grpo_convention_equals_flow_grpo_formula():
    """Flow-GRPO's KL loss (scripts/train_sd3.py): ((mean - mean_ref)^2).mean(dims) /
    (2 std_dev_t^2) with std_dev_t = sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) a
    from sde_step_with_logprob (sigma_max = the schedule's second sigma). ``flow_kl`` given the
    anchor's std (``sde.anchor_std``) is that formula; the exact convention is it / dt."""
    from flowgrpo.sde import anchor_std, static_shift_sigmas, transition

    sigmas = static_shift_sigmas(10, 3.0).double()
    steps = torch.tensor([0, 3, 8])
    sigma, sigma_next = sigmas[steps], sigmas[steps + 1]
    a = 0.7
    generator = torch.Generator().manual_seed(3)
    mean = torch.randn(3, 16, 8, 8, generator=generator, dtype=torch.float64)
    mean_ref = mean + 0.01 * torch.randn(3, 16, 8, 8, generator=generator, dtype=torch.float64)
    # the anchor's formula, written out
    sigma_max = sigmas[1]
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * a
    anchor = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t ** 2)
    # ours: the transition's total std, turned into the anchor's std_dev_t
    total = transition("flow_sde", torch.zeros(3, 2), torch.zeros(3, 2), sigma, sigma_next,
                       noise_level=a).std.double()
    ours = flow_kl(mean, mean_ref, anchor_std("flow_sde", total, sigma, sigma_next).double())
    torch.testing.assert_close(ours, anchor, rtol=1e-6, atol=0)
    exact = flow_kl(mean, mean_ref, total)
    torch.testing.assert_close(exact * (sigma - sigma_next), anchor, rtol=1e-5, atol=0)
    # a beta copied from Flow-GRPO is 1 / dt stronger under the exact convention: 3.7x (step 8)
    # to 25x (step 0) on the trained steps of SD3's 10-step schedule
    ratio = exact / anchor
    assert ratio[0].item() == pytest.approx(25.1, abs=0.1)
    assert ratio[2].item() == pytest.approx(3.72, abs=0.01)


def test_rectification_kappa_matches_flash_grpo_published_constants():
    """Flash-GRPO's kappa table (scripts/train_wanx2_1_flash.py value_dict: 999 -> 7.4770, ...,
    785 -> 3.7754) is 1 / (sqrt(-dt) / s + s sqrt(-dt) (1 - sigma) / (2 sigma)) with its noise
    s = sigma_min + (sigma_max - sigma_min) sigma on the Wan grid it sampled; our kappa of the
    flash_sde step reproduces every entry."""
    from flowgrpo.sde import shifted_linear_sigmas, transition

    published = {999: 7.4770, 982: 7.0414, 963: 6.6112, 944: 6.1867, 922: 5.7682, 899: 5.3559,
                 874: 4.9502, 847: 4.5513, 817: 4.1596, 785: 3.7754}
    sigmas = shifted_linear_sigmas(20, 3.0, start=0.999)
    sigma, sigma_next = sigmas[:10], sigmas[1:11]
    std = transition("flash_sde", torch.zeros(10, 4), torch.zeros(10, 4), sigma, sigma_next,
                     noise_level=1.0, schedule_bounds=(sigmas[1].item(), sigmas[-1].item())).std
    kappa = rectification_weights(sigma, sigma_next, std, normalize=False)
    timesteps = [int(s * 1000) for s in sigma.tolist()]
    assert timesteps == list(published)
    assert kappa[0].item() == pytest.approx(7.4770, abs=5e-4)
    torch.testing.assert_close(kappa, torch.tensor(list(published.values())), rtol=0, atol=5e-4)
