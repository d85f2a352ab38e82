"""Wan image-to-video adapter (wan_i2v): parity with WanImageToVideoPipeline (Euler scheduler at
the checkpoint's flow shift) from the same latents and source image, for Wan2.1 I2V (CLIP image
encoder), Wan2.2-I2V-A14B (two experts, no image encoder) and Wan2.2-TI2V-5B (expand_timesteps,
Wan2.2 VAE); the first-frame condition; every row's own source image; validation before loading;
LoRA round trips and the on-policy first pass of a Trainer on JSONL records with source images."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from PIL import Image

from flowgrpo.model import FlowModel, cfg_gradient
from flowgrpo.pixels import to_uint8
from flowgrpo.rollout import sample_ode
from pipelines import load_model
from tests.helpers import family_config
from tests.pipeline_helpers import (TINY_MAX_SEQUENCE_LENGTH, VIDEO_OPTIONS, fail_on_weight_loading,
                                    perturb_lora)

PROMPTS = ["the cube starts to roll", "the spheres bounce"]
NUM_STEPS = 3
WAN22_STEPS = 6   # shift 3: steps 0-1 at t >= 900 (high-noise expert), steps 2-5 low noise
H, W, F = VIDEO_OPTIONS["height"], VIDEO_OPTIONS["width"], VIDEO_OPTIONS["num_frames"]


@pytest.fixture(scope="module")
def wan_i2v(tiny_wan_i2v_dir):
    return load_model("wan_i2v", tiny_wan_i2v_dir, options=VIDEO_OPTIONS)


@pytest.fixture(scope="module")
def wan22_i2v(tiny_wan22_i2v_dir):
    return load_model("wan_i2v", tiny_wan22_i2v_dir, options=VIDEO_OPTIONS)


def _source(seed: int = 0, size: tuple[int, int] = (H, W)) -> torch.Tensor:
    """A uint8-exact random image (3, h, w) in [0, 1] (the pipeline sees the same pixels as PIL)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, *size), generator=generator).float() / 255


def _stock(directory, shift):
    """WanImageToVideoPipeline with its UniPC scheduler replaced by the Euler one at the shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(directory)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock_videos(pipe, image, noise, guidance_scale, steps=NUM_STEPS, guidance_scale_2=None,
                  output_type="pt", prompts=PROMPTS):
    """The stock pipeline's videos (B, F, 3, H, W) for ``prompts``, all animating ``image``."""
    return pipe(image=Image.fromarray(to_uint8(image)), prompt=prompts, height=H, width=W,
                num_frames=F, num_inference_steps=steps, guidance_scale=guidance_scale,
                guidance_scale_2=guidance_scale_2, latents=noise.clone(), output_type=output_type,
                max_sequence_length=TINY_MAX_SEQUENCE_LENGTH).frames


@torch.no_grad()
def _ode_latents(model, images, noise, num_steps, guidance_scale):
    cond = model.encode_prompts(PROMPTS[:len(noise)], images=images)
    sigmas = model.sigmas(num_steps)
    x = noise.clone().float()
    for i in range(num_steps):
        x = x + model.velocity(x, sigmas[i].expand(len(x)), cond, guidance_scale) * (sigmas[i + 1] - sigmas[i])
    return x


