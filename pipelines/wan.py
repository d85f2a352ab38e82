"""Wan2.1 text-to-video (e.g. ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``) as a FlowModel.

Family quirks, all checked against ``WanPipeline``:

- text: UMT5 per-token states (B, L, 4096), zeroed past each prompt's length;
- video latents (B, 16, (F - 1)/4 + 1, H/8, W/8); the frame count F must be 4k + 1 (causal VAE:
  the first frame alone, then groups of 4); height/width divisible by 8 x patch 2 = 16;
- transformer timestep = 1000 sigma; real CFG with a negative prompt, both branches in one
  batched forward (the pipeline runs them one after the other: same maths);
- schedule: the checkpoint ships a UniPC multistep scheduler with ``flow_shift`` (3.0 for 480p,
  5.0 for 720p). Our samplers are Euler/SDE steps, so ``sigmas`` is the
  FlowMatchEulerDiscreteScheduler schedule with the same shift (what ``WanPipeline`` computes
  when given ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)``);
- decode: latents * latents_std + latents_mean (per channel), then the VAE; videos come back as
  (B, F, 3, H, W) in [0, 1].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flowgrpo.model import Conditioning, guided_velocity
from pipelines.base import (AdapterOptions, DiffusersFlowModel, check_divisible,
                            check_pipeline_folder, parse_options, read_model_index,
                            require_attention_backend, resolve_dtype,
                            text_model_dtype)

# PEFT targets: self-attention (attn1) and text cross-attention (attn2) projections and the
# feed-forward of every block.
WAN_LORA_TARGET_MODULES = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                           "ffn.net.0.proj", "ffn.net.2"]


@dataclass
class WanOptions(AdapterOptions):
    """Wan2.1 T2V options (``load_model("wan", path, options={...})``)."""

    height: int = field(default=480, metadata={"help": (
        "Video height in pixels; divisible by VAE factor 8 x patch 2 = 16. Wan2.1-1.3B is a 480p model.")})
    width: int = field(default=832, metadata={"help": "Video width in pixels; divisible by 16."})
    num_frames: int = field(default=81, metadata={"help": (
        "Frames per video; must be 4k + 1 (the VAE encodes the first frame alone, then groups of "
        "4). Flow-GRPO trains Wan2.1-1.3B on 33-frame clips.")})
    cfg: bool = field(default=True, metadata={"help": (
        "Encode the negative prompt so that velocity() can run classifier-free guidance "
        "(guidance_scale > 1; WanPipeline's default is 5.0).")})
    negative_prompt: str = field(default="", metadata={"help": "The CFG negative prompt."})
    max_sequence_length: int = field(default=512, metadata={"help": (
        "UMT5 tokens per prompt (WanPipeline's default: 512).")})
    flow_shift: float | None = field(default=None, metadata={"help": (
        "Timestep shift of the sigma schedule; None = the checkpoint's scheduler config "
        "(flow_shift, or shift). Wan recommends 3.0 for 480p and 5.0 for 720p.")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_sequence_length < 1:
            raise ValueError(f"options.max_sequence_length must be >= 1 (got {self.max_sequence_length})")
        if self.flow_shift is not None and self.flow_shift <= 0:
            raise ValueError(f"options.flow_shift must be > 0 (got {self.flow_shift})")


def load_scheduler(path_or_hub_id: str):
    """The scheduler of a pipeline folder, as the class its config names."""
    import diffusers

    config = diffusers.FlowMatchEulerDiscreteScheduler.load_config(path_or_hub_id, subfolder="scheduler")
    name = config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    scheduler_class = getattr(diffusers, name, None)
    if scheduler_class is None:
        raise ValueError(f"wan scheduler config names an unknown class {name!r}")
    return scheduler_class.from_config(config)


class WanModel(DiffusersFlowModel):
    """Wan2.1 T2V adapter. Build with ``WanModel.from_pretrained(path_or_hub_id, ...)``."""

    family = "wan"
    pipeline_class_path = "diffusers:WanPipeline"
    text_encoder_names = ("text_encoder",)
    has_real_cfg = True

    def __init__(self, transformer: torch.nn.Module, components: dict, options: WanOptions,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__(transformer, components, options, WAN_LORA_TARGET_MODULES, device, dtype)
        vae_config = self.vae.config
        _check_sizes(options, vae_config.scale_factor_spatial, vae_config.scale_factor_temporal,
                     tuple(transformer.config.patch_size))
        self.scale_factor_spatial = vae_config.scale_factor_spatial
        self.scale_factor_temporal = vae_config.scale_factor_temporal
        self.scheduler_config = dict(components["scheduler"].config)
        if options.flow_shift is not None:
            self.shift = float(options.flow_shift)
        else:
            self.shift = float(self.scheduler_config.get("flow_shift", self.scheduler_config.get("shift", 1.0)))

    # ---------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu",
                        options: WanOptions | dict | None = None) -> "WanModel":
        """Load every component with its class's ``from_pretrained(path, subfolder=...)``.
        Options, folder contents, video size and frame count are validated before any weights load."""
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import AutoTokenizer, UMT5EncoderModel

        options = parse_options(WanOptions, options, cls.family)
        require_attention_backend(options.attention_backend)
        check_pipeline_folder(path_or_hub_id, {
            "transformer": "config.json", "vae": "config.json", "scheduler": "scheduler_config.json",
            "text_encoder": "config.json", "tokenizer": "tokenizer_config.json"}, cls.family)
        index = read_model_index(path_or_hub_id)
        if index.get("boundary_ratio") is not None or index.get("expand_timesteps"):
            raise ValueError("wan: this is a Wan2.2 pipeline (boundary_ratio/expand_timesteps set); the "
                             "adapter supports Wan2.1 text-to-video checkpoints")
        transformer_config = WanTransformer3DModel.load_config(path_or_hub_id, subfolder="transformer")
        vae_config = AutoencoderKLWan.load_config(path_or_hub_id, subfolder="vae")
        _check_sizes(options, vae_config.get("scale_factor_spatial", 8), vae_config.get("scale_factor_temporal", 4),
                     tuple(transformer_config["patch_size"]))

        components = {
            "scheduler": load_scheduler(path_or_hub_id),
            "vae": AutoencoderKLWan.from_pretrained(path_or_hub_id, subfolder="vae",
                                                    torch_dtype=resolve_dtype(options.vae_dtype, dtype)),
            "text_encoder": UMT5EncoderModel.from_pretrained(
                path_or_hub_id, subfolder="text_encoder",
                **text_model_dtype(resolve_dtype(options.text_encoder_dtype, dtype))),
            "tokenizer": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer"),
        }
        transformer = WanTransformer3DModel.from_pretrained(path_or_hub_id, subfolder="transformer",
                                                            torch_dtype=dtype)
        return cls(transformer, components, options, device=device, dtype=dtype)

    # ---------------------------------------------------------------------------- FlowModel
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, max_sequence_length, D)} by the stock pipeline's ``encode_prompt``."""
        prompt_embeds, _ = self.to_pipeline().encode_prompt(
            prompt=prompts, negative_prompt=None, do_classifier_free_guidance=False,
            max_sequence_length=self.options.max_sequence_length, device=self.device)
        return {"prompt_embeds": prompt_embeds}

    def negative_prompt(self) -> str | None:
        return self.options.negative_prompt if self.options.cfg else None

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F', h, w) of one video latent: F' = (F - 1)/4 + 1, h = H/8, w = W/8."""
        return (self.transformer.config.in_channels,
                (self.options.num_frames - 1) // self.scale_factor_temporal + 1,
                self.options.height // self.scale_factor_spatial,
                self.options.width // self.scale_factor_spatial)

    def initial_noise(self, batch: int, generator: torch.Generator | None) -> Tensor:
        """(batch, C, F', h, w) float32 standard normal, on the generator's device (else ``device``)."""
        device = generator.device if generator is not None else self.device
        return torch.randn((batch, *self.latent_shape), generator=generator, device=device,
                           dtype=torch.float32)

    def sigmas(self, num_steps: int) -> Tensor:
        """(num_steps + 1,) float32: static shift ``self.shift`` on diffusers' flow-matching grid
        (= FlowMatchEulerDiscreteScheduler(shift=flow_shift).set_timesteps(num_steps).sigmas)."""
        from flowgrpo.sde import static_shift_sigmas

        return static_shift_sigmas(num_steps, self.shift,
                                   int(self.scheduler_config.get("num_train_timesteps", 1000)))

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, C, F', h, w) float32 at ``latents`` and per-sample sigma (B,); transformer
        timestep = 1000 sigma. CFG (guidance_scale > 1): one forward over [negative; positive],
        combined in float32 as v_neg + g (v_pos - v_neg)."""
        batch = latents.shape[0]
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        use_cfg = self._use_cfg(cond, guidance_scale)
        hidden = latents.to(self.device, self.dtype)
        timestep = 1000.0 * sigma
        def forward(hidden: Tensor, timestep: Tensor, text: dict[str, Tensor]) -> Tensor:
            return self.transformer(hidden_states=hidden, timestep=timestep,
                                    encoder_hidden_states=text["prompt_embeds"].to(self.device, self.dtype),
                                    return_dict=False)[0].float()

        return guided_velocity(forward, hidden, timestep,
                               {"prompt_embeds": cond.positive["prompt_embeds"]},
                               cond.negative if use_cfg else None, guidance_scale)

    def decode(self, latents: Tensor) -> Tensor:
        """Videos (B, F, 3, H, W) float32 in [0, 1] from latents (B, C, F', h, w)."""
        config = self.vae.config
        mean = torch.tensor(config.latents_mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1, 1)
        z = latents.to(self.device, torch.float32) * std + mean
        with self.vae_on_device():
            videos = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]   # (B, 3, F, H, W)
        return (videos.float().permute(0, 2, 1, 3, 4) * 0.5 + 0.5).clamp(0.0, 1.0)


def _check_sizes(options: WanOptions, spatial: int, temporal: int, patch_size: tuple[int, ...]) -> None:
    for name, value, patch in (("height", options.height, patch_size[1]), ("width", options.width, patch_size[2])):
        check_divisible(value, spatial * patch, name, "wan", f"VAE factor {spatial} x patch size {patch}")
    frames = options.num_frames
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % temporal:
        lower = max(frames - (frames - 1) % temporal, 1) if isinstance(frames, int) and frames >= 1 else 1
        raise ValueError(f"options.num_frames must be {temporal}k + 1 for wan (the VAE encodes the first "
                         f"frame alone, then groups of {temporal}); got {frames!r}, try {lower} or "
                         f"{lower + temporal}")
