"""The recipes' maths against their anchors' formulas, written out from the anchors' released
code (docs/recipes.md names the files): the Wan step's noise, its exact-KL divisor and policy-loss
scale, GRPO-Guard's loss scale, the EMA as the anchors' loops step it, the branch-start set of
Flow-GRPO's SDE window, DanceGRPO's per-sample step count. Closed forms, no models."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.ema import EMA, ema_decay
from flowgrpo.flow_batches import ema_updates_per_step, rollout_sigmas
from flowgrpo.algorithms.grpo import GRPO
from flowgrpo.flow_policy import FlowPolicy
from flowgrpo.losses import (batch_mean_dt_weights, flow_kl, ratio_norm_log_ratio, policy_loss,
                             std_over_sqrt_dt_weights)
from flowgrpo.plans import PlanConfig, dance_count, make_plan, sample_trained_steps
from flowgrpo.sde import static_shift_sigmas, transition


def _policy(config, processes: int = 1):
    """A FlowPolicy shell with ``config`` for the functions that need no model."""
    policy = object.__new__(FlowPolicy)
    policy.config = config
    policy.accelerator = SimpleNamespace(num_processes=processes)
    policy.algorithm = object.__new__(GRPO)    # its step weights read only the config
    policy.algorithm.policy, policy.algorithm.config = policy, config
    return policy


# --------------------------------------------------------------------- Flow-GRPO's Wan loop


def _wan22_step(sigma_index: torch.Tensor):
    """wan22_video's rollout schedule and one flash_sde step at each of ``sigma_index``: the
    recipe as the trainer builds it (schedule from the Wan adapter's grid at flow shift 12)."""
    config = load_config("configs/wan22_video.yaml")
    model = SimpleNamespace(sigmas=lambda n: static_shift_sigmas(n, 12.0))
    sigmas = rollout_sigmas(config, model).double()
    sigma, sigma_next = sigmas[sigma_index], sigmas[sigma_index + 1]
    step = transition(config.sampling.kind, torch.zeros(len(sigma_index), 4),
                      torch.zeros(len(sigma_index), 4), sigma.float(), sigma_next.float(),
                      noise_level=config.sampling.noise_level,
                      schedule_bounds=(float(sigmas[1]), float(sigmas[-1])))
    return config, sigmas, sigma, sigma_next, step


def test_wan22_step_noise_is_the_wan_loops_schedule():
    """Flow-GRPO's Wan step (diffusers_patch/wan_pipeline_with_logprob.py, sde_step_with_logprob):
    std_dev_t = sigma_min + (sigma_max - sigma_min) sigma with sigma_max = sigmas[1], sigma_min =
    sigmas[-1], and the step's noise std_dev_t sqrt(-dt). Flow-GRPO's SD3 rule with a = 0.7 (what
    the recipe had) is 10x larger at the first step (0.7 against 0.067)."""
    index = torch.arange(19)
    config, sigmas, sigma, sigma_next, step = _wan22_step(index)
    std_dev_t = sigmas[-1] + (sigmas[1] - sigmas[-1]) * sigma
    torch.testing.assert_close(step.std.double(), std_dev_t * (sigma - sigma_next).sqrt(),
                               rtol=1e-6, atol=1e-8)
    flow = transition("flow_sde", torch.zeros(1, 4), torch.zeros(1, 4), sigma[:1].float(),
                      sigma_next[:1].float(), noise_level=0.7)
    assert flow.std.item() / step.std[0].item() == pytest.approx(10.4, abs=0.1)


def test_wan22_kl_is_the_wan_loops_exact_kl():
    """The Wan loop's KL loss: ((mean - mean_ref)^2).mean(dims) / (2 (std_dev_t * sqrt(-dt))^2),
    the exact Gaussian KL per dimension; the recipe's KL (``kl_convention: exact``) is it, while
    Flow-GRPO's SD3 divisor (2 std_dev_t^2) is that times sigma - sigma_next."""
    index = torch.tensor([0, 7, 15])
    config, sigmas, sigma, sigma_next, step = _wan22_step(index)
    generator = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 16, 3, 4, 4, generator=generator, dtype=torch.float64)
    mean_ref = mean + 0.01 * torch.randn(3, 16, 3, 4, 4, generator=generator, dtype=torch.float64)
    std_dev_t = sigmas[-1] + (sigmas[1] - sigmas[-1]) * sigma
    anchor = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3, 4)) / \
        (2 * (std_dev_t * (sigma - sigma_next).sqrt()) ** 2)
    replay = SimpleNamespace(std=step.std, sigmas=sigma.float(), sigmas_next=sigma_next.float())
    ours = flow_kl(mean, mean_ref, _policy(config).kl_std(replay).double())
    torch.testing.assert_close(ours, anchor, rtol=1e-5, atol=0)
    config.training.kl_convention = "flow_grpo"
    sd3_divisor = flow_kl(mean, mean_ref, _policy(config).kl_std(replay).double())
    torch.testing.assert_close(sd3_divisor, anchor * (sigma - sigma_next), rtol=1e-5, atol=0)


