"""Flow-matching transitions and sigma schedules: pure tensor maths, no model, no state.

Convention: ``x_sigma = (1 - sigma) x0 + sigma noise``, velocity ``v ~ noise - x0``,
sigma runs from 1 (noise) to 0 (data), ``sigma_next < sigma`` and ``dt = sigma_next - sigma < 0``.
Derived quantities used below: ``x0_hat = x - sigma v`` (predicted data) and
``eps_hat = x + (1 - sigma) v`` (predicted noise).

One step of a trajectory is a Gaussian ``x' ~ N(mean, std^2 I)`` whose mean and per-sample std
depend on the transition ``kind``:

========== ========================================================== ==========================
kind       mean                                                       std (total, per sample)
========== ========================================================== ==========================
ode        x + v dt  (Euler; what diffusers' FlowMatchEuler does)      0
flow_sde   x + [v + s^2/(2 sigma) eps_hat] dt,                        s sqrt(-dt)
           s = a sqrt(sigma / (1 - sigma~)), sigma~ = sigma except
           sigma~ = sigma_next where sigma == 1 (Flow-GRPO)
dance_sde  x + [v + a^2/(2 sigma) eps_hat] dt  (DanceGRPO, a = eta)   a sqrt(-dt)
flash_sde  x + [v + s^2/(2 sigma) eps_hat] dt,                        s sqrt(-dt)
           s = a [s_min + (s_max - s_min) sigma] (Flash-GRPO, a = 1;
           s_max = the schedule's second sigma, s_min its last)
cps        (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) eps_hat  sigma_next sin(a pi / 2)
========== ========================================================== ==========================

``a`` is ``noise_level``; with ``a = 0`` every stochastic kind reduces to Euler (bit for bit for
``flow_sde``, ``dance_sde`` and ``flash_sde``, up to rounding for ``cps``). ``flash_sde`` needs the
schedule's (s_max, s_min) = (sigmas[1], sigmas[-1]) as ``schedule_bounds``: Flash-GRPO's Wan step
reads them from the scheduler's sigma array (``std_dev_t = sigma_min + (sigma_max - sigma_min)
sigma``), which on Wan2.1's 20-step grid is about 0.13 total std at the first step where
``flow_sde`` with a = 0.7 has exactly 0.7.

Log-prob conventions (``log_prob``): "exact" is the Gaussian log-density per element with its
constants (what every anchor uses for its SDE kinds); "unscaled" is ``-mean_d (x' - mean)^2``
without 1/(2 std^2) and constants, what Flow-GRPO's CPS step returns. Its log-ratios are
2 std^2 times the exact ones, which is what the anchor's CPS clip range (1e-5) is sized for. Everything is computed in float32
whatever the input dtype: bf16 overflows and loses the tiny log-ratio differences GRPO relies on.

Behaviour with an exact velocity (checked on Gaussian data in tests/test_sde.py):
``dance_sde`` and ``flow_sde`` converge to the data distribution as steps are refined. The
Flow-GRPO rule at sigma = 1 makes step 0 an O(1) step whatever N (std = a exactly), adding a
fixed a^4/4 of variance there, which later steps mostly absorb. ``cps`` with a mean denoiser
(x0_hat = E[x0 | x]) loses variance at every step by an amount that does not shrink with the
step size, so its samples are under-dispersed (mean exact); a = 0 is Euler.

Every kind's mean is affine in (x, v), ``mean = coef_x x + coef_v v`` with per-sample
coefficients. ``Transition.gaussian`` (a ``StepGaussian``) holds them with the std and the
log-density's constants; a trainer re-scores a recorded step under new weights with
``score_step(velocity, x, x', gaussian)`` (closed-form backward), bit for bit what sampling
returned, so the first inner pass of an update has ratio exactly 1.

The deterministic stretches of a trajectory may use DPM-Solver++(2M) (``dpmpp_2m_step``), and
``ode_solve`` integrates a whole schedule. The sigma schedules reproduce diffusers'
``FlowMatchEulerDiscreteScheduler`` (SD3-style static shift, FLUX-style dynamic shift).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "KINDS",
    "LOG_PROBS",
    "ODE_SOLVERS",
    "Transition",
    "transition",
    "step_entropy",
    "score_step",
    "region_log_probs",
    "StepGaussian",
    "dpmpp_2m_step",
    "ode_solve",
    "shift_sigma",
    "calculate_shift",
    "exponential_time_shift",
    "static_shift_sigmas",
    "dynamic_shift_sigmas",
    "shifted_linear_sigmas",
    "anchor_std",
]

ODE_SOLVERS = ("euler", "dpmpp_2m")
REDUCTIONS = ("mean", "sum")
LOG_PROBS = ("exact", "unscaled")
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass
class Transition:
    """One step x -> x'.

    prev_sample: x' (B, ...) float32, sampled, or the replayed sample that was scored.
    mean:        mean of x' given x (B, ...) float32; carries the gradient of the velocity.
    std:         total std of x' given x (B,) float32, including sqrt(-dt) where it applies;
                 0 for "ode" and for rows with noise_level 0.
    log_prob:    (B,) float32 exact Gaussian log-density of prev_sample under N(mean, std^2),
                 per element with constants, reduced over non-batch dims ("mean" or "sum");
                 0 for rows whose std is 0 (the density is degenerate there; 0 keeps the
                 ratio exp(logp - logp_old) at exactly 1 for those rows).
    gaussian:    the step's ``StepGaussian`` (mean = coef_x x + coef_v v, std, log-density
                 constants), which ``score_step`` takes to re-score x' in a replay.
    """

    prev_sample: Tensor
    mean: Tensor
    std: Tensor
    log_prob: Tensor
    gaussian: StepGaussian


# ----------------------------------------------------------------------------- helpers


def _rows(values: Tensor, ndim: int) -> Tensor:
    """(B,) -> (B, 1, ..., 1) with ``ndim`` dims, to broadcast a per-sample value over a sample."""
    return values.reshape(-1, *([1] * (ndim - 1)))


def _as_float32(value: Tensor, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(value).__name__})")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (got dtype {value.dtype})")
    return value.to(torch.float32)


def _check_velocity_shape(velocity: Tensor, sample: Tensor) -> None:
    if velocity.shape == sample.shape:   # the usual case; broadcast_shapes took ~0.1 ms a call (cProfile)
        return
    try:
        broadcast = torch.broadcast_shapes(velocity.shape, sample.shape)
    except RuntimeError:
        broadcast = None
    if broadcast != sample.shape:
        raise ValueError(f"velocity shape {tuple(velocity.shape)} does not broadcast to sample "
                         f"shape {tuple(sample.shape)}")


def _per_sample(value: float | Tensor, name: str, batch: int, device: torch.device,
                check_finite: bool = True) -> Tensor:
    """A python float, a 0-d / (1,) tensor or a (B,) tensor -> (B,) float32 on ``device``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
        raise TypeError(f"{name} must be a float or a tensor of shape ({batch},) "
                        f"(got {type(value).__name__})")
    values = torch.as_tensor(value).to(device=device, dtype=torch.float32)
    if values.ndim == 0 or tuple(values.shape) == (1,):
        values = values.reshape(1).expand(batch)
    elif tuple(values.shape) != (batch,):
        raise ValueError(f"{name} must be a scalar or have shape ({batch},) to match the batch of "
                         f"sample (got shape {tuple(values.shape)})")
    if check_finite and not bool(torch.isfinite(values).all()):
        raise ValueError(f"{name} must be finite (got {values.tolist()})")
    return values