# ================================================================================ Wan2.1 I2V
def test_load_model_returns_an_image_to_video_flow_model(wan_i2v):
    assert isinstance(wan_i2v, FlowModel) and wan_i2v.family == "wan_i2v" and wan_i2v.supports_images
    assert wan_i2v.pipeline_class.__name__ == "WanImageToVideoPipeline"
    assert wan_i2v.boundary_ratio is None and wan_i2v.image_encoder is not None
    assert wan_i2v.transformer.config.in_channels == 36
    assert wan_i2v.latent_shape == (16, 2, 4, 4)   # 16 channels, not the transformer's 36
    assert wan_i2v.shift == 3.0
    with pytest.raises(ValueError, match="one source image per prompt"):
        wan_i2v.encode_prompts(PROMPTS)


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0], ids=["cfg_off", "cfg_on"])
def test_ode_matches_stock_pipeline(wan_i2v, tiny_wan_i2v_dir, guidance_scale):
    image = _source()
    noise = wan_i2v.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    ours = sample_ode(wan_i2v, PROMPTS, noise, NUM_STEPS, guidance_scale, images=[image, image])
    reference = _stock_videos(_stock(tiny_wan_i2v_dir, wan_i2v.shift), image, noise, guidance_scale)
    assert ours.shape == reference.shape == (2, F, 3, H, W)
    assert ((ours > 0) & (ours < 1)).float().mean() > 0.9
    # CFG's two branches run as one batched forward here and as two in the stock pipeline: float32
    # reduction order differs (about 2e-6 in latents of magnitude 5, measured), and at CFG 5 the
    # VAE carries that to about 1.4e-5 in pixels. Two forwards are the stock arithmetic exactly.
    torch.testing.assert_close(ours, reference, atol=1e-5 if guidance_scale == 1.0 else 3e-5, rtol=0)
    if guidance_scale > 1.0:
        with cfg_gradient("conditional"):
            two_forwards = sample_ode(wan_i2v, PROMPTS, noise, NUM_STEPS, guidance_scale,
                                      images=[image, image])
        torch.testing.assert_close(two_forwards, reference, atol=1e-6, rtol=0)


def test_first_frame_condition_is_the_mask_and_the_normalised_latents(wan_i2v):
    """image_condition = [mask (4 channels: 1 on the first latent frame, 0 after);
    (VAE mode of [image; F - 1 zero frames] - mean) / std] and the CLIP embeddings are the image
    encoder's penultimate hidden states, one row per prompt in both branches."""
    image = _source(3)
    cond = wan_i2v.encode_prompts(PROMPTS[:1], images=[image])
    condition = cond.positive["image_condition"]
    assert condition.shape == (1, 20, 2, 4, 4)
    assert torch.equal(condition[:, :4, 0], torch.ones(1, 4, 4, 4))
    assert torch.equal(condition[:, :4, 1:], torch.zeros(1, 4, 1, 4, 4))
    video = torch.cat([image[None, :, None] * 2 - 1, torch.zeros(1, 3, F - 1, H, W)], dim=2)
    vae = wan_i2v.vae
    with torch.no_grad():
        z = vae.encode(video).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    # the pipeline's PIL resize (Lanczos) at the same size leaves the 8-bit pixels as they are
    torch.testing.assert_close(condition[:, 4:], (z - mean) / std, atol=1e-5, rtol=0)
    assert torch.equal(cond.negative["image_condition"], condition)
    embeds = cond.positive["image_embeds"]
    assert embeds.shape == (1, 17, 16)   # 16 patches of 8 px on the 32 px crop + the class token
    assert torch.equal(cond.negative["image_embeds"], embeds)


def test_each_row_animates_its_own_source_image(wan_i2v):
    """A batch of rows with different images gives each row what it gives alone; changing only
    the image, or only its CLIP embeddings, changes the velocity."""
    a, b = _source(0), _source(1, size=(2 * H, 3 * W))   # b is resized to the output size
    noise = wan_i2v.initial_noise(2, torch.Generator().manual_seed(3))
    sigma = torch.full((2,), 0.7)
    with torch.no_grad():
        both = wan_i2v.velocity(noise, sigma, wan_i2v.encode_prompts(PROMPTS, images=[a, b]), 5.0)
        alone = [wan_i2v.velocity(noise[i:i + 1], sigma[:1],
                                  wan_i2v.encode_prompts(PROMPTS[i:i + 1], images=[image]), 5.0)
                 for i, image in enumerate((a, b))]
        torch.testing.assert_close(both, torch.cat(alone), atol=1e-5, rtol=0)
        swapped = wan_i2v.velocity(noise, sigma, wan_i2v.encode_prompts(PROMPTS, images=[b, a]), 5.0)
        assert (swapped - both).abs().amax(dim=(1, 2, 3, 4)).min() > 1e-4
        cond = wan_i2v.encode_prompts(PROMPTS, images=[a, b])
        cond.positive["image_embeds"] = cond.positive["image_embeds"].flip(0)
        cond.negative["image_embeds"] = cond.negative["image_embeds"].flip(0)
        assert (wan_i2v.velocity(noise, sigma, cond, 5.0) - both).abs().max() > 1e-4


