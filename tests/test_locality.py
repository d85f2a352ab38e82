"""Locality-preserving advantages for editing (training.locality, after Edit-GRPO): the step's
Gaussian log-density split by an edit-region mask, one clipped ratio and one advantage per
region, the two advantages from the edit and preservation rewards, masks on latent grids, and a
training iteration that uses them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.advantages import group_advantages, region_advantages
from flowgrpo.config import ConfigError
from flowgrpo.edit_regions import difference_mask, downsample_mask
from flowgrpo.losses import (fixed_region_shares, flow_kl, policy_loss, region_flow_kl,
                             region_flow_matching, region_policy_loss, signal_region_shares,
                             source_preserving_target)
from flowgrpo.prompts import load_prompts
from flowgrpo.sde import region_log_probs, score_step, transition
from flowgrpo.toyworld.editing import render_pair
from tests.helpers import edit_config

SHAPE = (6, 3, 8, 8)
CLIP = 1e-3


def step(seed: int = 0, kind: str = "flow_sde", log_prob: str = "exact"):
    """A sampled SDE step (x, x', its Gaussian) and a new velocity with a gradient."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=generator)
    v_old = torch.randn(SHAPE, generator=generator)
    out = transition(kind, v_old, x, torch.full((SHAPE[0],), 0.8), torch.full((SHAPE[0],), 0.7),
                     noise_level=0.7, generator=generator, log_prob=log_prob)
    v_new = (v_old + 0.05 * torch.randn(SHAPE, generator=generator)).requires_grad_(True)
    return x, v_old, v_new, out


def region_loss(x, v_new, out, mask, advantages, weights=None):
    """What the flow policy computes for a replay batch under training.locality."""
    _, mean = score_step(v_new, x, out.prev_sample, out.gaussian)
    logp, shares = region_log_probs(out.prev_sample - mean, out.gaussian, mask)
    logp_old, _ = region_log_probs(out.prev_sample - out.mean, out.gaussian, mask)
    return region_policy_loss(logp, logp_old, advantages, shares, CLIP, CLIP, weights=weights)


def random_mask(seed: int, soft: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.rand((SHAPE[0], 1, *SHAPE[2:]), generator=generator)
    return values if soft else (values > 0.6).float()


@pytest.mark.parametrize("log_prob", ["exact", "unscaled"])
@pytest.mark.parametrize("soft", [False, True])
def test_region_parts_weighted_by_their_shares_are_the_step_log_prob(log_prob, soft):
    _, _, _, out = step(1, log_prob=log_prob)
    mask = random_mask(2, soft)
    parts, shares = region_log_probs(out.prev_sample - out.mean, out.gaussian, mask)
    assert parts.shape == shares.shape == (SHAPE[0], 2)
    torch.testing.assert_close(shares.sum(dim=1), torch.ones(SHAPE[0]))
    torch.testing.assert_close(shares[:, 0], mask.mean(dim=(1, 2, 3)))
    torch.testing.assert_close((shares * parts).sum(dim=1), out.log_prob, rtol=1e-5, atol=1e-5)
    # Each part is the mean of the per-element log-density over its region (closed form).
    residual = (out.prev_sample - out.mean).square()
    std = out.std[:, None, None, None]
    if log_prob == "exact":
        element = -residual / (2 * std ** 2) - torch.log(std) - 0.5 * np.log(2 * np.pi)
    else:
        element = -residual
    weights = mask.expand(SHAPE)
    inside = (weights * element).sum(dim=(1, 2, 3)) / weights.sum(dim=(1, 2, 3))
    torch.testing.assert_close(parts[:, 0], inside, rtol=1e-5, atol=1e-5)


def test_a_mask_of_ones_is_the_scalar_loss_and_its_gradient():
    """Off-policy (the velocity moved since the rollout, some ratios clipped): with every element
    in the edit region, the region loss is policy_loss with the edit advantage, value and
    gradient; the preservation advantage has no effect."""
    x, _, v_new, out = step(3)
    advantages = torch.tensor([1.5, -0.7, 0.3, -2.0, 0.9, 0.0])
    weights = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.0, 1.0])
    ones = torch.ones(SHAPE[0], 1, *SHAPE[2:])
    keep = torch.tensor([9.0, -9.0, 3.0, 3.0, -1.0, 4.0])
    loss = region_loss(x, v_new, out, ones, torch.stack([advantages, keep], 1), weights)
    (grad,) = torch.autograd.grad(loss, v_new)
    logp, _ = score_step(v_new, x, out.prev_sample, out.gaussian)
    scalar = policy_loss(logp, out.log_prob, advantages, CLIP, CLIP, weights=weights)
    (scalar_grad,) = torch.autograd.grad(scalar, v_new)
    torch.testing.assert_close(loss, scalar, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, scalar_grad, rtol=1e-4, atol=1e-9)
    ratio = torch.exp(logp.detach() - out.log_prob)
    assert bool(((ratio - 1).abs() > CLIP).any())   # the clip acts in this batch


