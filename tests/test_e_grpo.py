"""E-GRPO (arXiv 2601.00423; shengjun-zhang/VisualGRPO): ``sampling.plan.kind: merge``.

A trajectory takes one SDE step that spans m steps of the base schedule, sigma_k ->
sigma_{k+m}, and Euler ODE steps elsewhere; a group shares everything up to that step and
branches there, so its group-normalised advantage is among samples sharing the merged step.
Checked here: the merged step's entropy and log-density in closed form, m = 1 being the
single SDE step bit for bit, which steps a plan merges and trains, the advantages of the
branches, and short Trainer runs on the toy and the tiny SD3 being on-policy on their first pass.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from flowgrpo.plans import (PlanConfig, make_plan, merge_counts_for_entropy, merged_schedule,
                            replay_steps_per_chunk)
from flowgrpo.rollout import RolloutSettings, run_plan
from flowgrpo.sde import euler_step, score_step, step_entropy, transition
from flowgrpo.seeding import seeded_generator
from tests.helpers import assert_on_policy_training, tiny_config

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "assets" / "toy"
CONFIG = ROOT / "configs" / "toy_methods" / "e_grpo.yaml"
needs_toy = pytest.mark.skipif(not (TOY / "transformer").is_dir(), reason="assets/toy is not built")


def shifted_sigmas(num_steps: int = 16, shift: float = 3.0) -> torch.Tensor:
    """The toy's (and E-GRPO's FLUX) schedule: shift t / (1 + (shift - 1) t), t = linspace(1, 0)."""
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


# ----------------------------------------------------------------------------- the merged step


@pytest.mark.parametrize("step,count", [(1, 1), (1, 3), (4, 2), (8, 5), (12, 2)])
def test_merged_step_entropy_is_the_closed_form(step, count):
    """H = 0.5 log(2 pi e a^2 sigma_k / (1 - sigma_k) (sigma_k - sigma_{k+m})) per element."""
    sigmas, a = shifted_sigmas(), 0.7
    sigma, sigma_next = float(sigmas[step]), float(sigmas[step + count])
    expected = 0.5 * math.log(2 * math.pi * math.e * a ** 2 * sigma / (1 - sigma)
                              * (sigma - sigma_next))
    got = step_entropy("flow_sde", sigmas[step:step + 1], sigmas[step + count:step + count + 1], a)
    assert got.shape == (1,)
    assert float(got) == pytest.approx(expected, abs=1e-5)
    # merging one more step always raises it: the variance grows with dt
    if step + count + 1 < sigmas.numel():
        longer = step_entropy("flow_sde", sigmas[step:step + 1],
                              sigmas[step + count + 1:step + count + 2], a)
        assert float(longer) > float(got)


def test_entropy_rule_picks_the_fewest_steps_over_the_threshold():
    sigmas, a = shifted_sigmas(), 0.7

    def entropy(k, m):
        return float(step_entropy("flow_sde", sigmas[k:k + 1], sigmas[k + m:k + m + 1], a))

    counts = merge_counts_for_entropy(sigmas, [1, 2, 3, 4, 9], a, 1.1)
    for k, m in zip([1, 2, 3, 4, 9], counts):
        assert entropy(k, m) >= 1.1 and (m == 1 or entropy(k, m - 1) < 1.1), (k, m)
    assert counts[:4] == (2, 2, 3, 4)          # the toy config's counts
    # unreachable: the longest merge that keeps the last step deterministic (k + m = N - 1)
    assert merge_counts_for_entropy(sigmas, [12], a, 10.0) == (3,)
    with pytest.raises(ValueError, match="step 15"):
        merge_counts_for_entropy(sigmas, [15], a, 1.0)


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_merged_step_log_prob_is_the_gaussians(reduce):
    """The merged step is N(mean, std^2 I) with std^2 = a^2 sigma / (1 - sigma) dt and the
    Flow-GRPO drift over dt = sigma_k - sigma_{k+m}; its log-prob (sampled and replayed) is
    torch.distributions.Normal's, reduced over the row."""
    torch.manual_seed(0)
    sigmas, a, k, m = shifted_sigmas(), 0.7, 3, 4
    sigma, sigma_next = sigmas[k].expand(3), sigmas[k + m].expand(3)
    x, v = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    out = transition("flow_sde", v, x, sigma, sigma_next, noise_level=a, reduce=reduce,
                     generator=torch.Generator().manual_seed(1))
    s, dt = sigma.double(), (sigma - sigma_next).double()
    variance = a ** 2 * s / (1 - s) * dt
    assert torch.allclose(out.std.double() ** 2, variance, rtol=1e-5)
    xd, vd = x.double(), v.double()
    drift = (a ** 2 * s / (1 - s) / (2 * s)).reshape(-1, 1, 1, 1)
    mean = xd - (vd + drift * (xd + (1 - s.reshape(-1, 1, 1, 1)) * vd)) * dt.reshape(-1, 1, 1, 1)
    assert torch.allclose(out.mean.double(), mean, atol=1e-5)
    normal = torch.distributions.Normal(out.mean.double(),
                                        out.std.double().reshape(-1, 1, 1, 1))
    density = normal.log_prob(out.prev_sample.double()).flatten(1)
    expected = density.mean(1) if reduce == "mean" else density.sum(1)
    assert torch.allclose(out.log_prob.double(), expected, rtol=1e-5, atol=1e-4)
    replayed, _ = score_step(v, x, out.prev_sample, out.gaussian)
    assert torch.equal(replayed, out.log_prob)


