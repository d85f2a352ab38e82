"""What training.cfg_gradient costs: the update step with CFG's unconditional branch detached our
way, Flow-GRPO's way, or carrying gradient.

    python benchmarks/cfg_gradient.py [--repeats 5] [--size 32] [--layers 2 --heads 2]
                                      [--threads 1] [--skip-peak]
                                      [--out benchmarks/results/cfg_gradient]

One tiny SD3 run (``pipelines.tiny``; ``--layers/--heads`` widen its transformer): 2 prompts x 4
samples rolled out in one batch of 8 with CFG 4.5 over 5 steps, 4 of them trained (4 timesteps x
8 samples = 4 replay batches), KL to the reference on (beta 0.04), AdamW, one optimiser step per
update. One rollout is made; then the same update (``Trainer.update``: 4 replay forwards and
backwards, each with the reference's forward for the KL, and the AdamW step) is timed for three
arms, in turn, with the arms' order rotating every repeat so that a drift in machine speed hits
all alike:

    detached     training.cfg_gradient: conditional, ours: the unconditional branch in a forward
                 of its own under torch.no_grad, the conditional one with autograd
    flow_grpo    Flow-GRPO's update (train_sd3.py, 2025-07-15 to -18): one batched forward over
                 [uncond; cond] with autograd, the uncond half detached after it (not a mode of
                 this toolkit: patched into ``flowgrpo.model.guidance_branches`` for this arm)
    both         training.cfg_gradient: both, the default: one batched forward, both halves
                 carry gradient

Time: CPU seconds of the update (``time.process_time``, every thread), median over the
repeats; ratios are medians of the per-repeat ratios. Memory: two measures of one more update
per arm, run after the timed ones. Peak: torch's CPU memory profiler
(``torch.profiler.profile(profile_memory=True)``, its memory timeline as
``export_memory_timeline`` builds it): the peak of the bytes allocated during the update above
what was allocated when it began. Saved: the bytes autograd keeps for backward over the update
(``torch.autograd.graph.saved_tensors_hooks``, each storage counted once, the trainable and
frozen weights left out; summed over the 4 replay batches, of which one is alive at a time):
the activations each way stores. tracemalloc is not
used: it sees Python's allocator only, not tensor memory. Results go to
``<out>/sd3_<blocks>x<width>_<size>px.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flowgrpo.model  # noqa: E402
from flowgrpo.config import load_config  # noqa: E402
from flowgrpo.trainer import Trainer  # noqa: E402

ARMS = ("detached", "flow_grpo", "both")
GUIDANCE = 4.5


def flow_grpo_branches(forward: Callable[[Tensor, Tensor, dict[str, Tensor]], Tensor],
                       latents: Tensor, timestep: Tensor, positive: dict[str, Tensor],
                       negative: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(v_neg, v_pos) the way Flow-GRPO's SD3 update computed them: one forward over the batch
    [uncond; cond] under the ambient grad mode, the uncond half detached afterwards (its
    activations were stored and its rows go through the backward of the shared ops)."""
    text = {key: torch.cat([negative[key].to(value), value]) for key, value in positive.items()}
    v_neg, v_pos = forward(torch.cat([latents, latents]), torch.cat([timestep, timestep]),
                           text).chunk(2)
    return v_neg.detach(), v_pos


def arm_scope(trainer: Trainer, arm: str):
    """The context an arm's update runs in: the config's cfg_gradient set (the policy reads it at
    each replay), Flow-GRPO's branches patched in for its arm."""
    trainer.config.training.cfg_gradient = "conditional" if arm == "detached" else "both"
    if arm == "flow_grpo":
        return mock.patch.object(flowgrpo.model, "guidance_branches", flow_grpo_branches)
    return nullcontext()


def make_config(sd3_path: str, workdir: Path, size: int, threads: int):
    (workdir / "prompts.txt").write_text("a red square\na blue circle\n")
    return load_config(data={
        "name": "cfg_gradient",
        "model": {"family": "sd3", "path": sd3_path,
                  "options": {"height": size, "width": size, "max_sequence_length": 16},
                  "lora": {"rank": 4, "alpha": 8}},
        "prompts": {"train": str(workdir / "prompts.txt"), "eval": None},
        # 5 steps: 4 stochastic and trained, the last deterministic
        "sampling": {"num_steps": 5, "rollout_batch_size": 8, "guidance_scale": GUIDANCE},
        "training": {"prompts_per_iteration": 2, "group_size": 4, "lr": 1e-4, "kl_beta": 0.04,
                     "optimizer_steps_per_epoch": 1, "skip_zero_std_groups": False},
        "rewards": {"components": [{"name": "jpeg_compressibility"}], "threaded": False},
        "run": {"output_dir": str(workdir / "runs"), "max_iterations": 1, "tracker": "none",
                "progress": False, "checkpoint_every": 0, "eval_every": 0,
                "comparison_grid": False, "num_threads": threads},
    })


