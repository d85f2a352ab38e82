"""Exponential moving average of the trainable weights (swapped in for evaluation and saving)."""
from __future__ import annotations

from contextlib import contextmanager

import torch


class EMA:
    """EMA with Flow-GRPO's warm-up: decay_k = min((1 + k) / (10 + k), max_decay)."""

    def __init__(self, parameters: dict[str, torch.nn.Parameter], max_decay: float = 0.9,
                 every: int = 8) -> None:
        self.parameters = parameters
        self.max_decay = max_decay
        self.every = every
        self.num_updates = 0
        self.steps = 0
        self.shadow = {name: p.detach().clone().float() for name, p in parameters.items()}

    def decay(self) -> float:
        return min((1 + self.num_updates) / (10 + self.num_updates), self.max_decay)

    @torch.no_grad()
    def step(self) -> None:
        """Call after every optimiser step; updates the shadow every ``every`` steps."""
        self.steps += 1
        if self.steps % self.every:
            return
        decay = self.decay()
        for name, param in self.parameters.items():
            self.shadow[name].mul_(decay).add_(param.detach().float(), alpha=1 - decay)
        self.num_updates += 1

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
