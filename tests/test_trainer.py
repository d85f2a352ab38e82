"""The GRPO core end to end on the tiny SD3 build: on-policy replay, learning direction, NaN
masking, resume, and config failures before any model loads."""
from __future__ import annotations

import json

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.trainer import Trainer
from tests.helpers import PLANS, tiny_config



@pytest.mark.parametrize("plan", sorted(PLANS))
def test_ratio_is_one_on_first_pass(plan, tiny_sd3_path, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, *PLANS[plan],
                                  "training.skip_zero_std_groups=false"))
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0


def test_update_statistics_describe_the_update(tiny_sd3_path, tmp_path):
    """On-policy single pass: every ratio is 1, nothing is clipped, the k3 KL is 0. A second
    inner epoch after an optimiser step moves the ratios (the statistics read the log-ratios, not
    some other record)."""
    first = Trainer(tiny_config(tiny_sd3_path, tmp_path / "a", "training.skip_zero_std_groups=false"))
    metrics = first.run_iteration(0)
    assert metrics["train/ratio_mean"] == metrics["train/ratio_min"] == metrics["train/ratio_max"] == 1.0
    assert metrics["train/clip_fraction"] == 0.0 and metrics["train/approx_kl"] == 0.0
    two = Trainer(tiny_config(tiny_sd3_path, tmp_path / "b", "training.skip_zero_std_groups=false",
                              "training.num_inner_epochs=2", "training.lr=1e-1"))
    metrics = two.run_iteration(0)
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    assert metrics["train/ratio_min"] < 1.0 < metrics["train/ratio_max"]
    assert metrics["train/approx_kl"] > 0.0


def test_first_pass_deviation_reports_a_policy_change_before_the_update(tiny_sd3_path, tmp_path):
    """train/first_pass_ratio_max_dev is the on-policy check: 0 when rollout and replay see the
    same weights, and the largest |ratio - 1| when the weights moved in between."""
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.skip_zero_std_groups=false"))
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    with torch.no_grad():
        for param in trainer.trainable.values():
            param.add_(0.05 * torch.randn_like(param))
    metrics = trainer.update(batch, advantages, 0)
    assert metrics["train/first_pass_ratio_max_dev"] > 1e-4


def test_negative_step_weights_are_refused_once_per_update(tiny_sd3_path, tmp_path, monkeypatch):
    """The loss skips its per-call weight check (a host sync on GPU) because step_weights
    checks the iteration's weights once."""
    import flowgrpo.algorithms.grpo as trainer_module

    monkeypatch.setattr(trainer_module, "rectification_weights",
                        lambda sigmas, sigmas_next, std, normalize:
                        torch.linspace(-1.0, 3.0, len(std)))   # mean > 0: some stay negative
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.rectification=true",
                                  "training.skip_zero_std_groups=false"))
    with pytest.raises(ValueError, match="weights must be >= 0"):
        trainer.run_iteration(0)


def test_guard_and_kl_stay_on_policy_then_move(tiny_sd3_path, tmp_path):
    """Guard's ratio, 1/dt weights and the KL to the LoRA-disabled reference: the first pass is
    exactly on-policy (zero-initialised LoRA = the reference), and a second inner epoch after an
    optimiser step moves both the ratios and the KL."""
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.skip_zero_std_groups=false",
                                  "training.ratio_norm=true", "training.dt_reweight=true",
                                  "training.kl_beta=0.1", "training.num_inner_epochs=2",
                                  "training.lr=1e-1"))
    metrics = trainer.run_iteration(0)
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    assert metrics["train/kl"] > 0.0
    assert metrics["train/ratio_min"] < 1.0 < metrics["train/ratio_max"]
    single = Trainer(tiny_config(tiny_sd3_path, tmp_path / "single",
                                 "training.skip_zero_std_groups=false", "training.ratio_norm=true",
                                 "training.kl_beta=0.1"))
    metrics = single.run_iteration(0)
    assert metrics["train/kl"] == 0.0 and metrics["train/ratio_max"] == 1.0


