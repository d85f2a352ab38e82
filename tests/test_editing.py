"""Image editing as a first-class input: prompt records with a source image, the toy world's edit
splits and exact edit reward, an editing toy model that sees the source image, and the rollout,
replay, evaluation and grids passing the image through."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.config import InputError, load_config
from flowgrpo.pixels import to_uint8
from flowgrpo.prompts import load_prompts, record_images, reward_metadata
from flowgrpo.toyworld.editing import edit_split, render_pair
from flowgrpo.toyworld.grammar import COLORS
from flowgrpo.toyworld.render import draw, place_scene
from pipelines.toy import ToyArchitecture, ToyFlowModel, build_toy_model, to_editing_model
from reward_models.toy_edit import ToyEditReward
from tests.helpers import edit_config

ROOT = Path(__file__).resolve().parent.parent
TINY = ToyArchitecture(num_layers=2, num_attention_heads=2, attention_head_dim=8, text_hidden_size=16,
                       text_heads=2, pooled_dim=16)


@pytest.fixture(scope="module")
def edit_model(edit_dir) -> ToyFlowModel:
    return ToyFlowModel.from_pretrained(edit_dir)


def test_edit_splits_are_deterministic_disjoint_and_carry_a_source_image():
    train, heldout = load_prompts("toy:edit_train"), load_prompts("toy:edit_heldout")
    assert len(train) == 472 and len(heldout) == 158
    sources = lambda rs: {json.dumps(r["metadata"]["source"], sort_keys=True) for r in rs}  # noqa: E731
    assert not sources(train) & sources(heldout)
    again = edit_split("edit_heldout")
    for a, b in zip(heldout, again):
        assert a["prompt"] == b["prompt"] and torch.equal(a["image"], b["image"])
    record = heldout[0]
    assert record["image"].shape == (3, 24, 24) and record["image"].dtype == torch.float32
    assert record["prompt"].startswith("make the ")
    meta = record["metadata"]
    source_image, _ = render_pair(meta["source"], meta["edit"], meta["layout_seed"])
    assert np.array_equal(source_image, record["image"].numpy())


def test_jsonl_image_is_a_path_relative_to_the_file(tmp_path):
    folder = tmp_path / "data"
    (folder / "img").mkdir(parents=True)
    pixels = np.random.default_rng(0).integers(0, 256, (8, 6, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(folder / "img" / "a.png")
    path = folder / "edits.jsonl"
    path.write_text(json.dumps({"prompt": "make it red", "image": "img/a.png",
                                "metadata": {"k": 1}}) + "\n" + json.dumps({"prompt": "plain"}) + "\n")
    records = load_prompts(str(path))
    assert records[0]["image"].shape == (3, 8, 6)
    assert np.array_equal(to_uint8(records[0]["image"]), pixels)   # exact uint8 round trip
    assert "image" not in records[1]
    with pytest.raises(ValueError, match="some prompt records have a source"):
        record_images(records)
    assert reward_metadata(records)[0]["source_image"] is records[0]["image"]
    path.write_text(json.dumps({"prompt": "x", "image": "img/missing.png"}) + "\n")
    with pytest.raises(InputError, match=r"edits.jsonl:1: image .*missing.png does not exist"):
        load_prompts(str(path))


def test_edit_reward_sees_the_source_image():
    """Right edit: exact 1. The unedited source, another object recoloured, or the right scene
    with the objects moved: exact 0 (the reward compares with the source image)."""
    reward = ToyEditReward(score="exact")
    records = load_prompts("toy:edit_heldout")
    two = [r for r in records if r["metadata"]["family"] == "recolor_two"][:6]
    targets, moved, wrong = [], [], []
    for r in two:
        meta = r["metadata"]
        _, target = render_pair(meta["source"], meta["edit"], meta["layout_seed"])
        targets.append(torch.from_numpy(target))
        # the right scene with the edited object moved 3 px (vertically, towards the centre)
        placed = place_scene(meta["source"], 24, np.random.default_rng(meta["layout_seed"]))
        for p in placed:
            if p.shape == meta["edit"]["shape"]:
                p.color, p.cy = meta["edit"]["color"], p.cy + (3.0 if p.cy < 12 else -3.0)
        moved.append(torch.from_numpy(draw(placed, 24)))
        other = next(o for o in meta["source"]["objects"] if o["shape"] != meta["edit"]["shape"])
        wrong_edit = {"kind": "recolor", "shape": other["shape"], "color": meta["edit"]["color"]}
        _, bad = render_pair(meta["source"], wrong_edit, meta["layout_seed"])
        wrong.append(torch.from_numpy(bad))
    prompts = [r["prompt"] for r in two]
    metadata = reward_metadata(two)
    assert reward(torch.stack(targets), prompts, metadata).tolist() == [1.0] * 6
    assert reward(torch.stack([r["image"] for r in two]), prompts, metadata).tolist() == [0.0] * 6
    assert reward(torch.stack(wrong), prompts, metadata).tolist() == [0.0] * 6
    parts = reward.components(torch.stack(moved), prompts, metadata)
    assert parts["target"].tolist() == [1.0] * 6          # the target scene, but
    assert parts["exact"].tolist() == [0.0] * 6           # not where the source had it
    assert parts["kept"].tolist() == [0.5] * 6
    with pytest.raises(ValueError, match="source_image"):
        reward(torch.stack(targets), prompts, [r["metadata"] for r in two])


def test_recolored_judges_the_edited_object_alone():
    """``recolored`` (the edit region's own verdict) is 1 when the named object has the asked
    colour at its place, whatever the other object does: the right edit, and the right edit with
    the other object recoloured too (where ``target`` and ``kept`` fail); 0 for the source, the
    other object recoloured instead, and the named object recoloured but moved 3 px."""
    reward = ToyEditReward(score="recolored")
    two = [r for r in load_prompts("toy:edit_heldout")
           if r["metadata"]["family"] == "recolor_two"][:6]
    cases = {"right": [], "both": [], "other": [], "moved": []}
    for r in two:
        meta = r["metadata"]
        other = next(o for o in meta["source"]["objects"] if o["shape"] != meta["edit"]["shape"])
        taken = {meta["edit"]["color"], *(o["color"] for o in meta["source"]["objects"])}
        free = next(c for c in COLORS if c not in taken)
        placed = place_scene(meta["source"], 24, np.random.default_rng(meta["layout_seed"]))
        variants = {name: [copy.copy(p) for p in placed] for name in cases}
        for name, scene in variants.items():
            for p in scene:
                if p.shape == meta["edit"]["shape"] and name != "other":
                    p.color = meta["edit"]["color"]
                    if name == "moved":
                        p.cy = p.cy + (3.0 if p.cy < 12 else -3.0)
                elif p.shape != meta["edit"]["shape"] and name in ("both", "other"):
                    p.color = free
            cases[name].append(torch.from_numpy(draw(scene, 24)))
    prompts, metadata = [r["prompt"] for r in two], reward_metadata(two)
    parts = {name: reward.components(torch.stack(images), prompts, metadata)
             for name, images in cases.items()}
    assert parts["right"]["recolored"].tolist() == [1.0] * 6
    assert parts["both"]["recolored"].tolist() == [1.0] * 6
    assert parts["both"]["target"].tolist() == [0.0] * 6
    assert parts["both"]["kept"].tolist() == [0.5] * 6
    assert parts["other"]["recolored"].tolist() == [0.0] * 6
    assert parts["moved"]["recolored"].tolist() == [0.0] * 6
    source = reward(torch.stack([r["image"] for r in two]), prompts, metadata)
    assert source.tolist() == [0.0] * 6


def test_preserved_is_the_colour_change_over_the_other_objects_alone():
    """``preserved`` = 1 - mean over the record's keep_mask of max_c |output - source|: every
    channel of every kept pixel moved by 0.2 gives 0.8 exactly, whatever happens in the edit
    region and the background; the target gives 1; a one-object edit (nothing to keep) gives 1
    for any output."""
    reward = ToyEditReward(score="preserved")
    records = load_prompts("toy:edit_heldout")
    two = [r for r in records if r["metadata"]["family"] == "recolor_two"][:4]
    one = [r for r in records if r["metadata"]["family"] == "recolor_one"][:2]
    shifted, targets = [], []
    for r in two:
        meta = r["metadata"]
        source, target = render_pair(meta["source"], meta["edit"], meta["layout_seed"])
        keep = r["keep_mask"][0].numpy() > 0
        out = np.ones_like(source)                     # edit region and background: white
        moved = np.where(source >= 0.2, source - 0.2, source + 0.2)
        out[:, keep] = moved[:, keep]
        shifted.append(torch.from_numpy(out))
        targets.append(torch.from_numpy(target))
    prompts, metadata = [r["prompt"] for r in two], reward_metadata(two)
    assert reward(torch.stack(shifted), prompts, metadata).tolist() == \
        pytest.approx([0.8] * 4, abs=1e-6)
    assert reward(torch.stack(targets), prompts, metadata).tolist() == [1.0] * 4
    noise = torch.rand(2, 3, 24, 24, generator=torch.Generator().manual_seed(0))
    assert reward(noise, [r["prompt"] for r in one], reward_metadata(one)).tolist() == [1.0] * 2
    bare = [{k: v for k, v in m.items() if k != "layout_seed"} for m in metadata]
    with pytest.raises(ValueError, match=r"preserved score .*'layout_seed'"):
        reward(torch.stack(targets), prompts, bare)


def test_changing_only_the_source_image_changes_the_output(edit_model, edit_dir):
    records = load_prompts("toy:edit_heldout")[:2]
    prompts = [records[0]["prompt"]] * 2
    images = [records[0]["image"], records[1]["image"]]
    cond = edit_model.encode_prompts(prompts, images=images)
    assert cond.positive["source_latents"].shape == (2, 3, 24, 24)
    assert torch.equal(cond.select([1, 1]).positive["source_latents"][0],
                       cond.positive["source_latents"][1])
    x = torch.randn(1, 3, 24, 24).expand(2, -1, -1, -1)
    with torch.no_grad():
        v = edit_model.velocity(x, torch.full((2,), 0.7), cond, 1.0)
        v_cfg = edit_model.velocity(x, torch.full((2,), 0.7), cond, 3.0)
    assert not torch.allclose(v[0], v[1])             # same prompt and noise, other source image
    assert not torch.allclose(v_cfg[0], v_cfg[1])     # also through the CFG branch
    assert edit_model.supports_images
    with pytest.raises(ValueError, match="one source image per prompt"):
        edit_model.encode_prompts(prompts)
    plain = build_toy_model(TINY, seed=0)
    assert not plain.supports_images
    with pytest.raises(ValueError, match="cannot take source images"):
        plain.encode_prompts(prompts, images=images)
    # A fresh conversion starts as the base: zero source weights ignore the image.
    base = build_toy_model(TINY, seed=0)
    fresh = to_editing_model(base)
    cond = fresh.encode_prompts(prompts, images=images)
    with torch.no_grad():
        v = fresh.velocity(x, torch.full((2,), 0.7), cond, 1.0)
    assert torch.equal(v[0], v[1])


@pytest.mark.parametrize("plan", [["sampling.plan.kind=full"],
                                  ["sampling.plan.kind=branch", "sampling.plan.window_size=2"]])
def test_first_pass_ratio_is_exactly_one_with_images(plan, edit_dir, tmp_path):
    """A whole editing iteration: rollout with the source images, the reward reading them, the
    replay re-encoding (prompt, image) rows, evaluation on held-out edits."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(edit_config(edit_dir, tmp_path, *plan))
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] > 0
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    assert 0.0 <= metrics["reward/toy_edit/mean"] <= 1.0
    evals = trainer.evaluate(0)
    assert 0.0 <= evals["eval/toy_edit.exact"] <= 1.0


