"""A 0/1 reward for pass@k and verdict tests, loaded by dotted path like a user's own reward."""
from __future__ import annotations

from torch import Tensor


def parity_bit(media: Tensor) -> Tensor:
    """1.0 when floor(1000 * mean pixel) is odd, else 0.0: a deterministic verdict that varies
    from sample to sample like a weak model's exact-match verdict."""
    return (media.flatten(1).double().mean(1) * 1000).floor().remainder(2).float()


class ParityBit:
    name = "parity"

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return parity_bit(media)
