"""Command line: ``flowgrpo train | sample | eval | grid | configs | fetch-prompts | serve-reward``.

Each sub-command validates its arguments before it loads a model, and exits with a one-line error
(status 2) on bad input instead of a traceback. What counts as bad input is per command
(``input_errors`` in its defaults): for ``train``, whose runs last days, only ``InputError``
(``ConfigError`` is one): a ValueError from deep inside training is a bug or a failure and keeps
its traceback. The other commands treat ValueError / FileNotFoundError as bad input, which they
raise for their argument checks before any model loads. A run that stops before its end on
purpose (``RunStopped``: a signal, no finite reward, non-finite gradients) prints its one line and
exits with its own code (128 + the signal's number for a signal, else 1); Ctrl-C outside a run's
handlers prints "interrupted" and exits 130.
"""
from __future__ import annotations

import argparse
import os
import sys

from flowgrpo import __version__
from flowgrpo.commands import add_commands
from flowgrpo.config import help_text, load_config
from flowgrpo.errors import InputError, RunStopped
from flowgrpo.tiny_recipe import load_tiny_config
from flowgrpo.trainer import Trainer
from pipelines import MODEL_FAMILIES
from reward_models import available_rewards
from reward_models.server import add_serve_reward_parser

# Bad-input exceptions of commands that do not set their own (sample, eval, grid, serve-reward).
DEFAULT_INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)


def config_help() -> str:
    """``flowgrpo train --help-config``: every config field, with the names the registries own
    (model families, rewards) listed where a field takes them."""
    rewards = (*available_rewards(), "'package.module:Class'")
    return help_text(choices={"model.family": tuple(MODEL_FAMILIES),
                              "rewards.components": rewards, "eval.rewards": rewards})


def _train(args: argparse.Namespace) -> int:
    if args.help_config:
        print(config_help())
        return 0
    if not args.config:
        raise InputError("flowgrpo train needs a CONFIG: a YAML file or a built-in config's "
                         "name, e.g. toy_geneval (flowgrpo configs lists them)")
    if args.tiny:
        os.environ["ACCELERATE_USE_CPU"] = "true"   # read when the trainer builds its Accelerator
        config = load_tiny_config(args.config, args.overrides)
    else:
        config = load_config(args.config, args.overrides)
    # resume/overwrite go to the constructor: the run folder is checked before the model loads.
    Trainer(config, resume=args.resume, overwrite=args.overwrite).train()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo",
        description=f"GRPO for flow-matching image/video models ({', '.join(MODEL_FAMILIES)}) "
                    f"and LLMs.")
    parser.add_argument("--version", action="version", version=f"flowgrpo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train a policy from a YAML config",
                           description="Train with GRPO. Overrides are dotted keys, e.g. "
                                       "training.lr=1e-4 run.max_iterations=50.")
    train.add_argument("config", nargs="?",
                       help="YAML config file, or a built-in config's name (flowgrpo configs)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")
    start = train.add_mutually_exclusive_group()
    start.add_argument("--resume", default=None, metavar="latest|auto|PATH",
                       help="continue a run: 'latest' (its newest complete checkpoint; an error "
                            "when there is none), 'auto' (the newest, or start from scratch when "
                            "there is none) or a checkpoint folder (of any run)")
    start.add_argument("--overwrite", action="store_true",
                       help="delete what the run folder holds and start again (without this or "
                            "--resume, a run folder that holds a run is refused)")
    train.add_argument("--tiny", action="store_true",
                       help="run the recipe on its model family's tiny offline build (made once "
                            "under $FLOWGRPO_TINY_DIR or ~/.cache/flowgrpo/tiny), small sizes, "
                            "float32, on the CPU, with tiny random weights for hub-weight rewards; "
                            "the method settings (plan, SDE, clip, KL, optimiser steps) stay the "
                            "recipe's; the run is named <name>_tiny (flowgrpo/tiny_recipe.py)")
    train.add_argument("--help-config", action="store_true",
                       help="print every config field with its default and help text")
    train.set_defaults(handler=_train, input_errors=(InputError,))
    add_commands(sub)
    add_serve_reward_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # argparse ends a positional list at the first flag, so `train CONFIG --resume latest a.b=1`
    # would leave `a.b=1` unrecognised: key=value words after a flag are overrides too.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in word and not word.startswith("-")
                                               for word in extra):
            args.overrides = [*(args.overrides or []), *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler = getattr(args, "handler", None) or getattr(args, "func", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return int(handler(args) or 0)
    except RunStopped as err:   # a signal, no finite reward, non-finite gradients: said in one line
        if not err.quiet:
            print(f"flowgrpo {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:   # `flowgrpo configs | head`: the reader left, which is no error
        # Python flushes stdout again at exit; pointing it at /dev/null keeps that quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:   # Ctrl-C where no handler saves (start-up, other commands)
        print(f"flowgrpo {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        input_errors = getattr(args, "input_errors", None) or DEFAULT_INPUT_ERRORS
        if not isinstance(err, input_errors):
            raise   # not the user's input: keep the traceback
        print(f"flowgrpo {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
