"""benchmarks/edit_anatomy.py: every failure class on a rendered edit built to have it, and the
window probe's invariant (no SDE noise and a shared initial noise: every group silent)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from flowgrpo.toyworld.editing import edit_split
from flowgrpo.toyworld.grammar import COLORS
from flowgrpo.toyworld.render import draw, place_scene
from pipelines.toy import ToyFlowModel
from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def anatomy():
    return load_benchmark("edit_anatomy")


@pytest.fixture(scope="module")
def record():
    return next(r for r in edit_split("edit_heldout") if r["metadata"]["family"] == "recolor_two")


def rendered(record: dict, colours: dict[str, str], keep: int = 2, seed_offset: int = 0
             ) -> np.ndarray:
    """The record's source layout (its layout seed + seed_offset) with the objects' colours
    set by shape from ``colours``, only the first ``keep`` objects drawn."""
    meta = record["metadata"]
    placed = [copy.copy(p) for p in place_scene(meta["source"], 24, np.random.default_rng(
        meta["layout_seed"] + seed_offset))]
    for p in placed:
        p.color = colours.get(p.shape, p.color)
    return draw(placed[:keep], 24)


def test_every_failure_class_is_recognised(anatomy, record):
    meta = record["metadata"]
    edit = meta["edit"]
    other = next(o for o in meta["source"]["objects"] if o["shape"] != edit["shape"])
    taken = {o["color"] for o in meta["source"]["objects"]} | {edit["color"]}
    third = next(c for c in COLORS if c not in taken)
    target = {edit["shape"]: edit["color"]}
    assert anatomy.failure_class(rendered(record, target), record) == "exact"
    assert np.array_equal(rendered(record, {}), record["image"].numpy())
    assert anatomy.failure_class(rendered(record, {}), record) == "not recoloured"
    assert anatomy.failure_class(rendered(record, {edit["shape"]: third}), record) == "wrong colour"
    assert anatomy.failure_class(rendered(record, {**target, other["shape"]: third}),
                                 record) == "other recoloured"
    assert anatomy.failure_class(rendered(record, target, keep=1), record) == "objects"
    # the target drawn in another layout: colours right, objects elsewhere
    assert anatomy.failure_class(rendered(record, target, seed_offset=1), record) == "moved"


def test_no_sde_noise_and_shared_noise_leave_every_group_silent(anatomy, edit_dir, record):
    model = ToyFlowModel.from_pretrained(edit_dir)
    records = [record, *[r for r in edit_split("edit_train")][:2]]
    ode = anatomy.window_signal(model, records, group=3, start=None, noise_level=0.7,
                                shared=True, num_steps=4, seed=0)
    assert ode["no_signal"] == 1.0 and ode["within_std"] == 0.0
    # the same rows through the SDE window: a fixed generator gives the same numbers twice
    first = anatomy.window_signal(model, records, group=3, start=0, noise_level=0.7,
                                  shared=True, num_steps=4, seed=0)
    assert first == anatomy.window_signal(model, records, group=3, start=0, noise_level=0.7,
                                          shared=True, num_steps=4, seed=0)
    assert 0.0 <= first["no_signal"] <= 1.0


def test_window_sampler_without_window_is_the_euler_sampler(anatomy, edit_dir, record):
    """start None is sample_ode's Euler trajectory exactly (the probe's reference row)."""
    from flowgrpo.rollout import sample_ode

    model = ToyFlowModel.from_pretrained(edit_dir)
    noise = model.initial_noise(2, torch.Generator().manual_seed(3))
    cond = model.encode_prompts([record["prompt"]] * 2, images=[record["image"]] * 2)
    ours = anatomy.sample_with_window(model, cond, noise, None, 0.7, 4, torch.Generator())
    reference = sample_ode(model, [record["prompt"]] * 2, noise, 4, 1.0,
                           images=[record["image"]] * 2)
    torch.testing.assert_close(ours, reference)
    noisy = anatomy.sample_with_window(model, cond, noise, 0, 0.7, 4,
                                       torch.Generator().manual_seed(0))
    assert not torch.allclose(noisy, reference)
    # the window is steps [start, start + 4): one starting past the last step is the ODE, one
    # starting at the last step is not
    past = anatomy.sample_with_window(model, cond, noise, 4, 0.7, 4, torch.Generator().manual_seed(0))
    torch.testing.assert_close(past, reference)
    last = anatomy.sample_with_window(model, cond, noise, 3, 0.7, 4, torch.Generator().manual_seed(0))
    assert not torch.allclose(last, reference)
