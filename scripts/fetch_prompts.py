"""Fetch the anchors' prompt sets into assets/prompts/fetched/<name>/ (flowgrpo/prompt_sets.py).

    python scripts/fetch_prompts.py --list
    python scripts/fetch_prompts.py flow_grpo_ocr flow_grpo_pickscore
    python scripts/fetch_prompts.py mixgrpo_hpdv2 --accept-license

Pinned files are checked against their git blob id at the pinned commit; sets whose terms
restrict their use are fetched only with --accept-license (read the terms --list prints).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flowgrpo.prompt_sets import PROMPT_SETS, fetch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"sets to fetch: {', '.join(PROMPT_SETS)}")
    parser.add_argument("--list", action="store_true", help="list the sets with their terms")
    parser.add_argument("--accept-license", action="store_true",
                        help="fetch sets whose terms restrict their use (academic only, or none "
                             "stated) after reading them")
    parser.add_argument("--root", default=None,
                        help="folder of the sets (default assets/prompts/fetched)")
    args = parser.parse_args(argv)
    if args.list or not args.names:
        for prompt_set in PROMPT_SETS.values():
            flag = " (needs --accept-license)" if prompt_set.needs_acceptance else ""
            print(f"{prompt_set.name}{flag}\n  {prompt_set.anchor}\n  {prompt_set.repository} "
                  f"@ {prompt_set.commit}\n  terms: {prompt_set.terms}")
        return 0
    for name in args.names:
        try:
            fetch(name, args.root, accept_license=args.accept_license)
        except (ValueError, PermissionError, OSError) as err:
            print(f"fetch_prompts: {name}: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
