"""Held-out metrics (eval.rewards) beside the training reward, their direction, curves.png, the
evaluation samples on the tracker, and best-checkpoint selection with early stopping."""
from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.config import ConfigError, load_config
from flowgrpo.curves import (COLUMNS, PANEL_HEIGHT, TRAIN_HEIGHT, curve_series, metric_keys,
                             moving_average)
from flowgrpo.heldout import BestRecord, resolve_mode
from flowgrpo.run_log import eval_line, read_records, summary_line
from flowgrpo.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "toy_geneval.yaml"
needs_toy = pytest.mark.skipif(not (ROOT / "assets" / "toy" / "transformer").is_dir(),
                               reason="assets/toy is not built")


def toy_config(tmp_path, *overrides: str):
    """The embedded default shrunk to seconds: 2 x 4 samples, 6 steps, 6 held-out samples."""
    return load_config(CONFIG, [
        f"model.path={ROOT / 'assets' / 'toy'}", f"run.output_dir={tmp_path}",
        "run.tracker=none", "run.progress=false", "run.num_threads=1",
        "prompts.eval_per_family=1", "training.prompts_per_iteration=2", "training.group_size=4",
        "training.gradient_accumulation_steps=0", "sampling.num_steps=6",
        "sampling.eval_num_steps=4", "sampling.plan.window_size=2",
        "sampling.plan.branch_range=[0, 2]", "run.comparison_grid=false",
        "run.checkpoint_every=0", "run.max_iterations=2", "run.eval_every=1", *overrides])


# ------------------------------------------------------------------------ config validation

@pytest.mark.parametrize("overrides, message", [
    (["eval.rewards=[{name: toy_artifactz}]"], r"eval\.rewards\[0\]\.name: unknown reward"),
    (["eval.rewards=[{name: toy_artifacts}, {name: geneval_toy}]"],
     r"eval\.rewards\[1\] \(geneval_toy\) would be logged as eval/geneval_toy.*label: "
     r"geneval_toy_heldout"),
    (["eval.rewards=[{name: toy_artifacts}, {name: toy_artifacts}]"],
     r"eval\.rewards\[1\] and eval\.rewards\[0\].*options\.label"),
    (["eval.rewards=[{name: toy_artifacts, options: {label: total}}]"], r"eval/total"),
    (["prompts.eval=null"], r"eval\.rewards scores the evaluation's samples"),
    (["run.select_best_on=eval/clip_score"],
     r"must start with one of eval/geneval_toy, eval/total, eval/toy_artifacts"),
    (["run.select_best_on=geneval_toy"], r"must start with one of"),
    (["run.select_best_on=eval/geneval_toy/se"], r"standard error"),
    (["run.select_best_mode=best"], r"run\.select_best_mode must be one of max, min, auto"),
    (["run.early_stop_patience=3"], r"run\.early_stop_patience .* run\.select_best_on"),
])
def test_config_errors_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIG, overrides)


def test_valid_held_out_configs_load():
    config = load_config(CONFIG, [
        "eval.rewards=[{name: toy_artifacts}, {name: geneval_toy, options: {label: partial, "
        "score: partial}}]",
        "run.select_best_on=eval/toy_artifacts.texture/family_mean",
        "run.early_stop_patience=2"])
    assert [s.name for s in config.eval.rewards] == ["toy_artifacts", "geneval_toy"]
    assert config.run.select_best_mode == "auto"


def test_llm_eval_rewards_are_text_rewards():
    base = ["prompts.eval=assets/lm/heldout.jsonl"]
    with pytest.raises(ConfigError, match=r"eval\.rewards\[0\]\.name: unknown text reward "
                                          r"'toy_artifacts'"):
        load_config(ROOT / "configs" / "llm_arith.yaml",
                    [*base, "eval.rewards=[{name: toy_artifacts}]"])
    with pytest.raises(ConfigError, match="eval/accuracy"):
        load_config(ROOT / "configs" / "llm_arith.yaml",
                    [*base, "eval.rewards=[{name: length, options: {label: accuracy}}]"])
    config = load_config(ROOT / "configs" / "llm_arith.yaml",
                         [*base, "eval.rewards=[{name: length, options: {target: 2}}]",
                          "run.select_best_on=eval/accuracy"])
    assert config.eval.rewards[0].name == "length"


