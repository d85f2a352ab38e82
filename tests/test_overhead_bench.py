"""benchmarks/overhead.py: its clocks attach to every model call and its split adds up."""
from __future__ import annotations

import argparse
import time

import pytest
import torch



BENCHMARK = "overhead"   # benchmarks/<BENCHMARK>.py, the `bench` fixture (conftest.py)


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
    # per trained batch: score_step and policy_loss, and the maths' backward (timed apart from
    # the transformer's, from an identity on the loss); the engine's own time once per pass
    assert clock.calls[("update", "maths")] == 2 * trained_batches
    assert clock.calls[("update", "maths_backward")] == trained_batches
    assert clock.calls[("update", "engine")] == trained_batches
    assert 0 < clock.total("update") < wall["update"]
    assert 0 < clock.total() < wall["total"]
    assert clock.total(None, ("maths",)) > 0
    assert set(result["plain_wall"]) == set(wall)
    # one ratio per phase and measured iteration: the plain trainer's wall over the model time
    assert {phase: len(values) for phase, values in result["ratios"].items()} == \
        {"rollout": 1, "reward": 1, "update": 1, "total": 1}
    for phase in ("update", "total"):
        which = None if phase == "total" else phase
        assert result["ratios"][phase][0] == pytest.approx(
            result["plain_wall"][phase] / clock.total(which), rel=1e-9)


@pytest.mark.slow   # op counts depend on the torch build: a guard for benchmark work, not CI
def test_op_census_counts_our_ops_apart_from_the_transformers(bench, tiny_sd3_path, tmp_path):
    """A regression guard on the loop's own cost, in units that do not depend on machine load:
    at CPU sizes each op costs a few microseconds whatever its size, so the ops our code issues
    per replay batch set the overhead's floor. Measured with torch 2.14.1: 63 forward ops and 3
    backward nodes of ours against 360 and 358 of the transformer, full plan (65 and 4 before
    the loss's division became backward()'s seed); accelerator.backward adds its division by
    its accumulation count (1 here): one op and one node."""
    from flowgrpo.trainer import Trainer

    args = argparse.Namespace(size=32, steps=10, group_size=4, prompts=2, threads=1, iterations=1)
    trainer = Trainer(bench.make_config("sd3", tiny_sd3_path, bench.PLANS["full"], args, tmp_path))
    trainer.run_iteration(0)
    counts = bench.op_census(trainer, 1)
    assert counts["model_forward"] > 200 and counts["model_backward"] > 200   # scope attached
    assert 0 < counts["ours_forward"] <= 67, counts
    assert 0 < counts["ours_backward"] <= 4, counts
    ours = counts["ours_forward"] + counts["ours_backward"]
    assert ours / (counts["model_forward"] + counts["model_backward"]) < 0.10


def test_backward_passes_split_into_engine_model_and_maths(bench, tiny_sd3_path, tmp_path):
    """Each backward() call is partitioned without gaps or overlaps: the engine's own time (start
    and end, charged to the model, see ``_timed_tensor_backward``), our maths' nodes, then the
    transformer's. The parts add up to the call's wall time measured outside, less only the
    wrappers' few microseconds; the engine part alone is about 0.15 ms a call here, so leaving it
    out (or counting the whole call twice) fails."""
    args = argparse.Namespace(size=32, steps=4, group_size=2, prompts=2, threads=1, iterations=1)
    clock = bench.ModelClock()
    trainer = bench.TimedTrainer(bench.make_config("sd3", tiny_sd3_path, bench.PLANS["full"], args,
                                                   tmp_path), clock)
    trainer.run_iteration(0)
    batch, rewards, _ = trainer.rollout_and_score(1)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    walls: list[float] = []
    with bench.timed_functions(clock, torch.device("cpu")):
        timed = torch.Tensor.backward

        def outer(tensor, *call_args, **kwargs):
            began = time.perf_counter()
            try:
                return timed(tensor, *call_args, **kwargs)
            finally:
                walls.append(time.perf_counter() - began)

        torch.Tensor.backward = outer
        try:
            clock.reset()
            trainer.update(batch, advantages, 1)
        finally:
            torch.Tensor.backward = timed
    passes = len(batch.replay)
    assert len(walls) == passes
    for kind in ("engine", "maths_backward", "backward"):
        assert clock.calls[("update", kind)] == passes, kind
    assert clock.seconds[("update", "engine")] > 0
    parts = sum(clock.seconds[("update", kind)] for kind in ("engine", "maths_backward", "backward"))
    assert sum(walls) - passes * 40e-6 <= parts <= sum(walls)


def test_printed_ratio_is_the_median_of_the_iterations(bench, capsys):
    """One iteration that a hiccup hit (5.0) moves neither the printed ratio nor the flag; the
    summed columns keep the hiccup (wall 7.0 s over 3.0 s of model time)."""
    clock = bench.ModelClock()
    for _ in range(3):
        clock.add("forward", 1.0, "update")
    walls = {"rollout": 0.0, "reward": 0.0, "update": 7.0, "total": 7.0}
    result = {"clock": clock, "wall": walls, "plain_wall": walls, "nfe": 1, "trained": 1,
              "ratios": {"update": [1.0, 1.05, 5.0], "total": [1.0, 1.05, 5.0]}}
    bench.print_table([("sd3", "full", result)], target=1.10)
    update = next(line for line in capsys.readouterr().out.splitlines() if " update " in line)
    assert update.split()[3:7] == ["7000.0", "3000.0", "0.0", "1.050"]
    assert "above target" not in update
