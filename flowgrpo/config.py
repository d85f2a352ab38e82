"""Typed run configuration: dataclasses, YAML loading, dotted overrides, validation.

Every field is checked (name, type, range, combination) before any model is loaded, and every
error names the field and says what to do. ``flowgrpo train --help-config`` prints the help texts.

A config file mirrors ``TrainConfig``::

    name: toy_geneval
    model:    {family: toy, path: assets/toy, lora: {rank: 8}}
    prompts:  {train: "toy:train", eval: "toy:heldout"}
    sampling: {num_steps: 10, kind: flow_sde, noise_level: 0.7, plan: {kind: branch}}
    training: {group_size: 8, prompts_per_iteration: 8, lr: 3.0e-5}
    rewards:  {components: [{name: geneval_toy, score: partial}]}
    run:      {max_iterations: 100, eval_every: 10}
"""
from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from flowgrpo.plans import PlanConfig


LR_DECAYS = ("constant", "linear", "cosine")
SIGMA_SCHEDULES = ("model", "shifted_linear")


class InputError(ValueError):
    """Something the user gave is wrong (a config value, a prompt file, a run folder, a
    ``--resume`` target): the message says what and how to fix it. ``flowgrpo train`` prints
    these as one line; any other exception keeps its traceback, because it is a bug or a failure
    of the machine rather than of the input."""


class ConfigError(InputError):
    """A configuration value is wrong; the message names the field and the fix."""


# Option names whose values are secrets, at any depth of the config (compared lower-case, "-"
# read as "_"; a name ending in "_<one of these>" counts too, e.g. hf_token). Redacted from the
# run folder's config.yaml and the trackers' hyper-parameters.
SECRET_OPTION_NAMES = ("token", "api_key", "apikey", "password", "secret")
REDACTED = "***"


def _help(text: str, **kw: Any) -> Any:
    """A dataclass field with a help text (printed by ``flowgrpo train --help-config``)."""
    if "default" not in kw and "default_factory" not in kw:
        raise TypeError("every config field needs a default")
    return field(metadata={"help": text}, **kw)


@dataclass
class LoraConfig:
    enabled: bool = _help("Train LoRA adapters (True) or the full transformer (False).", default=True)
    rank: int = _help("LoRA rank r. Flow-GRPO SD3: 32; FLUX.1: 64.", default=32)
    alpha: int = _help("LoRA alpha (scale alpha/r). Flow-GRPO: 2*rank.", default=64)
    init: str = _help("LoRA init: 'gaussian' (Flow-GRPO) or 'default' (PEFT's Kaiming A, zero B).",
                      default="gaussian")
    target_modules: list[str] | None = _help(
        "PEFT target module names; None = the model family's default list.", default=None)


@dataclass
class ModelConfig:
    family: str = _help("Model family: sd3 | flux | wan | toy.", default="toy")
    path: str = _help("Hub id or local folder passed to from_pretrained.", default="assets/toy")
    dtype: str = _help("Weights dtype of frozen components: float32 | bfloat16 | float16.",
                       default="float32")
    options: dict[str, Any] = _help(
        "Family options (height, width, num_frames, text_encoder_3, ...); see pipelines/<family>.py.",
        default_factory=dict)
    lora: LoraConfig = _help("LoRA settings.", default_factory=LoraConfig)
    gradient_checkpointing: bool = _help("Recompute activations in backward to save memory.",
                                         default=False)


@dataclass
class CurriculumConfig:
    """Variance curriculum (CGPO-style): draw training prompts whose groups had reward variance
    more often. Weight of a prompt = floor + estimated P(its next group is mixed), where the
    estimate is (mixed + prior * prior_strength) / (groups + prior_strength) over its past groups'
    decayed counts (``flowgrpo.prompts.PromptCurriculum``)."""

    enabled: bool = _help("Turn the variance curriculum on (flow policies only).", default=False)
    floor: float = _help(
        "Weight every prompt keeps on top of its estimated P(mixed) (>= 0), so all-right and "
        "all-wrong prompts are still drawn and can turn mixed; 0.1 draws an always-mixed prompt "
        "up to 11x as often as an always-constant one.", default=0.1)
    prior: float = _help("Estimated P(mixed) of a prompt never trained on, in [0, 1].", default=0.5)
    prior_strength: float = _help(
        "Pseudo-groups of the prior in the estimate (> 0): how many groups it takes for a "
        "prompt's own history to outweigh it.", default=1.0)
    decay: float = _help(
        "Each new group of a prompt multiplies its past counts by decay, in (0, 1]: 1 = plain "
        "counts; < 1 forgets old groups as the policy changes (about 1 / (1 - decay) groups "
        "remembered).", default=0.8)


@dataclass
class PromptsConfig:
    train: str = _help("Training prompts: 'toy:train', a .txt file (one prompt a line) or a .jsonl "
                       "file of {prompt, metadata}.", default="toy:train")
    eval: str | None = _help("Held-out prompts for evaluation (same formats); None disables eval.",
                             default="toy:heldout")
    balance_key: str | None = _help(
        "Sample training prompts uniformly over the values of metadata[balance_key] (e.g. "
        "'family') instead of uniformly over prompts; None = uniform over prompts.", default=None)
    num_eval: int = _help("Number of held-out prompts per evaluation (0 = all).", default=0)
    eval_seeds: int = _help("Samples per held-out prompt at evaluation.", default=1)
    eval_per_family: int = _help(
        "If > 0: evaluate exactly this many samples per metadata['family'] (cycling through the "
        "family's prompts with new seeds), so rare families are measured as precisely as common "
        "ones; eval_seeds is then ignored.", default=0)
    eval_seed: int | None = _help(
        "Seed of the evaluation noise (the run's evaluations, its grids and flowgrpo eval); "
        "None = run.seed. Fix it to evaluate runs of different training seeds on the same "
        "samples.", default=None)
    curriculum: CurriculumConfig = _help(
        "Variance curriculum over training prompts (off by default); combines with "
        "balance_key: the value is drawn uniformly, then a prompt by curriculum weight.",
        default_factory=CurriculumConfig)


