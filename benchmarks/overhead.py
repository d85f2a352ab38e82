"""Trainer overhead: wall time of a training iteration / the model's own compute it needed.

    python benchmarks/overhead.py [--iterations 2] [--size 32] [--steps 10] [--layers 2 --heads 2]
                                  [--ops] [--check-model-time] [--profile PLAN]

For each plan (full, window, window + DPM-Solver++ compression, branch, one_step) the real
``Trainer`` runs one warm-up iteration and then ``--iterations`` measured ones on the tiny SD3
build (and on the toy model when ``assets/toy`` exists). The model's own compute is measured in
the same run, without editing the trainer:

- transformer forward: forward pre/post hooks on ``model.transformer``;
- transformer backward: a forward hook passes the transformer's output (when it carries a
  gradient) through an identity autograd function. Its backward runs when the gradient reaches
  the transformer's output; it starts a clock and queues an end-of-backward callback. So the
  backward of the transformer (and of the LoRA weights in it) is model time, and the backward of
  our own maths before it (policy loss, KL, transition log-prob; timed from an identity on the
  loss) is overhead, counted in "maths";
- the autograd engine's own time in such a pass ("engine", part of the model's time):
  ``Tensor.backward`` is wrapped, and the time from the call to the first node (the engine's
  setup and its dependency count over the whole graph, >99% the transformer's nodes) and from
  the end of the pass to the return is what a backward of the transformer alone would pay too;
- VAE decode and prompt encoding: ``model.decode`` / ``model.encode_prompts`` wrapped;
- rewards: the reward classes' own ``__call__`` / ``components`` wrapped inside ``MultiReward``.

The instrumented run pays for its own hooks and wrappers. So an uninstrumented ``Trainer`` with
the same config runs the same iterations, alternating with the instrumented one, and its wall
time is the numerator of the ratio ("wall"); "instr." is the instrumented wall minus it. The
printed ratio is the median over the measured iterations of (plain wall / model time) of that
iteration, so that a machine hiccup in one of the two trainers' runs does not move it.

Phases (rewards scored synchronously, ``rewards.threaded=false``, so phases do not overlap):
rollout = trainer's ``time/rollout`` minus the reward scoring inside it; reward = scoring time;
update = ``time/update`` (replay forwards, backwards, optimiser steps). "total" is the whole
``run_iteration`` wall time (advantages included) over all model compute. The target is a ratio
<= 1.10 at these CPU sizes; the table prints where it is above.

The overhead (instrumented wall - model) is broken down by timing, the same way, what the loop calls besides
the model: "maths" = the SDE transitions / DPM steps / policy loss (``flowgrpo.rollout.transition``,
``score_step``, ``dpmpp_2m_step``, ``flowgrpo.algorithms.grpo.policy_loss``,
``ratio_norm_log_ratio``, ``flow_kl``) and their
backward, "noise" =
per-sample seeded noise (``StepNoise``, ``initial_noise``), "cond" = ``encode_prompts`` minus the
text encoders' own forward (the prompt-cache lookups), "adapt" = ``model.velocity`` minus the
transformer forward (the adapter's own tensor handling), "optim" = ``optimizer_step``; "rest" is
everything else (loop bookkeeping, stats, hooks).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flowgrpo.config import load_config  # noqa: E402
from flowgrpo.trainer import Trainer  # noqa: E402

PLANS: dict[str, dict] = {
    "full": {"kind": "full"},
    "window": {"kind": "window", "window_size": 4},
    "window+dpm": {"kind": "window", "window_size": 4, "solver_after": "dpmpp_2m",
                   "compress_ratio": 0.4},
    "branch": {"kind": "branch", "window_size": 2},
    "one_step": {"kind": "one_step"},
}
PHASES = ("rollout", "reward", "update")
MODEL_KINDS = ("forward", "backward", "engine", "decode", "encode", "reward")


class ModelClock:
    """Seconds of the model's own compute, by (phase, what), and call counts."""

    def __init__(self) -> None:
        self.phase = "rollout"
        # One backward() call: called (the timed Tensor.backward), pass_began (_BackwardPassStart:
        # the engine runs its first node), reached (_TimedBackward: the gradient is at the
        # transformer's output), stopped (the end-of-pass callback).
        self.called: float | None = None
        self.pass_began: float | None = None
        self.reached: float | None = None
        self.stopped: float | None = None
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, what: str, seconds: float, phase: str | None = None) -> None:
        key = (phase or self.phase, what)
        self.seconds[key] += seconds
        self.calls[key] += 1

    def total(self, phase: str | None = None, kinds: tuple[str, ...] = MODEL_KINDS) -> float:
        """Seconds of ``kinds`` (default: the model's own compute) in ``phase`` (None = all)."""
        return sum(s for (p, k), s in self.seconds.items()
                   if (phase is None or p == phase) and k in kinds)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(function, clock: ModelClock, what: str, device: torch.device, phase: str | None = None):
    def wrapper(*args, **kwargs):
        _sync(device)
        began = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _sync(device)
            clock.add(what, time.perf_counter() - began, phase)

    return wrapper


