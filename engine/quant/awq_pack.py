"""AutoAWQ's INT4 layout: group-wise asymmetric quantization, GEMM packing, and its Q4_1 repacking.

AutoAWQ ("version": "gemm") stores a Linear of `out` x `inp` weights as three tensors:

    qweight  int32 (inp, out // 8)      8 output channels per int32, nibble i holds channel 8c + ORDER[i]
    qzeros   int32 (inp // g, out // 8) the zero point of each group, packed the same way
    scales   f16   (inp // g, out)      the step of each group

and the weight is w[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o], with q, z in 0..15 (group g along the
input dimension, 128 by default). AutoAWQ's quantizer takes each group's min/max:
s = max(max - min, 1e-5) / 15, z = clamp(-round(min / s), 0, 15), q = clamp(round(w / s) + z, 0, 15).

Hearth runs such weights with its Q4_1 kernels: a Q4_1 block of 32 is x = d * q + m, so every g-group
becomes g / 32 blocks with d = s and m = -s * z (exact but for the float16 rounding of m).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.quant.kernels_legacy import f16_round

# nibble i of a packed int32 holds output channel ORDER[i] of its group of 8 (AutoAWQ's order_map)
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GROUP = 128
Q4_1 = 3
Q4_1_BLOCK_BYTES = 20


def quantize_groups(w: np.ndarray, group: int = GROUP) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AutoAWQ's asymmetric round-to-nearest INT4 of a (rows, cols) matrix, groups of `group` along cols.

    Scales are rounded to float16 before the codes are chosen, so the codes fit the stored scales.

    Returns:
        q uint8 (rows, cols) codes 0..15, scales float16 (rows, cols // group),
        zeros uint8 (rows, cols // group).
    """
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"{cols} columns do not split into groups of {group}")
    x = np.asarray(w, np.float32).reshape(rows, cols // group, group)
    hi = x.max(axis=2)
    lo = x.min(axis=2)
    scale = (np.maximum(hi - lo, np.float32(1e-5)) / np.float32(15.0)).astype(np.float16)
    s = scale.astype(np.float32)
    zero = np.clip(-np.round(lo / s), 0, 15)
    q = np.clip(np.round(x / s[..., None]) + zero[..., None], 0, 15)
    return q.astype(np.uint8).reshape(rows, cols), scale, zero.astype(np.uint8)


def dequantize_groups(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """(q - z) * s as float32 (rows, cols) from quantize_groups' three arrays."""
    rows, cols = q.shape
    ng = scales.shape[1]
    x = q.reshape(rows, ng, cols // ng).astype(np.float32) - zeros[..., None].astype(np.float32)
    return (x * scales.astype(np.float32)[..., None]).reshape(rows, cols)


def fake_quantize(w: np.ndarray, group: int = GROUP) -> np.ndarray:
    """w quantized to INT4 groups and back (float32, same shape): quantize_groups then
    dequantize_groups in one Numba pass (the AWQ search calls it thousands of times)."""
    x = np.ascontiguousarray(w, np.float32)
    if x.ndim != 2 or x.shape[1] % group:
        raise ValueError(f"shape {x.shape} does not split into rows of groups of {group}")
    out = np.empty_like(x)
    _fake_quantize(out, x, group)
    return out


@njit(cache=True, nogil=True, parallel=True)
def _fake_quantize(out, x, group):
    # out, x (rows, cols) float32; the same arithmetic as quantize_groups + dequantize_groups
    rows, cols = x.shape
    for r in prange(rows):
        for g0 in range(0, cols, group):
            hi = x[r, g0]
            lo = x[r, g0]
            for j in range(g0, g0 + group):
                v = x[r, j]
                hi = max(hi, v)
                lo = min(lo, v)
            s = f16_round(max(hi - lo, np.float32(1e-5)) / np.float32(15.0))
            z = min(max(-np.rint(lo / s), np.float32(0.0)), np.float32(15.0))
            for j in range(g0, g0 + group):
                q = min(max(np.rint(x[r, j] / s) + z, np.float32(0.0)), np.float32(15.0))
                out[r, j] = (q - z) * s


def pack_columns(a: np.ndarray) -> np.ndarray:
    """uint8 (n, m) nibbles -> int32 (n, m // 8); nibble i of word c holds a[:, 8c + ORDER[i]]."""
    n, m = a.shape
    if m % 8:
        raise ValueError(f"{m} columns cannot be packed 8 per int32")
    a = a.reshape(n, m // 8, 8).astype(np.uint32)
    out = np.zeros((n, m // 8), np.uint32)
    for i, j in enumerate(ORDER):
        out |= (a[:, :, j] & 0xF) << np.uint32(4 * i)
    return out.view(np.int32)


def unpack_columns(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack_columns: int32 (n, m // 8) -> uint8 (n, m)."""
    p = np.ascontiguousarray(packed).view(np.uint32)
    n, w = p.shape
    out = np.empty((n, w, 8), np.uint8)
    for i, j in enumerate(ORDER):
        out[:, :, j] = (p >> np.uint32(4 * i)) & 0xF
    return out.reshape(n, w * 8)


def to_awq_tensors(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> dict[str, np.ndarray]:
    """quantize_groups' arrays of an (out, inp) weight -> AutoAWQ's {qweight, qzeros, scales}."""
    return {
        "qweight": pack_columns(np.ascontiguousarray(q.T)),
        "qzeros": pack_columns(np.ascontiguousarray(zeros.T)),
        "scales": np.ascontiguousarray(scales.T).astype(np.float16),
    }


def from_awq_tensors(
    qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AutoAWQ's tensors -> (q (out, inp), scales f16 (out, ng), zeros (out, ng)), checking shapes.

    Raises:
        ValueError: the three shapes do not fit one layout (the message says which).
    """
    inp, w = qweight.shape
    ng, out = scales.shape
    if out != 8 * w:
        raise ValueError(f"scales have {out} output channels but qweight packs {8 * w}")
    if qzeros.shape != (ng, w):
        raise ValueError(f"qzeros has shape {tuple(qzeros.shape)}, expected {(ng, w)}")
    if ng == 0 or inp % ng or (inp // ng) % 32:
        raise ValueError(f"{inp} input channels in {ng} groups is not a group size that is a multiple of 32")
    q = np.ascontiguousarray(unpack_columns(qweight).T)
    zeros = np.ascontiguousarray(unpack_columns(qzeros).T)
    return q, np.ascontiguousarray(np.asarray(scales, np.float16).T), zeros


def q4_1_rows(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """Group-quantized (out, inp) codes -> Q4_1 rows, uint8 (out, inp // 32 * 20).

    Each 32-block takes its group's d = s and m = -s * z (m rounded to float16); codes are laid out as
    Q4_1 has them: byte j holds element j in the low nibble and element j + 16 in the high nibble.
    """
    rows, cols = q.shape
    ng = scales.shape[1]
    per = cols // ng // 32  # 32-blocks per group
    nb = cols // 32
    d = np.repeat(np.asarray(scales, np.float16), per, axis=1)  # (rows, nb)
    m = (-(d.astype(np.float32) * np.repeat(zeros, per, axis=1).astype(np.float32))).astype(np.float16)
    codes = q.reshape(rows, nb, 32)
    qs = (codes[:, :, :16] & 0xF) | ((codes[:, :, 16:] & 0xF) << 4)
    out = np.empty((rows, nb, Q4_1_BLOCK_BYTES), np.uint8)
    out[:, :, 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    out[:, :, 2:4] = m.view(np.uint8).reshape(rows, nb, 2)
    out[:, :, 4:] = qs
    return out.reshape(rows, nb * Q4_1_BLOCK_BYTES)


def awq_weight(st, prefix: str, rows: int, cols: int, folder):
    """The AutoAWQ linear `prefix` (qweight/qzeros/scales) of a mapped safetensors repo as a Q4_1 Weight.

    Args:
        st: a models.formats.safetensors.SafetensorsModel; prefix: e.g. "model.layers.0.self_attn.q_proj.".
        rows, cols: the expected (out, in) shape.

    Raises:
        ModelFormatError: tensors missing, of the wrong dtype or shape (e.g. GEMV-packed or GPTQ repos).
    """
    from engine.errors import ModelFormatError
    from engine.weights import Weight

    want = {"qweight": "I32", "qzeros": "I32", "scales": "F16"}
    arrays = {}
    for part, dtype in want.items():
        t = st.tensors.get(prefix + part)
        if t is None:
            raise ModelFormatError(
                folder, f"{prefix}{part} is missing; an AWQ linear needs qweight, qzeros, scales"
            )
        if t.dtype != dtype:
            raise ModelFormatError(
                folder, f"{prefix}{part} is {t.dtype}, expected {dtype} (Hearth reads AutoAWQ's GEMM layout)"
            )
        arrays[part] = st.array(prefix + part)
    if arrays["qweight"].shape != (cols, rows // 8):
        raise ModelFormatError(
            folder,
            f"{prefix}qweight has shape {tuple(arrays['qweight'].shape)}, expected {(cols, rows // 8)} "
            "(AutoAWQ 'gemm' packing, 4 bits); other AWQ/GPTQ layouts are not supported",
        )
    try:
        q, scales, zeros = from_awq_tensors(arrays["qweight"], arrays["qzeros"], arrays["scales"])
    except ValueError as e:
        raise ModelFormatError(folder, f"{prefix}*: {e}") from e
    return Weight(Q4_1, q4_1_rows(q, scales, zeros), rows, cols)
