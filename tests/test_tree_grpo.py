"""TreeGRPO / BranchGRPO: ``sampling.plan.kind: tree`` and the tree advantage estimator.

A group is one tree grown from the group's shared noise: ODE to the SDE window, k children per
node at each branch step, ODE after it; its leaves are the group's samples. Checked here in
closed form: node values backed up from the leaves (the children's mean; the softmax-weighted
mean), the counts of trained edges and transformer calls, depth-wise normalisation, a tree with
one branch step being the ``one_step`` plan bit for bit, the rollout's transformer calls, and
Trainer runs on the toy (on-policy first pass, log-probs equal the Gaussian's) and on every
family's tiny build.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowgrpo.advantages import group_advantages
from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from flowgrpo.plans import PlanConfig, make_plan, replay_steps_per_chunk
from flowgrpo.tree import TreeShape, backup_values, tree_advantages, tree_shape
from tests.test_algorithms import FAMILY_RECIPES, family_tiny_config   # a family's tiny recipe

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "assets" / "toy"
CONFIG = ROOT / "configs" / "toy_methods" / "tree_grpo.yaml"
needs_toy = pytest.mark.skipif(not (TOY / "transformer").is_dir(), reason="assets/toy is not built")


def full_tree(k: int, w: int, start: int = 0) -> TreeShape:
    """w consecutive window steps from ``start``, every one a branch step and trained."""
    steps = tuple(range(start, start + w))
    return TreeShape(steps, steps, k, steps)


# ----------------------------------------------------------------------------- closed forms


def test_backup_with_equal_path_probabilities_is_the_childrens_mean():
    """Every internal node's value is the mean of its children's (so of the leaves below it),
    with or without equal edge log-probabilities; a NaN leaf is left out of its parent's mean."""
    shape = full_tree(2, 3)
    rewards = torch.tensor([[1.0, 3.0, 2.0, 6.0, 0.0, 4.0, 5.0, 7.0]])
    values = backup_values(rewards, shape)
    assert [v.shape for v in values] == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert values[2].tolist() == [[2.0, 4.0, 2.0, 6.0]]
    assert values[1].tolist() == [[3.0, 4.0]]
    assert values[0].tolist() == [[3.5]]
    equal = [torch.full((1, 2), -0.7), torch.full((1, 4), 1.3), torch.full((1, 8), 0.2)]
    assert all(torch.equal(a, b) for a, b in zip(backup_values(rewards, shape, equal), values))
    with_nan = rewards.clone()
    with_nan[0, 1] = float("nan")
    assert backup_values(with_nan, shape)[2][0, 0].item() == 1.0


def test_probability_weighted_backup_is_the_softmax_of_the_edge_log_probs():
    """BranchGRPO's tree_prob_weighted: a parent's value is sum_c softmax(log p)_c v_c over its
    children, level by level."""
    shape = full_tree(2, 2)
    rewards = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    logp = [torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[math.log(2.0), 0.0, 0.0, 0.0]])]
    values = backup_values(rewards, shape, logp)
    assert values[1][0].tolist() == pytest.approx([2 / 3 * 1 + 1 / 3 * 2, 6.0])
    assert values[0][0, 0].item() == pytest.approx(0.25 * (4 / 3) + 0.75 * 6.0)


@pytest.mark.parametrize("k,w", [(2, 1), (2, 3), (3, 2), (4, 2), (2, 5)])
def test_trained_edges_and_window_calls_of_a_full_tree(k, w):
    """Every window step branching: k (k^w - 1) / (k - 1) trained edges (k + k^2 + ... + k^w,
    one per non-root node) from (k^w - 1) / (k - 1) transformer calls in the window (one per
    internal node); the tree has k^w leaves."""
    shape = full_tree(k, w)
    assert shape.leaves == k ** w
    assert shape.trained_edges == k * (k ** w - 1) // (k - 1)
    assert shape.window_calls == (k ** w - 1) // (k - 1)


