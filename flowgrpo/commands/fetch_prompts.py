"""``flowgrpo fetch-prompts``: download the anchors' prompt sets (``flowgrpo.prompt_sets``).

The sets are the anchors' data with their own terms, so neither the repository nor the wheel
ships them; this command fetches one into ``assets/prompts/fetched/<name>/`` under the current
folder (where the recipes look for it; ``--root`` elsewhere), from a clone or an installed wheel
alike. ``scripts/fetch_prompts.py`` in a clone runs the same code.
"""
from __future__ import annotations

import argparse

from flowgrpo.prompt_sets import PROMPT_SETS, fetch


def list_sets() -> str:
    """Every registered set: its name, anchor, source at the pinned commit and terms."""
    lines = []
    for prompt_set in PROMPT_SETS.values():
        flag = " (needs --accept-license)" if prompt_set.needs_acceptance else ""
        lines.append(f"{prompt_set.name}{flag}\n  {prompt_set.anchor}\n  {prompt_set.repository} "
                     f"@ {prompt_set.commit}\n  terms: {prompt_set.terms}")
    return "\n".join(lines)


def run_fetch_prompts(args: argparse.Namespace) -> int:
    if args.list or not args.names:
        print(list_sets())
        return 0
    unknown = [name for name in args.names if name not in PROMPT_SETS]
    if unknown:   # before anything is downloaded
        raise ValueError(f"unknown prompt set {unknown[0]!r}; known: {', '.join(PROMPT_SETS)} "
                         f"(--list shows their sources and terms)")
    for name in args.names:
        try:
            fetch(name, args.root, accept_license=args.accept_license)
        except PermissionError as err:   # terms not accepted: a user decision, not a failure
            raise ValueError(f"{name}: {err}") from None
    return 0


def add_fetch_prompts_parser(subparsers) -> None:
    """Register ``fetch-prompts`` on the ``flowgrpo`` sub-command parser."""
    parser = subparsers.add_parser(
        "fetch-prompts", help="download the anchors' prompt sets the GPU recipes train on",
        description="Download prompt sets into assets/prompts/fetched/NAME/ (pinned files are "
                    "checked against their git blob ids); without NAME, list the sets and "
                    "their terms.")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"sets to fetch: {', '.join(PROMPT_SETS)}")
    parser.add_argument("--list", action="store_true", help="list the sets with their terms")
    parser.add_argument("--accept-license", action="store_true",
                        help="fetch sets whose terms restrict their use (academic only, or none "
                             "stated) after reading them")
    parser.add_argument("--root", default=None,
                        help="folder of the sets (default assets/prompts/fetched)")
    parser.set_defaults(handler=run_fetch_prompts, input_errors=(ValueError, OSError))
