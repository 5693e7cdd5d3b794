"""Per-kernel parity of the CUDA backend with the CPU kernels on random data (needs a GPU; the quantized
matvec / dequant cases also run on host threads in test_decoder_dry.py and test_fp_formats.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.backends import cpu
from engine.backends.cpu import fpquant
from engine.backends.cpu.fpquant import FP8_E4M3, FP8_E4M3_BLOCK, NVFP4
from engine.quant.encode import dequantize, quantize
from engine.quant.fp8 import dequantize_fp8, dequantize_fp8_blocks, quantize_fp8, quantize_fp8_blocks
from engine.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from engine.weights import Weight

pytestmark = pytest.mark.cuda

# ggml id (or safetensors format id: FP8_E4M3, NVFP4, FP8_E4M3_BLOCK) -> elements per block
TYPES = {0: 1, 1: 1, 30: 1, 8: 32, 2: 32, 3: 32, 6: 32, 7: 32, 10: 256, 11: 256, 12: 256, 13: 256, 14: 256}
TYPES |= {20: 32, 23: 256, 39: 32}  # IQ4_NL, IQ4_XS, MXFP4
TYPES |= {FP8_E4M3: 1, NVFP4: 16, FP8_E4M3_BLOCK: 1}


def _weight(t: int, rows: int, cols: int, seed: int) -> tuple[Weight, np.ndarray]:
    rng = np.random.default_rng(seed)
    m = (rng.standard_normal((rows, cols)) * rng.uniform(0.05, 1.0, (rows, 1))).astype(np.float32)
    if t == FP8_E4M3:
        codes, scale = quantize_fp8(m)
        return Weight(t, codes, rows, cols, scale), dequantize_fp8(codes, scale)
    if t == FP8_E4M3_BLOCK:  # a scale per 128 x 128 block, repeated per row as the loader keeps it
        codes, blocks = quantize_fp8_blocks(m)
        scales = fpquant.block_scales_per_row(blocks, rows)
        return Weight(t, codes, rows, cols, scales), dequantize_fp8_blocks(codes, blocks)
    if t == NVFP4:
        packed, scales, g = quantize_nvfp4(m)
        return Weight(t, packed, rows, cols, scales, float(g)), dequantize_nvfp4(packed, scales, g)
    if t in (20, 23, 39):  # IQ4_NL / IQ4_XS: no encoder; MXFP4: every code and exponents down to 2^-128
        # (random blocks, test_cpu_kernels), gguf's decoding
        from tests.engine.test_cpu_kernels import make_weight

        return make_weight(gguf.GGMLQuantizationType(t), rows, cols, rng)
    raw = quantize(t, m)
    return Weight(t, raw, rows, cols), dequantize(t, raw, cols)


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("t", sorted(TYPES))
def test_matvec_and_dequant_match_cpu(gpu, t):
    import cupy as cp

    from engine.backends.cuda import ops

    rows, cols = 77, 512  # rows not a multiple of the 8 warps of a block
    w, dense = _weight(t, rows, cols, t)
    x = np.random.default_rng(1).standard_normal((1, cols)).astype(np.float32)
    ref = np.empty((1, rows), np.float32)
    cpu.linear(ref, w, x)
    gw = ops.upload(w)
    assert gw.nbytes == w.nbytes  # codes and scales: what a decode step reads
    for int_dot in (False, True):  # float dot products, then integer ones where the type has them
        out = cp.empty(rows, cp.float32)
        ops.matvec(out, [gw], cp.asarray(x[0]), int_dot=int_dot)
        assert _rel(out.get(), ref[0]) < 1e-4, t  # CPU kernels quantize x to int16 per 32 (~1e-5)
        # x quantized per 32 to 15 bits: up to 1.5e-5 of its unit's max per element
        tol = 1e-4 if int_dot and t in ops.INT_DOT_TYPES else 2e-5
        np.testing.assert_allclose(out.get(), dense @ x[0], rtol=0, atol=tol * np.abs(dense).sum(1).max())
    # dequant of all rows (float32 and float16) and of picked rows (embedding lookup)
    full = cp.empty((rows, cols), cp.float32)
    ops.dequant(full, gw)
    # the GPU may contract d * q - m into one FMA: last-bit differences
    np.testing.assert_allclose(full.get(), dense, rtol=1e-6, atol=1e-7 * np.abs(dense).max())
    half = cp.empty((rows, cols), cp.float16)
    ops.dequant(half, gw)
    np.testing.assert_allclose(
        half.get().astype(np.float32), dense, rtol=1e-3, atol=1e-4 * np.abs(dense).max()
    )
    ids = np.array([5, 0, 76, 5], np.int32)
    picked = cp.empty((4, cols), cp.float32)
    ops.dequant(picked, gw, ids=cp.asarray(ids), scale=2.0)
    np.testing.assert_allclose(picked.get(), dense[ids] * 2.0, rtol=1e-6)


# FP8 / NVFP4: each stacked weight brings its own row / block and global scales
@pytest.mark.parametrize("int_dot", [True, False])
@pytest.mark.parametrize("t", [10, 11, 12, 13, 14, 20, 23, 39, 8, 6, 7, 1, FP8_E4M3, NVFP4, FP8_E4M3_BLOCK])
def test_stacked_matvec_prologues_and_accumulate(gpu, t, int_dot):
    import cupy as cp

    from engine.backends.cuda import ops

    cols = 512
    parts = [_weight(t, r, cols, 10 + r) for r in (64, 16, 16)]
    dense = np.concatenate([d for _, d in parts])
    rng = np.random.default_rng(3)
    x, x2, nw = (rng.standard_normal(cols).astype(np.float32) for _ in range(3))
    eps = 1e-5
    normed = x / np.sqrt(np.mean(x * x) + eps) * nw
    silu = x / (1 + np.exp(-x)) * x2
    c = np.sqrt(2 / np.pi)
    gelu = 0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x**3))) * x2
    ws = [ops.upload(w) for w, _ in parts]
    gx, gx2, gnw = cp.asarray(x), cp.asarray(x2), cp.asarray(nw)
    scale = np.abs(dense).sum(1).max() * 4e-6
    if int_dot and t in ops.INT_DOT_TYPES:
        scale *= 10  # the activation quantized per 32 to 15 bits
    for prologue, act in ((0, x), (1, normed), (2, silu), (3, gelu)):
        out = cp.empty(96, cp.float32)
        ops.matvec(out, ws, gx, x2=gx2, norm=gnw, eps=eps, prologue=prologue, int_dot=int_dot)
        np.testing.assert_allclose(out.get(), dense @ act, rtol=0, atol=scale * (1 + np.abs(act).max()))
    base = np.random.default_rng(4).standard_normal(96).astype(np.float32)
    out = cp.asarray(base)
    ops.matvec(out, ws, gx, accumulate=True, int_dot=int_dot)
    np.testing.assert_allclose(out.get(), base + dense @ x, rtol=0, atol=scale * (1 + np.abs(x).max()))


@pytest.mark.parametrize("cols", [512, 4096])  # 4096: 16 rounds of quarters in a block of 256
def test_int_dot_matvec_stacks_mixed_types(gpu, cols):
    """One integer-dot launch over q|k|v of different types (Q4_K_M files mix Q4_K and Q6_K), against
    the dense product; the float kernels refuse such a stack."""
    import cupy as cp

    from engine.backends.cuda import ops

    parts = [_weight(t, rows, cols, seed) for t, rows, seed in ((12, 40, 1), (14, 9, 2), (8, 23, 3))]
    dense = np.concatenate([d for _, d in parts])
    ws = [ops.upload(w) for w, _ in parts]
    x = np.random.default_rng(5).standard_normal(cols).astype(np.float32)
    nw = np.random.default_rng(6).uniform(0.5, 1.5, cols).astype(np.float32)
    normed = x / np.sqrt(np.mean(x * x) + 1e-6) * nw
    out = cp.empty(72, cp.float32)
    ops.matvec(out, ws, cp.asarray(x), norm=cp.asarray(nw), eps=1e-6, prologue=1)
    atol = 1e-4 * np.abs(dense).sum(1).max() * np.abs(normed).max()
    np.testing.assert_allclose(out.get(), dense @ normed, rtol=0, atol=atol)
    with pytest.raises(ValueError, match="one type"):
        ops.matvec(out, ws, cp.asarray(x), int_dot=False)


def test_matvec_batch_matches_one_vector_at_a_time(gpu):
    """ops.matvec_batch over 10 vectors (launches of 8 and 2) gives each vector what ops.matvec gives
    it alone: the same quantization and dot products. RMSNorm and SwiGLU prologues,
    accumulate into rows of a wider output, mixed Q4_K/Q6_K/Q8_0 stacks."""
    import cupy as cp

    from engine.backends.cuda import ops

    parts = [_weight(t, rows, 256, seed) for t, rows, seed in ((12, 24, 1), (14, 8, 2), (8, 8, 3))]
    ws = [ops.upload(w) for w, _ in parts]
    rng = np.random.default_rng(8)
    B = 10
    x = rng.standard_normal((B, 512)).astype(np.float32)  # [x | x2] rows for the SwiGLU prologue
    nw = cp.asarray(rng.uniform(0.5, 1.5, 256).astype(np.float32))
    base = rng.standard_normal((B, 48)).astype(np.float32)
    for prologue, accumulate in ((1, False), (2, True)):
        out = cp.asarray(base)
        gx = cp.asarray(x if prologue == 2 else np.ascontiguousarray(x[:, :256]))
        kw = dict(norm=nw, eps=1e-5, prologue=prologue, accumulate=accumulate)
        ops.matvec_batch(out, ws, gx, cols_x2=prologue == 2, **kw)
        for b in range(B):
            one = cp.asarray(base[b, :40])
            x2 = cp.asarray(x[b, 256:]) if prologue == 2 else None
            ops.matvec(one, ws, cp.asarray(x[b, :256]), x2=x2, **kw)
            np.testing.assert_allclose(out.get()[b, :40], one.get(), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(out.get()[:, 40:], base[:, 40:])  # beyond the rows: untouched
    with pytest.raises(ValueError, match="integer-dot weights"):  # records: matvec_qb's alone
        ops.matvec_batch(out, [ops.upload(_weight(1, 4, 256, 9)[0])], gx, prologue=4)


# float kernels: F16, BF16, F32, FP8 (both), NVFP4, and block types' float dot products (int_dot=False)
FLOAT_BATCH_TYPES = (1, 30, 0, FP8_E4M3, NVFP4, FP8_E4M3_BLOCK, 8, 12, 39)


@pytest.mark.parametrize("t", FLOAT_BATCH_TYPES)
def test_float_matvec_batch_matches_one_vector_at_a_time(gpu, t, monkeypatch):
    """ops.matvec_batch through the float kernels: 5 vectors in launches of 2 (shared memory for 2
    float inputs made the limit), each weight row read once a launch, give each vector what ops.matvec
    gives it alone: a stack of two weights of the type, RMSNorm and SwiGLU prologues, accumulate into
    rows of a wider output."""
    import cupy as cp

    from engine.backends.cuda import ops

    cols = 256
    ws = [ops.upload(_weight(t, rows, cols, seed)[0]) for rows, seed in ((24, 1), (8, 2))]
    monkeypatch.setattr(ops, "max_shared", lambda: 2 * 4 * cols + 64)
    rng = np.random.default_rng(9)
    B = 5
    x = rng.standard_normal((B, 2 * cols)).astype(np.float32)  # [x | x2] rows for the SwiGLU prologue
    nw = cp.asarray(rng.uniform(0.5, 1.5, cols).astype(np.float32))
    base = rng.standard_normal((B, 40)).astype(np.float32)
    for prologue, accumulate in ((1, False), (2, True)):
        out = cp.asarray(base)
        gx = cp.asarray(x if prologue == 2 else np.ascontiguousarray(x[:, :cols]))
        kw = dict(norm=nw, eps=1e-5, prologue=prologue, accumulate=accumulate, int_dot=False)
        ops.matvec_batch(out, ws, gx, cols_x2=prologue == 2, **kw)
        for b in range(B):
            one = cp.asarray(base[b, :32])
            x2 = cp.asarray(x[b, cols:]) if prologue == 2 else None
            ops.matvec(one, ws, cp.asarray(x[b, :cols]), x2=x2, **kw)
            np.testing.assert_allclose(out.get()[b, :32], one.get(), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(out.get()[:, 32:], base[:, 32:])  # beyond the rows: untouched
    with pytest.raises(ValueError, match="integer-dot weights"):
        ops.matvec_batch(out, ws, gx, prologue=4, int_dot=False)


def test_matvec_batch_within_a_smaller_shared_memory(gpu, monkeypatch):
    """The same on a device whose blocks hold only 3 vectors' records (an RTX 4090's 99 KiB hold 2 of
    Llama-3-8B's down projection): 3 vectors a launch."""
    from engine.backends.cuda import ops

    monkeypatch.setattr(ops, "max_shared", lambda: 3 * 4 * ops.records_width(256) + 64)
    test_matvec_batch_matches_one_vector_at_a_time(gpu)


