"""A mixture-of-experts decode step's matrices in one parallel region (engine/arch/moe.py).

A GGUF file keeps a layer's experts as one (experts, rows, cols) tensor, so the k experts a token chose
are k row ranges of one array. `matvec_experts` runs all k of them at once, one parallel item per
(expert, group of four rows): for one token, k gate (or up, or down) matrices cost one launch instead of
k, and the cores stream all of them back to back instead of ramping up and draining on each small matrix.

Each row group is the type's matvec loop exactly (the same `dot4` intrinsic on the same int16 activations,
engine/backends/cpu/quant.py), so every result is bit-identical to cpu.linear on that expert alone.
Types: the GGUF block types that have a dot4 kernel (GATHER_TYPES); float and FP8/NVFP4 experts, and
experts held as separate tensors (Hugging Face folders), run expert by expert.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends.cpu import _llvm_kquant as K
from engine.backends.cpu._llvm import dot4_q4_0, dot4_q4_1, dot4_q8_0
from engine.backends.cpu.quant import QK, _store4, quantize_act16

_KW = dict(nogil=True, cache=True, fastmath=True)

# ggml type -> elements per block, for the types matvec_experts computes
GATHER_TYPES = {8: 32, 2: 32, 3: 32, 6: 32, 7: 32, 20: 32}  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL
GATHER_TYPES |= {39: 32}  # MXFP4 (gpt-oss's experts)
GATHER_TYPES |= {10: 256, 11: 256, 12: 256, 13: 256, 14: 256, 23: 256}  # Q2_K .. Q6_K, IQ4_XS


@njit(inline="always", **_KW)
def _dot4(t, raw, p0, p1, p2, p3, cols, xq, xd, xs):
    # the type's four-row dot product (the per-type matvec kernels' call), chosen by ggml type id
    if t == 12:
        return K.dot4_q4_k(raw, p0, p1, p2, p3, cols // 256, xq, xd, xs)
    if t == 14:
        return K.dot4_q6_k(raw, p0, p1, p2, p3, cols // 256, xq, xd, xs)
    if t == 13:
        return K.dot4_q5_k(raw, p0, p1, p2, p3, cols // 256, xq, xd, xs)
    if t == 11:
        return K.dot4_q3_k(raw, p0, p1, p2, p3, cols // 256, xq, xd, xs)
    if t == 10:
        return K.dot4_q2_k(raw, p0, p1, p2, p3, cols // 256, xq, xd, xs)
    if t == 23:
        return K.dot4_iq4_xs(raw, p0, p1, p2, p3, cols // 256, xq, xd, xs)
    if t == 8:
        return dot4_q8_0(raw, p0, p1, p2, p3, cols // QK, xq, xd, xs)
    if t == 2:
        return dot4_q4_0(raw, p0, p1, p2, p3, cols // QK, xq, xd, xs)
    if t == 3:
        return dot4_q4_1(raw, p0, p1, p2, p3, cols // QK, xq, xd, xs)
    if t == 6:
        return K.dot4_q5_0(raw, p0, p1, p2, p3, cols // QK, xq, xd, xs)
    if t == 7:
        return K.dot4_q5_1(raw, p0, p1, p2, p3, cols // QK, xq, xd, xs)
    if t == 39:
        return K.dot4_mxfp4(raw, p0, p1, p2, p3, cols // QK, xq, xd, xs)
    return K.dot4_iq4_nl(raw, p0, p1, p2, p3, cols // QK, xq, xd, xs)


@njit(parallel=True, **_KW)
def matvec_experts(out, raw, x, starts, rows, cols, t):
    # out (k, rows) f32 C-contiguous; raw (experts * rows, row bytes) uint8: the stacked experts, of ggml
    # type t (in GATHER_TYPES); x (1, cols) f32 (every expert's input) or (k, cols) (expert j's in row j);
    # starts (k,) int64: the first row in raw of each chosen expert. out[j] = expert j's rows @ its x.
    k = starts.shape[0]
    n_x = x.shape[0]
    xq = np.empty((n_x, cols), np.int16)
    xd = np.empty((n_x, cols // QK), np.float32)
    xs = np.empty((n_x, cols // QK), np.float32)
    for i in range(n_x):
        quantize_act16(x[i], xq[i], xd[i], xs[i])
    rb = raw.shape[1]
    groups = (rows + 3) // 4
    for item in prange(k * groups):
        j = item // groups
        r0 = (item - j * groups) * 4
        base = starts[j]
        i = j if n_x > 1 else 0
        a0, a1, a2, a3 = _dot4(t, raw, (base + r0) * rb, (base + min(r0 + 1, rows - 1)) * rb,
                               (base + min(r0 + 2, rows - 1)) * rb, (base + min(r0 + 3, rows - 1)) * rb, cols,
                               xq[i], xd[i], xs[i])
        _store4(out[j], r0, rows, a0, a1, a2, a3)
