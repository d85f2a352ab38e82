"""LTX-2 adapter: parity with LTX2Pipeline from the same latents (video latents, pixels, audio
latents and waveform; without and with CFG, and with the audio's own CFG scale), the joint
[video; audio] sample, the dynamic-shift schedule, the Gemma text through the connectors, LoRA
round trip through the stock loader, on-policy first pass, validation before loading."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo.model import FlowModel
from pipelines import load_model
from tests.helpers import family_config
from tests.pipeline_helpers import (VIDEO_OPTIONS, CallCounter, fail_on_weight_loading,
                                    perturb_lora)

PROMPTS = ["a red cube rolls", "two green spheres bounce"]
NUM_STEPS = 3
FRAME_RATE = 24.0   # the adapter's default, LTX2Pipeline's


@pytest.fixture(scope="module")
def ltx2(tiny_ltx2_dir):
    return load_model("ltx2", tiny_ltx2_dir, options=VIDEO_OPTIONS)


def _stock_pipeline(directory):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock(pipe, model, noise, guidance_scale, audio_guidance_scale=None, output_type="pt"):
    """LTX2Pipeline.__call__ from the adapter's noise (B, S_v + S_a, D): the packed video tokens as
    ``latents`` (taken as they are) and the audio tokens un-normalised as ``audio_latents`` (the
    pipeline normalises them); spatio-temporal and modality guidance and the rescale off."""
    video, audio = model.split_streams(noise)
    audio_vae = pipe.audio_vae
    audio = audio * audio_vae.latents_std + audio_vae.latents_mean
    return pipe(PROMPTS, negative_prompt="", height=VIDEO_OPTIONS["height"], width=VIDEO_OPTIONS["width"],
                num_frames=VIDEO_OPTIONS["num_frames"], frame_rate=FRAME_RATE,
                num_inference_steps=NUM_STEPS, guidance_scale=guidance_scale,
                audio_guidance_scale=audio_guidance_scale or guidance_scale,
                stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
                guidance_rescale=0.0, audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None,
                latents=video.clone(), audio_latents=audio.clone(), output_type=output_type,
                max_sequence_length=VIDEO_OPTIONS["max_sequence_length"])


@torch.no_grad()
def _ode_latents(model, noise, guidance_scale):
    """Euler ODE through the FlowModel interface: the final sample (B, S_v + S_a, D)."""
    cond = model.encode_prompts(PROMPTS)
    sigmas = model.sigmas(NUM_STEPS)
    x = noise.clone()
    for i in range(NUM_STEPS):
        v = model.velocity(x, sigmas[i].expand(x.shape[0]), cond, guidance_scale)
        x = x + v * (sigmas[i + 1] - sigmas[i])
    return x


def test_load_model_returns_a_flow_model(ltx2):
    assert isinstance(ltx2, FlowModel) and ltx2.family == "ltx2"
    assert ltx2.pipeline_class.__name__ == "LTX2Pipeline"
    # 5 frames -> 3 latent frames (VAE 2x temporal), 32 px -> 8 (4x): 192 video tokens; audio:
    # round(5 / 24 s x 16000 / 160 / 4) = 5 latent frames of 2 channels x 8/4 mel bins
    assert (ltx2.latent_frames, ltx2.latent_height, ltx2.latent_width) == (3, 8, 8)
    assert ltx2.audio_frames == round(5 / FRAME_RATE * 16000 / 160 / 4) == 5
    assert ltx2.latent_shape == (192 + 5, 4)
    assert ltx2.initial_noise(2, torch.Generator().manual_seed(0)).shape == (2, 197, 4)


@pytest.mark.parametrize("guidance_scale, audio_guidance_scale", [(1.0, None), (3.0, None), (3.0, 7.0)])
def test_ode_matches_stock_pipeline(tiny_ltx2_dir, guidance_scale, audio_guidance_scale):
    """Latents of both streams, pixels and the vocoder's waveform equal LTX2Pipeline's."""
    model = load_model("ltx2", tiny_ltx2_dir,
                       options={**VIDEO_OPTIONS, "audio_guidance_scale": audio_guidance_scale})
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    x = _ode_latents(model, noise, guidance_scale)
    pipe = _stock_pipeline(tiny_ltx2_dir)
    latents = _stock(pipe, model, noise, guidance_scale, audio_guidance_scale, output_type="latent")
    torch.testing.assert_close(model.video_latents(x), latents.frames, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.audio_latents(x), latents.audio, atol=1e-5, rtol=0)
    decoded = _stock(pipe, model, noise, guidance_scale, audio_guidance_scale)
    videos = model.decode(x)
    assert videos.shape == decoded.frames.shape == (2, 5, 3, 32, 32)
    assert ((videos > 0) & (videos < 1)).float().mean() > 0.5
    torch.testing.assert_close(videos, decoded.frames, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.decode_audio(x), decoded.audio, atol=1e-5, rtol=0)


def test_cfg_scales_each_stream_in_one_forward(tiny_ltx2_dir, ltx2):
    """With audio_guidance_scale set, one batched forward per step gives the video tokens the
    video's CFG and the audio tokens the audio's: each equals the run with that scale on both."""
    model = load_model("ltx2", tiny_ltx2_dir, options={**VIDEO_OPTIONS, "audio_guidance_scale": 7.0})
    cond = model.encode_prompts(PROMPTS)
    assert cond.negative is not None
    x = model.initial_noise(2, torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.6, 0.6])
    counter = CallCounter([model.transformer])
    with torch.no_grad():
        mixed = model.velocity(x, sigma, cond, 3.0)
    counter.remove()
    assert counter.calls == 1
    with torch.no_grad():
        video_scale = ltx2.velocity(x, sigma, ltx2.encode_prompts(PROMPTS), 3.0)
        audio_scale = ltx2.velocity(x, sigma, ltx2.encode_prompts(PROMPTS), 7.0)
    torch.testing.assert_close(mixed[:, :192], video_scale[:, :192], atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed[:, 192:], audio_scale[:, 192:], atol=1e-6, rtol=0)
    assert (video_scale[:, 192:] - audio_scale[:, 192:]).abs().max() > 1e-3


def test_the_streams_see_each_other(ltx2):
    """The video velocity depends on the audio tokens and the other way round (the transformer's
    audio-to-video and video-to-audio attention): the two are one sample."""
    cond = ltx2.encode_prompts(PROMPTS[:1])
    x = ltx2.initial_noise(1, torch.Generator().manual_seed(2))
    other_audio, other_video = x.clone(), x.clone()
    other_audio[:, 192:] += 1.0
    other_video[:, :192] += 1.0
    with torch.no_grad():
        base = ltx2.velocity(x, torch.tensor([0.5]), cond, 1.0)
        audio_changed = ltx2.velocity(other_audio, torch.tensor([0.5]), cond, 1.0)
        video_changed = ltx2.velocity(other_video, torch.tensor([0.5]), cond, 1.0)
    assert (base[:, :192] - audio_changed[:, :192]).abs().max() > 1e-5
    assert (base[:, 192:] - video_changed[:, 192:]).abs().max() > 1e-5


def test_sigmas_are_the_pipelines_dynamic_shift(ltx2, tiny_ltx2_dir):
    """linspace(1, 1/N, N) through the scheduler with mu from the 192 video tokens: LTX-2's
    exponential shift exp(mu) / (exp(mu) + 1/t - 1), stretched so the last step's sigma is the
    shift_terminal 0.1, then 0; what the pipeline's scheduler steps through."""
    pipe = _stock_pipeline(tiny_ltx2_dir)
    noise = ltx2.initial_noise(2, torch.Generator().manual_seed(0))
    _stock(pipe, ltx2, noise, 1.0, output_type="latent")
    assert torch.equal(ltx2.sigmas(NUM_STEPS), pipe.scheduler.sigmas)
    mu = 0.95 + (2.05 - 0.95) / (4096 - 1024) * (192 - 1024)
    t = np.linspace(1.0, 1.0 / 8, 8)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / t - 1))
    stretched = 1 - (1 - shifted) / ((1 - shifted[-1]) / (1 - 0.1))
    expected = torch.tensor(np.append(stretched, 0.0), dtype=torch.float64)
    torch.testing.assert_close(ltx2.sigmas(8).double(), expected, atol=1e-6, rtol=0)
    assert ltx2.sigmas(8)[-2].item() == pytest.approx(0.1, abs=1e-6)


