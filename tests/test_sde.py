"""flowgrpo.sde: closed forms, parity with diffusers, the analytic Gaussian, precision, validation.

The analytic case: data x0 ~ N(M, S0^2) per dimension, x_sigma = (1 - sigma) x0 + sigma noise.
x_sigma is Gaussian with mean (1 - sigma) M and variance V(sigma) = (1 - sigma)^2 S0^2 + sigma^2,
and the exact velocity E[noise - x0 | x_sigma = x] = -M + k(sigma) (x - (1 - sigma) M) with
k = Cov(noise - x0, x_sigma) / V = (sigma - (1 - sigma) S0^2) / V. The probability-flow ODE keeps
z = (x - (1 - sigma) M) / sqrt(V) constant, so it maps x at sigma = 1 to exactly M + S0 x.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from flowgrpo.sde import (
    KINDS,
    ODE_SOLVERS,
    anchor_std,
    calculate_shift,
    dpmpp_2m_step,
    dynamic_shift_sigmas,
    ode_solve,
    StepGaussian,
    score_step,
    shift_sigma,
    shifted_linear_sigmas,
    static_shift_sigmas,
    transition,
)

M, S0 = 1.5, 0.5
STOCHASTIC = ("flow_sde", "dance_sde", "flash_sde", "cps")
BOUNDS = (0.98, 0.02)          # flash_sde's (sigma_max, sigma_min) in the generic tests


def _transition(kind, *args, **kwargs):
    """``transition`` with flash_sde's schedule bounds filled in (BOUNDS)."""
    if kind == "flash_sde":
        kwargs.setdefault("schedule_bounds", BOUNDS)
    return transition(kind, *args, **kwargs)


def _gaussian_velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Exact velocity for the Gaussian data distribution (float64 maths, float32 out)."""
    s = sigma.reshape(-1, *([1] * (x.ndim - 1))).double()
    variance = (1 - s) ** 2 * S0 ** 2 + s ** 2
    return (-M + (s - (1 - s) * S0 ** 2) / variance * (x.double() - (1 - s) * M)).float()


def _reference_mean_std(kind, v, x, sigma, sigma_next, a):
    """The Flow-GRPO SDE's closed-form mean and std in float64 (sigma, sigma_next, a: (B,) float64)."""
    col = lambda t: t.reshape(-1, *([1] * (x.ndim - 1)))  # noqa: E731
    dt = sigma_next - sigma
    eps_hat = x + (1 - col(sigma)) * v
    x0_hat = x - col(sigma) * v
    if kind == "ode":
        return x + v * col(dt), torch.zeros_like(sigma)
    if kind == "flow_sde":
        sigma_tilde = torch.where(sigma == 1, sigma_next, sigma)
        s = a * torch.sqrt(sigma / (1 - sigma_tilde))
        return x + (v + col(s ** 2 / (2 * sigma)) * eps_hat) * col(dt), s * torch.sqrt(-dt)
    if kind == "dance_sde":
        return x + (v + col(a ** 2 / (2 * sigma)) * eps_hat) * col(dt), a * torch.sqrt(-dt)
    if kind == "flash_sde":
        s = a * (BOUNDS[1] + (BOUNDS[0] - BOUNDS[1]) * sigma)
        return x + (v + col(s ** 2 / (2 * sigma)) * eps_hat) * col(dt), s * torch.sqrt(-dt)
    std = sigma_next * torch.sin(a * math.pi / 2)
    return col(1 - sigma_next) * x0_hat + col(torch.sqrt(sigma_next ** 2 - std ** 2)) * eps_hat, std


