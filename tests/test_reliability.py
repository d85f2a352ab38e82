"""Fault injection (docs/reliability.md lists what each test proves): non-finite
rewards and gradients, refused and resumed run folders, durable checkpoints and metrics,
config ranges, secrets, prompt files, the CLI's error handling, and a kill -9 loop (slow)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flowgrpo import checkpoint as ckpt
from flowgrpo import run_folder
from flowgrpo.config import (ConfigError, InputError, load_config, redact, resume_signature,
                             to_dict)
from flowgrpo.trainer import Trainer
from tests import helpers

REPO = Path(__file__).resolve().parents[1]


def tiny_data(model_path: str, root: Path, **sections: dict) -> dict:
    """``helpers.tiny_data`` without the comparison grid; ``sections`` update its sections."""
    run = {"comparison_grid": False, **sections.pop("run", {})}
    return helpers.tiny_data(model_path, root, run=run, **sections)


def tiny(model_path: str, root: Path, *overrides: str, **sections: dict):
    return load_config(data=tiny_data(model_path, root, **sections), overrides=list(overrides))


def write_yaml(data: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder`` with its mtime and bytes."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- non-finite values

def test_reward_boundary_turns_inf_into_nan():
    """Every reward output passes as_score_vector: +-inf become NaN with a warning naming the
    reward; a weighted total that overflows float32 is NaN too."""
    from reward_models.base import as_score_vector
    from reward_models.multi import weighted_total

    with pytest.warns(RuntimeWarning, match="'probe'"):
        scores = as_score_vector([1.0, float("inf"), float("-inf"), float("nan")], 4, "probe")
    assert scores[0] == 1.0 and scores[1:].isnan().all()
    big = torch.tensor([3e38, 1.0])
    total = weighted_total({"a": big, "b": big}, {"a": 1.0, "b": 1.0})
    assert total[0].isnan() and total[1] == 2.0


def test_inf_and_nan_rewards_are_masked_counted_and_the_other_groups_train(tiny_sd3_path,
                                                                           tmp_path):
    """+inf, -inf and NaN rewards count as missing (reward/nan_count = 3, advantage 0); the
    batch still trains: finite loss, a finite non-zero gradient, weights move."""
    (tmp_path / "prompts.txt").write_text("an inf cube\na nan ball\na fine cat\n")
    trainer = Trainer(tiny(tiny_sd3_path, tmp_path, "training.prompts_per_iteration=3",
                           "rewards.components=[{name: 'tests.reliability_helpers:"
                           "InfAndNaNByPrompt'}]"))
    batch, rewards, _ = trainer.rollout_and_score(0)
    assert not torch.isinf(rewards["total"]).any()          # masked at the reward boundary
    advantages, metrics = trainer.compute_advantages(batch, rewards)
    missing = rewards["total"].isnan()
    assert metrics["reward/nan_count"] == int(missing.sum()) == 3
    assert torch.isfinite(advantages).all() and (advantages[missing] == 0).all()
    assert (advantages[~missing] != 0).sum() >= 4           # the fine group has signal
    assert all(v == v for k, v in metrics.items() if k.startswith("reward/") and "mean" in k)
    before = {n: p.detach().clone() for n, p in trainer.trainable.items()}
    update = trainer.update(batch, advantages, 0)
    assert update["train/skipped_steps"] == 0
    assert 0 < update["train/grad_norm"] < float("inf")
    assert torch.isfinite(torch.tensor(update["train/policy_loss"]))
    moved = [n for n, p in trainer.trainable.items() if not torch.equal(p, before[n])]
    assert moved and all(torch.isfinite(p).all() for p in trainer.trainable.values())


def test_injected_nan_gradient_skips_the_step_and_the_run_finishes(tiny_sd3_path, tmp_path):
    """A NaN loss in iteration 2 of 3: that step is skipped and counted (weights and EMA
    unchanged and finite), the other iterations train, every checkpoint is written."""
    config = tiny(tiny_sd3_path, tmp_path, "run.max_iterations=3", "run.checkpoint_every=1",
                  "training.ema.enabled=true", "training.ema.every=1",
                  "training.skip_zero_std_groups=false")
    trainer = Trainer(config)
    real_loss = trainer.policy.replay_loss

    def poisoned(batch, replay, advantages, iteration, *args):
        loss, record = real_loss(batch, replay, advantages, iteration, *args)
        return (loss * float("nan"), record) if iteration == 1 else (loss, record)

    trainer.policy.replay_loss = poisoned
    states = []
    real_iteration = trainer.run_iteration

    def recorded(iteration):
        metrics = real_iteration(iteration)
        states.append(({n: p.detach().clone() for n, p in trainer.trainable.items()},
                       {n: s.clone() for n, s in trainer.ema.shadow.items()}))
        return metrics

    trainer.run_iteration = recorded
    history = [h for h in trainer.train() if h["phase"] == "train"]
    assert [h["train/skipped_steps"] for h in history] == [0, 1, 0]
    weights, ema = states[1]
    for name in weights:
        assert torch.equal(weights[name], states[0][0][name]), name     # the step was skipped
        assert torch.equal(ema[name], states[0][1][name]), name
    assert any(not torch.equal(states[2][0][n], weights[n]) for n in weights)   # then trains
    for tensor in [*trainer.trainable.values(), *trainer.ema.shadow.values()]:
        assert torch.isfinite(tensor).all()
    assert [p.name for p in ckpt.list_checkpoints(trainer.run_dir)] == ["1", "2", "3"]


# --------------------------------------------------------------------------- run folders

def test_a_second_run_with_the_same_name_is_refused_and_the_old_run_is_untouched(
        tiny_sd3_path, tmp_path, monkeypatch, capsys):
    from flowgrpo.cli import main

    data = tiny_data(tiny_sd3_path, tmp_path, run={"checkpoint_every": 1})
    path = write_yaml(data, tmp_path / "run.yaml")
    assert main(["train", str(path)]) == 0
    run_dir = tmp_path / "runs" / "tiny"
    before = snapshot(run_dir)
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    capsys.readouterr()

    import flowgrpo.trainer as trainer_module

    real = trainer_module.load_policy_class
    monkeypatch.setattr(trainer_module, "load_policy_class", lambda *a: pytest.fail("loaded"))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "--overwrite" in err and "Traceback" not in err
    assert snapshot(run_dir) == before
    monkeypatch.setattr(trainer_module, "load_policy_class", real)
    # the API: Trainer(config).train() checks in train() (after the model loads), as strictly
    with pytest.raises(InputError, match="already holds a run"):
        Trainer(load_config(path)).train()
    assert snapshot(run_dir) == before

    assert main(["train", str(path), "--overwrite"]) == 0
    assert json.loads((run_dir / "run.json").read_text())["run_id"] != run_id
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in train if r["phase"] == "train"] == [1]


def test_resume_latest_without_a_checkpoint_fails_before_the_model_loads(
        tiny_sd3_path, tmp_path, no_model_load):
    config = tiny(tiny_sd3_path, tmp_path)
    with pytest.raises(InputError, match="no complete checkpoint.*--resume auto"):
        Trainer(config, resume="latest", overwrite=False)
    with pytest.raises(InputError, match="contradict"):
        Trainer(config, resume="latest", overwrite=True)
    run_dir = tmp_path / "runs" / "tiny"
    # auto with nothing to resume starts from scratch (here: up to the model load)
    with pytest.raises(AssertionError, match="model was loaded"):
        Trainer(config, resume="auto", overwrite=False)
    assert run_folder.read_run_id(run_dir)


def _fake_checkpoint(run_dir: Path, iteration: int, run_id: str | None = None,
                     signature: dict | None = None, value: float = 0.0) -> Path:
    weights = {"w": torch.full((3,), value)}
    param = torch.nn.Parameter(weights["w"].clone())
    optimizer = torch.optim.AdamW([param])
    extra = {"run_id": run_id, "signature": signature} if run_id or signature else {}
    return ckpt.save_checkpoint(run_dir / "checkpoints" / str(iteration), iteration=iteration,
                                trainable=weights, optimizer=optimizer, ema_state=None,
                                ema_counters=None, extra=extra)


def test_run_ids_are_checked_on_resume_unless_the_checkpoint_is_named(tmp_path):
    run_dir = tmp_path / "run"
    signature = {"model.family": "sd3"}
    first = run_folder.open_run(run_dir, resume=None, overwrite=False, signature=signature, name="r")
    _fake_checkpoint(run_dir, 1, first["run_id"], signature)
    again = run_folder.open_run(run_dir, resume="latest", overwrite=False, signature=signature, name="r")
    assert again["run_id"] == first["run_id"] and again["checkpoint"].endswith("1")
    # a checkpoint of another run copied into this folder
    _fake_checkpoint(run_dir, 2, "0123456789abcdef", signature)
    with pytest.raises(InputError, match="belongs to run 0123456789abcdef.*--resume"):
        run_folder.open_run(run_dir, resume="latest", overwrite=False, signature=signature, name="r")
    named = run_folder.open_run(run_dir, resume=str(run_dir / "checkpoints" / "2"), overwrite=False,
                          signature=signature, name="r")
    assert named["run_id"] == first["run_id"]        # the folder's run continues from it
    # another run's checkpoint named into a new folder: a fork with its own id
    fork = run_folder.open_run(tmp_path / "fork", resume=str(run_dir / "checkpoints" / "1"),
                         overwrite=False, signature=signature, name="f")
    assert fork["run_id"] not in (first["run_id"], None)


def test_resume_refuses_a_changed_model_lora_layout_or_plan(tiny_sd3_path, tmp_path):
    saved = json.loads(json.dumps(resume_signature(tiny(tiny_sd3_path, tmp_path))))
    run_dir = tmp_path / "run"
    run_folder.open_run(run_dir, resume=None, overwrite=False, signature=saved, name="r")
    _fake_checkpoint(run_dir, 1, run_folder.read_run_id(run_dir), saved)
    changed = tiny(tiny_sd3_path, tmp_path, "model.lora.rank=8", "sampling.plan.kind=branch",
                   "sampling.plan.window_size=2", "model.lora.target_modules=[to_q]")
    current = json.loads(json.dumps(resume_signature(changed)))
    with pytest.raises(InputError) as err:
        run_folder.open_run(run_dir, resume="latest", overwrite=False, signature=current, name="r")
    for field in ("model.lora.rank", "model.lora.target_modules", "sampling.plan"):
        assert field in str(err.value)
    # what a resume may change (lr, iterations) is not part of the signature
    fine = tiny(tiny_sd3_path, tmp_path, "training.lr=1e-3", "run.max_iterations=9")
    assert resume_signature(fine) == resume_signature(tiny(tiny_sd3_path, tmp_path))


def test_overwrite_empties_a_run_folder_and_refuses_any_other_folder(tmp_path):
    run_dir = tmp_path / "run"
    run_folder.open_run(run_dir, resume=None, overwrite=False, signature={}, name="r")
    _fake_checkpoint(run_dir, 1, run_folder.read_run_id(run_dir))
    (run_dir / "metrics.jsonl").write_text('{"iteration": 1}\n')
    run_folder.open_run(run_dir, resume=None, overwrite=True, signature={}, name="r")
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.json"]
    other = tmp_path / "photos"
    other.mkdir()
    (other / "holiday.jpg").write_bytes(b"x")
    with pytest.raises(InputError, match="does not look like a flowgrpo run folder"):
        run_folder.open_run(other, resume=None, overwrite=True, signature={}, name="photos")
    assert (other / "holiday.jpg").read_bytes() == b"x"


def test_a_run_folder_in_use_is_refused(tmp_path):
    first = run_folder.RunLock(tmp_path / "run")
    first.acquire()
    try:
        with pytest.raises(InputError, match="in use by another training process"):
            run_folder.RunLock(tmp_path / "run").acquire()
    finally:
        first.release()
    second = run_folder.RunLock(tmp_path / "run")
    second.acquire()      # free again once released
    second.release()


def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path):
    run_dir = tmp_path / "run"
    run_id = run_folder.open_run(run_dir, resume=None, overwrite=False, signature={}, name="r")["run_id"]
    for iteration in (1, 2, 3):
        _fake_checkpoint(run_dir, iteration, run_id)
    out = run_folder.open_run(run_dir, resume=str(run_dir / "checkpoints" / "1"), overwrite=False,
                        signature={}, name="r")
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["1"]
    aside = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("superseded")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["2", "3"]
    assert any("moved to" in note for note in out["notes"])


# --------------------------------------------------------------------------- checkpoints

def test_incomplete_checkpoints_are_skipped_and_never_counted_by_rotation(tmp_path):
    run_dir = tmp_path / "run"
    for iteration in (1, 2, 3, 4):
        _fake_checkpoint(run_dir, iteration, "r")
    root = run_dir / "checkpoints"
    (root / "2" / "COMPLETE.json").unlink()                       # no marker
    (root / "3" / "trainer_state.json").write_text("")            # empty state
    with open(root / "4" / "trainable.safetensors", "ab") as f:   # a file of another size
        f.write(b"\0")
    empty = root / "5"
    empty.mkdir()
    (empty / "trainer_state.json").write_text("")
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["1"]
    problems = {p.name: ckpt.checkpoint_problem(p) for p in root.iterdir()}
    assert "COMPLETE.json" in problems["2"] and "trainer_state.json" in problems["3"]
    assert "bytes" in problems["4"] and problems["1"] is None
    ckpt.prune_checkpoints(run_dir, keep=1)
    assert (root / "1").is_dir()                  # the newest complete one stays
    assert sorted(p.name for p in root.iterdir()) == ["1", "2", "3", "4", "5"]
    found = run_folder.open_run(run_dir, resume="latest", overwrite=False, signature={}, name="r")
    assert found["checkpoint"] == str(root / "1")
    assert sum("skipped incomplete checkpoint" in n for n in found["notes"]) == 4
    # a damaged file of the right size: caught by its sha256 when a resume picks it
    data = bytearray((root / "1" / "rng.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (root / "1" / "rng.safetensors").write_bytes(bytes(data))
    with pytest.raises(InputError, match="damaged.*rng.safetensors"):
        ckpt.load_checkpoint(root / "1", verify_hashes=True)
    with pytest.raises(InputError, match="every checkpoint .* is damaged"):
        run_folder.open_run(run_dir, resume="latest", overwrite=False, signature={}, name="r")
    with pytest.raises(InputError, match="damaged"):
        run_folder.open_run(run_dir, resume=str(root / "1"), overwrite=False, signature={}, name="r")
    _fake_checkpoint(run_dir, 6, "r")
    _fake_checkpoint(run_dir, 7, "r")
    (root / "7" / "rng.safetensors").write_bytes(bytes(data))     # the newest is damaged
    found = run_folder.open_run(run_dir, resume="latest", overwrite=False, signature={}, name="r")
    assert found["checkpoint"] == str(root / "6")
    assert any("checkpoint 7 is damaged" in n for n in found["notes"])


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    for iteration in (1, 2, 3):
        _fake_checkpoint(run_dir, iteration, "r")
    (run_dir / "checkpoints" / "3" / "COMPLETE.json").unlink()
    ckpt.prune_checkpoints(run_dir, keep=1)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "3"]


def test_same_iteration_resave_is_atomic_and_stale_folders_are_swept(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    _fake_checkpoint(run_dir, 5, "r", value=1.0)
    # a crash after the old folder moved aside and before the new one moved in
    real_replace = os.replace

    def crash_on_move_in(src, dst):
        if Path(src).name == ".tmp-5":
            raise KeyboardInterrupt("killed between the two renames")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_move_in)
    with pytest.raises(KeyboardInterrupt):
        _fake_checkpoint(run_dir, 5, "r", value=2.0)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert not (root / "5").exists() and (root / ".old-5").is_dir() and (root / ".tmp-5").is_dir()
    (root / ".engine-7").mkdir()
    notes = run_folder.sweep_stale(run_dir)
    assert sorted(p.name for p in root.iterdir()) == ["5"]
    assert any("restored checkpoint 5" in n for n in notes)
    assert float(load_file(str(root / "5" / "trainable.safetensors"))["w"][0]) == 1.0
    # an uninterrupted re-save replaces it and leaves nothing else behind
    _fake_checkpoint(run_dir, 5, "r", value=3.0)
    assert sorted(p.name for p in root.iterdir()) == ["5"]
    assert ckpt.checkpoint_problem(root / "5", verify_hashes=True) is None
    assert float(load_file(str(root / "5" / "trainable.safetensors"))["w"][0]) == 3.0


def test_a_torn_metrics_line_is_dropped_on_resume(tiny_sd3_path, tmp_path):
    common = ["run.checkpoint_every=1", "name=torn"]
    Trainer(tiny(tiny_sd3_path, tmp_path, *common, "run.max_iterations=2")).train()
    metrics = tmp_path / "runs" / "torn" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"iteration": 3, "phase": "tr')          # killed while writing
    resumed = Trainer(tiny(tiny_sd3_path, tmp_path, *common, "run.max_iterations=3"))
    with pytest.warns(RuntimeWarning, match="dropped 1 unreadable line"):
        resumed.train(resume="latest")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records if r["phase"] == "train"] == [1, 2, 3]


def test_checkpoints_store_the_run_id_and_signature(tiny_sd3_path, tmp_path):
    trainer = Trainer(tiny(tiny_sd3_path, tmp_path, "run.checkpoint_every=1"))
    trainer.train()
    folder = trainer.run_dir / "checkpoints" / "1"
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["run_id"] == run_folder.read_run_id(trainer.run_dir)
    assert state["signature"]["model.lora.rank"] == 4
    marker = json.loads((folder / "COMPLETE.json").read_text())
    assert {"trainable.safetensors", "trainer_state.json",
            "pytorch_lora_weights.safetensors"} <= set(marker["files"])


# --------------------------------------------------------------------------- config

BAD_VALUES = [
    ("training.lr=nan", "training.lr"),
    ("training.lr=inf", "training.lr"),
    ("sampling.noise_level=nan", "sampling.noise_level"),
    ("training.ema.every=0", "training.ema.every"),
    ("training.max_grad_norm=-1", "training.max_grad_norm"),
    ("training.adv_clip=-1", "training.adv_clip"),
    ("training.adv_eps=-1", "training.adv_eps"),
    ("training.weight_decay=-0.1", "training.weight_decay"),
    ("training.adam_eps=0", "training.adam_eps"),
    ("run.keep_checkpoints=-1", "run.keep_checkpoints"),
    ("run.num_threads=-2", "run.num_threads"),
    ("prompts.num_eval=-1", "prompts.num_eval"),
    ("prompts.eval_seeds=0", "prompts.eval_seeds"),
    ("training.adam_betas=[2,3]", "training.adam_betas[0]"),
    ("training.adam_betas=[0.9,1.0]", "training.adam_betas[1]"),
    ("sampling.guidance_scale=.inf", "sampling.guidance_scale"),
    ("sampling.plan.compress_ratio=nan", "sampling.plan.compress_ratio"),
    ("prompts.curriculum.floor=nan", "prompts.curriculum.floor"),
    ("rewards.components=[{name: brightnes}]", "rewards.components[0].name"),
    ("rewards.components=[{name: jpeg_compressibility, weight: .nan}]",
     "rewards.components[0].weight"),
    ("model.family=sdxl", "model.family"),
    ("prompts.train=prompts.json", "prompts.train"),
    ("prompts.eval=heldout.csv", "prompts.eval"),
    ("name=..", "name"),
]


@pytest.mark.parametrize("override,field", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_each_bad_config_value_fails_at_load_naming_the_field(override, field, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "toy_geneval.yaml", [override])
    assert str(err.value).startswith(field) or f" {field} " in f" {err.value}"


def test_a_bad_config_value_fails_before_the_model_loads_from_the_cli(
        tiny_sd3_path, tmp_path, no_model_load, capsys):
    from flowgrpo.cli import main

    path = write_yaml(tiny_data(tiny_sd3_path, tmp_path), tmp_path / "run.yaml")
    assert main(["train", str(path), "training.lr=nan"]) == 2
    err = capsys.readouterr().err
    assert "training.lr must be a finite number" in err and "Traceback" not in err


def test_choices_come_from_the_registries(monkeypatch):
    """A family added to the pipelines registry is valid without touching the config module."""
    import pipelines

    monkeypatch.setitem(pipelines.MODEL_FAMILIES, "sdxl", "pipelines.sd3:SD3Model")
    assert load_config(REPO / "configs" / "toy_geneval.yaml",
                       ["model.family=sdxl"]).model.family == "sdxl"


# --------------------------------------------------------------------------- secrets

def test_secret_reward_options_are_redacted_from_config_yaml_and_trackers(tiny_sd3_path,
                                                                          tmp_path):
    options = {"url": "http://127.0.0.1:1", "token": "s3cret-1", "token_env": "MY_TOKEN",
               "auth": {"API-Key": "s3cret-2", "Password": "s3cret-3", "hf_token": "s3cret-4"},
               "headers": [{"secret": "s3cret-5"}]}
    spec = {"name": "tests.reliability_helpers:BrightnessWithOptions", "options": options}
    config = tiny(tiny_sd3_path, tmp_path, rewards={"components": [spec]})
    assert config.rewards.components[0].options["token"] == "s3cret-1"   # the run still gets it
    trainer = Trainer(config)
    trainer.tracker = "tensorboard"            # exercise the tracker path without a tracker
    captured = {}
    trainer.accelerator.init_trackers = lambda name, config: captured.update(config)
    trainer.accelerator.log = lambda *a, **k: None
    trainer.accelerator.end_training = lambda: None
    trainer.train()
    written = (trainer.run_dir / "config.yaml").read_text()
    for text in (written, json.dumps(captured)):
        assert "s3cret" not in text
        assert "MY_TOKEN" in text and "***" in text
    assert yaml.safe_load(written)["rewards"]["components"][0]["options"]["token"] == "***"
    assert redact({"max_tokens": 5, "token_env": "X", "Secret": None}) == \
        {"max_tokens": 5, "token_env": "X", "Secret": None}
    assert "s3cret-1" in json.dumps(to_dict(config))     # only the dumps are redacted


# --------------------------------------------------------------------------- prompt files

PROMPT_FILES = [
    ("prompts.json", '[{"prompt": "a"}]', "prompt file .*prompts.json: .json is not a prompt"),
    ("prompts.csv", "prompt\na cat\n", r"\.csv is not a prompt format"),
    ("prompts", "a cat\n", "no suffix is not a prompt format"),
    ("bad.jsonl", '{"prompt": "a"}\n\n{"prompt": "b",\n', r"bad.jsonl:3: not valid JSON"),
    ("string.jsonl", '"a prompt with the word prompt"\n', r"string.jsonl:1: expected a JSON object"
                                                        r".*got a JSON string"),
    ("missing.jsonl", '{"text": "a"}\n', r"missing.jsonl:1: no \"prompt\" field"),
    ("number.jsonl", '{"prompt": 7}\n', r"number.jsonl:1: \"prompt\" is a JSON number"),
    ("meta.jsonl", '{"prompt": "a", "metadata": [1]}\n', r"meta.jsonl:1: \"metadata\" must be"),
    ("empty.txt", "\n\n", "holds no prompts"),
]


@pytest.mark.parametrize("name,body,message", PROMPT_FILES, ids=[p[0] for p in PROMPT_FILES])
def test_prompt_file_errors_name_the_file_and_line(name, body, message, tmp_path):
    from flowgrpo.prompts import load_prompts

    (tmp_path / name).write_text(body)
    with pytest.raises(InputError, match=message):
        load_prompts(str(tmp_path / name))


def test_jsonl_prompts_still_load(tmp_path):
    from flowgrpo.prompts import load_prompts

    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "metadata": {"family": "x"}}\n\n'
                                      '{"prompt": "b"}\n')
    assert load_prompts(str(tmp_path / "p.jsonl")) == [
        {"prompt": "a", "metadata": {"family": "x"}}, {"prompt": "b", "metadata": {}}]


# --------------------------------------------------------------------------- the CLI

def test_cli_prints_input_errors_in_one_line_and_keeps_other_tracebacks(tmp_path, monkeypatch,
                                                                        capsys):
    from flowgrpo import cli

    path = tmp_path / "c.yaml"
    path.write_text("rewards: {components: [{name: jpeg_compressibility}]}\n"
                    f"run: {{output_dir: {tmp_path / 'runs'}}}\n")

    def deep_bug(self, *args, **kwargs):
        raise ValueError("a bug deep inside training")

    monkeypatch.setattr(Trainer, "__init__", deep_bug)
    with pytest.raises(ValueError, match="a bug deep inside training"):
        cli.main(["train", str(path)])

    def bad_input(self, *args, **kwargs):
        raise InputError("prompt file x.json: .json is not a prompt format")

    monkeypatch.setattr(Trainer, "__init__", bad_input)
    assert cli.main(["train", str(path)]) == 2
    assert capsys.readouterr().err.strip() == \
        "flowgrpo train: error: prompt file x.json: .json is not a prompt format"


def test_a_broken_commands_module_is_an_error_not_missing_subcommands(monkeypatch):
    import importlib

    monkeypatch.setitem(sys.modules, "flowgrpo.commands", None)   # import raises ImportError
    monkeypatch.delitem(sys.modules, "flowgrpo.cli", raising=False)
    with pytest.raises(ImportError):
        importlib.import_module("flowgrpo.cli")


# --------------------------------------------------------------------------- kill -9 loop

def _train_process(config_path: Path, *args: str, fault_sleep: float | None,
                   log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.pop(ckpt.FAULT_SLEEP_ENV, None)
    if fault_sleep:
        env[ckpt.FAULT_SLEEP_ENV] = str(fault_sleep)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "flowgrpo", "train", str(config_path),
                                 *args], cwd=REPO, env=env, stdout=out, stderr=out)


def _wait_for(predicate, process: subprocess.Popen, timeout: float = 120.0) -> bool:
    """Poll ``predicate`` until it holds (True) or the process ends or time runs out (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and process.poll() is None:
        if predicate():
            return True
        time.sleep(0.002)
    return False


def _temporaries(run_dir: Path) -> set[tuple[str, int]]:
    """(name, inode) of the unfinished saves and removals in the run's checkpoints/."""
    out = set()
    for path in (run_dir / "checkpoints").glob(".tmp-*"):
        try:
            out.add((path.name, path.stat().st_ino))
        except FileNotFoundError:    # renamed or removed while we looked
            pass
    return out


def _last_train_iteration(metrics: Path) -> int:
    """The iteration of the last complete train record (0 when there is none)."""
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("phase") == "train":
            return int(record["iteration"])
    return 0


def _newest(run_dir: Path) -> int:
    found = ckpt.list_checkpoints(run_dir)
    return int(found[-1].name) if found else 0


def _assert_no_half_written_checkpoint(run_dir: Path) -> None:
    for folder in (run_dir / "checkpoints").iterdir() if (run_dir / "checkpoints").exists() else []:
        if folder.name.isdigit():
            assert ckpt.checkpoint_problem(folder, verify_hashes=True) is None, folder


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_equals_the_uninterrupted_run(tiny_sd3_path,
                                                                          tmp_path):
    """kill -9 of `flowgrpo train` at random points (in the middle of a checkpoint save, in an
    iteration shortly after its metrics record, or at a random time, start-up included), each
    followed by --resume latest (--resume auto while no checkpoint exists yet): the final
    weights and EMA equal an uninterrupted run's to 1e-6, and no numbered checkpoint folder is
    ever half-written. About 60 s."""
    iterations = 16
    data = tiny_data(tiny_sd3_path, tmp_path,
                     # The prompt-embedding cache encodes the prompts it misses in one batch, so
                     # an embedding depends (at ~1e-7) on which prompts a process had cached
                     # already: a resumed process, whose cache starts empty, drifts by ~3e-6
                     # after one step at lr 1e-2. Without the cache every call encodes the same
                     # batch in both runs and the resumed weights are bit-identical.
                     model={"options": {"height": 32, "width": 32, "prompt_cache_size": 0}},
                     training={"ema": {"enabled": True, "every": 1}},
                     run={"max_iterations": iterations, "checkpoint_every": 1,
                          "keep_checkpoints": 2, "num_threads": 1})
    log = tmp_path / "train.log"
    reference = write_yaml({**data, "name": "straight"}, tmp_path / "straight.yaml")
    assert _train_process(reference, fault_sleep=None, log=log).wait(timeout=300) == 0
    config = write_yaml({**data, "name": "killed"}, tmp_path / "killed.yaml")
    run_dir = tmp_path / "runs" / "killed"
    metrics = run_dir / "metrics.jsonl"
    rng = random.Random(18)
    kills, during_save, attempts = 0, 0, 0
    while kills < 6 and attempts < 15:
        attempts += 1
        found = ckpt.list_checkpoints(run_dir)
        args: tuple[str, ...] = ()
        if attempts > 1:
            args = ("--resume", "latest" if found else "auto")
        resumed_from = int(found[-1].name) if found else 0
        stale = _temporaries(run_dir)        # left by the previous kill; swept at start
        # every file of a save sleeps 30 ms: a save takes ~0.25 s, a target for the kills
        process = _train_process(config, *args, fault_sleep=0.03, log=log)
        mode = kills % 3
        # Modes 0 and 1 let one checkpoint complete first, so that the run moves on.
        if mode == 0:     # in the middle of a save: a new .tmp- folder exists
            _wait_for(lambda: _newest(run_dir) > resumed_from and
                      bool(_temporaries(run_dir) - stale), process)
            time.sleep(rng.uniform(0.0, 0.15))
        elif mode == 1:   # in an iteration, shortly after this process logged one
            _wait_for(lambda: _last_train_iteration(metrics) > resumed_from + 1, process)
            time.sleep(rng.uniform(0.0, 0.3))
        else:             # anywhere, start-up (about 5 s) included
            time.sleep(rng.uniform(0.5, 6.5))
        if process.poll() is None:
            during_save += bool(_temporaries(run_dir) - stale)
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            kills += 1
        else:             # it finished first: the loop goes on from its last checkpoint
            assert process.returncode == 0, log.read_text()[-3000:]
        _assert_no_half_written_checkpoint(run_dir)
    assert kills >= 5 and during_save >= 1, (kills, during_save)
    args = ("--resume", "latest" if ckpt.list_checkpoints(run_dir) else "auto")
    assert _train_process(config, *args, fault_sleep=None, log=log).wait(timeout=300) == 0, \
        log.read_text()[-3000:]

    ours = run_dir / "checkpoints" / str(iterations)
    theirs = tmp_path / "runs" / "straight" / "checkpoints" / str(iterations)
    for name in ("trainable.safetensors", "ema.safetensors"):
        a, b = load_file(str(ours / name)), load_file(str(theirs / name))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0, msg=key)
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.isdigit()]
    assert leftovers == []
    _assert_no_half_written_checkpoint(run_dir)
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [str(iterations - 1),
                                                               str(iterations)]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records if r["phase"] == "train"] == \
        list(range(1, iterations + 1))
