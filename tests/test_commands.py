"""flowgrpo sample | eval | grid on the tiny SD3 build: outputs equal ``sample_ode`` on the seed's
noise, grid columns are the base and a LoRA checkpoint over the same noise, eval statistics match
the rewards (and the trainer's own evaluation), and bad inputs fail with exit status 2 before any
model loads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file

from flowgrpo.cli import main
from flowgrpo.grids import to_uint8
from flowgrpo.rollout import sample_ode
from tests.pipeline_helpers import fail_on_weight_loading, perturb_lora

OPTIONS = {"height": 32, "width": 32, "max_sequence_length": 16}
OPTION_ARGS = ["--options"] + [f"{k}={v}" for k, v in OPTIONS.items()]
PROMPTS = ["a red square", "a blue circle"]
SEEDS = [0, 2]
STEPS = 2


def _load(path: str):
    from pipelines import load_model

    return load_model("sd3", path, options=dict(OPTIONS))


def _expected(model, prompts: list[str], seeds: list[int]) -> np.ndarray:
    """uint8 (N, H, W, 3): sample_ode from each seed's noise, rows prompt-major."""
    rows = [(p, s) for p in prompts for s in seeds]
    noise = torch.cat([model.initial_noise(1, torch.Generator().manual_seed(s)) for _, s in rows])
    return to_uint8(sample_ode(model, [p for p, _ in rows], noise, STEPS, 1.0, batch_size=8))


def _png(path: Path) -> np.ndarray:
    return np.array(Image.open(path).convert("RGB"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("commands")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return root


@pytest.fixture(scope="module")
def lora_checkpoint(tiny_sd3_path, workdir) -> Path:
    """A trainer-layout checkpoint (runs/tiny/checkpoints/3) holding a perturbed LoRA written by
    the adapter's save_lora_weights, with the run's config.yaml naming family sd3."""
    from peft import LoraConfig, get_peft_model_state_dict

    model = _load(tiny_sd3_path)
    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8,
                                             target_modules=model.lora_target_modules))
    assert perturb_lora(model.transformer, seed=1, std=0.5) > 0
    run = workdir / "runs" / "tiny"
    folder = run / "checkpoints" / "3"
    folder.mkdir(parents=True)
    model.save_lora_weights(str(folder), get_peft_model_state_dict(model.transformer))
    (folder / "trainer_state.json").write_text(json.dumps({"iteration": 3, "name": "tiny"}))
    (run / "config.yaml").write_text(yaml.safe_dump({"name": "tiny", "model": {"family": "sd3"}}))
    return folder


def _sample(path: str, out: Path, *extra: str) -> int:
    return main(["sample", "--model", f"sd3:{path}", *OPTION_ARGS, "--prompts", str(out.parent /
                 "prompts.txt"), "--seeds", ",".join(map(str, SEEDS)), "--steps", str(STEPS),
                 "--guidance", "1", "--out", str(out), "--quiet", *extra])


@pytest.fixture(scope="module")
def base_samples(tiny_sd3_path, workdir) -> Path:
    assert _sample(tiny_sd3_path, workdir / "base") == 0
    return workdir / "base"


@pytest.fixture(scope="module")
def lora_samples(tiny_sd3_path, workdir, lora_checkpoint) -> Path:
    assert _sample(tiny_sd3_path, workdir / "lora", "--lora", str(lora_checkpoint)) == 0
    return workdir / "lora"


def _sample_files(folder: Path) -> list[Path]:
    index = json.loads((folder / "samples.json").read_text())
    return [folder / s["files"][0] for s in index["samples"]]


def test_sample_writes_one_png_per_prompt_and_seed_equal_to_sample_ode(tiny_sd3_path, base_samples):
    index = json.loads((base_samples / "samples.json").read_text())
    assert [(s["prompt"], s["seed"]) for s in index["samples"]] == \
        [(p, s) for p in PROMPTS for s in SEEDS]
    files = _sample_files(base_samples)
    assert sorted(base_samples.glob("*.png")) == sorted(files) and len(files) == 4
    expected = _expected(_load(tiny_sd3_path), PROMPTS, SEEDS)
    for file, pixels in zip(files, expected):
        assert np.array_equal(_png(file), pixels), file.name


