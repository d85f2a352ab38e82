"""flowgrpo.plans: window sequences, determinism, per-group draws, compression and NFE."""
from __future__ import annotations

import pytest
import torch

from flowgrpo.plans import (
    PlanConfig,
    StepPlan,
    compress_schedule,
    make_plan,
    plan_seed,
    window_start,
)
from flowgrpo.sde import dpmpp_2m_step, dynamic_shift_sigmas, static_shift_sigmas, transition


def _starts(config: PlanConfig, num_steps: int, iterations, seed: int = 0) -> list[int]:
    base = static_shift_sigmas(num_steps, 3.0)
    plans = [make_plan(config, base, it, group_id=0, seed=seed) for it in iterations]
    for plan in plans:  # a window plan is its window: stochastic == trained == consecutive steps
        assert plan.trained == plan.stochastic
        assert plan.stochastic == tuple(range(plan.stochastic[0], plan.stochastic[-1] + 1))
        assert plan.shared_prefix == plan.stochastic[0]
    return [plan.stochastic[0] for plan in plans]


# ------------------------------------------------------------------------- full


def test_full_plan_flow_grpo_trains_first_steps_and_keeps_last_step_deterministic():
    base = static_shift_sigmas(10, 3.0)
    plan = make_plan(PlanConfig(kind="full", train_fraction=0.99), base, 3, 5, 0)
    assert plan.stochastic == tuple(range(9))
    assert plan.trained == tuple(range(9))          # int(10 * 0.99) = 9
    assert torch.equal(plan.sigmas, base) and plan.nfe == 10 and plan.shared_prefix == 0
    assert [plan.solver_for(i) for i in range(10)] == ["sde"] * 9 + ["euler"]
    half = make_plan(PlanConfig(kind="full", train_fraction=0.5), base, 3, 5, 0)
    assert half.trained == (0, 1, 2, 3, 4)


def test_full_plan_random_selection_is_per_group_and_deterministic():
    base = static_shift_sigmas(16, 3.0)
    config = PlanConfig(kind="full", train_fraction=0.6, train_select="random")
    chosen = {}
    for group_id in range(8):
        plan = make_plan(config, base, 2, group_id, 11)
        assert len(plan.trained) == 9                 # int(16 * 0.6)
        assert set(plan.trained) <= set(plan.stochastic) and plan.stochastic == tuple(range(15))
        assert make_plan(config, base, 2, group_id, 11) == plan
        chosen[group_id] = plan.trained
    assert len(set(chosen.values())) > 4
    assert make_plan(config, base, 3, 0, 11).trained != chosen[0] or \
        make_plan(config, base, 4, 0, 11).trained != chosen[0]


# ------------------------------------------------------------------------- window


def test_progressive_window_mixgrpo_defaults_move_every_interval_and_roll_back():
    config = PlanConfig(kind="window", window_size=4, window_stride=1, shift_interval=25)
    # range [0, 24): the window [s, s + 4) fits for s <= 20, i.e. 21 positions
    iterations = [0, 24, 25, 49, 50, 500, 524, 525, 550]
    assert _starts(config, 25, iterations) == [0, 0, 1, 1, 2, 20, 20, 0, 1]


def test_progressive_window_with_stride_roll_back_and_clamp():
    # N = 8: range [0, 7), size 3 -> last start 4; stride 3 -> positions 0, 3
    rolled = PlanConfig(kind="window", window_size=3, window_stride=3, shift_interval=2)
    assert _starts(rolled, 8, range(10)) == [0, 0, 3, 3, 0, 0, 3, 3, 0, 0]
    clamped = PlanConfig(kind="window", window_size=3, window_stride=3, shift_interval=2,
                         roll_back=False)
    assert _starts(clamped, 8, range(10)) == [0, 0, 3, 3, 4, 4, 4, 4, 4, 4]
    ranged = PlanConfig(kind="window", window_size=2, window_stride=2, shift_interval=1,
                        window_range=[2, 7])
    assert _starts(ranged, 10, range(5)) == [2, 4, 2, 4, 2]   # last start 5; positions 2, 4


def test_stride_zero_freezes_the_window_at_the_range_start():
    frozen = PlanConfig(kind="window", window_stride=0, shift_interval=1)
    assert set(_starts(frozen, 25, range(0, 200, 7))) == {0}
    frozen_ranged = PlanConfig(kind="window", window_stride=0, window_range=(3, 12))
    assert set(_starts(frozen_ranged, 25, range(0, 200, 13))) == {3}


