"""GRPO on SDE transitions: the clipped surrogate on the exact Gaussian log-probs of the trained
denoising steps the rollout kept (Flow-GRPO, DanceGRPO, MixGRPO, Flow-GRPO-Fast, Flash-GRPO,
GRPO-Guard, CPS), with its optional parts.

The loss of a replay batch is its *surrogate* (``losses.policy_loss``, with GRPO-Guard's RatioNorm
log-ratio, or ``losses.region_policy_loss`` under ``training.locality``) plus the *terms* the
config turns on, each a method that adds to the loss and the record:

    kl            training.kl_beta * the KL to the reference (GARDO's gated KL when gated)
    keep_kl       training.locality.keep_kl_beta * the KL over the preservation region
    keep_source   training.locality.keep_source_beta * the source-preserving matching loss
    anchor        training.anchor_beta * the velocity anchor at untrained steps

Per-row step weights (GRPO-Guard's 1/dt, Flash-GRPO's kappa, the anchors' loss scales,
TempFlow-GRPO's noise-aware weights) come from ``step_weights``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import Tensor

from flowgrpo.algorithms.base import FlowAlgorithm
from flowgrpo.losses import (batch_mean_dt_weights, check_weights, fixed_region_shares, flow_kl,
                             dt_reweight_step_weights, gated_kl, policy_loss, ratio_norm_log_ratio,
                             rectification_weights, region_flow_kl, region_flow_matching,
                             region_policy_loss, signal_region_shares, source_preserving_target,
                             std_over_sqrt_dt_weights, surrogate_stats, velocity_anchor,
                             noise_aware_weights)
from flowgrpo.rollout import RolloutBatch, RolloutSettings, replay_logp
from flowgrpo.sde import STOCHASTIC_STEPS, anchor_std, region_log_probs
from flowgrpo.seeding import seeded_generator


def replay_rows(replay, keep: Tensor):
    """The replay batch restricted to its rows ``keep`` (local indices, (b',)): every per-row
    tensor of it and of its step Gaussian indexed, the step and the constants kept."""
    def pick(value):
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == count:
            return value.index_select(0, keep.to(value.device))
        return value

    count = replay.rows.shape[0]
    gaussian = dataclasses.replace(replay.gaussian, **{
        f.name: pick(getattr(replay.gaussian, f.name))
        for f in dataclasses.fields(replay.gaussian)})
    fields = {f.name: pick(getattr(replay, f.name)) for f in dataclasses.fields(replay)
              if f.name != "gaussian"}
    return dataclasses.replace(replay, gaussian=gaussian, **fields)


def schedule_step_stds(kind: str, sigmas: Tensor, noise_level: float) -> Tensor:
    """(N - 1,) float32: the total std of an SDE step of ``kind`` at every step of the schedule
    ``sigmas`` (N + 1,) but the last (always deterministic), computed as the rollout computes
    each step's std (flash_sde's bounds the schedule's sigmas[1] and sigmas[-1]): the S_k that
    ``losses.noise_aware_weights`` normalises by."""
    sigmas = sigmas.detach().to(device="cpu", dtype=torch.float32)
    sigma, sigma_next = sigmas[:-2], sigmas[1:-1]
    bounds = (sigmas[1].expand_as(sigma), sigmas[-1].expand_as(sigma))
    return STOCHASTIC_STEPS[kind](sigma, sigma_next, torch.full_like(sigma, noise_level),
                                  bounds)[2]


@dataclasses.dataclass
class ReplayStep:
    """What the terms of one replay batch's loss share: the batch, the replay, its prompt
    condition, the rollout settings, the policy's transition mean (with grad) and, once a term
    asked for it, the reference's (``reference_mean``)."""

    batch: RolloutBatch
    replay: object
    cond: object
    settings: RolloutSettings
    iteration: int
    mean: Tensor
    mean_ref: Tensor | None = None


class GRPO(FlowAlgorithm):
    name = "grpo"
    keeps_transitions = True

    def __init__(self, policy) -> None:
        super().__init__(policy)
        t = self.config.training
        self.terms: list[Callable[[ReplayStep, Tensor, dict], Tensor]] = [
            term for term, on in ((self.kl, t.kl_beta > 0),
                                  (self.keep_kl, t.locality.keep_kl_beta > 0),
                                  (self.keep_source, t.locality.keep_source_beta > 0),
                                  (self.anchor, t.anchor_beta > 0)) if on]

    # ------------------------------------------------------------------ weights
    def step_weights(self, replays: list) -> list[Tensor]:
        """Per-row loss weights of each replay batch: GRPO-Guard's 1/dt and/or Flash-GRPO's kappa,
        normalised by their mean over the iteration's trained transitions on every process (a
        replay batch holds a single step, so normalising within it would make every weight 1;
        a per-process mean would weigh the same step differently on different processes), times
        the per-batch factors the anchors do not normalise (``training.dt_reweight_norm:
        batch_mean``, ``training.loss_scale``; TempFlow-GRPO's noise-aware weights, normalised by
        the schedule, not the iteration). Called on every process (the mean is gathered)."""
        t = self.config.training
        normalised = (t.dt_reweight and t.dt_reweight_norm == "iteration") or t.rectification
        raw, absolute = [], []
        if t.loss_scale == "noise_aware":
            schedule_std = schedule_step_stds(self.config.sampling.kind, self.policy.base_sigmas,
                                              self.config.sampling.noise_level)
        for replay in replays:
            weights = torch.ones_like(replay.logp_old)
            if t.dt_reweight and t.dt_reweight_norm == "iteration":
                weights = weights * dt_reweight_step_weights(replay.sigmas, replay.sigmas_next,
                                                       normalize=False)
            if t.rectification:
                weights = weights * rectification_weights(replay.sigmas, replay.sigmas_next,
                                                          replay.std, normalize=False)
            raw.append(weights)
            # Factors the anchors apply per batch, not normalised over the iteration.
            factor = None
            if t.dt_reweight and t.dt_reweight_norm == "batch_mean":
                factor = batch_mean_dt_weights(replay.sigmas, replay.sigmas_next)
            if t.loss_scale == "std_over_sqrt_dt":
                scale = std_over_sqrt_dt_weights(
                    anchor_std(self.config.sampling.kind, replay.std, replay.sigmas,
                               replay.sigmas_next), replay.sigmas, replay.sigmas_next)
                factor = scale if factor is None else factor * scale
            if t.loss_scale == "noise_aware":
                scale = noise_aware_weights(replay.std, schedule_std)
                factor = scale if factor is None else factor * scale
            absolute.append(factor)
        if normalised:
            acc = self.policy.accelerator
            local = torch.cat(raw) if raw else torch.zeros(0)
            totals = torch.tensor([float(local.double().sum()), float(local.numel())],
                                  dtype=torch.float64)
            if acc.num_processes > 1:
                totals = acc.gather(totals.to(acc.device).unsqueeze(0)).sum(dim=0).cpu()
            if totals[1] > 0:
                mean = (totals[0] / totals[1]).to(local.dtype)
                raw = [w / mean.to(w.device) for w in raw]
        raw = [w if f is None else w * f.to(w.dtype) for w, f in zip(raw, absolute)]
        if raw and (normalised or any(f is not None for f in absolute)):
            check_weights(torch.cat(raw))   # once here, so the loss skips it per replay batch
        return raw

    # ------------------------------------------------------------------ loss
    def loss(self, batch: RolloutBatch, replay, advantages: Tensor, iteration: int,
             clip_high: float, weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one replay batch: the surrogate, then each enabled term. Returns the loss
        and a record of detached tensors for ``update_metrics``: per row ``log_ratio`` (the one
        the loss used), ``advantages`` and ``weights``; 0-d ``ratio_max_dev`` (max
        |exp(logp - logp_old) - 1|, exactly 0 on the first pass), ``policy_loss`` and each
        term's value."""
        policy = self.policy
        cond = policy.replay_condition(batch, replay)
        settings = policy.settings(iteration)
        with policy.training_forward():
            logp, mean = replay_logp(policy.model, replay, cond, settings)
        adv = advantages[replay.rows]
        adv = adv if adv.device == logp.device else adv.to(logp.device)
        step = ReplayStep(batch, replay, cond, settings, iteration, mean)
        if self.config.training.locality.enabled:
            loss, record = self.region_surrogate(step, adv, clip_high, weights)
        else:
            loss, record = self.surrogate(step, logp, adv, clip_high, weights)
        for term in self.terms:
            loss = term(step, loss, record)
        return loss, record

    def surrogate(self, step: ReplayStep, logp: Tensor, adv: Tensor, clip_high: float,
                  weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The clipped surrogate of a replay batch, on GRPO-Guard's RatioNorm log-ratio when
        ``training.ratio_norm``."""
        t, replay = self.config.training, step.replay
        raw_log_ratio = logp.detach() - replay.logp_old
        log_ratio = ratio_norm_log_ratio(logp, replay.logp_old, step.mean, replay.mean_old,
                                    replay.std) if t.ratio_norm else None
        loss = policy_loss(logp, replay.logp_old, adv, t.clip_low, clip_high, weights=weights,
                           log_ratio=log_ratio)
        return loss, {"log_ratio": raw_log_ratio if log_ratio is None else log_ratio.detach(),
                      "advantages": adv, "weights": weights,
                      "ratio_max_dev": torch.expm1(raw_log_ratio).abs().max(),
                      "policy_loss": loss.detach()}

    def region_surrogate(self, step: ReplayStep, adv: Tensor, clip_high: float,
                         weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``training.locality``'s surrogate of a replay batch: the step's log-density split by
        the rows' edit-region masks (``sde.region_log_probs``), the edit advantage (adv[:, 0])
        on the region, the preservation advantage (adv[:, 1]) on the rest
        (``losses.region_policy_loss``). The record holds each (row, region) as a row, weighted
        by the region's share."""
        t = self.config.training
        batch, replay, mean = step.batch, step.replay, step.mean
        masks = batch.region_masks
        mask = masks.index_select(0, replay.rows.to(masks.device)).to(mean.device)
        keep = batch.keep_masks
        if keep is not None:
            keep = keep.index_select(0, replay.rows.to(keep.device)).to(mean.device)
        next_latents = replay.next_latents.to(mean.device)
        logp, shares = region_log_probs(next_latents - mean, replay.gaussian, mask, keep)
        if t.locality.edit_weight is not None:
            shares = fixed_region_shares(shares, t.locality.edit_weight)
        if t.locality.silent_share == "reassign":
            shares = signal_region_shares(shares, adv)
        with torch.no_grad():
            logp_old, _ = region_log_probs(next_latents - replay.mean_old.to(mean.device),
                                           replay.gaussian, mask, keep)
        loss = region_policy_loss(logp, logp_old, adv, shares, t.clip_low, clip_high,
                                  weights=weights)
        log_ratio = logp.detach() - logp_old
        part_weights = shares * weights.to(shares)[:, None]
        return loss, {"log_ratio": log_ratio.flatten(), "advantages": adv.flatten(),
                      "weights": part_weights.flatten(),
                      "ratio_max_dev": torch.expm1(log_ratio).abs().max(),
                      "policy_loss": loss.detach()}

    # ------------------------------------------------------------------ terms
    def reference_mean(self, step: ReplayStep) -> Tensor:
        """(B, ...) the replay's transition means under the reference policy (no gradient),
        computed once per replay batch for the terms that need it."""
        if step.mean_ref is None:
            step.mean_ref = self.policy.reference_mean(step.replay, step.cond, step.settings)
        return step.mean_ref

    def kl(self, step: ReplayStep, loss: Tensor, record: dict) -> Tensor:
        """training.kl_beta * the KL to the reference (``losses.flow_kl``), over every row, or
        over the rows GARDO's gate lets in (``batch.kl_weights``)."""
        gate = step.batch.kl_weights
        beta = self.config.training.kl_beta
        if gate is not None:
            return self.gated_kl(step, loss, record, gate[step.replay.rows.to(gate.device)])
        kl = flow_kl(step.mean, self.reference_mean(step),
                     self.policy.kl_std(step.replay)).mean()
        record["kl"] = kl.detach()
        return loss + beta * kl

    def gated_kl(self, step: ReplayStep, loss: Tensor, record: dict, gate: Tensor) -> Tensor:
        """loss + beta * ``gated_kl`` over the replay's gated rows (training.gardo). The
        reference forward runs on the gated rows only, none when no row is gated; records
        ``kl`` (mean over the gated rows) and ``kl_rows`` for the update's statistics."""
        keep = (gate > 0).nonzero().flatten()
        if keep.numel() == 0:
            return loss
        replay, cond, mean = step.replay, step.cond, step.mean
        if keep.numel() < gate.numel():
            replay, cond = replay_rows(replay, keep), cond.select(keep)
            mean = mean.index_select(0, keep.to(mean.device))
            gate = gate.index_select(0, keep)
        mean_ref = self.policy.reference_mean(replay, cond, step.settings)
        kl = gated_kl(flow_kl(mean, mean_ref, self.policy.kl_std(replay)), gate)
        record["kl"] = kl.detach()
        record["kl_rows"] = torch.tensor(float(keep.numel()), device=kl.device)
        return loss + self.config.training.kl_beta * kl

    def keep_kl(self, step: ReplayStep, loss: Tensor, record: dict) -> Tensor:
        """training.locality.keep_kl_beta * the KL to the reference over the preservation region
        (``losses.region_flow_kl``), averaged over the rows that have one."""
        keep_region = self.preservation_weights(step.batch, step.replay, step.mean.device)
        row_kl = region_flow_kl(step.mean, self.reference_mean(step),
                                self.policy.kl_std(step.replay), keep_region)
        # The mean over the rows that have something to keep (a one-object toy edit has
        # not), so beta's strength does not depend on the batch's mix of edits.
        has_region = keep_region.flatten(1).sum(dim=1) > 0
        keep_kl = gated_kl(row_kl, has_region.to(row_kl.dtype))
        record["keep_kl"] = keep_kl.detach()
        return loss + self.config.training.locality.keep_kl_beta * keep_kl

    def keep_source(self, step: ReplayStep, loss: Tensor, record: dict) -> Tensor:
        keep_source = self.keep_source_loss(step.batch, step.replay, step.cond, step.settings,
                                            step.iteration)
        if keep_source is None:
            return loss
        record["keep_source"] = keep_source.detach()
        return loss + self.config.training.locality.keep_source_beta * keep_source

    def anchor(self, step: ReplayStep, loss: Tensor, record: dict) -> Tensor:
        if not step.replay.anchors:
            return loss
        anchor = self.anchor_penalty(step.batch, step.replay.anchors, step.settings)
        record["anchor"] = anchor.detach()
        return loss + self.config.training.anchor_beta * anchor

    def preservation_weights(self, batch: RolloutBatch, replay, device: torch.device) -> Tensor:
        """The replay rows' preservation-region weights on ``device``, broadcastable to the
        latents: where the preservation advantage acts (``training.locality.keep_region``), the
        records' keep masks outside the edit region, or the whole rest: the weights
        ``sde.region_log_probs`` gives its second part."""
        masks = batch.region_masks
        edit = masks.index_select(0, replay.rows.to(masks.device)).to(device)
        keep = batch.keep_masks
        if keep is None:
            return 1.0 - edit
        return keep.index_select(0, replay.rows.to(keep.device)).to(device) * (1.0 - edit)

    def keep_source_loss(self, batch: RolloutBatch, replay, cond, settings: RolloutSettings,
                         iteration: int) -> Tensor | None:
        """``training.locality.keep_source_beta``'s term for a replay batch, a scalar, or None
        when no row has a preservation region (a one-object toy edit): the mean over those rows
        of ``losses.region_flow_matching`` at the step's sigmas, on x_sigma = (1 - sigma) target
        + sigma noise, target = the row's sample with its preservation region replaced by the
        source (``losses.source_preserving_target``), fresh noise drawn per (seed, iteration,
        step, first row). Gradient flows through the policy's velocity only."""
        policy = self.policy
        model = policy.model
        device = model.device
        region = self.preservation_weights(batch, replay, device)
        has_region = (region.flatten(1).sum(dim=1) > 0).nonzero().flatten()
        if has_region.numel() == 0:
            return None
        rows = replay.rows.to(device).index_select(0, has_region)
        region = region.index_select(0, has_region)
        images = [batch.images[i] for i in rows.tolist()]
        sample = [batch.media[i] for i in rows.tolist()]
        with torch.no_grad():
            target = source_preserving_target(model.encode_images(sample).float(),
                                              model.encode_images(images).float(), region)
        # Keyed by the batch's first sample id (global), not its row: the same draw on any
        # number of processes.
        generator = seeded_generator(settings.seed, iteration, "keep_source", replay.step,
                                     int(batch.sample_ids[replay.rows[0]]))
        noise = torch.randn(target.shape, generator=generator).to(device)
        sigmas = replay.sigmas.to(device).index_select(0, has_region).float()
        s = sigmas.view(-1, *([1] * (target.dim() - 1)))
        latents = ((1.0 - s) * target + s * noise).to(model.dtype)
        with policy.training_forward():
            velocity = model.velocity(latents, sigmas, cond.select(has_region),
                                      settings.guidance_scale)
        return region_flow_matching(velocity, noise, target, region).mean()

    def anchor_penalty(self, batch: RolloutBatch, anchors: list, settings: RolloutSettings
                       ) -> Tensor:
        """Mean over the anchored states of ``losses.velocity_anchor``: the policy's velocity
        (with grad, through the engine) against the reference's at each untrained-step state a
        chunk kept (training.anchor_beta)."""
        policy = self.policy
        model = policy.model
        penalties = []
        for anchor in anchors:
            cond = policy.replay_condition(batch, anchor)
            latents = anchor.latents.to(model.dtype)
            with policy.training_forward():
                velocity = model.velocity(latents, anchor.sigmas, cond, settings.guidance_scale)
            with torch.no_grad(), policy.reference_policy():
                velocity_ref = model.velocity(latents, anchor.sigmas, cond,
                                              settings.guidance_scale)
            penalties.append(velocity_anchor(velocity, velocity_ref).mean())
        return torch.stack(penalties).mean()

    # ------------------------------------------------------------------ statistics
    def update_metrics(self, rows: dict[str, Tensor], clip_high: float) -> dict[str, Tensor]:
        """``surrogate_stats`` over every trained row, and the mean policy loss and terms."""
        if not rows:
            return {}
        stats = surrogate_stats(rows["log_ratio"], rows["advantages"],
                                self.config.training.clip_low, clip_high, rows["weights"])
        stats["policy_loss"] = rows["policy_loss"].float().mean()
        if "kl_rows" in rows:   # gated KL: the mean over every gated row of the update
            counts = rows["kl_rows"].float()
            stats["kl"] = (rows["kl"].float() * counts).sum() / counts.sum().clamp(min=1)
        elif "kl" in rows:
            stats["kl"] = rows["kl"].float().mean()
        for key in ("anchor", "keep_kl", "keep_source"):
            if key in rows:
                stats[key] = rows[key].float().mean()
        return stats
