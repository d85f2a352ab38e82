"""The methods benchmark's tuning (``benchmarks/methods.py --tune``): the lr x noise grid on one
training seed, and the choice of each method's point."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from benchmarks.methods_registry import METHODS, TUNE_EVAL_SEED, TUNE_SEED, Method, parse_list
from benchmarks.methods_report import fmt
from benchmarks.methods_runs import RunSpec, run_status, write_json


@dataclass
class TuneSettings:
    lrs: list[float]
    noise: dict[str, tuple[float, ...]]
    budget: float
    seed: int = TUNE_SEED
    eval_seed: int = TUNE_EVAL_SEED
    eval_per_family: int = 96
    schedule: str = "scaled"        # scaled: max_iterations x budget / table budget; config: as is
    table_budget: float = 600.0
    tie_tolerance: float = 0.0


def tune_specs(methods: list[Method], settings: TuneSettings, out: Path,
               extra: Sequence[str] = ()) -> list[RunSpec]:
    """One spec per (method, lr, noise level). Schedule "scaled": run.max_iterations is the
    config's times tuning budget / table budget, so the lr schedule runs its whole course within
    the tuning budget, shaped as in the table's run; "config": the config's own, cut short by the
    tuning budget."""
    specs = []
    for method in methods:
        for lr in settings.lrs:
            for noise in settings.noise.get(method.name, method.noise_levels):
                overrides = (f"training.lr={lr!r}", f"sampling.noise_level={noise!r}",
                             f"prompts.eval_per_family={settings.eval_per_family}", *extra)
                spec = RunSpec(method.name, settings.seed, f"{method.name}_lr{lr:.0e}_n{noise:g}",
                               settings.budget, settings.budget, settings.eval_seed, overrides)
                if settings.schedule == "scaled":
                    total = spec.load(out).run.max_iterations
                    spec = RunSpec(**{**asdict(spec), "max_iterations": max(
                        1, round(total * settings.budget / settings.table_budget))})
                specs.append(spec)
    return specs


def choose(points: list[dict], tolerance: float = 0.0) -> dict:
    """The chosen point of one method: the best accuracy at the tuning budget; points within
    ``tolerance`` of it tie, and a tie goes to the lower lr, then to the noise level listed first
    (the anchor's)."""
    if not points:
        raise ValueError("choose needs at least one point")
    best = max(p["accuracy"] for p in points)
    tied = [p for p in points if p["accuracy"] >= best - tolerance - 1e-12]
    return min(tied, key=lambda p: (p["lr"], p["noise_rank"]))


def tune_report(out: Path, methods: list[Method], settings: TuneSettings, specs: list[RunSpec],
                log: Callable[[str], None] = print) -> dict:
    """tuning.json and tuning.md from the finished tuning runs."""
    points: dict[str, list[dict]] = {}
    for spec in specs:
        path = out / "runs" / f"{spec.key}.json"
        if run_status(path, spec.signature()) != "finished":
            continue
        record = json.loads(path.read_text())
        config = record["config"]
        noise = config["sampling"]["noise_level"]
        levels = list(settings.noise.get(spec.method, METHODS[spec.method].noise_levels))
        final = record["evals"][-1]
        points.setdefault(spec.method, []).append({
            "key": spec.key, "lr": config["training"]["lr"], "noise_level": noise,
            "noise_rank": levels.index(noise) if noise in levels else len(levels),
            "accuracy": final["accuracy"], "accuracy_se": final.get("accuracy_se"),
            "gain": final["accuracy"] - record["base"]["accuracy"],
            "artifacts": final.get("artifacts"), "iterations": record["iterations_done"],
            "max_iterations": record["max_iterations"], "stopped_by": record["stopped_by"]})
    chosen = {name: choose(p, settings.tie_tolerance) for name, p in points.items()}
    data = {"generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "settings": asdict(settings),
            "points": points, "chosen": chosen,
            "missing": [s.key for s in specs if s.method not in points or s.key not in
                        {p["key"] for p in points[s.method]}]}
    write_json(out / "tuning.json", data)
    lines = [f"Tuning, {time.strftime('%Y-%m-%d')}: {settings.budget:g} training CPU seconds per "
             f"point (one thread), training seed {settings.seed}, evaluation noise seed "
             f"{settings.eval_seed} ({settings.eval_per_family * 6} held-out samples), schedule "
             f"{settings.schedule}; chosen = best accuracy, ties (within "
             f"{settings.tie_tolerance:g}) to the lower lr, then the anchor's noise level.", "",
             "| method | lr | noise | accuracy (se) | gain | iterations | chosen |",
             "|---|---:|---:|---:|---:|---:|:---:|"]
    for method in methods:
        for p in sorted(points.get(method.name, []), key=lambda p: (p["lr"], p["noise_rank"])):
            lines.append(f"| {method.label} | {p['lr']:.0e} | {p['noise_level']:g} | "
                         f"{p['accuracy']:.3f} ({fmt(p['accuracy_se'], '.3f')}) | "
                         f"{p['gain']:+.3f} | {p['iterations']} | "
                         f"{'**yes**' if chosen[method.name]['key'] == p['key'] else ''} |")
    if data["missing"]:
        lines += ["", f"Not finished: {', '.join(data['missing'])}"]
    (out / "tuning.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return data


def parse_noise(items: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """``["dance_grpo=0.3,1.0"]`` -> {"dance_grpo": (0.3, 1.0)}."""
    noise = {}
    for item in items:
        name, _, values = item.partition("=")
        if name not in METHODS or not values:
            raise ValueError(f"--tune-noise {item!r}: give METHOD=V1,V2 with METHOD one of "
                             f"{', '.join(METHODS)}")
        noise[name] = tuple(parse_list(values, float, "--tune-noise"))
    return noise
