"""benchmarks/cfg_gradient.py: the three arms run the same update, the activations they store
are what each way of handling CFG's unconditional branch stores, and the peak-memory measure
finds a known peak."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("cfg_gradient")


def test_detached_arm_stores_half_the_activations_of_flow_grpos_way(bench, tmp_path):
    # the profiler's peak takes seconds an arm: measured by the next test on a known case
    result = bench.main(["--repeats", "1", "--skip-peak", "--out", str(tmp_path)])
    assert result["replay_batches"] == 4 and result["rows_per_replay_batch"] == 8
    saved = result["saved_for_backward_bytes"]
    # Flow-GRPO's detach comes after the batched forward: it stores what 'both' stores
    assert saved["flow_grpo"] == saved["both"] > 0
    # ours keeps the conditional rows' activations only (plus a few per-row tensors)
    assert 0.45 < saved["detached"] / saved["flow_grpo"] < 0.55
    assert all(len(v) == 1 and v[0] > 0 for v in result["update_cpu_seconds"].values())
    assert result["peak_bytes"] == {arm: None for arm in bench.ARMS}
    written = json.loads((tmp_path / "sd3_2x16_32px.json").read_text())
    assert written["saved_ratio"] == result["saved_ratio"]
    assert written["command"] == \
        f"python benchmarks/cfg_gradient.py --repeats 1 --skip-peak --out {tmp_path}"


def test_peak_is_the_largest_live_allocation_of_the_call(bench):
    keep = torch.ones(1)   # allocated before: not counted

    def work() -> None:
        first = torch.empty(1 << 20, dtype=torch.uint8)     # 1 MiB
        second = torch.empty(2 << 20, dtype=torch.uint8)    # 2 MiB, both alive: 3 MiB
        del first, second
        torch.empty(2 << 20, dtype=torch.uint8)             # 2 MiB alone

    peak = bench.peak_update_bytes(work)
    assert 3 << 20 <= peak < (3 << 20) + (64 << 10)
    assert keep.item() == 1.0
