"""The methods benchmark's report (``benchmarks/methods.py --report``): each method's summary
over seeds, the table, the ranking, the gains at equal iterations and at another report's pace,
the plot, and the papers' claims against the measured ratios. Every gain is computed from the
run records' unrounded accuracies; only the text rounds."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from benchmarks.methods_registry import DEFAULT_OUT, METHODS, ROOT
from benchmarks.methods_runs import milestones, schedule_origin, write_json
from benchmarks.methods_stats import (gains_at_iteration, mean_of, median_seconds,
                                      seconds_to_target, t_interval)


TARGET_DELTA = 0.10            # "CPU seconds to +10 points"

# A ratio of two held-out gains is reported only when both reach one point: below that the
# ratio is evaluation noise (a baseline at +0.000 once gave a ratio of 2e7).
MIN_GAIN_FOR_RATIO = 0.01


def finished_records(out: Path) -> list[dict]:
    records = []
    for path in sorted((out / "runs").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if record.get("finished"):
            records.append(record)
    return records


def _value_at(record: dict, mark: float) -> float | None:
    for e in record["evals"]:
        if any(abs(m - mark) < 1e-6 for m in e.get("marks", [])):
            return e["accuracy"]
    return None


def summarize_method(records: list[dict], target_delta: float = TARGET_DELTA,
                     equal_iterations: int | None = None) -> dict:
    """One method's line of the report from its finished runs (one per seed). With
    ``equal_iterations``, also the gain after that many iterations (``value_at_iteration``), so
    that methods of different cost per iteration compare per update as well as per CPU second."""
    if not records:
        raise ValueError("summarize_method needs at least one finished run")
    signatures = {json.dumps({k: v for k, v in r["signature"].items() if k != "seed"},
                             sort_keys=True) for r in records}
    if len(signatures) > 1:
        raise ValueError(f"the runs of {records[0]['method']} were measured under different "
                         f"settings ({len(signatures)} signatures): report them from separate "
                         f"--out folders")
    records = sorted(records, key=lambda r: r["seed"])
    finals = [r["evals"][-1] for r in records]
    bases = [r["base"]["accuracy"] for r in records]
    accuracy = [f["accuracy"] for f in finals]
    gains = [a - b for a, b in zip(accuracy, bases)]
    to_target, to_target_first = [], []
    for record, base in zip(records, bases):
        points = [(e["cpu_seconds"], e["accuracy"]) for e in record["evals"]]
        interpolated, first = seconds_to_target(points, base + target_delta)
        to_target.append(interpolated)
        to_target_first.append(first)
    per_iteration: dict[str, list[float]] = {}
    for record in records:
        columns = record["iterations"]
        for key in ("cpu/iteration", "cpu/rollout", "cpu/advantages", "cpu/update", "nfe",
                    "trained_transitions", "train/optimizer_steps", "time/reward_wait"):
            value = mean_of(columns.get(key, []))
            if value is not None:
                per_iteration.setdefault(key, []).append(value)
    phases = {k: mean_of(v) for k, v in per_iteration.items()}
    if phases.get("cpu/iteration") is not None:
        known = sum(phases.get(k) or 0.0 for k in ("cpu/rollout", "cpu/advantages", "cpu/update"))
        phases["cpu/other"] = phases["cpu/iteration"] - known
    budget = records[0]["signature"]["budget"]
    interval = records[0]["signature"]["eval_interval"]
    marks = [0.0] + milestones(budget, interval)
    curve = {"cpu_seconds": marks, "mean": [], "min": [], "max": [], "n": []}
    for mark in marks:
        values = [v for v in (_value_at(r, mark) for r in records) if v is not None]
        curve["mean"].append(sum(values) / len(values) if values else None)
        curve["min"].append(min(values) if values else None)
        curve["max"].append(max(values) if values else None)
        curve["n"].append(len(values))
    artifacts = [f.get("artifacts") for f in finals]
    base_artifacts = [r["base"].get("artifacts") for r in records]
    at_iterations = None
    if equal_iterations is not None:
        gains_then = gains_at_iteration(records, equal_iterations)
        if any(v is None for v in gains_then):
            raise ValueError(f"equal_iterations={equal_iterations} is past the last evaluation "
                             f"of a run of {records[0]['method']}")
        at_iterations = {"iterations": equal_iterations, **t_interval(gains_then),
                         "per_seed": gains_then}
    return {
        "method": records[0]["method"], "label": records[0]["label"],
        "seeds": [r["seed"] for r in records], "budget": budget, "eval_interval": interval,
        "base": {"accuracy": mean_of(bases), "accuracy_se": records[0]["base"].get("accuracy_se"),
                 "per_seed": bases, "artifacts": mean_of(base_artifacts)},
        "accuracy": {**t_interval(accuracy), "per_seed": accuracy},
        "gain": {**t_interval(gains), "per_seed": gains},
        "seconds_to_target": {"target_delta": target_delta, "median": median_seconds(to_target),
                              "per_seed": to_target,
                              "reached": sum(v is not None for v in to_target),
                              "rule": "linear interpolation between the last evaluation below "
                                      "base + target_delta and the first at or above it; median "
                                      "over seeds with 'not reached' as longer than the budget",
                              "median_first_evaluation": median_seconds(to_target_first),
                              "per_seed_first_evaluation": to_target_first},
        "iterations": {"mean": mean_of([r["iterations_done"] for r in records]),
                       "per_seed": [r["iterations_done"] for r in records],
                       "stopped_by": [r["stopped_by"] for r in records],
                       "max_iterations": records[0]["max_iterations"]},
        "cpu_seconds_trained": [r["cpu_seconds"] for r in records],
        "per_iteration": {"cpu_seconds": phases.get("cpu/iteration"),
                          "rollout": phases.get("cpu/rollout"),
                          "advantages": phases.get("cpu/advantages"),
                          "update": phases.get("cpu/update"), "other": phases.get("cpu/other"),
                          "reward_wait_wall": phases.get("time/reward_wait"),
                          "nfe_per_sample": phases.get("nfe"),
                          "trained_transitions": phases.get("trained_transitions"),
                          "optimizer_steps": phases.get("train/optimizer_steps")},
        "artifacts": {"mean": mean_of(artifacts), "per_seed": artifacts,
                      "key": finals[0].get("artifacts_key")},
        "curve": curve,
        "gain_at_equal_iterations": at_iterations,
        "load_average": [r.get("load_average_start") for r in records],
    }


def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _interval_text(stats: dict, signed: bool = False) -> str:
    sign = "+" if signed else ""
    mean = format(stats["mean"], f"{sign}.3f")
    if stats["low"] is None:
        return f"{mean} (n=1)"
    return f"{mean} [{stats['low']:{sign}.3f}, {stats['high']:{sign}.3f}]"


TABLE_HEADER = ("| method | seeds | acc@budget [95% CI] | gain [95% CI] | CPU s to +10 (median) | "
                "iterations | NFE/sample | trained/it | opt steps/it | CPU s/it | rollout | "
                "update | other | artifacts@budget |")


def format_table(summaries: list[dict]) -> str:
    """The Markdown table of the report, one line per method."""
    columns = TABLE_HEADER.count("|") - 1
    lines = [TABLE_HEADER, "|" + "|".join(["---"] + ["---:"] * (columns - 1)) + "|"]
    for s in summaries:
        to_target = s["seconds_to_target"]
        n = len(s["seeds"])
        reached = ("not reached" if to_target["median"] is None
                   else f"{to_target['median']:.0f}") + f" ({to_target['reached']}/{n})"
        p = s["per_iteration"]
        capped = sum(by == "max_iterations" for by in s["iterations"]["stopped_by"])
        iterations = fmt(s["iterations"]["mean"], ".0f") + (f" ({capped} cap)" if capped else "")
        lines.append(
            f"| {s['label']} | {n} | {_interval_text(s['accuracy'])} | "
            f"{_interval_text(s['gain'], signed=True)} | {reached} | "
            f"{iterations} | {fmt(p['nfe_per_sample'], '.1f')} | "
            f"{fmt(p['trained_transitions'], '.0f')} | {fmt(p['optimizer_steps'], '.1f')} | "
            f"{fmt(p['cpu_seconds'], '.2f')} | {fmt(p['rollout'], '.2f')} | "
            f"{fmt(p['update'], '.2f')} | {fmt(p['other'], '.2f')} | "
            f"{fmt(s['artifacts']['mean'], '.4f')} |")
    return "\n".join(lines)


def format_equal_iterations(summaries: list[dict]) -> str:
    """The gain of every method after the same number of iterations (the fewest any run of the
    report did), beside its gain at the budget: what separates per update from what separates
    per CPU second."""
    iterations = summaries[0]["gain_at_equal_iterations"]["iterations"]
    lines = [f"Gain after {iterations} iterations (the fewest any run did; linear interpolation "
             f"between evaluations), against the gain at the budget and the CPU seconds an "
             f"iteration costs:", "",
             f"| method | gain after {iterations} iterations [95% CI] | per seed | gain at the "
             f"budget | CPU s / it |", "|---|---:|---:|---:|---:|"]
    for s in summaries:
        at = s["gain_at_equal_iterations"]
        seeds = ", ".join(f"{v:+.3f}" for v in at["per_seed"])
        per_iteration = fmt(s["per_iteration"]["cpu_seconds"], ".2f")
        lines.append(f"| {s['label']} | {_interval_text(at, signed=True)} | {seeds} | "
                     f"{s['gain']['mean']:+.3f} | {per_iteration} |")
    return "\n".join(lines)


def gain_at_paced_budget(records: list[dict], seconds_per_iteration: float,
                         cpu_budget: float) -> dict:
    """The gain of a method's runs at ``cpu_budget`` CPU seconds spent at another measurement's
    pace: after ``cpu_budget / seconds_per_iteration`` iterations (``value_at_iteration`` on each
    run). CPU seconds per iteration vary from day to day on a shared machine (1.5-1.8x on this
    one), so runs measured on another day, or stopped by an iteration cap, compare with a table
    at the budget the table would have spent. A run whose last evaluation comes before that
    iteration gives None; the mean and interval are over the others (None when none got there)."""
    if not (seconds_per_iteration > 0 and cpu_budget > 0):
        raise ValueError(f"seconds_per_iteration and cpu_budget must be > 0 (got "
                         f"{seconds_per_iteration}, {cpu_budget})")
    iterations = cpu_budget / seconds_per_iteration
    per_seed = gains_at_iteration(sorted(records, key=lambda r: r["seed"]), iterations)
    reached = [v for v in per_seed if v is not None]
    stats = (t_interval(reached) if reached else
             {"mean": None, "low": None, "high": None, "half_width": None, "n": 0, "sd": None})
    return {"cpu_budget": cpu_budget, "seconds_per_iteration": seconds_per_iteration,
            "iterations": iterations, **stats, "per_seed": per_seed}


def paced_budgets(summaries: list[dict], by_method: dict[str, list[dict]],
                  pace_files: list[Path], cpu_budget: float) -> dict[str, dict | None]:
    """``gain_at_paced_budget`` of every method of a report at the CPU seconds per iteration
    that another report's methods.json measured for it: the first of ``pace_files`` that has
    the method (its index in ``pace_from``); None for a method none of them has. Several files
    let each method take its pace from the runs measured in one sitting when some of a table's
    rows were re-measured on another day."""
    paces = []
    for pace_file in pace_files:
        if not Path(pace_file).is_file():
            raise ValueError(f"--pace-from {pace_file}: no such file (give the methods.json that "
                             f"--report wrote for the report whose pace to use)")
        paces.append(json.loads(Path(pace_file).read_text())["methods"])
    out = {}
    for s in summaries:
        out[s["method"]] = None
        for index, pace in enumerate(paces):
            seconds = (pace.get(s["method"]) or {}).get("per_iteration", {}).get("cpu_seconds")
            if seconds is not None:
                at = gain_at_paced_budget(by_method[s["method"]], seconds, cpu_budget)
                out[s["method"]] = {**at, "pace_from": index}
                break
    return out


def format_paced_budget(summaries: list[dict], paced: dict[str, dict | None], cpu_budget: float,
                        pace_files: list[str]) -> str:
    """The section of ``paced_budgets``: each method's iterations and gain at the budget (and,
    with several pace files, which one its pace came from)."""
    several = len(pace_files) > 1
    source = (f"`{pace_files[0]}`" if not several else
              "the first of " + ", ".join(f"`{f}`" for f in pace_files) + " that has the method")
    lines = [f"Gain at {cpu_budget:g} CPU seconds at the pace of {source} (each method "
             f"after {cpu_budget:g} / its CPU seconds per iteration there; linear interpolation "
             f"between evaluations; '-' past a run's last evaluation or a method that report "
             f"does not have):", "",
             "| method | CPU s / it there | iterations | gain [95% CI] | per seed |"
             + (" pace from |" if several else ""),
             "|---|---:|---:|---:|---:|" + ("---|" if several else "")]
    for s in summaries:
        at = paced[s["method"]]
        if at is None:
            lines.append(f"| {s['label']} | - | - | - | - |" + (" - |" if several else ""))
            continue
        seeds = ", ".join("-" if v is None else f"{v:+.3f}" for v in at["per_seed"])
        gain = "-" if at["mean"] is None else _interval_text(at, signed=True)
        lines.append(f"| {s['label']} | {at['seconds_per_iteration']:.2f} | "
                     f"{at['iterations']:.0f} | {gain} | {seeds} |"
                     + (f" `{pace_files[at['pace_from']]}` |" if several else ""))
    return "\n".join(lines)


def plot_curves(summaries: list[dict], path: Path, target_delta: float = TARGET_DELTA) -> Path:
    """Held-out accuracy against training CPU seconds: each method's mean over seeds as a line,
    the min-max over seeds as a band; the base and base + target as grey lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    colours = plt.get_cmap("tab10")
    for i, s in enumerate(summaries):
        curve = s["curve"]
        points = [(x, m, lo, hi) for x, m, lo, hi in zip(curve["cpu_seconds"], curve["mean"],
                                                         curve["min"], curve["max"])
                  if m is not None]
        if not points:
            continue
        xs, mean, low, high = zip(*points)
        colour = colours(i % 10)
        axes.plot(xs, mean, marker="o", markersize=3, color=colour,
                  label=f"{s['label']} (n={len(s['seeds'])})")
        if len(s["seeds"]) > 1:
            axes.fill_between(xs, low, high, color=colour, alpha=0.15, linewidth=0)
    bases = {round(s["base"]["accuracy"], 6) for s in summaries}
    if len(bases) == 1:
        base = bases.pop()
        axes.axhline(base, color="grey", linewidth=0.8, label=f"base {base:.3f}")
        axes.axhline(base + target_delta, color="grey", linestyle="--", linewidth=0.8,
                     label=f"base + {target_delta * 100:.0f} points")
    axes.set_xlabel("training CPU seconds (one thread; evaluation excluded)")
    axes.set_ylabel("held-out exact accuracy (family mean)")
    axes.set_title("toy GenEval world: accuracy vs CPU time (line: mean over seeds; band: min-max)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


# ----------------------------------------------------------------------------- the papers' claims


@dataclass(frozen=True)
class Claim:
    """A paper's speed claim as a ratio of ``method`` against ``baseline``.

    measure: "time" (median CPU seconds to +10 points, method / baseline), "reward" (training
    reward at equal iterations: the mean over the second half of the iterations both runs of a
    seed did, same prompts, method / baseline, then the mean over seeds) or "early_gain" (held-out
    gain at the first evaluation, means over seeds, method / baseline).
    """

    text: str
    method: str
    baseline: str
    measure: str
    paper_ratio: str


CLAIMS = (
    Claim("MixGRPO: about half of DanceGRPO's training time", "mix_grpo", "dance_grpo", "time",
          "0.5"),
    Claim("MixGRPO-Flash: about 71% less training time than DanceGRPO", "mix_grpo_flash",
          "dance_grpo", "time", "0.29"),
    Claim("Flow-GRPO-Fast: 2 trained steps match the full SDE (Flow-GRPO)", "flow_grpo_fast",
          "flow_grpo", "reward", "1.0 (reward at equal iterations)"),
    Claim("Flash-GRPO: one step per trajectory beats full-trajectory training at low budgets",
          "flash_grpo", "flow_grpo", "early_gain", "> 1 (gain at a low budget)"),
)


def _reward_at_equal_iterations(method_runs: list[dict], baseline_runs: list[dict]
                                ) -> tuple[float, float] | None:
    """Mean over shared seeds of the training reward over the second half of the iterations both
    runs of a seed did: (method, baseline). None when no seed is shared."""
    baseline_by_seed = {r["seed"]: r for r in baseline_runs}
    pairs = []
    for run in method_runs:
        other = baseline_by_seed.get(run["seed"])
        if other is None:
            continue
        ours = run["iterations"].get("reward/total/mean") or []
        theirs = other["iterations"].get("reward/total/mean") or []
        n = min(len(ours), len(theirs))
        if n == 0:
            continue
        half = slice(n // 2, n)
        pairs.append((mean_of(ours[half]), mean_of(theirs[half])))
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    if not pairs:
        return None
    return mean_of([a for a, _ in pairs]), mean_of([b for _, b in pairs])


def claim_row(claim: Claim, summaries: dict[str, dict], runs: dict[str, list[dict]]) -> dict:
    """The claim's measured ratio from the report's summaries (and, for "reward", the runs).
    ``measured`` is text: a ratio, a bound when one side did not reach the target, or why there
    is none; ``ratio`` the number when there is one."""
    row = {"claim": claim.text, "method": claim.method, "baseline": claim.baseline,
           "measure": claim.measure, "paper_ratio": claim.paper_ratio, "ratio": None}
    if claim.method not in summaries or claim.baseline not in summaries:
        return {**row, "measured": "not measured"}
    ours, theirs = summaries[claim.method], summaries[claim.baseline]
    if claim.measure == "time":
        a, b = ours["seconds_to_target"]["median"], theirs["seconds_to_target"]["median"]
        budget = ours["budget"]
        row.update(method_value=a, baseline_value=b)
        if a is not None and b is not None:
            row["ratio"] = a / b
            return {**row, "measured": f"{a / b:.2f} ({a:.0f} s / {b:.0f} s to +10)"}
        if a is not None:
            return {**row, "measured": f"< {a / budget:.2f} ({a:.0f} s; the baseline did not "
                                       f"reach +10 in {budget:g} s)"}
        if b is not None:
            return {**row, "measured": f"> {budget / b:.2f} (not reached in {budget:g} s; the "
                                       f"baseline in {b:.0f} s)"}
        return {**row, "measured": f"neither reached +10 in {budget:g} s"}
    if claim.measure == "reward":
        means = _reward_at_equal_iterations(runs.get(claim.method, []),
                                            runs.get(claim.baseline, []))
        if means is None or not means[1]:
            return {**row, "measured": "no shared seed"}
        row.update(method_value=means[0], baseline_value=means[1], ratio=means[0] / means[1])
        return {**row, "measured": f"{means[0] / means[1]:.2f} (training reward {means[0]:.3f} "
                                   f"vs {means[1]:.3f})"}
    if claim.measure == "early_gain":
        first = min(m for m in ours["curve"]["cpu_seconds"] if m > 0)
        at = ours["curve"]["cpu_seconds"].index(first)
        gains = []
        for summary in (ours, theirs):
            mean = summary["curve"]["mean"][at] if summary["curve"]["cpu_seconds"][at] == first \
                else None
            gains.append(None if mean is None else mean - summary["base"]["accuracy"])
        a, b = gains
        row.update(method_value=a, baseline_value=b, at_cpu_seconds=first)
        if a is None or b is None:
            return {**row, "measured": "not measured at the same mark"}
        if a >= MIN_GAIN_FOR_RATIO and b >= MIN_GAIN_FOR_RATIO:
            row["ratio"] = a / b
            return {**row, "measured": f"{a / b:.2f} (gain {a:+.3f} vs {b:+.3f} at {first:g} s)"}
        loser = "the method" if a < MIN_GAIN_FOR_RATIO else "the baseline"
        return {**row, "measured": f"gain {a:+.3f} vs {b:+.3f} at {first:g} s (no ratio: "
                                   f"{loser} did not gain a point)"}
    raise ValueError(f"unknown claim measure {claim.measure!r}")


def format_claims(rows: list[dict]) -> str:
    lines = ["| claim | paper's ratio | measured here |", "|---|---|---|"]
    lines += [f"| {r['claim']} | {r['paper_ratio']} | {r['measured']} |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- ranking, report


def separations(summaries: list[dict]) -> list[tuple[str, str]]:
    """(higher, lower) label pairs whose 95% intervals of the gain over seeds do not overlap:
    the higher method's interval lies wholly above the lower's. A method with one seed has no
    interval and separates from nothing. Ordered by the higher method's mean gain, then the
    lower's, both descending."""
    ranked = sorted((s for s in summaries if s["gain"]["low"] is not None),
                    key=lambda s: -s["gain"]["mean"])
    return [(a["label"], b["label"]) for i, a in enumerate(ranked) for b in ranked[i + 1:]
            if a["gain"]["low"] > b["gain"]["high"]]


def format_ranking(summaries: list[dict]) -> str:
    """One sentence per method that lies above others, and what cannot be ranked."""
    pairs = separations(summaries)
    single = [s["label"] for s in summaries if s["gain"]["low"] is None]
    lines = ["Ranking, stated only where the 95% intervals of the gain over seeds do not overlap:"]
    above: dict[str, list[str]] = {}
    for high, low in pairs:
        above.setdefault(high, []).append(low)
    lines += [f"- {high} above {', '.join(lows)}" for high, lows in above.items()]
    if not pairs:
        lines.append("- no two methods separate: no ranking")
    if single:
        lines.append(f"- one seed only (not ranked): {', '.join(single)}")
    return "\n".join(lines)


def reproduce_command(records: list[dict], out: Path) -> str:
    """The table's own command, read from its runs (seeds, budget, evaluation interval, a
    stretched schedule's --schedule-from, extra overrides, methods): rerunning it skips every
    finished run and rewrites the report."""
    seeds = sorted({r["seed"] for r in records})
    signature = records[0]["signature"]
    names = {r["method"] for r in records}
    methods = [m for m in METHODS if m in names] + sorted(names - set(METHODS))
    parts = ["python benchmarks/methods.py", f"--seeds {','.join(map(str, seeds))}",
             f"--budget {signature['budget']:g}", f"--eval-interval {signature['eval_interval']:g}",
             f"--methods {','.join(methods)}"]
    stretched_from, own_overrides = schedule_origin(records, out)
    if stretched_from is not None:
        parts.append(f"--schedule-from {stretched_from:g}")
    overrides = set(own_overrides)
    if len(overrides) == 1:
        parts += [f"--set {item}" for item in next(iter(overrides))]
    else:   # no one command reproduces these runs: say so rather than drop the overrides
        parts.append("(the runs differ in their --set overrides: see each run's signature)")
    try:
        relative = out.resolve().relative_to(ROOT)
    except ValueError:
        relative = out
    if str(relative) != DEFAULT_OUT:
        parts.append(f"--out {relative}")
    return " ".join(parts)


def gathered_records(out: Path, include: Sequence[Path] = ()) -> dict[Path, list[dict]]:
    """The finished runs of ``<out>/runs`` and of each ``<include>/runs`` (tables run on other
    days into their own folders, reported as one), by folder; folders without any are left out.
    A run key found twice, or runs scored on different held-out samples (another base
    accuracy), make one table meaningless: ValueError."""
    by_folder, seen = {}, {}
    for folder in (out, *include):
        for record in finished_records(folder):
            if record["key"] in seen:
                raise ValueError(f"run {record['key']} is in both {seen[record['key']]} and "
                                 f"{folder}: report each folder alone, or include it once")
            seen[record["key"]] = folder
            by_folder.setdefault(folder, []).append(record)
    bases = {r["base"]["accuracy"] for records in by_folder.values() for r in records}
    if len(bases) > 1:
        raise ValueError(f"the runs were scored on different held-out samples (base accuracies "
                         f"{sorted(bases)}): only tables with the same evaluation seed and size "
                         f"report together")
    return by_folder


def report(out: Path, command: str = "", log: Callable[[str], None] = print,
           pace_files: list[Path] | None = None, at_cpu: float | None = None,
           include: Sequence[Path] = ()) -> dict | None:
    """Aggregate every finished run in ``<out>/runs`` (and in each ``include`` folder's
    ``runs``) into table.md, methods.json and accuracy_vs_cpu_seconds.png in ``out``. Returns the
    JSON's content (None when nothing is finished). With ``pace_files`` and ``at_cpu``, also
    every method's gain at ``at_cpu`` CPU seconds at the pace those reports measured
    (``paced_budgets``)."""
    if (not pace_files) != (at_cpu is None):
        raise ValueError("--pace-from and --at-cpu go together: the budget is in the CPU seconds "
                         "of the report the pace comes from")
    by_folder = gathered_records(out, include)
    records = [r for folder_records in by_folder.values() for r in folder_records]
    if not records:
        log(f"no finished runs in {out / 'runs'}: nothing to report")
        return None
    by_method: dict[str, list[dict]] = {}
    for record in records:
        by_method.setdefault(record["method"], []).append(record)
    order = [m for m in METHODS if m in by_method] + sorted(set(by_method) - set(METHODS))
    # the fewest iterations any run evaluated at its end: every method is compared there too
    equal_iterations = min(r["evals"][-1]["iteration"] for r in records)
    summaries = [summarize_method(by_method[m], equal_iterations=equal_iterations)
                 for m in order]
    unfinished = sorted(p.stem for folder in (out, *include)
                        for p in (folder / "runs").glob("*.json")
                        if p.stem not in {r["key"] for r in records})
    first = summaries[0]
    base = first["base"]
    date = time.strftime("%Y-%m-%d")
    head = [f"Methods on the toy world, {date}: {first['budget']:g} training CPU seconds per run "
            f"(one thread, evaluation excluded), evaluations every {first['eval_interval']:g} s; "
            f"held-out exact accuracy (family mean) on the same "
            f"{_eval_samples(records[0])} samples for every method and seed.",
            f"Base accuracy {base['accuracy']:.3f} (se {fmt(base['accuracy_se'], '.3f')})"
            + (f", artifacts {base['artifacts']:.4f}" if base["artifacts"] is not None else "")
            + ". CI: 95% t-interval over seeds. CPU s to +10: linear interpolation between "
              "evaluations, median over seeds ('not reached' counts as longer than the budget; "
              "(k/n) seeds reached it). Iterations: mean over seeds; (k cap): k seeds stopped at "
              "their config's run.max_iterations before the budget. Per-iteration columns: means "
              "over every iteration of every seed, CPU seconds; rollout includes the reward; "
              "other = the rest of the iteration.",
            ""]
    # one command per folder: the runs of each were made by its own
    commands = [reproduce_command(folder_records, folder)
                for folder, folder_records in by_folder.items()]
    head.insert(1, ("Commands, one per folder" if len(commands) > 1 else "Command")
                + " (resumable; reruns skip finished runs): "
                + "; ".join(f"`{c}`" for c in commands))
    table = "\n".join(head + [format_table(summaries)])
    table += "\n\n" + format_ranking(summaries)
    table += "\n\n" + format_equal_iterations(summaries)
    paced = None
    if pace_files:
        paced = paced_budgets(summaries, by_method, pace_files, at_cpu)
        shown = [str(os.path.relpath(f, ROOT) if Path(f).is_absolute() else f)
                 for f in pace_files]
        table += "\n\n" + format_paced_budget(summaries, paced, at_cpu, shown)
        for s in summaries:
            at = paced[s["method"]]
            s["gain_at_paced_budget"] = (None if at is None else
                                         {**at, "pace_from": shown[at["pace_from"]]})
    if unfinished:
        table += f"\n\nNot finished (not in the table): {', '.join(unfinished)}"
    capped = capped_early(records)
    if capped:
        table += ("\n\nStopped by their iteration cap before the CPU budget (their CPU-second "
                  "columns compare iterations, not CPU time; rerun with a higher "
                  "`run.max_iterations`, e.g. `--calibrate --write-configs`): "
                  + ", ".join(f"{key} ({cpu:.0f} s)" for key, cpu in capped))
    by_name = {s["method"]: s for s in summaries}
    claims = [claim_row(c, by_name, by_method) for c in CLAIMS]
    table += ("\n\nThe papers' speed claims, as ratios against their baselines, measured here "
              "(time: median CPU seconds to +10 points; reward: training reward over the second "
              "half of the iterations both runs did, mean over seeds; early gain: held-out gain "
              "at the first evaluation, mean over seeds):\n\n" + format_claims(claims))
    out.mkdir(parents=True, exist_ok=True)     # a report of included folders only
    (out / "table.md").write_text(table + "\n")
    data = {"generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command,
            "table_command": "; ".join(commands),
            "separations": [{"higher": h, "lower": low} for h, low in separations(summaries)],
            "target_delta": TARGET_DELTA, "methods": by_name, "claims": claims,
            "unfinished": unfinished}
    write_json(out / "methods.json", data)
    plot = plot_curves(summaries, out / "accuracy_vs_cpu_seconds.png")
    log(f"\n{table}\n\nwrote {out / 'table.md'}, {out / 'methods.json'}, {plot}")
    return data


def capped_early(records: list[dict]) -> list[tuple[str, float]]:
    """The runs that ended at their config's ``run.max_iterations`` before the CPU budget, with
    the CPU seconds they trained: the runs a fair table must not rank by CPU time."""
    return [(r["key"], r["evals"][-1]["cpu_seconds"]) for r in records
            if r.get("stopped_by") == "max_iterations"
            and r["evals"][-1]["cpu_seconds"] < r["signature"]["budget"]]


def _eval_samples(record: dict) -> str:
    samples = record["base"].get("samples")
    return str(samples) if samples else "the config's"
