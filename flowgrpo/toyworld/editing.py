"""The toy world's editing task: a source scene, an instruction, and the exact edited scene.

An edit record is a prompt record with a source image (``flowgrpo.prompts``)::

    {"prompt": "make the circle blue",
     "image": float (3, 24, 24) in [0, 1],          # the source scene
     "mask": float (1, 24, 24) of 0/1,              # where source and target differ
     "keep_mask": float (1, 24, 24) of 0/1,         # the source's objects the edit leaves alone
     "metadata": {"family": "recolor_two",           # recolor_one / recolor_two (objects in scene)
                  "task": "edit",
                  "objects": [...], "relation": None, # the TARGET scene (grammar metadata)
                  "source": {...},                    # the source scene's grammar metadata
                  "edit": {"kind": "recolor", "shape": "circle", "color": "blue"},
                  "layout_seed": 123}}                # render_pair(source, edit, seed) redraws both

The source scenes are the grammar's coloured scenes ("colors": one object, "color_attr": two),
train sources from the grammar's train split and held-out sources from its held-out split, so
``edit_heldout`` asks for edits of scenes never trained on. Each source prompt gives one edit (a
seeded choice of object and new colour) and one seeded layout, so the splits are deterministic.
``reward_models/toy_edit.py`` verifies an edit exactly: the target scene holds and every object
of the source stays where it was (``edit_verdict``).
"""
from __future__ import annotations

import copy
import random

import numpy as np
import torch

from flowgrpo.toyworld.grammar import COLORS, prompt_split
from flowgrpo.toyworld.render import draw, place_scene
from flowgrpo.toyworld.verify import DetectedObject, detect_objects, verify

# Words the instructions add to the grammar's vocabulary (the editing tokenizer's extra words).
EDIT_WORDS: tuple[str, ...] = ("make", "the")
EDIT_SPLITS: tuple[str, ...] = ("edit_train", "edit_heldout")
EDIT_FAMILIES: dict[str, str] = {"colors": "recolor_one", "color_attr": "recolor_two"}
EDIT_SEED = 20261130
# How far (px, at 24 px) an object kept by the edit may drift from its source position.
KEEP_TOLERANCE = 2.0


def instruction(edit: dict) -> str:
    """The instruction of ``edit`` ({"kind": "recolor", "shape", "color"}), e.g. "make the circle blue"."""
    if edit.get("kind") != "recolor":
        raise ValueError(f"edit kind must be 'recolor' (got {edit.get('kind')!r})")
    return f"make the {edit['shape']} {edit['color']}"


def apply_edit(source: dict, edit: dict) -> dict:
    """The target grammar metadata: ``source`` with the edited object's colour changed."""
    target = copy.deepcopy(source)
    hits = [o for o in target["objects"] if o["shape"] == edit["shape"]]
    if len(hits) != 1:
        raise ValueError(f"edit {edit} must name exactly one object of the source scene "
                         f"{source['objects']}")
    hits[0]["color"] = edit["color"]
    return target


def choose_edit(source: dict, rng: random.Random) -> dict:
    """A recolour of one object of ``source`` to a colour no object of the scene has."""
    target = source["objects"][rng.randrange(len(source["objects"]))]
    taken = {o["color"] for o in source["objects"]}
    return {"kind": "recolor", "shape": target["shape"],
            "color": rng.choice([c for c in COLORS if c not in taken])}


