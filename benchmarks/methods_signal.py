"""The methods benchmark's reward-signal probe (``benchmarks/methods.py --signal``): how much
reward variance each method's rollouts from the untrained base give its groups."""
from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Callable, Sequence

from benchmarks.methods_registry import TABLE_EVAL_SEED, Method
from benchmarks.methods_runs import RunSpec, merge_methods_json
from benchmarks.methods_stats import mean_of


def group_signal(values: Sequence[float], group_ids: Sequence[int]) -> dict:
    """The learning signal in one batch of groups, by the trainer's own group statistics
    (``advantages.group_advantages``, NaN = no score): ``no_signal`` = share of groups that carry
    none (all valid rewards equal, or fewer than 2: zero advantage), ``within_std`` = mean over
    groups of the valid rewards' population std (0 for those), ``mean`` = mean valid reward."""
    import torch

    from flowgrpo.advantages import group_advantages

    if len(values) == 0:
        raise ValueError("group_signal needs at least one reward")
    rewards = torch.tensor(values, dtype=torch.float64)
    groups = torch.tensor(group_ids)
    # scale "none", no clip: the advantages are the rewards minus their group's mean
    centred, stats = group_advantages(rewards, groups, scale="none", clip=None)
    valid = ~rewards.isnan()
    spreads = []
    for group in groups.unique():
        members = (groups == group) & valid
        silent = bool((centred[members] == 0).all())     # group_advantages zeroes silent groups
        spreads.append(0.0 if silent else float(centred[members].double().pow(2).mean().sqrt()))
    return {"no_signal": stats["zero_std_fraction"], "within_std": sum(spreads) / len(spreads),
            "mean": float(rewards[valid].mean()) if bool(valid.any()) else float("nan"),
            "groups": len(spreads)}


def signal_probe(methods: list[Method], iterations: int, out: Path, extra: Sequence[str] = (),
                 log: Callable[[str], None] = print) -> dict:
    """Each method's rollouts from the untrained base (training seed 0, so every method draws the
    same prompts; no update in between): how much reward variance its sampler gives the groups.
    A method whose groups mostly have equal rewards cannot learn whatever its loss; writes
    ``<out>/signal.json`` and ``signal.md``."""
    from flowgrpo.trainer import Trainer

    results: dict[str, dict] = {}
    for method in methods:
        spec = RunSpec(method.name, 0, f"signal_{method.name}", 1.0, 1.0, TABLE_EVAL_SEED,
                       tuple(extra))
        config = spec.load(out)
        trainer = Trainer(config)
        rows = []
        for iteration in range(iterations):
            batch, rewards, _ = trainer.rollout_and_score(iteration)
            rows.append(group_signal(rewards["total"].tolist(), batch.group_ids.tolist()))
        s = config.sampling
        results[method.name] = {
            "label": method.label, "kind": s.kind, "noise_level": s.noise_level,
            "shared_initial_noise": s.share_initial_noise, "plan": s.plan.kind,
            "iterations": iterations, "groups": sum(r["groups"] for r in rows),
            **{k: mean_of([r[k] for r in rows]) for k in ("no_signal", "within_std", "mean")}}
        r = results[method.name]
        log(f"{method.name:20s} rollout reward {r['mean']:.3f}, groups without signal "
            f"{r['no_signal']:.2f}, within-group std {r['within_std']:.3f}")
        del trainer
        gc.collect()
    def write_table(data: dict) -> None:
        lines = [f"Reward signal of each method's rollouts from the untrained base, "
                 f"{time.strftime('%Y-%m-%d')}: {iterations} iterations at training seed 0 (the "
                 f"same prompts for every method), no update; exact reward. No signal = share of "
                 f"groups whose rewards are all equal.", "",
                 "| method | SDE | noise | shared initial noise | plan | groups | rollout reward | "
                 "no signal | within-group std |", "|---|---|---:|:---:|---|---:|---:|---:|---:|"]
        for r in data["methods"].values():
            lines.append(f"| {r['label']} | {r['kind']} | {r['noise_level']:g} | "
                         f"{'yes' if r['shared_initial_noise'] else 'no'} | {r['plan']} | "
                         f"{r['groups']} | {r['mean']:.3f} | {r['no_signal']:.2f} | "
                         f"{r['within_std']:.3f} |")
        (out / "signal.md").write_text("\n".join(lines) + "\n")

    merge_methods_json(out / "signal.json", {"measured": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                             "iterations": iterations, "methods": results},
                       same="iterations", then=write_table)
    return results
