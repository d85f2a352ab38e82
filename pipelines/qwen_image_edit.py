"""Qwen-Image-Edit (``Qwen/Qwen-Image-Edit``) as an editing FlowModel.

Qwen-Image (``pipelines/qwen_image.py``: packing, schedule, true CFG with the per-token norm
rescale, decode) plus the source image, as ``QwenImageEditPipeline`` does it:

- the source image is resized (the pipeline's own ``image_processor.resize``, PIL) to about
  1024^2 pixels at its aspect ratio, sides multiples of 32 (``calculate_dimensions``), whatever the
  output size;
- the text: Qwen2.5-VL reads the instruction *and that image* (the processor's vision tokens in
  the edit template); computed per (prompt, image) row by the pipeline's ``encode_prompt``, for the
  CFG negative too (same image), so nothing is cached per prompt string;
- the image is also VAE-encoded (mode, ``(z - mean) / std``) and packed: ``image_latents``
  (B, tokens', 64); every transformer call sees [output tokens; source tokens] with
  ``img_shapes`` [(1, H/16, W/16), (1, h'/16, w'/16)] and returns the output tokens' velocity.

All rows of one ``encode_prompts`` call must have source images of one aspect ratio (their
source token counts must match to batch); a JSONL of mixed aspect ratios is refused with the
rows named. Source images reach the pipeline as 8-bit PIL images (what users hand it).
"""
from __future__ import annotations

import torch
from torch import Tensor

from flowgrpo.model import Conditioning, check_source_images, guidance_branches
from pipelines.flux import pack_latents
from pipelines.qwen_image import QwenImageModel, _text_length, stacked_text, true_cfg

# QwenImageEditPipeline resizes every source image to about this many pixels.
SOURCE_AREA = 1024 * 1024


