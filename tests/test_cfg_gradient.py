"""training.cfg_gradient: where classifier-free guidance's unconditional branch gets gradient.

'conditional' must give the policy gradient of Flow-GRPO's July-2025 SD3 update (one batched
forward over [uncond; cond], the uncond velocity detached before the guidance combination),
'both' that of its current code (no detach); the unconditional branch must then run without
autograd (a no-grad forward of its own, not a batched forward with grad), the rollout's replayed
calls must split the same way so that the first-pass ratio stays exactly 1, and every real-CFG
family must train with it."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from flowgrpo.config import load_config
from flowgrpo.losses import flow_kl, policy_loss
from flowgrpo.model import CFG_GRADIENTS, Conditioning, cfg_gradient, guided_velocity
from flowgrpo.sde import score_step
from flowgrpo.tiny_recipe import load_tiny_config
from flowgrpo.trainer import Trainer
from tests.helpers import tiny_config
from tests.pipeline_helpers import perturb_lora

GUIDANCE = 4.5


class ForwardLog:
    """Every forward of ``module``: (rows, whether autograd was recording), in call order."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls: list[tuple[int, bool]] = []
        self._handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.calls.append((int(hidden.shape[0]), torch.is_grad_enabled()))

    def take(self) -> list[tuple[int, bool]]:
        calls, self.calls = self.calls, []
        return calls

    def remove(self) -> None:
        self._handle.remove()


# ------------------------------------------------------------------ the shared function


def _toy_forward(weight: Tensor):
    """forward(latents, timestep, text) of a linear 'transformer' whose output depends on the
    text, so that both branches carry gradient to ``weight``."""
    def forward(latents: Tensor, timestep: Tensor, text: dict[str, Tensor]) -> Tensor:
        return latents * weight + text["embeds"] * timestep[:, None]
    return forward


def test_conditional_mode_detaches_the_negative_branch_and_keeps_the_value():
    weight = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    latents = torch.randn(2, 3)
    timestep = torch.tensor([0.3, 0.8])
    positive, negative = {"embeds": torch.randn(2, 3)}, {"embeds": torch.randn(2, 3)}
    forward = _toy_forward(weight)
    both = guided_velocity(forward, latents, timestep, positive, negative, GUIDANCE)
    (grad_both,) = torch.autograd.grad(both.sum(), weight)
    with cfg_gradient("conditional"):
        conditional = guided_velocity(forward, latents, timestep, positive, negative, GUIDANCE)
    (grad_conditional,) = torch.autograd.grad(conditional.sum(), weight)
    torch.testing.assert_close(conditional, both)
    # v = v_neg + g (v_pos - v_neg): d/dw is (1 - g) x + g x = x with both branches, g x with
    # the negative one a constant
    torch.testing.assert_close(grad_both, latents.sum(0))
    torch.testing.assert_close(grad_conditional, GUIDANCE * latents.sum(0))


def test_the_mode_is_scoped_and_checked():
    weight = torch.ones(3, requires_grad=True)
    log: list[bool] = []

    def forward(latents, timestep, text):
        log.append(torch.is_grad_enabled())
        return _toy_forward(weight)(latents, timestep, text)

    args = (torch.randn(2, 3), torch.ones(2), {"embeds": torch.randn(2, 3)},
            {"embeds": torch.randn(2, 3)}, 2.0)
    with cfg_gradient("conditional"):
        guided_velocity(forward, *args)
        with cfg_gradient("both"):
            guided_velocity(forward, *args)
        guided_velocity(forward, *args)
    guided_velocity(forward, *args)
    # split (negative without grad, positive with), one batched call, split, one batched call
    assert log == [False, True, True, False, True, True]
    assert CFG_GRADIENTS == ("both", "conditional")
    with pytest.raises(ValueError, match="cfg_gradient must be one of"):
        with cfg_gradient("unconditional"):
            pass


# ------------------------------------------------------------------ tiny SD3 against the anchor


