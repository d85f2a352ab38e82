"""Z-Image (``Tongyi-MAI/Z-Image-Turbo``, ``Tongyi-MAI/Z-Image``) text-to-image as a FlowModel.

Family quirks, all checked against ``ZImagePipeline`` (diffusers 0.42):

- text: Qwen3's second-to-last hidden states (``hidden_states[-2]``) of the prompt wrapped in the
  tokenizer's chat template (one user message, generation prompt, ``enable_thinking=True``),
  padded to ``max_sequence_length`` for the encoder and then cut to each prompt's own tokens: the
  transformer takes a *list* of per-prompt (L_i, D) features. Cached per prompt at its length,
  here as (B, L, D) zero-padded embeddings with a (B, L) mask (1 = token), as Qwen-Image's;
- latents: VAE latents (B, 16, H/8, W/8) as SD3's (the transformer patchifies 2x2 itself and
  takes a list of (C, 1, h, w) frames); the VAE is FLUX.1's layout (scaling and shift factor);
- transformer timestep = 1 - sigma (the pipeline's ``(1000 - t) / 1000`` with t = 1000 sigma),
  and its output is minus the velocity (the pipeline negates it before the Euler step);
- schedule: sigmas = linspace(1, 1/N, N) through the checkpoint's
  ``FlowMatchEulerDiscreteScheduler`` with mu from the patch token count (as Qwen-Image's):
  Z-Image-Turbo's config is a static shift 3.0 (no dynamic shifting), so a Turbo checkpoint
  samples its few-step schedule 3s / (1 + 2s) and whatever another checkpoint ships applies;
- CFG: the pipeline's ``guidance_scale`` s runs CFG when s > 0 as pos + s (pos - neg); here the
  framework's convention g = s + 1 (v_neg + g (v_pos - v_neg), CFG when g > 1), so Turbo's
  guidance 0 is 1.0 and the base model's 4 is 5.0. Its options ``cfg_normalization`` (cap the
  guided norm at k |v_pos| per sample) and ``cfg_truncation`` (no CFG where 1 - sigma exceeds
  it) are the pipeline's arguments of the same names.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flowgrpo.model import Conditioning, guidance_branches
from flowgrpo.sde import calculate_shift
from pipelines.base import DiffusersFlowModel
from pipelines.options import (AdapterOptions, check_divisible, parse_options,
                               require_attention_backend, resolve_dtype, resolve_size,
                               text_model_dtype)
from pipelines.sources import check_pipeline_folder, read_model_index
from pipelines.qwen_image import one_text_length
from pipelines.sd3 import SD3Model

# PEFT targets: the attention projections and the SwiGLU feed-forward of every
# ZImageTransformerBlock (the main layers and both refiners), Flow-Factory's default for
# Z-Image (src/flow_factory/models/z_image/z_image.py, default_target_modules).
Z_IMAGE_LORA_TARGET_MODULES = ["attention.to_q", "attention.to_k", "attention.to_v",
                               "attention.to_out.0", "feed_forward.w1", "feed_forward.w2",
                               "feed_forward.w3"]

# ZImagePipeline.__call__: ``height = height or 1024`` (and width): its default image size.
PIPELINE_DEFAULT_SIZE = 1024
# The transformer patch the pipeline runs (its forward's defaults patch_size=2, f_patch_size=1).
PATCH_SIZE, FRAME_PATCH_SIZE = 2, 1


@dataclass
class ZImageOptions(AdapterOptions):
    """Z-Image options (``load_model("z_image", path, options={...})``)."""

    height: int | None = field(default=None, metadata={"help": (
        "Image height in pixels; divisible by VAE factor x patch size 2 = 16. None = "
        "ZImagePipeline's default, 1024. Flow-Factory trains Z-Image(-Turbo) at 512.")})
    width: int | None = field(default=None, metadata={"help": (
        "Image width in pixels; divisible by 16. None = 1024 (as height).")})
    cfg: bool = field(default=True, metadata={"help": (
        "Encode the negative prompt so that velocity() can run classifier-free guidance "
        "(guidance_scale > 1 = the pipeline's guidance_scale > 0). Z-Image-Turbo samples "
        "without CFG (false saves the negative prompt's encoding); the base model with it.")})
    negative_prompt: str = field(default="", metadata={"help": (
        "The CFG negative prompt (ZImagePipeline's default: the empty prompt).")})
    max_sequence_length: int = field(default=512, metadata={"help": (
        "Tokens the prompt (with its chat template) is padded/truncated to before encoding "
        "(ZImagePipeline's default 512); the transformer then sees only the real tokens.")})
    cfg_normalization: float = field(default=0.0, metadata={"help": (
        "ZImagePipeline's cfg_normalization: > 0 caps each sample's guided velocity norm at "
        "this many times its conditional velocity's norm; 0 = off (the pipeline's False).")})
    cfg_truncation: float = field(default=1.0, metadata={"help": (
        "ZImagePipeline's cfg_truncation: CFG is off at steps where 1 - sigma exceeds it "
        "(values above 1 never truncate; 1.0 = the pipeline's default, never).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.max_sequence_length, bool) or self.max_sequence_length < 1:
            raise ValueError(f"options.max_sequence_length must be an int >= 1 "
                             f"(got {self.max_sequence_length})")
        for name in ("cfg_normalization", "cfg_truncation"):
            value = getattr(self, name)
            if not value >= 0.0 or value == float("inf"):
                raise ValueError(f"options.{name} must be a finite number >= 0 (got {value})")
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"options.{name} must be a positive int or None for the "
                                 f"pipeline's 1024 (got {value})")


def z_image_timestep(sigma: Tensor, num_train_timesteps: int = 1000) -> Tensor:
    """(B,) transformer timesteps for sigmas (B,): ZImagePipeline's ``(T - t) / T`` of the
    scheduler timestep t = T sigma, i.e. 1 - sigma (1 at data, 0 at noise)."""
    scale = float(num_train_timesteps)
    return (scale - scale * sigma) / scale


def z_image_guidance(v_neg: Tensor, v_pos: Tensor, guidance_scale: float, sigma: Tensor,
                     normalization: float = 0.0, truncation: float = 1.0) -> Tensor:
    """ZImagePipeline's CFG of the branches (B, ...) in the framework's scale g = s + 1:
    v_pos + (g - 1) (v_pos - v_neg) (= v_neg + g (v_pos - v_neg)); with ``normalization`` k > 0
    each sample whose guided norm exceeds k |v_pos| (norms over all its elements) is scaled
    down to it; rows whose 1 - sigma (B,) exceeds ``truncation`` (<= 1) take v_pos alone."""
    guided = v_pos + (guidance_scale - 1.0) * (v_pos - v_neg)
    if normalization > 0.0:
        pos_norm = torch.linalg.vector_norm(v_pos.flatten(1), dim=1)
        guided_norm = torch.linalg.vector_norm(guided.flatten(1), dim=1)
        limit = pos_norm * normalization
        factor = torch.where(guided_norm > limit, limit / guided_norm, torch.ones_like(limit))
        guided = guided * factor.view(-1, *[1] * (guided.dim() - 1))
    truncated = _truncated_rows(sigma, truncation)
    if bool(truncated.any()):
        guided = torch.where(truncated.view(-1, *[1] * (guided.dim() - 1)), v_pos, guided)
    return guided


def _truncated_rows(sigma: Tensor, truncation: float) -> Tensor:
    """(B,) bool: rows where the pipeline turns CFG off (1 - sigma > truncation <= 1)."""
    if truncation > 1.0:
        return torch.zeros(sigma.shape, dtype=torch.bool, device=sigma.device)
    return z_image_timestep(sigma) > truncation


class ZImageModel(DiffusersFlowModel):
    """Z-Image adapter. Build with ``ZImageModel.from_pretrained(path_or_hub_id, ...)``."""

    family = "z_image"
    options_class = ZImageOptions
    pipeline_class_path = "diffusers:ZImagePipeline"
    text_encoder_names = ("text_encoder",)
    has_real_cfg = True

    def __init__(self, transformer: torch.nn.Module, components: dict, options: ZImageOptions,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.vae_scale_factor = 2 ** (len(components["vae"].config.block_out_channels) - 1)
        options = _resolve_size(options, self.vae_scale_factor)
        super().__init__(transformer, components, options, Z_IMAGE_LORA_TARGET_MODULES, device, dtype)
        _check_transformer_config(dict(transformer.config))
        self.height, self.width = options.height, options.width
        self.scheduler_config = dict(components["scheduler"].config)
        _check_scheduler_config(self.scheduler_config)

    # ---------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu",
                        options: ZImageOptions | dict | None = None) -> "ZImageModel":
        """Load every component with its class's ``from_pretrained(path, subfolder=...)``.
        Options, folder contents, pipeline class, transformer variant, image size and scheduler
        are validated before any weights load."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen3Model

        options = parse_options(ZImageOptions, options, cls.family)
        require_attention_backend(options.attention_backend)
        check_pipeline_folder(path_or_hub_id, {
            "transformer": "config.json", "vae": "config.json", "scheduler": "scheduler_config.json",
            "text_encoder": "config.json", "tokenizer": "tokenizer_config.json"}, cls.family)
        pipeline_name = read_model_index(path_or_hub_id).get("_class_name", "ZImagePipeline")
        if pipeline_name != "ZImagePipeline":
            raise ValueError(f"z_image: {path_or_hub_id!r} is a {pipeline_name} folder; this adapter "
                             "is text-to-image (ZImagePipeline: Tongyi-MAI/Z-Image-Turbo or "
                             "Tongyi-MAI/Z-Image); Omni, ControlNet and image-to-image variants "
                             "need their own adapters")
        _check_transformer_config(ZImageTransformer2DModel.load_config(path_or_hub_id,
                                                                       subfolder="transformer"))
        vae_config = AutoencoderKL.load_config(path_or_hub_id, subfolder="vae")
        options = _resolve_size(options, 2 ** (len(vae_config["block_out_channels"]) - 1))
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path_or_hub_id, subfolder="scheduler")
        _check_scheduler_config(dict(scheduler.config))

        components = {
            "scheduler": scheduler,
            "vae": AutoencoderKL.from_pretrained(path_or_hub_id, subfolder="vae",
                                                 torch_dtype=resolve_dtype(options.vae_dtype, dtype)),
            "text_encoder": Qwen3Model.from_pretrained(
                path_or_hub_id, subfolder="text_encoder",
                **text_model_dtype(resolve_dtype(options.text_encoder_dtype, dtype))),
            "tokenizer": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer"),
        }
        transformer = ZImageTransformer2DModel.from_pretrained(path_or_hub_id, subfolder="transformer",
                                                               torch_dtype=dtype)
        return cls(transformer, components, options, device=device, dtype=dtype)

    # ---------------------------------------------------------------------------- prompts
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, L, D), "prompt_embeds_mask": (B, L) int64} from the stock
        pipeline's ``encode_prompt`` (its per-prompt list of real-token features, L = the longest
        of the batch, zero-padded, mask 0 on the padding)."""
        # A copy: the pipeline writes the templated prompts into the list it is given.
        features, _ = self.to_pipeline().encode_prompt(
            prompt=list(prompts), device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.options.max_sequence_length)
        length = max(f.shape[0] for f in features)
        embeds = features[0].new_zeros((len(features), length, features[0].shape[1]))
        mask = torch.zeros((len(features), length), dtype=torch.long, device=embeds.device)
        for row, feature in enumerate(features):
            embeds[row, :feature.shape[0]] = feature
            mask[row, :feature.shape[0]] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def negative_prompt(self) -> str | None:
        return self.options.negative_prompt if self.options.cfg else None

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """As ``DiffusersFlowModel.encode_prompts``, with the positive and negative embeddings
        brought to one length L (the longest prompt among them, zero-padded, mask 0), so that
        both CFG branches stack into one batch. positive/negative: {"prompt_embeds": (B, L, D),
        "prompt_embeds_mask": (B, L)}."""
        return one_text_length(super().encode_prompts(prompts))

    # ---------------------------------------------------------------------------- FlowModel
    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, H/8, W/8) of one latent (what ZImagePipeline.prepare_latents draws)."""
        return (self.transformer.config.in_channels, self.height // self.vae_scale_factor,
                self.width // self.vae_scale_factor)

    @property
    def packed_shape(self) -> tuple[int, int]:
        """(tokens, features) of one latent as the transformer patchifies it: (H/16 * W/16,
        4C); the token count sets the schedule's mu (``sigmas``)."""
        channels, height, width = self.latent_shape
        return ((height // PATCH_SIZE) * (width // PATCH_SIZE), channels * PATCH_SIZE ** 2)

    # (batch, C, H/8, W/8) float32 standard normal: SD3's layout and draw, the same as
    # ZImagePipeline.prepare_latents from the same generator.
    initial_noise = SD3Model.initial_noise
    def sigmas(self, num_steps: int) -> Tensor:
        """(num_steps + 1,) float32: ZImagePipeline's schedule, computed by the checkpoint's
        scheduler as the pipeline does: set_timesteps(sigmas=get_default_z_image_sigmas(N)
        (linspace(1, 1/N, N) in float32), mu linear in the token count); the scheduler applies
        the config's shift (Z-Image-Turbo: static 3.0, mu unused), then 0."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1 (got {num_steps!r})")
        config = self.scheduler_config
        mu = calculate_shift(self.packed_shape[0], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), mu=mu)
        return scheduler.sigmas.detach().to("cpu", torch.float32)
    # Images (B, 3, H, W) in [0, 1]: latents / scaling_factor + shift_factor through the VAE,
    # as SD3 (and ZImagePipeline's decode and "pt" postprocessing).
    decode = SD3Model.decode

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, C, h, w) float32 at ``latents`` (B, C, h, w) and per-sample sigma (B,):
        minus the transformer's output at timestep 1 - sigma, with each row's text cut to its
        own tokens. CFG (guidance_scale > 1, and not every row truncated): both branches
        through ``guidance_branches`` (one forward over [negative; positive] unless
        training.cfg_gradient splits them), combined by ``z_image_guidance``."""
        batch = latents.shape[0]
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        use_cfg = self._use_cfg(cond, guidance_scale)
        hidden = latents.to(self.device, self.dtype)
        timestep = z_image_timestep(sigma, int(self.scheduler_config.get("num_train_timesteps", 1000)))
        positive = {k: cond.positive[k] for k in ("prompt_embeds", "prompt_embeds_mask")}

        def forward(hidden: Tensor, timestep: Tensor, text: dict[str, Tensor]) -> Tensor:
            mask = text["prompt_embeds_mask"].to(self.device).bool()
            embeds = text["prompt_embeds"].to(self.device, self.dtype)
            captions = [embeds[row][mask[row]] for row in range(embeds.shape[0])]
            frames = list(hidden.unsqueeze(2).unbind(dim=0))       # (C, 1, h, w) each
            out = self.transformer(frames, timestep, captions, return_dict=False)[0]
            return -torch.stack([frame.float() for frame in out]).squeeze(2)

        if use_cfg and bool(_truncated_rows(sigma, self.options.cfg_truncation).all()):
            use_cfg = False          # the pipeline skips the unconditional forward there
        if not use_cfg:
            return forward(hidden, timestep, positive)
        v_neg, v_pos = guidance_branches(forward, hidden, timestep, positive, cond.negative)
        return z_image_guidance(v_neg, v_pos, guidance_scale, sigma, self.options.cfg_normalization,
                                self.options.cfg_truncation)


def _resolve_size(options: ZImageOptions, vae_scale_factor: int) -> ZImageOptions:
    """``options`` with height/width None set to the pipeline's 1024, both checked divisible
    by VAE factor x the transformer's 2x2 patch."""
    options = resolve_size(options, {"height": PIPELINE_DEFAULT_SIZE, "width": PIPELINE_DEFAULT_SIZE})
    why = f"VAE factor {vae_scale_factor} x patch size {PATCH_SIZE}"
    check_divisible(options.height, vae_scale_factor * PATCH_SIZE, "height", "z_image", why)
    check_divisible(options.width, vae_scale_factor * PATCH_SIZE, "width", "z_image", why)
    return options


def _check_transformer_config(config: dict) -> None:
    if config.get("siglip_feat_dim") is not None:
        raise ValueError("z_image transformer config sets siglip_feat_dim: the Omni variant, whose "
                         "forward needs SigLIP image features text-to-image sampling does not "
                         "give; use a Z-Image / Z-Image-Turbo checkpoint")
    pairs = list(zip(config.get("all_patch_size", (2,)), config.get("all_f_patch_size", (1,))))
    if (PATCH_SIZE, FRAME_PATCH_SIZE) not in pairs:
        raise ValueError(f"z_image transformer config has patch sizes {pairs} (all_patch_size, "
                         f"all_f_patch_size); ZImagePipeline runs patch ({PATCH_SIZE}, "
                         f"{FRAME_PATCH_SIZE}), which it lacks")


def _check_scheduler_config(config: dict) -> None:
    if config.get("invert_sigmas"):
        raise ValueError("z_image scheduler config sets invert_sigmas, which this adapter does "
                         "not reproduce (its schedule must run from 1 to 0); use the checkpoint's "
                         "FlowMatchEulerDiscreteScheduler config")
