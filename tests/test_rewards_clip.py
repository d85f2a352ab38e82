"""CLIP-family rewards (aesthetic, clip_score, pickscore, temporal_consistency) on tiny random
CLIP checkpoints built offline and loaded through the real from_pretrained path."""
from __future__ import annotations

import json
import math
import os
import pickle

import numpy as np
import pytest
import torch

from reward_models import load_reward
from reward_models.aesthetic import HEAD_KEYS, AestheticHead, aesthetic_from_embeds, \
    load_aesthetic_head
from reward_models.clip_common import ClipPreprocess, center_crop, clip_preprocess, \
    clip_score_from_cosine, consecutive_frame_cosine, paired_cosine, shortest_edge_size
from flowgrpo.pixels import from_uint8
from reward_models.pickscore import pickscore_from_cosine
from reward_models.tiny import build_tiny_aesthetic_head, build_tiny_clip


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory) -> str:
    return build_tiny_clip(str(tmp_path_factory.mktemp("tiny_clip")), image_size=32)


@pytest.fixture(scope="session")
def tiny_clip_768_dir(tmp_path_factory) -> str:
    return build_tiny_clip(str(tmp_path_factory.mktemp("tiny_clip_768")), projection_dim=768,
                           image_size=32, seed=1)


@pytest.fixture(scope="session")
def reference_clip(tiny_clip_dir):
    from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizer

    model = CLIPModel.from_pretrained(tiny_clip_dir).eval()
    return model, CLIPImageProcessor.from_pretrained(tiny_clip_dir), \
        CLIPTokenizer.from_pretrained(tiny_clip_dir)


