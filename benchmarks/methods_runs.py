"""The methods benchmark's runs (``benchmarks/methods.py``): a run's spec and signature, its
result file (written atomically, resumed, locked against a second invocation), and training one
run to its CPU budget with evaluations at the milestones."""
from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from benchmarks.methods_registry import FIELDS_ADDED_SINCE_RESULTS, METHODS
from benchmarks.methods_stats import artifact_value


ACCURACY_KEY = "eval/geneval_toy.exact/family_mean"

# Per-iteration values kept in a run's record (as columns): the trainer's metrics plus ours.
ITERATION_KEYS = ("cpu_seconds", "wall_seconds", "cpu/iteration", "cpu/rollout",
                  "cpu/advantages", "cpu/update", "time/rollout", "time/reward_wait",
                  "time/update", "nfe", "trained_transitions", "train/optimizer_steps",
                  "train/replay_batches", "train/skipped_replay_batches", "reward/total/mean",
                  "train/clip_fraction", "train/first_pass_ratio_max_dev", "train/grad_norm",
                  "lr", "adv/zero_std_fraction")


# ----------------------------------------------------------------------------- files


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a reader, or a crash, never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False, default=_json_default))
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _finite(value: Any) -> Any:
    """JSON has no NaN: non-finite floats become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def run_status(path: Path, signature: dict) -> str:
    """"missing", "partial" (written at an evaluation, not finished: it is rerun from the start)
    or "finished". A finished run whose signature (what it measured under) differs from this
    invocation's is an error, so results of different settings never mix in one table."""
    if not path.is_file():
        return "missing"
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError:
        return "partial"
    if not record.get("finished"):
        return "partial"
    if record.get("signature") != signature:
        theirs, ours = record.get("signature") or {}, signature
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise ValueError(f"{path} was measured with other settings ({', '.join(differ)} differ: "
                         f"{[theirs.get(k) for k in differ]} there, {[ours.get(k) for k in differ]}"
                         f" now): use another --out, or delete the file to measure it again")
    return "finished"


class RunLock:
    """``<run>.lock`` holding the pid of the invocation running that (method, seed), so that two
    invocations sharing an --out do not train the same run. A lock whose process is gone (a
    killed invocation) is taken over."""

    def __init__(self, path: Path):
        self.path = path.with_suffix(".lock")
        self.held = False

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if _alive(self.owner()):
                    return False
                self.path.unlink(missing_ok=True)    # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self.held = True
            return True
        return False

    def owner(self) -> int | None:
        try:
            return int(self.path.read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------- run specs


def merge_methods_json(path: Path, data: dict, same: str,
                       then: Callable[[dict], None] | None = None) -> dict:
    """Write ``data`` to ``path`` with ``data["methods"]`` merged over the file's, when the file
    was measured under the same ``data[same]`` (a budget, a number of iterations); otherwise the
    file is replaced. Under a lock, so two invocations (one per core, --methods halves) of one
    mode build one file; ``then(written)`` runs under the same lock (a table made from it).
    Returns what was written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = RunLock(path)
    while not lock.acquire():
        time.sleep(0.2)
    try:
        merged = dict(data["methods"])
        if path.is_file():
            earlier = json.loads(path.read_text())
            if earlier.get(same) == data[same]:
                merged = {**earlier.get("methods", {}), **merged}
        order = [m for m in METHODS if m in merged] + sorted(set(merged) - set(METHODS))
        data = {**data, "methods": {m: merged[m] for m in order}}
        write_json(path, data)
        if then is not None:
            then(data)
        return data
    finally:
        lock.release()


@dataclass(frozen=True)
class RunSpec:
    """One training run: a method's config at a training seed, for a CPU budget.

    key: the result file's stem (``flow_grpo_s0``; tuning: ``flow_grpo_lr2e-04_n0.7``).
    overrides: dotted config overrides after the benchmark's common ones (tuning's lr and noise,
    ``--set``, quick mode's). eval_seed: the evaluation noise (``prompts.eval_seed``).
    max_iterations: replaces the config's run.max_iterations when set (tuning's scaled schedule).
    """

    method: str
    seed: int
    key: str
    budget: float
    eval_interval: float
    eval_seed: int
    overrides: tuple[str, ...] = ()
    max_iterations: int | None = None

    @classmethod
    def of_record(cls, record: dict, extra: tuple[str, ...] = ()) -> "RunSpec":
        """The spec a finished record's signature describes, with ``extra`` overrides appended."""
        sig = record["signature"]
        return cls(sig["method"], sig["seed"], record["key"], sig["budget"], sig["eval_interval"],
                   sig["eval_seed"], tuple(sig["overrides"]) + extra, sig["max_iterations"])

    def common_overrides(self, out: Path) -> list[str]:
        return [f"run.seed={self.seed}", f"prompts.eval_seed={self.eval_seed}",
                "run.num_threads=1", "run.tracker=none", "run.progress=false",
                "run.comparison_grid=false", "run.eval_every=0", "run.checkpoint_every=0",
                f"run.output_dir={out / 'trainer_runs'}", f"name={self.key}"]

    def load(self, out: Path):
        from flowgrpo.config import load_config

        extra = [] if self.max_iterations is None else [f"run.max_iterations={self.max_iterations}"]
        return load_config(METHODS[self.method].path,
                           self.common_overrides(out) + list(self.overrides) + extra)

    def signature(self) -> dict:
        """What a finished result was measured under; a rerun must match it to reuse it. The
        config enters as a digest of the resolved config (file, overrides), so an edit that
        changes nothing the run uses (a comment, a value an override replaces) keeps its
        results."""
        from flowgrpo.config import to_dict

        resolved = to_dict(self.load(Path("out")))
        for section, key in (("run", "output_dir"), ("run", "seed")):   # seed: its own entry
            del resolved[section][key]
        for path, inert in FIELDS_ADDED_SINCE_RESULTS.items():
            *parents, key = path
            holder = resolved
            for name in parents:
                holder = holder[name]
            if holder.get(key) == inert:
                del holder[key]
        del resolved["name"]
        digest = hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode())
        return {"method": self.method, "seed": self.seed, "budget": self.budget,
                "eval_interval": self.eval_interval, "eval_seed": self.eval_seed,
                "overrides": list(self.overrides), "max_iterations": self.max_iterations,
                "config": METHODS[self.method].config, "config_digest": digest.hexdigest()[:16]}


