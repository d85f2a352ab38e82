"""Dense per-step values from one-step predictions, and VGPO's per-step advantages.

VGPO (Shao et al., "Anchoring Values in Temporal and Group Dimensions for Flow Matching Model
Alignment", arXiv 2512.12387; no code released) replaces the one terminal reward that GRPO gives
every step of a trajectory by a value per step, and the purely group-relative advantage by one
that keeps an absolute term, so that the signal survives when a group's rewards all agree. The
paper's method section was not available to this project (only its abstract and a summary of
its two parts, a "temporal cumulative reward" and a "dual" relative + absolute advantage); the
formulas below are this code base's reading of that, stated in full so that they can be checked:

Values. At a trained step k the rollout keeps the state x_k at sigma_k and the model's velocity
v there (its transformer call of that step); the one-step prediction of the data is
x0_hat_k = x_k - sigma_k v (``one_step_prediction``), and its reward (the rewards' ``total`` of
the decoded x0_hat) is the value V(x_k) of that state. Row i trains the steps k_1 < ... < k_M;
write V_{i,m} for the value of its state at k_m and V_{i,M+1} = R_i for its final reward.

Temporal value of an action (``temporal_values``). The action of step k_m leads to the states
after it, so it is credited with the values of those states, nearest first, ending with the final
reward, as a discounted and normalised mean (gamma = ``discount``):

    Q_{i,m} = sum_{j=m+1}^{M+1} gamma^(j-m-1) V_{i,j} / sum_{j=m+1}^{M+1} gamma^(j-m-1)

gamma = 0: the value of the next trained state (the last step: R_i); gamma = 1: the plain mean of
every later value and R_i. A missing value (NaN) is skipped (the later ones move up a place).
The value of a row's first trained state enters no Q, so it is not scored (no reward call). Q
stays in the reward's units, so the absolute term below means the same at every step.

Advantages (``vgpo_advantages``). With beta = ``absolute_weight`` and b = ``anchor``:

    A_{i,m} = (Q_{i,m} - mean_c Q) / (std_c Q + eps) + beta (Q_{i,m} - b)

mean_c and std_c over the cell c = (group of i, step k_m): the members of the group that train
that step (scale ``group``; ``batch`` divides by the std of every cell's Q, ``none`` by 1), the
relative part exactly ``advantages.group_advantages`` of the cell (0 for a cell whose Qs agree),
then clipped to [-clip, clip]. A group whose rewards and values all equal r gets beta (r - b) at
every step: positive above the anchor, negative below it.

Reductions (tests/test_vgpo.py): the last trained step's Q is R_i, so with beta = 0 its advantage
is GRPO's (``group_advantages`` of R) whatever the values; a one-trained-step plan is GRPO plus
the absolute term, and scores nothing; with beta = 0 and every value equal to its row's final
reward (V_{i,m} = R_i), every step's advantage is GRPO's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from flowgrpo.advantages import _check_common, _check_rewards, group_advantages
from flowgrpo.checks import Section, config_field, finite, in_range, positive
from flowgrpo.errors import ConfigError

# training.advantage: "auto" (the estimator the reward options imply:
# ``trainer_advantages.advantage_estimator``) or "vgpo" (per-step advantages from step values)
ADVANTAGES = ("auto", "vgpo")
# Keys under which the trainer hands the gathered step values (B, N) and trained-step mask
# (B, N, 1.0 where the row trains the step) to the vgpo estimator beside the rewards.
STEP_VALUES_KEY = "step_values"
TRAINED_STEPS_KEY = "trained_steps"


@dataclass
class VGPOConfig(Section):
    """VGPO's per-step advantages (``training.advantage: vgpo``; flowgrpo/step_values.py)."""

    discount: float = config_field(
        "gamma in [0, 1]: how a trained step's value Q weighs the values of the states after "
        "it (one-step predictions x0_hat = x - sigma v scored by the reward, then the final "
        "reward): a normalised sum of gamma^j over them, nearest first. 0 = the next trained "
        "state's value (the last step: the final reward); 1 = their plain mean.", default=1.0)
    absolute_weight: float = config_field(
        "beta >= 0: weight of the absolute term beta * (Q - anchor) added to the group-relative "
        "advantage, so a group whose rewards all agree still has a signal (0 = relative only).",
        default=0.5)
    anchor: float = config_field(
        "b: the reward level the absolute term is measured from (above it positive, below "
        "negative); 0 for rewards in [0, 1].", default=0.0)

    def validate(self) -> None:
        in_range(self.discount, 0.0, 1.0, "training.vgpo.discount",
                 meaning=" (0 = the next state's value only, 1 = the mean of every later value)")
        positive(self.absolute_weight, "training.vgpo.absolute_weight", allow_zero=True)
        finite(self.anchor, "training.vgpo.anchor")


