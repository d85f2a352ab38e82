"""Two processes (accelerate launch, gloo on CPU) compute the same advantages as one process on the
same rollouts: rewards are gathered, groups span processes, noise is seeded per sample."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import free_port

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


def launch(num_processes: int, config: Path, out: Path) -> dict:
    # torchrun-style launch of CPU processes: accelerate picks gloo when ACCELERATE_USE_CPU is set.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "true"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu" if num_processes > 1 else "--cpu",
           "--num_processes", str(num_processes), "--num_machines", "1",
           "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", str(ROOT / "tests" / "mp_advantages.py"), str(config), str(out)]
    result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    # progress bars fill stderr; keep the rest, so that a failure shows its cause
    errors = "\n".join(line for line in result.stderr.splitlines() if "it/s]" not in line)
    assert result.returncode == 0, errors[-6000:]
    return json.loads(out.read_text())


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
