"""Qwen-Image-Edit adapter: parity with QwenImageEditPipeline from the same latents and source
image (with and without true CFG), the source image reaching the transformer (through the VAE
latents and the text encoder's vision tokens), on-policy replay with images. Slow: the pipeline
encodes every source image at about 1024^2 pixels, even on the tiny build."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.model import FlowModel
from flowgrpo.rollout import sample_ode
from pipelines import load_model

pytestmark = pytest.mark.slow
H = W = 32
OPTIONS = {"height": H, "width": W}
PROMPT = "make the cube red"
NUM_STEPS = 2


@pytest.fixture(scope="module")
def model(tiny_qwen_image_edit_dir):
    return load_model("qwen_image_edit", tiny_qwen_image_edit_dir, options=OPTIONS)


def _source(seed: int) -> torch.Tensor:
    pixels = np.random.default_rng(seed).integers(0, 256, (H, W, 3), dtype=np.uint8)
    return torch.from_numpy(pixels).permute(2, 0, 1).float() / 255


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_matches_stock_pipeline(model, tiny_qwen_image_edit_dir, guidance_scale):
    from diffusers import QwenImageEditPipeline

    from flowgrpo.pixels import to_uint8

    assert isinstance(model, FlowModel) and model.supports_images
    image = _source(0)
    noise = model.initial_noise(1, torch.Generator().manual_seed(0))
    ours = sample_ode(model, [PROMPT], noise, NUM_STEPS, guidance_scale, images=[image])
    pipe = QwenImageEditPipeline.from_pretrained(tiny_qwen_image_edit_dir)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(prompt=PROMPT, image=Image.fromarray(to_uint8(image)), height=H, width=W,
                     num_inference_steps=NUM_STEPS, true_cfg_scale=guidance_scale,
                     negative_prompt=" " if guidance_scale > 1 else None,
                     latents=noise.clone(), output_type="pt").images
    assert ours.shape == reference.shape == (1, 3, H, W)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


def test_changing_only_the_source_image_changes_the_output(model):
    noise = model.initial_noise(1, torch.Generator().manual_seed(3)).expand(2, -1, -1)
    cond = model.encode_prompts([PROMPT] * 2, images=[_source(0), _source(1)])
    with torch.no_grad():
        v = model.velocity(noise, torch.full((2,), 0.6), cond, 1.0)
    assert (v[0] - v[1]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="one source image per prompt"):
        model.encode_prompts([PROMPT])


def test_first_pass_ratio_is_exactly_one_and_lora_loads_in_the_stock_pipeline(tiny_qwen_image_edit_dir, tmp_path):
    import json

    from diffusers import QwenImageEditPipeline

    from flowgrpo.config import load_config
    from flowgrpo.pixels import to_uint8
    from flowgrpo.trainer import Trainer
    from tests.pipeline_helpers import perturb_lora

    lines = []
    for i, prompt in enumerate([PROMPT, "add a green sphere"]):
        Image.fromarray(to_uint8(_source(i))).save(tmp_path / f"{i}.png")
        lines.append(json.dumps({"prompt": prompt, "image": f"{i}.png"}))
    (tmp_path / "edits.jsonl").write_text("\n".join(lines) + "\n")
    config = load_config(data={
        "name": "qwen_edit",
        "model": {"family": "qwen_image_edit", "path": tiny_qwen_image_edit_dir, "options": OPTIONS,
                  "lora": {"rank": 4, "alpha": 8}},
        "prompts": {"train": str(tmp_path / "edits.jsonl"), "eval": None},
        "sampling": {"num_steps": 2, "eval_num_steps": 2, "rollout_batch_size": 2,
                     "guidance_scale": 4.0, "plan": {"kind": "full"}},
        "training": {"prompts_per_iteration": 2, "group_size": 2, "lr": 1e-2, "clip_low": 0.2,
                     "skip_zero_std_groups": False},
        "rewards": {"components": [{"name": "tests.helpers:Brightness"}], "threaded": False},
        "run": {"output_dir": str(tmp_path / "runs"), "max_iterations": 1, "tracker": "none",
                "progress": False, "checkpoint_every": 0, "eval_every": 0}})
    trainer = Trainer(config)
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0

    model = trainer.policy.model
    perturb_lora(model.transformer)
    trainer.policy.save_weights(str(tmp_path / "lora"))
    image = _source(0)
    noise = model.initial_noise(1, torch.Generator().manual_seed(5))
    ours = sample_ode(model, [PROMPT], noise, NUM_STEPS, 1.0, images=[image])
    pipe = QwenImageEditPipeline.from_pretrained(tiny_qwen_image_edit_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    loaded = pipe(prompt=PROMPT, image=Image.fromarray(to_uint8(image)), height=H, width=W,
                  num_inference_steps=NUM_STEPS, true_cfg_scale=1.0, latents=noise.clone(),
                  output_type="pt").images
    torch.testing.assert_close(ours, loaded, atol=1e-4, rtol=0)
