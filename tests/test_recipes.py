"""The shipped recipes: the anchors' optimiser cadence, ``flowgrpo train CONFIG --tiny`` (the
recipe's method settings on its family's tiny offline build), two iterations of every recipe on
its tiny build with off-policy ratios, a clip range that clips, the KL reward, step weights
normalised over every process, and the adapters' default size (docs/recipes.md)."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.config import InputError, load_config
from flowgrpo.flow_batches import accumulation_steps, replay_batches_per_process
from flowgrpo.flow_policy import KL_REWARD_KEY
from flowgrpo.tiny_recipe import (TINY_REMOTE_STAND_IN, ensure_tiny_model, load_tiny_config,
                                  tiny_build_name)
from flowgrpo.trainer import Trainer

# config -> (optimiser steps per epoch, the anchor's process count)
SHIPPED = {
    "sd3_ocr": (2, 32),          # Flow-GRPO general_ocr_sd3: gpu_number 32
    "sd3_pickscore": (2, 32),    # Flow-GRPO pickscore_sd3
    "sd3_fast_cps": (2, 32),     # Flow-GRPO pickscore_sd3_fast_nocfg
    "flux_flowgrpo": (2, 32),    # Flow-GRPO pickscore_flux
    "flux_pickscore": (4, 32),   # MixGRPO-Flash: 4 nodes x 8 GPUs, 12 samples, accumulation 3
    "wan_video": (2, 96),        # Flash-GRPO: 96 processes
    "kontext_edit": (2, 28),     # Flow-GRPO counting_flux_kontext: gpu_number 28
    "qwen_image_ocr": (2, 32),   # Flow-GRPO pickscore_qwenimage: gpu_number 32
    "wan22_video": (2, 8),       # Flow-GRPO general_ocr_wan2_1's per-GPU layout on 8 GPUs
    "flux2_klein_pickscore": (2, 8),   # Flow-Factory grpo/lora/flux2_klein_base: 8 processes
    "flux2_dev_pickscore": (2, 8),     # Flow-Factory grpo/lora/flux2/t2i: 8 processes
    "qwen_image_edit_plus_pickscore": (2, 8),   # Flow-Factory grpo/lora/qwen_image_edit_plus: 8
    "wan_i2v_pickscore": (2, 8),   # Flow-Factory grpo/lora/wan21/i2v: 8 processes
    "z_image_turbo_pickscore": (2, 8),   # Flow-Factory grpo/lora/z_image_turbo: 8 processes
    "z_image_pickscore": (2, 8),   # Flow-Factory grpo/lora/z_image: 8 processes
    "hunyuan_video_dance_grpo": (2, 32),   # DanceGRPO finetune_hunyuan_grpo.sh: 4 nodes x 8 GPUs
    "ltx2_pickscore": (2, 8),    # Flow-Factory grpo/lora/ltx2/t2av_pickscore: 8 processes
    "flux_e_grpo": (3, 8),       # E-GRPO train_grpo_merge.sh: 8 GPUs, a step per branch step
    # BranchGRPO finetune_flux_branchgrpo_8gpus.sh: 8 GPUs x 2 trees x 19 trained steps, one a
    # step (the anchor: a step every 12 of its 436 transitions, 37)
    "flux_branch_grpo": (38, 8),
    "flux_pref_grpo": (2, 64),   # Pref-GRPO finetune_prefgrpo_flux.sh: 8 nodes x 8 GPUs
}
# The sample-based algorithms' recipes: (optimiser steps per epoch, the anchor's process count).
SAMPLE_SHIPPED = {
    "sd3_nft_pickscore": (1, 8),  # DiffusionNFT sd3_pickscore: n_gpus 8, gradient_step_per_epoch 1
    "sd3_dgpo_pickscore": (1, 4),  # Flow-Factory's DGPO SD3.5 example: 4 ranks, one step an epoch
    "sd3_e2po_pickscore": (1, 8),  # E2PO: DiffusionNFT's sd3_pickscore with the perturbation
}
# The anchors' accumulation in replay batches (our unit: rows of one step) at their process count:
# Flow-GRPO accumulates num_batches_per_epoch // 2 sample batches x the trained timesteps.
ANCHOR_ACCUMULATION = {"sd3_ocr": 2 * 9, "sd3_pickscore": 2 * 9, "sd3_fast_cps": 2 * 3,
                       "flux_flowgrpo": 6 * 5, "flux_pickscore": 1, "wan_video": 1,
                       "kontext_edit": 6 * 5, "qwen_image_ocr": 2 * 2, "wan22_video": 1 * 19,
                       # Flow-Factory: 96 one-sample batches x 1 SDE step, 2 steps an epoch
                       "flux2_klein_pickscore": 48 * 1,
                       "flux2_dev_pickscore": 48 * 1,   # the same layout (flux2/t2i.yaml)
                       # Flow-Factory qwen_image_edit_plus: the same layout (96 one-sample
                       # batches x 1 SDE step, 2 steps an epoch)
                       "qwen_image_edit_plus_pickscore": 48 * 1,
                       "wan_i2v_pickscore": 48 * 1,   # the same layout (wan21/i2v.yaml)
                       # Flow-Factory: 96 one-sample batches x 1 SDE step, 2 steps an epoch
                       "z_image_turbo_pickscore": 48 * 1,
                       "z_image_pickscore": 48 * 1,   # the same layout (z_image/default.yaml)
                       # 24 one-video rollouts x 9 trained steps, 2 steps an epoch (DanceGRPO:
                       # its best 4 + worst 4 of the 24 x 9 steps, accumulation 4 -> 4 * 9)
                       "hunyuan_video_dance_grpo": 24 * 9 // 2,
                       # Flow-Factory ltx2: 96 one-sample batches x 3 SDE steps, 2 steps an epoch
                       "ltx2_pickscore": 96 * 3 // 2,
                       # E-GRPO: a step per branch step, each one group of 12 a GPU at that
                       # step (here 3 groups a GPU, one replay batch each, over 3 steps)
                       "flux_e_grpo": 1,
                       # BranchGRPO: one trained step of one tree a GPU (the anchor: 12
                       # shuffled one-transition backwards a step)
                       "flux_branch_grpo": 1,
                       # Pref-GRPO: 4 one-image batches x 14 steps a step; here a GPU's group
                       # makes 24 step batches (its rows training each step), 12 a step
                       "flux_pref_grpo": 24 // 2,
                       # DiffusionNFT: 16 sample batches x 9 timesteps a step
                       "sd3_nft_pickscore": 16 * 9,
                       "sd3_e2po_pickscore": 16 * 9,   # E2PO: DiffusionNFT's layout
                       # DGPO: 12 micro-batches of half a group x 4 levels there; whole groups
                       # (the preference is a group's) here: 6 groups x 4 levels
                       "sd3_dgpo_pickscore": 6 * 4}
# Recipes whose OCR reward scores random tiny images 0 (no group varies): their tiny runs score
# JPEG size instead, so that steps are taken.
OCR_RECIPES = ("sd3_ocr", "qwen_image_ocr", "wan22_video")
# Tiny runs slower than ~20 s on one thread (the Wan2.2 build trains 19 steps on two experts).
# flux_branch_grpo: 2 trees of 203 transformer calls, 38 optimiser steps (6 min an iteration on a
# loaded 2-core machine).
SLOW_TINY = ("wan22_video", "flux_pref_grpo", "flux_branch_grpo")
# A tree recipe's group is its tree's leaves (16 for BranchGRPO's binary splits at 4 steps):
# --tiny keeps that group and rolls one tree at a time, with --tiny's 2 prompts (so 38 replay
# batches for its 38 optimiser steps), with no override.
TREE_RECIPES = ("flux_branch_grpo",)
TINY_RUN_OVERRIDES = {"flux_e_grpo": ["training.prompts_per_iteration=3"]}
METHOD_FIELDS = [
    "sampling.num_steps", "sampling.kind", "sampling.noise_level", "sampling.log_prob",
    "sampling.sigma_schedule", "sampling.sigma_shift", "sampling.sigma_schedule_start",
    "sampling.guidance_scale", "sampling.share_initial_noise", "sampling.plan",
    "sampling.embedding_perturbation",
    "training.lr", "training.clip_low", "training.clip_high", "training.kl_beta",
    "training.kl_convention", "training.kl_reward", "training.adv_scale", "training.adv_ddof",
    "training.adv_eps", "training.adv_clip", "training.num_inner_epochs",
    "training.optimizer_steps_per_epoch", "training.ratio_norm", "training.dt_reweight",
    "training.rectification", "training.dt_reweight_norm", "training.loss_scale",
    "training.ema", "training.skip_zero_std_groups",
    "model.family", "model.lora", "rewards.aggregation",
    "training.algorithm", "training.timesteps", "training.nft", "training.awm", "training.dgpo",
    "training.dpo", "training.gdro",
]


def _field(config, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _run_tiny(name: str, root, out, overrides=()):
    config = load_tiny_config(f"configs/{name}.yaml",
                              [f"run.output_dir={out}", "run.progress=false",
                               "run.comparison_grid=false", *overrides], root=root)
    trainer = Trainer(config)
    history = trainer.train()
    return config, trainer, [h for h in history if h["phase"] == "train"]


# --------------------------------------------------------------------- the recipes as shipped


@pytest.mark.parametrize("name", sorted(SHIPPED) + sorted(SAMPLE_SHIPPED))
def test_shipped_recipe_steps_the_optimiser_like_its_anchor(name):
    """optimizer_steps_per_epoch gives exactly the anchor's steps per epoch at its process count
    and on one 8-GPU node, and at the anchor's count the accumulation equals the anchor's."""
    steps, anchor_processes = {**SHIPPED, **SAMPLE_SHIPPED}[name]
    config = load_config(f"configs/{name}.yaml")
    assert config.training.optimizer_steps_per_epoch == steps
    assert config.training.num_inner_epochs == 1
    for processes in (8, anchor_processes):
        count = replay_batches_per_process(config, processes)
        assert count % steps == 0, (processes, count)
        accumulation = accumulation_steps(config, processes)   # over every process
        assert math.ceil(count * processes / accumulation) == steps
        if processes == anchor_processes:   # the anchor's count is per GPU
            assert accumulation == ANCHOR_ACCUMULATION[name] * processes


# --------------------------------------------------------------------- --tiny


@pytest.mark.parametrize("name", sorted(SHIPPED) + sorted(SAMPLE_SHIPPED))
def test_tiny_config_keeps_the_method_settings_and_shrinks_the_rest(name, tiny_recipe_root):
    recipe = load_config(f"configs/{name}.yaml")
    tiny = load_tiny_config(f"configs/{name}.yaml", root=tiny_recipe_root)
    for dotted in METHOD_FIELDS:
        assert _field(tiny, dotted) == _field(recipe, dotted), dotted
    stand_in = {"remote": TINY_REMOTE_STAND_IN}
    assert [c.name for c in tiny.rewards.components] == \
        [stand_in.get(c.name, c.name) for c in recipe.rewards.components]
    assert [c.weight for c in tiny.rewards.components] == \
        [c.weight for c in recipe.rewards.components]
    assert tiny.name == f"{name}_tiny"
    assert tiny.model.dtype == "float32" and tiny.training.mixed_precision == "no"
    assert not tiny.model.gradient_checkpointing
    assert tiny.model.options["height"] == tiny.model.options["width"] == 32
    assert (tiny_recipe_root / tiny_build_name(recipe.model.family, recipe.model.path)
            / "model_index.json").is_file()
    if name in TREE_RECIPES:   # a tree: the recipe's group (its leaves), one tree a call, 2 trees
        assert tiny.training.group_size == recipe.training.group_size == 16
        assert tiny.sampling.rollout_batch_size == 16
        assert tiny.training.prompts_per_iteration == 2
    else:
        assert tiny.training.prompts_per_iteration * tiny.training.group_size == 8
    for component in [*tiny.rewards.components, *tiny.eval.rewards]:
        for key in ("model", "processor", "head"):
            if key in component.options:
                assert str(tiny_recipe_root) in str(component.options[key])
    assert [c.name for c in tiny.eval.rewards] == [c.name for c in recipe.eval.rewards]


@pytest.mark.parametrize("path", sorted(Path("configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_config_loads_and_tiny_replaces_its_hub_weight_held_out_rewards(path, tiny_recipe_root):
    """Every shipped config validates; --tiny points every hub-weight reward of eval.rewards
    (CLIP-based: PickScore, CLIP score, aesthetic, temporal consistency) at the tiny builds and
    leaves the others (toy_artifacts) as they are."""
    import yaml

    from flowgrpo.tiny_recipe import TINY_REWARDS, _tiny_rewards

    config = load_config(path)
    raw = yaml.safe_load(path.read_text())
    specs = (raw.get("eval") or {}).get("rewards") or []
    assert [s["name"] for s in specs] == [s.name for s in config.eval.rewards]
    for before, after in zip(specs, _tiny_rewards(specs, tiny_recipe_root)):
        if before["name"] in TINY_REWARDS:
            assert str(after["options"]["model"]).startswith(str(tiny_recipe_root)), before
            kept = {k: v for k, v in (before.get("options") or {}).items()
                    if k not in ("model", "processor", "head", "pretrained", "backend")}
            assert kept.items() <= after["options"].items()
        else:
            assert after == before


def test_tiny_overrides_win_and_llm_recipes_are_refused(tiny_recipe_root):
    config = load_tiny_config("configs/sd3_pickscore.yaml", ["training.group_size=2",
                                                             "sampling.rollout_batch_size=2"],
                              root=tiny_recipe_root)
    assert config.training.group_size == 2 and config.sampling.rollout_batch_size == 2
    with pytest.raises(InputError, match="flow recipes"):
        load_tiny_config("configs/llm_arith.yaml", root=tiny_recipe_root)


def test_tiny_puts_a_groupwise_rewards_inner_reward_on_its_tiny_build(tiny_recipe_root):
    """win_rate's pairwise.of and group_rank's of (a name or a flat spec) get the tiny weights;
    the rest of the options stay."""
    from flowgrpo.tiny_recipe import _tiny_rewards

    specs = [{"name": "win_rate", "weight": 0.7,
              "options": {"pairwise": {"model": "bradley_terry", "of": "pickscore",
                                       "temperature": 1.0}, "wins": "hard"}},
             {"name": "group_rank", "options": {"of": {"name": "clip_score", "scale": 2.0}}},
             {"name": "group_rank", "options": {"of": {"name": "geneval_toy", "score": "partial"}}}]
    win, rank, toy = _tiny_rewards(specs, tiny_recipe_root)
    inner = win["options"]["pairwise"]["of"]
    assert inner["name"] == "pickscore" and str(tiny_recipe_root) in inner["model"]
    assert win["options"]["pairwise"]["temperature"] == 1.0 and win["options"]["wins"] == "hard"
    assert win["weight"] == 0.7
    clip = rank["options"]["of"]
    assert clip["name"] == "clip_score" and clip["scale"] == 2.0
    assert str(tiny_recipe_root) in clip["model"]
    assert toy == specs[2]


# --------------------------------------------------------------------- two iterations each


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TINY else n
                                  for n in sorted(SHIPPED)])
def test_shipped_recipe_runs_two_iterations_on_its_tiny_build(name, tiny_recipe_root, tmp_path):
    """Every iteration takes the recipe's optimiser steps; the replays scored after the first
    step are off-policy (ratios != 1) while the first pass stays exactly on-policy. The OCR
    recipes' reward scores random tiny images 0 (no group varies), so their runs score JPEG size
    instead; kontext_edit's reward servers are stood in for by JPEG size (tiny_recipe)."""
    overrides = ["rewards.components=[{name: jpeg_compressibility}]"] if name in OCR_RECIPES \
        else []
    overrides += TINY_RUN_OVERRIDES.get(name, [])
    config, trainer, train = _run_tiny(name, tiny_recipe_root, tmp_path / "runs", overrides)
    steps = SHIPPED[name][0]
    assert len(train) == 2
    for record in train:
        assert record["train/optimizer_steps"] == steps
        assert record["train/first_pass_ratio_max_dev"] == 0.0
        assert record["train/ratio_max"] > 1.0 or record["train/ratio_min"] < 1.0
        assert record["reward/nan_count"] == 0
    assert (trainer.run_dir / "checkpoints" / "2").is_dir()