class TimedReward:
    """Forwards to a reward class, timing its scoring methods (phase "reward")."""

    SCORING = ("components", "score_and_components")

    def __init__(self, inner, clock: ModelClock, device: torch.device) -> None:
        self._inner = inner
        self._clock = clock
        self._device = device

    def __call__(self, *args, **kwargs):
        return _timed(self._inner, self._clock, "reward", self._device, "reward")(*args, **kwargs)

    def __getattr__(self, name: str):
        value = getattr(self._inner, name)
        if name in self.SCORING and callable(value):
            return _timed(value, self._clock, "reward", self._device, "reward")
        return value


class _ClockIdentity(torch.autograd.Function):
    """Identity whose backward (defined by a subclass) reads the clock when the gradient
    arrives at the tensor it was applied to."""

    @staticmethod
    def forward(ctx, tensor, clock, device):
        ctx.clock, ctx.device = clock, device
        return tensor.view_as(tensor)


class _TimedBackward(_ClockIdentity):
    """On the transformer's output: its backward runs when the gradient reaches that output,
    starts a clock, and queues a callback that stops it when the whole pass has finished (what
    runs after it is the transformer's and its weights' backward)."""

    @staticmethod
    def backward(ctx, grad):
        from torch.autograd import Variable

        _sync(ctx.device)
        clock = ctx.clock
        began = time.perf_counter()
        if clock.reached is None:          # the first transformer output this pass reaches
            clock.reached = began
            if clock.pass_began is not None:   # the maths' backward ran from then until now
                clock.add("maths_backward", began - clock.pass_began)

            def stop() -> None:
                _sync(ctx.device)
                clock.stopped = time.perf_counter()
                clock.add("backward", clock.stopped - clock.reached)

            Variable._execution_engine.queue_callback(stop)
        return grad, None, None


class _BackwardPassStart(_ClockIdentity):
    """On a replay batch's loss: its backward is the first node of ``loss.backward()`` and notes
    when the pass began (the loss's own backward, our maths, runs from there)."""

    @staticmethod
    def backward(ctx, grad):
        _sync(ctx.device)
        ctx.clock.pass_began = time.perf_counter()
        return grad, None, None


def _timed_tensor_backward(backward, clock: ModelClock):
    """``Tensor.backward`` that charges the autograd engine's own time in a pass through the
    transformer to the model ("engine"): from the call to the first node (the GraphTask and the
    dependency count over the whole graph, >99% the transformer's nodes) and from the end of
    the pass to the return. A backward of the transformer alone pays the same; measured
    0.16 ms a call on the tiny SD3 build, whose node execution takes about 3 ms. Our nodes'
    execution stays overhead ("maths")."""

    def wrapper(tensor, *args, **kwargs):
        clock.called, clock.pass_began, clock.reached, clock.stopped = \
            time.perf_counter(), None, None, None
        try:
            return backward(tensor, *args, **kwargs)
        finally:
            ended = time.perf_counter()
            if clock.reached is not None and clock.stopped is not None:
                first_node = clock.pass_began if clock.pass_began is not None else clock.reached
                clock.add("engine", (first_node - clock.called) + (ended - clock.stopped))
            clock.called = clock.pass_began = clock.reached = clock.stopped = None

    return wrapper


