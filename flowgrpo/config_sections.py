"""The sections of the run configuration (``model``, ``prompts``, ``sampling``, ``training``,
``rewards``, ``llm``, ``eval``, ``run``): typed fields with their help texts (``flowgrpo train
--help-config``) and each section's own rules (``validate``), which name the field and the fix.

A rule that reads one section lives in that section's ``validate``; a rule that relates two
sections (or the policy, or the process count) is a cross-section rule of
``flowgrpo.config.validate``; a name that a registry owns (model families, adapter options,
reward names) is checked by that registry, from the policy (``Policy.check_config``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowgrpo.advantages import REWARD_AGGREGATIONS, SCALES
from flowgrpo.checks import Section, choice, config_field, in_range, is_number, positive
from flowgrpo.config_algorithms import (ALGORITHM_NAMES, TIMESTEP_SAMPLINGS, AWMConfig,
                                        DGPOConfig, DPOConfig, GDROConfig, NFTConfig,
                                        TimestepsConfig)
from flowgrpo.dtypes import DTYPE_NAMES
from flowgrpo.edit_regions import REGION_RESIZES
from flowgrpo.embedding_perturbation import EMBEDDING_SCHEDULES, EmbeddingPerturbationConfig
from flowgrpo.ema import EMA_WARMUPS
from flowgrpo.errors import ConfigError
from flowgrpo.interrupts import STOP_SIGNALS
from flowgrpo.matching_losses import AWM_WEIGHTINGS, GDRO_LOSSES
from flowgrpo.model import CFG_GRADIENTS
from flowgrpo.losses import KL_CONVENTIONS
from flowgrpo.token_losses import TOKEN_AGGREGATIONS, TOKEN_LEVELS
from flowgrpo.guided_sde import GUIDANCE_FORMS, LOG_PROB_MEANS, RewardGuidanceConfig
from flowgrpo.plans import (ONE_STEP_SELECTS, PLAN_KINDS, TRAIN_SELECTS, TREE_BACKUPS,
                            WINDOW_ENDS, WINDOW_STRATEGIES, PlanConfig)
from flowgrpo.prompts import PROMPT_SUFFIXES
from flowgrpo.sde import KINDS, LOG_PROBS, ODE_SOLVERS
from flowgrpo.step_values import ADVANTAGES, VGPOConfig

LR_DECAYS = ("constant", "linear", "cosine")
SIGMA_SCHEDULES = ("model", "shifted_linear")
# "ode" is the deterministic evaluation step: it has no log-probability to train on.
SAMPLING_KINDS = tuple(k for k in KINDS if k != "ode")
LORA_INITS = ("gaussian", "default")
DT_REWEIGHT_NORMS = ("iteration", "batch_mean")
LOSS_SCALES = ("none", "std_over_sqrt_dt", "noise_aware")
MIXED_PRECISIONS = ("no", "fp16", "bf16")
LOCALITY_MASKS = ("off", "record", "difference")
SILENT_SHARES = ("keep", "reassign")
KEEP_REGIONS = ("rest", "record")
TRACKERS = ("tensorboard", "wandb", "none")
SELECT_BEST_MODES = ("max", "min", "auto")
CONSTANT_REWARD_ACTIONS = ("warn", "stop", "ignore")
# The values of the choice fields, by dotted name: what ``validate`` accepts and what
# ``flowgrpo train --help-config`` lists (one table; the names registries own are added by the
# command line, ``flowgrpo.cli.config_help``).
FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": DTYPE_NAMES, "model.lora.init": LORA_INITS,
    "sampling.kind": SAMPLING_KINDS, "sampling.log_prob": LOG_PROBS,
    "sampling.sigma_schedule": SIGMA_SCHEDULES, "sampling.plan.kind": PLAN_KINDS,
    "sampling.plan.train_select": TRAIN_SELECTS,
    "sampling.plan.window_strategy": WINDOW_STRATEGIES, "sampling.plan.window_end": WINDOW_ENDS,
    "sampling.plan.solver_after": ODE_SOLVERS,
    "sampling.plan.one_step_select": ONE_STEP_SELECTS,
    "sampling.plan.tree_backup": TREE_BACKUPS,
    "sampling.reward_guidance.form": GUIDANCE_FORMS,
    "sampling.reward_guidance.log_prob_mean": LOG_PROB_MEANS,
    "sampling.embedding_perturbation.schedule": EMBEDDING_SCHEDULES,
    "training.algorithm": ALGORITHM_NAMES, "training.timesteps.sampling": TIMESTEP_SAMPLINGS,
    "training.awm.weighting": AWM_WEIGHTINGS, "training.dgpo.reference": ("base", "old"),
    "training.gdro.loss": GDRO_LOSSES,
    "training.lr_decay": LR_DECAYS, "training.kl_convention": tuple(KL_CONVENTIONS),
    "training.adv_scale": tuple(SCALES), "training.dt_reweight_norm": DT_REWEIGHT_NORMS,
    "training.loss_scale": LOSS_SCALES, "training.mixed_precision": MIXED_PRECISIONS,
    "training.cfg_gradient": CFG_GRADIENTS, "training.advantage": ADVANTAGES,
    "training.ema.warmup": EMA_WARMUPS, "training.locality.mask": LOCALITY_MASKS,
    "training.locality.resize": REGION_RESIZES,
    "training.locality.silent_share": SILENT_SHARES,
    "training.locality.keep_region": KEEP_REGIONS, "rewards.aggregation": REWARD_AGGREGATIONS,
    "llm.aggregation": tuple(TOKEN_AGGREGATIONS), "llm.level": tuple(TOKEN_LEVELS),
    "run.tracker": TRACKERS, "run.select_best_mode": SELECT_BEST_MODES,
}




@dataclass
class LoraConfig(Section):
    enabled: bool = config_field(
        "Train LoRA adapters (True) or the full transformer (False).", default=True)
    rank: int = config_field("LoRA rank r. Flow-GRPO SD3: 32; FLUX.1: 64.", default=32)
    alpha: int = config_field("LoRA alpha (scale alpha/r). Flow-GRPO: 2*rank.", default=64)
    init: str = config_field(
        "LoRA init: 'gaussian' (Flow-GRPO) or 'default' (PEFT's Kaiming A, zero B).",
        default="gaussian")
    target_modules: list[str] | None = config_field(
        "PEFT target module names; None = the model family's default list.", default=None)

    def validate(self) -> None:
        """Checked only when LoRA trains (``enabled``)."""
        if not self.enabled:
            return
        positive(self.rank, "model.lora.rank")
        positive(self.alpha, "model.lora.alpha")
        choice(self.init, LORA_INITS, "model.lora.init")
        if self.target_modules is not None and not self.target_modules:
            raise ConfigError("model.lora.target_modules is an empty list: give module names, or "
                              "null for the model family's default list")


@dataclass
class ModelConfig(Section):
    family: str = config_field(
        "Model family: an adapter of pipelines/ (pipelines.MODEL_FAMILIES).",
        default="toy")
    path: str = config_field(
        "Hub id or local folder passed to from_pretrained.", default="assets/toy")
    dtype: str = config_field(
        "Weights dtype of frozen components: float32 | bfloat16 | float16.",
        default="float32")
    options: dict[str, Any] = config_field(
        "Family options (height, width, num_frames, text_encoder_3, ...); see "
        "pipelines/<family>.py.",
        default_factory=dict)
    lora: LoraConfig = config_field("LoRA settings.", default_factory=LoraConfig)
    gradient_checkpointing: bool = config_field(
        "Recompute activations in backward to save memory.",
        default=False)

    def validate(self) -> None:
        """``family`` and ``options`` are the adapters' names: checked by their registry
        (``pipelines.check_model_config``) from the policy."""
        choice(self.dtype, DTYPE_NAMES, "model.dtype")
        self.lora.validate()


@dataclass
class CurriculumConfig(Section):
    """Variance curriculum (CGPO-style): draw training prompts whose groups had reward variance
    more often. Weight of a prompt = floor + estimated P(its next group is mixed), where the
    estimate is (mixed + prior * prior_strength) / (groups + prior_strength) over its past groups'
    decayed counts (``flowgrpo.prompts.PromptCurriculum``)."""

    enabled: bool = config_field(
        "Turn the variance curriculum on (flow policies only).", default=False)
    floor: float = config_field(
        "Weight every prompt keeps on top of its estimated P(mixed) (>= 0), so all-right and "
        "all-wrong prompts are still drawn and can turn mixed; 0.1 draws an always-mixed prompt "
        "up to 11x as often as an always-constant one.", default=0.1)
    prior: float = config_field(
        "Estimated P(mixed) of a prompt never trained on, in [0, 1].", default=0.5)
    prior_strength: float = config_field(
        "Pseudo-groups of the prior in the estimate (> 0): how many groups it takes for a "
        "prompt's own history to outweigh it.", default=1.0)
    decay: float = config_field(
        "Each new group of a prompt multiplies its past counts by decay, in (0, 1]: 1 = plain "
        "counts; < 1 forgets old groups as the policy changes (about 1 / (1 - decay) groups "
        "remembered).", default=0.8)

    def validate(self) -> None:
        if not self.enabled:
            return
        positive(self.floor, "prompts.curriculum.floor", allow_zero=True)
        if not 0 <= self.prior <= 1:
            raise ConfigError(f"prompts.curriculum.prior is a probability and must be in [0, 1] "
                              f"(got {self.prior})")
        positive(self.prior_strength, "prompts.curriculum.prior_strength")
        if not 0 < self.decay <= 1:
            raise ConfigError(f"prompts.curriculum.decay must be in (0, 1] (1 = plain counts; "
                              f"got {self.decay})")
        if self.floor == 0 and self.prior == 0:
            raise ConfigError("prompts.curriculum.floor and prompts.curriculum.prior are both 0, "
                              "so every prompt starts with weight 0: make floor > 0 or prior > 0")


@dataclass
class PromptsConfig(Section):
    train: str = config_field(
        "Training prompts: 'toy:train', a .txt file (one prompt a line) or a .jsonl "
        "file of {prompt, metadata}.", default="toy:train")
    eval: str | None = config_field(
        "Held-out prompts for evaluation (same formats); None disables eval.",
        default="toy:heldout")
    balance_key: str | None = config_field(
        "Sample training prompts uniformly over the values of metadata[balance_key] (e.g. "
        "'family') instead of uniformly over prompts; None = uniform over prompts.", default=None)
    balance_weights: dict[str, float] = config_field(
        "With balance_key: relative draw weights of its values, e.g. {recolor_one: 1, recolor_two: "
        "2} draws two-object edits twice as often; a value not named weighs 1; empty = uniform "
        "over the values.", default_factory=dict)
    num_eval: int = config_field("Number of held-out prompts per evaluation (0 = all).", default=0)
    eval_seeds: int = config_field("Samples per held-out prompt at evaluation.", default=1)
    eval_per_family: int = config_field(
        "If > 0: evaluate exactly this many samples per metadata['family'] (cycling through the "
        "family's prompts with new seeds), so rare families are measured as precisely as common "
        "ones; eval_seeds is then ignored.", default=0)
    eval_seed: int | None = config_field(
        "Seed of the evaluation noise (the run's evaluations, its grids and flowgrpo eval); "
        "None = run.seed. Fix it to evaluate runs of different training seeds on the same "
        "samples.", default=None)
    curriculum: CurriculumConfig = config_field(
        "Variance curriculum over training prompts (off by default); combines with "
        "balance_key: the value is drawn uniformly, then a prompt by curriculum weight.",
        default_factory=CurriculumConfig)

    def validate(self) -> None:
        self.curriculum.validate()
        for key, source in (("prompts.train", self.train), ("prompts.eval", self.eval)):
            if source is not None and not source.startswith("toy:") and \
                    Path(source).suffix.lower() not in PROMPT_SUFFIXES:
                raise ConfigError(f"{key}: {source} is not a prompt source; give a .txt file (one "
                                  f"prompt a line), a .jsonl file ({{\"prompt\": ..., "
                                  f"\"metadata\": ...}} a line) or toy:train / toy:heldout")
        if self.balance_weights:
            if not self.balance_key:
                raise ConfigError("prompts.balance_weights weighs the values of "
                                  "prompts.balance_key, which is not set: set balance_key (e.g. "
                                  "'family') or remove balance_weights")
            for label, weight in self.balance_weights.items():
                name = f"prompts.balance_weights.{label}"
                if not is_number(weight):
                    raise ConfigError(f"{name} must be a number >= 0 (got {weight!r})")
                in_range(weight, 0.0, math.inf, name, high_open=True,
                         meaning=" (a relative draw weight)")
        positive(self.num_eval, "prompts.num_eval", allow_zero=True)
        positive(self.eval_seeds, "prompts.eval_seeds")
        positive(self.eval_per_family, "prompts.eval_per_family", allow_zero=True)
        if self.eval_seed is not None and self.eval_seed < 0:
            raise ConfigError(f"prompts.eval_seed must be >= 0, or null to use run.seed "
                              f"(got {self.eval_seed})")


@dataclass
class SamplingConfig(Section):
    num_steps: int = config_field(
        "Denoising steps of a training rollout. Flow-GRPO SD3: 10.", default=10)
    eval_num_steps: int = config_field(
        "Steps of the deterministic evaluation sampler. Flow-GRPO: 40.",
        default=20)
    kind: str = config_field(
        "Transition of stochastic steps (flowgrpo/sde.py).", default="flow_sde")
    noise_level: float = config_field(
        "SDE noise: a for flow_sde/cps (0.7 / 0.8), eta for dance_sde, a multiplier of "
        "Flash-GRPO's s = s_min + (s_max - s_min) sigma for flash_sde (Flash-GRPO: 1).",
        default=0.7)
    log_prob: str = config_field(
        "Log-prob of a step: 'exact' (Gaussian log-density, every anchor's SDE kinds) or "
        "'unscaled' (-mean_d (x' - mean)^2, Flow-GRPO's CPS: its log-ratios are 2 std^2 times "
        "the exact ones, which its clip range 1e-5 is sized for); 'unscaled' needs kind: cps.",
        default="exact")
    sigma_schedule: str = config_field(
        "Schedule of training rollouts: 'model' (the checkpoint scheduler's, what its stock "
        "pipeline samples) or 'shifted_linear' (shift(linspace(sigma_schedule_start, 0, N + 1)) "
        "with static shift sigma_shift: MixGRPO's FLUX grid (start 1, shift 3), Flash-GRPO's Wan "
        "grid (start 0.999, shift 3)). Evaluation keeps the model's schedule.", default="model")
    sigma_shift: float = config_field(
        "Static shift of sigma_schedule: shifted_linear.", default=3.0)
    sigma_schedule_start: float = config_field(
        "First point of the unshifted grid of sigma_schedule: shifted_linear, in (0, 1].",
        default=1.0)
    guidance_scale: float = config_field(
        "CFG scale during rollouts and training; <= 1 runs CFG-free (distils CFG). For FLUX.1 the "
        "guidance-embedding value.", default=1.0)
    eval_guidance_scale: float | None = config_field(
        "CFG scale at evaluation; None = guidance_scale.",
        default=None)
    share_initial_noise: bool = config_field(
        "Members of a group start from the same noise.", default=True)
    rollout_batch_size: int = config_field(
        "Samples per transformer call in rollouts; training replays the same batches so the first "
        "ratio is exactly 1. A multiple of group_size lets zero-variance groups be skipped.",
        default=8)
    plan: PlanConfig = config_field(
        "Which steps are stochastic and trained (full/window/branch/one_step/merge).",
        default_factory=PlanConfig)
    reward_guidance: RewardGuidanceConfig = config_field(
        "Euphonium: steer the stochastic steps along a differentiable reward's gradient "
        "(flowgrpo/guided_sde.py); off unless reward is named.",
        default_factory=RewardGuidanceConfig)
    embedding_perturbation: EmbeddingPerturbationConfig = config_field(
        "E2PO: roll group members out from structured perturbations of their prompt embedding "
        "(some members keep the original), the update training on the original "
        "(flowgrpo/embedding_perturbation.py); off at scale 0.",
        default_factory=EmbeddingPerturbationConfig)

    def validate(self) -> None:
        """The plan is validated where it applies (policy: flow), with ``num_steps``."""
        self.embedding_perturbation.validate()
        choice(self.kind, SAMPLING_KINDS, "sampling.kind")
        positive(self.num_steps, "sampling.num_steps")
        positive(self.eval_num_steps, "sampling.eval_num_steps")
        positive(self.noise_level, "sampling.noise_level", allow_zero=True)
        if self.kind == "cps" and self.noise_level > 1:
            raise ConfigError(f"sampling.noise_level is the CPS angle fraction a and must be in "
                              f"[0, 1] (got {self.noise_level})")
        choice(self.log_prob, LOG_PROBS, "sampling.log_prob")
        if self.log_prob == "unscaled" and self.kind != "cps":
            raise ConfigError(f"sampling.log_prob: unscaled is Flow-GRPO's CPS log-prob and needs "
                              f"sampling.kind: cps (got kind {self.kind!r}); use log_prob: exact")
        choice(self.sigma_schedule, SIGMA_SCHEDULES, "sampling.sigma_schedule")
        positive(self.sigma_shift, "sampling.sigma_shift")
        in_range(self.sigma_schedule_start, 0.0, 1.0, "sampling.sigma_schedule_start",
                 low_open=True,
                 meaning=" (the first unshifted point of sigma_schedule: shifted_linear)")
        positive(self.rollout_batch_size, "sampling.rollout_batch_size")
        if self.plan.kind == "merge" and not self.share_initial_noise:
            raise ConfigError("sampling.plan.kind 'merge' (E-GRPO) branches a group at its merged "
                              "step from one shared deterministic prefix, so the group must share "
                              "its initial noise: set sampling.share_initial_noise: true")


@dataclass
class EmaConfig(Section):
    enabled: bool = config_field(
        "Keep an EMA of the trainable weights (used for eval and saved).",
        default=False)
    decay: float = config_field("Maximum EMA decay; warm-up min((1+k)/(10+k), decay).", default=0.9)
    every: int = config_field("Update the EMA every N optimiser steps.", default=8)
    warmup: str = config_field(
        "What the decay warm-up counts: 'updates' (k = EMA updates made, one every `every` "
        "steps: 0.9 is reached at optimiser step 80 * every) or 'optimizer_steps' (Flow-GRPO's "
        "and Flash-GRPO's loops: k = optimiser steps taken, an update after step k when "
        "(k + 1) % every == 0: 0.9 at step 80).", default="updates")
    updates_per_step: int = config_field(
        "warmup optimizer_steps: times each update is applied. Flow-GRPO calls its EMA after "
        "every sample batch, so an update is applied once per sample batch of the step; 0 = "
        "that count here, the rollout batches per optimiser step on each process (2 in "
        "Flow-GRPO's 32-GPU SD3 recipes); Flash-GRPO: 1.", default=1)

    def validate(self) -> None:
        """The decay is checked where it is used (``enabled``); the rest always."""
        if self.enabled and not 0 < self.decay < 1:
            raise ConfigError(f"training.ema.decay must be in (0, 1) (got {self.decay})")
        if self.every < 1:
            raise ConfigError(f"training.ema.every must be >= 1 optimiser steps (got "
                              f"{self.every}); 1 updates the EMA after every step")
        choice(self.warmup, EMA_WARMUPS, "training.ema.warmup")
        positive(self.updates_per_step, "training.ema.updates_per_step", allow_zero=True)
        if self.warmup == "updates" and self.updates_per_step != 1:
            raise ConfigError(f"training.ema.updates_per_step={self.updates_per_step} repeats "
                              f"the updates of warmup optimizer_steps (Flow-GRPO's); with warmup "
                              f"updates set it to 1, or set training.ema.warmup: optimizer_steps")


@dataclass
class GardoConfig(Section):
    """Guards against reward hacking after GARDO (Gated and Adaptive Regularization with
    Diversity-aware Optimization, He et al. 2025): the KL only where the reward is least trusted,
    a reference that moves with the policy, and amplified advantages for distinct good samples.
    Every guard is off by default; docs/design.md, "Guards against reward hacking"."""

    kl_gate_key: str | None = config_field(
        "Gate the KL (training.kl_beta) by this reward output's per-sample uncertainty, e.g. "
        "'ensemble.std' or 'toy_proxy.std' (a reward key or '<key>.<component>'): the KL "
        "applies only to the kl_gate_fraction of the batch with the highest values. None = no "
        "gate by key.", default=None)
    kl_gate_auxiliary: list[str] = config_field(
        "Gate the KL by GARDO's uncertainty instead: the win rate of the total reward in the "
        "batch minus the mean win rate under these reward keys (e.g. weight-0 components "
        "[aesthetic, clip_score]), high where the trained reward alone rates a sample well. "
        "Empty = no gate by auxiliary rewards.", default_factory=list)
    kl_gate_fraction: float = config_field(
        "Share q of the batch the gated KL applies to, in [0, 1] (GARDO starts at 0.1); 1 = "
        "every sample (the plain KL). The KL of a replay batch is then beta * mean over its "
        "gated rows.", default=0.1)
    refresh_every: int = config_field(
        "Make the KL reference the current policy every N iterations since the last refresh "
        "(0 = never): full fine-tuning copies the weights into the frozen reference, LoRA keeps "
        "a snapshot of the adapter that the reference pass swaps in. Saved in checkpoints "
        "(reference.safetensors).", default=0)
    refresh_kl: float = config_field(
        "Also refresh right after an iteration whose mean KL (train/kl, over every process) "
        "exceeded this (GARDO's adaptive trigger; 0 = off).", default=0.0)
    diversity: bool = config_field(
        "Diversity-aware amplification: multiply each positive advantage by the sample's "
        "nearest-neighbour feature distance within its group over the group's mean distance.",
        default=False)
    diversity_features: str = config_field(
        "Feature of the media for diversity: 'pixels' (average-pooled to diversity_feature_size "
        "squared, no weights needed) or 'package.module:Class' (built with "
        "diversity_feature_options, called on (B, ...) media in [0, 1], returning (B, D)).",
        default="pixels")
    diversity_feature_size: int = config_field(
        "Side of the pooled image of the 'pixels' feature.",
        default=16)
    diversity_feature_options: dict[str, Any] = config_field(
        "Constructor options of a diversity_features class.", default_factory=dict)

    @property
    def kl_gate(self) -> bool:
        return self.kl_gate_key is not None or bool(self.kl_gate_auxiliary)

    @property
    def refresh(self) -> bool:
        return self.refresh_every > 0 or self.refresh_kl > 0

    def validate(self) -> None:
        """Ranges and what names a guard takes; what each guard needs from other sections (the
        policy, the KL terms, the reward keys) is a cross-section rule."""
        in_range(self.kl_gate_fraction, 0.0, 1.0, "training.gardo.kl_gate_fraction",
                 meaning=" (the share of the batch the gated KL applies to)")
        if self.kl_gate_key is not None and self.kl_gate_auxiliary:
            raise ConfigError("training.gardo.kl_gate_key and training.gardo.kl_gate_auxiliary "
                              "are two uncertainty sources for the KL gate: set one of them")
        if self.kl_gate_key is not None and not self.kl_gate_key:
            raise ConfigError("training.gardo.kl_gate_key is empty: give a reward output key "
                              "such as 'ensemble.std', or null for no gate")
        for i, key in enumerate(self.kl_gate_auxiliary):
            if not key or key == "total":
                raise ConfigError(f"training.gardo.kl_gate_auxiliary[{i}] is {key!r}: give "
                                  f"another reward's key (the total is what the gate compares "
                                  f"against)")
        positive(self.refresh_every, "training.gardo.refresh_every", allow_zero=True)
        positive(self.refresh_kl, "training.gardo.refresh_kl", allow_zero=True)
        if self.diversity:
            positive(self.diversity_feature_size, "training.gardo.diversity_feature_size")
            source = self.diversity_features
            if source != "pixels" and (":" not in source or source.startswith(":")
                                       or source.endswith(":")):
                raise ConfigError(f"training.gardo.diversity_features must be 'pixels' or "
                                  f"'package.module:Class' (got {source!r})")


@dataclass
class LocalityConfig(Section):
    """Locality-preserving advantages for editing (after Edit-GRPO): the edit reward's advantage
    drives the latent elements where the edit should act, the preservation reward's advantage
    the others, each region with its own clipped ratio (``losses.region_policy_loss``). Off by
    default; docs/design.md, "Editing: locality-preserving advantages"."""

    mask: str = config_field(
        "Where the edit region comes from: 'off' (one scalar advantage per sample), 'record' "
        "(each prompt record's \"mask\": toy:edit_* know it exactly, the recoloured object's "
        "pixels; a JSONL line names a greyscale image, white = edit), or 'difference' (per "
        "sample, the pixels whose largest channel difference between the source image and the "
        "sample exceeds difference_threshold).", default="off")
    edit_key: str = config_field(
        "Reward output whose group advantage drives the edit region, a reward key or "
        "'<key>.<component>' (toy: 'toy_edit.target', the target scene's verdict).", default="")
    keep_key: str = config_field(
        "Reward output whose group advantage drives the rest of the image, the preservation "
        "objective (toy: 'toy_edit.kept', the share of the source's objects kept in place).",
        default="")
    difference_threshold: float = config_field(
        "mask: difference: a pixel is in the edit region when max over channels |sample - "
        "source| exceeds this, in (0, 1) (images in [0, 1]).", default=0.1)
    resize: str = config_field(
        "How a pixel mask reaches a latent grid smaller than the image (a VAE's, 8x): 'area' "
        "(each latent cell weighted by the share of its pixels in the region) or 'nearest' "
        "(the cell's centre pixel decides). The toy model's latents are its pixels (identity).",
        default="area")
    edit_weight: float | None = config_field(
        "How the two regions' surrogates are weighed in a sample's loss: None (each by its share "
        "of the latent elements, so the split is exactly the step's log-prob, and a small edit "
        "region carries a small weight) or a number in (0, 1): in a sample with both regions the "
        "edit region weighs edit_weight and the rest 1 - edit_weight whatever their areas, so a "
        "small object's edit signal is not outweighed by the rest's preservation signal "
        "(losses.fixed_region_shares).", default=None)
    silent_share: str = config_field(
        "What a region whose advantage is 0 in a sample (its reward equal across the group: on a "
        "one-object toy edit nothing else can be disturbed, so 'kept' never varies) does with its "
        "weight: 'keep' (it keeps its share and weighs nothing, so the other region keeps only "
        "its own share) or 'reassign' (its share goes to the sample's regions with a non-zero "
        "advantage; losses.signal_region_shares).", default="keep")
    keep_region: str = config_field(
        "Where the preservation advantage acts: 'rest' (every element outside the edit region) "
        "or 'record' (each prompt record's \"keep_mask\": toy:edit_* know it exactly, the "
        "source's other objects; a JSONL line names a greyscale image, white = keep). With "
        "'record', elements in neither region (the toy's empty background) are left out of the "
        "surrogate and the two regions share each sample's weight by their sizes "
        "(sde.region_log_probs).", default="rest")
    keep_kl_beta: float = config_field(
        "Weight of a KL to the reference policy over the preservation region only (the "
        "keep_region's elements; losses.region_flow_kl under training.kl_convention), >= 0: "
        "holds the part of the image an edit should leave alone at what the untuned model draws "
        "there, while the edit region trains free of it (training.kl_beta pulls on both). 0 = off.",
        default=0.0)
    keep_source_beta: float = config_field(
        "Weight of a flow-matching loss that teaches the preservation region to reproduce the "
        "source, >= 0 (0 = off): at each trained step, the rollout's sample with its "
        "keep_region replaced by the source image (losses.source_preserving_target) is noised "
        "at the step's sigma and the policy's velocity regressed onto noise - target over the "
        "keep_region's elements only (losses.region_flow_matching). Supervised, not RL: what "
        "an edit should leave alone is known, the source, so it is taught directly rather than "
        "through the preservation reward's noisy advantage. Needs an adapter that encodes "
        "images into its latents (editing families with encode_images: toy, flux_kontext).", default=0.0)

    @property
    def enabled(self) -> bool:
        return self.mask != "off"

    def validate(self) -> None:
        """Values and the keys' presence; what the option needs of other sections (policy,
        aggregation, reward keys) is a cross-section rule."""
        choice(self.mask, LOCALITY_MASKS, "training.locality.mask")
        choice(self.resize, REGION_RESIZES, "training.locality.resize")
        choice(self.silent_share, SILENT_SHARES, "training.locality.silent_share")
        choice(self.keep_region, KEEP_REGIONS, "training.locality.keep_region")
        if self.edit_weight is not None:
            in_range(self.edit_weight, 0.0, 1.0, "training.locality.edit_weight",
                     low_open=True, high_open=True,
                     meaning=" (the edit region's weight; None = its area share)")
        in_range(self.difference_threshold, 0.0, 1.0, "training.locality.difference_threshold",
                 low_open=True, high_open=True, meaning=" (images are in [0, 1])")
        positive(self.keep_kl_beta, "training.locality.keep_kl_beta", allow_zero=True)
        positive(self.keep_source_beta, "training.locality.keep_source_beta", allow_zero=True)
        if not self.enabled:
            if self.keep_source_beta > 0:
                raise ConfigError("training.locality.keep_source_beta is set but training."
                                  "locality.mask is 'off', so there is no preservation region "
                                  "to teach: set mask to 'record' or 'difference', or set "
                                  "keep_source_beta to 0")
            if self.keep_kl_beta > 0:
                raise ConfigError("training.locality.keep_kl_beta is set but training.locality."
                                  "mask is 'off', so there is no preservation region: set mask "
                                  "to 'record' or 'difference', or use training.kl_beta")
            if self.edit_weight is not None:
                raise ConfigError("training.locality.edit_weight is set but training.locality.mask "
                                  "is 'off', so there are no regions to weigh: set mask to "
                                  "'record' or 'difference', or remove edit_weight")
            if self.silent_share != "keep":
                raise ConfigError("training.locality.silent_share is 'reassign' but "
                                  "training.locality.mask is 'off', so there are no regions: set "
                                  "mask to 'record' or 'difference', or remove silent_share")
            if self.keep_region != "rest":
                raise ConfigError("training.locality.keep_region is 'record' but "
                                  "training.locality.mask is 'off', so there are no regions: set "
                                  "mask to 'record' or 'difference', or remove keep_region")
            return
        for name in ("edit_key", "keep_key"):
            if not getattr(self, name):
                raise ConfigError(f"training.locality.{name} is empty: training.locality.mask "
                                  f"{self.mask!r} needs the reward outputs of both objectives, "
                                  f"e.g. edit_key: toy_edit.target, keep_key: toy_edit.kept")
        if self.edit_key == self.keep_key:
            raise ConfigError(f"training.locality.edit_key and keep_key are both "
                              f"{self.edit_key!r}: one advantage for both regions is the scalar "
                              f"loss; name the edit and the preservation rewards, or set "
                              f"training.locality.mask: off")


@dataclass
class TrainingConfig(Section):
    algorithm: str = config_field(
        "What the update trains on (flowgrpo/algorithms/, docs/algorithms.md): 'grpo' (the "
        "clipped policy gradient on the exact log-probs of SDE transitions: Flow-GRPO, "
        "DanceGRPO, MixGRPO, GRPO-Guard, Flash-GRPO), or on final samples re-noised by the "
        "forward process: 'nft' (DiffusionNFT), 'awm' (advantage weighted matching), 'dgpo' "
        "(direct group preference), 'dpo' (Diffusion-DPO on each group's best/worst pair, "
        "and offline pairs from training.dpo.pairs_file), 'gdro' (GDRO: a listwise loss of "
        "each group's implicit rewards against its rewards). "
        "The sample-based ones roll out with any solver (sampling.plan.kind: ode) and keep no "
        "transitions.", default="grpo")
    prompts_per_iteration: int = config_field(
        "Groups (distinct prompts) per iteration, over all processes.",
        default=8)
    group_size: int = config_field("Samples per prompt (group). Flow-GRPO: 24.", default=8)
    lr: float = config_field("AdamW learning rate. Flow-GRPO LoRA: 3e-4.", default=3e-4)
    lr_warmup_iterations: int = config_field(
        "Linear lr warmup over this many iterations (0: constant lr). Fresh Adam moments make the "
        "first steps sign-like and lr-sized on every weight.", default=0)
    lr_decay: str = config_field(
        "After warmup: 'constant', or 'linear' / 'cosine' decay from lr to lr * lr_final_ratio at "
        "run.max_iterations. Adam's steps are lr-sized whatever the gradient's signal, so once the "
        "easy gains are made a constant lr random-walks the weights away from what they learned "
        "(the toy default peaks and then declines at a constant 2e-4).", default="constant")
    lr_final_ratio: float = config_field(
        "The decayed lr at run.max_iterations as a share of lr, in [0, 1].",
        default=0.1)
    weight_decay: float = config_field("AdamW weight decay.", default=1e-4)
    adam_betas: tuple[float, float] = config_field("AdamW betas.", default=(0.9, 0.999))
    adam_eps: float = config_field("AdamW epsilon.", default=1e-8)
    use_8bit_adam: bool = config_field(
        "bitsandbytes AdamW8bit (needs the gpu extra).", default=False)
    max_grad_norm: float = config_field("Gradient-norm clip (0 disables).", default=1.0)
    clip_low: float = config_field(
        "Ratio clip below 1 (1 - clip_low). Flow-GRPO: 1e-4; Fast: 1e-5.",
        default=1e-4)
    clip_high: float | None = config_field(
        "Ratio clip above 1; None = clip_low (DAPO clip-higher: larger).",
        default=None)
    kl_beta: float = config_field(
        "Weight of the KL to the reference (LoRA disabled). 0.04 GenEval/OCR.",
        default=0.0)
    anchor_beta: float = config_field(
        "Untrained-step anchoring (0 = off): add anchor_beta * mean_d (v - v_ref)^2, the squared "
        "velocity difference to the KL reference (LoRA disabled, or the frozen initial model), at "
        "training.anchor_steps untrained steps of every rollout chunk, drawn afresh each "
        "iteration. A plan that trains a few steps (Fast branch, MixGRPO window, Flash one step) "
        "leaves the other steps free to drift as a side effect of the shared weights; on the toy "
        "the tinted canvas and textured objects that RL leaves come from the last, untrained "
        "steps (docs/reward_hacking.md). Costs one forward and backward of the policy and one "
        "forward of the reference per anchored step. The sample-based algorithms (nft, awm, "
        "dgpo, dpo, gdro) keep no states: they anchor their final samples re-noised at the "
        "schedule's levels below every training level (training.timesteps.fraction).",
        default=0.0)
    anchor_steps: int = config_field(
        "Untrained steps per rollout chunk that training.anchor_beta anchors, drawn uniformly "
        "without replacement among the chunk's untrained steps (seeded by seed, iteration and "
        "chunk).", default=1)
    anchor_sigma_max: float = config_field(
        "Anchor only untrained steps whose sigma is at most this, in (0, 1] (1 = every untrained "
        "step). Fine detail is drawn at low noise: on the toy the artifacts come from the steps "
        "below sigma 0.45, while the steps between the trained ones and those carry the "
        "learned behaviour usefully (docs/reward_hacking.md).", default=1.0)
    kl_convention: str = config_field(
        "What the KL divides by: 'exact' (the step's total std: the Gaussian KL per dim) or "
        "'flow_grpo' (the anchor's std_dev_t, s without sqrt(dt): Flow-GRPO's formula, the exact "
        "KL times sigma - sigma_next; use it with Flow-GRPO's beta).", default="exact")
    kl_reward: float = config_field(
        "Flow-GRPO's KL reward: subtract kl_reward * KL (the step KL of kl_convention to the "
        "reference, averaged over the sample's trained steps, computed during the rollout) from "
        "the total reward before the advantages (0 = off; needs rewards.aggregation: "
        "weighted_sum).", default=0.0)
    adv_scale: str = config_field("Advantage normalisation (none: Dr.GRPO).", default="group")
    adv_ddof: int = config_field(
        "Std degrees of freedom: 0 (Flow-GRPO) or 1 (TRL, DanceGRPO).", default=0)
    adv_eps: float = config_field("Added to the std.", default=1e-4)
    adv_clip: float = config_field(
        "Clip advantages to [-adv_clip, adv_clip] (0 disables).", default=5.0)
    num_inner_epochs: int = config_field("Passes over each rollout batch.", default=1)
    gradient_accumulation_steps: int = config_field(
        "Replay batches per optimiser step, counted over every process (a step trains the same "
        "batches on 1 or N processes); 0 = all of an inner epoch. One step per epoch scores "
        "every replay before the only step: the ratio is 1 and clipping never acts.",
        default=0)
    optimizer_steps_per_epoch: int = config_field(
        "Optimiser steps per inner epoch (Flow-GRPO: 2; MixGRPO: 4; Flash-GRPO: 2); when > 0 it "
        "sets gradient_accumulation_steps at start to ceil(replay batches / this), "
        "from the batch, rollout_batch_size, plan and process count (at most this many steps; "
        "exactly this many when the count divides). 0 = use gradient_accumulation_steps.",
        default=0)
    ratio_norm: bool = config_field("GRPO-Guard RatioNorm on the log-ratio.", default=False)
    dt_reweight: bool = config_field(
        "GRPO-Guard 1/dt gradient reweighting (normalised by batch mean).",
        default=False)
    rectification: bool = config_field(
        "Flash-GRPO temporal rectification weights kappa(t).", default=False)
    dt_reweight_norm: str = config_field(
        "How dt_reweight scales a replay batch's loss: 'iteration' (1/dt divided by its mean "
        "over the iteration's trained transitions on every process: the lr keeps its meaning) "
        "or 'batch_mean' (GRPO-Guard's released loss: divided by mean_b(sqrt(sigma - "
        "sigma_next))^2 over the replay batch, not normalised).", default="iteration")
    loss_scale: str = config_field(
        "Extra factor on each replay batch's policy loss (not the KL): 'none', or "
        "'std_over_sqrt_dt' (Flow-GRPO's Wan loop: mean_b(s) / mean_b(sqrt(sigma - sigma_next)) "
        "over the replay batch, s the step's std_dev_t without sqrt(dt), sde.anchor_std), or "
        "'noise_aware' (TempFlow-GRPO: each row's step total std over the mean total std of the "
        "rollout schedule's steps but the last, losses.noise_aware_weights).",
        default="none")
    cfg_gradient: str = config_field(
        "Where classifier-free guidance's unconditional branch gets gradient in the update "
        "(real CFG only: sampling.guidance_scale > 1 on SD3, Qwen-Image, Wan, toy): 'both' "
        "backpropagates through v_neg + g (v_pos - v_neg) into both branches (Flow-GRPO's "
        "current code, DanceGRPO, Flash-GRPO); 'conditional' treats v_neg as a constant, as "
        "Flow-GRPO's SD3 update did in July 2025, and runs that branch without autograd (no "
        "activations kept), the conditional one with it. The rollout's replayed steps then "
        "run the same two forwards, so the first-pass ratio stays exactly 1. docs/recipes.md.",
        default="both")
    skip_zero_std_groups: bool = config_field(
        "Skip replay of batches whose advantages are all zero (DAPO-style filtering).",
        default=True)
    mixed_precision: str = config_field(
        "accelerate mixed precision (SDE maths stay fp32). fp16 scales the loss "
        "(accelerate's GradScaler): an overflowing step is skipped and the scale lowered.",
        default="no")
    max_consecutive_skipped_steps: int = config_field(
        "Abort the run after this many optimiser steps in a row were skipped for a non-finite "
        "gradient (0 = never abort). A skipped step changes neither the weights nor the EMA.",
        default=20)
    max_iterations_without_finite_reward: int = config_field(
        "Stop the run (with an error naming each reward and what it returned) after this many "
        "iterations in a row in which no sample had a finite reward (0 = never stop). Such "
        "iterations teach nothing; the checkpoints are kept.", default=5)
    on_constant_reward: str = config_field(
        "What to do when a weighted reward gives every sample of an iteration the same value "
        "for training.constant_reward_iterations iterations in a row (its advantages are all "
        "zero: it teaches nothing): 'warn' (once per streak), 'stop' (an error) or 'ignore'.",
        default="warn")
    constant_reward_iterations: int = config_field(
        "Iterations in a row of one constant reward before training.on_constant_reward acts.",
        default=5)
    ddp_find_unused_parameters: bool = config_field(
        "DDP's find_unused_parameters: set it when some trainable parameters get no gradient "
        "in a forward (DDP then stops with 'Expected to have finished reduction').", default=False)
    ema: EmaConfig = config_field("EMA of trainable weights.", default_factory=EmaConfig)
    gardo: GardoConfig = config_field(
        "Guards against reward hacking (GARDO); all off by default.",
        default_factory=GardoConfig)
    locality: LocalityConfig = config_field(
        "Locality-preserving advantages for editing (Edit-GRPO); off by default.",
        default_factory=LocalityConfig)
    timesteps: TimestepsConfig = config_field(
        "The noise levels the sample-based algorithms (nft, awm, dgpo, dpo) train at.",
        default_factory=TimestepsConfig)
    nft: NFTConfig = config_field(
        "DiffusionNFT (training.algorithm: nft).", default_factory=NFTConfig)
    awm: AWMConfig = config_field(
        "Advantage weighted matching (training.algorithm: awm).",
        default_factory=AWMConfig)
    dgpo: DGPOConfig = config_field("DGPO (training.algorithm: dgpo).", default_factory=DGPOConfig)
    dpo: DPOConfig = config_field(
        "Diffusion-DPO (training.algorithm: dpo).", default_factory=DPOConfig)
    gdro: GDROConfig = config_field(
        "GDRO, group-level direct reward optimization (training.algorithm: gdro).",
        default_factory=GDROConfig)
    advantage: str = config_field(
        "Which advantages the update uses: 'auto' (one a sample, as the reward options imply: "
        "group-normalised total, GDPO per component, saturation weights, locality regions) or "
        "'vgpo' (VGPO, arXiv 2512.12387: one a trained step, from the rewards of the one-step "
        "predictions x - sigma v of the trained states, a group-relative part and an absolute "
        "part: training.vgpo; costs a reward call a replay batch after a row's first trained "
        "step, logged as cost/step_value_*; flowgrpo/step_values.py).", default="auto")
    vgpo: VGPOConfig = config_field(
        "VGPO's per-step advantages (training.advantage: vgpo).", default_factory=VGPOConfig)

    def validate(self) -> None:
        choice(self.algorithm, ALGORITHM_NAMES, "training.algorithm")
        positive(self.prompts_per_iteration, "training.prompts_per_iteration")
        positive(self.group_size, "training.group_size")
        choice(self.adv_scale, SCALES, "training.adv_scale")
        if self.group_size == 1 and self.adv_scale in ("group", "batch"):
            raise ConfigError("training.group_size is 1, so group statistics are undefined: use "
                              "group_size >= 2 (GRPO needs several samples per prompt)")
        positive(self.lr, "training.lr")
        positive(self.lr_warmup_iterations, "training.lr_warmup_iterations", allow_zero=True)
        choice(self.lr_decay, LR_DECAYS, "training.lr_decay")
        positive(self.weight_decay, "training.weight_decay", allow_zero=True)
        for i, beta in enumerate(self.adam_betas):
            in_range(beta, 0.0, 1.0, f"training.adam_betas[{i}]", high_open=True,
                     meaning=" (AdamW's moment decays, e.g. [0.9, 0.999])")
        positive(self.adam_eps, "training.adam_eps")
        positive(self.max_grad_norm, "training.max_grad_norm", allow_zero=True)
        positive(self.adv_eps, "training.adv_eps", allow_zero=True)
        positive(self.adv_clip, "training.adv_clip", allow_zero=True)
        if not 0.0 <= self.lr_final_ratio <= 1.0:
            raise ConfigError(f"training.lr_final_ratio must be in [0, 1] (got "
                              f"{self.lr_final_ratio}); it is the final lr as a share of "
                              f"training.lr")
        positive(self.clip_low, "training.clip_low")
        if self.clip_low > 1:
            raise ConfigError(f"training.clip_low must be <= 1 so that 1 - clip_low >= 0 "
                              f"(got {self.clip_low})")
        if self.clip_high is not None:
            positive(self.clip_high, "training.clip_high")
        positive(self.kl_beta, "training.kl_beta", allow_zero=True)
        positive(self.anchor_beta, "training.anchor_beta", allow_zero=True)
        positive(self.anchor_steps, "training.anchor_steps")
        in_range(self.anchor_sigma_max, 0.0, 1.0, "training.anchor_sigma_max", low_open=True,
                 meaning=" (the largest sigma of an anchored step)")
        choice(self.kl_convention, KL_CONVENTIONS, "training.kl_convention")
        choice(self.dt_reweight_norm, DT_REWEIGHT_NORMS, "training.dt_reweight_norm")
        choice(self.loss_scale, LOSS_SCALES, "training.loss_scale")
        choice(self.cfg_gradient, CFG_GRADIENTS, "training.cfg_gradient")
        positive(self.kl_reward, "training.kl_reward", allow_zero=True)
        if self.adv_ddof not in (0, 1):
            raise ConfigError(f"training.adv_ddof must be 0 or 1 (got {self.adv_ddof})")
        positive(self.num_inner_epochs, "training.num_inner_epochs")
        positive(self.gradient_accumulation_steps, "training.gradient_accumulation_steps",
                 allow_zero=True)
        positive(self.optimizer_steps_per_epoch, "training.optimizer_steps_per_epoch",
                 allow_zero=True)
        choice(self.mixed_precision, MIXED_PRECISIONS, "training.mixed_precision")
        positive(self.max_consecutive_skipped_steps, "training.max_consecutive_skipped_steps",
                 allow_zero=True)
        positive(self.max_iterations_without_finite_reward,
                 "training.max_iterations_without_finite_reward", allow_zero=True)
        choice(self.on_constant_reward, CONSTANT_REWARD_ACTIONS, "training.on_constant_reward")
        positive(self.constant_reward_iterations, "training.constant_reward_iterations")
        self.ema.validate()
        self.gardo.validate()
        self.locality.validate()
        self.timesteps.validate()
        self.nft.validate()
        self.awm.validate()
        self.dgpo.validate()
        self.dpo.validate()
        self.gdro.validate()
        choice(self.advantage, ADVANTAGES, "training.advantage")
        self.vgpo.validate()
        if self.algorithm != "grpo":
            self._sample_algorithm_rules()

    def _sample_algorithm_rules(self) -> None:
        """What the sample-based algorithms cannot use: the parts of the GRPO loss that act on
        transitions (they keep none). training.anchor_beta is not one: they anchor re-noised
        final samples (``FlowAlgorithm.add_anchor``)."""
        grpo_only = {"ratio_norm": self.ratio_norm, "dt_reweight": self.dt_reweight,
                     "rectification": self.rectification,
                     "kl_reward": self.kl_reward > 0, "loss_scale": self.loss_scale != "none",
                     "locality.mask": self.locality.enabled,
                     "gardo.kl_gate": self.gardo.kl_gate}
        used = [name for name, on in grpo_only.items() if on]
        if used:
            raise ConfigError(f"training.{used[0]} acts on SDE transitions, which "
                              f"training.algorithm {self.algorithm!r} does not keep: remove it, "
                              f"or use training.algorithm: grpo")
        if self.algorithm == "nft" and self.adv_clip <= 0:
            raise ConfigError("training.adv_clip is 0, but DiffusionNFT maps advantages in "
                              "[-adv_clip, adv_clip] to its weight r: set adv_clip > 0 (the "
                              "reference uses 5)")



@dataclass
class RewardSpec:
    name: str = config_field("Registered reward name or 'package.module:Class'.", default="")
    weight: float = config_field("Weight in the sum (or in GDPO's decoupled sum).", default=1.0)
    options: dict[str, Any] = config_field(
        "Constructor options of the reward.", default_factory=dict)

    def validate(self, where: str) -> None:
        """``where``: the spec's place, e.g. ``rewards.components[0]``. Whether the name is
        known is the reward registry's check (``reward_models.check_reward_specs``)."""
        if not self.name:
            raise ConfigError(f"{where}.name is empty: give a registered reward name or "
                              f"'package.module:Class'")


