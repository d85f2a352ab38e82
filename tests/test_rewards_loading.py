"""load_reward (names, options, user classes, entry points, chunking, video per frame),
MultiReward maths, JPEG rewards and the optional package adapters."""
from __future__ import annotations

import io
import math
import sys
import types

import pytest
import torch
from PIL import Image

from reward_models import REGISTRY, MultiReward, available_rewards, load_reward, register_reward
from reward_models.loading import aggregate_frames
from flowgrpo.pixels import to_uint8
from reward_models.media import frame_indices


# ---- user rewards used below (loaded by dotted path: f"{__name__}:Class") ----

class Brightness:
    """Mean pixel value per image, times ``gain``. Records the batch shapes it is called with."""

    name = "brightness"

    def __init__(self, gain: float = 1.0):
        self.gain = gain
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, media, prompts, metadata):
        assert media.ndim == 4, "image rewards must only ever see images"
        self.calls.append(tuple(media.shape))
        return self.gain * media.mean(dim=(1, 2, 3))


class VerdictWithParts:
    """A reward with components: 'exact' (main: 1 if brightness > 0.5) and 'partial' (the
    brightness itself); NaN for prompts equal to 'skip'."""

    main_component = "exact"

    def __init__(self):
        self.calls = 0

    def components(self, media, prompts, metadata):
        self.calls += 1
        brightness = media.mean(dim=(1, 2, 3))
        skip = torch.tensor([p == "skip" for p in prompts])
        nan = torch.full_like(brightness, math.nan)
        return {"exact": torch.where(skip, nan, (brightness > 0.5).float()),
                "partial": torch.where(skip, nan, brightness)}

    def __call__(self, media, prompts, metadata):
        return self.components(media, prompts, metadata)["exact"]


class NeedsDeviceAndDtype:
    def __init__(self, device="cpu", dtype=torch.float32):
        self.device, self.dtype = device, dtype

    def __call__(self, media, prompts, metadata):
        return torch.zeros(media.shape[0])


def flat_images(values: list[float], size: int = 8) -> torch.Tensor:
    """(B, 3, size, size) constant images with the given values."""
    return torch.tensor(values).view(-1, 1, 1, 1).expand(-1, 3, size, size).clone()


# ---- registry and names ----

def test_builtin_names_are_registered_lazily():
    names = available_rewards()
    for name in ("aesthetic", "clip_score", "pickscore", "ocr", "jpeg_compressibility",
                 "jpeg_incompressibility", "hpsv2", "imagereward", "temporal_consistency",
                 "remote", "geneval_toy"):
        assert name in names
    assert REGISTRY["geneval_toy"] == "reward_models.geneval_toy:GenevalToyReward"
    assert all(":" in path for path in REGISTRY.values())


def test_unknown_name_lists_available_rewards():
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*clip_score.*ocr"):
        load_reward("nope")


def test_unknown_option_names_reward_option_and_valid_ones():
    with pytest.raises(ValueError, match=r"reward 'jpeg_compressibility' has no option "
                                         r"'qualty'; valid options: quality, device"):
        load_reward({"name": "jpeg_compressibility", "qualty": 90})


def test_missing_required_option_is_named():
    with pytest.raises(ValueError, match="reward 'remote' requires option 'url'"):
        load_reward("remote")


def test_user_class_by_dotted_path_with_options():
    reward = load_reward({"name": f"{__name__}:Brightness", "gain": 2.0})
    scores = reward(flat_images([0.25, 0.5]), ["a", "b"])
    assert torch.allclose(scores, torch.tensor([0.5, 1.0]))
    assert scores.dtype == torch.float32 and reward.name == "brightness"
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        load_reward(f"{__name__}:Missing")


class BufferedBrightness:
    """Returns its scores in one numpy buffer that it overwrites on every call."""

    name = "buffered"

    def __init__(self):
        import numpy as np

        self.buffer = np.zeros(2, dtype=np.float32)

    def __call__(self, media, prompts, metadata):
        self.buffer[:] = media.mean(dim=(1, 2, 3)).numpy()
        return self.buffer