def test_matvec_hand_off_records_match_the_float_input(gpu):
    """ops.Emit: a matvec's outputs handed on as the next matvec's activation records give the next
    matvec what its own prologue over the float outputs gives. EMIT_NORM (wo-like: added into the
    residual; the next matvec takes RMSNorm's scale, prologue 5) and EMIT_SILU/EMIT_GELU (gate|up; the
    down projection reads the GLU, prologue 4); 10 vectors (launches of 8 and 2), output units that
    several blocks complete; emitting changes no output, and the counters are left zeroed. And the
    records rmsnorm emits as it adds Gemma's post-norms into the residual stream."""
    import cupy as cp

    from engine.backends.cuda import ops

    rng = np.random.default_rng(11)
    B, d, ff, eps = 10, 256, 512, 1e-5
    wo = ops.upload(_weight(12, d, 256, 1)[0])
    gate, up = (ops.upload(_weight(t, ff, d, s)[0]) for t, s in ((12, 2), (14, 3)))
    down = ops.upload(_weight(8, d, ff, 4)[0])
    a = cp.asarray(rng.standard_normal((B, 256)).astype(np.float32))
    x0 = rng.standard_normal((B, d)).astype(np.float32)
    nw = cp.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32))
    x_rec = cp.zeros((B, ops.records_width(d)), cp.uint32)
    act_rec = cp.zeros((B, ops.records_width(ff)), cp.uint32)
    counts = cp.zeros(ff // 32, cp.int32)
    x, x_plain = cp.asarray(x0), cp.asarray(x0)
    ops.matvec_batch(x, [wo], a, accumulate=True, emit=ops.Emit(ops.EMIT_NORM, nw, x_rec, counts))
    ops.matvec_batch(x_plain, [wo], a, accumulate=True)
    np.testing.assert_array_equal(x.get(), x_plain.get())
    assert not counts.get().any()
    for mode, prologue in ((ops.EMIT_SILU, 2), (ops.EMIT_GELU, 3)):
        gu, gu_plain = cp.zeros((B, 2 * ff), cp.float32), cp.zeros((B, 2 * ff), cp.float32)
        emit = ops.Emit(mode, None, act_rec, counts)
        ops.matvec_batch(gu, [gate, up], x_rec, eps=eps, prologue=5, emit=emit)
        ops.matvec_batch(gu_plain, [gate, up], x, norm=nw, eps=eps, prologue=1)
        # the same integer levels; only the RMS's sum of squares adds up in another order
        np.testing.assert_allclose(gu.get(), gu_plain.get(), rtol=0, atol=1e-5 * np.abs(gu_plain.get()).max())
        assert not counts.get().any()
        y, y_plain = cp.zeros((B, d), cp.float32), cp.zeros((B, d), cp.float32)
        ops.matvec_batch(y, [down], act_rec, prologue=4)
        ops.matvec_batch(y_plain, [down], gu, cols_x2=True, prologue=prologue)
        np.testing.assert_array_equal(y.get(), y_plain.get())  # the same activation, quantized alike
    # Gemma's post-norms: x += rmsnorm(o) * w (one block a row) emits x's records for the next norm
    o = cp.asarray(rng.standard_normal((B, d)).astype(np.float32))
    pw = cp.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32))
    xg, xg_plain = cp.asarray(x0), cp.asarray(x0)
    ops.rmsnorm(xg, o, pw, eps, accumulate=True, emit=ops.Emit(ops.EMIT_NORM, nw, x_rec, counts))
    ops.rmsnorm(xg_plain, o, pw, eps, accumulate=True)
    np.testing.assert_array_equal(xg.get(), xg_plain.get())
    ops.matvec_batch(gu, [gate, up], x_rec, eps=eps, prologue=5)
    ops.matvec_batch(gu_plain, [gate, up], xg, norm=nw, eps=eps, prologue=1)
    np.testing.assert_allclose(gu.get(), gu_plain.get(), rtol=0, atol=1e-5 * np.abs(gu_plain.get()).max())
    with pytest.raises(ValueError, match="float32 out"):
        ops.rmsnorm(xg, o, pw, eps, emit=ops.Emit(ops.EMIT_SILU, None, x_rec, counts))
    with pytest.raises(ValueError, match="uint32 activation records"):
        ops.matvec_batch(y, [down], gu, prologue=4)
    with pytest.raises(ValueError, match="gate; up"):
        ops.matvec_batch(y, [down], act_rec, prologue=4, emit=ops.Emit(ops.EMIT_SILU, None, x_rec, counts))
    f16 = ops.upload(_weight(1, d, 256, 5)[0])
    with pytest.raises(ValueError, match="integer-dot"):
        ops.matvec(y[0], [f16], a[0], emit=ops.Emit(ops.EMIT_NORM, nw, x_rec, counts))


