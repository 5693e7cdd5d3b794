"""Decode (matvec) and row-dequantization kernels for Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS and MXFP4.

Same scheme as quant.py: decode quantizes the activation vector once per call to int16 per 32
elements (scale and float sum per 32) and runs `_llvm_kquant.dot4_<type>` on four rows at a time;
dequantization writes float32 rows block by block with `_llvm_kquant.deq_<type>` (bit-identical to
gguf.quants.dequantize). Block layouts are described in _llvm_kquant.

Every kernel takes `raw` as the weight's uint8 (rows, row_nbytes) C-contiguous array and addresses it
with flat byte offsets; `cols` is a multiple of the type's block size (checked by the caller).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends.cpu import _llvm_kquant as K
from engine.backends.cpu.quant import QK, _store4, quantize_act16

_KW = dict(nogil=True, cache=True, fastmath=True)


@njit(**_KW)
def _act16(x):
    # x (cols,) f32 -> int16 quants (cols,), float32 scale (cols/32,), float32 sum (cols/32,)
    nb = x.shape[0] // QK
    xq = np.empty(x.shape[0], np.int16)
    xd = np.empty(nb, np.float32)
    xs = np.empty(nb, np.float32)
    quantize_act16(x, xq, xd, xs)
    return xq, xd, xs


@njit(parallel=True, **_KW)
def matvec_q5_0(out, raw, x, rows, cols):
    # raw (rows, cols/32*22) uint8, x (cols,) f32 -> out (rows,) f32
    xq, xd, xs = _act16(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = K.dot4_q5_0(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, cols // 32, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def dequant_q5_0(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/32*22) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // 32):
            K.deq_q5_0(out, i * cols + b * 32, raw, p + b * 22)


@njit(parallel=True, **_KW)
def matvec_q5_1(out, raw, x, rows, cols):
    # raw (rows, cols/32*24) uint8, x (cols,) f32 -> out (rows,) f32
    xq, xd, xs = _act16(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = K.dot4_q5_1(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, cols // 32, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def dequant_q5_1(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/32*24) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // 32):
            K.deq_q5_1(out, i * cols + b * 32, raw, p + b * 24)


@njit(parallel=True, **_KW)
def matvec_q2_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*84) uint8, x (cols,) f32 -> out (rows,) f32
    xq, xd, xs = _act16(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = K.dot4_q2_k(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, cols // 256, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def dequant_q2_k(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/256*84) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // 256):
            K.deq_q2_k(out, i * cols + b * 256, raw, p + b * 84)


@njit(parallel=True, **_KW)
def matvec_q3_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*110) uint8, x (cols,) f32 -> out (rows,) f32
    xq, xd, xs = _act16(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = K.dot4_q3_k(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, cols // 256, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def dequant_q3_k(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/256*110) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // 256):
            K.deq_q3_k(out, i * cols + b * 256, raw, p + b * 110)


@njit(parallel=True, **_KW)
def matvec_q4_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*144) uint8, x (cols,) f32 -> out (rows,) f32
    xq, xd, xs = _act16(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = K.dot4_q4_k(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, cols // 256, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def dequant_q4_k(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/256*144) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // 256):
            K.deq_q4_k(out, i * cols + b * 256, raw, p + b * 144)


@njit(parallel=True, **_KW)
def matvec_q5_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*176) uint8, x (cols,) f32 -> out (rows,) f32
    xq, xd, xs = _act16(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = K.dot4_q5_k(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, cols // 256, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def dequant_q5_k(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/256*176) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // 256):
            K.deq_q5_k(out, i * cols + b * 256, raw, p + b * 176)


@njit(parallel=True, **_KW)
def matvec_q6_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*210) uint8, x (cols,) f32 -> out (rows,) f32
    xq, xd, xs = _act16(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = K.dot4_q6_k(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, cols // 256, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def dequant_q6_k(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/256*210) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // 256):
            K.deq_q6_k(out, i * cols + b * 256, raw, p + b * 210)


@njit(parallel=True, **_KW)
def matvec_iq4_nl(out, raw, x, rows, cols):
    # raw (rows, cols/32*18) uint8, x (cols,) f32 -> out (rows,) f32
    xq, xd, xs = _act16(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = K.dot4_iq4_nl(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, cols // 32, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def dequant_iq4_nl(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/32*18) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // 32):
            K.deq_iq4_nl(out, i * cols + b * 32, raw, p + b * 18)


@njit(parallel=True, **_KW)
def matvec_iq4_xs(out, raw, x, rows, cols):
    # raw (rows, cols/256*136) uint8, x (cols,) f32 -> out (rows,) f32
    xq, xd, xs = _act16(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = K.dot4_iq4_xs(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, cols // 256, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def dequant_iq4_xs(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/256*136) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // 256):
            K.deq_iq4_xs(out, i * cols + b * 256, raw, p + b * 136)


@njit(parallel=True, **_KW)
def matvec_mxfp4(out, raw, x, rows, cols):
    # raw (rows, cols/32*17) uint8, x (cols,) f32 -> out (rows,) f32
    xq, xd, xs = _act16(x)
    rb = raw.shape[1]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = K.dot4_mxfp4(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, cols // 32, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def dequant_mxfp4(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/32*17) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // 32):
            K.deq_mxfp4(out, i * cols + b * 32, raw, p + b * 17)
