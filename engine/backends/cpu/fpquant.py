"""CPU kernels for the safetensors float formats: FP8 (E4M3, per-row scale) and NVFP4 (E2M1 + E4M3 per 16).

Both are computed directly on the stored codes; nothing is dequantized at load.
  FP8_E4M3: raw (rows, cols) uint8 E4M3 codes, Weight.scales float32 (rows,);
            w[r, c] = E4M3[raw[r, c]] * scales[r]
  FP8_E4M3_BLOCK (block-wise FP8, DeepSeek / Qwen "fp8" checkpoints): raw as FP8_E4M3, Weight.scales
            float32 (rows, ceil(cols/128)): a scale per row and 128 columns (the checkpoint's scale per
            128 x 128 block, repeated for its rows at load); w[r, c] = E4M3[raw[r, c]] * scales[r, c // 128]
  NVFP4:    raw (rows, cols/2) uint8, element 2i in the low nibble of byte i, 2i+1 in the high one;
            Weight.scales (rows, cols/16) uint8 E4M3 codes, Weight.global_scale float;
            w[r, c] = E2M1[nibble(r, c)] * E4M3[scales[r, c // 16]] * global_scale
Codes are widened to float by bit moves (see below); the reference decoders of engine/quant/fp8.py and
nvfp4.py (value tables) are the oracle these kernels are tested against.

Three kernels per format, float32 accumulation, four rows per pass sharing every activation load:
`matvec_*` (decode: out (rows,) = W @ x, codes widened in registers), `matmul_*` (2..SMALL_BATCH_MAX
tokens) and `dequant_*` (rows to float32, for prefill tiles and embeddings). FP8 (both layouts) runs the
float types' loop (smalln._matmul_float) for one token and for a few, so each token gets its matvec's
bits; NVFP4's matmul widens four rows once into a float tile reused for every token, which agrees with
its matvec to float32 rounding.
"""

from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from engine.backends.cpu.quant import _store4
from engine.backends.cpu.smalln import COL_BLOCK, _matmul_float
from engine.weights import Weight

# Weight.ggml_type ids of the formats that only live in safetensors (above every ggml type id)
FP8_E4M3 = 1001
NVFP4 = 1002
FP8_E4M3_BLOCK = 1003
FP_TYPES = frozenset({FP8_E4M3, NVFP4, FP8_E4M3_BLOCK})
TYPE_NAMES = {FP8_E4M3: "FP8_E4M3", NVFP4: "NVFP4", FP8_E4M3_BLOCK: "FP8_E4M3_BLOCK"}
NVFP4_BLOCK = 16
FP8_COL_BLOCK = COL_BLOCK  # FP8_E4M3_BLOCK: columns a scale covers

# prefill: rows are dequantized to float32 in tiles of at most this many bytes, then BLAS
_TILE_BYTES = 16 << 20


def _e4m3_lut() -> np.ndarray:
    out = np.empty(256, np.float32)
    for c in range(256):
        e, m = (c >> 3) & 0xF, c & 0x7
        v = m / 512.0 if e == 0 else (8 + m) * 2.0 ** (e - 10)
        out[c] = np.nan if (c & 0x7F) == 0x7F else (-v if c & 0x80 else v)
    return out


# code -> value tables (tests and tools; the kernels decode by bit moves, below)
E4M3_LUT = _e4m3_lut()
E2M1_LUT = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)

# The kernels widen codes to IEEE halves by moving bits, then to float32 (vcvtph2ps), which LLVM
# vectorizes (a 256-entry table lookup is a gather: measured ~4x slower). Exponent and mantissa land
# in the half's fields unchanged, so the half's larger bias leaves a constant factor, folded into the
# row / global scale; subnormal codes become half subnormals, exact. The NaN codes of E4M3
# (0x7F/0xFF) are no weights: the kernels read them as +-480.
#   E4M3 s eeee mmm -> half s 0eeee mmm0000000: value / 2**8
#   E2M1 s ee m     -> half s 000ee m000000000: value / 2**14
E4M3_HALF_FACTOR = np.float32(256.0)
E2M1_HALF_FACTOR = np.float32(16384.0)
_I8, _I16, _F32 = ir.IntType(8), ir.IntType(16), ir.FloatType()


def _byte(context, builder, arrty, arr, off):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.zext(builder.load(builder.gep(data, [off]), align=1), _I16)


def _half_to_f32(builder, bits):
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32)


def _u8_array(arr, what):
    if not (isinstance(arr, types.Array) and arr.layout == "C" and arr.dtype == types.uint8):
        raise TypingError(f"{what} must be a C-contiguous uint8 array, got {arr}")


