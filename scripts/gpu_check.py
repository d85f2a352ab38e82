"""One-GPU check of GRPO training in bf16 and fp16, in under 10 minutes.

For every model family with an offline build (toy: assets/toy; SD3, FLUX.1, Wan2.1, Z-Image,
FLUX.2-klein, Qwen-Image-Edit-Plus, Wan2.1 I2V, HunyuanVideo, LTX-2: the tiny random folders of
``pipelines.tiny``; the editing and image-to-video families train on prompts with source images
written to the work folder) and for a width-realistic SD3 stack (SD3.5-Medium's block
width at 512 px, 4 blocks, LoRA rank 32), this runs a few training iterations in each precision
through the public API (``load_config(path, overrides)`` and ``Trainer(config).train()``) and
prints one row per run:

    family  precision  weights dtype  peak GPU memory  s/iteration  first-pass ratio deviation

``train/first_pass_ratio_max_dev`` is the on-policy check: the first replay of a rollout must see
the weights the rollout saw, so every ratio is 1 (deviation 0). A deviation above --ratio-tol
(default 1e-5, ten times below the 1e-4 clip range of Flow-GRPO's SD3 recipe) fails the run.

Results go to $OUT/gpu_check.json when OUT is set, else runs/gpu_check.json (--out overrides).
Exit status: 0 all runs passed; 1 a run failed or a check did not hold; 2 no CUDA device (or a
bad argument). ``--cpu-smoke`` runs the same plumbing on the CPU (toy, bf16 autocast, one short
iteration) so that a CPU test can check the script end to end.

Each run is a separate Python process: accelerate keeps one process-wide state and refuses a second
Accelerator with another mixed precision, and a fresh process makes the peak-memory counter and
the CUDA caches start from nothing.

    bash scripts/gpu_check.sh                        # all families, bf16 and fp16, 3 iterations
    bash scripts/gpu_check.sh --families sd3_wide --precisions bf16
    bash scripts/gpu_check.sh --cpu-smoke            # no GPU: plumbing only
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a file (python scripts/gpu_check.py), so the repository's packages are not on sys.path
# unless the project is installed; the child processes get the same path through PYTHONPATH.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# In run order: the width-realistic sd3_wide before the later tiny families, so that a spent
# --time-budget skips tiny runs (run them with --families) rather than the one that measures.
FAMILIES = ("toy", "sd3", "flux", "wan", "sd3_wide", "z_image", "flux2", "qwen_image_edit_plus",
            "wan_i2v", "hunyuan_video", "ltx2")
# Families whose prompts carry a source image (JSONL {"prompt", "image"}): image_prompts() writes them.
IMAGE_FAMILIES = ("qwen_image_edit_plus", "wan_i2v")
PRECISIONS = ("bf16", "fp16")
WEIGHT_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
PROMPTS = ["a red square", "a blue circle", "a green cat", "two yellow stars"]

# SD3.5-Medium's transformer width: 24 heads x 64 = 1536 channels, T5 width 4096; 4 of its 24
# blocks, 2 of them with the second (dual) attention like its first 13.
WIDE_SD3 = {"num_layers": 4, "attention_head_dim": 64, "num_attention_heads": 24,
            "joint_attention_dim": 4096, "caption_projection_dim": 1536,
            "dual_attention_layers": (0, 1), "height": 512, "lora_rank": 32}


# --------------------------------------------------------------------------- model folders

def build_wide_sd3(directory: Path) -> Path:
    """The tiny SD3 pipeline with its transformer and T5 encoder replaced by SD3.5-Medium-width
    ones (random weights): the transformer's per-block cost and memory are realistic, the CLIP
    encoders and the VAE stay tiny (they run once per rollout, without gradients)."""
    import torch
    from diffusers import SD3Transformer2DModel
    from transformers import T5Config, T5EncoderModel

    from pipelines.tiny import build_tiny

    w = WIDE_SD3
    pipeline = build_tiny("sd3")
    tokenizer = pipeline.tokenizer_3
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        text_encoder_3 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer), d_model=w["joint_attention_dim"], d_kv=64,
            d_ff=w["joint_attention_dim"], num_layers=1, num_heads=w["joint_attention_dim"] // 64,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id))
        transformer = SD3Transformer2DModel(
            sample_size=w["height"] // 8, patch_size=2, in_channels=16, out_channels=16,
            num_layers=w["num_layers"], attention_head_dim=w["attention_head_dim"],
            num_attention_heads=w["num_attention_heads"],
            joint_attention_dim=w["joint_attention_dim"],
            caption_projection_dim=w["caption_projection_dim"],
            # The pooled CLIP-L + CLIP-G embedding of the tiny encoders.
            pooled_projection_dim=pipeline.transformer.config.pooled_projection_dim,
            pos_embed_max_size=384, dual_attention_layers=w["dual_attention_layers"],
            qk_norm="rms_norm")
    pipeline.register_modules(transformer=transformer, text_encoder_3=text_encoder_3)
    directory.mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(str(directory))
    return directory


def model_folder(family: str, work: Path) -> Path:
    """Where the family's model folder is (``ensure_model`` writes it)."""
    return ROOT / "assets" / "toy" if family == "toy" else work / "models" / family