def test_window_is_clipped_to_the_trainable_range():
    config = PlanConfig(kind="window", window_size=4, window_range=(1, 3))
    plan = make_plan(config, static_shift_sigmas(10, 3.0), 0, 0, 0)
    assert plan.stochastic == (1, 2) and plan.trained == (1, 2)


def test_random_window_is_deterministic_shared_by_groups_and_spans_the_range():
    config = PlanConfig(kind="window", window_strategy="random", window_size=4)
    base = static_shift_sigmas(25, 3.0)
    starts = []
    for iteration in range(60):
        plans = {make_plan(config, base, iteration, group_id, seed=7) for group_id in range(4)}
        assert len(plans) == 1                       # same for every group
        (plan,) = plans
        with torch.random.fork_rng(devices=[]):      # global RNG state is irrelevant
            torch.manual_seed(iteration)
            assert make_plan(config, base, iteration, 99, seed=7) == plan
        starts.append(plan.stochastic[0])
    assert all(0 <= s <= 20 for s in starts)
    assert len(set(starts)) >= 12
    assert starts != [make_plan(config, base, it, 0, seed=8).stochastic[0] for it in range(60)]
    assert window_start(config, 25, 5, 7) == starts[5]


def test_planners_do_not_touch_the_global_rng():
    base = static_shift_sigmas(20, 3.0)
    with torch.random.fork_rng(devices=[]):          # restores the global RNG afterwards
        torch.manual_seed(123)
        for kind in ("full", "window", "branch", "one_step"):
            config = PlanConfig(kind=kind, train_select="random", train_fraction=0.5,
                                window_strategy="random")
            state = torch.get_rng_state()
            first = make_plan(config, base, 4, 2, 0)
            assert torch.equal(torch.get_rng_state(), state)    # nothing consumed
            torch.rand(10)                           # a "rank" that used its RNG differently
            assert make_plan(config, base, 4, 2, 0) == first
    assert plan_seed(0, 4, 2, "branch") == plan_seed(0, 4, 2, "branch")
    assert plan_seed(0, 4, 2, "branch") != plan_seed(0, 4, 3, "branch")


# ------------------------------------------------------------------------- branch, one_step


def test_branch_start_differs_across_groups_and_is_fixed_within_a_group():
    base = static_shift_sigmas(10, 3.0)
    config = PlanConfig(kind="branch", window_size=3)
    plans = [make_plan(config, base, 5, g, seed=1) for g in range(32)]
    starts = [p.stochastic[0] for p in plans]
    assert len(set(starts)) > 1 and all(0 <= s < 5 for s in starts)   # default [0, N // 2)
    for group_id, plan in enumerate(plans):
        assert make_plan(config, base, 5, group_id, seed=1) == plan
        start = plan.stochastic[0]
        assert plan.stochastic == plan.trained == (start, start + 1, start + 2)
        assert plan.shared_prefix == start
        assert [plan.solver_for(i) for i in range(start)] == ["euler"] * start
    assert [make_plan(config, base, 6, g, seed=1).stochastic[0] for g in range(32)] != starts


def test_branch_window_never_covers_the_last_step():
    config = PlanConfig(kind="branch", window_size=4, branch_range=(2, 3))
    plan = make_plan(config, static_shift_sigmas(5, 3.0), 0, 0, 0)
    assert plan.stochastic == (2, 3)                 # [2, 6) clipped to [2, 4)


def test_one_step_k_differs_across_groups_and_is_shared_within_a_group():
    base = static_shift_sigmas(20, 3.0)
    config = PlanConfig(kind="one_step")
    ks = []
    for group_id in range(32):
        plan = make_plan(config, base, 9, group_id, seed=3)
        (k,) = plan.stochastic
        assert plan.trained == (k,) and plan.shared_prefix == k and 0 <= k < 10
        assert make_plan(config, base, 9, group_id, seed=3) == plan
        ks.append(k)
    assert len(set(ks)) > 3
    ranged = make_plan(PlanConfig(kind="one_step", one_step_range=[12, 13]), base, 0, 0, 0)
    assert ranged.stochastic == (12,)


# ------------------------------------------------------------------------- compression, NFE


