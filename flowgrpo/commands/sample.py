"""``flowgrpo sample``: deterministic samples per prompt and seed, as PNG or MP4 + GIF."""
from __future__ import annotations

import argparse
import json
import math

from PIL import Image

from flowgrpo.checkpoint_inspection import (BASE, Checkpoint, check_checkpoint, checkpoint_applied,
                                            resolve_checkpoint)
from flowgrpo.commands.common import (check_model_path, check_positive, check_writable_dir,
                                      default_sampling, generate, load_flow_model, parse_model,
                                      parse_options, parse_seeds, progress_bar, resolve_device,
                                      resolve_prompts, seed_noise, slug)
from flowgrpo.grids import save_video
from flowgrpo.pixels import to_uint8
from flowgrpo.prompts import record_images


# ================================================================================ flowgrpo sample
def run_sample(args: argparse.Namespace) -> int:
    family, path = parse_model(args.model)
    records = resolve_prompts(args.prompts)
    seeds = parse_seeds(args.seeds)
    options = parse_options(args.options)
    check_positive(args.steps, "--steps")
    check_positive(args.batch_size, "--batch-size")
    check_positive(args.fps, "--fps")
    check_model_path(family, path)
    checkpoint = resolve_checkpoint(args.lora) if args.lora else Checkpoint(BASE, "base")
    check_checkpoint(checkpoint, family, path)
    out = check_writable_dir(args.out, "--out")

    model = load_flow_model(family, path, args.dtype, resolve_device(args.device), options)
    check_checkpoint(checkpoint, family, path, model=model)
    steps, guidance = default_sampling(model, family, args.steps, args.guidance)
    rows = [(index, record, seed) for index, record in enumerate(records) for seed in seeds]
    prompts = [record["prompt"] for _, record, _ in rows]
    noise = seed_noise(model, [seed for _, _, seed in rows])
    bar = progress_bar(math.ceil(len(rows) / args.batch_size), "sample", args.quiet)

    with checkpoint_applied(model, checkpoint):
        media = generate(model, prompts, noise, steps, guidance, args.batch_size, bar,
                         images=record_images([record for _, record, _ in rows]))
    bar.close()

    index = []
    for (prompt_index, record, seed), item in zip(rows, media):
        stem = f"{prompt_index:03d}_{slug(record['prompt'])}_seed{seed}"
        if item.dim() == 4:        # video (F, 3, H, W)
            files = save_video(to_uint8(item), out / f"{stem}.mp4", fps=args.fps)
        else:
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
