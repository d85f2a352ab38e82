"""Typed run configuration: dataclasses, YAML loading, dotted overrides, validation.

Every field is checked (name, type, range, combination) before any model is loaded, and every
error names the field and says what to do. ``flowgrpo train --help-config`` prints the help texts.

A config file mirrors ``TrainConfig``::

    name: toy_geneval
    model:    {family: toy, path: assets/toy, lora: {rank: 8}}
    prompts:  {train: "toy:train", eval: "toy:heldout"}
    sampling: {num_steps: 10, kind: flow_sde, noise_level: 0.7, plan: {kind: branch}}
    training: {group_size: 8, prompts_per_iteration: 8, lr: 3.0e-5}
    rewards:  {components: [{name: geneval_toy, score: partial}]}
    run:      {max_iterations: 100, eval_every: 10}
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import yaml

from flowgrpo.checks import choice, config_field
from flowgrpo.config_sections import (FIELD_CHOICES, CurriculumConfig, EmaConfig, EvalConfig,
                                      GardoConfig, LLMConfig, LoraConfig, ModelConfig,
                                      PromptsConfig, RewardsConfig, RewardSpec, RunConfig,
                                      SamplingConfig, TrainingConfig)
from flowgrpo.errors import ConfigError, InputError
from flowgrpo.packaged_data import resolve_config_path, with_packaged_paths
from flowgrpo.plans import PlanConfig
from flowgrpo.step_values import check_vgpo_config
from flowgrpo.embedding_perturbation import check_embedding_perturbation_config
from flowgrpo.tree import check_tree_config
from flowgrpo.policy_registry import POLICIES, load_policy_class
from flowgrpo.user_files import folder_blocker, line_and_column, read_text_file

# Re-exported: the sections are part of this module's public names (``flowgrpo.config.X``).
__all__ = ["ConfigError", "CurriculumConfig", "EmaConfig", "EvalConfig", "GardoConfig",
           "InputError", "LLMConfig", "LoraConfig", "ModelConfig", "PlanConfig", "PromptsConfig",
           "RewardSpec", "RewardsConfig", "RunConfig", "SamplingConfig", "TrainConfig",
           "TrainingConfig", "check_reward_key", "dump_config", "eval_noise_seed", "help_text",
           "json_roundtrip", "load_config", "parse_override", "parse_overrides",
           "read_config_file", "redact", "resume_signature",
           "reward_key", "reward_output_keys", "to_dict", "training_reward_keys", "validate"]


# Option names whose values are secrets, at any depth of the config (compared lower-case, "-"
# read as "_"; a name ending in "_<one of these>" counts too, e.g. hf_token). Redacted from the
# run folder's config.yaml and the trackers' hyper-parameters.
SECRET_OPTION_NAMES = ("token", "api_key", "apikey", "password", "secret")
REDACTED = "***"


@dataclass
class TrainConfig:
    name: str = config_field("Run name: outputs go to <run.output_dir>/<name>/.", default="run")
    policy: str = config_field(
        "Policy type: flow (image/video generators) | llm (causal LMs).", default="flow")
    model: ModelConfig = config_field("The model to train.", default_factory=ModelConfig)
    prompts: PromptsConfig = config_field("Prompt sources.", default_factory=PromptsConfig)
    sampling: SamplingConfig = config_field("Rollout sampler.", default_factory=SamplingConfig)
    training: TrainingConfig = config_field("Optimisation.", default_factory=TrainingConfig)
    rewards: RewardsConfig = config_field("Rewards.", default_factory=RewardsConfig)
    run: RunConfig = config_field("Run bookkeeping.", default_factory=RunConfig)
    llm: LLMConfig = config_field(
        "LLM policy options (policy: llm); see flowgrpo/llm.py.", default_factory=LLMConfig)
    eval: EvalConfig = config_field(
        "Held-out metrics scored at every evaluation, never trained on.",
        default_factory=EvalConfig)


# --------------------------------------------------------------------------- loading

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML value to the annotated type ``tp`` or raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{path}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, path)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    raise ConfigError(f"{path}: unsupported type {tp}")


def _build(cls: type, data: dict, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]!s}; valid keys under "
                          f"'{path or 'top level'}': {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


# The fix named by every error about a config file itself.
CONFIG_FIX = ("give a YAML config file like configs/toy_geneval.yaml, or a built-in config's name "
              "(`flowgrpo configs` lists them)")


def yaml_problem(err: yaml.YAMLError, text: str) -> str:
    """One line saying where and why ``text`` is not valid YAML: the 1-based line and column
    of the problem, the parser's reason and what it was reading ("while parsing a flow
    mapping" and where that started). PyYAML's own message spans several lines and quotes
    the text."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        reason = err.problem or "invalid YAML"
        if err.context:
            start = err.context_mark
            reason += (f" ({err.context}, from line {start.line + 1}, column {start.column + 1})"
                       if start is not None else f" ({err.context})")
    elif isinstance(err, yaml.reader.ReaderError):
        line, column = line_and_column(text, err.position)
        where = f"line {line}, column {column}"
        reason = f"character #x{err.character:04x}: {err.reason}"
    else:
        where, reason = "", str(err)
    reason = " ".join(reason.split())   # PyYAML's texts may hold newlines
    return f"{where}: {reason}" if where else reason


