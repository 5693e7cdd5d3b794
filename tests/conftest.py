"""Shared fixtures. Every test runs with HEARTH_HOME in a temp dir, so no real user file is touched.

Starter models are cached between runs in HEARTH_TEST_MODELS (default ~/.cache/hearth-test-models),
outside the clone, so CI on the same machine downloads them once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

TEST_MODELS = Path(os.environ.get("HEARTH_TEST_MODELS", Path.home() / ".cache" / "hearth-test-models"))
# The Numba cache must survive between test runs (compiling every kernel each run costs minutes),
# so it lives next to the cached test models rather than in the per-test HEARTH_HOME (engine/__init__
# adds a folder per hash of the kernel sources).
os.environ.setdefault("HEARTH_KERNEL_CACHE", str(TEST_MODELS / "numba-cache"))


@pytest.fixture(autouse=True)
def _hearth_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HEARTH_HOME", str(tmp_path_factory.mktemp("hearth-home")))


def _starter(name: str) -> Path:
    from models.starter import ensure_starter

    return ensure_starter(name, TEST_MODELS)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (llama family, BPE, chat template)."""
    return _starter("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma-3-270M base Q4_K_M (gemma3 family, SentencePiece, no chat template)."""
    return _starter("gemma-3-270m")
