"""The run's metrics log (``metrics.jsonl``: one JSON record per iteration and per evaluation)
and its end-of-run summary."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from flowgrpo.checkpoint import TMP_PREFIX


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


def summary_line(name: str, history: list[dict], seconds: float, run_dir: Path) -> str:
    """The one-line end-of-run summary: iterations, seconds, first -> last train reward and
    first -> last evaluation (with its standard error), where the grid and outputs are."""
    evals = [h for h in history if h["phase"] == "eval"]
    trains = [h for h in history if h["phase"] == "train"]
    parts = [f"{name}: {len(trains)} iterations in {seconds:.0f} s"]
    if trains:
        parts.append(f"train reward {trains[0].get('reward/total/mean', float('nan')):.3f} -> "
                     f"{trains[-1].get('reward/total/mean', float('nan')):.3f}")
    if len(evals) >= 1:
        keys = [k for k in evals[-1] if k.startswith("eval/") and
                (k.count("/") == 1 or k.endswith("/family_mean"))]
        for key in keys:
            first = evals[0].get(key, float("nan"))
            se = evals[-1].get(f"{key}/se")
            parts.append(f"{key} {first:.3f} -> {evals[-1][key]:.3f}"
                         + (f" (se {se:.3f})" if se is not None else ""))
    for grid in ("comparison.png", "comparison.md"):
        if (run_dir / grid).is_file():
            parts.append(f"grid {run_dir / grid}")
    parts.append(f"outputs in {run_dir}")
    return " | ".join(parts)