@pytest.mark.parametrize("name", sorted(SAMPLE_SHIPPED))
def test_sample_recipe_runs_two_iterations_on_its_tiny_build(name, tiny_recipe_root, tmp_path):
    """A sample-based recipe on its tiny build: every final sample at its levels, the recipe's
    optimiser steps, the old policy's decay after each iteration, a checkpoint with it."""
    config, trainer, train = _run_tiny(name, tiny_recipe_root, tmp_path / "runs")
    t = config.training
    assert len(train) == 2
    for record in train:
        assert record["train/optimizer_steps"] == SAMPLE_SHIPPED[name][0]
        assert record["trained_transitions"] == \
            t.prompts_per_iteration * t.group_size * t.timesteps.count
        assert math.isfinite(record["train/policy_loss"]) and record["reward/nan_count"] == 0
    assert [r["train/old_decay"] for r in train] == [pytest.approx(0.001), pytest.approx(0.002)]
    assert (trainer.run_dir / "checkpoints" / "2" / "algorithm.safetensors").is_file()


def test_a_tiny_clip_range_clips(tiny_recipe_root, tmp_path):
    _, _, train = _run_tiny("sd3_pickscore", tiny_recipe_root, tmp_path / "runs",
                            ["training.clip_low=1.0e-7", "run.max_iterations=1"])
    assert train[0]["train/clip_fraction"] > 0
    assert train[0]["train/clip_fraction_active"] > 0


