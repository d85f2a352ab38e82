"""``flowgrpo train CONFIG --tiny``: any flow recipe on its family's tiny offline model, on a CPU.

The recipe's method settings are kept as they are: the step count, plan, SDE kind and noise, the
rollout schedule, log-prob convention, clip range, KL (beta, convention, KL reward), advantage
scaling, optimiser steps per epoch, inner epochs, LoRA shape, EMA and the rewards' classes. What
changes is size and place:

- the model is the family's tiny random pipeline (``pipelines.tiny``), built once into
  ``$FLOWGRPO_TINY_DIR/<build>`` (default ``~/.cache/flowgrpo/tiny``) and reused;
- images / videos are ``TINY_HEIGHT x TINY_WIDTH`` (x ``TINY_NUM_FRAMES``), weights float32, no
  mixed precision, no offloading or gradient checkpointing, the default attention;
- an iteration is ``TINY_PROMPTS`` groups of ``TINY_GROUP_SIZE`` samples, rolled out
  ``TINY_ROLLOUT_BATCH`` at a time (a tree plan keeps the recipe's group, its leaves, and rolls
  out one tree at a time); evaluation uses ``TINY_EVAL_PROMPTS`` held-out prompts at the
  training step count; the run is ``TINY_ITERATIONS`` iterations, checkpointed at the end, named
  ``<name>_tiny`` so that it never touches the real run's folder;
- rewards whose weights come from the hub (PickScore, CLIP score, aesthetic, temporal
  consistency), in ``rewards.components`` and in the held-out ``eval.rewards`` alike, load a tiny
  random CLIP (and aesthetic head) saved in the same layout (``reward_models.tiny``): the same
  reward class and code path, meaningless scores. Rewards computed by servers (``remote``) are
  scored by JPEG compressibility under their label and weight (there is no server). Other rewards
  (OCR's packaged ONNX models, JPEG, the toy verifier, toy_artifacts) run as they are;
- the recipe's prompt set when it is fetched (a tiny run draws a few of its prompts), else the
  set's small shipped stand-in (``flowgrpo.prompt_sets``: the illustrative files in
  ``assets/prompts/``, the toy world's edits for editing recipes).

The CLI also sets ``ACCELERATE_USE_CPU`` so a GPU machine trains the tiny run on its CPU too.
Overrides on the command line apply after the tiny settings, so any of them can be changed back.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from flowgrpo.config import (InputError, TrainConfig, load_config, parse_overrides,
                             read_config_file)
from flowgrpo.prompt_sets import example_for
from pipelines.tiny import TINY_FAMILIES, TINY_HEIGHT, TINY_NUM_FRAMES, TINY_WIDTH, save_tiny
from reward_models.tiny import build_tiny_aesthetic_head, build_tiny_clip

TINY_DIR_ENV = "FLOWGRPO_TINY_DIR"
TINY_PROMPTS = 2
TINY_GROUP_SIZE = 4
TINY_ROLLOUT_BATCH = 4
TINY_EVAL_PROMPTS = 2
TINY_ITERATIONS = 2
TINY_CLIP_PROJECTION = 16
# Options of the diffusers adapters that only place or shrink a GPU run: reset to their defaults.
_PLACEMENT_OPTIONS = {"offload_text_encoders": False, "offload_vae": False,
                      "attention_backend": "sdpa", "text_encoder_dtype": None, "vae_dtype": None}
# Families whose model is replaced by a tiny build (toy is already tiny and CPU-sized).
_VIDEO_FAMILIES = ("wan", "wan_i2v", "hunyuan_video", "ltx2")


def tiny_root(root: str | os.PathLike | None = None) -> Path:
    """Where tiny builds live: ``root``, else $FLOWGRPO_TINY_DIR, else ~/.cache/flowgrpo/tiny."""
    if root is not None:
        return Path(root)
    if os.environ.get(TINY_DIR_ENV):
        return Path(os.environ[TINY_DIR_ENV])
    return Path.home() / ".cache" / "flowgrpo" / "tiny"


def tiny_build_name(family: str, path: str) -> str:
    """The ``pipelines.tiny`` build of a config's model: the family's, except Wan2.2 checkpoints
    (two experts), whose family is ``wan`` / ``wan_i2v`` and whose build is ``wan22`` /
    ``wan22_i2v``, and Wan2.2-TI2V-5B under ``wan_i2v`` (build ``wan22_ti2v``)."""
    if family == "wan" and "wan2.2" in str(path).lower():
        return "wan22"
    if family == "wan_i2v" and "wan2.2" in str(path).lower():
        return "wan22_ti2v" if "ti2v" in str(path).lower() else "wan22_i2v"
    if family == "flux2" and "flux.2-dev" in str(path).lower():
        return "flux2_dev"     # FLUX.2-dev (Mistral text, guidance embedding); klein otherwise
    return family


def _publish(build, target: Path) -> Path:
    """Run ``build(folder)`` into a fresh temporary folder next to ``target`` and move it into
    place, unless another process got there first (then the other's is kept)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(scratch)
        try:
            os.replace(scratch, target)
        except OSError:            # target appeared meanwhile (another process): keep that one
            if not target.exists():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def ensure_tiny_model(build: str, root: str | os.PathLike | None = None) -> Path:
    """The tiny ``build`` pipeline folder under ``tiny_root(root)``, written on first use."""
    if build not in TINY_FAMILIES:
        raise InputError(f"--tiny has no tiny build for model family {build!r} (builds: "
                         f"{', '.join(TINY_FAMILIES)})")
    return _publish(lambda folder: save_tiny(build, folder), tiny_root(root) / build)


def ensure_tiny_clip(root: str | os.PathLike | None = None) -> Path:
    """A tiny random CLIP (model, processor, tokenizer) for the CLIP-based rewards."""
    return _publish(lambda folder: build_tiny_clip(str(folder), projection_dim=TINY_CLIP_PROJECTION,
                                                   image_size=32),
                    tiny_root(root) / "reward_clip")


def ensure_tiny_aesthetic_head(root: str | os.PathLike | None = None) -> Path:
    """A tiny random aesthetic head on the tiny CLIP's embeddings."""
    def build(folder: Path) -> None:
        build_tiny_aesthetic_head(str(folder / "head.safetensors"),
                                  embed_dim=TINY_CLIP_PROJECTION)

    return _publish(build, tiny_root(root) / "reward_aesthetic") / "head.safetensors"


def _clip_reward(options: dict, root) -> dict:
    clip = str(ensure_tiny_clip(root))
    out = {k: v for k, v in options.items() if k not in ("pretrained",)}
    out.update({"model": clip, "backend": "transformers"})
    if "processor" in out or options.get("processor") is not None:
        out["processor"] = clip
    return out


def _pickscore_reward(options: dict, root) -> dict:
    clip = str(ensure_tiny_clip(root))
    return {**options, "model": clip, "processor": clip}


def _aesthetic_reward(options: dict, root) -> dict:
    out = _clip_reward(options, root)
    out["head"] = str(ensure_tiny_aesthetic_head(root))
    return out


# reward name -> options with its hub weights replaced by tiny random builds of the same layout
TINY_REWARDS = {"pickscore": _pickscore_reward, "clip_score": _clip_reward,
                "aesthetic": _aesthetic_reward, "temporal_consistency": _clip_reward}
# Rewards computed by servers (``remote``) have no server in a tiny run: each is scored by this
# local reward instead, under the same label and weight.
TINY_REMOTE_STAND_IN = "jpeg_compressibility"


def _tiny_rewards(components: Any, root) -> Any:
    """``components`` (a recipe's reward list) with hub-weight rewards on tiny builds and remote
    rewards on a local stand-in. A value of the wrong type (not a list, a spec's options not a
    mapping) is passed on as it is, so that the config's check names it."""
    if not isinstance(components, list):
        return components
    out = []
    for spec in components:
        spec = dict(spec) if isinstance(spec, dict) else {"name": spec}
        name, options = spec.get("name"), spec.get("options")
        if not isinstance(name, str) or not isinstance(options, (dict, type(None))):
            out.append(spec)
        elif name in TINY_REWARDS:
            spec["options"] = TINY_REWARDS[name](dict(options or {}), root)
            out.append(spec)
        elif name in _NESTED_REWARD_KEYS and isinstance(options, dict):
            # a groupwise reward over a pointwise one (win_rate's pairwise.of, group_rank's of):
            # the inner reward on its tiny build too
            spec["options"] = _tiny_nested(options, _NESTED_REWARD_KEYS[name], root)
            out.append(spec)
        elif name == "remote":
            label = (options or {}).get("label")
            out.append({"name": TINY_REMOTE_STAND_IN, "weight": spec.get("weight", 1.0),
                        "options": {"label": label} if label else {}})
        else:
            out.append(spec)
    return out


# groupwise rewards -> the path of the pointwise reward spec inside their options
_NESTED_REWARD_KEYS = {"win_rate": ("pairwise", "of"), "group_rank": ("of",)}


def _tiny_nested(options: dict, path: tuple[str, ...], root) -> dict:
    """``options`` with the reward spec at ``path`` (a name or ``{name: ..., <options>}``, options
    flat) on its tiny build; anything of another shape is left for the config's check to name."""
    head, rest = path[0], path[1:]
    inner = options.get(head)
    if rest:
        if not isinstance(inner, dict):
            return options
        return {**options, head: _tiny_nested(inner, rest, root)}
    if isinstance(inner, str):
        spec = {"name": inner}
    elif isinstance(inner, dict) and isinstance(inner.get("name"), str):
        spec = {"name": inner["name"], "options": {k: v for k, v in inner.items() if k != "name"}}
    else:
        return options
    (tiny,) = _tiny_rewards([spec], root)
    return {**options, head: {"name": tiny["name"], **(tiny.get("options") or {})}}


def _tiny_prompts(raw: dict) -> dict:
    """``prompts.train`` / ``prompts.eval`` of a recipe whose anchor prompt set is not fetched:
    the set's shipped stand-ins (``flowgrpo.prompt_sets``), so a tiny run works offline on a
    fresh clone. A fetched set is used as it is (a tiny run draws a few of its prompts)."""
    out = {}
    for key in ("train", "eval"):
        source = _get(raw, f"prompts.{key}")
        if isinstance(source, str) and not source.startswith("toy:") and \
                not Path(source).is_file():
            example = example_for(source, key)
            if example is not None:
                out[key] = example
    return out


def _get(tree: dict, dotted: str, default: Any = None) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def tiny_patch(raw: dict, root: str | os.PathLike | None = None) -> dict:
    """The config changes (a nested dict merged over the recipe) that put ``raw`` (a config file's
    mapping) on its family's tiny build: see the module docstring. Builds what it points to."""
    policy = raw.get("policy", "flow")
    if policy != "flow":
        raise InputError(f"--tiny is for flow recipes (this config's policy is {policy!r}); the "
                         f"llm recipes already run on a CPU as they are")
    family = _get(raw, "model.family", "toy")
    model: dict[str, Any] = {"dtype": "float32", "gradient_checkpointing": False}
    if family != "toy":
        build = tiny_build_name(family, _get(raw, "model.path", ""))
        recipe_options = _get(raw, "model.options", {}) or {}
        # not a mapping: an empty one here, and the merge names model.options
        options = dict(recipe_options) if isinstance(recipe_options, dict) else {}
        options.update(_PLACEMENT_OPTIONS)
        options.update({"height": TINY_HEIGHT, "width": TINY_WIDTH})
        if family in _VIDEO_FAMILIES:
            options["num_frames"] = TINY_NUM_FRAMES
        model.update({"path": str(ensure_tiny_model(build, root)), "options": options})
    num_steps = _get(raw, "sampling.num_steps", 10)
    name = raw.get("name", "run")
    patch: dict[str, Any] = {
        "model": model,
        "prompts": {"num_eval": TINY_EVAL_PROMPTS, "eval_seeds": 1, "eval_per_family": 0,
                    **_tiny_prompts(raw)},
        "sampling": {"rollout_batch_size": TINY_ROLLOUT_BATCH},
        "training": {"prompts_per_iteration": TINY_PROMPTS, "group_size": TINY_GROUP_SIZE,
                     "mixed_precision": "no", "use_8bit_adam": False},
        "rewards": {"components": _tiny_rewards(_get(raw, "rewards.components", []), root)},
        # held-out metrics: the same substitution, so no hub weights are fetched either
        "eval": {"rewards": _tiny_rewards(_get(raw, "eval.rewards", []), root)},
        "run": {"max_iterations": TINY_ITERATIONS, "eval_every": 0, "checkpoint_every": 0,
                "keep_checkpoints": 1, "tracker": "none"},
    }
    # A name or step count of the wrong type stays the recipe's, for the config's check to name
    # (a patched "5_tiny" or a copied bad step count would hide it or blame another field).
    if isinstance(name, str):
        patch["name"] = f"{name}_tiny"
    if isinstance(num_steps, int) and not isinstance(num_steps, bool):
        patch["sampling"]["eval_num_steps"] = num_steps
    group_size = _get(raw, "training.group_size", None)
    if _get(raw, "sampling.plan.kind", None) == "tree" and isinstance(group_size, int):
        # A tree's group is its leaves (branching ** splits): a group of TINY_GROUP_SIZE would
        # change the method, so the tiny run keeps the recipe's tree and rolls one tree at a time.
        patch["training"]["group_size"] = group_size
        patch["sampling"]["rollout_batch_size"] = group_size
    return patch


def load_tiny_config(path: str | os.PathLike, overrides: list[str] | None = None,
                     root: str | os.PathLike | None = None) -> TrainConfig:
    """``path`` with ``tiny_patch`` merged over it, then the dotted ``overrides`` (which win),
    validated like any config. Builds the tiny model and reward weights it needs."""
    raw = read_config_file(path)
    view = copy.deepcopy(raw)       # what the overrides make of the recipe (family, rewards, ...)
    for key, value in parse_overrides(overrides or []):
        node = view
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[parts[-1]] = value
    return load_config(path, overrides, data=tiny_patch(view, root))
