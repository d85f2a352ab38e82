"""The trainer's end-of-run comparison grid: rows are the first two held-out prompts of each family
(chosen before any result exists), columns base and final over the same noise, and each caption
carries the verifier's PASS/FAIL verdict and score."""
from __future__ import annotations

import json

import pytest
import torch

from flowgrpo.grids import cell_caption, verdict_keys
from flowgrpo.prompts import comparison_prompts


def _records(pairs):
    return [{"prompt": p, "metadata": {"family": f} if f else {}} for p, f in pairs]


def test_rows_are_the_first_two_prompts_of_each_family_in_source_order():
    records = _records([("a", "x"), ("b", "y"), ("c", "x"), ("d", "x"), ("e", "z"), ("f", "y"),
                        ("g", "y")])
    assert [r["prompt"] for r in comparison_prompts(records)] == ["a", "c", "b", "f", "e"]
    assert comparison_prompts(records) == comparison_prompts(list(records))   # no randomness
    assert [r["prompt"] for r in comparison_prompts(records, per_family=1)] == ["a", "b", "e"]
    plain = _records([(str(i), None) for i in range(20)])
    assert [r["prompt"] for r in comparison_prompts(plain)] == [str(i) for i in range(12)]
    assert len(comparison_prompts(plain[:5])) == 5


def test_captions_carry_the_verdict_of_0_1_rewards():
    scores = {"geneval_toy": torch.tensor([1.0, 0.0]), "geneval_toy.partial": torch.tensor([1.0, 0.5]),
              "total": torch.tensor([1.0, 0.0])}
    weights = {"geneval_toy": 1.0}
    verdicts = verdict_keys([scores], weights)
    assert verdicts == {"geneval_toy", "total"}
    assert cell_caption(scores, weights, 0, verdict=verdicts) == "PASS 1.000 geneval_toy"
    assert cell_caption(scores, weights, 1, verdict=verdicts) == "FAIL 0.000 geneval_toy"
    assert cell_caption(scores, weights, 1) == "0.000 geneval_toy"       # as before without
    two = {"a": torch.tensor([1.0]), "b": torch.tensor([0.25]), "total": torch.tensor([1.25])}
    verdicts = verdict_keys([two], {"a": 1.0, "b": 1.0})
    assert verdicts == {"a"}            # b and the total are scores, not verdicts
    assert cell_caption(two, {"a": 1.0, "b": 1.0}, 0, verdict=verdicts) == \
        "1.250 total\nPASS 1.000 a\n0.250 b"
    # 1.0 in one column but 0.5 in another: not a verdict
    assert verdict_keys([{"a": torch.tensor([1.0]), "total": torch.tensor([1.0])},
                         {"a": torch.tensor([0.5]), "total": torch.tensor([0.5])}], {"a": 1}) == set()


def test_comparison_grid_rows_noise_and_verdicts(tiny_sd3_path, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import flowgrpo.grids as grids
    from flowgrpo.trainer import Trainer
    from tests.helpers import tiny_config
    from tests.verdict_rewards import parity_bit

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "eval.jsonl").write_text("".join(
        json.dumps({"prompt": p, "metadata": {"family": f}}) + "\n"
        for p, f in [("a red square", "shapes"), ("a green cat", "animals"),
                     ("a blue circle", "shapes"), ("a yellow star", "shapes"),
                     ("two dogs", "animals"), ("three birds", "animals")]))
    trainer = Trainer(tiny_config(
        tiny_sd3_path, tmp_path, f"prompts.eval={tmp_path / 'eval.jsonl'}",
        "rewards.components=[{name: 'tests.verdict_rewards:ParityBit'}]",
        "sampling.plan.kind=one_step", "training.lr=1e-1", "run.comparison_grid=true"))
    captured = {}
    real = grids.image_grid

    def spy(images, row_labels=None, col_labels=None, cell_labels=None, **kw):
        captured.update(images=images, rows=row_labels, cols=col_labels, cells=cell_labels)
        return real(images, row_labels, col_labels, cell_labels, **kw)

    monkeypatch.setattr(grids, "image_grid", spy)
    trainer.train()
    assert (trainer.run_dir / "comparison.png").is_file()
    assert captured["rows"] == ["a red square\n(shapes)", "a blue circle\n(shapes)",
                                "a green cat\n(animals)", "two dogs\n(animals)"]
    assert captured["cols"] == ["base", "iteration 1"]
    base = load_file(str(trainer.run_dir / "grid_base.safetensors"))["media"]
    final = load_file(str(trainer.run_dir / "grid_final.safetensors"))["media"]
    assert torch.equal(captured["images"][:, 0], base) and torch.equal(captured["images"][:, 1], final)
    # both columns start from the same noise (the eval stream's first draws): re-sampling the
    # grid's prompts from it gives the final column, and with LoRA disabled the base column
    from flowgrpo.rollout import sample_ode

    prompts = ["a red square", "a blue circle", "a green cat", "two dogs"]
    noise, steps = trainer.policy.eval_noise(4), trainer.config.sampling.eval_num_steps
    with torch.no_grad():
        assert torch.allclose(sample_ode(trainer.model, prompts, noise, steps, 1.0), final, atol=1e-5)
        with trainer.policy.reference_policy():
            assert torch.allclose(sample_ode(trainer.model, prompts, noise, steps, 1.0), base,
                                  atol=1e-5)
    assert not torch.equal(base, final)         # training moved the model
    for column, media in enumerate((base, final)):
        for row, bit in enumerate(parity_bit(media).tolist()):
            mark = "PASS" if bit == 1.0 else "FAIL"
            assert captured["cells"][row][column] == f"{mark} {bit:.3f} parity"


@pytest.mark.parametrize("bit", [0.0, 1.0])
def test_verdict_marks_render_in_the_grid_font(bit):
    """The marks are plain ASCII: PIL's default font draws every character of them."""
    from flowgrpo.grids import load_font

    font = load_font(14)
    text = cell_caption({"v": torch.tensor([bit]), "total": torch.tensor([bit])}, {"v": 1.0}, 0,
                        verdict={"v"})
    assert text.isascii() and font.getbbox(text.split()[0])[2] > 0
