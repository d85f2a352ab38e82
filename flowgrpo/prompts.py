"""Prompt sources: the toy world's splits, a text file (one prompt a line) or JSONL.

Every source yields ``{"prompt": str, "metadata": dict}`` records; rewards that verify structure
(the toy verifier, OCR targets) read the metadata.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from flowgrpo.rollout import seeded_generator


def load_prompts(source: str) -> list[dict]:
    """Records for ``source``: ``toy:<split>``, ``*.txt`` or ``*.jsonl``. Raises ValueError when the
    source is missing or empty."""
    if source.startswith("toy:"):
        from reward_models.shapes import prompt_split

        records = prompt_split(source.split(":", 1)[1])
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"prompt file {source} does not exist (give a .txt file with one prompt "
                             f"a line, a .jsonl file of {{\"prompt\": ..., \"metadata\": ...}}, or "
                             f"toy:train / toy:heldout)")
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if path.suffix == ".jsonl":
            records = []
            for number, line in enumerate(lines, 1):
                item = json.loads(line)
                if "prompt" not in item:
                    raise ValueError(f"{source}:{number}: each JSONL line needs a 'prompt' field")
                records.append({"prompt": item["prompt"], "metadata": item.get("metadata", {})})
        else:
            records = [{"prompt": line.strip(), "metadata": {}} for line in lines]
    if not records:
        raise ValueError(f"prompt source {source} holds no prompts")
    return records


def sample_groups(records: list[dict], num_groups: int, seed: int, iteration: int,
                  balance_key: str | None = None) -> list[dict]:
    """The ``num_groups`` prompts of one iteration: a deterministic function of (seed, iteration).

    Without ``balance_key``: draws without replacement within an iteration while there are enough
    prompts. With it (e.g. "family"): each group first draws a value of ``metadata[balance_key]``
    uniformly, then a prompt of that value, so a rare task family is trained as often as a common
    one (GenEval's prompt set is dominated by one family).
    """
    generator = seeded_generator(seed, iteration, "prompts")
    if balance_key:
        buckets: dict[str, list[dict]] = {}
        for record in records:
            buckets.setdefault(str(record["metadata"].get(balance_key)), []).append(record)
        keys = sorted(buckets)
        picks = []
        for _ in range(num_groups):
            bucket = buckets[keys[int(torch.randint(len(keys), (1,), generator=generator))]]
            picks.append(bucket[int(torch.randint(len(bucket), (1,), generator=generator))])
        return picks
    order = torch.randperm(len(records), generator=generator).tolist()
    while len(order) < num_groups:
        order += torch.randperm(len(records), generator=generator).tolist()
    return [records[i] for i in order[:num_groups]]


def eval_selection(records: list[dict], eval_per_family: int = 0, eval_seeds: int = 1) -> list[dict]:
    """The held-out records to sample at evaluation, one entry per sample (each gets its own noise).

    ``eval_per_family > 0``: exactly that many samples per ``metadata["family"]``, cycling through a
    family's prompts (so a family with one held-out prompt is measured with many seeds as precisely
    as a family with forty); otherwise every record ``eval_seeds`` times. Shared by the trainer's
    evaluation and ``flowgrpo eval CONFIG`` so both score the same samples.
    """
    if eval_per_family <= 0:
        return [r for r in records for _ in range(eval_seeds)]
    by_family: dict[str, list[dict]] = {}
    for record in records:
        by_family.setdefault(str(record["metadata"].get("family")), []).append(record)
    return [family_records[k % len(family_records)] for family_records in by_family.values()
            for k in range(eval_per_family)]


def eval_prompts(records: list[dict], eval_per_family: int = 0) -> list[dict]:
    """The distinct prompts ``eval_selection`` samples, each once, in its order: the first
    ``eval_per_family`` prompts of each family (families in order of first appearance) when
    ``eval_per_family > 0``, else every record (``flowgrpo eval --samples-per-prompt``)."""
    if eval_per_family <= 0:
        return list(records)
    by_family: dict[str, list[dict]] = {}
    for record in records:
        by_family.setdefault(str(record["metadata"].get("family")), []).append(record)
    return [r for family_records in by_family.values() for r in family_records[:eval_per_family]]