# every case of row_dot: the 32-element types, the K-quants' pair loops, IQ4_XS's sub-blocks
SPLIT_STACKS = (((12, 24), (14, 8), (8, 8)), ((2, 8), (6, 8), (23, 8)), ((10, 16), (11, 8), (13, 16)))


@pytest.mark.parametrize("split", [2, 4, 8])
def test_matvec_split_rows_match_one_warp_a_row(gpu, monkeypatch, split, stacks=SPLIT_STACKS):
    """HEARTH_CUDA_SPLIT: `split` warps a row (matvec_qb_split, each warp its share of the row's pieces,
    the shares added in shared memory) give what one warp a row gives, up to the order of the sums: three
    stacked types over 4096 columns (128 units: every warp of a row has pieces at split 2 and 4), 3
    vectors, RMSNorm prologue and accumulate; and the hand-off's records (EMIT_NORM) read back alike."""
    import cupy as cp

    from engine.backends.cuda import ops

    rng = np.random.default_rng(12)
    B, cols = 3, 4096
    x = cp.asarray(rng.standard_normal((B, cols)).astype(np.float32))
    nw = cp.asarray(rng.uniform(0.5, 1.5, cols).astype(np.float32))

    def run(mode, ws, out, **kw):
        monkeypatch.setenv(ops.ROW_SPLIT_ENV, mode)
        ops.matvec_batch(out, ws, x, **kw)
        return out.get()

    for i, stack in enumerate(stacks):
        ws = [ops.upload(_weight(t, rows, cols, 20 + 3 * i + k)[0]) for k, (t, rows) in enumerate(stack)]
        n = sum(rows for _, rows in stack)
        base = rng.standard_normal((B, n)).astype(np.float32)
        kw = dict(norm=nw, eps=1e-5, prologue=1, accumulate=True)
        one = run("1", ws, cp.asarray(base), **kw)
        got = run(str(split), ws, cp.asarray(base), **kw)
        np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-5 * np.abs(one).max())
    # the records a split matvec hands on: a 64-row wo-like matrix added into a residual stream
    wo = ops.upload(_weight(12, 64, cols, 40)[0])
    nxt = ops.upload(_weight(8, 16, 64, 41)[0])
    x0 = rng.standard_normal((B, 64)).astype(np.float32)
    nw64 = cp.asarray(rng.uniform(0.5, 1.5, 64).astype(np.float32))
    ys = []
    for mode in ("1", str(split)):
        res, rec = cp.asarray(x0), cp.zeros((B, ops.records_width(64)), cp.uint32)
        counts = cp.zeros(2, cp.int32)
        run(mode, [wo], res, accumulate=True, emit=ops.Emit(ops.EMIT_NORM, nw64, rec, counts))
        assert not counts.get().any()
        y = cp.zeros((B, 16), cp.float32)
        ops.matvec_batch(y, [nxt], rec, eps=1e-5, prologue=5)
        ys.append(y.get())
    np.testing.assert_allclose(ys[1], ys[0], rtol=0, atol=1e-4 * np.abs(ys[0]).max())


