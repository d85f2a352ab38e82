"""Z-Image adapter: parity with ZImagePipeline (Qwen3 text through the chat template, the list
of per-prompt features, timestep 1 - sigma and the negated output, Z-Image-Turbo's static-shift
schedule, CFG in the pipeline's pos + s (pos - neg) with its normalization and truncation), LoRA
round trip through the stock loader, on-policy first pass, validation, text caching."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from torch import Tensor

from flowgrpo.model import Conditioning, FlowModel
from pipelines import load_model
from pipelines.z_image import Z_IMAGE_LORA_TARGET_MODULES, z_image_guidance
from tests.pipeline_helpers import CallCounter, fail_on_weight_loading, perturb_lora
from tests.helpers import family_config

PROMPTS = ["a red cube", "two green spheres on a long wooden table"]
NUM_STEPS = 3
MAX_SEQUENCE_LENGTH = 96       # the template and both prompts fit (one token per character)
OPTIONS = {"height": 32, "width": 32, "max_sequence_length": MAX_SEQUENCE_LENGTH}
# The pipeline's CFG arguments of the parity cases: (our guidance, options). At 3 steps
# 1 - sigma is 0, 0.14, 0.4: truncation 0.3 turns CFG off at the last step only.
CFG_CASES = {
    "turbo_no_cfg": (1.0, {}),
    "cfg_5": (5.0, {}),
    "cfg_5_normalized_truncated": (5.0, {"cfg_normalization": 1.05, "cfg_truncation": 0.3}),
}


@pytest.fixture(scope="module")
def zimage(tiny_z_image_dir):
    return load_model("z_image", tiny_z_image_dir, options=OPTIONS)


def _stock_pipeline(directory):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock(pipe, noise: Tensor, guidance_scale: float, options: dict | None = None,
           output_type: str = "pt", num_steps: int = NUM_STEPS) -> Tensor:
    """The pipeline's own sampling from ``noise`` at our ``guidance_scale`` g (its g - 1)."""
    options = options or {}
    # A copy: the pipeline writes the templated prompts into the list it is given.
    return pipe(list(PROMPTS), height=OPTIONS["height"], width=OPTIONS["width"],
                num_inference_steps=num_steps, guidance_scale=guidance_scale - 1.0,
                cfg_normalization=options.get("cfg_normalization", False),
                cfg_truncation=options.get("cfg_truncation", 1.0),
                latents=noise.clone(), output_type=output_type,
                max_sequence_length=MAX_SEQUENCE_LENGTH).images


@torch.no_grad()
def _ode_latents(model, noise: Tensor, num_steps: int, guidance_scale: float) -> Tensor:
    """Euler ODE through the FlowModel interface: the final latents."""
    cond = model.encode_prompts(PROMPTS)
    sigmas = model.sigmas(num_steps)
    x = noise.clone().float()
    for i in range(num_steps):
        x = x + model.velocity(x, sigmas[i].expand(len(x)), cond, guidance_scale) * (sigmas[i + 1] - sigmas[i])
    return x


def test_load_model_returns_a_flow_model(zimage):
    assert isinstance(zimage, FlowModel) and zimage.family == "z_image"
    assert zimage.pipeline_class.__name__ == "ZImagePipeline"
    assert zimage.lora_target_modules == Z_IMAGE_LORA_TARGET_MODULES
    assert type(zimage.components["text_encoder"]).__name__ == "Qwen3Model"
    assert type(zimage.transformer).__name__ == "ZImageTransformer2DModel"


