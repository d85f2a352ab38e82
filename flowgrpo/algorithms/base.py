"""What every algorithm of ``flowgrpo/algorithms/`` provides, and the parts the sample-based ones
share: the replay unit of a final sample at one noise level, the draw of those noise levels and
of the forward-process noise, and the "old" policy (an EMA of the trained weights).

An algorithm is built by ``FlowPolicy`` with the policy itself (its model, config, reference
policy and training forward) and answers the trainer's per-update questions through the policy:
which replay units an iteration's rollout yields, their loss weights, the loss of one unit, the
update's statistics, and what happens after each optimiser step and each update.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import Tensor

from flowgrpo.errors import ConfigError
from flowgrpo.losses import velocity_anchor
from flowgrpo.matching_losses import (discrete_sigma_choices, logit_normal_sigmas,
                                      noised_latents, old_policy_decay, velocity_error)
from flowgrpo.seeding import seeded_generator

if TYPE_CHECKING:
    from flowgrpo.flow_policy import FlowPolicy
    from flowgrpo.rollout import RolloutBatch


class FlowAlgorithm:
    """The algorithm half of a ``FlowPolicy``. Subclasses set ``keeps_transitions`` (True: the
    rollout keeps its trained SDE transitions as replay batches, GRPO; False: only final
    samples) and implement ``loss``."""

    name = "base"
    keeps_transitions = True

    def __init__(self, policy: FlowPolicy) -> None:
        self.policy = policy
        self.config = policy.config

    # ------------------------------------------------------------------ rollout
    def sampling_weights(self, iteration: int):
        """The weights the rollout samples with (a context manager): the current ones."""
        return nullcontext()

    def replays(self, batch: RolloutBatch, iteration: int) -> list:
        """The replay units of an iteration's rollout that the update iterates over (each with
        ``rows``, indices into ``batch``)."""
        return batch.replay

    # ------------------------------------------------------------------ update
    def step_weights(self, replays: list) -> list[Tensor]:
        """Per-row loss weights of each replay unit (ones unless the algorithm reweights)."""
        return [torch.ones(len(r.rows), device=self.policy.model.device) for r in replays]

    def loss(self, batch: RolloutBatch, replay: Any, advantages: Tensor, iteration: int,
             clip_high: float, weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one replay unit and a record of detached statistics."""
        raise NotImplementedError

    def update_metrics(self, rows: dict[str, Tensor], clip_high: float) -> dict[str, Tensor]:
        """The update's statistics from the concatenated records: the mean of each."""
        return {key: values.float().mean() for key, values in rows.items()}

    def after_optimizer_step(self) -> None:
        """Called after each optimiser step that changed the weights."""

    def after_update(self) -> dict[str, float]:
        """Called once per iteration after its update; returns metrics."""
        return {}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> tuple[dict, dict[str, Tensor]]:
        """(JSON-able state, tensors) that a checkpoint keeps for an exact resume."""
        return {}, {}

    def load_state_dict(self, state: dict, tensors: dict[str, Tensor]) -> None:
        """Restore ``state_dict``'s output."""

    def check_engine(self, sharded: bool) -> None:
        """Refuse an engine the algorithm cannot run on (called when the engine is known)."""

    # ------------------------------------------------------------------ the image guard
    def add_anchor(self, loss: Tensor, record: dict, unit: UnitForward, batch: RolloutBatch,
                   replay: SampleReplay, iteration: int, weights: Tensor) -> Tensor:
        """``training.anchor_beta`` for a sample-based algorithm: loss + beta times the mean over
        ``training.anchor_steps`` levels of ``losses.velocity_anchor`` (the squared velocity gap
        to the reference), on the unit's final samples re-noised at levels below every training
        level (``anchor_levels``). GRPO anchors the rollout's own states at its untrained steps;
        these rollouts keep no states, so the forward process of the policy's samples stands in
        for them (the same marginals when the policy's flow is exact). Applied on each chunk's
        first unit (slot 0), so once per chunk and pass, as GRPO's; levels and noise are keyed by
        (seed, iteration, the chunk's first sample id)."""
        t = self.config.training
        if t.anchor_beta <= 0 or replay.slot != 0:
            return loss
        levels = anchor_levels(self.policy.base_sigmas, t.timesteps.fraction, t.anchor_sigma_max)
        if levels.numel() == 0:
            raise ConfigError(
                f"training.anchor_beta anchors the schedule's levels below the training levels "
                f"(training.timesteps.fraction {t.timesteps.fraction}) and at most "
                f"training.anchor_sigma_max {t.anchor_sigma_max}, and this schedule has none: "
                f"lower training.timesteps.fraction or raise training.anchor_sigma_max")
        policy = self.policy
        generator = seeded_generator(self.config.run.seed, iteration, "anchor",
                                     int(batch.sample_ids[replay.rows[0]]))
        picked = torch.randperm(len(levels), generator=generator)[:t.anchor_steps]
        penalties = []
        for index in picked.tolist():
            sigmas = levels[index].expand(unit.clean.shape[0]).to(unit.clean.device)
            noise = torch.randn(tuple(unit.clean.shape), generator=generator)
            latents, _ = noised_latents(unit.clean, noise.to(unit.clean.device), sigmas)
            state = dataclasses.replace(unit, latents=latents, sigmas=sigmas)
            velocity = state.velocity()
            velocity_ref = state.velocity(policy.reference_policy())
            penalties.append(weighted_mean(velocity_anchor(velocity, velocity_ref), weights))
        anchor = torch.stack(penalties).mean()
        record["anchor"] = anchor.detach()
        return loss + t.anchor_beta * anchor


