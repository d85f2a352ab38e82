"""E2PO's embedding-perturbed exploration (arXiv 2605.15803, ``sampling.embedding_perturbation``).

A group's members are rolled out from structured perturbations of their prompt's embedding, so
that the group keeps reward variance once the policy's samples of one prompt have grown alike;
the update (DiffusionNFT, ``training.algorithm: nft``) trains on the *original* embedding, since
the sample-based algorithms re-encode the batch's prompts for their forwards
(``FlowPolicy.replay_condition``) and keep nothing of the rollout's conditioning.

What the paper states and this module implements:

- perturbations of the text embedding within sample groups, structured: member m of a group
  (after the anchors) moves along direction k = (m - anchors) // 2 of the group's orthonormal
  set, with sign + for even (m - anchors) and - for odd (antithetic pairs), one set per
  (run seed, iteration, group, embedding key), drawn by QR of a Gaussian matrix;
- a reference-anchored batch: the first ``anchors`` members of every group keep the original
  embedding;
- a noise-aware schedule: the perturbation's size at a step is ``scale * s(sigma)`` with
  s = 1, sigma or 1 - sigma (``schedule``).

Each token e (the last dimension D of a prompt-embedding tensor) of a perturbed member becomes
e + scale s(sigma) ||e|| c u with u its unit direction and c = +-1: a move of relative size
scale s(sigma), the same direction for every token of the row. Only the positive (prompt)
branch is perturbed; CFG's negative prompt and the editing families' source images are not.

What is not implemented: the paper's perturbations are *learned*, and its learning rule (and
the exact form of its schedule) could not be recovered from the text available here; these
perturbations are drawn, not learned (docs/algorithms.md, "E2PO").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowgrpo.checks import Section, choice, config_field, int_at_least, positive
from flowgrpo.errors import ConfigError
from flowgrpo.model import Conditioning
from flowgrpo.seeding import seeded_generator

# s(sigma), the noise-aware factor of the perturbation's size at a step of noise level sigma
EMBEDDING_SCHEDULES = ("constant", "sigma", "one_minus_sigma")
# The Conditioning.positive keys that hold prompt embeddings unless a family says otherwise
# (its adapter's ``text_embedding_keys``; LTX-2 names its text tokens video_text / audio_text).
DEFAULT_TEXT_EMBEDDING_KEYS = ("prompt_embeds", "pooled_prompt_embeds")


@dataclass
class EmbeddingPerturbationConfig(Section):
    """E2PO's exploration (``sampling.embedding_perturbation``; flowgrpo/embedding_perturbation.py)."""

    scale: float = config_field(
        "E2PO: relative size of the prompt-embedding perturbation of a group's non-anchor "
        "members (each token e moves by scale * s(sigma) * ||e|| along a unit direction). 0 = "
        "off: every member samples from the original embedding.", default=0.0)
    anchors: int = config_field(
        "Members of each group that keep the original embedding (E2PO's reference-anchored "
        "batch); the others move along antithetic pairs of orthonormal directions.", default=1)
    schedule: str = config_field(
        "Noise-aware factor s(sigma) of the size at a step of noise level sigma: 'constant' (1), "
        "'sigma' (largest at pure noise, 0 at the data) or 'one_minus_sigma'.", default="sigma")

    def validate(self) -> None:
        positive(self.scale, "sampling.embedding_perturbation.scale", allow_zero=True)
        int_at_least(self.anchors, 0, "sampling.embedding_perturbation.anchors")
        choice(self.schedule, EMBEDDING_SCHEDULES, "sampling.embedding_perturbation.schedule")

    @property
    def enabled(self) -> bool:
        return self.scale > 0


