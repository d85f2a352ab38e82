"""accelerate's engines as the trainer sees them: which one was launched, what it cannot do
(refused at start, before any model loads, instead of a hang later), and the replica check."""
from __future__ import annotations

import os

import torch
from accelerate.utils import DistributedType
from torch import Tensor

from flowgrpo.config import TrainConfig
from flowgrpo.errors import ConfigError


def replica_checksums(tensors: list[Tensor]) -> Tensor:
    """(len(tensors), 2) float64: each tensor's sum and position-weighted sum. Equal rows on two
    processes mean equal weights up to a coincidence no initialisation or update produces."""
    rows = []
    for tensor in tensors:
        flat = tensor.detach().double().flatten()
        positions = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        rows.append(torch.stack([flat.sum(), (flat * positions).sum() / max(flat.numel(), 1)]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def set_gradient_sync(accelerator, sync: bool) -> None:
    """Whether the coming backward ends an accumulation window, through accelerate's public
    ``Accelerator.sync_gradients``: its prepared optimiser steps only when it is True, and
    DeepSpeed's backward reduces gradients then. The trainer runs the windows itself (windows of
    any length, the same on every process), so it sets this rather than counting steps in
    ``accelerator.accumulate``."""
    accelerator.sync_gradients = sync


def engine_name(accelerator) -> str:
    """'single' | 'ddp' | 'fsdp' | 'deepspeed' (other accelerate types by their lower-case name)."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return "fsdp"
    if kind == DistributedType.DEEPSPEED:
        return "deepspeed"
    if accelerator.num_processes > 1:
        return "ddp"
    return "single"


def preflight_engine(environ: dict[str, str] | None = None, cuda: bool | None = None) -> None:
    """FSDP and DeepSpeed need GPUs (and DeepSpeed its package): say so in one clear error before
    accelerate fails deep inside its setup. ``accelerate launch`` passes the engine in the
    environment (ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED)."""
    environ = os.environ if environ is None else environ
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for variable, engine in (("ACCELERATE_USE_FSDP", "FSDP"),
                             ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if environ.get(variable, "false").lower() not in ("true", "1"):
            continue
        if not cuda:
            raise ConfigError(f"the accelerate config asks for {engine}, which needs CUDA GPUs, "
                              f"and this machine has none: launch with configs/accelerate/ddp.yaml"
                              f" (or without --config_file) to train on CPU processes")
        if engine == "DeepSpeed":
            try:
                import deepspeed  # noqa: F401  (optional: only the GPU machine has it)
            except ImportError as err:
                raise ConfigError("the accelerate config asks for DeepSpeed, which is not "
                                  "installed: pip install deepspeed (on the GPU machine)") from err


def check_engine(config: TrainConfig, accelerator) -> bool:
    """What this trainer cannot do under the launched engine fails here, before any model loads
    (not as a hang later). Returns whether parameters are sharded (FSDP, DeepSpeed ZeRO-3)."""
    engine = engine_name(accelerator)
    sharded = False
    if engine == "fsdp":
        sharded = True
    elif engine == "deepspeed":
        plugin = accelerator.state.deepspeed_plugin
        sharded = int(plugin.zero_stage) == 3
        config_dict = plugin.deepspeed_config
        if str(config_dict.get("gradient_accumulation_steps", "auto")) not in ("auto", "1"):
            raise ConfigError("the DeepSpeed config sets gradient_accumulation_steps; this trainer "
                              "accumulates itself (training.gradient_accumulation_steps): set "
                              "it to 1 or auto in the accelerate/DeepSpeed config")
    if sharded:
        t = config.training
        if config.policy == "llm":
            raise ConfigError(f"policy llm under {engine} with sharded parameters is not "
                              f"supported (generation would need the full parameters on every "
                              f"process): use DDP, or DeepSpeed ZeRO-2")
        if t.ema.enabled:
            raise ConfigError(f"training.ema is not supported under {engine} with sharded "
                              f"parameters (each process holds a shard): set training.ema."
                              f"enabled: false or use DDP / DeepSpeed ZeRO-2")
        reference_terms = [name for name, value in (
            ("kl_beta", t.kl_beta), ("kl_reward", t.kl_reward),
            ("locality.keep_kl_beta", t.locality.keep_kl_beta)) if value > 0]
        if reference_terms and not config.model.lora.enabled:
            raise ConfigError(f"training.{reference_terms[0]} > 0 with full fine-tuning keeps "
                              f"an unsharded reference copy of the model on every process under "
                              f"{engine}: "
                              f"use LoRA (the reference is the model without its adapter) or "
                              f"kl_beta: 0, kl_reward: 0 and locality.keep_kl_beta: 0")
        if t.gardo.refresh:
            raise ConfigError(f"training.gardo.refresh_every / refresh_kl snapshot the trainable "
                              f"weights, which {engine} shards over the processes: set both to 0 "
                              f"or use DDP / DeepSpeed ZeRO-2")
    return sharded
