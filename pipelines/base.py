"""Machinery shared by the diffusers-backed adapters (``sd3.py``, ``flux.py``, ``wan.py``).

The interface they implement, ``FlowModel``, lives in the core (``flowgrpo/model.py``).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import typing
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch
from torch import Tensor

from flowgrpo.dtypes import DTYPE_NAMES, parse_dtype
from flowgrpo.errors import InputError
from flowgrpo.hub import require_hub_file
from flowgrpo.model import Conditioning


# ================================================================================================
# Shared machinery of the diffusers-backed adapters (pipelines/sd3.py, flux.py, wan.py): option
# parsing, folder and size checks done before any weights load, the per-prompt embedding cache,
# CPU offloading, attention backend, LoRA target checks and LoRA saving. Nothing here samples.
# ================================================================================================
ATTENTION_BACKENDS = ("sdpa", "xformers")
# The file of a checkpoint's LoRA, as the stock pipelines' save_lora_weights / load_lora_weights name it.
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass
class AdapterOptions:
    """Options every diffusers-backed adapter accepts; each family's options dataclass extends it.
    Passed to ``load_model(..., options={...})`` as a dict; unknown keys are an error."""

    offload_text_encoders: bool = field(default=False, metadata={"help": (
        "Keep the text encoders on the CPU and move them to the device only while encoding prompts "
        "that are not cached yet. Saves their memory (T5-XXL: ~9 GB in bf16) during training.")})
    offload_vae: bool = field(default=False, metadata={"help": (
        "Keep the VAE on the CPU and move it to the device only while decoding.")})
    attention_backend: str = field(default="sdpa", metadata={"help": (
        "'sdpa' (torch scaled_dot_product_attention, default) or 'xformers' (needs the xformers "
        "package).")})
    vae_slicing: bool = field(default=False, metadata={"help": (
        "Decode one sample at a time (vae.enable_slicing()): lower peak memory for large batches.")})
    vae_tiling: bool = field(default=False, metadata={"help": (
        "Decode in overlapping tiles (vae.enable_tiling()): lower peak memory for large media.")})
    text_encoder_dtype: str | None = field(default=None, metadata={"help": (
        "dtype of the text encoders: 'float32', 'bfloat16' or 'float16'; None = the model dtype.")})
    vae_dtype: str | None = field(default=None, metadata={"help": (
        "dtype of the VAE: 'float32', 'bfloat16' or 'float16'; None = the model dtype.")})
    prompt_cache_size: int = field(default=256, metadata={"help": (
        "How many distinct prompts keep their embeddings (least recently used evicted first; the "
        "negative prompt is always kept). 0 = no cache beyond the current call.")})

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"options.attention_backend must be one of {list(ATTENTION_BACKENDS)} "
                             f"(got {self.attention_backend!r})")
        for name in ("text_encoder_dtype", "vae_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPE_NAMES:
                raise ValueError(f"options.{name} must be None or one of {list(DTYPE_NAMES)} "
                                 f"(got {value!r})")
        if self.prompt_cache_size < 0:
            raise ValueError(f"options.prompt_cache_size must be >= 0 (got {self.prompt_cache_size})")


def _matches_type(value: Any, hint: Any) -> bool:
    """isinstance for the plain field types used by option dataclasses (bool, int, float, str,
    X | None, tuple[...]); bools are not ints here, ints are accepted for floats."""
    args = typing.get_args(hint)
    if args and type(None) in args:
        return value is None or any(_matches_type(value, a) for a in args if a is not type(None))
    origin = typing.get_origin(hint) or hint
    if origin is bool:
        return isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(origin, type):
        return isinstance(value, origin)
    return True


def parse_options(options_class: type, options: Any, family: str) -> Any:
    """``options`` (None, a dict, or an ``options_class`` instance) as an ``options_class`` instance.
    Unknown keys and wrongly typed values raise ValueError/TypeError naming the key."""
    if options is None:
        return options_class()
    if isinstance(options, options_class):
        return options
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict or {options_class.__name__} (got {type(options).__name__})")
    valid = [f.name for f in fields(options_class)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown {family} option(s) {unknown}; valid options are {valid}")
    hints = typing.get_type_hints(options_class)
    for key, value in options.items():
        if not _matches_type(value, hints[key]):
            raise TypeError(f"options.{key} must be {hints[key]} (got {value!r})")
    return options_class(**options)


def resolve_size(options: Any, defaults: Mapping[str, int]) -> Any:
    """``options`` with each size field that is None (height, width, num_frames) set to its
    default in ``defaults``: the size the family's stock pipeline samples at when given none."""
    missing = {name: value for name, value in defaults.items() if getattr(options, name) is None}
    return dataclasses.replace(options, **missing) if missing else options


