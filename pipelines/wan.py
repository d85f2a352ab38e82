"""Wan2.1 and Wan2.2 text-to-video (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``,
``Wan-AI/Wan2.2-T2V-A14B-Diffusers``) as a FlowModel.

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
  (B, F, 3, H, W) in [0, 1];
- Wan2.2 (model_index.json with ``boundary_ratio`` and a ``transformer_2``): two experts of one
  architecture, ``transformer`` for high noise and ``transformer_2`` for low noise; a step whose
  timestep t = 1000 sigma is >= boundary_ratio * num_train_timesteps runs the first, any other the
  second, with ``guidance_scale_2`` (default: the same scale) as the low-noise expert's CFG scale.
  Both live in one ``WanExperts`` module (``pipelines/wan22.py``), the adapter's
  ``transformer``: what the optimiser trains and DDP / checkpoints see; its forward picks the
  expert per row. ``train_experts`` chooses which experts carry LoRA / train. LoRA is written as
  one file per trained expert, each loadable by the stock pipeline (``load_wan22_lora``). Wan2.2's
  TI2V-5B (``expand_timesteps``) and image-to-video pipelines are not supported.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from flowgrpo.model import Conditioning, guided_velocity
from pipelines.base import DiffusersFlowModel
from pipelines.options import (AdapterOptions, check_divisible, parse_options,
                               require_attention_backend, resolve_dtype, resolve_size,
                               text_model_dtype)
from pipelines.sources import check_pipeline_folder, is_local_path, read_model_index
from pipelines.training import LORA_WEIGHTS_NAME
from pipelines.wan22 import (EXPERT_NAMES, LOW_NOISE_LORA_WEIGHTS_NAME, TRAIN_EXPERTS, WanExperts,
                             check_pipeline_index, check_wan22_options, expert_state,
                             save_expert_lora, save_experts_full)

# PEFT targets: self-attention (attn1) and text cross-attention (attn2) projections and the
# feed-forward of every block.
WAN_LORA_TARGET_MODULES = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                           "ffn.net.0.proj", "ffn.net.2"]



@dataclass
class WanOptions(AdapterOptions):
    """Wan2.1 / Wan2.2 T2V options (``load_model("wan", path, options={...})``)."""

    height: int | None = field(default=None, metadata={"help": (
        "Video height in pixels; divisible by VAE factor 8 x patch 2 = 16. None = the size the stock "
        "WanPipeline samples at when not given one (480; the checkpoint folder records none). "
        "Wan2.1-1.3B is a 480p model, Wan2.2-A14B samples 480p or 720p.")})
    width: int | None = field(default=None, metadata={"help": (
        "Video width in pixels; divisible by 16. None = WanPipeline's default (832).")})
    num_frames: int | None = field(default=None, metadata={"help": (
        "Frames per video; must be 4k + 1 (the VAE encodes the first frame alone, then groups of "
        "4). None = WanPipeline's default (81). Flow-GRPO trains Wan2.1-1.3B on 33-frame clips.")})
    cfg: bool = field(default=True, metadata={"help": (
        "Encode the negative prompt so that velocity() can run classifier-free guidance "
        "(guidance_scale > 1; WanPipeline's default is 5.0).")})
    negative_prompt: str = field(default="", metadata={"help": "The CFG negative prompt."})
    max_sequence_length: int = field(default=512, metadata={"help": (
        "UMT5 tokens per prompt (WanPipeline's default: 512).")})
    flow_shift: float | None = field(default=None, metadata={"help": (
        "Timestep shift of the sigma schedule; None = the checkpoint's scheduler config "
        "(flow_shift, or shift). Wan recommends 3.0 for 480p and 5.0 for 720p (Wan2.1); Wan2.2's "
        "own sampler uses 12.0 for T2V-A14B.")})
    guidance_scale_2: float | None = field(default=None, metadata={"help": (
        "Wan2.2 only: the CFG scale of the low-noise expert's steps (WanPipeline's "
        "guidance_scale_2); None = the guidance_scale velocity() is given, for every step. "
        "Wan2.2-T2V-A14B's release samples with 4.0 (high noise) and 3.0 (low noise). CFG itself "
        "runs only when guidance_scale > 1, as in the pipeline.")})
    train_experts: str | None = field(default=None, metadata={"help": (
        "Wan2.2 only: which experts LoRA wraps / full fine-tuning trains: 'both', 'high' "
        "(transformer, steps with t >= boundary) or 'low' (transformer_2). With one expert, the "
        "plan must train only that expert's steps. None = 'both' (Wan2.1: its one transformer).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_sequence_length < 1:
            raise ValueError(f"options.max_sequence_length must be >= 1 (got {self.max_sequence_length})")
        if self.flow_shift is not None and self.flow_shift <= 0:
            raise ValueError(f"options.flow_shift must be > 0 (got {self.flow_shift})")
        if self.train_experts is not None and self.train_experts not in TRAIN_EXPERTS:
            raise ValueError(f"options.train_experts must be one of {list(TRAIN_EXPERTS)} or None "
                             f"(got {self.train_experts!r})")
        if self.guidance_scale_2 is not None and self.guidance_scale_2 < 0:
            raise ValueError(f"options.guidance_scale_2 must be >= 0 or None (got {self.guidance_scale_2})")


def pipeline_default_size() -> tuple[int, int, int]:
    """(height, width, num_frames) that ``WanPipeline.__call__`` samples at by default (read from
    its signature, so it follows the installed diffusers: 480, 832, 81 for 0.42)."""
    from diffusers import WanPipeline

    parameters = inspect.signature(WanPipeline.__call__).parameters
    return tuple(int(parameters[name].default) for name in ("height", "width", "num_frames"))


def default_size() -> dict[str, int]:
    """The size ``WanPipeline.__call__`` samples at when given none."""
    return dict(zip(("height", "width", "num_frames"), pipeline_default_size()))


def video_size(options: WanOptions) -> tuple[int, int, int]:
    """(height, width, num_frames): the options, WanPipeline's defaults where None."""
    resolved = resolve_size(options, default_size())
    return resolved.height, resolved.width, resolved.num_frames