def check_embedding_perturbation_config(config) -> None:
    """sampling.embedding_perturbation against the other sections (a cross-section rule of
    ``flowgrpo.config.validate``): a flow policy whose update re-encodes the original prompts
    (a sample-based algorithm), with at least one perturbed member a group."""
    p, t = config.sampling.embedding_perturbation, config.training
    if not p.enabled:
        return
    why = ("sampling.embedding_perturbation (E2PO) rolls group members out from perturbed prompt "
           "embeddings and trains on the original ones")
    if config.policy != "flow":
        raise ConfigError(f"{why}; it is for policy: flow: set sampling.embedding_perturbation."
                          f"scale: 0")
    if t.algorithm == "grpo":
        raise ConfigError(f"{why}; training.algorithm grpo replays the rollout's SDE transitions, "
                          f"whose log-probs were taken under the perturbed embedding, against the "
                          f"original one (off-policy from the first pass): use a sample-based "
                          f"algorithm (nft, E2PO's; awm, dgpo, dpo, gdro) or set "
                          f"sampling.embedding_perturbation.scale: 0")
    if p.anchors >= t.group_size:
        raise ConfigError(f"{why}; sampling.embedding_perturbation.anchors {p.anchors} keeps "
                          f"every member of a group of training.group_size {t.group_size} "
                          f"unperturbed: set anchors below group_size")