SHIFT_INTERVAL = "sampling.plan.shift_interval"      # MixGRPO's window step, in iterations


def scaled_schedule(spec: RunSpec, factor: float, out: Path) -> RunSpec:
    """``spec`` with its config's schedule stretched by ``factor``: run.max_iterations (over
    which the lr decays) times ``factor``, rounded, and for the MixGRPO windows the
    shift_interval likewise, so the window visits the same positions over the run. Used for a
    budget other than the one the configs were calibrated for (tuning at a shorter budget, the
    table at a longer one): every method's schedule then runs its course in the budget, shaped
    as at the calibrated one. The shift_interval override is added only where it changes the
    value, so a factor of 1 leaves the run's overrides (and its recorded signature) as they
    were."""
    config = spec.load(out)
    total = max(1, round(config.run.max_iterations * factor))
    overrides = tuple(spec.overrides)
    if METHODS[spec.method].window_visits:
        interval = config.sampling.plan.shift_interval
        scaled = max(1, round(interval * factor))
        if scaled != interval:
            overrides += (f"{SHIFT_INTERVAL}={scaled}",)
    return replace(spec, overrides=overrides, max_iterations=total)


def schedule_origin(records: list[dict], out: Path) -> tuple[float | None, list[tuple[str, ...]]]:
    """The SECONDS of the ``--schedule-from`` that stretched these finished runs' schedules
    (None when none did: every run kept its config's cap), and each run's overrides without the
    ones the stretch added, for a report to print the command that reproduces them. Found by
    redoing the stretch: a candidate is kept only if ``scaled_schedule`` reproduces every run's
    cap and overrides exactly (records from before the signature named its cap give None)."""
    plain = [tuple(r["signature"].get("overrides", ())) for r in records]
    try:
        specs = [RunSpec.of_record(r) for r in records]
    except KeyError:
        return None, plain
    if not specs or any(spec.method not in METHODS or spec.max_iterations is None
                        for spec in specs):     # None: the run kept its config's cap
        return None, plain
    unscaled = [replace(spec, max_iterations=None, overrides=tuple(
        o for o in spec.overrides if not o.startswith(f"{SHIFT_INTERVAL}="))) for spec in specs]
    caps = [spec.load(out).run.max_iterations for spec in unscaled]
    if all(cap == spec.max_iterations for cap, spec in zip(caps, specs)):
        return None, plain
    candidates = []
    for cap, spec in zip(caps, specs):     # a calibrated budget is a round number of seconds
        exact = spec.budget * cap / spec.max_iterations
        candidates += [c for c in (round(exact, -1), round(exact)) if c > 0 and c not in candidates]
    for seconds in candidates:
        if all((stretched.overrides, stretched.max_iterations)
               == (tuple(spec.overrides), spec.max_iterations)
               for spec, stretched in ((spec, scaled_schedule(base, base.budget / seconds, out))
                                       for spec, base in zip(specs, unscaled))):
            return float(seconds), [spec.overrides for spec in unscaled]
    return None, plain


