"""GDRO (training.algorithm: gdro) and offline Diffusion-DPO pairs (training.dpo.pairs_file):
GDRO's listwise losses against closed forms and a brute-force Plackett-Luce, the gradient's
direction, the order-only invariance; a pairs file's refusals (one line, at config load, before
the model), the pairs an iteration draws, the offline batch against the file, log 2 at the
reference, and offline training that raises the pairs' implicit reward margin."""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.algorithms.dpo import DiffusionDPO, OfflinePairs
from flowgrpo.algorithms.gdro import group_matrix
from flowgrpo.cli import main
from flowgrpo.config import InputError, load_config
from flowgrpo.matching_losses import (gdro_implicit_rewards, gdro_loss, noised_latents,
                                      velocity_error)
from flowgrpo.preference_pairs import iteration_pairs, read_pairs_file
from flowgrpo.prompts import load_image
from flowgrpo.seeding import seeded_generator
from flowgrpo.trainer import Trainer
from tests.helpers import tiny_config
from tests.test_algorithms import _algorithm

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ GDRO's loss


def _plackett_luce_brute_force(s: list[float], order: list[int]) -> float:
    """-log P(order) = -sum_k log [exp s_k / sum_{j not yet ranked} exp s_j], written out."""
    remaining, total = list(order), 0.0
    for member in order:
        total -= s[member] - math.log(sum(math.exp(s[j]) for j in remaining))
        remaining.remove(member)
    return total


@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_gdro_at_the_reference_is_log_k_factorial_and_log_k(k):
    """The policy is the reference: every implicit reward is 0, so every ranking of k members is
    equally likely (Plackett-Luce: log k!) and softmax(s) is uniform (cross-entropy: log k,
    whatever the target)."""
    error = torch.rand(1, k, dtype=torch.float64)
    implicit = gdro_implicit_rewards(error.flatten(), error.flatten(), beta=50.0).reshape(1, k)
    assert torch.equal(implicit, torch.zeros_like(implicit))
    rewards = torch.randn(1, k, dtype=torch.float64)
    valid = torch.ones(1, k, dtype=torch.bool)
    pl = gdro_loss(implicit, rewards, valid, tau=0.3, form="plackett_luce")
    ce = gdro_loss(implicit, rewards, valid, tau=0.3, form="cross_entropy")
    assert float(pl) == pytest.approx(math.log(math.factorial(k)), rel=1e-12)
    assert float(ce) == pytest.approx(math.log(k), rel=1e-12)


def test_gdro_losses_match_their_formulas_written_out():
    generator = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    r = torch.rand(3, 5, generator=generator, dtype=torch.float64)
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[2, 1] = False                     # a member without a finite reward
    r[2, 1] = float("nan")
    tau = 0.4
    pl = gdro_loss(s, r, valid, tau, "plackett_luce")
    ce = gdro_loss(s, r, valid, tau, "cross_entropy")
    for n in range(3):
        members = [i for i in range(5) if valid[n, i]]
        order = sorted(members, key=lambda i: -float(r[n, i]))
        assert float(pl[n]) == pytest.approx(_plackett_luce_brute_force(s[n].tolist(), order),
                                             rel=1e-10)
        target = torch.softmax(r[n, members] / tau, 0)
        expected = -(target * torch.log_softmax(s[n, members], 0)).sum()
        assert float(ce[n]) == pytest.approx(float(expected), rel=1e-10)
    # the Plackett-Luce likelihoods of all rankings of a group sum to 1
    members = list(range(4))
    total = sum(math.exp(-_plackett_luce_brute_force(s[0].tolist(), list(o)))
                for o in itertools.permutations(members))
    assert total == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("form", ["plackett_luce", "cross_entropy"])