class LinearVelocity:
    """A model stand-in for run_plan: v = 0.3 x - sigma (float32, CPU), no conditioning."""

    device = torch.device("cpu")
    dtype = torch.float32

    def velocity(self, x, sigma, cond, guidance_scale):
        return 0.3 * x - sigma.reshape(-1, 1, 1, 1)


def _settings():
    return RolloutSettings(kind="flow_sde", noise_level=0.7, guidance_scale=1.0, batch_size=4,
                           share_initial_noise=True, seed=3, iteration=5)


def test_merging_one_step_is_the_single_sde_step_bit_for_bit():
    """merge_counts 1 visits the base schedule: the plan is Flash-GRPO's one_step plan at the
    same k (same key), and run_plan gives the same latents, log-probs and replays."""
    sigmas = shifted_sigmas()
    assert torch.equal(merged_schedule(sigmas, 4, 1), sigmas)
    merge = make_plan(PlanConfig(kind="merge", merge_at=[4], merge_counts=[1]), sigmas, 0, 0, 0)
    one_step = make_plan(PlanConfig(kind="one_step", one_step_range=(4, 5)), sigmas, 0, 0, 0)
    assert merge == one_step and merge.stochastic == (4,) and merge.shared_prefix == 4
    x0 = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    rows, ids = torch.arange(4), torch.arange(10, 14)
    out_m, replay_m, calls_m = run_plan(LinearVelocity(), merge, x0, None, rows, ids, _settings())
    out_o, replay_o, calls_o = run_plan(LinearVelocity(), one_step, x0, None, rows, ids,
                                        _settings())
    assert torch.equal(out_m, out_o) and calls_m == calls_o == 16
    assert len(replay_m) == len(replay_o) == 1
    for name in ("latents", "next_latents", "logp_old", "mean_old", "std", "sigmas_next"):
        assert torch.equal(getattr(replay_m[0], name), getattr(replay_o[0], name)), name


