"""VGPO (arXiv 2512.12387): per-step advantages from the values of one-step predictions
(``training.advantage: vgpo``, flowgrpo/step_values.py).

Checked here: the temporal values and the advantages on hand-made values against the formula
written out by hand; a group whose rewards all agree getting the absolute term (positive above
the anchor, negative below, zero at weight 0); the reductions to GRPO (the last trained step
always, every step when the values equal the final rewards, a one-step plan plus the absolute
term); NaN rows and values; the config's refusals; and on the toy a Trainer rollout whose scored
x0-hats are x - sigma v of the kept states (a direct model call), whose update reads each step's
column and is on-policy on its first pass, with the reward calls counted; and the tiny SD3.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flowgrpo.flow_policy as flow_policy
from flowgrpo.advantages import group_advantages
from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from flowgrpo.step_values import (VGPOConfig, one_step_prediction, temporal_values,
                                  vgpo_advantages)
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "assets" / "toy"
CONFIG = ROOT / "configs" / "toy_methods" / "vgpo.yaml"
needs_toy = pytest.mark.skipif(not (TOY / "transformer").is_dir(), reason="assets/toy is not built")
NAN = float("nan")


# ----------------------------------------------------------------------------- the formula


def test_temporal_values_by_hand():
    """Q_m = sum_{j>m} gamma^(j-m-1) V_j / sum gamma^(j-m-1) over the later trained values and
    the final reward, nearest first; untrained columns are not read, a NaN value is skipped."""
    values = torch.tensor([[9.0, 0.2, 9.0, 0.4, 0.6],
                           [0.1, NAN, 0.3, 9.0, 9.0]])
    trained = torch.tensor([[True, True, False, True, True],
                            [True, True, True, False, False]])
    final = torch.tensor([1.0, 0.5])
    g = 0.5
    q = temporal_values(values, trained, final, g)
    # row 0 trains columns 0, 1, 3, 4 (column 2's 9.0 is not a trained state's value)
    expected0 = [(0.2 + g * 0.4 + g * g * 0.6 + g ** 3 * 1.0) / (1 + g + g * g + g ** 3),
                 (0.4 + g * 0.6 + g * g * 1.0) / (1 + g + g * g), NAN,
                 (0.6 + g * 1.0) / (1 + g), 1.0]
    # row 1 trains 0, 1, 2; column 1's value is missing: column 0 sees 0.3 then R
    expected1 = [(0.3 + g * 0.5) / (1 + g), (0.3 + g * 0.5) / (1 + g), 0.5, NAN, NAN]
    torch.testing.assert_close(q, torch.tensor([expected0, expected1], dtype=torch.float64),
                               equal_nan=True)
    # gamma 0: the next trained state's value; gamma 1: the plain mean of the later ones
    torch.testing.assert_close(temporal_values(values, trained, final, 0.0)[0, [0, 1, 3, 4]],
                               torch.tensor([0.2, 0.4, 0.6, 1.0], dtype=torch.float64))
    torch.testing.assert_close(temporal_values(values, trained, final, 1.0)[0, 0],
                               torch.tensor((0.2 + 0.4 + 0.6 + 1.0) / 4, dtype=torch.float64))


def test_advantages_are_the_formula_on_hand_made_values():
    """A = (Q - mean_c Q) / (std_c Q + eps) + beta (Q - b), c = (group, step), population std."""
    values = torch.tensor([[NAN, 0.0, 0.5], [NAN, 1.0, 0.5], [NAN, 0.5, 1.0],
                           [NAN, 0.2, 0.2], [NAN, 0.6, 0.0], [NAN, 0.1, 0.9]])
    trained = torch.ones(6, 3, dtype=torch.bool)
    final = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([7, 7, 7, 3, 3, 3])
    beta, b, g, eps = 0.3, 0.25, 0.8, 1e-4
    adv, stats = vgpo_advantages(values, trained, final, groups, discount=g,
                                 absolute_weight=beta, anchor=b, eps=eps, clip=None)
    q = temporal_values(values, trained, final, g)
    expected = torch.zeros(6, 3, dtype=torch.float64)
    for rows in ([0, 1, 2], [3, 4, 5]):
        for column in range(3):
            cell = q[rows, column]
            mean, std = cell.mean(), cell.std(correction=0)
            expected[rows, column] = (cell - mean) / (std + eps) + beta * (cell - b)
    torch.testing.assert_close(adv, expected.float())
    # by hand for one entry: row 0, column 0: Q = (0 + 0.8 * 0.5 + 0.64 * 1) / (1 + 0.8 + 0.64)
    assert float(q[0, 0]) == pytest.approx((0.4 + 0.64) / 2.44)
    assert stats["step_cells"] == 6 and stats["num_groups"] == 2
    assert stats["absolute_term_mean"] == pytest.approx(float((beta * (q - b)).mean()))
    # the clip acts on the sum
    clipped, _ = vgpo_advantages(values, trained, final, groups, discount=g,
                                 absolute_weight=beta, anchor=b, eps=eps, clip=0.5)
    torch.testing.assert_close(clipped, expected.float().clamp(-0.5, 0.5))


def test_a_group_whose_rewards_agree_gets_the_absolute_term():
    """All ones (values and final rewards): the relative part is exactly 0 (GRPO's signal is
    gone), the advantage is beta (1 - b) at every trained step: positive above the anchor,
    negative below it, 0 at weight 0 or with nothing after the first step to value."""
    values = torch.ones(4, 5)
    trained = torch.tensor([[False, True, True, True, False]] * 4)
    final = torch.ones(4)
    groups = torch.zeros(4, dtype=torch.long)
    adv, stats = vgpo_advantages(values, trained, final, groups, absolute_weight=0.5, anchor=0.0)
    assert torch.equal(adv[:, [1, 2, 3]], torch.full((4, 3), 0.5))
    assert torch.equal(adv[:, [0, 4]], torch.zeros(4, 2))        # untrained columns
    assert stats["zero_std_fraction"] == 1.0
    below, _ = vgpo_advantages(values, trained, final, groups, absolute_weight=0.5, anchor=1.5)
    assert torch.equal(below[:, [1, 2, 3]], torch.full((4, 3), -0.25))
    relative_only, _ = vgpo_advantages(values, trained, final, groups, absolute_weight=0.0)
    assert torch.equal(relative_only, torch.zeros(4, 5))
    # GRPO on the same group: nothing at all
    assert torch.equal(group_advantages(final, groups)[0], torch.zeros(4))


def test_reductions_to_group_grpo():
    """beta = 0: (a) the last trained step's Q is the final reward, so its advantage is GRPO's
    whatever the values; (b) values equal to each row's final reward give GRPO's advantage at
    every trained step; (c) a plan with one trained step is GRPO plus beta (R - b)."""
    torch.manual_seed(0)
    final = torch.tensor([0.9, 0.1, 0.4, 0.4, 0.0, 1.0, 0.3, 0.7])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    grpo, _ = group_advantages(final, groups)
    trained = torch.zeros(8, 6, dtype=torch.bool)
    trained[:, 1:5] = True
    values = torch.rand(8, 6)
    for gamma in (0.0, 0.6, 1.0):
        adv, _ = vgpo_advantages(values, trained, final, groups, discount=gamma,
                                 absolute_weight=0.0)
        torch.testing.assert_close(adv[:, 4], grpo)                            # (a)
        same, _ = vgpo_advantages(final[:, None].expand(8, 6), trained, final, groups,
                                  discount=gamma, absolute_weight=0.0)
        for column in range(1, 5):                                             # (b)
            torch.testing.assert_close(same[:, column], grpo)
    one = torch.zeros(8, 6, dtype=torch.bool)
    one[:4, 2] = True
    one[4:, 3] = True                                   # the groups train different steps
    adv, _ = vgpo_advantages(values, one, final, groups, absolute_weight=0.4, anchor=0.5)
    expected = grpo + 0.4 * (final - 0.5)
    torch.testing.assert_close(adv[:4, 2], expected[:4])
    torch.testing.assert_close(adv[4:, 3], expected[4:])
    assert int((adv != 0).sum()) == 8


def test_rows_without_a_final_reward_and_missing_values():
    """A NaN final reward: the row's advantages are all 0 and it leaves its cells' statistics; a
    NaN value is skipped by the Q of the earlier steps."""
    values = torch.tensor([[NAN, 0.5, NAN], [NAN, 0.1, 0.2], [NAN, 0.9, 0.3]])
    trained = torch.ones(3, 3, dtype=torch.bool)
    final = torch.tensor([1.0, NAN, 0.0])
    adv, stats = vgpo_advantages(values, trained, final, torch.zeros(3, dtype=torch.long),
                                 absolute_weight=0.0)
    assert torch.equal(adv[1], torch.zeros(3)) and stats["nan_count"] == 1
    # rows 0 and 2 at column 2: Q = R = 1 and 0 -> +-1 (eps aside)
    torch.testing.assert_close(adv[[0, 2], 2], torch.tensor([1.0, -1.0]), atol=1e-3, rtol=0)
    # column 1: row 0's Q is R (its column-2 value is missing), row 2's is (0.3 + 0) / 2
    assert float(adv[0, 1]) > 0 > float(adv[2, 1])
    with pytest.raises(ValueError, match="discount"):
        temporal_values(values, trained, final, 1.5)


def test_one_step_prediction_is_x_minus_sigma_v():
    x, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    sigma = torch.tensor([1.0, 0.5, 0.0])
    x0 = one_step_prediction(x, sigma, v)
    for i in range(3):
        torch.testing.assert_close(x0[i], x[i] - float(sigma[i]) * v[i])


# ----------------------------------------------------------------------------- the config


def test_the_config_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match="training.vgpo.discount"):
        VGPOConfig(discount=1.5)
    with pytest.raises(ConfigError, match="training.vgpo.absolute_weight"):
        load_config(CONFIG, [f"model.path={TOY}", "training.vgpo.absolute_weight=-1"])
    with pytest.raises(ConfigError, match="training.advantage must be one of auto, vgpo"):
        load_config(CONFIG, [f"model.path={TOY}", "training.advantage=dense"])
    with pytest.raises(ConfigError, match="rewards.aggregation: decoupled"):
        load_config(CONFIG, [f"model.path={TOY}", "rewards.aggregation=decoupled"])
    with pytest.raises(ConfigError, match="training.algorithm: nft"):
        load_config(CONFIG, [f"model.path={TOY}", "training.algorithm=nft",
                             "sampling.plan={kind: ode}"])
    with pytest.raises(ConfigError, match="training.kl_reward"):
        load_config(CONFIG, [f"model.path={TOY}", "training.kl_reward=0.1"])
    config = load_config(CONFIG, [f"model.path={TOY}"])
    assert config.training.advantage == "vgpo"
    assert load_config(ROOT / "configs" / "toy_methods" / "flow_grpo.yaml",
                       [f"model.path={TOY}"]).training.advantage == "auto"


# ----------------------------------------------------------------------------- training


def toy_config(tmp_path, *overrides):
    return load_config(CONFIG, [
        f"model.path={TOY}", f"run.output_dir={tmp_path}", "run.tracker=none",
        "run.progress=false", "run.num_threads=0", "run.comparison_grid=false",
        "run.eval_every=0", "run.checkpoint_every=0", "prompts.eval=null", "eval.rewards=[]",
        "training.prompts_per_iteration=4", "training.group_size=4", "sampling.num_steps=4",
        "sampling.rollout_batch_size=8", *overrides])


@needs_toy
def test_toy_scores_the_kept_states_x0_hats_and_trains_each_steps_column(tmp_path, monkeypatch):
    """One rollout: every trained state's kept x0_hat is x - sigma v from a direct model call on
    that state, the rows' first trained states are not scored and the others are, by the
    training reward of the decoded x0_hat; the advantages are (B, N) and each replay batch's loss
    reads its step's column."""
    from flowgrpo.trainer import Trainer

    kept = []
    real = flow_policy.score_step_values

    def recording(model, reward, replays, prompts, metadata, width):
        kept.extend((r.rows.clone(), r.step, r.latents.clone(), r.sigmas.clone(),
                     r.x0_pred.clone()) for r in replays)
        return real(model, reward, replays, prompts, metadata, width)

    monkeypatch.setattr(flow_policy, "score_step_values", recording)
    config = toy_config(tmp_path, "run.max_iterations=1")
    trainer = Trainer(config)
    batch, rewards, timing = trainer.rollout_and_score(0)
    policy, model = trainer.policy, trainer.policy.model
    width = len(policy.base_sigmas) - 1
    assert width == 4 and batch.step_values.shape == (16, 4)
    assert all(r.x0_pred is None for r in batch.replay)             # freed once scored
    assert len(kept) == len(batch.replay) == 2 * 3                    # 2 chunks x 3 trained steps
    with torch.no_grad():
        for rows, step, latents, sigmas, x0 in kept:
            cond = policy.replay_condition(batch, SimpleNamespace(rows=rows))
            velocity = model.velocity(latents.to(model.dtype), sigmas, cond,
                                      config.sampling.guidance_scale).float()
            sigma = sigmas.view(-1, *[1] * (latents.dim() - 1))
            torch.testing.assert_close(x0, latents - sigma * velocity, rtol=0, atol=1e-6)
            scored = batch.step_values[rows, step]
            if step == 0:   # every row's first trained step: not scored
                assert bool(torch.isnan(scored).all())
                continue
            media = model.decode(x0.to(model.dtype)).float()
            direct = policy.reward(media, [batch.prompts[i] for i in rows.tolist()],
                                   [batch.metadata[i] for i in rows.tolist()])["total"]
            torch.testing.assert_close(scored, direct.float())
    assert bool(batch.trained_steps[:, :3].all()) and not bool(batch.trained_steps[:, 3].any())
    assert timing["cost/step_value_images"] == 16 * 2
    assert timing["cost/step_value_reward_calls"] == 2 * 2
    advantages, metrics = trainer.compute_advantages(batch, rewards)
    assert advantages.shape == (16, 4) and bool((advantages[:, 3] == 0).all())
    assert metrics["adv/step_cells"] == 4 * 3
    replay = batch.replay[4]
    weights = torch.ones(len(replay.rows))
    _, record = policy.replay_loss(batch, replay, advantages, 0, 1e-3, weights)
    torch.testing.assert_close(record["advantages"].cpu(),
                               advantages[replay.rows, replay.step])