def test_text_goes_through_gemma_and_the_connectors(ltx2):
    """Each prompt: Gemma's states of every layer (left-padded, <bos> first) through the
    connectors, equal to the pipeline's own encode_prompt + connectors, row by row whatever the
    batch; the mask marks the tokens."""
    prompts = ["a cat", "a red dog"]   # shorter than the 16 tokens (one a character here)
    pipe = ltx2.pipeline_class(transformer=None, **ltx2.components)
    embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                            max_sequence_length=16, device="cpu")
    assert embeds.shape == (2, 16, 32 * 3)   # width 32 x (embeddings + 2 layers)
    tokenizer = ltx2.components["tokenizer"]
    assert tokenizer("a cat").input_ids[0] == tokenizer.bos_token_id
    assert mask.sum(dim=1).tolist() == [len(tokenizer(p).input_ids) for p in prompts] == [6, 10]
    assert mask[0, -1] == 1 and mask[0, :10].eq(0).all()   # left padding
    video, audio, connector_mask = ltx2.components["connectors"](embeds, mask, padding_side="left")
    cond = ltx2.encode_prompts([prompts[1], prompts[0]])
    torch.testing.assert_close(cond.positive["video_text"], video.flip(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(cond.positive["audio_text"], audio.flip(0), atol=1e-6, rtol=0)
    assert torch.equal(cond.positive["text_mask"], connector_mask.flip(0).float())


def test_prompt_embeddings_are_cached_per_prompt(tiny_ltx2_dir):
    model = load_model("ltx2", tiny_ltx2_dir, options={**VIDEO_OPTIONS, "cfg": False})
    counter = CallCounter([model.components["text_encoder"], model.components["connectors"]])
    try:
        cond = model.encode_prompts(["a", "b", "a"])
        assert counter.calls == 2   # ["a", "b"] once through Gemma and once through the connectors
        model.encode_prompts(["b"])
        assert counter.calls == 2
    finally:
        counter.remove()
    torch.testing.assert_close(cond.positive["video_text"][0], cond.positive["video_text"][2])
    model.free_text_encoders()
    assert model.components["connectors"] is None   # only encoding needs them
    with pytest.raises(ValueError, match="text encoders were freed"):
        model.encode_prompts(["c"])


def test_lora_saved_by_adapter_loads_into_stock_pipeline(tiny_ltx2_dir, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict

    model = load_model("ltx2", tiny_ltx2_dir, options=VIDEO_OPTIONS)
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_modules,
                                             init_lora_weights="gaussian"))
    assert perturb_lora(model.transformer) == 28 * 2   # Flow-Factory's 28 layers a block, 2 blocks
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    ours = model.decode(_ode_latents(model, noise, 3.0))
    model.save_lora_weights(str(tmp_path), get_peft_model_state_dict(model.transformer))
    pipe = _stock_pipeline(tiny_ltx2_dir)
    without_lora = _stock(pipe, model, noise, 3.0).frames
    pipe.load_lora_weights(str(tmp_path))
    with_lora = _stock(pipe, model, noise, 3.0).frames
    assert (with_lora - without_lora).abs().max() > 1e-3
    torch.testing.assert_close(ours, with_lora, atol=1e-5, rtol=0)


def test_decode_returns_frames_first_videos_in_unit_range(ltx2):
    latents = 30.0 * torch.randn(1, *ltx2.latent_shape, generator=torch.Generator().manual_seed(0))
    videos = ltx2.decode(latents)
    assert videos.shape == (1, 5, 3, 32, 32) and videos.dtype == torch.float32
    assert videos.min() >= 0 and videos.max() <= 1
    waveform = ltx2.decode_audio(latents)
    assert waveform.shape[:2] == (1, 2) and torch.isfinite(waveform).all()


def test_default_size_is_the_pipelines():
    from pipelines.ltx2 import default_size

    assert default_size() == {"height": 512, "width": 768, "num_frames": 121, "frame_rate": 24.0}


@pytest.mark.parametrize("frames, hint", [(4, "try 3 or 5"), (0, "try 1")])
def test_frame_count_must_fit_the_vae(tiny_ltx2_dir, monkeypatch, frames, hint):
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match=rf"num_frames must be 2k \+ 1 for ltx2.*{hint}"):
        load_model("ltx2", tiny_ltx2_dir, options={**VIDEO_OPTIONS, "num_frames": frames})