def test_a_merged_plan_rolls_out_euler_then_one_long_sde_step_then_euler():
    """run_plan along a merge plan (k = 2, m = 3) is, step by step, Euler to sigma_2, the
    Flow-GRPO step sigma_2 -> sigma_5 with the sample's first SDE noise, Euler to 0: 14 calls."""
    sigmas, k, m = shifted_sigmas(), 2, 3
    plan = make_plan(PlanConfig(kind="merge", merge_at=[k], merge_counts=[m]), sigmas, 0, 0, 0)
    x0 = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    rows, ids, settings = torch.arange(4), torch.arange(10, 14), _settings()
    out, replay, calls = run_plan(LinearVelocity(), plan, x0, None, rows, ids, settings)
    model, x = LinearVelocity(), x0.clone()
    visited = torch.cat([sigmas[:k + 1], sigmas[k + m:]])
    for i in range(visited.numel() - 1):
        sigma, sigma_next = visited[i].expand(4), visited[i + 1].expand(4)
        v = model.velocity(x, sigma, None, 1.0)
        if i == k:
            noise = torch.stack([torch.randn(x.shape[1:], generator=seeded_generator(
                settings.seed, settings.iteration, "sde", int(sid))) for sid in ids])
            step = transition("flow_sde", v, x, sigma, sigma_next, noise_level=0.7, noise=noise)
            assert torch.equal(replay[0].logp_old, step.log_prob)
            assert torch.equal(replay[0].sigmas_next, sigmas[k + m].expand(4))
            x = step.prev_sample
        else:
            x = euler_step(x, v, sigma, sigma_next)
    assert torch.equal(out, x) and calls == 16 - (m - 1)


# ----------------------------------------------------------------------------- plans


def test_plan_merges_and_trains_one_step_per_group_in_turn():
    sigmas = shifted_sigmas()
    config = PlanConfig(kind="merge", merge_at=[1, 3, 6], merge_counts=[2, 1, 4])
    for iteration in (0, 1, 7):
        for group in range(6):
            k, m = [(1, 2), (3, 1), (6, 4)][(iteration + group) % 3]
            plan = make_plan(config, sigmas, iteration, group, seed=11)
            assert plan.stochastic == plan.trained == (k,)
            assert plan.shared_prefix == k and plan.num_steps == 16 - (m - 1)
            # sigma_{k+1} .. sigma_{k+m-1} are skipped: step k ends at sigma_{k+m}
            assert torch.equal(plan.sigmas[:k + 1], sigmas[:k + 1])
            assert torch.equal(plan.sigmas[k + 1:], sigmas[k + m:])
            assert [plan.solver_for(i) for i in range(plan.num_steps)] == \
                ["euler"] * k + ["sde"] + ["euler"] * (plan.num_steps - k - 1)
    # the same for any seed: no draw
    assert make_plan(config, sigmas, 2, 3, seed=1) == make_plan(config, sigmas, 2, 3, seed=2)
    assert replay_steps_per_chunk(config, 16) == 1
    # merge_counts null: every branch step unmerged
    plain = make_plan(PlanConfig(kind="merge", merge_at=[5]), sigmas, 0, 0, 0)
    assert plain.num_steps == 16 and plain.stochastic == (5,)


@pytest.mark.parametrize("fields,message", [
    ({"merge_at": [10], "merge_counts": [6]}, "merge_at 10 with merge_counts 6"),
    ({"merge_at": [1, 2], "merge_counts": [2]}, "merge_counts must be null or a list"),
    ({"merge_at": [], "merge_counts": None}, "merge_at must be a non-empty"),
    ({"merge_at": [1], "merge_counts": [0]}, "merge_counts must be null or a list"),
])
def test_bad_merge_fields_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        PlanConfig(kind="merge", **fields).validate(16)


def test_merge_needs_shared_initial_noise(tiny_sd3_path, tmp_path):
    with pytest.raises(ConfigError, match="sampling.share_initial_noise: true"):
        tiny_config(tiny_sd3_path, tmp_path, "sampling.plan.kind=merge",
                    "sampling.share_initial_noise=false")


# ----------------------------------------------------------------------------- training