def test_scores_do_not_alias_a_buffer_the_reward_reuses():
    """torch.as_tensor shares a numpy array's memory; the scores handed on are copies, so a
    reward that reuses its output buffer (the next call, or a threaded scorer) cannot change
    scores already returned."""
    reward = load_reward(f"{__name__}:BufferedBrightness")
    first = reward(flat_images([0.25, 0.5]), ["a", "b"])
    reward(flat_images([1.0, 1.0]), ["a", "b"])
    assert torch.allclose(first, torch.tensor([0.25, 0.5]))


class HalfBrightness(Brightness):
    def __init__(self):
        super().__init__(gain=0.5)


def test_register_reward_decorator_adds_a_name(monkeypatch):
    import reward_models.base as base
    import reward_models.loading as loading

    registry = dict(REGISTRY)       # work on a copy: the real registry stays untouched
    monkeypatch.setattr(base, "REGISTRY", registry)
    monkeypatch.setattr(loading, "REGISTRY", registry)
    monkeypatch.setattr(HalfBrightness, "name", "brightness", raising=False)
    register_reward("test_half")(HalfBrightness)
    assert registry["test_half"] == f"{__name__}:HalfBrightness"
    assert HalfBrightness.name == "test_half"
    reward = load_reward("test_half")
    assert reward.name == "test_half"
    assert torch.allclose(reward(flat_images([0.5]), [""]), torch.tensor([0.25]))
    assert "test_half" not in REGISTRY


def test_device_and_dtype_reach_constructors_and_spec_overrides():
    reward = load_reward(f"{__name__}:NeedsDeviceAndDtype", dtype="bfloat16")
    assert reward.inner.dtype == torch.bfloat16 and reward.inner.device == torch.device("cpu")
    reward = load_reward({"name": f"{__name__}:NeedsDeviceAndDtype", "dtype": "fp16"},
                         dtype=torch.float32)
    assert reward.inner.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_reward({"name": f"{__name__}:NeedsDeviceAndDtype", "dtype": "float8"})


@pytest.fixture
def entry_point_package(tmp_path, monkeypatch):
    """An installed package (dist-info with entry_points.txt) registering 'test_gray_level'."""
    module = "flowgrpo_test_plugin_rewards"
    (tmp_path / f"{module}.py").write_text(
        "import torch\n"
        "class GrayLevel:\n"
        "    def __call__(self, media, prompts, metadata):\n"
        "        return 10 * media.mean(dim=(1, 2, 3))\n")
    dist = tmp_path / "flowgrpo_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flowgrpo-test-plugin\n"
                                   "Version: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[flowgrpo.rewards]\ntest_gray_level = {module}:GrayLevel\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "test_gray_level"
    sys.modules.pop(module, None)


def test_entry_point_registers_a_reward_by_name(entry_point_package):
    assert entry_point_package in available_rewards()
    reward = load_reward(entry_point_package)
    assert torch.allclose(reward(flat_images([0.1, 0.3]), ["", ""]), torch.tensor([1.0, 3.0]))
    assert reward.name == entry_point_package


def test_outputs_of_wrong_shape_and_bad_inputs_are_errors():
    reward = load_reward(f"{__name__}:Brightness")
    with pytest.raises(ValueError, match="prompts must be a list of 2"):
        reward(flat_images([0.1, 0.2]), ["only one"])
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        reward(torch.rand(2, 4, 8, 8), ["a", "b"])
    with pytest.raises(TypeError, match="divide uint8 images by 255"):
        reward(torch.zeros(1, 3, 4, 4, dtype=torch.uint8), ["a"])


# ---- chunking and video ----

