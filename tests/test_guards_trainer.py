"""Guards against reward hacking in the trainer, on the tiny SD3 build: off means untouched, the
gated KL's loss, the reference refresh (exact KL 0 after it, restored by a resume, LoRA and full
fine-tuning), diversity and saturation wired to their pure functions, and key errors before the
model loads."""
from __future__ import annotations

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.trainer import Trainer
from tests.helpers import tiny_config

GATED = ["training.kl_beta=0.1", "training.skip_zero_std_groups=false",
         "rewards.components=[{name: 'tests.helpers:BrightnessSpread'}]",
         "training.gardo.kl_gate_key=brightness_spread.spread"]


def _perturb(trainer, scale: float = 0.05) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainer.trainable.values():
            param.add_(scale * torch.randn(param.shape, generator=generator))


def _reference_gap(trainer, iteration: int = 7) -> float:
    """max |policy mean - reference mean| over a fresh rollout's replay batches."""
    from flowgrpo.rollout import replay_logp

    policy = trainer.policy
    batch, _, _ = trainer.rollout_and_score(iteration)
    settings = policy.settings(iteration)
    gaps = []
    with torch.no_grad():
        for replay in batch.replay:
            cond = policy.replay_condition(batch, replay)
            _, mean = replay_logp(policy.model, replay, cond, settings)
            with policy.reference_policy():
                _, mean_ref = replay_logp(policy.model, replay, cond, settings)
            gaps.append(float((mean - mean_ref).abs().max()))
    return max(gaps)


def test_guards_off_never_run(tiny_sd3_path, tmp_path, monkeypatch):
    """Every guard off (the default): none of their code runs and the batch carries no gate,
    so training takes exactly the path it takes without the guards."""
    import flowgrpo.algorithms.grpo
    import flowgrpo.flow_policy
    import flowgrpo.trainer_advantages as advantages_module

    def boom(*args, **kwargs):
        raise AssertionError("a guard ran while every guard is off")

    for name in ("diversity_weights", "kl_gate_weights", "saturation_weights",
                 "gate_uncertainty", "media_features"):
        monkeypatch.setattr(advantages_module, name, boom)
    monkeypatch.setattr(flowgrpo.algorithms.grpo.GRPO, "gated_kl", boom)
    monkeypatch.setattr(flowgrpo.flow_policy.FlowPolicy, "refresh_reference", boom)
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.kl_beta=0.1",
                                  "run.max_iterations=2", "run.comparison_grid=false"))
    history = [h for h in trainer.train() if h["phase"] == "train"]
    assert len(history) == 2 and not any(k.startswith(("adv/saturation", "adv/diversity"))
                                         for k in history[-1])
    assert "train/kl_gate_share" not in history[-1]


def test_gated_kl_applies_beta_times_the_mean_over_gated_rows(tiny_sd3_path, tmp_path):
    from flowgrpo.advantages import kl_gate_weights
    from flowgrpo.losses import flow_kl
    from flowgrpo.rollout import replay_logp

    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, *GATED,
                                  "training.gardo.kl_gate_fraction=0.25"))
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, metrics = trainer.compute_advantages(batch, rewards)
    expected_gate = kl_gate_weights(rewards["brightness_spread.spread"], 0.25)
    assert torch.equal(batch.kl_weights, expected_gate) and expected_gate.sum() == 2
    assert metrics["train/kl_gate_share"] == 0.25
    _perturb(trainer)   # the policy leaves the reference: KL > 0
    policy, settings = trainer.policy, trainer.policy.settings(0)
    seen_gated = seen_empty = False
    for replay in batch.replay:
        weights = torch.ones(len(replay.rows))
        loss, record = policy.replay_loss(batch, replay, advantages, 0, 0.2, weights)
        gate = batch.kl_weights[replay.rows]
        if gate.sum() == 0:   # no gated row: no reference forward, no KL term
            assert torch.equal(loss, record["policy_loss"]) and "kl" not in record
            seen_empty = True
            continue
        with torch.no_grad():
            cond = policy.replay_condition(batch, replay)
            _, mean = replay_logp(policy.model, replay, cond, settings)
            with policy.reference_policy():
                _, mean_ref = replay_logp(policy.model, replay, cond, settings)
            kl = flow_kl(mean, mean_ref, replay.std)
        by_hand = 0.1 * kl[gate > 0].mean()
        assert by_hand > 0
        assert torch.allclose(loss.detach() - record["policy_loss"], by_hand, rtol=1e-4)
        assert record["kl_rows"] == gate.sum()
        seen_gated = True
    assert seen_gated and seen_empty