# ------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("kind,noise_level,mean,std", [
    # x = 1, v = 0.5, sigma = 0.5, sigma_next = 0.25 (dt = -0.25, eps_hat = 1.25, x0_hat = 0.75)
    ("ode", 0.7, 1.0 - 0.125, 0.0),
    ("dance_sde", 0.5, 1.0 - 0.25 * (0.5 + 0.25 / 1.0 * 1.25), 0.5 * 0.5),
    # s^2 = 0.25 * 0.5 / 0.5 = 0.25: same numbers as dance_sde with eta = 0.5
    ("flow_sde", 0.5, 1.0 - 0.25 * (0.5 + 0.25 / 1.0 * 1.25), 0.5 * 0.5),
    # a = 1/3: std = 0.25 sin(pi/6) = 0.125; mean = 0.75 * 0.75 + sqrt(0.0625 - 0.015625) * 1.25
    ("cps", 1.0 / 3.0, 0.75 * 0.75 + math.sqrt(0.0625 - 0.015625) * 1.25, 0.125),
])
def test_scalar_step_matches_hand_computed_values(kind, noise_level, mean, std):
    out = _transition(kind, torch.full((1, 1), 0.5), torch.ones(1, 1), 0.5, 0.25,
                     noise_level=noise_level, noise=torch.full((1, 1), 2.0))
    assert out.mean.item() == pytest.approx(mean, abs=1e-6)
    assert out.std.item() == pytest.approx(std, abs=1e-6)
    assert out.prev_sample.item() == pytest.approx(mean + 2.0 * std, abs=1e-6)
    expected_logp = 0.0 if std == 0 else -2.0 - math.log(std) - 0.5 * math.log(2 * math.pi)
    assert out.log_prob.item() == pytest.approx(expected_logp, abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_mean_std_log_prob_match_reference_formulas(kind):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 4, generator=gen)
    v = torch.randn(3, 2, 4, generator=gen)
    sigma = torch.tensor([1.0, 0.6, 0.3])
    sigma_next = torch.tensor([0.95, 0.4, 0.0])
    a = torch.tensor([0.7, 0.5, 0.9])
    out = _transition(kind, v, x, sigma, sigma_next, noise_level=a, generator=gen)

    ref_mean, ref_std = _reference_mean_std(kind, v.double(), x.double(), sigma.double(),
                                            sigma_next.double(), a.double())
    torch.testing.assert_close(out.mean, ref_mean.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.std, ref_std.float(), rtol=1e-6, atol=1e-7)
    for tensor in (out.prev_sample, out.mean, out.std, out.log_prob):
        assert tensor.dtype == torch.float32
    assert out.std.shape == out.log_prob.shape == (3,)

    stochastic_rows = out.std > 0
    if kind == "ode":
        assert not stochastic_rows.any()
        assert torch.equal(out.prev_sample, out.mean)
        assert torch.equal(out.log_prob, torch.zeros(3))
        return
    # cps at sigma_next = 0 is deterministic: x' = x0_hat, log_prob 0 by convention
    expected_stochastic = sigma_next > 0 if kind == "cps" else torch.ones(3, dtype=torch.bool)
    assert torch.equal(stochastic_rows, expected_stochastic)
    rows = stochastic_rows.nonzero().flatten()
    normal = torch.distributions.Normal(out.mean[rows].double(),
                                        out.std[rows].double().reshape(-1, 1, 1))
    ref_logp = normal.log_prob(out.prev_sample[rows].double()).mean(dim=(1, 2))
    torch.testing.assert_close(out.log_prob[rows].double(), ref_logp, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.log_prob[~stochastic_rows], torch.zeros(int((~stochastic_rows).sum())))
    summed = _transition(kind, v, x, sigma, sigma_next, noise_level=a,
                        prev_sample=out.prev_sample, reduce="sum")
    torch.testing.assert_close(summed.log_prob, out.log_prob * 8, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("noise_level", [0.3, 0.7, 0.9, 1.3])
def test_flow_sde_std_at_sigma_one_is_noise_level_exactly(noise_level):
    for sigmas in (static_shift_sigmas(10, 3.0), dynamic_shift_sigmas(6, 4096),
                   torch.linspace(1, 0, 26)):
        out = transition("flow_sde", torch.zeros(2, 3), torch.zeros(2, 3), sigmas[0], sigmas[1],
                         noise_level=noise_level)
        assert torch.equal(out.std, torch.full((2,), noise_level, dtype=torch.float32))


def test_noise_level_zero_rows_equal_euler():
    gen = torch.Generator().manual_seed(1)
    x, v = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    sigma, sigma_next = torch.tensor([1.0, 0.7, 0.5]), torch.tensor([0.9, 0.5, 0.2])
    euler = transition("ode", v, x, sigma, sigma_next).prev_sample
    mixed = torch.tensor([0.7, 0.0, 0.4])
    for kind in STOCHASTIC:
        out = _transition(kind, v, x, sigma, sigma_next, noise_level=mixed, generator=gen)
        assert out.std[1] == 0 and out.log_prob[1] == 0
        assert (out.std[[0, 2]] > 0).all()
        if kind == "cps":  # equal in exact arithmetic: (1-s')(x - s v) + s'(x + (1-s) v) = x + v dt
            torch.testing.assert_close(out.prev_sample[1], euler[1], rtol=0, atol=1e-6)
        else:
            assert torch.equal(out.prev_sample[1], euler[1])
        assert not torch.allclose(out.prev_sample[[0, 2]], euler[[0, 2]])


def test_log_prob_gradient_is_finite_and_zero_for_deterministic_rows():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, generator=gen)
    v = torch.randn(2, 4, generator=gen, requires_grad=True)
    sample = transition("flow_sde", v.detach(), x, 0.8, 0.6, noise_level=torch.tensor([0.7, 0.0]),
                        generator=gen)
    replay = transition("flow_sde", v, x, 0.8, 0.6, noise_level=torch.tensor([0.7, 0.0]),
                        prev_sample=sample.prev_sample)
    replay.log_prob.sum().backward()
    assert torch.isfinite(v.grad).all()
    assert torch.equal(v.grad[1], torch.zeros(4))
    assert v.grad[0].abs().sum() > 0


# ------------------------------------------------------------------------- diffusers parity


