"""Where a diffusers model comes from, checked before any weights load: a local folder or a hub
id, the folder's ``model_index.json`` and the component files a family needs
(``check_model_source``, ``check_pipeline_folder``)."""

from __future__ import annotations

import json
import os
import re
from typing import Mapping

from flowgrpo.errors import InputError
from flowgrpo.hub import require_hub_file


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_local_path(path_or_hub_id: str) -> bool:
    """True for an existing folder or anything that cannot be a hub id ('org/name')."""
    path = os.path.expanduser(path_or_hub_id)
    if os.path.isdir(path):
        return True
    return not (_HUB_ID.fullmatch(path_or_hub_id) and not path_or_hub_id.startswith("."))


def check_pipeline_folder(path_or_hub_id: str, required: Mapping[str, str], family: str) -> None:
    """Check a local pipeline folder before loading: it exists, has ``model_index.json`` and, for
    each required component subfolder, the file that proves it is there (``required`` maps
    subfolder -> file, e.g. {"vae": "config.json"}). Hub ids ('org/name') are left to
    ``from_pretrained``."""
    if not isinstance(path_or_hub_id, (str, os.PathLike)):
        raise TypeError(f"path_or_hub_id must be a str (got {type(path_or_hub_id).__name__})")
    path_or_hub_id = os.fspath(path_or_hub_id)
    if not is_local_path(path_or_hub_id):
        return
    path = os.path.expanduser(path_or_hub_id)
    if not os.path.isdir(path):
        raise ValueError(f"{family} model folder {path_or_hub_id!r} does not exist (and is not a hub id "
                         "'org/name'); pass a diffusers pipeline folder or a hub id")
    missing = [] if os.path.isfile(os.path.join(path, "model_index.json")) else ["model_index.json"]
    missing += [f"{sub}/{name}" for sub, name in required.items()
                if not os.path.isfile(os.path.join(path, sub, name))]
    if missing:
        raise ValueError(f"{family} model folder {path_or_hub_id!r} lacks {missing}; it must be a "
                         f"diffusers pipeline folder with the components {sorted(required)} "
                         "(as written by the pipeline's save_pretrained)")


def _component_file(class_name: str) -> str | None:
    """The file a saved component's subfolder must hold, from its class name (None: any)."""
    if class_name.endswith("Scheduler"):
        return "scheduler_config.json"
    if "Tokenizer" in class_name:
        return "tokenizer_config.json"
    if "Processor" in class_name or "FeatureExtractor" in class_name:
        return None
    return "config.json"


def check_model_source(path_or_hub_id: str | os.PathLike, family: str,
                       field: str = "model.path") -> None:
    """Fail with one message naming the model, the likely cause and the fix when a diffusers
    pipeline cannot be loaded from ``path_or_hub_id``: a local folder that does not exist, has
    no model_index.json or lacks a component's config (an incomplete download), or a hub id
    whose model_index.json cannot be read (offline without a cached copy, a gated repository
    without an accepted license and login, a wrong id; ``flowgrpo.hub``). Reads no weights, so a
    trainer calls it before anything else loads. Raises ``InputError``."""
    source = os.fspath(path_or_hub_id)
    what = f"a diffusers pipeline of family {family!r}"
    if not is_local_path(source):
        require_hub_file(source, "model_index.json", what=what, field=field)
        return
    folder = os.path.expanduser(source)
    fetch = ("download it with `huggingface-cli download <hub id> --local-dir "
             f"{source}` (or save a pipeline there with pipe.save_pretrained), or set {field} to "
             f"the hub id")
    if not os.path.isdir(folder):
        raise InputError(f"{field}: {source!r} does not exist and is not a hub id 'owner/name': "
                         f"give the folder of {what} or its hub id")
    index = read_model_index(folder)
    if not index:
        raise InputError(f"{field}: {source!r} is not a diffusers pipeline folder (it has no "
                         f"model_index.json): {fetch}")
    missing = []
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or \
                spec[0] is None or spec[1] is None:
            continue
        sub = os.path.join(folder, name)
        required = _component_file(str(spec[1]))
        if not os.path.isdir(sub):
            missing.append(f"{name}/{required or ''}")
        elif required is not None and not os.path.isfile(os.path.join(sub, required)):
            missing.append(f"{name}/{required}")
    if missing:
        raise InputError(f"{field}: the pipeline folder {source!r} is incomplete, it lacks "
                         f"{', '.join(missing)} (an interrupted or partial download): {fetch}")


def read_model_index(path_or_hub_id: str) -> dict:
    """model_index.json of a local folder ({} for a hub id, whose index is not downloaded here)."""
    index = os.path.join(os.path.expanduser(path_or_hub_id), "model_index.json")
    if not os.path.isfile(index):
        return {}
    with open(index) as handle:
        return json.load(handle)
