"""The update on accelerate's engine: fp16 loss scaling, skipped non-finite steps, equal backward
counts on every process, replica checks, engine checks before any model loads, reward devices,
and the LM policy's independence from the flow stack."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.engines import (check_engine, preflight_engine, replica_checksums,
                              set_gradient_sync)
from flowgrpo.trainer import (NonFiniteGradientError, Trainer, global_replay_order,
                              step_windows)
from tests.helpers import edit_config, tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_accelerator():
    """An Accelerator of its own: accelerate keeps one process-wide state, and these tests need
    other mixed-precision settings than the rest of the suite. Restored afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    def make(fp16: bool):
        AcceleratorState._reset_state(True)
        acc = Accelerator(cpu=True, mixed_precision="fp16" if fp16 else "no")
        if fp16:
            # accelerate only scales on GPUs; the CPU's GradScaler and fp16 autocast run the same
            # code path (accelerator.backward -> scaler.scale, clip -> unscale, step -> skip).
            acc.native_amp = True
            acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        return acc

    yield make
    AcceleratorState._reset_state(True)


def gradient(make_accelerator, path, tmp_path, dtype: str, fp16: bool, scale: float):
    """The trainable gradient of the first replay batch's loss times ``scale`` (unscaled)."""
    acc = make_accelerator(fp16)
    torch.manual_seed(0)
    trainer = Trainer(tiny_config(path, tmp_path / f"{dtype}{fp16}", f"model.dtype={dtype}",
                                  "training.skip_zero_std_groups=false"), accelerator=acc)
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    replay = batch.replay[0]
    with acc.autocast():
        loss, _ = trainer.policy.replay_loss(batch, replay, advantages, 0, 0.2,
                                             torch.ones(len(replay.rows)))
    trainer.backward(loss, scale)
    if fp16:
        assert acc.scaler.get_scale() == 2.0 ** 16
        acc.unscale_gradients()
    return torch.cat([p.grad.flatten().double() for p in trainer.trainable.values()])


def cosine(a, b) -> float:
    return float(a @ b / (a.norm() * b.norm() + 1e-30))


def test_fp16_loss_scaling_recovers_gradients_that_underflow_unscaled(fresh_accelerator,
                                                                      tiny_sd3_path, tmp_path):
    """fp16 weights and activations, LoRA in fp32, a small loss (as a 1/N seed or a small
    advantage makes it): without scaling most of the gradient underflows in the fp16 backward;
    with accelerate's scaler it matches the float32 model's."""
    scale = 1e-4
    reference = gradient(fresh_accelerator, tiny_sd3_path, tmp_path, "float32", False, scale)
    unscaled = gradient(fresh_accelerator, tiny_sd3_path, tmp_path, "float16", False, scale)
    scaled = gradient(fresh_accelerator, tiny_sd3_path, tmp_path, "float16", True, scale)
    assert cosine(reference, unscaled) < 0.5          # measured 0.21: the proxy does underflow
    assert cosine(reference, scaled) >= 0.99          # measured 0.9988
    assert float(scaled.norm() / reference.norm()) == pytest.approx(1.0, rel=0.05)


def poison_and_step(trainer):
    """A real backward, then one gradient made infinite; returns (weights before, step result)."""
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    replay = batch.replay[0]
    with trainer.accelerator.autocast():
        loss, _ = trainer.policy.replay_loss(batch, replay, advantages, 0, 0.2,
                                             torch.ones(len(replay.rows)))
    trainer.backward(loss, 1.0)
    before = {n: p.detach().clone() for n, p in trainer.trainable.items()}
    next(iter(trainer.trainable.values())).grad.view(-1)[0] = float("inf")
    return before, trainer.optimizer_step()


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16_scaler"])
def test_a_step_with_an_infinite_gradient_is_skipped_not_applied(fresh_accelerator, tiny_sd3_path,
                                                                 tmp_path, fp16):
    acc = fresh_accelerator(fp16)
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.skip_zero_std_groups=false",
                                  "training.ema.enabled=true", "training.ema.every=1",
                                  "training.max_consecutive_skipped_steps=2",
                                  *(["model.dtype=float16"] if fp16 else [])), accelerator=acc)
    shadow = {n: v.clone() for n, v in trainer.ema.state_dict().items()}
    before, (norm, stepped) = poison_and_step(trainer)
    assert not stepped and not torch.isfinite(torch.tensor(norm))
    for name, param in trainer.trainable.items():
        assert torch.equal(param, before[name]), name            # weights untouched
        assert torch.equal(trainer.ema.state_dict()[name], shadow[name]), name   # EMA too
        assert param.grad is None                                 # gradients cleared
    assert trainer.ema.steps == 0
    if fp16:
        assert acc.scaler.get_scale() == 2.0 ** 15               # the scaler backed off
    # the configured number of skips in a row aborts the run with a clear error
    with pytest.raises(NonFiniteGradientError, match="2 optimiser steps in a row"):
        poison_and_step(trainer)


