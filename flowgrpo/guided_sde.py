"""Reward-gradient-guided SDE steps (Euphonium, arXiv 2602.04928): the rollout's stochastic step
x' ~ N(mean, std^2 I) gets its mean shifted along the gradient of a differentiable reward, so the
exploration of a rollout is steered toward high reward; with scale 0 it is the plain step bit for
bit (Flow-GRPO's, DanceGRPO's, ... whichever ``sampling.kind``).

The shift of a guided step (``guidance_shift``), for the reward's gradient g (B, ...) and the
step's total std (B,) and length dt = sigma - sigma_next:

========== ================================ ================================================
form       shift                            meaning
========== ================================ ================================================
tilt       scale * std^2 * g~               for a linear reward r = g . x the step's Gaussian
                                            tilted by exp(scale * r): N(mean + std^2 g / beta,
                                            std^2) with beta = 1 / scale, exactly
dt         scale * dt * g~                  Euphonium's released step with its
                                            USE_DELTA_T_FOR_GRADIENT_SCALING (what its script
                                            runs, scale 0.01)
constant   scale * g~                       Euphonium's released step without it
========== ================================ ================================================

g~ = g / (||g|| + 1e-8) per sample when ``normalize``, else g. Euphonium's code writes its
scale as eta^2 / (2 beta) times dt, which on its (DanceGRPO) SDE, std^2 = eta^2 dt, is
std^2 / (2 beta): ``tilt`` with scale = 1 / (2 beta) is the same step there.

The gradient is the reward's at the step's one-step prediction of the data, x0_hat = x - sigma v
(detached: the transformer is not differentiated), through the model's ``decode``: Euphonium's
latent process reward model scores the noisy latent with its timestep; the rewards here score
clean media, so they score x0_hat. Nothing of the shift depends on the policy's weights: it is a
constant of the update.

Which mean the log-prob is taken under (``log_prob_mean``):

- ``policy`` (Euphonium's script: USE_REWARD_GUIDED_MEAN_FOR_LOGPROB false, at sampling and at
  training): the guided sample is scored under the *unguided* policy N(mean, std^2). The update
  then raises the likelihood of good guided samples under the policy that has no reward model:
  the guidance is distilled into the velocity (with x' = mean_old + shift + std eps, the
  gradient of log p is (shift + std eps) / std^2 d mean, pulling the mean along the shift).
- ``guided``: scored under the guided Gaussian N(mean + shift, std^2) (``ShiftedStepGaussian``,
  the shift kept with the step): the exact log-density of the transition that was sampled.

Either way the replay re-scores with the same Gaussian, so the first inner pass has ratio 1.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from flowgrpo.checks import Section, choice, config_field, positive
from flowgrpo.errors import ConfigError
from flowgrpo.sde import StepGaussian, Transition, transition

GUIDANCE_FORMS = ("tilt", "dt", "constant")
LOG_PROB_MEANS = ("policy", "guided")
_NORM_EPS = 1e-8     # Euphonium's: g / (||g|| + 1e-8)


@dataclass
class RewardGuidanceConfig(Section):
    """``sampling.reward_guidance``: Euphonium's reward-gradient-guided rollouts."""

    reward: str = config_field(
        "Name of a differentiable reward (one with score_gradient, e.g. toy_proxy) whose "
        "gradient steers the stochastic steps; '' = no guidance.", default="")
    options: dict[str, Any] = config_field(
        "Options of the guidance reward (as a rewards.components entry's).",
        default_factory=dict)
    scale: float = config_field(
        "Strength of the shift; 0 = the unguided step bit for bit. tilt: 1 / beta of the "
        "tilted step; dt / constant: Euphonium's PROCESS_LATENT_REWARD_GUIDANCE_SCALE (0.01).",
        default=0.0)
    form: str = config_field(
        "Shift of the mean: 'tilt' (scale std^2 g), 'dt' (scale dt g, Euphonium's script) or "
        "'constant' (scale g) - flowgrpo/guided_sde.py.", default="tilt")
    normalize: bool = config_field(
        "Use g / ||g|| per sample (Euphonium's option; its script: false).", default=False)
    first_step: int = config_field(
        "First guided step (index into the rollout's steps; Euphonium's script: 12 of 16).",
        default=0)
    last_step: int | None = config_field(
        "Guided steps end before this index; None = to the end.", default=None)
    interval: int = config_field(
        "Guide every interval-th step from first_step.", default=1)
    log_prob_mean: str = config_field(
        "Mean the rollout's log-prob is taken under: 'policy' (the unguided mean: the update "
        "distils the guidance, Euphonium's script) or 'guided' (the guided mean: the exact "
        "density of the sampled transition).", default="policy")

    @property
    def enabled(self) -> bool:
        return bool(self.reward)

    def guides(self, step: int) -> bool:
        """Whether rollout step ``step`` (an index into the plan's sigmas) is guided."""
        if step < self.first_step or (self.last_step is not None and step >= self.last_step):
            return False
        return (step - self.first_step) % self.interval == 0

    def validate(self) -> None:
        where = "sampling.reward_guidance"
        choice(self.form, GUIDANCE_FORMS, f"{where}.form")
        choice(self.log_prob_mean, LOG_PROB_MEANS, f"{where}.log_prob_mean")
        positive(self.scale, f"{where}.scale", allow_zero=True)
        if not isinstance(self.first_step, int) or self.first_step < 0:
            raise ConfigError(f"{where}.first_step must be an int >= 0 (got {self.first_step!r})")
        if self.last_step is not None and (not isinstance(self.last_step, int)
                                           or self.last_step <= self.first_step):
            raise ConfigError(f"{where}.last_step must be None or an int > first_step "
                              f"({self.first_step}) (got {self.last_step!r})")
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ConfigError(f"{where}.interval must be an int >= 1 (got {self.interval!r})")
        if self.scale > 0 and not self.enabled:
            raise ConfigError(f"{where}.scale is {self.scale} but {where}.reward is empty: name "
                              f"a differentiable reward (e.g. toy_proxy) or set the scale to 0")


