"""Which method should I use? Every GRPO method of the toolkit on the toy world at equal CPU time.

Each method is a config a user can run (``configs/toy_methods/<method>.yaml``; the embedded
default is ``configs/toy_geneval.yaml``). This script trains each of them from the same base
weights with the real ``Trainer``, for the same budget of process CPU seconds, on several
training seeds, and ranks them by held-out accuracy::

    python benchmarks/methods.py --calibrate    # CPU s per iteration -> run.max_iterations
    python benchmarks/methods.py --tune         # lr x noise grid, one seed, short budget
    python benchmarks/methods.py --seeds 0,1,2  # the table (resumable)
    python benchmarks/methods.py --report       # table.md, methods.json, the plot
    python benchmarks/methods.py --signal       # reward variance of each method's rollouts
    python benchmarks/methods.py --quick --methods flow_grpo,flash_grpo --out /tmp/quick

What is equal: every run starts from ``assets/toy``; a training seed gives every method the same
prompt order (the default with the curriculum draws by its own weights, by design); one torch
thread per process (``torch.set_num_threads(1)`` before any work); the budget counts the process's
CPU seconds (``time.process_time``, every thread, the reward thread included) spent in training
iterations, so model loading and evaluations are not counted. A run stops at the budget or at its
config's ``run.max_iterations``, whichever comes first (its lr schedule is defined over
``max_iterations``, which ``--calibrate`` sizes to the budget). A table at a longer budget than
the configs were calibrated for (``--budget 940 --schedule-from 600``) stretches every
method's cap, and MixGRPO's window, by the budgets' ratio, so no run stops at its cap first.

Evaluation: the config's own (held-out prompts, 96 samples per family = 576, 16-step Euler ODE),
with the evaluation noise seed fixed (``prompts.eval_seed``) for every method and training seed,
so every run is scored on the same samples; the score is the exact verifier accuracy, mean over
the six families (``eval/geneval_toy.exact/family_mean``). The untrained model is therefore
evaluated once overall (per distinct evaluation setting, cached in ``<out>/base/``), not once
per seed. Each run is evaluated every ``--eval-interval`` CPU seconds of training (after the
first iteration that ends past each mark) and at the budget. When the config has an evaluation
reward ``toy_artifacts`` (the toy's image-quality metric), it is recorded beside the accuracy.

Resuming: each (method, seed) writes ``<out>/runs/<method>_s<seed>.json`` at every evaluation
(``finished: false``) and when it ends (``finished: true``). A rerun skips finished runs and
restarts unfinished ones, so an interruption loses at most the run in progress; a finished run
measured with other settings (budget, interval, config file, overrides) is refused rather than
mixed in. A ``.lock`` file per run lets two invocations with different ``--methods`` (one per core)
share an ``--out``. ``--report`` (run at the end of every invocation too) reads every finished
run in ``<out>/runs``, and sets the papers' speed claims (``CLAIMS``) beside the ratios measured
here.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("flowgrpo") is None:   # run from a checkout that is not installed
    sys.path.insert(0, _CHECKOUT)
if _CHECKOUT not in sys.path:   # the jobs below import as benchmarks.methods_* (a folder of scripts)
    sys.path.append(_CHECKOUT)

# The benchmark by job; every name stays importable from here. METHODS and
# FIELDS_ADDED_SINCE_RESULTS live in benchmarks/methods_registry.py.
from benchmarks.methods_calibration import (calibrate, calibrated_values,  # noqa: E402,F401
                                            set_yaml_scalar, tuned_values, write_config_values,
                                            yaml_number)
from benchmarks.methods_registry import (DEFAULT_OUT, FIELDS_ADDED_SINCE_RESULTS,  # noqa: E402,F401
                                         METHODS, QUICK_BUDGET, QUICK_INTERVAL,
                                         QUICK_OVERRIDES, ROOT, TABLE_EVAL_SEED, TUNE_EVAL_SEED,
                                         TUNE_SEED, Method, parse_list, parse_methods)
from benchmarks.methods_report import (CLAIMS, MIN_GAIN_FOR_RATIO, capped_early,  # noqa: E402,F401
                                       TABLE_HEADER, TARGET_DELTA, Claim, claim_row,
                                       finished_records, fmt, format_claims,
                                       format_equal_iterations, format_paced_budget,
                                       format_ranking, format_table, gain_at_paced_budget,
                                       paced_budgets, plot_curves, report, reproduce_command,
                                       separations, summarize_method)
from benchmarks.methods_runs import (ACCURACY_KEY, ITERATION_KEYS, PhaseClock,  # noqa: E402,F401
                                     RunLock, RunSpec, base_evaluation, eval_signature,
                                     evaluation, load_average, merge_methods_json, milestones,
                                     run_specs, run_status, scaled_schedule, torch_threads,
                                     train_run, write_json)
from benchmarks.methods_signal import group_signal, signal_probe  # noqa: E402,F401
from benchmarks.methods_stats import (artifact_value, gains_at_iteration,  # noqa: E402,F401
                                      mean_of, median_seconds, seconds_to_target, t_interval,
                                      value_at_iteration)
from benchmarks.methods_tuning import (TuneSettings, choose,  # noqa: E402,F401
                                       extend_downward, parse_noise, tune_report, tune_specs)


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--calibrate", action="store_true",
                      help="measure CPU seconds per iteration and the max_iterations that fit "
                           "--budget (calibration.json)")
    mode.add_argument("--tune", action="store_true",
                      help="the lr x noise grid on one seed at --tune-budget (tuning.md/json)")
    mode.add_argument("--signal", action="store_true",
                      help="reward variance of each method's rollouts from the base, no training "
                           "(signal.md/json; --signal-iterations)")
    mode.add_argument("--report", action="store_true",
                      help="only aggregate the finished runs of --out")
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized: 2 x 4 samples, 12 eval samples, 2 CPU-s or 3 iterations")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (default 0,1,2)")
    parser.add_argument("--budget", type=float, default=600.0,
                        help="training CPU seconds per run (default 600)")
    parser.add_argument("--eval-interval", type=float, default=100.0,
                        help="training CPU seconds between evaluations (default 100)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--pace-from", action="append", default=[], metavar="METHODS_JSON",
                        help="--report: also each method's gain at --at-cpu CPU seconds at the "
                             "CPU seconds per iteration this report's methods.json measured "
                             "(repeatable: each method's pace from the first file that has it)")
    parser.add_argument("--include", action="append", default=[], metavar="OUT",
                        help="--report: also the finished runs of OUT/runs (a table run on "
                             "another day into its own folder), reported with --out's as one "
                             "table written into --out (repeatable)")
    parser.add_argument("--at-cpu", type=float, default=None, metavar="SECONDS",
                        help="--report with --pace-from: the budget, in that report's seconds")
    parser.add_argument("--schedule-from", type=float, default=None, metavar="SECONDS",
                        help="the table at a budget other than the one the configs were "
                             "calibrated for (SECONDS, 600 for the shipped configs): every "
                             "run's run.max_iterations, and MixGRPO's shift_interval, times "
                             "--budget / SECONDS, so each schedule runs its course in --budget")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra dotted config override for every run (repeatable)")
    parser.add_argument("--signal-iterations", type=int, default=8,
                        help="rollout iterations per method for --signal (default 8)")
    parser.add_argument("--calibrate-iterations", type=int, default=3,
                        help="counted iterations per method after one warm-up (default 3)")
    parser.add_argument("--write-configs", action="store_true",
                        help="with --calibrate: write run.max_iterations (and MixGRPO's "
                             "shift_interval) into configs/toy_methods/; with --tune: write the "
                             "chosen lr and noise level")
    parser.add_argument("--tune-budget", type=float, default=None,
                        help="training CPU seconds per tuning point (default: --budget, the "
                             "table's; a shorter tuning chose lrs whose damage showed later)")
    parser.add_argument("--tune-lrs", default="1e-4,2e-4,4e-4", help="lrs to try")
    parser.add_argument("--tune-noise", action="append", default=[], metavar="METHOD=V1,V2",
                        help="noise levels to try for METHOD (default: the anchor's value and "
                             "the alternative in METHODS)")
    parser.add_argument("--tune-seed", type=int, default=TUNE_SEED)
    parser.add_argument("--tune-eval-seed", type=int, default=TUNE_EVAL_SEED)
    parser.add_argument("--tune-eval-per-family", type=int, default=96)
    parser.add_argument("--tune-schedule", choices=("scaled", "config"), default="scaled")
    parser.add_argument("--tie-tolerance", type=float, default=0.0)
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    import torch

    torch.set_num_threads(1)        # before any work: CPU seconds comparable across methods
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    methods = parse_methods(args.methods)
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out
    command = "python benchmarks/methods.py " + " ".join(sys.argv[1:] if argv is None else argv)
    extra = list(args.set)
    budget, interval = args.budget, args.eval_interval
    if args.quick:
        extra = extra + list(QUICK_OVERRIDES)
        budget, interval = QUICK_BUDGET, QUICK_INTERVAL
    if not (budget > 0 and interval > 0):
        raise SystemExit(f"--budget and --eval-interval must be > 0 (got {budget}, {interval})")

    if args.include and not args.report:
        raise SystemExit("--include adds folders to --report only: add --report (the runs of "
                         "each folder are made by their own table command)")
    if args.report:
        paces = [Path(p) if Path(p).is_absolute() else ROOT / p for p in args.pace_from]
        try:
            return report(out, command, pace_files=paces, at_cpu=args.at_cpu,
                          include=[Path(p) if Path(p).is_absolute() else ROOT / p
                                   for p in args.include])
        except ValueError as error:
            raise SystemExit(str(error)) from None
    if args.signal:
        return signal_probe(methods, 1 if args.quick else args.signal_iterations, out, extra)
    if args.calibrate:
        data = calibrate(methods, budget, args.calibrate_iterations, out, extra)
        seeds = parse_list(args.seeds, int, "--seeds")
        evaluations = len(milestones(budget, interval))
        cost = data["evaluation"]["cpu_seconds"]
        hours = len(methods) * len(seeds) * (budget + evaluations * cost) / 3600
        tuning = len(methods) * 6 * ((args.tune_budget or budget) + cost) / 3600
        print(f"the table ({len(methods)} methods x {len(seeds)} seeds, {budget:g} s, "
              f"{evaluations} evaluations a run): about {hours:.1f} CPU hours of training and "
              f"evaluation, model loading not included; tuning adds {tuning:.1f} (6 points a "
              f"method at --tune-budget {args.tune_budget or budget:g})")
        if args.write_configs:
            for method in methods:
                if method.calibrated and method.editable:
                    values = calibrated_values(method, data["methods"][method.name])
                    write_config_values(method, values)
                    print(f"wrote {values} into {method.config}")
        return data
    if args.tune:
        settings = TuneSettings(
            lrs=parse_list(args.tune_lrs, float, "--tune-lrs"), noise=parse_noise(args.tune_noise),
            budget=QUICK_BUDGET if args.quick else (args.tune_budget or budget), seed=args.tune_seed,
            eval_seed=args.tune_eval_seed,
            eval_per_family=2 if args.quick else args.tune_eval_per_family,
            schedule=args.tune_schedule, table_budget=budget, tie_tolerance=args.tie_tolerance)
        tune_out = out / "tuning"
        while True:     # the same grid for every method, extended downward where its edge wins
            specs = tune_specs(methods, settings, tune_out, extra)
            run_specs(specs, tune_out)
            data = tune_report(tune_out, methods, settings, specs)
            added = extend_downward(data["chosen"], settings)
            if not added:
                break
            for name, lr in added.items():
                print(f"{name}: its lowest lr won; extending its grid down to {lr:.1e}")
                settings.extended.setdefault(name, []).append(lr)
        if args.write_configs:
            for name, point in data["chosen"].items():
                method = METHODS[name]
                values = tuned_values(method, point["lr"], point["noise_level"])
                if method.editable:
                    write_config_values(method, values)
                    print(f"wrote {values} into {method.config}")
                else:
                    print(f"{method.config} (not edited): chosen {values}")
        return data
    seeds = parse_list(args.seeds, int, "--seeds")
    specs = [RunSpec(m.name, seed, f"{m.name}_s{seed}", budget, interval, TABLE_EVAL_SEED,
                     tuple(extra)) for m in methods for seed in seeds]
    if args.schedule_from is not None:
        if not args.schedule_from > 0:
            raise SystemExit(f"--schedule-from must be > 0 seconds (got {args.schedule_from}): "
                             f"the budget the configs' caps were calibrated for, 600")
        specs = [scaled_schedule(spec, budget / args.schedule_from, out) for spec in specs]
    run_specs(specs, out)
    return report(out, command)


if __name__ == "__main__":
    main()
