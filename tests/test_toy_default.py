"""The embedded default (configs/toy_geneval.yaml) on the shipped toy model: one iteration end to
end (fast), and measurable learning in a few minutes (slow)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "toy_geneval.yaml"

pytestmark = pytest.mark.skipif(not (ROOT / "assets" / "toy" / "transformer").is_dir(),
                                reason="assets/toy is not built")


def default_config(tmp_path, *overrides):
    return load_config(CONFIG, [f"model.path={ROOT / 'assets' / 'toy'}",
                                f"run.output_dir={tmp_path}", "run.tracker=none",
                                "run.progress=false", "run.num_threads=0", *overrides])


def test_one_iteration_of_the_default_config(tmp_path):
    config = default_config(tmp_path, "run.max_iterations=1", "prompts.num_eval=12",
                            "prompts.eval_seeds=1")
    trainer = Trainer(config)
    history = trainer.train()
    train = [h for h in history if h["phase"] == "train"]
    evals = [h for h in history if h["phase"] == "eval"]
    assert len(train) == 1 and len(evals) == 2
    assert train[0]["train/first_pass_ratio_max_dev"] == 0.0
    assert 0.0 <= train[0]["reward/geneval_toy/mean"] <= 1.0
    assert any(k.startswith("eval/geneval_toy.exact/") for k in evals[0])
    run = tmp_path / config.name
    assert (run / "checkpoints" / "1" / "trainable.safetensors").is_file()
    assert (run / "comparison.png").is_file()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in lines] == ["eval", "train", "eval"]


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="issue 8 open: on the 35.8% base the training reward does "
                   "not yet rise by 2 SEM in 40 iterations (measured 2026-11-30, with the "
                   "partial-credit and with the exact-reward default)")
def test_training_reward_rises_on_the_toy_world(tmp_path):
    """A reduced default run on 8 fixed training prompts (every iteration sees all of them, so
    prompt mix does not drown the signal): the training reward rises within 40 iterations.
    Run: bash scripts/test.sh -m slow -k toy_world"""
    from reward_models.shapes import prompt_split

    records = [r for r in prompt_split("train") if r["metadata"]["family"] != "color_attr"][::4][:8]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = default_config(tmp_path, "run.max_iterations=40", "prompts.eval=null",
                            f"prompts.train={prompts}", "prompts.balance_key=null",
                            "run.comparison_grid=false", "run.checkpoint_every=0")
    history = [h for h in Trainer(config).train() if h["phase"] == "train"]
    rewards = torch.tensor([h["reward/total/mean"] for h in history])
    sem = max(h["reward/total/std"] for h in history) / 8.0   # 64 samples per iteration
    assert rewards[-10:].mean() - rewards[:10].mean() > 2 * sem, rewards.tolist()
