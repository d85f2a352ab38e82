"""Advantages: parity with a slow per-group loop, NaN masking, zero-std groups, GDPO by hand."""
from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.advantages import decoupled_advantages, group_advantages


def _reference_advantages(rewards: list[float], group_ids: list[int], scale: str, ddof: int, eps: float,
                          clip: float | None) -> list[float]:
    """One group at a time, in python floats."""

    def std(values: list[float]) -> float:
        if len(values) < 2:
            return 0.0
        mean = sum(values) / len(values)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - ddof))

    all_valid = [r for r in rewards if not math.isnan(r)]
    batch_std = std(all_valid)
    out = [0.0] * len(rewards)
    for group in set(group_ids):
        members = [i for i, g in enumerate(group_ids) if g == group and not math.isnan(rewards[i])]
        values = [rewards[i] for i in members]
        if len(values) < 2 or max(values) == min(values):
            continue
        mean = sum(values) / len(values)
        for i in members:
            centred = rewards[i] - mean
            if scale == "group":
                out[i] = centred / (std(values) + eps)
            elif scale == "batch":
                out[i] = centred / (batch_std + eps)
            else:
                out[i] = centred
            if clip is not None:
                out[i] = min(max(out[i], -clip), clip)
    return out


def _random_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-contiguous shuffled group ids; NaNs; one all-equal group; one all-NaN group; one group with a
    single valid reward."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.tensor([907, -3, 12, 5_000_000_000, 44, 0])
    sizes = [5, 4, 6, 3, 4, 2]
    group_ids = torch.cat([labels[i].repeat(n) for i, n in enumerate(sizes)])
    rewards = torch.randn(group_ids.shape[0], generator=generator, dtype=torch.float64) * 2 + 1
    rewards[torch.rand(rewards.shape[0], generator=generator) < 0.2] = float("nan")
    rewards[group_ids == 44] = 0.1                      # all equal (0.1 * 4 / 4 is not exactly 0.1)
    rewards[(group_ids == 44).nonzero()[0]] = float("nan")
    rewards[group_ids == 0] = float("nan")              # no valid reward
    single = (group_ids == 5_000_000_000).nonzero().flatten()
    rewards[single[1:]] = float("nan")                  # one valid reward
    permutation = torch.randperm(group_ids.shape[0], generator=generator)
    return rewards[permutation], group_ids[permutation]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_slow_loop(scale, ddof, clip, seed):
    rewards, group_ids = _random_batch(seed)
    advantages, _ = group_advantages(rewards, group_ids, scale=scale, ddof=ddof, eps=1e-4, clip=clip)
    expected = _reference_advantages(rewards.tolist(), group_ids.tolist(), scale, ddof, 1e-4, clip)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-6)


def test_nan_rewards_get_zero_and_do_not_move_statistics():
    group_ids = torch.tensor([3, 3, 3, 3, 8, 8, 8])
    with_nan = torch.tensor([1.0, 2.0, float("nan"), 4.0, 0.0, float("nan"), 1.0])
    advantages, stats = group_advantages(with_nan, group_ids, scale="batch", ddof=1, clip=None)
    kept = ~torch.isnan(with_nan)
    without, _ = group_advantages(with_nan[kept], group_ids[kept], scale="batch", ddof=1, clip=None)
    assert advantages[~kept].tolist() == [0.0, 0.0]
    torch.testing.assert_close(advantages[kept], without)
    assert stats["nan_count"] == 2.0


def test_all_equal_group_is_exactly_zero_even_without_eps():
    # mean(0.1, 0.1, 0.1) != 0.1 in floating point: r - mean is ~1e-17 and so is the computed std,
    # so a naive (r - mean) / (std + 0) would give O(1) noise.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 3.0], dtype=torch.float64)
    group_ids = torch.tensor([1, 1, 1, 2, 2])
    advantages, stats = group_advantages(rewards, group_ids, scale="group", eps=0.0, clip=None)
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0]
    assert advantages[3:].tolist() == [-1.0, 1.0]          # population std of {1, 3} is 1
    assert stats["zero_std_fraction"] == 0.5


