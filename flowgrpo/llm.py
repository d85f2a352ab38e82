"""Causal language models on the same GRPO core: the completion's tokens are the steps.

``LMPolicy`` is the policy half of ``flowgrpo.trainer.Trainer`` for ``policy: llm``: rollouts
come from ``generate`` (each prompt ``group_size`` times), rewards score completion strings, and
the loss is ``token_losses.token_policy_loss`` over completion tokens. Advantages (group / batch / none,
GDPO), the update loop, EMA, checkpoints and resume are the trainer's.

Variants, all by config (see ``configs/llm_*.yaml``):

- GRPO: ``llm.aggregation=grpo``, ``llm.level=token``.
- Dr. GRPO: ``training.adv_scale=none`` + ``llm.aggregation=dr_grpo``.
- DAPO: ``training.clip_high > clip_low`` (clip-higher), ``llm.aggregation=dapo``,
  ``llm.dynamic_sampling`` (refill zero-variance groups), ``llm.overlong_buffer`` (soft overlong
  punishment), ``llm.mask_truncated`` (truncated completions leave the loss).
- GSPO: ``llm.level=sequence``.
- GDPO (several rewards): ``rewards.aggregation=decoupled``.

On-policy replay: after generation, ``logp_old`` is recomputed by ``token_logp`` on exactly the
replay batches (same rows, padding, dtype, mode and code path) that the update replays, so the
first inner pass has ratio == 1 exactly. Sampling is seeded per (seed, iteration, round, sample):
each row draws its tokens from its own generator (``SeededSampler``), so a batch split over
several processes samples what one process would.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from flowgrpo.advantages import PER_COMPONENT
from flowgrpo.config import TrainConfig, eval_noise_seed
from flowgrpo.dtypes import parse_dtype
from flowgrpo.errors import ConfigError
from flowgrpo.heldout import load_eval_rewards, score_eval_rewards
from flowgrpo.lm_sampling import (eos_token_ids, generate_completions, pad_replay_inputs,
                                  token_logp)
from flowgrpo.token_losses import token_policy_loss
from flowgrpo.passk import mean_and_se
from flowgrpo.policy import eval_share, float32_trainable, frozen_reference, gather_rows
from flowgrpo.prompts import sample_groups
from flowgrpo.seeding import seeded_generator
from reward_models import MultiReward, check_reward_names
from reward_models.text import ExactMatchReward, load_text_reward, text_reward_names

# Attention projections of common causal LMs (Llama/Qwen/Mistral, GPT-2, GPT-NeoX, MPT).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "query_key_value", "Wqkv")
MODEL_OPTIONS = ("attn_implementation", "revision", "trust_remote_code")
OVERLONG_KEY = "overlong"


# --------------------------------------------------------------------------- data


@dataclass
class LanguagePolicy:
    """The causal LM and its tokenizer. ``transformer`` is named as in ``FlowModel``: it is what
    LoRA wraps, what trains, and what ``LMPolicy.reference_policy`` swaps for a frozen copy."""

    transformer: nn.Module
    tokenizer: object


@dataclass
class TokenReplayBatch:
    """One replayed forward pass: b rows, prompts left-padded to P tokens, completions
    right-padded to C tokens.

    Shapes: rows (b,) indices into the rollout batch; input_ids / attention_mask (b, P + C) int64;
    completion_mask (b, C) float32, 1 on completion tokens that enter the loss (up to and including
    EOS; 0 on padding and, with ``llm.mask_truncated``, on truncated completions); logp_old (b, C)
    float32 token log-probs at rollout time (0 on padding).
    """

    rows: Tensor
    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    logp_old: Tensor
    prompt_length: int

    @property
    def valid_mask(self) -> Tensor:
        """(b, C) bool: generated completion tokens, including those masked out of the loss."""
        return self.attention_mask[:, self.prompt_length:].bool()


@dataclass
class TokenRolloutBatch:
    """One iteration's language rollouts (the ``RolloutBatch`` of ``policy: llm``). B = local rows.

    completion_lengths (B,) int64 counts completion tokens including EOS; truncated (B,) bool marks
    completions that reached ``llm.max_new_tokens`` without EOS."""

    prompts: list[str]
    metadata: list[dict]
    group_ids: Tensor
    sample_ids: Tensor
    completions: list[str]
    completion_lengths: Tensor
    truncated: Tensor
    replay: list[TokenReplayBatch] = field(default_factory=list)
    nfe: int = 0

    @property
    def trained_transitions(self) -> int:
        """Completion tokens that enter the loss."""
        return int(sum(float(r.completion_mask.sum()) for r in self.replay))


def disable_dropout(module: nn.Module) -> None:
    """Zero every dropout of a model (nn.Dropout and functional ``attention_dropout`` rates), so
    rollout and replay compute the same function whatever the module's train/eval mode."""
    for child in module.modules():
        if isinstance(child, nn.Dropout):
            child.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(child, name, None), float):
                setattr(child, name, 0.0)


