"""quantize / dequantize: float32 matrices <-> raw ggml rows, for every GGUF type we write.

    quantize(ggml_type, matrix) -> uint8 (rows, row_nbytes)
    dequantize(ggml_type, raw, cols) -> float32 (rows, cols)

`ggml_type` is a type id or a name ("Q4_K"). Quantizers are the Numba kernels of kernels_legacy /
kernels_k (ggml's reference search) and kernels_mxfp4's numpy encoder; F32/F16/BF16 are plain
conversions (BF16 rounds to nearest even and keeps NaNs quiet, as ggml does). Dequantizing reuses the
CPU backend's decode kernels, which are tested against gguf.quants.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from engine.quant import kernels_k, kernels_legacy, kernels_mxfp4
from models.errors import HearthError
from models.formats.ggml_types import BLOCK_SIZES, type_name

_QUANTIZERS = {
    int(T.Q8_0): kernels_legacy.quantize_q8_0,
    int(T.Q4_0): kernels_legacy.quantize_q4_0,
    int(T.Q4_1): kernels_legacy.quantize_q4_1,
    int(T.Q5_0): kernels_legacy.quantize_q5_0,
    int(T.Q5_1): kernels_legacy.quantize_q5_1,
    int(T.Q2_K): kernels_k.quantize_q2_k,
    int(T.Q3_K): kernels_k.quantize_q3_k,
    int(T.Q4_K): kernels_k.quantize_q4_k,
    int(T.Q5_K): kernels_k.quantize_q5_k,
    int(T.Q6_K): kernels_k.quantize_q6_k,
    int(T.MXFP4): kernels_mxfp4.quantize_mxfp4,
}
F32, F16, BF16 = int(T.F32), int(T.F16), int(T.BF16)

# every type quantize() can write
WRITABLE_TYPES = frozenset([F32, F16, BF16, *_QUANTIZERS])


class QuantizeError(HearthError):
    """A matrix cannot be encoded in the requested type (bad shape, non-finite values, unknown type)."""


def type_id(ggml_type: int | str) -> int:
    """A ggml type id from an id or a name ("q4_k" works too)."""
    if isinstance(ggml_type, str):
        try:
            return int(T[ggml_type.upper()])
        except KeyError:
            raise QuantizeError(f"unknown ggml type {ggml_type!r}") from None
    return int(ggml_type)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, NaNs kept quiet."""
    n = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    rounded = ((n.astype(np.uint64) + 0x7FFF + ((n >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((n >> 16) | 0x40).astype(np.uint16), rounded)


def quantize(ggml_type: int | str, matrix: np.ndarray) -> np.ndarray:
    """Encode a 2-D float32 matrix as rows of `ggml_type` blocks.

    Args:
        ggml_type: target type id or name (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K,
            MXFP4).
        matrix: (rows, cols) float; cols must be a multiple of the type's block size (32 or 256).

    Returns:
        uint8 (rows, cols // block * block_bytes), the bytes a GGUF file stores.

    Raises:
        QuantizeError: unknown/unsupported type, wrong shape, or NaN/inf in a block-quantized matrix.
    """
    t = type_id(ggml_type)
    if t not in WRITABLE_TYPES:
        raise QuantizeError(
            f"cannot encode {type_name(t)}; supported: "
            + ", ".join(type_name(x) for x in sorted(WRITABLE_TYPES))
        )
    x = np.ascontiguousarray(matrix, dtype=np.float32)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2:
        raise QuantizeError(f"quantize takes a 2-D matrix, got shape {x.shape}")
    rows, cols = x.shape
    block, nbytes = BLOCK_SIZES[t]
    if cols % block:
        raise QuantizeError(f"{type_name(t)} needs rows of a multiple of {block} elements, got {cols}")
    if t == F32:
        return x.view(np.uint8).copy()
    if t == F16:
        return x.astype(np.float16).view(np.uint8)
    if t == BF16:
        return bf16_bits(x).view(np.uint8)
    if not np.isfinite(x).all():
        raise QuantizeError(f"the matrix holds NaN or infinite values; {type_name(t)} cannot encode them")
    out = np.empty((rows, cols // block * nbytes), np.uint8)
    _QUANTIZERS[t](out, x)
    return out


def dequantize(ggml_type: int | str, raw: np.ndarray, cols: int) -> np.ndarray:
    """Decode rows of `ggml_type` (uint8 (rows, row_nbytes)) back to float32 (rows, cols)."""
    from engine.backends import cpu
    from engine.weights import Weight

    t = type_id(ggml_type)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    out = np.empty((rows, cols), np.float32)
    cpu.get_rows(out, Weight(t, raw, rows, cols), np.arange(rows, dtype=np.int64))
    return out
