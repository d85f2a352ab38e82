"""FLUX.1 Kontext (``black-forest-labs/FLUX.1-Kontext-dev``) as an editing FlowModel.

Everything of FLUX.1 (``pipelines/flux.py``: text encoders, packing, dynamic shift on the
*output's* token count, timestep = sigma, guidance embedding) plus the source image, as
``FluxKontextPipeline`` does it:

- the source image (3, h, w) in [0, 1] is resized (bilinear, antialiased) to the output size
  (options height/width) when it differs, mapped to [-1, 1], VAE-encoded (the posterior's mode),
  normalised ``(z - shift_factor) * scaling_factor`` and packed: ``image_latents``
  (B, H/16 * W/16, 4C), one row per prompt in the Conditioning;
- its position ids are the output's with the first coordinate 1 instead of 0;
- each transformer call sees [output tokens; source tokens] and ids [output ids; source ids], and
  the velocity is the prediction of the output tokens only.

Differences from the stock pipeline, on purpose: the pipeline resizes the source image to a
"preferred Kontext resolution" and the output to about 1024^2 pixels of the source's aspect
(``_auto_resize``, ``max_area``); here both are the configured height x width, so every row of a
batch has the same token count (the parity tests call the pipeline with ``_auto_resize=False``
and ``max_area=height*width``). True CFG with a negative prompt (``true_cfg_scale``) is not
supported: Kontext-dev is guidance-distilled and Flow-GRPO trains it with the embedding.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flowgrpo.model import Conditioning
from pipelines.flux import FluxModel, latent_image_ids


class FluxKontextModel(FluxModel):
    """FLUX.1 Kontext adapter (``load_model("flux_kontext", path, options=...)``: FLUX's options)."""

    family = "flux_kontext"
    pipeline_class_path = "diffusers:FluxKontextPipeline"
    supports_images = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        ids = latent_image_ids(self.latent_height, self.latent_width)
        ids[:, 0] = 1.0     # the source image's tokens: same grid, first id coordinate 1
        self.source_image_ids = ids.to(self.device)

    def encode_prompts(self, prompts: list[str], images: list[Tensor] | None = None) -> Conditioning:
        """FLUX's prompt embeddings plus ``image_latents`` (B, tokens, 4C): one source image per
        prompt is required (Kontext edits; for text-to-image use the flux family)."""
        if images is None or len(images) != len(prompts) or any(i is None for i in images):
            raise ValueError("flux_kontext edits images: give one source image per prompt "
                             "(prompt records with an \"image\"; JSONL {\"prompt\", \"image\"})")
        cond = super().encode_prompts(prompts)
        cond.positive["image_latents"] = self.encode_images(list(images))
        return cond

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, tokens, 4C) float32 of the output tokens, the transformer seeing the output
        tokens followed by the source image's (``cond.positive["image_latents"]``)."""
        if "image_latents" not in cond.positive:
            raise ValueError("flux_kontext needs the source image: encode the prompts with "
                             "encode_prompts(prompts, images=...)")
        return super().velocity(latents, sigma, cond, guidance_scale)

    def image_tokens(self, latents: Tensor, cond: Conditioning) -> tuple[Tensor, Tensor]:
        """The output tokens followed by the source image's, with the source's ids (first
        coordinate 1) after the output's."""
        hidden = torch.cat([latents, cond.positive["image_latents"].to(self.device, self.dtype)], dim=1)
        ids = torch.cat([self.image_ids.to(self.device), self.source_image_ids.to(self.device)])
        return hidden, ids