def test_kl_reward_is_zero_on_policy_then_positive(tiny_recipe_root, tmp_path):
    """Flow-GRPO's KL reward: the rollout's KL to the reference is 0 before any update (LoRA B is
    0) and positive after it, and it is subtracted from the total reward."""
    _, _, train = _run_tiny("sd3_pickscore", tiny_recipe_root, tmp_path / "runs",
                            ["training.kl_reward=0.5"])
    first, second = (record[f"reward/{KL_REWARD_KEY}/mean"] for record in train)
    assert first == 0.0 and second > 0.0
    assert train[1]["reward/total/mean"] == pytest.approx(
        train[1]["reward/pickscore/mean"] - 0.5 * second, abs=1e-6)
    assert train[1]["train/kl"] > 0.0


def test_dance_grpo_per_sample_steps_train_on_policy(tiny_recipe_root, tmp_path):
    _, _, train = _run_tiny("sd3_pickscore", tiny_recipe_root, tmp_path / "runs",
                            ["sampling.plan.train_select=random_per_sample",
                             "sampling.plan.train_fraction=0.6", "run.max_iterations=1"])
    assert train[0]["train/first_pass_ratio_max_dev"] == 0.0
    assert train[0]["trained_transitions"] == 8 * 5          # int((10 - 1) * 0.6) per sample
    assert train[0]["train/optimizer_steps"] == 2


