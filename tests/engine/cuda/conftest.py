"""CUDA tests: `gpu` skips (with the reason) unless CuPy sees a usable GPU."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gpu() -> int:
    from engine.backends.cuda.device import probe

    reason = probe(0)
    if reason is not None:
        pytest.skip(f"needs an NVIDIA GPU: {reason}")
    return 0
