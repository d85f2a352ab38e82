"""LAION "improved aesthetic predictor": an MLP on L2-normalised CLIP ViT-L/14 image embeddings.

Score ~ 1..10 (mean opinion score scale of the AVA/SAC/LOGOS ratings it was trained on).
Weights: the CLIP model from a hub id or folder (default ``openai/clip-vit-large-patch14``) and
the head from a file: a local ``.safetensors`` (preferred) or ``.pth``/``.pt``/``.bin`` state dict
(read with ``torch.load(weights_only=True)``, never unpickling objects), or ``"hub_repo:filename"``
fetched with huggingface_hub (default: the published ``sac+logos+ava1-l14-linearMSE.pth``).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from .base import register_reward
from .clip_common import ClipEncoder, l2_normalise

DEFAULT_HEAD = "camenduru/improved-aesthetic-predictor:sac+logos+ava1-l14-linearMSE.pth"
# The published head's state-dict keys (nn.Sequential indices; dropouts have no weights).
HEAD_KEYS = tuple(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))


class AestheticHead(nn.Module):
    """The published layer stack: Linear(D,1024), Dropout(0.2), Linear(1024,128), Dropout(0.2),
    Linear(128,64), Dropout(0.1), Linear(64,16), Linear(16,1); no activations (it is affine).
    Input (B, D) unit-norm embeddings, output (B, 1)."""

    def __init__(self, embed_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: Tensor) -> Tensor:
        return self.layers(embeds)


def read_state_dict(path: str) -> dict[str, Tensor]:
    """Tensors from a ``.safetensors`` file, or from a torch state-dict file loaded with
    ``weights_only=True`` (no arbitrary unpickling)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(state).__name__})")
    return state


def resolve_weights_file(spec: str) -> str:
    """A local path as is; ``"owner/repo:filename"`` downloaded (or found in the cache) with
    huggingface_hub."""
    if os.path.exists(spec):
        return spec
    repo_id, sep, filename = spec.rpartition(":")
    if not sep or "/" not in repo_id:
        raise FileNotFoundError(f"head file {spec!r} not found; give a local path or "
                                f"'owner/repo:filename' on the Hugging Face hub")
    from flowgrpo.hub import require_hub_file

    return require_hub_file(repo_id, filename, what="an aesthetic head file",
                            field="the reward option 'head'")


def load_aesthetic_head(path: str) -> AestheticHead:
    """The head from a state dict with the published keys ``layers.{0,2,4,6,7}.{weight,bias}``;
    the input size comes from ``layers.0.weight``."""
    state = read_state_dict(path)
    if set(state) != set(HEAD_KEYS):
        raise ValueError(f"aesthetic head file {path} has keys {sorted(state)}; expected the "
                         f"published keys {list(HEAD_KEYS)}")
    head = AestheticHead(embed_dim=int(state["layers.0.weight"].shape[1]))
    head.load_state_dict({k: v.float() for k, v in state.items()})
    return head.eval().requires_grad_(False)


def aesthetic_from_embeds(image_embeds: Tensor, head: nn.Module) -> Tensor:
    """(B, D) raw CLIP image embeddings -> (B,) head(embeds / ||embeds||)."""
    return head(l2_normalise(image_embeds.float()))[:, 0]


@register_reward("aesthetic")
class AestheticReward:
    """LAION aesthetic score (about 1..10, higher is better); ignores prompts."""

    def __init__(self, model: str = "openai/clip-vit-large-patch14", head: str = DEFAULT_HEAD,
                 processor: str | None = None, backend: str = "transformers",
                 pretrained: str | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.encoder = ClipEncoder(model, processor, backend=backend, pretrained=pretrained,
                                   device=device, dtype=dtype)
        self.head = load_aesthetic_head(resolve_weights_file(head)).to(self.encoder.device)
        in_dim = self.head.layers[0].in_features
        if self.encoder.embed_dim is not None and self.encoder.embed_dim != in_dim:
            raise ValueError(f"aesthetic head expects {in_dim}-d embeddings but CLIP model "
                             f"{model!r} gives {self.encoder.embed_dim}-d; use the CLIP model the "
                             f"head was trained on (ViT-L/14 for the published head)")

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return aesthetic_from_embeds(self.encoder.image_embeds(media), self.head).cpu()
