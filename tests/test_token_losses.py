"""Token-level losses: parity (value and gradient) with TRL's GRPOTrainer loss.

Tested against trl==1.16.0 (``GRPOTrainer._compute_loss``), driven through a minimal stand-in for
the trainer: a SimpleNamespace with the attributes that method reads, whose per-token log-prob
computation returns our tensors. Nothing of TRL's code is copied into flowgrpo.

Mapping of TRL's options to ours:
- ``loss_type`` grpo / bnpo / dr_grpo / dapo -> ``aggregation`` of the same name;
  ``max_completion_length`` -> ``max_len``; dapo's ``num_items_in_batch / num_processes`` (one
  process, no accumulation here) -> ``num_tokens_global``.
- ``importance_sampling_level`` token / sequence -> ``level``.
- ``epsilon`` / ``epsilon_high`` -> ``clip_low`` / ``clip_high``; ``beta`` -> ``beta`` with
  ``ref_per_token_logps`` -> ``logp_ref``.
- TRL divides grpo/bnpo/dr_grpo by the gradient-accumulation steps; here that is 1.
"""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.token_losses import token_policy_loss

TRL_VERSION = "1.16.0"


@pytest.fixture(scope="module")
def trl_compute_loss():
    pytest.importorskip("trl", minversion=TRL_VERSION)
    from trl import GRPOTrainer

    return GRPOTrainer._compute_loss


def _trl_loss(compute_loss, logp, logp_old, advantages, mask, *, loss_type, level, clip_low, clip_high,
              max_completion_length, num_items_in_batch, logp_ref=None, beta=0.0):
    batch, length = logp.shape
    accelerator = SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                  reduce=lambda x, reduction: x)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type,
        epsilon_low=clip_low, epsilon_high=clip_high,
        use_vllm=False, vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, accelerator=accelerator,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros(batch, 2, dtype=torch.long), "prompt_mask": torch.ones(batch, 2, dtype=torch.long),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "old_per_token_logps": logp_old,
        "num_items_in_batch": torch.tensor(float(num_items_in_batch), dtype=logp.dtype),
    }
    if logp_ref is not None:
        inputs["ref_per_token_logps"] = logp_ref
    return compute_loss(trainer, None, inputs)


def _random_case(seed: int, batch: int = 6, length: int = 7):
    generator = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(batch, length, generator=generator, dtype=torch.float64) * 3
    # log-ratios large enough that some tokens (and sequences) leave a 0.2 clip range
    logp = logp_old + 0.4 * torch.randn(batch, length, generator=generator, dtype=torch.float64)
    logp_ref = logp_old + 0.2 * torch.randn(batch, length, generator=generator, dtype=torch.float64)
    advantages = torch.randn(batch, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    lengths[0] = length
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    mask[-1] = 0            # a sequence with no completion token
    return logp, logp_old, logp_ref, advantages, mask


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_token_policy_loss_matches_trl(trl_compute_loss, aggregation, level, beta):
    logp, logp_old, logp_ref, advantages, mask = _random_case(seed=len(aggregation) + 10 * (level == "token"))
    max_len, num_tokens_global = 11, 1.7 * mask.sum().item()
    ours_logp = logp.clone().requires_grad_(True)
    ours, stats = token_policy_loss(ours_logp, logp_old, advantages, mask, clip_low=0.2, clip_high=0.28,
                                    aggregation=aggregation, level=level, max_len=max_len,
                                    num_tokens_global=num_tokens_global, logp_ref=logp_ref, beta=beta)
    ours.backward()
    trl_logp = logp.clone().requires_grad_(True)
    reference = _trl_loss(trl_compute_loss, trl_logp, logp_old, advantages, mask, loss_type=aggregation,
                          level=level, clip_low=0.2, clip_high=0.28, max_completion_length=max_len,
                          num_items_in_batch=num_tokens_global, logp_ref=logp_ref if beta else None, beta=beta)
    reference.backward()
    torch.testing.assert_close(ours, reference.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_logp.grad, trl_logp.grad, rtol=1e-10, atol=1e-12)
    # the case exercises clipping and the gradient is not trivially zero
    assert 0 < stats["clip_fraction"].item() < 1
    assert trl_logp.grad.abs().sum() > 0


def test_sequence_level_ratio_is_masked_mean_of_token_log_ratios():
    logp_old = torch.zeros(2, 4, dtype=torch.float64)
    logp = torch.tensor([[0.1, 0.3, -0.2, 9.0], [0.05, 0.05, 0.05, 0.05]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    logp.requires_grad_(True)
    loss, stats = token_policy_loss(logp, logp_old, torch.tensor([1.0, 1.0], dtype=torch.float64), mask,
                                    clip_low=1.0, clip_high=10.0, level="sequence")
    sequence_ratio = torch.exp(torch.tensor([0.2 / 3, 0.05], dtype=torch.float64))
    assert loss.item() == pytest.approx(-sequence_ratio.mean().item(), rel=1e-12)
    loss.backward()
    # GSPO: d/d logp_t of -s_i / B is -s_i / (B |y_i|) at every unmasked token, 0 at padding
    expected = -(sequence_ratio / 2).unsqueeze(1) / torch.tensor([[3.0], [4.0]], dtype=torch.float64) * mask
    torch.testing.assert_close(logp.grad, expected)
    assert stats["ratio_mean"].item() == pytest.approx((3 * sequence_ratio[0] + 4 * sequence_ratio[1]).item() / 7)


def test_padding_with_non_finite_log_probs_is_ignored():
    logp = torch.tensor([[-0.5, -1.0, -float("inf")]], requires_grad=True)
    logp_old = torch.tensor([[-0.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    for level in ("token", "sequence"):
        loss, _ = token_policy_loss(logp, logp_old, torch.tensor([1.0]), mask, level=level,
                                    logp_ref=logp_old, beta=0.1)
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(-1.0)
        torch.testing.assert_close(grad, torch.tensor([[-0.5, -0.5, 0.0]]))


def test_token_policy_loss_rejects_bad_arguments():
    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="aggregation"):
        token_policy_loss(x, x, torch.zeros(2), mask, aggregation="mean")
    with pytest.raises(ValueError, match="level"):
        token_policy_loss(x, x, torch.zeros(2), mask, level="chunk")
    with pytest.raises(ValueError, match="logp_ref"):
        token_policy_loss(x, x, torch.zeros(2), mask, beta=0.1)
    with pytest.raises(ValueError, match="max_len"):
        token_policy_loss(x, x, torch.zeros(2), mask, aggregation="dr_grpo", max_len=2)
    with pytest.raises(ValueError, match="advantages"):
        token_policy_loss(x, x, torch.zeros(3), mask)