def test_a_mask_of_zeros_leaves_the_region_without_gradient():
    """No edit region: the loss is the scalar loss with the preservation advantage, and the edit
    advantage changes neither value nor gradient."""
    x, _, v_new, out = step(4)
    keep = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    zeros = torch.zeros(SHAPE[0], 1, *SHAPE[2:])
    grads = []
    for edit in (torch.zeros(6), torch.full((6,), 7.0)):
        loss = region_loss(x, v_new, out, zeros, torch.stack([edit, keep], 1))
        grads.append(torch.autograd.grad(loss, v_new)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    logp, _ = score_step(v_new, x, out.prev_sample, out.gaussian)
    scalar = policy_loss(logp, out.log_prob, keep, CLIP, CLIP)
    torch.testing.assert_close(grads[0], torch.autograd.grad(scalar, v_new)[0], rtol=1e-4,
                               atol=1e-9)


def test_each_element_is_pushed_by_its_own_regions_advantage():
    """On the first pass (ratio 1) the gradient w.r.t. the step mean is, per element,
    -A_region(d) (x'_d - mean_d) / (std^2 n) / rows: zero inside the region when the edit
    advantage is 0, zero outside when the preservation advantage is 0."""
    x, v_old, _, out = step(5)
    mask = random_mask(6)
    edit = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.25])
    keep = torch.tensor([-0.5, 1.0, 2.0, -1.5, 0.75, 1.0])
    mean = out.mean.clone().requires_grad_(True)
    logp, shares = region_log_probs(out.prev_sample - mean, out.gaussian, mask)
    logp_old, _ = region_log_probs(out.prev_sample - out.mean, out.gaussian, mask)
    loss = region_policy_loss(logp, logp_old, torch.stack([edit, keep], 1), shares, CLIP, CLIP)
    (grad,) = torch.autograd.grad(loss, mean, retain_graph=True)
    numel = float(np.prod(SHAPE[1:]))
    per_element = torch.where(mask.expand(SHAPE) > 0, edit[:, None, None, None],
                              keep[:, None, None, None])
    std = out.std[:, None, None, None]
    expected = -per_element * (out.prev_sample - out.mean) / (std ** 2 * numel) / SHAPE[0]
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-10)
    for column, where in ((0, mask > 0), (1, mask == 0)):
        advantages = torch.stack([edit, keep], 1)
        advantages[:, column] = 0
        loss = region_policy_loss(logp, logp_old, advantages, shares, CLIP, CLIP)
        (grad,) = torch.autograd.grad(loss, mean, retain_graph=True)
        assert bool((grad[where.expand(SHAPE)] == 0).all())
        assert bool((grad[~where.expand(SHAPE)] != 0).any())


def first_pass_region_grad(out, inside, weights, edit, keep):
    """The first pass's gradient w.r.t. the step mean with region weights (B, 2) over the edit
    region ``inside`` and its complement: -A_region(d) (x'_d - mean_d) w_region(d) /
    (std^2 |region(d)|) / B per element."""
    region_size = torch.where(inside, inside.sum(dim=(1, 2, 3), keepdim=True),
                              (~inside).sum(dim=(1, 2, 3), keepdim=True)).float()
    region_weight = torch.where(inside, weights[:, 0, None, None, None],
                                weights[:, 1, None, None, None])
    per_element = torch.where(inside, edit[:, None, None, None], keep[:, None, None, None])
    std = out.std[:, None, None, None]
    return (-per_element * (out.prev_sample - out.mean) * region_weight
            / (std ** 2 * region_size) / SHAPE[0])