def test_ode_matches_diffusers_flow_match_euler_step():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    ours = x.clone()
    for step, timestep in enumerate(scheduler.timesteps):
        v = torch.randn(2, 4, 8, 8, generator=gen)
        x = scheduler.step(v, timestep, x, return_dict=False)[0]
        ours = transition("ode", v, ours, scheduler.sigmas[step], scheduler.sigmas[step + 1]
                          ).prev_sample
        assert torch.equal(ours, x), f"step {step}"


# ------------------------------------------------------------------------- precision, replay


@pytest.mark.parametrize("kind", KINDS)
def test_replay_log_prob_is_bitwise_equal_to_sampling(kind):
    gen = torch.Generator().manual_seed(4)
    x, v = torch.randn(4, 3, 6, 6, generator=gen), torch.randn(4, 3, 6, 6, generator=gen)
    sigma, sigma_next = torch.tensor([1.0, 0.8, 0.5, 0.2]), torch.tensor([0.9, 0.6, 0.3, 0.1])
    for reduce in ("mean", "sum"):
        sampled = _transition(kind, v, x, sigma, sigma_next, generator=gen, reduce=reduce)
        replayed = _transition(kind, v, x, sigma, sigma_next, prev_sample=sampled.prev_sample,
                              reduce=reduce)
        assert torch.equal(replayed.log_prob, sampled.log_prob)
        assert torch.equal(replayed.mean, sampled.mean)
        assert torch.equal(replayed.std, sampled.std)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_inputs_give_float32_outputs_of_the_rounded_inputs(kind):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 4, generator=gen).bfloat16()
    v = torch.randn(2, 3, 4, generator=gen).bfloat16()
    noise = torch.randn(2, 3, 4, generator=gen)
    sigma = torch.tensor([0.9, 0.55]).bfloat16()
    sigma_next = torch.tensor([0.7, 0.3]).bfloat16()
    low = _transition(kind, v, x, sigma, sigma_next, noise=noise)
    high = _transition(kind, v.float(), x.float(), sigma.float(), sigma_next.float(), noise=noise)
    for name in ("prev_sample", "mean", "std", "log_prob"):
        assert getattr(low, name).dtype == torch.float32
        assert torch.equal(getattr(low, name), getattr(high, name)), name


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_score_step_replays_the_sampled_step_bit_for_bit(kind):
    """The trainer's replay path (score_step on the recorded StepGaussian) returns exactly the
    log-prob and mean that sampling returned: the first inner pass has ratio 1 exactly."""
    gen = torch.Generator().manual_seed(11)
    x, v = torch.randn(4, 3, 5, 5, generator=gen), torch.randn(4, 3, 5, 5, generator=gen)
    sigma, sigma_next = torch.tensor([1.0, 0.8, 0.5, 0.2]), torch.tensor([0.9, 0.6, 0.3, 0.0])
    level = torch.tensor([0.7, 0.0, 0.5, 0.9])          # a zero-noise row: std 0, log-prob 0
    for reduce in ("mean", "sum"):
        sampled = _transition(kind, v, x, sigma, sigma_next, noise_level=level, generator=gen,
                             reduce=reduce)
        logp, mean = score_step(v.clone().requires_grad_(), x, sampled.prev_sample,
                                sampled.gaussian)
        assert torch.equal(logp.detach(), sampled.log_prob)
        assert torch.equal(mean.detach(), sampled.mean)
        assert logp[1] == 0 and sampled.std[1] == 0


def _requiring_grad(gaussian: StepGaussian) -> StepGaussian:
    """The same Gaussian with coef_x requiring a gradient: score_step then uses plain autograd."""
    return dataclasses.replace(gaussian, coef_x=gaussian.coef_x.clone().requires_grad_())