def test_errors_are_raised_before_weights_load(tiny_wan_i2v_dir, tiny_wan_dir, tmp_path, monkeypatch):
    folders = {}
    for name, change in (("ti2v", {"expand_timesteps": True}),
                         ("no_processor", {"image_processor": [None, None]}),
                         ("low_only", {"transformer_2": ["diffusers", "WanTransformer3DModel"]})):
        folder = tmp_path / name
        shutil.copytree(tiny_wan_i2v_dir, folder)
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps({**index, **change}))
        folders[name] = folder
    no_encoder = tmp_path / "no_encoder"
    shutil.copytree(tiny_wan_i2v_dir, no_encoder)
    shutil.rmtree(no_encoder / "image_encoder")
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="WanPipeline folder.*use the wan family"):
        load_model("wan_i2v", tiny_wan_dir, options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match="expand_timesteps"):
        load_model("wan_i2v", folders["ti2v"], options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match="no image_processor"):
        load_model("wan_i2v", folders["no_processor"], options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match="transformer_2 but no boundary_ratio"):
        load_model("wan_i2v", folders["low_only"], options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match="image_encoder/config.json"):
        load_model("wan_i2v", no_encoder, options=VIDEO_OPTIONS)
    with pytest.raises(ValueError, match=r"num_frames must be 4k \+ 1.*try 5 or 9"):
        load_model("wan_i2v", tiny_wan_i2v_dir, options={**VIDEO_OPTIONS, "num_frames": 6})
    with pytest.raises(ValueError, match="options.guidance_scale_2 is for Wan2.2"):
        load_model("wan_i2v", tiny_wan_i2v_dir, options={**VIDEO_OPTIONS, "guidance_scale_2": 3.0})
    with pytest.raises(ValueError, match=r"unknown wan_i2v option\(s\) \['image'\]"):
        load_model("wan_i2v", tiny_wan_i2v_dir, options={"image": "x.png"})


def test_a_text_to_video_transformer_is_refused(tiny_wan_dir, tiny_wan_i2v_dir, tmp_path, monkeypatch):
    """An I2V folder whose transformer takes 16 channels (a T2V one copied in) names the fix
    before any weights load."""
    folder = tmp_path / "t2v_transformer"
    shutil.copytree(tiny_wan_i2v_dir, folder)
    shutil.rmtree(folder / "transformer")
    shutil.copytree(f"{tiny_wan_dir}/transformer", folder / "transformer")
    fail_on_weight_loading(monkeypatch)
    with pytest.raises(ValueError, match="16 input channels.*36.*Use the wan family"):
        load_model("wan_i2v", folder, options=VIDEO_OPTIONS)


# ------------------------------------------------------------------------------ training
def _train_config(path, tmp_path, *overrides: str, iterations: int = 1, guidance_scale: float = 5.0,
                  options: dict | None = None):
    """Two JSONL records with source images (written to tmp_path), LoRA rank 2, 3 steps."""
    lines = []
    for i, prompt in enumerate(PROMPTS):
        Image.fromarray(to_uint8(_source(i))).save(tmp_path / f"{i}.png")
        lines.append(json.dumps({"prompt": prompt, "image": f"{i}.png"}))
    (tmp_path / "i2v.jsonl").write_text("\n".join(lines) + "\n")
    return family_config("wan_i2v", path, tmp_path, options or VIDEO_OPTIONS, *overrides,
                         guidance_scale=guidance_scale, iterations=iterations,
                         num_steps=NUM_STEPS, prompts=str(tmp_path / "i2v.jsonl"))


