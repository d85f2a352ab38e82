"""Stable Diffusion 3 / 3.5 (e.g. ``stabilityai/stable-diffusion-3.5-medium``) as a FlowModel.

Family quirks, all checked against ``StableDiffusion3Pipeline``:

- three text encoders: two CLIPs (per-token penultimate states concatenated and zero-padded to
  the T5 width, pooled projections concatenated) and an optional T5 (``text_encoder_3=False``
  replaces its tokens by zeros, as the pipeline does with ``text_encoder_3=None``);
- latents (B, 16, H/8, W/8); transformer timestep = 1000 sigma;
- static shift from the scheduler config (``shift``, 3.0 for SD3.5), with diffusers' schedule
  (the last non-zero sigma is the twice-shifted 1/1000);
- real CFG with a negative prompt ("" by default), both branches in one batched forward;
- decode: latents / scaling_factor + shift_factor, then the VAE;
- size: without height/width options the image is the checkpoint's size, as the pipeline does:
  transformer ``sample_size`` x VAE factor (1024 for SD3.5); prompts are embedded at 256 T5 tokens
  unless ``max_sequence_length`` says otherwise (Flow-GRPO's recipes: 128).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flowgrpo.model import Conditioning, guided_velocity
from pipelines.base import DiffusersFlowModel
from pipelines.options import (AdapterOptions, check_divisible, parse_options,
                               require_attention_backend, resolve_dtype, resolve_size,
                               text_model_dtype)
from pipelines.sources import check_pipeline_folder

# PEFT targets: the joint attention projections of every block, image stream (to_*) and text
# stream (add_*_proj, to_add_out). The last block has no to_add_out (context_pre_only) and
# SD3.5's second attention (attn2) is not targeted, as in Flow-GRPO.
SD3_LORA_TARGET_MODULES = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]

_UNSUPPORTED_SCHEDULER_FLAGS = ("use_dynamic_shifting", "use_karras_sigmas", "use_exponential_sigmas",
                                "use_beta_sigmas", "shift_terminal", "invert_sigmas", "stochastic_sampling")


@dataclass
class SD3Options(AdapterOptions):
    """SD3 options (``load_model("sd3", path, options={...})``)."""

    height: int | None = field(default=None, metadata={"help": (
        "Image height in pixels; divisible by VAE factor x patch size (16). None = the checkpoint's "
        "size, transformer sample_size x VAE factor (StableDiffusion3Pipeline's default; 1024 for "
        "SD3.5). Flow-GRPO trains SD3.5-M at 512.")})
    width: int | None = field(default=None, metadata={"help": (
        "Image width in pixels; divisible by 16. None = the checkpoint's size (as height).")})
    text_encoder_3: bool = field(default=True, metadata={"help": (
        "Load the T5-XXL encoder. False saves ~9 GB and uses zeros for its tokens (diffusers' "
        "text_encoder_3=None path); image quality drops somewhat.")})
    cfg: bool = field(default=True, metadata={"help": (
        "Encode the negative prompt so that velocity() can run classifier-free guidance "
        "(guidance_scale > 1). Flow-GRPO samples SD3.5-M with guidance 4.5.")})
    negative_prompt: str = field(default="", metadata={"help": "The CFG negative prompt."})
    max_sequence_length: int = field(default=256, metadata={"help": (
        "T5 tokens per prompt (<= 512); the pipeline default is 256, Flow-GRPO's train_sd3.py "
        "embeds 128 (the sequence length is the largest speed lever after the image size).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.max_sequence_length <= 512:
            raise ValueError(f"options.max_sequence_length must be in [1, 512] (got {self.max_sequence_length})")


class SD3Model(DiffusersFlowModel):
    """SD3/SD3.5 adapter. Build with ``SD3Model.from_pretrained(path_or_hub_id, ...)``."""

    family = "sd3"
    options_class = SD3Options
    pipeline_class_path = "diffusers:StableDiffusion3Pipeline"
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    has_real_cfg = True

    def __init__(self, transformer: torch.nn.Module, components: dict, options: SD3Options,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.vae_scale_factor = 2 ** (len(components["vae"].config.block_out_channels) - 1)
        options = resolve_size(options, default_size(dict(transformer.config), self.vae_scale_factor))
        super().__init__(transformer, components, options, SD3_LORA_TARGET_MODULES, device, dtype)
        _check_sizes(options, self.vae_scale_factor, transformer.config.patch_size)
        self.scheduler_config = dict(components["scheduler"].config)
        _check_scheduler_config(self.scheduler_config)

    # ---------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu",
                        options: SD3Options | dict | None = None) -> "SD3Model":
        """Load every component with its class's ``from_pretrained(path, subfolder=...)``.
        Options, folder contents, image size and scheduler are validated before any weights load."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        options = parse_options(SD3Options, options, cls.family)
        require_attention_backend(options.attention_backend)
        required = {"transformer": "config.json", "vae": "config.json",
                    "scheduler": "scheduler_config.json",
                    "text_encoder": "config.json", "text_encoder_2": "config.json",
                    "tokenizer": "tokenizer_config.json", "tokenizer_2": "tokenizer_config.json"}
        if options.text_encoder_3:
            required.update({"text_encoder_3": "config.json", "tokenizer_3": "tokenizer_config.json"})
        check_pipeline_folder(path_or_hub_id, required, cls.family)
        transformer_config = SD3Transformer2DModel.load_config(path_or_hub_id, subfolder="transformer")
        vae_config = AutoencoderKL.load_config(path_or_hub_id, subfolder="vae")
        vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
        options = resolve_size(options, default_size(transformer_config, vae_scale_factor))
        _check_sizes(options, vae_scale_factor, transformer_config["patch_size"])
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path_or_hub_id, subfolder="scheduler")
        _check_scheduler_config(dict(scheduler.config))

        text_dtype = resolve_dtype(options.text_encoder_dtype, dtype)
        components = {
            "scheduler": scheduler,
            "vae": AutoencoderKL.from_pretrained(path_or_hub_id, subfolder="vae",
                                                 torch_dtype=resolve_dtype(options.vae_dtype, dtype)),
            "text_encoder": CLIPTextModelWithProjection.from_pretrained(
                path_or_hub_id, subfolder="text_encoder", **text_model_dtype(text_dtype)),
            "text_encoder_2": CLIPTextModelWithProjection.from_pretrained(
                path_or_hub_id, subfolder="text_encoder_2", **text_model_dtype(text_dtype)),
            "tokenizer": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer"),
            "tokenizer_2": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_2"),
            "text_encoder_3": None,
            "tokenizer_3": None,
        }
        if options.text_encoder_3:
            components["text_encoder_3"] = T5EncoderModel.from_pretrained(
                path_or_hub_id, subfolder="text_encoder_3", **text_model_dtype(text_dtype))
            components["tokenizer_3"] = AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_3")
        transformer = SD3Transformer2DModel.from_pretrained(path_or_hub_id, subfolder="transformer",
                                                            torch_dtype=dtype)
        return cls(transformer, components, options, device=device, dtype=dtype)

    def required_text_encoders(self) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2") + (("text_encoder_3",) if self.options.text_encoder_3 else ())

    # ---------------------------------------------------------------------------- FlowModel
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, 77 + max_sequence_length, D_T5), "pooled_prompt_embeds": (B, P)}
        computed by the stock pipeline's ``encode_prompt``."""
        prompt_embeds, _, pooled, _ = self.to_pipeline().encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.options.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def negative_prompt(self) -> str | None:
        return self.options.negative_prompt if self.options.cfg else None

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, H/8, W/8) of one latent."""
        return (self.transformer.config.in_channels, self.options.height // self.vae_scale_factor,
                self.options.width // self.vae_scale_factor)

    def initial_noise(self, batch: int, generator: torch.Generator | None) -> Tensor:
        """(batch, C, H/8, W/8) float32 standard normal, on the generator's device (else ``device``)."""
        device = generator.device if generator is not None else self.device
        return torch.randn((batch, *self.latent_shape), generator=generator, device=device,
                           dtype=torch.float32)

    def sigmas(self, num_steps: int) -> Tensor:
        """(num_steps + 1,) float32: the scheduler config's static shift on diffusers' grid
        (= FlowMatchEulerDiscreteScheduler.set_timesteps(num_steps).sigmas)."""
        from flowgrpo.sde import static_shift_sigmas

        return static_shift_sigmas(num_steps, float(self.scheduler_config.get("shift", 1.0)),
                                   int(self.scheduler_config.get("num_train_timesteps", 1000)))

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, C, h, w) float32 at ``latents`` (B, C, h, w) and per-sample sigma (B,);
        transformer timestep = 1000 sigma. CFG (guidance_scale > 1): ``guided_velocity`` (one
        forward over [negative; positive] unless training.cfg_gradient splits them), combined in
        float32 as v_neg + g (v_pos - v_neg)."""
        batch = latents.shape[0]
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        use_cfg = self._use_cfg(cond, guidance_scale)
        hidden = latents.to(self.device, self.dtype)
        timestep = 1000.0 * sigma
        keys = ("prompt_embeds", "pooled_prompt_embeds")

        def forward(hidden: Tensor, timestep: Tensor, text: dict[str, Tensor]) -> Tensor:
            return self.transformer(hidden_states=hidden, timestep=timestep,
                                    encoder_hidden_states=text["prompt_embeds"].to(self.device, self.dtype),
                                    pooled_projections=text["pooled_prompt_embeds"].to(self.device, self.dtype),
                                    return_dict=False)[0].float()

        return guided_velocity(forward, hidden, timestep, {k: cond.positive[k] for k in keys},
                               cond.negative if use_cfg else None, guidance_scale)

    def encode_images(self, images: list[Tensor]) -> Tensor:
        """Latents (B, C, H/8, W/8) of images (3, h, w) in [0, 1] (resized to the output size):
        ``decode``'s inverse up to the VAE, e.g. for Diffusion-DPO's offline preference pairs."""
        return self.vae_latents(images).to(self.dtype)

    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, 3, H, W) float32 in [0, 1] from latents (B, C, H/8, W/8)."""
        config = self.vae.config
        z = latents.to(self.device, torch.float32) / config.scaling_factor + (config.shift_factor or 0.0)
        with self.vae_on_device():
            images = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]
        return (images.float() * 0.5 + 0.5).clamp(0.0, 1.0)


def default_size(transformer_config: dict, vae_scale_factor: int) -> dict[str, int]:
    """The size StableDiffusion3Pipeline samples at when given none: the checkpoint's,
    ``transformer_config["sample_size"] * vae_scale_factor`` (its default_sample_size is the
    transformer's sample_size)."""
    side = int(transformer_config.get("sample_size") or 128) * vae_scale_factor
    return {"height": side, "width": side}


def _check_sizes(options: SD3Options, vae_scale_factor: int, patch_size: int) -> None:
    multiple = vae_scale_factor * patch_size
    why = f"VAE factor {vae_scale_factor} x patch size {patch_size}"
    check_divisible(options.height, multiple, "height", "sd3", why)
    check_divisible(options.width, multiple, "width", "sd3", why)


def _check_scheduler_config(config: dict) -> None:
    flags = [name for name in _UNSUPPORTED_SCHEDULER_FLAGS if config.get(name)]
    if flags:
        raise ValueError(f"sd3 scheduler config sets {flags}, which this adapter does not reproduce; "
                         "use a static-shift FlowMatchEulerDiscreteScheduler config")
