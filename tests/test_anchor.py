"""Untrained-step anchoring (training.anchor_beta): the penalty's closed form, which steps are
anchored, and in the trainer: zero while the policy is the reference, the added gradient pulls
the untrained steps' velocity back to the reference's, off means untouched."""
from __future__ import annotations

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.losses import velocity_anchor
from flowgrpo.plans import StepPlan
from flowgrpo.rollout import RolloutSettings, choose_anchor_steps
from flowgrpo.trainer import Trainer
from tests.test_trainer import tiny_config

BRANCH = "sampling.plan={kind: branch, window_size: 1, branch_range: [0, 1]}"


def test_velocity_anchor_is_the_mean_squared_difference_per_row():
    velocity = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[0.0, 0.0], [0.0, 0.0]]],
                            requires_grad=True)
    reference = torch.tensor([[[1.0, 0.0], [3.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])
    penalty = velocity_anchor(velocity, reference)
    assert torch.allclose(penalty, torch.tensor([(4 + 16) / 4, 1.0]))
    penalty.sum().backward()          # d/dv mean (v - r)^2 = 2 (v - r) / D
    assert torch.allclose(velocity.grad, 2 * (velocity.detach() - reference) / 4)


def _plan(trained: tuple[int, ...], num_steps: int = 8) -> StepPlan:
    sigmas = torch.linspace(1, 0, num_steps + 1)
    return StepPlan(sigmas=sigmas, stochastic=trained, trained=trained)


def _settings(iteration: int = 0, seed: int = 0, sigma_max: float = 1.0) -> RolloutSettings:
    return RolloutSettings(kind="flow_sde", noise_level=0.7, guidance_scale=1.0, batch_size=4,
                           share_initial_noise=False, seed=seed, iteration=iteration,
                           anchor_sigma_max=sigma_max)


def test_anchor_steps_are_untrained_distinct_and_seeded():
    plan = _plan((1, 2))
    seen = set()
    for chunk in range(20):
        steps = choose_anchor_steps(plan, 0, 3, _settings(), chunk)
        assert len(steps) == 3 == len(set(steps)) and steps == sorted(steps)
        assert not set(steps) & {1, 2} and all(0 <= s < 8 for s in steps)
        assert steps == choose_anchor_steps(plan, 0, 3, _settings(), chunk)   # seeded
        seen.update(steps)
    assert seen == {0, 3, 4, 5, 6, 7}           # every untrained step can be drawn
    assert choose_anchor_steps(plan, 5, 9, _settings(), 0) == [5, 6, 7]      # from first_step
    assert choose_anchor_steps(plan, 0, 0, _settings(), 0) == []
    draws = {tuple(choose_anchor_steps(plan, 0, 1, _settings(iteration=i), 0)) for i in range(30)}
    assert len(draws) > 1                       # drawn afresh each iteration
    # sigmas 1, 0.875, ..., 0.125 at steps 0..7: sigma <= 0.4 leaves steps 5, 6, 7
    low = {s for k in range(20) for s in choose_anchor_steps(plan, 0, 2, _settings(sigma_max=0.4), k)}
    assert low == {5, 6, 7}


def test_anchor_config_errors_name_the_field(tiny_sd3_path, tmp_path):
    with pytest.raises(ConfigError, match="training.anchor_beta"):
        tiny_config(tiny_sd3_path, tmp_path, "training.anchor_beta=-1")
    with pytest.raises(ConfigError, match="training.anchor_steps"):
        tiny_config(tiny_sd3_path, tmp_path, "training.anchor_steps=0")
    with pytest.raises(ConfigError, match="training.anchor_sigma_max"):
        tiny_config(tiny_sd3_path, tmp_path, "training.anchor_sigma_max=0")


def _anchor_gap(trainer, iteration: int = 5) -> float:
    """Mean squared velocity difference to the reference over a fresh rollout's anchored states."""
    policy = trainer.policy
    batch, _, _ = trainer.rollout_and_score(iteration)
    settings = policy.settings(iteration)
    gaps = []
    with torch.no_grad():
        for replay in batch.replay:
            for anchor in replay.anchors:
                cond = policy.replay_condition(batch, anchor)
                v = policy.model.velocity(anchor.latents, anchor.sigmas, cond, 1.0)
                with policy.reference_policy():
                    v_ref = policy.model.velocity(anchor.latents, anchor.sigmas, cond, 1.0)
                gaps.append(float(velocity_anchor(v, v_ref).mean()))
    assert gaps, "the rollout kept no anchored state"
    return sum(gaps) / len(gaps)


@pytest.mark.parametrize("lora", [True, False])
def test_anchor_is_zero_at_the_reference_and_pulls_back_after_a_perturbation(
        tiny_sd3_path, tmp_path, lora):
    common = (BRANCH, "training.skip_zero_std_groups=false", "training.adv_scale=none",
              "training.anchor_steps=2", f"model.lora.enabled={str(lora).lower()}",
              "rewards.components=[{name: 'tests.helpers:Constant'}]")   # no policy gradient
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path / "a", *common,
                                  "training.anchor_beta=1.0", "training.lr=1e-3"))
    batch, rewards, _ = trainer.rollout_and_score(0)
    replay = next(r for r in batch.replay if r.anchors)
    assert {a.step for a in replay.anchors} <= {1, 2, 3}         # untrained steps of the branch
    penalty = trainer.policy.algorithm.anchor_penalty(batch, replay.anchors, trainer.policy.settings(0))
    assert float(penalty.detach()) == 0.0                         # policy == reference
    # Move the policy away from the reference, then train on the anchor alone (the reward is
    # constant, so advantages are 0): the gap must shrink.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainer.trainable.values():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    before = _anchor_gap(trainer)
    assert before > 0
    for iteration in range(1, 6):
        metrics = trainer.run_iteration(iteration)
        assert metrics["train/anchor"] > 0
    assert _anchor_gap(trainer) < 0.8 * before


