"""Qwen-Image-Edit-Plus adapter (Qwen-Image-Edit-2509/2511): parity with
QwenImageEditPlusPipeline from the same latents with two source images of different aspect
ratios and with one (with and without true CFG; 2509's and 2511's zero_cond_t transformer), every
source reaching the transformer, rows of mixed source layouts batched, validation before
loading, on-policy first pass and the LoRA loaded by the stock pipeline.

The pipeline has the VAE read every source at about 1024^2 pixels (its module constant
``VAE_IMAGE_SIZE``; 3 s per image on the tiny VAE), so the fast tests set the adapter's
``source_area`` and the pipeline's constant to 64^2 alike; one slow test compares at the
pipeline's own 1024^2."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.model import FlowModel, SourceImages
from flowgrpo.pixels import to_uint8
from flowgrpo.rollout import sample_ode
from pipelines import load_model
from tests.pipeline_helpers import fail_on_weight_loading, perturb_lora

H = W = 32
SMALL_AREA = 64 * 64
OPTIONS = {"height": H, "width": W, "source_area": SMALL_AREA}
PROMPT = "put the cube from picture 2 on the table in picture 1"
NUM_STEPS = 2


def _source(seed: int, height: int, width: int) -> torch.Tensor:
    """A random 8-bit image as float (3, height, width) in [0, 1] (what a PNG loads as)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return torch.from_numpy(pixels).permute(2, 0, 1).float() / 255


# Two sources of different aspect ratios: wide (40 x 64) and tall (64 x 48).
WIDE, TALL, OTHER = _source(0, 40, 64), _source(1, 64, 48), _source(2, 64, 48)


@pytest.fixture(scope="module")
def model(tiny_qwen_image_edit_plus_dir):
    return load_model("qwen_image_edit_plus", tiny_qwen_image_edit_plus_dir, options=OPTIONS)