def test_sample_with_lora_equals_sample_ode_of_the_adapted_model(tiny_sd3_path, lora_checkpoint,
                                                                 lora_samples, base_samples):
    model = _load(tiny_sd3_path)
    model.transformer.load_lora_adapter(str(lora_checkpoint), prefix="transformer",
                                        weight_name="pytorch_lora_weights.safetensors")
    expected = _expected(model, PROMPTS, SEEDS)
    lora = [_png(f) for f in _sample_files(lora_samples)]
    base = [_png(f) for f in _sample_files(base_samples)]
    for got, want, plain in zip(lora, expected, base):
        assert np.array_equal(got, want)
        assert not np.array_equal(got, plain)


def test_lora_without_metadata_takes_alpha_from_the_run_config(tiny_sd3_path, workdir,
                                                               lora_checkpoint, lora_samples):
    from safetensors.torch import load_file

    tensors = load_file(str(lora_checkpoint / "pytorch_lora_weights.safetensors"))
    with_config = workdir / "runs" / "nometa" / "checkpoints" / "1"
    bare = workdir / "bare_lora"
    for folder in (with_config, bare):
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "pytorch_lora_weights.safetensors"))   # no metadata
    (with_config.parent.parent / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"family": "sd3", "lora": {"rank": 4, "alpha": 8}}}))
    assert _sample(tiny_sd3_path, workdir / "nometa", "--lora", str(with_config)) == 0
    with pytest.warns(UserWarning, match="alpha = rank"):
        assert _sample(tiny_sd3_path, workdir / "bare", "--lora", str(bare)) == 0
    want = [_png(f) for f in _sample_files(lora_samples)]               # alpha 8 (metadata)
    restored = [_png(f) for f in _sample_files(workdir / "nometa")]
    assumed = [_png(f) for f in _sample_files(workdir / "bare")]        # alpha 4 = rank
    assert all(np.array_equal(a, b) for a, b in zip(restored, want))
    assert not any(np.array_equal(a, b) for a, b in zip(assumed, want))


def test_sample_with_a_full_checkpoint_swaps_in_its_transformer(tiny_sd3_path, workdir,
                                                               base_samples):
    model = _load(tiny_sd3_path)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.transformer.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    folder = workdir / "full_ckpt"
    model.transformer.save_pretrained(folder / "transformer")
    expected = _expected(model, PROMPTS, SEEDS)
    assert _sample(tiny_sd3_path, workdir / "full", "--lora", str(folder)) == 0
    got = [_png(f) for f in _sample_files(workdir / "full")]
    base = [_png(f) for f in _sample_files(base_samples)]
    for pixels, want, plain in zip(got, expected, base):
        assert np.array_equal(pixels, want)
        assert not np.array_equal(pixels, plain)


def test_grid_columns_are_base_and_checkpoint_over_the_same_noise(tiny_sd3_path, workdir,
                                                                  lora_checkpoint, base_samples,
                                                                  lora_samples):
    out = workdir / "grid" / "grid.png"
    code = main(["grid", "--model", f"sd3:{tiny_sd3_path}", *OPTION_ARGS, "--prompts",
                 str(workdir / "prompts.txt"), "--seeds", "0,2", "--steps", str(STEPS),
                 "--guidance", "1", "--checkpoints", "base", str(lora_checkpoint.parent.parent),
                 "--rewards", "tests.helpers:Brightness", "--max-rows", "3", "--out", str(out),
                 "--quiet"])
    assert code == 0
    summary = json.loads((out.parent / "grid.json").read_text())
    assert [c["label"] for c in summary["columns"]] == ["base", "tiny@3"]   # run -> newest ckpt
    # 4 rows, at most 3 a page: two balanced pages.
    assert [p["file"] for p in summary["pages"]] == ["grid_001.png", "grid_002.png"]
    assert [p["rows"] for p in summary["pages"]] == [[0, 2], [2, 4]]
    assert sorted(f.name for f in out.parent.glob("*.png")) == ["grid_001.png", "grid_002.png"]
    columns = {"base": [_png(f) for f in _sample_files(base_samples)],
               "tiny@3": [_png(f) for f in _sample_files(lora_samples)]}
    for page in summary["pages"]:
        pixels = _png(out.parent / page["file"])
        scale = page["scale"]
        assert scale == 4                                   # 32 px -> 128 px cells
        for local, row in enumerate(range(*page["rows"])):
            cells = []
            for col, label in enumerate(columns):
                left, top, right, bottom = page["cells"][local][col]
                cell = pixels[top:bottom:scale, left:right:scale]
                assert np.array_equal(cell, columns[label][row]), (row, label)
                reward = summary["rewards"][label]["brightness"][row]
                assert reward == pytest.approx(columns[label][row].mean() / 255, abs=2e-3)
                cells.append(cell)
            assert not np.array_equal(cells[0], cells[1])