@pytest.mark.parametrize("guard", [False, True])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_log_prob(sign, guard, tiny_sd3_path, tmp_path):
    """With GRPO-Guard the loss reads the replay's mean as well as its log-prob: the gradient
    reaches the model through score_step's mean output too."""
    extra = ["training.ratio_norm=true", "training.dt_reweight=true"] if guard else []
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.lr=1e-3",
                                  "training.clip_low=1.0", "training.clip_high=10.0",
                                  "training.max_grad_norm=0", *extra))
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages = torch.full((len(batch.prompts),), sign)
    before = torch.cat([r.logp_old for r in batch.replay])
    trainer.update(batch, advantages, 0)
    settings = trainer.policy.settings(0)
    cond = trainer.model.encode_prompts(batch.prompts)
    from flowgrpo.rollout import replay_logp

    with torch.no_grad():
        after = torch.cat([replay_logp(trainer.model, r, cond.select(r.rows), settings)[0]
                           for r in batch.replay])
    change = (after - before).mean().item()
    assert change * sign > 0, change


def test_nan_rewards_are_masked_and_counted(tiny_sd3_path, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path,
                                  "rewards.components=[{name: 'tests.helpers:NaNForFirst'}]"))
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, metrics = trainer.compute_advantages(batch, rewards)
    nan_rows = rewards["total"].isnan()
    assert metrics["reward/nan_count"] == int(nan_rows.sum()) > 0
    assert (advantages[nan_rows] == 0).all()
    assert torch.isfinite(advantages).all()


def test_resume_equals_uninterrupted_run(tiny_sd3_path, tmp_path):
    common = ["sampling.plan.kind=branch", "sampling.plan.window_size=2", "run.max_iterations=3",
              "training.ema.enabled=true", "training.ema.every=1", "training.lr_warmup_iterations=3"]
    full = Trainer(tiny_config(tiny_sd3_path, tmp_path / "a", "name=full", *common))
    full.train()
    stopped = Trainer(tiny_config(tiny_sd3_path, tmp_path / "b", "name=resumed", *common,
                                  "run.max_iterations=2"))
    stopped.train()
    resumed = Trainer(tiny_config(tiny_sd3_path, tmp_path / "b", "name=resumed", *common))
    resumed.train(resume="latest")
    assert resumed.start_iteration == 2
    for name, param in full.trainable.items():
        assert torch.equal(param, resumed.trainable[name]), name
    for name, shadow in full.ema.shadow.items():
        assert torch.equal(shadow, resumed.ema.shadow[name]), name
    lines = [json.loads(line) for line in
             (tmp_path / "b" / "runs" / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines if r["phase"] == "train"] == [1, 2, 3]
    # linear warmup over 3 iterations, a function of the iteration: the resumed run continues it
    assert [r["lr"] for r in lines if r["phase"] == "train"] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2])


def test_bad_config_fails_before_model_loads(tiny_sd3_path, tmp_path, monkeypatch):
    import flowgrpo.flow_policy

    def boom(*args, **kwargs):
        raise AssertionError("model loaded before the config was checked")

    monkeypatch.setattr(flowgrpo.flow_policy, "load_model", boom)
    with pytest.raises(ConfigError, match="training.group_size"):
        tiny_config(tiny_sd3_path, tmp_path, "training.group_size=1")
    with pytest.raises(ValueError, match="no_such_reward"):
        Trainer(tiny_config(tiny_sd3_path, tmp_path,
                            "rewards.components=[{name: no_such_reward}]"))
    with pytest.raises(ValueError, match="does not exist"):
        Trainer(tiny_config(tiny_sd3_path, tmp_path, "prompts.train=/no/such/file.txt"))


def test_checkpoint_lora_loads_in_stock_pipeline(tiny_sd3_path, tmp_path):
    """The trainer's LoRA file loads with diffusers' load_lora_weights and reproduces the policy."""
    from diffusers import StableDiffusion3Pipeline

    from flowgrpo.rollout import sample_ode

    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "run.max_iterations=1",
                                  "model.lora.init=gaussian"))
    trainer.train()
    folder = trainer.run_dir / "checkpoints" / "1"
    assert (folder / "pytorch_lora_weights.safetensors").is_file()
    noise = trainer.model.initial_noise(1, torch.Generator().manual_seed(0))
    ours = sample_ode(trainer.model, ["a red square"], noise, 4, 1.0)
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    pipe.load_lora_weights(str(folder))
    theirs = pipe("a red square", latents=noise, num_inference_steps=4, guidance_scale=1.0,
                  height=32, width=32, output_type="pt").images
    assert torch.allclose(ours, theirs.float(), atol=1e-4)


