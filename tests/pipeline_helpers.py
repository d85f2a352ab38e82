"""Helpers of the model-adapter tests (tests/test_pipelines_*.py); their tiny pipeline folders
are conftest.py's fixtures. ``ode_sample`` is the reference Euler loop written against the
FlowModel interface only; the parity tests compare it with the stock diffusers pipeline's own
``__call__``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pipelines.tiny import TINY_HEIGHT, TINY_NUM_FRAMES, TINY_WIDTH

TINY_MAX_SEQUENCE_LENGTH = 16
IMAGE_OPTIONS = {"height": TINY_HEIGHT, "width": TINY_WIDTH, "max_sequence_length": TINY_MAX_SEQUENCE_LENGTH}
VIDEO_OPTIONS = {**IMAGE_OPTIONS, "num_frames": TINY_NUM_FRAMES}


@torch.no_grad()
def ode_sample(model, prompts: list[str], noise: Tensor, num_steps: int, guidance_scale: float) -> Tensor:
    """Euler ODE through the FlowModel interface: x += v (sigma_next - sigma), then decode."""
    cond = model.encode_prompts(prompts)
    sigmas = model.sigmas(num_steps)
    x = noise.clone().float()
    batch = x.shape[0]
    for i in range(num_steps):
        v = model.velocity(x, sigmas[i].expand(batch), cond, guidance_scale)
        x = x + v * (sigmas[i + 1] - sigmas[i])
    return model.decode(x)


def perturb_lora(transformer: torch.nn.Module, seed: int = 0, std: float = 0.2) -> int:
    """Give every lora_B weight random values (PEFT initialises them to 0); returns how many."""
    generator = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
                count += 1
    return count


class CallCounter:
    """Counts forward calls of modules (via forward hooks; remove() detaches them)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.calls = 0
        self._handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, module, args, output) -> None:
        self.calls += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def fail_on_weight_loading(monkeypatch) -> None:
    """Make every diffusers/transformers ``from_pretrained`` of a model raise, so that a test can
    check that an error is raised before any weights load."""
    from diffusers.models.modeling_utils import ModelMixin
    from transformers import PreTrainedModel

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__}.from_pretrained was called before validation failed")

    monkeypatch.setattr(ModelMixin, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
