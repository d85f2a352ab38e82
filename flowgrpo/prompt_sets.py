"""The anchors' prompt sets: where each comes from, its terms, and how to fetch it.

The GPU recipes train and evaluate on the prompt sets their anchors released. These are the
anchors' data, not this project's, so they are not in the repository: ``flowgrpo
fetch-prompts NAME`` downloads a set once into ``assets/prompts/fetched/NAME/`` (git
ignores that folder), from the anchor's repository at a pinned commit where one could be checked,
and verifies every pinned file against its git blob id at that commit. Sets whose terms restrict
their use (academic only, or no license stated) are fetched only with ``--accept-license``.
GenEval-style metadata (tag, include/exclude with classes, counts, colours) is kept in the JSONL
records' ``"metadata"``, with ``"family"`` set to the task tag (GenEval's overall score is the
mean over tags). ``assets/prompts/README.md`` lists every set with its source and terms.

A missing set is not an error until a run reads it: ``flowgrpo train CONFIG --tiny`` falls back
to the small illustrative files shipped next to the fetched folder (``PromptSet.examples``), and
a real run names the fetch command.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

FETCH_ROOT = Path("assets/prompts/fetched")
FLOW_GRPO = "https://github.com/yifan123/flow_grpo"
FLOW_GRPO_COMMIT = "ac4c86e8cae021841f1fde853d340e0db67690dd"
MIXGRPO = "https://github.com/Tencent-Hunyuan/MixGRPO"
MIXGRPO_COMMIT = "e5cdd6a427778d8c8b2e7a48ce16972141adbe7c"
FLASH_GRPO = "https://github.com/Shredded-Pork/Flash-GRPO"
FLASH_GRPO_COMMIT = "421101378e8811aa7460ada34a3b76ac7b53c9f7"
CONVERSIONS = ("copy", "geneval_jsonl", "edit_jsonl")


def raw_url(repository: str, commit: str, path: str) -> str:
    """The raw-file URL of ``path`` in a GitHub ``repository`` at ``commit`` (or a branch)."""
    owner_name = repository.removeprefix("https://github.com/")
    return f"https://raw.githubusercontent.com/{owner_name}/{commit}/{path}"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a set: its source ``path`` in the repository, where it goes (``dest``,
    relative to the set's folder), its git blob id at the pinned commit (None when no commit
    could be checked: the file is then not verified) and how it is converted."""

    path: str
    dest: str
    git_blob: str | None
    convert: str = "copy"


@dataclass(frozen=True)
class PromptSet:
    name: str
    anchor: str                      # who trained on it, for what
    repository: str
    commit: str                      # a commit id, or a branch when no commit could be checked
    terms: str                       # the license or terms, as the source states them
    files: tuple[RemoteFile, ...]
    needs_acceptance: bool = False   # restricted or unstated terms: fetched with --accept-license
    archives: tuple[str, ...] = ()   # zip URLs extracted into the set's folder (editing images)
    examples: tuple[str, str] | None = None   # shipped (train, eval) stand-ins for offline runs
    notes: tuple[str, ...] = field(default=())

    def folder(self, root: str | os.PathLike | None = None) -> Path:
        return Path(root) / self.name if root is not None else FETCH_ROOT / self.name

    def url(self, file: RemoteFile) -> str:
        return raw_url(self.repository, self.commit, file.path)