@pytest.mark.parametrize("kind", STOCHASTIC)
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_score_step_closed_form_gradient_equals_autograd(kind, reduce):
    """score_step's hand-written backward (through the log-prob and through the mean, as
    GRPO-Guard and the KL use it) against autograd over the same maths."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 2, 4, 4, generator=gen)
    v = torch.randn(3, 2, 4, 4, generator=gen)
    sampled = _transition(kind, v, x, torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.1]),
                         noise_level=torch.tensor([0.7, 0.0, 0.9]), generator=gen, reduce=reduce)
    weight_logp = torch.randn(3, generator=gen)
    weight_mean = torch.randn(3, 2, 4, 4, generator=gen)
    grads = []
    for gaussian in (sampled.gaussian, _requiring_grad(sampled.gaussian)):
        velocity = (v + 0.1).requires_grad_()
        sample = x.clone().requires_grad_()
        logp, mean = score_step(velocity, sample, sampled.prev_sample, gaussian)
        ((weight_logp * logp).sum() + (weight_mean * mean).sum()).backward()
        grads.append((velocity.grad, sample.grad, logp.detach(), mean.detach()))
    (fused_v, fused_x, fused_logp, fused_mean), (auto_v, auto_x, auto_logp, auto_mean) = grads
    assert torch.equal(fused_logp, auto_logp) and torch.equal(fused_mean, auto_mean)
    torch.testing.assert_close(fused_v, auto_v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_x, auto_x, rtol=1e-5, atol=1e-6)
    assert fused_v.abs().sum() > 0


def test_score_step_gradcheck_in_float64():
    """The closed-form backward against finite differences (float64, both outputs)."""
    from flowgrpo.sde import _ScoredStep

    gen = torch.Generator().manual_seed(13)
    v = torch.randn(3, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    x = torch.randn(3, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    value = torch.randn(3, 2, 3, dtype=torch.float64, generator=gen)
    coef_x = torch.tensor([0.9, 1.1, 1.0], dtype=torch.float64)
    coef_v = torch.tensor([-0.1, -0.2, -0.05], dtype=torch.float64)
    std = torch.tensor([0.3, 0.0, 0.5], dtype=torch.float64)
    for reduce in ("mean", "sum"):
        gaussian = StepGaussian.build(coef_x, coef_v, std, 6, reduce)
        assert torch.autograd.gradcheck(
            lambda v, x: _ScoredStep.apply(v, x, value, gaussian), (v, x))


def test_degenerate_rows_score_zero_even_for_a_non_finite_residual():
    """std == 0 rows have log-prob 0 by convention; an inf residual there must not make NaN
    (0 * inf) nor leak into the other rows."""
    gaussian = StepGaussian.build(torch.ones(2), torch.zeros(2), torch.tensor([0.5, 0.0]), 3)
    residual = torch.tensor([[0.1, -0.2, 0.3], [float("inf"), 0.0, 1.0]])
    log_prob = gaussian.log_prob(residual)
    assert log_prob[1] == 0
    expected = -(residual[0] ** 2).mean() / (2 * 0.25) - math.log(0.5) - 0.5 * math.log(2 * math.pi)
    assert log_prob[0].item() == pytest.approx(expected.item(), rel=1e-6)


def test_score_step_rejects_a_gaussian_of_another_shape():
    x = torch.zeros(2, 3)
    two_rows = StepGaussian.build(torch.ones(2), torch.ones(2), torch.ones(2), 3)
    with pytest.raises(ValueError, match="gaussian is for"):
        score_step(x, x, x, StepGaussian.build(torch.ones(3), torch.ones(3), torch.ones(3), 3))
    with pytest.raises(ValueError, match="gaussian is for"):
        score_step(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4), two_rows)
    with pytest.raises(ValueError, match="next_sample must have the shape"):
        score_step(x, x, torch.zeros(2, 4), two_rows)


def test_given_noise_equals_generator_draw_and_rows_are_batch_independent():
    gen = torch.Generator().manual_seed(6)
    x, v = torch.randn(3, 2, 5, generator=gen), torch.randn(3, 2, 5, generator=gen)
    sigma, sigma_next = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.1])
    drawn = transition("flow_sde", v, x, sigma, sigma_next,
                       generator=torch.Generator().manual_seed(7))
    noise = torch.randn(3, 2, 5, generator=torch.Generator().manual_seed(7))
    given = transition("flow_sde", v, x, sigma, sigma_next, noise=noise)
    assert torch.equal(drawn.prev_sample, given.prev_sample)
    for row in range(3):
        alone = transition("flow_sde", v[row:row + 1], x[row:row + 1], sigma[row:row + 1],
                           sigma_next[row:row + 1], noise=noise[row:row + 1])
        assert torch.equal(alone.prev_sample[0], given.prev_sample[row])
        assert torch.equal(alone.log_prob[0], given.log_prob[row])


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize("change,match", [
    (dict(kind="euler"), "kind"),
    (dict(sigma_next=0.9), "sigma_next must be < sigma"),
    (dict(sigma=1.2, sigma_next=0.5), "sigma must be <= 1"),
    (dict(noise_level=-0.1), "noise_level must be >= 0"),
    (dict(kind="cps", noise_level=1.5), "noise_level must be in \\[0, 1\\] for kind='cps'"),
    (dict(velocity=torch.zeros(2, 4)), "velocity shape"),
    (dict(sigma=torch.tensor([0.9, 0.8, 0.7])), "sigma must be a scalar or have shape \\(2,\\)"),
    (dict(noise_level=torch.tensor([0.1, 0.2, 0.3])), "noise_level must be a scalar"),
    (dict(reduce="max"), "reduce"),
    (dict(noise=torch.zeros(2, 4)), "noise must have the shape"),
    (dict(prev_sample=torch.zeros(2, 3), noise=torch.zeros(2, 3)), "prev_sample .* or noise"),
    (dict(prev_sample=torch.zeros(3, 3)), "prev_sample must have the shape"),
])
def test_transition_validation_names_the_argument(change, match):
    args = dict(kind="flow_sde", velocity=torch.zeros(2, 3), sample=torch.zeros(2, 3), sigma=0.8,
                sigma_next=0.6)
    args.update(change)
    kind, velocity, sample = args.pop("kind"), args.pop("velocity"), args.pop("sample")
    sigma, sigma_next = args.pop("sigma"), args.pop("sigma_next")
    with pytest.raises(ValueError, match=match):
        _transition(kind, velocity, sample, sigma, sigma_next, **args)


def test_dpmpp_validation_names_the_argument():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="prev_x0 and prev_sigma"):
        dpmpp_2m_step(x, x, 0.5, 0.4, prev_x0=x)
    with pytest.raises(ValueError, match="prev_sigma must be in \\(sigma, 1\\]"):
        dpmpp_2m_step(x, x, 0.5, 0.4, prev_x0=x, prev_sigma=0.5)
    with pytest.raises(ValueError, match="sigma_next must be < sigma"):
        dpmpp_2m_step(x, x, 0.5, 0.5)
    with pytest.raises(ValueError, match="velocity shape"):
        dpmpp_2m_step(x, torch.zeros(2, 4), 0.5, 0.4)
    with pytest.raises(ValueError, match="solver"):
        ode_solve(lambda s, sig: s, x, torch.linspace(1, 0, 3), solver="heun")
    with pytest.raises(ValueError, match="strictly decreasing"):
        ode_solve(lambda s, sig: s, x, torch.tensor([1.0, 0.5, 0.5, 0.0]))


# ------------------------------------------------------------------------- analytic Gaussian


def _exact_chain_moments(kind: str, noise_level: float,
                         sigmas: torch.Tensor) -> tuple[float, float]:
    """Terminal mean and variance of the discrete chain started at N(0, 1), in float64.

    With the exact (affine) velocity v = k x + c, every kind's mean is affine in x, so
    x' = A x + b + std * noise and the moments follow mean' = A mean + b, var' = A^2 var + std^2.
    """
    mean, var = 0.0, 1.0
    levels = [float(s) for s in sigmas.double()]
    a = noise_level
    for s, s_next in zip(levels[:-1], levels[1:]):
        dt = s_next - s
        k = (s - (1 - s) * S0 ** 2) / ((1 - s) ** 2 * S0 ** 2 + s ** 2)
        c = -M - k * (1 - s) * M
        eps_coef, eps_const = 1 + (1 - s) * k, (1 - s) * c          # eps_hat = x + (1-s) v
        x0_coef, x0_const = 1 - s * k, -s * c                        # x0_hat = x - s v
        if kind == "ode":
            coef, const, std = 1 + k * dt, c * dt, 0.0
        elif kind in ("flow_sde", "dance_sde"):
            if kind == "flow_sde":
                s_tilde = s_next if s == 1 else s
                diffusion_sq = a * a * s / (1 - s_tilde)
            else:
                diffusion_sq = a * a
            coef = 1 + (k + diffusion_sq / (2 * s) * eps_coef) * dt
            const = (c + diffusion_sq / (2 * s) * eps_const) * dt
            std = math.sqrt(diffusion_sq * -dt)
        else:
            std = s_next * math.sin(a * math.pi / 2)
            root = math.sqrt(max(s_next ** 2 - std ** 2, 0.0))
            coef = (1 - s_next) * x0_coef + root * eps_coef
            const = (1 - s_next) * x0_const + root * eps_const
        mean, var = coef * mean + const, coef * coef * var + std * std
    return mean, var


def _run_chain(kind, noise_level, sigmas, num_samples=20_000, dims=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, dims, generator=gen)
    for step in range(len(sigmas) - 1):
        sigma = sigmas[step].expand(num_samples)
        sigma_next = sigmas[step + 1].expand(num_samples)
        x = _transition(kind, _gaussian_velocity(x, sigma), x, sigma, sigma_next,
                       noise_level=noise_level, generator=gen).prev_sample
    return x.double()


def _assert_moments(samples, mean, var, z=4.5):
    n = samples.numel()
    mean_se, var_se = math.sqrt(var / n), var * math.sqrt(2.0 / (n - 1))
    assert abs(samples.mean().item() - mean) < z * mean_se, (samples.mean().item(), mean, mean_se)
    assert abs(samples.var().item() - var) < z * var_se, (samples.var().item(), var, var_se)


@pytest.mark.parametrize("kind,noise_level", [("ode", 0.0), ("flow_sde", 0.7),
                                              ("dance_sde", 0.7), ("cps", 0.8)])
def test_monte_carlo_matches_exact_discrete_chain_moments(kind, noise_level):
    """20k x 2 samples through 50 shifted steps match the chain's exact moments (float64)."""
    sigmas = static_shift_sigmas(50, 3.0)
    mean, var = _exact_chain_moments(kind, noise_level, sigmas)
    _assert_moments(_run_chain(kind, noise_level, sigmas), mean, var)