def test_eval_reports_statistics_per_component_and_family(tiny_sd3_path, workdir, capsys):
    prompts = workdir / "families.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "metadata": {"family": f}}) + "\n"
                               for p, f in [("a red square", "colors"), ("two cats", "counting"),
                                            ("a blue circle", "colors")]))
    out = workdir / "eval" / "results.json"
    code = main(["eval", "--model", f"sd3:{tiny_sd3_path}", *OPTION_ARGS, "--rewards",
                 "tests.helpers:Brightness=2", "--prompts", str(prompts), "--seeds", "0,1",
                 "--steps", str(STEPS), "--guidance", "1", "--out", str(out), "--quiet"])
    assert code == 0
    result = json.loads(out.read_text())
    model = _load(tiny_sd3_path)
    names = ["a red square", "two cats", "a blue circle"]
    rows = [(p, s) for p in names for s in (0, 1)]
    noise = torch.cat([model.initial_noise(1, torch.Generator().manual_seed(s)) for _, s in rows])
    media = sample_ode(model, [p for p, _ in rows], noise, STEPS, 1.0, batch_size=8)
    brightness = media.flatten(1).mean(1).double()
    assert result["num_samples"] == 6
    stats = result["rewards"]["brightness"]
    assert stats["mean"] == pytest.approx(float(brightness.mean()), abs=1e-6)
    assert stats["std"] == pytest.approx(float(brightness.std(unbiased=False)), abs=1e-6)
    assert stats["count"] == 6 and stats["nan_count"] == 0
    assert result["rewards"]["total"]["mean"] == pytest.approx(2 * float(brightness.mean()), abs=1e-6)
    colors = brightness[[0, 1, 4, 5]]
    assert result["families"]["colors"]["brightness"]["mean"] == pytest.approx(float(colors.mean()),
                                                                              abs=1e-6)
    assert result["families"]["counting"]["brightness"]["count"] == 2
    counting = brightness[[2, 3]]
    assert result["family_mean"]["brightness"] == pytest.approx(
        float(colors.mean() + counting.mean()) / 2, abs=1e-6)
    # standard errors: std / sqrt(n) per mean, sqrt(sum_f se_f^2) / F for the family mean
    assert stats["se"] == pytest.approx(float(brightness.std(unbiased=False)) / 6 ** 0.5, abs=1e-6)
    se = {name: float(v.std(unbiased=False)) / len(v) ** 0.5
          for name, v in (("colors", colors), ("counting", counting))}
    for name in se:
        assert result["families"][name]["brightness"]["se"] == pytest.approx(se[name], abs=1e-6)
    assert result["family_mean_se"]["brightness"] == pytest.approx(
        (se["colors"] ** 2 + se["counting"] ** 2) ** 0.5 / 2, abs=1e-6)
    table = capsys.readouterr().out
    assert "colors" in table and "counting" in table and "brightness" in table
    assert "family mean" in table


