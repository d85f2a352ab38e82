"""The learning signal of an iteration: the rewards gathered over every process, the advantages
(``advantages.py``: group / batch scaling, decoupled multi-reward, saturation weights, regions;
one estimator per kind in ``ADVANTAGE_ESTIMATORS``, picked from the config by
``advantage_estimator``), the guards
against reward hacking on the gathered batch (``training.gardo``: diversity-aware amplification,
the KL gate, the reference refresh) and the curriculum's record of mixed groups.

``TrainerAdvantages`` is a part of ``flowgrpo.trainer.Trainer``; it uses the trainer's
``config``, ``accelerator``, ``policy`` / ``reward``, ``feature_extractor``, ``curriculum``,
``train_buckets``, ``reference_refreshed_at``, ``reward_streaks`` and ``group_prompts``, and keeps
the gathered rewards in ``gathered`` for the curriculum and ``check_reward_signal``.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

from flowgrpo.advantages import (PER_COMPONENT, decoupled_advantages, diversity_weights,
                                 group_advantages, kl_gate_weights, mask_nonfinite,
                                 region_advantages, saturation_weights)
from flowgrpo.errors import ConfigError, RunStopped
from flowgrpo.guards import gate_uncertainty, media_features
from flowgrpo.prompts import mixed_groups
from flowgrpo.step_values import STEP_VALUES_KEY, TRAINED_STEPS_KEY, vgpo_advantages
from flowgrpo.tree import tree_advantages, tree_shape

# the gathered (B, N) edge log-probs of a tree rollout (RolloutBatch.tree_log_probs)
TREE_LOG_PROBS_KEY = "tree/edge_log_probs"


Estimate = tuple[Tensor, dict[str, float], dict[str, float]]


def region_estimate(config, weights: dict[str, float], gathered: dict[str, Tensor],
                    group_ids: Tensor) -> Estimate:
    """(B, 2) advantages of training.locality: the group advantages of its edit_key's and
    keep_key's rewards (``advantages.region_advantages``), for the edit region and the rest."""
    t = config.training
    locality = t.locality
    for name in ("edit_key", "keep_key"):
        key = getattr(locality, name)
        if key not in gathered:
            raise ConfigError(f"training.locality.{name}: the rewards output no {key!r}; "
                              f"they output {', '.join(sorted(gathered))}: use one of them")
    advantages, stats = region_advantages(gathered[locality.edit_key], gathered[locality.keep_key],
                                          group_ids, scale=t.adv_scale, ddof=t.adv_ddof,
                                          eps=t.adv_eps, clip=t.adv_clip or None)
    return advantages, stats, {}


def per_component_estimate(config, weights: dict[str, float], gathered: dict[str, Tensor],
                           group_ids: Tensor) -> Estimate:
    """GDPO (rewards.aggregation decoupled / decoupled_sum): each weighted component normalised
    in its groups, then summed (and batch-normalised for decoupled), with saturation weights
    per component when rewards.saturation_ratio is set."""
    t, r = config.training, config.rewards
    components = {k: v for k, v in gathered.items() if k in weights}
    scales, saturation_stats = None, {}
    if r.saturation_ratio:
        scales, saturation_stats = saturation_weights(components, group_ids,
                                                      ratio=r.saturation_ratio, ddof=t.adv_ddof)
    advantages, stats = decoupled_advantages(
        components, weights, group_ids, ddof=t.adv_ddof, eps=t.adv_eps,
        clip=t.adv_clip or None, batch_normalize=r.aggregation == "decoupled",
        component_scales=scales)
    return advantages, stats, saturation_stats


def saturation_estimate(config, weights: dict[str, float], gathered: dict[str, Tensor],
                        group_ids: Tensor) -> Estimate:
    """The weighted sum again from its components with per-group saturation weights
    (rewards.saturation_ratio with aggregation weighted_sum), then normalised."""
    t = config.training
    weights = {k: w for k, w in weights.items() if w != 0}
    components = {k: gathered[k] for k in weights}
    scales, saturation_stats = saturation_weights(components, group_ids,
                                                  ratio=config.rewards.saturation_ratio,
                                                  ddof=t.adv_ddof)
    advantages, stats = decoupled_advantages(
        components, weights, group_ids, mode="sum_then_normalize", scale=t.adv_scale,
        ddof=t.adv_ddof, eps=t.adv_eps, clip=t.adv_clip or None, component_scales=scales)
    return advantages, stats, saturation_stats


