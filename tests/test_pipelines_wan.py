"""Wan2.1 adapter: parity with WanPipeline (Euler scheduler with the checkpoint's flow shift),
LoRA round trip, frame-count and size validation, caching."""
from __future__ import annotations

import shutil

import pytest
import torch

from pipelines import load_model
from flowgrpo.model import FlowModel
from tests.pipeline_helpers import (TINY_MAX_SEQUENCE_LENGTH, VIDEO_OPTIONS, CallCounter,
                                    fail_on_weight_loading, ode_sample, perturb_lora)

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


# ================================================================================ Wan2.2
# Two experts (transformer = high noise, transformer_2 = low noise) switched at boundary_ratio.
WAN22_STEPS = 6   # shift 3: the first two steps are high noise (t >= 875), the other four low


@pytest.fixture(scope="module")
def wan22(tiny_wan22_dir):
    return load_model("wan", tiny_wan22_dir, options=VIDEO_OPTIONS)


def _wan22_pipeline(directory, shift):
    return _stock_pipeline(directory, shift)


def _wan22_stock(pipe, noise, guidance_scale, guidance_scale_2=None, output_type="pt", steps=WAN22_STEPS):
    out = pipe(PROMPTS, height=VIDEO_OPTIONS["height"], width=VIDEO_OPTIONS["width"],
               num_frames=VIDEO_OPTIONS["num_frames"], num_inference_steps=steps,
               guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, latents=noise.clone(),
               output_type=output_type, max_sequence_length=TINY_MAX_SEQUENCE_LENGTH)
    return out.frames


@torch.no_grad()
def _ode_latents(model, noise, num_steps, guidance_scale):
    cond = model.encode_prompts(PROMPTS)
    sigmas = model.sigmas(num_steps)
    x = noise.clone().float()
    for i in range(num_steps):
        x = x + model.velocity(x, sigmas[i].expand(len(x)), cond, guidance_scale) * (sigmas[i + 1] - sigmas[i])
    return x


class ExpertLog:
    """Which expert ran at which timestep: forward pre-hooks on both experts."""

    def __init__(self, experts: dict[str, torch.nn.Module]) -> None:
        self.calls: list[tuple[str, tuple[float, ...]]] = []
        self._handles = [module.register_forward_pre_hook(self._hook(name), with_kwargs=True)
                         for name, module in experts.items()]

    def _hook(self, name):
        def hook(module, args, kwargs):
            timestep = kwargs["timestep"] if "timestep" in kwargs else args[1]
            self.calls.append((name, tuple(float(t) for t in timestep.reshape(-1))))
        return hook

    def by_timestep(self) -> dict[float, set[str]]:
        out: dict[float, set[str]] = {}
        for name, timesteps in self.calls:
            for t in timesteps:
                out.setdefault(t, set()).add(name)
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def test_wan22_loads_both_experts(wan22):
    from pipelines.wan22 import WanExperts

    experts = wan22.transformer
    assert isinstance(experts, WanExperts) and isinstance(wan22, FlowModel)
    assert wan22.boundary_ratio == 0.875 and experts.boundary_timestep == 875.0
    assert not torch.equal(experts.transformer.blocks[0].attn1.to_q.weight,
                           experts.transformer_2.blocks[0].attn1.to_q.weight)
    pipe = wan22.to_pipeline()
    assert pipe.transformer is experts.transformer and pipe.transformer_2 is experts.transformer_2
    assert pipe.config.boundary_ratio == 0.875
    keys = set(experts.state_dict())
    assert any(k.startswith("transformer.blocks.") for k in keys) and any(k.startswith("transformer_2.") for k in keys)


@pytest.mark.parametrize("guidance_scale, guidance_scale_2", [(1.0, None), (5.0, None), (4.0, 3.0)],
                         ids=["cfg_off", "cfg_on", "cfg_per_expert"])
