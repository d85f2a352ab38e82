"""Evaluation statistics: pass@k over repeated samples of a prompt, and standard errors.

Pure functions: tensors and ints in, python numbers (and dicts of them) out. ``flowgrpo eval
--samples-per-prompt K`` and the trainer's evaluation use them.

Definitions (documented here once, used everywhere):

* **Success**: a sample whose score is ``>= threshold`` (default 0.5, so a 0/1 verdict such as
  ``geneval_toy.exact`` succeeds exactly when it is 1). A NaN score is no trial: it counts neither
  as a success nor as a sample, so a prompt with n valid scores out of K has n trials.
* **pass@k** of one prompt with n trials and c successes is the unbiased estimator of the
  probability that at least one of k samples succeeds (Chen et al. 2021, "Evaluating Large
  Language Models Trained on Code"): ``1 - C(n - c, k) / C(n, k)``, defined for k <= n. A set of
  prompts reports the mean over its prompts with n >= k. pass@1 is the mean success rate c / n.
* **mixed**: a prompt with ``0 < c < n``: a GRPO group of its samples would have reward variance
  (carry signal); all-right and all-wrong prompts give zero-variance groups.
* **Standard error** of a mean of n values: their population standard deviation over sqrt(n)
  (for 0/1 values: sqrt(p (1 - p) / n)); 0 for a single value. The standard error of a mean over
  F families (GenEval's overall score) is ``sqrt(sum_f se_f^2) / F`` (independent families).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

DEFAULT_THRESHOLD = 0.5


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 - C(n - c, k) / C(n, k)`` for n trials with c successes.

    1.0 when fewer than k failures exist (n - c < k); exact integer binomials, so large n lose no
    precision. Raises ValueError unless 0 <= c <= n and 1 <= k <= n.
    """
    if not 0 <= c <= n:
        raise ValueError(f"successes c must be in [0, n] (got c={c}, n={n})")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n] (got k={k}, n={n})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_k_values(k_max: int) -> list[int]:
    """The k reported for K samples per prompt: powers of two below K, and K (K=6 -> [1, 2, 4, 6])."""
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1 (got {k_max})")
    ks, k = [], 1
    while k < k_max:
        ks.append(k)
        k *= 2
    return ks + [k_max]


def success_counts(scores: Tensor, threshold: float = DEFAULT_THRESHOLD) -> tuple[Tensor, Tensor]:
    """scores (P, K) -> (successes (P,), trials (P,)) int64: per prompt, how many valid scores are
    ``>= threshold`` and how many scores are valid (not NaN)."""
    if scores.dim() != 2:
        raise ValueError(f"scores must have shape (prompts, samples) (got {tuple(scores.shape)})")
    values = scores.detach().double()
    valid = ~values.isnan()
    successes = (valid & (values >= threshold)).sum(1)
    return successes.long(), valid.sum(1).long()


def is_binary(values: Tensor) -> bool:
    """True when every valid (non-NaN) value is exactly 0 or 1 and there is at least one."""
    valid = values[~values.isnan()]
    return bool(len(valid)) and bool(((valid == 0) | (valid == 1)).all())


def mean_and_se(values: Tensor | Sequence[float]) -> tuple[float, float]:
    """(mean, standard error) of the valid values: population std / sqrt(n). NaN values are
    dropped; (nan, nan) when none is left."""
    values = torch.as_tensor(values, dtype=torch.float64).flatten()
    values = values[~values.isnan()]
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    return float(values.mean()), float(values.std(correction=0)) / math.sqrt(n)


def family_mean_se(standard_errors: Sequence[float]) -> float:
    """Standard error of the mean over F families from their standard errors: sqrt(sum se^2) / F."""
    if not standard_errors:
        raise ValueError("family_mean_se needs at least one family")
    return math.sqrt(sum(se * se for se in standard_errors)) / len(standard_errors)


def summarize(successes: Tensor, trials: Tensor, ks: Sequence[int]) -> dict:
    """pass@k statistics of a set of prompts from their successes and trials (ints, (P,) each).

    Returns ``prompts`` (with at least one trial), ``samples`` (their trials), ``pass@k`` and
    ``pass@k_se`` (mean over the prompts with n >= k of their pass@k, and its standard error;
    None when no prompt has k trials), ``mixed_share`` (share of prompts with 0 < c < n) and its
    ``mixed_share_se``, and ``histogram``: entry j = number of prompts with j successes,
    j = 0..max(ks). Prompts without a trial are left out and counted in ``no_score_prompts``.
    """
    pairs = [(int(n), int(c)) for n, c in zip(trials.tolist(), successes.tolist())]
    scored = [(n, c) for n, c in pairs if n > 0]
    size = max(max(ks), max((n for n, _ in scored), default=0))
    histogram = [0] * (size + 1)
    for _, c in scored:
        histogram[c] += 1
    out: dict = {"prompts": len(scored), "samples": sum(n for n, _ in scored),
                 "no_score_prompts": len(pairs) - len(scored)}
    for k in ks:
        values = [pass_at_k(n, c, k) for n, c in scored if n >= k]
        mean, se = mean_and_se(values) if values else (None, None)
        out[f"pass@{k}"], out[f"pass@{k}_se"] = mean, se
    mixed = [float(0 < c < n) for n, c in scored]
    mean, se = mean_and_se(mixed) if mixed else (None, None)
    out["mixed_share"], out["mixed_share_se"] = mean, se
    out["histogram"] = histogram
    return out


