"""flowgrpo.plans: window sequences, determinism, per-group draws, compression and NFE; the
rollout's use of a plan (per-sample trained steps, the seeded DPM-Solver++ step after a window).

MixGRPO facts used below come from its release (Tencent-Hunyuan/MixGRPO): the window schedule of
fastvideo/utils/grpo_states.py (GRPOTrainingStates with max_timesteps = sampling_steps - 2,
window = range(cur, min(cur + size, max_timesteps)), roll back when cur > max_timesteps), the
post-window grid of fastvideo/utils/sampling_utils.py (int((N - last) ratio) points from the step
after the window to 0, uniform in the unshifted time) and its DPMState, which holds the x0 of
every step up to the window's last."""
from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.plans import (
    PlanConfig,
    StepPlan,
    compress_schedule,
    compressed_steps,
    make_plan,
    plan_seed,
    sample_trained_steps,
    window_schedule,
    window_start,
)
from flowgrpo.sde import (dpmpp_2m_step, dynamic_shift_sigmas, shift_sigma, shifted_linear_sigmas,
                          static_shift_sigmas, transition)


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


def test_mixgrpo_flash_compressed_nfe_equals_the_paper():
    """N = 25, window [0, 4): MixGRPO builds int((N - last) ratio) = int(22 ratio) grid points
    from the step after the window to 0, i.e. int(22 ratio) - 1 steps: Flash (0.4) 4 + 7 = 11
    evaluations, Flash* (0.2) 4 + 3 = 7, the paper's counts."""
    base = dynamic_shift_sigmas(25, 4096)
    flash = PlanConfig(kind="window", window_stride=0, solver_after="dpmpp_2m", compress_ratio=0.4)
    plan = make_plan(flash, base, 0, 0, 0)
    assert plan.stochastic == (0, 1, 2, 3)
    assert plan.nfe == 11 and plan.sigmas.shape == (12,)
    assert torch.equal(plan.sigmas[:5], base[:5]) and plan.sigmas[-1] == 0
    assert bool((plan.sigmas[1:] < plan.sigmas[:-1]).all())
    assert [plan.solver_for(i) for i in range(11)] == ["sde"] * 4 + ["dpmpp_2m"] * 7
    flash_star = PlanConfig(kind="window", window_stride=0, solver_after="dpmpp_2m",
                            compress_ratio=0.2)
    assert make_plan(flash_star, base, 0, 0, 0).nfe == 7
    uncompressed = make_plan(PlanConfig(kind="window", window_stride=0), base, 0, 0, 0)
    assert uncompressed.nfe == 25 and torch.equal(uncompressed.sigmas, base)
    assert compressed_steps(21, 0.4) == 7 and compressed_steps(21, 0.2) == 3
    assert compressed_steps(1, 0.4) == 1 and compressed_steps(5, 1.0) == 5


def _anchor_nfe(start: int, size: int, num_steps: int, max_timesteps: int, ratio: float) -> int:
    """MixGRPO-Flash's transformer calls per sample for a window starting at ``start``: every
    step up to the window's last, then int((N - last) ratio) grid points after it (one step
    fewer)."""
    last = min(start + size, max_timesteps) - 1
    points = int(max((num_steps - last) * ratio, 1))
    return last + 1 + points - 1


def test_nfe_over_a_whole_mixgrpo_flash_run_equals_the_released_count():
    base = shifted_linear_sigmas(25, 3.0)
    config = PlanConfig(kind="window", window_size=4, shift_interval=1, window_range=[0, 23],
                        window_end="shrink", solver_after="dpmpp_2m", compress_ratio=0.4)
    for iteration in range(23):
        plan = make_plan(config, base, iteration, 0, 0, time_shift=3.0)
        start = plan.stochastic[0]
        assert start == iteration
        anchor = _anchor_nfe(start, 4, 25, 23, 0.4)
        if start + 4 <= 21:      # the anchor's grid degenerates (no post step) for the last starts
            assert plan.nfe == anchor, start
        assert plan.sigmas[-1] == 0


