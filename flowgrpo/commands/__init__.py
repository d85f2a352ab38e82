"""``flowgrpo sample | eval | grid``: look at and score a model and its trained checkpoints;
``flowgrpo configs``: list the built-in configs (``configs.py``); ``flowgrpo fetch-prompts``:
download the anchors' prompt sets (``fetch_prompts.py``).

* ``sample``: deterministic (Euler ODE) samples per prompt and seed, as PNG (images) or MP4 + GIF
  (videos), optionally with a trainer checkpoint applied (``--lora CKPT``).
* ``eval``: reward statistics (mean, std, standard error) per component and per prompt family
  (``metadata["family"]``), written as JSON and printed as a table; from a training CONFIG or
  from flags. ``--samples-per-prompt K`` adds pass@k diagnostics (``flowgrpo.passk``).
* ``grid``: rows = prompts x seeds, columns = the base model and each checkpoint, the same noise
  along a row, every cell labelled with its reward; paged into several files when large.

The noise of seed s is ``model.initial_noise(1, torch.Generator().manual_seed(s))``, so a seed
gives the same picture in ``sample``, ``grid`` and ``eval --seeds``. A checkpoint is a folder with
``pytorch_lora_weights.safetensors`` (diffusers/PEFT LoRA, as ``Trainer.save`` writes) or
``transformer/`` (full fine-tune), or a run folder (its newest checkpoint), or ``base``.

One module per command (``sample.py``, ``evaluate.py``, ``grid.py``) and what they share
(``common.py``: argument parsing and sampling helpers); resolving and checking the checkpoints a
user names is ``flowgrpo/checkpoint_inspection.py``. This module builds the parsers.

Every argument is checked before any model loads: missing or mismatched checkpoints (LoRA modules
or shapes that the model's transformer lacks, a run trained on another family), empty prompt
files and unwritable outputs raise ValueError / FileNotFoundError, which ``flowgrpo.cli.main``
prints as one line with exit status 2.
"""
from __future__ import annotations

import argparse

from flowgrpo.commands.evaluate import run_eval
from flowgrpo.commands.grid import run_grid
from flowgrpo.commands.common import FALLBACK_SAMPLING, SAMPLING_DEFAULTS
from flowgrpo.commands.configs import add_configs_parser
from flowgrpo.commands.fetch_prompts import add_fetch_prompts_parser
from flowgrpo.commands.sample import run_sample
from flowgrpo.dtypes import DTYPE_NAMES
from pipelines import MODEL_FAMILIES