def test_wan22_ode_matches_stock_pipeline(tiny_wan22_dir, guidance_scale, guidance_scale_2):
    model = load_model("wan", tiny_wan22_dir, options={**VIDEO_OPTIONS, "guidance_scale_2": guidance_scale_2})
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    latents = _ode_latents(model, noise, WAN22_STEPS, guidance_scale)
    videos = model.decode(latents)
    pipe = _wan22_pipeline(tiny_wan22_dir, model.shift)
    reference_latents = _wan22_stock(pipe, noise, guidance_scale, guidance_scale_2, "latent")
    torch.testing.assert_close(latents, reference_latents, atol=1e-5, rtol=0)
    reference = _wan22_stock(pipe, noise, guidance_scale, guidance_scale_2)
    assert videos.shape == reference.shape == (2, 5, 3, 32, 32)
    assert ((videos > 0) & (videos < 1)).float().mean() > 0.9
    torch.testing.assert_close(videos, reference, atol=1e-5, rtol=0)


def test_wan22_guidance_scale_2_changes_only_low_noise_steps(tiny_wan22_dir, wan22):
    other = load_model("wan", tiny_wan22_dir, options={**VIDEO_OPTIONS, "guidance_scale_2": 1.5})
    x = wan22.initial_noise(2, torch.Generator().manual_seed(1))
    cond = wan22.encode_prompts(PROMPTS)
    with torch.no_grad():
        for sigma, same in ((0.95, True), (0.5, False)):
            a = wan22.velocity(x, torch.full((2,), sigma), cond, 5.0)
            b = other.velocity(x, torch.full((2,), sigma), cond, 5.0)
            assert torch.equal(a, b) == same


def test_wan22_expert_at_every_step_is_the_pipelines_choice(tiny_wan22_dir):
    """Hooks on both experts: over a whole CFG run, each timestep is handled by the same expert in
    the adapter as in WanPipeline (same Euler grid), and both experts take part."""
    model = load_model("wan", tiny_wan22_dir, options=VIDEO_OPTIONS)
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(2))
    experts = {"high": model.transformer.transformer, "low": model.transformer.transformer_2}
    ours = ExpertLog(experts)
    try:
        _ode_latents(model, noise, WAN22_STEPS, 5.0)
    finally:
        ours.remove()
    pipe = _wan22_pipeline(tiny_wan22_dir, model.shift)
    theirs = ExpertLog({"high": pipe.transformer, "low": pipe.transformer_2})
    try:
        _wan22_stock(pipe, noise, 5.0, output_type="latent")
    finally:
        theirs.remove()
    chosen = ours.by_timestep()
    assert chosen == theirs.by_timestep()
    assert len(chosen) == WAN22_STEPS and all(len(names) == 1 for names in chosen.values())
    by_step = [next(iter(chosen[t])) for t in sorted(chosen, reverse=True)]
    assert by_step == ["high", "high", "low", "low", "low", "low"]
    expected = model.high_noise_steps(model.sigmas(WAN22_STEPS)[:-1]).tolist()
    assert by_step == ["high" if h else "low" for h in expected]


def test_wan22_rows_on_both_sides_of_the_boundary_go_to_their_experts(wan22):
    x = wan22.initial_noise(2, torch.Generator().manual_seed(3))
    cond = wan22.encode_prompts(PROMPTS)
    log = ExpertLog({"high": wan22.transformer.transformer, "low": wan22.transformer.transformer_2})
    try:
        with torch.no_grad():
            mixed = wan22.velocity(x, torch.tensor([0.3, 0.95]), cond, 5.0)
    finally:
        log.remove()
    assert log.by_timestep() == {300.0: {"low"}, 950.0: {"high"}}
    with torch.no_grad():
        low = wan22.velocity(x[:1], torch.tensor([0.3]), cond.select([0]), 5.0)
        high = wan22.velocity(x[1:], torch.tensor([0.95]), cond.select([1]), 5.0)
    torch.testing.assert_close(mixed, torch.cat([low, high]), atol=1e-5, rtol=0)


