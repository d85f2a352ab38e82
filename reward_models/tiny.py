"""Tiny random versions of the rewards' checkpoints, built offline, for tests and benchmarks.

They are saved in the same layout as the hub checkpoints (``config.json`` + weights,
``preprocessor_config.json``, tokenizer files) so that the rewards load them through the real
``from_pretrained`` path. The scores they produce are meaningless; the code paths are real.
"""
from __future__ import annotations

import json
import os

import torch

from .clip_common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD


def _byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins GPT-2/CLIP byte-level BPE uses for bytes 0..255."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


TINY_MERGES = ("t h", "th e</w>", "o f</w>", "a n", "an d</w>", "i n", "o n</w>")


def write_tiny_clip_tokenizer(directory: str) -> None:
    """A byte-level CLIP BPE tokenizer (every byte as a token, a few merges, the start/end tokens
    last so that end-of-text has the highest id) saved with ``save_pretrained``."""
    from transformers import CLIPTokenizer

    os.makedirs(directory, exist_ok=True)
    alphabet = _byte_level_alphabet()
    vocab = {token: i for i, token in enumerate(alphabet + [c + "</w>" for c in alphabet])}
    for merge in TINY_MERGES:
        vocab["".join(merge.split())] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    with open(os.path.join(directory, "vocab.json"), "w") as handle:
        json.dump(vocab, handle)
    with open(os.path.join(directory, "merges.txt"), "w") as handle:
        handle.write("#version: 0.2\n" + "\n".join(TINY_MERGES) + "\n")
    tokenizer = CLIPTokenizer.from_pretrained(directory, model_max_length=77)
    tokenizer.save_pretrained(directory)


def build_tiny_clip(directory: str, *, projection_dim: int = 16, image_size: int = 32,
                    hidden_size: int = 32, seed: int = 0) -> str:
    """Save a random tiny ``CLIPModel`` with its image processor (shortest edge and crop
    ``image_size``, OpenAI mean/std, bicubic) and tokenizer to ``directory``; returns it."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    write_tiny_clip_tokenizer(directory)
    with open(os.path.join(directory, "vocab.json")) as handle:
        vocab_size = len(json.load(handle))
    text = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)
    vision = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                  num_attention_heads=2, image_size=image_size, patch_size=8)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)
    with torch.random.fork_rng(devices=[]):     # seeded without touching the caller's RNG
        torch.manual_seed(seed)
        model = CLIPModel(config)
    model.save_pretrained(directory)
    CLIPImageProcessor(size={"shortest_edge": image_size},
                       crop_size={"height": image_size, "width": image_size},
                       image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD),
                       resample=3).save_pretrained(directory)
    return directory


def build_tiny_aesthetic_head(path: str, *, embed_dim: int = 768, seed: int = 0) -> str:
    """Save a random head with the published keys/shapes (``layers.{0,2,4,6,7}``) to ``path``
    (.safetensors, or a torch state dict for .pth); returns ``path``."""
    from .aesthetic import AestheticHead

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = AestheticHead(embed_dim)
    state = {k: v.contiguous() for k, v in head.state_dict().items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, path)
    else:
        torch.save(state, path)
    return path