def test_compressed_grid_is_uniform_in_the_unshifted_time_like_mixgrpo():
    """With the base grid shift_3(linspace(1, 0, 26)) (MixGRPO's FLUX schedule) the post-window
    grid is shift_3(linspace(t[last + 1], 0, points)) exactly, as MixGRPO's "post" strategy."""
    base = shifted_linear_sigmas(25, 3.0)
    config = PlanConfig(kind="window", window_size=4, shift_interval=1, window_range=[0, 23],
                        solver_after="dpmpp_2m", compress_ratio=0.4)
    for start in (0, 5, 12):
        plan = make_plan(config, base, start, 0, 0, time_shift=3.0)
        last = start + 3
        points = int(max((25 - last) * 0.4, 1))
        t = torch.linspace(1, 0, 26, dtype=torch.float64)[last + 1].item()
        expected = shift_sigma(torch.linspace(t, 0, points, dtype=torch.float64), 3.0).float()
        torch.testing.assert_close(plan.sigmas[last + 1:], expected, rtol=0, atol=1e-6)
        assert torch.equal(plan.sigmas[:last + 1], base[:last + 1])


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
    assert plan.nfe == 14 + 3                          # int(12 * 0.4) - 1 = 3 post steps
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
    (dict(window_strategy="linear"), "sampling.plan.window_strategy"),
    (dict(window_end="wrap"), "sampling.plan.window_end"),
    (dict(decay_min_interval=0), "sampling.plan.decay_min_interval"),
    (dict(decay_max_interval=2, decay_min_interval=3), "sampling.plan.decay_max_interval"),
    (dict(exp_decay_rate=-0.1), "sampling.plan.exp_decay_rate"),
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


# ------------------------------------------------------------------------- MixGRPO's schedule


class _AnchorWindow:
    """MixGRPO's GRPOTrainingStates for the strategies progressive / decay / exp_decay with
    prog_overlap (a stride), written from its released rules: get the window, then update."""

    def __init__(self, strategy, interval, size, max_timesteps, stride=1, roll_back=True,
                 max_iters=10, min_iters=1, threshold=13, rate=0.1):
        self.strategy, self.interval, self.size = strategy, interval, size
        self.max_timesteps, self.stride, self.roll_back = max_timesteps, stride, roll_back
        self.max_iters, self.min_iters, self.threshold, self.rate = max_iters, min_iters, \
            threshold, rate
        self.cur, self.in_group = 0, 0

    def timesteps(self) -> list[int]:
        return list(range(self.cur, min(self.cur + self.size, self.max_timesteps)))

    def _iters(self) -> float:
        if self.strategy == "decay":
            progress = self.cur / self.max_timesteps
            return max(self.min_iters, int(self.max_iters * (1 - progress)
                                           + self.min_iters * progress))
        if self.strategy == "exp_decay":
            return math.ceil(self.interval * math.exp(-self.rate * max(0, self.cur
                                                                       - self.threshold)))
        return self.interval

    def update(self) -> None:
        self.in_group += 1
        if self.in_group >= self._iters():
            self.in_group = 0
            self.cur += self.stride
        if self.cur > self.max_timesteps:
            if self.roll_back:
                self.cur, self.in_group = 0, 0
            else:
                self.cur = self.max_timesteps


@pytest.mark.parametrize("strategy,interval", [("progressive", 25), ("progressive", 20),
                                               ("decay", 25), ("exp_decay", 25), ("exp_decay", 5)])
@pytest.mark.parametrize("roll_back", [True, False])
def test_window_positions_over_a_run_equal_mixgrpo_schedule(strategy, interval, roll_back):
    """MixGRPO's released settings (25 steps, window 4, stride 1, max_timesteps 23, decay
    max/min 10/1, exp_decay threshold 13 and rate 0.1): over more than two cycles every window,
    including the shrinking end and the empty position before the roll back, equals the anchor."""
    config = PlanConfig(kind="window", window_size=4, window_stride=1, shift_interval=interval,
                        window_strategy=strategy, window_range=[0, 23], window_end="shrink_empty",
                        roll_back=roll_back, decay_max_interval=10, decay_min_interval=1)
    anchor = _AnchorWindow(strategy, interval, 4, 23, roll_back=roll_back)
    base = shifted_linear_sigmas(25, 3.0)
    cycle = sum(iterations for _, iterations in window_schedule(config, 25))
    seen_shrunk = seen_empty = False
    for iteration in range(2 * cycle + 7):
        expected = anchor.timesteps()
        anchor.update()
        plan = make_plan(config, base, iteration, group_id=3, seed=0)
        assert list(plan.stochastic) == expected, iteration
        assert plan.trained == plan.stochastic
        seen_shrunk |= 0 < len(expected) < 4
        seen_empty |= not expected
    assert seen_shrunk and seen_empty


