"""What the core asks of a model: the FlowModel interface and its prompt conditioning.

Every model family implements ``FlowModel`` in ``pipelines/<family>.py``; the rollout, the flow
policy and the CLI talk only to this interface, so a new family is one new file in ``pipelines/``
and nothing above it changes. An adapter knows its family's quirks (text encoders, latent layout,
timestep scale, shift, guidance) and nothing about sampling, rewards or losses.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass
class Conditioning:
    """Prompt embeddings for a batch of prompts.

    ``positive`` holds the tensors the transformer needs for the prompts, each with the batch
    dimension first (B, ...). ``negative`` holds the same keys for the negative/empty prompt used by
    classifier-free guidance, or is None when the family has no real CFG (FLUX.1's guidance is an
    embedding) or CFG is off. ``extra`` is for non-batched, family-specific values (e.g. FLUX.1's
    text ids), passed through unchanged by ``select``.
    """

    positive: dict[str, Tensor]
    negative: dict[str, Tensor] | None = None
    extra: dict[str, Tensor] = field(default_factory=dict)

    def select(self, index: Tensor | list[int]) -> "Conditioning":
        """Rows ``index`` (B',) of every batched tensor: used to expand prompts to group members."""
        index = torch.as_tensor(index, dtype=torch.long)

        def pick(tensors: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
            if tensors is None:
                return None
            return {k: v.index_select(0, index.to(v.device)) for k, v in tensors.items()}

        return Conditioning(pick(self.positive), pick(self.negative), dict(self.extra))

    @property
    def batch_size(self) -> int:
        return next(iter(self.positive.values())).shape[0]

    def to(self, device: torch.device | str) -> "Conditioning":
        def move(tensors):
            return None if tensors is None else {k: v.to(device) for k, v in tensors.items()}

        return Conditioning(move(self.positive), move(self.negative), move(self.extra))


# Where classifier-free guidance's unconditional branch gets gradient (training.cfg_gradient):
# "both" backpropagates through v_neg + g (v_pos - v_neg) into both branches; "conditional"
# treats v_neg as a constant, as Flow-GRPO's SD3 update did for a while (docs/recipes.md).
CFG_GRADIENTS = ("both", "conditional")

_CFG_GRADIENT: ContextVar[str] = ContextVar("cfg_gradient", default="both")


@contextmanager
def cfg_gradient(mode: str) -> Iterator[None]:
    """Run every ``guidance_branches`` / ``guided_velocity`` call inside with ``mode``.

    "both" (the default outside any scope): one batched forward over [negative; positive], so
    under autograd both branches carry gradient. "conditional": the negative branch in a forward
    of its own under ``torch.no_grad`` (no activations stored, nothing to backpropagate through),
    then the positive branch in the ambient grad mode. The split applies under an ambient
    ``no_grad`` too: a rollout step that the update replays must run the same forwards (the same
    batch geometry) as the replay, or the two velocities differ in the last bits and the
    first-pass ratio is not exactly 1. Like ``torch.no_grad`` it is a mode, not an argument, so
    that ``FlowModel.velocity`` keeps its signature and a family needs no code for it beyond
    calling ``guided_velocity``.
    """
    if mode not in CFG_GRADIENTS:
        raise ValueError(f"cfg_gradient must be one of {list(CFG_GRADIENTS)} (got {mode!r})")
    token = _CFG_GRADIENT.set(mode)
    try:
        yield
    finally:
        _CFG_GRADIENT.reset(token)


def guidance_branches(forward: Callable[[Tensor, Tensor, dict[str, Tensor]], Tensor],
                      latents: Tensor, timestep: Tensor, positive: dict[str, Tensor],
                      negative: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(v_neg, v_pos): CFG's two branches, each (N, ...), in the current ``cfg_gradient`` mode.

    ``forward(latents, timestep, text)`` runs the transformer on (M, ...) latents, (M,)
    timesteps and a dict of (M, ...) text tensors (M = N or 2N) and returns float32 velocities.
    ``negative`` holds the same keys as ``positive`` (converted to each positive tensor's dtype
    and device). For families whose guidance is not the plain linear combination (Qwen-Image's
    norm rescale); the others call ``guided_velocity``.
    """
    negative = {key: negative[key].to(value) for key, value in positive.items()}
    if _CFG_GRADIENT.get() == "conditional":
        with torch.no_grad():
            v_neg = forward(latents, timestep, negative)
        return v_neg, forward(latents, timestep, positive)
    text = {key: torch.cat([negative[key], value]) for key, value in positive.items()}
    v_neg, v_pos = forward(torch.cat([latents, latents]), torch.cat([timestep, timestep]),
                           text).chunk(2)
    return v_neg, v_pos


def guided_velocity(forward: Callable[[Tensor, Tensor, dict[str, Tensor]], Tensor],
                    latents: Tensor, timestep: Tensor, positive: dict[str, Tensor],
                    negative: dict[str, Tensor] | None, guidance_scale: float | Tensor) -> Tensor:
    """Classifier-free guidance, shared by every real-CFG family.

    ``forward`` as in ``guidance_branches``. With ``negative`` None it is called once on the
    positive branch; otherwise the branches run as ``cfg_gradient`` says (one batched forward
    by default) and are combined as ``v_neg + g (v_pos - v_neg)``; ``guidance_scale`` is a float
    or a tensor broadcastable to the velocities (a scale per row: Wan2.2's experts).
    """
    if negative is None:
        return forward(latents, timestep, positive)
    v_neg, v_pos = guidance_branches(forward, latents, timestep, positive, negative)
    return v_neg + guidance_scale * (v_pos - v_neg)


class SourceImages(torch.Tensor):
    """The source images of a prompt that gives several (a JSONL line's ``"images"``), as one
    value: it *is* its first image, (3, H, W) float in [0, 1] (the image being edited: what the
    rewards' ``source_image``, the edit masks, ``training.locality`` and the grids' source column
    read, unchanged), and ``images`` holds all of them in order, each (3, H_i, W_i) (what a
    multi-image editing model conditions on: ``source_images_of``). Operations on it give plain
    tensors (its ``__torch_function__`` is disabled), so nothing derived carries the others."""

    images: tuple[Tensor, ...]
    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, images) -> "SourceImages":
        images = tuple(images)
        if len(images) < 2 or not all(isinstance(i, Tensor) and i.dim() == 3 for i in images):
            raise ValueError("SourceImages holds two or more (3, H, W) tensors (one image is the "
                             "tensor itself)")
        value = images[0].as_subclass(cls)
        value.images = images
        return value

    def __deepcopy__(self, memo) -> "SourceImages":
        return SourceImages([i.clone() for i in self.images])

    def __reduce_ex__(self, protocol):
        return SourceImages, (list(self.images),)


def source_images_of(image: Tensor) -> tuple[Tensor, ...]:
    """All source images of one prompt row: ``image.images`` for a ``SourceImages``, else
    ``(image,)``."""
    return image.images if isinstance(image, SourceImages) else (image,)


def source_image_limit(model) -> int:
    """How many source images one prompt may give ``model`` (an adapter or its class): 0 when
    it does not edit images, else its ``max_source_images`` (1 unless it says more)."""
    if not getattr(model, "supports_images", False):
        return 0
    return int(getattr(model, "max_source_images", 1))


def check_source_images(model, images: list[Tensor]) -> None:
    """ValueError naming the first row whose prompt gives ``model`` more source images than its
    family takes (``source_image_limit``): a one-image family given several, or more than a
    multi-image family's ``max_source_images``."""
    limit = source_image_limit(model)
    for row, image in enumerate(images):
        count = len(source_images_of(image))
        if count > limit:
            takes = ("does not edit images" if limit == 0 else
                     "takes one source image per prompt" if limit == 1 else
                     f"takes at most {limit} source images per prompt")
            raise ValueError(f"row {row}'s prompt gives {count} source images (\"images\") but "
                             f"the {model.family} family {takes}; give those prompt records at "
                             f"most {limit}, or use a multi-image editing family (e.g. "
                             f"qwen_image_edit_plus)")


@runtime_checkable
class FlowModel(Protocol):
    """A text-to-image/video flow-matching model seen as a velocity field.

    Convention: ``x_sigma = (1 - sigma) x0 + sigma noise``; velocity ``v ~ noise - x0``;
    sigma runs from 1 (noise) to 0 (data).
    """

    family: str                      # the family's name in pipelines.MODEL_FAMILIES
    transformer: torch.nn.Module     # what LoRA wraps and the optimiser trains
    lora_target_modules: list[str]   # PEFT target module names for this family
    device: torch.device
    dtype: torch.dtype               # compute dtype of the transformer

    # Optional: ``may_skip_parameters = True`` when a forward can leave trainable parameters
    # unused (Wan2.2's experts): the trainer then has DDP look for unused parameters.
    # Optional: ``supports_images = True`` for an editing model (a source image per prompt);
    # its ``encode_prompts(prompts, images=...)`` takes one float (3, H, W) in [0, 1] per prompt
    # and puts the image's latents/tokens in the Conditioning's batched tensors (one row per
    # prompt, in both branches), so ``select``, the rollout and the replay need nothing else.
    # Not a protocol member, so text-to-image families need not declare it.
    # Optional: ``max_source_images`` (default 1): how many source images one prompt may give a
    # multi-image editing model; a prompt with several hands it a ``SourceImages`` (below) in
    # place of the one tensor, and ``check_source_images`` refuses more than the family takes.
    # Optional: ``text_embedding_keys``: the ``Conditioning.positive`` keys that hold prompt
    # embeddings, which ``sampling.embedding_perturbation`` (E2PO) perturbs (default
    # ``("prompt_embeds", "pooled_prompt_embeds")``; masks and source images are not among them).
    # Optional: ``region_mask(mask, resize)`` maps an edit-region mask (B, 1, H, W) in [0, 1] in
    # pixels to a tensor broadcastable to the latents (B, ...), for ``training.locality``
    # (``flowgrpo.edit_regions``): the toy model's latents are its pixels; a VAE family
    # downsamples to its latent grid and lays the mask out as its latents (packing).

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Embeddings for ``prompts`` (and the negative prompt when CFG is possible); cached.
        An editing model also takes ``images=`` (see ``supports_images`` above)."""

    def initial_noise(self, batch: int, generator: torch.Generator | None) -> Tensor:
        """Standard normal latents (batch, ...) in the layout the stock diffusers pipeline accepts
        as ``latents=`` (float32, on CPU when the generator is a CPU generator)."""

    def sigmas(self, num_steps: int) -> Tensor:
        """(num_steps + 1,) float32 decreasing sigma schedule ending at 0, shift applied."""

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning,
                 guidance_scale: float) -> Tensor:
        """Velocity (B, ...) at latents (B, ...) and per-sample sigma (B,). With a real-CFG family and
        ``guidance_scale > 1`` and ``cond.negative`` set, both branches run through
        ``guided_velocity`` (one batched forward, or under ``cfg_gradient("conditional")`` the
        negative one without autograd) and are combined ``v_neg + g (v_pos - v_neg)``."""

    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, 3, H, W) or videos (B, F, 3, H, W), float32 in [0, 1]."""

    def save_lora_weights(self, directory: str, transformer_lora_state_dict: dict[str, Tensor]) -> None:
        """Write LoRA weights so that the stock diffusers pipeline's ``load_lora_weights(directory)``
        loads them (PEFT-format keys, as ``lora_state_dict`` returns them)."""

    # What the flow policy needs to train ``transformer`` (``pipelines.training.TransformerTraining``
    # implements it on diffusers and PEFT for every family). The policy freezes the transformer
    # (``requires_grad_(False)``), then calls these; the KL reference of full fine-tuning is a
    # frozen copy of the module, a refreshed LoRA reference a snapshot of its trainable tensors.

    def enable_gradient_checkpointing(self) -> None:
        """Recompute the transformer's activations in backward (``model.gradient_checkpointing``)."""

    def train_full_weights(self) -> None:
        """Full fine-tuning: the transformer weights that train require gradients (all of them,
        or the experts a family's options select)."""

    def add_lora(self, rank: int, alpha: int, target_modules: list[str], init: str) -> None:
        """A LoRA adapter on what trains (rank, alpha = scale alpha / rank, PEFT target module
        names, ``init`` "gaussian" or "default"); its weights then are the parameters that
        require gradients."""

    def disable_lora(self) -> None:
        """Run the base weights (the KL reference of a LoRA run) until ``enable_lora``."""

    def enable_lora(self) -> None:
        """Run the LoRA adapter again."""

    def lora_state_dict(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The adapter's weights in PEFT's format, for ``save_lora_weights``; ``state_dict``: the
        transformer's consolidated state under a sharded engine (None: its own)."""

    def save_full_weights(self, folder: str, state_dict: dict[str, Tensor] | None = None) -> None:
        """The fully fine-tuned transformer under ``folder`` (``folder/transformer``, loadable
        with its class's ``from_pretrained``), from ``state_dict`` when given."""

    def configure_transformer(self, module: torch.nn.Module) -> None:
        """Make ``module`` (a transformer swapped in for the own, e.g. a full fine-tune's) run
        as the own does: device, frozen, the family's attention settings."""