def test_replay_condition_is_per_prompt_and_image(edit_model):
    """Two rows with the same instruction and different source images get different
    conditioning (a cache per prompt string would give both the first image)."""
    from flowgrpo.rollout import encode_rows

    records = load_prompts("toy:edit_heldout")[:2]
    prompts = [records[0]["prompt"]] * 3
    images = [records[0]["image"], records[1]["image"], records[0]["image"]]
    cond, index = encode_rows(edit_model, prompts, images)
    assert index.tolist() == [0, 1, 0] and cond.batch_size == 2
    rows = cond.select(index).positive["source_latents"]
    assert torch.equal(rows[1], 2 * records[1]["image"] - 1)


def test_grid_shows_the_source_image_as_the_first_column(edit_dir, tmp_path):
    from flowgrpo.cli import main

    records = load_prompts("toy:edit_heldout")[:3]
    folder = tmp_path / "prompts"
    folder.mkdir()
    lines = []
    for i, r in enumerate(records):
        Image.fromarray(to_uint8(r["image"])).save(folder / f"{i}.png")
        lines.append(json.dumps({"prompt": r["prompt"], "image": f"{i}.png",
                                 "metadata": r["metadata"]}))
    (folder / "edits.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "grid" / "grid.png"
    assert main(["grid", "--model", f"toy:{edit_dir}", "--prompts", str(folder / "edits.jsonl"),
                 "--seeds", "0", "--steps", "2", "--guidance", "1", "--checkpoints", "base",
                 "--rewards", "toy_edit", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out.parent / "grid.json").read_text())
    assert summary["source_column"] is True
    page = summary["pages"][0]
    pixels = np.array(Image.open(out.parent / page["file"]).convert("RGB"))
    scale = page["scale"]
    for row, record in enumerate(records):
        left, top, right, bottom = page["cells"][row][0]
        assert np.array_equal(pixels[top:bottom:scale, left:right:scale], to_uint8(record["image"]))
        left, top, right, bottom = page["cells"][row][1]
        assert not np.array_equal(pixels[top:bottom:scale, left:right:scale],
                                  to_uint8(record["image"]))
    assert set(summary["rewards"]["base"]) >= {"toy_edit.exact", "toy_edit.kept"} or \
        summary["rewards"]["base"]


def test_training_comparison_grid_starts_with_the_source_column(edit_dir, tmp_path, monkeypatch):
    import flowgrpo.grids as grids
    from flowgrpo.trainer import Trainer

    seen = {}
    original = grids.image_grid

    def spy(images, row_labels=None, col_labels=None, cell_labels=None, **kwargs):
        seen.update(images=images, col_labels=col_labels)
        return original(images, row_labels, col_labels, cell_labels, **kwargs)

    monkeypatch.setattr(grids, "image_grid", spy)
    trainer = Trainer(edit_config(edit_dir, tmp_path))
    trainer.run_dir.mkdir(parents=True, exist_ok=True)   # train() makes it; called directly here
    trainer.save_grid_samples("base")
    path = trainer.write_comparison_grid()
    assert path is not None and path.is_file()
    records = trainer.grid_records()
    assert seen["col_labels"][0] == "source" and seen["images"].shape[1] == 3
    for row, record in enumerate(records):
        assert torch.equal(seen["images"][row, 0], record["image"])


def load_pretrain_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_toy_edit",
                                                  ROOT / "scripts" / "pretrain_toy_edit.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize("other_share", [0.0, 0.5, 1.0])
def test_near_misses_recolour_the_other_object_at_the_asked_share(other_share):
    """--other-object-share: of the two-object near misses, that share recolours the other object
    (in the asked colour), the rest the named object in a colour no object has and not the asked
    one; one-object near misses are always the named object in another colour."""
    import random

    script = load_pretrain_script()
    rng = random.Random(0)
    sources = [r["metadata"]["source"] for r in load_prompts("toy:edit_train")]
    other, counts = 0, {1: 0, 2: 0}
    for i in range(600):
        source = sources[i % len(sources)]
        edit = script.choose_edit(source, rng)
        miss = script.near_miss_edit(source, edit, rng, other_share)
        counts[len(source["objects"])] += 1
        if miss["shape"] != edit["shape"]:
            assert len(source["objects"]) == 2 and miss["color"] == edit["color"]
            other += 1
        else:
            taken = {o["color"] for o in source["objects"]}
            assert miss["color"] != edit["color"] and miss["color"] not in taken
    share = other / counts[2]
    assert abs(share - other_share) < 0.07, (share, counts)
    with pytest.raises(SystemExit):
        script.parse_args(["--out", "x", "--minutes", "1", "--other-object-share", "1.5"])


def test_pretraining_continues_an_editing_model(edit_dir, tmp_path):
    """scripts/pretrain_toy_edit.py --base <an editing model> trains that model further: the saved
    model keeps its 6 input channels and its vocabulary (made an editing model once, not twice),
    its weights moved from the start, and the start's provenance is kept under continued_from."""
    script = load_pretrain_script()
    start = ToyFlowModel.from_pretrained(edit_dir)
    start.defaults.extra = {"command": "the first stage", "steps": 7}
    start.save_pretrained(str(tmp_path / "first"))
    out = tmp_path / "continued"
    script.main(["--base", str(tmp_path / "first"), "--out", str(out), "--minutes", "5",
                 "--max-steps", "3", "--batch-size", "4", "--warmup-steps", "1"])
    continued = ToyFlowModel.from_pretrained(str(out))
    assert continued.transformer.config.in_channels == 6 and continued.supports_images
    assert continued.tokenizer.get_vocab() == start.tokenizer.get_vocab()
    before = start.transformer.pos_embed.proj.weight
    after = continued.transformer.pos_embed.proj.weight
    assert after.shape == before.shape and not torch.equal(after, before)
    assert continued.defaults.extra["steps"] == 3
    assert continued.defaults.extra["continued_from"] == {"command": "the first stage", "steps": 7}


# Measured with the test's own settings, 2026-12-03 (2 threads, nothing else running; 4 min 4 s):
# exact 0.328 -> 0.417 (+8.9 points), kept 0.867 -> 0.878; the same settings on training seed 1
# (one thread): 0.240 -> 0.354 (+11.5), kept 0.849 -> 0.857. The threshold asks two thirds of the
# smaller gain; kept may fall at most the 2 points. The test guards learning and `kept`,
# not the source term itself: with training.locality.keep_source_beta=0 the same settings gave
# +10.4, kept -0.8 (it would pass); the term has its own tests in tests/test_locality.py. The full config (100 iterations) gains +16.2
# (docs/toy_world.md).
EDIT_TEST_ITERATIONS = 40
MEASURED = "measured 2026-12-03: exact 0.328 -> 0.417, kept 0.867 -> 0.878"
GAIN_THRESHOLD = 0.06
KEPT_TOLERANCE = 0.02


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "assets" / "toy_edit" / "transformer").is_dir(),
                    reason="assets/toy_edit is not built")