def test_counts_with_non_branching_steps_and_pruning():
    """Window [2, 6) branching at 3 and 5, k = 3: levels have 1, 1, 3, 3, 9 nodes; steps 2
    and 4 give one child per node. Pruned to steps 3 and 4, it trains 3 + 3 edges."""
    config = PlanConfig(kind="tree", tree_branch_at=[3, 5], tree_branching=3,
                        tree_window=(2, 6))
    shape = tree_shape(config, 10)
    assert shape.window == (2, 3, 4, 5) and shape.leaves == 9
    assert [shape.nodes(j) for j in range(5)] == [1, 1, 3, 3, 9]
    assert shape.window_calls == 1 + 1 + 3 + 3 and shape.trained_edges == 1 + 3 + 3 + 9
    # prefix 2 calls + window 8 + tail (10 - 5 - 1) x 9 leaves
    assert shape.transformer_calls(10) == 2 + 8 + 4 * 9
    pruned = tree_shape(PlanConfig(kind="tree", tree_branch_at=[3, 5], tree_branching=3,
                                   tree_window=(2, 6), tree_trained=[4, 3]), 10)
    assert pruned.trained == (3, 4) and pruned.trained_edges == 6
    plan = make_plan(PlanConfig(kind="tree", tree_branch_at=[3, 5], tree_branching=3,
                                tree_window=(2, 6), tree_trained=[4, 3]),
                     torch.linspace(1, 0, 11), 0, 0, 0)
    assert plan.stochastic == (2, 3, 4, 5) and plan.trained == (3, 4)
    assert plan.branch_at == (3, 5) and plan.branching == 3 and plan.shared_prefix == 2
    assert replay_steps_per_chunk(PlanConfig(kind="tree", tree_branch_at=[3, 5],
                                             tree_branching=3, tree_window=(2, 6),
                                             tree_trained=[3, 4]), 10) == 2