@dataclass
class SamplingConfig:
    num_steps: int = _help("Denoising steps of a training rollout. Flow-GRPO SD3: 10.", default=10)
    eval_num_steps: int = _help("Steps of the deterministic evaluation sampler. Flow-GRPO: 40.",
                                default=20)
    kind: str = _help("Transition of stochastic steps: flow_sde | dance_sde | flash_sde | cps "
                      "(flowgrpo/sde.py).", default="flow_sde")
    noise_level: float = _help(
        "SDE noise: a for flow_sde/cps (0.7 / 0.8), eta for dance_sde, a multiplier of "
        "Flash-GRPO's s = s_min + (s_max - s_min) sigma for flash_sde (Flash-GRPO: 1).",
        default=0.7)
    log_prob: str = _help(
        "Log-prob of a step: 'exact' (Gaussian log-density, every anchor's SDE kinds) or "
        "'unscaled' (-mean_d (x' - mean)^2, Flow-GRPO's CPS: its log-ratios are 2 std^2 times "
        "the exact ones, which its clip range 1e-5 is sized for); 'unscaled' needs kind: cps.",
        default="exact")
    sigma_schedule: str = _help(
        "Schedule of training rollouts: 'model' (the checkpoint scheduler's, what its stock "
        "pipeline samples) or 'shifted_linear' (shift(linspace(sigma_schedule_start, 0, N + 1)) "
        "with static shift sigma_shift: MixGRPO's FLUX grid (start 1, shift 3), Flash-GRPO's Wan "
        "grid (start 0.999, shift 3)). Evaluation keeps the model's schedule.", default="model")
    sigma_shift: float = _help("Static shift of sigma_schedule: shifted_linear.", default=3.0)
    sigma_schedule_start: float = _help(
        "First point of the unshifted grid of sigma_schedule: shifted_linear, in (0, 1].",
        default=1.0)
    guidance_scale: float = _help(
        "CFG scale during rollouts and training; <= 1 runs CFG-free (distils CFG). For FLUX.1 the "
        "guidance-embedding value.", default=1.0)
    eval_guidance_scale: float | None = _help("CFG scale at evaluation; None = guidance_scale.",
                                              default=None)
    share_initial_noise: bool = _help("Members of a group start from the same noise.", default=True)
    rollout_batch_size: int = _help(
        "Samples per transformer call in rollouts; training replays the same batches so the first "
        "ratio is exactly 1. A multiple of group_size lets zero-variance groups be skipped.", default=8)
    plan: PlanConfig = _help("Which steps are stochastic and trained (full/window/branch/one_step).",
                             default_factory=PlanConfig)


@dataclass
class EmaConfig:
    enabled: bool = _help("Keep an EMA of the trainable weights (used for eval and saved).",
                          default=False)
    decay: float = _help("Maximum EMA decay; warm-up min((1+k)/(10+k), decay).", default=0.9)
    every: int = _help("Update the EMA every N optimiser steps.", default=8)
    warmup: str = _help(
        "What the decay warm-up counts: 'updates' (k = EMA updates made, one every `every` "
        "steps: 0.9 is reached at optimiser step 80 * every) or 'optimizer_steps' (Flow-GRPO's "
        "and Flash-GRPO's loops: k = optimiser steps taken, an update after step k when "
        "(k + 1) % every == 0: 0.9 at step 80).", default="updates")
    updates_per_step: int = _help(
        "warmup optimizer_steps: times each update is applied. Flow-GRPO calls its EMA after "
        "every sample batch, so an update is applied once per sample batch of the step; 0 = "
        "that count here, the rollout batches per optimiser step on each process (2 in "
        "Flow-GRPO's 32-GPU SD3 recipes); Flash-GRPO: 1.", default=1)


@dataclass
class GardoConfig:
    """Guards against reward hacking after GARDO (Gated and Adaptive Regularization with
    Diversity-aware Optimization, He et al. 2025): the KL only where the reward is least trusted,
    a reference that moves with the policy, and amplified advantages for distinct good samples.
    Every guard is off by default; docs/design.md, "Guards against reward hacking"."""

    kl_gate_key: str | None = _help(
        "Gate the KL (training.kl_beta) by this reward output's per-sample uncertainty, e.g. "
        "'ensemble.std' or 'toy_proxy.std' (a reward key or '<key>.<component>'): the KL "
        "applies only to the kl_gate_fraction of the batch with the highest values. None = no "
        "gate by key.", default=None)
    kl_gate_auxiliary: list[str] = _help(
        "Gate the KL by GARDO's uncertainty instead: the win rate of the total reward in the "
        "batch minus the mean win rate under these reward keys (e.g. weight-0 components "
        "[aesthetic, clip_score]), high where the trained reward alone rates a sample well. "
        "Empty = no gate by auxiliary rewards.", default_factory=list)
    kl_gate_fraction: float = _help(
        "Share q of the batch the gated KL applies to, in [0, 1] (GARDO starts at 0.1); 1 = "
        "every sample (the plain KL). The KL of a replay batch is then beta * mean over its "
        "gated rows.", default=0.1)
    refresh_every: int = _help(
        "Make the KL reference the current policy every N iterations since the last refresh "
        "(0 = never): full fine-tuning copies the weights into the frozen reference, LoRA keeps "
        "a snapshot of the adapter that the reference pass swaps in. Saved in checkpoints "
        "(reference.safetensors).", default=0)
    refresh_kl: float = _help(
        "Also refresh right after an iteration whose mean KL (train/kl, over every process) "
        "exceeded this (GARDO's adaptive trigger; 0 = off).", default=0.0)
    diversity: bool = _help(
        "Diversity-aware amplification: multiply each positive advantage by the sample's "
        "nearest-neighbour feature distance within its group over the group's mean distance.",
        default=False)
    diversity_features: str = _help(
        "Feature of the media for diversity: 'pixels' (average-pooled to diversity_feature_size "
        "squared, no weights needed) or 'package.module:Class' (built with "
        "diversity_feature_options, called on (B, ...) media in [0, 1], returning (B, D)).",
        default="pixels")
    diversity_feature_size: int = _help("Side of the pooled image of the 'pixels' feature.",
                                        default=16)
    diversity_feature_options: dict[str, Any] = _help(
        "Constructor options of a diversity_features class.", default_factory=dict)

    @property
    def kl_gate(self) -> bool:
        return self.kl_gate_key is not None or bool(self.kl_gate_auxiliary)

    @property
    def refresh(self) -> bool:
        return self.refresh_every > 0 or self.refresh_kl > 0