@pytest.mark.parametrize("edit_weight", [0.5, 0.2])
def test_fixed_edit_weight_pushes_each_region_by_its_advantage_over_its_own_area(edit_weight):
    """training.locality.edit_weight = w. On the first pass the gradient w.r.t. the step mean is
    -A_region(d) (x'_d - mean_d) w_region(d) / (std^2 |region(d)|) / rows per element (w_edit = w,
    w_rest = 1 - w), so a region of a few elements gets its advantage at full strength; a row
    whose mask is all ones or all zeros keeps the area weighting's (one region, weight 1), i.e.
    the scalar loss."""
    x, v_old, _, out = step(7)
    mask = random_mask(8)
    mask[0] = 1.0      # all edit region
    mask[1] = 0.0      # no edit region
    edit = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.25])
    keep = torch.tensor([-0.5, 1.0, 2.0, -1.5, 0.75, 1.0])
    mean = out.mean.clone().requires_grad_(True)
    logp, shares = region_log_probs(out.prev_sample - mean, out.gaussian, mask)
    logp_old, _ = region_log_probs(out.prev_sample - out.mean, out.gaussian, mask)
    weights = fixed_region_shares(shares, edit_weight)
    torch.testing.assert_close(weights[:2], torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    torch.testing.assert_close(weights[2:], torch.tensor([[edit_weight, 1 - edit_weight]] * 4))
    loss = region_policy_loss(logp, logp_old, torch.stack([edit, keep], 1), weights, CLIP, CLIP)
    (grad,) = torch.autograd.grad(loss, mean)
    inside = mask.expand(SHAPE) > 0
    torch.testing.assert_close(grad, first_pass_region_grad(out, inside, weights, edit, keep),
                               rtol=1e-4, atol=1e-10)
    # Against the area weighting, the edit region's per-element push grows by w n / |region|.
    numel = float(np.prod(SHAPE[1:]))
    area_grad = first_pass_region_grad(out, inside, shares, edit, keep)
    region_size = inside.sum(dim=(1, 2, 3), keepdim=True).float().expand(SHAPE)
    rows = slice(2, None)
    ratio = grad[rows][inside[rows]] / area_grad[rows][inside[rows]]
    torch.testing.assert_close(ratio, edit_weight * numel / region_size[rows][inside[rows]],
                               rtol=1e-3, atol=1e-6)
    with pytest.raises(ValueError, match=r"\(B, 2\)"):
        fixed_region_shares(torch.ones(3), edit_weight)
    with pytest.raises(ValueError, match="edit_weight must be in"):
        fixed_region_shares(shares, 1.0)


@pytest.mark.parametrize("edit_weight", [None, 0.3])
def test_a_silent_regions_share_goes_to_the_live_region(edit_weight):
    """training.locality.silent_share = reassign. A row whose preservation advantage is 0 (its
    kept score equal across the group) pushes its edit region as a whole row would: gradient
    -A_edit (x' - mean) / (std^2 |edit region|) / B there and exactly 0 on the rest; a row with
    a silent edit region pushes the rest over its own area; rows with both advantages non-zero
    keep their weights (area shares or edit_weight's), and a row with both silent gives nothing."""
    x, v_old, _, out = step(11)
    mask = random_mask(9)
    edit = torch.tensor([1.5, 0.0, -0.5, 2.0, 0.0, -1.0])
    keep = torch.tensor([0.0, -1.0, 0.75, 0.0, 0.0, 1.25])
    mean = out.mean.clone().requires_grad_(True)
    logp, shares = region_log_probs(out.prev_sample - mean, out.gaussian, mask)
    logp_old, _ = region_log_probs(out.prev_sample - out.mean, out.gaussian, mask)
    base = shares if edit_weight is None else fixed_region_shares(shares, edit_weight)
    advantages = torch.stack([edit, keep], 1)
    weights = signal_region_shares(base, advantages)
    live_edit, live_keep = edit != 0, keep != 0
    torch.testing.assert_close(weights[live_edit & ~live_keep],
                               torch.tensor([[1.0, 0.0]]).expand(2, 2))
    torch.testing.assert_close(weights[~live_edit & live_keep], torch.tensor([[0.0, 1.0]]))
    torch.testing.assert_close(weights[live_edit & live_keep], base[live_edit & live_keep])
    torch.testing.assert_close(weights[4], base[4])                  # both silent: unchanged
    torch.testing.assert_close(weights.sum(1), torch.ones(6))
    loss = region_policy_loss(logp, logp_old, advantages, weights, CLIP, CLIP)
    (grad,) = torch.autograd.grad(loss, mean)
    inside = mask.expand(SHAPE) > 0
    torch.testing.assert_close(grad, first_pass_region_grad(out, inside, weights, edit, keep),
                               rtol=1e-4, atol=1e-10)
    # the silent-keep rows (0, 3): the edit region at full weight, nothing on the rest
    for row in (0, 3):
        assert bool((grad[row][~inside[row]] == 0).all())
        torch.testing.assert_close(
            grad[row][inside[row]],
            (-edit[row] * (out.prev_sample - out.mean)[row] / (out.std[row] ** 2
             * inside[row].sum()) / SHAPE[0])[inside[row]], rtol=1e-4, atol=1e-10)
    assert bool((grad[4] == 0).all())
    with pytest.raises(ValueError, match=r"\(B, K\)"):
        signal_region_shares(shares, edit)


def test_a_keep_region_leaves_the_elements_no_reward_speaks_for_out():
    """training.locality.keep_region = record. The preservation part is the keep mask's weighted
    mean, the shares are the two regions' sizes over their sum, and on the first pass the
    gradient w.r.t. the mean is -A_region(d) (x'_d - mean_d) / (std^2 (|E| + |K|)) / B in each
    region and exactly 0 on elements in neither; a keep mask of 1 - mask is the default split;
    a row with an empty keep region is the scalar loss over the edit region alone."""
    x, v_old, _, out = step(5)
    mask = random_mask(3)
    keep = random_mask(4) * (1 - mask)
    keep[0] = 0.0                                   # no other object: the edit region alone
    edit = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.25])
    kept = torch.tensor([-0.5, 1.0, 2.0, -1.5, 0.75, 1.0])
    mean = out.mean.clone().requires_grad_(True)
    logp, shares = region_log_probs(out.prev_sample - mean, out.gaussian, mask, keep)
    logp_old, _ = region_log_probs(out.prev_sample - out.mean, out.gaussian, mask, keep)
    size_e, size_k = mask.sum(dim=(1, 2, 3)) * SHAPE[1], keep.sum(dim=(1, 2, 3)) * SHAPE[1]
    torch.testing.assert_close(shares, torch.stack([size_e, size_k], 1)
                               / (size_e + size_k)[:, None])
    torch.testing.assert_close(shares[0], torch.tensor([1.0, 0.0]))
    loss = region_policy_loss(logp, logp_old, torch.stack([edit, kept], 1), shares, CLIP, CLIP)
    (grad,) = torch.autograd.grad(loss, mean)
    inside, kept_in = mask.expand(SHAPE) > 0, keep.expand(SHAPE) > 0
    neither = ~inside & ~kept_in
    assert bool(neither.any()) and bool((grad[neither] == 0).all())
    std = out.std[:, None, None, None]
    per_element = torch.where(inside, edit[:, None, None, None], kept[:, None, None, None])
    expected = (-per_element * (out.prev_sample - out.mean)
                / (std ** 2 * (size_e + size_k)[:, None, None, None]) / SHAPE[0])
    where = inside | kept_in
    torch.testing.assert_close(grad[where], expected[where], rtol=1e-4, atol=1e-10)
    # keep = 1 - mask is the default complement, log-probs and shares
    default = region_log_probs(out.prev_sample - out.mean, out.gaussian, mask)
    complement = region_log_probs(out.prev_sample - out.mean, out.gaussian, mask, 1 - mask)
    for ours, theirs in zip(complement, default):
        torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="keep shape"):
        region_log_probs(out.prev_sample - out.mean, out.gaussian, mask, torch.ones(5, 5))


def test_a_region_kl_over_every_element_is_the_flow_kl():
    generator = torch.Generator().manual_seed(3)
    mean = torch.randn(SHAPE, generator=generator)
    mean_ref = torch.randn(SHAPE, generator=generator)
    std = torch.rand(SHAPE[0], generator=generator) + 0.1
    ones = torch.ones((SHAPE[0], 1, *SHAPE[2:]))
    torch.testing.assert_close(region_flow_kl(mean, mean_ref, std, ones),
                               flow_kl(mean, mean_ref, std))


