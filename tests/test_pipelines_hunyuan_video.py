"""HunyuanVideo adapter: parity with HunyuanVideoPipeline (its guidance embedding and its
shift(linspace) schedule), the Llama template crop, LoRA round trip through the stock loader,
on-policy first pass, frame-count and size validation, caching."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo.model import FlowModel
from pipelines import load_model
from tests.helpers import family_config
from tests.pipeline_helpers import (TINY_MAX_SEQUENCE_LENGTH, VIDEO_OPTIONS, CallCounter,
                                    fail_on_weight_loading, ode_sample, perturb_lora)

PROMPTS = ["a red cube rolls", "two green spheres bounce"]
NUM_STEPS = 3


@pytest.fixture(scope="module")
def hunyuan(tiny_hunyuan_video_dir):
    return load_model("hunyuan_video", tiny_hunyuan_video_dir, options=VIDEO_OPTIONS)


def _stock_pipeline(directory):
    from diffusers import HunyuanVideoPipeline

    pipe = HunyuanVideoPipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock_videos(pipe, noise, guidance_scale):
    return pipe(PROMPTS, height=VIDEO_OPTIONS["height"], width=VIDEO_OPTIONS["width"],
                num_frames=VIDEO_OPTIONS["num_frames"], num_inference_steps=NUM_STEPS,
                guidance_scale=guidance_scale, latents=noise.clone(), output_type="pt",
                max_sequence_length=TINY_MAX_SEQUENCE_LENGTH).frames   # (B, F, 3, H, W)


def test_load_model_returns_a_flow_model(hunyuan):
    assert isinstance(hunyuan, FlowModel) and hunyuan.family == "hunyuan_video"
    assert hunyuan.pipeline_class.__name__ == "HunyuanVideoPipeline"
    assert hunyuan.shift == 7.0   # the checkpoint scheduler's static shift
    assert hunyuan.latent_shape == (16, 2, 4, 4)   # 5 frames -> 2 latent frames, 32 px -> 4


@pytest.mark.parametrize("guidance_scale", [6.0, 1.0])
def test_ode_matches_stock_pipeline(hunyuan, tiny_hunyuan_video_dir, guidance_scale):
    noise = hunyuan.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    assert noise.shape == (2, 16, 2, 4, 4)
    ours = ode_sample(hunyuan, PROMPTS, noise, NUM_STEPS, guidance_scale)
    reference = _stock_videos(_stock_pipeline(tiny_hunyuan_video_dir), noise, guidance_scale)
    assert ours.shape == reference.shape == (2, 5, 3, 32, 32)
    assert ((ours > 0) & (ours < 1)).float().mean() > 0.5
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


def test_guidance_scale_feeds_the_guidance_embedding(hunyuan):
    """One forward per step whatever the scale, and the scale changes the velocity (distilled
    guidance, not CFG)."""
    cond = hunyuan.encode_prompts(PROMPTS)
    assert cond.negative is None
    x = hunyuan.initial_noise(2, torch.Generator().manual_seed(1))
    counter = CallCounter([hunyuan.transformer])
    try:
        with torch.no_grad():
            low = hunyuan.velocity(x, torch.tensor([0.7, 0.7]), cond, 1.0)
            high = hunyuan.velocity(x, torch.tensor([0.7, 0.7]), cond, 6.0)
    finally:
        counter.remove()
    assert counter.calls == 2
    assert (low - high).abs().max() > 1e-4


def test_sigmas_are_the_pipelines_shifted_linspace(hunyuan):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, 17)[:-1])
    assert torch.equal(hunyuan.sigmas(16), scheduler.sigmas)   # bit-identical, timesteps too
    assert torch.equal(1000.0 * hunyuan.sigmas(16)[:-1], scheduler.timesteps)
    grid = torch.linspace(1.0, 0.0, 17, dtype=torch.float64)
    torch.testing.assert_close(hunyuan.sigmas(16).double(), 7.0 * grid / (1 + 6.0 * grid),
                               atol=1e-6, rtol=0)


def test_flow_shift_option_overrides_the_checkpoint(tiny_hunyuan_video_dir, hunyuan):
    model = load_model("hunyuan_video", tiny_hunyuan_video_dir, options={**VIDEO_OPTIONS, "flow_shift": 5.0})
    assert model.shift == 5.0
    sigma = torch.linspace(1.0, 0.0, 5, dtype=torch.float64)
    torch.testing.assert_close(model.sigmas(4).double(), 5.0 * sigma / (1 + 4.0 * sigma), atol=1e-6, rtol=0)
    assert (hunyuan.sigmas(4) - model.sigmas(4))[1:-1].min() > 0.01   # less shift: less noisy


def test_template_prefix_is_cropped_and_masked(hunyuan):
    """The tiny Llama-3 tokenizer splits the template before the prompt into exactly the 95
    tokens the pipeline crops, so the text starts at the prompt; the mask marks its tokens."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    tokenizer = hunyuan.components["tokenizer"]
    template = DEFAULT_PROMPT_TEMPLATE["template"]
    prefix = tokenizer(template.split("{}")[0]).input_ids
    assert len(prefix) == DEFAULT_PROMPT_TEMPLATE["crop_start"] == 95
    full = tokenizer(template.format("a cat")).input_ids
    assert full[:95] == prefix and tokenizer.decode(full[95:]).startswith("a cat")
    cond = hunyuan.encode_prompts(["a cat", "a red cube rolls"])
    mask = cond.positive["prompt_attention_mask"]
    assert cond.positive["prompt_embeds"].shape == (2, TINY_MAX_SEQUENCE_LENGTH, 32)
    assert cond.positive["pooled_prompt_embeds"].shape == (2, 16)
    # the prompt's tokens and the template's closing <|eot_id|>, then right padding
    lengths = [len(tokenizer(template.format(p)).input_ids) - 95 for p in ["a cat", "a red cube rolls"]]
    assert mask.sum(dim=1).tolist() == lengths and lengths[0] < lengths[1]
    assert mask[0, :lengths[0]].eq(1).all() and mask[0, lengths[0]:].eq(0).all()


