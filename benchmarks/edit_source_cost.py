"""What the source term costs: an editing config with and without ``keep_source_beta``.

    python benchmarks/edit_source_cost.py [--config configs/toy_edit.yaml] [--iterations 8]
                                          [--threads 2] [--out benchmarks/results/edit_source_cost]

Two ``Trainer``s are built from the same config: one as given (the source term on) and one with
``training.locality.keep_source_beta=0``. After one warm-up iteration each (prompt encoding,
allocations), they run the same iteration numbers in turn, and which goes first alternates, so
a drift in machine speed hits both alike. Reported per arm: wall seconds of ``run_iteration``
and of its update phase (``time/update``: replay forwards and backwards, the source term's
encode, forward and backward, optimiser steps), and the replay batches trained. The ratios
(source / plain) are medians over the iterations of each iteration's ratio. The arms diverge
after their first update (other weights, other samples, so a different number of zero-variance
replay batches skipped), so the update's ratio per trained replay batch is printed too.
Results go to ``<out>/<config name>.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowgrpo.config import ConfigError, load_config  # noqa: E402
from flowgrpo.trainer import Trainer  # noqa: E402

ARMS = ("source", "plain")


def build_trainers(config_path: str, overrides: list[str], workdir: Path) -> dict[str, Trainer]:
    """The two arms' trainers; refuses a config whose source term is off (nothing to compare)."""
    common = [*overrides, f"run.output_dir={workdir}", "run.tracker=none", "run.progress=false",
              "run.checkpoint_every=0", "run.comparison_grid=false"]
    source = load_config(config_path, common)
    if source.training.locality.keep_source_beta <= 0:
        raise ConfigError(f"{config_path}: training.locality.keep_source_beta is 0, so there is "
                          "no source term to cost; set it (e.g. training.locality."
                          "keep_source_beta=1e-4) as an override")
    plain = load_config(config_path, [*common, "training.locality.keep_source_beta=0",
                                      f"name={source.name}_plain"])
    return {"source": Trainer(source), "plain": Trainer(plain)}


def measure(trainers: dict[str, Trainer], iterations: int) -> dict:
    """Per-iteration wall, update seconds and trained replay batches of both arms, and the
    median ratios source / plain."""
    rows = {arm: [] for arm in ARMS}
    for arm in ARMS:
        trainers[arm].run_iteration(0)                      # warm-up, not counted
    for iteration in range(1, 1 + iterations):
        for arm in ARMS if iteration % 2 else ARMS[::-1]:
            began = time.perf_counter()
            metrics = trainers[arm].run_iteration(iteration)
            rows[arm].append({
                "wall": time.perf_counter() - began, "update": metrics["time/update"],
                "batches": metrics["train/replay_batches"] - metrics["train/skipped_replay_batches"],
                "keep_source": metrics.get("train/keep_source")})
    source, plain = rows["source"], rows["plain"]

    def median_ratio(key: str, per_batch: bool = False) -> float:
        ratios = [(s[key] / max(s["batches"], 1)) / (p[key] / max(p["batches"], 1)) if per_batch
                  else s[key] / p[key] for s, p in zip(source, plain)]
        return round(statistics.median(ratios), 3)

    return {"iterations": rows,
            "ratio_wall": median_ratio("wall"), "ratio_update": median_ratio("update"),
            "ratio_update_per_batch": median_ratio("update", per_batch=True)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/toy_edit.yaml")
    p.add_argument("--iterations", type=int, default=8, help="measured iterations per arm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/edit_source_cost")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = p.parse_args(argv)
    if args.iterations < 1:
        p.error("--iterations must be at least 1")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        trainers = build_trainers(args.config, [*args.overrides,
                                                f"run.num_threads={args.threads}"], Path(workdir))
        began = time.process_time()
        result = measure(trainers, args.iterations)
        cpu = time.process_time() - began
    for arm in ARMS:
        walls = [r["wall"] for r in result["iterations"][arm]]
        updates = [r["update"] for r in result["iterations"][arm]]
        print(f"{arm:>6}: iteration {statistics.median(walls):.2f} s, update "
              f"{statistics.median(updates):.2f} s (medians over {args.iterations})")
    print(f"source / plain (median of per-iteration ratios): iteration {result['ratio_wall']}, "
          f"update {result['ratio_update']}, update per trained replay batch "
          f"{result['ratio_update_per_batch']}")
    name = trainers["source"].config.name
    result.update(config=args.config, overrides=args.overrides, threads=args.threads,
                  cpu_seconds=round(cpu, 1),
                  command=" ".join(["python benchmarks/edit_source_cost.py", *(argv or sys.argv[1:])]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
