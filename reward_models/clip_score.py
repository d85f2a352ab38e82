"""CLIPScore: how well an image matches its prompt, from CLIP image/text embeddings.

Score = ``scale * max(cos(image, prompt), 0)`` with ``scale = 100`` by default, the form most
papers and torchmetrics report (about 20..35 for matching real image/caption pairs with
ViT-L/14); ``raw_cosine=True`` returns the cosine in [-1, 1] instead. Flow-GRPO's clip reward is
CLIP's logit / 30 = 100 cos / 30 for the OpenAI checkpoint: ``scale=100/30`` gives the same
values wherever the cosine is positive.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import register_reward
from .clip_common import ClipEncoder, clip_score_from_cosine, paired_cosine


@register_reward("clip_score")
class ClipScoreReward:
    """Prompt-image agreement; ``model`` is a transformers CLIP hub id or folder (or an open_clip
    architecture with ``backend="open_clip"`` and ``pretrained``)."""

    def __init__(self, model: str = "openai/clip-vit-large-patch14", processor: str | None = None,
                 scale: float = 100.0, raw_cosine: bool = False, backend: str = "transformers",
                 pretrained: str | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        if not scale > 0:
            raise ValueError(f"scale must be > 0 (got {scale})")
        self.scale = float(scale)
        self.raw_cosine = bool(raw_cosine)
        self.encoder = ClipEncoder(model, processor, backend=backend, pretrained=pretrained,
                                   device=device, dtype=dtype)

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        cosine = paired_cosine(self.encoder.image_embeds(media), self.encoder.text_embeds(prompts))
        return clip_score_from_cosine(cosine, self.scale, self.raw_cosine).cpu()
