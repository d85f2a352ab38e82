"""Groupwise rewards: rewards that score the members of a group (the samples of one prompt)
against each other, and the pairwise preference models behind them.

A groupwise reward sees every member of a group at once and returns one value per sample::

    score_groups(media, prompts, metadata, group_ids) -> (main (B,), components {key: (B,)})

It marks itself with ``groupwise = True`` (``reward_models.base.is_groupwise``); ``MultiReward``
calls ``score_groups`` when the caller passes ``group_ids`` (the flow policy's rollout does, with
the whole local batch, once the rollout is done: its chunks may split a group). Without group ids
(held-out evaluation, the comparison grid) there is no group to compare with: the main score is
NaN ("no score") and the components still carry the pointwise scores behind it, so evaluation
logs ``eval/<key>.<of key>``. A groupwise reward is refused in ``eval.rewards``
(``check_group_rewards``).

Built in:

``win_rate`` (Pref-GRPO, arXiv 2508.20751): each sample's win rate against the other members of
its group under a pairwise preference model::

    rate_i = 1 / (G - 1) * sum_{j != i} w_ij,    w_ij = 1 if i is preferred to j, 0 if j is,
                                                        1/2 on a tie            (wins: hard)
                                                 w_ij = P(i preferred to j)    (wins: soft)

Rates of a group sum to G / 2 (w_ij + w_ji = 1). Pref-GRPO's code judges each unordered pair once
and counts hard wins, 1/2 each when the judge names no winner (CodeGoat24/Pref-GRPO
fastvideo/rewards/unifiedreward_flex.py ``_pairwise_win_rate``), so ``wins: hard`` is the
default; ``soft`` uses the probabilities.

``group_rank``: the rank of a pointwise reward within its group, ties averaged, scaled to [0, 1]
(0 = the group's lowest, 1 = its highest). With hard wins, the win rate under a Bradley-Terry
model of a pointwise reward is exactly this rank (a member beats those below it and ties half of
its equals).

Config (``rewards.components`` entries; the options are parsed into typed specs at config load,
errors name the field)::

    - name: win_rate
      options:
        pairwise: {model: bradley_terry, of: pickscore, temperature: 1.0}
        wins: hard                        # hard (Pref-GRPO) | soft
    - name: group_rank
      options: {of: {name: geneval_toy, score: partial}}

``pairwise.model`` is a name of ``PAIRWISE_MODELS`` or a ``package.module:Class`` with
``prefer``; its other keys are that model's constructor options. ``of`` is a pointwise reward
spec as an ensemble member's (a name or ``{name: ..., <options>}``, options flat), loaded by
``load_reward`` on the reward's device; it may be a ``remote`` reward. A groupwise reward itself
cannot be served by ``flowgrpo serve-reward``: the protocol carries no group ids.

NaN: a member without a score (NaN pointwise score, or NaN preference) is left out of its group's
comparisons and gets NaN; the others' rates are over the comparisons that were made. A group with
fewer than two scored members gets NaN throughout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from flowgrpo.errors import ConfigError

from .base import is_groupwise, register_reward
from .loading import _split_spec, load_reward, resolve_reward_class

WINS = ("hard", "soft")
GROUPWISE_REWARDS = ("win_rate", "group_rank")


# --------------------------------------------------------------------------- pure functions

def win_rates(preferences: Tensor, wins: str = "hard") -> Tensor:
    """Win rate of each member of one group.

    preferences: (G, G) with P[i, j] = P(member i preferred to member j), NaN where the pair was
    not judged (the diagonal is ignored). ``wins``: "hard" counts w_ij = 1 / 0 / 1/2 as P[i, j]
    is above / below / at 1/2; "soft" uses w_ij = P[i, j].
    Returns (G,) float32: mean of w_ij over the judged j != i; NaN for a member with none.
    """
    if wins not in WINS:
        raise ValueError(f"wins must be one of {WINS} (got {wins!r})")
    if preferences.ndim != 2 or preferences.shape[0] != preferences.shape[1]:
        raise ValueError(f"preferences must be (G, G) (got {tuple(preferences.shape)})")
    p = preferences.to(torch.float64)
    size = p.shape[0]
    judged = ~torch.isnan(p) & ~torch.eye(size, dtype=torch.bool, device=p.device)
    w = (torch.where(p > 0.5, 1.0, torch.where(p < 0.5, 0.0, 0.5)) if wins == "hard" else p)
    total = torch.where(judged, w, 0.0).sum(dim=1)
    count = judged.sum(dim=1)
    rates = torch.where(count > 0, total / count.clamp(min=1), torch.nan)
    return rates.to(torch.float32)


def bradley_terry_matrix(scores: Tensor, temperature: float = 1.0) -> Tensor:
    """(G,) pointwise scores -> (G, G) P[i, j] = sigmoid((r_i - r_j) / temperature); NaN in the
    rows and columns of NaN scores. For PickScore's raw score (``logit_scale * cos``) at
    temperature 1 this is its training objective's softmax over the two images."""
    r = scores.to(torch.float64)
    return torch.sigmoid((r[:, None] - r[None, :]) / temperature)