@pytest.mark.parametrize("case", sorted(CFG_CASES))
def test_ode_matches_stock_pipeline(tiny_z_image_dir, case):
    guidance_scale, cfg_options = CFG_CASES[case]
    model = load_model("z_image", tiny_z_image_dir, options={**OPTIONS, **cfg_options})
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    assert noise.shape == (2, 16, 4, 4)
    latents = _ode_latents(model, noise, NUM_STEPS, guidance_scale)
    images = model.decode(latents)
    pipe = _stock_pipeline(tiny_z_image_dir)
    torch.testing.assert_close(latents, _stock(pipe, noise, guidance_scale, cfg_options, "latent"),
                               atol=1e-5, rtol=0)
    reference = _stock(pipe, noise, guidance_scale, cfg_options)
    assert images.shape == reference.shape == (2, 3, 32, 32)
    assert ((images > 0) & (images < 1)).float().mean() > 0.9   # real pixel values, not saturated
    torch.testing.assert_close(images, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("option", ["cfg_normalization", "cfg_truncation"])
def test_cfg_options_change_the_samples(zimage, option):
    """The parity cases exercise each CFG path: guidance changes the samples, and each of the
    third case's normalization and truncation changes them again on its own."""
    noise = zimage.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    plain = _ode_latents(zimage, noise, NUM_STEPS, 1.0)
    guided = _ode_latents(zimage, noise, NUM_STEPS, 5.0)
    options = zimage.options
    try:
        value = CFG_CASES["cfg_5_normalized_truncated"][1][option]
        zimage.options = dataclasses.replace(options, **{option: value})
        shaped = _ode_latents(zimage, noise, NUM_STEPS, 5.0)
    finally:
        zimage.options = options
    assert (guided - plain).abs().max() > 1e-2
    assert (shaped - guided).abs().max() > 1e-3


def test_initial_noise_is_what_the_pipeline_draws_from_the_same_generator(zimage, tiny_z_image_dir):
    pipe = _stock_pipeline(tiny_z_image_dir)
    drawn = pipe.prepare_latents(2, 16, 32, 32, torch.float32, "cpu", torch.Generator().manual_seed(7))
    assert torch.equal(zimage.initial_noise(2, torch.Generator().manual_seed(7)), drawn)


@pytest.mark.parametrize("num_steps", [6, 8])
def test_turbo_schedule_is_the_static_shift_of_its_scheduler_config(zimage, tiny_z_image_dir, num_steps):
    """Z-Image-Turbo's scheduler config (shift 3, no dynamic shifting): sigmas = 3s / (1 + 2s)
    on linspace(1, 1/N, N), then 0, at its few steps: what the pipeline's scheduler steps
    through in its own call."""
    grid = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    expected = torch.cat([(3.0 * grid / (1.0 + 2.0 * grid)).float(), torch.zeros(1)])
    sigmas = zimage.sigmas(num_steps)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps + 1,)
    torch.testing.assert_close(sigmas, expected, atol=1e-6, rtol=0)
    pipe = _stock_pipeline(tiny_z_image_dir)
    noise = zimage.initial_noise(len(PROMPTS), torch.Generator().manual_seed(1))
    _stock(pipe, noise, 1.0, output_type="latent", num_steps=num_steps)
    assert torch.equal(sigmas, pipe.scheduler.sigmas)


def test_schedule_follows_the_checkpoints_scheduler_config(tiny_z_image_dir, tmp_path):
    """Another shift in the checkpoint's scheduler config is the one sampled with."""
    other = tmp_path / "shift6"
    shutil.copytree(tiny_z_image_dir, other)
    config_path = other / "scheduler" / "scheduler_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "shift": 6.0}))
    model = load_model("z_image", other, options=OPTIONS)
    grid = torch.linspace(1.0, 0.25, 4, dtype=torch.float64)
    expected = torch.cat([(6.0 * grid / (1.0 + 5.0 * grid)).float(), torch.zeros(1)])
    torch.testing.assert_close(model.sigmas(4), expected, atol=1e-6, rtol=0)