# ------------------------------------------------------------------------ direction and best

def test_best_record_respects_the_direction_and_counts_evaluations_without_a_new_best():
    lower = BestRecord("eval/toy_artifacts", "min")
    seen = [lower.observe(i, {"eval/toy_artifacts": v})
            for i, v in enumerate([0.5, 0.2, 0.2, float("nan"), 0.3, 0.1])]
    assert seen == [True, True, False, False, False, True]     # ties and NaN never improve
    assert (lower.value, lower.iteration, lower.since) == (0.1, 5, 0)
    higher = BestRecord("eval/x", "max")
    for i, v in enumerate([0.5, 0.2, 0.4]):
        higher.observe(i, {"eval/x": v})
    assert (higher.iteration, higher.since) == (0, 2)
    assert higher.exhausted(2) and not higher.exhausted(3) and not higher.exhausted(0)
    with pytest.raises(ConfigError, match=r"not among the evaluation's metrics; choose one of: "
                                          r"eval/y$"):
        higher.observe(3, {"eval/y": 2.0, "eval/x/se": 0.1})
    again = BestRecord("eval/x", "max")
    assert again.load_state_dict(higher.state_dict()) and again.state_dict() == higher.state_dict()
    assert not BestRecord("eval/x", "min").load_state_dict(higher.state_dict())
    directions = {"toy_artifacts": False, "geneval_toy": True}
    assert resolve_mode("auto", "eval/toy_artifacts.texture/family_mean", directions) == "min"
    assert resolve_mode("auto", "eval/geneval_toy.exact/colors", directions) == "max"
    assert resolve_mode("auto", "eval/total", directions) == "max"
    assert resolve_mode("max", "eval/toy_artifacts", directions) == "max"


def _history():
    evals = [(0, 0.30, 0.020), (10, 0.45, 0.010), (20, 0.40, 0.030)]
    records = []
    for it, accuracy, artifacts in evals:
        records.append({"iteration": it, "phase": "eval", "eval/geneval_toy": accuracy,
                        "eval/geneval_toy/se": 0.02, "eval/geneval_toy/colors": accuracy,
                        "eval/geneval_toy/family_mean": accuracy + 0.01,
                        "eval/geneval_toy/family_mean/se": 0.03,
                        "eval/toy_artifacts": artifacts, "eval/toy_artifacts/se": 0.004})
        if it:
            records += [{"iteration": i, "phase": "train", "reward/total/mean": i / 100}
                        for i in range(it - 9, it + 1)]
    return sorted(records, key=lambda r: (r["iteration"], r["phase"] == "eval"))


def test_summary_reports_start_end_and_the_best_in_each_metrics_direction(tmp_path):
    line = summary_line("run", _history(), 12.0, tmp_path, directions={"toy_artifacts": False},
                        heldout={"toy_artifacts"},
                        best={"key": "eval/toy_artifacts", "mode": "min", "value": 0.01,
                              "iteration": 10, "since": 1}, stopped_early=20, patience=1)
    assert "train reward 0.010 -> 0.200" in line
    assert "eval/geneval_toy/family_mean 0.310 -> 0.410 (se 0.030), best 0.460 at 10" in line
    assert ("eval/toy_artifacts [held-out, lower is better] 0.020 -> 0.030 (se 0.004), "
            "best 0.010 at 10") in line
    assert "eval/geneval_toy/colors" not in line        # per-family values stay in the log
    assert "best checkpoint: eval/toy_artifacts 0.01 (min) at iteration 10" in line
    assert "stopped early at iteration 20" in line
    printed = eval_line(10, _history()[-12], {"toy_artifacts": False}, {"toy_artifacts"})
    assert printed.startswith("eval at iteration 10: geneval_toy/family_mean 0.46 (se 0.03)")
    assert "toy_artifacts 0.01 (se 0.004) [held-out, lower is better]" in printed