def flow_grpo_velocity(model, replay, cond: Conditioning, guidance: float, detach: bool) -> Tensor:
    """Flow-GRPO's ``compute_log_prob`` velocity on the SD3 transformer (scripts/train_sd3.py,
    written from it): one forward over the batch [uncond; cond] (latents and timesteps
    repeated), chunk, at ``2d76907``-``ac4c86e`` ``noise_pred_uncond.detach()``, then
    ``uncond + g (cond - uncond)``."""
    x = replay.latents.to(model.dtype)
    timestep = 1000.0 * replay.sigmas.to(x)
    negative, positive = cond.negative, cond.positive
    out = model.transformer(
        hidden_states=torch.cat([x, x]), timestep=torch.cat([timestep, timestep]),
        encoder_hidden_states=torch.cat([negative["prompt_embeds"], positive["prompt_embeds"]]),
        pooled_projections=torch.cat([negative["pooled_prompt_embeds"],
                                      positive["pooled_prompt_embeds"]]),
        return_dict=False)[0].float()
    uncond, text = out.chunk(2)
    if detach:
        uncond = uncond.detach()
    return uncond + guidance * (text - uncond)


def _policy_gradient(sd3_path: str, root: Path, mode: str, reference: bool) -> Tensor:
    """The first update's gradient (every replay batch's loss summed, before any step) of a
    tiny SD3 run with CFG 4.5 and the KL on: through our replay loss, or (``reference``) through
    Flow-GRPO's velocity with our SDE step, surrogate and KL (checked against its formulas
    elsewhere), the unconditional branch detached when ``mode`` is 'conditional'."""
    config = tiny_config(sd3_path, root / f"{mode}_{reference}",
                         f"sampling.guidance_scale={GUIDANCE}", f"training.cfg_gradient={mode}",
                         "training.kl_beta=0.04")
    trainer = Trainer(config)
    policy = trainer.policy
    perturb_lora(policy.module, seed=1, std=0.05)   # LoRA off its zero start: every tensor moves
    batch, rewards, _ = trainer.rollout_and_score(0)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    t = config.training
    settings = policy.settings(0)
    for replay in batch.replay:
        weights = torch.ones(len(replay.rows))
        if reference:
            cond = policy.replay_condition(batch, replay)
            velocity = flow_grpo_velocity(policy.model, replay, cond, GUIDANCE,
                                          detach=mode == "conditional")
            logp, mean = score_step(velocity, replay.latents, replay.next_latents,
                                    replay.gaussian)
            loss = policy_loss(logp, replay.logp_old, advantages[replay.rows], t.clip_low,
                               t.clip_low, weights=weights)
            kl = flow_kl(mean, policy.reference_mean(replay, cond, settings),
                         policy.kl_std(replay)).mean()
            loss = loss + t.kl_beta * kl
        else:
            loss, _ = policy.replay_loss(batch, replay, advantages, 0, t.clip_low, weights)
        loss.backward()
    return torch.cat([p.grad.flatten() for p in policy.trainable.values()]).double()


