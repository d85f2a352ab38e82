"""The anchors' prompt sets (flowgrpo/prompt_sets.py, scripts/fetch_prompts.py): every GPU recipe
points at a registered set, a fetched file must be the one pinned (git blob id), GenEval metadata
stays in the records, restricted terms need consent, and a missing set names its fetch command
(or, under --tiny, falls back to the shipped stand-ins). No network: downloads are stood in for."""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import yaml

from flowgrpo.config import InputError, load_config
from flowgrpo.prompt_sets import (FETCH_ROOT, PROMPT_SETS, PromptSet, RemoteFile, example_for,
                                  fetch, git_blob_id, set_of)
from flowgrpo.prompts import load_prompts

CONFIGS = sorted(Path("configs").glob("*.yaml"))
GPU_CONFIGS = [p for p in CONFIGS
               if (yaml.safe_load(p.read_text()).get("model") or {}).get("family", "toy")
               not in ("toy",) and yaml.safe_load(p.read_text()).get("policy", "flow") == "flow"]


def test_git_blob_id_is_gits_object_id():
    # `printf 'hello\n' | git hash-object --stdin`, and of an empty file
    assert git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"
    assert git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_every_gpu_recipe_trains_and_evaluates_on_a_registered_anchor_set(path):
    config = load_config(path)
    for key, source in (("train", config.prompts.train), ("eval", config.prompts.eval)):
        prompt_set = set_of(source)
        assert prompt_set is not None, f"{path.stem}: prompts.{key} {source} is no anchor set"
        assert Path(source).parent == FETCH_ROOT / prompt_set.name
        assert Path(source).name in {f.dest for f in prompt_set.files}
        stand_in = example_for(source, key)
        assert stand_in.startswith("toy:") or Path(stand_in).is_file()
        assert prompt_set.name in path.read_text()        # the header says how to fetch it


def _fake_set(monkeypatch, name="fake_geneval", needs_acceptance=False, archives=()):
    geneval = (json.dumps({"tag": "counting", "include": [{"class": "cup", "count": 2}],
                           "exclude": [{"class": "cup", "count": 3}],
                           "prompt": "a photo of two cups"}) + "\n"
               + json.dumps({"tag": "colors", "include": [{"class": "car", "count": 1,
                                                           "color": "red"}],
                             "prompt": "a photo of a red car"}) + "\n").encode()
    text = b"a sign that says \"hello\"\nsecond prompt\n"
    files = (RemoteFile("data/train.jsonl", "train.jsonl", git_blob_id(geneval), "geneval_jsonl"),
             RemoteFile("data/test.txt", "test.txt", git_blob_id(text)))
    served = {f"https://raw.githubusercontent.com/owner/repo/abc/data/train.jsonl": geneval,
              f"https://raw.githubusercontent.com/owner/repo/abc/data/test.txt": text}
    prompt_set = PromptSet(name=name, anchor="a test anchor", repository="https://github.com/owner/repo",
                           commit="abc", terms="test terms", files=files,
                           needs_acceptance=needs_acceptance, archives=archives)
    monkeypatch.setitem(PROMPT_SETS, name, prompt_set)
    return prompt_set, served


def test_fetch_verifies_pinned_files_and_keeps_geneval_metadata(tmp_path, monkeypatch):
    prompt_set, served = _fake_set(monkeypatch)
    folder = fetch(prompt_set.name, tmp_path, get=served.__getitem__, log=lambda _: None)
    records = load_prompts(str(folder / "train.jsonl"))
    assert [r["prompt"] for r in records] == ["a photo of two cups", "a photo of a red car"]
    assert records[0]["metadata"] == {"tag": "counting", "family": "counting",
                                      "include": [{"class": "cup", "count": 2}],
                                      "exclude": [{"class": "cup", "count": 3}]}
    assert records[1]["metadata"]["include"][0]["color"] == "red"
    assert [r["prompt"] for r in load_prompts(str(folder / "test.txt"))][0] == \
        'a sign that says "hello"'
    # a file that is not the pinned one is refused, and nothing is written for it
    tampered = dict(served)
    tampered["https://raw.githubusercontent.com/owner/repo/abc/data/test.txt"] = b"other\n"
    with pytest.raises(ValueError, match="not the file pinned at abc"):
        fetch(prompt_set.name, tmp_path / "again", get=tampered.__getitem__, log=lambda _: None)
    assert not (tmp_path / "again" / prompt_set.name / "test.txt").exists()


