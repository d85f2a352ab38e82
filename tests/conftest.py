"""Shared fixtures: tiny offline model folders, built once per test session."""
from __future__ import annotations

import os

import pytest
import torch

from pipelines.tiny import save_tiny

# Two cores shared by the suite: one intra-op thread keeps tests fast and deterministic.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory) -> str:
    return save_tiny("sd3", tmp_path_factory.mktemp("tiny_sd3"))


@pytest.fixture(scope="session")
def tiny_sd3_dir(tiny_sd3_path) -> str:
    """The adapter tests' name for ``tiny_sd3_path`` (one build)."""
    return tiny_sd3_path


@pytest.fixture(scope="session")
def tiny_recipe_root(tmp_path_factory):
    """The root ``--tiny`` configs build their tiny models and reward weights under
    (``tiny_recipe.load_tiny_config(..., root=)``), shared by every test module: each build is
    written once, on first use."""
    return tmp_path_factory.mktemp("tiny_recipe_builds")


def _tiny_build(family: str):
    """A session fixture: the tiny offline build of ``family`` (pipelines/tiny.py), made once."""

    @pytest.fixture(scope="session", name=f"tiny_{family}_dir")
    def build(tmp_path_factory) -> str:
        return save_tiny(family, tmp_path_factory.mktemp("tiny") / family)

    return build


tiny_flux_dir = _tiny_build("flux")
tiny_flux_kontext_dir = _tiny_build("flux_kontext")
tiny_flux2_dir = _tiny_build("flux2")       # FLUX.2-klein base (real CFG)
tiny_flux2_dev_dir = _tiny_build("flux2_dev")   # FLUX.2-dev (guidance embedding)
tiny_qwen_image_dir = _tiny_build("qwen_image")
tiny_qwen_image_edit_dir = _tiny_build("qwen_image_edit")
tiny_qwen_image_edit_plus_dir = _tiny_build("qwen_image_edit_plus")   # 2509 layout (2511: zero_cond_t)
tiny_wan_dir = _tiny_build("wan")
tiny_wan22_dir = _tiny_build("wan22")   # Wan2.2's two experts (boundary_ratio 0.875)
tiny_wan_i2v_dir = _tiny_build("wan_i2v")   # Wan2.1 I2V: CLIP image encoder
tiny_wan22_i2v_dir = _tiny_build("wan22_i2v")   # Wan2.2-I2V-A14B: two experts (boundary 0.9)
tiny_wan22_ti2v_dir = _tiny_build("wan22_ti2v")   # Wan2.2-TI2V-5B: expand_timesteps, Wan2.2 VAE
tiny_z_image_dir = _tiny_build("z_image")   # Z-Image(-Turbo): Qwen3 text, Turbo's shift-3 scheduler
tiny_hunyuan_video_dir = _tiny_build("hunyuan_video")   # HunyuanVideo: Llama + CLIP text, guidance embedding
tiny_ltx2_dir = _tiny_build("ltx2")   # LTX-2: Gemma-3 text + connectors, joint audio+video tokens


@pytest.fixture(scope="session")
def edit_dir(tmp_path_factory) -> str:
    """A tiny random editing toy model whose source channels have weight (to_editing_model starts
    them at 0, which would hide whether the image reaches the transformer)."""
    from pipelines.toy import ToyArchitecture, build_toy_model, to_editing_model

    tiny = ToyArchitecture(num_layers=2, num_attention_heads=2, attention_head_dim=8,
                           text_hidden_size=16, text_heads=2, pooled_dim=16)
    path = str(tmp_path_factory.mktemp("toy_edit_tiny"))
    model = to_editing_model(build_toy_model(tiny, seed=0))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.transformer.parameters():
            if p.abs().sum() == 0:
                p.copy_(0.02 * torch.randn(p.shape, generator=generator))
        weight = model.transformer.pos_embed.proj.weight             # (D, 6, p, p)
        weight[:, 3:] = 0.2 * torch.randn(weight[:, 3:].shape, generator=generator)
    model.save_pretrained(path)
    return path


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a policy (and so a model) is built: bad input must fail before."""
    import flowgrpo.trainer as trainer_module

    def boom(*args, **kwargs):
        raise AssertionError("the model was loaded before the check failed")

    monkeypatch.setattr(trainer_module, "load_policy_class", boom)


@pytest.fixture(scope="module")
def bench(request):
    """benchmarks/<BENCHMARK>.py of the test module (its ``BENCHMARK``) loaded as a module."""
    from tests.helpers import load_benchmark

    return load_benchmark(request.module.BENCHMARK)
