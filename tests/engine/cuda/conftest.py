"""CUDA tests: `gpu` skips (with the reason) unless CuPy sees a usable GPU."""

from __future__ import annotations

import os

import pytest

from tests.conftest import TEST_MODELS

_STARTERS = {
    "smollm2_path": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3_path": "gemma-3-270m-q4_k_m.gguf",
}


@pytest.fixture(scope="session")
def gpu() -> int:
    from engine.backends.cuda.device import probe

    reason = probe(0)
    if reason is not None:
        pytest.skip(f"needs an NVIDIA GPU: {reason}")
    return 0


def _starter_or_skip(request, fixture: str):
    # On the GPU machine (no network) scripts/cuda_device_check.sh sets HEARTH_CUDA_OFFLINE: a starter
    # model that is not already cached is skipped instead of being downloaded.
    if os.environ.get("HEARTH_CUDA_OFFLINE") and not (TEST_MODELS / "starter" / _STARTERS[fixture]).is_file():
        pytest.skip(f"{_STARTERS[fixture]} is not cached in {TEST_MODELS} and this machine is offline")
    return request.getfixturevalue(fixture)


@pytest.fixture
def smollm2_gpu_path(request):
    return _starter_or_skip(request, "smollm2_path")


@pytest.fixture
def gemma3_gpu_path(request):
    return _starter_or_skip(request, "gemma3_path")
