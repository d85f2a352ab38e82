"""The embedded default as a user runs it: the shipped command (`configs/toy_geneval.yaml`, its
own threads, iterations and evaluation), once per training seed, each run's held-out result kept
as a small JSON record, and the README's figures (median and range over the seeds) computed from
those records.

    python benchmarks/default_runs.py run --seeds 0,1,2      # the embedded default, each seed
    python benchmarks/default_runs.py report                 # the table, from the records
    python benchmarks/default_runs.py run --config configs/toy_geneval.yaml   # another config

A record (benchmarks/results/default_runs/<config name>/s<seed>.json) holds the command, the date, the CPU
and wall seconds, the machine's load before and after (a run that shared the machine is slower,
not different: the result depends on the iterations, not the time), and the held-out accuracy
(GenEval's family mean) and artifact metric at the start and at the end, unrounded.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "default_runs"
CONFIG = "configs/toy_geneval.yaml"
ACCURACY = "eval/geneval_toy"                       # the family mean
ARTIFACTS = "eval/toy_artifacts/family_mean"


def command(seed: int, output_dir: Path, config: str = CONFIG) -> list[str]:
    """The README's command (`scripts/quickstart.sh` runs it, for the embedded default), with the
    seed, a run name per seed and an output folder outside the checkout's runs/."""
    return [sys.executable, "-m", "flowgrpo", "train", config, "--overwrite",
            f"run.seed={seed}", f"name={run_name(config, seed)}", f"run.output_dir={output_dir}",
            "run.progress=false"]


def run_name(config: str, seed: int) -> str:
    return f"{Path(config).stem}_s{seed}"


def records_dir(config: str) -> Path:
    """Where a config's run records are kept: one folder per config name."""
    return RESULTS / Path(config).stem


def eval_records(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r["phase"] == "eval"]


def run_seed(seed: int, output_dir: Path, config: str = CONFIG) -> dict:
    cmd = command(seed, output_dir, config)
    load_before = os.getloadavg()
    began = time.time()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    evals = eval_records(output_dir / run_name(config, seed) / "metrics.jsonl")
    first, last = evals[0], evals[-1]
    return {
        "seed": seed, "command": " ".join(["python", *cmd[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)),
        "wall_seconds": time.time() - began,
        "cpu_seconds": (cpu_after.ru_utime + cpu_after.ru_stime)
        - (cpu_before.ru_utime + cpu_before.ru_stime),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "iterations": last["iteration"],
        "base": {"accuracy": first[ACCURACY], "accuracy_se": first[f"{ACCURACY}/se"],
                 "artifacts": first[ARTIFACTS]},
        "final": {"accuracy": last[ACCURACY], "accuracy_se": last[f"{ACCURACY}/se"],
                  "artifacts": last[ARTIFACTS]},
        "evals": [{"iteration": r["iteration"], "accuracy": r[ACCURACY], "artifacts": r[ARTIFACTS]}
                  for r in evals],
    }


def summary(records: list[dict]) -> dict:
    """Median and range of the final accuracy, the gain in points and the artifact ratio."""
    finals = [r["final"]["accuracy"] for r in records]
    gains = [100 * (r["final"]["accuracy"] - r["base"]["accuracy"]) for r in records]
    ratios = [r["final"]["artifacts"] / r["base"]["artifacts"] for r in records]
    return {"seeds": [r["seed"] for r in records], "base": records[0]["base"]["accuracy"],
            "final_median": statistics.median(finals), "final_range": (min(finals), max(finals)),
            "gain_median": statistics.median(gains), "gain_range": (min(gains), max(gains)),
            "artifacts_ratio_range": (min(ratios), max(ratios)),
            "dates": sorted({r["started"][:10] for r in records})}


def report(records: list[dict]) -> str:
    s = summary(records)
    lines = ["| seed | started | base | final (se) | gain (points) | artifacts | CPU s | load before/after |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['seed']} | {r['started']} | {r['base']['accuracy']:.3f} | "
            f"{r['final']['accuracy']:.3f} ({r['final']['accuracy_se']:.3f}) | "
            f"{100 * (r['final']['accuracy'] - r['base']['accuracy']):+.1f} | "
            f"{r['base']['artifacts']:.4f} -> {r['final']['artifacts']:.4f} | "
            f"{r['cpu_seconds']:.0f} | {r['load_average_before'][0]:.1f} / "
            f"{r['load_average_after'][0]:.1f} |")
    lines.append("")
    lines.append(f"seeds {s['seeds']}: final accuracy median {s['final_median']:.3f} (range "
                 f"{s['final_range'][0]:.3f}-{s['final_range'][1]:.3f}), gain median "
                 f"{s['gain_median']:+.1f} (range {s['gain_range'][0]:+.1f} to "
                 f"{s['gain_range'][1]:+.1f}) points, artifacts "
                 f"{s['artifacts_ratio_range'][0]:.1f}-{s['artifacts_ratio_range'][1]:.1f}x the "
                 f"base's")
    return "\n".join(lines)


def load_records(config: str = CONFIG) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(records_dir(config).glob("s*.json"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="job", required=True)
    run = sub.add_parser("run", help="train the shipped config once per seed, keep the records")
    run.add_argument("--seeds", default="0,1,2")
    run.add_argument("--output-dir", default=str(ROOT / "runs" / "default_runs"))
    report_job = sub.add_parser("report", help="the table and the README's figures, from the records")
    for job in (run, report_job):
        job.add_argument("--config", default=CONFIG, help=f"the config (default {CONFIG})")
    args = parser.parse_args(argv)
    if args.job == "run":
        folder = records_dir(args.config)
        folder.mkdir(parents=True, exist_ok=True)
        for seed in (int(s) for s in args.seeds.split(",")):
            record = run_seed(seed, Path(args.output_dir), args.config)
            (folder / f"s{seed}.json").write_text(json.dumps(record, indent=1) + "\n")
            print(f"seed {seed}: {record['base']['accuracy']:.3f} -> "
                  f"{record['final']['accuracy']:.3f}", flush=True)
    records = load_records(args.config)
    if records:
        print(report(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
