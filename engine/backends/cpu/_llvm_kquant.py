"""LLVM-level block decoders for Q5_0, Q5_1, the K-quants (Q2_K..Q6_K), IQ4_NL/IQ4_XS and MXFP4.

Every type is described by one function, `sub(builder, blk, s)`, that emits the IR decoding
sub-block s (32 elements) of the block at uint8* blk into

    q     <32 x i16>  the integer quants in element order,
    scale float32, or a (first 16, last 16) pair for types with a scale per 16 elements, or an i32 E8M0
          exponent e for the scale 2^(e-128) (MXFP4),
    minc  None, or the additive constant per element (same shape rules as scale, float32 only),

so that element i of the sub-block is `scale * q[i] + minc`. From that one description this module
builds two Numba intrinsics per type:

  dot4_<type>(raw, p0, p1, p2, p3, n_blocks, xq, xd, xs) -> 4 x float32
      decode dot products of four rows with int16-quantized activations (the scheme of _llvm.dot4_*:
      vpmaddwd per 32 elements, one FMA per sub-block into a float vector, scale applied per
      sub-block, mins through the activation block sums);
  deq_<type>(out, oo, raw, off)
      out[oo : oo + block elements] = the block at byte `off`, float32, bit-identical to
      gguf.quants.dequantize (same float operations in the same order).

Block layouts (bytes; little-endian; gguf.quants is the executable spec):
  Q5_0   22 = f16 d | u32 qh | 16 qs           q = (nibble | bit<<4) - 16; value d*q
  Q5_1   24 = f16 d | f16 m | u32 qh | 16 qs   value d*q + m  (nibble: as Q4_0; bit i of qh -> element i)
  Q2_K   84 = 16 scales | 64 qs | f16 d | f16 dmin; per 16: d*(sc&15)*q - dmin*(sc>>4), q 2-bit
  Q3_K  110 = 32 hmask | 64 qs | 12 scales (6-bit, -32) | f16 d; q = 2-bit - 4*(1 - hmask bit)
  Q4_K  144 = f16 d | f16 dmin | 12 scales (6-bit scale+min per 32) | 128 qs; d*sc*q - dmin*m
  Q5_K  176 = as Q4_K with 32 qh bytes before qs (bit s of qh[l] = 5th bit of sub-block s, element l)
  Q6_K  210 = 128 ql | 64 qh | 16 int8 scales | f16 d; q = (4 low | 2 high << 4) - 32, scale per 16
  IQ4_NL 18 = f16 d | 16 qs; value d * KVALUES[nibble]
  IQ4_XS 136 = f16 d | u16 scales_h | 4 scales_l | 128 qs; per 32: d*(6-bit scale - 32)*KVALUES[nibble]
  MXFP4  17 = u8 e (E8M0) | 16 qs; value 2^(e-128) * MXFP4_VALUES[nibble]  (nibbles: as IQ4_NL)
In the 256-element K-quants, sub-block s = 4h + t of a 2-bit-per-byte array reads bytes
[32h, 32h + 32) shifted by 2t; of a nibble array (Q4_K/Q5_K), bytes [32(s//2), +32) shifted by 4(s%2).
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.backends.cpu._llvm import (
    _F32,
    _I8,
    _I16,
    _I32,
    PREFETCH_ROWS,
    _accumulators,
    _broadcast_f32,
    _check_c_array,
    _dot_pointers,
    _fmuladd16,
    _load_f16,
    _pmaddwd,
    _prefetch,
    _ptr,
    _reduce_add_f32x16,
    _splat,
)

# IQ4_NL / IQ4_XS non-linear 4-bit codebook (gguf.quants.IQ4_NL.kvalues)
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4's E2M1 values doubled, so they are integers (gguf.quants.MXFP4.kvalues); the scale halves them back
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

_V32I8 = ir.VectorType(_I8, 32)
_V16I8 = ir.VectorType(_I8, 16)
_V32I16 = ir.VectorType(_I16, 32)
_X86 = llvm_binding.get_process_triple().startswith(("x86_64", "i686", "i386"))


# ---------------------------------------------------------------------------------------------
# Small IR pieces
# ---------------------------------------------------------------------------------------------


def _c(v: int) -> ir.Constant:
    return ir.Constant(_I32, v)


def _byte(builder, blk, off: int):
    """i32 zero-extension of the byte at blk + off."""
    return builder.zext(builder.load(builder.gep(blk, [_c(off)])), _I32)


def _f16(builder, blk, off: int):
    return _load_f16(builder, blk, _c(off))


def _vload(builder, blk, off: int, vty: ir.VectorType):
    return builder.load(builder.bitcast(builder.gep(blk, [_c(off)]), vty.as_pointer()), align=1)


def _bits32(builder, blk, off: int, shift: int, mask: int):
    """<32 x i8> (blk[off + l] >> shift) & mask for l in 0..31."""
    v = _vload(builder, blk, off, _V32I8)
    if shift:
        v = builder.lshr(v, _splat(_I8, 32, shift))
    return builder.and_(v, _splat(_I8, 32, mask))


def _nibbles(builder, blk, off: int):
    """(<16 x i8> low nibbles, <16 x i8> high nibbles) of the 16 bytes at blk + off."""
    packed = _vload(builder, blk, off, _V16I8)
    return builder.and_(packed, _splat(_I8, 16, 15)), builder.lshr(packed, _splat(_I8, 16, 4))


def _concat16(builder, lo, hi):
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


def _high_bits32(builder, blk, off: int):
    """<32 x i8> bit i of the little-endian u32 at blk + off, shifted to 16 (the 5th quant bit)."""
    word = builder.load(builder.bitcast(builder.gep(blk, [_c(off)]), _I32.as_pointer()), align=1)
    bits = builder.zext(builder.bitcast(word, ir.VectorType(ir.IntType(1), 32)), _V32I8)
    return builder.shl(bits, _splat(_I8, 32, 4))


def _lookup16(builder, table: tuple[int, ...], idx):
    """<16 x i8> table[idx] for a 16-entry int8 table and <16 x i8> indices in 0..15."""
    tab = ir.Constant(_V16I8, [ir.Constant(_I8, v & 0xFF) for v in table])
    if _X86:  # SSSE3 pshufb: one instruction per 16 lookups
        fnty = ir.FunctionType(_V16I8, [_V16I8, _V16I8])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.ssse3.pshuf.b.128")
        return builder.call(fn, [tab, idx])
    out = ir.Constant(_V16I8, ir.Undefined)
    for i in range(16):
        val = builder.extract_element(tab, builder.extract_element(idx, _c(i)))
        out = builder.insert_element(out, val, _c(i))
    return out


def _scale6_q4k(builder, blk, j: int):
    """(scale, min) 6-bit pair j (0..7) of the 12 packed bytes at blk + 4 (Q4_K/Q5_K)."""
    if j < 4:
        return (builder.and_(_byte(builder, blk, 4 + j), _c(63)),
                builder.and_(_byte(builder, blk, 8 + j), _c(63)))
    lo = _byte(builder, blk, 8 + j)

    def top2(off):  # the two high bits of byte blk[off], as bits 4..5
        return builder.shl(builder.lshr(_byte(builder, blk, off), _c(6)), _c(4))

    sc = builder.or_(builder.and_(lo, _c(15)), top2(j))
    mn = builder.or_(builder.lshr(lo, _c(4)), top2(4 + j))
    return sc, mn


def _scale6_q3k(builder, blk, i: int):
    """Signed 6-bit scale i (0..15) of Q3_K's 12 packed bytes at blk + 96, as float32."""
    low = builder.and_(builder.lshr(_byte(builder, blk, 96 + i % 8), _c(4 * (i // 8))), _c(15))
    high = builder.and_(builder.lshr(_byte(builder, blk, 104 + i % 4), _c(2 * (i // 4))), _c(3))
    return builder.sitofp(builder.sub(builder.or_(low, builder.shl(high, _c(4))), _c(32)), _F32)


def _u2f(builder, v):
    return builder.uitofp(v, _F32)


# ---------------------------------------------------------------------------------------------
# Per-type sub-block decoders: (q <32 x i16>, scale, minc); see the module docstring.
# ---------------------------------------------------------------------------------------------


def _sub_q5_0(builder, blk, s):
    lo, hi = _nibbles(builder, blk, 6)
    q = builder.or_(_concat16(builder, lo, hi), _high_bits32(builder, blk, 2))
    return builder.sub(builder.zext(q, _V32I16), _splat(_I16, 32, 16)), _f16(builder, blk, 0), None


def _sub_q5_1(builder, blk, s):
    lo, hi = _nibbles(builder, blk, 8)
    q = builder.or_(_concat16(builder, lo, hi), _high_bits32(builder, blk, 4))
    return builder.zext(q, _V32I16), _f16(builder, blk, 0), _f16(builder, blk, 2)


def _sub_q2_k(builder, blk, s):
    q = builder.zext(_bits32(builder, blk, 16 + 32 * (s // 4), 2 * (s % 4), 3), _V32I16)
    d, dmin = _f16(builder, blk, 80), _f16(builder, blk, 82)
    sc = [_byte(builder, blk, 2 * s + k) for k in (0, 1)]
    scale = tuple(builder.fmul(d, _u2f(builder, builder.and_(v, _c(15)))) for v in sc)
    minc = tuple(builder.fneg(builder.fmul(dmin, _u2f(builder, builder.lshr(v, _c(4))))) for v in sc)
    return q, scale, minc


def _sub_q3_k(builder, blk, s):
    low = _bits32(builder, blk, 32 + 32 * (s // 4), 2 * (s % 4), 3)
    high = builder.shl(_bits32(builder, blk, 0, s, 1), _splat(_I8, 32, 2))
    q = builder.sub(builder.zext(builder.or_(low, high), _V32I16), _splat(_I16, 32, 4))
    d = _f16(builder, blk, 108)
    return q, tuple(builder.fmul(d, _scale6_q3k(builder, blk, 2 * s + k)) for k in (0, 1)), None


def _sub_q4_k(builder, blk, s):
    q = builder.zext(_bits32(builder, blk, 16 + 32 * (s // 2), 4 * (s % 2), 15), _V32I16)
    return (q, *_k_scale_min(builder, blk, s))


def _sub_q5_k(builder, blk, s):
    low = _bits32(builder, blk, 48 + 32 * (s // 2), 4 * (s % 2), 15)
    high = builder.shl(_bits32(builder, blk, 16, s, 1), _splat(_I8, 32, 4))
    return (builder.zext(builder.or_(low, high), _V32I16), *_k_scale_min(builder, blk, s))


def _k_scale_min(builder, blk, s):
    sc, mn = _scale6_q4k(builder, blk, s)
    scale = builder.fmul(_f16(builder, blk, 0), _u2f(builder, sc))
    return scale, builder.fneg(builder.fmul(_f16(builder, blk, 2), _u2f(builder, mn)))


def _sub_q6_k(builder, blk, s):
    h, t = divmod(s, 4)
    low = _bits32(builder, blk, 64 * h + 32 * (t % 2), 4 * (t // 2), 15)
    high = builder.shl(_bits32(builder, blk, 128 + 32 * h, 2 * t, 3), _splat(_I8, 32, 4))
    q = builder.sub(builder.zext(builder.or_(low, high), _V32I16), _splat(_I16, 32, 32))
    d = _f16(builder, blk, 208)
    sc = [builder.sitofp(builder.load(builder.gep(blk, [_c(192 + 2 * s + k)])), _F32) for k in (0, 1)]
    return q, tuple(builder.fmul(d, v) for v in sc), None


def _iq4_quants(builder, blk, off: int, table: tuple[int, ...] = KVALUES):
    lo, hi = _nibbles(builder, blk, off)
    q = _concat16(builder, _lookup16(builder, table, lo), _lookup16(builder, table, hi))
    return builder.sext(q, _V32I16)


def _sub_iq4_nl(builder, blk, s):
    return _iq4_quants(builder, blk, 2), _f16(builder, blk, 0), None


def _sub_iq4_xs(builder, blk, s):
    low = builder.and_(builder.lshr(_byte(builder, blk, 4 + s // 2), _c(4 * (s % 2))), _c(15))
    hword = builder.zext(builder.load(builder.bitcast(builder.gep(blk, [_c(2)]), _I16.as_pointer()), align=1),
                         _I32)
    high = builder.and_(builder.lshr(hword, _c(2 * s)), _c(3))
    ls = builder.sitofp(builder.sub(builder.or_(low, builder.shl(high, _c(4))), _c(32)), _F32)
    return _iq4_quants(builder, blk, 8 + 16 * s), builder.fmul(_f16(builder, blk, 0), ls), None


def _sub_mxfp4(builder, blk, s):
    return _iq4_quants(builder, blk, 1, MXFP4_VALUES), _byte(builder, blk, 0), None


def _is_exponent(scale) -> bool:
    """Whether a decoder's scale is an E8M0 exponent (i32) rather than float32."""
    return not isinstance(scale, tuple) and scale.type == _I32


def _e8m0_half(builder, e):
    """float32 2^(e-128) of an i32 E8M0 exponent e, exactly (ggml_e8m0_to_fp32_half): the bits (e-1) << 23
    for e >= 2, the denormals 0x00200000 << e (2^-128, 2^-127) for e = 0, 1.

    The kernels' fastmath sets LLVM's fast-math flags, which do not flush denormals (that is the MXCSR's
    FTZ/DAZ, which stay off), so deq_<type> multiplies by these scales exactly, as gguf does.
    """
    bits = builder.select(builder.icmp_unsigned("<", e, _c(2)),
                          builder.shl(_c(0x00200000), e), builder.shl(builder.sub(e, _c(1)), _c(23)))
    return builder.bitcast(bits, _F32)


def _exp2_times(builder, e, dx):
    """float32 2^(e-128) * dx for dot4, formed on the bits of dx (an activation block's max|x| / 32767):
    the product's bits wherever it is a normal float, 2^-126 (the smallest normal) where it would be less.

    Fewer instructions than decoding the scale and multiplying, and never a denormal: ggml writes all-zero
    blocks with e = 0 (scale 2^-128), and a denormal operand costs a multiply a microcode assist (a
    2880 x 2880 matvec with one such block in eight took 0.85 ms instead of 0.18). What the floor adds to
    a block's sum is under 2^-100; a denormal dx (activations all below 2^-111) is off by under 2^(e-230):
    both nothing next to any block of a real weight's exponents.
    """
    bits = builder.add(builder.shl(e, _c(23)), builder.bitcast(dx, _I32))
    floor = _c(129 << 23)
    bits = builder.select(builder.icmp_unsigned(">", bits, floor), bits, floor)
    return builder.bitcast(builder.sub(bits, _c(128 << 23)), _F32)


# ggml type name -> (bytes per block, 32-element sub-blocks per block, sub-block decoder)
LAYOUTS = {
    "q5_0": (22, 1, _sub_q5_0),
    "q5_1": (24, 1, _sub_q5_1),
    "q2_k": (84, 8, _sub_q2_k),
    "q3_k": (110, 8, _sub_q3_k),
    "q4_k": (144, 8, _sub_q4_k),
    "q5_k": (176, 8, _sub_q5_k),
    "q6_k": (210, 8, _sub_q6_k),
    "iq4_nl": (18, 1, _sub_iq4_nl),
    "iq4_xs": (136, 8, _sub_iq4_xs),
    "mxfp4": (17, 1, _sub_mxfp4),
}


# ---------------------------------------------------------------------------------------------
# Intrinsic factories
# ---------------------------------------------------------------------------------------------


def _fence(builder, value):
    """value behind llvm.arithmetic.fence: fast-math may not regroup arithmetic across it. A scalar
    sub-block scale (Q4_K's d * sc) times the activation scale dx was otherwise regrouped (as d * (sc *
    dx), or sharing d * dx between sub-blocks) one way in dot4 and another in dot4x4: Q4_K, Q5_K and
    IQ4_XS sums differed in the last bits between a token alone and the same token in a batch."""
    fnty = ir.FunctionType(_F32, [_F32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.arithmetic.fence.f32")
    return builder.call(fn, [value])


def _vec(builder, value, n: int):
    """<n x float> of a scalar (all lanes) or a (first half, second half) pair."""
    if not isinstance(value, tuple):
        return _broadcast_f32(builder, value, n)
    pair = builder.insert_element(ir.Constant(ir.VectorType(_F32, 2), ir.Undefined), value[0], _c(0))
    pair = builder.insert_element(pair, value[1], _c(1))
    mask = [0] * (n // 2) + [1] * (n // 2)
    return builder.shuffle_vector(pair, pair, ir.Constant(ir.VectorType(_I32, n), mask))


def _make_dot4(kind: str, tokens: int = 1):
    """dot4_<kind> (tokens 1) or dot4x4_<kind> (tokens 4: each sub-block of the four rows decoded once for
    four tokens, as batchq does for Q8_0/Q4_0/Q4_1). Every (row, token) sum sees the same operations in
    the same order either way, so a token gets the same bits alone or in a group."""
    block_bytes, subs, sub = LAYOUTS[kind]
    n_lines = (block_bytes + 63) // 64
    name = f"dot4_{kind}" if tokens == 1 else f"dot4x{tokens}_{kind}"

    def codegen(context, builder, signature, args):
        _, *row_offs, nb_v = args[:6]
        base, xq_p, xd_p, xs_p = _dot_pointers(context, builder, signature, args)
        v16f = ir.VectorType(_F32, 16)
        intp = nb_v.type
        per_row = builder.mul(nb_v, intp(subs))  # 32-element sub-blocks a row
        # token t's activations: row t0 + t of the (n, cols) / (n, cols / 32) arrays (one token: row 0)
        first = args[9] if tokens > 1 else intp(0)
        tok = [builder.mul(builder.add(first, intp(t)), per_row) for t in range(tokens)]
        accs, mins = _accumulators(builder, tokens)
        rows = [builder.gep(base, [off]) for off in row_offs]
        # p1 - p0 is the row stride (0 in a clamped tail group: a harmless re-read of this row)
        pf_dist = builder.mul(builder.sub(row_offs[1], row_offs[0]), intp(PREFETCH_ROWS))
        with cgutils.for_range(builder, nb_v) as loop:
            b = loop.index
            boff = builder.mul(b, intp(block_bytes))
            for row in rows:
                for line in range(n_lines):
                    ahead = builder.add(builder.add(boff, pf_dist), intp(64 * line))
                    _prefetch(builder, builder.gep(row, [ahead]))
            for s in range(subs):
                ks = [builder.add(t0, builder.add(builder.mul(b, intp(subs)), intp(s))) for t0 in tok]
                xvs = [builder.load(builder.bitcast(builder.gep(xq_p, [builder.mul(k, intp(32))]),
                                                    _V32I16.as_pointer()), align=2) for k in ks]
                dxs = [builder.load(builder.gep(xd_p, [k])) for k in ks]
                sxs = [builder.load(builder.gep(xs_p, [k])) for k in ks]
                xsums = [None] * tokens  # per-pair sums of the int16 activations, for mins per 16 elements
                for r, row in enumerate(rows):
                    q, scale, minc = sub(builder, builder.gep(row, [boff]), s)
                    if not isinstance(scale, tuple) and not _is_exponent(scale):
                        scale = _fence(builder, scale)
                    if minc is not None and not isinstance(minc, tuple):
                        minc = _fence(builder, minc)
                    for t in range(tokens):
                        xv, dx, acc, mn = xvs[t], dxs[t], accs[t][r], mins[t][r]
                        dots = builder.sitofp(_pmaddwd(builder, q, xv), v16f)
                        if _is_exponent(scale):
                            scl = _broadcast_f32(builder, _exp2_times(builder, scale, dx), 16)
                        else:
                            scl = builder.fmul(_vec(builder, scale, 16), _broadcast_f32(builder, dx, 16))
                        a = _fmuladd16(builder, dots, scl, builder.load(acc))
                        if isinstance(minc, tuple):
                            if xsums[t] is None:
                                xsums[t] = builder.sitofp(_pmaddwd(builder, xv, _splat(_I16, 32, 1)), v16f)
                            mv = builder.fmul(_vec(builder, minc, 16), _broadcast_f32(builder, dx, 16))
                            a = _fmuladd16(builder, xsums[t], mv, a)
                        elif minc is not None:
                            builder.store(builder.fadd(builder.load(mn), builder.fmul(minc, sxs[t])), mn)
                        builder.store(a, acc)
        sums = [builder.fadd(_reduce_add_f32x16(builder, builder.load(accs[t][r])), builder.load(mins[t][r]))
                for t in range(tokens) for r in range(4)]
        return context.make_tuple(builder, signature.return_type, sums)

    def check(raw, xq, xd, xs):
        _check_c_array(raw, types.uint8, f"{name} weights")
        _check_c_array(xq, types.int16, f"{name} activations")
        _check_c_array(xd, types.float32, f"{name} activation scales")
        _check_c_array(xs, types.float32, f"{name} activation sums")

    if tokens == 1:

        @intrinsic
        def dot(typingctx, raw, p0, p1, p2, p3, nb, xq, xd, xs):
            check(raw, xq, xd, xs)
            ip = types.intp
            return types.UniTuple(types.float32, 4)(raw, ip, ip, ip, ip, ip, xq, xd, xs), codegen

        dot.__doc__ = (
            f"(float32 x4) dot products of four {kind.upper()} rows with int16-quantized activations.\n\n"
            "raw: uint8 weight bytes; p0..p3: byte offsets of the rows; nb: blocks per row;\n"
            "xq: int16 (nb*block elements,) activations; xd, xs: float32 scale and float sum of x per 32."
        )
    else:

        @intrinsic
        def dot(typingctx, raw, p0, p1, p2, p3, nb, xq, xd, xs, t0):
            check(raw, xq, xd, xs)
            ip = types.intp
            return types.UniTuple(types.float32, 4 * tokens)(raw, ip, ip, ip, ip, ip, xq, xd, xs, ip), codegen

        dot.__doc__ = (
            f"(float32 x{4 * tokens}) dot products of four {kind.upper()} rows with tokens t0..t0+"
            f"{tokens - 1}, [token][row] order; xq (n, cols), xd, xs (n, cols/32) hold all the tokens."
        )
    return dot


def _make_deq(kind: str):
    _, subs, sub = LAYOUTS[kind]

    @intrinsic
    def deq(typingctx, out, oo, w, wo):
        _check_c_array(out, types.float32, f"deq_{kind} output")
        _check_c_array(w, types.uint8, f"deq_{kind} weights")
        sig = types.void(out, types.intp, w, types.intp)

        def codegen(context, builder, signature, args):
            v32f = ir.VectorType(_F32, 32)
            blk = _ptr(context, builder, signature.args[2], args[2], args[3], _I8)
            for s in range(subs):
                q, scale, minc = sub(builder, blk, s)
                if _is_exponent(scale):
                    scale = _e8m0_half(builder, scale)
                vals = builder.fmul(builder.sitofp(q, v32f), _vec(builder, scale, 32))
                if minc is not None:
                    vals = builder.fadd(vals, _vec(builder, minc, 32))
                dst = builder.add(args[1], ir.Constant(args[1].type, 32 * s))
                builder.store(vals, _ptr(context, builder, signature.args[0], args[0], dst, v32f), align=4)
            return context.get_dummy_value()

        return sig, codegen

    deq.__doc__ = f"out[oo : oo + {32 * subs}] = the {kind.upper()} block at byte wo of w, as float32."
    return deq


dot4_q5_0, deq_q5_0 = _make_dot4("q5_0"), _make_deq("q5_0")
dot4_q5_1, deq_q5_1 = _make_dot4("q5_1"), _make_deq("q5_1")
dot4_q2_k, deq_q2_k = _make_dot4("q2_k"), _make_deq("q2_k")
dot4_q3_k, deq_q3_k = _make_dot4("q3_k"), _make_deq("q3_k")
dot4_q4_k, deq_q4_k = _make_dot4("q4_k"), _make_deq("q4_k")
dot4_q5_k, deq_q5_k = _make_dot4("q5_k"), _make_deq("q5_k")
dot4_q6_k, deq_q6_k = _make_dot4("q6_k"), _make_deq("q6_k")
dot4_iq4_nl, deq_iq4_nl = _make_dot4("iq4_nl"), _make_deq("iq4_nl")
dot4_iq4_xs, deq_iq4_xs = _make_dot4("iq4_xs"), _make_deq("iq4_xs")
dot4_mxfp4, deq_mxfp4 = _make_dot4("mxfp4"), _make_deq("mxfp4")

# four tokens a pass, for smalln's small batches
dot4x4_q5_0, dot4x4_q5_1 = _make_dot4("q5_0", 4), _make_dot4("q5_1", 4)
dot4x4_iq4_nl, dot4x4_mxfp4 = _make_dot4("iq4_nl", 4), _make_dot4("mxfp4", 4)
dot4x4_q2_k, dot4x4_q3_k, dot4x4_q6_k = _make_dot4("q2_k", 4), _make_dot4("q3_k", 4), _make_dot4("q6_k", 4)
dot4x4_q4_k, dot4x4_q5_k = _make_dot4("q4_k", 4), _make_dot4("q5_k", 4)
dot4x4_iq4_xs = _make_dot4("iq4_xs", 4)