def test_first_pass_ratio_is_exactly_one_and_lora_loads_in_the_stock_pipeline(tiny_wan_i2v_dir, tmp_path):
    from flowgrpo.trainer import Trainer

    trainer = Trainer(_train_config(tiny_wan_i2v_dir, tmp_path))
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0

    model = trainer.policy.model
    perturb_lora(model.transformer)
    trainer.policy.save_weights(str(tmp_path / "lora"))
    image = _source(5)
    noise = model.initial_noise(2, torch.Generator().manual_seed(5))
    ours = sample_ode(model, PROMPTS, noise, NUM_STEPS, 5.0, images=[image, image])
    pipe = _stock(tiny_wan_i2v_dir, model.shift)
    plain = _stock_videos(pipe, image, noise, 5.0)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    loaded = _stock_videos(pipe, image, noise, 5.0)
    assert (plain - loaded).abs().max() > 1e-3
    torch.testing.assert_close(ours, loaded, atol=1e-5, rtol=0)


# ================================================================================ Wan2.2 I2V
def test_wan22_i2v_loads_two_experts_and_no_image_encoder(wan22_i2v):
    from pipelines.wan22 import WanExperts

    assert isinstance(wan22_i2v.transformer, WanExperts) and wan22_i2v.image_encoder is None
    assert wan22_i2v.boundary_ratio == 0.9 and wan22_i2v.transformer.boundary_timestep == 900.0
    assert wan22_i2v.high_noise_steps(wan22_i2v.sigmas(WAN22_STEPS)[:-1]).tolist() == \
        [True, True, False, False, False, False]
    cond = wan22_i2v.encode_prompts(PROMPTS, images=[_source(), _source(1)])
    assert "image_embeds" not in cond.positive and cond.positive["image_condition"].shape == (2, 20, 2, 4, 4)
    pipe = wan22_i2v.to_pipeline()
    assert pipe.transformer_2 is wan22_i2v.transformer.transformer_2 and pipe.config.boundary_ratio == 0.9


@pytest.mark.parametrize("guidance_scale, guidance_scale_2", [(1.0, None), (4.0, 3.0)],
                         ids=["cfg_off", "cfg_per_expert"])
def test_wan22_i2v_ode_matches_stock_pipeline(tiny_wan22_i2v_dir, guidance_scale, guidance_scale_2):
    model = load_model("wan_i2v", tiny_wan22_i2v_dir,
                       options={**VIDEO_OPTIONS, "guidance_scale_2": guidance_scale_2})
    image = _source()
    noise = model.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    latents = _ode_latents(model, [image, image], noise, WAN22_STEPS, guidance_scale)
    pipe = _stock(tiny_wan22_i2v_dir, model.shift)
    reference = _stock_videos(pipe, image, noise, guidance_scale, WAN22_STEPS, guidance_scale_2, "latent")
    torch.testing.assert_close(latents, reference, atol=1e-5, rtol=0)
    videos = _stock_videos(pipe, image, noise, guidance_scale, WAN22_STEPS, guidance_scale_2)
    # decoded: the pipeline divides by 1/std where the adapter multiplies by std (a few ulps in
    # the latents), which the tiny random VAE amplifies to ~2e-5
    torch.testing.assert_close(model.decode(latents), videos, atol=5e-5, rtol=0)


def test_wan22_i2v_lora_on_both_experts_loads_into_stock_pipeline(tiny_wan22_i2v_dir, tmp_path):
    """A Trainer over 6 steps (both experts' steps), first pass on-policy; the LoRA of both
    experts, one file each, loads with load_wan22_lora and the pipeline reproduces the samples."""
    from flowgrpo.trainer import Trainer

    from pipelines.wan22 import LORA_WEIGHTS_NAME, LOW_NOISE_LORA_WEIGHTS_NAME, load_wan22_lora

    trainer = Trainer(_train_config(tiny_wan22_i2v_dir, tmp_path, f"sampling.num_steps={WAN22_STEPS}",
                                    guidance_scale=4.0))
    metrics = trainer.run_iteration(0)
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    model = trainer.policy.model
    for expert in model.denoisers():
        perturb_lora(expert)
    trainer.policy.save_weights(str(tmp_path / "lora"))
    assert (tmp_path / "lora" / LORA_WEIGHTS_NAME).is_file()
    assert (tmp_path / "lora" / LOW_NOISE_LORA_WEIGHTS_NAME).is_file()
    image = _source(5)
    noise = model.initial_noise(2, torch.Generator().manual_seed(6))
    ours = model.decode(_ode_latents(model, [image, image], noise, WAN22_STEPS, 4.0))
    pipe = _stock(tiny_wan22_i2v_dir, model.shift)
    plain = _stock_videos(pipe, image, noise, 4.0, WAN22_STEPS)
    assert load_wan22_lora(pipe, tmp_path / "lora") == ["transformer", "transformer_2"]
    loaded = _stock_videos(pipe, image, noise, 4.0, WAN22_STEPS)
    assert (plain - loaded).abs().max() > 1e-3
    torch.testing.assert_close(ours, loaded, atol=5e-5, rtol=0)


