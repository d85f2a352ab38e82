"""The language-model policy's loss: the clipped surrogate on completion tokens, aggregated as
GRPO, BNPO, Dr. GRPO or DAPO, with token or sequence (GSPO) importance ratios and a k3 KL to a
reference; checked against TRL's loss and gradients (tests/test_token_losses.py). Pure functions
on tensors; the flow transitions' losses are ``flowgrpo/losses.py``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flowgrpo.losses import _compute_dtype, _check_shape, _check_clip

# aggregation -> rule(masked_loss (B, T), mask (B, T), max_len, num_tokens_global) -> loss; the
# formulas are in token_policy_loss's docstring.
TOKEN_AGGREGATION_RULES = {
    "grpo": lambda masked, mask, max_len, tokens:
        (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean(),
    "bnpo": lambda masked, mask, max_len, tokens: masked.sum() / mask.sum().clamp(min=1),
    "dr_grpo": lambda masked, mask, max_len, tokens: masked.sum() / (mask.shape[0] * max_len),
    "dapo": lambda masked, mask, max_len, tokens:
        masked.sum() / (mask.sum().clamp(min=1) if tokens is None else tokens),
}
TOKEN_AGGREGATIONS = tuple(TOKEN_AGGREGATION_RULES)
TOKEN_LEVELS = ("token", "sequence")


def token_policy_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, *,
                      clip_low: float = 0.2, clip_high: float = 0.2, aggregation: str = "grpo",
                      level: str = "token", max_len: int | None = None,
                      num_tokens_global: float | None = None, logp_ref: Tensor | None = None,
                      beta: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate on completion tokens, aggregated as in GRPO and its variants.

    Per token l = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + beta k3, with
    k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1 (only when beta != 0). The ratio r:

    - ``level="token"``: r_t = exp(logp_t - logp_old_t).
    - ``level="sequence"`` (GSPO): s = exp(masked mean_t(logp_t - logp_old_t)) per sequence, used
      in the GSPO-token form r_t = sg[s] * exp(logp_t - sg[logp_t]): its value is s at every token
      and its gradient w.r.t. logp_t is s. Its loss and gradients equal TRL's
      ``importance_sampling_level="sequence"`` (a (B, 1) ratio broadcast over tokens) for every
      aggregation, and it also admits per-token advantages.

    Aggregation with m the mask, over the local batch of B sequences:

    - ``"grpo"``:    mean_i( sum_t l m / max(sum_t m, 1) )
    - ``"bnpo"``:    sum l m / max(sum m, 1)
    - ``"dr_grpo"``: sum l m / (B * max_len), max_len defaulting to T
    - ``"dapo"``:    sum l m / num_tokens_global, defaulting to sum m (local). With P data-parallel
      ranks whose gradients are averaged, pass (tokens in the global batch) / P so that the
      averaged gradient is that of sum(l m) / (global tokens): TRL's ``dapo`` normaliser is
      ``num_items_in_batch / num_processes`` (scaled for gradient accumulation).

    TRL's grpo/bnpo/dr_grpo also divide by the gradient-accumulation steps; that belongs to the
    trainer, not here. Masked positions contribute neither value nor gradient.

    Args:
        logp: (B, T) per-token log-probs under the current policy (carries the gradient).
        logp_old: (B, T) per-token log-probs at rollout time.
        advantages: (B,) per sequence, or (B, T) per token.
        mask: (B, T) 1 for completion tokens, 0 for padding.
        logp_ref: (B, T) reference-policy log-probs; required when beta != 0.
        beta: weight of the k3 KL penalty.

    Returns:
        scalar loss and detached stats, means over the masked tokens: ``clip_fraction`` (ratio
        outside the range), ``clip_fraction_low`` / ``clip_fraction_high`` (outside below with
        A < 0 / above with A > 0: TRL's clip_ratio low/high, where the gradient is zeroed),
        ``ratio_mean``, and ``kl`` (mean k3) when ``logp_ref`` is given.
    """
    _check_clip(clip_low, clip_high)
    if aggregation not in TOKEN_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {TOKEN_AGGREGATIONS} (got {aggregation!r})")
    if level not in TOKEN_LEVELS:
        raise ValueError(f"level must be one of {TOKEN_LEVELS} (got {level!r})")
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape (B, T) (got {tuple(logp.shape)})")
    batch, length = logp.shape
    _check_shape(logp_old, "logp_old", (batch, length), "(B, T) like logp")
    _check_shape(mask, "mask", (batch, length), "(B, T) like logp")
    if advantages.shape not in ((batch,), (batch, length)):
        raise ValueError(f"advantages must have shape (B,) = ({batch},) or (B, T) = ({batch}, {length}) "
                         f"(got {tuple(advantages.shape)})")
    if beta < 0:
        raise ValueError(f"beta must be >= 0 (got {beta})")
    if beta != 0 and logp_ref is None:
        raise ValueError(f"logp_ref (B, T) is required when beta != 0 (got beta={beta}); "
                         "pass the reference model's token log-probs or set beta=0")
    if logp_ref is not None:
        _check_shape(logp_ref, "logp_ref", (batch, length), "(B, T) like logp")
    if max_len is not None and max_len < length:
        raise ValueError(f"max_len must be >= the completion length T = {length} (got {max_len})")
    if num_tokens_global is not None and not num_tokens_global > 0:
        raise ValueError(f"num_tokens_global must be > 0 (got {num_tokens_global})")

    dtype = _compute_dtype(logp, logp_old, advantages)
    logp = logp.to(dtype)
    mask = mask.detach().to(dtype)
    kept = mask > 0
    advantages = advantages.detach().to(dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)

    token_log_ratio = torch.where(kept, logp - logp_old.detach().to(dtype), torch.zeros_like(logp))
    if level == "token":
        log_ratio = token_log_ratio
    else:
        tokens_per_sequence = mask.sum(dim=1, keepdim=True).clamp(min=1)
        sequence_log_ratio = (token_log_ratio * mask).sum(dim=1, keepdim=True) / tokens_per_sequence
        pass_through = torch.where(kept, logp - logp.detach(), torch.zeros_like(logp))
        log_ratio = sequence_log_ratio.detach() + pass_through
    ratio = torch.exp(log_ratio)
    ratio_clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * advantages, ratio_clipped * advantages)

    token_kl = None
    if logp_ref is not None:
        ref_minus_logp = torch.where(kept, logp_ref.detach().to(dtype) - logp, torch.zeros_like(logp))
        token_kl = torch.exp(ref_minus_logp) - ref_minus_logp - 1
        if beta != 0:
            per_token = per_token + beta * token_kl

    loss = TOKEN_AGGREGATION_RULES[aggregation](per_token * mask, mask,
                                                (length if max_len is None else max_len),
                                                num_tokens_global)

    with torch.no_grad():
        r = ratio.detach()
        low, high = r < 1 - clip_low, r > 1 + clip_high
        token_count = mask.sum().clamp(min=1)

        def token_mean(x: Tensor) -> Tensor:
            return (x.to(dtype) * mask).sum() / token_count

        stats = {"clip_fraction": token_mean(low | high),
                 "clip_fraction_low": token_mean(low & (advantages < 0)),
                 "clip_fraction_high": token_mean(high & (advantages > 0)),
                 "ratio_mean": token_mean(r)}
        if token_kl is not None:
            stats["kl"] = token_mean(token_kl.detach())
    return loss, stats