def test_batch_size_chunks_calls_without_changing_scores():
    media = torch.rand(8, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    whole = load_reward(f"{__name__}:Brightness")
    chunked = load_reward({"name": f"{__name__}:Brightness", "batch_size": 3})
    assert torch.equal(chunked(media, [""] * 8), whole(media, [""] * 8))
    assert [shape[0] for shape in chunked.inner.calls] == [3, 3, 2]


def test_frame_indices_are_evenly_spaced():
    assert frame_indices(9, 3).tolist() == [0, 4, 8]
    assert frame_indices(16, 4).tolist() == [0, 5, 10, 15]
    assert frame_indices(5, None).tolist() == [0, 1, 2, 3, 4]
    assert frame_indices(3, 10).tolist() == [0, 1, 2]


def test_video_is_scored_per_frame_and_averaged():
    generator = torch.Generator().manual_seed(1)
    videos = torch.rand(2, 5, 3, 6, 6, generator=generator)
    reward = load_reward(f"{__name__}:Brightness")
    per_frame = torch.stack([reward(video, ["p"] * 5) for video in videos])   # (2, 5)
    assert torch.allclose(reward(videos, ["p", "q"]), per_frame.mean(dim=1), atol=1e-6)

    sampled = load_reward({"name": f"{__name__}:Brightness", "video_frames": 3,
                           "video_aggregate": "min"})
    assert torch.allclose(sampled(videos, ["p", "q"]), per_frame[:, [0, 2, 4]].amin(dim=1))
    maximum = load_reward({"name": f"{__name__}:Brightness", "video_aggregate": "max"})
    assert torch.allclose(maximum(videos, ["p", "q"]), per_frame.amax(dim=1))


def test_aggregate_frames_ignores_nan_frames_unless_all_are_nan():
    nan = math.nan
    scores = torch.tensor([[1.0, nan, 3.0], [nan, nan, nan], [2.0, 4.0, 6.0]])
    mean = aggregate_frames(scores, "mean")
    assert mean[0] == 2.0 and math.isnan(mean[1]) and mean[2] == 4.0
    assert aggregate_frames(scores, "min")[0] == 1.0 and aggregate_frames(scores, "max")[0] == 3.0
    assert math.isnan(aggregate_frames(scores, "max")[1])


def test_video_components_are_aggregated_too():
    reward = load_reward(f"{__name__}:VerdictWithParts")
    videos = torch.stack([flat_images([0.2, 0.8]), flat_images([0.9, 0.9])])   # (2, 2, 3, 8, 8)
    main, parts = reward.score_and_components(videos, ["a", "b"])
    assert torch.allclose(main, torch.tensor([0.5, 1.0]))
    assert torch.allclose(parts["partial"], torch.tensor([0.5, 0.9]))


# ---- MultiReward ----

def test_multi_reward_returns_components_and_weighted_total():
    multi = MultiReward([
        {"name": f"{__name__}:Brightness", "weight": 2.0},
        {"name": f"{__name__}:VerdictWithParts", "weight": 0.5, "label": "verdict"},
    ])
    media = flat_images([0.25, 0.75])
    out = multi(media, ["a", "b"])
    assert set(out) == {"brightness", "verdict", "verdict.exact", "verdict.partial", "total"}
    assert torch.allclose(out["brightness"], torch.tensor([0.25, 0.75]))
    assert torch.allclose(out["verdict"], torch.tensor([0.0, 1.0]))
    assert torch.allclose(out["verdict.partial"], torch.tensor([0.25, 0.75]))
    assert torch.allclose(out["total"], 2.0 * out["brightness"] + 0.5 * out["verdict"])
    assert multi.weights == {"brightness": 2.0, "verdict": 0.5}
    assert multi.rewards["verdict"].inner.calls == 1   # main_component: one model run


def test_multi_reward_total_is_nan_when_a_weighted_component_is_nan():
    multi = MultiReward([{"name": f"{__name__}:Brightness"},
                         {"name": f"{__name__}:VerdictWithParts", "label": "verdict"}],
                        aggregation="decoupled")
    out = multi(flat_images([0.25, 0.75]), ["skip", "b"])
    assert math.isnan(out["verdict"][0]) and math.isnan(out["total"][0])
    assert out["total"][1].item() == pytest.approx(0.75 + 1.0)
    assert multi.aggregation == "decoupled"
    ignored = MultiReward([{"name": f"{__name__}:Brightness"},
                           {"name": f"{__name__}:VerdictWithParts", "weight": 0.0}])
    assert ignored(flat_images([0.25]), ["skip"])["total"].item() == 0.25


def test_multi_reward_validates_specs():
    with pytest.raises(ValueError, match="appears twice"):
        MultiReward([f"{__name__}:Brightness", {"name": f"{__name__}:Brightness"}])
    with pytest.raises(ValueError, match="weight must be a finite number"):
        MultiReward([{"name": f"{__name__}:Brightness", "weight": "high"}])
    with pytest.raises(ValueError, match="aggregation must be one of"):
        MultiReward([f"{__name__}:Brightness"], aggregation="product")
    from_config = MultiReward.from_config([{"name": "jpeg_compressibility", "weight": 1.0},
                                           {"name": "jpeg_incompressibility", "weight": 1.0}])
    out = from_config(torch.rand(2, 3, 16, 16), ["", ""])
    assert torch.allclose(out["total"], torch.zeros(2))   # -size + size


# ---- JPEG ----

def test_jpeg_flat_image_compresses_better_than_noise():
    generator = torch.Generator().manual_seed(0)
    media = torch.cat([torch.full((1, 3, 64, 64), 0.5), torch.rand(1, 3, 64, 64,
                                                                   generator=generator)])
    compressibility = load_reward("jpeg_compressibility")(media, ["", ""])
    incompressibility = load_reward("jpeg_incompressibility")(media, ["", ""])
    assert compressibility[0] > compressibility[1]
    assert incompressibility[0] < incompressibility[1]
    assert torch.equal(compressibility, -incompressibility) and (compressibility < 0).all()
    buffer = io.BytesIO()     # units: kB of a quality-95 Pillow JPEG
    Image.fromarray(to_uint8(media)[1]).save(buffer, format="JPEG", quality=95)
    assert incompressibility[1].item() == pytest.approx(len(buffer.getvalue()) / 1000)


# ---- optional package adapters ----

def test_adapters_without_their_package_name_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "hpsv2", None)            # import hpsv2 -> ImportError
    monkeypatch.setitem(sys.modules, "ImageReward", None)
    with pytest.raises(ImportError, match="pip install hpsv2"):
        load_reward("hpsv2")
    with pytest.raises(ImportError, match="pip install image-reward"):
        load_reward("imagereward")