def resolve_dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    """torch dtype for a name in ``DTYPE_NAMES``; None -> ``default``."""
    return default if name is None else parse_dtype(name)


def text_model_dtype(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype keyword of transformers' ``from_pretrained``: ``dtype`` from 4.56 on,
    ``torch_dtype`` before (where ``dtype`` would be silently ignored)."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def require_attention_backend(backend: str) -> None:
    """Fail fast (before loading weights) when the chosen attention backend is not installed."""
    if backend == "xformers" and importlib.util.find_spec("xformers") is None:
        raise ValueError("options.attention_backend='xformers' needs the xformers package "
                         "(pip install 'flowgrpo[gpu]'); use attention_backend='sdpa' otherwise")


def apply_attention_backend(transformer: torch.nn.Module, backend: str) -> None:
    """Switch the transformer's attention to ``backend``; 'sdpa' is diffusers' default."""
    if backend == "sdpa":
        return
    processors = transformer.attn_processors.values()
    if any(hasattr(p, "_attention_backend") for p in processors):
        transformer.set_attention_backend(backend)          # dispatcher-based processors (FLUX, Wan)
    else:
        transformer.enable_xformers_memory_efficient_attention()   # legacy processors (SD3)


def is_local_path(path_or_hub_id: str) -> bool:
    """True for an existing folder or anything that cannot be a hub id ('org/name')."""
    path = os.path.expanduser(path_or_hub_id)
    if os.path.isdir(path):
        return True
    return not (_HUB_ID.fullmatch(path_or_hub_id) and not path_or_hub_id.startswith("."))


def check_pipeline_folder(path_or_hub_id: str, required: Mapping[str, str], family: str) -> None:
    """Check a local pipeline folder before loading: it exists, has ``model_index.json`` and, for
    each required component subfolder, the file that proves it is there (``required`` maps
    subfolder -> file, e.g. {"vae": "config.json"}). Hub ids ('org/name') are left to
    ``from_pretrained``."""
    if not isinstance(path_or_hub_id, (str, os.PathLike)):
        raise TypeError(f"path_or_hub_id must be a str (got {type(path_or_hub_id).__name__})")
    path_or_hub_id = os.fspath(path_or_hub_id)
    if not is_local_path(path_or_hub_id):
        return
    path = os.path.expanduser(path_or_hub_id)
    if not os.path.isdir(path):
        raise ValueError(f"{family} model folder {path_or_hub_id!r} does not exist (and is not a hub id "
                         "'org/name'); pass a diffusers pipeline folder or a hub id")
    missing = [] if os.path.isfile(os.path.join(path, "model_index.json")) else ["model_index.json"]
    missing += [f"{sub}/{name}" for sub, name in required.items()
                if not os.path.isfile(os.path.join(path, sub, name))]
    if missing:
        raise ValueError(f"{family} model folder {path_or_hub_id!r} lacks {missing}; it must be a "
                         f"diffusers pipeline folder with the components {sorted(required)} "
                         "(as written by the pipeline's save_pretrained)")


def _component_file(class_name: str) -> str | None:
    """The file a saved component's subfolder must hold, from its class name (None: any)."""
    if class_name.endswith("Scheduler"):
        return "scheduler_config.json"
    if "Tokenizer" in class_name:
        return "tokenizer_config.json"
    if "Processor" in class_name or "FeatureExtractor" in class_name:
        return None
    return "config.json"


def check_model_source(path_or_hub_id: str | os.PathLike, family: str,
                       field: str = "model.path") -> None:
    """Fail with one message naming the model, the likely cause and the fix when a diffusers
    pipeline cannot be loaded from ``path_or_hub_id``: a local folder that does not exist, has
    no model_index.json or lacks a component's config (an incomplete download), or a hub id
    whose model_index.json cannot be read (offline without a cached copy, a gated repository
    without an accepted license and login, a wrong id; ``flowgrpo.hub``). Reads no weights, so a
    trainer calls it before anything else loads. Raises ``InputError``."""
    source = os.fspath(path_or_hub_id)
    what = f"a diffusers pipeline of family {family!r}"
    if not is_local_path(source):
        require_hub_file(source, "model_index.json", what=what, field=field)
        return
    folder = os.path.expanduser(source)
    fetch = ("download it with `huggingface-cli download <hub id> --local-dir "
             f"{source}` (or save a pipeline there with pipe.save_pretrained), or set {field} to "
             f"the hub id")
    if not os.path.isdir(folder):
        raise InputError(f"{field}: {source!r} does not exist and is not a hub id 'owner/name': "
                         f"give the folder of {what} or its hub id")
    index = read_model_index(folder)
    if not index:
        raise InputError(f"{field}: {source!r} is not a diffusers pipeline folder (it has no "
                         f"model_index.json): {fetch}")
    missing = []
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or \
                spec[0] is None or spec[1] is None:
            continue
        sub = os.path.join(folder, name)
        required = _component_file(str(spec[1]))
        if not os.path.isdir(sub):
            missing.append(f"{name}/{required or ''}")
        elif required is not None and not os.path.isfile(os.path.join(sub, required)):
            missing.append(f"{name}/{required}")
    if missing:
        raise InputError(f"{field}: the pipeline folder {source!r} is incomplete, it lacks "
                         f"{', '.join(missing)} (an interrupted or partial download): {fetch}")


def read_model_index(path_or_hub_id: str) -> dict:
    """model_index.json of a local folder ({} for a hub id, whose index is not downloaded here)."""
    index = os.path.join(os.path.expanduser(path_or_hub_id), "model_index.json")
    if not os.path.isfile(index):
        return {}
    with open(index) as handle:
        return json.load(handle)


def check_divisible(value: int, multiple: int, name: str, family: str, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"options.{name} must be a positive int (got {value!r})")
    if value % multiple:
        lower = max(value - value % multiple, multiple)
        raise ValueError(f"options.{name} must be divisible by {multiple} for {family} ({why}); "
                         f"got {value}, try {lower} or {lower + multiple}")


def check_lora_targets(transformer: torch.nn.Module, targets: list[str], family: str) -> None:
    """Every PEFT target name (exact module name or '.'-suffix, PEFT's list matching) must match
    at least one Linear module; a silent empty match would train nothing."""
    linear_names = [name for name, module in transformer.named_modules()
                    if isinstance(module, torch.nn.Linear)]
    unmatched = [t for t in targets
                 if not any(name == t or name.endswith("." + t) for name in linear_names)]
    if unmatched:
        raise ValueError(f"{family} LoRA target modules {unmatched} match no Linear module of "
                         f"{type(transformer).__name__}; fix lora_target_modules")


def lora_adapter_metadata(transformer: torch.nn.Module) -> dict | None:
    """The LoraConfig of the transformer's (single) PEFT adapter as a JSON-able dict, so that the
    loader restores rank *and* alpha (without it diffusers assumes alpha = rank)."""
    configs = getattr(transformer, "peft_config", None)
    if not configs:
        return None
    if len(configs) > 1:
        active = getattr(transformer, "active_adapters", None)
        active = active() if callable(active) else active
        name = active[0] if active else next(iter(configs))
    else:
        name = next(iter(configs))
    metadata = configs[name].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in metadata.items()}