def _with_backward_clock(output, clock: ModelClock, device: torch.device):
    """The transformer's output (a tensor, a tuple whose first item is one, or an object with
    ``.sample``) with its sample passed through ``_TimedBackward`` when it carries a gradient."""
    if isinstance(output, torch.Tensor):
        return _TimedBackward.apply(output, clock, device) if output.requires_grad else output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (_with_backward_clock(output[0], clock, device),) + tuple(output[1:])
    if hasattr(output, "sample") and isinstance(output.sample, torch.Tensor):
        output.sample = _with_backward_clock(output.sample, clock, device)
    return output


def text_encoders(model) -> list[torch.nn.Module]:
    """The text encoders of a FlowModel: ``text_encoder*`` attributes or components."""
    found = [m for name, m in vars(model).items() if name.startswith("text_encoder")]
    found += [m for name, m in (getattr(model, "components", None) or {}).items()
              if name.startswith("text_encoder")]
    return [m for m in found if isinstance(m, torch.nn.Module)]


@contextmanager
def timed_functions(clock: ModelClock, device: torch.device) -> Iterator[None]:
    """Time the loop's non-model callees (see the module docstring) by patching the names the
    rollout and the trainer look up; restored on exit."""
    import flowgrpo.rollout as rollout_module
    import flowgrpo.algorithms.grpo as trainer_module

    targets = [(rollout_module, "transition", "maths"), (rollout_module, "score_step", "maths"),
               (rollout_module, "dpmpp_2m_step", "maths"),
               (trainer_module, "policy_loss", "maths"), (trainer_module, "ratio_norm_log_ratio", "maths"),
               (trainer_module, "flow_kl", "maths"), (rollout_module.StepNoise, "__init__", "noise"),
               (rollout_module.StepNoise, "__call__", "noise"),
               (rollout_module, "initial_noise", "noise")]
    # Only the names this checkout has (the script also measures older commits side by side).
    targets = [(module, name, kind) for module, name, kind in targets if hasattr(module, name)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in targets]
    for module, name, kind in targets:
        setattr(module, name, _timed(getattr(module, name), clock, kind, device))
    saved.append((torch.Tensor, "backward", torch.Tensor.backward))
    torch.Tensor.backward = _timed_tensor_backward(torch.Tensor.backward, clock)
    try:
        yield
    finally:
        for module, name, function in saved:
            setattr(module, name, function)


class TimedTrainer(Trainer):
    """The Trainer with the model's own compute timed (see the module docstring)."""

    def __init__(self, config, clock: ModelClock) -> None:
        self.clock = clock
        super().__init__(config)
        self.instrument_model()
        self.instrument_rewards()
        replay_loss = self.policy.replay_loss

        def timed_replay_loss(*args, **kwargs):
            loss, record = replay_loss(*args, **kwargs)
            return _BackwardPassStart.apply(loss, self.clock, torch.device(self.model.device)), record

        self.policy.replay_loss = timed_replay_loss

    def instrument_model(self) -> None:
        device = torch.device(self.model.device)
        transformer = self.model.transformer
        starts: list[float] = []

        def pre_hook(module, args, kwargs=None):
            _sync(device)
            starts.append(time.perf_counter())

        def post_hook(module, args, output):
            _sync(device)
            self.clock.add("forward", time.perf_counter() - starts.pop())
            if torch.is_grad_enabled():
                return _with_backward_clock(output, self.clock, device)
            return None

        transformer.register_forward_pre_hook(pre_hook)
        transformer.register_forward_hook(post_hook)
        for encoder in text_encoders(self.model):
            encoder.forward = _timed(encoder.forward, self.clock, "encode", device)
        self.model.decode = _timed(self.model.decode, self.clock, "decode", device)
        self.model.velocity = _timed(self.model.velocity, self.clock, "velocity", device)
        self.model.encode_prompts = _timed(self.model.encode_prompts, self.clock, "cond", device)

    def instrument_rewards(self) -> None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        for managed in self.reward.rewards.values():
            managed.inner = TimedReward(managed.inner, self.clock, device)

    def rollout_and_score(self, iteration: int):
        self.clock.phase = "rollout"
        return super().rollout_and_score(iteration)

    def update(self, batch, advantages, iteration):
        self.clock.phase = "update"
        return super().update(batch, advantages, iteration)

    def optimizer_step(self) -> tuple[float, bool]:
        return _timed(super().optimizer_step, self.clock, "optim",
                      torch.device(self.model.device))()


