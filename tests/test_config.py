"""Config loading: types, unknown keys, dotted overrides, impossible combinations — all before any
model loads, each error naming the field."""
import pytest

from flowgrpo.config import ConfigError, help_text, load_config, to_dict, validate


def base(**sections):
    data = {"rewards": {"components": [{"name": "jpeg_compressibility"}]}}
    data.update(sections)
    return data


def test_defaults_load_and_round_trip(tmp_path):
    config = load_config(data=base())
    assert config.training.group_size == 8
    assert config.sampling.plan.kind == "full"
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump(to_dict(config)))
    assert to_dict(load_config(path)) == to_dict(config)


def test_dotted_overrides_are_typed():
    config = load_config(data=base(), overrides=["training.lr=1e-5", "sampling.plan.kind=branch",
                                                  "training.adam_betas=[0.8, 0.9]"])
    assert config.training.lr == pytest.approx(1e-5)
    assert config.sampling.plan.kind == "branch"
    assert config.training.adam_betas == (0.8, 0.9)


@pytest.mark.parametrize("override, field", [
    ("training.lrr=1", "training.lrr"),
    ("training.group_size=two", "training.group_size"),
    ("sampling.kind=ddim", "sampling.kind"),
    ("sampling.noise_level=-0.1", "sampling.noise_level"),
    ("training.adv_scale=zscore", "training.adv_scale"),
    ("model.family=sdxl", "model.family"),
    ("run.tracker=mlflow", "run.tracker"),
    ("training.use_8bit_adam=maybe", "training.use_8bit_adam"),
])
def test_bad_field_is_named(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(data=base(), overrides=[override])


def test_group_size_one_with_group_scaling_is_refused():
    with pytest.raises(ConfigError, match="group_size"):
        load_config(data=base(), overrides=["training.group_size=1"])
    # Dr.GRPO-style 'none' scaling with one sample is still meaningless? It is allowed: mean only.
    assert load_config(data=base(), overrides=["training.group_size=1",
                                               "training.adv_scale=none"]).training.group_size == 1


def test_batch_must_divide_over_processes():
    config = load_config(data=base(), overrides=["training.prompts_per_iteration=3",
                                                 "training.group_size=3"])
    with pytest.raises(ConfigError, match="processes"):
        validate(config, num_processes=2)


def test_empty_rewards_refused():
    with pytest.raises(ConfigError, match="rewards.components"):
        load_config(data={})


def test_plan_fields_validated():
    with pytest.raises(ConfigError, match="plan"):
        load_config(data=base(), overrides=["sampling.plan.kind=zigzag"])


def test_help_lists_every_section():
    text = help_text()
    for name in ("training.clip_low", "sampling.plan.kind", "model.lora.rank", "run.seed"):
        assert name in text


def test_help_lists_what_every_registry_holds():
    """``--help-config`` and the sub-commands' ``--model`` help name every model family, plan
    kind, SDE kind and reward of the registries, each on the line of the field that takes it."""
    import re

    from flowgrpo.cli import build_parser, config_help
    from flowgrpo.plans import PLAN_KINDS
    from flowgrpo.sde import STOCHASTIC_STEPS
    from pipelines import MODEL_FAMILIES
    from reward_models import available_rewards

    lines = {line.strip().split(" ")[0]: line for line in config_help().splitlines()}

    def missing(field, names):
        return [n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)",
                                                  lines[field])]

    assert not missing("model.family", MODEL_FAMILIES)
    assert not missing("sampling.plan.kind", PLAN_KINDS)
    assert not missing("sampling.kind", STOCHASTIC_STEPS)
    assert not missing("rewards.components", available_rewards())
    assert not missing("eval.rewards", available_rewards())
    assert missing("model.family", ["no_such_family"]) == ["no_such_family"]   # the check bites
    commands = build_parser()._subparsers._group_actions[0].choices
    for command in ("sample", "eval", "grid"):
        model = next(a for a in commands[command]._actions if a.dest == "model")
        assert all(family in model.help for family in MODEL_FAMILIES), command


CONFIGS = sorted((__import__("pathlib").Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_validate(path):
    config = load_config(path)
    assert config.name == path.stem


def test_cli_reports_bad_config_in_one_line(tmp_path, capsys):
    from flowgrpo.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text("training: {group_size: 1}\nrewards: {components: [{name: jpeg_compressibility}]}\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "training.group_size" in err and "Traceback" not in err


def test_eval_seed_defaults_to_the_run_seed_and_is_validated():
    from flowgrpo.config import eval_noise_seed

    assert load_config(data=base(), overrides=["run.seed=3"]).prompts.eval_seed is None
    assert eval_noise_seed(load_config(data=base(), overrides=["run.seed=3"])) == 3
    assert eval_noise_seed(load_config(data=base(), overrides=["run.seed=3",
                                                               "prompts.eval_seed=0"])) == 0
    with pytest.raises(ConfigError, match=r"prompts\.eval_seed"):
        load_config(data=base(), overrides=["prompts.eval_seed=-1"])


def test_overrides_do_not_mutate_the_callers_data():
    data = base(training={"lr": 1e-4})
    load_config(data=data, overrides=["training.lr=1e-5", "training.ratio_norm=true"])
    assert data["training"] == {"lr": 1e-4}


def test_every_section_rejects_a_bad_value_when_it_is_built():
    """Sections check themselves in __post_init__ (checks.Section): a bad value fails at
    construction, naming the field, not only when the whole config is validated."""
    import dataclasses

    from flowgrpo.checks import Section
    from flowgrpo.config import (EmaConfig, GardoConfig, LoraConfig, RunConfig, SamplingConfig,
                                 TrainingConfig)
    from flowgrpo.config_algorithms import TimestepsConfig

    cases = [(TrainingConfig, {"lr": -1.0}, "training.lr"),
             (TrainingConfig, {"group_size": 0}, "training.group_size"),
             (SamplingConfig, {"num_steps": 0}, "sampling.num_steps"),
             (RunConfig, {"save_on_signal": ["SIGKILL"]}, "run.save_on_signal"),
             (EmaConfig, {"enabled": True, "decay": 2.0}, "training.ema.decay"),
             (LoraConfig, {"rank": 0}, "model.lora.rank"),
             (GardoConfig, {"kl_gate_fraction": 1.5}, "training.gardo.kl_gate_fraction"),
             (TimestepsConfig, {"count": 0}, "training.timesteps.count")]
    for section, values, field in cases:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            section(**values)
        default = section()   # the defaults are valid
        with pytest.raises(ConfigError):
            dataclasses.replace(default, **values)   # replace builds a new section
    import flowgrpo.config_algorithms as algorithms
    import flowgrpo.config_sections as sections
    built = [cls for module in (sections, algorithms) for cls in vars(module).values()
             if dataclasses.is_dataclass(cls) and isinstance(cls, type)
             and "validate" in vars(cls) and cls.__module__ == module.__name__]
    takes_no_argument = [cls for cls in built
                         if cls.validate.__code__.co_argcount == 1]
    assert takes_no_argument and all(issubclass(cls, Section) for cls in takes_no_argument), \
        [cls.__name__ for cls in takes_no_argument if not issubclass(cls, Section)]
