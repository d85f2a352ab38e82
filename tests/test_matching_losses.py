"""Closed-form checks of the sample-based algorithms' maths (flowgrpo/matching_losses.py) and of
the noise levels and old policy they share (flowgrpo/algorithms/base.py)."""
from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.algorithms.base import OldPolicy, draw_sigmas, unit_noise
from flowgrpo.matching_losses import (awm_log_prob, dgpo_loss, diffusion_dpo_loss,
                                      discrete_sigma_choices, nft_loss, nft_reward_weight,
                                      noised_latents, old_policy_decay, velocity_error)


def test_forward_process_ends_and_target():
    clean, noise = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    x, target = noised_latents(clean, noise, torch.tensor([0.0, 1.0, 0.25]))
    assert torch.equal(x[0], clean[0]) and torch.equal(x[1], noise[1])
    assert torch.allclose(x[2], 0.75 * clean[2] + 0.25 * noise[2])
    assert torch.equal(target, noise - clean)
    # x0 is recovered exactly from the target velocity: x0 = x - sigma v*
    assert torch.allclose(x[2] - 0.25 * target[2], clean[2], atol=1e-6)


def test_nft_reward_weight_mapping():
    adv = torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0])
    r = nft_reward_weight(adv, 5.0)
    assert torch.allclose(r, torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]))
    with pytest.raises(ValueError, match="adv_max"):
        nft_reward_weight(adv, 0.0)


def _nft_scalar(v, v_old, x0, eps, sigma, r, beta, adv_max=5.0):
    """The NFT loss of one row whose latents are one scalar (shape (1, 1))."""
    s = torch.tensor([sigma], dtype=torch.float64)
    x, _ = noised_latents(torch.tensor([[x0]], dtype=torch.float64),
                          torch.tensor([[eps]], dtype=torch.float64), s)
    return nft_loss(v.view(1, 1), torch.tensor([[v_old]], dtype=torch.float64), x,
                    torch.tensor([[x0]], dtype=torch.float64), s,
                    torch.tensor([r], dtype=torch.float64), beta, adv_max)[0]


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_positive_only_minimiser(beta):
    """r = 1: the loss is zero, with zero gradient, exactly where the positive policy
    beta v + (1 - beta) v_old is the target velocity eps - x0, i.e. v = v_old + (v* - v_old) / beta,
    and positive elsewhere with a gradient pointing towards it."""
    x0, eps, sigma, v_old = 0.3, -1.2, 0.6, 0.4
    v_star = eps - x0
    v_min = v_old + (v_star - v_old) / beta
    at = torch.tensor(v_min, dtype=torch.float64, requires_grad=True)
    loss = _nft_scalar(at, v_old, x0, eps, sigma, 1.0, beta)
    loss.backward()
    assert abs(float(loss.detach())) < 1e-12 and abs(float(at.grad)) < 1e-9
    for offset in (-0.5, 0.7):
        v = torch.tensor(v_min + offset, dtype=torch.float64, requires_grad=True)
        loss = _nft_scalar(v, v_old, x0, eps, sigma, 1.0, beta)
        loss.backward()
        assert float(loss.detach()) > 0 and math.copysign(1, float(v.grad)) == math.copysign(1, offset)


def test_nft_zero_advantage_is_stationary_at_the_old_policy():
    """r = 1/2 (advantage 0): at v = v_old both implicit policies are v_old, their weights are
    equal, and the positive and negative gradients cancel: a zero-advantage sample does not move
    the policy away from the old one."""
    v = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    _nft_scalar(v, 0.4, 0.3, -1.2, 0.6, 0.5, 1.0).backward()
    assert abs(float(v.grad)) < 1e-12
    # a negative advantage pushes v away from the target: the gradient sign flips with r
    grads = []
    for r in (0.9, 0.1):
        v = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
        _nft_scalar(v, 0.4, 0.3, -1.2, 0.6, r, 1.0).backward()
        grads.append(float(v.grad))
    assert grads[0] > 0 > grads[1]   # v* = -1.5 < v_old: a good sample pulls v down


