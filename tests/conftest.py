"""Shared fixtures: tiny offline model folders, built once per test session."""
from __future__ import annotations

import os

import pytest
import torch

# Two cores shared by the suite: one intra-op thread keeps tests fast and deterministic.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory) -> str:
    from pipelines.tiny import save_tiny

    return save_tiny("sd3", tmp_path_factory.mktemp("tiny_sd3"))
