"""A wheel that works without the clone: build the sdist and the wheel from it (what ``python -m
build`` does), install the wheel into a fresh virtual environment outside the checkout, and from
an empty folder run ``flowgrpo train toy_geneval`` and ``flowgrpo configs``.

The fresh environment sees the dependencies (torch, diffusers, ...) through a .pth file naming
this environment's site-packages, added after the install (so that pip never sees the editable
flowgrpo installed there); the checkout itself is not importable, which the test asserts.
Offline: the builds use this environment's setuptools (``--no-build-isolation``).
Run: .venv/bin/python -m pytest -q -m slow tests/test_wheel_install.py
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# What a build reads: the metadata, the build step, the packages and the shipped folders.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "flowgrpo", "pipelines",
                "reward_models", "configs", "assets")
PACKAGED = "flowgrpo/_packaged"
TIMEOUT_S = 300
# Short, CPU-friendly: 2 iterations of 2 groups of 4, 4 steps, 1 eval prompt per family.
TRAIN_OVERRIDES = ("run.max_iterations=2", "run.eval_every=0", "run.checkpoint_every=0",
                   "training.prompts_per_iteration=2", "training.group_size=4",
                   "training.gradient_accumulation_steps=1", "sampling.num_steps=4",
                   "sampling.eval_num_steps=4", "sampling.rollout_batch_size=8",
                   "prompts.eval_per_family=1", "prompts.eval_seeds=1",
                   "run.comparison_grid=false", "run.tracker=none", "run.progress=false",
                   "run.num_threads=1")

pytestmark = pytest.mark.slow


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def shipped_asset_paths() -> set[str]:
    """Every ``assets/...`` value in the shipped configs that names a shipped file or folder
    (the fetched prompt sets are downloaded by users, not shipped)."""
    found: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)
        elif isinstance(node, str) and re.match(r"assets/(?!prompts/fetched/)", node):
            found.add(node)

    for path in (REPO / "configs").rglob("*.yaml"):
        visit(yaml.safe_load(path.read_text()))
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from the sdist of a copy of the build inputs (the shared checkout gets no
    build/ or egg-info from the test)."""
    root = tmp_path_factory.mktemp("wheel_build")
    source, dist = root / "source", root / "dist"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, source / name)
    build_sdist = ("import sys; from setuptools import build_meta; "
                   "print(build_meta.build_sdist(sys.argv[1]))")
    sdist = dist / run([sys.executable, "-c", build_sdist, str(dist)], source
                       ).stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        # the "data" filter (no links out, no special files) where this Python has it
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(root / "unpacked", **safe)
    unpacked = next((root / "unpacked").iterdir())
    run([sys.executable, "-m", "pip", "wheel", str(unpacked), "--no-deps",
         "--no-build-isolation", "--quiet", "-w", str(dist)], root)
    return next(dist.glob("flowgrpo-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh environment holding the wheel, with this environment's dependencies visible."""
    folder = tmp_path_factory.mktemp("wheel_venv") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(folder)], folder.parent)
    python = folder / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--quiet", str(wheel)], folder.parent)
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               folder.parent).stdout.strip()
    dependencies = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "flowgrpo_test_dependencies.pth").write_text("\n".join(sorted(dependencies)))
    return folder


@pytest.fixture
def empty_folder(tmp_path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def clean_env(tmp_path: Path) -> dict[str, str]:
    """No PYTHONPATH (the checkout must not be importable), offline, caches under tmp_path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               FLOWGRPO_TINY_DIR=str(tmp_path / "tiny"), MPLCONFIGDIR=str(tmp_path / "mpl"))
    return env


def test_the_wheel_ships_the_configs_and_assets_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert f"{PACKAGED}/configs/toy_geneval.yaml" in names
    assert f"{PACKAGED}/configs/toy_methods/flow_grpo.yaml" in names
    assert f"{PACKAGED}/configs/accelerate/ddp.yaml" in names
    assert f"{PACKAGED}/assets/toy/transformer/diffusion_pytorch_model.safetensors" in names
    for path in shipped_asset_paths():
        assert any(name.startswith(f"{PACKAGED}/{path}") for name in names), path
    tops = {name.split("/")[0] for name in names}
    assert tops == {"flowgrpo", "pipelines", "reward_models", "flowgrpo-0.1.0.dist-info"}, tops
    assert not any("/prompts/fetched/" in name or "__pycache__" in name for name in names)


def test_flowgrpo_train_a_built_in_config_from_an_empty_folder(venv, empty_folder, tmp_path):
    env = clean_env(tmp_path)
    where = json.loads(run([str(venv / "bin" / "python"), "-c",
                            "import json, sys, flowgrpo, flowgrpo.packaged_data as p; "
                            "print(json.dumps([flowgrpo.__file__, str(p.data_root()), sys.path]))"],
                           empty_folder, env).stdout)
    package, data, path = where
    assert Path(package).is_relative_to(venv) and Path(data).is_relative_to(venv), where
    assert not any(Path(entry or empty_folder).resolve() == REPO for entry in path), path

    result = run([str(venv / "bin" / "flowgrpo"), "train", "toy_geneval", *TRAIN_OVERRIDES],
                 empty_folder, env)
    run_dir = empty_folder / "runs" / "toy_geneval"
    assert (run_dir / "checkpoints" / "2" / "COMPLETE.json").is_file(), result.stderr[-3000:]
    model_path = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"]
    assert Path(model_path).is_relative_to(venv), model_path
    assert sorted(p.name for p in empty_folder.iterdir()) == ["runs"]   # nothing else written


def test_flowgrpo_configs_lists_the_shipped_configs(venv, empty_folder, tmp_path):
    env = clean_env(tmp_path)
    listing = run([str(venv / "bin" / "flowgrpo"), "configs"], empty_folder, env).stdout
    assert re.search(r"^  toy_geneval +The embedded default", listing, re.MULTILINE), listing
    assert re.search(r"^  accelerate/ddp +DDP", listing, re.MULTILINE), listing
    path = run([str(venv / "bin" / "flowgrpo"), "configs", "--path", "accelerate/ddp"],
               empty_folder, env).stdout.strip()
    assert Path(path).is_relative_to(venv) and Path(path).is_file(), path
