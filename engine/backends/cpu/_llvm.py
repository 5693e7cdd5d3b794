"""LLVM-level helpers (Numba intrinsics) the CPU kernels are built from.

Numba types every int8/int32 product as int64, which stops LLVM from using the narrow SIMD
dot-product instructions. These intrinsics spell the block arithmetic as LLVM vector IR so the
x86 backend can select vpmaddwd (AVX-512BW / AVX2), vcvtph2ps (F16C) and FMAs.

Every array argument must be C-contiguous; offsets are flat *element* offsets from the first
element (for the uint8 weight arrays: byte offsets), so a 2-D weight can be addressed row by row
without reshaping it. No bounds checks: callers compute offsets from validated shapes.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _splat(ty: ir.Type, n: int, value) -> ir.Constant:
    return ir.Constant(ir.VectorType(ty, n), [ir.Constant(ty, value)] * n)


def _check_c_array(arr, dtype, what: str) -> None:
    if not (isinstance(arr, types.Array) and arr.layout == "C" and arr.dtype == dtype):
        raise TypingError(f"{what} must be a C-contiguous {dtype} array, got {arr}")


def _ptr(context, builder, arrty, arr, offset, elem_ty: ir.Type):
    """Pointer to element `offset` of a C-contiguous array, cast to elem_ty*."""
    data = context.make_array(arrty)(context, builder, arr).data
    p = builder.gep(data, [offset])
    return builder.bitcast(p, elem_ty.as_pointer())


def _broadcast_f32(builder, value, n: int):
    """<n x float> with every lane = value."""
    undef = ir.Constant(ir.VectorType(_F32, n), ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _nibbles32(builder, packed):
    """<16 x i8> packed nibbles -> <32 x i8>: low nibbles are elements 0..15, high 16..31."""
    lo = builder.and_(packed, _splat(_I8, 16, 15))
    hi = builder.lshr(packed, _splat(_I8, 16, 4))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


@intrinsic
def ld_f16(typingctx, arr, off):
    """float32 of the IEEE half stored little-endian at byte `off` of a uint8 array."""
    _check_c_array(arr, types.uint8, "ld_f16 array")
    sig = types.float32(arr, types.intp)

    def codegen(context, builder, signature, args):
        p = _ptr(context, builder, signature.args[0], args[0], args[1], _I16)
        h = builder.load(p, align=1)
        return builder.fpext(builder.bitcast(h, ir.HalfType()), _F32)

    return sig, codegen


@intrinsic
def half_to_f32(typingctx, bits):
    """float32 of an IEEE half given as its uint16 bits (how float16 arrays reach Numba, as a uint16 view)."""
    if bits != types.uint16:
        raise TypingError(f"half_to_f32 takes uint16 bits, got {bits}")
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)

    return sig, codegen


@intrinsic
def pow2_f32(typingctx, k):
    """2.0 ** k as float32 for an integral float32 k in [-126, 127], built from its exponent bits (plain
    integer and bitcast IR, so that loops calling it vectorize)."""
    if k != types.float32:
        raise TypingError(f"pow2_f32 takes a float32, got {k}")
    sig = types.float32(k)

    def codegen(context, builder, signature, args):
        biased = builder.add(builder.fptosi(args[0], _I32), ir.Constant(_I32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(_I32, 23)), _F32)

    return sig, codegen


@intrinsic
def ld_bf16(typingctx, arr, off):
    """float32 of the bfloat16 stored little-endian at byte `off` of a uint8 array."""
    _check_c_array(arr, types.uint8, "ld_bf16 array")
    sig = types.float32(arr, types.intp)

    def codegen(context, builder, signature, args):
        p = _ptr(context, builder, signature.args[0], args[0], args[1], _I16)
        h = builder.zext(builder.load(p, align=1), _I32)
        return builder.bitcast(builder.shl(h, ir.Constant(_I32, 16)), _F32)

    return sig, codegen


def _store_f32x32(context, builder, arrty, arr, off, vec):
    v32f = ir.VectorType(_F32, 32)
    builder.store(vec, _ptr(context, builder, arrty, arr, off, v32f), align=4)


@intrinsic
def deq_q4_block(typingctx, out, oo, w, wo, d, m):
    """out[oo:oo+32] = nibble(w[wo:wo+16]) * d + m (float32); Q4_0 passes m = -8 d."""
    _check_c_array(out, types.float32, "deq_q4_block output")
    _check_c_array(w, types.uint8, "deq_q4_block weights")
    sig = types.void(out, types.intp, w, types.intp, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        v16 = ir.VectorType(_I8, 16)
        packed = builder.load(_ptr(context, builder, signature.args[2], args[2], args[3], v16), align=1)
        v32f = ir.VectorType(_F32, 32)
        qf = builder.uitofp(_nibbles32(builder, packed), v32f)
        vals = builder.fadd(builder.fmul(qf, _broadcast_f32(builder, args[4], 32)),
                            _broadcast_f32(builder, args[5], 32))
        _store_f32x32(context, builder, signature.args[0], args[0], args[1], vals)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def deq_q8_block(typingctx, out, oo, w, wo, d):
    """out[oo:oo+32] = int8(w[wo:wo+32]) * d (float32)."""
    _check_c_array(out, types.float32, "deq_q8_block output")
    _check_c_array(w, types.uint8, "deq_q8_block weights")
    sig = types.void(out, types.intp, w, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        v32, v32f = ir.VectorType(_I8, 32), ir.VectorType(_F32, 32)
        q = builder.load(_ptr(context, builder, signature.args[2], args[2], args[3], v32), align=1)
        vals = builder.fmul(builder.sitofp(q, v32f), _broadcast_f32(builder, args[4], 32))
        _store_f32x32(context, builder, signature.args[0], args[0], args[1], vals)
        return context.get_dummy_value()

    return sig, codegen


# ---------------------------------------------------------------------------------------------
# Decode dot products with int16 activations.
#
# x is quantized per block of 32 to int16 (scale max|x|/32767, ~1.5e-5 relative: float32-grade for a
# greedy decode, where int8's ~4e-3 flipped tokens). A block's 32 weights are widened to int16 and
# multiplied with the int16 activations pairwise into 16 int32 lanes (the pattern x86 selects as one
# vpmaddwd; |sum| <= 2 * 32767 * 128, no overflow); the lanes are converted to float and added to a
# per-row float vector with one FMA by the block's combined scale d_w * d_x. The horizontal sum
# happens once per row, not per block.
# ---------------------------------------------------------------------------------------------

# ggml type name -> (bytes per block, byte offset of the quants, byte offset of Q4_1's f16 min or -1,
#                    4-bit nibbles?, offset subtracted from each quant)
_DOT_LAYOUTS = {
    "q8_0": (34, 2, -1, False, 0),
    "q4_0": (18, 2, -1, True, 8),
    "q4_1": (20, 4, 2, True, 0),
}


def _load_f16(builder, base, off):
    p = builder.bitcast(builder.gep(base, [off]), _I16.as_pointer())
    return builder.fpext(builder.bitcast(builder.load(p, align=1), ir.HalfType()), _F32)


def _block_quants_i16(builder, blk, layout):
    """<32 x i16> quants of the block starting at uint8* blk (offset already subtracted)."""
    _, q_off, _, nibbles, sub = layout
    v32i16 = ir.VectorType(_I16, 32)
    if nibbles:
        p = builder.bitcast(builder.gep(blk, [ir.Constant(_I32, q_off)]), ir.VectorType(_I8, 16).as_pointer())
        q = builder.zext(_nibbles32(builder, builder.load(p, align=1)), v32i16)
    else:
        p = builder.bitcast(builder.gep(blk, [ir.Constant(_I32, q_off)]), ir.VectorType(_I8, 32).as_pointer())
        q = builder.sext(builder.load(p, align=1), v32i16)
    if sub:
        q = builder.sub(q, _splat(_I16, 32, sub))
    return q


def _pmaddwd(builder, a, b):
    """<32 x i16> a, b -> <16 x i32> with lane i = a[2i] b[2i] + a[2i+1] b[2i+1]."""
    v32i32 = ir.VectorType(_I32, 32)
    prod = builder.mul(builder.sext(a, v32i32), builder.sext(b, v32i32), flags=["nsw"])
    even = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2))))
    odd = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2))))
    return builder.add(even, odd, flags=["nsw"])


def _fmuladd16(builder, a, b, c):
    v16f = ir.VectorType(_F32, 16)
    fnty = ir.FunctionType(v16f, [v16f, v16f, v16f])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fmuladd.v16f32")
    return builder.call(fn, [a, b, c])


def _accumulators(builder, tokens: int):
    """(accs, mins): per token, four rows' <16 x float> sums and scalar min terms, zeroed allocas."""
    v16f = ir.VectorType(_F32, 16)

    def zeroed(value):
        return [[cgutils.alloca_once_value(builder, value) for _ in range(4)] for _ in range(tokens)]

    return zeroed(ir.Constant(v16f, None)), zeroed(ir.Constant(_F32, 0.0))


