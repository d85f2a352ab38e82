"""benchmarks/default_runs.py: the README's figures for the default come from its run records,
unrounded (median and range of the final accuracy, the gain in points over each seed's own base,
the artifact ratio), and the command it records is the shipped one."""
from __future__ import annotations

import pytest

BENCHMARK = "default_runs"


def _record(seed: int, base: float, final: float, artifacts=(0.01, 0.02)) -> dict:
    return {"seed": seed, "started": f"2026-12-0{seed + 1} 10:00 UTC", "cpu_seconds": 100.0,
            "load_average_before": [0.5, 0, 0], "load_average_after": [1.0, 0, 0],
            "base": {"accuracy": base, "accuracy_se": 0.02, "artifacts": artifacts[0]},
            "final": {"accuracy": final, "accuracy_se": 0.02, "artifacts": artifacts[1]}}


def test_summary_is_the_median_and_range_of_unrounded_values(bench):
    records = [_record(0, 0.340, 0.5659722), _record(1, 0.3125, 0.6013889, (0.01, 0.015)),
               _record(2, 0.2847222, 0.5815972, (0.01, 0.011))]
    s = bench.summary(records)
    assert s["final_median"] == pytest.approx(0.5815972)
    assert s["final_range"] == pytest.approx((0.5659722, 0.6013889))
    gains = sorted([22.59722, 28.88889, 29.6875])   # (final - base) * 100, per seed
    assert s["gain_median"] == pytest.approx(gains[1], abs=1e-4)
    assert s["gain_range"] == pytest.approx((gains[0], gains[2]), abs=1e-4)
    assert s["artifacts_ratio_range"] == pytest.approx((1.1, 2.0))
    assert s["dates"] == ["2026-12-01", "2026-12-02", "2026-12-03"]
    table = bench.report(records)
    assert "gain median +28.9 (range +22.6 to +29.7)" in table


def test_the_recorded_command_is_the_shipped_config_with_a_seed(bench, tmp_path):
    cmd = bench.command(3, tmp_path)
    assert cmd[1:5] == ["-m", "flowgrpo", "train", bench.CONFIG]
    # the embedded default is what the quickstart trains
    quickstart = (bench.ROOT / "scripts" / "quickstart.sh").read_text()
    assert bench.CONFIG in quickstart
    assert "run.seed=3" in cmd and f"run.output_dir={tmp_path}" in cmd
    assert f"name={bench.Path(bench.CONFIG).stem}_s3" in cmd
    # each config's records in their own folder
    assert bench.records_dir("configs/toy_geneval.yaml") == bench.RESULTS / "toy_geneval"
    # nothing else of the config changes: threads, iterations and evaluation stay as shipped
    assert not [a for a in cmd if a.startswith(("run.num_threads", "run.max_iterations",
                                                 "training.", "sampling.", "prompts."))]