@dataclass
class TrainingConfig:
    prompts_per_iteration: int = _help("Groups (distinct prompts) per iteration, over all processes.",
                                       default=8)
    group_size: int = _help("Samples per prompt (group). Flow-GRPO: 24.", default=8)
    lr: float = _help("AdamW learning rate. Flow-GRPO LoRA: 3e-4.", default=3e-4)
    lr_warmup_iterations: int = _help(
        "Linear lr warmup over this many iterations (0: constant lr). Fresh Adam moments make the "
        "first steps sign-like and lr-sized on every weight.", default=0)
    lr_decay: str = _help(
        "After warmup: 'constant', or 'linear' / 'cosine' decay from lr to lr * lr_final_ratio at "
        "run.max_iterations. Adam's steps are lr-sized whatever the gradient's signal, so once the "
        "easy gains are made a constant lr random-walks the weights away from what they learned "
        "(the toy default peaks and then declines at a constant 2e-4).", default="constant")
    lr_final_ratio: float = _help("The decayed lr at run.max_iterations as a share of lr, in [0, 1].",
                                  default=0.1)
    weight_decay: float = _help("AdamW weight decay.", default=1e-4)
    adam_betas: tuple[float, float] = _help("AdamW betas.", default=(0.9, 0.999))
    adam_eps: float = _help("AdamW epsilon.", default=1e-8)
    use_8bit_adam: bool = _help("bitsandbytes AdamW8bit (needs the gpu extra).", default=False)
    max_grad_norm: float = _help("Gradient-norm clip (0 disables).", default=1.0)
    clip_low: float = _help("Ratio clip below 1 (1 - clip_low). Flow-GRPO: 1e-4; Fast: 1e-5.",
                            default=1e-4)
    clip_high: float | None = _help("Ratio clip above 1; None = clip_low (DAPO clip-higher: larger).",
                                    default=None)
    kl_beta: float = _help("Weight of the KL to the reference (LoRA disabled). 0.04 GenEval/OCR.",
                           default=0.0)
    anchor_beta: float = _help(
        "Untrained-step anchoring (0 = off): add anchor_beta * mean_d (v - v_ref)^2, the squared "
        "velocity difference to the KL reference (LoRA disabled, or the frozen initial model), at "
        "training.anchor_steps untrained steps of every rollout chunk, drawn afresh each "
        "iteration. A plan that trains a few steps (Fast branch, MixGRPO window, Flash one step) "
        "leaves the other steps free to drift as a side effect of the shared weights; on the toy "
        "the tinted canvas and textured objects that RL leaves come from the last, untrained "
        "steps (docs/reward_hacking.md). Costs one forward and backward of the policy and one "
        "forward of the reference per anchored step.", default=0.0)
    anchor_steps: int = _help(
        "Untrained steps per rollout chunk that training.anchor_beta anchors, drawn uniformly "
        "without replacement among the chunk's untrained steps (seeded by seed, iteration and "
        "chunk).", default=1)
    anchor_sigma_max: float = _help(
        "Anchor only untrained steps whose sigma is at most this, in (0, 1] (1 = every untrained "
        "step). Fine detail is drawn at low noise: on the toy the artifacts come from the steps "
        "below sigma 0.45, while the steps between the trained ones and those carry the "
        "learned behaviour usefully (docs/reward_hacking.md).", default=1.0)
    kl_convention: str = _help(
        "What the KL divides by: 'exact' (the step's total std: the Gaussian KL per dim) or "
        "'flow_grpo' (the anchor's std_dev_t, s without sqrt(dt): Flow-GRPO's formula, the exact "
        "KL times sigma - sigma_next; use it with Flow-GRPO's beta).", default="exact")
    kl_reward: float = _help(
        "Flow-GRPO's KL reward: subtract kl_reward * KL (the step KL of kl_convention to the "
        "reference, averaged over the sample's trained steps, computed during the rollout) from "
        "the total reward before the advantages (0 = off; needs rewards.aggregation: "
        "weighted_sum).", default=0.0)
    adv_scale: str = _help("Advantage normalisation: group | batch | none (Dr.GRPO).", default="group")
    adv_ddof: int = _help("Std degrees of freedom: 0 (Flow-GRPO) or 1 (TRL, DanceGRPO).", default=0)
    adv_eps: float = _help("Added to the std.", default=1e-4)
    adv_clip: float = _help("Clip advantages to [-adv_clip, adv_clip] (0 disables).", default=5.0)
    num_inner_epochs: int = _help("Passes over each rollout batch.", default=1)
    gradient_accumulation_steps: int = _help(
        "Replay batches per optimiser step on each process; 0 = all of an inner epoch (one step "
        "per epoch, which makes the update the same on any number of processes). One step per "
        "epoch scores every replay before the only step: the ratio is 1 and clipping never acts.",
        default=0)
    optimizer_steps_per_epoch: int = _help(
        "Optimiser steps per inner epoch (Flow-GRPO: 2; MixGRPO: 4; Flash-GRPO: 2); when > 0 it "
        "sets gradient_accumulation_steps at start to ceil(replay batches per process / this), "
        "from the batch, rollout_batch_size, plan and process count (at most this many steps; "
        "exactly this many when the count divides). 0 = use gradient_accumulation_steps.",
        default=0)
    ratio_norm: bool = _help("GRPO-Guard RatioNorm on the log-ratio.", default=False)
    dt_reweight: bool = _help("GRPO-Guard 1/dt gradient reweighting (normalised by batch mean).",
                              default=False)
    rectification: bool = _help("Flash-GRPO temporal rectification weights kappa(t).", default=False)
    dt_reweight_norm: str = _help(
        "How dt_reweight scales a replay batch's loss: 'iteration' (1/dt divided by its mean "
        "over the iteration's trained transitions on every process: the lr keeps its meaning) "
        "or 'batch_mean' (GRPO-Guard's released loss: divided by mean_b(sqrt(sigma - "
        "sigma_next))^2 over the replay batch, not normalised).", default="iteration")
    loss_scale: str = _help(
        "Extra factor on each replay batch's policy loss (not the KL): 'none', or "
        "'std_over_sqrt_dt' (Flow-GRPO's Wan loop: mean_b(s) / mean_b(sqrt(sigma - sigma_next)) "
        "over the replay batch, s the step's std_dev_t without sqrt(dt), sde.anchor_std).",
        default="none")
    skip_zero_std_groups: bool = _help(
        "Skip replay of batches whose advantages are all zero (DAPO-style filtering).", default=True)
    mixed_precision: str = _help(
        "accelerate mixed precision: no | fp16 | bf16 (SDE maths stay fp32). fp16 scales the loss "
        "(accelerate's GradScaler): an overflowing step is skipped and the scale lowered.",
        default="no")
    max_consecutive_skipped_steps: int = _help(
        "Abort the run after this many optimiser steps in a row were skipped for a non-finite "
        "gradient (0 = never abort). A skipped step changes neither the weights nor the EMA.",
        default=20)
    ddp_find_unused_parameters: bool = _help(
        "DDP's find_unused_parameters: set it when some trainable parameters get no gradient "
        "in a forward (DDP then stops with 'Expected to have finished reduction').", default=False)
    ema: EmaConfig = _help("EMA of trainable weights.", default_factory=EmaConfig)
    gardo: GardoConfig = _help("Guards against reward hacking (GARDO); all off by default.",
                               default_factory=GardoConfig)


@dataclass
class RewardSpec:
    name: str = _help("Registered reward name or 'package.module:Class'.", default="")
    weight: float = _help("Weight in the sum (or in GDPO's decoupled sum).", default=1.0)
    options: dict[str, Any] = _help("Constructor options of the reward.", default_factory=dict)


@dataclass
class RewardsConfig:
    components: list[RewardSpec] = _help("Rewards to combine.", default_factory=list)
    aggregation: str = _help("weighted_sum (then group-normalise) | decoupled (GDPO) | "
                             "decoupled_sum (MixGRPO's advantage_aggr: GDPO without the final "
                             "batch normalisation).",
                             default="weighted_sum")
    threaded: bool = _help("Score each rollout batch in a thread while the next one rolls out.",
                           default=True)
    saturation_ratio: float = _help(
        "Saturation weighting of several components (after the idea of TaRoS; 0 = off): in each "
        "group, component k's weight is scaled by min(1, its std in the group / (ratio * its std "
        "over the batch)), so a component that no longer separates a group stops dominating its "
        "advantage. In (0, 1], e.g. 0.5; needs >= 2 weighted components.", default=0.0)


@dataclass
class LLMConfig:
    """Causal-LM policy options (``policy: llm``); the model is ``model.path``."""

    max_new_tokens: int = _help("Completion length limit.", default=32)
    temperature: float = _help("Sampling temperature of rollouts.", default=1.0)
    top_p: float = _help("Nucleus sampling threshold.", default=1.0)
    aggregation: str = _help("Token-loss aggregation: grpo | bnpo | dr_grpo | dapo.", default="grpo")
    level: str = _help("Importance ratio level: token (GRPO) | sequence (GSPO).", default="token")
    dynamic_sampling: bool = _help("DAPO: drop zero-variance groups and resample until the batch is "
                                   "full (bounded by max_resample_rounds).", default=False)
    max_resample_rounds: int = _help("Upper bound on dynamic-sampling rounds.", default=3)
    overlong_buffer: int = _help("DAPO soft overlong punishment window in tokens (0 = off).",
                                 default=0)
    overlong_penalty: float = _help("Penalty at max_new_tokens for the overlong shaping.",
                                    default=1.0)
    mask_truncated: bool = _help("DAPO: exclude completions that hit max_new_tokens from the loss.",
                                 default=False)
    eval_temperature: float = _help("Temperature at evaluation (0 = greedy).", default=0.0)