@dataclass
class RewardsConfig(Section):
    components: list[RewardSpec] = config_field("Rewards to combine.", default_factory=list)
    aggregation: str = config_field(
        "weighted_sum (then group-normalise) | decoupled (GDPO) | "
        "decoupled_sum (MixGRPO's advantage_aggr: GDPO without the final "
        "batch normalisation).",
        default="weighted_sum")
    threaded: bool = config_field(
        "Score each rollout batch in a thread while the next one rolls out.",
        default=True)
    saturation_ratio: float = config_field(
        "Saturation weighting of several components (after the idea of TaRoS; 0 = off): "
        "in each group, component k's weight is scaled by min(1, its std in the group / "
        "(ratio * its std over the batch)), so a component that no longer separates a group "
        "stops dominating its advantage. In (0, 1], e.g. 0.5; needs >= 2 weighted "
        "components.", default=0.0)

    def validate(self) -> None:
        """Whether the names are known is the reward registry's check; the saturation weights'
        needs (several weighted components, no kl_reward) are cross-section rules."""
        choice(self.aggregation, REWARD_AGGREGATIONS, "rewards.aggregation")
        for i, spec in enumerate(self.components):
            spec.validate(f"rewards.components[{i}]")
        if self.saturation_ratio != 0:
            in_range(self.saturation_ratio, 0.0, 1.0, "rewards.saturation_ratio", low_open=True,
                     meaning=" (0 = off)")


