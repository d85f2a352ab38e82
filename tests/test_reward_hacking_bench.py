"""benchmarks/reward_hacking.py: every guard is a valid config, and the report's arithmetic
(where the proxy stops tracking gold, the proxy under each reward layout, the delivered
checkpoint's gold) on synthetic evaluation records."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


BENCHMARK = "reward_hacking"   # benchmarks/<BENCHMARK>.py, the `bench` fixture (conftest.py)


def _row(bench, iteration, gold, proxy, se=0.02, key=None):
    return {"phase": "eval", "iteration": iteration, bench.GOLD: gold, bench.GOLD + "/se": se,
            key or bench.PROXY: proxy, bench.ARTIFACTS: 0.01}


@pytest.mark.parametrize("name", ["none", "kl_strong", "gardo", "ensemble_penalty", "saturation",
                                  "anchor", "select_best"])
def test_every_guard_loads_as_a_valid_config(bench, name):
    from flowgrpo.config import load_config

    config = load_config(ROOT / bench.CONFIG, list(bench.GUARDS[name].overrides))
    names = [c.name for c in config.rewards.components]
    assert set(names) <= {"toy_proxy", "ensemble"}
    assert [r.name for r in config.eval.rewards] == ["geneval_toy", "toy_artifacts"]
    if name == "anchor":
        assert config.training.anchor_beta == 1.0 and config.training.anchor_sigma_max == 0.45
    if name == "select_best":
        assert config.run.select_best_on == bench.GOLD
    if name == "saturation":
        assert len(names) == bench.MEMBERS and config.rewards.saturation_ratio == 0.5


def test_divergence_is_the_first_evaluation_after_golds_best_with_proxy_up_and_gold_down(bench):
    evals = [_row(bench, 0, 0.30, 0.30), _row(bench, 5, 0.40, 0.35),
             _row(bench, 10, 0.39, 0.50),      # gold within one se of its best: still tracking
             _row(bench, 15, 0.30, 0.34),      # gold down, but the proxy is down too
             _row(bench, 20, 0.30, 0.60)]      # proxy above its value at gold's best, gold down
    assert bench.divergence(evals) == 20
    assert bench.divergence(evals[:4]) is None
    assert bench.divergence([]) is None


def test_proxy_is_read_under_every_reward_layout(bench):
    assert bench.proxy_of({bench.PROXY: 0.4}) == 0.4
    assert bench.proxy_of({"eval/ensemble.mean/family_mean": 0.5}) == 0.5
    assert bench.proxy_of({"eval/m0.mean/family_mean": 0.6}) == 0.6
    assert math.isnan(bench.proxy_of({}))


def test_delivered_gold_is_the_best_checkpoints_when_one_was_selected(bench, tmp_path):
    last = _row(bench, 30, 0.01, 0.7)
    assert bench.delivered_gold(tmp_path, last) == 0.01
    (tmp_path / "checkpoints").mkdir()
    record = {"key": bench.GOLD, "mode": "max", "value": 0.243, "iteration": 0, "since": 0}
    (tmp_path / "checkpoints" / "best.json").write_text(json.dumps(record))
    assert bench.delivered_gold(tmp_path, last) == 0.243
    record["key"] = "eval/other/family_mean"       # selected on another metric: not gold's best
    (tmp_path / "checkpoints" / "best.json").write_text(json.dumps(record))
    assert bench.delivered_gold(tmp_path, last) == 0.01


def test_summary_reports_gold_at_the_proxys_peak(bench, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [_row(bench, 0, 0.24, 0.31), _row(bench, 5, 0.28, 0.40), _row(bench, 10, 0.10, 0.70),
            _row(bench, 15, 0.05, 0.65)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = bench.summarize(bench.GUARDS["none"], run, 15)
    assert summary["finished"] and summary["gold_best"] == 0.28
    assert summary["gold_best_iteration"] == 5
    assert (summary["proxy_peak_iteration"], summary["gold_at_proxy_peak"]) == (10, 0.10)
    assert summary["diverges_at"] == 10 and summary["gold_delivered"] == 0.05