def ensure_model(family: str, work: Path) -> Path:
    """The family's model folder, written under ``work`` on first use."""
    folder = model_folder(family, work)
    if family != "toy" and not (folder / "model_index.json").is_file():
        import diffusers
        import transformers

        # save_pretrained's per-shard progress bars would interleave with the table.
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        if family == "sd3_wide":
            build_wide_sd3(folder)
        else:
            from pipelines.tiny import save_tiny

            save_tiny(family, folder)
    return folder


# --------------------------------------------------------------------------- run configs

def run_config(family: str, precision: str, iterations: int, work: Path, model_path: Path,
               smoke: bool) -> dict:
    """The YAML of one run. Settings follow tests/test_trainer_families.py (each family's plan
    and guidance), sized so that three iterations of the tiny builds take seconds."""
    name = f"{family}_{precision}"
    lora = {"rank": 4, "alpha": 8}
    dtype = WEIGHT_DTYPES[precision]
    options: dict = {"height": 32, "width": 32, "max_sequence_length": 16}
    sampling: dict = {"num_steps": 4, "rollout_batch_size": 4}
    training: dict = {"prompts_per_iteration": 2, "group_size": 4, "lr": 1e-4,
                      "mixed_precision": precision, "skip_zero_std_groups": False}
    train_prompts = str(work / "prompts.txt")
    rewards = [{"name": "jpeg_compressibility"}]
    if family == "toy":
        # Full fine-tuning, as the toy default: the trained weights are the model's own, so they
        # stay float32 (AdamW on bf16/fp16 master weights loses small updates); autocast supplies
        # the low precision.
        dtype, options, lora = "float32", {}, {"enabled": False}
        train_prompts = "toy:train"
        rewards = [{"name": "geneval_toy", "options": {"score": "partial"}}]
        if smoke:
            sampling = {"num_steps": 2, "rollout_batch_size": 4}
            training.update(prompts_per_iteration=2, group_size=2)
    elif family == "sd3":
        sampling["guidance_scale"] = 3.0
    elif family == "flux":
        sampling.update(guidance_scale=3.5, plan={"kind": "window", "window_size": 1,
                                                  "solver_after": "dpmpp_2m"})
    elif family == "wan":
        options["num_frames"] = 5
        sampling.update(guidance_scale=2.0, plan={"kind": "one_step"})
        training["rectification"] = True
    elif family == "z_image":
        sampling["guidance_scale"] = 5.0   # the base model's CFG 4 in ZImagePipeline's scale
    elif family == "flux2":
        sampling["guidance_scale"] = 4.0   # the klein base build: real CFG
    elif family == "qwen_image_edit_plus":
        # no max_sequence_length option (Qwen's text is per prompt); small VAE sources
        options = {"height": 32, "width": 32, "source_area": 64 * 64}
        sampling.update(guidance_scale=4.0, plan={"kind": "full"})
        train_prompts = str(work / "image_prompts.jsonl")
    elif family == "wan_i2v":
        options["num_frames"] = 5
        sampling.update(guidance_scale=5.0, plan={"kind": "one_step"})
        train_prompts = str(work / "image_prompts.jsonl")
    elif family == "hunyuan_video":
        options["num_frames"] = 5
        sampling["guidance_scale"] = 6.0   # the guidance embedding (no real CFG)
    elif family == "ltx2":
        options["num_frames"] = 5
        sampling.update(guidance_scale=3.0, kind="cps",
                        plan={"kind": "window", "window_size": 2, "window_strategy": "random"})
    elif family == "sd3_wide":
        side = WIDE_SD3["height"]
        options = {"height": side, "width": side}   # T5 keeps its default 256 tokens
        lora = {"rank": WIDE_SD3["lora_rank"], "alpha": 2 * WIDE_SD3["lora_rank"]}
        # Flow-GRPO's SD3 guidance: real CFG doubles every transformer call to 16 rows.
        sampling = {"num_steps": 6, "rollout_batch_size": 8, "guidance_scale": 4.5}
    return {
        "name": name,
        "model": {"family": "sd3" if family == "sd3_wide" else family, "path": str(model_path),
                  "dtype": dtype, "options": options, "lora": lora},
        "prompts": {"train": train_prompts, "eval": None},
        "sampling": sampling,
        "training": training,
        "rewards": {"components": rewards},
        "run": {"output_dir": str(work / "runs"), "max_iterations": iterations, "seed": 0,
                "eval_every": 0, "checkpoint_every": 0, "tracker": "none", "progress": False,
                "comparison_grid": False},
    }


