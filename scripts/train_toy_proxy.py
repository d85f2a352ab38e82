"""Fit the toy world's learned proxy reward (``toy_proxy``) to the exact verifier's verdicts on
samples of the base model, and report how well it agrees with the verifier on held-out prompts.

    python scripts/train_toy_proxy.py --out assets/toy_proxy

1. Samples: the base model (``--model``, default assets/toy) draws ``--train-samples`` images of
   training prompts (family-balanced, one fresh noise each) and ``--heldout-samples`` of held-out
   prompts with the 16-step Euler sampler at CFG 1, as the embedded default's evaluation does.
   Samples are cached in ``--cache`` (safetensors), so refitting costs only the fit.
2. Labels: the verifier's exact 0/1 verdict (``geneval_toy``). ``--augment K`` adds K copies of
   each training sample, each relabelled by the verifier: flipped (left-right and/or up-down),
   with its colours permuted (a permutation of the RGB channels maps the palette onto itself;
   the prompt's colour words follow), and, with probability ``--near-miss``, paired with a near
   miss of its prompt (``grammar.near_miss``: one requirement changed), so the proxy learns which
   prompt an image answers and not only whether it looks like a typical pass. Augmented copies
   also get, each with probability ``--photometric``, a random tint of the canvas and Gaussian
   pixel noise (the verifier's verdict decides whether they still pass).
   ``--renders N`` adds N rendered scenes of training prompts (``toyworld.render``), half of
   them drawn from a near miss of the prompt, also labelled by the verifier: clean examples of
   what each prompt asks for, which the base's samples alone are too few to teach.
3. Fit: ``--members`` CNNs (``reward_models.toy_proxy.ToyProxyNet``), each on its own bootstrap
   resample of the training samples and its own initialisation, binary cross-entropy, AdamW,
   ``--epochs`` passes.
4. Report (printed and written to ``--out``/config.json): agreement with the verifier on the
   held-out samples: accuracy of the ensemble mean thresholded at 0.5, ROC AUC, Brier score, the
   mean predicted vs the verifier's pass rate per family, and the members' mean spread.

``--train-samples`` and ``--width`` weaken or strengthen the proxy (fewer labels, a smaller net).
Process CPU seconds of each phase are printed; one torch thread by default (``--threads``).
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

from flowgrpo.prompts import load_prompts, sample_indices  # noqa: E402
from flowgrpo.rollout import sample_ode  # noqa: E402
from flowgrpo.seeding import seeded_generator  # noqa: E402
from flowgrpo.toyworld.grammar import FAMILIES, PALETTE, make_prompt, near_miss  # noqa: E402
from flowgrpo.toyworld.render import render  # noqa: E402
from pipelines import load_model  # noqa: E402
from reward_models.geneval_toy import GenevalToyReward  # noqa: E402
from reward_models.toy_proxy import ToyProxyNet, prompt_features  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for config.json and model.safetensors")
    p.add_argument("--model", default="assets/toy", help="the base model whose samples are labelled")
    p.add_argument("--train-samples", type=int, default=3072)
    p.add_argument("--heldout-samples", type=int, default=768)
    p.add_argument("--augment", type=int, default=4,
                   help="relabelled copies of each training sample (0 = none)")
    p.add_argument("--near-miss", type=float, default=0.5,
                   help="share of augmented copies paired with a near miss of their prompt")
    p.add_argument("--photometric", type=float, default=0.5,
                   help="probability of a tinted canvas, and of pixel noise, in an augmented copy")
    p.add_argument("--renders", type=int, default=0,
                   help="rendered scenes of training prompts added to the fit (half near misses)")
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--steps", type=int, default=16, help="Euler steps of the base's sampler")
    p.add_argument("--guidance", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=None,
                   help="samples cache (safetensors); default <out>/../.toy_proxy_samples_<n>.st "
                        "under /tmp")
    return p.parse_args(argv)


def draw_samples(model, records: list[dict], count: int, seed: int, tag: str, steps: int,
                 guidance: float, balance: bool) -> tuple[torch.Tensor, list[dict]]:
    """``count`` base samples of ``records`` (family-balanced draws when ``balance``), noise
    seeded by (seed, tag, i). Returns images (count, 3, H, W) in [0, 1] and their records."""
    buckets = [r["metadata"]["family"] for r in records] if balance else None
    picked = sample_indices(len(records), count, seed, tag, buckets) if balance else \
        [i % len(records) for i in range(count)]
    chosen = [records[i] for i in picked]
    noise = torch.cat([model.initial_noise(1, seeded_generator(seed, tag, i)) for i in range(count)])
    images = sample_ode(model, [r["prompt"] for r in chosen], noise, steps, guidance,
                        batch_size=64)
    return images.float().clamp(0, 1), chosen


def load_or_sample(args, cache: str) -> dict[str, torch.Tensor | list]:
    from safetensors.torch import load_file, save_file

    train_records = load_prompts("toy:train")
    heldout_records = load_prompts("toy:heldout")
    meta_path = cache + ".json"
    if os.path.isfile(cache) and os.path.isfile(meta_path):
        tensors = load_file(cache)
        meta = json.loads(open(meta_path).read())
        return {**tensors, **meta}
    model = load_model("toy", args.model)
    verifier = GenevalToyReward(score="exact")
    out: dict = {}
    for split, records, count, balance in (("train", train_records, args.train_samples, True),
                                           ("heldout", heldout_records, args.heldout_samples,
                                            True)):
        images, chosen = draw_samples(model, records, count, args.seed, f"proxy_{split}",
                                      args.steps, args.guidance, balance)
        labels = verifier(images, [r["prompt"] for r in chosen], [r["metadata"] for r in chosen])
        out[f"{split}_images"] = images.contiguous()
        out[f"{split}_labels"] = labels.contiguous()
        out[f"{split}_records"] = chosen
    save_file({k: v for k, v in out.items() if isinstance(v, torch.Tensor)}, cache)
    with open(meta_path, "w") as f:
        json.dump({k: v for k, v in out.items() if not isinstance(v, torch.Tensor)}, f)
    return out


# The six orders of the RGB channels; each maps the palette onto itself (red, green and blue are
# the channels, yellow / cyan / magenta their pairs).
CHANNEL_ORDERS = ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))


def permuted_color(color: str | None, order: tuple[int, int, int]) -> str | None:
    """The palette colour that ``color`` becomes when the image's channels are reordered so that
    new channel c is old channel order[c]."""
    if color is None:
        return None
    old = PALETTE[color]
    new = tuple(old[order[c]] for c in range(3))
    return next(name for name, rgb in PALETTE.items() if tuple(rgb) == new)


def augment(images: torch.Tensor, records: list[dict], copies: int, near_miss_share: float,
            seed: int, photometric: float = 0.5) -> tuple[torch.Tensor, list[dict]]:
    """``copies`` transformed copies of every (image, record) and the records they answer:
    a random flip, a random channel order (the prompt's colours follow) and, with probability
    ``near_miss_share``, a near miss of the prompt instead of the prompt; with probability
    ``photometric`` each, a tinted canvas and pixel noise."""
    rng = np.random.default_rng(seed)
    out_images, out_records = [], []
    for _ in range(copies):
        for image, record in zip(images, records):
            order = CHANNEL_ORDERS[int(rng.integers(len(CHANNEL_ORDERS)))]
            x = image[list(order)]
            if rng.random() < 0.5:
                x = x.flip(-1)
            if rng.random() < 0.5:
                x = x.flip(-2)
            meta = record["metadata"]
            meta = {"family": meta["family"], "relation": meta.get("relation"),
                    "objects": [{**o, "color": permuted_color(o.get("color"), order)}
                                for o in meta["objects"]]}
            if rng.random() < near_miss_share:
                meta = near_miss(meta, rng)
            if rng.random() < photometric:   # a tinted canvas: what the verifier does not see
                tint = torch.from_numpy(rng.uniform(0, 0.25, size=3).astype(np.float32))
                x = torch.where(x.amax(0, keepdim=True) < 0.3, x + tint[:, None, None], x)
            if rng.random() < photometric:
                noise = torch.from_numpy(rng.normal(size=x.shape).astype(np.float32))
                x = x + float(rng.uniform(0, 0.08)) * noise
            out_images.append(x.clamp(0, 1))
            out_records.append({"prompt": make_prompt(meta), "metadata": meta})
    return torch.stack(out_images), out_records


def rendered(records: list[dict], count: int, seed: int) -> tuple[torch.Tensor, list[dict]]:
    """``count`` rendered scenes of prompts drawn from ``records``: even i the prompt's own
    scene, odd i a near miss of it, each paired with the drawn prompt."""
    rng = np.random.default_rng(seed)
    images, chosen = [], []
    for i in range(count):
        record = records[int(rng.integers(len(records)))]
        meta = record["metadata"] if i % 2 == 0 else near_miss(record["metadata"], rng)
        images.append(torch.from_numpy(render(meta, 24, rng)))
        chosen.append(record)
    return torch.stack(images), chosen


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability that a random positive outscores a random negative (ties count half)."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).double().mean()
    ties = (pos[:, None] == neg[None, :]).double().mean()
    return float(greater + 0.5 * ties)


def fit(args, images: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> ToyProxyNet:
    torch.manual_seed(args.seed)
    net = ToyProxyNet(members=args.members, width=args.width, hidden=args.hidden,
                      size=images.shape[-1])
    n = len(labels)
    for index, member in enumerate(net.members):
        rng = seeded_generator(args.seed, "proxy_bootstrap", index)
        rows = torch.randint(0, n, (n,), generator=rng)            # bootstrap resample
        optimizer = torch.optim.AdamW(member.parameters(), lr=args.lr,
                                      weight_decay=args.weight_decay)
        steps = args.epochs * max(1, n // args.batch_size)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
        member.train()
        for epoch in range(args.epochs):
            order = rows[torch.randperm(n, generator=rng)]
            for start in range(0, n - args.batch_size + 1, args.batch_size):
                batch = order[start:start + args.batch_size]
                logits = member(images[batch], features[batch])
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
        member.eval()
    return net.eval()


def report(net: ToyProxyNet, images, features, labels, records) -> dict:
    with torch.no_grad():
        probs = net(images, features)                               # (M, B)
    mean = probs.mean(0)
    per_family = {}
    for family in FAMILIES:
        mask = torch.tensor([r["metadata"]["family"] == family for r in records])
        if mask.any():
            per_family[family] = {"verifier": round(float(labels[mask].mean()), 4),
                                  "proxy": round(float(mean[mask].mean()), 4)}
    return {"accuracy": round(float(((mean > 0.5).float() == labels).float().mean()), 4),
            "auc": round(roc_auc(mean, labels), 4),
            "brier": round(float(((mean - labels) ** 2).mean()), 4),
            "verifier_pass_rate": round(float(labels.mean()), 4),
            "proxy_mean": round(float(mean.mean()), 4),
            "member_spread": round(float(probs.std(0, unbiased=False).mean()), 4),
            "samples": len(labels), "per_family": per_family}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cache = args.cache or f"/tmp/toy_proxy_samples_{args.train_samples}_{args.heldout_samples}" \
                          f"_s{args.seed}.safetensors"
    began = time.process_time()
    data = load_or_sample(args, cache)
    sampled = time.process_time() - began
    began = time.process_time()
    fit_images, fit_records = data["train_images"], list(data["train_records"])
    fit_labels = data["train_labels"]
    verifier = GenevalToyReward(score="exact")
    extras = []
    if args.augment:
        extras.append(augment(fit_images, fit_records, args.augment, args.near_miss, args.seed,
                              args.photometric))
    if args.renders:
        extras.append(rendered(fit_records, args.renders, args.seed))
    for images, records in extras:       # each labelled by the verifier
        labels = verifier(images, [r["prompt"] for r in records], [r["metadata"] for r in records])
        fit_images = torch.cat([fit_images, images])
        fit_records += records
        fit_labels = torch.cat([fit_labels, labels])
    augmented = time.process_time() - began
    feats = {"train": torch.stack([prompt_features(r["metadata"]) for r in fit_records]),
             "heldout": torch.stack([prompt_features(r["metadata"])
                                     for r in data["heldout_records"]])}
    began = time.process_time()
    net = fit(args, fit_images, feats["train"], fit_labels)
    fitted = time.process_time() - began
    result = {
        "train": report(net, data["train_images"], feats["train"][:len(data["train_labels"])],
                        data["train_labels"], data["train_records"]),
        "heldout": report(net, data["heldout_images"], feats["heldout"], data["heldout_labels"],
                          data["heldout_records"]),
        "cpu_seconds": {"sampling": round(sampled, 1), "augment": round(augmented, 1),
                        "fit": round(fitted, 1)},
        "fit": {k: getattr(args, k) for k in ("train_samples", "augment", "near_miss", "photometric",
                                              "renders",
                                              "members",
                                              "width", "hidden", "epochs", "lr", "weight_decay",
                                              "seed")},
        "fit_rows": len(fit_labels), "fit_pass_rate": round(float(fit_labels.mean()), 4),
    }
    net.save_pretrained(args.out, extra={"agreement": result})
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
