"""run.save_on_signal: a signal makes the run save at the next safe point, say so in one line and
exit with 128 + the signal's number; resuming gives the weights of a run never stopped. And the
runs that teach nothing: no finite reward (stops), one constant reward (warns, or stops).

In-process tests send the signal from a reward (during a rollout) or from the update, so they
hit a known point; the subprocess tests (slow) send it from outside, as a scheduler does."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flowgrpo import checkpoint as ckpt
from flowgrpo import interrupts
from flowgrpo.config import load_config
from flowgrpo.interrupts import DUPLICATE_WINDOW_S, Preempted, StopRequested, StopSignals
from flowgrpo.trainer import Trainer
from flowgrpo.trainer_advantages import (ConstantRewardError, NoFiniteRewardError,
                                         constant_value, describe_returned)
from tests.helpers import errors_of, free_port, tiny_data

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 6


def signal_data(model_path: str, root: Path, name: str, reward: dict | None = None,
                **run: object) -> dict:
    """Tiny SD3, EMA on, the prompt cache off (a resumed process then encodes exactly as the
    uninterrupted one: bit-identical resumes, see docs/reliability.md)."""
    data = tiny_data(model_path, root,
                     model={"options": {"height": 32, "width": 32, "prompt_cache_size": 0}},
                     training={"ema": {"enabled": True, "every": 1}},
                     run={"max_iterations": ITERATIONS, "checkpoint_every": 2,
                          "keep_checkpoints": 0, "num_threads": 1, **run})
    data["name"] = name
    if reward is not None:
        data["rewards"] = {"components": [reward], "threaded": False}
    return data


def weights(run_dir: Path, iteration: int) -> dict[str, torch.Tensor]:
    folder = run_dir / "checkpoints" / str(iteration)
    return {**load_file(str(folder / "trainable.safetensors")),
            **{f"ema:{k}": v for k, v in load_file(str(folder / "ema.safetensors")).items()}}


def assert_equal_weights(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-6, rtol=0, msg=key)


def train_iterations(metrics: Path) -> list[int]:
    return [r["iteration"] for r in map(json.loads, metrics.read_text().splitlines())
            if r["phase"] == "train"]


@pytest.fixture(scope="module")
def straight(tiny_sd3_path, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights and EMA of the run never stopped."""
    root = tmp_path_factory.mktemp("straight")
    Trainer(load_config(data=signal_data(tiny_sd3_path, root, "straight"))).train()
    return weights(root / "runs" / "straight", ITERATIONS)


def test_a_signal_during_a_rollout_abandons_it_saves_the_last_update_and_resumes_exactly(
        tiny_sd3_path, tmp_path, straight):
    """SIGTERM in the middle of iteration 4's rollout (the reward's 7th call of 2 per
    iteration): the rollout is abandoned, checkpoint 3 (the last applied update) is written, the
    run raises Preempted (exit code 143), and --resume latest ends on the uninterrupted weights."""
    reward = {"name": "tests.helpers:SignalOnCall", "options": {"signal": "SIGTERM", "call": 7}}
    data = signal_data(tiny_sd3_path, tmp_path, "stopped", reward)
    run_dir = tmp_path / "runs" / "stopped"
    with pytest.raises(Preempted) as stop:
        Trainer(load_config(data=data)).train()
    assert stop.value.exit_code == 143 and stop.value.signum == signal.SIGTERM
    assert str(stop.value).startswith("stopped by SIGTERM after iteration 3 of 6: checkpoint ")
    assert ckpt.checkpoint_problem(run_dir / "checkpoints" / "3", verify_hashes=True) is None
    assert train_iterations(run_dir / "metrics.jsonl") == [1, 2, 3]
    # The handler is the run's only while it trains.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    data["rewards"]["components"] = [{"name": "tests.helpers:Brightness"}]
    Trainer(load_config(data=data)).train(resume="latest")
    assert train_iterations(run_dir / "metrics.jsonl") == list(range(1, ITERATIONS + 1))
    assert_equal_weights(weights(run_dir, ITERATIONS), straight)


