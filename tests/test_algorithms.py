"""The algorithm registry (training.algorithm): every algorithm on every family's tiny build, the
sample-based algorithms' first-pass invariants, DiffusionNFT's loss and gradient against the
reference implementation's formula, the old policy's update and resume, and the config's
refusals."""
from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.algorithms import ALGORITHMS, algorithm_class
from flowgrpo.algorithms.dpo import best_worst_pairs
from flowgrpo.config import ConfigError, load_config, validate
from flowgrpo.config_algorithms import ALGORITHM_NAMES
from flowgrpo.matching_losses import old_policy_decay, velocity_error
from flowgrpo.tiny_recipe import load_tiny_config
from flowgrpo.trainer import Trainer
from tests.helpers import tiny_config

SAMPLE_ALGORITHMS = ("nft", "awm", "dgpo", "dpo", "gdro")
# What a sample-based run needs on top of a GRPO recipe: a deterministic sampler from
# independent noise, one level per sample, none of GRPO's transition options.
SAMPLE_OVERRIDES = ["sampling.plan={kind: ode}", "sampling.share_initial_noise=false",
                    "training.timesteps.count=1", "training.ratio_norm=false",
                    "training.dt_reweight=false", "training.rectification=false",
                    "training.kl_reward=0", "training.loss_scale=none",
                    "training.skip_zero_std_groups=false", "training.anchor_beta=0"]


def _algorithm(name: str) -> list[str]:
    return [f"training.algorithm={name}", *SAMPLE_OVERRIDES]


def test_registry_names_and_kinds():
    assert tuple(ALGORITHMS) == ALGORITHM_NAMES
    for name in ALGORITHM_NAMES:
        cls = algorithm_class(name)
        assert cls.name == name
        assert cls.keeps_transitions == (name == "grpo")


# ------------------------------------------------------------------ every family x algorithm

# family -> the recipe whose tiny build runs it (qwen_image_edit has no recipe: the toy editing
# model stands for the editing path on the CPU below)
FAMILY_RECIPES = {"sd3": "sd3_pickscore", "flux": "flux_flowgrpo", "flux_kontext": "kontext_edit",
                  "qwen_image": "qwen_image_ocr", "wan": "wan_video", "wan_i2v": "wan_i2v_pickscore",
                  "flux2": "flux2_klein_pickscore",
                  "qwen_image_edit_plus": "qwen_image_edit_plus_pickscore", "z_image": "z_image_turbo_pickscore",
                  "hunyuan_video": "hunyuan_video_dance_grpo", "ltx2": "ltx2_pickscore"}


def family_tiny_config(family: str, tmp_path, tiny_recipe_root, *overrides: str):
    """One iteration of ``family``'s recipe (FAMILY_RECIPES) on its tiny build, 3 steps, one
    optimiser step, plus ``overrides`` (Qwen-Image's OCR reward swapped for a cheap one)."""
    recipe = FAMILY_RECIPES[family]
    reward = ["rewards.components=[{name: jpeg_compressibility}]"] \
        if recipe in ("qwen_image_ocr",) else []
    return load_tiny_config(f"configs/{recipe}.yaml", [
        f"run.output_dir={tmp_path}", "run.progress=false", "run.comparison_grid=false",
        "run.max_iterations=1", "sampling.num_steps=3", "prompts.num_eval=1",
        "training.optimizer_steps_per_epoch=1", *reward, *overrides], root=tiny_recipe_root)




@pytest.mark.parametrize("algorithm", SAMPLE_ALGORITHMS)
@pytest.mark.parametrize("family", sorted(FAMILY_RECIPES))
def test_every_algorithm_runs_on_every_family(family, algorithm, tiny_recipe_root, tmp_path):
    """One iteration of each sample-based algorithm on each family's tiny build through its
    recipe's --tiny config (CFG, guidance embeddings, editing sources and video included): the
    rollout keeps final latents and no transition, the update takes an optimiser step with a
    finite loss."""
    config = family_tiny_config(family, tmp_path, tiny_recipe_root, *_algorithm(algorithm))
    assert config.model.family == family
    history = Trainer(config).train()
    train = [h for h in history if h["phase"] == "train"]
    # every (sample, noise level) is trained once; dpo trains the best and worst of a group
    samples = config.training.prompts_per_iteration * config.training.group_size
    expected = 2 * config.training.prompts_per_iteration if algorithm == "dpo" else samples
    assert 0 < train[0]["trained_transitions"] <= expected
    assert algorithm == "dpo" or train[0]["trained_transitions"] == expected
    assert train[0]["train/optimizer_steps"] == 1
    assert math.isfinite(train[0]["train/policy_loss"])


