"""The toy flow model adapter (pipelines/toy.py): FlowModel contract, loading, CFG, LoRA."""
from __future__ import annotations

import os

import pytest
import torch

from flowgrpo.model import Conditioning, FlowModel
from pipelines.toy import ToyArchitecture, ToyFlowModel, ToyOptions, build_toy_model

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "toy")
HAVE_ASSETS = os.path.exists(os.path.join(ASSETS, "transformer", "config.json"))
TINY = ToyArchitecture(num_layers=2, num_attention_heads=2, attention_head_dim=8, text_hidden_size=16,
                       text_heads=2, pooled_dim=16)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("toy_tiny"))
    model = build_toy_model(TINY, seed=0)
    # give the zero-initialised output layers some weight so velocities depend on the inputs
    with torch.no_grad():
        for p in model.transformer.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_dir) -> ToyFlowModel:
    return ToyFlowModel.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def model(tiny_dir) -> ToyFlowModel:
    """The pretrained assets when present, else the tiny random build."""
    return ToyFlowModel.from_pretrained(ASSETS if HAVE_ASSETS else tiny_dir)


def _ode_sample(model: ToyFlowModel, prompts: list[str], steps: int, guidance: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    cond = model.encode_prompts(prompts)
    x = model.initial_noise(len(prompts), generator)
    sigmas = model.sigmas(steps)
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            x = x + (sigma_next - sigma) * model.velocity(x, sigma.expand(len(prompts)), cond, guidance)
    return model.decode(x)


def test_implements_the_flow_model_protocol(model):
    assert isinstance(model, FlowModel)
    assert model.family == "toy" and model.dtype == torch.float32
    assert model.device == torch.device("cpu")
    assert not any(p.requires_grad for p in model.transformer.parameters())


def test_from_pretrained_round_trip_reproduces_velocities(tiny_dir, tiny, tmp_path):
    tiny.save_pretrained(str(tmp_path))
    again = ToyFlowModel.from_pretrained(str(tmp_path))
    x = tiny.initial_noise(2, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.3])
    prompts = ["a red circle", "two squares"]
    with torch.no_grad():
        v1 = tiny.velocity(x, sigma, tiny.encode_prompts(prompts), 1.0)
        v2 = again.velocity(x, sigma, again.encode_prompts(prompts), 1.0)
    assert torch.equal(v1, v2)
    assert again.defaults == tiny.defaults


def test_from_pretrained_rejects_bad_arguments(tiny_dir):
    with pytest.raises(ValueError, match="path"):
        ToyFlowModel.from_pretrained(os.path.join(tiny_dir, "missing"))
    with pytest.raises(ValueError, match="shfit"):
        ToyFlowModel.from_pretrained(tiny_dir, options={"shfit": 3.0})
    with pytest.raises(ValueError, match="shift"):
        ToyOptions(shift=0.0)


def test_tokenizer_is_offline_padded_and_word_order_matters(tiny):
    ids = tiny.tokenize(["a circle left of a square", "a square left of a circle", ""])
    tok = tiny.tokenizer
    assert ids.shape == (3, tok.model_max_length)
    assert ids[0, 0] == tok.bos_token_id and ids[0, 7] == tok.eos_token_id
    assert ids[2, :2].tolist() == [tok.bos_token_id, tok.eos_token_id]
    assert (ids[2, 2:] == tok.pad_token_id).all()
    assert sorted(ids[0].tolist()) == sorted(ids[1].tolist())       # same words ...
    cond = tiny.encode_prompts(["a circle left of a square", "a square left of a circle"])
    pooled = cond.positive["pooled_prompt_embeds"]
    assert not torch.allclose(pooled[0], pooled[1])                  # ... different meaning
    assert tok.unk_token_id in tiny.tokenize(["a purple circle"])[0].tolist()