def test_a_finite_step_after_a_skip_resets_the_count(fresh_accelerator, tiny_sd3_path, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path, "training.skip_zero_std_groups=false",
                                  "training.max_consecutive_skipped_steps=2"),
                      accelerator=fresh_accelerator(False))
    poison_and_step(trainer)
    assert trainer.skipped_in_a_row == 1
    metrics = trainer.run_iteration(0)
    assert metrics["train/skipped_steps"] == 0 and trainer.skipped_in_a_row == 0


def test_step_windows_train_the_same_batches_on_any_number_of_processes():
    """7 replay batches, 3 per step, one permutation: the steps hold the same batches whether one
    process holds all 7 or two hold 4 and 3, in whatever order each rolled them out; each
    process runs as many passes as the fullest holder of the step."""
    # (plan bucket, first sample id) of each replay batch: chunks starting at samples 0, 8, 16
    # and 24 (groups 0-3, 8 rows each), with 2, 2, 1 and 2 trained steps; groups 0 and 2 share
    # a plan (bucket 0), groups 1 and 3 another (bucket 1). One process rolls bucket 0 out
    # first (chunks 0, 16), then bucket 1 (8, 24); two processes hold groups 0, 1 and 2, 3.
    one_keys = [[(0, 0), (0, 0), (0, 16), (1, 8), (1, 8), (1, 24), (1, 24)]]
    two_keys = [[(0, 0), (0, 0), (1, 8), (1, 8)], [(0, 16), (1, 24), (1, 24)]]
    one, two = global_replay_order(one_keys), global_replay_order(two_keys)
    assert one == [(0, i) for i in range(7)]   # one process: its own order
    assert two == [(0, 0), (0, 1), (1, 0), (0, 2), (0, 3), (1, 1), (1, 2)]
    assert [one_keys[q][i] for q, i in one] == [two_keys[q][i] for q, i in two]
    order = [5, 0, 3, 6, 1, 4, 2]
    assert step_windows(order, 3, one, 0) == [([5, 0, 3], 3), ([6, 1, 4], 3), ([2], 1)]
    two = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]   # 4 and 3 batches in turn
    first, second = step_windows(order, 3, two, 0), step_windows(order, 3, two, 1)
    assert first == [([0, 3], 2), ([1], 2), ([2], 1)]
    assert second == [([1], 2), ([2, 0], 2), ([], 1)]
    assert step_windows([], 3, [], 1) == []


def test_replica_checksums_tell_weights_apart():
    weights = [torch.randn(4, 3), torch.randn(5)]
    same = replica_checksums([w.clone() for w in weights])
    assert torch.equal(replica_checksums(weights), same)
    swapped = [weights[0].flip(0), weights[1]]        # same sum, other positions
    assert not torch.equal(replica_checksums(swapped)[0], same[0])
    nudged = [weights[0] + 1e-6, weights[1]]
    assert not torch.equal(replica_checksums(nudged)[0], same[0])