def read_config_file(path: str | Path) -> dict:
    """The mapping of sections in YAML file ``path``. A missing file, a folder, an unreadable or
    non-UTF-8 file, invalid YAML (with its line and column), an empty file and a top level that
    is not a mapping are each a one-line ConfigError naming the file. An empty file is refused
    rather than read as all defaults: a config that names no model, prompts or rewards is a
    mistake, not a run. ``load_config`` and ``flowgrpo train --tiny`` read configs with it.
    ``path`` may also be a built-in config's name (``toy_geneval``) or a checkout-relative path
    (``configs/toy_geneval.yaml``) outside a checkout: ``packaged_data.resolve_config_path``;
    a file that exists on disk always wins."""
    path = resolve_config_path(path)
    text = read_text_file(path, "config file", CONFIG_FIX, ConfigError)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML at "
                          f"{yaml_problem(err, text)}") from None
    except RecursionError:   # PyYAML composes nested collections recursively
        raise ConfigError(f"config file {path} nests collections too deeply to read: "
                          f"{CONFIG_FIX}") from None
    if raw is None or raw == {}:
        raise ConfigError(f"config file {path} holds no settings (it is empty, only comments "
                          f"or {{}}): a config needs at least its model, prompts and rewards "
                          f"sections; start from one in configs/")
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections "
                          f"(name:, model:, prompts:, ...), got a {type(raw).__name__}")
    return raw


def parse_override(item: str) -> tuple[str, Any]:
    """``"training.lr=1e-4"`` -> ("training.lr", 1e-4): the dotted key and the YAML-read value.
    A word without "=", an empty key or key part (``=3``, ``training..lr``) and a value that is
    not valid YAML (``[1e-4``) are ConfigErrors naming the override."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has no key before '=': it must look like "
                          f"section.key=value, e.g. training.lr=1e-4")
    if any(not part.strip() for part in key.split(".")):
        raise ConfigError(f"override {item!r}: the key {key!r} has an empty part (a doubled, "
                          f"leading or trailing '.'); it must look like section.key=value")
    if not raw.strip():
        return key, ""
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: the value is not valid YAML "
                          f"({yaml_problem(err, raw)}); close its brackets and quotes, or quote "
                          f"a text value, e.g. {key}='...'") from None


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["training.lr=1e-4", "run.seed=3"]`` -> [(dotted key, YAML-parsed value)]."""
    return [parse_override(item) for item in overrides]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                data: dict | None = None) -> TrainConfig:
    """Read a YAML file (``read_config_file``, or ``data``), apply dotted overrides, build and
    validate the config."""
    raw: dict = {}
    if path is not None:
        raw = read_config_file(path)
    if data is not None:
        # Deep-copied so that overrides never write into the caller's dicts.
        raw = _merge(raw, copy.deepcopy(data))
    for key, value in parse_overrides(overrides or []):
        _set_dotted(raw, key, value)
    config = _build(TrainConfig, raw, "")
    # Shipped assets (model.path: assets/toy) resolve from any folder; a path that exists
    # relative to the current folder is kept (flowgrpo/packaged_data.py).
    with_packaged_paths(config)
    validate(config)
    return config