def group_estimate(config, weights: dict[str, float], gathered: dict[str, Tensor],
                   group_ids: Tensor) -> Estimate:
    """GRPO's: the total reward normalised in its group (or batch, or not: training.adv_scale)."""
    t = config.training
    advantages, stats = group_advantages(gathered["total"], group_ids, scale=t.adv_scale,
                                         ddof=t.adv_ddof, eps=t.adv_eps, clip=t.adv_clip or None)
    return advantages, stats, {}


def vgpo_estimate(config, weights: dict[str, float], gathered: dict[str, Tensor],
                  group_ids: Tensor) -> Estimate:
    """VGPO's (training.advantage: vgpo): (B, N) advantages, a column a step of the rollout
    schedule, from the values of the trained states (the rewards of their one-step predictions,
    gathered under ``STEP_VALUES_KEY`` with the trained steps under ``TRAINED_STEPS_KEY``) and
    the total reward (``step_values.vgpo_advantages``)."""
    t = config.training
    v = t.vgpo
    advantages, stats = vgpo_advantages(
        gathered[STEP_VALUES_KEY], gathered[TRAINED_STEPS_KEY] > 0, gathered["total"], group_ids,
        discount=v.discount, absolute_weight=v.absolute_weight, anchor=v.anchor,
        scale=t.adv_scale, ddof=t.adv_ddof, eps=t.adv_eps, clip=t.adv_clip or None)
    return advantages, stats, {}


def tree_estimate(config, weights: dict[str, float], gathered: dict[str, Tensor],
                  group_ids: Tensor) -> Estimate:
    """TreeGRPO / BranchGRPO's (sampling.plan.kind: tree): (B, N) advantages, a column a step
    of the rollout schedule: each trained edge the depth-wise normalised backed-up value of its
    child node (``tree.tree_advantages``), the leaves' rewards the total; with
    ``tree_backup: prob_weighted`` the node values weigh the children by their edge log-probs
    (gathered under ``TREE_LOG_PROBS_KEY``)."""
    t, s = config.training, config.sampling
    weighted = s.plan.tree_backup == "prob_weighted"
    advantages, stats = tree_advantages(
        gathered["total"], group_ids, tree_shape(s.plan, s.num_steps), s.num_steps,
        scale=t.adv_scale, ddof=t.adv_ddof, eps=t.adv_eps, clip=t.adv_clip or None,
        path_log_probs=gathered[TREE_LOG_PROBS_KEY] if weighted else None)
    return advantages, stats, {}


# name -> estimator(config, reward weights, gathered rewards, group ids) ->
# (advantages (B,) or (B, 2), or (B, N) a column a step for vgpo, statistics, saturation statistics)
ADVANTAGE_ESTIMATORS = {"region": region_estimate, "per_component": per_component_estimate,
                        "saturation": saturation_estimate, "group": group_estimate,
                        "vgpo": vgpo_estimate, "tree": tree_estimate}
# the estimators whose advantages are (B, N), a column a step of the rollout schedule
PER_STEP_ESTIMATORS = ("vgpo", "tree")


def advantage_estimator(config) -> str:
    """Which estimator a config asks for: the regions of training.locality, GDPO's per-component
    aggregation, the saturation-weighted sum, or the group-normalised total; or the one
    training.advantage names."""
    if config.training.advantage != "auto":
        return config.training.advantage
    if config.policy == "flow" and config.sampling.plan.kind == "tree":
        return "tree"
    if config.training.locality.enabled:
        return "region"
    if config.rewards.aggregation in PER_COMPONENT:
        return "per_component"
    if config.rewards.saturation_ratio:
        return "saturation"
    return "group"


class NoFiniteRewardError(RunStopped):
    """No sample had a finite reward for ``training.max_iterations_without_finite_reward``
    iterations in a row."""


class ConstantRewardError(RunStopped):
    """A weighted reward gave every sample the same value for
    ``training.constant_reward_iterations`` iterations in a row (``on_constant_reward: stop``)."""


def describe_returned(values: Tensor) -> str:
    """What a reward returned for a batch (B,), in words: 'NaN for 16 of 16 samples',
    '+inf for 2, NaN for 14 of 16 samples', '16 finite values'."""
    kinds = [("NaN", values.isnan()), ("+inf", values.isposinf()), ("-inf", values.isneginf())]
    parts = [f"{label} for {int(mask.sum())}" for label, mask in kinds if bool(mask.any())]
    if not parts:
        return f"{len(values)} finite values"
    return f"{', '.join(parts)} of {len(values)} samples"


def constant_value(values: Tensor) -> float | None:
    """The value when every entry of ``values`` (B,) is the same finite number, else None."""
    if len(values) < 2 or not bool(torch.isfinite(values).all()):
        return None
    return float(values[0]) if bool((values == values[0]).all()) else None


