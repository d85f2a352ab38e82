"""configs/toy_methods/ and benchmarks/methods.py: each method's config is the method it names
(checked against a table of what each method IS, through the plans it builds), the benchmark's
statistics, time-to-target, resume and config-editing helpers on synthetic inputs, and its quick
mode end to end (slow)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowgrpo.config import load_config, to_dict
from flowgrpo.flow_batches import accumulation_steps, replay_batches_per_process
from flowgrpo.plans import make_plan, sample_trained_steps

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "assets" / "toy"
needs_toy = pytest.mark.skipif(not (TOY / "transformer").is_dir(), reason="assets/toy is not built")


BENCHMARK = "methods"   # benchmarks/<BENCHMARK>.py, the `bench` fixture (conftest.py)


def method_config(bench, name, *overrides):
    return load_config(bench.METHODS[name].path, [f"model.path={TOY}", *overrides])


# What each method IS on the toy's 16 steps (its anchors, scaled as the config headers say):
# the transition kind, which steps are stochastic and trained, how they are drawn, the solver
# after the last stochastic step, whether a group shares its initial noise, and the loss options.
#   stochastic: "all" (every step but the last) or the number of consecutive SDE steps
#   trained: "all" (every stochastic step), "per_sample" (this many per sample, drawn per sample),
#            or "stochastic" (the stochastic steps)
#   moves: "group" (drawn per group), "iteration" (the same for every group, moving with the
#          iteration), "fixed"
#   first_half: stochastic steps lie in [0, 8); below: they lie in [0, below), each visited
IS = {
    "flow_grpo": dict(kind="flow_sde", stochastic="all", trained="all", moves="fixed",
                      solver="euler", shared=False),
    "flow_grpo_guard": dict(kind="flow_sde", stochastic="all", trained="all", moves="fixed",
                            solver="euler", shared=False, ratio_norm=True, dt_reweight=True),
    "dance_grpo": dict(kind="dance_sde", stochastic="all", trained=("per_sample", 9),
                       moves="fixed", solver="euler", shared=True),
    "mix_grpo": dict(kind="flow_sde", stochastic=3, trained="stochastic", moves="iteration",
                     solver="euler", shared=True),
    "mix_grpo_flash": dict(kind="flow_sde", stochastic=3, trained="stochastic",
                           moves="iteration", solver="dpmpp_2m", shared=True, compressed=True),
    "flow_grpo_fast": dict(kind="flow_sde", stochastic=2, trained="stochastic", moves="group",
                           solver="euler", shared=False, first_half=True),
    "flow_grpo_fast_cps": dict(kind="cps", stochastic=3, trained="stochastic", moves="group",
                               solver="euler", shared=False, first_half=True,
                               log_prob="unscaled"),
    # Flash-GRPO: one initial noise a group (the anchor's is per video; benchmarks/README.md
    # measured why the toy needs it)
    "flash_grpo": dict(kind="flash_sde", stochastic=1, trained="stochastic", moves="group",
                       solver="euler", shared=True, first_half=True, rectification=True),
    # E-GRPO: its one SDE step merges 2-4 schedule steps, so every plan visits fewer than 16
    "e_grpo": dict(kind="flow_sde", stochastic=1, trained="stochastic", moves="group",
                   solver="euler", shared=True, first_half=True, compressed=True),
    # TempFlow-GRPO: one branch step a group, cycling over the schedule; noise-aware weights
    "tempflow_grpo": dict(kind="flow_sde", stochastic=1, trained="stochastic", moves="group",
                          solver="euler", shared=True, loss_scale="noise_aware"),
    # the same, branching only at steps 0-8 (the steps where the base's groups carry a signal)
    "tempflow_grpo_early": dict(kind="flow_sde", stochastic=1, trained="stochastic",
                                moves="group", solver="euler", shared=True,
                                loss_scale="noise_aware", below=9),
    # TreeGRPO / BranchGRPO: a tree a group, binary splits at each of the window's 3 SDE steps
    "tree_grpo": dict(kind="flow_sde", stochastic=3, trained="stochastic", moves="fixed",
                      solver="euler", shared=True, first_half=True),
    # VGPO: Flow-GRPO's rollouts, one advantage a trained step from its one-step predictions
    "vgpo": dict(kind="flow_sde", stochastic="all", trained="all", moves="fixed",
                 solver="euler", shared=False, advantage="vgpo"),
    "euphonium": dict(kind="flow_sde", stochastic="all", trained="all", moves="fixed",
                      solver="euler", shared=False, reward_guidance="toy_proxy"),
    "default": dict(kind="flow_sde", stochastic=4, trained="stochastic", moves="group",
                    solver="euler", shared=False, first_half=True),
    # VGPO's advantages on the default's rollouts and update
    "vgpo_branch": dict(kind="flow_sde", stochastic=4, trained="stochastic", moves="group",
                        solver="euler", shared=False, first_half=True, advantage="vgpo"),
    # Pref-GRPO: the default's rollouts; only the reward differs (the group win rate)
    "pref_grpo": dict(kind="flow_sde", stochastic=4, trained="stochastic", moves="group",
                      solver="euler", shared=False, first_half=True),
    "default_cgpo": dict(kind="flow_sde", stochastic=4, trained="stochastic", moves="group",
                         solver="euler", shared=False, first_half=True, curriculum=True),
}


# The sample-based algorithms: ODE rollouts (Euler, 16 steps) from independent noise, each final
# sample trained at `levels` noise levels per iteration.
SAMPLE_IS = {"nft": dict(levels=2, kl_beta=1e-4), "awm": dict(levels=2, kl_beta=1e-4),
             "dgpo": dict(levels=2, kl_beta=1e-3), "dpo": dict(levels=2, kl_beta=0.0),
             "gdro": dict(levels=2, kl_beta=0.0),
             # DGPO with the default's guard: the anchor below its training levels
             "dgpo_guarded": dict(levels=2, kl_beta=1e-3, algorithm="dgpo", anchor_beta=5.0),
             "awm_guarded": dict(levels=2, kl_beta=1e-4, algorithm="awm", anchor_beta=5.0),
             "nft_guarded": dict(levels=2, kl_beta=1e-4, algorithm="nft", anchor_beta=5.0),
             "nft_clean": dict(levels=2, kl_beta=1e-4, algorithm="nft", anchor_beta=10.0),
             "dpo_guarded": dict(levels=2, kl_beta=0.0, algorithm="dpo", anchor_beta=5.0),
             # E2PO: nft with perturbed prompt embeddings in the rollout
             "e2po": dict(levels=2, kl_beta=1e-4, algorithm="nft")}


def plans_of(config, iterations, groups=range(8)):
    sigmas = torch.linspace(1, 0, config.sampling.num_steps + 1)
    return {(it, g): make_plan(config.sampling.plan, sigmas, it, g, config.run.seed)
            for it in iterations for g in groups}


def test_the_table_covers_every_method_and_every_config_file(bench):
    assert set(IS) | set(SAMPLE_IS) == set(bench.METHODS)
    files = {p.name for p in (ROOT / "configs" / "toy_methods").glob("*.yaml")}
    assert files == {Path(m.config).name for m in bench.METHODS.values()
                     if m.config.startswith("configs/toy_methods/")}
    assert bench.METHODS["default"].config == "configs/toy_geneval.yaml"


@pytest.mark.parametrize("name", sorted(IS))
def test_each_config_is_its_method(bench, name):
    config = method_config(bench, name)
    spec = IS[name]
    s, t = config.sampling, config.training
    assert s.num_steps == 16 and s.kind == spec["kind"]
    assert s.share_initial_noise == spec["shared"]
    assert s.log_prob == spec.get("log_prob", "exact")
    assert (t.ratio_norm, t.dt_reweight) == (spec.get("ratio_norm", False),
                                            spec.get("dt_reweight", False))
    assert t.rectification == spec.get("rectification", False)
    assert t.loss_scale == spec.get("loss_scale", "none")
    assert t.advantage == spec.get("advantage", "auto")
    assert config.prompts.curriculum.enabled == spec.get("curriculum", False)
    assert s.reward_guidance.reward == spec.get("reward_guidance", "")
    iterations = range(0, config.run.max_iterations, max(config.run.max_iterations // 40, 1))
    plans = plans_of(config, iterations)
    for (it, group), plan in plans.items():
        stochastic, trained = plan.stochastic, plan.trained
        if spec["stochastic"] == "all":
            assert stochastic == tuple(range(15))
        else:
            size = spec["stochastic"]
            assert len(stochastic) == size and stochastic == tuple(
                range(stochastic[0], stochastic[0] + size)), (it, group, stochastic)
        if spec["trained"] in ("all", "stochastic"):
            assert trained == stochastic
        if spec.get("first_half"):
            assert stochastic[-1] < 8
        if "below" in spec:
            assert stochastic[-1] < spec["below"]
        assert plan.solver_after == spec["solver"]
        assert (plan.num_steps < 16) == spec.get("compressed", False)
    starts = {plan.stochastic[0] for plan in plans.values()}
    if "below" in spec:     # every step below the bound is visited
        assert starts == set(range(spec["below"]))
    if spec["moves"] == "fixed":
        assert len(starts) == 1
    elif spec["moves"] == "group":
        # drawn per (iteration, group): the groups of one iteration differ
        assert len({plans[(0, g)].stochastic for g in range(8)}) > 1
    else:
        # the same window for every group of an iteration, moving one step at a time
        assert all(len({plans[(it, g)].stochastic for g in range(8)}) == 1 for it in iterations)
        path = [plans[(it, 0)].stochastic[0] for it in iterations]
        assert len(set(path)) > 3 and all(b - a in (0, 1) or b == 0 for a, b in zip(path, path[1:]))
        assert max(path) < 14
    if isinstance(spec["trained"], tuple):
        # DanceGRPO: a random subset of each sample's steps, drawn per sample
        count = spec["trained"][1]
        plan = plans[(0, 0)]
        subsets = [sample_trained_steps(s.plan, plan, 0, sample, config.run.seed)
                   for sample in range(8)]
        assert all(len(sub) == count and set(sub) <= set(plan.stochastic) for sub in subsets)
        assert len(set(subsets)) > 1


@pytest.mark.parametrize("name", sorted(SAMPLE_IS))
def test_each_sample_config_is_its_algorithm(bench, name):
    config = method_config(bench, name)
    s, t = config.sampling, config.training
    spec = SAMPLE_IS[name]
    assert t.algorithm == spec.get("algorithm", name)
    assert s.plan.kind == "ode" and s.plan.solver_after == "euler"
    assert t.anchor_beta == spec.get("anchor_beta", 0.0)
    assert s.num_steps == 16 and not s.share_initial_noise
    assert t.timesteps.count == SAMPLE_IS[name]["levels"]
    assert t.kl_beta == SAMPLE_IS[name]["kl_beta"]
    plan = plans_of(config, [0])[(0, 0)]
    assert plan.stochastic == () and plan.trained == ()


# The guard's overrides that benchmarks/README.md ("With the image guard") measured on each
# unguarded config (COMMANDS.md): a guarded config is exactly that, its name aside.
GUARD_OVERRIDES = {"dgpo": ("training.anchor_beta=5.0", "training.anchor_sigma_max=0.45"),
                   "awm": ("training.anchor_beta=5.0", "training.anchor_sigma_max=0.45",
                           "training.timesteps.fraction=0.6"),
                   "nft": ("training.anchor_beta=5.0", "training.anchor_sigma_max=0.45",
                           "training.timesteps.fraction=0.6"),
                   "dpo": ("training.anchor_beta=5.0", "training.anchor_sigma_max=0.45",
                           "training.timesteps.fraction=0.6")}


def test_the_clean_nft_config_is_the_measured_run(bench):
    # benchmarks/README.md: nft_guarded with --set training.anchor_beta=10
    # --set run.max_iterations=170 (every other field, evaluation cadence aside, the same), at
    # nft_guarded's lr of then (8e-4; the fair grid of 2026-12-07 moved it to 2e-4)
    measured = to_dict(method_config(bench, "nft_guarded", "training.anchor_beta=10",
                                     "run.max_iterations=170", "training.lr=8.0e-4"))
    shipped = to_dict(method_config(bench, "nft_clean"))
    for config in (measured, shipped):
        config.pop("name")
        for key in ("eval_every", "checkpoint_every"):
            config["run"].pop(key)
    assert shipped == measured


# A guarded config's own schedule: its algorithm's lr from the fair grid (2026-12-07, the
# unguarded config's), its caps calibrated for itself the same day (1.25x the fit of a 6-iteration
# calibration; the runs were cheaper, so six of nine reached the cap before 600 CPU s).
GUARDED_CAPS = {"dgpo": ("run.max_iterations=82", "run.eval_every=20", "run.checkpoint_every=20"),
                "awm": ("run.max_iterations=80", "run.eval_every=20", "run.checkpoint_every=20"),
                "nft": ("run.max_iterations=75", "run.eval_every=18", "run.checkpoint_every=18"),
                "dpo": ("run.max_iterations=120", "run.eval_every=30", "run.checkpoint_every=30")}


@pytest.mark.parametrize("name", sorted(GUARD_OVERRIDES))
def test_guarded_configs_are_the_measured_runs(bench, name):
    measured = to_dict(method_config(bench, name, *GUARD_OVERRIDES[name], *GUARDED_CAPS[name]))
    shipped = to_dict(method_config(bench, f"{name}_guarded"))
    assert {k: v for k, v in shipped.items() if k != "name"} == \
        {k: v for k, v in measured.items() if k != "name"}


@pytest.mark.parametrize("name", sorted(IS) + sorted(SAMPLE_IS))
def test_every_method_takes_the_toy_world_base_batch_and_evaluation(bench, name):
    default = to_dict(method_config(bench, "default"))
    mine = to_dict(method_config(bench, name))
    shared = [("model",), ("prompts", "train"), ("prompts", "eval"), ("prompts", "balance_key"),
              ("prompts", "eval_per_family"), ("prompts", "eval_seed"),
              ("sampling", "eval_num_steps"), ("sampling", "guidance_scale"),
              ("sampling", "eval_guidance_scale"), ("sampling", "rollout_batch_size"),
              ("training", "prompts_per_iteration"), ("training", "group_size"),
              ("training", "lr_decay"), ("training", "lr_final_ratio"), ("training", "kl_beta"),
              ("training", "adv_scale"), ("training", "skip_zero_std_groups"),
              ("training", "ema"), ("rewards",)]
    if name in SAMPLE_IS:   # their anchors' own velocity KL and zero-variance handling
        shared = [p for p in shared if p not in (("training", "kl_beta"),
                                                 ("training", "skip_zero_std_groups"))]
    if name == "pref_grpo":   # the group win rate over the verifier's partial credit
        shared.remove(("rewards",))
    for path in shared:
        a, b = default, mine
        for part in path:
            a, b = a[part], b[part]
        assert a == b, (name, path)
    if name == "pref_grpo":
        # the default, field for field, but for the reward, the evaluation keeping the default's
        # exact accuracy beside the win rate's own score, and the run's name
        reward = mine["rewards"]["components"]
        assert [c["name"] for c in reward] == ["win_rate"]
        assert reward[0]["options"]["pairwise"]["of"]["name"] == "geneval_toy"
        assert {"name": "geneval_toy", "weight": 1.0, "options": {"score": "exact"}} in \
            mine["eval"]["rewards"]
        assert {k: v for k, v in mine.items() if k not in ("name", "rewards", "eval")} == \
            {k: v for k, v in default.items() if k not in ("name", "rewards", "eval")}
    if name == "default_cgpo":
        # the default, field for field, but for the curriculum and the run's name
        mine["prompts"]["curriculum"]["enabled"] = False
        assert {k: v for k, v in mine.items() if k != "name"} == \
            {k: v for k, v in default.items() if k != "name"}


# the default's variants keep its gradient accumulation (tests/test_vgpo.py for vgpo_branch)
@pytest.mark.parametrize("name", sorted(set(IS) - {"default", "default_cgpo", "pref_grpo",
                                                    "vgpo_branch"}))
def test_methods_take_two_optimiser_steps_per_iteration(bench, name):
    config = method_config(bench, name)
    batches = replay_batches_per_process(config, 1)
    assert math.ceil(batches / accumulation_steps(config, 1)) == 2


def test_mix_windows_sweep_the_share_of_the_range_the_anchors_sweep(bench):
    """MixGRPO visits about half of its window positions in a run, MixGRPO-Flash about two
    thirds (the anchors' 12 and 15 of 23), whatever run.max_iterations the calibration writes.
    The calibration sets shift_interval from the iterations the budget fits and the cap 1.25x
    above them (so that the budget, not the cap, ends a run). Counted over the fit (cap / 1.25
    iterations), both hold within 0.1."""
    for name, share in (("mix_grpo", 12 / 23), ("mix_grpo_flash", 15 / 23)):
        config = method_config(bench, name)
        plans = plans_of(config, range(round(config.run.max_iterations / 1.25)), groups=[0])
        visited = {plan.stochastic[0] for plan in plans.values()}
        assert abs(len(visited) / 14 - share) < 0.1, (name, len(visited))


def test_a_longer_budget_stretches_each_schedule_over_it(bench, tmp_path):
    """--schedule-from: at 940 s against the configs' 600 every cap (the lr's decay) is 940/600
    of the config's, and MixGRPO's window moves that much more slowly, so over the stretched run
    it visits the same positions as over the config's (up to the last); a factor of 1 changes
    nothing the run records, and a method without a window gets no window override."""
    factor = 940 / 600
    for name in ("mix_grpo", "mix_grpo_flash", "flow_grpo_guard", "default"):
        spec = bench.RunSpec(name, 0, f"{name}_s0", 940.0, 200.0, 0, (f"model.path={TOY}",))
        config = spec.load(tmp_path)
        stretched = bench.scaled_schedule(spec, factor, tmp_path)
        longer = stretched.load(tmp_path)
        assert stretched.max_iterations == round(config.run.max_iterations * factor)
        assert longer.run.max_iterations == stretched.max_iterations
        assert longer.training.lr == config.training.lr
        assert stretched.signature()["config_digest"] != spec.signature()["config_digest"]
        same = bench.scaled_schedule(spec, 1.0, tmp_path)
        assert same.overrides == spec.overrides
        assert same.max_iterations == config.run.max_iterations
        if not bench.METHODS[name].window_visits:
            assert stretched.overrides == spec.overrides
            continue
        interval = config.sampling.plan.shift_interval
        assert longer.sampling.plan.shift_interval == round(interval * factor) != interval
        fit = round(config.run.max_iterations / 1.25)
        positions = {p.stochastic[0] for p in plans_of(config, range(fit), groups=[0]).values()}
        stretched_positions = {p.stochastic[0] for p in plans_of(
            longer, range(round(longer.run.max_iterations / 1.25)), groups=[0]).values()}
        # the same positions, up to the last one (both intervals are rounded): 8 against 7 of
        # 14 for MixGRPO, whose fit is 7.03 intervals at 600 s and 6.98 at 940 s
        assert len(stretched_positions ^ positions) <= 1, (name, positions, stretched_positions)


def test_a_stretched_tables_command_names_its_schedule_from(bench, tmp_path):
    """The report's command for runs made with --schedule-from 600 at 940 s names it (and not
    the window override the stretch added), so rerunning it finds the same runs; runs at their
    configs' caps, or at a cap no single --schedule-from gives, get no --schedule-from."""
    def record(spec):
        return {"method": spec.method, "seed": spec.seed, "key": spec.key,
                "signature": spec.signature()}

    specs = [bench.RunSpec(name, seed, f"{name}_s{seed}", 940.0, 200.0, 0, (f"model.path={TOY}",))
             for name in ("default", "mix_grpo") for seed in (0, 1)]
    stretched = [record(bench.scaled_schedule(spec, 940 / 600, tmp_path)) for spec in specs]
    assert any("sampling.plan.shift_interval=49" in r["signature"]["overrides"]
               for r in stretched)
    command = bench.reproduce_command(stretched, tmp_path)
    assert "--schedule-from 600 " in command
    assert "shift_interval" not in command and "differ" not in command
    assert f"--set model.path={TOY}" in command
    plain = [record(spec) for spec in specs]
    assert "--schedule-from" not in bench.reproduce_command(plain, tmp_path)
    as_shipped = [record(bench.scaled_schedule(spec, 1.0, tmp_path)) for spec in specs]
    assert "--schedule-from" not in bench.reproduce_command(as_shipped, tmp_path)
    stretched[0]["signature"]["max_iterations"] += 7          # a cap set by hand
    assert "--schedule-from" not in bench.reproduce_command(stretched, tmp_path)