def op_census(trainer: Trainer, iteration: int) -> dict[str, float]:
    """Operator counts of one update (plain ``trainer``), per replay batch: top-level aten ops
    of the forward passes inside the transformer ("model_forward") and outside it
    ("ours_forward": SDE log-prob, loss, records, adapter glue, optimiser), and autograd nodes
    run by the backward passes, the transformer's (and its weights' gradient accumulation) or
    ours. Counts do not depend on the machine's speed or load, unlike the timings; at these
    sizes every op costs a few microseconds whatever its size, so ours / model is about the
    overhead's floor."""
    from torch.profiler import ProfilerActivity, profile, record_function

    scopes: list = []

    def enter(module, args):
        scopes.append(record_function("model"))
        scopes[-1].__enter__()

    def leave(module, args, output):
        scopes.pop().__exit__(None, None, None)

    hooks = [trainer.model.transformer.register_forward_pre_hook(enter),
             trainer.model.transformer.register_forward_hook(leave)]
    try:
        batch, rewards, _ = trainer.rollout_and_score(iteration)
        advantages, _ = trainer.compute_advantages(batch, rewards)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.update(batch, advantages, iteration)
    finally:
        for hook in hooks:
            hook.remove()
    counts = {"ours_forward": 0, "model_forward": 0, "ours_backward": 0, "model_backward": 0}
    model_sequence: set[int] = set()
    nodes = []
    for event in prof.events():
        if event.name.startswith("autograd::engine::evaluate_function"):
            nodes.append(event)
            continue
        if not event.name.startswith("aten::"):
            continue
        parents, parent = [], event.cpu_parent
        while parent is not None:
            parents.append(parent.name)
            parent = parent.cpu_parent
        if any(p.startswith("autograd::engine") for p in parents):
            continue                                     # inside a backward node
        in_model = "model" in parents
        if in_model and event.sequence_nr >= 0:
            model_sequence.add(event.sequence_nr)
        if not any(p.startswith("aten::") for p in parents):
            counts["model_forward" if in_model else "ours_forward"] += 1
    for node in nodes:
        is_model = node.sequence_nr in model_sequence or "AccumulateGrad" in node.name
        counts["model_backward" if is_model else "ours_backward"] += 1
    replays = max(len(batch.replay), 1)
    return {key: value / replays for key, value in counts.items()}


def make_config(family: str, path: str, plan: dict, args: argparse.Namespace, workdir: Path):
    (workdir / "prompts.txt").write_text("a red square\na blue circle\na green cat\na cat\n")
    options = {"height": args.size, "width": args.size, "max_sequence_length": 16} \
        if family == "sd3" else {}
    reward = [{"name": "jpeg_compressibility"}] if family == "sd3" else \
        [{"name": "geneval_toy"}]
    data = {
        "name": f"overhead_{family}",
        "model": {"family": family, "path": path, "options": options,
                  "lora": {"rank": 4, "alpha": 8}},
        "prompts": {"train": "toy:train" if family == "toy" else str(workdir / "prompts.txt"),
                    "eval": None},
        "sampling": {"num_steps": args.steps, "rollout_batch_size": args.group_size,
                     "plan": plan},
        "training": {"prompts_per_iteration": args.prompts, "group_size": args.group_size,
                     "skip_zero_std_groups": False},
        "rewards": {"components": reward, "threaded": False},
        "run": {"output_dir": str(workdir / "runs"), "tracker": "none", "progress": False,
                "num_threads": args.threads, "max_iterations": 1 + args.iterations},
    }
    return load_config(data=data)