def test_depthwise_normalisation_gives_zero_mean_and_unit_std_per_depth():
    """Each trained level's node advantages, per tree, have mean 0 and (population) std 1 with
    eps 0; every leaf under a node carries that node's advantage in the step's column; a level
    with one node per tree (before the first branch) has none."""
    shape = TreeShape((1, 2, 3, 4), (2, 3, 4), 2, (1, 2, 3, 4))
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(3 * 8, generator=generator, dtype=torch.float64).float()
    group_ids = torch.arange(3).repeat_interleave(8)
    advantages, stats = tree_advantages(rewards, group_ids, shape, 6, eps=0.0, clip=None)
    assert advantages.shape == (24, 6)
    assert torch.all(advantages[:, [0, 5]] == 0) and torch.all(advantages[:, 1] == 0)
    for level, step in ((2, 2), (3, 3), (4, 4)):
        count = shape.nodes(level)
        column = advantages[:, step].reshape(3, count, 8 // count)
        assert torch.all(column == column[..., :1])          # constant under a node
        nodes = column[..., 0].double()
        assert torch.allclose(nodes.mean(1), torch.zeros(3, dtype=torch.float64), atol=1e-6)
        assert torch.allclose(nodes.std(1, unbiased=False), torch.ones(3, dtype=torch.float64),
                              atol=1e-5)
    assert stats["edges"] == 3 * shape.trained_edges == 3 * (1 + 2 + 4 + 8)
    # the leaves' level is the group advantage of the rewards
    leaf, _ = group_advantages(rewards, group_ids, eps=0.0, clip=None)
    assert torch.allclose(advantages[:, 4], leaf, atol=1e-6)


def test_probability_weighted_advantages_read_each_edge_off_the_rows_paths():
    """tree_advantages with (B, N) path log-probs (a column a step, the same for the leaves
    below an edge) backs up with the softmax over siblings of the edges' log-probs."""
    shape = full_tree(2, 2, start=1)
    rewards = torch.tensor([1.0, 2.0, 4.0, 8.0])
    a, b, c, d, e, f = 0.3, -0.4, 1.0, 0.0, -2.0, 0.5
    paths = torch.zeros(4, 4)
    paths[:, 1] = torch.tensor([a, a, b, b])
    paths[:, 2] = torch.tensor([c, d, e, f])
    advantages, _ = tree_advantages(rewards, torch.zeros(4, dtype=torch.long), shape, 4,
                                    path_log_probs=paths)
    level1 = torch.stack([torch.tensor([1.0, 2.0]) @ torch.softmax(torch.tensor([c, d]), 0),
                          torch.tensor([4.0, 8.0]) @ torch.softmax(torch.tensor([e, f]), 0)])
    values = backup_values(rewards[None], shape, [torch.tensor([[a, b]]),
                                                  torch.tensor([[c, d, e, f]])])
    assert torch.allclose(values[1][0].float(), level1)
    node_adv, _ = group_advantages(level1, torch.zeros(2, dtype=torch.long))
    assert torch.allclose(advantages[:, 1], node_adv.repeat_interleave(2))
    mean_adv, _ = tree_advantages(rewards, torch.zeros(4, dtype=torch.long), shape, 4)
    assert torch.equal(advantages[:, 2], mean_adv[:, 2])     # the leaves' level: no backup


def test_leaves_are_taken_in_batch_order_within_each_group():
    """Rows of a tree in any interleaving: leaf i of a group is its i-th row in the batch."""
    shape = full_tree(2, 2)
    rewards = torch.tensor([1.0, 10.0, 2.0, 20.0, 3.0, 30.0, 5.0, 50.0])
    group_ids = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    advantages, _ = tree_advantages(rewards, group_ids, shape, 4, eps=0.0, clip=None)
    # group 0 leaves (1, 2, 3, 5): level-1 nodes 1.5 and 4 -> -1, +1
    assert advantages[group_ids == 0, 0].tolist() == [-1.0, -1.0, 1.0, 1.0]
    assert advantages[group_ids == 1, 0].tolist() == [-1.0, -1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="every tree needs its 4 leaves"):
        tree_advantages(rewards[:6], group_ids[:6], shape, 4)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("plan,message", [
    ({"tree_branch_at": [3, 2]}, "tree_branch_at must be a non-empty, strictly increasing"),
    ({"tree_branch_at": [1], "tree_branching": 1}, "tree_branching"),
    ({"tree_branch_at": [4], "tree_window": [0, 3]}, r"must lie in tree_window \[0, 3\)"),
    ({"tree_branch_at": [15]}, "num_steps - 1 = 15"),
    ({"tree_branch_at": [1], "tree_trained": [5]}, "tree_trained must be null or"),
    ({"tree_branch_at": [1], "solver_after": "dpmpp_2m"}, "solver_after 'dpmpp_2m'"),
])
def test_bad_plan_fields_are_named(plan, message):
    with pytest.raises(ConfigError, match=message):
        PlanConfig(kind="tree", **plan).validate(16)


def toy_config(tmp_path, *overrides):
    return load_config(CONFIG, [
        f"model.path={TOY}", f"run.output_dir={tmp_path}", "run.tracker=none",
        "run.progress=false", "run.num_threads=0", "run.comparison_grid=false",
        "run.eval_every=0", "run.checkpoint_every=0", "prompts.eval=null", "eval.rewards=[]",
        "training.prompts_per_iteration=4", *overrides])


@pytest.mark.parametrize("overrides,message", [
    (["training.group_size=4"], r"group_size \(4\) must equal the tree's leaves"),
    (["sampling.share_initial_noise=false"], "share_initial_noise: true"),
    (["sampling.rollout_batch_size=12"], "multiple of training.group_size"),
    (["training.kl_reward=0.1"], "training.kl_reward is not supported"),
    (["training.anchor_beta=0.1"], "training.anchor_beta is not supported"),
    (["training.algorithm=nft", "sampling.share_initial_noise=true"],
     "training.algorithm: grpo"),
])
def test_config_refusals_name_the_field(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        toy_config(tmp_path, *overrides)


# ----------------------------------------------------------------------------- rollouts


class CountingModel:
    """Wraps a FlowModel, counting the rows of its transformer calls."""

    def __init__(self, model):
        self.model, self.rows = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def velocity(self, x, sigma, cond, guidance_scale):
        self.rows += x.shape[0]
        return self.model.velocity(x, sigma, cond, guidance_scale)


class RowwiseModel(CountingModel):
    """Evaluates the transformer one row at a time: its velocities do not depend on the batch
    geometry (a batched matmul's last bits do), so rollouts of different chunkings compare bit
    for bit."""

    def velocity(self, x, sigma, cond, guidance_scale):
        self.rows += x.shape[0]
        return torch.cat([self.model.velocity(x[i:i + 1], sigma[i:i + 1], cond.select([i]),
                                              guidance_scale) for i in range(x.shape[0])])


def _rollout(trainer, plan_config, iteration=0, wrapper=CountingModel):
    """The toy trainer's rollout of its local batch along ``plan_config`` with a counting model."""
    from flowgrpo.rollout import rollout

    policy = trainer.policy
    records, group_ids, sample_ids = trainer.local_batch(iteration)
    plans = {int(g): make_plan(plan_config, policy.base_sigmas, iteration, int(g),
                               trainer.config.run.seed) for g in group_ids.unique()}
    counting = wrapper(policy.model)
    with torch.no_grad():
        batch = rollout(counting, [r["prompt"] for r in records],
                        [r["metadata"] for r in records], group_ids, sample_ids, plans,
                        policy.settings(iteration))
    return batch, counting.rows


@needs_toy
def test_rollout_calls_the_transformer_once_per_node(tmp_path):
    """The toy config's trees (1 prefix step, binary splits at steps 1-3, 12 tail steps): 104
    transformer rows a tree against 128 for 8 independent trajectories, 14 trained edges a tree
    in 3 replay batches a chunk, every replay row's state shared by its siblings."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(toy_config(tmp_path, "run.max_iterations=1"))
    plan_config = trainer.config.sampling.plan
    batch, rows = _rollout(trainer, plan_config)
    shape = tree_shape(plan_config, 16)
    trees = 4
    assert shape.transformer_calls(16) == 1 + 7 + 12 * 8 == 104
    assert rows == trees * 104 and batch.nfe == 104 // 8
    assert batch.trained_transitions == trees * shape.trained_edges == trees * 14
    assert sorted({r.step for r in batch.replay}) == [1, 2, 3] and len(batch.replay) == 2 * 3
    for replay in batch.replay:
        assert replay.children == 2
        pairs = replay.latents.reshape(-1, 2, *replay.latents.shape[1:])
        assert torch.equal(pairs[:, 0], pairs[:, 1])                 # siblings share the parent
        assert not torch.equal(replay.next_latents[0], replay.next_latents[1])
        # the path log-probs: each edge's on every leaf below it
        assert torch.equal(batch.tree_log_probs[replay.rows, replay.step], replay.logp_old)
        below = 2 * 8 // len(replay.rows)           # a chunk: 2 trees of 8 leaves
        column = batch.tree_log_probs[:, replay.step].reshape(-1, below)
        assert torch.all(column == column[:, :1])
    assert torch.all(batch.tree_log_probs[:, [0] + list(range(4, 16))] == 0)


@needs_toy
def test_a_tree_with_one_branch_step_is_the_one_step_plan(tmp_path):
    """Invariant: a tree branching once into k = group_size children, at step b with the window
    [b, b + 1), is Flash-GRPO's / TempFlow-GRPO's one_step plan at b bit for bit (the same
    samples, log-probs and replay rows, the prefix once a group), with fewer transformer rows at
    b (one per group instead of one per sample) and, as its only trained level, the group
    advantages of the rewards. Bit for bit with a batch-invariant transformer (``RowwiseModel``);
    the toy's batched calls of 2 and 16 rows differ in the last bits (about 1e-7 in x')."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(toy_config(tmp_path, "run.max_iterations=1",
                                 "training.prompts_per_iteration=2",
                                 "sampling.plan.tree_branch_at=[4]",
                                 "sampling.plan.tree_branching=8"))
    tree = trainer.config.sampling.plan
    one_step = PlanConfig(kind="one_step", one_step_range=(4, 5))
    batch_t, rows_t = _rollout(trainer, tree, wrapper=RowwiseModel)
    batch_o, rows_o = _rollout(trainer, one_step, wrapper=RowwiseModel)
    assert torch.equal(batch_t.media, batch_o.media)
    assert rows_o - rows_t == 2 * (8 - 1)             # step 4: one row a tree, not 8
    order = lambda b: torch.cat([r.rows for r in b.replay]).argsort()   # noqa: E731
    logp_t = torch.cat([r.logp_old for r in batch_t.replay])[order(batch_t)]
    logp_o = torch.cat([r.logp_old for r in batch_o.replay])[order(batch_o)]
    assert torch.equal(logp_t, logp_o)
    rewards = torch.rand(16, generator=torch.Generator().manual_seed(1))
    advantages, _ = tree_advantages(rewards, batch_t.group_ids, tree_shape(tree, 16), 16)
    expected, _ = group_advantages(rewards, batch_t.group_ids)
    assert torch.equal(advantages[:, 4], expected)
    assert torch.all(advantages[:, [s for s in range(16) if s != 4]] == 0)


