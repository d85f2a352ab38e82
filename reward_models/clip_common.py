"""CLIP machinery shared by aesthetic, clip_score, pickscore and temporal_consistency.

- ``ClipPreprocess``: the CLIP image processor's resize / center-crop / normalise done on float
  tensors (no PIL round trip, differentiable, runs on the model's device). Built from the
  checkpoint's own processor config so that each model gets the preprocessing it was trained with.
- ``ClipEncoder``: image and text embeddings from a transformers ``CLIPModel`` (hub id or local
  folder) or, optionally, an open_clip model.
- Pure score maths on embeddings, tested on hand-made vectors.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_PIL_RESAMPLE_TO_MODE = {0: "nearest", 1: "bicubic", 2: "bilinear", 3: "bicubic"}  # 1 = LANCZOS


# ---- preprocessing ----

@dataclass(frozen=True)
class ClipPreprocess:
    """Resize so the shorter side is ``shortest_edge`` (or to ``resize_hw`` exactly), center-crop
    to ``crop_hw`` (zero-padding when smaller), normalise with ``mean``/``std`` per channel."""

    shortest_edge: int | None = 224
    resize_hw: tuple[int, int] | None = None
    crop_hw: tuple[int, int] | None = (224, 224)
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD
    interpolation: str = "bicubic"

    @classmethod
    def from_image_processor(cls, processor) -> "ClipPreprocess":
        """From a transformers CLIP image processor (its ``size``, ``crop_size``, ``do_*``,
        ``image_mean``, ``image_std``, ``resample``)."""
        def as_dict(value):
            if value is None:
                return {}
            if isinstance(value, int):
                return {"shortest_edge": value}
            if isinstance(value, dict):
                return {k: v for k, v in value.items() if v is not None}
            return {k: getattr(value, k) for k in ("shortest_edge", "height", "width")
                    if getattr(value, k, None) is not None}

        size = as_dict(getattr(processor, "size", None)) if getattr(processor, "do_resize", True) \
            else {}
        crop = as_dict(getattr(processor, "crop_size", None)) \
            if getattr(processor, "do_center_crop", True) else {}
        normalise = getattr(processor, "do_normalize", True)
        resample = getattr(processor, "resample", 3)
        mode = _PIL_RESAMPLE_TO_MODE.get(int(getattr(resample, "value", resample)), "bicubic") \
            if not isinstance(resample, str) else resample.lower()
        return cls(
            shortest_edge=size.get("shortest_edge"),
            resize_hw=(size["height"], size["width"]) if "height" in size else None,
            crop_hw=(crop["height"], crop["width"]) if "height" in crop else None,
            mean=tuple(processor.image_mean) if normalise else (0.0, 0.0, 0.0),
            std=tuple(processor.image_std) if normalise else (1.0, 1.0, 1.0),
            interpolation=mode if mode in ("bicubic", "bilinear", "nearest") else "bicubic",
        )

    def __call__(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) float in [0, 1] -> (B, 3, h, w) normalised pixel values, float32."""
        return clip_preprocess(images, self)


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """(new_h, new_w) with the shorter side = ``shortest_edge`` and the longer side scaled and
    truncated (int), as CLIP's processors do."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(images: Tensor, crop_hw: tuple[int, int]) -> Tensor:
    """(B, C, H, W) -> (B, C, h, w), top-left at int((H - h) / 2), int((W - w) / 2); zero-pads
    first when the image is smaller than the crop."""
    crop_h, crop_w = crop_hw
    height, width = images.shape[-2:]
    if crop_h > height or crop_w > width:
        pad_w, pad_h = max(crop_w - width, 0), max(crop_h - height, 0)
        images = F.pad(images, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
        height, width = images.shape[-2:]
    top, left = int((height - crop_h) / 2.0), int((width - crop_w) / 2.0)
    return images[..., top:top + crop_h, left:left + crop_w]


def clip_preprocess(images: Tensor, preprocess: ClipPreprocess) -> Tensor:
    """(B, 3, H, W) float in [0, 1] -> (B, 3, h, w) float32: resize (antialiased; bicubic
    overshoot is kept, as the reference processor does on float input), center-crop,
    (x - mean) / std."""
    pixels = images.float()
    height, width = pixels.shape[-2:]
    target = preprocess.resize_hw
    if target is None and preprocess.shortest_edge is not None:
        target = shortest_edge_size(height, width, preprocess.shortest_edge)
    if target is not None and tuple(target) != (height, width):
        antialias = preprocess.interpolation in ("bicubic", "bilinear")
        pixels = F.interpolate(pixels, size=tuple(target), mode=preprocess.interpolation,
                               antialias=antialias,
                               align_corners=False if antialias else None)
    if preprocess.crop_hw is not None:
        pixels = center_crop(pixels, preprocess.crop_hw)
    mean = torch.tensor(preprocess.mean, device=pixels.device).view(1, 3, 1, 1)
    std = torch.tensor(preprocess.std, device=pixels.device).view(1, 3, 1, 1)
    return (pixels - mean) / std


# ---- score maths (pure) ----

def l2_normalise(embeds: Tensor, eps: float = 1e-12) -> Tensor:
    """(..., D) -> (..., D) with unit L2 norm along the last dim."""
    return embeds / embeds.norm(dim=-1, keepdim=True).clamp(min=eps)


def paired_cosine(image_embeds: Tensor, text_embeds: Tensor) -> Tensor:
    """Cosine similarity of row i of each: (B, D), (B, D) -> (B,) in [-1, 1]."""
    return (l2_normalise(image_embeds.float()) * l2_normalise(text_embeds.float())).sum(dim=-1)


def clip_score_from_cosine(cosine: Tensor, scale: float = 100.0, raw_cosine: bool = False) -> Tensor:
    """CLIPScore as commonly reported (torchmetrics, many papers): ``scale * max(cos, 0)`` with
    scale 100 (Hessel et al. use w = 2.5); ``raw_cosine`` returns ``cos`` unchanged. (B,) -> (B,)."""
    return cosine if raw_cosine else scale * cosine.clamp(min=0)


def consecutive_frame_cosine(frame_embeds: Tensor) -> Tensor:
    """Mean cosine similarity of consecutive frames: (B, F, D) -> (B,); 1.0 when F == 1."""
    if frame_embeds.shape[1] < 2:
        return torch.ones(frame_embeds.shape[0], dtype=torch.float32,
                          device=frame_embeds.device)
    unit = l2_normalise(frame_embeds.float())
    return (unit[:, 1:] * unit[:, :-1]).sum(dim=-1).mean(dim=1)


# ---- model loading ----

class ClipEncoder:
    """Image/text embeddings of a CLIP model, with its preprocessing and tokenizer.

    Backends: ``"transformers"`` (``CLIPModel.from_pretrained(model)``; processor config and
    tokenizer from ``processor`` or else ``model``) and ``"open_clip"`` (``model`` = architecture
    name such as "ViT-L-14", ``pretrained`` = a tag such as "openai" or a checkpoint file)."""

    def __init__(self, model: str, processor: str | None = None, *,
                 backend: str = "transformers", pretrained: str | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        self.dtype = dtype
        self.backend = backend
        if backend == "transformers":
            self._load_transformers(model, processor or model)
        elif backend == "open_clip":
            self._load_open_clip(model, pretrained)
        else:
            raise ValueError(f"backend must be 'transformers' or 'open_clip' (got {backend!r})")

    def _load_transformers(self, model: str, processor: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        from flowgrpo.hub import require_hub_file

        # Hub weights that cannot be had fail here with one message (id, cause, fix) instead of
        # a traceback from inside from_pretrained.
        for source, filename, option in ((model, "config.json", "model"),
                                         (processor, "preprocessor_config.json", "processor")):
            if not os.path.isdir(os.path.expanduser(source)):
                require_hub_file(source, filename, what="a transformers CLIP checkpoint",
                                 field=f"the reward option {option!r}")
        clip = CLIPModel.from_pretrained(model)
        self.model = clip.eval().requires_grad_(False).to(device=self.device, dtype=self.dtype)
        self.preprocess = ClipPreprocess.from_image_processor(
            AutoImageProcessor.from_pretrained(processor))
        self.tokenizer = AutoTokenizer.from_pretrained(processor)
        self.max_length = min(int(clip.config.text_config.max_position_embeddings),
                              int(getattr(self.tokenizer, "model_max_length", 77) or 77))
        self.embed_dim = int(clip.config.projection_dim)

    def _load_open_clip(self, model: str, pretrained: str | None) -> None:
        try:
            import open_clip
        except ImportError as error:
            raise ImportError("backend='open_clip' needs the open_clip package: "
                              "pip install open_clip_torch") from error
        clip = open_clip.create_model(model, pretrained=pretrained, device="cpu")
        self.model = clip.eval().requires_grad_(False).to(device=self.device, dtype=self.dtype)
        visual = clip.visual
        size = visual.image_size if isinstance(visual.image_size, (tuple, list)) \
            else (visual.image_size, visual.image_size)
        config = getattr(visual, "preprocess_cfg", {}) or {}
        self.preprocess = ClipPreprocess(
            shortest_edge=int(min(size)), crop_hw=(int(size[0]), int(size[1])),
            mean=tuple(config.get("mean", OPENAI_CLIP_MEAN)),
            std=tuple(config.get("std", OPENAI_CLIP_STD)),
            interpolation=config.get("interpolation", "bicubic"))
        self.tokenizer = open_clip.get_tokenizer(model)
        self.max_length = int(getattr(self.tokenizer, "context_length", 77))
        self.embed_dim = int(clip.text_projection.shape[-1]) \
            if getattr(clip, "text_projection", None) is not None else None

    @property
    def logit_scale(self) -> float:
        """exp(learned logit scale) (100 for the OpenAI and PickScore checkpoints)."""
        return float(self.model.logit_scale.detach().float().exp())

    @torch.no_grad()
    def image_embeds(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) float in [0, 1] -> (B, D) float32 projected, not normalised."""
        pixels = self.preprocess(images.to(self.device)).to(self.dtype)
        if self.backend == "open_clip":
            return self.model.encode_image(pixels).float()
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        return self.model.visual_projection(pooled).float()

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> Tensor:
        """B prompts -> (B, D) float32 projected, not normalised (truncated to the context)."""
        if self.backend == "open_clip":
            tokens = self.tokenizer(list(prompts)).to(self.device)
            return self.model.encode_text(tokens).float()
        tokens = self.tokenizer(list(prompts), padding=True, truncation=True,
                                max_length=self.max_length, return_tensors="pt").to(self.device)
        pooled = self.model.text_model(input_ids=tokens["input_ids"],
                                       attention_mask=tokens["attention_mask"]).pooler_output
        return self.model.text_projection(pooled).float()