def test_fsdp1_and_deepspeed_without_gpus_are_refused_with_a_clear_error():
    # FSDP2 runs on CPU processes (tests/test_fsdp.py); FSDP1 (accelerate's default version)
    # and DeepSpeed do not.
    with pytest.raises(ConfigError, match="FSDP version 1, which needs CUDA GPUs.*ddp.yaml"):
        preflight_engine({"ACCELERATE_USE_FSDP": "true"}, cuda=False)
    with pytest.raises(ConfigError, match="DeepSpeed, which needs CUDA GPUs"):
        preflight_engine({"ACCELERATE_USE_DEEPSPEED": "true"}, cuda=False)
    preflight_engine({}, cuda=False)                   # plain CPU / DDP: nothing to refuse
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install deepspeed"):
            preflight_engine({"ACCELERATE_USE_DEEPSPEED": "true"}, cuda=True)


def test_gradient_sync_is_set_through_accelerates_public_setter():
    """The update marks the last backward of a window with ``set_gradient_sync`` (accelerate's
    public ``sync_gradients``): the prepared optimiser must skip its step until it is set, as
    accelerate's own accumulation relies on. Fails when accelerate stops honouring the setter."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    linear = torch.nn.Linear(2, 1)
    model, optimizer = acc.prepare(linear, torch.optim.SGD(linear.parameters(), lr=1.0))
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.detach().clone()
    try:
        set_gradient_sync(acc, False)
        assert acc.sync_gradients is False and acc.gradient_state.sync_gradients is False
        optimizer.step()
        assert torch.equal(model.weight, before)          # inside a window: no step
        set_gradient_sync(acc, True)
        optimizer.step()
        assert not torch.equal(model.weight, before)      # its last backward: the step
    finally:
        set_gradient_sync(acc, True)


def fake_accelerator(kind: str, zero_stage: int = 2, processes: int = 8):
    from accelerate.utils import DistributedType

    types = {"fsdp": DistributedType.FSDP, "deepspeed": DistributedType.DEEPSPEED,
             "ddp": DistributedType.MULTI_GPU}
    plugin = SimpleNamespace(zero_stage=zero_stage, deepspeed_config={
        "gradient_accumulation_steps": "auto"})
    return SimpleNamespace(distributed_type=types[kind], num_processes=processes,
                           state=SimpleNamespace(deepspeed_plugin=plugin))


def test_what_a_sharded_engine_cannot_do_fails_at_start(tiny_sd3_path, tmp_path):
    config = tiny_config(tiny_sd3_path, tmp_path)
    assert check_engine(config, fake_accelerator("ddp")) is False
    assert check_engine(config, fake_accelerator("deepspeed", zero_stage=2)) is False
    assert check_engine(config, fake_accelerator("fsdp")) is True
    assert check_engine(config, fake_accelerator("deepspeed", zero_stage=3)) is True
    ema = tiny_config(tiny_sd3_path, tmp_path, "training.ema.enabled=true")
    with pytest.raises(ConfigError, match="training.ema is not supported under fsdp"):
        check_engine(ema, fake_accelerator("fsdp"))
    check_engine(ema, fake_accelerator("deepspeed", zero_stage=2))   # ZeRO-2: weights whole
    kl_full = tiny_config(tiny_sd3_path, tmp_path, "training.kl_beta=0.01",
                          "model.lora.enabled=false")
    with pytest.raises(ConfigError, match="unsharded reference copy"):
        check_engine(kl_full, fake_accelerator("deepspeed", zero_stage=3))
    keep_kl_full = edit_config("assets/toy_edit", tmp_path, "training.locality.mask=record",
                               "training.locality.edit_key=toy_edit.target",
                               "training.locality.keep_key=toy_edit.kept",
                               "training.locality.keep_kl_beta=0.1")
    with pytest.raises(ConfigError, match="training.locality.keep_kl_beta > 0 with full fine"):
        check_engine(keep_kl_full, fake_accelerator("fsdp"))
    accumulating = fake_accelerator("deepspeed")
    accumulating.state.deepspeed_plugin.deepspeed_config["gradient_accumulation_steps"] = 4
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        check_engine(config, accumulating)


def test_deepspeed_gets_a_micro_batch_and_zero3_keeps_transformers_models_whole(
        tiny_sd3_path, tmp_path, monkeypatch):
    """Two things accelerate's DeepSpeed path needs from a trainer that hands prepare() no
    dataloader and loads frozen transformers models (found running ZeRO-2/3 on CPU processes
    with deepspeed installed, docs/distributed.md): a micro batch size, else prepare() raises;
    and, under ZeRO-3, transformers' DeepSpeed registration undone before the model loads, else
    the text encoders load partitioned by zero.Init. deepspeed need not be installed here."""
    import transformers.integrations.deepspeed as hf_deepspeed

    class RegisteredZero3:
        def is_zero3(self) -> bool:
            return True

    registered = RegisteredZero3()
    config = tiny_config(tiny_sd3_path, tmp_path, "sampling.rollout_batch_size=2")
    zero2 = fake_accelerator("deepspeed", zero_stage=2)
    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", lambda: registered)
    check_engine(config, zero2)
    assert zero2.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 2
    assert hf_deepspeed.is_deepspeed_zero3_enabled()       # ZeRO-2: left alone
    pinned = fake_accelerator("deepspeed", zero_stage=3)
    pinned.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 8
    check_engine(config, pinned)
    assert pinned.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 8
    assert not hf_deepspeed.is_deepspeed_zero3_enabled()


def test_fp16_full_fine_tuning_needs_float32_master_weights(tiny_sd3_path, tmp_path):
    with pytest.raises(ConfigError, match="model.dtype: float32"):
        tiny_config(tiny_sd3_path, tmp_path, "training.mixed_precision=fp16",
                    "model.lora.enabled=false", "model.dtype=float16")


class DeviceProbe:
    """A reward that records the device it was built on."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = torch.device(device)

    def __call__(self, media, prompts, metadata):
        return torch.zeros(len(prompts))