PROMPT_SETS: dict[str, PromptSet] = {s.name: s for s in (
    PromptSet(
        name="flow_grpo_ocr",
        anchor="Flow-GRPO's text-rendering (OCR) recipes (general_ocr_sd3, general_ocr_wan2_1)",
        repository=FLOW_GRPO, commit=FLOW_GRPO_COMMIT,
        terms="MIT (the repository's LICENSE, copyright 2025 Jie Liu)",
        files=(RemoteFile("dataset/ocr/train.txt", "train.txt",
                          "3ce0521b77b0a9031191d66ecc36ebaaf27a3922"),
               RemoteFile("dataset/ocr/test.txt", "test.txt",
                          "8deb4f8d8f2e863f45353354243669b3c991a6a2")),
        examples=("assets/prompts/ocr_train.txt", "assets/prompts/ocr_eval.txt")),
    PromptSet(
        name="flow_grpo_pickscore",
        anchor="Flow-GRPO's PickScore recipes (pickscore_sd3, pickscore_sd3_fast_nocfg, "
               "pickscore_flux)",
        repository=FLOW_GRPO, commit=FLOW_GRPO_COMMIT,
        terms="MIT (the repository's LICENSE); the captions are Pick-a-Pic v1's "
              "(huggingface.co/datasets/yuvalkirstain/pickapic_v1: check its card's terms)",
        files=(RemoteFile("dataset/pickscore/train.txt", "train.txt",
                          "a437bd921c03fbc00c4e7ce148ae2d28fcd6e49b"),
               RemoteFile("dataset/pickscore/test.txt", "test.txt",
                          "45f05231b969fb5f74c8debd606b22cd3be27f8e")),
        examples=("assets/prompts/general_train.txt", "assets/prompts/general_eval.txt"),
        notes=("Flow-GRPO's README says this set contains NSFW prompts and recommends the SFW "
               "subset of Pick-a-Pic (CarperAI/pickapic_v1_no_images_training_sfw).",)),
    PromptSet(
        name="flow_grpo_geneval",
        anchor="Flow-GRPO's GenEval recipes (geneval_sd3, geneval_sd3_fast_nocfg)",
        repository=FLOW_GRPO, commit=FLOW_GRPO_COMMIT,
        terms="MIT (the repository's LICENSE); the task templates are GenEval's",
        files=(RemoteFile("dataset/geneval/train_metadata.jsonl", "train.jsonl",
                          "0b97e8a6802c08fc7537cd00c76ae79c851bddcb", "geneval_jsonl"),
               RemoteFile("dataset/geneval/test_metadata.jsonl", "test.jsonl",
                          "27cdaf5cc1356fe15aeadbb8df55682ca74228f0", "geneval_jsonl"))),
    PromptSet(
        name="flow_grpo_counting_edit",
        anchor="Flow-GRPO's FLUX.1 Kontext counting-edit recipe (counting_flux_kontext)",
        # The commit whose config/grpo.py reads dataset/counting_edit in counting_flux_kontext;
        # the snapshot this project pins its other sets to predates the editing recipes.
        repository=FLOW_GRPO, commit="54809b5fcf4d3930d2a17fa553928704bd0b719e",
        terms="MIT (the repository's LICENSE) for the metadata; the image archive's terms are "
              "not stated in the stored copies (check huggingface.co/datasets/jieliu/"
              "counting_edit)",
        files=(RemoteFile("dataset/counting_edit/train_metadata.jsonl", "train.jsonl", None,
                          "edit_jsonl"),
               RemoteFile("dataset/counting_edit/test_metadata.jsonl", "test.jsonl", None,
                          "edit_jsonl")),
        needs_acceptance=True,
        archives=("https://huggingface.co/datasets/jieliu/counting_edit/resolve/main/"
                  "generated_images.zip",),
        examples=("toy:edit_train", "toy:edit_heldout"),
        notes=("Pinned to the commit whose config/grpo.py (counting_flux_kontext) reads "
               "dataset/counting_edit; no stored copy of the two files themselves could be "
               "checked, so they carry no content hash.",)),
    PromptSet(
        name="mixgrpo_hpdv2",
        anchor="MixGRPO's FLUX recipes (HPDv2's training and test prompts)",
        repository=MIXGRPO, commit=MIXGRPO_COMMIT,
        terms="License Terms of MixGRPO (License.txt): academic use only, no commercial or "
              "production use; the prompts are HPDv2's (huggingface.co/datasets/ymhao/HPDv2)",
        files=(RemoteFile("data/prompts.txt", "train.txt",
                          "b47234e475645222ca9a0bb7742ebf4d08123855"),
               RemoteFile("data/prompts_test.txt", "test.txt",
                          "69323d42374806447d4768a257f376a7db683e07")),
        needs_acceptance=True,
        examples=("assets/prompts/general_train.txt", "assets/prompts/general_eval.txt")),
    PromptSet(
        name="flash_grpo_video",
        anchor="Flash-GRPO's Wan2.1 recipe (wan2_1_flash)",
        repository=FLASH_GRPO, commit=FLASH_GRPO_COMMIT,
        terms="none stated (the repository has no LICENSE file)",
        files=(RemoteFile("dataset/video/train.txt", "train.txt",
                          "997613ab78bce9252d51760fe0967a09b3c3f2cb"),
               RemoteFile("dataset/video/test.txt", "test.txt",
                          "e4f4ceee67e30582010b982f68bc318e2eb460a0")),
        needs_acceptance=True,
        examples=("assets/prompts/video_train.txt", "assets/prompts/video_eval.txt")),
)}