@dataclass
class LLMConfig(Section):
    """Causal-LM policy options (``policy: llm``); the model is ``model.path``."""

    max_new_tokens: int = config_field("Completion length limit.", default=32)
    temperature: float = config_field("Sampling temperature of rollouts.", default=1.0)
    top_p: float = config_field("Nucleus sampling threshold.", default=1.0)
    aggregation: str = config_field("Token-loss aggregation (flowgrpo/losses.py).", default="grpo")
    level: str = config_field(
        "Importance ratio level: token (GRPO) or sequence (GSPO).", default="token")
    dynamic_sampling: bool = config_field(
        "DAPO: drop zero-variance groups and resample until the batch is "
        "full (bounded by max_resample_rounds).", default=False)
    max_resample_rounds: int = config_field("Upper bound on dynamic-sampling rounds.", default=3)
    overlong_buffer: int = config_field(
        "DAPO soft overlong punishment window in tokens (0 = off).",
        default=0)
    overlong_penalty: float = config_field(
        "Penalty at max_new_tokens for the overlong shaping.",
        default=1.0)
    mask_truncated: bool = config_field(
        "DAPO: exclude completions that hit max_new_tokens from the loss.",
        default=False)
    eval_temperature: float = config_field("Temperature at evaluation (0 = greedy).", default=0.0)

    def validate(self) -> None:
        """Checked for ``policy: llm`` only (the other policies ignore the section)."""
        choice(self.aggregation, TOKEN_AGGREGATIONS, "llm.aggregation")
        choice(self.level, TOKEN_LEVELS, "llm.level")
        positive(self.max_new_tokens, "llm.max_new_tokens")
        positive(self.temperature, "llm.temperature")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"llm.top_p must be in (0, 1] (got {self.top_p})")
        positive(self.max_resample_rounds, "llm.max_resample_rounds", allow_zero=True)
        in_range(self.overlong_buffer, 0, self.max_new_tokens, "llm.overlong_buffer",
                 meaning=" (tokens before llm.max_new_tokens; 0 = off)")
        positive(self.overlong_penalty, "llm.overlong_penalty", allow_zero=True)
        positive(self.eval_temperature, "llm.eval_temperature", allow_zero=True)


