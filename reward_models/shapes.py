"""A toy text-to-image world with GenEval's task families, and its exact verifier.

Scenes hold 1-4 flat-coloured circles, squares, triangles (pointing up), wedges (triangles
pointing down) and wide rectangles on a black background. Prompts come
from a small grammar with GenEval's six families; every prompt carries structured metadata::

    {"family": "color_attr",
     "objects": [{"shape": "circle", "color": "red", "count": 1},
                 {"shape": "square", "color": "blue", "count": 1}],
     "relation": None}            # or "left of" / "right of" / "above" / "below": objects[0] REL objects[1]

The same module renders scenes (pretraining data, test positives and negatives) and verifies
images (the reward). The verifier segments an image by the nearest palette hue of its bright
pixels, keeps 8-connected components above a minimum area, classifies each component's shape by
geometry (top/bottom asymmetry for triangles, filled bounding-box corners for squares), and
checks the prompt's requirements (shapes present, colours bound to shapes, counts, no extra
objects, relation of centroids with a margin). ``exact`` is 1 when every requirement holds;
``partial`` is the share of requirements that hold.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from scipy import ndimage
from torch import Tensor

from reward_models.base import register_reward

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "wedge", "rectangle")
PLURALS: dict[str, str] = {s: s + "s" for s in SHAPES}
# Width and height of each shape as a share of an object's extent: rectangles are wide bars, the
# one shape told apart by its aspect ratio.
ASPECT: dict[str, tuple[float, float]] = {"circle": (1.0, 1.0), "square": (1.0, 1.0),
                                          "triangle": (1.0, 1.0), "wedge": (1.0, 1.0),
                                          "rectangle": (1.0, 0.45)}
# Corners of the RGB cube: every colour has max channel 1, so dimmed or blurred pixels keep their hue.
PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "magenta": (1.0, 0.0, 1.0),
}
COLORS: tuple[str, ...] = tuple(PALETTE)
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
NUMBER_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three", 4: "four"}
FAMILIES: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position",
                             "color_attr")
# Every word the grammar can produce (the toy tokenizer's vocabulary).
VOCABULARY: tuple[str, ...] = (
    ("a", "and", "of") + tuple(NUMBER_WORDS[n] for n in (2, 3, 4)) + SHAPES
    + tuple(PLURALS[s] for s in SHAPES) + COLORS + ("left", "right", "above", "below"))

HELDOUT_FRACTION = 0.25
# Held-out prompts per family at least: enough distinct prompts that a family's held-out accuracy
# measures generalisation, not a couple of prompts under many seeds.
MIN_HELDOUT: dict[str, int] = {"single_object": 3, "two_object": 8, "counting": 8, "colors": 8,
                               "position": 8, "color_attr": 8}
SPLIT_SEED = 20240607


# --------------------------------------------------------------------------------------------
# Prompt grammar
# --------------------------------------------------------------------------------------------
def _phrase(shape: str, color: str | None, count: int) -> str:
    noun = shape if count == 1 else PLURALS[shape]
    words = [NUMBER_WORDS[count]] + ([color] if color else []) + [noun]
    return " ".join(words)


def make_prompt(metadata: dict) -> str:
    """The prompt string for ``metadata`` (inverse of ``parse_prompt``)."""
    objects = metadata["objects"]
    first = _phrase(objects[0]["shape"], objects[0].get("color"), objects[0]["count"])
    if len(objects) == 1:
        return first
    second = _phrase(objects[1]["shape"], objects[1].get("color"), objects[1]["count"])
    joiner = metadata.get("relation") or "and"
    return f"{first} {joiner} {second}"


def _meta(family: str, objects: list[tuple[str, str | None, int]], relation: str | None = None) -> dict:
    return {"family": family,
            "objects": [{"shape": s, "color": c, "count": n} for s, c, n in objects],
            "relation": relation}


def _family_metadata(family: str) -> list[dict]:
    pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    if family == "single_object":
        return [_meta(family, [(s, None, 1)]) for s in SHAPES]
    if family == "two_object":
        return [_meta(family, [(a, None, 1), (b, None, 1)]) for a, b in pairs]
    if family == "counting":
        return [_meta(family, [(s, None, n)]) for n in (2, 3, 4) for s in SHAPES]
    if family == "colors":
        return [_meta(family, [(s, c, 1)]) for c in COLORS for s in SHAPES]
    if family == "position":
        return [_meta(family, [(a, None, 1), (b, None, 1)], r) for r in RELATIONS for a, b in pairs]
    if family == "color_attr":
        return [_meta(family, [(a, ca, 1), (b, cb, 1)])
                for a, b in pairs for ca in COLORS for cb in COLORS if ca != cb]
    raise ValueError(f"family must be one of {FAMILIES} (got {family!r})")


def _split_family(family: str) -> tuple[list[dict], list[dict]]:
    """(train, heldout) prompt dicts of one family; a seeded shuffle, stable across runs."""
    items = [{"prompt": make_prompt(m), "metadata": m} for m in _family_metadata(family)]
    order = list(range(len(items)))
    random.Random(f"{SPLIT_SEED}-{family}").shuffle(order)
    n_heldout = max(MIN_HELDOUT[family], round(HELDOUT_FRACTION * len(items)))
    heldout = sorted(order[:n_heldout])
    train = sorted(order[n_heldout:])
    return [items[i] for i in train], [items[i] for i in heldout]


def prompt_split(split: str) -> list[dict]:
    """Prompts of ``split`` ("train", "heldout" or "all") as {"prompt": str, "metadata": dict},
    grouped by family in ``FAMILIES`` order. "train" and "heldout" are disjoint and deterministic;
    RL trains on "train" only. Sizes: 750 prompts in all, 197 held out (single object 3 of 5,
    two objects 8 of 20, counting 8 of 15, colours 8 of 30, position 20 of 80, colour attribution
    150 of 600)."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all' (got {split!r})")
    out: list[dict] = []
    for family in FAMILIES:
        train, heldout = _split_family(family)
        if split in ("train", "all"):
            out += train
        if split in ("heldout", "all"):
            out += heldout
    if split == "all":
        out.sort(key=lambda item: (FAMILIES.index(item["metadata"]["family"]), item["prompt"]))
    return out


