"""Diffusion-DPO (arXiv 2311.12908) for flow models (Flow-Factory ``trainers/dpo.py``).

Online: the best and the worst sample of each group (by total reward; a group whose finite
rewards are all equal gives no pair) form a (chosen, rejected) pair (offline pairs from a
preference file are not implemented yet). Both samples of a pair are re-noised at the same level with the same noise, and the loss is
-log sigmoid(-beta / 2 [(e_w - e_ref_w) - (e_l - e_ref_l)]) (``matching_losses.
diffusion_dpo_loss``), log 2 while the policy is the reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flowgrpo.algorithms.base import (FlowAlgorithm, SampleReplay, add_velocity_kl, draw_sigmas,
                                      unit_forward, weighted_mean)
from flowgrpo.matching_losses import diffusion_dpo_loss, velocity_error
from flowgrpo.seeding import seeded_generator


def best_worst_pairs(total: Tensor, group_ids: Tensor) -> list[tuple[int, int, int]]:
    """(group id, chosen row, rejected row) of each group whose finite rewards differ: the
    first row with the group's highest reward and the first with its lowest."""
    pairs = []
    for group in group_ids.unique().tolist():
        rows = (group_ids == group).nonzero().flatten()
        values = total[rows]
        finite = torch.isfinite(values)
        if int(finite.sum()) < 2:
            continue
        rows, values = rows[finite], values[finite]
        if float(values.max()) == float(values.min()):
            continue
        pairs.append((group, int(rows[int(values.argmax())]), int(rows[int(values.argmin())])))
    return pairs


class DiffusionDPO(FlowAlgorithm):
    name = "dpo"
    keeps_transitions = False

    def replays(self, batch, iteration: int, rewards=None) -> list:
        """Units of up to rollout_batch_size / 2 pairs, times training.timesteps.count levels;
        a pair's two samples share their levels and noise (keyed by the pair's group)."""
        t, seed = self.config.training, self.config.run.seed
        pairs = best_worst_pairs(rewards["total"].float(), batch.group_ids)
        size = max(1, self.config.sampling.rollout_batch_size // 2)
        units = []
        for start in range(0, len(pairs), size):
            chunk = pairs[start:start + size]
            groups = [g for g, _, _ in chunk]
            rows = torch.tensor([c for _, c, _ in chunk] + [r for _, _, r in chunk])
            levels = [draw_sigmas(self.policy.base_sigmas, t.timesteps.count,
                                  t.timesteps.sampling, t.timesteps.fraction,
                                  seeded_generator(seed, iteration, "matching_sigma", g))
                      for g in groups]
            for slot in range(t.timesteps.count):
                sigmas = torch.stack([level[slot] for level in levels]).float()
                units.append(SampleReplay(rows=rows, slot=slot, sigmas=torch.cat([sigmas, sigmas]),
                                          noise_keys=groups + groups, pairs=len(chunk)))
        if not units:
            # No group varied here; another process may have pairs. Its padding (weight 0) is a
            # sample paired with itself: a margin of exactly 0 and no gradient.
            first = int(batch.group_ids[0])
            batch.padding_replay = SampleReplay(
                rows=torch.tensor([0, 0]), slot=0, sigmas=self.policy.base_sigmas[:1].repeat(2),
                noise_keys=[first, first], pairs=1)
        return units

    def loss(self, batch, replay, advantages: Tensor, iteration: int, clip_high: float,
             weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        t = self.config.training
        unit = unit_forward(self.policy, batch, replay, iteration)
        velocity = unit.velocity()
        velocity_ref = unit.velocity(self.policy.reference_policy())
        error = velocity_error(velocity, unit.target)
        error_ref = velocity_error(velocity_ref, unit.target)
        p = replay.pairs
        per_pair = diffusion_dpo_loss(error[:p], error[p:], error_ref[:p], error_ref[p:],
                                      t.dpo.beta)
        loss = weighted_mean(per_pair, weights[:p])
        with torch.no_grad():
            reward_chosen = error_ref[:p] - error[:p].detach()
            reward_rejected = error_ref[p:] - error[p:].detach()
        record = {"policy_loss": loss.detach(),
                  "implicit_accuracy": (reward_chosen > reward_rejected).float().mean(),
                  "pairs": torch.tensor(float(p))}
        if t.kl_beta > 0:
            loss = add_velocity_kl(loss, record, t.kl_beta, velocity, velocity_ref, weights)
        return loss, record

    def update_metrics(self, rows: dict[str, Tensor], clip_high: float) -> dict[str, Tensor]:
        stats = {key: values.float().mean() for key, values in rows.items() if key != "pairs"}
        return stats
