"""NVFP4 (E2M1 values, E4M3 scale per 16, FP32 global scale): codec and `hearth convert --to nvfp4`.

E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, code =
sign << 3 | index. A weight (rows, cols) is stored as NVIDIA ModelOpt exports it:
  `weight`          U8 (rows, cols / 2): element 2i in the low nibble of byte i, 2i+1 in the high one
  `weight_scale`    F8_E4M3 (rows, cols / 16): one scale per 16 consecutive elements of a row
  `weight_scale_2`  F32 scalar: the per-tensor scale, max|w| / (6 * 448)
and decodes as w = e2m1_value(q) * e4m3_value(weight_scale) * weight_scale_2.

Encoding follows ModelOpt (block scale = e4m3(max|block| / 6 / weight_scale_2), an all-zero block
gets scale 1.0, values rounded to the nearest E2M1 with ties to the even code, clipped at 6), plus one
refinement that keeps the format: each block also tries the E4M3 scale codes just below and above
the max-based one and keeps the one with the smallest squared error.

The folder carries ModelOpt's `hf_quant_config.json` and the same description as config.json's
`quantization_config` (quant_method "modelopt", quant_algo "NVFP4", group_size 16, lm_head
excluded). No `input_scale` is written: Hearth's CPU kernels keep activations in float (W4A16).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit, prange

from engine.errors import ModelFormatError
from engine.quant.fp8 import E4M3_MAX, Part, e4m3_decode, e4m3_encode, write_quantized_repo
from engine.quant.registry import ConvertResult, ProgressFn, TargetFormat, register
from engine.quant.source import SourceModel

BLOCK = 16
E2M1_MAX = 6.0
# code -> value (the sign is bit 3)
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
# midpoints between neighbouring magnitudes; a value on an odd-indexed midpoint rounds up (even code)
_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_TIE_UP = np.array([False, True, False, True, False, True, False])


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 codes (uint8, 0..15): nearest, ties to the even code, saturating at +-6; the sign
    bit is set for x < 0 (ModelOpt's rule: -0.0 gives code 0)."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    idx = np.searchsorted(_BOUNDS, a, side="left")  # bounds[idx-1] < a <= bounds[idx]
    tie = (idx < len(_BOUNDS)) & (a == _BOUNDS[np.minimum(idx, len(_BOUNDS) - 1)])
    idx = idx + (tie & _TIE_UP[np.minimum(idx, len(_BOUNDS) - 1)])
    return (idx | ((x < 0) << 3)).astype(np.uint8)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """(rows, cols) codes -> (rows, cols / 2) bytes, even element in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    out = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