@intrinsic
def ld_e4m3(typingctx, arr, off):
    """E4M3 value / 256 of byte `off` (flat) of a uint8 array, as float32."""
    _u8_array(arr, "ld_e4m3 array")
    sig = types.float32(arr, types.intp)

    def codegen(context, builder, signature, args):
        u = _byte(context, builder, signature.args[0], args[0], args[1])
        c = lambda v: ir.Constant(_I16, v)  # noqa: E731
        bits = builder.or_(builder.and_(builder.shl(u, c(8)), c(0x8000)),
                           builder.and_(builder.shl(u, c(7)), c(0x3F80)))
        return _half_to_f32(builder, bits)

    return sig, codegen


@intrinsic
def ld_e2m1(typingctx, arr, off, high):
    """E2M1 value / 16384 of the low (high=0) or high (high=4) nibble of byte `off` (flat), as float32."""
    _u8_array(arr, "ld_e2m1 array")
    sig = types.float32(arr, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        u = _byte(context, builder, signature.args[0], args[0], args[1])
        u = builder.lshr(u, builder.trunc(args[2], _I16))
        c = lambda v: ir.Constant(_I16, v)  # noqa: E731
        bits = builder.or_(builder.and_(builder.shl(u, c(12)), c(0x8000)),
                           builder.and_(builder.shl(u, c(9)), c(0x0E00)))
        return _half_to_f32(builder, bits)

    return sig, codegen


_KW = dict(nogil=True, cache=True, fastmath=True)


def block_scales_per_row(blocks: np.ndarray, rows: int) -> np.ndarray:
    """FP8_E4M3_BLOCK's Weight.scales: a checkpoint's float32 scales per 128 x 128 block (ceil(rows/128),
    ceil(cols/128)) repeated for each row of their block, (rows, ceil(cols/128)) C-contiguous."""
    return np.ascontiguousarray(np.repeat(np.asarray(blocks, np.float32), FP8_COL_BLOCK, axis=0)[:rows])


# ---------------------------------------------------------------------------------------------
# Row groups: four rows per pass share every activation load; the last group clamps its rows to
# rows-1 (quant._store4 skips the repeats).
# ---------------------------------------------------------------------------------------------


@njit(inline="always", **_KW)
def _rows4(g, rows):
    # rows of row group g: 4g .. 4g+3, clamped to rows-1
    r0 = g * 4
    return r0, min(r0 + 1, rows - 1), min(r0 + 2, rows - 1), min(r0 + 3, rows - 1)


@njit(inline="always", **_KW)
def _tile_tokens(out, tile, x, r0, rows):
    # x (n, cols), tile (4, cols) f32: out[t, r0..r0+3] = tile rows . x[t] for every token t
    # Kept as one loop nest: a per-token dot helper (even inlined) measured ~10% slower at 4-8 tokens,
    # its per-token setup weighing on short rows.
    cols = x.shape[1]
    for t in range(x.shape[0]):
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for j in range(cols):
            xj = x[t, j]
            a0 += tile[0, j] * xj
            a1 += tile[1, j] * xj
            a2 += tile[2, j] * xj
            a3 += tile[3, j] * xj
        _store4(out[t], r0, rows, a0, a1, a2, a3)


@njit(**_KW)
def matmul_fp8(out, raw, scale, x, rows, cols):
    # raw (rows, cols) uint8 E4M3, scale (rows,) f32 (FP8_E4M3) or (rows, ceil(cols/128)) f32
    # (FP8_E4M3_BLOCK), x (n, cols) f32 -> out (n, rows) f32
    # The float kernels' loop (smalln._matmul_float: 16-lane FMAs over four rows x four tokens, the codes
    # widened in registers, the row scale applied to each sum or each block's sums scaled into the row's
    # lanes), so every token gets the bits its matvec gives whatever the batch.
    _matmul_float(out, raw.view(np.int8), x, rows, cols, cols, scale, E4M3_HALF_FACTOR)


@njit(**_KW)
def matvec_fp8(out, raw, scale, x, rows, cols):
    # raw (rows, cols) uint8 E4M3, scale as matmul_fp8's, x (cols,) f32 -> out (rows,) f32: one token's matmul
    matmul_fp8(out.reshape((1, rows)), raw, scale, x.reshape((1, cols)), rows, cols)


@njit(parallel=True, **_KW)
def dequant_fp8(out, raw, scale, ids, cols):
    # out (n, cols) f32; raw (rows, cols) uint8 E4M3; scale (rows,) f32; ids (n,) int64
    for i in prange(ids.shape[0]):
        p = ids[i] * cols
        s = scale[ids[i]] * E4M3_HALF_FACTOR
        for j in range(cols):
            out[i, j] = ld_e4m3(raw, p + j) * s


@njit(parallel=True, **_KW)
def dequant_fp8_blocks(out, raw, scale, ids, cols):
    # out (n, cols) f32; raw (rows, cols) uint8 E4M3; scale (rows, ceil(cols/128)) f32; ids (n,) int64
    for i in prange(ids.shape[0]):
        r = ids[i]
        p = r * cols
        for b in range(scale.shape[1]):
            s = scale[r, b] * E4M3_HALF_FACTOR
            for j in range(b * COL_BLOCK, min(cols, (b + 1) * COL_BLOCK)):
                out[i, j] = ld_e4m3(raw, p + j) * s


@njit(parallel=True, **_KW)
def matvec_nvfp4(out, raw, bscale, gscale, x, rows, cols):
    # raw (rows, cols/2) uint8 E2M1 pairs, bscale (rows, cols/16) uint8 E4M3, gscale f32,
    # x (cols,) f32 -> out (rows,) f32
    half = cols // 2
    nb = cols // 16
    # even / odd activations apart, so a byte's two nibbles meet contiguous activations
    xe = np.empty(half, np.float32)
    xo = np.empty(half, np.float32)
    for i in range(half):
        xe[i] = x[2 * i]
        xo[i] = x[2 * i + 1]
    k = gscale * E4M3_HALF_FACTOR * E2M1_HALF_FACTOR
    for g in prange((rows + 3) // 4):
        r0, r1, r2, r3 = _rows4(g, rows)
        p0, p1, p2, p3 = r0 * half, r1 * half, r2 * half, r3 * half
        # eight lanes per row, each block's products scaled into them: no per-block horizontal sum
        # (measured 2-3x the weights/s of summing every block first)
        acc = np.zeros((4, 8), np.float32)
        for b in range(nb):
            c0 = ld_e4m3(bscale, r0 * nb + b)
            c1 = ld_e4m3(bscale, r1 * nb + b)
            c2 = ld_e4m3(bscale, r2 * nb + b)
            c3 = ld_e4m3(bscale, r3 * nb + b)
            for lane in range(8):
                i = b * 8 + lane
                e = xe[i]
                o = xo[i]
                acc[0, lane] += c0 * (ld_e2m1(raw, p0 + i, 0) * e + ld_e2m1(raw, p0 + i, 4) * o)
                acc[1, lane] += c1 * (ld_e2m1(raw, p1 + i, 0) * e + ld_e2m1(raw, p1 + i, 4) * o)
                acc[2, lane] += c2 * (ld_e2m1(raw, p2 + i, 0) * e + ld_e2m1(raw, p2 + i, 4) * o)
                acc[3, lane] += c3 * (ld_e2m1(raw, p3 + i, 0) * e + ld_e2m1(raw, p3 + i, 4) * o)
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for lane in range(8):
            a0 += acc[0, lane]
            a1 += acc[1, lane]
            a2 += acc[2, lane]
            a3 += acc[3, lane]
        _store4(out, r0, rows, a0 * k, a1 * k, a2 * k, a3 * k)


@njit(parallel=True, **_KW)
def matmul_nvfp4(out, raw, bscale, gscale, x, rows, cols):
    # raw (rows, cols/2) uint8 E2M1 pairs, bscale (rows, cols/16) uint8 E4M3, gscale f32,
    # x (n, cols) f32 -> out (n, rows) f32
    # Four rows are dequantized once into a float tile and reused for every token (2-4x the matvec's
    # weights/s at 8 tokens); the sums run in another order than the matvec's (float32 rounding apart).
    half = cols // 2
    nb = cols // 16
    k = gscale * E4M3_HALF_FACTOR * E2M1_HALF_FACTOR
    for g in prange((rows + 3) // 4):
        r0 = g * 4
        tile = np.empty((4, cols), np.float32)
        for i in range(4):
            r = min(r0 + i, rows - 1)
            for b in range(nb):
                s = ld_e4m3(bscale, r * nb + b) * k
                for j in range(8):
                    p = r * half + b * 8 + j
                    tile[i, 16 * b + 2 * j] = ld_e2m1(raw, p, 0) * s
                    tile[i, 16 * b + 2 * j + 1] = ld_e2m1(raw, p, 4) * s
        _tile_tokens(out, tile, x, r0, rows)


@njit(parallel=True, **_KW)
def dequant_nvfp4(out, raw, bscale, gscale, ids, cols):
    # out (n, cols) f32; raw (rows, cols/2) uint8; bscale (rows, cols/16) uint8 E4M3; ids (n,) int64
    nb = cols // 16
    k = gscale * E4M3_HALF_FACTOR * E2M1_HALF_FACTOR
    for i in prange(ids.shape[0]):
        r = ids[i]
        for b in range(nb):
            s = ld_e4m3(bscale, r * nb + b) * k
            for j in range(8):
                p = r * (cols // 2) + b * 8 + j
                out[i, b * 16 + 2 * j] = ld_e2m1(raw, p, 0) * s
                out[i, b * 16 + 2 * j + 1] = ld_e2m1(raw, p, 4) * s


def check(w: Weight) -> None:
    """Validate an FP8/NVFP4 weight's arrays against its shape. Raises ValueError."""
    ok = w.raw.dtype == np.uint8 and w.raw.flags.c_contiguous and w.scales is not None
    if ok and w.ggml_type in (FP8_E4M3, FP8_E4M3_BLOCK):
        shape = (w.rows,) if w.ggml_type == FP8_E4M3 else (w.rows, -(-w.cols // FP8_COL_BLOCK))
        ok = w.raw.shape == (w.rows, w.cols) and w.scales.dtype == np.float32 and w.scales.shape == shape
    elif ok and w.ggml_type == NVFP4:
        ok = (
            w.cols % NVFP4_BLOCK == 0
            and w.raw.shape == (w.rows, w.cols // 2)
            and w.scales.dtype == np.uint8
            and w.scales.shape == (w.rows, w.cols // NVFP4_BLOCK)
        )
    else:
        ok = False
    if not ok or not w.scales.flags.c_contiguous:
        raise ValueError(
            f"{TYPE_NAMES.get(w.ggml_type, w.ggml_type)} weight {w.rows}x{w.cols} has raw "
            f"{w.raw.dtype} {w.raw.shape} and scales "
            f"{None if w.scales is None else (w.scales.dtype, w.scales.shape)}; see engine/weights.py"
        )


def _matmul(out: np.ndarray, w: Weight, x: np.ndarray) -> None:
    fp8 = w.ggml_type != NVFP4
    if x.shape[0] == 1:
        if fp8:
            matvec_fp8(out[0], w.raw, w.scales, x[0], w.rows, w.cols)
        else:
            matvec_nvfp4(out[0], w.raw, w.scales, np.float32(w.global_scale), x[0], w.rows, w.cols)
    elif fp8:
        matmul_fp8(out, w.raw, w.scales, x, w.rows, w.cols)
    else:
        matmul_nvfp4(out, w.raw, w.scales, np.float32(w.global_scale), x, w.rows, w.cols)


def _dequant(out: np.ndarray, w: Weight, ids: np.ndarray) -> None:
    if w.ggml_type == FP8_E4M3:
        dequant_fp8(out, w.raw, w.scales, ids, w.cols)
    elif w.ggml_type == FP8_E4M3_BLOCK:
        dequant_fp8_blocks(out, w.raw, w.scales, ids, w.cols)
    else:
        dequant_nvfp4(out, w.raw, w.scales, np.float32(w.global_scale), ids, w.cols)


_scratch = threading.local()


def linear(out: np.ndarray, w: Weight, x: np.ndarray, small_batch_max: int) -> None:
    """out (n, rows) = x (n, cols) @ W.T for an FP8_E4M3 / NVFP4 weight (see cpu.linear).

    Up to `small_batch_max` tokens the kernel reads the codes directly (one token: the decode matvec);
    more tokens (prefill) dequantize tiles of rows to float32 and multiply them with BLAS.
    """
    check(w)
    n = x.shape[0]
    if x.ndim != 2 or x.shape[1] != w.cols or out.shape != (n, w.rows):
        raise ValueError(f"linear: x {x.shape} and out {out.shape} do not fit a {w.rows}x{w.cols} weight")
    if n <= small_batch_max and x.flags.c_contiguous and out.flags.c_contiguous:
        _matmul(out, w, x)
        return
    tile = max(4, min(w.rows, _TILE_BYTES // (4 * w.cols)))
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < tile * w.cols:
        buf = _scratch.buf = np.empty(tile * w.cols, np.float32)
    for r0 in range(0, w.rows, tile):
        r1 = min(r0 + tile, w.rows)
        rows = buf[: (r1 - r0) * w.cols].reshape(r1 - r0, w.cols)
        _dequant(rows, w, np.arange(r0, r1, dtype=np.int64))
        np.matmul(x, rows.T, out=out[:, r0:r1])


def get_rows(out: np.ndarray, w: Weight, ids: np.ndarray) -> None:
    """out (len(ids), cols) float32 = dequantized rows `ids` of an FP8_E4M3 / NVFP4 weight."""
    check(w)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if out.shape != (ids.shape[0], w.cols) or not out.flags.c_contiguous:
        raise ValueError(f"get_rows: out {out.shape} should be C-contiguous ({ids.shape[0]}, {w.cols})")
    if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
        raise ValueError(f"get_rows: ids must lie in [0, {w.rows}), got [{ids.min()}, {ids.max()}]")
    _dequant(out, w, ids)