def test_gate_of_the_whole_batch_is_the_plain_kl(tiny_sd3_path, tmp_path):
    plain = Trainer(tiny_config(tiny_sd3_path, tmp_path / "plain", *GATED[:3]))
    gated = Trainer(tiny_config(tiny_sd3_path, tmp_path / "gated", *GATED,
                                "training.gardo.kl_gate_fraction=1.0"))
    results = []
    for trainer in (plain, gated):
        batch, rewards, _ = trainer.rollout_and_score(0)
        advantages, _ = trainer.compute_advantages(batch, rewards)
        _perturb(trainer)
        replay = batch.replay[0]
        loss, record = trainer.policy.replay_loss(batch, replay, advantages, 0, 0.2,
                                                  torch.ones(len(replay.rows)))
        grads = torch.autograd.grad(loss, list(trainer.trainable.values()))
        results.append((loss.detach(), record["kl"], grads))
    assert gated.config.training.gardo.kl_gate and plain.config.training.gardo.kl_gate is False
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], rtol=1e-6) and results[0][1] > 0
    for a, b in zip(results[0][2], results[1][2]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-10)


def test_an_unknown_component_fails_after_the_rewards_load_before_the_model(
        tiny_sd3_path, tmp_path, monkeypatch):
    import flowgrpo.flow_policy

    def boom(*args, **kwargs):
        raise AssertionError("model loaded before the guard's key was checked")

    monkeypatch.setattr(flowgrpo.flow_policy, "load_model", boom)
    # Brightness has no components; its key is known only once it loads ("module:Class")
    with pytest.raises(ConfigError, match="reward 'brightness' has no component 'std'"):
        Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.kl_beta=0.1",
                            "training.gardo.kl_gate_key=brightness.std"))


def test_an_unknown_component_of_an_undeclared_reward_fails_at_the_first_iteration(
        tiny_sd3_path, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, *GATED[:3],
                                  "training.gardo.kl_gate_key=brightness_spread.nope"))
    with pytest.raises(ConfigError, match="kl_gate_key: the rewards output no 'brightness_spread"):
        trainer.run_iteration(0)


@pytest.mark.parametrize("lora", [True, False])
def test_after_a_refresh_the_reference_is_the_policy(lora, tiny_sd3_path, tmp_path):
    """Before a refresh the moved policy differs from its reference; right after, the
    reference's outputs equal the policy's exactly (and the policy itself is unchanged by the
    reference pass)."""
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.kl_beta=0.1",
                                  f"model.lora.enabled={str(lora).lower()}",
                                  "training.gardo.refresh_every=5"))
    assert _reference_gap(trainer) == 0.0     # the initial model is the reference
    _perturb(trainer, 0.05 if lora else 0.01)
    live = {k: v.detach().clone() for k, v in trainer.trainable.items()}
    assert _reference_gap(trainer) > 1e-4
    trainer.policy.refresh_reference()
    assert _reference_gap(trainer) == 0.0
    assert all(torch.equal(live[k], v) for k, v in trainer.trainable.items())
    _perturb(trainer, 0.05 if lora else 0.01)
    assert _reference_gap(trainer) > 1e-4   # the reference stays where it was taken


@pytest.mark.parametrize("lora", [True, False])
def test_refresh_every_iteration_makes_each_first_pass_kl_zero(lora, tiny_sd3_path, tmp_path):
    common = ["training.kl_beta=0.1", "training.lr=1e-1", "training.skip_zero_std_groups=false",
              f"model.lora.enabled={str(lora).lower()}", "run.max_iterations=2",
              "run.comparison_grid=false"] + ([] if lora else ["training.lr=1e-3"])
    refreshed = Trainer(tiny_config(tiny_sd3_path, tmp_path / "a", *common,
                                    "training.gardo.refresh_every=1"))
    history = [h for h in refreshed.train() if h["phase"] == "train"]
    # one optimiser step per epoch: every replay is scored before it, against a reference that
    # is the policy (iteration 1: the initial model; iteration 2: refreshed after iteration 1)
    assert [h["train/kl"] for h in history] == [0.0, 0.0]
    assert [h["train/reference_refreshed"] for h in history] == [1.0, 1.0]
    fixed = Trainer(tiny_config(tiny_sd3_path, tmp_path / "b", *common))
    history = [h for h in fixed.train() if h["phase"] == "train"]
    assert history[0]["train/kl"] == 0.0 and history[1]["train/kl"] > 0.0


