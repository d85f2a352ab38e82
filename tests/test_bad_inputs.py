"""Bad input to ``flowgrpo train`` (docs/reliability.md, "Bad input"): a corpus of broken
configs, overrides, prompt files and run folders, each fed to the config loader and to the
command line in-process. Every case must end in one line, ``flowgrpo train: error: ...``, naming
the field or file, with exit status 2, no traceback, nothing written and no model loaded."""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
import random
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import pytest
import yaml

from flowgrpo.cli import main
from flowgrpo.config import InputError, TrainConfig, load_config
from flowgrpo.config_sections import FIELD_CHOICES
from flowgrpo.tiny_recipe import TINY_DIR_ENV, load_tiny_config

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "configs" / "toy_geneval.yaml"
LLM = REPO / "configs" / "llm_arith.yaml"
ERROR_PREFIX = "flowgrpo train: error: "
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@dataclass(frozen=True)
class Case:
    """One bad input: the config file and overrides given, the CLI flags, and the texts the
    error must contain (the field, the file)."""
    config: Path
    names: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()


# A builder writes its case's files under the test's folder (and may patch, e.g. os.access).
Builder = Callable[[Path, pytest.MonkeyPatch], Case]


# --------------------------------------------------------------------------- writing configs

def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for "a.b.c", making the sections on the way."""
    *sections, leaf = dotted.split(".")
    for part in sections:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


@functools.lru_cache(maxsize=None)
def _shipped(base: Path) -> dict:
    return yaml.safe_load(base.read_text())


def recipe(tmp: Path, base: Path = TOY) -> dict:
    """A shipped config's mapping, made runnable from any folder (an absolute model path) and
    writing under ``tmp`` (run.output_dir), so that the trainer's checks can be reached."""
    raw = copy.deepcopy(_shipped(base))
    model = raw.setdefault("model", {})
    model["path"] = str(REPO / model.get("path", "assets/toy"))
    raw.setdefault("run", {})["output_dir"] = str(tmp / "runs")
    return raw


def write_config(tmp: Path, changes: dict[str, Any] | None = None, base: Path = TOY,
                 name: str = "config.yaml") -> Path:
    raw = recipe(tmp, base)
    for dotted, value in (changes or {}).items():
        set_dotted(raw, dotted, value)
    path = tmp / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def write_text(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


# --------------------------------------------------------------------------- wrong types

def config_fields(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, Any]]:
    """Every field of the config tree, sections included: (dotted name, annotated type)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        name, tp = f"{prefix}{f.name}", hints[f.name]
        out.append((name, tp))
        if dataclasses.is_dataclass(tp):
            out += config_fields(tp, name + ".")
    return out


def field_kind(tp: Any) -> str:
    """int, float, bool, str, list, tuple, dict or section (an Optional counts as its type)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        assert len(rest) == 1, f"a union of several types needs its own wrong value: {tp}"
        return field_kind(rest[0])
    if dataclasses.is_dataclass(tp):
        return "section"
    origin = typing.get_origin(tp)
    if origin in (list, tuple, dict):
        return origin.__name__
    return tp.__name__


# A value each kind of field must refuse (YAML reads "maybe" as a string, not a bool).
WRONG_VALUE = {"int": "three", "float": "fast", "bool": "maybe", "str": 5, "list": 5,
               "tuple": 5, "dict": 5, "section": 5}
# Sections validated only where they apply: where a bogus choice must still be refused.
CHOICE_CONTEXT: dict[str, tuple[Path, dict[str, Any]]] = {
    "llm.": (LLM, {}),
    "model.lora.": (TOY, {"model.lora.enabled": True}),
}