def parse_prompt(prompt: str) -> dict:
    """Metadata for a prompt of the grammar, e.g. "two red circles" or "a circle left of a square".
    Raises ValueError naming the prompt when it is not in the grammar."""
    words = prompt.strip().lower().split()
    relation = None
    for rel in RELATIONS:
        rel_words = rel.split()
        for i in range(1, len(words) - len(rel_words) + 1):
            if words[i:i + len(rel_words)] == rel_words:
                relation, left, right = rel, words[:i], words[i + len(rel_words):]
                break
        if relation:
            break
    if relation is None:
        if "and" in words:
            i = words.index("and")
            left, right = words[:i], words[i + 1:]
        else:
            left, right = words, None

    def phrase(tokens: list[str]) -> tuple[str, str | None, int]:
        number = {w: n for n, w in NUMBER_WORDS.items()}
        if len(tokens) not in (2, 3) or tokens[0] not in number and tokens[0] != "an":
            raise ValueError(f"prompt {prompt!r} is not in the toy grammar (phrase {' '.join(tokens)!r})")
        count = number.get(tokens[0], 1)
        color = tokens[1] if len(tokens) == 3 else None
        if color is not None and color not in PALETTE:
            raise ValueError(f"prompt {prompt!r}: unknown colour {color!r}; use one of {COLORS}")
        noun = tokens[-1]
        shape = next((s for s in SHAPES if noun in (s, PLURALS[s])), None)
        if shape is None:
            raise ValueError(f"prompt {prompt!r}: unknown shape {noun!r}; use one of {SHAPES}")
        return shape, color, count

    first = phrase(left)
    if right is None:
        family = "counting" if first[2] > 1 else ("colors" if first[1] else "single_object")
        return _meta(family, [first])
    second = phrase(right)
    if relation is not None:
        family = "position"
    else:
        family = "color_attr" if first[1] and second[1] else "two_object"
    return _meta(family, [first, second], relation)


