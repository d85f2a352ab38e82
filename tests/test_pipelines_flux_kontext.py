"""FLUX.1 Kontext adapter: parity with FluxKontextPipeline from the same latents and source
image, the source image reaching the transformer, on-policy replay with images, LoRA round trip."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from flowgrpo.model import FlowModel
from flowgrpo.pixels import to_uint8
from flowgrpo.rollout import sample_ode
from pipelines import load_model
from tests.pipeline_helpers import IMAGE_OPTIONS, TINY_MAX_SEQUENCE_LENGTH, perturb_lora

PROMPTS = ["make the cube red", "add a green sphere"]
NUM_STEPS = 4
H, W = IMAGE_OPTIONS["height"], IMAGE_OPTIONS["width"]


@pytest.fixture(scope="module")
def kontext(tiny_flux_kontext_dir):
    return load_model("flux_kontext", tiny_flux_kontext_dir, options=IMAGE_OPTIONS)


def _sources(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # uint8-exact images, so the stock pipeline's PIL/tensor path sees the same pixels
    return [torch.randint(0, 256, (3, H, W), generator=generator).float() / 255 for _ in PROMPTS]


def _stock(directory):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock_images(pipe, images, noise, guidance_scale):
    return pipe(prompt=PROMPTS, image=torch.stack(images), height=H, width=W,
                num_inference_steps=NUM_STEPS, guidance_scale=guidance_scale,
                latents=noise.clone(), output_type="pt", max_sequence_length=TINY_MAX_SEQUENCE_LENGTH,
                max_area=H * W, _auto_resize=False).images


def test_load_model_returns_an_editing_flow_model(kontext):
    assert isinstance(kontext, FlowModel) and kontext.family == "flux_kontext"
    assert kontext.supports_images and kontext.pipeline_class.__name__ == "FluxKontextPipeline"
    with pytest.raises(ValueError, match="one source image per prompt"):
        kontext.encode_prompts(PROMPTS)


@pytest.mark.parametrize("guidance_scale", [1.0, 3.5])
def test_ode_matches_stock_pipeline(kontext, tiny_flux_kontext_dir, guidance_scale):
    images = _sources()
    noise = kontext.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    ours = sample_ode(kontext, PROMPTS, noise, NUM_STEPS, guidance_scale, images=images)
    reference = _stock_images(_stock(tiny_flux_kontext_dir), images, noise, guidance_scale)
    assert ours.shape == reference.shape == (2, 3, H, W)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


def test_changing_only_the_source_image_changes_the_output(kontext):
    a, b = _sources(0), _sources(1)
    noise = kontext.initial_noise(1, torch.Generator().manual_seed(3)).expand(2, -1, -1)
    cond = kontext.encode_prompts([PROMPTS[0]] * 2, images=[a[0], b[0]])
    assert cond.positive["image_latents"].shape == noise.shape
    with torch.no_grad():
        v = kontext.velocity(noise, torch.full((2,), 0.6), cond, 3.5)
    assert (v[0] - v[1]).abs().max() > 1e-4
    # a larger source is resized to the output size
    big = torch.nn.functional.interpolate(a[0][None], size=(2 * H, 2 * W), mode="nearest")[0]
    assert kontext.encode_prompts([PROMPTS[0]], images=[big]).positive["image_latents"].shape == \
        (1, *noise.shape[1:])


def _kontext_trainer(tiny_flux_kontext_dir: str, tmp_path, name: str, masks: bool = False,
                     locality: dict | None = None, rewards: list | None = None):
    """A Trainer of the tiny Kontext model on two JSONL edit records (source images written to
    tmp_path; with ``masks``, record i's mask is the top half of its i-th vertical stripe)."""
    from flowgrpo.config import load_config
    from flowgrpo.trainer import Trainer

    lines = []
    for i, image in enumerate(_sources()):
        Image.fromarray(to_uint8(image)).save(tmp_path / f"{i}.png")
        record = {"prompt": PROMPTS[i], "image": f"{i}.png"}
        if masks:
            mask = torch.zeros(H, W, dtype=torch.uint8)
            mask[: H // 2, i * W // 2:(i + 1) * W // 2] = 255
            Image.fromarray(mask.numpy()).save(tmp_path / f"{i}_mask.png")
            record["mask"] = f"{i}_mask.png"
        lines.append(json.dumps(record))
    (tmp_path / "edits.jsonl").write_text("\n".join(lines) + "\n")
    training = {"prompts_per_iteration": 2, "group_size": 4, "lr": 1e-2, "clip_low": 0.2,
                "skip_zero_std_groups": False}
    if locality:
        training["locality"] = locality
    config = load_config(data={
        "name": name,
        "model": {"family": "flux_kontext", "path": tiny_flux_kontext_dir, "options": IMAGE_OPTIONS,
                  "lora": {"rank": 4, "alpha": 8}},
        "prompts": {"train": str(tmp_path / "edits.jsonl"), "eval": None},
        "sampling": {"num_steps": 4, "eval_num_steps": 4, "rollout_batch_size": 4,
                     "guidance_scale": 3.5},
        "training": training,
        "rewards": {"components": rewards or [{"name": "tests.helpers:Brightness"}],
                    "threaded": False},
        "run": {"output_dir": str(tmp_path / "runs"), "max_iterations": 1, "tracker": "none",
                "progress": False, "checkpoint_every": 0, "eval_every": 0}})
    return Trainer(config)


def test_first_pass_ratio_is_exactly_one_and_lora_loads_in_the_stock_pipeline(tiny_flux_kontext_dir, tmp_path):
    trainer = _kontext_trainer(tiny_flux_kontext_dir, tmp_path, "kontext")
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0

    # LoRA: the stock pipeline's load_lora_weights reproduces the adapter's samples
    model = trainer.policy.model
    perturb_lora(model.transformer)
    trainer.policy.save_weights(str(tmp_path / "lora"))
    images = _sources()
    noise = model.initial_noise(2, torch.Generator().manual_seed(5))
    ours = sample_ode(model, PROMPTS, noise, NUM_STEPS, 3.5, images=images)
    pipe = _stock(tiny_flux_kontext_dir)
    plain = _stock_images(pipe, images, noise, 3.5)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    loaded = _stock_images(pipe, images, noise, 3.5)
    assert (plain - loaded).abs().max() > 1e-4
    torch.testing.assert_close(ours, loaded, atol=1e-3, rtol=0)


def test_locality_masks_reach_the_packed_latents(tiny_flux_kontext_dir, tmp_path):
    """training.locality on Kontext: each JSONL record's mask, downsampled to the VAE grid and
    packed like the latents, splits the replayed steps; the first pass's ratio stays exactly 1."""
    from flowgrpo.edit_regions import downsample_mask
    from pipelines.flux import unpack_latents

    trainer = _kontext_trainer(
        tiny_flux_kontext_dir, tmp_path, "kontext_locality", masks=True,
        locality={"mask": "record", "edit_key": "bright", "keep_key": "dark", "resize": "area"},
        rewards=[{"name": "tests.helpers:Brightness", "options": {"label": "bright"}},
                 {"name": "tests.helpers:Darkness", "options": {"label": "dark"}}])
    model = trainer.policy.model
    records, group_ids, sample_ids = trainer.local_batch(0)
    batch, _, _ = trainer.policy.rollout(records, group_ids, sample_ids, 0)
    latents = batch.replay[0].latents
    assert batch.region_masks.shape == (len(records), *latents.shape[1:])
    grid = downsample_mask(records[0]["mask"][None], (model.latent_height, model.latent_width))
    unpacked = unpack_latents(batch.region_masks[:1], model.latent_height, model.latent_width)
    torch.testing.assert_close(unpacked, grid.expand_as(unpacked))
    assert 0.0 < float(batch.region_masks[0].mean()) < 1.0
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
