"""What several test modules share: small rewards (loaded by dotted path, like a user's own),
tiny run configs, and runs launched as several processes."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch
import yaml
from safetensors.torch import load_file
from torch import Tensor

from flowgrpo.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on localhost now, for a launched process group's rendezvous: a fixed port
    collides with another job (or a previous run's socket) on the same machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def report_and_close(accelerator, out_path: str, record: dict) -> None:
    """End of a launched test process: the main process writes ``record`` as JSON, every process
    waits for it, then leaves the process group cleanly (no gloo abort at exit)."""
    if accelerator.is_main_process:
        with open(out_path, "w") as f:
            json.dump(record, f)
    accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Leave without the interpreter's C++ teardown: with torch 2.14's gloo on CPU it aborted now
    # and then ("terminate called without an active exception", SIGABRT) after all the work was
    # done and written, failing the launch. The record is on disk; nothing is left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def history_record(history: list[dict]) -> dict:
    """What the launched training scripts report of a run's history: the first-pass ratio
    deviation and the optimiser steps of each iteration, and each evaluation's metrics."""
    train = [h for h in history if h["phase"] == "train"]
    return {"first_pass_ratio_max_dev": [h["train/first_pass_ratio_max_dev"] for h in train],
            "optimizer_steps": [h["train/optimizer_steps"] for h in train],
            "eval": [{k: v for k, v in h.items() if k.startswith("eval/")} for h in history
                     if h["phase"] == "eval"]}


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (benchmarks/ is scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the classes are created.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


class Brightness:
    """Mean pixel value: a smooth, cheap, real reward for learning tests."""

    name = "brightness"

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return media.flatten(1).mean(1).float()


class NaNForFirst:
    """Brightness, but NaN for the first sample of each call (tests NaN masking)."""

    name = "nan_first"

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        out = media.flatten(1).mean(1).float()
        out[0] = float("nan")
        return out


class AllNaN:
    """NaN for every sample: a reward that never works (a dead server, say)."""

    name = "all_nan"

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return torch.full((media.shape[0],), float("nan"))


class SignalOnCall:
    """Brightness that sends ``signal`` to its own process at its ``call``-th call (1-based),
    only on the process of rank ``rank`` when given: a signal that arrives during a rollout."""

    name = "brightness"

    def __init__(self, signal: str = "SIGTERM", call: int = 1, rank: int | None = None) -> None:
        self.signal, self.call, self.rank, self.calls = signal, int(call), rank, 0

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        self.calls += 1
        if self.calls == self.call and (self.rank is None or
                                        int(os.environ.get("RANK", "0")) == self.rank):
            os.kill(os.getpid(), getattr(signal, self.signal))
        return media.flatten(1).mean(1).float()


class Constant:
    """The same score for every sample (ensemble members with known statistics)."""

    name = "constant"

    def __init__(self, value: float = 0.0) -> None:
        self.value = float(value)

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return torch.full((media.shape[0],), self.value)


class BrightnessSpread:
    """Brightness with a second component, the pixel std of each image: a reward that reports
    its own spread (like an ensemble's std), for the KL gate. No ``component_names``."""

    name = "brightness_spread"
    main_component = "mean"

    def components(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> dict:
        flat = media.flatten(1).float()
        return {"mean": flat.mean(1), "spread": flat.std(1)}

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return self.components(media, prompts, metadata)["mean"]


class Darkness:
    """1 - mean pixel value: a second reward pulling against Brightness."""

    name = "darkness"

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return 1.0 - media.flatten(1).mean(1).float()


class MeanColour:
    """A diversity feature: the mean colour of each image, (B, 3)."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, media: Tensor) -> Tensor:
        return self.scale * media.flatten(2).mean(2)


# --------------------------------------------------------------------------- tiny SD3 runs

# The plans a first-pass test runs under, as overrides.
PLANS = {
    "full": ["sampling.plan.kind=full"],
    "full_random": ["sampling.plan.kind=full", "sampling.plan.train_fraction=0.6",
                    "sampling.plan.train_select=random"],
    "window": ["sampling.plan.kind=window", "sampling.plan.window_size=2"],
    "window_dpm": ["sampling.plan.kind=window", "sampling.plan.window_size=2",
                   "sampling.plan.solver_after=dpmpp_2m", "sampling.plan.compress_ratio=0.5"],
    "branch": ["sampling.plan.kind=branch", "sampling.plan.window_size=2"],
    "one_step": ["sampling.plan.kind=one_step"],
}


def tiny_data(model_path: str, root: Path, **sections: dict) -> dict:
    """A tiny-SD3 run config under ``root`` (its prompts file written there); ``sections``
    update its sections (a dict merges into the section, anything else replaces it)."""
    data = {
        "name": "tiny",
        "model": {"family": "sd3", "path": model_path, "options": {"height": 32, "width": 32},
                  "lora": {"rank": 4, "alpha": 8}},
        "prompts": {"train": str(root / "prompts.txt"), "eval": None},
        "sampling": {"num_steps": 4, "eval_num_steps": 4, "rollout_batch_size": 4,
                     "guidance_scale": 1.0},
        "training": {"prompts_per_iteration": 2, "group_size": 4, "lr": 1e-2, "clip_low": 0.2},
        "rewards": {"components": [{"name": "tests.helpers:Brightness"}], "threaded": False},
        "run": {"output_dir": str(root / "runs"), "max_iterations": 1, "tracker": "none",
                "progress": False, "checkpoint_every": 0, "eval_every": 0},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "prompts.txt").exists():
        (root / "prompts.txt").write_text("a red square\na blue circle\na green cat\n")
    return data


def family_config(family: str, path: str, tmp_path: Path, options: dict, *overrides: str,
                  guidance_scale: float = 1.0, iterations: int = 1, num_steps: int = 4,
                  prompts: str | None = None) -> TrainConfig:
    """A two-prompt LoRA (rank 2) run of a diffusers family's tiny build with the Brightness
    reward, no evaluation and no checkpoints: what each family's tests train with. ``prompts``:
    a prompt file (default: two prompts written to ``tmp_path``)."""
    if prompts is None:
        prompts = str(tmp_path / "prompts.txt")
        Path(prompts).write_text("a red square\na blue circle\n")
    return load_config(data={
        "name": family,
        "model": {"family": family, "path": path, "options": dict(options),
                  "lora": {"rank": 2, "alpha": 4}},
        "prompts": {"train": prompts, "eval": None},
        "sampling": {"num_steps": num_steps, "rollout_batch_size": 2,
                     "guidance_scale": guidance_scale},
        "training": {"prompts_per_iteration": 2, "group_size": 2, "lr": 1e-3,
                     "skip_zero_std_groups": False},
        "rewards": {"components": [{"name": "tests.helpers:Brightness"}], "threaded": False},
        "run": {"output_dir": str(tmp_path / "runs"), "max_iterations": iterations,
                "tracker": "none", "progress": False, "checkpoint_every": 0, "eval_every": 0},
    }, overrides=list(overrides))


def assert_on_policy_training(config: TrainConfig, transitions: int, iterations: int = 1) -> None:
    """Train ``config`` for its iterations: each is exactly on-policy on its first pass (ratio 1),
    trains ``transitions`` transitions, takes an optimiser step and has a finite policy loss."""
    from flowgrpo.trainer import Trainer

    train = [h for h in Trainer(config).train() if h["phase"] == "train"]
    assert len(train) == iterations
    for record in train:
        assert record["train/first_pass_ratio_max_dev"] == 0.0
        assert record["trained_transitions"] == transitions
        assert record["train/optimizer_steps"] >= 1
        assert math.isfinite(record["train/policy_loss"])


def tiny_config(path: str, tmp_path: Path, *overrides: str) -> TrainConfig:
    """``tiny_data``'s config with dotted ``overrides``."""
    return load_config(data=tiny_data(path, tmp_path), overrides=list(overrides))


# --------------------------------------------------------------------------- launched runs

def run_launch(num_processes: int, script: str, *args: str, timeout: int = 300,
               config_file: Path | None = None) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``tests/<script>`` on CPU processes; ``config_file``: an accelerate
    config (e.g. configs/accelerate/fsdp.yaml) whose engine the processes run, the flags below
    overriding its process count and precision."""
    # torchrun-style launch of CPU processes: accelerate picks gloo when ACCELERATE_USE_CPU is set.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "true"}
    engine = (["--config_file", str(config_file)] if config_file is not None
              else ["--multi_gpu" if num_processes > 1 else "--cpu"])
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *engine,
           "--num_processes", str(num_processes), "--num_machines", "1",
           "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", str(ROOT / "tests" / script), *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def errors_of(result: subprocess.CompletedProcess) -> str:
    # progress bars fill stderr; keep the rest, so that a failure shows its cause
    return "\n".join(line for line in result.stderr.splitlines() if "it/s]" not in line)


def launch(num_processes: int, config: Path, out: Path, script: str = "mp_advantages.py",
           *before: str, after: tuple[str, ...] = (), config_file: Path | None = None) -> dict:
    """Launch ``script [*before] CONFIG OUT [*after]`` (``run_launch``) and return OUT's record."""
    result = run_launch(num_processes, script, *before, str(config), str(out), *after,
                        config_file=config_file)
    assert result.returncode == 0, errors_of(result)[-6000:]
    return json.loads(out.read_text())


def train_config(path: Path, tmp: Path, name: str, model: dict, **training) -> None:
    (tmp / "prompts.txt").write_text("a red square\na blue circle\na green cat\n")
    path.write_text(yaml.safe_dump({
        "name": name,
        "model": model,
        # 3 held-out rows over 2 processes: 2 on one, 1 (+ 1 padding) on the other
        "prompts": {"train": str(tmp / "prompts.txt"), "eval": str(tmp / "prompts.txt")},
        "sampling": {"num_steps": 3, "rollout_batch_size": 2, "guidance_scale": 1.0,
                     "eval_num_steps": 3},
        # 2 groups of 4: one group per process. 2 inner epochs of one optimiser step each: the
        # second replays off-policy (ratios != 1), and each step accumulates every replay batch
        # of the process, all but the last without gradient sync.
        "training": {"prompts_per_iteration": 2, "group_size": 4, "lr": 1e-3,
                     "skip_zero_std_groups": False, "num_inner_epochs": 2,
                     "max_grad_norm": 0.0, **training},
        "rewards": {"components": [{"name": "tests.helpers:Brightness"}], "threaded": False},
        "run": {"output_dir": str(tmp / "runs"), "tracker": "none", "progress": False,
                "max_iterations": 3, "eval_every": 0, "checkpoint_every": 0,
                "comparison_grid": False},
    }))


def final_weights(tmp: Path, name: str) -> dict:
    return load_file(str(tmp / "runs" / name / "checkpoints" / "3" / "trainable.safetensors"))


def assert_same_weights(one: dict, two: dict, start: dict | None = None) -> None:
    assert one.keys() == two.keys()
    for name in one:
        # DDP averages the two processes' gradients, one process sums the same terms in another
        # order: float32 rounding, then three Adam steps (which divide by the gradient's size).
        assert torch.allclose(one[name], two[name], atol=2e-5, rtol=1e-4), name
    moved = max(float((one[n] - start[n]).abs().max()) for n in one) if start else 1.0
    assert moved > 1e-3   # not trivially equal: training moved the weights


def edit_config(path: str, tmp_path: Path, *overrides: str) -> TrainConfig:
    """A one-iteration run of the toy editing model at ``path`` on toy edits, rewarded by
    ``toy_edit`` (partial), evaluated every iteration; dotted ``overrides`` on top."""
    data = {
        "name": "tiny_edit",
        "model": {"family": "toy", "path": path, "lora": {"enabled": False}},
        "prompts": {"train": "toy:edit_train", "eval": "toy:edit_heldout", "num_eval": 4},
        "sampling": {"num_steps": 4, "eval_num_steps": 4, "rollout_batch_size": 4,
                     "guidance_scale": 1.0},
        "training": {"prompts_per_iteration": 2, "group_size": 4, "lr": 1e-3, "clip_low": 0.2,
                     "skip_zero_std_groups": False},
        "rewards": {"components": [{"name": "toy_edit", "options": {"score": "partial"}}],
                    "threaded": False},
        "run": {"output_dir": str(tmp_path / "runs"), "max_iterations": 1, "tracker": "none",
                "progress": False, "checkpoint_every": 0, "eval_every": 1},
    }
    return load_config(data=data, overrides=list(overrides))
