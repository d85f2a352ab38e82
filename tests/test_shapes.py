"""The toy GenEval world: grammar, split, renderer and verifier quality."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from scipy import ndimage

from flowgrpo.toyworld import grammar
from flowgrpo.toyworld import render as scenes
from flowgrpo.toyworld import verify as verifier
from flowgrpo.toyworld.grammar import (COLORS, FAMILIES, SHAPES, parse_prompt, prompt_split,
                                       random_caption)
from flowgrpo.toyworld.render import render
from flowgrpo.toyworld.verify import DetectedObject, verify
from reward_models.base import REGISTRY
from reward_models.geneval_toy import GenevalToyReward

SAMPLES_PER_FAMILY = 40


def _by_family(split: str = "all") -> dict[str, list[dict]]:
    pools: dict[str, list[dict]] = {f: [] for f in FAMILIES}
    for item in prompt_split(split):
        pools[item["metadata"]["family"]].append(item)
    return pools


def _draws(family: str, seed: int) -> list[tuple[dict, np.random.Generator]]:
    rng = np.random.default_rng(seed)
    pool = _by_family()[family]
    return [(pool[int(rng.integers(len(pool)))]["metadata"], rng) for _ in range(SAMPLES_PER_FAMILY)]


def _like_generator_output(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Mild Gaussian blur (0.6 px) and Gaussian noise (std 0.08), as a generator's output."""
    blurred = ndimage.gaussian_filter(image, sigma=(0, 0.6, 0.6))
    return np.clip(blurred + rng.normal(0, 0.08, image.shape), 0, 1).astype(np.float32)


def _negatives(metadata: dict) -> list[tuple[str, dict]]:
    """Perturbed copies of ``metadata`` that violate exactly one kind of requirement."""
    out = []
    objects = metadata["objects"]
    wrong_count = copy.deepcopy(metadata)
    n = objects[0]["count"]
    wrong_count["objects"][0]["count"] = n + 1 if n < 4 and sum(o["count"] for o in objects) < 4 else n - 1
    if wrong_count["objects"][0]["count"] >= 1:
        out.append(("count", wrong_count))
    wrong_shape = copy.deepcopy(metadata)
    taken = {o["shape"] for o in objects}
    wrong_shape["objects"][0]["shape"] = next(s for s in SHAPES if s not in taken)
    out.append(("shape", wrong_shape))
    if objects[0]["color"] is not None:
        wrong_color = copy.deepcopy(metadata)
        if len(objects) == 2:   # colour attribution: the colours swap shapes
            wrong_color["objects"][0]["color"], wrong_color["objects"][1]["color"] = (
                objects[1]["color"], objects[0]["color"])
        else:
            wrong_color["objects"][0]["color"] = next(c for c in COLORS if c != objects[0]["color"])
        out.append(("color", wrong_color))
    if metadata["relation"]:
        opposite = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
        wrong_relation = copy.deepcopy(metadata)
        wrong_relation["relation"] = opposite[metadata["relation"]]
        out.append(("relation", wrong_relation))
    return out


def test_split_is_deterministic_disjoint_and_covers_every_family():
    train, heldout, everything = prompt_split("train"), prompt_split("heldout"), prompt_split("all")
    train_prompts = {item["prompt"] for item in train}
    heldout_prompts = {item["prompt"] for item in heldout}
    assert not train_prompts & heldout_prompts
    assert train_prompts | heldout_prompts == {item["prompt"] for item in everything}
    assert len(everything) == 750 and len(heldout) == 197
    held = {f: sum(i["metadata"]["family"] == f for i in heldout) for f in FAMILIES}
    assert held == {"single_object": 3, "two_object": 8, "counting": 8, "colors": 8, "position": 20,
                    "color_attr": 150}
    assert [i["prompt"] for i in prompt_split("heldout")] == [i["prompt"] for i in heldout]
    for family in FAMILIES:
        assert any(i["metadata"]["family"] == family for i in train)
        assert any(i["metadata"]["family"] == family for i in heldout)
    with pytest.raises(ValueError, match="split"):
        prompt_split("test")


