"""Method benchmark on the toy world: held-out GenEval-style accuracy per second of training.

    python benchmarks/methods.py [--budget 120] [--methods flow_grpo,mix_grpo] [--model assets/toy]
                                 [--out benchmarks/results/methods] [--quick] [--clock wall|cpu]

Every method starts from the same pretrained toy model, with the same seed, prompts and base
config (``configs/toy_geneval.yaml``); only the overrides of ``METHODS`` differ. Each method
trains with the real ``Trainer`` until its training time reaches ``--budget`` seconds (the loop
is "while elapsed < budget: run_iteration", so the last iteration may overshoot; the table shows
the seconds actually trained). Every ``--eval-interval`` seconds of training (default budget / 4)
and at the end, it evaluates on the held-out prompts with the deterministic sampler; evaluation
time is not counted. The score is the exact (0/1) verifier accuracy averaged over task families
(``eval/geneval_toy.exact/family_mean``, GenEval's overall). The base model is evaluated once:
the evaluation does not depend on the method.

The base config is read once at start (a snapshot saved in the JSON), so every method trains on
the same settings even if the file changes during the run. Methods use the papers' transitions:
the Flow-GRPO SDE with a = 0.7 everywhere except DanceGRPO (its SDE, eta = 0.3); ``--set
KEY=VALUE`` overrides apply after the methods' own, to every method (e.g. ``--set
sampling.noise_level=0.4``). Plan ranges (Fast's branch start, Flash-GRPO's step) are the first
half of the trajectory, so they follow ``sampling.num_steps``.

Outputs in ``--out``: ``methods.json`` (every iteration's metrics and every evaluation),
``accuracy_vs_seconds.png`` and ``table.md`` (the printed table).

Clock: ``wall`` (default) is ``time.perf_counter``; ``cpu`` is the process CPU time
(``time.process_time``, all threads), which is what a wall clock would read on an otherwise idle
single core and is less distorted on a shared machine. Per-phase seconds in the table are always
the trainer's wall-clock ``time/*`` metrics. Rewards are scored in a thread while the rollout
continues, so "reward" is the time spent waiting for them after the rollout, and
rollout + reward + update (+ advantages) is the iteration.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

if importlib.util.find_spec("flowgrpo") is None:   # run from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flowgrpo.config import load_config  # noqa: E402

ACCURACY_KEY = "eval/geneval_toy.exact/family_mean"
BASE_CONFIG = "configs/toy_geneval.yaml"
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class Method:
    """One method: a label for the table and the dotted config overrides that make it."""

    name: str
    label: str
    overrides: tuple[str, ...]
    note: str = ""


FLOW_SDE = ("sampling.kind=flow_sde", "sampling.noise_level=0.7")
# Flow-GRPO trains the first int(N * 0.99) steps: every SDE step (all but the last of N).
FULL_PLAN = "sampling.plan={kind: full, train_fraction: 0.99}"
# MixGRPO's window (4 of 25 steps, moving every 25 iterations) scaled to the toy's 10-16 steps
# and to the tens of iterations a toy budget allows: 3 steps, moving every 4 iterations.
MIX_WINDOW = ("kind: window, window_size: 3, window_strategy: progressive, window_stride: 1, "
              "shift_interval: 4")

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("flow_grpo", "Flow-GRPO", FLOW_SDE + (FULL_PLAN,),
           "full SDE (a = 0.7), every SDE step trained"),
    Method("dance_grpo", "DanceGRPO", (
        "sampling.kind=dance_sde", "sampling.noise_level=0.3",
        "sampling.plan={kind: full, train_fraction: 0.6, train_select: random}"),
           "DanceGRPO SDE (eta = 0.3, its FLUX value), random 60% of steps per group"),
    Method("mix_grpo", "MixGRPO", FLOW_SDE + (f"sampling.plan={{{MIX_WINDOW}}}",),
           "progressive window of 3 SDE steps, Euler elsewhere"),
    Method("mix_grpo_flash", "MixGRPO-Flash", FLOW_SDE + (
        f"sampling.plan={{{MIX_WINDOW}, solver_after: dpmpp_2m, compress_ratio: 0.4}}",),
           "window + DPM-Solver++(2M) on a 0.4x re-discretised tail"),
    Method("flow_grpo_fast", "Flow-GRPO-Fast", FLOW_SDE + (
        "sampling.plan={kind: branch, window_size: 2, branch_range: null}",),
           "branch of 2 SDE steps starting in [0, N/2), ODE prefix shared per prompt"),
    Method("flash_grpo", "Flash-GRPO", FLOW_SDE + (
        "sampling.plan={kind: one_step, one_step_range: null}", "training.rectification=true"),
           "one SDE step k ~ U[0, N/2) per group (iso-temporal), temporal rectification"),
    Method("flow_grpo_guard", "Flow-GRPO+Guard", FLOW_SDE + (
        FULL_PLAN, "training.ratio_norm=true", "training.dt_reweight=true"),
           "Flow-GRPO + GRPO-Guard RatioNorm and 1/dt gradient reweighting"),
)}

# CI-sized runs: a smaller batch, two iterations, a tiny evaluation.
QUICK_OVERRIDES = ("training.prompts_per_iteration=2", "training.group_size=4",
                   "prompts.eval_per_family=2", "sampling.eval_num_steps=8")


@dataclass
class BenchSettings:
    """What every method shares in one benchmark run."""

    model: str
    out: Path
    budget: float                       # seconds of training per method (clock below)
    eval_interval: float                # seconds of training between evaluations
    eval_every: int = 0                 # evaluate every K iterations instead (0 = by seconds)
    max_iterations: int = 0             # stop after this many iterations too (0 = no cap)
    clock: str = "wall"
    seed: int = 0
    target_delta: float = 0.05          # the target accuracy is base + target_delta
    config: str = BASE_CONFIG
    extra_overrides: tuple[str, ...] = field(default_factory=tuple)
    base_data: dict | None = None       # the base config's YAML, read once so that every method
                                        # trains on the same snapshot even if the file changes

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)} (got {self.clock!r})")
        if self.budget <= 0 and self.max_iterations <= 0:
            raise ValueError(f"budget must be > 0 seconds (got {self.budget}), or set "
                             f"max_iterations")
        if self.eval_interval <= 0 and self.eval_every <= 0:
            raise ValueError(f"eval_interval must be > 0 seconds (got {self.eval_interval}), or "
                             f"set eval_every")

    def overrides(self, method: Method) -> list[str]:
        """The dotted overrides of ``method``: shared ones, the method's, then ``--set`` ones
        (last, so that ``--set`` changes every method)."""
        common = [f"model.path={self.model}", f"run.seed={self.seed}", "run.num_threads=1",
                  "run.tracker=none", "run.progress=false", "run.comparison_grid=false",
                  f"run.output_dir={self.out / 'runs'}", f"name={method.name}"]
        return common + list(method.overrides) + list(self.extra_overrides)

    def load(self, method: Method):
        """The validated TrainConfig of ``method``."""
        if self.base_data is not None:
            # load_config may edit the nested dicts it is given: hand it a copy every time.
            return load_config(None, self.overrides(method), data=copy.deepcopy(self.base_data))
        return load_config(self.config, self.overrides(method))


# ----------------------------------------------------------------------------- the runs


def _scalars(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def evaluate(trainer, iteration: int) -> dict:
    """The trainer's held-out evaluation (no images written), with its wall time."""
    began = time.perf_counter()
    metrics = trainer.evaluate(iteration, save_images=False)
    if ACCURACY_KEY not in metrics:
        raise ValueError(f"the evaluation returned no {ACCURACY_KEY}: the config needs the "
                         f"geneval_toy reward and held-out prompts with task families")
    return {**_scalars(metrics), "accuracy": metrics[ACCURACY_KEY],
            "eval_wall_seconds": time.perf_counter() - began}