# (type, rows) stacks over `cols`: block types of one and of mixed kinds (one dequant_qb launch per
# tile), and a float16 weight among them (a launch per weight in each tile)
STACKS = {
    "q8_0|q4_0|q8_0": (((8, 5), (2, 3), (8, 4)), 64),
    "q4_k|q4_k|q6_k": (((12, 5), (12, 3), (14, 4)), 256),
    "q8_0|f16|q8_0": (((8, 5), (1, 3), (8, 4)), 64),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("stack", list(STACKS))
def test_linear_prefill_stacks_weights_across_tiles(gpu, dtype, stack):
    """linear_prefill over stacked weights of different types (q|k|v, gate|up) with a scratch so small
    that tiles start and end inside weights and one tile spans two: out = x @ [W1; W2; W3].T, then +=."""
    import cupy as cp

    from engine.backends.cuda import ops

    types, cols = STACKS[stack]
    parts = [_weight(t, rows, cols, seed) for seed, (t, rows) in enumerate(types, 1)]
    dense = np.concatenate([d for _, d in parts])
    x = np.random.default_rng(4).standard_normal((3, cols)).astype(np.float32)
    scratch = cp.empty(cols * 5, dtype)  # tiles of 5 rows: [0, 5) [5, 10) [10, 12)
    out = cp.zeros((3, 12), cp.float32)
    ws = [ops.upload(w) for w, _ in parts]
    ops.linear_prefill(out, ws, cp.asarray(x.astype(dtype)), scratch)
    want = x.astype(dtype).astype(np.float64) @ dense.astype(dtype).astype(np.float64).T
    tol = 1e-4 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(out.get(), want, rtol=tol, atol=tol * np.abs(want).max())
    ops.linear_prefill(out, ws, cp.asarray(x.astype(dtype)), scratch, accumulate=True)
    np.testing.assert_allclose(out.get(), 2 * want, rtol=tol, atol=2 * tol * np.abs(want).max())
    with pytest.raises(ValueError, match="same number of columns"):
        ops.linear_prefill(out, [ws[0], ops.upload(_weight(8, 2, cols + 32, 5)[0])], cp.asarray(x), scratch)


@pytest.mark.parametrize("add_one", [False, True])
def test_rmsnorm(gpu, add_one):
    import cupy as cp

    from engine.backends.cuda import ops

    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 640)).astype(np.float32)
    w = rng.standard_normal(640).astype(np.float32)
    ref = np.empty_like(x)
    cpu.rmsnorm(ref, x, (1 + w) if add_one else w, 1e-6)
    out = cp.empty((3, 640), cp.float32)
    ops.rmsnorm(out, cp.asarray(x), cp.asarray(w), 1e-6, add_one=add_one)
    np.testing.assert_allclose(out.get(), ref, rtol=1e-5, atol=1e-6)
    acc = cp.ones((3, 640), cp.float32)
    ops.rmsnorm(acc, cp.asarray(x), cp.asarray(w), 1e-6, add_one=add_one, accumulate=True)
    np.testing.assert_allclose(acc.get(), ref + 1, rtol=1e-5, atol=1e-6)