def load_scheduler(path_or_hub_id: str):
    """The scheduler of a pipeline folder, as the class its config names."""
    import diffusers

    config = diffusers.FlowMatchEulerDiscreteScheduler.load_config(path_or_hub_id, subfolder="scheduler")
    name = config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    scheduler_class = getattr(diffusers, name, None)
    if scheduler_class is None:
        raise ValueError(f"wan scheduler config names an unknown class {name!r}")
    return scheduler_class.from_config(config)


def read_pipeline_index(path_or_hub_id: str) -> dict:
    """model_index.json of a local folder, or of a hub id (fetched with WanPipeline.load_config:
    the index decides Wan2.1 vs Wan2.2 before any weights load)."""
    if is_local_path(path_or_hub_id):
        return read_model_index(path_or_hub_id)
    from diffusers import WanPipeline

    return dict(WanPipeline.load_config(path_or_hub_id))


class WanModel(DiffusersFlowModel):
    """Wan2.1 / Wan2.2 T2V adapter. Build with ``WanModel.from_pretrained(path_or_hub_id, ...)``.
    For Wan2.2, ``transformer`` is a ``WanExperts`` and ``boundary_ratio`` is set."""

    family = "wan"
    options_class = WanOptions
    pipeline_class_path = "diffusers:WanPipeline"
    text_encoder_names = ("text_encoder",)
    has_real_cfg = True

    def __init__(self, transformer: torch.nn.Module, components: dict, options: WanOptions,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.boundary_ratio = transformer.boundary_ratio if isinstance(transformer, WanExperts) else None
        super().__init__(transformer, components, options, WAN_LORA_TARGET_MODULES, device, dtype)
        # Wan2.2: a replay batch runs one expert, so the other's parameters get no gradient in
        # that backward (DDP must look for unused parameters; the trainer reads this).
        self.may_skip_parameters = self.boundary_ratio is not None
        check_wan22_options(options, self.boundary_ratio is not None)
        vae_config = self.vae.config
        self.height, self.width, self.num_frames = video_size(options)
        _check_sizes(self.height, self.width, self.num_frames, vae_config.scale_factor_spatial,
                     vae_config.scale_factor_temporal, tuple(self.denoisers()[0].config.patch_size))
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
        """Load every component with its class's ``from_pretrained(path, subfolder=...)``; a
        Wan2.2 folder (boundary_ratio and transformer_2 in model_index.json) loads both experts
        into a ``WanExperts``. Options, folder contents, pipeline variant, video size and frame
        count are validated before any weights load."""
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import AutoTokenizer, UMT5EncoderModel

        options = parse_options(WanOptions, options, cls.family)
        require_attention_backend(options.attention_backend)
        required = {"transformer": "config.json", "vae": "config.json",
                    "scheduler": "scheduler_config.json", "text_encoder": "config.json",
                    "tokenizer": "tokenizer_config.json"}
        index = read_pipeline_index(path_or_hub_id)
        two_experts = check_pipeline_index(index, path_or_hub_id)
        if two_experts:
            required["transformer_2"] = "config.json"
        check_pipeline_folder(path_or_hub_id, required, cls.family)
        check_wan22_options(options, two_experts)
        transformer_config = WanTransformer3DModel.load_config(path_or_hub_id, subfolder="transformer")
        vae_config = AutoencoderKLWan.load_config(path_or_hub_id, subfolder="vae")
        _check_sizes(*video_size(options), vae_config.get("scale_factor_spatial", 8),
                     vae_config.get("scale_factor_temporal", 4), tuple(transformer_config["patch_size"]))

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
        if two_experts:
            transformer = WanExperts(
                transformer,
                WanTransformer3DModel.from_pretrained(path_or_hub_id, subfolder="transformer_2",
                                                      torch_dtype=dtype),
                boundary_ratio=float(index["boundary_ratio"]),
                num_train_timesteps=int(components["scheduler"].config.get("num_train_timesteps", 1000)),
                train_experts=options.train_experts or "both")
        return cls(transformer, components, options, device=device, dtype=dtype)

    def to_pipeline(self) -> Any:
        """The stock WanPipeline on this adapter's components (no copies); for Wan2.2 with both
        experts and the boundary."""
        if self.boundary_ratio is None:
            return super().to_pipeline()
        return self.pipeline_class(transformer=self.transformer.transformer,
                                   transformer_2=self.transformer.transformer_2,
                                   boundary_ratio=self.boundary_ratio, **self.components)

    # ---------------------------------------------------------------------------- FlowModel
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, max_sequence_length, D)} by the stock pipeline's ``encode_prompt``
        (on a text-only pipeline: encoding needs no transformer)."""
        prompt_embeds, _ = self.pipeline_class(**self.components).encode_prompt(
            prompt=prompts, negative_prompt=None, do_classifier_free_guidance=False,
            max_sequence_length=self.options.max_sequence_length, device=self.device)
        return {"prompt_embeds": prompt_embeds}

    def negative_prompt(self) -> str | None:
        return self.options.negative_prompt if self.options.cfg else None

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F', h, w) of one video latent: F' = (F - 1)/4 + 1, h = H/8, w = W/8."""
        return (self.denoisers()[0].config.in_channels,
                (self.num_frames - 1) // self.scale_factor_temporal + 1,
                self.height // self.scale_factor_spatial,
                self.width // self.scale_factor_spatial)

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

    def high_noise_steps(self, sigmas: Tensor) -> Tensor:
        """Wan2.2: (N,) bool, the steps at ``sigmas`` (N,) that the high-noise expert runs
        (1000 sigma >= boundary, as WanPipeline decides on its timesteps)."""
        if self.boundary_ratio is None:
            raise ValueError("wan: high_noise_steps is for Wan2.2 checkpoints (two experts)")
        return self.transformer.uses_high_noise(1000.0 * sigmas.to(torch.float32).reshape(-1))

    def _guidance(self, timestep: Tensor, guidance_scale: float) -> float | Tensor:
        """The CFG scale per row: ``guidance_scale``, or for Wan2.2 with guidance_scale_2 set
        that scale on the low-noise expert's rows (B,)."""
        scale_2 = self.options.guidance_scale_2
        if self.boundary_ratio is None or scale_2 is None or scale_2 == guidance_scale:
            return float(guidance_scale)
        high = self.transformer.uses_high_noise(timestep)
        if bool(high.all()):
            return float(guidance_scale)
        if not bool(high.any()):
            return float(scale_2)
        return torch.where(high, float(guidance_scale), float(scale_2)).to(torch.float32)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, C, F', h, w) float32 at ``latents`` and per-sample sigma (B,); transformer
        timestep = 1000 sigma (Wan2.2: each row runs its expert). CFG (guidance_scale > 1):
        ``guided_velocity`` (one forward over [negative; positive] unless training.cfg_gradient
        splits them), combined in float32 as v_neg + g (v_pos - v_neg), g the row's scale
        (Wan2.2: guidance_scale_2 on low-noise rows when set)."""
        batch = latents.shape[0]
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        use_cfg = self._use_cfg(cond, guidance_scale)
        hidden = latents.to(self.device, self.dtype)
        timestep = 1000.0 * sigma
        positive = {"prompt_embeds": cond.positive["prompt_embeds"].to(self.device, self.dtype)}

        def forward(hidden: Tensor, timestep: Tensor, text: dict[str, Tensor]) -> Tensor:
            return self.transformer(hidden_states=hidden, timestep=timestep,
                                    encoder_hidden_states=text["prompt_embeds"],
                                    return_dict=False)[0].float()

        if not use_cfg:
            return forward(hidden, timestep, positive)
        scale = self._guidance(timestep, guidance_scale)
        if isinstance(scale, Tensor):   # one scale per row: (B, 1, 1, 1, 1)
            scale = scale.view(-1, *([1] * (hidden.dim() - 1))).to(self.device)
        return guided_velocity(forward, hidden, timestep, positive, cond.negative, scale)

    def decode(self, latents: Tensor) -> Tensor:
        """Videos (B, F, 3, H, W) float32 in [0, 1] from latents (B, C, F', h, w)."""
        config = self.vae.config
        mean = torch.tensor(config.latents_mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1, 1)
        # divided by 1 / std, as the stock pipelines do: multiplying by std differs by float32
        # rounding, which the VAE amplifies to about 1e-5 in pixels
        z = latents.to(self.device, torch.float32) / (1.0 / std) + mean
        with self.vae_on_device():
            videos = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]   # (B, 3, F, H, W)
        return (videos.float().permute(0, 2, 1, 3, 4) * 0.5 + 0.5).clamp(0.0, 1.0)

    # ---------------------------------------------------------------------------- training
    def denoisers(self, module: torch.nn.Module | None = None) -> list[torch.nn.Module]:
        """The Wan transformers inside ``module`` (default: the adapter's): Wan2.2's two
        experts, high noise first, or the one transformer."""
        if module is not None and module is not self.transformer:
            return [module]
        if self.boundary_ratio is None:
            return [self.transformer]
        return [self.transformer.transformer, self.transformer.transformer_2]

    def trained_denoisers(self) -> list[torch.nn.Module]:
        """Wan2.2: the experts ``options.train_experts`` selects."""
        if self.boundary_ratio is None:
            return [self.transformer]
        return self.transformer.trained

    def lora_state_dict(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Wan2.2: each adapted expert's LoRA, keys prefixed with its name (``transformer.`` /
        ``transformer_2.``), as ``save_lora_weights`` splits them."""
        if self.boundary_ratio is None:
            return super().lora_state_dict(state_dict)
        from peft import get_peft_model_state_dict   # peft takes seconds to import

        out: dict[str, Tensor] = {}
        for name, expert in zip(EXPERT_NAMES, self.denoisers()):
            if getattr(expert, "_hf_peft_config_loaded", False):
                part = get_peft_model_state_dict(expert, state_dict=expert_state(state_dict, name))
                out.update({f"{name}.{key}": value for key, value in part.items()})
        return out

    def save_full_weights(self, folder: str | os.PathLike,
                          state_dict: dict[str, Tensor] | None = None) -> None:
        """Wan2.2: both experts in the pipeline's layout (``folder/transformer``,
        ``folder/transformer_2``)."""
        if self.boundary_ratio is None:
            return super().save_full_weights(folder, state_dict)
        save_experts_full(self.transformer, folder, state_dict)

    # ---------------------------------------------------------------------------- LoRA files
    def lora_parts(self) -> list[tuple[str, torch.nn.Module]]:
        """(LoRA file, module) per part a checkpoint carries (``flowgrpo sample/eval/grid``):
        Wan2.2 has one file per expert (a checkpoint holds the files of the experts it trained)."""
        if self.boundary_ratio is None:
            return [(LORA_WEIGHTS_NAME, self.transformer)]
        return [(LORA_WEIGHTS_NAME, self.transformer.transformer),
                (LOW_NOISE_LORA_WEIGHTS_NAME, self.transformer.transformer_2)]

    def full_parts(self) -> list[tuple[str, object, str]]:
        """(checkpoint folder, owner, attribute) of the modules a full fine-tune replaces."""
        if self.boundary_ratio is None:
            return [("transformer", self, "transformer")]
        return [("transformer", self.transformer, "transformer"),
                ("transformer_2", self.transformer, "transformer_2")]

    def save_lora_weights(self, directory: str, transformer_lora_state_dict: dict[str, Tensor]) -> None:
        """Wan2.1: as every family (``pytorch_lora_weights.safetensors``). Wan2.2: one file per
        expert that has LoRA keys, ``pytorch_lora_weights.safetensors`` (high noise, loaded by
        ``pipe.load_lora_weights(directory)``) and ``pytorch_lora_weights_transformer_2.safetensors``
        (low noise, ``pipe.load_lora_weights(directory, weight_name=..., load_into_transformer_2=
        True)``); ``load_wan22_lora(pipe, directory)`` does both."""
        if self.boundary_ratio is None:
            return super().save_lora_weights(directory, transformer_lora_state_dict)
        if not transformer_lora_state_dict:
            raise ValueError("transformer_lora_state_dict is empty; pass model.lora_state_dict() "
                             "(peft.get_peft_model_state_dict of each expert)")
        save_expert_lora(self.pipeline_class, directory, self.transformer,
                         transformer_lora_state_dict)


def _check_sizes(height: int, width: int, frames: int, spatial: int, temporal: int,
                 patch_size: tuple[int, ...]) -> None:
    for name, value, patch in (("height", height, patch_size[1]), ("width", width, patch_size[2])):
        check_divisible(value, spatial * patch, name, "wan", f"VAE factor {spatial} x patch size {patch}")
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % temporal:
        lower = max(frames - (frames - 1) % temporal, 1) if isinstance(frames, int) and frames >= 1 else 1
        raise ValueError(f"options.num_frames must be {temporal}k + 1 for wan (the VAE encodes the first "
                         f"frame alone, then groups of {temporal}); got {frames!r}, try {lower} or "
                         f"{lower + temporal}")
