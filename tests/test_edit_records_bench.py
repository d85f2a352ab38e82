"""benchmarks/edit_records.py: an editing probe's record keeps the evaluation rows unrounded and
nothing else of them, counts the iterations trained, and refuses a run that is not an editing run."""
from __future__ import annotations

import json

import pytest

BENCHMARK = "edit_records"
EXACT = "eval/toy_edit.exact/family_mean"


def _rows() -> list[dict]:
    return [{"iteration": 0, EXACT: 0.2734375, "eval/toy_edit.kept/family_mean": 0.84},
            {"iteration": 1, "train/loss": 0.1, "time/iteration": 10.25},
            {"iteration": 2, "train/loss": 0.2, "time/iteration": 9.75},
            {"iteration": 2, EXACT: 0.4947917, "eval/toy_edit.kept/family_mean": 0.86,
             "train/loss": 0.2}]


def test_record_keeps_eval_rows_unrounded_and_counts_iterations(bench, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    record = bench.edit_record(bench.read_rows(run), 2, "2026-12-05 08:00 UTC", "toy_edit")
    assert record["iterations"] == 2 and record["training_wall_seconds"] == 20.0
    assert [e["iteration"] for e in record["evals"]] == [0, 2]
    assert record["evals"][1] == {"iteration": 2, EXACT: 0.4947917,
                                  "eval/toy_edit.kept/family_mean": 0.86}
    assert record["seed"] == 2 and record["started"] == "2026-12-05 08:00 UTC"


def test_a_run_without_edit_metrics_or_metrics_file_is_refused(bench, tmp_path):
    with pytest.raises(SystemExit, match="not an editing-toy run"):
        bench.edit_record([{"iteration": 0, "eval/geneval_toy": 0.3}], 0, "x", "y")
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        bench.read_rows(tmp_path)