def check_guidance_reward(config, resolve_reward_class: Callable[[str], type]) -> None:
    """At config load (``FlowPolicy.check_config``, which passes the reward registry's
    ``resolve_reward_class``: name -> class): the guidance reward must exist and be
    differentiable (its class defines ``score_gradient``)."""
    guidance = config.sampling.reward_guidance
    if not guidance.enabled:
        return
    try:
        cls = resolve_reward_class(guidance.reward)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"sampling.reward_guidance.reward: {err}") from None
    if not callable(getattr(cls, "score_gradient", None)):
        raise ConfigError(
            f"sampling.reward_guidance.reward: {guidance.reward!r} is not differentiable (its "
            f"class {cls.__name__} has no score_gradient(media, prompts, metadata) -> (scores, "
            f"d scores / d media)); use one that has, e.g. toy_proxy, or set reward: ''")


# ----------------------------------------------------------------------------- maths


def _rows(values: Tensor, ndim: int) -> Tensor:
    return values.reshape(-1, *([1] * (ndim - 1)))


def guidance_shift(gradient: Tensor, std: Tensor, sigma: Tensor, sigma_next: Tensor, *,
                   form: str, scale: float, normalize: bool) -> Tensor:
    """(B, ...) float32 shift of a step's mean (table in the module docstring).

    gradient: (B, ...) d reward / d x; std: (B,) the step's total std; sigma, sigma_next: (B,).
    """
    choice(form, GUIDANCE_FORMS, "form")
    g = gradient.to(torch.float32)
    if normalize:
        norm = g.flatten(1).norm(dim=1)
        g = g / _rows(norm + _NORM_EPS, g.ndim)
    if form == "tilt":
        factor = scale * std.to(torch.float32).square()
    elif form == "dt":
        factor = scale * (sigma.to(torch.float32) - sigma_next.to(torch.float32))
    else:
        factor = torch.full_like(std, float(scale), dtype=torch.float32)
    return _rows(factor, g.ndim) * g


@dataclass
class ShiftedStepGaussian(StepGaussian):
    """A step Gaussian whose mean carries a constant ``offset`` (B, ...):
    mean = coef_x x + coef_v v + offset. The offset has no gradient, so the closed-form replay
    (``sde.score_step``) and its backward hold as they are; the guided log-prob of a replay is
    bit for bit the rollout's (both compute the mean with this method)."""

    offset: Tensor = None

    def mean(self, sample: Tensor, velocity: Tensor) -> Tensor:
        return super().mean(sample, velocity) + self.offset


