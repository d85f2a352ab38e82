"""Which steps of a trajectory are stochastic, which are trained, and how the rest is solved.

A ``StepPlan`` is the schedule a trajectory actually visits plus the indices of its SDE steps.
Planners are pure functions of (config, base schedule, iteration, group_id, seed): every rank and
every member of a group derive the same plan without communicating, and no global RNG is used
(each draw seeds its own ``torch.Generator`` from a hash of the inputs and a salt).

Plan kinds (``PlanConfig.kind``):

* ``full`` (Flow-GRPO, DanceGRPO): every step but the last is stochastic (the last step to
  sigma = 0 is deterministic); the first ``int(num_steps * train_fraction)`` stochastic steps are
  trained (Flow-GRPO: 0.99 of 10 -> 9), or that many drawn per (iteration, group) (``random``),
  or int((num_steps - 1) * train_fraction) per sample (``random_per_sample``, DanceGRPO's
  per-sample permutation and count; the group's plan then lists every stochastic step as
  trained and ``sample_trained_steps`` gives each row its subset).
* ``window`` (MixGRPO): a sliding window of ``window_size`` stochastic+trained steps; Euler before
  it, ``solver_after`` after it; the start moves by ``window_stride`` every ``shift_interval``
  iterations (``progressive``), after a number of iterations that decays with the position
  (``decay``, ``exp_decay``: MixGRPO's other schedules) or is drawn per iteration (``random``),
  the same for all groups. ``window_end`` says how far the start runs before rolling back:
  ``fit`` (the window always fits the range), ``shrink`` (to the range end, the window shrinking
  on its last positions) or ``shrink_empty`` (one more position whose window is empty: MixGRPO's
  released ``GRPOTrainingStates``). MixGRPO-Flash: ``solver_after="dpmpp_2m"`` and
  ``compress_ratio < 1`` re-discretise the post-window stretch to fewer steps, as many as
  MixGRPO's code builds: with r steps after the window, max(int((r + 1) ratio) - 1, 1).
* ``branch`` (Flow-GRPO-Fast): a window whose start is drawn per (iteration, group); ODE elsewhere.
* ``one_step`` (Flash-GRPO): a single stochastic+trained step k drawn per (iteration, group);
  with ``one_step_select: cycle`` (TempFlow-GRPO) group g of iteration t takes
  k = lo + (t + g) mod (hi - lo) instead, so the groups of an iteration branch at consecutive
  steps and every step of the range is trained equally often.
* ``ode``: no stochastic step, ``solver_after`` throughout (Euler or DPM-Solver++(2M)): the
  rollouts of the algorithms that train on final samples (DiffusionNFT, AWM, DGPO, DPO).
* ``merge`` (E-GRPO): one stochastic+trained step that spans ``m`` steps of the base schedule,
  sigma_k -> sigma_{k+m} (the intermediate points are dropped from the visited schedule, so the
  SDE step is the transition kind's own step with dt = sigma_k - sigma_{k+m}: higher entropy
  than any of the m steps it replaces); ODE elsewhere. The branch steps k and their counts m are
  ``merge_at`` / ``merge_counts`` (E-GRPO's eta_step_list / eta_step_merge_list); group g of
  iteration t branches at merge_at[(t + g) % len(merge_at)], so the members of a group share
  their merged step and the group-normalised advantage is E-GRPO's "among samples sharing the
  merged step". ``merge_counts_for_entropy`` picks the counts by an entropy threshold.

* ``tree`` (TreeGRPO / BranchGRPO): the SDE steps are a window ``tree_window`` (default: the
  first to the last branch step); at each of ``tree_branch_at`` every node of the group's tree
  splits into ``tree_branching`` children, each continuing with its own noise, at the other
  window steps each node takes one SDE step; ODE before and after. A group is the tree's
  k^len(tree_branch_at) leaves; ``tree_trained`` prunes the trained window steps. The tree maths
  (node counts, backed-up rewards, depth-wise advantages) is ``flowgrpo/tree.py``, its rollout
  ``flowgrpo/tree_rollout.py``.

Steps before the last stochastic step are always Euler; steps after it use ``solver_after``.
``shared_prefix`` is the number of leading deterministic steps: when the members of a group share
their initial noise (the rollout's default) these are identical for the whole group and are
computed once per prompt. Every planner sets it to the first stochastic index.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from flowgrpo.checks import choice, config_field, int_at_least, is_number
from flowgrpo.errors import ConfigError
from flowgrpo.sde import ODE_SOLVERS, step_entropy

__all__ = [
    "PLAN_KINDS",
    "StepPlan",
    "PlanConfig",
    "make_plan",
    "window_start",
    "window_schedule",
    "compress_schedule",
    "compressed_steps",
    "sample_trained_steps",
    "dance_count",
    "replay_steps_per_chunk",
    "plan_seed",
    "merged_schedule",
    "merge_counts_for_entropy",
    "tree_steps",
]

TRAIN_SELECTS = ("first", "random", "random_per_sample")
TREE_BACKUPS = ("mean", "prob_weighted")
WINDOW_STRATEGIES = ("progressive", "decay", "exp_decay", "random")
WINDOW_ENDS = ("fit", "shrink", "shrink_empty")
ONE_STEP_SELECTS = ("random", "cycle")


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
    # tree plans: the steps at which every node splits into ``branching`` children (a subset of
    # ``stochastic``); () and 1 for every other plan, whose rows never share a node
    branch_at: tuple[int, ...] = ()
    branching: int = 1

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
        branch_at = _int_tuple(self.branch_at, "StepPlan.branch_at")
        object.__setattr__(self, "branch_at", branch_at)
        if not set(branch_at) <= set(stochastic) or \
                isinstance(self.branching, bool) or not isinstance(self.branching, int) or \
                self.branching < 1 or (self.branching > 1) != bool(branch_at):
            raise ValueError(f"StepPlan.branch_at must be stochastic steps and branching an int "
                             f">= 2 with them (1 without) (got branch_at={branch_at}, "
                             f"branching={self.branching!r}, stochastic={stochastic})")

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
                self.shared_prefix, self.branch_at, self.branching)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        return self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())


# ----------------------------------------------------------------------------- config




@dataclass
class PlanConfig:
    """``sampling.plan`` in the trainer's YAML: which steps are stochastic and trained."""

    kind: str = config_field(
        "full (Flow-GRPO / DanceGRPO) | window (MixGRPO) | branch (Flow-GRPO-Fast) | "
        "one_step (Flash-GRPO) | merge (E-GRPO: one SDE step merging several) | "
        "ode (no SDE step: the sample-based algorithms' rollouts) | tree (TreeGRPO / "
        "BranchGRPO: a group's tree branching inside an SDE window).",
        default="full")
    train_fraction: float = config_field(
        "full: train int(num_steps * train_fraction) of the num_steps - 1 stochastic steps "
        "(Flow-GRPO 0.99 -> 9 of 10); with train_select random_per_sample, DanceGRPO's "
        "int((num_steps - 1) * train_fraction) a sample (0.6 of 10 -> 5).", default=1.0)
    train_select: str = config_field(
        "full: 'first' trains the first ones in order (Flow-GRPO); 'random' draws them per "
        "(iteration, group), so the members of a group train the same steps; "
        "'random_per_sample' draws them per (iteration, sample) as DanceGRPO does.",
        default="first")
    window_size: int = config_field(
        "window/branch: number of consecutive stochastic+trained steps (MixGRPO 4; Fast 2-3).",
        default=4)
    window_stride: int = config_field(
        "window: steps the progressive window moves every shift_interval iterations; 0 freezes "
        "it at the range start (MixGRPO-Flash*).", default=1)
    shift_interval: int = config_field(
        "window: iterations between progressive moves (MixGRPO 25; Flash 20).", default=25)
    window_strategy: str = config_field(
        "window: 'progressive' (moves by window_stride every shift_interval iterations), 'decay' "
        "(stays int(max (1 - p / hi) + min p / hi) iterations at start p, at least min: "
        "decay_max_interval / decay_min_interval), 'exp_decay' (stays ceil(shift_interval "
        "exp(-exp_decay_rate max(0, p - exp_decay_threshold))) iterations) or 'random' (start "
        "drawn each iteration, the same for every group); MixGRPO's sample_strategy.",
        default="progressive")
    window_range: tuple[int, int] | None = config_field(
        "window: [lo, hi) steps the window may cover; None = all but the last step "
        "(MixGRPO: [0, num_steps - 2)).", default=None)
    window_end: str = config_field(
        "window: last start of a progressive/decay window before it rolls back: 'fit' (hi - "
        "window_size: the window always fits), 'shrink' (hi - 1: the window shrinks to the "
        "steps left in the range) or 'shrink_empty' (hi: one more position with no stochastic "
        "step, as MixGRPO's released GRPOTrainingStates).", default="fit")
    roll_back: bool = config_field(
        "window: when the progressive window passes its last start, go back to the range start "
        "(True) or stay at the last start (False).", default=True)
    decay_max_interval: int = config_field(
        "window, 'decay': iterations at the range start (MixGRPO's max_iters_per_group, 10 in "
        "its scripts).", default=10)
    decay_min_interval: int = config_field(
        "window, 'decay': iterations at the range end and the floor (MixGRPO's "
        "min_iters_per_group, 1 in its scripts).", default=1)
    exp_decay_threshold: int = config_field(
        "window, 'exp_decay': start index after which the interval decays (MixGRPO: 13).",
        default=13)
    exp_decay_rate: float = config_field(
        "window, 'exp_decay': decay rate k per step past the threshold (MixGRPO: 0.1).",
        default=0.1)
    solver_after: str = config_field(
        "Deterministic solver after the last stochastic step: 'euler' or 'dpmpp_2m' "
        "(MixGRPO-Flash).", default="euler")
    compress_ratio: float = config_field(
        "window: < 1 re-discretises the post-window stretch of r steps to "
        "max(int((r + 1) * ratio) - 1, 1) steps, MixGRPO's count (MixGRPO-Flash 0.4: 21 -> 7, "
        "Flash* 0.2: 21 -> 3).", default=1.0)
    branch_range: tuple[int, int] | None = config_field(
        "branch: [lo, hi) for the window start, drawn per (iteration, group); None = "
        "[0, num_steps // 2).", default=None)
    one_step_range: tuple[int, int] | None = config_field(
        "one_step: [lo, hi) for the stochastic step k, drawn per (iteration, group); None = "
        "[0, num_steps // 2) (Flash-GRPO: k in 0..9 of 20).", default=None)
    one_step_select: str = config_field(
        "one_step: how k is picked in one_step_range: 'random' (uniform per (iteration, group), "
        "Flash-GRPO) or 'cycle' (group g of iteration t takes lo + (t + g) mod (hi - lo): the "
        "groups of an iteration branch at consecutive steps and every step of the range is "
        "trained equally often; TempFlow-GRPO, whose reference branches at every step).",
        default="random")
    merge_at: list[int] = config_field(
        "merge: base-schedule steps k where a group branches with one merged SDE step (E-GRPO's "
        "eta_step_list; default [1]); group g of iteration t takes merge_at[(t + g) % len].",
        default_factory=lambda: [1])
    merge_counts: list[int] | None = config_field(
        "merge: base steps m each merged step spans, sigma_k -> sigma_{k+m} (E-GRPO's "
        "eta_step_merge_list), one per merge_at entry with k + m <= num_steps - 1; None = 1 "
        "each (an unmerged SDE step). plans.merge_counts_for_entropy picks them by entropy.",
        default=None)
    tree_branch_at: list[int] = config_field(
        "tree: base steps at which every node of a group's tree splits into tree_branching "
        "children (each then takes its own SDE noise); a group is the k^len leaves, so "
        "training.group_size must equal tree_branching ** len(tree_branch_at).",
        default_factory=lambda: [0, 1, 2])
    tree_branching: int = config_field(
        "tree: children per node at each branch step (k >= 2; BranchGRPO: 2).", default=2)
    tree_window: tuple[int, int] | None = config_field(
        "tree: [lo, hi) SDE steps, containing every tree_branch_at step; at a window step that "
        "is not a branch step each node takes one SDE step (one child); ODE outside. None = "
        "[first, last + 1) of tree_branch_at (every window step branches).", default=None)
    tree_trained: list[int] | None = config_field(
        "tree: the window steps whose edges are trained (BranchGRPO's depth pruning: the other "
        "steps are sampled, not trained); None = every window step.", default=None)
    tree_backup: str = config_field(
        "tree: a node's value from its children's: 'mean' (equal path probabilities) or "
        "'prob_weighted' (weighted by the softmax of the children's edge log-probs, "
        "BranchGRPO's tree_prob_weighted; flowgrpo/tree.py backup_values).", default="mean")

    def validate(self, num_steps: int) -> None:
        """Raise ConfigError naming ``sampling.plan.<field>`` for the first invalid field."""
        prefix = "sampling.plan."
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
            raise ConfigError(f"sampling.num_steps must be an int >= 2 for a training plan (the "
                              f"last step is deterministic) (got {num_steps!r})")
        choice(self.kind, PLAN_KINDS, prefix + "kind")
        choice(self.train_select, TRAIN_SELECTS, prefix + "train_select")
        choice(self.window_strategy, WINDOW_STRATEGIES, prefix + "window_strategy")
        choice(self.window_end, WINDOW_ENDS, prefix + "window_end")
        choice(self.one_step_select, ONE_STEP_SELECTS, prefix + "one_step_select")
        choice(self.tree_backup, TREE_BACKUPS, prefix + "tree_backup")
        choice(self.solver_after, ODE_SOLVERS, prefix + "solver_after")
        if not is_number(self.train_fraction) or not 0 < self.train_fraction <= 1:
            raise ConfigError(f"{prefix}train_fraction must be in (0, 1] "
                              f"(got {self.train_fraction!r})")
        if self.kind == "full" and int(num_steps * self.train_fraction) < 1:
            raise ConfigError(f"{prefix}train_fraction={self.train_fraction} trains "
                              f"int({num_steps} * {self.train_fraction}) = 0 steps; use at least "
                              f"{1 / num_steps:.4g}")
        if self.kind == "full" and self.train_select == "random_per_sample" and \
                dance_count(self, num_steps) < 1:
            raise ConfigError(f"{prefix}train_fraction={self.train_fraction} with train_select "
                              f"random_per_sample trains int(({num_steps} - 1) * "
                              f"{self.train_fraction}) = 0 steps a sample (DanceGRPO's count); use "
                              f"at least {1 / (num_steps - 1):.4g}")
        int_at_least(self.window_size, 1, prefix + "window_size")
        int_at_least(self.window_stride, 0, prefix + "window_stride")
        int_at_least(self.shift_interval, 1, prefix + "shift_interval")
        int_at_least(self.decay_min_interval, 1, prefix + "decay_min_interval")
        int_at_least(self.decay_max_interval, 1, prefix + "decay_max_interval")
        if self.decay_max_interval < self.decay_min_interval:
            raise ConfigError(f"{prefix}decay_max_interval ({self.decay_max_interval}) must be >= "
                              f"{prefix}decay_min_interval ({self.decay_min_interval})")
        int_at_least(self.exp_decay_threshold, 0, prefix + "exp_decay_threshold")
        if not is_number(self.exp_decay_rate) or not self.exp_decay_rate >= 0:
            raise ConfigError(f"{prefix}exp_decay_rate must be a number >= 0 "
                              f"(got {self.exp_decay_rate!r})")
        if not isinstance(self.roll_back, bool):
            raise ConfigError(f"{prefix}roll_back must be true or false (got {self.roll_back!r})")
        if not is_number(self.compress_ratio) or not 0 < self.compress_ratio <= 1:
            raise ConfigError(f"{prefix}compress_ratio must be in (0, 1] "
                              f"(got {self.compress_ratio!r})")
        if self.compress_ratio < 1 and self.kind != "window":
            raise ConfigError(f"{prefix}compress_ratio < 1 applies to kind 'window' only "
                              f"(MixGRPO-Flash); got kind {self.kind!r}")
        for name in ("window_range", "branch_range", "one_step_range"):
            _step_range(getattr(self, name), (0, 1), num_steps, prefix + name)
        _merge_pairs(self, num_steps)
        if self.kind == "tree":
            tree_steps(self, num_steps)