# ----------------------------------------------------------------------------- evaluation noise


@needs_toy
def test_fixed_eval_seed_gives_every_method_and_training_seed_the_same_samples(bench):
    from types import SimpleNamespace

    from flowgrpo.flow_policy import FlowPolicy
    from flowgrpo.rollout import eval_noise
    from pipelines.toy import ToyFlowModel

    model = ToyFlowModel.from_pretrained(str(TOY))

    def policy_noise(config):     # FlowPolicy.eval_noise reads only the model and the config
        return FlowPolicy.eval_noise(SimpleNamespace(model=model, config=config), 4)

    a = method_config(bench, "flow_grpo", "run.seed=0", "prompts.eval_seed=0")
    b = method_config(bench, "flash_grpo", "run.seed=3", "prompts.eval_seed=0")
    unset = method_config(bench, "flow_grpo", "run.seed=3")
    seed_0, seed_3 = (eval_noise(model, seed, range(4)) for seed in (0, 3))
    assert torch.equal(policy_noise(a), seed_0) and torch.equal(policy_noise(b), seed_0)
    assert torch.equal(policy_noise(unset), seed_3)       # unset: follows run.seed, as before
    assert not torch.equal(seed_0, seed_3)
    # ... so the two runs share the base evaluation the benchmark caches
    assert bench.eval_signature(a) == bench.eval_signature(b)
    assert bench.eval_signature(a) != bench.eval_signature(unset)