def test_wan22_lora_on_both_experts_loads_into_stock_pipeline(tiny_wan22_dir, tmp_path):
    from pipelines.wan22 import LORA_WEIGHTS_NAME, LOW_NOISE_LORA_WEIGHTS_NAME, load_wan22_lora

    model = load_model("wan", tiny_wan22_dir, options=VIDEO_OPTIONS)
    model.add_lora(4, 8, model.lora_target_modules, "gaussian")
    assert perturb_lora(model.transformer) == 2 * 2 * 10   # 2 experts x 2 blocks x 10 targets
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    ours = model.decode(_ode_latents(model, noise, WAN22_STEPS, 5.0))
    model.save_lora_weights(str(tmp_path), model.lora_state_dict())
    assert (tmp_path / LORA_WEIGHTS_NAME).is_file() and (tmp_path / LOW_NOISE_LORA_WEIGHTS_NAME).is_file()
    pipe = _wan22_pipeline(tiny_wan22_dir, model.shift)
    without_lora = _wan22_stock(pipe, noise, 5.0)
    # The stock loader, expert by expert (load_wan22_lora is exactly these two calls).
    pipe.load_lora_weights(str(tmp_path))
    high_only = _wan22_stock(pipe, noise, 5.0)
    pipe.load_lora_weights(str(tmp_path), weight_name=LOW_NOISE_LORA_WEIGHTS_NAME, load_into_transformer_2=True)
    with_lora = _wan22_stock(pipe, noise, 5.0)
    assert (high_only - without_lora).abs().max() > 1e-3 and (with_lora - high_only).abs().max() > 1e-3
    torch.testing.assert_close(ours, with_lora, atol=1e-5, rtol=0)
    fresh = _wan22_pipeline(tiny_wan22_dir, model.shift)
    assert load_wan22_lora(fresh, tmp_path) == ["transformer", "transformer_2"]
    torch.testing.assert_close(_wan22_stock(fresh, noise, 5.0), with_lora, atol=0, rtol=0)