@pytest.fixture
def small_stock_area(monkeypatch):
    """The stock pipeline's VAE source area set to the fast tests' ``source_area``."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as stock

    monkeypatch.setattr(stock, "VAE_IMAGE_SIZE", SMALL_AREA)


def _stock(folder: str, sources: list[torch.Tensor], noise: torch.Tensor, guidance_scale: float,
           lora: str | None = None) -> torch.Tensor:
    from diffusers import QwenImageEditPlusPipeline

    pipe = QwenImageEditPlusPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    pictures = [Image.fromarray(to_uint8(image)) for image in sources]
    return pipe(prompt=PROMPT, image=pictures if len(pictures) > 1 else pictures[0], height=H,
                width=W, num_inference_steps=NUM_STEPS, true_cfg_scale=guidance_scale,
                negative_prompt=" " if guidance_scale > 1 else None, latents=noise.clone(),
                output_type="pt").images


def _entry(sources: list[torch.Tensor]) -> torch.Tensor:
    return SourceImages(sources) if len(sources) > 1 else sources[0]


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
@pytest.mark.parametrize("count", [2, 1])
def test_ode_matches_stock_pipeline(model, tiny_qwen_image_edit_plus_dir, small_stock_area,
                                    count, guidance_scale):
    assert isinstance(model, FlowModel) and model.supports_images and model.max_source_images == 3
    sources = [WIDE, TALL][:count]
    noise = model.initial_noise(1, torch.Generator().manual_seed(0))
    ours = sample_ode(model, [PROMPT], noise, NUM_STEPS, guidance_scale, images=[_entry(sources)])
    reference = _stock(tiny_qwen_image_edit_plus_dir, sources, noise, guidance_scale)
    assert ours.shape == reference.shape == (1, 3, H, W)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


def test_2511_zero_cond_t_matches_stock_pipeline(tiny_qwen_image_edit_plus_dir, tmp_path,
                                                  small_stock_area, model):
    """Qwen-Image-Edit-2511: the transformer config's zero_cond_t (no new weights) is accepted,
    changes the velocity, and the adapter still equals the pipeline."""
    folder = tmp_path / "2511"
    shutil.copytree(tiny_qwen_image_edit_plus_dir, folder)
    config_path = folder / "transformer" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "zero_cond_t": True}))
    plus_2511 = load_model("qwen_image_edit_plus", folder, options=OPTIONS)
    noise = plus_2511.initial_noise(1, torch.Generator().manual_seed(1))
    ours = sample_ode(plus_2511, [PROMPT], noise, NUM_STEPS, 4.0, images=[SourceImages([WIDE, TALL])])
    torch.testing.assert_close(ours, _stock(str(folder), [WIDE, TALL], noise, 4.0), atol=1e-5, rtol=0)
    cond = model.encode_prompts([PROMPT], images=[SourceImages([WIDE, TALL])])
    with torch.no_grad():
        v_2509 = model.velocity(noise, torch.full((1,), 0.7), cond, 1.0)
        v_2511 = plus_2511.velocity(noise, torch.full((1,), 0.7), cond, 1.0)
    assert (v_2509 - v_2511).abs().max() > 1e-4


@pytest.mark.slow
def test_ode_matches_stock_pipeline_at_its_own_source_size(tiny_qwen_image_edit_plus_dir):
    """The pipeline's own 1024^2 VAE sources (the adapter's default source_area)."""
    plus = load_model("qwen_image_edit_plus", tiny_qwen_image_edit_plus_dir,
                      options={"height": H, "width": W})
    assert plus.options.source_area == 1024 * 1024
    noise = plus.initial_noise(1, torch.Generator().manual_seed(2))
    ours = sample_ode(plus, [PROMPT], noise, NUM_STEPS, 4.0, images=[SourceImages([WIDE, TALL])])
    reference = _stock(tiny_qwen_image_edit_plus_dir, [WIDE, TALL], noise, 4.0)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


def test_every_source_image_and_its_place_reach_the_transformer(model):
    noise = model.initial_noise(1, torch.Generator().manual_seed(3)).expand(4, -1, -1)
    entries = [SourceImages([WIDE, TALL]), SourceImages([WIDE, OTHER]), SourceImages([TALL, WIDE]),
               WIDE]
    cond = model.encode_prompts([PROMPT] * 4, images=entries)
    # the text encoder read both images: more vision tokens than for one
    lengths = cond.positive["prompt_embeds_mask"].sum(dim=1)
    assert lengths[0] == lengths[1] == lengths[2] > lengths[3]
    # each row's source layout, (1, h/16, w/16) per image at about 64^2 pixels, sides rounded
    # to 32: wide (ratio 1.6) w = sqrt(4096 * 1.6) = 81 -> 96, h = 51 -> 64; tall (0.75) 55 -> 64,
    # 74 -> 64; a row with one image padded with zeros
    assert cond.positive["source_shapes"].tolist()[0] == [[1, 4, 6], [1, 4, 4]]
    assert cond.positive["source_shapes"].tolist()[3] == [[1, 4, 6], [0, 0, 0]]
    assert cond.positive["image_latents"].shape[1] == 4 * 6 + 4 * 4
    with torch.no_grad():
        v = model.velocity(noise, torch.full((4,), 0.6), cond, 1.0)
    assert (v[0] - v[1]).abs().max() > 1e-4      # only the second image differs
    assert (v[0] - v[2]).abs().max() > 1e-4      # the same images in the other order
    assert (v[0] - v[3]).abs().max() > 1e-4      # the second image dropped


def test_rows_of_mixed_layouts_batch_as_each_alone(model):
    """Rows of different source layouts (counts, aspect ratios) in one batch: grouped by layout,
    each row's velocity equals the row's own (with and without CFG), padding never seen."""
    entries = [SourceImages([WIDE, TALL]), TALL, SourceImages([TALL, WIDE, OTHER]),
               SourceImages([WIDE, OTHER])]
    prompts = [PROMPT, "make it red", "combine these", "swap them"]
    noise = model.initial_noise(4, torch.Generator().manual_seed(4))
    sigma = torch.tensor([0.9, 0.7, 0.5, 0.3])
    calls = []
    handle = model.transformer.register_forward_hook(lambda *args: calls.append(1))
    try:
        for guidance_scale in (1.0, 4.0):
            cond = model.encode_prompts(prompts, images=entries)
            with torch.no_grad():
                calls.clear()
                batched = model.velocity(noise, sigma, cond, guidance_scale)
                assert len(calls) == 3           # rows 0 and 3 share a layout: one call
                for row in range(4):
                    alone = model.velocity(noise[row:row + 1], sigma[row:row + 1],
                                           model.encode_prompts([prompts[row]], images=[entries[row]]),
                                           guidance_scale)
                    torch.testing.assert_close(batched[row:row + 1], alone, atol=1e-5, rtol=0)
    finally:
        handle.remove()


def test_refusals(model):
    four = SourceImages([WIDE, TALL, OTHER, WIDE])
    with pytest.raises(ValueError, match=r"row 0's prompt gives 4 source images .* at most 3"):
        model.encode_prompts([PROMPT], images=[four])
    with pytest.raises(ValueError, match="one or more source images per prompt"):
        model.encode_prompts([PROMPT])
    with pytest.raises(ValueError, match="side under 32"):
        model.encode_prompts([PROMPT], images=[_source(0, 4, 96)])   # 96 x 4: h -> 13 -> 0


def test_one_image_sibling_refuses_several(tiny_qwen_image_edit_dir):
    sibling = load_model("qwen_image_edit", tiny_qwen_image_edit_dir, options={"height": H, "width": W})
    with pytest.raises(ValueError, match="qwen_image_edit family takes one source image"):
        sibling.encode_prompts([PROMPT], images=[SourceImages([WIDE, TALL])])


def test_errors_are_raised_before_weights_load(tiny_qwen_image_edit_plus_dir,
                                               tiny_qwen_image_edit_dir, monkeypatch):
    from pipelines import check_model_config

    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="is a QwenImageEditPipeline folder; this adapter is "
                                         "Qwen-Image-Edit-Plus"):
        load_model("qwen_image_edit_plus", tiny_qwen_image_edit_dir, options=OPTIONS)
    with pytest.raises(ValueError, match="options.source_area must be at least 1024"):
        load_model("qwen_image_edit_plus", tiny_qwen_image_edit_plus_dir,
                   options={**OPTIONS, "source_area": 100})
    with pytest.raises(ValueError, match="is a QwenImageEditPlusPipeline folder"):
        load_model("qwen_image_edit", tiny_qwen_image_edit_plus_dir, options={"height": H, "width": W})
    with pytest.raises(Exception, match="source_area"):
        check_model_config("qwen_image_edit_plus", {"source_area": "big"})
    check_model_config("qwen_image_edit_plus", {"source_area": 384 * 384})


def test_first_pass_ratio_is_exactly_one_and_lora_loads_in_the_stock_pipeline(
        tiny_qwen_image_edit_plus_dir, tmp_path, small_stock_area):
    from flowgrpo.config import load_config
    from flowgrpo.trainer import Trainer

    for name, image in (("wide", WIDE), ("tall", TALL), ("other", OTHER)):
        Image.fromarray(to_uint8(image)).save(tmp_path / f"{name}.png")
    lines = [{"prompt": PROMPT, "images": ["wide.png", "tall.png"]},
             {"prompt": "make it red", "image": "tall.png"},
             {"prompt": "combine these", "images": ["other.png", "wide.png", "tall.png"]}]
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = load_config(data={
        "name": "qwen_edit_plus",
        "model": {"family": "qwen_image_edit_plus", "path": tiny_qwen_image_edit_plus_dir,
                  "options": OPTIONS, "lora": {"rank": 4, "alpha": 8}},
        "prompts": {"train": str(tmp_path / "edits.jsonl"), "eval": None},
        "sampling": {"num_steps": 2, "eval_num_steps": 2, "rollout_batch_size": 3,
                     "guidance_scale": 4.0, "plan": {"kind": "full"}},
        "training": {"prompts_per_iteration": 3, "group_size": 2, "lr": 1e-2, "clip_low": 0.2,
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
    noise = model.initial_noise(1, torch.Generator().manual_seed(5))
    ours = sample_ode(model, [PROMPT], noise, NUM_STEPS, 1.0, images=[SourceImages([WIDE, TALL])])
    loaded = _stock(tiny_qwen_image_edit_plus_dir, [WIDE, TALL], noise, 1.0, lora=str(tmp_path / "lora"))
    base = _stock(tiny_qwen_image_edit_plus_dir, [WIDE, TALL], noise, 1.0)
    assert (loaded - base).abs().max() > 1e-3      # the LoRA changes the pipeline's samples
    torch.testing.assert_close(ours, loaded, atol=1e-4, rtol=0)