def test_eval_from_config_reproduces_the_trainers_evaluation(tiny_sd3_path, workdir):
    from flowgrpo.config import load_config
    from flowgrpo.trainer import Trainer

    # Families of unequal size: eval_per_family must cycle the one-prompt family through seeds.
    (workdir / "eval_prompts.jsonl").write_text("".join(
        json.dumps({"prompt": p, "metadata": {"family": f}}) + "\n"
        for p, f in [("a green cat", "animals"), ("a red square", "shapes"),
                     ("a blue circle", "shapes")]))
    data = {
        "name": "evalrun",
        "model": {"family": "sd3", "path": tiny_sd3_path, "options": dict(OPTIONS),
                  "lora": {"rank": 4, "alpha": 8}},
        "prompts": {"train": str(workdir / "prompts.txt"),
                    "eval": str(workdir / "eval_prompts.jsonl"), "eval_per_family": 3},
        "sampling": {"num_steps": 2, "eval_num_steps": STEPS, "rollout_batch_size": 4},
        "training": {"prompts_per_iteration": 2, "group_size": 2},
        "rewards": {"components": [{"name": "tests.helpers:Brightness"}], "threaded": False},
        "run": {"output_dir": str(workdir / "runs"), "tracker": "none", "progress": False},
    }
    config_file = workdir / "evalrun.yaml"
    config_file.write_text(yaml.safe_dump(data))
    out = workdir / "evalrun.json"
    assert main(["eval", str(config_file), "--out", str(out), "--quiet"]) == 0
    result = json.loads(out.read_text())
    # A fresh trainer's LoRA is a no-op (B = 0), so its evaluation is the base model's.
    metrics = Trainer(load_config(data=data)).evaluate(0, save_images=False)
    assert result["num_samples"] == 6
    assert [s["prompt"] for s in result["samples"]] == (
        ["a green cat"] * 3 + ["a red square", "a blue circle", "a red square"])
    assert result["rewards"]["brightness"]["mean"] == pytest.approx(metrics["eval/brightness"],
                                                                    abs=1e-6)
    for family in ("animals", "shapes"):
        assert result["families"][family]["brightness"]["mean"] == pytest.approx(
            metrics[f"eval/brightness/{family}"], abs=1e-6)
    assert result["family_mean"]["brightness"] == pytest.approx(
        metrics["eval/brightness/family_mean"], abs=1e-6)
    # the trainer's eval records carry the same standard errors (<metric>/se)
    assert result["rewards"]["brightness"]["se"] == pytest.approx(metrics["eval/brightness/se"],
                                                                  abs=1e-6)
    for family in ("animals", "shapes"):
        entry = result["families"][family]["brightness"]
        assert entry["se"] == pytest.approx(entry["std"] / entry["count"] ** 0.5, abs=1e-9)
        assert entry["se"] == pytest.approx(metrics[f"eval/brightness/{family}/se"], abs=1e-6)
    assert metrics["eval/brightness/animals/se"] > 0
    assert result["family_mean_se"]["brightness"] == pytest.approx(
        metrics["eval/brightness/family_mean/se"], abs=1e-6)
    assert metrics["eval/brightness/family_mean/se"] == pytest.approx(
        (metrics["eval/brightness/animals/se"] ** 2 + metrics["eval/brightness/shapes/se"] ** 2)
        ** 0.5 / 2, abs=1e-9)


