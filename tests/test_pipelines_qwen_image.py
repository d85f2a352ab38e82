"""Qwen-Image adapter: parity with QwenImagePipeline (Qwen2.5-VL text through the pipeline's
template, 2x2 packing and RoPE shapes, dynamic shift with shift_terminal, true CFG with its norm
rescale), LoRA round trip through the stock loader, on-policy first pass under every plan,
validation, caching of variable-length text."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from torch import Tensor

from flowgrpo.model import Conditioning, FlowModel
from pipelines import load_model
from pipelines.qwen_image import QWEN_IMAGE_LORA_TARGET_MODULES
from pipelines.tiny import QWEN_TEMPLATE_PREFIX_TOKENS
from tests.pipeline_helpers import CallCounter, fail_on_weight_loading, perturb_lora

PROMPTS = ["a red cube", "two green spheres on a long wooden table"]
NUM_STEPS = 3
MAX_SEQUENCE_LENGTH = 32
OPTIONS = {"height": 32, "width": 32, "max_sequence_length": MAX_SEQUENCE_LENGTH}


@pytest.fixture(scope="module")
def qwen(tiny_qwen_image_dir):
    return load_model("qwen_image", tiny_qwen_image_dir, options=OPTIONS)


def _stock_pipeline(directory):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock(pipe, noise: Tensor, guidance_scale: float, output_type: str = "pt") -> Tensor:
    """The pipeline's own sampling from ``noise``: images (B, 3, H, W), or packed latents."""
    cfg = {"negative_prompt": " ", "true_cfg_scale": guidance_scale} if guidance_scale > 1 else \
        {"true_cfg_scale": 1.0}
    out = pipe(PROMPTS, height=OPTIONS["height"], width=OPTIONS["width"], num_inference_steps=NUM_STEPS,
               latents=noise.clone(), output_type=output_type, max_sequence_length=MAX_SEQUENCE_LENGTH,
               **cfg).images
    return out


@torch.no_grad()
def _ode_latents(model, noise: Tensor, num_steps: int, guidance_scale: float) -> Tensor:
    """Euler ODE through the FlowModel interface: the final (packed) latents."""
    cond = model.encode_prompts(PROMPTS)
    sigmas = model.sigmas(num_steps)
    x = noise.clone().float()
    for i in range(num_steps):
        x = x + model.velocity(x, sigmas[i].expand(len(x)), cond, guidance_scale) * (sigmas[i + 1] - sigmas[i])
    return x


def test_load_model_returns_a_flow_model(qwen):
    assert isinstance(qwen, FlowModel) and qwen.family == "qwen_image"
    assert qwen.pipeline_class.__name__ == "QwenImagePipeline"
    assert qwen.lora_target_modules == QWEN_IMAGE_LORA_TARGET_MODULES
    assert type(qwen.components["text_encoder"]).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(qwen.components["tokenizer"]).__name__ == "Qwen2Tokenizer"