# ----------------------------------------------------------------------------- statistics


def test_t_interval_matches_closed_forms(bench):
    # n = 2: t_{0.975, 1} is the Cauchy quantile tan(0.475 pi) = 12.7062...
    stats = bench.t_interval([0.30, 0.40])
    assert stats["mean"] == pytest.approx(0.35)
    assert stats["half_width"] == pytest.approx(math.tan(0.475 * math.pi) * 0.05, rel=1e-9)
    # n = 5: t_{0.975, 4} = 2.776445 (tables); sample sd of 1..5 is sqrt(2.5)
    stats = bench.t_interval([1, 2, 3, 4, 5])
    assert stats["half_width"] == pytest.approx(2.776445 * math.sqrt(2.5) / math.sqrt(5),
                                                rel=1e-6)
    assert (stats["low"], stats["high"]) == pytest.approx((3 - stats["half_width"],
                                                           3 + stats["half_width"]))
    one = bench.t_interval([0.4])
    assert one["mean"] == 0.4 and one["low"] is None and one["half_width"] is None


def test_seconds_to_target_interpolates_between_evaluations(bench):
    points = [(0.0, 0.30), (100.0, 0.35), (200.0, 0.45)]
    assert bench.seconds_to_target(points, 0.40) == (pytest.approx(150.0), 200.0)
    # the first crossing counts, even when accuracy dips below the target later
    dipping = [(0.0, 0.30), (100.0, 0.42), (200.0, 0.35), (300.0, 0.50)]
    assert bench.seconds_to_target(dipping, 0.40) == (pytest.approx(100 / 1.2), 100.0)
    assert bench.seconds_to_target(points, 0.45) == (200.0, 200.0)      # exactly at an eval
    assert bench.seconds_to_target(points, 0.46) == (None, None)


def test_value_at_iteration_interpolates_between_evaluations(bench):
    points = [(0, 0.30), (20, 0.40), (40, 0.35)]
    assert bench.value_at_iteration(points, 10) == pytest.approx(0.35)
    assert bench.value_at_iteration(points, 20) == pytest.approx(0.40)     # on an evaluation
    assert bench.value_at_iteration(points, 30) == pytest.approx(0.375)    # on the way down
    assert bench.value_at_iteration(points, 0) == pytest.approx(0.30)
    assert bench.value_at_iteration(points, 41) is None                    # never got there


def test_gain_at_equal_iterations_compares_methods_per_update(bench):
    """A method at 10 CPU s an iteration and one at 20 (half the iterations by each evaluation):
    after 15 iterations the gains are the interpolated accuracies minus the base, whatever the
    cost; the table section puts them beside the gains at the budget."""
    cheap = [_record("cheap", seed, [0.36, 0.42, 0.45]) for seed in (0, 1)]
    costly = []
    for seed in (0, 1):
        record = _record("costly", seed, [0.40, 0.44, 0.46], seconds_per_it=20.0)
        for e in record["evals"]:
            e["iteration"] //= 2                    # 5, 10, 15 iterations at 100, 200, 300 s
        costly.append(record)
    summaries = [bench.summarize_method(cheap, equal_iterations=15),
                 bench.summarize_method(costly, equal_iterations=15)]
    assert summaries[0]["gain_at_equal_iterations"]["per_seed"] == \
        [pytest.approx(0.39 - 0.30)] * 2                      # halfway from 0.36 (10) to 0.42 (20)
    assert summaries[1]["gain_at_equal_iterations"]["mean"] == pytest.approx(0.46 - 0.30)
    assert summaries[1]["gain_at_equal_iterations"]["iterations"] == 15
    text = bench.format_equal_iterations(summaries)
    assert "| Cheap | +0.090 [+0.090, +0.090] | +0.090, +0.090 | +0.150 | 10.00 |" in text
    assert "| Costly | +0.160 [+0.160, +0.160] | +0.160, +0.160 | +0.160 | 20.00 |" in text
    with pytest.raises(ValueError, match="past the last evaluation"):
        bench.summarize_method(costly, equal_iterations=16)


