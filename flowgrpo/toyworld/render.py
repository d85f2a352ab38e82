"""Rendering toy scenes: flat-coloured circles, squares, triangles (pointing up), wedges
(pointing down) and wide rectangles on black, laid out in the prompt's order or relation
(pretraining data, test positives and negatives)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowgrpo.toyworld.grammar import ASPECT, COLORS, PALETTE, RELATIONS, SHAPES

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


def relation_holds(relation: str, a: tuple[float, float], b: tuple[float, float], margin: float) -> bool:
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
        if relation and not relation_holds(relation, (placed[0].cx, placed[0].cy),
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
