"""Which steps of a trajectory are stochastic, which are trained, and how the rest is solved.

A ``StepPlan`` is the schedule a trajectory actually visits plus the indices of its SDE steps.
Planners are pure functions of (config, base schedule, iteration, group_id, seed): every rank and
every member of a group derive the same plan without communicating, and no global RNG is used
(each draw seeds its own ``torch.Generator`` from a hash of the inputs and a salt).

Plan kinds (``PlanConfig.kind``):

* ``full`` (Flow-GRPO, DanceGRPO): every step but the last is stochastic (the last step to
  sigma = 0 is deterministic); the first ``int(num_steps * train_fraction)`` stochastic steps are
  trained (Flow-GRPO: 0.99 of 10 -> 9), or that many drawn per (iteration, group) (DanceGRPO).
* ``window`` (MixGRPO): a sliding window of ``window_size`` stochastic+trained steps; Euler before
  it, ``solver_after`` after it; the start moves every ``shift_interval`` iterations
  (``progressive``) or is drawn per iteration (``random``), the same for all groups.
  MixGRPO-Flash: ``solver_after="dpmpp_2m"`` and ``compress_ratio < 1`` re-discretise the
  post-window stretch to fewer steps.
* ``branch`` (Flow-GRPO-Fast): a window whose start is drawn per (iteration, group); ODE elsewhere.
* ``one_step`` (Flash-GRPO): a single stochastic+trained step k drawn per (iteration, group).

Steps before the last stochastic step are always Euler; steps after it use ``solver_after``.
``shared_prefix`` is the number of leading deterministic steps: when the members of a group share
their initial noise (the rollout's default) these are identical for the whole group and are
computed once per prompt. Every planner sets it to the first stochastic index.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from flowgrpo.sde import ODE_SOLVERS

__all__ = [
    "PLAN_KINDS",
    "StepPlan",
    "PlanConfig",
    "make_plan",
    "window_start",
    "compress_schedule",
    "plan_seed",
]

TRAIN_SELECTS = ("first", "random")
WINDOW_STRATEGIES = ("progressive", "random")


# ----------------------------------------------------------------------------- StepPlan


def _int_tuple(values: Sequence[int], name: str) -> tuple[int, ...]:
    out = tuple(values)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in out):
        raise TypeError(f"{name} must be a tuple of ints (got {values!r})")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"{name} must be strictly increasing step indices (got {out})")
    return out


def _check_schedule(sigmas: Tensor, name: str) -> Tensor:
    if not isinstance(sigmas, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(sigmas).__name__})")
    sigmas = sigmas.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(f"{name} must be a 1-D schedule with at least 2 entries "
                         f"(got shape {tuple(sigmas.shape)})")
    in_range = bool(torch.isfinite(sigmas).all()) and 0 <= sigmas.min() and sigmas.max() <= 1
    if not in_range:
        raise ValueError(f"{name} must lie in [0, 1] (got {sigmas.tolist()})")
    if not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError(f"{name} must be strictly decreasing (got {sigmas.tolist()})")
    return sigmas


@dataclass(frozen=True, eq=False)
class StepPlan:
    """The steps one trajectory visits and what happens at each.

    sigmas:        (n+1,) float32 CPU schedule actually visited (after any compression).
    stochastic:    step indices (into sigmas[:-1]) that take an SDE transition.
    trained:       subset of ``stochastic`` the policy is trained on.
    solver_after:  "euler" or "dpmpp_2m": deterministic solver for steps after the last
                   stochastic one; deterministic steps before it are always Euler.
    shared_prefix: number of leading deterministic steps, identical for a whole group that shares
                   its initial noise and prompt (computed once per prompt).

    Plans compare and hash by ``key()``, so the rollout can batch groups that share a plan.
    """

    sigmas: Tensor
    stochastic: tuple[int, ...]
    trained: tuple[int, ...]
    solver_after: str = "euler"
    shared_prefix: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigmas", _check_schedule(self.sigmas, "StepPlan.sigmas"))
        stochastic = _int_tuple(self.stochastic, "StepPlan.stochastic")
        trained = _int_tuple(self.trained, "StepPlan.trained")
        object.__setattr__(self, "stochastic", stochastic)
        object.__setattr__(self, "trained", trained)
        num_steps = self.num_steps
        if stochastic and (stochastic[0] < 0 or stochastic[-1] >= num_steps):
            raise ValueError(f"StepPlan.stochastic indices must be in [0, {num_steps}) "
                             f"(got {stochastic})")
        if not set(trained) <= set(stochastic):
            raise ValueError(f"StepPlan.trained must be a subset of StepPlan.stochastic "
                             f"(got trained={trained}, stochastic={stochastic})")
        if self.solver_after not in ODE_SOLVERS:
            raise ValueError(f"StepPlan.solver_after must be one of {ODE_SOLVERS} "
                             f"(got {self.solver_after!r})")
        first_stochastic = stochastic[0] if stochastic else num_steps
        if (isinstance(self.shared_prefix, bool) or not isinstance(self.shared_prefix, int)
                or not 0 <= self.shared_prefix <= first_stochastic):
            raise ValueError(f"StepPlan.shared_prefix must be an int in [0, {first_stochastic}] "
                             "(the leading deterministic steps) "
                             f"(got {self.shared_prefix!r})")

    @property
    def num_steps(self) -> int:
        """Number of transitions, len(sigmas) - 1."""
        return self.sigmas.numel() - 1

    @property
    def nfe(self) -> int:
        """Transformer evaluations per sample: one per visited step (CFG is the model's)."""
        return self.num_steps

    def solver_for(self, step: int) -> str:
        """What ``step`` does: "sde", "euler", or ``solver_after`` (after the last SDE step)."""
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step must be in [0, {self.num_steps}) (got {step})")
        if step in self.stochastic:
            return "sde"
        if self.stochastic and step < self.stochastic[-1]:
            return "euler"
        return self.solver_after

    def key(self) -> tuple:
        """Hashable identity: schedule values, step indices, solver and shared prefix."""
        return (tuple(self.sigmas.tolist()), self.stochastic, self.trained, self.solver_after,
                self.shared_prefix)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        return self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())