# ----------------------------------------------------------------------------- training


@needs_toy
def test_toy_run_is_on_policy_and_its_log_probs_are_the_gaussians(tmp_path):
    """A Trainer iteration of the toy config: the first pass's ratio is exactly 1 (a branch
    step's replay evaluates one row per parent, as the rollout did); every kept transition's
    log-prob is torch.distributions.Normal's, averaged over the elements; each edge's
    advantage is its child's depth-wise normalised value."""
    from flowgrpo.trainer import Trainer

    config = toy_config(tmp_path, "run.max_iterations=1")
    trainer = Trainer(config)
    batch, rewards, _ = trainer.rollout_and_score(0)
    for replay in batch.replay:
        normal = torch.distributions.Normal(replay.mean_old.double(),
                                            replay.std.double().reshape(-1, 1, 1, 1))
        expected = normal.log_prob(replay.next_latents.double()).flatten(1).mean(1)
        assert torch.allclose(replay.logp_old.double(), expected, atol=1e-5)
    advantages, metrics = trainer.compute_advantages(batch, rewards)
    assert advantages.shape == (32, 16) and metrics["adv/edges"] == 4 * 14
    direct, _ = tree_advantages(rewards["total"], batch.group_ids,
                                tree_shape(config.sampling.plan, 16), 16,
                                eps=config.training.adv_eps, clip=config.training.adv_clip)
    assert torch.equal(advantages, direct)
    metrics = trainer.update(batch, advantages, 0)
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    assert metrics["train/optimizer_steps"] == 2
    assert math.isfinite(metrics["train/policy_loss"])
    trainer._lock.release()