def eval_signature(config) -> dict:
    """Everything the untrained model's evaluation depends on: runs that agree on it share one
    base evaluation."""
    from flowgrpo.config import eval_noise_seed, to_dict

    data = to_dict(config)
    s = config.sampling
    return {"model": data["model"]["family"], "path": data["model"]["path"],
            "dtype": data["model"]["dtype"], "options": data["model"]["options"],
            "prompts": data["prompts"]["eval"], "num_eval": config.prompts.num_eval,
            "eval_seeds": config.prompts.eval_seeds,
            "eval_per_family": config.prompts.eval_per_family,
            "eval_noise_seed": eval_noise_seed(config), "eval_num_steps": s.eval_num_steps,
            "guidance": s.guidance_scale if s.eval_guidance_scale is None
            else s.eval_guidance_scale,
            "rewards": data["rewards"], "eval": data.get("eval")}


def milestones(budget: float, interval: float) -> list[float]:
    """The CPU seconds at which a run is evaluated: every ``interval`` before the budget, and the
    budget."""
    if not budget > 0 or not interval > 0:
        raise ValueError(f"budget and eval interval must be > 0 (got {budget}, {interval})")
    count = math.ceil(budget / interval - 1e-9)
    marks = [round(k * interval, 6) for k in range(1, count)]
    return marks + [float(budget)]


# ----------------------------------------------------------------------------- one run


def evaluation(trainer, iteration: int) -> dict:
    """The trainer's held-out evaluation (no images written): accuracy, its standard error, the
    artifacts metric when scored, every scalar, and the evaluation's own CPU and wall time."""
    began, began_wall = time.process_time(), time.perf_counter()
    metrics = trainer.evaluate(iteration, save_images=False)
    if ACCURACY_KEY not in metrics:
        raise ValueError(f"the evaluation returned no {ACCURACY_KEY}: the config needs the "
                         f"geneval_toy reward (score: exact) and held-out prompts with families")
    from flowgrpo.prompts import eval_selection

    p = trainer.config.prompts
    artifacts = artifact_value(metrics)
    return {"accuracy": metrics[ACCURACY_KEY], "accuracy_se": metrics.get(ACCURACY_KEY + "/se"),
            "samples": len(eval_selection(trainer.eval_records, p.eval_per_family, p.eval_seeds)),
            "artifacts": artifacts[1] if artifacts else None,
            "artifacts_key": artifacts[0] if artifacts else None,
            "eval_cpu_seconds": time.process_time() - began,
            "eval_wall_seconds": time.perf_counter() - began_wall,
            "metrics": {k: _finite(v) for k, v in metrics.items()
                        if isinstance(v, (int, float))}}


