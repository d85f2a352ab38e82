"""Two processes (accelerate launch, gloo on CPU) against one: the same advantages on the same
rollouts (rewards gathered, groups spanning processes, noise seeded per sample), the same weights
after training under DDP, and an error on the main process ending every process."""
import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import (assert_same_weights, errors_of, final_weights, launch, run_launch,
                           train_config)

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, model_path: str, tmp: Path) -> None:
    (tmp / "prompts.txt").write_text("a red square\na blue circle\na green cat\n")
    path.write_text(yaml.safe_dump({
        "name": "mp",
        "model": {"family": "sd3", "path": model_path, "options": {"height": 32, "width": 32},
                  "lora": {"rank": 4, "alpha": 8}},
        "prompts": {"train": str(tmp / "prompts.txt"), "eval": None},
        # 3 groups of 4 over 2 processes: group 1 spans both processes.
        "sampling": {"num_steps": 3, "rollout_batch_size": 2},
        "training": {"prompts_per_iteration": 3, "group_size": 4},
        "rewards": {"components": [{"name": "tests.helpers:Brightness"}], "threaded": False},
        "run": {"output_dir": str(tmp / "runs"), "tracker": "none", "progress": False},
    }))


def test_two_processes_match_one(tiny_sd3_path, tmp_path):
    config = tmp_path / "mp.yaml"
    write_config(config, tiny_sd3_path, tmp_path)
    one = launch(1, config, tmp_path / "one.json")
    two = launch(2, config, tmp_path / "two.json")
    assert two["num_processes"] == 2
    assert one["sample_ids"] == two["sample_ids"] == list(range(12))
    assert one["group_ids"] == two["group_ids"]
    assert one["rewards"] == pytest.approx(two["rewards"], abs=1e-6)
    assert one["advantages"] == pytest.approx(two["advantages"], abs=1e-5)
    # Not trivially equal: the advantages carry signal.
    assert max(abs(a) for a in one["advantages"]) > 0.5


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_ddp_two_processes_train_the_same_weights_as_one(tiny_sd3_path, tmp_path, lora):
    """3 iterations of tiny SD3 on 1 and on 2 processes end with the same weights; on 2 the
    trainable parameters are those of the DDP wrapper (gradients all-reduced by DDP), and the
    evaluation split over both processes gives the metrics of one."""
    model = {"family": "sd3", "path": tiny_sd3_path, "options": {"height": 32, "width": 32},
             "lora": {"enabled": lora, "rank": 4, "alpha": 8}}
    for processes in (1, 2):
        folder = tmp_path / str(processes)
        folder.mkdir()
        train_config(folder / "c.yaml", folder, "ddp", model)
        record = launch(processes, folder / "c.yaml", folder / "out.json", "mp_train.py", "train")
        assert record["num_processes"] == processes
        assert record["first_pass_ratio_max_dev"] == [0.0, 0.0, 0.0]
        assert record["optimizer_steps"] == [2, 2, 2]
        if processes == 2:
            assert record["engine"] == "ddp"
            assert record["wrapper"] == "DistributedDataParallel"
            assert record["wrapped_parameters"] == record["trainable"]
    assert_same_weights(final_weights(tmp_path / "1", "ddp"), final_weights(tmp_path / "2", "ddp"))
    evals = [json.loads((tmp_path / str(p) / "out.json").read_text())["eval"] for p in (1, 2)]
    assert len(evals[0]) == len(evals[1]) == 2 and "eval/brightness" in evals[0][0]
    for one, two in zip(*evals):
        assert one.keys() == two.keys()
        for key in one:
            assert two[key] == pytest.approx(one[key], abs=1e-4), key


@pytest.mark.slow
def test_ddp_two_processes_train_the_toy_model_like_one(tmp_path):
    """The same on the embedded toy model (full fine-tuning, as the default config)."""
    model = {"family": "toy", "path": str(ROOT / "assets" / "toy"), "lora": {"enabled": False}}
    for processes in (1, 2):
        folder = tmp_path / str(processes)
        folder.mkdir()
        train_config(folder / "c.yaml", folder, "toy", model)
        record = launch(processes, folder / "c.yaml", folder / "out.json", "mp_train.py", "train")
        assert record["first_pass_ratio_max_dev"] == [0.0, 0.0, 0.0]
    assert_same_weights(final_weights(tmp_path / "1", "toy"), final_weights(tmp_path / "2", "toy"))


def test_error_on_the_main_process_during_save_ends_every_process(tiny_sd3_path, tmp_path):
    """The main process fails while checkpointing; the other process must not wait in a barrier
    until the process group times out (30 min): both exit, naming the error, within seconds."""
    import time

    model = {"family": "sd3", "path": tiny_sd3_path, "options": {"height": 32, "width": 32},
             "lora": {"rank": 4, "alpha": 8}}
    train_config(tmp_path / "c.yaml", tmp_path, "fail", model)
    began = time.perf_counter()
    result = run_launch(2, "mp_train.py", "fail_save", str(tmp_path / "c.yaml"),
                        str(tmp_path / "out.json"), timeout=240)
    assert result.returncode != 0
    errors = errors_of(result)
    assert "disk full while saving (injected by the test)" in errors
    # the other rank names the main process's error instead of timing out
    assert "the main process failed in checkpoint 3: OSError: disk full" in errors
    assert time.perf_counter() - began < 120
    assert not (tmp_path / "out.json").exists()