def test_encode_prompts_shapes_negative_and_cache(tiny):
    cond = tiny.encode_prompts(["a circle", "two squares", "a circle"])
    assert isinstance(cond, Conditioning) and cond.batch_size == 3
    states, pooled = cond.positive["prompt_embeds"], cond.positive["pooled_prompt_embeds"]
    assert states.shape == (3, tiny.tokenizer.model_max_length, TINY.text_hidden_size)
    assert pooled.shape == (3, TINY.pooled_dim)
    assert torch.equal(states[0], states[2])
    empty = tiny.encode_prompts([""])
    assert torch.equal(cond.negative["pooled_prompt_embeds"][1], empty.positive["pooled_prompt_embeds"][0])
    with pytest.raises(TypeError, match="list"):
        tiny.encode_prompts("a circle")


def test_sigmas_uniform_and_shifted():
    base = build_toy_model(TINY)
    sigmas = base.sigmas(4)
    assert torch.allclose(sigmas, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    shifted = ToyFlowModel(base.transformer, base.text_encoder, base.tokenizer, base.defaults,
                           ToyOptions(shift=3.0)).sigmas(4)
    # shift 3: s' = 3 s / (1 + 2 s); at s = 0.5 -> 0.75
    assert shifted[0] == 1.0 and shifted[-1] == 0.0 and shifted[2] == pytest.approx(0.75)
    assert (shifted[1:] < shifted[:-1]).all() and shifted.dtype == torch.float32
    with pytest.raises(ValueError, match="num_steps"):
        base.sigmas(0)


def test_velocity_uses_timestep_1000_sigma_and_real_cfg(tiny):
    prompts = ["a red circle and a blue square", "three triangles"]
    cond = tiny.encode_prompts(prompts)
    x = tiny.initial_noise(2, torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.8, 0.2])
    with torch.no_grad():
        direct = tiny.transformer(hidden_states=x, encoder_hidden_states=cond.positive["prompt_embeds"],
                                  pooled_projections=cond.positive["pooled_prompt_embeds"],
                                  timestep=1000 * sigma, return_dict=False)[0]
        v_pos = tiny.velocity(x, sigma, cond, 1.0)
        v_neg = tiny.velocity(x, sigma, Conditioning(cond.negative), 1.0)
        v_cfg = tiny.velocity(x, sigma, cond, 4.5)
        v_no_negative = tiny.velocity(x, sigma, Conditioning(cond.positive), 4.5)
        v_row = tiny.velocity(x[1:], sigma[1:], cond.select([1]), 4.5)
    assert v_pos.dtype == torch.float32 and v_pos.shape == x.shape
    assert torch.allclose(v_pos, direct, atol=1e-6)
    assert torch.allclose(v_cfg, v_neg + 4.5 * (v_pos - v_neg), atol=1e-5)
    assert not torch.allclose(v_cfg, v_pos, atol=1e-4)
    assert torch.allclose(v_no_negative, v_pos, atol=1e-6)
    assert torch.allclose(v_row, v_cfg[1:], atol=1e-5)
    with pytest.raises(ValueError, match="sigma"):
        tiny.velocity(x, torch.tensor([0.5, 0.5, 0.5]), cond, 1.0)


def test_initial_noise_and_decode(tiny):
    a = tiny.initial_noise(3, torch.Generator().manual_seed(7))
    b = tiny.initial_noise(3, torch.Generator().manual_seed(7))
    assert a.shape == (3, 3, 24, 24) and a.dtype == torch.float32 and torch.equal(a, b)
    x = torch.tensor([-3.0, -1.0, 0.0, 1.0, 2.0]).view(1, 5, 1, 1).expand(1, 5, 1, 1)
    assert tiny.decode(x).flatten().tolist() == [0.0, 0.0, 0.5, 1.0, 1.0]


def test_ode_sample_decodes_to_images(model):
    images = _ode_sample(model, ["a red circle", "two squares", "a circle left of a square"], 6,
                         model.defaults.guidance_scale, seed=0)
    assert images.shape == (3, 3, 24, 24) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1


