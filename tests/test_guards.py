"""Guards against reward hacking, the maths and the config: the KL gate (which samples, the
normaliser), GARDO's win-rate uncertainty, diversity-aware amplification, TaRoS-style saturation
weights, the reward ensemble, and the config errors (field and fix, before any model loads)."""
from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.advantages import (decoupled_advantages, diversity_weights, kl_gate_weights,
                                 saturation_weights, win_rate, win_rate_gap)
from flowgrpo.config import ConfigError, load_config
from flowgrpo.losses import gated_kl

NAN = float("nan")


# --------------------------------------------------------------------------- the KL gate

@pytest.mark.parametrize("uncertainty, fraction, expected", [
    ([0.1, 0.5, 0.3, 0.9, 0.2], 0.4, [0, 1, 0, 1, 0]),      # k = 2: the two largest
    ([1.0, 3.0, 3.0, 2.0], 0.25, [0, 1, 1, 0]),              # k = 1, a tie at the k-th: both in
    ([1.0, 3.0, 3.0, 2.0], 0.5, [0, 1, 1, 0]),               # k = 2 exactly the tie
    ([1.0, 3.0, 3.0, 2.0], 0.75, [0, 1, 1, 1]),
    ([0.1, NAN, 0.2, 0.3], 0.25, [0, 1, 0, 0]),              # NaN = least trusted
    ([0.1, 0.5, 0.3, 0.9], 0.0, [0, 0, 0, 0]),               # q = 0: nothing
    ([0.1, 0.5, 0.3, 0.9], 1.0, [1, 1, 1, 1]),               # q = 1: the plain KL
    ([5.0] * 4, 0.25, [1, 1, 1, 1]),                          # all tied: all in
])
def test_kl_gate_picks_the_most_uncertain_share(uncertainty, fraction, expected):
    gate = kl_gate_weights(torch.tensor(uncertainty), fraction)
    assert gate.dtype == torch.float32
    assert gate.tolist() == [float(e) for e in expected]


def test_kl_gate_count_is_the_nearest_integer_of_q_times_b():
    values = torch.arange(10.0)
    assert kl_gate_weights(values, 0.25).sum() == 3      # 2.5 rounds up
    assert kl_gate_weights(values, 0.3).sum() == 3       # 3.0000000000000004 is 3
    assert kl_gate_weights(values, 0.04).sum() == 0      # 0.4 rounds down: nothing gated
    assert kl_gate_weights(values, 0.25)[-3:].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="fraction"):
        kl_gate_weights(values, 1.5)


def test_gated_kl_is_the_mean_over_gated_rows_and_only_they_get_gradient():
    kl = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    gate = torch.tensor([1.0, 0.0, 1.0, 0.0])
    value = gated_kl(kl, gate)
    assert value.item() == 2.0                          # (1 + 3) / 2
    value.backward()
    assert kl.grad.tolist() == [0.5, 0.0, 0.5, 0.0]
    assert gated_kl(kl, torch.ones(4)).item() == kl.mean().item() == 2.5   # q = 1: the plain KL
    assert gated_kl(kl, torch.zeros(4)).item() == 0.0
    assert gated_kl(torch.tensor([1.0, NAN]), torch.tensor([1.0, 0.0])).item() == 1.0


def test_win_rate_counts_ties_as_half_and_the_gap_is_proxy_minus_auxiliaries():
    assert win_rate(torch.tensor([1.0, 2.0, 2.0, 4.0])).tolist() == [0.0, 0.5, 0.5, 1.0]
    rates = win_rate(torch.tensor([1.0, NAN, 3.0]))
    assert rates[0] == 0.0 and math.isnan(rates[1]) and rates[2] == 1.0
    trained = torch.tensor([1.0, 2.0, 3.0])
    # the trained reward ranks sample 2 first, the auxiliaries last: the most suspicious
    assert win_rate_gap(trained, [torch.tensor([3.0, 2.0, 1.0])]).tolist() == [-1.0, 0.0, 1.0]
    gap = win_rate_gap(trained, [torch.tensor([3.0, 2.0, 1.0]), torch.tensor([1.0, 2.0, 3.0])])
    assert gap.tolist() == [-0.5, 0.0, 0.5]


# --------------------------------------------------------------------------- diversity