def default_lora_targets(module: nn.Module) -> list[str]:
    """Names of the attention projections present in ``module`` (``DEFAULT_LORA_TARGETS``), or
    else every linear layer's name except the output head. For GPT-2 this is ``c_attn`` (the
    fused q/k/v projection)."""
    from transformers.pytorch_utils import Conv1D   # GPT-2's linear layers

    linear = {name.rsplit(".", 1)[-1] for name, child in module.named_modules()
              if isinstance(child, (nn.Linear, Conv1D))}
    found = sorted(linear & set(DEFAULT_LORA_TARGETS))
    return found or sorted(linear - {"lm_head"})


# --------------------------------------------------------------------------- rewards


def text_rewards(config: TrainConfig):
    """The config's text rewards combined like image rewards (``reward_models.MultiReward`` with
    ``load_text_reward``): every component and ``"total"``. With DAPO's overlong shaping on
    (``llm.overlong_buffer > 0``), ``"overlong"`` (``reward_models.text.OverlongReward``) is one
    more component of weight 1, so GDPO normalises it apart."""
    specs = [{"name": c.name, "weight": c.weight, **c.options} for c in config.rewards.components]
    llm = config.llm
    if llm.overlong_buffer > 0:
        if any((spec.get("label") or spec["name"]) == OVERLONG_KEY for spec in specs):
            raise ConfigError(f"rewards.components: the label {OVERLONG_KEY!r} is taken by "
                              f"llm.overlong_buffer's shaping; give the component another label")
        specs.append({"name": "overlong", "label": OVERLONG_KEY, "weight": 1.0,
                      "max_new_tokens": llm.max_new_tokens, "buffer": llm.overlong_buffer,
                      "penalty": llm.overlong_penalty})
    return MultiReward(specs, config.rewards.aggregation, load=load_text_reward)


def eval_text_rewards(config: TrainConfig, training):
    """``eval.rewards`` as text rewards (held-out metrics of the evaluation's completions, never
    trained on); None when there are none. ``training``: the training MultiReward, whose keys
    the held-out ones must not reuse."""
    return load_eval_rewards(config, "cpu", load_text_reward, MultiReward, training=training)


def with_token_counts(metadata: list[dict], completion_ids: list[list[int]]) -> list[dict]:
    """Copies of ``metadata`` with ``completion_tokens`` (what the overlong reward reads)."""
    return [{**m, "completion_tokens": len(ids)} for m, ids in zip(metadata, completion_ids)]


def zero_variance_groups(values: dict[str, Tensor], group_ids: Tensor) -> set[int]:
    """Group ids in which every reward of ``values`` ({key: (B,)}) is constant over the group's
    valid (non-NaN) samples, or that have fewer than two valid samples: no learning signal."""
    flat = set()
    for group in group_ids.unique().tolist():
        members = group_ids == group
        has_signal = False
        for scores in values.values():
            valid = scores[members][~scores[members].isnan()]
            if len(valid) >= 2 and bool(valid.max() > valid.min()):
                has_signal = True
                break
        if not has_signal:
            flat.add(int(group))
    return flat


# --------------------------------------------------------------------------- trainer