# ================================================================================ Wan2.2 TI2V-5B
# expand_timesteps: the first latent frame is the condition (its tokens at timestep 0); the Wan2.2
# VAE compresses 16x, so 64 px gives 4 x 4 latents, 2 x 2 tokens a frame.
TI2V_OPTIONS = {**VIDEO_OPTIONS, "height": 64, "width": 64}


@pytest.fixture(scope="module")
def ti2v(tiny_wan22_ti2v_dir):
    return load_model("wan_i2v", tiny_wan22_ti2v_dir, options=TI2V_OPTIONS)


def _stock_ti2v(pipe, image, noise, guidance_scale, output_type="pt"):
    return pipe(image=Image.fromarray(to_uint8(image)), prompt=PROMPTS, height=64, width=64,
                num_frames=F, num_inference_steps=NUM_STEPS, guidance_scale=guidance_scale,
                latents=noise.clone(), output_type=output_type,
                max_sequence_length=TINY_MAX_SEQUENCE_LENGTH).frames


def test_ti2v_per_token_timesteps_are_zero_on_the_first_frame():
    from pipelines.wan_i2v import first_frame_mask, token_timesteps

    mask = first_frame_mask((16, 3, 4, 6))
    assert mask.shape == (1, 1, 3, 4, 6) and mask[0, 0, 0].sum() == 0 and mask[0, 0, 1:].min() == 1
    t = torch.tensor([900.0, 250.0])
    per_token = token_timesteps(mask, t, (1, 2, 2))
    assert per_token.shape == (2, 3 * 2 * 3)   # frames x (4 / 2) x (6 / 2) tokens
    expected = torch.cat([torch.zeros(2, 6), t[:, None].expand(2, 12)], dim=1)
    assert torch.equal(per_token, expected)


def test_ti2v_loads_with_expand_timesteps_and_the_wan22_vae(ti2v, tiny_wan22_ti2v_dir, tmp_path):
    assert ti2v.expand_timesteps and ti2v.image_encoder is None and ti2v.boundary_ratio is None
    assert ti2v.vae.config.scale_factor_spatial == 16 and ti2v.shift == 5.0
    assert ti2v.latent_shape == (16, 2, 4, 4)
    cond = ti2v.encode_prompts(PROMPTS[:1], images=[_source(0, (64, 64))])
    assert cond.positive["image_condition"].shape == (1, 16, 1, 4, 4)
    assert ti2v.to_pipeline().config.expand_timesteps
    # the released folder names WanPipeline (it samples text-to-video too): loaded as I2V here
    released = tmp_path / "released"
    shutil.copytree(tiny_wan22_ti2v_dir, released)
    index = json.loads((released / "model_index.json").read_text())
    (released / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanPipeline"}))
    assert load_model("wan_i2v", released, options=TI2V_OPTIONS).expand_timesteps
    (released / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.9}))
    with pytest.raises(ValueError, match="expand_timesteps.*boundary_ratio"):
        load_model("wan_i2v", released, options=TI2V_OPTIONS)
    with pytest.raises(ValueError, match="height must be divisible by 32"):
        load_model("wan_i2v", tiny_wan22_ti2v_dir, options={**TI2V_OPTIONS, "height": 48})


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0], ids=["cfg_off", "cfg_on"])
def test_ti2v_ode_matches_stock_pipeline(ti2v, tiny_wan22_ti2v_dir, guidance_scale):
    image = _source(0, (64, 64))
    noise = ti2v.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    latents = _ode_latents(ti2v, [image, image], noise, NUM_STEPS, guidance_scale)
    pipe = _stock(tiny_wan22_ti2v_dir, ti2v.shift)
    # the pipeline's final latents have the condition as first frame: so do the solver's
    reference = _stock_ti2v(pipe, image, noise, guidance_scale, "latent")
    torch.testing.assert_close(latents, reference, atol=1e-5, rtol=0)
    videos = _stock_ti2v(pipe, image, noise, guidance_scale)
    assert videos.shape == (2, F, 3, 64, 64)
    torch.testing.assert_close(ti2v.decode(latents), videos, atol=1e-5, rtol=0)