def _merge(base: dict, extra: dict, path: str = "") -> dict:
    """``extra`` merged over ``base``, section by section. A section of ``extra`` over a value of
    ``base`` that is neither a section nor null is an error naming the field: merged blindly,
    the extra section would replace the wrong value (``training: 5`` in a file under
    ``--tiny``'s patch) and hide it."""
    out = dict(base)
    for k, v in extra.items():
        where = f"{path}.{k}" if path else str(k)
        old = out.get(k)
        if isinstance(v, dict) and isinstance(old, dict):
            out[k] = _merge(old, v, where)
        elif isinstance(v, dict) and old is not None:
            raise ConfigError(f"{where}: expected a mapping, got {old!r}")
        else:
            out[k] = v
    return out


def to_dict(config: Any) -> Any:
    """Plain-Python (YAML-safe) form of a config."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def is_secret_name(key: Any) -> bool:
    """Whether an option called ``key`` holds a secret (token, api_key, password, secret; any
    case, "-" or "_", and names ending in "_token" etc.). ``token_env`` names a variable, not a
    secret, and stays visible."""
    if not isinstance(key, str):
        return False
    name = key.lower().replace("-", "_")
    return name in SECRET_OPTION_NAMES or name.endswith(tuple(f"_{s}" for s in SECRET_OPTION_NAMES))


def redact(tree: Any) -> Any:
    """A copy of a plain config tree (``to_dict``) with every secret-named value, at any depth,
    replaced by ``REDACTED``: what config dumps and trackers get."""
    if isinstance(tree, dict):
        return {k: (REDACTED if is_secret_name(k) and v is not None else redact(v))
                for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [redact(v) for v in tree]
    return tree


def dump_config(config: TrainConfig, path: str | Path) -> None:
    """Write the config as YAML with secrets redacted (``redact``): the file is for reading and
    re-running, and a token in it would leak to whoever can read the run folder."""
    Path(path).write_text(yaml.safe_dump(redact(to_dict(config)), sort_keys=False))


def resume_signature(config: TrainConfig) -> dict[str, Any]:
    """The config fields a checkpoint's weights and optimiser state are only valid for: the
    model, the LoRA layout and the sampling plan. Stored in every checkpoint and compared on
    resume (``run_folder.open_run``); everything else (lr, iterations, logging) may change."""
    m = config.model
    return {
        "policy": config.policy,
        "model.family": m.family,
        "model.path": m.path,
        "model.lora.enabled": m.lora.enabled,
        "model.lora.rank": m.lora.rank if m.lora.enabled else None,
        "model.lora.alpha": m.lora.alpha if m.lora.enabled else None,
        "model.lora.target_modules": (list(m.lora.target_modules)
                                      if m.lora.enabled and m.lora.target_modules is not None
                                      else None),
        "sampling.num_steps": config.sampling.num_steps,
        "sampling.plan": to_dict(config.sampling.plan) if config.policy == "flow" else None,
    }


def eval_noise_seed(config: TrainConfig) -> int:
    """The seed of the evaluation noise: ``prompts.eval_seed``, or ``run.seed`` when it is None."""
    seed = config.prompts.eval_seed
    return config.run.seed if seed is None else seed


def json_roundtrip(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists), for comparisons with what a
    checkpoint stored."""
    return json.loads(json.dumps(value))


# --------------------------------------------------------------------------- validation

def validate(config: TrainConfig, num_processes: int = 1) -> None:
    """Every rule, each in one home: finite numbers, the top-level fields, each section's own
    rules (``<Section>.validate``, ``config_sections.py``), the rules across sections
    (``_cross_section_rules``), then the names their registries own, checked by the policy's
    class (``Policy.check_config``: model families, adapter options, reward names). Raises
    ConfigError naming the field and the fix."""
    _check_finite(config)
    choice(config.policy, tuple(POLICIES), "policy")
    if not config.name or config.name in (".", "..") or any(c in config.name for c in "/\\\0"):
        raise ConfigError(f"name must be a non-empty folder name without '/', '\\' and not '.' "
                          f"or '..' (got {config.name!r}): it names the run folder "
                          f"<run.output_dir>/<name>")
    config.model.validate()
    config.prompts.validate()
    config.sampling.validate()
    config.training.validate()
    config.rewards.validate()
    if config.policy == "llm":
        config.llm.validate()
    config.eval.validate()
    config.run.validate()
    _check_output_dir(config.run.output_dir)
    _cross_section_rules(config, num_processes)
    load_policy_class(config.policy).check_config(config)


