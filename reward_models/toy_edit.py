"""The toy world's editing verifier as a reward (``toy_edit``): an edit is right when the output
is the instruction's target scene and every object of the source stays where it was
(``flowgrpo.toyworld.editing.edit_verdict``). The source image comes with each row's metadata as
``metadata["source_image"]`` (the policy adds it from the prompt record's ``image``)."""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from flowgrpo.toyworld.editing import edit_verdict
from reward_models.base import register_reward

SCORES = ("exact", "partial", "target", "kept", "recolored", "preserved")


@register_reward("toy_edit")
class ToyEditReward:
    """Exact verifier of toy edits. ``score``: "exact" (0/1: target scene and nothing else
    moved or recoloured), "partial" (default: mean of the target's share of requirements met and
    the share of source objects kept, a signal even when no sample is fully right), or one of
    the parts ("target", "kept", "recolored": the edited object in the asked colour at its
    place, whatever else changed; "preserved": 1 - the mean colour change over the source's other
    objects' pixels, graded)."""

    name = "toy_edit"

    def __init__(self,
                 score: Literal["exact", "partial", "target", "kept", "recolored",
                                "preserved"] = "partial"):
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES} (got {score!r})")
        self.score = score

    def components(self, media: Tensor, prompts: list[str],
                   metadata: list[dict] | None = None) -> dict[str, Tensor]:
        """{"exact", "partial", "target", "kept", "recolored", "preserved"}: (B,) float32 each,
        for media (B, 3, H, W) in [0, 1] and metadata with "objects", "edit", "source_image"
        (3, H, W), and for "preserved" the toy record's "source" and "layout_seed", per row."""
        if media.ndim != 4 or media.shape[1] != 3:
            raise ValueError(f"media must be images (B, 3, H, W) (got {tuple(media.shape)})")
        if metadata is None or len(metadata) != media.shape[0]:
            raise ValueError(f"toy_edit needs one metadata dict per image ({media.shape[0]}); use "
                             f"edit prompts (toy:edit_train / toy:edit_heldout)")
        rows = []
        for i, (image, meta) in enumerate(zip(media.detach().float().clamp(0, 1).cpu(), metadata)):
            source = meta.get("source_image")
            if source is None or "edit" not in meta:
                raise ValueError(f"row {i} ({prompts[i]!r}): toy_edit needs metadata['edit'] and "
                                 f"metadata['source_image'] (the record's source image); train "
                                 f"on edit prompts such as toy:edit_train")
            source = torch.as_tensor(source).detach().float().cpu()
            if source.shape != image.shape:
                raise ValueError(f"row {i}: source_image {tuple(source.shape)} and the output "
                                 f"{tuple(image.shape)} must have the same shape")
            rows.append(edit_verdict(image.numpy(), source.numpy(), meta))
        return {k: torch.tensor([r[k] for r in rows], dtype=torch.float32) for k in SCORES}

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict] | None = None) -> Tensor:
        return self.components(media, prompts, metadata)[self.score]