def test_refresh_on_kl_threshold(tiny_sd3_path, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.kl_beta=0.1",
                                  "training.lr=1e-1", "training.skip_zero_std_groups=false",
                                  "training.gradient_accumulation_steps=1",
                                  "training.gardo.refresh_kl=1e-12"))
    metrics = trainer.run_iteration(0)
    assert metrics["train/kl"] > 1e-12 and metrics["train/reference_refreshed"] == 1.0
    assert trainer.reference_refreshed_at == 1 and metrics["train/reference_age"] == 0.0
    assert _reference_gap(trainer) == 0.0


@pytest.mark.parametrize("lora", [True, False])
def test_resume_restores_the_refreshed_reference(lora, tiny_sd3_path, tmp_path):
    """Several optimiser steps per epoch, so the KL (and its gradient) depends on the
    reference: a resumed run ends with the weights of the uninterrupted one only if the
    reference refreshed at iteration 2 comes back from the checkpoint."""
    from safetensors.torch import load_file

    common = ["training.kl_beta=1.0", "training.skip_zero_std_groups=false",
              "training.gradient_accumulation_steps=1", "training.gardo.refresh_every=2",
              f"model.lora.enabled={str(lora).lower()}", "run.max_iterations=3",
              "run.comparison_grid=false"] + ([] if lora else ["training.lr=1e-3"])
    full = Trainer(tiny_config(tiny_sd3_path, tmp_path / "a", "name=full", *common))
    full.train()
    stopped = Trainer(tiny_config(tiny_sd3_path, tmp_path / "b", "name=resumed", *common,
                                  "run.max_iterations=2"))
    stopped.train()
    checkpoint = tmp_path / "b" / "runs" / "resumed" / "checkpoints" / "2"
    saved = load_file(str(checkpoint / "reference.safetensors"))
    assert set(saved) == set(stopped.trainable)
    resumed = Trainer(tiny_config(tiny_sd3_path, tmp_path / "b", "name=resumed", *common))
    resumed.train(resume="latest")
    assert resumed.start_iteration == 2
    for name, tensor in stopped.policy.reference_state().items():
        assert torch.equal(saved[name], tensor.cpu()), name
    assert full.reference_refreshed_at == resumed.reference_refreshed_at == 2
    for name, param in full.trainable.items():
        assert torch.equal(param, resumed.trainable[name]), name
    for name, tensor in full.policy.reference_state().items():
        assert torch.equal(tensor, resumed.policy.reference_state()[name]), name
    # the KL did act: a run whose reference stays the initial model ends elsewhere
    other = Trainer(tiny_config(tiny_sd3_path, tmp_path / "c", "name=other", *common,
                                "training.gardo.refresh_every=0", "training.kl_reward=0"))
    other.train()
    assert any(not torch.equal(p, other.trainable[n]) for n, p in full.trainable.items())


def test_diversity_amplifies_the_advantages_by_the_pure_weights(tiny_sd3_path, tmp_path):
    from flowgrpo.advantages import diversity_weights, group_advantages
    from flowgrpo.guards import pixel_features

    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.gardo.diversity=true",
                                  "training.gardo.diversity_feature_size=4",
                                  "sampling.share_initial_noise=false"))
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, metrics = trainer.compute_advantages(batch, rewards)
    plain, _ = group_advantages(rewards["total"], batch.group_ids, clip=5.0)
    weights, _ = diversity_weights(pixel_features(batch.media, 4), batch.group_ids, plain)
    assert torch.equal(advantages, (plain * weights).clamp(-5.0, 5.0))
    assert (weights[plain > 0] != 1).any() and (weights[plain <= 0] == 1).all()
    assert metrics["adv/diversity_weight_max"] > 1.0


def test_saturation_weights_the_components_of_each_group(tiny_sd3_path, tmp_path):
    from flowgrpo.advantages import decoupled_advantages, saturation_weights

    trainer = Trainer(tiny_config(
        tiny_sd3_path, tmp_path, "rewards.saturation_ratio=0.5", "rewards.aggregation=decoupled",
        "rewards.components=[{name: 'tests.helpers:Brightness'}, "
        "{name: 'tests.helpers:Constant', weight: 0.5, options: {value: 1.0}}]"))
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, metrics = trainer.compute_advantages(batch, rewards)
    components = {k: rewards[k] for k in ("brightness", "constant")}
    scales, _ = saturation_weights(components, batch.group_ids, ratio=0.5)
    assert (scales["constant"] == 0).all()     # constant everywhere: no weight anywhere
    expected, _ = decoupled_advantages(components, {"brightness": 1.0, "constant": 0.5},
                                       batch.group_ids, component_scales=scales)
    assert torch.equal(advantages, expected)
    assert metrics["adv/saturation/constant/weight"] == 0.0
    assert 0.0 < metrics["adv/saturation/brightness/weight"] <= 1.0
