"""``flowgrpo grid``: prompts x seeds against the base model and checkpoints."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from flowgrpo.checkpoint_inspection import (check_checkpoint, checkpoint_applied,
                                            resolve_checkpoint, unique_labels)
from flowgrpo.commands.common import (IMAGE_SUFFIXES, check_model_path, check_positive,
                                      check_reward_names, check_writable_dir, default_sampling,
                                      generate, held_out_specs, json_number, load_flow_model,
                                      load_held_out, parse_model, parse_options, parse_reward_specs,
                                      parse_seeds, progress_bar, resolve_device, resolve_prompts,
                                      seed_noise)
from flowgrpo.grids import (cell_caption, page_paths, paginate, render_image_grid,
                            render_video_grid, save_video, verdict_keys, with_source_column)
from flowgrpo.prompts import record_images, reward_metadata
from reward_models import MultiReward


# ================================================================================ flowgrpo grid
def run_grid(args: argparse.Namespace) -> int:
    family, path = parse_model(args.model)
    records = resolve_prompts(args.prompts)
    seeds = parse_seeds(args.seeds)
    options = parse_options(args.options)
    for value, flag in ((args.steps, "--steps"), (args.batch_size, "--batch-size"),
                        (args.max_rows, "--max-rows"), (args.fps, "--fps"),
                        (args.min_cell_size, "--min-cell-size")):
        check_positive(value, flag)
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
    heldout_specs = held_out_specs(args.eval_rewards)
    check_reward_names(heldout_specs)

    device = resolve_device(args.device)
    reward = None
    if specs:
        reward = MultiReward(specs, device=device)
    held_out = load_held_out(heldout_specs, reward.rewards if reward is not None else (), device)
    model = load_flow_model(family, path, args.dtype, device, options)
    for checkpoint in checkpoints:
        check_checkpoint(checkpoint, family, path, model=model)
    steps, guidance = default_sampling(model, family, args.steps, args.guidance)
    rows = [(record, seed) for record in records for seed in seeds]
    prompts = [record["prompt"] for record, _ in rows]
    metadata = reward_metadata([record for record, _ in rows])   # + "source_image" when editing
    sources = record_images([record for record, _ in rows])
    noise = seed_noise(model, [seed for _, seed in rows])

    bar = progress_bar(len(checkpoints) * math.ceil(len(rows) / args.batch_size), "grid", args.quiet)
    columns, scores = [], []
    for checkpoint in checkpoints:
        bar.set_postfix_str(checkpoint.label)
        with checkpoint_applied(model, checkpoint):
            media = generate(model, prompts, noise, steps, guidance, args.batch_size, bar,
                             images=sources)
        columns.append(media)
        column = reward(media, prompts, metadata) if reward is not None else {}
        if held_out is not None:   # held-out metrics of the same images, for the labels
            column.update({k: v for k, v in held_out(media, prompts, metadata).items()
                           if k != "total"})
        scores.append(column if column else None)
    bar.close()
    media = torch.stack(columns, dim=1)                  # (R, C, ...)
    lead = 0
    if sources is not None and media.dim() == 5:
        # Editing: the source image is column 0, so each row reads source -> edits.
        media, lead = with_source_column(media, sources), 1

    row_labels = [f"{record['prompt']}\nseed {seed}" for record, seed in rows]
    col_labels = ["source"] * lead + [checkpoint.label for checkpoint in checkpoints]
    cell_labels = None
    if reward is not None or held_out is not None:
        weights = reward.weights if reward is not None else {}
        extra = list(held_out.rewards) if held_out is not None else []
        verdicts = verdict_keys(scores, weights)
        cell_labels = [[""] * lead + [cell_caption(scores[c], weights, r, verdict=verdicts,
                                                   extra=extra, max_lines=4 + len(extra))
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
                          "cells": [[list(layout.cell_box(r, c)) for c in range(lead + len(checkpoints))]
                                    for r in range(len(page))]})
    summary = {
        "model": args.model, "num_steps": steps, "guidance_scale": guidance, "options": options,
        "columns": [{"label": c.label, "kind": c.kind, "path": str(c.path) if c.path else None}
                    for c in checkpoints],
        "rows": [{"prompt": record["prompt"], "seed": seed, "metadata": record["metadata"]}
                 for record, seed in rows],
        "source_column": bool(lead),
        "held_out": list(held_out.rewards) if held_out is not None else [],
        "rewards": None if reward is None and held_out is None else {
            checkpoint.label: {k: [json_number(float(x)) for x in v] for k, v in column.items()}
            for checkpoint, column in zip(checkpoints, scores)},
        "pages": page_info,
    }
    sidecar = target.with_suffix(".json")
    sidecar.write_text(json.dumps(summary, indent=2))
    print(f"wrote {', '.join(str(p) for p in written)} and {sidecar} "
          f"({len(rows)} rows x {len(checkpoints)} columns, {len(pages)} page(s))")
    return 0
