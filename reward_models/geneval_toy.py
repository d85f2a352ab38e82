"""The toy world's verifier as a reward (``geneval_toy``): the world itself (grammar,
renderer, verifier) is ``flowgrpo.toyworld``."""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from flowgrpo.toyworld.grammar import parse_prompt
from flowgrpo.toyworld.verify import score_image
from reward_models.base import register_reward


@register_reward("geneval_toy")
class GenevalToyReward:
    """Exact verifier of the toy world (``flowgrpo.toyworld``) as a reward.

    ``score="partial"`` (default) returns the share of the prompt's requirements met, which gives
    group-normalised RL a signal even when no sample is fully right; ``score="exact"`` returns the
    0/1 GenEval-style verdict. Metadata is used when given, else the prompt is parsed.
    """

    name = "geneval_toy"

    def __init__(self, score: Literal["partial", "exact"] = "partial"):
        if score not in ("partial", "exact"):
            raise ValueError(f"score must be 'partial' or 'exact' (got {score!r})")
        self.score = score

    def components(self, media: Tensor, prompts: list[str],
                   metadata: list[dict] | None = None) -> dict[str, Tensor]:
        """{"exact": (B,), "partial": (B,)} float32. Videos (B, F, 3, H, W) are scored per frame
        and averaged."""
        if media.ndim == 5:
            b, f = media.shape[:2]
            flat = self.components(media.flatten(0, 1), [p for p in prompts for _ in range(f)],
                                   None if metadata is None else [m for m in metadata for _ in range(f)])
            return {k: v.view(b, f).mean(1) for k, v in flat.items()}
        if media.ndim != 4 or media.shape[1] != 3:
            raise ValueError(f"media must be (B, 3, H, W) or (B, F, 3, H, W) (got {tuple(media.shape)})")
        if len(prompts) != media.shape[0]:
            raise ValueError(f"prompts has {len(prompts)} entries for {media.shape[0]} images")
        images = media.detach().float().clamp(0, 1).cpu().numpy()
        exact, partial = [], []
        for i, image in enumerate(images):
            meta = metadata[i] if metadata is not None and i < len(metadata) else None
            if not meta or "objects" not in meta:
                meta = parse_prompt(prompts[i])
            verdict = score_image(image, meta)
            exact.append(verdict.exact)
            partial.append(verdict.partial)
        return {"exact": torch.tensor(exact, dtype=torch.float32),
                "partial": torch.tensor(partial, dtype=torch.float32)}

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict] | None = None) -> Tensor:
        return self.components(media, prompts, metadata)[self.score]