# --------------------------------------------------------------------------- one run (child)

def worker(spec_path: str) -> int:
    """Train one config (``spec["config"]``) and write what the row needs to ``spec["result"]``."""
    import torch

    from flowgrpo.config import load_config
    from flowgrpo.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    cuda = torch.cuda.is_available() and not spec["smoke"]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    config = load_config(spec["config"], spec["overrides"])
    Trainer(config).train(overwrite=True)   # a rerun of the check replaces its old runs
    result = {"peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
              "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None}
    metrics = Path(config.run.output_dir) / config.name / "metrics.jsonl"
    result["metrics"] = [json.loads(line) for line in metrics.read_text().splitlines()
                         if line.strip()]
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


def summarise(metrics: list[dict], ratio_tol: float) -> dict:
    """Row values from a run's metrics.jsonl records."""
    train = [m for m in metrics if m.get("phase") == "train"]
    if not train:
        return {"status": "failed", "error": "metrics.jsonl has no train records"}
    seconds = [float(m["time/iteration"]) for m in train]
    # The first iteration pays one-off costs (kernel selection, allocator growth, lazy inits).
    steady = seconds[1:] or seconds
    deviation = max(float(m["train/first_pass_ratio_max_dev"]) for m in train)
    nan_count = int(sum(m.get("reward/nan_count", 0) for m in train))
    row = {"iterations": len(train), "iteration_seconds": seconds,
           "seconds_per_iteration": sum(steady) / len(steady),
           "first_iteration_seconds": seconds[0],
           "first_pass_ratio_max_dev": deviation, "reward_nan_count": nan_count,
           "status": "ok", "error": None}
    if not deviation <= ratio_tol:   # also catches NaN
        row.update(status="failed", error=f"train/first_pass_ratio_max_dev = {deviation:.3g} > "
                   f"{ratio_tol:g}: the first replay did not see the rollout's weights")
    elif nan_count:
        row.update(status="failed", error=f"{nan_count} samples had a NaN reward (decoded media "
                   "not finite?)")
    return row


def image_prompts(work: Path) -> Path:
    """``work/image_prompts.jsonl``: PROMPTS, each with a source image (random 8-bit RGB of
    different sizes, written beside it) for the editing and image-to-video families."""
    path = work / "image_prompts.jsonl"
    if path.is_file():
        return path
    import numpy as np
    from PIL import Image

    generator = np.random.default_rng(0)
    lines = []
    for i, prompt in enumerate(PROMPTS):
        size = (48 + 16 * i, 64 - 8 * i)   # (width, height): the sources' aspect ratios differ
        pixels = generator.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(work / f"source_{i}.png")
        lines.append(json.dumps({"prompt": prompt, "image": f"source_{i}.png"}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_config(family: str, precision: str, args, work: Path) -> Path:
    """Write the run's YAML and check it (with the --override values) the way the trainer will,
    so that a bad override stops the check before any model is built."""
    import yaml

    from flowgrpo.config import load_config

    config = run_config(family, precision, args.iterations, work, model_folder(family, work),
                        args.cpu_smoke)
    if family in IMAGE_FAMILIES:
        image_prompts(work)
    path = work / "configs" / f"{family}_{precision}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    load_config(path, args.override)
    return path


def run_one(family: str, precision: str, args, work: Path, timeout: int) -> dict:
    name = f"{family}_{precision}"
    config_path = work / "configs" / f"{name}.yaml"
    import yaml

    row = {"family": family, "precision": precision, "status": "failed", "error": None,
           "dtype": yaml.safe_load(config_path.read_text())["model"]["dtype"],
           "peak_memory_bytes": None, "peak_memory_gib": None}
    try:
        ensure_model(family, work)
    except Exception as err:   # a build failure is this row's result; the other runs go on
        row["error"] = f"building the {family} model folder failed: {type(err).__name__}: {err}"
        return row
    spec_path = work / "configs" / f"{name}.spec.json"
    result_path = work / "results" / f"{name}.json"
    result_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps({"config": str(config_path), "overrides": args.override,
                                     "result": str(result_path), "smoke": args.cpu_smoke}))
    log_path = work / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if args.cpu_smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""   # the smoke run must not pick up a GPU either
    began = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                                   str(spec_path)], cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    row["wall_seconds"] = time.perf_counter() - began
    row["log"] = str(log_path)
    if code != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        reason = (f"timed out after {timeout} s (--run-timeout / --time-budget)" if code is None
                  else f"exit status {code}")
        row["error"] = f"{reason}; last lines of {log_path}:\n    " + "\n    ".join(tail)
        return row
    result = json.loads(result_path.read_text())
    row.update(summarise(result["metrics"], args.ratio_tol))
    row["peak_memory_bytes"] = result["peak_memory_bytes"]
    row["peak_reserved_bytes"] = result["peak_reserved_bytes"]
    if result["peak_memory_bytes"] is not None:
        row["peak_memory_gib"] = result["peak_memory_bytes"] / 2**30
    row["run_dir"] = str(work / "runs" / name)
    return row


# --------------------------------------------------------------------------- table and report

COLUMNS = (("family", 9), ("precision", 9), ("dtype", 9), ("peak GiB", 9), ("s/iter", 8),
           ("first s", 8), ("ratio dev", 10), ("status", 6))


def format_row(row: dict) -> str:
    def number(value, spec):
        return "-" if value is None else format(value, spec)

    cells = [row["family"], row["precision"], row.get("dtype", "-"),
             number(row.get("peak_memory_gib"), ".3f"),
             number(row.get("seconds_per_iteration"), ".3f"),
             number(row.get("first_iteration_seconds"), ".2f"),
             number(row.get("first_pass_ratio_max_dev"), ".2g"), row["status"]]
    return "  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip()


def environment(cuda: bool) -> dict:
    from importlib.metadata import version

    import torch

    # Versions from the package metadata: importing diffusers here would cost seconds per check.
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "diffusers": version("diffusers"), "accelerate": version("accelerate"),
            "transformers": version("transformers"), "peft": version("peft"),
            "python": sys.version.split()[0]}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, device_memory_gib=props.total_memory / 2**30,
                    bf16_supported=torch.cuda.is_bf16_supported())
    else:
        info["device"] = "cpu"
    return info


