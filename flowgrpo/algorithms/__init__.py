"""The algorithm registry: ``training.algorithm`` -> the class that computes the update.

One file per algorithm; each is a ``FlowAlgorithm`` (``base.py``) that a ``FlowPolicy`` builds
with itself. ``grpo`` trains on the exact log-probs of SDE transitions the rollout keeps (the
clipped surrogate with its optional parts); ``nft``, ``awm``, ``dgpo``, ``dpo`` and ``gdro``
train on final samples re-noised by the forward process (``matching_losses.py``). Adding one: docs/design.md,
"Adding things".
"""
from __future__ import annotations

from flowgrpo.config_algorithms import ALGORITHM_NAMES
from flowgrpo.dotted import import_dotted

# training.algorithm -> "module:Class", imported on use
ALGORITHMS = {
    "grpo": "flowgrpo.algorithms.grpo:GRPO",
    "nft": "flowgrpo.algorithms.nft:NFT",
    "awm": "flowgrpo.algorithms.awm:AWM",
    "dgpo": "flowgrpo.algorithms.dgpo:DGPO",
    "dpo": "flowgrpo.algorithms.dpo:DiffusionDPO",
    "gdro": "flowgrpo.algorithms.gdro:GDRO",
}
assert tuple(ALGORITHMS) == ALGORITHM_NAMES


def algorithm_class(name: str) -> type:
    """The class registered under ``name`` (a validated ``training.algorithm``)."""
    return import_dotted(ALGORITHMS[name], "algorithm")