# ----------------------------------------------------------------------------- config


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class PlanConfig:
    """``sampling.plan`` in the trainer's YAML: which steps are stochastic and trained."""

    kind: str = field(default="full", metadata=_help(
        "full (Flow-GRPO / DanceGRPO) | window (MixGRPO) | branch (Flow-GRPO-Fast) | "
        "one_step (Flash-GRPO)."))
    train_fraction: float = field(default=1.0, metadata=_help(
        "full: train int(num_steps * train_fraction) of the num_steps - 1 stochastic steps "
        "(Flow-GRPO 0.99 -> 9 of 10; DanceGRPO 0.6)."))
    train_select: str = field(default="first", metadata=_help(
        "full: 'first' trains the first ones in order (Flow-GRPO); 'random' draws them per "
        "(iteration, group) (DanceGRPO)."))
    window_size: int = field(default=4, metadata=_help(
        "window/branch: number of consecutive stochastic+trained steps (MixGRPO 4; Fast 2-3)."))
    window_stride: int = field(default=1, metadata=_help(
        "window: steps the progressive window moves every shift_interval iterations; 0 freezes "
        "it at the range start (MixGRPO-Flash*)."))
    shift_interval: int = field(default=25, metadata=_help(
        "window: iterations between progressive moves (MixGRPO 25; Flash 20)."))
    window_strategy: str = field(default="progressive", metadata=_help(
        "window: 'progressive' (moves by window_stride every shift_interval iterations) or "
        "'random' (start drawn each iteration, the same for every group)."))
    window_range: tuple[int, int] | None = field(default=None, metadata=_help(
        "window: [lo, hi) steps the window may cover; None = all but the last step."))
    roll_back: bool = field(default=True, metadata=_help(
        "window: when the progressive window passes the range end, go back to the range start "
        "(True) or stay at the last start that fits (False)."))
    solver_after: str = field(default="euler", metadata=_help(
        "Deterministic solver after the last stochastic step: 'euler' or 'dpmpp_2m' "
        "(MixGRPO-Flash)."))
    compress_ratio: float = field(default=1.0, metadata=_help(
        "window: < 1 re-discretises the post-window stretch of r steps to "
        "max(int(r * ratio), 1) steps (MixGRPO-Flash 0.4, Flash* 0.2)."))
    branch_range: tuple[int, int] | None = field(default=None, metadata=_help(
        "branch: [lo, hi) for the window start, drawn per (iteration, group); None = "
        "[0, num_steps // 2)."))
    one_step_range: tuple[int, int] | None = field(default=None, metadata=_help(
        "one_step: [lo, hi) for the stochastic step k, drawn per (iteration, group); None = "
        "[0, num_steps // 2) (Flash-GRPO: k in 0..9 of 20)."))

    def validate(self, num_steps: int) -> None:
        """Raise ValueError naming ``sampling.plan.<field>`` for the first invalid field."""
        prefix = "sampling.plan."
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
            raise ValueError(f"sampling.num_steps must be an int >= 2 for a training plan (the "
                             f"last step is deterministic) (got {num_steps!r})")
        _choice(self.kind, PLAN_KINDS, prefix + "kind")
        _choice(self.train_select, TRAIN_SELECTS, prefix + "train_select")
        _choice(self.window_strategy, WINDOW_STRATEGIES, prefix + "window_strategy")
        _choice(self.solver_after, ODE_SOLVERS, prefix + "solver_after")
        if not _is_number(self.train_fraction) or not 0 < self.train_fraction <= 1:
            raise ValueError(f"{prefix}train_fraction must be in (0, 1] "
                             f"(got {self.train_fraction!r})")
        if self.kind == "full" and int(num_steps * self.train_fraction) < 1:
            raise ValueError(f"{prefix}train_fraction={self.train_fraction} trains "
                             f"int({num_steps} * {self.train_fraction}) = 0 steps; use at least "
                             f"{1 / num_steps:.4g}")
        _int_at_least(self.window_size, 1, prefix + "window_size")
        _int_at_least(self.window_stride, 0, prefix + "window_stride")
        _int_at_least(self.shift_interval, 1, prefix + "shift_interval")
        if not isinstance(self.roll_back, bool):
            raise ValueError(f"{prefix}roll_back must be true or false (got {self.roll_back!r})")
        if not _is_number(self.compress_ratio) or not 0 < self.compress_ratio <= 1:
            raise ValueError(f"{prefix}compress_ratio must be in (0, 1] "
                             f"(got {self.compress_ratio!r})")
        if self.compress_ratio < 1 and self.kind != "window":
            raise ValueError(f"{prefix}compress_ratio < 1 applies to kind 'window' only "
                             f"(MixGRPO-Flash); got kind {self.kind!r}")
        for name in ("window_range", "branch_range", "one_step_range"):
            _step_range(getattr(self, name), (0, 1), num_steps, prefix + name)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choice(value: object, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices} (got {value!r})")


