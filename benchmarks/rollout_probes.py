"""Two probes of a method's rollouts from the untrained base, on the training prompts (never the
held-out ones), with no update in between: what a config would learn from before it learns.

    python benchmarks/rollout_probes.py steps --config configs/toy_methods/tempflow_grpo.yaml \\
        --iterations 30 --out benchmarks/results/probes/tempflow_steps.json
    python benchmarks/rollout_probes.py guidance --config configs/toy_geneval.yaml \\
        --set "sampling.reward_guidance={reward: toy_proxy, normalize: true, first_step: 0}" \\
        --scales 0,1,3,10,30 --iterations 4 \\
        --out benchmarks/results/probes/guidance_default_window.json

``steps``: the learning signal by the step a group trains first. Each group's rewards go through
the trainer's own group statistics (``methods_signal.group_signal``): ``no_signal`` is the share
of groups whose rewards all agree (their advantages are zero: with
``training.skip_zero_std_groups`` they are skipped and train nothing), ``within_std`` the mean
within-group std. For a plan that trains one step a group (TempFlow-GRPO's branching, Flash-GRPO)
it says which branch steps can teach anything; for a window plan, which window starts.

``guidance``: the rollout rewards of ``sampling.reward_guidance`` at several scales, each from
the same noise and prompts (training seed ``--seed``, iterations 0 to ``--iterations`` - 1):
whether steering the stochastic steps along the guidance reward's gradient raises the training
reward or hacks the guidance reward at its expense. The rollout's reward components (e.g. the exact verdict and the
partial credit) are reported as the trainer logs them.

One torch thread (``torch.set_num_threads(1)``); prints a line per row and writes ``--out``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _CHECKOUT)

from benchmarks.methods_signal import group_signal  # noqa: E402
from flowgrpo.config import load_config  # noqa: E402

QUIET = ("run.eval_every=0", "run.checkpoint_every=0", "run.num_threads=1", "run.tracker=none",
         "run.progress=false", "run.comparison_grid=false")


def first_trained_steps(batch) -> torch.Tensor:
    """(B,) the first step each row trains (its replay batches' steps), -1 for a row none trains."""
    first = torch.full((len(batch.group_ids),), -1, dtype=torch.long)
    for replay in batch.replay:
        rows = replay.rows.long().cpu()
        current = first[rows]
        first[rows] = torch.where((current < 0) | (current > replay.step),
                                  torch.full_like(current, replay.step), current)
    return first


def steps_by_group(rewards: list[float], group_ids: list[int], first: list[int]
                   ) -> dict[int, list[dict]]:
    """``group_signal`` of each group, keyed by the first step its rows train (the smallest over
    its rows: a group of a one-step or window plan shares it)."""
    members: dict[int, list[int]] = collections.defaultdict(list)
    for row, group in enumerate(group_ids):
        members[group].append(row)
    out: dict[int, list[dict]] = collections.defaultdict(list)
    for rows in members.values():
        trained = [first[r] for r in rows if first[r] >= 0]
        step = min(trained) if trained else -1
        out[step].append(group_signal([rewards[r] for r in rows], [0] * len(rows)))
    return out


def probe_steps(config_path: str, iterations: int, seed: int, overrides: list[str]) -> dict:
    from flowgrpo.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(config_path, [*QUIET, f"run.output_dir={tmp}", f"run.seed={seed}",
                                           *overrides])
        trainer = Trainer(config)
        by_step: dict[int, list[dict]] = collections.defaultdict(list)
        for iteration in range(iterations):
            batch, rewards, _ = trainer.rollout_and_score(iteration)
            found = steps_by_group(rewards["total"].tolist(), batch.group_ids.tolist(),
                                   first_trained_steps(batch).tolist())
            for step, rows in found.items():
                by_step[step].extend(rows)
    rows = []
    for step in sorted(by_step):
        groups = by_step[step]
        rows.append({"step": step, "groups": len(groups),
                     "no_signal": sum(g["no_signal"] for g in groups) / len(groups),
                     "within_std": sum(g["within_std"] for g in groups) / len(groups),
                     "mean": sum(g["mean"] for g in groups) / len(groups)})
        print(f"step {step:2d}: {len(groups):3d} groups, no signal {rows[-1]['no_signal']:.2f}, "
              f"within-group std {rows[-1]['within_std']:.3f}", flush=True)
    return {"probe": "steps", "config": config_path, "iterations": iterations, "seed": seed,
            "overrides": overrides, "rows": rows}


def probe_guidance(config_path: str, scales: list[float], iterations: int, seed: int,
                   overrides: list[str]) -> dict:
    from flowgrpo.trainer import Trainer

    rows = []
    for scale in scales:
        with tempfile.TemporaryDirectory() as tmp:
            # the scale last: an override of the whole reward_guidance section would reset it
            config = load_config(config_path, [*QUIET, f"run.output_dir={tmp}",
                                               f"run.seed={seed}", *overrides,
                                               f"sampling.reward_guidance.scale={scale}"])
            if not config.sampling.reward_guidance.enabled:
                raise SystemExit(f"{config_path}: sampling.reward_guidance.reward is empty; "
                                 f"name the guidance reward (e.g. toy_proxy)")
            trainer = Trainer(config)
            scored: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
            for iteration in range(iterations):
                _, rewards, _ = trainer.rollout_and_score(iteration)
                for name, values in rewards.items():
                    if torch.is_tensor(values) and values.dim() == 1:
                        scored[name].append(values.float())
            row = {"scale": scale, "samples": int(sum(v.numel() for v in scored["total"]))}
            row.update({name: float(torch.cat(values).nanmean())
                        for name, values in scored.items()})
            rows.append(row)
            print(f"scale {scale:g}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()
                                                    if k not in ("scale", "samples")), flush=True)
    return {"probe": "guidance", "config": config_path, "iterations": iterations, "seed": seed,
            "overrides": overrides, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probe", choices=("steps", "guidance"))
    parser.add_argument("--config", required=True, help="a training config (YAML)")
    parser.add_argument("--iterations", type=int, default=30,
                        help="rollout iterations (default 30; the same prompts and noise for "
                             "every guidance scale)")
    parser.add_argument("--scales", default="0,1,3,10,30",
                        help="guidance: comma-separated sampling.reward_guidance.scale values")
    parser.add_argument("--seed", type=int, default=0, help="training seed (run.seed)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error("--iterations must be >= 1")
    torch.set_num_threads(1)
    start = time.process_time()
    if args.probe == "steps":
        result = probe_steps(args.config, args.iterations, args.seed, args.set)
    else:
        try:
            scales = [float(s) for s in args.scales.split(",") if s.strip()]
        except ValueError:
            parser.error(f"--scales: {args.scales!r} is not a comma-separated list of numbers")
        result = probe_guidance(args.config, scales, args.iterations, args.seed, args.set)
    result["cpu_seconds"] = round(time.process_time() - start, 1)
    result["measured"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