@needs_toy
def test_toy_probability_weighted_backup_uses_the_rollouts_edge_log_probs(tmp_path):
    """tree_backup: prob_weighted: the trainer's advantages are tree_advantages with the
    rollout's path log-probs; the leaves' level is the mean backup's, the levels above differ."""
    from flowgrpo.trainer import Trainer

    config = toy_config(tmp_path, "run.max_iterations=1",
                        "sampling.plan.tree_backup=prob_weighted")
    trainer = Trainer(config)
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    shape = tree_shape(config.sampling.plan, 16)
    kwargs = dict(eps=config.training.adv_eps, clip=config.training.adv_clip)
    weighted, _ = tree_advantages(rewards["total"], batch.group_ids, shape, 16,
                                  path_log_probs=batch.tree_log_probs, **kwargs)
    mean, _ = tree_advantages(rewards["total"], batch.group_ids, shape, 16, **kwargs)
    assert torch.equal(advantages, weighted)
    assert torch.equal(advantages[:, 3], mean[:, 3])        # the leaves' level
    assert not torch.equal(advantages[:, 1], mean[:, 1])    # the weights act above it
    trainer._lock.release()




@pytest.mark.parametrize("family", sorted(FAMILY_RECIPES))
def test_the_tree_plan_runs_on_every_family(family, tiny_recipe_root, tmp_path):
    """One iteration of a 2 x 2 tree (branch steps 0 and 1 of 3) on each family's tiny build
    through its recipe's --tiny config (CFG, guidance embeddings, editing sources and video
    included): 6 trained edges a group, exactly on-policy on the first pass."""
    from flowgrpo.trainer import Trainer

    config = family_tiny_config(
        family, tmp_path, tiny_recipe_root,
        "sampling.plan={kind: tree, tree_branch_at: [0, 1], tree_branching: 2}",
        "sampling.share_initial_noise=true", "training.group_size=4",
        "sampling.rollout_batch_size=4", "training.kl_reward=0", "training.anchor_beta=0",
        "training.gardo={}", "training.locality={mask: 'off'}",
        "rewards.aggregation=weighted_sum", "rewards.saturation_ratio=0")
    assert config.model.family == family
    train = [h for h in Trainer(config).train() if h["phase"] == "train"]
    groups = config.training.prompts_per_iteration
    assert train[0]["trained_transitions"] == groups * (2 + 4)
    assert train[0]["train/first_pass_ratio_max_dev"] == 0.0
    assert math.isfinite(train[0]["train/policy_loss"])
