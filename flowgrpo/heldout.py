"""Held-out metrics and the best evaluation: which way a metric improves, the rewards of
``eval.rewards`` (scored beside the training rewards, never trained on), and the record of the
best evaluation behind ``run.select_best_on`` and ``run.early_stop_patience``.

How they flow: ``policy.evaluate`` scores the evaluation's samples with the training rewards and
with ``eval.rewards`` (the same samples, once) -> ``Trainer.eval_and_log`` logs ``eval/<key>`` ->
``curves.png`` and the tracker -> ``BestRecord.observe`` decides whether ``checkpoints/best/``
is rewritten and whether the run stops.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from flowgrpo.config import TrainConfig, training_reward_keys
from flowgrpo.errors import ConfigError

TOTAL_KEY = "total"


# --------------------------------------------------------------------------- direction

def higher_is_better(reward: Any) -> bool:
    """A reward's ``higher_is_better`` (True unless its class says False), looked up through the
    wrappers the loaders put around it (``ManagedReward`` / ``LoadedTextReward``: ``.inner``)."""
    inner = getattr(reward, "inner", None)
    if inner is not None and hasattr(inner, "higher_is_better"):
        return bool(inner.higher_is_better)
    return bool(getattr(reward, "higher_is_better", True))


def reward_directions(*rewards: Any) -> dict[str, bool]:
    """Reward key -> higher is better, over ``MultiReward``s (None skipped)."""
    out: dict[str, bool] = {}
    for multi in rewards:
        if multi is not None:
            out.update({key: higher_is_better(r) for key, r in multi.rewards.items()})
    return out


def metric_reward_key(metric: str) -> str:
    """The reward key of a metric: ``eval/toy_artifacts.texture/family_mean`` -> toy_artifacts;
    also for a bare reward key (``geneval_toy.exact`` -> geneval_toy)."""
    name = metric[len("eval/"):] if metric.startswith("eval/") else metric
    return name.split("/")[0].split(".")[0]


def metric_higher_is_better(metric: str, directions: dict[str, bool]) -> bool:
    """Direction of a metric (an ``eval/...`` key or a reward key), from its reward's; a
    component and a family statistic go the way of their reward; unknown keys count as higher
    is better (``total``, accuracy)."""
    return directions.get(metric_reward_key(metric), True)


# --------------------------------------------------------------------------- eval.rewards

def eval_reward_specs(config: TrainConfig) -> list[dict]:
    """``eval.rewards`` as MultiReward specs; weights are 0 because held-out metrics are never
    summed into anything."""
    return [{**spec.options, "name": spec.name, "weight": 0.0} for spec in config.eval.rewards]


@contextmanager
def isolated_rng(device: torch.device | str | None = None) -> Iterator[None]:
    """Run a block without moving the global torch RNG (CPU, and ``device``'s when it is a CUDA
    device), so that loading or running held-out metrics cannot change what the run trains:
    LoRA initialisation and anything else drawing from the global generator see the same state
    with or without ``eval.rewards``."""
    devices = []
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        yield


def load_eval_rewards(config: TrainConfig, device: torch.device | str,
                      load: Callable[[dict], Any], combine: Callable[..., Any], *,
                      training: Any = None):
    """The rewards of ``eval.rewards`` on ``device`` combined (None when there are none), built
    without touching the global RNG. The policy hands in its reward machinery: ``load`` builds
    one reward from a spec (the flow policy's ``load_reward``, the LM policy's text rewards),
    ``combine(specs, load=...)`` combines them (``MultiReward``). An error of one reward
    becomes a ConfigError naming ``eval.rewards[i]``; a key equal to one of ``training``'s (the
    training MultiReward: a ``module:Class`` reward may name itself) is refused with the fix."""
    specs = eval_reward_specs(config)
    if not specs:
        return None
    position = {id(spec): i for i, spec in enumerate(specs)}

    def load_one(spec: dict):
        try:
            return load(spec)
        except (ValueError, TypeError, ImportError, OSError) as err:
            i = position[id(spec)]
            raise ConfigError(f"eval.rewards[{i}] ({spec['name']}) does not load: "
                              f"{err}") from err

    with isolated_rng(device):
        try:
            reward = combine(specs, load=load_one)
        except ValueError as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"eval.rewards: {err}") from err
    if training is not None:
        reserved = set(training.rewards) | training_reward_keys(config)
        clash = sorted(set(reward.rewards) & reserved)
        if clash:
            raise ConfigError(f"eval.rewards: the reward keyed {clash[0]!r} would be logged as "
                              f"eval/{clash[0]} like a training reward's; give it another key "
                              f"with options: {{label: {clash[0]}_heldout}}")
    return reward


def score_eval_rewards(reward, media, prompts: list[str], metadata: list[dict],
                       device: torch.device | str | None = None) -> dict[str, Tensor]:
    """Every held-out key's (B,) scores (main scores and components; no ``total``), computed
    without moving the global RNG. Empty without eval rewards or samples."""
    if reward is None or len(prompts) == 0:
        return {}
    with isolated_rng(device), torch.no_grad():
        scores = reward(media, prompts, metadata)
    scores.pop(TOTAL_KEY, None)
    return scores


# --------------------------------------------------------------------------- the best evaluation

class BestRecord:
    """The best value so far of one metric (``run.select_best_on``) and how many evaluations
    in a row have not beaten it. ``mode``: "max" or "min" (``resolve_mode`` turns "auto" into one
    of them). Strictly better values improve; NaN never does."""

    def __init__(self, key: str, mode: str) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min' (got {mode!r})")
        self.key = key
        self.mode = mode
        self.value: float | None = None
        self.iteration: int | None = None
        self.since = 0              # evaluations since the best (0 right after a new best)

    def better(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value

    def observe(self, iteration: int, metrics: dict[str, float]) -> bool:
        """Record an evaluation's ``metrics``; True when it is a new best. A record without the
        key raises ``ConfigError`` listing the keys it has (a misspelt family, or the
        family_mean of prompts without families)."""
        if self.key not in metrics:
            have = ", ".join(sorted(k for k in metrics if k.startswith("eval/")
                                    and not k.endswith("/se")))
            raise ConfigError(f"run.select_best_on {self.key!r} is not among the evaluation's "
                              f"metrics; choose one of: {have}")
        value = float(metrics[self.key])
        if self.better(value):
            self.value, self.iteration, self.since = value, iteration, 0
            return True
        self.since += 1
        return False

    def exhausted(self, patience: int) -> bool:
        """``patience`` evaluations in a row without a new best (never when patience is 0)."""
        return patience > 0 and self.since >= patience

    def state_dict(self) -> dict:
        return {"key": self.key, "mode": self.mode, "value": self.value,
                "iteration": self.iteration, "since": self.since}

    def load_state_dict(self, state: dict | None) -> bool:
        """Take over a saved record of the same key and mode; False (record unchanged) for
        another metric or none."""
        if not state or state.get("key") != self.key or state.get("mode") != self.mode:
            return False
        self.value, self.iteration = state.get("value"), state.get("iteration")
        self.since = int(state.get("since", 0))
        return True


def resolve_mode(mode: str, key: str, directions: dict[str, bool]) -> str:
    """"max" / "min" as given, or for "auto" the direction of the key's reward."""
    if mode != "auto":
        return mode
    return "max" if metric_higher_is_better(key, directions) else "min"