def test_guidance_is_the_pipelines_in_the_framework_scale(zimage):
    """velocity(g) = v_pos + (g - 1)(v_pos - v_neg) (the pipeline's guidance g - 1), with the
    normalization capping each sample's norm at k |v_pos| and truncated rows (1 - sigma >
    cfg_truncation) taking v_pos alone."""
    x = zimage.initial_noise(2, torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.9, 0.3])
    cond = zimage.encode_prompts(PROMPTS)
    with torch.no_grad():
        v_pos = zimage.velocity(x, sigma, Conditioning(positive=cond.positive), 1.0)
        v_neg = zimage.velocity(x, sigma, Conditioning(positive=cond.negative), 1.0)
        v_cfg = zimage.velocity(x, sigma, cond, 4.0)
    assert (v_pos - v_neg).abs().max() > 1e-3      # the prompt matters
    torch.testing.assert_close(v_cfg, v_neg + 4.0 * (v_pos - v_neg), atol=2e-5, rtol=0)

    capped = z_image_guidance(v_neg, v_pos, 4.0, sigma, normalization=1.0)
    norms = torch.linalg.vector_norm(capped.flatten(1), dim=1)
    torch.testing.assert_close(norms, torch.linalg.vector_norm(v_pos.flatten(1), dim=1))
    truncated = z_image_guidance(v_neg, v_pos, 4.0, sigma, truncation=0.5)   # 1 - 0.3 > 0.5
    assert torch.equal(truncated[1], v_pos[1])
    torch.testing.assert_close(truncated[0], v_cfg[0], atol=2e-5, rtol=0)


def test_each_row_sees_only_its_own_tokens(zimage):
    """Rows of different prompt lengths share one padded text tensor; each row's velocity equals
    the row run alone, and the cached features are the pipeline's own."""
    x = zimage.initial_noise(2, torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.8, 0.3])
    cond = zimage.encode_prompts(PROMPTS)
    lengths = cond.positive["prompt_embeds_mask"].sum(dim=1)
    assert lengths[0] < lengths[1] and cond.positive["prompt_embeds"].shape[1] == int(lengths[1])
    with torch.no_grad():
        both = zimage.velocity(x, sigma, cond, 5.0)
        short = zimage.velocity(x[:1], sigma[:1], zimage.encode_prompts(PROMPTS[:1]), 5.0)
        features, _ = zimage.to_pipeline().encode_prompt(
            list(PROMPTS), device="cpu", do_classifier_free_guidance=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH)
    torch.testing.assert_close(both[:1], short, atol=1e-5, rtol=0)
    for row, feature in enumerate(features):
        assert int(lengths[row]) == feature.shape[0]
        torch.testing.assert_close(cond.positive["prompt_embeds"][row, :feature.shape[0]], feature)


def test_prompt_embeddings_are_cached_per_prompt(tiny_z_image_dir):
    model = load_model("z_image", tiny_z_image_dir, options=OPTIONS)
    counter = CallCounter([model.components["text_encoder"]])
    try:
        first = model.encode_prompts(["a", PROMPTS[1], "a"])
        assert counter.calls == 2   # ["a", long prompt] in one call, then the negative ""
        again = model.encode_prompts(["a"])
        assert counter.calls == 2
    finally:
        counter.remove()
    length = int(again.positive["prompt_embeds_mask"].sum())
    torch.testing.assert_close(again.positive["prompt_embeds"][0, :length],
                               first.positive["prompt_embeds"][0, :length])
    assert torch.equal(first.positive["prompt_embeds"][0], first.positive["prompt_embeds"][2])


def test_lora_saved_by_adapter_loads_into_stock_pipeline(tiny_z_image_dir, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict

    model = load_model("z_image", tiny_z_image_dir, options=OPTIONS)
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_modules,
                                             init_lora_weights="gaussian"))
    # 7 targets in each of the 2 main layers, the noise refiner and the context refiner
    assert perturb_lora(model.transformer) == 7 * 4
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    ours = model.decode(_ode_latents(model, noise, NUM_STEPS, 5.0))
    model.save_lora_weights(str(tmp_path), get_peft_model_state_dict(model.transformer))
    pipe = _stock_pipeline(tiny_z_image_dir)
    without_lora = _stock(pipe, noise, 5.0)
    pipe.load_lora_weights(str(tmp_path))
    with_lora = _stock(pipe, noise, 5.0)
    assert (with_lora - without_lora).abs().max() > 1e-2   # the LoRA changes the images
    torch.testing.assert_close(ours, with_lora, atol=1e-5, rtol=0)


def test_default_size_is_the_pipelines(tiny_z_image_dir):
    """No height/width: ZImagePipeline's default 1024 x 1024, 64 x 64 patch tokens."""
    model = load_model("z_image", tiny_z_image_dir)
    assert model.height == model.width == 1024
    assert model.latent_shape == (16, 128, 128) and model.packed_shape == (64 * 64, 64)


