"""The common body of the diffusers-backed adapters (``DiffusersFlowModel``): components loaded
by a family's ``from_pretrained``, the per-prompt embedding cache (``PromptEmbeddingCache``), CPU
offloading of text encoders and VAE, and the training methods (``pipelines.training``).

Beside it, by job: ``pipelines/options.py`` (the options every family extends and their parsing),
``pipelines/sources.py`` (the checks of a model folder or hub id before any weights load) and
``pipelines/training.py`` (LoRA and full-weight training and saving). The interface they
implement, ``FlowModel``, lives in the core (``flowgrpo/model.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import Tensor

from flowgrpo.model import Conditioning
from pipelines.options import apply_attention_backend
from pipelines.training import (TransformerTraining, check_lora_targets, lora_adapter_metadata,
                                strip_peft_wrapper_prefix)


class PromptEmbeddingCache:
    """Embeddings of single prompts, keyed by the prompt string (least recently used evicted).

    ``lookup(prompts, encode)`` returns batched tensors (B, ...) in the order of ``prompts`` and
    calls ``encode`` once, on the distinct prompts not cached yet (``encode`` returns a dict of
    batched tensors, one row per prompt it was given). Rows encoded in different calls may differ
    in length (dim 1); they come back zero-padded to the longest (``cat_rows``).
    """

    def __init__(self, max_prompts: int) -> None:
        self.max_prompts = max_prompts
        self._entries: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        self.pinned: set[str] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, prompt: str) -> bool:
        return prompt in self._entries

    def clear(self) -> None:
        self._entries.clear()

    def lookup(self, prompts: list[str], encode: Callable[[list[str]], dict[str, Tensor]]) -> dict[str, Tensor]:
        missing = [p for p in dict.fromkeys(prompts) if p not in self._entries]
        fresh: dict[str, dict[str, Tensor]] = {}
        if missing:
            batch = encode(missing)
            fresh = {p: {k: v[i:i + 1] for k, v in batch.items()} for i, p in enumerate(missing)}
        rows = []
        for prompt in prompts:
            if prompt in self._entries:
                self._entries.move_to_end(prompt)
                rows.append(self._entries[prompt])
            else:
                rows.append(fresh[prompt])
        for prompt, entry in fresh.items():
            if self.max_prompts > 0 or prompt in self.pinned:
                self._entries[prompt] = entry
        evictable = [p for p in self._entries if p not in self.pinned]
        for prompt in evictable[:max(0, len(evictable) - self.max_prompts)]:
            del self._entries[prompt]
        return {k: cat_rows([row[k] for row in rows]) for k in rows[0]}


def cat_rows(rows: list[Tensor]) -> Tensor:
    """Concatenate rows (1, L_i, ...) along the batch. Rows of different lengths L_i (dim 1) are
    right-padded with zeros to the longest: variable-length text whose padding is marked by a
    zero mask (Qwen-Image's prompt_embeds / prompt_embeds_mask), cached at its own length so that
    the cache does not hold every prompt at the longest possible length."""
    if rows[0].dim() < 2 or all(r.shape[1] == rows[0].shape[1] for r in rows):
        return torch.cat(rows)
    length = max(r.shape[1] for r in rows)
    return torch.cat([torch.nn.functional.pad(r, (0, 0) * (r.dim() - 2) + (0, length - r.shape[1]))
                      for r in rows])


class DiffusersFlowModel(TransformerTraining):
    """Common body of the diffusers-backed adapters. A family subclass sets the class attributes,
    builds its components in ``from_pretrained`` and implements ``_encode_batch``,
    ``initial_noise``, ``sigmas``, ``velocity`` and ``decode``.

    ``components`` holds the stock pipeline's constructor arguments except ``transformer``
    (text encoders, tokenizers, VAE, scheduler); the transformer is the ``transformer`` attribute,
    which the trainer may wrap or swap, and ``to_pipeline()`` always uses the current one.
    """

    family: ClassVar[str]
    pipeline_class_path: ClassVar[str]          # "diffusers:StableDiffusion3Pipeline"
    text_encoder_names: ClassVar[tuple[str, ...]]
    has_real_cfg: ClassVar[bool]

    def __init__(self, transformer: torch.nn.Module, components: dict[str, Any], options: Any,
                 lora_target_modules: list[str], device: torch.device | str, dtype: torch.dtype) -> None:
        self.transformer = transformer
        self.components = dict(components)
        self.options = options
        self.device = torch.device(device)
        self.dtype = dtype
        self.lora_target_modules = list(lora_target_modules)
        check_lora_targets(transformer, self.lora_target_modules, self.family)
        self.prompt_cache = PromptEmbeddingCache(options.prompt_cache_size)
        self._configure()

    # ------------------------------------------------------------------------- setup
    def _configure(self) -> None:
        """Devices, training switches and memory options (called once by ``__init__``)."""
        self.configure_transformer(self.transformer)
        for name in self.text_encoder_names:
            encoder = self.components.get(name)
            if encoder is not None:
                encoder.eval().requires_grad_(False)
                encoder.to("cpu" if self.options.offload_text_encoders else self.device)
        vae = self.components["vae"]
        vae.eval().requires_grad_(False)
        vae.to("cpu" if self.options.offload_vae else self.device)
        if self.options.vae_slicing:
            vae.enable_slicing()
        if self.options.vae_tiling:
            vae.enable_tiling()

    def configure_transformer(self, module: torch.nn.Module) -> None:
        """A transformer this adapter runs (its own, or a full fine-tune swapped in for it): on
        the device, frozen, with the options' attention backend."""
        module.to(self.device).requires_grad_(False)
        for denoiser in self.denoisers(module):
            apply_attention_backend(denoiser, self.options.attention_backend)

    @property
    def pipeline_class(self) -> type:
        """The stock diffusers pipeline class of this family (imported on first use)."""
        module, name = self.pipeline_class_path.split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def vae(self) -> torch.nn.Module:
        return self.components["vae"]

    def to_pipeline(self) -> Any:
        """The stock diffusers pipeline built from this adapter's own components (no copies):
        used by parity tests and sampling CLIs."""
        return self.pipeline_class(transformer=self.transformer, **self.components)

    # ------------------------------------------------------------------------- memory
    @contextmanager
    def _on_device(self, modules: list[torch.nn.Module], offloaded: bool) -> Iterator[None]:
        if offloaded:
            for module in modules:
                module.to(self.device)
        try:
            yield
        finally:
            if offloaded:
                for module in modules:
                    module.to("cpu")
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def text_encoders_on_device(self):
        """Context in which the text encoders are on ``device`` (moved back when offloaded)."""
        encoders = [self.components[n] for n in self.text_encoder_names if self.components.get(n) is not None]
        return self._on_device(encoders, self.options.offload_text_encoders)

    def vae_on_device(self):
        """Context in which the VAE is on ``device`` (moved back when offloaded)."""
        return self._on_device([self.vae], self.options.offload_vae)

    def vae_latents(self, images: list[Tensor]) -> Tensor:
        """Normalised VAE latents (B, C, H/f, W/f) float32 of images (3, h, w) in [0, 1], each
        resized to the configured output size when it differs: what a sample of those pixels
        would be before decoding, for the families whose VAE normalises by shift and scale (SD3,
        FLUX: the mean of the latent distribution, as the stock image-to-image pipelines do)."""
        size = (self.options.height, self.options.width)
        rows = []
        for image in images:
            if image.dim() != 3 or image.shape[0] != 3:
                raise ValueError(f"images must be (3, H, W) floats in [0, 1] (got shape "
                                 f"{tuple(image.shape)})")
            image = image.to(self.device, torch.float32)[None]
            if tuple(image.shape[-2:]) != size:
                image = torch.nn.functional.interpolate(
                    image, size=size, mode="bilinear", align_corners=False,
                    antialias=True).clamp(0, 1)
            rows.append(image)
        pixels = torch.cat(rows) * 2.0 - 1.0
        config = self.vae.config
        with torch.no_grad(), self.vae_on_device():
            z = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist.mode()
        return (z.float() - (config.shift_factor or 0.0)) * config.scaling_factor

    def free_text_encoders(self) -> None:
        """Drop the text encoders (e.g. once every training prompt is cached). Encoding a prompt
        that is not cached afterwards raises ValueError."""
        for name in self.text_encoder_names:
            if name in self.components:
                self.components[name] = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------- prompts
    def clear_cache(self) -> None:
        """Forget every cached prompt embedding."""
        self.prompt_cache.clear()

    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        """Embeddings of ``prompts`` (each tensor (len(prompts), ...)), text encoders on device."""
        raise NotImplementedError

    def _encode_uncached(self, prompts: list[str]) -> dict[str, Tensor]:
        if any(self.components.get(n) is None for n in self.required_text_encoders()):
            raise ValueError(f"cannot encode {len(prompts)} uncached prompt(s) (e.g. {prompts[0]!r}): "
                             "the text encoders were freed; encode every prompt before "
                             "free_text_encoders()")
        with torch.no_grad(), self.text_encoders_on_device():
            batch = self._encode_batch(prompts)
        return {k: v.to(self.device) for k, v in batch.items()}

    def required_text_encoders(self) -> tuple[str, ...]:
        return self.text_encoder_names

    def negative_prompt(self) -> str | None:
        """The CFG negative prompt, or None when the family/options have no real CFG."""
        return None

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Embeddings for ``prompts`` (B rows) and, with real CFG, for the negative prompt
        (broadcast to B rows). Each distinct prompt is encoded once and cached."""
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of str (wrap a single prompt in a list)")
        if not prompts:
            raise ValueError("prompts is empty")
        prompts = list(prompts)
        positive = self.prompt_cache.lookup(prompts, self._encode_uncached)
        negative = None
        negative_prompt = self.negative_prompt()
        if negative_prompt is not None:
            self.prompt_cache.pinned.add(negative_prompt)
            row = self.prompt_cache.lookup([negative_prompt], self._encode_uncached)
            negative = {k: v.expand(len(prompts), *v.shape[1:]) for k, v in row.items()}
        return Conditioning(positive=positive, negative=negative, extra=self._extra_conditioning(positive))

    def _extra_conditioning(self, positive: dict[str, Tensor]) -> dict[str, Tensor]:
        return {}

    def _use_cfg(self, cond: Conditioning, guidance_scale: float) -> bool:
        """Real CFG runs when guidance_scale > 1 (the stock pipelines' rule); it needs the negative."""
        if not self.has_real_cfg or guidance_scale <= 1.0:
            return False
        if cond.negative is None:
            raise ValueError(f"guidance_scale={guidance_scale} > 1 needs negative-prompt embeddings, "
                             f"but the conditioning has none; load the {self.family} model with "
                             "options cfg=True or use guidance_scale=1")
        return True

    @staticmethod
    def _per_sample_sigma(sigma: Tensor | float, batch: int, device: torch.device) -> Tensor:
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=device).reshape(-1)
        if sigma.numel() == 1:
            sigma = sigma.expand(batch)
        if sigma.shape != (batch,):
            raise ValueError(f"sigma must be a scalar or have shape ({batch},) (got {tuple(sigma.shape)})")
        return sigma

    # ------------------------------------------------------------------------- LoRA
    def save_lora_weights(self, directory: str, transformer_lora_state_dict: dict[str, Tensor]) -> None:
        """Write the transformer LoRA with the stock pipeline class's ``save_lora_weights``
        (``pytorch_lora_weights.safetensors``, keys 'transformer.<module>.lora_A/B.weight', the
        LoraConfig as metadata), so ``pipe.load_lora_weights(directory)`` restores it exactly."""
        if not transformer_lora_state_dict:
            raise ValueError("transformer_lora_state_dict is empty; pass model.lora_state_dict() "
                             "(peft.get_peft_model_state_dict of the transformer)")
        state_dict = strip_peft_wrapper_prefix(transformer_lora_state_dict)
        self.pipeline_class.save_lora_weights(
            directory, transformer_lora_layers=state_dict,
            transformer_lora_adapter_metadata=lora_adapter_metadata(self.transformer))