def run_method(method: Method, settings: BenchSettings, base_eval: dict | None) -> dict:
    """Train ``method`` for the budget; returns its record (iterations and evaluations).

    ``base_eval``: the untrained model's evaluation, reused when given (it is the same for every
    method); evaluated here when None.
    """
    from flowgrpo.config import to_dict
    from flowgrpo.trainer import Trainer

    overrides = settings.overrides(method)
    config = settings.load(method)
    trainer = Trainer(config)
    clock = CLOCKS[settings.clock]
    base = base_eval if base_eval is not None else evaluate(trainer, 0)
    evals = [{"iteration": 0, "seconds": 0.0, "wall_seconds": 0.0, **base}]
    iterations: list[dict] = []
    trained = trained_wall = 0.0   # training seconds in the budget clock, and in wall time
    next_eval = settings.eval_interval
    iteration = 0
    while not (settings.budget > 0 and trained >= settings.budget) and \
            not (settings.max_iterations and iteration >= settings.max_iterations):
        began, began_wall = clock(), time.perf_counter()
        metrics = trainer.run_iteration(iteration)
        trained += clock() - began
        trained_wall += time.perf_counter() - began_wall
        iteration += 1
        iterations.append({"iteration": iteration, "seconds": trained,
                           "wall_seconds": trained_wall, **_scalars(metrics)})
        print(f"  {method.name} it {iteration:3d}  {trained:7.1f} s  reward "
              f"{metrics.get('reward/total/mean', float('nan')):.3f}", flush=True)
        finished = trained >= settings.budget > 0 or iteration == settings.max_iterations
        due = (settings.eval_every and iteration % settings.eval_every == 0) or \
            (not settings.eval_every and trained >= next_eval)
        if due or finished:
            evals.append({"iteration": iteration, "seconds": trained, "wall_seconds": trained_wall,
                          **evaluate(trainer, iteration)})
            print(f"  {method.name} eval at {trained:.1f} s: accuracy "
                  f"{evals[-1]['accuracy']:.3f}", flush=True)
            while settings.eval_interval > 0 and next_eval <= trained:
                next_eval += settings.eval_interval
    return {"label": method.label, "note": method.note, "overrides": overrides,
            "config": to_dict(config), "iterations": iterations, "evals": evals}


