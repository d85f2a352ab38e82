"""Image quality of toy scenes, apart from what the verifier checks.

The renderer draws flat palette colours on pure black with hard edges (``render.draw``), so a clean
scene has two properties that the verifier (``verify.py``: colour segments, shapes, centroids)
never looks at: its background is exactly black, and every object pixel is exactly a palette
colour. A policy trained on the verifier alone is free to tint and pattern the background and to
texture its objects, as long as the segments stay right. These two measures see exactly that:

- ``background``: the mean brightest channel over background pixels (brightest channel below
  ``BACKGROUND_BELOW``): 0 for a render, larger for tint, noise or patterns on the canvas.
- ``texture``: the mean distance (RGB, divided by sqrt(3) so it lies in [0, 1]) of each foreground
  pixel (brightest channel above ``FOREGROUND_ABOVE``: what the verifier segments) to its nearest
  palette colour: 0 for a render, larger for shading, grids or off-palette colours on objects.

``artifacts = background + texture`` is 0 for every render and grows with either defect. Pixels
between the two thresholds (the soft edges a model draws) count in neither.
"""
from __future__ import annotations

import numpy as np

from flowgrpo.toyworld.grammar import PALETTE

BACKGROUND_BELOW = 0.3
FOREGROUND_ABOVE = 0.4
_PALETTE = np.asarray(list(PALETTE.values()), dtype=np.float32)   # (K, 3)


def artifact_scores(images: np.ndarray) -> dict[str, np.ndarray]:
    """{"background", "texture", "artifacts"}: (B,) float32 each, for images (B, 3, H, W) in
    [0, 1]. An image without background (or foreground) pixels scores 0 on that part."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (B, 3, H, W) (got shape {tuple(images.shape)})")
    pixels = np.transpose(np.clip(images, 0.0, 1.0), (0, 2, 3, 1)).astype(np.float32)  # B,H,W,3
    value = pixels.max(axis=-1)                                                      # B,H,W
    background = value < BACKGROUND_BELOW
    foreground = value > FOREGROUND_ABOVE
    dist = np.sqrt(((pixels[..., None, :] - _PALETTE) ** 2).sum(-1)).min(-1) / np.sqrt(3.0)
    flat = (len(images), -1)

    def masked_mean(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
        count = mask.reshape(flat).sum(1)
        total = (values * mask).reshape(flat).sum(1)
        return np.where(count > 0, total / np.maximum(count, 1), 0.0).astype(np.float32)

    back = masked_mean(value, background)
    tex = masked_mean(dist, foreground)
    return {"background": back, "texture": tex, "artifacts": (back + tex).astype(np.float32)}
