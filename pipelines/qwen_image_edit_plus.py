"""Qwen-Image-Edit-Plus (``Qwen/Qwen-Image-Edit-2509``, ``Qwen/Qwen-Image-Edit-2511``) as an
editing FlowModel with one to three source images per prompt.

Qwen-Image-Edit (``pipelines/qwen_image_edit.py``: the output tokens followed by the sources'
tokens, true CFG with the per-token norm rescale, decode) with ``QwenImageEditPlusPipeline``'s
handling of several images, checked against it:

- each source image is resized on its own, at its own aspect ratio, twice: to about 384^2 pixels
  for the text encoder (the pipeline's ``CONDITION_IMAGE_SIZE``; sides multiples of 32 by its
  ``calculate_dimensions``; ``image_processor.resize``, PIL) and to about ``options.source_area``
  pixels for the VAE (the pipeline's ``VAE_IMAGE_SIZE``, 1024^2, the default;
  ``image_processor.preprocess`` of the original image);
- the text: Qwen2.5-VL reads "Picture 1: <vision tokens> Picture 2: ..." and the instruction in
  the edit template (the pipeline's ``encode_prompt`` with the list of 384^2 images), per
  (prompt, images) row, for the CFG negative too (same images);
- the VAE latents of each image (mode, ``(z - mean) / std``), packed 2x2, are concatenated along
  the tokens: ``image_latents`` (B, tokens', 64); the transformer sees [output tokens; source
  tokens] with ``img_shapes`` [(1, H/16, W/16), (1, h_1/16, w_1/16), (1, h_2/16, w_2/16), ...]
  and returns the output tokens' velocity;
- Qwen-Image-Edit-2511 is the same pipeline with the transformer config's ``zero_cond_t`` (the
  source tokens are modulated at timestep 0): the transformer does it, nothing here differs.

Not reproduced, refused or fixed instead: the stock pipeline sizes its *output* from the last
source image (about 1024^2 at its aspect ratio) when no height/width is given; here the output
is ``options.height`` x ``options.width`` for every prompt (one latent shape per run), as the
pipeline with ``height=``/``width=``. The pipeline takes one prompt per call; here rows batch:
rows whose sources have the same layout (count and resized sizes) run in one transformer call,
rows of different layouts in one call each (the velocity groups them), so a prompt set of mixed
aspect ratios trains as it is. Source images reach the pipeline as 8-bit PIL images.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flowgrpo.model import Conditioning, check_source_images, source_images_of
from pipelines.flux import pack_latents
from pipelines.qwen_image import QwenImageOptions, stacked_text
from pipelines.qwen_image_edit import QwenImageEditModel

# QwenImageEditPlusPipeline's VAE_IMAGE_SIZE: the VAE sees each source at about this many pixels.
STOCK_SOURCE_AREA = 1024 * 1024
# Qwen-Image-Edit-2509's model card: "the optimal performance is currently achieved with 1 to 3
# input images"; the pipeline itself sets no limit.
MAX_SOURCE_IMAGES = 3
# calculate_dimensions rounds each side to a multiple of this.
_SIDE_MULTIPLE = 32


@dataclass
class QwenImageEditPlusOptions(QwenImageOptions):
    """Qwen-Image's options plus the VAE size of the source images."""

    source_area: int = field(default=STOCK_SOURCE_AREA, metadata={"help": (
        "Pixels of each source image as the VAE encodes it (about this many, at the image's "
        "aspect ratio, sides multiples of 32): 1024^2 as QwenImageEditPlusPipeline (its "
        "VAE_IMAGE_SIZE); Flow-Factory trains at 384^2 (condition_image_size). The text "
        "encoder always sees each image at about 384^2, as the pipeline.")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.source_area < _SIDE_MULTIPLE ** 2:
            raise ValueError(f"options.source_area must be at least {_SIDE_MULTIPLE ** 2} pixels "
                             f"(got {self.source_area}); 1048576 (1024^2) is the pipeline's")


class QwenImageEditPlusModel(QwenImageEditModel):
    """Qwen-Image-Edit-2509/2511 adapter (``load_model("qwen_image_edit_plus", path,
    options=...)``: Qwen-Image's options and ``source_area``). A prompt gives one source image
    (a (3, H, W) tensor) or several (a ``flowgrpo.model.SourceImages``: JSONL ``"images"``)."""

    family = "qwen_image_edit_plus"
    options_class = QwenImageEditPlusOptions
    pipeline_class_path = "diffusers:QwenImageEditPlusPipeline"
    max_source_images = MAX_SOURCE_IMAGES
    supported_transformer_flags = ("zero_cond_t",)     # Qwen-Image-Edit-2511
    wrong_folder_hint = ("this adapter is Qwen-Image-Edit-Plus (QwenImageEditPlusPipeline: "
                         "Qwen/Qwen-Image-Edit-2509 or -2511); use qwen_image_edit for "
                         "Qwen/Qwen-Image-Edit and qwen_image for text-to-image")

    # ---------------------------------------------------------------------------- prompts
    def encode_prompts(self, prompts: list[str], images: list[Tensor] | None = None) -> Conditioning:
        """positive/negative: {"prompt_embeds": (B, L, D), "prompt_embeds_mask": (B, L),
        "image_latents": (B, T, 64) (each row's sources' tokens, zero-padded to the longest row's
        T), "source_shapes": (B, K, 3) int64 (each row's sources' RoPE shapes (1, h/16, w/16),
        rows with fewer than K images padded with zeros)}. One entry of ``images`` per prompt:
        a (3, H, W) float in [0, 1] or a ``SourceImages`` of up to ``max_source_images``."""
        from flowgrpo.pixels import to_uint8
        from PIL import Image

        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of str (wrap a single prompt in a list)")
        if images is None or len(images) != len(prompts) or any(i is None for i in images):
            raise ValueError("qwen_image_edit_plus edits images: give one or more source images "
                             "per prompt (prompt records with an \"image\" or \"images\"; JSONL "
                             "{\"prompt\", \"images\": [...]})")
        check_source_images(self, images)
        pipe = self.to_pipeline()
        rows = [[Image.fromarray(to_uint8(image)) for image in source_images_of(entry)]
                for entry in images]
        positive, negative = [], []
        with torch.no_grad(), self.text_encoders_on_device():
            for prompt, pictures in zip(prompts, rows):
                seen = [pipe.image_processor.resize(picture, *condition_size(picture))
                        for picture in pictures]
                positive.append(self._text_row(pipe, prompt, seen))
                if self.negative_prompt() is not None:
                    negative.append(self._text_row(pipe, self.negative_prompt(), seen))
        latents, shapes = [], []
        with torch.no_grad(), self.vae_on_device():
            for pictures in rows:
                tokens, layout = [], []
                for picture in pictures:
                    height, width = source_size(picture, self.options.source_area)
                    pixels = pipe.image_processor.preprocess(picture, height, width).unsqueeze(2)
                    z = pipe._encode_vae_image(pixels.to(self.device, self.vae.dtype), generator=None)
                    tokens.append(pack_latents(z[:, :, 0].float()))
                    scale = self.vae_scale_factor * 2
                    layout.append((1, height // scale, width // scale))
                latents.append(torch.cat(tokens, dim=1)[0])
                shapes.append(torch.tensor(layout, dtype=torch.long))
        image_latents = torch.nn.utils.rnn.pad_sequence(latents, batch_first=True).to(self.dtype)
        source_shapes = torch.nn.utils.rnn.pad_sequence(shapes, batch_first=True).to(self.device)
        texts = stacked_text([positive] + ([negative] if negative else []))
        sources = {"image_latents": image_latents, "source_shapes": source_shapes}
        return Conditioning(positive={**texts[0], **sources},
                            negative={**texts[1], **sources} if negative else None)

    # ---------------------------------------------------------------------------- FlowModel
    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, tokens, 64) float32 of the output tokens, the transformer seeing them
        followed by each row's source tokens (``_velocity_with_sources``). Rows are grouped by
        source layout (``source_layouts``); each group is one call (one batched forward over
        both CFG branches), its rows' source tokens cut to the group's count."""
        if "image_latents" not in cond.positive or "source_shapes" not in cond.positive:
            raise ValueError("qwen_image_edit_plus needs the source images: encode the prompts "
                             "with encode_prompts(prompts, images=...)")
        batch = latents.shape[0]
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        groups: dict[tuple, list[int]] = {}
        for row, layout in enumerate(source_layouts(cond.positive["source_shapes"])):
            groups.setdefault(layout, []).append(row)
        if len(groups) == 1:
            (layout, _), = groups.items()
            return self._velocity_with_sources(latents, sigma, _cut_sources(cond, layout),
                                               guidance_scale, [self.img_shapes[0], *layout])
        out = None
        for layout, rows in groups.items():
            index = torch.tensor(rows, device=latents.device)
            part = self._velocity_with_sources(
                latents.index_select(0, index), sigma.index_select(0, index.to(sigma.device)),
                _cut_sources(cond.select(rows), layout), guidance_scale,
                [self.img_shapes[0], *layout])
            if out is None:
                out = part.new_empty((batch, *part.shape[1:]))
            out = out.index_copy(0, index.to(part.device), part)
        return out


def source_layouts(source_shapes: Tensor) -> list[tuple[tuple[int, int, int], ...]]:
    """Each row's sources' RoPE shapes from ``source_shapes`` (B, K, 3) (zero rows = no image):
    a tuple of (1, h/16, w/16) per row."""
    return [tuple(tuple(shape) for shape in row if shape[0] > 0)
            for row in source_shapes.tolist()]


def _cut_sources(cond: Conditioning, layout: tuple[tuple[int, int, int], ...]) -> Conditioning:
    """``cond`` with ``image_latents`` (B, T, 64) cut to the tokens of ``layout`` (sum of
    f h w), dropping the padding of rows with more source tokens."""
    tokens = sum(f * h * w for f, h, w in layout)
    positive = {**cond.positive, "image_latents": cond.positive["image_latents"][:, :tokens]}
    return Conditioning(positive=positive, negative=cond.negative, extra=dict(cond.extra))


def _dimensions(area: int, picture) -> tuple[int, int]:
    """(height, width) of ``picture`` (PIL) resized to about ``area`` pixels at its aspect ratio,
    sides multiples of 32: the pipeline's own ``calculate_dimensions``."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    width, height = calculate_dimensions(area, picture.size[0] / picture.size[1])
    if width < _SIDE_MULTIPLE or height < _SIDE_MULTIPLE:
        raise ValueError(f"qwen_image_edit_plus: a {picture.size[0]}x{picture.size[1]} source "
                         f"image resized to about {area} pixels has a side under "
                         f"{_SIDE_MULTIPLE} ({width}x{height}); crop it nearer to square or "
                         f"raise options.source_area")
    return height, width


def condition_size(picture) -> tuple[int, int]:
    """(height, width) the text encoder sees ``picture`` at: the pipeline's CONDITION_IMAGE_SIZE
    (384^2), read from the installed pipeline module."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as stock

    return _dimensions(stock.CONDITION_IMAGE_SIZE, picture)


def source_size(picture, area: int) -> tuple[int, int]:
    """(height, width) the VAE sees ``picture`` at (``options.source_area``)."""
    return _dimensions(area, picture)