def test_parse_prompt_inverts_the_grammar_for_every_prompt():
    for item in prompt_split("all"):
        assert parse_prompt(item["prompt"]) == item["metadata"]
    assert parse_prompt("a red circle and a blue square")["family"] == "color_attr"
    assert parse_prompt("a circle left of a square")["relation"] == "left of"
    with pytest.raises(ValueError, match="colour"):
        parse_prompt("a purple circle")


def test_random_caption_mix_starves_no_family():
    rng = np.random.default_rng(0)
    families = [random_caption(rng)["metadata"]["family"] for _ in range(3000)]
    shares = {f: families.count(f) / len(families) for f in FAMILIES}
    assert min(shares.values()) >= 0.08, shares
    only = {random_caption(rng, {"counting": 1.0})["metadata"]["family"] for _ in range(50)}
    assert only == {"counting"}
    with pytest.raises(ValueError, match="family_weights"):
        random_caption(rng, {"countin": 1.0})


def test_render_is_deterministic_with_its_rng_and_in_range():
    meta = parse_prompt("three cyan squares")
    a = render(meta, 24, np.random.default_rng(3))
    b = render(meta, 24, np.random.default_rng(3))
    assert a.shape == (3, 24, 24) and a.dtype == np.float32
    assert np.array_equal(a, b) and a.min() >= 0 and a.max() <= 1
    assert not np.array_equal(a, render(meta, 24, np.random.default_rng(4)))
    with pytest.raises(ValueError, match="layout"):
        render(meta, 24, np.random.default_rng(3), layout="scattered")
    # only the prompt's colour and black appear
    colours = {tuple(px) for px in a.reshape(3, -1).T.tolist()}
    assert colours == {(0.0, 0.0, 0.0), grammar.PALETTE["cyan"]}


