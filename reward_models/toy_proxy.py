"""A learned proxy of the toy world's verifier (``toy_proxy``): an ensemble of small CNNs that
predict, from a 24 px image and its prompt, the probability that the exact verifier passes it.

It exists to show reward hacking on a model anyone can run: it was fitted to the verifier's
verdicts on samples of the *base* model (``scripts/train_toy_proxy.py``), so it is right where the
base draws and free to be wrong where a policy trained on it goes. Training on it and evaluating
with the verifier (the gold metric) is the toy version of training on PickScore and asking a person.

The ensemble's members differ in initialisation and in the bootstrap sample they were fitted to,
so their spread (``std``) is an uncertainty estimate: large where the members disagree, which is
typically off the base's distribution.

Loads like any user's reward model: ``ToyProxyNet.from_pretrained(folder)`` reads
``config.json`` and ``model.safetensors`` (member ``i``'s tensors under ``member{i}.``).

Prompt features come from the toy grammar (``prompt_features``): per named object its shape,
colour and count, and the relation. The image, with soft palette-colour maps added
(``palette_channels``), goes through three convolutions modulated by the prompt and is flattened,
so the position of objects (relations) stays visible to the head.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from flowgrpo.packaged_data import resolve_packaged_path
from flowgrpo.toyworld.grammar import COLORS, PALETTE, RELATIONS, SHAPES, parse_prompt
from reward_models.base import register_reward

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MAX_OBJECTS = 2          # the grammar names at most two object phrases
MAX_COUNT = 4
# Per object: shape one-hot, colour one-hot (+ "any colour"), count one-hot; then the relation
# one-hot (+ "no relation").
OBJECT_FEATURES = len(SHAPES) + len(COLORS) + 1 + MAX_COUNT
PROMPT_FEATURES = MAX_OBJECTS * OBJECT_FEATURES + len(RELATIONS) + 1


def prompt_features(metadata: dict) -> Tensor:
    """(PROMPT_FEATURES,) float32 encoding of a toy prompt's metadata ({"objects": [{"shape",
    "color", "count"}], "relation"}); absent objects are all-zero blocks."""
    out = torch.zeros(PROMPT_FEATURES)
    objects = metadata["objects"]
    if not 1 <= len(objects) <= MAX_OBJECTS:
        raise ValueError(f"toy prompts name 1 or {MAX_OBJECTS} objects (got {len(objects)})")
    for i, spec in enumerate(objects):
        base = i * OBJECT_FEATURES
        out[base + SHAPES.index(spec["shape"])] = 1.0
        color = spec.get("color")
        out[base + len(SHAPES) + (COLORS.index(color) if color else len(COLORS))] = 1.0
        count = int(spec.get("count", 1))
        if not 1 <= count <= MAX_COUNT:
            raise ValueError(f"toy object counts are 1..{MAX_COUNT} (got {count})")
        out[base + len(SHAPES) + len(COLORS) + 1 + count - 1] = 1.0
    relation = metadata.get("relation")
    out[MAX_OBJECTS * OBJECT_FEATURES + (RELATIONS.index(relation) if relation else
                                         len(RELATIONS))] = 1.0
    return out


def palette_channels(images: Tensor) -> Tensor:
    """(B, 10, H, W) inputs of a member for images (B, 3, H, W) in [0, 1]: the pixels in [-1, 1],
    a soft similarity exp(-|pixel - colour|^2 / 0.1) to each of the six palette colours, and the
    brightest channel. The palette maps spare a small net from learning colour segmentation."""
    palette = torch.tensor(list(PALETTE.values()), dtype=images.dtype, device=images.device)
    dist = ((images.permute(0, 2, 3, 1)[..., None, :] - palette) ** 2).sum(-1)     # B, H, W, 6
    similarity = torch.exp(-dist / 0.1).permute(0, 3, 1, 2)
    return torch.cat([images * 2 - 1, similarity, images.amax(1, keepdim=True)], dim=1)


class ProxyMember(nn.Module):
    """One member: image (B, 3, 24, 24) in [0, 1] and prompt features (B, F) -> logit (B,).
    Three convolutions (the last two strided, to 6 x 6), the first two modulated by the prompt
    (FiLM: a per-channel scale and shift from the prompt features), then the flattened map and
    the prompt's embedding through a two-layer head."""

    def __init__(self, width: int = 16, hidden: int = 64, size: int = 24):
        super().__init__()
        self.conv1 = nn.Conv2d(10, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)       # 12 x 12
        self.conv3 = nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1)   # 6 x 6
        self.film1 = nn.Linear(PROMPT_FEATURES, 2 * width)
        self.film2 = nn.Linear(PROMPT_FEATURES, 4 * width)
        self.prompt = nn.Sequential(nn.Linear(PROMPT_FEATURES, hidden), nn.SiLU())
        flat = 2 * width * (size // 4) ** 2
        self.head = nn.Sequential(nn.Linear(flat + hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    @staticmethod
    def _film(x: Tensor, params: Tensor) -> Tensor:
        scale, shift = params.chunk(2, dim=1)
        return nn.functional.silu(x * (1 + scale[..., None, None]) + shift[..., None, None])

    def forward(self, images: Tensor, features: Tensor) -> Tensor:
        x = self._film(self.conv1(palette_channels(images)), self.film1(features))
        x = self._film(self.conv2(x), self.film2(features))
        x = nn.functional.silu(self.conv3(x)).flatten(1)
        return self.head(torch.cat([x, self.prompt(features)], dim=1)).squeeze(1)


class ToyProxyNet(nn.Module):
    """The ensemble: ``members`` ProxyMembers of the same shape."""

    def __init__(self, members: int = 4, width: int = 16, hidden: int = 64, size: int = 24):
        super().__init__()
        if members < 1:
            raise ValueError(f"members must be >= 1 (got {members})")
        self.config = {"members": members, "width": width, "hidden": hidden, "size": size}
        self.members = nn.ModuleList(ProxyMember(width, hidden, size) for _ in range(members))

    def forward(self, images: Tensor, features: Tensor) -> Tensor:
        """(M, B) probabilities of passing the verifier, one row per member."""
        return torch.stack([torch.sigmoid(m(images, features)) for m in self.members])

    def save_pretrained(self, folder: str | Path, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"member{i}.{k}": v.detach().contiguous()
                   for i, m in enumerate(self.members) for k, v in m.state_dict().items()}
        save_file(tensors, str(folder / WEIGHTS_NAME))
        (folder / CONFIG_NAME).write_text(json.dumps({**self.config, **(extra or {})}, indent=2)
                                          + "\n")

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "ToyProxyNet":
        """Read ``folder/config.json`` and ``folder/model.safetensors`` (safetensors only)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"toy_proxy: {path} is missing; train one with "
                                        f"python scripts/train_toy_proxy.py --out {folder}")
        config = json.loads(config_path.read_text())
        net = cls(**{k: int(config[k]) for k in ("members", "width", "hidden", "size")})
        state = load_file(str(weights_path))
        for i, member in enumerate(net.members):
            prefix = f"member{i}."
            member.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                                    if k.startswith(prefix)})
        return net.eval()


@register_reward("toy_proxy")
class ToyProxyReward:
    """The proxy's probability that the verifier passes each image: the mean over the ensemble
    (``member: None``, default) or one member's (``member: i``). Components: ``mean``, ``std``
    (the members' spread, population std; 0 for one member) and ``member<i>``."""

    name = "toy_proxy"

    def __init__(self, path: str = "assets/toy_proxy", member: int | None = None,
                 device: str | torch.device = "cpu"):
        # The default names the shipped proxy as in a checkout; from another folder it is the
        # installed copy (flowgrpo/packaged_data.py). Paths in a config are resolved at load.
        self.net = ToyProxyNet.from_pretrained(resolve_packaged_path(path)).to(device)
        self.net.requires_grad_(False)
        count = len(self.net.members)
        if member is not None and not 0 <= member < count:
            raise ValueError(f"member must be in 0..{count - 1} or null for the ensemble mean "
                             f"(got {member})")
        self.member = member
        self.device = torch.device(device)
        self.main_component = "mean" if member is None else f"member{member}"

    @torch.no_grad()
    def components(self, media: Tensor, prompts: list[str],
                   metadata: list[dict] | None = None) -> dict[str, Tensor]:
        if media.ndim != 4 or media.shape[1] != 3:
            raise ValueError(f"toy_proxy scores images (B, 3, H, W) (got {tuple(media.shape)})")
        features = torch.stack([
            prompt_features(metadata[i] if metadata and metadata[i] and "objects" in metadata[i]
                            else parse_prompt(p)) for i, p in enumerate(prompts)])
        probs = self.net(media.float().clamp(0, 1).to(self.device),
                         features.to(self.device)).cpu()                      # (M, B)
        out = {"mean": probs.mean(0), "std": probs.std(0, unbiased=False)}
        out.update({f"member{i}": p for i, p in enumerate(probs)})
        return out

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict] | None = None
                 ) -> Tensor:
        return self.components(media, prompts, metadata)[self.main_component]

    def score_gradient(self, media: Tensor, prompts: list[str],
                       metadata: list[dict] | None = None) -> tuple[Tensor, Tensor]:
        """(scores (B,), d scores / d media (B, 3, H, W)) of the main score (the ensemble mean
        or the chosen member), on media's device: the differentiable-reward interface
        (``reward_models.base``) that ``sampling.reward_guidance`` steers rollouts with. Pixels
        outside [0, 1] get gradient 0 (the score clamps them)."""
        if media.ndim != 4 or media.shape[1] != 3:
            raise ValueError(f"toy_proxy scores images (B, 3, H, W) (got {tuple(media.shape)})")
        features = torch.stack([
            prompt_features(metadata[i] if metadata and metadata[i] and "objects" in metadata[i]
                            else parse_prompt(p)) for i, p in enumerate(prompts)])
        with torch.enable_grad():
            pixels = media.detach().float().to(self.device).requires_grad_(True)
            probs = self.net(pixels.clamp(0, 1), features.to(self.device))          # (M, B)
            scores = probs.mean(0) if self.member is None else probs[self.member]
            (grad,) = torch.autograd.grad(scores.sum(), pixels)
        return scores.detach().to(media.device), grad.to(media.device)
