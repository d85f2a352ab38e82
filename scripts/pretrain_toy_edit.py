"""Fine-tune the toy text-to-image model into a toy editing model (``assets/toy_edit``).

    python scripts/pretrain_toy_edit.py --base assets/toy --out assets/toy_edit --minutes 8

(The shipped ``assets/toy_edit`` took three runs, each continuing the one before (``--base``): exact
targets, more exact targets, then wrong-colour near misses (``--edit-noise 0.3
--other-object-share 0``); its README has the three commands.)

``pipelines.toy.to_editing_model`` gives the base 3 more input channels (the source image, zero
weights) and the instructions' words; then the rectified-flow loss on freshly rendered edits:
a source scene of the grammar's *train* split (one or two coloured objects), a random recolour
instruction ("make the circle blue") and its target, the same layout with that object
recoloured (``flowgrpo.toyworld.editing.render_pair``). x_sigma = (1 - sigma) target + sigma
noise, v = noise - target, sigma logit-normal(0, 1); AdamW with warmup and a cosine decay over
the time budget; transformer and text encoder trained. At the end the held-out edit accuracy
(``toy:edit_heldout``, the model's sampling defaults, fixed noise) is measured, written to
``toy_config.json`` (``extra``) and printed, and the model is saved to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flowgrpo.model import Conditioning  # noqa: E402
from flowgrpo.rollout import eval_noise, sample_ode  # noqa: E402
from flowgrpo.toyworld.editing import (EDIT_FAMILIES, apply_edit, choose_edit,  # noqa: E402
                                       edit_split, instruction, render_pair)
from flowgrpo.toyworld.grammar import COLORS, prompt_split  # noqa: E402
from pipelines.toy import ToyFlowModel, to_editing_model  # noqa: E402
from reward_models.toy_edit import ToyEditReward  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="assets/toy",
                   help="the model to start from: a text-to-image toy model (made an editing model "
                        "first) or an editing model, whose training this continues")
    p.add_argument("--out", required=True, help="folder the editing model is saved to")
    p.add_argument("--minutes", type=float, required=True, help="wall-clock budget of training")
    p.add_argument("--max-steps", type=int, default=None, help="stop (and schedule the lr) by steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--eval-seed", type=int, default=3)
    p.add_argument("--edit-noise", type=float, default=0.0,
                   help="share of examples whose target is a near miss (another colour, or in a "
                        "two-object scene the other object recoloured), as the T2I model's "
                        "--caption-noise: the model can edit but does not reliably (RL-able)")
    p.add_argument("--other-object-share", type=float, default=0.5,
                   help="of the two-object near misses, the share that recolours the other object "
                        "(the rest: the named object in another free colour)")
    args = p.parse_args(argv)
    for name in ("edit_noise", "other_object_share"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} is a share: give a number in [0, 1] "
                    f"(got {getattr(args, name)})")
    return args


def near_miss_edit(source: dict, edit: dict, rng: random.Random, other_share: float = 0.5
                   ) -> dict:
    """The edit drawn instead of ``edit`` for a near-miss target: in a two-object scene the other
    object recoloured (``other_share`` of the time), else the named object in another free
    colour."""
    others = [o for o in source["objects"] if o["shape"] != edit["shape"]]
    if others and rng.random() < other_share:
        return {**edit, "shape": others[0]["shape"]}
    taken = {o["color"] for o in source["objects"]} | {edit["color"]}
    return {**edit, "color": rng.choice([c for c in COLORS if c not in taken])}


def edit_batch(sources: list[dict], batch_size: int, rng: random.Random, edit_noise: float = 0.0,
               other_share: float = 0.5) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(instructions, source images (B, 3, 24, 24), targets (B, 3, 24, 24)) in [0, 1]; a share
    ``edit_noise`` of the targets are near misses of the instruction (``near_miss_edit``)."""
    prompts, src, tgt = [], [], []
    for _ in range(batch_size):
        source = sources[rng.randrange(len(sources))]
        edit = choose_edit(source, rng)
        apply_edit(source, edit)          # validates the edit
        drawn = (near_miss_edit(source, edit, rng, other_share) if rng.random() < edit_noise
                 else edit)
        a, b = render_pair(source, drawn, rng.randrange(2 ** 31))
        prompts.append(instruction(edit))
        src.append(torch.from_numpy(a))
        tgt.append(torch.from_numpy(b))
    return prompts, torch.stack(src), torch.stack(tgt)