def _merge_pairs(config: PlanConfig, num_steps: int) -> list[tuple[int, int]]:
    """[(k, m)] of a merge plan, validated: ints, k >= 0, m >= 1, one count per step, and
    k + m <= num_steps - 1 when the kind is merge (the last step stays deterministic)."""
    prefix = "sampling.plan."
    steps, counts = config.merge_at, config.merge_counts
    if not isinstance(steps, (tuple, list)) or not steps or \
            any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in steps):
        raise ConfigError(f"{prefix}merge_at must be a non-empty list of step indices >= 0 "
                          f"(got {steps!r})")
    if counts is None:
        counts = [1] * len(steps)
    if not isinstance(counts, (tuple, list)) or len(counts) != len(steps) or \
            any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in counts):
        raise ConfigError(f"{prefix}merge_counts must be null or a list of ints >= 1, one per "
                          f"{prefix}merge_at entry ({len(steps)}) (got {counts!r})")
    pairs = list(zip(steps, counts))
    if config.kind == "merge":
        for k, m in pairs:
            if k + m > num_steps - 1:
                raise ConfigError(f"{prefix}merge_at {k} with merge_counts {m} ends at step "
                                  f"{k + m}, past num_steps - 1 = {num_steps - 1} (the last "
                                  f"step is deterministic): lower the count or the step")
    return pairs