# ================================================================================ parsers
def _add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--model", required=required, metavar="FAMILY:PATH",
                        help=f"model family ({', '.join(MODEL_FAMILIES)}) and hub id or local "
                             f"folder, e.g. sd3:stabilityai/stable-diffusion-3.5-medium")
    parser.add_argument("--options", nargs="*", metavar="KEY=VALUE",
                        help="family options, e.g. height=512 width=512 (see pipelines/<family>.py)")
    steps, guidance = (", ".join(f"{family} {value[i]:g}"
                                 for family, value in SAMPLING_DEFAULTS.items()) for i in (0, 1))
    parser.add_argument("--steps", type=int, default=None,
                        help=f"ODE (Euler) steps; default: the family's evaluation setting "
                             f"({steps}; toy: its toy_config.json; others "
                             f"{FALLBACK_SAMPLING[0]})")
    parser.add_argument("--guidance", type=float, default=None,
                        help=f"CFG scale (FLUX: guidance embedding); default: the family's "
                             f"({guidance}; toy: its toy_config.json; others "
                             f"{FALLBACK_SAMPLING[1]:g})")
    parser.add_argument("--batch-size", type=int, default=None if not required else 8,
                        help="samples per transformer call")
    parser.add_argument("--device", default="auto",
                        help="torch device (default auto: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None if not required else "float32",
                        choices=DTYPE_NAMES, help="transformer dtype (default float32)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_commands(subparsers) -> None:
    """Register ``sample``, ``eval``, ``grid`` and ``configs`` on the ``flowgrpo`` sub-command
    parser."""
    sample = subparsers.add_parser(
        "sample", help="deterministic samples per prompt and seed (PNG, or MP4 + GIF for video)",
        description="Sample with the deterministic Euler ODE sampler; the noise of seed s is "
                    "model.initial_noise(1, torch.Generator().manual_seed(s)).")
    _add_model_arguments(sample)
    sample.add_argument("--lora", default=None, metavar="CKPT",
                        help="trainer checkpoint to apply (LoRA or full fine-tune) or a run folder")
    sample.add_argument("--prompts", required=True,
                        help="prompt file (.txt / .jsonl), toy:<split>, or the prompt itself")
    sample.add_argument("--seeds", nargs="+", default=["0"],
                        help="e.g. 0 1 2, 0,1,2 or 0-3 (default 0)")
    sample.add_argument("--fps", type=float, default=8.0, help="frames per second of videos")
    sample.add_argument("--out", required=True, help="output folder")
    sample.set_defaults(handler=run_sample)

    evaluate = subparsers.add_parser(
        "eval", help="reward statistics per component and prompt family (JSON + table)",
        description="Score deterministic samples. With CONFIG, the model, rewards, eval prompts, "
                    "steps, guidance and noise are the training run's evaluation settings (so "
                    "the numbers match its eval/ metrics); flags override them.")
    evaluate.add_argument("config", nargs="?", help="training YAML config")
    evaluate.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    _add_model_arguments(evaluate, required=False)
    evaluate.add_argument("--rewards", default=None,
                          help="reward specs: ocr | ocr=1,aesthetic=0.1 | '[{name: ocr, ...}]'")
    evaluate.add_argument("--eval-rewards", default=None,
                          help="held-out metrics scored on the same samples besides the config's "
                               "eval.rewards (same forms as --rewards; weights ignored), e.g. "
                               "toy_artifacts,clip_score or '[{name: clip_score, label: clip}]'")
    evaluate.add_argument("--prompts", default=None,
                          help="prompt file (.txt / .jsonl), toy:<split>, or the prompt itself")
    evaluate.add_argument("--lora", default=None, metavar="CKPT",
                          help="trainer checkpoint to evaluate (default: the base model)")
    evaluate.add_argument("--seeds", nargs="+", default=None,
                          help="seeds per prompt, e.g. 0 1 or 0-3 (default: the config's eval "
                               "noise, else 0)")
    evaluate.add_argument("--samples-per-prompt", type=int, default=None, metavar="K",
                          help="pass@k diagnostics: sample each eval prompt K times with K "
                               "distinct noises (seeds 0..K-1, or the K --seeds, or with a "
                               "CONFIG its eval noise stream; with a CONFIG the prompts are the "
                               "distinct prompts of its evaluation: the first eval_per_family of "
                               "each family, or all) and report pass@1, pass@k for k = 1, 2, "
                               "4, ..., K (unbiased estimator), the share of prompts with "
                               "0 < successes < K and the histogram of successes per prompt, "
                               "per family and overall")
    evaluate.add_argument("--success-threshold", type=float, default=0.5, metavar="T",
                          help="a sample succeeds when its score is >= T (default 0.5: a 0/1 "
                               "verdict succeeds when it is 1)")
    evaluate.add_argument("--passk-keys", default=None, metavar="KEY[,KEY]",
                          help="reward keys to report pass@k for (default: every key whose "
                               "scores are all 0 or 1, e.g. geneval_toy.exact)")
    evaluate.add_argument("--out", default="eval.json", help="JSON results file (default eval.json)")
    evaluate.set_defaults(handler=run_eval)

    grid = subparsers.add_parser(
        "grid", help="side-by-side comparison grid of the base model and checkpoints",
        description="Rows are prompts x seeds, columns the given checkpoints ('base' = the model "
                    "without one), with the same noise along each row. Writes OUT (PNG; for "
                    "video an MP4 and a GIF), paged as OUT_001... when rows exceed --max-rows, "
                    "plus OUT.json with the rewards and cell positions.")
    _add_model_arguments(grid)
    grid.add_argument("--checkpoints", nargs="+", required=True, metavar="CKPT",
                      help="columns: 'base' and/or checkpoint or run folders")
    grid.add_argument("--prompts", required=True,
                      help="prompt file (.txt / .jsonl), toy:<split>, or the prompt itself")
    grid.add_argument("--seeds", nargs="+", default=["0"], help="e.g. 0 1, 0,1 or 0-3 (default 0)")
    grid.add_argument("--rewards", default=None, help="label each cell with these rewards")
    grid.add_argument("--eval-rewards", default=None,
                      help="held-out metrics to add to each cell's label (same forms as "
                           "--rewards; weights ignored), e.g. toy_artifacts,clip_score")
    grid.add_argument("--max-rows", type=int, default=8, help="rows per page (default 8)")
    grid.add_argument("--min-cell-size", type=int, default=128,
                      help="upscale smaller images (nearest neighbour, integer factor) to at least "
                           "this many px (default 128)")
    grid.add_argument("--fps", type=float, default=8.0, help="frames per second of video grids")
    grid.add_argument("--out", required=True, help="output file, e.g. grid.png")
    grid.set_defaults(handler=run_grid)

    add_configs_parser(subparsers)
    add_fetch_prompts_parser(subparsers)