def check_vgpo_config(config) -> None:
    """training.advantage: vgpo against the other sections (a cross-section rule of
    ``flowgrpo.config.validate``): it trains SDE steps of a flow policy, and it replaces the
    scalar advantage of a sample by one per trained step, from the total reward alone."""
    t, r = config.training, config.rewards
    if t.advantage != "vgpo":
        return
    why = ("training.advantage: vgpo gives each trained step of a sample its own advantage, from "
           "the rewards of its one-step predictions")
    conflicts = [(config.policy != "flow", "policy: llm (it needs a flow model; set policy: flow)"),
                 (t.algorithm != "grpo", f"training.algorithm: {t.algorithm}, which keeps no SDE "
                                         f"steps (set grpo)"),
                 (t.locality.enabled, "training.locality, two region advantages a sample (set "
                                      "training.locality.mask: off)"),
                 (r.aggregation != "weighted_sum", f"rewards.aggregation: {r.aggregation} (set "
                                                    f"weighted_sum: the values are the total)"),
                 (r.saturation_ratio != 0, "rewards.saturation_ratio (set 0)"),
                 (t.kl_reward > 0, "training.kl_reward, which changes the final reward but not "
                                   "the step values (set 0)"),
                 (t.gardo.diversity, "training.gardo.diversity, which scales a scalar advantage "
                                     "a sample (set false)"),
                 # a tree's replay batches are built by the tree rollout, which keeps no x0_hat
                 (config.sampling.plan.kind == "tree", "sampling.plan.kind: tree, whose rollout "
                                                       "keeps no one-step predictions (use "
                                                       "another plan kind)")]
    for conflict, what in conflicts:
        if conflict:
            raise ConfigError(f"{why}; it does not combine with {what}, or set "
                              f"training.advantage: auto")


def check_step_value_reward(config, reward) -> None:
    """Once the rewards load: the step values score one replay batch's rows at a time, which a
    groupwise reward (one that compares the members of a group) cannot."""
    if config.training.advantage == "vgpo" and getattr(reward, "groupwise", False):
        raise ConfigError("training.advantage: vgpo scores the one-step predictions of each "
                          "replay batch, a few rows of a group at a time; a groupwise reward "
                          "(e.g. win_rate) compares whole groups: use a pointwise reward, or "
                          "set training.advantage: auto")


def one_step_prediction(latents: Tensor, sigmas: Tensor, velocity: Tensor) -> Tensor:
    """x0_hat = x - sigma v: the flow's one-step prediction of the data from x at sigma.

    latents, velocity: (b, ...); sigmas: (b,). Returns (b, ...) in the dtype of the inputs'
    promotion (float32 in the rollout)."""
    return latents - sigmas.reshape(-1, *[1] * (latents.dim() - 1)) * velocity


