"""A short GRPO run completes on each tiny family (SD3 CFG-free is also covered in test_trainer.py), including
Wan video with a per-frame reward, writes a checkpoint, and stays on-policy on the first pass."""
from __future__ import annotations

import pytest

from flowgrpo.config import load_config
from flowgrpo.trainer import Trainer
from tests.pipeline_helpers import IMAGE_OPTIONS, VIDEO_OPTIONS

CASES = {
    # SD3 with real CFG during rollout and training (both branches carry gradient).
    "sd3": (IMAGE_OPTIONS, ["sampling.guidance_scale=3.0"]),
    # FLUX.1: guidance-distilled (embedding), MixGRPO window with DPM-Solver++ after it.
    "flux": (IMAGE_OPTIONS, ["sampling.guidance_scale=3.5", "sampling.plan.kind=window",
                             "sampling.plan.window_size=1", "sampling.plan.solver_after=dpmpp_2m"]),
    # Wan: real CFG, one-step Flash-GRPO plan, per-frame JPEG reward on (B, F, 3, H, W) videos.
    "wan": (VIDEO_OPTIONS, ["sampling.guidance_scale=2.0", "sampling.plan.kind=one_step",
                            "training.rectification=true"]),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_short_run_on_tiny_family(family, request, tmp_path):
    path = request.getfixturevalue(f"tiny_{family}_dir")
    options, overrides = CASES[family]
    (tmp_path / "prompts.txt").write_text("a red square\na blue circle\n")
    config = load_config(data={
        "name": family,
        "model": {"family": family, "path": path, "options": dict(options),
                  "lora": {"rank": 2, "alpha": 4}},
        "prompts": {"train": str(tmp_path / "prompts.txt"), "eval": None},
        "sampling": {"num_steps": 3, "rollout_batch_size": 2},
        "training": {"prompts_per_iteration": 2, "group_size": 2, "lr": 1e-3,
                     "skip_zero_std_groups": False},
        "rewards": {"components": [{"name": "jpeg_compressibility"}], "threaded": False},
        "run": {"output_dir": str(tmp_path / "runs"), "max_iterations": 2, "tracker": "none",
                "progress": False, "checkpoint_every": 0},
    }, overrides=overrides)
    trainer = Trainer(config)
    history = trainer.train()
    train = [h for h in history if h["phase"] == "train"]
    assert len(train) == 2
    assert train[0]["train/first_pass_ratio_max_dev"] == 0.0
    assert train[0]["reward/nan_count"] == 0
    checkpoint = trainer.run_dir / "checkpoints" / "2"
    assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
    assert (checkpoint / "optimizer.safetensors").is_file()
    if family == "wan":
        assert trainer.model.decode(trainer.model.initial_noise(1, None)).dim() == 5
