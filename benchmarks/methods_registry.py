"""What the methods benchmark compares (``benchmarks/methods.py``): the methods (``METHODS``),
the config fields added since its results were measured (``FIELDS_ADDED_SINCE_RESULTS``), and the
constants every job of the benchmark shares.

Add a method or a config field here; ``benchmarks/methods.py`` re-exports every name.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from flowgrpo.config_algorithms import (AWMConfig, DGPOConfig, DPOConfig,
                                        GDROConfig, NFTConfig, TimestepsConfig)
from flowgrpo.embedding_perturbation import EmbeddingPerturbationConfig
from flowgrpo.guided_sde import RewardGuidanceConfig
from flowgrpo.step_values import VGPOConfig


_ALGORITHM_SECTIONS = {"timesteps": TimestepsConfig, "nft": NFTConfig, "awm": AWMConfig,
                       "dgpo": DGPOConfig, "dpo": DPOConfig, "gdro": GDROConfig}

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = "benchmarks/results/methods"

# Config fields added after results in benchmarks/results were measured, with the value that
# leaves a run as it was: at that value a field is left out of a run's config digest, so adding
# a field does not invalidate every finished run (a run that sets it differs, as it should).
FIELDS_ADDED_SINCE_RESULTS: dict[tuple[str, ...], object] = {
    ("training", "locality", "edit_weight"): None,
    ("training", "locality", "silent_share"): "keep",
    ("training", "locality", "keep_region"): "rest",
    ("training", "locality", "keep_kl_beta"): 0.0,
    ("training", "locality", "keep_source_beta"): 0.0,
    ("prompts", "balance_weights"): {},
    # training.algorithm and its sections (every earlier result is grpo with their defaults)
    ("training", "algorithm"): "grpo",
    **{("training", name): asdict(section()) for name, section in _ALGORITHM_SECTIONS.items()},
    # the stops of runs that learn nothing, and the signals that save (no earlier run hit them)
    ("training", "max_iterations_without_finite_reward"): 5,
    ("training", "on_constant_reward"): "warn",
    ("training", "constant_reward_iterations"): 5,
    ("run", "save_on_signal"): ["SIGTERM", "SIGUSR1", "SIGINT"],
    ("training", "cfg_gradient"): "both",   # every earlier run backpropagated both CFG branches
    # Euphonium's reward-guided rollouts (flowgrpo/guided_sde.py): every earlier run unguided
    ("sampling", "reward_guidance"): asdict(RewardGuidanceConfig()),
    # E-GRPO's merge plan (sampling.plan.kind: merge); inert for every other kind
    ("sampling", "plan", "merge_at"): [1],
    ("sampling", "plan", "merge_counts"): None,
    # TempFlow-GRPO's cycling branch step (sampling.plan.one_step_select); Flash-GRPO's random
    ("sampling", "plan", "one_step_select"): "random",
    # VGPO's per-step advantages (training.advantage: vgpo); every earlier run one a sample
    ("training", "advantage"): "auto",
    ("training", "vgpo"): asdict(VGPOConfig()),
    # TreeGRPO / BranchGRPO's tree plan (sampling.plan.kind: tree); inert for every other kind
    ("sampling", "plan", "tree_branch_at"): [0, 1, 2],
    ("sampling", "plan", "tree_branching"): 2,
    ("sampling", "plan", "tree_window"): None,
    ("sampling", "plan", "tree_trained"): None,
    ("sampling", "plan", "tree_backup"): "mean",
    # E2PO's embedding-perturbed rollouts (sampling.embedding_perturbation); off at scale 0
    ("sampling", "embedding_perturbation"): asdict(EmbeddingPerturbationConfig()),
}

TABLE_EVAL_SEED = 0            # the default config's own evaluation noise (run.seed 0)
TUNE_EVAL_SEED = 1             # tuning is scored on other noise than the table
TUNE_SEED = 100                # tuning's training seed, kept apart from the table's seeds


@dataclass(frozen=True)
class Method:
    """A method of the benchmark: its config and the settings its tuning tries.

    noise_levels: the noise levels the tuning tries, the anchor's value first (the tuning's
    tie-break prefers it); one for the sample-based algorithms, whose ODE rollouts have none.
    window_visits: for MixGRPO's progressive window, how many positions it visits in a run;
    ``shift_interval = round(max_iterations / window_visits)`` (the config header says why).
    calibrated: whether ``--calibrate --write-configs`` writes the config's run.max_iterations
    (not for the embedded default and its curriculum twin, which keep the default's schedule).
    editable: whether ``--write-configs`` may edit the file at all.
    """

    name: str
    label: str
    config: str
    noise_levels: tuple[float, ...]
    window_visits: int = 0
    calibrated: bool = True
    editable: bool = True

    @property
    def path(self) -> Path:
        return ROOT / self.config


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("default", "Default (Fast, 4-step branch)", "configs/toy_geneval.yaml", (0.7, 1.0),
           calibrated=False, editable=False),
    Method("default_cgpo", "Default + CGPO curriculum", "configs/toy_methods/default_cgpo.yaml",
           (0.7, 1.0), calibrated=False),
    # Pref-GRPO: the default with the group win rate as its reward, on the default's schedule
    Method("pref_grpo", "Pref-GRPO (win rate)", "configs/toy_methods/pref_grpo.yaml", (0.7, 1.0),
           calibrated=False),
    Method("flow_grpo", "Flow-GRPO", "configs/toy_methods/flow_grpo.yaml", (0.7, 0.4)),
    Method("flow_grpo_guard", "Flow-GRPO + GRPO-Guard", "configs/toy_methods/flow_grpo_guard.yaml",
           (0.7, 0.4)),
    Method("dance_grpo", "DanceGRPO", "configs/toy_methods/dance_grpo.yaml", (0.3, 0.7)),
    Method("mix_grpo", "MixGRPO", "configs/toy_methods/mix_grpo.yaml", (0.7, 1.0),
           window_visits=7),
    Method("mix_grpo_flash", "MixGRPO-Flash", "configs/toy_methods/mix_grpo_flash.yaml",
           (0.7, 1.0), window_visits=9),
    Method("flow_grpo_fast", "Flow-GRPO-Fast", "configs/toy_methods/flow_grpo_fast.yaml",
           (0.7, 1.0)),
    Method("flow_grpo_fast_cps", "Flow-GRPO-Fast (CPS)",
           "configs/toy_methods/flow_grpo_fast_cps.yaml", (0.8, 0.5)),
    Method("flash_grpo", "Flash-GRPO", "configs/toy_methods/flash_grpo.yaml", (1.0, 2.0)),
    Method("e_grpo", "E-GRPO", "configs/toy_methods/e_grpo.yaml", (0.7, 1.0)),
    Method("tempflow_grpo", "TempFlow-GRPO", "configs/toy_methods/tempflow_grpo.yaml", (0.7, 1.0)),
    Method("vgpo", "VGPO (per-step values)", "configs/toy_methods/vgpo.yaml", (0.7, 0.4)),
    Method("tree_grpo", "TreeGRPO / BranchGRPO (tree rollouts)",
           "configs/toy_methods/tree_grpo.yaml", (0.7, 1.0)),
    Method("nft", "DiffusionNFT", "configs/toy_methods/nft.yaml", (0.7,)),
    # E2PO: nft.yaml (at its former lr, 8e-4) with perturbed prompt embeddings in the rollout
    Method("e2po", "E2PO (NFT + embedding-perturbed exploration)",
           "configs/toy_methods/e2po.yaml", (0.7,)),
    Method("awm", "AWM", "configs/toy_methods/awm.yaml", (0.7,)),
    Method("dgpo", "DGPO", "configs/toy_methods/dgpo.yaml", (0.7,)),
    Method("dgpo_guarded", "DGPO + the image guard", "configs/toy_methods/dgpo_guarded.yaml",
           (0.7,)),
    Method("awm_guarded", "AWM + the image guard", "configs/toy_methods/awm_guarded.yaml",
           (0.7,)),
    Method("nft_guarded", "DiffusionNFT + the image guard",
           "configs/toy_methods/nft_guarded.yaml", (0.7,)),
    # nft_guarded (its lr then, 8e-4) with beta 10 to the end of its 170-iteration schedule (880 s)
    Method("nft_clean", "DiffusionNFT + the image guard, full schedule",
           "configs/toy_methods/nft_clean.yaml", (0.7,), calibrated=False),
    Method("dpo", "Diffusion-DPO (online)", "configs/toy_methods/dpo.yaml", (0.7,)),
    Method("dpo_guarded", "Diffusion-DPO + the image guard",
           "configs/toy_methods/dpo_guarded.yaml", (0.7,)),
    Method("euphonium", "Euphonium (reward-guided rollouts)", "configs/toy_methods/euphonium.yaml",
           (0.7, 0.4)),
    # VGPO's advantages on the default's plan and update, on the default's schedule (as
    # Pref-GRPO): vgpo.yaml above trains every step of Flow-GRPO's rollouts
    Method("vgpo_branch", "VGPO on the default (4-step branch)",
           "configs/toy_methods/vgpo_branch.yaml", (0.7, 1.0), calibrated=False),
    # TempFlow-GRPO branching only at the steps where most of the base's groups carry a signal
    Method("tempflow_grpo_early", "TempFlow-GRPO, branching at steps 0-8",
           "configs/toy_methods/tempflow_grpo_early.yaml", (0.7, 1.0)),
    Method("gdro", "GDRO", "configs/toy_methods/gdro.yaml", (0.7,)),
)}

# CI-sized runs: a tiny batch and evaluation (2 per family = 12 samples, 8 Euler steps).
QUICK_OVERRIDES = ("training.prompts_per_iteration=2", "training.group_size=4",
                   "sampling.rollout_batch_size=8", "prompts.eval_per_family=2",
                   "sampling.eval_num_steps=8", "run.max_iterations=3")

QUICK_BUDGET, QUICK_INTERVAL = 2.0, 0.5


def parse_list(text: str, kind: Callable[[str], Any], name: str) -> list:
    """``"0,1,2"`` -> [0, 1, 2]; a clear error naming the option otherwise."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        values = [kind(t) for t in items]
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a comma-separated list of "
                         f"{kind.__name__} values") from None
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def parse_methods(text: str) -> list[Method]:
    names = parse_list(text, str, "--methods")
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown method {unknown[0]}; choose from "
                         f"{', '.join(METHODS)}")
    return [METHODS[n] for n in dict.fromkeys(names)]
