"""FLUX.2 (``black-forest-labs/FLUX.2-klein-4B`` / ``-9B``, their ``-base-`` versions, and
``black-forest-labs/FLUX.2-dev``) text-to-image as a FlowModel.

One family, two variants told apart by the checkpoint's ``model_index.json`` ``_class_name``:

- ``Flux2KleinPipeline`` (klein): text = Qwen3's hidden states of layers (9, 18, 27), stacked per
  token: (B, L, 3 D); the prompt goes through Qwen3's chat template (user turn, generation prompt,
  thinking off). The transformer has no guidance embedding; the base checkpoints
  (``is_distilled`` false in model_index.json) sample with real CFG against the empty prompt,
  v = v_neg + g (v_pos - v_neg) when g > 1 (no rescale); the step-distilled ones
  (``is_distilled`` true) never run CFG;
- ``Flux2Pipeline`` (dev): text = Mistral-Small-3's hidden states of layers (10, 20, 30) of the
  prompt under the pipeline's system message, (B, L, 3 D); guidance-distilled: ``guidance_scale``
  feeds the transformer's guidance embedding (one forward, no real CFG), as FLUX.1-dev.

What both variants share, all checked against the stock pipelines:

- text is padded to ``max_sequence_length`` tokens (the pipelines pad to max_length and do not
  pass the mask to the transformer), text position ids (t, h, w, l) = (0, 0, 0, l);
- latents: the VAE's 32 channels at H/8 x W/8, patchified 2x2 into 128 channels and flattened:
  (B, H/16 * W/16, 128), each token's features ordered (channel, dy, dx) - the same layout as
  FLUX.1's packing (``pipelines.flux.pack_latents``), drawn differently: the pipeline draws its
  noise directly in the patchified shape (B, 128, H/16, W/16); image position ids
  (0, row, column, 0);
- the latents are normalised by the VAE's batch-norm statistics (per packed feature: running
  mean, sqrt(running var + eps)), undone before decoding;
- schedule: sigmas = linspace(1, 1/N, N) through the checkpoint's scheduler with
  mu = ``empirical_mu(tokens, N)``, BFL's fit that depends on the step count as well as the
  resolution, then 0;
- transformer timestep = sigma (the pipelines divide their 1000-scaled timesteps by 1000);
- size: without height/width options, the pipelines' default_sample_size 128 x the VAE factor.

FLUX.2's reference-image editing (``image=`` of both pipelines) is not supported here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from flowgrpo.model import Conditioning, guided_velocity
from pipelines.base import DiffusersFlowModel
from pipelines.options import (AdapterOptions, check_divisible, parse_options,
                               require_attention_backend, resolve_dtype, resolve_size,
                               text_model_dtype)
from pipelines.sources import check_pipeline_folder, is_local_path, read_model_index
from pipelines.flux import (FLUX_DOUBLE_BLOCK_TARGETS, default_size, latent_image_ids,
                            packed_region_mask, unpack_latents)

# PEFT targets. Double-stream blocks: FLUX.1's image and text attention projections and both
# SwiGLU feed-forwards (FLUX.2 names them linear_in / linear_out). Single-stream blocks: the fused
# q/k/v + MLP input (to_qkv_mlp_proj) and, listed per block by ``flux2_lora_target_modules`` (a
# bare 'attn.to_out' suffix would also match the double blocks' to_out ModuleList), the fused
# attention + MLP output (attn.to_out): the counterparts of FLUX.1's proj_mlp and proj_out.
FLUX2_DOUBLE_BLOCK_TARGETS = [t for t in FLUX_DOUBLE_BLOCK_TARGETS if t.startswith("attn.")] + [
    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"]
FLUX2_SINGLE_BLOCK_TARGETS = ["attn.to_qkv_mlp_proj"]

KLEIN_PIPELINE = "Flux2KleinPipeline"
DEV_PIPELINE = "Flux2Pipeline"
# Both pipelines' tokenizer_max_length.
TOKENIZER_MAX_LENGTH = 512


def flux2_lora_target_modules(num_single_layers: int) -> list[str]:
    """PEFT target names for a FLUX.2 transformer with ``num_single_layers`` single blocks."""
    return (FLUX2_DOUBLE_BLOCK_TARGETS + FLUX2_SINGLE_BLOCK_TARGETS
            + [f"single_transformer_blocks.{i}.attn.to_out" for i in range(num_single_layers)])


@dataclass(frozen=True)
class Flux2Variant:
    """What differs between FLUX.2's pipelines: the pipeline class, its text encoder and its
    tokenizer's loader (transformers class names), and how it guides."""

    pipeline: str
    text_encoder_class: str
    tokenizer_class: str
    guidance_embedding: bool     # True: guidance_scale feeds the transformer's embedding


