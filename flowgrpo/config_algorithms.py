"""The ``training`` sub-sections of the algorithms that train on final samples (DiffusionNFT,
AWM, DGPO, Diffusion-DPO, GDRO; ``flowgrpo/algorithms/``): typed fields with their help texts
and their own rules. ``training.algorithm`` picks the algorithm; only its section is read."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowgrpo.checks import Section, choice, config_field, in_range, positive
from flowgrpo.errors import ConfigError
from flowgrpo.matching_losses import AWM_WEIGHTINGS, GDRO_LOSSES

# training.algorithm -> what it trains on; the registry (flowgrpo/algorithms/__init__.py) maps
# the names to their classes.
ALGORITHM_NAMES = ("grpo", "nft", "awm", "dgpo", "dpo", "gdro")
TIMESTEP_SAMPLINGS = ("discrete", "uniform", "logit_normal")




def _old_policy_rules(section: Any, prefix: str) -> None:
    positive(section.old_flat_steps, f"{prefix}.old_flat_steps", allow_zero=True)
    positive(section.old_ramp_rate, f"{prefix}.old_ramp_rate", allow_zero=True)
    in_range(section.old_max_decay, 0.0, 1.0, f"{prefix}.old_max_decay", high_open=True,
             meaning=" (the old policy's EMA decay cap; 0 = the current policy)")


@dataclass
class TimestepsConfig(Section):
    count: int = config_field(
        "Noise levels each final sample is trained at per inner epoch (one replay batch each): "
        "DiffusionNFT's reference trains at int(0.99 num_steps) of the sampler's levels; "
        "Flow-Factory's NFT/AWM/DGPO examples use 4-6.", default=4)
    sampling: str = config_field(
        "How the levels are drawn: 'discrete' (distinct levels of the rollout schedule, drawn "
        "per sample without replacement), 'uniform' or 'logit_normal' (continuous, in the "
        "interval the discrete choices span).", default="discrete")
    fraction: float = config_field(
        "The share of the rollout schedule's levels, noisiest first, that may be drawn, in "
        "(0, 1] (0.5: the noisier half).", default=1.0)

    def validate(self) -> None:
        positive(self.count, "training.timesteps.count")
        choice(self.sampling, TIMESTEP_SAMPLINGS, "training.timesteps.sampling")
        in_range(self.fraction, 0.0, 1.0, "training.timesteps.fraction", low_open=True,
                 meaning=" (the share of the schedule's levels that may be drawn)")


@dataclass
class NFTConfig(Section):
    beta: float = config_field(
        "DiffusionNFT's beta: the implicit policies are beta v + (1 - beta) v_old and (1 + beta) "
        "v_old - beta v, and the loss is divided by beta. Reference: 1.0 (GenEval, PickScore), "
        "0.1 (OCR).", default=1.0)
    old_flat_steps: int = config_field(
        "Optimiser steps during which the old policy is the current one (decay 0). Reference: 0 "
        "(decay_type 1) or 75 (decay_type 2).", default=0)
    old_ramp_rate: float = config_field(
        "The old policy's EMA decay grows by this per optimiser step after old_flat_steps. "
        "Reference: 0.001 (decay_type 1) or 0.0075 (decay_type 2).", default=0.001)
    old_max_decay: float = config_field(
        "Cap of the old policy's EMA decay. Reference: 0.5 (decay_type 1) or 0.999 (decay_type "
        "2). The old policy is updated once per iteration, after the update, as in the "
        "reference: old <- d old + (1 - d) current.", default=0.5)
    sample_with_old: bool = config_field(
        "Roll out with the old policy (the reference samples with it); False: with the current "
        "weights.", default=True)

    def validate(self) -> None:
        positive(self.beta, "training.nft.beta")
        _old_policy_rules(self, "training.nft")


@dataclass
class AWMConfig(Section):
    weighting: str = config_field(
        "Noise-level weighting of the matching error in AWM's log-prob: uniform | t | t2 | "
        "huber | ghuber (Flow-Factory's SD3.5 example: ghuber with power 0.25).",
        default="ghuber")
    power: float = config_field("The generalised Huber power p of weighting: ghuber.", default=0.25)

    def validate(self) -> None:
        choice(self.weighting, AWM_WEIGHTINGS, "training.awm.weighting")
        positive(self.power, "training.awm.power")


@dataclass
class DGPOConfig(Section):
    beta: float = config_field(
        "DGPO's beta in the group preference z = beta / G sum_i A_i (e_i - e_ref_i). "
        "Flow-Factory's SD3.5 PickScore example: 10.", default=10.0)
    shared_noise: bool = config_field(
        "The samples of a group are re-noised with the same noise (and every row at the same "
        "noise level), as in the reference: the group's errors then differ by their samples "
        "only.", default=True)
    reference: str = config_field(
        "What the preference compares with: 'base' (the frozen initial model / LoRA disabled) "
        "or 'old' (the old policy, an EMA of the trained weights).", default="base")
    clip: bool = config_field(
        "PPO-style clip of each row's error against the old policy: a row whose ratio "
        "exp(e_old - e) left [1 - clip_low, 1 + clip_high] on the side its advantage pushes "
        "gets no gradient (DGPO's clip_dsm; the example's clip range is 0.05).", default=True)
    old_ramp_rate: float = config_field(
        "The old policy's EMA decay per optimiser step.", default=0.001)
    old_max_decay: float = config_field(
        "Cap of the old policy's EMA decay (updated every optimiser "
        "step). DGPO: 0.3.", default=0.3)
    old_flat_steps: int = config_field("Optimiser steps with decay 0 before the ramp.", default=0)
    sample_with_old_after: int = config_field(
        "Roll out with the old policy after this many optimiser steps (DGPO's switch_ema_ref: "
        "200); -1: never.", default=200)
    guidance_scale: float = config_field(
        "CFG scale of DGPO's training forwards (policy, old policy, reference), whatever "
        "sampling.guidance_scale the rollouts use: the reference trains CFG-free (1.0).",
        default=1.0)

    def validate(self) -> None:
        positive(self.beta, "training.dgpo.beta")
        positive(self.guidance_scale, "training.dgpo.guidance_scale")
        choice(self.reference, ("base", "old"), "training.dgpo.reference")
        _old_policy_rules(self, "training.dgpo")
        if self.sample_with_old_after < -1:
            raise ConfigError(f"training.dgpo.sample_with_old_after must be >= -1 (got "
                              f"{self.sample_with_old_after}); -1 never samples with the old "
                              f"policy")


@dataclass
class DPOConfig(Section):
    beta: float = config_field(
        "Diffusion-DPO's beta in -log sigmoid(-beta / 2 [(e_w - e_ref_w) - (e_l - e_ref_l)]). "
        "Flow-Factory's SD3.5 example: 100.", default=100.0)
    pairs_file: str | None = config_field(
        "Offline preference pairs: a JSONL file, one {\"prompt\": ..., \"chosen\": image path, "
        "\"rejected\": image path} object a line (paths relative to the file), VAE-encoded by "
        "the model (a family with encode_images: toy, sd3, flux) and trained with the online pairs' loss. "
        "null: online pairs only.", default=None)
    pairs_per_iteration: int = config_field(
        "Offline pairs trained per iteration over all processes, drawn from pairs_file in a "
        "shuffled order per pass over the file (by run.seed: the same pairs in the same order on "
        "any process count and on a resume).", default=8)
    online: bool = config_field(
        "Also train each rollout group's best/worst pair; false with a pairs_file: offline pairs "
        "only (the rollouts still run, for the logged rewards).", default=True)

    def validate(self) -> None:
        positive(self.beta, "training.dpo.beta")
        positive(self.pairs_per_iteration, "training.dpo.pairs_per_iteration")
        if self.pairs_file is not None and (not isinstance(self.pairs_file, str)
                                            or not self.pairs_file.strip()):
            raise ConfigError(f"training.dpo.pairs_file must be a path to a JSONL file of "
                              f"preference pairs, or null (got {self.pairs_file!r})")
        if not self.online and self.pairs_file is None:
            raise ConfigError("training.dpo.online is false but training.dpo.pairs_file is "
                              "null: there is nothing to train; give a pairs_file or set online: "
                              "true")


@dataclass
class GDROConfig(Section):
    beta: float = config_field(
        "GDRO's beta in the implicit reward s_i = -beta (e_i - e_ref_i) of each group member "
        "(e the flow-matching error at a level and noise the group shares).", default=100.0)
    tau: float = config_field(
        "Temperature of the target distribution softmax(r / tau) over a group's rewards "
        "(loss: cross_entropy); small: the best members take all the mass.", default=0.25)
    loss: str = config_field(
        "'cross_entropy' (-sum_i softmax(r / tau)_i log softmax(s)_i over a group) or "
        "'plackett_luce' (the listwise likelihood of the group's ranking by reward, "
        "-sum_k log softmax over the members not yet ranked; uses only the order).",
        default="cross_entropy")

    def validate(self) -> None:
        positive(self.beta, "training.gdro.beta")
        positive(self.tau, "training.gdro.tau")
        choice(self.loss, GDRO_LOSSES, "training.gdro.loss")
