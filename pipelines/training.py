"""What the flow policy needs to train a diffusers transformer (``TransformerTraining``, the
training half of ``flowgrpo.model.FlowModel``): gradient checkpointing, full weights or PEFT
LoRA with its targets checked, LoRA saved as the stock pipelines' ``load_lora_weights`` reads it,
full weights saved as ``from_pretrained`` reads them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor


# The file of a checkpoint's LoRA, as the stock pipelines' save_lora_weights / load_lora_weights name it.
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"


def check_lora_targets(transformer: torch.nn.Module, targets: list[str], family: str) -> None:
    """Every PEFT target name (exact module name or '.'-suffix, PEFT's list matching) must match
    at least one Linear module; a silent empty match would train nothing."""
    linear_names = [name for name, module in transformer.named_modules()
                    if isinstance(module, torch.nn.Linear)]
    unmatched = [t for t in targets
                 if not any(name == t or name.endswith("." + t) for name in linear_names)]
    if unmatched:
        raise ValueError(f"{family} LoRA target modules {unmatched} match no Linear module of "
                         f"{type(transformer).__name__}; fix lora_target_modules")


def lora_adapter_metadata(transformer: torch.nn.Module) -> dict | None:
    """The LoraConfig of the transformer's (single) PEFT adapter as a JSON-able dict, so that the
    loader restores rank *and* alpha (without it diffusers assumes alpha = rank)."""
    configs = getattr(transformer, "peft_config", None)
    if not configs:
        return None
    if len(configs) > 1:
        active = getattr(transformer, "active_adapters", None)
        active = active() if callable(active) else active
        name = active[0] if active else next(iter(configs))
    else:
        name = next(iter(configs))
    metadata = configs[name].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in metadata.items()}


def strip_peft_wrapper_prefix(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Keys of ``get_peft_model_state_dict(get_peft_model(transformer))`` start with
    'base_model.model.'; diffusers expects the transformer's own module names."""
    prefix = "base_model.model."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}


class TransformerTraining:
    """What the flow policy needs to train an adapter's transformer (``flowgrpo.model.FlowModel``'s
    training methods), on diffusers models with PEFT: every family's transformer is one.
    ``denoisers()`` lists the diffusers models inside ``transformer`` (itself; Wan2.2's two
    experts) and ``trained_denoisers()`` those that train; an adapter with several overrides
    them and, where its files differ, ``lora_state_dict`` / ``save_full_weights``."""

    transformer: torch.nn.Module

    def denoisers(self, module: torch.nn.Module | None = None) -> list[torch.nn.Module]:
        """The diffusers models inside ``module`` (default: this adapter's transformer)."""
        return [self.transformer if module is None else module]

    def trained_denoisers(self) -> list[torch.nn.Module]:
        """The denoisers that LoRA wraps and full fine-tuning unfreezes."""
        return self.denoisers()

    def enable_gradient_checkpointing(self) -> None:
        for denoiser in self.denoisers():
            denoiser.enable_gradient_checkpointing()

    def train_full_weights(self) -> None:
        """Full fine-tuning: the weights of the trained denoisers require gradients."""
        for denoiser in self.trained_denoisers():
            denoiser.requires_grad_(True)

    def add_lora(self, rank: int, alpha: int, target_modules: list[str], init: str) -> None:
        """A LoRA adapter (rank, alpha, PEFT target names; ``init`` "gaussian" or "default",
        PEFT's Kaiming A and zero B) on each trained denoiser."""
        from peft import LoraConfig   # peft takes seconds to import

        for denoiser in self.trained_denoisers():
            denoiser.add_adapter(LoraConfig(
                r=rank, lora_alpha=alpha, target_modules=list(target_modules),
                init_lora_weights="gaussian" if init == "gaussian" else True))

    def _adapted(self) -> list[torch.nn.Module]:
        return [d for d in self.denoisers() if getattr(d, "_hf_peft_config_loaded", False)]

    def disable_lora(self) -> None:
        """Run the base weights (the KL reference of a LoRA run) until ``enable_lora``."""
        for denoiser in self._adapted():
            denoiser.disable_adapters()

    def enable_lora(self) -> None:
        for denoiser in self._adapted():
            denoiser.enable_adapters()

    def lora_state_dict(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The LoRA weights in PEFT's format (what ``save_lora_weights`` takes); ``state_dict``:
        the transformer's consolidated state under a sharded engine."""
        from peft import get_peft_model_state_dict   # peft takes seconds to import

        return get_peft_model_state_dict(self.transformer, state_dict=state_dict)

    def save_full_weights(self, folder: str | os.PathLike,
                          state_dict: dict[str, Tensor] | None = None) -> None:
        """The full fine-tuned transformer under ``folder/transformer`` (``from_pretrained``-
        loadable); ``state_dict`` as in ``lora_state_dict``."""
        save_diffusers_model(self.transformer, Path(folder) / "transformer", state_dict)


def save_diffusers_model(module: torch.nn.Module, folder: str | os.PathLike,
                         state_dict: dict[str, Tensor] | None = None) -> None:
    """``module.save_pretrained(folder)`` (a diffusers model: config + safetensors weights), with
    the weights of ``state_dict`` when given. diffusers' ``save_pretrained`` takes no state dict
    (one passed lands in its ``**kwargs`` unused) and saves the module's own, which under FSDP2
    holds only this process's shards: the consolidated weights are written here instead, as
    the single file ``from_pretrained`` reads."""
    if state_dict is None:
        module.save_pretrained(folder)
        return
    from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    module.save_config(folder)
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in state_dict.items()},
              str(folder / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
