"""Small-batch kernels for Q8_0 / Q4_0 / Q4_1 that unpack each weight block once for four tokens.

The generic small-batch kernels (smalln) run the decode dot product (`_llvm.dot4_*`) once per token
over the same four weight rows: the rows come from L1 after the first token, but their nibbles are
unpacked and widened to int16 again for every token, which is most of a quantized dot product's
work. So a batched decode step of 8 sequences cost ~7x a single decode step instead of ~1-2x.

Here one pass over four rows serves four tokens: per block, the four rows' quants are widened once
and multiplied (vpmaddwd) with each token's int16 activations into 16 float accumulators (4 rows x
4 tokens, 16 lanes each). Every (row, token) accumulator sees exactly the operations, in the same
order, that `_llvm.dot4_*` applies for that row and token (int32 pair sums, conversion, one fused
multiply-add by d_w * d_x per block, the same tree sum at the end, Q4_1's min term summed apart), so
results are bit-identical to the matvec kernels: a batched verify or decode step reproduces
token-by-token decoding. Tokens beyond a multiple of four run dot4 itself.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.backends.cpu._llvm import (
    _DOT_LAYOUTS,
    _F32,
    _I16,
    _I32,
    PREFETCH_ROWS,
    _accumulators,
    _block_quants_i16,
    _broadcast_f32,
    _check_c_array,
    _dot_pointers,
    _fmuladd16,
    _load_f16,
    _pmaddwd,
    _prefetch,
    _reduce_add_f32x16,
    dot4_q4_0,
    dot4_q4_1,
    dot4_q8_0,
)
from engine.backends.cpu.quant import _store4
from engine.backends.cpu.smalln import _act16_rows

TOKENS = 4  # tokens per pass over a row group (16 accumulators + 4 row vectors fit the 32 zmm registers)
_KW = dict(nogil=True, cache=True, fastmath=True)


def _make_dot4x4(kind: str):
    layout = _DOT_LAYOUTS[kind]
    block_bytes, _, min_off, _, _ = layout

    @intrinsic
    def dot4x4(typingctx, raw, p0, p1, p2, p3, nb, xq, xd, xs, t0):
        _check_c_array(raw, types.uint8, f"dot4x4_{kind} weights")
        for arr, dtype, what in (
            (xq, types.int16, "activations"),
            (xd, types.float32, "activation scales"),
            (xs, types.float32, "activation sums"),
        ):
            _check_c_array(arr, dtype, f"dot4x4_{kind} {what}")
        sig = types.UniTuple(types.float32, 4 * TOKENS)(
            raw, types.intp, types.intp, types.intp, types.intp, types.intp, xq, xd, xs, types.intp
        )

        def codegen(context, builder, signature, args):
            _, *row_offs, nb_v = args[:6]
            t0_v = args[9]
            base, xq_p, xd_p, xs_p = _dot_pointers(context, builder, signature, args)
            v16f = ir.VectorType(_F32, 16)
            intp = nb_v.type
            cols = builder.mul(nb_v, intp(32))
            # token t's activations: row t0 + t of the (n, cols) / (n, nb) arrays
            x_rows = [
                builder.gep(xq_p, [builder.mul(builder.add(t0_v, intp(t)), cols)]) for t in range(TOKENS)
            ]
            s_rows = [builder.mul(builder.add(t0_v, intp(t)), nb_v) for t in range(TOKENS)]
            accs, mins = _accumulators(builder, TOKENS)
            rows = [builder.gep(base, [off]) for off in row_offs]
            pf_dist = builder.mul(builder.sub(row_offs[1], row_offs[0]), intp(PREFETCH_ROWS))
            with cgutils.for_range(builder, nb_v) as loop:
                b = loop.index
                boff = builder.mul(b, intp(block_bytes))
                for row in rows:
                    _prefetch(builder, builder.gep(row, [builder.add(boff, pf_dist)]))
                blks = [builder.gep(row, [boff]) for row in rows]
                qs = [_block_quants_i16(builder, blk, layout) for blk in blks]
                ds = [_load_f16(builder, blk, ir.Constant(_I32, 0)) for blk in blks]
                ms = (
                    [_load_f16(builder, blk, ir.Constant(_I32, min_off)) for blk in blks]
                    if min_off >= 0
                    else None
                )
                for t in range(TOKENS):
                    xp = builder.bitcast(
                        builder.gep(x_rows[t], [builder.mul(b, intp(32))]),
                        ir.VectorType(_I16, 32).as_pointer(),
                    )
                    xv = builder.load(xp, align=2)
                    dx = builder.load(builder.gep(xd_p, [builder.add(s_rows[t], b)]))
                    sx = builder.load(builder.gep(xs_p, [builder.add(s_rows[t], b)])) if ms else None
                    for r in range(4):
                        dots = builder.sitofp(_pmaddwd(builder, qs[r], xv), v16f)
                        scale = builder.fmul(ds[r], dx)
                        acc = accs[t][r]
                        builder.store(
                            _fmuladd16(builder, dots, _broadcast_f32(builder, scale, 16), builder.load(acc)),
                            acc,
                        )
                        if ms:
                            mn = mins[t][r]
                            builder.store(builder.fadd(builder.load(mn), builder.fmul(ms[r], sx)), mn)
            sums = [
                builder.fadd(_reduce_add_f32x16(builder, builder.load(accs[t][r])), builder.load(mins[t][r]))
                for t in range(TOKENS)
                for r in range(4)
            ]
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    dot4x4.__doc__ = (
        f"(float32 x16) dot products of four {kind.upper()} rows with tokens t0..t0+3: [t][row] order.\n\n"
        "raw, p0..p3, nb: as dot4; xq: int16 (n, nb*32); xd, xs: float32 (n, nb) (quant.quantize_act16\n"
        "per token); rows t0..t0+3 of them are the four tokens."
    )
    return dot4x4


dot4x4_q8_0 = _make_dot4x4("q8_0")
dot4x4_q4_0 = _make_dot4x4("q4_0")
dot4x4_q4_1 = _make_dot4x4("q4_1")


# out (n, rows) f32 = x (n, cols) f32 @ W.T; raw (rows, row bytes) uint8 as for the matvec kernels.
# Row groups of four in parallel; per group, tokens four at a time, then the 1-3 left one by one.
# One kernel serves the three types: `kind` (loop-invariant, so the branch costs nothing measurable)
# picks the intrinsics, which must be named as globals for the kernel to be cached.
_Q8_0, _Q4_0, _Q4_1 = 0, 1, 2


@njit(parallel=True, **_KW)
def _matmul(out, raw, x, rows, cols, kind):
    xq, xd, xs = _act16_rows(x)
    rb, nb, n = raw.shape[1], cols // 32, x.shape[0]
    full = n - n % TOKENS
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        p0 = r0 * rb
        p1, p2, p3 = min(r0 + 1, rows - 1) * rb, min(r0 + 2, rows - 1) * rb, min(r0 + 3, rows - 1) * rb
        for t in range(0, full, TOKENS):
            if kind == _Q8_0:
                a = dot4x4_q8_0(raw, p0, p1, p2, p3, nb, xq, xd, xs, t)
            elif kind == _Q4_0:
                a = dot4x4_q4_0(raw, p0, p1, p2, p3, nb, xq, xd, xs, t)
            else:
                a = dot4x4_q4_1(raw, p0, p1, p2, p3, nb, xq, xd, xs, t)
            for u in range(TOKENS):
                _store4(out[t + u], r0, rows, a[4 * u], a[4 * u + 1], a[4 * u + 2], a[4 * u + 3])
        for t in range(full, n):
            if kind == _Q8_0:
                a0, a1, a2, a3 = dot4_q8_0(raw, p0, p1, p2, p3, nb, xq[t], xd[t], xs[t])
            elif kind == _Q4_0:
                a0, a1, a2, a3 = dot4_q4_0(raw, p0, p1, p2, p3, nb, xq[t], xd[t], xs[t])
            else:
                a0, a1, a2, a3 = dot4_q4_1(raw, p0, p1, p2, p3, nb, xq[t], xd[t], xs[t])
            _store4(out[t], r0, rows, a0, a1, a2, a3)


def matmul_q8_0(out, raw, x, rows, cols):
    _matmul(out, raw, x, rows, cols, _Q8_0)


def matmul_q4_0(out, raw, x, rows, cols):
    _matmul(out, raw, x, rows, cols, _Q4_0)


def matmul_q4_1(out, raw, x, rows, cols):
    _matmul(out, raw, x, rows, cols, _Q4_1)
