"""The methods benchmark's calibration (``benchmarks/methods.py --calibrate``): CPU seconds per
iteration of each method and the run.max_iterations that fit the budget, and the config edits
that ``--write-configs`` makes (here and after ``--tune``)."""
from __future__ import annotations

import gc
import math
import re
import time
from pathlib import Path
from typing import Callable, Sequence

from benchmarks.methods_registry import TABLE_EVAL_SEED, Method
from benchmarks.methods_runs import (PhaseClock, RunSpec, evaluation, load_average,
                                     merge_methods_json, torch_threads)
from benchmarks.methods_stats import mean_of


def calibrate(methods: list[Method], budget: float, iterations: int, out: Path,
              extra: Sequence[str] = (), log: Callable[[str], None] = print) -> dict:
    """CPU seconds per iteration of each method and the run.max_iterations that fit ``budget``.

    One warm-up iteration (index 0, not counted), then ``iterations`` iterations at indices
    spread over the config's current run.max_iterations, so that plans that change over a run
    (MixGRPO's window, whose ODE prefix is computed once per group when the initial noise is
    shared) are sampled along it. Learning does not happen in between, so costs that change with
    the policy (fewer replay batches as more groups have no reward variance) are those of the
    start. The first method's untrained model is evaluated once, for the evaluation's cost.
    """
    from flowgrpo.trainer import Trainer

    results: dict[str, dict] = {}
    evaluation_cost = None
    for method in methods:
        spec = RunSpec(method.name, 0, f"calibrate_{method.name}", budget, budget,
                       TABLE_EVAL_SEED, tuple(extra))
        config = spec.load(out)
        trainer = Trainer(config)
        if evaluation_cost is None:
            measured = evaluation(trainer, 0)
            evaluation_cost = {"cpu_seconds": measured["eval_cpu_seconds"],
                               "wall_seconds": measured["eval_wall_seconds"],
                               "samples": measured["samples"]}
            log(f"one evaluation ({measured['samples']} samples): "
                f"{measured['eval_cpu_seconds']:.1f} cpu-s")
        phases = PhaseClock(trainer)
        total = config.run.max_iterations
        # a warm-up at 0, then the midpoints of `iterations` equal stretches of the run
        indices = [0] + [((2 * k + 1) * total) // (2 * iterations) for k in range(iterations)]
        rows = []
        for position, index in enumerate(indices):
            began = time.process_time()
            metrics = trainer.run_iteration(index)
            rows.append({**phases.take(), "cpu/iteration": time.process_time() - began,
                         "nfe": metrics.get("nfe"),
                         "trained_transitions": metrics.get("trained_transitions"),
                         "index": index, "warm_up": position == 0})
        counted = [r for r in rows if not r["warm_up"]] or rows
        mean = {k: mean_of([r.get(k) for r in counted]) for k in
                ("cpu/iteration", "cpu/rollout", "cpu/advantages", "cpu/update", "nfe",
                 "trained_transitions")}
        fit = max(1, int(budget // mean["cpu/iteration"]))
        entry = {"cpu_seconds_per_iteration": mean["cpu/iteration"],
                 "rollout": mean["cpu/rollout"], "advantages": mean["cpu/advantages"],
                 "update": mean["cpu/update"], "nfe_per_sample": mean["nfe"],
                 "trained_transitions": mean["trained_transitions"],
                 "max_iterations_for_budget": fit, "config_max_iterations": total,
                 "iterations": rows, "calibrated": method.calibrated,
                 "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_average": load_average()}
        if method.window_visits:
            entry["shift_interval"] = max(1, round(fit / method.window_visits))
        results[method.name] = entry
        log(f"{method.name:20s} {mean['cpu/iteration']:6.2f} cpu-s/it (rollout "
            f"{mean['cpu/rollout']:.2f}, update {mean['cpu/update']:.2f}), NFE/sample "
            f"{mean['nfe']:.1f}, trained/it {mean['trained_transitions']:.0f}: "
            f"max_iterations {fit} for {budget:g} s"
            + ("" if method.calibrated else " (not written: keeps the default's schedule)"))
        del trainer
        gc.collect()
    data = {"measured": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "budget": budget,
            "iterations_per_method": iterations,
            "torch_threads": torch_threads(), "evaluation": evaluation_cost, "methods": results}
    return merge_methods_json(out / "calibration.json", data, same="budget")


# A config's run.max_iterations is this much above the calibrated fit, so that a run of the table
# stops at the CPU budget, not at its cap: iterations get cheaper during a run (fewer groups keep
# reward variance, so fewer replay batches) and from day to day, and a run stopped by its cap
# before the budget compares iterations, not CPU time. Runs that still stop early are marked in
# the table ("k cap").
CAP_MARGIN = 1.25


def calibrated_values(method: Method, entry: dict) -> dict[str, str]:
    """The config values of one calibrated method: the cap (CAP_MARGIN x the iterations that
    fit the budget, rounded up), evaluations and checkpoints every quarter of it, and for the
    MixGRPO windows the shift interval that makes the window visit its positions within it."""
    cap = math.ceil(CAP_MARGIN * entry["max_iterations_for_budget"])
    values = {"run.max_iterations": str(cap), "run.eval_every": str(max(cap // 4, 1)),
              "run.checkpoint_every": str(max(cap // 4, 1))}
    if method.window_visits:
        values["sampling.plan.shift_interval"] = str(entry["shift_interval"])
    return values


# ----------------------------------------------------------------------------- config edits


def set_yaml_scalar(text: str, dotted: str, value: str) -> str:
    """``text`` with the block-style YAML scalar at ``dotted`` (e.g. ``training.lr``,
    ``sampling.plan.shift_interval``) set to ``value``, keeping every other line and the
    line's comment. Raises ValueError when the key is not found exactly once as a block
    entry (a flow mapping such as ``plan: {...}`` is not edited)."""
    parts = dotted.split(".")
    lines = text.split("\n")
    start, end = 0, len(lines)
    for depth, part in enumerate(parts):
        indent = " " * (2 * depth)
        pattern = re.compile(rf"^{indent}{re.escape(part)}:(\s|$)")
        found = [i for i in range(start, end) if pattern.match(lines[i])]
        if len(found) != 1:
            raise ValueError(f"{dotted}: found {len(found)} block entries '{part}:' at indent "
                             f"{len(indent)}; edit the file by hand")
        index = found[0]
        if depth == len(parts) - 1:
            match = re.match(rf"^({indent}{re.escape(part)}:\s*)(\S[^#]*?)?(\s*#.*)?$",
                             lines[index])
            if match is None or match.group(2) is None or match.group(2).startswith("{"):
                raise ValueError(f"{dotted} is not a scalar on its line: {lines[index]!r}")
            lines[index] = f"{match.group(1)}{value}{match.group(3) or ''}"
            return "\n".join(lines)
        start = index + 1
        end = next((i for i in range(start, len(lines)) if lines[i].strip()
                    and not lines[i].startswith(" " * (2 * depth + 2))
                    and not lines[i].lstrip().startswith("#")), len(lines))
    raise AssertionError("unreachable")


def yaml_number(value: float) -> str:
    """A float as the configs write it (2.0e-4, 0.7)."""
    if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e4):
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:g}" if value != int(value) else f"{value:.1f}"


def tuned_values(method: Method, lr: float, noise_level: float) -> dict[str, str]:
    """The config values a tuning's chosen point sets: its lr, and its noise level only where
    that changes what the config runs. The sample-based algorithms' configs roll out by the ODE
    and leave ``sampling.noise_level`` at its default, so a tuning at that default writes no
    noise line into them (there is none to edit)."""
    import yaml

    from flowgrpo.config import load_config

    values = {"training.lr": yaml_number(lr)}
    config = load_config(None, data=yaml.safe_load(method.path.read_text()))
    if noise_level != config.sampling.noise_level:
        values["sampling.noise_level"] = yaml_number(noise_level)
    return values


def write_config_values(method: Method, values: dict[str, str]) -> Path:
    """Set ``values`` (dotted key -> YAML text) in the method's config file and check that it
    still loads and holds them."""
    import yaml

    from flowgrpo.config import load_config

    if not method.editable:
        raise ValueError(f"{method.config} is not edited by this script (the embedded default)")
    text = method.path.read_text()
    for dotted, value in values.items():
        text = set_yaml_scalar(text, dotted, value)
    data = yaml.safe_load(text)
    for dotted, value in values.items():
        node = data
        for part in dotted.split("."):
            node = node[part]
        if node != yaml.safe_load(value):
            raise ValueError(f"{method.config}: {dotted} reads {node!r} after the edit, not "
                             f"{value}")
    load_config(None, data=data)       # still a valid config
    method.path.write_text(text)
    return method.path
