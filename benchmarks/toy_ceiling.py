"""Supervised ceiling of the toy world: how far can *any* update from N images move the toy model?

    python benchmarks/toy_ceiling.py [--split train] [--steps 150] [--batch-size 64] [--lr 1e-4]
                                     [--eval-at 50,100,150] [--out FILE.json]

RL on the toy default sees ``iterations x 64`` images of its own, scored 0/1. This script spends
the same number of images on the best data there is: freshly rendered *correct* scenes
(``flowgrpo.toyworld.render.render``) of the prompts of ``--split``, families drawn uniformly (as the
RL config's ``balance_key: family`` does), trained with the rectified-flow loss that pretrained
the model (logit-normal sigmas, 10% empty captions so CFG keeps working) and the RL run's own
optimiser (AdamW from ``configs/toy_geneval.yaml``, ``--lr``). At each ``--eval-at`` step the
weights are scored by the RL run's evaluation (``Trainer.evaluate``: Euler ODE, fixed noise,
``--per-family`` samples per family) on the held-out prompts and on the training prompts.

If supervised training on correct images of the training prompts cannot raise held-out accuracy
within an RL run's image budget, a reward-driven update on the model's own samples will not
either: the limit is the model and the prompt split, not the RL estimator.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flowgrpo.config import load_config  # noqa: E402
from flowgrpo.prompts import load_prompts  # noqa: E402
from flowgrpo.trainer import Trainer  # noqa: E402
from flowgrpo.toyworld.grammar import FAMILIES, random_caption  # noqa: E402
from flowgrpo.toyworld.render import render  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/toy_geneval.yaml")
    p.add_argument("--split", choices=["train", "all"], default="train",
                   help="prompts whose correct renders are trained on (all = includes held-out)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=0, help="linear lr warmup steps (the trainer's "
                   "training.lr_warmup_iterations)")
    p.add_argument("--eval-at", default="50,100,150")
    p.add_argument("--per-family", type=int, default=96, help="evaluation samples per family")
    p.add_argument("--caption-dropout", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for the results")
    return p.parse_args(argv)


def exact_by_family(metrics: dict) -> dict[str, float]:
    key = "eval/geneval_toy.exact"
    out = {f: metrics[f"{key}/{f}"] for f in FAMILIES if f"{key}/{f}" in metrics}
    out["family_mean"] = metrics[f"{key}/family_mean"]
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = load_config(args.config, [
        "name=toy_ceiling", "run.tracker=none", f"run.num_threads={args.threads}",
        f"prompts.eval_per_family={args.per_family}", f"training.lr={args.lr}",
        f"training.lr_warmup_iterations={args.warmup}",
        "rewards.components=[{name: geneval_toy, options: {score: exact}}]"])
    trainer = Trainer(config)
    model = trainer.model
    splits = {"heldout": load_prompts("toy:heldout"), "train": load_prompts("toy:train")}
    eval_at = sorted({int(s) for s in args.eval_at.split(",") if s})
    rng = np.random.default_rng(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    uniform = {family: 1.0 for family in FAMILIES}
    size = model.sample_size

    def evaluate(step: int) -> dict:
        row = {"step": step, "images": step * args.batch_size}
        for name, records in splits.items():
            trainer.eval_records = records
            row[name] = exact_by_family(trainer.evaluate(step, save_images=False))
        print(json.dumps(row), flush=True)
        return row

    began = time.perf_counter()
    rows = [evaluate(0)]
    for step in range(1, args.steps + 1):
        for group in trainer.optimizer.param_groups:
            group["lr"] = trainer.learning_rate(step - 1)
        captions = [random_caption(rng, uniform, split=args.split) for _ in range(args.batch_size)]
        x0 = torch.from_numpy(np.stack([render(c["metadata"], size, rng) for c in captions])) * 2 - 1
        drop = rng.random(args.batch_size) < args.caption_dropout
        prompts = ["" if d else c["prompt"] for c, d in zip(captions, drop)]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = torch.sigmoid(torch.randn(args.batch_size, generator=generator))
        s = sigma.view(-1, 1, 1, 1)
        velocity = model.velocity((1 - s) * x0 + s * noise, sigma, model.encode_prompts(prompts), 1.0)
        loss = torch.nn.functional.mse_loss(velocity, noise - x0)
        loss.backward()
        trainer.optimizer_step()
        if step in eval_at:
            rows.append(evaluate(step))
    result = {"args": vars(args), "seconds": round(time.perf_counter() - began, 1), "rows": rows}

    print(f"\nsupervised ceiling: correct renders of '{args.split}' prompts, lr {args.lr} "
          f"(warmup {args.warmup}), batch {args.batch_size}; exact accuracy, family mean "
          f"(GenEval overall)")
    print(f"{'step':>5} {'images':>7} {'held-out':>9} {'train':>7}")
    for row in rows:
        print(f"{row['step']:>5} {row['images']:>7} {row['heldout']['family_mean']:>9.3f} "
              f"{row['train']['family_mean']:>7.3f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
