"""Reward hacking on the toy world, and the guards against it, measured.

    python benchmarks/reward_hacking.py [--guards none,kl_weak,...] [--out runs/reward_hacking]
                                        [--results benchmarks/results/reward_hacking]
    python benchmarks/reward_hacking.py --report           # table and plot from finished runs
    python benchmarks/reward_hacking.py --cost             # seconds per iteration, side by side

Every run is ``flowgrpo train configs/toy_hacking.yaml`` (the learned proxy ``toy_proxy`` as the
only training reward; the exact verifier, never trained on, as the held-out gold metric) plus one
guard's overrides (``GUARDS``), from the same base, seed and prompt order. Runs go to
``--out/<guard>/`` and resume where they stopped (``--resume auto``), so an interrupted
benchmark loses at most the iterations since a run's last checkpoint; finished runs are skipped.

The report reads each run's ``metrics.jsonl`` and writes ``table.md``, ``results.json`` and
``curves.png`` (gold and proxy against iteration, one line per guard) to ``--results``. Per
guard: gold (held-out exact accuracy, family mean) at the end, at its best and at the evaluation
where the proxy peaked, the proxy at the end, the image-artifact metric at the end, and the
iteration from which the proxy stops tracking gold (the first evaluation after gold's best at
which the proxy is higher than at gold's best while gold is lower by more than one standard
error). ``--cost`` times ``--cost-iterations`` iterations of every guard, the guards taking
turns, in process CPU seconds (one thread), and reports each guard's median seconds per
iteration over the unguarded run's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/toy_hacking.yaml"
GOLD = "eval/geneval_toy/family_mean"
PROXY = "eval/toy_proxy/family_mean"
ARTIFACTS = "eval/toy_artifacts/family_mean"
PROXY_PATH = "assets/toy_proxy"
MEMBERS = 4


@dataclass(frozen=True)
class Guard:
    name: str
    label: str
    overrides: tuple[str, ...]


def _members(path: str = PROXY_PATH) -> str:
    return ", ".join(f"{{name: toy_proxy, label: m{i}, member: {i}, path: {path}}}"
                     for i in range(MEMBERS))


GUARDS: dict[str, Guard] = {g.name: g for g in (
    Guard("none", "no guard", ()),
    Guard("kl_weak", "KL 0.1", ("training.kl_beta=0.1",)),
    Guard("kl_strong", "KL 1", ("training.kl_beta=1.0",)),
    Guard("gardo", "GARDO (gated KL 1 on the 10% most uncertain, reference refresh every 10, "
                   "diversity)",
          ("training.kl_beta=1.0", "training.gardo.kl_gate_key=toy_proxy.std",
           "training.gardo.kl_gate_fraction=0.1", "training.gardo.refresh_every=10",
           "training.gardo.diversity=true")),
    Guard("ensemble_penalty", "ensemble mean - 1 x std",
          (f"rewards.components=[{{name: ensemble, options: {{members: [{_members()}], "
           f"penalty: 1.0}}}}]",)),
    Guard("saturation", "members as components, saturation weights (ratio 0.5)",
          (f"rewards.components=[{', '.join(f'{{name: toy_proxy, weight: 0.25, options: {{label: m{i}, member: {i}, path: {PROXY_PATH}}}}}' for i in range(MEMBERS))}]",
           "rewards.saturation_ratio=0.5")),
    Guard("anchor", "velocity anchor 1 at untrained steps (sigma <= 0.45)",
          ("training.anchor_beta=1.0", "training.anchor_sigma_max=0.45")),
    Guard("select_best", "no guard, best checkpoint by held-out gold",
          (f"run.select_best_on={GOLD.replace('/family_mean', '/family_mean')}",)),
)}


# Where a run logs the proxy's ensemble mean: as the reward itself, inside the `ensemble`
# reward, or (members as components, labelled m0..m3) as each member reward's `mean` component.
PROXY_KEYS = (PROXY, "eval/ensemble.mean/family_mean", "eval/m0.mean/family_mean")


def proxy_of(row: dict) -> float:
    """The proxy's ensemble mean (family mean) in an evaluation record, whatever the guard's
    reward layout; NaN when absent."""
    return next((row[k] for k in PROXY_KEYS if k in row), math.nan)


def evaluations(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("phase") == "eval" and GOLD in r]


def train_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("phase") == "train"]


def divergence(evals: list[dict]) -> int | None:
    """The first evaluation after gold's best at which the proxy is higher than at gold's best
    while gold is lower than its best by more than one standard error (of the best); None when
    none is."""
    if not evals:
        return None
    best = max(range(len(evals)), key=lambda i: evals[i][GOLD])
    gold_best, proxy_best = evals[best][GOLD], proxy_of(evals[best])
    se = evals[best].get(GOLD + "/se", 0.0)
    for row in evals[best + 1:]:
        if proxy_of(row) > proxy_best and row[GOLD] < gold_best - se:
            return int(row["iteration"])
    return None


def delivered_gold(run_dir: Path, last: dict) -> float:
    """Gold of the checkpoint the run hands over: the best one when the run selected one by
    a held-out metric (``checkpoints/best.json``), else the last."""
    best = run_dir / "checkpoints" / "best.json"
    if best.is_file():
        record = json.loads(best.read_text())
        if record.get("key") == GOLD:
            return float(record["value"])
    return last[GOLD]


def summarize(guard: Guard, run_dir: Path, max_iterations: int) -> dict | None:
    evals = evaluations(run_dir)
    if not evals:
        return None
    last, first = evals[-1], evals[0]
    best = max(evals, key=lambda r: r[GOLD])
    proxy_peak = max(evals, key=lambda r: -math.inf if math.isnan(proxy_of(r)) else proxy_of(r))
    cpu = [r["time/iteration"] for r in train_rows(run_dir) if "time/iteration" in r]
    return {
        "guard": guard.name, "label": guard.label, "finished": last["iteration"] >= max_iterations,
        "iterations": int(last["iteration"]),
        "gold_start": first[GOLD], "gold_end": last[GOLD], "gold_end_se": last.get(GOLD + "/se"),
        "gold_best": best[GOLD], "gold_best_iteration": int(best["iteration"]),
        "gold_at_proxy_peak": proxy_peak[GOLD], "proxy_peak_iteration": int(proxy_peak["iteration"]),
        "proxy_start": proxy_of(first), "proxy_end": proxy_of(last),
        "artifacts_start": first.get(ARTIFACTS), "artifacts_end": last.get(ARTIFACTS),
        "diverges_at": divergence(evals),
        "gold_delivered": delivered_gold(run_dir, last),
        "wall_seconds_per_iteration": statistics.median(cpu) if cpu else None,
        "curve": [{"iteration": int(r["iteration"]), "gold": r[GOLD], "proxy": proxy_of(r),
                   "artifacts": r.get(ARTIFACTS)} for r in evals],
    }


def max_iterations_of(overrides: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from flowgrpo.config import load_config

    return load_config(ROOT / CONFIG, overrides).run.max_iterations


def run_guard(guard: Guard, out: Path, extra: list[str]) -> None:
    overrides = [f"name={guard.name}", f"run.output_dir={out}", *guard.overrides, *extra]
    total = max_iterations_of(list(guard.overrides) + list(extra))
    done = evaluations(out / guard.name)
    if done and done[-1]["iteration"] >= total:
        print(f"{guard.name}: finished, skipped", flush=True)
        return
    command = [sys.executable, "-m", "flowgrpo", "train", CONFIG, *overrides, "--resume", "auto"]
    print(" ".join(command), flush=True)
    began = time.time()
    subprocess.run(command, cwd=ROOT, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    print(f"{guard.name}: {time.time() - began:.0f} s", flush=True)


def fmt(value, digits=3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def report(guards: list[Guard], out: Path, results: Path, extra: list[str]) -> list[dict]:
    rows = []
    for guard in guards:
        summary = summarize(guard, out / guard.name,
                            max_iterations_of(list(guard.overrides) + list(extra)))
        if summary is not None:
            rows.append(summary)
    if not rows:
        print("no finished evaluations yet", flush=True)
        return rows
    cost = {}
    cost_path = results / "cost.json"
    if cost_path.is_file():
        cost = json.loads(cost_path.read_text())["ratio_to_none"]
    lines = ["| guard | its | gold start | gold end (se) | gold best (it) | gold at proxy peak (it)"
             " | gold delivered | proxy start -> end | artifacts start -> end |"
             " proxy stops tracking gold at | CPU s/it vs none |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['iterations']}{'' if r['finished'] else ' (running)'} | "
            f"{fmt(r['gold_start'])} | {fmt(r['gold_end'])} ({fmt(r['gold_end_se'])}) | "
            f"{fmt(r['gold_best'])} ({r['gold_best_iteration']}) | "
            f"{fmt(r['gold_at_proxy_peak'])} ({r['proxy_peak_iteration']}) | "
            f"{fmt(r['gold_delivered'])} | "
            f"{fmt(r['proxy_start'])} -> {fmt(r['proxy_end'])} | "
            f"{fmt(r['artifacts_start'], 4)} -> {fmt(r['artifacts_end'], 4)} | "
            f"{fmt(r['diverges_at'])} | {fmt(cost.get(r['guard']), 2)} |")
    results.mkdir(parents=True, exist_ok=True)
    (results / "table.md").write_text("\n".join(lines) + "\n")
    (results / "results.json").write_text(json.dumps(rows, indent=1))
    plot(rows, results / "curves.png")
    print("\n".join(lines), flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6))
    for r in rows:
        its = [p["iteration"] for p in r["curve"]]
        line, = axes[0].plot(its, [p["gold"] for p in r["curve"]], marker="o", ms=3,
                             label=r["label"])
        axes[1].plot(its, [p["proxy"] for p in r["curve"]], marker="o", ms=3,
                     color=line.get_color())
        axes[2].plot(its, [p["artifacts"] for p in r["curve"]], marker="o", ms=3,
                     color=line.get_color())
    axes[0].set_title("gold: held-out verifier accuracy (never trained on)")
    axes[1].set_title("proxy: toy_proxy on held-out prompts (trained on)")
    axes[2].set_title("image artifacts (lower is better)")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    # Below the panels, so no curve is hidden (no guard and best-checkpoint selection train
    # identically: their lines coincide).
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure_cost(guards: list[Guard], iterations: int, results: Path) -> dict:
    """Process CPU seconds per iteration of each guard, one thread, the guards taking turns
    iteration by iteration (so a change of load hits all of them alike)."""
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    from flowgrpo.config import load_config
    from flowgrpo.trainer import Trainer

    trainers = {}
    for guard in guards:
        config = load_config(ROOT / CONFIG, [f"name=cost_{guard.name}", "run.output_dir=/tmp/"
                                             "flowgrpo_hacking_cost", "run.tracker=none",
                                             "run.progress=false", *guard.overrides])
        trainers[guard.name] = Trainer(config, overwrite=True)
    seconds: dict[str, list[float]] = {g.name: [] for g in guards}
    for iteration in range(iterations):
        for guard in guards:
            began = time.process_time()
            trainers[guard.name].run_iteration(iteration)
            seconds[guard.name].append(time.process_time() - began)
    medians = {name: statistics.median(v[1:] or v) for name, v in seconds.items()}
    base = medians.get("none")
    result = {"iterations": iterations, "cpu_seconds_median": medians,
              "ratio_to_none": {k: (v / base if base else None) for k, v in medians.items()},
              "date": time.strftime("%Y-%m-%d")}
    results.mkdir(parents=True, exist_ok=True)
    (results / "cost.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guards", default=",".join(GUARDS))
    p.add_argument("--out", default=str(ROOT / "runs" / "reward_hacking"))
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "reward_hacking"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every guard (e.g. run.max_iterations=60)")
    p.add_argument("--report", action="store_true", help="only write the table and plot")
    p.add_argument("--cost", action="store_true", help="only measure seconds per iteration")
    p.add_argument("--cost-iterations", type=int, default=4)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.guards.split(",") if n.strip()]
    unknown = [n for n in names if n not in GUARDS]
    if unknown:
        raise SystemExit(f"--guards: unknown guard {unknown[0]}; choose from {', '.join(GUARDS)}")
    guards = [GUARDS[n] for n in names]
    out, results = Path(args.out), Path(args.results)
    if args.cost:
        measure_cost(guards, args.cost_iterations, results)
        return
    if not args.report:
        for guard in guards:
            run_guard(guard, out, args.set)
    report([GUARDS[n] for n in GUARDS], out, results, args.set)


if __name__ == "__main__":
    main()
