"""TempFlow-GRPO (arXiv 2508.04324; Shredded-Pork/TempFlow-GRPO, read for facts only):
trajectory branching (``sampling.plan.kind: one_step`` with ``one_step_select: cycle`` and shared
initial noise) and noise-aware weights (``training.loss_scale: noise_aware``,
``losses.noise_aware_weights``).

Checked here: the weights' formula by hand and on the reference's own schedule (its constant
2.25), their normalisation, equal weights on a uniform-noise schedule, the branch steps a cycling
plan takes (every step of the range, as the reference branches every step), the trainer's weights
on the toy, and short Trainer runs on the toy and the tiny SD3 being on-policy on their first pass.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.algorithms.grpo import GRPO, schedule_step_stds
from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from flowgrpo.flow_policy import FlowPolicy
from flowgrpo.losses import noise_aware_weights
from flowgrpo.plans import PlanConfig, make_plan
from flowgrpo.sde import static_shift_sigmas, transition
from tests.helpers import assert_on_policy_training, tiny_config

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "assets" / "toy"
CONFIG = ROOT / "configs" / "toy_methods" / "tempflow_grpo.yaml"
needs_toy = pytest.mark.skipif(not (TOY / "transformer").is_dir(), reason="assets/toy is not built")


def shifted_sigmas(num_steps: int = 16, shift: float = 3.0) -> torch.Tensor:
    """The toy's schedule: shift t / (1 + (shift - 1) t), t = linspace(1, 0)."""
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def _policy(config, base_sigmas: torch.Tensor):
    """A FlowPolicy shell with ``config`` and a rollout schedule, for its step weights."""
    policy = object.__new__(FlowPolicy)
    policy.config, policy.base_sigmas = config, base_sigmas
    policy.accelerator = SimpleNamespace(num_processes=1)
    policy.algorithm = object.__new__(GRPO)
    policy.algorithm.policy, policy.algorithm.config = policy, config
    return policy


# ----------------------------------------------------------------------------- the weights


def test_weights_are_the_step_std_over_the_schedules_mean_std():
    # schedule stds 0.4, 0.2, 0.1, 0.1: mean 0.2
    schedule = torch.tensor([0.4, 0.2, 0.1, 0.1])
    weights = noise_aware_weights(torch.tensor([0.4, 0.1, 0.2, 0.05]), schedule)
    torch.testing.assert_close(weights, torch.tensor([2.0, 0.5, 1.0, 0.25]))
    # the schedule's own steps average exactly 1
    assert float(noise_aware_weights(schedule, schedule).mean()) == pytest.approx(1.0, abs=1e-7)
    with pytest.raises(ValueError, match="noise_level > 0"):
        noise_aware_weights(torch.tensor([0.1]), torch.zeros(3))


def test_schedule_stds_are_flow_grpos_step_std_and_the_reference_constant_is_one_over_their_mean():
    """The reference weighs step i's surrogate by 2.25 std_i, std_i = a sqrt(sigma / (1 -
    sigma~)) sqrt(dt) (sigma~ = sigmas[1] at sigma = 1), a = 0.7, on SD3.5-M's 10 steps (shift
    3), trained steps 0..8; 2.25 is 1 / their mean, so its weights are ours."""
    sigmas = static_shift_sigmas(10, 3.0).double()
    stds = schedule_step_stds("flow_sde", sigmas, 0.7).double()
    assert stds.shape == (9,)
    by_hand = []
    for i in range(9):
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        tilde = float(sigmas[1]) if sigma == 1.0 else sigma
        by_hand.append(0.7 * math.sqrt(sigma / (1 - tilde)) * math.sqrt(sigma - sigma_next))
    torch.testing.assert_close(stds, torch.tensor(by_hand, dtype=torch.float64), rtol=1e-5, atol=0)
    assert stds[0] == pytest.approx(0.7, abs=1e-6)       # step 0: exactly a
    assert 1 / float(stds.mean()) == pytest.approx(2.25, abs=0.01)
    weights = noise_aware_weights(stds, stds)
    torch.testing.assert_close(weights, 2.25 * stds, rtol=0.01, atol=0)
    # early, noisy steps weigh more: after the first two, the weights fall step by step
    assert float(weights[1]) > 1.5 and float(weights[-1]) < 0.6
    assert bool((weights[2:] < weights[1:-1]).all())


