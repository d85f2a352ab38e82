"""docs/recipes.md covers every shipped GPU config field by field: a config with a GPU family
(anything but the toy models and the LLM recipes) has a section, the section's first column names
every field the config sets under model / prompts / sampling / training / rewards / run, and
every field it names exists in that config (a dataclass field, or a key the config gives to a
dict such as ``model.options``)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from flowgrpo.config import load_config

DOC = Path("docs/recipes.md")
# The sections of a config this page documents; other top-level sections are documented where
# their feature is.
COVERED = ("model", "prompts", "sampling", "training", "rewards", "run")
FIELD = re.compile(r"`([a-z_]+(?:\.[a-z0-9_]+)+)`")


def _gpu_configs() -> list[Path]:
    out = []
    for path in sorted(Path("configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        if raw.get("policy", "flow") == "flow" and \
                (raw.get("model") or {}).get("family", "toy") != "toy":
            out.append(path)
    return out


def _sections() -> dict[str, str]:
    """'<name>.yaml' -> the text of its section (up to the next '## ')."""
    text = DOC.read_text()
    out = {}
    for match in re.finditer(r"^## `([\w.-]+\.yaml)`.*$", text, flags=re.M):
        end = text.find("\n## ", match.end())
        out[match.group(1)] = text[match.end():end if end >= 0 else len(text)]
    return out


def _named_fields(section: str) -> set[str]:
    """Dotted field names in the first column of the section's table rows."""
    names = set()
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        first = line.split("|")[1]
        names.update(FIELD.findall(first))
    return names


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def _exists(config, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        if dataclasses.is_dataclass(node):
            if part not in {f.name for f in dataclasses.fields(node)}:
                return False
            node = getattr(node, part)
        elif isinstance(node, dict):
            if part not in node:
                return False
            node = node[part]
        else:
            return False
    return True


@pytest.mark.parametrize("path", _gpu_configs(), ids=lambda p: p.stem)
def test_every_gpu_config_is_documented_field_by_field(path):
    sections = _sections()
    assert path.name in sections, f"docs/recipes.md has no section for {path.name}"
    named = _named_fields(sections[path.name])
    config = load_config(path)
    unknown = sorted(n for n in named if not _exists(config, n))
    assert not unknown, f"{path.name}'s section names fields the config does not have: {unknown}"
    raw = yaml.safe_load(path.read_text())
    set_fields = [leaf for leaf in _leaves(raw) if leaf.split(".")[0] in COVERED]
    missing = [leaf for leaf in set_fields if leaf not in named]
    assert not missing, f"{path.name} sets fields its section does not list: {missing}"


def test_the_checks_catch_what_they_are_for():
    """A section that names an options key the config lacks, or misses a field, is caught."""
    config = load_config("configs/flux_pickscore.yaml")
    assert not _exists(config, "model.options.max_sequence_length")
    assert _exists(config, "model.options.height") and _exists(config, "training.ema.warmup")
    assert not _exists(config, "training.ema.warm_up")
    row = "| `sampling.num_steps`, `sampling.eval_num_steps` | 25 | `sampling_steps=25` |"
    assert _named_fields(row) == {"sampling.num_steps", "sampling.eval_num_steps"}
    assert "flux_pickscore.yaml" in _sections() and "toy_geneval.yaml" not in _sections()
