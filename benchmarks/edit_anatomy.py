"""Where a toy editing model fails and where along the trajectory its edit is decided.

    python benchmarks/edit_anatomy.py --model assets/toy_edit

1. **Failure anatomy**: deterministic (Euler ODE) edits of two-object records, each sorted into
   one class (``failure_class``): exact; the edited object kept its source colour ("not
   recoloured"); it took a colour other than the asked one ("wrong colour"); the other object
   changed colour ("other recoloured"); an object missing or extra ("objects"); both colours right
   but an object moved ("moved").
2. **Where the outcome is decided**: per record, ``--group`` samples that share one initial noise
   and differ only in the SDE noise of four consecutive steps starting at step s (flow SDE, noise
   level ``--noise-level``; the other steps Euler). A window whose noise never changes the verdict
   within a group (share of groups without reward variance near 1) is not where the edit is
   decided, so the policy gradient of its steps carries no signal. The same with independent
   initial noise per sample, the default's sampling, for comparison.

Writes ``benchmarks/results/edit_anatomy/<model folder name>.json`` and prints both tables.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flowgrpo.advantages import group_advantages  # noqa: E402
from flowgrpo.rollout import sample_ode  # noqa: E402
from flowgrpo.sde import euler_step, transition  # noqa: E402
from flowgrpo.toyworld.editing import edit_split, edit_verdict  # noqa: E402
from flowgrpo.toyworld.verify import DetectedObject, detect_objects  # noqa: E402
from pipelines.toy import ToyFlowModel  # noqa: E402

CLASSES = ("exact", "not recoloured", "wrong colour", "other recoloured", "objects", "moved")
WINDOW = 4


def failure_class(output: np.ndarray, record: dict) -> str:
    """One of ``CLASSES`` for an edit ``output`` (3, H, W) in [0, 1] of a two-object ``record``
    (``toy:edit_*``). The checks run in CLASSES order, so a sample is counted once, by its first
    failure: the object count, then the edited object's colour, then the other object's, then
    where the objects are."""
    meta = record["metadata"]
    verdict = edit_verdict(output, record["image"].numpy(), meta)
    if verdict["exact"] == 1.0:
        return "exact"
    edit = meta["edit"]
    source = {o["shape"]: o["color"] for o in meta["source"]["objects"]}
    found: list[DetectedObject] = detect_objects(output)
    colours = collections.defaultdict(list)
    for obj in found:
        colours[obj.shape].append(obj.color)
    if len(found) != len(source) or any(len(colours[s]) != 1 for s in source):
        return "objects"
    if colours[edit["shape"]][0] == source[edit["shape"]]:
        return "not recoloured"
    if colours[edit["shape"]][0] != edit["color"]:
        return "wrong colour"
    if any(colours[s][0] != c for s, c in source.items() if s != edit["shape"]):
        return "other recoloured"
    return "moved"


def sample_with_window(model: ToyFlowModel, cond, noise: torch.Tensor, start: int | None,
                       noise_level: float, num_steps: int, generator: torch.Generator
                       ) -> torch.Tensor:
    """Images (B, 3, H, W) from initial ``noise`` (B, 3, H, W): flow-SDE steps start..start+3
    (``start`` None: none), Euler elsewhere."""
    sigmas = model.sigmas(num_steps)
    x = noise
    b = x.shape[0]
    for i in range(num_steps):
        sigma, sigma_next = sigmas[i].expand(b), sigmas[i + 1].expand(b)
        velocity = model.velocity(x, sigma, cond, 1.0)
        if start is not None and start <= i < start + WINDOW:
            x = transition("flow_sde", velocity, x, sigma, sigma_next, noise_level=noise_level,
                           generator=generator).prev_sample
        else:
            x = euler_step(x, velocity, sigma, sigma_next)
    return model.decode(x)


@torch.no_grad()
def window_signal(model: ToyFlowModel, records: list[dict], group: int, start: int | None,
                  noise_level: float, shared: bool, num_steps: int, seed: int) -> dict[str, float]:
    """Exact-edit rewards of ``group`` samples per record: their mean, the share of groups
    without reward variance and the mean within-group std (the share by
    the trainer's own rule, ``group_advantages``)."""
    generator = torch.Generator().manual_seed(seed)
    rows = [r for r in records for _ in range(group)]
    cond = model.encode_prompts([r["prompt"] for r in rows], images=[r["image"] for r in rows])
    if shared:
        noise = model.initial_noise(len(records), generator).repeat_interleave(group, 0)
    else:
        noise = model.initial_noise(len(rows), generator)
    images = sample_with_window(model, cond, noise, start, noise_level, num_steps, generator)
    rewards = torch.tensor([edit_verdict(img.numpy(), r["image"].numpy(), r["metadata"])["exact"]
                            for img, r in zip(images, rows)])
    group_ids = torch.arange(len(records)).repeat_interleave(group)
    _, stats = group_advantages(rewards, group_ids, scale="none", clip=None)
    return {"reward": round(float(rewards.mean()), 4),
            "no_signal": round(stats["zero_std_fraction"], 4),
            "within_std": round(float(rewards.view(len(records), group).std(dim=1, unbiased=False)
                                      .mean()), 4)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="assets/toy_edit", help="editing toy model folder")
    p.add_argument("--split", default="edit_train", choices=("edit_train", "edit_heldout"))
    p.add_argument("--records", type=int, default=96, help="two-object records for the anatomy")
    p.add_argument("--signal-records", type=int, default=24, help="records (groups) per window")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--starts", default="0,4,8", help="first steps of the SDE windows")
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/edit_anatomy")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.process_time()
    model = ToyFlowModel.from_pretrained(args.model)
    records = [r for r in edit_split(args.split) if r["metadata"]["family"] == "recolor_two"]
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(args.seed))
    records = [records[i] for i in order.tolist()]
    chosen = records[:args.records]
    noise = model.initial_noise(len(chosen), torch.Generator().manual_seed(args.seed + 1))
    images = sample_ode(model, [r["prompt"] for r in chosen], noise, args.steps, 1.0,
                        images=[r["image"] for r in chosen])
    counts = collections.Counter(failure_class(img.numpy(), r) for img, r in zip(images, chosen))
    anatomy = {c: counts.get(c, 0) for c in CLASSES}
    print(f"failure anatomy, {len(chosen)} two-object {args.split} edits (ODE):")
    for c in CLASSES:
        print(f"  {c:17s} {anatomy[c]:4d}  {anatomy[c] / len(chosen):.3f}")
    signal_records = records[:args.signal_records]
    windows = [None] + [int(s) for s in args.starts.split(",")]
    signal = []
    print(f"\nwhere the edit is decided: {len(signal_records)} groups of {args.group}, SDE noise "
          f"level {args.noise_level} on steps [s, s+{WINDOW})")
    print("  initial noise | SDE steps | reward | groups without variance | within-group std")
    for shared in (True, False):
        for start in windows:
            row = window_signal(model, signal_records, args.group, start, args.noise_level,
                                shared, args.steps, args.seed + 2)
            row.update(shared=shared, start=start)
            signal.append(row)
            steps = "none (ODE)" if start is None else f"{start}-{start + WINDOW - 1}"
            print(f"  {'shared' if shared else 'independent':13s} | {steps:9s} | {row['reward']:.3f}"
                  f"  | {row['no_signal']:.3f} | {row['within_std']:.3f}", flush=True)
    result = {"model": args.model, "split": args.split, "seed": args.seed, "steps": args.steps,
              "noise_level": args.noise_level, "group": args.group, "anatomy": anatomy,
              "anatomy_samples": len(chosen), "signal": signal,
              "cpu_seconds": round(time.process_time() - began, 1),
              "command": "python benchmarks/edit_anatomy.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{Path(args.model).name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