DEFAULT_FAMILY_WEIGHTS: dict[str, float] = {
    "single_object": 0.10, "two_object": 0.12, "counting": 0.24, "colors": 0.12,
    "position": 0.22, "color_attr": 0.20,
}


def random_caption(rng: np.random.Generator, family_weights: dict[str, float] | None = None,
                   split: str = "all") -> dict:
    """A random {"prompt", "metadata"} from ``split``: a family drawn with ``family_weights``
    (default ``DEFAULT_FAMILY_WEIGHTS``, which over-weights counting and relations so no family
    is starved), then a prompt of that family drawn uniformly."""
    weights = DEFAULT_FAMILY_WEIGHTS if family_weights is None else family_weights
    unknown = set(weights) - set(FAMILIES)
    if unknown:
        raise ValueError(f"family_weights has unknown families {sorted(unknown)}; use {FAMILIES}")
    families = [f for f in FAMILIES if weights.get(f, 0.0) > 0]
    if not families:
        raise ValueError("family_weights must give at least one family a weight > 0")
    p = np.array([weights[f] for f in families], dtype=np.float64)
    family = families[rng.choice(len(families), p=p / p.sum())]
    pool = _prompts_by_family(split)[family]
    return pool[int(rng.integers(len(pool)))]


# What a near-miss caption changes, per family: the requirement the family tests, most often.
_NEAR_MISS_KINDS: dict[str, tuple[str, ...]] = {
    "single_object": ("shape",),
    "two_object": ("shape",),
    "counting": ("count", "count", "shape"),
    "colors": ("color", "color", "shape"),
    "position": ("relation", "relation", "shape"),
    "color_attr": ("swap_colors", "color", "shape"),
}


def near_miss(metadata: dict, rng: np.random.Generator) -> dict:
    """A copy of ``metadata`` with exactly one requirement changed: a shape, a colour, a count, the
    relation (its opposite) or, for colour attribution, the colours swapped between the objects.

    Pretraining renders a share of its captions from a near miss (``scripts/pretrain_toy.py
    --caption-noise``), as web captions misdescribe images: the model then learns each prompt's
    correct scene as the main mode among near misses, so it can draw the prompt but does not
    reliably, which is what RL improves. A render of the result never passes ``verify`` against
    the original ``metadata`` (tested)."""
    family = metadata.get("family") or parse_prompt(make_prompt(metadata))["family"]
    kind = _NEAR_MISS_KINDS[family][int(rng.integers(len(_NEAR_MISS_KINDS[family])))]
    out = {"family": family, "objects": [dict(o) for o in metadata["objects"]],
           "relation": metadata.get("relation")}
    objects = out["objects"]
    if kind in ("shape", "color"):
        # another value than any object of the prompt has, so the near miss is never a reordering
        target = objects[int(rng.integers(len(objects)))]
        taken = {o[kind] for o in objects}
        choices = [v for v in (SHAPES if kind == "shape" else COLORS) if v not in taken]
        target[kind] = choices[int(rng.integers(len(choices)))]
    elif kind == "count":
        n = int(objects[0]["count"])
        choices = [c for c in (n - 1, n + 1) if 1 <= c <= 4]
        objects[0]["count"] = choices[int(rng.integers(len(choices)))]
    elif kind == "swap_colors":
        objects[0]["color"], objects[1]["color"] = objects[1]["color"], objects[0]["color"]
    else:
        opposite = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
        out["relation"] = opposite[out["relation"]]
    return out


_POOLS: dict[str, dict[str, list[dict]]] = {}


def _prompts_by_family(split: str) -> dict[str, list[dict]]:
    if split not in _POOLS:
        pools: dict[str, list[dict]] = {f: [] for f in FAMILIES}
        for item in prompt_split(split):
            pools[item["metadata"]["family"]].append(item)
        _POOLS[split] = pools
    return _POOLS[split]