@pytest.mark.parametrize("layout", scenes.LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_verifier_accepts_rendered_positives(family, layout):
    accepted = [verifier.score_image(render(meta, 24, rng, layout), meta).exact
                for meta, rng in _draws(family, 1)]
    assert np.mean(accepted) >= 0.99


@pytest.mark.parametrize("layout", scenes.LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_verifier_accepts_blurred_noisy_positives(family, layout):
    accepted = [verifier.score_image(_like_generator_output(render(meta, 24, rng, layout), rng), meta).exact
                for meta, rng in _draws(family, 2)]
    assert np.mean(accepted) >= 0.97


@pytest.mark.parametrize("layout", scenes.LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_verifier_rejects_rendered_negatives(family, layout):
    rejected = {}
    for meta, rng in _draws(family, 3):
        for kind, wrong in _negatives(meta):
            verdict = verifier.score_image(render(wrong, 24, rng, layout), meta)
            rejected.setdefault(kind, []).append(verdict.exact == 0.0 and verdict.partial < 1.0)
    assert {"count", "shape"} <= set(rejected)
    for kind, flags in rejected.items():
        assert np.mean(flags) >= 0.99, (kind, np.mean(flags))


def test_partial_credit_is_the_share_of_requirements_met_and_monotone():
    meta = parse_prompt("a red circle left of a blue square")
    # position prompts carry no colours, so use attributes and a relation together
    meta["objects"][0]["color"], meta["objects"][1]["color"] = "red", "blue"
    right = [DetectedObject("circle", "red", 5.0, 12.0, 30), DetectedObject("square", "blue", 18.0, 12.0, 30)]
    scenes = [
        right,                                                        # all 8 requirements
        [right[0], DetectedObject("square", "blue", 3.0, 12.0, 30)],  # relation broken
        [right[0], DetectedObject("square", "green", 3.0, 12.0, 30)],  # + colour, count of square
        [DetectedObject("triangle", "red", 5.0, 12.0, 30),
         DetectedObject("square", "green", 3.0, 12.0, 30)],          # + circle gone
        [],                                                           # nothing at all
    ]
    verdicts = [verify(scene, meta) for scene in scenes]
    n_req = len(verdicts[0].requirements)
    assert n_req == 8
    for v in verdicts:
        assert v.partial == pytest.approx(sum(v.requirements.values()) / n_req)
    partials = [v.partial for v in verdicts]
    assert partials == sorted(partials, reverse=True) and len(set(partials)) == len(partials)
    assert verdicts[0].exact == 1.0 and partials[0] == 1.0
    assert all(v.exact == 0.0 for v in verdicts[1:]) and partials[-1] == 0.0


def test_reward_scores_from_metadata_or_plain_prompts_and_is_registered():
    assert REGISTRY["geneval_toy"] == "reward_models.geneval_toy:GenevalToyReward"
    rng = np.random.default_rng(5)
    prompts = ["a red circle and a blue square", "two triangles", "a square above a circle"]
    metas = [parse_prompt(p) for p in prompts]
    good = torch.from_numpy(np.stack([render(m, 24, rng) for m in metas]))
    swapped = torch.from_numpy(render(parse_prompt("a blue circle and a red square"), 24, rng))[None]
    media = torch.cat([good, swapped, torch.zeros(1, 3, 24, 24)])
    all_prompts = prompts + [prompts[0], prompts[1]]
    exact = GenevalToyReward(score="exact")
    partial = GenevalToyReward()
    from_meta = exact(media, all_prompts, metas + [metas[0], metas[1]])
    from_text = exact(media, all_prompts, [{}] * 5)
    assert from_meta.dtype == torch.float32 and from_meta.shape == (5,)
    assert from_meta.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert torch.equal(from_meta, from_text)
    scores = partial(media, all_prompts, None)
    assert scores[:3].tolist() == [1.0, 1.0, 1.0]
    assert 0.0 < scores[3] < 1.0 and scores[4] == 0.0      # swapped colours keep the shapes
    components = partial.components(media, all_prompts, None)
    assert torch.equal(components["exact"], from_meta) and torch.equal(components["partial"], scores)
    video = media[:2, None].expand(2, 3, 3, 24, 24)
    assert exact(video, all_prompts[:2], None).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="score"):
        GenevalToyReward(score="binary")


@pytest.mark.parametrize("family", FAMILIES)
def test_near_miss_changes_one_requirement_and_never_passes(family):
    """Caption noise: a near miss differs from its prompt in exactly one object field or the
    relation, its render passes the near miss and fails the prompt."""
    rng = np.random.default_rng(7)
    kinds = set()
    for meta, _ in _draws(family, 4):
        wrong = grammar.near_miss(meta, rng)
        assert wrong["family"] == meta["family"] and meta == parse_prompt(grammar.make_prompt(meta))
        changed = [(i, key) for i, (a, b) in enumerate(zip(meta["objects"], wrong["objects"]))
                   for key in a if a[key] != b[key]]
        relation_changed = wrong["relation"] != meta["relation"]
        kinds.add("relation" if relation_changed else "+".join(sorted({k for _, k in changed})))
        assert relation_changed + len(changed) in (1, 2)   # a colour swap changes two colours
        if len(changed) == 2:
            assert {k for _, k in changed} == {"color"} and len(meta["objects"]) == 2
        image = render(wrong, 24, rng)
        assert verifier.score_image(image, wrong).exact == 1.0
        assert verifier.score_image(image, meta).exact == 0.0
    expected = {"single_object": {"shape"}, "two_object": {"shape"}, "counting": {"count", "shape"},
                "colors": {"color", "shape"}, "position": {"relation", "shape"},
                "color_attr": {"color", "shape"}}[family]
    assert kinds == expected


def test_grid_layout_puts_two_objects_where_the_prompt_says():
    rng = np.random.default_rng(11)
    for prompt, axis, first_lower in [("a circle and a square", 0, True),
                                      ("a red wedge and a blue rectangle", 0, True),
                                      ("a circle right of a square", 0, False),
                                      ("a triangle above a square", 1, True),
                                      ("a triangle below a wedge", 1, False)]:
        meta = parse_prompt(prompt)
        for _ in range(20):
            first, second = scenes.place_scene(meta, 24, rng)
            a, b = (first.cx, second.cx) if axis == 0 else (first.cy, second.cy)
            assert (a < 12 < b) if first_lower else (b < 12 < a), prompt
