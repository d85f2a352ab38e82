"""The first run of a recipe fails well: a model (or a reward's hub weights) that cannot be had
stops the run before prompts, rewards or weights load, with one message naming the id, the likely
cause and the fix (flowgrpo/hub.py, pipelines.check_model_source). Hub access is switched off in
every test (HF_HUB_OFFLINE, an empty cache), so nothing here can wait on the network."""
from __future__ import annotations

import json

import pytest

from flowgrpo.config import InputError, load_config
from flowgrpo.hub import HubAccessError, access_error


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch):
    """No hub look-up can leave this machine, and the cache is empty."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def _nothing_else_loads(monkeypatch):
    """Fail the test if prompts, rewards or a model start to load."""
    import flowgrpo.flow_policy
    import flowgrpo.trainer

    def refuse(*args, **kwargs):
        raise AssertionError("loaded before the model source was checked")

    monkeypatch.setattr(flowgrpo.trainer, "load_prompts", refuse)
    monkeypatch.setattr(flowgrpo.flow_policy, "load_rewards", refuse)
    monkeypatch.setattr(flowgrpo.flow_policy, "load_model", refuse)


def test_a_recipe_offline_fails_first_with_one_message(offline_hub, tmp_path, monkeypatch, capsys):
    """`flowgrpo train configs/sd3_ocr.yaml` on a machine without hub access: exit status 2 and
    one line naming the hub id, the cause (offline, not cached) and the fixes."""
    from flowgrpo.cli import main

    _nothing_else_loads(monkeypatch)
    # mixed precision off: accelerate's state is one per process, and other tests made it so
    code = main(["train", "configs/sd3_ocr.yaml", f"run.output_dir={tmp_path / 'runs'}",
                 "run.tracker=none", "training.mixed_precision='no'"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "stabilityai/stable-diffusion-3.5-medium" in err and "model.path" in err
    assert "HF_HUB_OFFLINE" in err and "huggingface-cli download" in err
    assert str(offline_hub) in err
    assert not (tmp_path / "runs" / "sd3_ocr").exists()


def test_a_folder_that_is_not_a_whole_pipeline_fails_first(offline_hub, tmp_path, monkeypatch):
    from flowgrpo.trainer import Trainer

    _nothing_else_loads(monkeypatch)
    folder = tmp_path / "sd35"
    (folder / "transformer").mkdir(parents=True)
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text("{}")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusion3Pipeline",
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "text_encoder_3": [None, None]}))
    overrides = [f"model.path={folder}", f"run.output_dir={tmp_path / 'runs'}", "run.tracker=none",
                 "training.mixed_precision='no'"]
    with pytest.raises(InputError, match=r"incomplete, it lacks transformer/config\.json, "
                                         r"tokenizer/tokenizer_config\.json.*huggingface-cli"):
        Trainer(load_config("configs/sd3_ocr.yaml", overrides))
    (folder / "model_index.json").unlink()
    with pytest.raises(InputError, match=r"not a diffusers pipeline folder \(it has no model_index\.json\)"):
        Trainer(load_config("configs/sd3_ocr.yaml", overrides))
    missing = [f"model.path={tmp_path / 'nowhere'}", *overrides[1:]]
    with pytest.raises(InputError, match="does not exist and is not a hub id"):
        Trainer(load_config("configs/sd3_ocr.yaml", missing))


def test_a_whole_pipeline_folder_passes_the_check(tiny_sd3_path):
    from pipelines import check_model_source

    check_model_source("sd3", tiny_sd3_path)      # save_pretrained's layout, every component
    check_model_source("toy", "assets/toy")


def test_hub_failures_are_told_apart():
    """Gated (accept the license, log in), not found (spelling, private), a file the repository
    lacks (not a pipeline), unreachable (offline or no network)."""
    from huggingface_hub import errors

    def bare(cls):
        return cls.__new__(cls)      # the classification reads only the type

    gated = access_error("black-forest-labs/FLUX.1-dev", "model_index.json",
                         bare(errors.GatedRepoError), "a pipeline", "model.path")
    assert "gated" in str(gated) and "accept the license at " \
        "https://huggingface.co/black-forest-labs/FLUX.1-dev" in str(gated)
    assert "huggingface-cli login" in str(gated) and "HF_TOKEN" in str(gated)
    missing = access_error("stabilityai/sd-3.5-medum", "model_index.json",
                           bare(errors.RepositoryNotFoundError), "a pipeline", "model.path")
    assert "not found" in str(missing) and "spelling" in str(missing)
    no_file = access_error("openai/clip-vit-large-patch14", "model_index.json",
                           bare(errors.RemoteEntryNotFoundError), "a pipeline", "model.path")
    assert "has no model_index.json, so it is not a pipeline" in str(no_file)
    unreachable = access_error("Qwen/Qwen-Image", "model_index.json",
                               ConnectionError("no route"), "a pipeline", "model.path")
    assert "not in the local cache" in str(unreachable)
    assert all(isinstance(e, HubAccessError) for e in (gated, missing, no_file, unreachable))


def test_a_reward_whose_hub_weights_cannot_be_had_says_so(offline_hub):
    from reward_models import load_reward

    with pytest.raises(HubAccessError, match=r"'yuvalkirstain/PickScore_v1' is not in the local "
                                             r"cache.*HF_HUB_OFFLINE.*reward option 'model'"):
        load_reward({"name": "pickscore"})
    with pytest.raises(HubAccessError, match="openai/clip-vit-large-patch14"):
        load_reward({"name": "clip_score"})
