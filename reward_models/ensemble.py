"""A reward ensemble: several member rewards scored on the same samples, their mean as the score
and their spread as the uncertainty (a penalty on it, and a source for the KL gate).

    {name: ensemble, options: {members: [{name: toy_proxy, seed: 0}, {name: toy_proxy, seed: 1}],
                               penalty: 0.5}}

Main score (what the weighted total and the advantages use)::

    score = mean_m r_m - penalty * std_m r_m

over the M members (std with ``ddof``: 0, the population std, by default). Components (logged
as ``<key>.<component>``, e.g. ``ensemble.std``, and usable by ``training.gardo.kl_gate_key``):
``mean``, ``std`` and each member's score under its key (the member spec's ``label``, else its
reward name, else ``<name>_<index>`` when two members share a name). Members should score on a
common scale (several members of one proxy); for rewards on different scales (PickScore and
HPS) the std mixes their units, so wrap each in a class that puts them on one scale first.

A sample that any member scores NaN ("no score") gets NaN for ``mean``, ``std`` and the main
score: an ensemble missing a member cannot say how much its members agree. The member's own
component is NaN there; the other members keep their scores.

Members load like any reward (``load_reward``: registered names, entry points,
``module:Class``; their own options, ``device``, ``batch_size``, videos per frame or natively),
on the ensemble's device and dtype unless a member sets its own.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .loading import _split_spec, load_reward

ENSEMBLE_KEYS = ("mean", "std")


def member_keys(members: list) -> list[str]:
    """The component key of each member spec: its ``label``, else its name's last part, else
    ``<name>_<index>`` where names repeat. Raises ValueError for a bad or repeated key."""
    names = []
    for spec in members:
        name, options = _split_spec(spec)
        names.append((options.get("label"), name.rpartition(":")[2].rpartition(".")[2]))
    counts: dict[str, int] = {}
    for label, name in names:
        if label is None:
            counts[name] = counts.get(name, 0) + 1
    keys = []
    for index, (label, name) in enumerate(names):
        key = label if label is not None else (name if counts[name] == 1 else f"{name}_{index}")
        if not isinstance(key, str) or not key or "." in key or key in ENSEMBLE_KEYS:
            raise ValueError(f"ensemble member {index}: key {key!r} must be a non-empty string "
                             f"without '.' and not one of {ENSEMBLE_KEYS}; set its 'label'")
        if key in keys:
            raise ValueError(f"ensemble member {index}: key {key!r} is used twice; give the "
                             f"members distinct 'label's")
        keys.append(key)
    return keys


def declared_components(name: str, options: dict) -> tuple[str, ...] | None:
    """The component names a reward spec will output, where they are known before it loads:
    an ensemble's ``mean``, ``std`` and member keys; None for any other reward (known once it
    loads) and for members the ensemble will refuse when it loads."""
    if name != "ensemble" or not isinstance(options.get("members"), list):
        return None
    try:
        return (*ENSEMBLE_KEYS, *member_keys(options["members"]))
    except (TypeError, ValueError):
        return None   # the ensemble reports its own error when it loads


class EnsembleReward:
    """Mean of the members minus ``penalty`` times their std (see the module docstring).

    Args:
        members: at least two reward specs (names or dicts, as in ``rewards.components``, with
            an optional ``label``).
        penalty: >= 0, weight of the std subtracted from the mean (0: the plain mean).
        ddof: 0 (population std) or 1 (unbiased) over the members.
    """

    name = "ensemble"
    video_native = True   # members score videos themselves (per frame or natively)

    def __init__(self, members: list, penalty: float = 0.0, ddof: int = 0,
                 device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32):
        if not isinstance(members, (list, tuple)) or len(members) < 2:
            raise ValueError(f"reward 'ensemble': members must be a list of at least 2 reward "
                             f"specs (got {members!r})")
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or \
                not math.isfinite(penalty) or penalty < 0:
            raise ValueError(f"reward 'ensemble': penalty must be a finite number >= 0 "
                             f"(got {penalty!r})")
        if ddof not in (0, 1):
            raise ValueError(f"reward 'ensemble': ddof must be 0 or 1 (got {ddof!r})")
        self.keys = member_keys(list(members))
        self.members = [load_reward(spec, device=device, dtype=dtype) for spec in members]
        self.penalty = float(penalty)
        self.ddof = ddof

    @property
    def component_names(self) -> tuple[str, ...]:
        """Every key ``components`` returns, known without scoring anything."""
        return (*ENSEMBLE_KEYS, *self.keys)

    def score_and_components(self, media: Tensor, prompts: list[str],
                             metadata: list[dict] | None = None
                             ) -> tuple[Tensor, dict[str, Tensor]]:
        """Main score (B,) and components {mean, std, <member key>...}, each (B,) float32."""
        scores = torch.stack([member(media, prompts, metadata) for member in self.members])
        mean, std = ensemble_statistics(scores, self.ddof)
        parts = {"mean": mean, "std": std, **dict(zip(self.keys, scores))}
        return mean - self.penalty * std, parts

    def components(self, media: Tensor, prompts: list[str],
                   metadata: list[dict] | None = None) -> dict[str, Tensor]:
        return self.score_and_components(media, prompts, metadata)[1]

    def __call__(self, media: Tensor, prompts: list[str],
                 metadata: list[dict] | None = None) -> Tensor:
        return self.score_and_components(media, prompts, metadata)[0]


def ensemble_statistics(scores: Tensor, ddof: int = 0) -> tuple[Tensor, Tensor]:
    """(M, B) member scores -> mean (B,) and std (B,) over the members (std with ``ddof``),
    computed in float64 and returned as float32; NaN for a sample where any member is NaN."""
    values = scores.to(torch.float64)
    mean = values.mean(dim=0)
    std = ((values - mean).pow(2).sum(dim=0) / (values.shape[0] - ddof)).sqrt()
    return mean.to(torch.float32), std.to(torch.float32)