@pytest.mark.slow
def test_mean_reward_rises_over_20_iterations(tiny_sd3_path, tmp_path):
    """Learning happens on the tiny SD3 build: brightness of the decoded image (a cheap, smooth
    reward) rises over 20 iterations by more than the noise of the per-iteration means.
    Full fine-tuning at lr 1e-3: gains of 12-17 standard errors for seeds 0, 1, 2 (measured
    2026-11-30). LoRA r4 on this random build's attention moved the mean by only 0.5-5 standard
    errors depending on the seed (lr 1e-2 to 1e-1), so the test failed or passed with the noise
    stream; the LoRA path's learning direction is tested in test_advantage_sign_moves_log_prob.
    Run: bash scripts/test.sh -m slow -k reward_rises"""
    config = tiny_config(tiny_sd3_path, tmp_path, "run.max_iterations=20",
                         "rewards.components=[{name: 'tests.helpers:Brightness'}]",
                         "model.lora.enabled=false", "training.lr=1e-3", "training.clip_low=0.2",
                         "training.gradient_accumulation_steps=1",
                         "training.prompts_per_iteration=4", "training.group_size=8",
                         "sampling.rollout_batch_size=8")
    history = [h for h in Trainer(config).train() if h["phase"] == "train"]
    means = torch.tensor([h["reward/total/mean"] for h in history])
    # Standard error of one iteration's mean reward, from the within-batch spread.
    sem = max(h["reward/total/std"] for h in history) / (32 ** 0.5)
    gain = means[-5:].mean() - means[:5].mean()
    assert gain > 3 * sem, (means.tolist(), sem)


@pytest.mark.parametrize("accumulation", [0, 2])
def test_each_optimiser_step_sees_the_mean_gradient_of_its_replay_batches(tiny_sd3_path, tmp_path,
                                                                          monkeypatch, accumulation):
    """Gradient accumulation: the gradient handed to an optimiser step is the mean of the loss
    gradients of the replay batches in its window (1 / window is backward()'s seed), for one
    window of all replay batches (0) and for windows of 2."""
    from flowgrpo.seeding import seeded_generator

    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.skip_zero_std_groups=false",
                                  f"training.gradient_accumulation_steps={accumulation}"))
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    names = list(trainer.trainable)
    stepped: list[dict[str, torch.Tensor]] = []

    def capture() -> float:          # no optimiser step: every window sees the same weights
        stepped.append({n: trainer.trainable[n].grad.clone() for n in names})
        trainer.optimizer.zero_grad(set_to_none=True)
        return 0.0, True

    monkeypatch.setattr(trainer, "optimizer_step", capture)
    trainer.update(batch, advantages, 0)

    t = trainer.config.training
    replays = batch.replay
    weights = trainer.policy.step_weights(replays)
    params = [trainer.trainable[n] for n in names]
    per_replay = []
    for replay, weight in zip(replays, weights):
        loss, _ = trainer.policy.replay_loss(batch, replay, advantages, 0, t.clip_low, weight)
        per_replay.append(torch.autograd.grad(loss, params))
    window = accumulation or len(replays)
    order = torch.randperm(len(replays), generator=seeded_generator(
        trainer.config.run.seed, 0, "epoch", 0)).tolist()
    assert len(stepped) == -(-len(replays) // window) > (1 if accumulation else 0)
    for step, grads in enumerate(stepped):
        members = order[step * window:(step + 1) * window]
        for i, name in enumerate(names):
            expected = sum(per_replay[m][i] for m in members) / window
            assert torch.allclose(grads[name], expected, rtol=1e-5, atol=1e-9), name
    assert max(float(g.abs().max()) for grads in stepped for g in grads.values()) > 0