def test_a_signal_during_an_update_lets_it_finish_then_saves_it(tiny_sd3_path, tmp_path,
                                                                 straight, monkeypatch):
    """SIGUSR1 while iteration 3 updates: the update is not cut (a half-applied update could
    not resume exactly); checkpoint 3 holds it, and the resumed run equals the straight one."""
    update = Trainer.update

    def signalled_update(self, batch, advantages, iteration):
        if iteration == 2:   # 0-based: the third
            os.kill(os.getpid(), signal.SIGUSR1)
        return update(self, batch, advantages, iteration)

    monkeypatch.setattr(Trainer, "update", signalled_update)
    data = signal_data(tiny_sd3_path, tmp_path, "stopped")
    run_dir = tmp_path / "runs" / "stopped"
    with pytest.raises(Preempted) as stop:
        Trainer(load_config(data=data)).train()
    assert stop.value.exit_code == 128 + signal.SIGUSR1
    assert "SIGUSR1 after iteration 3 of 6" in str(stop.value)
    assert train_iterations(run_dir / "metrics.jsonl") == [1, 2, 3]
    monkeypatch.setattr(Trainer, "update", update)
    Trainer(load_config(data=data)).train(resume="latest")
    assert_equal_weights(weights(run_dir, ITERATIONS), straight)


def test_a_signal_at_a_checkpoint_does_not_save_it_twice(tiny_sd3_path, tmp_path, monkeypatch):
    """A signal during the save of checkpoint 2: the save finishes, the run stops before
    iteration 3 and names checkpoint 2, written once."""
    save = Trainer.save
    saves: list[int] = []

    def signalled_save(self, iteration, folder=None):
        saves.append(iteration)
        if iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return save(self, iteration, folder)

    monkeypatch.setattr(Trainer, "save", signalled_save)
    data = signal_data(tiny_sd3_path, tmp_path, "stopped")
    with pytest.raises(Preempted, match="after iteration 2 of 6: checkpoint .*/checkpoints/2 "):
        Trainer(load_config(data=data)).train()
    assert saves == [2]


def test_a_signal_left_out_of_save_on_signal_keeps_its_default(tiny_sd3_path, tmp_path):
    """run.save_on_signal without SIGINT: Ctrl-C is Python's KeyboardInterrupt again."""
    # Python's own SIGINT handler, as in a terminal: a test process started in the background
    # by a non-interactive shell inherits SIGINT ignored, and the trainer must keep that too.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _run_plain_with_sigint(tiny_sd3_path, tmp_path)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # left as it was
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_plain_with_sigint(tiny_sd3_path: str, tmp_path: Path) -> None:
    reward = {"name": "tests.helpers:SignalOnCall", "options": {"signal": "SIGINT", "call": 3}}
    data = signal_data(tiny_sd3_path, tmp_path, "plain", reward, save_on_signal=["SIGTERM"])
    with pytest.raises(KeyboardInterrupt):
        Trainer(load_config(data=data)).train()
    assert not (tmp_path / "runs" / "plain" / "checkpoints").exists() or \
        not ckpt.list_checkpoints(tmp_path / "runs" / "plain")