def test_gdro_gradient_raises_the_implicit_reward_of_the_best_member(form):
    """One gradient step on the policy's errors (at the reference: e = e_ref) lowers the best
    member's error, i.e. raises its implicit reward, and lowers the worst one's; the loss drops."""
    error_ref = torch.tensor([0.50, 0.40, 0.60, 0.45], dtype=torch.float64)
    rewards = torch.tensor([[0.2, 0.9, 0.1, 0.5]], dtype=torch.float64)
    error = error_ref.clone().requires_grad_(True)
    valid = torch.ones(1, 4, dtype=torch.bool)

    def loss_of(e):
        return gdro_loss(gdro_implicit_rewards(e, error_ref, 10.0)[None], rewards, valid, 0.2,
                         form).sum()

    loss = loss_of(error)
    loss.backward()
    best, worst = int(rewards.argmax()), int(rewards.argmin())
    assert error.grad[best] > 0 and error.grad[worst] < 0   # descent lowers e_best
    stepped = (error - 1e-3 * error.grad).detach()
    implicit = gdro_implicit_rewards(stepped, error_ref, 10.0)
    assert implicit[best] > 0 and implicit[best] == implicit.max()
    assert implicit[worst] == implicit.min()
    assert float(loss_of(stepped)) < float(loss.detach())


def test_plackett_luce_uses_only_the_order_and_cross_entropy_the_values():
    generator = torch.Generator().manual_seed(1)
    s = torch.randn(2, 6, generator=generator, dtype=torch.float64)
    r = torch.rand(2, 6, generator=generator, dtype=torch.float64)
    valid = torch.ones(2, 6, dtype=torch.bool)
    transformed = torch.exp(5.0 * r) - 3.0            # strictly increasing
    assert torch.allclose(gdro_loss(s, r, valid, 0.5, "plackett_luce"),
                          gdro_loss(s, transformed, valid, 0.5, "plackett_luce"), rtol=1e-12)
    assert not torch.allclose(gdro_loss(s, r, valid, 0.5, "cross_entropy"),
                              gdro_loss(s, transformed, valid, 0.5, "cross_entropy"))
    # the cross-entropy's target is shift-invariant: softmax(r / tau) = softmax((r + c) / tau)
    assert torch.allclose(gdro_loss(s, r, valid, 0.5, "cross_entropy"),
                          gdro_loss(s, r + 7.0, valid, 0.5, "cross_entropy"), rtol=1e-12)


def test_gdro_drops_groups_of_fewer_than_two_members_and_has_finite_gradients():
    s = torch.zeros(2, 3, requires_grad=True)
    r = torch.tensor([[1.0, float("nan"), float("nan")], [0.3, 0.2, 0.1]])
    valid = torch.tensor([[True, True, True], [True, True, True]])
    for form in ("plackett_luce", "cross_entropy"):
        loss = gdro_loss(s, r, valid, 0.5, form)
        assert float(loss[0].detach()) == 0.0 and float(loss[1].detach()) > 0
        (grad,) = torch.autograd.grad(loss.sum(), s)
        assert torch.isfinite(grad).all() and torch.equal(grad[0], torch.zeros(3))


def test_group_matrix_lays_rows_out_by_group():
    values = torch.tensor([10.0, 11.0, 12.0, 13.0, 14.0])
    groups = torch.tensor([4, 4, 2, 2, 2])
    matrix, index, labels = group_matrix(values, groups)
    assert labels == [4, 2]
    assert index.tolist() == [[0, 1, -1], [2, 3, 4]]
    assert matrix[1].tolist() == [12.0, 13.0, 14.0]