def test_a_uniform_noise_schedule_gives_equal_weights():
    """dance_sde's std is eta sqrt(dt): on a uniform grid every step has the same std, so every
    weight is 1 (and a flat schedule weighs nothing up or down)."""
    sigmas = torch.linspace(1.0, 0.0, 9)
    stds = schedule_step_stds("dance_sde", sigmas, 0.5)
    weights = noise_aware_weights(stds, stds)
    torch.testing.assert_close(weights, torch.ones(7), rtol=1e-5, atol=0)


def test_the_trainers_step_weights_are_the_rows_step_std_over_the_schedules():
    """``training.loss_scale: noise_aware`` in GRPO's step weights: each row of each replay batch
    gets its step's total std (the rollout's ``Transition.std``) over the schedule's mean, the
    same for every batch holding that step, whatever else the iteration trains."""
    config = load_config(CONFIG, [f"model.path={TOY}"])
    sigmas = shifted_sigmas()
    policy = _policy(config, sigmas)

    def replay(step: int, rows: int):
        out = transition("flow_sde", torch.zeros(rows, 4), torch.zeros(rows, 4),
                         sigmas[step].expand(rows), sigmas[step + 1].expand(rows),
                         noise_level=0.7)
        return SimpleNamespace(logp_old=torch.zeros(rows), sigmas=sigmas[step].expand(rows),
                               sigmas_next=sigmas[step + 1].expand(rows), std=out.std)

    batches = [replay(0, 3), replay(7, 2), replay(14, 4)]
    weights = policy.step_weights(batches)
    schedule = schedule_step_stds("flow_sde", sigmas, 0.7)
    for batch, w, step in zip(batches, weights, (0, 7, 14)):
        torch.testing.assert_close(w, (schedule[step] / schedule.mean()).expand(len(w)))
    # the same step weighs the same alone
    torch.testing.assert_close(policy.step_weights([replay(7, 2)])[0], weights[1])
    # off: every weight 1
    config.training.loss_scale = "none"
    assert all(torch.equal(w, torch.ones_like(w)) for w in policy.step_weights(batches))


# ----------------------------------------------------------------------------- the branch step


def test_cycling_groups_branch_at_consecutive_steps_and_cover_every_step():
    """Group g of iteration t branches at lo + (t + g) mod (hi - lo): one SDE (and trained) step,
    the rest ODE, the group's prefix up to it shared. With as many groups as steps an iteration
    branches at every step of the range once, as the reference branches every initial noise at
    every step but the last; with fewer, every step is taken equally often over hi - lo
    iterations."""
    sigmas = shifted_sigmas()
    config = PlanConfig(kind="one_step", one_step_range=[0, 15], one_step_select="cycle")
    for iteration in (0, 1, 9):
        for group in range(8):
            plan = make_plan(config, sigmas, iteration, group, seed=5)
            k = (iteration + group) % 15
            assert plan.stochastic == plan.trained == (k,)
            assert plan.shared_prefix == k and plan.num_steps == 16
            assert [plan.solver_for(i) for i in range(16)] == \
                ["sde" if i == k else "euler" for i in range(16)]
    steps = [make_plan(config, sigmas, 0, g, seed=5).stochastic[0] for g in range(15)]
    assert sorted(steps) == list(range(15))
    counts = torch.zeros(15, dtype=torch.long)
    for iteration in range(15):
        for group in range(8):
            counts[make_plan(config, sigmas, iteration, group, seed=5).stochastic[0]] += 1
    assert torch.equal(counts, torch.full((15,), 8))
    # a sub-range cycles within it; the seed plays no part
    narrow = PlanConfig(kind="one_step", one_step_range=[2, 7], one_step_select="cycle")
    assert [make_plan(narrow, sigmas, 3, g, seed=s).stochastic[0]
            for g, s in zip(range(6), (0, 1, 2, 3, 4, 5))] == [5, 6, 2, 3, 4, 5]


def test_cycling_one_step_plan_is_the_unmerged_merge_plan():
    """E-GRPO's merge plan with counts 1 at every step of the range takes the same step for the
    same (iteration, group): the two express one branching rule."""
    sigmas = shifted_sigmas()
    cycle = PlanConfig(kind="one_step", one_step_range=[0, 15], one_step_select="cycle")
    merge = PlanConfig(kind="merge", merge_at=list(range(15)))
    for iteration in (0, 4):
        for group in range(8):
            assert make_plan(cycle, sigmas, iteration, group, 0) == \
                make_plan(merge, sigmas, iteration, group, 0)


