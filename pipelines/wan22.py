"""Wan2.2's two experts (``Wan-AI/Wan2.2-T2V-A14B-Diffusers``): one architecture, ``transformer``
for high noise and ``transformer_2`` for low noise. A step whose timestep t = 1000 sigma is
>= boundary_ratio * num_train_timesteps runs the first, any other the second (``WanPipeline``'s
rule). ``pipelines/wan.py``'s ``WanModel`` is the adapter of both Wan2.1 and Wan2.2; this module
holds what only Wan2.2 has: the two experts as one module (``WanExperts``, what the optimiser
trains and DDP / checkpoints see), the experts' side of the training contract (LoRA per trained
expert, full weights per expert) and the LoRA files the stock pipeline loads per expert.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipelines.training import (LORA_WEIGHTS_NAME, lora_adapter_metadata, save_diffusers_model,
                                strip_peft_wrapper_prefix)

# Wan2.2's LoRA files: the high-noise expert's under diffusers' default name (``load_lora_weights
# (folder)`` puts it into ``transformer``), the low-noise expert's under its own name (loaded with
# ``load_into_transformer_2=True``). Each holds 'transformer.<module>.lora_A/B.weight' keys, as the
# stock loader expects for either expert.
LOW_NOISE_LORA_WEIGHTS_NAME = "pytorch_lora_weights_transformer_2.safetensors"
TRAIN_EXPERTS = ("both", "high", "low")
EXPERT_NAMES = ("transformer", "transformer_2")   # the pipeline's component names, high first


class WanExperts(torch.nn.Module):
    """Wan2.2's two experts as one module (the adapter's ``transformer``).

    ``transformer`` is the high-noise expert: it runs the rows whose timestep t (B,) is
    >= ``boundary_timestep`` (= boundary_ratio x num_train_timesteps, WanPipeline's rule);
    ``transformer_2`` (low noise) runs the others. ``forward`` takes WanTransformer3DModel's
    arguments and returns its output for the whole batch, splitting a batch whose rows straddle the
    boundary. Being one module, the optimiser, DDP and checkpoints see both experts (state-dict
    keys ``transformer.*`` and ``transformer_2.*``, the pipeline's component names).

    ``train_experts`` ('both', 'high' or 'low') decides which experts train (``trained``: LoRA
    wraps them, full fine-tuning unfreezes them; ``WanModel`` does both). A forward with
    gradients enabled that needs an expert which does not train, while the other does, is an
    error: its loss could not reach any weight.
    """

    # The block class FSDP's transformer-based auto-wrap reads (as from WanTransformer3DModel);
    # FSDP / DeepSpeed with the two experts are untested.
    _no_split_modules = ["WanTransformerBlock"]

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module,
                 boundary_ratio: float, num_train_timesteps: int = 1000,
                 train_experts: str = "both") -> None:
        super().__init__()
        if train_experts not in TRAIN_EXPERTS:
            raise ValueError(f"train_experts must be one of {list(TRAIN_EXPERTS)} "
                             f"(got {train_experts!r})")
        if not 0.0 <= boundary_ratio <= 1.0:
            raise ValueError(f"boundary_ratio must be in [0, 1] (got {boundary_ratio})")
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_ratio = float(boundary_ratio)
        self.boundary_timestep = float(boundary_ratio) * num_train_timesteps
        self.train_experts = train_experts

    @property
    def experts(self) -> list[torch.nn.Module]:
        """Both experts, high noise first."""
        return [self.transformer, self.transformer_2]

    @property
    def trained(self) -> list[torch.nn.Module]:
        """The experts ``train_experts`` selects (high noise first)."""
        return {"both": self.experts, "high": [self.transformer],
                "low": [self.transformer_2]}[self.train_experts]

    def uses_high_noise(self, timestep: Tensor) -> Tensor:
        """(B,) bool: the rows of timestep (B,) that the high-noise expert runs (t >= boundary)."""
        if timestep.dim() != 1:
            raise ValueError(f"wan: Wan2.2 experts take one timestep per row, shape (B,) (got "
                             f"{tuple(timestep.shape)}); per-token timesteps (TI2V) are not supported")
        return timestep >= self.boundary_timestep

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                encoder_hidden_states_image: Tensor | None = None, return_dict: bool = False,
                attention_kwargs: dict | None = None) -> tuple[Tensor]:
        """WanTransformer3DModel's forward with each row sent to its expert, called as the
        adapter calls a single transformer (``return_dict=False``): hidden_states
        (B, C, F', h, w), timestep (B,), encoder_hidden_states (B, L, D) -> ((B, C, F', h, w),)."""
        if return_dict:
            raise ValueError("WanExperts returns a tuple: call it with return_dict=False")
        high = self.uses_high_noise(timestep)
        self._check_trains(high)
        rows = {"hidden_states": hidden_states, "timestep": timestep,
                "encoder_hidden_states": encoder_hidden_states,
                "encoder_hidden_states_image": encoder_hidden_states_image}

        def run(expert: torch.nn.Module, index: Tensor | None) -> Tensor:
            picked = {k: (v if index is None or v is None else v.index_select(0, index))
                      for k, v in rows.items()}
            return expert(**picked, attention_kwargs=attention_kwargs, return_dict=False)[0]

        n_high = int(high.sum())
        if n_high in (0, len(high)):
            return (run(self.transformer if n_high else self.transformer_2, None),)
        index_high = high.nonzero().squeeze(1)
        index_low = (~high).nonzero().squeeze(1)
        joined = torch.cat([run(self.transformer, index_high), run(self.transformer_2, index_low)])
        return (joined.index_select(0, torch.cat([index_high, index_low]).argsort()),)

    def _check_trains(self, high: Tensor) -> None:
        """With gradients on, every expert the rows need must train if any expert does."""
        if not torch.is_grad_enabled():
            return
        needed = {"transformer": bool(high.any()), "transformer_2": bool((~high).any())}
        trains = {name: any(p.requires_grad for p in getattr(self, name).parameters()) for name in needed}
        frozen = [name for name in needed if needed[name] and not trains[name]]
        if frozen and any(trains.values()):
            raise ValueError(
                f"wan: a step with gradients needs the {frozen[0]} expert, which does not train "
                f"(options.train_experts={self.train_experts!r}): its loss reaches no trained weight. "
                f"Train only steps on the trained expert's side of t = {self.boundary_timestep:g} "
                f"(sigma {self.boundary_ratio:g}; e.g. sampling.plan one_step_range / window_range / "
                f"train_fraction) or set options.train_experts='both'")


def expert_state(state_dict: dict[str, Tensor] | None, name: str) -> dict[str, Tensor] | None:
    """The entries of a ``WanExperts`` state dict (keys ``<name>.<rest>``) of expert ``name``,
    keyed ``<rest>``; None stays None."""
    if state_dict is None:
        return None
    return {key[len(name) + 1:]: value for key, value in state_dict.items()
            if key.startswith(name + ".")}


def split_lora_state(lora_state_dict: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """A ``WanExperts`` LoRA state dict split per expert (keys without the expert's prefix)."""
    parts: dict[str, dict[str, Tensor]] = {name: {} for name in EXPERT_NAMES}
    for key, value in strip_peft_wrapper_prefix(lora_state_dict).items():
        expert, _, rest = key.partition(".")
        if expert not in parts:
            raise ValueError(f"wan: LoRA key {key!r} belongs to neither expert (keys must start "
                             "with 'transformer.' or 'transformer_2.': a WanExperts state dict)")
        parts[expert][rest] = value
    return parts


def save_expert_lora(pipeline_class: Any, directory: str, experts: WanExperts,
                     lora_state_dict: dict[str, Tensor]) -> None:
    """One LoRA file per expert that has LoRA keys: ``pytorch_lora_weights.safetensors`` (high
    noise, loaded by ``pipe.load_lora_weights(directory)``) and
    ``pytorch_lora_weights_transformer_2.safetensors`` (low noise, ``load_into_transformer_2``);
    ``load_wan22_lora(pipe, directory)`` loads both."""
    parts = split_lora_state(lora_state_dict)
    for expert, weight_name in zip(EXPERT_NAMES, (LORA_WEIGHTS_NAME, LOW_NOISE_LORA_WEIGHTS_NAME)):
        if parts[expert]:
            pipeline_class.save_lora_weights(
                directory, transformer_lora_layers=parts[expert], weight_name=weight_name,
                transformer_lora_adapter_metadata=lora_adapter_metadata(getattr(experts, expert)))


def save_experts_full(experts: WanExperts, folder: str | os.PathLike,
                      state_dict: dict[str, Tensor] | None = None) -> None:
    """Both experts in the pipeline's layout, ``folder/transformer`` and ``folder/transformer_2``,
    each ``WanTransformer3DModel.from_pretrained``-loadable. ``state_dict``: the experts'
    consolidated state (keys ``transformer.*`` / ``transformer_2.*``), split per expert."""
    for name in EXPERT_NAMES:
        save_diffusers_model(getattr(experts, name), Path(folder) / name,
                             expert_state(state_dict, name))


def load_wan22_lora(pipeline: Any, directory: str | os.PathLike,
                    adapter_name: str | None = None) -> list[str]:
    """Load a Wan2.2 LoRA folder written by ``WanModel.save_lora_weights`` into a stock
    ``WanPipeline``: ``pytorch_lora_weights.safetensors`` into ``transformer`` and
    ``pytorch_lora_weights_transformer_2.safetensors`` into ``transformer_2`` (diffusers'
    ``load_into_transformer_2=True``), whichever exist. Returns the components loaded."""
    directory = os.fspath(directory)
    loaded = []
    for weight_name, component in ((LORA_WEIGHTS_NAME, "transformer"),
                                   (LOW_NOISE_LORA_WEIGHTS_NAME, "transformer_2")):
        if os.path.isfile(os.path.join(directory, weight_name)):
            pipeline.load_lora_weights(directory, weight_name=weight_name, adapter_name=adapter_name,
                                       load_into_transformer_2=component == "transformer_2")
            loaded.append(component)
    if not loaded:
        raise FileNotFoundError(f"{directory} holds neither {LORA_WEIGHTS_NAME} nor "
                                f"{LOW_NOISE_LORA_WEIGHTS_NAME} (give a folder written by "
                                f"WanModel.save_lora_weights)")
    return loaded


def component_present(index: dict, name: str) -> bool:
    """A pipeline component listed in model_index.json with a class (not [null, null])."""
    entry = index.get(name)
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] is not None


def check_pipeline_index(index: dict, path_or_hub_id: str) -> bool:
    """True for a Wan2.2 two-expert T2V folder, False for Wan2.1; an error for the variants this
    adapter does not reproduce."""
    name = index.get("_class_name", "WanPipeline")
    if name != "WanPipeline":
        raise ValueError(f"wan: {path_or_hub_id!r} is a {name} folder; this adapter is text-to-video "
                         "(WanPipeline: Wan2.1 T2V or Wan2.2 T2V-A14B)")
    if index.get("expand_timesteps"):
        raise ValueError(f"wan: {path_or_hub_id!r} sets expand_timesteps (Wan2.2 TI2V-5B: per-token "
                         "timesteps, a 16x VAE); not supported. Use a Wan2.1 T2V or Wan2.2 T2V-A14B folder")
    has_high, has_low = component_present(index, "transformer"), component_present(index, "transformer_2")
    if index.get("boundary_ratio") is None:
        if has_low:
            raise ValueError(f"wan: {path_or_hub_id!r} has a transformer_2 but no boundary_ratio in "
                             "model_index.json, so WanPipeline would never run it; set boundary_ratio")
        return False
    if not (has_high and has_low):
        raise ValueError(f"wan: {path_or_hub_id!r} sets boundary_ratio but lacks "
                         f"{'transformer_2' if has_high else 'transformer'}; Wan2.2 needs both experts "
                         "(transformer = high noise, transformer_2 = low noise)")
    return True


def check_wan22_options(options: Any, two_experts: bool) -> None:
    """Options that only Wan2.2 has are an error on a Wan2.1 checkpoint."""
    if two_experts:
        return
    for name in ("guidance_scale_2", "train_experts"):
        if getattr(options, name) is not None:
            raise ValueError(f"options.{name} is for Wan2.2 checkpoints (two experts); this one has a "
                             f"single transformer: remove {name}")