def _dot_pointers(context, builder, signature, args):
    """Data pointers of a dot intrinsic's weight bytes (argument 0) and activation quants, scales and
    sums (arguments 6, 7, 8)."""
    return tuple(context.make_array(signature.args[i])(context, builder, args[i]).data for i in (0, 6, 7, 8))


def _reduce_add_f32x16(builder, vec):
    """Tree sum of a <16 x float> (halving shuffles: the order LLVM would pick with reassoc)."""
    n = 16
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        vec = builder.fadd(lo, hi)
    return builder.extract_element(vec, ir.Constant(_I32, 0))


# Decode weights stream from DRAM (the model is larger than the caches); one core alone keeps too few
# misses in flight, so each block loop asks for the same block PREFETCH_ROWS rows ahead itself:
# ~1.5x faster on SmolLM2's matrices. Into L2 (prefetcht1), not L1: on this AMD core prefetcht0
# streams held the Gemma-3 262144 x 640 Q8_0 output matrix at ~6 GB/s, prefetcht1 8 rows ahead
# reached 9-14 GB/s (1 thread; 4/16/32 rows ahead measured too: 8-32 alike, 4 worse).
PREFETCH_ROWS = 8


def _prefetch(builder, ptr):
    """Read prefetch of the cache line at ptr into L2 and below (llvm.prefetch, locality 2)."""
    fnty = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
    builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])


