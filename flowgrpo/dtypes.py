"""Dtype names, one table: the names configs and options use, and the aliases users type."""
from __future__ import annotations

import torch

# The names configs accept (model.dtype, adapter and reward options), in this order in messages.
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
ALIASES: dict[str, str] = {"fp32": "float32", "float": "float32", "bf16": "bfloat16",
                           "fp16": "float16", "half": "float16"}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch dtype from a dtype or its name ("float16", "bf16", "torch.float32", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    key = ALIASES.get(key, key)
    if key not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join([*DTYPE_NAMES, *ALIASES])} "
                         f"(got {dtype!r})")
    return getattr(torch, key)