def temporal_values(step_values: Tensor, trained: Tensor, final: Tensor, discount: float
                    ) -> Tensor:
    """Q of every trained step (the module docstring's formula).

    Args:
        step_values: (B, N) value V of the state at each step (NaN: none; read only where
            ``trained``).
        trained: (B, N) bool, the steps each row trains.
        final: (B,) final reward R (NaN: none).
        discount: gamma in [0, 1].

    Returns:
        (B, N) float64: Q at the trained steps, NaN elsewhere and where no later value exists.
    """
    if step_values.dim() != 2 or trained.shape != step_values.shape:
        raise ValueError(f"step_values and trained must both have shape (B, N) (got "
                         f"{tuple(step_values.shape)} and {tuple(trained.shape)})")
    if final.shape != step_values.shape[:1]:
        raise ValueError(f"final must have shape ({step_values.shape[0]},) (got "
                         f"{tuple(final.shape)})")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1] (got {discount})")
    values = step_values.detach().to(torch.float64)
    trained = trained.to(device=values.device, dtype=torch.bool)
    reward = final.detach().to(device=values.device, dtype=torch.float64)
    # Discounted sums of the later values, nearest first, built from the end backwards:
    # total / weight is Q; a missing value leaves them as they are.
    present = ~torch.isnan(reward)
    total = torch.where(present, reward, torch.zeros_like(reward))
    weight = present.to(torch.float64)
    out = torch.full_like(values, float("nan"))
    for column in range(values.shape[1] - 1, -1, -1):
        here = trained[:, column]
        q = torch.where(weight > 0, total / weight.clamp(min=1e-300),
                        torch.full_like(total, float("nan")))
        out[:, column] = torch.where(here, q, out[:, column])
        value = values[:, column]
        fold = here & ~torch.isnan(value)
        total = torch.where(fold, value + discount * total, total)
        weight = torch.where(fold, 1.0 + discount * weight, weight)
    return out


def vgpo_advantages(step_values: Tensor, trained: Tensor, final: Tensor, group_ids: Tensor, *,
                    discount: float = 1.0, absolute_weight: float = 0.5, anchor: float = 0.0,
                    scale: str = "group", ddof: int = 0, eps: float = 1e-4,
                    clip: float | None = 5.0) -> tuple[Tensor, dict[str, float]]:
    """VGPO's per-step advantages (the module docstring's formula).

    Args:
        step_values: (B, N) value of each row's state at each step (NaN: none).
        trained: (B, N) bool (or 0/1), the steps each row trains.
        final: (B,) final reward (NaN: no score: the row's advantages are all 0).
        group_ids: (B,) integer group labels.
        discount, absolute_weight, anchor: gamma, beta, b.
        scale, ddof, eps, clip: as ``advantages.group_advantages`` (the relative part is its
            advantages over each (group, step) cell, unclipped; the sum is clipped).

    Returns:
        advantages (B, N) float32 (0 where a row does not train the step, has no final reward,
        or no later value), and stats (python floats): ``nan_count`` (rows without a final
        reward), ``num_groups``, ``step_cells`` ((group, step) cells with a value),
        ``zero_std_fraction`` (share of cells whose Qs agree: no relative signal),
        ``value_mean`` (mean scored step value), ``temporal_value_mean`` (mean Q),
        ``absolute_term_mean`` (mean beta (Q - b)), ``adv_mean``, ``adv_std``, ``adv_abs_max``
        over the entries with a Q.
    """
    _check_rewards(final, "final")
    _check_common(group_ids, final.shape[0], ddof, eps, clip)
    if absolute_weight < 0:
        raise ValueError(f"absolute_weight must be >= 0 (got {absolute_weight})")
    trained = trained.to(device=step_values.device, dtype=torch.bool)
    q = temporal_values(step_values, trained, final, discount)
    batch, width = q.shape
    rows_scored = ~torch.isnan(final.detach().to(q.device))
    valid = trained & ~torch.isnan(q) & rows_scored[:, None]
    _, group_index = torch.unique(group_ids.to(q.device), return_inverse=True)
    cells = group_index[:, None] * width + torch.arange(width, device=q.device)[None, :]
    advantages = torch.zeros_like(q)
    stats: dict[str, float] = {"nan_count": float((~rows_scored).sum()),
                               "num_groups": float(group_index.max() + 1) if batch else 0.0}
    if bool(valid.any()):
        relative, cell_stats = group_advantages(q[valid], cells[valid], scale=scale, ddof=ddof,
                                                eps=eps, clip=None)
        absolute = absolute_weight * (q[valid] - anchor)
        combined = relative.to(torch.float64) + absolute
        if clip is not None:
            combined = combined.clamp(-clip, clip)
        advantages[valid] = combined
        stats.update({"step_cells": cell_stats["num_groups"],
                      "zero_std_fraction": cell_stats["zero_std_fraction"],
                      "temporal_value_mean": q[valid].mean().item(),
                      "absolute_term_mean": absolute.mean().item(),
                      "adv_mean": combined.mean().item(),
                      "adv_std": combined.std(correction=0).item(),
                      "adv_abs_max": combined.abs().max().item()})
    else:
        stats.update({"step_cells": 0.0, "zero_std_fraction": 0.0, "temporal_value_mean": 0.0,
                      "absolute_term_mean": 0.0, "adv_mean": 0.0, "adv_std": 0.0,
                      "adv_abs_max": 0.0})
    scored = step_values.detach().to(q.device)[trained]
    scored = scored[~torch.isnan(scored)]
    stats["value_mean"] = scored.double().mean().item() if scored.numel() else float("nan")
    return advantages.to(torch.float32), stats