@dataclass
class EvalConfig(Section):
    """Held-out metrics: rewards scored on the samples of every evaluation beside the training
    rewards, logged as eval/<key> with the same statistics, and never part of the advantages.
    Every real reward is a proxy; a metric the run does not optimise shows when it is gamed."""

    rewards: list[RewardSpec] = config_field(
        "Rewards in the format of rewards.components (name, options; options.label sets the "
        "key, which must differ from every training reward's; weight is ignored), scored on "
        "each evaluation's held-out samples (the same images, scored once). A reward class with "
        "higher_is_better = False (e.g. toy_artifacts) counts as lower-is-better in summaries "
        "and run.select_best_on.", default_factory=list)

    def validate(self) -> None:
        """The keys the held-out rewards are logged under are a cross-section rule (they must
        differ from the training rewards'); the names are the reward registry's check."""
        for i, spec in enumerate(self.rewards):
            spec.validate(f"eval.rewards[{i}]")


@dataclass
class RunConfig(Section):
    seed: int = config_field("Seed of every random draw (prompts, noise, plans).", default=0)
    output_dir: str = config_field("Runs go to <output_dir>/<name>/.", default="runs")
    max_iterations: int = config_field("Iterations (rollout + update) to run.", default=100)
    eval_every: int = config_field(
        "Evaluate every N iterations (0 = only at start and end).", default=10)
    checkpoint_every: int = config_field(
        "Checkpoint every N iterations (0 = only at the end).", default=10)
    keep_checkpoints: int = config_field("Keep the newest N checkpoints (0 = all).", default=3)
    tracker: str = config_field("accelerate tracker.", default="tensorboard")
    num_threads: int = config_field("torch CPU threads (0 = torch default).", default=0)
    progress: bool = config_field("Show a progress bar.", default=True)
    comparison_grid: bool = config_field(
        "Write a before/after grid of held-out prompts at the end.",
        default=True)
    select_best_on: str | None = config_field(
        "Keep the weights of the evaluation where this metric was best in checkpoints/best/ "
        "(never pruned; checkpoints/best.json says which iteration and value), e.g. "
        "eval/geneval_toy.exact/family_mean: a key of the evaluation records, eval/<reward key>"
        "[/<family> | /family_mean], of a reward in rewards.components or eval.rewards. "
        "None = no selection.", default=None)
    select_best_mode: str = config_field(
        "Whether larger or smaller values of run.select_best_on are better; auto: the reward's "
        "higher_is_better (True unless its class says otherwise).", default="auto")
    early_stop_patience: int = config_field(
        "Stop the run after this many evaluations in a row without a new best of "
        "run.select_best_on (0 = never stop early). The final checkpoint is saved where it stops.",
        default=0)
    save_on_signal: list[str] = config_field(
        "Signals that make the run save a checkpoint at the next safe point, print one line and "
        "exit with 128 + the signal's number (143 for SIGTERM); a second one exits at once. Any "
        f"of {', '.join(STOP_SIGNALS)}; a signal left out keeps its default effect (SIGINT: "
        "exit without saving). docs/reliability.md, 'Signals and preemption'.",
        default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])

    def validate(self) -> None:
        """Whether ``select_best_on`` names a metric the evaluation logs is a cross-section
        rule (it reads the rewards and prompts.eval)."""
        positive(self.max_iterations, "run.max_iterations")
        positive(self.eval_every, "run.eval_every", allow_zero=True)
        positive(self.checkpoint_every, "run.checkpoint_every", allow_zero=True)
        positive(self.keep_checkpoints, "run.keep_checkpoints", allow_zero=True)
        positive(self.num_threads, "run.num_threads", allow_zero=True)
        if not self.output_dir:
            raise ConfigError("run.output_dir is empty: give the folder that holds run folders, "
                              "e.g. runs")
        choice(self.tracker, TRACKERS, "run.tracker")
        choice(self.select_best_mode, SELECT_BEST_MODES, "run.select_best_mode")
        positive(self.early_stop_patience, "run.early_stop_patience", allow_zero=True)
        for name in self.save_on_signal:
            choice(name, STOP_SIGNALS, "run.save_on_signal")
        if len(set(self.save_on_signal)) != len(self.save_on_signal):
            raise ConfigError(f"run.save_on_signal names a signal twice: {self.save_on_signal}")
        if self.select_best_on is None and self.early_stop_patience:
            raise ConfigError("run.early_stop_patience counts evaluations without a new best of "
                              "run.select_best_on, which is null: set run.select_best_on (e.g. "
                              "eval/<reward key>/family_mean) or early_stop_patience: 0")
