"""Built-in configs and assets from any folder (flowgrpo/packaged_data.py): shipped paths resolve
to the shipped copy only when the current folder lacks them, a config file on disk wins over a
built-in name, and ``flowgrpo configs`` lists the built-in configs one line each. The wheel itself
is built and run outside the checkout in tests/test_wheel_install.py (slow)."""
from __future__ import annotations

from pathlib import Path

import pytest

import flowgrpo.packaged_data as packaged_data
from flowgrpo.cli import main
from flowgrpo.config import ConfigError, load_config
from flowgrpo.packaged_data import (accelerate_configs, builtin_configs, config_summary,
                                    resolve_config_path, resolve_packaged_path,
                                    with_packaged_paths)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """An empty current folder outside the checkout."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture
def installed(tmp_path, monkeypatch) -> Path:
    """A stand-in for a wheel's flowgrpo/_packaged: one config, one model folder, one file."""
    root = tmp_path / "site" / "_packaged"
    (root / "configs" / "nested").mkdir(parents=True)
    (root / "configs" / "accelerate").mkdir()
    (root / "assets" / "model").mkdir(parents=True)
    (root / "assets" / "prompts.txt").write_text("a red square\n")
    (root / "configs" / "demo.yaml").write_text("# A demo config. More text.\nname: demo\n")
    (root / "configs" / "nested" / "deep.yaml").write_text("name: deep\n")
    (root / "configs" / "accelerate" / "ddp.yaml").write_text("# DDP here.\nnum_processes: 1\n")
    monkeypatch.setattr(packaged_data, "INSTALLED_DATA_DIR", root)
    return root


# --------------------------------------------------------------------------- where the data is
def test_a_wheels_copy_wins_over_the_checkout(installed):
    assert packaged_data.data_root() == installed


def test_a_checkout_is_its_own_data(monkeypatch, tmp_path):
    monkeypatch.setattr(packaged_data, "INSTALLED_DATA_DIR", tmp_path / "absent")
    assert packaged_data.data_root() == REPO


def test_no_data_leaves_every_path_alone(monkeypatch, elsewhere):
    monkeypatch.setattr(packaged_data, "data_root", lambda: None)
    assert resolve_packaged_path("assets/toy") == "assets/toy"
    assert resolve_config_path("toy_geneval") == Path("toy_geneval")
    assert builtin_configs() == []


# --------------------------------------------------------------------------- shipped paths
def test_a_shipped_path_missing_here_is_the_shipped_copy(installed, elsewhere):
    assert resolve_packaged_path("assets/model") == str(installed / "assets" / "model")
    assert resolve_packaged_path("./assets/prompts.txt") == str(installed / "assets" / "prompts.txt")
    assert resolve_packaged_path("configs/demo.yaml") == str(installed / "configs" / "demo.yaml")


def test_the_users_own_file_wins_over_the_shipped_copy(installed, elsewhere):
    (elsewhere / "assets" / "model").mkdir(parents=True)
    assert resolve_packaged_path("assets/model") == "assets/model"


@pytest.mark.parametrize("value", [
    "assets/not_shipped",          # missing everywhere: fails where it is opened, as named
    "assets",                      # a bare folder name: the user's, not a shipped item
    "assets/../assets/model",      # climbs out: never mapped into the installation
    "toy:train", "stabilityai/stable-diffusion-3.5-medium", "model", "",
    "https://example.com/assets/model",
])
def test_other_values_are_left_alone(installed, elsewhere, value):
    assert resolve_packaged_path(value) == value


def test_absolute_paths_are_left_alone(installed, elsewhere):
    absolute = str(elsewhere / "assets" / "model")
    assert resolve_packaged_path(absolute) == absolute


def test_every_string_of_a_nested_value_resolves(installed, elsewhere):
    value = {"path": "assets/model", "list": ["assets/prompts.txt", 3, "toy:train"],
             "tuple": ("assets/model",), "assets/model": None}
    assert with_packaged_paths(value) == {
        "path": str(installed / "assets" / "model"),
        "list": [str(installed / "assets" / "prompts.txt"), 3, "toy:train"],
        "tuple": (str(installed / "assets" / "model"),), "assets/model": None}


# --------------------------------------------------------------------------- load_config
def test_a_built_in_config_loads_from_any_folder_with_its_assets(elsewhere):
    config = load_config("toy_hacking")
    assert config.name == "toy_hacking"
    assert config.model.path == str(REPO / "assets" / "toy")
    assert config.rewards.components[0].options["path"] == str(REPO / "assets" / "toy_proxy")
    assert config.prompts.train == "toy:train"
    assert config.run.output_dir == "runs"