def test_tiny_tokenizer_splits_the_template_like_qwens(qwen):
    """The pipeline drops prompt_template_encode_start_idx = 34 tokens: the tiny tokenizer must
    split the template's system part into exactly those, so the drop removes the template and
    nothing of the prompt (as with Qwen's own tokenizer)."""
    pipe = qwen.to_pipeline()
    prefix = pipe.prompt_template_encode.split("{}")[0]
    tokenizer = qwen.components["tokenizer"]
    assert pipe.prompt_template_encode_start_idx == QWEN_TEMPLATE_PREFIX_TOKENS
    assert len(tokenizer(prefix).input_ids) == QWEN_TEMPLATE_PREFIX_TOKENS
    embeds, mask = pipe.encode_prompt(["a red cube"], device="cpu", max_sequence_length=1024)
    suffix = pipe.prompt_template_encode.split("{}")[1]
    assert embeds.shape[1] == len(tokenizer("a red cube" + suffix).input_ids)   # prompt + template end


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0], ids=["cfg_off", "true_cfg_4"])
def test_ode_matches_stock_pipeline(qwen, tiny_qwen_image_dir, guidance_scale):
    noise = qwen.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    assert noise.shape == (2, (32 // 16) ** 2, 64)
    latents = _ode_latents(qwen, noise, NUM_STEPS, guidance_scale)
    images = qwen.decode(latents)
    pipe = _stock_pipeline(tiny_qwen_image_dir)
    torch.testing.assert_close(latents, _stock(pipe, noise, guidance_scale, "latent"), atol=1e-5, rtol=0)
    reference = _stock(pipe, noise, guidance_scale)
    assert images.shape == reference.shape == (2, 3, 32, 32)
    assert ((images > 0) & (images < 1)).float().mean() > 0.9   # real pixel values, not saturated
    torch.testing.assert_close(images, reference, atol=1e-5, rtol=0)


def test_initial_noise_is_what_the_pipeline_draws_from_the_same_generator(qwen, tiny_qwen_image_dir):
    pipe = _stock_pipeline(tiny_qwen_image_dir)
    drawn = pipe.prepare_latents(2, 16, 32, 32, torch.float32, "cpu", torch.Generator().manual_seed(7))
    assert torch.equal(qwen.initial_noise(2, torch.Generator().manual_seed(7)), drawn)


def test_sigmas_are_the_dynamic_shift_with_terminal_stretch(qwen):
    """mu linear in the packed length (base 0.5 at 256 tokens, max 0.9 at 8192), the exponential
    time shift e^mu / (e^mu + 1/s - 1) on linspace(1, 1/N, N), then the stretch that makes the
    last sigma shift_terminal = 0.02, then 0; the same as the pipeline's scheduler."""
    import numpy as np

    num_steps = 6
    tokens = (32 // 16) ** 2
    mu = 0.5 + (0.9 - 0.5) * (tokens - 256) / (8192 - 256)
    grid = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    shifted = math.exp(mu) / (math.exp(mu) + 1.0 / grid - 1.0)
    stretched = 1.0 - (1.0 - shifted) * (1.0 - 0.02) / (1.0 - shifted[-1])
    expected = torch.cat([stretched.float(), torch.zeros(1)])
    sigmas = qwen.sigmas(num_steps)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps + 1,)
    torch.testing.assert_close(sigmas, expected, atol=1e-6, rtol=0)
    assert abs(float(sigmas[-2]) - 0.02) < 1e-6
    scheduler = qwen.to_pipeline().scheduler
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu)
    assert torch.equal(sigmas, scheduler.sigmas)


def test_true_cfg_rescales_to_the_conditional_norm(qwen):
    x = qwen.initial_noise(2, torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.9, 0.4])
    cond = qwen.encode_prompts(PROMPTS)
    with torch.no_grad():
        v_pos = qwen.velocity(x, sigma, Conditioning(positive=cond.positive), 1.0)
        v_neg = qwen.velocity(x, sigma, Conditioning(positive=cond.negative), 1.0)
        v_cfg = qwen.velocity(x, sigma, cond, 4.0)
    combined = v_neg + 4.0 * (v_pos - v_neg)
    rescaled = combined * v_pos.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(v_cfg, rescaled, atol=2e-5, rtol=0)
    torch.testing.assert_close(v_cfg.norm(dim=-1), v_pos.norm(dim=-1), atol=1e-4, rtol=1e-5)
    assert (v_cfg - combined).abs().max() > 1e-3   # the rescale does something
    assert (v_pos - v_neg).abs().max() > 1e-3      # the prompt matters


def test_padding_of_shorter_prompts_is_masked(qwen):
    """Rows of different prompt lengths share one padded text tensor; each row's velocity equals
    the row run alone (its own length, no padding)."""
    x = qwen.initial_noise(2, torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.8, 0.3])
    cond = qwen.encode_prompts(PROMPTS)
    lengths = cond.positive["prompt_embeds_mask"].sum(dim=1)
    assert lengths[0] < lengths[1] and cond.positive["prompt_embeds"].shape[1] == int(lengths[1])
    with torch.no_grad():
        both = qwen.velocity(x, sigma, cond, 4.0)
        short = qwen.velocity(x[:1], sigma[:1], qwen.encode_prompts(PROMPTS[:1]), 4.0)
    torch.testing.assert_close(both[:1], short, atol=1e-5, rtol=0)


def test_prompt_embeddings_are_cached_per_prompt_at_their_length(tiny_qwen_image_dir):
    model = load_model("qwen_image", tiny_qwen_image_dir, options=OPTIONS)
    counter = CallCounter([model.components["text_encoder"]])
    try:
        long = model.encode_prompts(["a", PROMPTS[1], "a"])
        assert counter.calls == 2   # ["a", long prompt] in one call, then the negative " "
        short = model.encode_prompts(["a"])
        assert counter.calls == 2
    finally:
        counter.remove()
    width = model.transformer.config.joint_attention_dim
    assert long.positive["prompt_embeds"].shape[::2] == (3, width)
    assert long.negative["prompt_embeds"].shape == long.positive["prompt_embeds"].shape
    length = int(short.positive["prompt_embeds_mask"].sum())
    assert short.positive["prompt_embeds"].shape[1] == max(length, int(short.negative["prompt_embeds_mask"].sum()))
    torch.testing.assert_close(short.positive["prompt_embeds"][0, :length], long.positive["prompt_embeds"][0, :length])
    assert torch.equal(long.positive["prompt_embeds"][0], long.positive["prompt_embeds"][2])


