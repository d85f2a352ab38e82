"""The learned toy proxy reward: prompt features, safetensors round trip, ensemble statistics,
and that it loads through the reward registry like a user's reward model."""
import pytest
import torch

from flowgrpo.toyworld.grammar import COLORS, RELATIONS, SHAPES, parse_prompt
from reward_models.loading import load_reward
from reward_models.toy_proxy import (OBJECT_FEATURES, PROMPT_FEATURES, ToyProxyNet,
                                     prompt_features)


def test_prompt_features_encode_shape_colour_count_and_relation():
    features = prompt_features(parse_prompt("two red circles left of a blue square"))
    assert features.shape == (PROMPT_FEATURES,)
    assert features.sum() == 7        # 3 per object + the relation
    first, second = features[:OBJECT_FEATURES], features[OBJECT_FEATURES:2 * OBJECT_FEATURES]
    assert first[SHAPES.index("circle")] == 1 and first[len(SHAPES) + COLORS.index("red")] == 1
    assert first[len(SHAPES) + len(COLORS) + 1 + 1] == 1            # count 2
    assert second[SHAPES.index("square")] == 1 and second[len(SHAPES) + COLORS.index("blue")] == 1
    assert features[2 * OBJECT_FEATURES + RELATIONS.index("left of")] == 1
    single = prompt_features(parse_prompt("a wedge"))
    assert single[len(SHAPES) + len(COLORS)] == 1                    # any colour
    assert single[OBJECT_FEATURES:2 * OBJECT_FEATURES].sum() == 0    # no second object
    assert single[2 * OBJECT_FEATURES + len(RELATIONS)] == 1         # no relation
    assert not torch.equal(prompt_features(parse_prompt("a red circle left of a blue square")),
                           prompt_features(parse_prompt("a blue square left of a red circle")))


@pytest.fixture(scope="module")
def proxy_dir(tmp_path_factory):
    torch.manual_seed(0)
    net = ToyProxyNet(members=3, width=4, hidden=8)
    folder = tmp_path_factory.mktemp("proxy")
    net.save_pretrained(folder, extra={"note": "random test weights"})
    return folder, net


def test_round_trip_reproduces_every_member(proxy_dir):
    folder, net = proxy_dir
    loaded = ToyProxyNet.from_pretrained(folder)
    images = torch.rand(5, 3, 24, 24)
    features = torch.stack([prompt_features(parse_prompt("a red circle"))] * 5)
    assert torch.equal(net(images, features), loaded(images, features))


def test_reward_mean_std_and_members_are_consistent(proxy_dir):
    folder, net = proxy_dir
    prompts = ["a red circle", "two green squares", "a cyan wedge above a red circle"]
    images = torch.rand(3, 3, 24, 24)
    reward = load_reward({"name": "toy_proxy", "path": str(folder)})
    main, parts = reward.score_and_components(images, prompts, [{}] * 3)
    members = torch.stack([parts[f"member{i}"] for i in range(3)])
    assert torch.allclose(main, members.mean(0)) and torch.equal(main, parts["mean"])
    assert torch.allclose(parts["std"], members.std(0, unbiased=False))
    assert ((main > 0) & (main < 1)).all()
    one = load_reward({"name": "toy_proxy", "path": str(folder), "member": 1})
    assert torch.equal(one(images, prompts, [{}] * 3), parts["member1"])


def test_bad_member_and_missing_folder_name_the_fix(proxy_dir, tmp_path):
    folder, _ = proxy_dir
    with pytest.raises(ValueError, match="member must be in 0..2"):
        load_reward({"name": "toy_proxy", "path": str(folder), "member": 3})
    with pytest.raises(FileNotFoundError, match="train_toy_proxy.py"):
        load_reward({"name": "toy_proxy", "path": str(tmp_path / "nothing")})
