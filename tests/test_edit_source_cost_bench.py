"""benchmarks/edit_source_cost.py: the two arms differ only in the source term, and a config
without one is refused before any model loads."""
from __future__ import annotations

import json
import math

import pytest

from flowgrpo.config import ConfigError
from tests.helpers import ROOT

# configs/toy_edit.yaml on the tiny editing model, small enough for a test.
TINY = ["sampling.num_steps=6", "sampling.eval_num_steps=6", "sampling.rollout_batch_size=4",
        "sampling.plan.branch_range=[0,1]", "training.prompts_per_iteration=2",
        "training.group_size=2", "training.gradient_accumulation_steps=1",
        "training.skip_zero_std_groups=false"]


BENCHMARK = "edit_source_cost"   # benchmarks/<BENCHMARK>.py, the `bench` fixture (conftest.py)


def test_source_arm_trains_the_source_term_and_plain_arm_does_not(bench, edit_dir, tmp_path):
    out = tmp_path / "results"
    result = bench.main(["--config", str(ROOT / "configs" / "toy_edit.yaml"), "--iterations", "3",
                         "--threads", "1", "--out", str(out), f"model.path={edit_dir}", *TINY])
    source, plain = result["iterations"]["source"], result["iterations"]["plain"]
    assert len(source) == len(plain) == 3
    assert all(math.isfinite(r["keep_source"]) and r["keep_source"] > 0 for r in source)
    assert all(r["keep_source"] is None for r in plain)
    assert all(r["batches"] > 0 and r["wall"] >= r["update"] > 0 for r in source + plain)
    # The median ratios are those of the recorded iterations.
    walls = sorted(s["wall"] / p["wall"] for s, p in zip(source, plain))
    assert result["ratio_wall"] == pytest.approx(walls[1], abs=1e-3)
    saved = json.loads((out / "toy_edit.json").read_text())
    assert saved["ratio_update"] == result["ratio_update"] and saved["threads"] == 1


def test_config_without_source_term_is_refused_before_loading(bench, tmp_path):
    with pytest.raises(ConfigError, match="keep_source_beta is 0"):
        bench.build_trainers(str(ROOT / "configs" / "toy_edit.yaml"),
                             ["model.path=/nonexistent", "training.locality.keep_source_beta=0"],
                             tmp_path)
