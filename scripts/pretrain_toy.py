"""Pretrain the toy text-to-image flow model from scratch on freshly rendered scenes.

    python scripts/pretrain_toy.py --out assets/toy --minutes 55 --seed 0

Rectified-flow loss: x_sigma = (1 - sigma) x0 + sigma noise, target v = noise - x0, sigma drawn
logit-normal (or uniform); captions from ``flowgrpo.toyworld.grammar.random_caption`` with 10% dropped
to the empty prompt (so CFG works) and ``--caption-noise`` of them paired with a near-miss scene
(``flowgrpo.toyworld.grammar.near_miss``), so the model can draw a prompt but does not reliably; AdamW with linear warmup and a cosine decay over the time
budget (or over ``--max-steps``); an EMA of the weights. Every ``--eval-every-minutes`` the EMA
model samples held-out prompts with the Euler ODE sampler and the verifier scores them (exact
accuracy per family), printed and appended to ``--log`` (JSONL); the EMA model is checkpointed to
``--ckpt-dir``. At the end the sampling defaults (shift, guidance) are chosen on *train* prompts,
the held-out accuracy is measured with them, and the EMA model is saved to ``--out``.

Deterministic with ``--seed`` (data, init, eval noise); with a time budget the number of steps
depends on the machine, with ``--max-steps`` it does not.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipelines.toy import (ToyArchitecture, ToyFlowModel, ToyOptions, ToySamplingDefaults,  # noqa: E402
                          build_toy_model)
from flowgrpo.toyworld.grammar import (DEFAULT_FAMILY_WEIGHTS, FAMILIES,  # noqa: E402
                                       near_miss, prompt_split, random_caption)
from flowgrpo.toyworld.render import render  # noqa: E402
from reward_models.geneval_toy import GenevalToyReward  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder the final EMA model is saved to")
    p.add_argument("--minutes", type=float, required=True, help="wall-clock budget, evals included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None, help="stop (and schedule the lr) by steps")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 is ~2.7x faster than 2 when other processes share the 2 cores")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a share of --lr")
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--caption-dropout", type=float, default=0.1, help="share of empty captions (CFG)")
    p.add_argument("--caption-noise", type=float, default=0.0,
                   help="share of captions whose scene is rendered from a near miss "
                        "(flowgrpo.toyworld.grammar.near_miss: one requirement changed), as noisy web "
                        "captions: the model learns the prompt's scene as the main mode among near "
                        "misses, so it can draw a prompt but does not reliably")
    p.add_argument("--sigma-sampling", choices=["logit_normal", "uniform"], default="logit_normal")
    p.add_argument("--logit-mean", type=float, default=0.0)
    p.add_argument("--logit-std", type=float, default=1.0)
    p.add_argument("--family-weights", type=str, default=None,
                   help=f"JSON dict of caption family weights (default {DEFAULT_FAMILY_WEIGHTS})")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--text-hidden", type=int, default=64)
    p.add_argument("--text-layers", type=int, default=1)
    p.add_argument("--eval-every-minutes", type=float, default=10.0)
    p.add_argument("--eval-per-family", type=int, default=24, help="held-out samples per family, periodic")
    p.add_argument("--final-eval-per-family", type=int, default=80)
    p.add_argument("--select-per-family", type=int, default=32,
                   help="train-prompt samples per family per candidate when choosing shift/guidance")
    p.add_argument("--eval-steps", type=int, default=20, help="Euler ODE steps at eval")
    p.add_argument("--eval-guidance", type=float, default=2.0, help="CFG scale of periodic evals")
    p.add_argument("--candidates", type=str, default="1:1,1:2,3:2,3:3",
                   help="shift:guidance pairs tried at the end, on train prompts")
    p.add_argument("--ckpt-dir", default="runs/toy_ckpt")
    p.add_argument("--log", default="runs/pretrain_toy.jsonl")
    return p.parse_args(argv)


class Logger:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path

    def __call__(self, record: dict) -> None:
        print(json.dumps(record), flush=True)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


@torch.no_grad()
def sample_ode(model: ToyFlowModel, prompts: list[str], num_steps: int, guidance_scale: float,
               generator: torch.Generator, batch_size: int = 64) -> torch.Tensor:
    """Images (N, 3, H, W) in [0, 1] from the Euler ODE sampler (x += v dt, dt = sigma' - sigma)."""
    sigmas = model.sigmas(num_steps)
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        cond = model.encode_prompts(chunk)
        x = model.initial_noise(len(chunk), generator)
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            v = model.velocity(x, sigma.expand(len(chunk)), cond, guidance_scale)
            x = x + (sigma_next - sigma) * v
        out.append(model.decode(x))
    return torch.cat(out)


def family_eval_set(split: str, per_family: int) -> list[dict]:
    """``per_family`` items per family, cycling through the split's prompts of that family."""
    items = []
    for family in FAMILIES:
        pool = [i for i in prompt_split(split) if i["metadata"]["family"] == family]
        items += [pool[k % len(pool)] for k in range(per_family)]
    return items


def evaluate(model: ToyFlowModel, items: list[dict], num_steps: int, guidance_scale: float,
             seed: int) -> dict:
    """Exact and partial accuracy per family and overall (ODE sampler, fixed noise)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [i["prompt"] for i in items]
    images = sample_ode(model, prompts, num_steps, guidance_scale, generator)
    scores = GenevalToyReward().components(images, prompts, [i["metadata"] for i in items])
    result = {"exact": {}, "partial": {}}
    families = np.array([i["metadata"]["family"] for i in items])
    for family in FAMILIES:
        mask = torch.from_numpy(families == family)
        if mask.any():
            result["exact"][family] = round(float(scores["exact"][mask].mean()), 4)
            result["partial"][family] = round(float(scores["partial"][mask].mean()), 4)
    result["exact_overall"] = round(float(scores["exact"].mean()), 4)
    result["partial_overall"] = round(float(scores["partial"].mean()), 4)
    return result


def ema_model(live: ToyFlowModel, ema_transformer, ema_text, defaults: ToySamplingDefaults,
              shift: float | None = None) -> ToyFlowModel:
    """A fresh (empty-cache) model view over the EMA weights."""
    return ToyFlowModel(ema_transformer, ema_text, live.tokenizer, defaults, ToyOptions(shift=shift))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.minutes <= 0:
        raise ValueError(f"--minutes must be > 0 (got {args.minutes})")
    if not 0.0 <= args.caption_noise < 1.0:
        raise ValueError(f"--caption-noise must be in [0, 1) (got {args.caption_noise})")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    log = Logger(args.log)
    weights = json.loads(args.family_weights) if args.family_weights else None
    t_start = time.time()
    budget = args.minutes * 60.0

    arch = ToyArchitecture(num_layers=args.layers, num_attention_heads=args.heads,
                           attention_head_dim=args.head_dim, text_hidden_size=args.text_hidden,
                           text_layers=args.text_layers, pooled_dim=args.text_hidden)
    model = build_toy_model(arch, seed=args.seed)
    transformer, text_encoder = model.transformer.train(), model.text_encoder.train()
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    n_params = sum(p.numel() for p in transformer.parameters())
    n_text = sum(p.numel() for p in text_encoder.parameters())
    ema_transformer = copy.deepcopy(transformer).eval().requires_grad_(False)
    ema_text = copy.deepcopy(text_encoder).eval().requires_grad_(False)
    ema_params = list(ema_transformer.parameters()) + list(ema_text.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    log({"event": "start", "args": vars(args), "arch": asdict(arch), "transformer_params": n_params,
         "text_params": n_text})

    eval_items = family_eval_set("heldout", args.eval_per_family)
    # time kept for the final selection + evaluation, measured from the first periodic eval
    reserve = 0.0
    step, last_eval = 0, time.time()
    loss_sum, loss_count = 0.0, 0
    train_start = time.time()

    def progress() -> float:
        if args.max_steps:
            return step / args.max_steps
        usable = budget - reserve - (train_start - t_start)
        return (time.time() - train_start) / max(usable, 1.0)

    def periodic_eval() -> None:
        nonlocal reserve
        t0 = time.time()
        view = ema_model(model, ema_transformer, ema_text, ToySamplingDefaults())
        result = evaluate(view, eval_items, args.eval_steps, args.eval_guidance, seed=args.seed + 1)
        seconds = time.time() - t0
        per_sample = seconds / len(eval_items)
        n_candidates = len(args.candidates.split(","))
        reserve = 1.3 * per_sample * 6 * (n_candidates * args.select_per_family + args.final_eval_per_family) + 30
        log({"event": "eval", "step": step, "minutes": round((time.time() - t_start) / 60, 2),
             "eval_seconds": round(seconds, 1), "steps": args.eval_steps, "guidance": args.eval_guidance,
             "samples": len(eval_items), **result})
        view.save_pretrained(args.ckpt_dir)

    while True:
        if args.max_steps and step >= args.max_steps:
            break
        if not args.max_steps and step > 0 and progress() >= 1.0:
            break
        if step == 20 or (step > 0 and time.time() - last_eval >= args.eval_every_minutes * 60):
            periodic_eval()
            last_eval = time.time()
        frac = progress()
        if step < args.warmup_steps:
            lr = args.lr * (step + 1) / args.warmup_steps
        else:
            cosine = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
            lr = args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)
        for group in optimizer.param_groups:
            group["lr"] = lr

        captions = [random_caption(rng, weights) for _ in range(args.batch_size)]
        noisy = rng.random(args.batch_size) < args.caption_noise
        scenes = [near_miss(c["metadata"], rng) if n else c["metadata"] for c, n in zip(captions, noisy)]
        x0 = torch.from_numpy(np.stack([render(m, arch.sample_size, rng) for m in scenes])) * 2 - 1
        drop = rng.random(args.batch_size) < args.caption_dropout
        prompts = ["" if d else c["prompt"] for c, d in zip(captions, drop)]
        noise = torch.randn_like(x0)
        if args.sigma_sampling == "logit_normal":
            sigma = torch.sigmoid(args.logit_mean + args.logit_std * torch.randn(args.batch_size))
        else:
            sigma = torch.rand(args.batch_size)
        s = sigma.view(-1, 1, 1, 1)
        x_sigma = (1 - s) * x0 + s * noise
        states, pooled = model.text_states(model.tokenize(prompts))
        v = transformer(hidden_states=x_sigma, encoder_hidden_states=states, pooled_projections=pooled,
                        timestep=1000 * sigma, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(v, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        decay = min(args.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        step += 1
        loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1
        if step % 100 == 0:
            log({"event": "train", "step": step, "minutes": round((time.time() - t_start) / 60, 2),
                 "loss": round(loss_sum / loss_count, 5), "lr": lr})
            loss_sum, loss_count = 0.0, 0

    train_minutes = (time.time() - t_start) / 60
    log({"event": "train_done", "step": step, "minutes": round(train_minutes, 2)})

    # choose sampling defaults on train prompts (never on the held-out split)
    select_items = family_eval_set("train", args.select_per_family)
    best = None
    for pair in args.candidates.split(","):
        shift, guidance = (float(v) for v in pair.split(":"))
        view = ema_model(model, ema_transformer, ema_text, ToySamplingDefaults(), shift=shift)
        result = evaluate(view, select_items, args.eval_steps, guidance, seed=args.seed + 2)
        log({"event": "select", "shift": shift, "guidance": guidance, "split": "train",
             "exact_overall": result["exact_overall"], "exact": result["exact"]})
        key = (result["exact_overall"], min(result["exact"].values()))
        if best is None or key > best[0]:
            best = (key, shift, guidance)
    _, shift, guidance = best
    final_items = family_eval_set("heldout", args.final_eval_per_family)
    defaults = ToySamplingDefaults(shift=shift, guidance_scale=guidance, eval_steps=args.eval_steps)
    view = ema_model(model, ema_transformer, ema_text, defaults)
    final = evaluate(view, final_items, args.eval_steps, guidance, seed=args.seed + 3)
    wall = (time.time() - t_start) / 60
    defaults.extra = {
        "command": "python scripts/pretrain_toy.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "train_steps": step, "wall_minutes": round(wall, 2), "transformer_params": n_params,
        "text_params": n_text, "heldout_eval": {"samples": len(final_items), "ode_steps": args.eval_steps,
                                                "shift": shift, "guidance": guidance, **final}}
    view.defaults = defaults
    view.save_pretrained(args.out)
    log({"event": "final", "step": step, "minutes": round(wall, 2), "shift": shift, "guidance": guidance,
         "samples": len(final_items), "ode_steps": args.eval_steps, **final})


if __name__ == "__main__":
    main()