def test_window_end_variants_and_the_schedule_they_walk():
    def ends(window_end):
        config = PlanConfig(kind="window", window_size=4, shift_interval=1, window_range=[0, 23],
                            window_end=window_end)
        return [start for start, _ in window_schedule(config, 25)]

    assert ends("fit")[-1] == 19 and ends("shrink")[-1] == 22 and ends("shrink_empty")[-1] == 23
    shrink = PlanConfig(kind="window", window_size=4, shift_interval=1, window_range=[0, 23],
                        window_end="shrink")
    base = shifted_linear_sigmas(25, 3.0)
    windows = [make_plan(shrink, base, it, 0, 0).stochastic for it in range(20, 25)]
    assert windows == [(20, 21, 22), (21, 22), (22,), (0, 1, 2, 3), (1, 2, 3, 4)]
    decay = PlanConfig(kind="window", window_strategy="decay", window_range=[0, 23],
                       window_end="shrink_empty", decay_max_interval=10, decay_min_interval=1)
    intervals = [it for _, it in window_schedule(decay, 25)]
    assert intervals[0] == 10 and intervals[-1] == 1 and intervals == sorted(intervals, reverse=True)
    exp = PlanConfig(kind="window", window_strategy="exp_decay", shift_interval=25)
    intervals = [it for _, it in window_schedule(exp, 25)]
    assert intervals[:14] == [25] * 14 and intervals[14] == math.ceil(25 * math.exp(-0.1))


# ------------------------------------------------------------------------- the rollout of a plan