def _step_range(value: Sequence[int] | None, default: tuple[int, int], num_steps: int,
                name: str) -> tuple[int, int]:
    """[lo, hi) with 0 <= lo < hi <= num_steps - 1 (the last step is never stochastic)."""
    if value is None:
        return default
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in value)):
        raise ConfigError(f"{name} must be a pair of ints [lo, hi) or null (got {value!r})")
    lo, hi = value
    if not 0 <= lo < hi <= num_steps - 1:
        raise ConfigError(f"{name} must satisfy 0 <= lo < hi <= num_steps - 1 = {num_steps - 1} "
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


def _window_bounds(config: PlanConfig, num_steps: int) -> tuple[int, int]:
    return _step_range(config.window_range, (0, num_steps - 1), num_steps,
                       "sampling.plan.window_range")


def window_schedule(config: PlanConfig, num_steps: int) -> list[tuple[int, int]]:
    """One cycle of a progressive / decay / exp_decay window: [(start, iterations at it)].

    Starts run lo, lo + stride, ... up to the last start of ``window_end`` (fit: hi - size;
    shrink: hi - 1; shrink_empty: hi). The iterations at start p are shift_interval
    (progressive), max(min, int(max (1 - p / hi) + min p / hi)) (decay) or
    ceil(shift_interval exp(-k max(0, p - threshold))) (exp_decay): MixGRPO's
    ``GRPOTrainingStates``, whose max_timesteps is hi (num_steps - 2 in its scripts).
    """
    config.validate(num_steps)
    lo, hi = _window_bounds(config, num_steps)
    last = {"fit": max(hi - config.window_size, lo), "shrink": hi - 1,
            "shrink_empty": hi}[config.window_end]
    starts = [lo] if config.window_stride == 0 else list(range(lo, last + 1, config.window_stride))
    schedule = []
    for start in starts:
        if config.window_strategy == "decay":
            progress = start / hi
            interval = max(config.decay_min_interval,
                           int(config.decay_max_interval * (1 - progress)
                               + config.decay_min_interval * progress))
        elif config.window_strategy == "exp_decay":
            excess = max(0, start - config.exp_decay_threshold)
            interval = max(1, math.ceil(config.shift_interval
                                        * math.exp(-config.exp_decay_rate * excess)))
        else:
            interval = config.shift_interval
        schedule.append((start, interval))
    return schedule


def window_start(config: PlanConfig, num_steps: int, iteration: int, seed: int) -> int:
    """Start of the MixGRPO window at ``iteration`` (the same for every group).

    With [lo, hi) = window_range (default [0, num_steps - 1)):
    * window_stride == 0: lo (frozen window, Flash*).
    * progressive / decay / exp_decay: walk ``window_schedule`` (each start held for its number
      of iterations); past the last start it rolls back to lo if roll_back (the schedule
      repeats), else stays at the last start of ``window_end``.
    * random: uniform in [lo, max(hi - size, lo)] (the window fits), drawn from (seed, iteration).
    A window starting at p covers [p, min(p + size, hi)): with window_end shrink / shrink_empty
    its last positions cover fewer steps (none at p = hi).
    """
    config.validate(num_steps)
    lo, hi = _window_bounds(config, num_steps)
    if config.window_stride == 0:
        return lo
    if config.window_strategy == "random":
        last = max(hi - config.window_size, lo)
        return _draw(lo, last + 1, _generator(seed, iteration, None, "window"))
    schedule = window_schedule(config, num_steps)
    cycle = sum(interval for _, interval in schedule)
    if iteration >= cycle:
        if not config.roll_back:
            last = {"fit": max(hi - config.window_size, lo), "shrink": hi - 1,
                    "shrink_empty": hi}[config.window_end]
            return last
        iteration %= cycle
    for start, interval in schedule:
        if iteration < interval:
            return start
        iteration -= interval
    raise AssertionError("unreachable: iteration is within one cycle")


def compress_schedule(sigmas: Tensor, num_steps: int, time_shift: float | None = None) -> Tensor:
    """Re-discretise a schedule (r+1,) into ``num_steps`` steps (num_steps+1,), same endpoints.

    Without ``time_shift``: points sit at evenly spaced fractional indices u_j = j r / num_steps
    and take the piecewise-linear interpolation of ``sigmas`` in the index, so the new points
    follow the shape of the original (shifted) schedule; when r is a multiple of num_steps the
    points are exactly every (r / num_steps)-th original point.

    With ``time_shift`` s (the schedule is shift_s(t) of a time t linear in the step index, as
    MixGRPO's ``sd3_time_shift(3, linspace(1, 0, N + 1))``): the points are
    shift_s(linspace(t_0, 0, num_steps + 1)) with t_0 the unshifted time of sigmas[0], what
    MixGRPO's DPM-Solver++ "post" grid is.
    """
    sigmas = _check_schedule(sigmas, "sigmas")
    intervals = sigmas.numel() - 1
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1 (got {num_steps!r})")
    if num_steps > intervals:
        raise ValueError(f"num_steps must be <= the {intervals} steps of sigmas: compression never "
                         f"refines (got {num_steps})")
    if time_shift is not None:
        if not time_shift > 0:
            raise ValueError(f"time_shift must be > 0 (got {time_shift})")
        first = float(sigmas[0])
        start_time = first / (time_shift - (time_shift - 1) * first)     # inverse of the shift
        grid = torch.linspace(start_time, 0.0, num_steps + 1, dtype=torch.float64)
        values = time_shift * grid / (1 + (time_shift - 1) * grid)
        values[0], values[-1] = sigmas[0].double(), sigmas[-1].double()
        return values.to(torch.float32)
    position = torch.arange(num_steps + 1, dtype=torch.float64) * (intervals / num_steps)
    position[-1] = intervals
    left = position.floor().long().clamp(max=intervals - 1)
    frac = position - left
    base = sigmas.double()
    values = base[left] * (1 - frac) + base[left + 1] * frac
    return values.to(torch.float32)


def compressed_steps(remaining: int, ratio: float) -> int:
    """Steps after a MixGRPO-Flash window of ``remaining`` original steps: MixGRPO builds
    int((remaining + 1) ratio) schedule points from the step after the window to 0, i.e. one
    step fewer, and at least one step here (its code degenerates to none when int(...) = 1)."""
    if ratio >= 1:
        return remaining
    return min(max(int((remaining + 1) * ratio) - 1, 1), remaining)


def _full_count(config: PlanConfig, num_steps: int) -> int:
    return min(int(num_steps * config.train_fraction), num_steps - 1)


def _full_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
               seed: int, time_shift: float | None = None) -> StepPlan:
    num_steps = sigmas.numel() - 1
    stochastic = tuple(range(num_steps - 1))
    count = _full_count(config, num_steps)
    if config.train_select == "first":
        trained = stochastic[:count]
    elif config.train_select == "random_per_sample":
        trained = stochastic          # each row trains its own subset: sample_trained_steps
    else:
        order = torch.randperm(len(stochastic), generator=_generator(seed, iteration, group_id,
                                                                     "full"))
        trained = tuple(sorted(stochastic[i] for i in order[:count].tolist()))
    return StepPlan(sigmas, stochastic, trained, config.solver_after, shared_prefix=0)