class TrainerAdvantages:
    """The advantages-and-guards half of ``Trainer`` (see the module docstring)."""

    def compute_advantages(self, batch, rewards: dict[str, Tensor]
                           ) -> tuple[Tensor, dict[str, float]]:
        """Gather rewards over processes, compute advantages on the whole batch, keep ours."""
        t = self.config.training
        acc = self.accelerator
        device = acc.device
        # Policies hand over NaN for a missing reward (and the reward boundary already turns
        # +-inf into NaN); masking here too keeps a policy that bypasses it from poisoning the
        # whole batch's advantages with one inf.
        returned = {k: acc.gather(v.to(device)).cpu() for k, v in rewards.items()}
        gathered = {k: mask_nonfinite(v)[0] for k, v in returned.items()}
        # What each reward returned, in words, for the error of a run without finite rewards.
        self.returned = {k: describe_returned(v) for k, v in returned.items() if k != "total"}
        group_ids = acc.gather(batch.group_ids.to(device)).cpu()
        estimator = ADVANTAGE_ESTIMATORS[advantage_estimator(self.config)]
        inputs = gathered
        if getattr(batch, "step_values", None) is not None:   # per-step values (vgpo)
            inputs = {**gathered, STEP_VALUES_KEY: mask_nonfinite(
                          acc.gather(batch.step_values.to(device)).cpu())[0],
                      TRAINED_STEPS_KEY: acc.gather(
                          batch.trained_steps.to(device, torch.float32)).cpu()}
        if getattr(batch, "tree_log_probs", None) is not None:   # a tree plan's edges
            inputs = {**inputs, TREE_LOG_PROBS_KEY: acc.gather(
                batch.tree_log_probs.to(device)).cpu()}
        advantages, stats, saturation_stats = estimator(self.config, self.reward.weights,
                                                        inputs, group_ids)
        local = len(batch.prompts)
        start = acc.process_index * local
        metrics = {f"adv/{k}": float(v) for k, v in stats.items()}
        metrics.update({f"adv/{k}": float(v) for k, v in saturation_stats.items()})
        g = t.gardo
        if g.diversity or g.kl_gate:
            advantages, guard_metrics = self.apply_guards(batch, gathered, group_ids, advantages)
            metrics.update(guard_metrics)
        for name, values in gathered.items():
            valid = values[~values.isnan()]
            metrics[f"reward/{name}/mean"] = float(valid.mean()) if len(valid) else float("nan")
            metrics[f"reward/{name}/std"] = float(valid.std(unbiased=False)) if len(valid) else 0.0
        metrics["reward/nan_count"] = int(gathered["total"].isnan().sum())
        # The same on every process (gathered), for the curriculum's bookkeeping.
        self.gathered = (gathered, group_ids)
        return advantages[start:start + local], metrics

    def check_reward_signal(self, done: int) -> None:
        """After iteration ``done`` (1-based), on every process alike (gathered rewards): stop
        the run after ``training.max_iterations_without_finite_reward`` iterations in a row
        without one finite reward, and warn (or stop, ``training.on_constant_reward``) once a
        weighted reward has given every sample one value for ``constant_reward_iterations``
        iterations in a row. Streaks count from the start of this process (a resume restarts
        them)."""
        t = self.config.training
        gathered, _ = self.gathered
        streaks = self.reward_streaks
        none_finite = bool(gathered["total"].isnan().all())
        streaks["no finite"] = streaks.get("no finite", 0) + 1 if none_finite else 0
        limit = t.max_iterations_without_finite_reward
        if limit and streaks["no finite"] >= limit:
            returned = "; ".join(f"{name} returned {what}"
                                 for name, what in sorted(self.returned.items()))
            raise NoFiniteRewardError(
                f"no sample had a finite reward in the last {streaks['no finite']} iterations "
                f"(iterations {done - streaks['no finite'] + 1}-{done}): {returned}. Check the "
                f"reward models (a server that is down, inputs they cannot score); the "
                f"checkpoints are kept. training.max_iterations_without_finite_reward sets "
                f"this limit (0 = never stop)")
        if t.on_constant_reward == "ignore":
            return
        for name, weight in self.reward.weights.items():
            value = constant_value(gathered[name]) if weight and name in gathered else None
            key = f"constant {name}"
            streaks[key] = streaks.get(key, 0) + 1 if value is not None else 0
            if streaks[key] != t.constant_reward_iterations:
                continue
            # VGPO's absolute term still moves a constant reward's samples; nothing else does
            absolute = advantage_estimator(self.config) == "vgpo" and t.vgpo.absolute_weight
            effect = ("its group-relative advantages are all zero (only VGPO's absolute term "
                      "acts)" if absolute else "its advantages are all zero, so it teaches nothing")
            message = (f"reward {name} gave every sample the value {value:.6g} in each of the "
                       f"last {streaks[key]} iterations ({done - streaks[key] + 1}-{done}): "
                       f"{effect}. Check its inputs and options (training.on_constant_reward: "
                       f"warn | stop | ignore)")
            if t.on_constant_reward == "stop":
                raise ConstantRewardError(message)
            if self.accelerator.is_main_process:
                warnings.warn(message, RuntimeWarning, stacklevel=2)

    def apply_guards(self, batch, gathered: dict[str, Tensor], group_ids: Tensor,
                     advantages: Tensor) -> tuple[Tensor, dict[str, float]]:
        """training.gardo on the gathered batch (so every process agrees): diversity-aware
        amplification of the advantages (``advantages.diversity_weights`` on the media's
        features, then the clip again) and the KL gate (``advantages.kl_gate_weights``, this
        process's rows handed to the loss as ``batch.kl_weights``). Returns the advantages and
        the guards' metrics."""
        t = self.config.training
        g = t.gardo
        acc = self.accelerator
        metrics: dict[str, float] = {}
        if g.diversity:
            local_features = media_features(self.feature_extractor, batch.media)
            features = acc.gather(local_features.to(acc.device)).cpu()
            weights, stats = diversity_weights(features, group_ids, advantages)
            advantages = advantages * weights
            if t.adv_clip:
                advantages = advantages.clamp(-t.adv_clip, t.adv_clip)
            metrics.update({f"adv/{k}": v for k, v in stats.items()})
        if g.kl_gate:
            gate = kl_gate_weights(gate_uncertainty(self.config, gathered), g.kl_gate_fraction)
            local = len(batch.prompts)
            start = acc.process_index * local
            batch.kl_weights = gate[start:start + local]
            metrics["train/kl_gate_share"] = float(gate.mean())
        return advantages, metrics

    def refresh_reference(self, done: int, metrics: dict[str, float]) -> dict[str, float]:
        """After iteration ``done`` (1-based): make the KL reference the policy when
        ``refresh_every`` iterations have passed since the last refresh, or when the update's
        mean KL over every process exceeded ``refresh_kl`` (GARDO's reference reset). Returns
        ``train/reference_refreshed`` (1 or 0) and ``train/reference_age`` (iterations since)."""
        g = self.config.training.gardo
        acc = self.accelerator
        kl = metrics.get("train/kl", 0.0)
        if acc.num_processes > 1:
            weight = metrics.get("train/replay_batches", 0.0) if "train/kl" in metrics else 0.0
            local = torch.tensor([[kl * weight, weight]], dtype=torch.float64, device=acc.device)
            total = acc.gather(local).sum(dim=0).cpu()
            kl = float(total[0] / total[1]) if total[1] > 0 else 0.0
        since = done - (self.reference_refreshed_at or 0)
        due = (g.refresh_every > 0 and since >= g.refresh_every) or \
            (g.refresh_kl > 0 and kl > g.refresh_kl)
        if due:
            self.policy.refresh_reference()
            self.reference_refreshed_at = done
        return {"train/reference_refreshed": float(due),
                "train/reference_age": float(done - (self.reference_refreshed_at or 0))}

    def observe_curriculum(self, iteration: int) -> dict[str, float]:
        """Record which of the iteration's groups had reward variance (from the gathered rewards,
        so every process records the same) and return the curriculum's ``train/`` metrics:
        ``curriculum_mixed_share`` (this iteration's groups), ``curriculum_expected_mixed_share``
        and ``curriculum_uniform_mixed_share`` (the estimated mixed share of a draw with and
        without the curriculum, after this update) and ``curriculum_seen_prompts``."""
        gathered, group_ids = self.gathered
        keys = (list(self.reward.weights) if self.config.rewards.aggregation in PER_COMPONENT
                else ["total"])
        indices = self.group_prompts(iteration)
        mixed, informative = mixed_groups({k: gathered[k] for k in keys}, group_ids, len(indices))
        kept = [g for g in range(len(indices)) if bool(informative[g])]
        self.curriculum.observe([indices[g] for g in kept], [bool(mixed[g]) for g in kept])
        metrics = {"train/curriculum_mixed_share":
                   float(mixed[informative].double().mean()) if kept else float("nan")}
        metrics.update({f"train/curriculum_{k}": v
                        for k, v in self.curriculum.summary(
                            self.train_buckets, self.config.prompts.balance_weights).items()})
        return metrics