# --------------------------------------------------------------------------- the rollout's part

@torch.no_grad()
def score_step_values(model, reward, replays: list, prompts: list[str], metadata: list[dict],
                      width: int) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Score the one-step predictions the rollout kept (``ReplayBatch.x0_pred``).

    Each replay batch's rows whose step is not their first trained step are decoded
    (``model.decode``) and scored by ``reward`` (its ``total``), one reward call per replay
    batch with such rows; a row's first trained state enters no temporal value and is not
    scored.

    Args:
        model: the FlowModel (its ``decode``).
        reward: the training reward, ``reward(media, prompts, metadata) -> {"total": (b,), ...}``.
        replays: the rollout's ReplayBatch list (``rows`` (b,), ``step``, ``x0_pred`` (b, ...)).
        prompts, metadata: the B rows' prompts and reward metadata.
        width: N, the number of columns (steps of the rollout schedule).

    Returns:
        step_values (B, N) float32 (NaN where not scored), trained (B, N) bool, and the cost:
        ``cost/step_value_reward_calls``, ``cost/step_value_images`` (this process's) and
        ``time/step_values`` (seconds decoding and scoring).
    """
    began = time.perf_counter()
    batch = len(prompts)
    values = torch.full((batch, width), float("nan"))
    trained = torch.zeros((batch, width), dtype=torch.bool)
    first = torch.full((batch,), width, dtype=torch.long)
    for replay in replays:
        if replay.step >= width:
            raise ValueError(f"a replay batch trains step {replay.step}, beyond the {width} "
                             f"steps of the rollout schedule")
        rows = replay.rows.cpu()
        trained[rows, replay.step] = True
        first[rows] = torch.minimum(first[rows], torch.full_like(rows, replay.step))
    calls = images = 0
    for replay in replays:
        rows = replay.rows.cpu()
        later = (first[rows] < replay.step).nonzero().flatten()
        if later.numel() == 0:
            continue
        if replay.x0_pred is None:
            raise ValueError("the rollout kept no one-step predictions (RolloutSettings."
                             "keep_x0_predictions) for the step values")
        picked = rows[later].tolist()
        x0 = replay.x0_pred.index_select(0, later.to(replay.x0_pred.device))
        media = model.decode(x0.to(model.device, model.dtype)).to(torch.float32).cpu()
        scores = reward(media, [prompts[i] for i in picked], [metadata[i] for i in picked])
        values[rows[later], replay.step] = scores["total"].float().cpu()
        calls += 1
        images += len(picked)
    return values, trained, {"cost/step_value_reward_calls": float(calls),
                             "cost/step_value_images": float(images),
                             "time/step_values": time.perf_counter() - began}