def _int_at_least(value: object, minimum: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} (got {value!r})")


def _step_range(value: Sequence[int] | None, default: tuple[int, int], num_steps: int,
                name: str) -> tuple[int, int]:
    """[lo, hi) with 0 <= lo < hi <= num_steps - 1 (the last step is never stochastic)."""
    if value is None:
        return default
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in value)):
        raise ValueError(f"{name} must be a pair of ints [lo, hi) or null (got {value!r})")
    lo, hi = value
    if not 0 <= lo < hi <= num_steps - 1:
        raise ValueError(f"{name} must satisfy 0 <= lo < hi <= num_steps - 1 = {num_steps - 1} "
                         f"(the last step is deterministic) (got [{lo}, {hi}))")
    return lo, hi


# ----------------------------------------------------------------------------- randomness


def plan_seed(seed: int, iteration: int, group_id: int | None, salt: str) -> int:
    """A 63-bit seed from (seed, iteration, group_id, salt), stable across processes and runs."""
    text = f"flowgrpo.plans|{seed}|{iteration}|{group_id}|{salt}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2 ** 63 - 1)


def _generator(seed: int, iteration: int, group_id: int | None, salt: str) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(plan_seed(seed, iteration, group_id, salt))
    return generator


def _draw(lo: int, hi: int, generator: torch.Generator) -> int:
    """Uniform int in [lo, hi)."""
    return int(torch.randint(lo, hi, (1,), generator=generator).item())


# ----------------------------------------------------------------------------- planners


def window_start(config: PlanConfig, num_steps: int, iteration: int, seed: int) -> int:
    """Start of the MixGRPO window at ``iteration`` (the same for every group).

    With [lo, hi) = window_range (default [0, num_steps - 1)) and last = max(hi - size, lo), the
    last start at which the window still fits:
    * window_stride == 0: lo (frozen window, Flash*).
    * progressive: lo + (iteration // shift_interval) * stride; past ``last`` it rolls back to lo
      (cycling through lo, lo + stride, ... <= last) if roll_back, else stays at ``last``.
    * random: uniform in [lo, last], drawn from (seed, iteration).
    """
    config.validate(num_steps)
    lo, hi = _step_range(config.window_range, (0, num_steps - 1), num_steps,
                         "sampling.plan.window_range")
    last = max(hi - config.window_size, lo)
    if config.window_stride == 0:
        return lo
    if config.window_strategy == "random":
        return _draw(lo, last + 1, _generator(seed, iteration, None, "window"))
    moves = iteration // config.shift_interval
    if config.roll_back:
        positions = (last - lo) // config.window_stride + 1
        return lo + (moves % positions) * config.window_stride
    return min(lo + moves * config.window_stride, last)


