"""Wan image-to-video (``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers``,
``Wan-AI/Wan2.2-I2V-A14B-Diffusers``) as a FlowModel that takes a source image per prompt.

Everything of Wan text-to-video (``pipelines/wan.py``: UMT5 text, video latents, Euler schedule
at the checkpoint's flow shift, timestep = 1000 sigma, real CFG, decode; ``pipelines/wan22.py``:
Wan2.2's two experts) plus the first frame, as ``WanImageToVideoPipeline`` conditions on it:

- the source image (3, h, w) in [0, 1] reaches the pipeline's own preprocessing as an 8-bit PIL
  image (what users hand it): ``video_processor.preprocess`` resizes it to the output size and
  maps it to [-1, 1];
- condition latents: the video [image; F - 1 zero frames (mid-grey in [-1, 1])] VAE-encoded
  (the posterior's mode), normalised (z - mean) / std per channel: (16, F', h, w); in front of
  them a 4-channel mask that is 1 on the first latent frame (its 4 channels are the first pixel
  frame repeated 4 times, the causal VAE's temporal factor) and 0 after it: ``image_condition``
  (B, 20, F', h, w), built by the pipeline's ``prepare_latents``;
- each transformer call sees the channel concatenation [latents; image_condition] (16 + 20 = 36
  input channels) and returns the 16-channel velocity; both CFG branches see the same condition;
- Wan2.1 I2V also has a CLIP vision encoder: ``image_embeds`` (B, 257, 1280), the penultimate
  hidden states of ``image_encoder`` on ``image_processor``'s crop, which the transformer projects
  and prepends to the text in every cross-attention. Wan2.2-I2V-A14B has no image encoder
  (model_index.json lists ``image_encoder`` as null) and two experts switched at
  ``boundary_ratio`` (0.9), handled as for text-to-video (``WanExperts``).

Wan2.2-TI2V-5B (``Wan-AI/Wan2.2-TI2V-5B-Diffusers``, ``expand_timesteps`` in model_index.json;
one transformer, no image encoder, the Wan2.2 VAE: 48 latent channels, 16x spatial compression)
conditions differently, as the pipeline does with ``expand_timesteps``:

- ``image_condition`` (B, C, 1, h, w): the normalised VAE latents of the image alone;
- each transformer call sees the latents with their first latent frame replaced by the
  condition (C input channels, no concatenation), and a timestep per token: 0 on the first
  frame's tokens, t = 1000 sigma on the others ((B, tokens), ``token_timesteps``);
- the pipeline steps every latent frame with the prediction and replaces the first frame by the
  condition at the end; here the velocity of the first frame is (x - condition) / sigma, the
  straight path to the condition, so that the solver itself ends there (exactly at an Euler /
  ODE step to sigma 0) and ``decode`` needs no condition. The other frames' velocity is the
  transformer's. That frame's velocity does not depend on the weights: it adds nothing to a
  log-prob ratio. Under a stochastic last step the frame ends at the condition plus that step's
  noise (a deterministic last step ends it exactly).

The stock pipeline takes one image for the whole batch; here each row has its own (a group's
rows share one). Prompt embeddings are cached per prompt string; the image tensors are computed
per ``encode_prompts`` call (the rollout encodes each distinct (prompt, image) row once).
Not supported: FLF2V (``last_image``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flowgrpo.model import Conditioning, guided_velocity
from pipelines.options import (parse_options, require_attention_backend, resolve_dtype,
                               text_model_dtype)
from pipelines.sources import check_pipeline_folder
from pipelines.wan import WanModel, WanOptions, _check_sizes, load_scheduler, read_pipeline_index, video_size
from pipelines.wan22 import WanExperts, check_wan22_options, component_present

PIPELINE_CLASS_NAME = "WanImageToVideoPipeline"
# Wan2.2-TI2V-5B's folder names the text-to-video class (it samples both ways); with
# expand_timesteps, WanImageToVideoPipeline loads it for image-to-video.
TI2V_CLASS_NAMES = (PIPELINE_CLASS_NAME, "WanPipeline")
# Mask channels in front of the condition latents: one per pixel frame of a latent frame.
MASK_CHANNELS_PER_LATENT_FRAME = 4


@dataclass
class WanI2VOptions(WanOptions):
    """Wan I2V options (``load_model("wan_i2v", path, options={...})``): Wan text-to-video's
    (``WanOptions``). The source image is resized to ``height`` x ``width``; the stock pipeline's
    default size (480 x 832, 81 frames) applies where they are None."""


class I2VVariant(NamedTuple):
    """What a folder's model_index.json says about its Wan I2V variant."""

    two_experts: bool          # Wan2.2-I2V-A14B: transformer (high noise) + transformer_2
    image_encoder: bool        # Wan2.1 I2V: a CLIP vision encoder and its processor
    expand_timesteps: bool     # Wan2.2-TI2V-5B: first-frame tokens at timestep 0


