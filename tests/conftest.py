"""Shared fixtures: tiny offline model folders, built once per test session."""
from __future__ import annotations

import os

import pytest
import torch

from pipelines.tiny import save_tiny

# Two cores shared by the suite: one intra-op thread keeps tests fast and deterministic.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory) -> str:
    return save_tiny("sd3", tmp_path_factory.mktemp("tiny_sd3"))


@pytest.fixture(scope="session")
def tiny_sd3_dir(tiny_sd3_path) -> str:
    """The adapter tests' name for ``tiny_sd3_path`` (one build)."""
    return tiny_sd3_path


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory) -> str:
    return save_tiny("flux", tmp_path_factory.mktemp("tiny") / "flux")


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory) -> str:
    return save_tiny("wan", tmp_path_factory.mktemp("tiny") / "wan")


@pytest.fixture(scope="session")
def tiny_wan22_dir(tmp_path_factory) -> str:
    """Wan2.2's two experts (boundary_ratio 0.875)."""
    return save_tiny("wan22", tmp_path_factory.mktemp("tiny") / "wan22")
