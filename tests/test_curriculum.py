"""The variance curriculum (prompts.curriculum): sampling shifts toward prompts whose groups were
mixed by exactly the closed-form weight ratio, draws are a pure function of (seed, iteration,
history), it composes with balance_key, its state round-trips through checkpoints (resume is
exact), and bad settings are refused naming the field."""
from __future__ import annotations

import json
import math

import pytest
import torch

from flowgrpo.config import ConfigError, load_config
from flowgrpo.prompts import (PromptCurriculum, draw_probabilities, mixed_groups, mixed_probability,
                              sample_groups, sample_indices)


def _curriculum(num: int, **kw) -> PromptCurriculum:
    return PromptCurriculum([f"prompt {i}" for i in range(num)], **kw)


def _shares(picks: list[int], num: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(picks), minlength=num).double() / len(picks)


def test_estimate_and_weights_closed_form():
    cur = _curriculum(3, floor=0.1, prior=0.5, prior_strength=1.0, decay=1.0)
    cur.observe([0] * 6, [True] * 6)          # always mixed
    cur.observe([1] * 6, [False] * 6)         # always constant; prompt 2 never seen
    p = cur.probabilities()
    assert p.tolist() == pytest.approx([(6 + 0.5) / 7, 0.5 / 7, 0.5])
    assert cur.weights().tolist() == pytest.approx([0.1 + 6.5 / 7, 0.1 + 0.5 / 7, 0.6])
    decayed = _curriculum(1, decay=0.5, prior=0.0, floor=0.1)
    decayed.observe([0, 0, 0], [True, False, False])   # counts: groups 1.75, mixed 0.25
    assert decayed.groups.tolist() == [1.75] and decayed.mixed.tolist() == [0.25]
    assert float(decayed.probabilities()) == pytest.approx(0.25 / 2.75)
    assert mixed_probability(torch.tensor([0.0]), torch.tensor([0.0]), 0.3, 2.0).item() == 0.3


def test_sampling_shifts_to_the_mixed_prompt_by_the_weight_ratio():
    cur = _curriculum(2, floor=0.1, prior=0.5, prior_strength=1.0, decay=1.0)
    cur.observe([0] * 4 + [1] * 4, [True] * 4 + [False] * 4)
    weights = cur.weights()
    expected = float(weights[0] / weights.sum())          # (0.1 + 4.5/5) / (1.2) = 0.8333
    assert expected == pytest.approx(1.0 / 1.2)
    draws = 4000
    picks = [i for it in range(draws) for i in sample_indices(2, 1, 0, it, weights=weights)]
    share = float(_shares(picks, 2)[0])
    tolerance = 4 * math.sqrt(expected * (1 - expected) / draws)      # 4 binomial sigmas
    assert abs(share - expected) < tolerance, (share, expected)
    uniform = [i for it in range(draws) for i in sample_indices(2, 1, 0, it)]
    assert abs(float(_shares(uniform, 2)[0]) - 0.5) < 4 * math.sqrt(0.25 / draws)


def test_balance_key_draws_the_family_uniformly_then_by_curriculum_weight():
    records = [{"prompt": "x0", "metadata": {"family": "x"}}] + \
        [{"prompt": f"y{i}", "metadata": {"family": "y"}} for i in range(3)]
    cur = PromptCurriculum([r["prompt"] for r in records], floor=0.1, prior=0.5, decay=1.0)
    cur.observe([1] * 9 + [2] * 9 + [3] * 9, [True] * 9 + [False] * 18)
    buckets = ["x", "y", "y", "y"]
    probabilities = draw_probabilities(cur.weights(), buckets)
    w = cur.weights().tolist()
    assert probabilities.tolist() == pytest.approx(
        [0.5, 0.5 * w[1] / sum(w[1:]), 0.5 * w[2] / sum(w[1:]), 0.5 * w[3] / sum(w[1:])])
    draws = 2000
    picks = [i for it in range(draws // 4)
             for i in sample_indices(4, 4, 1, it, buckets, cur.weights())]
    shares = _shares(picks, 4)
    for share, expected in zip(shares.tolist(), probabilities.tolist()):
        assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / draws), shares
    # the family is still drawn uniformly: the one-prompt family keeps half of all groups
    assert abs(float(shares[0]) - 0.5) < 0.05
    groups = sample_groups(records, 4, 1, 0, "family", cur.weights())
    assert [r["prompt"] for r in groups] == [records[i]["prompt"]
                                             for i in sample_indices(4, 4, 1, 0, buckets, cur.weights())]