def strip_peft_wrapper_prefix(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Keys of ``get_peft_model_state_dict(get_peft_model(transformer))`` start with
    'base_model.model.'; diffusers expects the transformer's own module names."""
    prefix = "base_model.model."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}


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


class TransformerTraining:
    """What the flow policy needs to train an adapter's transformer (``flowgrpo.model.FlowModel``'s
    training methods), on diffusers models with PEFT: every family's transformer is one.
    ``denoisers()`` lists the diffusers models inside ``transformer`` (itself; Wan2.2's two
    experts) and ``trained_denoisers()`` those that train; an adapter with several overrides
    them and, where its files differ, ``lora_state_dict`` / ``save_full_weights``."""

    transformer: torch.nn.Module

    def denoisers(self, module: torch.nn.Module | None = None) -> list[torch.nn.Module]:
        """The diffusers models inside ``module`` (default: this adapter's transformer)."""
        return [self.transformer if module is None else module]

    def trained_denoisers(self) -> list[torch.nn.Module]:
        """The denoisers that LoRA wraps and full fine-tuning unfreezes."""
        return self.denoisers()

    def enable_gradient_checkpointing(self) -> None:
        for denoiser in self.denoisers():
            denoiser.enable_gradient_checkpointing()

    def train_full_weights(self) -> None:
        """Full fine-tuning: the weights of the trained denoisers require gradients."""
        for denoiser in self.trained_denoisers():
            denoiser.requires_grad_(True)

    def add_lora(self, rank: int, alpha: int, target_modules: list[str], init: str) -> None:
        """A LoRA adapter (rank, alpha, PEFT target names; ``init`` "gaussian" or "default",
        PEFT's Kaiming A and zero B) on each trained denoiser."""
        from peft import LoraConfig   # peft takes seconds to import

        for denoiser in self.trained_denoisers():
            denoiser.add_adapter(LoraConfig(
                r=rank, lora_alpha=alpha, target_modules=list(target_modules),
                init_lora_weights="gaussian" if init == "gaussian" else True))

    def _adapted(self) -> list[torch.nn.Module]:
        return [d for d in self.denoisers() if getattr(d, "_hf_peft_config_loaded", False)]

    def disable_lora(self) -> None:
        """Run the base weights (the KL reference of a LoRA run) until ``enable_lora``."""
        for denoiser in self._adapted():
            denoiser.disable_adapters()

    def enable_lora(self) -> None:
        for denoiser in self._adapted():
            denoiser.enable_adapters()

    def lora_state_dict(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The LoRA weights in PEFT's format (what ``save_lora_weights`` takes); ``state_dict``:
        the transformer's consolidated state under a sharded engine."""
        from peft import get_peft_model_state_dict   # peft takes seconds to import

        return get_peft_model_state_dict(self.transformer, state_dict=state_dict)

    def save_full_weights(self, folder: str | os.PathLike,
                          state_dict: dict[str, Tensor] | None = None) -> None:
        """The full fine-tuned transformer under ``folder/transformer`` (``from_pretrained``-
        loadable); ``state_dict`` as in ``lora_state_dict``."""
        save_diffusers_model(self.transformer, Path(folder) / "transformer", state_dict)


def save_diffusers_model(module: torch.nn.Module, folder: str | os.PathLike,
                         state_dict: dict[str, Tensor] | None = None) -> None:
    """``module.save_pretrained(folder)`` (a diffusers model: config + safetensors weights), with
    the weights of ``state_dict`` when given. diffusers' ``save_pretrained`` takes no state dict
    (one passed lands in its ``**kwargs`` unused) and saves the module's own, which under FSDP2
    holds only this process's shards: the consolidated weights are written here instead, as
    the single file ``from_pretrained`` reads."""
    if state_dict is None:
        module.save_pretrained(folder)
        return
    from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    module.save_config(folder)
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in state_dict.items()},
              str(folder / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})


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