VARIANTS = {
    KLEIN_PIPELINE: Flux2Variant(KLEIN_PIPELINE, "Qwen3ForCausalLM", "AutoTokenizer", False),
    DEV_PIPELINE: Flux2Variant(DEV_PIPELINE, "Mistral3ForConditionalGeneration", "AutoProcessor", True),
}


@dataclass
class Flux2Options(AdapterOptions):
    """FLUX.2 options (``load_model("flux2", path, options={...})``)."""

    height: int | None = field(default=None, metadata={"help": (
        "Image height in pixels; divisible by VAE factor x 2 (patchify) = 16. None = the "
        "pipelines' default, 128 x the checkpoint's VAE factor (1024). Flow-Factory trains "
        "FLUX.2-klein at 384.")})
    width: int | None = field(default=None, metadata={"help": (
        "Image width in pixels; divisible by 16. None = the pipelines' default (as height).")})
    max_sequence_length: int = field(default=512, metadata={"help": (
        "Text tokens per prompt, template included (<= 512, the pipelines' default): every prompt "
        "is padded to it.")})
    cfg: bool = field(default=True, metadata={"help": (
        "klein base checkpoints (is_distilled false): encode the negative prompt so that "
        "velocity() runs real classifier-free guidance when guidance_scale > 1 (the pipeline's "
        "rule). No effect on step-distilled klein or FLUX.2-dev, which have no real CFG.")})
    negative_prompt: str = field(default="", metadata={"help": (
        "The CFG negative prompt (Flux2KleinPipeline uses the empty prompt).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.max_sequence_length <= TOKENIZER_MAX_LENGTH:
            raise ValueError(f"options.max_sequence_length must be in [1, {TOKENIZER_MAX_LENGTH}] "
                             f"(got {self.max_sequence_length})")


# ------------------------------------------------------------------------------------ maths
def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The schedule shift mu of FLUX.2 for ``image_seq_len`` image tokens and ``num_steps``
    steps (BFL's empirical fit, as the pipelines compute it): above 4300 tokens mu is linear in
    the tokens alone (slope 1.6927e-4, intercept 0.45667, the fit at 200 steps); below, it is
    interpolated linearly in the step count between that fit and the 10-step one (slope
    8.7381e-5, intercept 1.89833), extrapolated outside [10, 200] steps."""
    at_200 = 0.00016927 * image_seq_len + 0.45666666
    if image_seq_len > 4300:
        return float(at_200)
    at_10 = 8.73809524e-05 * image_seq_len + 1.89833333
    slope = (at_200 - at_10) / 190.0
    return float(slope * num_steps + at_200 - 200.0 * slope)


def text_position_ids(length: int) -> Tensor:
    """(length, 4) int64 position ids (t, h, w, l) of the text tokens: (0, 0, 0, l)."""
    ids = torch.zeros(length, 4, dtype=torch.int64)
    ids[:, 3] = torch.arange(length)
    return ids


def image_position_ids(latent_height: int, latent_width: int) -> Tensor:
    """(h/2 * w/2, 4) int64 position ids (t, h, w, l) of the packed image tokens of a
    (h, w) VAE grid: (0, row, column, 0), row-major (FLUX.1's ids with a fourth, zero axis)."""
    ids = latent_image_ids(latent_height, latent_width).to(torch.int64)
    return torch.cat([ids, torch.zeros(len(ids), 1, dtype=torch.int64)], dim=1)


def packed_noise(noise: Tensor) -> Tensor:
    """Noise drawn in the patchified shape (B, 4C, h/2, w/2) as packed tokens (B, h/2 * w/2, 4C)
    (the pipelines' ``_pack_latents``)."""
    return noise.flatten(2).transpose(1, 2)


# ------------------------------------------------------------------------------------ adapter
class Flux2Model(DiffusersFlowModel):
    """FLUX.2 adapter (klein and dev). Build with ``Flux2Model.from_pretrained(path, ...)``."""

    family = "flux2"
    options_class = Flux2Options
    pipeline_class_path = f"diffusers:{KLEIN_PIPELINE}"    # set per checkpoint in __init__
    text_encoder_names = ("text_encoder",)
    has_real_cfg = False                                    # set per checkpoint in __init__

    def __init__(self, transformer: torch.nn.Module, components: dict, options: Flux2Options,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 variant: str = KLEIN_PIPELINE, is_distilled: bool = False) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"flux2 variant must be one of {sorted(VARIANTS)} (got {variant!r})")
        self.variant = VARIANTS[variant]
        self.pipeline_class_path = f"diffusers:{variant}"
        self.is_distilled = bool(is_distilled)
        self.has_real_cfg = variant == KLEIN_PIPELINE and not self.is_distilled
        self.vae_scale_factor = 2 ** (len(components["vae"].config.block_out_channels) - 1)
        options = resolve_size(options, default_size(self.vae_scale_factor))
        targets = flux2_lora_target_modules(transformer.config.num_single_layers)
        super().__init__(transformer, components, options, targets, device, dtype)
        _check_sizes(options, self.vae_scale_factor, transformer.config.patch_size)
        _check_transformer_config(dict(transformer.config), self.variant)
        self.scheduler_config = dict(components["scheduler"].config)
        _check_scheduler_config(self.scheduler_config)
        self.latent_height = options.height // self.vae_scale_factor
        self.latent_width = options.width // self.vae_scale_factor
        self.image_ids = image_position_ids(self.latent_height, self.latent_width).to(self.device)

    # ---------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu",
                        options: Flux2Options | dict | None = None) -> "Flux2Model":
        """Load every component with its class's ``from_pretrained(path, subfolder=...)``; the
        variant (klein or dev) and klein's ``is_distilled`` come from model_index.json.
        Options, folder contents, variant, transformer, image size and scheduler are validated
        before any weights load."""
        import transformers
        from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler,
                               Flux2Transformer2DModel)

        options = parse_options(Flux2Options, options, cls.family)
        require_attention_backend(options.attention_backend)
        check_pipeline_folder(path_or_hub_id, {
            "transformer": "config.json", "vae": "config.json", "scheduler": "scheduler_config.json",
            "text_encoder": "config.json", "tokenizer": "tokenizer_config.json"}, cls.family)
        index = _model_index(path_or_hub_id)
        variant_name = index.get("_class_name")
        if variant_name not in VARIANTS:
            raise ValueError(f"flux2: {path_or_hub_id!r} is a {variant_name} folder; this adapter "
                             f"loads text-to-image FLUX.2 checkpoints ({' or '.join(sorted(VARIANTS))})")
        variant = VARIANTS[variant_name]
        transformer_config = Flux2Transformer2DModel.load_config(path_or_hub_id, subfolder="transformer")
        _check_transformer_config(transformer_config, variant)
        vae_config = AutoencoderKLFlux2.load_config(path_or_hub_id, subfolder="vae")
        vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
        options = resolve_size(options, default_size(vae_scale_factor))
        _check_sizes(options, vae_scale_factor, transformer_config.get("patch_size", 1))
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path_or_hub_id,
                                                                    subfolder="scheduler")
        _check_scheduler_config(dict(scheduler.config))

        text_encoder_class = getattr(transformers, variant.text_encoder_class)
        tokenizer_class = getattr(transformers, variant.tokenizer_class)
        components = {
            "scheduler": scheduler,
            "vae": AutoencoderKLFlux2.from_pretrained(
                path_or_hub_id, subfolder="vae", torch_dtype=resolve_dtype(options.vae_dtype, dtype)),
            "text_encoder": text_encoder_class.from_pretrained(
                path_or_hub_id, subfolder="text_encoder",
                **text_model_dtype(resolve_dtype(options.text_encoder_dtype, dtype))),
            "tokenizer": tokenizer_class.from_pretrained(path_or_hub_id, subfolder="tokenizer"),
        }
        transformer = Flux2Transformer2DModel.from_pretrained(path_or_hub_id, subfolder="transformer",
                                                              torch_dtype=dtype)
        return cls(transformer, components, options, device=device, dtype=dtype,
                   variant=variant_name, is_distilled=bool(index.get("is_distilled", False)))

    def to_pipeline(self):
        """The stock pipeline on this adapter's components (klein's with its ``is_distilled``)."""
        extra = {"is_distilled": self.is_distilled} if self.variant.pipeline == KLEIN_PIPELINE else {}
        return self.pipeline_class(transformer=self.transformer, **self.components, **extra)

    # ---------------------------------------------------------------------------- prompts
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, max_sequence_length, 3 D)} by the stock pipeline's
        ``encode_prompt`` (its template / system message and hidden-state layers)."""
        embeds, _ = self.to_pipeline().encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.options.max_sequence_length)
        return {"prompt_embeds": embeds}

    def negative_prompt(self) -> str | None:
        return self.options.negative_prompt if self.has_real_cfg and self.options.cfg else None

    def _extra_conditioning(self, positive: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"text_ids": text_position_ids(positive["prompt_embeds"].shape[1]).to(self.device)}

    # ---------------------------------------------------------------------------- FlowModel
    @property
    def packed_shape(self) -> tuple[int, int]:
        """(tokens, features) of one packed latent: (H/16 * W/16, 4 C)."""
        tokens = (self.latent_height // 2) * (self.latent_width // 2)
        return tokens, self.transformer.config.in_channels

    def region_mask(self, mask: Tensor, resize: str = "area") -> Tensor:
        """An edit-region mask (B, 1, H, W) in [0, 1] on the packed latents' layout
        (B, H/16 * W/16, 4C) (``pipelines.flux.packed_region_mask``: FLUX.1's layout)."""
        return packed_region_mask(mask, self.latent_height, self.latent_width,
                                  self.transformer.config.in_channels // 4, resize)

    def initial_noise(self, batch: int, generator: torch.Generator | None) -> Tensor:
        """(batch, H/16 * W/16, 4C) float32: standard normal drawn in the patchified shape
        (batch, 4C, H/16, W/16), then flattened (what the pipelines' prepare_latents draws from
        the same generator in float32)."""
        device = generator.device if generator is not None else self.device
        tokens_h, tokens_w = self.latent_height // 2, self.latent_width // 2
        noise = torch.randn((batch, self.transformer.config.in_channels, tokens_h, tokens_w),
                            generator=generator, device=device, dtype=torch.float32)
        return packed_noise(noise)

    def sigmas(self, num_steps: int) -> Tensor:
        """(num_steps + 1,) float32: the pipelines' schedule, computed by the checkpoint's
        scheduler: set_timesteps(sigmas=linspace(1, 1/N, N), mu=empirical_mu(tokens, N)), then 0."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1 (got {num_steps!r})")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps),
                                mu=empirical_mu(self.packed_shape[0], num_steps))
        return scheduler.sigmas.detach().to("cpu", torch.float32)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning,
                 guidance_scale: float) -> Tensor:
        """Velocity (B, tokens, 4C) float32 at packed ``latents`` and per-sample sigma (B,);
        transformer timestep = sigma. dev: ``guidance_scale`` is the guidance embedding's value,
        one forward. klein base: real CFG v_neg + g (v_pos - v_neg) when g > 1 (both branches
        through ``guided_velocity``); step-distilled klein: one conditional forward."""
        batch = latents.shape[0]
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        text_ids = cond.extra.get("text_ids")
        if text_ids is None:
            text_ids = text_position_ids(cond.positive["prompt_embeds"].shape[1])
        text_ids = text_ids.to(self.device)
        embedded_guidance = self.transformer.config.guidance_embeds

        def forward(hidden: Tensor, timestep: Tensor, text: dict[str, Tensor]) -> Tensor:
            guidance = None
            if embedded_guidance:
                guidance = torch.full((hidden.shape[0],), float(guidance_scale), device=self.device,
                                      dtype=torch.float32)
            return self.transformer(
                hidden_states=hidden, timestep=timestep, guidance=guidance,
                encoder_hidden_states=text["prompt_embeds"].to(self.device, self.dtype),
                txt_ids=text_ids, img_ids=self.image_ids.to(self.device), return_dict=False)[0].float()

        negative = cond.negative if self._use_cfg(cond, guidance_scale) else None
        positive = {"prompt_embeds": cond.positive["prompt_embeds"]}
        return guided_velocity(forward, latents.to(self.device, self.dtype), sigma, positive,
                               negative, guidance_scale)

    def latent_statistics(self) -> tuple[Tensor, Tensor]:
        """(mean, std), each (4C,) float32: the VAE's batch-norm statistics per packed feature
        (running mean, sqrt(running var + batch_norm_eps)) that normalise FLUX.2's latents."""
        bn = self.vae.bn
        mean = bn.running_mean.detach().to(self.device, torch.float32)
        std = torch.sqrt(bn.running_var.detach().to(self.device, torch.float32)
                         + self.vae.config.batch_norm_eps)
        return mean, std

    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, 3, H, W) float32 in [0, 1] from packed latents (B, tokens, 4C): the
        batch-norm normalisation undone per feature, unpacked to the VAE grid, decoded."""
        mean, std = self.latent_statistics()
        tokens = latents.to(self.device, torch.float32) * std + mean
        z = unpack_latents(tokens, self.latent_height, self.latent_width)
        with self.vae_on_device():
            images = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]
        return (images.float() * 0.5 + 0.5).clamp(0.0, 1.0)


# ------------------------------------------------------------------------------------ checks
def _model_index(path_or_hub_id: str) -> dict:
    """model_index.json of a local folder, or of a hub id (through diffusers' config loader,
    which reads only that file)."""
    if is_local_path(path_or_hub_id):
        return read_model_index(path_or_hub_id)
    from diffusers import DiffusionPipeline

    return dict(DiffusionPipeline.load_config(path_or_hub_id))


def _check_sizes(options: Flux2Options, vae_scale_factor: int, patch_size: int) -> None:
    multiple = vae_scale_factor * 2 * patch_size
    why = f"VAE factor {vae_scale_factor} x 2x2 patchify x patch size {patch_size}"
    check_divisible(options.height, multiple, "height", "flux2", why)
    check_divisible(options.width, multiple, "width", "flux2", why)


def _check_transformer_config(config: dict, variant: Flux2Variant) -> None:
    """The transformer's guidance embedding must be what the variant's pipeline feeds: klein
    passes guidance=None (an embedding would be skipped silently), dev always passes one."""
    embeds = bool(config.get("guidance_embeds", True))
    if embeds != variant.guidance_embedding:
        feeds = "feeds" if variant.guidance_embedding else "never feeds"
        raise ValueError(f"flux2 transformer config has guidance_embeds={embeds}, but "
                         f"{variant.pipeline} {feeds} a guidance embedding; the checkpoint's "
                         "transformer does not belong to its pipeline class (check model_index.json "
                         "_class_name)")
    if config.get("in_channels", 128) % 4:
        raise ValueError(f"flux2 transformer in_channels must be 4 x VAE latent channels (2x2 "
                         f"patchify); got {config.get('in_channels')}")


def _check_scheduler_config(config: dict) -> None:
    for flag in ("use_flow_sigmas", "invert_sigmas"):
        if config.get(flag):
            raise ValueError(f"flux2 scheduler config sets {flag}, which this adapter does not "
                             "reproduce (its schedule is linspace(1, 1/N, N) shifted by mu); use the "
                             "checkpoint's FlowMatchEulerDiscreteScheduler config")


__all__ = ["DEV_PIPELINE", "FLUX2_DOUBLE_BLOCK_TARGETS", "FLUX2_SINGLE_BLOCK_TARGETS",
           "Flux2Model", "Flux2Options", "KLEIN_PIPELINE", "VARIANTS", "empirical_mu",
           "flux2_lora_target_modules", "image_position_ids", "packed_noise", "text_position_ids"]