# ------------------------------------------------------------------------ curves

def test_moving_average_and_curve_series():
    values = moving_average([1.0, 2.0, float("nan"), 4.0, 6.0], 2)
    assert values == [1.0, 1.5, 2.0, 4.0, 5.0]
    assert math.isnan(moving_average([float("nan")], 3)[0])
    records = _history()
    assert metric_keys(records) == ["eval/geneval_toy/family_mean", "eval/toy_artifacts"]
    train, average, panels = curve_series(records, {"toy_artifacts": False}, {"toy_artifacts"},
                                          window=3)
    assert train.xs == list(map(float, range(1, 21))) and train.ys[-1] == 0.2
    assert average.ys[-1] == pytest.approx((0.18 + 0.19 + 0.2) / 3)
    accuracy, artifacts = panels
    assert accuracy.xs == [0.0, 10.0, 20.0] and accuracy.se == [0.03] * 3
    assert "trained on, higher is better" in accuracy.title and not accuracy.heldout
    assert artifacts.ys == [0.02, 0.01, 0.03] and artifacts.heldout
    assert "held-out, lower is better" in artifacts.title


# ------------------------------------------------------------------------ runs on the toy model

def _train_records(history):
    return [{k: v for k, v in h.items() if not k.startswith("time/")}
            for h in history if h["phase"] == "train"]


@needs_toy
def test_held_out_metrics_are_logged_and_never_change_training(tmp_path):
    """The same run with and without eval.rewards: identical training records and weights; the
    held-out keys (mean, se, per family, family mean) in evaluation records only."""
    plain = Trainer(toy_config(tmp_path / "a", "eval.rewards=[]"))
    plain_history = plain.train()
    held = Trainer(toy_config(tmp_path / "b"))
    history = held.train()
    assert _train_records(history) == _train_records(plain_history)
    for name, param in held.trainable.items():
        assert torch.equal(param, plain.trainable[name]), name
    evals = [h for h in history if h["phase"] == "eval"]
    assert [h["iteration"] for h in evals] == [0, 1, 2]
    for record in evals:
        for key in ("eval/toy_artifacts", "eval/toy_artifacts/se", "eval/toy_artifacts/colors",
                    "eval/toy_artifacts/family_mean", "eval/toy_artifacts/family_mean/se",
                    "eval/toy_artifacts.texture"):
            assert key in record, key
    assert not any("toy_artifacts" in key for h in history if h["phase"] == "train" for key in h)
    plain_evals = [h for h in plain_history if h["phase"] == "eval"]
    for mine, theirs in zip(evals, plain_evals):   # the training rewards' metrics are untouched
        assert {k: v for k, v in mine.items() if "toy_artifacts" not in k} == theirs


@needs_toy
def test_held_out_rewards_score_the_evaluation_samples_once(tmp_path):
    trainer = Trainer(toy_config(tmp_path))
    calls: dict[str, list] = {"train": [], "eval": []}

    class Recorder:
        def __init__(self, inner, kind):
            self.inner, self.kind = inner, kind

        def __call__(self, media, prompts, metadata):
            calls[self.kind].append(media.clone())
            return self.inner(media, prompts, metadata)

    trainer.policy.reward = Recorder(trainer.policy.reward, "train")
    trainer.policy.eval_reward = Recorder(trainer.policy.eval_reward, "eval")
    metrics = trainer.evaluate(0, save_images=False)
    assert len(calls["eval"]) == 1 and len(calls["train"]) == 1
    assert torch.equal(calls["eval"][0], calls["train"][0])
    from reward_models.toy_quality import ToyArtifactsReward

    expected = ToyArtifactsReward()(calls["eval"][0], [""] * len(calls["eval"][0]))
    assert metrics["eval/toy_artifacts"] == pytest.approx(float(expected.mean()), abs=1e-6)


