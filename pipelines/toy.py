"""The toy world's text-to-image flow model (family "toy"): an MM-DiT on 24 px pixels.

Components, each saved/loaded with its own class's ``save_pretrained`` / ``from_pretrained`` in a
subfolder of one directory (the layout of a diffusers pipeline folder)::

    <dir>/transformer/    diffusers SD3Transformer2DModel (in/out channels 3, patch 2, 24 px)
    <dir>/text_encoder/   transformers CLIPTextModelWithProjection (token + position embeddings,
                          causal layers; per-token states and the EOS-pooled projection)
    <dir>/tokenizer/      PreTrainedTokenizerFast over a WordLevel vocabulary of the toy grammar
    <dir>/toy_config.json sampling defaults found by pretraining (shift, guidance, steps)

Latents are pixels in [-1, 1], shape (B, 3, 24, 24); ``decode`` maps them to [0, 1]. The
transformer sees timestep = 1000 * sigma (as SD3). Pretraining dropped 10% of captions to the
empty prompt, so classifier-free guidance uses the empty prompt as the negative.

An *editing* toy model (``to_editing_model``, ``assets/toy_edit``) is the same transformer with 6
input channels: the noisy pixels and the source image's pixels in [-1, 1], concatenated on the
channel axis (InstructPix2Pix's conditioning; the transformer still predicts 3 channels). Its
``encode_prompts(prompts, images)`` puts the source pixels in the Conditioning as
``source_latents`` (B, 3, 24, 24), one row per prompt, so selecting rows needs nothing new.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import Tensor

from flowgrpo.edit_regions import downsample_mask
from flowgrpo.model import Conditioning, guided_velocity
from flowgrpo.toyworld.grammar import VOCABULARY
from pipelines.options import parse_options
from pipelines.training import TransformerTraining, lora_adapter_metadata

TOY_CONFIG_NAME = "toy_config.json"
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")   # ids 0..3; EOS != 2 (CLIP's legacy pooling)

# PEFT targets: the joint attention projections of every SD3 block (image and text streams).
SD3_LORA_TARGET_MODULES = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]


@dataclass
class ToyOptions:
    """Sampling options; None means the default saved in ``toy_config.json``.

    shift: timestep shift of ``sigmas`` (sigma' = shift s / (1 + (shift - 1) s)); 1 = uniform.
    negative_prompt: the CFG negative; "" is what pretraining's caption dropout learned.
    """

    shift: float | None = None
    negative_prompt: str = ""

    def __post_init__(self):
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"options.shift must be > 0 (got {self.shift})")


@dataclass
class ToyArchitecture:
    """Sizes of a freshly built toy model (``build_toy_model``); saved in the component configs."""

    sample_size: int = 24
    patch_size: int = 2
    num_layers: int = 3
    num_attention_heads: int = 4
    attention_head_dim: int = 32
    text_hidden_size: int = 64
    text_layers: int = 1
    text_heads: int = 4
    pooled_dim: int = 64
    max_length: int = 10

    def __post_init__(self):
        if self.sample_size % self.patch_size:
            raise ValueError(f"sample_size ({self.sample_size}) must be a multiple of patch_size "
                             f"({self.patch_size})")
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be > 0 (got {getattr(self, f.name)})")


@dataclass
class ToySamplingDefaults:
    """What ``toy_config.json`` holds: the sampling settings pretraining measured best."""

    shift: float = 1.0
    guidance_scale: float = 1.0
    eval_steps: int = 20
    extra: dict = field(default_factory=dict)   # provenance: command, accuracy, wall time


def build_tokenizer(vocabulary: tuple[str, ...] | None = None, max_length: int = 10):
    """An offline word-level tokenizer: "[BOS] words [EOS] [PAD]...", padded to ``max_length``."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    if vocabulary is None:
        vocabulary = VOCABULARY
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(vocabulary))}
    core = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", vocab["[BOS]"]), ("[EOS]", vocab["[EOS]"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="[BOS]", eos_token="[EOS]",
                                   pad_token="[PAD]", unk_token="[UNK]", model_max_length=max_length)