# ----------------------------------------------------------------------------- table and plot


@dataclass
class Row:
    """One line of the table (seconds in the benchmark's clock; per-iteration phases wall)."""

    method: str
    accuracy: float              # held-out exact accuracy (family mean) at the budget
    gain: float                  # accuracy - base accuracy
    seconds_to_target: float | None
    iterations: int
    trained_seconds: float
    nfe: float                   # rollout transformer calls per sample per iteration
    trained_transitions: float   # trained (sample, step) pairs per iteration
    seconds_per_iteration: float
    rollout: float
    reward: float
    update: float


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(records: dict, target_delta: float) -> tuple[list[Row], float, float]:
    """Rows of the table from the records (``{"base": eval, "methods": {name: record}}``).

    Returns (rows, base accuracy, target accuracy = base + target_delta). The time to target is
    the training seconds of the first evaluation at or above the target (None if none is).
    """
    base = records["base"]["accuracy"]
    target = base + target_delta
    rows = []
    for name, record in records["methods"].items():
        evals, its = record["evals"], record["iterations"]
        if not evals:
            raise ValueError(f"records['methods'][{name!r}] has no evaluations")
        reached = [e["seconds"] for e in evals if e["accuracy"] >= target - 1e-9]
        final = evals[-1]

        def per_iteration(key: str) -> float:
            return _mean([float(i[key]) for i in its if key in i])

        rows.append(Row(
            method=record.get("label", name), accuracy=final["accuracy"],
            gain=final["accuracy"] - base, seconds_to_target=reached[0] if reached else None,
            iterations=len(its), trained_seconds=its[-1]["seconds"] if its else 0.0,
            nfe=per_iteration("nfe"), trained_transitions=per_iteration("trained_transitions"),
            seconds_per_iteration=(its[-1]["seconds"] / len(its)) if its else float("nan"),
            rollout=per_iteration("time/rollout"), reward=per_iteration("time/reward_wait"),
            update=per_iteration("time/update")))
    return rows, base, target


def format_table(rows: list[Row], base: float, target: float) -> str:
    """A Markdown table of the rows, headed by the base and target accuracies."""
    head = ("| method | acc@budget | gain | s to target | iters | train s | NFE/it | "
            "trained/it | s/it | rollout | reward | update |")
    columns = head.count("|") - 1
    lines = [f"base accuracy {base:.3f}, target {target:.3f}", "", head,
             "|" + "|".join(["---"] + ["---:"] * (columns - 1)) + "|"]
    for r in rows:
        to_target = "-" if r.seconds_to_target is None else f"{r.seconds_to_target:.0f}"
        lines.append(
            f"| {r.method} | {r.accuracy:.3f} | {r.gain:+.3f} | {to_target} | {r.iterations} | "
            f"{r.trained_seconds:.0f} | {r.nfe:.1f} | {r.trained_transitions:.0f} | "
            f"{r.seconds_per_iteration:.1f} | {r.rollout:.1f} | {r.reward:.2f} | {r.update:.1f} |")
    return "\n".join(lines)


def accuracy_label(records: dict) -> str:
    """What the accuracy measures: a run that evaluates on its training prompts (the one-prompt
    run) measures learning speed, not generalisation to held-out prompts."""
    prompts = [r.get("config", {}).get("prompts", {}) for r in records["methods"].values()]
    if prompts and all(p.get("eval") == p.get("train") for p in prompts):
        return "exact accuracy on the trained prompts (family mean)"
    return "held-out exact accuracy (family mean)"


