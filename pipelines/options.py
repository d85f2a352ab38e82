"""Options of the diffusers-backed adapters: the fields every family's options dataclass
extends (``AdapterOptions``), parsing a config's ``model.options`` into it with errors naming the
option, sizes and dtypes, and the attention backend. Nothing here loads weights."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch

from flowgrpo.dtypes import DTYPE_NAMES, parse_dtype


ATTENTION_BACKENDS = ("sdpa", "xformers")


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


def check_divisible(value: int, multiple: int, name: str, family: str, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"options.{name} must be a positive int (got {value!r})")
    if value % multiple:
        lower = max(value - value % multiple, multiple)
        raise ValueError(f"options.{name} must be divisible by {multiple} for {family} ({why}); "
                         f"got {value}, try {lower} or {lower + multiple}")
