"""Launch wrappers for the CUDA kernels (kernels/*.cu), on CuPy arrays. Needs a GPU.

Conventions as the CPU backend's: output first, float32 activations, weights kept in their file's
encoding on the GPU (`GpuWeight`). Shapes are given on every array argument.

Weight formats: the GGUF types of `TYPES` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K,
IQ4_NL, IQ4_XS, MXFP4) and the safetensors formats of `hearth convert --to fp8 / fp8:block / nvfp4`
(layouts in engine/backends/cpu/fpquant.py): FP8_E4M3 (E4M3 codes, float32 scale per row),
FP8_E4M3_BLOCK (E4M3 codes, float32 scale per row and 128 columns) and NVFP4 (E2M1 codes, E4M3 scale
per 16 elements, float32 global scale). Their scales travel beside the codes (GpuWeight.scales,
.global_scale); on sm_89+ (Ada, Hopper) the kernels widen E4M3 with the hardware conversion, elsewhere
by bit moves.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import cupy as cp
import numpy as np

from engine.backends.cpu import fpquant
from engine.backends.cpu.fpquant import FP8_E4M3, FP8_E4M3_BLOCK, NVFP4
from engine.backends.cuda import capture_blas, pdl
from engine.backends.cuda.kernels import kernel
from engine.weights import Weight
from models.formats.ggml_types import type_name

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16, MXFP4 = 10, 11, 12, 13, 14, 20, 23, 30, 39

# ggml type -> (kernel suffix, elements per block, bytes per block)
TYPES = {
    F32: ("f32", 1, 4),
    F16: ("f16", 1, 2),
    BF16: ("bf16", 1, 2),
    Q8_0: ("q8_0", 32, 34),
    Q4_0: ("q4_0", 32, 18),
    Q4_1: ("q4_1", 32, 20),
    Q5_0: ("q5_0", 32, 22),
    Q5_1: ("q5_1", 32, 24),
    Q2_K: ("q2_k", 256, 84),
    Q3_K: ("q3_k", 256, 110),
    Q4_K: ("q4_k", 256, 144),
    Q5_K: ("q5_k", 256, 176),
    Q6_K: ("q6_k", 256, 210),
    IQ4_NL: ("iq4_nl", 32, 18),
    IQ4_XS: ("iq4_xs", 256, 136),
    MXFP4: ("mxfp4", 32, 17),
    # codes only: the scales are arrays of their own (GpuWeight.scales)
    FP8_E4M3: ("fp8", 1, 1),
    FP8_E4M3_BLOCK: ("fp8b", 1, 1),
    NVFP4: ("nvfp4", 16, 8),
}
SUPPORTED_TYPES = frozenset(TYPES)
# dequant_qb (step.cu) and matvec_qb's dp4a dot products (row_dot): every GGUF block type
BLOCK_TYPES = frozenset({Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4})
INT_DOT_TYPES = BLOCK_TYPES
_FLOAT_TYPES = (F32, F16, BF16)
_FP_TYPES = fpquant.FP_TYPES

GRID_Y_MAX = 65535  # CUDA's limit on gridDim.y: kernels with tokens on y stride past it
MATVEC_THREADS = 256  # 8 warps, one row each at a time (matvec_qb is built for it: step.cu MV_WARPS)
MATVEC_BLOCKS_PER_SM = 4
ATTN_SPLITS = 128  # decode attention: the cache in up to this many splits (more for very long caches)
ATTN_MIN_CHUNK, ATTN_MAX_CHUNK = 64, 4096  # keys per split-K block (ops.cu's ATTN_MAX_CHUNK)
ATTN_GEMM_BYTES = 128 << 20  # prefill attention: scores + float32 K/V of one batch of KV heads, at most
NULL = np.uint64(0)  # a null pointer argument

_i32, _f32 = np.int32, np.float32


@dataclass(frozen=True)
class GpuWeight:
    """A weight's rows on the GPU: raw uint8 (rows, row_nbytes), in its own allocation.

    scales: FP8_E4M3 float32 (rows,), FP8_E4M3_BLOCK float32 (rows, ceil(cols/128)), NVFP4 uint8 E4M3
    codes (rows, cols/16), as Weight.scales; None for GGUF types. global_scale: NVFP4's per-tensor scale
    (1.0 otherwise).
    """

    ggml_type: int
    raw: cp.ndarray
    rows: int
    cols: int
    scales: cp.ndarray | None = None
    global_scale: float = 1.0

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes) + (0 if self.scales is None else int(self.scales.nbytes))


class UnsupportedCudaWeightType(ValueError):
    pass


def check_type(ggml_type: int, cols: int) -> None:
    """Raise UnsupportedCudaWeightType unless the kernels handle this type at this width."""
    if ggml_type not in TYPES:
        name = fpquant.TYPE_NAMES.get(ggml_type) or type_name(ggml_type)  # "IQ2_XXS", "FP8_E4M3", "type 99"
        raise UnsupportedCudaWeightType(f"{name} has no CUDA kernel")
    block = TYPES[ggml_type][1]
    if ggml_type in _FLOAT_TYPES and cols % 8:
        raise UnsupportedCudaWeightType(f"float weights need cols % 8 == 0 on CUDA, got {cols}")
    if cols % max(block, 32):
        raise UnsupportedCudaWeightType(f"cols {cols} is not a multiple of {max(block, 32)}")


def upload(w: Weight, progress=None, chunk_bytes: int = 64 << 20) -> GpuWeight:
    """Copy a Weight's rows (and scales) to the GPU in chunks of about chunk_bytes; progress(nbytes)
    after each, w.nbytes in all.

    Raises:
        UnsupportedCudaWeightType: see check_type.
        ValueError: an FP8/NVFP4 weight whose scales do not fit its shape (fpquant.check).
    """
    check_type(w.ggml_type, w.cols)
    if w.ggml_type in _FP_TYPES:
        fpquant.check(w)
    raw = _upload_rows(w.raw, progress, chunk_bytes)
    scales = None if w.scales is None else _upload_rows(w.scales, progress, chunk_bytes)
    return GpuWeight(w.ggml_type, raw, w.rows, w.cols, scales, float(w.global_scale))


def _upload_rows(a: np.ndarray, progress, chunk_bytes: int) -> cp.ndarray:
    a = np.ascontiguousarray(a)
    dst = cp.empty(a.shape, a.dtype)
    step = max(1, chunk_bytes // max(1, a.nbytes // max(1, a.shape[0])))
    for r0 in range(0, a.shape[0], step):
        r1 = min(r0 + step, a.shape[0])
        dst[r0:r1].set(a[r0:r1])
        if progress is not None:
            progress(int(a[r0:r1].nbytes))
    return dst


def _sm_count() -> int:
    return _sm_count_of(cp.cuda.Device().id)


@functools.cache
def _sm_count_of(device: int) -> int:
    return int(cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMultiProcessorCount, device))


ROW_SPLIT_ENV = "HEARTH_CUDA_SPLIT"
# matvec_qb_split's static shared memory (its warps' shares: 2 x MAX_BATCH x 8 floats) and emit's count,
# beside the dynamic records: a launch whose records leave less than this takes one warp a row
SPLIT_STATIC_SHARED = 1024


def row_split(rows: int, mode: str | None = None) -> int:
    """Warps matvec_qb gives each row of a `rows`-row stack (1, 2, 4 or 8).

    mode (default: HEARTH_CUDA_SPLIT, else "1"): "1" one warp a row; "2", "4" or "8" that many; "auto"
    doubles the warps a row while the rows times them twice over still fit the warps the GPU holds at
    once (MATVEC_BLOCKS_PER_SM blocks of 8 warps an SM). A 1B-class down or attention-output projection
    (2048 rows) then has 2 warps a row on an H200 instead of filling 16 of each SM's 32 warp slots; the
    8192-row gate|up stays at one. Opt-in until timed on a GPU (scripts/cuda_device_check.sh).

    Raises:
        ValueError: an unknown mode (naming the variable).
    """
    mode = (mode if mode is not None else os.environ.get(ROW_SPLIT_ENV, "")).strip().lower() or "1"
    if mode in ("1", "2", "4", "8"):
        return int(mode)
    if mode != "auto":
        raise ValueError(f"{ROW_SPLIT_ENV}={mode!r}: use 1, 2, 4, 8 or auto")
    slots = _sm_count() * MATVEC_BLOCKS_PER_SM * (MATVEC_THREADS // 32)
    split = 1
    while split < 8 and 2 * split * rows <= slots:
        split *= 2
    return split


def max_shared() -> int:
    """The most dynamic shared memory a block may take on the current device, opted in (227 KiB on
    sm_90, 163 KiB on sm_80, 99 KiB on sm_86/sm_89, 64 KiB on sm_75)."""
    return _max_shared_of(cp.cuda.Device().id)


@functools.cache
def _max_shared_of(device: int) -> int:
    attr = cp.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin
    return int(cp.cuda.runtime.deviceGetAttribute(attr, device))


def matvec_shared(w, int_dot: bool = True) -> int:
    """Dynamic shared memory a matvec of w (a GpuWeight, or the Weight it comes from) over one vector
    takes: its activation records (matvec_qb) or its float32 activation (the float kernels)."""
    if int_dot and w.ggml_type in INT_DOT_TYPES:
        return 4 * records_width(w.cols)
    return 4 * w.cols


def allow_shared(k, nbytes: int) -> None:
    """Let kernel k (a RawKernel, from RawModule.get_function) take nbytes of dynamic shared memory
    (above 48 KiB a function must opt in)."""
    if nbytes > 48 * 1024:
        drv = cp.cuda.driver
        drv.funcSetAttribute(k.kernel.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))


_DEPENDENT = [False]  # dependent_launches(): matvec_qb and attn_decode launched programmatically


@contextlib.contextmanager
def dependent_launches(enabled: bool = True):
    """Within: matvec_qb and attn_decode go out as programmatic dependent launches (pdl.launch), which
    may start while the kernel before them finishes; both wait for it (griddepcontrol.wait) before
    touching its data. A decode step's kernels only: every other launch stays fully serialised."""
    was = _DEPENDENT[0]
    _DEPENDENT[0] = enabled
    try:
        yield
    finally:
        _DEPENDENT[0] = was


