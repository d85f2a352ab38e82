"""FLUX.2 adapter (klein): parity with Flux2KleinPipeline (Qwen3 text through its chat template
and layers 9/18/27, patchified latents, position ids, the empirical mu schedule, real CFG of the
base checkpoints, none for the step-distilled ones, batch-norm latent statistics), LoRA round
trip through the stock loader, on-policy first pass, validation before loading, caching."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from torch import Tensor

from flowgrpo.model import Conditioning, FlowModel
from pipelines import load_model
from pipelines.flux import pack_latents, unpack_latents
from pipelines.flux2 import (FLUX2_DOUBLE_BLOCK_TARGETS, empirical_mu, flux2_lora_target_modules,
                             image_position_ids, text_position_ids)
from tests.pipeline_helpers import CallCounter, fail_on_weight_loading, perturb_lora
from tests.helpers import family_config

PROMPTS = ["a red cube", "two green spheres on a table"]
NUM_STEPS = 3
# The template alone is ~40 byte-level tokens of the tiny tokenizer: 64 keeps every prompt whole.
MAX_SEQUENCE_LENGTH = 64
OPTIONS = {"height": 32, "width": 32, "max_sequence_length": MAX_SEQUENCE_LENGTH}


@pytest.fixture(scope="module")
def flux2(tiny_flux2_dir):
    return load_model("flux2", tiny_flux2_dir, options=OPTIONS)


@pytest.fixture(scope="module")
def distilled_dir(tiny_flux2_dir, tmp_path_factory):
    """The tiny klein build marked step-distilled (model_index.json is_distilled true)."""
    folder = tmp_path_factory.mktemp("flux2_distilled") / "flux2"
    shutil.copytree(tiny_flux2_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    return str(folder)


def _stock_pipeline(directory):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _patchified(noise: Tensor, model) -> Tensor:
    """Packed noise (B, tokens, 4C) in the shape the pipeline's ``latents=`` takes: (B, 4C, h, w)."""
    return noise.transpose(1, 2).reshape(noise.shape[0], -1, model.latent_height // 2,
                                         model.latent_width // 2).clone()


def _denormalised(model, latents: Tensor) -> Tensor:
    """Packed latents (B, tokens, 4C) as Flux2KleinPipeline's output_type="latent" returns them:
    batch-norm statistics undone, unpacked to the VAE grid (B, C, h, w)."""
    mean, std = model.latent_statistics()
    return unpack_latents(latents * std + mean, model.latent_height, model.latent_width)


def _stock(pipe, model, noise: Tensor, guidance_scale: float, output_type: str = "pt") -> Tensor:
    return pipe(prompt=PROMPTS, height=OPTIONS["height"], width=OPTIONS["width"],
                num_inference_steps=NUM_STEPS, guidance_scale=guidance_scale,
                latents=_patchified(noise, model), output_type=output_type,
                max_sequence_length=MAX_SEQUENCE_LENGTH).images


@torch.no_grad()
def _ode_latents(model, noise: Tensor, guidance_scale: float, num_steps: int = NUM_STEPS) -> Tensor:
    """Euler ODE through the FlowModel interface: the final packed latents."""
    cond = model.encode_prompts(PROMPTS)
    sigmas = model.sigmas(num_steps)
    x = noise.clone().float()
    for i in range(num_steps):
        v = model.velocity(x, sigmas[i].expand(len(x)), cond, guidance_scale)
        x = x + v * (sigmas[i + 1] - sigmas[i])
    return x


def test_load_model_returns_a_klein_flow_model(flux2):
    assert isinstance(flux2, FlowModel) and flux2.family == "flux2"
    assert flux2.pipeline_class.__name__ == "Flux2KleinPipeline"
    assert flux2.has_real_cfg and not flux2.is_distilled
    assert type(flux2.components["text_encoder"]).__name__ == "Qwen3ForCausalLM"
    assert flux2.lora_target_modules == flux2_lora_target_modules(2)
    assert flux2.lora_target_modules[-2:] == ["single_transformer_blocks.0.attn.to_out",
                                              "single_transformer_blocks.1.attn.to_out"]
    assert flux2.packed_shape == ((32 // 16) ** 2, 32)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0], ids=["cfg_off", "cfg_4"])
def test_ode_matches_stock_pipeline(flux2, tiny_flux2_dir, guidance_scale):
    noise = flux2.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    latents = _ode_latents(flux2, noise, guidance_scale)
    images = flux2.decode(latents)
    pipe = _stock_pipeline(tiny_flux2_dir)
    torch.testing.assert_close(_denormalised(flux2, latents),
                               _stock(pipe, flux2, noise, guidance_scale, "latent"), atol=1e-5, rtol=0)
    reference = _stock(pipe, flux2, noise, guidance_scale)
    assert images.shape == reference.shape == (2, 3, 32, 32)
    assert ((images > 0) & (images < 1)).float().mean() > 0.9   # real pixel values
    torch.testing.assert_close(images, reference, atol=1e-5, rtol=0)


def test_cfg_is_the_plain_linear_combination(flux2):
    x = flux2.initial_noise(2, torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.9, 0.4])
    cond = flux2.encode_prompts(PROMPTS)
    assert cond.negative is not None
    with torch.no_grad():
        v_pos = flux2.velocity(x, sigma, Conditioning(positive=cond.positive, extra=cond.extra), 1.0)
        v_neg = flux2.velocity(x, sigma, Conditioning(positive=cond.negative, extra=cond.extra), 1.0)
        v_cfg = flux2.velocity(x, sigma, cond, 4.0)
        v_one = flux2.velocity(x, sigma, cond, 1.0)
    torch.testing.assert_close(v_cfg, v_neg + 4.0 * (v_pos - v_neg), atol=2e-5, rtol=0)
    torch.testing.assert_close(v_one, v_pos)          # guidance 1: the conditional branch only
    assert (v_pos - v_neg).abs().max() > 1e-3         # the prompt matters


def test_step_distilled_klein_never_runs_cfg(distilled_dir):
    """is_distilled true: no negative prompt is encoded, guidance_scale changes nothing, and the
    stock pipeline (which ignores the scale too) gives the same samples."""
    model = load_model("flux2", distilled_dir, options=OPTIONS)
    assert model.is_distilled and not model.has_real_cfg
    cond = model.encode_prompts(PROMPTS)
    assert cond.negative is None
    noise = model.initial_noise(2, torch.Generator().manual_seed(3))
    latents = _ode_latents(model, noise, 4.0)
    torch.testing.assert_close(latents, _ode_latents(model, noise, 1.0), atol=0, rtol=0)
    pipe = _stock_pipeline(distilled_dir)
    assert pipe.config.is_distilled and model.to_pipeline().config.is_distilled
    torch.testing.assert_close(_denormalised(model, latents), _stock(pipe, model, noise, 4.0, "latent"),
                               atol=1e-5, rtol=0)


def test_initial_noise_is_what_the_pipeline_draws_from_the_same_generator(flux2, tiny_flux2_dir):
    pipe = _stock_pipeline(tiny_flux2_dir)
    drawn, _ = pipe.prepare_latents(2, 8, 32, 32, torch.float32, "cpu", torch.Generator().manual_seed(7))
    noise = flux2.initial_noise(2, torch.Generator().manual_seed(7))
    assert noise.shape == (2, 4, 32) and noise.dtype == torch.float32
    assert torch.equal(noise, drawn)


def test_packing_and_position_ids_are_the_pipelines(flux2):
    """FLUX.2's patchify-then-flatten is FLUX.1's pack_latents; the ids are (t, h, w, l)."""
    pipe = flux2.to_pipeline()
    z = torch.randn(2, 8, 4, 6, generator=torch.Generator().manual_seed(1))
    packed = pipe._pack_latents(pipe._patchify_latents(z))
    assert torch.equal(packed, pack_latents(z))
    assert torch.equal(unpack_latents(packed, 4, 6), z)
    patchified = pipe._patchify_latents(z)
    assert torch.equal(image_position_ids(4, 6), pipe._prepare_latent_ids(patchified)[0])
    assert image_position_ids(4, 6)[4].tolist() == [0, 1, 1, 0]   # token 4: row 1, column 1
    text = torch.zeros(1, 5, 3)
    assert torch.equal(text_position_ids(5), pipe._prepare_text_ids(text)[0])
    assert text_position_ids(5)[:, 3].tolist() == [0, 1, 2, 3, 4]


def test_empirical_mu_and_sigmas(flux2):
    """mu is BFL's fit (equal to the pipeline's compute_empirical_mu), the schedule is the
    exponential time shift e^mu / (e^mu + 1/s - 1) of linspace(1, 1/N, N), then 0."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    for tokens in (4, 256, 1024, 4300, 4301, 9000):
        for steps in (1, 4, 28, 50, 200, 300):
            expected_mu = compute_empirical_mu(tokens, steps)
            assert empirical_mu(tokens, steps) == pytest.approx(expected_mu, abs=1e-12)
    assert empirical_mu(1024, 200) == pytest.approx(0.00016927 * 1024 + 0.45666666)
    assert empirical_mu(1024, 10) == pytest.approx(8.73809524e-05 * 1024 + 1.89833333)
    num_steps = 6
    mu = empirical_mu(4, num_steps)
    grid = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    expected = torch.cat([(math.exp(mu) / (math.exp(mu) + 1.0 / grid - 1.0)).float(), torch.zeros(1)])
    sigmas = flux2.sigmas(num_steps)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps + 1,)
    torch.testing.assert_close(sigmas, expected, atol=1e-6, rtol=0)
    assert not torch.equal(flux2.sigmas(4)[1], flux2.sigmas(8)[1])   # mu depends on N


def test_decode_undoes_the_batch_norm_statistics(flux2):
    mean, std = flux2.latent_statistics()
    bn = flux2.vae.bn
    assert mean.shape == std.shape == (32,)
    torch.testing.assert_close(std, torch.sqrt(bn.running_var + flux2.vae.config.batch_norm_eps))
    assert (mean.abs() > 0).all() and ((std - 1).abs() > 1e-3).any()   # not the identity
    tokens = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(5))
    z = unpack_latents(tokens * std + mean, 4, 4)
    with torch.no_grad():
        expected = (flux2.vae.decode(z, return_dict=False)[0] * 0.5 + 0.5).clamp(0, 1)
    torch.testing.assert_close(flux2.decode(tokens), expected)


def test_prompt_embeddings_are_cached_and_padded_to_max_length(tiny_flux2_dir):
    model = load_model("flux2", tiny_flux2_dir, options=OPTIONS)
    counter = CallCounter([model.components["text_encoder"]])
    try:
        cond = model.encode_prompts(["a", PROMPTS[1], "a"])
        assert counter.calls == 2      # ["a", long prompt] in one call, then the negative ""
        again = model.encode_prompts([PROMPTS[1]])
        assert counter.calls == 2
    finally:
        counter.remove()
    assert cond.positive["prompt_embeds"].shape == (3, MAX_SEQUENCE_LENGTH, 48)
    assert cond.negative["prompt_embeds"].shape == (3, MAX_SEQUENCE_LENGTH, 48)
    assert torch.equal(cond.extra["text_ids"], text_position_ids(MAX_SEQUENCE_LENGTH))
    assert torch.equal(again.positive["prompt_embeds"][0], cond.positive["prompt_embeds"][1])


def test_lora_saved_by_adapter_loads_into_stock_pipeline(tiny_flux2_dir, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict

    model = load_model("flux2", tiny_flux2_dir, options=OPTIONS)
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_modules,
                                             init_lora_weights="gaussian"))
    # 12 double-block targets in the one double block, 2 in each of the 2 single blocks
    assert perturb_lora(model.transformer) == len(FLUX2_DOUBLE_BLOCK_TARGETS) + 2 * 2
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    ours = model.decode(_ode_latents(model, noise, 4.0))
    model.save_lora_weights(str(tmp_path), get_peft_model_state_dict(model.transformer))
    pipe = _stock_pipeline(tiny_flux2_dir)
    without_lora = _stock(pipe, model, noise, 4.0)
    pipe.load_lora_weights(str(tmp_path))
    with_lora = _stock(pipe, model, noise, 4.0)
    assert (with_lora - without_lora).abs().max() > 1e-2   # the LoRA changes the images
    torch.testing.assert_close(ours, with_lora, atol=1e-5, rtol=0)


def test_default_size_is_the_pipelines(tiny_flux2_dir, flux2):
    model = load_model("flux2", tiny_flux2_dir, options={"max_sequence_length": MAX_SEQUENCE_LENGTH})
    pipe = flux2.to_pipeline()
    side = pipe.default_sample_size * pipe.vae_scale_factor
    assert (model.options.height, model.options.width) == (side, side) == (1024, 1024)
    assert model.packed_shape == ((1024 // 16) ** 2, 32)


def test_errors_are_raised_before_weights_load(tiny_flux2_dir, tmp_path, monkeypatch):
    def variant(name: str, edit) -> str:
        folder = tmp_path / name
        shutil.copytree(tiny_flux2_dir, folder)
        edit(folder)
        return str(folder)

    def set_json(path, **values):
        path.write_text(json.dumps({**json.loads(path.read_text()), **values}))

    incomplete = variant("incomplete", lambda f: shutil.rmtree(f / "tokenizer"))
    kontext = variant("kontext", lambda f: set_json(f / "model_index.json",
                                                    _class_name="FluxKontextPipeline"))
    embedded = variant("embedded", lambda f: set_json(f / "transformer" / "config.json",
                                                      guidance_embeds=True))
    flow_sigmas = variant("flow_sigmas", lambda f: set_json(f / "scheduler" / "scheduler_config.json",
                                                            use_flow_sigmas=True))
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="tokenizer/tokenizer_config.json"):
        load_model("flux2", incomplete, options=OPTIONS)
    with pytest.raises(ValueError, match="FluxKontextPipeline folder"):
        load_model("flux2", kontext, options=OPTIONS)
    with pytest.raises(ValueError, match="guidance_embeds=True"):
        load_model("flux2", embedded, options=OPTIONS)
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        load_model("flux2", flow_sigmas, options=OPTIONS)
    with pytest.raises(ValueError, match="height must be divisible by 16"):
        load_model("flux2", tiny_flux2_dir, options={**OPTIONS, "height": 40})
    with pytest.raises(ValueError, match=r"max_sequence_length must be in \[1, 512\]"):
        load_model("flux2", tiny_flux2_dir, options={**OPTIONS, "max_sequence_length": 1024})
    with pytest.raises(ValueError, match=r"unknown flux2 option\(s\) \['guidance'\]"):
        load_model("flux2", tiny_flux2_dir, options={"guidance": 4.0})


# ------------------------------------------------------------------------------- training
def _train_config(path, tmp_path, *overrides: str, iterations: int = 1, options: dict = OPTIONS):
    return family_config("flux2", path, tmp_path, options, *overrides, guidance_scale=4.0,
                         iterations=iterations)


def test_trained_checkpoint_is_on_policy_first_and_loads_into_stock_pipeline(tiny_flux2_dir,
                                                                            tmp_path):
    """Two GRPO iterations with real CFG 4 and a KL to the LoRA-free reference: the first pass
    is exactly on-policy (ratio 1), the LoRA moves, and the checkpoint's LoRA, loaded by the
    stock pipeline, reproduces the trained adapter's samples."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(_train_config(tiny_flux2_dir, tmp_path, "training.kl_beta=0.01", iterations=2))
    history = [h for h in trainer.train() if h["phase"] == "train"]
    assert all(h["train/replay_batches"] > 0 for h in history)
    assert [h["train/first_pass_ratio_max_dev"] for h in history] == [0.0, 0.0]
    assert history[1]["train/kl"] > 0   # LoRA moved away from the adapter-free reference
    checkpoint = trainer.run_dir / "checkpoints" / "2"
    assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
    noise = trainer.model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(5))
    ours = trainer.model.decode(_ode_latents(trainer.model, noise, 4.0))
    pipe = _stock_pipeline(tiny_flux2_dir)
    base = _stock(pipe, trainer.model, noise, 4.0)
    pipe.load_lora_weights(str(checkpoint))
    trained = _stock(pipe, trainer.model, noise, 4.0)
    assert (trained - base).abs().max() > 0   # training moved the weights
    torch.testing.assert_close(ours, trained, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------- FLUX.2-dev
DEV_OPTIONS = {"height": 32, "width": 32, "max_sequence_length": 128}   # system message ~50 tokens


@pytest.fixture(scope="module")
def flux2_dev(tiny_flux2_dev_dir):
    return load_model("flux2", tiny_flux2_dev_dir, options=DEV_OPTIONS)


def _stock_dev(directory):
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _dev_call(pipe, model, noise: Tensor, guidance_scale: float, output_type: str = "pt") -> Tensor:
    """Flux2Pipeline's sampling; its output_type="latent" is the packed, normalised latents."""
    return pipe(prompt=PROMPTS, height=32, width=32, num_inference_steps=NUM_STEPS,
                guidance_scale=guidance_scale, latents=_patchified(noise, model),
                output_type=output_type, max_sequence_length=DEV_OPTIONS["max_sequence_length"]).images


def test_dev_variant_is_read_from_the_model_index(flux2_dev):
    assert flux2_dev.family == "flux2" and flux2_dev.pipeline_class.__name__ == "Flux2Pipeline"
    assert not flux2_dev.has_real_cfg and flux2_dev.transformer.config.guidance_embeds
    assert type(flux2_dev.components["text_encoder"]).__name__ == "Mistral3ForConditionalGeneration"
    assert type(flux2_dev.components["tokenizer"]).__name__ == "PixtralProcessor"
    cond = flux2_dev.encode_prompts(PROMPTS)
    assert cond.negative is None   # guidance-distilled: no real CFG
    assert cond.positive["prompt_embeds"].shape == (2, DEV_OPTIONS["max_sequence_length"], 48)


@pytest.mark.parametrize("guidance_scale", [1.0, 3.5], ids=["guidance_1", "guidance_3.5"])
def test_dev_ode_matches_stock_pipeline(flux2_dev, tiny_flux2_dev_dir, guidance_scale):
    noise = flux2_dev.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    latents = _ode_latents(flux2_dev, noise, guidance_scale)
    pipe = _stock_dev(tiny_flux2_dev_dir)
    torch.testing.assert_close(latents, _dev_call(pipe, flux2_dev, noise, guidance_scale, "latent"),
                               atol=1e-5, rtol=0)
    images = flux2_dev.decode(latents)
    reference = _dev_call(pipe, flux2_dev, noise, guidance_scale)
    assert ((images > 0) & (images < 1)).float().mean() > 0.9
    torch.testing.assert_close(images, reference, atol=1e-5, rtol=0)


def test_dev_guidance_scale_feeds_the_embedding(flux2_dev):
    x = flux2_dev.initial_noise(2, torch.Generator().manual_seed(1))
    cond = flux2_dev.encode_prompts(PROMPTS)
    calls = []
    hook = flux2_dev.transformer.register_forward_hook(lambda m, args, kwargs, out: calls.append(kwargs),
                                                       with_kwargs=True)
    try:
        with torch.no_grad():
            v1 = flux2_dev.velocity(x, torch.tensor([0.8, 0.3]), cond, 1.0)
            v35 = flux2_dev.velocity(x, torch.tensor([0.8, 0.3]), cond, 3.5)
    finally:
        hook.remove()
    assert len(calls) == 2                                   # one forward per velocity
    assert calls[1]["guidance"].tolist() == [3.5, 3.5]
    assert (v1 - v35).abs().max() > 1e-4


def test_dev_lora_round_trip_and_first_pass(tiny_flux2_dev_dir, tmp_path):
    """The dev LoRA loads into Flux2Pipeline and reproduces the adapter's samples; a GRPO
    iteration on dev (guidance embedding 3.5) is exactly on-policy on its first pass."""
    from peft import LoraConfig, get_peft_model_state_dict

    from flowgrpo.trainer import Trainer

    model = load_model("flux2", tiny_flux2_dev_dir, options=DEV_OPTIONS)
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_modules,
                                             init_lora_weights="gaussian"))
    perturb_lora(model.transformer)
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    ours = model.decode(_ode_latents(model, noise, 3.5))
    model.save_lora_weights(str(tmp_path / "lora"), get_peft_model_state_dict(model.transformer))
    pipe = _stock_dev(tiny_flux2_dev_dir)
    without_lora = _dev_call(pipe, model, noise, 3.5)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    with_lora = _dev_call(pipe, model, noise, 3.5)
    assert (with_lora - without_lora).abs().max() > 1e-2
    torch.testing.assert_close(ours, with_lora, atol=1e-5, rtol=0)

    config = _train_config(tiny_flux2_dev_dir, tmp_path, "sampling.guidance_scale=3.5",
                           options=DEV_OPTIONS)
    metrics = Trainer(config).run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0


def test_tiny_recipes_pick_the_variants_build():
    from flowgrpo.tiny_recipe import tiny_build_name

    assert tiny_build_name("flux2", "black-forest-labs/FLUX.2-dev") == "flux2_dev"
    assert tiny_build_name("flux2", "black-forest-labs/FLUX.2-klein-base-9B") == "flux2"
    assert tiny_build_name("flux2", "black-forest-labs/FLUX.2-klein-4B") == "flux2"


def test_the_tiny_qwen3_chat_template_renders_qwen3s_format():
    """The tiny builds' Qwen3 chat template (FLUX.2-klein, Z-Image) keeps the newlines of
    Qwen3's own: <|im_end|>\\n<|im_start|>assistant\\n, and the empty think block when thinking
    is off."""
    import jinja2

    from pipelines.tiny import QWEN3_CHAT_TEMPLATE

    template = jinja2.Template(QWEN3_CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "a red cube"}]
    assert template.render(messages=messages, add_generation_prompt=True) == \
        "<|im_start|>user\na red cube<|im_end|>\n<|im_start|>assistant\n"
    assert template.render(messages=messages, add_generation_prompt=True,
                           enable_thinking=False) == \
        "<|im_start|>user\na red cube<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
