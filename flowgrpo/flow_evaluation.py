"""The flow policy's evaluation: deterministic samples of the held-out prompts from the run's
evaluation noise, scored by the training rewards and ``eval.rewards`` (means, standard errors,
per family and their mean), and the before/after comparison grid.

``FlowEvaluation`` is a part of ``flowgrpo.flow_policy.FlowPolicy``; it uses the policy's
``config``, ``accelerator``, ``model``, ``reward`` and ``eval_reward``.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from flowgrpo import grids
from flowgrpo.config import eval_noise_seed
from flowgrpo.eval_media import save_eval_media
from flowgrpo.heldout import score_eval_rewards
from flowgrpo.passk import family_mean_se, mean_and_se
from flowgrpo.policy import eval_share, gather_rows
from flowgrpo.prompts import eval_selection, record_images, reward_metadata
from flowgrpo.rollout import eval_noise, sample_ode


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


class FlowEvaluation:
    """The evaluation half of ``FlowPolicy`` (see the module docstring)."""

    def eval_noise(self, indices) -> Tensor:
        """Initial noise of evaluation samples ``indices`` (an int n: samples 0..n-1), seeded by
        (eval seed, "eval", i) (``config.eval_noise_seed``: prompts.eval_seed, else run.seed): the
        same at every evaluation of the run and in ``flowgrpo eval``."""
        indices = range(indices) if isinstance(indices, int) else indices
        return eval_noise(self.model, eval_noise_seed(self.config), indices)

    def _sample(self, prompts: list[str], indices, batch_size: int | None = None,
                images: list[Tensor] | None = None) -> Tensor:
        """Deterministic samples of ``prompts`` (with their source ``images`` when editing) from
        the evaluation noise of ``indices``."""
        s = self.config.sampling
        guidance = s.guidance_scale if s.eval_guidance_scale is None else s.eval_guidance_scale
        with torch.no_grad(), self.accelerator.autocast():
            return sample_ode(self.model, prompts, self.eval_noise(indices), s.eval_num_steps,
                              guidance, **({"batch_size": batch_size} if batch_size else {}),
                              images=images)

    def evaluate(self, records: list[dict], iteration: int, out_dir: Path | None
                 ) -> dict[str, float]:
        """Deterministic-sampler rewards on the held-out prompts (``eval_selection``): the mean of
        every component with its standard error, per task family and their mean (GenEval's
        overall score). Every process samples and scores its share of the rows
        (``eval_share``; sample i keeps its noise whatever the process count) and every process
        returns the metrics of all rows. The held-out metrics of ``eval.rewards`` score the same
        samples and get the same statistics. Saves the first 64 samples to
        ``out_dir/eval_<iteration>.png`` (videos: a strip of frames and a GIF,
        ``eval_media.save_eval_media``) when ``out_dir`` is given."""
        p = self.config.prompts
        acc = self.accelerator
        records = eval_selection(records, p.eval_per_family, p.eval_seeds)
        if not records:
            return {}
        indices, real = eval_share(len(records), acc.num_processes, acc.process_index)
        media = self._sample([records[i]["prompt"] for i in indices], indices,
                             max(self.config.sampling.rollout_batch_size, 16),
                             record_images([records[i] for i in indices]))[:real]
        mine = indices[:real]
        prompts = [records[i]["prompt"] for i in mine]
        scored = reward_metadata([records[i] for i in mine])
        local = self.reward(media, prompts, scored) if real else {}
        # Held-out metrics score the same samples (eval.rewards: logged, never trained on).
        local.update(score_eval_rewards(self.eval_reward, media, prompts, scored, acc.device))
        rows = gather_rows([{k: float(v[j]) for k, v in local.items()} for j in range(real)], acc)
        keep = [j for j, i in enumerate(mine) if i < 64]
        shown = gather_rows([media[j] for j in keep], acc)   # a collective: every process
        scores = {k: torch.tensor([row[k] for row in rows]) for k in rows[0]} if rows else {}
        metadata = [r["metadata"] for r in records]
        metrics: dict[str, float] = {}
        families = sorted({str(m.get("family")) for m in metadata if m.get("family")})
        for name, values in scores.items():
            valid = values[~values.isnan()]
            metrics[f"eval/{name}"] = float(valid.mean()) if len(valid) else float("nan")
            metrics[f"eval/{name}/se"] = mean_and_se(valid)[1]
            per_family, per_family_se = [], []
            for family in families:
                mask = torch.tensor([m.get("family") == family for m in metadata]) & ~values.isnan()
                if mask.any():
                    metrics[f"eval/{name}/{family}"] = float(values[mask].mean())
                    metrics[f"eval/{name}/{family}/se"] = mean_and_se(values[mask])[1]
                    per_family.append(metrics[f"eval/{name}/{family}"])
                    per_family_se.append(metrics[f"eval/{name}/{family}/se"])
            if per_family:
                metrics[f"eval/{name}/family_mean"] = _mean(per_family)
                metrics[f"eval/{name}/family_mean/se"] = family_mean_se(per_family_se)
        if out_dir is not None and shown:
            save_eval_media(torch.stack(shown), out_dir, iteration)
        return metrics

    def save_grid_samples(self, records: list[dict], run_dir: Path, tag: str) -> None:
        """Deterministic samples of the grid prompts as ``grid_<tag>.safetensors`` (survives a
        resume, so the final grid compares with the run's true base)."""
        if records:
            media = self._sample([r["prompt"] for r in records], range(len(records)),
                                 images=record_images(records))
            save_file({"media": media.contiguous()}, str(run_dir / f"grid_{tag}.safetensors"))

    def write_comparison_grid(self, records: list[dict], run_dir: Path, final_label: str
                              ) -> Path | None:
        """``run_dir/comparison.png``: rows = held-out prompts, columns = base and final model from
        the same noise, each cell captioned with the verifier's verdict (PASS / FAIL for a reward
        whose scores are all 0 or 1) and the score of each reward."""
        base_path = run_dir / "grid_base.safetensors"
        if not base_path.is_file() or not records:
            return None
        self.save_grid_samples(records, run_dir, "final")
        base = load_file(str(base_path))["media"]
        final = load_file(str(run_dir / "grid_final.safetensors"))["media"]
        if base.dim() != 4:
            return None   # video runs: use `flowgrpo grid` for MP4 grids
        prompts = [r["prompt"] for r in records]
        metadata = reward_metadata(records)
        scores = [self.reward(m, prompts, metadata) for m in (base, final)]
        weights = self.reward.weights
        verdicts = grids.verdict_keys(scores, weights)
        images = torch.stack([base, final], dim=1)
        labels = [[grids.cell_caption(scores[c], weights, r, verdict=verdicts) for c in range(2)]
                  for r in range(len(records))]
        columns = ["base", final_label]
        sources = record_images(records)
        if sources is not None:
            # Editing: the source image is the first column, so each edit reads left to right.
            images = grids.with_source_column(images, sources)
            labels = [["source"] + row for row in labels]
            columns = ["source"] + columns
        rows = [f"{r['prompt']}\n({r['metadata']['family']})" if r["metadata"].get("family")
                else r["prompt"] for r in records]
        grid = grids.image_grid(images, row_labels=rows, col_labels=columns, cell_labels=labels)
        path = run_dir / "comparison.png"
        grid.save(path)
        return path