def _make_dot4(kind: str):
    layout = _DOT_LAYOUTS[kind]
    block_bytes, _, min_off, _, _ = layout

    @intrinsic
    def dot4(typingctx, raw, p0, p1, p2, p3, nb, xq, xd, xs):
        _check_c_array(raw, types.uint8, f"dot4_{kind} weights")
        _check_c_array(xq, types.int16, f"dot4_{kind} activations")
        _check_c_array(xd, types.float32, f"dot4_{kind} activation scales")
        _check_c_array(xs, types.float32, f"dot4_{kind} activation sums")
        sig = types.UniTuple(types.float32, 4)(
            raw, types.intp, types.intp, types.intp, types.intp, types.intp, xq, xd, xs
        )

        def codegen(context, builder, signature, args):
            _, *row_offs, nb_v = args[:6]
            base, xq_p, xd_p, xs_p = _dot_pointers(context, builder, signature, args)
            v16f = ir.VectorType(_F32, 16)
            intp = nb_v.type
            accs = [cgutils.alloca_once_value(builder, ir.Constant(v16f, None)) for _ in range(4)]
            mins = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(4)]
            rows = [builder.gep(base, [off]) for off in row_offs]
            # p1 - p0 is the row stride (0 in a clamped tail group: a harmless re-read of this row)
            pf_dist = builder.mul(builder.sub(row_offs[1], row_offs[0]), intp(PREFETCH_ROWS))
            with cgutils.for_range(builder, nb_v) as loop:
                b = loop.index
                xp = builder.bitcast(builder.gep(xq_p, [builder.mul(b, intp(32))]),
                                     ir.VectorType(_I16, 32).as_pointer())
                xv = builder.load(xp, align=2)
                dx = builder.load(builder.gep(xd_p, [b]))
                sx = builder.load(builder.gep(xs_p, [b])) if min_off >= 0 else None
                boff = builder.mul(b, intp(block_bytes))
                for row in rows:
                    _prefetch(builder, builder.gep(row, [builder.add(boff, pf_dist)]))
                for row, acc, mn in zip(rows, accs, mins):
                    blk = builder.gep(row, [boff])
                    q = _block_quants_i16(builder, blk, layout)
                    dots = builder.sitofp(_pmaddwd(builder, q, xv), v16f)
                    scale = builder.fmul(_load_f16(builder, blk, ir.Constant(_I32, 0)), dx)
                    builder.store(_fmuladd16(builder, dots, _broadcast_f32(builder, scale, 16),
                                             builder.load(acc)), acc)
                    if sx is not None:
                        m = _load_f16(builder, blk, ir.Constant(_I32, min_off))
                        builder.store(builder.fadd(builder.load(mn), builder.fmul(m, sx)), mn)
            sums = [builder.fadd(_reduce_add_f32x16(builder, builder.load(acc)), builder.load(mn))
                    for acc, mn in zip(accs, mins)]
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    dot4.__doc__ = (
        f"(float32 x4) dot products of four {kind.upper()} rows with int16-quantized activations.\n\n"
        "raw: uint8 weight bytes; p0..p3: byte offsets of the rows; nb: blocks per row;\n"
        "xq: int16 (nb*32,) activations; xd: float32 (nb,) block scales; xs: float32 (nb,) block sums\n"
        "of the float activations (used by Q4_1's min term; any array for the other types)."
    )
    return dot4