def uint8_images(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Smooth random images (B, H, W, 3) uint8: low-frequency content, so resampling kernels
    agree closely (pure noise would exaggerate the bicubic kernel differences)."""
    generator = torch.Generator().manual_seed(seed)
    batch, height, width = shape
    coarse = torch.rand(batch, 3, max(height // 6, 2), max(width // 6, 2), generator=generator)
    smooth = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear",
                                             align_corners=False)
    return (smooth * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


# ---- preprocessing ----

def test_shortest_edge_size_matches_clip_convention():
    assert shortest_edge_size(480, 640, 224) == (224, int(224 * 640 / 480))   # landscape: 298
    assert shortest_edge_size(640, 480, 224) == (298, 224)                    # portrait
    assert shortest_edge_size(100, 100, 224) == (224, 224)


def test_center_crop_takes_the_middle_and_pads_small_images():
    image = torch.arange(6 * 9, dtype=torch.float32).view(1, 1, 6, 9)
    crop = center_crop(image, (3, 4))      # top = int(3 / 2) = 1, left = int(5 / 2) = 2
    assert torch.equal(crop, image[..., 1:4, 2:6])
    padded = center_crop(torch.ones(1, 1, 2, 2), (4, 4))
    assert padded.shape == (1, 1, 4, 4) and padded.sum() == 4
    assert torch.equal(padded[0, 0, 1:3, 1:3], torch.ones(2, 2))


@pytest.mark.parametrize("height,width", [(32, 32), (48, 80), (90, 40), (20, 24)])
def test_tensor_preprocessing_matches_clip_image_processor(tiny_clip_dir, height, width):
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor.from_pretrained(tiny_clip_dir)
    images = uint8_images((2, height, width))
    reference = processor(images=list(images), return_tensors="pt")["pixel_values"]
    ours = clip_preprocess(from_uint8(images), ClipPreprocess.from_image_processor(processor))
    assert ours.shape == reference.shape
    # The reference rounds the resized image to uint8 (<= 0.5/255 / std ~ 0.008); ours stays float.
    assert (ours - reference).abs().max() < 0.02
    if (height, width) == (32, 32):  # no resize: only crop and normalise, which must be exact
        assert torch.allclose(ours, reference, atol=1e-5)


@pytest.mark.parametrize("height,width", [(48, 80), (90, 40), (20, 24), (33, 47), (41, 32),
                                          (300, 500)])
def test_tensor_preprocessing_equals_clip_image_processor_on_float_input(tiny_clip_dir, height,
                                                                         width):
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor.from_pretrained(tiny_clip_dir)
    images = torch.rand(2, 3, height, width, generator=torch.Generator().manual_seed(height))
    reference = processor(images=list(images), do_rescale=False,
                          return_tensors="pt")["pixel_values"]
    ours = clip_preprocess(images, ClipPreprocess.from_image_processor(processor))
    assert ours.shape == reference.shape
    assert torch.allclose(ours, reference, atol=1e-5)


def test_preprocess_constants_come_from_the_checkpoint(tiny_clip_dir):
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor.from_pretrained(tiny_clip_dir, image_mean=[0.5, 0.5, 0.5],
                                                   image_std=[0.25, 0.25, 0.25])
    preprocess = ClipPreprocess.from_image_processor(processor)
    assert preprocess.mean == (0.5, 0.5, 0.5) and preprocess.std == (0.25, 0.25, 0.25)
    assert preprocess.shortest_edge == 32 and preprocess.crop_hw == (32, 32)
    assert preprocess.interpolation == "bicubic"
    pixels = clip_preprocess(torch.full((1, 3, 32, 32), 0.75), preprocess)
    assert torch.allclose(pixels, torch.full_like(pixels, 1.0))    # (0.75 - 0.5) / 0.25


# ---- score maths on hand-made embeddings ----

def test_paired_cosine_on_hand_made_vectors():
    image = torch.tensor([[1.0, 0.0], [3.0, 4.0], [1.0, 0.0]])
    text = torch.tensor([[1.0, 1.0], [6.0, 8.0], [-2.0, 0.0]])
    assert torch.allclose(paired_cosine(image, text), torch.tensor([1 / math.sqrt(2), 1.0, -1.0]))


def test_clip_score_is_100_times_clamped_cosine():
    cosine = torch.tensor([0.3, -0.2, 1.0])
    assert torch.allclose(clip_score_from_cosine(cosine), torch.tensor([30.0, 0.0, 100.0]))
    assert torch.allclose(clip_score_from_cosine(cosine, scale=2.5), torch.tensor([0.75, 0, 2.5]))
    assert torch.equal(clip_score_from_cosine(cosine, raw_cosine=True), cosine)


def test_pickscore_is_logit_scale_times_cosine_optionally_over_26():
    cosine = torch.tensor([0.25, 0.2])
    assert torch.allclose(pickscore_from_cosine(cosine, 100.0), torch.tensor([25.0, 20.0]))
    assert torch.allclose(pickscore_from_cosine(cosine, 100.0, normalise=True),
                          torch.tensor([25.0, 20.0]) / 26)


def test_consecutive_frame_cosine_on_hand_made_frames():
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    videos = torch.stack([torch.stack([e1, e1, e2]),            # cos 1 then 0 -> 0.5
                          torch.stack([e1, -e1, e1])])          # -1, -1 -> -1
    assert torch.allclose(consecutive_frame_cosine(videos), torch.tensor([0.5, -1.0]))
    assert torch.equal(consecutive_frame_cosine(videos[:, :1]), torch.ones(2))


# ---- aesthetic head ----

def test_aesthetic_head_has_the_published_keys_and_shapes():
    state = AestheticHead().state_dict()
    assert tuple(state) == HEAD_KEYS
    shapes = [tuple(state[f"layers.{i}.weight"].shape) for i in (0, 2, 4, 6, 7)]
    assert shapes == [(1024, 768), (128, 1024), (64, 128), (16, 64), (1, 16)]


def _hand_made_head_state() -> dict[str, torch.Tensor]:
    """Each layer passes coordinate 0 through; the last computes 2 * x0 + 3."""
    state = {k: torch.zeros_like(v) for k, v in AestheticHead().state_dict().items()}
    for i in (0, 2, 4, 6):
        state[f"layers.{i}.weight"][0, 0] = 1.0
    state["layers.7.weight"][0, 0] = 2.0
    state["layers.7.bias"][0] = 3.0
    return state


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_aesthetic_head_computes_the_expected_value(tmp_path, suffix):
    path = str(tmp_path / f"head{suffix}")
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(_hand_made_head_state(), path)
    else:
        torch.save(_hand_made_head_state(), path)
    head = load_aesthetic_head(path)
    embeds = torch.zeros(2, 768)
    embeds[0, :2] = torch.tensor([3.0, 4.0])       # unit: (0.6, 0.8) -> 2 * 0.6 + 3 = 4.2
    embeds[1, :2] = torch.tensor([-5.0, 0.0])      # unit: (-1, 0)    -> 1.0
    assert torch.allclose(aesthetic_from_embeds(embeds, head), torch.tensor([4.2, 1.0]))


def test_aesthetic_head_rejects_wrong_keys_and_pickled_objects(tmp_path):
    from safetensors.torch import save_file

    wrong = str(tmp_path / "wrong.safetensors")
    save_file({"weight": torch.zeros(1, 768)}, wrong)
    with pytest.raises(ValueError, match="layers.0.weight"):
        load_aesthetic_head(wrong)
    unsafe = str(tmp_path / "unsafe.pth")
    torch.save({"layers.0.weight": torch.zeros(1), "payload": os.path.join}, unsafe)  # a global
    with pytest.raises(pickle.UnpicklingError):
        load_aesthetic_head(unsafe)


# ---- rewards end to end, against transformers' own CLIP forward ----

def test_clip_score_and_pickscore_match_clip_model_logits(tiny_clip_dir, reference_clip):
    model, processor, tokenizer = reference_clip
    images = uint8_images((3, 32, 32), seed=3)   # processor size: no resampling, exact path
    prompts = ["the cat", "a red and blue sign", "on the table of the kitchen"]
    inputs = processor(images=list(images), return_tensors="pt")
    tokens = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(pixel_values=inputs["pixel_values"], **tokens).logits_per_image.diagonal()
    logit_scale = model.logit_scale.exp().item()
    media = from_uint8(images)

    clip_score = load_reward({"name": "clip_score", "model": tiny_clip_dir})
    expected = 100 * (logits / logit_scale).clamp(min=0)
    assert torch.allclose(clip_score(media, prompts), expected, atol=1e-4)
    raw = load_reward({"name": "clip_score", "model": tiny_clip_dir, "raw_cosine": True})
    assert torch.allclose(raw(media, prompts), logits / logit_scale, atol=1e-6)

    pickscore = load_reward({"name": "pickscore", "model": tiny_clip_dir,
                             "processor": tiny_clip_dir})
    assert torch.allclose(pickscore(media, prompts), logits, atol=1e-4)
    normalised = load_reward({"name": "pickscore", "model": tiny_clip_dir,
                              "processor": tiny_clip_dir, "normalise": True})
    assert torch.allclose(normalised(media, prompts), logits / 26, atol=1e-5)


def test_clip_score_with_resizing_stays_close_to_the_processor_path(tiny_clip_dir,
                                                                    reference_clip):
    model, processor, tokenizer = reference_clip
    images = uint8_images((2, 72, 100), seed=5)
    prompts = ["the cat", "a sign"]
    with torch.no_grad():
        logits = model(**processor(images=list(images), return_tensors="pt"),
                       **tokenizer(prompts, padding=True, return_tensors="pt")
                       ).logits_per_image.diagonal()
    reward = load_reward({"name": "clip_score", "model": tiny_clip_dir, "raw_cosine": True})
    cosine = reward(from_uint8(images), prompts)
    assert torch.allclose(cosine, logits / model.logit_scale.exp(), atol=2e-3)


def test_aesthetic_reward_equals_head_on_normalised_clip_embedding(tmp_path, tiny_clip_768_dir):
    from transformers import CLIPImageProcessor, CLIPModel

    head_path = build_tiny_aesthetic_head(str(tmp_path / "head.safetensors"))
    reward = load_reward({"name": "aesthetic", "model": tiny_clip_768_dir, "head": head_path})
    images = uint8_images((2, 32, 32), seed=7)
    model = CLIPModel.from_pretrained(tiny_clip_768_dir).eval()
    processor = CLIPImageProcessor.from_pretrained(tiny_clip_768_dir)
    with torch.no_grad():
        pixels = processor(images=list(images), return_tensors="pt")["pixel_values"]
        embeds = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        head = load_aesthetic_head(head_path)
        expected = head(embeds / embeds.norm(dim=-1, keepdim=True))[:, 0]
    assert torch.allclose(reward(from_uint8(images), ["", ""]), expected, atol=1e-5)


def test_aesthetic_rejects_a_clip_of_the_wrong_width(tmp_path, tiny_clip_dir):
    head_path = build_tiny_aesthetic_head(str(tmp_path / "head.safetensors"))
    with pytest.raises(ValueError, match="768-d embeddings"):
        load_reward({"name": "aesthetic", "model": tiny_clip_dir, "head": head_path})


def test_temporal_consistency_is_one_for_still_videos_and_lower_for_changing_ones(tiny_clip_dir):
    reward = load_reward({"name": "temporal_consistency", "model": tiny_clip_dir})
    frame = from_uint8(uint8_images((1, 32, 32), seed=1))[0]
    still = frame.expand(4, 3, 32, 32)
    changing = from_uint8(uint8_images((4, 32, 32), seed=2))
    scores = reward(torch.stack([still, changing]), ["a", "b"])
    assert scores[0].item() == pytest.approx(1.0, abs=1e-5)
    assert scores[1].item() < 0.999
    with pytest.raises(ValueError, match="videos"):
        reward(still, ["a"] * 4)


def test_open_clip_backend_loads_a_local_dir_and_scores_cosines(tmp_path):
    open_clip = pytest.importorskip("open_clip")
    from safetensors.torch import save_file

    model_cfg = {"embed_dim": 16,
                 "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8,
                                "head_width": 16},
                 "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32,
                              "heads": 2, "layers": 1}}
    folder = tmp_path / "tiny_open_clip"
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(json.dumps(
        {"model_cfg": model_cfg, "preprocess_cfg": {"mean": [0.5, 0.5, 0.5],
                                                    "std": [0.5, 0.5, 0.5]}}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = open_clip.CLIP(**model_cfg).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "open_clip_model.safetensors"))

    name = f"local-dir:{folder}"
    reward = load_reward({"name": "clip_score", "model": name, "backend": "open_clip",
                          "raw_cosine": True})
    images = from_uint8(uint8_images((2, 32, 32), seed=4))
    prompts = ["a cat", "a dog"]
    with torch.no_grad():
        pixels = (images - 0.5) / 0.5                      # the config's mean/std, no resize
        expected = paired_cosine(model.encode_image(pixels),
                                 model.encode_text(open_clip.get_tokenizer(name)(prompts)))
    assert torch.allclose(reward(images, prompts), expected, atol=1e-5)


def test_reduced_precision_dtype_gives_close_scores(tiny_clip_dir):
    images = from_uint8(uint8_images((2, 32, 32), seed=9))
    prompts = ["the cat", "a sign"]
    full = load_reward({"name": "clip_score", "model": tiny_clip_dir, "raw_cosine": True})
    half = load_reward({"name": "clip_score", "model": tiny_clip_dir, "raw_cosine": True},
                       dtype="bfloat16")
    assert half.inner.encoder.model.dtype == torch.bfloat16
    scores = half(images, prompts)
    assert scores.dtype == torch.float32
    assert torch.allclose(scores, full(images, prompts), atol=0.05)