def test_gain_at_a_paced_budget_is_read_at_that_paces_iterations(bench, tmp_path):
    """Runs measured on a day the machine ran faster, compared at 150 CPU seconds of a table
    that measured 10 s an iteration: after 15 iterations, whatever the runs' own seconds;
    a run that stopped before gives '-', and a method the table lacks a '-' row."""
    runs = [_record("fast", 0, [0.36, 0.42, 0.45], seconds_per_it=5.0),
            _record("fast", 1, [0.40, 0.44, 0.46], seconds_per_it=5.0)]
    runs[1]["evals"] = runs[1]["evals"][:2]                  # seed 1 stopped at iteration 10
    at = bench.gain_at_paced_budget(runs, 10.0, 150.0)
    assert at["iterations"] == pytest.approx(15.0)
    assert at["per_seed"][0] == pytest.approx(0.39 - 0.30)  # halfway from 0.36 (10) to 0.42 (20)
    assert at["per_seed"][1] is None
    assert (at["mean"], at["n"], at["low"]) == (pytest.approx(0.09), 1, None)
    assert bench.gain_at_paced_budget(runs, 20.0, 150.0)["per_seed"] == \
        [pytest.approx(0.75 * 0.06), pytest.approx(0.75 * 0.10)]     # 7.5 of the first 10
    assert bench.gain_at_paced_budget(runs, 5.0, 500.0)["mean"] is None   # 100: none got there
    with pytest.raises(ValueError, match="must be > 0"):
        bench.gain_at_paced_budget(runs, 0.0, 150.0)
    pace = tmp_path / "methods.json"
    pace.write_text(json.dumps({"methods": {"fast": {"per_iteration": {"cpu_seconds": 10.0}}}}))
    summaries = [{"method": "fast", "label": "Fast"}, {"method": "other", "label": "Other"}]
    paced = bench.paced_budgets(summaries, {"fast": runs, "other": []}, [pace], 150.0)
    assert paced["other"] is None and paced["fast"]["iterations"] == pytest.approx(15.0)
    text = bench.format_paced_budget(summaries, paced, 150.0, ["table/methods.json"])
    assert "| Fast | 10.00 | 15 | +0.090 (n=1) | +0.090, - |" in text
    assert "| Other | - | - | - | - |" in text
    with pytest.raises(ValueError, match="no such file"):
        bench.paced_budgets(summaries, {}, [pace, tmp_path / "missing.json"], 150.0)


def test_several_pace_files_give_each_method_the_first_pace_that_has_it(bench, tmp_path):
    """A table whose rows were measured on two days: 'fast' takes 20 s an iteration from the
    first file (its runs of the table's sitting), not the 10 s of the second, which still paces
    'other'; a method neither file has gives '-'."""
    runs = {m: [_record(m, 0, [0.36, 0.42, 0.45], seconds_per_it=5.0)]
            for m in ("fast", "other", "third")}
    sitting, table = tmp_path / "sitting.json", tmp_path / "table.json"
    sitting.write_text(json.dumps({"methods": {"fast": {"per_iteration": {"cpu_seconds": 20.0}}}}))
    table.write_text(json.dumps({"methods": {m: {"per_iteration": {"cpu_seconds": 10.0}}
                                             for m in ("fast", "other")}}))
    summaries = [{"method": m, "label": m.title()} for m in runs]
    paced = bench.paced_budgets(summaries, runs, [sitting, table], 200.0)
    assert (paced["fast"]["iterations"], paced["fast"]["pace_from"]) == (pytest.approx(10.0), 0)
    assert (paced["other"]["iterations"], paced["other"]["pace_from"]) == (pytest.approx(20.0), 1)
    assert paced["third"] is None
    assert paced["fast"]["per_seed"] == [pytest.approx(0.36 - 0.30)]
    assert paced["other"]["per_seed"] == [pytest.approx(0.42 - 0.30)]
    text = bench.format_paced_budget(summaries, paced, 200.0, ["a/methods.json", "b/methods.json"])
    assert "the first of `a/methods.json`, `b/methods.json` that has the method" in text
    assert "| Fast | 20.00 | 10 | +0.060 (n=1) | +0.060 | `a/methods.json` |" in text
    assert "| Other | 10.00 | 20 | +0.120 (n=1) | +0.120 | `b/methods.json` |" in text
    assert "| Third | - | - | - | - | - |" in text


def test_median_over_seeds_counts_not_reached_as_longer(bench):
    assert bench.median_seconds([100.0, None, 300.0]) == 300.0
    assert bench.median_seconds([100.0, None, None]) is None
    assert bench.median_seconds([50.0, 70.0]) == 60.0
    assert bench.median_seconds([50.0, None]) is None
    assert bench.median_seconds([]) is None


def test_milestones(bench):
    assert bench.milestones(600, 100) == [100, 200, 300, 400, 500, 600]
    assert bench.milestones(250, 100) == [100, 200, 250]
    with pytest.raises(ValueError, match="> 0"):
        bench.milestones(600, 0)


def test_artifact_metric_is_found_under_its_logged_names(bench):
    assert bench.artifact_value({"eval/geneval_toy.exact/family_mean": 0.4}) is None
    metrics = {"eval/toy_artifacts.background/family_mean": 0.02,
               "eval/toy_artifacts.artifacts/family_mean": 0.05,
               "eval/toy_artifacts.artifacts/family_mean/se": 0.001,
               "eval/toy_artifacts.artifacts/colors": 0.09,
               "eval/toy_artifacts.artifacts": 0.06}
    assert bench.artifact_value(metrics) == ("eval/toy_artifacts.artifacts/family_mean", 0.05)
    assert bench.artifact_value({"eval/toy_artifacts": 0.03, "eval/toy_artifacts/se": 0.1}) == \
        ("eval/toy_artifacts", 0.03)


def _record(method, seed, accuracies, seconds_per_it=10.0, budget=300.0, interval=100.0,
            base=0.30, stopped_by="budget"):
    """A finished run: evaluations at 100, 200, 300 CPU seconds."""
    evals = [{"iteration": 0, "cpu_seconds": 0.0, "marks": [0.0], "accuracy": base,
              "artifacts": 0.001}]
    for k, accuracy in enumerate(accuracies, start=1):
        evals.append({"iteration": 10 * k, "cpu_seconds": 100.0 * k + 3, "marks": [100.0 * k],
                      "accuracy": accuracy, "artifacts": 0.01 * k})
    n = 10 * len(accuracies)
    columns = {"cpu/iteration": [seconds_per_it] * n, "cpu/rollout": [4.0] * n,
               "cpu/advantages": [0.5] * n, "cpu/update": [5.0] * n, "nfe": [16] * n,
               "trained_transitions": [960] * n, "train/optimizer_steps": [2] * n}
    return {"method": method, "label": method.title(), "seed": seed, "key": f"{method}_s{seed}",
            "finished": True, "signature": {"method": method, "seed": seed, "budget": budget,
                                            "eval_interval": interval},
            "base": {"accuracy": base, "accuracy_se": 0.02, "artifacts": 0.001},
            "evals": evals, "iterations": columns, "iterations_done": n,
            "max_iterations": 30, "stopped_by": stopped_by, "cpu_seconds": 303.0}


def test_runs_stopped_by_their_cap_before_the_budget_are_named(bench, tmp_path):
    at_budget = _record("fast", 0, [0.36, 0.42, 0.45])
    capped = _record("slow", 0, [0.36, 0.42], stopped_by="max_iterations")   # 203 of 300 s
    capped_late = _record("late", 0, [0.36, 0.42, 0.45], budget=303.0 - 1e-6,
                          stopped_by="max_iterations")     # its cap fell on the budget: fair
    assert bench.capped_early([at_budget, capped, capped_late]) == [("slow_s0", 203.0)]
    runs = tmp_path / "runs"
    runs.mkdir()
    for record in (at_budget, capped):
        (runs / f"{record['key']}.json").write_text(json.dumps(record))
    bench.report(tmp_path, log=lambda _: None)
    table = (tmp_path / "table.md").read_text()
    assert "Stopped by their iteration cap before the CPU budget" in table
    assert "slow_s0 (203 s)" in table and "fast_s0 (" not in table