dot4_q8_0 = _make_dot4("q8_0")
dot4_q4_0 = _make_dot4("q4_0")
dot4_q4_1 = _make_dot4("q4_1")


# ---------------------------------------------------------------------------------------------
# Draft-only kernels with int8 activations over repacked weights (engine.backends.cpu.draft).
#
# A draft model need not be exact (the target verifies every token), but the closer it follows the
# target the more drafts are accepted. Its activations are quantized per block of 32 to two int8 levels
# (x ~= (254 hi + lo) dx: int16-grade, as fine as the exact path; one int8 level, ~4e-3, cost SmolLM2's
# Q4_1 draft a third of its accepted tokens), and its weights are repacked once, at
# load, for 16 rows at a time: per block of 32 columns, 32-bit lane r of a 64-byte vector holds four
# consecutive weights of row r as unsigned bytes. One vpdpbusd (AVX512-VNNI) with four activation
# bytes broadcast to every lane then adds four products to each of the 16 rows' int32 sums: 16 of them
# (8 per level) per block for 16 rows, against ~16 instructions per row and block in the one-row loop.
#   4-bit (Q4_0/Q4_1): 256 bytes per block; byte e of lane r of vector p in 0..3 holds row r's element
#       4p + e in its low nibble and element 16 + 4p + e in its high nibble.
#   8-bit (Q8_0): 512 bytes per block; vector j in 0..7 holds elements 4j..4j+3, as q + 128.
# Each block also has 32 float16 scales (as uint16 bits): 16 row scales d, then 16 row offsets c. A block adds
# d * dx * sum(u * (254 hi + lo)) + c * sx to a row: 4-bit c is Q4_1's min (Q4_0: -8 d) with sx the
# float sum of the block's activations; 8-bit c is -128 d with sx the sum of the quantized ones,
# taking the +128 back out.
# Without VNNI the same integer sums come from int16 widening and vpmaddwd.
# ---------------------------------------------------------------------------------------------


def _host_has_vnni() -> bool:
    from llvmlite import binding as llvm_binding

    try:
        feats = llvm_binding.get_host_cpu_features()
    except RuntimeError:  # features unknown (not x86): the portable integer path
        return False
    return bool(feats.get("avx512vnni")) and bool(feats.get("avx512bw"))


HAS_VNNI = _host_has_vnni()
_V64I8 = ir.VectorType(_I8, 64)
_V16I32 = ir.VectorType(_I32, 16)


def _dpbusd16(builder, acc, w, x):
    """acc <16 x i32> + lane-wise sums of four products of unsigned w and signed x (<64 x i8> each)."""
    if HAS_VNNI:
        fnty = ir.FunctionType(_V16I32, [_V16I32, _V64I8, _V64I8])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, [acc, w, x])
    v64i32 = ir.VectorType(_I32, 64)
    prod = builder.mul(builder.zext(w, v64i32), builder.sext(x, v64i32), flags=["nsw"])
    for n in (32, 16):  # pairwise sums twice: 64 products -> 16 lanes of four
        ev = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, n), list(range(0, 2 * n, 2))))
        od = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, n), list(range(1, 2 * n, 2))))
        prod = builder.add(ev, od, flags=["nsw"])
    return builder.add(acc, prod)


def _bcast_dword(builder, ptr):
    """<64 x i8>: the four bytes at ptr repeated in every 32-bit lane."""
    word = builder.load(builder.bitcast(ptr, _I32.as_pointer()), align=1)
    undef = ir.Constant(_V16I32, ir.Undefined)
    one = builder.insert_element(undef, word, ir.Constant(_I32, 0))
    return builder.bitcast(builder.shuffle_vector(one, undef, ir.Constant(_V16I32, [0] * 16)), _V64I8)


def _widen_f16x16(builder, ptr):
    """<16 x float> of the 16 IEEE halves at i16* ptr (vcvtph2ps)."""
    h = builder.load(builder.bitcast(ptr, ir.VectorType(_I16, 16).as_pointer()), align=2)
    return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 16)), ir.VectorType(_F32, 16))


