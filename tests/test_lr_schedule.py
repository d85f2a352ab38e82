"""training.lr_decay: the lr of each iteration in closed form, and validation at load."""
from __future__ import annotations

import math

import pytest

from flowgrpo.config import ConfigError, TrainConfig, validate
from flowgrpo.trainer import scheduled_lr


def test_constant_linear_and_cosine_decay_in_closed_form():
    assert [scheduled_lr(1.0, i, 0, "constant", 0.1, 10) for i in (0, 5, 10, 20)] == [1.0] * 4
    linear = [scheduled_lr(2.0, i, 0, "linear", 0.1, 10) for i in (0, 5, 10, 20)]
    assert linear == pytest.approx([2.0, 2.0 * (0.1 + 0.9 * 0.5), 0.2, 0.2])
    cosine = [scheduled_lr(2.0, i, 0, "cosine", 0.0, 8) for i in range(9)]
    assert cosine == pytest.approx([1.0 + math.cos(math.pi * i / 8) for i in range(9)])
    assert cosine[4] == pytest.approx(1.0) and cosine[-1] == pytest.approx(0.0, abs=1e-12)


def test_warmup_comes_first_and_decay_starts_after_it():
    lrs = [scheduled_lr(1.0, i, 4, "linear", 0.0, 12) for i in range(13)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0) and lrs[8] == pytest.approx(0.5) and lrs[12] == 0.0
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))


def test_bad_schedule_fields_name_the_field():
    config = TrainConfig()
    config.training.lr_decay = "exponential"
    with pytest.raises(ConfigError, match="training.lr_decay"):
        validate(config)
    config = TrainConfig()
    config.training.lr_final_ratio = 1.5
    with pytest.raises(ConfigError, match="training.lr_final_ratio"):
        validate(config)
