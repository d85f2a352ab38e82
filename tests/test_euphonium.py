"""Euphonium's reward-gradient-guided rollouts (flowgrpo/guided_sde.py): zero guidance is the
unguided Flow-GRPO step, rollout and update bit for bit; the guided mean in closed form (the
tilted Gaussian for a linear reward, the dt / constant / normalised forms); the guided
log-prob is torch.distributions.Normal's; the first update pass is on-policy with guidance; and
guided rollouts of the toy reach a higher proxy reward than unguided ones from the same noise."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributions import Normal

from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from flowgrpo.guided_sde import (RewardGuidance, RewardGuidanceConfig, ShiftedStepGaussian,
                                 guidance_shift, guided_transition)
from flowgrpo.plans import PlanConfig, make_plan
from flowgrpo.rollout import RolloutSettings, rollout
from flowgrpo.sde import score_step, transition

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "assets" / "toy"
CONFIG = ROOT / "configs" / "toy_methods" / "euphonium.yaml"
needs_toy = pytest.mark.skipif(not (TOY / "transformer").is_dir() or
                               not (ROOT / "assets" / "toy_proxy" / "config.json").is_file(),
                               reason="assets/toy or assets/toy_proxy is not built")


def _step_inputs(batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 4, 4, generator=g)
    v = torch.randn(batch, 3, 4, 4, generator=g)
    noise = torch.randn(batch, 3, 4, 4, generator=g)
    gradient = torch.randn(batch, 3, 4, 4, generator=g)
    sigma = torch.tensor([0.9, 0.6, 0.3])[:batch]
    sigma_next = torch.tensor([0.8, 0.45, 0.1])[:batch]
    return x, v, noise, gradient, sigma, sigma_next


# ----------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("kind", ["flow_sde", "dance_sde", "cps"])
@pytest.mark.parametrize("mode", ["policy", "guided"])
def test_zero_scale_is_the_plain_step_bit_for_bit(kind, mode):
    x, v, noise, gradient, sigma, sigma_next = _step_inputs()
    plain = transition(kind, v, x, sigma, sigma_next, noise_level=0.7, noise=noise)
    guided = guided_transition(kind, v, x, sigma, sigma_next, gradient, scale=0.0,
                               log_prob_mean=mode, noise_level=0.7, noise=noise)
    for name in ("prev_sample", "mean", "std", "log_prob"):
        assert torch.equal(getattr(plain, name), getattr(guided, name)), name


def test_linear_reward_tilt_is_the_tilted_gaussian():
    """For r = g . x the tilted step p(x') exp(r(x') / beta) is N(mean + std^2 g / beta, std^2):
    the guided log-density minus the plain one minus g . x' / beta is one constant per row."""
    x, v, noise, g, sigma, sigma_next = _step_inputs()
    beta = 4.0
    out = guided_transition("flow_sde", v, x, sigma, sigma_next, g, scale=1 / beta,
                            form="tilt", log_prob_mean="guided", noise_level=0.7, noise=noise,
                            reduce="sum")
    plain = transition("flow_sde", v, x, sigma, sigma_next, noise_level=0.7, noise=noise,
                       reduce="sum")
    std = plain.std.reshape(-1, 1, 1, 1)
    torch.testing.assert_close(out.mean, plain.mean + std ** 2 * g / beta, rtol=0, atol=1e-6)
    offsets = []
    for k in range(4):
        probe = plain.mean + torch.randn(x.shape, generator=torch.Generator().manual_seed(k))
        guided_logp = out.gaussian.log_prob(probe - out.gaussian.mean(x, v))
        plain_logp = plain.gaussian.log_prob(probe - plain.mean)
        offsets.append(guided_logp - plain_logp - (g * probe).flatten(1).sum(1) / beta)
    for other in offsets[1:]:
        torch.testing.assert_close(other, offsets[0], rtol=0, atol=1e-4)


def test_dt_constant_and_normalised_forms():
    _, _, _, g, sigma, sigma_next = _step_inputs()
    std = torch.tensor([0.5, 0.4, 0.2])
    dt = (sigma - sigma_next).reshape(-1, 1, 1, 1)
    unit = g / (g.flatten(1).norm(dim=1).reshape(-1, 1, 1, 1) + 1e-8)
    torch.testing.assert_close(guidance_shift(g, std, sigma, sigma_next, form="dt", scale=0.01,
                                              normalize=False), 0.01 * dt * g)
    torch.testing.assert_close(guidance_shift(g, std, sigma, sigma_next, form="constant",
                                              scale=0.3, normalize=True), 0.3 * unit)
    torch.testing.assert_close(guidance_shift(g, std, sigma, sigma_next, form="tilt", scale=2.0,
                                              normalize=True),
                               2.0 * std.reshape(-1, 1, 1, 1) ** 2 * unit)
    # Euphonium's script on its (DanceGRPO) SDE: 0.01 dt g = tilt with scale 1 / (2 beta),
    # beta = eta^2 / (2 * 0.01) = 3.125 at eta = 0.25
    eta = 0.25
    dance_std = eta * (sigma - sigma_next).sqrt()
    torch.testing.assert_close(
        guidance_shift(g, dance_std, sigma, sigma_next, form="tilt", scale=1 / (2 * 3.125),
                       normalize=False),
        guidance_shift(g, dance_std, sigma, sigma_next, form="dt", scale=0.01, normalize=False))