def _launch(k, grid: tuple, block: tuple, args: tuple, shared: int = 0) -> None:
    """k over grid x block: programmatically dependent inside dependent_launches(), else as CuPy does."""
    if _DEPENDENT[0]:
        pdl.launch(k, grid, block, args, shared, cp.cuda.get_current_stream().ptr)
    else:
        k(grid, block, args, shared_mem=shared)


def _launch_matvec(name: str, grid: int, shared: int, args: tuple, threads: int = MATVEC_THREADS) -> None:
    k = kernel(name, cp.cuda.Device().id)
    allow_shared(k, shared)
    if name in ("matvec_qb", "matvec_qb_split"):
        _launch(k, (grid,), (threads,), args, shared)
    else:
        k((grid,), (threads,), args, shared_mem=shared)


def matvec(
    out: cp.ndarray,
    ws: list[GpuWeight],
    x: cp.ndarray,
    x2: cp.ndarray | None = None,
    norm: cp.ndarray | None = None,
    eps: float = 0.0,
    prologue: int = 0,
    accumulate: bool = False,
    int_dot: bool = True,
    emit: Emit | None = None,
) -> None:
    """out (sum of rows,) (= or +=) [W0; W1; W2] @ act(x), one launch for up to 3 stacked weights.

    Args:
        ws: 1-3 weights of one cols: of one type, or of any INT_DOT_TYPES when int_dot.
        x: float32 (cols,); x2: (cols,) the up half for prologue 2/3; for prologue 4/5 the records
            (uint32, records_width(cols)) an earlier matvec's `emit` wrote.
        norm: (cols,) RMSNorm weight for prologue 1.
        prologue: 0 x, 1 rmsnorm(x) * norm, 2 silu(x) * x2, 3 gelu_tanh(x) * x2, 4 records, 5 records
            of x * (the norm weight) still to take RMSNorm's 1 / RMS (integer-dot weights only),
            6 relu(x)^2 (Nemotron-H's MLP).
        int_dot: weights of INT_DOT_TYPES take integer dot products against the activation quantized
            per 32 to two int8 levels (dp4a, as the fused step and like the CPU kernels' int16); False:
            float dot products of the dequantized weights.
        emit: the outputs also leave as the next matvec's records (Emit; integer-dot weights only).
    """
    cols = ws[0].cols
    if not 1 <= len(ws) <= 3 or any(w.cols != cols for w in ws):
        raise ValueError("matvec stacks 1-3 weights of one width")
    if int_dot and all(w.ggml_type in INT_DOT_TYPES for w in ws):
        _launch_matvec_qb(out, 0, ws, x, x2, 0, norm, eps, prologue, accumulate, 1, emit)
        return
    _check_float_kernel(ws, prologue, emit)
    _launch_float_matvec(out, 0, ws, x, x2, 0, norm, eps, prologue, accumulate, 1)


def _check_float_kernel(ws: list[GpuWeight], prologue: int, emit) -> None:
    if prologue in RECORDS or emit is not None:
        raise ValueError("activation records (prologue 4/5, emit) need integer-dot weights")
    if any(w.ggml_type != ws[0].ggml_type for w in ws):
        raise ValueError("matvec stacks weights of one type (or of INT_DOT_TYPES with int_dot)")


