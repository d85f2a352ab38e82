"""FLUX.1 (e.g. ``black-forest-labs/FLUX.1-dev``) as a FlowModel.

Family quirks, all checked against ``FluxPipeline``:

- text: CLIP pooled output (B, 768) + T5 per-token states (B, L, 4096); text ids are zeros (L, 3);
- latents are VAE latents (B, 16, H/8, W/8) packed into 2x2 patches: (B, H/16 * W/16, 64), with
  image ids (row, column) per patch; ``initial_noise`` returns this packed layout (what
  ``FluxPipeline(latents=...)`` accepts), and draws it exactly as the pipeline does for the same
  generator (unpacked normal noise, then packed);
- dynamic shift: sigmas = linspace(1, 1/N, N), mu linear in the packed sequence length,
  sigma' = e^mu / (e^mu + 1/sigma - 1);
- transformer timestep = sigma (the pipeline divides its 1000-scaled timesteps by 1000);
- FLUX.1-dev is guidance-distilled: no real CFG; ``velocity(..., guidance_scale)`` feeds the
  guidance embedding (3.5 is the usual value), so one forward per step;
- size: without height/width options the image is what FluxPipeline samples at by default, its
  default_sample_size (128, a constant of the pipeline: FLUX's transformer config has no
  sample_size) x the checkpoint's VAE factor: 1024 for FLUX.1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flowgrpo.edit_regions import downsample_mask
from flowgrpo.model import Conditioning
from pipelines.base import DiffusersFlowModel
from pipelines.options import (AdapterOptions, check_divisible, parse_options,
                               require_attention_backend, resolve_dtype, resolve_size,
                               text_model_dtype)
from pipelines.sources import check_pipeline_folder

# PEFT targets. Double-stream blocks: image (to_*) and text (add_*_proj, to_add_out) attention
# projections and both feed-forwards. Single-stream blocks: their q/k/v (matched by the same
# 'attn.to_*' suffixes; they have no add_* and no to_out), the MLP input proj_mlp, and their
# proj_out (fused attention + MLP output), listed per block by ``flux_lora_target_modules`` so
# that the model's final 'proj_out' is not matched.
FLUX_DOUBLE_BLOCK_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                             "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                             "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
FLUX_SINGLE_BLOCK_TARGETS = ["proj_mlp"]


def flux_lora_target_modules(num_single_layers: int) -> list[str]:
    """PEFT target names for a FLUX transformer with ``num_single_layers`` single blocks."""
    return (FLUX_DOUBLE_BLOCK_TARGETS + FLUX_SINGLE_BLOCK_TARGETS
            + [f"single_transformer_blocks.{i}.proj_out" for i in range(num_single_layers)])


@dataclass
class FluxOptions(AdapterOptions):
    """FLUX.1 options (``load_model("flux", path, options={...})``)."""

    height: int | None = field(default=None, metadata={"help": (
        "Image height in pixels; divisible by VAE factor x 2 (packing) = 16. None = FluxPipeline's "
        "default, 128 x the checkpoint's VAE factor (1024 for FLUX.1). Flow-GRPO trains "
        "FLUX.1-dev at 512, MixGRPO at 720.")})
    width: int | None = field(default=None, metadata={"help": (
        "Image width in pixels; divisible by 16. None = FluxPipeline's default (as height).")})
    max_sequence_length: int = field(default=512, metadata={"help": (
        "T5 tokens per prompt (<= 512, the FluxPipeline default).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.max_sequence_length <= 512:
            raise ValueError(f"options.max_sequence_length must be in [1, 512] (got {self.max_sequence_length})")


def pack_latents(latents: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): each 2x2 patch becomes one token, channels-major
    (token features ordered (c, dy, dx)), tokens in row-major patch order."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: Tensor, h: int, w: int) -> Tensor:
    """Inverse of ``pack_latents``: (B, h/2 * w/2, 4C) -> (B, C, h, w)."""
    b, _, features = tokens.shape
    c = features // 4
    patches = tokens.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, h, w)


def packed_region_mask(mask: Tensor, latent_height: int, latent_width: int, channels: int,
                       resize: str = "area") -> Tensor:
    """An edit-region mask (B, 1, H, W) in [0, 1] in pixels -> the packed latents' layout
    (B, h/2 * w/2, 4C): downsampled to the VAE grid (h, w) by ``resize`` (``downsample_mask``),
    repeated over the C latent channels and packed like the latents (``pack_latents``), so each
    packed feature carries the weight of the latent element it holds."""
    grid = downsample_mask(mask, (latent_height, latent_width), resize)
    return pack_latents(grid.expand(-1, channels, -1, -1).contiguous())


def latent_image_ids(h: int, w: int) -> Tensor:
    """(h/2 * w/2, 3) float32 position ids of the packed tokens: (0, row, column)."""
    rows = torch.arange(h // 2, dtype=torch.float32)[:, None].expand(h // 2, w // 2)
    columns = torch.arange(w // 2, dtype=torch.float32)[None, :].expand(h // 2, w // 2)
    return torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(-1, 3)


class FluxModel(DiffusersFlowModel):
    """FLUX.1 adapter. Build with ``FluxModel.from_pretrained(path_or_hub_id, ...)``."""

    family = "flux"
    options_class = FluxOptions
    pipeline_class_path = "diffusers:FluxPipeline"
    text_encoder_names = ("text_encoder", "text_encoder_2")
    has_real_cfg = False

    def __init__(self, transformer: torch.nn.Module, components: dict, options: FluxOptions,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        targets = flux_lora_target_modules(transformer.config.num_single_layers)
        self.vae_scale_factor = 2 ** (len(components["vae"].config.block_out_channels) - 1)
        options = resolve_size(options, default_size(self.vae_scale_factor))
        super().__init__(transformer, components, options, targets, device, dtype)
        _check_sizes(options, self.vae_scale_factor, transformer.config.patch_size)
        self.scheduler_config = dict(components["scheduler"].config)
        self.latent_height = options.height // self.vae_scale_factor
        self.latent_width = options.width // self.vae_scale_factor
        self.image_ids = latent_image_ids(self.latent_height, self.latent_width).to(self.device)

    # ---------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu",
                        options: FluxOptions | dict | None = None) -> "FluxModel":
        """Load every component with its class's ``from_pretrained(path, subfolder=...)``.
        Options, folder contents and image size are validated before any weights load."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        options = parse_options(FluxOptions, options, cls.family)
        require_attention_backend(options.attention_backend)
        check_pipeline_folder(path_or_hub_id, {
            "transformer": "config.json", "vae": "config.json", "scheduler": "scheduler_config.json",
            "text_encoder": "config.json", "text_encoder_2": "config.json",
            "tokenizer": "tokenizer_config.json", "tokenizer_2": "tokenizer_config.json"}, cls.family)
        transformer_config = FluxTransformer2DModel.load_config(path_or_hub_id, subfolder="transformer")
        vae_config = AutoencoderKL.load_config(path_or_hub_id, subfolder="vae")
        vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
        options = resolve_size(options, default_size(vae_scale_factor))
        _check_sizes(options, vae_scale_factor, transformer_config["patch_size"])

        text_dtype = resolve_dtype(options.text_encoder_dtype, dtype)
        components = {
            "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(path_or_hub_id, subfolder="scheduler"),
            "vae": AutoencoderKL.from_pretrained(path_or_hub_id, subfolder="vae",
                                                 torch_dtype=resolve_dtype(options.vae_dtype, dtype)),
            "text_encoder": CLIPTextModel.from_pretrained(path_or_hub_id, subfolder="text_encoder",
                                                          **text_model_dtype(text_dtype)),
            "text_encoder_2": T5EncoderModel.from_pretrained(path_or_hub_id, subfolder="text_encoder_2",
                                                             **text_model_dtype(text_dtype)),
            "tokenizer": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer"),
            "tokenizer_2": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_2"),
        }
        transformer = FluxTransformer2DModel.from_pretrained(path_or_hub_id, subfolder="transformer",
                                                             torch_dtype=dtype)
        return cls(transformer, components, options, device=device, dtype=dtype)

    # ---------------------------------------------------------------------------- FlowModel
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, max_sequence_length, D_T5), "pooled_prompt_embeds": (B, D_CLIP)}
        computed by the stock pipeline's ``encode_prompt``."""
        prompt_embeds, pooled, _ = self.to_pipeline().encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device,
            max_sequence_length=self.options.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def _extra_conditioning(self, positive: dict[str, Tensor]) -> dict[str, Tensor]:
        text_length = positive["prompt_embeds"].shape[1]
        return {"text_ids": torch.zeros(text_length, 3, device=self.device)}

    @property
    def packed_shape(self) -> tuple[int, int]:
        """(tokens, features) of one packed latent: (H/16 * W/16, 4 C)."""
        return ((self.latent_height // 2) * (self.latent_width // 2), self.transformer.config.in_channels)

    def region_mask(self, mask: Tensor, resize: str = "area") -> Tensor:
        """An edit-region mask (B, 1, H, W) in [0, 1] on the packed latents' layout
        (B, H/16 * W/16, 4C) (``packed_region_mask``)."""
        return packed_region_mask(mask, self.latent_height, self.latent_width,
                                  self.transformer.config.in_channels // 4, resize)

    def initial_noise(self, batch: int, generator: torch.Generator | None) -> Tensor:
        """(batch, H/16 * W/16, 4C) float32: standard normal (batch, C, H/8, W/8), packed."""
        device = generator.device if generator is not None else self.device
        channels = self.transformer.config.in_channels // 4
        noise = torch.randn((batch, channels, self.latent_height, self.latent_width), generator=generator,
                            device=device, dtype=torch.float32)
        return pack_latents(noise)

    def sigmas(self, num_steps: int) -> Tensor:
        """(num_steps + 1,) float32: linspace(1, 1/N, N) with the dynamic (resolution-dependent)
        shift of the scheduler config, or its static shift when dynamic shifting is off."""
        from flowgrpo.sde import dynamic_shift_sigmas, shift_sigma

        config = self.scheduler_config
        if config.get("use_dynamic_shifting", False):
            return dynamic_shift_sigmas(
                num_steps, self.packed_shape[0],
                base_seq_len=config.get("base_image_seq_len", 256),
                max_seq_len=config.get("max_image_seq_len", 4096),
                base_shift=config.get("base_shift", 0.5), max_shift=config.get("max_shift", 1.15))
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1 (got {num_steps})")
        grid = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
        sigmas = shift_sigma(grid, float(config.get("shift", 1.0))).to(torch.float32)
        return torch.cat([sigmas, torch.zeros(1)])

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, tokens, 4C) float32 at packed ``latents`` and per-sample sigma (B,);
        transformer timestep = sigma; ``guidance_scale`` is the guidance embedding's value
        (ignored by models without one, e.g. FLUX.1-schnell). One forward, no real CFG."""
        batch = latents.shape[0]
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((batch,), float(guidance_scale), device=self.device, dtype=torch.float32)
        text_ids = cond.extra.get("text_ids")
        if text_ids is None:
            text_ids = torch.zeros(cond.positive["prompt_embeds"].shape[1], 3)
        hidden, image_ids = self.image_tokens(latents.to(self.device, self.dtype), cond)
        out = self.transformer(
            hidden_states=hidden, timestep=sigma, guidance=guidance,
            pooled_projections=cond.positive["pooled_prompt_embeds"].to(self.device, self.dtype),
            encoder_hidden_states=cond.positive["prompt_embeds"].to(self.device, self.dtype),
            txt_ids=text_ids.to(self.device), img_ids=image_ids, return_dict=False)[0]
        # The velocity of the output tokens only (a subclass may append source tokens after them).
        return out[:, :latents.shape[1]].float()

    def image_tokens(self, latents: Tensor, cond: Conditioning) -> tuple[Tensor, Tensor]:
        """The image tokens the transformer sees, (B, tokens', 4C), and their position ids
        (tokens', 3): here the output tokens alone; Kontext appends its source image's."""
        return latents, self.image_ids.to(self.device)

    def encode_images(self, images: list[Tensor]) -> Tensor:
        """Packed, normalised VAE latents (B, H/16 * W/16, 4C) of images (3, h, w) in [0, 1],
        each resized to the output size when it differs (Kontext's source images; Diffusion-DPO's
        offline preference pairs)."""
        return pack_latents(self.vae_latents(images)).to(self.dtype)

    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, 3, H, W) float32 in [0, 1] from packed latents (B, tokens, 4C)."""
        config = self.vae.config
        z = unpack_latents(latents.to(self.device, torch.float32), self.latent_height, self.latent_width)
        z = z / config.scaling_factor + (config.shift_factor or 0.0)
        with self.vae_on_device():
            images = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]
        return (images.float() * 0.5 + 0.5).clamp(0.0, 1.0)


# FluxPipeline.default_sample_size: a constant of the pipeline (not read from the checkpoint).
PIPELINE_DEFAULT_SAMPLE_SIZE = 128


def default_size(vae_scale_factor: int) -> dict[str, int]:
    """The size FluxPipeline samples at when given none: ``PIPELINE_DEFAULT_SAMPLE_SIZE *
    vae_scale_factor`` a side."""
    side = PIPELINE_DEFAULT_SAMPLE_SIZE * vae_scale_factor
    return {"height": side, "width": side}


def _check_sizes(options: FluxOptions, vae_scale_factor: int, patch_size: int) -> None:
    multiple = vae_scale_factor * 2 * patch_size
    why = f"VAE factor {vae_scale_factor} x 2x2 packing x patch size {patch_size}"
    check_divisible(options.height, multiple, "height", "flux", why)
    check_divisible(options.width, multiple, "width", "flux", why)
