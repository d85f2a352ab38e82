"""FLUX.1 adapter: parity with FluxPipeline (packing, dynamic shift, guidance embedding), LoRA
round trip, validation, caching."""
from __future__ import annotations

import shutil

import pytest
import torch

from pipelines import load_model
from flowgrpo.model import FlowModel
from pipelines.flux import latent_image_ids, pack_latents, unpack_latents
from tests.pipeline_helpers import (IMAGE_OPTIONS, TINY_MAX_SEQUENCE_LENGTH, CallCounter,
                                    fail_on_weight_loading, ode_sample, perturb_lora)

PROMPTS = ["a red cube", "two green spheres"]
NUM_STEPS = 4


@pytest.fixture(scope="module")
def flux(tiny_flux_dir):
    return load_model("flux", tiny_flux_dir, options=IMAGE_OPTIONS)


def _stock_pipeline(directory):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock_images(pipe, guidance_scale, noise=None, generator=None):
    return pipe(PROMPTS, height=IMAGE_OPTIONS["height"], width=IMAGE_OPTIONS["width"],
                num_inference_steps=NUM_STEPS, guidance_scale=guidance_scale,
                latents=None if noise is None else noise.clone(), generator=generator,
                output_type="pt", max_sequence_length=TINY_MAX_SEQUENCE_LENGTH).images


def test_load_model_returns_a_flow_model(flux):
    assert isinstance(flux, FlowModel) and flux.family == "flux"
    assert flux.pipeline_class.__name__ == "FluxPipeline"


@pytest.mark.parametrize("guidance_scale", [1.0, 3.5], ids=["guidance_1", "guidance_3.5"])
def test_ode_matches_stock_pipeline(flux, tiny_flux_dir, guidance_scale):
    noise = flux.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    ours = ode_sample(flux, PROMPTS, noise, NUM_STEPS, guidance_scale)
    reference = _stock_images(_stock_pipeline(tiny_flux_dir), guidance_scale, noise=noise)
    assert ours.shape == reference.shape == (2, 3, IMAGE_OPTIONS["height"], IMAGE_OPTIONS["width"])
    assert ((ours > 0) & (ours < 1)).float().mean() > 0.9
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


def test_guidance_scale_feeds_the_embedding(flux):
    x = flux.initial_noise(2, torch.Generator().manual_seed(1))
    cond = flux.encode_prompts(PROMPTS)
    assert cond.negative is None   # guidance-distilled: no real CFG
    with torch.no_grad():
        v1 = flux.velocity(x, torch.tensor([0.8, 0.3]), cond, 1.0)
        v35 = flux.velocity(x, torch.tensor([0.8, 0.3]), cond, 3.5)
    assert (v1 - v35).abs().max() > 1e-4