def test_summary_of_synthetic_runs(bench):
    records = [_record("fast", 0, [0.36, 0.42, 0.45]), _record("fast", 1, [0.38, 0.41, 0.43]),
               _record("fast", 2, [0.31, 0.33, 0.37])]
    s = bench.summarize_method(records)
    finals = [0.45, 0.43, 0.37]
    assert s["accuracy"]["mean"] == pytest.approx(sum(finals) / 3)
    assert s["accuracy"]["per_seed"] == finals
    assert s["gain"]["mean"] == pytest.approx(sum(finals) / 3 - 0.30)
    assert s["gain"]["half_width"] == pytest.approx(s["accuracy"]["half_width"])
    # seed 0 crosses 0.40 between 103 s (0.36) and 203 s (0.42): 103 + 100 * 4/6
    to_target = s["seconds_to_target"]["per_seed"]
    assert to_target[0] == pytest.approx(103 + 100 * 4 / 6)
    assert to_target[1] == pytest.approx(103 + 100 * 2 / 3)
    assert to_target[2] is None
    assert s["seconds_to_target"]["median"] == pytest.approx(max(to_target[:2]))
    assert s["seconds_to_target"]["reached"] == 2
    assert s["curve"]["cpu_seconds"] == [0.0, 100.0, 200.0, 300.0]
    assert s["curve"]["mean"][1] == pytest.approx((0.36 + 0.38 + 0.31) / 3)
    assert (s["curve"]["min"][3], s["curve"]["max"][3]) == (0.37, 0.45)
    p = s["per_iteration"]
    assert (p["cpu_seconds"], p["rollout"], p["update"]) == (10.0, 4.0, 5.0)
    assert p["other"] == pytest.approx(0.5)
    assert (p["nfe_per_sample"], p["trained_transitions"], p["optimizer_steps"]) == (16, 960, 2)
    assert s["artifacts"]["mean"] == pytest.approx(0.03) and s["base"]["artifacts"] == 0.001
    assert s["iterations"]["per_seed"] == [30, 30, 30]


def test_runs_of_different_settings_are_not_summarised_together(bench):
    other = _record("fast", 1, [0.4, 0.4, 0.4], budget=200.0)
    with pytest.raises(ValueError, match="different settings"):
        bench.summarize_method([_record("fast", 0, [0.4, 0.4, 0.4]), other])


def test_table_has_a_line_per_method_and_says_not_reached(bench):
    summaries = [bench.summarize_method([_record("fast", 0, [0.36, 0.42, 0.45]),
                                         _record("fast", 1, [0.38, 0.41, 0.43])]),
                 bench.summarize_method([_record("slow", 0, [0.31, 0.32, 0.33],
                                                 stopped_by="max_iterations")])]
    lines = [line for line in bench.format_table(summaries).splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, [c.strip() for c in line.strip("|").split("|")]))
            for line in lines[1:]]
    assert len(rows) == 2
    assert rows[0]["method"] == "Fast" and rows[0]["seeds"] == "2"
    assert rows[0]["CPU s to +10 (median)"].endswith("(2/2)")
    assert rows[1]["CPU s to +10 (median)"] == "not reached (0/1)"
    assert rows[1]["acc@budget [95% CI]"] == "0.330 (n=1)"
    assert rows[1]["gain [95% CI]"] == "+0.030 (n=1)"
    assert rows[0]["trained/it"] == "960" and rows[0]["update"] == "5.00"
    assert rows[0]["iterations"] == "30" and rows[1]["iterations"] == "30 (1 cap)"


def test_ranking_only_where_the_intervals_do_not_overlap(bench):
    # final gains over the 0.30 base: "high" +0.20 +-0.01, "mid" +0.10 +-0.01, "wide" spans both
    summaries = [bench.summarize_method([_record(name, seed, [0.3, 0.3, 0.3 + gain])
                                         for seed, gain in enumerate(gains)])
                 for name, gains in (("mid", (0.09, 0.10, 0.11)), ("high", (0.19, 0.20, 0.21)),
                                     ("wide", (-0.10, 0.15, 0.40)))]
    summaries.append(bench.summarize_method([_record("lone", 0, [0.3, 0.3, 0.9])]))
    half = summaries[0]["gain"]["half_width"]
    assert half == pytest.approx(4.302653 * 0.01 / 3 ** 0.5, rel=1e-5)   # t_{0.975,2} s / sqrt(3)
    assert bench.separations(summaries) == [("High", "Mid")]
    text = bench.format_ranking(summaries)
    assert "- High above Mid" in text and "Wide above" not in text
    assert "one seed only (not ranked): Lone" in text
    # intervals that touch (upper of the lower == lower of the higher) do not separate
    close = [bench.summarize_method([_record(name, seed, [0.3, 0.3, 0.3 + gain])
                                     for seed, gain in enumerate(gains)])
             for name, gains in (("a", (0.09, 0.10, 0.11)), ("b", (0.10 + half,) * 3))]
    assert close[1]["gain"]["low"] == pytest.approx(close[0]["gain"]["high"])
    assert bench.separations(close) in ([], [("B", "A")])   # float tie: either side of equal
    assert "no two methods separate" in bench.format_ranking(close[:1])


def test_table_command_is_read_from_its_runs(bench, tmp_path):
    records = [_record("flow_grpo", 2, [0.4] * 3), _record("default", 0, [0.4] * 3),
               _record("default", 1, [0.4] * 3)]
    records[0]["signature"]["overrides"] = ["training.lr=2e-4"]
    plain = bench.reproduce_command(records[1:], bench.ROOT / bench.DEFAULT_OUT)
    assert plain == ("python benchmarks/methods.py --seeds 0,1 --budget 300 "
                     "--eval-interval 100 --methods default")
    mixed = bench.reproduce_command(records, bench.ROOT / bench.DEFAULT_OUT)
    assert mixed == ("python benchmarks/methods.py --seeds 0,1,2 --budget 300 "
                     "--eval-interval 100 --methods default,flow_grpo (the runs differ in their "
                     "--set overrides: see each run's signature)")
    for record in records:
        record["signature"]["overrides"] = ["training.lr=2e-4"]
    other = bench.reproduce_command(records, bench.ROOT / "benchmarks/results/methods/lr2e-4")
    assert other.endswith("--methods default,flow_grpo --set training.lr=2e-4 "
                          "--out benchmarks/results/methods/lr2e-4")
    assert bench.reproduce_command(records, tmp_path).endswith(f"--out {tmp_path}")


def test_group_signal_counts_groups_without_reward_variance(bench):
    # group 0: all 1 (no signal), group 1: 0, 1, 0, 1 (std 0.5), group 2: 0, 0, 0, 1 (std sqrt(3)/4)
    values = [1, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 1]
    groups = [0] * 4 + [1] * 4 + [2] * 4
    signal = bench.group_signal(values, groups)
    assert signal["no_signal"] == pytest.approx(1 / 3)
    assert signal["within_std"] == pytest.approx((0 + 0.5 + 3 ** 0.5 / 4) / 3)
    assert signal["mean"] == pytest.approx(7 / 12) and signal["groups"] == 3
    # the order of the rows does not matter, only their groups
    order = [11, 0, 5, 3, 8, 1, 10, 2, 7, 4, 9, 6]
    assert bench.group_signal([values[i] for i in order], [groups[i] for i in order]) == signal
    with pytest.raises(ValueError, match="at least one"):
        bench.group_signal([], [])
    # NaN = no score, as in training: a group with one valid reward carries no signal, and a
    # NaN leaves the others' std and the mean to the valid rewards
    nan = float("nan")
    masked = bench.group_signal([1, nan, nan, nan, 0, 1, nan, 1], [0] * 4 + [1] * 4)
    assert masked["no_signal"] == pytest.approx(1 / 2)
    assert masked["within_std"] == pytest.approx((0 + 2 ** 0.5 / 3) / 2)    # pstdev(0, 1, 1)
    assert masked["mean"] == pytest.approx(3 / 4)


def test_two_invocations_merge_their_methods_into_one_file(bench, tmp_path):
    path = tmp_path / "signal.json"
    first = bench.merge_methods_json(path, {"iterations": 8, "methods": {"flash_grpo": 1}},
                                     same="iterations")
    second = bench.merge_methods_json(path, {"iterations": 8, "methods": {"default": 2}},
                                      same="iterations")
    assert first["methods"] == {"flash_grpo": 1}
    assert second["methods"] == {"default": 2, "flash_grpo": 1}          # METHODS order
    assert list(json.loads(path.read_text())["methods"]) == ["default", "flash_grpo"]
    # a rerun replaces its own method; other settings replace the file
    assert bench.merge_methods_json(path, {"iterations": 8, "methods": {"default": 3}},
                                    same="iterations")["methods"] == {"default": 3, "flash_grpo": 1}
    assert bench.merge_methods_json(path, {"iterations": 4, "methods": {"mix_grpo": 4}},
                                    same="iterations")["methods"] == {"mix_grpo": 4}
    assert not path.with_suffix(".lock").exists()
    seen = []
    bench.merge_methods_json(path, {"iterations": 4, "methods": {"default": 5}}, same="iterations",
                             then=lambda data: seen.append((path.with_suffix(".lock").exists(),
                                                            data["methods"])))
    assert seen == [(True, {"default": 5, "mix_grpo": 4})]      # under the lock, merged