def _launch_float_matvec(out, ldo: int, ws, x, x2, ldx: int, norm, eps, prologue, accumulate, n: int) -> None:
    """matvec_<type> (float dot products: the float, FP8 and NVFP4 kernels, and the block types' without
    int_dot) over n vectors (rows ldo apart in out, ldx apart in x and x2): each row read once for them."""
    t, cols, pad = ws[0].ggml_type, ws[0].cols, 3 - len(ws)
    rows = [w.rows for w in ws] + [0] * pad
    weights = [w.raw for w in ws] + [NULL] * pad
    tail = (
        _i32(cols),
        x,
        NULL if x2 is None else x2,
        NULL if norm is None else norm,
        _f32(eps),
        _i32(prologue),
        _i32(bool(accumulate)),
        _i32(n),
        np.int64(ldx),
        np.int64(ldo),
    )
    grid = max(1, min(-(-sum(rows) // 8), _sm_count() * MATVEC_BLOCKS_PER_SM))
    if t in _FP_TYPES:  # FP8: the row scales of each weight; NVFP4: block scales, then global scales
        weights += [w.scales for w in ws] + [NULL] * pad
        if t == NVFP4:
            weights += [_f32(w.global_scale) for w in ws] + [_f32(0.0)] * pad
    shared = n * matvec_shared(ws[0], int_dot=False)
    # the float/FP8/NVFP4 kernels come in pairs: one vector's (one accumulator a row) and a batch's
    name = "matvec_" + TYPES[t][0] + ("_batch" if n > 1 and t not in BLOCK_TYPES else "")
    _launch_matvec(name, grid, shared, (out, *weights, *map(_i32, rows), *tail))


MAX_BATCH = 8  # activation vectors per matvec launch (step.cu's MAX_BATCH, quant.cu's FMV_MAX_BATCH)


def matvec_batch(
    out: cp.ndarray,
    ws: list[GpuWeight],
    x: cp.ndarray,
    cols_x2: bool = False,
    norm: cp.ndarray | None = None,
    eps: float = 0.0,
    prologue: int = 0,
    accumulate: bool = False,
    emit: Emit | None = None,
    int_dot: bool = True,
) -> None:
    """matvec for B vectors: out[:, :rows] (B, >= rows) (= or +=)
    [W0; W1; W2] @ act(x[b]) for each row b of x (B, cols), or of x (B, 2 cols) = [x | x2] for
    prologue 2/3 (cols_x2), or of the records x (B, records_width(cols)) for prologue 4/5. Both
    row-major with unit column stride. Each weight row is read once for up to MAX_BATCH vectors
    as often as the vectors' inputs fit one block's shared memory (max_shared): matvec_qb's records, 8
    vectors a launch on the H200 up to 11k columns, 6 for Llama-3-8B's 14336 (its down projection); the
    float kernels' float32 inputs (ws of one type that is not of INT_DOT_TYPES, or any without int_dot),
    8 up to 7k columns. emit (integer-dot weights only): as matvec's, its records (B, ...) row b for
    vector b.
    """
    B, cols = out.shape[0], ws[0].cols
    if prologue in (2, 3) and not cols_x2:
        raise ValueError("prologue 2/3 takes x as (B, 2 cols) rows [x | x2]")
    if any(w.cols != cols for w in ws) or not 1 <= len(ws) <= 3:
        raise ValueError("matvec stacks 1-3 weights of one width")
    qb = int_dot and all(w.ggml_type in INT_DOT_TYPES for w in ws)
    if not qb:
        _check_float_kernel(ws, prologue, emit)
    ldo, ldx = out.strides[0] // 4, x.strides[0] // 4
    per = max(1, min(MAX_BATCH, max_shared() // matvec_shared(ws[0], qb)))
    for b0 in range(0, B, per):
        # x2: vector b0's up half; vector b's lies ldx further on per vector, as its x does
        x2 = x[b0, cols:] if cols_x2 else None
        n = min(per, B - b0)
        if not qb:
            _launch_float_matvec(out[b0:], ldo, ws, x[b0:], x2, ldx, norm, eps, prologue, accumulate, n)
            continue
        part = None if emit is None else emit._replace(records=emit.records[b0:])
        _launch_matvec_qb(out[b0:], ldo, ws, x[b0:], x2, ldx, norm, eps, prologue, accumulate, n, part)


XREC = 20  # 32-bit words of a unit's activation record (step.cu)
EMIT_NORM, EMIT_SILU, EMIT_GELU, EMIT_RELU2 = 1, 2, 3, 4
RECORDS = (4, 5)  # the prologues that read records an Emit wrote


class Emit(NamedTuple):
    """A matvec's outputs handed to the next matvec as its activation records (step.cu's emit_records):
    each unit of 32 outputs quantized once, by the block that completes it, instead of in every block
    of the next matvec.

    mode: EMIT_NORM (a residual stream the next matvec RMS-normalises: records of out * norm, read with
    prologue 5), EMIT_SILU / EMIT_GELU (gate|up: the GLU activation, read with prologue 4), EMIT_RELU2
    (one matrix, Nemotron-H's up projection: relu(out)^2, read with prologue 4).
    norm: the next RMSNorm's weight (EMIT_NORM). records: uint32 (B, records_width(units' elements)),
    16-byte aligned rows. counts: int32 zeros, one per output unit (left zeroed)."""

    mode: int
    norm: cp.ndarray | None
    records: cp.ndarray
    counts: cp.ndarray


def records_width(n: int) -> int:
    """uint32 words of the records of an activation of n elements (n a multiple of 32): its units' in
    whole groups of 8 slots (common.cuh's rec_slot permutes the units of a group)."""
    return -(-(n // 32) // 8) * 8 * XREC


def _check_records(r, rows: int, n: int, what: str) -> None:
    """r: `rows` C-contiguous rows of exactly records_width(n) uint32 words (the kernels that write
    records step records_width(n) from one vector's to the next's)."""
    fits = r.ndim == 2 and r.dtype == cp.uint32 and r.shape[0] >= rows and r.flags.c_contiguous
    if n % 32 or not fits or r.shape[1] != records_width(n):
        raise ValueError(f"{what}: {rows} rows of records_width({n}) uint32 words ({n} a multiple of 32)")


def _check_emit(emit: Emit, ws, n: int) -> int:
    """The emitted activation's width (the outputs' units), after checking emit against the weights."""
    if emit.mode == EMIT_NORM:
        if len(ws) != 1 or emit.norm is None:
            raise ValueError("EMIT_NORM takes one weight and the next norm's weight")
        width = ws[0].rows
    elif emit.mode == EMIT_RELU2:
        if len(ws) != 1:
            raise ValueError("EMIT_RELU2 takes one weight")
        width = ws[0].rows
    elif emit.mode in (EMIT_SILU, EMIT_GELU):
        if len(ws) != 2 or ws[0].rows != ws[1].rows:
            raise ValueError("a GLU emit takes [gate; up] of equal rows")
        width = ws[0].rows
    else:
        raise ValueError(f"unknown emit mode {emit.mode}")
    _check_records(emit.records, n, width, "emit's records")
    if emit.counts.size < width // 32:
        raise ValueError("emit's counts hold one int32 per output unit")
    return width


def _row_bytes(w: GpuWeight) -> int:
    """Bytes of one of w's rows of blocks."""
    return w.cols // TYPES[w.ggml_type][1] * TYPES[w.ggml_type][2]


def _launch_matvec_qb(
    out, ldo: int, ws, x, x2, ldx: int, norm, eps, prologue, accumulate, n: int, emit: Emit | None = None
) -> None:
    """matvec_qb over n vectors (rows ldo apart in out, ldx apart in x and x2)."""
    cols, pad = ws[0].cols, 3 - len(ws)
    if prologue in RECORDS and (x.dtype != cp.uint32 or x.shape[-1] < records_width(cols)):
        raise ValueError("prologue 4/5 reads uint32 activation records (records_width(cols) a vector)")
    width = 0 if emit is None else _check_emit(emit, ws, n)
    rows = [w.rows for w in ws] + [0] * pad
    weights = [w.raw for w in ws] + [NULL] * pad
    kinds = [_i32(w.ggml_type) for w in ws] + [_i32(ws[0].ggml_type)] * pad
    row_bytes = [_row_bytes(w) for w in ws] + [0] * pad
    # every block quantizes the whole input, 8 elements a thread at a time: even the down projection's
    # 8192 take a block of 256 threads 4 rounds of independent loads, so its rows spread over as many
    # blocks as the other matrices' (1024-thread blocks, one per SM, left half the H200's SMs idle)
    threads = MATVEC_THREADS
    # the records of the input; with emit the same memory then lists the units the block completes
    shared = max(n * 4 * records_width(cols), 4 * (width // 32))
    split = row_split(sum(rows))
    if shared + SPLIT_STATIC_SHARED > max_shared():  # no room beside the records for the shares
        split = 1
    grid = max(1, min(-(-sum(rows) * split // (threads // 32)), _sm_count() * MATVEC_BLOCKS_PER_SM))
    args = (
        out,
        np.int64(ldo),
        *weights,
        *kinds,
        *map(_i32, rows),
        *map(_i32, row_bytes),
        _i32(cols),
        x,
        NULL if x2 is None else x2,
        np.int64(ldx),
        NULL if norm is None else norm,
        _f32(eps),
        _i32(prologue),
        _i32(bool(accumulate)),
        _i32(n),
        _i32(0 if emit is None else emit.mode),
        NULL if emit is None or emit.norm is None else emit.norm,
        NULL if emit is None else emit.records,
        NULL if emit is None else emit.counts,
        _i32(split),
    )
    _launch_matvec("matvec_qb" if split == 1 else "matvec_qb_split", grid, shared, args, threads)


def dequant(
    out: cp.ndarray,
    w: GpuWeight,
    ids: cp.ndarray | None = None,
    r0: int = 0,
    n: int | None = None,
    scale: float = 1.0,
) -> None:
    """out (n, cols) float32 or float16 = rows ids (int32 (n,)) or r0..r0+n of w, times scale."""
    n = int(ids.shape[0]) if ids is not None else (w.rows - r0 if n is None else n)
    if w.ggml_type in BLOCK_TYPES:
        _launch_dequant_qb(out, [w], ids, r0, n, scale)
        return
    name, _, _ = TYPES[w.ggml_type]
    per = (4 if w.ggml_type == F32 else 8) if w.ggml_type in _FLOAT_TYPES else 32
    items = n * (w.cols // per)
    half = out.dtype == cp.float16
    weight = (w.raw, w.scales) if w.ggml_type in _FP_TYPES else (w.raw,)
    scale *= w.global_scale  # NVFP4's global scale; 1.0 for the others
    rows = (NULL if ids is None else ids, _i32(r0), _i32(n))
    kernel("dequant_" + name, cp.cuda.Device().id)(
        (-(-items // 256),), (256,), (out, *weight, *rows, _i32(w.cols), _i32(half), _f32(scale))
    )


def _launch_dequant_qb(out, ws: list[GpuWeight], ids, r0: int, n: int, scale: float = 1.0) -> None:
    """dequant_qb: out (n, cols) = rows (ids, or r0..r0+n) of 1-3 weights of BLOCK_TYPES stacked."""
    pad = 3 - len(ws)
    weights = [w.raw for w in ws] + [NULL] * pad
    kinds = [_i32(w.ggml_type) for w in ws] + [_i32(ws[0].ggml_type)] * pad
    rows = [_i32(w.rows) for w in ws[:2]] + [_i32(0)] * (2 - len(ws[:2]))
    items = n * (ws[0].cols // 32)
    half = _i32(out.dtype == cp.float16)
    args = (out, *weights, *kinds, *rows, NULL if ids is None else ids, _i32(r0), _i32(n), _i32(ws[0].cols))
    kernel("dequant_qb", cp.cuda.Device().id)((-(-items // 256),), (256,), (*args, half, _f32(scale)))


def _grid1(n: int, threads: int = 256) -> tuple[tuple[int], tuple[int]]:
    return (max(1, -(-n // threads)),), (threads,)


def rmsnorm(
    out, x, w, eps: float, add_one: bool = False, accumulate: bool = False, emit: Emit | None = None,
    center: bool = False, heads: int = 1,
) -> None:
    """out (n, dim) (= or +=) rmsnorm(x (n, dim)) * (w or 1 + w), or with center a LayerNorm without bias
    ((x - mean) / sqrt(var + eps) * w: Cohere's); a float16 out gets the values rounded
    (no accumulate then). emit: an EMIT_NORM Emit (float32 out, dim a multiple of 32): out's rows also
    leave as the records of out * emit.norm for the next matvec (prologue 5), emit.records row i for
    row i (emit.counts unused). x and out may be column slices of wider rows (out may be x: in place).
    heads: each row's `heads` vectors of dim / heads normed apart, each by its part of w (dim,) (Command
    R+'s per-head LayerNorms of q and k)."""
    n, dim = x.shape
    if dim % heads or (heads > 1 and emit is not None):
        raise ValueError("rmsnorm: rows of `heads` equal vectors, with no records emitted")
    half = out.dtype == cp.float16
    if out.shape != x.shape or x.strides[1] != 4 or out.strides[1] != out.itemsize:
        raise ValueError("rmsnorm takes float32 x and an out of its shape, rows contiguous")
    if half and accumulate:
        raise ValueError("rmsnorm accumulates into float32 only")
    if emit is not None:
        if emit.mode != EMIT_NORM or emit.norm is None or half:
            raise ValueError("rmsnorm emits EMIT_NORM records of a float32 out")
        _check_records(emit.records, n, dim, "rmsnorm's records")
    tail = (NULL, NULL) if emit is None else (emit.norm, emit.records)
    tail += (np.int64(x.strides[0] // 4), np.int64(out.strides[0] // out.itemsize), _i32(center), _i32(heads))
    kernel("rmsnorm", cp.cuda.Device().id)(
        (n * heads,), (256,),
        (out, x, w, _i32(dim // heads), _f32(eps), _i32(add_one), _i32(accumulate), _i32(half), *tail),
    )


def rope_store(
    qg,
    qkv,
    H: int,
    k_cache,
    v_cache,
    pos,
    inv_freq,
    n_rot: int,
    neox: bool,
    eps: float = 0.0,
    q_norm=None,
    k_norm=None,
    mscale: float = 1.0,
    temperature: tuple = (0.0, 1),
    gated: bool = False,
) -> None:
    """Prefill: RoPE the q part of qkv (n, (H + 2 KV) hd), rows [q (H, hd) | k (KV, hd) | v (KV, hd)],
    into qg (KV, n * rep, hd) float32, grouped by KV head and token-major (attention_prefill's input),
    and write rotated k and v into one layer's caches (KV, n_ctx, hd) at positions pos[0]..; per-head
    q/k RMSNorm first when q_norm/k_norm are given. mscale: the rotated dims of q and k times it after
    RoPE (Phi-4-mini's attention factor); temperature (beta, length): each query times
    1 + beta log(1 + floor(position / length)) (Ministral 3; beta 0: none). gated: qkv's q part holds per
    head its query then its output gate (H, 2, hd) (Qwen3.5; gate_heads applies them)."""
    KV, n_ctx, hd = k_cache.shape
    n = qkv.size // (((2 if gated else 1) * H + 2 * KV) * hd)
    threads = max(32, min(256, -(-hd // 2 // 32) * 32))
    kernel("rope_store", cp.cuda.Device().id)(
        (H + KV, n),
        (threads,),
        (
            qg,
            qkv,
            k_cache,
            v_cache,
            pos,
            inv_freq,
            NULL if q_norm is None else q_norm,
            NULL if k_norm is None else k_norm,
            _i32(H),
            _i32(KV),
            _i32(hd),
            _i32(n_rot),
            _i32(neox),
            _i32(n_ctx),
            _f32(eps),
            _i32(k_cache.dtype == cp.float16),
            _i32(qg.dtype == cp.float16),
            *_rope_scales(mscale, temperature),
            _i32(gated),
        ),
    )


def gate_heads(attn, qkv, H: int, hd: int) -> None:
    """attn (n, H hd) float32 or float16 *= sigmoid of each head's output gate in the gated q part of the
    q|k|v rows qkv (n, .) float32 (rope_store's gated layout; Qwen3.5's prefill)."""
    n = attn.shape[0]
    args = (attn, qkv, np.int64(qkv.strides[0] // 4), _i32(H), _i32(hd), np.int64(n),
            _i32(attn.dtype == cp.float16))
    blocks = max(1, min(-(-(n * H * hd) // 256), 65535))
    kernel("gate_heads", cp.cuda.Device().id)((blocks,), (256,), args)


NO_ROPE_SCALES = (1.0, (0.0, 1))  # rope_store's mscale and temperature where a model has neither


def _rope_scales(mscale: float, temperature: tuple) -> tuple:
    """The kernels' (mscale, beta, length) arguments."""
    beta, length = temperature
    if beta and length < 1:
        raise ValueError(f"the attention temperature needs a length >= 1, got {length}")
    return _f32(mscale), _f32(beta), _i32(max(1, int(length)))


def attention(
    out,
    qkv,
    H: int,
    k_cache,
    v_cache,
    pos,
    rope: tuple,
    scale: float,
    n_keys_max: int,
    window: int = 0,
    parts: tuple | None = None,
    records: cp.ndarray | None = None,
    softcap: float = 0.0,
    sinks: cp.ndarray | None = None,
    gated: bool = False,
) -> None:
    """Decode attention of one token, one launch (attn_decode): out (H * hd,) float32 = attention of the
    query in qkv ((H + 2 KV) hd,) rows [q | k | v] at position pos[0] (device int32) over one layer's
    caches (KV, n_ctx, hd), whose position pos[0] gets the token's key and value: RoPE (and the
    per-head q/k RMSNorm) as rope_store, split-K over the keys, the partials combined by the last
    block of each head.

    rope: (inv_freq, n_rot, neox, eps, q_norm, k_norm), optionally followed by rope_store's mscale and
    temperature (both for the query, mscale for the new key too). n_keys_max: an upper bound on the positions
    seen (sets the number of splits; a captured decode step passes the cache size). parts: optional
    preallocated (acc (H*S*hd,) float32, ml (H*S*2,) float32, count (H,) uint32 zeros) from
    attention_parts; the kernel leaves count zeroed for the next call. records: uint32
    (records_width(H * hd),): out's activation records too, for the output projection's matvec
    (prologue 4; hd a multiple of 32). softcap > 0: scores softcap * tanh(scale q.k / softcap) (Gemma 2).
    sinks: float32 (H,) attention-sink logits (gpt-oss), each joining its head's softmax (None: none).
    gated: qkv's q part as rope_store's gated one; each head's output times sigmoid of its gate (Qwen3.5).
    """
    if records is not None:
        records = records.reshape(1, -1)
    _attn_decode(out, qkv, H, k_cache, v_cache, pos, rope, scale, n_keys_max, window, parts, records,
                 softcap=softcap, sinks=sinks, gated=gated)


def attention_batch(
    out, qkv, H: int, caches: list[tuple], table, pos, rope: tuple, scale: float, n_keys_max: int,
    window: int = 0, parts: tuple | None = None, records: cp.ndarray | None = None, softcap: float = 0.0,
    sinks: cp.ndarray | None = None, gated: bool = False,
) -> None:
    """attention for B sequences in one launch: out (B, H * hd) row b = attention of qkv's row b at
    position pos[b] over caches[b] = (k_cache, v_cache) of one layer (one dtype and head layout, any
    n_ctx), whose device table (B, 3) uint64 holds (k pointer, v pointer, n_ctx) per sequence (kept by
    the caller: a captured step's launch holds its address). n_keys_max: at least every cache's size.
    parts: attention_parts(H, hd, n_keys_max, B). records: (B, records_width(H * hd)) or None. softcap,
    sinks, gated: as attention's."""
    k0 = caches[0][0]
    B = len(caches)
    for k, v in caches:
        same = k.dtype == v.dtype == k0.dtype and (k.shape[0], k.shape[2]) == (k0.shape[0], k0.shape[2])
        if not same:
            raise ValueError("attention_batch takes caches of one dtype and head layout")
        if k.shape[1] > n_keys_max:
            raise ValueError(f"attention_batch: a cache of {k.shape[1]} positions, n_keys_max {n_keys_max}")
    if table.dtype != cp.uint64 or table.shape != (B, 3) or out.shape[0] != B or qkv.shape[0] != B:
        raise ValueError("attention_batch: table (B, 3) uint64 and B rows of out and qkv")
    batch = (table, np.int64(out.strides[0] // 4), np.int64(qkv.strides[0] // 4))
    _attn_decode(out, qkv, H, k0, caches[0][1], pos, rope, scale, n_keys_max, window, parts, records, batch,
                 softcap, sinks, gated)


def _attn_decode(
    out, qkv, H, k_cache, v_cache, pos, rope, scale, n_keys_max, window, parts, records, batch=None,
    softcap: float = 0.0, sinks=None, gated: bool = False,
) -> None:
    """attn_decode over one sequence (batch None) or batch = (table, ldo, ldq) (grid z: the sequences)."""
    KV, n_ctx, hd = k_cache.shape
    B = 1 if batch is None else batch[0].shape[0]
    if records is not None:
        if hd % 32:  # each unit of 32 must lie in one head (its block writes it)
            raise ValueError(f"attention's records need a head size that is a multiple of 32, not {hd}")
        _check_records(records, B, H * hd, "attention's records")
    chunk, S = attention_splits(n_keys_max)
    acc, ml, count = parts if parts is not None else attention_parts(H, hd, n_keys_max, B)
    if count.size < B * H:
        raise ValueError(f"attention's parts hold {count.size // H} sequences, not {B}")
    inv_freq, n_rot, neox, eps, q_norm, k_norm, *scales = rope
    _check_sinks(sinks, H)
    tail = (NULL, np.int64(0), np.int64(0)) if batch is None else batch
    _launch(
        kernel("attn_decode", cp.cuda.Device().id),
        (H, S, B),
        (128,),
        (
            out,
            acc,
            ml,
            count,
            qkv,
            k_cache,
            v_cache,
            pos,
            inv_freq,
            NULL if q_norm is None else q_norm,
            NULL if k_norm is None else k_norm,
            _i32(H),
            _i32(KV),
            _i32(hd),
            _i32(n_ctx),
            _i32(n_rot),
            _i32(neox),
            _f32(eps),
            _f32(scale),
            _i32(window),
            _i32(chunk),
            _i32(k_cache.dtype == cp.float16),
            NULL if records is None else records,
            *tail,
            _f32(softcap),
            NULL if sinks is None else sinks,
            *_rope_scales(*(scales or NO_ROPE_SCALES)),
            _i32(gated),
        ),
    )


def _check_sinks(sinks, H: int) -> None:
    if sinks is not None and (sinks.dtype != cp.float32 or sinks.shape != (H,)):
        raise ValueError(f"attention: sinks must be float32 ({H},), got {sinks.dtype} {sinks.shape}")


def attention_splits(n_keys_max: int) -> tuple[int, int]:
    """(keys per split, splits) of decode attention over up to n_keys_max positions: splits small enough
    that a short prompt still spreads over many blocks, large enough that a long cache needs at most
    ATTN_SPLITS of them."""
    chunk = min(ATTN_MAX_CHUNK, max(ATTN_MIN_CHUNK, -(-n_keys_max // ATTN_SPLITS)))
    return chunk, max(1, -(-n_keys_max // chunk))


def attention_parts(H: int, hd: int, n_keys_max: int, batch: int = 1) -> tuple:
    """attention's scratch for up to n_keys_max positions (attention_batch's: for `batch` sequences): split
    partials and per-head counters."""
    S = attention_splits(n_keys_max)[1]
    n = batch * H * S
    return cp.empty(n * hd, cp.float32), cp.empty(n * 2, cp.float32), cp.zeros(batch * H, cp.uint32)


FLASH_HEAD_DIMS = (64, 128)  # flash.cu's instantiations
FLASH_ROWS = 64  # grouped query rows a block of flash_prefill takes


def flash_enabled() -> bool:
    """Prefill attention in one flash kernel (flash.cu) where it applies: HEARTH_CUDA_FLASH=1 (opt-in
    until it has been timed on a GPU; `scripts/cuda_bench_1b.py` measures both)."""
    return os.environ.get("HEARTH_CUDA_FLASH", "").strip() == "1"


def flash_applies(kv_dtype, hd: int) -> bool:
    """Whether flash_prefill can take a layer: a float16 cache, head size 64 or 128, sm_80+."""
    if np.dtype(kv_dtype) != np.float16 or hd not in FLASH_HEAD_DIMS:
        return False
    return int(cp.cuda.Device().compute_capability) >= 80


def flash_check(H: int, KV: int, hd: int) -> str | None:
    """None when attention_prefill_flash gives the cuBLAS path's result for H query and KV key heads of
    size hd on random float16 inputs (a prompt after cached tokens, rows past a block's end); else what
    went wrong. A decoder runs it once before it takes the kernel (outside any capture)."""
    rep, n, pos0 = H // KV, 70, 13
    rng = np.random.default_rng(0)
    k, v, q = (
        cp.asarray(rng.standard_normal(shape).astype(np.float16))
        for shape in ((KV, n + pos0, hd), (KV, n + pos0, hd), (KV, n * rep, hd))
    )
    want, got = cp.zeros((n, H, hd), cp.float32), cp.zeros((n, H, hd), cp.float32)
    attention_prefill(want, q, k, v, pos0, hd**-0.5)
    try:
        attention_prefill_flash(got, q, k, v, pos0, hd**-0.5)
        a, b = cp.asnumpy(want), cp.asnumpy(got)
    except Exception as e:  # noqa: BLE001 - any failure keeps the cuBLAS path, with the reason
        return f"{type(e).__name__}: {e}"
    err = float(np.abs(a - b).max() / (np.abs(a).max() or 1.0))
    return None if err < 2e-2 else f"flash prefill attention differs from the cuBLAS path's by {err:.3g}"


def attention_prefill_flash(out, qg, k_cache, v_cache, pos0: int, scale: float, window: int = 0) -> None:
    """attention_prefill's result in one launch (flash.cu: scores and probabilities stay in registers,
    mma.sync on tensor cores): out (n, H, hd) float32 or float16, qg (KV, n * rep, hd) float16, caches
    (KV, n_ctx, hd) float16, hd in FLASH_HEAD_DIMS."""
    n, H, hd = out.shape
    KV, n_ctx, _ = k_cache.shape
    if hd not in FLASH_HEAD_DIMS or k_cache.dtype != cp.float16 or qg.dtype != cp.float16:
        raise ValueError(f"flash prefill takes float16 queries and caches of head size 64 or 128, not {hd}")
    rep = H // KV
    grid = (-(-n * rep // FLASH_ROWS), KV)
    args = (out, qg, k_cache, v_cache, _i32(n), _i32(rep), _i32(H), _i32(n_ctx), _i32(pos0), _f32(scale))
    args += (_i32(window), _i32(out.dtype == cp.float16))
    kernel(f"flash_prefill_{hd}", cp.cuda.Device().id)(grid, (128,), args)


def attention_prefill(
    out, qg, k_cache, v_cache, pos0: int, scale: float, window: int = 0, flash: bool = False,
    softcap: float = 0.0, sinks=None,
) -> None:
    """out (n, H, hd) float32 or float16 (the output projection's GEMM input) = causal attention of the
    queries qg (KV, n * rep, hd), grouped as rope_store writes them (query head g * rep + r of token t
    in row t * rep + r of qg[g], so a chunk of queries is a block of rows), query t at position pos0 + t,
    over one layer's caches (KV, n_ctx, hd) holding keys 0..pos0+n-1: the scores and the weighted sum as
    strided-batched cuBLAS GEMMs over KV heads, straight on the caches, the masked softmax in between.
    Float16 caches take float16 queries and the softmax writes float16 probabilities (tensor-core GEMMs,
    float32 scores and sums); float32 caches, float32 throughout (exact checks).

    KV heads go in batches and queries in chunks so that the scores (and their float16 probabilities)
    stay under ATTN_GEMM_BYTES (beyond one query per batch, which always runs). flash: where
    flash_applies, attention_prefill_flash instead (one launch, no scores in memory; not with softcap or
    sinks, which the softmax applies as attention's).
    """
    n, H = out.shape[0], out.shape[1]
    KV, n_ctx, hd = k_cache.shape
    _check_sinks(sinks, H)
    if flash and flash_applies(k_cache.dtype, hd) and not softcap and sinks is None:
        attention_prefill_flash(out, qg, k_cache, v_cache, pos0, scale, window)
        return
    rep, T = H // KV, pos0 + n
    half = k_cache.dtype == cp.float16
    if qg.dtype != k_cache.dtype:
        raise ValueError(f"attention_prefill: queries {qg.dtype} against a {k_cache.dtype} cache")
    og = cp.empty((KV, n * rep, hd), cp.float32)
    per_score = 6 if half else 4  # float32 score (+ float16 probability)
    gb = max(1, min(KV, ATTN_GEMM_BYTES // (per_score * rep * T)))
    dev = cp.cuda.Device().id
    softmax = kernel("softmax_causal", dev)
    for g0 in range(0, KV, gb):
        g1 = min(KV, g0 + gb)
        k, v = k_cache[g0:g1, :T], v_cache[g0:g1, :T]
        nc = max(1, min(n, ATTN_GEMM_BYTES // (per_score * (g1 - g0) * rep * T)))
        for c0 in range(0, n, nc):
            c1 = min(n, c0 + nc)
            # only the keys some query of the chunk sees: up to its last position, from its first's window
            k0, k1 = (max(0, pos0 + c0 - window + 1) if window > 0 else 0), pos0 + c1
            rows = slice(c0 * rep, c1 * rep)
            scores = cp.empty((g1 - g0, (c1 - c0) * rep, k1 - k0), cp.float32)
            gemm_batched(scores, qg[g0:g1, rows], k[:, k0:k1], trans_b=True)
            probs = cp.empty(scores.shape, cp.float16) if half else scores
            keys = (_i32(k1 - k0), _i32(c1 - c0), _i32(rep), _i32(pos0 + c0), _i32(k0))
            p16 = probs if half else NULL
            sink = NULL if sinks is None else sinks[g0 * rep :]  # from the batch's first KV head's heads
            args = (scores, p16, *keys, _f32(scale), _i32(window), _f32(softcap), sink)
            softmax((scores.size // (k1 - k0),), (256,), args)
            gemm_batched(og[g0:g1, rows], probs, v[:, k0:k1])
    heads = (_i32(n), _i32(H), _i32(KV), _i32(hd), _i32(out.dtype == cp.float16))
    grid = (-(-(H * hd) // 256), max(1, min(n, GRID_Y_MAX)))  # a token's elements, tokens grid-strided
    kernel("ungroup_heads", dev)(grid, (256,), (out, og, *heads))


GLU_SILU, GLU_GELU, GLU_OAI, RELU2 = 0, 1, 2, 3  # glu's modes (RELU2: not gated)


def glu(out, gu, mode: int, bias=None, ids=None, oai: tuple = (0.0, 0.0)) -> None:
    """out (n, ff) = silu(gate) * up (GLU_SILU, SwiGLU), gelu_tanh(gate) * up (GLU_GELU, GeGLU) or gpt-oss's
    clamped SwiGLU (GLU_OAI, oai = (alpha, limit): engine.backends.cpu.swiglu_oai_mul) of gu (n, 2 ff)
    float32, each row [gate | up], or relu(gu)^2 of gu (n, ff) (RELU2: Nemotron-H's MLP, no bias); out
    float32 or float16. bias: float32 [gate | up] bias rows (., 2 ff)
    added first, row ids[t] (int32 (n,) on the GPU) for row t, or bias's one row for all rows (ids None)."""
    ff = out.shape[-1]
    n = out.size // ff
    half = _i32(out.dtype == cp.float16)
    if gu.size != (1 if mode == RELU2 else 2) * n * ff:
        raise ValueError(f"glu: gu holds {'ff' if mode == RELU2 else '2 ff'} floats a row of out")
    if bias is not None and mode == RELU2:
        raise ValueError("glu: RELU2 takes no bias")
    if bias is not None and (bias.dtype != cp.float32 or bias.shape[-1] != 2 * ff):
        raise ValueError(f"glu: bias rows must be float32 of {2 * ff}, got {bias.dtype} {bias.shape}")
    grid = (-(-ff // (4 * 256)), max(1, min(n, GRID_Y_MAX)))  # 4 elements a thread; tokens grid-strided
    args = (out, gu, _i32(ff), np.int64(n), _i32(mode), half, NULL if bias is None else bias,
            NULL if ids is None else ids, _f32(oai[0]), _f32(oai[1]))
    kernel("glu", cp.cuda.Device().id)(grid, (256,), args)


def add_inplace(x, y, scale: float = 1.0) -> None:
    """x += scale * y, y (m,) repeated over x (.., m) (a bias added to every row), or y of x's shape."""
    args = (x, y, np.int64(x.size), np.int64(y.size), _f32(scale))
    kernel("add_inplace", cp.cuda.Device().id)(*_grid1(x.size), args)


def convert(out, x) -> None:
    """out = x (float32, contiguous) in out's dtype, float32 or float16, of x's size."""
    if out.size != x.size or out.dtype not in (cp.float32, cp.float16) or x.dtype != cp.float32:
        raise ValueError("convert takes float32 x and a float32 or float16 out of its size")
    half = _i32(out.dtype == cp.float16)
    kernel("convert", cp.cuda.Device().id)(*_grid1(x.size), (out, x, np.int64(x.size), half))


def softcap(x, cap: float) -> None:
    kernel("softcap", cp.cuda.Device().id)(*_grid1(x.size), (x, _f32(cap), np.int64(x.size)))


def penalize(x, ids, penalty: float) -> None:
    """The repetition penalty on logits x float32 (vocab,) in place: x[i] / penalty where positive,
    x[i] * penalty where not, for the distinct token ids (int32 on the GPU)."""
    if ids.size:
        kernel("penalize", cp.cuda.Device().id)(*_grid1(ids.size), (x, ids, _i32(ids.size), _f32(penalty)))


def bump(pos, by: int = 1) -> None:
    kernel("bump", cp.cuda.Device().id)((1,), (32,), (pos, _i32(by)))


ARGMAX_BLOCKS = 64


def argmax_parts() -> tuple:
    """argmax's scratch: each block's best value and index, and the blocks' counter (zeros)."""
    return cp.empty(ARGMAX_BLOCKS, cp.float32), cp.empty(ARGMAX_BLOCKS, cp.int32), cp.zeros(1, cp.uint32)


def argmax(token, x, parts: tuple | None = None) -> None:
    """token int32 (1,) = argmax of x float32 (n,) (first index on ties, as numpy), over ARGMAX_BLOCKS
    blocks. parts: optional preallocated argmax_parts() (a captured step keeps its own); the kernel
    leaves the counter zeroed for the next call."""
    pv, pi, count = parts if parts is not None else argmax_parts()
    blocks = max(1, min(ARGMAX_BLOCKS, -(-x.size // 256)))
    kernel("argmax", cp.cuda.Device().id)((blocks,), (256,), (token, x, _i32(x.size), pv, pi, count))


SAMPLE_MAX_K = 256  # ops.cu's SAMPLE_MAX_K: the widest top-k, and the candidates with top-k off
SAMPLE_BLOCKS = 64
SAMPLE_CANDIDATES = 4096  # blocks x k at most: the last block holds them in 32 KiB of shared memory


def sample_parts(draws: int = 1) -> tuple:
    """sample_topk's scratch (sample_rows': for up to `draws` draws at once): each block's candidates
    (values, indices), each block's softmax max and sum (top-k off), and the blocks' counter (zeros)."""
    m = draws * SAMPLE_BLOCKS * SAMPLE_MAX_K
    pm = cp.empty(2 * draws * SAMPLE_BLOCKS, cp.float32)
    return cp.empty(m, cp.float32), cp.empty(m, cp.int32), pm, cp.zeros(draws, cp.uint32)


def _sample_blocks(n: int, width: int) -> int:
    return max(1, min(SAMPLE_BLOCKS, SAMPLE_CANDIDATES // width, -(-n // width)))


def sample_topk(
    token, x, k: int, temp: float, top_p: float, u: float, min_p: float = 0.0, parts: tuple | None = None
) -> None:
    """token int32 (1,) = the token engine.sampling.draw picks from x float32 (n,) with the uniform u in
    [0, 1): softmax at temp (> 0; temp 0 is argmax) of the k most likely (k = 0: top-k off), top_p,
    min_p. One launch: blocks take chunks of x, the last one merges their candidates and draws.
    0 <= k <= SAMPLE_MAX_K. With k = 0 the SAMPLE_MAX_K most likely are the candidates: token is -1
    when the cuts, or with none the draw, reach past them (then draw on the host with the same u).
    parts: optional preallocated sample_parts(); the kernel leaves the counter zeroed."""
    if not 0 <= k <= SAMPLE_MAX_K:
        raise ValueError(f"GPU sampling takes top_k 0 (off) or 1..{SAMPLE_MAX_K}, not {k}")
    if temp <= 0:
        raise ValueError("GPU sampling needs a temperature > 0 (0 is argmax)")
    k = min(int(k), x.size)
    pv, pi, pm, count = parts if parts is not None else sample_parts()
    width = k or SAMPLE_MAX_K
    blocks = _sample_blocks(x.size, width)
    args = (token, x, _i32(x.size), _i32(k), _f32(temp), _f32(top_p), _f32(min_p), _f32(u), pv, pi, pm, count)
    args += (NULL, np.int64(0))
    kernel("sample_topk", cp.cuda.Device().id)((blocks,), (256,), args, shared_mem=8 * blocks * width)


def sample_rows(
    tokens, x, rows: list[int], picks: list[tuple], parts: tuple | None = None, n: int | None = None
) -> None:
    """tokens int32 (len(rows),): draw i from the first n (None: all) logits of row rows[i] of x float32
    (B, width), C-contiguous, with picks[i] = (temp, top_k, top_p, min_p, u), as sample_topk draws, all in
    one launch (and one small upload of the draws' parameters). temp 0 is argmax (top-1: the first index
    on ties). parts: optional sample_parts(d) with d >= len(rows)."""
    if not rows:
        return
    n = x.shape[1] if n is None else int(n)
    if not x.flags.c_contiguous or not 0 < n <= x.shape[1]:
        raise ValueError("sample_rows draws from the first n logits of the rows of a C-contiguous matrix")
    prm = np.empty((len(rows), 6), np.float32)
    for i, (row, (temp, k, top_p, min_p, u)) in enumerate(zip(rows, picks)):
        if not 0 <= k <= SAMPLE_MAX_K:
            raise ValueError(f"GPU sampling takes top_k 0 (off) or 1..{SAMPLE_MAX_K}, not {k}")
        k = 1 if temp <= 0 else min(int(k), n)  # argmax: the single best, drawn at temperature 1
        prm[i] = (temp if temp > 0 else 1.0, top_p, min_p, u, k, row)
    pv, pi, pm, count = parts if parts is not None else sample_parts(len(rows))
    if count.size < len(rows):
        raise ValueError(f"sample_parts for {count.size} draws, not {len(rows)}")
    width = int(max(k or SAMPLE_MAX_K for k in prm[:, 4]))
    blocks = _sample_blocks(n, width)
    unused = (_i32(0), _f32(1.0), _f32(1.0), _f32(0.0), _f32(0.0))  # each draw's own come from prm
    args = (tokens, x, _i32(n), *unused, pv, pi, pm, count, cp.asarray(prm), np.int64(x.shape[1]))
    launch = kernel("sample_topk", cp.cuda.Device().id)
    launch((blocks, len(rows)), (256,), args, shared_mem=8 * blocks * width)


def linear_prefill(out, ws: list[GpuWeight], x16, scratch, accumulate: bool = False) -> None:
    """out (n, R) float32 (=, or += when accumulate) x16 (n, cols) @ W.T, W the rows of ws (one cols)
    stacked, R rows in all: tiles of W dequantized into scratch (float16 or float32, >= cols elements)
    and multiplied by cuBLAS, one GEMM per tile; x16 has scratch's dtype.

    A tile may span several weights (q|k|v, gate|up), so stacked projections cost one GEMM, and one
    dequantization launch when they are 1-3 weights of BLOCK_TYPES (any mix of them)."""
    cols = _stack_cols(ws)
    total = sum(w.rows for w in ws)
    tile_rows = min(total, scratch.size // cols)
    for r0 in range(0, total, tile_rows):
        r1 = min(r0 + tile_rows, total)
        tile = scratch[: (r1 - r0) * cols].reshape(r1 - r0, cols)
        dequant_stack(tile, ws, r0)
        gemm_nt(out[:, r0:r1], x16, tile, accumulate)


def _stack_cols(ws: list[GpuWeight]) -> int:
    cols = ws[0].cols
    if any(w.cols != cols for w in ws):
        raise ValueError("stacked weights must have the same number of columns")
    return cols


def dequant_stack(out, ws: list[GpuWeight], r0: int = 0) -> None:
    """out (n, cols) float16 or float32 = rows r0..r0+n of the weights ws stacked (one cols): one launch
    when they are 1-3 weights of BLOCK_TYPES (any mix of them), else a launch for each weight's part."""
    n, cols = out.shape
    if cols != _stack_cols(ws):
        raise ValueError(f"out has {cols} columns for weights of {ws[0].cols}")
    if len(ws) <= 3 and all(w.ggml_type in BLOCK_TYPES for w in ws):  # whichever weights the rows fall in
        _launch_dequant_qb(out, ws, None, r0, n)
        return
    s0 = 0
    for w in ws:
        lo, hi = max(r0, s0), min(r0 + n, s0 + w.rows)  # the part of w in out
        if lo < hi:
            dequant(out[lo - r0 : hi - r0], w, r0=int(lo - s0), n=int(hi - lo))
        s0 += w.rows


def direct_matrix(w: GpuWeight, dtype):
    """w's rows as a (rows, cols) matrix of dtype that GEMMs can read in place (a float16 weight for
    float16 GEMMs, a float32 one for float32), or None when w has to be dequantized first."""
    if (w.ggml_type, np.dtype(dtype)) in ((F16, np.dtype(np.float16)), (F32, np.dtype(np.float32))):
        return w.raw.view(dtype).reshape(w.rows, w.cols)
    return None


# cuBLAS enums (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_R_32F, _R_16F = 0, 2
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_POINTER_MODE_HOST = 0
_gemm_ex_failed: list[str] = []  # the first cublasGemmEx error: later calls use cp.matmul


_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # host alpha / beta


def _blas() -> tuple:
    """(cuBLAS calls, capturing): CuPy's wrappers, or while the current stream is being captured into a
    graph (a captured prefill), capture_blas's, which CuPy's refuse to be."""
    stream = cp.cuda.get_current_stream()
    if stream.is_capturing():
        return capture_blas.api(lambda: cp.cuda.get_current_stream().ptr), True
    return cp.cuda.cublas, False


def gemm_nt(c, a, b, accumulate: bool = False) -> None:
    """c (n, m) float32 (=, or += when accumulate) a (n, k) @ b (m, k).T, a and b float16 or float32 of
    one dtype, c a row-major view with unit column stride (a column slice of a wider array is fine).

    One cublasGemmEx writing float32 straight into c (float32 accumulation, tensor cores for halves):
    no float16 product and no copy. Should the call be refused, cp.matmul does it from then on.
    """
    n, k = a.shape
    m = b.shape[0]
    if not _gemm_ex_failed and a.flags.c_contiguous and b.flags.c_contiguous and c.strides[1] == 4:
        cublas, capturing = _blas()
        handle = cp.cuda.device.get_cublas_handle()
        dtype = _R_16F if a.dtype == cp.float16 else _R_32F
        beta = _ONE if accumulate else _ZERO
        # column-major view: c.T (m, n) = b (m, k) @ a.T (k, n); b and a are their own transposes there
        try:
            cublas.setPointerMode(handle, _POINTER_MODE_HOST)
            cublas.gemmEx(
                handle, _OP_T, _OP_N, m, n, k, _ONE.ctypes.data, b.data.ptr, dtype, k, a.data.ptr, dtype, k,
                beta.ctypes.data, c.data.ptr, _R_32F, c.strides[0] // 4, _COMPUTE_32F, _GEMM_DEFAULT,
            )
            return
        except Exception as e:  # noqa: BLE001 - a cuBLAS that refuses the call: the plain product works
            if capturing:  # the capture fails, not cuBLAS: the eager path keeps gemmEx
                raise
            _gemm_ex_failed.append(f"{type(e).__name__}: {e}")
    if accumulate:
        c += cp.matmul(a, b.T)
    else:
        c[...] = cp.matmul(a, b.T)


def _rows_unit(a) -> bool:
    """A (B, rows, cols) float32 or float16 view cuBLAS can take as strided batches: unit column
    stride, row and batch strides in elements."""
    size = a.dtype.itemsize
    return a.strides[2] == size and a.strides[1] % size == 0 and a.strides[0] % size == 0


def gemm_batched(c, a, b, trans_b: bool = False) -> None:
    """c (B, m, n) float32 = a (B, m, k) @ (b (B, n, k).T if trans_b else b (B, k, n)), a and b float32
    (cublasSgemmStridedBatched) or float16 (cublasGemmStridedBatchedEx: tensor cores, float32
    accumulation), views with unit column strides and any row and batch strides; cp.matmul should cuBLAS
    refuse."""
    B, m, k = a.shape
    n = b.shape[1] if trans_b else b.shape[2]
    if not _gemm_ex_failed and all(_rows_unit(x) for x in (a, b, c)):
        cublas, capturing = _blas()
        handle = cp.cuda.device.get_cublas_handle()
        # column-major: c.T (n, m) = op(b.T) @ a.T, each row-major matrix read as its own transpose
        ld = [(x.strides[1] // x.dtype.itemsize, x.strides[0] // x.dtype.itemsize) for x in (b, a, c)]
        op_b = _OP_T if trans_b else _OP_N
        try:
            cublas.setPointerMode(handle, _POINTER_MODE_HOST)
            if a.dtype == cp.float16:
                cublas.gemmStridedBatchedEx(
                    handle, op_b, _OP_N, n, m, k, _ONE.ctypes.data,
                    b.data.ptr, _R_16F, *ld[0], a.data.ptr, _R_16F, *ld[1], _ZERO.ctypes.data,
                    c.data.ptr, _R_32F, *ld[2], B, _COMPUTE_32F, _GEMM_DEFAULT,
                )
            else:
                cublas.sgemmStridedBatched(
                    handle, op_b, _OP_N, n, m, k, _ONE.ctypes.data,
                    b.data.ptr, *ld[0], a.data.ptr, *ld[1], _ZERO.ctypes.data, c.data.ptr, *ld[2], B,
                )
            return
        except Exception as e:  # noqa: BLE001 - a cuBLAS that refuses the call: the plain product works
            if capturing:
                raise
            _gemm_ex_failed.append(f"{type(e).__name__}: {e}")
    c[...] = cp.matmul(a, b.transpose(0, 2, 1) if trans_b else b)


# ---- mixture-of-experts -------------------------------------------------------------------------
MOE_MAX_EXPERTS = 512  # ops.cu's MOE_MAX_EXPERTS: moe_route holds 16 router logits a lane


@dataclass(frozen=True)
class GpuExperts:
    """A layer's experts on the GPU: the merged gate, up and down tensors (experts * rows, cols) of
    BLOCK_TYPES, each expert a block of consecutive rows (ff for gate and up, hidden for down)."""

    gate: GpuWeight
    up: GpuWeight
    down: GpuWeight
    n_experts: int
    ff: int

    def rows_of(self, w: GpuWeight) -> int:
        """Rows an expert has in the merged tensor w."""
        return w.rows // self.n_experts

    def expert(self, which: str, e: int) -> GpuWeight:
        """Expert e's gate, up or down matrix as a GpuWeight view (rows ff, ff, hidden)."""
        w = getattr(self, which)
        rows = self.rows_of(w)
        return GpuWeight(w.ggml_type, w.raw[e * rows : (e + 1) * rows], rows, w.cols)

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


def moe_route(ids, wts, logits, k: int, sigmoid: bool, normalize: bool, scale: float, bias=None) -> None:
    """ids (n, k) int32, wts (n, k) float32 = the k experts each of n tokens is routed to and their weights,
    from router logits (n, E) float32 (moe.route's rules: softmax or sigmoid gating, `bias` (E,) added for
    the choice only, `normalize` over the chosen, times `scale`)."""
    n, E = logits.shape
    if E > MOE_MAX_EXPERTS or not 1 <= k <= min(E, 32):
        raise ValueError(f"moe_route takes up to {MOE_MAX_EXPERTS} experts and 1..32 of them a token")
    grid = (max(1, min(n, GRID_Y_MAX)),)
    args = (ids, wts, logits, NULL if bias is None else bias, _i32(n), _i32(E), _i32(k), _i32(sigmoid),
            _i32(normalize), _f32(scale))
    kernel("moe_route", cp.cuda.Device().id)(grid, (32,), args)


def matvec_experts(out, experts: GpuExperts, which: str, x, ids, group: int, norm=None, eps: float = 0.0,
                   prologue: int = 0) -> None:
    """For each slot s of ids (S,) int32 (B tokens x k experts, on the GPU): out[s] (S, R) = expert
    ids[s]'s `which` matrices ("gate_up": its gate then up rows, R = 2 ff; "down": R = hidden) @
    act(x[s // group]), with integer dot products for GGUF block types (matvec_qb's body), float ones for
    F32/F16/BF16 experts (the float kernels' body; gate and up of one type). x: (S / group, cols) rows, the
    hidden states for prologue 1 (norm: the FFN norm's weight; group k) or each slot's [gate | up] rows
    (S, 2 ff) for prologue 2 (silu(gate) * up; group 1), or activations as they are (prologue 0)."""
    S = int(ids.size)
    if which == "gate_up":
        w0, w1 = experts.gate, experts.up
        rows0 = rows1 = experts.ff
    else:
        w0, w1, rows0, rows1 = experts.down, None, experts.rows_of(experts.down), 0
    cols = w0.cols
    per0 = experts.rows_of(w0) * _row_bytes(w0)
    per1 = 0 if w1 is None else experts.rows_of(w1) * _row_bytes(w1)
    raw1 = NULL if w1 is None else w1.raw
    ldx = x.strides[0] // 4
    blocks = -(-(rows0 + rows1) // (MATVEC_THREADS // 32))
    grid = (max(1, min(blocks, -(-_sm_count() * MATVEC_BLOCKS_PER_SM // S))), S)
    if w0.ggml_type in _FLOAT_TYPES:
        if w1 is not None and w1.ggml_type != w0.ggml_type:
            raise ValueError("matvec_experts: float gate and up experts of one type")
        shared = matvec_shared(w0, int_dot=False)
        x2_off, nw = np.int64(cols if prologue == 2 else 0), NULL if norm is None else norm
        args = (out, np.int64(out.strides[0] // 4), w0.raw, raw1, np.int64(per0), np.int64(per1), _i32(rows0),
                _i32(rows1), _i32(cols), x, np.int64(ldx), _i32(group), x2_off, nw, _f32(eps), _i32(prologue),
                ids)
        k = kernel(f"matvec_{TYPES[w0.ggml_type][0]}_experts", cp.cuda.Device().id)
        allow_shared(k, shared)
        k(grid, (MATVEC_THREADS,), args, shared_mem=shared)
        return
    shared = matvec_shared(w0)
    args = (
        out, np.int64(out.strides[0] // 4), w0.raw, raw1, np.int64(per0), np.int64(per1),
        _i32(w0.ggml_type), _i32(w0.ggml_type if w1 is None else w1.ggml_type), _i32(rows0), _i32(rows1),
        _i32(_row_bytes(w0)), _i32(0 if w1 is None else _row_bytes(w1)), _i32(cols), x, np.int64(ldx),
        _i32(group), np.int64(cols if prologue == 2 else 0), NULL if norm is None else norm, _f32(eps),
        _i32(prologue), ids,
    )
    k = kernel("matvec_qb_experts", cp.cuda.Device().id)
    allow_shared(k, shared)
    k(grid, (MATVEC_THREADS,), args, shared_mem=shared)


def moe_combine(x, y, wts, ys=None, sg=None, down_bias=None, ids=None, scale: float = 1.0) -> None:
    """x (n, d) += scale (sum over j of wts[t, j] * y[t, j] for each token t (y (n, k, d), wts (n, k)), plus
    the shared expert's ys (n, d) times sigmoid(sg[t]) (sg (n,); None: ungated)); all float32 on the GPU.
    down_bias (experts, d), with the chosen ids (n, k) int32: row ids[t, j] added to y[t, j] first
    (gpt-oss's experts' down biases). scale: Granite's residual multiplier."""
    n, k, d = y.shape
    if (down_bias is None) != (ids is None):
        raise ValueError("moe_combine: down_bias and ids come together")
    grid = (-(-d // 256), max(1, min(n, GRID_Y_MAX)))
    args = (x, y, wts, NULL if ys is None else ys, NULL if sg is None else sg, _i32(k), _i32(d), np.int64(n),
            NULL if down_bias is None else down_bias, NULL if ids is None else ids, _f32(scale))
    kernel("moe_combine", cp.cuda.Device().id)(grid, (256,), args)


def short_conv(out, bcx, history, w, pos) -> None:
    """LFM2's gated short convolution (shortconv.gated_inputs, then convolve, times C) of the rows bcx
    (n, 3 d) [B | C | x] float32 at positions pos[0].. (pos: int32 on the GPU): B * x into the rows of
    one layer's history (n_ctx, d), float32 or float16, then out (n, d) float32 (row-strided) = C * the
    causal convolution by w (d, taps) float32 over the history's rows."""
    n, d = out.shape
    taps = w.shape[1]
    if bcx.shape != (n, 3 * d) or not bcx.flags.c_contiguous or w.shape[0] != d or history.shape[1] != d:
        raise ValueError("short_conv: bcx (n, 3 d) contiguous, w (d, taps), the history (n_ctx, d)")
    if out.strides[1] != 4 or not history.flags.c_contiguous:
        raise ValueError("short_conv: out rows of float32, a contiguous history")
    half = history.dtype == cp.float16
    grid = (-(-d // 256), max(1, min(n, GRID_Y_MAX)))
    ldo = np.int64(out.strides[0] // 4)
    args = (out, ldo, bcx, history, w, pos, _i32(d), _i32(taps), _i32(n), _i32(half))
    kernel("short_conv", cp.cuda.Device().id)(grid, (256,), args)


DELTA_MAX_TAPS, DELTA_MAX_HEAD, SSM_MAX_STATE = 9, 512, 256  # recurrent.cu's limits


def delta_conv(out, x, conv_state, w, bias=None) -> None:
    """out (n, C) = SiLU(causal depthwise convolution (+ bias (C,))) of x (n, >= C) float32 (row-strided:
    the first C columns of q|k|v|z rows, or a column slice of wider rows) after the rows of conv_state
    (taps - 1, C), which then holds the last taps - 1 inputs; w (C, taps) float32 (Qwen3.5's DeltaNet
    convolution, deltanet.mix; Mamba-2's with its bias, mamba2.mix)."""
    n, C = out.shape
    taps = w.shape[1]
    if not 1 <= taps <= DELTA_MAX_TAPS or conv_state.shape != (taps - 1, C) or w.shape[0] != C:
        raise ValueError(f"delta_conv: {C} channels of up to {DELTA_MAX_TAPS} taps, its state (taps - 1, C)")
    if x.shape[0] != n or x.shape[1] < C or x.strides[1] != 4:
        raise ValueError("delta_conv: x rows hold the C channels first")
    if bias is not None and bias.shape != (C,):
        raise ValueError("delta_conv: a bias per channel")
    args = (out, x, np.int64(x.strides[0] // 4), conv_state, w, NULL if bias is None else bias, _i32(C),
            _i32(taps), _i32(n))
    kernel("delta_conv", cp.cuda.Device().id)(*_grid1(C), args)


def delta_rule(out, conv, proj, zoff: int, ba, state, dt_bias, neg_a, norm, shape, eps: float) -> None:
    """out (n, v_heads hv) = the gated delta rule of delta_conv's rows conv (n, C) from and into one layer's
    state (v_heads, hk, hv), RMS-normed per head by norm (hv,) and gated by SiLU(z), z the columns zoff..
    of proj's rows (n, .); ba (n, 2 v_heads): [b | a]; dt_bias, neg_a (v_heads,); shape: the layer's
    deltanet.DeltaShape."""
    n = out.shape[0]
    kh, vh, hk, hv = shape.k_heads, shape.v_heads, shape.head_k, shape.head_v
    if max(hk, hv) > DELTA_MAX_HEAD or state.shape != (vh, hk, hv) or out.shape != (n, vh * hv):
        raise ValueError(f"delta_rule: heads up to {DELTA_MAX_HEAD} wide, a state ({vh}, {hk}, {hv})")
    if conv.shape != (n, shape.conv_dim) or ba.shape != (n, 2 * vh) or proj.shape[1] < zoff + vh * hv:
        raise ValueError("delta_rule: conv (n, conv_dim), ba (n, 2 v_heads) and z inside proj's rows")
    threads = -(-hv // 32) * 32
    args = (out, conv, proj, np.int64(proj.strides[0] // 4), np.int64(zoff), ba, state, dt_bias, neg_a, norm,
            _i32(kh), _i32(vh), _i32(hk), _i32(hv), _i32(shape.tiled), _f32(eps), _i32(n))
    kernel("delta_rule", cp.cuda.Device().id)((vh,), (threads,), args)


SSM_WARPS = 8  # ssm_scan's block: rows of a head's state, a warp each


def ssm_scan(out, conv, proj, dt_off: int, state, dt_bias, neg_a, d, shape) -> None:
    """out (n, d_inner) = Mamba-2's selective scan of delta_conv's rows conv (n, conv_dim) [x | B | C] from
    and into one layer's state (heads, head_dim, state_size), plus d x, gated by SiLU(z): z the first
    d_inner columns of proj's rows (n, .), dt the heads columns from dt_off; dt_bias, neg_a, d (heads,);
    shape: the layer's mamba2.MambaShape (the grouped RMSNorm after it: rmsnorm with heads = groups)."""
    n = out.shape[0]
    heads, p, size = shape.state_dims
    if size > SSM_MAX_STATE or state.shape != (heads, p, size) or out.shape != (n, shape.d_inner):
        raise ValueError(f"ssm_scan: states up to {SSM_MAX_STATE} wide, a state {shape.state_dims}")
    if conv.shape != (n, shape.conv_dim) or proj.shape[0] != n or proj.shape[1] < dt_off + heads:
        raise ValueError("ssm_scan: conv (n, conv_dim), and z and dt inside proj's rows")
    if proj.strides[1] != 4 or heads % shape.groups:
        raise ValueError("ssm_scan: float32 proj rows, heads a multiple of the groups")
    args = (out, conv, proj, np.int64(proj.strides[0] // 4), np.int64(dt_off), state, dt_bias, neg_a, d,
            _i32(heads), _i32(p), _i32(size), _i32(shape.groups), _f32(shape.dt_min), _f32(shape.dt_max),
            _i32(n))
    grid = (heads, -(-p // SSM_WARPS))
    kernel("ssm_scan", cp.cuda.Device().id)(grid, (32 * SSM_WARPS,), args)
