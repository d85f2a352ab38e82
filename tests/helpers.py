"""Small rewards and builders shared by trainer tests (loaded by dotted path, like a user's own)."""
from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from types import ModuleType

from torch import Tensor


def free_port() -> int:
    """A TCP port free on localhost now, for a launched process group's rendezvous: a fixed port
    collides with another job (or a previous run's socket) on the same machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def report_and_close(accelerator, out_path: str, record: dict) -> None:
    """End of a launched test process: the main process writes ``record`` as JSON, every process
    waits for it, then leaves the process group cleanly (no gloo abort at exit)."""
    import json

    import torch

    if accelerator.is_main_process:
        with open(out_path, "w") as f:
            json.dump(record, f)
    accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Leave without the interpreter's C++ teardown: with torch 2.14's gloo on CPU it aborted now
    # and then ("terminate called without an active exception", SIGABRT) after all the work was
    # done and written, failing the launch. The record is on disk; nothing is left to flush.
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


class Constant:
    """The same score for every sample (ensemble members with known statistics)."""

    name = "constant"

    def __init__(self, value: float = 0.0) -> None:
        self.value = float(value)

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        import torch

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
