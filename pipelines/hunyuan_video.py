"""HunyuanVideo text-to-video (``hunyuanvideo-community/HunyuanVideo``) as a FlowModel.

Family quirks, all checked against ``HunyuanVideoPipeline`` (diffusers' HunyuanVideo 1.0
pipeline; HunyuanVideo-1.5 has its own pipeline, Qwen2.5-VL + ByT5 text, and is not this family):

- text: a Llama (LLaVA-Llama-3) encoder reads the prompt inside a fixed video-description
  template; its third-to-last hidden states, with the template's leading 95 tokens cropped, are
  the per-token text (B, L, 4096) with an attention mask (B, L) (L = max_sequence_length, right
  padding); a CLIP-L text model's pooled output (B, 768) is the pooled projection;
- video latents (B, 16, (F - 1)/4 + 1, H/8, W/8) as Wan's (``WanModel``'s layout and initial
  noise); the frame count F must be 4k + 1 (causal VAE); height/width divisible by 8 x patch 2;
- guidance-distilled like FLUX.1-dev: ``velocity(..., guidance_scale)`` feeds the guidance
  embedding with 1000 x guidance_scale (the pipeline's default scale 6.0), one forward per step,
  no real CFG (the pipeline's optional true_cfg_scale with a negative prompt is not supported);
- transformer timestep = 1000 sigma; schedule: the pipeline passes sigmas linspace(1, 0, N + 1)
  without its last point to the FlowMatchEulerDiscreteScheduler, which applies its static
  ``shift`` (7.0 in the checkpoint's scheduler config) and appends 0, i.e.
  shift(linspace(1, 0, N + 1)) (``shifted_linear_sigmas``; DanceGRPO's ``sd3_time_shift``);
- decode: latents / scaling_factor (0.476986), then the VAE; videos come back as
  (B, F, 3, H, W) in [0, 1];
- the transformer is FLUX's MMDiT layout (double-stream blocks, then single-stream blocks with a
  fused proj_out) plus a token refiner on the text, so LoRA targets FLUX's module names.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flowgrpo.model import Conditioning
from pipelines.base import DiffusersFlowModel
from pipelines.flux import flux_lora_target_modules
from pipelines.options import (AdapterOptions, check_divisible, parse_options,
                               require_attention_backend, resolve_dtype, resolve_size,
                               text_model_dtype)
from pipelines.sources import check_pipeline_folder
from pipelines.wan import WanModel


@dataclass
class HunyuanVideoOptions(AdapterOptions):
    """HunyuanVideo T2V options (``load_model("hunyuan_video", path, options={...})``)."""

    height: int | None = field(default=None, metadata={"help": (
        "Video height in pixels; divisible by VAE factor 8 x patch 2 = 16. None = the size the "
        "stock HunyuanVideoPipeline samples at when not given one (720). DanceGRPO trains at 480.")})
    width: int | None = field(default=None, metadata={"help": (
        "Video width in pixels; divisible by 16. None = HunyuanVideoPipeline's default (1280).")})
    num_frames: int | None = field(default=None, metadata={"help": (
        "Frames per video; must be 4k + 1 (the VAE encodes the first frame alone, then groups of "
        "4). None = HunyuanVideoPipeline's default (129). DanceGRPO trains on 53-frame clips.")})
    max_sequence_length: int = field(default=256, metadata={"help": (
        "Llama tokens per prompt after the template (HunyuanVideoPipeline's default: 256).")})
    flow_shift: float | None = field(default=None, metadata={"help": (
        "Static shift of the sigma schedule; None = the checkpoint's scheduler config (shift 7.0 "
        "for hunyuanvideo-community/HunyuanVideo). DanceGRPO samples with shift 5.")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_sequence_length < 1:
            raise ValueError(f"options.max_sequence_length must be >= 1 (got {self.max_sequence_length})")
        if self.flow_shift is not None and not self.flow_shift > 0:
            raise ValueError(f"options.flow_shift must be > 0 (got {self.flow_shift})")


def default_size() -> dict[str, int]:
    """(height, width, num_frames) that ``HunyuanVideoPipeline.__call__`` samples at by default
    (read from its signature, so it follows the installed diffusers: 720, 1280, 129 for 0.42)."""
    from diffusers import HunyuanVideoPipeline

    parameters = inspect.signature(HunyuanVideoPipeline.__call__).parameters
    return {name: int(parameters[name].default) for name in ("height", "width", "num_frames")}


class HunyuanVideoModel(DiffusersFlowModel):
    """HunyuanVideo T2V adapter. Build with ``HunyuanVideoModel.from_pretrained(path_or_hub_id, ...)``."""

    family = "hunyuan_video"
    options_class = HunyuanVideoOptions
    pipeline_class_path = "diffusers:HunyuanVideoPipeline"
    text_encoder_names = ("text_encoder", "text_encoder_2")
    has_real_cfg = False

    def __init__(self, transformer: torch.nn.Module, components: dict, options: HunyuanVideoOptions,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        options = resolve_size(options, default_size())
        targets = flux_lora_target_modules(transformer.config.num_single_layers)
        super().__init__(transformer, components, options, targets, device, dtype)
        vae_config = self.vae.config
        self.scale_factor_spatial = vae_config.spatial_compression_ratio
        self.scale_factor_temporal = vae_config.temporal_compression_ratio
        self.height, self.width, self.num_frames = options.height, options.width, options.num_frames
        _check_sizes(options, self.scale_factor_spatial, self.scale_factor_temporal,
                     transformer.config.patch_size, transformer.config.patch_size_t)
        self.scheduler_config = dict(components["scheduler"].config)
        _check_scheduler(self.scheduler_config)
        self.shift = float(options.flow_shift if options.flow_shift is not None
                           else self.scheduler_config.get("shift", 1.0))

    # ---------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu",
                        options: HunyuanVideoOptions | dict | None = None) -> "HunyuanVideoModel":
        """Load every component with its class's ``from_pretrained(path, subfolder=...)``.
        Options, folder contents, video size and frame count are validated before any weights
        load."""
        from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler,
                               HunyuanVideoTransformer3DModel)
        from transformers import AutoTokenizer, CLIPTextModel, LlamaModel

        options = parse_options(HunyuanVideoOptions, options, cls.family)
        require_attention_backend(options.attention_backend)
        check_pipeline_folder(path_or_hub_id, {
            "transformer": "config.json", "vae": "config.json", "scheduler": "scheduler_config.json",
            "text_encoder": "config.json", "text_encoder_2": "config.json",
            "tokenizer": "tokenizer_config.json", "tokenizer_2": "tokenizer_config.json"}, cls.family)
        transformer_config = HunyuanVideoTransformer3DModel.load_config(path_or_hub_id,
                                                                        subfolder="transformer")
        vae_config = AutoencoderKLHunyuanVideo.load_config(path_or_hub_id, subfolder="vae")
        _check_scheduler(FlowMatchEulerDiscreteScheduler.load_config(path_or_hub_id, subfolder="scheduler"))
        options = resolve_size(options, default_size())
        _check_sizes(options, vae_config.get("spatial_compression_ratio", 8),
                     vae_config.get("temporal_compression_ratio", 4),
                     transformer_config.get("patch_size", 2), transformer_config.get("patch_size_t", 1))

        text_dtype = resolve_dtype(options.text_encoder_dtype, dtype)
        components = {
            "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(path_or_hub_id,
                                                                         subfolder="scheduler"),
            "vae": AutoencoderKLHunyuanVideo.from_pretrained(
                path_or_hub_id, subfolder="vae", torch_dtype=resolve_dtype(options.vae_dtype, dtype)),
            "text_encoder": LlamaModel.from_pretrained(path_or_hub_id, subfolder="text_encoder",
                                                       **text_model_dtype(text_dtype)),
            "text_encoder_2": CLIPTextModel.from_pretrained(path_or_hub_id, subfolder="text_encoder_2",
                                                            **text_model_dtype(text_dtype)),
            "tokenizer": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer"),
            "tokenizer_2": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_2"),
        }
        transformer = HunyuanVideoTransformer3DModel.from_pretrained(path_or_hub_id, subfolder="transformer",
                                                                     torch_dtype=dtype)
        return cls(transformer, components, options, device=device, dtype=dtype)

    # ---------------------------------------------------------------------------- FlowModel
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, L, D_llama), "prompt_attention_mask": (B, L) (1 = token),
        "pooled_prompt_embeds": (B, D_clip)} by the stock pipeline's ``encode_prompt`` (its
        default template; on a text-only pipeline: encoding needs no transformer)."""
        pipeline = self.pipeline_class(transformer=None, **self.components)
        prompt_embeds, pooled, mask = pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.options.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "prompt_attention_mask": mask.to(torch.float32),
                "pooled_prompt_embeds": pooled}

    # Wan's video latent layout, read from the same attributes (denoiser in_channels, VAE factors,
    # frames and size): (C, (F - 1)/4 + 1, H/8, W/8) and float32 standard normal noise.
    latent_shape = WanModel.latent_shape
    initial_noise = WanModel.initial_noise

    def sigmas(self, num_steps: int) -> Tensor:
        """(num_steps + 1,) float32: shift(linspace(1, 0, N + 1)) with ``self.shift``
        (``shifted_linear_sigmas``), the shift computed in float32 as HunyuanVideoPipeline's
        scheduler does on the float32 grid it is given: bit-identical sigmas and timesteps (the
        float64 route differs by an ulp, 6e-5 in the timestep)."""
        from flowgrpo.sde import shift_sigma, shifted_linear_sigmas

        grid = shifted_linear_sigmas(num_steps, 1.0)   # shift 1: the plain linspace(1, 0, N + 1)
        return shift_sigma(grid, self.shift)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, C, F', h, w) float32 at ``latents`` and per-sample sigma (B,); transformer
        timestep = 1000 sigma, guidance embedding = 1000 guidance_scale; one forward."""
        batch = latents.shape[0]
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        guidance = torch.full((batch,), float(guidance_scale), device=self.device, dtype=self.dtype) * 1000.0
        text = cond.positive
        return self.transformer(
            hidden_states=latents.to(self.device, self.dtype), timestep=1000.0 * sigma,
            encoder_hidden_states=text["prompt_embeds"].to(self.device, self.dtype),
            encoder_attention_mask=text["prompt_attention_mask"].to(self.device, self.dtype),
            pooled_projections=text["pooled_prompt_embeds"].to(self.device, self.dtype),
            guidance=guidance, return_dict=False)[0].float()

    def decode(self, latents: Tensor) -> Tensor:
        """Videos (B, F, 3, H, W) float32 in [0, 1] from latents (B, C, F', h, w)."""
        z = latents.to(self.device, torch.float32) / self.vae.config.scaling_factor
        with self.vae_on_device():
            videos = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]   # (B, 3, F, H, W)
        return (videos.float().permute(0, 2, 1, 3, 4) * 0.5 + 0.5).clamp(0.0, 1.0)


