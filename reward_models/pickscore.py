"""PickScore (Kirstain et al. 2023): a CLIP-H fine-tuned on Pick-a-Pic human preferences.

Score = ``logit_scale * cos(image, prompt)`` as the model card computes it (logit_scale = exp of
the checkpoint's learned value, 100 in PickScore_v1), about 18..24 for typical generations.
``normalise=True`` divides by 26, as Flow-GRPO's PickScore reward does (values near 0.7..0.9).
The processor (preprocessing constants, tokenizer) comes from the CLIP-H repository, the
weights from PickScore's, as in the model card.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import register_reward
from .clip_common import ClipEncoder, paired_cosine

PICKSCORE_NORMALISER = 26.0


def pickscore_from_cosine(cosine: Tensor, logit_scale: float, normalise: bool = False) -> Tensor:
    """(B,) cosines -> (B,) ``logit_scale * cos``, divided by 26 when ``normalise``."""
    scores = logit_scale * cosine
    return scores / PICKSCORE_NORMALISER if normalise else scores


@register_reward("pickscore")
class PickScoreReward:
    """Human-preference score of an image for its prompt (higher is better)."""

    def __init__(self, model: str = "yuvalkirstain/PickScore_v1",
                 processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", normalise: bool = False,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.normalise = bool(normalise)
        self.encoder = ClipEncoder(model, processor, device=device, dtype=dtype)

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        cosine = paired_cosine(self.encoder.image_embeds(media), self.encoder.text_embeds(prompts))
        return pickscore_from_cosine(cosine, self.encoder.logit_scale, self.normalise).cpu()
