"""Reward throughput on CPU and the overhead of scoring through the HTTP server.

    python benchmarks/rewards.py [--batch 8] [--size 256] [--repeats 3]

Prints images per second for each reward at the given batch size. CLIP-family rewards use tiny
random checkpoints built offline (the real ViT-L/ViT-H weights cannot be downloaded here), so
their numbers measure the pipeline (preprocessing, tokenisation, plumbing), not a real model's
forward pass; the output says which. OCR runs the real RapidOCR models at 64 and 512 px with a
rendered word. The remote overhead is measured side by side (interleaved repetitions) in one run
and printed as the ratio remote time / local time. Times are the best of ``--repeats`` runs
(robust to other processes sharing the CPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reward_models import load_reward  # noqa: E402
from flowgrpo.pixels import from_uint8  # noqa: E402
from reward_models.server import make_server, start_in_thread  # noqa: E402
from reward_models.tiny import build_tiny_aesthetic_head, build_tiny_clip  # noqa: E402


def rendered_word(word: str, size: int) -> torch.Tensor:
    """(3, size, size) black word on white, Pillow's built-in font scaled to the image."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=max(size // 6, 10))
    draw.text((size // 10, size // 3), word, fill="black", font=font)
    return from_uint8(np.asarray(image))


def best_time(fn, repeats: int) -> float:
    """Best wall time of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=256, help="image side for non-OCR rewards")
    parser.add_argument("--frames", type=int, default=8, help="frames per video")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    batch, size = args.batch, args.size
    workdir = tempfile.mkdtemp(prefix="flowgrpo_reward_bench_")
    tiny_clip = build_tiny_clip(os.path.join(workdir, "clip"))
    tiny_clip_768 = build_tiny_clip(os.path.join(workdir, "clip768"), projection_dim=768)
    head = build_tiny_aesthetic_head(os.path.join(workdir, "head.safetensors"))

    images = torch.rand(batch, 3, size, size)
    videos = torch.rand(batch, args.frames, 3, size // 2, size // 2)
    prompts = [f'a photo of a sign saying "word{i}"' for i in range(batch)]
    tiny = "tiny random weights (real ones not downloadable here)"
    cases = [
        ("aesthetic", {"name": "aesthetic", "model": tiny_clip_768, "head": head}, images, tiny),
        ("clip_score", {"name": "clip_score", "model": tiny_clip}, images, tiny),
        ("pickscore", {"name": "pickscore", "model": tiny_clip, "processor": tiny_clip}, images,
         tiny),
        ("jpeg_compressibility", "jpeg_compressibility", images, "real (Pillow)"),
        ("jpeg_incompressibility", "jpeg_incompressibility", images, "real (Pillow)"),
        ("clip_score per frame", {"name": "clip_score", "model": tiny_clip}, videos,
         tiny + "; frames/s"),
        ("temporal_consistency", {"name": "temporal_consistency", "model": tiny_clip}, videos,
         tiny + "; frames/s"),
    ]
    for px in (64, 512):
        word_images = torch.stack([rendered_word(f"word{i}", px) for i in range(batch)])
        cases.append((f"ocr {px}px", "ocr", word_images, "real RapidOCR ONNX models"))
    for name in ("hpsv2", "imagereward"):
        try:
            load_reward(name)
        except ImportError as error:
            print(f"{name:<24} skipped: {error}")

    print(f"\nbatch {batch}, images {size}x{size}, videos {args.frames}x{size // 2}x{size // 2}, "
          f"CPU threads {torch.get_num_threads()}")
    print(f"{'reward':<24} {'images/s':>10}  weights")
    for label, spec, media, note in cases:
        reward = load_reward(spec)
        seconds = best_time(lambda: reward(media, prompts), args.repeats)
        count = media.shape[0] * (media.shape[1] if media.ndim == 5 else 1)
        print(f"{label:<24} {count / seconds:>10.1f}  {note}")

    print("\nremote vs local (same reward, interleaved runs, loopback HTTP, PNG transport)")
    for label, spec in (("jpeg_compressibility", "jpeg_compressibility"),
                        ("clip_score (tiny)", {"name": "clip_score", "model": tiny_clip})):
        local = load_reward(spec)
        server = make_server(spec, port=0, token="bench")
        start_in_thread(server)
        client = load_reward({"name": "remote", "url": server.url, "token": "bench"})
        local_times, remote_times = [], []
        client(images, prompts)
        local(images, prompts)
        for _ in range(args.repeats):
            start = time.perf_counter()
            local(images, prompts)
            local_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            client(images, prompts)
            remote_times.append(time.perf_counter() - start)
        server.shutdown()
        server.server_close()
        t_local, t_remote = min(local_times), min(remote_times)   # min: robust to CPU contention
        print(f"{label:<24} local {t_local * 1e3:8.1f} ms  remote {t_remote * 1e3:8.1f} ms  "
              f"ratio {t_remote / t_local:5.2f}x  (+{(t_remote - t_local) * 1e3 / batch:.1f} "
              f"ms/image)")


if __name__ == "__main__":
    main()