def _check_output_dir(output_dir: str) -> None:
    """run.output_dir must be, or be creatable as, a folder: a file in its place would otherwise
    fail the run at its first write. Only reads the filesystem (whether the folder is writable
    is the run folder's check when a run opens it, ``run_folder.check_run_folder``: commands
    that only read a run, such as ``flowgrpo eval``, validate configs too)."""
    blocker = folder_blocker(output_dir)
    if blocker is not None:
        where = "is a file" if blocker == Path(os.path.abspath(output_dir)) else \
            f"cannot be a folder: {blocker} is a file"
        raise ConfigError(f"run.output_dir {output_dir} {where}; run.output_dir is the folder "
                          f"that holds the run folders (<output_dir>/<name>/): give a folder")


def _check_finite(node: Any, path: str = "") -> None:
    """Every float field of the config tree must be finite: NaN passes every ``<``/``>`` range
    check, and an inf lr or noise level turns the whole run into NaN without an error."""
    if not dataclasses.is_dataclass(node):
        return
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        name = f"{path}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, name + ".")
            continue
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for index, item in items:
            where = name if index is None else f"{name}[{index}]"
            if dataclasses.is_dataclass(item):    # rewards.components[i]
                _check_finite(item, where + ".")
            elif isinstance(item, float) and not math.isfinite(item):
                default = (f.default if f.default is not dataclasses.MISSING
                           else f.default_factory())
                raise ConfigError(f"{where} must be a finite number (got {item}); set a finite "
                                  f"value (default {default!r}; see flowgrpo train --help-config)")


def _cross_section_rules(config: TrainConfig, num_processes: int) -> None:
    """The rules that relate sections: what applies to the policy, what one option needs of
    another, the batch against the process count, and the reward keys that other options name."""
    m, s, t, r = config.model, config.sampling, config.training, config.rewards
    flow = config.policy == "flow"
    if flow:   # the plan shapes flow rollouts; the LM policy has none
        s.plan.validate(s.num_steps)
    if config.prompts.curriculum.enabled and not flow:
        raise ConfigError("prompts.curriculum.enabled is only supported for policy: flow "
                          "(the llm trainer resamples prompts itself); set it to false")
    if s.log_prob == "unscaled" and t.ratio_norm:
        raise ConfigError("training.ratio_norm (GRPO-Guard) needs the exact log-prob: set "
                          "sampling.log_prob: exact or training.ratio_norm: false")
    if t.loss_scale == "std_over_sqrt_dt" and s.kind == "cps":
        raise ConfigError("training.loss_scale std_over_sqrt_dt divides the SDE's s by "
                          "sqrt(dt), which CPS does not have (its std is sigma_next sin(a pi/2)): "
                          "set training.loss_scale: none or use an SDE sampling.kind")
    if t.kl_reward > 0 and r.aggregation != "weighted_sum":
        raise ConfigError(f"training.kl_reward subtracts the KL from the total reward, which "
                          f"rewards.aggregation: {r.aggregation} does not use: set "
                          f"rewards.aggregation: weighted_sum or training.kl_reward: 0")
    if t.anchor_beta > 0 and not flow:
        raise ConfigError("training.anchor_beta anchors denoising steps of a flow policy; set it "
                          "to 0 for policy: llm")
    if t.optimizer_steps_per_epoch and not flow:
        raise ConfigError("training.optimizer_steps_per_epoch is for policy: flow (it counts "
                          "replay batches); set training.gradient_accumulation_steps instead")
    if not flow and (t.kl_reward or s.sigma_schedule != "model"):
        raise ConfigError("training.kl_reward and sampling.sigma_schedule are for policy: flow; "
                          "leave them at 0 / model")
    if t.mixed_precision == "fp16" and not m.lora.enabled and m.dtype == "float16":
        raise ConfigError("training.mixed_precision fp16 with full fine-tuning needs float32 "
                          "master weights (the loss scaler cannot unscale fp16 gradients): set "
                          "model.dtype: float32 (autocast still computes in fp16), or use LoRA")
    total = t.prompts_per_iteration * t.group_size
    if total % num_processes:
        raise ConfigError(
            f"training.prompts_per_iteration * training.group_size = {total} samples must divide "
            f"evenly over {num_processes} processes: change prompts_per_iteration or group_size")
    if not r.components:
        raise ConfigError("rewards.components is empty: add at least one reward, e.g. "
                          "[{name: geneval_toy}]" if flow else
                          "rewards.components is empty: add a text reward, e.g. "
                          "[{name: exact_match}]")
    _check_eval_rewards(config)
    _check_guards(config)
    _check_select_best(config)
    _check_locality(config)
    _check_algorithm(config, num_processes)
    check_tree_config(config, num_processes)   # sampling.plan.kind: tree (flowgrpo/tree.py)
    check_vgpo_config(config)
    check_embedding_perturbation_config(config)   # E2PO (flowgrpo/embedding_perturbation.py)


