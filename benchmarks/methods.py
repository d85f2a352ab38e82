"""Which method should I use? Every GRPO method of the toolkit on the toy world at equal CPU time.

Each method is a config a user can run (``configs/toy_methods/<method>.yaml``; the embedded
default is ``configs/toy_geneval.yaml``). This script trains each of them from the same base
weights with the real ``Trainer``, for the same budget of process CPU seconds, on several
training seeds, and ranks them by held-out accuracy::

    python benchmarks/methods.py --calibrate    # CPU s per iteration -> run.max_iterations
    python benchmarks/methods.py --tune         # lr x noise grid, one seed, short budget
    python benchmarks/methods.py --seeds 0,1,2  # the table (resumable)
    python benchmarks/methods.py --report       # table.md, methods.json, the plot
    python benchmarks/methods.py --signal       # reward variance of each method's rollouts
    python benchmarks/methods.py --quick --methods flow_grpo,flash_grpo --out /tmp/quick

What is equal: every run starts from ``assets/toy``; a training seed gives every method the same
prompt order (the default with the curriculum draws by its own weights, by design); one torch
thread per process (``torch.set_num_threads(1)`` before any work); the budget counts the process's
CPU seconds (``time.process_time``, every thread, the reward thread included) spent in training
iterations, so model loading and evaluations are not counted. A run stops at the budget or at its
config's ``run.max_iterations``, whichever comes first (its lr schedule is defined over
``max_iterations``, which ``--calibrate`` sizes to the budget).

Evaluation: the config's own (held-out prompts, 96 samples per family = 576, 16-step Euler ODE),
with the evaluation noise seed fixed (``prompts.eval_seed``) for every method and training seed,
so every run is scored on the same samples; the score is the exact verifier accuracy, mean over
the six families (``eval/geneval_toy.exact/family_mean``). The untrained model is therefore
evaluated once overall (per distinct evaluation setting, cached in ``<out>/base/``), not once
per seed. Each run is evaluated every ``--eval-interval`` CPU seconds of training (after the
first iteration that ends past each mark) and at the budget. When the config has an evaluation
reward ``toy_artifacts`` (the toy's image-quality metric), it is recorded beside the accuracy.

Resuming: each (method, seed) writes ``<out>/runs/<method>_s<seed>.json`` at every evaluation
(``finished: false``) and when it ends (``finished: true``). A rerun skips finished runs and
restarts unfinished ones, so an interruption loses at most the run in progress; a finished run
measured with other settings (budget, interval, config file, overrides) is refused rather than
mixed in. A ``.lock`` file per run lets two invocations with different ``--methods`` (one per core)
share an ``--out``. ``--report`` (run at the end of every invocation too) reads every finished
run in ``<out>/runs``, and sets the papers' speed claims (``CLAIMS``) beside the ratios measured
here.
"""
from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

if importlib.util.find_spec("flowgrpo") is None:   # run from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flowgrpo.config_algorithms import (AWMConfig, DGPOConfig, DPOConfig,  # noqa: E402 (after the path set-up)
                                        GDROConfig, NFTConfig, TimestepsConfig)
from flowgrpo.guided_sde import RewardGuidanceConfig  # noqa: E402

_ALGORITHM_SECTIONS = {"timesteps": TimestepsConfig, "nft": NFTConfig, "awm": AWMConfig,
                       "dgpo": DGPOConfig, "dpo": DPOConfig, "gdro": GDROConfig}

ROOT = Path(__file__).resolve().parents[1]
ACCURACY_KEY = "eval/geneval_toy.exact/family_mean"
DEFAULT_OUT = "benchmarks/results/methods"
TARGET_DELTA = 0.10            # "CPU seconds to +10 points"
# Config fields added after results in benchmarks/results were measured, with the value that
# leaves a run as it was: at that value a field is left out of a run's config digest, so adding
# a field does not invalidate every finished run (a run that sets it differs, as it should).
FIELDS_ADDED_SINCE_RESULTS: dict[tuple[str, ...], object] = {
    ("training", "locality", "edit_weight"): None,
    ("training", "locality", "silent_share"): "keep",
    ("training", "locality", "keep_region"): "rest",
    ("training", "locality", "keep_kl_beta"): 0.0,
    ("training", "locality", "keep_source_beta"): 0.0,
    ("prompts", "balance_weights"): {},
    # training.algorithm and its sections (every earlier result is grpo with their defaults)
    ("training", "algorithm"): "grpo",
    **{("training", name): asdict(section()) for name, section in _ALGORITHM_SECTIONS.items()},
    # the stops of runs that learn nothing, and the signals that save (no earlier run hit them)
    ("training", "max_iterations_without_finite_reward"): 5,
    ("training", "on_constant_reward"): "warn",
    ("training", "constant_reward_iterations"): 5,
    ("run", "save_on_signal"): ["SIGTERM", "SIGUSR1", "SIGINT"],
    ("training", "cfg_gradient"): "both",   # every earlier run backpropagated both CFG branches
    # Euphonium's reward-guided rollouts (flowgrpo/guided_sde.py): every earlier run unguided
    ("sampling", "reward_guidance"): asdict(RewardGuidanceConfig()),
    # E-GRPO's merge plan (sampling.plan.kind: merge); inert for every other kind
    ("sampling", "plan", "merge_at"): [1],
    ("sampling", "plan", "merge_counts"): None,
    # TempFlow-GRPO's cycling branch step (sampling.plan.one_step_select); Flash-GRPO's random
    ("sampling", "plan", "one_step_select"): "random",
}
# A ratio of two held-out gains is reported only when both reach one point: below that the
# ratio is evaluation noise (a baseline at +0.000 once gave a ratio of 2e7).
MIN_GAIN_FOR_RATIO = 0.01
TABLE_EVAL_SEED = 0            # the default config's own evaluation noise (run.seed 0)
TUNE_EVAL_SEED = 1             # tuning is scored on other noise than the table
TUNE_SEED = 100                # tuning's training seed, kept apart from the table's seeds