@needs_toy
def test_toy_run_is_on_policy_on_its_first_pass_and_counts_its_reward_calls(tmp_path):
    from flowgrpo.trainer import Trainer

    history = Trainer(toy_config(tmp_path, "run.max_iterations=2")).train()
    train = [h for h in history if h["phase"] == "train"]
    assert len(train) == 2
    for record in train:
        assert record["train/first_pass_ratio_max_dev"] == 0.0
        assert record["trained_transitions"] == 16 * 3
        assert record["cost/step_value_images"] == 16 * 2
        assert record["cost/step_value_reward_calls"] == 4
        assert math.isfinite(record["train/policy_loss"])
        assert record["train/optimizer_steps"] >= 1


def test_tiny_sd3_iteration_is_on_policy_on_its_first_pass(tiny_sd3_path, tmp_path):
    """The same on a family's tiny build (CFG, a VAE decode of the x0-hats, a CLIP-style
    reward): one iteration, ratio 1 on the first pass, every later trained state scored."""
    from flowgrpo.trainer import Trainer

    config = tiny_config(tiny_sd3_path, tmp_path, "sampling.num_steps=4",
                         "training.advantage=vgpo",
                         "sampling.plan={kind: full, train_fraction: 0.99}")
    train = [h for h in Trainer(config).train() if h["phase"] == "train"]
    samples = config.training.prompts_per_iteration * config.training.group_size
    assert train[0]["train/first_pass_ratio_max_dev"] == 0.0
    assert train[0]["trained_transitions"] == samples * 3
    assert train[0]["cost/step_value_images"] == samples * 2
    assert math.isfinite(train[0]["train/policy_loss"])


