"""Prompt records with several source images (JSONL ``"images"``): what a record holds
(``SourceImages``: the first image, carrying all), the errors at load, what the rest of the
code reads from it (rewards, masks, grids read the first image), and the family check
(``check_source_images``)."""
from __future__ import annotations

import copy
import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.errors import InputError
from flowgrpo.model import SourceImages, check_source_images, source_image_limit, source_images_of
from flowgrpo.prompt_sets import convert
from flowgrpo.prompts import load_prompts, record_images, reward_metadata


def _save(folder, name: str, height: int, width: int, seed: int) -> torch.Tensor:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(folder / name)
    return torch.from_numpy(pixels).permute(2, 0, 1).float() / 255


def _jsonl(folder, *items) -> str:
    path = folder / "edits.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return str(path)


def test_images_load_in_order_as_one_value_that_reads_as_the_first(tmp_path):
    first = _save(tmp_path, "a.png", 8, 12, 0)
    second = _save(tmp_path, "b.png", 16, 6, 1)
    (tmp_path / "sub").mkdir()
    third = _save(tmp_path / "sub", "c.png", 4, 4, 2)
    records = load_prompts(_jsonl(tmp_path,
                                  {"prompt": "combine", "images": ["a.png", "b.png", "sub/c.png"]},
                                  {"prompt": "one in a list", "images": ["b.png"]},
                                  {"prompt": "one", "image": "a.png"}))
    multi = records[0]["image"]
    assert isinstance(multi, SourceImages) and isinstance(multi, torch.Tensor)
    assert torch.equal(multi, first) and multi.shape == (3, 8, 12)
    assert [tuple(i.shape) for i in multi.images] == [(3, 8, 12), (3, 16, 6), (3, 4, 4)]
    for loaded, saved in zip(source_images_of(multi), (first, second, third)):
        assert torch.equal(loaded, saved)
    # a one-element list is the one image, as "image"
    assert type(records[1]["image"]) is torch.Tensor and torch.equal(records[1]["image"], second)
    assert source_images_of(records[2]["image"]) == (records[2]["image"],)
    # the generic readers: the model gets the value, the rewards' source_image is the first
    images = record_images(records)
    assert images[0] is multi
    assert torch.equal(reward_metadata(records)[0]["source_image"], first)


def test_derived_tensors_are_plain_and_copies_keep_every_image(tmp_path):
    _save(tmp_path, "a.png", 8, 12, 0)
    _save(tmp_path, "b.png", 16, 6, 1)
    value = load_prompts(_jsonl(tmp_path, {"prompt": "x", "images": ["a.png", "b.png"]}))[0]["image"]
    for derived in (value[None], value * 2, torch.nn.functional.interpolate(value[None], size=(4, 4))):
        assert type(derived) is torch.Tensor
    for copied in (copy.deepcopy(value), pickle.loads(pickle.dumps(value))):
        assert isinstance(copied, SourceImages) and len(copied.images) == 2
        assert all(torch.equal(a, b) for a, b in zip(copied.images, value.images))
    with pytest.raises(ValueError, match="two or more"):
        SourceImages([value.images[0]])


@pytest.mark.parametrize("item, message", [
    ({"image": "a.png", "images": ["a.png"]}, "either \"image\" .* or \"images\""),
    ({"images": "a.png"}, "\"images\" must be a non-empty array .*got a JSON string"),
    ({"images": []}, "\"images\" must be a non-empty array .*got an empty array"),
    ({"images": ["a.png", 3]}, r"\"images\"\[1\] must be a path string .*got a JSON number"),
    ({"images": ["a.png", " "]}, r"\"images\"\[1\] must be a path string"),
    ({"images": ["a.png", "gone.png"]}, r"edits.jsonl:1 \"images\"\[1\]: image .*gone.png does not exist"),
    ({"images": ["a.png", "b.png"], "mask": "mask_b.png"}, r"mask mask_b.png is \(16, 6\) but the image is \(8, 12\)"),
])
def test_bad_images_fail_at_load_naming_the_line_and_index(tmp_path, item, message):
    _save(tmp_path, "a.png", 8, 12, 0)
    _save(tmp_path, "b.png", 16, 6, 1)
    Image.fromarray(np.zeros((16, 6), dtype=np.uint8)).save(tmp_path / "mask_b.png")
    with pytest.raises(InputError, match=message):
        load_prompts(_jsonl(tmp_path, {"prompt": "x", **item}))


def test_a_mask_is_the_first_images_region(tmp_path):
    _save(tmp_path, "a.png", 8, 12, 0)
    _save(tmp_path, "b.png", 16, 6, 1)
    Image.fromarray(np.full((8, 12), 255, dtype=np.uint8)).save(tmp_path / "mask_a.png")
    record = load_prompts(_jsonl(tmp_path, {"prompt": "x", "images": ["a.png", "b.png"],
                                            "mask": "mask_a.png"}))[0]
    assert record["mask"].shape == (1, 8, 12) and float(record["mask"].min()) == 1.0


class _TextOnly:
    family = "text_only"


class _OneImage:
    family = "one_image"
    supports_images = True


class _ThreeImages:
    family = "three_images"
    supports_images = True
    max_source_images = 3


def test_a_family_is_refused_more_images_than_it_takes():
    one, two = torch.zeros(3, 4, 4), SourceImages([torch.zeros(3, 4, 4), torch.ones(3, 2, 2)])
    four = SourceImages([torch.zeros(3, 4, 4)] * 4)
    assert [source_image_limit(m) for m in (_TextOnly, _OneImage, _ThreeImages)] == [0, 1, 3]
    check_source_images(_OneImage, [one, one])
    check_source_images(_ThreeImages, [one, two])
    with pytest.raises(ValueError, match="row 1's prompt gives 2 source images .* one_image "
                                         "family takes one source image per prompt"):
        check_source_images(_OneImage, [one, two])
    with pytest.raises(ValueError, match="row 0's prompt gives 4 .* at most 3"):
        check_source_images(_ThreeImages, [four])
    with pytest.raises(ValueError, match="text_only family does not edit images"):
        check_source_images(_TextOnly, [one])


def test_edit_sets_keep_a_list_of_source_images():
    line = json.dumps({"prompt": "combine", "images": ["a.png", "b.png"], "tag": "counting"})
    record = json.loads(convert(line.encode(), "edit_jsonl"))
    assert record == {"prompt": "combine", "images": ["a.png", "b.png"],
                      "metadata": {"tag": "counting", "family": "counting"}}


def test_one_image_families_refuse_several_sources_where_prompts_are_encoded(edit_dir):
    """The toy editing model (one source image) refuses a row with two in a rollout's and an
    evaluation's encoding, naming the row, instead of silently using the first image."""
    from flowgrpo.rollout import encode_rows, sample_ode
    from pipelines.toy import ToyFlowModel

    model = ToyFlowModel.from_pretrained(edit_dir)
    noise = model.initial_noise(2, torch.Generator().manual_seed(0))     # (2, 3, H, W) pixels
    size = noise.shape[-1]
    one = torch.rand(3, size, size)
    two = SourceImages([torch.rand(3, size, size), torch.rand(3, size, size)])
    encode_rows(model, ["a", "b"], images=[one, one])           # one image a row is fine
    with pytest.raises(ValueError, match="row 1's prompt gives 2 source images"):
        encode_rows(model, ["a", "b"], images=[one, two])
    with pytest.raises(ValueError, match="row 0's prompt gives 2 source images"):
        sample_ode(model, ["a", "b"], noise, 2, 1.0, images=[two, one])