def test_mixgrpo_flash_compressed_nfe_and_its_relation_to_the_paper():
    """N = 25, window [0, 4): post-window r = 21 steps -> int(21 * ratio) steps.

    Ours: ratio 0.4 -> 8 post steps -> NFE 12; Flash* ratio 0.2 -> 4 -> NFE 8. The paper reports
    11 and 7: MixGRPO's code builds int((N - last_window_index) * ratio) = int(22 * ratio) schedule
    *points* (both ends included) after the window, i.e. one step fewer (8 points = 7 steps).
    """
    base = dynamic_shift_sigmas(25, 4096)
    flash = PlanConfig(kind="window", window_stride=0, solver_after="dpmpp_2m", compress_ratio=0.4)
    plan = make_plan(flash, base, 0, 0, 0)
    assert plan.stochastic == (0, 1, 2, 3)
    assert plan.nfe == 12 and plan.sigmas.shape == (13,)
    assert torch.equal(plan.sigmas[:5], base[:5]) and plan.sigmas[-1] == 0
    assert bool((plan.sigmas[1:] < plan.sigmas[:-1]).all())
    assert [plan.solver_for(i) for i in range(12)] == ["sde"] * 4 + ["dpmpp_2m"] * 8
    flash_star = PlanConfig(kind="window", window_stride=0, solver_after="dpmpp_2m",
                            compress_ratio=0.2)
    assert make_plan(flash_star, base, 0, 0, 0).nfe == 8
    uncompressed = make_plan(PlanConfig(kind="window", window_stride=0), base, 0, 0, 0)
    assert uncompressed.nfe == 25 and torch.equal(uncompressed.sigmas, base)


def test_compressed_tail_follows_the_base_schedule_shape():
    base = static_shift_sigmas(25, 3.0)
    tail = base[5:]                                    # 20 steps
    every_other = compress_schedule(tail, 10)
    assert torch.equal(every_other, tail[::2])
    uneven = compress_schedule(tail, 7)
    assert uneven[0] == tail[0] and uneven[-1] == 0 and uneven.shape == (8,)
    # point j is the linear interpolation of the base schedule at fractional index 20 j / 7
    for j in range(1, 7):
        index = 20 * j / 7
        left, frac = int(index), index - int(index)
        expected = tail[left].item() + frac * (tail[left + 1].item() - tail[left].item())
        assert uneven[j].item() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="never refines"):
        compress_schedule(tail, 21)


def test_progressive_compressed_window_keeps_ratio_of_the_remaining_steps():
    base = static_shift_sigmas(25, 3.0)
    config = PlanConfig(kind="window", shift_interval=1, solver_after="dpmpp_2m",
                        compress_ratio=0.4)
    plan = make_plan(config, base, 10, 0, 0)           # window [10, 14), 11 steps remain
    assert plan.stochastic == (10, 11, 12, 13)
    assert plan.nfe == 14 + 4                          # int(11 * 0.4) = 4 post steps
    late = make_plan(config, base, 20, 0, 0)           # window [20, 24), 1 step remains
    assert late.nfe == 25


def _count_plan_evaluations(plan: StepPlan) -> int:
    """An ode_solve-style loop over a plan: SDE on stochastic steps, Euler before, solver_after
    after; returns how many times the velocity was evaluated."""
    calls = 0

    def velocity(x, sigma):
        nonlocal calls
        calls += 1
        return x - sigma[:, None]

    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    prev_x0 = prev_sigma = None
    for step in range(plan.num_steps):
        sigma = plan.sigmas[step].expand(3)
        sigma_next = plan.sigmas[step + 1].expand(3)
        v = velocity(x, sigma)
        solver = plan.solver_for(step)
        if solver == "dpmpp_2m":
            x, prev_x0 = dpmpp_2m_step(x, v, sigma, sigma_next, prev_x0=prev_x0,
                                       prev_sigma=prev_sigma, final=step == plan.num_steps - 1)
            prev_sigma = sigma
        else:
            kind = "flow_sde" if solver == "sde" else "ode"
            x = transition(kind, v, x, sigma, sigma_next).prev_sample
    return calls