def test_stats_closed_form():
    rewards = torch.tensor([0.0, 2.0, 5.0, 5.0, float("nan"), 7.0])
    group_ids = torch.tensor([10, 10, 20, 20, 30, 30])
    advantages, stats = group_advantages(rewards, group_ids, scale="none", clip=None)
    assert advantages.tolist() == [-1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # group 20 all equal, group 30 one valid reward: 2 of 3 groups carry no signal
    assert stats["num_groups"] == 3.0
    assert stats["nan_count"] == 1.0
    assert stats["zero_std_fraction"] == pytest.approx(2 / 3)
    # valid samples: advantages -1, 1, 0, 0, 0 (the NaN sample is left out)
    assert stats["adv_mean"] == pytest.approx(0.0)
    assert stats["adv_std"] == pytest.approx(math.sqrt(2 / 5))
    assert stats["adv_abs_max"] == 1.0


def test_clip_bounds_advantages():
    rewards = torch.tensor([0.0] * 9 + [100.0])
    advantages, _ = group_advantages(rewards, torch.zeros(10, dtype=torch.long), clip=2.0)
    assert advantages.max().item() == 2.0
    unclipped, _ = group_advantages(rewards, torch.zeros(10, dtype=torch.long), clip=None)
    assert unclipped.max().item() == pytest.approx(3.0, rel=1e-4)    # (100 - 10) / 30


def test_relabelling_and_permutation_equivariance():
    rewards, group_ids = _random_batch(5)
    advantages, _ = group_advantages(rewards, group_ids, scale="group", ddof=1)
    permutation = torch.randperm(rewards.shape[0], generator=torch.Generator().manual_seed(1))
    relabelled = group_ids * 7 + 11
    moved, _ = group_advantages(rewards[permutation], relabelled[permutation], scale="group", ddof=1)
    torch.testing.assert_close(moved, advantages[permutation])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_trl_formula(scale):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    generator = torch.Generator().manual_seed(3)
    num_generations = 4
    rewards = torch.randint(0, 5, (6 * num_generations,), generator=generator).float()
    rewards[[1, 9]] = float("nan")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = trl_utils.nanstd(rewards).expand_as(rewards)
    else:
        std = trl_utils.nanstd(grouped, dim=1).repeat_interleave(num_generations)
    expected = rewards - mean
    if scale != "none":
        expected = expected / (std + 1e-4)
    expected = torch.nan_to_num(expected, nan=0.0)          # TRL zeroes unscorable rows afterwards
    group_ids = torch.arange(6).repeat_interleave(num_generations)
    advantages, _ = group_advantages(rewards, group_ids, scale=scale, ddof=1, eps=1e-4, clip=None)
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-5)


def test_group_advantages_reject_bad_arguments():
    rewards, group_ids = torch.zeros(4), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(rewards, group_ids, scale="global")
    with pytest.raises(ValueError, match="ddof"):
        group_advantages(rewards, group_ids, ddof=2)
    with pytest.raises(TypeError, match="group_ids"):
        group_advantages(rewards, group_ids.float())
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(rewards, group_ids[:3])
    with pytest.raises(ValueError, match="clip"):
        group_advantages(rewards, group_ids, clip=0.0)


# ---------------------------------------------------------------- GDPO / multi-reward


def _z_scores(values: list[float], groups: list[int], eps: float) -> list[float]:
    """Per-group population z-scores by hand, NaN-masked, 0 for NaN and zero-std groups."""
    out = [0.0] * len(values)
    for group in set(groups):
        members = [i for i, g in enumerate(groups) if g == group and not math.isnan(values[i])]
        kept = [values[i] for i in members]
        mean = sum(kept) / len(kept)
        std = math.sqrt(sum((v - mean) ** 2 for v in kept) / len(kept))
        for i in members:
            out[i] = 0.0 if std == 0 else (values[i] - mean) / (std + eps)
    return out