def test_wan22_policy_loss_scale_is_the_wan_loops():
    """The Wan loop scales each batch's policy loss by std_dev_t.mean() / sqrt_dt.mean() (batch
    means); the recipe's step weights are that factor, for a batch of one step and for a batch
    that mixes steps alike."""
    config, sigmas, sigma, sigma_next, step = _wan22_step(torch.tensor([0, 0, 3, 9]))
    std_dev_t = sigmas[-1] + (sigmas[1] - sigmas[-1]) * sigma
    root = (sigma - sigma_next).sqrt()
    policy = _policy(config)
    one_step = SimpleNamespace(logp_old=torch.zeros(2), sigmas=sigma[:2].float(),
                               sigmas_next=sigma_next[:2].float(), std=step.std[:2])
    mixed = SimpleNamespace(logp_old=torch.zeros(4), sigmas=sigma.float(),
                            sigmas_next=sigma_next.float(), std=step.std)
    first, both = policy.step_weights([one_step, mixed])
    torch.testing.assert_close(first.double(), (std_dev_t[:2].mean() / root[:2].mean()).expand(2),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(both.double(), (std_dev_t.mean() / root.mean()).expand(4),
                               rtol=1e-5, atol=0)
    # on one step it is the total std over dt, S / D
    torch.testing.assert_close(first.double(), step.std[:2].double() / (sigma - sigma_next)[:2],
                               rtol=1e-5, atol=0)


def test_loss_scales_need_a_stochastic_kind_they_are_defined_for():
    with pytest.raises(ValueError, match="loss_scale"):
        load_config("configs/sd3_fast_cps.yaml", ["training.loss_scale=std_over_sqrt_dt"])
    with pytest.raises(ValueError, match="dt_reweight_norm"):
        load_config("configs/sd3_ocr.yaml", ["training.dt_reweight_norm=per_row"])


# --------------------------------------------------------------------- GRPO-Guard


def test_guard_batch_mean_loss_equals_grpo_guards_released_loss():
    """GRPO-Guard's released loss (Flow-GRPO's train_sd3_GRPO_Guard.py with rationorm):
    ratio = exp((logp - logp_old + b) * sqrt_dt.mean() * std_dev_t.mean()), b = mse /
    (2 (sqrt_dt.mean() std_dev_t.mean())^2), policy loss = mean(max(-A r, -A clip r)) /
    sqrt_dt.mean()^2. A replay batch here holds one step, so ``ratio_norm_log_ratio`` with the
    step's total std and ``batch_mean_dt_weights`` give that loss exactly."""
    sigmas = static_shift_sigmas(10, 3.0).double()
    for j in (0, 4, 8):
        sigma, sigma_next = sigmas[j].expand(6), sigmas[j + 1].expand(6)
        generator = torch.Generator().manual_seed(j)
        x, v = (torch.randn(6, 4, 8, generator=generator, dtype=torch.float64) for _ in range(2))
        old = transition("flow_sde", v, x, sigma, sigma_next, noise_level=0.7,
                         generator=generator)
        new_v = v + 0.05 * torch.randn(6, 4, 8, generator=generator, dtype=torch.float64)
        new = transition("flow_sde", new_v, x, sigma, sigma_next, noise_level=0.7,
                         prev_sample=old.prev_sample)
        advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
        clip = 1e-3
        # the anchor, written out with its std_dev_t = a sqrt(sigma / (1 - sigma~))
        sqrt_dt = (sigma - sigma_next).sqrt()
        std_dev_t = 0.7 * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma)))
        scale = sqrt_dt.mean() * std_dev_t.mean()
        # = the step's total std (float32 in the transition, whose precision the rest needs)
        torch.testing.assert_close(new.std.double(), scale.expand(6), rtol=1e-6, atol=0)
        scale = new.std.double().mean()
        bias = ((new.mean - old.mean) ** 2).mean(dim=(1, 2)) / (2 * scale ** 2)
        ratio = torch.exp((new.log_prob - old.log_prob + bias) * scale)
        anchor = torch.maximum(-advantages * ratio,
                               -advantages * ratio.clamp(1 - clip, 1 + clip)).mean()
        anchor = anchor / sqrt_dt.mean() ** 2
        ours = policy_loss(new.log_prob, old.log_prob, advantages, clip, clip,
                           log_ratio=ratio_norm_log_ratio(new.log_prob, old.log_prob, new.mean,
                                                     old.mean, new.std),
                           weights=batch_mean_dt_weights(sigma, sigma_next))
        # float32 log-ratios: equal to float32 rounding of the per-row terms (|A| r / dt)
        terms = advantages.abs().max() / sqrt_dt.mean() ** 2
        torch.testing.assert_close(ours, anchor, rtol=1e-5, atol=float(1e-6 * terms))