def render_pair(source: dict, edit: dict, seed: int, size: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """(source image, target image), float32 (3, size, size) in [0, 1]: one layout drawn for the
    source scene, the target the same layout with the edited object recoloured."""
    placed = place_scene(source, size, np.random.default_rng(seed))
    edited = [copy.copy(p) for p in placed]
    for p in edited:
        if p.shape == edit["shape"]:
            p.color = edit["color"]
    return draw(placed, size), draw(edited, size)


def edit_mask(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(1, H, W) float32 of 0/1: the pixels where the target differs from the source (3, H, W),
    i.e. the recoloured object's pixels, its anti-aliased rim included."""
    return (np.abs(target - source).max(axis=0, keepdims=True) > 0).astype(np.float32)


def keep_mask(source: np.ndarray, edit_region: np.ndarray) -> np.ndarray:
    """(1, H, W) float32 of 0/1: the source's object pixels (any channel above the black
    background) outside the edit region (1, H, W): the objects the edit must leave alone."""
    foreground = source.max(axis=0, keepdims=True) > 0
    return (foreground & (edit_region == 0)).astype(np.float32)


def layout_regions(source: dict, edit: dict, seed: int, size: int = 24
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source image (3, size, size), edit region, keep region (1, size, size) of 0/1) of one
    seeded layout: ``render_pair``'s source, ``edit_mask`` and ``keep_mask``. The records'
    "image" / "mask" / "keep_mask", and what the ``preserved`` score redraws from metadata."""
    image, target_image = render_pair(source, edit, seed, size)
    region = edit_mask(image, target_image)
    return image, region, keep_mask(image, region)


def edit_split(split: str) -> list[dict]:
    """Edit records of ``split`` ("edit_train" or "edit_heldout"), with ``image`` a float32 torch
    tensor (3, 24, 24) in [0, 1], ``mask`` its exact edit region (``edit_mask``, (1, 24, 24)) and
    ``keep_mask`` the objects the edit leaves alone (``keep_mask``);
    families in ``EDIT_FAMILIES`` order."""
    if split not in EDIT_SPLITS:
        raise ValueError(f"split must be one of {EDIT_SPLITS} (got {split!r})")
    grammar_split = "train" if split == "edit_train" else "heldout"
    records = []
    for item in prompt_split(grammar_split):
        source = item["metadata"]
        if source["family"] not in EDIT_FAMILIES:
            continue
        rng = random.Random(f"{EDIT_SEED}-{item['prompt']}")
        edit = choose_edit(source, rng)
        seed = rng.randrange(2 ** 31)
        image, region, keep = layout_regions(source, edit, seed)
        target = apply_edit(source, edit)
        records.append({
            "prompt": instruction(edit),
            "image": torch.from_numpy(image),
            "mask": torch.from_numpy(region),
            "keep_mask": torch.from_numpy(keep),
            "metadata": {"family": EDIT_FAMILIES[source["family"]], "task": "edit",
                         "objects": target["objects"], "relation": target.get("relation"),
                         "source": source, "edit": edit, "layout_seed": seed}})
    return records


def _kept(source_objects: list[DetectedObject], output_objects: list[DetectedObject],
          edit: dict, tolerance: float) -> tuple[int, int]:
    """(objects of the source found where they were, objects of the source). A source object is
    kept when an output object of its shape, and of its colour unless it is the edited object,
    lies within ``tolerance`` px of its centroid."""
    found = 0
    for obj in source_objects:
        edited = obj.shape == edit["shape"]
        found += any(o.shape == obj.shape and (edited or o.color == obj.color)
                     and _near(o, obj, tolerance) for o in output_objects)
    return found, len(source_objects)


def edit_verdict(output: np.ndarray, source: np.ndarray, metadata: dict,
                 tolerance: float = KEEP_TOLERANCE) -> dict[str, float]:
    """Scores of one edit. output/source: float (3, H, W) in [0, 1]; metadata: an edit record's.

    ``target``: 1 when the output is the target scene exactly (``verify``: shapes, colours,
    counts, no extra objects); ``kept``: share of the source's objects still at their place (the
    edited one by shape, the others by shape and colour, centroids within ``tolerance`` px scaled
    with H); ``recolored``: 1 when the edited object is at its place in the asked colour, whatever
    the rest of the scene does (the verdict on the edit region alone, where ``target`` also fails
    when another object changes); ``preserved``: 1 - the mean over the source's other objects'
    pixels (``keep_mask`` of the record's layout) of the largest channel difference between output
    and source, a graded preservation score that varies within a group even when ``kept`` does
    not (1 when the edit leaves nothing else, as in one-object scenes); ``exact``: target and
    every object kept; ``partial``: the mean of the target's share of requirements met and
    ``kept``."""
    target = verify(detect_objects(output), metadata)
    tolerance = tolerance * output.shape[-1] / 24.0
    source_objects, output_objects = detect_objects(source), detect_objects(output)
    found, total = _kept(source_objects, output_objects, metadata["edit"], tolerance)
    kept = found / max(total, 1)
    return {"exact": float(target.exact == 1.0 and found == total),
            "partial": 0.5 * (target.partial + kept), "target": target.exact, "kept": kept,
            "recolored": _recolored(source_objects, output_objects, metadata["edit"], tolerance),
            "preserved": _preserved(output, source, metadata)}


def _recolored(source_objects: list[DetectedObject], output_objects: list[DetectedObject],
               edit: dict, tolerance: float) -> float:
    """1.0 when an output object of the edited shape, in the edit's colour, lies within
    ``tolerance`` px of the edited source object's centroid; else 0.0 (also when the source has
    no object of that shape: nothing to recolour)."""
    return float(any(o.shape == edit["shape"] and o.color == edit["color"]
                     and _near(o, obj, tolerance)
                     for obj in source_objects if obj.shape == edit["shape"]
                     for o in output_objects))


def _near(a: DetectedObject, b: DetectedObject, tolerance: float) -> bool:
    """The two centroids within ``tolerance`` px of each other on both axes."""
    return abs(a.cx - b.cx) <= tolerance and abs(a.cy - b.cy) <= tolerance


def _preserved(output: np.ndarray, source: np.ndarray, metadata: dict) -> float:
    """1 - mean over the keep region of max_c |output - source| (images (3, H, W) in [0, 1]); the
    keep region is the record's (``keep_mask`` of ``render_pair``'s layout, redrawn from
    ``metadata["source"]``, ``["edit"]`` and ``["layout_seed"]`` at the output's size). 1.0 when
    the region is empty."""
    missing = [k for k in ("source", "edit", "layout_seed") if k not in metadata]
    if missing:
        raise ValueError(f"the preserved score redraws the record's layout and needs metadata "
                         f"{missing}: use toy:edit_* records (toyworld.editing.edit_split)")
    _, _, keep = layout_regions(metadata["source"], metadata["edit"], metadata["layout_seed"],
                                output.shape[-1])
    keep = keep[0] > 0
    if not keep.any():
        return 1.0
    return float(1.0 - np.abs(output - source).max(axis=0)[keep].mean())