def test_claims_are_ratios_against_their_baselines(bench):
    def with_rewards(record, rewards):
        record["iterations"]["reward/total/mean"] = rewards
        return record

    fast = [_record("mix_grpo", 0, [0.36, 0.42, 0.45]), _record("mix_grpo", 1, [0.38, 0.41, 0.43])]
    slow = [_record("dance_grpo", 0, [0.32, 0.35, 0.41]),
            _record("dance_grpo", 1, [0.31, 0.34, 0.42])]
    never = [_record("mix_grpo_flash", 0, [0.31, 0.32, 0.33])]
    runs = {"mix_grpo": fast, "dance_grpo": slow, "mix_grpo_flash": never}
    summaries = {name: bench.summarize_method(r) for name, r in runs.items()}
    time_claim, flash_claim = bench.CLAIMS[0], bench.CLAIMS[1]
    row = bench.claim_row(time_claim, summaries, runs)
    # seconds to 0.40 by interpolation: mix 103 + 100 * 4/6 on both seeds; dance 203 + 100 * 5/6
    # and 203 + 100 * 6/8, median of two = their mean
    mix, dance = 103 + 100 * 4 / 6, (203 + 100 * 5 / 6 + 203 + 100 * 6 / 8) / 2
    assert row["ratio"] == pytest.approx(mix / dance)
    assert row["measured"].startswith(f"{mix / dance:.2f} (")
    bound = bench.claim_row(flash_claim, summaries, runs)     # MixGRPO-Flash never reaches it
    assert bound["ratio"] is None
    assert bound["measured"].startswith(f"> {300 / dance:.2f} (not reached")
    assert bench.claim_row(flash_claim, {"dance_grpo": summaries["dance_grpo"]}, runs)[
        "measured"] == "not measured"

    # reward at equal iterations: second half of the shorter run (10 iterations of 20 -> 5..9)
    ours = [with_rewards(_record("flow_grpo_fast", 0, [0.3, 0.3]), [0.1] * 5 + [0.6] * 15)]
    theirs = [with_rewards(_record("flow_grpo", 0, [0.3]), [0.2] * 5 + [0.3] * 5)]
    runs = {"flow_grpo_fast": ours, "flow_grpo": theirs}
    summaries = {name: bench.summarize_method(r) for name, r in runs.items()}
    row = bench.claim_row(bench.CLAIMS[2], summaries, runs)
    assert row["method_value"] == pytest.approx(0.6) and row["baseline_value"] == pytest.approx(0.3)
    assert row["ratio"] == pytest.approx(2.0)

    # early gain: at the first evaluation mark (100 s): +0.08 vs +0.02
    runs = {"flash_grpo": [_record("flash_grpo", 0, [0.38, 0.40])],
            "flow_grpo": [_record("flow_grpo", 0, [0.32, 0.45])]}
    summaries = {name: bench.summarize_method(r) for name, r in runs.items()}
    row = bench.claim_row(bench.CLAIMS[3], summaries, runs)
    assert row["at_cpu_seconds"] == 100.0 and row["ratio"] == pytest.approx(4.0)
    runs["flow_grpo"] = [_record("flow_grpo", 0, [0.29, 0.45])]
    summaries["flow_grpo"] = bench.summarize_method(runs["flow_grpo"])
    row = bench.claim_row(bench.CLAIMS[3], summaries, runs)
    assert row["ratio"] is None and "the baseline did not gain" in row["measured"]
    runs["flash_grpo"] = [_record("flash_grpo", 0, [0.28, 0.40])]
    summaries["flash_grpo"] = bench.summarize_method(runs["flash_grpo"])
    row = bench.claim_row(bench.CLAIMS[3], summaries, runs)
    assert row["ratio"] is None and "the method did not gain" in row["measured"]
    # a baseline gain of rounding noise (the base's accuracy again) or under a point is no gain
    runs["flash_grpo"] = [_record("flash_grpo", 0, [0.38, 0.40])]
    summaries["flash_grpo"] = bench.summarize_method(runs["flash_grpo"])
    for flat in (0.30 + 1e-12, 0.309):
        runs["flow_grpo"] = [_record("flow_grpo", 0, [flat, 0.45])]
        summaries["flow_grpo"] = bench.summarize_method(runs["flow_grpo"])
        row = bench.claim_row(bench.CLAIMS[3], summaries, runs)
        assert row["ratio"] is None and "the baseline did not gain a point" in row["measured"]


def test_tuning_choice_breaks_ties_toward_the_lower_lr(bench):
    points = [{"lr": 4e-4, "noise_rank": 0, "accuracy": 0.50},
              {"lr": 2e-4, "noise_rank": 1, "accuracy": 0.50},
              {"lr": 2e-4, "noise_rank": 0, "accuracy": 0.48},
              {"lr": 1e-4, "noise_rank": 0, "accuracy": 0.45}]
    assert bench.choose(points) == points[1]
    assert bench.choose(points, tolerance=0.02) == points[2]     # 0.48 ties within 0.02
    assert bench.choose(points, tolerance=0.05) == points[3]


def test_the_tuning_grid_is_every_methods_and_extends_down_where_its_edge_wins(bench, tmp_path):
    settings = bench.TuneSettings(lrs=[4e-4, 1e-4, 2e-4], noise={}, budget=200.0,
                                  max_extensions=2)
    chosen = {"flow_grpo": {"lr": 1e-4}, "mix_grpo": {"lr": 2e-4}, "dance_grpo": {"lr": 4e-4}}
    # only the method whose choice is the grid's lowest point is extended, by half
    assert bench.extend_downward(chosen, settings) == {"flow_grpo": 5e-5}
    settings.extended["flow_grpo"] = [5e-5]
    assert settings.lrs_for("flow_grpo") == [5e-5, 1e-4, 2e-4, 4e-4]
    assert settings.lrs_for("mix_grpo") == [1e-4, 2e-4, 4e-4]
    # a choice inside the extended grid ends it; the edge again extends it once more, then stops
    assert bench.extend_downward({"flow_grpo": {"lr": 1e-4}}, settings) == {}
    assert bench.extend_downward({"flow_grpo": {"lr": 5e-5}}, settings) == {"flow_grpo": 2.5e-5}
    settings.extended["flow_grpo"].append(2.5e-5)
    assert bench.extend_downward({"flow_grpo": {"lr": 2.5e-5}}, settings) == {}
    # the specs follow each method's own grid: every lr x noise level of its grid, nothing else
    specs = bench.tune_specs([bench.METHODS["flow_grpo"], bench.METHODS["mix_grpo"]],
                             settings, tmp_path)
    flow_lrs = {float(o.split("=")[1]) for s in specs if s.method == "flow_grpo"
                for o in s.overrides if o.startswith("training.lr=")}
    mix_lrs = {float(o.split("=")[1]) for s in specs if s.method == "mix_grpo"
               for o in s.overrides if o.startswith("training.lr=")}
    assert flow_lrs == {2.5e-5, 5e-5, 1e-4, 2e-4, 4e-4} and mix_lrs == {1e-4, 2e-4, 4e-4}
    levels = len(bench.METHODS["flow_grpo"].noise_levels)
    assert sum(s.method == "flow_grpo" for s in specs) == 5 * levels
    assert len({s.key for s in specs}) == len(specs)        # 2.5e-5 is not filed as 2e-05


# ----------------------------------------------------------------------------- resume


def test_run_signatures_differ_in_settings_not_in_seed(bench):
    def signature(seed, *overrides, budget=600.0):
        spec = bench.RunSpec("flow_grpo", seed, f"flow_grpo_s{seed}", budget, 100.0, 0, overrides)
        return {k: v for k, v in spec.signature().items() if k != "seed"}

    assert signature(0) == signature(1)
    assert signature(0) != signature(0, budget=300.0)
    assert signature(0)["config_digest"] != signature(0, "training.lr=1e-4")["config_digest"]