def test_gdro_at_the_reference_on_tiny_sd3_is_log_g_factorial(tiny_sd3_path, tmp_path):
    """LoRA starts at zero, so the policy is the reference: each informative group's
    Plackett-Luce loss is log G! before the first step (one step per iteration), and the
    implicit rewards' margin is 0."""
    config = tiny_config(tiny_sd3_path, tmp_path, "run.max_iterations=1", "run.progress=false",
                         "run.comparison_grid=false", "prompts.eval=null", "sampling.num_steps=4",
                         *_algorithm("gdro"), "training.gdro.loss=plackett_luce",
                         "training.gradient_accumulation_steps=0", "training.group_size=4",
                         "training.prompts_per_iteration=2", "sampling.rollout_batch_size=4")
    train = [h for h in Trainer(config).train() if h["phase"] == "train"]
    share = train[0]["train/informative_groups"]
    assert share > 0
    # one group a unit: a unit's loss is log 4! if its group's rewards differ, else 0
    assert train[0]["train/policy_loss"] == pytest.approx(math.log(24.0) * share, rel=1e-5)
    assert train[0]["train/implicit_reward_best_margin"] == 0.0
    assert train[0]["train/optimizer_steps"] == 1


# ------------------------------------------------------------------ offline pairs: the file

def _image(path: Path, colour: tuple[int, int, int], size: int = 24, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour)[None, None] + rng.integers(-20, 20, (size, size, 3)), 0, 255)
    Image.fromarray(pixels.astype(np.uint8)).save(path)
    return path


