"""Exponential moving average of the trainable weights (swapped in for evaluation and saving).

Flow-GRPO's ``EMAModuleWrapper`` (and Flash-GRPO's copy of it) decays with a warm-up,
d(k) = min((1 + k) / (10 + k), max_decay), and its training loops call it with k = the optimiser
steps taken so far, updating when (k + 1) % every == 0. Flow-GRPO calls it after every sample
batch, so each update is applied once per sample batch of the optimiser step (twice per step in
its 32-GPU SD3 recipes); Flash-GRPO calls it once per optimiser step. Two warm-ups are offered:

- ``"optimizer_steps"`` (the anchors'): after optimiser step k, when (k + 1) % every == 0, the
  update with decay d(k) is applied ``updates_per_step`` times. d reaches 0.9 at step 80.
- ``"updates"``: one update every ``every`` optimiser steps, with k = the updates made so far, so
  d reaches 0.9 after 80 updates, i.e. at optimiser step 640 with every = 8.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

EMA_WARMUPS = ("updates", "optimizer_steps")


def ema_decay(count: int, max_decay: float) -> float:
    """The decay at warm-up count ``count`` (k >= 0): min((1 + k) / (10 + k), max_decay)."""
    return min((1 + count) / (10 + count), max_decay)


class EMA:
    """EMA of ``parameters`` with Flow-GRPO's warm-up (module docstring); ``step()`` after every
    optimiser step."""

    def __init__(self, parameters: dict[str, torch.nn.Parameter], max_decay: float = 0.9,
                 every: int = 8, warmup: str = "updates", updates_per_step: int = 1) -> None:
        if warmup not in EMA_WARMUPS:
            raise ValueError(f"warmup must be one of {EMA_WARMUPS} (got {warmup!r})")
        if updates_per_step < 1:
            raise ValueError(f"updates_per_step must be >= 1 (got {updates_per_step})")
        self.parameters = parameters
        self.max_decay = max_decay
        self.every = every
        self.warmup = warmup
        self.updates_per_step = updates_per_step
        self.num_updates = 0
        self.steps = 0
        self.shadow = {name: p.detach().clone().float() for name, p in parameters.items()}

    def decay(self) -> float:
        """The decay of an update made now (at the current warm-up count)."""
        count = self.num_updates if self.warmup == "updates" else self.steps
        return ema_decay(count, self.max_decay)

    def _due(self) -> bool:
        if self.warmup == "updates":
            return self.steps % self.every == 0
        return (self.steps + 1) % self.every == 0

    @torch.no_grad()
    def step(self) -> None:
        """Call after every optimiser step; updates the shadow when the warm-up's cadence says so
        (module docstring)."""
        self.steps += 1
        if not self._due():
            return
        decay = self.decay()
        repeats = self.updates_per_step if self.warmup == "optimizer_steps" else 1
        for _ in range(repeats):
            for name, param in self.parameters.items():
                self.shadow[name].mul_(decay).add_(param.detach().float(), alpha=1 - decay)
        self.num_updates += repeats

    @contextmanager
    def swapped_in(self):
        """Temporarily load the EMA weights into the model."""
        backup = {name: p.detach().clone() for name, p in self.parameters.items()}
        with torch.no_grad():
            for name, param in self.parameters.items():
                param.copy_(self.shadow[name].to(param.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self.parameters.items():
                    param.copy_(backup[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def counters(self) -> dict[str, int]:
        return {"num_updates": self.num_updates, "steps": self.steps}

    def load(self, shadow: dict[str, torch.Tensor], counters: dict[str, int]) -> None:
        self.shadow = {k: v.clone().float() for k, v in shadow.items()}
        self.num_updates = counters["num_updates"]
        self.steps = counters["steps"]