def ranks_in_groups(scores: Tensor, group_ids: Tensor) -> Tensor:
    """(B,) scores, (B,) group ids -> (B,) float32 rank of each score in its group, ties
    averaged, scaled to [0, 1]: (#lower + #equal others / 2) / (G_valid - 1), over the group's
    non-NaN scores. NaN for NaN scores and in groups with fewer than two valid scores."""
    values = scores.to(torch.float64)
    out = torch.full_like(values, float("nan"))
    for group in torch.unique(group_ids):
        rows = (group_ids == group).nonzero()[:, 0]
        group_scores = values[rows]
        valid = ~torch.isnan(group_scores)
        n = int(valid.sum())
        if n < 2:
            continue
        v = group_scores[valid]
        lower = (v[None, :] < v[:, None]).sum(dim=1).to(torch.float64)
        equal = (v[None, :] == v[:, None]).sum(dim=1).to(torch.float64) - 1
        out[rows[valid]] = (lower + equal / 2) / (n - 1)
    return out.to(torch.float32)


def group_win_rates(preference_matrix, group_ids: Tensor, wins: str = "hard") -> Tensor:
    """(B,) win rates: ``preference_matrix(rows)`` gives the (G, G) preferences of the members
    ``rows`` (a (G,) index tensor) of one group; each group is judged on its own."""
    out = torch.full((len(group_ids),), float("nan"))
    for group in torch.unique(group_ids):
        rows = (group_ids == group).nonzero()[:, 0]
        out[rows] = win_rates(preference_matrix(rows), wins)
    return out


# --------------------------------------------------------------------------- pairwise models

