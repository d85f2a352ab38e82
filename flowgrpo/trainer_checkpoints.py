"""The trainer's checkpoints and run folder: saving (numbered checkpoints and ``best``), opening a
run folder (refuse, resume, overwrite), resuming (weights, optimiser, EMA, RNG, the KL
reference, the curriculum and the best record) and reconciling ``checkpoints/best/`` with a
resumed iteration. The file format is ``flowgrpo/checkpoint.py``'s.

``TrainerCheckpoints`` is a part of ``flowgrpo.trainer.Trainer``; it uses the trainer's
``config``, ``accelerator``, ``run_dir``, ``policy``, ``trainable``, ``optimizer``, ``ema``,
``engine``, ``sharded``, ``engine_module``, ``curriculum``, ``best``, ``_run`` / ``_lock`` and its
``main_only`` / ``ema_weights`` / ``check_replicas``.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowgrpo import checkpoint as ckpt
from flowgrpo.config import json_roundtrip, resume_signature
from flowgrpo.engines import local_shard
from flowgrpo.errors import InputError
from flowgrpo.run_folder import open_run, set_aside


# Engines whose weights and optimiser state a checkpoint holds in the engine's own format
# (``engine/``, written by ``accelerator.save_state``).
ENGINES_WITH_OWN_STATE = ("fsdp", "deepspeed")


class TrainerCheckpoints:
    """The checkpoint half of ``Trainer`` (see the module docstring)."""

    def save(self, iteration: int, folder: str | None = None) -> Path:
        """checkpoints/<iteration>/: exact-resume state (safetensors) and the user-facing weights
        (LoRA in the ecosystem's format, or the full model), EMA weights when EMA is on. Under
        FSDP and DeepSpeed the engine's own (partitioned) state goes to ``engine/`` and the
        user-facing weights are consolidated on the main process. ``folder``: another name than the
        iteration (``best``: the best evaluation's, never pruned, with ``best.json`` beside it)."""
        name = folder or str(iteration)
        directory = self.run_dir / "checkpoints" / name
        tensors = dict(self.trainable)
        if self.ema is not None:
            tensors.update({f"ema:{n}": v for n, v in self.ema.state_dict().items()})
        # Under FSDP2 each process checks its own shard; every process must then refuse together
        # (the others would wait in the collective save below).
        bad = [n for n, p in tensors.items() if not bool(torch.isfinite(local_shard(p)).all())]
        bad_anywhere = len(bad)
        if self.sharded and self.accelerator.num_processes > 1:
            counts = torch.tensor([len(bad)], device=self.accelerator.device)
            bad_anywhere = int(self.accelerator.gather(counts).sum())
        if bad_anywhere:
            first = f"first: {bad[0]}" if bad else "on another process"
            raise FloatingPointError(f"not saving iteration {iteration}: {bad_anywhere} trainable "
                                     f"or EMA tensors hold non-finite values ({first}); "
                                     f"the previous checkpoint is kept")
        consolidated = None
        # FSDP and every DeepSpeed stage keep the optimiser state partitioned in their own
        # format (ZeRO-2's optimiser state dict has no per-parameter "state" to flatten): the
        # engine saves it, and the published weights come from its consolidated state dict.
        engine_state = self.engine in ENGINES_WITH_OWN_STATE
        if engine_state:
            # Collective: every process writes its shard and takes part in the consolidation.
            self.accelerator.save_state(str(self.run_dir / "checkpoints" /
                                            f"{ckpt.ENGINE_PREFIX}{name}"))
            consolidated = self.accelerator.get_state_dict(self.engine_module)

        def write() -> None:
            def save_weights(folder: str) -> None:
                with self.ema_weights():   # the published weights are the EMA weights
                    self.policy.save_weights(folder, consolidated)

            extra = {"name": self.config.name, "family": self.config.model.family,
                     "policy": self.config.policy, "engine": self.engine,
                     # run_id: --resume latest continues only this run's checkpoints;
                     # signature: what a resume must not change (config.resume_signature).
                     "run_id": self._run["run_id"] if self._run else None,
                     "signature": json_roundtrip(resume_signature(self.config))}
            if self.curriculum is not None:
                extra["curriculum"] = self.curriculum.state_dict()
            if self.best is not None:
                extra["best"] = self.best.state_dict()
            if self.accelerator.scaler is not None:
                extra["grad_scaler"] = self.accelerator.scaler.state_dict()
            tensor_files = {}
            algorithm_state, algorithm_tensors = self.policy.algorithm_state()
            if algorithm_state or algorithm_tensors:
                extra["algorithm"] = {"name": self.config.training.algorithm,
                                      "state": algorithm_state}
                if algorithm_tensors:
                    tensor_files[ckpt.ALGORITHM] = algorithm_tensors
            if self.config.training.gardo.refresh:
                extra["reference_refreshed_at"] = self.reference_refreshed_at
                if self.reference_refreshed_at is not None:
                    tensor_files[ckpt.REFERENCE] = self.policy.reference_state()
            ckpt.save_checkpoint(
                directory, iteration=iteration,
                trainable={} if engine_state else self.trainable,
                optimizer=None if engine_state else self.optimizer,
                ema_state=self.ema.state_dict() if self.ema else None,
                ema_counters=self.ema.counters() if self.ema else None, save_lora=save_weights,
                extra=extra,
                # inside the folder before its completion marker, so the marker covers it
                engine_dir=(self.run_dir / "checkpoints" / f"{ckpt.ENGINE_PREFIX}{name}"
                            if engine_state else None),
                tensor_files=tensor_files)
            if folder == ckpt.BEST:
                ckpt.write_json_atomic(self.run_dir / "checkpoints" / ckpt.BEST_RECORD,
                                       self.best.state_dict())
            elif folder is None:
                ckpt.prune_checkpoints(self.run_dir, self.config.run.keep_checkpoints)

        self.main_only(f"checkpoint {name}", write)
        return directory

    def open_run(self, resume: str | None, overwrite: bool) -> None:
        """Decide how the run starts (``run_folder.open_run``: refuse a used folder without
        --resume / --overwrite, find the checkpoint, check its run id and signature, sweep what
        a crash left, write run.json) on the main process under the run folder's lock, and hand
        the decision to every process, so that all continue from the same checkpoint even where
        the run folder is not on a shared filesystem."""
        if self._run is not None:
            if (resume, bool(overwrite)) != self._opened_with:
                raise InputError(f"the run folder was opened with resume={self._opened_with[0]!r}"
                                 f", overwrite={self._opened_with[1]}; give resume/overwrite to "
                                 f"Trainer(...) or to train(), not different values to both")
            return
        signature = json_roundtrip(resume_signature(self.config))

        def work() -> dict:
            self._lock.acquire()
            try:
                return open_run(self.run_dir, resume=resume, overwrite=bool(overwrite),
                                     signature=signature, name=self.config.name)
            except BaseException:
                self._lock.release()
                raise

        self._run = self.main_only("checking the run folder", work)
        self._opened_with = (resume, bool(overwrite))
        if self.accelerator.is_main_process:
            for note in ([self._lock.note] if self._lock.note else []) + self._run["notes"]:
                print(f"{self.run_dir}: {note}", flush=True)

    def resume(self, checkpoint: str | Path) -> None:
        """Load ``checkpoint`` into every process: a folder (``train`` passes the one
        ``open_run`` chose and checked), or "latest" / "auto" resolved on the main process."""
        if str(checkpoint) in ("latest", "auto"):
            found = self.main_only("resume", lambda: ckpt.resolve_resume(str(checkpoint),
                                                                         self.run_dir))
            if found is None:
                return
            checkpoint = found
        path = Path(checkpoint)
        engine_state = self.engine in ENGINES_WITH_OWN_STATE
        state = ckpt.load_checkpoint(path, require_trainable=not engine_state)
        saved_engine = state["state"].get("engine", "single")
        if engine_state or saved_engine in ENGINES_WITH_OWN_STATE:
            if saved_engine != self.engine:
                raise ValueError(f"checkpoint {path} was written under {saved_engine}; resume it "
                                 f"under the same engine (this run: {self.engine})")
            self.accelerator.load_state(str(path / "engine"))
        else:
            missing = set(self.trainable) - set(state["trainable"])
            if missing:
                raise ValueError(f"checkpoint {path} does not match this model/LoRA config: "
                                 f"{len(missing)} trainable tensors missing (e.g. "
                                 f"{sorted(missing)[0]})")
            with torch.no_grad():
                for name, param in self.trainable.items():
                    param.copy_(state["trainable"][name])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load(state["ema"], state["state"]["ema"])
        if self.accelerator.scaler is not None and "grad_scaler" in state["state"]:
            self.accelerator.scaler.load_state_dict(state["state"]["grad_scaler"])
        torch.set_rng_state(state["rng"])
        self.start_iteration = int(state["state"]["iteration"])
        if self.config.training.gardo.refresh:
            self.resume_reference(path, state["state"])
        self.resume_algorithm(path, state["state"])
        if self.best is not None:
            self.restore_best(state["state"].get("best"))
        if self.curriculum is not None:
            if "curriculum" in state["state"]:
                self.curriculum.load_state_dict(state["state"]["curriculum"])
            else:
                print(f"checkpoint {path} has no curriculum state (saved without "
                      f"prompts.curriculum): the curriculum starts from its prior", flush=True)
        self.check_replicas(f"resuming from {path}")

    def resume_algorithm(self, path: Path, state: dict) -> None:
        """The training algorithm's state of checkpoint ``path`` (the old policy of nft / dgpo
        and its optimiser-step count), when the algorithm keeps any."""
        expected, _ = self.policy.algorithm_state()
        saved = state.get("algorithm")
        if saved is None:
            if expected and self.accelerator.is_main_process:
                print(f"checkpoint {path} has no {self.config.training.algorithm} state: its old "
                      f"policy starts as the resumed weights", flush=True)
            return
        if saved["name"] != self.config.training.algorithm:
            raise InputError(f"checkpoint {path} was trained with training.algorithm "
                             f"{saved['name']!r}, the config says "
                             f"{self.config.training.algorithm!r}: resume with the same algorithm")
        tensors = load_file(str(path / ckpt.ALGORITHM)) if (path / ckpt.ALGORITHM).is_file() \
            else {}
        self.policy.load_algorithm_state(saved["state"], tensors)

    def resume_reference(self, path: Path, state: dict) -> None:
        """The refreshed KL reference of checkpoint ``path`` (training.gardo.refresh_every /
        refresh_kl): its weights and the iteration they were taken at."""
        if "reference_refreshed_at" not in state:
            if self.accelerator.is_main_process:
                print(f"checkpoint {path} has no KL reference state (saved without "
                      f"training.gardo.refresh_every / refresh_kl): the reference is the "
                      f"initial model until the next refresh", flush=True)
            return
        at = state["reference_refreshed_at"]
        self.reference_refreshed_at = None if at is None else int(at)
        if at is not None:
            if not (path / ckpt.REFERENCE).is_file():
                raise InputError(f"checkpoint {path} says the KL reference was refreshed at "
                                 f"iteration {at} but has no {ckpt.REFERENCE}; resume from "
                                 f"another checkpoint")
            self.policy.load_reference_state(load_file(str(path / ckpt.REFERENCE)))

    def restore_best(self, saved: dict | None) -> None:
        """After loading a checkpoint: take over its record of the best evaluation (same
        run.select_best_on and mode), and make checkpoints/best/ agree with it. A best folder
        written after the resumed iteration belongs to the continuation being replaced: it is
        set aside under checkpoints/superseded-*/ (as later numbered checkpoints are)."""
        restored = self.best.load_state_dict(saved)

        def reconcile() -> None:
            notes = []
            if saved and not restored:
                notes.append(f"the checkpoint's best record is for {saved.get('key')!r} "
                             f"({saved.get('mode')}); run.select_best_on is now "
                             f"{self.best.key!r} ({self.best.mode}): its best starts afresh")
            folder = self.run_dir / "checkpoints" / ckpt.BEST
            if folder.is_dir():
                held = int(ckpt.read_state(folder)["iteration"])
                if held > self.start_iteration:
                    moved = set_aside(self.run_dir, ckpt.BEST)
                    record = self.run_dir / "checkpoints" / ckpt.BEST_RECORD
                    if record.is_file():
                        os.replace(record, moved.parent / ckpt.BEST_RECORD)
                    notes.append(f"checkpoints/best (iteration {held}) came after the resumed "
                                 f"iteration {self.start_iteration}: moved to {moved}")
                    if restored and self.best.iteration is not None:
                        notes.append(f"the best so far stays iteration {self.best.iteration} "
                                     f"({self.best.key} {self.best.value:.4g}); its weights "
                                     f"are saved again at the next new best")
                elif restored and held == self.best.iteration:
                    ckpt.write_json_atomic(self.run_dir / "checkpoints" / ckpt.BEST_RECORD,
                                           self.best.state_dict())
            for note in notes:
                print(f"{self.run_dir}: {note}", flush=True)

        self.main_only("reconciling checkpoints/best", reconcile)