@pytest.mark.parametrize("kind,noise_level", [("flow_sde", 0.7), ("dance_sde", 0.7)])
def test_sde_samplers_reproduce_the_data_distribution(kind, noise_level):
    """Terminal distribution = data distribution (= the exact ODE's) within Monte-Carlo error,
    and the discretisation bias of the exact chain shrinks as steps are added."""
    sigmas = torch.linspace(1.0, 0.0, 201)
    _assert_moments(_run_chain(kind, noise_level, sigmas, seed=1), M, S0 ** 2)
    bias = [abs(_exact_chain_moments(kind, noise_level, static_shift_sigmas(n, 3.0))[1] - S0 ** 2)
            for n in (25, 100, 400)]
    assert bias[0] > bias[1] > bias[2] and bias[2] < 0.01 * S0 ** 2


def test_cps_with_a_mean_denoiser_underdisperses_and_does_not_converge():
    """Documents a property of CPS, not of this implementation: with the exact *mean* denoiser
    (x0_hat = E[x0 | x]) each step loses variance A S (1 - cos t)^2 / (A + S) with
    A = (1-sigma)^2 S0^2, S = sigma^2, t = a pi/2 -- an O(1) loss per step that does not vanish
    as steps are refined. The mean stays exact; a = 0 (Euler) converges."""
    for num_steps in (25, 100, 400):
        mean, var = _exact_chain_moments("cps", 0.8, static_shift_sigmas(num_steps, 3.0))
        assert mean == pytest.approx(M, abs=1e-9)
        assert var < 0.7 * S0 ** 2
    _, var_ode = _exact_chain_moments("cps", 0.0, static_shift_sigmas(400, 3.0))
    assert var_ode == pytest.approx(S0 ** 2, rel=0.02)


