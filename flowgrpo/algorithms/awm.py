"""AWM, Advantage Weighted Matching (arXiv 2509.25050; Flow-Factory ``trainers/awm.py``).

Pretraining's flow-matching loss on the policy's own final samples, weighted by their advantages:
the "log-prob" of a sample at a noise level is minus its (weighted) matching error
(``matching_losses.awm_log_prob``), and the loss is the clipped surrogate on it
(``losses.policy_loss``, ``training.clip_low`` / ``clip_high``), so at ratio 1 its gradient is
sum_i A_i d e_i. The old log-prob of a replay unit is taken at its first pass (ratio exactly 1);
a second inner epoch is clipped against it. ``training.kl_beta`` adds the velocity KL to the
reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flowgrpo.algorithms.base import FlowAlgorithm, add_velocity_kl, sample_units, unit_forward
from flowgrpo.losses import policy_loss, surrogate_stats
from flowgrpo.matching_losses import awm_log_prob


class AWM(FlowAlgorithm):
    name = "awm"
    keeps_transitions = False

    def replays(self, batch, iteration: int, rewards=None) -> list:
        return sample_units(batch, self.policy.base_sigmas, self.config, iteration,
                            whole_groups=False, shared_sigmas=False, group_noise=False)

    def loss(self, batch, replay, advantages: Tensor, iteration: int, clip_high: float,
             weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        t = self.config.training
        unit = unit_forward(self.policy, batch, replay, iteration)
        velocity = unit.velocity()
        logp = awm_log_prob(velocity, unit.target, unit.sigmas, t.awm.weighting, t.awm.power)
        if "logp_old" not in replay.cache:      # the first pass: the rollout's policy
            replay.cache["logp_old"] = logp.detach()
        logp_old = replay.cache["logp_old"]
        adv = advantages[replay.rows].to(logp.device).float()
        loss = policy_loss(logp, logp_old, adv, t.clip_low, clip_high, weights=weights)
        log_ratio = logp.detach() - logp_old
        record = {"log_ratio": log_ratio, "advantages": adv, "weights": weights,
                  "ratio_max_dev": torch.expm1(log_ratio).abs().max(),
                  "policy_loss": loss.detach(), "matching_error": (-logp.detach()).mean()}
        if t.kl_beta > 0:
            loss = add_velocity_kl(loss, record, t.kl_beta, velocity,
                                   unit.velocity(self.policy.reference_policy()), weights)
        loss = self.add_anchor(loss, record, unit, batch, replay, iteration, weights)
        return loss, record

    def update_metrics(self, rows: dict[str, Tensor], clip_high: float) -> dict[str, Tensor]:
        if not rows:
            return {}
        stats = surrogate_stats(rows["log_ratio"], rows["advantages"],
                                self.config.training.clip_low, clip_high, rows["weights"])
        for key in ("policy_loss", "matching_error", "kl", "anchor"):
            if key in rows:
                stats[key] = rows[key].float().mean()
        return stats