def toy_config(tmp_path, *overrides):
    return load_config(CONFIG, [
        f"model.path={TOY}", f"run.output_dir={tmp_path}", "run.tracker=none",
        "run.progress=false", "run.num_threads=0", "run.comparison_grid=false",
        "run.eval_every=0", "run.checkpoint_every=0", "prompts.eval=null", "eval.rewards=[]",
        "training.prompts_per_iteration=4", "training.group_size=4",
        "sampling.rollout_batch_size=8", *overrides])


@needs_toy
def test_toy_branches_share_the_prefix_and_advantages_normalise_among_them(tmp_path):
    """One rollout of the toy config: every group trains one merged step, its members enter it
    from one state (the shared prefix) and leave it apart; each group's advantages are its
    rewards normalised among its own members (the members sharing the merged step)."""
    from flowgrpo.trainer import Trainer

    config = toy_config(tmp_path, "run.max_iterations=1")
    trainer = Trainer(config)
    batch, rewards, _ = trainer.rollout_and_score(0)
    steps_of_group: dict[int, set[int]] = {}
    entry: dict[int, list[torch.Tensor]] = {}
    for replay in batch.replay:
        for j, row in enumerate(replay.rows.tolist()):
            group = int(batch.group_ids[row])
            steps_of_group.setdefault(group, set()).add(replay.step)
            entry.setdefault(group, []).append((replay.latents[j], replay.next_latents[j]))
    plan = config.sampling.plan
    assert {g: s for g, s in steps_of_group.items()} == \
        {g: {plan.merge_at[g % 4]} for g in range(4)}
    for group, states in entry.items():
        assert len(states) == config.training.group_size
        assert all(torch.equal(x, states[0][0]) for x, _ in states)          # shared prefix
        assert all(not torch.equal(x1, states[0][1]) for _, x1 in states[1:])   # branched
    assert batch.trained_transitions == 16 and batch.nfe < 16
    advantages, _ = trainer.compute_advantages(batch, rewards)
    t = config.training
    total = rewards["total"].double()
    signal = 0
    for group in range(4):
        members = batch.group_ids == group
        r = total[members]
        std = r.std(unbiased=t.adv_ddof == 1)
        if float(std) == 0:
            assert torch.all(advantages[members] == 0)
            continue
        expected = ((r - r.mean()) / (std + t.adv_eps)).clamp(-t.adv_clip, t.adv_clip)
        assert torch.allclose(advantages[members].double(), expected, atol=1e-5)
        signal += 1
    assert signal > 0      # (3 of the 4 groups on this seed)


@needs_toy
def test_toy_run_is_on_policy_on_its_first_pass(tmp_path):
    assert_on_policy_training(toy_config(tmp_path, "run.max_iterations=2"), 16, iterations=2)


def test_tiny_sd3_iteration_is_on_policy_on_its_first_pass(tiny_sd3_path, tmp_path):
    config = tiny_config(tiny_sd3_path, tmp_path, "sampling.num_steps=5",
                         "sampling.share_initial_noise=true",
                         "sampling.plan={kind: merge, merge_at: [0, 1], merge_counts: [2, 3]}")
    assert_on_policy_training(config, 8)


@needs_toy
def test_replay_batch_count_matches_the_rollout_when_groups_chunk_apart(tmp_path):
    """A merge plan differs between groups, so each group rolls out in its own chunks: with
    rollout_batch_size 8 and groups of 4, 4 groups make 4 replay batches (not 16 / 8 = 2), the
    count the optimiser-step split (gradient_accumulation_steps) is derived from."""
    from flowgrpo.flow_batches import replay_batches_per_process
    from flowgrpo.trainer import Trainer

    config = toy_config(tmp_path, "run.max_iterations=1")
    batch, _, _ = Trainer(config).rollout_and_score(0)
    assert len(batch.replay) == 4
    assert replay_batches_per_process(config, 1) == len(batch.replay)