def wrong_type(name: str, value: Any) -> Builder:
    def build(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
        return Case(write_config(tmp, {name: value}), (name,))
    return build


def bad_choice(name: str) -> Builder:
    base, context = next(((path, ctx) for prefix, (path, ctx) in CHOICE_CONTEXT.items()
                          if name.startswith(prefix)), (TOY, {}))

    def build(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
        return Case(write_config(tmp, {**context, name: "no_such_choice"}, base=base),
                    (name, "no_such_choice"))
    return build


FIELDS = config_fields()
WRONG_TYPES: dict[str, Builder] = {
    f"wrong_type:{name}": wrong_type(name, WRONG_VALUE[field_kind(tp)]) for name, tp in FIELDS}
BAD_CHOICES: dict[str, Builder] = {f"bad_choice:{name}": bad_choice(name)
                                   for name, _ in FIELDS if name in FIELD_CHOICES}


# --------------------------------------------------------------------------- broken files

def _cuts(text: str) -> list[int]:
    """Byte offsets that cut ``text`` (a shipped config) into invalid YAML: just after each
    opening bracket of a flow collection, and two letters into each top-level key after the
    first (a key without its ':')."""
    cuts, start, keys = [], 0, 0
    for line in text.splitlines(keepends=True):
        body = line.split("#", 1)[0]
        for bracket in "{[":
            if bracket in body:
                cuts.append(start + body.index(bracket) + 1)
        if line[:1].isalpha():
            if keys:
                cuts.append(start + 2)
            keys += 1
        start += len(line)
    return sorted(set(cuts))


TOY_TEXT = TOY.read_text()


def truncated(cut: int) -> Builder:
    def build(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
        kept = TOY_TEXT[:cut]
        path = write_text(tmp, "cut.yaml", kept)
        return Case(path, (str(path), "not valid YAML", f"line {kept.count(chr(10)) + 1},"))
    return build


def random_bytes(seed: int) -> Builder:
    def build(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
        path = write_text(tmp, "noise.yaml", random.Random(seed).randbytes(256))
        return Case(path, (str(path), "is not UTF-8"))
    return build


# Text without ':', '{' and '?' cannot form a mapping, so every draw is refused as a file.
NOISE_CHARS = "abcxyz019 \n-[],'\"#&*!|>%@`"


def random_text(seed: int) -> Builder:
    def build(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
        draw = random.Random(seed)
        text = "".join(draw.choice(NOISE_CHARS) for _ in range(80))
        return Case(write_text(tmp, "noise.yaml", text), (str(tmp / "noise.yaml"),))
    return build


def file_case(name: str, content: str | bytes, *names: str) -> Builder:
    def build(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
        path = write_text(tmp, name, content)
        return Case(path, (str(path), *names))
    return build


def folder_as_config(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    folder = tmp / "configs_folder"
    folder.mkdir()
    return Case(folder, (str(folder), "is a folder"))


def device_as_config(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    """/dev/zero never ends: it must be refused, not read."""
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero on this system")
    return Case(Path("/dev/zero"), ("/dev/zero", "not a regular file"))


def missing_config(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    return Case(tmp / "missing.yaml", (str(tmp / "missing.yaml"), "does not exist"))


def tab_on_line_3(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    path = write_text(tmp, "tab.yaml", "name: x\nmodel:\n\tfamily: toy\n")
    return Case(path, (str(path), "line 3, column 1", "'\\t'"))


FILES: dict[str, Builder] = {
    **{f"truncated_at_{cut}": truncated(cut) for cut in _cuts(TOY_TEXT)},
    **{f"random_bytes_{seed}": random_bytes(seed) for seed in range(4)},
    **{f"random_text_{seed}": random_text(seed) for seed in range(4)},
    "folder": folder_as_config,
    "device": device_as_config,
    "missing": missing_config,
    "empty": file_case("empty.yaml", "", "holds no settings"),
    "only_comments": file_case("comments.yaml", "# nothing here\n\n", "holds no settings"),
    "empty_mapping": file_case("braces.yaml", "{}\n", "holds no settings"),
    "top_level_list": file_case("list.yaml", "- model\n- prompts\n", "top level must be a mapping"),
    "latin1": file_case("latin1.yaml", "name: caf\xe9\n".encode("latin-1"),
                        "not UTF-8", "byte 0xe9 at line 1, column 10"),
    "nul_character": file_case("nul.yaml", "name: a\x00b\n", "line 1, column 8", "#x0000"),
    "python_tag": file_case("tag.yaml", "name: !!python/object:os.system x\n",
                            "line 1, column 7", "constructor"),
    "tab_indent": tab_on_line_3,
    "deep_nesting": file_case("deep.yaml", "name: " + "[" * 3000 + "]" * 3000 + "\n",
                              "nests collections too deeply"),
}


# --------------------------------------------------------------------------- values, overrides

def with_overrides(*overrides: str, names: tuple[str, ...]) -> Builder:
    def build(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
        return Case(write_config(tmp), names, overrides)
    return build


def with_values(changes: dict[str, Any], *names: str) -> Builder:
    def build(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
        return Case(write_config(tmp, changes), names)
    return build


VALUES: dict[str, Builder] = {
    "unknown_top_level_key": with_values({"nosuch": 1}, "unknown config key nosuch"),
    "unknown_section_key": with_values({"training.lr_typo": 1}, "training.lr_typo"),
    "unknown_nested_key": with_values({"sampling.plan.kinds": "x"}, "sampling.plan.kinds"),
    "negative_group_size": with_values({"training.group_size": -1}, "training.group_size"),
    "zero_prompts_per_iteration": with_values({"training.prompts_per_iteration": 0},
                                              "training.prompts_per_iteration"),
    "negative_iterations": with_values({"run.max_iterations": -5}, "run.max_iterations"),
    "zero_steps": with_values({"sampling.num_steps": 0}, "sampling.num_steps"),
    "nan_lr": with_values({"training.lr": float("nan")}, "training.lr"),
}
OVERRIDES: dict[str, Builder] = {
    "unclosed_list": with_overrides("training.lr=[1e-4", names=("training.lr=[1e-4",
                                                                "not valid YAML", "']'")),
    "unclosed_mapping": with_overrides("rewards.components=[{name: x}",
                                       names=("rewards.components", "not valid YAML")),
    "unclosed_quote": with_overrides("name='unclosed", names=("name='unclosed",
                                                              "not valid YAML")),
    "two_documents": with_overrides("name=a\n---\nb", names=("not valid YAML", "document")),
    "empty_key": with_overrides("=3", names=("'=3'", "no key")),
    "double_dot": with_overrides("training..lr=1", names=("training..lr", "empty part")),
    "leading_dot": with_overrides(".lr=1", names=("'.lr'", "empty part")),
    "trailing_dot": with_overrides("training.=1", names=("'training.'", "empty part")),
    "no_equals": with_overrides("training.lr", names=("'training.lr'", "section.key=value")),
    "into_a_value": with_overrides("training.lr.x=1", names=("training.lr.x", "not a section")),
    "unknown_section": with_overrides("nosuch.x=1", names=("nosuch",)),
    "wrong_type_int": with_overrides("training.group_size=eight",
                                     names=("training.group_size", "integer")),
    "wrong_type_bool": with_overrides("run.progress=maybe", names=("run.progress",)),
    "wrong_type_list": with_overrides("rewards.components=5", names=("rewards.components",)),
    "wrong_type_section": with_overrides("training=5", names=("training",)),
}


# --------------------------------------------------------------------------- prompts, run folders

def prompt_file(name: str, content: str | bytes, *names: str, key: str = "train") -> Builder:
    def build(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
        path = write_text(tmp, name, content)
        return Case(write_config(tmp), (str(path), *names), (f"prompts.{key}={path}",))
    return build


def missing_prompts(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    path = tmp / "missing.txt"
    return Case(write_config(tmp), (str(path), "does not exist"), (f"prompts.train={path}",))


def prompts_folder(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    folder = tmp / "prompts.txt"
    folder.mkdir()
    return Case(write_config(tmp), (str(folder), "is a folder"), (f"prompts.train={folder}",))


def output_dir_a_file(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    blocker = write_text(tmp, "runs_file", "not a folder\n")
    return Case(write_config(tmp, {"run.output_dir": str(blocker)}),
                ("run.output_dir", str(blocker), "is a file"))


def output_dir_under_a_file(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    blocker = write_text(tmp, "runs_file", "not a folder\n")
    return Case(write_config(tmp, {"run.output_dir": str(blocker / "sub")}),
                ("run.output_dir", str(blocker), "is a file"))


def run_folder_a_file(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    (tmp / "runs").mkdir()
    blocker = write_text(tmp / "runs", "toy_geneval", "not a folder\n")
    return Case(write_config(tmp), (str(blocker), "is a file"))


def _held_run(tmp: Path) -> Path:
    """A run folder that holds a run (run.json, metrics), as a resume finds it."""
    run_dir = tmp / "runs" / "toy_geneval"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text('{"run_id": "0123456789abcdef"}\n')
    (run_dir / "metrics.jsonl").write_text('{"iteration": 1, "phase": "train"}\n')
    return run_dir


def deny_writes(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """os.access says ``folder`` is not writable (what a read-only mount answers, even to
    root), so the check runs where the test runs as root."""
    real = os.access

    def access(path, mode, *args, **kwargs):
        if Path(path) == folder and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


def resume_read_only_run(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    if IS_ROOT:
        pytest.skip("root ignores permissions: the denied-access case covers this check")
    run_dir = _held_run(tmp)
    run_dir.chmod(0o555)
    return Case(write_config(tmp), (str(run_dir), "not writable"), flags=("--resume", "latest"))


def resume_denied_run(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    run_dir = _held_run(tmp)
    deny_writes(monkeypatch, run_dir)
    return Case(write_config(tmp), (str(run_dir), "not writable"), flags=("--resume", "latest"))


def read_only_output_dir(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    if IS_ROOT:
        pytest.skip("root ignores permissions: the denied-access case covers this check")
    (tmp / "runs").mkdir(mode=0o555)
    return Case(write_config(tmp), (str(tmp / "runs"), "not writable"))


def denied_output_dir(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    (tmp / "runs").mkdir()
    deny_writes(monkeypatch, tmp / "runs")
    return Case(write_config(tmp), (str(tmp / "runs"), "not writable"))


def lock_is_a_folder(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    run_dir = _held_run(tmp)
    (run_dir / ".lock").mkdir()
    return Case(write_config(tmp), (str(run_dir / ".lock"), "lock file"),
                flags=("--resume", "latest"))


# run.output_dir is checked by the config loader already (it writes nothing, it only looks)
OUTPUT_DIRS: dict[str, Builder] = {
    "output_dir_a_file": output_dir_a_file,
    "output_dir_under_a_file": output_dir_under_a_file,
}
# Refused only when the trainer starts (before the model loads): prompt files, run folders.
AT_START: dict[str, Builder] = {
    "prompts_missing": missing_prompts,
    "prompts_empty": prompt_file("empty.txt", "", "holds no prompts"),
    "prompts_blank_lines": prompt_file("blank.txt", "\n  \n", "holds no prompts"),
    "prompts_not_utf8": prompt_file("latin1.txt", "a caf\xe9\n".encode("latin-1"),
                                    "not UTF-8", "line 1"),
    "prompts_binary": prompt_file("binary.jsonl", bytes(range(256)), "not UTF-8"),
    "eval_prompts_not_utf8": prompt_file("eval.txt", b"\xff\xfe", "not UTF-8", key="eval"),
    "prompts_folder": prompts_folder,
    "run_folder_a_file": run_folder_a_file,
    "resume_read_only_run": resume_read_only_run,
    "resume_denied_run": resume_denied_run,
    "read_only_output_dir": read_only_output_dir,
    "denied_output_dir": denied_output_dir,
    "lock_is_a_folder": lock_is_a_folder,
}


# --------------------------------------------------------------------------- --tiny

def tiny(builder: Builder) -> Builder:
    """The same case under ``flowgrpo train --tiny`` (its own reading of the recipe)."""
    def build(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
        case = builder(tmp, monkeypatch)
        return dataclasses.replace(case, flags=(*case.flags, "--tiny"))
    return build


TINY: dict[str, Builder] = {
    "tiny_truncated": tiny(truncated(_cuts(TOY_TEXT)[0])),
    "tiny_not_utf8": tiny(FILES["latin1"]),
    "tiny_empty": tiny(FILES["empty"]),
    "tiny_folder": tiny(folder_as_config),
    "tiny_section_not_a_mapping": tiny(wrong_type("training", 5)),
    "tiny_run_not_a_mapping": tiny(wrong_type("run", "fast")),
    "tiny_name_not_a_string": tiny(wrong_type("name", 5)),
    "tiny_rewards_not_a_list": tiny(wrong_type("rewards.components", 5)),
    "tiny_reward_options_not_a_mapping": tiny(with_values(
        {"rewards.components": [{"name": "pickscore", "options": 3}]},
        "rewards.components[0].options")),
    "tiny_broken_override": tiny(OVERRIDES["unclosed_list"]),
}

CORPUS: dict[str, Builder] = {**WRONG_TYPES, **BAD_CHOICES, **FILES, **VALUES, **OVERRIDES,
                              **OUTPUT_DIRS, **AT_START, **TINY}
AT_LOAD = [name for name in CORPUS if name not in AT_START]


def one_per_group(names: list[str], group: Callable[[str], str]) -> list[str]:
    """The first of ``names`` in each ``group``."""
    firsts: dict[str, str] = {}
    for name in names:
        firsts.setdefault(group(name), name)
    return list(firsts.values())


# The command line prints whatever the loader raises, so it gets every case but the per-field
# ones, of which one per field kind and one choice per section stand for the rest (the loader's
# test takes them all).
KIND_OF = {f"wrong_type:{name}": field_kind(tp) for name, tp in FIELDS}
ON_THE_COMMAND_LINE = [
    *one_per_group(list(WRONG_TYPES), KIND_OF.__getitem__),
    *one_per_group(list(BAD_CHOICES), lambda name: name.split(":")[1].split(".")[0]),
    *(name for name in CORPUS if name not in WRONG_TYPES and name not in BAD_CHOICES)]


# --------------------------------------------------------------------------- the tests

def snapshot(folder: Path) -> dict[str, tuple[bool, int, bytes | None]]:
    """Every file and folder under ``folder``: kind, mtime and a file's bytes."""
    return {p.relative_to(folder).as_posix(): (p.is_dir(), p.stat().st_mtime_ns,
                                               None if p.is_dir() else p.read_bytes())
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """An empty current folder under ``tmp_path`` (a relative output path would land in it)
    and tiny builds under ``tmp_path``, so a snapshot of ``tmp_path`` sees every write."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv(TINY_DIR_ENV, str(tmp_path / "tiny"))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")   # --tiny sets it: restored after the test
    return tmp_path


@pytest.mark.parametrize("name", AT_LOAD)
def test_the_config_loader_refuses_in_one_line_naming_the_input(name, workdir, monkeypatch):
    case = CORPUS[name](workdir, monkeypatch)
    before = snapshot(workdir)
    load = load_tiny_config if "--tiny" in case.flags else load_config
    with pytest.raises(InputError) as err:
        load(case.config, list(case.overrides))
    message = str(err.value)
    assert "\n" not in message
    for text in case.names:
        assert text in message, f"{text!r} not in: {message}"
    assert snapshot(workdir) == before


@pytest.mark.parametrize("name", ON_THE_COMMAND_LINE)
def test_flowgrpo_train_refuses_in_one_line_before_the_model_loads_and_writes_nothing(
        name, workdir, monkeypatch, capsys, no_model_load):
    case = CORPUS[name](workdir, monkeypatch)
    before = snapshot(workdir)
    status = main(["train", str(case.config), *case.overrides, *case.flags])
    out, err = capsys.readouterr()
    assert status == 2
    assert "Traceback" not in err + out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), err
    for text in case.names:
        assert text in lines[0], f"{text!r} not in: {lines[0]}"
    assert snapshot(workdir) == before


def test_the_corpus_covers_every_field_kind_and_choice():
    """The wrong-type cases come from the config classes: a new field is covered by adding it,
    and a field of a kind without a wrong value fails here (add one to WRONG_VALUE)."""
    kinds = {field_kind(tp) for _, tp in FIELDS}
    assert kinds <= set(WRONG_VALUE)
    assert {"int", "float", "bool", "str", "list", "tuple", "dict", "section"} <= kinds
    assert len(WRONG_TYPES) == len(FIELDS) > 100
    assert set(BAD_CHOICES) == {f"bad_choice:{name}" for name in FIELD_CHOICES}
    assert len(_cuts(TOY_TEXT)) >= 6


def test_a_good_config_still_passes_the_same_path(workdir, monkeypatch):
    """The corpus's own base config loads (its failures are the broken parts, not the base),
    and an override whose value is empty or holds '=' still parses."""
    config = load_config(write_config(workdir), ["name=a=b", "prompts.balance_key="])
    assert config.name == "a=b" and config.prompts.balance_key == ""
    assert config.run.output_dir == str(workdir / "runs")
