"""GDRO, Group-level Direct Reward Optimization (arXiv 2601.02036; no public code: written from
the paper's description).

ODE rollouts keep final samples. The members of a group are re-noised at one level with one noise
(both drawn per group and level, keyed by (seed, iteration, group)), so that their errors differ
by their samples only. Each member's implicit reward is s_i = -beta (e_i - e_ref_i), e the
flow-matching error mean_d (v - v*)^2 of the policy and e_ref the reference's at the same x_sigma
(``matching_losses.gdro_implicit_rewards``), and the group's loss compares the implicit rewards
with the explicit ones (``matching_losses.gdro_loss``): the cross-entropy of softmax(s) against
the target softmax(r / tau) (``training.gdro.loss: cross_entropy``), or the Plackett-Luce
likelihood of the group's ranking by reward (``plackett_luce``). A group whose finite rewards are
all equal (or that has fewer than two) carries no preference and gives no loss.
``training.kl_beta`` adds the velocity KL to the reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flowgrpo.algorithms.base import (FlowAlgorithm, SampleReplay, add_velocity_kl, draw_sigmas,
                                      unit_forward)
from flowgrpo.matching_losses import gdro_implicit_rewards, gdro_loss, velocity_error
from flowgrpo.seeding import seeded_generator


def group_matrix(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, list[int]]:
    """Rows laid out by group: ((N, G) values, (N, G) row index into ``values`` or -1 where a
    group has fewer rows than the largest, the N group labels in first-appearance order)."""
    labels = list(dict.fromkeys(group_ids.tolist()))
    members = [(group_ids == g).nonzero().flatten() for g in labels]
    width = max(len(m) for m in members)
    index = torch.full((len(labels), width), -1, dtype=torch.long)
    for n, rows in enumerate(members):
        index[n, :len(rows)] = rows
    gathered = values[index.clamp(min=0).to(values.device)]
    return gathered, index, labels


class GDRO(FlowAlgorithm):
    name = "gdro"
    keeps_transitions = False

    def replays(self, batch, iteration: int, rewards=None) -> list:
        """Chunks of whole groups (rollout_batch_size rows, at least one group), times
        training.timesteps.count levels; a group's members share their level and noise. Each
        unit keeps its rows' total rewards (``cache["rewards"]``)."""
        t, seed = self.config.training, self.config.run.seed
        total = rewards["total"].float()
        group_ids = batch.group_ids.tolist()
        by_group: dict[int, list[int]] = {}
        for row, group in enumerate(group_ids):
            by_group.setdefault(group, []).append(row)
        per_chunk = max(1, self.config.sampling.rollout_batch_size // t.group_size)
        groups = list(by_group)
        levels = {g: draw_sigmas(self.policy.base_sigmas, t.timesteps.count, t.timesteps.sampling,
                                 t.timesteps.fraction,
                                 seeded_generator(seed, iteration, "matching_sigma", g))
                  for g in groups}
        units = []
        for start in range(0, len(groups), per_chunk):
            chunk = groups[start:start + per_chunk]
            rows = [r for g in chunk for r in by_group[g]]
            keys = [group_ids[r] for r in rows]
            rows_tensor = torch.tensor(rows)
            chunk_rewards = total[rows_tensor]
            for slot in range(t.timesteps.count):
                sigmas = torch.stack([levels[k][slot] for k in keys]).float()
                units.append(SampleReplay(rows=rows_tensor, slot=slot, sigmas=sigmas,
                                          noise_keys=keys, cache={"rewards": chunk_rewards}))
        return units

    def loss(self, batch, replay, advantages: Tensor, iteration: int, clip_high: float,
             weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        t = self.config.training
        g = t.gdro
        unit = unit_forward(self.policy, batch, replay, iteration)
        velocity = unit.velocity()
        velocity_ref = unit.velocity(self.policy.reference_policy())
        error = velocity_error(velocity, unit.target)
        error_ref = velocity_error(velocity_ref, unit.target)
        implicit = gdro_implicit_rewards(error, error_ref, g.beta)
        device = implicit.device
        groups = batch.group_ids.index_select(0, replay.rows)
        s, index, _ = group_matrix(implicit, groups)
        present = (index >= 0).to(device)
        r = replay.cache["rewards"].to(device)[index.clamp(min=0).to(device)]
        # a member with weight 0 (padding) or a non-finite reward takes no part
        row_weights = weights.to(device)[index.clamp(min=0).to(device)]
        valid = present & torch.isfinite(r) & (row_weights > 0)
        finite_r = torch.where(valid, r, torch.zeros_like(r))
        spread = (torch.where(valid, finite_r, torch.full_like(r, -float("inf"))).amax(dim=1)
                  - torch.where(valid, finite_r, torch.full_like(r, float("inf"))).amin(dim=1))
        informative = (valid.sum(dim=1) >= 2) & (spread > 0)
        valid = valid & informative[:, None]
        per_group = gdro_loss(s, finite_r, valid, g.tau, g.loss)
        loss = per_group.sum() / informative.sum().clamp(min=1)
        with torch.no_grad():
            best = torch.where(valid, finite_r, torch.full_like(r, -float("inf"))).argmax(dim=1)
            s_detached = s.detach()
            top = s_detached.gather(1, best[:, None]).squeeze(1)
            mean_s = (torch.where(valid, s_detached, torch.zeros_like(s_detached)).sum(dim=1)
                      / valid.sum(dim=1).clamp(min=1))
            margin = torch.where(informative, top - mean_s, torch.zeros_like(top))
        record = {"policy_loss": loss.detach(),
                  "implicit_reward_best_margin": margin.sum() / informative.sum().clamp(min=1),
                  "informative_groups": informative.float().mean()}
        if t.kl_beta > 0:
            loss = add_velocity_kl(loss, record, t.kl_beta, velocity, velocity_ref, weights)
        loss = self.add_anchor(loss, record, unit, batch, replay, iteration, weights)
        return loss, record
