"""Command line: ``flowgrpo train | sample | eval | grid | serve-reward``.

Each sub-command validates its arguments before it loads a model, and exits with a one-line error
(status 2) on bad input instead of a traceback.
"""
from __future__ import annotations

import argparse
import sys

from flowgrpo import __version__


def _train(args: argparse.Namespace) -> int:
    from flowgrpo.config import help_text, load_config

    if args.help_config:
        print(help_text())
        return 0
    if not args.config:
        raise ValueError("flowgrpo train needs a CONFIG file, e.g. configs/toy_geneval.yaml")
    from flowgrpo.trainer import Trainer

    config = load_config(args.config, args.overrides)
    Trainer(config).train(resume=args.resume)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo",
        description="GRPO for flow-matching image/video models (SD3, FLUX.1, Wan2.1, toy) and LLMs.")
    parser.add_argument("--version", action="version", version=f"flowgrpo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train a policy from a YAML config",
                           description="Train with GRPO. Overrides are dotted keys, e.g. "
                                       "training.lr=1e-4 run.max_iterations=50.")
    train.add_argument("config", nargs="?", help="YAML config (see configs/)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")
    train.add_argument("--resume", default=None,
                       help="'latest' (newest checkpoint of this run) or a checkpoint folder")
    train.add_argument("--help-config", action="store_true",
                       help="print every config field with its default and help text")
    train.set_defaults(handler=_train)

    try:
        from flowgrpo.commands import add_commands
    except ImportError:
        pass
    else:
        add_commands(sub)
    try:
        from reward_models.server import add_serve_reward_parser
    except ImportError:
        pass
    else:
        add_serve_reward_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None) or getattr(args, "func", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return int(handler(args) or 0)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"flowgrpo {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
