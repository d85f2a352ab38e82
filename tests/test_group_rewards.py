"""Groupwise rewards (reward_models/group.py): Pref-GRPO's win rate under a pairwise preference
model, the rank of a pointwise reward in its group, their config checks, and the trainer scoring
whole groups with them (configs/toy_methods/pref_grpo.yaml)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from reward_models import MultiReward
from reward_models.group import (BradleyTerryPreference, bradley_terry_matrix, check_whole_groups,
                                 group_win_rates, preference_matrix, ranks_in_groups, win_rates)
from reward_models.pickscore import PICKSCORE_NORMALISER, pickscore_from_cosine

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "assets" / "toy"
CONFIG = ROOT / "configs" / "toy_methods" / "pref_grpo.yaml"
needs_toy = pytest.mark.skipif(not (TOY / "transformer").is_dir(), reason="assets/toy is not built")


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ------------------------------------------------------------------------ the maths

@pytest.mark.parametrize("wins", ["hard", "soft"])
def test_the_win_rates_of_a_group_sum_to_half_its_size(wins):
    generator = torch.Generator().manual_seed(0)
    for size in (2, 3, 5, 8):
        # scores with ties (rounded), so hard wins meet 1/2 as well as 0 and 1
        scores = (torch.randn(size, generator=generator) * 2).round()
        rates = win_rates(bradley_terry_matrix(scores, 0.7), wins)
        assert float(rates.sum()) == pytest.approx(size / 2, abs=1e-5)
        assert bool(((rates >= 0) & (rates <= 1)).all())
    # any judge whose P(j > i) = 1 - P(i > j), not only Bradley-Terry
    upper = torch.rand(6, 6, generator=generator).triu(1)
    judge = upper + (1 - upper.T).tril(-1)
    assert float(win_rates(judge, wins).sum()) == pytest.approx(3.0, abs=1e-5)


def test_a_three_member_group_by_hand():
    # scores 3, 1, 2 at temperature 1: P = sigmoid(r_i - r_j)
    p = bradley_terry_matrix(torch.tensor([3.0, 1.0, 2.0]), 1.0)
    assert float(p[0, 1]) == pytest.approx(sigmoid(2.0)) and float(p[2, 0]) == pytest.approx(
        sigmoid(-1.0))
    # hard: member 0 beats both, member 1 loses both, member 2 beats 1 and loses to 0
    assert win_rates(p, "hard").tolist() == [1.0, 0.0, 0.5]
    # soft: (0.880797 + 0.731059) / 2, (0.119203 + 0.268941) / 2, (0.268941 + 0.731059) / 2
    assert win_rates(p, "soft").tolist() == pytest.approx([0.805928, 0.194072, 0.5], abs=1e-6)
    # a tie is half a win for each
    tied = win_rates(bradley_terry_matrix(torch.tensor([2.0, 2.0, 1.0]), 1.0), "hard")
    assert tied.tolist() == [0.75, 0.75, 0.0]


def test_hard_wins_depend_only_on_the_order_of_the_scores():
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(8, generator=generator)
    scores[3] = scores[5]                                   # a tie survives the transform
    transformed = torch.exp(3 * scores) + scores ** 3       # strictly increasing
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])

    def rates(values, temperature, wins):
        return group_win_rates(lambda rows: bradley_terry_matrix(values[rows], temperature),
                               ids, wins)

    hard = rates(scores, 1.0, "hard")
    assert torch.equal(hard, rates(transformed, 0.05, "hard"))
    # ... which the probabilities are not
    assert not torch.allclose(rates(scores, 1.0, "soft"), rates(transformed, 0.05, "soft"),
                              atol=1e-3)
    # hard win rates under Bradley-Terry are the rank in the group, ties averaged
    assert torch.allclose(hard, ranks_in_groups(scores, ids))


def test_rank_in_group_averages_ties_and_scales_to_unit_interval():
    scores = torch.tensor([5.0, 1.0, 5.0, 3.0, 7.0, 7.0, float("nan"), 2.0, 4.0])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3])
    ranks = ranks_in_groups(scores, ids)
    # group 0: 1 -> 0, 3 -> 1/3, the two 5s share ranks 2 and 3 -> 2.5 / 3
    assert ranks[:4].tolist() == pytest.approx([2.5 / 3, 0.0, 2.5 / 3, 1 / 3])
    assert ranks[4:6].tolist() == [0.5, 0.5]                 # all tied: the middle
    # a NaN member has no rank and leaves one valid member: no comparison, NaN throughout
    assert bool(ranks[6:].isnan().all())


def test_nan_members_are_left_out_of_the_comparisons():
    p = bradley_terry_matrix(torch.tensor([1.0, float("nan"), 3.0, 2.0]), 1.0)
    rates = win_rates(p, "hard")
    assert math.isnan(float(rates[1]))
    assert rates[[0, 2, 3]].tolist() == [0.0, 1.0, 0.5]       # sums to 3 / 2 over 3 members


def test_bradley_terry_on_pickscore_is_its_pairwise_softmax():
    """PickScore is trained with a softmax over the two images' logit_scale * cos: P(a > b) is
    sigmoid(s_a - s_b) on the raw score, and at temperature 1/26 on the normalised one."""
    cosine = torch.tensor([0.21, 0.23, 0.18])
    raw = pickscore_from_cosine(cosine, 100.0)
    softmax = torch.softmax(raw[[0, 1]].double(), dim=0)[0]
    assert float(bradley_terry_matrix(raw, 1.0)[0, 1]) == pytest.approx(float(softmax), rel=1e-6)
    normalised = pickscore_from_cosine(cosine, 100.0, normalise=True)
    assert torch.allclose(bradley_terry_matrix(normalised, 1 / PICKSCORE_NORMALISER),
                          bradley_terry_matrix(raw, 1.0), atol=1e-6)


class BrighterJudge:
    """A pairwise judge of the toy's kind: prefers the brighter image, and cannot tell images
    within 0.01 of each other (P = 1/2, as Pref-GRPO's judge naming no winner)."""

    def __init__(self):
        self.pairs = []

    def prefer(self, a, b, prompts, metadata):
        self.pairs.append(len(a))
        gap = a.mean(dim=(1, 2, 3)) - b.mean(dim=(1, 2, 3))
        return torch.where(gap.abs() < 0.01, 0.5, (gap > 0).double())


def test_a_judge_sees_each_unordered_pair_of_a_group_once():
    levels = torch.tensor([0.2, 0.9, 0.205, 0.5])
    media = levels[:, None, None, None].expand(4, 3, 2, 2).clone()
    judge = BrighterJudge()
    p = preference_matrix(judge, media, ["a"] * 4, [{}] * 4)
    assert judge.pairs == [6]                                 # 4 choose 2, one call
    off_diagonal = ~torch.eye(4, dtype=torch.bool)
    assert bool(((p + p.T)[off_diagonal] == 1).all())       # P(j > i) = 1 - P(i > j)
    # 0.2 and 0.205 tie: half a win each
    assert win_rates(p, "hard").tolist() == pytest.approx([0.5 / 3, 1.0, 0.5 / 3, 2 / 3])


# ------------------------------------------------------------------------ rewards and config

def toy_multi(*specs):
    return MultiReward(list(specs))


def test_win_rate_reward_scores_groups_and_is_nan_without_them():
    reward = toy_multi({"name": "win_rate", "pairwise": {"model": "bradley_terry", "of": {
        "name": "geneval_toy", "score": "partial"}, "temperature": 0.1}},
        {"name": "group_rank", "of": {"name": "geneval_toy", "score": "partial"}, "weight": 0})
    assert reward.groupwise
    generator = torch.Generator().manual_seed(0)
    media = torch.rand(8, 3, 24, 24, generator=generator)
    media[::3] = 0                                            # blank canvases: partial 0
    prompts = ["a red circle"] * 4 + ["two squares"] * 4
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    scored = reward(media, prompts, None, group_ids=ids)
    partial = scored["win_rate.geneval_toy"]
    assert torch.equal(scored["group_rank.geneval_toy"], partial)
    assert torch.allclose(scored["win_rate"], ranks_in_groups(partial, ids))
    assert torch.allclose(scored["group_rank"], scored["win_rate"])
    assert float(scored["win_rate"][:4].sum()) == pytest.approx(2.0)
    assert torch.equal(scored["total"], scored["win_rate"])  # group_rank has weight 0
    # evaluation: no groups, so no win rate; the pointwise score is still there
    held_out = reward(media, prompts, None)
    assert bool(held_out["win_rate"].isnan().all()) and bool(held_out["total"].isnan().all())
    assert torch.equal(held_out["win_rate.geneval_toy"], partial)


def test_soft_wins_through_the_reward_match_the_formula():
    reward = toy_multi({"name": "win_rate", "wins": "soft", "pairwise": {
        "of": {"name": "geneval_toy", "score": "partial"}, "temperature": 0.5}})
    media = torch.rand(3, 3, 24, 24, generator=torch.Generator().manual_seed(3))
    scored = reward(media, ["a circle"] * 3, None, group_ids=torch.zeros(3, dtype=torch.long))
    r = scored["win_rate.geneval_toy"].double()
    expected = [sum(sigmoid(float(r[i] - r[j]) / 0.5) for j in range(3) if j != i) / 2
                for i in range(3)]
    assert scored["win_rate"].tolist() == pytest.approx(expected, abs=1e-6)
    # the model's prefer(a, b) on pairs agrees with its matrix of the group
    model = BradleyTerryPreference({"name": "geneval_toy", "score": "partial"}, temperature=0.5)
    matrix = model.preference_matrix(media, ["a circle"] * 3, [{}] * 3)
    pairs = model.prefer(media[[0, 2]], media[[1, 0]], ["a circle"] * 2, [{}] * 2)
    assert pairs.tolist() == pytest.approx([float(matrix[0, 1]), float(matrix[2, 0])], abs=1e-6)


def test_a_custom_pairwise_model_by_path():
    reward = toy_multi({"name": "win_rate",
                        "pairwise": {"model": "tests.test_group_rewards:BrighterJudge"}})
    media = torch.tensor([0.1, 0.6, 0.3, 0.9])[:, None, None, None].expand(4, 3, 4, 4).clone()
    scored = reward(media, ["a"] * 4, None, group_ids=torch.tensor([0, 0, 1, 1]))
    assert scored["win_rate"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert set(scored) == {"win_rate", "total"}              # no pointwise score to show


def toy_config(tmp_path, *overrides: str):
    """configs/toy_methods/pref_grpo.yaml shrunk to seconds: 2 x 4 samples, 6 steps."""
    return load_config(CONFIG, [
        f"model.path={TOY}", f"run.output_dir={tmp_path}", "run.tracker=none",
        "run.progress=false", "run.num_threads=1", "prompts.eval_per_family=1",
        "training.prompts_per_iteration=2", "training.group_size=4",
        "training.gradient_accumulation_steps=0", "sampling.num_steps=6",
        "sampling.eval_num_steps=4", "sampling.plan.window_size=2",
        "sampling.plan.branch_range=[0, 2]", "run.comparison_grid=false",
        "run.checkpoint_every=0", "run.max_iterations=2", "run.eval_every=0", *overrides])


WIN_RATE = "rewards.components=[{name: win_rate, options: {pairwise: %s%s}}]"


@pytest.mark.parametrize("overrides, message", [
    ([WIN_RATE % ("{of: geneval_toy, temperature: 0}", "")],
     r"rewards\.components\[0\]\.options\.pairwise\.temperature must be a finite number > 0"),
    ([WIN_RATE % ("{temperature: 1}", "")],
     r"rewards\.components\[0\]\.options\.pairwise\.of is required"),
    ([WIN_RATE % ("{of: geneval_toyy}", "")],
     r"rewards\.components\[0\]\.options\.pairwise\.of: unknown reward 'geneval_toyy'"),
    ([WIN_RATE % ("{of: group_rank}", "")], r"pairwise\.of: 'group_rank' is itself groupwise"),
    ([WIN_RATE % ("{model: elo, of: geneval_toy}", "")],
     r"options\.pairwise\.model: unknown pairwise model 'elo'; available: bradley_terry"),
    ([WIN_RATE % ("{of: geneval_toy, scale: 2}", "")], r"options\.pairwise\.scale: bradley_terry"),
    ([WIN_RATE % ("{of: geneval_toy}", ", wins: majority")],
     r"rewards\.components\[0\]\.options\.wins must be one of hard, soft"),
    (["rewards.components=[{name: win_rate, options: {of: geneval_toy}}]"],
     r"options\.of: win_rate has no option 'of'"),
    (["rewards.components=[{name: group_rank}]"], r"rewards\.components\[0\]\.options\.of is "
                                                  r"required"),
    (["eval.rewards=[{name: group_rank, options: {of: geneval_toy}}]"],
     r"eval\.rewards\[0\]: 'group_rank' compares the samples of a training group"),
    (["run.select_best_on=eval/total"], r"run\.select_best_on 'eval/total'.*NaN"),
    (["run.select_best_on=eval/win_rate/family_mean"], r"select_best_on.*NaN"),
])
def test_config_errors_name_the_field(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        toy_config(tmp_path, *overrides)


def test_the_config_selects_on_the_pointwise_score(tmp_path):
    config = toy_config(tmp_path, "run.select_best_on=eval/win_rate.geneval_toy")
    assert config.run.select_best_on == "eval/win_rate.geneval_toy"


def test_each_process_must_hold_whole_groups():
    reward = toy_multi({"name": "group_rank", "of": "geneval_toy"})
    check_whole_groups(reward, per_process=8, group_size=4, num_processes=2)
    with pytest.raises(ConfigError, match=r"6 samples per process is not a multiple of "
                                          r"training\.group_size 4.*prompts_per_iteration"):
        check_whole_groups(reward, per_process=6, group_size=4, num_processes=2)
    # pointwise rewards do not care
    check_whole_groups(toy_multi("geneval_toy"), per_process=6, group_size=4, num_processes=2)


# ------------------------------------------------------------------------ the trainer

@needs_toy
def test_a_toy_trainer_trains_on_win_rates_of_whole_groups(tmp_path):
    """Two iterations of the shipped Pref-GRPO config, shrunk. The rollout cuts its rows into
    chunks of 2 (rollout_batch_size), smaller than a group of 4: the win rates are still over
    whole groups (each group's sum is 4 / 2), and the weights move."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(toy_config(tmp_path, "sampling.rollout_batch_size=2"))
    before = {n: p.detach().clone() for n, p in trainer.trainable.items()}
    rates = []
    for iteration in range(2):
        metrics = trainer.run_iteration(iteration)
        gathered, group_ids = trainer.gathered
        rates.append(gathered["win_rate"])
        for group in group_ids.unique():
            assert float(gathered["win_rate"][group_ids == group].sum()) == pytest.approx(2.0)
        # the win rate is the rank of the partial credit in its group (hard Bradley-Terry wins)
        assert torch.allclose(gathered["win_rate"],
                              ranks_in_groups(gathered["win_rate.geneval_toy"], group_ids))
        assert metrics["reward/win_rate/mean"] == pytest.approx(0.5)
        assert metrics["reward/nan_count"] == 0
    moved = sum(float((p.detach() - before[n]).abs().sum()) for n, p in trainer.trainable.items())
    assert moved > 0
    # the evaluation scores without groups: no win rate, the partial credit and the verdict
    evaluation = trainer.evaluate(2, save_images=False)
    assert math.isnan(evaluation["eval/win_rate"])
    assert 0 <= evaluation["eval/win_rate.geneval_toy"] <= 1
    assert 0 <= evaluation["eval/geneval_toy"] <= 1


@pytest.mark.slow
@needs_toy
def test_two_processes_train_pref_grpo_like_one(tmp_path):
    """configs/toy_methods/pref_grpo.yaml, 4 groups of 8 for 2 iterations: each process scores
    its own whole groups, so 2 processes end each iteration with the weights of 1 (to 1e-6, as
    the shipped configs in test_multiprocess.py). ~1-2 minutes on 2 cores."""
    from safetensors.torch import load_file

    from tests.test_multiprocess import _launch_config

    sizes = ("training.prompts_per_iteration=4", "sampling.rollout_batch_size=8")
    one = _launch_config(1, str(CONFIG), tmp_path, *sizes)
    two = _launch_config(2, str(CONFIG), tmp_path, *sizes)
    for iteration in (1, 2):
        a = load_file(str(one / "checkpoints" / str(iteration) / "trainable.safetensors"))
        b = load_file(str(two / "checkpoints" / str(iteration) / "trainable.safetensors"))
        diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
        assert float(diff.max()) < 1e-6, (iteration, float(diff.max()))
    first = load_file(str(one / "checkpoints" / "1" / "trainable.safetensors"))
    last = load_file(str(one / "checkpoints" / "2" / "trainable.safetensors"))
    assert max(float((first[k] - last[k]).abs().max()) for k in first) > 1e-5   # it trained
    # 3 prompts per iteration cannot be split into whole groups over 2 processes
    with pytest.raises(AssertionError, match=r"not a multiple of training\.group_size"):
        _launch_config(2, str(CONFIG), tmp_path / "odd", "training.prompts_per_iteration=3",
                       "training.group_size=2")