def test_restricted_sets_need_consent_and_archives_stay_inside(tmp_path, monkeypatch):
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("generated_images/0.png", b"png")
    bad = io.BytesIO()
    with zipfile.ZipFile(bad, "w") as zipped:
        zipped.writestr("../escape.png", b"png")
    prompt_set, served = _fake_set(monkeypatch, "fake_restricted", needs_acceptance=True,
                                   archives=("https://example.org/images.zip",))
    served["https://example.org/images.zip"] = archive.getvalue()
    with pytest.raises(PermissionError, match="test terms.*--accept-license"):
        fetch(prompt_set.name, tmp_path, get=served.__getitem__, log=lambda _: None)
    folder = fetch(prompt_set.name, tmp_path, accept_license=True, get=served.__getitem__,
                   log=lambda _: None)
    assert (folder / "generated_images" / "0.png").read_bytes() == b"png"
    served["https://example.org/images.zip"] = bad.getvalue()
    with pytest.raises(ValueError, match="outside"):
        fetch(prompt_set.name, tmp_path / "bad", accept_license=True, get=served.__getitem__,
              log=lambda _: None)
    assert not (tmp_path / "bad" / "escape.png").exists()


def test_registry_terms_flag_the_restricted_sets():
    restricted = {name for name, s in PROMPT_SETS.items() if s.needs_acceptance}
    assert restricted == {"mixgrpo_hpdv2", "flash_grpo_video", "flow_grpo_counting_edit"}
    for prompt_set in PROMPT_SETS.values():
        pinned = [f for f in prompt_set.files if f.git_blob is not None]
        assert all(len(f.git_blob) == 40 for f in pinned)
        # every set is fetched from a fixed commit, never a branch (the counting-edit files carry
        # no content hash: no stored copy of them could be checked)
        assert len(prompt_set.commit) == 40 and int(prompt_set.commit, 16) >= 0, prompt_set.name
        assert bool(pinned) == (prompt_set.name != "flow_grpo_counting_edit")


def test_a_missing_set_names_its_fetch_command(tmp_path):
    missing = tmp_path / FETCH_ROOT / "mixgrpo_hpdv2" / "train.txt"
    with pytest.raises(InputError, match=r"flowgrpo fetch-prompts mixgrpo_hpdv2 "
                                         r"--accept-license.*academic use only"):
        load_prompts(str(missing))
    with pytest.raises(InputError, match=r"does not exist \(give a .txt file"):
        load_prompts(str(tmp_path / "mine.txt"))


def test_tiny_runs_use_a_fetched_set_and_fall_back_to_the_stand_ins(tmp_path, monkeypatch):
    from flowgrpo.tiny_recipe import _tiny_prompts

    fetched = tmp_path / FETCH_ROOT / "flow_grpo_ocr"
    raw = {"prompts": {"train": str(fetched / "train.txt"), "eval": str(fetched / "test.txt")}}
    assert _tiny_prompts(raw) == {"train": "assets/prompts/ocr_train.txt",
                                  "eval": "assets/prompts/ocr_eval.txt"}
    fetched.mkdir(parents=True)
    (fetched / "train.txt").write_text('a sign that says "fetched"\n')
    assert _tiny_prompts(raw) == {"eval": "assets/prompts/ocr_eval.txt"}
    edit = {"prompts": {"train": "assets/prompts/fetched/flow_grpo_counting_edit/train.jsonl"}}
    monkeypatch.chdir(tmp_path)    # no fetched set here
    assert _tiny_prompts(edit) == {"train": "toy:edit_train"}


# ----------------------------------------------------------------- flowgrpo fetch-prompts (CLI)
def test_cli_lists_the_sets_and_refuses_unknown_or_unaccepted_ones(capsys, tmp_path):
    from flowgrpo.cli import main

    assert main(["fetch-prompts", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in PROMPT_SETS)
    assert listed.count("(needs --accept-license)") == sum(
        s.needs_acceptance for s in PROMPT_SETS.values())
    # an unknown name is refused before anything downloads, naming the known ones
    assert main(["fetch-prompts", "flow_grpo_ocr", "no_such_set", "--root", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "'no_such_set'" in error and "flow_grpo_ocr" in error
    assert not any(tmp_path.iterdir())
    # restricted terms without consent: one line naming the flag, nothing written
    assert main(["fetch-prompts", "mixgrpo_hpdv2", "--root", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--accept-license" in error
    assert not any(tmp_path.iterdir())


def test_cli_fetches_into_the_current_folder_where_recipes_read(monkeypatch, tmp_path):
    """Without --root the set lands in ./assets/prompts/fetched/<name>/ (a wheel user's folder),
    the path a recipe's prompts.train names."""
    import functools

    from flowgrpo.cli import main
    from flowgrpo.commands import fetch_prompts as command

    prompt_set, served = _fake_set(monkeypatch)
    monkeypatch.setattr(command, "fetch", functools.partial(fetch, get=served.__getitem__,
                                                            log=lambda _: None))
    monkeypatch.chdir(tmp_path)
    assert main(["fetch-prompts", prompt_set.name]) == 0
    folder = tmp_path / FETCH_ROOT / prompt_set.name
    records = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert records and all("prompt" in record for record in records)