@dataclass(frozen=True)
class Method:
    """A method of the benchmark: its config and the settings its tuning tries.

    noise_levels: the noise levels the tuning tries, the anchor's value first (the tuning's
    tie-break prefers it); one for the sample-based algorithms, whose ODE rollouts have none. window_visits: for MixGRPO's progressive window, how many positions it
    visits in a run; ``shift_interval = round(max_iterations / window_visits)`` (the config
    header says why). calibrated: whether ``--calibrate --write-configs`` writes the config's
    run.max_iterations (not for the embedded default and its curriculum twin, which keep the
    default's schedule). editable: whether ``--write-configs`` may edit the file at all.
    """

    name: str
    label: str
    config: str
    noise_levels: tuple[float, ...]
    window_visits: int = 0
    calibrated: bool = True
    editable: bool = True

    @property
    def path(self) -> Path:
        return ROOT / self.config


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("default", "Default (Fast, 4-step branch)", "configs/toy_geneval.yaml", (0.7, 1.0),
           calibrated=False, editable=False),
    Method("default_cgpo", "Default + CGPO curriculum", "configs/toy_methods/default_cgpo.yaml",
           (0.7, 1.0), calibrated=False),
    # Pref-GRPO: the default with the group win rate as its reward, on the default's schedule
    Method("pref_grpo", "Pref-GRPO (win rate)", "configs/toy_methods/pref_grpo.yaml", (0.7, 1.0),
           calibrated=False),
    Method("flow_grpo", "Flow-GRPO", "configs/toy_methods/flow_grpo.yaml", (0.7, 0.4)),
    Method("flow_grpo_guard", "Flow-GRPO + GRPO-Guard", "configs/toy_methods/flow_grpo_guard.yaml",
           (0.7, 0.4)),
    Method("dance_grpo", "DanceGRPO", "configs/toy_methods/dance_grpo.yaml", (0.3, 0.7)),
    Method("mix_grpo", "MixGRPO", "configs/toy_methods/mix_grpo.yaml", (0.7, 1.0),
           window_visits=7),
    Method("mix_grpo_flash", "MixGRPO-Flash", "configs/toy_methods/mix_grpo_flash.yaml",
           (0.7, 1.0), window_visits=9),
    Method("flow_grpo_fast", "Flow-GRPO-Fast", "configs/toy_methods/flow_grpo_fast.yaml",
           (0.7, 1.0)),
    Method("flow_grpo_fast_cps", "Flow-GRPO-Fast (CPS)",
           "configs/toy_methods/flow_grpo_fast_cps.yaml", (0.8, 0.5)),
    Method("flash_grpo", "Flash-GRPO", "configs/toy_methods/flash_grpo.yaml", (1.0, 2.0)),
    Method("e_grpo", "E-GRPO", "configs/toy_methods/e_grpo.yaml", (0.7, 1.0)),
    Method("tempflow_grpo", "TempFlow-GRPO", "configs/toy_methods/tempflow_grpo.yaml", (0.7, 1.0)),
    Method("nft", "DiffusionNFT", "configs/toy_methods/nft.yaml", (0.7,)),
    Method("awm", "AWM", "configs/toy_methods/awm.yaml", (0.7,)),
    Method("dgpo", "DGPO", "configs/toy_methods/dgpo.yaml", (0.7,)),
    Method("dpo", "Diffusion-DPO (online)", "configs/toy_methods/dpo.yaml", (0.7,)),
    Method("euphonium", "Euphonium (reward-guided rollouts)", "configs/toy_methods/euphonium.yaml",
           (0.7, 0.4)),
    Method("gdro", "GDRO", "configs/toy_methods/gdro.yaml", (0.7,)),
)}

# CI-sized runs: a tiny batch and evaluation (2 per family = 12 samples, 8 Euler steps).
QUICK_OVERRIDES = ("training.prompts_per_iteration=2", "training.group_size=4",
                   "sampling.rollout_batch_size=8", "prompts.eval_per_family=2",
                   "sampling.eval_num_steps=8", "run.max_iterations=3")
QUICK_BUDGET, QUICK_INTERVAL = 2.0, 0.5

# Per-iteration values kept in a run's record (as columns): the trainer's metrics plus ours.
ITERATION_KEYS = ("cpu_seconds", "wall_seconds", "cpu/iteration", "cpu/rollout",
                  "cpu/advantages", "cpu/update", "time/rollout", "time/reward_wait",
                  "time/update", "nfe", "trained_transitions", "train/optimizer_steps",
                  "train/replay_batches", "train/skipped_replay_batches", "reward/total/mean",
                  "train/clip_fraction", "train/first_pass_ratio_max_dev", "train/grad_norm",
                  "lr", "adv/zero_std_fraction")


def parse_list(text: str, kind: Callable[[str], Any], name: str) -> list:
    """``"0,1,2"`` -> [0, 1, 2]; a clear error naming the option otherwise."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        values = [kind(t) for t in items]
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a comma-separated list of "
                         f"{kind.__name__} values") from None
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def parse_methods(text: str) -> list[Method]:
    names = parse_list(text, str, "--methods")
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown method {unknown[0]}; choose from "
                         f"{', '.join(METHODS)}")
    return [METHODS[n] for n in dict.fromkeys(names)]


# ----------------------------------------------------------------------------- statistics


def t_interval(values: Sequence[float], confidence: float = 0.95) -> dict:
    """Mean and two-sided t-interval of the mean over ``values`` (seeds): mean +- t_{(1+c)/2, n-1}
    s / sqrt(n), s the sample std (ddof 1). One value: the interval is undefined (None)."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        raise ValueError("t_interval needs at least one value")
    mean = sum(values) / n
    if n == 1:
        return {"mean": mean, "low": None, "high": None, "half_width": None, "n": 1, "sd": None}
    from scipy.stats import t as student_t

    sd = statistics.stdev(values)
    half = float(student_t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "half_width": half, "n": n,
            "sd": sd}


def seconds_to_target(points: Sequence[tuple[float, float]], target: float
                      ) -> tuple[float | None, float | None]:
    """CPU seconds at which accuracy first reaches ``target`` along (seconds, accuracy) points in
    time order (the base at 0 s first). Returns (interpolated, first evaluation): the linear
    interpolation between the last point below the target and the first at or above it, and that
    first point's seconds. (None, None) when no point reaches it."""
    previous = None
    for seconds, accuracy in points:
        if accuracy >= target - 1e-12:
            if previous is None or previous[1] >= accuracy:
                return float(seconds), float(seconds)
            s0, a0 = previous
            return float(s0 + (target - a0) / (accuracy - a0) * (seconds - s0)), float(seconds)
        previous = (seconds, accuracy)
    return None, None


def value_at_iteration(points: Sequence[tuple[float, float]], iteration: float) -> float | None:
    """Accuracy at ``iteration`` along (iteration, accuracy) points in iteration order (the base
    at iteration 0 first): linear interpolation between the evaluations on either side, the
    point's own value on an evaluation; None past the last evaluation (the run did not get
    there)."""
    previous = None
    for done, accuracy in points:
        if done >= iteration:
            if previous is None or done == previous[0]:
                return float(accuracy)
            i0, a0 = previous
            return float(a0 + (iteration - i0) / (done - i0) * (accuracy - a0))
        previous = (done, accuracy)
    return None


def gains_at_iteration(records: list[dict], iteration: float) -> list[float | None]:
    """Each run's held-out gain over its base after ``iteration`` iterations
    (``value_at_iteration`` on its evaluations), in the records' order; None for a run whose
    last evaluation comes before."""
    gains = []
    for record in records:
        value = value_at_iteration([(e["iteration"], e["accuracy"]) for e in record["evals"]],
                                   iteration)
        gains.append(None if value is None else value - record["base"]["accuracy"])
    return gains


def median_seconds(values: Sequence[float | None]) -> float | None:
    """Median over seeds where "not reached" (None) counts as longer than any budget; None when
    the median itself is not reached (so at least half the seeds must reach the target)."""
    if not values:
        return None
    median = statistics.median([math.inf if v is None else float(v) for v in values])
    return None if math.isinf(median) else float(median)