def _window_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
                 seed: int, time_shift: float | None = None) -> StepPlan:
    # one window for every group of an iteration (MixGRPO): group_id does not enter
    num_steps = sigmas.numel() - 1
    _, hi = _window_bounds(config, num_steps)
    start = window_start(config, num_steps, iteration, seed)
    end = min(start + config.window_size, hi)
    steps = tuple(range(start, end))
    if config.compress_ratio < 1 and steps:
        remaining = num_steps - end
        post_steps = compressed_steps(remaining, config.compress_ratio)
        sigmas = torch.cat([sigmas[:end], compress_schedule(sigmas[end:], post_steps, time_shift)])
    return StepPlan(sigmas, steps, steps, config.solver_after,
                    shared_prefix=min(start, num_steps) if steps else 0)


def _branch_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
                 seed: int, time_shift: float | None = None) -> StepPlan:
    num_steps = sigmas.numel() - 1
    lo, hi = _step_range(config.branch_range, (0, num_steps // 2), num_steps,
                         "sampling.plan.branch_range")
    start = _draw(lo, hi, _generator(seed, iteration, group_id, "branch"))
    steps = tuple(range(start, min(start + config.window_size, num_steps - 1)))
    return StepPlan(sigmas, steps, steps, config.solver_after, shared_prefix=start)


def _one_step_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
                   seed: int, time_shift: float | None = None) -> StepPlan:
    num_steps = sigmas.numel() - 1
    lo, hi = _step_range(config.one_step_range, (0, num_steps // 2), num_steps,
                         "sampling.plan.one_step_range")
    if config.one_step_select == "cycle":
        # no draw: consecutive groups take consecutive steps, shifted by one each iteration
        step = lo + (iteration + group_id) % (hi - lo)
    else:
        step = _draw(lo, hi, _generator(seed, iteration, group_id, "one_step"))
    return StepPlan(sigmas, (step,), (step,), config.solver_after, shared_prefix=step)


def merged_schedule(sigmas: Tensor, step: int, count: int) -> Tensor:
    """(N + 2 - count,) the schedule a trajectory merged at ``step`` visits: sigmas[:step + 1]
    then sigmas[step + count:], so its step ``step`` goes sigma_step -> sigma_{step + count}
    (dt = sigma_step - sigma_{step + count}) and the other steps are the base ones. count = 1
    returns the base schedule."""
    return torch.cat([sigmas[:step + 1], sigmas[step + count:]])


def _merge_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
                seed: int, time_shift: float | None = None) -> StepPlan:
    pairs = _merge_pairs(config, sigmas.numel() - 1)
    # every group of an iteration takes the next branch step, so all of them are trained
    # whenever the iteration has at least len(merge_at) groups (E-GRPO trains each of its
    # eta_step_list every iteration); no draw, so no salt
    step, count = pairs[(iteration + group_id) % len(pairs)]
    return StepPlan(merged_schedule(sigmas, step, count), (step,), (step,), config.solver_after,
                    shared_prefix=step)