def family_mean(per_family: dict[str, dict], ks: Sequence[int]) -> dict:
    """GenEval's overall score for each pass@k statistic: the mean over families (each family's
    value counts once), with standard error sqrt(sum se^2) / F; None when a family lacks it."""
    out: dict = {"families": len(per_family)}
    for name in [f"pass@{k}" for k in ks] + ["mixed_share"]:
        values = [f[name] for f in per_family.values()]
        if not values or any(v is None for v in values):
            out[name] = out[f"{name}_se"] = None
            continue
        out[name] = sum(values) / len(values)
        out[f"{name}_se"] = family_mean_se([f[f"{name}_se"] for f in per_family.values()])
    return out


def passk_report(scores: dict[str, Tensor], families: Sequence[str | None],
                 threshold: float = DEFAULT_THRESHOLD, keys: Sequence[str] | None = None) -> dict:
    """pass@k of every key in ``keys`` (default: the keys whose scores are all 0/1, see
    ``is_binary``), overall and per family.

    scores: key -> (P, K) scores of P prompts, K samples each; families: the P prompts' families
    (None = none). Returns ``{"threshold", "samples_per_prompt", "ks", "keys": {key: {"all",
    "families", "family_mean"}}}`` with ``summarize`` dicts under "all" and per family, and
    ``family_mean`` (mean over families) when any prompt has a family.
    """
    if not scores:
        raise ValueError("passk_report needs at least one reward key")
    shapes = {tuple(v.shape) for v in scores.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"every score table must have the same shape (prompts, samples) "
                         f"(got {sorted(shapes)})")
    num_prompts, k_max = next(iter(shapes))
    if len(families) != num_prompts:
        raise ValueError(f"families must have one entry per prompt ({num_prompts}), "
                         f"got {len(families)}")
    if keys is None:
        keys = [key for key, values in scores.items() if is_binary(values)]
    unknown = [key for key in keys if key not in scores]
    if unknown:
        raise ValueError(f"no reward key {unknown[0]!r}; the rewards give {', '.join(scores)}")
    ks = pass_k_values(k_max)
    names = sorted({f for f in families if f is not None})
    report: dict = {"threshold": threshold, "samples_per_prompt": k_max, "ks": ks, "keys": {}}
    for key in keys:
        successes, trials = success_counts(scores[key], threshold)
        entry: dict = {"all": summarize(successes, trials, ks), "families": {}}
        for name in names:
            mask = torch.tensor([f == name for f in families])
            entry["families"][name] = summarize(successes[mask], trials[mask], ks)
        if names:
            entry["family_mean"] = family_mean(entry["families"], ks)
        report["keys"][key] = entry
    return report


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_passk_table(report: dict) -> str:
    """A readable table per key: rows = families, the family mean and all prompts; columns =
    prompts, pass@k (+- standard error) for each k, mixed share, and the histogram of successes
    per prompt ("0:n0 1:n1 ..."). Keys whose tables are identical are printed once."""
    ks = report["ks"]
    blocks, seen = [], {}
    for key, entry in report["keys"].items():
        signature = repr(entry)
        if signature in seen:
            seen[signature].append(key)
            continue
        seen[signature] = [key]
    for names in seen.values():
        entry = report["keys"][names[0]]
        header = ["family", "prompts"] + [f"pass@{k}" for k in ks] + ["mixed",
                                                                      "successes:prompts"]
        rows = [header]
        listed = list(entry["families"].items())
        if "family_mean" in entry:
            listed.append(("family mean", entry["family_mean"]))
        listed.append(("all prompts", entry["all"]))
        for name, stats in listed:
            cells = [name, str(stats["prompts"]) if "prompts" in stats else
                     f"{stats['families']} families"]
            for k in ks:
                value, se = stats[f"pass@{k}"], stats[f"pass@{k}_se"]
                cells.append("n/a" if value is None else f"{value:.3f}+-{se:.3f}")
            cells.append(_number(stats["mixed_share"]))
            histogram = stats.get("histogram")
            cells.append(" ".join(f"{j}:{count}" for j, count in enumerate(histogram))
                         if histogram is not None else "")
            rows.append(cells)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip()
                 for row in rows]
        lines.insert(1, "  ".join("-" * width for width in widths))
        title = (f"pass@k of {' = '.join(names)} (success: score >= {report['threshold']}; "
                 f"{report['samples_per_prompt']} samples per prompt; mean +- standard error; "
                 f"'family mean' counts families, not prompts)")
        blocks.append(title + "\n" + "\n".join(lines))
    if not blocks:
        return ("pass@k: no reward key has 0/1 scores; pass --passk-keys KEY to threshold another "
                f"at {report['threshold']}")
    return "\n\n".join(blocks)