def test_wan22_checkpoint_applied_by_the_cli_loads_both_experts(tiny_wan22_dir, tmp_path):
    """``flowgrpo sample / eval / grid`` apply a Wan2.2 LoRA checkpoint to both experts (one file
    each), check each file against its expert, and leave the exact base weights afterwards."""
    from flowgrpo.checkpoint_inspection import (Checkpoint, check_checkpoint,
                                                checkpoint_applied)

    trained = load_model("wan", tiny_wan22_dir, options=VIDEO_OPTIONS)
    trained.add_lora(4, 8, trained.lora_target_modules, "gaussian")
    perturb_lora(trained.transformer)
    noise = trained.initial_noise(len(PROMPTS), torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = _ode_latents(trained, noise, WAN22_STEPS, 5.0)
    trained.save_lora_weights(str(tmp_path), trained.lora_state_dict())

    base = load_model("wan", tiny_wan22_dir, options=VIDEO_OPTIONS)
    checkpoint = Checkpoint("run@1", "lora", tmp_path)
    check_checkpoint(checkpoint, "wan", tiny_wan22_dir, model=base)
    with torch.no_grad():
        before = _ode_latents(base, noise, WAN22_STEPS, 5.0)
        with checkpoint_applied(base, checkpoint):
            applied = _ode_latents(base, noise, WAN22_STEPS, 5.0)
        after = _ode_latents(base, noise, WAN22_STEPS, 5.0)
    torch.testing.assert_close(applied, expected, atol=1e-5, rtol=0)
    assert (applied - before).abs().max() > 1e-3
    torch.testing.assert_close(after, before, atol=0, rtol=0)


@pytest.mark.parametrize("train_experts, trained, frozen_sigma",
                         [("high", "transformer", 0.3), ("low", "transformer_2", 0.95)])
def test_wan22_train_experts_selects_what_trains(tiny_wan22_dir, tmp_path, train_experts, trained, frozen_sigma):
    from pipelines.wan22 import LORA_WEIGHTS_NAME, LOW_NOISE_LORA_WEIGHTS_NAME

    model = load_model("wan", tiny_wan22_dir, options={**VIDEO_OPTIONS, "train_experts": train_experts})
    experts = model.transformer
    model.add_lora(2, 8, model.lora_target_modules, "default")
    adapted = {name for name in ("transformer", "transformer_2")
               if any("lora_A" in n for n, _ in getattr(experts, name).named_parameters())}
    assert adapted == {trained}
    keys = model.lora_state_dict()
    assert keys and all(k.startswith(trained + ".") for k in keys)
    model.save_lora_weights(str(tmp_path), keys)
    written = {p.name for p in tmp_path.glob("*.safetensors")}
    assert written == {LORA_WEIGHTS_NAME if trained == "transformer" else LOW_NOISE_LORA_WEIGHTS_NAME}
    x = model.initial_noise(1, torch.Generator().manual_seed(5))
    cond = model.encode_prompts(PROMPTS[:1])
    with pytest.raises(ValueError, match=rf"train_experts='{train_experts}'.*train_experts='both'"):
        model.velocity(x, torch.tensor([frozen_sigma]), cond, 5.0)   # gradients on: loss reaches nothing
    with torch.no_grad():   # sampling with the frozen expert is fine
        model.velocity(x, torch.tensor([frozen_sigma]), cond, 5.0)
    # full fine-tuning unfreezes the selected expert only
    experts.requires_grad_(False)
    model.train_full_weights()
    unfrozen = {name for name in ("transformer", "transformer_2")
                if any(p.requires_grad for p in getattr(experts, name).parameters())}
    assert unfrozen == {trained}


def test_wan22_full_weights_save_in_the_pipeline_layout(wan22, tmp_path):
    from diffusers import WanTransformer3DModel

    wan22.save_full_weights(tmp_path)
    for name in ("transformer", "transformer_2"):
        loaded = WanTransformer3DModel.from_pretrained(tmp_path / name)
        original = getattr(wan22.transformer, name).state_dict()
        assert all(torch.equal(v, original[k]) for k, v in loaded.state_dict().items())


def test_wan22_default_size_is_the_pipelines(tiny_wan22_dir):
    """Without size options the model samples at the size WanPipeline uses when given none (the
    checkpoint folder records no size): 480 x 832, 81 frames, the latents its prepare_latents makes."""
    from diffusers import WanPipeline

    from pipelines.wan import pipeline_default_size

    model = load_model("wan", tiny_wan22_dir, options={"max_sequence_length": TINY_MAX_SEQUENCE_LENGTH})
    assert (model.height, model.width, model.num_frames) == pipeline_default_size() == (480, 832, 81)
    pipe = WanPipeline.from_pretrained(tiny_wan22_dir)
    drawn = pipe.prepare_latents(1, 16, 480, 832, 81, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert torch.equal(model.initial_noise(1, torch.Generator().manual_seed(0)), drawn)


@pytest.mark.slow
def test_wan22_samples_at_the_default_size_like_the_pipeline(tiny_wan22_dir):
    """One Euler step at the default 480 x 832 x 81 (latents only: the tiny VAE takes ~80 s to
    decode that): the adapter's latents equal WanPipeline's at its defaults (~20 s)."""
    model = load_model("wan", tiny_wan22_dir, options={"max_sequence_length": TINY_MAX_SEQUENCE_LENGTH})
    noise = model.initial_noise(1, torch.Generator().manual_seed(0))
    cond = model.encode_prompts(PROMPTS[:1])
    sigmas = model.sigmas(1)
    with torch.no_grad():
        ours = noise + model.velocity(noise, sigmas[:1], cond, 1.0) * (sigmas[1] - sigmas[0])
    pipe = _wan22_pipeline(tiny_wan22_dir, model.shift)
    theirs = pipe(PROMPTS[:1], num_inference_steps=1, guidance_scale=1.0, latents=noise.clone(),
                  output_type="latent", max_sequence_length=TINY_MAX_SEQUENCE_LENGTH).frames
    assert ours.shape == theirs.shape == (1, 16, 21, 60, 104)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_wan22_errors_are_raised_before_weights_load(tiny_wan22_dir, tiny_wan_dir, tmp_path, monkeypatch):
    import json

    ti2v = tmp_path / "ti2v"
    shutil.copytree(tiny_wan22_dir, ti2v)
    index = json.loads((ti2v / "model_index.json").read_text())
    (ti2v / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    one_expert = tmp_path / "one_expert"
    shutil.copytree(tiny_wan22_dir, one_expert)
    (one_expert / "model_index.json").write_text(json.dumps({**index, "transformer_2": [None, None]}))
    i2v = tmp_path / "i2v"
    shutil.copytree(tiny_wan22_dir, i2v)
    (i2v / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanImageToVideoPipeline"}))
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="expand_timesteps"):
        load_model("wan", ti2v, options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match="lacks transformer_2"):
        load_model("wan", one_expert, options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match="WanImageToVideoPipeline"):
        load_model("wan", i2v, options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match="options.guidance_scale_2 is for Wan2.2"):
        load_model("wan", tiny_wan_dir, options={**VIDEO_OPTIONS, "guidance_scale_2": 3.0})
    with pytest.raises(ValueError, match="options.train_experts is for Wan2.2"):
        load_model("wan", tiny_wan_dir, options={**VIDEO_OPTIONS, "train_experts": "high"})
    with pytest.raises(ValueError, match=r"train_experts must be one of \['both', 'high', 'low'\]"):
        load_model("wan", tiny_wan22_dir, options={**VIDEO_OPTIONS, "train_experts": "low_noise"})


# ------------------------------------------------------------------------------- Wan2.2 training
def _wan22_train_config(path, tmp_path, *overrides: str, options=None, iterations: int = 1):
    from flowgrpo.config import load_config

    (tmp_path / "prompts.txt").write_text("a red square\na blue circle\n")
    return load_config(data={
        "name": "wan22",
        "model": {"family": "wan", "path": path, "options": {**VIDEO_OPTIONS, **(options or {})},
                  "lora": {"rank": 2, "alpha": 4}},
        "prompts": {"train": str(tmp_path / "prompts.txt"), "eval": None},
        "sampling": {"num_steps": 4, "rollout_batch_size": 2, "guidance_scale": 4.0},
        "training": {"prompts_per_iteration": 2, "group_size": 2, "lr": 1e-3,
                     "skip_zero_std_groups": False},
        "rewards": {"components": [{"name": "tests.helpers:Brightness"}], "threaded": False},
        "run": {"output_dir": str(tmp_path / "runs"), "max_iterations": iterations, "tracker": "none",
                "progress": False, "checkpoint_every": 0, "eval_every": 0},
    }, overrides=list(overrides))


def _plans():
    from tests.helpers import PLANS

    return PLANS


@pytest.mark.parametrize("plan", sorted(_plans()))
def test_wan22_first_pass_ratio_is_one_under_every_plan(plan, tiny_wan22_dir, tmp_path):
    from flowgrpo.trainer import Trainer

    trainer = Trainer(_wan22_train_config(tiny_wan22_dir, tmp_path, *_plans()[plan],
                                          options={"guidance_scale_2": 3.0}))
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0


def _lora_weights(module, expert):
    return {n: p.detach().clone() for n, p in getattr(module, expert).named_parameters() if "lora_" in n}


def test_wan22_training_updates_both_experts_and_checkpoints_load_into_stock_pipeline(tiny_wan22_dir, tmp_path):
    """A full plan over 4 steps trains steps on both sides of the boundary (with gradient
    checkpointing and a KL to both experts without LoRA): both experts' LoRA move, the checkpoint
    holds one file per expert, and the stock pipeline with both loaded reproduces the trained
    adapter's samples."""
    from flowgrpo.trainer import Trainer

    from pipelines.wan22 import LORA_WEIGHTS_NAME, LOW_NOISE_LORA_WEIGHTS_NAME, load_wan22_lora

    trainer = Trainer(_wan22_train_config(tiny_wan22_dir, tmp_path, "model.gradient_checkpointing=true",
                                          "training.kl_beta=0.004", iterations=2))
    assert all(expert.is_gradient_checkpointing for expert in trainer.module.experts)
    model = trainer.model
    assert model.high_noise_steps(model.sigmas(4)[:-1]).tolist() == [True, False, False, False]
    before = {e: _lora_weights(trainer.module, e) for e in ("transformer", "transformer_2")}
    history = trainer.train()
    assert [h for h in history if h["phase"] == "train"][0]["train/first_pass_ratio_max_dev"] == 0.0
    second = [h for h in history if h["phase"] == "train"][1]
    assert second["train/kl"] > 0   # LoRA moved away from the adapter-free reference
    for expert, weights in before.items():
        after = _lora_weights(trainer.module, expert)
        assert any(not torch.equal(after[n], w) for n, w in weights.items()), expert
    checkpoint = trainer.run_dir / "checkpoints" / "2"
    assert (checkpoint / LORA_WEIGHTS_NAME).is_file() and (checkpoint / LOW_NOISE_LORA_WEIGHTS_NAME).is_file()
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(6))
    ours = model.decode(_ode_latents(model, noise, WAN22_STEPS, 4.0))
    pipe = _wan22_pipeline(tiny_wan22_dir, model.shift)
    load_wan22_lora(pipe, checkpoint)
    torch.testing.assert_close(ours, _wan22_stock(pipe, noise, 4.0), atol=1e-5, rtol=0)


def test_wan22_training_one_expert(tiny_wan22_dir, tmp_path):
    """train_experts='high' with a one-step plan on the first (high-noise) step: only the high-noise
    expert's LoRA exists and moves, and only its file is written."""
    from flowgrpo.trainer import Trainer

    from pipelines.wan22 import LORA_WEIGHTS_NAME

    trainer = Trainer(_wan22_train_config(
        tiny_wan22_dir, tmp_path, "sampling.plan.kind=one_step", "sampling.plan.one_step_range=[0,1]",
        options={"train_experts": "high"}, iterations=1))
    assert not _lora_weights(trainer.module, "transformer_2")
    before = _lora_weights(trainer.module, "transformer")
    history = trainer.train()
    assert [h for h in history if h["phase"] == "train"][0]["train/first_pass_ratio_max_dev"] == 0.0
    after = _lora_weights(trainer.module, "transformer")
    assert any(not torch.equal(after[n], w) for n, w in before.items())
    checkpoint = trainer.run_dir / "checkpoints" / "1"
    assert {p.name for p in checkpoint.glob("pytorch_lora_weights*.safetensors")} == {LORA_WEIGHTS_NAME}


@pytest.mark.slow
def test_wan22_ddp_two_processes_train_the_same_weights_as_one(tiny_wan22_dir, tmp_path):
    """Under DDP (gloo, 2 CPU processes) each replay batch runs one expert, so the other's LoRA
    is unused in that forward. The adapter says so (may_skip_parameters) and the trainer has DDP
    look for unused parameters, with no config option: the two processes end with the weights
    of one process (~60 s)."""
    from tests.helpers import assert_same_weights, final_weights, launch, train_config

    model = {"family": "wan", "path": tiny_wan22_dir, "options": dict(VIDEO_OPTIONS),
             "lora": {"rank": 4, "alpha": 8}}
    for processes in (1, 2):
        folder = tmp_path / str(processes)
        folder.mkdir()
        train_config(folder / "c.yaml", folder, "ddp22", model)   # no DDP option: the model says
        record = launch(processes, folder / "c.yaml", folder / "out.json", "mp_train.py", "train")
        assert record["num_processes"] == processes
        assert record["first_pass_ratio_max_dev"] == [0.0, 0.0, 0.0]
        if processes == 2:
            assert record["wrapper"] == "DistributedDataParallel"
            assert any(n.startswith("transformer_2.") for n in record["trainable"])
    one, two = final_weights(tmp_path / "1", "ddp22"), final_weights(tmp_path / "2", "ddp22")
    assert_same_weights(one, two)
    for expert in ("transformer.", "transformer_2."):
        assert any(name.startswith(expert) for name in one)
