"""The training loop: prompts -> rollouts (via the policy) -> gather -> advantages -> clipped updates.

One loop for every policy (``flowgrpo/policy.py``: a flow-matching generator or a causal LM) and
every engine accelerate launches (one process, DDP, FSDP, DeepSpeed). It orchestrates; the maths
lives in ``advantages.py`` and ``losses.py`` and the model-specific work in the policy. Follow one
iteration in ``Trainer.run_iteration``.

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
from accelerate.utils import DistributedDataParallelKwargs, broadcast_object_list
from safetensors.torch import load_file
from torch import Tensor
from tqdm.auto import tqdm

from flowgrpo import checkpoint as ckpt
from flowgrpo import curves
from flowgrpo.advantages import (PER_COMPONENT, decoupled_advantages, diversity_weights,
                                 group_advantages, kl_gate_weights, mask_nonfinite,
                                 saturation_weights)
from flowgrpo.config import (TrainConfig, dump_config, json_roundtrip, redact, resume_signature,
                             to_dict, validate)
from flowgrpo.ema import EMA
from flowgrpo.engines import (check_engine, engine_name, preflight_engine, replica_checksums,
                              set_gradient_sync)
from flowgrpo.errors import InputError
from flowgrpo.eval_media import log_eval_media
from flowgrpo.guards import gate_uncertainty, load_feature_extractor, media_features
from flowgrpo.heldout import BestRecord, reward_directions, resolve_mode
from flowgrpo.policy import check_model_source, gather_rows, load_policy_class
from flowgrpo.prompts import (PromptCurriculum, bucket_labels, comparison_prompts, load_prompts,
                              mixed_groups, sample_indices)
from flowgrpo.run_log import append_record, eval_line, keep_records, read_records, summary_line
from flowgrpo.seeding import seeded_generator


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


def window_lengths(max_count: int, per_step: int) -> list[int]:
    """Backward passes of each optimiser step of an inner epoch when the process with the most
    replay batches holds ``max_count`` of them and a step takes ``per_step``: the same list on every
    process, so every process joins every gradient all-reduce. Empty when nothing trains."""
    return [min(per_step, max_count - start) for start in range(0, max_count, per_step)]


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


class NonFiniteGradientError(RuntimeError):
    """Too many optimiser steps in a row had a non-finite gradient."""


class Trainer:
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
        self._lock = ckpt.RunLock(self.run_dir)

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
            self.engine_module, self.optimizer = self.accelerator.prepare(
                self.policy.module, self._make_optimizer())
            self.policy.bind(self.engine_module, self.sharded)
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
        """Run ``work`` on the main process and hand its result to every process. When it raises,
        every process raises (the main process its own error, the others one naming it) instead
        of waiting for the main process at the next collective until the group times out."""
        acc = self.accelerator
        result, error = None, None
        if acc.is_main_process:
            try:
                result = work()
            except Exception as err:   # noqa: BLE001 (re-raised below, on every process)
                error = err
        if acc.num_processes > 1:
            message = None if error is None else f"{type(error).__name__}: {error}"
            shared = broadcast_object_list([message, result if error is None else None,
                                            isinstance(error, InputError)], from_process=0)
            if shared[0] is not None and error is None:
                # A bad input stays a bad input on every process (one line from the CLI, not a
                # traceback per process); anything else is a failure with its own traceback.
                kind = InputError if shared[2] else RuntimeError
                raise kind(f"the main process failed in {section}: {shared[0]}")
            result = shared[1]
        if error is not None:
            raise error
        return result

    def check_replicas(self, when: str) -> None:
        """Every process must hold the same trainable weights (DDP keeps them equal only if they
        start equal): compare checksums after setup and after a resume. Sharded engines hold
        different shards by design and are skipped."""
        acc = self.accelerator
        if acc.num_processes == 1 or self.sharded:
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
                                 self.config.run.seed, iteration, self.train_buckets, weights)
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

    def compute_advantages(self, batch, rewards: dict[str, Tensor]
                           ) -> tuple[Tensor, dict[str, float]]:
        """Gather rewards over processes, compute advantages on the whole batch, keep ours."""
        t = self.config.training
        acc = self.accelerator
        device = acc.device
        # Policies hand over NaN for a missing reward (and the reward boundary already turns
        # +-inf into NaN); masking here too keeps a policy that bypasses it from poisoning the
        # whole batch's advantages with one inf.
        gathered = {k: mask_nonfinite(acc.gather(v.to(device)).cpu())[0]
                    for k, v in rewards.items()}
        group_ids = acc.gather(batch.group_ids.to(device)).cpu()
        clip = t.adv_clip or None
        aggregation = self.config.rewards.aggregation
        saturation = self.config.rewards.saturation_ratio
        scales, saturation_stats = None, {}
        if aggregation in PER_COMPONENT:
            components = {k: v for k, v in gathered.items() if k in self.reward.weights}
            if saturation:
                scales, saturation_stats = saturation_weights(components, group_ids,
                                                              ratio=saturation, ddof=t.adv_ddof)
            advantages, stats = decoupled_advantages(
                components, self.reward.weights, group_ids, ddof=t.adv_ddof, eps=t.adv_eps,
                clip=clip, batch_normalize=aggregation == "decoupled", component_scales=scales)
        elif saturation:
            # The total again, from the weighted components with per-group saturation weights.
            weights = {k: w for k, w in self.reward.weights.items() if w != 0}
            components = {k: gathered[k] for k in weights}
            scales, saturation_stats = saturation_weights(components, group_ids,
                                                          ratio=saturation, ddof=t.adv_ddof)
            advantages, stats = decoupled_advantages(
                components, weights, group_ids, mode="sum_then_normalize", scale=t.adv_scale,
                ddof=t.adv_ddof, eps=t.adv_eps, clip=clip, component_scales=scales)
        else:
            advantages, stats = group_advantages(gathered["total"], group_ids, scale=t.adv_scale,
                                                 ddof=t.adv_ddof, eps=t.adv_eps, clip=clip)
        local = len(batch.prompts)
        start = acc.process_index * local
        metrics = {f"adv/{k}": float(v) for k, v in stats.items()}
        metrics.update({f"adv/{k}": float(v) for k, v in saturation_stats.items()})
        g = t.gardo
        if g.diversity or g.kl_gate:
            advantages, guard_metrics = self.apply_guards(batch, gathered, group_ids, advantages)
            metrics.update(guard_metrics)
        for name, values in gathered.items():
            valid = values[~values.isnan()]
            metrics[f"reward/{name}/mean"] = float(valid.mean()) if len(valid) else float("nan")
            metrics[f"reward/{name}/std"] = float(valid.std(unbiased=False)) if len(valid) else 0.0
        metrics["reward/nan_count"] = int(gathered["total"].isnan().sum())
        # The same on every process (gathered), for the curriculum's bookkeeping.
        self.gathered = (gathered, group_ids)
        return advantages[start:start + local], metrics

    def apply_guards(self, batch, gathered: dict[str, Tensor], group_ids: Tensor,
                     advantages: Tensor) -> tuple[Tensor, dict[str, float]]:
        """training.gardo on the gathered batch (so every process agrees): diversity-aware
        amplification of the advantages (``advantages.diversity_weights`` on the media's
        features, then the clip again) and the KL gate (``advantages.kl_gate_weights``, this
        process's rows handed to the loss as ``batch.kl_weights``). Returns the advantages and
        the guards' metrics."""
        t = self.config.training
        g = t.gardo
        acc = self.accelerator
        metrics: dict[str, float] = {}
        if g.diversity:
            local_features = media_features(self.feature_extractor, batch.media)
            features = acc.gather(local_features.to(acc.device)).cpu()
            weights, stats = diversity_weights(features, group_ids, advantages)
            advantages = advantages * weights
            if t.adv_clip:
                advantages = advantages.clamp(-t.adv_clip, t.adv_clip)
            metrics.update({f"adv/{k}": v for k, v in stats.items()})
        if g.kl_gate:
            gate = kl_gate_weights(gate_uncertainty(self.config, gathered), g.kl_gate_fraction)
            local = len(batch.prompts)
            start = acc.process_index * local
            batch.kl_weights = gate[start:start + local]
            metrics["train/kl_gate_share"] = float(gate.mean())
        return advantages, metrics

    def refresh_reference(self, done: int, metrics: dict[str, float]) -> dict[str, float]:
        """After iteration ``done`` (1-based): make the KL reference the policy when
        ``refresh_every`` iterations have passed since the last refresh, or when the update's
        mean KL over every process exceeded ``refresh_kl`` (GARDO's reference reset). Returns
        ``train/reference_refreshed`` (1 or 0) and ``train/reference_age`` (iterations since)."""
        g = self.config.training.gardo
        acc = self.accelerator
        kl = metrics.get("train/kl", 0.0)
        if acc.num_processes > 1:
            weight = metrics.get("train/replay_batches", 0.0) if "train/kl" in metrics else 0.0
            local = torch.tensor([[kl * weight, weight]], dtype=torch.float64, device=acc.device)
            total = acc.gather(local).sum(dim=0).cpu()
            kl = float(total[0] / total[1]) if total[1] > 0 else 0.0
        since = done - (self.reference_refreshed_at or 0)
        due = (g.refresh_every > 0 and since >= g.refresh_every) or \
            (g.refresh_kl > 0 and kl > g.refresh_kl)
        if due:
            self.policy.refresh_reference()
            self.reference_refreshed_at = done
        return {"train/reference_refreshed": float(due),
                "train/reference_age": float(done - (self.reference_refreshed_at or 0))}

    def observe_curriculum(self, iteration: int) -> dict[str, float]:
        """Record which of the iteration's groups had reward variance (from the gathered rewards,
        so every process records the same) and return the curriculum's ``train/`` metrics:
        ``curriculum_mixed_share`` (this iteration's groups), ``curriculum_expected_mixed_share``
        and ``curriculum_uniform_mixed_share`` (the estimated mixed share of a draw with and
        without the curriculum, after this update) and ``curriculum_seen_prompts``."""
        gathered, group_ids = self.gathered
        keys = (list(self.reward.weights) if self.config.rewards.aggregation in PER_COMPONENT
                else ["total"])
        indices = self.group_prompts(iteration)
        mixed, informative = mixed_groups({k: gathered[k] for k in keys}, group_ids, len(indices))
        kept = [g for g in range(len(indices)) if bool(informative[g])]
        self.curriculum.observe([indices[g] for g in kept], [bool(mixed[g]) for g in kept])
        metrics = {"train/curriculum_mixed_share":
                   float(mixed[informative].double().mean()) if kept else float("nan")}
        metrics.update({f"train/curriculum_{k}": v
                        for k, v in self.curriculum.summary(self.train_buckets).items()})
        return metrics

    def update(self, batch, advantages: Tensor, iteration: int) -> dict[str, float]:
        """num_inner_epochs passes over the rollout's replay batches, clipped-surrogate loss.

        An optimiser step accumulates the policy's ``accumulation_steps`` replay batches (0: all
        of an epoch; ``training.gradient_accumulation_steps``, or derived from
        ``optimizer_steps_per_epoch``). Every process runs the same number of backward passes per step
        (``window_lengths``); one short of replay batches replays one of its own with weight 0.
        """
        t = self.config.training
        acc = self.accelerator
        clip_high = t.clip_low if t.clip_high is None else t.clip_high
        replays = [r for r in batch.replay
                   if not (t.skip_zero_std_groups and bool((advantages[r.rows] == 0).all()))]
        count = torch.tensor([len(replays)], device=acc.device)
        max_count = int(acc.gather(count).max()) if acc.num_processes > 1 else len(replays)
        per_step = self.policy.accumulation_steps or max(max_count, 1)
        lengths = window_lengths(max_count, per_step)
        step_weights = self.policy.step_weights(replays)
        # Per replay batch only detached tensors are kept; the statistics are computed once over
        # all of them at the end (``update_metrics``), so they describe the whole update.
        rows: dict[str, list[Tensor]] = {}
        first_pass_dev: list[Tensor] = []
        grad_norms: list[float] = []
        skipped = 0
        for epoch in range(t.num_inner_epochs):
            order = torch.randperm(len(replays), generator=seeded_generator(
                self.config.run.seed, iteration, "epoch", epoch)).tolist()
            for step, length in enumerate(lengths):
                window = order[step * per_step:step * per_step + length]
                for position in range(length):
                    last = position == length - 1
                    padding = position >= len(window)
                    if padding:   # zero-weighted, so this process joins the all-reduce
                        replay = replays[0] if replays else batch.replay[0]
                        weights = torch.ones(len(replay.rows), device=replay.logp_old.device)
                    else:
                        replay, weights = replays[window[position]], step_weights[window[position]]
                    set_gradient_sync(acc, last)
                    with nullcontext() if last else acc.no_sync(self.engine_module):
                        with acc.autocast():
                            loss, record = self.policy.replay_loss(batch, replay, advantages,
                                                                   iteration, clip_high, weights)
                        self.backward(loss, 0.0 if padding else 1.0 / per_step)
                    if padding:
                        continue
                    for key, value in record.items():   # detached by contract; a detach is an op
                        rows.setdefault(key, []).append(
                            value.detach() if value.requires_grad else value)
                    if epoch == 0 and step == 0:   # before any optimiser step: must be exactly 1
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
        metrics["train/skipped_replay_batches"] = len(batch.replay) - len(replays)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

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
        batch, rewards, timing = self.rollout_and_score(iteration)
        advantages, metrics = self.compute_advantages(batch, rewards)
        if self.curriculum is not None:
            metrics.update(self.observe_curriculum(iteration))
        began = time.perf_counter()
        metrics.update(self.update(batch, advantages, iteration))
        if self.config.training.gardo.refresh:
            metrics.update(self.refresh_reference(iteration + 1, metrics))
        metrics.update(timing)
        metrics["time/update"] = time.perf_counter() - began
        metrics["nfe"] = batch.nfe
        metrics["trained_transitions"] = batch.trained_transitions
        return metrics

    # ------------------------------------------------------------------ evaluation and grids
    def everywhere(self, section: str, work: Callable[[], Any]) -> Any:
        """Run ``work`` on every process. When it raises on any process, every process raises
        (its own error, or one naming the process that failed) instead of waiting at the next
        collective. ``work`` must reach its own collectives on every process."""
        acc = self.accelerator
        result, error = None, None
        try:
            result = work()
        except Exception as err:   # noqa: BLE001 (re-raised below, on every process)
            error = err
        if acc.num_processes > 1:
            own = None if error is None else \
                f"process {acc.process_index}: {type(error).__name__}: {error}"
            failed = [m for m in gather_rows([own], acc) if m]
            if failed and error is None:
                raise RuntimeError(f"{section} failed on another process ({failed[0]})")
        if error is not None:
            raise error
        return result

    def _everywhere_or_main(self, section: str, work: Callable[[], Any]) -> Any:
        """Sampling sections: on the main process alone, except under a sharded engine, where
        every forward gathers parameter shards and so every process must run it."""
        if self.sharded:
            return work()
        return self.main_only(section, work)

    def evaluate(self, iteration: int, save_images: bool = True) -> dict[str, float]:
        """The policy's held-out metrics with the EMA weights (when EMA is on)."""
        if not self.eval_records:
            return {}
        out = self.run_dir / "samples" if save_images and self.accelerator.is_main_process \
            else None
        with torch.no_grad(), self.ema_weights():
            return self.policy.evaluate(self.eval_records, iteration, out)

    GRID_ROWS = 12          # rows of the grid when the eval prompts have no families
    GRID_PER_FAMILY = 2     # rows per family otherwise

    def grid_records(self) -> list[dict]:
        """Held-out prompts of the before/after grid, chosen without looking at any result: the
        first two eval prompts of each family in the eval source's order (else the first 12)."""
        return comparison_prompts(self.eval_records, self.GRID_PER_FAMILY, self.GRID_ROWS)

    def save_grid_samples(self, tag: str) -> None:
        with torch.no_grad(), self.ema_weights():
            self.policy.save_grid_samples(self.grid_records(), self.run_dir, tag)

    def write_comparison_grid(self) -> Path | None:
        """The policy's base-vs-final comparison (``comparison.png`` / ``comparison.md``)."""
        final = self.stopped_early or self.config.run.max_iterations
        with torch.no_grad(), self.ema_weights():
            return self.policy.write_comparison_grid(
                self.grid_records(), self.run_dir, f"iteration {final}")

    # ------------------------------------------------------------------ checkpoints
    def save(self, iteration: int, folder: str | None = None) -> Path:
        """checkpoints/<iteration>/: exact-resume state (safetensors) and the user-facing weights
        (LoRA in the ecosystem's format, or the full model), EMA weights when EMA is on. Under a
        sharded engine the engine's own sharded state goes to ``engine/`` and the user-facing
        weights are consolidated on the main process. ``folder``: another name than the
        iteration (``best``: the best evaluation's, never pruned, with ``best.json`` beside it)."""
        name = folder or str(iteration)
        directory = self.run_dir / "checkpoints" / name
        tensors = dict(self.trainable)
        if self.ema is not None:
            tensors.update({f"ema:{n}": v for n, v in self.ema.state_dict().items()})
        bad = [n for n, p in tensors.items() if not bool(torch.isfinite(p).all())]
        if bad:
            raise FloatingPointError(f"not saving iteration {iteration}: {len(bad)} trainable "
                                     f"or EMA tensors hold non-finite values (first: {bad[0]}); "
                                     f"the previous checkpoint is kept")
        consolidated = None
        if self.sharded:
            # Collective: every process writes its shard and takes part in the consolidation.
            self.accelerator.save_state(str(self.run_dir / "checkpoints" /
                                            f"{ckpt.ENGINE_PREFIX}{name}"))
            consolidated = self.accelerator.get_state_dict(self.engine_module)

        def write() -> None:
            def save_weights(folder: str) -> None:
                with self.ema_weights():   # the published weights are the EMA weights
                    self.policy.save_weights(folder, consolidated)

            extra = {"name": self.config.name, "family": self.config.model.family,
                     "policy": self.config.policy, "engine": self.engine,
                     # run_id: --resume latest continues only this run's checkpoints;
                     # signature: what a resume must not change (config.resume_signature).
                     "run_id": self._run["run_id"] if self._run else None,
                     "signature": json_roundtrip(resume_signature(self.config))}
            if self.curriculum is not None:
                extra["curriculum"] = self.curriculum.state_dict()
            if self.best is not None:
                extra["best"] = self.best.state_dict()
            if self.accelerator.scaler is not None:
                extra["grad_scaler"] = self.accelerator.scaler.state_dict()
            tensor_files = {}
            if self.config.training.gardo.refresh:
                extra["reference_refreshed_at"] = self.reference_refreshed_at
                if self.reference_refreshed_at is not None:
                    tensor_files[ckpt.REFERENCE] = self.policy.reference_state()
            ckpt.save_checkpoint(
                directory, iteration=iteration,
                trainable={} if self.sharded else self.trainable,
                optimizer=None if self.sharded else self.optimizer,
                ema_state=self.ema.state_dict() if self.ema else None,
                ema_counters=self.ema.counters() if self.ema else None, save_lora=save_weights,
                extra=extra,
                # inside the folder before its completion marker, so the marker covers it
                engine_dir=(self.run_dir / "checkpoints" / f"{ckpt.ENGINE_PREFIX}{name}"
                            if self.sharded else None),
                tensor_files=tensor_files)
            if folder == ckpt.BEST:
                ckpt.write_json_atomic(self.run_dir / "checkpoints" / ckpt.BEST_RECORD,
                                       self.best.state_dict())
            elif folder is None:
                ckpt.prune_checkpoints(self.run_dir, self.config.run.keep_checkpoints)

        self.main_only(f"checkpoint {name}", write)
        return directory

    def open_run(self, resume: str | None, overwrite: bool) -> None:
        """Decide how the run starts (``checkpoint.open_run``: refuse a used folder without
        --resume / --overwrite, find the checkpoint, check its run id and signature, sweep what
        a crash left, write run.json) on the main process under the run folder's lock, and hand
        the decision to every process, so that all continue from the same checkpoint even where
        the run folder is not on a shared filesystem."""
        if self._run is not None:
            if (resume, bool(overwrite)) != self._opened_with:
                raise InputError(f"the run folder was opened with resume={self._opened_with[0]!r}"
                                 f", overwrite={self._opened_with[1]}; give resume/overwrite to "
                                 f"Trainer(...) or to train(), not different values to both")
            return
        signature = json_roundtrip(resume_signature(self.config))

        def work() -> dict:
            self._lock.acquire()
            try:
                return ckpt.open_run(self.run_dir, resume=resume, overwrite=bool(overwrite),
                                     signature=signature, name=self.config.name)
            except BaseException:
                self._lock.release()
                raise

        self._run = self.main_only("checking the run folder", work)
        self._opened_with = (resume, bool(overwrite))
        if self.accelerator.is_main_process:
            for note in ([self._lock.note] if self._lock.note else []) + self._run["notes"]:
                print(f"{self.run_dir}: {note}", flush=True)

    def resume(self, checkpoint: str | Path) -> None:
        """Load ``checkpoint`` into every process: a folder (``train`` passes the one
        ``open_run`` chose and checked), or "latest" / "auto" resolved on the main process."""
        if str(checkpoint) in ("latest", "auto"):
            found = self.main_only("resume", lambda: ckpt.resolve_resume(str(checkpoint),
                                                                         self.run_dir))
            if found is None:
                return
            checkpoint = found
        path = Path(checkpoint)
        state = ckpt.load_checkpoint(path, require_trainable=not self.sharded)
        saved_engine = state["state"].get("engine", "single")
        if self.sharded or saved_engine in ("fsdp", "deepspeed"):
            if saved_engine != self.engine:
                raise ValueError(f"checkpoint {path} was written under {saved_engine}; resume it "
                                 f"under the same engine (this run: {self.engine})")
            self.accelerator.load_state(str(path / "engine"))
        else:
            missing = set(self.trainable) - set(state["trainable"])
            if missing:
                raise ValueError(f"checkpoint {path} does not match this model/LoRA config: "
                                 f"{len(missing)} trainable tensors missing (e.g. "
                                 f"{sorted(missing)[0]})")
            with torch.no_grad():
                for name, param in self.trainable.items():
                    param.copy_(state["trainable"][name])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load(state["ema"], state["state"]["ema"])
        if self.accelerator.scaler is not None and "grad_scaler" in state["state"]:
            self.accelerator.scaler.load_state_dict(state["state"]["grad_scaler"])
        torch.set_rng_state(state["rng"])
        self.start_iteration = int(state["state"]["iteration"])
        if self.config.training.gardo.refresh:
            self.resume_reference(path, state["state"])
        if self.best is not None:
            self.restore_best(state["state"].get("best"))
        if self.curriculum is not None:
            if "curriculum" in state["state"]:
                self.curriculum.load_state_dict(state["state"]["curriculum"])
            else:
                print(f"checkpoint {path} has no curriculum state (saved without "
                      f"prompts.curriculum): the curriculum starts from its prior", flush=True)
        self.check_replicas(f"resuming from {path}")

    def resume_reference(self, path: Path, state: dict) -> None:
        """The refreshed KL reference of checkpoint ``path`` (training.gardo.refresh_every /
        refresh_kl): its weights and the iteration they were taken at."""
        if "reference_refreshed_at" not in state:
            if self.accelerator.is_main_process:
                print(f"checkpoint {path} has no KL reference state (saved without "
                      f"training.gardo.refresh_every / refresh_kl): the reference is the "
                      f"initial model until the next refresh", flush=True)
            return
        at = state["reference_refreshed_at"]
        self.reference_refreshed_at = None if at is None else int(at)
        if at is not None:
            if not (path / ckpt.REFERENCE).is_file():
                raise InputError(f"checkpoint {path} says the KL reference was refreshed at "
                                 f"iteration {at} but has no {ckpt.REFERENCE}; resume from "
                                 f"another checkpoint")
            self.policy.load_reference_state(load_file(str(path / ckpt.REFERENCE)))

    def restore_best(self, saved: dict | None) -> None:
        """After loading a checkpoint: take over its record of the best evaluation (same
        run.select_best_on and mode), and make checkpoints/best/ agree with it. A best folder
        written after the resumed iteration belongs to the continuation being replaced: it is
        set aside under checkpoints/superseded-*/ (as later numbered checkpoints are)."""
        restored = self.best.load_state_dict(saved)

        def reconcile() -> None:
            notes = []
            if saved and not restored:
                notes.append(f"the checkpoint's best record is for {saved.get('key')!r} "
                             f"({saved.get('mode')}); run.select_best_on is now "
                             f"{self.best.key!r} ({self.best.mode}): its best starts afresh")
            folder = self.run_dir / "checkpoints" / ckpt.BEST
            if folder.is_dir():
                held = int(ckpt.read_state(folder)["iteration"])
                if held > self.start_iteration:
                    moved = ckpt.set_aside(self.run_dir, ckpt.BEST)
                    record = self.run_dir / "checkpoints" / ckpt.BEST_RECORD
                    if record.is_file():
                        os.replace(record, moved.parent / ckpt.BEST_RECORD)
                    notes.append(f"checkpoints/best (iteration {held}) came after the resumed "
                                 f"iteration {self.start_iteration}: moved to {moved}")
                    if restored and self.best.iteration is not None:
                        notes.append(f"the best so far stays iteration {self.best.iteration} "
                                     f"({self.best.key} {self.best.value:.4g}); its weights "
                                     f"are saved again at the next new best")
                elif restored and held == self.best.iteration:
                    ckpt.write_json_atomic(self.run_dir / "checkpoints" / ckpt.BEST_RECORD,
                                           self.best.state_dict())
            for note in notes:
                print(f"{self.run_dir}: {note}", flush=True)

        self.main_only("reconciling checkpoints/best", reconcile)

    # ------------------------------------------------------------------ the run
    def log(self, record: dict) -> None:
        self.history.append(record)
        if self.accelerator.is_main_process:
            append_record(self.run_dir / ckpt.METRICS, record)
            if self.tracker != "none":
                scalars = {k: v for k, v in record.items()
                           if isinstance(v, (int, float)) and k != "iteration"}
                self.accelerator.log(scalars, step=record["iteration"])

    def eval_and_log(self, iteration: int) -> None:
        """Evaluate -> log (metrics.jsonl, tracker scalars) -> print a line, redraw curves.png,
        send the samples to the tracker -> keep checkpoints/best/ when run.select_best_on
        improved (every process decides alike: the metrics are gathered)."""
        # Every process evaluates its share of the held-out rows (the policy gathers them).
        metrics = self.everywhere(f"evaluation at {iteration}", lambda: self.evaluate(iteration))
        record = {"iteration": iteration, "phase": "eval", **(metrics or {})}
        self.log(record)
        if metrics:
            self.main_only(f"curves and samples of evaluation {iteration}",
                           lambda: self.report_evaluation(iteration, record))
        if self.best is not None and metrics and self.best.observe(iteration, metrics):
            self.save(iteration, folder=ckpt.BEST)

    def report_evaluation(self, iteration: int, record: dict) -> None:
        """Main process: the evaluation's line on the console, ``curves.png`` redrawn from the
        whole metrics log, the evaluation samples to the tracker."""
        tqdm.write(eval_line(iteration, record, self.directions, self.heldout_keys))
        curves.write_curves(read_records(self.run_dir / ckpt.METRICS),
                            self.run_dir / curves.CURVES, self.directions, self.heldout_keys)
        if self.tracker != "none":
            log_eval_media(self.accelerator, self.tracker, self.run_dir / "samples", iteration)

    def train(self, resume: str | None = None, overwrite: bool | None = None) -> list[dict]:
        """Run to ``run.max_iterations``. ``resume``: None (a new run), "latest" (the newest
        complete checkpoint of this run; an error when there is none), "auto" (the newest, or a
        new run when there is none) or a checkpoint folder (of any run). A run folder that
        already holds a run is refused unless ``resume`` is given or ``overwrite`` is True
        (which deletes it first). The folder stays locked against other processes until the
        run ends."""
        try:
            if self._run is None or resume is not None or overwrite is not None:
                self.open_run(resume, bool(overwrite))   # else as given to Trainer(...)
            return self._train()
        finally:
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
        if self.start_iteration == 0:
            self.eval_and_log(0)
            if cfg.run.comparison_grid:
                self._everywhere_or_main("base grid samples", lambda: self.save_grid_samples("base"))
        bar = tqdm(range(self.start_iteration, cfg.run.max_iterations), initial=self.start_iteration,
                   total=cfg.run.max_iterations, disable=not (cfg.run.progress and
                                                            self.accelerator.is_main_process),
                   desc=cfg.name, dynamic_ncols=True)
        began = time.perf_counter()
        for iteration in bar:
            tick = time.perf_counter()
            metrics = self.run_iteration(iteration)
            metrics["time/iteration"] = time.perf_counter() - tick
            done = iteration + 1
            self.log({"iteration": done, "phase": "train", **metrics})
            bar.set_postfix(reward=f"{metrics.get('reward/total/mean', float('nan')):.3f}",
                            sec=f"{metrics['time/iteration']:.1f}")
            if metrics["reward/nan_count"]:
                bar.write(f"iteration {done}: {metrics['reward/nan_count']} samples had no finite "
                          f"reward (NaN or +-inf); they were masked out of the advantages")
            last = done == cfg.run.max_iterations
            stop = False
            if (cfg.run.eval_every and done % cfg.run.eval_every == 0) or last:
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
        bar.close()
        if cfg.run.comparison_grid:
            self._everywhere_or_main("comparison grid", self.write_comparison_grid)
        if self.tracker != "none":
            self.accelerator.end_training()
        if self.accelerator.is_main_process:
            self.print_summary(time.perf_counter() - began)
        return self.history

    def print_summary(self, seconds: float) -> None:
        print(summary_line(self.config.name, self.history, seconds, self.run_dir,
                           directions=self.directions, heldout=self.heldout_keys,
                           best=self.best.state_dict() if self.best is not None else None,
                           stopped_early=self.stopped_early,
                           patience=self.config.run.early_stop_patience), flush=True)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