# (neox, window, qk_norm, soft-cap, sinks): plain, Qwen3's norms, a window, Gemma 2's cap, gpt-oss's sinks
ATTENTION_CASES = [(False, 0, False, 0.0, False), (True, 0, True, 0.0, False), (True, 5, True, 0.0, False),
                   (False, 0, False, 2.5, True), (True, 5, False, 0.0, True)]


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("neox,window,qk_norm,cap,with_sinks", ATTENTION_CASES)
def test_rope_store_and_attention_match_cpu(gpu, kv_dtype, neox, window, qk_norm, cap, with_sinks):
    import cupy as cp

    from engine.backends.cuda import ops
    from engine.rope import rope_inv_freq

    H, KV, hd, n_ctx, pos0, n = 8, 2, 64, 600, 517, 3  # 517 + 3 keys: splits of 64 (ops.attention_splits)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    k = rng.standard_normal((n, KV, hd)).astype(np.float32)
    v = rng.standard_normal((n, KV, hd)).astype(np.float32)
    kc = np.zeros((KV, n_ctx, hd), kv_dtype)
    vc = np.zeros((KV, n_ctx, hd), kv_dtype)
    kc[:, :pos0] = rng.standard_normal((KV, pos0, hd))
    vc[:, :pos0] = rng.standard_normal((KV, pos0, hd))
    inv = rope_inv_freq(hd, 10000.0)
    qn = rng.standard_normal(hd).astype(np.float32) if qk_norm else None
    kn = rng.standard_normal(hd).astype(np.float32) if qk_norm else None
    sinks = rng.normal(1.0, 1.0, H).astype(np.float32) if with_sinks else None
    gsinks = None if sinks is None else cp.asarray(sinks)
    extra = dict(softcap=cap, sinks=gsinks)
    # CPU reference: per-head norm, RoPE, cache write, attention (window through cache views)
    qr, kr = q.copy(), k.copy()
    if qk_norm:
        cpu.rmsnorm(qr.reshape(-1, hd), qr.reshape(-1, hd), qn, 1e-6)
        cpu.rmsnorm(kr.reshape(-1, hd), kr.reshape(-1, hd), kn, 1e-6)
    positions = np.arange(pos0, pos0 + n)
    cpu.rope(qr, positions, inv, hd, neox)
    cpu.rope(kr, positions, inv, hd, neox)
    kref, vref = kc.copy(), vc.copy()
    kref[:, pos0 : pos0 + n] = kr.transpose(1, 0, 2)
    vref[:, pos0 : pos0 + n] = v.transpose(1, 0, 2)
    ref = np.empty_like(q)
    scale = hd**-0.5
    for i in range(n):
        p = pos0 + i
        start = max(0, p - window + 1) if window else 0
        cpu.attention(ref[i : i + 1], qr[i : i + 1], kref[:, start:], vref[:, start:], p - start, scale,
                      softcap=cap or None, sinks=sinks)
    # the rows as the stacked q|k|v projection leaves them
    gqkv = cp.asarray(np.concatenate([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], axis=1))
    gkc, gvc = cp.asarray(kc), cp.asarray(vc)
    pos = cp.asarray(np.array([pos0], np.int32))
    rep = H // KV
    gq = cp.empty((KV, n * rep, hd), kv_dtype)  # grouped by KV head, token-major, in the cache's dtype
    ops.rope_store(
        gq,
        gqkv,
        H,
        gkc,
        gvc,
        pos,
        cp.asarray(inv),
        hd,
        neox,
        1e-6,
        None if qn is None else cp.asarray(qn),
        None if kn is None else cp.asarray(kn),
    )
    tol = 1e-5 if kv_dtype == np.float32 else 1e-3
    q_tokens = gq.get().astype(np.float32).reshape(KV, n, rep, hd).transpose(1, 0, 2, 3).reshape(n, H, hd)
    np.testing.assert_allclose(q_tokens, qr, rtol=tol, atol=tol)
    rows = np.concatenate([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], axis=1)
    np.testing.assert_array_equal(gqkv.get(), rows)  # qkv is left as it was
    np.testing.assert_allclose(gkc.get().astype(np.float32), kref.astype(np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(gvc.get(), vref)
    # prefill attention over the grouped queries and the caches rope_store wrote
    out = cp.empty((n, H, hd), cp.float32)
    ops.attention_prefill(out, gq, gkc, gvc, pos0, scale, window, **extra)
    np.testing.assert_allclose(out.get(), ref, rtol=1e-4, atol=10 * tol)
    # decode: the same tokens one at a time, RoPE + cache write + split-K attention in one launch each,
    # over 10 splits of 64 keys (with the window only the last holds visible keys; the last block of a head
    # combines the splits that hold visible keys)
    gkc, gvc = cp.asarray(kc), cp.asarray(vc)
    norms = tuple(None if a is None else cp.asarray(a) for a in (qn, kn))
    rope = (cp.asarray(inv), hd, neox, 1e-6, *norms)
    parts = ops.attention_parts(H, hd, n_ctx)
    records = cp.zeros((1, ops.records_width(H * hd)), cp.uint32)
    for i in range(n):
        out = cp.empty(H * hd, cp.float32)
        at = cp.asarray(np.array([pos0 + i], np.int32))
        rec = records[0] if i == n - 1 else None  # the last token's output as records too
        keys = (n_ctx, window, parts, rec)
        ops.attention(out, cp.asarray(rows[i]), H, gkc, gvc, at, rope, scale, *keys, **extra)
        np.testing.assert_allclose(out.get().reshape(H, hd), ref[i], rtol=1e-4, atol=10 * tol)
        assert not parts[2].get().any()  # the last block of each head reset its counter
    # the output projection over the records (prologue 4) is its product with out quantized in its blocks
    wo = ops.upload(_weight(8, 16, H * hd, 9)[0])
    got, want = cp.zeros((1, 16), cp.float32), cp.zeros((1, 16), cp.float32)
    ops.matvec_batch(got, [wo], records, prologue=4)
    ops.matvec_batch(want, [wo], out.reshape(1, -1))
    np.testing.assert_array_equal(got.get(), want.get())
    np.testing.assert_allclose(gkc.get().astype(np.float32), kref.astype(np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(gvc.get(), vref)


@pytest.mark.parametrize("window", [0, 40])
def test_attention_batch_matches_one_sequence_at_a_time(gpu, window):
    """ops.attention_batch: three sequences (caches of different sizes, positions far apart) in one launch
    give what ops.attention gives each alone with the same splits (n_keys_max): the outputs, the records
    for wo, and the key and value each writes to its own cache."""
    import cupy as cp

    from engine.backends.cuda import ops
    from engine.rope import rope_inv_freq

    H, KV, hd = 4, 2, 64
    sizes, positions = (200, 130, 200), (150, 100, 5)
    rng = np.random.default_rng(9)
    rope = (cp.asarray(rope_inv_freq(hd, 10000.0)), hd, True, 1e-6, None, None)
    qkv = cp.asarray(rng.standard_normal((3, (H + 2 * KV) * hd)).astype(np.float32))
    pos = cp.asarray(np.array(positions, np.int32))
    host = [rng.standard_normal((2, KV, n, hd)).astype(np.float16) for n in sizes]
    width, n_keys = ops.records_width(H * hd), max(sizes)
    outs, caches = {}, {}
    for batched in (True, False):
        kv = [(cp.asarray(c[0]), cp.asarray(c[1])) for c in host]
        out, rec = cp.zeros((3, H * hd), cp.float32), cp.zeros((3, width), cp.uint32)
        if batched:
            table = np.array([[k.data.ptr, v.data.ptr, k.shape[1]] for k, v in kv], np.uint64)
            parts = ops.attention_parts(H, hd, n_keys, 3)
            args = (kv, cp.asarray(table), pos, rope, hd**-0.5, n_keys, window, parts, rec)
            ops.attention_batch(out, qkv, H, *args)
            assert not parts[2].get().any()
        else:
            for b, (k, v) in enumerate(kv):
                keys = (n_keys, window)
                ops.attention(out[b], qkv[b], H, k, v, pos[b : b + 1], rope, hd**-0.5, *keys, records=rec[b])
        outs[batched], caches[batched] = (out.get(), rec.get()), [(k.get(), v.get()) for k, v in kv]
    for got, want in zip(outs[True], outs[False]):
        np.testing.assert_array_equal(got, want)
    for (k, v), (k1, v1), h, p in zip(caches[True], caches[False], host, positions):
        np.testing.assert_array_equal(k, k1)
        np.testing.assert_array_equal(v, v1)
        assert not np.array_equal(k[:, p], h[0][:, p])  # the new key went into this sequence's cache
    with pytest.raises(ValueError, match="n_keys_max"):
        ops.attention_batch(out, qkv, H, kv, cp.asarray(table), pos, rope, 1.0, 100)


def _attention_reference(qg, k, v, n, rep, pos0, scale, window):
    """Causal attention (float64) of grouped queries qg (KV, n * rep, hd) over caches (KV, n_ctx, hd):
    (n, H, hd), query row t * rep + r of group g being head g * rep + r of token t at pos0 + t."""
    KV, _, hd = k.shape
    out = np.zeros((n, KV * rep, hd))
    for g in range(KV):
        for t in range(n):
            p = pos0 + t
            lo = max(0, p - window + 1) if window > 0 else 0
            s = qg[g, t * rep : (t + 1) * rep].astype(np.float64) @ k[g, lo : p + 1].astype(np.float64).T
            w = np.exp(scale * s - (scale * s).max(axis=1, keepdims=True))
            o = w @ v[g, lo : p + 1].astype(np.float64) / w.sum(axis=1, keepdims=True)
            out[t, g * rep : (g + 1) * rep] = o
    return out


# (head size, query heads per KV head, prompt tokens, cached tokens before them, sliding window): the
# 1B bench's shape, follow-up turns (rows past a block's end, tiles past its last position), a window,
# head size 128
FLASH_CASES = ((64, 4, 512, 0, 0), (64, 4, 100, 300, 0), (128, 2, 130, 70, 64), (64, 1, 70, 37, 0))


def test_flash_prefill_matches_attention(gpu, cases=FLASH_CASES):
    """ops.attention_prefill_flash (flash.cu: mma.sync tiles of 64 keys, the online softmax in
    registers) against float64 attention of the same float16 inputs, float32 and float16 output; a head
    size it has no kernel for is a ValueError."""
    import cupy as cp

    from engine.backends.cuda import ops

    for hd, rep, n, pos0, window in cases:
        rng = np.random.default_rng(hd + n + pos0)
        KV, n_ctx = 2, pos0 + n + 3
        k = rng.standard_normal((KV, n_ctx, hd)).astype(np.float16)
        v = rng.standard_normal((KV, n_ctx, hd)).astype(np.float16)
        qg = rng.standard_normal((KV, n * rep, hd)).astype(np.float16)
        scale = 1.0 / np.sqrt(hd)
        want = _attention_reference(qg, k, v, n, rep, pos0, scale, window)
        gq, gk, gv = cp.asarray(qg), cp.asarray(k), cp.asarray(v)
        for dtype, tol in ((np.float32, 4e-3), (np.float16, 6e-3)):
            out = cp.zeros((n, KV * rep, hd), dtype)
            ops.attention_prefill_flash(out, gq, gk, gv, pos0, scale, window)
            err = np.abs(cp.asnumpy(out).astype(np.float64) - want).max()
            assert err < tol * np.abs(want).max(), (hd, rep, n, pos0, window, dtype, err)
    with pytest.raises(ValueError, match="head size"):
        ops.attention_prefill_flash(cp.zeros((2, 2, 96), cp.float32), gq, gk, gv, 0, 1.0)


# (vocabulary, top_k, temperature, top_p, min_p): the app's defaults, a single candidate, a wide top-k
# over few logits, a wide top-k with both cuts, fewer logits than top_k; top-k off (the server's) with
# no cut, with top-p, with min-p, over a 128k vocabulary, and over fewer logits than its candidates
SAMPLING_CASES = ((5000, 40, 0.7, 0.95, 0.05), (5000, 1, 1.0, 1.0, 0.0), (300, 256, 1.3, 1.0, 0.0),
                  (5000, 256, 0.5, 0.9, 0.1), (7, 40, 1.0, 1.0, 0.0), (5000, 0, 0.3, 1.0, 0.0),
                  (5000, 0, 0.7, 0.9, 0.0), (5000, 0, 1.0, 1.0, 0.05), (128256, 0, 0.8, 0.95, 0.0),
                  (200, 0, 1.0, 0.9, 0.0))


def test_sampling_draws_from_the_cpu_distribution(gpu, cases=SAMPLING_CASES, draws: int = 12):
    """ops.sample_topk picks, for a uniform u, the token engine.sampling.draw picks with that u (inverse
    CDF of filtered_distribution, as Generator.choice): the same candidates in the same order (ties to
    the lower id), the same temperature, top-p and min-p cuts. With top-k off it answers -1 exactly when
    the pick needs more than its SAMPLE_MAX_K candidates (a cut past them, or with no cut a draw past
    their mass). u's within 1e-4 of a CDF step are left out (float32 against float64 sums)."""
    import cupy as cp

    from engine.backends.cuda import ops
    from engine.sampling import draw, filtered_distribution

    rng = np.random.default_rng(11)
    parts, tok = ops.sample_parts(), cp.zeros(1, cp.int32)
    for n, k, temp, top_p, min_p in cases:
        logits = (3 * rng.standard_normal(n)).astype(np.float32)
        logits[[5 % n, 6 % n]] = logits.max() + 0.5  # a tie at the top
        ids, probs = filtered_distribution(logits, temp, k, top_p, min_p)
        cdf = np.cumsum(probs)
        x, drawn, passed = cp.asarray(logits), 0, 0
        for u in rng.random(draws):
            if np.min(np.abs(cdf - u)) < 1e-4:
                continue
            ops.sample_topk(tok, x, k, temp, top_p, float(u), min_p, parts)
            got, want = int(tok.get()[0]), draw(logits, temp, k, top_p, min_p, float(u))
            assert want == int(ids[np.searchsorted(cdf, u, side="right")])
            cut = top_p < 1.0 or min_p > 0.0
            rank = len(ids) if cut else list(ids).index(want) + 1  # candidates the pick needs
            past = k == 0 and rank > ops.SAMPLE_MAX_K
            assert got == (-1 if past else want), (n, k, u, got, want)
            drawn += 1
            passed += past
        assert drawn >= draws // 2 and not parts[3].get().any()  # the last block reset the counter
        if k == 0 and top_p < 1.0 and (n > 100000 or temp >= 5.0):
            assert passed == drawn  # a flat distribution: the kept set is far past the candidates
    with pytest.raises(ValueError, match="top_k"):
        ops.sample_topk(tok, x, ops.SAMPLE_MAX_K + 1, 1.0, 1.0, 0.5)


def test_sample_rows_draws_each_row_as_sample_topk(gpu, n: int = 3000):
    """ops.sample_rows: several draws in one launch (rows of one logits matrix, in any order and
    repeated, each with its own temperature, top-k (0: off), top-p, min-p and u; temp 0 the argmax,
    ties to the lower id) pick what ops.sample_topk picks for each alone; scratch counters left zeroed."""
    import cupy as cp

    from engine.backends.cuda import ops

    rng = np.random.default_rng(12)
    logits = (3 * rng.standard_normal((4, n + 5))).astype(np.float32)
    logits[2, [7, 9]] = logits[2].max() + 1.0  # a tie at the top
    x = cp.asarray(logits)  # draws from the first n of each row
    rows = [2, 0, 3, 2, 1, 2]
    picks = [(0.0, 40, 1.0, 0.0, 0.3), (0.7, 40, 0.95, 0.05, 0.6), (1.0, 0, 1.0, 0.0, 0.2)]
    picks += [(0.8, 1, 1.0, 0.0, 0.9), (1.3, 256, 0.9, 0.0, 0.45), (0.5, 0, 0.9, 0.1, 0.7)]
    parts = ops.sample_parts(len(rows))
    tokens = cp.asarray(np.full(len(rows), -7, np.int32))
    ops.sample_rows(tokens, x, rows, picks, parts, n)
    got = tokens.get().tolist()
    one, alone = cp.zeros(1, cp.int32), []
    for row, (temp, k, top_p, min_p, u) in zip(rows, picks):
        if temp == 0:
            ops.argmax(one, x[row, :n])
        else:
            ops.sample_topk(one, x[row, :n], k, temp, top_p, u, min_p)
        alone.append(int(one.get()[0]))
    assert got == alone and got[0] == 7
    assert not parts[3].get().any()
    with pytest.raises(ValueError, match="draws"):
        ops.sample_rows(tokens, x, rows, picks, ops.sample_parts(2), n)
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.sample_rows(tokens, x[:, :n], rows, picks, parts)


def test_repetition_penalty_matches_the_cpu(gpu):
    """ops.penalize: engine.sampling.repetition_penalty's CTRL rule on the GPU, for distinct ids."""
    import cupy as cp

    from engine.backends.cuda import ops
    from engine.sampling import repetition_penalty

    logits = np.random.default_rng(2).standard_normal(5000).astype(np.float32)
    recent = [3, 17, 17, 4999, 0, 250]
    want = repetition_penalty(1.7, 64)(recent, logits.copy())
    x = cp.asarray(logits)
    ops.penalize(x, cp.asarray(np.unique(recent).astype(np.int32)), 1.7)
    np.testing.assert_array_equal(x.get(), want)


def test_glu_argmax_and_sampling(gpu):
    import cupy as cp

    from engine.backends.cuda import ops

    rng = np.random.default_rng(7)
    g, u = rng.standard_normal((2, 3, 500)).astype(np.float32)  # 3 rows of [gate | up]
    for gelu, fn in ((False, cpu.silu_mul), (True, cpu.gelu_tanh_mul)):
        ref = np.empty_like(g)
        for t in range(3):
            fn(ref[t], g[t], u[t])
        out = cp.empty((3, 500), cp.float32)
        ops.glu(out, cp.asarray(np.concatenate([g, u], axis=1)), gelu)
        np.testing.assert_allclose(out.get(), ref, rtol=1e-5, atol=1e-6)
    logits = rng.standard_normal(50000).astype(np.float32)
    logits[[123, 40000]] = 9.0  # a tie: the first index wins, as np.argmax
    tok = cp.zeros(1, cp.int32)
    ops.argmax(tok, cp.asarray(logits))
    assert int(tok.get()[0]) == int(np.argmax(logits)) == 123
    parts = ops.argmax_parts()  # reused: the last block resets the counter
    for i, best in enumerate((49999, 7, 40000)):  # the last, the second and a later block's
        logits[best] = 100.0 * (i + 1)
        ops.argmax(tok, cp.asarray(logits), parts)
        assert int(tok.get()[0]) == best and not parts[2].get().any()
    logits[[7, 40000, 49999]] = 0.0
    top5 = set(np.argsort(-logits, kind="stable")[:5].tolist())
    seen = set()
    for i in range(200):
        ops.sample_topk(tok, cp.asarray(logits), 5, 1.0, 1.0, (i + 0.5) / 200)
        seen.add(int(tok.get()[0]))
    assert seen <= top5 and len(seen) > 1
    ops.sample_topk(tok, cp.asarray(logits), 40, 1.0, 1e-6, 0.99)  # top_p tiny: only the best token
    assert int(tok.get()[0]) == 123


@pytest.mark.parametrize("dt_max", [np.inf, 0.3])
def test_mamba2_mixer(gpu, dt_max):
    """The CUDA decoder's Mamba-2 mixer (delta_conv with its bias, ssm_scan, rmsnorm by group) against
    mamba2.mix: a 20-token prompt (the CPU scans it in chunks, the GPU token by token), then decode steps
    from the states it left. Head rows not a multiple of the block's 8 warps, a state of 40 (lanes with two
    columns and lanes with one), three heads a group of B and C, dt clamped or not."""
    import types

    import cupy as cp

    from engine.arch import mamba2
    from engine.backends.cuda.decoder import CudaDecoder

    rng = np.random.default_rng(11)
    shape = mamba2.MambaShape(heads=6, head_dim=10, state_size=40, groups=2, taps=4, dt_min=0.01,
                              dt_max=dt_max)
    f32 = np.float32
    net = mamba2.Mamba2(
        in_proj=None, out_proj=None,
        conv=(rng.standard_normal((shape.conv_dim, shape.taps)) * 0.5).astype(f32),
        conv_bias=rng.standard_normal(shape.conv_dim).astype(f32) * 0.1,
        dt_bias=rng.standard_normal(shape.heads).astype(f32) * 0.5,
        neg_a=-np.exp(rng.uniform(-1, 1, shape.heads)).astype(f32),
        d=rng.standard_normal(shape.heads).astype(f32),
        norm=rng.uniform(0.5, 1.5, shape.d_inner).astype(f32),
    )
    M = {k: cp.asarray(getattr(net, k)) for k in ("conv", "conv_bias", "dt_bias", "neg_a", "d", "norm")}
    mixer = types.SimpleNamespace(mamba=shape, cfg=types.SimpleNamespace(rms_norm_eps=1e-5))
    conv_state = np.zeros((shape.taps - 1, shape.conv_dim), f32)
    state = np.zeros(shape.state_dims, f32)
    g_conv, g_state = cp.asarray(conv_state), cp.asarray(state)
    for n in (20, 1, 1):
        proj = rng.standard_normal((n, shape.in_rows)).astype(f32)
        want = mamba2.mix(net, shape, 1e-5, proj, conv_state, state)
        got = CudaDecoder._mamba_mix(mixer, M, [cp.asarray(proj)], g_conv, g_state)
        assert _rel(got.get(), want) < 1e-4
        assert _rel(g_state.get(), state) < 1e-4 and _rel(g_conv.get(), conv_state) == 0