def git_blob_id(data: bytes) -> str:
    """Git's object id of a file holding ``data`` (SHA-1 of "blob <size>\\0" + data)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def set_of(path: str | os.PathLike) -> PromptSet | None:
    """The registered set a prompt file path belongs to (``assets/prompts/fetched/<name>/...``,
    relative or absolute), or None."""
    parts = Path(path).parts
    fetched = FETCH_ROOT.parts
    for i in range(len(parts) - len(fetched)):
        if parts[i:i + len(fetched)] == fetched:
            return PROMPT_SETS.get(parts[i + len(fetched)])
    return None


def fetch_command(prompt_set: PromptSet) -> str:
    flag = " --accept-license" if prompt_set.needs_acceptance else ""
    return f"flowgrpo fetch-prompts {prompt_set.name}{flag}"


def missing_hint(path: str | os.PathLike) -> str:
    """What to do about a missing prompt file: the fetch command when it belongs to a set, else
    an empty string."""
    prompt_set = set_of(path)
    if prompt_set is None:
        return ""
    return (f"; it belongs to the prompt set {prompt_set.name!r} ({prompt_set.anchor}), which "
            f"is not shipped: fetch it once with `{fetch_command(prompt_set)}` (terms: "
            f"{prompt_set.terms}), or point prompts.train / prompts.eval at your own files")


def example_for(path: str, split: str) -> str | None:
    """The shipped stand-in for a missing set file (``split`` "train" or "eval"), or None."""
    prompt_set = set_of(path)
    if prompt_set is None or prompt_set.examples is None:
        return None
    return prompt_set.examples[0 if split == "train" else 1]


# ----------------------------------------------------------------------------- conversions


def _geneval_record(item: dict) -> dict:
    metadata = {k: v for k, v in item.items() if k != "prompt"}
    if "tag" in metadata:
        metadata.setdefault("family", metadata["tag"])
    return {"prompt": item["prompt"], "metadata": metadata}


def _edit_record(item: dict) -> dict:
    record = _geneval_record(item)
    for key in ("image", "images"):     # one source image, or a list of them (multi-image edits)
        value = record["metadata"].pop(key, None)
        if value is not None:
            record[key] = value
    return record


def convert(data: bytes, how: str) -> bytes:
    """A fetched file in this project's format: "copy" as it is; "geneval_jsonl" (Flow-GRPO's
    flat GenEval lines) as {"prompt", "metadata": {everything else, "family": tag}};
    "edit_jsonl" the same with the source image's path moved to the record's "image" (a list
    of paths to its "images")."""
    if how == "copy":
        return data
    if how not in CONVERSIONS:
        raise ValueError(f"unknown conversion {how!r} (known: {CONVERSIONS})")
    build = _geneval_record if how == "geneval_jsonl" else _edit_record
    lines = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f"line {number}: expected an object with a \"prompt\" string")
        lines.append(json.dumps(build(item), ensure_ascii=False))
    return ("\n".join(lines) + "\n").encode("utf-8")


# ----------------------------------------------------------------------------- fetching


def download(url: str, timeout: float = 120.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:   # noqa: S310 (https URLs)
        return response.read()


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(data)
    os.replace(f.name, path)


def _extract(archive: bytes, folder: Path) -> int:
    """Extract a zip into ``folder``, refusing members that would land outside it."""
    root = folder.resolve()
    count = 0
    with zipfile.ZipFile(io.BytesIO(archive)) as zipped:
        for member in zipped.infolist():
            target = (folder / member.filename).resolve()
            if root not in target.parents and target != root:
                raise ValueError(f"archive member {member.filename!r} points outside {folder}")
            if member.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zipped.open(member) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)
            count += 1
    return count


def fetch(name: str, root: str | os.PathLike | None = None, *, accept_license: bool = False,
          get: Callable[[str], bytes] = download, log: Callable[[str], None] = print) -> Path:
    """Download set ``name`` into ``root/name`` (default ``assets/prompts/fetched/name``): every
    file checked against its git blob id when it has one, converted, written atomically; then
    its archives extracted. ``get(url) -> bytes`` does the downloading. Returns the folder."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")
    prompt_set = PROMPT_SETS[name]
    if prompt_set.needs_acceptance and not accept_license:
        raise PermissionError(f"the set's terms are {prompt_set.terms}. Read them, then run "
                              f"again with --accept-license to fetch it")
    folder = prompt_set.folder(root)
    log(f"{name}: {prompt_set.anchor}; terms: {prompt_set.terms}")
    for note in prompt_set.notes:
        log(f"{name}: note: {note}")
    for file in prompt_set.files:
        url = prompt_set.url(file)
        data = get(url)
        if file.git_blob is not None and git_blob_id(data) != file.git_blob:
            raise ValueError(f"{url}: the download is not the file pinned at {prompt_set.commit} "
                             f"(git blob {git_blob_id(data)}, expected {file.git_blob}); nothing "
                             f"was written for it")
        _write(folder / file.dest, convert(data, file.convert))
        log(f"{name}: {file.dest} <- {url}" + ("" if file.git_blob else " (unverified)"))
    for url in prompt_set.archives:
        count = _extract(get(url), folder)
        log(f"{name}: {count} files <- {url} (unverified)")
    return folder
