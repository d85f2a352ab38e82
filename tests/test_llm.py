"""Causal-LM policies on the shared GRPO core: on-policy replay for every variant, seeded
sampling, token log-probs, DAPO pieces, text rewards, checkpoints loadable by PEFT, learning."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flowgrpo.config import ConfigError, dump_config, load_config
from flowgrpo.llm import text_rewards, zero_variance_groups
from flowgrpo.lm_sampling import (SeededSampler, build_char_tokenizer, generate_completions,
                                  pad_replay_inputs, token_logp, top_p_filter)
from flowgrpo.prompts import sample_groups
from flowgrpo.seeding import seeded_generator
from flowgrpo.trainer import Trainer
from reward_models import MultiReward
from reward_models.text import (ExactMatchReward, LengthReward, RegexFormatReward,
                                extract_answer, load_text_reward, normalize_answer,
                                overlong_penalty)
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]

ALPHABET = "0123456789+-*= "
ASSET = Path(__file__).resolve().parents[1] / "assets" / "lm"


# --------------------------------------------------------------------------- rewards by path


def char_sum(completions: list[str], prompts: list[str], metadata: list[dict]) -> list[float]:
    """A reward that varies with the sampled text (so groups carry signal on a random model)."""
    return [float(sum(ord(c) for c in text) % 7) for text in completions]


def flat_for_even(completions: list[str], prompts: list[str], metadata: list[dict]) -> list[float]:
    """Constant (no group variance) for prompts whose first operand is even, else char_sum."""
    varied = char_sum(completions, prompts, metadata)
    return [0.0 if m["a"] % 2 == 0 else v for m, v in zip(metadata, varied)]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_lm_path(tmp_path_factory) -> str:
    """A tiny random Llama + char tokenizer saved like a hub folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_lm")
    tokenizer = build_char_tokenizer(ALPHABET, folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    generator_state = torch.get_rng_state()
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    torch.set_rng_state(generator_state)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_gpt2_path(tmp_path_factory) -> str:
    """A tiny random GPT-2 (absolute position embeddings, dropout on by default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("tiny_gpt2")
    tokenizer = build_char_tokenizer(ALPHABET, folder)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    generator_state = torch.get_rng_state()
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    torch.set_rng_state(generator_state)
    return str(folder)


@pytest.fixture(scope="session")
def prompts_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("lm_prompts")
    lines = [json.dumps({"prompt": f"{a}+{b}=", "metadata": {"answer": str(a + b), "a": a}})
             for a in range(0, 40, 3) for b in (1, 12)]
    (folder / "arith.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder / "arith.jsonl")


def llm_config(model_path: str, prompts: str, tmp_path, *overrides: str):
    data = {
        "name": "tiny_llm", "policy": "llm",
        "model": {"path": model_path, "lora": {"rank": 4, "alpha": 8}},
        "prompts": {"train": prompts, "eval": prompts, "num_eval": 8},
        "sampling": {"rollout_batch_size": 4},
        "training": {"prompts_per_iteration": 2, "group_size": 4, "lr": 1e-3, "clip_low": 0.2,
                     "skip_zero_std_groups": False},
        "rewards": {"components": [{"name": "tests.test_llm:char_sum"}], "threaded": False},
        "llm": {"max_new_tokens": 5},
        "run": {"output_dir": str(tmp_path / "runs"), "max_iterations": 1, "tracker": "none",
                "progress": False, "eval_every": 0, "checkpoint_every": 0},
    }
    return load_config(data=data, overrides=list(overrides))


VARIANTS = {
    "grpo": [],
    "dr_grpo": ["training.adv_scale=none", "llm.aggregation=dr_grpo"],
    "dapo": ["llm.aggregation=dapo", "training.clip_high=0.28", "llm.dynamic_sampling=true",
             "llm.overlong_buffer=2", "llm.mask_truncated=true"],
    "gspo": ["llm.level=sequence", "training.clip_low=0.0003", "training.clip_high=0.0004"],
    "gdpo": ["rewards.aggregation=decoupled",
             "rewards.components=[{name: 'tests.test_llm:char_sum'}, {name: length, "
             "weight: 0.5, options: {target: 2}}]"],
    "bnpo_top_p": ["llm.aggregation=bnpo", "llm.temperature=0.7", "llm.top_p=0.9"],
    "lora_kl": ["training.kl_beta=0.04"],
    "full_kl": ["model.lora.enabled=false", "training.kl_beta=0.04"],
    "two_epochs": ["training.num_inner_epochs=2"],
}


# --------------------------------------------------------------------------- on-policy replay


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["gpt2"])
def test_ratio_is_one_on_first_pass(variant, tiny_lm_path, tiny_gpt2_path, prompts_path, tmp_path):
    path = tiny_gpt2_path if variant == "gpt2" else tiny_lm_path
    trainer = Trainer(llm_config(path, prompts_path, tmp_path, *VARIANTS.get(variant, [])))
    metrics = trainer.run_iteration(0)
    assert metrics["train/replay_batches"] == 2
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    assert math.isfinite(metrics["train/policy_loss"])


def test_kl_is_zero_at_the_reference_and_grows(tiny_lm_path, prompts_path, tmp_path):
    trainer = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path, "training.kl_beta=0.1",
                                    "model.lora.init=default", "training.lr=0.05"))
    first = trainer.run_iteration(0)
    assert first["train/kl"] == 0.0            # LoRA B = 0: policy == reference
    later = trainer.run_iteration(1)
    assert later["train/kl"] > 0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_token_log_probs(sign, tiny_lm_path, prompts_path, tmp_path):
    trainer = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path, "training.lr=1e-2",
                                    "training.clip_low=1.0", "training.clip_high=10",
                                    "training.max_grad_norm=0"))
    batch, _, _ = trainer.rollout_and_score(0)
    trainer.update(batch, torch.full((len(batch.prompts),), sign), 0)
    change = []
    with torch.no_grad():
        for r in batch.replay:
            logp = token_logp(trainer.module, r.input_ids, r.attention_mask, r.prompt_length)
            change.append(((logp - r.logp_old) * r.completion_mask).sum() / r.completion_mask.sum())
    assert sign * float(torch.stack(change).mean()) > 0


# --------------------------------------------------------------------------- sampling and log-probs


def load_tiny(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return AutoModelForCausalLM.from_pretrained(path).eval(), tokenizer


PROMPTS = ["1+2=", "13+27=", "5+30=", "22+9=", "0+0=", "7+18=", "31+4=", "9+9="]


def test_seeded_sampling_does_not_depend_on_batch_composition(tiny_lm_path):
    model, tokenizer = load_tiny(tiny_lm_path)

    def gens(ids):
        return [seeded_generator(0, 3, "tokens", 0, i) for i in ids]

    together = generate_completions(model, tokenizer, PROMPTS, max_new_tokens=5, batch_size=8,
                                    generators=gens(range(8)))[1]
    # Two "processes" holding half the rows each, different generate batch sizes.
    first = generate_completions(model, tokenizer, PROMPTS[:4], max_new_tokens=5, batch_size=3,
                                 generators=gens(range(4)))[1]
    second = generate_completions(model, tokenizer, PROMPTS[4:], max_new_tokens=5, batch_size=1,
                                  generators=gens(range(4, 8)))[1]
    assert together == first + second
    other_seed = generate_completions(model, tokenizer, PROMPTS, max_new_tokens=5, batch_size=8,
                                      generators=[seeded_generator(1, 3, "tokens", 0, i)
                                                  for i in range(8)])[1]
    assert other_seed != together


def test_recomputed_logp_matches_the_generation_logits(tiny_lm_path):
    """logp_old (full forward, replay geometry) equals the log-probs generate sampled from."""
    model, tokenizer = load_tiny(tiny_lm_path)
    from transformers import GenerationConfig, LogitsProcessorList

    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    out = model.generate(**encoded, generation_config=GenerationConfig(
        max_new_tokens=5, do_sample=False, eos_token_id=2, pad_token_id=0),
        logits_processor=LogitsProcessorList([SeededSampler(
            [seeded_generator(0, i) for i in range(8)], 1.0, 1.0)]),
        output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[:, encoded["input_ids"].shape[1]:]
    from_generate = torch.stack([torch.log_softmax(step.float(), -1).gather(
        -1, tokens[:, t:t + 1]).squeeze(-1) for t, step in enumerate(out.logits)], dim=1)
    prompt_ids = [ids[mask.bool()].tolist() for ids, mask in
                  zip(encoded["input_ids"], encoded["attention_mask"])]
    input_ids, attention_mask, prompt_length = pad_replay_inputs(prompt_ids, tokens.tolist(), 0)
    with torch.no_grad():
        recomputed = token_logp(model, input_ids, attention_mask, prompt_length)
    torch.testing.assert_close(recomputed, from_generate, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_token_logp_matches_unpadded_sequences(family, tiny_lm_path, tiny_gpt2_path):
    model, tokenizer = load_tiny(tiny_gpt2_path if family == "gpt2" else tiny_lm_path)
    prompts = [tokenizer(p)["input_ids"] for p in ["1+2=", "13+27="]]
    completions = [[5, 6, 2], [7]]
    input_ids, attention_mask, prompt_length = pad_replay_inputs(prompts, completions, 0)
    assert input_ids.shape == (2, 7 + 3) and prompt_length == 7
    assert attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
                                       [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]]
    with torch.no_grad():
        batched = token_logp(model, input_ids, attention_mask, prompt_length, temperature=0.5)
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            ids = torch.tensor([prompt + completion])
            logits = model(ids).logits[0, len(prompt) - 1:-1].float() / 0.5
            alone = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            torch.testing.assert_close(batched[row, :len(completion)], alone, atol=1e-5, rtol=0)


def test_seeded_sampler_draws_from_the_tempered_nucleus():
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    sampler = SeededSampler([seeded_generator(5, i) for i in range(4000)], temperature=0.5, top_p=1.0)
    choice = sampler(None, scores).argmax(-1)
    frequency = torch.bincount(choice, minlength=4).float() / 4000
    expected = torch.softmax(scores[0] / 0.5, -1)
    torch.testing.assert_close(frequency, expected, atol=0.02, rtol=0)
    nucleus = SeededSampler([seeded_generator(5, i) for i in range(4000)], 1.0, top_p=0.7)
    picked = nucleus(None, scores).argmax(-1)
    assert set(picked.tolist()) == {0, 1}      # p = .64, .24, .09, .03: the nucleus of 0.7 is {0, 1}


def test_top_p_filter_closed_form():
    probs = torch.tensor([[0.5, 0.2, 0.3]])
    torch.testing.assert_close(top_p_filter(probs, 0.7), torch.tensor([[0.625, 0.0, 0.375]]))
    torch.testing.assert_close(top_p_filter(probs, 0.5), torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)
    with pytest.raises(ValueError, match="top_p"):
        top_p_filter(probs, 0.0)


# --------------------------------------------------------------------------- DAPO pieces


def test_overlong_penalty_closed_form():
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]) * 0.5
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 0.5), expected)
    assert torch.equal(overlong_penalty(lengths, 10, 0, 1.0), torch.zeros(6))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 10, 11, 1.0)


def test_overlong_is_its_own_component_for_gdpo(tiny_lm_path, prompts_path, tmp_path):
    config = llm_config(tiny_lm_path, prompts_path, tmp_path, "llm.max_new_tokens=4",
                        "llm.overlong_buffer=2", "llm.overlong_penalty=1.0",
                        "rewards.aggregation=decoupled",
                        "rewards.components=[{name: 'tests.test_llm:char_sum', weight: 2.0}]")
    rewards = text_rewards(config)
    assert rewards.weights == {"char_sum": 2.0, "overlong": 1.0}
    out = rewards(["1", "22"], ["a", "b"], [{"completion_tokens": 2}, {"completion_tokens": 4}])
    torch.testing.assert_close(out["overlong"], torch.tensor([0.0, -1.0]))
    torch.testing.assert_close(out["total"], 2 * out["char_sum"] + out["overlong"])


def test_mask_truncated_removes_truncated_completions(tiny_lm_path, prompts_path, tmp_path):
    trainer = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path, "llm.mask_truncated=true",
                                    "llm.max_new_tokens=3"))
    batch, _, _ = trainer.rollout_and_score(0)
    for replay in batch.replay:
        truncated = batch.truncated[replay.rows]
        loss_tokens = replay.completion_mask.sum(1)
        assert (loss_tokens[truncated] == 0).all()
        assert torch.equal(loss_tokens[~truncated], batch.completion_lengths[replay.rows][~truncated]
                           .float())
    assert batch.truncated.any()


def test_dynamic_sampling_refills_flat_groups(tiny_lm_path, prompts_path, tmp_path):
    overrides = ["rewards.components=[{name: 'tests.test_llm:flat_for_even'}]",
                 "llm.dynamic_sampling=true", "llm.max_resample_rounds=6",
                 "training.prompts_per_iteration=4"]
    records = [json.loads(line) for line in Path(prompts_path).read_text().splitlines()]
    seed = next(s for s in range(100)
                if any(r["metadata"]["a"] % 2 == 0 for r in sample_groups(records, 4, s, 0)))
    trainer = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path, *overrides,
                                    f"run.seed={seed}"))
    first = sample_groups(records, 4, seed, 0)
    batch, rewards, info = trainer.rollout_and_score(0)
    flat_at_first = sum(r["metadata"]["a"] % 2 == 0 for r in first)
    assert info["rollout/resampled_groups"] >= flat_at_first > 0
    assert info["rollout/zero_std_groups"] == 0
    assert zero_variance_groups({"total": rewards["total"]}, batch.group_ids) == set()
    for row, group in enumerate(batch.group_ids.tolist()):
        assert batch.metadata[row]["a"] % 2 == 1
        if first[group]["metadata"]["a"] % 2 == 1:        # groups with signal keep their prompt
            assert batch.prompts[row] == first[group]["prompt"]


def test_dapo_token_normaliser_is_mean_tokens_per_replay(tiny_lm_path, prompts_path, tmp_path):
    trainer = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path, "llm.aggregation=dapo"))
    batch, _, _ = trainer.rollout_and_score(0)
    weights = trainer.policy.step_weights(batch.replay)
    assert all(torch.equal(w, torch.ones(4)) for w in weights)
    tokens = sum(float(r.completion_mask.sum()) for r in batch.replay)
    assert trainer.policy.tokens_per_replay == tokens / len(batch.replay)


# --------------------------------------------------------------------------- text rewards


@pytest.mark.parametrize("text, answer", [
    ("19", "19"), ("12+7=19", "19"), ("so the answer is 42.", "42"), ("#### 1,234", "1,234"),
    ("x \\boxed{7} then 9", "7"), ("no digits here", None), ("-3", "-3"), ("2.50", "2.50"),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_exact_match_and_format_and_length_rewards():
    completions = ["19", "20", "the sum is 1,234.0", "x"]
    metadata = [{"answer": 19}, {"answer": "19"}, {"answer": "1234"}, {}]
    prompts = ["p"] * 4
    scores = ExactMatchReward()(completions, prompts, metadata)
    assert scores[:3].tolist() == [1.0, 0.0, 1.0] and math.isnan(scores[3])
    assert ExactMatchReward(extract="full")(["19 ", "=19"], prompts[:2], metadata[:2]).tolist() == \
        [1.0, 0.0]
    assert normalize_answer("1,234.00") == normalize_answer(1234) == "1234"
    assert RegexFormatReward()(completions, prompts).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert RegexFormatReward(r"\d+", full_match=False)(completions, prompts).tolist() == \
        [1.0, 1.0, 1.0, 0.0]
    assert LengthReward(target=4)(["", "ab", "abcd", "abcdefgh"], prompts).tolist() == \
        [-1.0, -0.5, 0.0, -1.0]
    with pytest.raises(ValueError, match="prompts"):
        ExactMatchReward()(completions, prompts[:2], metadata)


def TextRewards(specs):   # noqa: N802  (the text rewards as the LM policy builds them)
    return MultiReward(specs, load=load_text_reward)


def test_text_rewards_resolve_names_paths_and_check_options():
    rewards = TextRewards([{"name": "exact_match"}, {"name": "regex_format", "weight": 0.5,
                                                     "pattern": "[0-9]+"},
                           {"name": "tests.test_llm:char_sum", "label": "chars", "weight": 0}])
    out = rewards(["19", "a"], ["p", "q"], [{"answer": "19"}, {"answer": "3"}])
    assert out["total"].tolist() == [1.5, 0.0]
    assert set(out) == {"exact_match", "regex_format", "chars", "total"}
    with pytest.raises(ValueError, match="no option 'patern'"):
        TextRewards([{"name": "regex_format", "patern": "x"}])
    with pytest.raises(ValueError, match="takes no options"):
        TextRewards([{"name": "tests.test_llm:char_sum", "scale": 2}])
    with pytest.raises(ValueError, match="unknown reward"):
        TextRewards([{"name": "no_such_reward"}])


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("override, field", [
    ("llm.overlong_buffer=9", "llm.overlong_buffer"),
    ("llm.max_resample_rounds=-1", "llm.max_resample_rounds"),
    ("model.options={foo: 1}", "model.options.foo"),
    ("rewards.components=[]", "rewards.components"),
])
def test_llm_config_errors_name_the_field(override, field, tiny_lm_path, prompts_path, tmp_path):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path, override))


@pytest.mark.parametrize("name", sorted(p.name for p in (ASSET.parents[1] / "configs").glob("llm_*.yaml")))
def test_shipped_llm_configs_validate(name):
    config = load_config(ASSET.parents[1] / "configs" / name)   # LMPolicy.check_config too
    assert config.policy == "llm"


# --------------------------------------------------------------------------- checkpoints and eval


def test_lora_checkpoint_loads_with_peft_and_matches_the_policy(tiny_lm_path, prompts_path,
                                                                 tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path, "run.max_iterations=2",
                                    "model.lora.init=default", "training.lr=0.05"))
    history = trainer.train()
    folder = trainer.run_dir / "checkpoints" / "2"
    assert (folder / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_path),
                                       str(folder)).eval()
    ids = torch.tensor([[1, 5, 14, 6, 17, 7]])
    with torch.no_grad():
        expected = trainer.module(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_lm_path).eval()(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, atol=1e-6, rtol=0)
    assert (expected - base).abs().max() > 1e-4        # the adapter did train
    evals = [h for h in history if h["phase"] == "eval"]
    assert [h["iteration"] for h in evals] == [0, 2]
    assert {"eval/accuracy", "eval/total", "eval/char_sum"} <= set(evals[0])
    lines = (trainer.run_dir / "samples" / "eval_00002.jsonl").read_text().splitlines()
    assert len(lines) == 8
    table = (trainer.run_dir / "comparison.md").read_text().splitlines()
    assert len(table) == 2 + 8 and table[2].startswith("| `0+1=` |")


def test_full_checkpoint_loads_with_auto_model(tiny_lm_path, prompts_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path,
                                    "model.lora.enabled=false", "training.lr=1e-2"))
    trainer.train()
    folder = trainer.run_dir / "checkpoints" / "1"
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert AutoTokenizer.from_pretrained(folder)("1+2=")["input_ids"] == [1, 5, 14, 6, 17]
    ids = torch.tensor([[1, 5, 14, 6, 17, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits,
                                   trainer.module(input_ids=ids).logits, atol=1e-6, rtol=0)


def test_resume_continues_from_the_checkpoint(tiny_lm_path, prompts_path, tmp_path):
    overrides = ["run.max_iterations=2", "run.checkpoint_every=1", "model.lora.init=default",
                 "run.eval_every=0", "prompts.eval=null"]
    straight = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path / "a", *overrides))
    straight.train()
    first = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path / "b", *overrides[1:],
                                  "run.max_iterations=1"))
    first.train()
    resumed = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path / "b", *overrides))
    resumed.train(resume="latest")
    for name, param in straight.trainable.items():
        torch.testing.assert_close(resumed.trainable[name], param, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- two processes

WORKER = """
import json, sys, torch
from flowgrpo.config import load_config
from flowgrpo.trainer import Trainer
torch.set_num_threads(1)
trainer = Trainer(load_config(sys.argv[1]))
batch, rewards, info = trainer.rollout_and_score(0)
advantages, _ = trainer.compute_advantages(batch, rewards)
acc = trainer.accelerator
logp_old = torch.zeros(len(batch.prompts))
for r in batch.replay:
    logp_old[r.rows] = (r.logp_old * r.completion_mask).sum(1)
digest = torch.tensor([sum(ord(c) * 31 ** i for i, c in enumerate(p + '|' + text)) % 2 ** 31
                       for p, text in zip(batch.prompts, batch.completions)])
record = {k: acc.gather(v).tolist() for k, v in [
    ("sample_ids", batch.sample_ids), ("group_ids", batch.group_ids), ("digest", digest),
    ("rewards", rewards["total"]), ("advantages", advantages), ("logp_old", logp_old)]}
record.update(num_processes=acc.num_processes, resampled=info["rollout/resampled_groups"])
if acc.is_main_process:
    open(sys.argv[2], "w").write(json.dumps(record))
"""


@pytest.mark.slow
def test_two_processes_sample_and_score_like_one(tiny_lm_path, prompts_path, tmp_path):
    """Groups span processes; dynamic sampling decides on gathered rewards; tokens are seeded
    per sample, so two processes produce the one-process rollout."""
    import os
    import subprocess
    import sys

    import yaml

    root = Path(__file__).resolve().parents[1]
    config = llm_config(tiny_lm_path, prompts_path, tmp_path,
                        "rewards.components=[{name: 'tests.test_llm:flat_for_even'}]",
                        "llm.dynamic_sampling=true", "training.prompts_per_iteration=3",
                        "sampling.rollout_batch_size=3", "run.seed=1")
    from flowgrpo.config import to_dict

    (tmp_path / "mp.yaml").write_text(yaml.safe_dump(to_dict(config)))
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root),
           "ACCELERATE_USE_CPU": "true"}
    results = []
    for processes in (1, 2):
        out = tmp_path / f"out{processes}.json"
        cmd = [sys.executable, "-m", "accelerate.commands.launch",
               "--multi_gpu" if processes > 1 else "--cpu", "--num_processes", str(processes),
               "--num_machines", "1", "--main_process_port", str(free_port()),
               "--mixed_precision", "no", "--dynamo_backend", "no", str(tmp_path / "worker.py"),
               str(tmp_path / "mp.yaml"), str(out)]
        done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
        results.append(json.loads(out.read_text()))
    one, two = results
    assert two["num_processes"] == 2 and one["sample_ids"] == two["sample_ids"] == list(range(12))
    assert one["digest"] == two["digest"] and one["group_ids"] == two["group_ids"]
    assert one["rewards"] == pytest.approx(two["rewards"], abs=1e-6)
    assert one["advantages"] == pytest.approx(two["advantages"], abs=1e-5)
    assert one["logp_old"] == pytest.approx(two["logp_old"], abs=1e-4)
    assert one["resampled"] == two["resampled"] > 0


# --------------------------------------------------------------------------- learning


@pytest.mark.slow
def test_grpo_raises_heldout_accuracy_of_the_pretrained_lm(tmp_path):
    """Reduced configs/llm_arith.yaml on the shipped model: held-out greedy exact match rises."""
    if not (ASSET / "model.safetensors").is_file():
        pytest.skip("assets/lm is missing: python scripts/pretrain_lm.py --out assets/lm")
    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "llm_arith.yaml", [
        f"model.path={ASSET}", f"prompts.train={ASSET / 'train.jsonl'}",
        f"prompts.eval={ASSET / 'heldout.jsonl'}", f"run.output_dir={tmp_path}",
        "run.max_iterations=80", "run.eval_every=0", "run.checkpoint_every=0",
        "run.progress=false"])
    history = Trainer(config).train()
    evals = [h["eval/accuracy"] for h in history if h["phase"] == "eval"]
    assert evals[-1] >= evals[0] + 0.08, evals


def test_an_lm_run_loads_no_flow_code(tiny_lm_path, prompts_path, tmp_path):
    """A whole LM iteration (policy, rewards, update, evaluation) in a fresh process imports
    neither diffusers nor the flow adapters, rollout or toy world (the config may read the
    family registry, pipelines/__init__.py, which imports none of them)."""
    import subprocess
    import sys

    config = tmp_path / "llm.yaml"
    dump_config(llm_config(tiny_lm_path, prompts_path, tmp_path,
                           "rewards.components=[{name: exact_match}]"), config)
    code = ("import sys; from flowgrpo.config import load_config; "
            "from flowgrpo.trainer import Trainer; "
            f"Trainer(load_config({str(config)!r})).train(); "
            "print(sorted(m for m in ('diffusers', 'pipelines.base', 'flowgrpo.rollout', "
            "'flowgrpo.flow_policy', 'flowgrpo.toyworld', 'open_clip') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_held_out_text_rewards_score_the_evaluation_completions(tiny_lm_path, prompts_path,
                                                                tmp_path):
    """eval.rewards on the LM policy: scored on the evaluation's completions (mean and se),
    never in the training records."""
    from reward_models.text import LengthReward

    trainer = Trainer(llm_config(tiny_lm_path, prompts_path, tmp_path,
                                 "eval.rewards=[{name: length, options: {target: 3}}]"))
    history = trainer.train()
    evals = [h for h in history if h["phase"] == "eval"]
    assert all({"eval/length", "eval/length/se", "eval/char_sum/se"} <= set(h) for h in evals)
    assert not any(key.startswith("reward/length") for h in history if h["phase"] == "train"
                   for key in h)
    lines = (trainer.run_dir / "samples" / "eval_00001.jsonl").read_text().splitlines()
    completions = [json.loads(line)["completion"] for line in lines]
    expected = LengthReward(target=3)(completions, [""] * len(completions))
    assert evals[-1]["eval/length"] == pytest.approx(float(expected.mean()), abs=1e-6)
