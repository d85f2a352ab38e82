"""``flowgrpo sample | eval | grid``: look at and score a model and its trained checkpoints.

* ``sample``: deterministic (Euler ODE) samples per prompt and seed, as PNG (images) or MP4 + GIF
  (videos), optionally with a trainer checkpoint applied (``--lora CKPT``).
* ``eval``: reward statistics (mean, std, standard error) per component and per prompt family
  (``metadata["family"]``), written as JSON and printed as a table; from a training CONFIG or
  from flags. ``--samples-per-prompt K`` adds pass@k diagnostics (``flowgrpo.passk``).
* ``grid``: rows = prompts x seeds, columns = the base model and each checkpoint, the same noise
  along a row, every cell labelled with its reward; paged into several files when large.

The noise of seed s is ``model.initial_noise(1, torch.Generator().manual_seed(s))``, so a seed
gives the same picture in ``sample``, ``grid`` and ``eval --seeds``. A checkpoint is a folder with
``pytorch_lora_weights.safetensors`` (diffusers/PEFT LoRA, as ``Trainer.save`` writes) or
``transformer/`` (full fine-tune), or a run folder (its newest checkpoint), or ``base``.

Every argument is checked before any model loads: missing or mismatched checkpoints (LoRA modules
or shapes that the model's transformer lacks, a run trained on another family), empty prompt
files and unwritable outputs raise ValueError / FileNotFoundError, which ``flowgrpo.cli.main``
prints as one line with exit status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from flowgrpo.dtypes import DTYPE_NAMES

if TYPE_CHECKING:       # torch is imported where it is used, so `flowgrpo --help` stays fast
    from torch import Tensor

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
LORA_ADAPTER_NAME = "flowgrpo_checkpoint"
BASE = "base"
# family -> (steps, guidance) of the deterministic sampler when the flags are not given: the
# evaluation settings of Flow-GRPO (SD3.5: 40 steps, CFG 4.5; FLUX.1: 28 steps, guidance
# embedding 3.5) and Wan2.1's stock pipeline (50 steps, CFG 5). The toy model reads its own
# defaults (``toy_config.json``).
SAMPLING_DEFAULTS: dict[str, tuple[int, float]] = {"sd3": (40, 4.5), "flux": (28, 3.5),
                                                   "wan": (50, 5.0)}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


# ================================================================================ argument parsing
def parse_model(text: str) -> tuple[str, str]:
    """``"FAMILY:PATH"`` -> (family, path); the family must be a known one."""
    from pipelines import MODEL_FAMILIES

    family, sep, path = text.partition(":")
    if not sep or not path:
        raise ValueError(f"--model must look like FAMILY:PATH, e.g. sd3:stabilityai/"
                         f"stable-diffusion-3.5-medium or toy:assets/toy (got {text!r})")
    if family not in MODEL_FAMILIES:
        raise ValueError(f"--model family {family!r} is unknown; use one of {sorted(MODEL_FAMILIES)}")
    return family, path


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
    import yaml

    options = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--options entries must look like key=value (got {item!r})")
        options[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return options


def parse_reward_specs(text: str) -> list[dict]:
    """``--rewards``: ``"ocr"``, ``"ocr=1.0,aesthetic=0.1"`` (name=weight; names may be
    ``package.module:Class``) or a YAML/JSON list of spec dicts (``"[{name: ocr, batch_size: 8}]"``)
    -> list of MultiReward specs."""
    import yaml

    text = text.strip()
    if text.startswith("["):
        specs = yaml.safe_load(text)
        if not isinstance(specs, list) or not all(isinstance(s, (dict, str)) for s in specs):
            raise ValueError(f"--rewards as YAML must be a list of names or {{name: ...}} dicts "
                             f"(got {text!r})")
        specs = [{"name": s} if isinstance(s, str) else dict(s) for s in specs]
    else:
        specs = []
        for part in text.split(","):
            name, sep, weight = part.strip().partition("=")
            if not name:
                raise ValueError(f"--rewards has an empty entry (got {text!r})")
            spec: dict = {"name": name}
            if sep:
                try:
                    spec["weight"] = float(weight)
                except ValueError:
                    raise ValueError(f"--rewards weight of {name!r} must be a number "
                                     f"(got {weight!r})") from None
            specs.append(spec)
    if not specs:
        raise ValueError("--rewards is empty; name at least one reward")
    return specs


def check_reward_names(specs: list[dict]) -> None:
    """Resolve every reward name (cheap: imports the class, loads no weights)."""
    from reward_models.loading import resolve_reward_class

    for spec in specs:
        if "name" not in spec:
            raise ValueError(f"reward spec {spec!r} has no 'name'")
        resolve_reward_class(spec["name"])


def resolve_prompts(text: str) -> list[dict]:
    """``--prompts``: a prompt file (.txt, one a line; .jsonl with prompt/metadata), ``toy:<split>``,
    or else the text itself as the only prompt. Records ``{"prompt", "metadata"}``."""
    from flowgrpo.prompts import load_prompts

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
    from pipelines.base import is_local_path

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


# ================================================================================ checkpoints
@dataclass
class Checkpoint:
    """A column of a comparison: the base model or a trainer checkpoint.

    kind: "base" (no weights), "lora" (``path/pytorch_lora_weights.safetensors``) or "full"
    (``path/transformer/``, a ``from_pretrained`` folder). label: what grids and reports show."""

    label: str
    kind: str
    path: Path | None = None


def _checkpoint_label(path: Path) -> str:
    if path.parent.name == "checkpoints":
        return f"{path.parent.parent.name}@{path.name}"
    return path.name or str(path)


def resolve_checkpoint(text: str) -> Checkpoint:
    """``base`` (any case), a checkpoint folder, or a run folder (-> its newest checkpoint)."""
    from flowgrpo.checkpoint import list_checkpoints

    if text.lower() == BASE:
        return Checkpoint(label=BASE, kind="base")
    path = Path(text)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {text} does not exist (give runs/<name>/checkpoints/"
                                f"<iteration>, a run folder, or 'base')")
    if not path.is_dir():
        raise ValueError(f"checkpoint {text} is a file; give the folder that holds "
                         f"{LORA_WEIGHTS_NAME} or transformer/")
    if not (path / LORA_WEIGHTS_NAME).is_file() and not (path / "transformer").is_dir():
        found = list_checkpoints(path)
        if found:
            path = found[-1]
    if (path / LORA_WEIGHTS_NAME).is_file():
        return Checkpoint(label=_checkpoint_label(path), kind="lora", path=path)
    if (path / "transformer" / "config.json").is_file():
        return Checkpoint(label=_checkpoint_label(path), kind="full", path=path)
    raise FileNotFoundError(f"checkpoint {text} holds neither {LORA_WEIGHTS_NAME} (LoRA) nor "
                            f"transformer/config.json (full fine-tune), nor a checkpoints/ folder")


def unique_labels(checkpoints: list[Checkpoint]) -> None:
    """Make labels distinct in place ("x", "x (2)", ...)."""
    seen: dict[str, int] = {}
    for checkpoint in checkpoints:
        count = seen.get(checkpoint.label, 0) + 1
        seen[checkpoint.label] = count
        if count > 1:
            checkpoint.label = f"{checkpoint.label} ({count})"


def run_config(checkpoint: Path) -> tuple[dict, Path] | None:
    """The YAML config of the run a trainer checkpoint belongs to (``runs/<name>/config.yaml``
    for ``runs/<name>/checkpoints/<iteration>``) and its path, or None."""
    import yaml

    if checkpoint.parent.name != "checkpoints":
        return None
    path = checkpoint.parent.parent / "config.yaml"
    if not path.is_file():
        return None
    data = yaml.safe_load(path.read_text())
    return (data, path) if isinstance(data, dict) else None


def declared_family(checkpoint: Path) -> tuple[str, str] | None:
    """(family, source file) the checkpoint's run declares: ``trainer_state.json["family"]``, else
    ``model.family`` of the run's ``config.yaml`` (``runs/<name>/config.yaml``); None if neither."""
    state = checkpoint / "trainer_state.json"
    if state.is_file():
        family = json.loads(state.read_text()).get("family")
        if family:
            return str(family), str(state)
    found = run_config(checkpoint)
    if found is not None:
        family = (found[0].get("model") or {}).get("family")
        if family:
            return str(family), str(found[1])
    return None