def test_toy_edit_run_raises_held_out_edit_accuracy(tmp_path):
    """configs/toy_edit.yaml as shipped but 40 iterations (the lr schedule over 40), evaluated at
    iterations 0 and 40 on 192 held-out edits (96 per family, source scenes RL never trains on;
    one standard error of one evaluation is about 3 points, the two share their noise).
    Run: .venv/bin/python -m pytest -q -m slow tests/test_editing.py -k held_out -s"""
    from flowgrpo.trainer import Trainer

    config = load_config(ROOT / "configs" / "toy_edit.yaml", [
        f"model.path={ROOT / 'assets' / 'toy_edit'}", f"run.output_dir={tmp_path}",
        "run.tracker=none", "run.progress=false", "run.comparison_grid=false",
        "run.checkpoint_every=0", f"run.max_iterations={EDIT_TEST_ITERATIONS}",
        f"run.eval_every={EDIT_TEST_ITERATIONS}", "prompts.eval_per_family=96"])
    evals = [h for h in Trainer(config).train() if h["phase"] == "eval"]
    exact = [h["eval/toy_edit.exact/family_mean"] for h in evals]
    kept = [h["eval/toy_edit.kept/family_mean"] for h in evals]
    print("held-out exact edit accuracy (family mean) at iterations 0 and "
          f"{EDIT_TEST_ITERATIONS}:", exact, "kept:", kept)
    assert [h["iteration"] for h in evals] == [0, EDIT_TEST_ITERATIONS]
    assert exact[1] - exact[0] >= GAIN_THRESHOLD, (exact, MEASURED)
    assert kept[1] >= kept[0] - KEPT_TOLERANCE, (kept, MEASURED)