def test_balance_weights_draw_each_family_by_its_weight():
    """prompts.balance_weights: a family is drawn with probability b_l / sum b (a family not
    named weighs 1, weight 0 is never drawn), then a prompt of it as before; without weights the
    draws are exactly balance_key's uniform ones."""
    buckets = ["x"] + ["y"] * 3 + ["z"] * 2
    probabilities = draw_probabilities(torch.ones(6), buckets, {"y": 3, "z": 0})
    assert probabilities.tolist() == pytest.approx([0.25, 0.25, 0.25, 0.25, 0.0, 0.0])
    probabilities = draw_probabilities(torch.ones(6), buckets, {"y": 2})   # z weighs 1
    assert probabilities.tolist() == pytest.approx([0.25, 1 / 6, 1 / 6, 1 / 6, 0.125, 0.125])
    draws = 3000
    picks = [i for it in range(draws // 3)
             for i in sample_indices(6, 3, 4, it, buckets, bucket_weights={"y": 2})]
    shares = _shares(picks, 6)
    for share, expected in zip(shares.tolist(), probabilities.tolist()):
        assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / draws), shares
    never = [i for it in range(200) for i in sample_indices(6, 3, 4, it, buckets,
                                                            bucket_weights={"z": 0})]
    assert not {4, 5} & set(never)
    for it in range(20):
        assert sample_indices(6, 3, 4, it, buckets) == sample_indices(6, 3, 4, it, buckets,
                                                                      bucket_weights={})
    with pytest.raises(ValueError, match="no label can be drawn"):
        sample_indices(6, 3, 4, 0, buckets, bucket_weights={"x": 0, "y": 0, "z": 0})


@pytest.mark.parametrize("overrides, message", [
    (["prompts.balance_key=null", "prompts.balance_weights={x: 2}"],
     "prompts.balance_weights weighs the values of prompts.balance_key, which is not set"),
    (["prompts.balance_weights={colors: -1}"], r"prompts.balance_weights.colors must be in \[0, inf\)"),
    (["prompts.balance_weights={colors: .nan}"], r"prompts.balance_weights.colors must be a finite"),
    (["prompts.balance_weights={colors: .inf}"], r"prompts.balance_weights.colors must be a finite"),
    (["prompts.balance_weights={colors: many}"], r"prompts.balance_weights.colors must be a number"),
])
def test_bad_balance_weights_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/toy_geneval.yaml", overrides)


def test_balance_weights_must_name_families_the_prompts_have(tmp_path):
    from flowgrpo.trainer import Trainer

    for weights, message in (("{colour: 2}", r"names \['colour'\], which no training prompt"),
                             ("{colors: 0, counting: 0, position: 0, color_attr: 0, "
                              "single_object: 0, two_object: 0}", "every value of 'family' weight 0")):
        config = load_config("configs/toy_geneval.yaml", [
            f"prompts.balance_weights={weights}", f"run.output_dir={tmp_path}",
            "model.path=does/not/matter"])
        with pytest.raises(ConfigError, match=message):
            Trainer(config, model=object())


