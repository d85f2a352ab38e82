"""What the training loop asks of a policy, and the pieces every policy shares.

``Trainer`` (``flowgrpo/trainer.py``) is the generic loop: prompts, gather, advantages, the
optimiser on accelerate's engine, EMA, checkpoints and logging. A *policy* is what differs between
a flow-matching generator and a causal LM: how the model loads and what trains, how a batch of
prompts becomes scored rollouts with replay batches, the loss of one replay batch, evaluation and
the comparison grid. ``FlowPolicy`` (``flowgrpo/flow_policy.py``) and ``LMPolicy``
(``flowgrpo/llm.py``) implement it; ``policy_registry.POLICIES`` maps ``config.policy`` to them.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch.distributed as dist
from torch import Tensor, nn

from flowgrpo.policy_registry import load_policy_class

if TYPE_CHECKING:   # annotations only: the policies get a built config
    from flowgrpo.config import TrainConfig


class Policy(Protocol):
    """The policy-specific half of a trainer.

    Attributes: ``module`` (the ``nn.Module`` that trains: what the engine wraps), ``trainable``
    (name -> parameter, the optimiser's parameters), ``reward`` (a callable with ``weights``: the
    component weights, for the advantages and the logs).
    """

    module: nn.Module
    trainable: dict[str, nn.Parameter]
    reward: Any

    @staticmethod
    def check_config(config: TrainConfig) -> None:
        """The names of ``config`` that this policy's registries own (model families and
        adapter options, reward names), checked by them at config load (``config.validate``),
        before anything loads; raises ConfigError naming the field."""

    @staticmethod
    def check_model_source(config: TrainConfig) -> None:
        """Fail with one message when ``model.path`` cannot be had, before prompts, rewards or
        weights load (the trainer calls it first)."""

    @property
    def accumulation_steps(self) -> int:
        """Replay batches per optimiser step over every process (0: all of an inner epoch),
        derived from the config for this run's process count."""

    @property
    def ema_updates_per_step(self) -> int:
        """Times each EMA update is applied (``training.ema.updates_per_step``, with 0 resolved
        for this run)."""

    def bind(self, engine_module: nn.Module, sharded: bool) -> None:
        """Hand the policy the engine's wrapper of ``module`` (DDP / FSDP / DeepSpeed, or
        ``module`` itself): the training forward must run through it. ``sharded``: every forward,
        sampling included, must too (the parameters live in shards)."""

    def rollout(self, records: list[dict], group_ids: Tensor, sample_ids: Tensor, iteration: int
                ) -> tuple[Any, dict[str, Tensor], dict[str, float]]:
        """Sample and score this process's rows: a batch with ``prompts``, ``group_ids``,
        ``replay`` (the replay batches, each with ``rows``), ``nfe`` and
        ``trained_transitions``; rewards name -> (B,) float32 CPU (NaN = no reward, "total"
        among them); timing and rollout metrics."""

    def step_weights(self, replays: list) -> list[Tensor]:
        """Per-row loss weights of each replay batch (called once per update, on every process)."""

    def replay_loss(self, batch: Any, replay: Any, advantages: Tensor, iteration: int,
                    clip_high: float, weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one replay batch and a record of detached statistics, among them 0-d
        ``ratio_max_dev`` (max |ratio - 1|, exactly 0 on the first pass) and ``policy_loss``."""

    def update_metrics(self, rows: dict[str, Tensor], clip_high: float) -> dict[str, Tensor]:
        """An update's statistics from the concatenated records of its replay batches."""

    def after_optimizer_step(self) -> None:
        """Called after every optimiser step that changed the weights."""

    def after_update(self) -> dict[str, float]:
        """Called after each iteration's update; returns metrics to log."""

    def algorithm_state(self) -> tuple[dict, dict[str, Tensor]]:
        """(JSON-able state, tensors) of the training algorithm for an exact resume."""

    def load_algorithm_state(self, state: dict, tensors: dict[str, Tensor]) -> None:
        """Restore ``algorithm_state``'s output."""

    def evaluate(self, records: list[dict], iteration: int, out_dir: Path | None
                 ) -> dict[str, float]:
        """Held-out metrics (``eval/...``); writes samples under ``out_dir`` when given."""

    def save_grid_samples(self, records: list[dict], run_dir: Path, tag: str) -> None:
        """Deterministic samples of the comparison prompts, saved under ``run_dir``."""

    def write_comparison_grid(self, records: list[dict], run_dir: Path, final_label: str
                              ) -> Path | None:
        """The base-vs-final comparison of ``records`` from the saved samples."""

    def save_weights(self, folder: str, state_dict: dict[str, Tensor] | None = None) -> None:
        """The user-facing weights (LoRA in its ecosystem's format, or the full model);
        ``state_dict`` is the consolidated trainable state under a sharded engine."""


def eval_share(count: int, num_processes: int, process_index: int) -> tuple[list[int], int]:
    """This process's share of ``count`` evaluation rows: contiguous chunks of ceil(count / P)
    rows, the last ones padded by repeating a row, so that every process runs the same number of
    forwards (a sharded engine gathers parameters in every forward). Returns (indices, real):
    the first ``real`` indices are this process's rows, the rest padding."""
    per = -(-count // num_processes) if count else 0
    start = min(process_index * per, count)
    real = max(0, min(count, start + per) - start)
    indices = list(range(start, start + real))
    filler = indices[-1] if indices else 0
    return indices + [filler] * (per - real) if count else [], real


def gather_rows(rows: list, accelerator) -> list:
    """Every process's list of rows (picklable values: floats, CPU tensors), concatenated in
    process order; every process gets all of them."""
    if accelerator.num_processes == 1:
        return list(rows)
    parts: list = [None] * accelerator.num_processes
    dist.all_gather_object(parts, rows)
    return [row for part in parts for row in part]


def check_model_source(config: TrainConfig) -> None:
    """The policy's ``check_model_source``: a model that cannot be had fails first, with one
    message, before prompts, rewards or weights load (and before any policy is built)."""
    load_policy_class(config.policy).check_model_source(config)


class Through:
    """A module seen through its engine's wrapper: calls go through ``wrapper`` (so DDP's
    gradient hooks and FSDP's all-gathers run), attribute reads come from ``module`` (adapters
    read ``transformer.config``, ``.dtype``, ... which a wrapper does not forward)."""

    def __init__(self, wrapper: nn.Module, module: nn.Module) -> None:
        self._wrapper = wrapper
        self._module = module

    def __call__(self, *args, **kwargs):
        return self._wrapper(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def float32_trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> parameter of ``module``'s trainable parameters, cast to float32 (LoRA weights train
    in float32 whatever the base dtype: fp16 gradients of small adapters underflow)."""
    for param in module.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    if not trainable:
        raise ValueError("model.lora.target_modules matched no module: nothing to train")
    return trainable


def frozen_reference(config: TrainConfig, module: nn.Module) -> nn.Module | None:
    """The KL reference for full fine-tuning (there is no adapter to disable): a frozen copy of
    the initial module (``training.gardo.refresh_every`` copies later weights into it). None when
    nothing compares with a reference (kl_beta, kl_reward, anchor_beta and
    locality.keep_kl_beta all 0, and an algorithm other than dpo, gdro and dgpo with reference base)
    or LoRA provides the reference."""
    t = config.training
    uses_reference = (t.kl_beta > 0 or t.kl_reward > 0 or t.anchor_beta > 0
                      or t.locality.keep_kl_beta > 0 or t.algorithm in ("dpo", "gdro")
                      or (t.algorithm == "dgpo" and t.dgpo.reference == "base"))
    if uses_reference and not config.model.lora.enabled:
        return copy.deepcopy(module).requires_grad_(False)
    return None


@contextmanager
def swapped_attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Temporarily set ``owner.<name>`` to ``value``."""
    live = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, live)