def build_toy_model(arch: ToyArchitecture | None = None, seed: int = 0,
                    defaults: ToySamplingDefaults | None = None) -> "ToyFlowModel":
    """A randomly initialised toy model (float32, CPU), seeded."""
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    arch = arch or ToyArchitecture()
    tokenizer = build_tokenizer(max_length=arch.max_length)
    torch.manual_seed(seed)
    text_config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=arch.text_hidden_size,
        intermediate_size=4 * arch.text_hidden_size, num_hidden_layers=arch.text_layers,
        num_attention_heads=arch.text_heads, max_position_embeddings=arch.max_length,
        projection_dim=arch.pooled_dim, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    text_encoder = CLIPTextModelWithProjection(text_config)
    transformer = SD3Transformer2DModel(
        sample_size=arch.sample_size, patch_size=arch.patch_size, in_channels=3, out_channels=3,
        num_layers=arch.num_layers, attention_head_dim=arch.attention_head_dim,
        num_attention_heads=arch.num_attention_heads, joint_attention_dim=arch.text_hidden_size,
        caption_projection_dim=arch.num_attention_heads * arch.attention_head_dim,
        pooled_projection_dim=arch.pooled_dim,
        pos_embed_max_size=arch.sample_size // arch.patch_size)
    return ToyFlowModel(transformer, text_encoder, tokenizer, defaults or ToySamplingDefaults())


def _shifted(sigmas: Tensor, shift: float) -> Tensor:
    return shift * sigmas / (1 + (shift - 1) * sigmas)


class ToyFlowModel(TransformerTraining):
    """FlowModel for the toy world (see module docstring). Sampling lives in ``flowgrpo.sde``."""

    family = "toy"
    options_class = ToyOptions
    lora_target_modules = list(SD3_LORA_TARGET_MODULES)

    def __init__(self, transformer, text_encoder, tokenizer, defaults: ToySamplingDefaults,
                 options: ToyOptions | None = None):
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.defaults = defaults
        self.options = options or ToyOptions()
        self.device = next(transformer.parameters()).device
        self.dtype = next(transformer.parameters()).dtype
        self.sample_size = int(transformer.config.sample_size)
        self._cache: dict[str, tuple[Tensor, Tensor]] = {}

    # ---------------------------------------------------------------- loading / saving
    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu",
                        options: ToyOptions | dict | None = None) -> "ToyFlowModel":
        """Load ``path`` (a folder laid out as in the module docstring)."""
        from diffusers import SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

        if not os.path.isdir(path):
            raise ValueError(f"path must be a toy model folder (got {path!r}, which is not a directory); "
                             "create one with scripts/pretrain_toy.py")
        options = parse_options(ToyOptions, options, cls.family)
        transformer = SD3Transformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
        text_encoder = CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder",
                                                                   dtype=dtype)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, subfolder="tokenizer")
        defaults = ToySamplingDefaults()
        config_path = os.path.join(path, TOY_CONFIG_NAME)
        if os.path.exists(config_path):
            with open(config_path) as handle:
                defaults = ToySamplingDefaults(**json.load(handle))
        transformer.to(device).eval().requires_grad_(False)
        text_encoder.to(device).eval().requires_grad_(False)
        return cls(transformer, text_encoder, tokenizer, defaults, options)

    def configure_transformer(self, module: torch.nn.Module) -> None:
        """A transformer this adapter runs (a full fine-tune swapped in): on the device, frozen."""
        module.to(self.device).requires_grad_(False)

    def save_pretrained(self, path: str) -> None:
        """Write every component (safetensors) and ``toy_config.json`` under ``path``."""
        os.makedirs(path, exist_ok=True)
        self.transformer.save_pretrained(os.path.join(path, "transformer"))
        self.text_encoder.save_pretrained(os.path.join(path, "text_encoder"))
        self.tokenizer.save_pretrained(os.path.join(path, "tokenizer"))
        with open(os.path.join(path, TOY_CONFIG_NAME), "w") as handle:
            json.dump(asdict(self.defaults), handle, indent=2)

    def save_lora_weights(self, directory: str, transformer_lora_state_dict: dict[str, Tensor],
                          lora_config=None) -> None:
        """Write PEFT-format LoRA weights with diffusers' SD3 writer
        (``StableDiffusion3Pipeline.save_lora_weights``: keys prefixed "transformer.", file
        ``pytorch_lora_weights.safetensors``), so ``pipe.load_lora_weights(directory)`` and
        ``SD3Transformer2DModel.load_lora_adapter(directory, prefix="transformer")`` load them.
        ``lora_config`` (the adapter's ``peft.LoraConfig`` or its ``to_dict()``) is stored as the
        file's adapter metadata so that ``lora_alpha`` survives; without it loaders assume
        alpha = rank."""
        from diffusers import StableDiffusion3Pipeline

        if not transformer_lora_state_dict:
            raise ValueError("transformer_lora_state_dict is empty; pass model.lora_state_dict() "
                             "(peft.get_peft_model_state_dict of the transformer)")
        if lora_config is None and getattr(self.transformer, "peft_config", None):
            # The adapter the trainer added: its alpha must survive (as in the SD3 adapter).
            lora_config = lora_adapter_metadata(self.transformer)
        metadata = lora_config.to_dict() if hasattr(lora_config, "to_dict") else lora_config
        if metadata is not None and not isinstance(metadata, dict):
            raise TypeError("lora_config must be a peft.LoraConfig, a dict or None "
                            f"(got {type(lora_config).__name__})")
        StableDiffusion3Pipeline.save_lora_weights(
            directory, transformer_lora_layers=transformer_lora_state_dict,
            transformer_lora_adapter_metadata=metadata)

    # ---------------------------------------------------------------- FlowModel
    def tokenize(self, prompts: list[str]) -> Tensor:
        """(B, max_length) token ids, padded."""
        return self.tokenizer(list(prompts), padding="max_length", max_length=self.tokenizer.model_max_length,
                              truncation=True, return_tensors="pt").input_ids

    def text_states(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(per-token states (B, L, D), pooled projection (B, P)) of the text encoder (with grad
        if the encoder is trainable: used by pretraining)."""
        out = self.text_encoder(input_ids=input_ids.to(self.text_encoder.device))
        return out.last_hidden_state, out.text_embeds

    @torch.no_grad()
    def _encode_cached(self, prompts: list[str]) -> dict[str, Tensor]:
        missing = sorted({p for p in prompts if p not in self._cache})
        if missing:
            states, pooled = self.text_states(self.tokenize(missing))
            for i, prompt in enumerate(missing):
                self._cache[prompt] = (states[i].to(self.dtype), pooled[i].to(self.dtype))
        return {"prompt_embeds": torch.stack([self._cache[p][0] for p in prompts]),
                "pooled_prompt_embeds": torch.stack([self._cache[p][1] for p in prompts])}

    @property
    def supports_images(self) -> bool:
        """True for an editing model (source pixels as extra input channels)."""
        config = self.transformer.config
        return int(config.in_channels) == 2 * int(config.out_channels)

    def encode_prompts(self, prompts: list[str], images: list[Tensor] | None = None) -> Conditioning:
        """Per-token states (B, L, D) and pooled projections (B, P); the negative is the empty
        prompt (``options.negative_prompt``), broadcast to B rows. Cached per prompt string.

        images: an editing model's source images, one (3, H, W) float in [0, 1] per prompt;
        stored as ``source_latents`` (B, 3, H, W) in [-1, 1] in both branches (the negative
        drops the instruction, not the image, as InstructPix2Pix's text guidance)."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings (got a single str); wrap it in a list")
        positive = self._encode_cached(list(prompts))
        negative = self._encode_cached([self.options.negative_prompt] * len(prompts))
        if self.supports_images:
            if images is None or len(images) != len(prompts) or any(i is None for i in images):
                raise ValueError("this toy model edits images: give one source image per prompt "
                                 "(prompt records with an \"image\", e.g. toy:edit_train)")
            positive["source_latents"] = negative["source_latents"] = self.encode_images(images)
        elif images is not None and any(i is not None for i in images):
            raise ValueError("this toy model is text-to-image and cannot take source images; use "
                             "an editing model (model.path: assets/toy_edit) or prompts without "
                             "\"image\"")
        return Conditioning(positive=positive, negative=negative)

    def encode_images(self, images: list[Tensor]) -> Tensor:
        """Images (3, S, S) floats in [0, 1], one per row -> their latents (B, 3, S, S) in
        [-1, 1] in the model's dtype (the latents are the pixels, rescaled: ``decode``'s
        inverse on [0, 1])."""
        size = (3, self.sample_size, self.sample_size)
        bad = [tuple(i.shape) for i in images if tuple(i.shape) != size]
        if bad:
            raise ValueError(f"images must be {size} floats in [0, 1] (got {bad[0]})")
        pixels = torch.stack([i.to(self.device, torch.float32) for i in images])
        return (2.0 * pixels - 1.0).to(self.dtype)

    def region_mask(self, mask: Tensor, resize: str = "area") -> Tensor:
        """An edit-region mask (B, 1, H, W) in [0, 1] on the latents' layout, (B, 1, S, S):
        the latents are the pixels, so a mask of the model's size is returned as it is (a larger
        one is downsampled by ``resize``, ``flowgrpo.edit_regions.downsample_mask``)."""
        return downsample_mask(mask, (self.sample_size, self.sample_size), resize)

    def initial_noise(self, batch: int, generator: torch.Generator | None) -> Tensor:
        """Standard normal pixels (batch, 3, 24, 24), float32, on the generator's device."""
        device = generator.device if generator is not None else torch.device("cpu")
        return torch.randn((batch, 3, self.sample_size, self.sample_size), generator=generator,
                           device=device, dtype=torch.float32)

    @property
    def shift(self) -> float:
        return self.options.shift if self.options.shift is not None else self.defaults.shift

    def sigmas(self, num_steps: int) -> Tensor:
        """(num_steps + 1,) float32 from 1 to 0: uniform in t, then shifted by ``shift``."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1 (got {num_steps})")
        return _shifted(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), self.shift).float()

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity (B, 3, H, W) float32 at pixels ``latents`` and per-sample ``sigma`` (B,).
        With ``guidance_scale > 1`` and ``cond.negative`` set, both branches through
        ``guided_velocity`` (one batched forward unless training.cfg_gradient splits them),
        combined ``v_neg + g (v_pos - v_neg)``."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1)
        if sigma.numel() == 1:
            sigma = sigma.expand(batch)
        if sigma.shape[0] != batch or cond.batch_size != batch:
            raise ValueError(f"sigma ({sigma.shape[0]}) and cond ({cond.batch_size}) must have one row "
                             f"per latent ({batch})")
        use_cfg = guidance_scale > 1.0 and cond.negative is not None
        x = latents.to(self.device, self.dtype)
        timestep = (1000.0 * sigma).to(self.device, self.dtype)
        keys = ("prompt_embeds", "pooled_prompt_embeds")
        if self.supports_images:
            if "source_latents" not in cond.positive:
                raise ValueError("this toy model edits images: encode the prompts with their "
                                 "source images (encode_prompts(prompts, images=...))")
            keys += ("source_latents",)
        positive = {k: cond.positive[k].to(self.device, self.dtype) for k in keys}

        def forward(x: Tensor, timestep: Tensor, text: dict[str, Tensor]) -> Tensor:
            if "source_latents" in text:
                # InstructPix2Pix: the source pixels ride along as extra input channels.
                x = torch.cat([x, text["source_latents"].to(x)], dim=1)
            return self.transformer(hidden_states=x, encoder_hidden_states=text["prompt_embeds"],
                                    pooled_projections=text["pooled_prompt_embeds"],
                                    timestep=timestep, return_dict=False)[0].float()

        return guided_velocity(forward, x, timestep, positive,
                               cond.negative if use_cfg else None, guidance_scale)

    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, 3, H, W) float32 in [0, 1]: (x + 1) / 2, clamped."""
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)


def to_editing_model(model: ToyFlowModel, extra_words: tuple[str, ...] | None = None) -> ToyFlowModel:
    """An editing toy model made from a text-to-image one (what ``scripts/pretrain_toy_edit.py``
    fine-tunes): the transformer's patch embedding takes 3 more input channels (the source image)
    with zero weights, so before training it draws exactly what the base draws; the tokenizer
    gains ``extra_words`` (default: the editing instructions' words) at the end of its
    vocabulary, so existing ids keep their embeddings and the new rows start random."""
    from diffusers import SD3Transformer2DModel

    from flowgrpo.toyworld.editing import EDIT_WORDS

    if model.supports_images:
        raise ValueError("model already edits images (its transformer has 6 input channels)")
    extra_words = EDIT_WORDS if extra_words is None else extra_words
    config = dict(model.transformer.config)
    channels = int(config["in_channels"])
    config.update(in_channels=2 * channels, out_channels=channels)
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    transformer = SD3Transformer2DModel(**config).to(model.device, model.dtype)
    state = model.transformer.state_dict()
    weight = state["pos_embed.proj.weight"]                       # (D, C, p, p)
    state["pos_embed.proj.weight"] = torch.cat([weight, torch.zeros_like(weight)], dim=1)
    transformer.load_state_dict(state)
    vocabulary = [t for t, _ in sorted(model.tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    words = tuple(t for t in vocabulary if t not in SPECIAL_TOKENS)
    words += tuple(w for w in extra_words if w not in words)
    tokenizer = build_tokenizer(words, max_length=model.tokenizer.model_max_length)
    text_encoder = copy.deepcopy(model.text_encoder)
    text_encoder.resize_token_embeddings(len(tokenizer))
    transformer.eval().requires_grad_(False)
    return ToyFlowModel(transformer, text_encoder, tokenizer, copy.deepcopy(model.defaults),
                        copy.deepcopy(model.options))