def test_nft_loss_scale_follows_the_reference():
    """l = adv_max (r err+ + (1 - r) err-) / beta with err = mean_d (x0_hat - x0)^2 / mean_d
    |x0_hat - x0|: checked on random tensors against the formula written out."""
    g = torch.Generator().manual_seed(0)
    shape = (4, 3, 5)
    v, v_old, x0, eps = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    sigma = torch.tensor([0.9, 0.5, 0.2, 0.7], dtype=torch.float64)
    r = torch.tensor([0.0, 0.3, 0.5, 1.0], dtype=torch.float64)
    x, _ = noised_latents(x0, eps, sigma)
    beta, adv_max = 0.1, 5.0
    got = nft_loss(v, v_old, x, x0, sigma, r, beta, adv_max)
    s = sigma.view(-1, 1, 1)
    expected = []
    for prediction, share in ((beta * v + (1 - beta) * v_old, r),
                              ((1 + beta) * v_old - beta * v, 1 - r)):
        diff = x - s * prediction - x0
        expected.append(share * (diff ** 2).mean(dim=(1, 2)) / diff.abs().mean(dim=(1, 2)))
    assert torch.allclose(got, adv_max * (expected[0] + expected[1]) / beta, rtol=1e-12)


def test_awm_weightings():
    v, target = torch.tensor([[1.0, 3.0], [0.0, 0.0]]), torch.tensor([[0.0, 1.0], [0.0, 2.0]])
    sigma = torch.tensor([0.5, 0.25])
    error = velocity_error(v, target)
    assert torch.allclose(error, torch.tensor([2.5, 2.0]))
    assert torch.allclose(awm_log_prob(v, target, sigma, "uniform"), -error)
    assert torch.allclose(awm_log_prob(v, target, sigma, "t"), -error * sigma)
    assert torch.allclose(awm_log_prob(v, target, sigma, "t2"), -error * sigma ** 2)
    assert torch.allclose(awm_log_prob(v, target, sigma, "huber"),
                          -(error.sqrt() - 1e-5) * sigma, atol=1e-6)
    # ghuber with p = 1 is the t weighting; with p = 1/2 twice the huber one
    assert torch.allclose(awm_log_prob(v, target, sigma, "ghuber", 1.0), -error * sigma)
    assert torch.allclose(awm_log_prob(v, target, sigma, "ghuber", 0.5),
                          -2 * error.sqrt() * sigma, atol=1e-4)
    # a perfect prediction has log-prob 0 under every weighting (the offsets cancel exactly)
    for kind in ("ghuber", "huber"):
        at_zero = awm_log_prob(target, target, sigma, kind, 0.25)
        assert torch.allclose(at_zero, torch.zeros(2), atol=2e-5), kind
    with pytest.raises(ValueError, match="weighting"):
        awm_log_prob(v, target, sigma, "nope")


def test_dgpo_gradient_is_the_group_dpo_gradient():
    """For one group the loss's gradient equals (1/beta) d/dtheta [-log sigmoid(-z)] with
    z = beta / G sum_i A_i (e_i - e_ref_i), z taken with gradient."""
    g = torch.Generator().manual_seed(1)
    group_size, beta = 4, 7.0
    theta = torch.randn(group_size, 6, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(group_size, 6, generator=g, dtype=torch.float64)
    error_ref = torch.rand(group_size, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.2, -0.4, 0.3, -1.1], dtype=torch.float64)
    error = velocity_error(theta, target)
    loss = dgpo_loss(error, error_ref, adv, torch.zeros(group_size, dtype=torch.long), beta,
                     group_size)
    (grad,) = torch.autograd.grad(loss, theta)
    error = velocity_error(theta, target)
    z = beta / group_size * (adv * (error - error_ref)).sum()
    (expected,) = torch.autograd.grad(-torch.nn.functional.logsigmoid(-z) / beta, theta)
    assert torch.allclose(grad, expected, rtol=1e-10, atol=1e-14)


def test_dgpo_groups_are_independent_and_weights_mask():
    """Two groups in one batch: each row's gate is its own group's sigmoid(z_g); a zero weight
    removes a row from the loss (not from its group's z)."""
    error = torch.tensor([1.0, 2.0, 0.5, 0.25], dtype=torch.float64)
    error_ref = torch.tensor([1.5, 1.0, 0.5, 0.75], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.float64)
    groups = torch.tensor([3, 3, 8, 8])
    z = torch.tensor([2.0 / 2 * (1 * -0.5 + -1 * 1.0), 2.0 / 2 * (2 * 0.0 + -2 * -0.5)],
                     dtype=torch.float64)
    gate = torch.sigmoid(z)[[0, 0, 1, 1]]
    got = dgpo_loss(error, error_ref, adv, groups, 2.0, 2)
    assert torch.allclose(got, (gate * adv * error).mean())
    weights = torch.tensor([1.0, 0.0, 1.0, 1.0])
    got = dgpo_loss(error, error_ref, adv, groups, 2.0, 2, weights=weights)
    assert torch.allclose(got, (gate * adv * error * weights.double()).sum() / 3)