def test_overrides_and_defaults_resolve_too(elsewhere):
    config = load_config("llm_arith", ["prompts.eval=assets/lm/train.jsonl"])
    assert config.prompts.train == str(REPO / "assets" / "lm" / "train.jsonl")
    assert config.prompts.eval == str(REPO / "assets" / "lm" / "train.jsonl")
    default = load_config(data={"prompts": {"train": "toy:train"},
                                "rewards": {"components": [{"name": "geneval_toy"}]}})
    assert default.model.path == str(REPO / "assets" / "toy")   # the field's default


def test_the_output_folder_never_points_into_the_installation(installed, elsewhere):
    config = load_config(REPO / "configs" / "toy_geneval.yaml",
                         ["run.output_dir=assets/model", "prompts.train=assets/prompts.txt"])
    assert config.prompts.train == str(installed / "assets" / "prompts.txt")   # resolves
    assert config.run.output_dir == "assets/model"                              # never


def test_in_the_checkout_paths_stay_as_written(monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config("configs/toy_geneval.yaml")
    assert config.model.path == "assets/toy"


# --------------------------------------------------------------------------- config names
def test_names_and_checkout_paths_find_the_built_in_config(elsewhere):
    expected = REPO / "configs" / "toy_geneval.yaml"
    for given in ("toy_geneval", "toy_geneval.yaml", "configs/toy_geneval.yaml"):
        assert resolve_config_path(given) == expected, given
    assert resolve_config_path("toy_methods/flow_grpo") == \
        REPO / "configs" / "toy_methods" / "flow_grpo.yaml"


def test_a_config_file_on_disk_wins_over_a_built_in_name(elsewhere):
    (elsewhere / "toy_geneval.yaml").write_text((REPO / "configs" / "toy_geneval.yaml").read_text()
                                                .replace("name: toy_geneval", "name: mine"))
    assert resolve_config_path("toy_geneval.yaml") == Path("toy_geneval.yaml")
    assert load_config("toy_geneval.yaml").name == "mine"
    assert load_config("toy_geneval").name == "toy_geneval"   # no file of that name here


def test_an_unknown_name_says_where_the_names_are(elsewhere):
    with pytest.raises(ConfigError, match=r"config file no_such_recipe does not exist: .*"
                                          r"`flowgrpo configs` lists them"):
        load_config("no_such_recipe")


def test_a_name_cannot_climb_out_of_the_configs(elsewhere):
    assert packaged_data.builtin_config_path("../pyproject.toml") is None
    assert packaged_data.builtin_config_path("") is None


# --------------------------------------------------------------------------- the listing
def test_the_summary_is_the_first_sentence_of_the_top_comment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# Dr. GRPO on the tiny LM (assets/lm, built by scripts/x.py): no std\n"
                    "# scaling. Second sentence.\n#   flowgrpo train c.yaml\nname: c\n")
    assert config_summary(path) == "Dr. GRPO on the tiny LM: no std scaling."
    path.write_text("# " + "word " * 40 + "\nname: c\n")
    assert config_summary(path, width=30) == "word word word word word..."
    path.write_text("name: plain\nmodel: {}\n")
    assert config_summary(path) == "plain"


def test_the_built_in_configs_are_listed_with_a_line_each():
    names = {config.name: config for config in builtin_configs()}
    assert {"toy_geneval", "llm_arith", "toy_methods/flow_grpo"} <= set(names)
    assert not any(name.startswith("accelerate/") for name in names)
    assert names["toy_geneval"].summary.startswith("The embedded default")
    for config in builtin_configs() + accelerate_configs():
        assert config.summary and "\n" not in config.summary, config.name
        assert len(config.summary) <= packaged_data.SUMMARY_WIDTH, config.name
    assert "accelerate/ddp" in {config.name for config in accelerate_configs()}


def test_flowgrpo_configs_prints_names_summaries_and_paths(installed, capsys):
    assert main(["configs"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  demo         A demo config." in out
    assert "  nested/deep  deep" in out
    assert "  accelerate/ddp  DDP here." in out
    assert main(["configs", "--path", "accelerate/ddp"]) == 0
    assert capsys.readouterr().out.strip() == str(installed / "configs" / "accelerate" / "ddp.yaml")


def test_flowgrpo_configs_refuses_an_unknown_name_in_one_line(capsys):
    assert main(["configs", "--path", "no_such_recipe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a built-in config" in err


def test_flowgrpo_configs_into_a_closed_pipe_is_quiet():
    """`flowgrpo configs | head -1` when the reader has left before the listing is written (here
    `true`, which reads nothing): exit 0 and nothing on stderr, not a BrokenPipeError
    traceback."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(f"set -o pipefail; {sys.executable} -m flowgrpo configs | true",
                            shell=True, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60, executable="/bin/bash")
    assert result.stderr == ""
    assert result.returncode == 0