# --------------------------------------------------------------------------------------------
# Renderer
# --------------------------------------------------------------------------------------------
def shape_mask(shape: str, cx: float, cy: float, width: float, height: float, size: int) -> np.ndarray:
    """Boolean (size, size) mask of an ideal shape centred at (cx, cy) in pixel units, sampled at
    pixel centres. Triangles point up, wedges down."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        return (dx / (width / 2)) ** 2 + (dy / (height / 2)) ** 2 <= 1.0
    if shape == "square":
        return (np.abs(dx) <= width / 2) & (np.abs(dy) <= height / 2)
    if shape == "triangle":
        depth = (dy + height / 2) / height       # 0 at the apex, 1 at the base
        return (depth >= 0) & (depth <= 1) & (np.abs(dx) <= depth * width / 2)
    if shape == "wedge":
        depth = (height / 2 - dy) / height       # 0 at the (bottom) apex, 1 at the top edge
        return (depth >= 0) & (depth <= 1) & (np.abs(dx) <= depth * width / 2)
    if shape == "rectangle":
        return (np.abs(dx) <= width / 2) & (np.abs(dy) <= height / 2)
    raise ValueError(f"shape must be one of {SHAPES} (got {shape!r})")


@dataclass
class PlacedObject:
    shape: str
    color: str
    cx: float
    cy: float
    extent: float      # the shape's size in pixels; width, height = extent * ASPECT[shape]

    @property
    def half_size(self) -> tuple[float, float]:
        """Half the drawn width and height, in pixels."""
        width, height = ASPECT[self.shape]
        return self.extent * width / 2, self.extent * height / 2


def _relation_holds(relation: str, a: tuple[float, float], b: tuple[float, float], margin: float) -> bool:
    (ax, ay), (bx, by) = a, b
    if relation == "left of":
        return ax < bx - margin
    if relation == "right of":
        return ax > bx + margin
    if relation == "above":
        return ay < by - margin
    if relation == "below":
        return ay > by + margin
    raise ValueError(f"relation must be one of {RELATIONS} or None (got {relation!r})")


def _expand_objects(metadata: dict, rng: np.random.Generator) -> list[tuple[str, str, int]]:
    """(shape, colour, spec index) per object to draw; unspecified colours drawn at random."""
    out = []
    for index, spec in enumerate(metadata["objects"]):
        for _ in range(int(spec["count"])):
            color = spec.get("color") or COLORS[int(rng.integers(len(COLORS)))]
            out.append((spec["shape"], color, index))
    return out


LAYOUTS: tuple[str, ...] = ("grid", "free")


def place_scene(metadata: dict, size: int, rng: np.random.Generator, layout: str = "grid",
                relation_gap: float = 4.0) -> list[PlacedObject]:
    """A random layout satisfying ``metadata`` (sizes in px at 24 px, scaled with ``size``).

    ``"grid"`` (the default, what pretraining renders): each object takes a distinct cell of a
    2 x 2 grid, 7-8.5 px wide, its centre jittered up to 1.5 px from the cell centre. Two objects
    named with "and" stand in reading order (the first in the left column), a relation puts them in
    the columns (left/right) or rows (above/below) it names, in random rows or columns. The
    coarse, canonical layout is
    what makes the world learnable by a small model in an hour of CPU. ``"free"``: objects of
    6-10 px anywhere. In both, bounding boxes are at least 2 px apart and a relation holds by
    centroids at least ``relation_gap`` px apart."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} (got {layout!r})")
    objects = _expand_objects(metadata, rng)
    if len(objects) > 4:
        raise ValueError(f"metadata asks for {len(objects)} objects; scenes hold at most 4")
    scale = size / 24.0
    relation = metadata.get("relation")
    gap = 2.0 * scale
    cell = size / 2.0
    cells = [(col, row) for row in range(2) for col in range(2)]
    for attempt in range(200):
        placed: list[PlacedObject] = []
        if layout == "grid":
            order = _grid_cells(metadata, len(objects), rng)
            for (shape, color, _), (col, row) in zip(objects, order):
                extent = float(rng.uniform(7.0, 8.5)) * scale
                jitter = rng.uniform(-1.5, 1.5, size=2) * scale
                cx, cy = (col + 0.5) * cell + float(jitter[0]), (row + 0.5) * cell + float(jitter[1])
                placed.append(PlacedObject(shape, color, cx, cy, extent))
        else:
            shrink = 1.0 - 0.1 * min(attempt // 50, 3)
            max_extent = (10.0 if len(objects) <= 2 else 8.0) * scale
            for shape, color, _ in objects:
                extent = float(rng.uniform(6.0 * scale, max(6.0 * scale, max_extent * shrink)))
                for _ in range(50):
                    cx = float(rng.uniform(extent / 2 + 1, size - extent / 2 - 1))
                    cy = float(rng.uniform(extent / 2 + 1, size - extent / 2 - 1))
                    if _separated(PlacedObject(shape, color, cx, cy, extent), placed, gap):
                        placed.append(PlacedObject(shape, color, cx, cy, extent))
                        break
                else:
                    break
            if len(placed) != len(objects):
                continue
        inside = all(half + 0.5 <= c <= size - half - 0.5
                     for p in placed for c, half in zip((p.cx, p.cy), p.half_size))
        apart = all(_separated(p, placed[:i], gap) for i, p in enumerate(placed))
        if not (inside and apart):
            continue
        if relation and not _relation_holds(relation, (placed[0].cx, placed[0].cy),
                                            (placed[1].cx, placed[1].cy), relation_gap * scale):
            continue
        return placed
    raise RuntimeError(f"could not place a scene for {metadata!r} at size {size}")


def _grid_cells(metadata: dict, n_objects: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(column, row) per object for the grid layout: random distinct cells, except that two
    single objects (two objects, position, colour attribution) take the columns or rows their
    prompt implies, so the layout carries the prompt's word order or relation."""
    specs = metadata["objects"]
    if len(specs) != 2 or n_objects != 2:
        cells = [(col, row) for row in range(2) for col in range(2)]
        return [cells[i] for i in rng.permutation(4)[:n_objects]]
    a, b = (int(v) for v in rng.integers(2, size=2))
    relation = metadata.get("relation") or "left of"
    if relation == "left of":
        return [(0, a), (1, b)]
    if relation == "right of":
        return [(1, a), (0, b)]
    if relation == "above":
        return [(a, 0), (b, 1)]
    if relation == "below":
        return [(a, 1), (b, 0)]
    raise ValueError(f"relation must be one of {RELATIONS} or None (got {relation!r})")


def _separated(obj: PlacedObject, others: list[PlacedObject], gap: float) -> bool:
    (half_w, half_h) = obj.half_size
    return all(abs(obj.cx - p.cx) >= half_w + p.half_size[0] + gap
               or abs(obj.cy - p.cy) >= half_h + p.half_size[1] + gap for p in others)


def draw(objects: list[PlacedObject], size: int) -> np.ndarray:
    """float32 (3, size, size) image in [0, 1] of ``objects`` on black."""
    image = np.zeros((3, size, size), dtype=np.float32)
    for obj in objects:
        half_w, half_h = obj.half_size
        mask = shape_mask(obj.shape, obj.cx, obj.cy, 2 * half_w, 2 * half_h, size)
        image[:, mask] = np.asarray(PALETTE[obj.color], dtype=np.float32)[:, None]
    return image


def render(metadata: dict, size: int = 24, rng: np.random.Generator | None = None,
           layout: str = "grid") -> np.ndarray:
    """A random valid scene for ``metadata`` as float32 (3, size, size) in [0, 1]
    (``place_scene`` describes the layouts)."""
    rng = np.random.default_rng() if rng is None else rng
    return draw(place_scene(metadata, size, rng, layout), size)


# --------------------------------------------------------------------------------------------
# Verifier
# --------------------------------------------------------------------------------------------
@dataclass
class DetectedObject:
    shape: str
    color: str
    cx: float
    cy: float
    area: int


_EIGHT = np.ones((3, 3), dtype=bool)
_PALETTE_ARRAY = np.asarray(list(PALETTE.values()), dtype=np.float32)   # (K, 3)


def detect_objects(image: np.ndarray, min_area: float | None = None,
                   brightness: float = 0.4) -> list[DetectedObject]:
    """Objects in a float (3, H, W) image in [0, 1]. A pixel is foreground when its brightest
    channel exceeds ``brightness``; its colour is the palette colour nearest to its
    brightness-normalised value; each colour's 8-connected components of at least ``min_area``
    pixels (default 8 at 24 px, scaled by area) are objects, classified by geometry (``_classify_shape``)."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"image must be (3, H, W) (got shape {tuple(image.shape)})")
    height, width = image.shape[1:]
    if min_area is None:
        min_area = 8.0 * (height * width) / (24.0 * 24.0)
    pixels = np.transpose(image, (1, 2, 0)).astype(np.float32)                  # (H, W, 3)
    value = pixels.max(axis=-1)
    foreground = value > brightness
    hue = pixels / np.maximum(value, 1e-6)[..., None]
    dist = ((hue[..., None, :] - _PALETTE_ARRAY) ** 2).sum(-1)                   # (H, W, K)
    nearest = dist.argmin(-1)
    found: list[DetectedObject] = []
    for k, color in enumerate(COLORS):
        mask = foreground & (nearest == k)
        if not mask.any():
            continue
        labels, n = ndimage.label(mask, structure=_EIGHT)
        if n == 0:
            continue
        slices = ndimage.find_objects(labels)
        for index, sl in enumerate(slices, start=1):
            blob = labels[sl] == index
            area = int(blob.sum())
            if area < min_area:
                continue
            ys, xs = np.nonzero(blob)
            found.append(DetectedObject(
                shape=_classify_shape(blob), color=color,
                cx=float(xs.mean() + sl[1].start + 0.5), cy=float(ys.mean() + sl[0].start + 0.5),
                area=area))
    return found


def _classify_shape(blob: np.ndarray) -> str:
    """Shape of a boolean blob (h, w) cropped to its bounding box, from three geometric features.

    ``aspect`` = w / h: about 2.2 for the wide rectangles, at most 1.33 for the other shapes after
    a 0.6 px blur. ``asymmetry`` = (pixels in the bottom half - pixels in the top half) / area:
    about +0.4 for a triangle (apex up), -0.4 for a wedge (apex down), about 0 for circles and
    squares. ``corner_fill`` = share of the bounding box pixels outside its inscribed ellipse
    (radius inflated by 0.4 px for pixel sampling) that are set: 1 for a square, 0 for a circle,
    robust to mild blur (measured: circles <= 0.25, squares >= 0.5 after a 0.6 px Gaussian blur)."""
    h, w = blob.shape
    if w >= RECTANGLE_MIN_ASPECT * h:
        return "rectangle"
    area = blob.sum()
    half = h // 2
    asymmetry = (blob[h - half:].sum() - blob[:half].sum()) / max(area, 1)
    if asymmetry > 0.2:
        return "triangle"
    if asymmetry < -0.2:
        return "wedge"
    outside = _outside_ellipse(h, w)
    corner_fill = blob[outside].mean() if outside.any() else 1.0
    return "square" if corner_fill > 0.4 else "circle"


RECTANGLE_MIN_ASPECT = 1.45
_OUTSIDE_CACHE: dict[tuple[int, int], np.ndarray] = {}


def _outside_ellipse(h: int, w: int) -> np.ndarray:
    if (h, w) not in _OUTSIDE_CACHE:
        ys, xs = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
        radius_x, radius_y = (w + 0.8) / 2, (h + 0.8) / 2
        _OUTSIDE_CACHE[(h, w)] = ((xs - w / 2) / radius_x) ** 2 + ((ys - h / 2) / radius_y) ** 2 > 1.0
    return _OUTSIDE_CACHE[(h, w)]


@dataclass
class Verdict:
    exact: float          # 1.0 when every requirement holds
    partial: float        # share of requirements that hold
    requirements: dict[str, bool]


def verify(objects: list[DetectedObject], metadata: dict, margin: float = 2.0) -> Verdict:
    """Check detected objects against a prompt's metadata.

    Requirements, per object spec i: ``shape_i`` some object has the shape; ``color_i`` (when a
    colour is given) some object has the shape and the colour; ``count_i`` exactly ``count``
    objects match shape (and colour). Globally: ``total`` no extra objects; ``relation`` (when
    given) some object matching spec 0 and some matching spec 1 have centroids in the relation,
    ``margin`` px apart."""
    req: dict[str, bool] = {}
    matches = []
    for i, spec in enumerate(metadata["objects"]):
        shape, color = spec["shape"], spec.get("color")
        same_shape = [o for o in objects if o.shape == shape]
        match = [o for o in same_shape if color is None or o.color == color]
        matches.append(match)
        req[f"shape_{i}"] = bool(same_shape)
        if color is not None:
            req[f"color_{i}"] = bool(match)
        req[f"count_{i}"] = len(match) == int(spec["count"])
    req["total"] = len(objects) == sum(int(s["count"]) for s in metadata["objects"])
    relation = metadata.get("relation")
    if relation:
        req["relation"] = any(_relation_holds(relation, (a.cx, a.cy), (b.cx, b.cy), margin)
                              for a in matches[0] for b in matches[1] if a is not b)
    met = sum(req.values())
    return Verdict(exact=float(met == len(req)), partial=met / len(req), requirements=req)


def score_image(image: np.ndarray, metadata: dict) -> Verdict:
    """``verify(detect_objects(image), metadata)`` for a float (3, H, W) image in [0, 1]."""
    return verify(detect_objects(image), metadata)


@register_reward("geneval_toy")
class GenevalToyReward:
    """Exact verifier of the toy world (``reward_models.shapes``) as a reward.

    ``score="partial"`` (default) returns the share of the prompt's requirements met, which gives
    group-normalised RL a signal even when no sample is fully right; ``score="exact"`` returns the
    0/1 GenEval-style verdict. Metadata is used when given, else the prompt is parsed.
    """

    name = "geneval_toy"

    def __init__(self, score: Literal["partial", "exact"] = "partial"):
        if score not in ("partial", "exact"):
            raise ValueError(f"score must be 'partial' or 'exact' (got {score!r})")
        self.score = score

    def components(self, media: Tensor, prompts: list[str],
                   metadata: list[dict] | None = None) -> dict[str, Tensor]:
        """{"exact": (B,), "partial": (B,)} float32. Videos (B, F, 3, H, W) are scored per frame
        and averaged."""
        if media.ndim == 5:
            b, f = media.shape[:2]
            flat = self.components(media.flatten(0, 1), [p for p in prompts for _ in range(f)],
                                   None if metadata is None else [m for m in metadata for _ in range(f)])
            return {k: v.view(b, f).mean(1) for k, v in flat.items()}
        if media.ndim != 4 or media.shape[1] != 3:
            raise ValueError(f"media must be (B, 3, H, W) or (B, F, 3, H, W) (got {tuple(media.shape)})")
        if len(prompts) != media.shape[0]:
            raise ValueError(f"prompts has {len(prompts)} entries for {media.shape[0]} images")
        images = media.detach().float().clamp(0, 1).cpu().numpy()
        exact, partial = [], []
        for i, image in enumerate(images):
            meta = metadata[i] if metadata is not None and i < len(metadata) else None
            if not meta or "objects" not in meta:
                meta = parse_prompt(prompts[i])
            verdict = score_image(image, meta)
            exact.append(verdict.exact)
            partial.append(verdict.partial)
        return {"exact": torch.tensor(exact, dtype=torch.float32),
                "partial": torch.tensor(partial, dtype=torch.float32)}

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict] | None = None) -> Tensor:
        return self.components(media, prompts, metadata)[self.score]
