"""Seeds as pure functions of names: every random draw of a run (prompts, noise, plans, tokens,
evaluation) takes a generator seeded by a tuple such as (seed, iteration, "epoch", 3), so a batch
split over several processes draws what one process would, and a resumed run repeats the
uninterrupted one."""
from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from a tuple of ints/strings (stable across processes and Python runs)."""
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seeded_generator(*parts: int | str) -> torch.Generator:
    """A CPU generator seeded by ``derive_seed(*parts)``."""
    return torch.Generator("cpu").manual_seed(derive_seed(*parts))
