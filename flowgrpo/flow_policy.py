"""The flow-matching policy: a FlowModel (any family of ``pipelines``) as an MDP over denoising steps.

Rollouts follow each group's StepPlan (``plans.py``) with SDE/ODE transitions (``sde.py``) and keep
every trained transformer call as a replay batch (``rollout.py``); the loss of a replay batch is
the clipped surrogate on its exact Gaussian log-probs (``losses.py``), plus GRPO-Guard's ratio
normalisation and step weights, Flash-GRPO's rectification and the KL to the reference.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from flowgrpo.config import TrainConfig, check_reward_key, reward_output_keys
from flowgrpo.dtypes import parse_dtype
from flowgrpo.edit_regions import difference_mask, stack_masks
from flowgrpo.errors import ConfigError
from flowgrpo.flow_batches import accumulation_steps, ema_updates_per_step, rollout_sigmas
from flowgrpo.flow_evaluation import FlowEvaluation
from flowgrpo.guards import check_gate_keys, check_guard_keys, loaded_reward_keys
from flowgrpo.heldout import load_eval_rewards
from flowgrpo.losses import (batch_mean_dt_weights, check_weights, fixed_region_shares, flow_kl,
                             gated_kl, guard_log_ratio, guard_step_weights, policy_loss,
                             rectification_weights, region_flow_kl, region_flow_matching,
                             region_policy_loss, signal_region_shares, source_preserving_target,
                             std_over_sqrt_dt_weights, surrogate_stats, velocity_anchor)
from flowgrpo.plans import make_plan, sample_trained_steps
from flowgrpo.policy import Through, float32_trainable, frozen_reference, swapped_attribute
from flowgrpo.prompts import (record_images, record_keep_masks, record_masks,
                              reward_metadata)
from flowgrpo.rollout import RolloutBatch, RolloutSettings, encode_rows, replay_logp, rollout
from flowgrpo.sde import anchor_std, region_log_probs
from flowgrpo.seeding import seeded_generator
from pipelines import check_model_config, load_model, model_class
from pipelines import check_model_source as check_family_source
from reward_models import (MultiReward, available_rewards, check_reward_names,
                           declared_components, load_reward)


# The key under which the rollout reports the KL of training.kl_reward (reward/<key>/mean).
KL_REWARD_KEY = "kl_to_reference"


def _replay_rows(replay, keep: Tensor):
    """The replay batch restricted to its rows ``keep`` (local indices, (b',)): every per-row
    tensor of it and of its step Gaussian indexed, the step and the constants kept."""
    def pick(value):
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == count:
            return value.index_select(0, keep.to(value.device))
        return value

    count = replay.rows.shape[0]
    gaussian = dataclasses.replace(replay.gaussian, **{
        f.name: pick(getattr(replay.gaussian, f.name))
        for f in dataclasses.fields(replay.gaussian)})
    fields = {f.name: pick(getattr(replay, f.name)) for f in dataclasses.fields(replay)
              if f.name != "gaussian"}
    return dataclasses.replace(replay, gaussian=gaussian, **fields)


def check_locality_keys(config: TrainConfig, known: dict[str, tuple[str, ...] | None] | None
                        ) -> None:
    """training.locality's edit_key and keep_key must be reward outputs ``known`` (key -> its
    components, None where known only once the reward loads; ``known`` None: not yet known).
    Called at config load and once the rewards load."""
    locality = config.training.locality
    if not locality.enabled or known is None:
        return
    check_reward_key(locality.edit_key, "training.locality.edit_key", known)
    check_reward_key(locality.keep_key, "training.locality.keep_key", known)


def load_rewards(config: TrainConfig, device: torch.device):
    """The MultiReward of the config's components on ``device`` (each rank's accelerator by
    default; a component's own ``device`` option wins, ``device: auto`` means this one)."""
    return MultiReward.from_config(
        [{"name": c.name, "weight": c.weight, **c.options} for c in config.rewards.components],
        aggregation=config.rewards.aggregation, device=device)


class FlowPolicy(FlowEvaluation):
    """GRPO on a FlowModel. ``model`` is the FlowModel, ``module`` its transformer (what trains)."""

    @staticmethod
    def check_config(config: TrainConfig) -> None:
        """At config load: the model family and its options (``pipelines``), the reward names
        (``reward_models``) and the reward keys the KL gate names, as far as the config tells."""
        check_model_config(config.model.family, config.model.options)
        known = available_rewards()
        check_reward_names(config.rewards.components, "rewards.components", known)
        check_reward_names(config.eval.rewards, "eval.rewards", known)
        check_gate_keys(config, reward_output_keys(config, declared_components))
        check_locality_keys(config, reward_output_keys(config, declared_components))
        family = config.model.family
        if (config.training.locality.keep_source_beta > 0
                and not hasattr(model_class(family), "encode_images")):
            raise ConfigError(f"training.locality.keep_source_beta needs the model's latents of "
                              f"the source images (an adapter with encode_images: toy, "
                              f"flux_kontext); the {family} adapter has none: set "
                              f"keep_source_beta to 0")

    @staticmethod
    def check_model_source(config: TrainConfig) -> None:
        check_family_source(config.model.family, config.model.path)

    def __init__(self, config: TrainConfig, accelerator: Accelerator, train_records: list[dict],
                 model=None) -> None:
        self.config = config
        self.accelerator = accelerator
        # Cheap things first: a bad reward name fails before the model loads.
        self.reward = load_rewards(config, accelerator.device)
        check_guard_keys(config, self.reward)
        check_locality_keys(config, loaded_reward_keys(self.reward))
        locality = config.training.locality
        try:
            if locality.mask == "record":
                record_masks(train_records)
            if locality.keep_region == "record":
                record_keep_masks(train_records)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        # Held-out metrics load here too, on every process (each scores its share of the
        # evaluation rows): a bad option or missing weights fail now, not at the first
        # evaluation of a resumed run.
        device = accelerator.device
        self.eval_reward = load_eval_rewards(
            config, device, lambda spec: load_reward(spec, device=device), MultiReward,
            training=self.reward)
        m = config.model
        if model is None:
            model = load_model(m.family, m.path, dtype=parse_dtype(m.dtype), device=accelerator.device,
                               options=dict(m.options))
        self.model = model
        if config.training.locality.enabled and not callable(getattr(model, "region_mask", None)):
            raise ConfigError(f"training.locality needs the model to lay an edit mask out on its "
                              f"latents (region_mask), which the {model.family} adapter does not "
                              f"implement; set training.locality.mask: off")
        self.module: nn.Module = model.transformer
        self.trainable = self._setup_trainable(model.lora_target_modules)
        self.reference_module = frozen_reference(config, self.module)
        # LoRA's reference after a refresh (training.gardo): a snapshot of the adapter weights,
        # swapped in for the reference pass; None = the adapter disabled (the base model).
        self.reference_snapshot: dict[str, Tensor] | None = None
        self.base_sigmas = rollout_sigmas(config, model)
        self.accumulation_steps = accumulation_steps(config, accelerator.num_processes)
        self.ema_updates_per_step = ema_updates_per_step(config, accelerator.num_processes)
        self.engine_module: nn.Module = self.module
        self._cond_batch = None

    def _setup_trainable(self, default_targets: list[str]) -> dict[str, nn.Parameter]:
        """What trains, through the FlowModel's training methods: the LoRA adapter (in float32),
        or the full weights."""
        m = self.config.model
        self.module.requires_grad_(False)
        if m.gradient_checkpointing:
            self.model.enable_gradient_checkpointing()
        if not m.lora.enabled:
            self.model.train_full_weights()
            return {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        self.model.add_lora(m.lora.rank, m.lora.alpha, m.lora.target_modules or default_targets,
                            m.lora.init)
        return float32_trainable(self.module)

    def bind(self, engine_module: nn.Module, sharded: bool) -> None:
        self.engine_module = engine_module
        if sharded and engine_module is not self.module:
            # Sharded parameters: sampling and evaluation must gather them through the engine too.
            self.model.transformer = Through(engine_module, self.module)

    @contextmanager
    def training_forward(self):
        """The transformer calls of a replay go through the engine (DDP's gradient hooks)."""
        if self.engine_module is self.module or isinstance(self.model.transformer, Through):
            yield
        else:
            with swapped_attribute(self.model, "transformer", Through(self.engine_module,
                                                                      self.module)):
                yield

    @contextmanager
    def own_transformer(self):
        """The adapter's own transformer in place of the engine's wrapper (``bind``), for the
        training methods that act on its modules (LoRA switches, state dicts)."""
        with swapped_attribute(self.model, "transformer", self.module):
            yield

    @contextmanager
    def reference_policy(self):
        """The KL reference: the transformer with LoRA disabled, or the frozen copy kept for full
        fine-tuning; after a refresh (``refresh_reference``) the LoRA snapshot swapped in."""
        if self.reference_module is not None:
            with swapped_attribute(self.model, "transformer", self.reference_module):
                yield
        elif self.reference_snapshot is not None:
            # The parameters' storage is swapped, not copied: the same module and code path
            # with the snapshot's values, and the live values back afterwards.
            live = {name: param.data for name, param in self.trainable.items()}
            try:
                for name, param in self.trainable.items():
                    param.data = self.reference_snapshot[name]
                yield
            finally:
                for name, param in self.trainable.items():
                    param.data = live[name]
        else:
            with self.own_transformer():
                self.model.disable_lora()
            try:
                yield
            finally:
                with self.own_transformer():
                    self.model.enable_lora()

    @torch.no_grad()
    def refresh_reference(self) -> None:
        """Make the KL reference the current policy (GARDO's reference reset): full fine-tuning
        copies the weights into the frozen copy; LoRA keeps a snapshot of the adapter."""
        if self.reference_module is not None:
            live = dict(self.module.named_parameters())
            for name, param in self.reference_module.named_parameters():
                param.copy_(live[name])
        else:
            self.reference_snapshot = {name: param.detach().clone()
                                       for name, param in self.trainable.items()}

    def reference_state(self) -> dict[str, Tensor]:
        """The reference's trainable tensors by parameter name (for a checkpoint): the frozen
        copy's values of the trainable parameters, or the LoRA snapshot ({} when none)."""
        if self.reference_module is not None:
            frozen = dict(self.reference_module.named_parameters())
            return {name: frozen[name].detach() for name in self.trainable}
        return dict(self.reference_snapshot or {})

    @torch.no_grad()
    def load_reference_state(self, tensors: dict[str, Tensor]) -> None:
        """Restore ``reference_state``'s tensors (a resume)."""
        missing = sorted(set(self.trainable) - set(tensors))
        if missing:
            raise ValueError(f"the saved KL reference lacks {len(missing)} trainable tensors "
                             f"(e.g. {missing[0]}); it was saved for another model or LoRA "
                             f"config")
        if self.reference_module is not None:
            frozen = dict(self.reference_module.named_parameters())
            for name in self.trainable:
                frozen[name].copy_(tensors[name])
        else:
            self.reference_snapshot = {
                name: tensors[name].to(device=param.device, dtype=param.dtype).clone()
                for name, param in self.trainable.items()}

    def settings(self, iteration: int) -> RolloutSettings:
        s = self.config.sampling
        bounds = (float(self.base_sigmas[1]), float(self.base_sigmas[-1]))
        return RolloutSettings(kind=s.kind, noise_level=s.noise_level,
                               guidance_scale=s.guidance_scale, batch_size=s.rollout_batch_size,
                               share_initial_noise=s.share_initial_noise, seed=self.config.run.seed,
                               iteration=iteration, log_prob=s.log_prob, schedule_bounds=bounds,
                               anchor_steps=(self.config.training.anchor_steps
                                             if self.config.training.anchor_beta > 0 else 0),
                               anchor_sigma_max=self.config.training.anchor_sigma_max)

    def time_shift(self) -> float | None:
        """The static shift of the rollout schedule when it is shift(t) of a linear t grid
        (MixGRPO-Flash's compressed grid is then uniform in t, as in its code)."""
        s = self.config.sampling
        return s.sigma_shift if s.sigma_schedule == "shifted_linear" else None

    def kl_std(self, replay) -> Tensor:
        """The std the KL divides by (``training.kl_convention``, see ``losses.flow_kl``)."""
        if self.config.training.kl_convention == "flow_grpo":
            return anchor_std(self.config.sampling.kind, replay.std, replay.sigmas,
                              replay.sigmas_next)
        return replay.std

    # ------------------------------------------------------------------ rollout
    def rollout(self, records: list[dict], group_ids: Tensor, sample_ids: Tensor, iteration: int
                ) -> tuple[RolloutBatch, dict[str, Tensor], dict[str, float]]:
        """Roll out the rows along their groups' plans; with ``rewards.threaded`` each rollout
        batch is scored in a thread while the next one samples."""
        prompts = [r["prompt"] for r in records]
        metadata = [r["metadata"] for r in records]
        images = record_images(records)
        scored_metadata = reward_metadata(records)   # + "source_image" for editing rewards
        plan_config, seed = self.config.sampling.plan, self.config.run.seed
        plans = {int(g): make_plan(plan_config, self.base_sigmas, iteration, int(g), seed,
                                   time_shift=self.time_shift()) for g in group_ids.unique()}
        sample_trained = None
        if plan_config.kind == "full" and plan_config.train_select == "random_per_sample":
            sample_trained = {int(sid): sample_trained_steps(plan_config, plans[int(g)], iteration,
                                                             int(sid), seed)
                              for sid, g in zip(sample_ids.tolist(), group_ids.tolist())}
        futures: list[tuple[Tensor, Future]] = []
        reward_seconds: list[float] = []
        executor = ThreadPoolExecutor(max_workers=1) if self.config.rewards.threaded else None

        def score(rows: Tensor, media: Tensor) -> dict[str, Tensor]:
            began = time.perf_counter()
            picked = rows.tolist()    # iterating the tensor would make a 0-d tensor per row
            out = self.reward(media, [prompts[i] for i in picked],
                              [scored_metadata[i] for i in picked])
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
                            self.settings(iteration), on_media=on_media, images=images,
                            sample_trained=sample_trained)
        rollout_seconds = time.perf_counter() - began
        began = time.perf_counter()
        rewards: dict[str, Tensor] = {}
        try:
            for rows, future in futures:
                for name, values in future.result().items():
                    if name not in rewards:
                        rewards[name] = torch.full((len(prompts),), float("nan"))
                    rewards[name][rows] = values.float().cpu()
        finally:
            if executor is not None:
                executor.shutdown()
        timing = {"time/rollout": rollout_seconds, "time/reward_wait": time.perf_counter() - began,
                  "time/reward_compute": sum(reward_seconds)}
        if self.config.training.locality.enabled:
            batch.region_masks = self.region_masks(records, batch)
            if self.config.training.locality.keep_region == "record":
                batch.keep_masks = self.keep_masks(records)
        if self.config.training.kl_reward > 0:
            began = time.perf_counter()
            kl = self.rollout_kl(batch, iteration)
            rewards["total"] = rewards["total"] - self.config.training.kl_reward * kl
            rewards[KL_REWARD_KEY] = kl
            timing["time/kl_reward"] = time.perf_counter() - began
        return batch, rewards, timing

    @torch.no_grad()
    def region_masks(self, records: list[dict], batch: RolloutBatch) -> Tensor:
        """(B, ...) edit-region weights on the latents' layout (``training.locality``): the
        records' masks, or per sample the pixels where it differs from its source image,
        laid out by the model (``region_mask``) on the latents' device."""
        locality = self.config.training.locality
        if locality.mask == "record":
            pixels = stack_masks(record_masks(records))
        else:
            if batch.images is None:
                raise ValueError("training.locality.mask: difference compares each sample with "
                                 "its source image, and these prompt records have none; train "
                                 "on editing records (\"image\")")
            pixels = torch.cat([difference_mask(batch.media[i:i + 1], image[None],
                                                locality.difference_threshold)
                                for i, image in enumerate(batch.images)])
        return self.model.region_mask(pixels, locality.resize).to(self.model.device,
                                                                  torch.float32)

    @torch.no_grad()
    def keep_masks(self, records: list[dict]) -> Tensor:
        """(B, ...) preservation-region weights on the latents' layout
        (``training.locality.keep_region: record``): the records' ``"keep_mask"``."""
        pixels = stack_masks(record_keep_masks(records))
        return self.model.region_mask(pixels, self.config.training.locality.resize).to(
            self.model.device, torch.float32)

    @torch.no_grad()
    def rollout_kl(self, batch: RolloutBatch, iteration: int) -> Tensor:
        """(B,) KL of each sample's trained steps to the reference (``flow_kl`` under
        ``training.kl_convention``), averaged over its steps: Flow-GRPO's KL reward. Flow-GRPO
        subtracts each step's KL from that step's reward (per-step advantages); advantages here
        are per sample, so the sample's mean over its trained steps is subtracted instead. Rows
        without a trained step get 0."""
        total = torch.zeros(len(batch.prompts))
        count = torch.zeros(len(batch.prompts))
        settings = self.settings(iteration)
        with self.accelerator.autocast(), self.reference_policy():
            for replay in batch.replay:
                cond = self.replay_condition(batch, replay)
                _, mean_ref = replay_logp(self.model, replay, cond, settings)
                kl = flow_kl(replay.mean_old, mean_ref, self.kl_std(replay)).float().cpu()
                rows = replay.rows.cpu()
                total.index_add_(0, rows, kl)
                count.index_add_(0, rows, torch.ones_like(kl))
        return total / count.clamp(min=1)

    # ------------------------------------------------------------------ loss
    def step_weights(self, replays: list) -> list[Tensor]:
        """Per-row loss weights of each replay batch: GRPO-Guard's 1/dt and/or Flash-GRPO's kappa,
        normalised by their mean over the iteration's trained transitions on every process (a
        replay batch holds a single step, so normalising within it would make every weight 1;
        a per-process mean would weigh the same step differently on different processes), times
        the per-batch factors the anchors do not normalise (``training.dt_reweight_norm:
        batch_mean``, ``training.loss_scale``). Called on every process (the mean is
        gathered)."""
        t = self.config.training
        normalised = (t.dt_reweight and t.dt_reweight_norm == "iteration") or t.rectification
        raw, absolute = [], []
        for replay in replays:
            weights = torch.ones_like(replay.logp_old)
            if t.dt_reweight and t.dt_reweight_norm == "iteration":
                weights = weights * guard_step_weights(replay.sigmas, replay.sigmas_next,
                                                       normalize=False)
            if t.rectification:
                weights = weights * rectification_weights(replay.sigmas, replay.sigmas_next,
                                                          replay.std, normalize=False)
            raw.append(weights)
            # Factors the anchors apply per batch, not normalised over the iteration.
            factor = None
            if t.dt_reweight and t.dt_reweight_norm == "batch_mean":
                factor = batch_mean_dt_weights(replay.sigmas, replay.sigmas_next)
            if t.loss_scale == "std_over_sqrt_dt":
                scale = std_over_sqrt_dt_weights(
                    anchor_std(self.config.sampling.kind, replay.std, replay.sigmas,
                               replay.sigmas_next), replay.sigmas, replay.sigmas_next)
                factor = scale if factor is None else factor * scale
            absolute.append(factor)
        if normalised:
            acc = self.accelerator
            local = torch.cat(raw) if raw else torch.zeros(0)
            totals = torch.tensor([float(local.double().sum()), float(local.numel())],
                                  dtype=torch.float64)
            if acc.num_processes > 1:
                totals = acc.gather(totals.to(acc.device).unsqueeze(0)).sum(dim=0).cpu()
            if totals[1] > 0:
                mean = (totals[0] / totals[1]).to(local.dtype)
                raw = [w / mean.to(w.device) for w in raw]
        raw = [w if f is None else w * f.to(w.dtype) for w, f in zip(raw, absolute)]
        if raw and (normalised or any(f is not None for f in absolute)):
            check_weights(torch.cat(raw))   # once here, so the loss skips it per replay batch
        return raw

    def replay_condition(self, batch: RolloutBatch, replay):
        """Prompt embeddings of a replay batch's rows; the batch's distinct rows (prompt, and
        source image when editing: ``encode_rows``) are encoded once per update and rows are
        picked from them. The rollout hands every step of a chunk the
        same ``rows`` tensor, so a selection is made once per chunk and reused for its steps."""
        if self._cond_batch is not batch:
            cond, self._cond_index = encode_rows(self.model, batch.prompts, batch.images)
            self._cond_unique = cond.to(self.model.device)
            self._cond_batch = batch
            self._cond_by_rows = {}
        # Keyed by the tensor's id: the batch keeps every rows tensor alive, so an id cannot be
        # reused while this cache (reset with the batch) is in use.
        key = id(replay.rows)
        if key not in self._cond_by_rows:
            self._cond_by_rows[key] = self._cond_unique.select(self._cond_index[replay.rows])
        return self._cond_by_rows[key]

    def replay_loss(self, batch: RolloutBatch, replay, advantages: Tensor, iteration: int,
                    clip_high: float, weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one replay batch: surrogate (+ Guard / rectification weights) + KL.
        Returns the loss and a record of detached tensors for ``update_metrics``: per row
        ``log_ratio`` (the one the loss used), ``advantages`` and ``weights``; 0-d
        ``ratio_max_dev`` (max |exp(logp - logp_old) - 1|, exactly 0 on the first pass),
        ``policy_loss`` (and ``kl``)."""
        cond = self.replay_condition(batch, replay)
        t = self.config.training
        settings = self.settings(iteration)
        with self.training_forward():
            logp, mean = replay_logp(self.model, replay, cond, settings)
        adv = advantages[replay.rows]
        adv = adv if adv.device == logp.device else adv.to(logp.device)
        if t.locality.enabled:
            loss, record = self._region_loss(batch, replay, mean, adv, clip_high, weights)
        else:
            raw_log_ratio = logp.detach() - replay.logp_old
            log_ratio = guard_log_ratio(logp, replay.logp_old, mean, replay.mean_old,
                                        replay.std) if t.ratio_norm else None
            loss = policy_loss(logp, replay.logp_old, adv, t.clip_low, clip_high, weights=weights,
                               log_ratio=log_ratio)
            record = {"log_ratio": raw_log_ratio if log_ratio is None else log_ratio.detach(),
                      "advantages": adv, "weights": weights,
                      "ratio_max_dev": torch.expm1(raw_log_ratio).abs().max(),
                      "policy_loss": loss.detach()}
        gate = batch.kl_weights
        mean_ref = None
        if t.kl_beta > 0 and gate is None:
            mean_ref = self.reference_mean(replay, cond, settings)
            kl = flow_kl(mean, mean_ref, self.kl_std(replay)).mean()
            loss = loss + t.kl_beta * kl
            record["kl"] = kl.detach()
        elif t.kl_beta > 0:
            loss = self._gated_kl_loss(loss, record, replay, cond, settings, mean,
                                       gate[replay.rows.to(gate.device)])
        if t.locality.keep_kl_beta > 0:
            if mean_ref is None:
                mean_ref = self.reference_mean(replay, cond, settings)
            keep_region = self.preservation_weights(batch, replay, mean.device)
            row_kl = region_flow_kl(mean, mean_ref, self.kl_std(replay), keep_region)
            # The mean over the rows that have something to keep (a one-object toy edit has
            # not), so beta's strength does not depend on the batch's mix of edits.
            has_region = keep_region.flatten(1).sum(dim=1) > 0
            keep_kl = gated_kl(row_kl, has_region.to(row_kl.dtype))
            loss = loss + t.locality.keep_kl_beta * keep_kl
            record["keep_kl"] = keep_kl.detach()
        if t.locality.keep_source_beta > 0:
            keep_source = self.keep_source_loss(batch, replay, cond, settings, iteration)
            if keep_source is not None:
                loss = loss + t.locality.keep_source_beta * keep_source
                record["keep_source"] = keep_source.detach()
        if t.anchor_beta > 0 and replay.anchors:
            anchor = self.anchor_penalty(batch, replay.anchors, settings)
            loss = loss + t.anchor_beta * anchor
            record["anchor"] = anchor.detach()
        return loss, record

    def reference_mean(self, replay, cond, settings: RolloutSettings) -> Tensor:
        """(B, ...) the replay's transition means under the reference policy (no gradient)."""
        with torch.no_grad(), self.reference_policy():
            _, mean_ref = replay_logp(self.model, replay, cond, settings)
        return mean_ref

    def preservation_weights(self, batch: RolloutBatch, replay, device: torch.device) -> Tensor:
        """The replay rows' preservation-region weights on ``device``, broadcastable to the
        latents: where the preservation advantage acts (``training.locality.keep_region``), the
        records' keep masks outside the edit region, or the whole rest: the weights
        ``sde.region_log_probs`` gives its second part."""
        masks = batch.region_masks
        edit = masks.index_select(0, replay.rows.to(masks.device)).to(device)
        keep = batch.keep_masks
        if keep is None:
            return 1.0 - edit
        return keep.index_select(0, replay.rows.to(keep.device)).to(device) * (1.0 - edit)

    def keep_source_loss(self, batch: RolloutBatch, replay, cond, settings: RolloutSettings,
                         iteration: int) -> Tensor | None:
        """``training.locality.keep_source_beta``'s term for a replay batch, a scalar, or None
        when no row has a preservation region (a one-object toy edit): the mean over those rows
        of ``losses.region_flow_matching`` at the step's sigmas, on x_sigma = (1 - sigma) target
        + sigma noise, target = the row's sample with its preservation region replaced by the
        source (``losses.source_preserving_target``), fresh noise drawn per (seed, iteration,
        step, first row). Gradient flows through the policy's velocity only."""
        device = self.model.device
        region = self.preservation_weights(batch, replay, device)
        has_region = (region.flatten(1).sum(dim=1) > 0).nonzero().flatten()
        if has_region.numel() == 0:
            return None
        rows = replay.rows.to(device).index_select(0, has_region)
        region = region.index_select(0, has_region)
        images = [batch.images[i] for i in rows.tolist()]
        sample = [batch.media[i] for i in rows.tolist()]
        with torch.no_grad():
            target = source_preserving_target(self.model.encode_images(sample).float(),
                                              self.model.encode_images(images).float(), region)
        generator = seeded_generator(settings.seed, iteration, "keep_source", replay.step,
                                     int(replay.rows[0]))
        noise = torch.randn(target.shape, generator=generator).to(device)
        sigmas = replay.sigmas.to(device).index_select(0, has_region).float()
        s = sigmas.view(-1, *([1] * (target.dim() - 1)))
        latents = ((1.0 - s) * target + s * noise).to(self.model.dtype)
        with self.training_forward():
            velocity = self.model.velocity(latents, sigmas, cond.select(has_region),
                                           settings.guidance_scale)
        return region_flow_matching(velocity, noise, target, region).mean()

    def _region_loss(self, batch: RolloutBatch, replay, mean: Tensor, adv: Tensor,
                     clip_high: float, weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``training.locality``'s surrogate of a replay batch: the step's log-density split by
        the rows' edit-region masks (``sde.region_log_probs``), the edit advantage (adv[:, 0])
        on the region, the preservation advantage (adv[:, 1]) on the rest
        (``losses.region_policy_loss``). The record holds each (row, region) as a row, weighted
        by the region's share."""
        t = self.config.training
        masks = batch.region_masks
        mask = masks.index_select(0, replay.rows.to(masks.device)).to(mean.device)
        keep = batch.keep_masks
        if keep is not None:
            keep = keep.index_select(0, replay.rows.to(keep.device)).to(mean.device)
        next_latents = replay.next_latents.to(mean.device)
        logp, shares = region_log_probs(next_latents - mean, replay.gaussian, mask, keep)
        if t.locality.edit_weight is not None:
            shares = fixed_region_shares(shares, t.locality.edit_weight)
        if t.locality.silent_share == "reassign":
            shares = signal_region_shares(shares, adv)
        with torch.no_grad():
            logp_old, _ = region_log_probs(next_latents - replay.mean_old.to(mean.device),
                                           replay.gaussian, mask, keep)
        loss = region_policy_loss(logp, logp_old, adv, shares, t.clip_low, clip_high,
                                  weights=weights)
        log_ratio = logp.detach() - logp_old
        part_weights = shares * weights.to(shares)[:, None]
        record = {"log_ratio": log_ratio.flatten(), "advantages": adv.flatten(),
                  "weights": part_weights.flatten(),
                  "ratio_max_dev": torch.expm1(log_ratio).abs().max(),
                  "policy_loss": loss.detach()}
        return loss, record

    def anchor_penalty(self, batch: RolloutBatch, anchors: list, settings: RolloutSettings
                       ) -> Tensor:
        """Mean over the anchored states of ``losses.velocity_anchor``: the policy's velocity
        (with grad, through the engine) against the reference's at each untrained-step state a
        chunk kept (training.anchor_beta)."""
        penalties = []
        for anchor in anchors:
            cond = self.replay_condition(batch, anchor)
            latents = anchor.latents.to(self.model.dtype)
            with self.training_forward():
                velocity = self.model.velocity(latents, anchor.sigmas, cond,
                                               settings.guidance_scale)
            with torch.no_grad(), self.reference_policy():
                velocity_ref = self.model.velocity(latents, anchor.sigmas, cond,
                                                   settings.guidance_scale)
            penalties.append(velocity_anchor(velocity, velocity_ref).mean())
        return torch.stack(penalties).mean()

    def _gated_kl_loss(self, loss: Tensor, record: dict, replay, cond, settings, mean: Tensor,
                       gate: Tensor) -> Tensor:
        """loss + beta * ``gated_kl`` over the replay's gated rows (training.gardo). The
        reference forward runs on the gated rows only, none when no row is gated; records
        ``kl`` (mean over the gated rows) and ``kl_rows`` for the update's statistics."""
        keep = (gate > 0).nonzero().flatten()
        if keep.numel() == 0:
            return loss
        if keep.numel() < gate.numel():
            replay, cond = _replay_rows(replay, keep), cond.select(keep)
            mean = mean.index_select(0, keep.to(mean.device))
            gate = gate.index_select(0, keep)
        mean_ref = self.reference_mean(replay, cond, settings)
        kl = gated_kl(flow_kl(mean, mean_ref, self.kl_std(replay)), gate)
        record["kl"] = kl.detach()
        record["kl_rows"] = torch.tensor(float(keep.numel()), device=kl.device)
        return loss + self.config.training.kl_beta * kl

    def update_metrics(self, rows: dict[str, Tensor], clip_high: float) -> dict[str, Tensor]:
        """``surrogate_stats`` over every trained row, and the mean policy loss (and KL)."""
        if not rows:
            return {}
        stats = surrogate_stats(rows["log_ratio"], rows["advantages"],
                                self.config.training.clip_low, clip_high, rows["weights"])
        stats["policy_loss"] = rows["policy_loss"].float().mean()
        if "kl_rows" in rows:   # gated KL: the mean over every gated row of the update
            counts = rows["kl_rows"].float()
            stats["kl"] = (rows["kl"].float() * counts).sum() / counts.sum().clamp(min=1)
        elif "kl" in rows:
            stats["kl"] = rows["kl"].float().mean()
        if "anchor" in rows:
            stats["anchor"] = rows["anchor"].float().mean()
        if "keep_kl" in rows:
            stats["keep_kl"] = rows["keep_kl"].float().mean()
        if "keep_source" in rows:
            stats["keep_source"] = rows["keep_source"].float().mean()
        return stats

    # ------------------------------------------------------------------ weights
    def save_weights(self, folder: str, state_dict: dict[str, Tensor] | None = None) -> None:
        """LoRA in the diffusers format (``pipe.load_lora_weights(folder)``), or the full
        transformer under ``folder/transformer`` (``from_pretrained``-loadable)."""
        with self.own_transformer():
            if self.config.model.lora.enabled:
                self.model.save_lora_weights(folder, self.model.lora_state_dict(state_dict))
            else:
                self.model.save_full_weights(folder, state_dict)

