"""Tree rollouts (TreeGRPO, arXiv 2512.08153; BranchGRPO, arXiv 2509.06040): the shape of a
group's tree, its transformer calls and its advantages. Pure functions, no model.

A group of ``sampling.plan.kind: tree`` is one tree. Its root is the group's shared initial noise,
taken by Euler ODE to the first step of the SDE window ``s_0 < ... < s_{W-1}`` (consecutive base
steps). Level j holds the nodes entering window step s_j (level 0: the root; level W: the
leaves). At a branch step each node of level j splits into k children, each continuing with its
own SDE noise; at any other window step each node takes one SDE step (one child). So level j has
n_j = k^(branch steps among s_0 .. s_{j-1}) nodes and the tree k^D leaves (D branch steps): the
group's samples, each finished by Euler ODE and scored by the reward.

Leaves are ordered so that the leaves of any node form a contiguous block: node i of level j owns
leaves [i L / n_j, (i + 1) L / n_j) (L = k^D), its representative is the first of them, and its
c children (c = k at a branch step, else 1) own the c consecutive sub-blocks.

Credit (the "edge" from a node of level j to its child at level j + 1 is the SDE transition of
step s_j): each node's value is backed up from the leaves (``backup_values``: the mean of its
children, or their softmax-by-edge-log-probability weighted mean), the values of each level are
normalised among the nodes of that level in the same tree (``tree_advantages``, "depth-wise"),
and every trained edge takes its child's advantage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowgrpo.advantages import group_advantages
from flowgrpo.errors import ConfigError
from flowgrpo.plans import PlanConfig, tree_steps

__all__ = ["TreeShape", "tree_shape", "backup_values", "tree_advantages", "check_tree_config"]


@dataclass(frozen=True)
class TreeShape:
    """The structure of one tree (the same for every group of a tree plan).

    window:    (W,) the SDE steps s_0 < ... < s_{W-1} of the base schedule.
    branch_at: the window steps at which every node splits into ``branching`` children.
    branching: k >= 2.
    trained:   the window steps whose edges are trained (a subset of ``window``).
    """

    window: tuple[int, ...]
    branch_at: tuple[int, ...]
    branching: int
    trained: tuple[int, ...]

    @property
    def depth(self) -> int:
        """W: levels below the root (one per window step)."""
        return len(self.window)

    @property
    def leaves(self) -> int:
        """L = k^D, the group size."""
        return self.branching ** len(self.branch_at)

    def children(self, level: int) -> int:
        """Children of each node of ``level`` (0 <= level < W): k at a branch step, else 1."""
        return self.branching if self.window[level] in self.branch_at else 1

    def nodes(self, level: int) -> int:
        """n_level = k^(branch steps among s_0 .. s_{level-1}), 0 <= level <= W."""
        return self.branching ** sum(step in self.branch_at for step in self.window[:level])

    def leaf_node(self, level: int) -> Tensor:
        """(L,) int64: the node of ``level`` each leaf descends from."""
        return torch.arange(self.leaves) // (self.leaves // self.nodes(level))

    @property
    def window_calls(self) -> int:
        """Transformer calls of one tree inside the window: one per node and step,
        sum_{j < W} n_j ((k^W - 1) / (k - 1) when every window step branches)."""
        return sum(self.nodes(level) for level in range(self.depth))

    @property
    def trained_edges(self) -> int:
        """Trained transitions of one tree: sum over trained steps s_j of n_{j+1}
        (k (k^W - 1) / (k - 1) when every window step branches and is trained)."""
        return sum(self.nodes(level + 1) for level, step in enumerate(self.window)
                   if step in self.trained)

    def transformer_calls(self, num_steps: int) -> int:
        """Transformer calls of one tree over the whole schedule of ``num_steps`` steps: the
        prefix once (s_0 calls), the window (``window_calls``) and the Euler tail once per leaf
        ((num_steps - s_{W-1} - 1) L); a flat group of L samples makes num_steps L."""
        tail = num_steps - self.window[-1] - 1
        return self.window[0] + self.window_calls + tail * self.leaves


def tree_shape(config: PlanConfig, num_steps: int) -> TreeShape:
    """The validated ``TreeShape`` of a ``kind: tree`` plan config on ``num_steps`` steps."""
    window, branch_at, trained = tree_steps(config, num_steps)
    return TreeShape(window, branch_at, config.tree_branching, trained)


def backup_values(leaf_rewards: Tensor, shape: TreeShape,
                  edge_log_probs: list[Tensor] | None = None) -> list[Tensor]:
    """The value of every node, backed up from the leaves.

    Args:
        leaf_rewards: (T, L) float, T trees; NaN = no score (left out of every mean).
        shape: the trees' shape.
        edge_log_probs: None for the children's mean (BranchGRPO's default, TreeGRPO's equal
            path probabilities), or W tensors, entry j (T, n_{j+1}) the log-probability of the
            edge into each node of level j + 1: a parent's value is then its children's values
            weighted by the softmax of their edge log-probabilities over the siblings
            (BranchGRPO's ``tree_prob_weighted``, temperature 1), so a value is a
            path-probability-weighted mean of the leaves below.

    Returns:
        W + 1 tensors, entry j (T, n_j) float64 (entry W the leaf rewards). A node with no
        scored leaf below is NaN.
    """
    if leaf_rewards.dim() != 2 or leaf_rewards.shape[1] != shape.leaves:
        raise ValueError(f"leaf_rewards must have shape (T, {shape.leaves}) (got "
                         f"{tuple(leaf_rewards.shape)})")
    if edge_log_probs is not None and len(edge_log_probs) != shape.depth:
        raise ValueError(f"edge_log_probs must hold {shape.depth} tensors, one per window step "
                         f"(got {len(edge_log_probs)})")
    trees = leaf_rewards.shape[0]
    values = [leaf_rewards.detach().to(torch.float64)]
    for level in reversed(range(shape.depth)):
        count, children = shape.nodes(level), shape.children(level)
        child = values[0].reshape(trees, count, children)
        valid = ~torch.isnan(child)
        if edge_log_probs is None:
            weight = valid.to(torch.float64)
        else:
            logits = edge_log_probs[level].detach().to(torch.float64)
            if logits.shape != (trees, count * children):
                raise ValueError(f"edge_log_probs[{level}] must have shape "
                                 f"({trees}, {count * children}) (got {tuple(logits.shape)})")
            logits = logits.reshape(trees, count, children).masked_fill(~valid, float("-inf"))
            weight = torch.softmax(logits, dim=-1).nan_to_num(0.0)   # all-NaN siblings: 0
        total = (weight * child.nan_to_num(0.0)).sum(-1)
        mass = weight.sum(-1)
        values.insert(0, torch.where(mass > 0, total / mass.clamp(min=1e-300),
                                     torch.full_like(total, float("nan"))))
    return values


def tree_advantages(rewards: Tensor, group_ids: Tensor, shape: TreeShape, num_steps: int, *,
                    scale: str = "group", ddof: int = 0, eps: float = 1e-4,
                    clip: float | None = 5.0, path_log_probs: Tensor | None = None
                    ) -> tuple[Tensor, dict[str, float]]:
    """Per-step advantages of a batch of trees.

    Args:
        rewards: (B,) leaf rewards, NaN = no score; B = T L.
        group_ids: (B,) the tree (group) of each row; a tree's L rows, in their order in the
            batch, are its leaves 0 .. L - 1 (the rollout's order: by sample id).
        shape, num_steps: the plan's tree and the schedule's step count.
        scale, ddof, eps, clip: as ``advantages.group_advantages``, applied to each level: the
            values of the nodes of one level of one tree are normalised among themselves.
        path_log_probs: None for the children's mean, or (B, num_steps): column s_j of a row
            the log-prob of the edge of step s_j on its leaf's path (``RolloutBatch.
            tree_log_probs``), the same for every leaf below that edge: the weights of
            ``backup_values``' probability-weighted mean.

    Returns:
        advantages (B, num_steps) float32: column s_j of a row is the advantage of its ancestor
        at level j + 1 (the child of the edge of step s_j the row's leaf descends through) when
        s_j is trained, 0 elsewhere; a level with one node per tree (before the first branch)
        carries no signal (0). Stats: ``nan_count``, ``num_groups``, ``zero_std_fraction`` (of
        the leaf rewards' groups), ``edges`` (trained edges of the batch) and ``adv_mean``,
        ``adv_std``, ``adv_abs_max`` over the trained edges with a scored leaf below, each edge
        counted once.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must have one shape (B,) (got "
                         f"{tuple(rewards.shape)} and {tuple(group_ids.shape)})")
    groups, index = torch.unique(group_ids, sorted=False, return_inverse=True)
    trees, leaves = len(groups), shape.leaves
    counts = torch.bincount(index, minlength=trees)
    if bool((counts != leaves).any()):
        raise ValueError(f"every tree needs its {leaves} leaves (training.group_size = "
                         f"tree_branching ** len(tree_branch_at)); got group sizes "
                         f"{sorted(set(counts.tolist()))}")
    # leaf index of each row: its rank among its tree's rows in batch order
    order = torch.argsort(index, stable=True)
    slots = torch.empty_like(index)
    slots[order] = torch.arange(len(index)) % leaves
    leaf_rewards = torch.full((trees, leaves), float("nan"), dtype=torch.float64)
    leaf_rewards[index, slots] = rewards.detach().to(torch.float64).cpu()
    edge_log_probs = None
    if path_log_probs is not None:
        if path_log_probs.shape != (len(rewards), num_steps):
            raise ValueError(f"path_log_probs must have shape ({len(rewards)}, {num_steps}) "
                             f"(got {tuple(path_log_probs.shape)})")
        by_leaf = torch.zeros(trees, leaves, num_steps, dtype=torch.float64)
        by_leaf[index, slots] = path_log_probs.detach().to(torch.float64).cpu()
        # the edge into node m of level j + 1 is read off its first leaf
        edge_log_probs = [by_leaf[:, ::leaves // shape.nodes(level + 1), step]
                          for level, step in enumerate(shape.window)]
    values = backup_values(leaf_rewards, shape, edge_log_probs)

    advantages = torch.zeros(len(rewards), num_steps, dtype=torch.float64)
    edge_values: list[Tensor] = []
    for level, step in enumerate(shape.window):
        if step not in shape.trained:
            continue
        count = shape.nodes(level + 1)
        node_values = values[level + 1].reshape(-1)
        tree_of_node = torch.arange(trees).repeat_interleave(count)
        if count > 1:
            node_adv, _ = group_advantages(node_values, tree_of_node, scale=scale, ddof=ddof,
                                           eps=eps, clip=clip)
            node_adv = node_adv.to(torch.float64)
        else:
            node_adv = torch.zeros(trees, dtype=torch.float64)
        node_adv = node_adv.reshape(trees, count)
        advantages[:, step] = node_adv[index, shape.leaf_node(level + 1)[slots]]
        edge_values.append(node_adv[~torch.isnan(values[level + 1])])
    _, leaf_stats = group_advantages(rewards.detach().to(torch.float64).cpu(),
                                     group_ids.cpu(), scale="none", clip=None)
    edges = torch.cat(edge_values) if edge_values else torch.zeros(0, dtype=torch.float64)
    stats = {"nan_count": leaf_stats["nan_count"], "num_groups": leaf_stats["num_groups"],
             "zero_std_fraction": leaf_stats["zero_std_fraction"],
             "edges": float(trees * shape.trained_edges),
             "adv_mean": edges.mean().item() if edges.numel() else 0.0,
             "adv_std": edges.std(correction=0).item() if edges.numel() else 0.0,
             "adv_abs_max": edges.abs().max().item() if edges.numel() else 0.0}
    return advantages.to(device=rewards.device, dtype=torch.float32), stats


def check_tree_config(config, num_processes: int) -> None:
    """At config load, for ``sampling.plan.kind: tree`` (``config.validate``): what a tree needs
    of the other sections, each refusal naming the field and the fix."""
    s, t, r = config.sampling, config.training, config.rewards
    if config.policy != "flow" or s.plan.kind != "tree":
        return
    shape = tree_shape(s.plan, s.num_steps)
    plan = "sampling.plan.kind 'tree'"
    if t.group_size != shape.leaves:
        raise ConfigError(
            f"training.group_size ({t.group_size}) must equal the tree's leaves, "
            f"tree_branching ** len(tree_branch_at) = {shape.branching} ** "
            f"{len(shape.branch_at)} = {shape.leaves}: set group_size: {shape.leaves} or change "
            f"sampling.plan.tree_branch_at / tree_branching")
    if not s.share_initial_noise:
        raise ConfigError(f"{plan} grows one tree per group from one root, the group's initial "
                          f"noise: set sampling.share_initial_noise: true")
    if t.algorithm != "grpo":
        raise ConfigError(f"{plan} trains the tree's SDE edges, which training.algorithm "
                          f"{t.algorithm!r} does not: set training.algorithm: grpo")
    if s.rollout_batch_size % t.group_size:
        raise ConfigError(f"{plan} rolls whole trees out together: sampling.rollout_batch_size "
                          f"({s.rollout_batch_size}) must be a multiple of training.group_size "
                          f"({t.group_size})")
    if (t.prompts_per_iteration * t.group_size // num_processes) % t.group_size:
        raise ConfigError(f"{plan} needs whole trees on each process: "
                          f"training.prompts_per_iteration ({t.prompts_per_iteration}) must be "
                          f"a multiple of the {num_processes} processes")
    refused = [
        ("training.locality.mask", t.locality.enabled, "'off'"),
        ("rewards.aggregation", r.aggregation != "weighted_sum", "weighted_sum"),
        ("rewards.saturation_ratio", bool(r.saturation_ratio), "0"),
        ("training.kl_reward", t.kl_reward > 0, "0"),
        ("training.gardo.diversity", bool(t.gardo.diversity), "false"),
        ("training.gardo.kl_gate", bool(t.gardo.kl_gate), "false"),
        ("training.anchor_beta", t.anchor_beta > 0, "0"),
        ("sampling.reward_guidance.reward", bool(s.reward_guidance.reward), "''"),
        ("training.advantage", getattr(t, "advantage", "auto") != "auto", "auto"),
    ]
    for name, active, fix in refused:
        if active:
            raise ConfigError(f"{name} is not supported with {plan} (the tree's advantages are "
                              f"per edge, tree_advantages): set {name}: {fix}")