def test_guard_batch_mean_weights_through_the_policy_are_absolute():
    """``training.dt_reweight_norm: batch_mean`` gives each replay batch 1 / mean(sqrt(dt))^2 on
    every process alike; the default normalises 1/dt to mean 1 over the iteration."""
    config = load_config("configs/sd3_ocr.yaml", ["training.dt_reweight=true",
                                                  "training.dt_reweight_norm=batch_mean"])
    sigmas = static_shift_sigmas(10, 3.0)
    replays = [SimpleNamespace(logp_old=torch.zeros(3), sigmas=sigmas[j].expand(3),
                               sigmas_next=sigmas[j + 1].expand(3), std=torch.ones(3))
               for j in (0, 8)]
    absolute = _policy(config).step_weights(replays)
    for replay, weights in zip(replays, absolute):
        dt = float(replay.sigmas[0] - replay.sigmas_next[0])
        torch.testing.assert_close(weights, torch.full((3,), 1 / dt), rtol=1e-5, atol=0)
    config.training.dt_reweight_norm = "iteration"
    normalised = _policy(config).step_weights(replays)
    assert torch.cat(normalised).mean().item() == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(normalised[1] / normalised[0], absolute[1] / absolute[0])


# --------------------------------------------------------------------- EMA


def _anchor_ema(values: list[float], batches_per_step: int, every: int, max_decay: float,
                steps: int) -> float:
    """Flow-GRPO's loop with its EMAModuleWrapper (flow_grpo/ema.py, scripts/train_sd3.py):
    after every sample batch, ``ema.step(params, global_step)`` with global_step = optimiser
    steps taken; decay min((1 + g) / (10 + g), max), an update when (g + 1) % every == 0. An
    optimiser step ends every ``batches_per_step``-th batch; the parameter then takes the next
    value of ``values``."""
    param = shadow = values[0]
    global_step = 0
    # every call made while ``steps`` optimiser steps are done: up to the batch before step + 1
    for batch in range(steps * batches_per_step + batches_per_step - 1):
        if (batch + 1) % batches_per_step == 0:
            global_step += 1
            param = values[global_step]
        decay = min((1 + global_step) / (10 + global_step), max_decay)
        if (global_step + 1) % every == 0:
            shadow = shadow + (1 - decay) * (param - shadow)
    return shadow


@pytest.mark.parametrize("batches_per_step", [1, 2, 6])
def test_ema_optimizer_step_warmup_equals_the_anchors_loop(batches_per_step):
    steps, every = 100, 8
    values = [math.sin(0.3 * k) + 0.01 * k for k in range(steps + 1)]
    param = torch.nn.Parameter(torch.tensor([values[0]], dtype=torch.float64))
    ema = EMA({"w": param}, 0.9, every, warmup="optimizer_steps",
              updates_per_step=batches_per_step)
    for k in range(1, steps + 1):
        with torch.no_grad():
            param.fill_(values[k])
        ema.step()
        assert ema.shadow["w"].item() == pytest.approx(
            _anchor_ema(values, batches_per_step, every, 0.9, k), rel=1e-6, abs=1e-7)  # float32 shadow


