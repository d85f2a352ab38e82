"""Wan2.1 adapter: parity with WanPipeline (Euler scheduler with the checkpoint's flow shift),
LoRA round trip, frame-count and size validation, caching."""
from __future__ import annotations

import shutil

import pytest
import torch

from pipelines import load_model
from flowgrpo.model import FlowModel
from tests.pipelines_fixtures import (TINY_MAX_SEQUENCE_LENGTH, VIDEO_OPTIONS, CallCounter,
                                      fail_on_weight_loading, ode_sample, perturb_lora,
                                      tiny_wan_dir)  # noqa: F401  (fixture)

PROMPTS = ["a red cube rolls", "two green spheres bounce"]
NUM_STEPS = 3


@pytest.fixture(scope="module")
def wan(tiny_wan_dir):
    return load_model("wan", tiny_wan_dir, options=VIDEO_OPTIONS)


def _stock_pipeline(directory, shift):
    """WanPipeline with its UniPC scheduler replaced by the Euler one with the same shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    pipe = WanPipeline.from_pretrained(directory)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock_videos(pipe, noise, guidance_scale):
    frames = pipe(PROMPTS, height=VIDEO_OPTIONS["height"], width=VIDEO_OPTIONS["width"],
                  num_frames=VIDEO_OPTIONS["num_frames"], num_inference_steps=NUM_STEPS,
                  guidance_scale=guidance_scale, latents=noise.clone(), output_type="pt",
                  max_sequence_length=TINY_MAX_SEQUENCE_LENGTH).frames
    return frames   # (B, F, 3, H, W)


def test_load_model_returns_a_flow_model(wan):
    assert isinstance(wan, FlowModel) and wan.family == "wan"
    assert wan.pipeline_class.__name__ == "WanPipeline"
    assert wan.shift == 3.0   # the UniPC scheduler config's flow_shift
    assert type(wan.components["scheduler"]).__name__ == "UniPCMultistepScheduler"


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0], ids=["cfg_off", "cfg_on"])
def test_ode_matches_stock_pipeline(wan, tiny_wan_dir, guidance_scale):
    noise = wan.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    assert noise.shape == (2, 16, 2, 4, 4)   # 5 frames -> 2 latent frames, 32 px -> 4
    ours = ode_sample(wan, PROMPTS, noise, NUM_STEPS, guidance_scale)
    reference = _stock_videos(_stock_pipeline(tiny_wan_dir, wan.shift), noise, guidance_scale)
    assert ours.shape == reference.shape == (2, 5, 3, 32, 32)
    assert ((ours > 0) & (ours < 1)).float().mean() > 0.9
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


def test_sigmas_are_the_euler_schedule_with_the_checkpoint_shift(wan):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(20)
    torch.testing.assert_close(wan.sigmas(20), scheduler.sigmas, atol=1e-7, rtol=0)


def test_flow_shift_option_overrides_the_checkpoint(wan, tiny_wan_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = load_model("wan", tiny_wan_dir, options={**VIDEO_OPTIONS, "flow_shift": 5.0})
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    scheduler.set_timesteps(4)
    assert model.shift == 5.0
    torch.testing.assert_close(model.sigmas(4), scheduler.sigmas, atol=1e-7, rtol=0)
    assert (model.sigmas(4) - wan.sigmas(4))[1:-1].min() > 0.01   # more shift: noisier steps


def test_lora_saved_by_adapter_loads_into_stock_pipeline(tiny_wan_dir, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict

    model = load_model("wan", tiny_wan_dir, options=VIDEO_OPTIONS)
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_modules,
                                             init_lora_weights="gaussian"))
    assert perturb_lora(model.transformer) == 2 * 10
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    ours = ode_sample(model, PROMPTS, noise, NUM_STEPS, 5.0)
    model.save_lora_weights(str(tmp_path), get_peft_model_state_dict(model.transformer))
    pipe = _stock_pipeline(tiny_wan_dir, model.shift)
    without_lora = _stock_videos(pipe, noise, 5.0)
    pipe.load_lora_weights(str(tmp_path))
    with_lora = _stock_videos(pipe, noise, 5.0)
    assert (with_lora - without_lora).abs().max() > 1e-3
    torch.testing.assert_close(ours, with_lora, atol=1e-5, rtol=0)


def test_prompt_embeddings_are_cached_per_prompt(tiny_wan_dir):
    model = load_model("wan", tiny_wan_dir, options=VIDEO_OPTIONS)
    counter = CallCounter([model.components["text_encoder"]])
    try:
        cond = model.encode_prompts(["a", "b", "a"])
        assert counter.calls == 2   # ["a", "b"] in one call, then the negative ""
        model.encode_prompts(["b"])
        assert counter.calls == 2
    finally:
        counter.remove()
    assert cond.positive["prompt_embeds"].shape == (3, TINY_MAX_SEQUENCE_LENGTH, 32)
    assert cond.negative["prompt_embeds"].shape == (3, TINY_MAX_SEQUENCE_LENGTH, 32)


def test_decode_returns_frames_first_videos_in_unit_range(wan):
    latents = 30.0 * torch.randn(1, *wan.latent_shape, generator=torch.Generator().manual_seed(0))
    videos = wan.decode(latents)
    assert videos.shape == (1, 5, 3, 32, 32) and videos.dtype == torch.float32
    assert videos.min() >= 0 and videos.max() <= 1


@pytest.mark.parametrize("frames, hint", [(4, "try 1 or 5"), (80, "try 77 or 81"), (0, "try 1")])
def test_frame_count_must_be_4k_plus_1(tiny_wan_dir, monkeypatch, frames, hint):
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match=rf"num_frames must be 4k \+ 1.*{hint}"):
        load_model("wan", tiny_wan_dir, options={**VIDEO_OPTIONS, "num_frames": frames})


def test_errors_are_raised_before_weights_load(tiny_wan_dir, tmp_path, monkeypatch):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_wan_dir, incomplete)
    shutil.rmtree(incomplete / "vae")
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="vae/config.json"):
        load_model("wan", incomplete, options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match="width must be divisible by 16"):
        load_model("wan", tiny_wan_dir, options={**VIDEO_OPTIONS, "width": 40})
    with pytest.raises(ValueError, match=r"unknown wan option\(s\) \['frames'\]"):
        load_model("wan", tiny_wan_dir, options={"frames": 5})


def test_vae_slicing_and_tiling_switches(tiny_wan_dir, wan):
    model = load_model("wan", tiny_wan_dir, options={**VIDEO_OPTIONS, "vae_slicing": True, "vae_tiling": True})
    assert model.vae.use_slicing and model.vae.use_tiling
    assert not wan.vae.use_slicing and not wan.vae.use_tiling
    latents = torch.randn(2, *wan.latent_shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.decode(latents), wan.decode(latents), atol=1e-5, rtol=0)
