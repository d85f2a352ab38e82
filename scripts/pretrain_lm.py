"""Pretrain the tiny arithmetic language model shipped in ``assets/lm/`` (CPU, about a minute).

The task: complete ``"a+b="`` with the decimal sum and EOS, for a, b in [0, max_operand]. A
character-level tokenizer and a 2-layer Llama (~0.33 M parameters) are built offline, trained with
next-token cross-entropy on the answer tokens for a fixed, short number of steps, so that the
model is only partly right (held-out greedy exact match around 30-40 %): GRPO then has
something to improve (configs/llm_arith.yaml).

Writes to ``--out``: the model (safetensors + config), the tokenizer, ``train.jsonl`` and
``heldout.jsonl`` prompt files (``{"prompt": "12+7=", "metadata": {"answer": "19"}}``; the pairs
of the held-out split are never trained on) and a README.md with the command and the measured
accuracy curve.

    python scripts/pretrain_lm.py --out assets/lm
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ALPHABET = "0123456789+-*= "


def arithmetic_splits(max_operand: int, num_heldout: int, seed: int
                      ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All pairs (a, b) in [0, max_operand]^2, shuffled by ``seed``: (train pairs, held-out)."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[num_heldout:], pairs[:num_heldout]


def record(a: int, b: int) -> dict:
    return {"prompt": f"{a}+{b}=", "metadata": {"answer": str(a + b)}}


def make_batch(tokenizer, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """(B, S) input_ids, attention_mask (right-padded) and labels (-100 outside answer + EOS)."""
    rows = []
    for a, b in pairs:
        prompt = tokenizer(f"{a}+{b}=")["input_ids"]
        answer = tokenizer(str(a + b), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, answer))
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(input_ids, -100)
    for i, (prompt, answer) in enumerate(rows):
        sequence = prompt + answer
        input_ids[i, :len(sequence)] = torch.tensor(sequence)
        labels[i, len(prompt):len(sequence)] = torch.tensor(answer)
    return input_ids, (input_ids != tokenizer.pad_token_id).long(), labels


def heldout_accuracy(model, tokenizer, pairs: list[tuple[int, int]]) -> float:
    """Greedy exact match with the trainer's own generation and reward code."""
    from flowgrpo.lm_sampling import generate_completions
    from reward_models.text import ExactMatchReward

    records = [record(a, b) for a, b in pairs]
    prompts = [r["prompt"] for r in records]
    was_training = model.training
    model.eval()
    _, completion_ids, _ = generate_completions(model, tokenizer, prompts, max_new_tokens=6,
                                                batch_size=256)
    model.train(was_training)
    completions = [tokenizer.decode(c, skip_special_tokens=True) for c in completion_ids]
    return float(ExactMatchReward()(completions, prompts, [r["metadata"] for r in records]).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="assets/lm", help="output folder")
    parser.add_argument("--steps", type=int, default=240, help="optimiser steps")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    parser.add_argument("--max-operand", type=int, default=99)
    parser.add_argument("--heldout", type=int, default=200, help="held-out pairs")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=50)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from transformers import LlamaConfig, LlamaForCausalLM

    from flowgrpo.lm_sampling import build_char_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(ALPHABET)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    train_pairs, heldout_pairs = arithmetic_splits(args.max_operand, args.heldout, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    draw = random.Random(args.seed + 1)
    curve = []
    began = time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, step / max(args.warmup, 1))
        input_ids, attention_mask, labels = make_batch(
            tokenizer, [train_pairs[draw.randrange(len(train_pairs))] for _ in range(args.batch_size)])
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        loss = loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or step == args.steps:
            accuracy = heldout_accuracy(model, tokenizer, heldout_pairs)
            curve.append((step, loss.item(), accuracy))
            print(f"step {step:5d}  loss {loss.item():.3f}  held-out exact match {accuracy:.3f}  "
                  f"{time.perf_counter() - began:.0f} s", flush=True)
    seconds = time.perf_counter() - began

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name, pairs in (("train.jsonl", train_pairs), ("heldout.jsonl", heldout_pairs)):
        (out / name).write_text("".join(json.dumps(record(a, b)) + "\n" for a, b in pairs))
    command = "python scripts/pretrain_lm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    parameters = sum(p.numel() for p in model.parameters())
    rows = "\n".join(f"| {s} | {l:.3f} | {a:.3f} |" for s, l, a in curve)
    (out / "README.md").write_text(f"""# Tiny arithmetic LM

A {parameters:,}-parameter Llama ({args.layers} layers, hidden {args.hidden}) with a character-level
tokenizer ({ALPHABET!r} + <pad> <bos> <eos> <unk>), pretrained to complete `a+b=` with the sum and
EOS for a, b in [0, {args.max_operand}]. It is deliberately stopped early, partly right, so that
GRPO (`flowgrpo train configs/llm_arith.yaml`) has room to improve it.

Reproduce ({seconds:.0f} s on {args.threads} CPU thread(s)):

    {command.strip()}

Files: model.safetensors + config.json + generation_config.json (`AutoModelForCausalLM`),
tokenizer.json + tokenizer_config.json (`AutoTokenizer`), train.jsonl ({len(train_pairs)} prompts)
and heldout.jsonl ({len(heldout_pairs)} prompts, never trained on), each line
`{{"prompt": "12+7=", "metadata": {{"answer": "19"}}}}`.

Held-out greedy exact match during pretraining (seed {args.seed}):

| step | loss | exact match |
|---|---|---|
{rows}
""")
    print(f"saved to {out} ({seconds:.0f} s); final held-out exact match {curve[-1][2]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