def test_lora_saved_by_adapter_loads_into_stock_pipeline(tiny_qwen_image_dir, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict

    model = load_model("qwen_image", tiny_qwen_image_dir, options=OPTIONS)
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_modules,
                                             init_lora_weights="gaussian"))
    assert perturb_lora(model.transformer) == 2 * 12   # 12 targets in each of the 2 blocks
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    ours = model.decode(_ode_latents(model, noise, NUM_STEPS, 4.0))
    model.save_lora_weights(str(tmp_path), get_peft_model_state_dict(model.transformer))
    pipe = _stock_pipeline(tiny_qwen_image_dir)
    without_lora = _stock(pipe, noise, 4.0)
    pipe.load_lora_weights(str(tmp_path))
    with_lora = _stock(pipe, noise, 4.0)
    assert (with_lora - without_lora).abs().max() > 1e-2   # the LoRA changes the images
    torch.testing.assert_close(ours, with_lora, atol=1e-5, rtol=0)


def test_default_size_is_the_checkpoints(tiny_qwen_image_dir, qwen):
    """No height/width: the size QwenImagePipeline samples at by default (default_sample_size x
    its VAE factor), not a constant of this adapter."""
    model = load_model("qwen_image", tiny_qwen_image_dir)
    pipe = qwen.to_pipeline()
    assert model.height == model.width == pipe.default_sample_size * pipe.vae_scale_factor
    assert model.packed_shape == ((model.height // 16) ** 2, 64)


def test_errors_are_raised_before_weights_load(tiny_qwen_image_dir, tmp_path, monkeypatch):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_qwen_image_dir, incomplete)
    shutil.rmtree(incomplete / "tokenizer")
    edit = tmp_path / "edit"
    shutil.copytree(tiny_qwen_image_dir, edit)
    index = json.loads((edit / "model_index.json").read_text())
    (edit / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImageEditPipeline"}))
    layered = tmp_path / "layered"
    shutil.copytree(tiny_qwen_image_dir, layered)
    config = json.loads((layered / "transformer" / "config.json").read_text())
    (layered / "transformer" / "config.json").write_text(json.dumps({**config, "use_layer3d_rope": True}))
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="tokenizer/tokenizer_config.json"):
        load_model("qwen_image", incomplete, options=OPTIONS)
    with pytest.raises(ValueError, match="QwenImageEditPipeline"):
        load_model("qwen_image", edit, options=OPTIONS)
    with pytest.raises(ValueError, match="use_layer3d_rope"):
        load_model("qwen_image", layered, options=OPTIONS)
    with pytest.raises(ValueError, match="height must be divisible by 16"):
        load_model("qwen_image", tiny_qwen_image_dir, options={**OPTIONS, "height": 40})
    with pytest.raises(ValueError, match=r"max_sequence_length must be in \[1, 1024\]"):
        load_model("qwen_image", tiny_qwen_image_dir, options={**OPTIONS, "max_sequence_length": 2048})
    with pytest.raises(ValueError, match=r"unknown qwen_image option\(s\) \['true_cfg_scale'\]"):
        load_model("qwen_image", tiny_qwen_image_dir, options={"true_cfg_scale": 4.0})


# ------------------------------------------------------------------------------- training
def _train_config(path, tmp_path, *overrides: str, iterations: int = 1):
    from tests.helpers import family_config

    return family_config("qwen_image", path, tmp_path, OPTIONS, *overrides, guidance_scale=4.0,
                         iterations=iterations)


def _plans() -> dict[str, list[str]]:
    from tests.helpers import PLANS

    return PLANS


@pytest.mark.parametrize("plan", sorted(_plans()))
def test_first_pass_ratio_is_one_under_every_plan(plan, tiny_qwen_image_dir, tmp_path):
    from flowgrpo.trainer import Trainer

    trainer = Trainer(_train_config(tiny_qwen_image_dir, tmp_path, *_plans()[plan]))
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0


def test_trained_checkpoint_loads_into_stock_pipeline(tiny_qwen_image_dir, tmp_path):
    """Two GRPO iterations with true CFG, gradient checkpointing and a KL to the LoRA-free
    reference; the checkpoint's LoRA, loaded by the stock pipeline, reproduces the trained
    adapter's samples."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(_train_config(tiny_qwen_image_dir, tmp_path, "model.gradient_checkpointing=true",
                                    "training.kl_beta=0.01", iterations=2))
    assert trainer.module.is_gradient_checkpointing
    history = trainer.train()
    assert [h["train/first_pass_ratio_max_dev"] for h in history if h["phase"] == "train"][0] == 0.0
    second = [h for h in history if h["phase"] == "train"][1]
    assert second["train/kl"] > 0   # LoRA moved away from the adapter-free reference
    checkpoint = trainer.run_dir / "checkpoints" / "2"
    assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
    noise = trainer.model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(5))
    ours = trainer.model.decode(_ode_latents(trainer.model, noise, NUM_STEPS, 4.0))
    pipe = _stock_pipeline(tiny_qwen_image_dir)
    base = _stock(pipe, noise, 4.0)
    pipe.load_lora_weights(str(checkpoint))
    trained = _stock(pipe, noise, 4.0)
    assert (trained - base).abs().max() > 0   # training moved the weights
    torch.testing.assert_close(ours, trained, atol=1e-5, rtol=0)
