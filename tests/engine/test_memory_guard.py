"""Memory guard: the estimate's arithmetic, the refusal, the trained-context warning."""

from __future__ import annotations

import pytest

from engine import memory_guard
from engine.memory_guard import InsufficientMemoryError, KVShape, check, estimate, kv_shape_from_gguf

SMOL = KVShape(n_layers=30, n_kv_heads=3, head_dim=64, hidden_size=576, trained_ctx=8192)
GIB = 1 << 30


def test_kv_bytes_per_token_and_total():
    assert SMOL.kv_bytes_per_token == 30 * 3 * 64 * 2 * 4
    est = estimate(100 << 20, SMOL, 4096, batch=256, available=8 * GIB)
    assert est.kv_bytes == 4096 * SMOL.kv_bytes_per_token
    assert est.total_bytes == (100 << 20) + est.kv_bytes + est.overhead_bytes
    assert est.fits and not est.warnings
    # the largest context that fits uses the room left after weights and buffers
    room = int(8 * GIB * memory_guard.HEADROOM) - (100 << 20) - est.overhead_bytes
    assert est.max_fitting_ctx == room // SMOL.kv_bytes_per_token


def test_refuses_with_a_smaller_context_suggestion():
    with pytest.raises(InsufficientMemoryError) as info:
        check(100 << 20, SMOL, 200_000, available=2 * GIB)
    err = info.value
    assert err.estimate.max_fitting_ctx < 200_000
    assert f"at most {err.estimate.max_fitting_ctx} tokens" in str(err)
    assert "smaller quantization" in str(err)


def test_weights_alone_too_big():
    with pytest.raises(InsufficientMemoryError, match="weights alone"):
        check(40 * GIB, SMOL, 2048, available=16 * GIB)


def test_gpu_layers_leave_ram():
    """Layers on a GPU keep neither weights nor KV cache in RAM: a model bigger than RAM loads when it
    all goes to the GPU, and partial offload counts the CPU layers' share."""
    with pytest.raises(InsufficientMemoryError):
        check(40 * GIB, SMOL, 8192, available=16 * GIB)
    full = check(40 * GIB, SMOL, 8192, available=16 * GIB, gpu_layers=30)
    assert full.weights_bytes == 0 and full.kv_bytes == 0 and full.max_fitting_ctx == 8192
    third = estimate(30 * GIB, SMOL, 4096, available=64 * GIB, gpu_layers=20)
    assert third.weights_bytes == 10 * GIB and third.kv_bytes == 4096 * SMOL.kv_bytes_per_token // 3
    assert estimate(GIB, SMOL, 4096, available=64 * GIB, gpu_layers=99).weights_bytes == 0


def test_gpu_layers_planned_only_when_cuda_works(monkeypatch):
    from engine import worker
    from engine.backends.cuda import device
    from engine.client import LoadOptions

    assert worker.gpu_layers_planned(LoadOptions(device="cpu"), 30) == 0
    monkeypatch.setattr(device, "probe", lambda index=0: "no CUDA GPU found")
    assert worker.gpu_layers_planned(LoadOptions(device="cuda"), 30) == 0  # falls back: RAM holds it all
    monkeypatch.setattr(device, "probe", lambda index=0: None)
    assert worker.gpu_layers_planned(LoadOptions(device="cuda"), 30) == 30
    assert worker.gpu_layers_planned(LoadOptions(device="cuda:1", gpu_layers=12), 30) == 12
    assert worker.gpu_layers_planned(LoadOptions(device="cuda", gpu_layers=50), 30) == 30


def test_warns_above_trained_context():
    est = check(100 << 20, SMOL, 16384, available=64 * GIB)
    assert est.fits and len(est.warnings) == 1 and "8192" in est.warnings[0]


def test_shape_from_real_metadata(smollm2_path):
    from models.formats.gguf import open_gguf

    with open_gguf(smollm2_path) as gguf:
        shape = kv_shape_from_gguf(gguf.metadata)
    assert shape == SMOL


def test_shape_from_incomplete_metadata():
    from models.errors import ModelFormatError

    with pytest.raises(ModelFormatError, match="hyper-parameters"):
        kv_shape_from_gguf({"general.architecture": "llama"})