def directions_needed(group_size: int, anchors: int) -> int:
    """K = ceil((group_size - anchors) / 2): the orthonormal directions a group's perturbed
    members use (two members, of opposite signs, a direction)."""
    return max(0, -(-(group_size - anchors) // 2))


def member_direction(member: int, anchors: int) -> tuple[int, float]:
    """(direction index k, sign c) of group member ``member`` (0-based): (-1, 0.0) for an anchor
    (member < anchors), else k = (member - anchors) // 2 and c = +1 for even member - anchors,
    -1 for odd (antithetic pairs)."""
    if member < anchors:
        return -1, 0.0
    offset = member - anchors
    return offset // 2, 1.0 if offset % 2 == 0 else -1.0


def orthonormal_directions(dim: int, count: int, generator: torch.Generator) -> Tensor:
    """(count, dim) float32 orthonormal rows: the Q factor of a (dim, count) standard normal
    matrix, signs fixed by R's diagonal (a Haar-distributed orthonormal frame). ValueError when
    count > dim."""
    if count > dim:
        raise ValueError(f"{count} orthonormal directions do not fit in an embedding of dimension "
                         f"{dim}: lower training.group_size or raise "
                         f"sampling.embedding_perturbation.anchors")
    q, r = torch.linalg.qr(torch.randn(dim, count, generator=generator))
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).T.contiguous()


def schedule_factor(schedule: str, sigmas: Tensor) -> Tensor:
    """(b,) float32 s(sigma) of ``schedule`` (EMBEDDING_SCHEDULES) at sigmas (b,)."""
    sigmas = sigmas.float()
    if schedule == "constant":
        return torch.ones_like(sigmas)
    if schedule == "sigma":
        return sigmas.clone()
    if schedule == "one_minus_sigma":
        return 1.0 - sigmas
    raise ValueError(f"schedule must be one of {EMBEDDING_SCHEDULES} (got {schedule!r})")


def perturb_rows(embedding: Tensor, directions: Tensor, sizes: Tensor) -> Tensor:
    """embedding (b, ..., D) -> e + size_r ||e|| u_r for every token e of row r (the norm over
    D, u_r = directions[r] (b, D), computed in float32, returned in the embedding's dtype); rows
    of size 0 are returned bit for bit."""
    b, dim = embedding.shape[0], embedding.shape[-1]
    shape = (b,) + (1,) * (embedding.ndim - 1)
    values = embedding.float()
    norms = values.norm(dim=-1, keepdim=True)
    steps = directions.to(values).reshape(b, *(1,) * (embedding.ndim - 2), dim)
    moved = values + sizes.to(values).reshape(shape) * norms * steps
    keep = (sizes == 0).to(embedding.device).reshape(shape)
    return torch.where(keep, embedding, moved.to(embedding.dtype))


class EmbeddingPerturbation:
    """The perturbation of one iteration's rollout, before it knows its rows: the config, the
    family's embedding keys, the group size, the seed and the iteration."""

    def __init__(self, config: EmbeddingPerturbationConfig, keys: tuple[str, ...],
                 group_size: int, seed: int, iteration: int) -> None:
        self.config = config
        self.keys = tuple(keys)
        self.group_size = group_size
        self.seed = seed
        self.iteration = iteration

    def bind(self, cond: Conditioning, group_ids: Tensor, sample_ids: Tensor) -> "RowPerturbation":
        """The perturbation of a rollout's rows: group_ids/sample_ids (B,) int64. Sample j of an
        iteration is member j mod group_size of its group (``Trainer.local_batch``). ValueError
        when ``cond`` (the rollout's encoded prompts) has none of the family's embedding keys."""
        keys = tuple(k for k in self.keys if k in cond.positive)
        if not keys:
            raise ValueError(f"sampling.embedding_perturbation perturbs the prompt embeddings "
                             f"{list(self.keys)}, and this model's conditioning has none of them "
                             f"(it has {sorted(cond.positive)}): its adapter must name its "
                             f"prompt-embedding keys in text_embedding_keys")
        members = [member_direction(int(s) % self.group_size, self.config.anchors)
                   for s in sample_ids.tolist()]
        return RowPerturbation(self, keys, group_ids.long().cpu(),
                               torch.tensor([k for k, _ in members]),
                               torch.tensor([c for _, c in members]))


class RowPerturbation:
    """One rollout's perturbation (``RolloutSettings.embedding_perturbation``): per row of the
    RolloutBatch its group, direction index and sign; ``condition`` perturbs a chunk's
    conditioning at a step."""

    def __init__(self, owner: EmbeddingPerturbation, keys: tuple[str, ...], group_ids: Tensor,
                 direction_index: Tensor, signs: Tensor) -> None:
        self.owner = owner
        self.keys = keys
        self.group_ids = group_ids
        self.direction_index = direction_index
        self.signs = signs
        self.count = directions_needed(owner.group_size, owner.config.anchors)
        self._directions: dict[tuple[int, str], Tensor] = {}

    def directions(self, group: int, key: str, dim: int) -> Tensor:
        """(K, dim) the orthonormal directions of ``group`` for embedding ``key``, drawn by
        (seed, iteration, "embedding_perturbation", group, key)."""
        if (group, key) not in self._directions:
            o = self.owner
            generator = seeded_generator(o.seed, o.iteration, "embedding_perturbation", group, key)
            self._directions[(group, key)] = orthonormal_directions(dim, self.count, generator)
        return self._directions[(group, key)]

    def sizes(self, rows: Tensor, sigmas: Tensor) -> Tensor:
        """(b,) signed relative sizes scale * s(sigma) * c of rows (b,) at sigmas (b,)."""
        rows = rows.long().cpu()
        factor = schedule_factor(self.owner.config.schedule, sigmas.detach().float().cpu())
        return self.owner.config.scale * factor * self.signs[rows]

    def condition(self, cond: Conditioning, rows: Tensor, sigmas: Tensor) -> Conditioning:
        """``cond`` of rows (b,) (indices into the RolloutBatch) with its prompt embeddings
        perturbed at noise levels sigmas (b,); ``cond`` itself when no row moves."""
        sizes = self.sizes(rows, sigmas)
        if not bool((sizes != 0).any()):
            return cond
        rows = rows.long().cpu()
        positive = dict(cond.positive)
        for key in self.keys:
            embedding = positive[key]
            dim = embedding.shape[-1]
            unit = torch.zeros(len(rows), dim)
            for i, row in enumerate(rows.tolist()):
                k = int(self.direction_index[row])
                if k >= 0:
                    unit[i] = self.directions(int(self.group_ids[row]), key, dim)[k]
            positive[key] = perturb_rows(embedding, unit.to(embedding.device), sizes)
        return Conditioning(positive, cond.negative, dict(cond.extra))
