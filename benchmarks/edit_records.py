"""Keep an editing-toy run's held-out evaluations as a small committed record, and print its gain.

An editing probe is a plain ``flowgrpo train configs/toy_edit.yaml ...`` run (the commands are in
benchmarks/COMMANDS.md); its ``metrics.jsonl`` holds every iteration. The record keeps what the
results cite: the evaluation rows (iteration and every ``eval/`` metric, unrounded), the number of
iterations trained and their summed wall seconds.

    python benchmarks/edit_records.py runs/edit_probe/edit_nft_s0 \
        --out benchmarks/results/methods/guarded/edit_nft/s0.json --seed 0 \
        --started "2026-12-05 07:46 UTC" --config "configs/toy_edit.yaml with ... (COMMANDS.md)"
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

EXACT = "eval/toy_edit.exact/family_mean"
KEPT = "eval/toy_edit.kept/family_mean"


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no metrics.jsonl (is {run_dir} a run folder?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def edit_record(rows: list[dict], seed: int, started: str, config: str) -> dict:
    """The record of one run: its evaluation rows (``iteration`` and ``eval/*`` keys only), the
    iterations trained (rows with ``time/iteration``) and their wall seconds."""
    evals = [{k: v for k, v in row.items() if k == "iteration" or k.startswith("eval/")}
             for row in rows if any(k.startswith("eval/") for k in row)]
    if not evals or EXACT not in evals[0]:
        raise SystemExit(f"no {EXACT} in the run's evaluations: not an editing-toy run?")
    trained = [row["time/iteration"] for row in rows if "time/iteration" in row]
    return {"seed": seed, "config": config, "started": started, "iterations": len(trained),
            "training_wall_seconds": round(math.fsum(trained), 1), "evals": evals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--started", required=True, help="UTC start, e.g. '2026-12-05 07:46 UTC'")
    parser.add_argument("--config", required=True, help="the config and where its overrides are")
    args = parser.parse_args()
    record = edit_record(read_rows(args.run_dir), args.seed, args.started, args.config)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    first, last = record["evals"][0], record["evals"][-1]
    print(f"{args.out}: exact {first[EXACT]:.3f} -> {last[EXACT]:.3f} "
          f"({100 * (last[EXACT] - first[EXACT]):+.1f} points), kept "
          f"{100 * (last[KEPT] - first[KEPT]):+.1f}, best exact "
          f"{max(e[EXACT] for e in record['evals']):.3f}, {record['iterations']} iterations")


if __name__ == "__main__":
    main()
