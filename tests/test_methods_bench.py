"""benchmarks/methods.py: method definitions, table and plot on synthetic records (no training)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.plans import make_plan
from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("methods")


def _settings(bench, tmp_path):
    return bench.BenchSettings(model="assets/toy", out=tmp_path, budget=60.0, eval_interval=15.0)


def _record(label, evals, seconds_per_it, nfe, trained, phases=(1.0, 0.5, 2.0)):
    iterations = [{"iteration": i + 1, "seconds": seconds_per_it * (i + 1), "nfe": nfe,
                   "trained_transitions": trained, "time/rollout": phases[0],
                   "time/reward_wait": phases[1], "time/update": phases[2]} for i in range(4)]
    return {"label": label, "iterations": iterations,
            "evals": [{"iteration": 0, "seconds": 0.0, "accuracy": 0.20}] +
                     [{"iteration": it, "seconds": s, "accuracy": a} for it, s, a in evals]}


@pytest.fixture()
def records():
    return {"settings": {"clock": "cpu"}, "base": {"accuracy": 0.20}, "methods": {
        "fast": _record("Fast", [(2, 20.0, 0.24), (4, 40.0, 0.26)], 10.0, 7, 128),
        "slow": _record("Slow", [(2, 30.0, 0.21), (4, 60.0, 0.22)], 15.0, 10, 576,
                        phases=(3.0, 0.0, 12.0)),
    }}


def _plan(config, iteration=0, group=0):
    sigmas = torch.linspace(1, 0, config.sampling.num_steps + 1)
    return make_plan(config.sampling.plan, sigmas, iteration, group, config.run.seed)


@pytest.mark.parametrize("num_steps", [10, 16])
def test_every_method_builds_a_valid_config_with_its_plan(bench, tmp_path, num_steps):
    settings = _settings(bench, tmp_path)
    n = num_steps
    expected_trained = {"flow_grpo": n - 1, "dance_grpo": int(n * 0.6), "mix_grpo": 3,
                        "mix_grpo_flash": 3, "flow_grpo_fast": 2, "flash_grpo": 1,
                        "flow_grpo_guard": n - 1}
    assert set(bench.METHODS) == set(expected_trained)
    for name, method in bench.METHODS.items():
        config = load_config(ROOT / bench.BASE_CONFIG,
                             settings.overrides(method) + [f"sampling.num_steps={n}"])
        plan = _plan(config)
        assert len(plan.trained) == expected_trained[name], name
        # Shared settings are the same for every method; only the method's own fields differ.
        assert (config.run.seed, config.run.num_threads, config.model.path) == (0, 1, "assets/toy")
        guard = name == "flow_grpo_guard"
        assert config.training.ratio_norm == config.training.dt_reweight == guard
        assert config.training.rectification == (name == "flash_grpo")
        assert config.sampling.kind == ("dance_sde" if name == "dance_grpo" else "flow_sde")
        assert config.sampling.noise_level == (0.3 if name == "dance_grpo" else 0.7)


def test_set_overrides_apply_to_every_method_after_its_own(bench, tmp_path):
    settings = bench.BenchSettings(model="m", out=tmp_path, budget=1.0, eval_interval=1.0,
                                   extra_overrides=("sampling.noise_level=0.4", "training.lr=1e-5"),
                                   base_data={"name": "x", "sampling": {"num_steps": 10},
                                              "training": {"lr": 3e-5}, "rewards": {
                                                  "components": [{"name": "geneval_toy"}]}})
    snapshot = copy.deepcopy(settings.base_data)
    for method in bench.METHODS.values():
        config = settings.load(method)   # built from base_data, not from the file
        assert (config.sampling.noise_level, config.training.lr) == (0.4, 1e-5)
        assert config.name == method.name
    # One method's overrides never leak into the next one's config.
    assert settings.base_data == snapshot
    assert not settings.load(bench.METHODS["flow_grpo_guard"]).training.rectification


def test_method_plans_have_their_papers_structure(bench, tmp_path):
    settings = _settings(bench, tmp_path)

    def config(name):
        return load_config(ROOT / bench.BASE_CONFIG, settings.overrides(bench.METHODS[name]) +
                           ["sampling.num_steps=10"])

    # DanceGRPO: a different random subset per group.
    dance = config("dance_grpo")
    assert len({_plan(dance, 0, g).trained for g in range(8)}) > 1
    # MixGRPO-Flash: DPM-Solver++ on a compressed tail -> fewer visited steps than MixGRPO.
    mix, flash_mix = _plan(config("mix_grpo")), _plan(config("mix_grpo_flash"))
    assert mix.num_steps == 10 and flash_mix.num_steps == 3 + max(int(7 * 0.4), 1)
    assert flash_mix.solver_after == "dpmpp_2m"
    # MixGRPO's window is the same for every group and moves every shift_interval iterations.
    mix_config = config("mix_grpo")
    assert _plan(mix_config, 0, 0).trained == _plan(mix_config, 0, 5).trained == (0, 1, 2)
    assert _plan(mix_config, 3, 0).trained == (0, 1, 2)
    assert _plan(mix_config, 4, 0).trained == (1, 2, 3)
    # Fast and Flash-GRPO draw their steps in the first half of the trajectory, per group
    # (Flash: one step, the same for the whole group: iso-temporal).
    for name, size in (("flow_grpo_fast", 2), ("flash_grpo", 1)):
        cfg = config(name)
        steps = {_plan(cfg, it, g).trained for it in range(4) for g in range(8)}
        assert all(len(s) == size and 0 <= s[0] < 5 for s in steps) and len(steps) > 1, name


def test_summary_values_from_synthetic_records(bench, records):
    rows, base, target = bench.summarize(records, target_delta=0.05)
    assert base == 0.20 and target == pytest.approx(0.25)
    fast, slow = rows
    assert fast.method == "Fast" and fast.accuracy == 0.26 and fast.gain == pytest.approx(0.06)
    assert fast.seconds_to_target == 40.0          # 0.24 at 20 s is short of 0.25
    assert slow.seconds_to_target is None
    assert fast.iterations == 4 and fast.trained_seconds == 40.0
    assert fast.seconds_per_iteration == 10.0 and slow.seconds_per_iteration == 15.0
    assert (slow.nfe, slow.trained_transitions) == (10, 576)
    assert (slow.rollout, slow.reward, slow.update) == (3.0, 0.0, 12.0)
    # An exact hit counts as reaching the target.
    rows, _, _ = bench.summarize(records, target_delta=0.04)
    assert rows[0].seconds_to_target == 20.0


def test_table_marks_unreached_targets_and_has_one_line_per_method(bench, records):
    rows, base, target = bench.summarize(records, target_delta=0.05)
    table = bench.format_table(rows, base, target)
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(lines) == 3                        # header + two methods
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    slow = dict(zip(header, [c.strip() for c in lines[2].strip("|").split("|")]))
    assert slow["method"] == "Slow" and slow["s to target"] == "-" and slow["acc@budget"] == "0.220"
    assert slow["trained/it"] == "576" and slow["update"] == "12.0"


def test_plot_writes_a_png(bench, records, tmp_path):
    path = bench.plot_accuracy(records, tmp_path / "plot.png", target=0.25)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_accuracy_label_says_when_the_evaluation_is_on_trained_prompts(bench):
    def records_with(train, evaluation):
        config = {"prompts": {"train": train, "eval": evaluation}}
        return {"methods": {"a": {"config": config}, "b": {"config": config}}}

    assert bench.accuracy_label(records_with("toy:train", "toy:heldout")).startswith("held-out")
    assert "trained prompts" in bench.accuracy_label(records_with("one.jsonl", "one.jsonl"))


def test_bad_arguments_name_the_fix(bench, tmp_path):
    with pytest.raises(ValueError, match="unknown method nope"):
        bench.parse_methods("flow_grpo,nope")
    with pytest.raises(ValueError, match="clock must be one of"):
        bench.BenchSettings(model="m", out=tmp_path, budget=1.0, eval_interval=1.0, clock="gpu")
    with pytest.raises(ValueError, match="budget must be > 0"):
        bench.BenchSettings(model="m", out=tmp_path, budget=0.0, eval_interval=1.0)
    rows, _, _ = bench.summarize({"base": {"accuracy": 0.1}, "methods": {}}, 0.05)
    assert rows == []
