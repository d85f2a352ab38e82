"""The methods benchmark's tuning (``benchmarks/methods.py --tune``): the lr x noise grid on one
training seed, and the choice of each method's point."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from benchmarks.methods_registry import METHODS, TUNE_EVAL_SEED, TUNE_SEED, Method, parse_list
from benchmarks.methods_report import fmt
from benchmarks.methods_runs import RunSpec, run_status, scaled_schedule, write_json


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
    # lrs added below the grid for one method, because its lowest lr won (``extend_downward``)
    extended: dict[str, list[float]] = field(default_factory=dict)
    max_extensions: int = 3

    def lrs_for(self, method: str) -> list[float]:
        """Every method's grid is ``lrs``; a method whose lowest lr won also gets the lrs
        extended below it, so no method is compared at the edge of its grid."""
        return sorted(set(self.lrs) | set(self.extended.get(method, ())))


def tune_specs(methods: list[Method], settings: TuneSettings, out: Path,
               extra: Sequence[str] = ()) -> list[RunSpec]:
    """One spec per (method, lr, noise level). Schedule "scaled": run.max_iterations is the
    config's times tuning budget / table budget, so the lr schedule runs its whole course within
    the tuning budget, shaped as in the table's run; "config": the config's own, cut short by the
    tuning budget."""
    specs = []
    for method in methods:
        for lr in settings.lrs_for(method.name):
            for noise in settings.noise.get(method.name, method.noise_levels):
                overrides = (f"training.lr={lr!r}", f"sampling.noise_level={noise!r}",
                             f"prompts.eval_per_family={settings.eval_per_family}", *extra)
                lr_tag = f"{lr:.0e}" if float(f"{lr:.0e}") == lr else f"{lr:.1e}"   # 2.5e-05
                spec = RunSpec(method.name, settings.seed, f"{method.name}_lr{lr_tag}_n{noise:g}",
                               settings.budget, settings.budget, settings.eval_seed, overrides)
                if settings.schedule == "scaled":
                    spec = scaled_schedule(spec, settings.budget / settings.table_budget, out)
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


def extend_downward(chosen: dict[str, dict], settings: TuneSettings) -> dict[str, float]:
    """The fair grid's rule: a method whose chosen lr is the lowest it was tried at gets the
    next lower point, half of it (the grid's own spacing when it is powers of two), up to
    ``max_extensions`` extensions a method. Returns {method: lr to add}; empty when every
    method's choice is inside its grid, which is when the tuning is done."""
    added = {}
    for name, point in chosen.items():
        lrs = settings.lrs_for(name)
        extensions = len(settings.extended.get(name, ()))
        if point["lr"] <= lrs[0] * (1 + 1e-9) and extensions < settings.max_extensions:
            added[name] = lrs[0] / 2
    return added


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
             f"{settings.tie_tolerance:g}) to the lower lr, then the anchor's noise level. "
             f"Grid: lr {', '.join(f'{lr:.0e}' for lr in sorted(settings.lrs))} for every "
             f"method, halved below its lowest point while that point wins"
             + "".join(f"; {name}: +{', '.join(f'{lr:.1e}' for lr in sorted(lrs))}"
                       for name, lrs in sorted(settings.extended.items()))
             + ".", "",
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