def artifact_value(metrics: dict) -> tuple[str, float] | None:
    """The toy image-quality metric (``toy_artifacts``) of an evaluation, when it was scored:
    (key, value) of its main score's family mean, else its main score's plain mean, else the
    first family mean or value logged under that name. None when it was not scored."""
    keys = [k for k, v in metrics.items() if "toy_artifacts" in k and not k.endswith("/se")
            and isinstance(v, (int, float)) and math.isfinite(v)]
    if not keys:
        return None
    main = ("toy_artifacts.artifacts", "toy_artifacts")
    for wanted in ([m + "/family_mean" for m in main], list(main)):
        found = [k for k in keys if any(k.endswith(w) for w in wanted)]
        if found:
            return found[0], float(metrics[found[0]])
    family = [k for k in keys if k.endswith("/family_mean")]
    key = (family or keys)[0]
    return key, float(metrics[key])


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
              "torch_threads": _torch_threads(), "load_average_start": _load(),
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
                  load_average_end=_load(), finished_at=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    write_json(path, record)
    del trainer
    gc.collect()
    return record


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _load() -> list[float] | None:
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


# ----------------------------------------------------------------------------- the report


def finished_records(out: Path) -> list[dict]:
    records = []
    for path in sorted((out / "runs").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if record.get("finished"):
            records.append(record)
    return records


def _value_at(record: dict, mark: float) -> float | None:
    for e in record["evals"]:
        if any(abs(m - mark) < 1e-6 for m in e.get("marks", [])):
            return e["accuracy"]
    return None


def _mean_of(column: Sequence) -> float | None:
    values = [float(v) for v in column if v is not None]
    return sum(values) / len(values) if values else None


def summarize_method(records: list[dict], target_delta: float = TARGET_DELTA,
                     equal_iterations: int | None = None) -> dict:
    """One method's line of the report from its finished runs (one per seed). With
    ``equal_iterations``, also the gain after that many iterations (``value_at_iteration``), so
    that methods of different cost per iteration compare per update as well as per CPU second."""
    if not records:
        raise ValueError("summarize_method needs at least one finished run")
    signatures = {json.dumps({k: v for k, v in r["signature"].items() if k != "seed"},
                             sort_keys=True) for r in records}
    if len(signatures) > 1:
        raise ValueError(f"the runs of {records[0]['method']} were measured under different "
                         f"settings ({len(signatures)} signatures): report them from separate "
                         f"--out folders")
    records = sorted(records, key=lambda r: r["seed"])
    finals = [r["evals"][-1] for r in records]
    bases = [r["base"]["accuracy"] for r in records]
    accuracy = [f["accuracy"] for f in finals]
    gains = [a - b for a, b in zip(accuracy, bases)]
    to_target, to_target_first = [], []
    for record, base in zip(records, bases):
        points = [(e["cpu_seconds"], e["accuracy"]) for e in record["evals"]]
        interpolated, first = seconds_to_target(points, base + target_delta)
        to_target.append(interpolated)
        to_target_first.append(first)
    per_iteration: dict[str, list[float]] = {}
    for record in records:
        columns = record["iterations"]
        for key in ("cpu/iteration", "cpu/rollout", "cpu/advantages", "cpu/update", "nfe",
                    "trained_transitions", "train/optimizer_steps", "time/reward_wait"):
            value = _mean_of(columns.get(key, []))
            if value is not None:
                per_iteration.setdefault(key, []).append(value)
    phases = {k: _mean_of(v) for k, v in per_iteration.items()}
    if phases.get("cpu/iteration") is not None:
        known = sum(phases.get(k) or 0.0 for k in ("cpu/rollout", "cpu/advantages", "cpu/update"))
        phases["cpu/other"] = phases["cpu/iteration"] - known
    budget = records[0]["signature"]["budget"]
    interval = records[0]["signature"]["eval_interval"]
    marks = [0.0] + milestones(budget, interval)
    curve = {"cpu_seconds": marks, "mean": [], "min": [], "max": [], "n": []}
    for mark in marks:
        values = [v for v in (_value_at(r, mark) for r in records) if v is not None]
        curve["mean"].append(sum(values) / len(values) if values else None)
        curve["min"].append(min(values) if values else None)
        curve["max"].append(max(values) if values else None)
        curve["n"].append(len(values))
    artifacts = [f.get("artifacts") for f in finals]
    base_artifacts = [r["base"].get("artifacts") for r in records]
    at_iterations = None
    if equal_iterations is not None:
        gains_then = gains_at_iteration(records, equal_iterations)
        if any(v is None for v in gains_then):
            raise ValueError(f"equal_iterations={equal_iterations} is past the last evaluation "
                             f"of a run of {records[0]['method']}")
        at_iterations = {"iterations": equal_iterations, **t_interval(gains_then),
                         "per_seed": gains_then}
    return {
        "method": records[0]["method"], "label": records[0]["label"],
        "seeds": [r["seed"] for r in records], "budget": budget, "eval_interval": interval,
        "base": {"accuracy": _mean_of(bases), "accuracy_se": records[0]["base"].get("accuracy_se"),
                 "per_seed": bases, "artifacts": _mean_of(base_artifacts)},
        "accuracy": {**t_interval(accuracy), "per_seed": accuracy},
        "gain": {**t_interval(gains), "per_seed": gains},
        "seconds_to_target": {"target_delta": target_delta, "median": median_seconds(to_target),
                              "per_seed": to_target,
                              "reached": sum(v is not None for v in to_target),
                              "rule": "linear interpolation between the last evaluation below "
                                      "base + target_delta and the first at or above it; median "
                                      "over seeds with 'not reached' as longer than the budget",
                              "median_first_evaluation": median_seconds(to_target_first),
                              "per_seed_first_evaluation": to_target_first},
        "iterations": {"mean": _mean_of([r["iterations_done"] for r in records]),
                       "per_seed": [r["iterations_done"] for r in records],
                       "stopped_by": [r["stopped_by"] for r in records],
                       "max_iterations": records[0]["max_iterations"]},
        "cpu_seconds_trained": [r["cpu_seconds"] for r in records],
        "per_iteration": {"cpu_seconds": phases.get("cpu/iteration"),
                          "rollout": phases.get("cpu/rollout"),
                          "advantages": phases.get("cpu/advantages"),
                          "update": phases.get("cpu/update"), "other": phases.get("cpu/other"),
                          "reward_wait_wall": phases.get("time/reward_wait"),
                          "nfe_per_sample": phases.get("nfe"),
                          "trained_transitions": phases.get("trained_transitions"),
                          "optimizer_steps": phases.get("train/optimizer_steps")},
        "artifacts": {"mean": _mean_of(artifacts), "per_seed": artifacts,
                      "key": finals[0].get("artifacts_key")},
        "curve": curve,
        "gain_at_equal_iterations": at_iterations,
        "load_average": [r.get("load_average_start") for r in records],
    }


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _interval_text(stats: dict, signed: bool = False) -> str:
    sign = "+" if signed else ""
    mean = format(stats["mean"], f"{sign}.3f")
    if stats["low"] is None:
        return f"{mean} (n=1)"
    return f"{mean} [{stats['low']:{sign}.3f}, {stats['high']:{sign}.3f}]"


TABLE_HEADER = ("| method | seeds | acc@budget [95% CI] | gain [95% CI] | CPU s to +10 (median) | "
                "iterations | NFE/sample | trained/it | opt steps/it | CPU s/it | rollout | "
                "update | other | artifacts@budget |")


def format_table(summaries: list[dict]) -> str:
    """The Markdown table of the report, one line per method."""
    columns = TABLE_HEADER.count("|") - 1
    lines = [TABLE_HEADER, "|" + "|".join(["---"] + ["---:"] * (columns - 1)) + "|"]
    for s in summaries:
        to_target = s["seconds_to_target"]
        n = len(s["seeds"])
        reached = ("not reached" if to_target["median"] is None
                   else f"{to_target['median']:.0f}") + f" ({to_target['reached']}/{n})"
        p = s["per_iteration"]
        capped = sum(by == "max_iterations" for by in s["iterations"]["stopped_by"])
        iterations = _fmt(s["iterations"]["mean"], ".0f") + (f" ({capped} cap)" if capped else "")
        lines.append(
            f"| {s['label']} | {n} | {_interval_text(s['accuracy'])} | "
            f"{_interval_text(s['gain'], signed=True)} | {reached} | "
            f"{iterations} | {_fmt(p['nfe_per_sample'], '.1f')} | "
            f"{_fmt(p['trained_transitions'], '.0f')} | {_fmt(p['optimizer_steps'], '.1f')} | "
            f"{_fmt(p['cpu_seconds'], '.2f')} | {_fmt(p['rollout'], '.2f')} | "
            f"{_fmt(p['update'], '.2f')} | {_fmt(p['other'], '.2f')} | "
            f"{_fmt(s['artifacts']['mean'], '.4f')} |")
    return "\n".join(lines)


def format_equal_iterations(summaries: list[dict]) -> str:
    """The gain of every method after the same number of iterations (the fewest any run of the
    report did), beside its gain at the budget: what separates per update from what separates
    per CPU second."""
    iterations = summaries[0]["gain_at_equal_iterations"]["iterations"]
    lines = [f"Gain after {iterations} iterations (the fewest any run did; linear interpolation "
             f"between evaluations), against the gain at the budget and the CPU seconds an "
             f"iteration costs:", "",
             f"| method | gain after {iterations} iterations [95% CI] | per seed | gain at the "
             f"budget | CPU s / it |", "|---|---:|---:|---:|---:|"]
    for s in summaries:
        at = s["gain_at_equal_iterations"]
        seeds = ", ".join(f"{v:+.3f}" for v in at["per_seed"])
        per_iteration = _fmt(s["per_iteration"]["cpu_seconds"], ".2f")
        lines.append(f"| {s['label']} | {_interval_text(at, signed=True)} | {seeds} | "
                     f"{s['gain']['mean']:+.3f} | {per_iteration} |")
    return "\n".join(lines)


def gain_at_paced_budget(records: list[dict], seconds_per_iteration: float,
                         cpu_budget: float) -> dict:
    """The gain of a method's runs at ``cpu_budget`` CPU seconds spent at another measurement's
    pace: after ``cpu_budget / seconds_per_iteration`` iterations (``value_at_iteration`` on each
    run). CPU seconds per iteration vary from day to day on a shared machine (1.5-1.8x on this
    one), so runs measured on another day, or stopped by an iteration cap, compare with a table
    at the budget the table would have spent. A run whose last evaluation comes before that
    iteration gives None; the mean and interval are over the others (None when none got there)."""
    if not (seconds_per_iteration > 0 and cpu_budget > 0):
        raise ValueError(f"seconds_per_iteration and cpu_budget must be > 0 (got "
                         f"{seconds_per_iteration}, {cpu_budget})")
    iterations = cpu_budget / seconds_per_iteration
    per_seed = gains_at_iteration(sorted(records, key=lambda r: r["seed"]), iterations)
    reached = [v for v in per_seed if v is not None]
    stats = (t_interval(reached) if reached else
             {"mean": None, "low": None, "high": None, "half_width": None, "n": 0, "sd": None})
    return {"cpu_budget": cpu_budget, "seconds_per_iteration": seconds_per_iteration,
            "iterations": iterations, **stats, "per_seed": per_seed}


def paced_budgets(summaries: list[dict], by_method: dict[str, list[dict]],
                  pace_files: list[Path], cpu_budget: float) -> dict[str, dict | None]:
    """``gain_at_paced_budget`` of every method of a report at the CPU seconds per iteration
    that another report's methods.json measured for it: the first of ``pace_files`` that has
    the method (its index in ``pace_from``); None for a method none of them has. Several files
    let each method take its pace from the runs measured in one sitting when some of a table's
    rows were re-measured on another day."""
    paces = []
    for pace_file in pace_files:
        if not Path(pace_file).is_file():
            raise ValueError(f"--pace-from {pace_file}: no such file (give the methods.json that "
                             f"--report wrote for the report whose pace to use)")
        paces.append(json.loads(Path(pace_file).read_text())["methods"])
    out = {}
    for s in summaries:
        out[s["method"]] = None
        for index, pace in enumerate(paces):
            seconds = (pace.get(s["method"]) or {}).get("per_iteration", {}).get("cpu_seconds")
            if seconds is not None:
                at = gain_at_paced_budget(by_method[s["method"]], seconds, cpu_budget)
                out[s["method"]] = {**at, "pace_from": index}
                break
    return out


def format_paced_budget(summaries: list[dict], paced: dict[str, dict | None], cpu_budget: float,
                        pace_files: list[str]) -> str:
    """The section of ``paced_budgets``: each method's iterations and gain at the budget (and,
    with several pace files, which one its pace came from)."""
    several = len(pace_files) > 1
    source = (f"`{pace_files[0]}`" if not several else
              "the first of " + ", ".join(f"`{f}`" for f in pace_files) + " that has the method")
    lines = [f"Gain at {cpu_budget:g} CPU seconds at the pace of {source} (each method "
             f"after {cpu_budget:g} / its CPU seconds per iteration there; linear interpolation "
             f"between evaluations; '-' past a run's last evaluation or a method that report "
             f"does not have):", "",
             "| method | CPU s / it there | iterations | gain [95% CI] | per seed |"
             + (" pace from |" if several else ""),
             "|---|---:|---:|---:|---:|" + ("---|" if several else "")]
    for s in summaries:
        at = paced[s["method"]]
        if at is None:
            lines.append(f"| {s['label']} | - | - | - | - |" + (" - |" if several else ""))
            continue
        seeds = ", ".join("-" if v is None else f"{v:+.3f}" for v in at["per_seed"])
        gain = "-" if at["mean"] is None else _interval_text(at, signed=True)
        lines.append(f"| {s['label']} | {at['seconds_per_iteration']:.2f} | "
                     f"{at['iterations']:.0f} | {gain} | {seeds} |"
                     + (f" `{pace_files[at['pace_from']]}` |" if several else ""))
    return "\n".join(lines)


def plot_curves(summaries: list[dict], path: Path, target_delta: float = TARGET_DELTA) -> Path:
    """Held-out accuracy against training CPU seconds: each method's mean over seeds as a line,
    the min-max over seeds as a band; the base and base + target as grey lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    colours = plt.get_cmap("tab10")
    for i, s in enumerate(summaries):
        curve = s["curve"]
        points = [(x, m, lo, hi) for x, m, lo, hi in zip(curve["cpu_seconds"], curve["mean"],
                                                         curve["min"], curve["max"])
                  if m is not None]
        if not points:
            continue
        xs, mean, low, high = zip(*points)
        colour = colours(i % 10)
        axes.plot(xs, mean, marker="o", markersize=3, color=colour,
                  label=f"{s['label']} (n={len(s['seeds'])})")
        if len(s["seeds"]) > 1:
            axes.fill_between(xs, low, high, color=colour, alpha=0.15, linewidth=0)
    bases = {round(s["base"]["accuracy"], 6) for s in summaries}
    if len(bases) == 1:
        base = bases.pop()
        axes.axhline(base, color="grey", linewidth=0.8, label=f"base {base:.3f}")
        axes.axhline(base + target_delta, color="grey", linestyle="--", linewidth=0.8,
                     label=f"base + {target_delta * 100:.0f} points")
    axes.set_xlabel("training CPU seconds (one thread; evaluation excluded)")
    axes.set_ylabel("held-out exact accuracy (family mean)")
    axes.set_title("toy GenEval world: accuracy vs CPU time (line: mean over seeds; band: min-max)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


@dataclass(frozen=True)
class Claim:
    """A paper's speed claim as a ratio of ``method`` against ``baseline``.

    measure: "time" (median CPU seconds to +10 points, method / baseline), "reward" (training
    reward at equal iterations: the mean over the second half of the iterations both runs of a
    seed did, same prompts, method / baseline, then the mean over seeds) or "early_gain" (held-out
    gain at the first evaluation, means over seeds, method / baseline).
    """

    text: str
    method: str
    baseline: str
    measure: str
    paper_ratio: str


CLAIMS = (
    Claim("MixGRPO: about half of DanceGRPO's training time", "mix_grpo", "dance_grpo", "time",
          "0.5"),
    Claim("MixGRPO-Flash: about 71% less training time than DanceGRPO", "mix_grpo_flash",
          "dance_grpo", "time", "0.29"),
    Claim("Flow-GRPO-Fast: 2 trained steps match the full SDE (Flow-GRPO)", "flow_grpo_fast",
          "flow_grpo", "reward", "1.0 (reward at equal iterations)"),
    Claim("Flash-GRPO: one step per trajectory beats full-trajectory training at low budgets",
          "flash_grpo", "flow_grpo", "early_gain", "> 1 (gain at a low budget)"),
)


def _reward_at_equal_iterations(method_runs: list[dict], baseline_runs: list[dict]
                                ) -> tuple[float, float] | None:
    """Mean over shared seeds of the training reward over the second half of the iterations both
    runs of a seed did: (method, baseline). None when no seed is shared."""
    baseline_by_seed = {r["seed"]: r for r in baseline_runs}
    pairs = []
    for run in method_runs:
        other = baseline_by_seed.get(run["seed"])
        if other is None:
            continue
        ours = run["iterations"].get("reward/total/mean") or []
        theirs = other["iterations"].get("reward/total/mean") or []
        n = min(len(ours), len(theirs))
        if n == 0:
            continue
        half = slice(n // 2, n)
        pairs.append((_mean_of(ours[half]), _mean_of(theirs[half])))
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    if not pairs:
        return None
    return _mean_of([a for a, _ in pairs]), _mean_of([b for _, b in pairs])


def claim_row(claim: Claim, summaries: dict[str, dict], runs: dict[str, list[dict]]) -> dict:
    """The claim's measured ratio from the report's summaries (and, for "reward", the runs).
    ``measured`` is text: a ratio, a bound when one side did not reach the target, or why there
    is none; ``ratio`` the number when there is one."""
    row = {"claim": claim.text, "method": claim.method, "baseline": claim.baseline,
           "measure": claim.measure, "paper_ratio": claim.paper_ratio, "ratio": None}
    if claim.method not in summaries or claim.baseline not in summaries:
        return {**row, "measured": "not measured"}
    ours, theirs = summaries[claim.method], summaries[claim.baseline]
    if claim.measure == "time":
        a, b = ours["seconds_to_target"]["median"], theirs["seconds_to_target"]["median"]
        budget = ours["budget"]
        row.update(method_value=a, baseline_value=b)
        if a is not None and b is not None:
            row["ratio"] = a / b
            return {**row, "measured": f"{a / b:.2f} ({a:.0f} s / {b:.0f} s to +10)"}
        if a is not None:
            return {**row, "measured": f"< {a / budget:.2f} ({a:.0f} s; the baseline did not "
                                       f"reach +10 in {budget:g} s)"}
        if b is not None:
            return {**row, "measured": f"> {budget / b:.2f} (not reached in {budget:g} s; the "
                                       f"baseline in {b:.0f} s)"}
        return {**row, "measured": f"neither reached +10 in {budget:g} s"}
    if claim.measure == "reward":
        means = _reward_at_equal_iterations(runs.get(claim.method, []),
                                            runs.get(claim.baseline, []))
        if means is None or not means[1]:
            return {**row, "measured": "no shared seed"}
        row.update(method_value=means[0], baseline_value=means[1], ratio=means[0] / means[1])
        return {**row, "measured": f"{means[0] / means[1]:.2f} (training reward {means[0]:.3f} "
                                   f"vs {means[1]:.3f})"}
    if claim.measure == "early_gain":
        first = min(m for m in ours["curve"]["cpu_seconds"] if m > 0)
        at = ours["curve"]["cpu_seconds"].index(first)
        gains = []
        for summary in (ours, theirs):
            mean = summary["curve"]["mean"][at] if summary["curve"]["cpu_seconds"][at] == first \
                else None
            gains.append(None if mean is None else mean - summary["base"]["accuracy"])
        a, b = gains
        row.update(method_value=a, baseline_value=b, at_cpu_seconds=first)
        if a is None or b is None:
            return {**row, "measured": "not measured at the same mark"}
        if a >= MIN_GAIN_FOR_RATIO and b >= MIN_GAIN_FOR_RATIO:
            row["ratio"] = a / b
            return {**row, "measured": f"{a / b:.2f} (gain {a:+.3f} vs {b:+.3f} at {first:g} s)"}
        loser = "the method" if a < MIN_GAIN_FOR_RATIO else "the baseline"
        return {**row, "measured": f"gain {a:+.3f} vs {b:+.3f} at {first:g} s (no ratio: "
                                   f"{loser} did not gain a point)"}
    raise ValueError(f"unknown claim measure {claim.measure!r}")


def format_claims(rows: list[dict]) -> str:
    lines = ["| claim | paper's ratio | measured here |", "|---|---|---|"]
    lines += [f"| {r['claim']} | {r['paper_ratio']} | {r['measured']} |" for r in rows]
    return "\n".join(lines)


def separations(summaries: list[dict]) -> list[tuple[str, str]]:
    """(higher, lower) label pairs whose 95% intervals of the gain over seeds do not overlap:
    the higher method's interval lies wholly above the lower's. A method with one seed has no
    interval and separates from nothing. Ordered by the higher method's mean gain, then the
    lower's, both descending."""
    ranked = sorted((s for s in summaries if s["gain"]["low"] is not None),
                    key=lambda s: -s["gain"]["mean"])
    return [(a["label"], b["label"]) for i, a in enumerate(ranked) for b in ranked[i + 1:]
            if a["gain"]["low"] > b["gain"]["high"]]


def format_ranking(summaries: list[dict]) -> str:
    """One sentence per method that lies above others, and what cannot be ranked."""
    pairs = separations(summaries)
    single = [s["label"] for s in summaries if s["gain"]["low"] is None]
    lines = ["Ranking, stated only where the 95% intervals of the gain over seeds do not overlap:"]
    above: dict[str, list[str]] = {}
    for high, low in pairs:
        above.setdefault(high, []).append(low)
    lines += [f"- {high} above {', '.join(lows)}" for high, lows in above.items()]
    if not pairs:
        lines.append("- no two methods separate: no ranking")
    if single:
        lines.append(f"- one seed only (not ranked): {', '.join(single)}")
    return "\n".join(lines)


def reproduce_command(records: list[dict], out: Path) -> str:
    """The table's own command, read from its runs (seeds, budget, evaluation interval, extra
    overrides, methods): rerunning it skips every finished run and rewrites the report."""
    seeds = sorted({r["seed"] for r in records})
    signature = records[0]["signature"]
    names = {r["method"] for r in records}
    methods = [m for m in METHODS if m in names] + sorted(names - set(METHODS))
    parts = ["python benchmarks/methods.py", f"--seeds {','.join(map(str, seeds))}",
             f"--budget {signature['budget']:g}", f"--eval-interval {signature['eval_interval']:g}",
             f"--methods {','.join(methods)}"]
    overrides = {tuple(r["signature"].get("overrides", ())) for r in records}
    if len(overrides) == 1:
        parts += [f"--set {item}" for item in next(iter(overrides))]
    else:   # no one command reproduces these runs: say so rather than drop the overrides
        parts.append("(the runs differ in their --set overrides: see each run's signature)")
    try:
        relative = out.resolve().relative_to(ROOT)
    except ValueError:
        relative = out
    if str(relative) != DEFAULT_OUT:
        parts.append(f"--out {relative}")
    return " ".join(parts)


def report(out: Path, command: str = "", log: Callable[[str], None] = print,
           pace_files: list[Path] | None = None, at_cpu: float | None = None) -> dict | None:
    """Aggregate every finished run in ``<out>/runs`` into table.md, methods.json and
    accuracy_vs_cpu_seconds.png. Returns the JSON's content (None when nothing is finished).
    With ``pace_files`` and ``at_cpu``, also every method's gain at ``at_cpu`` CPU seconds at the
    pace those reports measured (``paced_budgets``)."""
    if (not pace_files) != (at_cpu is None):
        raise ValueError("--pace-from and --at-cpu go together: the budget is in the CPU seconds "
                         "of the report the pace comes from")
    records = finished_records(out)
    if not records:
        log(f"no finished runs in {out / 'runs'}: nothing to report")
        return None
    by_method: dict[str, list[dict]] = {}
    for record in records:
        by_method.setdefault(record["method"], []).append(record)
    order = [m for m in METHODS if m in by_method] + sorted(set(by_method) - set(METHODS))
    # the fewest iterations any run evaluated at its end: every method is compared there too
    equal_iterations = min(r["evals"][-1]["iteration"] for r in records)
    summaries = [summarize_method(by_method[m], equal_iterations=equal_iterations)
                 for m in order]
    unfinished = sorted(p.stem for p in (out / "runs").glob("*.json")
                        if p.stem not in {r["key"] for r in records})
    first = summaries[0]
    base = first["base"]
    date = time.strftime("%Y-%m-%d")
    head = [f"Methods on the toy world, {date}: {first['budget']:g} training CPU seconds per run "
            f"(one thread, evaluation excluded), evaluations every {first['eval_interval']:g} s; "
            f"held-out exact accuracy (family mean) on the same "
            f"{_eval_samples(records[0])} samples for every method and seed.",
            f"Base accuracy {base['accuracy']:.3f} (se {_fmt(base['accuracy_se'], '.3f')})"
            + (f", artifacts {base['artifacts']:.4f}" if base["artifacts"] is not None else "")
            + ". CI: 95% t-interval over seeds. CPU s to +10: linear interpolation between "
              "evaluations, median over seeds ('not reached' counts as longer than the budget; "
              "(k/n) seeds reached it). Iterations: mean over seeds; (k cap): k seeds stopped at "
              "their config's run.max_iterations before the budget. Per-iteration columns: means "
              "over every iteration of every seed, CPU seconds; rollout includes the reward; "
              "other = the rest of the iteration.",
            ""]
    head.insert(1, f"Command (resumable; reruns skip finished runs): "
                   f"`{reproduce_command(records, out)}`")
    table = "\n".join(head + [format_table(summaries)])
    table += "\n\n" + format_ranking(summaries)
    table += "\n\n" + format_equal_iterations(summaries)
    paced = None
    if pace_files:
        paced = paced_budgets(summaries, by_method, pace_files, at_cpu)
        shown = [str(os.path.relpath(f, ROOT) if Path(f).is_absolute() else f)
                 for f in pace_files]
        table += "\n\n" + format_paced_budget(summaries, paced, at_cpu, shown)
        for s in summaries:
            at = paced[s["method"]]
            s["gain_at_paced_budget"] = (None if at is None else
                                         {**at, "pace_from": shown[at["pace_from"]]})
    if unfinished:
        table += f"\n\nNot finished (not in the table): {', '.join(unfinished)}"
    by_name = {s["method"]: s for s in summaries}
    claims = [claim_row(c, by_name, by_method) for c in CLAIMS]
    table += ("\n\nThe papers' speed claims, as ratios against their baselines, measured here "
              "(time: median CPU seconds to +10 points; reward: training reward over the second "
              "half of the iterations both runs did, mean over seeds; early gain: held-out gain "
              "at the first evaluation, mean over seeds):\n\n" + format_claims(claims))
    (out / "table.md").write_text(table + "\n")
    data = {"generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command,
            "table_command": reproduce_command(records, out),
            "separations": [{"higher": h, "lower": low} for h, low in separations(summaries)],
            "target_delta": TARGET_DELTA, "methods": by_name, "claims": claims,
            "unfinished": unfinished}
    write_json(out / "methods.json", data)
    plot = plot_curves(summaries, out / "accuracy_vs_cpu_seconds.png")
    log(f"\n{table}\n\nwrote {out / 'table.md'}, {out / 'methods.json'}, {plot}")
    return data


def _eval_samples(record: dict) -> str:
    samples = record["base"].get("samples")
    return str(samples) if samples else "the config's"


# ----------------------------------------------------------------------------- calibration


def calibrate(methods: list[Method], budget: float, iterations: int, out: Path,
              extra: Sequence[str] = (), log: Callable[[str], None] = print) -> dict:
    """CPU seconds per iteration of each method and the run.max_iterations that fit ``budget``.

    One warm-up iteration (index 0, not counted), then ``iterations`` iterations at indices
    spread over the config's current run.max_iterations, so that plans that change over a run
    (MixGRPO's window, whose ODE prefix is computed once per group when the initial noise is
    shared) are sampled along it. Learning does not happen in between, so costs that change with
    the policy (fewer replay batches as more groups have no reward variance) are those of the
    start. The first method's untrained model is evaluated once, for the evaluation's cost.
    """
    from flowgrpo.trainer import Trainer

    results: dict[str, dict] = {}
    evaluation_cost = None
    for method in methods:
        spec = RunSpec(method.name, 0, f"calibrate_{method.name}", budget, budget,
                       TABLE_EVAL_SEED, tuple(extra))
        config = spec.load(out)
        trainer = Trainer(config)
        if evaluation_cost is None:
            measured = evaluation(trainer, 0)
            evaluation_cost = {"cpu_seconds": measured["eval_cpu_seconds"],
                               "wall_seconds": measured["eval_wall_seconds"],
                               "samples": measured["samples"]}
            log(f"one evaluation ({measured['samples']} samples): "
                f"{measured['eval_cpu_seconds']:.1f} cpu-s")
        phases = PhaseClock(trainer)
        total = config.run.max_iterations
        # a warm-up at 0, then the midpoints of `iterations` equal stretches of the run
        indices = [0] + [((2 * k + 1) * total) // (2 * iterations) for k in range(iterations)]
        rows = []
        for position, index in enumerate(indices):
            began = time.process_time()
            metrics = trainer.run_iteration(index)
            rows.append({**phases.take(), "cpu/iteration": time.process_time() - began,
                         "nfe": metrics.get("nfe"),
                         "trained_transitions": metrics.get("trained_transitions"),
                         "index": index, "warm_up": position == 0})
        counted = [r for r in rows if not r["warm_up"]] or rows
        mean = {k: _mean_of([r.get(k) for r in counted]) for k in
                ("cpu/iteration", "cpu/rollout", "cpu/advantages", "cpu/update", "nfe",
                 "trained_transitions")}
        fit = max(1, int(budget // mean["cpu/iteration"]))
        entry = {"cpu_seconds_per_iteration": mean["cpu/iteration"],
                 "rollout": mean["cpu/rollout"], "advantages": mean["cpu/advantages"],
                 "update": mean["cpu/update"], "nfe_per_sample": mean["nfe"],
                 "trained_transitions": mean["trained_transitions"],
                 "max_iterations_for_budget": fit, "config_max_iterations": total,
                 "iterations": rows, "calibrated": method.calibrated,
                 "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_average": _load()}
        if method.window_visits:
            entry["shift_interval"] = max(1, round(fit / method.window_visits))
        results[method.name] = entry
        log(f"{method.name:20s} {mean['cpu/iteration']:6.2f} cpu-s/it (rollout "
            f"{mean['cpu/rollout']:.2f}, update {mean['cpu/update']:.2f}), NFE/sample "
            f"{mean['nfe']:.1f}, trained/it {mean['trained_transitions']:.0f}: "
            f"max_iterations {fit} for {budget:g} s"
            + ("" if method.calibrated else " (not written: keeps the default's schedule)"))
        del trainer
        gc.collect()
    data = {"measured": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "budget": budget, "iterations_per_method": iterations,
            "torch_threads": _torch_threads(), "evaluation": evaluation_cost, "methods": results}
    return merge_methods_json(out / "calibration.json", data, same="budget")


# ----------------------------------------------------------------------------- config edits


# ----------------------------------------------------------------------------- reward signal


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
            **{k: _mean_of([r[k] for r in rows]) for k in ("no_signal", "within_std", "mean")}}
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


def set_yaml_scalar(text: str, dotted: str, value: str) -> str:
    """``text`` with the block-style YAML scalar at ``dotted`` (e.g. ``training.lr``,
    ``sampling.plan.shift_interval``) set to ``value``, keeping every other line and the
    line's comment. Raises ValueError when the key is not found exactly once as a block
    entry (a flow mapping such as ``plan: {...}`` is not edited)."""
    parts = dotted.split(".")
    lines = text.split("\n")
    start, end = 0, len(lines)
    for depth, part in enumerate(parts):
        indent = " " * (2 * depth)
        pattern = re.compile(rf"^{indent}{re.escape(part)}:(\s|$)")
        found = [i for i in range(start, end) if pattern.match(lines[i])]
        if len(found) != 1:
            raise ValueError(f"{dotted}: found {len(found)} block entries '{part}:' at indent "
                             f"{len(indent)}; edit the file by hand")
        index = found[0]
        if depth == len(parts) - 1:
            match = re.match(rf"^({indent}{re.escape(part)}:\s*)(\S[^#]*?)?(\s*#.*)?$",
                             lines[index])
            if match is None or match.group(2) is None or match.group(2).startswith("{"):
                raise ValueError(f"{dotted} is not a scalar on its line: {lines[index]!r}")
            lines[index] = f"{match.group(1)}{value}{match.group(3) or ''}"
            return "\n".join(lines)
        start = index + 1
        end = next((i for i in range(start, len(lines)) if lines[i].strip()
                    and not lines[i].startswith(" " * (2 * depth + 2))
                    and not lines[i].lstrip().startswith("#")), len(lines))
    raise AssertionError("unreachable")


def yaml_number(value: float) -> str:
    """A float as the configs write it (2.0e-4, 0.7)."""
    if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e4):
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:g}" if value != int(value) else f"{value:.1f}"


def write_config_values(method: Method, values: dict[str, str]) -> Path:
    """Set ``values`` (dotted key -> YAML text) in the method's config file and check that it
    still loads and holds them."""
    import yaml

    from flowgrpo.config import load_config

    if not method.editable:
        raise ValueError(f"{method.config} is not edited by this script (the embedded default)")
    text = method.path.read_text()
    for dotted, value in values.items():
        text = set_yaml_scalar(text, dotted, value)
    data = yaml.safe_load(text)
    for dotted, value in values.items():
        node = data
        for part in dotted.split("."):
            node = node[part]
        if node != yaml.safe_load(value):
            raise ValueError(f"{method.config}: {dotted} reads {node!r} after the edit, not "
                             f"{value}")
    load_config(None, data=data)       # still a valid config
    method.path.write_text(text)
    return method.path


def calibrated_values(method: Method, entry: dict) -> dict[str, str]:
    fit = entry["max_iterations_for_budget"]
    values = {"run.max_iterations": str(fit), "run.eval_every": str(max(fit // 4, 1)),
              "run.checkpoint_every": str(max(fit // 4, 1))}
    if method.window_visits:
        values["sampling.plan.shift_interval"] = str(entry["shift_interval"])
    return values


# ----------------------------------------------------------------------------- tuning


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
                         f"{p['accuracy']:.3f} ({_fmt(p['accuracy_se'], '.3f')}) | "
                         f"{p['gain']:+.3f} | {p['iterations']} | "
                         f"{'**yes**' if chosen[method.name]['key'] == p['key'] else ''} |")
    if data["missing"]:
        lines += ["", f"Not finished: {', '.join(data['missing'])}"]
    (out / "tuning.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return data


# ----------------------------------------------------------------------------- main


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--calibrate", action="store_true",
                      help="measure CPU seconds per iteration and the max_iterations that fit "
                           "--budget (calibration.json)")
    mode.add_argument("--tune", action="store_true",
                      help="the lr x noise grid on one seed at --tune-budget (tuning.md/json)")
    mode.add_argument("--signal", action="store_true",
                      help="reward variance of each method's rollouts from the base, no training "
                           "(signal.md/json; --signal-iterations)")
    mode.add_argument("--report", action="store_true",
                      help="only aggregate the finished runs of --out")
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized: 2 x 4 samples, 12 eval samples, 2 CPU-s or 3 iterations")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (default 0,1,2)")
    parser.add_argument("--budget", type=float, default=600.0,
                        help="training CPU seconds per run (default 600)")
    parser.add_argument("--eval-interval", type=float, default=100.0,
                        help="training CPU seconds between evaluations (default 100)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--pace-from", action="append", default=[], metavar="METHODS_JSON",
                        help="--report: also each method's gain at --at-cpu CPU seconds at the "
                             "CPU seconds per iteration this report's methods.json measured "
                             "(repeatable: each method's pace from the first file that has it)")
    parser.add_argument("--at-cpu", type=float, default=None, metavar="SECONDS",
                        help="--report with --pace-from: the budget, in that report's seconds")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra dotted config override for every run (repeatable)")
    parser.add_argument("--signal-iterations", type=int, default=8,
                        help="rollout iterations per method for --signal (default 8)")
    parser.add_argument("--calibrate-iterations", type=int, default=3,
                        help="counted iterations per method after one warm-up (default 3)")
    parser.add_argument("--write-configs", action="store_true",
                        help="with --calibrate: write run.max_iterations (and MixGRPO's "
                             "shift_interval) into configs/toy_methods/; with --tune: write the "
                             "chosen lr and noise level")
    parser.add_argument("--tune-budget", type=float, default=200.0,
                        help="training CPU seconds per tuning point (default 200)")
    parser.add_argument("--tune-lrs", default="1e-4,2e-4,4e-4", help="lrs to try")
    parser.add_argument("--tune-noise", action="append", default=[], metavar="METHOD=V1,V2",
                        help="noise levels to try for METHOD (default: the anchor's value and "
                             "the alternative in METHODS)")
    parser.add_argument("--tune-seed", type=int, default=TUNE_SEED)
    parser.add_argument("--tune-eval-seed", type=int, default=TUNE_EVAL_SEED)
    parser.add_argument("--tune-eval-per-family", type=int, default=96)
    parser.add_argument("--tune-schedule", choices=("scaled", "config"), default="scaled")
    parser.add_argument("--tie-tolerance", type=float, default=0.0)
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    import torch

    torch.set_num_threads(1)        # before any work: CPU seconds comparable across methods
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    methods = parse_methods(args.methods)
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out
    command = "python benchmarks/methods.py " + " ".join(sys.argv[1:] if argv is None else argv)
    extra = list(args.set)
    budget, interval = args.budget, args.eval_interval
    if args.quick:
        extra = extra + list(QUICK_OVERRIDES)
        budget, interval = QUICK_BUDGET, QUICK_INTERVAL
    if not (budget > 0 and interval > 0):
        raise SystemExit(f"--budget and --eval-interval must be > 0 (got {budget}, {interval})")

    if args.report:
        paces = [Path(p) if Path(p).is_absolute() else ROOT / p for p in args.pace_from]
        try:
            return report(out, command, pace_files=paces, at_cpu=args.at_cpu)
        except ValueError as error:
            raise SystemExit(str(error)) from None
    if args.signal:
        return signal_probe(methods, 1 if args.quick else args.signal_iterations, out, extra)
    if args.calibrate:
        data = calibrate(methods, budget, args.calibrate_iterations, out, extra)
        seeds = parse_list(args.seeds, int, "--seeds")
        evaluations = len(milestones(budget, interval))
        cost = data["evaluation"]["cpu_seconds"]
        hours = len(methods) * len(seeds) * (budget + evaluations * cost) / 3600
        tuning = len(methods) * 6 * (args.tune_budget + cost) / 3600
        print(f"the table ({len(methods)} methods x {len(seeds)} seeds, {budget:g} s, "
              f"{evaluations} evaluations a run): about {hours:.1f} CPU hours of training and "
              f"evaluation, model loading not included; tuning adds {tuning:.1f} (6 points a "
              f"method at --tune-budget {args.tune_budget:g})")
        if args.write_configs:
            for method in methods:
                if method.calibrated and method.editable:
                    values = calibrated_values(method, data["methods"][method.name])
                    write_config_values(method, values)
                    print(f"wrote {values} into {method.config}")
        return data
    if args.tune:
        settings = TuneSettings(
            lrs=parse_list(args.tune_lrs, float, "--tune-lrs"), noise=parse_noise(args.tune_noise),
            budget=QUICK_BUDGET if args.quick else args.tune_budget, seed=args.tune_seed,
            eval_seed=args.tune_eval_seed,
            eval_per_family=2 if args.quick else args.tune_eval_per_family,
            schedule=args.tune_schedule, table_budget=budget, tie_tolerance=args.tie_tolerance)
        tune_out = out / "tuning"
        specs = tune_specs(methods, settings, tune_out, extra)
        run_specs(specs, tune_out)
        data = tune_report(tune_out, methods, settings, specs)
        if args.write_configs:
            for name, point in data["chosen"].items():
                method = METHODS[name]
                values = {"training.lr": yaml_number(point["lr"]),
                          "sampling.noise_level": yaml_number(point["noise_level"])}
                if method.editable:
                    write_config_values(method, values)
                    print(f"wrote {values} into {method.config}")
                else:
                    print(f"{method.config} (not edited): chosen {values}")
        return data
    seeds = parse_list(args.seeds, int, "--seeds")
    specs = [RunSpec(m.name, seed, f"{m.name}_s{seed}", budget, interval, TABLE_EVAL_SEED,
                     tuple(extra)) for m in methods for seed in seeds]
    run_specs(specs, out)
    return report(out, command)


if __name__ == "__main__":
    main()
