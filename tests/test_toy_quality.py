"""The toy world's image-quality metric: a clean render is the ideal (0), and each defect the
verifier ignores (tinted or noisy canvas, textured objects) raises it while the verdict stays."""
import numpy as np
import pytest
import torch

from flowgrpo.toyworld.grammar import parse_prompt
from flowgrpo.toyworld.quality import artifact_scores
from flowgrpo.toyworld.render import render
from flowgrpo.toyworld.verify import score_image
from reward_models.loading import load_reward

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow wedge",
           "four cyan circles", "a magenta rectangle above a red square"]


@pytest.fixture(scope="module")
def renders() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.stack([render(parse_prompt(p), 24, rng) for p in PROMPTS])


def test_clean_renders_score_exactly_zero(renders):
    scores = artifact_scores(renders)
    for key in ("background", "texture", "artifacts"):
        assert np.array_equal(scores[key], np.zeros(len(PROMPTS), dtype=np.float32)), key


def test_tinted_background_raises_background_by_the_tint_and_keeps_the_verdict(renders):
    tinted = renders.copy()
    canvas = renders.max(axis=1, keepdims=True) == 0
    tinted = np.where(canvas, tinted + np.asarray([0.0, 0.05, 0.1], dtype=np.float32)[:, None, None],
                      tinted)
    scores = artifact_scores(tinted)
    np.testing.assert_allclose(scores["background"], 0.1, atol=1e-6)   # the brightest channel
    np.testing.assert_allclose(scores["texture"], 0.0, atol=1e-6)
    for image, prompt in zip(tinted, PROMPTS):   # the verifier does not see it
        assert score_image(image, parse_prompt(prompt)).exact == 1.0


def test_background_noise_and_object_texture_each_score_worse(renders):
    rng = np.random.default_rng(1)
    noisy = np.clip(renders + rng.uniform(0, 0.2, renders.shape).astype(np.float32)
                    * (renders.max(axis=1, keepdims=True) == 0), 0, 1)
    objects = renders.max(axis=1, keepdims=True) > 0
    grid = np.zeros_like(renders)
    grid[..., ::2, :] = 0.3                       # every other row darkened on the objects
    textured = np.clip(renders - grid * objects, 0, 1)
    clean = artifact_scores(renders)["artifacts"]
    assert (artifact_scores(noisy)["background"] > 0.05).all()
    assert (artifact_scores(textured)["texture"] > 0.02).all()
    assert (artifact_scores(textured)["background"] == 0).all()
    assert (artifact_scores(noisy)["artifacts"] > clean).all()
    assert (artifact_scores(textured)["artifacts"] > clean).all()


def test_more_noise_scores_monotonically_worse(renders):
    rng = np.random.default_rng(2)
    noise = rng.uniform(0, 1, renders.shape).astype(np.float32)
    values = [artifact_scores(np.clip(renders + level * noise, 0, 1))["artifacts"].mean()
              for level in (0.0, 0.05, 0.1, 0.2)]
    assert values == sorted(values) and values[0] == 0 and values[-1] > values[1]


def test_reward_is_registered_lower_is_better_and_scores_parts(renders):
    reward = load_reward("toy_artifacts")
    media = torch.from_numpy(renders)
    media[0, :, :2, :2] = 0.25                   # a 2 x 2 patch of grey in one canvas corner
    scores = reward(media, PROMPTS, [{}] * len(PROMPTS))
    assert scores.shape == (len(PROMPTS),) and scores[0] > 0 and (scores[1:] == 0).all()
    background = load_reward({"name": "toy_artifacts", "score": "background"})(media, PROMPTS, None)
    assert torch.allclose(background, scores)    # only the background changed
    from reward_models.toy_quality import ToyArtifactsReward

    assert ToyArtifactsReward.higher_is_better is False