def test_gdpo_matches_formula_by_hand():
    groups = [0, 0, 0, 1, 1, 1, 2, 2]
    quality = [1.0, 3.0, 2.0, 0.5, 0.5, 2.5, 4.0, 1.0]
    length = [0.0, 1.0, 1.0, 10.0, float("nan"), 20.0, 3.0, 3.0]
    weights = {"quality": 1.0, "length": 0.5}
    eps = 1e-4
    a_quality, a_length = _z_scores(quality, groups, eps), _z_scores(length, groups, eps)
    combined = [weights["quality"] * q + weights["length"] * l for q, l in zip(a_quality, a_length)]
    valid = [i for i in range(8) if i != 4]                # sample 4 has a NaN component
    mean = sum(combined[i] for i in valid) / len(valid)
    std = math.sqrt(sum((combined[i] - mean) ** 2 for i in valid) / len(valid))
    expected = [0.0 if i == 4 else (combined[i] - mean) / (std + eps) for i in range(8)]

    rewards = {"quality": torch.tensor(quality), "length": torch.tensor(length)}
    group_ids = torch.tensor(groups)
    advantages, stats = decoupled_advantages(rewards, weights, group_ids, mode="gdpo", eps=eps, clip=None)
    torch.testing.assert_close(advantages, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert stats["nan_count"] == 1.0
    assert stats["length/nan_count"] == 1.0 and stats["quality/nan_count"] == 0.0
    assert stats["length/zero_std_fraction"] == pytest.approx(1 / 3)     # group 2: length 3, 3

    raw, _ = decoupled_advantages(rewards, weights, group_ids, mode="gdpo", eps=eps, clip=None,
                                  batch_normalize=False)
    expected_raw = [0.0 if i == 4 else combined[i] for i in range(8)]
    torch.testing.assert_close(raw, torch.tensor(expected_raw), rtol=1e-5, atol=1e-6)


def test_sum_then_normalize_is_group_advantages_of_weighted_sum():
    generator = torch.Generator().manual_seed(0)
    group_ids = torch.arange(4).repeat_interleave(5)
    rewards = {"a": torch.randn(20, generator=generator), "b": torch.rand(20, generator=generator)}
    rewards["b"][7] = float("nan")
    weights = {"a": 0.3, "b": 2.0}
    advantages, stats = decoupled_advantages(rewards, weights, group_ids, mode="sum_then_normalize",
                                             scale="batch", ddof=1)
    total = 0.3 * rewards["a"].double() + 2.0 * rewards["b"].double()
    expected, _ = group_advantages(total, group_ids, scale="batch", ddof=1)
    torch.testing.assert_close(advantages, expected)
    assert advantages[7].item() == 0.0 and stats["nan_count"] == 1.0


def test_decoupled_advantages_reject_bad_arguments():
    rewards = {"a": torch.zeros(4), "b": torch.zeros(4)}
    group_ids = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="weights must have exactly the keys"):
        decoupled_advantages(rewards, {"a": 1.0}, group_ids)
    with pytest.raises(ValueError, match="mode"):
        decoupled_advantages(rewards, {"a": 1.0, "b": 1.0}, group_ids, mode="mean")
    with pytest.raises(ValueError, match="scale"):
        decoupled_advantages(rewards, {"a": 1.0, "b": 1.0}, group_ids, mode="gdpo", scale="batch")
    with pytest.raises(ValueError, match="rewards\\['b'\\]"):
        decoupled_advantages({"a": torch.zeros(4), "b": torch.zeros(3)}, {"a": 1.0, "b": 1.0}, group_ids)


def test_decoupled_sum_is_the_weighted_sum_of_per_reward_group_z_scores(tiny_sd3_path, tmp_path):
    """rewards.aggregation: decoupled_sum (MixGRPO's advantage_aggr) gives A = sum_k w_k z_k
    with z_k each reward's group z-score and no batch normalisation afterwards."""
    from flowgrpo.trainer import Trainer
    from tests.helpers import tiny_config

    trainer = Trainer(tiny_config(
        tiny_sd3_path, tmp_path, "rewards.aggregation=decoupled_sum", "training.adv_clip=0",
        "rewards.components=[{name: 'tests.helpers:Brightness', weight: 2.0}, "
        "{name: 'tests.helpers:Brightness', weight: 0.5, options: {label: b2}}]"))
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    first = torch.tensor([0.1, 0.4, 0.2, 0.9, 0.5, 0.5, 0.3, 0.7])
    second = torch.tensor([1.0, 0.0, 2.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    batch = type("Batch", (), {"group_ids": group_ids, "prompts": ["p"] * 8})()
    advantages, _ = trainer.compute_advantages(
        batch, {"brightness": first, "b2": second, "total": 2 * first + 0.5 * second})

    def z(values):
        grouped = values.view(2, 4)
        mean, std = grouped.mean(1, keepdim=True), grouped.std(1, unbiased=False, keepdim=True)
        return ((grouped - mean) / (std + 1e-4)).flatten()

    torch.testing.assert_close(advantages, 2 * z(first) + 0.5 * z(second), atol=1e-5, rtol=1e-5)