def test_a_region_kl_is_the_regions_kl_per_element_and_pulls_only_there():
    """Means 0.3 from the reference inside the region and 5 outside, std 0.5: the region's KL
    per element is 0.3^2 / (2 * 0.25) = 0.18 whatever happens outside; the gradient is
    (mean - mean_ref) / (std^2 |region|) inside and exactly 0 outside; a row without region 0."""
    mask = random_mask(4)
    mask[-1] = 0.0
    mean_ref = torch.zeros(SHAPE)
    mean = torch.where(mask.bool().expand(SHAPE), 0.3, 5.0).requires_grad_(True)
    std = torch.full((SHAPE[0],), 0.5)
    kl = region_flow_kl(mean, mean_ref, std, mask)
    expected = torch.tensor([0.18] * (SHAPE[0] - 1) + [0.0])
    torch.testing.assert_close(kl, expected)
    kl.sum().backward()
    region = mask.expand(SHAPE)
    sizes = region.flatten(1).sum(dim=1).clamp(min=1)
    torch.testing.assert_close(mean.grad, region * 0.3 / (0.25 * sizes[:, None, None, None]))
    assert mean.grad[region == 0].abs().max().item() == 0.0


def test_a_soft_region_kl_weighs_each_element_by_its_weight():
    generator = torch.Generator().manual_seed(5)
    mean = torch.randn(SHAPE, generator=generator)
    mean_ref = torch.randn(SHAPE, generator=generator)
    std = torch.rand(SHAPE[0], generator=generator) + 0.1
    weights = random_mask(6, soft=True)
    full = weights.expand(SHAPE)
    squared = (mean - mean_ref) ** 2
    expected = (full * squared).flatten(1).sum(1) / full.flatten(1).sum(1) / (2 * std ** 2)
    torch.testing.assert_close(region_flow_kl(mean, mean_ref, std, weights), expected)


def test_a_region_kl_refuses_bad_regions():
    mean = torch.zeros(SHAPE)
    std = torch.ones(SHAPE[0])
    with pytest.raises(ValueError, match="does not broadcast"):
        region_flow_kl(mean, mean, std, torch.ones(SHAPE[0], 1, 5, 5))
    with pytest.raises(ValueError, match="must be in \\[0, 1\\]"):
        region_flow_kl(mean, mean, std, torch.full((SHAPE[0], 1, 8, 8), 1.5))


def test_toy_edit_records_keep_the_other_objects_pixels():
    """keep_mask: the source's object pixels outside the edit region, so the two regions are
    disjoint and together the source's foreground; a one-object scene has nothing to keep."""
    records = load_prompts("toy:edit_heldout")
    families = set()
    for record in records[:6] + records[-6:]:
        mask, keep = record["mask"], record["keep_mask"]
        foreground = record["image"].amax(dim=0, keepdim=True) > 0
        assert keep.shape == (1, 24, 24) and float((mask * keep).sum()) == 0.0
        assert torch.equal((mask + keep) > 0, foreground)
        family = record["metadata"]["family"]
        families.add(family)
        assert (float(keep.sum()) == 0.0) == (family == "recolor_one")
    assert families == {"recolor_one", "recolor_two"}


