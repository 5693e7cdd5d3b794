"""CUDA tests: `gpu` skips (with the reason) unless CuPy sees a usable GPU."""

from __future__ import annotations

import os

import pytest

from tests.conftest import TEST_MODELS

_STARTERS = {
    "smollm2_path": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3_path": "gemma-3-270m-q4_k_m.gguf",
}


def nvrtc_or_skip() -> None:
    """Skip unless CuPy's NVRTC can be loaded (CuPy plus the nvidia-cuda-nvrtc-cu12 wheel)."""
    from engine.backends.cuda import kernels

    try:
        kernels._add_pip_nvrtc_path()
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 - CuPy or libnvrtc missing: nothing to compile with
        pytest.skip(f"NVRTC cannot be loaded ({type(e).__name__}: {e}); pip install -e .[dev]")


@pytest.fixture(scope="session")
def module_ptx() -> str:
    """PTX of the module the backend builds (every source in one unit), compiled once per session."""
    from engine.backends.cuda import kernels

    nvrtc_or_skip()
    return kernels.compile_ptx(kernels.full_source(), "hearth.cu")


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