# ------------------------------------------------------------------------- DPM-Solver++(2M)


def test_dpmpp_first_order_step_is_euler_and_final_step_returns_x0_hat():
    gen = torch.Generator().manual_seed(8)
    x, v = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    sigma, sigma_next = torch.tensor([1.0, 0.7, 0.2]), torch.tensor([0.9, 0.4, 0.0])
    next_sample, x0_hat = dpmpp_2m_step(x, v, sigma, sigma_next)
    euler = transition("ode", v, x, sigma, sigma_next).prev_sample
    torch.testing.assert_close(next_sample, euler, rtol=0, atol=2e-6)
    assert torch.equal(x0_hat, x - sigma[:, None] * v)
    assert torch.equal(next_sample[2], x0_hat[2])
    with_history, _ = dpmpp_2m_step(x[1:], v[1:], sigma[1:], sigma_next[1:],
                                    prev_x0=torch.randn(2, 4, generator=gen),
                                    prev_sigma=torch.tensor([0.9, 0.4]), final=True)
    assert torch.equal(with_history, next_sample[1:])


def test_dpmpp_second_order_matches_reference_formula():
    """DPM-Solver++(2M)'s lambda / e^-h form, per-sample sigmas, in float64."""
    gen = torch.Generator().manual_seed(9)
    x, v = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    prev_x0 = torch.randn(2, 5, generator=gen)
    prev_sigma, sigma = torch.tensor([0.9, 0.5]), torch.tensor([0.8, 0.35])
    sigma_next = torch.tensor([0.6, 0.1])
    ours, _ = dpmpp_2m_step(x, v, sigma, sigma_next, prev_x0=prev_x0, prev_sigma=prev_sigma)

    lam = lambda s: torch.log((1 - s) / s)  # noqa: E731
    s_prev, s, s_next = prev_sigma.double(), sigma.double(), sigma_next.double()
    h, h_prev = lam(s_next) - lam(s), lam(s) - lam(s_prev)
    alpha_next = (1 - s_next)[:, None]
    d0 = x.double() - s[:, None] * v.double()
    d1 = (d0 - prev_x0.double()) / (h_prev / h)[:, None]
    expm = torch.exp(-h)[:, None] - 1
    expected = ((s_next / s)[:, None] * x.double() - alpha_next * expm * d0
                - 0.5 * alpha_next * expm * d1)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5)


def _terminal_error(solver: str, num_steps: int, start: torch.Tensor) -> float:
    out = ode_solve(_gaussian_velocity, start, torch.linspace(1.0, 0.0, num_steps + 1), solver)
    return (out.double() - (M + S0 * start.double())).pow(2).mean().sqrt().item()


def test_dpmpp_2m_is_more_accurate_and_second_order_on_the_analytic_ode():
    start = torch.randn(2000, 1, generator=torch.Generator().manual_seed(10))
    errors = {solver: [_terminal_error(solver, n, start) for n in (20, 40, 80, 160)]
              for solver in ODE_SOLVERS}
    for euler, dpm in zip(errors["euler"], errors["dpmpp_2m"]):
        assert dpm < euler / 4
    euler_ratio = errors["euler"][-2] / errors["euler"][-1]
    dpm_ratio = errors["dpmpp_2m"][-2] / errors["dpmpp_2m"][-1]
    assert 1.8 < euler_ratio < 2.2, errors
    # second order up to a log factor: near sigma = 1 and sigma = 0 the steps in lambda do not
    # shrink with N, so the asymptotic ratio approaches 4 slowly from below
    assert 3.0 < dpm_ratio < 4.5, errors