def _check_sigma_pair(sigma: Tensor, sigma_next: Tensor) -> None:
    """sigma in (0, 1], 0 <= sigma_next < sigma for every row."""
    if bool((sigma > 1).any()):
        raise ValueError(f"sigma must be <= 1 (got max {sigma.max().item():.6g})")
    if bool((sigma_next < 0).any()):
        raise ValueError(f"sigma_next must be >= 0 (got min {sigma_next.min().item():.6g})")
    bad = sigma_next >= sigma
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            "sigma_next must be < sigma for every sample (dt = sigma_next - sigma < 0: sampling "
            f"runs from noise to data); got sigma_next={sigma_next[row].item():.6g} >= "
            f"sigma={sigma[row].item():.6g} at row {row}")


def _standard_normal(like: Tensor, noise: Tensor | None,
                     generator: torch.Generator | None) -> Tensor:
    if noise is not None:
        noise = _as_float32(noise, "noise")
        if noise.shape != like.shape:
            raise ValueError(f"noise must have the shape of sample {tuple(like.shape)} "
                             f"(got {tuple(noise.shape)})")
        return noise.to(like.device)
    device = generator.device if generator is not None else like.device
    draw = torch.randn(like.shape, generator=generator, device=device, dtype=torch.float32)
    return draw.to(like.device)


# ----------------------------------------------------------------------------- transitions


@dataclass
class StepGaussian:
    """One step's policy, x' ~ N(coef_x x + coef_v v, std^2 I) per row, with the constants of its
    log-density. Every field is (B,) float32 and none depends on the model, so the rollout builds
    it once per step and a replay re-scores x' with it (``score_step``) without redoing the
    schedule arithmetic: on CPU-sized latents each small op costs as much as the maths in it.

    log p(x') = -reduce((x' - mean)^2) * half_precision - log_norm, where ``reduce`` is "mean" or
    "sum" over a row, half_precision = 1 / (2 std^2) and log_norm = n (log std + log sqrt(2 pi)),
    n = 1 for "mean" and the row's element count for "sum"; both are 0 on rows with std == 0,
    whose log-prob is 0 (``stochastic`` False). Under the "unscaled" convention (Flow-GRPO's CPS)
    half_precision = 1 and log_norm = 0: log p = -reduce((x' - mean)^2).
    """

    coef_x: Tensor
    coef_v: Tensor
    std: Tensor
    stochastic: Tensor
    half_precision: Tensor
    log_norm: Tensor
    reduce: str
    numel: int                         # elements per row

    @classmethod
    def build(cls, coef_x: Tensor, coef_v: Tensor, std: Tensor, numel: int,
              reduce: str = "mean", log_prob: str = "exact") -> "StepGaussian":
        """From the mean's coefficients and the std (B,), for rows of ``numel`` elements;
        ``log_prob`` is the convention ("exact" or "unscaled", see ``LOG_PROBS``)."""
        stochastic = std > 0
        zero = torch.zeros_like(std)
        if log_prob == "unscaled":
            half_precision = torch.where(stochastic, torch.ones_like(std), zero)
            return cls(coef_x, coef_v, std, stochastic, half_precision, zero, reduce, numel)
        safe_std = torch.where(stochastic, std, torch.ones_like(std))
        count = 1.0 if reduce == "mean" else float(numel)
        half_precision = torch.where(stochastic, 0.5 / safe_std.square(), zero)
        log_norm = torch.where(stochastic, count * (torch.log(safe_std) + _LOG_SQRT_2PI), zero)
        return cls(coef_x, coef_v, std, stochastic, half_precision, log_norm, reduce, numel)

    def mean(self, sample: Tensor, velocity: Tensor) -> Tensor:
        """coef_x x + coef_v v: (B, ...) sample and velocity."""
        return _rows(self.coef_x, sample.ndim) * sample + _rows(self.coef_v, sample.ndim) * velocity

    def log_prob(self, residual: Tensor) -> Tensor:
        """(B,) log-density of mean + residual (residual (B, ...), treated as given)."""
        dims = tuple(range(1, residual.ndim))
        squared = residual.square()
        reduced = squared.mean(dim=dims) if self.reduce == "mean" else squared.sum(dim=dims)
        log_prob = torch.addcmul(self.log_norm, reduced, self.half_precision).neg()
        # where, not the zero constants alone: 0 * inf would be NaN on a degenerate row
        return torch.where(self.stochastic, log_prob, 0.0)