def test_rewards_load_on_the_trainers_device_unless_they_ask_for_one(tiny_sd3_path, tmp_path):
    from flowgrpo.flow_policy import load_rewards

    probe = "tests.test_engines:DeviceProbe"
    config = tiny_config(tiny_sd3_path, tmp_path)
    config.rewards.components[0].name = probe
    extra = [{"name": probe, "options": {"device": "cpu", "label": "on_cpu"}},
             {"name": probe, "options": {"device": "auto", "label": "auto"}}]
    from flowgrpo.config import RewardSpec

    config.rewards.components += [RewardSpec(name=e["name"], options=e["options"]) for e in extra]
    # "meta" stands in for a rank's GPU: nothing else in the process would pick it by accident
    reward = load_rewards(config, torch.device("meta"))
    devices = [managed.inner.device for managed in reward.rewards.values()]
    assert devices == [torch.device("meta"), torch.device("cpu"), torch.device("meta")]


def test_the_trainer_hands_its_device_to_the_rewards(tiny_sd3_path, tmp_path, monkeypatch):
    import flowgrpo.flow_policy as flow_policy

    seen = []
    real = flow_policy.load_rewards
    monkeypatch.setattr(flow_policy, "load_rewards",
                        lambda config, device: seen.append(device) or real(config, device))
    trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path))
    assert seen == [trainer.accelerator.device]


def test_the_lm_policy_does_not_import_the_flow_stack():
    """Training a causal LM needs neither diffusers nor the flow adapters and rollouts."""
    code = ("import sys; import flowgrpo.trainer, flowgrpo.llm, flowgrpo.policy; "
            "from flowgrpo.policy_registry import load_policy_class; load_policy_class('llm'); "
            "print(sorted(m for m in ('diffusers', 'pipelines', 'flowgrpo.rollout', "
            "'flowgrpo.flow_policy', 'flowgrpo.toyworld', 'reward_models.geneval_toy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def test_a_launch_precision_other_than_the_configs_is_reported(tiny_sd3_path, tmp_path,
                                                               monkeypatch, fresh_accelerator):
    """``accelerate launch --mixed_precision bf16`` (or a config file saying so) with a run config
    at fp32: the config's value is used, and the run says so instead of silently ignoring one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.warns(UserWarning, match="launched with mixed precision 'bf16'.*'no'"):
        trainer = Trainer(tiny_config(tiny_sd3_path, tmp_path))
    assert trainer.accelerator.mixed_precision == "no"
