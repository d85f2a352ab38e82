"""SD3 adapter: parity with StableDiffusion3Pipeline, LoRA round trip, validation, caching."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from pipelines import MODEL_FAMILIES, load_model
from flowgrpo.model import FlowModel
from pipelines.sd3 import SD3_LORA_TARGET_MODULES, SD3Model
from tests.pipeline_helpers import (IMAGE_OPTIONS, TINY_MAX_SEQUENCE_LENGTH, CallCounter,
                                    fail_on_weight_loading, ode_sample, perturb_lora)

PROMPTS = ["a red cube", "two green spheres"]
NUM_STEPS = 4


@pytest.fixture(scope="module")
def sd3(tiny_sd3_dir):
    return load_model("sd3", tiny_sd3_dir, options=IMAGE_OPTIONS)


def _stock_pipeline(directory, **components):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(directory, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock_images(pipe, noise, guidance_scale):
    return pipe(PROMPTS, height=IMAGE_OPTIONS["height"], width=IMAGE_OPTIONS["width"],
                num_inference_steps=NUM_STEPS, guidance_scale=guidance_scale, latents=noise.clone(),
                output_type="pt", max_sequence_length=TINY_MAX_SEQUENCE_LENGTH).images


def test_load_model_returns_a_flow_model(sd3):
    assert isinstance(sd3, FlowModel)
    assert sd3.family == "sd3" and sd3.dtype == torch.float32 and sd3.device == torch.device("cpu")
    assert sd3.pipeline_class.__name__ == "StableDiffusion3Pipeline"
    assert sd3.lora_target_modules == SD3_LORA_TARGET_MODULES


@pytest.mark.parametrize("guidance_scale", [1.0, 4.5], ids=["cfg_off", "cfg_on"])
def test_ode_matches_stock_pipeline(sd3, tiny_sd3_dir, guidance_scale):
    noise = sd3.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    ours = ode_sample(sd3, PROMPTS, noise, NUM_STEPS, guidance_scale)
    reference = _stock_images(_stock_pipeline(tiny_sd3_dir), noise, guidance_scale)
    assert ours.shape == reference.shape == (2, 3, IMAGE_OPTIONS["height"], IMAGE_OPTIONS["width"])
    # the tiny model's output is not saturated, so the comparison sees real pixel values
    assert ((ours > 0) & (ours < 1)).float().mean() > 0.9
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


def test_ode_without_t5_matches_stock_pipeline_without_t5(tiny_sd3_dir):
    model = load_model("sd3", tiny_sd3_dir, options={**IMAGE_OPTIONS, "text_encoder_3": False})
    assert model.components["text_encoder_3"] is None
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(1))
    ours = ode_sample(model, PROMPTS, noise, NUM_STEPS, 3.0)
    pipe = _stock_pipeline(tiny_sd3_dir, text_encoder_3=None, tokenizer_3=None)
    torch.testing.assert_close(ours, _stock_images(pipe, noise, 3.0), atol=1e-5, rtol=0)


def test_to_pipeline_shares_the_adapter_components(sd3):
    pipe = sd3.to_pipeline()
    assert pipe.transformer is sd3.transformer and pipe.vae is sd3.vae
    assert pipe.text_encoder_3 is sd3.components["text_encoder_3"]


def test_sigmas_are_the_sd3_schedule(sd3):
    from diffusers import FlowMatchEulerDiscreteScheduler

    expected = torch.tensor([1.0, 0.96013, 0.91335, 0.85769, 0.79037, 0.70728, 0.60215, 0.46488,
                             0.27805, 0.00893, 0.0])  # shift 3 (diffusers FlowMatchEulerDiscreteScheduler)
    sigmas = sd3.sigmas(10)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (11,)
    torch.testing.assert_close(sigmas, expected, atol=1e-5, rtol=0)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(sd3.scheduler_config)
    scheduler.set_timesteps(7)
    torch.testing.assert_close(sd3.sigmas(7), scheduler.sigmas, atol=1e-7, rtol=0)


def test_initial_noise_is_seeded_standard_normal_latents(sd3):
    a = sd3.initial_noise(3, torch.Generator().manual_seed(5))
    b = sd3.initial_noise(3, torch.Generator().manual_seed(5))
    assert a.shape == (3, 16, IMAGE_OPTIONS["height"] // 8, IMAGE_OPTIONS["width"] // 8)
    assert a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(a, sd3.initial_noise(3, torch.Generator().manual_seed(6)))


def test_decode_maps_any_latents_into_unit_range(sd3):
    latents = 50.0 * torch.randn(2, *sd3.latent_shape, generator=torch.Generator().manual_seed(0))
    images = sd3.decode(latents)
    assert images.dtype == torch.float32 and images.shape == (2, 3, 32, 32)
    assert images.min() >= 0.0 and images.max() <= 1.0


def test_velocity_combines_cfg_branches(sd3):
    x = sd3.initial_noise(2, torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.9, 0.4])
    cond = sd3.encode_prompts(PROMPTS)
    with torch.no_grad():
        v_pos = sd3.velocity(x, sigma, cond, 1.0)
        negative_as_positive = type(cond)(positive=cond.negative, negative=None)
        v_neg = sd3.velocity(x, sigma, negative_as_positive, 1.0)
        v_cfg = sd3.velocity(x, sigma, cond, 4.0)
    torch.testing.assert_close(v_cfg, v_neg + 4.0 * (v_pos - v_neg), atol=2e-5, rtol=0)
    assert (v_pos - v_neg).abs().max() > 1e-3   # the prompt matters


def test_velocity_per_sample_sigma_equals_separate_calls(sd3):
    x = sd3.initial_noise(2, torch.Generator().manual_seed(3))
    cond = sd3.encode_prompts(PROMPTS)
    with torch.no_grad():
        mixed = sd3.velocity(x, torch.tensor([0.9, 0.2]), cond, 1.0)
        first = sd3.velocity(x[:1], torch.tensor([0.9]), cond.select([0]), 1.0)
        second = sd3.velocity(x[1:], torch.tensor([0.2]), cond.select([1]), 1.0)
    torch.testing.assert_close(mixed, torch.cat([first, second]), atol=1e-5, rtol=0)


def test_cfg_without_negative_embeddings_is_an_error(tiny_sd3_dir):
    model = load_model("sd3", tiny_sd3_dir, options={**IMAGE_OPTIONS, "cfg": False})
    cond = model.encode_prompts(PROMPTS)
    assert cond.negative is None
    with pytest.raises(ValueError, match="cfg=True"):
        model.velocity(model.initial_noise(2, None), torch.ones(2), cond, 4.5)


def test_prompt_embeddings_are_cached_per_prompt(tiny_sd3_dir):
    model = load_model("sd3", tiny_sd3_dir, options=IMAGE_OPTIONS)
    encoders = [model.components[n] for n in ("text_encoder", "text_encoder_2", "text_encoder_3")]
    counter = CallCounter(encoders)
    try:
        first = model.encode_prompts(["a", "b", "a"])
        assert counter.calls == 2 * 3   # one batched call for ["a", "b"], one for the negative ""
        again = model.encode_prompts(["a"])
        assert counter.calls == 6
        torch.testing.assert_close(again.positive["prompt_embeds"], first.positive["prompt_embeds"][:1])
        torch.testing.assert_close(first.positive["prompt_embeds"][0], first.positive["prompt_embeds"][2])
        assert first.positive["prompt_embeds"].shape == (3, 77 + TINY_MAX_SEQUENCE_LENGTH, 48)
        assert first.negative["pooled_prompt_embeds"].shape == (3, 40)
        model.clear_cache()
        model.encode_prompts(["a"])
        assert counter.calls == 6 + 2 * 3
    finally:
        counter.remove()


def test_prompt_cache_evicts_least_recently_used_but_keeps_negative(tiny_sd3_dir):
    model = load_model("sd3", tiny_sd3_dir, options={**IMAGE_OPTIONS, "prompt_cache_size": 2})
    model.encode_prompts(["a", "b"])
    model.encode_prompts(["c"])
    assert "a" not in model.prompt_cache and "b" in model.prompt_cache and "c" in model.prompt_cache
    assert "" in model.prompt_cache   # the negative prompt is pinned


def test_freed_text_encoders_still_serve_cached_prompts(tiny_sd3_dir):
    model = load_model("sd3", tiny_sd3_dir, options=IMAGE_OPTIONS)
    cached = model.encode_prompts(["a cat"])
    model.free_text_encoders()
    torch.testing.assert_close(model.encode_prompts(["a cat"]).positive["prompt_embeds"],
                               cached.positive["prompt_embeds"])
    with pytest.raises(ValueError, match="freed"):
        model.encode_prompts(["a dog"])


def test_lora_saved_by_adapter_loads_into_stock_pipeline(tiny_sd3_dir, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict

    model = load_model("sd3", tiny_sd3_dir, options=IMAGE_OPTIONS)
    # alpha != rank: the saved metadata must carry the scale alpha / r = 2
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_modules,
                                             init_lora_weights="gaussian"))
    assert perturb_lora(model.transformer) == 8 + 7   # the last block has no to_add_out
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    ours = ode_sample(model, PROMPTS, noise, NUM_STEPS, 4.5)

    model.save_lora_weights(str(tmp_path), get_peft_model_state_dict(model.transformer))
    assert os.path.isfile(tmp_path / "pytorch_lora_weights.safetensors")
    pipe = _stock_pipeline(tiny_sd3_dir)
    without_lora = _stock_images(pipe, noise, 4.5)
    pipe.load_lora_weights(str(tmp_path))
    with_lora = _stock_images(pipe, noise, 4.5)
    assert (with_lora - without_lora).abs().max() > 1e-2   # the LoRA changes the images
    torch.testing.assert_close(ours, with_lora, atol=1e-5, rtol=0)


def test_save_lora_weights_rejects_empty_state_dict(sd3, tmp_path):
    with pytest.raises(ValueError, match="get_peft_model_state_dict"):
        sd3.save_lora_weights(str(tmp_path), {})


def test_lora_targets_match_real_module_names(sd3):
    names = [n for n, _ in sd3.transformer.named_modules()]
    for target in sd3.lora_target_modules:
        assert any(n.endswith("." + target) for n in names), target


def test_unmatched_lora_target_is_an_error(sd3):
    from pipelines.training import check_lora_targets

    with pytest.raises(ValueError, match="attn.to_qq"):
        check_lora_targets(sd3.transformer, ["attn.to_q", "attn.to_qq"], "sd3")


def test_gradient_checkpointing_is_the_configs_one_switch(tiny_sd3_dir, tmp_path):
    """model.gradient_checkpointing (the only switch) turns it on in the transformer; adapters
    have no option of their own."""
    from flowgrpo.trainer import Trainer
    from tests.helpers import tiny_config

    with pytest.raises(ValueError, match="gradient_checkpointing"):
        load_model("sd3", tiny_sd3_dir, options={**IMAGE_OPTIONS, "gradient_checkpointing": True})
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "model.gradient_checkpointing=true"))
    assert trainer.module.is_gradient_checkpointing
    assert trainer.run_iteration(0)["train/first_pass_ratio_max_dev"] == 0.0


def test_component_dtypes_follow_options(tiny_sd3_dir):
    model = load_model("sd3", tiny_sd3_dir, dtype=torch.bfloat16,
                       options={**IMAGE_OPTIONS, "vae_dtype": "float32"})
    assert model.transformer.dtype == torch.bfloat16 and model.vae.dtype == torch.float32
    assert model.components["text_encoder"].dtype == torch.bfloat16
    x = model.initial_noise(1, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = model.velocity(x.to(torch.bfloat16), torch.tensor([0.5]), model.encode_prompts(["a"]), 4.5)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


# ------------------------------------------------------------------------------- validation
def test_unknown_family_lists_known_ones():
    with pytest.raises(ValueError, match="known families are") as info:
        load_model("sdxl", "/nowhere")
    for family in MODEL_FAMILIES:
        assert family in str(info.value)


def test_errors_are_raised_before_weights_load(tiny_sd3_dir, tmp_path, monkeypatch):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_sd3_dir, incomplete)
    shutil.rmtree(incomplete / "text_encoder_2")
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="text_encoder_2/config.json"):
        load_model("sd3", incomplete, options=IMAGE_OPTIONS)
    with pytest.raises(ValueError, match=r"unknown sd3 option\(s\) \['heigth'\].*'height'"):
        load_model("sd3", tiny_sd3_dir, options={"heigth": 512})
    with pytest.raises(ValueError, match="height must be divisible by 16"):
        load_model("sd3", tiny_sd3_dir, options={**IMAGE_OPTIONS, "height": 40})
    with pytest.raises(ValueError, match="width must be divisible by 16"):
        load_model("sd3", tiny_sd3_dir, options={**IMAGE_OPTIONS, "width": 33})
    with pytest.raises(TypeError, match="options.cfg"):
        load_model("sd3", tiny_sd3_dir, options={**IMAGE_OPTIONS, "cfg": "yes"})
    with pytest.raises(ValueError, match="does not exist"):
        load_model("sd3", tmp_path / "missing_folder")
    with pytest.raises(ValueError, match="attention_backend"):
        load_model("sd3", tiny_sd3_dir, options={**IMAGE_OPTIONS, "attention_backend": "flash"})


def test_folder_without_t5_loads_with_text_encoder_3_off(tiny_sd3_dir, tmp_path):
    folder = tmp_path / "no_t5"
    shutil.copytree(tiny_sd3_dir, folder)
    shutil.rmtree(folder / "text_encoder_3")
    shutil.rmtree(folder / "tokenizer_3")
    with pytest.raises(ValueError, match="text_encoder_3"):
        SD3Model.from_pretrained(str(folder), options=IMAGE_OPTIONS)
    model = SD3Model.from_pretrained(str(folder), options={**IMAGE_OPTIONS, "text_encoder_3": False})
    assert model.encode_prompts(["a"]).positive["prompt_embeds"].shape[-1] == 48


@pytest.mark.skipif(__import__("importlib").util.find_spec("xformers") is not None,
                    reason="xformers is installed")
def test_xformers_without_the_package_is_a_clear_error(tiny_sd3_dir, monkeypatch):
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="xformers"):
        load_model("sd3", tiny_sd3_dir, options={**IMAGE_OPTIONS, "attention_backend": "xformers"})


def test_hub_ids_are_left_to_from_pretrained_and_paths_are_checked():
    from pipelines.sources import is_local_path

    assert not is_local_path("stabilityai/stable-diffusion-3.5-medium")
    assert not is_local_path("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    for path in ("./models/sd3", "/abs/sd3", "models/sd3/v2", "~/sd3", "sd3"):
        assert is_local_path(path), path


def test_a_larger_tiny_transformer_loads_and_runs(tmp_path):
    """The benchmarks' larger tiny SD3 (``transformer_size``): the blocks and width asked for,
    loaded back through ``load_model`` and giving velocities of the latents' shape; the default
    build is unchanged by the option, and other families refuse it."""
    from pipelines.tiny import build_tiny, save_tiny

    model = load_model("sd3", save_tiny("sd3", tmp_path / "big", transformer_size=(3, 4)),
                       options=IMAGE_OPTIONS)
    config = model.transformer.config
    assert (config.num_layers, config.num_attention_heads, config.caption_projection_dim) == (3, 4, 32)
    noise = model.initial_noise(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        velocity = model.velocity(noise, torch.full((2,), 0.5), model.encode_prompts(PROMPTS), 1.0)
    assert velocity.shape == noise.shape and torch.isfinite(velocity).all()
    default, explicit = build_tiny("sd3"), build_tiny("sd3", transformer_size=(2, 2))
    assert all(torch.equal(a, b) for a, b in zip(default.transformer.parameters(),
                                                 explicit.transformer.parameters()))
    with pytest.raises(ValueError, match="transformer_size is only supported"):
        build_tiny("flux", transformer_size=(2, 2))
