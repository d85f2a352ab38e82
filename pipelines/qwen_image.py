"""Qwen-Image (``Qwen/Qwen-Image``) text-to-image as a FlowModel.

Family quirks, all checked against ``QwenImagePipeline``:

- text: Qwen2.5-VL's last hidden states of the prompt wrapped in the pipeline's chat template,
  with the template's first tokens (its system part, ``prompt_template_encode_start_idx``) dropped;
  per-prompt lengths vary, so the embeddings (B, L, 3584) come with a mask (B, L) (1 = token,
  0 = padding) that the transformer's joint attention uses. Computed by the pipeline's own
  ``encode_prompt``; cached per prompt at its batch's length and zero-padded to a common length;
- latents: VAE latents (B, 16, H/8, W/8) packed into 2x2 patches, (B, H/16 * W/16, 64), the same
  layout as FLUX; RoPE needs ``img_shapes`` = [(1, H/16, W/16)] per sample;
- dynamic shift: sigmas = linspace(1, 1/N, N) through the scheduler config's
  ``FlowMatchEulerDiscreteScheduler`` with mu linear in the packed sequence length (base/max
  shift and sequence lengths from that config: 0.5 / 0.9 at 256 / 8192 tokens for Qwen-Image, with
  ``shift_terminal`` 0.02): computed by the scheduler itself, so every flag of its config applies;
- transformer timestep = sigma (the pipeline passes its 1000-scaled timesteps divided by 1000);
- true CFG with a negative prompt (``true_cfg_scale``): both branches in one batched forward,
  v = v_neg + g (v_pos - v_neg), then rescaled per token to the norm of v_pos (the pipeline's
  ``comb_pred * (cond_norm / noise_norm)``, norms over the 64 packed features);
- decode: latents * latents_std + latents_mean (per channel), the (causal, video-shaped) VAE on a
  single frame, images (B, 3, H, W) in [0, 1].
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from flowgrpo.model import Conditioning, guidance_branches
from pipelines.base import DiffusersFlowModel
from pipelines.options import (AdapterOptions, check_divisible, parse_options,
                               require_attention_backend, resolve_dtype, resolve_size,
                               text_model_dtype)
from pipelines.sources import check_pipeline_folder, read_model_index
from pipelines.flux import pack_latents, packed_region_mask, unpack_latents

# PEFT targets as in Flow-GRPO's Qwen-Image training (scripts/train_qwenimage_edit_plus.py of
# yifan123/flow_grpo): the joint attention's image (to_*) and text (add_*_proj, to_add_out)
# projections and both streams' feed-forwards.
QWEN_IMAGE_LORA_TARGET_MODULES = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                  "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                                  "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
                                  "txt_mlp.net.0.proj", "txt_mlp.net.2"]

# QwenImagePipeline.default_sample_size: its default image is this many latent pixels a side
# (x the VAE factor 8 = 1024 px for Qwen-Image). A checkpoint whose transformer config declares
# ``sample_size`` overrides it.
PIPELINE_DEFAULT_SAMPLE_SIZE = 128
# QwenImagePipeline.tokenizer_max_length: the longest prompt (template excluded) it encodes.
TOKENIZER_MAX_LENGTH = 1024

# Transformer variants whose forward needs inputs a text-to-image call does not have (editing's
# conditioning images, layered decomposition); refused with the field named.
_UNSUPPORTED_TRANSFORMER_FLAGS = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond",
                                  "use_layer3d_rope")


@dataclass
class QwenImageOptions(AdapterOptions):
    """Qwen-Image options (``load_model("qwen_image", path, options={...})``)."""

    height: int | None = field(default=None, metadata={"help": (
        "Image height in pixels; divisible by VAE factor x 2 (packing) = 16. None = the "
        "checkpoint's size: its transformer config's sample_size, else QwenImagePipeline's "
        "default (128 latent pixels x the VAE factor = 1024 for Qwen-Image). Flow-GRPO trains "
        "Qwen-Image at 512.")})
    width: int | None = field(default=None, metadata={"help": (
        "Image width in pixels; divisible by 16. None = the checkpoint's size (see height).")})
    cfg: bool = field(default=True, metadata={"help": (
        "Encode the negative prompt so that velocity() can run true classifier-free guidance "
        "(guidance_scale > 1, the pipeline's true_cfg_scale; Flow-GRPO samples with 4).")})
    negative_prompt: str = field(default=" ", metadata={"help": (
        "The CFG negative prompt (Flow-GRPO and Qwen-Image's examples use a single space).")})
    max_sequence_length: int = field(default=512, metadata={"help": (
        "Prompt tokens kept after the template (QwenImagePipeline's default 512; at most 1024).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.max_sequence_length <= TOKENIZER_MAX_LENGTH:
            raise ValueError(f"options.max_sequence_length must be in [1, {TOKENIZER_MAX_LENGTH}] "
                             f"(got {self.max_sequence_length})")
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"options.{name} must be a positive int or None for the "
                                 f"checkpoint's size (got {value})")


class QwenImageModel(DiffusersFlowModel):
    """Qwen-Image adapter. Build with ``QwenImageModel.from_pretrained(path_or_hub_id, ...)``."""

    family = "qwen_image"
    options_class = QwenImageOptions
    pipeline_class_path = "diffusers:QwenImagePipeline"
    text_encoder_names = ("text_encoder",)
    has_real_cfg = True

    def __init__(self, transformer: torch.nn.Module, components: dict, options: QwenImageOptions,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__(transformer, components, options, QWEN_IMAGE_LORA_TARGET_MODULES, device, dtype)
        _check_transformer_config(dict(transformer.config), self.supported_transformer_flags)
        self.vae_scale_factor = 2 ** len(self.vae.config.temperal_downsample)
        self.height, self.width = _image_size(options, dict(transformer.config), self.vae_scale_factor)
        self.latent_height = self.height // self.vae_scale_factor
        self.latent_width = self.width // self.vae_scale_factor
        self.scheduler_config = dict(components["scheduler"].config)
        _check_scheduler_config(self.scheduler_config)

    # ---------------------------------------------------------------------------- loading
    # What a subclass (Qwen-Image-Edit) adds to the folder check and the components.
    extra_folders: dict[str, str] = {}
    # Transformer config flags of _UNSUPPORTED_TRANSFORMER_FLAGS whose inputs the subclass gives.
    supported_transformer_flags: tuple[str, ...] = ()
    wrong_folder_hint = ("this adapter is text-to-image (QwenImagePipeline, e.g. Qwen/Qwen-Image); "
                         "editing and control variants need their own adapters")

    @classmethod
    def _extra_components(cls, path_or_hub_id: str) -> dict:
        return {}

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu",
                        options: QwenImageOptions | dict | None = None) -> "QwenImageModel":
        """Load every component with its class's ``from_pretrained(path, subfolder=...)``.
        Options, folder contents, pipeline class, transformer variant, image size and scheduler
        are validated before any weights load."""
        from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                               QwenImageTransformer2DModel)
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

        options = parse_options(cls.options_class, options, cls.family)
        require_attention_backend(options.attention_backend)
        check_pipeline_folder(path_or_hub_id, {
            "transformer": "config.json", "vae": "config.json", "scheduler": "scheduler_config.json",
            "text_encoder": "config.json", "tokenizer": "tokenizer_config.json",
            **cls.extra_folders}, cls.family)
        expected = cls.pipeline_class_path.split(":")[1]
        pipeline_name = read_model_index(path_or_hub_id).get("_class_name", expected)
        if pipeline_name != expected:
            raise ValueError(f"{cls.family}: {path_or_hub_id!r} is a {pipeline_name} folder; "
                             f"{cls.wrong_folder_hint}")
        transformer_config = QwenImageTransformer2DModel.load_config(path_or_hub_id, subfolder="transformer")
        _check_transformer_config(transformer_config, cls.supported_transformer_flags)
        vae_config = AutoencoderKLQwenImage.load_config(path_or_hub_id, subfolder="vae")
        height, width = _image_size(options, transformer_config,
                                      2 ** len(vae_config.get("temperal_downsample", [False, True, True])))
        # Resolved here, where the raw config (with any sample_size) is at hand: the loaded
        # model's config keeps only its constructor's fields.
        options = dataclasses.replace(options, height=height, width=width)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path_or_hub_id, subfolder="scheduler")
        _check_scheduler_config(dict(scheduler.config))

        components = {
            "scheduler": scheduler,
            "vae": AutoencoderKLQwenImage.from_pretrained(
                path_or_hub_id, subfolder="vae", torch_dtype=resolve_dtype(options.vae_dtype, dtype)),
            "text_encoder": Qwen2_5_VLForConditionalGeneration.from_pretrained(
                path_or_hub_id, subfolder="text_encoder",
                **text_model_dtype(resolve_dtype(options.text_encoder_dtype, dtype))),
            "tokenizer": Qwen2Tokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer"),
            **cls._extra_components(path_or_hub_id),
        }
        transformer = QwenImageTransformer2DModel.from_pretrained(path_or_hub_id, subfolder="transformer",
                                                                  torch_dtype=dtype)
        return cls(transformer, components, options, device=device, dtype=dtype)

    # ---------------------------------------------------------------------------- prompts
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, L, D), "prompt_embeds_mask": (B, L) int64} by the stock
        pipeline's ``encode_prompt`` (template applied and dropped, L = the longest prompt of the
        batch, at most max_sequence_length). The pipeline returns no mask when no row is padded;
        here the mask is always there (ones)."""
        embeds, mask = self.to_pipeline().encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.options.max_sequence_length)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask.long()}

    def negative_prompt(self) -> str | None:
        return self.options.negative_prompt if self.options.cfg else None

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """As ``DiffusersFlowModel.encode_prompts``, with the positive and negative embeddings
        brought to one length L (the longest prompt among them, zero-padded, mask 0), so that both
        CFG branches run in one batched forward. positive/negative: {"prompt_embeds": (B, L, D),
        "prompt_embeds_mask": (B, L)}."""
        return one_text_length(super().encode_prompts(prompts))

    # ---------------------------------------------------------------------------- FlowModel
    @property
    def packed_shape(self) -> tuple[int, int]:
        """(tokens, features) of one packed latent: (H/16 * W/16, 4 C)."""
        return ((self.latent_height // 2) * (self.latent_width // 2), self.transformer.config.in_channels)

    @property
    def img_shapes(self) -> list[tuple[int, int, int]]:
        """The transformer's RoPE layout of one image: [(frames 1, H/16, W/16)]."""
        return [(1, self.latent_height // 2, self.latent_width // 2)]

    def region_mask(self, mask: Tensor, resize: str = "area") -> Tensor:
        """An edit-region mask (B, 1, H, W) in [0, 1] on the packed latents' layout
        (B, H/16 * W/16, 4C) (``pipelines.flux.packed_region_mask``)."""
        return packed_region_mask(mask, self.latent_height, self.latent_width,
                                  self.transformer.config.in_channels // 4, resize)

    def initial_noise(self, batch: int, generator: torch.Generator | None) -> Tensor:
        """(batch, H/16 * W/16, 4C) float32: standard normal (batch, C, H/8, W/8), packed (what
        QwenImagePipeline.prepare_latents draws from the same generator in float32)."""
        device = generator.device if generator is not None else self.device
        channels = self.transformer.config.in_channels // 4
        noise = torch.randn((batch, channels, self.latent_height, self.latent_width),
                            generator=generator, device=device, dtype=torch.float32)
        return pack_latents(noise)

    def sigmas(self, num_steps: int) -> Tensor:
        """(num_steps + 1,) float32: the pipeline's schedule, computed by the checkpoint's
        scheduler as QwenImagePipeline does: set_timesteps(sigmas=linspace(1, 1/N, N), mu) with
        mu linear in the packed sequence length (dynamic shift), shift_terminal stretching, then 0."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        from flowgrpo.sde import calculate_shift

        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1 (got {num_steps!r})")
        config = self.scheduler_config
        mu = calculate_shift(self.packed_shape[0], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu)
        return scheduler.sigmas.detach().to("cpu", torch.float32)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, tokens, 4C) float32 at packed ``latents`` and per-sample sigma (B,);
        transformer timestep = sigma. CFG (guidance_scale > 1): both branches through
        ``guidance_branches`` (one forward over [negative; positive] unless training.cfg_gradient
        splits them), v = v_neg + g (v_pos - v_neg), rescaled per token to |v_pos| (the
        pipeline's true CFG). Text is cut to the longest prompt among the rows of a forward."""
        batch = latents.shape[0]
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        use_cfg = self._use_cfg(cond, guidance_scale)
        hidden = latents.to(self.device, self.dtype)
        positive = {k: cond.positive[k] for k in ("prompt_embeds", "prompt_embeds_mask")}

        def forward(hidden: Tensor, sigma: Tensor, text: dict[str, Tensor]) -> Tensor:
            length = _text_length(text["prompt_embeds_mask"])
            embeds = text["prompt_embeds"][:, :length].to(self.device, self.dtype)
            mask = text["prompt_embeds_mask"][:, :length].to(self.device)
            # No padding left: no mask, as the pipeline passes (it drops an all-ones mask),
            # which lets the attention take its unmasked kernel.
            mask = None if bool(mask.all()) else mask
            return self.transformer(hidden_states=hidden, timestep=sigma.to(hidden.dtype),
                                    encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                                    img_shapes=[self.img_shapes] * hidden.shape[0],
                                    return_dict=False)[0].float()

        if not use_cfg:
            return forward(hidden, sigma, positive)
        v_neg, v_pos = guidance_branches(forward, hidden, sigma, positive, cond.negative)
        return true_cfg(v_neg, v_pos, guidance_scale)

    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, 3, H, W) float32 in [0, 1] from packed latents (B, tokens, 4C)."""
        config = self.vae.config
        z = unpack_latents(latents.to(self.device, torch.float32), self.latent_height, self.latent_width)
        mean = torch.tensor(config.latents_mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        inverse_std = 1.0 / torch.tensor(config.latents_std, dtype=torch.float32,
                                         device=self.device).view(1, -1, 1, 1)
        z = (z / inverse_std + mean).unsqueeze(2)   # the VAE is video-shaped: one frame
        with self.vae_on_device():
            images = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0][:, :, 0]
        return (images.float() * 0.5 + 0.5).clamp(0.0, 1.0)


def one_text_length(cond: Conditioning) -> Conditioning:
    """``cond`` with its positive and negative text ({"prompt_embeds": (B, L_i, D),
    "prompt_embeds_mask": (B, L_i)}) brought to one length L, the longest real text among them
    (zero-padded, mask 0), so that both CFG branches stack into one batch."""
    branches = [cond.positive] + ([cond.negative] if cond.negative is not None else [])
    length = max(_text_length(b["prompt_embeds_mask"]) for b in branches)
    negative = _fit_text(cond.negative, length) if cond.negative is not None else None
    return Conditioning(positive=_fit_text(cond.positive, length), negative=negative,
                        extra=dict(cond.extra))


def stacked_text(branches: list[list[dict[str, Tensor]]]) -> list[dict[str, Tensor]]:
    """Per CFG branch, its rows' texts (each {"prompt_embeds": (1, L_i, D), "prompt_embeds_mask":
    (1, L_i)}) stacked into (B, L, ...) at one length L for every branch: the editing adapters,
    which encode each row with its own images."""
    length = max(_text_length(row["prompt_embeds_mask"]) for rows in branches for row in rows)
    return [{key: torch.cat([_fit_text(row, length)[key] for row in rows])
             for key in ("prompt_embeds", "prompt_embeds_mask")} for rows in branches]


def _text_length(mask: Tensor) -> int:
    """Tokens up to the last real one over the rows of ``mask`` (B, L) (at least 1)."""
    real = mask.bool().any(dim=0).nonzero()
    return int(real.max()) + 1 if real.numel() else 1


def true_cfg(v_neg: Tensor, v_pos: Tensor, guidance_scale: float) -> Tensor:
    """Qwen-Image's true CFG of the branches (B, tokens, D): v_neg + g (v_pos - v_neg), each
    token rescaled to the norm of its conditional velocity."""
    combined = v_neg + guidance_scale * (v_pos - v_neg)
    return combined * (v_pos.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


def _fit_text(text: dict[str, Tensor], length: int) -> dict[str, Tensor]:
    """``text``'s (B, L, ...) tensors cut or zero-padded (mask 0) to ``length`` along dim 1."""
    out = {}
    for key, value in text.items():
        if value.shape[1] >= length:
            out[key] = value[:, :length]
        else:
            pad = (0, 0) * (value.dim() - 2) + (0, length - value.shape[1])
            out[key] = torch.nn.functional.pad(value, pad)
    return out


def _image_size(options: QwenImageOptions, transformer_config: dict, vae_scale_factor: int
                  ) -> tuple[int, int]:
    """(height, width) in pixels: the options, or the checkpoint's default for None; both
    checked divisible by VAE factor x 2 (the 2x2 packing)."""
    side = (transformer_config.get("sample_size") or PIPELINE_DEFAULT_SAMPLE_SIZE) * vae_scale_factor
    resolved = resolve_size(options, {"height": side, "width": side})
    why = f"VAE factor {vae_scale_factor} x 2x2 packing"
    check_divisible(resolved.height, vae_scale_factor * 2, "height", "qwen_image", why)
    check_divisible(resolved.width, vae_scale_factor * 2, "width", "qwen_image", why)
    return resolved.height, resolved.width


def _check_transformer_config(config: dict, supported: tuple[str, ...] = ()) -> None:
    flags = [name for name in _UNSUPPORTED_TRANSFORMER_FLAGS
             if config.get(name) and name not in supported]
    if flags:
        raise ValueError(f"qwen_image transformer config sets {flags}: a variant whose forward "
                         "needs inputs text-to-image sampling does not give (guidance embedding, "
                         "conditioning images or layers); use a Qwen-Image text-to-image checkpoint")
    if config.get("in_channels", 64) % 4:
        raise ValueError(f"qwen_image transformer in_channels must be 4 x latent channels (2x2 "
                         f"packing); got {config.get('in_channels')}")


def _check_scheduler_config(config: dict) -> None:
    if config.get("invert_sigmas"):
        raise ValueError("qwen_image scheduler config sets invert_sigmas, which this adapter does "
                         "not reproduce (its schedule must run from 1 to 0); use the checkpoint's "
                         "FlowMatchEulerDiscreteScheduler config")