def test_lora_saved_by_adapter_loads_into_stock_pipeline(tiny_hunyuan_video_dir, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict

    model = load_model("hunyuan_video", tiny_hunyuan_video_dir, options=VIDEO_OPTIONS)
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_modules,
                                             init_lora_weights="gaussian"))
    # double block: 12 (FLUX's); single block: q, k, v, proj_mlp, proj_out; token refiner:
    # q, k, v, out and its two feed-forward layers
    assert perturb_lora(model.transformer) == 12 + 5 + 6
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    ours = ode_sample(model, PROMPTS, noise, NUM_STEPS, 6.0)
    model.save_lora_weights(str(tmp_path), get_peft_model_state_dict(model.transformer))
    pipe = _stock_pipeline(tiny_hunyuan_video_dir)
    without_lora = _stock_videos(pipe, noise, 6.0)
    pipe.load_lora_weights(str(tmp_path))
    with_lora = _stock_videos(pipe, noise, 6.0)
    assert (with_lora - without_lora).abs().max() > 1e-3
    torch.testing.assert_close(ours, with_lora, atol=1e-5, rtol=0)


def test_prompt_embeddings_are_cached_per_prompt(tiny_hunyuan_video_dir):
    model = load_model("hunyuan_video", tiny_hunyuan_video_dir, options=VIDEO_OPTIONS)
    counter = CallCounter([model.components["text_encoder"], model.components["text_encoder_2"]])
    try:
        cond = model.encode_prompts(["a", "b", "a"])
        assert counter.calls == 2   # ["a", "b"] once through each encoder; no negative prompt
        model.encode_prompts(["b"])
        assert counter.calls == 2
    finally:
        counter.remove()
    assert cond.positive["prompt_embeds"].shape == (3, TINY_MAX_SEQUENCE_LENGTH, 32)
    torch.testing.assert_close(cond.positive["prompt_embeds"][0], cond.positive["prompt_embeds"][2])


def test_decode_returns_frames_first_videos_in_unit_range(hunyuan):
    latents = 30.0 * torch.randn(1, *hunyuan.latent_shape, generator=torch.Generator().manual_seed(0))
    videos = hunyuan.decode(latents)
    assert videos.shape == (1, 5, 3, 32, 32) and videos.dtype == torch.float32
    assert videos.min() >= 0 and videos.max() <= 1


def test_default_size_is_the_pipelines():
    from pipelines.hunyuan_video import default_size

    assert default_size() == {"height": 720, "width": 1280, "num_frames": 129}


@pytest.mark.parametrize("frames, hint", [(4, "try 1 or 5"), (52, "try 49 or 53"), (0, "try 1")])
def test_frame_count_must_be_4k_plus_1(tiny_hunyuan_video_dir, monkeypatch, frames, hint):
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match=rf"num_frames must be 4k \+ 1 for hunyuan_video.*{hint}"):
        load_model("hunyuan_video", tiny_hunyuan_video_dir, options={**VIDEO_OPTIONS, "num_frames": frames})


def test_errors_are_raised_before_weights_load(tiny_hunyuan_video_dir, tmp_path, monkeypatch):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_hunyuan_video_dir, incomplete)
    shutil.rmtree(incomplete / "text_encoder_2")
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="text_encoder_2/config.json"):
        load_model("hunyuan_video", incomplete, options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match="width must be divisible by 16"):
        load_model("hunyuan_video", tiny_hunyuan_video_dir, options={**VIDEO_OPTIONS, "width": 40})
    with pytest.raises(ValueError, match="flow_shift must be > 0"):
        load_model("hunyuan_video", tiny_hunyuan_video_dir, options={**VIDEO_OPTIONS, "flow_shift": 0.0})
    scheduler_config = incomplete / "scheduler" / "scheduler_config.json"
    scheduler_config.write_text(scheduler_config.read_text().replace(
        '"use_dynamic_shifting": false', '"use_dynamic_shifting": true'))
    shutil.copytree(Path(tiny_hunyuan_video_dir) / "text_encoder_2", incomplete / "text_encoder_2")
    with pytest.raises(ValueError, match=r"scheduler config sets \['use_dynamic_shifting'\]"):
        load_model("hunyuan_video", incomplete, options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match=r"unknown hunyuan_video option\(s\) \['guidance_scale'\]"):
        load_model("hunyuan_video", tiny_hunyuan_video_dir, options={"guidance_scale": 6.0})


# ------------------------------------------------------------------------------- training
def _train_config(path, tmp_path, *overrides: str, iterations: int = 1):
    return family_config("hunyuan_video", path, tmp_path, VIDEO_OPTIONS, *overrides, guidance_scale=6.0,
                         iterations=iterations)


def test_first_pass_ratio_is_one(tiny_hunyuan_video_dir, tmp_path):
    """The recipe's method in small: DanceGRPO's SDE with the guidance embedding, a group's
    shared initial noise, int(N x 0.6) steps trained, drawn per group; the first pass over each
    rollout is exactly on-policy."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(_train_config(
        tiny_hunyuan_video_dir, tmp_path, "sampling.kind=dance_sde", "sampling.noise_level=0.25",
        "sampling.share_initial_noise=true", "sampling.plan.kind=full",
        "sampling.plan.train_fraction=0.6", "sampling.plan.train_select=random"))
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
