"""Offline preference pairs for Diffusion-DPO (``training.dpo.pairs_file``): reading and checking
the file at config load, and the pairs an iteration trains.

The file is JSONL, one object a line: ``{"prompt": "a red cube", "chosen": "a.png", "rejected":
"b.png"}`` with image paths relative to the file. Only text and image headers are read when the
config loads (JSON, never a pickle); an iteration's images are decoded when it trains them. Every
mistake is one ``InputError`` line naming ``training.dpo.pairs_file``, the line and the fix.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from flowgrpo.errors import ConfigError, InputError
from flowgrpo.prompts import load_image
from flowgrpo.seeding import seeded_generator
from flowgrpo.user_files import read_text_file

FIELD = "training.dpo.pairs_file"
PAIR_KEYS = ("prompt", "chosen", "rejected")
_EXAMPLE = '{"prompt": "a red cube", "chosen": "good.png", "rejected": "bad.png"}'
_FORMAT = (f"give a .jsonl file with one object a line like {_EXAMPLE} (image paths relative to "
           f"the file)")


@dataclass(frozen=True)
class PreferencePair:
    """One line of a pairs file: the prompt and the paths of its chosen and rejected images."""

    prompt: str
    chosen: Path
    rejected: Path


def _kind(value: object) -> str:
    return {str: "string", bool: "boolean", int: "number", float: "number", list: "array",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def _check_image(path: Path, key: str, where: str) -> None:
    """``path`` exists and its header is an image format PIL reads (the pixels are decoded when
    the pair trains)."""
    if not path.is_file():
        raise InputError(f"{where}: \"{key}\" image {path} does not exist; \"{key}\" is a path "
                         f"relative to the pairs file")
    try:
        with Image.open(path) as handle:
            handle.size  # noqa: B018 (the header parse is the check)
    except (UnidentifiedImageError, OSError) as err:
        raise InputError(f"{where}: \"{key}\" {path} is not an image PIL can read ({err}); give "
                         f"a PNG or JPEG") from None


def _pair(line: str, where: str, folder: Path) -> PreferencePair:
    try:
        item = json.loads(line)
    except ValueError as err:
        raise InputError(f"{where}: not valid JSON ({err}); {_FORMAT}") from None
    if not isinstance(item, dict):
        raise InputError(f"{where}: expected a JSON object, got a JSON {_kind(item)}; {_FORMAT}")
    for key in PAIR_KEYS:
        if key not in item:
            raise InputError(f"{where}: no \"{key}\" field; each line needs \"prompt\", "
                             f"\"chosen\" and \"rejected\" ({_EXAMPLE})")
        value = item[key]
        if not isinstance(value, str) or not value.strip():
            got = f"a JSON {_kind(value)}" if not isinstance(value, str) else "empty"
            raise InputError(f"{where}: \"{key}\" must be a non-empty string (got {got}); "
                             f"{_FORMAT}")
    chosen, rejected = folder / item["chosen"], folder / item["rejected"]
    _check_image(chosen, "chosen", where)
    _check_image(rejected, "rejected", where)
    return PreferencePair(item["prompt"], chosen, rejected)


_CACHE: dict[tuple, list[PreferencePair]] = {}


def read_pairs_file(path: str | os.PathLike) -> list[PreferencePair]:
    """The pairs of a JSONL pairs file, in file order (blank lines skipped). InputError naming
    ``training.dpo.pairs_file`` (and ``file:line``) when the file is missing, not a .jsonl file,
    not UTF-8, malformed, lacks a key, names a missing or non-image file, or holds no pair. A file
    read once is not read again until it changes (the config is validated more than once)."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        raise InputError(f"{FIELD} {path}: {path.suffix or 'no suffix'} is not JSONL; {_FORMAT}")
    text = read_text_file(path, f"{FIELD}", _FORMAT)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _CACHE:
        pairs = [_pair(line, f"{FIELD} {path}:{number}", path.parent)
                 for number, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not pairs:
            raise InputError(f"{FIELD} {path} holds no pairs (it is empty or only blank lines); "
                             f"{_FORMAT}")
        _CACHE[key] = pairs
    return _CACHE[key]


def check_pairs_config(config, encodes_images: bool, edits_images: bool) -> None:
    """At config load: a ``training.dpo.pairs_file`` is for ``training.algorithm: dpo``, on a
    model family that can VAE-encode images (``encodes_images``: an adapter with
    ``encode_images``) and is not an editing family (``edits_images``: a pair carries no source
    image), without ``training.skip_zero_std_groups`` (it skips units by the rollout's
    advantages, which offline pairs have none of); and the file itself reads."""
    t = config.training
    if t.dpo.pairs_file is None:
        return
    if t.algorithm != "dpo":
        raise ConfigError(f"{FIELD} is set but training.algorithm is {t.algorithm!r}: offline "
                          f"pairs train with training.algorithm: dpo; set it, or remove "
                          f"pairs_file")
    family = config.model.family
    if not encodes_images:
        raise ConfigError(f"{FIELD} needs the model to VAE-encode the pairs' images "
                          f"(encode_images: toy, sd3, flux), which the {family} adapter does not do: remove "
                          f"pairs_file (online pairs only) or use such a family")
    if edits_images:
        raise ConfigError(f"{FIELD}: the {family} family edits source images, and a pair "
                          f"carries none: remove pairs_file or use a text-to-image family")
    if t.skip_zero_std_groups:
        raise ConfigError(f"{FIELD} with training.skip_zero_std_groups: offline pairs have no "
                          f"rollout advantages to skip by (online pairs always differ in reward): "
                          f"set skip_zero_std_groups: false")
    read_pairs_file(t.dpo.pairs_file)


def iteration_pairs(count: int, per_iteration: int, seed: int, iteration: int) -> list[int]:
    """Indices into the file's pairs of the ``per_iteration`` pairs iteration ``iteration``
    trains: consecutive slices of one permutation of the file per pass (pass p drawn by (seed,
    p)), so every pair is trained once per pass, and the draw depends on (seed, iteration) only:
    the same on any process count and on a resume."""
    start = iteration * per_iteration
    picked: list[int] = []
    while len(picked) < per_iteration:
        position = start + len(picked)
        epoch, offset = divmod(position, count)
        order = torch.randperm(count, generator=seeded_generator(seed, "dpo_pairs", epoch))
        take = min(per_iteration - len(picked), count - offset)
        picked.extend(order[offset:offset + take].tolist())
    return picked


def load_pair_images(pairs: list[PreferencePair]) -> tuple[list[Tensor], list[Tensor]]:
    """(chosen images, rejected images) of ``pairs``, float32 (3, H, W) in [0, 1]."""
    chosen = [load_image(p.chosen, f"{FIELD} \"chosen\"") for p in pairs]
    rejected = [load_image(p.rejected, f"{FIELD} \"rejected\"") for p in pairs]
    return chosen, rejected