def test_errors_are_raised_before_weights_load(tiny_z_image_dir, tmp_path, monkeypatch):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_z_image_dir, incomplete)
    shutil.rmtree(incomplete / "tokenizer")
    omni = tmp_path / "omni"
    shutil.copytree(tiny_z_image_dir, omni)
    index = json.loads((omni / "model_index.json").read_text())
    (omni / "model_index.json").write_text(json.dumps({**index, "_class_name": "ZImageOmniPipeline"}))
    siglip = tmp_path / "siglip"
    shutil.copytree(tiny_z_image_dir, siglip)
    config = json.loads((siglip / "transformer" / "config.json").read_text())
    (siglip / "transformer" / "config.json").write_text(json.dumps({**config, "siglip_feat_dim": 8}))
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="tokenizer/tokenizer_config.json"):
        load_model("z_image", incomplete, options=OPTIONS)
    with pytest.raises(ValueError, match="ZImageOmniPipeline"):
        load_model("z_image", omni, options=OPTIONS)
    with pytest.raises(ValueError, match="siglip_feat_dim"):
        load_model("z_image", siglip, options=OPTIONS)
    with pytest.raises(ValueError, match="height must be divisible by 16"):
        load_model("z_image", tiny_z_image_dir, options={**OPTIONS, "height": 40})
    with pytest.raises(ValueError, match="cfg_normalization must be a finite number >= 0"):
        load_model("z_image", tiny_z_image_dir, options={**OPTIONS, "cfg_normalization": -1.0})
    with pytest.raises(ValueError, match=r"unknown z_image option\(s\) \['guidance_scale'\]"):
        load_model("z_image", tiny_z_image_dir, options={"guidance_scale": 4.0})


# ------------------------------------------------------------------------------- training
def _train_config(path, tmp_path, *overrides: str, iterations: int = 1):
    return family_config("z_image", path, tmp_path, OPTIONS, *overrides, guidance_scale=5.0,
                         iterations=iterations)


def test_first_pass_ratio_is_one_with_turbos_window(tiny_z_image_dir, tmp_path):
    """The recipe's plan (one Flow-SDE step drawn in steps 1..3 per iteration) without CFG, as
    Z-Image-Turbo trains: the first pass over each rollout is exactly on-policy."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(_train_config(
        tiny_z_image_dir, tmp_path, "sampling.num_steps=6", "sampling.guidance_scale=1.0",
        "model.options.cfg=false",
        "sampling.plan.kind=window", "sampling.plan.window_size=1",
        "sampling.plan.window_strategy=random", "sampling.plan.window_range=[1, 4]"))
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0


def test_trained_checkpoint_loads_into_stock_pipeline(tiny_z_image_dir, tmp_path):
    """Two GRPO iterations with CFG (the base model's way), gradient checkpointing and a KL to
    the LoRA-free reference: the first pass is on-policy, and the checkpoint's LoRA, loaded by
    the stock pipeline, reproduces the trained adapter's samples."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(_train_config(tiny_z_image_dir, tmp_path, "model.gradient_checkpointing=true",
                                    "training.kl_beta=0.01", iterations=2))
    assert trainer.module.is_gradient_checkpointing
    history = trainer.train()
    train = [h for h in history if h["phase"] == "train"]
    assert [h["train/first_pass_ratio_max_dev"] for h in train] == [0.0, 0.0]
    assert train[1]["train/kl"] > 0   # LoRA moved away from the adapter-free reference
    checkpoint = trainer.run_dir / "checkpoints" / "2"
    assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
    noise = trainer.model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(5))
    ours = trainer.model.decode(_ode_latents(trainer.model, noise, NUM_STEPS, 5.0))
    pipe = _stock_pipeline(tiny_z_image_dir)
    base = _stock(pipe, noise, 5.0)
    pipe.load_lora_weights(str(checkpoint))
    trained = _stock(pipe, noise, 5.0)
    assert (trained - base).abs().max() > 0   # training moved the weights
    torch.testing.assert_close(ours, trained, atol=1e-5, rtol=0)