def test_random_stays_the_default_and_a_bad_select_is_named():
    assert PlanConfig().one_step_select == "random"
    flash = load_config(ROOT / "configs" / "toy_methods" / "flash_grpo.yaml", [f"model.path={TOY}"])
    assert flash.sampling.plan.one_step_select == "random"
    with pytest.raises(ConfigError, match="sampling.plan.one_step_select"):
        PlanConfig(kind="one_step", one_step_select="first").validate(16)
    with pytest.raises(ConfigError, match="training.loss_scale"):
        load_config(CONFIG, [f"model.path={TOY}", "training.loss_scale=noise"])


# ----------------------------------------------------------------------------- training


def toy_config(tmp_path, *overrides):
    return load_config(CONFIG, [
        f"model.path={TOY}", f"run.output_dir={tmp_path}", "run.tracker=none",
        "run.progress=false", "run.num_threads=0", "run.comparison_grid=false",
        "run.eval_every=0", "run.checkpoint_every=0", "prompts.eval=null", "eval.rewards=[]",
        "training.prompts_per_iteration=4", "training.group_size=4",
        "sampling.rollout_batch_size=8", *overrides])


@needs_toy
def test_toy_groups_branch_from_a_shared_prefix_with_the_noise_aware_weights(tmp_path):
    """One rollout of the toy config: group g trains step g (iteration 0), its members enter it
    from one state and leave it apart, and the trainer weighs each row by its step's std over
    the toy schedule's mean step std."""
    from flowgrpo.trainer import Trainer

    config = toy_config(tmp_path, "run.max_iterations=1")
    trainer = Trainer(config)
    batch, _, _ = trainer.rollout_and_score(0)
    steps_of_group: dict[int, set[int]] = {}
    entry: dict[int, list] = {}
    for replay in batch.replay:
        for j, row in enumerate(replay.rows.tolist()):
            group = int(batch.group_ids[row])
            steps_of_group.setdefault(group, set()).add(replay.step)
            entry.setdefault(group, []).append((replay.latents[j], replay.next_latents[j]))
    assert steps_of_group == {g: {g} for g in range(4)}
    for group, states in entry.items():
        assert len(states) == config.training.group_size
        assert all(torch.equal(x, states[0][0]) for x, _ in states)              # shared prefix
        assert all(not torch.equal(x1, states[0][1]) for _, x1 in states[1:])    # branched
    schedule = schedule_step_stds("flow_sde", trainer.policy.base_sigmas, 0.7)
    torch.testing.assert_close(trainer.policy.base_sigmas, shifted_sigmas(), rtol=0, atol=1e-6)
    for replay, weights in zip(batch.replay, trainer.policy.step_weights(batch.replay)):
        torch.testing.assert_close(weights.cpu(), (schedule[replay.step] / schedule.mean())
                                   .expand(len(weights)), rtol=1e-6, atol=0)


@needs_toy
def test_toy_run_is_on_policy_on_its_first_pass(tmp_path):
    assert_on_policy_training(toy_config(tmp_path, "run.max_iterations=2"), 16, iterations=2)


def test_tiny_sd3_iteration_is_on_policy_on_its_first_pass(tiny_sd3_path, tmp_path):
    config = tiny_config(tiny_sd3_path, tmp_path, "sampling.num_steps=5",
                         "sampling.share_initial_noise=true", "training.loss_scale=noise_aware",
                         "sampling.plan={kind: one_step, one_step_range: [0, 4], "
                         "one_step_select: cycle}")
    assert_on_policy_training(config, 8)


def test_early_config_is_tempflow_branching_only_at_steps_0_to_8():
    """tempflow_grpo_early.yaml is tempflow_grpo.yaml but for its name, its branch range and the
    iteration cap (and evaluation interval) calibrated for it."""
    from dataclasses import asdict

    early = asdict(load_config(ROOT / "configs" / "toy_methods" / "tempflow_grpo_early.yaml",
                               [f"model.path={TOY}"]))
    full = asdict(load_config(CONFIG, [f"model.path={TOY}"]))
    assert full["sampling"]["plan"]["one_step_range"] == (0, 15)
    assert early["sampling"]["plan"]["one_step_range"] == (0, 9)
    for config in (early, full):
        config.pop("name")
        config["sampling"]["plan"].pop("one_step_range")
        for key in ("max_iterations", "eval_every", "checkpoint_every"):
            config["run"].pop(key)
    assert early == full
