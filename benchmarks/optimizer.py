"""AdamW step time on a real model's trainable tensors: per-tensor loop vs foreach vs fused.

    python benchmarks/optimizer.py [--model assets/toy] [--family toy] [--steps 50] [--threads 1]

The trainer builds ``torch.optim.AdamW(..., fused=True)`` when every trainable tensor is a float
tensor on CPU or CUDA (``Trainer._make_optimizer``). This measures why, on the model's own
parameter list (full fine-tuning: every transformer tensor), side by side in one run, and checks
that the three implementations agree on the weights after the measured steps.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

if importlib.util.find_spec("flowgrpo") is None:   # run from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def time_variant(shapes: list[torch.Size], options: dict, steps: int, seed: int = 0
                 ) -> tuple[float, list[torch.Tensor]]:
    """Seconds per ``optimizer.step()`` (mean over ``steps`` after 3 warm-up steps) and the final
    weights. Every variant sees the same initial weights and the same gradient sequence."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator) * 0.05) for s in shapes]
    grads = [[torch.randn(s, generator=generator) * 1e-4 for s in shapes] for _ in range(4)]
    optimizer = torch.optim.AdamW(params, lr=3e-5, weight_decay=1e-4, **options)
    elapsed = 0.0
    for step in range(3 + steps):
        for p, g in zip(params, grads[step % len(grads)]):
            p.grad = g
        began = time.perf_counter()
        optimizer.step()
        if step >= 3:
            elapsed += time.perf_counter() - began
    return elapsed / steps, [p.detach() for p in params]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="assets/toy", help="model folder")
    parser.add_argument("--family", default="toy", help="model family (pipelines.MODEL_FAMILIES)")
    parser.add_argument("--steps", type=int, default=50, help="measured optimiser steps")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from pipelines import load_model

    model = load_model(args.family, args.model)
    shapes = [p.shape for p in model.transformer.parameters()]
    print(f"{args.family}:{args.model}: {len(shapes)} tensors, "
          f"{sum(s.numel() for s in shapes) / 1e6:.2f}M parameters, {args.threads} thread(s)")
    results = {name: time_variant(shapes, options, args.steps) for name, options in VARIANTS.items()}
    loop_seconds, loop_weights = results["loop"]
    print(f"{'variant':8s} {'ms/step':>8s} {'loop/variant':>13s} {'max |w - w_loop|':>17s}")
    for name, (seconds, weights) in results.items():
        deviation = max(float((w - r).abs().max()) for w, r in zip(weights, loop_weights))
        print(f"{name:8s} {seconds * 1e3:8.2f} {loop_seconds / seconds:13.2f} {deviation:17.2e}")


if __name__ == "__main__":
    main()