def test_draws_are_a_pure_function_of_seed_iteration_and_history():
    a, b = _curriculum(6), _curriculum(6)
    history = ([0, 3, 3, 5], [True, False, True, False])
    a.observe(*history)
    b.observe(*history)                     # another process seeing the same gathered groups
    assert a.state_dict() == b.state_dict()
    assert sample_indices(6, 4, 2, 7, weights=a.weights()) == \
        sample_indices(6, 4, 2, 7, weights=b.weights())
    picks = sample_indices(6, 4, 2, 7, weights=a.weights())
    assert len(set(picks)) == 4                            # without replacement within an iteration
    assert len(sample_indices(6, 9, 2, 7, weights=a.weights())) == 9   # then a second round
    # a different history moves the draw for the same (seed, iteration) somewhere
    c = _curriculum(6)
    c.observe([0] * 20, [False] * 20)
    assert any(sample_indices(6, 4, 2, it, weights=a.weights()) !=
               sample_indices(6, 4, 2, it, weights=c.weights()) for it in range(10))


def test_mixed_groups_follow_the_advantage_rule():
    nan = float("nan")
    rewards = {"total": torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, nan, nan, nan])}
    mixed, informative = mixed_groups(rewards, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), 4)
    assert mixed.tolist() == [False, True, False, False]
    assert informative.tolist() == [True, True, False, False]   # < 2 valid scores: no evidence
    two = {"a": torch.tensor([1.0, 1.0, 0.0, 0.0]), "b": torch.tensor([0.2, 0.3, 0.0, 0.0])}
    mixed, _ = mixed_groups(two, torch.tensor([0, 0, 1, 1]), 2)
    assert mixed.tolist() == [True, False]                     # GDPO: any component varies


def test_state_round_trips_through_json_and_checks_the_prompts():
    cur = _curriculum(4, decay=0.7)
    cur.observe([0, 1, 1, 3], [True, False, True, False])
    restored = _curriculum(4, decay=0.7)
    restored.load_state_dict(json.loads(json.dumps(cur.state_dict())))
    assert torch.equal(restored.groups, cur.groups) and torch.equal(restored.mixed, cur.mixed)
    assert torch.equal(restored.weights(), cur.weights())
    other = PromptCurriculum(["a", "b", "c", "e"])
    with pytest.raises(ValueError, match="other training prompts"):
        other.load_state_dict(cur.state_dict())


@pytest.mark.parametrize("override, field", [
    ("prompts.curriculum.floor=-0.1", "prompts.curriculum.floor"),
    ("prompts.curriculum.prior=1.5", "prompts.curriculum.prior"),
    ("prompts.curriculum.prior_strength=0", "prompts.curriculum.prior_strength"),
    ("prompts.curriculum.decay=0", "prompts.curriculum.decay"),
    ("prompts.curriculum.decay=1.2", "prompts.curriculum.decay"),
    ("prompts.curriculum.enabled=maybe", "prompts.curriculum.enabled"),
    ("prompts.curriculum.speed=2", "prompts.curriculum.speed"),
])
def test_bad_curriculum_settings_are_named(override, field):
    base = {"rewards": {"components": [{"name": "geneval_toy"}]}}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(data=base, overrides=["prompts.curriculum.enabled=true", override])


def test_curriculum_combinations_refused():
    base = {"rewards": {"components": [{"name": "geneval_toy"}]}}
    with pytest.raises(ConfigError, match="floor and prompts.curriculum.prior are both 0"):
        load_config(data=base, overrides=["prompts.curriculum.enabled=true",
                                          "prompts.curriculum.floor=0", "prompts.curriculum.prior=0"])
    with pytest.raises(ConfigError, match="only supported for policy: flow"):
        load_config(data={**base, "policy": "llm"}, overrides=["prompts.curriculum.enabled=true"])
    off = load_config(data=base)
    assert off.prompts.curriculum.enabled is False   # default off


# ------------------------------------------------------------------------------ in the trainer
def _config(path: str, tmp_path, *overrides: str):
    from tests.helpers import tiny_config

    (tmp_path).mkdir(parents=True, exist_ok=True)
    config = tiny_config(path, tmp_path, "prompts.curriculum.enabled=true",
                         "rewards.components=[{name: 'tests.verdict_rewards:ParityBit'}]",
                         "training.prompts_per_iteration=2", "training.group_size=2",
                         "sampling.rollout_batch_size=2", "sampling.num_steps=2",
                         "sampling.plan.kind=one_step", *overrides)
    return config


