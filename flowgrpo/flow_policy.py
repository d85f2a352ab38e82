"""The flow-matching policy: a FlowModel (any family of ``pipelines``) as an MDP over denoising steps.

Rollouts follow each group's StepPlan (``plans.py``) with SDE/ODE transitions (``sde.py``); GRPO
keeps every trained transformer call as a replay batch (``rollout.py``), the sample-based
algorithms keep each row's final sample. What the update trains on and its loss are the
algorithm's (``training.algorithm``, ``flowgrpo/algorithms/``): this class loads the model, rolls
out and scores, and gives the algorithms the model's forwards through the engine, the reference
policy and the prompt conditions.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from flowgrpo.algorithms import algorithm_class
from flowgrpo.config import TrainConfig, check_reward_key, reward_output_keys
from flowgrpo.dtypes import parse_dtype
from flowgrpo.edit_regions import difference_mask, stack_masks
from flowgrpo.embedding_perturbation import DEFAULT_TEXT_EMBEDDING_KEYS, EmbeddingPerturbation
from flowgrpo.errors import ConfigError
from flowgrpo.flow_batches import accumulation_steps, ema_updates_per_step, rollout_sigmas
from flowgrpo.flow_evaluation import FlowEvaluation
from flowgrpo.guards import check_gate_keys, check_guard_keys, loaded_reward_keys
from flowgrpo.guided_sde import check_guidance_reward, load_guidance
from flowgrpo.heldout import load_eval_rewards
from flowgrpo.losses import flow_kl
from flowgrpo.model import cfg_gradient
from flowgrpo.plans import make_plan, sample_trained_steps
from flowgrpo.policy import Through, float32_trainable, frozen_reference, swapped_attribute
from flowgrpo.preference_pairs import check_pairs_config
from flowgrpo.prompts import (record_images, record_keep_masks, record_masks,
                              reward_metadata)
from flowgrpo.rollout import RolloutBatch, RolloutSettings, encode_rows, replay_logp, rollout
from flowgrpo.sde import anchor_std
from flowgrpo.step_values import check_step_value_reward, score_step_values
from flowgrpo.trainer_advantages import PER_STEP_ESTIMATORS, advantage_estimator
from pipelines import check_model_config, load_model, model_class
from pipelines import check_model_source as check_family_source
from reward_models import (MultiReward, available_rewards, check_reward_names,
                           declared_components, load_reward)
from reward_models.group import check_group_rewards, check_whole_groups
from reward_models.loading import resolve_reward_class


# The key under which the rollout reports the KL of training.kl_reward (reward/<key>/mean).
KL_REWARD_KEY = "kl_to_reference"


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
        check_group_rewards(config, known)
        check_gate_keys(config, reward_output_keys(config, declared_components))
        check_locality_keys(config, reward_output_keys(config, declared_components))
        check_guidance_reward(config, resolve_reward_class)
        family = config.model.family
        adapter = model_class(family)
        # an editing family that encodes its sources onto its output latents (the toy's
        # supports_images is a per-build property: its editing build is checked when it loads)
        encodes_sources = hasattr(adapter, "encode_images") and \
            getattr(adapter, "supports_images", False) is not False
        if config.training.locality.keep_source_beta > 0 and not encodes_sources:
            raise ConfigError(f"training.locality.keep_source_beta needs the model's latents of "
                              f"the source images (an adapter with encode_images: toy, "
                              f"flux_kontext); the {family} adapter has none: set "
                              f"keep_source_beta to 0")
        # training.dpo.pairs_file: VAE-encoded by the family (a class-level supports_images is
        # an editing family; the toy's is per build, checked when the model loads)
        check_pairs_config(config, hasattr(model_class(family), "encode_images"),
                           getattr(model_class(family), "supports_images", False) is True)

    @staticmethod
    def check_model_source(config: TrainConfig) -> None:
        check_family_source(config.model.family, config.model.path)

    def __init__(self, config: TrainConfig, accelerator: Accelerator, train_records: list[dict],
                 model=None) -> None:
        self.config = config
        self.accelerator = accelerator
        # Cheap things first: a bad reward name fails before the model loads.
        self.reward = load_rewards(config, accelerator.device)
        t = config.training
        check_whole_groups(self.reward, t.prompts_per_iteration * t.group_size
                           // accelerator.num_processes, t.group_size, accelerator.num_processes)
        check_guard_keys(config, self.reward)
        check_locality_keys(config, loaded_reward_keys(self.reward))
        check_step_value_reward(config, self.reward)
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
        # sampling.reward_guidance (Euphonium): its differentiable reward, loaded once
        self.guidance = load_guidance(config, model, accelerator.device, load_reward)
        self.trainable = self._setup_trainable(model.lora_target_modules)
        self.reference_module = frozen_reference(config, self.module)
        # LoRA's reference after a refresh (training.gardo): a snapshot of the adapter weights,
        # swapped in for the reference pass; None = the adapter disabled (the base model).
        self.reference_snapshot: dict[str, Tensor] | None = None
        self.base_sigmas = rollout_sigmas(config, model)
        self.algorithm = algorithm_class(config.training.algorithm)(self)
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
        self.algorithm.check_engine(sharded)
        self.engine_module = engine_module
        if sharded and engine_module is not self.module:
            # Sharded parameters: sampling and evaluation must gather them through the engine too.
            self.model.transformer = Through(engine_module, self.module)
        if sharded:
            # FSDP2 shards the module in place and registers new (DTensor) parameters under the
            # same names: the ones collected before wrapping are no longer the module's.
            current = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
            if current.keys() == self.trainable.keys():
                self.trainable = current

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
                               anchor_sigma_max=self.config.training.anchor_sigma_max,
                               cfg_gradient=self.config.training.cfg_gradient)

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
        # Every group's plan, this process's or not: the rank of each plan by its first group
        # is the order one process would roll the iteration's chunks out in (ReplayBatch.bucket).
        buckets: dict[tuple, int] = {}
        for g in range(self.config.training.prompts_per_iteration):
            plan = plans.get(g) or make_plan(plan_config, self.base_sigmas, iteration, g, seed,
                                             time_shift=self.time_shift())
            buckets.setdefault(plan.key(), g)
        transitions = self.algorithm.keeps_transitions
        if not transitions:   # SDE steps still add noise; none is kept for training
            plans = {g: dataclasses.replace(p, trained=()) for g, p in plans.items()}
        sample_trained = None
        if transitions and plan_config.kind == "full" and \
                plan_config.train_select == "random_per_sample":
            sample_trained = {int(sid): sample_trained_steps(plan_config, plans[int(g)], iteration,
                                                             int(sid), seed)
                              for sid, g in zip(sample_ids.tolist(), group_ids.tolist())}
        futures: list[tuple[Tensor, Future]] = []
        reward_seconds: list[float] = []
        executor = ThreadPoolExecutor(max_workers=1) if self.config.rewards.threaded else None
        # A groupwise reward compares the members of a group, which the rollout's chunks may
        # split: it scores the whole local batch (whole groups, check_whole_groups) at the end.
        groupwise = getattr(self.reward, "groupwise", False)

        def score(rows: Tensor, media: Tensor) -> dict[str, Tensor]:
            began = time.perf_counter()
            picked = rows.tolist()    # iterating the tensor would make a 0-d tensor per row
            groups = {"group_ids": group_ids[rows]} if groupwise else {}
            out = self.reward(media, [prompts[i] for i in picked],
                              [scored_metadata[i] for i in picked], **groups)
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
        settings = self.settings(iteration)
        settings.keep_final_latents = not transitions
        step_values = self.config.training.advantage == "vgpo"
        settings.keep_x0_predictions = step_values
        perturbation = self.config.sampling.embedding_perturbation
        if perturbation.enabled:   # E2PO's exploration; the update re-encodes the originals
            settings.embedding_perturbation = EmbeddingPerturbation(
                perturbation, getattr(self.model, "text_embedding_keys",
                                      DEFAULT_TEXT_EMBEDDING_KEYS),
                self.config.training.group_size, self.config.run.seed, iteration)
        if self.guidance is not None:
            settings.guidance = self.guidance.for_rows(prompts, scored_metadata)
        with torch.no_grad(), self.accelerator.autocast(), \
                self.algorithm.sampling_weights(iteration):
            batch = rollout(self.model, prompts, metadata, group_ids, sample_ids, plans,
                            settings, on_media=None if groupwise else on_media, images=images,
                            sample_trained=sample_trained)
        rollout_seconds = time.perf_counter() - began
        if groupwise:
            on_media(torch.arange(len(prompts)), batch.media)
        for replay in batch.replay:
            replay.bucket = buckets[plans[int(group_ids[replay.rows[0]])].key()] \
                if transitions else 0
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
        if step_values:   # VGPO: the rewards of the trained states' one-step predictions
            with torch.no_grad(), self.accelerator.autocast():
                batch.step_values, batch.trained_steps, cost = score_step_values(
                    self.model, self.reward, batch.replay, prompts, scored_metadata,
                    len(self.base_sigmas) - 1)
            for replay in batch.replay:   # scored: the update does not read them
                replay.x0_pred = None
            timing.update(cost)
        if not transitions:
            batch.replay = self.algorithm.replays(batch, iteration, rewards)
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
        """Per-row loss weights of each replay unit (the algorithm's ``step_weights``; called on
        every process once per update)."""
        return self.algorithm.step_weights(replays)

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
        """The loss of one replay unit: the algorithm's (``flowgrpo/algorithms/``). Every
        forward of it (the policy's, the reference's, an old policy's) runs CFG's branches as
        ``training.cfg_gradient`` says, so that forwards of equal weights give equal velocities."""
        if advantage_estimator(self.config) in PER_STEP_ESTIMATORS:
            # (B, N) advantages, a column a schedule step (VGPO's steps, a tree's edges)
            advantages = advantages[:, replay.step]
        with cfg_gradient(self.config.training.cfg_gradient):
            return self.algorithm.loss(batch, replay, advantages, iteration, clip_high, weights)

    def reference_mean(self, replay, cond, settings: RolloutSettings) -> Tensor:
        """(B, ...) the replay's transition means under the reference policy (no gradient)."""
        with torch.no_grad(), self.reference_policy():
            _, mean_ref = replay_logp(self.model, replay, cond, settings)
        return mean_ref

    def update_metrics(self, rows: dict[str, Tensor], clip_high: float) -> dict[str, Tensor]:
        """The update's statistics (the algorithm's ``update_metrics``)."""
        return self.algorithm.update_metrics(rows, clip_high)

    def after_optimizer_step(self) -> None:
        """After an optimiser step that changed the weights (the old policies of nft / dgpo)."""
        self.algorithm.after_optimizer_step()

    def after_update(self) -> dict[str, float]:
        """After an iteration's update; returns the algorithm's metrics."""
        return self.algorithm.after_update()

    def algorithm_state(self) -> tuple[dict, dict[str, Tensor]]:
        return self.algorithm.state_dict()

    def load_algorithm_state(self, state: dict, tensors: dict[str, Tensor]) -> None:
        self.algorithm.load_state_dict(state, tensors)

    # ------------------------------------------------------------------ weights
    def save_weights(self, folder: str, state_dict: dict[str, Tensor] | None = None) -> None:
        """LoRA in the diffusers format (``pipe.load_lora_weights(folder)``), or the full
        transformer under ``folder/transformer`` (``from_pretrained``-loadable)."""
        with self.own_transformer():
            if self.config.model.lora.enabled:
                self.model.save_lora_weights(folder, self.model.lora_state_dict(state_dict))
            else:
                self.model.save_full_weights(folder, state_dict)