@njit(cache=True, nogil=True, parallel=True)
def _encode_blocks(w, cand, g, packed, chosen):
    # w (rows, cols) f32; cand (rows, cols/16, k) f32 candidate block scales (E4M3 values); g global;
    # -> packed (rows, cols/2) u8 codes under the best candidate, chosen (rows, cols/16) its index
    rows, cols = w.shape
    for r in prange(rows):
        for b in range(cols // BLOCK):
            best = np.inf
            best_k = 0
            for k in range(cand.shape[2]):
                d = np.float32(cand[r, b, k] * g)
                err = 0.0
                for j in range(BLOCK):
                    v = w[r, b * BLOCK + j]
                    q = _e2m1_code(v / d)
                    err += (E2M1_VALUES[q] * d - v) ** 2
                if err < best:
                    best = err
                    best_k = k
            chosen[r, b] = best_k
            d = np.float32(cand[r, b, best_k] * g)
            for j in range(BLOCK // 2):
                lo = _e2m1_code(w[r, b * BLOCK + 2 * j] / d)
                hi = _e2m1_code(w[r, b * BLOCK + 2 * j + 1] / d)
                packed[r, b * (BLOCK // 2) + j] = lo | (hi << 4)


@njit(cache=True, nogil=True, inline="always")
def _e2m1_code(x):
    # nearest E2M1 code, ties to the even code (down at 0.25/1.25/2.5/5, up at 0.75/1.75/3.5), clip 6
    a = abs(x)
    i = (a > 0.25) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    return np.uint8(i + (8 if x < 0 else 0))


def quantize_nvfp4(w: np.ndarray, search: bool = True) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """NVFP4 of a float (rows, cols) matrix, cols a multiple of 16.

    Args:
        search: also try the neighbouring E4M3 block-scale codes (smaller error; False = plain ModelOpt).

    Returns:
        (packed uint8 (rows, cols/2), block scale E4M3 codes uint8 (rows, cols/16), global scale float32).
    """
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"NVFP4 needs a 2-D matrix with a multiple of {BLOCK} columns, got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("matrix holds NaN or infinite values; NVFP4 cannot encode it")
    rows, cols = w.shape
    amax = float(np.abs(w).max())
    g = np.float32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)
    bmax = np.abs(w.reshape(rows, cols // BLOCK, BLOCK)).max(axis=2)
    base = np.where(bmax > 0, e4m3_encode(bmax / np.float32(E2M1_MAX) / g), e4m3_encode(np.float32(1.0)))
    codes = [base]
    if search:
        # positive E4M3 codes are ordered by value: the neighbours are the next scale down and up
        codes += [np.clip(base.astype(np.int16) + d, 1, 0x7E).astype(np.uint8) for d in (-1, 1)]
    cand = np.stack(codes, axis=2)  # (rows, cols/16, k) codes
    packed = np.empty((rows, cols // 2), np.uint8)
    chosen = np.empty((rows, cols // BLOCK), np.int64)
    _encode_blocks(w, np.ascontiguousarray(e4m3_decode(cand)), g, packed, chosen)
    scales = np.take_along_axis(cand, chosen[:, :, None], axis=2)[:, :, 0]
    return packed, np.ascontiguousarray(scales), g


def dequantize_nvfp4(packed: np.ndarray, scales: np.ndarray, global_scale: float) -> np.ndarray:
    """Reference decoder (the kernels' oracle): float32 (rows, cols)."""
    vals = e2m1_decode(unpack_nibbles(np.asarray(packed, dtype=np.uint8)))
    rows, cols = vals.shape
    s = e4m3_decode(scales).astype(np.float32) * np.float32(global_scale)
    return (vals.reshape(rows, cols // BLOCK, BLOCK) * s[:, :, None]).reshape(rows, cols)


def _nvfp4_parts(base: str, w: np.ndarray) -> list[Part]:
    packed, scales, g = quantize_nvfp4(w)
    return [
        (f"{base}.weight", "U8", packed.shape, packed.tobytes()),
        (f"{base}.weight_scale", "F8_E4M3", scales.shape, scales.tobytes()),
        (f"{base}.weight_scale_2", "F32", (), np.float32(g).tobytes()),
    ]


def modelopt_nvfp4_config() -> tuple[dict, dict]:
    """(config.json quantization_config, hf_quant_config.json) of a ModelOpt NVFP4 checkpoint."""
    from models.version import VERSION

    quant = {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": BLOCK,
        "exclude_modules": ["lm_head"],
    }
    hf_quant = {"producer": {"name": "hearth", "version": VERSION}, "quantization": quant}
    config = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": BLOCK, "ignore": ["lm_head"],
              "kv_cache_quant_algo": None, "producer": hf_quant["producer"]}
    return config, hf_quant


def _write_nvfp4(source: SourceModel, out_path: Path, options: dict, progress: ProgressFn) -> ConvertResult:
    if source.architecture not in ("llama", "qwen2", "qwen3", "gemma3"):
        raise ModelFormatError(out_path, f"NVFP4 export has no Hugging Face layout for {source.architecture}")
    config, hf_quant = modelopt_nvfp4_config()
    return write_quantized_repo(
        source,
        out_path,
        progress,
        quantize=_nvfp4_parts,
        cols_multiple=BLOCK,
        type_label="NVFP4",
        quantization_config=config,
        extra_files={"hf_quant_config.json": hf_quant},
    )


register(
    TargetFormat(
        "nvfp4",
        "safetensors",
        _write_nvfp4,
        "NVFP4 linear weights: E2M1 + E4M3 scale per 16 + FP32 global (ModelOpt safetensors folder)",
    )
)
