"""DGPO, Direct Group Preference Optimization (arXiv 2510.08425; Flow-Factory
``trainers/dgpo.py``; Luo-Yihong/DGPO, read only).

ODE rollouts keep final samples. The samples of a group are re-noised with the same noise at the
same level; e_i = mean_d (v_theta - v*)^2 and e_ref_i the reference's at the same x_sigma give the
group's detached preference z = beta / G sum_i A_i (e_i - e_ref_i), and the loss
sigmoid(z) A_i e_i (``matching_losses.dgpo_loss``): for one group its gradient is
(1/beta) d[-log sigmoid(-z)], a DPO of the whole group. With ``training.dgpo.clip`` a row whose
ratio exp(e_old - e) to the old policy (an EMA of the trained weights, updated every optimiser
step) left [1 - clip_low, 1 + clip_high] on its advantage's side gets no gradient. After
``sample_with_old_after`` optimiser steps the rollouts use the old policy. ``training.kl_beta``
adds the velocity KL to the reference. The training forwards use ``training.dgpo.guidance_scale``
(1: CFG-free, as the reference), whatever the sampler's scale.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from flowgrpo.algorithms.base import (FlowAlgorithm, OldPolicy, add_velocity_kl, sample_units,
                                      unit_forward)
from flowgrpo.errors import ConfigError
from flowgrpo.matching_losses import dgpo_loss, velocity_error


class DGPO(FlowAlgorithm):
    name = "dgpo"
    keeps_transitions = False

    def __init__(self, policy) -> None:
        super().__init__(policy)
        d = self.config.training.dgpo
        needs_old = d.clip or d.reference == "old" or d.sample_with_old_after >= 0
        self.old = OldPolicy(policy.trainable, d.old_flat_steps, d.old_ramp_rate,
                             d.old_max_decay) if needs_old else None
        self.steps = 0

    def check_engine(self, sharded: bool) -> None:
        if sharded and self.old is not None:
            raise ConfigError("training.algorithm dgpo with an old policy (dgpo.clip, "
                              "dgpo.reference: old or sample_with_old_after >= 0) swaps a copy "
                              "of the trainable weights in, which a sharded engine does not "
                              "allow: use DDP or DeepSpeed ZeRO-2")

    def sampling_weights(self, iteration: int):
        after = self.config.training.dgpo.sample_with_old_after
        if self.old is not None and after >= 0 and self.steps > after:
            return self.old.swapped_in()
        return nullcontext()

    def replays(self, batch, iteration: int, rewards=None) -> list:
        shared = self.config.training.dgpo.shared_noise
        return sample_units(batch, self.policy.base_sigmas, self.config, iteration,
                            whole_groups=True, shared_sigmas=shared, group_noise=shared)

    def loss(self, batch, replay, advantages: Tensor, iteration: int, clip_high: float,
             weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        policy, t = self.policy, self.config.training
        d = t.dgpo
        # CFG-free training whatever the sampler's scale (d.guidance_scale)
        unit = unit_forward(policy, batch, replay, iteration, guidance=d.guidance_scale,
                            per_slot_noise=not d.shared_noise)
        velocity = unit.velocity()
        error = velocity_error(velocity, unit.target)
        record: dict[str, Tensor] = {}
        velocity_base = velocity_old = None
        if d.reference == "base" or t.kl_beta > 0:
            velocity_base = unit.velocity(policy.reference_policy())
        if self.old is not None and (d.clip or d.reference == "old"):
            velocity_old = unit.velocity(self.old.swapped_in())
        error_ref = velocity_error(velocity_base if d.reference == "base" else velocity_old,
                                   unit.target)
        adv = advantages[replay.rows].to(error.device).float()
        if d.clip:
            ratio = torch.exp(velocity_error(velocity_old, unit.target) - error.detach())
            clipped = torch.where(adv > 0, ratio > 1 + clip_high, ratio < 1 - t.clip_low)
            error = torch.where(clipped, error.detach(), error)
            record["clip_fraction"] = clipped.float().mean()
        groups = batch.group_ids.index_select(0, replay.rows).to(error.device)
        loss = dgpo_loss(error, error_ref, adv, groups, d.beta, t.group_size, weights=weights)
        record["policy_loss"] = loss.detach()
        record["matching_error"] = error.detach().mean()
        if t.kl_beta > 0:
            loss = add_velocity_kl(loss, record, t.kl_beta, velocity, velocity_base, weights)
        loss = self.add_anchor(loss, record, unit, batch, replay, iteration, weights)
        return loss, record

    def after_optimizer_step(self) -> None:
        self.steps += 1
        if self.old is not None:
            self.old.update(self.steps)

    def after_update(self) -> dict[str, float]:
        return {"train/old_decay": self.old.last_decay} if self.old is not None else {}

    def state_dict(self) -> tuple[dict, dict[str, Tensor]]:
        return {"steps": self.steps}, self.old.state_dict() if self.old is not None else {}

    def load_state_dict(self, state: dict, tensors: dict[str, Tensor]) -> None:
        self.steps = int(state["steps"])
        if self.old is not None:
            self.old.load_state_dict(tensors)
