"""The run's metrics log (``metrics.jsonl``: one JSON record per iteration and per evaluation)
and its end-of-run summary."""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

from flowgrpo.checkpoint import TMP_PREFIX
from flowgrpo.curves import metric_keys
from flowgrpo.heldout import metric_higher_is_better, metric_reward_key


def append_record(path: Path, record: dict) -> None:
    """Append one record, on disk before the run goes on: a crash loses at most the line being
    written (a torn last line, which ``keep_records`` drops at the next start)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def keep_records(path: Path, start: int) -> None:
    """Keep the records up to iteration ``start`` (none for a new run): a resumed run
    rewrites what came after its checkpoint, so the log has no duplicates. A line that is
    not a JSON record (the torn last line of a killed run) is dropped with a warning. The
    rewrite is atomic: a crash during it leaves the old log."""
    if not path.exists():
        return
    keep, torn = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            iteration = int(record["iteration"])
        except (ValueError, KeyError, TypeError):
            torn.append(number)
            continue
        if iteration <= start:
            keep.append(line)
    if torn:
        warnings.warn(f"{path}: dropped {len(torn)} unreadable line(s) (line "
                      f"{', '.join(map(str, torn))}; a run killed while writing leaves its "
                      f"last line torn)", RuntimeWarning, stacklevel=2)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in keep) if start else "")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_records(path: Path) -> list[dict]:
    """The records of a metrics log (unreadable lines skipped); [] when there is none."""
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "iteration" in record:
            records.append(record)
    return records


def _direction_note(key: str, directions: dict[str, bool], heldout) -> str:
    notes = []
    if metric_reward_key(key) in heldout:
        notes.append("held-out")
    if not metric_higher_is_better(key, directions):
        notes.append("lower is better")
    return f" [{', '.join(notes)}]" if notes else ""


def best_of(evals: list[dict], key: str, higher: bool) -> tuple[float, int] | None:
    """(best value, its iteration) of ``key`` over evaluation records (the earliest on ties;
    NaN left out), or None."""
    best = None
    for record in evals:
        value = record.get(key)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if best is None or (value > best[0] if higher else value < best[0]):
            best = (float(value), int(record["iteration"]))
    return best


def eval_line(iteration: int, record: dict, directions: dict[str, bool] | None = None,
              heldout=()) -> str:
    """One line per evaluation: each reward's headline metric (its family mean where there is
    one) with its standard error, held-out metrics and lower-is-better ones marked."""
    directions = directions or {}
    parts = []
    for key in metric_keys([record]):
        se = record.get(f"{key}/se")
        value = record[key]
        parts.append(f"{key[len('eval/'):]} {value:.4g}"
                     + (f" (se {se:.2g})" if isinstance(se, float) and math.isfinite(se) else "")
                     + _direction_note(key, directions, set(heldout)))
    return f"eval at iteration {iteration}: " + ("; ".join(parts) or "no metrics")


def summary_line(name: str, history: list[dict], seconds: float, run_dir: Path,
                 directions: dict[str, bool] | None = None, heldout=(),
                 best: dict | None = None, stopped_early: int | None = None,
                 patience: int = 0) -> str:
    """The one-line end-of-run summary: iterations, seconds, first -> last train reward and,
    for every evaluated metric (each reward key and component; its family mean where the
    prompts have families) of the training rewards and of ``eval.rewards`` (``heldout``:
    their keys), first -> last evaluation with its standard error and, over several
    evaluations, the best one and its iteration (the smallest for a lower-is-better reward:
    ``directions``, reward key -> higher is better); the run.select_best_on checkpoint
    (``best``: ``BestRecord.state_dict()``), an early stop, and where the grid and outputs are."""
    directions = directions or {}
    heldout = set(heldout)
    evals = [h for h in history if h["phase"] == "eval"]
    trains = [h for h in history if h["phase"] == "train"]
    parts = [f"{name}: {len(trains)} iterations in {seconds:.0f} s"]
    if trains:
        parts.append(f"train reward {trains[0].get('reward/total/mean', float('nan')):.3f} -> "
                     f"{trains[-1].get('reward/total/mean', float('nan')):.3f}")
    if len(evals) >= 1:
        for key in metric_keys([evals[-1]]):
            first = evals[0].get(key, float("nan"))
            se = evals[-1].get(f"{key}/se")
            text = (f"{key}{_direction_note(key, directions, heldout)} {first:.3f} -> "
                    f"{evals[-1][key]:.3f}" + (f" (se {se:.3f})" if se is not None else ""))
            top = best_of(evals, key, metric_higher_is_better(key, directions))
            if len(evals) > 1 and top is not None:
                text += f", best {top[0]:.3f} at {top[1]}"
            parts.append(text)
    if best and best.get("iteration") is not None:
        parts.append(f"best checkpoint: {best['key']} {best['value']:.4g} ({best['mode']}) at "
                     f"iteration {best['iteration']} in {run_dir / 'checkpoints' / 'best'}")
    if stopped_early is not None:
        parts.append(f"stopped early at iteration {stopped_early}: no new best in {patience} "
                     f"evaluations")
    for grid in ("comparison.png", "comparison.md"):
        if (run_dir / grid).is_file():
            parts.append(f"grid {run_dir / grid}")
    if (run_dir / "curves.png").is_file():
        parts.append(f"curves {run_dir / 'curves.png'}")
    parts.append(f"outputs in {run_dir}")
    return " | ".join(parts)