def test_a_second_signal_is_ignored_inside_the_window_and_exits_at_once_after_it(monkeypatch):
    clock = [100.0]
    exits: list[int] = []
    monkeypatch.setattr(interrupts.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(interrupts.os, "_exit", exits.append)
    monkeypatch.setattr(interrupts.os, "write", lambda fd, data: len(data))
    stops = StopSignals(["SIGTERM", "SIGUSR1"], may_abandon=False)
    stops._handle(signal.SIGTERM, None)
    assert stops.received == signal.SIGTERM and exits == []
    clock[0] += DUPLICATE_WINDOW_S / 2   # the launcher forwarding the same request
    stops._handle(signal.SIGTERM, None)
    assert exits == []
    clock[0] += DUPLICATE_WINDOW_S
    stops._handle(signal.SIGUSR1, None)
    assert exits == [128 + signal.SIGUSR1]
    assert stops.received == signal.SIGTERM   # the first one is what the run acts on


def test_abandonable_sections_raise_only_on_one_process():
    one = StopSignals(["SIGTERM"], may_abandon=True)
    with pytest.raises(StopRequested):
        with one.abandonable():
            one._handle(signal.SIGTERM, None)
    with pytest.raises(StopRequested):   # entering after the signal raises at once
        with one.abandonable():
            pass
    several = StopSignals(["SIGTERM"], may_abandon=False)
    with several.abandonable():
        several._handle(signal.SIGTERM, None)   # recorded, not raised: the others must agree
    assert several.received == signal.SIGTERM
    # Outside a section the handler only records, also on one process.
    outside = StopSignals(["SIGTERM"], may_abandon=True)
    outside._handle(signal.SIGTERM, None)
    assert outside.received == signal.SIGTERM


def test_save_on_signal_is_validated():
    with pytest.raises(ValueError, match="run.save_on_signal must be one of"):
        load_config(data={"run": {"save_on_signal": ["SIGKILL"]}})
    with pytest.raises(ValueError, match="names a signal twice"):
        load_config(data={"run": {"save_on_signal": ["SIGTERM", "SIGTERM"]}})


# --------------------------------------------------------------------------- runs that teach nothing

def test_describe_returned_and_constant_value():
    nan, inf = float("nan"), float("inf")
    assert describe_returned(torch.tensor([nan, nan, inf, nan])) == "NaN for 3, +inf for 1 of 4 samples"
    assert describe_returned(torch.tensor([1.0, 2.0])) == "2 finite values"
    assert constant_value(torch.tensor([0.5, 0.5, 0.5])) == 0.5
    assert constant_value(torch.tensor([0.5, 0.25])) is None
    assert constant_value(torch.tensor([nan, nan])) is None
    assert constant_value(torch.tensor([0.5])) is None   # one sample: nothing to compare


def test_a_run_without_any_finite_reward_stops_after_the_configured_iterations(tiny_sd3_path,
                                                                                tmp_path, capsys):
    """All-NaN rewards: the CLI stops after training.max_iterations_without_finite_reward (3)
    iterations with one line naming the reward and what it returned, and exit code 1."""
    from flowgrpo import cli

    data = signal_data(tiny_sd3_path, tmp_path, "dead", {"name": "tests.helpers:AllNaN"},
                       max_iterations=20, checkpoint_every=2)
    data["training"]["max_iterations_without_finite_reward"] = 3
    config = tmp_path / "dead.yaml"
    config.write_text(yaml.safe_dump(data))
    assert cli.main(["train", str(config)]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "it/s]" not in line]
    assert err[-1] == ("flowgrpo train: no sample had a finite reward in the last 3 iterations "
                       "(iterations 1-3): all_nan returned NaN for 8 of 8 samples. Check the "
                       "reward models (a server that is down, inputs they cannot score); the "
                       "checkpoints are kept. training.max_iterations_without_finite_reward "
                       "sets this limit (0 = never stop)")
    run_dir = tmp_path / "runs" / "dead"
    assert train_iterations(run_dir / "metrics.jsonl") == [1, 2, 3]
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["2"]   # kept


def test_a_finite_iteration_resets_the_count(tiny_sd3_path, tmp_path):
    """NaN for the first sample of each call (NaNForFirst) is not 'no finite reward': the run
    with the limit at 1 finishes."""
    data = signal_data(tiny_sd3_path, tmp_path, "partial", {"name": "tests.helpers:NaNForFirst"},
                       max_iterations=2, checkpoint_every=0)
    data["training"]["max_iterations_without_finite_reward"] = 1
    history = Trainer(load_config(data=data)).train()
    assert [r["iteration"] for r in history if r["phase"] == "train"] == [1, 2]


@pytest.mark.parametrize("action", ["warn", "stop"])
def test_a_constant_reward_warns_once_or_stops(tiny_sd3_path, tmp_path, action):
    reward = {"name": "tests.helpers:Constant", "options": {"value": 0.25}}
    data = signal_data(tiny_sd3_path, tmp_path, action, reward, max_iterations=4,
                       checkpoint_every=0)
    data["training"].update(on_constant_reward=action, constant_reward_iterations=2)
    trainer = Trainer(load_config(data=data))
    expected = ("reward constant gave every sample the value 0.25 in each of the last 2 "
                "iterations (1-2): its advantages are all zero")
    if action == "stop":
        with pytest.raises(ConstantRewardError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            trainer.train()
        return
    with pytest.warns(RuntimeWarning) as caught:
        trainer.train()
    messages = [str(w.message) for w in caught if "gave every sample" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith(expected)   # once per streak


# --------------------------------------------------------------------------- from outside (slow)

def _start(config: Path, log: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "flowgrpo", "train", str(config), *args],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=out)


def _wait_for_train_record(metrics: Path, iteration: int, process: subprocess.Popen) -> None:
    end = time.monotonic() + 120
    while time.monotonic() < end and process.poll() is None:
        if metrics.exists() and any(i >= iteration for i in train_iterations_safe(metrics)):
            return
        time.sleep(0.01)
    raise AssertionError(f"iteration {iteration} never logged (exit {process.poll()})")


def train_iterations_safe(metrics: Path) -> list[int]:
    out = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:   # a line being written
            continue
        if record.get("phase") == "train":
            out.append(record["iteration"])
    return out


def _lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines()
            if line.strip() and "it/s]" not in line and "s/it]" not in line]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_flowgrpo_train_stops_on_a_signal_from_outside_and_resumes_exactly(
        tiny_sd3_path, tmp_path, straight, name):
    """`flowgrpo train` sent a signal after iteration 3 (between checkpoints 2 and 4): exit within
    60 s with 128 + the signal's number, no traceback, one line naming the signal and a complete
    checkpoint; --resume latest then ends on the uninterrupted run's weights. About 25 s each."""
    data = signal_data(tiny_sd3_path, tmp_path, "outside", max_iterations=ITERATIONS)
    config = tmp_path / "outside.yaml"
    config.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "runs" / "outside"
    log = tmp_path / "train.log"
    process = _start(config, log)
    _wait_for_train_record(run_dir / "metrics.jsonl", 3, process)
    signum = getattr(signal, name)
    sent = time.monotonic()
    process.send_signal(signum)
    assert process.wait(timeout=60) == 128 + signum, log.read_text()[-3000:]
    assert time.monotonic() - sent < 60
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    last = _lines(log)[-1]
    assert last.startswith(f"flowgrpo train: stopped by {name} after iteration "), last
    stopped_at = int(last.split("after iteration ")[1].split()[0])
    assert 3 <= stopped_at < ITERATIONS
    assert f"checkpoints/{stopped_at} is complete" in last
    assert ckpt.checkpoint_problem(run_dir / "checkpoints" / str(stopped_at),
                                   verify_hashes=True) is None
    assert _start(config, log, "--resume", "latest").wait(timeout=300) == 0, \
        log.read_text()[-3000:]
    assert train_iterations(run_dir / "metrics.jsonl") == list(range(1, ITERATIONS + 1))
    assert_equal_weights(weights(run_dir, ITERATIONS), straight)


@pytest.mark.slow
def test_one_signal_to_one_of_two_processes_stops_both_at_the_same_iteration(tiny_sd3_path,
                                                                             tmp_path):
    """accelerate launch, 2 CPU processes (gloo): SIGUSR1 reaches only rank 1, during its
    rollout of iteration 3. Both processes agree at the next safe point (after that iteration's
    update), save checkpoint 3 together, the main process prints the one line, both exit 138,
    and neither is left waiting in a collective."""
    # 8 samples over 2 processes, rollout batches of 4: 1 reward call per iteration each.
    reward = {"name": "tests.helpers:SignalOnCall",
              "options": {"signal": "SIGUSR1", "call": 3, "rank": 1}}
    data = signal_data(tiny_sd3_path, tmp_path, "two", reward)
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "ACCELERATE_USE_CPU": "true"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
           "2", "--num_machines", "1", "--main_process_port", str(free_port()),
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "flowgrpo", "train",
           str(config)]
    began = time.monotonic()
    result = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert time.monotonic() - began < 240
    errors = errors_of(result)
    assert result.returncode != 0, errors[-3000:]
    run_dir = tmp_path / "runs" / "two"
    # The signal came in iteration 3's rollout on rank 1; rank 0 learns of it at the next safe
    # point, after iteration 3's update: both stop there.
    lines = [line for line in errors.splitlines() if "flowgrpo train: stopped by" in line]
    assert len(lines) == 1, errors[-3000:]
    assert "stopped by SIGUSR1 after iteration 3 of 6" in lines[0]
    assert "exitcode  : 138" in errors or "exit code 138" in errors
    assert ckpt.checkpoint_problem(run_dir / "checkpoints" / "3", verify_hashes=True) is None
    assert train_iterations(run_dir / "metrics.jsonl") == [1, 2, 3]


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.mark.slow
def test_slurm_train_sh_forwards_usr1_requeues_and_the_requeued_job_resumes(tiny_sd3_path,
                                                                            tmp_path):
    """scripts/slurm_train.sh under stand-ins for srun, scontrol, scancel and accelerate (no
    Slurm here): USR1 to the batch script is passed to the training process (not to the
    launcher stand-ins, which ignore it), the run saves and exits 138, the script requeues the
    job and exits 0; the requeued job (SLURM_RESTART_COUNT=1) resumes with --resume latest and
    finishes. What real Slurm adds (the signal's timing, delivery to every process of a step)
    is not run here."""
    data = signal_data(tiny_sd3_path, tmp_path, "slurm")
    config = tmp_path / "slurm.yaml"
    config.write_text(yaml.safe_dump(data))
    stubs = tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "calls.log"
    _stub(stubs, "scontrol", f'case "$1" in show) echo localhost;; *) echo "scontrol $*" >> {calls};; esac\n')
    # Slurm signals every process of the job step; the stand-in signals every process whose
    # command line names this test's config (the launcher stand-ins included).
    _stub(stubs, "scancel", f'echo "scancel $*" >> {calls}\npkill -USR1 -f -- "{config}" || true\n')
    _stub(stubs, "srun", 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    _stub(stubs, "accelerate", f'while [[ "$1" != -m ]]; do shift; done\nexec {sys.executable} "$@"\n')
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", PYTHONPATH=str(REPO),
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               SLURM_JOB_NODELIST="node1", SLURM_JOB_ID="4242", SLURM_NNODES="1",
               SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(REPO), GPUS_PER_NODE="1")
    env.pop("RESUME", None)
    log = tmp_path / "job.log"
    run_dir = tmp_path / "runs" / "slurm"
    with open(log, "ab") as out:
        job = subprocess.Popen(["bash", "scripts/slurm_train.sh", str(config)], cwd=REPO,
                               env=env, stdout=out, stderr=out)
    _wait_for_train_record(run_dir / "metrics.jsonl", 3, job)
    job.send_signal(signal.SIGUSR1)
    assert job.wait(timeout=60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "requeueing job 4242" in text and "stopped by SIGUSR1 after iteration" in text, text[-3000:]
    assert calls.read_text().splitlines() == ["scancel --signal=USR1 4242", "scontrol requeue 4242"]
    stopped = ckpt.list_checkpoints(run_dir)[-1]
    assert 3 <= int(stopped.name) < ITERATIONS
    with open(log, "ab") as out:
        requeued = subprocess.run(["bash", "scripts/slurm_train.sh", str(config)], cwd=REPO,
                                  env={**env, "SLURM_RESTART_COUNT": "1"}, stdout=out, stderr=out,
                                  timeout=300)
    assert requeued.returncode == 0, log.read_text()[-3000:]
    starts = [line for line in log.read_text().splitlines() if "rank 0 on" in line]
    assert [line.rsplit(" ", 1)[-1] for line in starts] == ["auto", "latest"]
    assert train_iterations(run_dir / "metrics.jsonl") == list(range(1, ITERATIONS + 1))
