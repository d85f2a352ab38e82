"""How one iteration of a flow run divides into rollout chunks, replay batches and optimiser
steps, and the rollout schedule: counts the flow policy derives from the config and the process
count (a function of both, the same on every process), so that the anchors' cadences (optimiser
steps per epoch, EMA updates per step) carry over to any number of processes."""
from __future__ import annotations

import math

from torch import Tensor

from flowgrpo.config import TrainConfig
from flowgrpo.plans import replay_steps_per_chunk
from flowgrpo.sde import shifted_linear_sigmas


def rollout_sigmas(config: TrainConfig, model) -> Tensor:
    """(N + 1,) schedule of training rollouts: the model's (``sampling.sigma_schedule: model``)
    or shift(linspace(start, 0, N + 1)) (``shifted_linear``: MixGRPO, Flash-GRPO)."""
    s = config.sampling
    if s.sigma_schedule == "shifted_linear":
        return shifted_linear_sigmas(s.num_steps, s.sigma_shift, s.sigma_schedule_start)
    return model.sigmas(s.num_steps)


# Plan kinds whose plan differs between the groups of an iteration (each group's rows roll out
# in their own chunks).
PER_GROUP_PLANS = ("branch", "one_step", "merge")


def rollout_chunks_per_process(config: TrainConfig, num_processes: int) -> int:
    """Rollout chunks (rows that share a plan, rollout_batch_size at a time) of one iteration on
    each process. Plans shared by every group (full, window) chunk the process's rows together;
    per-group plans (branch, one_step, merge) chunk each group's rows on their own."""
    t, s = config.training, config.sampling
    rows = t.prompts_per_iteration * t.group_size // num_processes
    if s.plan.kind in PER_GROUP_PLANS and rows % t.group_size == 0:
        return (rows // t.group_size) * math.ceil(t.group_size / s.rollout_batch_size)
    return math.ceil(rows / s.rollout_batch_size)


def replay_batches_per_process(config: TrainConfig, num_processes: int) -> int:
    """Replay batches of one inner epoch on each process, before zero-variance groups are
    skipped: rollout chunks times the trained steps of a trajectory; for the sample-based
    algorithms, chunks of rollout_batch_size rows (whole groups for dgpo and gdro, pairs for dpo:
    at most one per group, plus training.dpo.pairs_file's) times ``training.timesteps.count``."""
    s, t = config.sampling, config.training
    if t.algorithm == "grpo":
        return rollout_chunks_per_process(config, num_processes) * \
            replay_steps_per_chunk(s.plan, s.num_steps)
    rows = t.prompts_per_iteration * t.group_size // num_processes
    size = max(1, s.rollout_batch_size)
    if t.algorithm in ("dgpo", "gdro"):
        chunks = math.ceil((rows // t.group_size) / max(1, size // t.group_size))
    elif t.algorithm == "dpo":
        pairs_size = max(1, size // 2)
        chunks = math.ceil((rows // t.group_size) / pairs_size) if t.dpo.online else 0
        if t.dpo.pairs_file is not None:   # offline pairs: position j goes to process j mod P
            chunks += math.ceil(math.ceil(t.dpo.pairs_per_iteration / num_processes)
                                / pairs_size)
    else:
        chunks = math.ceil(rows / size)
    return chunks * t.timesteps.count


def ema_updates_per_step(config: TrainConfig, num_processes: int) -> int:
    """``training.ema.updates_per_step``, with 0 resolved to the rollout chunks per optimiser
    step on each process (at least 1): Flow-GRPO updates its EMA after every sample batch, and a
    sample batch of its loops is a rollout chunk here. 1 for policies without rollout chunks."""
    t = config.training
    if t.ema.updates_per_step > 0:
        return t.ema.updates_per_step
    if config.policy != "flow":
        return 1
    steps = max(t.optimizer_steps_per_epoch, 1)
    return max(1, rollout_chunks_per_process(config, num_processes) // steps)


def accumulation_steps(config: TrainConfig, num_processes: int) -> int:
    """Replay batches per optimiser step over every process (the trainer's ``step_windows``):
    ``training.optimizer_steps_per_epoch`` > 0 gives ceil(replay batches of all processes /
    steps); else ``training.gradient_accumulation_steps`` (0: all of an inner epoch)."""
    t = config.training
    if t.optimizer_steps_per_epoch > 0:
        count = replay_batches_per_process(config, num_processes) * num_processes
        return max(1, math.ceil(count / t.optimizer_steps_per_epoch))
    return t.gradient_accumulation_steps
