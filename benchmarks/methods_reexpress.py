"""Keep a method's committed run records reusable after its config file changed.

A record's signature digests the resolved config it ran (benchmarks/methods_runs.py,
``RunSpec.signature``); after a shipped value changes, rerunning the record's command would
refuse it as "measured with other settings". Re-expressing writes the old values into the
record's overrides (those it does not already set), so its command names what it ran, and keeps
the record only if the resolved config is digested to the very value it was stored with.

    python benchmarks/methods_reexpress.py flash_grpo training.lr=2e-4 \
        sampling.share_initial_noise=false run.max_iterations=101
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.methods_runs import RunSpec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "methods"


def reexpress(record: dict, old_values: dict[str, str]) -> dict | None:
    """``record`` with ``old_values`` (dotted field -> its value then) added to its overrides, or
    None when it needs none (its signature still holds) or when they do not reproduce its stored
    digest (then the old values are wrong and the record must be left alone). A record with its
    own max_iterations (tuning's scaled schedule) ignores an old ``run.max_iterations``."""
    sig = record["signature"]
    if RunSpec.of_record(record).signature() == sig:
        return None
    have = {o.split("=", 1)[0] for o in sig["overrides"]}
    extra = tuple(f"{k}={v}" for k, v in old_values.items() if k not in have
                  and not (k == "run.max_iterations" and sig["max_iterations"] is not None))
    new = RunSpec.of_record(record, extra).signature()
    if new["config_digest"] != sig["config_digest"]:
        return None
    return {**record, "signature": {**sig, "overrides": new["overrides"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method")
    parser.add_argument("old_values", nargs="+", metavar="FIELD=VALUE",
                        help="each changed field with the value the records ran")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    bad = [v for v in args.old_values if "=" not in v or not v.split("=", 1)[0]]
    if bad:
        parser.error(f"old values must be FIELD=VALUE (e.g. training.lr=2e-4); got {bad}")
    old = dict(v.split("=", 1) for v in args.old_values)
    # The benchmark sets these for every run after the config is read, so a config's own value
    # never reached a record: naming one would override the benchmark's and break the digest.
    fixed = {o.split("=", 1)[0] for o in RunSpec(args.method, 0, "k", 1.0, 1.0, 0).common_overrides(Path("out"))}
    if fixed & old.keys():
        parser.error(f"{sorted(fixed & old.keys())} are set by the benchmark for every run (not "
                     f"from the config): leave them out")
    stale = 0
    for path in sorted(args.results.glob("**/runs/*.json")):
        text = path.read_text()
        record = json.loads(text)
        if not record.get("finished") or record["signature"]["method"] != args.method:
            continue
        if RunSpec.of_record(record).signature() == record["signature"]:
            continue
        new = reexpress(record, old)
        if new is None:
            print(f"left alone (the old values do not reproduce its digest): {path}")
            stale += 1
            continue
        indent = 1 if text.startswith('{\n "') else 2   # keep each file's own layout
        path.write_text(json.dumps(new, indent=indent) + "\n")
        print(f"re-expressed {path}: + {new['signature']['overrides'][len(record['signature']['overrides']):]}")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