class LMPolicy:
    """GRPO and its variants for causal LMs (``policy: llm``): the policy half of ``Trainer``."""

    @staticmethod
    def check_config(config: TrainConfig) -> None:
        """At config load: the model options ``from_pretrained`` takes here, and the held-out
        metrics' text reward names."""
        unknown = sorted(set(config.model.options) - set(MODEL_OPTIONS))
        if unknown:
            raise ConfigError(f"model.options.{unknown[0]} is not an option of policy llm; "
                              f"valid: {', '.join(MODEL_OPTIONS)}")
        check_reward_names(config.eval.rewards, "eval.rewards", text_reward_names(),
                           kind="text reward")

    @staticmethod
    def check_model_source(config: TrainConfig) -> None:
        """Nothing before the load: transformers' own errors name the model."""

    def __init__(self, config: TrainConfig, accelerator, train_records: list[dict],
                 model: LanguagePolicy | None = None) -> None:
        if config.policy != "llm":
            raise ConfigError(f"policy must be 'llm' for LMPolicy (got {config.policy!r})")
        self.config = config
        self.accelerator = accelerator
        self.train_records = train_records   # DAPO's dynamic sampling draws fresh prompts
        self.tokens_per_replay = 1.0
        self.reward = text_rewards(config)
        self.eval_reward = eval_text_rewards(config, self.reward)
        self.model = model if model is not None else self._load(config, accelerator.device)
        tokenizer = self.model.tokenizer
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.module = self.model.transformer
        eos_token_ids(self.module, tokenizer)   # fail now, not at the first rollout, without EOS
        disable_dropout(self.module)
        self.trainable = self._setup_trainable(default_lora_targets(self.module))
        self.reference_module = frozen_reference(config, self.module)
        # Eval mode, or train mode when gradient checkpointing needs it (dropout is off either
        # way, so rollouts and replays compute the same function).
        self.module.train(config.model.gradient_checkpointing)
        self.engine_module: nn.Module = self.module
        self.accumulation_steps = config.training.gradient_accumulation_steps
        self.ema_updates_per_step = config.training.ema.updates_per_step or 1

    @staticmethod
    def _load(config: TrainConfig, device) -> LanguagePolicy:
        """``AutoModelForCausalLM`` + ``AutoTokenizer`` from ``model.path`` (hub id or folder)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer   # a second to import

        m = config.model
        options = dict(m.options)
        tokenizer = AutoTokenizer.from_pretrained(
            m.path, **{k: v for k, v in options.items() if k != "attn_implementation"})
        module = AutoModelForCausalLM.from_pretrained(m.path, dtype=parse_dtype(m.dtype), **options)
        return LanguagePolicy(module.to(device), tokenizer)

    def _setup_trainable(self, default_targets: list[str]) -> dict[str, nn.Parameter]:
        """Full fine-tuning, or LoRA on the attention projections through
        ``peft.get_peft_model`` (a ``PeftModel`` wrapping the LM, because transformers' own
        ``add_adapter`` needs a newer PEFT than the one pinned here). Sets ``self.module`` and
        ``self.model.transformer`` to the wrapped LM."""
        m = self.config.model
        if not m.lora.enabled:
            self.module.requires_grad_(True)
            if m.gradient_checkpointing:
                self.module.gradient_checkpointing_enable()
            return {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        from peft import LoraConfig, get_peft_model   # peft takes seconds to import

        self.module.requires_grad_(False)
        if m.gradient_checkpointing:
            self.module.gradient_checkpointing_enable()
            self.module.enable_input_require_grads()
        self.module = get_peft_model(self.module, LoraConfig(
            r=m.lora.rank, lora_alpha=m.lora.alpha, task_type="CAUSAL_LM",
            target_modules=m.lora.target_modules or default_targets,
            init_lora_weights="gaussian" if m.lora.init == "gaussian" else True))
        self.model.transformer = self.module
        return float32_trainable(self.module)

    def bind(self, engine_module: nn.Module, sharded: bool) -> None:
        # Generation runs on the unwrapped module (``check_engine`` refuses sharded LMs); the
        # replay's forward runs through the engine.
        self.engine_module = engine_module

    @contextmanager
    def reference_policy(self):
        """The KL reference: the LM with its LoRA adapter disabled, or the frozen copy kept for
        full fine-tuning."""
        if self.reference_module is not None:
            live = self.model.transformer
            self.model.transformer = self.reference_module
            try:
                yield
            finally:
                self.model.transformer = live
        else:
            with self.module.disable_adapter():
                yield

    def sample_completions(self, prompts: list[str], iteration: int, round_index: int,
                           sample_ids: list[int]
                           ) -> tuple[list[list[int]], list[list[int]], list[bool]]:
        """``generate_completions`` at the rollout temperature / top-p, each sample drawing from
        its own generator seeded by (seed, iteration, round, sample id)."""
        llm = self.config.llm
        generators = [seeded_generator(self.config.run.seed, iteration, "tokens", round_index, s)
                      for s in sample_ids]
        with self.accelerator.autocast():
            return generate_completions(
                self.module, self.model.tokenizer, prompts, max_new_tokens=llm.max_new_tokens,
                batch_size=self.config.sampling.rollout_batch_size, temperature=llm.temperature,
                top_p=llm.top_p, generators=generators)

    def rollout(self, records: list[dict], group_ids: Tensor, sample_ids: Tensor, iteration: int
                ) -> tuple[TokenRolloutBatch, dict[str, Tensor], dict]:
        """Sample ``group_size`` completions per prompt, score them, and recompute ``logp_old``
        on the replay batches. With ``llm.dynamic_sampling`` (DAPO), groups whose rewards have
        no variance get a fresh prompt and are resampled, up to ``llm.max_resample_rounds``."""
        cfg, llm, acc = self.config, self.config.llm, self.accelerator
        records = list(records)
        batch = len(records)
        prompt_ids: list[list[int]] = [[] for _ in range(batch)]
        completion_ids: list[list[int]] = [[] for _ in range(batch)]
        truncated = [False] * batch
        completions = [""] * batch
        rewards: dict[str, Tensor] = {}
        signal_keys = (list(self.reward.weights) if cfg.rewards.aggregation in PER_COMPONENT
                       else ["total"])
        rows = list(range(batch))
        rollout_seconds = reward_seconds = 0.0
        rounds = 1 + (llm.max_resample_rounds if llm.dynamic_sampling else 0)
        resampled = flat_groups = 0
        for round_index in range(rounds):
            if round_index > 0:
                # Refill each flat group's slot with a fresh prompt of this round.
                fresh = sample_groups(self.train_records, cfg.training.prompts_per_iteration,
                                      cfg.run.seed, f"{iteration}/resample{round_index}",
                                      cfg.prompts.balance_key,
                                      bucket_weights=cfg.prompts.balance_weights)
                for row in rows:
                    records[row] = fresh[int(group_ids[row])]
            if rows:   # after round 0, a process may hold no row of a flat group
                began = time.perf_counter()
                sampled = self.sample_completions([records[r]["prompt"] for r in rows],
                                                  iteration, round_index,
                                                  [int(sample_ids[r]) for r in rows])
                rollout_seconds += time.perf_counter() - began
                for row, p, c, t in zip(rows, *sampled):
                    prompt_ids[row], completion_ids[row], truncated[row] = p, c, t
                    completions[row] = self.model.tokenizer.decode(c, skip_special_tokens=True)
                began = time.perf_counter()
                scores = self.reward([completions[r] for r in rows],
                                     [records[r]["prompt"] for r in rows],
                                     with_token_counts([records[r]["metadata"] for r in rows],
                                                       [completion_ids[r] for r in rows]))
                reward_seconds += time.perf_counter() - began
                index = torch.tensor(rows, dtype=torch.long)
                for name, values in scores.items():
                    rewards.setdefault(name, torch.full((batch,), float("nan")))[index] = values
            if not llm.dynamic_sampling:
                break
            flat = zero_variance_groups(
                {k: acc.gather(rewards[k].to(acc.device)).cpu() for k in signal_keys},
                acc.gather(group_ids.to(acc.device)).cpu())
            flat_groups = len(flat)
            if not flat or round_index == rounds - 1:
                break
            resampled += len(flat)
            rows = [r for r in range(batch) if int(group_ids[r]) in flat]

        lengths = torch.tensor([len(c) for c in completion_ids])
        rollout = TokenRolloutBatch(
            prompts=[r["prompt"] for r in records], metadata=[r["metadata"] for r in records],
            group_ids=group_ids, sample_ids=sample_ids, completions=completions,
            completion_lengths=lengths, truncated=torch.tensor(truncated),
            nfe=int(lengths.max()) if batch else 0)
        began = time.perf_counter()
        rollout.replay = self.build_replays(prompt_ids, completion_ids, truncated)
        info = {"time/rollout": rollout_seconds + time.perf_counter() - began,
                "time/reward_wait": 0.0, "time/reward_compute": reward_seconds,
                "rollout/completion_length": float(lengths.float().mean()),
                "rollout/truncated_fraction": float(torch.tensor(truncated).float().mean()),
                "rollout/resampled_groups": float(resampled)}
        if llm.dynamic_sampling:
            info["rollout/zero_std_groups"] = float(flat_groups)
        return rollout, rewards, info

    @torch.no_grad()
    def build_replays(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                      truncated: list[bool]) -> list[TokenReplayBatch]:
        """Chunk the rows into ``sampling.rollout_batch_size`` replay batches and score their
        tokens under the rollout policy in exactly the geometry ``replay_loss`` uses."""
        size = self.config.sampling.rollout_batch_size
        device = self.accelerator.device
        replays = []
        for start in range(0, len(prompt_ids), size):
            rows = torch.arange(start, min(start + size, len(prompt_ids)))
            input_ids, attention_mask, prompt_length = pad_replay_inputs(
                [prompt_ids[r] for r in rows], [completion_ids[r] for r in rows],
                self.model.tokenizer.pad_token_id)
            completion_mask = attention_mask[:, prompt_length:].float()
            if self.config.llm.mask_truncated:
                completion_mask[torch.tensor([truncated[r] for r in rows])] = 0.0
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            with self.accelerator.autocast():
                logp_old = token_logp(self.module, input_ids, attention_mask, prompt_length,
                                      self.config.llm.temperature)
            valid = attention_mask[:, prompt_length:].bool()
            replays.append(TokenReplayBatch(
                rows=rows, input_ids=input_ids, attention_mask=attention_mask,
                completion_mask=completion_mask.to(device),
                logp_old=torch.where(valid, logp_old, torch.zeros_like(logp_old)),
                prompt_length=prompt_length))
        return replays

    def step_weights(self, replays: list) -> list[Tensor]:
        """Ones (every completion token counts alike). Also fixes the iteration's DAPO token
        normaliser: the mean number of loss tokens per replay batch over all processes, which
        with the loop's division by the batches per step gives sum(l m) / (global tokens)."""
        acc = self.accelerator
        tokens = torch.tensor([sum(float(r.completion_mask.sum()) for r in replays),
                               float(len(replays))], device=acc.device)
        if acc.num_processes > 1:
            tokens = acc.gather(tokens.unsqueeze(0)).sum(0)
        self.tokens_per_replay = max(float(tokens[0]) / max(float(tokens[1]), 1.0), 1.0)
        return [torch.ones(len(r.rows), device=r.logp_old.device) for r in replays]

    def replay_loss(self, batch: TokenRolloutBatch, replay: TokenReplayBatch, advantages: Tensor,
                    iteration: int, clip_high: float, weights: Tensor
                    ) -> tuple[Tensor, dict[str, Tensor]]:
        """token_policy_loss of one replay batch (+ k3 KL to the reference when kl_beta > 0).
        Returns the loss and detached stats, including ``ratio_max_dev`` (max |ratio - 1| over
        the generated tokens). ``weights`` scales every row's loss (0 for a padding pass)."""
        t, llm = self.config.training, self.config.llm
        logp = token_logp(self.engine_module, replay.input_ids, replay.attention_mask,
                          replay.prompt_length, llm.temperature)
        logp_ref = None
        if t.kl_beta > 0:
            with torch.no_grad(), self.reference_policy():
                logp_ref = token_logp(self.model.transformer, replay.input_ids,
                                      replay.attention_mask, replay.prompt_length, llm.temperature)
        loss, stats = token_policy_loss(
            logp, replay.logp_old, advantages[replay.rows].to(logp.device), replay.completion_mask,
            clip_low=t.clip_low, clip_high=clip_high, aggregation=llm.aggregation, level=llm.level,
            max_len=max(llm.max_new_tokens, logp.shape[1]),
            num_tokens_global=self.tokens_per_replay if llm.aggregation == "dapo" else None,
            logp_ref=logp_ref, beta=t.kl_beta)
        valid = replay.valid_mask
        deviation = (torch.exp(logp.detach() - replay.logp_old) - 1).abs()
        stats["ratio_max_dev"] = torch.where(valid, deviation, torch.zeros_like(deviation)).max()
        stats["policy_loss"] = loss.detach()
        return loss, stats

    def update_metrics(self, rows: dict[str, Tensor], clip_high: float) -> dict[str, Tensor]:
        """Token-level stats are already reduced per replay batch: their mean over the update."""
        return {key: values.float().mean() for key, values in rows.items()}

    # The LM trains with GRPO's token loss only: no algorithm state or hooks.
    def after_optimizer_step(self) -> None:
        pass

    def after_update(self) -> dict[str, float]:
        return {}

    def algorithm_state(self) -> tuple[dict, dict[str, Tensor]]:
        return {}, {}

    def load_algorithm_state(self, state: dict, tensors: dict[str, Tensor]) -> None:
        pass

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, records: list[dict], iteration: int, out_dir: Path | None
                 ) -> dict[str, float]:
        """Held-out prompts, greedy (or ``llm.eval_temperature``): the mean (and standard error)
        of every reward component and of every held-out metric (``eval.rewards``),
        ``eval/accuracy`` (exact match against ``metadata["answer"]``, when the prompts
        have answers), the mean completion length and truncated fraction. Writes the completions
        to ``out_dir/eval_<iteration>.jsonl`` when given."""
        if not records:
            return {}
        llm, acc = self.config.llm, self.accelerator
        seeds = self.config.prompts.eval_seeds if llm.eval_temperature > 0 else 1
        records = [r for r in records for _ in range(seeds)]
        # Every process generates its share (sample i keeps its generator whatever the process
        # count); the rows are gathered so every process returns the metrics of all of them.
        indices, real = eval_share(len(records), acc.num_processes, acc.process_index)
        prompts = [records[i]["prompt"] for i in indices]
        generators = None
        if llm.eval_temperature > 0:
            generators = [seeded_generator(eval_noise_seed(self.config), "eval", i)
                          for i in indices]
        with self.accelerator.autocast():
            _, completion_ids, truncated = generate_completions(
                self.module, self.model.tokenizer, prompts, max_new_tokens=llm.max_new_tokens,
                batch_size=max(self.config.sampling.rollout_batch_size, 64),
                temperature=llm.eval_temperature or 1.0, top_p=llm.top_p, generators=generators)
        mine = indices[:real]
        completions = [self.model.tokenizer.decode(c, skip_special_tokens=True)
                       for c in completion_ids[:real]]
        metadata = [records[i]["metadata"] for i in mine]
        lengths = torch.tensor([len(c) for c in completion_ids[:real]])
        scored = with_token_counts(metadata, completion_ids[:real])
        prompts_mine = [records[i]["prompt"] for i in mine]
        scores = self.reward(completions, prompts_mine, scored) if real else {}
        # Held-out metrics of eval.rewards: the same completions, logged, never trained on.
        scores.update(score_eval_rewards(self.eval_reward, completions, prompts_mine, scored))
        has_answers = any(r["metadata"].get("answer") is not None for r in records)
        correct = (ExactMatchReward()(completions, [records[i]["prompt"] for i in mine],
                                      metadata) if has_answers and real else None)
        rows = gather_rows([{"scores": {k: float(v[j]) for k, v in scores.items()},
                             "completion": completions[j], "length": int(lengths[j]),
                             "truncated": bool(truncated[j]),
                             "correct": None if correct is None else float(correct[j])}
                            for j in range(real)], acc)
        metrics: dict[str, float] = {}
        for name in rows[0]["scores"] if rows else []:
            values = torch.tensor([row["scores"][name] for row in rows])
            valid = values[~values.isnan()]
            metrics[f"eval/{name}"] = float(valid.mean()) if len(valid) else float("nan")
            metrics[f"eval/{name}/se"] = mean_and_se(valid)[1]
        if has_answers:
            correct_all = torch.tensor([row["correct"] for row in rows])
            metrics["eval/accuracy"] = float(correct_all[~correct_all.isnan()].mean())
        metrics["eval/completion_length"] = float(torch.tensor(
            [row["length"] for row in rows], dtype=torch.float32).mean())
        metrics["eval/truncated_fraction"] = float(torch.tensor(
            [row["truncated"] for row in rows], dtype=torch.float32).mean())
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            with open(out_dir / f"eval_{iteration:05d}.jsonl", "w") as f:
                for record, row in list(zip(records, rows))[:64]:
                    f.write(json.dumps({"prompt": record["prompt"], "completion": row["completion"],
                                        "total": row["scores"].get("total")}) + "\n")
        return metrics

    def greedy_completions(self, records: list[dict]) -> dict[str, list]:
        """Greedy completions of ``records``' prompts: {"completions": [str], "lengths": [n]}."""
        with self.accelerator.autocast():
            _, completion_ids, _ = generate_completions(
                self.module, self.model.tokenizer, [r["prompt"] for r in records],
                max_new_tokens=self.config.llm.max_new_tokens,
                batch_size=max(self.config.sampling.rollout_batch_size, 64))
        return {"completions": [self.model.tokenizer.decode(c, skip_special_tokens=True)
                                for c in completion_ids],
                "lengths": [len(c) for c in completion_ids]}

    def save_grid_samples(self, records: list[dict], run_dir: Path, tag: str) -> None:
        """Greedy completions of the comparison prompts, saved as ``grid_<tag>.json``."""
        if records:
            (run_dir / f"grid_{tag}.json").write_text(json.dumps(self.greedy_completions(records)))

    def write_comparison_grid(self, records: list[dict], run_dir: Path, final_label: str
                              ) -> Path | None:
        """``run_dir/comparison.md``: held-out prompts, the base and the final model's greedy
        completions and their total rewards, one table row per prompt."""
        base_path = run_dir / "grid_base.json"
        if not base_path.is_file() or not records:
            return None
        self.save_grid_samples(records, run_dir, "final")
        prompts = [r["prompt"] for r in records]
        metadata = [r["metadata"] for r in records]
        saved = [json.loads(base_path.read_text()),
                 json.loads((run_dir / "grid_final.json").read_text())]
        columns = [s["completions"] for s in saved]
        scores = [self.reward(s["completions"], prompts,
                              [{**m, "completion_tokens": n} for m, n in zip(metadata, s["lengths"])]
                              )["total"] for s in saved]
        lines = [f"| prompt | base | {final_label} |", "|---|---|---|"]
        for row, prompt in enumerate(prompts):
            cells = [f"`{columns[c][row]}` ({float(scores[c][row]):.2f})" for c in range(2)]
            lines.append(f"| `{prompt}` | {cells[0]} | {cells[1]} |")
        path = run_dir / "comparison.md"
        path.write_text("\n".join(lines) + "\n")
        return path

    # ------------------------------------------------------------------ weights
    def save_weights(self, folder: str, state_dict: dict[str, Tensor] | None = None) -> None:
        """``save_pretrained`` of the policy and its tokenizer: with LoRA the PEFT adapter
        (``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)`` or
        ``model.load_adapter(folder)``), else the full model (``from_pretrained(folder)``)."""
        self.module.save_pretrained(folder, state_dict=state_dict)
        self.model.tokenizer.save_pretrained(folder)
