"""Diffusion-DPO (arXiv 2311.12908) for flow models (Flow-Factory ``trainers/dpo.py``).

Online (``training.dpo.online``): the best and the worst sample of each group (by total reward; a
group whose finite rewards are all equal gives no pair) form a (chosen, rejected) pair. Offline
(``training.dpo.pairs_file``, ``flowgrpo/preference_pairs.py``): ``pairs_per_iteration`` pairs
of a JSONL preference file per iteration, their two images VAE-encoded by the model
(``encode_images``) into the latents a rollout's final sample would have. Both kinds train
alike: both samples of a pair are re-noised at the same level with the same noise, and the loss
is -log sigmoid(-beta / 2 [(e_w - e_ref_w) - (e_l - e_ref_l)]) (``matching_losses.
diffusion_dpo_loss``), log 2 while the policy is the reference. The two kinds mix in one update
(their units are replay batches alike); ``online: false`` trains the file's pairs only.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from flowgrpo.algorithms.base import (FlowAlgorithm, SampleReplay, UnitForward, add_velocity_kl,
                                      draw_sigmas, unit_forward, weighted_mean)
from flowgrpo.errors import ConfigError
from flowgrpo.matching_losses import diffusion_dpo_loss, noised_latents, velocity_error
from flowgrpo.preference_pairs import (FIELD, iteration_pairs, load_pair_images,
                                       read_pairs_file)
from flowgrpo.rollout import encode_rows
from flowgrpo.seeding import seeded_generator


def best_worst_pairs(total: Tensor, group_ids: Tensor) -> list[tuple[int, int, int]]:
    """(group id, chosen row, rejected row) of each group whose finite rewards differ: the
    first row with the group's highest reward and the first with its lowest."""
    pairs = []
    for group in group_ids.unique().tolist():
        rows = (group_ids == group).nonzero().flatten()
        values = total[rows]
        finite = torch.isfinite(values)
        if int(finite.sum()) < 2:
            continue
        rows, values = rows[finite], values[finite]
        if float(values.max()) == float(values.min()):
            continue
        pairs.append((group, int(rows[int(values.argmax())]), int(rows[int(values.argmin())])))
    return pairs


@dataclasses.dataclass
class OfflinePairs(SampleReplay):
    """A replay unit of p offline pairs at one level each: ``clean`` (2p, ...) float32 CPU latents
    of the chosen images then the rejected ones, ``prompts`` (2p), ``positions`` (p) the pairs'
    places in the iteration's draw (they key the levels and the noise). ``rows`` points at row 0
    of the rollout batch (the unit has no rollout rows; the trainer sizes its weights by it) and
    ``bucket`` orders the offline units after the online ones, by their first pair."""

    clean: Tensor | None = None
    prompts: list = dataclasses.field(default_factory=list)
    positions: list = dataclasses.field(default_factory=list)
    bucket: int = 0