def test_diffusion_dpo_is_log2_at_the_reference_and_prefers_the_chosen():
    errors = torch.tensor([0.7, 1.3])
    loss = diffusion_dpo_loss(errors, errors.flip(0), errors, errors.flip(0), 100.0)
    assert torch.allclose(loss, torch.full((2,), math.log(2.0)))
    chosen = torch.tensor([0.5], requires_grad=True)
    loss = diffusion_dpo_loss(chosen, torch.tensor([0.9]), torch.tensor([0.6]),
                              torch.tensor([0.9]), 10.0)
    # margin = (0.5 - 0.6) - 0 = -0.1: -log sigmoid(0.5) < log 2
    assert torch.allclose(loss, -torch.nn.functional.logsigmoid(torch.tensor([0.5])))
    loss.sum().backward()
    assert float(chosen.grad) > 0     # lowering the chosen error lowers the loss


def test_old_policy_decay_schedules():
    assert old_policy_decay(0, 0, 0.001, 0.5) == 0.0
    assert old_policy_decay(100, 0, 0.001, 0.5) == pytest.approx(0.1)
    assert old_policy_decay(1000, 0, 0.001, 0.5) == 0.5
    assert old_policy_decay(74, 75, 0.0075, 0.999) == 0.0
    assert old_policy_decay(100, 75, 0.0075, 0.999) == pytest.approx(0.1875)
    assert old_policy_decay(10 ** 6, 75, 0.0075, 0.999) == 0.999


def test_old_policy_ema_and_swap():
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    old = OldPolicy({"w": param}, 0, 0.25, 0.5)
    with torch.no_grad():
        param.copy_(torch.tensor([3.0, 6.0]))
    assert old.update(1) == 0.25     # old = 0.25 * [1, 2] + 0.75 * [3, 6]
    assert torch.allclose(old.weights["w"], torch.tensor([2.5, 5.0]))
    live = param.data.data_ptr()
    with old.swapped_in():
        assert torch.equal(param, torch.tensor([2.5, 5.0]))
    assert param.data.data_ptr() == live and torch.equal(param, torch.tensor([3.0, 6.0]))
    restored = OldPolicy({"w": param}, 0, 0.25, 0.5)
    restored.load_state_dict(old.state_dict())
    assert torch.equal(restored.weights["w"], old.weights["w"])


def test_discrete_sigma_draws():
    schedule = torch.linspace(1.0, 0.0, 11)
    assert torch.equal(discrete_sigma_choices(schedule, 0.5), schedule[:5])
    g = torch.Generator().manual_seed(0)
    drawn = draw_sigmas(schedule, 4, "discrete", 0.5, g)
    assert len(set(drawn.tolist())) == 4 and all(0.6 - 1e-6 <= s <= 1.0 for s in drawn.tolist())
    # more levels than choices: every choice once before any repeats
    drawn = draw_sigmas(schedule, 7, "discrete", 0.5, torch.Generator().manual_seed(0))
    assert sorted(drawn[:5].tolist()) == sorted(schedule[:5].tolist())
    for kind in ("uniform", "logit_normal"):
        drawn = draw_sigmas(schedule, 50, kind, 0.5, torch.Generator().manual_seed(0))
        assert float(drawn.min()) >= 0.6 - 1e-6 and float(drawn.max()) <= 1.0


def test_unit_noise_is_shared_by_key():
    noise = unit_noise((2, 3), [5, 7, 5], seed=0, iteration=1, slot=0)
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    assert not torch.equal(noise, unit_noise((2, 3), [5, 7, 5], 0, 1, slot=1))
    assert torch.equal(unit_noise((2, 3), [5], 0, 1, 0, per_slot=False),
                       unit_noise((2, 3), [5], 0, 1, 3, per_slot=False))