@dataclass
class EvalConfig:
    """Held-out metrics: rewards scored on the samples of every evaluation beside the training
    rewards, logged as eval/<key> with the same statistics, and never part of the advantages.
    Every real reward is a proxy; a metric the run does not optimise shows when it is gamed."""

    rewards: list[RewardSpec] = _help(
        "Rewards in the format of rewards.components (name, options; options.label sets the "
        "key, which must differ from every training reward's; weight is ignored), scored on "
        "each evaluation's held-out samples (the same images, scored once). A reward class with "
        "higher_is_better = False (e.g. toy_artifacts) counts as lower-is-better in summaries "
        "and run.select_best_on.", default_factory=list)


@dataclass
class RunConfig:
    seed: int = _help("Seed of every random draw (prompts, noise, plans).", default=0)
    output_dir: str = _help("Runs go to <output_dir>/<name>/.", default="runs")
    max_iterations: int = _help("Iterations (rollout + update) to run.", default=100)
    eval_every: int = _help("Evaluate every N iterations (0 = only at start and end).", default=10)
    checkpoint_every: int = _help("Checkpoint every N iterations (0 = only at the end).", default=10)
    keep_checkpoints: int = _help("Keep the newest N checkpoints (0 = all).", default=3)
    tracker: str = _help("accelerate tracker: tensorboard | wandb | none.", default="tensorboard")
    num_threads: int = _help("torch CPU threads (0 = torch default).", default=0)
    progress: bool = _help("Show a progress bar.", default=True)
    comparison_grid: bool = _help("Write a before/after grid of held-out prompts at the end.",
                                  default=True)
    select_best_on: str | None = _help(
        "Keep the weights of the evaluation where this metric was best in checkpoints/best/ "
        "(never pruned; checkpoints/best.json says which iteration and value), e.g. "
        "eval/geneval_toy.exact/family_mean: a key of the evaluation records, eval/<reward key>"
        "[/<family> | /family_mean], of a reward in rewards.components or eval.rewards. "
        "None = no selection.", default=None)
    select_best_mode: str = _help(
        "Whether larger or smaller values of run.select_best_on are better: max | min | auto "
        "(the reward's higher_is_better, True unless its class says otherwise).", default="auto")
    early_stop_patience: int = _help(
        "Stop the run after this many evaluations in a row without a new best of "
        "run.select_best_on (0 = never stop early). The final checkpoint is saved where it stops.",
        default=0)


@dataclass
class TrainConfig:
    name: str = _help("Run name: outputs go to <run.output_dir>/<name>/.", default="run")
    policy: str = _help("Policy type: flow (image/video generators) | llm (causal LMs).",
                        default="flow")
    model: ModelConfig = _help("The model to train.", default_factory=ModelConfig)
    prompts: PromptsConfig = _help("Prompt sources.", default_factory=PromptsConfig)
    sampling: SamplingConfig = _help("Rollout sampler.", default_factory=SamplingConfig)
    training: TrainingConfig = _help("Optimisation.", default_factory=TrainingConfig)
    rewards: RewardsConfig = _help("Rewards.", default_factory=RewardsConfig)
    run: RunConfig = _help("Run bookkeeping.", default_factory=RunConfig)
    llm: LLMConfig = _help("LLM policy options (policy: llm); see flowgrpo/llm.py.",
                           default_factory=LLMConfig)
    eval: EvalConfig = _help("Held-out metrics scored at every evaluation, never trained on.",
                             default_factory=EvalConfig)


# --------------------------------------------------------------------------- loading

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML value to the annotated type ``tp`` or raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{path}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, path)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    raise ConfigError(f"{path}: unsupported type {tp}")


def _build(cls: type, data: dict, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]!s}; valid keys under "
                          f"'{path or 'top level'}': {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["training.lr=1e-4", "run.seed=3"]`` -> [(dotted key, YAML-parsed value)]."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        parsed.append((key.strip(), yaml.safe_load(raw) if raw.strip() else ""))
    return parsed


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                data: dict | None = None) -> TrainConfig:
    """Read a YAML file (or ``data``), apply dotted overrides, build and validate the config."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    if data is not None:
        # Deep-copied so that overrides never write into the caller's dicts.
        raw = _merge(raw, copy.deepcopy(data))
    for key, value in parse_overrides(overrides or []):
        _set_dotted(raw, key, value)
    config = _build(TrainConfig, raw, "")
    validate(config)
    return config


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def to_dict(config: Any) -> Any:
    """Plain-Python (YAML-safe) form of a config."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def is_secret_name(key: Any) -> bool:
    """Whether an option called ``key`` holds a secret (token, api_key, password, secret; any
    case, "-" or "_", and names ending in "_token" etc.). ``token_env`` names a variable, not a
    secret, and stays visible."""
    if not isinstance(key, str):
        return False
    name = key.lower().replace("-", "_")
    return name in SECRET_OPTION_NAMES or name.endswith(tuple(f"_{s}" for s in SECRET_OPTION_NAMES))