def merge_counts_for_entropy(sigmas: Tensor, steps: Sequence[int], noise_level: float,
                             threshold: float, kind: str = "flow_sde") -> tuple[int, ...]:
    """E-GRPO's entropy rule for ``merge_counts``: for each branch step k, the smallest m >= 1
    whose merged step sigma_k -> sigma_{k+m} has per-element entropy (``sde.step_entropy``) at
    least ``threshold``, or the largest that keeps the last step deterministic (k + m <= N - 1)
    when none reaches it. sigmas: (N + 1,) base schedule."""
    sigmas = _check_schedule(sigmas, "sigmas")
    last = sigmas.numel() - 2
    counts = []
    for k in steps:
        if not 0 <= k < last:
            raise ValueError(f"step {k} must be in [0, {last}) (the merged step ends by step "
                             f"{last}, the last step is deterministic)")
        count = last - k
        for m in range(1, last - k + 1):
            entropy = step_entropy(kind, sigmas[k:k + 1], sigmas[k + m:k + m + 1], noise_level)
            if float(entropy) >= threshold:
                count = m
                break
        counts.append(count)
    return tuple(counts)


def tree_steps(config: PlanConfig, num_steps: int
               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(window, branch_at, trained) step tuples of a tree plan, validated: the branch steps
    strictly increasing inside the window [lo, hi) (0 <= lo < hi <= num_steps - 1: the last step
    is deterministic), k an int >= 2, the trained steps a non-empty subset of the window."""
    prefix = "sampling.plan."
    branch_at = config.tree_branch_at
    if not isinstance(branch_at, (tuple, list)) or not branch_at or \
            any(isinstance(b, bool) or not isinstance(b, int) for b in branch_at) or \
            any(b2 <= b1 for b1, b2 in zip(branch_at, branch_at[1:])):
        raise ConfigError(f"{prefix}tree_branch_at must be a non-empty, strictly increasing list "
                          f"of step indices (got {branch_at!r})")
    int_at_least(config.tree_branching, 2, prefix + "tree_branching")
    lo, hi = _step_range(config.tree_window, (branch_at[0], branch_at[-1] + 1), num_steps,
                         prefix + "tree_window")
    if branch_at[0] < lo or branch_at[-1] >= hi or lo < 0 or hi > num_steps - 1:
        raise ConfigError(f"{prefix}tree_branch_at {list(branch_at)} must lie in tree_window "
                          f"[{lo}, {hi}) with {hi} <= num_steps - 1 = {num_steps - 1} (the "
                          f"last step is deterministic)")
    window = tuple(range(lo, hi))
    trained = window if config.tree_trained is None else config.tree_trained
    if not isinstance(trained, (tuple, list)) or not trained or \
            any(isinstance(s, bool) or not isinstance(s, int) or s not in window
                for s in trained) or len(set(trained)) != len(trained):
        raise ConfigError(f"{prefix}tree_trained must be null or a non-empty list of distinct "
                          f"steps of tree_window [{lo}, {hi}) (got {config.tree_trained!r})")
    if config.solver_after != "euler":
        raise ConfigError(f"{prefix}solver_after {config.solver_after!r} is not supported by "
                          f"kind 'tree' (the tail after the window is Euler): set 'euler'")
    return window, tuple(branch_at), tuple(sorted(trained))


def _tree_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
               seed: int, time_shift: float | None = None) -> StepPlan:
    # the same tree for every group and iteration: no draw
    window, branch_at, trained = tree_steps(config, sigmas.numel() - 1)
    return StepPlan(sigmas, window, trained, config.solver_after, shared_prefix=window[0],
                    branch_at=branch_at, branching=config.tree_branching)


def _ode_plan(config: PlanConfig, sigmas: Tensor, iteration: int, group_id: int,
              seed: int, time_shift: float | None = None) -> StepPlan:
    # no SDE step: the sample-based algorithms (nft, awm, dgpo, dpo) train on final samples
    return StepPlan(sigmas, (), (), config.solver_after, shared_prefix=0)


def make_plan(config: PlanConfig, base_sigmas: Tensor, iteration: int, group_id: int,
              seed: int, time_shift: float | None = None) -> StepPlan:
    """The plan of group ``group_id`` at ``iteration``; a pure function of its arguments.

    Args:
        config: validated against ``num_steps = len(base_sigmas) - 1``.
        base_sigmas: (N+1,) strictly decreasing schedule from the model (``FlowModel.sigmas``).
        iteration: training iteration (>= 0); windows move with it, draws are keyed on it.
        group_id: the prompt group; only ``full``/random, ``branch``, ``one_step`` and ``merge``
            depend on it (window plans are the same for every group).
        seed: the run's seed.
        time_shift: the static shift of ``base_sigmas`` when it is shift(t) on a t grid linear
            in the index (``sde.shifted_linear_sigmas``); MixGRPO-Flash's compressed grid is
            then uniform in t as in its code (``compress_schedule``). None: compress by index.
    """
    sigmas = _check_schedule(base_sigmas, "base_sigmas")
    for name, value in (("iteration", iteration), ("group_id", group_id), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int (got {type(value).__name__})")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0 (got {iteration})")
    config.validate(sigmas.numel() - 1)
    return PLAN_BUILDERS[config.kind](config, sigmas, iteration, group_id, seed, time_shift)


def dance_count(config: PlanConfig, num_steps: int) -> int:
    """Steps each sample trains under ``train_select: random_per_sample``: DanceGRPO's
    int((num_steps - 1) * train_fraction), the fraction of its num_steps - 1 stochastic steps
    (its loops permute the timesteps without the last and train the first
    int(len * timestep_fraction)). The other selects train int(num_steps * train_fraction),
    Flow-GRPO's count (0.99 of 10 -> 9)."""
    return int((num_steps - 1) * config.train_fraction)


def sample_trained_steps(config: PlanConfig, plan: StepPlan, iteration: int, sample_id: int,
                         seed: int) -> tuple[int, ...]:
    """The steps of ``plan`` that sample ``sample_id`` trains: ``plan.trained``, except for
    ``train_select: random_per_sample`` (DanceGRPO), where ``dance_count`` of the plan's
    stochastic steps are drawn per (iteration, sample)."""
    if config.kind != "full" or config.train_select != "random_per_sample":
        return plan.trained
    count = dance_count(config, plan.num_steps)
    order = torch.randperm(len(plan.stochastic),
                           generator=_generator(seed, iteration, sample_id, "full_sample"))
    return tuple(sorted(plan.stochastic[i] for i in order[:count].tolist()))


def replay_steps_per_chunk(config: PlanConfig, num_steps: int) -> int:
    """Replay batches one rollout chunk (rows sharing a plan) makes: its trained steps (the most
    a window position or branch gives). With ``random_per_sample`` the rows of a chunk train
    different subsets, so nearly every stochastic step has some row to replay. The unit from
    which ``training.optimizer_steps_per_epoch`` derives the accumulation."""
    config.validate(num_steps)
    if config.kind == "full":
        if config.train_select == "random_per_sample":
            return num_steps - 1
        return _full_count(config, num_steps)
    if config.kind in ("one_step", "merge"):
        return 1
    if config.kind == "window":
        lo, hi = _window_bounds(config, num_steps)
        return min(config.window_size, hi - lo)
    if config.kind == "ode":
        return 0
    if config.kind == "tree":   # one replay batch per trained window step of a chunk of trees
        return len(tree_steps(config, num_steps)[2])
    return min(config.window_size, num_steps - 1)


# plan kind -> builder(config, sigmas, iteration, group_id, seed, time_shift) -> StepPlan
PLAN_BUILDERS = {"full": _full_plan, "window": _window_plan, "branch": _branch_plan,
                 "one_step": _one_step_plan, "merge": _merge_plan, "ode": _ode_plan,
                 "tree": _tree_plan}
PLAN_KINDS = tuple(PLAN_BUILDERS)