class _AffineModel:
    """A FlowModel stand-in whose velocity is row-wise affine in x (no batch coupling)."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self):
        self.calls = []

    def velocity(self, x, sigma, cond, guidance_scale):
        self.calls.append(x.shape[0])
        return 0.3 * x - sigma.reshape(-1, *[1] * (x.ndim - 1)) * 0.5 + 0.1


class _Cond:
    def select(self, index):
        return self


def _settings(**changes):
    from flowgrpo.rollout import RolloutSettings

    values = dict(kind="flow_sde", noise_level=0.7, guidance_scale=1.0, batch_size=4,
                  share_initial_noise=False, seed=0, iteration=0)
    values.update(changes)
    return RolloutSettings(**values)


def test_first_post_window_dpm_step_is_second_order_when_seeded():
    """run_plan seeds DPM-Solver++(2M) with the window's last x0 estimate (MixGRPO's DPMState
    holds it), so the first post-window step is second order; unseeded it would be first order."""
    from flowgrpo.rollout import run_plan

    config = PlanConfig(kind="window", window_size=2, window_stride=0, window_range=[2, 9],
                        solver_after="dpmpp_2m", compress_ratio=0.5)
    plan = make_plan(config, static_shift_sigmas(10, 3.0), 0, 0, 0)
    assert plan.stochastic == (2, 3)
    model = _AffineModel()
    x0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    rows, ids = torch.arange(3), torch.arange(3)
    # noise level 0: the window's SDE steps are Euler, so the whole trajectory is deterministic
    out, replay, calls = run_plan(model, plan, x0, _Cond(), rows, ids, _settings(noise_level=0.0))
    assert calls == plan.nfe and len(replay) == 2

    def reference(seeded: bool):
        x = x0.clone()
        prev_x0 = prev_sigma = None
        for i in range(plan.num_steps):
            sigma, sigma_next = plan.sigmas[i].expand(3), plan.sigmas[i + 1].expand(3)
            v = model.velocity(x, sigma, None, 1.0)
            if i <= 3:
                if i == 3 and seeded:
                    prev_x0, prev_sigma = x - sigma[:, None] * v, sigma
                x = transition("ode", v, x, sigma, sigma_next).prev_sample
            else:
                x, x0_hat = dpmpp_2m_step(x, v, sigma, sigma_next, prev_x0=prev_x0,
                                          prev_sigma=prev_sigma, final=i == plan.num_steps - 1)
                prev_x0, prev_sigma = x0_hat, sigma
        return x

    torch.testing.assert_close(out, reference(seeded=True), rtol=0, atol=1e-6)
    assert not torch.allclose(out, reference(seeded=False), atol=1e-4)


def test_dance_grpo_per_sample_trained_steps_split_the_call_and_keep_the_trajectory():
    """train_select random_per_sample (DanceGRPO's per-sample permutation): each sample trains its
    own int((N - 1) fraction) steps; a step's call is split into the rows that train it and the others,
    each replay batch holds exactly the rows that train its step, and the trajectory is the one an
    unsplit call gives."""
    from flowgrpo.rollout import run_plan

    config = PlanConfig(kind="full", train_fraction=0.6, train_select="random_per_sample")
    base = static_shift_sigmas(10, 3.0)
    plan = make_plan(config, base, 4, 0, 7)
    assert plan.trained == plan.stochastic == tuple(range(9))
    subsets = [sample_trained_steps(config, plan, 4, sid, 7) for sid in range(6)]
    assert all(len(steps) == 5 and set(steps) <= set(plan.stochastic) for steps in subsets)
    assert len(set(subsets)) > 1                                      # per sample, not per group
    assert subsets[2] == sample_trained_steps(config, plan, 4, 2, 7)   # a pure function
    assert subsets[2] != sample_trained_steps(config, plan, 5, 2, 7)
    per_group = PlanConfig(kind="full", train_fraction=0.6, train_select="random")
    group_plan = make_plan(per_group, base, 4, 0, 7)
    assert sample_trained_steps(per_group, group_plan, 4, 2, 7) == group_plan.trained

    x0 = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    rows, ids = torch.arange(6), torch.arange(6)
    split_model, whole_model = _AffineModel(), _AffineModel()
    split, replay, _ = run_plan(split_model, plan, x0, _Cond(), rows, ids, _settings(),
                                row_trained=subsets)
    whole, whole_replay, _ = run_plan(whole_model, plan, x0, _Cond(), rows, ids, _settings())
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-6)
    for batch in replay:
        expected = [r for r in range(6) if batch.step in subsets[r]]
        assert batch.rows.tolist() == expected
        reference = next(b for b in whole_replay if b.step == batch.step)
        torch.testing.assert_close(batch.logp_old, reference.logp_old[batch.rows], rtol=0,
                                   atol=1e-6)
    assert sum(len(b.rows) for b in replay) == 6 * 5
    assert len(split_model.calls) > len(whole_model.calls)           # mixed steps were split



def test_the_rollout_asks_the_plan_which_solver_each_deterministic_step_uses(monkeypatch):
    """One code path for a plan's per-step solver: rollout.run_plan (what training calls)
    consults StepPlan.solver_for for every step that is not an SDE step, and integrates the
    steps after the window with DPM-Solver++ exactly when the plan says so."""
    from types import SimpleNamespace

    from flowgrpo import rollout

    base = static_shift_sigmas(12, 3.0)
    plan = make_plan(PlanConfig(kind="window", shift_interval=1, window_size=3,
                                solver_after="dpmpp_2m"), base, 2, 0, 0)
    asked: list[tuple[int, str]] = []
    real = StepPlan.solver_for

    def spy(self, step):
        asked.append((step, real(self, step)))
        return asked[-1][1]

    solved: list[int] = []
    real_dpmpp = rollout.dpmpp_2m_step

    def dpmpp_spy(*args, **kwargs):
        solved.append(len(asked) - 1)
        return real_dpmpp(*args, **kwargs)

    monkeypatch.setattr(StepPlan, "solver_for", spy)
    monkeypatch.setattr(rollout, "dpmpp_2m_step", dpmpp_spy)
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32,
                            velocity=lambda x, sigma, cond, g: x - sigma.view(-1, 1))
    settings = rollout.RolloutSettings(kind="flow_sde", noise_level=0.7, guidance_scale=1.0,
                                       batch_size=2, share_initial_noise=False, seed=0,
                                       iteration=2)
    latents = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    rollout.run_plan(model, plan, latents, None, torch.arange(2), torch.arange(2), settings)
    deterministic = [i for i in range(plan.num_steps) if i not in plan.stochastic]
    assert [step for step, _ in asked] == deterministic
    after = [k for k, (step, solver) in enumerate(asked) if solver == "dpmpp_2m"]
    assert after and solved == after   # DPM-Solver++ ran on exactly the steps the plan names
    assert all(step > plan.stochastic[-1] for step, solver in asked if solver == "dpmpp_2m")