@pytest.mark.parametrize("algorithm", SAMPLE_ALGORITHMS)
def test_every_algorithm_runs_on_the_editing_toy(algorithm, edit_dir, tmp_path):
    config = load_config("configs/toy_edit.yaml", overrides=[
        f"model.path={edit_dir}", f"run.output_dir={tmp_path}", "run.progress=false",
        "run.comparison_grid=false", "run.max_iterations=1", "prompts.eval=null",
        "training.prompts_per_iteration=2", "training.group_size=4", "sampling.num_steps=3",
        "training.locality={mask: 'off'}",
        "training.gradient_accumulation_steps=0", "eval.rewards=[]",
        "rewards.components=[{name: toy_edit, options: {score: partial}}]",
        *_algorithm(algorithm)])
    train = [h for h in Trainer(config).train() if h["phase"] == "train"]
    assert train[0]["train/optimizer_steps"] == 1
    assert math.isfinite(train[0]["train/policy_loss"])


# ------------------------------------------------------------------ first-pass invariants


def _tiny(path, tmp_path, *overrides):
    return tiny_config(path, tmp_path, "run.max_iterations=1", "run.progress=false",
                       "run.comparison_grid=false", "prompts.eval=null", "sampling.num_steps=4",
                       "training.timesteps.count=2", *overrides)


def test_awm_is_on_policy_on_the_first_pass_and_clips_the_second(tiny_sd3_path, tmp_path):
    config = _tiny(tiny_sd3_path, tmp_path, *_algorithm("awm"), "training.timesteps.count=2",
                   "training.num_inner_epochs=2", "training.lr=3e-2",
                   "training.clip_low=1e-6", "training.clip_high=1e-6",
                   "training.awm.weighting=uniform")
    train = [h for h in Trainer(config).train() if h["phase"] == "train"]
    assert train[0]["train/first_pass_ratio_max_dev"] == 0.0
    assert train[0]["train/optimizer_steps"] == 2
    # the second epoch replays the same noise off-policy: ratios move and the tiny clip acts
    assert train[0]["train/clip_fraction"] > 0


def test_dpo_starts_at_log_two(tiny_sd3_path, tmp_path):
    """LoRA starts at zero, so the policy is the reference: every pair's loss is log 2 before
    the first step (one step per iteration: every unit is scored before it)."""
    config = _tiny(tiny_sd3_path, tmp_path, *_algorithm("dpo"),
                   "training.gradient_accumulation_steps=0")
    train = [h for h in Trainer(config).train() if h["phase"] == "train"]
    assert train[0]["train/policy_loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert train[0]["train/implicit_accuracy"] == 0.0


def test_dgpo_at_the_reference_weighs_every_group_by_one_half(tiny_sd3_path, tmp_path):
    """With the policy equal to the base reference z = 0 for every group, so the loss of a unit
    is 1/2 mean(A e): computed here from the model's own velocity."""
    config = _tiny(tiny_sd3_path, tmp_path, *_algorithm("dgpo"), "training.dgpo.clip=false")
    trainer = Trainer(config)
    trainer.open_run(None, True)
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    unit = batch.replay[0]
    weights = torch.ones(len(unit.rows))
    loss, _ = trainer.policy.replay_loss(batch, unit, advantages, 0, 0.2, weights)
    from flowgrpo.algorithms.base import unit_forward
    inputs = unit_forward(trainer.policy, batch, unit, 0, guidance=1.0, per_slot_noise=False)
    latents, target, sigmas = inputs.latents, inputs.target, inputs.sigmas
    cond = trainer.policy.replay_condition(batch, unit)
    with torch.no_grad():
        velocity = trainer.model.velocity(latents, sigmas, cond, 1.0).float()
    expected = 0.5 * (advantages[unit.rows] * velocity_error(velocity, target)).mean()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5, abs=1e-9)
    # a group's rows share one noise level and one noise
    assert len(set(unit.sigmas.tolist())) == 1
    trainer._lock.release()


# ------------------------------------------------------------------ DiffusionNFT vs its reference