def test_remote_edit_reward_receives_the_source_image():
    """An editing reward behind the reward server: the client sends each row's source image as a
    PNG in the metadata and the server hands it back as a tensor, so the scores equal local ones."""
    from reward_models import load_reward
    from reward_models.server import ServerLimits, make_server, start_in_thread

    server = make_server("toy_edit", port=0, token="t0ken", limits=ServerLimits(max_batch=4))
    start_in_thread(server)
    try:
        records = [r for r in load_prompts("toy:edit_heldout")
                   if r["metadata"]["family"] == "recolor_two"][:6]
        outputs = []
        for i, r in enumerate(records):
            meta = r["metadata"]
            _, target = render_pair(meta["source"], meta["edit"], meta["layout_seed"])
            outputs.append(torch.from_numpy(target) if i % 2 == 0 else r["image"])
        media, prompts = torch.stack(outputs), [r["prompt"] for r in records]
        metadata = reward_metadata(records)
        client = load_reward({"name": "remote", "url": server.url, "token": "t0ken", "timeout": 20})
        remote_scores = client(media, prompts, metadata)
        assert remote_scores.tolist() == ToyEditReward()(media, prompts, metadata).tolist()
        assert remote_scores[0::2].min() > remote_scores[1::2].max()
    finally:
        server.shutdown()
        server.server_close()