def default_output() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else ROOT / "runs" / "gpu_check.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated subset of {','.join(FAMILIES)}")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help="comma-separated subset of bf16,fp16")
    parser.add_argument("--iterations", type=int, default=3, help="training iterations per run")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to every run (repeatable), e.g. "
                             "model.gradient_checkpointing=true")
    parser.add_argument("--ratio-tol", type=float, default=1e-5,
                        help="largest accepted train/first_pass_ratio_max_dev")
    parser.add_argument("--run-timeout", type=int, default=300, help="seconds allowed per run")
    parser.add_argument("--time-budget", type=int, default=540,
                        help="seconds for all runs together; runs that would start later are "
                             "reported as skipped (keeps the whole check under 10 minutes)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default $OUT/gpu_check.json, else runs/gpu_check.json)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="model folders, configs, runs and logs (default: a temporary folder, "
                             "removed at the end unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU needed: toy only, bf16 autocast, 1 short iteration on the CPU "
                             "(checks the plumbing, measures nothing)")
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [f for f in args.families if f not in FAMILIES]
    if bad:
        parser.error(f"--families: unknown {bad[0]!r}; choose from {', '.join(FAMILIES)}")
    bad = [p for p in args.precisions if p not in PRECISIONS]
    if bad:
        parser.error(f"--precisions: unknown {bad[0]!r}; choose from {', '.join(PRECISIONS)}")
    if args.iterations < 1:
        parser.error("--iterations must be >= 1")
    if args.cpu_smoke:
        # One short run keeps the smoke test near 10 s on two cores; what fp16 changes (the CUDA
        # GradScaler, fp16 kernels) only exists on the GPU, and the tiny diffusers builds train
        # on the CPU in tests/test_trainer_families.py already.
        args.families, args.precisions, args.iterations = ["toy"], ["bf16"], 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, built for CUDA {torch.version.cuda}). Run it on a machine "
              "with an NVIDIA GPU and a CUDA build of torch, or pass --cpu-smoke to check the "
              "script's plumbing on the CPU.", file=sys.stderr)
        return 2
    out = args.out or default_output()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    report = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "mode": "cpu-smoke" if args.cpu_smoke else "gpu", "iterations": args.iterations,
              "ratio_tolerance": args.ratio_tol, "overrides": args.override,
              "environment": environment(cuda and not args.cpu_smoke), "runs": []}
    from flowgrpo.config import ConfigError

    try:
        for family in args.families:
            for precision in args.precisions:
                write_config(family, precision, args, work)
    except ConfigError as err:
        print(f"gpu_check: the {family} {precision} config is invalid: {err} (check --override)",
              file=sys.stderr)
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
        return 2
    print(f"gpu_check ({report['mode']}, {report['environment']['device']}, "
          f"{args.iterations} iteration(s) per run); work folder {work}", flush=True)
    print("  ".join(name.ljust(w) for name, w in COLUMNS).rstrip(), flush=True)
    began = time.perf_counter()
    try:
        for family in args.families:
            for precision in args.precisions:
                left = args.time_budget - (time.perf_counter() - began)
                if left < 10:
                    row = {"family": family, "precision": precision, "status": "skipped",
                           "error": f"--time-budget of {args.time_budget} s spent"}
                else:
                    row = run_one(family, precision, args, work,
                                  timeout=int(min(args.run_timeout, left)))
                report["runs"].append(row)
                print(format_row(row), flush=True)
                if row["error"]:
                    print(f"  {family} {precision}: {row['error']}", flush=True)
    finally:
        report["total_seconds"] = time.perf_counter() - began
        report["ok"] = bool(report["runs"]) and all(r["status"] == "ok" for r in report["runs"])
        report["work_dir"] = str(work)
        report["work_dir_kept"] = args.work_dir is not None or args.keep or not report["ok"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        # A failed run's log and run folder are what one reads next: keep them.
        if not report["work_dir_kept"]:
            shutil.rmtree(work, ignore_errors=True)
    failed = [f"{r['family']} {r['precision']}" for r in report["runs"] if r["status"] != "ok"]
    print(f"results: {out} ({report['total_seconds']:.0f} s)"
          + (f"; FAILED: {', '.join(failed)} (logs and runs kept in {work})" if failed
             else "; all runs passed"), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
