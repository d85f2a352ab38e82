"""FSDP2 executed, not only configured: 2 CPU processes over gloo, launched through accelerate with
the shipped configs/accelerate/fsdp.yaml (ACCELERATE_USE_CPU=true, fp32), against one process.

What is checked: the parameters really are split (each process holds half of every trainable
and frozen element), training gives one process's weights within float32 tolerance, the
checkpoint holds each process's shard in ``engine/`` and a resume from it continues bit for bit,
and what does not run on CPU is refused with the fix. GPUs and NCCL are not exercised here."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flowgrpo.config import ConfigError, load_config
from flowgrpo.engines import preflight_engine
from flowgrpo.trainer import Trainer
from pipelines.training import LORA_WEIGHTS_NAME
from tests.helpers import launch, train_config

ROOT = Path(__file__).resolve().parents[1]
FSDP_FILE = ROOT / "configs" / "accelerate" / "fsdp.yaml"
TOY = str(ROOT / "assets" / "toy")

# 2 processes against 1: FSDP2 reduce-scatters the mean of the two processes' gradients, one
# process sums the same terms in another order, and Adam divides by the gradient's size. The
# tolerance of the DDP tests (tests/helpers.assert_same_weights); measured max |difference|:
# 1.2e-7 for tiny SD3 LoRA after 3 iterations (6 Adam steps), 3.8e-6 for the toy model's full
# fine-tuning, with the weights moving 4e-3 and 5.6e-3.
ATOL, RTOL = 2e-5, 1e-4


def tiny_sd3(path: str, lora: bool = True) -> dict:
    return {"family": "sd3", "path": path, "options": {"height": 32, "width": 32},
            "lora": {"enabled": lora, "rank": 4, "alpha": 8}}


def write_config(folder: Path, name: str, model: dict, run: dict | None = None,
                 evaluate: bool = True, **training) -> Path:
    """tests.helpers.train_config's run (2 groups of 4 rows, 2 inner epochs, lr 1e-3) with
    ``run`` entries replaced; ``evaluate`` False drops the held-out prompts."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "c.yaml"
    train_config(path, folder, name, model, **training)
    data = yaml.safe_load(path.read_text())
    data["run"].update(run or {})
    if not evaluate:
        data["prompts"]["eval"] = None
    path.write_text(yaml.safe_dump(data))
    return path


def one_process(config: Path) -> list[dict]:
    """The same run in this process (no launch: the reference costs seconds, not a start-up)."""
    return Trainer(load_config(str(config))).train()


def lora_file(folder: Path, name: str, iteration: int) -> dict:
    return load_file(str(folder / "runs" / name / "checkpoints" / str(iteration) /
                         LORA_WEIGHTS_NAME))


def assert_close(one: dict, two: dict) -> float:
    """Every tensor within ATOL/RTOL; returns the largest absolute difference."""
    assert one.keys() == two.keys()
    for key in one:
        assert torch.allclose(one[key], two[key], atol=ATOL, rtol=RTOL), key
    return max(float((one[key] - two[key]).abs().max()) for key in one)


def assert_split_in_two(record: dict) -> None:
    """Each of the 2 processes holds about half of the elements: the trainable ones and all of
    the transformer's (under DDP each would hold all of them)."""
    assert record["engine"] == "fsdp" and record["sharded"] is True
    assert record["wrapper"].startswith("FSDP")   # fully_shard's class, in place
    assert record["dtensor_parameters"] == record["trainable_parameters"] > 0
    for full, local in ((record["full_elements"], record["local_elements"]),
                        (record["all_full_elements"], record["all_local_elements"])):
        assert len(local) == 2 and sum(local) == full
        assert all(0.4 * full <= part <= 0.6 * full for part in local), (full, local)


