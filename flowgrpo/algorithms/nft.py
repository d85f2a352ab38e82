"""DiffusionNFT (arXiv 2509.16117; reference: NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``).

Rollouts by any solver from the *old* policy, keeping final samples only. Each sample is re-noised
at ``training.timesteps.count`` levels; the loss contrasts an implicit positive policy
beta v + (1 - beta) v_old with an implicit negative one (1 + beta) v_old - beta v, weighted by
r = clip(A / A_max / 2 + 1/2, 0, 1) (``matching_losses.nft_loss``), plus ``training.kl_beta``
times the velocity KL mean_d (v - v_ref)^2 to the reference. The old policy is an EMA of the
trained weights, updated once per iteration with the reference's ramped decay.
"""
from __future__ import annotations

from contextlib import nullcontext

from torch import Tensor

from flowgrpo.algorithms.base import (FlowAlgorithm, OldPolicy, add_velocity_kl, sample_units,
                                      unit_forward, weighted_mean)
from flowgrpo.matching_losses import nft_loss, nft_reward_weight, velocity_error
from flowgrpo.errors import ConfigError


class NFT(FlowAlgorithm):
    name = "nft"
    keeps_transitions = False

    def __init__(self, policy) -> None:
        super().__init__(policy)
        n = self.config.training.nft
        self.old = OldPolicy(policy.trainable, n.old_flat_steps, n.old_ramp_rate,
                             n.old_max_decay)
        self.steps = 0

    def check_engine(self, sharded: bool) -> None:
        if sharded:
            raise ConfigError("training.algorithm nft keeps an old copy of the trainable weights "
                              "and swaps it in, which a sharded engine (FSDP, DeepSpeed ZeRO-3) "
                              "does not allow: use DDP or DeepSpeed ZeRO-2")

    def sampling_weights(self, iteration: int):
        return self.old.swapped_in() if self.config.training.nft.sample_with_old else nullcontext()

    def replays(self, batch, iteration: int, rewards=None) -> list:
        return sample_units(batch, self.policy.base_sigmas, self.config, iteration,
                            whole_groups=False, shared_sigmas=False, group_noise=False)

    def loss(self, batch, replay, advantages: Tensor, iteration: int, clip_high: float,
             weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        t = self.config.training
        unit = unit_forward(self.policy, batch, replay, iteration)
        velocity_old = unit.velocity(self.old.swapped_in())
        velocity = unit.velocity()
        adv = advantages[replay.rows].to(velocity.device).float()
        r = nft_reward_weight(adv, t.adv_clip)
        per_row = nft_loss(velocity, velocity_old, unit.latents, unit.clean, unit.sigmas, r,
                           t.nft.beta, t.adv_clip)
        loss = weighted_mean(per_row, weights)
        record = {"policy_loss": loss.detach(),
                  "old_deviation": velocity_error(velocity.detach(), velocity_old).mean()}
        if t.kl_beta > 0:
            loss = add_velocity_kl(loss, record, t.kl_beta, velocity,
                                   unit.velocity(self.policy.reference_policy()), weights)
        loss = self.add_anchor(loss, record, unit, batch, replay, iteration, weights)
        return loss, record

    def after_optimizer_step(self) -> None:
        self.steps += 1

    def after_update(self) -> dict[str, float]:
        """The reference's once-per-iteration old-policy update at the decay of the optimiser
        steps so far."""
        return {"train/old_decay": self.old.update(self.steps)}

    def state_dict(self) -> tuple[dict, dict[str, Tensor]]:
        return {"steps": self.steps}, self.old.state_dict()

    def load_state_dict(self, state: dict, tensors: dict[str, Tensor]) -> None:
        self.steps = int(state["steps"])
        self.old.load_state_dict(tensors)
