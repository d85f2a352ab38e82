"""Which denoising steps draw what: sample with a tuned toy model for the first k steps and the
base model after, and score every switch point with the verifier and the artifact metric.

    python benchmarks/artifact_steps.py --checkpoint runs/toy_geneval/checkpoints/200
        [--base assets/toy] [--per-family 24] [--steps 16] [--switches 0,3,6,10,13,16]

Every sample starts from the same evaluation noise (seed 0) on held-out prompts
(``--per-family`` per family) and takes the 16-step Euler ODE at CFG 1, as the default's
evaluation does; at step k it hands over from the tuned model to the base model. k = 0 is the
base, k = 16 the tuned model. A quantity that appears only when k passes the last steps is drawn
by those steps: on the embedded default the tinted canvas and the textured objects appear only at
k = 16 (the last three steps, sigma <= 0.41, which the default's branch plan never trains), while
held-out accuracy is already the tuned model's by k = 10. ``training.anchor_beta`` with
``anchor_sigma_max`` anchors those steps (docs/reward_hacking.md).

``--checkpoint`` is a full fine-tuning checkpoint (``<dir>/transformer``) or a LoRA one (the
diffusers LoRA file in ``<dir>``). Prints one line per switch and writes ``--out`` (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flowgrpo.checkpoint_inspection import checkpoint_applied, resolve_checkpoint  # noqa: E402
from flowgrpo.prompts import eval_selection, load_prompts  # noqa: E402
from flowgrpo.rollout import euler_step, eval_noise  # noqa: E402
from flowgrpo.toyworld.quality import artifact_scores  # noqa: E402
from pipelines import load_model  # noqa: E402
from reward_models.geneval_toy import GenevalToyReward  # noqa: E402


def switched_samples(tuned, base, prompts: list[str], noise: torch.Tensor, switch: int,
                     num_steps: int) -> torch.Tensor:
    """Images of ``prompts`` from ``noise``: ``tuned`` for steps < switch, ``base`` after."""
    sigmas = base.sigmas(num_steps)
    conds = {id(tuned): tuned.encode_prompts(prompts), id(base): base.encode_prompts(prompts)}
    x = noise.clone().float()
    with torch.no_grad():
        for i in range(num_steps):
            model = tuned if i < switch else base
            sigma = sigmas[i].expand(len(x))
            sigma_next = sigmas[i + 1].expand(len(x))
            velocity = model.velocity(x, sigma, conds[id(model)], 1.0).float()
            x = euler_step(x, velocity, sigma, sigma_next)
        return base.decode(x).float().clamp(0, 1)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--base", default="assets/toy")
    p.add_argument("--per-family", type=int, default=24)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--switches", default=None, help="comma-separated k (default 0,3,6,10,13,steps)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = load_model("toy", args.base)
    tuned = load_model("toy", args.base)
    records = eval_selection(load_prompts("toy:heldout"), args.per_family, 1)
    noise = eval_noise(base, 0, range(len(records)))
    switches = ([int(k) for k in args.switches.split(",")] if args.switches else
                sorted({0, 3, 6, 10, 13, args.steps}))
    verifier = GenevalToyReward(score="exact")
    rows = []
    with checkpoint_applied(tuned, resolve_checkpoint(args.checkpoint)):
        for switch in switches:
            rows.append(score_switch(tuned, base, records, noise, switch, args.steps, verifier))
    if args.out:
        Path(args.out).write_text(json.dumps({"checkpoint": args.checkpoint, "rows": rows},
                                             indent=1))
    return rows


def score_switch(tuned, base, records: list[dict], noise: torch.Tensor, switch: int,
                 num_steps: int, verifier) -> dict:
    """Exact accuracy and artifact parts of the samples that switch models at ``switch``."""
    prompts = [r["prompt"] for r in records]
    images = switched_samples(tuned, base, prompts, noise, switch, num_steps)
    exact = verifier(images, prompts, [r["metadata"] for r in records])
    parts = artifact_scores(images.numpy())
    row = {"tuned_steps": switch, "exact": float(exact.mean()),
           "background": float(parts["background"].mean()),
           "texture": float(parts["texture"].mean()), "samples": len(records)}
    print(f"tuned for steps < {switch:2d}, base after: exact {row['exact']:.3f}  "
          f"background {row['background']:.4f}  texture {row['texture']:.4f}", flush=True)
    return row


if __name__ == "__main__":
    main()