class DiffusionDPO(FlowAlgorithm):
    name = "dpo"
    keeps_transitions = False

    def __init__(self, policy) -> None:
        super().__init__(policy)
        d = self.config.training.dpo
        self.pairs = read_pairs_file(d.pairs_file) if d.pairs_file is not None else []
        if self.pairs:
            self._check_model_takes_pairs()

    def _check_model_takes_pairs(self) -> None:
        """Refuse, once the model is loaded, a build that cannot train the file's pairs: an
        editing build (the toy's is known only now) or images of a size it does not take."""
        model = self.policy.model
        if getattr(model, "supports_images", False):
            raise ConfigError(f"{FIELD}: this {model.family} model edits source images, and a "
                              f"pair carries none: remove pairs_file or use a text-to-image model")
        chosen, _ = load_pair_images(self.pairs[:1])
        try:
            with torch.no_grad():
                model.encode_images(chosen)
        except ValueError as err:
            raise ConfigError(f"{FIELD}: the {model.family} model cannot encode "
                              f"{self.pairs[0].chosen} ({err}); give images of the model's "
                              f"output size") from None

    def replays(self, batch, iteration: int, rewards=None) -> list:
        """Online units of up to rollout_batch_size / 2 pairs, times training.timesteps.count
        levels (a pair's two samples share their levels and noise, keyed by the pair's group),
        then the offline pairs' units alike (``offline_units``)."""
        t, seed = self.config.training, self.config.run.seed
        pairs = best_worst_pairs(rewards["total"].float(), batch.group_ids) \
            if t.dpo.online else []
        size = max(1, self.config.sampling.rollout_batch_size // 2)
        units: list = []
        for start in range(0, len(pairs), size):
            chunk = pairs[start:start + size]
            groups = [g for g, _, _ in chunk]
            rows = torch.tensor([c for _, c, _ in chunk] + [r for _, _, r in chunk])
            levels = [draw_sigmas(self.policy.base_sigmas, t.timesteps.count,
                                  t.timesteps.sampling, t.timesteps.fraction,
                                  seeded_generator(seed, iteration, "matching_sigma", g))
                      for g in groups]
            for slot in range(t.timesteps.count):
                sigmas = torch.stack([level[slot] for level in levels]).float()
                units.append(SampleReplay(rows=rows, slot=slot, sigmas=torch.cat([sigmas, sigmas]),
                                          noise_keys=groups + groups, pairs=len(chunk)))
        if self.pairs:
            units += self.offline_units(iteration)
        if not units:
            # No group varied here; another process may have pairs. Its padding (weight 0) is a
            # sample paired with itself: a margin of exactly 0 and no gradient.
            first = int(batch.group_ids[0])
            batch.padding_replay = SampleReplay(
                rows=torch.tensor([0, 0]), slot=0, sigmas=self.policy.base_sigmas[:1].repeat(2),
                noise_keys=[first, first], pairs=1)
        return units

    @torch.no_grad()
    def offline_units(self, iteration: int) -> list[OfflinePairs]:
        """This process's share of the iteration's offline pairs (``iteration_pairs``; position
        j of the draw goes to process j mod the process count), VAE-encoded, in units of up to
        rollout_batch_size / 2 pairs times training.timesteps.count levels. A pair's levels are
        drawn by (seed, iteration, position), like an online pair's by its group."""
        t, seed = self.config.training, self.config.run.seed
        acc = self.policy.accelerator
        drawn = iteration_pairs(len(self.pairs), t.dpo.pairs_per_iteration, seed, iteration)
        mine = [(j, drawn[j]) for j in range(len(drawn))
                if j % acc.num_processes == acc.process_index]
        size = max(1, self.config.sampling.rollout_batch_size // 2)
        model = self.policy.model
        units = []
        for start in range(0, len(mine), size):
            chunk = mine[start:start + size]
            picked = [self.pairs[i] for _, i in chunk]
            positions = [j for j, _ in chunk]
            chosen, rejected = load_pair_images(picked)
            clean = model.encode_images(chosen + rejected).float().cpu()
            prompts = [pair.prompt for pair in picked] * 2
            levels = [draw_sigmas(self.policy.base_sigmas, t.timesteps.count,
                                  t.timesteps.sampling, t.timesteps.fraction,
                                  seeded_generator(seed, iteration, "offline_pair_sigma", j))
                      for j in positions]
            rows = torch.zeros(2 * len(chunk), dtype=torch.long)
            for slot in range(t.timesteps.count):
                sigmas = torch.stack([level[slot] for level in levels]).float()
                units.append(OfflinePairs(
                    rows=rows, slot=slot, sigmas=torch.cat([sigmas, sigmas]),
                    noise_keys=positions + positions, pairs=len(chunk), clean=clean,
                    prompts=prompts, positions=positions,
                    bucket=1 + positions[0] * t.timesteps.count + slot))
        return units

    def offline_forward(self, replay: OfflinePairs, iteration: int) -> UnitForward:
        """An offline unit's latents re-noised at its levels, a pair's two images with one noise
        drawn by (seed, iteration, position, level), and its prompts' condition (encoded once
        per unit and kept)."""
        policy = self.policy
        device = policy.model.device
        clean = replay.clean.to(device)
        shape = tuple(clean.shape[1:])
        noise = torch.stack([torch.randn(shape, generator=seeded_generator(
            self.config.run.seed, iteration, "offline_pair_noise", j, replay.slot))
            for j in replay.positions])
        noise = torch.cat([noise, noise]).to(device)
        sigmas = replay.sigmas.to(device)
        latents, target = noised_latents(clean, noise, sigmas)
        if "cond" not in replay.cache:
            with torch.no_grad():
                cond, index = encode_rows(policy.model, replay.prompts)
                replay.cache["cond"] = cond.to(device).select(index)
        return UnitForward(policy, clean, latents, target, sigmas, replay.cache["cond"],
                           policy.settings(iteration).guidance_scale)

    def loss(self, batch, replay, advantages: Tensor, iteration: int, clip_high: float,
             weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        t = self.config.training
        offline = isinstance(replay, OfflinePairs)
        unit = self.offline_forward(replay, iteration) if offline else \
            unit_forward(self.policy, batch, replay, iteration)
        velocity = unit.velocity()
        velocity_ref = unit.velocity(self.policy.reference_policy())
        error = velocity_error(velocity, unit.target)
        error_ref = velocity_error(velocity_ref, unit.target)
        p = replay.pairs
        per_pair = diffusion_dpo_loss(error[:p], error[p:], error_ref[:p], error_ref[p:],
                                      t.dpo.beta)
        loss = weighted_mean(per_pair, weights[:p])
        with torch.no_grad():
            reward_chosen = error_ref[:p] - error[:p].detach()
            reward_rejected = error_ref[p:] - error[p:].detach()
            # beta / 2 times the implicit reward margin: the argument of the loss's sigmoid
            margin = 0.5 * t.dpo.beta * (reward_chosen - reward_rejected)
        record = {"policy_loss": loss.detach(),
                  "implicit_accuracy": (reward_chosen > reward_rejected).float().mean(),
                  "implicit_margin": margin.mean(),
                  "pairs": torch.tensor(float(p))}
        if offline:
            record["offline_implicit_margin"] = margin.mean()
        if t.kl_beta > 0:
            loss = add_velocity_kl(loss, record, t.kl_beta, velocity, velocity_ref, weights)
        if not offline:   # the guard keeps the policy's own samples' low-noise velocity
            loss = self.add_anchor(loss, record, unit, batch, replay, iteration, weights)
        return loss, record

    def update_metrics(self, rows: dict[str, Tensor], clip_high: float) -> dict[str, Tensor]:
        return {key: values.float().mean() for key, values in rows.items() if key != "pairs"}