def _cosine(a: Tensor, b: Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def test_policy_gradient_is_flow_grpos_with_the_unconditional_branch_detached(tiny_sd3_path,
                                                                               tmp_path):
    detached = _policy_gradient(tiny_sd3_path, tmp_path, "conditional", reference=False)
    anchor_detached = _policy_gradient(tiny_sd3_path, tmp_path, "conditional", reference=True)
    assert _cosine(detached, anchor_detached) > 1 - 1e-9
    assert detached.norm() / anchor_detached.norm() == pytest.approx(1.0, abs=1e-5)
    # 'both' is the anchor without the detach (its code from August 2025 on) ...
    both = _policy_gradient(tiny_sd3_path, tmp_path, "both", reference=False)
    anchor_both = _policy_gradient(tiny_sd3_path, tmp_path, "both", reference=True)
    assert _cosine(both, anchor_both) > 1 - 1e-9
    assert both.norm() / anchor_both.norm() == pytest.approx(1.0, abs=1e-5)
    # ... and not the detached one: the two updates point elsewhere (cosine 0.64, norm 0.49
    # on this build)
    assert _cosine(both, anchor_detached) < 0.9
    assert not both.norm() / anchor_detached.norm() == pytest.approx(1.0, abs=0.1)


def test_detached_run_replays_exactly_and_runs_the_unconditional_branch_without_autograd(
        tiny_sd3_path, tmp_path):
    """Rollout: the calls of trained steps split (N without grad, then N), the untrained step
    stays one batched call of 2N. Update: every forward with autograd on holds only the
    conditional rows; the first pass is on-policy to the last bit."""
    config = tiny_config(tiny_sd3_path, tmp_path, f"sampling.guidance_scale={GUIDANCE}",
                         "training.cfg_gradient=conditional", "training.kl_beta=0.04",
                         "training.optimizer_steps_per_epoch=2", "training.num_inner_epochs=2")
    trainer = Trainer(config)
    log = ForwardLog(trainer.policy.module)
    batch, rewards, _ = trainer.rollout_and_score(0)
    rollout_calls = log.take()
    chunk = config.sampling.rollout_batch_size
    chunks = config.training.prompts_per_iteration * config.training.group_size // chunk
    trained_calls = len(batch.replay)
    untrained_calls = chunks * config.sampling.num_steps - trained_calls
    assert trained_calls > 0 and untrained_calls > 0
    assert sorted(rollout_calls) == sorted([(chunk, False)] * 2 * trained_calls
                                           + [(2 * chunk, False)] * untrained_calls)
    advantages, _ = trainer.compute_advantages(batch, rewards)
    metrics = trainer.update(batch, advantages, 0)
    update_calls = log.take()
    log.remove()
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    assert metrics["train/optimizer_steps"] == 4
    with_grad = [rows for rows, grad in update_calls if grad]
    # one conditional forward per replay batch and pass, none of 2N rows
    assert with_grad == [chunk] * (2 * metrics["train/replay_batches"])
    # its unconditional forward, and the reference's two forwards for the KL, without
    assert sum(1 for _, grad in update_calls if not grad) == 3 * len(with_grad)
    assert all(rows == chunk for rows, _ in update_calls)


def test_batched_run_keeps_one_forward_of_both_branches(tiny_sd3_path, tmp_path):
    """The default ('both') is unchanged: one forward of 2N rows wherever CFG runs."""
    config = tiny_config(tiny_sd3_path, tmp_path, f"sampling.guidance_scale={GUIDANCE}")
    assert config.training.cfg_gradient == "both"
    trainer = Trainer(config)
    log = ForwardLog(trainer.policy.module)
    batch, rewards, _ = trainer.rollout_and_score(0)
    assert {rows for rows, _ in log.take()} == {2 * config.sampling.rollout_batch_size}
    advantages, _ = trainer.compute_advantages(batch, rewards)
    metrics = trainer.update(batch, advantages, 0)
    log.remove()
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    assert {(rows, grad) for rows, grad in log.calls} == {
        (2 * config.sampling.rollout_batch_size, True)}


# ------------------------------------------------------------------ every real-CFG family

# family -> the recipe whose tiny build runs it with real CFG in rollout and update, and the
# step count its run uses (the full plans are cut to 3 steps; the branch and one-step plans keep
# theirs, which their ranges need)
CFG_RECIPES = {"sd3": ("sd3_pickscore", 3), "qwen_image": ("qwen_image_ocr", 10),
               "wan": ("wan_video", 20), "wan22": ("wan22_video", 3)}




def _assert_split_update(trainer: Trainer, iteration: int = 0) -> dict:
    """One iteration; the update's forwards with autograd hold no unconditional rows."""
    log = ForwardLog(trainer.policy.module)
    batch, rewards, _ = trainer.rollout_and_score(iteration)
    log.take()
    advantages, _ = trainer.compute_advantages(batch, rewards)
    metrics = trainer.update(batch, advantages, iteration)
    calls = log.take()
    log.remove()
    replay_rows = {int(replay.rows.numel()) for replay in batch.replay}
    with_grad = [rows for rows, grad in calls if grad]
    assert metrics["train/replay_batches"] > 0 and with_grad
    assert set(with_grad) <= replay_rows
    assert sum(1 for _, grad in calls if not grad) >= len(with_grad)
    assert metrics["train/first_pass_ratio_max_dev"] == 0.0
    assert metrics["train/optimizer_steps"] >= 1
    assert math.isfinite(metrics["train/policy_loss"])
    return metrics


@pytest.mark.parametrize("family", sorted(CFG_RECIPES))
def test_every_real_cfg_family_trains_with_the_unconditional_branch_detached(
        family, tiny_recipe_root, tmp_path):
    recipe, steps = CFG_RECIPES[family]
    config = load_tiny_config(f"configs/{recipe}.yaml", [
        f"run.output_dir={tmp_path}", "run.progress=false", "run.comparison_grid=false",
        f"sampling.num_steps={steps}", "prompts.num_eval=1",
        "training.optimizer_steps_per_epoch=1",
        "training.skip_zero_std_groups=false", "training.cfg_gradient=conditional",
        "rewards.components=[{name: jpeg_compressibility}]"], root=tiny_recipe_root)
    assert config.sampling.guidance_scale > 1
    if family == "wan22":
        # both experts train and the low-noise one runs at its own scale
        assert config.model.options["guidance_scale_2"] != config.sampling.guidance_scale
    _assert_split_update(Trainer(config))


def test_qwen_image_edit_trains_with_the_unconditional_branch_detached(tmp_path,
                                                                       tiny_qwen_image_edit_dir):
    from PIL import Image

    from flowgrpo.pixels import to_uint8

    path = tiny_qwen_image_edit_dir
    lines = []
    for i, prompt in enumerate(["make the cube red", "add a green sphere"]):
        source = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(i))
        Image.fromarray(to_uint8(source)).save(tmp_path / f"{i}.png")
        lines.append(json.dumps({"prompt": prompt, "image": f"{i}.png"}))
    (tmp_path / "edits.jsonl").write_text("\n".join(lines) + "\n")
    config = load_config(data={
        "name": "qwen_edit",
        "model": {"family": "qwen_image_edit", "path": path,
                  "options": {"height": 32, "width": 32}, "lora": {"rank": 2, "alpha": 4}},
        "prompts": {"train": str(tmp_path / "edits.jsonl"), "eval": None},
        "sampling": {"num_steps": 3, "rollout_batch_size": 2, "guidance_scale": 4.0},
        "training": {"prompts_per_iteration": 2, "group_size": 2, "lr": 1e-3,
                     "skip_zero_std_groups": False, "cfg_gradient": "conditional"},
        "rewards": {"components": [{"name": "tests.helpers:Brightness"}], "threaded": False},
        "run": {"output_dir": str(tmp_path / "runs"), "max_iterations": 1, "tracker": "none",
                "progress": False, "checkpoint_every": 0, "eval_every": 0}})
    _assert_split_update(Trainer(config))


def test_toy_editing_model_trains_with_the_unconditional_branch_detached(edit_dir, tmp_path):
    config = load_config("configs/toy_edit.yaml", overrides=[
        f"model.path={edit_dir}", f"run.output_dir={tmp_path}", "run.progress=false",
        "run.comparison_grid=false", "run.max_iterations=1", "prompts.eval=null",
        "eval.rewards=[]", "training.prompts_per_iteration=2", "training.group_size=4",
        "sampling.guidance_scale=2.0", "training.locality={mask: 'off'}",
        "training.cfg_gradient=conditional", "training.skip_zero_std_groups=false",
        "rewards.components=[{name: toy_edit, options: {score: partial}}]"])
    _assert_split_update(Trainer(config))