def test_run_status_and_refusal_of_other_settings(bench, tmp_path):
    path = tmp_path / "runs" / "x_s0.json"
    signature = {"budget": 600.0, "seed": 0}
    assert bench.run_status(path, signature) == "missing"
    bench.write_json(path, {"finished": False, "signature": signature})
    assert bench.run_status(path, signature) == "partial"
    bench.write_json(path, {"finished": True, "signature": signature})
    assert bench.run_status(path, signature) == "finished"
    with pytest.raises(ValueError, match="budget"):
        bench.run_status(path, {"budget": 300.0, "seed": 0})


def test_rerun_trains_only_unfinished_runs(bench, tmp_path, monkeypatch):
    trained = []

    def fake_train(spec, out, log=print):
        trained.append(spec.key)
        bench.write_json(out / "runs" / f"{spec.key}.json",
                         {"finished": True, "signature": spec.signature()})

    # run_specs trains through the module it lives in (benchmarks/methods_runs.py)
    monkeypatch.setattr(sys.modules[bench.run_specs.__module__], "train_run", fake_train)
    specs = [bench.RunSpec(name, 0, f"{name}_s0", 60.0, 20.0, 0)
             for name in ("flow_grpo", "flash_grpo", "mix_grpo", "dance_grpo")]
    runs = tmp_path / "runs"
    bench.write_json(runs / "flow_grpo_s0.json", {"finished": True,
                                                  "signature": specs[0].signature()})
    bench.write_json(runs / "flash_grpo_s0.json", {"finished": False,
                                                   "signature": specs[1].signature()})
    (runs / "dance_grpo_s0.lock").write_text(str(os.getpid()))     # held by a live process
    assert bench.run_specs(specs, tmp_path, log=lambda _: None) == ["flash_grpo_s0",
                                                                     "mix_grpo_s0"]
    assert trained == ["flash_grpo_s0", "mix_grpo_s0"]
    assert not (runs / "mix_grpo_s0.lock").exists()        # released after the run
    # a second invocation finds everything done but the locked run
    trained.clear()
    (runs / "dance_grpo_s0.lock").unlink()
    assert bench.run_specs(specs, tmp_path, log=lambda _: None) == ["dance_grpo_s0"]
    # a finished run of other settings stops the invocation before anything trains
    trained.clear()
    longer = [bench.RunSpec("flow_grpo", 0, "flow_grpo_s0", 120.0, 20.0, 0)]
    with pytest.raises(ValueError, match="other settings"):
        bench.run_specs(longer, tmp_path, log=lambda _: None)
    assert trained == []


