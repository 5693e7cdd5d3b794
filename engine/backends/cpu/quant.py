"""Matrix-vector (decode) and row-dequantization (prefill, embeddings) kernels per ggml type.

Decode kernels quantize the activation vector once per call to int16 per block of 32 (a scale per
block, plus the float block sum for Q4_1's min term) and run `_llvm.dot4_*`: four rows per call
share each activation block, a block's weights are widened to int16 and multiplied pairwise into
int32 lanes (vpmaddwd), and each block's lanes are added to a float vector with the block's scale.
The error is ~1e-5 of |w_row| |x|, as good as float32 accumulation, so a greedy decode reproduces
a float32 reference (int8 activations, ~4e-3, did not). The float types' (F32/F16/BF16) one-token
kernels are smalln's small-batch loop on one token.

Block layouts (gguf.GGML_QUANT_SIZES / gguf.quants), all little-endian:
  Q8_0: 34 bytes = f16 d, 32 x int8 q;               value = q * d
  Q4_0: 18 bytes = f16 d, 16 bytes of nibbles;       value = (q - 8) * d
  Q4_1: 20 bytes = f16 d, f16 m, 16 bytes nibbles;   value = q * d + m
  (nibbles: byte j holds element j in its low half and element j + 16 in its high half)

Every kernel takes `raw` as the weight's uint8 (rows, row_nbytes) C-contiguous array and
addresses it with flat byte offsets.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends.cpu._llvm import (
    deq_q4_block,
    deq_q8_block,
    dot4_q4_0,
    dot4_q4_1,
    dot4_q8_0,
    ld_bf16,
    ld_f16,
)

QK = 32  # elements per quantized block
Q8_0_BYTES = 34
Q4_0_BYTES = 18
Q4_1_BYTES = 20

_KW = dict(nogil=True, cache=True, fastmath=True)


@njit(**_KW)
def quantize_act16(x, xq, xd, xs):
    """Quantize activations to int16 per block of 32 (symmetric, round to nearest).

    x (n,) float32 -> xq (n,) int16, xd (n/32,) float32 block scale max|x|/32767,
    xs (n/32,) float32 block sum of x (Q4_1's min term multiplies it).
    """
    for b in range(x.shape[0] // QK):
        base = b * QK
        amax = np.float32(0.0)
        total = np.float32(0.0)
        for j in range(QK):
            amax = max(amax, abs(x[base + j]))
            total += x[base + j]
        inv = np.float32(32767.0) / amax if amax > 0 else np.float32(0.0)
        for j in range(QK):
            xq[base + j] = np.int16(np.rint(x[base + j] * inv))
        xd[b] = amax / np.float32(32767.0)
        xs[b] = total


# ---------------------------------------------------------------------------------------------
# Decode: out (rows,) = W (rows, cols) @ x (cols,)
# Four rows per iteration share each activation block (_llvm.dot4_*); the last group clamps its
# row indices to rows-1, so a tail of 1-3 rows is computed (redundantly) by the same loop.
# ---------------------------------------------------------------------------------------------


@njit(parallel=True, **_KW)
def matvec_q8_0(out, raw, x, rows, cols):
    # raw (rows, cols/32*34) uint8, x (cols,) f32 -> out (rows,) f32
    nb = cols // QK
    rb = raw.shape[1]
    xq = np.empty(cols, np.int16)
    xd = np.empty(nb, np.float32)
    xs = np.empty(nb, np.float32)
    quantize_act16(x, xq, xd, xs)
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = dot4_q8_0(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, nb, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def matvec_q4_0(out, raw, x, rows, cols):
    # raw (rows, cols/32*18) uint8, x (cols,) f32 -> out (rows,) f32
    nb = cols // QK
    rb = raw.shape[1]
    xq = np.empty(cols, np.int16)
    xd = np.empty(nb, np.float32)
    xs = np.empty(nb, np.float32)
    quantize_act16(x, xq, xd, xs)
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = dot4_q4_0(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, nb, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(parallel=True, **_KW)
def matvec_q4_1(out, raw, x, rows, cols):
    # raw (rows, cols/32*20) uint8, x (cols,) f32 -> out (rows,) f32
    nb = cols // QK
    rb = raw.shape[1]
    xq = np.empty(cols, np.int16)
    xd = np.empty(nb, np.float32)
    xs = np.empty(nb, np.float32)
    quantize_act16(x, xq, xd, xs)
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        a0, a1, a2, a3 = dot4_q4_1(raw, r0 * rb, min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb,
                                   min(r0 + 3, rows - 1) * rb, nb, xq, xd, xs)
        _store4(out, r0, rows, a0, a1, a2, a3)


@njit(**_KW)
def _store4(out, r0, rows, a0, a1, a2, a3):
    # Writes the (up to) four results of a row group; clamped duplicate rows are skipped.
    out[r0] = a0
    if r0 + 1 < rows:
        out[r0 + 1] = a1
    if r0 + 2 < rows:
        out[r0 + 2] = a2
    if r0 + 3 < rows:
        out[r0 + 3] = a3


# ---------------------------------------------------------------------------------------------
# Dequantize selected rows: out (len(ids), cols) float32 = W[ids]. Used by get_rows (embeddings)
# and by prefill, which dequantizes a tile of rows and hands it to BLAS.
# ---------------------------------------------------------------------------------------------


@njit(parallel=True, **_KW)
def dequant_q8_0(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/32*34) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // QK):
            o = p + b * Q8_0_BYTES
            deq_q8_block(out, i * cols + b * QK, raw, o + 2, ld_f16(raw, o))


@njit(parallel=True, **_KW)
def dequant_q4_0(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/32*18) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // QK):
            o = p + b * Q4_0_BYTES
            d = ld_f16(raw, o)
            deq_q4_block(out, i * cols + b * QK, raw, o + 2, d, np.float32(-8.0) * d)


@njit(parallel=True, **_KW)
def dequant_q4_1(out, raw, ids, cols):
    # out (n, cols) f32 C-contiguous; raw (rows, cols/32*20) uint8; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for b in range(cols // QK):
            o = p + b * Q4_1_BYTES
            deq_q4_block(out, i * cols + b * QK, raw, o + 4, ld_f16(raw, o), ld_f16(raw, o + 2))


@njit(parallel=True, **_KW)
def dequant_f32(out, w, ids, cols):
    # out (n, cols) f32; w (rows, cols) float32 view of the raw bytes; ids (n,) int64
    for i in prange(ids.shape[0]):
        r = ids[i]
        for j in range(cols):
            out[i, j] = w[r, j]


@njit(parallel=True, **_KW)
def dequant_f16(out, raw, ids, cols):
    # out (n, cols) f32; raw (rows, cols*2) uint8 of IEEE halves; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for j in range(cols):
            out[i, j] = ld_f16(raw, p + 2 * j)


@njit(parallel=True, **_KW)
def dequant_bf16(out, raw, ids, cols):
    # out (n, cols) f32; raw (rows, cols*2) uint8 of bfloat16s; ids (n,) int64
    rb = raw.shape[1]
    for i in prange(ids.shape[0]):
        p = ids[i] * rb
        for j in range(cols):
            out[i, j] = ld_bf16(raw, p + 2 * j)