def assert_sharded_checkpoint(checkpoint: Path) -> None:
    """The engine's state moved into the checkpoint (under its completion marker), one shard file
    per process for the model and the optimiser; no unsharded trainable/optimiser files."""
    for state in ("pytorch_model_fsdp_0", "optimizer_0"):
        shards = sorted(p.name for p in (checkpoint / "engine" / state).glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"], (state, shards)
    assert not (checkpoint / "trainable.safetensors").exists()
    marker = json.loads((checkpoint / "COMPLETE.json").read_text())
    assert "engine/pytorch_model_fsdp_0/__1_0.distcp" in marker["files"]
    assert json.loads((checkpoint / "trainer_state.json").read_text())["engine"] == "fsdp"


# --------------------------------------------------------------------------- what is refused

def test_fsdp2_on_cpu_passes_the_preflight_and_what_does_not_run_is_refused():
    fsdp2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_CPU": "true"}
    preflight_engine(fsdp2, cuda=False)
    with pytest.raises(ConfigError, match="FSDP version 1.*only FSDP2 runs"):
        preflight_engine({**fsdp2, "FSDP_VERSION": "1"}, cuda=False)
    # without ACCELERATE_USE_CPU accelerate starts no process group: each would train alone
    with pytest.raises(ConfigError, match="ACCELERATE_USE_CPU=true"):
        preflight_engine({**fsdp2, "ACCELERATE_USE_CPU": "false"}, cuda=False)
    with pytest.raises(ConfigError, match="DeepSpeed, which needs CUDA GPUs"):
        preflight_engine({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_CPU": "true"},
                         cuda=False)
    preflight_engine({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, cuda=True)


def test_a_full_fine_tune_publishes_the_consolidated_weights_it_is_given(tiny_sd3_path,
                                                                        tmp_path):
    """Under a sharded engine the module's own state is this process's shards; the published
    transformer must hold the consolidated state handed in (diffusers' save_pretrained would
    quietly ignore it), and still load with from_pretrained."""
    from diffusers import SD3Transformer2DModel

    from pipelines.training import save_diffusers_model

    module = SD3Transformer2DModel.from_pretrained(tiny_sd3_path, subfolder="transformer")
    consolidated = {name: tensor + 1.0 for name, tensor in module.state_dict().items()}
    save_diffusers_model(module, tmp_path / "given", consolidated)
    save_diffusers_model(module, tmp_path / "own")
    given = SD3Transformer2DModel.from_pretrained(str(tmp_path / "given")).state_dict()
    own = SD3Transformer2DModel.from_pretrained(str(tmp_path / "own")).state_dict()
    assert given.keys() == consolidated.keys() == own.keys()
    for name, tensor in module.state_dict().items():
        assert torch.equal(given[name], consolidated[name]), name
        assert torch.equal(own[name], tensor), name


# --------------------------------------------------------------------------- FSDP2 runs

def test_fsdp_on_two_cpu_processes_trains_the_lora_of_one_process(tiny_sd3_path, tmp_path):
    """One iteration (2 optimiser steps) of tiny SD3 LoRA, evaluated before and after: the
    parameters are split, the weights and the held-out metrics are one process's, and the
    checkpoint holds the engine's shards."""
    run = {"max_iterations": 1}
    two = write_config(tmp_path / "two", "fsdp", tiny_sd3(tiny_sd3_path), run)
    record = launch(2, two, tmp_path / "two" / "out.json", "mp_fsdp.py", config_file=FSDP_FILE)
    assert record["num_processes"] == 2
    assert_split_in_two(record)
    assert record["first_pass_ratio_max_dev"] == [0.0] and record["optimizer_steps"] == [2]
    assert_sharded_checkpoint(tmp_path / "two" / "runs" / "fsdp" / "checkpoints" / "1")

    one = write_config(tmp_path / "one", "fsdp", tiny_sd3(tiny_sd3_path), run)
    history = one_process(one)
    assert_close(lora_file(tmp_path / "one", "fsdp", 1), lora_file(tmp_path / "two", "fsdp", 1))
    evals = [{k: v for k, v in h.items() if k.startswith("eval/")} for h in history
             if h["phase"] == "eval"]
    assert len(evals) == len(record["eval"]) == 2 and "eval/brightness" in evals[0]
    for mine, theirs in zip(evals, record["eval"]):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert theirs[key] == pytest.approx(mine[key], abs=1e-4), key


@pytest.mark.slow
def test_fsdp_resumes_a_sharded_checkpoint_exactly(tiny_sd3_path, tmp_path):
    """3 iterations straight (a checkpoint after each) against one process, then the same run
    resumed from checkpoint 2 under FSDP: its iteration 3 equals the straight one bit for bit.
    No held-out prompts: an evaluation at iteration 0 fills the prompt-embedding cache with
    embeddings encoded in another batch, which moves later weights by ~1e-7 in one process as
    well, and a resumed run does not repeat it."""
    folder = tmp_path / "two"
    config = write_config(folder, "fsdp", tiny_sd3(tiny_sd3_path),
                          {"checkpoint_every": 1, "keep_checkpoints": 0}, evaluate=False)
    record = launch(2, config, folder / "straight.json", "mp_fsdp.py", config_file=FSDP_FILE)
    assert_split_in_two(record)
    assert record["optimizer_steps"] == [2, 2, 2]
    checkpoints = folder / "runs" / "fsdp" / "checkpoints"
    for iteration in (1, 2, 3):
        assert_sharded_checkpoint(checkpoints / str(iteration))
    straight = lora_file(folder, "fsdp", 3)
    first = lora_file(folder, "fsdp", 1)
    assert max(float((straight[k] - first[k]).abs().max()) for k in straight) > 1e-3

    one = write_config(tmp_path / "one", "fsdp", tiny_sd3(tiny_sd3_path), evaluate=False)
    one_process(one)
    assert_close(lora_file(tmp_path / "one", "fsdp", 3), straight)

    resumed_record = launch(2, config, folder / "resumed.json", "mp_fsdp.py",
                            after=(str(checkpoints / "2"),), config_file=FSDP_FILE)
    assert resumed_record["start_iteration"] == 2
    assert resumed_record["optimizer_steps"] == [2]
    assert_split_in_two(resumed_record)
    resumed = lora_file(folder, "fsdp", 3)
    assert resumed.keys() == straight.keys()
    for key in straight:
        assert torch.equal(resumed[key], straight[key]), key


@pytest.mark.slow
def test_fsdp_trains_the_toy_model_fully_like_one_process(tmp_path):
    """Full fine-tuning of the embedded toy model (every weight trains, all of them sharded):
    the consolidated transformer the checkpoint publishes is one process's, and loads."""
    from diffusers import SD3Transformer2DModel

    model = {"family": "toy", "path": TOY, "lora": {"enabled": False}}
    two = write_config(tmp_path / "two", "toy", model)
    record = launch(2, two, tmp_path / "two" / "out.json", "mp_fsdp.py", config_file=FSDP_FILE)
    assert_split_in_two(record)
    assert record["full_elements"] == record["all_full_elements"]   # full fine-tuning
    assert record["first_pass_ratio_max_dev"] == [0.0, 0.0, 0.0]
    checkpoint = tmp_path / "two" / "runs" / "toy" / "checkpoints" / "3"
    assert_sharded_checkpoint(checkpoint)

    one = write_config(tmp_path / "one", "toy", model)
    one_process(one)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    theirs = load_file(str(checkpoint / weights))
    mine = load_file(str(tmp_path / "one" / "runs" / "toy" / "checkpoints" / "3" / weights))
    assert_close(mine, theirs)
    start = load_file(str(Path(TOY) / weights))
    assert max(float((mine[k] - start[k]).abs().max()) for k in mine) > 1e-3
    loaded = SD3Transformer2DModel.from_pretrained(str(checkpoint / "transformer"))
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.slow
def test_fsdp_bf16_shards_bf16_base_weights_and_float32_lora_in_one_unit(tiny_sd3_path,
                                                                         tmp_path):
    """The GPU recipe's layout on CPU: bf16 frozen base weights next to float32 LoRA weights in
    the same transformer block (one FSDP2 unit, no use_orig_params), trained under bf16
    autocast. It runs, splits both kinds, and the first replay still sees the rollout's
    weights (ratio exactly 1)."""
    model = {**tiny_sd3(tiny_sd3_path), "dtype": "bfloat16"}
    config = write_config(tmp_path, "bf16", model, {"max_iterations": 2},
                          mixed_precision="bf16")
    record = launch(2, config, tmp_path / "out.json", "mp_fsdp.py", config_file=FSDP_FILE)
    assert_split_in_two(record)
    assert record["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert record["first_pass_ratio_max_dev"] == [0.0, 0.0]
    weights = lora_file(tmp_path, "bf16", 2)
    assert all(bool(torch.isfinite(t).all()) and t.dtype == torch.float32
               for t in weights.values())