# Scheduler settings that would change the sigmas HunyuanVideoPipeline steps through; the adapter
# reproduces the static shift only.
_UNSUPPORTED_SCHEDULER_SETTINGS = ("use_dynamic_shifting", "shift_terminal", "use_karras_sigmas",
                                   "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas")


def _check_scheduler(config: dict) -> None:
    """Refuse a scheduler config whose schedule is not shift(linspace(1, 0, N + 1))."""
    used = [name for name in _UNSUPPORTED_SCHEDULER_SETTINGS if config.get(name)]
    if used:
        raise ValueError(f"hunyuan_video: the checkpoint's scheduler config sets {used}; the adapter "
                         "reproduces HunyuanVideoPipeline's static-shift schedule only (set them "
                         "off in scheduler/scheduler_config.json, or use options.flow_shift)")


def _check_sizes(options: HunyuanVideoOptions, spatial: int, temporal: int, patch: int,
                 patch_t: int) -> None:
    why = f"VAE factor {spatial} x patch size {patch}"
    check_divisible(options.height, spatial * patch, "height", "hunyuan_video", why)
    check_divisible(options.width, spatial * patch, "width", "hunyuan_video", why)
    frames = options.num_frames
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % temporal:
        lower = max(frames - (frames - 1) % temporal, 1) if isinstance(frames, int) and frames >= 1 else 1
        raise ValueError(f"options.num_frames must be {temporal}k + 1 for hunyuan_video (the VAE encodes "
                         f"the first frame alone, then groups of {temporal}); got {frames!r}, try "
                         f"{lower} or {lower + temporal}")
    latent_frames = (frames - 1) // temporal + 1
    if latent_frames % patch_t:
        raise ValueError(f"options.num_frames gives {latent_frames} latent frames, not divisible by "
                         f"the transformer's temporal patch size {patch_t}")