def check_i2v_index(index: dict, path_or_hub_id: str) -> I2VVariant:
    """The variant of a Wan image-to-video folder from its model_index.json: Wan2.1 I2V (one
    transformer, a CLIP image encoder), Wan2.2-I2V-A14B (two experts at ``boundary_ratio``, no
    image encoder) or Wan2.2-TI2V-5B (``expand_timesteps``, one transformer). Other layouts are an
    error naming the fix."""
    name = index.get("_class_name", PIPELINE_CLASS_NAME)
    expand = bool(index.get("expand_timesteps"))
    if name not in (TI2V_CLASS_NAMES if expand else (PIPELINE_CLASS_NAME,)):
        raise ValueError(f"wan_i2v: {path_or_hub_id!r} is a {name} folder; this adapter is "
                         f"image-to-video ({PIPELINE_CLASS_NAME}: Wan2.1 I2V, Wan2.2-I2V-A14B or "
                         "Wan2.2-TI2V-5B); use the wan family for WanPipeline text-to-video")
    has_high, has_low = component_present(index, "transformer"), component_present(index, "transformer_2")
    has_image_encoder = component_present(index, "image_encoder")
    if has_image_encoder and not component_present(index, "image_processor"):
        raise ValueError(f"wan_i2v: {path_or_hub_id!r} has an image_encoder but no image_processor "
                         "in model_index.json; the CLIP image embeddings need both")
    if expand and (has_image_encoder or index.get("boundary_ratio") is not None):
        raise ValueError(f"wan_i2v: {path_or_hub_id!r} sets expand_timesteps (Wan2.2-TI2V-5B) with "
                         f"{'an image_encoder' if has_image_encoder else 'a boundary_ratio'}; TI2V-5B "
                         "has one transformer and no image encoder")
    if index.get("boundary_ratio") is None:
        if has_low:
            raise ValueError(f"wan_i2v: {path_or_hub_id!r} has a transformer_2 but no boundary_ratio "
                             "in model_index.json, so the pipeline would never run it; set boundary_ratio")
        if not has_high:
            raise ValueError(f"wan_i2v: {path_or_hub_id!r} has no transformer")
        return I2VVariant(False, has_image_encoder, expand)
    if not (has_high and has_low):
        raise ValueError(f"wan_i2v: {path_or_hub_id!r} sets boundary_ratio but lacks "
                         f"{'transformer_2' if has_high else 'transformer'}; Wan2.2 needs both experts "
                         "(transformer = high noise, transformer_2 = low noise)")
    return I2VVariant(True, has_image_encoder, False)


def check_i2v_transformer(in_channels: int, image_dim: int | None, latent_channels: int,
                          has_image_encoder: bool, expand_timesteps: bool = False) -> None:
    """An I2V transformer takes the latents, the 4 mask channels and the condition latents
    (2 x latent_channels + 4 inputs; TI2V-5B: the latents alone, latent_channels) and, exactly
    when the folder has a CLIP image encoder, its embeddings (``image_dim``)."""
    expected = latent_channels if expand_timesteps else 2 * latent_channels + MASK_CHANNELS_PER_LATENT_FRAME
    if in_channels != expected:
        layout = (f"the latents {latent_channels}, first frame replaced by the condition"
                  if expand_timesteps else f"latents {latent_channels} + mask "
                  f"{MASK_CHANNELS_PER_LATENT_FRAME} + condition {latent_channels}")
        raise ValueError(f"wan_i2v: the transformer takes {in_channels} input channels, an I2V "
                         f"transformer takes {expected} ({layout}); is this a text-to-video "
                         "checkpoint? Use the wan family")
    if (image_dim is not None) != has_image_encoder:
        raise ValueError(f"wan_i2v: the transformer's image_dim is {image_dim} but the folder "
                         f"{'lacks' if image_dim is not None else 'has'} an image_encoder; "
                         "Wan2.1 I2V needs its CLIP image encoder, Wan2.2 has none")


