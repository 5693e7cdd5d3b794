"""Small-batch linear kernels: out (n, rows) = x (n, cols) @ W.T for a few tokens (2 <= n <= ~16).

This is what makes a speculative verify pass (k+1 draft positions) or a batched decode step (several
sequences) cost about one decode step: every weight row is fetched from memory once per call and
reused from L1 for all n tokens, instead of once per token (n matvecs) or dequantized in full to
float32 for BLAS (the prefill path, ~10x slower than a matvec at these n).

Quantized types: the activations of every token are quantized to int16 per 32 exactly as the matvec
kernels do (quant.quantize_act16), then each group of four weight rows runs the type's `dot4`
intrinsic once per token while those rows sit in L1. Each token's result is therefore bit-identical
to the matvec kernel's on that token alone, so a batched verify pass reproduces sequential decode.
Float types (F32/F16/BF16): four rows x four tokens per pass over the row group, so each weight is
loaded (and widened) once for four tokens; float32 accumulation (a tail token runs a 4x1 loop).

Every kernel takes out (n, rows) f32 C-contiguous, the weight bytes as the matvec kernels do and
x (n, cols) f32 C-contiguous.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends.cpu import _llvm_kquant as K
from engine.backends.cpu._llvm import dot4_q4_0, dot4_q4_1, dot4_q8_0, ld_bf16, ld_f16
from engine.backends.cpu.quant import QK, _store4, quantize_act16

_KW = dict(nogil=True, cache=True, fastmath=True)


@njit(**_KW)
def _act16_rows(x):
    # x (n, cols) f32 -> int16 quants (n, cols), float32 scale (n, cols/32), float32 sum (n, cols/32)
    n, cols = x.shape
    xq = np.empty((n, cols), np.int16)
    xd = np.empty((n, cols // QK), np.float32)
    xs = np.empty((n, cols // QK), np.float32)
    for t in range(n):
        quantize_act16(x[t], xq[t], xd[t], xs[t])
    return xq, xd, xs


@njit(parallel=True, **_KW)
def matmul_q8_0(out, raw, x, rows, cols):
    # raw (rows, cols/32*34) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = dot4_q8_0(raw, r0 * rb, p1, p2, p3, cols // 32, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q4_0(out, raw, x, rows, cols):
    # raw (rows, cols/32*18) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = dot4_q4_0(raw, r0 * rb, p1, p2, p3, cols // 32, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q4_1(out, raw, x, rows, cols):
    # raw (rows, cols/32*20) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = dot4_q4_1(raw, r0 * rb, p1, p2, p3, cols // 32, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q5_0(out, raw, x, rows, cols):
    # raw (rows, cols/32*22) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q5_0(raw, r0 * rb, p1, p2, p3, cols // 32, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q5_1(out, raw, x, rows, cols):
    # raw (rows, cols/32*24) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q5_1(raw, r0 * rb, p1, p2, p3, cols // 32, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q2_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*84) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q2_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q3_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*110) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q3_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q4_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*144) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q4_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q5_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*176) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q5_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q6_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*210) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q6_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_iq4_nl(out, raw, x, rows, cols):
    # raw (rows, cols/32*18) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = K.dot4_iq4_nl(raw, r0 * rb, p1, p2, p3, cols // 32, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_iq4_xs(out, raw, x, rows, cols):
    # raw (rows, cols/256*136) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = K.dot4_iq4_xs(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(inline="always", **_KW)
def _f32_4x4(out, w, x, p0, p1, p2, p3, r0, rows, cols, t0, n_valid):
    # rows r0..r0+3 (row indices p0..p3) x tokens t0..t0+3 (clamped to n); stores n_valid tokens
    last = x.shape[0] - 1
    t1, t2, t3 = min(t0 + 1, last), min(t0 + 2, last), min(t0 + 3, last)
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for j in range(cols):
        w0 = w[p0, j]
        w1 = w[p1, j]
        w2 = w[p2, j]
        w3 = w[p3, j]
        x0, x1, x2, x3 = x[t0, j], x[t1, j], x[t2, j], x[t3, j]
        a00 += w0 * x0
        a01 += w1 * x0
        a02 += w2 * x0
        a03 += w3 * x0
        a10 += w0 * x1
        a11 += w1 * x1
        a12 += w2 * x1
        a13 += w3 * x1
        a20 += w0 * x2
        a21 += w1 * x2
        a22 += w2 * x2
        a23 += w3 * x2
        a30 += w0 * x3
        a31 += w1 * x3
        a32 += w2 * x3
        a33 += w3 * x3
    _store4(out[t0], r0, rows, a00, a01, a02, a03)
    if n_valid > 1:
        _store4(out[t1], r0, rows, a10, a11, a12, a13)
    if n_valid > 2:
        _store4(out[t2], r0, rows, a20, a21, a22, a23)
    if n_valid > 3:
        _store4(out[t3], r0, rows, a30, a31, a32, a33)


@njit(inline="always", **_KW)
def _f32_4x1(out, w, x, p0, p1, p2, p3, r0, rows, cols, t):
    # rows r0..r0+3 x the single token t
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for j in range(cols):
        w0 = w[p0, j]
        w1 = w[p1, j]
        w2 = w[p2, j]
        w3 = w[p3, j]
        xj = x[t, j]
        a0 += w0 * xj
        a1 += w1 * xj
        a2 += w2 * xj
        a3 += w3 * xj
    _store4(out[t], r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def matmul_f32(out, w, x, rows, cols):
    # w (rows, cols) float32, x (n, cols) f32 -> out (n, rows) f32
    n = x.shape[0]
    rb = 1  # p0..p3 are row indices of the float32 view
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p0, p1 = r0 * rb, min(r0 + 1, rows - 1) * rb
        p2, p3 = min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        t0 = 0
        while n - t0 >= 2:  # four tokens at a time; a tail of 2-3 runs clamped to n
            _f32_4x4(out, w, x, p0, p1, p2, p3, r0, rows, cols, t0, min(4, n - t0))
            t0 += 4
        if t0 < n:
            _f32_4x1(out, w, x, p0, p1, p2, p3, r0, rows, cols, t0)


@njit(inline="always", **_KW)
def _f16_4x4(out, raw, x, p0, p1, p2, p3, r0, rows, cols, t0, n_valid):
    # rows r0..r0+3 (byte offsets p0..p3) x tokens t0..t0+3 (clamped to n); stores n_valid tokens
    last = x.shape[0] - 1
    t1, t2, t3 = min(t0 + 1, last), min(t0 + 2, last), min(t0 + 3, last)
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for j in range(cols):
        w0 = ld_f16(raw, p0 + 2 * j)
        w1 = ld_f16(raw, p1 + 2 * j)
        w2 = ld_f16(raw, p2 + 2 * j)
        w3 = ld_f16(raw, p3 + 2 * j)
        x0, x1, x2, x3 = x[t0, j], x[t1, j], x[t2, j], x[t3, j]
        a00 += w0 * x0
        a01 += w1 * x0
        a02 += w2 * x0
        a03 += w3 * x0
        a10 += w0 * x1
        a11 += w1 * x1
        a12 += w2 * x1
        a13 += w3 * x1
        a20 += w0 * x2
        a21 += w1 * x2
        a22 += w2 * x2
        a23 += w3 * x2
        a30 += w0 * x3
        a31 += w1 * x3
        a32 += w2 * x3
        a33 += w3 * x3
    _store4(out[t0], r0, rows, a00, a01, a02, a03)
    if n_valid > 1:
        _store4(out[t1], r0, rows, a10, a11, a12, a13)
    if n_valid > 2:
        _store4(out[t2], r0, rows, a20, a21, a22, a23)
    if n_valid > 3:
        _store4(out[t3], r0, rows, a30, a31, a32, a33)


@njit(inline="always", **_KW)
def _f16_4x1(out, raw, x, p0, p1, p2, p3, r0, rows, cols, t):
    # rows r0..r0+3 x the single token t
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for j in range(cols):
        w0 = ld_f16(raw, p0 + 2 * j)
        w1 = ld_f16(raw, p1 + 2 * j)
        w2 = ld_f16(raw, p2 + 2 * j)
        w3 = ld_f16(raw, p3 + 2 * j)
        xj = x[t, j]
        a0 += w0 * xj
        a1 += w1 * xj
        a2 += w2 * xj
        a3 += w3 * xj
    _store4(out[t], r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def matmul_f16(out, raw, x, rows, cols):
    # raw (rows, cols*2) uint8, x (n, cols) f32 -> out (n, rows) f32
    n = x.shape[0]
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p0, p1 = r0 * rb, min(r0 + 1, rows - 1) * rb
        p2, p3 = min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        t0 = 0
        while n - t0 >= 2:  # four tokens at a time; a tail of 2-3 runs clamped to n
            _f16_4x4(out, raw, x, p0, p1, p2, p3, r0, rows, cols, t0, min(4, n - t0))
            t0 += 4
        if t0 < n:
            _f16_4x1(out, raw, x, p0, p1, p2, p3, r0, rows, cols, t0)


@njit(inline="always", **_KW)
def _bf16_4x4(out, raw, x, p0, p1, p2, p3, r0, rows, cols, t0, n_valid):
    # rows r0..r0+3 (byte offsets p0..p3) x tokens t0..t0+3 (clamped to n); stores n_valid tokens
    last = x.shape[0] - 1
    t1, t2, t3 = min(t0 + 1, last), min(t0 + 2, last), min(t0 + 3, last)
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for j in range(cols):
        w0 = ld_bf16(raw, p0 + 2 * j)
        w1 = ld_bf16(raw, p1 + 2 * j)
        w2 = ld_bf16(raw, p2 + 2 * j)
        w3 = ld_bf16(raw, p3 + 2 * j)
        x0, x1, x2, x3 = x[t0, j], x[t1, j], x[t2, j], x[t3, j]
        a00 += w0 * x0
        a01 += w1 * x0
        a02 += w2 * x0
        a03 += w3 * x0
        a10 += w0 * x1
        a11 += w1 * x1
        a12 += w2 * x1
        a13 += w3 * x1
        a20 += w0 * x2
        a21 += w1 * x2
        a22 += w2 * x2
        a23 += w3 * x2
        a30 += w0 * x3
        a31 += w1 * x3
        a32 += w2 * x3
        a33 += w3 * x3
    _store4(out[t0], r0, rows, a00, a01, a02, a03)
    if n_valid > 1:
        _store4(out[t1], r0, rows, a10, a11, a12, a13)
    if n_valid > 2:
        _store4(out[t2], r0, rows, a20, a21, a22, a23)
    if n_valid > 3:
        _store4(out[t3], r0, rows, a30, a31, a32, a33)


@njit(inline="always", **_KW)
def _bf16_4x1(out, raw, x, p0, p1, p2, p3, r0, rows, cols, t):
    # rows r0..r0+3 x the single token t
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for j in range(cols):
        w0 = ld_bf16(raw, p0 + 2 * j)
        w1 = ld_bf16(raw, p1 + 2 * j)
        w2 = ld_bf16(raw, p2 + 2 * j)
        w3 = ld_bf16(raw, p3 + 2 * j)
        xj = x[t, j]
        a0 += w0 * xj
        a1 += w1 * xj
        a2 += w2 * xj
        a3 += w3 * xj
    _store4(out[t], r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def matmul_bf16(out, raw, x, rows, cols):
    # raw (rows, cols*2) uint8, x (n, cols) f32 -> out (n, rows) f32
    n = x.shape[0]
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p0, p1 = r0 * rb, min(r0 + 1, rows - 1) * rb
        p2, p3 = min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        t0 = 0
        while n - t0 >= 2:  # four tokens at a time; a tail of 2-3 runs clamped to n
            _bf16_4x4(out, raw, x, p0, p1, p2, p3, r0, rows, cols, t0, min(4, n - t0))
            t0 += 4
        if t0 < n:
            _bf16_4x1(out, raw, x, p0, p1, p2, p3, r0, rows, cols, t0)