def test_diversity_amplifies_distinct_positive_samples_by_nearest_distance_over_group_mean():
    features = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0],      # group 0: a duplicate pair
                             [2.0, 2.0], [2.0, 2.0], [2.0, 2.0],      # group 1: identical
                             [3.0, 1.0]])                              # group 2: alone
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    advantages = torch.tensor([0.5, -0.5, 1.0, 1.0, -1.0, 0.0, 2.0])
    weights, stats = diversity_weights(features, groups, advantages)
    # group 0: nearest distances (0, 0, 1), mean 1/3: the distinct positive sample gets 3, the
    # duplicate positive one 0, the negative one is left alone; group 1 (all distances 0) and
    # the lone sample of group 2 are not reweighted.
    assert weights.tolist() == [0.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0]
    assert stats["diversity_weight_max"] == 3.0
    assert stats["diversity_weight_mean"] == pytest.approx((0 + 3 + 1 + 1) / 4)
    assert stats["diversity_amplified_share"] == 0.25


def test_diversity_weights_use_cosine_distance_of_any_feature_scale():
    angle = math.pi / 3   # 60 degrees: cosine 1/2
    features = torch.tensor([[1.0, 0.0], [math.cos(angle), math.sin(angle)], [-5.0, 0.0]])
    weights, _ = diversity_weights(features, torch.zeros(3, dtype=torch.long), torch.ones(3))
    nearest = torch.tensor([0.5, 0.5, 1.5], dtype=torch.float64)   # 1 - cos to the closest
    assert torch.allclose(weights.double(), nearest / nearest.mean(), atol=1e-6)


# --------------------------------------------------------------------------- saturation

def _z(values: list[float], eps: float = 1e-4) -> list[float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return [0.0 if std == 0 else (v - mean) / (std + eps) for v in values]


def test_saturation_weight_is_zero_for_a_component_constant_in_a_group():
    rewards = {"a": torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0]),
               "b": torch.tensor([0.0, 2.0, 4.0, 1.0, 3.0, 5.0])}
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    weights, stats = saturation_weights(rewards, groups, ratio=1.0)
    # a: constant in group 0; in group 1 its std sqrt(2/3) exceeds the batch std sqrt(1/3)
    assert weights["a"].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    # b: std in each group sqrt(8/3), over the batch sqrt(17.5/6): weight their ratio
    expected = math.sqrt(8 / 3) / math.sqrt(17.5 / 6)
    assert torch.allclose(weights["b"], torch.full((6,), expected, dtype=torch.float64))
    assert stats["saturation/a/zero_share"] == 0.5 and stats["saturation/a/weight"] == 0.5
    # with ratio 0.5 the groups' spread is enough for the full weight
    assert saturation_weights(rewards, groups, ratio=0.5)[0]["b"].tolist() == [1.0] * 6


def test_saturated_gdpo_advantages_equal_a_hand_computation():
    rewards = {"a": torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0]),
               "b": torch.tensor([0.0, 2.0, 4.0, 1.0, 3.0, 5.0])}
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    scales, _ = saturation_weights(rewards, groups, ratio=1.0)
    advantages, _ = decoupled_advantages(rewards, {"a": 1.0, "b": 0.5}, groups, clip=None,
                                         batch_normalize=False, component_scales=scales)
    s_b = math.sqrt(8 / 3) / math.sqrt(17.5 / 6)
    z_a = [0.0, 0.0, 0.0] + _z([0.0, 1.0, 2.0])
    z_b = _z([0.0, 2.0, 4.0]) + _z([1.0, 3.0, 5.0])
    s_a = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    expected = [1.0 * s_a[i] * z_a[i] + 0.5 * s_b * z_b[i] for i in range(6)]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)
    # the weighted_sum route: the total from scaled components, then the group z-score
    total, _ = decoupled_advantages(rewards, {"a": 1.0, "b": 0.5}, groups, clip=None,
                                    mode="sum_then_normalize", component_scales=scales)
    sums = [s_a[i] * rewards["a"][i].item() + 0.5 * s_b * rewards["b"][i].item() for i in range(6)]
    assert total.tolist() == pytest.approx(_z(sums[:3]) + _z(sums[3:]), abs=1e-6)


def test_equal_spreads_give_the_plain_weights():
    # both groups have each component's batch mean and spread: s = 1 everywhere
    rewards = {"a": torch.tensor([0.0, 1.0, 2.0, 2.0, 1.0, 0.0]),
               "b": torch.tensor([5.0, 3.0, 4.0, 3.0, 4.0, 5.0])}
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    scales, _ = saturation_weights(rewards, groups, ratio=0.5)
    assert all(bool((s == 1).all()) for s in scales.values())
    weights = {"a": 1.0, "b": 0.3}
    for kwargs in ({}, {"batch_normalize": False}, {"mode": "sum_then_normalize"}):
        plain, _ = decoupled_advantages(rewards, weights, groups, **kwargs)
        scaled, _ = decoupled_advantages(rewards, weights, groups, component_scales=scales,
                                         **kwargs)
        assert torch.equal(plain, scaled), kwargs