def test_pref_grpo_recipe_advantages_are_the_anchors_weighted_group_z_scores():
    """flux_pref_grpo's advantages, through the trainer's estimator, are Pref-GRPO's
    (train_flux_pref_grpo.py at c06662d): 0.7 x the win rate's group z-score + 1.4 x CLIP
    score's, each with torch's unbiased std + 1e-8, no batch renormalisation, clipped to 5; the
    win rates of hard Bradley-Terry wins are Pref-GRPO's counting (every pair once, 1 a win,
    1/2 each on a tie, wins over comparisons)."""
    from flowgrpo.trainer_advantages import per_component_estimate
    from reward_models.group import bradley_terry_matrix, win_rates

    config = load_config("configs/flux_pref_grpo.yaml")
    weights = {c.name: c.weight for c in config.rewards.components}
    assert weights == {"win_rate": 0.7, "clip_score": 1.4}
    generator = torch.Generator().manual_seed(0)
    group_ids = torch.arange(16) // 8
    pickscore = torch.randn(16, generator=generator).round(decimals=1)
    pickscore[3] = pickscore[5]                                      # a tie in group 0
    clip = torch.rand(16, generator=generator)

    def counted(scores: list[float]) -> list[float]:
        wins = [0.0] * len(scores)
        for i in range(len(scores)):
            for j in range(i + 1, len(scores)):
                if scores[i] > scores[j]:
                    wins[i] += 1
                elif scores[j] > scores[i]:
                    wins[j] += 1
                else:
                    wins[i] += 0.5
                    wins[j] += 0.5
        return [w / (len(scores) - 1) for w in wins]

    win_rate = torch.cat([win_rates(bradley_terry_matrix(pickscore[group_ids == g]), "hard")
                          for g in (0, 1)])
    assert win_rate.tolist() == pytest.approx(
        [r for g in (0, 1) for r in counted(pickscore[group_ids == g].tolist())])

    def group_z(values: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(values)
        for g in (0, 1):
            members = values[group_ids == g]
            out[group_ids == g] = (members - members.mean()) / (members.std() + 1e-8)
        return out

    advantages, _, _ = per_component_estimate(config, weights,
                                              {"win_rate": win_rate, "clip_score": clip},
                                              group_ids)
    expected = (0.7 * group_z(win_rate) + 1.4 * group_z(clip)).clamp(-5, 5)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-5)


