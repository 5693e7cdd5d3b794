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