def test_saturation_of_a_component_constant_over_the_batch_is_zero_and_nan_is_ignored():
    rewards = {"flat": torch.full((4,), 3.0), "live": torch.tensor([0.0, NAN, 1.0, 3.0])}
    weights, _ = saturation_weights(rewards, torch.tensor([0, 0, 1, 1]), ratio=1.0)
    assert weights["flat"].tolist() == [0.0] * 4
    # group 0 has one valid value (std 0); group 1 std 1 over batch std sqrt(14/9 - ...) >= 1
    assert weights["live"].tolist()[:2] == [0.0, 0.0] and weights["live"][2] > 0


# --------------------------------------------------------------------------- the ensemble

def _images(batch: int = 3) -> torch.Tensor:
    return torch.rand(batch, 3, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("penalty, ddof", [(0.0, 0), (2.0, 0), (0.5, 1)])
def test_ensemble_of_two_constants_has_exact_mean_and_std(penalty, ddof):
    from reward_models import MultiReward

    reward = MultiReward([{"name": "ensemble", "penalty": penalty, "ddof": ddof, "members": [
        {"name": "tests.helpers:Constant", "value": 2.0},
        {"name": "tests.helpers:Constant", "value": 5.0, "label": "high"}]}])
    out = reward(_images(), ["p"] * 3, [{}] * 3)
    std = 1.5 if ddof == 0 else 1.5 * math.sqrt(2)
    assert out["ensemble.mean"].tolist() == [3.5] * 3
    assert out["ensemble.std"].tolist() == pytest.approx([std] * 3, abs=1e-6)
    assert out["ensemble"].tolist() == pytest.approx([3.5 - penalty * std] * 3, abs=1e-6)
    assert out["ensemble.Constant"].tolist() == [2.0] * 3 and out["ensemble.high"].tolist() == [5.0] * 3
    assert out["total"].tolist() == out["ensemble"].tolist()


def test_ensemble_member_nan_makes_the_score_nan_and_spread_follows_members():
    from reward_models import load_reward

    reward = load_reward({"name": "ensemble", "members": [
        "tests.helpers:Brightness", "tests.helpers:NaNForFirst"]})
    images = _images()
    main, parts = reward.score_and_components(images, ["p"] * 3, [{}] * 3)
    bright = images.flatten(1).mean(1)
    assert math.isnan(main[0]) and math.isnan(parts["mean"][0]) and math.isnan(parts["std"][0])
    assert parts["Brightness"][0] == pytest.approx(bright[0].item())   # the member keeps its score
    # the other samples: both members score the brightness, so they agree exactly
    assert parts["std"][1:].tolist() == [0.0, 0.0]
    assert main[1:].tolist() == pytest.approx(bright[1:].tolist())


@pytest.mark.parametrize("members, match", [
    (["tests.helpers:Brightness"], "at least 2"),
    ([{"name": "tests.helpers:Brightness", "label": "x"},
      {"name": "tests.helpers:Darkness", "label": "x"}], "used twice"),
    ([{"name": "tests.helpers:Brightness", "label": "std"}, "tests.helpers:Darkness"], "not one of"),
])
def test_ensemble_refuses_bad_members(members, match):
    from reward_models import load_reward

    with pytest.raises(ValueError, match=match):
        load_reward({"name": "ensemble", "members": members})


# --------------------------------------------------------------------------- config

def _config(*overrides: str, components=None):
    components = components or [{"name": "geneval_toy"}]
    return load_config(data={"rewards": {"components": components}}, overrides=list(overrides))


ENSEMBLE = [{"name": "ensemble", "options": {"members": [
    {"name": "geneval_toy", "label": "a"}, {"name": "geneval_toy", "label": "b"}]}}]


@pytest.mark.parametrize("overrides, components, match", [
    (["training.kl_beta=0.1", "training.gardo.kl_gate_key=ensemble.nope"], ENSEMBLE,
     r"training.gardo.kl_gate_key: reward 'ensemble' has no component 'nope'.*ensemble.std"),
    (["training.kl_beta=0.1", "training.gardo.kl_gate_key=proxy.std"], None,
     r"training.gardo.kl_gate_key: 'proxy.std' names no reward output"),
    (["training.gardo.kl_gate_key=ensemble.std"], ENSEMBLE, r"training.kl_beta is 0"),
    (["training.kl_beta=0.1", "training.gardo.kl_gate_key=ensemble.std",
      "training.gardo.kl_gate_auxiliary=[geneval_toy]"], ENSEMBLE, "set one of them"),
    (["training.kl_beta=0.1", "training.gardo.kl_gate_auxiliary=[aesthetic]"], None,
     r"kl_gate_auxiliary\[0\]: 'aesthetic' names no reward output"),
    (["training.kl_beta=0.1", "training.gardo.kl_gate_key=ensemble.std",
      "training.gardo.kl_gate_fraction=1.5"], ENSEMBLE, r"kl_gate_fraction must be in \[0, 1\]"),
    (["training.gardo.refresh_every=5"], None, "no term uses"),
    (["training.gardo.diversity=true", "training.gardo.diversity_features=dino"], None,
     "'pixels' or 'package.module:Class'"),
    (["rewards.saturation_ratio=0.5"], None, "1 component"),
    (["rewards.saturation_ratio=1.5"], [{"name": "geneval_toy"}, {"name": "toy_artifacts"}],
     r"rewards.saturation_ratio must be in \(0, 1\]"),
    (["rewards.saturation_ratio=0.5", "training.kl_reward=0.1"],
     [{"name": "geneval_toy"}, {"name": "toy_artifacts"}], "kl_reward"),
])
def test_guard_config_errors_name_the_field_and_the_fix(overrides, components, match):
    with pytest.raises(ConfigError, match=match):
        _config(*overrides, components=components)


def test_guard_config_accepts_what_it_can_use_and_refuses_guards_for_llm():
    config = _config("training.kl_beta=0.1", "training.gardo.kl_gate_key=ensemble.std",
                     "training.gardo.refresh_every=10", "training.gardo.diversity=true",
                     components=ENSEMBLE)
    assert config.training.gardo.kl_gate and config.training.gardo.refresh
    _config("rewards.saturation_ratio=0.5", "rewards.aggregation=decoupled",
            components=[{"name": "geneval_toy"}, {"name": "toy_artifacts", "weight": 0.5}])
    # a module:Class reward without a label: its key is known only once it loads
    _config("training.kl_beta=0.1", "training.gardo.kl_gate_key=brightness_spread.spread",
            components=[{"name": "tests.helpers:BrightnessSpread"}])
    with pytest.raises(ConfigError, match="is for policy: flow"):
        load_config(data={"policy": "llm", "rewards": {"components": [{"name": "exact_match"}]},
                          "training": {"kl_beta": 0.1, "gardo": {"refresh_every": 2}}})
    with pytest.raises(ConfigError, match=r"options.members\[1\]: unknown reward 'nope'"):
        _config(components=[{"name": "ensemble", "options": {"members": ["geneval_toy", "nope"]}}])


# --------------------------------------------------------------------------- features

def test_pixel_features_pool_images_and_videos():
    from flowgrpo.guards import pixel_features

    images = torch.zeros(2, 3, 8, 8)
    images[1, 0, :4, :4] = 1.0                      # a red top-left quarter
    features = pixel_features(images, 2)
    assert features.shape == (2, 12)
    assert features[0].tolist() == [0.0] * 12
    assert features[1].tolist() == [1.0, 0.0, 0.0, 0.0] + [0.0] * 8
    assert pixel_features(torch.rand(2, 5, 3, 8, 8), 2).shape == (2, 5 * 12)


def test_a_users_feature_class_is_built_with_its_options_and_checked():
    from flowgrpo.guards import load_feature_extractor, media_features

    config = _config("training.gardo.diversity=true",
                     "training.gardo.diversity_features=tests.helpers:MeanColour",
                     "training.gardo.diversity_feature_options={scale: 2.0}")
    images = torch.rand(4, 3, 8, 8)
    features = media_features(load_feature_extractor(config), images)
    assert torch.allclose(features, 2.0 * images.flatten(2).mean(2))
    with pytest.raises(ValueError, match=r"must return \(B, D\)"):
        media_features(lambda media: media.mean(dim=(1, 2, 3)), images)   # (B,), not (B, D)
    config.training.gardo.diversity_features = "tests.helpers:NoSuchClass"
    with pytest.raises(ConfigError, match="training.gardo.diversity_features: cannot build"):
        load_feature_extractor(config)


def test_ensemble_member_keys_number_repeated_names():
    from reward_models.ensemble import member_keys

    assert member_keys(["toy_proxy", {"name": "toy_proxy"}, "pkg.mod:Sharp"]) == \
        ["toy_proxy_0", "toy_proxy_1", "Sharp"]
