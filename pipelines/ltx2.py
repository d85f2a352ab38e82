"""LTX-2 text-to-audio+video (``Lightricks/LTX-2``) as a FlowModel.

LTX-2 generates a video and its soundtrack jointly: one transformer (``LTX2VideoTransformer3DModel``)
denoises video tokens and audio tokens together (each stream attends to the other), and
``LTX2Pipeline`` always samples both: its transformer takes no video-only call, and the pipeline
has no switch that leaves the audio out. So the adapter keeps the audio in the sample rather than
refusing it: a sample is the pipeline's two packed token sequences concatenated,
``[video tokens; audio tokens]`` (B, S_v + S_a, D), as Flow-Factory's ``ltx2_t2av`` adapter lays
them out. Everything the framework does to a sample (SDE steps, log-probabilities, ratios, KL)
therefore covers the audio tokens too (Flow-Factory steps the audio by ODE and scores the video
only; here the audio is part of the policy's action). ``decode`` returns the video;
``decode_audio`` the waveform, as the pipeline's vocoder makes it.

Family quirks, all checked against ``LTX2Pipeline`` (diffusers 0.42):

- text: Gemma-3 (``Gemma3ForConditionalGeneration``) reads the prompt left-padded to
  ``max_sequence_length`` (1024) with its BOS; every layer's hidden states (the embeddings and
  each decoder layer) are stacked per token, and the pipeline's ``LTX2TextConnectors`` turn them
  (masked per-row normalisation, a projection, a small transformer per stream) into the video
  and the audio text tokens and their mask. Both are computed per prompt by the pipeline's own
  ``encode_prompt`` and ``connectors`` and cached (the connectors count as a text encoder:
  offloaded and freed with Gemma);
- video latents: the VAE's 128 channels at 1/32 of the size and (F - 1)/8 + 1 latent frames,
  normalised per channel by the VAE's ``latents_mean`` / ``latents_std``, packed frame-major into
  (B, F' h w, 128) tokens (patch size 1); F = 8k + 1, sides divisible by 32 (the pipeline's check);
- audio latents: ``round(F / frame_rate x sample_rate / hop / 4)`` latent frames of the audio VAE's
  latent channels x mel bins / 4, normalised by the audio VAE's statistics, packed into
  (B, S_a, channels x mel bins / 4) tokens. The two streams' token widths must agree to share a
  sample: in LTX-2 both are 128 wide (the pipeline's default 128 audio input channels, and
  Flow-Factory concatenates the two sequences the same way), 4 in the tiny build; a checkpoint
  where they differ is refused at load;
- transformer timestep = 1000 sigma, passed as ``timestep`` and ``sigma`` as the pipeline does
  (one value for both streams, so the pipeline's ``use_cross_timestep`` changes nothing here);
  RoPE positions from the latent grid and the frame rate (``frame_rate``, the pipeline's 24);
- schedule: ``linspace(1, 1/N, N)`` through the checkpoint's scheduler with mu from the video
  token count (``calculate_shift`` over the scheduler config's 1024..4096 tokens, 0.95..2.05),
  which applies LTX-2's dynamic exponential shift and its terminal stretch (shift_terminal 0.1);
- CFG: the pipeline guides in x0 space with a delta, x0_pos + (g - 1)(x0_pos - x0_neg), which is
  linear in the velocity, i.e. v_neg + g (v_pos - v_neg): ``guided_velocity`` with the video's
  scale on the video tokens and ``audio_guidance_scale`` (default: the same) on the audio tokens;
  the negative prompt defaults to the pipeline's "". CFG runs when either scale exceeds 1, as the
  pipeline decides. Not reproduced: the pipeline's spatio-temporal guidance (``stg_scale``),
  modality-isolation guidance (``modality_scale``) and guidance rescale, which need extra
  forwards or are not linear; the parity tests set them off (stg 0, modality 1, rescale 0), as
  Flow-Factory's LTX-2 examples train. Also not supported: prompt enhancement, the duration head
  (``num_frames`` is always given), image-to-video, conditioning, IC-LoRA and the two-stage
  upsampling pipelines;
- decode: the video tokens unpacked to (B, 128, F', h, w), un-normalised, decoded by
  ``AutoencoderKLLTX2Video`` (with decode timestep 0 and no decode noise when the VAE is
  timestep-conditioned, the pipeline's defaults); videos (B, F, 3, H, W) in [0, 1].
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flowgrpo.model import Conditioning, guided_velocity
from pipelines.base import DiffusersFlowModel
from pipelines.options import (AdapterOptions, check_divisible, parse_options,
                               require_attention_backend, resolve_dtype, resolve_size,
                               text_model_dtype)
from pipelines.sources import check_pipeline_folder

# PEFT targets (Flow-Factory's ltx2 default list): per block, the video and audio self- and
# text cross-attention, both cross-modal attentions (audio -> video, video -> audio) and both
# feed-forwards; 28 linear layers a block.
LTX2_LORA_TARGET_MODULES = [
    f"{attention}.{projection}"
    for attention in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn",
                      "video_to_audio_attn")
    for projection in ("to_q", "to_k", "to_v", "to_out.0")
] + ["ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"]

# LTX2Pipeline samples 121 frames when given no num_frames and it has no duration head (LTX-2.0 /
# 2.3 checkpoints): its signature's default is None, resolved in __call__.
PIPELINE_NUM_FRAMES = 121
# The pipeline's check_inputs: "height and width have to be divisible by 32".
PIPELINE_SIZE_MULTIPLE = 32


@dataclass
class LTX2Options(AdapterOptions):
    """LTX-2 options (``load_model("ltx2", path, options={...})``)."""

    height: int | None = field(default=None, metadata={"help": (
        "Video height in pixels; divisible by 32 (LTX2Pipeline's check; the VAE's factor x patch "
        "size too). None = the size LTX2Pipeline samples at when not given one (512).")})
    width: int | None = field(default=None, metadata={"help": (
        "Video width in pixels; divisible by 32. None = LTX2Pipeline's default (768).")})
    num_frames: int | None = field(default=None, metadata={"help": (
        "Frames per video; must be 8k + 1 (the VAE's temporal factor 8: the first frame alone, "
        "then groups of 8). None = LTX2Pipeline's default for checkpoints without a duration head "
        "(121, 5 s at 24 fps). The audio lasts as long: num_frames / frame_rate seconds.")})
    frame_rate: float | None = field(default=None, metadata={"help": (
        "Frames per second: the video's RoPE positions and the audio's length follow it. None = "
        "LTX2Pipeline's default (24.0).")})
    cfg: bool = field(default=True, metadata={"help": (
        "Encode the negative prompt so that velocity() can run classifier-free guidance "
        "(guidance_scale > 1; LTX2Pipeline's default is 3.0 for the video, 7.0 for the audio).")})
    negative_prompt: str = field(default="", metadata={"help": (
        "The CFG negative prompt (LTX2Pipeline's default: the empty prompt).")})
    audio_guidance_scale: float | None = field(default=None, metadata={"help": (
        "The CFG scale of the audio tokens (LTX2Pipeline's audio_guidance_scale); None = the "
        "guidance_scale velocity() is given, for both streams (Flow-Factory's setting).")})
    max_sequence_length: int = field(default=1024, metadata={"help": (
        "Gemma tokens per prompt, left-padded (LTX2Pipeline's default: 1024).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_sequence_length < 1:
            raise ValueError(f"options.max_sequence_length must be >= 1 (got {self.max_sequence_length})")
        if self.frame_rate is not None and not self.frame_rate > 0:
            raise ValueError(f"options.frame_rate must be > 0 (got {self.frame_rate})")
        if self.audio_guidance_scale is not None and self.audio_guidance_scale < 0:
            raise ValueError(f"options.audio_guidance_scale must be >= 0 or None "
                             f"(got {self.audio_guidance_scale})")


def default_size() -> dict[str, Any]:
    """(height, width, num_frames, frame_rate) that ``LTX2Pipeline.__call__`` samples at by
    default: height, width and frame rate read from its signature (512, 768, 24.0 for 0.42),
    the frame count its fixed default for checkpoints without a duration head (121)."""
    from diffusers import LTX2Pipeline

    parameters = inspect.signature(LTX2Pipeline.__call__).parameters
    return {"height": int(parameters["height"].default), "width": int(parameters["width"].default),
            "num_frames": PIPELINE_NUM_FRAMES, "frame_rate": float(parameters["frame_rate"].default)}


def calculate_shift(video_tokens: int, config: dict) -> float:
    """mu of the dynamic shift: linear in the video token count from (base_image_seq_len,
    base_shift) to (max_image_seq_len, max_shift), with LTX2Pipeline's fallbacks (1024, 4096,
    0.95, 2.05) for keys the scheduler config lacks."""
    base_len = config.get("base_image_seq_len", 1024)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.95)
    max_shift = config.get("max_shift", 2.05)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return video_tokens * slope + base_shift - slope * base_len


class LTX2Model(DiffusersFlowModel):
    """LTX-2 adapter. Build with ``LTX2Model.from_pretrained(path_or_hub_id, ...)``. A sample is
    [video tokens; audio tokens] (B, S_v + S_a, D) (see the module docstring)."""

    family = "ltx2"
    options_class = LTX2Options
    pipeline_class_path = "diffusers:LTX2Pipeline"
    # The connectors turn Gemma's states into the transformer's text tokens: only encoding needs
    # them, so they are offloaded and freed with Gemma.
    text_encoder_names = ("text_encoder", "connectors")
    has_real_cfg = True
    # The prompt embeddings (sampling.embedding_perturbation): the connectors' text tokens of
    # the video and the audio stream (text_mask is a mask)
    text_embedding_keys = ("video_text", "audio_text")

    def __init__(self, transformer: torch.nn.Module, components: dict, options: LTX2Options,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        options = resolve_size(options, default_size())
        super().__init__(transformer, components, options, LTX2_LORA_TARGET_MODULES, device, dtype)
        for name in ("audio_vae", "vocoder"):
            part = self.components[name]
            part.eval().requires_grad_(False)
            part.to("cpu" if options.offload_vae else self.device)
        self.height, self.width, self.num_frames = options.height, options.width, options.num_frames
        self.frame_rate = float(options.frame_rate)
        layout = stream_layout(options, dict(transformer.config), dict(self.vae.config),
                               dict(self.components["audio_vae"].config),
                               self.vae.spatial_compression_ratio, self.vae.temporal_compression_ratio)
        self.latent_frames, self.latent_height, self.latent_width = layout["video_grid"]
        self.audio_frames, self.audio_mel_bins = layout["audio_frames"], layout["audio_mel_bins"]
        self.video_tokens, self.audio_tokens, self.token_width = (
            layout["video_tokens"], layout["audio_tokens"], layout["token_width"])
        self.scheduler_config = dict(components["scheduler"].config)

    # ---------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu",
                        options: LTX2Options | dict | None = None) -> "LTX2Model":
        """Load every component with its class's ``from_pretrained(path, subfolder=...)``.
        Options, folder contents, video size, frame count and the two streams' token widths are
        validated before any weights load."""
        from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video,
                               FlowMatchEulerDiscreteScheduler, LTX2VideoTransformer3DModel)
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
        from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

        options = parse_options(LTX2Options, options, cls.family)
        require_attention_backend(options.attention_backend)
        check_pipeline_folder(path_or_hub_id, {
            "transformer": "config.json", "vae": "config.json", "audio_vae": "config.json",
            "vocoder": "config.json", "connectors": "config.json",
            "scheduler": "scheduler_config.json", "text_encoder": "config.json",
            "tokenizer": "tokenizer_config.json"}, cls.family)
        options = resolve_size(options, default_size())
        transformer_config = LTX2VideoTransformer3DModel.load_config(path_or_hub_id, subfolder="transformer")
        vae_config = AutoencoderKLLTX2Video.load_config(path_or_hub_id, subfolder="vae")
        audio_config = AutoencoderKLLTX2Audio.load_config(path_or_hub_id, subfolder="audio_vae")
        stream_layout(options, transformer_config, vae_config, audio_config,
                      *_video_vae_factors(vae_config))

        text_dtype = resolve_dtype(options.text_encoder_dtype, dtype)
        vae_dtype = resolve_dtype(options.vae_dtype, dtype)
        components = {
            "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(path_or_hub_id,
                                                                         subfolder="scheduler"),
            "vae": AutoencoderKLLTX2Video.from_pretrained(path_or_hub_id, subfolder="vae",
                                                          torch_dtype=vae_dtype),
            "audio_vae": AutoencoderKLLTX2Audio.from_pretrained(path_or_hub_id, subfolder="audio_vae",
                                                                torch_dtype=vae_dtype),
            "vocoder": LTX2Vocoder.from_pretrained(path_or_hub_id, subfolder="vocoder",
                                                   torch_dtype=vae_dtype),
            "text_encoder": Gemma3ForConditionalGeneration.from_pretrained(
                path_or_hub_id, subfolder="text_encoder", **text_model_dtype(text_dtype)),
            "tokenizer": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer"),
            "connectors": LTX2TextConnectors.from_pretrained(path_or_hub_id, subfolder="connectors",
                                                             torch_dtype=text_dtype),
        }
        transformer = LTX2VideoTransformer3DModel.from_pretrained(path_or_hub_id, subfolder="transformer",
                                                                  torch_dtype=dtype)
        return cls(transformer, components, options, device=device, dtype=dtype)

    # ---------------------------------------------------------------------------- FlowModel
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        """{"video_text": (B, L, D_v), "audio_text": (B, L, D_a), "text_mask": (B, L)}: the
        pipeline's ``encode_prompt`` (Gemma, every layer's states) then its ``connectors``, as
        ``LTX2Pipeline.__call__`` runs them (on a pipeline without a transformer: encoding needs
        none). The connectors treat each row on its own, so rows encode alike in any batch."""
        pipeline = self.pipeline_class(transformer=None, **self.components)
        prompt_embeds, mask, _, _ = pipeline.encode_prompt(
            prompt=prompts, negative_prompt=None, do_classifier_free_guidance=False,
            max_sequence_length=self.options.max_sequence_length, device=self.device)
        padding_side = getattr(self.components["tokenizer"], "padding_side", "left")
        video_text, audio_text, text_mask = self.components["connectors"](
            prompt_embeds, mask, padding_side=padding_side)
        return {"video_text": video_text, "audio_text": audio_text,
                "text_mask": text_mask.to(torch.float32)}

    def negative_prompt(self) -> str | None:
        return self.options.negative_prompt if self.options.cfg else None

    @property
    def latent_shape(self) -> tuple[int, int]:
        """(S_v + S_a, D): the video tokens F' h w, then the audio tokens, each D wide."""
        return (self.video_tokens + self.audio_tokens, self.token_width)

    def initial_noise(self, batch: int, generator: torch.Generator | None) -> Tensor:
        """(batch, S_v + S_a, D) float32 standard normal, on the generator's device (else
        ``device``): the packed noise of both streams (``LTX2Pipeline(latents=video,
        audio_latents=audio)`` takes the two parts, see ``split_streams``)."""
        device = generator.device if generator is not None else self.device
        return torch.randn((batch, *self.latent_shape), generator=generator, device=device,
                           dtype=torch.float32)

    def split_streams(self, latents: Tensor) -> tuple[Tensor, Tensor]:
        """(video (B, S_v, D), audio (B, S_a, D)) packed tokens of a sample (B, S_v + S_a, D)."""
        return latents[:, :self.video_tokens], latents[:, self.video_tokens:]

    def sigmas(self, num_steps: int) -> Tensor:
        """(num_steps + 1,) float32: ``linspace(1, 1/N, N)`` through a copy of the checkpoint's
        scheduler with mu from the video token count (``calculate_shift``), then 0: the sigmas
        ``LTX2Pipeline`` steps through."""
        scheduler = copy.deepcopy(self.components["scheduler"])   # set_timesteps changes its state
        scheduler.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps),
                                mu=calculate_shift(self.video_tokens, self.scheduler_config))
        return scheduler.sigmas.to(torch.float32).cpu()

    def _coords(self, batch: int) -> tuple[Tensor, Tensor]:
        """RoPE positions of the video (batch, 3, S_v, 2) and audio (batch, 1, S_a, 2) tokens, as
        ``LTX2Pipeline`` prepares them (the video's from the frame rate)."""
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        model = self.transformer
        video = model.rope.prepare_video_coords(
            batch, self.latent_frames, self.latent_height, self.latent_width, self.device,
            fps=conditioning_frame_rate(self.frame_rate, 1.0))
        audio = model.audio_rope.prepare_audio_coords(batch, self.audio_frames, self.device)
        return video, audio

    def _scales(self, guidance_scale: float) -> tuple[float, float]:
        """(video, audio) CFG scales: ``guidance_scale`` and ``audio_guidance_scale`` (None: the
        same)."""
        audio = self.options.audio_guidance_scale
        return float(guidance_scale), float(guidance_scale if audio is None else audio)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, S_v + S_a, D) float32 of both streams at ``latents`` and per-sample sigma
        (B,); transformer timestep and sigma = 1000 sigma. CFG when the video or the audio scale
        exceeds 1: ``guided_velocity`` with a per-token scale (the video's on the video tokens,
        the audio's on the audio tokens)."""
        batch = latents.shape[0]
        sigma = self._per_sample_sigma(sigma, batch, self.device)
        if cond.batch_size != batch:
            raise ValueError(f"cond has {cond.batch_size} rows but latents has {batch}")
        if tuple(latents.shape[1:]) != self.latent_shape:
            raise ValueError(f"ltx2 latents must be (B, {self.latent_shape[0]}, {self.latent_shape[1]}) "
                             f"[video tokens; audio tokens] (got {tuple(latents.shape)})")
        video_scale, audio_scale = self._scales(guidance_scale)
        use_cfg = self._use_cfg(cond, max(video_scale, audio_scale))
        positive = {key: value.to(self.device, self.dtype) for key, value in cond.positive.items()}

        def forward(hidden: Tensor, timestep: Tensor, text: dict[str, Tensor]) -> Tensor:
            rows = hidden.shape[0]
            video_coords, audio_coords = self._coords(rows)
            video, audio = self.split_streams(hidden)
            video_v, audio_v = self.transformer(
                hidden_states=video, audio_hidden_states=audio,
                encoder_hidden_states=text["video_text"], audio_encoder_hidden_states=text["audio_text"],
                timestep=timestep, sigma=timestep,
                encoder_attention_mask=text["text_mask"], audio_encoder_attention_mask=text["text_mask"],
                num_frames=self.latent_frames, height=self.latent_height, width=self.latent_width,
                fps=self.frame_rate, audio_num_frames=self.audio_frames,
                video_coords=video_coords, audio_coords=audio_coords, use_cross_timestep=True,
                return_dict=False)
            return torch.cat([video_v.float(), audio_v.float()], dim=1)

        hidden = latents.to(self.device, self.dtype)
        timestep = 1000.0 * sigma
        if not use_cfg:
            return forward(hidden, timestep, positive)
        scale: float | Tensor = video_scale
        if audio_scale != video_scale:   # (1, S_v + S_a, 1): each stream's scale on its tokens
            scale = torch.cat([torch.full((self.video_tokens,), video_scale),
                               torch.full((self.audio_tokens,), audio_scale)]).view(1, -1, 1).to(self.device)
        return guided_velocity(forward, hidden, timestep, positive, cond.negative, scale)

    def video_latents(self, latents: Tensor) -> Tensor:
        """The VAE's latents (B, C, F', h, w) float32 of a sample's video tokens: unpacked and
        un-normalised (what ``LTX2Pipeline(output_type="latent")`` returns as frames)."""
        from diffusers import LTX2Pipeline

        video, _ = self.split_streams(latents.to(self.device, torch.float32))
        config = self.transformer.config
        video = LTX2Pipeline._unpack_latents(video, self.latent_frames, self.latent_height,
                                             self.latent_width, config.patch_size, config.patch_size_t)
        return LTX2Pipeline._denormalize_latents(video, self.vae.latents_mean, self.vae.latents_std,
                                                 self.vae.config.scaling_factor)

    def audio_latents(self, latents: Tensor) -> Tensor:
        """The audio VAE's latents (B, C_a, S_a, M) float32 of a sample's audio tokens:
        un-normalised and unpacked (``LTX2Pipeline(output_type="latent")``'s audio)."""
        from diffusers import LTX2Pipeline

        _, audio = self.split_streams(latents.to(self.device, torch.float32))
        audio_vae = self.components["audio_vae"]
        audio = LTX2Pipeline._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
        return LTX2Pipeline._unpack_audio_latents(audio, self.audio_frames, num_mel_bins=self.audio_mel_bins)

    def decode(self, latents: Tensor) -> Tensor:
        """Videos (B, F, 3, H, W) float32 in [0, 1] from samples (B, S_v + S_a, D) (the audio
        tokens are ``decode_audio``'s)."""
        z = self.video_latents(latents)
        with self.vae_on_device():
            timestep = None
            if self.vae.config.timestep_conditioning:   # the pipeline's decode_timestep 0, no noise
                timestep = torch.zeros(z.shape[0], device=self.device, dtype=self.vae.dtype)
            videos = self.vae.decode(z.to(self.vae.dtype), timestep, return_dict=False)[0]   # (B, 3, F, H, W)
        return (videos.float().permute(0, 2, 1, 3, 4) * 0.5 + 0.5).clamp(0.0, 1.0)

    def decode_audio(self, latents: Tensor) -> Tensor:
        """Waveforms (B, channels, T) float32 from samples (B, S_v + S_a, D): the audio VAE's mel
        spectrogram through the vocoder, as ``LTX2Pipeline`` returns its audio."""
        audio_vae, vocoder = self.components["audio_vae"], self.components["vocoder"]
        z = self.audio_latents(latents)
        with torch.no_grad(), self._on_device([audio_vae, vocoder], self.options.offload_vae):
            mel = audio_vae.decode(z.to(audio_vae.dtype), return_dict=False)[0]
            return vocoder(mel).float()


def _video_vae_factors(vae_config: dict) -> tuple[int, int]:
    """(spatial, temporal) compression of an ``AutoencoderKLLTX2Video`` config, as the model
    computes them: the config's ratios when set, else patch size x 2 per scaling block."""
    scaled = 2 ** sum(bool(s) for s in vae_config.get("spatio_temporal_scaling", (True, True, True, True)))
    spatial = vae_config.get("spatial_compression_ratio") or vae_config.get("patch_size", 4) * scaled
    temporal = vae_config.get("temporal_compression_ratio") or vae_config.get("patch_size_t", 1) * scaled
    return int(spatial), int(temporal)


def stream_layout(options: LTX2Options, transformer: dict, vae: dict, audio_vae: dict,
                  spatial: int, temporal: int) -> dict[str, Any]:
    """The two token streams of a sample at ``options``' size, from the configs alone (so it runs
    before weights load): the video's latent grid (F', h, w) and token count F' h w / patches, the
    audio's latent frames, latent mel bins and token count, and the common token width D. Raises
    ValueError naming the option (size, frame count) or the checkpoint (unequal widths)."""
    patch, patch_t = transformer.get("patch_size", 1), transformer.get("patch_size_t", 1)
    multiple = int(np.lcm(PIPELINE_SIZE_MULTIPLE, spatial * patch))
    why = f"LTX2Pipeline's multiple of 32 and VAE factor {spatial} x patch size {patch}"
    check_divisible(options.height, multiple, "height", "ltx2", why)
    check_divisible(options.width, multiple, "width", "ltx2", why)
    frames = options.num_frames
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % temporal:
        lower = max(frames - (frames - 1) % temporal, 1) if isinstance(frames, int) and frames >= 1 else 1
        raise ValueError(f"options.num_frames must be {temporal}k + 1 for ltx2 (the VAE encodes the "
                         f"first frame alone, then groups of {temporal}); got {frames!r}, try "
                         f"{lower} or {lower + temporal}")
    grid = ((frames - 1) // temporal + 1, options.height // spatial, options.width // spatial)
    if grid[0] % patch_t:
        raise ValueError(f"options.num_frames gives {grid[0]} latent frames, not divisible by the "
                         f"transformer's temporal patch size {patch_t}")
    video_tokens = grid[0] // patch_t * (grid[1] // patch) * (grid[2] // patch)
    video_width = transformer.get("in_channels", 128) * patch * patch * patch_t
    from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR

    # AutoencoderKLLTX2Audio compresses time and mel bins by this fixed factor (its
    # temporal_compression_ratio and mel_compression_ratio), whatever its config
    mel_compression = audio_temporal = LATENT_DOWNSAMPLE_FACTOR
    per_second = audio_vae.get("sample_rate", 16000) / audio_vae.get("mel_hop_length", 160) / audio_temporal
    audio_frames = round(frames / float(options.frame_rate) * per_second)
    mel_bins = audio_vae.get("mel_bins", 64) // mel_compression
    audio_width = audio_vae.get("latent_channels", 8) * mel_bins
    if audio_frames < 1:
        raise ValueError(f"options.num_frames {frames} at frame_rate {options.frame_rate} gives no "
                         f"audio latent frame ({per_second:g} a second); give more frames")
    if audio_width != video_width or transformer.get("audio_in_channels", 128) != audio_width:
        raise ValueError(f"ltx2: the checkpoint's video tokens are {video_width} wide and its audio "
                         f"tokens {audio_width} (audio VAE latent_channels x mel bins) with a "
                         f"transformer taking {transformer.get('audio_in_channels')}; the adapter "
                         "keeps both streams in one sample and needs one width")
    return {"video_grid": grid, "video_tokens": video_tokens, "audio_frames": audio_frames,
            "audio_mel_bins": mel_bins, "audio_tokens": audio_frames, "token_width": video_width}