@pytest.mark.parametrize("config", [
    PlanConfig(kind="full"),
    PlanConfig(kind="window", solver_after="dpmpp_2m", compress_ratio=0.4),
    PlanConfig(kind="window", window_stride=0, solver_after="dpmpp_2m", compress_ratio=0.2),
    PlanConfig(kind="branch", window_size=2),
    PlanConfig(kind="one_step", solver_after="dpmpp_2m"),
], ids=["full", "flash", "flash_star", "branch", "one_step"])
def test_nfe_equals_velocity_evaluations_of_a_loop_over_the_plan(config):
    for iteration in (0, 30, 140):
        plan = make_plan(config, static_shift_sigmas(25, 3.0), iteration, 1, 0)
        assert _count_plan_evaluations(plan) == plan.nfe


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize("change,match", [
    (dict(kind="sliding"), "sampling.plan.kind"),
    (dict(train_fraction=0.0), "sampling.plan.train_fraction"),
    (dict(train_fraction=0.05), "sampling.plan.train_fraction=0.05 trains"),
    (dict(train_select="last"), "sampling.plan.train_select"),
    (dict(window_size=0), "sampling.plan.window_size"),
    (dict(window_stride=-1), "sampling.plan.window_stride"),
    (dict(shift_interval=0), "sampling.plan.shift_interval"),
    (dict(window_strategy="decay"), "sampling.plan.window_strategy"),
    (dict(window_range=(3, 3)), "sampling.plan.window_range"),
    (dict(window_range=(0, 10)), "sampling.plan.window_range"),
    (dict(window_range=(0,)), "sampling.plan.window_range"),
    (dict(roll_back="yes"), "sampling.plan.roll_back"),
    (dict(solver_after="heun"), "sampling.plan.solver_after"),
    (dict(kind="window", compress_ratio=0.0), "sampling.plan.compress_ratio"),
    (dict(kind="branch", compress_ratio=0.5), "sampling.plan.compress_ratio"),
    (dict(branch_range=[4, 12]), "sampling.plan.branch_range"),
    (dict(one_step_range=[-1, 2]), "sampling.plan.one_step_range"),
])
def test_config_validation_names_the_field(change, match):
    config = PlanConfig(**change)
    with pytest.raises(ValueError, match=match):
        config.validate(10)
    with pytest.raises(ValueError, match=match):
        make_plan(config, static_shift_sigmas(10, 3.0), 0, 0, 0)


def test_step_plan_validation_and_identity():
    sigmas = static_shift_sigmas(6, 3.0)
    with pytest.raises(ValueError, match="StepPlan.trained"):
        StepPlan(sigmas, (1, 2), (3,))
    with pytest.raises(ValueError, match="StepPlan.stochastic"):
        StepPlan(sigmas, (4, 6), (4,))
    with pytest.raises(ValueError, match="StepPlan.shared_prefix"):
        StepPlan(sigmas, (2, 3), (2,), shared_prefix=3)
    with pytest.raises(ValueError, match="StepPlan.sigmas must be strictly decreasing"):
        StepPlan(torch.tensor([1.0, 0.5, 0.5, 0.0]), (0,), (0,))
    with pytest.raises(ValueError, match="StepPlan.solver_after"):
        StepPlan(sigmas, (0,), (0,), solver_after="heun")
    with pytest.raises(ValueError, match="sampling.num_steps"):
        make_plan(PlanConfig(), torch.tensor([1.0, 0.0]), 0, 0, 0)
    a = StepPlan(sigmas, [1, 2], [1], "euler", 1)
    b = StepPlan(sigmas.clone(), (1, 2), (1,), "euler", 1)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != StepPlan(sigmas, (1, 2), (2,), "euler", 1)
    assert a.stochastic == (1, 2)
    gapped = StepPlan(sigmas, (1, 3), (3,), "dpmpp_2m", 1)
    assert [gapped.solver_for(i) for i in range(6)] == ["euler", "sde", "euler", "sde",
                                                        "dpmpp_2m", "dpmpp_2m"]


# ------------------------------------------------------------------------- SDE noise streams


def test_step_noise_is_per_sample_and_independent_of_batching_and_start():
    from flowgrpo.rollout import RolloutSettings, StepNoise

    settings = RolloutSettings(kind="flow_sde", noise_level=0.7, guidance_scale=1.0, batch_size=4,
                               share_initial_noise=True, seed=3, iteration=5)
    steps = [1, 4, 6]
    together = StepNoise((2, 3), torch.tensor([7, 9, 11]), steps, settings)
    draws = {step: together(step) for step in steps}
    assert draws[1].shape == (3, 2, 3)
    # Sample 9 alone, starting at a later step (a split-off prefix): the same values.
    alone = StepNoise((2, 3), torch.tensor([9]), steps, settings)
    assert torch.equal(alone(4)[0], draws[4][1]) and torch.equal(alone(6)[0], draws[6][1])
    # Different samples, steps, iterations and seeds get different noise.
    assert not torch.equal(draws[1][0], draws[1][1]) and not torch.equal(draws[1][0], draws[4][0])
    other = RolloutSettings(**{**settings.__dict__, "iteration": 6})
    assert not torch.equal(StepNoise((2, 3), torch.tensor([7]), steps, other)(1)[0], draws[1][0])
    # Unit normal: mean ~0, variance ~1 over many samples.
    many = StepNoise((64,), torch.arange(256), steps, settings)(1)
    assert abs(float(many.mean())) < 0.02 and abs(float(many.var()) - 1) < 0.03
    with pytest.raises(ValueError, match="not a remaining SDE step"):
        together(5)
    with pytest.raises(ValueError, match="not a remaining SDE step"):
        StepNoise((2,), torch.tensor([0]), steps, settings)(2)
