"""accelerate's engines as the trainer sees them: which one was launched, what it cannot do
(refused at start, before any model loads, instead of a hang later), what accelerate leaves
undone for it (FSDP2 on CPU processes, DeepSpeed's batch size and ZeRO-3 loading), and the
replica check."""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from accelerate import __version__ as accelerate_version
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
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


def _flag(environ: Mapping[str, str], variable: str) -> bool:
    """An accelerate launch flag from the environment ("true"/"1" as accelerate writes them)."""
    return environ.get(variable, "false").lower() in ("true", "1")


def preflight_engine(environ: Mapping[str, str] | None = None, cuda: bool | None = None) -> None:
    """What the launched engine needs, said in one clear error before accelerate fails deep inside
    its setup (or, worse, quietly trains something else). ``accelerate launch`` passes the engine
    in the environment (ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED, FSDP_VERSION).

    Without CUDA, FSDP2 runs on CPU processes over gloo (``enable_fsdp_on_cpu``; tested with 2
    processes): it needs ``fsdp_version: 2`` and ``ACCELERATE_USE_CPU=true``. FSDP1 and DeepSpeed
    stay GPU-only (docs/distributed.md says what failed when DeepSpeed was tried on CPU)."""
    environ = os.environ if environ is None else environ
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if _flag(environ, "ACCELERATE_USE_FSDP") and not cuda:
        version = environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise ConfigError(f"the accelerate config asks for FSDP version {version}, which needs "
                              f"CUDA GPUs, and this machine has none: on CPU processes only FSDP2 "
                              f"runs (fsdp_version: 2, as configs/accelerate/fsdp.yaml), or launch "
                              f"with configs/accelerate/ddp.yaml")
        if not _flag(environ, "ACCELERATE_USE_CPU"):
            # Without it accelerate finds no device backend and starts no process group: every
            # process would train alone on its own rows.
            raise ConfigError("the accelerate config asks for FSDP and this machine has no CUDA "
                              "GPU: set ACCELERATE_USE_CPU=true in the environment of "
                              "`accelerate launch` so that the processes shard over gloo on the "
                              "CPU (--cpu would start one process only)")
    if _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        if not cuda:
            raise ConfigError("the accelerate config asks for DeepSpeed, which needs CUDA GPUs, "
                              "and this machine has none: launch with configs/accelerate/ddp.yaml"
                              " (or without --config_file) to train on CPU processes, or with "
                              "configs/accelerate/fsdp.yaml and ACCELERATE_USE_CPU=true to shard "
                              "them")
        try:
            import deepspeed  # noqa: F401  (optional: only the GPU machine has it)
        except ImportError as err:
            raise ConfigError("the accelerate config asks for DeepSpeed, which is not "
                              "installed: pip install deepspeed (on the GPU machine)") from err


def enable_fsdp_on_cpu(accelerator) -> None:
    """Turn FSDP2 on for CPU processes, where accelerate would quietly drop it.

    accelerate (1.16) makes a launch with an FSDP config an FSDP run only when its processes have
    a device backend (``AcceleratorState`` switches MULTI_GPU / MULTI_NPU / ... to FSDP, never
    MULTI_CPU): on CPU processes it keeps the plugin out of its state and ``prepare`` wraps the
    model in DDP. torch's FSDP2 (``fully_shard``) itself runs on CPU over gloo, and every FSDP2
    path of accelerate (``prepare``, ``no_sync``, ``clip_grad_norm_``, ``save_state`` /
    ``load_state``, ``get_state_dict``) is device-agnostic, so this marks the process-wide state
    as FSDP the way accelerate does on a GPU (its AcceleratorState and PartialState share the
    distributed type) and hands it the plugin built from the launch's FSDP_* variables.
    Nothing happens unless the launch asked for FSDP and the processes are CPU processes."""
    if not _flag(os.environ, "ACCELERATE_USE_FSDP") or \
            accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise ConfigError(f"FSDP version {plugin.fsdp_version} does not run on CPU processes: "
                          f"set fsdp_version: 2 (configs/accelerate/fsdp.yaml)")
    if accelerator.mixed_precision == "fp16":
        # The GradScaler accelerate built a moment ago is DDP's, not FSDP2's; fp16 on CPU is no
        # use anyway.
        raise ConfigError("training.mixed_precision fp16 is not supported for FSDP on CPU "
                          "processes: use no or bf16")
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    # AcceleratorState copies PartialState's entries each time it is built (accelerate builds one
    # in many of its calls): without this the next one would switch the run back to MULTI_CPU.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    # These are accelerate's private state: a version that keeps it elsewhere must fail here,
    # loudly, not run DDP under an FSDP launch.
    state = AcceleratorState()
    if accelerator.distributed_type != DistributedType.FSDP or \
            state.distributed_type != DistributedType.FSDP or state.fsdp_plugin is not plugin:
        raise ConfigError(f"FSDP on CPU processes could not be turned on with accelerate "
                          f"{accelerate_version} (tested with 1.16): launch with the DDP "
                          f"config (configs/accelerate/ddp.yaml) or on GPUs")


def local_shard(tensor: Tensor) -> Tensor:
    """This process's part of ``tensor``: the local shard of an FSDP2 DTensor, else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _keep_transformers_out_of_zero3() -> None:
    """accelerate registers its DeepSpeed config with transformers when it selects the plugin,
    whatever ``zero3_init_flag`` says, and under ZeRO-3 transformers then builds every model it
    loads inside ``deepspeed.zero.Init``: the frozen text encoders, which no engine runs, would
    load partitioned (seen on CPU: CLIP's position table came out empty, "max_position_embeddings:
    0"). The transformer is partitioned when ``prepare`` wraps it, which needs no registration;
    this runs before any model loads."""
    # transformers is slow to import and needed only under DeepSpeed
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


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
        if str(config_dict.get("train_micro_batch_size_per_gpu", "auto")) == "auto":
            # accelerate sizes DeepSpeed's batch from the dataloaders given to prepare(), and the
            # trainer gives none (it draws its own rows): prepare() raises without a number.
            # DeepSpeed only books it (train_batch_size, throughput); the rows of one
            # transformer call are a rollout batch.
            config_dict["train_micro_batch_size_per_gpu"] = config.sampling.rollout_batch_size
        if sharded:
            _keep_transformers_out_of_zero3()
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
