"""The toy world's exact verifier: segment an image by the nearest palette hue of its bright
pixels, keep 8-connected components above a minimum area, classify each component's shape by
geometry (top/bottom asymmetry for triangles, filled bounding-box corners for squares), and check
the prompt's requirements (shapes present, colours bound to shapes, counts, no extra objects,
relation of centroids with a margin). ``exact`` is 1 when every requirement holds; ``partial``
is the share of requirements that hold."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from flowgrpo.toyworld.grammar import COLORS, PALETTE
from flowgrpo.toyworld.render import relation_holds

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
        req["relation"] = any(relation_holds(relation, (a.cx, a.cy), (b.cx, b.cy), margin)
                              for a in matches[0] for b in matches[1] if a is not b)
    met = sum(req.values())
    return Verdict(exact=float(met == len(req)), partial=met / len(req), requirements=req)


def score_image(image: np.ndarray, metadata: dict) -> Verdict:
    """``verify(detect_objects(image), metadata)`` for a float (3, H, W) image in [0, 1]."""
    return verify(detect_objects(image), metadata)
