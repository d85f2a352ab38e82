"""``flowgrpo eval``: reward statistics per component and family, optionally pass@k."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import Tensor

from flowgrpo.checkpoint_inspection import (BASE, Checkpoint, check_checkpoint, checkpoint_applied,
                                            resolve_checkpoint)
from flowgrpo.commands.common import (check_model_path, check_positive, check_reward_names,
                                      check_writable_dir, default_sampling, generate,
                                      held_out_specs, json_number, load_flow_model, load_held_out,
                                      parse_model, parse_options, parse_reward_specs, parse_seeds,
                                      progress_bar, resolve_device, resolve_prompts, seed_noise)
from flowgrpo.config import eval_noise_seed, load_config
from flowgrpo.heldout import eval_reward_specs, metric_higher_is_better, reward_directions
from flowgrpo.passk import family_mean_se, format_passk_table, mean_and_se, passk_report
from flowgrpo.prompts import eval_prompts, eval_selection, record_images, reward_metadata
from flowgrpo.rollout import eval_noise
from reward_models import MultiReward


# ================================================================================ flowgrpo eval
def reward_statistics(scores: dict[str, Tensor], families: list[str | None]) -> dict:
    """Per reward key: mean/std/se/min/max/count/nan_count over the samples; the same per family
    (samples whose metadata has a "family"); the family mean (GenEval's overall score) and its
    standard error ``family_mean_se`` = sqrt(sum_f se_f^2) / F. se = std / sqrt(count) (population
    std, ``flowgrpo.passk.mean_and_se``). scores: key -> (N,); families: N entries."""
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


def format_table(statistics: dict, notes: dict[str, str] | None = None) -> str:
    """Rows = reward keys, columns = all samples and each family: 'mean +- std (n, se)', se the
    standard error of the mean. ``notes``: key -> text after its row name (e.g. "held-out,
    lower is better")."""
    notes = notes or {}
    columns = [("all", statistics["rewards"])] + list(statistics["families"].items())
    keys = list(statistics["rewards"])

    def cell(entry: dict) -> str:
        if entry["mean"] is None:
            return "n/a"
        return f"{entry['mean']:.4f} +- {entry['std']:.4f} ({entry['count']}, se {entry['se']:.4f})"

    table = [["reward"] + [name for name, _ in columns]]
    table += [[key + (f" [{notes[key]}]" if notes.get(key) else "")]
              + [cell(stats[key]) for _, stats in columns] for key in keys]
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
    config = None
    if args.config:
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

    heldout_specs = held_out_specs(args.eval_rewards,
                                   eval_reward_specs(config) if config is not None else None)
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
    check_positive(per_prompt, "--samples-per-prompt")
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
    check_positive(steps, "--steps")
    check_positive(batch_size, "--batch-size")
    check_model_path(family, path)
    checkpoint = resolve_checkpoint(args.lora) if args.lora else Checkpoint(BASE, "base")
    check_checkpoint(checkpoint, family, path)
    check_reward_names(specs)
    check_reward_names(heldout_specs)
    out = Path(args.out)
    check_writable_dir(out.parent if str(out.parent) else ".", "--out")

    device = resolve_device(args.device)
    reward = MultiReward(specs, aggregation=aggregation, device=device)
    held_out = load_held_out(heldout_specs, reward.rewards, device)
    model = load_flow_model(family, path, dtype, device, options)
    check_checkpoint(checkpoint, family, path, model=model)
    steps, guidance = default_sampling(model, family, steps, guidance)
    if config is not None and per_prompt is not None:
        # pass@k: the distinct prompts of the config's evaluation, each K times.

        records = eval_prompts(records, config.prompts.eval_per_family)
    if seeds is not None:
        rows = [(record, seed) for record in records for seed in seeds]
        noise = seed_noise(model, [seed for _, seed in rows])
    elif per_prompt is not None:
        # The config's eval noise stream (prompts.eval_seed, else run.seed), one draw per sample,
        # prompt-major.
        rows = [(record, None) for record in records for _ in range(per_prompt)]
        noise = eval_noise(model, eval_noise_seed(config), range(len(rows)))
    else:
        # The trainer's evaluation samples and noise (FlowPolicy.evaluate, rollout.eval_noise): its
        # eval/ metrics are reproduced, including eval_per_family's balanced selection.

        selection = eval_selection(records, config.prompts.eval_per_family, config.prompts.eval_seeds)
        rows = [(record, None) for record in selection]
        noise = eval_noise(model, eval_noise_seed(config), range(len(rows)))
    prompts = [record["prompt"] for record, _ in rows]

    metadata = reward_metadata([record for record, _ in rows])   # + "source_image" when editing
    bar = progress_bar(math.ceil(len(rows) / batch_size), "eval", args.quiet)
    with checkpoint_applied(model, checkpoint):
        media = generate(model, prompts, noise, steps, guidance, batch_size, bar,
                         images=record_images([record for record, _ in rows]))
    bar.close()
    scores = reward(media, prompts, metadata)
    if held_out is not None:   # the same samples, scored once more by the held-out metrics
        scores.update({k: v for k, v in held_out(media, prompts, metadata).items()
                       if k != "total"})

    directions = reward_directions(reward, held_out)
    heldout_keys = set(held_out.rewards) if held_out is not None else set()
    notes = {key: ", ".join(([] if key.split(".")[0] not in heldout_keys else ["held-out"])
                            + ([] if metric_higher_is_better(key, directions)
                               else ["lower is better"]))
             for key in scores}
    families = [m.get("family") if isinstance(m, dict) else None for m in metadata]
    statistics = reward_statistics(scores, families)
    passk = None
    if per_prompt is not None:
        # rows are prompt-major with per_prompt samples each: (P * K,) -> (P, K)
        passk = passk_report({k: v.reshape(len(records), per_prompt) for k, v in scores.items()},
                             families[::per_prompt], threshold, passk_keys)
    result = {
        "model": f"{family}:{path}", "checkpoint": str(checkpoint.path) if checkpoint.path else BASE,
        "config": args.config, "num_steps": steps, "guidance_scale": guidance,
        "num_samples": len(rows),
        "held_out": sorted(k for k in scores if k.split(".")[0] in heldout_keys),
        "lower_is_better": sorted(k for k in scores if not metric_higher_is_better(k, directions)),
        **statistics,
        **({"pass_at_k": passk} if passk is not None else {}),
        "samples": [{"prompt": record["prompt"], "seed": seed,
                     "family": record["metadata"].get("family"),
                     **({"prompt_index": i // per_prompt} if per_prompt is not None else {}),
                     "rewards": {k: json_number(float(v[i])) for k, v in scores.items()}}
                    for i, (record, seed) in enumerate(rows)],
    }
    out.write_text(json.dumps(result, indent=2))
    print(format_table(statistics, notes))
    if passk is not None:
        print()
        print(format_passk_table(passk))
    print(f"{len(rows)} samples, {steps} steps, guidance {guidance}; wrote {out}")
    return 0