def compress_schedule(sigmas: Tensor, num_steps: int) -> Tensor:
    """Re-discretise a schedule (r+1,) into ``num_steps`` steps (num_steps+1,), same endpoints.

    Points sit at evenly spaced fractional indices u_j = j r / num_steps and take the piecewise-
    linear interpolation of ``sigmas`` in the index, so the new points follow the shape of the
    original (shifted) schedule: with a schedule f(1 - i/N) this approximates MixGRPO's
    f(linspace) re-discretisation, and when r is a multiple of num_steps the points are exactly
    every (r / num_steps)-th original point.
    """
    sigmas = _check_schedule(sigmas, "sigmas")
    intervals = sigmas.numel() - 1
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1 (got {num_steps!r})")
    if num_steps > intervals:
        raise ValueError(f"num_steps must be <= the {intervals} steps of sigmas: compression never "
                         f"refines (got {num_steps})")
    position = torch.arange(num_steps + 1, dtype=torch.float64) * (intervals / num_steps)
    position[-1] = intervals
    left = position.floor().long().clamp(max=intervals - 1)
    frac = position - left
    base = sigmas.double()
    values = base[left] * (1 - frac) + base[left + 1] * frac
    return values.to(torch.float32)


def _full_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
               seed: int) -> StepPlan:
    num_steps = sigmas.numel() - 1
    stochastic = tuple(range(num_steps - 1))
    count = min(int(num_steps * config.train_fraction), len(stochastic))
    if config.train_select == "first":
        trained = stochastic[:count]
    else:
        order = torch.randperm(len(stochastic), generator=_generator(seed, iteration, group_id,
                                                                     "full"))
        trained = tuple(sorted(stochastic[i] for i in order[:count].tolist()))
    return StepPlan(sigmas, stochastic, trained, config.solver_after, shared_prefix=0)


def _window_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
                 seed: int) -> StepPlan:
    # one window for every group of an iteration (MixGRPO): group_id does not enter
    num_steps = sigmas.numel() - 1
    _, hi = _step_range(config.window_range, (0, num_steps - 1), num_steps,
                        "sampling.plan.window_range")
    start = window_start(config, num_steps, iteration, seed)
    end = min(start + config.window_size, hi)
    steps = tuple(range(start, end))
    if config.compress_ratio < 1:
        remaining = num_steps - end
        post_steps = min(max(int(remaining * config.compress_ratio), 1), remaining)
        sigmas = torch.cat([sigmas[:end], compress_schedule(sigmas[end:], post_steps)])
    return StepPlan(sigmas, steps, steps, config.solver_after, shared_prefix=start)


def _branch_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
                 seed: int) -> StepPlan:
    num_steps = sigmas.numel() - 1
    lo, hi = _step_range(config.branch_range, (0, num_steps // 2), num_steps,
                         "sampling.plan.branch_range")
    start = _draw(lo, hi, _generator(seed, iteration, group_id, "branch"))
    steps = tuple(range(start, min(start + config.window_size, num_steps - 1)))
    return StepPlan(sigmas, steps, steps, config.solver_after, shared_prefix=start)


def _one_step_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
                   seed: int) -> StepPlan:
    num_steps = sigmas.numel() - 1
    lo, hi = _step_range(config.one_step_range, (0, num_steps // 2), num_steps,
                         "sampling.plan.one_step_range")
    step = _draw(lo, hi, _generator(seed, iteration, group_id, "one_step"))
    return StepPlan(sigmas, (step,), (step,), config.solver_after, shared_prefix=step)


def make_plan(config: PlanConfig, base_sigmas: Tensor, iteration: int, group_id: int,
              seed: int) -> StepPlan:
    """The plan of group ``group_id`` at ``iteration``; a pure function of its arguments.

    Args:
        config: validated against ``num_steps = len(base_sigmas) - 1``.
        base_sigmas: (N+1,) strictly decreasing schedule from the model (``FlowModel.sigmas``).
        iteration: training iteration (>= 0); windows move with it, draws are keyed on it.
        group_id: the prompt group; only ``full``/random, ``branch`` and ``one_step`` depend on
            it (window plans are the same for every group).
        seed: the run's seed.
    """
    sigmas = _check_schedule(base_sigmas, "base_sigmas")
    for name, value in (("iteration", iteration), ("group_id", group_id), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int (got {type(value).__name__})")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0 (got {iteration})")
    config.validate(sigmas.numel() - 1)
    return PLAN_BUILDERS[config.kind](config, sigmas, iteration, group_id, seed)


# plan kind -> builder(config, sigmas, iteration, group_id, seed) -> StepPlan
PLAN_BUILDERS = {"full": _full_plan, "window": _window_plan, "branch": _branch_plan,
                 "one_step": _one_step_plan}
PLAN_KINDS = tuple(PLAN_BUILDERS)
