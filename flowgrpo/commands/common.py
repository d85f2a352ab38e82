"""What the sub-commands share: argument parsing (every argument checked before a model
loads) and deterministic sampling helpers."""
from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

import torch
import yaml
from torch import Tensor
from tqdm.auto import tqdm

import pipelines
from flowgrpo.packaged_data import resolve_packaged_path
from flowgrpo.prompts import load_prompts
from flowgrpo.rollout import sample_ode
from pipelines import MODEL_FAMILIES
from pipelines.sources import is_local_path
from reward_models import MultiReward
from reward_models.loading import resolve_reward_class

# family -> (steps, guidance) of the deterministic sampler when the flags are not given: the
# evaluation settings of Flow-GRPO (SD3.5: 40 steps, CFG 4.5; FLUX.1: 28 steps, guidance
# embedding 3.5), else the stock diffusers pipeline's ``__call__`` defaults in this toolkit's CFG
# convention v_neg + g (v_pos - v_neg) (Z-Image's pipeline scale s is g = s + 1; distilled
# FLUX.2-klein checkpoints ignore the scale, as their pipeline does). The toy model reads its
# own defaults (``toy_config.json``).
SAMPLING_DEFAULTS: dict[str, tuple[int, float]] = {
    "sd3": (40, 4.5), "flux": (28, 3.5), "flux_kontext": (28, 3.5), "wan": (50, 5.0),
    "wan_i2v": (50, 5.0), "qwen_image": (50, 4.0), "qwen_image_edit": (50, 4.0),
    "qwen_image_edit_plus": (50, 4.0), "z_image": (50, 6.0), "flux2": (50, 4.0),
    "hunyuan_video": (50, 6.0), "ltx2": (30, 3.0)}
FALLBACK_SAMPLING = (20, 1.0)   # a family not listed and without its own defaults
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


# ================================================================================ argument parsing
def parse_model(text: str) -> tuple[str, str]:
    """``"FAMILY:PATH"`` -> (family, path); the family must be a known one. A shipped model named
    as in a checkout (``toy:assets/toy``) is found from any folder (``resolve_packaged_path``)."""
    family, sep, path = text.partition(":")
    if not sep or not path:
        raise ValueError(f"--model must look like FAMILY:PATH, e.g. sd3:stabilityai/"
                         f"stable-diffusion-3.5-medium or toy:assets/toy (got {text!r})")
    if family not in MODEL_FAMILIES:
        raise ValueError(f"--model family {family!r} is unknown; use one of {sorted(MODEL_FAMILIES)}")
    return family, resolve_packaged_path(path)


def parse_seeds(text: str | list[str]) -> list[int]:
    """``"0,1,2"``, ``"0-3"`` (inclusive) or a mix (``"0-3,7"``) -> list of ints, in order. A
    list (``--seeds 0 1 4-5`` on the command line) is read as its items joined by commas."""
    if not isinstance(text, str):
        text = ",".join(text)
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise ValueError(f"--seeds must be comma-separated non-negative ints or ranges like "
                             f"0-3 (got {text!r})")
        low, high = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if high < low:
            raise ValueError(f"--seeds range {part!r} is empty: write LOW-HIGH with LOW <= HIGH")
        seeds.extend(range(low, high + 1))
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds lists a seed twice (got {text!r})")
    return seeds