@dataclasses.dataclass
class SampleReplay:
    """One replay unit of a sample-based algorithm: b final samples at one noise level each.

    rows (b,) int64 CPU indices into the RolloutBatch; slot: which of the iteration's
    ``training.timesteps.count`` levels; sigmas (b,) float32 CPU; noise_keys: b keys of the
    forward-process noise (rows with the same key are noised alike: DGPO's groups, DPO's pairs);
    pairs: for Diffusion-DPO, the number of (chosen, rejected) pairs, rows[:pairs] chosen and
    rows[pairs:] rejected; cache: values an algorithm keeps between passes (AWM's old log-prob).
    """

    rows: Tensor
    slot: int
    sigmas: Tensor
    noise_keys: list[int]
    pairs: int = 0
    cache: dict = dataclasses.field(default_factory=dict)


def draw_sigmas(schedule: Tensor, count: int, sampling: str, fraction: float,
                generator: torch.Generator) -> Tensor:
    """(count,) training noise levels for one sample (or one shared draw): ``discrete`` picks
    ``count`` distinct levels among ``discrete_sigma_choices(schedule, fraction)`` in random
    order (with repeats only when count exceeds them); ``uniform`` / ``logit_normal`` draw
    continuous levels in the interval those choices span."""
    choices = discrete_sigma_choices(schedule.float(), fraction)
    if sampling == "discrete":
        order = torch.cat([torch.randperm(len(choices), generator=generator)
                           for _ in range(-(-count // len(choices)))])[:count]
        return choices[order]
    low, high = float(choices.min()), float(choices.max())
    if low == high:
        return torch.full((count,), high)
    if sampling == "uniform":
        return low + (high - low) * torch.rand(count, generator=generator)
    return logit_normal_sigmas(count, low, high, generator)


def sample_units(batch: RolloutBatch, schedule: Tensor, config, iteration: int, *,
                 whole_groups: bool, shared_sigmas: bool, group_noise: bool) -> list[SampleReplay]:
    """The replay units of a sample-based algorithm: the batch's rows in chunks of
    ``sampling.rollout_batch_size`` (whole groups when ``whole_groups``), times
    ``training.timesteps.count`` noise levels each. Levels are drawn per sample (or once per
    iteration when ``shared_sigmas``), noise per sample (or per group when ``group_noise``),
    all keyed by (seed, iteration, sample or group id): the same on any process count and on a
    resume."""
    t, seed = config.training, config.run.seed
    count = t.timesteps.count
    sample_ids = batch.sample_ids.tolist()
    group_ids = batch.group_ids.tolist()
    if shared_sigmas:
        shared = draw_sigmas(schedule, count, t.timesteps.sampling, t.timesteps.fraction,
                             seeded_generator(seed, iteration, "matching_sigma", "shared"))
        levels = {sid: shared for sid in sample_ids}
    else:
        levels = {sid: draw_sigmas(schedule, count, t.timesteps.sampling, t.timesteps.fraction,
                                   seeded_generator(seed, iteration, "matching_sigma", sid))
                  for sid in sample_ids}
    size = max(1, config.sampling.rollout_batch_size)
    rows = list(range(len(sample_ids)))
    if whole_groups:
        by_group: dict[int, list[int]] = {}
        for row in rows:
            by_group.setdefault(group_ids[row], []).append(row)
        per_chunk = max(1, size // t.group_size)
        groups = list(by_group.values())
        chunks = [sum(groups[i:i + per_chunk], []) for i in range(0, len(groups), per_chunk)]
    else:
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
    units = []
    for chunk in chunks:
        keys = [group_ids[r] if group_noise else sample_ids[r] for r in chunk]
        chunk_rows = torch.tensor(chunk)   # one tensor for the chunk's units: one cond selection
        for slot in range(count):
            sigmas = torch.stack([levels[sample_ids[r]][slot] for r in chunk]).float()
            units.append(SampleReplay(rows=chunk_rows, slot=slot, sigmas=sigmas,
                                      noise_keys=keys))
    return units


def anchor_levels(schedule: Tensor, fraction: float, sigma_max: float) -> Tensor:
    """(L,) the rollout schedule's non-zero levels that ``training.anchor_beta`` anchors for a
    sample-based algorithm: those after ``discrete_sigma_choices(schedule, fraction)`` (below
    every level a discrete or continuous draw can train) with sigma <= ``sigma_max``. schedule
    (N + 1,) descending, ending at 0."""
    trained = discrete_sigma_choices(schedule.float(), fraction)
    levels = schedule.float()[len(trained):-1]
    return levels[levels <= sigma_max + 1e-6]


def unit_noise(shape: tuple[int, ...], keys: list[int], seed: int, iteration: int, slot: int,
               per_slot: bool = True) -> Tensor:
    """(b, *shape) standard normal forward-process noise, one draw per key (rows with the same key
    get the same noise), keyed by (seed, iteration, key[, slot]). ``per_slot`` False: the same
    noise at every level (DGPO's timestep-invariant group noise)."""
    draws: dict[int, Tensor] = {}
    for key in keys:
        if key not in draws:
            parts = (seed, iteration, "matching_noise", key) + ((slot,) if per_slot else ())
            draws[key] = torch.randn(shape, generator=seeded_generator(*parts))
    return torch.stack([draws[key] for key in keys])


@dataclasses.dataclass
class UnitForward:
    """A replay unit's rows re-noised by the forward process, on the model's device: x0
    (``clean``), x_sigma (``latents``), v* (``target``), ``sigmas``, the prompt condition and the
    CFG scale of the training forwards. ``velocity(context)`` is a policy's velocity there."""

    policy: FlowPolicy
    clean: Tensor
    latents: Tensor
    target: Tensor
    sigmas: Tensor
    cond: Any
    guidance: float

    def velocity(self, context=None) -> Tensor:
        """(b, ...) float32 velocity at x_sigma: the trained weights through the engine (with
        grad) when ``context`` is None, else under ``context`` without grad (the old policy's
        ``swapped_in()``, the policy's ``reference_policy()``)."""
        model = self.policy.model
        inputs = self.latents.to(model.dtype)
        if context is None:
            with self.policy.training_forward():
                return model.velocity(inputs, self.sigmas, self.cond, self.guidance).float()
        with torch.no_grad(), context:
            return model.velocity(inputs, self.sigmas, self.cond, self.guidance).float()


def unit_forward(policy: FlowPolicy, batch: RolloutBatch, replay: SampleReplay, iteration: int,
                 guidance: float | None = None, per_slot_noise: bool = True) -> UnitForward:
    """A unit's rows' final samples re-noised at its levels (``noised_latents``) with its noise
    (``unit_noise``), float32 on the model's device; ``guidance`` None: the sampler's CFG."""
    device = policy.model.device
    clean = batch.final_latents.index_select(0, replay.rows).to(device, torch.float32)
    noise = unit_noise(tuple(clean.shape[1:]), replay.noise_keys, policy.config.run.seed,
                       iteration, replay.slot, per_slot_noise).to(device)
    sigmas = replay.sigmas.to(device)
    latents, target = noised_latents(clean, noise, sigmas)
    if guidance is None:
        guidance = policy.settings(iteration).guidance_scale
    return UnitForward(policy, clean, latents, target, sigmas,
                       policy.replay_condition(batch, replay), guidance)


def weighted_mean(values: Tensor, weights: Tensor) -> Tensor:
    """sum_i w_i x_i / #{w > 0} (0 when no weight is positive): the trainer's row weights,
    padding rows at 0."""
    weights = weights.to(values)
    return (weights * values).sum() / (weights > 0).sum().clamp(min=1)


def add_velocity_kl(loss: Tensor, record: dict, beta: float, velocity: Tensor,
                    velocity_ref: Tensor, weights: Tensor) -> Tensor:
    """loss + beta * the velocity KL mean_d (v - v_ref)^2 (``training.kl_beta``), recorded as
    ``kl``: the sample-based algorithms' KL to the reference."""
    kl = weighted_mean(velocity_error(velocity, velocity_ref), weights)
    record["kl"] = kl.detach()
    return loss + beta * kl


class OldPolicy:
    """The "old" policy of DiffusionNFT and DGPO: an EMA of the trainable weights with a ramped
    decay (``matching_losses.old_policy_decay``), swapped into the module's parameters for its
    forwards (the same code path as the policy's own, so an old policy equal to the current one
    gives exactly the current velocity)."""

    def __init__(self, trainable: dict[str, torch.nn.Parameter], flat_steps: int,
                 ramp_rate: float, max_decay: float) -> None:
        self.trainable = trainable
        self.schedule = (flat_steps, ramp_rate, max_decay)
        self.weights = {name: param.detach().clone() for name, param in trainable.items()}
        self.last_decay = 0.0

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        live = {name: param.data for name, param in self.trainable.items()}
        try:
            for name, param in self.trainable.items():
                param.data = self.weights[name]
            yield
        finally:
            for name, param in self.trainable.items():
                param.data = live[name]

    @torch.no_grad()
    def update(self, steps: int) -> float:
        """old <- d old + (1 - d) current with d = the schedule's decay at ``steps``."""
        decay = old_policy_decay(steps, *self.schedule)
        for name, param in self.trainable.items():
            self.weights[name].mul_(decay).add_(param.detach(), alpha=1.0 - decay)
        self.last_decay = decay
        return decay

    def state_dict(self) -> dict[str, Tensor]:
        return {f"old:{name}": value for name, value in self.weights.items()}

    @torch.no_grad()
    def load_state_dict(self, tensors: dict[str, Tensor]) -> None:
        missing = [n for n in self.trainable if f"old:{n}" not in tensors]
        if missing:
            raise ValueError(f"the checkpoint's old policy lacks {len(missing)} trainable tensors "
                             f"(e.g. {missing[0]}); it was saved for another model or algorithm")
        for name, param in self.trainable.items():
            self.weights[name] = tensors[f"old:{name}"].to(param.device, param.dtype).clone()