def write_pairs(folder: Path, count: int = 3) -> Path:
    """A pairs file of ``count`` pairs: a reddish image chosen over a bluish one, per prompt."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        _image(folder / f"good{i}.png", (200, 40 + 20 * i, 40), seed=i)
        _image(folder / f"bad{i}.png", (40, 40, 200 - 20 * i), seed=10 + i)
        lines.append(f'{{"prompt": "a red cube {i}", "chosen": "good{i}.png", '
                     f'"rejected": "bad{i}.png"}}')
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory) -> str:
    """A tiny random text-to-image toy model (the toy's encode_images: pixels to latents); its
    zero-initialised weights made random so that its velocity depends on its input."""
    from pipelines.toy import ToyArchitecture, build_toy_model

    tiny = ToyArchitecture(num_layers=2, num_attention_heads=2, attention_head_dim=8,
                           text_hidden_size=16, text_heads=2, pooled_dim=16)
    model = build_toy_model(tiny, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.transformer.parameters():
            if param.abs().sum() == 0:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    path = str(tmp_path_factory.mktemp("toy_pairs_tiny"))
    model.save_pretrained(path)
    return path


def _toy(toy_dir: str, tmp_path: Path, *overrides: str):
    return load_config(ROOT / "configs" / "toy_geneval.yaml", overrides=[
        f"model.path={toy_dir}", f"run.output_dir={tmp_path / 'runs'}",
        "run.progress=false", "run.comparison_grid=false", "prompts.eval=null",
        "eval.rewards=[]", "training.prompts_per_iteration=2", "training.group_size=2",
        "sampling.num_steps=4", "sampling.rollout_batch_size=4",
        "training.gradient_accumulation_steps=0", "training.optimizer_steps_per_epoch=0",
        "model.lora={enabled: false}", *_algorithm("dpo"), *overrides])


def _bad(tmp_path: Path, name: str):
    """(pairs file, texts the error names) of one broken pairs file."""
    folder = tmp_path / name
    path = write_pairs(folder, 2)
    if name == "missing":
        path.unlink()
        return path, ("training.dpo.pairs_file", "does not exist")
    if name == "not_jsonl":
        other = path.with_suffix(".json")
        path.rename(other)
        return other, ("training.dpo.pairs_file", "not JSONL")
    if name == "bad_json":
        path.write_text(path.read_text() + "{not json\n")
        return path, ("training.dpo.pairs_file", "pairs.jsonl:3", "not valid JSON")
    if name == "missing_key":
        path.write_text('{"prompt": "a", "chosen": "good0.png"}\n')
        return path, ("pairs.jsonl:1", "no \"rejected\" field")
    if name == "missing_image":
        (folder / "bad1.png").unlink()
        return path, ("pairs.jsonl:2", "\"rejected\" image", "does not exist")
    if name == "not_an_image":
        (folder / "good0.png").write_bytes(b"\x80\x04\x95 this is a pickle, not a PNG")
        return path, ("pairs.jsonl:1", "\"chosen\"", "not an image")
    if name == "empty":
        path.write_text("\n  \n")
        return path, ("training.dpo.pairs_file", "holds no pairs")
    raise AssertionError(name)


BAD_FILES = ["missing", "not_jsonl", "bad_json", "missing_key", "missing_image", "not_an_image",
             "empty"]


@pytest.mark.parametrize("name", BAD_FILES)
def test_a_broken_pairs_file_fails_at_config_load_in_one_line(name, toy_dir, tmp_path):
    path, texts = _bad(tmp_path, name)
    with pytest.raises(InputError) as err:
        _toy(toy_dir, tmp_path, f"training.dpo.pairs_file={path}")
    message = str(err.value)
    assert "\n" not in message
    for text in texts:
        assert text in message, f"{text!r} not in: {message}"


def test_flowgrpo_train_refuses_a_broken_pairs_file_before_the_model(tmp_path, capsys,
                                                                      no_model_load):
    path, texts = _bad(tmp_path, "missing_image")
    config = tmp_path / "config.yaml"
    config.write_text((ROOT / "configs" / "toy_methods" / "dpo.yaml").read_text())
    status = main(["train", str(config), f"model.path={ROOT / 'assets' / 'toy'}",
                   f"run.output_dir={tmp_path / 'runs'}", "training.skip_zero_std_groups=false",
                   f"training.dpo.pairs_file={path}"])
    out, err = capsys.readouterr()
    assert status == 2 and "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowgrpo train: error: ")
    for text in texts:
        assert text in lines[0]
    assert not (tmp_path / "runs").exists()


def test_pairs_file_refusals_name_the_field(tiny_sd3_path, toy_dir, tmp_path):
    from flowgrpo.flow_policy import FlowPolicy

    path = write_pairs(tmp_path / "pairs", 2)
    # SD3 encodes images (sd3.encode_images); a family whose adapter cannot is refused
    config = tiny_config(tiny_sd3_path, tmp_path, *_algorithm("dpo"),
                         f"training.dpo.pairs_file={path}")
    config.model.family = "qwen_image"
    with pytest.raises(InputError, match="training.dpo.pairs_file needs the model to VAE-encode"):
        FlowPolicy.check_config(config)
    with pytest.raises(InputError, match="training.dpo.pairs_file is set but training.algorithm"):
        _toy(toy_dir, tmp_path, "training.algorithm=dgpo", f"training.dpo.pairs_file={path}")
    with pytest.raises(InputError, match="skip_zero_std_groups"):
        _toy(toy_dir, tmp_path, "training.skip_zero_std_groups=true",
             f"training.dpo.pairs_file={path}")
    with pytest.raises(InputError, match="training.dpo.online is false"):
        _toy(toy_dir, tmp_path, "training.dpo.online=false")


def test_a_model_that_cannot_take_the_pairs_is_refused_when_it_loads(toy_dir, edit_dir,
                                                                      tmp_path):
    """What only the loaded model tells: an editing toy build (a pair has no source image) and
    images of another size than the model's."""
    path = write_pairs(tmp_path / "pairs", 2)
    edit = load_config(ROOT / "configs" / "toy_edit.yaml", overrides=[
        f"model.path={edit_dir}", f"run.output_dir={tmp_path / 'edit'}", "run.progress=false",
        "prompts.eval=null", "eval.rewards=[]", "training.locality={mask: 'off'}",
        "rewards.components=[{name: toy_edit, options: {score: partial}}]",
        *_algorithm("dpo"), f"training.dpo.pairs_file={path}"])
    with pytest.raises(InputError, match="training.dpo.pairs_file: this toy model edits"):
        Trainer(edit)
    large = tmp_path / "large"
    large.mkdir()
    _image(large / "good.png", (200, 40, 40), size=32)
    _image(large / "bad.png", (40, 40, 200), size=32)
    (large / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "good.png", '
                                       '"rejected": "bad.png"}\n')
    with pytest.raises(InputError, match="cannot encode .*give images of the model's output"):
        Trainer(_toy(toy_dir, tmp_path, f"training.dpo.pairs_file={large / 'pairs.jsonl'}"))


def test_iteration_pairs_cover_the_file_once_per_pass_by_seed():
    count, per = 7, 3
    drawn = [iteration_pairs(count, per, seed=5, iteration=i) for i in range(14)]
    flat = sum(drawn, [])
    for p in range(6):                                   # 42 draws = 6 passes of 7
        assert sorted(flat[p * count:(p + 1) * count]) == list(range(count))
    assert flat[:count] != flat[count:2 * count]          # each pass its own order
    assert drawn == [iteration_pairs(count, per, seed=5, iteration=i) for i in range(14)]
    assert drawn != [iteration_pairs(count, per, seed=6, iteration=i) for i in range(14)]
    # a larger draw than the file wraps into the next pass
    assert sorted(iteration_pairs(2, 4, seed=0, iteration=0)) == [0, 0, 1, 1]


# ------------------------------------------------------------------ offline pairs: training

def test_the_offline_batch_is_what_the_file_says_and_repeats(toy_dir, tmp_path):
    """Offline units hold the file's pairs in the draw's order, each image VAE-encoded by the
    model, a pair's two images at one level; a fresh algorithm (a resume) builds the same units."""
    path = write_pairs(tmp_path / "pairs", 3)
    overrides = (f"training.dpo.pairs_file={path}", "training.dpo.pairs_per_iteration=4",
                 "training.dpo.online=false")
    trainer = Trainer(_toy(toy_dir, tmp_path, *overrides))
    batch, _, _ = trainer.rollout_and_score(1)
    units = batch.replay
    assert units and all(isinstance(u, OfflinePairs) for u in units)
    pairs = read_pairs_file(path)
    drawn = iteration_pairs(3, 4, trainer.config.run.seed, 1)
    assert sum(u.pairs for u in units if u.slot == 0) == 4
    first = [u for u in units if u.slot == 0]
    order = [p for u in first for p in u.positions]
    assert order == [0, 1, 2, 3]
    model = trainer.model
    for unit in first:
        picked = [pairs[drawn[j]] for j in unit.positions]
        assert unit.prompts == [p.prompt for p in picked] * 2
        images = [load_image(p.chosen) for p in picked] + [load_image(p.rejected) for p in picked]
        assert torch.equal(unit.clean, model.encode_images(images).float().cpu())
    for unit in units:
        p = unit.pairs
        assert torch.equal(unit.sigmas[:p], unit.sigmas[p:])
    # a fresh algorithm (what a resumed run builds) draws the same units: no state but the file
    again = DiffusionDPO(trainer.policy).offline_units(1)
    assert [(u.positions, u.slot, u.sigmas.tolist()) for u in again] == \
        [(u.positions, u.slot, u.sigmas.tolist()) for u in units]
    assert all(torch.equal(a.clean, b.clean) for a, b in zip(again, units))


def test_offline_pairs_start_at_log_two_and_mix_with_online_pairs(toy_dir, tmp_path):
    """Full fine-tuning's reference is a frozen copy of the same weights: every pair, offline or
    online, has loss log 2 before the first step."""
    path = write_pairs(tmp_path / "pairs", 3)
    config = _toy(toy_dir, tmp_path, f"training.dpo.pairs_file={path}", "run.max_iterations=1",
                  "training.dpo.pairs_per_iteration=2")
    train = [h for h in Trainer(config).train() if h["phase"] == "train"]
    assert train[0]["train/policy_loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert train[0]["train/offline_implicit_margin"] == 0.0
    assert train[0]["train/optimizer_steps"] == 1


def _implicit_margin(trainer, pairs_path: Path, levels=(0.3, 0.5, 0.7, 0.9)) -> float:
    """Mean over the file's pairs and fixed levels and noise of the implicit reward margin
    (e_ref_w - e_w) - (e_ref_l - e_l): 0 at the reference, up when the policy prefers the
    chosen images more than the reference does."""
    policy, model = trainer.policy, trainer.model
    pairs = read_pairs_file(pairs_path)
    images = [load_image(p.chosen) for p in pairs] + [load_image(p.rejected) for p in pairs]
    with torch.no_grad():
        clean = model.encode_images(images).float()
        cond = model.encode_prompts([p.prompt for p in pairs] * 2)
        margins = []
        for i, sigma in enumerate(levels):
            noise = torch.randn(clean.shape[1:], generator=seeded_generator(9, i))
            noise = noise.expand_as(clean).contiguous()
            sigmas = torch.full((len(images),), sigma)
            latents, target = noised_latents(clean, noise, sigmas)
            error = velocity_error(model.velocity(latents, sigmas, cond, 1.0).float(), target)
            with policy.reference_policy():
                ref = velocity_error(model.velocity(latents, sigmas, cond, 1.0).float(), target)
            p = len(pairs)
            margins.append(((ref[:p] - error[:p]) - (ref[p:] - error[p:])).mean())
    return float(torch.stack(margins).mean())


def test_offline_pairs_train_and_raise_the_implicit_margin(toy_dir, tmp_path):
    """Two iterations of offline-only Diffusion-DPO take their optimiser steps, and the pairs'
    implicit reward margin, 0 at the reference, becomes clearly positive (at levels and noise of
    its own, not the trained ones)."""
    path = write_pairs(tmp_path / "pairs", 3)
    config = _toy(toy_dir, tmp_path, f"training.dpo.pairs_file={path}",
                  "training.dpo.online=false", "training.dpo.pairs_per_iteration=3",
                  "training.dpo.beta=100", "training.timesteps.count=2", "training.lr=1e-3",
                  "run.max_iterations=2", "training.optimizer_steps_per_epoch=2",
                  "sampling.num_steps=2")
    trainer = Trainer(config)
    assert _implicit_margin(trainer, path) == 0.0
    history = [h for h in trainer.train() if h["phase"] == "train"]
    assert [h["train/optimizer_steps"] for h in history] == [2, 2]
    margin = _implicit_margin(trainer, path)
    assert margin > 1e-3, margin
    assert history[-1]["train/offline_implicit_margin"] > 0
    assert history[-1]["train/implicit_accuracy"] > 0.5


def test_offline_pairs_on_sd3_start_at_log_two(tiny_sd3_path, tmp_path):
    """SD3 takes a preference file: its encode_images resizes the pairs' 24 px images to the
    configured size and VAE-encodes them; LoRA starts at zero, so the policy is the reference and
    every pair, offline or online, has loss log 2 before the first step."""
    path = write_pairs(tmp_path / "pairs", 2)
    config = tiny_config(tiny_sd3_path, tmp_path, "run.max_iterations=1", "run.progress=false",
                         "run.comparison_grid=false", "prompts.eval=null", "sampling.num_steps=3",
                         *_algorithm("dpo"), f"training.dpo.pairs_file={path}",
                         "training.dpo.pairs_per_iteration=2")
    trainer = Trainer(config)
    size = (config.model.options["height"], config.model.options["width"]) \
        if "height" in config.model.options else None
    latents = trainer.model.encode_images([load_image(p.chosen) for p in read_pairs_file(path)])
    assert latents.shape[0] == 2 and latents.shape[1:] == trainer.model.initial_noise(
        1, torch.Generator().manual_seed(0)).shape[1:]
    assert size is None or latents.shape[-2:] == tuple(x // 8 for x in size)
    train = [h for h in trainer.train() if h["phase"] == "train"]
    assert train[0]["train/policy_loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert train[0]["train/offline_implicit_margin"] == 0.0
    assert train[0]["train/optimizer_steps"] == 1