def test_adapters_pass_each_image_with_its_prompt(monkeypatch):
    seen = []

    def score(image, prompt, hps_version):
        seen.append((image.size, prompt, hps_version))
        return [len(prompt) / 10]

    monkeypatch.setitem(sys.modules, "hpsv2", types.SimpleNamespace(score=score))
    reward = load_reward({"name": "hpsv2", "version": "v2.0"})
    scores = reward(torch.rand(2, 3, 5, 7), ["ab", "abcd"])
    assert torch.allclose(scores, torch.tensor([0.2, 0.4]))
    assert seen == [((7, 5), "ab", "v2.0"), ((7, 5), "abcd", "v2.0")]

    class FakeImageReward:
        def score(self, prompt, images):
            return float(len(prompt)) + len(images)

    package = types.SimpleNamespace(load=lambda name, device: FakeImageReward())
    monkeypatch.setitem(sys.modules, "ImageReward", package)
    assert torch.equal(load_reward("imagereward")(torch.rand(2, 3, 4, 4), ["a", "abc"]),
                       torch.tensor([2.0, 4.0]))


class WrongShape:
    """Scores of the wrong length for its main score or for one component."""

    name = "wrong"

    def __init__(self, where: str = "main"):
        self.where = where

    def __call__(self, media, prompts, metadata):
        return torch.zeros(len(prompts) + (1 if self.where == "main" else 0))

    def components(self, media, prompts, metadata):
        good = torch.zeros(len(prompts), 1)          # (B, 1) is accepted as (B,)
        return {"good": good, "bad": torch.zeros(len(prompts) + (self.where == "part"))}


def test_a_reward_output_of_the_wrong_length_is_an_error_naming_it():
    """Every chunk's main score and components are checked: (B, 1) is taken as (B,), any other
    length raises naming the reward (and the component)."""
    images, prompts = flat_images([0.25, 0.5]), ["a", "b"]
    with pytest.raises(ValueError, match=r"reward 'wrong' returned shape \(3,\); expected \(2,\)"):
        load_reward(f"{__name__}:WrongShape")(images, prompts)
    with pytest.raises(ValueError, match=r"reward 'wrong.bad' returned shape \(3,\)"):
        load_reward({"name": f"{__name__}:WrongShape", "where": "part"}).components(images, prompts)
    parts = load_reward({"name": f"{__name__}:WrongShape", "where": "none"}).components(images, prompts)
    assert parts["good"].shape == (2,) and parts["bad"].shape == (2,)