def test_ode_solve_makes_one_velocity_call_per_step():
    calls = []

    def counting_velocity(x, sigma):
        calls.append(sigma.clone())
        return _gaussian_velocity(x, sigma)

    sigmas = static_shift_sigmas(7, 3.0)
    for solver in ODE_SOLVERS:
        calls.clear()
        ode_solve(counting_velocity, torch.zeros(3, 2), sigmas, solver)
        assert len(calls) == 7
        assert torch.equal(torch.stack([c[0] for c in calls]), sigmas[:-1])


# ------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("num_steps,shift", [(1, 3.0), (10, 3.0), (28, 3.0), (40, 3.0),
                                             (25, 1.0), (16, 5.0)])
def test_static_shift_sigmas_match_diffusers(num_steps, shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    ours = static_shift_sigmas(num_steps, shift)
    assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,)
    torch.testing.assert_close(ours, scheduler.sigmas, rtol=0, atol=1e-6)


def test_static_shift_sigmas_match_the_reference_sd3_values():
    expected = torch.tensor([1, .96013, .91335, .85769, .79037, .70728, .60215, .46488, .27805,
                             .00893, 0])
    torch.testing.assert_close(static_shift_sigmas(10, 3.0), expected, rtol=0, atol=6e-6)
    assert shift_sigma(1.0, 3.0) == 1.0 and shift_sigma(0.5, 1.0) == 0.5


@pytest.mark.parametrize("num_steps,image_seq_len", [(1, 256), (6, 4096), (28, 1024), (20, 6000),
                                                     (12, 64)])
def test_dynamic_shift_sigmas_match_diffusers_flux(num_steps, image_seq_len):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as diffusers_shift

    mu = diffusers_shift(image_seq_len, 256, 4096, 0.5, 1.15)
    assert calculate_shift(image_seq_len) == pytest.approx(mu, abs=1e-12)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5,
                                                max_shift=1.15)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    torch.testing.assert_close(dynamic_shift_sigmas(num_steps, image_seq_len), scheduler.sigmas,
                               rtol=0, atol=1e-6)


# ------------------------------------------------------------------------- anchors: Flash-GRPO, CPS

# Flash-GRPO's Wan runs sampled on the UniPC flow grid of the diffusers release it used (its
# kappa table, scripts/train_wanx2_1_flash.py, is keyed by these timesteps).
FLASH_TIMESTEPS = [999, 982, 963, 944, 922, 899, 874, 847, 817, 785]


def test_shifted_linear_sigmas_reproduce_the_anchor_grids():
    flash = shifted_linear_sigmas(20, 3.0, start=0.999)
    assert [int(s * 1000) for s in flash[:10].tolist()] == FLASH_TIMESTEPS
    assert flash.shape == (21,) and flash[-1] == 0 and bool((flash[1:] < flash[:-1]).all())
    # MixGRPO: sd3_time_shift(3, linspace(1, 0, 26))
    t = torch.linspace(1, 0, 26, dtype=torch.float64)
    torch.testing.assert_close(shifted_linear_sigmas(25, 3.0), (3 * t / (1 + 2 * t)).float(),
                               rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="start"):
        shifted_linear_sigmas(10, 3.0, start=1.5)


def test_flash_sde_std_per_step_equals_flash_grpo_formula():
    """std_dev_t = sigma_min + (sigma_max - sigma_min) sigma with sigma_max = sigmas[1] and
    sigma_min = sigmas[-1] of the schedule (Flash-GRPO's sde_step_with_logprob), total std
    std_dev_t sqrt(-dt); about 0.13 at the first step where flow_sde's a = 0.7 gives 0.7."""
    sigmas = shifted_linear_sigmas(20, 3.0, start=0.999).double()
    bounds = (sigmas[1].item(), sigmas[-1].item())
    x, v = torch.randn(20, 3, 4), torch.randn(20, 3, 4)
    out = transition("flash_sde", v, x, sigmas[:-1].float(), sigmas[1:].float(), noise_level=1.0,
                     schedule_bounds=bounds)
    std_dev_t = bounds[1] + (bounds[0] - bounds[1]) * sigmas[:-1]
    expected = std_dev_t * torch.sqrt(sigmas[:-1] - sigmas[1:])
    torch.testing.assert_close(out.std.double(), expected, rtol=1e-6, atol=1e-7)
    assert out.std[0].item() == pytest.approx(0.129, abs=1e-3)
    wan = static_shift_sigmas(20, 3.0)                 # the Wan adapter's grid: sigmas[0] = 1
    flow = transition("flow_sde", v[:1], x[:1], wan[0], wan[1], noise_level=0.7)
    assert flow.std.item() == pytest.approx(0.7, abs=1e-6)
    # the anchor's std_dev_t is what anchor_std recovers
    torch.testing.assert_close(anchor_std("flash_sde", out.std, sigmas[:-1].float(),
                                          sigmas[1:].float()).double(), std_dev_t,
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="schedule_bounds"):
        transition("flash_sde", v, x, sigmas[:-1].float(), sigmas[1:].float())