def test_initial_noise_is_what_the_pipeline_draws_from_the_same_generator(flux, tiny_flux_dir):
    noise = flux.initial_noise(len(PROMPTS), torch.Generator().manual_seed(7))
    assert noise.shape == (2, (32 // 16) ** 2, 64) and noise.dtype == torch.float32
    pipe = _stock_pipeline(tiny_flux_dir)
    from_generator = _stock_images(pipe, 3.5, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(_stock_images(pipe, 3.5, noise=noise), from_generator, atol=0, rtol=0)


def test_packing_round_trip_and_layout():
    latents = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(2, 3, 4, 6)
    tokens = pack_latents(latents)
    assert tokens.shape == (2, 2 * 3, 12)
    # token 1 is the patch at row 0, columns 2..3; features are (channel, dy, dx)
    torch.testing.assert_close(tokens[0, 1, :4], latents[0, 0, 0:2, 2:4].reshape(-1))
    assert torch.equal(unpack_latents(tokens, 4, 6), latents)
    ids = latent_image_ids(4, 6)
    assert ids.shape == (6, 3) and ids[1].tolist() == [0.0, 0.0, 1.0] and ids[3].tolist() == [0.0, 1.0, 0.0]


def test_sigmas_use_the_dynamic_shift_of_the_packed_sequence_length(flux):
    import math

    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    sigmas = flux.sigmas(6)
    seq_len = (32 // 16) ** 2
    mu = 0.5 + (1.15 - 0.5) * (seq_len - 256) / (4096 - 256)
    grid = torch.linspace(1.0, 1.0 / 6, 6, dtype=torch.float64)
    expected = math.exp(mu) / (math.exp(mu) + 1.0 / grid - 1.0)
    torch.testing.assert_close(sigmas, torch.cat([expected.float(), torch.zeros(1)]), atol=1e-6, rtol=0)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(flux.scheduler_config)
    scheduler.set_timesteps(6, sigmas=np.linspace(1.0, 1.0 / 6, 6), mu=mu)
    torch.testing.assert_close(sigmas, scheduler.sigmas, atol=1e-6, rtol=0)


def test_lora_targets_cover_single_blocks_but_not_the_final_projection(tiny_flux_dir):
    from peft import LoraConfig

    model = load_model("flux", tiny_flux_dir, options=IMAGE_OPTIONS)
    assert "proj_out" not in model.lora_target_modules
    model.transformer.add_adapter(LoraConfig(r=2, target_modules=model.lora_target_modules))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.transformer.named_modules() if n.endswith("lora_A")}
    assert "single_transformer_blocks.1.proj_out" in wrapped and "single_transformer_blocks.0.proj_mlp" in wrapped
    assert "single_transformer_blocks.0.attn.to_q" in wrapped and "transformer_blocks.0.ff.net.2" in wrapped
    assert "proj_out" not in wrapped and "transformer_blocks.0.norm1.linear" not in wrapped


def test_lora_saved_by_adapter_loads_into_stock_pipeline(tiny_flux_dir, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict

    model = load_model("flux", tiny_flux_dir, options=IMAGE_OPTIONS)
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=model.lora_target_modules,
                                             init_lora_weights="gaussian"))
    assert perturb_lora(model.transformer) == 12 + 2 * 5
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    ours = ode_sample(model, PROMPTS, noise, NUM_STEPS, 3.5)
    model.save_lora_weights(str(tmp_path), get_peft_model_state_dict(model.transformer))
    pipe = _stock_pipeline(tiny_flux_dir)
    without_lora = _stock_images(pipe, 3.5, noise=noise)
    pipe.load_lora_weights(str(tmp_path))
    with_lora = _stock_images(pipe, 3.5, noise=noise)
    assert (with_lora - without_lora).abs().max() > 1e-2
    torch.testing.assert_close(ours, with_lora, atol=1e-5, rtol=0)


def test_prompt_embeddings_are_cached_per_prompt(tiny_flux_dir):
    model = load_model("flux", tiny_flux_dir, options=IMAGE_OPTIONS)
    counter = CallCounter([model.components["text_encoder"], model.components["text_encoder_2"]])
    try:
        cond = model.encode_prompts(["a", "b", "a"])
        assert counter.calls == 2   # one batched call per encoder, no negative prompt
        model.encode_prompts(["b", "a"])
        assert counter.calls == 2
    finally:
        counter.remove()
    assert cond.positive["prompt_embeds"].shape == (3, TINY_MAX_SEQUENCE_LENGTH, 32)
    assert cond.positive["pooled_prompt_embeds"].shape == (3, 16)
    assert torch.equal(cond.extra["text_ids"], torch.zeros(TINY_MAX_SEQUENCE_LENGTH, 3))


def test_decode_range(flux):
    images = flux.decode(30.0 * torch.randn(2, *flux.packed_shape, generator=torch.Generator().manual_seed(0)))
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1


def test_errors_are_raised_before_weights_load(tiny_flux_dir, tmp_path, monkeypatch):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_flux_dir, incomplete)
    shutil.rmtree(incomplete / "tokenizer_2")
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="tokenizer_2/tokenizer_config.json"):
        load_model("flux", incomplete, options=IMAGE_OPTIONS)
    with pytest.raises(ValueError, match="height must be divisible by 16"):
        load_model("flux", tiny_flux_dir, options={**IMAGE_OPTIONS, "height": 24})
    with pytest.raises(ValueError, match=r"unknown flux option\(s\) \['cfg'\]"):
        load_model("flux", tiny_flux_dir, options={**IMAGE_OPTIONS, "cfg": True})
