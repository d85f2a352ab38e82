"""Temporal consistency of videos: mean cosine similarity of consecutive frames' CLIP image
embeddings, in [-1, 1] (1 = every frame embeds identically). Video-native: takes (B, F, 3, H, W).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import register_reward
from .clip_common import ClipEncoder, consecutive_frame_cosine
from .media import frame_indices


@register_reward("temporal_consistency")
class TemporalConsistencyReward:
    """``frames``: embed this many evenly spaced frames (None = all); consecutive means
    consecutive among those."""

    video_native = True

    def __init__(self, model: str = "openai/clip-vit-large-patch14", processor: str | None = None,
                 frames: int | None = None, backend: str = "transformers",
                 pretrained: str | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        if frames is not None and frames < 2:
            raise ValueError(f"frames must be >= 2 or None for all frames (got {frames})")
        self.frames = frames
        self.encoder = ClipEncoder(model, processor, backend=backend, pretrained=pretrained,
                                   device=device, dtype=dtype)

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        if media.ndim != 5:
            raise ValueError(f"temporal_consistency scores videos (B, F, 3, H, W) "
                             f"(got shape {tuple(media.shape)})")
        index = frame_indices(media.shape[1], self.frames).to(media.device)
        videos = media[:, index]
        embeds = self.encoder.image_embeds(videos.flatten(0, 1))
        return consecutive_frame_cosine(embeds.view(*videos.shape[:2], -1)).cpu()