class PhaseClock:
    """Process CPU seconds of the trainer's phases within an iteration, by wrapping its
    rollout (rewards included: they are scored in a thread of this process), advantages and
    update methods on the instance."""

    PHASES = {"rollout_and_score": "cpu/rollout", "compute_advantages": "cpu/advantages",
              "update": "cpu/update"}

    def __init__(self, trainer):
        self.seconds: dict[str, float] = {}
        for attribute, key in self.PHASES.items():
            setattr(trainer, attribute, self._timed(getattr(trainer, attribute), key))

    def _timed(self, function: Callable, key: str) -> Callable:
        def timed(*args, **kwargs):
            began = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.process_time() - began
        return timed

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def base_evaluation(config, trainer, out: Path) -> dict:
    """The untrained model's evaluation for this evaluation setting: from ``<out>/base/`` when an
    earlier run measured it, else measured now with ``trainer`` (before it trains) and stored."""
    signature = eval_signature(config)
    digest = hashlib.sha256(json.dumps(signature, sort_keys=True, default=str).encode()
                            ).hexdigest()[:12]
    path = out / "base" / f"{digest}.json"
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("signature") == json.loads(json.dumps(signature, default=str)):
            return stored["evaluation"]
    result = evaluation(trainer, 0)
    write_json(path, {"signature": signature, "evaluation": result,
                      "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    return result


def _columns(rows: list[dict]) -> dict[str, list]:
    return {k: [_finite(r.get(k)) for r in rows] for k in ITERATION_KEYS}


def train_run(spec: RunSpec, out: Path, log: Callable[[str], None] = print) -> dict:
    """Train one run to its budget (or its config's run.max_iterations), evaluating at the
    milestones; writes ``<out>/runs/<key>.json`` at every evaluation and at the end."""
    from flowgrpo.config import to_dict
    from flowgrpo.trainer import Trainer

    config = spec.load(out)
    path = out / "runs" / f"{spec.key}.json"
    began_wall = time.perf_counter()
    trainer = Trainer(config)
    base = base_evaluation(config, trainer, out)
    phases = PhaseClock(trainer)
    marks = milestones(spec.budget, spec.eval_interval)
    record = {"method": spec.method, "label": METHODS[spec.method].label, "seed": spec.seed,
              "key": spec.key, "signature": spec.signature(), "finished": False,
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host_cpus": os.cpu_count(),
              "torch_threads": torch_threads(), "load_average_start": load_average(),
              "max_iterations": config.run.max_iterations, "config": to_dict(config),
              "base": {k: v for k, v in base.items() if k != "metrics"},
              "evals": [{"iteration": 0, "cpu_seconds": 0.0, "wall_seconds": 0.0, "marks": [0.0],
                         **base}],
              "iterations": {}}
    rows: list[dict] = []
    trained = trained_wall = 0.0
    iteration, pending = 0, list(marks)
    stopped_by = None
    while stopped_by is None:
        tick, tick_wall = time.process_time(), time.perf_counter()
        metrics = trainer.run_iteration(iteration)
        cpu = time.process_time() - tick
        trained += cpu
        trained_wall += time.perf_counter() - tick_wall
        iteration += 1
        rows.append({**metrics, **phases.take(), "cpu/iteration": cpu, "cpu_seconds": trained,
                     "wall_seconds": trained_wall})
        if trained >= spec.budget:
            stopped_by = "budget"
        elif iteration >= config.run.max_iterations:
            stopped_by = "max_iterations"
        served = [m for m in pending if m <= trained + 1e-9]
        if stopped_by is not None:
            served = list(pending)     # the final model serves every milestone left
        if iteration % 10 == 0 and not served:
            log(f"  {spec.key} it {iteration:4d}  {trained:7.1f} cpu-s  reward "
                f"{metrics.get('reward/total/mean', float('nan')):.3f}")
        if served:
            pending = [m for m in pending if m not in served]
            result = evaluation(trainer, iteration)
            record["evals"].append({"iteration": iteration, "cpu_seconds": trained,
                                    "wall_seconds": trained_wall, "marks": served, **result})
            record["iterations"] = _columns(rows)
            log(f"  {spec.key} it {iteration:4d}  {trained:7.1f} cpu-s  accuracy "
                f"{result['accuracy']:.3f} (base {base['accuracy']:.3f})"
                + (f"  artifacts {result['artifacts']:.4f}" if result["artifacts"] is not None
                   else ""))
            if stopped_by is None:
                write_json(path, record)        # partial progress
    record.update(finished=True, stopped_by=stopped_by, iterations_done=iteration,
                  cpu_seconds=trained, wall_seconds_training=trained_wall,
                  wall_seconds_total=time.perf_counter() - began_wall,
                  load_average_end=load_average(),
                  finished_at=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    write_json(path, record)
    del trainer
    gc.collect()
    return record


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def run_specs(specs: Iterable[RunSpec], out: Path, log: Callable[[str], None] = print
              ) -> list[str]:
    """Train the specs that are not finished yet, skipping those another invocation holds.
    Returns the keys trained now."""
    specs = list(specs)
    for spec in specs:    # every config and finished file is checked before anything trains
        spec.load(out)
        run_status(out / "runs" / f"{spec.key}.json", spec.signature())
    trained = []
    for spec in specs:
        path = out / "runs" / f"{spec.key}.json"
        status = run_status(path, spec.signature())
        if status == "finished":
            log(f"== {spec.key}: finished earlier, skipped")
            continue
        lock = RunLock(path)
        if not lock.acquire():
            log(f"== {spec.key}: running in process {lock.owner()}, skipped")
            continue
        try:
            doing = "restarting an unfinished run" if status == "partial" else "training"
            log(f"== {spec.key}: {doing}")
            train_run(spec, out, log)
            trained.append(spec.key)
        finally:
            lock.release()
    return trained