def _make_dot16(bits: int):
    n_vec = 4 if bits == 4 else 8
    block_bytes = 64 * n_vec

    @intrinsic
    def dot16(typingctx, out, oo, w, wo, sc, so, nb, xq, xd, xs):
        _check_c_array(out, types.float32, f"dot16_q{bits} output")
        _check_c_array(w, types.uint8, f"dot16_q{bits} weights")
        _check_c_array(sc, types.uint16, f"dot16_q{bits} scales")
        _check_c_array(xq, types.int8, f"dot16_q{bits} activations")
        _check_c_array(xd, types.float32, f"dot16_q{bits} activation scales")
        _check_c_array(xs, types.float32, f"dot16_q{bits} activation sums")
        sig = types.void(out, types.intp, w, types.intp, sc, types.intp, types.intp, xq, xd, xs)

        def codegen(context, builder, signature, args):
            out_v, oo_v, w_v, wo_v, sc_v, so_v, nb_v, xq_v, xd_v, xs_v = args
            arrtys = signature.args

            def data(i, v):
                return context.make_array(arrtys[i])(context, builder, v).data

            wp = builder.gep(data(2, w_v), [wo_v])
            sp = builder.gep(data(4, sc_v), [so_v])
            xq_p, xd_p, xs_p = data(7, xq_v), data(8, xd_v), data(9, xs_v)
            v16f = ir.VectorType(_F32, 16)
            intp = nb_v.type
            acc = cgutils.alloca_once_value(builder, ir.Constant(v16f, None))
            with cgutils.for_range(builder, nb_v) as loop:
                b = loop.index
                blk = builder.gep(wp, [builder.mul(b, intp(block_bytes))])
                xb = builder.gep(xq_p, [builder.mul(b, intp(64))])
                _prefetch(builder, builder.gep(blk, [intp(4 * block_bytes)]))
                # int32 sums of the coarse (hi) and fine (lo) activation bytes, two chains of each
                hi_s = [ir.Constant(_V16I32, None), ir.Constant(_V16I32, None)]
                lo_s = [ir.Constant(_V16I32, None), ir.Constant(_V16I32, None)]

                def add(chain, wv, elem):
                    xh = _bcast_dword(builder, builder.gep(xb, [intp(elem)]))
                    xl = _bcast_dword(builder, builder.gep(xb, [intp(32 + elem)]))
                    hi_s[chain] = _dpbusd16(builder, hi_s[chain], wv, xh)
                    lo_s[chain] = _dpbusd16(builder, lo_s[chain], wv, xl)

                for p in range(n_vec):
                    vp = builder.bitcast(builder.gep(blk, [intp(64 * p)]), _V64I8.as_pointer())
                    packed = builder.load(vp, align=1)
                    if bits == 4:
                        add(0, builder.and_(packed, _splat(_I8, 64, 15)), 4 * p)
                        add(1, builder.lshr(packed, _splat(_I8, 64, 4)), 16 + 4 * p)
                    else:
                        add(p % 2, packed, 4 * p)
                coarse = builder.sitofp(builder.add(hi_s[0], hi_s[1]), v16f)
                fine = builder.sitofp(builder.add(lo_s[0], lo_s[1]), v16f)
                k254 = _broadcast_f32(builder, ir.Constant(_F32, 254.0), 16)
                total = _fmuladd16(builder, coarse, k254, fine)
                sb = builder.gep(sp, [builder.mul(b, intp(32))])
                dvec = _widen_f16x16(builder, sb)
                cvec = _widen_f16x16(builder, builder.gep(sb, [intp(16)]))
                dx = _broadcast_f32(builder, builder.load(builder.gep(xd_p, [b])), 16)
                sx = _broadcast_f32(builder, builder.load(builder.gep(xs_p, [b])), 16)
                a = _fmuladd16(builder, total, builder.fmul(dvec, dx), builder.load(acc))
                builder.store(_fmuladd16(builder, cvec, sx, a), acc)
            op = builder.bitcast(builder.gep(data(0, out_v), [oo_v]), v16f.as_pointer())
            builder.store(builder.load(acc), op, align=4)
            return context.get_dummy_value()

        return sig, codegen

    dot16.__doc__ = (
        f"out[oo:oo+16] = approximate dot products of 16 repacked {bits}-bit rows with int8 activations.\n\n"
        "w: uint8 repacked weights, the rows' first block at byte wo; sc: float16 scales as uint16,\n"
        "the first block's at so; nb: blocks per row; xq: int8 (nb*64,) activations (per block 32 hi, 32 lo\n"
        "bytes); xd: float32 (nb,) fine scales; xs: float32 (nb,) block sums (4-bit: of the float\n"
        "activations, 8-bit: of the quantized ones)."
    )
    return dot16


dot16_q4 = _make_dot16(4)
dot16_q8 = _make_dot16(8)