def _check_algorithm(config: TrainConfig, num_processes: int) -> None:
    """training.algorithm against the policy, the plan and the process count."""
    t, s = config.training, config.sampling
    if t.algorithm == "grpo":
        if config.policy == "flow" and s.plan.kind == "ode":
            raise ConfigError("sampling.plan.kind 'ode' has no SDE step to train, and "
                              "training.algorithm 'grpo' trains SDE steps: use a plan with SDE "
                              "steps (full, window, branch, one_step) or a sample-based "
                              "algorithm (nft, awm, dgpo, dpo, gdro)")
        return
    if config.policy != "flow":
        raise ConfigError(f"training.algorithm {t.algorithm!r} trains flow-matching models; "
                          f"policy: llm trains with grpo (set training.algorithm: grpo)")
    if s.plan.kind == "ode" and s.share_initial_noise:
        raise ConfigError("sampling.plan.kind 'ode' with sampling.share_initial_noise: every "
                          "sample of a group would be the same image (a deterministic sampler "
                          "from one noise), so no group has reward variance: set "
                          "sampling.share_initial_noise: false")
    per_process = t.prompts_per_iteration * t.group_size // num_processes
    if t.algorithm in ("dgpo", "dpo", "gdro") and per_process % t.group_size:
        raise ConfigError(f"training.algorithm {t.algorithm!r} compares the samples of a group "
                          f"with each other, so each process must hold whole groups: "
                          f"{per_process} samples per process is not a multiple of "
                          f"training.group_size {t.group_size}; change prompts_per_iteration "
                          f"so that it divides by the {num_processes} processes")


def _check_locality(config: TrainConfig) -> None:
    """training.locality replaces the scalar advantage of a sample by two region advantages of
    its own reward keys, so the options that reshape the scalar advantage or the scalar log-ratio
    do not compose with it. Its keys are checked against the rewards by the flow policy."""
    t, r = config.training, config.rewards
    if not t.locality.enabled:
        return
    why = ("training.locality gives each sample two advantages, from locality.edit_key and "
           "locality.keep_key, applied to the two regions of the latents")
    if config.policy != "flow":
        raise ConfigError(f"{why}; it is for policy: flow (images): set training.locality.mask: "
                          f"off")
    conflicts = [(r.aggregation != "weighted_sum",
                  f"rewards.aggregation: {r.aggregation} (set weighted_sum)"),
                 (r.saturation_ratio != 0, "rewards.saturation_ratio (set 0)"),
                 (t.kl_reward > 0, "training.kl_reward, which changes the total (set 0)"),
                 (t.gardo.diversity, "training.gardo.diversity, which scales the scalar "
                                     "advantage (set false)"),
                 (t.ratio_norm, "training.ratio_norm, a log-ratio of the whole step (set false)")]
    for conflict, what in conflicts:
        if conflict:
            raise ConfigError(f"{why}; it does not combine with {what}, or set "
                              f"training.locality.mask: off")


# What the LM policy's evaluation reports besides its rewards, as eval/<key> (flowgrpo/llm.py).
LLM_EVAL_KEYS = ("accuracy", "completion_length", "truncated_fraction")