def _inject(trainer, values: dict[int, float]) -> dict[int, dict]:
    """Replace the policy's evaluation by ``values`` (iteration -> eval/toy_artifacts); returns
    the trainable weights seen at each evaluation."""
    weights: dict[int, dict] = {}

    def evaluate(records, iteration, out_dir):
        weights[iteration] = {n: p.detach().clone() for n, p in trainer.trainable.items()}
        return {"eval/toy_artifacts": values[iteration], "eval/toy_artifacts/se": 0.01}

    trainer.policy.evaluate = evaluate
    return weights


@needs_toy
def test_select_best_keeps_the_best_evaluation_and_early_stopping_stops(tmp_path, capsys):
    """toy_artifacts is lower-is-better, so mode auto keeps the smallest value; two evaluations
    without a new best stop the run; checkpoints/best survives keep_checkpoints."""
    values = {0: 0.5, 1: 0.2, 2: 0.3, 3: 0.25, 4: 0.1, 5: 0.0}
    trainer = Trainer(toy_config(tmp_path, "run.max_iterations=5", "run.checkpoint_every=1",
                                 "run.keep_checkpoints=1", "run.select_best_on=eval/toy_artifacts",
                                 "run.early_stop_patience=2"))
    weights = _inject(trainer, values)
    history = trainer.train()
    assert trainer.best.mode == "min" and trainer.stopped_early == 3
    assert [h["iteration"] for h in history if h["phase"] == "train"] == [1, 2, 3]
    best = tmp_path / "toy_geneval" / "checkpoints" / "best"
    state = json.loads((best / "trainer_state.json").read_text())
    assert state["iteration"] == 1 and state["best"]["value"] == 0.2
    record = json.loads((best.parent / "best.json").read_text())
    assert (record["iteration"], record["value"], record["mode"]) == (1, 0.2, "min")
    saved = load_file(str(best / "trainable.safetensors"))
    for name, value in weights[1].items():
        assert torch.equal(saved[name], value), name
    assert any(not torch.equal(saved[n], weights[3][n]) for n in saved)   # the run moved on
    assert sorted(p.name for p in best.parent.iterdir() if p.is_dir()) == ["3", "best"]
    out = capsys.readouterr().out
    assert "best checkpoint: eval/toy_artifacts 0.2 (min) at iteration 1" in out
    assert "stopped early at iteration 3" in out
    from flowgrpo.checkpoint_inspection import resolve_checkpoint

    assert resolve_checkpoint(str(best)).kind == "full"      # what flowgrpo eval --lora takes


@needs_toy
def test_resume_keeps_the_best_record(tmp_path):
    """A run stopped at iteration 3 (best at 1, two evaluations since) and resumed: the restored
    count makes the first evaluation after the resume the stopping one, and checkpoints/best
    still holds iteration 1. A best folder newer than a resumed checkpoint is set aside."""
    values = {0: 0.5, 1: 0.2, 2: 0.3, 3: 0.4, 4: 0.45, 5: 0.0, 6: 0.0}
    common = ["run.checkpoint_every=1", "run.keep_checkpoints=0",
              "run.select_best_on=eval/toy_artifacts", "run.early_stop_patience=3"]
    first = Trainer(toy_config(tmp_path, "run.max_iterations=3", *common))
    _inject(first, values)
    first.train()
    assert first.stopped_early is None and first.best.since == 2
    resumed = Trainer(toy_config(tmp_path, "run.max_iterations=6", *common))
    _inject(resumed, values)
    resumed.train(resume="latest")
    assert (resumed.best.iteration, resumed.best.value) == (1, 0.2)
    assert resumed.stopped_early == 4
    best = tmp_path / "toy_geneval" / "checkpoints" / "best"
    assert json.loads((best / "trainer_state.json").read_text())["iteration"] == 1
    # Continue from checkpoint 1 with other values: a new best at 2; resuming from 1 once more
    # sets that best (of the abandoned continuation) aside and keeps checkpoint 1's record.
    values.update({2: 0.1, 3: 0.4, 4: 0.4})
    again = Trainer(toy_config(tmp_path, "run.max_iterations=2", *common[:-1]))
    _inject(again, values)
    again.train(resume=str(tmp_path / "toy_geneval" / "checkpoints" / "1"))
    assert json.loads((best / "trainer_state.json").read_text())["iteration"] == 2
    back = Trainer(toy_config(tmp_path, "run.max_iterations=1", *common[:-1]))
    _inject(back, values)
    back.train(resume=str(tmp_path / "toy_geneval" / "checkpoints" / "1"))
    assert not best.exists()
    moved = list((tmp_path / "toy_geneval" / "checkpoints").glob("superseded-*/best"))
    assert moved and json.loads((moved[0] / "trainer_state.json").read_text())["iteration"] == 2
    assert (back.best.iteration, back.best.value) == (1, 0.2)


