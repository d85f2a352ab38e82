"""Group rollouts over shared or independent initial noise -> RolloutBatch.

A rollout runs every sample of the local batch through its plan's schedule. Samples are processed in
*replay batches*: rows that share a plan, ``rollout_batch_size`` at a time. Each transformer call on
a trained step is kept as a ``ReplayBatch`` (its rows, x, x', sigmas, logp_old, mean_old, std), and
the trainer replays exactly those batches, so the first inner pass sees the same code path, dtype
and batch geometry as the rollout: the ratio is exactly 1. Nothing else of the trajectory is kept,
so memory is O(trained steps).

Randomness is a pure function of (seed, iteration, group or sample id, step): the same batch gives
the same rollout on one process or many, and a resumed run repeats the uninterrupted one.

When the rows of a chunk train different subsets of a step (DanceGRPO's per-sample draw,
``plans.sample_trained_steps``), that step's transformer call is split into the rows that train it
and the rows that do not, so the replay batch is again exactly a call the rollout made. After the
last stochastic step of a plan whose ``solver_after`` is DPM-Solver++(2M), the first solver step is
seeded with that step's x0 estimate (MixGRPO-Flash), so it is already second order.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from torch import Tensor

from flowgrpo.plans import StepPlan
from flowgrpo.seeding import seeded_generator
from flowgrpo.step_values import one_step_prediction
from flowgrpo.tree_rollout import tree_chunks
from flowgrpo.sde import StepGaussian, dpmpp_2m_step, euler_step, score_step, transition
from flowgrpo.model import Conditioning, FlowModel, cfg_gradient, check_source_images


@dataclass
class AnchorBatch:
    """The state of b rows at one untrained step of their plan (``training.anchor_beta``):
    rows (b,) (the chunk's rows tensor), latents (b, ...) float32 at ``plan.sigmas[step]``,
    sigmas (b,) float32."""

    rows: Tensor
    step: int
    latents: Tensor
    sigmas: Tensor


@dataclass
class ReplayBatch:
    """One trained transformer call of the rollout: b rows at one step of one plan.

    Shapes: rows (b,) indices into the RolloutBatch; latents/next_latents/mean_old (b, ...) float32;
    sigmas/sigmas_next/logp_old/std (b,) float32. ``step`` is the index into ``plan.sigmas``.
    ``gaussian`` is the step's policy (``sde.StepGaussian``): a replay re-scores x' with it
    without redoing the schedule arithmetic (``std`` is the same tensor as ``gaussian.std``,
    kept as a field for Guard, KL and rectification).
    """

    rows: Tensor
    step: int
    latents: Tensor
    next_latents: Tensor
    sigmas: Tensor
    sigmas_next: Tensor
    logp_old: Tensor
    mean_old: Tensor
    std: Tensor
    gaussian: StepGaussian
    # Untrained-step states of this replay batch's chunk (training.anchor_beta), kept on the
    # chunk's first replay batch so that each is anchored once per inner epoch.
    anchors: list[AnchorBatch] = field(default_factory=list)
    # Where the chunk's plan comes among the iteration's plans, ranked by the first group (of
    # every process) that follows it: rollouts chunk the rows plan by plan in this order, so
    # (bucket, first sample id) sorts every process's replay batches into one process's order.
    bucket: int = 0
    # A tree plan's step (``tree_rollout.py``): the rows come in runs of ``children`` siblings
    # that share one input (latents, sigma, prompt); the rollout evaluated the transformer once per
    # run and ``replay_logp`` does the same. 1: every row its own call row.
    children: int = 1
    # (b, ...) float32 one-step predictions x0_hat = x - sigma v of the rows' states, from this
    # step's velocity (RolloutSettings.keep_x0_predictions: VGPO's step values), else None
    x0_pred: Tensor | None = None


@dataclass
class RolloutBatch:
    """What one iteration's rollout keeps. B = local batch size."""

    prompts: list[str]
    metadata: list[dict]
    group_ids: Tensor                  # (B,) int64, assigned per iteration
    sample_ids: Tensor                 # (B,) int64, global index of each sample in the iteration
    media: Tensor                      # (B, 3, H, W) or (B, F, 3, H, W) float32 in [0, 1], CPU
    replay: list[ReplayBatch] = field(default_factory=list)
    nfe: int = 0                       # transformer calls per sample, summed over the batch / B
    # (B, ...) float32 CPU final latents x0 of each row (settings.keep_final_latents), else None
    final_latents: Tensor | None = None
    # a replay unit a process without any replays this iteration runs at weight 0 so that it
    # joins the gradient all-reduce (set by algorithms whose replay list may be empty: dpo)
    padding_replay: object | None = None
    images: list[Tensor] | None = None  # B source images (3, H, W) of an editing run, else None
    kl_weights: Tensor | None = None   # (B,) KL gate weights (training.gardo), None = plain KL
    # (B, ...) edit-region weights in [0, 1] broadcastable to the latents (training.locality)
    region_masks: Tensor | None = None
    # (B, ...) preservation-region weights like region_masks (locality.keep_region: record), or
    # None: the preservation region is everything outside the edit region
    keep_masks: Tensor | None = None
    # (B, N) float32 values of the rows' states at their trained steps (the reward of the kept
    # one-step predictions, NaN where not scored) and (B, N) bool trained steps, N the schedule's
    # steps (training.advantage: vgpo: the advantages are then (B, N), a column a step), else None
    step_values: Tensor | None = None
    trained_steps: Tensor | None = None
    # (B, N) float32 log-prob of the SDE edge at each window step on the row's path from its
    # tree's root (tree plans: tree_rollout.py; 0 off the window), else None
    tree_log_probs: Tensor | None = None

    @property
    def trained_transitions(self) -> int:
        return sum(int(r.rows.numel()) for r in self.replay)


@dataclass
class RolloutSettings:
    kind: str                          # flow_sde | dance_sde | flash_sde | cps
    noise_level: float
    guidance_scale: float
    batch_size: int                    # rows per transformer call
    share_initial_noise: bool
    seed: int
    iteration: int
    log_prob: str = "exact"            # sde.LOG_PROBS
    schedule_bounds: tuple[float, float] | None = None   # (sigmas[1], sigmas[-1]): flash_sde
    anchor_steps: int = 0              # untrained steps kept per chunk (training.anchor_beta)
    anchor_sigma_max: float = 1.0      # ... among those with sigma <= this
    keep_final_latents: bool = False   # keep each row's final latents (sample-based algorithms)
    # training.cfg_gradient: "conditional" runs CFG's unconditional branch in a forward of its
    # own (``flowgrpo.model.cfg_gradient``) in the replays and, so that a replayed velocity is
    # the rollout's bit for bit, in the rollout's trained calls; untrained steps stay batched.
    cfg_gradient: str = "both"
    # sampling.reward_guidance (Euphonium): a ``guided_sde.RewardGuidance`` bound to the batch's
    # prompts, whose ``step_function`` gives each stochastic step its transition; None = unguided.
    guidance: object | None = None
    # keep each trained step's one-step prediction x - sigma v (ReplayBatch.x0_pred): VGPO
    keep_x0_predictions: bool = False
    # sampling.embedding_perturbation (E2PO): an ``embedding_perturbation.EmbeddingPerturbation``
    # that ``rollout`` binds to its rows; each step's transformer call then sees its chunk's
    # prompt embeddings perturbed at the step's sigma. None = the original embeddings.
    embedding_perturbation: object | None = None


def encode_rows(model: FlowModel, prompts: list[str], images: list[Tensor] | None = None
                ) -> tuple[Conditioning, Tensor]:
    """(Conditioning of the distinct rows, (B,) index of each row in it). A row is its prompt, and
    with ``images`` (one source image (3, H, W) per row, for an editing model) its prompt and
    image: the rows of a group share one record, so one image object, and are encoded once."""
    if images is None:
        keys: list = list(prompts)
    else:
        if len(images) != len(prompts):
            raise ValueError(f"images ({len(images)}) must give one source image per prompt "
                             f"({len(prompts)})")
        if not getattr(model, "supports_images", False):
            raise ValueError(f"the prompts carry source images but the {model.family} model does "
                             f"not edit images; use an editing model (e.g. toy: assets/toy_edit) "
                             f"or prompts without \"image\"")
        check_source_images(model, images)   # a one-image family given several refuses them
        keys = [(prompt, id(image)) for prompt, image in zip(prompts, images)]
    unique = list(dict.fromkeys(keys))
    position = {key: i for i, key in enumerate(unique)}
    first = [keys.index(key) for key in unique]
    if images is None:
        cond = model.encode_prompts([prompts[i] for i in first])
    else:
        cond = model.encode_prompts([prompts[i] for i in first], images=[images[i] for i in first])
    return cond, torch.tensor([position[key] for key in keys])


def initial_noise(model: FlowModel, group_ids: Tensor, sample_ids: Tensor, settings: RolloutSettings
                  ) -> Tensor:
    """(B, ...) initial latents: one draw per group when shared, else one per sample."""
    draws = []
    for group_id, sample_id in zip(group_ids.tolist(), sample_ids.tolist()):
        key = ("group", group_id) if settings.share_initial_noise else ("sample", sample_id)
        draws.append(model.initial_noise(1, seeded_generator(settings.seed, settings.iteration,
                                                              "noise", *key)))
    return torch.cat(draws).to(torch.float32)


class StepNoise:
    """Standard normal noise of a plan's SDE steps, one independent stream per sample.

    Each sample's stream is seeded by (seed, iteration, sample id) alone, so its noise does not
    depend on which process or batch rolls it out. The steps are drawn in plan order from one
    generator per sample (seeding once per rollout, not per step, matters when a transformer call
    takes a millisecond); a step before the first one asked for is drawn and discarded, so a
    sample's noise at a step is the same whether or not a shared prefix was split off.
    """

    def __init__(self, shape: tuple[int, ...], sample_ids: Tensor, steps: list[int],
                 settings: RolloutSettings):
        self.shape = shape
        self.steps = sorted(steps)
        self.position = 0
        self.generators = [seeded_generator(settings.seed, settings.iteration, "sde", sample_id)
                           for sample_id in sample_ids.tolist()] if steps else []

    def __call__(self, step: int) -> Tensor:
        """(b, ...) noise of ``step`` (steps must be asked for in increasing order)."""
        while True:
            if self.position >= len(self.steps) or self.steps[self.position] > step:
                raise ValueError(f"step {step} is not a remaining SDE step of the plan "
                                 f"{self.steps[self.position:]}")
            draws = torch.stack([torch.randn(self.shape, generator=g) for g in self.generators])
            self.position += 1
            if self.steps[self.position - 1] == step:
                return draws


def run_plan(model: FlowModel, plan: StepPlan, latents: Tensor, cond: Conditioning,
             rows: Tensor, sample_ids: Tensor, settings: RolloutSettings,
             first_step: int = 0, last_step: int | None = None,
             row_trained: list[tuple[int, ...]] | None = None,
             anchor_steps: Sequence[int] = ()) -> tuple[Tensor, list[ReplayBatch], int]:
    """Integrate steps [first_step, last_step) of ``plan`` for one replay batch.

    latents (b, ...) float32 at ``plan.sigmas[first_step]``; rows (b,) their RolloutBatch indices;
    sample_ids (b,) their global ids (for noise); row_trained: the trained steps of each row when
    they differ from ``plan.trained`` (a subset of it); anchor_steps: steps whose input state is
    kept as an ``AnchorBatch`` on the first replay batch (dropped when nothing is trained).
    Returns (latents at the end, replay batches of the trained steps, transformer calls made per
    row).
    """
    last_step = plan.num_steps if last_step is None else last_step
    stochastic = set(plan.stochastic)
    trained = set(plan.trained)
    last_stochastic = max(plan.stochastic, default=-1)
    seed_solver = plan.solver_after == "dpmpp_2m"
    device = model.device
    replay: list[ReplayBatch] = []
    anchors: list[AnchorBatch] = []
    prev_x0 = prev_sigma = None
    calls = 0
    b = latents.shape[0]
    x = latents.to(device, torch.float32)
    step_noise = StepNoise(tuple(x.shape[1:]), sample_ids,
                           plan.stochastic if stochastic & set(range(first_step, last_step)) else [],
                           settings)
    for i in range(first_step, last_step):
        sigma = plan.sigmas[i].expand(b).to(device, torch.float32)
        sigma_next = plan.sigmas[i + 1].expand(b).to(device, torch.float32)
        calls += 1
        if i in anchor_steps:
            anchors.append(AnchorBatch(rows=rows, step=i, latents=x, sigmas=sigma))
        step_cond = cond if settings.embedding_perturbation is None else \
            settings.embedding_perturbation.condition(cond, rows, sigma)
        if i in stochastic:
            noise = step_noise(i).to(device)
            parts = _trained_parts(i, b, trained, row_trained)
            x_next = x if len(parts) == 1 else torch.empty_like(x)
            velocity_all = None if len(parts) == 1 else torch.empty_like(x)
            for index, is_trained in parts:
                part = (lambda t: t) if index is None else (lambda t, k=index: t[k])
                part_cond = step_cond if index is None else step_cond.select(index)
                with cfg_gradient(settings.cfg_gradient if is_trained else "both"):
                    velocity = model.velocity(part(x).to(model.dtype), part(sigma), part_cond,
                                              settings.guidance_scale).to(torch.float32)
                step_transition = transition if settings.guidance is None else \
                    settings.guidance.step_function(i, part(rows))
                out = step_transition(settings.kind, velocity, part(x), part(sigma),
                                      part(sigma_next), noise_level=settings.noise_level,
                                      noise=part(noise), validate=False,
                                      log_prob=settings.log_prob,
                                      schedule_bounds=settings.schedule_bounds)
                if is_trained:
                    replay.append(ReplayBatch(
                        rows=part(rows), step=i, latents=part(x), next_latents=out.prev_sample,
                        sigmas=part(sigma), sigmas_next=part(sigma_next), logp_old=out.log_prob,
                        mean_old=out.mean, std=out.std, gaussian=out.gaussian,
                        x0_pred=one_step_prediction(part(x), part(sigma), velocity)
                        if settings.keep_x0_predictions else None))
                if index is None:
                    x_next, velocity_all = out.prev_sample, velocity
                else:
                    x_next[index] = out.prev_sample
                    velocity_all[index] = velocity
            if seed_solver and i == last_stochastic:
                # MixGRPO-Flash seeds the multistep solver with the window's x0 estimate, so the
                # first post-window DPM-Solver++ step is already second order.
                prev_x0 = x - sigma.reshape(-1, *[1] * (x.ndim - 1)) * velocity_all
                prev_sigma = sigma
            x = x_next
            continue
        velocity = model.velocity(x.to(model.dtype), sigma, step_cond,
                                  settings.guidance_scale).to(torch.float32)
        if plan.solver_for(i) == "dpmpp_2m":   # the plan says which solver a non-SDE step uses
            x, x0 = dpmpp_2m_step(x, velocity, sigma, sigma_next, prev_x0=prev_x0,
                                  prev_sigma=prev_sigma, final=i == plan.num_steps - 1)
            prev_x0, prev_sigma = x0, sigma
        else:
            x = euler_step(x, velocity, sigma, sigma_next)
    if replay:
        replay[0].anchors = anchors
    return x, replay, calls


def choose_anchor_steps(plan: StepPlan, first_step: int, count: int, settings: RolloutSettings,
                        chunk_key: int) -> list[int]:
    """``count`` of the plan's untrained steps in [first_step, num_steps) whose sigma is at most
    ``settings.anchor_sigma_max``, drawn uniformly without replacement by (seed, iteration,
    "anchor", chunk_key): the steps whose states ``training.anchor_beta`` anchors. Fewer when
    fewer qualify."""
    trained = set(plan.trained)
    candidates = [i for i in range(first_step, plan.num_steps) if i not in trained
                  and float(plan.sigmas[i]) <= settings.anchor_sigma_max + 1e-6]
    if count <= 0 or not candidates:
        return []
    generator = seeded_generator(settings.seed, settings.iteration, "anchor", chunk_key)
    order = torch.randperm(len(candidates), generator=generator)[:count]
    return sorted(candidates[int(k)] for k in order)


def _trained_parts(step: int, batch: int, trained: set[int],
                   row_trained: list[tuple[int, ...]] | None) -> list[tuple[Tensor | None, bool]]:
    """How a stochastic step's call is split: [(row index or None for all rows, trained)]."""
    if row_trained is None:
        return [(None, step in trained)]
    mask = torch.tensor([step in steps for steps in row_trained])
    if bool(mask.all()) or not bool(mask.any()):
        return [(None, bool(mask.all()))]
    return [(mask.nonzero()[:, 0], True), ((~mask).nonzero()[:, 0], False)]


def rollout(model: FlowModel, prompts: list[str], metadata: list[dict], group_ids: Tensor,
            sample_ids: Tensor, plans: dict[int, StepPlan], settings: RolloutSettings,
            on_media: Callable[[Tensor, Tensor], None] | None = None,
            images: list[Tensor] | None = None,
            sample_trained: dict[int, tuple[int, ...]] | None = None) -> RolloutBatch:
    """Roll out the local batch.

    prompts/metadata: B entries; group_ids/sample_ids: (B,) int64; plans: group id -> StepPlan;
    sample_trained: sample id -> its trained steps when they differ per sample (a subset of its
    group plan's ``trained``; ``plans.sample_trained_steps``), else None.
    Rows are bucketed by plan (groups with the same plan run together, in batch order) and cut into
    replay batches of ``settings.batch_size`` rows. A deterministic prefix that the whole group
    shares (branch / one-step plans with shared noise) is computed once per group and expanded.
    ``on_media(rows, media)`` is called as each replay batch is decoded (the trainer scores it in a
    thread while the next batch rolls out). ``images``: B source images (3, H, W) for an editing
    model (``encode_rows``), kept in the batch for the replays.
    """
    batch = len(prompts)
    cond_unique, prompt_index = encode_rows(model, prompts, images)
    if settings.embedding_perturbation is not None:   # E2PO: bound to these rows' groups
        settings = replace(settings, embedding_perturbation=settings.embedding_perturbation.bind(
            cond_unique, group_ids, sample_ids))
    noise = initial_noise(model, group_ids, sample_ids, settings)

    buckets: dict[tuple, list[int]] = {}
    for row in range(batch):
        buckets.setdefault(plans[int(group_ids[row])].key(), []).append(row)

    media_rows: list[tuple[Tensor, Tensor]] = []
    final_rows: list[tuple[Tensor, Tensor]] = []
    replay: list[ReplayBatch] = []
    calls = 0
    tree_log_probs = None

    def finish(rows: Tensor, x: Tensor) -> None:
        """A chunk's final latents (kept when asked) and decoded media, handed to on_media."""
        if settings.keep_final_latents:
            final_rows.append((rows, x.to(torch.float32).cpu()))
        media = model.decode(x.to(model.device, model.dtype)).to(torch.float32).cpu()
        media_rows.append((rows, media))
        if on_media is not None:
            on_media(rows, media)

    for bucket_rows in buckets.values():
        plan = plans[int(group_ids[bucket_rows[0]])]
        if plan.branching > 1:   # a tree plan: whole trees per chunk, one call per node
            for rows, x, chunk_replay, chunk_calls, chunk_log_probs in tree_chunks(
                    model, plan, bucket_rows, noise, cond_unique, prompt_index, group_ids,
                    sample_ids, settings):
                if tree_log_probs is None:
                    tree_log_probs = torch.zeros(batch, plan.num_steps)
                tree_log_probs[rows] = chunk_log_probs
                calls += chunk_calls
                replay.extend(ReplayBatch(**fields) for fields in chunk_replay)
                finish(rows, x)
            continue
        for start in range(0, len(bucket_rows), settings.batch_size):
            rows = torch.tensor(bucket_rows[start:start + settings.batch_size])
            cond = cond_unique.select(prompt_index[rows]).to(model.device)
            x = noise[rows]
            first = 0
            if plan.shared_prefix > 0 and settings.share_initial_noise:
                # One representative per group computes the shared deterministic prefix.
                groups, expand = torch.unique(group_ids[rows], return_inverse=True)
                reps = torch.stack([(expand == k).nonzero()[0, 0] for k in range(len(groups))])
                prefix, _, prefix_calls = run_plan(
                    model, plan, x[reps], cond.select(reps), rows[reps], sample_ids[rows][reps],
                    settings, 0, plan.shared_prefix)
                x = prefix[expand.to(prefix.device)]
                first = plan.shared_prefix
                calls += prefix_calls * len(reps)
            row_trained = None if sample_trained is None else \
                [sample_trained[int(sid)] for sid in sample_ids[rows].tolist()]
            anchor_steps = choose_anchor_steps(plan, first, settings.anchor_steps, settings,
                                               int(sample_ids[rows][0]))
            x, chunk_replay, chunk_calls = run_plan(model, plan, x, cond, rows, sample_ids[rows],
                                                    settings, first, row_trained=row_trained,
                                                    anchor_steps=anchor_steps)
            calls += chunk_calls * len(rows)
            replay.extend(chunk_replay)
            finish(rows, x)

    first_media = media_rows[0][1]
    all_media = torch.empty((batch, *first_media.shape[1:]), dtype=torch.float32)
    for rows, media in media_rows:
        all_media[rows] = media
    final_latents = None
    if final_rows:
        final_latents = torch.empty((batch, *final_rows[0][1].shape[1:]), dtype=torch.float32)
        for rows, latents in final_rows:
            final_latents[rows] = latents
    return RolloutBatch(prompts=list(prompts), metadata=list(metadata), group_ids=group_ids,
                        sample_ids=sample_ids, media=all_media, replay=replay,
                        nfe=calls // max(batch, 1), images=None if images is None else list(images),
                        final_latents=final_latents, tree_log_probs=tree_log_probs)


def replay_logp(model: FlowModel, replay: ReplayBatch, cond: Conditioning, settings: RolloutSettings
                ) -> tuple[Tensor, Tensor]:
    """Re-score a replay batch under the current weights (with grad).

    Returns (logp (b,), mean (b, ...)) for x -> x' under the recorded step's Gaussian (the same
    transition kind, noise level and coefficients as the rollout), CFG's branches run as
    ``settings.cfg_gradient`` says (as in the rollout's call of this step).
    """
    if replay.children > 1:   # a tree's branch step: one call per parent, as in the rollout
        parents = torch.arange(0, len(replay.rows), replay.children)
        pick = parents.to(replay.latents.device)
        with cfg_gradient(settings.cfg_gradient):
            velocity = model.velocity(replay.latents[pick].to(model.dtype),
                                      replay.sigmas[pick.to(replay.sigmas.device)],
                                      cond.select(parents), settings.guidance_scale)
        velocity = velocity.repeat_interleave(replay.children, dim=0)
        return score_step(velocity, replay.latents, replay.next_latents, replay.gaussian)
    with cfg_gradient(settings.cfg_gradient):
        velocity = model.velocity(replay.latents.to(model.dtype), replay.sigmas, cond,
                                  settings.guidance_scale)
    return score_step(velocity, replay.latents, replay.next_latents, replay.gaussian)


def eval_noise(model: FlowModel, seed: int, indices: Sequence[int]) -> Tensor:
    """(len(indices), ...) initial noise of evaluation samples ``indices``: sample i draws from
    the generator of (seed, "eval", i), so the trainer's evaluations (on any number of processes)
    and ``flowgrpo eval`` of a config sample the same pictures."""
    return torch.cat([model.initial_noise(1, seeded_generator(seed, "eval", i)) for i in indices])


@torch.no_grad()
def sample_ode(model: FlowModel, prompts: list[str], noise: Tensor, num_steps: int,
               guidance_scale: float, batch_size: int = 16,
               images: list[Tensor] | None = None) -> Tensor:
    """Deterministic (Euler) samples for evaluation and grids: noise (B, ...) -> media (B, ...).
    ``images``: B source images (3, H, W) for an editing model."""
    if images is not None:
        check_source_images(model, images)
    sigmas = model.sigmas(num_steps)
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        cond = (model.encode_prompts(chunk) if images is None else model.encode_prompts(
            chunk, images=images[start:start + batch_size])).to(model.device)
        x = noise[start:start + batch_size].to(model.device, torch.float32)
        b = x.shape[0]
        for i in range(num_steps):
            sigma = sigmas[i].expand(b).to(model.device, torch.float32)
            sigma_next = sigmas[i + 1].expand(b).to(model.device, torch.float32)
            velocity = model.velocity(x.to(model.dtype), sigma, cond,
                                      guidance_scale).to(torch.float32)
            x = euler_step(x, velocity, sigma, sigma_next)
        out.append(model.decode(x.to(model.device, model.dtype)).to(torch.float32).cpu())
    return torch.cat(out)
