"""The toy world's prompt grammar: shapes, colours, GenEval's six task families, the fixed
train / held-out split, prompt <-> metadata, random captions and near misses (caption noise).

Every prompt carries structured metadata::

    {"family": "color_attr",
     "objects": [{"shape": "circle", "color": "red", "count": 1},
                 {"shape": "square", "color": "blue", "count": 1}],
     "relation": None}            # or "left of" / "right of" / "above" / "below": objects[0] REL objects[1]
"""
from __future__ import annotations

import random

import numpy as np

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