@runtime_checkable
class PairwisePreference(Protocol):
    """A pairwise preference model: which of two samples of the same prompt is better."""

    def prefer(self, a: Tensor, b: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """a, b: (P, ...) media of P pairs, prompts/metadata: P entries (each pair's prompt).
        Returns (P,) float P(a_k preferred to b_k) in [0, 1]; NaN = not judged."""


def preference_matrix(model, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
    """(G, G) preferences of one group's members: the model's own ``preference_matrix`` where it
    has one (e.g. Bradley-Terry scores every member once), else ``prefer`` on each unordered pair
    once (as Pref-GRPO's judge), P[j, i] = 1 - P[i, j]."""
    own = getattr(model, "preference_matrix", None)
    if callable(own):
        return own(media, prompts, metadata).to(torch.float64)
    size = media.shape[0]
    first, second = torch.triu_indices(size, size, offset=1)
    out = torch.full((size, size), float("nan"), dtype=torch.float64)
    if len(first):
        p = torch.as_tensor(model.prefer(media[first], media[second],
                                         [prompts[i] for i in first.tolist()],
                                         [metadata[i] for i in first.tolist()]),
                            dtype=torch.float64).cpu()
        out[first, second] = p
        out[second, first] = 1 - p
    return out


class BradleyTerryPreference:
    """P(a preferred to b) = sigmoid((r_a - r_b) / temperature) for a pointwise reward r (``of``).

    For PickScore (raw, ``normalise: false``) at temperature 1 this is exactly the pairwise
    softmax PickScore was trained with (``logit_scale * cos`` are its logits); with
    ``normalise: true`` (scores / 26) use temperature 1/26 for the same probabilities."""

    def __init__(self, of, temperature: float = 1.0, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str = torch.float32):
        self.of = load_reward(of, device=device, dtype=dtype)
        self.temperature = float(temperature)

    def scores(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """(B,) the pointwise reward's scores."""
        return self.of(media, prompts, metadata)

    def preference_matrix(self, media: Tensor, prompts: list[str], metadata: list[dict]
                          ) -> Tensor:
        return bradley_terry_matrix(self.scores(media, prompts, metadata), self.temperature)

    def prefer(self, a: Tensor, b: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        r_a, r_b = self.scores(a, prompts, metadata), self.scores(b, prompts, metadata)
        return torch.sigmoid((r_a.double() - r_b.double()) / self.temperature).float()


PAIRWISE_MODELS: dict[str, type] = {"bradley_terry": BradleyTerryPreference}


# --------------------------------------------------------------------------- typed options

@dataclass(frozen=True)
class PairwiseSpec:
    """``win_rate``'s ``pairwise``: the model (a ``PAIRWISE_MODELS`` name or
    ``package.module:Class``) and its constructor options (Bradley-Terry: ``of``, a pointwise
    reward spec, and ``temperature`` > 0, default 1)."""

    model: str = "bradley_terry"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WinRateSpec:
    pairwise: PairwiseSpec
    wins: Literal["hard", "soft"] = "hard"


@dataclass(frozen=True)
class GroupRankSpec:
    of: Any   # a pointwise reward spec


def _check_pointwise(of: Any, where: str, known: list[str] | None) -> None:
    """``of`` must be a reward spec (a name or a dict with ``name``) of a pointwise reward."""
    if isinstance(of, dict):
        name = of.get("name")
    else:
        name = of
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: give a pointwise reward, a name (e.g. pickscore) or "
                          f"{{name: ..., <options>}} (got {of!r})")
    if name in GROUPWISE_REWARDS:
        raise ConfigError(f"{where}: {name!r} is itself groupwise; give a pointwise reward "
                          f"(e.g. pickscore, geneval_toy)")
    if known is not None and ":" not in name and name not in known:
        raise ConfigError(f"{where}: unknown reward {name!r}; available: {', '.join(known)}; "
                          f"or give your own class as 'package.module:Class'")


def parse_win_rate(options: dict, where: str, known: list[str] | None = None) -> WinRateSpec:
    """``win_rate``'s options -> WinRateSpec; ConfigError naming ``<where>.<field>``."""
    unknown = sorted(set(options) - {"pairwise", "wins"})
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: win_rate has no option {unknown[0]!r}; its "
                          f"options: pairwise, wins (and the generic label, device, batch_size)")
    wins = options.get("wins", "hard")
    if wins not in WINS:
        raise ConfigError(f"{where}.wins must be one of {', '.join(WINS)} (got {wins!r}): hard "
                          f"counts 1 / 0 / 1/2 per comparison (Pref-GRPO), soft the probabilities")
    pairwise = options.get("pairwise")
    if not isinstance(pairwise, dict):
        raise ConfigError(f"{where}.pairwise is required: the pairwise preference model, e.g. "
                          f"{{model: bradley_terry, of: pickscore, temperature: 1.0}} "
                          f"(got {pairwise!r})")
    model = pairwise.get("model", "bradley_terry")
    rest = {k: v for k, v in pairwise.items() if k != "model"}
    if not isinstance(model, str) or (model not in PAIRWISE_MODELS and ":" not in model):
        raise ConfigError(f"{where}.pairwise.model: unknown pairwise model {model!r}; "
                          f"available: {', '.join(PAIRWISE_MODELS)}, or "
                          f"'package.module:Class' with prefer(a, b, prompts, metadata)")
    if model == "bradley_terry":
        extra = sorted(set(rest) - {"of", "temperature"})
        if extra:
            raise ConfigError(f"{where}.pairwise.{extra[0]}: bradley_terry has no option "
                              f"{extra[0]!r}; its options: of, temperature")
        if "of" not in rest:
            raise ConfigError(f"{where}.pairwise.of is required: the pointwise reward the "
                              f"Bradley-Terry model compares (e.g. pickscore)")
        _check_pointwise(rest["of"], f"{where}.pairwise.of", known)
        temperature = rest.get("temperature", 1.0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
                not math.isfinite(temperature) or temperature <= 0:
            raise ConfigError(f"{where}.pairwise.temperature must be a finite number > 0 "
                              f"(got {temperature!r})")
    return WinRateSpec(PairwiseSpec(model, rest), wins)


def parse_group_rank(options: dict, where: str, known: list[str] | None = None) -> GroupRankSpec:
    """``group_rank``'s options -> GroupRankSpec; ConfigError naming ``<where>.<field>``."""
    unknown = sorted(set(options) - {"of"})
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: group_rank has no option {unknown[0]!r}; its "
                          f"option: of (and the generic label, device, batch_size)")
    if "of" not in options:
        raise ConfigError(f"{where}.of is required: the pointwise reward to rank (e.g. pickscore)")
    _check_pointwise(options["of"], f"{where}.of", known)
    return GroupRankSpec(options["of"])


PARSERS = {"win_rate": parse_win_rate, "group_rank": parse_group_rank}
# what load_reward handles for every reward, and MultiReward's keys
_GENERIC = ("device", "dtype", "batch_size", "video_frames", "video_aggregate", "weight", "label")


def check_group_rewards(config, known: list[str] | None = None) -> None:
    """At config load: the options of every groupwise reward of ``rewards.components`` (typed,
    ConfigError naming ``rewards.components[i].options.<field>``), and no groupwise reward where
    there are no groups: in ``eval.rewards``, among an ensemble's members, or behind
    ``run.select_best_on`` (NaN at every evaluation)."""
    groupwise_keys = []
    for i, spec in enumerate(config.rewards.components):
        if spec.name in PARSERS:
            options = {k: v for k, v in spec.options.items() if k not in _GENERIC}
            PARSERS[spec.name](options, f"rewards.components[{i}].options", known)
            if spec.weight != 0:
                groupwise_keys.append(spec.options.get("label", spec.name))
        members = spec.options.get("members") if spec.name == "ensemble" else None
        for j, member in enumerate(members if isinstance(members, list) else []):
            name = member.get("name") if isinstance(member, dict) else member
            if name in GROUPWISE_REWARDS:
                raise ConfigError(f"rewards.components[{i}].options.members[{j}]: {name!r} is "
                                  f"groupwise and an ensemble scores samples one by one; put "
                                  f"it in rewards.components itself")
    for i, spec in enumerate(config.eval.rewards):
        if spec.name in GROUPWISE_REWARDS:
            raise ConfigError(f"eval.rewards[{i}]: {spec.name!r} compares the samples of a "
                              f"training group, and the evaluation has no groups; use its "
                              f"pointwise reward there (its 'of'), which the evaluation can "
                              f"score")
    best = getattr(config.run, "select_best_on", None)
    if best and groupwise_keys:
        from flowgrpo.heldout import metric_reward_key

        name = best[len("eval/"):] if best.startswith("eval/") else best
        head = metric_reward_key(best)
        if head == "total" or (head in groupwise_keys and "." not in name.split("/")[0]):
            raise ConfigError(f"run.select_best_on {best!r}: the evaluation has no groups, so "
                              f"{head} is NaN there (groupwise reward {groupwise_keys[0]!r}); "
                              f"select on its pointwise score, eval/{groupwise_keys[0]}.<of key>,"
                              f" or on an eval.rewards metric")


def check_whole_groups(reward, per_process: int, group_size: int, num_processes: int) -> None:
    """A groupwise reward compares the members of a group on the process that holds them, so
    each process must hold whole groups (``Trainer.local_batch``: sample j is in group
    j // group_size; a group spans processes when per_process is not a multiple of it)."""
    if not getattr(reward, "groupwise", False) or per_process % group_size == 0:
        return
    keys = [key for key, r in reward.rewards.items() if is_groupwise(r)]
    raise ConfigError(f"rewards.components: a groupwise reward ({', '.join(keys)}) compares the "
                      f"samples of a group with each other, so each process must hold whole "
                      f"groups: {per_process} samples per process is not a multiple of "
                      f"training.group_size {group_size}; make training.prompts_per_iteration a "
                      f"multiple of the {num_processes} processes")


# --------------------------------------------------------------------------- the rewards

def _pointwise_key(of) -> str:
    name, options = _split_spec(of)
    label = options.get("label")
    return label if isinstance(label, str) and label else name.rpartition(":")[2].rpartition(".")[2]


def _nan_vector(batch: int) -> Tensor:
    return torch.full((batch,), float("nan"))


@register_reward("win_rate")
class WinRateReward:
    """Pref-GRPO's win rate of each sample against the other members of its group under a
    pairwise preference model (see the module docstring). Components: the pointwise scores under
    the ``of`` key when the model is Bradley-Terry."""

    name = "win_rate"
    groupwise = True
    video_native = True   # the preference model (its pointwise reward) handles videos

    def __init__(self, pairwise: dict, wins: str = "hard", device: str | torch.device = "cpu",
                 dtype: torch.dtype | str = torch.float32):
        try:
            spec = parse_win_rate({"pairwise": pairwise, "wins": wins}, "reward 'win_rate'")
        except ConfigError as err:
            raise ValueError(str(err)) from None
        self.wins = spec.wins
        options = dict(spec.pairwise.options)
        if spec.pairwise.model in PAIRWISE_MODELS:
            self.model = PAIRWISE_MODELS[spec.pairwise.model](**options, device=device,
                                                              dtype=dtype)
        else:
            self.model = resolve_reward_class(spec.pairwise.model)(**options)
        if not callable(getattr(self.model, "prefer", None)) and \
                not callable(getattr(self.model, "preference_matrix", None)):
            raise ValueError(f"reward 'win_rate': pairwise model {spec.pairwise.model!r} has no "
                             f"prefer(a, b, prompts, metadata)")
        self.score_key = _pointwise_key(options["of"]) if "of" in options else None

    def _pointwise(self, media, prompts, metadata) -> dict[str, Tensor]:
        """Bradley-Terry's pointwise scores under the ``of`` key; {} for other judges."""
        if self.score_key is None or not isinstance(self.model, BradleyTerryPreference):
            return {}
        return {self.score_key: self.model.scores(media, prompts, metadata)}

    def score_groups(self, media: Tensor, prompts: list[str], metadata: list[dict] | None,
                     group_ids: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Win rates (B,) of every member of every group, and the pointwise components."""
        metadata = list(metadata) if metadata is not None else [{} for _ in prompts]
        group_ids = torch.as_tensor(group_ids).cpu()
        pointwise = self._pointwise(media, prompts, metadata)
        if pointwise:   # Bradley-Terry: the matrix from scores computed once for the batch
            scores = pointwise[self.score_key]
            temperature = self.model.temperature

            def matrix(rows):
                return bradley_terry_matrix(scores[rows], temperature)
        else:
            def matrix(rows):
                picked = rows.tolist()
                return preference_matrix(self.model, media[rows], [prompts[i] for i in picked],
                                         [metadata[i] for i in picked])
        return group_win_rates(matrix, group_ids, self.wins), pointwise

    def score_and_components(self, media: Tensor, prompts: list[str],
                             metadata: list[dict] | None = None
                             ) -> tuple[Tensor, dict[str, Tensor]]:
        """Without groups (evaluation): NaN, and the pointwise scores behind the win rate."""
        return _nan_vector(len(prompts)), self._pointwise(media, prompts, metadata)

    def components(self, media, prompts, metadata=None) -> dict[str, Tensor]:
        return self.score_and_components(media, prompts, metadata)[1]

    def __call__(self, media, prompts, metadata=None) -> Tensor:
        return _nan_vector(len(prompts))


@register_reward("group_rank")
class GroupRankReward:
    """The rank of a pointwise reward (``of``) within each group, ties averaged, in [0, 1].
    Component: the pointwise scores under the ``of`` key."""

    name = "group_rank"
    groupwise = True
    video_native = True

    def __init__(self, of, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str = torch.float32):
        try:
            parse_group_rank({"of": of}, "reward 'group_rank'")
        except ConfigError as err:
            raise ValueError(str(err)) from None
        self.of = load_reward(of, device=device, dtype=dtype)
        self.score_key = _pointwise_key(of)

    def score_groups(self, media: Tensor, prompts: list[str], metadata: list[dict] | None,
                     group_ids: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        scores = self.of(media, prompts, metadata)
        return ranks_in_groups(scores, torch.as_tensor(group_ids).cpu()), {self.score_key: scores}

    def score_and_components(self, media, prompts, metadata=None):
        """Without groups (evaluation): NaN, and the pointwise scores."""
        return _nan_vector(len(prompts)), {self.score_key: self.of(media, prompts, metadata)}

    def components(self, media, prompts, metadata=None) -> dict[str, Tensor]:
        return self.score_and_components(media, prompts, metadata)[1]

    def __call__(self, media, prompts, metadata=None) -> Tensor:
        return _nan_vector(len(prompts))


__all__ = ["win_rates", "bradley_terry_matrix", "ranks_in_groups", "group_win_rates",
           "PairwisePreference", "BradleyTerryPreference", "PAIRWISE_MODELS", "preference_matrix",
           "WinRateReward", "GroupRankReward", "check_group_rewards", "check_whole_groups"]