def first_frame_mask(latent_shape: tuple[int, int, int, int]) -> Tensor:
    """(1, 1, F', h, w) float32: 0 on the first latent frame, 1 on the others (TI2V-5B's
    ``first_frame_mask``) for latents of shape (C, F', h, w)."""
    _, frames, height, width = latent_shape
    mask = torch.ones(1, 1, frames, height, width)
    mask[:, :, 0] = 0.0
    return mask


def token_timesteps(mask: Tensor, timestep: Tensor, patch_size: tuple[int, int, int]) -> Tensor:
    """(B, tokens) per-token timesteps: ``timestep`` (B,) times the mask (1, 1, F', h, w) sampled
    at each patch's first latent (stride ``patch_size`` = (p_t, p_h, p_w)), flattened in the
    transformer's token order (frame, row, column): 0 on the first frame's tokens."""
    p_t, p_h, p_w = patch_size
    per_token = mask[0, 0, ::p_t, ::p_h, ::p_w].reshape(1, -1).to(timestep)
    return per_token * timestep.reshape(-1, 1)


class WanI2VModel(WanModel):
    """Wan2.1 / Wan2.2-A14B image-to-video adapter. Build with
    ``WanI2VModel.from_pretrained(path_or_hub_id, ...)``; ``encode_prompts(prompts, images=...)``
    takes one source image (3, H, W) in [0, 1] per prompt."""

    family = "wan_i2v"
    options_class = WanI2VOptions
    pipeline_class_path = f"diffusers:{PIPELINE_CLASS_NAME}"
    supports_images = True

    def __init__(self, transformer: torch.nn.Module, components: dict, options: WanI2VOptions,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 expand_timesteps: bool = False) -> None:
        components = {"image_encoder": None, "image_processor": None, **components}
        self.expand_timesteps = bool(expand_timesteps)
        super().__init__(transformer, components, options, device=device, dtype=dtype)
        config = self.denoisers()[0].config
        check_i2v_transformer(config.in_channels, config.image_dim, self.vae.config.z_dim,
                              self.image_encoder is not None, self.expand_timesteps)
        self.patch_size = tuple(config.patch_size)

    def _configure(self) -> None:
        """WanModel's placement plus the CLIP image encoder: frozen, on the device (on the CPU
        with options.offload_text_encoders, moved while encoding)."""
        super()._configure()
        encoder = self.components.get("image_encoder")
        if encoder is not None:
            encoder.eval().requires_grad_(False)
            encoder.to("cpu" if self.options.offload_text_encoders else self.device)

    @property
    def image_encoder(self) -> torch.nn.Module | None:
        return self.components.get("image_encoder")

    # ---------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu",
                        options: WanI2VOptions | dict | None = None) -> "WanI2VModel":
        """Load the components of a Wan image-to-video folder (Wan2.1 I2V: one transformer and a
        CLIP image encoder; Wan2.2-I2V-A14B: two experts in a ``WanExperts``; Wan2.2-TI2V-5B: one
        transformer, ``expand_timesteps``). Options, folder contents, variant, video size and
        frame count are validated before any weights load."""
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

        options = parse_options(WanI2VOptions, options, cls.family)
        require_attention_backend(options.attention_backend)
        index = read_pipeline_index(path_or_hub_id)
        two_experts, has_image_encoder, expand_timesteps = check_i2v_index(index, path_or_hub_id)
        required = {"transformer": "config.json", "vae": "config.json",
                    "scheduler": "scheduler_config.json", "text_encoder": "config.json",
                    "tokenizer": "tokenizer_config.json"}
        if two_experts:
            required["transformer_2"] = "config.json"
        if has_image_encoder:
            required.update({"image_encoder": "config.json",
                             "image_processor": "preprocessor_config.json"})
        check_pipeline_folder(path_or_hub_id, required, cls.family)
        check_wan22_options(options, two_experts)
        transformer_config = WanTransformer3DModel.load_config(path_or_hub_id, subfolder="transformer")
        vae_config = AutoencoderKLWan.load_config(path_or_hub_id, subfolder="vae")
        _check_sizes(*video_size(options), vae_config.get("scale_factor_spatial", 8),
                     vae_config.get("scale_factor_temporal", 4), tuple(transformer_config["patch_size"]))
        check_i2v_transformer(transformer_config["in_channels"], transformer_config.get("image_dim"),
                              vae_config.get("z_dim", 16), has_image_encoder, expand_timesteps)

        text_dtype = text_model_dtype(resolve_dtype(options.text_encoder_dtype, dtype))
        components: dict[str, Any] = {
            "scheduler": load_scheduler(path_or_hub_id),
            "vae": AutoencoderKLWan.from_pretrained(path_or_hub_id, subfolder="vae",
                                                    torch_dtype=resolve_dtype(options.vae_dtype, dtype)),
            "text_encoder": UMT5EncoderModel.from_pretrained(path_or_hub_id, subfolder="text_encoder",
                                                             **text_dtype),
            "tokenizer": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer"),
        }
        if has_image_encoder:
            # an encoder of the conditioning, like UMT5: options.text_encoder_dtype applies
            components["image_encoder"] = CLIPVisionModel.from_pretrained(
                path_or_hub_id, subfolder="image_encoder", **text_dtype)
            components["image_processor"] = CLIPImageProcessor.from_pretrained(
                path_or_hub_id, subfolder="image_processor")
        transformer = WanTransformer3DModel.from_pretrained(path_or_hub_id, subfolder="transformer",
                                                            torch_dtype=dtype)
        if two_experts:
            transformer = WanExperts(
                transformer,
                WanTransformer3DModel.from_pretrained(path_or_hub_id, subfolder="transformer_2",
                                                      torch_dtype=dtype),
                boundary_ratio=float(index["boundary_ratio"]),
                num_train_timesteps=int(components["scheduler"].config.get("num_train_timesteps", 1000)),
                train_experts=options.train_experts or "both")
        return cls(transformer, components, options, device=device, dtype=dtype,
                   expand_timesteps=expand_timesteps)

    def to_pipeline(self) -> Any:
        """The stock WanImageToVideoPipeline on this adapter's components (Wan2.2-A14B: both
        experts and the boundary; TI2V-5B: ``expand_timesteps=True``)."""
        if not self.expand_timesteps:
            return super().to_pipeline()
        return self.pipeline_class(transformer=self.transformer, expand_timesteps=True, **self.components)

    def _preprocessing_pipeline(self) -> Any:
        """The stock pipeline without a transformer: its image preprocessing and encoders."""
        return self.pipeline_class(expand_timesteps=self.expand_timesteps, **self.components)

    # ---------------------------------------------------------------------------- prompts
    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F', h, w) of one video latent: C = the VAE's latent channels (16; the transformer
        takes 36: these, the mask and the condition), F' = (F - 1)/4 + 1, h = H/8, w = W/8."""
        _, frames, height, width = super().latent_shape
        return (self.vae.config.z_dim, frames, height, width)

    def encode_prompts(self, prompts: list[str], images: list[Tensor] | None = None) -> Conditioning:
        """Wan's prompt embeddings (cached per prompt) plus, in both branches, the source image's
        ``image_condition`` (B, 20, F', h, w; TI2V-5B: (B, C, 1, h, w)) and for Wan2.1
        ``image_embeds`` (B, 257, D_clip). One source image (3, h, w) in [0, 1] per prompt is
        required."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of str (wrap a single prompt in a list)")
        if images is None or len(images) != len(prompts) or any(i is None for i in images):
            raise ValueError("wan_i2v animates a source image: give one source image per prompt "
                             "(prompt records with an \"image\"; JSONL {\"prompt\", \"image\"})")
        cond = super().encode_prompts(prompts)
        image_rows = self.encode_images(list(images))
        cond.positive.update(image_rows)
        if cond.negative is not None:
            cond.negative.update(image_rows)
        return cond

    def encode_images(self, images: list[Tensor]) -> dict[str, Tensor]:
        """{"image_condition": (B, 20, F', h, w) float32 (TI2V-5B: the image's latents alone,
        (B, C, 1, h, w)), ["image_embeds": (B, 257, D) in the model dtype, Wan2.1 only]} of source
        images (3, h, w) in [0, 1], by the stock pipeline's own preprocessing, ``prepare_latents``
        (mask and VAE latents) and ``encode_image``."""
        from PIL import Image

        from flowgrpo.pixels import to_uint8

        for image in images:
            if not isinstance(image, Tensor) or image.dim() != 3 or image.shape[0] != 3:
                raise ValueError(f"source images must be (3, H, W) floats in [0, 1] (got "
                                 f"{getattr(image, 'shape', type(image).__name__)})")
        pil_images = [Image.fromarray(to_uint8(image)) for image in images]
        pipe = self._preprocessing_pipeline()
        noise = torch.zeros((1, *self.latent_shape), device=self.device)   # prepare_latents' draw, unused
        rows = []
        with torch.no_grad(), self.vae_on_device():
            for pil in pil_images:
                pixels = pipe.video_processor.preprocess(pil, height=self.height, width=self.width)
                # (latents, condition), or with expand_timesteps (latents, condition, mask)
                prepared = pipe.prepare_latents(
                    pixels.to(self.device, torch.float32), 1, self.vae.config.z_dim, self.height,
                    self.width, self.num_frames, torch.float32, self.device, None, noise)
                rows.append(prepared[1].float())
        out = {"image_condition": torch.cat(rows).to(self.device)}
        if self.image_encoder is not None:
            with torch.no_grad(), self._on_device([self.image_encoder], self.options.offload_text_encoders):
                embeds = pipe.encode_image(pil_images, self.device)
            out["image_embeds"] = embeds.to(self.device, self.dtype)
        return out

    # ---------------------------------------------------------------------------- FlowModel
    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, C, F', h, w) float32 at ``latents`` and per-sample sigma (B,): the
        transformer (Wan2.2-A14B: each row's expert) on [latents; image_condition] at timestep
        1000 sigma, with the CLIP image embeddings (Wan2.1) beside the text; CFG as Wan T2V
        (``guided_velocity``, the low-noise expert's ``guidance_scale_2`` where set). TI2V-5B:
        the transformer on the latents with the first frame replaced by the condition at
        per-token timesteps (0 on that frame), and that frame's velocity (x - condition) / sigma."""
        batch = latents.shape[0]
        if "image_condition" not in cond.positive:
            raise ValueError("wan_i2v needs the source image: encode the prompts with "
                             "encode_prompts(prompts, images=...)")
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        use_cfg = self._use_cfg(cond, guidance_scale)
        timestep = 1000.0 * sigma
        keys = [k for k in ("prompt_embeds", "image_condition", "image_embeds") if k in cond.positive]
        positive = {k: cond.positive[k].to(self.device) for k in keys}
        latents = latents.to(self.device, torch.float32)
        if self.expand_timesteps:
            mask = first_frame_mask(tuple(latents.shape[1:])).to(self.device)
            condition = positive["image_condition"].float()
            # as the pipeline: mixed in float32, then cast
            hidden = ((1.0 - mask) * condition + mask * latents).to(self.dtype)
        else:
            mask = None
            hidden = latents.to(self.dtype)

        def forward(hidden: Tensor, timestep: Tensor, rows: dict[str, Tensor]) -> Tensor:
            image_embeds = rows.get("image_embeds")
            if mask is None:
                inputs = torch.cat([hidden, rows["image_condition"].to(hidden.dtype)], dim=1)
            else:
                inputs, timestep = hidden, token_timesteps(mask, timestep, self.patch_size)
            return self.transformer(
                hidden_states=inputs, timestep=timestep,
                encoder_hidden_states=rows["prompt_embeds"].to(self.dtype),
                encoder_hidden_states_image=None if image_embeds is None else image_embeds.to(self.dtype),
                return_dict=False)[0].float()

        if not use_cfg:
            velocity = forward(hidden, timestep, positive)
        else:
            scale = self._guidance(timestep, guidance_scale)
            if isinstance(scale, Tensor):   # one scale per row: (B, 1, 1, 1, 1)
                scale = scale.view(-1, *([1] * (hidden.dim() - 1))).to(self.device)
            velocity = guided_velocity(forward, hidden, timestep, positive, cond.negative, scale)
        if mask is None:
            return velocity
        to_condition = (latents - condition) / sigma.view(-1, 1, 1, 1, 1)
        return mask * velocity + (1.0 - mask) * to_condition