def peak_update_bytes(update: Callable[[], object]) -> int:
    """The peak of bytes allocated on the CPU during ``update()`` above those allocated when it
    began (torch's memory profiler timeline)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        update()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(
        torch.device("cpu"))
    totals = [sum(row) for row in sizes]
    return max(totals) if totals else 0


@contextmanager
def saved_activation_bytes(weights: set[int], counts: list[int]) -> Iterator[None]:
    """Appends to ``counts`` the bytes of the distinct storages autograd saves for backward in
    the scope (weights, by storage pointer in ``weights``, left out). Every saved tensor is held
    until the scope ends, so that no storage freed by a replay batch's backward is reused at the
    same address and taken for one already counted."""
    seen: set[int] = set()
    held: list[Tensor] = []

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in seen and pointer not in weights:
            seen.add(pointer)
            counts.append(storage.nbytes())
            held.append(tensor)
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
    finally:
        held.clear()


def measure(trainer: Trainer, repeats: int, peak: bool = True) -> dict:
    """Time the arms' updates of one rollout ``repeats`` times each, then measure the memory of
    one more update per arm (the profiler's peak only when ``peak``: it takes seconds an arm)."""
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    replay_batches = len(batch.replay)

    def update(arm: str) -> dict:
        with arm_scope(trainer, arm):
            return trainer.update(batch, advantages, 0)

    for arm in ARMS:                                         # warm-up, not counted
        update(arm)
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for repeat in range(repeats):
        order = ARMS[repeat % len(ARMS):] + ARMS[:repeat % len(ARMS)]
        for arm in order:
            began = time.process_time()
            metrics = update(arm)
            seconds[arm].append(time.process_time() - began)
            assert metrics["train/replay_batches"] == replay_batches
    weights = {p.untyped_storage().data_ptr() for p in trainer.policy.module.parameters()}
    peaks: dict[str, int | None] = {}
    saved: dict[str, int] = {}
    for arm in ARMS:
        peaks[arm] = peak_update_bytes(lambda arm=arm: update(arm)) if peak else None
        counts: list[int] = []
        with saved_activation_bytes(weights, counts):
            update(arm)
        saved[arm] = sum(counts)

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(x / y for x, y in zip(seconds[a], seconds[b])), 3)

    return {
        "replay_batches": replay_batches,
        "rows_per_replay_batch": int(batch.replay[0].rows.numel()),
        "update_cpu_seconds": {arm: [round(s, 4) for s in seconds[arm]] for arm in ARMS},
        "update_cpu_seconds_median": {arm: round(statistics.median(seconds[arm]), 4)
                                      for arm in ARMS},
        "peak_bytes": peaks, "saved_for_backward_bytes": saved,
        "time_ratio": {"detached/flow_grpo": ratio("detached", "flow_grpo"),
                       "detached/both": ratio("detached", "both"),
                       "flow_grpo/both": ratio("flow_grpo", "both")},
        "peak_ratio": {"detached/flow_grpo": round(peaks["detached"] / peaks["flow_grpo"], 3),
                       "detached/both": round(peaks["detached"] / peaks["both"], 3),
                       "flow_grpo/both": round(peaks["flow_grpo"] / peaks["both"], 3)}
        if peak else None,
        "saved_ratio": {"detached/flow_grpo": round(saved["detached"] / saved["flow_grpo"], 3),
                        "detached/both": round(saved["detached"] / saved["both"], 3),
                        "flow_grpo/both": round(saved["flow_grpo"] / saved["both"], 3)},
    }


def result_name(layers: int, heads: int, size: int) -> str:
    """The results file of a build: sd3_<blocks>x<width>_<size>px.json."""
    return f"sd3_{layers}x{8 * heads}_{size}px.json"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="timed updates per arm")
    p.add_argument("--size", type=int, default=32, help="image side in pixels (multiple of 16)")
    p.add_argument("--layers", type=int, default=2, help="SD3 transformer blocks (test build: 2)")
    p.add_argument("--heads", type=int, default=2,
                   help="SD3 attention heads of 8 channels (test build: 2, width 16)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-peak", action="store_true",
                   help="leave out the profiler's peak memory (seconds an arm)")
    p.add_argument("--out", default="benchmarks/results/cfg_gradient")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    torch.set_num_threads(args.threads)
    from pipelines.tiny import save_tiny

    began = time.process_time()
    with tempfile.TemporaryDirectory() as workdir:
        work = Path(workdir)
        size = None if (args.layers, args.heads) == (2, 2) else (args.layers, args.heads)
        sd3 = save_tiny("sd3", work / "sd3", transformer_size=size)
        trainer = Trainer(make_config(sd3, work, args.size, args.threads))
        result = measure(trainer, args.repeats, peak=not args.skip_peak)
    cpu = time.process_time() - began
    print(f"update of {result['replay_batches']} replay batches x "
          f"{result['rows_per_replay_batch']} rows, CFG {GUIDANCE}, KL on, AdamW; SD3 "
          f"{args.layers} blocks, width {8 * args.heads}, {args.size} px, {args.threads} thread(s)")
    for arm in ARMS:
        peak = result["peak_bytes"][arm]
        print(f"{arm:>10}: {result['update_cpu_seconds_median'][arm]:.3f} CPU s (median of "
              f"{args.repeats}), peak "
              f"{'-' if peak is None else f'{peak / 2**20:.2f} MiB'}, saved for "
              f"backward {result['saved_for_backward_bytes'][arm] / 2**20:.2f} MiB")
    for key in ("time_ratio", "peak_ratio", "saved_ratio"):
        if result[key] is not None:
            print(f"{key}: " + ", ".join(f"{k} {v}" for k, v in result[key].items()))
    result.update(size=args.size, layers=args.layers, heads=args.heads, threads=args.threads,
                  repeats=args.repeats, cpu_seconds=round(cpu, 1),
                  command=" ".join(["python benchmarks/cfg_gradient.py",
                                    *(sys.argv[1:] if argv is None else argv)]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / result_name(args.layers, args.heads, args.size)).write_text(
        json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
