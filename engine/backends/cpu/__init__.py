"""CPU backend: Numba kernels over weights kept in their on-disk (ggml) encoding.

Public ops (all float32, output buffer first, nothing allocated in the decode path except the
kernels' small activation scratch):
  linear(out, w, x)            out (n_tok, rows) = x (n_tok, cols) @ W.T for a quantized/float Weight
  get_rows(out, w, ids)        embedding lookup: out (len(ids), cols) = W[ids]
  rmsnorm(out, x, weight, eps) rope(x, positions, inv_freq, n_rot, neox)
  attention(out, q, k_cache, v_cache, pos0, scale, window=None, softcap=None, sinks=None)
                               (k/v caches float32 or float16)
  silu_mul(out, gate, up)      gelu_tanh_mul(out, gate, up)     swiglu_oai_mul(out, gate, up, alpha, limit)
  softmax(x)                   argmax(x)                  set_threads(n)

Import through the `engine` package (it points Numba's JIT cache at the user cache dir first).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

import numba
import numpy as np

from engine.backends.cpu import batchq, experts, fpquant, kquant, ops, quant, smalln
from engine.weights import Weight
from models.errors import HearthError
from models.formats.ggml_types import type_name

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 6, 7, 10, 11, 12, 13, 14, 20, 23
MXFP4 = 39

# ggml type -> (elements per block, bytes per block)
_BLOCK = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), Q4_0: (32, 18), Q4_1: (32, 20),
    Q5_0: (32, 22), Q5_1: (32, 24), Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176),
    Q6_K: (256, 210), IQ4_NL: (32, 18), IQ4_XS: (256, 136), MXFP4: (32, 17),
}

# The ggml types this backend computes with; loaders check weights against it before any kernel runs.
SUPPORTED_TYPES = frozenset(_BLOCK)

# float32 scratch per prefill tile of dequantized rows. Large enough that every layer matrix is one
# tile (BLAS then writes `out` contiguously, ~15% faster than into a column slice), small enough to
# bound memory for the 49152 x 576 embedding/output matrix (tiled into ~7300-row pieces).
PREFILL_TILE_BYTES = 16 << 20


class UnsupportedWeightType(HearthError):
    """A weight uses a ggml type the CPU backend has no kernel for.

    Args:
        ggml_type: the type id found on the weight.
    """

    def __init__(self, ggml_type: int):
        self.ggml_type = int(ggml_type)
        name = type_name(self.ggml_type)
        supported = ", ".join(type_name(t) for t in sorted(_BLOCK))
        super().__init__(
            f"weight type {name} (ggml type {self.ggml_type}) is not supported by the CPU backend "
            f"(supported: {supported}); pick a model file quantized to one of these."
        )


def _f32_view(raw: np.ndarray) -> np.ndarray:
    # F32 rows arrive as uint8 (rows, cols*4); the kernels take them as float32 (rows, cols)
    return raw.view(np.float32)


def _identity(raw: np.ndarray) -> np.ndarray:
    return raw


# ggml type -> (matvec kernel, dequant kernel, how the raw bytes are passed)
_KERNELS: dict[int, tuple[Callable, Callable, Callable]] = {
    # float matvecs: smalln's loop on one token (bit-identical to its small batches, 16-lane FMAs)
    F32: (smalln.matvec_f32, quant.dequant_f32, _f32_view),
    F16: (smalln.matvec_f16, quant.dequant_f16, _identity),
    BF16: (smalln.matvec_bf16, quant.dequant_bf16, _identity),
    Q8_0: (quant.matvec_q8_0, quant.dequant_q8_0, _identity),
    Q4_0: (quant.matvec_q4_0, quant.dequant_q4_0, _identity),
    Q4_1: (quant.matvec_q4_1, quant.dequant_q4_1, _identity),
    Q5_0: (kquant.matvec_q5_0, kquant.dequant_q5_0, _identity),
    Q5_1: (kquant.matvec_q5_1, kquant.dequant_q5_1, _identity),
    Q2_K: (kquant.matvec_q2_k, kquant.dequant_q2_k, _identity),
    Q3_K: (kquant.matvec_q3_k, kquant.dequant_q3_k, _identity),
    Q4_K: (kquant.matvec_q4_k, kquant.dequant_q4_k, _identity),
    Q5_K: (kquant.matvec_q5_k, kquant.dequant_q5_k, _identity),
    Q6_K: (kquant.matvec_q6_k, kquant.dequant_q6_k, _identity),
    IQ4_NL: (kquant.matvec_iq4_nl, kquant.dequant_iq4_nl, _identity),
    IQ4_XS: (kquant.matvec_iq4_xs, kquant.dequant_iq4_xs, _identity),
    MXFP4: (kquant.matvec_mxfp4, kquant.dequant_mxfp4, _identity),
}

# ggml type -> small-batch kernel (smalln): out (n, rows) = x (n, cols) @ W.T, weights read once for all n
# (Q8_0/Q4_0/Q4_1: batchq, which unpacks each weight block once for four tokens)
_SMALL: dict[int, Callable] = {
    F32: smalln.matmul_f32, F16: smalln.matmul_f16, BF16: smalln.matmul_bf16, Q8_0: batchq.matmul_q8_0,
    Q4_0: batchq.matmul_q4_0, Q4_1: batchq.matmul_q4_1, Q5_0: smalln.matmul_q5_0, Q5_1: smalln.matmul_q5_1,
    Q2_K: smalln.matmul_q2_k, Q3_K: smalln.matmul_q3_k, Q4_K: smalln.matmul_q4_k, Q5_K: smalln.matmul_q5_k,
    Q6_K: smalln.matmul_q6_k, IQ4_NL: smalln.matmul_iq4_nl, IQ4_XS: smalln.matmul_iq4_xs,
    MXFP4: smalln.matmul_mxfp4,
}

# Up to this many tokens, linear runs the small-batch kernels (each weight row read once for all tokens,
# on every Numba thread) instead of dequantize + BLAS, whatever the weights: speculative verify passes
# (k+1 tokens) and batched decode steps (a few sequences) live below it, and get each token the bits a
# one-token step would.
SMALL_BATCH_MAX = 16

# For more tokens, a forward pass keeps the small-batch kernels while they still beat dequantize + BLAS
# for its weights (small_batch_limit): per type, the most tokens at which they did on a 1536 x 768 matrix
# (2 shared cores, 2026-12-05, after the four-token kernels; small / BLAS ms at that count, then at the
# next count measured). Dequantizing the whole matrix costs BLAS about 0.7 ms whatever the count, while
# the small kernels cost per token, so the legacy 4/5/8-bit types and the float types keep them longest;
# the K-quants' kernels do more per weight. A 4096 x 4096 matrix moves each crossover up, if anywhere
# (Q4_0 64: 16.2 / 16.7 ms, Q8_0 64: 13.8 / 16.9, Q4_K 32: 10.8 / 12.8, Q6_K 48: 12.8 / 14.6, F16 64:
# 13.7 / 15.3), so the smaller matrix's figures are the ones kept.
SMALL_BATCH_CROSSOVER = {
    Q4_0: 48,  # 48: 0.90 / 1.16, 64: 1.24 / 1.20
    Q4_1: 48,  # 48: 1.05 / 1.15, 64: 1.33 / 1.19
    Q8_0: 64,  # 64: 1.05 / 1.28, 96: 1.52 / 1.46
    Q5_0: 48,  # 48: 0.98 / 1.09, 64: 1.32 / 1.11
    Q5_1: 40,  # 40: 0.93 / 1.01, 48: 1.10 / 1.07
    Q2_K: 24,  # 24: 0.73 / 0.84, 32: 0.97 / 0.85
    Q3_K: 40,  # 40: 0.87 / 1.01, 48: 1.06 / 1.05
    Q4_K: 32,  # 32: 0.77 / 0.94, 40: 1.02 / 0.97
    Q5_K: 32,  # 32: 0.86 / 0.97, 40: 1.10 / 1.03
    Q6_K: 48,  # 48: 0.95 / 1.10, 64: 1.27 / 1.19
    IQ4_NL: 48,  # 48: 0.95 / 1.18, 64: 1.21 / 1.19
    IQ4_XS: 48,  # 48: 0.95 / 1.09, 64: 1.30 / 1.20
    MXFP4: 48,  # 32: 0.65 / 0.98, 64: 1.24 / 1.25
    F16: 96,  # 96: 1.05 / 1.42, 128: 1.56 / 1.65
    BF16: 96,  # 96: 1.22 / 1.39, 128: 1.73 / 1.59
    F32: 96,  # 96: 1.34 / 1.41, 128: 1.46 / 1.71
}


def small_batch_limit(weights) -> int:
    """The most tokens for which a forward pass over `weights` runs the small-batch kernels: the per-type
    crossovers (SMALL_BATCH_CROSSOVER, SMALL_BATCH_MAX for the others) averaged by the weights' sizes,
    and at least SMALL_BATCH_MAX."""
    total = limit = 0.0
    for w in weights:
        size = w.rows * w.cols
        total += size
        limit += size * SMALL_BATCH_CROSSOVER.get(w.ggml_type, SMALL_BATCH_MAX)
    return max(SMALL_BATCH_MAX, int(limit / total) if total else SMALL_BATCH_MAX)


_scratch = threading.local()


def _small_batch_max() -> int:
    """The small-batch limit of the forward pass running on this thread (batch_phase)."""
    return getattr(_scratch, "small_max", SMALL_BATCH_MAX)


def _kernels_for(w: Weight) -> tuple[Callable, Callable, np.ndarray]:
    """Kernels for w's type and its bytes in the form they take; validates the weight's layout."""
    try:
        matvec, dequant, view = _KERNELS[w.ggml_type]
    except KeyError:
        raise UnsupportedWeightType(w.ggml_type) from None
    block, nbytes = _BLOCK[w.ggml_type]
    raw = w.raw
    if (
        w.cols % block
        or raw.dtype != np.uint8
        or raw.shape != (w.rows, w.cols // block * nbytes)
        or not raw.flags.c_contiguous
    ):
        raise ValueError(
            f"{type_name(w.ggml_type)} weight {w.rows}x{w.cols} needs C-contiguous uint8 raw of shape "
            f"({w.rows}, {w.cols // block * nbytes}) with cols a multiple of {block}; got {raw.dtype} "
            f"{raw.shape}"
        )
    return matvec, dequant, view(raw)


def _tile_scratch(n_floats: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n_floats:
        buf = np.empty(n_floats, np.float32)
        _scratch.buf = buf
    return buf


def linear(out: np.ndarray, w: Weight, x: np.ndarray) -> None:
    """out = x @ W.T, reading W in its stored encoding.

    Args:
        out: float32 (n_tok, w.rows), written.
        w: the weight, in one of SUPPORTED_TYPES (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
            Q2_K..Q6_K, IQ4_NL, IQ4_XS, MXFP4).
        x: float32 (n_tok, w.cols), C-contiguous.

    n_tok == 1 (decode) runs a matrix-vector kernel on the quantized blocks, with x quantized to
    int16 per block of 32 for the quantized types (error ~1e-5 of |w_row| |x|, float32-grade).
    2 <= n_tok <= the pass's small-batch limit (SMALL_BATCH_MAX, or more in a pass batch_phase gave a
    larger one: speculative verify, batched decode, short prompts) runs the small-batch kernels: each
    weight row is read once for all tokens, and every token's result equals the matvec's on it bit for
    bit (float types included).
    More tokens (prefill) dequantize tiles of rows to float32 and multiply them with BLAS, exact to
    float32 rounding.

    Raises:
        UnsupportedWeightType: no kernel for w.ggml_type.
        ValueError: shapes or dtypes do not match.
    """
    if w.ggml_type in fpquant.FP_TYPES:  # FP8 / NVFP4 from safetensors: per-row scales beside the codes
        fpquant.linear(out, w, x, _small_batch_max())
        return
    matvec, dequant, raw = _kernels_for(w)
    n_tok = x.shape[0]
    if x.ndim != 2 or x.shape[1] != w.cols or out.shape != (n_tok, w.rows):
        raise ValueError(f"linear: x {x.shape} and out {out.shape} do not fit a {w.rows}x{w.cols} weight")
    if n_tok == 1:
        matvec(out[0], raw, x[0], w.rows, w.cols)
        return
    if n_tok <= _small_batch_max() and x.flags.c_contiguous and out.flags.c_contiguous:
        _SMALL[w.ggml_type](out, raw, x, w.rows, w.cols)
        return
    tile = max(4, min(w.rows, PREFILL_TILE_BYTES // (4 * w.cols)))
    scratch = _tile_scratch(tile * w.cols)
    for r0 in range(0, w.rows, tile):
        r1 = min(r0 + tile, w.rows)
        rows = scratch[: (r1 - r0) * w.cols].reshape(r1 - r0, w.cols)
        dequant(rows, raw, np.arange(r0, r1, dtype=np.int64), w.cols)
        np.matmul(x, rows.T, out=out[:, r0:r1])


def get_rows(out: np.ndarray, w: Weight, ids: np.ndarray) -> None:
    """Embedding lookup: out (len(ids), w.cols) float32 = dequantized rows `ids` of w.

    Raises:
        UnsupportedWeightType: no kernel for w.ggml_type.
        ValueError: an id is outside [0, w.rows) or out has the wrong shape.
    """
    if w.ggml_type in fpquant.FP_TYPES:
        fpquant.get_rows(out, w, ids)
        return
    _, dequant, raw = _kernels_for(w)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if out.shape != (ids.shape[0], w.cols) or not out.flags.c_contiguous:
        raise ValueError(f"get_rows: out {out.shape} should be C-contiguous ({ids.shape[0]}, {w.cols})")
    if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
        raise ValueError(f"get_rows: ids must lie in [0, {w.rows}), got [{ids.min()}, {ids.max()}]")
    dequant(out, raw, ids, w.cols)


def rmsnorm(out: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float) -> None:
    """out = x / sqrt(mean(x**2, axis=-1) + eps) * weight; x, out (n_tok, dim), weight (dim,)."""
    ops.rmsnorm(out, x, weight, np.float32(eps))


def layernorm(out: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float) -> None:
    """out = (x - mean) / sqrt(var + eps) * weight over the last axis, without bias (Cohere's LayerNorm);
    x, out (n_tok, dim), weight (dim,)."""
    ops.layernorm(out, x, weight, np.float32(eps))


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, n_rot: int, neox: bool) -> None:
    """Rotary embedding in place on x (n_tok, n_heads, head_dim), first n_rot dims of each head.

    Args:
        positions: (n_tok,) integer positions.
        inv_freq: float32 (n_rot // 2,), frequency scaling already applied.
        neox: False pairs dims (2i, 2i+1) (GGML "normal", llama GGUFs); True pairs (i, i + n_rot/2).
    """
    if n_rot % 2 or n_rot > x.shape[2] or inv_freq.shape[0] != n_rot // 2:
        raise ValueError(f"rope: n_rot={n_rot} must be even, <= head_dim {x.shape[2]}, with n_rot/2 freqs")
    ops.rope(x, np.asarray(positions, dtype=np.int64), inv_freq, int(n_rot), bool(neox))


def attention(
    out: np.ndarray,
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    pos0: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
    key_ends: np.ndarray | None = None,
) -> None:
    """Causal multi-head attention over one layer's KV cache (GQA aware).

    Args:
        out: float32 (n_tok, n_heads, v_dim), written.
        q: float32 (n_tok, n_heads, head_dim); query i sits at position pos0 + i.
        k_cache, v_cache: float32 or float16 (n_kv_heads, max_ctx, head_dim) and (n_kv_heads, max_ctx,
            v_dim) holding positions [0, pos0 + n_tok); both of one dtype. Scores and sums are float32
            either way. Values of another width than the keys (v_dim != head_dim: decompressed latent
            attention, engine/arch/deepseek2.py) take the BLAS path whatever the pass's size.
        pos0: position of the first query.
        scale: multiplies q.k (usually head_dim ** -0.5); positive.
        window: None, or a sliding window: the query at position p sees only keys [p - window + 1, p].
        softcap: None, or soft-capped scores (Gemma 2): softcap * tanh(scale q.k / softcap) before the
            softmax.
        sinks: None, or float32 (n_heads,) attention-sink logits (gpt-oss): each joins its head's softmax
            denominator as a score with no value.
        key_ends: None, or int64 (n_tok,): query i sees keys up to position key_ends[i] - 1 (at least its
            own, at most the pass's last) instead of its own: an image's tokens see the whole image
            (engine.vision.tokens.ImageTable.key_ends). Such passes take the BLAS path whatever their size.
    """
    n_tok, n_heads, _ = q.shape
    if n_heads % k_cache.shape[0] or pos0 + n_tok > k_cache.shape[1]:
        raise ValueError(
            f"attention: {n_heads} heads over {k_cache.shape[0]} kv heads, positions up to {pos0 + n_tok} "
            f"in a cache of {k_cache.shape[1]}"
        )
    if k_cache.dtype == np.float16 and (
        v_cache.dtype != np.float16 or v_cache.shape[:2] != k_cache.shape[:2]
    ):
        raise ValueError(
            f"attention: v_cache {v_cache.dtype} {v_cache.shape} does not match the float16 k_cache"
        )
    wide = v_cache.shape[2] != q.shape[2]  # values of another width: the BLAS path only
    if out.shape != (n_tok, n_heads, v_cache.shape[2]) or k_cache.shape[2] != q.shape[2]:
        raise ValueError(
            f"attention: q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape} and out {out.shape} "
            "do not fit"
        )
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be positive, got {window}")
    # Past the pass's small-batch limit (prefill), BLAS matmuls per kv head and block of queries: the Numba
    # kernels run on one thread there (batch_phase). Up to it (speculative verify passes, batched decode,
    # short prompts) the kernels keep every thread: a 9-token verify pass on SmolLM2 spent 10.6 ms in the
    # BLAS path's per-head numpy calls, 3.5 ms in the kernel (which also gives each query the bits a
    # one-token decode step would).
    if softcap is not None and softcap <= 0:
        raise ValueError(f"attention: softcap must be positive, got {softcap}")
    if sinks is None:
        sinks = _NO_SINKS
    elif sinks.shape != (n_heads,) or sinks.dtype != np.float32:
        raise ValueError(f"attention: sinks must be float32 ({n_heads},), got {sinks.dtype} {sinks.shape}")
    if key_ends is not None:
        key_ends = np.ascontiguousarray(key_ends, dtype=np.int64)
        own = np.arange(pos0 + 1, pos0 + n_tok + 1)
        if key_ends.shape != (n_tok,) or (key_ends < own).any() or (key_ends > pos0 + n_tok).any():
            raise ValueError(f"attention: key_ends must be ({n_tok},) between each query's position + 1 and "
                             f"{pos0 + n_tok}")
    if n_tok > _small_batch_max() or key_ends is not None or wide:
        ends = _NO_ENDS if key_ends is None else key_ends
        _attention_blas(
            out, q, k_cache, v_cache, int(pos0), np.float32(scale), window or 0, softcap, sinks, ends
        )
        return
    # the kernels start every query at key 0: queries whose window reaches past position 0 attend one
    # at a time over a view of the cache that starts at their first key
    head = n_tok if window is None else min(n_tok, max(0, window - pos0))
    cap = softcap or 0.0
    if head:
        _attention_kernel(out[:head], q[:head], k_cache, v_cache, pos0, scale, cap, sinks)
    for i in range(head, n_tok):
        start = pos0 + i - window + 1
        k, v = k_cache[:, start:], v_cache[:, start:]
        _attention_kernel(out[i : i + 1], q[i : i + 1], k, v, window - 1, scale, cap, sinks)


_NO_SINKS = np.empty(0, np.float32)
_NO_ENDS = np.empty(0, np.int64)


def _attention_kernel(out, q, k_cache, v_cache, pos0: int, scale: float, cap: float, sinks) -> None:
    """The Numba attention kernels (few queries: decode, verify passes, batched decode steps).

    Queries with at least ops.long_keys(head_dim) keys go to ops.attention_long, the others to the
    per-head kernels: which one a query takes depends on its own key count (and the layer's head size)
    only, so it gets the same bits in a decode step and in a verify pass.
    """
    pos0, scale, cap = int(pos0), np.float32(scale), np.float32(cap)
    if k_cache.dtype == np.float16:  # Numba has no float16: the kernels read the halves' bits themselves
        k_cache, v_cache = k_cache.view(np.uint16), v_cache.view(np.uint16)
    long_keys = ops.long_keys(q.shape[2])
    short = min(len(q), max(0, long_keys - 1 - pos0))  # queries before the one with long_keys keys
    if short and k_cache.dtype == np.uint16:
        ops.attention_f16(out[:short], q[:short], k_cache, v_cache, pos0, scale, cap, sinks)
    elif short:
        ops.attention(out[:short], q[:short], k_cache, v_cache, pos0, scale, cap, sinks)
    if short < len(q):
        ops.attention_long(out[short:], q[short:], k_cache, v_cache, pos0 + short, scale, cap, sinks)


# _attention_blas's queries per block: a block multiplies only the keys its queries see (the causal
# triangle's blocks, and the window's band), so at 512 tokens it computes about 56% of the full square.
# Small enough for the softmax's scores to stay in L2 (64 x 4 heads x 2048 keys: 2 MiB). A kv head with
# fewer than 4 query heads takes 4 // rep times as many queries a block, so that a block keeps about 256
# score rows: each block reads its kv head's keys and values once, and 64 rows a product left them
# re-read 4x as often. 16 heads of 192 (DeepSeek-V2-Lite decompressed, rep 1), 512 queries after 1536 and
# 4096 cached keys, 1 thread, ms, blocks of 64 / 128 / 256 queries: 149 / 126 / 110 and 354 / 300 / 263
# (rerun: 177 / 145 / 130, 415 / 334 / 286); heads of 128 alike (108 / 101 / 83 after 1536).
_ATTENTION_QUERY_BLOCK = 64


def _attention_blas(
    out, q, k_cache, v_cache, pos0: int, scale: np.float32, window: int, softcap: float | None, sinks,
    ends=_NO_ENDS,
) -> None:
    """attention() for many queries, window 0 for none: per kv head and block of queries, scores =
    Q K^T over the keys the block sees (all the kv head's query heads at once, one row each), soft-capped
    when asked, the masked softmax in place (ops.causal_softmax), then P V. Float16 caches are widened to
    float32 over the keys in use."""
    n_tok, n_heads, head_dim = q.shape
    n_kv, v_dim = k_cache.shape[0], v_cache.shape[2]
    rep = n_heads // n_kv
    base = 0 if window == 0 else max(0, pos0 - window + 1)  # the first key any query sees
    ctx = pos0 + n_tok
    if k_cache.dtype == np.float16:
        k_cache = k_cache[:, base:ctx].astype(np.float32)
        v_cache = v_cache[:, base:ctx].astype(np.float32)
    else:
        k_cache, v_cache = k_cache[:, base:ctx], v_cache[:, base:ctx]
    block = _ATTENTION_QUERY_BLOCK * max(1, 4 // rep)
    for i0 in range(0, n_tok, block):
        i1 = min(i0 + block, n_tok)
        key0 = base if window == 0 else max(base, pos0 + i0 - window + 1)  # the block's first key
        block_ends = ends[i0:i1] if len(ends) else ends
        last = int(block_ends.max()) if len(ends) else pos0 + i1
        keys = slice(key0 - base, last - base)
        for g in range(n_kv):
            heads = slice(g * rep, (g + 1) * rep)
            qb = q[i0:i1, heads].reshape((i1 - i0) * rep, head_dim)  # row (query, head)
            scores = qb @ k_cache[g, keys].T
            group_sinks = sinks[heads] if len(sinks) else sinks
            if softcap is None:
                ops.causal_softmax(scores, rep, pos0 + i0, key0, window, scale, group_sinks, block_ends)
            else:
                np.tanh(scores * np.float32(scale / softcap), out=scores)
                scores *= np.float32(softcap)
                ops.causal_softmax(scores, rep, pos0 + i0, key0, window, np.float32(1.0), group_sinks,
                                   block_ends)
            out[i0:i1, heads] = (scores @ v_cache[g, keys]).reshape(i1 - i0, rep, v_dim)


def _flat(a: np.ndarray, name: str) -> np.ndarray:
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return a.reshape(-1)


def gathers_experts(w: Weight) -> bool:
    """Whether linear_experts computes on w's type (the GGUF block types with a matvec dot kernel)."""
    return w.ggml_type in experts.GATHER_TYPES


def linear_experts(out: np.ndarray, stack: Weight, x: np.ndarray, starts: np.ndarray, rows: int) -> None:
    """One token through k experts of a stacked expert tensor in one pass: out[j] = rows starts[j] ..
    starts[j] + rows of `stack` @ x[j] (or x[0] for all), each bit-identical to linear on that expert.

    Args:
        out: float32 (k, rows), C-contiguous.
        stack: the experts' matrices as one weight of (experts * rows) rows, a type gathers_experts takes.
        x: float32 (1 or k, stack.cols), C-contiguous.
        starts: (k,) first row of each expert in stack (expert e: e * rows).

    Raises:
        UnsupportedWeightType: a type gathers_experts refuses. ValueError: shapes do not fit.
    """
    if not gathers_experts(stack):
        raise UnsupportedWeightType(stack.ggml_type)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    k = starts.shape[0]
    if out.shape != (k, rows) or x.shape[0] not in (1, k) or x.shape[1] != stack.cols or x.ndim != 2:
        raise ValueError(f"linear_experts: out {out.shape}, x {x.shape} for {k} experts of {rows} rows")
    if k and (starts.min() < 0 or starts.max() + rows > stack.rows):
        raise ValueError(f"linear_experts: experts' rows outside the stack's {stack.rows}")
    experts.matvec_experts(out, stack.raw, x, starts, rows, stack.cols, stack.ggml_type)


def silu_mul(out: np.ndarray, gate: np.ndarray, up: np.ndarray) -> None:
    """out = silu(gate) * up (SwiGLU), float32 arrays of one shape."""
    ops.silu_mul(_flat(out, "out"), _flat(gate, "gate"), _flat(up, "up"))


def swiglu_oai_mul(out: np.ndarray, gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> None:
    """gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
    out = g * sigmoid(alpha g) * (u + 1); float32 arrays of one shape."""
    ops.swiglu_oai_mul(_flat(out, "out"), _flat(gate, "gate"), _flat(up, "up"), np.float32(alpha),
                       np.float32(limit))


def gelu_tanh_mul(out: np.ndarray, gate: np.ndarray, up: np.ndarray) -> None:
    """out = gelu_tanh(gate) * up (GeGLU, tanh approximation), float32 arrays of one shape."""
    ops.gelu_tanh_mul(_flat(out, "out"), _flat(gate, "gate"), _flat(up, "up"))


def softmax(x: np.ndarray) -> None:
    """Softmax over the last axis, in place; x float32, C-contiguous, any number of leading axes."""
    ops.softmax_rows(_flat(x, "x").reshape(-1, x.shape[-1]))


def argmax(x: np.ndarray) -> int | np.ndarray:
    """Index of the maximum along the last axis: an int for 1-D x, an int64 array for (n, m) x."""
    rows = _flat(x, "x").reshape(-1, x.shape[-1])
    idx = np.empty(rows.shape[0], np.int64)
    ops.argmax_rows(idx, rows)
    return int(idx[0]) if x.ndim == 1 else idx.reshape(x.shape[:-1])


def set_threads(n: int) -> int:
    """Set the number of Numba threads for kernels launched from the calling thread.

    Clamped to [1, NUMBA_NUM_THREADS]; returns the number in effect.
    """
    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


@contextmanager
def batch_phase(n_tok: int, small_max: int = SMALL_BATCH_MAX):
    """Scope of one forward pass over n_tok tokens, whose linears run the small-batch kernels up to
    small_max tokens (small_batch_limit of the model's weights; never below SMALL_BATCH_MAX).

    Past it the heavy work is OpenBLAS's (multi-threaded) matmul; Numba's OpenMP workers, which spin
    between parallel regions, would fight its threads for the cores (measured on 2 cores: prefill
    2.3x slower). So Numba kernels run on the calling thread for such a pass, while the decode path
    (n_tok == 1) and passes up to small_max (small-batch kernels), which are all Numba, keep every
    thread.
    """
    small_max = max(SMALL_BATCH_MAX, small_max)
    saved = _small_batch_max()
    _scratch.small_max = small_max
    n = numba.get_num_threads() if n_tok > small_max else 0  # the decode path leaves threads alone
    if n:
        numba.set_num_threads(1)
    try:
        yield
    finally:
        _scratch.small_max = saved
        if n:
            numba.set_num_threads(n)


def kernels_exclusive() -> bool:
    """Whether Numba's parallel kernels must never run on two threads at once: its fallback threading layer
    (workqueue, where neither OpenMP nor TBB is found) aborts the process when they do."""
    try:
        return numba.threading_layer() == "workqueue"
    except ValueError:  # no parallel kernel has run yet: the layer is not chosen
        return True


def get_threads() -> int:
    """The number of Numba threads kernels launched from the calling thread use."""
    return numba.get_num_threads()


def kernels_compiled() -> int:
    """Kernel signatures this process compiled rather than loaded from Numba's on-disk cache (a cold
    cache: a fresh install, or kernel sources changed)."""
    total = 0
    for module in (batchq, fpquant, kquant, ops, quant, smalln):
        for value in vars(module).values():
            if isinstance(value, numba.core.registry.CPUDispatcher):
                total += sum(value.stats.cache_misses.values())
    return total


__all__ = [
    "UnsupportedWeightType", "linear", "linear_experts", "gathers_experts", "get_rows", "rmsnorm", "rope",
    "attention", "silu_mul",
    "gelu_tanh_mul", "softmax", "argmax", "set_threads", "get_threads", "batch_phase", "PREFILL_TILE_BYTES",
    "SUPPORTED_TYPES", "SMALL_BATCH_MAX", "SMALL_BATCH_CROSSOVER", "small_batch_limit", "kernels_compiled",
]