def reward_key(spec: RewardSpec) -> str:
    """The key a spec's scores are logged under, as far as the config tells: ``options.label``,
    else the name (for ``module:Class``, the class's name; such a class may name itself
    otherwise, so the loaded rewards' keys are compared again when they load)."""
    label = spec.options.get("label")
    if label is not None:
        return label if isinstance(label, str) else repr(label)
    return spec.name.rpartition(":")[2].rpartition(".")[2] if ":" in spec.name else spec.name


def training_reward_keys(config: TrainConfig) -> set[str]:
    """Keys the evaluation logs for the training rewards (eval/<key>): every component's key,
    ``total``, and for the LM policy its other metrics and DAPO's ``overlong`` shaping."""
    keys = {reward_key(spec) for spec in config.rewards.components} | {"total"}
    if config.policy == "llm":
        keys |= set(LLM_EVAL_KEYS)
        if config.llm.overlong_buffer > 0:
            keys.add("overlong")
    return keys


def _check_eval_rewards(config: TrainConfig) -> None:
    """eval.rewards: keys that are distinct and differ from the training rewards' (both would
    be logged as eval/<key>), and an evaluation to score."""
    specs = config.eval.rewards
    if not specs:
        return
    if config.prompts.eval is None:
        raise ConfigError("eval.rewards scores the evaluation's samples, but prompts.eval is "
                          "null (no evaluation): set prompts.eval to held-out prompts, or remove "
                          "eval.rewards")
    training = training_reward_keys(config)
    trained = {reward_key(spec) for spec in config.rewards.components}
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        key = reward_key(spec)
        if not key or "." in key or "/" in key:
            raise ConfigError(f"eval.rewards[{i}].options.label {key!r} must be a non-empty "
                              f"name without '.' or '/' (it becomes the metric eval/<label>)")
        if key in training:
            taken_by = ("a reward of rewards.components" if key in trained else
                        "a metric the evaluation reports itself")
            raise ConfigError(f"eval.rewards[{i}] ({spec.name}) would be logged as eval/{key}, "
                              f"which is already {taken_by}: give it another key with "
                              f"options: {{label: {key}_heldout}}")
        if key in seen:
            raise ConfigError(f"eval.rewards[{i}] and eval.rewards[{seen[key]}] are both logged "
                              f"as eval/{key}: give one of them another key with options.label")
        seen[key] = i


def _check_select_best(config: TrainConfig) -> None:
    """run.select_best_on names a metric the evaluation logs, of a training or held-out
    reward."""
    key = config.run.select_best_on
    if key is None:
        return
    if config.prompts.eval is None:
        raise ConfigError("run.select_best_on needs evaluations, but prompts.eval is null: set "
                          "prompts.eval to held-out prompts, or run.select_best_on: null")
    keys = training_reward_keys(config) | {reward_key(s) for s in config.eval.rewards}
    valid = ", ".join(f"eval/{k}" for k in sorted(keys))
    rest = key[len("eval/"):] if key.startswith("eval/") else ""
    head = rest.split("/")[0].split(".")[0]
    # A 'module:Class' reward without a label may name itself otherwise than its class: its key
    # is known once it loads (the trainer checks the first evaluation's record then).
    unsure = any(":" in s.name and "label" not in s.options
                 for s in [*config.rewards.components, *config.eval.rewards])
    if not rest or (head not in keys and not unsure):
        raise ConfigError(f"run.select_best_on {key!r} is not a metric of a reward this run "
                          f"evaluates: it must start with one of {valid} (then optionally "
                          f".<component>, /<family> or /family_mean)")
    if key.endswith("/se"):
        raise ConfigError(f"run.select_best_on {key!r} is a standard error, not a metric: drop "
                          f"the /se")