def parse_options(items: list[str] | None) -> dict:
    """``["height=512", "cfg=false"]`` -> {"height": 512, "cfg": False} (values read as YAML)."""
    options = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--options entries must look like key=value (got {item!r})")
        options[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return options


def parse_reward_specs(text: str, flag: str = "--rewards") -> list[dict]:
    """``--rewards``: ``"ocr"``, ``"ocr=1.0,aesthetic=0.1"`` (name=weight; names may be
    ``package.module:Class``) or a YAML/JSON list of spec dicts (``"[{name: ocr, batch_size: 8}]"``)
    -> list of MultiReward specs. ``flag`` names the option in errors (``--eval-rewards``)."""
    text = text.strip()
    if text.startswith("["):
        specs = yaml.safe_load(text)
        if not isinstance(specs, list) or not all(isinstance(s, (dict, str)) for s in specs):
            raise ValueError(f"{flag} as YAML must be a list of names or {{name: ...}} dicts "
                             f"(got {text!r})")
        specs = [{"name": s} if isinstance(s, str) else dict(s) for s in specs]
    else:
        specs = []
        for part in text.split(","):
            name, sep, weight = part.strip().partition("=")
            if not name:
                raise ValueError(f"{flag} has an empty entry (got {text!r})")
            spec: dict = {"name": name}
            if sep:
                try:
                    spec["weight"] = float(weight)
                except ValueError:
                    raise ValueError(f"{flag} weight of {name!r} must be a number "
                                     f"(got {weight!r})") from None
            specs.append(spec)
    if not specs:
        raise ValueError(f"{flag} is empty; name at least one reward")
    return specs


def held_out_specs(text: str | None, config_specs: list[dict] | None = None) -> list[dict]:
    """Held-out metrics of ``eval`` / ``grid``: the config's ``eval.rewards`` (as
    ``heldout.eval_reward_specs`` gives them) then ``--eval-rewards`` (``parse_reward_specs``
    forms), a spec equal to an earlier one left out; weights are 0 (held-out metrics are
    never summed into a total)."""
    out: list[dict] = []
    extra = parse_reward_specs(text, "--eval-rewards") if text else []
    for spec in [*(config_specs or []), *extra]:
        spec = {**spec, "weight": 0.0}
        if spec not in out:
            out.append(spec)
    return out


def load_held_out(specs: list[dict], reward_keys, device: str):
    """The MultiReward of held-out ``specs`` on ``device`` (None when there are none); a key
    equal to one of ``reward_keys`` (the scored rewards' keys) is refused: both would be
    reported under one name."""
    if not specs:
        return None

    held_out = MultiReward(specs, device=device)
    clash = sorted(set(held_out.rewards) & (set(reward_keys) | {"total"}))
    if clash:
        raise ValueError(f"held-out metric {clash[0]!r} (--eval-rewards or the config's "
                         f"eval.rewards) is also a scored reward's key; give it another with "
                         f"'[{{name: ..., label: {clash[0]}_heldout}}]'")
    return held_out


def check_reward_names(specs: list[dict]) -> None:
    """Resolve every reward name (cheap: imports the class, loads no weights)."""
    for spec in specs:
        if "name" not in spec:
            raise ValueError(f"reward spec {spec!r} has no 'name'")
        resolve_reward_class(spec["name"])


def resolve_prompts(text: str) -> list[dict]:
    """``--prompts``: a prompt file (.txt, one a line; .jsonl with prompt/metadata), ``toy:<split>``,
    or else the text itself as the only prompt. Records ``{"prompt", "metadata"}``. A shipped
    prompt file named as in a checkout (``assets/prompts/general_eval.txt``) is found from any
    folder (``resolve_packaged_path``)."""
    text = resolve_packaged_path(text)
    looks_like_file = Path(text).suffix in (".txt", ".jsonl")
    if text.startswith("toy:") or Path(text).is_file():
        return load_prompts(text)
    if looks_like_file:
        raise FileNotFoundError(f"--prompts file {text} does not exist (give a .txt/.jsonl file, "
                                f"toy:<split>, or the prompt text itself)")
    if not text.strip():
        raise ValueError("--prompts is empty; give a prompt file or a prompt")
    return [{"prompt": text, "metadata": {}}]


def check_model_path(family: str, path: str) -> None:
    """A local model folder must exist (hub ids are left to ``from_pretrained``)."""
    if is_local_path(path) and not os.path.isdir(os.path.expanduser(path)):
        raise FileNotFoundError(f"--model {family}:{path}: folder {path} does not exist (give a "
                                f"diffusers pipeline folder or a hub id 'org/name')")


def check_writable_dir(path: str | os.PathLike, flag: str) -> Path:
    """Create folder ``path`` if needed and prove a file can be written in it."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path} is not a writable folder ({err.strerror or err}); "
                         f"choose another output path") from None
    return folder


# ================================================================================ sampling
def resolve_device(name: str) -> str:
    """``auto`` -> "cuda" when available, else "cpu"; anything else unchanged."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def load_flow_model(family: str, path: str, dtype: str, device: str, options: dict):
    """``pipelines.load_model`` (looked up at call time, so tests can forbid it)."""
    return pipelines.load_model(family, path, dtype=getattr(torch, dtype), device=device,
                                options=options)


def default_sampling(model, family: str, steps: int | None, guidance: float | None
                     ) -> tuple[int, float]:
    """The flags, else the model's own defaults (toy), else ``SAMPLING_DEFAULTS[family]``."""
    defaults = getattr(model, "defaults", None)
    if defaults is not None and hasattr(defaults, "eval_steps"):
        fallback = (int(defaults.eval_steps), float(defaults.guidance_scale))
    else:
        fallback = SAMPLING_DEFAULTS.get(family, FALLBACK_SAMPLING)
    return (fallback[0] if steps is None else steps,
            fallback[1] if guidance is None else guidance)


def seed_noise(model, seeds: list[int]) -> Tensor:
    """(len(seeds), ...) initial noise: row i = ``model.initial_noise(1, Generator().manual_seed(s_i))``."""
    return torch.cat([model.initial_noise(1, torch.Generator().manual_seed(seed)) for seed in seeds])


def generate(model, prompts: list[str], noise: Tensor, num_steps: int, guidance_scale: float,
             batch_size: int, progress=None, images: list[Tensor] | None = None) -> Tensor:
    """Deterministic samples (B, ...) for prompts (B) from noise (B, ...), ``batch_size`` at a
    time (``sample_ode`` on each chunk; ``progress.update(1)`` per chunk). ``images``: B source
    images (3, H, W) for an editing model."""
    chunks = []
    for start in range(0, len(prompts), batch_size):
        chunks.append(sample_ode(model, prompts[start:start + batch_size],
                                 noise[start:start + batch_size], num_steps, guidance_scale,
                                 batch_size=batch_size,
                                 images=None if images is None else images[start:start + batch_size]))
        if progress is not None:
            progress.update(1)
    return torch.cat(chunks)


def slug(text: str, max_length: int = 40) -> str:
    """A file-name-safe short form of ``text``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:max_length].strip("-") or "prompt"


def progress_bar(total: int, desc: str, quiet: bool):
    return tqdm(total=total, desc=desc, disable=quiet, dynamic_ncols=True, leave=False)


def check_positive(value: float | None, flag: str) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{flag} must be > 0 (got {value})")


def json_number(value: float) -> float | None:
    return None if math.isnan(value) else value