class _ScoredStep(torch.autograd.Function):
    """(mean, log_prob) of a given x' under a ``StepGaussian``, with the closed-form backward
    d log_prob / d mean = (x' - mean) * 2 half_precision / n (n = the row's element count for
    "mean", 1 for "sum"; 0 where std == 0) and d mean = coef_x dx + coef_v dv.

    The replay path: autograd over the same ops records about ten nodes per call, which on
    CPU-sized latents cost more than their arithmetic (benchmarks/overhead.py). The forward calls
    the same ``StepGaussian`` methods as sampling, so the log-prob is bit for bit the one
    sampling returned. The Gaussian's fields are constants here (no gradient); ``score_step``
    uses plain autograd when they require one.
    """

    @staticmethod
    def forward(ctx, velocity, sample, value, gaussian):
        mean = gaussian.mean(sample, velocity)
        residual = value - mean
        log_prob = gaussian.log_prob(residual)
        ctx.save_for_backward(residual)
        ctx.gaussian = gaussian
        ctx.set_materialize_grads(False)   # the mean's gradient is usually None: skip the zeros
        return mean, log_prob

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_mean, grad_log_prob):
        (residual,) = ctx.saved_tensors
        gaussian = ctx.gaussian
        grad = grad_mean
        if grad_log_prob is not None:
            count = float(gaussian.numel) if gaussian.reduce == "mean" else 1.0
            scale = grad_log_prob * gaussian.half_precision * (2.0 / count)
            from_log_prob = _rows(scale, residual.ndim) * residual
            grad = from_log_prob if grad is None else grad + from_log_prob
        if grad is None:
            return None, None, None, None
        grad_velocity = _rows(gaussian.coef_v, grad.ndim) * grad if ctx.needs_input_grad[0] else None
        grad_sample = _rows(gaussian.coef_x, grad.ndim) * grad if ctx.needs_input_grad[1] else None
        return grad_velocity, grad_sample, None, None


# Each stochastic kind's step as (coef_x, coef_v, std), each (B,) float32, with
# mean = coef_x x + coef_v v: the table in the module docstring with x0_hat = x - sigma v and
# eps_hat = x + (1 - sigma) v expanded. Every kind's mean is affine in (x, v) with per-sample
# coefficients, so the full-size work of a step is two products and a sum. ``bounds`` is the
# schedule's (s_max, s_min) as (B,) tensors, or None; only flash_sde reads it.
def _cps_coefficients(sigma: Tensor, sigma_next: Tensor, noise_level: Tensor,
                      bounds: tuple[Tensor, Tensor] | None = None
                      ) -> tuple[Tensor, Tensor, Tensor]:
    std = sigma_next * torch.sin(noise_level * (math.pi / 2.0))
    eps_coef = torch.sqrt(torch.clamp(sigma_next ** 2 - std ** 2, min=0.0))
    # (1 - s') (x - s v) + c (x + (1 - s) v)
    return 1.0 - sigma_next + eps_coef, eps_coef * (1.0 - sigma) - (1.0 - sigma_next) * sigma, std