def test_anchor_off_keeps_no_state_and_the_same_weights(tiny_sd3_path, tmp_path):
    off = Trainer(tiny_config(tiny_sd3_path, tmp_path / "off", BRANCH))
    batch, _, _ = off.rollout_and_score(0)
    assert all(not r.anchors for r in batch.replay)
    # With the policy still equal to the reference, the anchor adds 0 to the loss and nothing to
    # the gradient: one iteration with and without it gives the same weights.
    on = Trainer(tiny_config(tiny_sd3_path, tmp_path / "on", BRANCH, "training.anchor_beta=5.0"))
    off.run_iteration(0)
    metrics = on.run_iteration(0)
    assert metrics["train/anchor"] == 0.0
    for name, param in off.trainable.items():
        assert torch.allclose(param, on.trainable[name], atol=1e-7), name


# ------------------------------------------------------------------ sample-based algorithms

from flowgrpo.algorithms.base import anchor_levels          # noqa: E402
from tests.test_algorithms import SAMPLE_ALGORITHMS, _algorithm   # noqa: E402

# Sample-based runs on the tiny SD3 train the noisier half of the schedule; the anchor takes the
# rest (below every training level).
SAMPLE_ANCHOR = ("training.timesteps.fraction=0.5", "training.anchor_steps=2")


@pytest.mark.parametrize("sampling", ["discrete", "uniform"])
def test_anchor_levels_lie_below_every_training_level(sampling):
    schedule = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    # 10 non-zero levels, fraction 0.6: the first 6 (1.0 .. 0.5) are trained, in any mode
    levels = anchor_levels(schedule, 0.6, 0.35)
    assert torch.allclose(levels, torch.tensor([0.3, 0.2, 0.1]))
    assert torch.allclose(anchor_levels(schedule, 0.6, 1.0), torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert anchor_levels(schedule, 1.0, 1.0).numel() == 0
    from flowgrpo.algorithms.base import draw_sigmas
    drawn = draw_sigmas(schedule, 64, sampling, 0.6, torch.Generator().manual_seed(0))
    assert float(drawn.min()) > float(anchor_levels(schedule, 0.6, 1.0).max())


@pytest.mark.parametrize("algorithm", SAMPLE_ALGORITHMS)
def test_sample_algorithm_anchor_is_zero_at_the_reference(tiny_sd3_path, tmp_path, algorithm):
    """Each sample-based algorithm takes training.anchor_beta (it was ignored before): at the
    reference the anchor is 0 and adds nothing to the gradient, so one iteration with and without
    it gives the same weights; the metric is reported."""
    base = (*_algorithm(algorithm), *SAMPLE_ANCHOR, "training.lr=1e-3")
    off = Trainer(tiny_config(tiny_sd3_path, tmp_path / "off", *base))
    on = Trainer(tiny_config(tiny_sd3_path, tmp_path / "on", *base, "training.anchor_beta=5.0"))
    assert "train/anchor" not in off.run_iteration(0)
    metrics = on.run_iteration(0)
    assert metrics["train/anchor"] == 0.0
    for name, param in off.trainable.items():
        assert torch.allclose(param, on.trainable[name], atol=1e-7), name


def _sample_anchor_gap(trainer, iteration: int) -> float:
    """Mean squared velocity gap to the reference over the levels the anchor draws from, on a
    fresh rollout's final samples re-noised with fixed noise."""
    policy = trainer.policy
    t = trainer.config.training
    batch, _, _ = trainer.rollout_and_score(iteration)
    levels = anchor_levels(policy.base_sigmas, t.timesteps.fraction, t.anchor_sigma_max)
    rows = torch.arange(len(batch.prompts))
    cond = policy.replay_condition(batch, type("R", (), {"rows": rows})())
    clean = batch.final_latents.float()
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(1))
    gaps = []
    with torch.no_grad():
        for sigma in levels:
            s = sigma.expand(len(rows))
            x = (1 - sigma) * clean + sigma * noise
            v = policy.model.velocity(x, s, cond, 1.0)
            with policy.reference_policy():
                v_ref = policy.model.velocity(x, s, cond, 1.0)
            gaps.append(float(velocity_anchor(v, v_ref).mean()))
    return sum(gaps) / len(gaps)


def test_sample_algorithm_anchor_pulls_the_low_noise_velocity_back(tiny_sd3_path, tmp_path):
    """DGPO with a constant reward has no policy gradient (every advantage is 0), so after a
    perturbation of the weights only the anchor trains: the low-noise velocity gap to the
    reference shrinks, and the reported anchor is positive."""
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, *_algorithm("dgpo"), *SAMPLE_ANCHOR,
                                  "training.dgpo.clip=false", "training.kl_beta=0",
                                  "training.anchor_beta=1.0", "training.lr=1e-3",
                                  "training.adv_scale=none",
                                  "rewards.components=[{name: 'tests.helpers:Constant'}]"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainer.trainable.values():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    before = _sample_anchor_gap(trainer, 9)
    assert before > 0
    for iteration in range(5):
        assert trainer.run_iteration(iteration)["train/anchor"] > 0
    assert _sample_anchor_gap(trainer, 9) < 0.8 * before


def test_sample_algorithm_anchor_without_levels_is_a_clear_error(tiny_sd3_path, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, *_algorithm("nft"),
                                  "training.timesteps.fraction=1.0", "training.anchor_beta=1.0"))
    with pytest.raises(ConfigError, match="training.timesteps.fraction"):
        trainer.run_iteration(0)