def plot_accuracy(records: dict, path: Path, target: float | None = None) -> Path:
    """Accuracy (family mean) against training seconds, one line per method; PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, record in records["methods"].items():
        seconds = [e["seconds"] for e in record["evals"]]
        accuracy = [e["accuracy"] for e in record["evals"]]
        axes.plot(seconds, accuracy, marker="o", label=record.get("label", name))
    axes.axhline(records["base"]["accuracy"], color="grey", linewidth=0.8, label="base")
    if target is not None:
        axes.axhline(target, color="grey", linestyle="--", linewidth=0.8, label="target")
    settings = records.get("settings", {})
    axes.set_xlabel(f"training seconds ({settings.get('clock', 'wall')} clock, eval excluded)")
    axes.set_ylabel(accuracy_label(records))
    axes.set_title("toy GenEval: accuracy vs training time")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


# ----------------------------------------------------------------------------- main


def parse_methods(text: str) -> list[Method]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise ValueError(f"--methods: unknown method {unknown[0] if unknown else '(none)'}; "
                         f"choose from {', '.join(METHODS)}")
    return [METHODS[n] for n in names]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=120.0,
                        help="training seconds per method (default 120)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--model", default="assets/toy", help="pretrained toy model folder")
    parser.add_argument("--out", default="benchmarks/results/methods", help="output folder")
    parser.add_argument("--config", default=BASE_CONFIG, help="base config of every method")
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized: 2 iterations per method, small batch, tiny evaluation")
    parser.add_argument("--eval-interval", type=float, default=0.0,
                        help="training seconds between evaluations (default budget / 4)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate every K iterations instead of by seconds")
    parser.add_argument("--max-iterations", type=int, default=0, help="iteration cap (0 = none)")
    parser.add_argument("--target-delta", type=float, default=0.05,
                        help="target accuracy = base + this (default 0.05, i.e. 5 points)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="budget clock: wall (perf_counter) or cpu (process CPU time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra dotted config override for every method (repeatable)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not Path(args.model, "transformer").is_dir():
        raise SystemExit(f"--model {args.model} has no transformer/ folder: give a pretrained toy "
                         f"model (assets/toy, or runs/toy_ckpt while it trains)")
    methods = parse_methods(args.methods)
    extra = list(args.set)
    max_iterations = args.max_iterations
    budget = args.budget
    if args.quick:
        extra = list(QUICK_OVERRIDES) + extra
        max_iterations = max_iterations or 2
        budget = 0.0
    settings = BenchSettings(
        model=args.model, out=Path(args.out), budget=budget,
        eval_interval=args.eval_interval or budget / 4, eval_every=args.eval_every or (
            max_iterations if args.quick else 0),
        max_iterations=max_iterations, clock=args.clock, seed=args.seed,
        target_delta=args.target_delta, config=args.config, extra_overrides=tuple(extra),
        base_data=yaml.safe_load(Path(args.config).read_text()))
    settings.out.mkdir(parents=True, exist_ok=True)
    for method in methods:   # every method's config is valid before anything trains
        settings.load(method)

    records: dict = {"settings": {
        "model": settings.model, "budget": settings.budget, "clock": settings.clock,
        "eval_interval": settings.eval_interval, "eval_every": settings.eval_every,
        "max_iterations": settings.max_iterations, "seed": settings.seed,
        "target_delta": settings.target_delta, "config": settings.config,
        "extra_overrides": list(settings.extra_overrides), "quick": args.quick,
        "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "base_config": settings.base_data},
        "base": None, "methods": {}}
    json_path = settings.out / "methods.json"
    for method in methods:
        print(f"== {method.label}: {method.note}", flush=True)
        record = run_method(method, settings, records["base"])
        records["base"] = records["base"] or {k: v for k, v in record["evals"][0].items()
                                              if k not in ("iteration", "seconds", "wall_seconds")}
        print(f"  base accuracy {records['base']['accuracy']:.3f}", flush=True)
        records["methods"][method.name] = record
        json_path.write_text(json.dumps(records, indent=1))   # partial results survive a crash

    rows, base, target = summarize(records, settings.target_delta)
    table = format_table(rows, base, target)
    plot = plot_accuracy(records, settings.out / "accuracy_vs_seconds.png", target)
    (settings.out / "table.md").write_text(table + "\n")
    print(f"\n{table}\n\nclock: {settings.clock}; budget {settings.budget:.0f} s per method; "
          f"records {json_path}; plot {plot}", flush=True)
    return records


if __name__ == "__main__":
    main()