@pytest.mark.parametrize("mode", ["policy", "guided"])
def test_log_prob_is_normal_at_the_chosen_mean_and_replays_bit_for_bit(mode):
    x, v, noise, g, sigma, sigma_next = _step_inputs()
    out = guided_transition("flow_sde", v, x, sigma, sigma_next, g, scale=0.5,
                            log_prob_mean=mode, noise_level=0.7, noise=noise)
    plain = transition("flow_sde", v, x, sigma, sigma_next, noise_level=0.7, noise=noise)
    std = plain.std.reshape(-1, 1, 1, 1)
    shift = std ** 2 * 0.5 * g
    torch.testing.assert_close(out.prev_sample, plain.mean + shift + std * noise)
    mean = plain.mean + shift if mode == "guided" else plain.mean
    expected = Normal(mean, std.expand_as(mean)).log_prob(out.prev_sample).flatten(1).mean(1)
    torch.testing.assert_close(out.log_prob, expected, rtol=0, atol=1e-5)
    assert isinstance(out.gaussian, ShiftedStepGaussian) == (mode == "guided")
    # the replay path (closed-form backward) re-scores the step to the same bits
    logp, replay_mean = score_step(v, x, out.prev_sample, out.gaussian)
    assert torch.equal(logp, out.log_prob) and torch.equal(replay_mean, out.mean)


def test_the_shift_is_a_constant_of_the_update():
    """d log p / d v is the plain step's: the shift carries no gradient of the policy."""
    x, v, noise, g, sigma, sigma_next = _step_inputs()
    out = guided_transition("flow_sde", v, x, sigma, sigma_next, g, scale=0.5,
                            log_prob_mean="guided", noise_level=0.7, noise=noise)
    velocity = v.clone().requires_grad_(True)
    logp, _ = score_step(velocity, x, out.prev_sample, out.gaussian)
    (grad,) = torch.autograd.grad(logp.sum(), velocity)
    residual = out.prev_sample - out.mean                    # = std * noise
    coef_v = out.gaussian.coef_v.reshape(-1, 1, 1, 1)
    std = out.std.reshape(-1, 1, 1, 1)
    torch.testing.assert_close(grad, residual / std ** 2 * coef_v / residual[0].numel())


class _PixelModel:
    """decode of the toy ((x + 1) / 2, clamped) without the transformer."""
    dtype = torch.float32

    @staticmethod
    def decode(latents):
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)


class _LinearReward:
    def __init__(self, weights):
        self.weights = weights

    def score_gradient(self, media, prompts, metadata):
        return (media * self.weights).flatten(1).sum(1), self.weights.expand_as(media)


def test_reward_gradient_is_pulled_back_through_decode():
    weights = torch.randn(1, 3, 4, 4)
    guidance = RewardGuidance(RewardGuidanceConfig(reward="x", scale=1.0), _LinearReward(weights),
                              _PixelModel()).for_rows(["a", "b"], [{}, {}])
    x0 = torch.tensor([0.5, 3.0]).reshape(2, 1, 1, 1).expand(2, 3, 4, 4)   # row 1 is clamped
    grad = guidance.reward_gradient(x0, torch.tensor([0, 1]))
    torch.testing.assert_close(grad[0], weights[0] / 2)
    assert torch.equal(grad[1], torch.zeros_like(grad[1]))


def test_guided_steps_and_config_errors_name_the_field():
    c = RewardGuidanceConfig(reward="toy_proxy", scale=1.0, first_step=8, last_step=14,
                             interval=2)
    assert [s for s in range(16) if c.guides(s)] == [8, 10, 12]
    with pytest.raises(ConfigError, match="sampling.reward_guidance.reward"):
        RewardGuidanceConfig(scale=1.0)
    with pytest.raises(ConfigError, match="sampling.reward_guidance.last_step"):
        RewardGuidanceConfig(reward="toy_proxy", first_step=4, last_step=4)
    with pytest.raises(ConfigError, match="sampling.reward_guidance.reward.*not differentiable"):
        load_config(CONFIG, [f"model.path={TOY}", "sampling.reward_guidance.reward=geneval_toy"])


# ----------------------------------------------------------------------------- on the toy