def test_region_advantages_are_each_rewards_group_normalisation():
    """The edit region's advantage is the group z-score of the edit reward (toy_edit's
    "target"), the rest's that of the preservation reward ("kept"), each on its own."""
    target = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    kept = torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    advantages, stats = region_advantages(target, kept, groups, eps=0.0, clip=None)
    # group 0: target mean 1/2, std 1/2 -> +-1; kept mean 7/8, std sqrt(3)/8
    torch.testing.assert_close(advantages[:4, 0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    torch.testing.assert_close(advantages[:4, 1],
                               torch.tensor([1.0, -3.0, 1.0, 1.0]) / np.sqrt(3.0))
    assert advantages[4:, 0].tolist() == [0.0] * 4          # no target signal in group 1
    torch.testing.assert_close(advantages[:, 1], group_advantages(kept, groups, eps=0.0,
                                                                  clip=None)[0])
    assert stats["edit/zero_std_fraction"] == 0.5 and stats["keep/zero_std_fraction"] == 0.0
    assert stats["zero_std_fraction"] == 0.0


def test_downsampling_a_mask_to_a_latent_grid():
    mask = torch.zeros(1, 1, 16, 16)
    mask[..., 0:8, 0:8] = 1           # cell (0, 0) of an 8x grid, fully
    mask[..., 8:10, 8:12] = 1         # 2 x 4 of cell (1, 1)'s 64 pixels
    area = downsample_mask(mask, (2, 2), "area")
    torch.testing.assert_close(area[0, 0], torch.tensor([[1.0, 0.0], [0.0, 1 / 8]]))
    nearest = downsample_mask(mask, (2, 2), "nearest")
    assert nearest[0, 0].tolist() == [[1.0, 0.0], [0.0, 0.0]]   # cell centres (4, 4), (12, 12)
    mask[..., 12, 12] = 1
    assert downsample_mask(mask, (2, 2), "nearest")[0, 0, 1, 1] == 1.0
    assert torch.equal(downsample_mask(mask, (16, 16), "area"), mask)   # the toy: identity
    with pytest.raises(ValueError, match="at most"):
        downsample_mask(mask, (32, 32))


def test_packed_region_mask_follows_the_latents_packing():
    """FLUX / Qwen-Image latents are packed 2x2 patches; the mask's packed features carry the
    weight of the latent element they hold."""
    from pipelines.flux import pack_latents, packed_region_mask, unpack_latents

    mask = (torch.rand(2, 1, 64, 48, generator=torch.Generator().manual_seed(0)) > 0.5).float()
    packed = packed_region_mask(mask, 8, 6, 16, "area")
    assert packed.shape == (2, 4 * 3, 64)
    grid = downsample_mask(mask, (8, 6), "area")
    torch.testing.assert_close(unpack_latents(packed, 8, 6), grid.expand(-1, 16, -1, -1))
    latents = torch.randn(2, 16, 8, 6)
    weighted = unpack_latents(pack_latents(latents) * packed, 8, 6)
    torch.testing.assert_close(weighted, latents * grid)


def test_toy_edit_records_carry_the_recoloured_objects_pixels_as_mask():
    records = load_prompts("toy:edit_heldout")[:10]
    for record in records:
        meta = record["metadata"]
        source, target = render_pair(meta["source"], meta["edit"], meta["layout_seed"])
        mask = record["mask"]
        assert mask.shape == (1, 24, 24) and set(mask.unique().tolist()) == {0.0, 1.0}
        changed = torch.from_numpy(np.abs(target - source).max(axis=0) > 0)
        assert torch.equal(mask[0] > 0, changed)
        # the region is one object's, a fraction of the picture
        assert 0.02 < float(mask.mean()) < 0.25
    assert torch.equal(difference_mask(torch.from_numpy(target)[None],
                                       torch.from_numpy(source)[None], 0.05)[0], mask)


def test_jsonl_mask_is_a_greyscale_image_relative_to_the_file(tmp_path):
    pixels = np.zeros((6, 4, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    mask = np.zeros((6, 4), dtype=np.uint8)
    mask[1:3, 2:] = 255
    Image.fromarray(mask).save(tmp_path / "a_mask.png")
    Image.fromarray(np.zeros((5, 4), dtype=np.uint8)).save(tmp_path / "small.png")
    path = tmp_path / "edits.jsonl"
    path.write_text(json.dumps({"prompt": "x", "image": "a.png", "mask": "a_mask.png"}) + "\n")
    record = load_prompts(str(path))[0]
    assert record["mask"].shape == (1, 6, 4)
    assert torch.equal(record["mask"][0], torch.from_numpy(mask / 255.0).float())
    path.write_text(json.dumps({"prompt": "x", "image": "a.png", "mask": "small.png"}) + "\n")
    with pytest.raises(ValueError, match="the source image's size"):
        load_prompts(str(path))
    path.write_text(json.dumps({"prompt": "x", "mask": "a_mask.png"}) + "\n")
    with pytest.raises(ValueError, match="give the line an \"image\""):
        load_prompts(str(path))
    # the preservation region, in the same form
    path.write_text(json.dumps({"prompt": "x", "image": "a.png", "mask": "a_mask.png",
                                "keep_mask": "a_mask.png"}) + "\n")
    assert torch.equal(load_prompts(str(path))[0]["keep_mask"], record["mask"])
    path.write_text(json.dumps({"prompt": "x", "image": "a.png", "keep_mask": "small.png"}) + "\n")
    with pytest.raises(ValueError, match="keep_mask small.png is"):
        load_prompts(str(path))
    path.write_text(json.dumps({"prompt": "x", "image": "a.png", "keep_mask": 3}) + "\n")
    with pytest.raises(ValueError, match="\"keep_mask\" must be a path string"):
        load_prompts(str(path))
    path.write_text(json.dumps({"prompt": "x", "keep_mask": "a_mask.png"}) + "\n")
    with pytest.raises(ValueError, match="give the line an \"image\""):
        load_prompts(str(path))


def locality_config(path: str, tmp_path: Path, *overrides: str):
    """``edit_config`` with every step trained, the exact edit reward and locality on (the
    recoloured object's exact mask from the toy records)."""
    return edit_config(path, tmp_path, "sampling.plan.kind=full",
                       "rewards.components=[{name: toy_edit, options: {score: exact}}]",
                       "training.locality.mask=record", "training.locality.edit_key=toy_edit.target",
                       "training.locality.keep_key=toy_edit.kept", *overrides)


@pytest.mark.parametrize("overrides, message", [
    (["training.locality.edit_key="], "training.locality.edit_key is empty"),
    (["training.locality.keep_key=toy_edit.target"], "are both"),
    (["training.locality.mask=everywhere"], "training.locality.mask must be one of"),
    (["training.locality.resize=bilinear"], "training.locality.resize must be one of"),
    (["training.locality.edit_weight=1.5"], "training.locality.edit_weight must be in"),
    (["training.locality.silent_share=drop"], "training.locality.silent_share must be one of"),
    (["training.locality.keep_region=outside"], "training.locality.keep_region must be one of"),
    (["training.locality.difference_threshold=1.5"], "difference_threshold must be in"),
    (["training.locality.keep_kl_beta=-0.1"], "training.locality.keep_kl_beta must be >= 0"),
    (["training.locality.keep_source_beta=-1"],
     "training.locality.keep_source_beta must be >= 0"),
    (["rewards.aggregation=decoupled"], "rewards.aggregation: decoupled"),
    (["training.ratio_norm=true"], "training.ratio_norm"),
    (["training.gardo.diversity=true"], "training.gardo.diversity"),
])
def test_locality_config_errors_name_the_field(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        locality_config("assets/toy_edit", tmp_path, *overrides)


def test_an_edit_weight_without_regions_is_refused():
    from flowgrpo.config_sections import LocalityConfig

    with pytest.raises(ConfigError, match="edit_weight is set but training.locality.mask is 'off'"):
        LocalityConfig(mask="off", edit_weight=0.3).validate()
    with pytest.raises(ConfigError, match="silent_share is 'reassign' but training.locality.mask"):
        LocalityConfig(mask="off", silent_share="reassign").validate()
    with pytest.raises(ConfigError, match="keep_region is 'record' but training.locality.mask"):
        LocalityConfig(mask="off", keep_region="record").validate()
    with pytest.raises(ConfigError, match="keep_kl_beta is set but training.locality.mask"):
        LocalityConfig(mask="off", keep_kl_beta=0.1).validate()
    with pytest.raises(ConfigError, match="keep_source_beta is set but training.locality.mask"):
        LocalityConfig(mask="off", keep_source_beta=0.1).validate()
    LocalityConfig(mask="off").validate()


def test_locality_keys_must_be_reward_outputs(tmp_path):
    with pytest.raises(ConfigError, match="training.locality.edit_key: 'target' names no reward"):
        locality_config("assets/toy_edit", tmp_path, "training.locality.edit_key=target")


@pytest.mark.parametrize("mask, edit_weight, silent_share, keep_region", [
    ("record", "null", "keep", "rest"), ("difference", "0.3", "keep", "rest"),
    ("record", "null", "reassign", "rest"), ("record", "null", "keep", "record")])
def test_an_editing_iteration_with_locality(mask, edit_weight, silent_share, keep_region, edit_dir,
                                            tmp_path, monkeypatch):
    """A whole iteration: region masks on the batch, two advantages per sample, the region loss
    on replay (first-pass ratio exactly 1 in both regions, weighed by edit_weight when set, the
    silent regions' shares reassigned when asked), and the weights move."""
    import flowgrpo.algorithms.grpo as flow_policy
    from flowgrpo.trainer import Trainer

    weighted = []
    original = flow_policy.fixed_region_shares

    def recording(shares, weight):
        weighted.append(weight)
        return original(shares, weight)

    monkeypatch.setattr(flow_policy, "fixed_region_shares", recording)
    reassigned = []
    original_signal = flow_policy.signal_region_shares

    def recording_signal(shares, advantages):
        out = original_signal(shares, advantages)
        reassigned.append(bool(((advantages == 0) & (shares > 0) & (shares < 1)).any()))
        return out

    monkeypatch.setattr(flow_policy, "signal_region_shares", recording_signal)
    keeps = []
    original_parts = flow_policy.region_log_probs

    def recording_parts(residual, gaussian, region, keep=None):
        keeps.append(keep)
        return original_parts(residual, gaussian, region, keep)

    monkeypatch.setattr(flow_policy, "region_log_probs", recording_parts)

    trainer = Trainer(locality_config(edit_dir, tmp_path, f"training.locality.mask={mask}",
                                      f"training.locality.edit_weight={edit_weight}",
                                      f"training.locality.silent_share={silent_share}",
                                      f"training.locality.keep_region={keep_region}"))
    assert trainer.config.training.locality.edit_weight == (None if edit_weight == "null"
                                                            else 0.3)
    before = {k: v.detach().clone() for k, v in trainer.policy.trainable.items()}
    batch, rewards, _ = trainer.policy.rollout(*trainer.local_batch(0), 0)
    assert batch.region_masks.shape == (8, 1, 24, 24)
    records = trainer.local_batch(0)[0]
    if mask == "record":
        assert torch.equal(batch.region_masks[0], records[0]["mask"])
    if keep_region == "record":
        assert torch.equal(batch.keep_masks, torch.stack([r["keep_mask"] for r in records]))
    else:
        assert batch.keep_masks is None
    advantages, metrics = trainer.compute_advantages(batch, rewards)
    assert advantages.shape == (8, 2)
    assert "adv/edit/zero_std_fraction" in metrics and "adv/keep/zero_std_fraction" in metrics
    metrics = trainer.run_iteration(0)
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    if metrics["train/replay_batches"] > 0:
        assert any(not torch.equal(before[k], v) for k, v in trainer.policy.trainable.items())
        # the replay loss uses the fixed weights exactly when edit_weight is set
        assert weighted == ([] if edit_weight == "null" else [0.3] * len(weighted)) and \
            (edit_weight == "null" or len(weighted) > 0)
        # and reassigns the silent regions' shares exactly when silent_share asks for it
        assert (len(reassigned) > 0) == (silent_share == "reassign")
        # and splits by the records' keep masks exactly when keep_region asks for them
        assert len(keeps) > 0 and all((k is not None) == (keep_region == "record")
                                      for k in keeps)


@pytest.mark.parametrize("keep_region", ["rest", "record"])
def test_a_keep_region_kl_holds_the_rest_at_the_reference(keep_region, edit_dir, tmp_path,
                                                           monkeypatch):
    """training.locality.keep_kl_beta: full fine-tuning keeps a frozen reference for it; each
    replay batch's KL runs over the preservation region (the records' keep masks outside the
    edit region, or the whole rest), is exactly 0 before the first optimizer step (the policy is
    the reference), and enters the loss as beta times its mean over the rows with a region."""
    import flowgrpo.algorithms.grpo as flow_policy
    from flowgrpo.trainer import Trainer

    calls = []
    original = flow_policy.region_flow_kl

    def recording(mean, mean_ref, std, region):
        out = original(mean, mean_ref, std, region)
        calls.append((region.detach().clone(), out.detach().clone()))
        return out

    monkeypatch.setattr(flow_policy, "region_flow_kl", recording)
    # one-object edits (nothing to keep under keep_region: record) beside two-object ones in a
    # replay batch: 8 prompts of 2 samples, the two families drawn equally, batches of 8 rows
    trainer = Trainer(locality_config(edit_dir, tmp_path, "training.locality.keep_kl_beta=0.5",
                                      f"training.locality.keep_region={keep_region}",
                                      "training.gradient_accumulation_steps=1",
                                      "training.prompts_per_iteration=8", "training.group_size=2",
                                      "prompts.balance_key=family",
                                      "sampling.rollout_batch_size=8"))
    assert trainer.policy.reference_module is not None
    regions = []
    weights_of = trainer.policy.algorithm.preservation_weights

    def recording_region(batch, replay, device):
        out = weights_of(batch, replay, device)
        edit = batch.region_masks[replay.rows]
        expected = (1.0 - edit if keep_region == "rest"
                    else batch.keep_masks[replay.rows] * (1.0 - edit))
        regions.append((out, expected))
        return out

    monkeypatch.setattr(trainer.policy.algorithm, "preservation_weights", recording_region)
    metrics = trainer.run_iteration(0)
    assert len(calls) == len(regions) == metrics["train/replay_batches"] >= 2
    for (region, kl), (out, expected) in zip(calls, regions):
        assert torch.equal(region, out) and torch.equal(out, expected)
    if keep_region == "record":
        assert any(bool((region.flatten(1).sum(1) == 0).any()) for region, _ in calls[1:])
    assert calls[0][1].abs().max().item() == 0.0
    assert max(kl.max().item() for _, kl in calls[1:]) > 0.0
    # each batch's term: the mean over its rows that have a region (one-object toy edits have
    # nothing to keep), and the update reports the batches' mean
    terms = [kl.sum() / (region.flatten(1).sum(1) > 0).sum().clamp(min=1) for region, kl in calls]
    torch.testing.assert_close(torch.tensor(metrics["train/keep_kl"]),
                               torch.stack(terms).mean().float())


def test_record_masks_are_required_at_start(edit_dir, tmp_path):
    from flowgrpo.trainer import Trainer

    folder = tmp_path / "p"
    folder.mkdir()
    Image.fromarray(np.zeros((24, 24, 3), dtype=np.uint8)).save(folder / "a.png")
    (folder / "e.jsonl").write_text(json.dumps({"prompt": "make the circle red",
                                                "image": "a.png"}) + "\n")
    config = locality_config(edit_dir, tmp_path, f"prompts.train={folder / 'e.jsonl'}",
                             "prompts.eval=null", "rewards.components=[{name: toy_edit}]")
    with pytest.raises(ConfigError, match="have no \"mask\""):
        Trainer(config)
    config = locality_config(edit_dir, tmp_path, f"prompts.train={folder / 'e.jsonl'}",
                             "prompts.eval=null", "rewards.components=[{name: toy_edit}]",
                             "training.locality.mask=difference",
                             "training.locality.keep_region=record")
    with pytest.raises(ConfigError, match="have no \"keep_mask\""):
        Trainer(config)


# ---------------------------------------------------------------- keep_source_beta

def test_region_flow_matching_over_every_element_is_the_flow_matching_loss():
    generator = torch.Generator().manual_seed(3)
    velocity, noise, target = (torch.randn(SHAPE, generator=generator) for _ in range(3))
    full = region_flow_matching(velocity, noise, target, torch.ones(SHAPE[0], 1, *SHAPE[2:]))
    torch.testing.assert_close(full, (velocity - (noise - target)).pow(2).flatten(1).mean(1))


def test_region_flow_matching_is_the_regions_mean_and_trains_only_there():
    generator = torch.Generator().manual_seed(4)
    noise, target = (torch.randn(SHAPE, generator=generator) for _ in range(2))
    velocity = torch.randn(SHAPE, generator=generator).requires_grad_(True)
    region = random_mask(5)
    region[0] = 0.0                       # a row with nothing to keep
    loss = region_flow_matching(velocity, noise, target, region)
    inside = region.expand(SHAPE).bool()
    squared = (velocity - (noise - target)).pow(2).detach()
    for row in range(1, SHAPE[0]):
        torch.testing.assert_close(loss[row], squared[row][inside[row]].mean())
    assert loss[0].item() == 0.0
    loss.sum().backward()
    assert velocity.grad[~inside].abs().max().item() == 0.0
    assert velocity.grad[inside].abs().min().item() > 0.0
    # the velocity that carries x_sigma to the target has no loss
    exact = region_flow_matching(noise - target, noise, target, region)
    assert exact.abs().max().item() == 0.0


def test_a_soft_region_weighs_each_element_and_bad_regions_are_refused():
    generator = torch.Generator().manual_seed(6)
    velocity, noise, target = (torch.randn(SHAPE, generator=generator) for _ in range(3))
    region = random_mask(7, soft=True)
    weights = region.expand(SHAPE)
    squared = (velocity - (noise - target)).pow(2)
    expected = (weights * squared).flatten(1).sum(1) / weights.flatten(1).sum(1)
    torch.testing.assert_close(region_flow_matching(velocity, noise, target, region), expected)
    with pytest.raises(ValueError, match="region weights must be in"):
        region_flow_matching(velocity, noise, target, region * 2)
    with pytest.raises(ValueError, match="does not broadcast"):
        region_flow_matching(velocity, noise, target, torch.ones(2, 1, 3, 3))
    with pytest.raises(ValueError, match="noise must have shape"):
        region_flow_matching(velocity, noise[:1], target, region)


def test_the_source_preserving_target_is_the_source_where_kept_and_the_sample_elsewhere():
    generator = torch.Generator().manual_seed(8)
    sample, source = (torch.randn(SHAPE, generator=generator) for _ in range(2))
    keep = random_mask(9)
    target = source_preserving_target(sample, source, keep)
    inside = keep.expand(SHAPE).bool()
    assert torch.equal(target[inside], source[inside])
    assert torch.equal(target[~inside], sample[~inside])
    soft = random_mask(10, soft=True)
    torch.testing.assert_close(source_preserving_target(sample, source, soft),
                               soft * source + (1 - soft) * sample)


def test_toy_encode_images_inverts_decode_and_feeds_the_source_channels(edit_dir):
    from pipelines.toy import ToyFlowModel

    model = ToyFlowModel.from_pretrained(edit_dir)
    generator = torch.Generator().manual_seed(11)
    images = [torch.rand(3, model.sample_size, model.sample_size, generator=generator)
              for _ in range(2)]
    latents = model.encode_images(images)
    torch.testing.assert_close(model.decode(latents), torch.stack(images))
    cond = model.encode_prompts(["make the circle red", "make the square blue"], images=images)
    assert torch.equal(cond.positive["source_latents"], latents)
    with pytest.raises(ValueError, match="images must be"):
        model.encode_images([torch.rand(3, 5, 5)])


def test_keep_source_needs_an_adapter_that_encodes_images(tmp_path):
    """Refused at config load, before any model loads: qwen_image_edit encodes its sources at
    their own resolution, not onto its output latents."""
    from flowgrpo.flow_policy import FlowPolicy
    from pipelines import model_class

    assert hasattr(model_class("toy"), "encode_images")
    assert hasattr(model_class("flux_kontext"), "encode_images")
    assert not hasattr(model_class("qwen_image_edit"), "encode_images")
    config = locality_config("assets/toy_edit", tmp_path, "training.locality.keep_source_beta=1")
    FlowPolicy.check_config(config)
    config.model.family = "qwen_image_edit"
    with pytest.raises(ConfigError, match="keep_source_beta needs the model's latents"):
        FlowPolicy.check_config(config)
    config.model.family = "sd3"     # encodes images (offline DPO pairs) but edits none
    assert hasattr(model_class("sd3"), "encode_images")
    with pytest.raises(ConfigError, match="keep_source_beta needs the model's latents"):
        FlowPolicy.check_config(config)


def test_keep_source_regresses_the_preservation_region_onto_the_source(edit_dir, tmp_path,
                                                                      monkeypatch):
    """training.locality.keep_source_beta: each replay batch's rows that have a preservation
    region are re-noised at their step's sigma from a target that is the source there and the
    row's own sample elsewhere; the term is the mean of region_flow_matching over those rows,
    no reference model is needed, and it enters the update's statistics."""
    import flowgrpo.algorithms.grpo as flow_policy
    from flowgrpo.trainer import Trainer

    calls = []
    original = flow_policy.region_flow_matching

    def recording(velocity, noise, target, region):
        out = original(velocity, noise, target, region)
        calls.append((noise.clone(), target.clone(), region.clone(), out.detach().clone()))
        return out

    monkeypatch.setattr(flow_policy, "region_flow_matching", recording)
    inputs = []
    trainer = Trainer(locality_config(edit_dir, tmp_path, "training.locality.keep_source_beta=0.5",
                                      "training.locality.keep_region=record",
                                      "training.gradient_accumulation_steps=1",
                                      "training.prompts_per_iteration=8", "training.group_size=2",
                                      "prompts.balance_key=family",
                                      "sampling.rollout_batch_size=8"))
    assert trainer.policy.reference_module is None
    policy = trainer.policy
    original_velocity = policy.model.velocity

    def recording_velocity(latents, sigmas, cond, guidance_scale):
        inputs.append((latents.detach().clone(), sigmas.clone()))
        return original_velocity(latents, sigmas, cond, guidance_scale)

    batches = []
    original_loss = policy.algorithm.keep_source_loss

    def recording_loss(batch, replay, cond, settings, iteration):
        start = len(inputs)
        monkeypatch.setattr(policy.model, "velocity", recording_velocity)
        try:
            out = original_loss(batch, replay, cond, settings, iteration)
        finally:
            monkeypatch.setattr(policy.model, "velocity", original_velocity)
        batches.append((batch, replay, inputs[start:], out))
        return out

    monkeypatch.setattr(policy.algorithm, "keep_source_loss", recording_loss)
    metrics = trainer.run_iteration(0)
    assert len(batches) == metrics["train/replay_batches"] >= 2
    terms = []
    calls_iter = iter(calls)
    for batch, replay, forwards, out in batches:
        region = policy.algorithm.preservation_weights(batch, replay, torch.device("cpu"))
        has = (region.flatten(1).sum(1) > 0).nonzero().flatten()
        if has.numel() == 0:     # only one-object edits: no term, no forward
            assert out is None and forwards == []
            continue
        noise, target, called_region, per_row = next(calls_iter)
        rows = replay.rows[has]
        source = 2 * torch.stack([batch.images[i] for i in rows.tolist()]) - 1
        sample = 2 * batch.media[rows] - 1
        kept = called_region.expand(target.shape).bool()
        assert torch.equal(called_region, region[has]) and kept.any()
        torch.testing.assert_close(target[kept], source[kept])
        torch.testing.assert_close(target[~kept], sample[~kept])
        (latents, sigmas), = forwards
        torch.testing.assert_close(sigmas, replay.sigmas[has])
        s = sigmas.view(-1, 1, 1, 1)
        torch.testing.assert_close(latents, (1 - s) * target + s * noise)
        torch.testing.assert_close(out, per_row.mean())
        terms.append(out)
    assert len(terms) >= 1 and next(calls_iter, None) is None
    torch.testing.assert_close(torch.tensor(metrics["train/keep_source"]),
                               torch.stack(terms).mean().float())