def test_a_lock_left_by_a_dead_process_is_taken_over(bench, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "run.json"
    path.with_suffix(".lock").write_text(str(dead.pid))
    lock = bench.RunLock(path)
    assert lock.acquire() and lock.owner() == os.getpid()
    assert not bench.RunLock(path).acquire()         # now held by this (live) process
    lock.release()
    assert not path.with_suffix(".lock").exists()


# ----------------------------------------------------------------------------- config edits


def test_calibration_and_tuning_values_are_written_into_a_config(bench, tmp_path):
    source = ROOT / "configs" / "toy_methods" / "mix_grpo.yaml"
    copy = tmp_path / "mix_grpo.yaml"
    copy.write_text(source.read_text())
    method = bench.Method("mix_copy", "Mix copy", str(copy), (0.7, 1.0), window_visits=7)
    values = bench.calibrated_values(method, {"max_iterations_for_budget": 140,
                                              "shift_interval": 20})
    # values no shipped config holds, so that each of the six lines changes
    values.update({"training.lr": bench.yaml_number(1.5e-4),
                   "sampling.noise_level": bench.yaml_number(1.1)})
    bench.write_config_values(method, values)
    config = load_config(copy, [f"model.path={TOY}"])
    # the cap is 1.25x the fit, rounded up (175), so the table's runs end at the CPU budget
    assert (config.run.max_iterations, config.run.eval_every, config.run.checkpoint_every) == \
        (175, 43, 43)
    assert config.sampling.plan.shift_interval == 20
    assert (config.training.lr, config.sampling.noise_level) == (1.5e-4, 1.1)
    # every other line, comments included, is unchanged
    before, after = source.read_text().splitlines(), copy.read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 6
    assert all("#" not in a or "#" in b for a, b in changed)
    with pytest.raises(ValueError, match="plan"):    # a flow mapping is left to the user
        bench.set_yaml_scalar("sampling:\n  plan: {kind: branch}\n", "sampling.plan.kind", "x")
    with pytest.raises(ValueError, match="not edited"):
        bench.write_config_values(bench.METHODS["default"], {"training.lr": "1.0e-4"})


def test_a_tuned_point_writes_its_noise_level_only_where_it_changes_the_config(bench, tmp_path):
    # nft.yaml rolls out by the ODE and has no sampling.noise_level line: a tuning at the
    # default noise writes its lr alone (it used to stop on the missing line, lr unwritten)
    nft = tmp_path / "nft.yaml"
    nft.write_text((ROOT / "configs" / "toy_methods" / "nft.yaml").read_text())
    method = bench.Method("nft_copy", "NFT copy", str(nft), (0.7,))
    default_noise = load_config(nft, [f"model.path={TOY}"]).sampling.noise_level
    values = bench.tuned_values(method, 3.0e-4, default_noise)
    assert values == {"training.lr": "3.0e-4"}
    bench.write_config_values(method, values)
    assert load_config(nft, [f"model.path={TOY}"]).training.lr == 3.0e-4
    # a changed noise level is written, and where the config has no line for it the edit
    # stops with the fix named rather than writing half the point
    assert bench.tuned_values(method, 3.0e-4, 0.9) == {"training.lr": "3.0e-4",
                                                      "sampling.noise_level": "0.9"}
    with pytest.raises(ValueError, match="edit the file by hand"):
        bench.write_config_values(method, bench.tuned_values(method, 1.0e-4, 0.9))
    assert load_config(nft, [f"model.path={TOY}"]).training.lr == 3.0e-4
    mix = tmp_path / "mix_grpo.yaml"
    mix.write_text((ROOT / "configs" / "toy_methods" / "mix_grpo.yaml").read_text())
    mix_method = bench.Method("mix_copy", "Mix copy", str(mix), (0.7, 1.0))
    bench.write_config_values(mix_method, bench.tuned_values(mix_method, 1.5e-4, 1.0))
    config = load_config(mix, [f"model.path={TOY}"])
    assert (config.training.lr, config.sampling.noise_level) == (1.5e-4, 1.0)


def test_bad_arguments_name_the_fix(bench):
    with pytest.raises(ValueError, match="unknown method nope"):
        bench.parse_methods("flow_grpo,nope")
    with pytest.raises(ValueError, match="--seeds"):
        bench.parse_list("0,x", int, "--seeds")
    with pytest.raises(ValueError, match="METHOD=V1,V2"):
        bench.parse_noise(["flow_grpo"])
    with pytest.raises(SystemExit, match="--schedule-from must be > 0"):
        bench.main(["--methods", "flow_grpo", "--schedule-from", "0", "--out", "/nonexistent"])


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
@needs_toy
def test_quick_benchmark_end_to_end_writes_table_json_and_plot(bench, tmp_path):
    """Two methods x two seeds in quick mode (2 CPU seconds each, 12 evaluation samples):
    the table, the JSON with every field of the report and the plot are written; a rerun of
    the same command trains nothing. About 40 s."""
    args = ["--quick", "--methods", "flash_grpo,flow_grpo", "--seeds", "0,1",
            "--out", str(tmp_path)]
    data = bench.main(args)
    assert set(data["methods"]) == {"flash_grpo", "flow_grpo"}
    for summary in data["methods"].values():
        assert summary["seeds"] == [0, 1]
        assert summary["accuracy"]["low"] is not None and summary["gain"]["high"] is not None
        assert "median" in summary["seconds_to_target"]
        per_it = summary["per_iteration"]
        assert per_it["nfe_per_sample"] > 0 and per_it["trained_transitions"] > 0
        assert per_it["cpu_seconds"] > 0 and per_it["rollout"] > 0 and per_it["update"] >= 0
        assert summary["iterations"]["mean"] >= 1
        assert summary["curve"]["cpu_seconds"][0] == 0.0 and summary["curve"]["n"][-1] == 2
        assert "artifacts" in summary
    for seed in (0, 1):
        run = json.loads((tmp_path / "runs" / f"flash_grpo_s{seed}.json").read_text())
        assert run["finished"] and run["torch_threads"] == 1
        assert run["cpu_seconds"] >= bench.QUICK_BUDGET or \
            run["iterations_done"] == run["max_iterations"]
        assert all(e["samples"] == 12 for e in run["evals"])
    for path in (tmp_path / "runs").glob("*.json"):
        # the rollout's log-probs are those the update recomputes before its first step
        deviations = json.loads(path.read_text())["iterations"]["train/first_pass_ratio_max_dev"]
        assert deviations and max(deviations) < 1e-3
    # the Flash-GRPO claim (against Flow-GRPO, both run) is measured; those without theirs not
    claims = {c["method"]: c for c in data["claims"]}
    assert len(data["claims"]) == len(bench.CLAIMS)
    assert claims["flash_grpo"]["measured"] not in ("not measured", "not measured at the same mark")
    assert claims["mix_grpo"]["measured"] == "not measured"
    # one base evaluation for every method and seed
    assert len(list((tmp_path / "base").glob("*.json"))) == 1
    table = (tmp_path / "table.md").read_text()
    assert bench.TABLE_HEADER in table and "| Flash-GRPO | 2 |" in table
    assert "| Flash-GRPO: one step per trajectory" in table
    fewest = min(json.loads(p.read_text())["evals"][-1]["iteration"]
                 for p in (tmp_path / "runs").glob("*.json"))
    assert f"Gain after {fewest} iterations" in table
    assert all(s["gain_at_equal_iterations"]["iterations"] == fewest
               for s in data["methods"].values())
    assert (tmp_path / "accuracy_vs_cpu_seconds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same runs at a budget in another report's seconds (here their own methods.json)
    paced = bench.main(["--report", "--out", str(tmp_path), "--pace-from",
                        str(tmp_path / "methods.json"), "--at-cpu", "1"])
    assert all(s["gain_at_paced_budget"]["cpu_budget"] == 1.0 for s in paced["methods"].values())
    assert all(s["gain_at_paced_budget"]["pace_from"].endswith("methods.json")
               for s in paced["methods"].values())
    assert "Gain at 1 CPU seconds at the pace of" in (tmp_path / "table.md").read_text()
    with pytest.raises(SystemExit, match="go together"):
        bench.main(["--report", "--out", str(tmp_path), "--at-cpu", "1"])
    assert json.loads((tmp_path / "methods.json").read_text())["methods"].keys() == \
        data["methods"].keys()
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*.json")}
    bench.main(args)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*.json")} == stamps
    # the table reproduces from the command it prints
    assert data["table_command"].startswith("python benchmarks/methods.py --seeds 0,1 ")
    assert "--methods flow_grpo,flash_grpo" in data["table_command"]
    # the reward-signal probe: one quick iteration of 2 groups per method, shares in [0, 1]
    signal = bench.main(["--signal", "--quick", "--methods", "flash_grpo", "--out", str(tmp_path)])
    probe = json.loads((tmp_path / "signal.json").read_text())["methods"]["flash_grpo"]
    assert probe == signal["flash_grpo"] and probe["groups"] == 2
    assert 0 <= probe["no_signal"] <= 1 and probe["within_std"] <= 0.5 + 1e-9
    assert "| Flash-GRPO | flash_sde |" in (tmp_path / "signal.md").read_text()


def test_committed_results_are_what_their_command_reproduces(bench):
    """Every finished run under benchmarks/results/methods carries the signature its own command
    computes today (the config file with its --set overrides, digested), so rerunning the
    commands in benchmarks/README.md reuses it instead of refusing it as "measured with other
    settings". Adding a config field or editing a shipped value breaks this unless the field is
    listed in FIELDS_ADDED_SINCE_RESULTS or the old runs are re-expressed
    (benchmarks/methods_reexpress.py METHOD FIELD=OLD_VALUE ...)."""
    records = sorted((ROOT / "benchmarks" / "results" / "methods").glob("**/runs/*.json"))
    assert len(records) >= 60
    stale = []
    for path in records:
        record = json.loads(path.read_text())
        if not record.get("finished"):
            continue
        if bench.RunSpec.of_record(record).signature() != record["signature"]:
            stale.append(str(path.relative_to(ROOT)))
    assert not stale, f"results that their command would refuse: {stale}"


def test_reexpressing_a_record_restores_its_command_only_with_the_values_it_ran():
    """benchmarks/methods_reexpress.py: a committed Flash-GRPO table record (run at lr 2e-4,
    independent noise, cap 101, before flash_grpo.yaml changed) stripped of those overrides no
    longer matches its command; re-expressed with the old values it does again, with its stored
    digest; with a wrong old value it is refused, not rewritten."""
    from tests.helpers import load_benchmark

    tool = load_benchmark("methods_reexpress")
    path = ROOT / "benchmarks/results/methods/runs/flash_grpo_s0.json"
    record = json.loads(path.read_text())
    assert tool.RunSpec.of_record(record).signature() == record["signature"]   # as committed
    old = {"training.lr": "2e-4", "sampling.share_initial_noise": "false",
           "run.max_iterations": "101"}
    kept = [o for o in record["signature"]["overrides"] if o.split("=", 1)[0] not in old]
    bare = {**record, "signature": {**record["signature"], "overrides": kept}}
    assert tool.RunSpec.of_record(bare).signature() != bare["signature"]
    mended = tool.reexpress(bare, old)
    assert tool.RunSpec.of_record(mended).signature() == mended["signature"]
    assert mended["signature"]["config_digest"] == record["signature"]["config_digest"]
    assert tool.reexpress(bare, {**old, "training.lr": "4e-4"}) is None
    assert tool.reexpress(record, old) is None                      # nothing to do


def test_reexpress_refuses_a_field_the_benchmark_sets_for_every_run(capsys):
    """run.eval_every is overridden to 0 for every benchmark run, so no record ran a config's
    value of it: naming it is refused by name before any record is read."""
    from tests.helpers import load_benchmark

    tool = load_benchmark("methods_reexpress")
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["mix_grpo_flash", "run.max_iterations=125", "run.eval_every=31"])
    assert exit_info.value.code == 2
    assert "['run.eval_every'] are set by the benchmark" in capsys.readouterr().err


def test_report_includes_tables_from_other_folders_as_one(bench, tmp_path):
    """A table run on another day into its own folder reports with this one: every method in
    one table, the claims between them measured, each folder's own command named."""
    def write(folder, records):
        (folder / "runs").mkdir(parents=True)
        for record in records:
            (folder / "runs" / f"{record['key']}.json").write_text(json.dumps(record))

    def with_rewards(record, rewards):
        record["iterations"]["reward/total/mean"] = rewards
        return record

    first, second, combined = tmp_path / "day1", tmp_path / "day2", tmp_path / "both"
    write(first, [with_rewards(_record("flow_grpo_fast", s, [0.36, 0.42, 0.45]), [0.5] * 30)
                  for s in (0, 1)])
    write(second, [with_rewards(_record("flow_grpo", s, [0.32, 0.35, 0.41]), [0.4] * 30)
                   for s in (0, 1)])
    alone = bench.report(first, log=lambda _: None)
    assert list(alone["methods"]) == ["flow_grpo_fast"]
    claim = next(c for c in alone["claims"] if c["baseline"] == "flow_grpo")
    assert claim["measured"] == "not measured"

    data = bench.report(combined, log=lambda _: None, include=[first, second])
    assert list(data["methods"]) == ["flow_grpo", "flow_grpo_fast"]          # METHODS order
    claim = next(c for c in data["claims"] if c["method"] == "flow_grpo_fast")
    assert claim["ratio"] == pytest.approx(0.5 / 0.4)          # reward at equal iterations
    table = (combined / "table.md").read_text()
    assert "Commands, one per folder" in table
    assert f"--methods flow_grpo_fast --out {first}" in table
    assert f"--methods flow_grpo --out {second}" in table
    own = {folder: [json.loads(p.read_text()) for p in sorted((folder / "runs").glob("*.json"))]
           for folder in (first, second)}
    assert data["table_command"] == "; ".join(bench.reproduce_command(records, folder)
                                              for folder, records in own.items())
    assert list(json.loads((first / "methods.json").read_text())["methods"]) == [
        "flow_grpo_fast"]                                   # day 1's own report left as it was
    with pytest.raises(SystemExit, match="--include adds folders to --report only"):
        bench.main(["--include", str(first), "--out", str(combined)])

    write(tmp_path / "again", [_record("flow_grpo", 0, [0.3] * 3)])
    with pytest.raises(ValueError, match="flow_grpo_s0 is in both"):
        bench.report(combined, log=lambda _: None, include=[second, tmp_path / "again"])
    write(tmp_path / "other_eval", [_record("mix_grpo", 0, [0.3] * 3, base=0.25)])
    with pytest.raises(ValueError, match="different held-out samples"):
        bench.report(combined, log=lambda _: None, include=[first, tmp_path / "other_eval"])