def _drift_coefficients(sigma: Tensor, sigma_next: Tensor, diffusion_sq: Tensor, std: Tensor
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """The SDE kinds' Euler-Maruyama step x + [v + drift (x + (1 - s) v)] dt with
    drift = diffusion^2 / (2 sigma); with a = 0, coef_x = 1 and coef_v = dt exactly, so the step
    is Euler bit for bit."""
    dt = sigma_next - sigma
    drift = diffusion_sq / (2.0 * sigma)
    return 1.0 + drift * dt, dt * (1.0 + drift * (1.0 - sigma)), std


def _flow_sde_coefficients(sigma: Tensor, sigma_next: Tensor, noise_level: Tensor,
                           bounds: tuple[Tensor, Tensor] | None = None
                           ) -> tuple[Tensor, Tensor, Tensor]:
    sigma_tilde = torch.where(sigma == 1.0, sigma_next, sigma)
    diffusion_sq = noise_level ** 2 * sigma / (1.0 - sigma_tilde)          # s^2
    # s sqrt(-dt) written so that at sigma = 1 the ratio (-dt)/(1 - sigma_next) is exactly 1
    # and std == noise_level exactly.
    std = noise_level * torch.sqrt(sigma * (sigma - sigma_next) / (1.0 - sigma_tilde))
    return _drift_coefficients(sigma, sigma_next, diffusion_sq, std)


def _dance_sde_coefficients(sigma: Tensor, sigma_next: Tensor, noise_level: Tensor,
                            bounds: tuple[Tensor, Tensor] | None = None
                            ) -> tuple[Tensor, Tensor, Tensor]:
    return _drift_coefficients(sigma, sigma_next, noise_level ** 2,
                               noise_level * torch.sqrt(sigma - sigma_next))


def _flash_sde_coefficients(sigma: Tensor, sigma_next: Tensor, noise_level: Tensor,
                            bounds: tuple[Tensor, Tensor] | None = None
                            ) -> tuple[Tensor, Tensor, Tensor]:
    if bounds is None:
        raise ValueError("kind='flash_sde' needs schedule_bounds=(sigma_max, sigma_min): the "
                         "second and the last sigma of the sampling schedule (Flash-GRPO)")
    sigma_max, sigma_min = bounds
    scale = noise_level * (sigma_min + (sigma_max - sigma_min) * sigma)          # s
    return _drift_coefficients(sigma, sigma_next, scale ** 2,
                               scale * torch.sqrt(sigma - sigma_next))


STOCHASTIC_STEPS = {"flow_sde": _flow_sde_coefficients, "dance_sde": _dance_sde_coefficients,
                    "flash_sde": _flash_sde_coefficients, "cps": _cps_coefficients}
KINDS = ("ode", *STOCHASTIC_STEPS)
# Kinds whose anchor returns the total std as its ``std_dev_t`` (CPS); the SDE kinds return
# s = std / sqrt(sigma - sigma_next). See ``anchor_std``.
_TOTAL_STD_KINDS = ("cps",)


def anchor_std(kind: str, std: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """The ``std_dev_t`` the anchors' step functions return, (B,) float32: s = std / sqrt(sigma -
    sigma_next) for the SDE kinds (Flow-GRPO's a sqrt(sigma / (1 - sigma~)), DanceGRPO's eta,
    Flash-GRPO's linear s), the total std for cps (Flow-GRPO's sigma_next sin(a pi / 2)).

    Flow-GRPO's KL loss divides mean_d((mean - mean_ref)^2) by 2 std_dev_t^2, so for the SDE kinds
    its KL is the Gaussian KL per dim times (sigma - sigma_next): ``flow_kl(mean, mean_ref,
    anchor_std(...))`` is its formula. std, sigma, sigma_next: (B,).
    """
    if kind not in STOCHASTIC_STEPS:
        raise ValueError(f"kind must be one of {tuple(STOCHASTIC_STEPS)} (got {kind!r})")
    std = std.to(torch.float32)
    if kind in _TOTAL_STD_KINDS:
        return std
    return std / torch.sqrt(sigma.to(torch.float32) - sigma_next.to(torch.float32))


def _check_values(kind: str, sigma: Tensor, sigma_next: Tensor, level: Tensor) -> None:
    _check_sigma_pair(sigma, sigma_next)
    if bool((level < 0).any()):
        raise ValueError(f"noise_level must be >= 0 (got {level.min().item():.6g})")
    if kind == "cps" and bool((level > 1).any()):
        raise ValueError("noise_level must be in [0, 1] for kind='cps' (it is a in "
                         f"std = sigma_next sin(a pi/2)); got {level.max().item():.6g}")


def euler_step(sample: Tensor, velocity: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """x + v (sigma_next - sigma) in float32, unchecked: the deterministic steps of a rollout.
    sample/velocity (B, ...); sigma/sigma_next (B,). Equals ``transition("ode", ...).prev_sample``."""
    dt = (sigma_next.to(torch.float32) - sigma.to(torch.float32)).reshape(-1, *[1] * (sample.ndim - 1))
    return sample.to(torch.float32) + velocity.to(torch.float32) * dt


def transition(kind: str, velocity: Tensor, sample: Tensor, sigma: float | Tensor,
               sigma_next: float | Tensor, *, noise_level: float | Tensor = 0.7,
               prev_sample: Tensor | None = None, generator: torch.Generator | None = None,
               noise: Tensor | None = None, reduce: str = "mean",
               validate: bool = True, log_prob: str = "exact",
               schedule_bounds: tuple[float, float] | None = None) -> Transition:
    """One step from ``sample`` at ``sigma`` to ``sigma_next``: sample it, or score a given one.

    Args:
        kind: "ode", "flow_sde", "dance_sde", "flash_sde" or "cps" (table in the module docstring).
        velocity: (B, ...) model velocity (after CFG), broadcastable to sample's shape.
        sample: x (B, ...), any float dtype (computed in float32).
        sigma, sigma_next: (B,) per-sample noise levels, or python floats / 0-d tensors
            broadcast to B; 0 <= sigma_next < sigma <= 1.
        noise_level: a >= 0 (flow_sde's a, dance_sde's eta, cps's a in [0, 1]), float or (B,)
            so one batch can mix SDE rows with ODE-equivalent rows (a = 0). Ignored by "ode".
        prev_sample: when given, x' to score instead of sampling (replay). The log-prob is
            bit-for-bit the one sampling returned for the same inputs: both paths compute mean,
            std and the log-prob with the same helpers. Replay runs them inside ``_ScoredStep``,
            whose backward is closed-form (one autograd node instead of about ten).
        generator: RNG for sampling (ignored when ``noise`` or ``prev_sample`` is given).
        noise: optional pre-drawn standard normal of sample's shape, used instead of drawing;
            lets the rollout draw per-sample noise so results don't depend on batch composition.
        reduce: "mean" over non-batch dims (the anchors' convention) or "sum".
        validate: check sigma/noise_level values (each check is a host sync on GPU). The rollout
            passes False: its schedule and noise level were validated once, with the config.
            Shape and kind checks always run.
        log_prob: "exact" (Gaussian log-density) or "unscaled" (-mean_d (x' - mean)^2, Flow-GRPO's
            CPS convention); see ``LOG_PROBS``.
        schedule_bounds: (sigma_max, sigma_min) of the sampling schedule, its second and last
            sigma; required by "flash_sde", ignored by the other kinds.

    Returns:
        Transition with float32 prev_sample, mean, std (B,) and log_prob (B,).
        "ode" draws no noise, returns prev_sample = mean, std = 0 and log_prob = 0.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} (got {kind!r})")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS} (got {reduce!r})")
    if log_prob not in LOG_PROBS:
        raise ValueError(f"log_prob must be one of {LOG_PROBS} (got {log_prob!r})")
    x = _as_float32(sample, "sample")
    if x.ndim < 1:
        raise ValueError("sample must have a batch dimension (got a 0-d tensor)")
    v = _as_float32(velocity, "velocity").to(x.device)
    _check_velocity_shape(v, x)
    batch = x.shape[0]
    sigma_t = _per_sample(sigma, "sigma", batch, x.device, validate)
    sigma_next_t = _per_sample(sigma_next, "sigma_next", batch, x.device, validate)
    level = _per_sample(noise_level, "noise_level", batch, x.device, validate)
    if validate:
        _check_values(kind, sigma_t, sigma_next_t, level)
    if prev_sample is not None and noise is not None:
        raise ValueError("pass prev_sample (replay) or noise (sampling), not both")

    if prev_sample is not None:
        x_next = _as_float32(prev_sample, "prev_sample").to(x.device)
        if x_next.shape != x.shape:
            raise ValueError(f"prev_sample must have the shape of sample {tuple(x.shape)} "
                             f"(got {tuple(x_next.shape)})")
    numel = int(x[0].numel()) if batch else 0
    if kind == "ode":   # diffusers' x + v dt, bit for bit; the density is degenerate
        dt = sigma_next_t - sigma_t
        mean = x + v * _rows(dt, x.ndim)
        x_next = mean if prev_sample is None else x_next
        std = torch.zeros_like(sigma_t)
        gaussian = StepGaussian.build(torch.ones_like(dt), dt, std, numel, reduce)
        return Transition(prev_sample=x_next, mean=mean, std=std,
                          log_prob=gaussian.log_prob(x_next.detach() - mean), gaussian=gaussian)
    bounds = None
    if schedule_bounds is not None:
        bounds = tuple(_per_sample(value, name, batch, x.device, validate) for value, name in
                       zip(schedule_bounds, ("schedule_bounds[0]", "schedule_bounds[1]")))
    coef_x, coef_v, std = STOCHASTIC_STEPS[kind](sigma_t, sigma_next_t, level, bounds)
    gaussian = StepGaussian.build(coef_x, coef_v, std, numel, reduce, log_prob)
    if prev_sample is not None:
        log_prob, mean = _score(v, x, x_next, gaussian)
    else:
        mean = gaussian.mean(x, v)
        x_next = mean + _rows(std, x.ndim) * _standard_normal(x, noise, generator)
        log_prob = gaussian.log_prob(x_next.detach() - mean)
    return Transition(prev_sample=x_next, mean=mean, std=std, log_prob=log_prob,
                      gaussian=gaussian)


def step_entropy(kind: str, sigma: float | Tensor, sigma_next: float | Tensor,
                 noise_level: float | Tensor,
                 schedule_bounds: tuple[float, float] | None = None) -> Tensor:
    """(B,) differential entropy per element of a stochastic step's Gaussian,
    0.5 log(2 pi e std^2), with ``std`` the step's total std (``transition``'s).

    For flow_sde with sigma < 1 this is 0.5 log(2 pi e a^2 sigma / (1 - sigma) (sigma -
    sigma_next)): E-GRPO's entropy of a step, which grows with the step's length, so merging m
    steps sigma_k -> sigma_{k+m} into one (``plans.merged_schedule``) raises it. -inf where the
    std is 0 (a = 0). sigma, sigma_next, noise_level: (B,) or scalars, as ``transition``.
    """
    if kind not in STOCHASTIC_STEPS:
        raise ValueError(f"kind must be a stochastic kind {tuple(STOCHASTIC_STEPS)} (got {kind!r})")
    batch = max(torch.as_tensor(value).numel() for value in (sigma, sigma_next, noise_level))
    device = next((v.device for v in (sigma, sigma_next, noise_level) if isinstance(v, Tensor)),
                  torch.device("cpu"))
    sigma_t = _per_sample(sigma, "sigma", batch, device, True)
    sigma_next_t = _per_sample(sigma_next, "sigma_next", batch, device, True)
    level = _per_sample(noise_level, "noise_level", batch, device, True)
    _check_values(kind, sigma_t, sigma_next_t, level)
    bounds = None
    if schedule_bounds is not None:
        bounds = tuple(_per_sample(value, "schedule_bounds", batch, device, True)
                       for value in schedule_bounds)
    _, _, std = STOCHASTIC_STEPS[kind](sigma_t, sigma_next_t, level, bounds)
    return 0.5 * math.log(2.0 * math.pi * math.e) + torch.log(std)


def score_step(velocity: Tensor, sample: Tensor, next_sample: Tensor, gaussian: StepGaussian
               ) -> tuple[Tensor, Tensor]:
    """Score a recorded step again under a new velocity: the replay path of a trainer.

    velocity, sample, next_sample: (B, ...) (computed in float32); ``gaussian``: the
    ``Transition.gaussian`` of the step that produced ``next_sample``. Returns (log_prob (B,),
    mean (B, ...)), bit for bit what ``transition`` returned when it sampled ``next_sample`` from
    the same velocity. The gradient is closed-form (one autograd node, ``_ScoredStep``).
    """
    x = _as_float32(sample, "sample")
    v = _as_float32(velocity, "velocity").to(x.device)
    _check_velocity_shape(v, x)
    x_next = _as_float32(next_sample, "next_sample").to(x.device)
    if x_next.shape != x.shape:
        raise ValueError(f"next_sample must have the shape of sample {tuple(x.shape)} "
                         f"(got {tuple(x_next.shape)})")
    if tuple(gaussian.std.shape) != (x.shape[0],) or gaussian.numel != x[0].numel():
        raise ValueError(f"gaussian is for {tuple(gaussian.std.shape)} rows of {gaussian.numel} "
                         f"elements, sample has {x.shape[0]} rows of {x[0].numel()}")
    return _score(v, x, x_next, gaussian)


def _score(velocity: Tensor, sample: Tensor, next_sample: Tensor, gaussian: StepGaussian
           ) -> tuple[Tensor, Tensor]:
    """(log_prob, mean) of a given x'; plain autograd when the Gaussian carries a gradient."""
    if any(t.requires_grad for t in (gaussian.coef_x, gaussian.coef_v, gaussian.half_precision,
                                     gaussian.log_norm)):
        mean = gaussian.mean(sample, velocity)
        return gaussian.log_prob(next_sample.detach() - mean), mean
    mean, log_prob = _ScoredStep.apply(velocity, sample, next_sample.detach(), gaussian)
    return log_prob, mean


def region_log_probs(residual: Tensor, gaussian: StepGaussian, mask: Tensor,
                     keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A step's log-density split into an edit region and its complement (``training.locality``).

    The Gaussian factorises over elements: per element d, l_d = -(x'_d - mean_d)^2 / (2 std^2)
    - log std - log sqrt(2 pi), and the "mean" convention's log-prob is mean_d l_d. With region
    weights m_d in [0, 1] (1 = edit region) the two parts are the region means

        part_1 = sum_d m_d l_d / sum_d m_d,    part_2 = sum_d (1 - m_d) l_d / sum_d (1 - m_d)

    with shares s_1 = mean_d m_d, s_2 = 1 - s_1, so that s_1 part_1 + s_2 part_2 = mean_d l_d,
    the step's log-prob, exactly in real arithmetic. Each part is in the units of the whole
    (a mean over elements), so its log-ratio can be clipped with the same range. An empty part
    (share 0) has log-prob 0, as have both parts of a row whose std is 0 (``StepGaussian``).
    Under the "unscaled" convention l_d = -(x'_d - mean_d)^2.

    With ``keep`` (``training.locality.keep_region: record``) the second region is not the whole
    complement but the elements where the preservation objective is measured, with weights
    k_d (1 - m_d) (k_d in [0, 1]; the toy: the source's other objects): part_2 is their weighted
    mean, elements in neither region enter neither part, and the shares are the two regions'
    sizes over their sum (s_1 + s_2 = 1, so a row still weighs one row). The parts then no
    longer add up to the step's log-prob: the surrogate leaves out the elements no reward
    speaks for.

    Args:
        residual: (B, ...) x' - mean; carries the gradient of the mean when the caller needs it.
        gaussian: the step's ``StepGaussian``; its ``reduce`` must be "mean" (every rollout's).
        mask: region weights broadcastable to ``residual`` (e.g. (B, 1, H, W) for (B, C, H, W)
            latents), in [0, 1].
        keep: None (the rest is the complement) or preservation-region weights like ``mask``.

    Returns:
        (log_probs (B, 2), shares (B, 2)), float32: column 0 the edit region, column 1 the rest.
    """
    if gaussian.reduce != "mean":
        raise ValueError("region_log_probs needs the 'mean' log-prob convention (the shares "
                         "weigh region means); the rollout's steps use it")
    residual = _as_float32(residual, "residual")
    try:
        weights = torch.broadcast_to(mask.to(device=residual.device, dtype=torch.float32),
                                     residual.shape)
    except RuntimeError:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not broadcast to the latents "
                         f"{tuple(residual.shape)}") from None
    dims = tuple(range(1, residual.ndim))
    squared = residual.square()
    inside = weights.sum(dim=dims)
    if keep is None:
        rest = 1.0 - weights
        total = float(gaussian.numel)
        outside = total - inside
        shares = torch.stack([inside, outside], dim=1) / total
    else:
        try:
            rest = torch.broadcast_to(keep.to(device=residual.device, dtype=torch.float32),
                                      residual.shape) * (1.0 - weights)
        except RuntimeError:
            raise ValueError(f"keep shape {tuple(keep.shape)} does not broadcast to the latents "
                             f"{tuple(residual.shape)}") from None
        outside = rest.sum(dim=dims)
        sizes = torch.stack([inside, outside], dim=1)
        shares = sizes / sizes.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    sums = torch.stack([(weights * squared).sum(dim=dims), (rest * squared).sum(dim=dims)], dim=1)
    counts = torch.stack([inside, outside], dim=1)
    means = sums / counts.clamp(min=torch.finfo(torch.float32).tiny)
    log_probs = -(means * gaussian.half_precision[:, None] + gaussian.log_norm[:, None])
    keep = gaussian.stochastic[:, None] & (counts > 0)
    return torch.where(keep, log_probs, 0.0), shares


# ----------------------------------------------------------------------------- ODE solvers


def _log_snr(sigma: Tensor) -> Tensor:
    """lambda = log(alpha / sigma) with alpha = 1 - sigma; -inf at sigma = 1, +inf at sigma = 0."""
    return torch.log(1.0 - sigma) - torch.log(sigma)


def dpmpp_2m_step(sample: Tensor, velocity: Tensor, sigma: float | Tensor,
                  sigma_next: float | Tensor, *, prev_x0: Tensor | None = None,
                  prev_sigma: float | Tensor | None = None,
                  final: bool = False) -> tuple[Tensor, Tensor]:
    """One DPM-Solver++(2M) step (data prediction, multistep) from sigma to sigma_next.

    With alpha = 1 - sigma, lambda = log(alpha / sigma), h = lambda_next - lambda and
    x0_hat = x - sigma v:
        first order:  x' = (sigma_next / sigma) x - alpha_next (e^-h - 1) x0_hat
        second order: x' = first order - 0.5 alpha_next (e^-h - 1) D1,
                      D1 = (x0_hat - prev_x0) / r0, r0 = h_prev / h, h_prev = lambda - lambda_prev.
    The first-order step equals an Euler step in exact arithmetic (flow matching's DDIM).
    Second order is used per row when ``prev_x0``/``prev_sigma`` are given, ``final`` is False,
    sigma_next > 0 and prev_sigma < 1 (at prev_sigma = 1, lambda_prev = -inf and r0 = inf, i.e.
    D1 = 0). At sigma_next == 0 the step returns x0_hat exactly.

    Args:
        sample, velocity: (B, ...); computed in float32.
        sigma, sigma_next: (B,) or scalars, 0 <= sigma_next < sigma <= 1.
        prev_x0: x0_hat (B, ...) returned by the previous step, or None (first order).
        prev_sigma: the previous step's sigma (B,) or scalar, > sigma; required with prev_x0.
        final: force first order (the last step of a schedule).

    Returns:
        (next_sample, x0_hat), both (B, ...) float32; pass x0_hat and sigma as prev_x0 and
        prev_sigma to the next step.
    """
    x = _as_float32(sample, "sample")
    v = _as_float32(velocity, "velocity").to(x.device)
    _check_velocity_shape(v, x)
    if (prev_x0 is None) != (prev_sigma is None):
        raise ValueError("prev_x0 and prev_sigma must be given together (or both None)")
    batch, ndim = x.shape[0], x.ndim
    sigma_t = _per_sample(sigma, "sigma", batch, x.device)
    sigma_next_t = _per_sample(sigma_next, "sigma_next", batch, x.device)
    _check_sigma_pair(sigma_t, sigma_next_t)

    x0_hat = x - _rows(sigma_t, ndim) * v
    # e^-h = (sigma_next alpha) / (sigma alpha_next); alpha_next > 0 because sigma_next < 1.
    alpha, alpha_next = 1.0 - sigma_t, 1.0 - sigma_next_t
    exp_neg_h = (sigma_next_t * alpha) / (sigma_t * alpha_next)
    data_coef = alpha_next * (1.0 - exp_neg_h)                  # -alpha_next (e^-h - 1)
    next_sample = _rows(sigma_next_t / sigma_t, ndim) * x + _rows(data_coef, ndim) * x0_hat

    if prev_x0 is not None and not final:
        prev_x0_f = _as_float32(prev_x0, "prev_x0").to(x.device)
        if prev_x0_f.shape != x.shape:
            raise ValueError(f"prev_x0 must have the shape of sample {tuple(x.shape)} "
                             f"(got {tuple(prev_x0_f.shape)})")
        prev_sigma_t = _per_sample(prev_sigma, "prev_sigma", batch, x.device)
        if bool((prev_sigma_t <= sigma_t).any()) or bool((prev_sigma_t > 1).any()):
            raise ValueError("prev_sigma must be in (sigma, 1] for every sample (it is the sigma "
                             f"of the previous step); got {prev_sigma_t.tolist()} vs sigma "
                             f"{sigma_t.tolist()}")
        second_order = (sigma_next_t > 0) & (prev_sigma_t < 1)
        lam = _log_snr(sigma_t)
        h = torch.where(second_order, _log_snr(sigma_next_t) - lam, torch.ones_like(lam))
        h_prev = torch.where(second_order, lam - _log_snr(prev_sigma_t), torch.ones_like(lam))
        correction_coef = torch.where(second_order, 0.5 * data_coef * h / h_prev,
                                      torch.zeros_like(lam))               # 0.5 c / r0
        next_sample = next_sample + _rows(correction_coef, ndim) * (x0_hat - prev_x0_f)

    at_data = _rows(sigma_next_t == 0, ndim)
    next_sample = torch.where(at_data, x0_hat, next_sample)
    return next_sample, x0_hat


def ode_solve(velocity_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, sigmas: Tensor,
              solver: str = "euler") -> Tensor:
    """Integrate the probability-flow ODE along a whole schedule; one velocity call per step.

    Args:
        velocity_fn: (x (B, ...) float32, sigma (B,) float32) -> velocity (B, ...).
        x: (B, ...) start latents at sigmas[0].
        sigmas: (n+1,) strictly decreasing schedule in [0, 1].
        solver: "euler" or "dpmpp_2m" (second order from the second step on, first order on the
            final step).

    Returns:
        (B, ...) float32 latents at sigmas[-1].
    """
    if solver not in ODE_SOLVERS:
        raise ValueError(f"solver must be one of {ODE_SOLVERS} (got {solver!r})")
    sigmas = _as_float32(torch.as_tensor(sigmas), "sigmas")
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be a 1-D schedule of length >= 2 (got shape "
                         f"{tuple(sigmas.shape)})")
    if not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError("sigmas must be strictly decreasing")
    state = _as_float32(x, "x")
    batch = state.shape[0]
    sigmas = sigmas.to(state.device)
    prev_x0, prev_sigma = None, None
    num_steps = sigmas.numel() - 1
    for step in range(num_steps):
        sigma = sigmas[step].expand(batch)
        sigma_next = sigmas[step + 1].expand(batch)
        velocity = velocity_fn(state, sigma)
        if solver == "euler":
            state = transition("ode", velocity, state, sigma, sigma_next).prev_sample
        else:
            state, prev_x0 = dpmpp_2m_step(state, velocity, sigma, sigma_next, prev_x0=prev_x0,
                                           prev_sigma=prev_sigma, final=step == num_steps - 1)
            prev_sigma = sigma
    return state


# ----------------------------------------------------------------------------- schedules


def shift_sigma(sigma: float | Tensor, shift: float) -> float | Tensor:
    """SD3's static time shift: shift sigma / (1 + (shift - 1) sigma); shift > 0, 1 = identity."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0 (got {shift})")
    return shift * sigma / (1 + (shift - 1) * sigma)


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX's mu: linear in the packed image sequence length, base_shift at base_seq_len and
    max_shift at max_seq_len (extrapolated outside)."""
    if max_seq_len == base_seq_len:
        raise ValueError(f"max_seq_len must differ from base_seq_len (both {base_seq_len})")
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def exponential_time_shift(sigma: float | Tensor, mu: float) -> float | Tensor:
    """FLUX's dynamic shift: e^mu / (e^mu + 1/sigma - 1), sigma in (0, 1]."""
    return math.exp(mu) / (math.exp(mu) + (1.0 / sigma - 1.0))


def _check_num_steps(num_steps: int) -> None:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1 (got {num_steps!r})")


def static_shift_sigmas(num_steps: int, shift: float, num_train_timesteps: int = 1000) -> Tensor:
    """(num_steps + 1,) float32 SD3-style schedule ending at 0.

    Same as ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps).sigmas``:
    the grid runs linearly from 1 to the scheduler's sigma_min, which is the *shifted* last
    training sigma shift(1 / num_train_timesteps), and is then shifted again (so the last
    non-zero sigma is shift(shift(1/T)), e.g. 0.00893 for shift 3).
    """
    _check_num_steps(num_steps)
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1 (got {num_train_timesteps})")
    sigma_min = shift_sigma(1.0 / num_train_timesteps, shift)
    grid = torch.linspace(1.0, sigma_min, num_steps, dtype=torch.float64)
    sigmas = shift_sigma(grid, shift).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])


def dynamic_shift_sigmas(num_steps: int, image_seq_len: int, base_seq_len: int = 256,
                         max_seq_len: int = 4096, base_shift: float = 0.5,
                         max_shift: float = 1.15) -> Tensor:
    """(num_steps + 1,) float32 FLUX-style schedule ending at 0.

    Same as FluxPipeline with a ``use_dynamic_shifting`` scheduler: sigmas = linspace(1, 1/N, N),
    mu = calculate_shift(image_seq_len, ...), sigma' = e^mu / (e^mu + 1/sigma - 1), then 0.
    """
    _check_num_steps(num_steps)
    if image_seq_len < 1:
        raise ValueError(f"image_seq_len must be >= 1 (got {image_seq_len})")
    mu = calculate_shift(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift)
    grid = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    sigmas = exponential_time_shift(grid, mu).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])


def shifted_linear_sigmas(num_steps: int, shift: float, start: float = 1.0) -> Tensor:
    """(num_steps + 1,) float32: shift(linspace(start, 0, num_steps + 1)) with SD3's static shift.

    start = 1: MixGRPO's FLUX schedule (``sd3_time_shift(shift, linspace(1, 0, N + 1))``).
    start = 1 - 1/1000 = 0.999: the UniPC flow-sigma grid of the diffusers release Flash-GRPO's
    Wan runs sampled on (shift(linspace(0.999, 0, N + 1)) without its last point, then 0): for
    20 steps and shift 3 its timesteps are 999, 982, 963, 944, ... and sigmas[1] = 0.98242.
    """
    _check_num_steps(num_steps)
    if not 0 < start <= 1:
        raise ValueError(f"start must be in (0, 1] (got {start})")
    grid = torch.linspace(start, 0.0, num_steps + 1, dtype=torch.float64)
    sigmas = shift_sigma(grid, shift).to(torch.float32)
    sigmas[-1] = 0.0
    return sigmas