def test_ti2v_first_frame_velocity_leads_to_the_condition_whatever_the_weights(ti2v):
    """The first latent frame's velocity is (x - condition) / sigma: an Euler step to sigma 0
    lands on the condition; it does not depend on the transformer (no log-prob ratio from it),
    while the other frames' does and they see the image."""
    image = _source(2, (64, 64))
    cond = ti2v.encode_prompts(PROMPTS, images=[image, image])
    x = ti2v.initial_noise(2, torch.Generator().manual_seed(1))
    sigma = torch.full((2,), 0.4)
    with torch.no_grad():
        v = ti2v.velocity(x, sigma, cond, 5.0)
        landed = x - 0.4 * v
        condition = cond.positive["image_condition"].expand(2, -1, -1, -1, -1)
        torch.testing.assert_close(landed[:, :, :1], condition, atol=1e-6, rtol=0)
        other_image = ti2v.encode_prompts(PROMPTS, images=[_source(3, (64, 64))] * 2)
        other = ti2v.velocity(x, sigma, other_image, 5.0)
        assert (other[:, :, 1:] - v[:, :, 1:]).abs().max() > 1e-4
        block = ti2v.transformer.blocks[0].attn1.to_q.weight
        saved = block.clone()
        block.add_(0.5)
        try:
            changed = ti2v.velocity(x, sigma, cond, 5.0)
        finally:
            block.copy_(saved)
    assert torch.equal(changed[:, :, 0], v[:, :, 0])
    assert (changed[:, :, 1:] - v[:, :, 1:]).abs().max() > 1e-4


def test_ti2v_first_pass_ratio_is_exactly_one_and_lora_loads_in_the_stock_pipeline(tiny_wan22_ti2v_dir, tmp_path):
    from flowgrpo.trainer import Trainer

    trainer = Trainer(_train_config(tiny_wan22_ti2v_dir, tmp_path, options=TI2V_OPTIONS))
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    model = trainer.policy.model
    perturb_lora(model.transformer)
    trainer.policy.save_weights(str(tmp_path / "lora"))
    image = _source(5, (64, 64))
    noise = model.initial_noise(2, torch.Generator().manual_seed(5))
    ours = model.decode(_ode_latents(model, [image, image], noise, NUM_STEPS, 5.0))
    pipe = _stock(tiny_wan22_ti2v_dir, model.shift)
    plain = _stock_ti2v(pipe, image, noise, 5.0)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    loaded = _stock_ti2v(pipe, image, noise, 5.0)
    assert (plain - loaded).abs().max() > 1e-3
    torch.testing.assert_close(ours, loaded, atol=1e-5, rtol=0)


def test_tiny_runs_pick_the_variants_build():
    from flowgrpo.tiny_recipe import tiny_build_name

    assert tiny_build_name("wan_i2v", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers") == "wan_i2v"
    assert tiny_build_name("wan_i2v", "Wan-AI/Wan2.2-I2V-A14B-Diffusers") == "wan22_i2v"
    assert tiny_build_name("wan_i2v", "/models/Wan2.2-TI2V-5B-Diffusers") == "wan22_ti2v"
