"""benchmarks/overhead.py: its clocks attach to every model call and its split adds up."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    path = ROOT / "benchmarks" / "overhead.py"
    spec = importlib.util.spec_from_file_location("overhead_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.mark.parametrize("plan", ["full", "window"])
def test_model_clock_sees_every_transformer_call_and_no_more(bench, tiny_sd3_path, tmp_path, plan):
    """Rollout forwards = steps x replay chunks; update forwards = backwards = trained replay
    batches (the backward clock hangs on the transformer's output, so each backward pass is
    timed once, and only from the transformer on); model time < the instrumented wall."""
    args = argparse.Namespace(size=32, steps=4, group_size=2, prompts=2, threads=1, iterations=1)
    result = bench.measure("sd3", tiny_sd3_path, plan, args, tmp_path)
    clock, wall = result["clock"], result["wall"]
    chunks = 2                           # 2 prompts x 2 samples, 2 rows per transformer call
    trained_batches = result["trained"] // args.group_size
    assert clock.calls[("rollout", "forward")] == chunks * args.steps
    assert clock.calls[("update", "forward")] == trained_batches
    assert clock.calls[("update", "backward")] == trained_batches
    # per trained batch: score_step, policy_loss and the maths' backward (timed apart from the
    # transformer's, from an identity on the loss)
    assert clock.calls[("update", "maths")] == 3 * trained_batches
    assert 0 < clock.total("update") < wall["update"]
    assert 0 < clock.total() < wall["total"]
    assert clock.total(None, ("maths",)) > 0
    assert set(result["plain_wall"]) == set(wall)