def _anchor_cps_log_prob(velocity, sample, prev_sample, sigma, sigma_prev, noise_level):
    """Flow-GRPO's CPS step (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py): mean from the
    predicted x0 and noise, log_prob = mean_d(-(x' - mean)^2) with every constant removed."""
    col = lambda t: t.reshape(-1, *([1] * (sample.ndim - 1)))  # noqa: E731
    std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
    x0 = sample - col(sigma) * velocity
    eps = sample + velocity * (1 - col(sigma))
    mean = x0 * (1 - col(sigma_prev)) + eps * col(torch.sqrt(sigma_prev ** 2 - std_dev_t ** 2))
    return (-((prev_sample - mean) ** 2)).flatten(1).mean(dim=1)


def test_cps_unscaled_log_ratio_equals_the_anchor_quantity():
    """With log_prob="unscaled" the log-ratio a replay sees is exactly Flow-GRPO's CPS quantity
    (what its clip range 1e-5 acts on); the exact convention's log-ratio is it / (2 std^2)."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(4, 2, 6, 6, generator=gen, dtype=torch.float64)
    v_old = torch.randn(4, 2, 6, 6, generator=gen, dtype=torch.float64)
    v_new = v_old + 0.05 * torch.randn(4, 2, 6, 6, generator=gen, dtype=torch.float64)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.3], dtype=torch.float64)
    sigma_next = torch.tensor([0.9, 0.6, 0.3, 0.1], dtype=torch.float64)
    sampled = transition("cps", v_old, x, sigma, sigma_next, noise_level=0.8, generator=gen,
                         log_prob="unscaled")
    logp_new, _ = score_step(v_new.float(), x.float(), sampled.prev_sample, sampled.gaussian)
    ours = (logp_new - sampled.log_prob).double()
    prev = sampled.prev_sample.double()
    anchor = (_anchor_cps_log_prob(v_new, x, prev, sigma, sigma_next, 0.8)
              - _anchor_cps_log_prob(v_old, x, prev, sigma, sigma_next, 0.8))
    torch.testing.assert_close(ours, anchor, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(sampled.log_prob.double(),
                               _anchor_cps_log_prob(v_old, x, prev, sigma, sigma_next, 0.8),
                               rtol=1e-5, atol=1e-6)
    exact = transition("cps", v_old, x, sigma, sigma_next, noise_level=0.8,
                       prev_sample=sampled.prev_sample)
    exact_new = transition("cps", v_new, x, sigma, sigma_next, noise_level=0.8,
                           prev_sample=sampled.prev_sample)
    exact_ratio = (exact_new.log_prob - exact.log_prob).double()
    torch.testing.assert_close(exact_ratio * 2 * exact.std.double() ** 2, anchor, rtol=1e-4,
                               atol=1e-6)


def test_unscaled_log_prob_replays_bit_for_bit_with_the_closed_form_gradient():
    gen = torch.Generator().manual_seed(22)
    x, v = torch.randn(3, 2, 4, 4, generator=gen), torch.randn(3, 2, 4, 4, generator=gen)
    sampled = transition("cps", v, x, torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.0]),
                         noise_level=0.8, generator=gen, log_prob="unscaled")
    assert sampled.log_prob[2] == 0                      # sigma_next = 0: deterministic row
    grads = []
    for gaussian in (sampled.gaussian, dataclasses.replace(
            sampled.gaussian, coef_x=sampled.gaussian.coef_x.clone().requires_grad_())):
        velocity = (v + 0.1).requires_grad_()
        logp, _ = score_step(velocity, x, sampled.prev_sample, gaussian)
        logp.sum().backward()
        grads.append(velocity.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    logp, _ = score_step(v, x, sampled.prev_sample, sampled.gaussian)
    assert torch.equal(logp, sampled.log_prob)
    with pytest.raises(ValueError, match="log_prob"):
        transition("cps", v, x, 0.5, 0.3, log_prob="exactish")


def test_anchor_std_is_the_anchors_std_dev_t():
    sigma = torch.tensor([1.0, 0.7, 0.4])
    sigma_next = torch.tensor([0.9, 0.5, 0.1])
    x, v = torch.randn(3, 5), torch.randn(3, 5)
    flow = transition("flow_sde", v, x, sigma, sigma_next, noise_level=0.7)
    sigma_tilde = torch.where(sigma == 1, sigma_next, sigma)
    torch.testing.assert_close(anchor_std("flow_sde", flow.std, sigma, sigma_next),
                               0.7 * torch.sqrt(sigma / (1 - sigma_tilde)))
    cps = transition("cps", v, x, sigma, sigma_next, noise_level=0.8)
    assert torch.equal(anchor_std("cps", cps.std, sigma, sigma_next), cps.std)
    dance = transition("dance_sde", v, x, sigma, sigma_next, noise_level=0.5)
    torch.testing.assert_close(anchor_std("dance_sde", dance.std, sigma, sigma_next),
                               torch.full((3,), 0.5))