def test_errors_are_raised_before_weights_load(tiny_ltx2_dir, tmp_path, monkeypatch):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_ltx2_dir, incomplete)
    shutil.rmtree(incomplete / "audio_vae")
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="audio_vae/config.json"):
        load_model("ltx2", incomplete, options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match="width must be divisible by 32"):
        load_model("ltx2", tiny_ltx2_dir, options={**VIDEO_OPTIONS, "width": 48})
    with pytest.raises(ValueError, match="frame_rate must be > 0"):
        load_model("ltx2", tiny_ltx2_dir, options={**VIDEO_OPTIONS, "frame_rate": 0.0})
    with pytest.raises(ValueError, match=r"unknown ltx2 option\(s\) \['stg_scale'\]"):
        load_model("ltx2", tiny_ltx2_dir, options={"stg_scale": 1.0})
    # audio tokens of another width than the video's: one sample cannot hold both
    shutil.copytree(Path(tiny_ltx2_dir) / "audio_vae", incomplete / "audio_vae")
    config_file = incomplete / "audio_vae" / "config.json"
    config = json.loads(config_file.read_text())
    config["latent_channels"] = 4
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="video tokens are 4 wide and its audio tokens 8"):
        load_model("ltx2", incomplete, options=VIDEO_OPTIONS)


# ------------------------------------------------------------------------------- training
def test_first_pass_ratio_is_one(tiny_ltx2_dir, tmp_path):
    """The recipe's method in small (CPS on a random window of steps) with CFG on both streams:
    the first pass over each rollout is exactly on-policy."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(family_config(
        "ltx2", tiny_ltx2_dir, tmp_path, {**VIDEO_OPTIONS, "audio_guidance_scale": 5.0},
        "sampling.kind=cps", "sampling.noise_level=0.8", "sampling.plan.kind=window",
        "sampling.plan.window_size=2", "sampling.plan.window_strategy=random",
        guidance_scale=3.0))
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
