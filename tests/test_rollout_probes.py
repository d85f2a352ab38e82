"""benchmarks/rollout_probes.py: the per-step signal's bookkeeping on hand-made batches, and the
two probes end to end on the toy at a few seconds' size."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.rollout_probes import first_trained_steps, main, steps_by_group

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "assets" / "toy"
needs_toy = pytest.mark.skipif(not (TOY / "transformer").is_dir(), reason="assets/toy is not built")


def replay(rows, step):
    return SimpleNamespace(rows=torch.tensor(rows), step=step)


def test_first_trained_step_of_each_row_is_the_smallest_of_its_replay_batches():
    batch = SimpleNamespace(group_ids=torch.tensor([0, 0, 1, 1, 2]),
                            replay=[replay([2, 3], 5), replay([0, 1], 3), replay([0, 1], 2),
                                    replay([2], 4)])
    assert first_trained_steps(batch).tolist() == [2, 2, 4, 5, -1]


def test_groups_are_keyed_by_their_step_and_silent_groups_counted():
    # group 0 (step 3) agrees: no signal; group 1 (step 3) splits 1/0: std 0.5; group 2 (step 7)
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    groups = [0, 0, 1, 1, 2, 2, 2, 2]
    first = [3, 3, 3, 3, 7, 7, 7, 7]
    found = steps_by_group(rewards, groups, first)
    assert sorted(found) == [3, 7]
    assert [g["no_signal"] for g in found[3]] == [1.0, 0.0]
    assert found[3][1]["within_std"] == pytest.approx(0.5)
    assert found[7][0]["within_std"] == pytest.approx((0.25 * 0.75) ** 0.5)   # p = 3/4: sqrt(p(1-p))
    # a group whose rows train different steps (per-sample subsets) is keyed by the smallest;
    # an untrained row (-1) does not count, a group none of whose rows trains is keyed -1
    mixed = steps_by_group([1.0, 0.0, 1.0, 0.0, 0.0], [0, 0, 0, 1, 1], [5, 2, -1, -1, -1])
    assert sorted(mixed) == [-1, 2]


SMALL = ["model.path=" + str(TOY), "training.prompts_per_iteration=2", "training.group_size=4",
         "sampling.rollout_batch_size=8", "prompts.eval=null", "eval.rewards=[]"]


@needs_toy
def test_steps_probe_finds_each_branch_step_of_a_one_step_plan(tmp_path):
    out = tmp_path / "steps.json"
    result = main(["steps", "--config", str(ROOT / "configs/toy_methods/tempflow_grpo.yaml"),
                   "--iterations", "3", "--out", str(out),
                   *sum((["--set", s] for s in SMALL + ["sampling.num_steps=6",
                                                "sampling.plan.one_step_range=[0,5]"]),
                        [])])
    # 2 groups x 3 iterations, cycling over steps 0-4: group g of iteration t at (t + g) mod 5
    assert [r["step"] for r in result["rows"]] == [0, 1, 2, 3]
    assert [r["groups"] for r in result["rows"]] == [1, 2, 2, 1]
    assert all(0.0 <= r["no_signal"] <= 1.0 for r in result["rows"])
    assert json.loads(out.read_text())["rows"] == result["rows"]


@needs_toy
def test_guidance_probe_at_scale_zero_is_the_unguided_rollout(tmp_path):
    guided = "sampling.reward_guidance={reward: toy_proxy, normalize: true, first_step: 0}"
    args = sum((["--set", s] for s in SMALL + ["sampling.num_steps=8", guided]), [])
    result = main(["guidance", "--config", str(ROOT / "configs/toy_geneval.yaml"),
                   "--scales", "0,30", "--iterations", "1", *args])
    plain = main(["guidance", "--config", str(ROOT / "configs/toy_geneval.yaml"),
                  "--scales", "0", "--iterations", "1", *args])
    zero, strong = result["rows"]
    assert zero["total"] == plain["rows"][0]["total"]
    assert zero["samples"] == strong["samples"] == 8
    # the scale reaches the rollout even when --set replaces the whole guidance section
    assert strong["geneval_toy.partial"] != zero["geneval_toy.partial"]
    with pytest.raises(SystemExit, match="reward_guidance.reward is empty"):
        main(["guidance", "--config", str(ROOT / "configs/toy_geneval.yaml"), "--scales", "0"])