def _toy_rollout(model, guidance_config, prompts, metadata):
    from reward_models.loading import load_reward

    sigmas = model.sigmas(16)
    plan = make_plan(PlanConfig(kind="full", train_fraction=0.99), sigmas, 0, 0, 0)
    settings = RolloutSettings(kind="flow_sde", noise_level=0.7, guidance_scale=1.0,
                               batch_size=len(prompts), share_initial_noise=False, seed=0,
                               iteration=0)
    proxy = load_reward("toy_proxy")
    if guidance_config is not None:
        settings.guidance = RewardGuidance(guidance_config, proxy.inner, model).for_rows(
            prompts, metadata)
    batch = len(prompts)
    with torch.no_grad():
        out = rollout(model, prompts, metadata, torch.zeros(batch, dtype=torch.long),
                      torch.arange(batch), {0: plan}, settings)
    return out, proxy(out.media, prompts, metadata)


@pytest.fixture(scope="module")
def toy_batch():
    from flowgrpo.toyworld import prompt_records
    from pipelines.toy import ToyFlowModel

    records = prompt_records("train")[::97]          # 6 prompts of the training split
    return (ToyFlowModel.from_pretrained(str(TOY)), [r["prompt"] for r in records],
            [r["metadata"] for r in records])


@needs_toy
def test_zero_guidance_rollout_is_the_flow_grpo_rollout_bit_for_bit(toy_batch):
    model, prompts, metadata = toy_batch
    plain, plain_reward = _toy_rollout(model, None, prompts, metadata)
    zero, zero_reward = _toy_rollout(model, RewardGuidanceConfig(reward="toy_proxy", scale=0.0),
                                     prompts, metadata)
    assert torch.equal(plain.media, zero.media) and torch.equal(plain_reward, zero_reward)
    assert len(plain.replay) == len(zero.replay) == 15
    for a, b in zip(plain.replay, zero.replay):
        assert torch.equal(a.logp_old, b.logp_old) and torch.equal(a.next_latents, b.next_latents)


@needs_toy
def test_guided_rollouts_reach_a_higher_proxy_reward_from_the_same_noise(toy_batch):
    """Measured (the 6 prompts, seed 0): mean proxy 0.15 unguided, 0.71 guided (normalised,
    tilt scale 30 from step 0), every sample higher."""
    model, prompts, metadata = toy_batch
    _, plain = _toy_rollout(model, None, prompts, metadata)
    guided_config = RewardGuidanceConfig(reward="toy_proxy", scale=30.0, normalize=True)
    _, guided = _toy_rollout(model, guided_config, prompts, metadata)
    assert guided.mean() > plain.mean() + 0.1
    assert (guided > plain).float().mean() >= 0.75


# One group of 4 samples, the first 2 steps trained (and guided): an update in a few seconds.
SMALL = (f"model.path={TOY}", "training.prompts_per_iteration=1", "training.group_size=4",
         "sampling.rollout_batch_size=4", "training.skip_zero_std_groups=false",
         "sampling.plan.train_fraction=0.13", "run.num_threads=1", "run.eval_every=0",
         "run.checkpoint_every=0")


@needs_toy
@pytest.mark.parametrize("mode", ["policy", "guided"])
def test_first_update_pass_is_on_policy_with_guidance(mode, tmp_path):
    from flowgrpo.trainer import Trainer

    config = load_config(CONFIG, [
        *SMALL, f"run.output_dir={tmp_path}", "sampling.reward_guidance.scale=30.0",
        "sampling.reward_guidance.first_step=0", f"sampling.reward_guidance.log_prob_mean={mode}"])
    metrics = Trainer(config).run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0


@needs_toy
def test_zero_guidance_update_is_the_flow_grpo_update(tmp_path):
    from flowgrpo.trainer import Trainer

    runs = {}
    # the proxy as the training reward too: continuous, so the update is not zero
    zero = ["sampling.reward_guidance.scale=0.0", "sampling.reward_guidance.first_step=0",
            "rewards.components=[{name: toy_proxy}]", "eval.rewards=[]"]
    for name, extra in (("plain", [*zero, "sampling.reward_guidance.reward="]), ("zero", zero)):
        trainer = Trainer(load_config(CONFIG, [*SMALL, f"run.output_dir={tmp_path / name}",
                                               *extra]))
        before = {k: p.detach().clone() for k, p in trainer.module.named_parameters()}
        metrics = trainer.run_iteration(0)
        after = {k: p.detach().clone() for k, p in trainer.module.named_parameters()}
        runs[name] = (metrics, after)
        assert any(not torch.equal(before[k], v) for k, v in runs[name][1].items())
    def measured(metrics):   # everything but the clocks; NaN compared as a string
        return {k: repr(v) for k, v in metrics.items()
                if not k.startswith(("time/", "cpu/")) and "seconds" not in k}

    plain, zero_metrics = measured(runs["plain"][0]), measured(runs["zero"][0])
    assert "train/policy_loss" in plain and "reward/total/mean" in plain
    assert plain == zero_metrics
    for key, value in runs["plain"][1].items():
        assert torch.equal(value, runs["zero"][1][key]), key