def test_ema_decay_at_optimizer_step_k():
    """d(k) = min((1 + k) / (10 + k), 0.9): 8/17 at the first update (step 7), 0.9 from step 80
    when the warm-up counts optimiser steps (the anchors), from step 640 = 80 updates x 8 when it
    counts updates."""
    assert ema_decay(7, 0.9) == pytest.approx(8 / 17)
    assert ema_decay(79, 0.9) == pytest.approx(80 / 89) and ema_decay(80, 0.9) == 0.9
    param = torch.nn.Parameter(torch.zeros(1))
    anchor_style = EMA({"w": param}, 0.9, 8, warmup="optimizer_steps")
    updates = EMA({"w": param}, 0.9, 8, warmup="updates")
    for k in range(1, 641):
        anchor_style.step()
        updates.step()
        if k == 79:
            assert anchor_style.decay() == pytest.approx(80 / 89)   # an update at step 79 uses it
        if k == 80:
            assert anchor_style.decay() == 0.9 and updates.decay() == pytest.approx(11 / 20)
        if k == 639:
            assert updates.decay() == pytest.approx(80 / 89)
    assert updates.decay() == 0.9 and updates.num_updates == 80
    assert anchor_style.num_updates == 80     # after steps 7, 15, ..., 639


@pytest.mark.parametrize("name,processes", [("sd3_ocr", 32), ("sd3_pickscore", 32),
                                            ("sd3_fast_cps", 32), ("flux_flowgrpo", 32),
                                            ("kontext_edit", 28), ("sd3_ocr", 8)])
def test_ema_updates_per_step_are_flow_grpos_sample_batches_per_step(name, processes):
    """Flow-GRPO calls its EMA after every sample batch: (num_batches_per_epoch // 2) times per
    optimiser step, num_batches_per_epoch = int(prompts / (gpus x train_batch_size / images per
    prompt)) in config/grpo.py."""
    config = load_config(f"configs/{name}.yaml")
    t, s = config.training, config.sampling
    per_gpu_prompts = processes * s.rollout_batch_size / t.group_size
    anchor = int(t.prompts_per_iteration / per_gpu_prompts) // 2
    assert ema_updates_per_step(config, processes) == anchor
    assert (t.ema.warmup, t.ema.every, t.ema.decay) == ("optimizer_steps", 8, 0.9)


def test_flash_grpo_and_wan22_ema_update_once_per_step():
    """Flash-GRPO calls its EMA once per optimiser step; Flow-GRPO's Wan loop, one sample batch
    per step, likewise."""
    assert ema_updates_per_step(load_config("configs/wan_video.yaml"), 96) == 1
    assert ema_updates_per_step(load_config("configs/wan22_video.yaml"), 8) == 1


# --------------------------------------------------------------------- plans


@pytest.mark.parametrize("name,window,window_range", [("qwen_image_ocr", 2, (0, 5)),
                                                      ("sd3_fast_cps", 3, (0, 5))])
def test_branch_starts_are_the_anchors_randint_set(name, window, window_range):
    """Flow-GRPO draws the SDE window's start as random.randint(lo, hi - size) with
    sde_window_range (lo, hi) = (0, num_steps // 2): both ends included."""
    config = load_config(f"configs/{name}.yaml")
    plan_config = config.sampling.plan
    assert plan_config.window_size == window
    sigmas = static_shift_sigmas(config.sampling.num_steps, 3.0)
    starts = {make_plan(plan_config, sigmas, it, group, 0).stochastic[0]
              for it in range(20) for group in range(20)}
    lo, hi = window_range
    assert starts == set(range(lo, hi - window + 1))
    for it in range(5):
        plan = make_plan(plan_config, sigmas, it, 3, 0)
        assert plan.trained == tuple(range(plan.stochastic[0], plan.stochastic[0] + window))


@pytest.mark.parametrize("num_steps,fraction", [(10, 0.6), (16, 0.5), (25, 1.0), (20, 0.99)])
def test_dance_grpo_per_sample_count_is_the_anchors(num_steps, fraction):
    """DanceGRPO (fastvideo/train_grpo_flux.py; MixGRPO's "all" strategy copies it): the
    timesteps without the last, one permutation per sample, the first int(len * fraction)."""
    anchor = int(len(range(num_steps)[:-1]) * fraction)
    config = PlanConfig(kind="full", train_fraction=fraction, train_select="random_per_sample")
    plan = make_plan(config, static_shift_sigmas(num_steps, 3.0), 1, 0, 0)
    assert dance_count(config, num_steps) == anchor
    for sample in range(4):
        steps = sample_trained_steps(config, plan, 1, sample, 0)
        assert len(steps) == anchor and set(steps) <= set(range(num_steps - 1))
    with pytest.raises(ValueError, match="random_per_sample"):
        PlanConfig(kind="full", train_fraction=0.1,
                   train_select="random_per_sample").validate(10)