def lora_metadata(checkpoint: Path) -> dict | None:
    """The LoraConfig fields (keys prefixed "transformer.", as ``load_lora_adapter`` expects) of a
    checkpoint's LoRA: the file's own adapter metadata, else, for a file saved without it (loaders
    would then assume alpha = rank), rank and alpha from the run's ``config.yaml``
    (``model.lora``) with the target modules read from the keys. None when neither is known."""
    from safetensors import safe_open

    file = checkpoint / LORA_WEIGHTS_NAME
    with safe_open(str(file), framework="pt") as handle:
        raw = (handle.metadata() or {}).get("lora_adapter_metadata")
        ranks = {tuple(handle.get_slice(k).get_shape())[0] for k in handle.keys()
                 if k.endswith(".lora_A.weight")}
    if raw:
        return json.loads(raw)
    found = run_config(checkpoint)
    lora = ((found[0].get("model") or {}).get("lora") or {}) if found else {}
    if not {"rank", "alpha"} <= set(lora) or ranks != {lora["rank"]}:
        return None
    return {"transformer.r": lora["rank"], "transformer.lora_alpha": lora["alpha"],
            "transformer.target_modules": sorted(lora_module_shapes(file))}


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the headers of ``files`` (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def transformer_weight_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """Parameter shapes of a local model folder's ``transformer/`` (headers only); None when the
    model is not a local folder with safetensors weights."""
    folder = Path(os.path.expanduser(model_path)) / "transformer"
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    return safetensors_shapes(files) if files else None


def lora_module_shapes(lora_file: Path) -> dict[str, tuple[int, int]]:
    """Transformer module -> (out_features, in_features) that a diffusers-format LoRA file adapts
    (keys ``transformer.<module>.lora_A.weight`` (r, in) / ``.lora_B.weight`` (out, r))."""
    shapes = safetensors_shapes([lora_file])
    modules: dict[str, list[int]] = {}
    for key, shape in shapes.items():
        match = re.fullmatch(r"transformer\.(.+)\.lora_([AB])\.weight", key)
        if not match or len(shape) != 2:
            continue
        entry = modules.setdefault(match[1], [-1, -1])
        if match[2] == "A":
            entry[1] = shape[1]
        else:
            entry[0] = shape[0]
    return {module: (out, inp) for module, (out, inp) in modules.items()}


def lora_mismatches(lora: dict[str, tuple[int, int]], base: dict[str, tuple[int, ...]]) -> list[str]:
    """Why each LoRA module cannot apply to a transformer with parameter shapes ``base``."""
    problems = []
    for module, (out, inp) in sorted(lora.items()):
        weight = base.get(f"{module}.weight")
        if weight is None:
            problems.append(f"the model has no module {module}")
        elif len(weight) != 2 or (out >= 0 and weight[0] != out) or (inp >= 0 and weight[1] != inp):
            problems.append(f"{module} is {tuple(weight)} in the model but the LoRA adapts "
                            f"({out}, {inp})")
    return problems


def check_checkpoint(checkpoint: Checkpoint, family: str, model_path: str,
                     base_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Raise ValueError if ``checkpoint`` was trained on another family or does not fit the
    transformer of ``model_path`` (LoRA modules/shapes, or full weights' names/shapes).

    ``base_shapes`` defaults to the local folder's transformer headers (skipped for hub ids)."""
    if checkpoint.kind == "base":
        return
    declared = declared_family(checkpoint.path)
    if declared is not None and declared[0] != family:
        raise ValueError(f"checkpoint {checkpoint.path} was trained on model family "
                         f"{declared[0]!r} (per {declared[1]}) but --model is {family!r}; pass the "
                         f"model it was trained on")
    if base_shapes is None:
        base_shapes = transformer_weight_shapes(model_path)
    if base_shapes is None:
        return
    if checkpoint.kind == "lora":
        lora = lora_module_shapes(checkpoint.path / LORA_WEIGHTS_NAME)
        if not lora:
            raise ValueError(f"checkpoint {checkpoint.path}: {LORA_WEIGHTS_NAME} holds no "
                             f"transformer LoRA (keys 'transformer.<module>.lora_A/B.weight')")
        problems = lora_mismatches(lora, base_shapes)
        if problems:
            raise ValueError(f"checkpoint {checkpoint.path} does not fit --model {family}:"
                             f"{model_path}: {len(problems)} of {len(lora)} LoRA modules do not "
                             f"match ({problems[0]}); was it trained on another model?")
    else:
        files = sorted((checkpoint.path / "transformer").glob("*.safetensors"))
        if not files:
            raise ValueError(f"checkpoint {checkpoint.path}/transformer has no .safetensors weights")
        full = safetensors_shapes(files)
        differ = sorted(k for k in set(full) | set(base_shapes) if full.get(k) != base_shapes.get(k))
        if differ:
            key = differ[0]
            raise ValueError(f"checkpoint {checkpoint.path}/transformer does not fit --model "
                             f"{family}:{model_path}: {len(differ)} parameters differ (e.g. {key}: "
                             f"{full.get(key)} vs {base_shapes.get(key)} in the model)")


def model_shapes(model) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.transformer.state_dict().items()}


@contextmanager
def checkpoint_applied(model, checkpoint: Checkpoint) -> Iterator[None]:
    """Within the block, ``model`` carries ``checkpoint``'s weights: a LoRA adapter loaded with
    diffusers' ``load_lora_adapter`` (deleted afterwards, leaving the exact base weights; a file
    without adapter metadata gets rank/alpha from its run's config.yaml), or the full fine-tuned
    transformer swapped in for ``model.transformer``."""
    if checkpoint.kind == "base":
        yield
        return
    transformer = model.transformer
    if checkpoint.kind == "lora":
        if not hasattr(transformer, "load_lora_adapter"):
            raise TypeError(f"{type(transformer).__name__} has no load_lora_adapter; LoRA "
                            f"checkpoints need a diffusers transformer")
        from safetensors.torch import load_file

        state_dict = load_file(str(checkpoint.path / LORA_WEIGHTS_NAME))
        metadata = lora_metadata(checkpoint.path)
        if metadata is None:
            warnings.warn(f"checkpoint {checkpoint.path}: the LoRA file has no adapter metadata "
                          f"and no run config.yaml gives model.lora.rank/alpha; loading with "
                          f"alpha = rank", stacklevel=2)
        transformer.load_lora_adapter(state_dict, prefix="transformer",
                                      adapter_name=LORA_ADAPTER_NAME, metadata=metadata)
        try:
            yield
        finally:
            transformer.delete_adapters(LORA_ADAPTER_NAME)
        return
    full = type(transformer).from_pretrained(str(checkpoint.path / "transformer"),
                                             torch_dtype=model.dtype)
    full.to(model.device).eval().requires_grad_(False)
    backend = getattr(getattr(model, "options", None), "attention_backend", None)
    if backend:
        from pipelines.base import apply_attention_backend

        apply_attention_backend(full, backend)
    model.transformer = full
    try:
        yield
    finally:
        model.transformer = transformer
        del full


# ================================================================================ sampling
def resolve_device(name: str) -> str:
    """``auto`` -> "cuda" when available, else "cpu"; anything else unchanged."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def load_flow_model(family: str, path: str, dtype: str, device: str, options: dict):
    """``pipelines.load_model`` (looked up at call time, so tests can forbid it)."""
    import torch

    import pipelines

    return pipelines.load_model(family, path, dtype=getattr(torch, dtype), device=device,
                                options=options)


def default_sampling(model, family: str, steps: int | None, guidance: float | None
                     ) -> tuple[int, float]:
    """The flags, else the model's own defaults (toy), else ``SAMPLING_DEFAULTS[family]``."""
    defaults = getattr(model, "defaults", None)
    if defaults is not None and hasattr(defaults, "eval_steps"):
        fallback = (int(defaults.eval_steps), float(defaults.guidance_scale))
    else:
        fallback = SAMPLING_DEFAULTS.get(family, (20, 1.0))
    return (fallback[0] if steps is None else steps,
            fallback[1] if guidance is None else guidance)


def seed_noise(model, seeds: list[int]) -> Tensor:
    """(len(seeds), ...) initial noise: row i = ``model.initial_noise(1, Generator().manual_seed(s_i))``."""
    import torch

    return torch.cat([model.initial_noise(1, torch.Generator().manual_seed(seed)) for seed in seeds])


def generate(model, prompts: list[str], noise: Tensor, num_steps: int, guidance_scale: float,
             batch_size: int, progress=None) -> Tensor:
    """Deterministic samples (B, ...) for prompts (B) from noise (B, ...), ``batch_size`` at a
    time (``sample_ode`` on each chunk; ``progress.update(1)`` per chunk)."""
    import torch

    from flowgrpo.rollout import sample_ode

    chunks = []
    for start in range(0, len(prompts), batch_size):
        chunks.append(sample_ode(model, prompts[start:start + batch_size],
                                 noise[start:start + batch_size], num_steps, guidance_scale,
                                 batch_size=batch_size))
        if progress is not None:
            progress.update(1)
    return torch.cat(chunks)


def slug(text: str, max_length: int = 40) -> str:
    """A file-name-safe short form of ``text``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:max_length].strip("-") or "prompt"


def _progress(total: int, desc: str, quiet: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=quiet, dynamic_ncols=True, leave=False)


def _check_positive(value: float | None, flag: str) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{flag} must be > 0 (got {value})")


def _json_number(value: float) -> float | None:
    return None if math.isnan(value) else value


# ================================================================================ flowgrpo sample
def run_sample(args: argparse.Namespace) -> int:
    from flowgrpo.grids import save_video, to_uint8

    family, path = parse_model(args.model)
    records = resolve_prompts(args.prompts)
    seeds = parse_seeds(args.seeds)
    options = parse_options(args.options)
    _check_positive(args.steps, "--steps")
    _check_positive(args.batch_size, "--batch-size")
    _check_positive(args.fps, "--fps")
    check_model_path(family, path)
    checkpoint = resolve_checkpoint(args.lora) if args.lora else Checkpoint(BASE, "base")
    check_checkpoint(checkpoint, family, path)
    out = check_writable_dir(args.out, "--out")

    model = load_flow_model(family, path, args.dtype, resolve_device(args.device), options)
    check_checkpoint(checkpoint, family, path, base_shapes=model_shapes(model))
    steps, guidance = default_sampling(model, family, args.steps, args.guidance)
    rows = [(index, record, seed) for index, record in enumerate(records) for seed in seeds]
    prompts = [record["prompt"] for _, record, _ in rows]
    noise = seed_noise(model, [seed for _, _, seed in rows])
    bar = _progress(math.ceil(len(rows) / args.batch_size), "sample", args.quiet)
    with checkpoint_applied(model, checkpoint):
        media = generate(model, prompts, noise, steps, guidance, args.batch_size, bar)
    bar.close()

    index = []
    for (prompt_index, record, seed), item in zip(rows, media):
        stem = f"{prompt_index:03d}_{slug(record['prompt'])}_seed{seed}"
        if item.dim() == 4:        # video (F, 3, H, W)
            files = save_video(to_uint8(item), out / f"{stem}.mp4", fps=args.fps)
        else:
            from PIL import Image

            files = [out / f"{stem}.png"]
            Image.fromarray(to_uint8(item)).save(files[0])
        index.append({"files": [f.name for f in files], "prompt": record["prompt"], "seed": seed,
                      "metadata": record["metadata"]})
    (out / "samples.json").write_text(json.dumps({
        "model": args.model, "checkpoint": str(checkpoint.path) if checkpoint.path else BASE,
        "num_steps": steps, "guidance_scale": guidance, "options": options, "samples": index},
        indent=2))
    print(f"wrote {len(index)} samples ({steps} steps, guidance {guidance}) to {out}")
    return 0


# ================================================================================ flowgrpo eval
def reward_statistics(scores: dict[str, Tensor], families: list[str | None]) -> dict:
    """Per reward key: mean/std/se/min/max/count/nan_count over the samples; the same per family
    (samples whose metadata has a "family"); the family mean (GenEval's overall score) and its
    standard error ``family_mean_se`` = sqrt(sum_f se_f^2) / F. se = std / sqrt(count) (population
    std, ``flowgrpo.passk.mean_and_se``). scores: key -> (N,); families: N entries."""
    import torch

    from flowgrpo.passk import family_mean_se, mean_and_se

    def stats(values: Tensor) -> dict:
        valid = values[~values.isnan()].double()
        if len(valid) == 0:
            return {"mean": None, "std": None, "se": None, "min": None, "max": None, "count": 0,
                    "nan_count": int(values.numel())}
        return {"mean": float(valid.mean()), "std": float(valid.std(unbiased=False)),
                "se": mean_and_se(valid)[1],
                "min": float(valid.min()), "max": float(valid.max()), "count": int(len(valid)),
                "nan_count": int(values.numel() - len(valid))}

    out = {"rewards": {key: stats(values) for key, values in scores.items()}, "families": {}}
    for family in sorted({f for f in families if f is not None}):
        mask = torch.tensor([f == family for f in families])
        out["families"][family] = {key: stats(values[mask]) for key, values in scores.items()}
    if out["families"]:
        # GenEval's overall score: the mean over task families, not over samples.
        out["family_mean"] = {
            key: (None if any(f[key]["mean"] is None for f in out["families"].values()) else
                  sum(f[key]["mean"] for f in out["families"].values()) / len(out["families"]))
            for key in scores}
        out["family_mean_se"] = {
            key: (None if any(f[key]["se"] is None for f in out["families"].values()) else
                  family_mean_se([f[key]["se"] for f in out["families"].values()]))
            for key in scores}
    return out


def format_table(statistics: dict) -> str:
    """Rows = reward keys, columns = all samples and each family: 'mean +- std (n, se)', se the
    standard error of the mean."""
    columns = [("all", statistics["rewards"])] + list(statistics["families"].items())
    keys = list(statistics["rewards"])

    def cell(entry: dict) -> str:
        if entry["mean"] is None:
            return "n/a"
        return f"{entry['mean']:.4f} +- {entry['std']:.4f} ({entry['count']}, se {entry['se']:.4f})"

    table = [["reward"] + [name for name, _ in columns]]
    table += [[key] + [cell(stats[key]) for _, stats in columns] for key in keys]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip()
             for row in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    if statistics.get("family_mean"):
        ses = statistics.get("family_mean_se", {})
        lines.append("family mean (GenEval overall): " + ", ".join(
            f"{key} {value:.4f}" + (f" (se {ses[key]:.4f})" if ses.get(key) is not None else "")
            for key, value in statistics["family_mean"].items() if value is not None))
    return "\n".join(lines)


def run_eval(args: argparse.Namespace) -> int:
    import torch

    from flowgrpo.seeding import seeded_generator

    config = None
    if args.config:
        from flowgrpo.config import load_config

        config = load_config(args.config, args.overrides)
    elif args.overrides:
        raise ValueError(f"overrides {args.overrides} need a CONFIG file before them")
    if config is None and not (args.model and args.rewards and args.prompts):
        raise ValueError("flowgrpo eval needs a CONFIG file, or --model, --rewards and --prompts")

    if args.model:
        family, path = parse_model(args.model)
        options = parse_options(args.options)
        dtype = args.dtype or "float32"
    else:
        family, path = config.model.family, config.model.path
        options = {**config.model.options, **parse_options(args.options)}
        dtype = args.dtype or config.model.dtype
    if args.rewards:
        specs = parse_reward_specs(args.rewards)
        aggregation = "weighted_sum"
    else:
        specs = [{"name": c.name, "weight": c.weight, **c.options}
                 for c in config.rewards.components]
        aggregation = config.rewards.aggregation
        if not specs:
            raise ValueError(f"{args.config} has no rewards.components; pass --rewards")
    if args.prompts:
        records = resolve_prompts(args.prompts)
    else:
        source = config.prompts.eval or config.prompts.train
        records = resolve_prompts(source)
        if config.prompts.num_eval:
            records = records[:config.prompts.num_eval]
    s = config.sampling if config is not None else None
    steps = args.steps if args.steps is not None else (s.eval_num_steps if s else None)
    guidance = args.guidance
    if guidance is None and s is not None:
        guidance = s.guidance_scale if s.eval_guidance_scale is None else s.eval_guidance_scale
    batch_size = args.batch_size or (max(s.rollout_batch_size, 16) if s else 8)
    per_prompt = args.samples_per_prompt
    _check_positive(per_prompt, "--samples-per-prompt")
    if args.seeds is not None:
        seeds = parse_seeds(args.seeds)
        if per_prompt is not None and len(seeds) != per_prompt:
            raise ValueError(f"--seeds gives {len(seeds)} seeds but --samples-per-prompt is "
                             f"{per_prompt}: give {per_prompt} seeds, or leave --seeds out (then "
                             f"the samples use seeds 0-{per_prompt - 1}, or the config's eval "
                             f"noise)")
    elif config is None:
        seeds = list(range(per_prompt)) if per_prompt is not None else [0]
    else:
        seeds = None
    threshold = args.success_threshold
    if not math.isfinite(threshold):
        raise ValueError(f"--success-threshold must be a finite number (got {threshold})")
    passk_keys = [k.strip() for k in args.passk_keys.split(",") if k.strip()] \
        if args.passk_keys else None
    if passk_keys is not None and per_prompt is None:
        raise ValueError("--passk-keys needs --samples-per-prompt K (pass@k needs K samples of "
                         "each prompt)")
    _check_positive(steps, "--steps")
    _check_positive(batch_size, "--batch-size")
    check_model_path(family, path)
    checkpoint = resolve_checkpoint(args.lora) if args.lora else Checkpoint(BASE, "base")
    check_checkpoint(checkpoint, family, path)
    check_reward_names(specs)
    out = Path(args.out)
    check_writable_dir(out.parent if str(out.parent) else ".", "--out")

    from reward_models import MultiReward

    device = resolve_device(args.device)
    reward = MultiReward(specs, aggregation=aggregation, device=device)
    model = load_flow_model(family, path, dtype, device, options)
    check_checkpoint(checkpoint, family, path, base_shapes=model_shapes(model))
    steps, guidance = default_sampling(model, family, steps, guidance)
    if config is not None and per_prompt is not None:
        # pass@k: the distinct prompts of the config's evaluation, each K times.
        from flowgrpo.prompts import eval_prompts

        records = eval_prompts(records, config.prompts.eval_per_family)
    if seeds is not None:
        rows = [(record, seed) for record in records for seed in seeds]
        noise = seed_noise(model, [seed for _, seed in rows])
    elif per_prompt is not None:
        # The config's eval noise stream (seeded by run.seed), one draw per sample, prompt-major.
        rows = [(record, None) for record in records for _ in range(per_prompt)]
        noise = torch.cat([model.initial_noise(1, seeded_generator(config.run.seed, "eval", i))
                           for i in range(len(rows))])
    else:
        # The trainer's evaluation samples and noise (Trainer.eval_samples / eval_noise): its
        # eval/ metrics are reproduced, including eval_per_family's balanced selection.
        from flowgrpo.prompts import eval_selection

        selection = eval_selection(records, config.prompts.eval_per_family, config.prompts.eval_seeds)
        rows = [(record, None) for record in selection]
        noise = torch.cat([model.initial_noise(1, seeded_generator(config.run.seed, "eval", i))
                           for i in range(len(rows))])
    prompts = [record["prompt"] for record, _ in rows]
    metadata = [record["metadata"] for record, _ in rows]
    bar = _progress(math.ceil(len(rows) / batch_size), "eval", args.quiet)
    with checkpoint_applied(model, checkpoint):
        media = generate(model, prompts, noise, steps, guidance, batch_size, bar)
    bar.close()
    scores = reward(media, prompts, metadata)
    families = [m.get("family") if isinstance(m, dict) else None for m in metadata]
    statistics = reward_statistics(scores, families)
    passk = None
    if per_prompt is not None:
        from flowgrpo.passk import passk_report

        # rows are prompt-major with per_prompt samples each: (P * K,) -> (P, K)
        passk = passk_report({k: v.reshape(len(records), per_prompt) for k, v in scores.items()},
                             families[::per_prompt], threshold, passk_keys)
    result = {
        "model": f"{family}:{path}", "checkpoint": str(checkpoint.path) if checkpoint.path else BASE,
        "config": args.config, "num_steps": steps, "guidance_scale": guidance,
        "num_samples": len(rows), **statistics,
        **({"pass_at_k": passk} if passk is not None else {}),
        "samples": [{"prompt": record["prompt"], "seed": seed,
                     "family": record["metadata"].get("family"),
                     **({"prompt_index": i // per_prompt} if per_prompt is not None else {}),
                     "rewards": {k: _json_number(float(v[i])) for k, v in scores.items()}}
                    for i, (record, seed) in enumerate(rows)],
    }
    out.write_text(json.dumps(result, indent=2))
    print(format_table(statistics))
    if passk is not None:
        from flowgrpo.passk import format_passk_table

        print()
        print(format_passk_table(passk))
    print(f"{len(rows)} samples, {steps} steps, guidance {guidance}; wrote {out}")
    return 0


# ================================================================================ flowgrpo grid
def run_grid(args: argparse.Namespace) -> int:
    import torch

    from flowgrpo.grids import (cell_caption, page_paths, paginate, render_image_grid,
                                render_video_grid, save_video, verdict_keys)

    family, path = parse_model(args.model)
    records = resolve_prompts(args.prompts)
    seeds = parse_seeds(args.seeds)
    options = parse_options(args.options)
    for value, flag in ((args.steps, "--steps"), (args.batch_size, "--batch-size"),
                        (args.max_rows, "--max-rows"), (args.fps, "--fps"),
                        (args.min_cell_size, "--min-cell-size")):
        _check_positive(value, flag)
    check_model_path(family, path)
    checkpoints = [resolve_checkpoint(text) for text in args.checkpoints]
    unique_labels(checkpoints)
    for checkpoint in checkpoints:
        check_checkpoint(checkpoint, family, path)
    out = Path(args.out)
    check_writable_dir(out.parent if str(out.parent) else ".", "--out")
    specs = parse_reward_specs(args.rewards) if args.rewards else None
    if specs:
        check_reward_names(specs)

    device = resolve_device(args.device)
    reward = None
    if specs:
        from reward_models import MultiReward

        reward = MultiReward(specs, device=device)
    model = load_flow_model(family, path, args.dtype, device, options)
    shapes = model_shapes(model)
    for checkpoint in checkpoints:
        check_checkpoint(checkpoint, family, path, base_shapes=shapes)
    steps, guidance = default_sampling(model, family, args.steps, args.guidance)
    rows = [(record, seed) for record in records for seed in seeds]
    prompts = [record["prompt"] for record, _ in rows]
    metadata = [record["metadata"] for record, _ in rows]
    noise = seed_noise(model, [seed for _, seed in rows])

    bar = _progress(len(checkpoints) * math.ceil(len(rows) / args.batch_size), "grid", args.quiet)
    columns, scores = [], []
    for checkpoint in checkpoints:
        bar.set_postfix_str(checkpoint.label)
        with checkpoint_applied(model, checkpoint):
            media = generate(model, prompts, noise, steps, guidance, args.batch_size, bar)
        columns.append(media)
        scores.append(reward(media, prompts, metadata) if reward is not None else None)
    bar.close()
    media = torch.stack(columns, dim=1)                  # (R, C, ...)

    row_labels = [f"{record['prompt']}\nseed {seed}" for record, seed in rows]
    col_labels = [checkpoint.label for checkpoint in checkpoints]
    cell_labels = None
    if reward is not None:
        verdicts = verdict_keys(scores, reward.weights)
        cell_labels = [[cell_caption(scores[c], reward.weights, r, verdict=verdicts)
                        for c in range(len(checkpoints))] for r in range(len(rows))]
    is_video = media.dim() == 6
    pages = paginate(len(rows), args.max_rows)
    target = out.with_suffix(".mp4") if is_video else (
        out if out.suffix.lower() in IMAGE_SUFFIXES else out.with_suffix(".png"))
    written, page_info = [], []
    for page, file in zip(pages, page_paths(target, len(pages))):
        page_cells = [cell_labels[r] for r in page] if cell_labels is not None else None
        page_rows = [row_labels[r] for r in page]
        if is_video:
            frames, layout = render_video_grid(media[page.start:page.stop], page_rows, col_labels,
                                               page_cells, min_cell_size=args.min_cell_size)
            written += save_video(frames, file, fps=args.fps)
        else:
            image, layout = render_image_grid(media[page.start:page.stop], page_rows, col_labels,
                                              page_cells, min_cell_size=args.min_cell_size)
            image.save(file)
            written.append(file)
        page_info.append({"file": file.name, "rows": [page.start, page.stop],
                          "scale": layout.scale, "size": [layout.width, layout.height],
                          "cells": [[list(layout.cell_box(r, c)) for c in range(len(checkpoints))]
                                    for r in range(len(page))]})
    summary = {
        "model": args.model, "num_steps": steps, "guidance_scale": guidance, "options": options,
        "columns": [{"label": c.label, "kind": c.kind, "path": str(c.path) if c.path else None}
                    for c in checkpoints],
        "rows": [{"prompt": record["prompt"], "seed": seed, "metadata": record["metadata"]}
                 for record, seed in rows],
        "rewards": None if reward is None else {
            checkpoint.label: {k: [_json_number(float(x)) for x in v] for k, v in column.items()}
            for checkpoint, column in zip(checkpoints, scores)},
        "pages": page_info,
    }
    sidecar = target.with_suffix(".json")
    sidecar.write_text(json.dumps(summary, indent=2))
    print(f"wrote {', '.join(str(p) for p in written)} and {sidecar} "
          f"({len(rows)} rows x {len(checkpoints)} columns, {len(pages)} page(s))")
    return 0


# ================================================================================ parsers
def _add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--model", required=required, metavar="FAMILY:PATH",
                        help="model family (sd3, flux, wan, toy) and hub id or local folder, "
                             "e.g. sd3:stabilityai/stable-diffusion-3.5-medium")
    parser.add_argument("--options", nargs="*", metavar="KEY=VALUE",
                        help="family options, e.g. height=512 width=512 (see pipelines/<family>.py)")
    parser.add_argument("--steps", type=int, default=None,
                        help="ODE (Euler) steps; default: the family's evaluation setting "
                             "(SD3 40, FLUX 28, Wan 50, toy: its toy_config.json)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="CFG scale (FLUX: guidance embedding); default: the family's "
                             "(SD3 4.5, FLUX 3.5, Wan 5, toy: its toy_config.json)")
    parser.add_argument("--batch-size", type=int, default=None if not required else 8,
                        help="samples per transformer call")
    parser.add_argument("--device", default="auto",
                        help="torch device (default auto: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None if not required else "float32",
                        choices=DTYPE_NAMES, help="transformer dtype (default float32)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_commands(subparsers) -> None:
    """Register ``sample``, ``eval`` and ``grid`` on the ``flowgrpo`` sub-command parser."""
    sample = subparsers.add_parser(
        "sample", help="deterministic samples per prompt and seed (PNG, or MP4 + GIF for video)",
        description="Sample with the deterministic Euler ODE sampler; the noise of seed s is "
                    "model.initial_noise(1, torch.Generator().manual_seed(s)).")
    _add_model_arguments(sample)
    sample.add_argument("--lora", default=None, metavar="CKPT",
                        help="trainer checkpoint to apply (LoRA or full fine-tune) or a run folder")
    sample.add_argument("--prompts", required=True,
                        help="prompt file (.txt / .jsonl), toy:<split>, or the prompt itself")
    sample.add_argument("--seeds", nargs="+", default=["0"],
                        help="e.g. 0 1 2, 0,1,2 or 0-3 (default 0)")
    sample.add_argument("--fps", type=float, default=8.0, help="frames per second of videos")
    sample.add_argument("--out", required=True, help="output folder")
    sample.set_defaults(handler=run_sample)

    evaluate = subparsers.add_parser(
        "eval", help="reward statistics per component and prompt family (JSON + table)",
        description="Score deterministic samples. With CONFIG, the model, rewards, eval prompts, "
                    "steps, guidance and noise are the training run's evaluation settings (so "
                    "the numbers match its eval/ metrics); flags override them.")
    evaluate.add_argument("config", nargs="?", help="training YAML config")
    evaluate.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    _add_model_arguments(evaluate, required=False)
    evaluate.add_argument("--rewards", default=None,
                          help="reward specs: ocr | ocr=1,aesthetic=0.1 | '[{name: ocr, ...}]'")
    evaluate.add_argument("--prompts", default=None,
                          help="prompt file (.txt / .jsonl), toy:<split>, or the prompt itself")
    evaluate.add_argument("--lora", default=None, metavar="CKPT",
                          help="trainer checkpoint to evaluate (default: the base model)")
    evaluate.add_argument("--seeds", nargs="+", default=None,
                          help="seeds per prompt, e.g. 0 1 or 0-3 (default: the config's eval "
                               "noise, else 0)")
    evaluate.add_argument("--samples-per-prompt", type=int, default=None, metavar="K",
                          help="pass@k diagnostics: sample each eval prompt K times with K "
                               "distinct noises (seeds 0..K-1, or the K --seeds, or with a "
                               "CONFIG its eval noise stream; with a CONFIG the prompts are the "
                               "distinct prompts of its evaluation: the first eval_per_family of "
                               "each family, or all) and report pass@1, pass@k for k = 1, 2, "
                               "4, ..., K (unbiased estimator), the share of prompts with "
                               "0 < successes < K and the histogram of successes per prompt, "
                               "per family and overall")
    evaluate.add_argument("--success-threshold", type=float, default=0.5, metavar="T",
                          help="a sample succeeds when its score is >= T (default 0.5: a 0/1 "
                               "verdict succeeds when it is 1)")
    evaluate.add_argument("--passk-keys", default=None, metavar="KEY[,KEY]",
                          help="reward keys to report pass@k for (default: every key whose "
                               "scores are all 0 or 1, e.g. geneval_toy.exact)")
    evaluate.add_argument("--out", default="eval.json", help="JSON results file (default eval.json)")
    evaluate.set_defaults(handler=run_eval)

    grid = subparsers.add_parser(
        "grid", help="side-by-side comparison grid of the base model and checkpoints",
        description="Rows are prompts x seeds, columns the given checkpoints ('base' = the model "
                    "without one), with the same noise along each row. Writes OUT (PNG; for "
                    "video an MP4 and a GIF), paged as OUT_001... when rows exceed --max-rows, "
                    "plus OUT.json with the rewards and cell positions.")
    _add_model_arguments(grid)
    grid.add_argument("--checkpoints", nargs="+", required=True, metavar="CKPT",
                      help="columns: 'base' and/or checkpoint or run folders")
    grid.add_argument("--prompts", required=True,
                      help="prompt file (.txt / .jsonl), toy:<split>, or the prompt itself")
    grid.add_argument("--seeds", nargs="+", default=["0"], help="e.g. 0 1, 0,1 or 0-3 (default 0)")
    grid.add_argument("--rewards", default=None, help="label each cell with these rewards")
    grid.add_argument("--max-rows", type=int, default=8, help="rows per page (default 8)")
    grid.add_argument("--min-cell-size", type=int, default=128,
                      help="upscale smaller images (nearest neighbour, integer factor) to at least "
                           "this many px (default 128)")
    grid.add_argument("--fps", type=float, default=8.0, help="frames per second of video grids")
    grid.add_argument("--out", required=True, help="output file, e.g. grid.png")
    grid.set_defaults(handler=run_grid)
