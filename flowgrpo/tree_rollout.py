"""The rollout of tree plans (``sampling.plan.kind: tree``; TreeGRPO / BranchGRPO).

The shape and the leaf order are ``flowgrpo/tree.py``'s. A chunk is ``rollout_batch_size //
group_size`` whole trees (the config requires a multiple). For each chunk:

* the shared deterministic prefix runs once per tree (the root: the group's shared noise);
* at window step s_j one transformer call evaluates every node of level j of the chunk's trees
  (n_j per tree, not L: the sharing that is the method's point); at a branch step each node's
  Gaussian is sampled k times, once per child, else once; every child's noise is the draw of its
  representative leaf's SDE stream (seed, iteration, "sde", sample id) at that window position,
  so with one branch step and a window of one step the tree is the ``one_step`` plan bit for bit;
* a trained step keeps the fields of one ``rollout.ReplayBatch`` (built by ``rollout.rollout``,
  which calls this module) of one row per edge (the row of the child's representative leaf),
  with ``children`` = c: its rows come in runs of c siblings sharing one input, and
  ``rollout.replay_logp`` evaluates the transformer once per run, exactly the call the rollout
  made, so the first pass's ratio is exactly 1;
* the leaves finish by Euler ODE, one row per sample; the prefix and the tail are the Euler
  steps of ``rollout.run_plan``, op for op.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor

from flowgrpo.model import Conditioning, FlowModel, cfg_gradient
from flowgrpo.plans import StepPlan
from flowgrpo.sde import euler_step, transition
from flowgrpo.seeding import seeded_generator

# ``settings`` below is a ``rollout.RolloutSettings``: not imported, rollout.py imports this module


def euler_steps(model: FlowModel, plan: StepPlan, x: Tensor, cond: Conditioning,
                settings: Any, first: int, last: int) -> Tensor:
    """Euler steps [first, last) of ``plan`` from x (b, ...) float32: ``rollout.run_plan``'s
    deterministic steps, op for op."""
    b = x.shape[0]
    for i in range(first, last):
        sigma = plan.sigmas[i].expand(b).to(model.device, torch.float32)
        sigma_next = plan.sigmas[i + 1].expand(b).to(model.device, torch.float32)
        velocity = model.velocity(x.to(model.dtype), sigma, cond,
                                  settings.guidance_scale).to(torch.float32)
        x = euler_step(x, velocity, sigma, sigma_next)
    return x


def tree_groups(plan: StepPlan, rows: list[int], group_ids: Tensor, sample_ids: Tensor
                ) -> list[Tensor]:
    """The rows of each group among ``rows``, each (L,) sorted by sample id (leaf order);
    every group must hold exactly L = k^D rows (whole trees on each process)."""
    leaves = plan.branching ** len(plan.branch_at)
    by_group: dict[int, list[int]] = {}
    for row in rows:
        by_group.setdefault(int(group_ids[row]), []).append(row)
    groups = []
    for group, members in by_group.items():
        if len(members) != leaves:
            raise ValueError(f"a tree plan needs each group's {leaves} samples on one process "
                             f"(group {group} has {len(members)} here): make "
                             f"training.prompts_per_iteration * group_size / processes a "
                             f"multiple of group_size = tree_branching ** len(tree_branch_at)")
        members.sort(key=lambda r: int(sample_ids[r]))
        groups.append(torch.tensor(members))
    return groups


def tree_chunks(model: FlowModel, plan: StepPlan, rows: list[int], noise: Tensor,
                cond_unique: Conditioning, prompt_index: Tensor, group_ids: Tensor,
                sample_ids: Tensor, settings: Any
                ) -> Iterator[tuple[Tensor, Tensor, list[dict[str, Any]], int, Tensor]]:
    """Roll out the trees of ``rows`` (a bucket of one tree plan) chunk by chunk.

    noise (B, ...) the batch's initial noise (shared within a group); cond_unique / prompt_index
    as ``rollout.encode_rows``. Yields (leaf rows (b,), final latents (b, ...) at sigma = 0,
    the ``ReplayBatch`` fields of each trained step, transformer calls made, (b, N) float32 CPU
    log-prob of the edge at each window step on each leaf's path, 0 off the window) per chunk.
    """
    groups = tree_groups(plan, rows, group_ids, sample_ids)
    leaves = plan.branching ** len(plan.branch_at)
    per_chunk = max(1, settings.batch_size // leaves)
    window, branch_at, trained = plan.stochastic, set(plan.branch_at), set(plan.trained)
    device = model.device
    for start in range(0, len(groups), per_chunk):
        leaf_rows = torch.cat(groups[start:start + per_chunk])
        trees = len(leaf_rows) // leaves
        cond = cond_unique.select(prompt_index[leaf_rows]).to(device)
        node_pos = torch.arange(trees) * leaves          # positions of the nodes' first leaves
        x = noise[leaf_rows[node_pos]].to(device, torch.float32)
        calls = 0
        # the shared deterministic prefix, once per tree
        x = euler_steps(model, plan, x, cond.select(node_pos), settings, 0, window[0])
        calls += window[0] * trees
        streams = [seeded_generator(settings.seed, settings.iteration, "sde", int(sample_id))
                   for sample_id in sample_ids[leaf_rows].tolist()]
        block = leaves                                    # leaves below each current node
        replay: list[dict[str, Any]] = []
        path_log_probs = torch.zeros(len(leaf_rows), plan.num_steps)
        for step in window:
            # one draw per leaf stream and window step, kept for the representatives
            draws = torch.stack([torch.randn(x.shape[1:], generator=g) for g in streams])
            nodes = len(node_pos)
            children = plan.branching if step in branch_at else 1
            is_trained = step in trained
            sigma = plan.sigmas[step].expand(nodes).to(device, torch.float32)
            with cfg_gradient(settings.cfg_gradient if is_trained else "both"):
                velocity = model.velocity(x.to(model.dtype), sigma, cond.select(node_pos),
                                          settings.guidance_scale).to(torch.float32)
            calls += nodes
            block //= children
            child_pos = (node_pos[:, None] + torch.arange(children) * block).reshape(-1)
            if children > 1:
                x = x.repeat_interleave(children, dim=0)
                velocity = velocity.repeat_interleave(children, dim=0)
            edges = len(child_pos)
            sigma = plan.sigmas[step].expand(edges).to(device, torch.float32)
            sigma_next = plan.sigmas[step + 1].expand(edges).to(device, torch.float32)
            out = transition(settings.kind, velocity, x, sigma, sigma_next,
                             noise_level=settings.noise_level, noise=draws[child_pos].to(device),
                             validate=False, log_prob=settings.log_prob,
                             schedule_bounds=settings.schedule_bounds)
            if is_trained:
                replay.append(dict(
                    rows=leaf_rows[child_pos], step=step, latents=x,
                    next_latents=out.prev_sample, sigmas=sigma, sigmas_next=sigma_next,
                    logp_old=out.log_prob, mean_old=out.mean, std=out.std,
                    gaussian=out.gaussian, children=children))
            # child node m owns the chunk's leaves [m block, (m + 1) block)
            path_log_probs[:, step] = out.log_prob.float().cpu()[
                torch.arange(len(leaf_rows)) // block]
            x, node_pos = out.prev_sample, child_pos
        # every node is now a leaf, in leaf order: the Euler tail, one row per sample
        x = euler_steps(model, plan, x, cond, settings, window[-1] + 1, plan.num_steps)
        calls += (plan.num_steps - window[-1] - 1) * len(leaf_rows)
        yield leaf_rows, x, replay, calls, path_log_probs