def test_trainer_feeds_gathered_groups_to_the_curriculum_and_resumes_exactly(tiny_sd3_path,
                                                                             tmp_path):
    from flowgrpo.trainer import Trainer

    common = ["run.max_iterations=3", "run.checkpoint_every=1"]
    full = Trainer(_config(tiny_sd3_path, tmp_path / "a", "name=full", *common))
    history = [h for h in full.train() if h["phase"] == "train"]
    # every informative group of every iteration was counted once (decay 0.8 per prompt)
    assert 0 < float(full.curriculum.groups.sum()) <= 3 * 2
    assert all("train/curriculum_mixed_share" in h and "train/curriculum_expected_mixed_share"
               in h for h in history)
    draws = [full.group_prompts(it) for it in range(2, 3)]
    stopped = Trainer(_config(tiny_sd3_path, tmp_path / "b", "name=resumed", *common,
                              "run.max_iterations=2"))
    stopped.train()
    state = json.loads((stopped.run_dir / "checkpoints" / "2" / "trainer_state.json").read_text())
    assert "curriculum" in state
    resumed = Trainer(_config(tiny_sd3_path, tmp_path / "b", "name=resumed", *common))
    resumed.resume("latest")
    assert resumed.curriculum.state_dict() == stopped.curriculum.state_dict()
    assert resumed.group_prompts(2) == draws[0]
    resumed.train(resume="latest")
    assert resumed.curriculum.state_dict() == full.curriculum.state_dict()
    for name, param in full.trainable.items():
        assert torch.equal(param, resumed.trainable[name]), name


def test_two_processes_hold_the_same_curriculum(tiny_sd3_path, tmp_path):
    """Groups span processes; the curriculum is built from the gathered rewards, so both
    processes hold the same state and draw the same prompts."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from tests.helpers import free_port

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "prompts.txt").write_text("a red square\na blue circle\na green cat\na dog\n")
    config = tmp_path / "mp.yaml"
    config.write_text(yaml.safe_dump({
        "name": "mpcur",
        "model": {"family": "sd3", "path": tiny_sd3_path, "options": {"height": 32, "width": 32},
                  "lora": {"rank": 4, "alpha": 8}},
        "prompts": {"train": str(tmp_path / "prompts.txt"), "eval": None,
                    "curriculum": {"enabled": True}},
        # 3 groups of 4 over 2 processes: group 1 spans both processes.
        "sampling": {"num_steps": 2, "rollout_batch_size": 2, "plan": {"kind": "one_step"}},
        "training": {"prompts_per_iteration": 3, "group_size": 4},
        "rewards": {"components": [{"name": "tests.verdict_rewards:ParityBit"}],
                    "threaded": False},
        "run": {"output_dir": str(tmp_path / "runs"), "tracker": "none", "progress": False},
    }))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root),
           "ACCELERATE_USE_CPU": "true"}
    out = tmp_path / "state"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
           "2", "--num_machines", "1", "--main_process_port", str(free_port()),
           "--mixed_precision", "no", "--dynamo_backend", "no",
           str(root / "tests" / "mp_curriculum.py"), str(config), str(out)]
    result = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    errors = "\n".join(line for line in result.stderr.splitlines() if "it/s]" not in line)
    assert result.returncode == 0, errors[-6000:]
    ranks = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["num_processes"] == 2 and ranks[0]["local_rows"] == [6, 6]
    assert ranks[0]["states"] == ranks[1]["states"]
    assert ranks[0]["draws"] == ranks[1]["draws"]
    # every group of both iterations was counted: 3 per iteration, decay 0.8 per prompt
    groups = ranks[0]["states"][-1]["groups"]
    assert 3 < sum(groups) <= 6
