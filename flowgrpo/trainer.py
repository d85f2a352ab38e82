"""The training loop: prompts -> rollouts (via the policy) -> gather -> advantages -> clipped updates.

One loop for every policy (``flowgrpo/policy.py``: a flow-matching generator or a causal LM) and
every engine accelerate launches (one process, DDP, FSDP, DeepSpeed). It orchestrates; the maths
lives in ``advantages.py`` and ``losses.py`` and the model-specific work in the policy. Follow one
iteration in ``Trainer.run_iteration``. This module builds the run and holds the loop and the
update; the trainer's other parts are ``trainer_advantages.py`` (gathered rewards, advantages,
guards), ``trainer_checkpoints.py`` (saving, opening and resuming a run folder) and
``trainer_evaluation.py`` (evaluations, grids, logs, the summary).

Engines. The policy's module goes through ``accelerator.prepare`` with the optimiser: DDP buckets
the gradient all-reduce, FSDP / DeepSpeed shard what they shard, fp16 gets accelerate's GradScaler.
Gradient accumulation: every optimiser step takes the same number of backward passes on every
process (a process short of replay batches runs zero-weighted ones), all but the last without
gradient sync (``accelerator.no_sync``). Sampling stays a pure function of (seed, iteration,
sample id), so a run gives the same batch on 1 or N processes and a resumed run repeats itself.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch import Tensor
from tqdm.auto import tqdm

from flowgrpo import checkpoint as ckpt
from flowgrpo import ranks
from flowgrpo.config import TrainConfig, dump_config, redact, to_dict, validate
from flowgrpo.ema import EMA
from flowgrpo.engines import (check_engine, enable_fsdp_on_cpu, engine_name, preflight_engine,
                              replica_checksums, set_gradient_sync)
from flowgrpo.guards import load_feature_extractor
from flowgrpo.errors import RunStopped
from flowgrpo.heldout import BestRecord, reward_directions, resolve_mode
from flowgrpo.interrupts import Preempted, StopRequested, StopSignals, agreed_signal, signal_name
from flowgrpo.policy import check_model_source
from flowgrpo.policy_registry import load_policy_class
from flowgrpo.prompts import (PromptCurriculum, bucket_labels, check_balance_weights, load_prompts,
                              sample_indices)
from flowgrpo.run_folder import RunLock
from flowgrpo.run_log import keep_records
from flowgrpo.seeding import seeded_generator
from flowgrpo.trainer_advantages import TrainerAdvantages
from flowgrpo.trainer_checkpoints import TrainerCheckpoints
from flowgrpo.trainer_evaluation import TrainerEvaluation


def scheduled_lr(lr: float, iteration: int, warmup: int, decay: str, final_ratio: float,
                 total: int) -> float:
    """The lr of 0-based ``iteration``: linear warmup over ``warmup`` iterations to ``lr``, then
    ``decay``: "constant", or "linear" / "cosine" from ``lr`` after warmup to ``lr * final_ratio``
    at iteration ``total`` (held there after it)."""
    if warmup and iteration < warmup:
        return lr * (iteration + 1) / warmup
    if decay == "constant":
        return lr
    progress = min(1.0, (iteration - warmup) / max(total - warmup, 1))
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (final_ratio + (1.0 - final_ratio) * shape)


def global_replay_order(keys: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """The iteration's replay batches over every process, in the order one process would hold
    them: sorted by (plan bucket, global id of the batch's first sample), ties (the steps of one
    rollout chunk) in their rollout order. ``keys[q]``: those pairs for each of process q's replay
    batches, in its order (``Trainer.replay_keys``). Returns (process, index in its list) per
    global position."""
    keyed = [(*key, index, process) for process, pairs in enumerate(keys)
             for index, key in enumerate(pairs)]
    return [(process, index) for *_, index, process in sorted(keyed)]


def step_windows(order: list[int], per_step: int, owners: list[tuple[int, int]], process: int
                 ) -> list[tuple[list[int], int]]:
    """The optimiser steps of an inner epoch, for one process: (its replay batches in the step,
    as indices into its own list; the backward passes every process runs in the step).

    ``owners`` lists the global replay batches (``global_replay_order``), ``order`` permutes
    them, and each step takes the next ``per_step`` of the permutation: a step trains the same
    replay batches on any number of processes whose rollouts hold the same batches. Every
    process runs as many passes as the process holding most of the step's batches (a short
    process replays zero-weighted ones), so all join every all-reduce."""
    processes = max((q for q, _ in owners), default=0) + 1
    windows = []
    for start in range(0, len(order), per_step):
        window = [owners[g] for g in order[start:start + per_step]]
        held = [0] * max(processes, process + 1)
        for q, _ in window:
            held[q] += 1
        windows.append(([index for q, index in window if q == process], max(held)))
    return windows


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


class NonFiniteGradientError(RunStopped):
    """Too many optimiser steps in a row had a non-finite gradient."""


class Trainer(TrainerAdvantages, TrainerCheckpoints, TrainerEvaluation):
    """Builds everything from a validated ``TrainConfig`` and runs GRPO on its policy."""

    def __init__(self, config: TrainConfig, accelerator=None, model=None, *,
                 resume: str | None = None, overwrite: bool | None = None) -> None:
        """``resume`` / ``overwrite`` as in ``train``. Given here (``overwrite`` not None, as the
        CLI does), the run folder is checked before the model loads, so a refused folder or a
        missing checkpoint costs nothing; left out, ``train`` checks it."""
        self.config = config
        tracker = config.run.tracker
        if tracker == "tensorboard":
            try:
                import tensorboard  # noqa: F401  (optional: the test extra installs it)
            except ImportError:
                tracker = "none"
        self.run_dir = Path(config.run.output_dir) / config.name
        t = config.training
        if accelerator is None:
            preflight_engine()
            launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
            if launched and launched != t.mixed_precision and \
                    os.environ.get("RANK", "0") == "0":
                warnings.warn(f"accelerate was launched with mixed precision {launched!r}, the "
                              f"config says training.mixed_precision={t.mixed_precision!r}: the "
                              f"config's value is used. Set them equal (e.g. "
                              f"training.mixed_precision={launched}) to silence this",
                              stacklevel=2)
        self.accelerator = accelerator or Accelerator(
            mixed_precision=t.mixed_precision,
            log_with=None if tracker == "none" else tracker,
            project_dir=str(self.run_dir),
            # Buffers are not trained and equal on every rank; broadcasting them at every forward
            # would make a forward on the main process alone (evaluation) a collective.
            kwargs_handlers=[DistributedDataParallelKwargs(
                broadcast_buffers=False, find_unused_parameters=t.ddp_find_unused_parameters)])
        if accelerator is None:
            enable_fsdp_on_cpu(self.accelerator)   # accelerate runs FSDP on GPUs only
        self.tracker = tracker
        # Batch divisibility depends on the process count, known only now.
        validate(config, num_processes=self.accelerator.num_processes)
        self.engine = engine_name(self.accelerator)
        self.sharded = check_engine(config, self.accelerator)
        if config.run.num_threads:
            torch.set_num_threads(config.run.num_threads)
        torch.manual_seed(config.run.seed)
        self._run: dict | None = None      # how this run starts (open_run), once decided
        self._opened_with: tuple[str | None, bool] | None = None
        self._lock = RunLock(self.run_dir)

        if model is None:
            # A model that cannot be loaded (offline, gated, wrong id, incomplete folder) fails
            # first, with one message, before prompts, rewards or weights load.
            check_model_source(config)
        # Cheap things first: a bad prompt file or reward name fails before the model loads
        # (and before --overwrite empties the run folder).
        self.train_records = load_prompts(config.prompts.train)
        self.eval_records = load_prompts(config.prompts.eval) if config.prompts.eval else []
        if config.prompts.num_eval:
            self.eval_records = self.eval_records[:config.prompts.num_eval]
        cur = config.prompts.curriculum
        self.curriculum = PromptCurriculum(
            [r["prompt"] for r in self.train_records], floor=cur.floor, prior=cur.prior,
            prior_strength=cur.prior_strength, decay=cur.decay) if cur.enabled else None
        self.train_buckets = (bucket_labels(self.train_records, config.prompts.balance_key)
                              if config.prompts.balance_key else None)
        if config.prompts.balance_weights:
            check_balance_weights(config.prompts.balance_weights, self.train_buckets,
                                  config.prompts.balance_key)
        self._drawn: tuple[int, list[int]] | None = None
        # training.gardo.diversity's feature: a user's class that cannot be built fails here too
        self.feature_extractor = load_feature_extractor(config) if t.gardo.diversity else None
        if overwrite is not None:
            self.open_run(resume, overwrite)

        # The iteration the KL reference was last made the policy (training.gardo); None = the
        # initial model.
        self.reference_refreshed_at: int | None = None
        try:
            self.policy = load_policy_class(config.policy)(config, self.accelerator,
                                                           self.train_records, model=model)
            self.trainable = self.policy.trainable
            self.ema = EMA(self.trainable, t.ema.decay, t.ema.every, warmup=t.ema.warmup,
                           updates_per_step=self.policy.ema_updates_per_step
                           ) if t.ema.enabled else None
            if getattr(getattr(self.policy, "model", None), "may_skip_parameters", False):
                # Some forwards leave trainable parameters without a gradient (the other expert
                # of Wan2.2): without this DDP stops at the second backward.
                handler = self.accelerator.ddp_handler or DistributedDataParallelKwargs()
                handler.find_unused_parameters = True
                self.accelerator.ddp_handler = handler
            if self.sharded:
                # FSDP2 shards each process's own copy (DDP and FSDP1 broadcast rank 0's), so the
                # copies must be equal before they are cut.
                self.check_replicas("loading the model", before_sharding=True)
            self.engine_module, self.optimizer = self.accelerator.prepare(
                self.policy.module, self._make_optimizer())
            self.policy.bind(self.engine_module, self.sharded)
            self.trainable = self.policy.trainable   # FSDP2 replaced them with sharded ones
            self.check_replicas("setup")
        except BaseException:
            self._lock.release()   # a failed start must not keep the run folder locked
            raise
        # Which way each reward improves (a class may say higher_is_better = False), and the
        # record of the best evaluation of run.select_best_on.
        eval_reward = getattr(self.policy, "eval_reward", None)
        self.directions = reward_directions(self.policy.reward, eval_reward)
        self.heldout_keys = set(eval_reward.rewards) if eval_reward is not None else set()
        key = config.run.select_best_on
        self.best = BestRecord(key, resolve_mode(config.run.select_best_mode, key,
                                                 self.directions)) if key else None
        self.stopped_early: int | None = None
        self.start_iteration = 0
        self.skipped_in_a_row = 0
        self.reward_streaks: dict[str, int] = {}   # check_reward_signal's iterations in a row
        # run.save_on_signal: one process may cut a rollout short; several agree first.
        self.signals = StopSignals(config.run.save_on_signal,
                                   may_abandon=self.accelerator.num_processes == 1)
        self.completed = 0   # iterations whose update has been applied
        self._seeds: dict[tuple, Tensor] = {}
        self.history: list[dict] = []

    # ------------------------------------------------------------------ the policy's parts
    @property
    def model(self):
        """The policy's model (a FlowModel, or the LM with its tokenizer)."""
        return self.policy.model

    @property
    def module(self) -> torch.nn.Module:
        """The module that trains (unwrapped; ``engine_module`` is the engine's wrapper)."""
        return self.policy.module

    @property
    def reward(self):
        return self.policy.reward

    def _make_optimizer(self) -> torch.optim.Optimizer:
        t = self.config.training
        params = list(self.trainable.values())
        if t.use_8bit_adam:
            try:
                import bitsandbytes as bnb   # optional: the gpu extra
            except ImportError as err:
                raise ImportError("training.use_8bit_adam needs bitsandbytes: pip install "
                                  "'flowgrpo[gpu]'") from err
            return bnb.optim.AdamW8bit(params, lr=t.lr, betas=t.adam_betas,
                                       weight_decay=t.weight_decay, eps=t.adam_eps)
        # The fused kernel updates every tensor in one call: 4.2-4.4x faster than the per-tensor
        # loop for the toy model's 94 tensors on one CPU thread, weights equal to 1.5e-8 after
        # 53 steps (python benchmarks/optimizer.py). Sharded engines re-home the parameters after
        # this, so they get the plain loop.
        fused = not self.sharded and all(
            p.dtype.is_floating_point and p.device.type in ("cpu", "cuda") for p in params)
        return torch.optim.AdamW(params, lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay,
                                 eps=t.adam_eps, fused=fused or None)

    @contextmanager
    def ema_weights(self):
        """The EMA weights swapped in (evaluation, grids, published weights), when EMA is on."""
        with self.ema.swapped_in() if self.ema is not None else nullcontext():
            yield

    # ------------------------------------------------------------------ ranks
    def main_only(self, section: str, work: Callable[[], Any]) -> Any:
        """``ranks.main_only`` on this run's processes."""
        return ranks.main_only(self.accelerator, section, work)

    def everywhere(self, section: str, work: Callable[[], Any]) -> Any:
        """``ranks.everywhere`` on this run's processes."""
        return ranks.everywhere(self.accelerator, section, work)

    def _everywhere_or_main(self, section: str, work: Callable[[], Any]) -> Any:
        """Sampling sections: on the main process alone, except under a sharded engine, where
        every forward gathers parameter shards and so every process must run it."""
        if self.sharded:
            return work()
        return self.main_only(section, work)

    def check_replicas(self, when: str, before_sharding: bool = False) -> None:
        """Every process must hold the same trainable weights (DDP keeps them equal only if they
        start equal): compare checksums after setup and after a resume. Sharded engines hold
        different shards by design: they are compared only ``before_sharding``, when every
        process still holds the whole model."""
        acc = self.accelerator
        if acc.num_processes == 1 or (self.sharded and not before_sharding):
            return
        names = list(self.trainable)
        local = replica_checksums([self.trainable[n] for n in names]).to(acc.device)
        every = acc.gather(local.unsqueeze(0)).cpu()
        differ = (every != every[:1]).any(dim=2).any(dim=0)
        if bool(differ.any()):
            first = names[int(differ.nonzero()[0])]
            raise RuntimeError(f"trainable weights differ across processes after {when} (first: "
                               f"{first}); every process must load the same model and checkpoint")

    # ------------------------------------------------------------------ one iteration
    def group_prompts(self, iteration: int) -> list[int]:
        """Indices into ``train_records`` of the iteration's groups: a function of (seed,
        iteration) and, with the curriculum, of its state when the iteration is first asked for
        (kept, so a later call within the iteration returns the same draw)."""
        if self._drawn is not None and self._drawn[0] == iteration:
            return self._drawn[1]
        weights = self.curriculum.weights() if self.curriculum is not None else None
        indices = sample_indices(len(self.train_records), self.config.training.prompts_per_iteration,
                                 self.config.run.seed, iteration, self.train_buckets, weights,
                                 self.config.prompts.balance_weights)
        self._drawn = (iteration, indices)
        return indices

    def local_batch(self, iteration: int) -> tuple[list[dict], Tensor, Tensor]:
        """This process's rows of the iteration: records, group_ids (B,), sample_ids (B,).
        Sample j of the global batch belongs to group j // group_size; a group may span processes."""
        t = self.config.training
        groups = [self.train_records[i] for i in self.group_prompts(iteration)]
        total = t.prompts_per_iteration * t.group_size
        per_process = total // self.accelerator.num_processes
        start = self.accelerator.process_index * per_process
        sample_ids = torch.arange(start, start + per_process)
        group_ids = sample_ids // t.group_size
        return [groups[int(g)] for g in group_ids], group_ids, sample_ids

    def rollout_and_score(self, iteration: int) -> tuple[Any, dict[str, Tensor], dict]:
        """This process's rows, rolled out and scored by the policy."""
        records, group_ids, sample_ids = self.local_batch(iteration)
        return self.policy.rollout(records, group_ids, sample_ids, iteration)

    def update(self, batch, advantages: Tensor, iteration: int) -> dict[str, float]:
        """num_inner_epochs passes over the rollout's replay batches, clipped-surrogate loss.

        An optimiser step accumulates the policy's ``accumulation_steps`` replay batches over
        every process (0: all of an epoch; ``training.gradient_accumulation_steps``, or derived
        from ``optimizer_steps_per_epoch``), taken from one permutation of every process's
        batches (``step_windows``), so a step trains the same batches on 1 or N processes. Every
        process runs the same number of backward passes per step; one short of replay batches
        replays one of its own with weight 0. A batch's loss enters with weight 1 / per_step
        (times the process count, which the engine's gradient mean divides out).
        """
        t = self.config.training
        acc = self.accelerator
        clip_high = t.clip_low if t.clip_high is None else t.clip_high
        replays = [r for r in batch.replay
                   if not (t.skip_zero_std_groups and bool((advantages[r.rows] == 0).all()))]
        owners = global_replay_order(self.replay_keys(batch, replays))
        total = len(owners)
        per_step = self.policy.accumulation_steps or max(total, 1)
        scale = acc.num_processes / per_step
        step_weights = self.policy.step_weights(replays)
        # Per replay batch only detached tensors are kept; the statistics are computed once over
        # all of them at the end (``update_metrics``), so they describe the whole update.
        rows: dict[str, list[Tensor]] = {}
        first_pass_dev: list[Tensor] = []
        grad_norms: list[float] = []
        skipped = padded = 0
        for epoch in range(t.num_inner_epochs):
            order = torch.randperm(total, generator=seeded_generator(
                self.config.run.seed, iteration, "epoch", epoch)).tolist()
            windows = step_windows(order, per_step, owners, acc.process_index)
            for step, (window, length) in enumerate(windows):
                padded += length - len(window)
                for position in range(length):
                    last = position == length - 1
                    padding = position >= len(window)
                    if padding:   # zero-weighted, so this process joins the all-reduce
                        replay = replays[0] if replays else (
                            batch.replay[0] if batch.replay else batch.padding_replay)
                        weights = torch.ones(len(replay.rows), device=acc.device)
                    else:
                        replay, weights = replays[window[position]], step_weights[window[position]]
                    set_gradient_sync(acc, last)
                    with nullcontext() if last else acc.no_sync(self.engine_module):
                        with acc.autocast():
                            loss, record = self.policy.replay_loss(batch, replay, advantages,
                                                                   iteration, clip_high, weights)
                        self.backward(loss, 0.0 if padding else scale)
                    if padding:
                        continue
                    for key, value in record.items():   # detached by contract; a detach is an op
                        rows.setdefault(key, []).append(
                            value.detach() if value.requires_grad else value)
                    # before any optimiser step: must be exactly 1 (algorithms with a ratio)
                    if epoch == 0 and step == 0 and "ratio_max_dev" in record:
                        first_pass_dev.append(record["ratio_max_dev"])
                norm, stepped = self.optimizer_step()
                grad_norms.append(norm)
                skipped += not stepped
        metrics = {f"train/{k}": float(v) for k, v in self.policy.update_metrics(
            {key: torch.stack(values) if values[0].dim() == 0 else torch.cat(values)
             for key, values in rows.items()}, clip_high).items()}
        finite = [n for n in grad_norms if math.isfinite(n)]
        metrics["train/grad_norm"] = _mean(finite)
        metrics["train/optimizer_steps"] = len(grad_norms)
        metrics["train/skipped_steps"] = skipped
        if acc.scaler is not None:
            metrics["train/loss_scale"] = float(acc.scaler.get_scale())
        metrics["train/first_pass_ratio_max_dev"] = \
            float(torch.stack(first_pass_dev).max()) if first_pass_dev else 0.0
        metrics["train/replay_batches"] = len(replays)
        metrics["train/padding_passes"] = padded   # zero-weighted passes of this process
        metrics["train/skipped_replay_batches"] = len(batch.replay) - len(replays)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def replay_keys(self, batch, replays: list) -> list[list[tuple[int, int]]]:
        """Per process, (plan bucket, global sample id of the first row) of each replay batch
        (``global_replay_order``); gathered, so the same lists on every process."""
        local = [(int(getattr(replay, "bucket", 0)), int(batch.sample_ids[replay.rows[0]]))
                 for replay in replays]
        acc = self.accelerator
        if acc.num_processes == 1:
            return [local]
        count = torch.tensor([len(local)], device=acc.device)
        counts = acc.gather(count).cpu().tolist()
        padded = torch.full((max(counts), 2), -1, dtype=torch.int64)
        if local:
            padded[:len(local)] = torch.tensor(local, dtype=torch.int64)
        every = acc.gather(padded.unsqueeze(0).to(acc.device)).cpu()
        return [[tuple(pair) for pair in every[q, :counts[q]].tolist()]
                for q in range(acc.num_processes)]

    def backward(self, loss: Tensor, scale: float) -> None:
        """``accelerator.backward`` of ``scale * loss`` (d objective / d loss of a replay batch
        is 1 / batches per step). The scale is backward()'s seed, not a multiply: one op and one
        autograd node less per replay batch; DeepSpeed's backward takes no seed."""
        if self.engine == "deepspeed":
            self.accelerator.backward(loss * scale)
            return
        seed = self._seeds.get((scale, loss.dtype, loss.device))
        if seed is None:
            seed = self._seeds[(scale, loss.dtype, loss.device)] = torch.full(
                (), scale, dtype=loss.dtype, device=loss.device)
        self.accelerator.backward(loss, gradient=seed)

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip (after unscaling, under fp16), step, zero the gradients, update the EMA.
        A step whose gradient norm is not finite is skipped: neither the weights nor the EMA
        change (under fp16 the scaler also lowers its scale). Returns (norm, stepped)."""
        acc = self.accelerator
        max_norm = self.config.training.max_grad_norm
        params = (list(self.engine_module.parameters()) if self.sharded
                  else list(self.trainable.values()))
        norm = acc.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        norm = float("nan") if norm is None else float(norm)
        if math.isfinite(norm) or acc.scaler is not None or self.engine == "deepspeed":
            self.optimizer.step()   # the scaler / DeepSpeed skip a step that overflowed
            stepped = not acc.optimizer_step_was_skipped and (
                math.isfinite(norm) or self.engine == "deepspeed")
        else:
            stepped = False
        self.optimizer.zero_grad(set_to_none=True)
        if stepped and self.ema is not None:
            self.ema.step()
        if stepped:
            self.policy.after_optimizer_step()
        limit = self.config.training.max_consecutive_skipped_steps
        self.skipped_in_a_row = 0 if stepped else self.skipped_in_a_row + 1
        if limit and self.skipped_in_a_row >= limit:
            raise NonFiniteGradientError(
                f"{self.skipped_in_a_row} optimiser steps in a row had a non-finite gradient "
                f"norm and were skipped; the last checkpoint holds the last finite weights. "
                f"Lower training.lr, use bf16 instead of fp16, or check the rewards "
                f"(training.max_consecutive_skipped_steps sets this limit)")
        return norm, stepped

    def learning_rate(self, iteration: int) -> float:
        """The lr of ``iteration`` (0-based): ``scheduled_lr`` of the config. A function of the
        iteration alone, so a resumed run uses the same lrs."""
        t = self.config.training
        return scheduled_lr(t.lr, iteration, t.lr_warmup_iterations, t.lr_decay, t.lr_final_ratio,
                            self.config.run.max_iterations)

    def run_iteration(self, iteration: int) -> dict[str, float]:
        """rollout (+ threaded rewards) -> advantages -> update. Returns the iteration's metrics."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(iteration)
        with self.signals.abandonable():
            batch, rewards, timing = self.rollout_and_score(iteration)
        advantages, metrics = self.compute_advantages(batch, rewards)
        if self.curriculum is not None:
            metrics.update(self.observe_curriculum(iteration))
        began = time.perf_counter()
        metrics.update(self.update(batch, advantages, iteration))
        metrics.update(self.policy.after_update())
        if self.config.training.gardo.refresh:
            metrics.update(self.refresh_reference(iteration + 1, metrics))
        metrics.update(timing)
        metrics["time/update"] = time.perf_counter() - began
        metrics["nfe"] = batch.nfe
        metrics["trained_transitions"] = batch.trained_transitions
        return metrics

    # ------------------------------------------------------------------ the run
    def train(self, resume: str | None = None, overwrite: bool | None = None) -> list[dict]:
        """Run to ``run.max_iterations``. ``resume``: None (a new run), "latest" (the newest
        complete checkpoint of this run; an error when there is none), "auto" (the newest, or a
        new run when there is none) or a checkpoint folder (of any run). A run folder that
        already holds a run is refused unless ``resume`` is given or ``overwrite`` is True
        (which deletes it first). The folder stays locked against other processes until the
        run ends."""
        self.signals.install()
        try:
            if self._run is None or resume is not None or overwrite is not None:
                self.open_run(resume, bool(overwrite))   # else as given to Trainer(...)
            return self._train()
        finally:
            self.signals.restore()
            self._lock.release()

    def _train(self) -> list[dict]:
        cfg = self.config
        self.accelerator.wait_for_everyone()
        if self._run["checkpoint"] is not None:
            self.resume(self._run["checkpoint"])

        def start() -> None:
            dump_config(cfg, self.run_dir / "config.yaml")
            keep_records(self.run_dir / ckpt.METRICS, self.start_iteration)

        self.main_only("writing the run folder", start)
        if self.tracker != "none":
            # The trackers' hyper-parameters are as public as the config file: secrets redacted.
            flat = {k: str(v) for k, v in _flatten(redact(to_dict(cfg))).items()}
            self.accelerator.init_trackers(cfg.name, config=flat)
        self.completed = self.start_iteration
        bar = tqdm(range(self.start_iteration, cfg.run.max_iterations), initial=self.start_iteration,
                   total=cfg.run.max_iterations, disable=not (cfg.run.progress and
                                                            self.accelerator.is_main_process),
                   desc=cfg.name, dynamic_ncols=True)
        began = time.perf_counter()
        try:
            self._loop(bar)
        except StopRequested as stop:   # one process: cut short in a rollout or an evaluation
            self.stop_on_signal(stop.signum, bar)
        bar.close()
        if cfg.run.comparison_grid:
            self._everywhere_or_main("comparison grid", self.write_comparison_grid)
        if self.tracker != "none":
            self.accelerator.end_training()
        if self.accelerator.is_main_process:
            self.print_summary(time.perf_counter() - began)
        return self.history

    def _loop(self, bar) -> None:
        """The iterations from ``start_iteration``; the base evaluation first in a new run."""
        cfg = self.config
        if self.start_iteration == 0:
            with self.signals.abandonable():
                self.eval_and_log(0)
            if cfg.run.comparison_grid:
                self._everywhere_or_main("base grid samples", lambda: self.save_grid_samples("base"))
        for iteration in bar:
            self.stop_if_signalled(bar)
            tick = time.perf_counter()
            metrics = self.run_iteration(iteration)
            metrics["time/iteration"] = time.perf_counter() - tick
            done = iteration + 1
            self.log({"iteration": done, "phase": "train", **metrics})
            bar.set_postfix(reward=f"{metrics.get('reward/total/mean', float('nan')):.3f}",
                            sec=f"{metrics['time/iteration']:.1f}")
            self.completed = done
            if metrics["reward/nan_count"]:
                bar.write(f"iteration {done}: {metrics['reward/nan_count']} samples had no finite "
                          f"reward (NaN or +-inf); they were masked out of the advantages")
            self.check_reward_signal(done)
            last = done == cfg.run.max_iterations
            if not last:
                self.stop_if_signalled(bar)
            stop = False
            if (cfg.run.eval_every and done % cfg.run.eval_every == 0) or last:
                with self.signals.abandonable() if not last else nullcontext():
                    self.eval_and_log(done)
                stop = self.best is not None and self.best.exhausted(cfg.run.early_stop_patience)
            if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or last or stop:
                self.save(done)
            if stop and not last:
                self.stopped_early = done
                best = (f"{self.best.value:.4g} (iteration {self.best.iteration})"
                        if self.best.value is not None else "any finite value")
                bar.write(f"stopping early at iteration {done}: {self.best.key} has not beaten "
                          f"{best} in {cfg.run.early_stop_patience} evaluations")
                break

    # ------------------------------------------------------------------ signals
    def stop_if_signalled(self, bar) -> None:
        """A safe point of the loop (before a rollout, after an update): when a signal of
        run.save_on_signal has reached any process, stop here (``stop_on_signal``). A
        collective on several processes."""
        signum = agreed_signal(self.accelerator, self.signals.received)
        if signum is not None:
            self.stop_on_signal(signum, bar)

    def stop_on_signal(self, signum: int, bar) -> None:
        """Save the state after the last applied update (``completed`` iterations) unless that
        checkpoint exists already, end the trackers and raise ``Preempted``: one line naming
        the signal and the checkpoint, exit code 128 + the signal's number."""
        bar.close()
        done = self.completed
        folder = self.run_dir / "checkpoints" / str(done)
        if ckpt.checkpoint_problem(folder) is not None:   # else saved at this iteration
            self.save(done)
        if self.tracker != "none":
            self.accelerator.end_training()
        name = signal_name(signum)
        raise Preempted(signum, f"stopped by {name} after iteration {done} of "
                                f"{self.config.run.max_iterations}: checkpoint {folder} is "
                                f"complete; continue with --resume latest (exit code "
                                f"{128 + signum})",
                        quiet=not self.accelerator.is_main_process)

def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
