"""The built-in configs and assets, from a checkout or from an installed wheel.

A checkout holds them at its root: ``configs/`` (the recipes, ``configs/toy_methods/``, the
``accelerate launch`` files in ``configs/accelerate/``) and ``assets/`` (the toy text-to-image and
editing models, the toy proxy reward, the tiny LM with its prompts, the small prompt files).
A wheel cannot install folders next to the packages, so its build (``setup.py``) copies them into
the package, as ``flowgrpo/_packaged/configs`` and ``flowgrpo/_packaged/assets``; ``data_root``
returns whichever of the two this ``flowgrpo`` runs from. An editable install has no copy and reads
the checkout's own folders.

The configs name assets by paths relative to a checkout's root (``model.path: assets/toy``,
``prompts.train: assets/lm/train.jsonl``), and the docs name configs the same way
(``configs/toy_geneval.yaml``). So that these work from any folder, one rule, in one place:

* ``resolve_packaged_path``: a relative path whose first part is ``assets`` or ``configs``, which
  does not exist relative to the current folder but names a shipped file or folder, is that
  shipped copy. A path that exists relative to the current folder is always the user's own and is
  left as it is (so a checkout, or a folder holding its own ``assets/``, behaves as before); so is
  every other string (hub ids, ``toy:train``, absolute paths).
* ``load_config`` applies it to every string of the built config (``with_packaged_paths``): the
  config file's values, the command line's overrides and the defaults alike. ``flowgrpo sample /
  eval / grid`` apply it to ``--model`` and ``--prompts``.
* ``resolve_config_path`` (``flowgrpo.config.read_config_file``): a config argument that does not
  exist on disk is looked up as a shipped path (``configs/toy_geneval.yaml``), then as a built-in
  name (``toy_geneval``, ``toy_methods/flow_grpo``, with or without ``.yaml``).
  ``flowgrpo configs`` lists the names (``builtin_configs``).
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
# Where a wheel's build puts the copies (setup.py's PACKAGED_DIR, relative to the build folder).
INSTALLED_DATA_DIR = PACKAGE_DIR / "_packaged"
# The folders of a checkout's root that are shipped; a path starting with one may be resolved.
SHIPPED_FOLDERS = ("configs", "assets")
CONFIG_SUFFIX = ".yaml"
# Sub-folder of configs/ holding ``accelerate launch --config_file`` files, not training configs.
ACCELERATE_FOLDER = "accelerate"
SUMMARY_WIDTH = 90   # characters of a config's one-line summary in ``flowgrpo configs``
# Config fields naming where a run writes (run.output_dir): never resolved, so that no run
# writes into the installed package.
OUTPUT_FIELDS = ("output_dir",)


def data_root() -> Path | None:
    """The folder holding ``configs/`` and ``assets/``: the wheel's copy inside the package, else
    the checkout this package was imported from (an editable install, or PYTHONPATH), else None
    (a partial install: then nothing resolves and paths keep their meaning relative to the
    current folder)."""
    if (INSTALLED_DATA_DIR / "configs").is_dir():
        return INSTALLED_DATA_DIR
    checkout = PACKAGE_DIR.parent
    # pyproject.toml tells a checkout from a site-packages folder that happens to hold a
    # "configs" package of another distribution.
    if (checkout / "pyproject.toml").is_file() and all(
            (checkout / folder).is_dir() for folder in SHIPPED_FOLDERS):
        return checkout
    return None


def _shipped_relative(path: str | os.PathLike) -> Path | None:
    """``path`` as a relative path under a shipped folder, or None when it cannot name a
    shipped file (absolute, not starting with configs/ or assets/, or climbing with ``..``)."""
    try:
        candidate = Path(path)
    except TypeError:
        return None
    parts = candidate.parts
    # A bare "assets" or "configs" is a folder of the user's, not a shipped item.
    if candidate.is_absolute() or len(parts) < 2 or parts[0] not in SHIPPED_FOLDERS or \
            ".." in parts:
        return None
    return candidate


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):   # a name too long for the file system, a NUL byte
        return False


def resolve_packaged_path(path: str) -> str:
    """``path``, or the absolute path of its shipped copy when ``path`` is relative, starts with
    ``assets/`` or ``configs/``, does not exist relative to the current folder and the shipped
    data holds it (``assets/toy`` -> ``.../flowgrpo/_packaged/assets/toy`` outside a checkout).
    Any other value comes back unchanged, so a user's own relative path keeps meaning the file
    under the current folder, and a missing one still fails where it is opened, naming it."""
    relative = _shipped_relative(path)
    if relative is None or _exists(relative):
        return path
    root = data_root()
    if root is None:
        return path
    shipped = root / relative
    return str(shipped) if _exists(shipped) else path


def with_packaged_paths(value: Any) -> Any:
    """``value`` with ``resolve_packaged_path`` applied to every string in it: the fields of a
    dataclass are replaced in place (the config ``load_config`` has just built), dicts, lists
    and tuples are rebuilt. Dict keys are names, not paths, and are kept."""
    if isinstance(value, str):
        return resolve_packaged_path(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            if field.name not in OUTPUT_FIELDS:
                setattr(value, field.name, with_packaged_paths(getattr(value, field.name)))
        return value
    if type(value) is dict:
        return {key: with_packaged_paths(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(with_packaged_paths(item) for item in value)
    return value


# ================================================================================ built-in configs
@dataclass(frozen=True)
class BuiltinConfig:
    """A config file shipped with flowgrpo: its ``name`` (the path under configs/ without
    ``.yaml``, e.g. ``toy_methods/flow_grpo``), where it is, and one line about it."""

    name: str
    path: Path
    summary: str


def configs_dir() -> Path | None:
    root = data_root()
    return None if root is None else root / "configs"


def builtin_config_path(name: str) -> Path | None:
    """The shipped training config called ``name`` (``toy_geneval`` or ``toy_geneval.yaml``,
    ``toy_methods/flow_grpo``; also ``accelerate/ddp``), or None."""
    folder = configs_dir()
    if folder is None or not name:
        return None
    relative = Path(name if name.endswith(CONFIG_SUFFIX) else name + CONFIG_SUFFIX)
    if relative.is_absolute() or ".." in relative.parts:
        return None
    path = folder / relative
    return path if path.is_file() else None


def resolve_config_path(path: str | os.PathLike) -> Path:
    """A config argument as the file to read: ``path`` itself when it exists on disk (it always
    wins), else its shipped copy when it is a checkout-relative path (``configs/toy_geneval.yaml``
    from any folder), else the built-in config of that name (``toy_geneval``), else ``path``
    unchanged (reading it then reports it missing)."""
    given = Path(path)
    if _exists(given):
        return given
    shipped = resolve_packaged_path(str(path))
    if shipped != str(path):
        return Path(shipped)
    builtin = builtin_config_path(str(path))
    return builtin if builtin is not None else given


# Words whose period does not end a sentence ("Dr. GRPO on the tiny LM").
_ABBREVIATIONS = ("Dr.", "e.g.", "i.e.", "vs.", "cf.")


def _without_parentheses(text: str) -> str:
    """``text`` without its parenthesised asides (sources, file names, numbers), which make a
    one-line summary long without saying what the config is."""
    previous = None
    while previous != text:
        previous, text = text, re.sub(r"\s*\([^()]*\)", "", text)
    return text


def _first_sentence(text: str) -> str:
    for match in re.finditer(r"\.\s", text):
        word = text[:match.start() + 1].rsplit(" ", 1)[-1]
        if word not in _ABBREVIATIONS:
            return text[:match.start() + 1]
    return text


def config_summary(path: Path, width: int = SUMMARY_WIDTH) -> str:
    """One line about a config: the first sentence of the first paragraph of the comment block at
    its top (the paragraph ends at an empty comment line or an indented command line such as
    ``#   flowgrpo train ...``), cut to ``width`` characters at a word; a file without such a
    comment gives its ``name:``, else an empty string."""
    text = path.read_text(encoding="utf-8")
    paragraph: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line[1:]
        if not body.strip() or body.startswith("  "):
            if paragraph:
                break
            continue
        paragraph.append(body.strip())
    if not paragraph:
        name = re.search(r"^name:[ \t]*(\S+)", text, re.MULTILINE)
        return name[1] if name else ""
    sentence = _first_sentence(_without_parentheses(" ".join(paragraph)))
    if len(sentence) > width:
        sentence = sentence[:width - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."
    return sentence


def _list(folder: Path, pattern: str) -> list[BuiltinConfig]:
    return [BuiltinConfig(path.relative_to(folder).with_suffix("").as_posix(), path,
                          config_summary(path))
            for path in sorted(folder.glob(pattern))]


def builtin_configs() -> list[BuiltinConfig]:
    """The shipped training configs: configs/*.yaml, then each sub-folder's (toy_methods/...),
    without the accelerate files."""
    folder = configs_dir()
    if folder is None:
        return []
    nested = [config for config in _list(folder, f"*/*{CONFIG_SUFFIX}")
              if not config.name.startswith(f"{ACCELERATE_FOLDER}/")]
    return [*_list(folder, f"*{CONFIG_SUFFIX}"), *nested]


def accelerate_configs() -> list[BuiltinConfig]:
    """The shipped ``accelerate launch --config_file`` files (configs/accelerate/*.yaml)."""
    folder = configs_dir()
    if folder is None or not (folder / ACCELERATE_FOLDER).is_dir():
        return []
    return _list(folder, f"{ACCELERATE_FOLDER}/*{CONFIG_SUFFIX}")
