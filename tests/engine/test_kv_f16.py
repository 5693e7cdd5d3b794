"""Float16 KV cache: the attention kernels over half caches, the cache itself, SmolLM2 end to end,
and the load option that selects it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine import memory_guard
from engine.backends import cpu
from engine.client import LoadOptions
from engine.kv_cache import KVCache

GOLDEN = Path(__file__).resolve().parents[1] / "goldens" / "smollm2_greedy.json"


def _reference(q, k, v, pos0, scale):
    """float64 causal GQA attention; q (n, heads, hd), k, v (n_kv, ctx, hd)."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    n, heads, _ = q.shape
    group = heads // k.shape[0]
    out = np.zeros(q.shape)
    for t in range(n):
        for h in range(heads):
            keys, vals = k[h // group, : pos0 + t + 1], v[h // group, : pos0 + t + 1]
            s = keys @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vals
    return out


@pytest.mark.parametrize("n_tok", [1, 3, 16])  # 1 and 3: Numba kernel (decode); 16: the BLAS prefill path
@pytest.mark.parametrize("start", [0, 37])  # 37: a view skipping positions, as gemma's sliding window passes
def test_f16_attention_matches_float64_reference(n_tok, start):
    rng = np.random.default_rng(n_tok + start)
    n_kv, ctx, hd, heads, pos0 = 3, 160, 64, 9, 100
    k32 = rng.standard_normal((n_kv, ctx, hd)).astype(np.float32)
    v32 = rng.standard_normal((n_kv, ctx, hd)).astype(np.float32)
    k16, v16 = k32.astype(np.float16), v32.astype(np.float16)
    q = rng.standard_normal((n_tok, heads, hd)).astype(np.float32)
    scale = hd**-0.5
    out = np.full_like(q, np.nan)
    p0 = pos0 - start
    cpu.attention(out, q, k16[:, start:], v16[:, start:], p0, scale)
    # exact maths on the stored halves: only float32 rounding separates the kernel from it
    np.testing.assert_allclose(out, _reference(q, k16[:, start:], v16[:, start:], p0, scale), atol=2e-5)
    # against the unrounded float32 values: the half rounding (2^-11 relative) is all that is lost
    np.testing.assert_allclose(out, _reference(q, k32[:, start:], v32[:, start:], p0, scale), atol=5e-3)


def test_f16_attention_rejects_mismatched_caches():
    q = np.zeros((1, 2, 8), np.float32)
    k = np.zeros((1, 4, 8), np.float16)
    with pytest.raises(ValueError, match="does not match"):
        cpu.attention(np.empty_like(q), q, k, np.zeros((1, 4, 8), np.float32), 0, 1.0)


def test_kv_cache_f16_stores_halves_and_halves_memory():
    c32 = KVCache(2, 3, 8, 16)
    c16 = KVCache(2, 3, 8, 16, dtype=np.float16)
    assert c16.k.dtype == c16.v.dtype == np.float16 and c16.dtype == np.float16
    assert c16.nbytes * 2 == c32.nbytes == 2 * 2 * 3 * 16 * 8 * 4
    k = np.random.default_rng(0).standard_normal((5, 3, 8)).astype(np.float32)
    kl, vl = c16.update_and_fetch(1, k, -k)
    assert kl.dtype == np.float16 and kl.shape == (3, 16, 8)
    np.testing.assert_array_equal(kl[:, :5], k.transpose(1, 0, 2).astype(np.float16))
    np.testing.assert_array_equal(vl[:, :5], (-k).transpose(1, 0, 2).astype(np.float16))
    with pytest.raises(ValueError, match="float32 or float16"):
        KVCache(2, 3, 8, 16, dtype=np.float64)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from engine.loader import load_model

    return load_model(smollm2_path)


def test_smollm2_f16_cache_matches_f32(smollm2):
    golden = json.loads(GOLDEN.read_text())
    prompt, expected = golden["prompt_ids"], golden["new_ids"]
    model = smollm2.model
    results = {}
    for dtype in (np.float32, np.float16):
        cache = model.new_cache(64, dtype)
        logits = model.forward(prompt, cache)[0].copy()  # prefill path (BLAS attention)
        ids = [int(np.argmax(logits))]
        for _ in range(len(expected) - 1):  # decode path (Numba attention)
            ids.append(int(np.argmax(model.forward([ids[-1]], cache)[0])))
        results[dtype] = (logits, ids, cache)
    (l32, ids32, c32), (l16, ids16, c16) = results[np.float32], results[np.float16]
    assert c16.k.dtype == np.float16
    assert np.abs(l16 - l32).max() <= 1e-2 * np.abs(l32).max()
    assert ids32 == expected
    assert ids16 == expected
    assert c16.nbytes * 2 == c32.nbytes


def test_load_options_kv_dtype():
    assert LoadOptions().kv_dtype == "f16" and LoadOptions().kv_numpy_dtype == np.float16
    assert LoadOptions(kv_dtype="f32").kv_numpy_dtype == np.float32
    assert LoadOptions(kv_dtype="f16").kv_numpy_dtype == np.float16
    with pytest.raises(ValueError, match="kv_dtype must be one of f32, f16"):
        LoadOptions(kv_dtype="f8")


def test_memory_estimate_counts_two_bytes_per_f16_element():
    shape = memory_guard.KVShape(n_layers=30, n_kv_heads=3, head_dim=64, hidden_size=576, trained_ctx=8192)
    e32 = memory_guard.estimate(100 << 20, shape, 4096, 128, available=8 << 30)
    e16 = memory_guard.estimate(100 << 20, shape, 4096, 128, available=8 << 30, kv_itemsize=2)
    assert e16.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2
    assert e16.kv_bytes * 2 == e32.kv_bytes
    assert e16.max_fitting_ctx > 1.9 * e32.max_fitting_ctx


def test_chat_runner_with_f16_cache(smollm2_path):
    from engine.generate import GenerationParams
    from engine.worker import ChatRunner

    options = LoadOptions(n_ctx=128, batch_size=64, kv_dtype="f16", prefix_cache_mb=8)
    runner = ChatRunner.load(smollm2_path, options)
    assert runner.cache.k.dtype == np.float16
    assert runner.estimate.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = "".join(e.text for e in runner.chat(messages, GenerationParams(max_tokens=8, temperature=0.0)))
    assert "Paris" in text