# ----------------------------------------------------------------------------- on the default

BRANCH_CONFIG = ROOT / "configs" / "toy_methods" / "vgpo_branch.yaml"


def test_branch_config_is_the_default_with_vgpo_advantages():
    """vgpo_branch.yaml is configs/toy_geneval.yaml field for field but for its name, the
    advantage estimator, whose settings are vgpo.yaml's, and the lr its fair grid chose."""
    from dataclasses import asdict

    default = asdict(load_config(ROOT / "configs" / "toy_geneval.yaml", [f"model.path={TOY}"]))
    branch = asdict(load_config(BRANCH_CONFIG, [f"model.path={TOY}"]))
    paper = load_config(CONFIG, [f"model.path={TOY}"])
    assert branch["training"]["advantage"] == "vgpo"
    assert branch["training"]["vgpo"] == asdict(paper.training.vgpo)
    assert (branch["training"]["lr"], default["training"]["lr"]) == (4e-4, 2e-4)
    for config in (default, branch):
        config.pop("name")
        for key in ("advantage", "vgpo", "lr"):
            config["training"].pop(key)
    assert branch == default


@needs_toy
def test_branch_plan_scores_the_window_states_after_the_first_and_trains_only_the_window(
        tmp_path):
    """On the default's plan a row trains the 4 steps of its window (start drawn from 0-3):
    three of its states are scored (the first trained one is not), its advantages are zero
    outside the window, and each trained column gets the cell-normalised Q."""
    from flowgrpo.trainer import Trainer

    config = load_config(BRANCH_CONFIG, [
        f"model.path={TOY}", f"run.output_dir={tmp_path}", "run.tracker=none",
        "run.progress=false", "run.num_threads=0", "run.comparison_grid=false",
        "run.eval_every=0", "run.checkpoint_every=0", "prompts.eval=null", "eval.rewards=[]",
        "training.prompts_per_iteration=2", "training.group_size=4",
        "sampling.rollout_batch_size=8", "training.gradient_accumulation_steps=1",
        "run.max_iterations=1"])
    trainer = Trainer(config)
    batch, rewards, timing = trainer.rollout_and_score(0)
    trained = batch.trained_steps.bool()
    assert trained.shape == (8, 16)
    for row in trained:
        steps = row.nonzero().flatten().tolist()
        assert len(steps) == 4 and steps == list(range(steps[0], steps[0] + 4))
        assert steps[0] <= 3
    assert timing["cost/step_value_images"] == 8 * 3
    scored = ~torch.isnan(batch.step_values)
    first = trained.float().argmax(dim=1)
    for i in range(8):
        expected = trained[i].clone()
        expected[first[i]] = False
        assert torch.equal(scored[i], expected)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    assert bool((advantages[~trained] == 0).all())