def _reference_nft_loss(forward_prediction, old_prediction, ref_forward_prediction, x0, xt, t,
                        advantages, beta, adv_clip_max, kl_beta):
    """DiffusionNFT's loss as written in NVlabs/DiffusionNFT scripts/train_nft_sd3.py (the
    policy and KL lines of its training loop), Copyright NVIDIA, Apache License 2.0; kept
    verbatim but for the names of its inputs, to test this toolkit's implementation against."""
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    r = torch.clamp(normalized_advantages_clip, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (torch.abs(x0_prediction.double() - x0.double())
                         .mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001))
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (torch.abs(negative_x0_prediction.double() - x0.double())
                                  .mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
                                  .clip(min=0.00001))
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(
        dim=tuple(range(1, x0.ndim)))
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    loss = policy_loss
    kl_div_loss = ((forward_prediction - ref_forward_prediction) ** 2).mean(
        dim=tuple(range(1, x0.ndim)))
    loss += kl_beta * torch.mean(kl_div_loss)
    return loss


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_and_gradient_match_the_reference_on_tiny_sd3(beta, tiny_sd3_path, tmp_path):
    config = _tiny(tiny_sd3_path, tmp_path, *_algorithm("nft"), f"training.nft.beta={beta}",
                   "training.kl_beta=0.01")
    trainer = Trainer(config)
    policy = trainer.policy
    with torch.no_grad():   # an old policy and a policy that differ from each other and the base
        for param in trainer.trainable.values():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
        policy.algorithm.old.update(0)
        for param in trainer.trainable.values():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(4)))
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    advantages = advantages * 3.0        # some beyond adv_clip: the clip is part of the formula
    unit = batch.replay[0]
    params = list(trainer.trainable.values())
    loss, _ = policy.replay_loss(batch, unit, advantages, 0, 0.2, torch.ones(len(unit.rows)))
    ours = torch.autograd.grad(loss, params)

    from flowgrpo.algorithms.base import unit_forward
    inputs = unit_forward(policy, batch, unit, 0)
    x0, xt, t = inputs.clean, inputs.latents, inputs.sigmas
    cond = policy.replay_condition(batch, unit)
    with torch.no_grad(), policy.algorithm.old.swapped_in():
        old = trainer.model.velocity(xt, t, cond, 1.0).float()
    with torch.no_grad(), policy.reference_policy():
        ref = trainer.model.velocity(xt, t, cond, 1.0).float()
    forward = trainer.model.velocity(xt, t, cond, 1.0).float()
    expected = _reference_nft_loss(forward, old, ref, x0, xt, t, advantages[unit.rows], beta,
                                   config.training.adv_clip, config.training.kl_beta)
    theirs = torch.autograd.grad(expected, params)
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-9)


def test_nft_old_policy_follows_its_schedule_and_resumes(tiny_sd3_path, tmp_path):
    """After each iteration old <- d old + (1 - d) current, d from the optimiser steps so far;
    a run resumed from its checkpoint continues to the weights (and old policy) of an
    uninterrupted one."""
    overrides = [*_algorithm("nft"), "training.nft.old_ramp_rate=0.2",
                 "training.nft.old_max_decay=0.5", "training.optimizer_steps_per_epoch=2",
                 "run.max_iterations=3"]
    straight = Trainer(_tiny(tiny_sd3_path, tmp_path / "a", "name=full", *overrides))
    history = [h for h in straight.train() if h["phase"] == "train"]
    assert [h["train/old_decay"] for h in history] == [
        pytest.approx(old_policy_decay(steps, 0, 0.2, 0.5)) for steps in (2, 4, 6)]
    old = straight.policy.algorithm.old.weights
    assert any(not torch.equal(old[n], p) for n, p in straight.trainable.items())

    Trainer(_tiny(tiny_sd3_path, tmp_path / "b", "name=resumed", *overrides,
                  "run.max_iterations=2")).train()
    resumed = Trainer(_tiny(tiny_sd3_path, tmp_path / "b", "name=resumed", *overrides))
    resumed.train(resume="latest")
    assert resumed.start_iteration == 2 and resumed.policy.algorithm.steps == 6
    for name, param in straight.trainable.items():
        assert torch.equal(param, resumed.trainable[name]), name
        assert torch.equal(old[name], resumed.policy.algorithm.old.weights[name]), name


# ------------------------------------------------------------------ pairs and refusals


def test_best_worst_pairs():
    total = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.5, float("nan"), 0.2, 0.7])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    assert best_worst_pairs(total, groups) == [(0, 1, 0), (2, 7, 6)]


def test_config_refusals(tiny_sd3_path, tmp_path):
    with pytest.raises(ConfigError, match="sampling.plan.kind 'ode'.*grpo"):
        tiny_config(tiny_sd3_path, tmp_path, "sampling.plan.kind=ode")
    with pytest.raises(ConfigError, match="training.ratio_norm acts on SDE transitions"):
        tiny_config(tiny_sd3_path, tmp_path, *_algorithm("nft"), "training.ratio_norm=true")
    with pytest.raises(ConfigError, match="share_initial_noise"):
        tiny_config(tiny_sd3_path, tmp_path, *_algorithm("awm"),
                    "sampling.share_initial_noise=true")
    with pytest.raises(ConfigError, match="training.algorithm"):
        tiny_config(tiny_sd3_path, tmp_path, "training.algorithm=ppo")
    config = tiny_config(tiny_sd3_path, tmp_path, *_algorithm("dgpo"),
                         "training.prompts_per_iteration=1", "training.group_size=4")
    with pytest.raises(ConfigError, match="whole groups"):
        validate(config, num_processes=2)
