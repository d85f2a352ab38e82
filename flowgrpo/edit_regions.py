"""Edit regions: where an edit should change the image, as masks for the locality-preserving
advantages (``training.locality``, docs/design.md "Editing: locality-preserving advantages").

A region mask is a float tensor in [0, 1], 1 where the edit should act (the edit region) and 0
where the source should be kept; values in between are fractional membership (an area-downsampled
boundary cell). Masks start in pixel space, (B, 1, H, W), from one of two sources:

- the prompt record's ``"mask"`` (``training.locality.mask: record``): the toy world's edits know
  it exactly (the recoloured object's pixels, ``toyworld.editing``); a JSONL record names a
  greyscale image (``"mask": "path"``, ``flowgrpo.prompts``);
- the difference of the source image and the sample (``mask: difference``): pixels whose largest
  channel difference exceeds a threshold, per sample (``difference_mask``).

A model whose latents are not pixels maps a pixel mask to its latent layout
(``region_mask(mask, resize)`` of the adapter) with ``downsample_mask``: "nearest" (each latent
cell takes the pixel at its centre: a binary mask stays binary) or "area" (each cell takes the
share of its pixels inside the region: exact fractional membership). The toy model's latents are
its pixels, so its mapping is the identity.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

REGION_RESIZES = ("nearest", "area")


def _as_mask_batch(mask: Tensor) -> Tensor:
    """(B, H, W) or (B, 1, H, W) -> (B, 1, H, W) float32."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor (got {type(mask).__name__})")
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"mask must have shape (B, H, W) or (B, 1, H, W) (got {tuple(mask.shape)})")
    return mask.to(torch.float32)


def downsample_mask(mask: Tensor, size: tuple[int, int], rule: str = "area") -> Tensor:
    """A pixel mask on a coarser grid (a VAE's latent grid), (B, 1, h, w) float32 in [0, 1].

    mask: (B, H, W) or (B, 1, H, W) in [0, 1]; size: (h, w) with h <= H, w <= W.
    rule "nearest": cell (i, j) takes the pixel at floor((i + 1/2) H / h), floor((j + 1/2) W / w)
    (its centre; torch's "nearest-exact"), so a binary mask stays binary. rule "area": cell (i, j)
    takes the mean of the pixels it covers (adaptive average pooling; for an integer factor f,
    the mean of its f x f block), the share of the cell inside the region. Equal sizes return
    the mask unchanged under both rules.
    """
    if rule not in REGION_RESIZES:
        raise ValueError(f"rule must be one of {REGION_RESIZES} (got {rule!r})")
    mask = _as_mask_batch(mask)
    height, width = int(size[0]), int(size[1])
    if height < 1 or width < 1 or height > mask.shape[2] or width > mask.shape[3]:
        raise ValueError(f"size must be a grid of at least 1 x 1 and at most the mask's "
                         f"{tuple(mask.shape[2:])} (got {(height, width)}); a region mask is "
                         f"only ever downsampled to the latent grid")
    if (height, width) == tuple(mask.shape[2:]):
        return mask
    if rule == "nearest":
        return F.interpolate(mask, size=(height, width), mode="nearest-exact")
    return F.adaptive_avg_pool2d(mask, (height, width))


def difference_mask(output: Tensor, source: Tensor, threshold: float) -> Tensor:
    """(B, 1, H, W) float32 of 0/1: 1 where max over channels |output - source| > threshold.

    output: (B, C, H, W) samples in [0, 1]; source: (B, C, H', W') source images in [0, 1],
    area-resized to (H, W) when the sizes differ; threshold in [0, 1)."""
    if output.dim() != 4 or source.dim() != 4 or output.shape[:2] != source.shape[:2]:
        raise ValueError(f"output and source must be (B, C, H, W) with the same B and C (got "
                         f"{tuple(output.shape)} and {tuple(source.shape)})")
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must be in [0, 1) (got {threshold})")
    source = source.to(torch.float32)
    if source.shape[2:] != output.shape[2:]:
        source = F.interpolate(source, size=tuple(output.shape[2:]), mode="area")
    change = (output.to(torch.float32) - source.to(output.device)).abs().amax(dim=1, keepdim=True)
    return (change > threshold).to(torch.float32)


def stack_masks(masks: list[Tensor]) -> Tensor:
    """Records' masks (each (1, H, W) or (H, W), the same size) -> (B, 1, H, W) float32."""
    shapes = {tuple(m.shape[-2:]) for m in masks}
    if len(shapes) != 1:
        raise ValueError(f"the records' edit masks must share one size to form a batch (got "
                         f"{sorted(shapes)}); give masks the size of their source images")
    return torch.stack([m.reshape(1, *m.shape[-2:]).to(torch.float32) for m in masks])