class QwenImageEditModel(QwenImageModel):
    """Qwen-Image-Edit adapter (``load_model("qwen_image_edit", path, options=...)``: Qwen-Image's
    options)."""

    family = "qwen_image_edit"
    pipeline_class_path = "diffusers:QwenImageEditPipeline"
    supports_images = True

    # Loading is Qwen-Image's (``QwenImageModel.from_pretrained``) plus the processor.
    extra_folders = {"processor": "tokenizer_config.json"}
    wrong_folder_hint = ("this adapter is Qwen-Image-Edit (QwenImageEditPipeline, e.g. "
                         "Qwen/Qwen-Image-Edit); use qwen_image for text-to-image")

    @classmethod
    def _extra_components(cls, path_or_hub_id: str) -> dict:
        from transformers import Qwen2VLProcessor

        return {"processor": Qwen2VLProcessor.from_pretrained(path_or_hub_id,
                                                               subfolder="processor")}

    # ---------------------------------------------------------------------------- prompts
    def encode_prompts(self, prompts: list[str], images: list[Tensor] | None = None) -> Conditioning:
        """positive/negative: {"prompt_embeds": (B, L, D), "prompt_embeds_mask": (B, L),
        "image_latents": (B, tokens', 64)}; extra["source_shape"]: (3,) the source's RoPE shape
        (1, h'/16, w'/16). One source image (3, h, w) in [0, 1] per prompt is required."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
        from PIL import Image

        from flowgrpo.pixels import to_uint8

        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of str (wrap a single prompt in a list)")
        if images is None or len(images) != len(prompts) or any(i is None for i in images):
            raise ValueError("qwen_image_edit edits images: give one source image per prompt "
                             "(prompt records with an \"image\"; JSONL {\"prompt\", \"image\"})")
        check_source_images(self, images)     # one image: a prompt with several is refused
        pipe = self.to_pipeline()
        sizes = [calculate_dimensions(SOURCE_AREA, image.shape[-1] / image.shape[-2])[:2]
                 for image in images]
        if len(set(sizes)) > 1:
            raise ValueError(f"qwen_image_edit: the source images of one batch must share an "
                             f"aspect ratio (resized sizes {sorted(set(sizes))}); crop or pad the "
                             f"prompt file's images to one aspect ratio")
        width, height = sizes[0]
        positive, negative, sources = [], [], []
        with torch.no_grad(), self.text_encoders_on_device():
            for prompt, image in zip(prompts, images):
                pil = Image.fromarray(to_uint8(image))
                resized = pipe.image_processor.resize(pil, height, width)
                positive.append(self._text_row(pipe, prompt, resized))
                if self.negative_prompt() is not None:
                    negative.append(self._text_row(pipe, self.negative_prompt(), resized))
                sources.append(pipe.image_processor.preprocess(resized, height, width))
        pixels = torch.cat(sources).unsqueeze(2).to(self.device)      # (B, 3, 1, h', w')
        with torch.no_grad(), self.vae_on_device():
            z = pipe._encode_vae_image(pixels.to(self.vae.dtype), generator=None)
        image_latents = pack_latents(z[:, :, 0].float()).to(self.dtype)
        texts = stacked_text([positive] + ([negative] if negative else []))
        cond_positive = {**texts[0], "image_latents": image_latents}
        cond_negative = {**texts[1], "image_latents": image_latents} if negative else None
        scale = self.vae_scale_factor * 2
        shape = torch.tensor([1, height // scale, width // scale])
        return Conditioning(positive=cond_positive, negative=cond_negative,
                            extra={"source_shape": shape})

    def _text_row(self, pipe, prompt: str, image) -> dict[str, Tensor]:
        embeds, mask = pipe.encode_prompt(prompt=[prompt], image=image, device=self.device)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds.to(self.device), "prompt_embeds_mask": mask.long().to(self.device)}

    # ---------------------------------------------------------------------------- FlowModel
    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, tokens, 64) float32 of the output tokens, the transformer seeing them
        followed by the source's; true CFG as Qwen-Image (both branches see the source)."""
        if "image_latents" not in cond.positive or "source_shape" not in cond.extra:
            raise ValueError("qwen_image_edit needs the source image: encode the prompts with "
                             "encode_prompts(prompts, images=...)")
        shapes = [self.img_shapes[0], tuple(int(v) for v in cond.extra["source_shape"])]
        return self._velocity_with_sources(latents, sigma, cond, guidance_scale, shapes)

    def _velocity_with_sources(self, latents: Tensor, sigma: Tensor, cond: Conditioning,
                               guidance_scale: float, shapes: list[tuple[int, int, int]]) -> Tensor:
        """Velocity (B, tokens, 64) float32 of the output tokens (latents (B, tokens, 64)), the
        transformer seeing [output tokens; ``cond.positive["image_latents"]`` (B, tokens', 64)]
        with RoPE layout ``shapes`` (the output's (1, H/16, W/16), then each source's; tokens' =
        the sources' products); true CFG as Qwen-Image. Shared by Qwen-Image-Edit-Plus."""
        batch, tokens = latents.shape[:2]
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        use_cfg = self._use_cfg(cond, guidance_scale)
        source = cond.positive["image_latents"].to(self.device, self.dtype)
        hidden = torch.cat([latents.to(self.device, self.dtype), source], dim=1)
        positive = {k: cond.positive[k] for k in ("prompt_embeds", "prompt_embeds_mask")}

        def forward(hidden: Tensor, sigma: Tensor, text: dict[str, Tensor]) -> Tensor:
            length = _text_length(text["prompt_embeds_mask"])
            embeds = text["prompt_embeds"][:, :length].to(self.device, self.dtype)
            mask = text["prompt_embeds_mask"][:, :length].to(self.device)
            mask = None if bool(mask.all()) else mask      # as the pipeline: no all-ones mask
            return self.transformer(hidden_states=hidden, timestep=sigma.to(hidden.dtype),
                                    encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                                    img_shapes=[shapes] * hidden.shape[0],
                                    return_dict=False)[0][:, :tokens].float()

        if not use_cfg:
            return forward(hidden, sigma, positive)
        v_neg, v_pos = guidance_branches(forward, hidden, sigma, positive, cond.negative)
        return true_cfg(v_neg, v_pos, guidance_scale)