def test_e_grpo_recipe_merges_by_the_entropy_rule_on_its_schedule():
    """flux_e_grpo's merge counts are E-GRPO's entropy rule at 1.1 on its rollout schedule: each
    merged step is above the threshold, which is above every single step of the schedule's first
    half, and one step fewer would fall below it."""
    from flowgrpo.plans import merge_counts_for_entropy
    from flowgrpo.sde import shifted_linear_sigmas, step_entropy

    s = load_config("configs/flux_e_grpo.yaml").sampling
    sigmas = shifted_linear_sigmas(s.num_steps, s.sigma_shift, s.sigma_schedule_start)
    assert tuple(s.plan.merge_counts) == \
        merge_counts_for_entropy(sigmas, s.plan.merge_at, s.noise_level, 1.1)
    for k, m in zip(s.plan.merge_at, s.plan.merge_counts):
        assert float(step_entropy(s.kind, sigmas[k], sigmas[k + m], s.noise_level)) >= 1.1
        assert float(step_entropy(s.kind, sigmas[k], sigmas[k + m - 1], s.noise_level)) < 1.1
    assert max(float(step_entropy(s.kind, sigmas[k], sigmas[k + 1], s.noise_level))
               for k in range(s.num_steps // 2)) < 1.1


def test_branch_grpo_recipe_grows_the_anchors_tree():
    """flux_branch_grpo is BranchGRPO's FLUX script (finetune_flux_branchgrpo_8gpus.sh and
    train_branchgrpo_flux.py at 19fbb9f): binary splits at steps 0, 3, 6, 9 of 20 (16 leaves, the
    group), DanceGRPO's SDE at eta 0.3 on every step but the last, on sd3_time_shift(3,
    linspace(1, 0, 21)), the leaves' mean backup. Level by level the tree has the anchor's node
    counts (2^(splits at or before the step) after step i), so the same transformer calls, and
    trains every anchor edge but the 16 of its last step."""
    from flowgrpo.sde import shifted_linear_sigmas, transition
    from flowgrpo.tree import tree_shape

    split_points, steps, eta, shift = (0, 3, 6, 9), 20, 0.3, 3.0     # the script's values
    config = load_config("configs/flux_branch_grpo.yaml")
    s, plan = config.sampling, config.sampling.plan
    assert (plan.kind, plan.tree_branching, plan.tree_backup) == ("tree", 2, "mean")
    assert tuple(plan.tree_branch_at) == split_points and plan.tree_trained is None
    assert tuple(plan.tree_window) == (0, steps - 1)
    assert (s.num_steps, s.kind, s.noise_level, s.sigma_shift) == (steps, "dance_sde", eta, shift)
    assert s.share_initial_noise and s.guidance_scale == 3.5
    assert config.training.group_size == 2 ** len(split_points) == 16
    assert (config.training.clip_low, config.training.adv_clip) == (1e-3, 5.0)

    # the anchor's tree: after step i every node has split at each split point <= i
    after = [2 ** sum(p <= i for p in split_points) for i in range(steps)]
    before = [1] + after[:-1]
    shape = tree_shape(plan, s.num_steps)
    assert [shape.nodes(j + 1) for j in range(len(shape.window))] == after[:steps - 1]
    assert shape.transformer_calls(steps) == sum(before) == 203
    assert shape.trained_edges == sum(after) - after[-1] == 218 - 16

    # the schedule and DanceGRPO's step (flux_step with sde_solver=True) at eta 0.3
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    anchor_sigmas = (shift * t / (1 + (shift - 1) * t)).float()
    sigmas = shifted_linear_sigmas(steps, shift, s.sigma_schedule_start)
    torch.testing.assert_close(sigmas, anchor_sigmas)
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)
    for i in (0, 9, steps - 2):
        sigma, nxt = float(sigmas[i]), float(sigmas[i + 1])
        x0 = x - sigma * v
        score = -(x - x0 * (1 - sigma)) / sigma ** 2
        mean = x + (nxt - sigma) * v + (-0.5 * eta ** 2 * score) * (nxt - sigma)
        step = transition(s.kind, v, x, sigma, nxt, noise_level=s.noise_level)
        torch.testing.assert_close(step.mean, mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(step.std, torch.full((2,), eta * math.sqrt(sigma - nxt)))


def test_cli_tiny_trains_a_recipe_offline_on_the_cpu(tiny_recipe_root, tmp_path, monkeypatch):
    """``flowgrpo train configs/sd3_ocr.yaml --tiny``: the recipe as shipped (its OCR reward runs
    offline), a run folder of its own, a CPU device."""
    from flowgrpo.cli import main

    monkeypatch.setenv("FLOWGRPO_TINY_DIR", str(tiny_recipe_root))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")      # restored after; the CLI sets it
    code = main(["train", "configs/sd3_ocr.yaml", f"run.output_dir={tmp_path}",
                 "run.progress=false", "run.comparison_grid=false", "prompts.num_eval=1",
                 "--tiny"])
    assert code == 0
    run = tmp_path / "sd3_ocr_tiny"
    assert (run / "checkpoints" / "2").is_dir() and not (tmp_path / "sd3_ocr").exists()
    import os

    assert os.environ["ACCELERATE_USE_CPU"] == "true"


# --------------------------------------------------------------------- step weights over processes


class _TwoProcesses:
    """An accelerator stand-in for process 0 of 2 whose peer holds ``other`` (sum, count)."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, other):
        self.other = torch.tensor([other], dtype=torch.float64)

    def gather(self, tensor):
        return torch.cat([tensor, self.other.to(tensor.dtype)])


def test_step_weights_are_normalised_over_every_process():
    """GRPO-Guard's 1/dt (and Flash's kappa) are divided by their mean over the trained
    transitions of all processes, so the same step gets the same weight on every process."""
    from flowgrpo.flow_policy import FlowPolicy

    from flowgrpo.algorithms.grpo import GRPO

    policy = object.__new__(FlowPolicy)
    policy.config = SimpleNamespace(training=SimpleNamespace(
        dt_reweight=True, rectification=False, dt_reweight_norm="iteration", loss_scale="none"))
    policy.algorithm = object.__new__(GRPO)     # its step weights read only the config
    policy.algorithm.policy, policy.algorithm.config = policy, policy.config
    replay = SimpleNamespace(logp_old=torch.zeros(2), sigmas=torch.tensor([0.9, 0.9]),
                             sigmas_next=torch.tensor([0.8, 0.8]), std=torch.ones(2))
    raw = 1 / (0.9 - 0.8)
    # the other process holds 6 transitions whose weights sum to 6 * 2.0
    policy.accelerator = _TwoProcesses([12.0, 6.0])
    (weights,) = policy.step_weights([replay])
    global_mean = (2 * raw + 12.0) / 8
    torch.testing.assert_close(weights, torch.full((2,), raw / global_mean), rtol=1e-5, atol=0)
    policy.accelerator = SimpleNamespace(num_processes=1)
    (alone,) = policy.step_weights([replay])
    torch.testing.assert_close(alone, torch.ones(2))
    # a process without replay batches still joins the gather
    policy.accelerator = _TwoProcesses([12.0, 6.0])
    assert policy.step_weights([]) == []


# --------------------------------------------------------------------- adapters' default size


def test_sd3_without_size_options_samples_at_the_checkpoints_size(tiny_recipe_root):
    from pipelines import load_model

    path = ensure_tiny_model("sd3", tiny_recipe_root)
    model = load_model("sd3", path, options={"max_sequence_length": 16})
    pipe = model.to_pipeline()
    expected = pipe.default_sample_size * pipe.vae_scale_factor
    assert (model.options.height, model.options.width) == (expected, expected) == (32, 32)
    noise = model.initial_noise(1, torch.Generator().manual_seed(0))
    stock = pipe(prompt=["a red square"], num_inference_steps=2, guidance_scale=1.0, latents=noise,
                 max_sequence_length=16, output_type="pt").images
    cond = model.encode_prompts(["a red square"])
    sigmas = model.sigmas(2)
    x = noise
    for i in range(2):
        v = model.velocity(x, sigmas[i].expand(1), cond, 1.0)
        x = x + v * (sigmas[i + 1] - sigmas[i])
    ours = model.decode(x)
    assert ours.shape == stock.shape == (1, 3, 32, 32)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_flux_without_size_options_samples_at_the_pipelines_default_size(tiny_recipe_root):
    from pipelines import load_model

    path = ensure_tiny_model("flux", tiny_recipe_root)
    model = load_model("flux", path, options={"max_sequence_length": 16})
    pipe = model.to_pipeline()
    expected = pipe.default_sample_size * pipe.vae_scale_factor
    assert (model.options.height, model.options.width) == (expected, expected) == (1024, 1024)
    noise = model.initial_noise(1, torch.Generator().manual_seed(0))
    stock = pipe(prompt=["a red square"], num_inference_steps=1, guidance_scale=3.5, latents=noise,
                 max_sequence_length=16, output_type="latent").images
    cond = model.encode_prompts(["a red square"])
    sigmas = model.sigmas(1)
    v = model.velocity(noise, sigmas[0].expand(1), cond, 3.5)
    x = noise + v * (sigmas[1] - sigmas[0])
    assert x.shape == stock.shape == (1, (1024 // 16) ** 2, 64)
    torch.testing.assert_close(x, stock.float(), rtol=0, atol=1e-4)
    assert model.decode(x).shape == (1, 3, 1024, 1024)
