"""The trainer's evaluations and what a run reports: held-out metrics with the EMA weights, the
before/after comparison grid, ``metrics.jsonl`` and the tracker, the evaluation's console line,
``curves.png`` and samples, the best evaluation, and the end-of-run summary.

``TrainerEvaluation`` is a part of ``flowgrpo.trainer.Trainer``; it uses the trainer's
``config``, ``accelerator``, ``run_dir``, ``policy``, ``eval_records``, ``tracker``,
``directions``, ``heldout_keys``, ``best``, ``stopped_early``, ``history`` and its
``main_only`` / ``everywhere`` / ``ema_weights`` / ``save``.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowgrpo import checkpoint as ckpt
from flowgrpo import curves
from flowgrpo.eval_media import log_eval_media
from flowgrpo.prompts import comparison_prompts
from flowgrpo.run_log import append_record, eval_line, read_records, summary_line


class TrainerEvaluation:
    """The evaluation and reporting half of ``Trainer`` (see the module docstring)."""

    def evaluate(self, iteration: int, save_images: bool = True) -> dict[str, float]:
        """The policy's held-out metrics with the EMA weights (when EMA is on)."""
        if not self.eval_records:
            return {}
        out = self.run_dir / "samples" if save_images and self.accelerator.is_main_process \
            else None
        with torch.no_grad(), self.ema_weights():
            return self.policy.evaluate(self.eval_records, iteration, out)

    GRID_ROWS = 12          # rows of the grid when the eval prompts have no families
    GRID_PER_FAMILY = 2     # rows per family otherwise

    def grid_records(self) -> list[dict]:
        """Held-out prompts of the before/after grid, chosen without looking at any result: the
        first two eval prompts of each family in the eval source's order (else the first 12)."""
        return comparison_prompts(self.eval_records, self.GRID_PER_FAMILY, self.GRID_ROWS)

    def save_grid_samples(self, tag: str) -> None:
        with torch.no_grad(), self.ema_weights():
            self.policy.save_grid_samples(self.grid_records(), self.run_dir, tag)

    def write_comparison_grid(self) -> Path | None:
        """The policy's base-vs-final comparison (``comparison.png`` / ``comparison.md``)."""
        final = self.stopped_early or self.config.run.max_iterations
        with torch.no_grad(), self.ema_weights():
            return self.policy.write_comparison_grid(
                self.grid_records(), self.run_dir, f"iteration {final}")

    def log(self, record: dict) -> None:
        self.history.append(record)
        if self.accelerator.is_main_process:
            append_record(self.run_dir / ckpt.METRICS, record)
            if self.tracker != "none":
                scalars = {k: v for k, v in record.items()
                           if isinstance(v, (int, float)) and k != "iteration"}
                self.accelerator.log(scalars, step=record["iteration"])

    def eval_and_log(self, iteration: int) -> None:
        """Evaluate -> log (metrics.jsonl, tracker scalars) -> print a line, redraw curves.png,
        send the samples to the tracker -> keep checkpoints/best/ when run.select_best_on
        improved (every process decides alike: the metrics are gathered)."""
        # Every process evaluates its share of the held-out rows (the policy gathers them).
        metrics = self.everywhere(f"evaluation at {iteration}", lambda: self.evaluate(iteration))
        record = {"iteration": iteration, "phase": "eval", **(metrics or {})}
        self.log(record)
        if metrics:
            self.main_only(f"curves and samples of evaluation {iteration}",
                           lambda: self.report_evaluation(iteration, record))
        if self.best is not None and metrics and self.best.observe(iteration, metrics):
            self.save(iteration, folder=ckpt.BEST)

    def report_evaluation(self, iteration: int, record: dict) -> None:
        """Main process: the evaluation's line on the console, ``curves.png`` redrawn from the
        whole metrics log, the evaluation samples to the tracker."""
        tqdm.write(eval_line(iteration, record, self.directions, self.heldout_keys))
        curves.write_curves(read_records(self.run_dir / ckpt.METRICS),
                            self.run_dir / curves.CURVES, self.directions, self.heldout_keys)
        if self.tracker != "none":
            log_eval_media(self.accelerator, self.tracker, self.run_dir / "samples", iteration)

    def print_summary(self, seconds: float) -> None:
        print(summary_line(self.config.name, self.history, seconds, self.run_dir,
                           directions=self.directions, heldout=self.heldout_keys,
                           best=self.best.state_dict() if self.best is not None else None,
                           stopped_early=self.stopped_early,
                           patience=self.config.run.early_stop_patience), flush=True)
