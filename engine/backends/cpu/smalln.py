"""Small-batch linear kernels: out (n, rows) = x (n, cols) @ W.T for a few tokens (2 <= n <= ~16).

This is what makes a speculative verify pass (k+1 draft positions) or a batched decode step (several
sequences) cost about one decode step: every weight row is fetched from memory once per call and
reused from L1 for all n tokens, instead of once per token (n matvecs) or dequantized in full to
float32 for BLAS (the prefill path, ~10x slower than a matvec at these n).

Quantized types: the activations of every token are quantized to int16 per 32 exactly as the matvec
kernels do (quant.quantize_act16), then each group of four weight rows runs the type's `dot4`
intrinsic once per token while those rows sit in L1. The types of _llvm_kquant (Q5_0, Q5_1, the
K-quants, IQ4_NL, IQ4_XS, MXFP4) take tokens four at a time (`dot4x4_*`: each block of the four rows
unpacked once for four tokens, the rest one by one): on 2880-3072-column matrices, 16 tokens, 2
threads, 1.3x (MXFP4) to 2.2x (Q2_K, Q3_K, Q6_K) faster, Q4_K 1.6x. Each token's result is
bit-identical to the matvec kernel's on that token alone either way, so a batched verify pass
reproduces sequential decode.
Float types (F32/F16/BF16): four rows x four tokens per pass over the row group, spelled as LLVM vector
IR (16-lane float32 FMAs, weights widened in registers, prefetched PREFETCH_ROWS rows ahead), so each
weight is loaded once for four tokens; a 1-3 token tail runs the same loop with fewer tokens. Every
(row, token) sum is formed identically whatever the batch size, and the float matvec kernels here are
the same loop on one token, so these results too are bit-identical to decoding token by token.

Every kernel takes out (n, rows) f32 C-contiguous, the weight bytes as the matvec kernels do and
x (n, cols) f32 C-contiguous.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from engine.backends.cpu import _llvm_kquant as K
from engine.backends.cpu._llvm import (
    PREFETCH_ROWS,
    _broadcast_f32,
    _fmuladd16,
    _prefetch,
    _reduce_add_f32x16,
    dot4_q4_0,
    dot4_q4_1,
    dot4_q8_0,
)
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


@njit(inline="always", **_KW)
def _store16(out, t, r0, rows, a):
    # dot4x4's sums ([token][row]) into out rows t..t+3, columns r0..r0+3 (clipped to rows)
    for u in range(4):
        _store4(out[t + u], r0, rows, a[4 * u], a[4 * u + 1], a[4 * u + 2], a[4 * u + 3])


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
    rb, full = raw.shape[1], x.shape[0] - x.shape[0] % 4
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, 4):  # four tokens a pass over the rows' blocks
            _store16(out, t, r0, rows, K.dot4x4_q5_0(raw, r0 * rb, p1, p2, p3, cols // 32, xq, xd, xs, t))
        for t in range(full, x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q5_0(raw, r0 * rb, p1, p2, p3, cols // 32, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q5_1(out, raw, x, rows, cols):
    # raw (rows, cols/32*24) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb, full = raw.shape[1], x.shape[0] - x.shape[0] % 4
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, 4):  # four tokens a pass over the rows' blocks
            _store16(out, t, r0, rows, K.dot4x4_q5_1(raw, r0 * rb, p1, p2, p3, cols // 32, xq, xd, xs, t))
        for t in range(full, x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q5_1(raw, r0 * rb, p1, p2, p3, cols // 32, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q2_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*84) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb, full = raw.shape[1], x.shape[0] - x.shape[0] % 4
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, 4):  # four tokens a pass over the rows' blocks
            _store16(out, t, r0, rows, K.dot4x4_q2_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq, xd, xs, t))
        for t in range(full, x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q2_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q3_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*110) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb, full = raw.shape[1], x.shape[0] - x.shape[0] % 4
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, 4):  # four tokens a pass over the rows' blocks
            _store16(out, t, r0, rows, K.dot4x4_q3_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq, xd, xs, t))
        for t in range(full, x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q3_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q4_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*144) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb, full = raw.shape[1], x.shape[0] - x.shape[0] % 4
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, 4):  # four tokens a pass over the rows' blocks
            _store16(out, t, r0, rows, K.dot4x4_q4_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq, xd, xs, t))
        for t in range(full, x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q4_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q5_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*176) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb, full = raw.shape[1], x.shape[0] - x.shape[0] % 4
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, 4):  # four tokens a pass over the rows' blocks
            _store16(out, t, r0, rows, K.dot4x4_q5_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq, xd, xs, t))
        for t in range(full, x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q5_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_q6_k(out, raw, x, rows, cols):
    # raw (rows, cols/256*210) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb, full = raw.shape[1], x.shape[0] - x.shape[0] % 4
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, 4):  # four tokens a pass over the rows' blocks
            _store16(out, t, r0, rows, K.dot4x4_q6_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq, xd, xs, t))
        for t in range(full, x.shape[0]):
            a0, a1, a2, a3 = K.dot4_q6_k(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_iq4_nl(out, raw, x, rows, cols):
    # raw (rows, cols/32*18) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb, full = raw.shape[1], x.shape[0] - x.shape[0] % 4
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, 4):  # four tokens a pass over the rows' blocks
            _store16(out, t, r0, rows, K.dot4x4_iq4_nl(raw, r0 * rb, p1, p2, p3, cols // 32, xq, xd, xs, t))
        for t in range(full, x.shape[0]):
            a0, a1, a2, a3 = K.dot4_iq4_nl(raw, r0 * rb, p1, p2, p3, cols // 32, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_iq4_xs(out, raw, x, rows, cols):
    # raw (rows, cols/256*136) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb, full = raw.shape[1], x.shape[0] - x.shape[0] % 4
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, 4):  # four tokens a pass over the rows' blocks
            _store16(out, t, r0, rows, K.dot4x4_iq4_xs(raw, r0 * rb, p1, p2, p3, cols // 256, xq, xd, xs, t))
        for t in range(full, x.shape[0]):
            a0, a1, a2, a3 = K.dot4_iq4_xs(raw, r0 * rb, p1, p2, p3, cols // 256, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

@njit(parallel=True, **_KW)
def matmul_mxfp4(out, raw, x, rows, cols):
    # raw (rows, cols/32*17) uint8, x (n, cols) f32 -> out (n, rows) f32
    xq, xd, xs = _act16_rows(x)
    rb, full = raw.shape[1], x.shape[0] - x.shape[0] % 4
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, 4):  # four tokens a pass over the rows' blocks
            _store16(out, t, r0, rows, K.dot4x4_mxfp4(raw, r0 * rb, p1, p2, p3, cols // 32, xq, xd, xs, t))
        for t in range(full, x.shape[0]):
            a0, a1, a2, a3 = K.dot4_mxfp4(raw, r0 * rb, p1, p2, p3, cols // 32, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_LANES = 16  # float32 lanes per vector: one zmm register
# weight array dtype -> (element kind, bytes per weight): F16 weights arrive as their uint8 bytes, BF16
# as a uint16 view of them, F32 as float32, FP8 E4M3 codes as an int8 view of them (fpquant: the sums
# are value / 256 before the row scale)
_FLOAT_KINDS = {types.uint8: ("f16", 2), types.uint16: ("bf16", 2), types.float32: ("f32", 4),
                types.int8: ("e4m3", 1)}


def _widen(builder, kind: str, ptr, n: int):
    """<n x float> of n consecutive weights of `kind` at byte pointer ptr."""
    if kind == "f32":
        return builder.load(builder.bitcast(ptr, ir.VectorType(_F32, n).as_pointer()), align=4)
    if kind == "e4m3":
        # s eeee mmm -> half s 0eeee mmm0000000 (value / fpquant.E4M3_HALF_FACTOR): the code sign-extended
        # to 16 bits and shifted left 7 has s at bits 15 and 14 and eeee mmm at 13..7; bit 14 is cleared
        vec16 = ir.VectorType(_I16, n)
        codes = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(8), n).as_pointer()), align=1)
        u = builder.sext(codes, vec16)
        bits = builder.and_(builder.shl(u, ir.Constant(vec16, [7] * n)), ir.Constant(vec16, [0xBF80] * n))
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), n)), ir.VectorType(_F32, n))
    h = builder.load(builder.bitcast(ptr, ir.VectorType(_I16, n).as_pointer()), align=2)
    if kind == "f16":
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), n)), ir.VectorType(_F32, n))
    wide = builder.shl(builder.zext(h, ir.VectorType(_I32, n)), ir.Constant(ir.VectorType(_I32, n), [16] * n))
    return builder.bitcast(wide, ir.VectorType(_F32, n))


def _fmuladd1(builder, a, b, c):
    fnty = ir.FunctionType(_F32, [_F32, _F32, _F32])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.fmuladd.f32"), [a, b, c])


COL_BLOCK = 128  # block-wise FP8 (fpquant.FP8_E4M3_BLOCK): columns one scale covers, 8 vectors


def _make_rows4(n_tok: int):
    """Intrinsic: dot products of 4 float weight rows with n_tok activation rows (4 * n_tok float32s).

    rows4(raw, p0, p1, p2, p3, x, xo, cols, sc, o0, o1, o2, o3): rows at byte offsets p0..p3 of raw, the
    tokens' activations x[xo + t cols : ...]. sc is a float32 array: 1-D, it is not read here (row scales
    are the caller's); 2-D (rows, ceil(cols / COL_BLOCK)), each COL_BLOCK columns' sums are multiplied
    by their scale, sc's flat elements o_r + block for row r.

    Each (row, token) sum is built the same way whatever n_tok is: 16 float32 lanes accumulated with
    fused multiply-adds over the columns in order (2-D sc: each block's lanes from zero, then multiplied
    by the block's scale into the row's lanes), a fixed halving tree over the lanes, then the cols % 16
    tail in order. So a token's result is bit-identical across batch sizes.
    """

    @intrinsic
    def rows4(typingctx, raw, p0, p1, p2, p3, x, xo, cols, sc, o0, o1, o2, o3):
        if not (isinstance(raw, types.Array) and raw.layout == "C" and raw.dtype in _FLOAT_KINDS):
            raise TypingError(f"float weights must be a C-contiguous uint8/uint16/float32 array, got {raw}")
        for a, what in ((x, "activations"), (sc, "scales")):
            if not (isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32):
                raise TypingError(f"{what} must be a C-contiguous float32 array, got {a}")
        kind, elem_bytes = _FLOAT_KINDS[raw.dtype]
        blocked = sc.ndim == 2
        ip = types.intp
        sig = types.UniTuple(types.float32, 4 * n_tok)(raw, ip, ip, ip, ip, x, ip, ip, sc, ip, ip, ip, ip)

        def codegen(context, builder, signature, args):
            raw_v, q0, q1, q2, q3, x_v, xo_v, cols_v, sc_v = args[:9]
            base = builder.bitcast(context.make_array(signature.args[0])(context, builder, raw_v).data,
                                   ir.IntType(8).as_pointer())
            xp = context.make_array(signature.args[5])(context, builder, x_v).data
            intp = cols_v.type
            vec = ir.VectorType(_F32, _LANES)
            rows = [builder.gep(base, [q]) for q in (q0, q1, q2, q3)]
            xrows = [builder.gep(xp, [builder.add(xo_v, builder.mul(cols_v, intp(t)))]) for t in range(n_tok)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(4)]
                    for _ in range(n_tok)]
            # weights stream from DRAM: prefetch the same columns PREFETCH_ROWS rows ahead (p1 - p0 is the
            # row stride; 0 in a clamped tail group, a harmless re-read)
            ahead = builder.mul(builder.sub(q1, q0), intp(PREFETCH_ROWS))
            n_vec = builder.udiv(cols_v, intp(_LANES))

            def step(v):  # vector v (columns 16 v .. 16 v + 15) of every row into accs
                j = builder.mul(v, intp(_LANES))
                byte = builder.mul(j, intp(elem_bytes))
                ws = []
                for r in rows:
                    p = builder.gep(r, [byte])
                    _prefetch(builder, builder.gep(p, [ahead]))
                    ws.append(_widen(builder, kind, p, _LANES))
                for t in range(n_tok):
                    xv = builder.load(builder.bitcast(builder.gep(xrows[t], [j]), vec.as_pointer()), align=4)
                    for r in range(4):
                        builder.store(_fmuladd16(builder, ws[r], xv, builder.load(accs[t][r])), accs[t][r])

            if blocked:
                scp = context.make_array(signature.args[8])(context, builder, sc_v).data
                srows = [builder.gep(scp, [o]) for o in args[9:13]]
                totals = [[cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(4)]
                          for _ in range(n_tok)]
                per = intp(COL_BLOCK // _LANES)
                n_blk = builder.udiv(builder.add(n_vec, intp(COL_BLOCK // _LANES - 1)), per)
                with cgutils.for_range(builder, n_blk) as blk:
                    for acc_t in accs:
                        for a in acc_t:
                            builder.store(ir.Constant(vec, None), a)
                    v0 = builder.mul(blk.index, per)
                    v1 = builder.add(v0, per)
                    v1 = builder.select(builder.icmp_unsigned("<", v1, n_vec), v1, n_vec)
                    with cgutils.for_range_slice(builder, v0, v1, intp(1)) as (v, _):
                        step(v)
                    scales = [_broadcast_f32(builder, builder.load(builder.gep(sr, [blk.index])), _LANES)
                              for sr in srows]
                    for t in range(n_tok):
                        for r in range(4):
                            total = builder.load(totals[t][r])
                            builder.store(_fmuladd16(builder, builder.load(accs[t][r]), scales[r], total),
                                          totals[t][r])
                accs = totals
            else:
                with cgutils.for_range(builder, n_vec) as loop:
                    step(loop.index)
            sums = [[cgutils.alloca_once_value(builder, _reduce_add_f32x16(builder, builder.load(a)))
                     for a in acc_t] for acc_t in accs]
            tail0 = builder.mul(n_vec, intp(_LANES))
            # blocked: the tail (inside the last block) sums from zero, then times that block's scale
            tails = [[cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(4)]
                     for _ in range(n_tok)] if blocked else sums
            with cgutils.for_range_slice(builder, tail0, cols_v, intp(1)) as (j, _):
                byte = builder.mul(j, intp(elem_bytes))
                ws = [builder.extract_element(_widen(builder, kind, builder.gep(r, [byte]), 1), _I32(0))
                      for r in rows]
                for t in range(n_tok):
                    xs = builder.load(builder.gep(xrows[t], [j]))
                    for r in range(4):
                        builder.store(_fmuladd1(builder, ws[r], xs, builder.load(tails[t][r])), tails[t][r])
            if blocked:
                last = builder.udiv(tail0, intp(COL_BLOCK))
                scales = [builder.load(builder.gep(sr, [last])) for sr in srows]
                for t in range(n_tok):
                    for r in range(4):
                        tail, total = builder.load(tails[t][r]), builder.load(sums[t][r])
                        builder.store(_fmuladd1(builder, tail, scales[r], total), sums[t][r])
            vals = [builder.load(s) for sums_t in sums for s in sums_t]
            return context.make_tuple(builder, signature.return_type, vals)

        return sig, codegen

    return rows4


_rows4x4 = _make_rows4(4)
_rows4x3 = _make_rows4(3)
_rows4x2 = _make_rows4(2)
_rows4x1 = _make_rows4(1)


def _row_scales(scale, r0, rows, factor):
    """(s0, s1, s2, s3, o0, o1, o2, o3) of row group r0 (rows r0..r0+3, clamped to rows-1): the factors
    its sums are multiplied by (scale 1-D: scale[r] * factor, empty: factor; 2-D: factor) and the flat
    offsets of its rows in a 2-D scale (rows, blocks) for rows4 (0 for 1-D)."""


@overload(_row_scales, inline="always", jit_options={"fastmath": True})
def _row_scales_impl(scale, r0, rows, factor):
    if scale.ndim == 2:
        def blocks(scale, r0, rows, factor):
            nb = scale.shape[1]
            r1, r2, r3 = min(r0 + 1, rows - 1), min(r0 + 2, rows - 1), min(r0 + 3, rows - 1)
            return factor, factor, factor, factor, r0 * nb, r1 * nb, r2 * nb, r3 * nb
        return blocks

    def per_row(scale, r0, rows, factor):
        if scale.shape[0] == 0:
            return factor, factor, factor, factor, 0, 0, 0, 0
        r1, r2, r3 = min(r0 + 1, rows - 1), min(r0 + 2, rows - 1), min(r0 + 3, rows - 1)
        return (scale[r0] * factor, scale[r1] * factor, scale[r2] * factor, scale[r3] * factor, 0, 0, 0, 0)
    return per_row


@njit(parallel=True, **_KW)
def _matmul_float(out, w, x, rows, cols, rb, scale, factor):
    # w (rows, ...) uint8 (F16 bytes) / uint16 (BF16) / float32 (F32) / int8 (E4M3 codes), row stride rb
    # bytes; x (n, cols) f32 -> out (n, rows) f32, each sum times factor and the row's scale: scale (rows,)
    # f32, empty (none) or (rows, ceil(cols / COL_BLOCK)) (a scale per row and block of columns, see
    # rows4). Four rows x four tokens per pass; a 1-3 token tail at the end.
    n = x.shape[0]
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p0, p1 = r0 * rb, min(r0 + 1, rows - 1) * rb
        p2, p3 = min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        s0, s1, s2, s3, o0, o1, o2, o3 = _row_scales(scale, r0, rows, factor)
        t0 = 0
        while n - t0 >= 4:
            a = _rows4x4(w, p0, p1, p2, p3, x, t0 * cols, cols, scale, o0, o1, o2, o3)
            _store4(out[t0], r0, rows, a[0] * s0, a[1] * s1, a[2] * s2, a[3] * s3)
            _store4(out[t0 + 1], r0, rows, a[4] * s0, a[5] * s1, a[6] * s2, a[7] * s3)
            _store4(out[t0 + 2], r0, rows, a[8] * s0, a[9] * s1, a[10] * s2, a[11] * s3)
            _store4(out[t0 + 3], r0, rows, a[12] * s0, a[13] * s1, a[14] * s2, a[15] * s3)
            t0 += 4
        left = n - t0
        if left == 3:
            a = _rows4x3(w, p0, p1, p2, p3, x, t0 * cols, cols, scale, o0, o1, o2, o3)
            _store4(out[t0], r0, rows, a[0] * s0, a[1] * s1, a[2] * s2, a[3] * s3)
            _store4(out[t0 + 1], r0, rows, a[4] * s0, a[5] * s1, a[6] * s2, a[7] * s3)
            _store4(out[t0 + 2], r0, rows, a[8] * s0, a[9] * s1, a[10] * s2, a[11] * s3)
        elif left == 2:
            a = _rows4x2(w, p0, p1, p2, p3, x, t0 * cols, cols, scale, o0, o1, o2, o3)
            _store4(out[t0], r0, rows, a[0] * s0, a[1] * s1, a[2] * s2, a[3] * s3)
            _store4(out[t0 + 1], r0, rows, a[4] * s0, a[5] * s1, a[6] * s2, a[7] * s3)
        elif left == 1:
            a = _rows4x1(w, p0, p1, p2, p3, x, t0 * cols, cols, scale, o0, o1, o2, o3)
            _store4(out[t0], r0, rows, a[0] * s0, a[1] * s1, a[2] * s2, a[3] * s3)


_NO_SCALE = np.empty(0, np.float32)
_ONE = np.float32(1.0)


@njit(**_KW)
def matmul_f32(out, w, x, rows, cols):
    # w (rows, cols) float32, x (n, cols) f32 -> out (n, rows) f32
    _matmul_float(out, w, x, rows, cols, cols * 4, _NO_SCALE, _ONE)


@njit(**_KW)
def matmul_f16(out, raw, x, rows, cols):
    # raw (rows, cols*2) uint8 IEEE halves, x (n, cols) f32 -> out (n, rows) f32
    _matmul_float(out, raw, x, rows, cols, raw.shape[1], _NO_SCALE, _ONE)


@njit(**_KW)
def matmul_bf16(out, raw, x, rows, cols):
    # raw (rows, cols*2) uint8 bfloat16s, x (n, cols) f32 -> out (n, rows) f32
    _matmul_float(out, raw.view(np.uint16), x, rows, cols, raw.shape[1], _NO_SCALE, _ONE)


@njit(**_KW)
def matvec_f32(out, w, x, rows, cols):
    # w (rows, cols) float32, x (cols,) f32 -> out (rows,) f32: matmul_f32 on one token
    _matmul_float(out.reshape((1, rows)), w, x.reshape((1, cols)), rows, cols, cols * 4, _NO_SCALE, _ONE)


@njit(**_KW)
def matvec_f16(out, raw, x, rows, cols):
    # raw (rows, cols*2) uint8, x (cols,) f32 -> out (rows,) f32: matmul_f16 on one token
    _matmul_float(out.reshape((1, rows)), raw, x.reshape((1, cols)), rows, cols, raw.shape[1], _NO_SCALE,
                  _ONE)


@njit(**_KW)
def matvec_bf16(out, raw, x, rows, cols):
    # raw (rows, cols*2) uint8, x (cols,) f32 -> out (rows,) f32: matmul_bf16 on one token
    _matmul_float(out.reshape((1, rows)), raw.view(np.uint16), x.reshape((1, cols)), rows, cols, raw.shape[1],
                  _NO_SCALE, _ONE)
