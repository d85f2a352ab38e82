"""``flowgrpo configs``: the built-in configs, one line each, and where a shipped one lies.

``flowgrpo train NAME`` takes a listed name from any folder (``flowgrpo.packaged_data``); the
accelerate files are for ``accelerate launch --config_file PATH``, so ``--path NAME`` prints a
shipped file's absolute path, also for copying a recipe to edit.
"""
from __future__ import annotations

import argparse

from flowgrpo.packaged_data import (BuiltinConfig, accelerate_configs, builtin_config_path,
                                    builtin_configs, configs_dir)


def _table(configs: list[BuiltinConfig]) -> list[str]:
    width = max(len(config.name) for config in configs)
    return [f"  {config.name:<{width}}  {config.summary}".rstrip() for config in configs]


def run_configs(args: argparse.Namespace) -> int:
    if args.path is not None:
        path = builtin_config_path(args.path)
        if path is None:
            raise ValueError(f"--path {args.path!r} is not a built-in config; `flowgrpo configs` "
                             f"lists their names (e.g. toy_geneval, accelerate/ddp)")
        print(path)
        return 0
    training = builtin_configs()
    if not training:
        raise FileNotFoundError("no built-in configs found: this flowgrpo was installed without "
                                "its configs and assets (install it from its wheel, or "
                                "`pip install -e .` in a checkout)")
    print(f"Built-in configs (flowgrpo train NAME [section.key=value ...]), in {configs_dir()}:")
    print("\n".join(_table(training)))
    launch = accelerate_configs()
    if launch:
        print("\nAccelerate files (accelerate launch --config_file "
              "\"$(flowgrpo configs --path accelerate/NAME)\" -m flowgrpo train CONFIG):")
        print("\n".join(_table(launch)))
    return 0


def add_configs_parser(subparsers) -> None:
    """Register ``configs`` on the ``flowgrpo`` sub-command parser."""
    configs = subparsers.add_parser(
        "configs", help="list the built-in configs (flowgrpo train NAME works from any folder)",
        description="List the configs shipped with flowgrpo, one line each. A listed name is a "
                    "CONFIG for `flowgrpo train` (and `flowgrpo eval`) from any folder; a file "
                    "of that name in the current folder wins over it.")
    configs.add_argument("--path", default=None, metavar="NAME",
                         help="print the absolute path of built-in config NAME (e.g. "
                              "accelerate/ddp for accelerate launch --config_file, or "
                              "toy_geneval to copy and edit)")
    configs.set_defaults(handler=run_configs)