def guided_transition(kind: str, velocity: Tensor, sample: Tensor, sigma: float | Tensor,
                      sigma_next: float | Tensor, gradient: Tensor, *, scale: float,
                      form: str = "tilt", normalize: bool = False, log_prob_mean: str = "policy",
                      noise: Tensor | None = None, generator: torch.Generator | None = None,
                      **step_options: Any) -> Transition:
    """One guided stochastic step: x' = mean + shift + std * noise.

    velocity, sample, gradient: (B, ...); sigma, sigma_next: (B,) or scalars; noise: (B, ...)
    standard normal, else drawn from ``generator``; ``step_options`` are ``sde.transition``'s
    (noise_level, reduce, validate, log_prob, schedule_bounds).
    Returns a Transition with prev_sample = x', std, and per ``log_prob_mean``: "policy" -> mean
    the unguided mean, log_prob under N(mean, std^2), gaussian the plain step's; "guided" ->
    mean = the guided mean, log_prob under N(mean + shift, std^2), gaussian a
    ``ShiftedStepGaussian``. With scale 0 the result equals ``sde.transition``'s bit for bit.
    """
    choice(log_prob_mean, LOG_PROB_MEANS, "log_prob_mean")
    if kind == "ode":
        raise ValueError("guided_transition guides a stochastic step; kind 'ode' has no noise")
    if noise is None:
        noise = torch.randn(sample.shape, generator=generator, dtype=torch.float32,
                            device=generator.device if generator is not None else sample.device)
    plain = transition(kind, velocity, sample, sigma, sigma_next, noise=noise, **step_options)
    batch = plain.std.shape[0]
    per_row = [torch.as_tensor(s, dtype=torch.float32, device=plain.std.device).reshape(-1)
               .expand(batch) for s in (sigma, sigma_next)]
    shift = guidance_shift(gradient.to(plain.mean.device), plain.std, *per_row, form=form,
                           scale=scale, normalize=normalize)
    if log_prob_mean == "policy":
        x_next = plain.prev_sample + shift
        gaussian, mean = plain.gaussian, plain.mean
    else:
        fields = {f.name: getattr(plain.gaussian, f.name)
                  for f in dataclasses.fields(StepGaussian)}
        gaussian = ShiftedStepGaussian(**fields, offset=shift)
        mean = plain.mean + shift      # gaussian.mean(x, v): the same two operations
        x_next = mean + _rows(plain.std, mean.ndim) * noise.to(mean.device, torch.float32)
    log_prob = gaussian.log_prob(x_next.detach() - mean)
    return Transition(prev_sample=x_next, mean=mean, std=plain.std, log_prob=log_prob,
                      gaussian=gaussian)


# ----------------------------------------------------------------------------- rollout side


class RewardGuidance:
    """What a rollout needs to guide its steps: the config, the differentiable reward and the
    model (for ``decode``), and the rows' prompts and metadata (``for_rows``)."""

    def __init__(self, config: RewardGuidanceConfig, reward, model,
                 prompts: list[str] | None = None, metadata: list[dict] | None = None):
        self.config = config
        self.reward = reward
        self.model = model
        self.prompts = prompts
        self.metadata = metadata

    def for_rows(self, prompts: list[str], metadata: list[dict]) -> "RewardGuidance":
        """This guidance for one rollout's batch (rows index ``prompts``/``metadata``)."""
        return RewardGuidance(self.config, self.reward, self.model, list(prompts),
                              list(metadata))

    def step_function(self, step: int, rows: Tensor) -> Callable[..., Transition]:
        """The transition of rollout step ``step`` for ``rows``: ``sde.transition`` when the step
        is not guided, else the guided one, with ``sde.transition``'s signature (at scale 0 it
        still runs, and gives the plain step bit for bit)."""
        if not self.config.guides(step):
            return transition
        return functools.partial(self._guided, rows=rows)

    def reward_gradient(self, x0: Tensor, rows: Tensor) -> Tensor:
        """(b, ...) d reward(decode(x0)) / d x0 for the rows' prompts: the reward's gradient
        with respect to its media, pulled back through ``decode``."""
        picked = rows.tolist()
        prompts = [self.prompts[i] for i in picked]
        metadata = [self.metadata[i] for i in picked]
        with torch.enable_grad():
            latents = x0.detach().to(self.model.dtype).requires_grad_(True)
            media = self.model.decode(latents)
            _, grad_media = self.reward.score_gradient(media.detach(), prompts, metadata)
            (grad,) = torch.autograd.grad(media, latents,
                                          grad_outputs=grad_media.to(media))
        return grad.to(torch.float32)

    def _guided(self, kind: str, velocity: Tensor, sample: Tensor, sigma: Tensor,
                sigma_next: Tensor, *, rows: Tensor, **options: Any) -> Transition:
        x = sample.to(torch.float32)
        x0 = x - _rows(sigma.to(torch.float32), x.ndim) * velocity.to(torch.float32)
        gradient = self.reward_gradient(x0, rows)
        c = self.config
        return guided_transition(kind, velocity, x, sigma, sigma_next, gradient, scale=c.scale,
                                 form=c.form, normalize=c.normalize,
                                 log_prob_mean=c.log_prob_mean, **options)


def load_guidance(config, model, device, load_reward: Callable[..., Any]
                  ) -> RewardGuidance | None:
    """The run's ``RewardGuidance``, or None without one: its reward loaded on ``device`` with
    ``load_reward`` (the reward registry's, passed by the policy)."""
    guidance = config.sampling.reward_guidance
    if not guidance.enabled:
        return None
    reward = load_reward({"name": guidance.reward, **guidance.options}, device=device)
    inner = getattr(reward, "inner", reward)
    if not callable(getattr(inner, "score_gradient", None)):
        raise ConfigError(f"sampling.reward_guidance.reward: {guidance.reward!r} has no "
                          f"score_gradient; use a differentiable reward (e.g. toy_proxy)")
    return RewardGuidance(guidance, inner, model)