def _add_walls(wall: dict[str, float], metrics: dict, seconds: float) -> None:
    wall["total"] += seconds
    wall["rollout"] += metrics["time/rollout"] - metrics["time/reward_compute"]
    wall["reward"] += metrics["time/reward_compute"] + metrics["time/reward_wait"]
    wall["update"] += metrics["time/update"]


def measure(family: str, path: str, plan_name: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Wall and model seconds per phase over ``args.iterations`` iterations (after a warm-up):
    the instrumented trainer's and, alternating with it on the same iterations, a plain one's."""
    config = make_config(family, path, PLANS[plan_name], args, workdir)
    clock = ModelClock()
    timed = TimedTrainer(config, clock)
    plain = Trainer(config)
    device = torch.device(timed.model.device)
    wall: dict[str, float] = defaultdict(float)
    plain_wall: dict[str, float] = defaultdict(float)
    ratios: dict[str, list[float]] = defaultdict(list)     # per iteration: plain wall / model
    with timed_functions(clock, device):
        timed.run_iteration(0)                                # warm-up: encodes prompts, allocs
    plain.run_iteration(0)
    clock.reset()
    for iteration in range(1, 1 + args.iterations):
        model_before = {phase: clock.total(_phase_key(phase)) for phase in PHASES + ("total",)}
        plain_before = dict(plain_wall)
        # Alternate which trainer goes first, so a drift in machine speed hits both alike.
        for which in ("timed", "plain") if iteration % 2 else ("plain", "timed"):
            if which == "timed":
                with timed_functions(clock, device):
                    began = time.perf_counter()
                    metrics = timed.run_iteration(iteration)
                    _add_walls(wall, metrics, time.perf_counter() - began)
            else:
                began = time.perf_counter()
                plain_metrics = plain.run_iteration(iteration)
                _add_walls(plain_wall, plain_metrics, time.perf_counter() - began)
        for phase, before in model_before.items():
            model = clock.total(_phase_key(phase)) - before
            if model > 0:
                ratios[phase].append((plain_wall[phase] - plain_before.get(phase, 0.0)) / model)
    return {"wall": dict(wall), "plain_wall": dict(plain_wall), "clock": clock,
            "ratios": dict(ratios), "nfe": metrics["nfe"], "trained": metrics["trained_transitions"]}


def _phase_key(phase: str) -> str | None:
    return None if phase == "total" else phase


def model_time_check(family: str, path: str, args: argparse.Namespace, workdir: Path,
                     iterations: int = 8) -> list[float]:
    """The clocks' update-phase model time per replay batch (forward + backward + engine) over
    a transformer forward + backward alone on the same inputs, per iteration: the trainer runs
    an instrumented iteration (full plan), then the bare transformer runs as many forward +
    backward calls on the inputs of the iteration's first call, and so on. About 1 when the
    hooks neither miss nor add model time; our code running between the calls (cold caches)
    would show as > 1."""
    clock = ModelClock()
    trainer = TimedTrainer(make_config(family, path, PLANS["full"], args, workdir), clock)
    device = torch.device(trainer.model.device)
    transformer = trainer.model.transformer
    with timed_functions(clock, device):
        trainer.run_iteration(0)
    captured: dict = {}

    def grab(module, call_args, kwargs):
        if torch.is_grad_enabled() and not captured:
            captured.update({k: v.detach() if torch.is_tensor(v) else v for k, v in kwargs.items()})

    hook = transformer.register_forward_pre_hook(grab, with_kwargs=True)
    ratios = []
    try:
        for iteration in range(1, 1 + iterations):
            clock.reset()
            with timed_functions(clock, device):
                trainer.run_iteration(iteration)
            hook.remove()
            calls = clock.calls[("update", "forward")]
            # read before the bare calls: the transformer's hooks would clock those too
            model = clock.total("update", ("forward", "backward", "engine"))
            alone = 0.0
            for _ in range(calls):
                _sync(device)
                began = time.perf_counter()
                out = transformer(**captured)[0]
                out.backward(torch.ones_like(out))
                _sync(device)
                alone += time.perf_counter() - began
                del out
                transformer.zero_grad(set_to_none=True)
            ratios.append(model / alone)
    finally:
        hook.remove()
    return ratios


def print_table(rows: list[tuple[str, str, dict]], target: float) -> None:
    """One line per (model, plan, phase): the plain trainer's wall and the model's ms, their ratio,
    the instrumentation's cost, and the instrumented run's overhead split into maths / noise /
    cond / adapt / optim / rest (ms)."""
    header = (f"{'model':<5} {'plan':<10} {'phase':<7} {'wall':>7} {'model':>7} {'engine':>6} {'ratio':>6} "
              f"{'instr':>6} {'over':>6} | {'maths':>6} {'noise':>6} {'cond':>6} {'adapt':>6} {'optim':>6} "
              f"{'rest':>6}  calls")
    print(header)
    print("-" * len(header))
    for family, plan, result in rows:
        clock: ModelClock = result["clock"]
        for phase in PHASES + ("total",):
            which = None if phase == "total" else phase
            timed_wall = result["wall"][phase] * 1e3
            wall = result["plain_wall"][phase] * 1e3
            model = clock.total(which) * 1e3
            parts = {kind: clock.total(which, (kind,)) * 1e3
                     for kind in ("maths", "noise", "cond", "velocity", "optim")}
            parts["maths"] += clock.total(which, ("maths_backward",)) * 1e3
            parts["cond"] -= clock.total(which, ("encode",)) * 1e3   # encoders are model time
            parts["velocity"] -= clock.total(which, ("forward",)) * 1e3
            rest = timed_wall - model - sum(parts.values())
            # The median of the iterations' ratios: one iteration that a machine hiccup hits in
            # only one of the two trainers does not move it (the summed columns keep it).
            per_iteration = result["ratios"].get(phase, [])
            ratio = statistics.median(per_iteration) if per_iteration else float("inf")
            calls = {"rollout": f"fwd {clock.calls[('rollout', 'forward')]}",
                     "reward": f"reward {clock.calls[('reward', 'reward')]}",
                     "update": f"fwd {clock.calls[('update', 'forward')]} "
                               f"bwd {clock.calls[('update', 'backward')]}",
                     "total": f"nfe {result['nfe']}, trained {result['trained']}"}[phase]
            flag = "  <-- above target" if ratio > target else ""
            engine = clock.total(which, ("engine",)) * 1e3
            print(f"{family:<5} {plan:<10} {phase:<7} {wall:>7.1f} {model:>7.1f} {engine:>6.1f} {ratio:>6.3f} "
                  f"{timed_wall - wall:>6.1f} {timed_wall - model:>6.1f} | {parts['maths']:>6.1f} {parts['noise']:>6.1f} "
                  f"{parts['cond']:>6.1f} {parts['velocity']:>6.1f} {parts['optim']:>6.1f} {rest:>6.1f}  "
                  f"{calls}{flag}")
    print("ms summed over the measured iterations. wall: the plain Trainer's; ratio = the median over "
          "iterations of wall / model; "
          "engine: the autograd engine's own time in backward passes through the transformer, "
          "part of model;\ninstr. = instrumented wall - wall; over = instrumented wall - model = maths + noise + "
          "cond + adapt + optim + rest")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2, help="measured iterations per plan")
    parser.add_argument("--size", type=int, default=32, help="SD3 image side (multiple of 16)")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per rollout")
    parser.add_argument("--layers", type=int, default=2,
                        help="SD3 transformer blocks (2: the test build)")
    parser.add_argument("--heads", type=int, default=2,
                        help="SD3 attention heads of 8 channels (2: the test build, width 16)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2, help="prompts (groups) per iteration")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--plans", default=",".join(PLANS), help="comma-separated plan names")
    parser.add_argument("--models", default="sd3,toy", help="comma-separated: sd3, toy")
    parser.add_argument("--target", type=float, default=1.10)
    parser.add_argument("--ops", action="store_true",
                        help="also count the aten ops of one update per replay batch, ours vs "
                             "the transformer's (op_census), for every model and plan")
    parser.add_argument("--check-model-time", action="store_true",
                        help="also compare the clocks' model time with the bare transformer's "
                             "forward + backward on the same inputs (model_time_check)")
    parser.add_argument("--profile", default=None, metavar="PLAN",
                        help="also cProfile one iteration of PLAN (first model, plain Trainer) and print "
                             "the top entries")
    args = parser.parse_args(argv)
    plans = [p for p in args.plans.split(",") if p]
    unknown = [p for p in plans if p not in PLANS]
    if unknown:
        parser.error(f"unknown plans {unknown}; choose from {list(PLANS)}")

    from diffusers.utils import logging as diffusers_logging

    from pipelines.tiny import save_tiny

    diffusers_logging.disable_progress_bar()
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        wanted = args.models.split(",")
        size = None if (args.layers, args.heads) == (2, 2) else (args.layers, args.heads)
        models = [("sd3", save_tiny("sd3", workdir / "tiny_sd3", transformer_size=size))] \
            if "sd3" in wanted else []
        toy = repo / "assets" / "toy"
        if "toy" in wanted and (toy / "transformer").is_dir():
            models.append(("toy", str(toy)))
        rows = []
        for family, path in models:
            for plan in plans:
                rows.append((family, plan, measure(family, path, plan, args, workdir)))
        print(f"one iteration = {args.prompts} prompts x {args.group_size} samples, "
              f"{args.steps} steps, {args.size} px (SD3: {args.layers} blocks, width "
              f"{8 * args.heads}), LoRA r4, {args.threads} thread(s); "
              f"sums over {args.iterations} iteration(s) after a warm-up")
        print_table(rows, args.target)
        if args.ops:
            print("\nops per replay batch (one update, plain Trainer): forward ops ours / model, "
                  "backward nodes ours / model")
            for family, path in models:
                for plan in plans:
                    trainer = Trainer(make_config(family, path, PLANS[plan], args, workdir))
                    trainer.run_iteration(0)
                    c = op_census(trainer, 1)
                    print(f"{family:<5} {plan:<10} forward {c['ours_forward']:6.1f} / "
                          f"{c['model_forward']:6.1f}   backward {c['ours_backward']:5.1f} / "
                          f"{c['model_backward']:6.1f}   ours / model "
                          f"{(c['ours_forward'] + c['ours_backward']) / (c['model_forward'] + c['model_backward']):.3f}")
        if args.check_model_time:
            print("\nupdate-phase model time per replay batch in the trainer / the bare "
                  "transformer's forward + backward, full plan, per iteration:")
            for family, path in models:
                ratios = model_time_check(family, path, args, workdir)
                print(f"{family:<5} median {statistics.median(ratios):.3f}  "
                      f"({', '.join(f'{r:.3f}' for r in ratios)})")
        if args.profile:
            family, path = models[0]
            trainer = Trainer(make_config(family, path, PLANS[args.profile], args, workdir))
            trainer.run_iteration(0)
            profiler = cProfile.Profile()
            profiler.enable()
            trainer.run_iteration(1)
            profiler.disable()
            stats = pstats.Stats(profiler).strip_dirs().sort_stats("tottime")
            stats.print_stats(30)


if __name__ == "__main__":
    main()
