"""The training loop: rollout -> reward -> gather -> advantages -> clipped-surrogate updates.

One loop for every FlowModel and every StepPlan. It orchestrates; the maths lives in
``sde.py`` (transitions), ``plans.py`` (which steps), ``advantages.py`` and ``losses.py``.
Follow one iteration in ``Trainer.run_iteration``.
"""
from __future__ import annotations

import copy
import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import Tensor

from flowgrpo import checkpoint as ckpt
from flowgrpo.advantages import decoupled_advantages, group_advantages
from flowgrpo.config import TrainConfig, dump_config, to_dict, validate
from flowgrpo.ema import EMA
from flowgrpo.losses import (check_weights, flow_kl, guard_log_ratio, guard_step_weights,
                             policy_loss, rectification_weights, surrogate_stats)
from flowgrpo.plans import make_plan
from flowgrpo.passk import family_mean_se, mean_and_se
from flowgrpo.prompts import (PromptCurriculum, bucket_labels, comparison_prompts, eval_selection,
                              load_prompts, mixed_groups, sample_indices)
from flowgrpo.rollout import (RolloutBatch, RolloutSettings, replay_logp, rollout, sample_ode,
                              seeded_generator)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


class Trainer:
    """Builds everything from a validated ``TrainConfig`` and runs GRPO on a FlowModel."""

    def __init__(self, config: TrainConfig, accelerator=None, model=None) -> None:
        from accelerate import Accelerator

        self.config = config
        tracker = config.run.tracker
        if tracker == "tensorboard":
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                tracker = "none"
        self.run_dir = Path(config.run.output_dir) / config.name
        self.accelerator = accelerator or Accelerator(
            mixed_precision=config.training.mixed_precision,
            log_with=None if tracker == "none" else tracker,
            project_dir=str(self.run_dir))
        self.tracker = tracker
        # Batch divisibility depends on the process count, known only now.
        validate(config, num_processes=self.accelerator.num_processes)
        if config.run.num_threads:
            torch.set_num_threads(config.run.num_threads)
        torch.manual_seed(config.run.seed)

        # Cheap things first: a bad prompt file or reward name fails before the model loads.
        self.train_records = load_prompts(config.prompts.train)
        self.eval_records = load_prompts(config.prompts.eval) if config.prompts.eval else []
        if config.prompts.num_eval:
            self.eval_records = self.eval_records[:config.prompts.num_eval]
        self.reward = self.load_rewards()
        cur = config.prompts.curriculum
        self.curriculum = PromptCurriculum(
            [r["prompt"] for r in self.train_records], floor=cur.floor, prior=cur.prior,
            prior_strength=cur.prior_strength, decay=cur.decay) if cur.enabled else None
        self.train_buckets = (bucket_labels(self.train_records, config.prompts.balance_key)
                              if config.prompts.balance_key else None)
        self._drawn: tuple[int, list[int]] | None = None

        self.model = model   # tests and benchmarks may hand in a built FlowModel
        self.load_policy()
        t = config.training
        self.optimizer = self._make_optimizer()
        self.ema = EMA(self.trainable, t.ema.decay, t.ema.every) if t.ema.enabled else None
        self.start_iteration = 0
        self.reference_module = None
        if t.kl_beta > 0 and not config.model.lora.enabled:
            # Full fine-tuning has no adapter to disable: keep a frozen copy as the reference.
            self.reference_module = copy.deepcopy(self.module).requires_grad_(False)
        self.history: list[dict] = []

    def load_rewards(self):
        """The MultiReward of the config's components (every component is logged)."""
        from reward_models import MultiReward

        return MultiReward.from_config(
            [{"name": c.name, "weight": c.weight, **c.options}
             for c in self.config.rewards.components],
            aggregation=self.config.rewards.aggregation)

    def load_policy(self) -> None:
        """Load the model and make its trainable parameters (LoRA or full). Sets ``self.model``
        (the FlowModel), ``self.module`` (the nn.Module that trains) and ``self.trainable``."""
        from pipelines import load_model

        m = self.config.model
        if self.model is None:
            self.model = load_model(m.family, m.path, dtype=DTYPES[m.dtype],
                                    device=self.accelerator.device, options=dict(m.options))
        self.module = self.model.transformer
        self.setup_trainable(self.model.lora_target_modules)
        self.base_sigmas = self.model.sigmas(self.config.sampling.num_steps)

    # ------------------------------------------------------------------ setup helpers
    def setup_trainable(self, default_targets: list[str]) -> None:
        m = self.config.model
        self.module.requires_grad_(False)
        if m.gradient_checkpointing:
            self.module.gradient_checkpointing_enable() if hasattr(
                self.module, "gradient_checkpointing_enable") else \
                self.module.enable_gradient_checkpointing()
        if m.lora.enabled:
            from peft import LoraConfig

            targets = m.lora.target_modules or default_targets
            self.module.add_adapter(LoraConfig(
                r=m.lora.rank, lora_alpha=m.lora.alpha, target_modules=targets,
                init_lora_weights="gaussian" if m.lora.init == "gaussian" else True))
            for param in self.module.parameters():
                if param.requires_grad:
                    param.data = param.data.float()   # LoRA weights train in float32
        else:
            self.module.requires_grad_(True)
        self.trainable = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        if not self.trainable:
            raise ValueError("model.lora.target_modules matched no module: nothing to train")

    def _make_optimizer(self) -> torch.optim.Optimizer:
        t = self.config.training
        params = list(self.trainable.values())
        if t.use_8bit_adam:
            try:
                import bitsandbytes as bnb
            except ImportError as err:
                raise ImportError("training.use_8bit_adam needs bitsandbytes: pip install "
                                  "'flowgrpo[gpu]'") from err
            return bnb.optim.AdamW8bit(params, lr=t.lr, betas=t.adam_betas,
                                       weight_decay=t.weight_decay, eps=t.adam_eps)
        # The fused kernel updates every tensor in one call: 4.2-4.4x faster than the per-tensor
        # loop for the toy model's 94 tensors on one CPU thread, weights equal to 1.5e-8 after
        # 53 steps (python benchmarks/optimizer.py).
        fused = all(p.dtype.is_floating_point and p.device.type in ("cpu", "cuda") for p in params)
        return torch.optim.AdamW(params, lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay,
                                 eps=t.adam_eps, fused=fused or None)

    @contextmanager
    def reference_policy(self):
        """The KL reference: the same transformer with LoRA disabled (no copy in memory)."""
        if self.reference_module is not None:
            live = self.model.transformer
            self.model.transformer = self.reference_module
            try:
                yield
            finally:
                self.model.transformer = live
        else:
            self.module.disable_adapters()
            try:
                yield
            finally:
                self.module.enable_adapters()

    def settings(self, iteration: int) -> RolloutSettings:
        s = self.config.sampling
        return RolloutSettings(kind=s.kind, noise_level=s.noise_level,
                               guidance_scale=s.guidance_scale, batch_size=s.rollout_batch_size,
                               share_initial_noise=s.share_initial_noise, seed=self.config.run.seed,
                               iteration=iteration)

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

    def rollout_and_score(self, iteration: int) -> tuple[RolloutBatch, dict[str, Tensor], dict]:
        records, group_ids, sample_ids = self.local_batch(iteration)
        prompts = [r["prompt"] for r in records]
        metadata = [r["metadata"] for r in records]
        plans = {int(g): make_plan(self.config.sampling.plan, self.base_sigmas, iteration, int(g),
                                   self.config.run.seed) for g in group_ids.unique()}
        futures: list[tuple[Tensor, Future]] = []
        reward_seconds: list[float] = []
        executor = ThreadPoolExecutor(max_workers=1) if self.config.rewards.threaded else None

        def score(rows: Tensor, media: Tensor) -> dict[str, Tensor]:
            began = time.perf_counter()
            picked = rows.tolist()    # iterating the tensor would make a 0-d tensor per row
            out = self.reward(media, [prompts[i] for i in picked], [metadata[i] for i in picked])
            reward_seconds.append(time.perf_counter() - began)
            return out

        def on_media(rows: Tensor, media: Tensor) -> None:
            if executor is not None:
                futures.append((rows, executor.submit(score, rows, media)))
            else:
                done: Future = Future()
                done.set_result(score(rows, media))
                futures.append((rows, done))

        began = time.perf_counter()
        with torch.no_grad(), self.accelerator.autocast():
            batch = rollout(self.model, prompts, metadata, group_ids, sample_ids, plans,
                            self.settings(iteration), on_media=on_media)
        rollout_seconds = time.perf_counter() - began
        began = time.perf_counter()
        rewards: dict[str, Tensor] = {}
        for rows, future in futures:
            for name, values in future.result().items():
                if name not in rewards:
                    rewards[name] = torch.full((len(prompts),), float("nan"))
                rewards[name][rows] = values.float().cpu()
        if executor is not None:
            executor.shutdown()
        timing = {"time/rollout": rollout_seconds, "time/reward_wait": time.perf_counter() - began,
                  "time/reward_compute": sum(reward_seconds)}
        return batch, rewards, timing

    def compute_advantages(self, batch: RolloutBatch, rewards: dict[str, Tensor]
                           ) -> tuple[Tensor, dict[str, float]]:
        """Gather rewards over processes, compute advantages on the whole batch, keep ours."""
        t = self.config.training
        acc = self.accelerator
        device = acc.device
        gathered = {k: acc.gather(v.to(device)).cpu() for k, v in rewards.items()}
        group_ids = acc.gather(batch.group_ids.to(device)).cpu()
        clip = t.adv_clip or None
        if self.config.rewards.aggregation == "decoupled":
            components = {k: v for k, v in gathered.items() if k in self.reward.weights}
            advantages, stats = decoupled_advantages(components, self.reward.weights, group_ids,
                                                     ddof=t.adv_ddof, eps=t.adv_eps, clip=clip)
        else:
            advantages, stats = group_advantages(gathered["total"], group_ids, scale=t.adv_scale,
                                                 ddof=t.adv_ddof, eps=t.adv_eps, clip=clip)
        local = len(batch.prompts)
        start = acc.process_index * local
        metrics = {f"adv/{k}": float(v) for k, v in stats.items()}
        for name, values in gathered.items():
            valid = values[~values.isnan()]
            metrics[f"reward/{name}/mean"] = float(valid.mean()) if len(valid) else float("nan")
            metrics[f"reward/{name}/std"] = float(valid.std(unbiased=False)) if len(valid) else 0.0
        metrics["reward/nan_count"] = int(gathered["total"].isnan().sum())
        # The same on every process (gathered), for the curriculum's bookkeeping.
        self.gathered = (gathered, group_ids)
        return advantages[start:start + local], metrics

    def observe_curriculum(self, iteration: int) -> dict[str, float]:
        """Record which of the iteration's groups had reward variance (from the gathered rewards,
        so every process records the same) and return the curriculum's ``train/`` metrics:
        ``curriculum_mixed_share`` (this iteration's groups), ``curriculum_expected_mixed_share``
        and ``curriculum_uniform_mixed_share`` (the estimated mixed share of a draw with and
        without the curriculum, after this update) and ``curriculum_seen_prompts``."""
        gathered, group_ids = self.gathered
        keys = (list(self.reward.weights) if self.config.rewards.aggregation == "decoupled"
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

    def update(self, batch: RolloutBatch, advantages: Tensor, iteration: int) -> dict[str, float]:
        """num_inner_epochs passes over the rollout's replay batches, clipped-surrogate loss."""
        t = self.config.training
        acc = self.accelerator
        settings = self.settings(iteration)
        clip_high = t.clip_low if t.clip_high is None else t.clip_high
        replays = [r for r in batch.replay
                   if not (t.skip_zero_std_groups and bool((advantages[r.rows] == 0).all()))]
        # Every process must run the same number of optimiser steps (gradient all-reduce).
        count = torch.tensor([len(replays)], device=acc.device)
        max_count = int(acc.gather(count).max()) if acc.num_processes > 1 else len(replays)
        per_step = t.gradient_accumulation_steps or max(max_count, 1)
        num_steps = max(math.ceil(max_count / per_step), 1)
        step_weights = self.step_weights(replays)
        # Per replay batch only detached tensors are kept; the statistics are computed once over
        # all of them at the end (``update_metrics``), so they describe the whole update.
        rows: dict[str, list[Tensor]] = {}
        # d objective / d loss of a replay batch = 1 / per_step (gradient accumulation), handed
        # to backward() as its seed: a (loss / per_step) would add an op and an autograd node.
        seed: Tensor | None = None
        first_pass_dev: list[Tensor] = []
        grad_norms: list[float] = []
        for epoch in range(t.num_inner_epochs):
            order = torch.randperm(len(replays), generator=seeded_generator(
                self.config.run.seed, iteration, "epoch", epoch)).tolist()
            for step in range(num_steps):
                window = order[step * per_step:(step + 1) * per_step]
                for index in window:
                    with acc.autocast():
                        loss, record = self.replay_loss(batch, replays[index], advantages,
                                                        settings, clip_high, step_weights[index])
                    if seed is None or seed.dtype != loss.dtype or seed.device != loss.device:
                        seed = torch.full((), 1.0 / per_step, dtype=loss.dtype, device=loss.device)
                    loss.backward(seed)
                    for key, value in record.items():   # detached by contract; a detach is an op
                        rows.setdefault(key, []).append(
                            value.detach() if value.requires_grad else value)
                    if epoch == 0 and step == 0:   # before any optimiser step: must be exactly 1
                        first_pass_dev.append(record["ratio_max_dev"])
                grad_norms.append(self.optimizer_step())
        metrics = {f"train/{k}": float(v) for k, v in self.update_metrics(
            {key: torch.stack(values) if values[0].dim() == 0 else torch.cat(values)
             for key, values in rows.items()}, clip_high).items()}
        metrics["train/grad_norm"] = _mean(grad_norms)
        metrics["train/first_pass_ratio_max_dev"] = \
            float(torch.stack(first_pass_dev).max()) if first_pass_dev else 0.0
        metrics["train/replay_batches"] = len(replays)
        metrics["train/skipped_replay_batches"] = len(batch.replay) - len(replays)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def step_weights(self, replays: list) -> list[Tensor]:
        """Per-row loss weights of each replay batch: GRPO-Guard's 1/dt and/or Flash-GRPO's kappa,
        normalised by their mean over the iteration's trained transitions (a replay batch holds a
        single step, so normalising within it would make every weight 1)."""
        t = self.config.training
        raw = []
        for replay in replays:
            weights = torch.ones_like(replay.logp_old)
            if t.dt_reweight:
                weights = weights * guard_step_weights(replay.sigmas, replay.sigmas_next,
                                                       normalize=False)
            if t.rectification:
                weights = weights * rectification_weights(replay.sigmas, replay.sigmas_next,
                                                          replay.std, normalize=False)
            raw.append(weights)
        if raw and (t.dt_reweight or t.rectification):
            mean = torch.cat(raw).mean()
            raw = [w / mean for w in raw]
            check_weights(torch.cat(raw))   # once here, so the loss skips it per replay batch
        return raw

    def replay_condition(self, batch: RolloutBatch, replay):
        """Prompt embeddings of a replay batch's rows; the batch's unique prompts are encoded once
        per update and rows are picked from them. The rollout hands every step of a chunk the
        same ``rows`` tensor, so a selection is made once per chunk and reused for its steps."""
        if getattr(self, "_cond_batch", None) is not batch:
            unique = list(dict.fromkeys(batch.prompts))
            self._cond_unique = self.model.encode_prompts(unique).to(self.model.device)
            self._cond_index = torch.tensor([unique.index(p) for p in batch.prompts])
            self._cond_batch = batch
            self._cond_by_rows = {}
        # Keyed by the tensor's id: the batch keeps every rows tensor alive, so an id cannot be
        # reused while this cache (reset with the batch) is in use.
        key = id(replay.rows)
        if key not in self._cond_by_rows:
            self._cond_by_rows[key] = self._cond_unique.select(self._cond_index[replay.rows])
        return self._cond_by_rows[key]

    def replay_loss(self, batch: RolloutBatch, replay, advantages: Tensor,
                    settings: RolloutSettings, clip_high: float, weights: Tensor
                    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one replay batch: surrogate (+ Guard / rectification weights) + KL.
        Returns the loss and a record of detached tensors for ``update_metrics``: per row
        ``log_ratio`` (the one the loss used), ``advantages`` and ``weights``; 0-d
        ``ratio_max_dev`` (max |exp(logp - logp_old) - 1|, exactly 0 on the first pass),
        ``policy_loss`` (and ``kl``)."""
        cond = self.replay_condition(batch, replay)
        t = self.config.training
        logp, mean = replay_logp(self.model, replay, cond, settings)
        adv = advantages[replay.rows]
        adv = adv if adv.device == logp.device else adv.to(logp.device)
        raw_log_ratio = logp.detach() - replay.logp_old
        log_ratio = guard_log_ratio(logp, replay.logp_old, mean, replay.mean_old, replay.std) \
            if t.ratio_norm else None
        loss, _ = policy_loss(logp, replay.logp_old, adv, t.clip_low, clip_high,
                              weights=weights, log_ratio=log_ratio, with_stats=False,
                              validate=False)
        record = {"log_ratio": raw_log_ratio if log_ratio is None else log_ratio.detach(),
                  "advantages": adv, "weights": weights,
                  "ratio_max_dev": torch.expm1(raw_log_ratio).abs().max(),
                  "policy_loss": loss.detach()}
        if t.kl_beta > 0:
            with torch.no_grad(), self.reference_policy():
                _, mean_ref = replay_logp(self.model, replay, cond, settings)
            kl = flow_kl(mean, mean_ref, replay.std).mean()
            loss = loss + t.kl_beta * kl
            record["kl"] = kl.detach()
        return loss, record

    def update_metrics(self, rows: dict[str, Tensor], clip_high: float) -> dict[str, Tensor]:
        """An update's statistics from the concatenated records of its replay batches:
        ``surrogate_stats`` over every trained row, and the mean policy loss (and KL)."""
        if not rows:
            return {}
        stats = surrogate_stats(rows["log_ratio"], rows["advantages"], self.config.training.clip_low,
                                clip_high, rows["weights"])
        stats["policy_loss"] = rows["policy_loss"].float().mean()
        if "kl" in rows:
            stats["kl"] = rows["kl"].float().mean()
        return stats

    def optimizer_step(self) -> float:
        acc = self.accelerator
        params = list(self.trainable.values())
        if acc.num_processes > 1:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad = acc.reduce(p.grad, reduction="mean")
        max_norm = self.config.training.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step()
        return float(norm)

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
        metrics.update(timing)
        metrics["time/update"] = time.perf_counter() - began
        metrics["nfe"] = batch.nfe
        metrics["trained_transitions"] = batch.trained_transitions
        return metrics

    # ------------------------------------------------------------------ evaluation
    def eval_noise(self, count: int) -> Tensor:
        return torch.cat([self.model.initial_noise(1, seeded_generator(self.config.run.seed, "eval", i))
                          for i in range(count)])

    def eval_samples(self) -> list[dict]:
        """The held-out records to sample at evaluation, one entry per sample (fixed noise each)."""
        p = self.config.prompts
        return eval_selection(self.eval_records, p.eval_per_family, p.eval_seeds)

    @torch.no_grad()
    def evaluate(self, iteration: int, save_images: bool = True) -> dict[str, float]:
        """Deterministic-sampler rewards on the held-out prompts, per component and per family."""
        if not self.eval_records:
            return {}
        s = self.config.sampling
        records = self.eval_samples()
        prompts = [r["prompt"] for r in records]
        metadata = [r["metadata"] for r in records]
        guidance = s.guidance_scale if s.eval_guidance_scale is None else s.eval_guidance_scale
        swap = self.ema.swapped_in() if self.ema is not None else nullcontext()
        with swap, self.accelerator.autocast():
            media = sample_ode(self.model, prompts, self.eval_noise(len(prompts)), s.eval_num_steps,
                               guidance, batch_size=max(s.rollout_batch_size, 16))
        scores = self.reward(media, prompts, metadata)
        metrics: dict[str, float] = {}
        # Every mean X comes with its standard error X/se (std / sqrt(n), flowgrpo.passk).
        for name, values in scores.items():
            valid = values[~values.isnan()]
            metrics[f"eval/{name}"] = float(valid.mean()) if len(valid) else float("nan")
            metrics[f"eval/{name}/se"] = mean_and_se(valid)[1]
            families = sorted({str(m.get("family")) for m in metadata if m.get("family")})
            per_family, per_family_se = [], []
            for family in families:
                mask = torch.tensor([m.get("family") == family for m in metadata]) & ~values.isnan()
                if mask.any():
                    metrics[f"eval/{name}/{family}"] = float(values[mask].mean())
                    metrics[f"eval/{name}/{family}/se"] = mean_and_se(values[mask])[1]
                    per_family.append(metrics[f"eval/{name}/{family}"])
                    per_family_se.append(metrics[f"eval/{name}/{family}/se"])
            if per_family:
                # GenEval's overall score: the mean over task families, not over prompts.
                metrics[f"eval/{name}/family_mean"] = _mean(per_family)
                metrics[f"eval/{name}/family_mean/se"] = family_mean_se(per_family_se)
        if save_images:
            from torchvision.utils import save_image

            images = media[:64] if media.dim() == 4 else media[:16, 0]
            out = self.run_dir / "samples"
            out.mkdir(parents=True, exist_ok=True)
            save_image(images, out / f"eval_{iteration:05d}.png", nrow=8)
        return metrics

    GRID_ROWS = 12          # rows of the grid when the eval prompts have no families
    GRID_PER_FAMILY = 2     # rows per family otherwise

    def grid_records(self) -> list[dict]:
        """Held-out prompts of the before/after grid, chosen without looking at any result: the
        first two eval prompts of each family in the eval source's order (else the first 12)."""
        return comparison_prompts(self.eval_records, self.GRID_PER_FAMILY, self.GRID_ROWS)

    @torch.no_grad()
    def save_grid_samples(self, tag: str) -> None:
        """Deterministic samples of the grid prompts, saved as safetensors (survives a resume)."""
        from safetensors.torch import save_file

        records = self.grid_records()
        if not records:
            return
        s = self.config.sampling
        guidance = s.guidance_scale if s.eval_guidance_scale is None else s.eval_guidance_scale
        swap = self.ema.swapped_in() if self.ema is not None else nullcontext()
        with swap, self.accelerator.autocast():
            media = sample_ode(self.model, [r["prompt"] for r in records],
                               self.eval_noise(len(records)), s.eval_num_steps, guidance)
        save_file({"media": media.contiguous()}, str(self.run_dir / f"grid_{tag}.safetensors"))

    def write_comparison_grid(self) -> Path | None:
        """runs/<name>/comparison.png: rows = held-out prompts (``grid_records``), columns = base
        and final model, the same noise across a row, each cell captioned with the verifier's
        verdict (PASS / FAIL for a reward whose scores are all 0 or 1) and the score of each
        reward (``commands.cell_caption``)."""
        from safetensors.torch import load_file

        from flowgrpo.commands import cell_caption, verdict_keys
        from flowgrpo.grids import image_grid

        base_path = self.run_dir / "grid_base.safetensors"
        records = self.grid_records()
        if not base_path.is_file() or not records:
            return None
        self.save_grid_samples("final")
        base = load_file(str(base_path))["media"]
        final = load_file(str(self.run_dir / "grid_final.safetensors"))["media"]
        if base.dim() != 4:
            return None   # video runs: use `flowgrpo grid` for MP4 grids
        prompts = [r["prompt"] for r in records]
        metadata = [r["metadata"] for r in records]
        scores = [self.reward(m, prompts, metadata) for m in (base, final)]
        weights = self.reward.weights
        verdicts = verdict_keys(scores, weights)
        images = torch.stack([base, final], dim=1)
        labels = [[cell_caption(scores[c], weights, r, verdict=verdicts) for c in range(2)]
                  for r in range(len(records))]
        rows = [f"{r['prompt']}\n({r['metadata']['family']})" if r["metadata"].get("family")
                else r["prompt"] for r in records]
        grid = image_grid(images, row_labels=rows,
                          col_labels=["base", f"iteration {self.config.run.max_iterations}"],
                          cell_labels=labels)
        path = self.run_dir / "comparison.png"
        grid.save(path)
        return path

    # ------------------------------------------------------------------ checkpoints
    def save(self, iteration: int) -> Path:
        directory = self.run_dir / "checkpoints" / str(iteration)
        swap = self.ema.swapped_in() if self.ema is not None else nullcontext()

        def save_lora(folder: str) -> None:
            with swap:   # the published weights are the EMA weights when EMA is on
                self.save_policy_weights(folder)

        if self.accelerator.is_main_process:
            ckpt.save_checkpoint(
                directory, iteration=iteration, trainable=self.trainable, optimizer=self.optimizer,
                ema_state=self.ema.state_dict() if self.ema else None,
                ema_counters=self.ema.counters() if self.ema else None, save_lora=save_lora,
                extra={"name": self.config.name, "family": self.config.model.family,
                       "policy": self.config.policy,
                       **({"curriculum": self.curriculum.state_dict()}
                          if self.curriculum is not None else {})})
            ckpt.prune_checkpoints(self.run_dir, self.config.run.keep_checkpoints)
        self.accelerator.wait_for_everyone()
        return directory

    def save_policy_weights(self, folder: str) -> None:
        """LoRA in the diffusers format (``pipe.load_lora_weights(folder)``), or the full
        transformer under ``folder/transformer`` (``from_pretrained``-loadable)."""
        from peft import get_peft_model_state_dict

        if self.config.model.lora.enabled:
            self.model.save_lora_weights(folder, get_peft_model_state_dict(self.module))
        else:
            self.module.save_pretrained(Path(folder) / "transformer")

    def resume(self, resume: str) -> None:
        path = ckpt.resolve_resume(resume, self.run_dir)
        if path is None:
            return
        state = ckpt.load_checkpoint(path)
        missing = set(self.trainable) - set(state["trainable"])
        if missing:
            raise ValueError(f"checkpoint {path} does not match this model/LoRA config: "
                             f"{len(missing)} trainable tensors missing (e.g. {sorted(missing)[0]})")
        with torch.no_grad():
            for name, param in self.trainable.items():
                param.copy_(state["trainable"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load(state["ema"], state["state"]["ema"])
        torch.set_rng_state(state["rng"])
        self.start_iteration = int(state["state"]["iteration"])
        if self.curriculum is not None:
            if "curriculum" in state["state"]:
                self.curriculum.load_state_dict(state["state"]["curriculum"])
            else:
                print(f"checkpoint {path} has no curriculum state (saved without "
                      f"prompts.curriculum): the curriculum starts from its prior", flush=True)

    # ------------------------------------------------------------------ the run
    def log(self, record: dict) -> None:
        self.history.append(record)
        if self.accelerator.is_main_process:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            if self.tracker != "none":
                scalars = {k: v for k, v in record.items()
                           if isinstance(v, (int, float)) and k != "iteration"}
                self.accelerator.log(scalars, step=record["iteration"])

    def train(self, resume: str | None = None) -> list[dict]:
        from tqdm.auto import tqdm

        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self.resume(resume)
        if self.accelerator.is_main_process:
            dump_config(cfg, self.run_dir / "config.yaml")
            self._truncate_metrics(self.start_iteration)
        if self.tracker != "none":
            flat = {k: str(v) for k, v in _flatten(to_dict(cfg)).items()}
            self.accelerator.init_trackers(cfg.name, config=flat)
        if self.start_iteration == 0 and self.accelerator.is_main_process:
            self.log({"iteration": 0, "phase": "eval", **self.evaluate(0)})
            if cfg.run.comparison_grid:
                self.save_grid_samples("base")
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
                bar.write(f"iteration {done}: {metrics['reward/nan_count']} samples had no reward "
                          f"(NaN); they were masked out of the advantages")
            last = done == cfg.run.max_iterations
            if (cfg.run.eval_every and done % cfg.run.eval_every == 0) or last:
                if self.accelerator.is_main_process:
                    self.log({"iteration": done, "phase": "eval", **self.evaluate(done)})
                self.accelerator.wait_for_everyone()
            if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or last:
                self.save(done)
        bar.close()
        if cfg.run.comparison_grid and self.accelerator.is_main_process:
            self.write_comparison_grid()
        if self.tracker != "none":
            self.accelerator.end_training()
        if self.accelerator.is_main_process:
            self.print_summary(time.perf_counter() - began)
        return self.history

    def _truncate_metrics(self, start: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        # A resumed run rewrites what came after its checkpoint, so the log has no duplicates.
        keep = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["iteration"] <= start]
        path.write_text("".join(line + "\n" for line in keep) if start else "")

    def print_summary(self, seconds: float) -> None:
        evals = [h for h in self.history if h["phase"] == "eval"]
        trains = [h for h in self.history if h["phase"] == "train"]
        parts = [f"{self.config.name}: {len(trains)} iterations in {seconds:.0f} s"]
        if trains:
            parts.append(f"train reward {trains[0].get('reward/total/mean', float('nan')):.3f} -> "
                         f"{trains[-1].get('reward/total/mean', float('nan')):.3f}")
        if len(evals) >= 1:
            keys = [k for k in evals[-1] if k.startswith("eval/") and
                    (k.count("/") == 1 or k.endswith("/family_mean"))]
            for key in keys:
                first = evals[0].get(key, float("nan"))
                se = evals[-1].get(f"{key}/se")
                parts.append(f"{key} {first:.3f} -> {evals[-1][key]:.3f}"
                             + (f" (se {se:.3f})" if se is not None else ""))
        if (self.run_dir / "comparison.png").is_file():
            parts.append(f"grid {self.run_dir / 'comparison.png'}")
        parts.append(f"outputs in {self.run_dir}")
        print(" | ".join(parts), flush=True)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