def _check_guards(config: TrainConfig) -> None:
    """What training.gardo and rewards.saturation_ratio need of the policy, the KL terms and the
    rewards. The reward keys the KL gate names are checked with the rewards' own outputs
    (``reward_output_keys``, from the policy's ``check_config``)."""
    g, t, r = config.training.gardo, config.training, config.rewards
    flow_only = []
    if g.kl_gate:
        flow_only.append("training.gardo.kl_gate_key / kl_gate_auxiliary")
    if g.refresh:
        flow_only.append("training.gardo.refresh_every / refresh_kl")
    if g.diversity:
        flow_only.append("training.gardo.diversity")
    if flow_only and config.policy != "flow":
        raise ConfigError(f"{flow_only[0]} is for policy: flow (the guards act on flow "
                          f"transitions and images); switch it off for policy: {config.policy}")
    if g.kl_gate and t.kl_beta == 0:
        raise ConfigError("training.gardo.kl_gate_key / kl_gate_auxiliary gate the KL term, but "
                          "training.kl_beta is 0: set kl_beta > 0 (e.g. 0.04) or remove the gate")
    if g.refresh and t.kl_beta == 0 and t.kl_reward == 0:
        raise ConfigError("training.gardo.refresh_every / refresh_kl refresh the KL reference, "
                          "which no term uses: set training.kl_beta > 0 (or kl_reward > 0), or "
                          "set refresh_every and refresh_kl to 0")
    if r.saturation_ratio != 0:
        # the llm policy adds DAPO's overlong shaping as one more weighted component
        weighted = sum(spec.weight != 0 for spec in r.components) + int(
            config.policy == "llm" and config.llm.overlong_buffer > 0)
        if weighted < 2:
            raise ConfigError(f"rewards.saturation_ratio weighs several reward components "
                              f"against each other, and {weighted} component(s) have a "
                              f"non-zero weight: add components or set saturation_ratio: 0")
        if t.kl_reward > 0:
            raise ConfigError("rewards.saturation_ratio recomputes the total from the weighted "
                              "components, which would drop training.kl_reward's KL term: set "
                              "one of them to 0")


def reward_output_keys(config: TrainConfig,
                       declared_components: Callable[[str, dict], tuple[str, ...] | None]
                       ) -> dict[str, tuple[str, ...] | None] | None:
    """The main-score keys the config's rewards will output, each with its known component
    names (None: known only once the reward loads), plus "total"; None when some key itself is
    known only at load (a ``module:Class`` reward without a ``label``).
    ``declared_components(name, options)``: what the reward registry knows of a reward's
    components before it loads (``reward_models.declared_components``)."""
    keys: dict[str, tuple[str, ...] | None] = {"total": ()}
    for spec in config.rewards.components:
        label = spec.options.get("label")
        if label is None and ":" in spec.name:
            return None
        keys[label if label is not None else spec.name] = \
            declared_components(spec.name, spec.options)
    return keys


def check_reward_key(key: str, field_name: str, known: dict[str, tuple[str, ...] | None]) -> None:
    """ConfigError naming ``field_name`` unless ``key`` ('<key>' or '<key>.<component>') can be
    one of the reward outputs ``known`` (``reward_output_keys``, or the loaded rewards' keys)."""
    main, _, component = key.partition(".")
    if main not in known:
        raise ConfigError(f"{field_name}: {key!r} names no reward output; the rewards output "
                          f"{', '.join(sorted(known))} (and '<key>.<component>' for rewards with "
                          f"components): use one of them")
    components = known[main]
    if component and components is not None and component not in components:
        listed = ", ".join(f"{main}.{c}" for c in components) or f"none for {main!r}"
        raise ConfigError(f"{field_name}: reward {main!r} has no component {component!r}; its "
                          f"components: {listed}")


def help_text(cls: type = TrainConfig, prefix: str = "",
              choices: Mapping[str, Sequence[str]] | None = None) -> str:
    """One line per field: dotted name, type, default and help (``--help-config``), then the
    values a choice field takes: ``FIELD_CHOICES`` (and ``policy``'s), and ``choices``, the
    names the registries own (model families, reward names), which the command line adds."""
    every = {"policy": tuple(POLICIES), **FIELD_CHOICES, **(choices or {})}
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{name}: {f.metadata.get('help', '')}")
            lines.append(help_text(tp, name + ".", choices))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        listed = f" Choices: {', '.join(every[name])}." if name in every else ""
        lines.append(f"  {name} ({_type_name(tp)}, default {default!r}): "
                     f"{f.metadata.get('help', '')}{listed}")
    return "\n".join(lines)