@pytest.mark.skipif(not HAVE_ASSETS, reason="assets/toy not built (scripts/pretrain_toy.py)")
def test_pretrained_model_draws_what_it_is_told():
    from flowgrpo.toyworld.grammar import parse_prompt
    from reward_models.geneval_toy import GenevalToyReward

    model = ToyFlowModel.from_pretrained(ASSETS)
    prompts = ["a red circle", "a blue square", "a green triangle", "a yellow circle",
               "a cyan square", "a magenta triangle"] * 4
    images = _ode_sample(model, prompts, model.defaults.eval_steps, model.defaults.guidance_scale, seed=0)
    scores = GenevalToyReward().components(images, prompts, [parse_prompt(p) for p in prompts])
    # measured: pretrained 0.17 exact / 0.47 partial (seed 1: 0.38 / 0.67; the base draws near
    # misses by design, docs/toy_world.md); a random init 0.0 / 0.35
    assert scores["exact"].mean() >= 0.1
    assert scores["partial"].mean() >= 0.42


def test_lora_weights_round_trip_through_diffusers_loader(tiny, tmp_path):
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = SD3Transformer2DModel.from_config(tiny.transformer.config)
    transformer.load_state_dict(tiny.transformer.state_dict())
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=tiny.lora_target_modules,
                                       init_lora_weights="gaussian"))
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    state = get_peft_model_state_dict(transformer)
    assert state and any("add_q_proj" in k for k in state) and any("to_out.0" in k for k in state)
    tiny.save_lora_weights(str(tmp_path), state, transformer.peft_config["default"])
    assert os.path.exists(tmp_path / "pytorch_lora_weights.safetensors")

    fresh = SD3Transformer2DModel.from_config(tiny.transformer.config)
    fresh.load_state_dict(tiny.transformer.state_dict())
    fresh.load_lora_adapter(str(tmp_path), prefix="transformer",
                           weight_name="pytorch_lora_weights.safetensors")
    cond = tiny.encode_prompts(["a red circle"])
    kwargs = dict(hidden_states=torch.randn(1, 3, 24, 24, generator=torch.Generator().manual_seed(0)),
                  encoder_hidden_states=cond.positive["prompt_embeds"],
                  pooled_projections=cond.positive["pooled_prompt_embeds"],
                  timestep=torch.tensor([500.0]), return_dict=False)
    with torch.no_grad():
        expected = transformer(**kwargs)[0]
        loaded = fresh(**kwargs)[0]
        base = tiny.transformer(**kwargs)[0]
    assert torch.allclose(loaded, expected, atol=1e-5)
    assert not torch.allclose(base, expected, atol=1e-4)
    with pytest.raises(ValueError, match="transformer_lora_state_dict"):
        tiny.save_lora_weights(str(tmp_path), {})


def test_the_training_methods_switch_what_trains_and_what_runs(tiny_dir):
    """FlowModel's training methods (pipelines.training.TransformerTraining, as for every family):
    add_lora leaves only the adapter trainable, disable_lora runs the base weights exactly and
    enable_lora the adapter again, lora_state_dict holds the adapter's tensors, and
    train_full_weights unfreezes the transformer."""
    model = ToyFlowModel.from_pretrained(tiny_dir)
    cond = model.encode_prompts(["a red circle"])
    x = model.initial_noise(1, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.5])
    with torch.no_grad():
        base = model.velocity(x, sigma, cond, 1.0)
        model.add_lora(4, 8, model.lora_target_modules, "gaussian")
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
        adapted = model.velocity(x, sigma, cond, 1.0)
        model.disable_lora()
        disabled = model.velocity(x, sigma, cond, 1.0)
        model.enable_lora()
        enabled = model.velocity(x, sigma, cond, 1.0)
    trainable = {n for n, p in model.transformer.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert (adapted - base).abs().max() > 1e-3
    assert torch.equal(disabled, base) and torch.equal(enabled, adapted)
    state = model.lora_state_dict()
    assert len(state) == len(trainable) and all("lora_" in k for k in state)
    frozen = ToyFlowModel.from_pretrained(tiny_dir)
    assert not any(p.requires_grad for p in frozen.transformer.parameters())
    frozen.train_full_weights()
    assert all(p.requires_grad for p in frozen.transformer.parameters())
