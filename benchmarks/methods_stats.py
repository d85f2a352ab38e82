"""The methods benchmark's statistics (``benchmarks/methods.py``): intervals over seeds, the
CPU seconds to a target, values between evaluations, and the artifacts metric of an evaluation.
Pure functions of numbers and run records."""
from __future__ import annotations

import math
import statistics
from typing import Sequence


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


def mean_of(column: Sequence) -> float | None:
    values = [float(v) for v in column if v is not None]
    return sum(values) / len(values) if values else None


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