@needs_toy
def test_curves_and_samples_are_written_at_every_evaluation(tmp_path, monkeypatch):
    """curves.png is redrawn with every evaluation's points; TensorBoard receives the
    evaluation grid (samples/eval_<it>.png) at each evaluation step."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import flowgrpo.curves as curves

    config = toy_config(tmp_path, "run.tracker=tensorboard")
    trainer = Trainer(config)
    drawn = []
    original = curves.write_curves

    def spy(records, path, *args, **kwargs):
        result = original(records, path, *args, **kwargs)
        evals = [r for r in records if r["phase"] == "eval"]
        drawn.append((len(evals), Path(path).read_bytes()))
        return result

    monkeypatch.setattr(curves, "write_curves", spy)
    trainer.train()
    run = tmp_path / "toy_geneval"
    assert [count for count, _ in drawn] == [1, 2, 3]
    assert len({image for _, image in drawn}) == 3          # re-written with new points
    assert (run / "curves.png").read_bytes() == drawn[-1][1]
    records = read_records(run / "metrics.jsonl")
    panels = len(curve_series(records, {}, ())[2])
    with Image.open(run / "curves.png") as image:
        assert image.height == TRAIN_HEIGHT + math.ceil(panels / COLUMNS) * PANEL_HEIGHT
    assert panels >= 4                # geneval_toy, .partial, toy_artifacts, its parts...
    # A component equal to its reward's main score (geneval_toy.exact, total: the exact score
    # is the only weighted one; toy_artifacts.artifacts) gets no panel of its own.
    assert panels < len(metric_keys(records))
    events = EventAccumulator(str(run / config.name), size_guidance={"images": 0})
    events.Reload()
    logged = events.Images("samples/eval")
    assert [event.step for event in logged] == [0, 1, 2]
    with Image.open(run / "samples" / "eval_00002.png") as grid:
        assert (logged[-1].width, logged[-1].height) == grid.size


# ------------------------------------------------------------------------ media and trackers

def test_video_samples_become_a_strip_and_a_gif_for_wandb(tmp_path, monkeypatch):
    from PIL import Image

    from flowgrpo.eval_media import (IMAGE_TAG, VIDEO_TAG, evenly_spaced, log_eval_media,
                                     save_eval_media, video_strip)

    assert evenly_spaced(10, 8) == [0, 1, 3, 4, 5, 6, 8, 9] and evenly_spaced(3, 8) == [0, 1, 2]
    videos = torch.rand(3, 10, 3, 4, 6)
    frames, columns = video_strip(videos)
    assert columns == 8 and frames.shape == (24, 3, 4, 6)
    assert torch.equal(frames[8 + 2], videos[1, 3])           # row 1, column 2 = frame 3
    files = save_eval_media(videos, tmp_path, 7)
    assert [f.name for f in files] == ["eval_00007.png", "eval_00007.gif"]
    with Image.open(files[0]) as strip:
        assert strip.size == (8 * (6 + 2) + 2, 3 * (4 + 2) + 2)   # make_grid's 2 px padding
    with Image.open(files[1]) as gif:
        assert gif.n_frames == 10

    logged = []
    fake = types.ModuleType("wandb")
    fake.Image = lambda path: ("image", path)
    fake.Video = lambda path, format: ("video", path, format)
    monkeypatch.setitem(sys.modules, "wandb", fake)

    class Run:
        def log(self, payload, step):
            logged.append((payload, step))

    class Accelerator:
        def get_tracker(self, name, unwrap=False):
            assert name == "wandb" and unwrap
            return Run()

    assert log_eval_media(Accelerator(), "wandb", tmp_path, 7) == [IMAGE_TAG, VIDEO_TAG]
    assert logged == [({IMAGE_TAG: ("image", str(files[0])),
                        VIDEO_TAG: ("video", str(files[1]), "gif")}, 7)]
    assert log_eval_media(Accelerator(), "wandb", tmp_path, 8) == []   # no files for 8


# ------------------------------------------------------------------------ commands

@needs_toy
def test_eval_command_scores_held_out_metrics_like_the_trainer(tmp_path, capsys):
    from flowgrpo.cli import main

    overrides = [f"model.path={ROOT / 'assets' / 'toy'}", "prompts.eval_per_family=1",
                 "sampling.eval_num_steps=4", "run.num_threads=1"]
    out = tmp_path / "eval.json"
    assert main(["eval", str(CONFIG), *overrides, "--eval-rewards",
                 "[{name: geneval_toy, label: partial, score: partial}]", "--out", str(out),
                 "--quiet"]) == 0
    result = json.loads(out.read_text())
    assert result["held_out"] == sorted(k for k in result["rewards"]
                                        if k.startswith(("toy_artifacts", "partial")))
    assert "toy_artifacts" in result["lower_is_better"]
    assert "partial" not in result["lower_is_better"]
    table = capsys.readouterr().out
    assert "toy_artifacts [held-out, lower is better]" in table
    metrics = Trainer(load_config(CONFIG, [*overrides, f"run.output_dir={tmp_path}"])).evaluate(
        0, save_images=False)
    for key in ("toy_artifacts", "geneval_toy"):
        assert result["rewards"][key]["mean"] == pytest.approx(metrics[f"eval/{key}"], abs=1e-6)
    assert main(["eval", str(CONFIG), *overrides, "--eval-rewards", "geneval_toy",
                 "--out", str(out), "--quiet"]) == 2
    assert "label: geneval_toy_heldout" in capsys.readouterr().err


@needs_toy
def test_grid_labels_show_held_out_metrics(tmp_path):
    from flowgrpo.cli import main
    from flowgrpo.grids import cell_caption

    out = tmp_path / "grid.png"
    assert main(["grid", "--model", f"toy:{ROOT / 'assets' / 'toy'}", "--checkpoints", "base",
                 "--prompts", "a red circle", "--steps", "4", "--rewards", "geneval_toy",
                 "--eval-rewards", "toy_artifacts", "--out", str(out), "--quiet"]) == 0
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["held_out"] == ["toy_artifacts"]
    assert set(summary["rewards"]["base"]) >= {"geneval_toy", "toy_artifacts"}
    scores = {"a": torch.tensor([0.5]), "b": torch.tensor([0.25]), "total": torch.tensor([0.5]),
              "held": torch.tensor([0.125])}
    assert cell_caption(scores, {"a": 1.0}, 0, extra=["held"]) == "0.500 a\n0.125 held"
    assert cell_caption(scores, {"a": 1.0, "b": 0.0}, 0, extra=["held"], max_lines=5) == \
        "0.500 total\n0.500 a\n0.250 b\n0.125 held"