def heldout_accuracy(model: ToyFlowModel, seed: int) -> dict[str, float]:
    """Exact / partial edit accuracy on every ``toy:edit_heldout`` record (Euler ODE, the model's
    default steps and shift, noise of (seed, "eval", i)), overall and per family."""
    records = edit_split("edit_heldout")
    fresh = ToyFlowModel(model.transformer, model.text_encoder, model.tokenizer, model.defaults)
    with torch.no_grad():
        media = sample_ode(fresh, [r["prompt"] for r in records],
                           eval_noise(fresh, seed, range(len(records))), fresh.defaults.eval_steps,
                           1.0, images=[r["image"] for r in records])
    metadata = [{**r["metadata"], "source_image": r["image"]} for r in records]
    scores = ToyEditReward().components(media, [r["prompt"] for r in records], metadata)
    out = {"exact": float(scores["exact"].mean()), "partial": float(scores["partial"].mean())}
    families = np.array([r["metadata"]["family"] for r in records])
    for family in EDIT_FAMILIES.values():
        mask = torch.from_numpy(families == family)
        out[f"exact/{family}"] = float(scores["exact"][mask].mean())
    return {k: round(v, 4) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    began = time.time()
    model = ToyFlowModel.from_pretrained(args.base)
    # an editing model's own provenance is kept under "continued_from" of the new one
    earlier = dict(model.defaults.extra or {}) if model.supports_images else None
    if not model.supports_images:
        model = to_editing_model(model)
    print("held-out before:", heldout_accuracy(model, args.eval_seed), flush=True)
    sources = [i["metadata"] for i in prompt_split("train") if i["metadata"]["family"] in EDIT_FAMILIES]
    params = list(model.transformer.parameters()) + list(model.text_encoder.parameters())
    model.transformer.train().requires_grad_(True)
    model.text_encoder.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    budget = args.minutes * 60
    train_began = time.time()
    step, losses = 0, []
    while True:
        done = step / args.max_steps if args.max_steps else (time.time() - train_began) / budget
        if done >= 1:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        prompts, src, tgt = edit_batch(sources, args.batch_size, rng, args.edit_noise,
                                        args.other_object_share)
        x0 = 2 * tgt - 1
        noise = torch.randn_like(x0)
        sigma = torch.sigmoid(torch.randn(len(prompts)))
        s = sigma.view(-1, 1, 1, 1)
        states, pooled = model.text_states(model.tokenize(prompts))
        cond = Conditioning(positive={"prompt_embeds": states, "pooled_prompt_embeds": pooled,
                                      "source_latents": 2 * src - 1})
        v = model.velocity((1 - s) * x0 + s * noise, sigma, cond, 1.0)
        loss = torch.nn.functional.mse_loss(v, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step % 100 == 0:
            print(f"step {step} loss {np.mean(losses[-100:]):.4f} lr {lr:.2e} "
                  f"{time.time() - train_began:.0f}s", flush=True)
    model.transformer.eval().requires_grad_(False)
    model.text_encoder.eval().requires_grad_(False)
    accuracy = heldout_accuracy(model, args.eval_seed)
    print("held-out after:", accuracy, flush=True)
    model.defaults.extra = {"command": "python scripts/pretrain_toy_edit.py " + " ".join(sys.argv[1:] if argv is None else argv),
                            "steps": step, "batch_size": args.batch_size,
                            "train_minutes": round((time.time() - train_began) / 60, 2),
                            "wall_minutes": round((time.time() - began) / 60, 2),
                            "heldout_edit_accuracy": accuracy}
    if earlier is not None:
        model.defaults.extra["continued_from"] = earlier
    model.save_pretrained(args.out)
    print(json.dumps(model.defaults.extra, indent=2))


if __name__ == "__main__":
    main()