# The editing probe whose records back configs/toy_edit_nft.yaml (benchmarks/COMMANDS.md,
# #edit-nft): toy_edit.yaml with these overrides and a seed.
EDIT_NFT_PROBE = [
    "training.algorithm=nft", "sampling.plan={kind: ode, solver_after: euler}",
    "training.locality={mask: 'off'}", "training.lr=8.0e-4",
    "training.gradient_accumulation_steps=0", "training.optimizer_steps_per_epoch=2",
    "training.adv_clip=5.0", "training.kl_beta=1.0e-4", "training.skip_zero_std_groups=false",
    "training.timesteps={count: 2, sampling: discrete, fraction: 0.6}",
    "training.anchor_beta=10.0", "training.anchor_sigma_max=0.45",
    "training.nft={beta: 1.0, old_flat_steps: 0, old_ramp_rate: 0.001, old_max_decay: 0.5}"]


def test_the_nft_editing_config_is_the_measured_probe():
    """configs/toy_edit_nft.yaml trains what its records measured: field for field the editing
    default with the probe's overrides (only the name differs), and the probe's command in
    benchmarks/COMMANDS.md carries every override."""
    from flowgrpo.config import to_dict

    probe = to_dict(load_config("configs/toy_edit.yaml", EDIT_NFT_PROBE))
    shipped = to_dict(load_config("configs/toy_edit_nft.yaml"))
    assert shipped.pop("name") == "toy_edit_nft" and probe.pop("name") == "toy_edit"
    assert shipped == probe
    commands = Path("benchmarks/COMMANDS.md").read_text()
    section = commands[commands.index('<a id="edit-nft">'):]
    flat = " ".join(section.replace("\\\n", " ").split())
    for override in EDIT_NFT_PROBE:
        assert override.replace("'", "") in flat.replace("'", "").replace('"', ""), override
    records = sorted(Path("benchmarks/results/methods/guarded/edit_nft").glob("s*.json"))
    assert [json.loads(p.read_text())["seed"] for p in records] == [0, 1, 2]