def redact(tree: Any) -> Any:
    """A copy of a plain config tree (``to_dict``) with every secret-named value, at any depth,
    replaced by ``REDACTED``: what config dumps and trackers get."""
    if isinstance(tree, dict):
        return {k: (REDACTED if is_secret_name(k) and v is not None else redact(v))
                for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [redact(v) for v in tree]
    return tree


def dump_config(config: TrainConfig, path: str | Path) -> None:
    """Write the config as YAML with secrets redacted (``redact``): the file is for reading and
    re-running, and a token in it would leak to whoever can read the run folder."""
    Path(path).write_text(yaml.safe_dump(redact(to_dict(config)), sort_keys=False))


def resume_signature(config: TrainConfig) -> dict[str, Any]:
    """The config fields a checkpoint's weights and optimiser state are only valid for: the
    model, the LoRA layout and the sampling plan. Stored in every checkpoint and compared on
    resume (``checkpoint.open_run``); everything else (lr, iterations, logging) may change."""
    m = config.model
    return {
        "policy": config.policy,
        "model.family": m.family,
        "model.path": m.path,
        "model.lora.enabled": m.lora.enabled,
        "model.lora.rank": m.lora.rank if m.lora.enabled else None,
        "model.lora.alpha": m.lora.alpha if m.lora.enabled else None,
        "model.lora.target_modules": (list(m.lora.target_modules)
                                      if m.lora.enabled and m.lora.target_modules is not None
                                      else None),
        "sampling.num_steps": config.sampling.num_steps,
        "sampling.plan": to_dict(config.sampling.plan) if config.policy == "flow" else None,
    }


def eval_noise_seed(config: TrainConfig) -> int:
    """The seed of the evaluation noise: ``prompts.eval_seed``, or ``run.seed`` when it is None."""
    seed = config.prompts.eval_seed
    return config.run.seed if seed is None else seed


def json_roundtrip(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists), for comparisons with what a
    checkpoint stored."""
    import json

    return json.loads(json.dumps(value))


# --------------------------------------------------------------------------- validation

def _choice(value: str, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)} (got {value!r})")


def _positive(value: float, name: str, allow_zero: bool = False) -> None:
    # "not value > 0" rather than "value <= 0": NaN fails every comparison and must not pass.
    if not (value > 0 or (allow_zero and value == 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be {bound} (got {value})")


def _in_range(value: float, low: float, high: float, name: str, *, low_open: bool = False,
              high_open: bool = False, meaning: str = "") -> None:
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{name} must be in {interval}{meaning} (got {value})")


def _check_finite(node: Any, path: str = "") -> None:
    """Every float field of the config tree must be finite: NaN passes every ``<``/``>`` range
    check, and an inf lr or noise level turns the whole run into NaN without an error."""
    if not dataclasses.is_dataclass(node):
        return
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        name = f"{path}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, name + ".")
            continue
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for index, item in items:
            where = name if index is None else f"{name}[{index}]"
            if dataclasses.is_dataclass(item):    # rewards.components[i]
                _check_finite(item, where + ".")
            elif isinstance(item, float) and not math.isfinite(item):
                default = (f.default if f.default is not dataclasses.MISSING
                           else f.default_factory())
                raise ConfigError(f"{where} must be a finite number (got {item}); set a finite "
                                  f"value (default {default!r}; see flowgrpo train --help-config)")


def _registry_choices() -> dict[str, tuple[str, ...]]:
    """Allowed values of the choice fields, read from the registries that consume them (one
    source: adding a model family, policy or scaling there makes it valid here). Imported on
    use: each import is light (no model libraries), and the policy module imports this one."""
    from flowgrpo.advantages import SCALES
    from flowgrpo.losses import KL_CONVENTIONS, TOKEN_AGGREGATIONS, TOKEN_LEVELS
    from flowgrpo.policy import POLICIES
    from flowgrpo.sde import KINDS, LOG_PROBS
    from pipelines import MODEL_FAMILIES
    from reward_models.multi import AGGREGATIONS

    return {
        "policy": tuple(POLICIES),
        "model.family": tuple(MODEL_FAMILIES),
        # "ode" is the deterministic evaluation step: it has no log-probability to train on.
        "sampling.kind": tuple(k for k in KINDS if k != "ode"),
        "sampling.log_prob": tuple(LOG_PROBS),
        "sampling.sigma_schedule": SIGMA_SCHEDULES,
        "training.kl_convention": tuple(KL_CONVENTIONS),
        "training.adv_scale": tuple(SCALES),
        "training.lr_decay": LR_DECAYS,
        "rewards.aggregation": tuple(AGGREGATIONS),
        "llm.aggregation": tuple(TOKEN_AGGREGATIONS),
        "llm.level": tuple(TOKEN_LEVELS),
    }


def _check_reward_names(config: TrainConfig) -> None:
    """Flow rewards resolve through reward_models' registry (built-ins, @register_reward
    classes, entry points): an unknown plain name fails here, before any model loads.
    ``package.module:Class`` paths are imported only when the reward loads."""
    if config.policy != "flow":
        return   # the llm policy has its own text rewards, checked by flowgrpo/llm.py
    from reward_models.loading import available_rewards

    known = None
    for i, spec in enumerate(config.rewards.components):
        if not spec.name or ":" in spec.name:
            continue
        known = known if known is not None else available_rewards()
        if spec.name not in known:
            raise ConfigError(f"rewards.components[{i}].name: unknown reward {spec.name!r}; "
                              f"available: {', '.join(known)}; or give your own class as "
                              f"'package.module:Class'")
        members = spec.options.get("members") if spec.name == "ensemble" else None
        for j, member in enumerate(members if isinstance(members, list) else []):
            name = member.get("name") if isinstance(member, dict) else member
            if isinstance(name, str) and ":" not in name and name not in known:
                raise ConfigError(f"rewards.components[{i}].options.members[{j}]: unknown "
                                  f"reward {name!r}; available: {', '.join(known)}; or give "
                                  f"your own class as 'package.module:Class'")


SELECT_BEST_MODES = ("max", "min", "auto")
# What the LM policy's evaluation reports besides its rewards, as eval/<key> (flowgrpo/llm.py).
LLM_EVAL_KEYS = ("accuracy", "completion_length", "truncated_fraction")


def reward_key(spec: RewardSpec) -> str:
    """The key a spec's scores are logged under, as far as the config tells: ``options.label``,
    else the name (for ``module:Class``, the class's name; such a class may name itself
    otherwise, so the loaded rewards' keys are compared again when they load)."""
    label = spec.options.get("label")
    if label is not None:
        return label if isinstance(label, str) else repr(label)
    return spec.name.rpartition(":")[2].rpartition(".")[2] if ":" in spec.name else spec.name


def training_reward_keys(config: TrainConfig) -> set[str]:
    """Keys the evaluation logs for the training rewards (eval/<key>): every component's key,
    ``total``, and for the LM policy its other metrics and DAPO's ``overlong`` shaping."""
    keys = {reward_key(spec) for spec in config.rewards.components} | {"total"}
    if config.policy == "llm":
        keys |= set(LLM_EVAL_KEYS)
        if config.llm.overlong_buffer > 0:
            keys.add("overlong")
    return keys


def _known_reward_names(policy: str) -> list[str]:
    """Reward names a plain (not ``module:Class``) spec may use: image/video rewards for the
    flow policy, text rewards (``reward_models.text``) for the LM policy; entry points for both."""
    from reward_models.loading import _entry_points, available_rewards

    if policy == "flow":
        return available_rewards()
    import reward_models.text  # noqa: F401  (registers the text rewards)
    from reward_models.base import REGISTRY

    return sorted({n for n, path in REGISTRY.items() if path.startswith("reward_models.text:")}
                  | set(_entry_points()))


def _check_eval_rewards(config: TrainConfig) -> None:
    """eval.rewards: known names, keys that are distinct and differ from the training rewards'
    (both would be logged as eval/<key>), and an evaluation to score."""
    specs = config.eval.rewards
    if not specs:
        return
    if config.prompts.eval is None:
        raise ConfigError("eval.rewards scores the evaluation's samples, but prompts.eval is "
                          "null (no evaluation): set prompts.eval to held-out prompts, or remove "
                          "eval.rewards")
    known = None
    training = training_reward_keys(config)
    trained = {reward_key(spec) for spec in config.rewards.components}
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if not spec.name:
            raise ConfigError(f"eval.rewards[{i}].name is empty: give a registered reward name "
                              f"or 'package.module:Class'")
        if ":" not in spec.name:
            known = known if known is not None else _known_reward_names(config.policy)
            if spec.name not in known:
                kind = "text reward" if config.policy == "llm" else "reward"
                raise ConfigError(f"eval.rewards[{i}].name: unknown {kind} {spec.name!r}; "
                                  f"available: {', '.join(known)}; or give your own class as "
                                  f"'package.module:Class'")
        key = reward_key(spec)
        if not key or "." in key or "/" in key:
            raise ConfigError(f"eval.rewards[{i}].options.label {key!r} must be a non-empty "
                              f"name without '.' or '/' (it becomes the metric eval/<label>)")
        if key in training:
            taken_by = ("a reward of rewards.components" if key in trained else
                        "a metric the evaluation reports itself")
            raise ConfigError(f"eval.rewards[{i}] ({spec.name}) would be logged as eval/{key}, "
                              f"which is already {taken_by}: give it another key with "
                              f"options: {{label: {key}_heldout}}")
        if key in seen:
            raise ConfigError(f"eval.rewards[{i}] and eval.rewards[{seen[key]}] are both logged "
                              f"as eval/{key}: give one of them another key with options.label")
        seen[key] = i


def _check_select_best(config: TrainConfig) -> None:
    """run.select_best_on names a metric the evaluation logs, of a training or held-out reward;
    run.early_stop_patience needs it."""
    run = config.run
    _choice(run.select_best_mode, SELECT_BEST_MODES, "run.select_best_mode")
    _positive(run.early_stop_patience, "run.early_stop_patience", allow_zero=True)
    key = run.select_best_on
    if key is None:
        if run.early_stop_patience:
            raise ConfigError("run.early_stop_patience counts evaluations without a new best of "
                              "run.select_best_on, which is null: set run.select_best_on (e.g. "
                              "eval/<reward key>/family_mean) or early_stop_patience: 0")
        return
    if config.prompts.eval is None:
        raise ConfigError("run.select_best_on needs evaluations, but prompts.eval is null: set "
                          "prompts.eval to held-out prompts, or run.select_best_on: null")
    keys = training_reward_keys(config) | {reward_key(s) for s in config.eval.rewards}
    valid = ", ".join(f"eval/{k}" for k in sorted(keys))
    rest = key[len("eval/"):] if key.startswith("eval/") else ""
    head = rest.split("/")[0].split(".")[0]
    # A 'module:Class' reward without a label may name itself otherwise than its class: its key
    # is known once it loads (the trainer checks the first evaluation's record then).
    unsure = any(":" in s.name and "label" not in s.options
                 for s in [*config.rewards.components, *config.eval.rewards])
    if not rest or (head not in keys and not unsure):
        raise ConfigError(f"run.select_best_on {key!r} is not a metric of a reward this run "
                          f"evaluates: it must start with one of {valid} (then optionally "
                          f".<component>, /<family> or /family_mean)")
    if key.endswith("/se"):
        raise ConfigError(f"run.select_best_on {key!r} is a standard error, not a metric: drop "
                          f"the /se")


def validate(config: TrainConfig, num_processes: int = 1) -> None:
    """Check ranges and combinations. Raises ConfigError naming the field and the fix."""
    _check_finite(config)
    choices = _registry_choices()
    _choice(config.policy, choices["policy"], "policy")
    if not config.name or config.name in (".", "..") or any(c in config.name for c in "/\\\0"):
        raise ConfigError(f"name must be a non-empty folder name without '/', '\\' and not '.' "
                          f"or '..' (got {config.name!r}): it names the run folder "
                          f"<run.output_dir>/<name>")
    m = config.model
    if config.policy == "flow":
        _choice(m.family, choices["model.family"], "model.family")
    _choice(m.dtype, ("float32", "bfloat16", "float16"), "model.dtype")
    if m.lora.enabled:
        _positive(m.lora.rank, "model.lora.rank")
        _positive(m.lora.alpha, "model.lora.alpha")
        _choice(m.lora.init, ("gaussian", "default"), "model.lora.init")
        if m.lora.target_modules is not None and not m.lora.target_modules:
            raise ConfigError("model.lora.target_modules is an empty list: give module names, or "
                              "null for the model family's default list")
    cur = config.prompts.curriculum
    if cur.enabled:
        if config.policy != "flow":
            raise ConfigError("prompts.curriculum.enabled is only supported for policy: flow "
                              "(the llm trainer resamples prompts itself); set it to false")
        _positive(cur.floor, "prompts.curriculum.floor", allow_zero=True)
        if not 0 <= cur.prior <= 1:
            raise ConfigError(f"prompts.curriculum.prior is a probability and must be in [0, 1] "
                              f"(got {cur.prior})")
        _positive(cur.prior_strength, "prompts.curriculum.prior_strength")
        if not 0 < cur.decay <= 1:
            raise ConfigError(f"prompts.curriculum.decay must be in (0, 1] (1 = plain counts; "
                              f"got {cur.decay})")
        if cur.floor == 0 and cur.prior == 0:
            raise ConfigError("prompts.curriculum.floor and prompts.curriculum.prior are both 0, "
                              "so every prompt starts with weight 0: make floor > 0 or prior > 0")
    p = config.prompts
    from flowgrpo.prompts import PROMPT_SUFFIXES

    for key, source in (("prompts.train", p.train), ("prompts.eval", p.eval)):
        if source is not None and not source.startswith("toy:") and \
                Path(source).suffix.lower() not in PROMPT_SUFFIXES:
            raise ConfigError(f"{key}: {source} is not a prompt source; give a .txt file (one "
                              f"prompt a line), a .jsonl file ({{\"prompt\": ..., \"metadata\": "
                              f"...}} a line) or toy:train / toy:heldout")
    _positive(p.num_eval, "prompts.num_eval", allow_zero=True)
    _positive(p.eval_seeds, "prompts.eval_seeds")
    _positive(p.eval_per_family, "prompts.eval_per_family", allow_zero=True)
    if p.eval_seed is not None and p.eval_seed < 0:
        raise ConfigError(f"prompts.eval_seed must be >= 0, or null to use run.seed "
                          f"(got {p.eval_seed})")
    s = config.sampling
    _positive(s.num_steps, "sampling.num_steps")
    _positive(s.eval_num_steps, "sampling.eval_num_steps")
    _choice(s.kind, choices["sampling.kind"], "sampling.kind")
    _positive(s.noise_level, "sampling.noise_level", allow_zero=True)
    if s.kind == "cps" and s.noise_level > 1:
        raise ConfigError(f"sampling.noise_level is the CPS angle fraction a and must be in [0, 1] "
                          f"(got {s.noise_level})")
    _choice(s.log_prob, choices["sampling.log_prob"], "sampling.log_prob")
    if s.log_prob == "unscaled" and s.kind != "cps":
        raise ConfigError(f"sampling.log_prob: unscaled is Flow-GRPO's CPS log-prob and needs "
                          f"sampling.kind: cps (got kind {s.kind!r}); use log_prob: exact")
    if s.log_prob == "unscaled" and config.training.ratio_norm:
        raise ConfigError("training.ratio_norm (GRPO-Guard) needs the exact log-prob: set "
                          "sampling.log_prob: exact or training.ratio_norm: false")
    _choice(s.sigma_schedule, choices["sampling.sigma_schedule"], "sampling.sigma_schedule")
    _positive(s.sigma_shift, "sampling.sigma_shift")
    _in_range(s.sigma_schedule_start, 0.0, 1.0, "sampling.sigma_schedule_start", low_open=True,
              meaning=" (the first unshifted point of sigma_schedule: shifted_linear)")
    _positive(s.rollout_batch_size, "sampling.rollout_batch_size")
    if config.policy == "flow":
        try:
            s.plan.validate(s.num_steps)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    t = config.training
    _positive(t.prompts_per_iteration, "training.prompts_per_iteration")
    _positive(t.group_size, "training.group_size")
    _choice(t.adv_scale, choices["training.adv_scale"], "training.adv_scale")
    if t.group_size == 1 and t.adv_scale in ("group", "batch"):
        raise ConfigError("training.group_size is 1, so group statistics are undefined: use "
                          "group_size >= 2 (GRPO needs several samples per prompt)")
    _positive(t.lr, "training.lr")
    _positive(t.lr_warmup_iterations, "training.lr_warmup_iterations", allow_zero=True)
    _choice(t.lr_decay, choices["training.lr_decay"], "training.lr_decay")
    _positive(t.weight_decay, "training.weight_decay", allow_zero=True)
    for i, beta in enumerate(t.adam_betas):
        _in_range(beta, 0.0, 1.0, f"training.adam_betas[{i}]", high_open=True,
                  meaning=" (AdamW's moment decays, e.g. [0.9, 0.999])")
    _positive(t.adam_eps, "training.adam_eps")
    _positive(t.max_grad_norm, "training.max_grad_norm", allow_zero=True)
    _positive(t.adv_eps, "training.adv_eps", allow_zero=True)
    _positive(t.adv_clip, "training.adv_clip", allow_zero=True)
    if not 0.0 <= t.lr_final_ratio <= 1.0:
        raise ConfigError(f"training.lr_final_ratio must be in [0, 1] (got {t.lr_final_ratio}); "
                          "it is the final lr as a share of training.lr")
    _positive(t.clip_low, "training.clip_low")
    if t.clip_low > 1:
        raise ConfigError(f"training.clip_low must be <= 1 so that 1 - clip_low >= 0 "
                          f"(got {t.clip_low})")
    if t.clip_high is not None:
        _positive(t.clip_high, "training.clip_high")
    _positive(t.kl_beta, "training.kl_beta", allow_zero=True)
    _positive(t.anchor_beta, "training.anchor_beta", allow_zero=True)
    _positive(t.anchor_steps, "training.anchor_steps")
    _in_range(t.anchor_sigma_max, 0.0, 1.0, "training.anchor_sigma_max", low_open=True,
              meaning=" (the largest sigma of an anchored step)")
    if t.anchor_beta > 0 and config.policy != "flow":
        raise ConfigError("training.anchor_beta anchors denoising steps of a flow policy; set it "
                          "to 0 for policy: llm")
    _choice(t.kl_convention, choices["training.kl_convention"], "training.kl_convention")
    _choice(t.dt_reweight_norm, ("iteration", "batch_mean"), "training.dt_reweight_norm")
    _choice(t.loss_scale, ("none", "std_over_sqrt_dt"), "training.loss_scale")
    if t.loss_scale == "std_over_sqrt_dt" and s.kind == "cps":
        raise ConfigError("training.loss_scale std_over_sqrt_dt divides the SDE's s by "
                          "sqrt(dt), which CPS does not have (its std is sigma_next sin(a pi/2)): "
                          "set training.loss_scale: none or use an SDE sampling.kind")
    _positive(t.kl_reward, "training.kl_reward", allow_zero=True)
    if t.kl_reward > 0 and config.rewards.aggregation != "weighted_sum":
        raise ConfigError(f"training.kl_reward subtracts the KL from the total reward, which "
                          f"rewards.aggregation: {config.rewards.aggregation} does not use: set "
                          f"rewards.aggregation: weighted_sum or training.kl_reward: 0")
    if t.adv_ddof not in (0, 1):
        raise ConfigError(f"training.adv_ddof must be 0 or 1 (got {t.adv_ddof})")
    _positive(t.num_inner_epochs, "training.num_inner_epochs")
    _positive(t.gradient_accumulation_steps, "training.gradient_accumulation_steps", allow_zero=True)
    _positive(t.optimizer_steps_per_epoch, "training.optimizer_steps_per_epoch", allow_zero=True)
    if t.optimizer_steps_per_epoch and config.policy != "flow":
        raise ConfigError("training.optimizer_steps_per_epoch is for policy: flow (it counts "
                          "replay batches); set training.gradient_accumulation_steps instead")
    if config.policy != "flow" and (t.kl_reward or s.sigma_schedule != "model"):
        raise ConfigError("training.kl_reward and sampling.sigma_schedule are for policy: flow; "
                          "leave them at 0 / model")
    _choice(t.mixed_precision, ("no", "fp16", "bf16"), "training.mixed_precision")
    _positive(t.max_consecutive_skipped_steps, "training.max_consecutive_skipped_steps",
              allow_zero=True)
    if t.mixed_precision == "fp16" and not m.lora.enabled and m.dtype == "float16":
        raise ConfigError("training.mixed_precision fp16 with full fine-tuning needs float32 "
                          "master weights (the loss scaler cannot unscale fp16 gradients): set "
                          "model.dtype: float32 (autocast still computes in fp16), or use LoRA")
    if t.ema.enabled and not 0 < t.ema.decay < 1:
        raise ConfigError(f"training.ema.decay must be in (0, 1) (got {t.ema.decay})")
    if t.ema.every < 1:
        raise ConfigError(f"training.ema.every must be >= 1 optimiser steps (got {t.ema.every}); "
                          f"1 updates the EMA after every step")
    from flowgrpo.ema import EMA_WARMUPS

    _choice(t.ema.warmup, EMA_WARMUPS, "training.ema.warmup")
    _positive(t.ema.updates_per_step, "training.ema.updates_per_step", allow_zero=True)
    if t.ema.warmup == "updates" and t.ema.updates_per_step != 1:
        raise ConfigError(f"training.ema.updates_per_step={t.ema.updates_per_step} repeats the "
                          f"updates of warmup optimizer_steps (Flow-GRPO's); with warmup "
                          f"updates set it to 1, or set training.ema.warmup: optimizer_steps")
    total = t.prompts_per_iteration * t.group_size
    if total % num_processes:
        raise ConfigError(
            f"training.prompts_per_iteration * training.group_size = {total} samples must divide "
            f"evenly over {num_processes} processes: change prompts_per_iteration or group_size")
    r = config.rewards
    _choice(r.aggregation, choices["rewards.aggregation"], "rewards.aggregation")
    if config.policy == "flow" and not r.components:
        raise ConfigError("rewards.components is empty: add at least one reward, e.g. "
                          "[{name: geneval_toy}]")
    for i, spec in enumerate(r.components):
        if not spec.name:
            raise ConfigError(f"rewards.components[{i}].name is empty: give a registered reward "
                              f"name or 'package.module:Class'")
    _check_reward_names(config)
    _check_eval_rewards(config)
    if config.policy == "llm":
        llm = config.llm
        _choice(llm.aggregation, choices["llm.aggregation"], "llm.aggregation")
        _choice(llm.level, choices["llm.level"], "llm.level")
        _positive(llm.max_new_tokens, "llm.max_new_tokens")
        _positive(llm.temperature, "llm.temperature")
        if not 0 < llm.top_p <= 1:
            raise ConfigError(f"llm.top_p must be in (0, 1] (got {llm.top_p})")
        _positive(llm.max_resample_rounds, "llm.max_resample_rounds", allow_zero=True)
        _in_range(llm.overlong_buffer, 0, llm.max_new_tokens, "llm.overlong_buffer",
                  meaning=" (tokens before llm.max_new_tokens; 0 = off)")
        _positive(llm.overlong_penalty, "llm.overlong_penalty", allow_zero=True)
        _positive(llm.eval_temperature, "llm.eval_temperature", allow_zero=True)
    _check_guards(config)
    run = config.run
    _positive(run.max_iterations, "run.max_iterations")
    _positive(run.eval_every, "run.eval_every", allow_zero=True)
    _positive(run.checkpoint_every, "run.checkpoint_every", allow_zero=True)
    _positive(run.keep_checkpoints, "run.keep_checkpoints", allow_zero=True)
    _positive(run.num_threads, "run.num_threads", allow_zero=True)
    if not run.output_dir:
        raise ConfigError("run.output_dir is empty: give the folder that holds run folders, "
                          "e.g. runs")
    _choice(run.tracker, ("tensorboard", "wandb", "none"), "run.tracker")
    _check_select_best(config)


def reward_output_keys(config: TrainConfig) -> dict[str, tuple[str, ...] | None] | None:
    """The main-score keys the config's rewards will output, each with its known component
    names (None: known only once the reward loads), plus "total"; None when some key itself is
    known only at load (a ``module:Class`` reward without a ``label``)."""
    keys: dict[str, tuple[str, ...] | None] = {"total": ()}
    for spec in config.rewards.components:
        label = spec.options.get("label")
        if label is None and ":" in spec.name:
            return None
        key = label if label is not None else spec.name
        components = None
        if spec.name == "ensemble" and isinstance(spec.options.get("members"), list):
            from reward_models.ensemble import ENSEMBLE_KEYS, member_keys

            try:
                components = (*ENSEMBLE_KEYS, *member_keys(spec.options["members"]))
            except (TypeError, ValueError):
                components = None   # the ensemble reports its own error when it loads
        keys[key] = components
    return keys


def check_reward_key(key: str, field_name: str, known: dict[str, tuple[str, ...] | None]) -> None:
    """ConfigError naming ``field_name`` unless ``key`` ('<key>' or '<key>.<component>') can be
    one of the reward outputs ``known`` (``reward_output_keys``, or the loaded rewards' keys)."""
    main, _, component = key.partition(".")
    if main not in known:
        raise ConfigError(f"{field_name}: {key!r} names no reward output; the rewards output "
                          f"{', '.join(sorted(known))} (and '<key>.<component>' for rewards with "
                          f"components): use one of them")
    components = known[main]
    if component and components is not None and component not in components:
        listed = ", ".join(f"{main}.{c}" for c in components) or f"none for {main!r}"
        raise ConfigError(f"{field_name}: reward {main!r} has no component {component!r}; its "
                          f"components: {listed}")


def _check_guards(config: TrainConfig) -> None:
    """training.gardo and rewards.saturation_ratio: ranges, what each guard needs, and the
    reward keys they name (as far as the config tells them)."""
    g, t, r = config.training.gardo, config.training, config.rewards
    flow_only = []
    if g.kl_gate:
        flow_only.append("training.gardo.kl_gate_key / kl_gate_auxiliary")
    if g.refresh:
        flow_only.append("training.gardo.refresh_every / refresh_kl")
    if g.diversity:
        flow_only.append("training.gardo.diversity")
    if flow_only and config.policy != "flow":
        raise ConfigError(f"{flow_only[0]} is for policy: flow (the guards act on flow "
                          f"transitions and images); switch it off for policy: {config.policy}")
    _in_range(g.kl_gate_fraction, 0.0, 1.0, "training.gardo.kl_gate_fraction",
              meaning=" (the share of the batch the gated KL applies to)")
    if g.kl_gate_key is not None and g.kl_gate_auxiliary:
        raise ConfigError("training.gardo.kl_gate_key and training.gardo.kl_gate_auxiliary are "
                          "two uncertainty sources for the KL gate: set one of them")
    if g.kl_gate and t.kl_beta == 0:
        raise ConfigError("training.gardo.kl_gate_key / kl_gate_auxiliary gate the KL term, but "
                          "training.kl_beta is 0: set kl_beta > 0 (e.g. 0.04) or remove the gate")
    known = reward_output_keys(config) if config.policy == "flow" else None
    if g.kl_gate_key is not None:
        if not g.kl_gate_key:
            raise ConfigError("training.gardo.kl_gate_key is empty: give a reward output key "
                              "such as 'ensemble.std', or null for no gate")
        if known is not None:
            check_reward_key(g.kl_gate_key, "training.gardo.kl_gate_key", known)
    for i, key in enumerate(g.kl_gate_auxiliary):
        if not key or key == "total":
            raise ConfigError(f"training.gardo.kl_gate_auxiliary[{i}] is {key!r}: give another "
                              f"reward's key (the total is what the gate compares against)")
        if known is not None:
            check_reward_key(key, f"training.gardo.kl_gate_auxiliary[{i}]", known)
    _positive(g.refresh_every, "training.gardo.refresh_every", allow_zero=True)
    _positive(g.refresh_kl, "training.gardo.refresh_kl", allow_zero=True)
    if g.refresh and t.kl_beta == 0 and t.kl_reward == 0:
        raise ConfigError("training.gardo.refresh_every / refresh_kl refresh the KL reference, "
                          "which no term uses: set training.kl_beta > 0 (or kl_reward > 0), or "
                          "set refresh_every and refresh_kl to 0")
    if g.diversity:
        _positive(g.diversity_feature_size, "training.gardo.diversity_feature_size")
        source = g.diversity_features
        if source != "pixels" and (":" not in source or source.startswith(":")
                                   or source.endswith(":")):
            raise ConfigError(f"training.gardo.diversity_features must be 'pixels' or "
                              f"'package.module:Class' (got {source!r})")
    ratio = r.saturation_ratio
    if ratio != 0:
        _in_range(ratio, 0.0, 1.0, "rewards.saturation_ratio", low_open=True,
                  meaning=" (0 = off)")
        # the llm policy adds DAPO's overlong shaping as one more weighted component
        weighted = sum(spec.weight != 0 for spec in r.components) + int(
            config.policy == "llm" and config.llm.overlong_buffer > 0)
        if weighted < 2:
            raise ConfigError(f"rewards.saturation_ratio weighs several reward components "
                              f"against each other, and {weighted} component(s) have a "
                              f"non-zero weight: add components or set saturation_ratio: 0")
        from flowgrpo.advantages import REWARD_AGGREGATIONS

        if r.aggregation not in REWARD_AGGREGATIONS:
            raise ConfigError(f"rewards.saturation_ratio composes with rewards.aggregation "
                              f"{', '.join(REWARD_AGGREGATIONS)} (got {r.aggregation!r}): use one "
                              f"of them or set saturation_ratio: 0")
        if t.kl_reward > 0:
            raise ConfigError("rewards.saturation_ratio recomputes the total from the weighted "
                              "components, which would drop training.kl_reward's KL term: set "
                              "one of them to 0")


def help_text(cls: type = TrainConfig, prefix: str = "") -> str:
    """One line per field: dotted name, type, default and help (``--help-config``)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{name}: {f.metadata.get('help', '')}")
            lines.append(help_text(tp, name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {name} ({_type_name(tp)}, default {default!r}): {f.metadata.get('help', '')}")
    return "\n".join(lines)
