"""CPU backend kernels against independent references.

Weights are quantized with `gguf.quants.quantize` and the oracle is `gguf.quants.dequantize(raw) @ x`
in float64. Every linear path, decode (n_tok == 1, int16-quantized activations) and prefill (float32
BLAS on dequantized rows) alike, is held to DECODE_REL of |w_row| |x|: about float32's own error,
and the precision greedy decoding needs to reproduce a float32 reference token for token.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

import engine  # noqa: F401  (points the Numba cache at the user cache dir before kernels compile)
from engine.backends import cpu
from engine.backends.cpu import ops
from engine.weights import Weight
from models.formats.gguf import open_gguf

T = gguf.GGMLQuantizationType
ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
             T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4]
QUANTIZED = set(ALL_TYPES) - {T.F32, T.F16, T.BF16}
# Types whose test weights are random bytes with sane scales: gguf.quants cannot quantize to them, or (MXFP4)
# random bytes reach every nibble and a range of exponents a quantized Gaussian would not.
HAND_BUILT = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4}
# Byte offsets of the f16 fields (d, and dmin/m where present) in one block of a hand-built type.
F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
              T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.MXFP4: ()}
# Byte offset of the E8M0 exponent e (scale 2^(e-128)) in one block of a hand-built type.
E8M0_FIELDS = {T.MXFP4: 0}


def random_blocks(ggml_type: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 (rows, row_nbytes): every quant, scale and mask byte random, f16 scales in [1e-3, 5e-2),
    E8M0 exponents in [100, 132] (scales 2^-28 .. 2^4) but one block in eight's in [0, 3] (2^-128 .. 2^-125:
    denormal and tiny scales, whose values vanish next to the others')."""
    block, nbytes = gguf.GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[ggml_type]:
        raw[:, off : off + 2] = rng.uniform(1e-3, 5e-2, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if ggml_type in E8M0_FIELDS:
        tiny = rng.random(raw.shape[0]) < 0.125
        e = np.where(tiny, rng.integers(0, 4, raw.shape[0]), rng.integers(100, 133, raw.shape[0]))
        raw[:, E8M0_FIELDS[ggml_type]] = e
    return raw.reshape(rows, -1)


def make_weight(ggml_type: T, rows: int, cols: int, rng: np.random.Generator) -> tuple[Weight, np.ndarray]:
    """A random weight in ggml_type and its float64 dequantization by gguf (the oracle)."""
    if ggml_type in HAND_BUILT:
        raw = random_blocks(ggml_type, rows, cols, rng)
    else:
        dense = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = np.ascontiguousarray(gguf.quants.quantize(dense, ggml_type)).view(np.uint8).reshape(rows, -1)
    oracle = gguf.quants.dequantize(raw, ggml_type).astype(np.float64).reshape(rows, cols)
    return Weight(int(ggml_type), raw, rows, cols), oracle


# Tolerance of every linear output, relative to |w_row| |x|. int8 activations (the previous decode
# kernels) reached ~2e-3 here and flipped SmolLM2's greedy tokens; int16 activations reach ~3e-6.
DECODE_REL = 2e-4


def assert_linear_close(out: np.ndarray, oracle: np.ndarray, x: np.ndarray, rel: float) -> None:
    # out (n_tok, rows) vs x @ oracle.T, each element within rel * |w_row| * |x_tok|
    ref = x.astype(np.float64) @ oracle.T
    bound = rel * np.outer(np.linalg.norm(x, axis=1), np.linalg.norm(oracle, axis=1))
    worst = np.max(np.abs(out - ref) / bound)
    assert worst <= 1.0, f"error is {worst:.2f}x the tolerance"


def llm_like_activations(n_tok: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """float32 (n_tok, cols) with a few outlier channels ~50x the rest, as hidden states have.

    An outlier sets its block's quantization scale, so the small values sharing the block are the
    ones a coarse activation quantization loses.
    """
    x = rng.standard_normal((n_tok, cols))
    x[:, rng.choice(cols, size=max(1, cols // 64), replace=False)] *= 50.0
    return x.astype(np.float32)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("outliers", [False, True], ids=["gaussian", "outliers"])
def test_matvec_matches_dequantize(ggml_type, outliers):
    rng = np.random.default_rng(int(ggml_type))
    w, oracle = make_weight(ggml_type, 37, 256, rng)  # 37 rows: exercises the 4-row group tail
    x = llm_like_activations(1, 256, rng) if outliers else rng.standard_normal((1, 256)).astype(np.float32)
    out = np.full((1, 37), np.nan, np.float32)
    cpu.linear(out, w, x)
    assert_linear_close(out, oracle, x, DECODE_REL if ggml_type in QUANTIZED else 1e-5)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_dequantize(ggml_type, monkeypatch):
    rng = np.random.default_rng(100 + int(ggml_type))
    w, oracle = make_weight(ggml_type, 45, 256, rng)
    x = rng.standard_normal((9, 256)).astype(np.float32)
    # tiles of 12 rows (45 = 3 x 12 + 9) exercise the tile loop and its remainder
    monkeypatch.setattr(cpu, "PREFILL_TILE_BYTES", 12 * 256 * 4)
    out = np.full((9, 45), np.nan, np.float32)
    cpu.linear(out, w, x)
    assert_linear_close(out, oracle, x, 1e-4)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_decode_agrees_with_prefill(ggml_type):
    # The same token through the matvec kernel and through the dequantize + BLAS path (as one row of
    # a 3-token batch): a decode step must see what a prefill of the same prompt saw.
    rng = np.random.default_rng(300 + int(ggml_type))
    w, oracle = make_weight(ggml_type, 130, 768, rng)
    xs = llm_like_activations(3, 768, rng)
    batch = np.empty((3, 130), np.float32)
    cpu.linear(batch, w, xs)
    for t in range(3):
        one = np.empty((1, 130), np.float32)
        cpu.linear(one, w, xs[t : t + 1])
        bound = 1e-4 * np.linalg.norm(xs[t]) * np.linalg.norm(oracle, axis=1)
        worst = np.max(np.abs(one[0] - batch[t]) / bound)
        assert worst <= 1.0, f"token {t}: decode and prefill differ by {worst:.2f}x the tolerance"


def test_decode_error_is_float32_grade_on_a_layer_shape():
    # Whole-vector error on a SmolLM2 layer shape: int8 activations gave ~4e-3 here, float32 ~1e-7.
    rng = np.random.default_rng(7)
    w, oracle = make_weight(T.Q4_1, 256, 576, rng)
    x = llm_like_activations(1, 576, rng)
    out = np.empty((1, 256), np.float32)
    cpu.linear(out, w, x)
    ref = x.astype(np.float64) @ oracle.T
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 5e-5


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_get_rows_matches_dequantize(ggml_type):
    rng = np.random.default_rng(200 + int(ggml_type))
    w, oracle = make_weight(ggml_type, 20, 256, rng)
    ids = np.array([19, 0, 5, 5])
    out = np.empty((4, 256), np.float32)
    cpu.get_rows(out, w, ids)
    np.testing.assert_allclose(out, oracle[ids], rtol=1e-6, atol=1e-6)


def test_mxfp4_dequantizes_bit_for_bit_at_every_exponent():
    # Row r's blocks have exponent r, every one whose values are finite (12 * 2^(e-128) overflows from 253),
    # e = 0, 1 the denormal scales; all 16 nibbles in every row. get_rows (deq_mxfp4, also the prefill
    # path's) gives gguf's float32 bits, so a wrong scale, denormal branch or table entry shows here.
    rng = np.random.default_rng(39)
    raw = rng.integers(0, 256, (253, 8, 17), dtype=np.uint8)
    raw[:, 0, 1:] = np.arange(16) | (np.arange(16)[::-1] << 4)  # each block 0: every nibble, low and high
    raw[:, :, 0] = np.arange(253)[:, None]
    raw = raw.reshape(253, 8 * 17)
    ref = gguf.quants.dequantize(raw, T.MXFP4).reshape(253, 256)
    out = np.empty((253, 256), np.float32)
    cpu.get_rows(out, Weight(int(T.MXFP4), raw, 253, 256), np.arange(253))
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))
    tiny = np.abs(ref[:2])
    assert np.count_nonzero((tiny > 0) & (tiny < 2.0**-126)) > 50  # the bits compared include denormals


def test_get_rows_rejects_out_of_range_ids():
    w, _ = make_weight(T.Q8_0, 8, 32, np.random.default_rng(0))
    with pytest.raises(ValueError, match="ids"):
        cpu.get_rows(np.empty((1, 32), np.float32), w, np.array([8]))


def test_unsupported_type_raises_typed_error():
    w = Weight(int(T.IQ2_XXS), np.zeros((2, 66), np.uint8), 2, 256)
    with pytest.raises(cpu.UnsupportedWeightType, match="IQ2_XXS"):
        cpu.linear(np.empty((1, 2), np.float32), w, np.zeros((1, 256), np.float32))
    with pytest.raises(cpu.UnsupportedWeightType, match="IQ2_XXS"):
        cpu.get_rows(np.empty((1, 256), np.float32), w, np.array([0]))


def test_supported_types_cover_every_kernel_type():
    assert {int(t) for t in ALL_TYPES} == set(cpu.SUPPORTED_TYPES)


def test_linear_rejects_mismatched_shapes():
    w, _ = make_weight(T.Q4_1, 8, 64, np.random.default_rng(0))
    with pytest.raises(ValueError):
        cpu.linear(np.empty((1, 8), np.float32), w, np.zeros((1, 32), np.float32))
    bad = Weight(w.ggml_type, w.raw[:, :-1].copy(), 8, 64)  # row bytes do not match the type
    with pytest.raises(ValueError):
        cpu.linear(np.empty((1, 8), np.float32), bad, np.zeros((1, 64), np.float32))


def test_rmsnorm():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 48)).astype(np.float32)
    weight = rng.standard_normal(48).astype(np.float32)
    out = np.empty_like(x)
    cpu.rmsnorm(out, x, weight, 1e-5)
    ref = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-5) * weight
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_layernorm_without_bias_in_place():
    """Cohere's LayerNorm: mean subtracted, weight only; out may be x (offset rows: the mean matters)."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 48)) + 5.0).astype(np.float32)
    weight = rng.standard_normal(48).astype(np.float32)
    x64 = x.astype(np.float64)
    centered = x64 - x64.mean(axis=1, keepdims=True)
    ref = centered / np.sqrt(np.mean(centered**2, axis=1, keepdims=True) + 1e-5) * weight
    cpu.layernorm(x, x, weight, 1e-5)
    np.testing.assert_allclose(x, ref, rtol=1e-4, atol=1e-5)


def rope_reference(x, positions, inv_freq, n_rot, neox):
    out = x.astype(np.float64).copy()
    half = n_rot // 2
    for t, pos in enumerate(positions):
        ang = pos * inv_freq.astype(np.float64)
        c, s = np.cos(ang), np.sin(ang)
        if neox:
            a, b = out[t, :, :half].copy(), out[t, :, half:n_rot].copy()
            out[t, :, :half], out[t, :, half:n_rot] = a * c - b * s, a * s + b * c
        else:
            a, b = out[t, :, 0:n_rot:2].copy(), out[t, :, 1:n_rot:2].copy()
            out[t, :, 0:n_rot:2], out[t, :, 1:n_rot:2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [16, 10])  # 10 < head_dim: partial rotation
def test_rope(neox, n_rot):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 16)).astype(np.float32)
    positions = np.array([0, 1, 7, 300])
    inv_freq = (10000.0 ** (-np.arange(0, n_rot, 2) / n_rot)).astype(np.float32)
    ref = rope_reference(x, positions, inv_freq, n_rot, neox)
    cpu.rope(x, positions, inv_freq, n_rot, neox)
    np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(x[..., n_rot:], ref[..., n_rot:].astype(np.float32))


def attention_reference(q, k_cache, v_cache, pos0, scale):
    n_tok, n_heads, hd = q.shape
    group = n_heads // k_cache.shape[0]
    out = np.zeros((n_tok, n_heads, v_cache.shape[2]))
    for t in range(n_tok):
        for h in range(n_heads):
            k = k_cache[h // group, : pos0 + t + 1].astype(np.float64)
            v = v_cache[h // group, : pos0 + t + 1].astype(np.float64)
            s = k @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v
    return out


# 12 and 16 queries take the kernels (outside a model's batch_phase the BLAS path starts at 17)
@pytest.mark.parametrize("n_tok,pos0", [(1, 0), (1, 9), (5, 0), (6, 4), (12, 0), (16, 5)])
def test_attention_gqa_causal(n_tok, pos0):
    rng = np.random.default_rng(3)
    n_heads, n_kv, hd, max_ctx = 6, 2, 16, 32
    q = rng.standard_normal((n_tok, n_heads, hd)).astype(np.float32)
    k_cache = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float32)
    v_cache = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float32)
    # positions past pos0+n_tok hold garbage that a non-causal kernel would read
    k_cache[:, pos0 + n_tok :] = 1e4
    out = np.empty_like(q)
    cpu.attention(out, q, k_cache, v_cache, pos0, 1 / math.sqrt(hd))
    np.testing.assert_allclose(out, attention_reference(q, k_cache, v_cache, pos0, 1 / math.sqrt(hd)),
                               rtol=1e-4, atol=1e-5)


# decompressed latent attention (engine/arch/deepseek2.py): values narrower than the keys, any pass size (3
# queries take the BLAS path too); 300 queries over one query head a kv head go in blocks of 256
@pytest.mark.parametrize("n_tok,pos0,n_kv,dtype", [
    (3, 0, 4, np.float32), (20, 7, 2, np.float32), (300, 11, 4, np.float32), (40, 5, 4, np.float16),
])
def test_attention_with_values_of_another_width(n_tok, pos0, n_kv, dtype):
    rng = np.random.default_rng(4)
    n_heads, hd, v_dim, max_ctx = 4, 24, 16, 320
    q = rng.standard_normal((n_tok, n_heads, hd)).astype(np.float32)
    k_cache = rng.standard_normal((n_kv, max_ctx, hd)).astype(dtype)
    v_cache = rng.standard_normal((n_kv, max_ctx, v_dim)).astype(dtype)
    k_cache[:, pos0 + n_tok :] = 1e4
    out = np.full((n_tok, n_heads, v_dim), np.nan, np.float32)
    cpu.attention(out, q, k_cache, v_cache, pos0, 1 / math.sqrt(hd))
    ref = attention_reference(q, k_cache, v_cache, pos0, 1 / math.sqrt(hd))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)
    with pytest.raises(ValueError, match="do not fit"):
        cpu.attention(np.empty((n_tok, n_heads, hd), np.float32), q, k_cache, v_cache, pos0, 1.0)


def windowed_attention_reference(q, k_cache, v_cache, pos0, scale, window, softcap=None, sinks=None):
    """attention_reference where the query at position p sees only keys [p - window + 1, p] (its
    scores soft-capped, softcap * tanh(s / softcap), when softcap is given; with sinks, head h's
    softmax has the extra logit sinks[h], whose value is zero)."""
    n_tok, n_heads, hd = q.shape
    group = n_heads // k_cache.shape[0]
    out = np.zeros(q.shape)
    for t in range(n_tok):
        p = pos0 + t
        lo = max(0, p - window + 1)
        for h in range(n_heads):
            k = k_cache[h // group, lo : p + 1].astype(np.float64)
            v = v_cache[h // group, lo : p + 1].astype(np.float64)
            s = k @ q[t, h] * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            if sinks is not None:
                s = np.append(s, sinks[h])
                v = np.vstack([v, np.zeros(hd)])
            e = np.exp(s - s.max())
            out[t, h] = (e / e.sum()) @ v
    return out


# 150 queries take the BLAS path in three blocks of queries (the last one short); 5 the kernels, whose
# queries past the window attend over views of the cache
@pytest.mark.parametrize("n_tok,pos0,window,dtype", [
    (150, 0, None, np.float32), (150, 37, None, np.float16), (150, 20, 48, np.float32),
    (150, 0, 48, np.float16), (40, 3, 500, np.float32), (5, 60, 16, np.float32), (5, 60, 16, np.float16),
])
def test_attention_in_blocks_of_queries_with_a_sliding_window(n_tok, pos0, window, dtype):
    rng = np.random.default_rng(6)
    n_heads, n_kv, hd, max_ctx = 8, 2, 32, 256
    q = rng.standard_normal((n_tok, n_heads, hd)).astype(np.float32)
    k_cache = rng.standard_normal((n_kv, max_ctx, hd)).astype(dtype)
    v_cache = rng.standard_normal((n_kv, max_ctx, hd)).astype(dtype)
    k_cache[:, pos0 + n_tok :] = 1e4  # past the queries: a non-causal kernel would read these
    if window is not None:  # before every query's window: a kernel ignoring the window would read these
        k_cache[:, : max(0, pos0 - window + 1)] = 1e4
    out = np.full_like(q, np.nan)
    scale = 1 / math.sqrt(hd)
    cpu.attention(out, q, k_cache, v_cache, pos0, scale, window)
    ref = windowed_attention_reference(q, k_cache, v_cache, pos0, scale, window or max_ctx)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)



# Gemma 2's soft-capped scores (a cap small enough to bend them): decode, a verify-sized pass and a prefill
# of two query blocks, with and without a window, float32 and float16 caches
@pytest.mark.parametrize("n_tok,pos0,window,dtype", [
    (1, 70, None, np.float32), (1, 70, 16, np.float16), (5, 60, 16, np.float32), (90, 10, None, np.float16),
])
def test_attention_with_soft_capped_scores(n_tok, pos0, window, dtype):
    rng = np.random.default_rng(9)
    n_heads, n_kv, hd, max_ctx = 8, 2, 32, 128
    q = (3 * rng.standard_normal((n_tok, n_heads, hd))).astype(np.float32)
    k_cache = rng.standard_normal((n_kv, max_ctx, hd)).astype(dtype)
    v_cache = rng.standard_normal((n_kv, max_ctx, hd)).astype(dtype)
    k_cache[:, pos0 + n_tok :] = 1e4
    out = np.full_like(q, np.nan)
    scale = 1 / math.sqrt(hd)
    cpu.attention(out, q, k_cache, v_cache, pos0, scale, window, softcap=2.0)
    ref = windowed_attention_reference(q, k_cache, v_cache, pos0, scale, window or max_ctx, softcap=2.0)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)
    plain = windowed_attention_reference(q, k_cache, v_cache, pos0, scale, window or max_ctx)
    assert np.abs(plain - ref).max() > 1e-2  # the cap matters at these scores
    with pytest.raises(ValueError, match="softcap must be positive"):
        cpu.attention(out, q, k_cache, v_cache, pos0, scale, window, softcap=0.0)


# pos0 long_keys(hd) - 5: the pass straddles the switch to ops.attention_long (chunks of keys, merged after),
# which comes at fewer keys for wider heads (256: Gemma; 512: Gemma 4's global layers, from the first key)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    "pos0,hd", [(510, 32), (ops.LONG_KEYS - 5, 32), (ops.long_keys(256) - 5, 256), (3, 512), (300, 512)]
)
def test_attention_gives_a_query_the_same_bits_alone_or_among_others(dtype, pos0, hd):
    # 9 queries in one call (a verify pass) each get what a one-token decode step at its position gets
    # (speculative verify relies on it), float32 and float16 caches alike
    rng = np.random.default_rng(7)
    n_heads, n_kv, n_tok = 6, 2, 9
    q = rng.standard_normal((n_tok, n_heads, hd)).astype(np.float32)
    k_cache = rng.standard_normal((n_kv, pos0 + 20, hd)).astype(dtype)
    v_cache = rng.standard_normal((n_kv, pos0 + 20, hd)).astype(dtype)
    k_cache[:, pos0 + n_tok :] = 1e4  # past the queries: a non-causal kernel would read these
    together = np.empty_like(q)
    cpu.attention(together, q, k_cache, v_cache, pos0, 0.2)
    for t in range(n_tok):
        alone = np.empty_like(q[t : t + 1])
        cpu.attention(alone, q[t : t + 1], k_cache, v_cache, pos0 + t, 0.2)
        np.testing.assert_array_equal(alone, together[t : t + 1])
    ref = windowed_attention_reference(q, k_cache, v_cache, pos0, 0.2, pos0 + 20)
    np.testing.assert_allclose(together, ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_heads,n_kv,n_keys", [(9, 3, ops.LONG_KEYS), (4, 1, 3 * ops.LONG_KEYS + 77)])
def test_long_attention_in_chunks_matches_the_reference(dtype, n_heads, n_kv, n_keys):
    # one decode query past LONG_KEYS keys: its keys in chunks (up to LONG_MAX_CHUNKS, the last count
    # uneven), each read once for the kv head's query heads (GQA 3:1 as SmolLM2's, 4:1 as Gemma's)
    rng = np.random.default_rng(8)
    hd = 64
    q = rng.standard_normal((1, n_heads, hd)).astype(np.float32)
    k_cache = rng.standard_normal((n_kv, n_keys + 8, hd)).astype(dtype)
    v_cache = rng.standard_normal((n_kv, n_keys + 8, hd)).astype(dtype)
    k_cache[:, n_keys:] = 1e4
    out = np.full_like(q, np.nan)
    cpu.attention(out, q, k_cache, v_cache, n_keys - 1, 0.125)
    ref = attention_reference(q, k_cache, v_cache, n_keys - 1, 0.125)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)

# gpt-oss's attention sinks: decode (short and past LONG_KEYS, whose chunks merge with the sink), a
# verify-sized pass, a prefill (BLAS blocks), windows, float32 and float16 caches, with a soft cap too
@pytest.mark.parametrize("n_tok,pos0,window,dtype,softcap", [
    (1, 70, None, np.float32, None), (1, 70, 16, np.float16, None), (5, 60, 16, np.float32, None),
    (6, 3, None, np.float16, 2.0), (90, 10, None, np.float16, None), (90, 10, 32, np.float32, 2.0),
    (1, ops.LONG_KEYS + 40, None, np.float16, None), (3, ops.LONG_KEYS - 2, None, np.float32, None),
])
def test_attention_with_sinks(n_tok, pos0, window, dtype, softcap):
    rng = np.random.default_rng(10)
    n_heads, n_kv, hd = 8, 2, 32
    max_ctx = pos0 + n_tok + 8
    q = rng.standard_normal((n_tok, n_heads, hd)).astype(np.float32)
    k_cache = rng.standard_normal((n_kv, max_ctx, hd)).astype(dtype)
    v_cache = rng.standard_normal((n_kv, max_ctx, hd)).astype(dtype)
    k_cache[:, pos0 + n_tok :] = 1e4
    # sinks from well below to well above the scores (a sink that wins the max, one that hardly counts)
    sinks = np.array([-20, -2, -0.5, 0, 0.7, 1.5, 3, 8], np.float32)
    scale = 1 / math.sqrt(hd)
    out = np.full_like(q, np.nan)
    cpu.attention(out, q, k_cache, v_cache, pos0, scale, window, softcap=softcap, sinks=sinks)
    ref = windowed_attention_reference(q, k_cache, v_cache, pos0, scale, window or max_ctx, softcap, sinks)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)
    plain = windowed_attention_reference(q, k_cache, v_cache, pos0, scale, window or max_ctx, softcap)
    assert np.abs(plain - ref).max() > 1e-2  # the sinks matter
    if n_tok > 1:  # each query gets the bits a one-token step at its position gets
        for t in (0, n_tok - 1):
            alone = np.empty_like(q[t : t + 1])
            cpu.attention(alone, q[t : t + 1], k_cache, v_cache, pos0 + t, scale, window, softcap, sinks)
            if n_tok <= 16:
                np.testing.assert_array_equal(alone, out[t : t + 1])
            else:
                np.testing.assert_allclose(alone, out[t : t + 1], rtol=1e-4, atol=2e-5)


def test_attention_rejects_sinks_of_another_shape():
    q = np.zeros((1, 2, 8), np.float32)
    cache = np.zeros((1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="sinks must be float32"):
        cpu.attention(np.empty_like(q), q, cache, cache, 0, 1.0, sinks=np.zeros(3, np.float32))


def test_attention_rejects_a_window_below_one():
    q = np.zeros((1, 2, 8), np.float32)
    cache = np.zeros((1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="window must be positive"):
        cpu.attention(np.empty_like(q), q, cache, cache, 0, 1.0, 0)


def test_fast_exp_within_float32_grade_over_its_range():
    from numba import njit

    from engine.backends.cpu.ops import fast_exp

    @njit(fastmath=True, error_model="numpy")
    def exps(out, x):
        for i in range(x.shape[0]):
            out[i] = fast_exp(x[i])

    x = np.linspace(-87, 88, 1_000_001, dtype=np.float32)
    out = np.empty_like(x)
    exps(out, x)
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - exact) / exact) < 5e-7
    far = np.array([-1e4, -100, 100, 1e4], np.float32)  # clamped: finite, no denormals, no infinities
    exps(out[:4], far)
    assert np.all(np.isfinite(out[:4])) and out[0] == out[1] > 0 and out[2] == out[3] > 1e38


def test_silu_mul_and_gelu_tanh_mul():
    rng = np.random.default_rng(4)
    gate = (rng.standard_normal((3, 40)) * 4).astype(np.float32)
    up = rng.standard_normal((3, 40)).astype(np.float32)
    out = np.empty_like(gate)
    g = gate.astype(np.float64)
    cpu.silu_mul(out, gate, up)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * up, rtol=1e-5, atol=1e-6)
    cpu.gelu_tanh_mul(out, gate, up)
    gelu = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    np.testing.assert_allclose(out, gelu * up, rtol=1e-5, atol=1e-6)


def test_softmax_and_argmax():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 50)) * 10).astype(np.float32)
    x[1, :10] = -np.inf  # masked logits
    ref = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    ref /= ref.sum(axis=1, keepdims=True)
    assert cpu.argmax(x[2]) == int(np.argmax(x[2]))
    np.testing.assert_array_equal(cpu.argmax(x), np.argmax(x, axis=1))
    cpu.softmax(x)
    np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-7)
    assert np.all(x[1, :10] == 0)


def test_set_threads_clamps():
    assert cpu.set_threads(0) == 1
    assert cpu.set_threads(10_000) >= 1
    cpu.set_threads(2)


def check_real_matrix(path, name: str, ggml_type: T) -> None:
    """Decode and prefill through one real tensor (at most 4096 rows of it) against gguf's oracle."""
    f = open_gguf(path)
    tensor = f.tensors[name]
    assert tensor.ggml_type == ggml_type
    rows, cols = tensor.shape
    raw = tensor.raw()
    if rows > 4096:
        raw = raw[:4096]  # enough rows to be representative, and keeps the float64 oracle small
        rows = 4096
    w = Weight(int(tensor.ggml_type), np.ascontiguousarray(raw), rows, cols)
    oracle = gguf.quants.dequantize(raw, tensor.ggml_type).astype(np.float64).reshape(rows, cols)
    rng = np.random.default_rng(6)
    x = llm_like_activations(1, cols, rng)
    out = np.empty((1, rows), np.float32)
    cpu.linear(out, w, x)
    assert_linear_close(out, oracle, x, DECODE_REL)
    xs = llm_like_activations(3, cols, rng)
    outs = np.empty((3, rows), np.float32)
    cpu.linear(outs, w, xs)
    assert_linear_close(outs, oracle, xs, 1e-4)
    f.close()


@pytest.mark.parametrize("name,ggml_type", [("blk.0.ffn_down.weight", T.Q4_1), ("token_embd.weight", T.Q8_0)])
def test_real_smollm2_matrices(smollm2_path, name, ggml_type):
    # Real weight statistics (Q4_1 ffn_down, the Q8_0 embedding that is also the output matrix).
    check_real_matrix(smollm2_path, name, ggml_type)


@pytest.mark.parametrize("name,ggml_type", [
    ("blk.0.attn_q.weight", T.Q5_0),
    ("blk.0.attn_output.weight", T.Q4_K),
    ("blk.0.ffn_down.weight", T.Q6_K),
    ("blk.0.attn_v.weight", T.Q8_0),
])
def test_real_gemma3_matrices(gemma3_path, name, ggml_type):
    # Gemma-3-270M Q4_K_M mixes Q5_0 (640-column matrices), Q4_K, Q6_K and Q8_0.
    check_real_matrix(gemma3_path, name, ggml_type)
