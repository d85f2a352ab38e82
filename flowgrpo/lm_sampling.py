"""Causal-LM sampling and scoring: per-token log-probs, top-p, per-row seeded sampling,
generation of completions and the padding of replay inputs. Pure functions of a module and
tensors; the LM policy (``flowgrpo/llm.py``) calls them. Also the offline character tokenizer of
the tiny arithmetic model."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(B, S) 0/1 mask of a left-padded batch -> (B, S) positions: 0, 1, ... from each row's first
    real token, 0 on padding (what ``generate`` uses, so rollout and replay agree)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def token_logp(module: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_length: int,
               temperature: float = 1.0) -> Tensor:
    """Log-probs of the completion tokens, (B, C) float32 with C = S - prompt_length.

    Token t of the completion (position prompt_length + t) is scored by the logits at the
    previous position, divided by ``temperature`` (the sampled distribution, as in TRL).

    Args:
        module: a causal LM returning ``.logits`` (B, S, V).
        input_ids, attention_mask: (B, S), prompts left-padded to ``prompt_length``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    if not 0 < prompt_length < input_ids.shape[1]:
        raise ValueError(f"prompt_length must be in (0, {input_ids.shape[1]}) (got {prompt_length})")
    logits = module(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask), use_cache=False).logits
    logits = logits[:, prompt_length - 1:-1].float() / temperature
    targets = input_ids[:, prompt_length:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Nucleus filter, (B, V) -> (B, V) renormalised: keep the most probable tokens whose
    cumulative probability before them is < top_p (so at least the top token)."""
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (got {top_p})")
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


class SeededSampler:
    """A ``generate`` logits processor that samples each row from its own generator.

    Used with greedy decoding: it replaces the scores by 0 at one token drawn from
    top_p(softmax(scores / temperature)) and -inf elsewhere, so the greedy step picks that token.
    Each call draws one uniform per row (inverse-CDF sampling), so a row's tokens depend only on
    its generator and its own logits, not on the other rows of the batch.
    """

    def __init__(self, generators: list[torch.Generator], temperature: float, top_p: float) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling (got {temperature}); use "
                             f"greedy decoding for 0")
        self.generators = generators
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"SeededSampler has {len(self.generators)} generators for "
                             f"{scores.shape[0]} rows")
        probs = top_p_filter(torch.softmax(scores.float() / self.temperature, dim=-1), self.top_p)
        uniforms = torch.stack([torch.rand((), generator=g) for g in self.generators])
        cdf = probs.cumsum(-1)
        targets = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
        choice = torch.searchsorted(cdf, targets, right=True).clamp(max=scores.shape[-1] - 1)
        out = torch.full_like(scores, -math.inf)
        return out.scatter(-1, choice, 0.0)


# --------------------------------------------------------------------------- generation


def eos_token_ids(module: nn.Module, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update(int(i) for i in (configured if isinstance(configured, (list, tuple))
                                    else [configured]))
    if not ids:
        raise ValueError("the tokenizer and the model define no EOS token: completions could not "
                         "end; set tokenizer.eos_token")
    return sorted(ids)


@torch.no_grad()
def generate_completions(module: nn.Module, tokenizer, prompts: list[str], *, max_new_tokens: int,
                         batch_size: int, temperature: float = 1.0, top_p: float = 1.0,
                         generators: list[torch.Generator] | None = None
                         ) -> tuple[list[list[int]], list[list[int]], list[bool]]:
    """Complete ``prompts`` with ``module.generate``, ``batch_size`` prompts per call.

    ``generators`` (one per prompt) samples with ``SeededSampler``; None decodes greedily.
    Returns per prompt: its token ids (no padding), its completion ids up to and including the
    first EOS, and whether it was truncated (``max_new_tokens`` tokens without EOS).
    """
    from transformers import GenerationConfig, LogitsProcessorList   # a second to import

    if generators is not None and len(generators) != len(prompts):
        raise ValueError(f"generators must have one generator per prompt ({len(prompts)}) "
                         f"(got {len(generators)})")
    eos = eos_token_ids(module, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    device = next(module.parameters()).device
    prompt_ids, completion_ids, truncated = [], [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        encoded = tokenizer(chunk, return_tensors="pt", padding=True).to(device)
        processors = None
        if generators is not None:
            processors = LogitsProcessorList([SeededSampler(
                generators[start:start + batch_size], temperature, top_p)])
        out = module.generate(input_ids=encoded["input_ids"],
                              attention_mask=encoded["attention_mask"], generation_config=config,
                              logits_processor=processors)
        length = encoded["input_ids"].shape[1]
        for row in range(len(chunk)):
            kept = encoded["attention_mask"][row].bool()
            prompt_ids.append(encoded["input_ids"][row][kept].tolist())
            tokens = out[row, length:].tolist()
            end = next((i for i, token in enumerate(tokens) if token in eos), None)
            completion_ids.append(tokens if end is None else tokens[:end + 1])
            truncated.append(end is None)
    return prompt_ids, completion_ids, truncated


def pad_replay_inputs(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int
                      ) -> tuple[Tensor, Tensor, int]:
    """Left-pad prompts and right-pad completions into one batch.

    Returns input_ids and attention_mask (b, P + C) int64 and P, the padded prompt length."""
    prompt_length = max(len(p) for p in prompt_ids)
    width = prompt_length + max(max(len(c) for c in completion_ids), 1)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        sequence = torch.tensor(prompt + completion, dtype=torch.long)
        first = prompt_length - len(prompt)
        input_ids[row, first:first + len(sequence)] = sequence
        attention_mask[row, first:first + len(sequence)] = 1
    return input_ids, attention_mask, prompt_length


def build_char_tokenizer(alphabet: str, folder: str | Path | None = None):
    """A character-level ``PreTrainedTokenizerFast`` built offline: one token per character of
    ``alphabet`` plus <pad>=0, <bos>=1, <eos>=2, <unk>=3; encoding prepends <bos>, decoding
    concatenates characters. Saved to ``folder`` when given (AutoTokenizer-loadable)."""
    # transformers takes a second to import; only the tiny LM's pretraining builds tokenizers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet must not repeat characters (got {alphabet!r})")
    vocab = {token: i for i, token in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *alphabet])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>",
                                        eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                        padding_side="left", clean_up_tokenization_spaces=False)
    if folder is not None:
        tokenizer.save_pretrained(str(folder))
    return tokenizer
