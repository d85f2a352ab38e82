"""pass@k and standard errors (flowgrpo.passk): closed-form cases, the estimator against brute-force
enumeration of k-subsets, and ``flowgrpo eval --samples-per-prompt`` through the real parser on the
tiny SD3 build."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from flowgrpo.passk import (family_mean_se, format_passk_table, is_binary, mean_and_se, pass_at_k,
                            pass_k_values, passk_report, success_counts, summarize)


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c successes) holding a success."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 4, 6])
def test_pass_at_k_is_the_chance_that_a_k_subset_holds_a_success(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_closed_forms_and_domain():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)          # pass@1 = c / n
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)       # exact binomials at large n
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="successes"):
        pass_at_k(4, 5, 1)


def test_reported_ks_are_powers_of_two_and_k():
    assert pass_k_values(1) == [1]
    assert pass_k_values(6) == [1, 2, 4, 6]
    assert pass_k_values(8) == [1, 2, 4, 8]


def test_summary_of_successes_0_1_4_of_4():
    stats = summarize(torch.tensor([0, 1, 4]), torch.tensor([4, 4, 4]), [1, 2, 4])
    assert stats["pass@1"] == pytest.approx(5 / 12)             # mean(0, 1/4, 1)
    assert stats["pass@2"] == pytest.approx(0.5)                # mean(0, 1/2, 1)
    assert stats["pass@4"] == pytest.approx(2 / 3)              # mean(0, 1, 1)
    values = torch.tensor([0, 0.25, 1], dtype=torch.float64)
    assert stats["pass@1_se"] == pytest.approx(float(values.std(correction=0)) / math.sqrt(3))
    assert stats["mixed_share"] == pytest.approx(1 / 3)         # only c = 1 is 0 < c < 4
    assert stats["histogram"] == [1, 1, 0, 0, 1]
    assert stats["prompts"] == 3 and stats["samples"] == 12


def test_nan_scores_are_not_trials():
    scores = torch.tensor([[1.0, float("nan"), 0.0, 0.7],
                           [float("nan")] * 4,
                           [0.2, 0.49, 0.5, 0.0]])
    successes, trials = success_counts(scores, threshold=0.5)
    assert successes.tolist() == [2, 0, 1] and trials.tolist() == [3, 0, 4]
    stats = summarize(successes, trials, [1, 2, 4])
    assert stats["prompts"] == 2 and stats["no_score_prompts"] == 1
    # pass@4 is defined only for the prompt with 4 trials
    assert stats["pass@4"] == 1.0
    assert stats["pass@1"] == pytest.approx((2 / 3 + 1 / 4) / 2)


def test_standard_errors():
    mean, se = mean_and_se([0.0, 1.0, 1.0, 1.0])
    assert mean == 0.75 and se == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert mean_and_se([0.3]) == (0.3, 0.0)
    assert family_mean_se([0.3, 0.4]) == pytest.approx(0.25)     # sqrt(0.09 + 0.16) / 2


def test_report_per_family_and_family_mean():
    exact = torch.tensor([[0.0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    partial = torch.tensor([[0.2, 0.5, 0.7, 0.1]] * 4)
    report = passk_report({"v.exact": exact, "v.partial": partial}, ["a", "b", "a", None])
    assert list(report["keys"]) == ["v.exact"]                  # the only 0/1 key
    assert is_binary(exact) and not is_binary(partial)
    entry = report["keys"]["v.exact"]
    assert report["ks"] == [1, 2, 4] and report["samples_per_prompt"] == 4
    assert entry["families"]["a"]["pass@1"] == pytest.approx(0.5)
    assert entry["families"]["b"]["pass@2"] == pytest.approx(0.5)
    assert entry["all"]["prompts"] == 4                          # the family-less prompt counts here
    assert entry["all"]["histogram"] == [1, 1, 1, 0, 1]
    assert entry["all"]["mixed_share"] == pytest.approx(0.5)
    fam = entry["family_mean"]
    assert fam["pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert fam["pass@1_se"] == pytest.approx(
        family_mean_se([entry["families"]["a"]["pass@1_se"], entry["families"]["b"]["pass@1_se"]]))
    assert fam["mixed_share"] == pytest.approx((0 + 1) / 2)
    forced = passk_report({"v.partial": partial}, [None] * 4, threshold=0.5, keys=["v.partial"])
    assert forced["keys"]["v.partial"]["all"]["pass@1"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no reward key 'nope'"):
        passk_report({"v.exact": exact}, [None] * 4, keys=["nope"])
    table = format_passk_table(report)
    assert "family mean" in table and "pass@4" in table and "0:1 1:1 2:1 3:0 4:1" in table


# ------------------------------------------------------------------------------ through the CLI
OPTIONS = {"height": 32, "width": 32, "max_sequence_length": 16}


def test_eval_samples_per_prompt_reports_pass_at_k(tiny_sd3_path, tmp_path, capsys):
    from flowgrpo.cli import main
    from pipelines import load_model
    from flowgrpo.rollout import sample_ode
    from tests.verdict_rewards import parity_bit

    prompts = [("a red square", "colors"), ("two cats", "counting"), ("a blue circle", "colors")]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": p, "metadata": {"family": f}}) + "\n"
                              for p, f in prompts))
    out = tmp_path / "eval.json"
    k = 4
    code = main(["eval", "--model", f"sd3:{tiny_sd3_path}", "--options",
                 *[f"{key}={v}" for key, v in OPTIONS.items()],
                 "--rewards", "tests.verdict_rewards:ParityBit,tests.helpers:Brightness",
                 "--prompts", str(source), "--samples-per-prompt", str(k), "--steps", "2",
                 "--guidance", "1", "--out", str(out), "--quiet"])
    assert code == 0
    result = json.loads(out.read_text())
    # seeds 0..K-1 per prompt, prompt-major: recompute every verdict independently
    model = load_model("sd3", tiny_sd3_path, options=dict(OPTIONS))
    rows = [(p, s) for p, _ in prompts for s in range(k)]
    noise = torch.cat([model.initial_noise(1, torch.Generator().manual_seed(s)) for _, s in rows])
    bits = parity_bit(sample_ode(model, [p for p, _ in rows], noise, 2, 1.0, batch_size=8))
    assert [(s["prompt"], s["seed"], s["prompt_index"]) for s in result["samples"]] == \
        [(p, s, i // k) for i, (p, s) in enumerate(rows)]
    counts = bits.reshape(3, k).sum(1).long().tolist()
    assert 0 < sum(counts) < 3 * k, counts          # the case exercises successes and failures
    passk = result["pass_at_k"]
    # brightness and total = parity + brightness are not 0/1: only the verdict is reported
    assert list(passk["keys"]) == ["parity"] and passk["ks"] == [1, 2, 4]
    entry = passk["keys"]["parity"]
    for kk in (1, 2, 4):
        expected = sum(brute_pass_at_k(k, c, kk) for c in counts) / 3
        assert entry["all"][f"pass@{kk}"] == pytest.approx(expected, abs=1e-12)
        colors = (brute_pass_at_k(k, counts[0], kk) + brute_pass_at_k(k, counts[2], kk)) / 2
        assert entry["families"]["colors"][f"pass@{kk}"] == pytest.approx(colors, abs=1e-12)
        assert entry["family_mean"][f"pass@{kk}"] == pytest.approx(
            (colors + brute_pass_at_k(k, counts[1], kk)) / 2, abs=1e-12)
    histogram = [0] * (k + 1)
    for c in counts:
        histogram[c] += 1
    assert entry["all"]["histogram"] == histogram
    assert entry["all"]["mixed_share"] == pytest.approx(sum(0 < c < k for c in counts) / 3)
    printed = capsys.readouterr().out
    assert "pass@k of" in printed and "mixed" in printed


def test_samples_per_prompt_needs_as_many_seeds(tiny_sd3_path, tmp_path, capsys):
    from flowgrpo.cli import main

    code = main(["eval", "--model", f"sd3:{tiny_sd3_path}", "--rewards", "tests.helpers:Brightness",
                 "--prompts", "a cat", "--samples-per-prompt", "3", "--seeds", "0-1",
                 "--out", str(tmp_path / "e.json"), "--quiet"])
    assert code == 2
    assert "--samples-per-prompt is 3" in capsys.readouterr().err


def test_eval_config_samples_per_prompt_uses_the_configs_prompts_and_eval_noise(tiny_sd3_path,
                                                                               tmp_path):
    """With a CONFIG, the prompts are the distinct ones of its evaluation (the first
    eval_per_family of each family) and sample i of the prompt-major rows gets the eval noise
    stream's draw i (seeded by run.seed)."""
    import yaml

    from flowgrpo.cli import main
    from flowgrpo.rollout import sample_ode
    from flowgrpo.seeding import seeded_generator
    from pipelines import load_model
    from tests.verdict_rewards import parity_bit

    (tmp_path / "eval.jsonl").write_text("".join(
        json.dumps({"prompt": p, "metadata": {"family": f}}) + "\n"
        for p, f in [("a red square", "shapes"), ("a green cat", "animals"),
                     ("a blue circle", "shapes"), ("a yellow star", "shapes")]))
    (tmp_path / "train.txt").write_text("a cat\n")
    config = {
        "name": "passk", "model": {"family": "sd3", "path": tiny_sd3_path, "options": OPTIONS},
        "prompts": {"train": str(tmp_path / "train.txt"), "eval": str(tmp_path / "eval.jsonl"),
                    "eval_per_family": 2},
        "sampling": {"eval_num_steps": 2},
        "rewards": {"components": [{"name": "tests.verdict_rewards:ParityBit"}]},
        "run": {"seed": 5, "tracker": "none"},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out.json"
    assert main(["eval", str(tmp_path / "c.yaml"), "--samples-per-prompt", "2", "--out", str(out),
                 "--quiet"]) == 0
    result = json.loads(out.read_text())
    prompts = ["a red square", "a red square", "a blue circle", "a blue circle",
               "a green cat", "a green cat"]
    assert [s["prompt"] for s in result["samples"]] == prompts
    model = load_model("sd3", tiny_sd3_path, options=dict(OPTIONS))
    noise = torch.cat([model.initial_noise(1, seeded_generator(5, "eval", i)) for i in range(6)])
    bits = parity_bit(sample_ode(model, prompts, noise, 2, 1.0, batch_size=16))
    assert [s["rewards"]["parity"] for s in result["samples"]] == bits.tolist()
    counts = bits.reshape(3, 2).sum(1).long().tolist()
    entry = result["pass_at_k"]["keys"]["parity"]
    assert entry["families"]["shapes"]["prompts"] == 2
    assert entry["all"]["pass@2"] == pytest.approx(sum(brute_pass_at_k(2, c, 2) for c in counts) / 3)
