"""The toy world's image-quality metric as a reward (``toy_artifacts``): what the exact verifier
cannot see (``flowgrpo.toyworld.quality``). Lower is better; a clean render scores 0. Meant as a
held-out metric (``eval.rewards``), not as a training reward."""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from flowgrpo.toyworld.quality import artifact_scores
from reward_models.base import register_reward

PARTS = ("artifacts", "background", "texture")


@register_reward("toy_artifacts")
class ToyArtifactsReward:
    """Artifact energy of toy images: ``background`` (mean brightest channel of the canvas),
    ``texture`` (mean distance of object pixels to the flat palette colour) and their sum
    ``artifacts`` (the main score, ``score`` picks another). 0 for the renderer's own scenes;
    higher means more of what the verifier ignores."""

    name = "toy_artifacts"
    higher_is_better = False

    def __init__(self, score: Literal["artifacts", "background", "texture"] = "artifacts"):
        if score not in PARTS:
            raise ValueError(f"score must be one of {PARTS} (got {score!r})")
        self.score = score
        self.main_component = score

    def components(self, media: Tensor, prompts: list[str],
                   metadata: list[dict] | None = None) -> dict[str, Tensor]:
        """Each part, (B,) float32, for images (B, 3, H, W) or videos (B, F, 3, H, W, the mean
        over frames) in [0, 1]."""
        if media.ndim == 5:
            b, f = media.shape[:2]
            flat = self.components(media.flatten(0, 1), [p for p in prompts for _ in range(f)])
            return {k: v.view(b, f).mean(1) for k, v in flat.items()}
        if media.ndim != 4 or media.shape[1] != 3:
            raise ValueError(f"media must be (B, 3, H, W) or (B, F, 3, H, W) "
                             f"(got {tuple(media.shape)})")
        scores = artifact_scores(media.detach().float().cpu().numpy())
        return {k: torch.from_numpy(v) for k, v in scores.items()}

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict] | None = None
                 ) -> Tensor:
        return self.components(media, prompts, metadata)[self.score]