# ------------------------------------------------------------------------------ errors
def _write_lora(folder: Path, shapes: dict[str, tuple[int, int]]) -> Path:
    """A diffusers-format LoRA file adapting modules {name: (out, in)} at rank 2."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (out, inp) in shapes.items():
        tensors[f"transformer.{module}.lora_A.weight"] = torch.zeros(2, inp)
        tensors[f"transformer.{module}.lora_B.weight"] = torch.zeros(out, 2)
    save_file(tensors, str(folder / "pytorch_lora_weights.safetensors"))
    return folder


def _error_cases(root: Path, lora_checkpoint: Path) -> dict[str, tuple[list[str], str]]:
    prompts = str(root / "prompts.txt")
    (root / "empty.txt").write_text("\n  \n")
    (root / "a_file").write_text("not a folder")
    foreign = _write_lora(root / "flux_lora", {"single_transformer_blocks.0.attn.to_q": (16, 16)})
    wrong_shape = _write_lora(root / "shape_lora", {"transformer_blocks.0.attn.to_q": (16, 7)})
    other_run = root / "runs" / "toyrun"
    toy_ckpt = other_run / "checkpoints" / "5"
    toy_ckpt.mkdir(parents=True, exist_ok=True)
    (toy_ckpt / "pytorch_lora_weights.safetensors").write_bytes(
        (lora_checkpoint / "pytorch_lora_weights.safetensors").read_bytes())
    (other_run / "config.yaml").write_text(yaml.safe_dump({"model": {"family": "toy"}}))
    flux_state = _write_lora(root / "flux_state", {"transformer_blocks.0.attn.to_q": (16, 16)})
    (flux_state / "trainer_state.json").write_text(json.dumps({"iteration": 1, "family": "flux"}))
    full_other = root / "full_other" / "transformer"
    full_other.mkdir(parents=True, exist_ok=True)
    (full_other / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    save_file({"pos_embed.proj.weight": torch.zeros(8, 3, 2, 2)},
              str(full_other / "diffusion_pytorch_model.safetensors"))
    out = str(root / "out")
    return {
        "missing_checkpoint": (["--lora", str(root / "nope")], "does not exist"),
        "foreign_lora_keys": (["--lora", str(foreign)], "no module single_transformer_blocks.0"),
        "lora_shape": (["--lora", str(wrong_shape)], "transformer_blocks.0.attn.to_q is (16, 16)"),
        "config_family": (["--lora", str(toy_ckpt)], "trained on model family 'toy'"),
        "state_family": (["--lora", str(flux_state)], "trained on model family 'flux'"),
        "full_mismatch": (["--lora", str(full_other.parent)], "parameters differ"),
        "empty_prompts": (["--prompts", str(root / "empty.txt")], "holds no prompts"),
        "missing_prompts": (["--prompts", str(root / "missing.txt")], "does not exist"),
        "unwritable_out": (["--out", str(root / "a_file" / "sub")], "not a writable folder"),
        "bad_seeds": (["--seeds", "3-1"], "--seeds range '3-1' is empty"),
        "_defaults": ([prompts, out], ""),
    }


def _argv(command: str, model: str, override: list[str], prompts: str, out: str) -> list[str]:
    args = {"--prompts": prompts, "--out": out, "--seeds": "0"}
    checkpoint = None
    for flag, value in zip(override[::2], override[1::2]):
        if flag == "--lora":
            checkpoint = value
        else:
            args[flag] = value
    argv = [command, "--model", model, *OPTION_ARGS, "--steps", "1", "--quiet"]
    if command == "grid":
        argv += ["--checkpoints", "base"] + ([checkpoint] if checkpoint else [])
        args["--out"] = str(Path(args["--out"]) / "grid.png")
    elif checkpoint:
        argv += ["--lora", checkpoint]
    if command == "eval":
        argv += ["--rewards", "tests.helpers:Brightness"]
        args["--out"] = str(Path(args["--out"]) / "eval.json")
    for flag, value in args.items():
        argv += [flag, value]
    return argv


ERROR_CASES = ["missing_checkpoint", "foreign_lora_keys", "lora_shape", "config_family",
               "state_family", "full_mismatch", "empty_prompts", "missing_prompts", "unwritable_out", "bad_seeds"]


@pytest.mark.parametrize("command", ["sample", "grid", "eval"])
@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_input_exits_2_naming_the_problem_before_any_model_loads(
        case, command, tiny_sd3_path, workdir, lora_checkpoint, monkeypatch, capsys):
    import pipelines

    cases = _error_cases(workdir, lora_checkpoint)
    prompts, out = cases["_defaults"][0]
    override, message = cases[case]

    def refuse(*args, **kwargs):
        raise AssertionError("pipelines.load_model was called before the error was raised")

    monkeypatch.setattr(pipelines, "load_model", refuse)
    fail_on_weight_loading(monkeypatch)
    code = main(_argv(command, f"sd3:{tiny_sd3_path}", override, prompts, out))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"flowgrpo {command}: error:") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_unknown_family_and_missing_model_folder_fail_fast(workdir, monkeypatch, capsys):
    import pipelines

    monkeypatch.setattr(pipelines, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["sample", "--model", "sdxl:x", "--prompts", "a cat", "--out",
                 str(workdir / "o")]) == 2
    assert "family 'sdxl' is unknown" in capsys.readouterr().err
    assert main(["sample", "--model", f"sd3:{workdir / 'no_model'}", "--prompts", "a cat",
                 "--out", str(workdir / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


class FakeVideoModel:
    """A FlowModel whose media are videos (B, F, 3, H, W): exercises the MP4/GIF paths."""

    family = "wan"
    lora_target_modules: list[str] = []

    def __init__(self, frames: int = 4, size: int = 8) -> None:
        self.transformer = torch.nn.Linear(1, 1)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.frames, self.size = frames, size

    def encode_prompts(self, prompts):
        from flowgrpo.model import Conditioning

        return Conditioning(positive={"embeds": torch.tensor([[float(len(p))] for p in prompts])})

    def initial_noise(self, batch, generator):
        return torch.randn(batch, self.frames * 3, self.size, self.size, generator=generator)

    def sigmas(self, num_steps):
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def velocity(self, latents, sigma, cond, guidance_scale):
        return latents * 0.5 + cond.positive["embeds"].view(-1, 1, 1, 1) * 0.01

    def decode(self, latents):
        return torch.sigmoid(latents).view(latents.shape[0], self.frames, 3, self.size, self.size)


def test_video_models_write_mp4_and_gif_samples_and_grids(workdir, monkeypatch):
    import imageio.v2 as imageio_v2
    import imageio.v3 as imageio_v3

    import pipelines

    monkeypatch.setattr(pipelines, "load_model", lambda *args, **kwargs: FakeVideoModel())
    model_dir = workdir / "fake_wan"
    model_dir.mkdir(exist_ok=True)
    common = ["--model", f"wan:{model_dir}", "--prompts", str(workdir / "prompts.txt"),
              "--seeds", "0-1", "--steps", "2", "--guidance", "1", "--fps", "4", "--quiet"]
    assert main(["sample", *common, "--out", str(workdir / "videos")]) == 0
    index = json.loads((workdir / "videos" / "samples.json").read_text())
    assert len(index["samples"]) == 4
    for sample in index["samples"]:
        mp4, gif = (workdir / "videos" / f for f in sample["files"])
        assert mp4.suffix == ".mp4" and gif.suffix == ".gif"
        assert imageio_v3.imread(gif).shape == (4, 8, 8, 3)
    out = workdir / "video_grid" / "grid.png"
    assert main(["grid", *common, "--checkpoints", "base", "--max-rows", "2",
                 "--out", str(out)]) == 0
    summary = json.loads((out.parent / "grid.json").read_text())
    assert [p["file"] for p in summary["pages"]] == ["grid_001.mp4", "grid_002.mp4"]
    for page in summary["pages"]:
        width, height = page["size"]
        assert imageio_v3.imread(out.parent / page["file"].replace(".mp4", ".gif")).shape == \
            (4, height, width, 3)
        with imageio_v2.get_reader(str(out.parent / page["file"])) as reader:
            frames = np.stack([frame for frame in reader.iter_data()])
        assert frames.shape == (4, height, width, 3)


def test_argument_parsers():
    from flowgrpo.commands.common import parse_model, parse_options, parse_reward_specs, parse_seeds

    assert parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert parse_seeds("5") == [5]
    from flowgrpo.cli import build_parser

    for command in ("sample", "grid", "eval"):   # --seeds 0 1 4-5 and --seeds 0,1,4-5 alike
        extra = ["--checkpoints", "base"] if command == "grid" else []
        for given in (["0", "1", "4-5"], ["0,1,4-5"]):
            args = build_parser().parse_args([command, "--model", "toy:x", "--prompts", "p",
                                              "--out", "o", *extra, "--seeds", *given])
            assert parse_seeds(args.seeds) == [0, 1, 4, 5], (command, given)
    with pytest.raises(ValueError, match="twice"):
        parse_seeds("1,0-2")
    with pytest.raises(ValueError, match="--seeds must be"):
        parse_seeds("a")
    assert parse_model("sd3:stabilityai/sd3.5") == ("sd3", "stabilityai/sd3.5")
    assert parse_options(["height=512", "cfg=false", "negative_prompt="]) == \
        {"height": 512, "cfg": False, "negative_prompt": ""}
    assert parse_reward_specs("ocr=1,my.mod:Cls=0.5") == [{"name": "ocr", "weight": 1.0},
                                                          {"name": "my.mod:Cls", "weight": 0.5}]
    assert parse_reward_specs("[{name: ocr, batch_size: 4}, clip_score]") == \
        [{"name": "ocr", "batch_size": 4}, {"name": "clip_score"}]


def test_overrides_may_follow_flags():
    """`flowgrpo train CONFIG --overwrite run.max_iterations=5` (what the quickstart passes):
    key=value words after a flag are overrides; other unknown words are still an error."""
    from flowgrpo import cli

    parser_args = []

    def capture(args):
        parser_args.append(args)
        return 0

    parser = cli.build_parser()
    for action in parser._subparsers._group_actions[0].choices.values():
        action.set_defaults(handler=capture)
    original = cli.build_parser
    cli.build_parser = lambda: parser
    try:
        assert cli.main(["train", "c.yaml", "a.b=1", "--overwrite", "run.max_iterations=5"]) == 0
        assert parser_args[-1].overrides == ["a.b=1", "run.max_iterations=5"]
        assert parser_args[-1].overwrite is True
        with pytest.raises(SystemExit):
            cli.main(["train", "c.yaml", "--overwrite", "--no-such-flag"])
    finally:
        cli.build_parser = original
