"""FP8 and NVFP4 linear layers of Hugging Face safetensors checkpoints, as engine Weights (no copy).

Hub conventions read (the tensors describe themselves; config.json's quantization_config is not needed):
  FP8, compressed-tensors "float-quantized" or ModelOpt FP8: `weight` F8_E4M3 (rows, cols) and
  `weight_scale` with one value (per tensor) or one per output row (per channel: shape (rows,) or
  (rows, 1)), in F32, F16 or BF16; w = e4m3(weight) * scale.
  NVFP4, ModelOpt: `weight` U8 (rows, cols/2), two E2M1 codes per byte, element 2i in the low nibble;
  `weight_scale` F8_E4M3 (rows, cols/16); `weight_scale_2` F32 scalar; w = e2m1 * e4m3(scale) * scale_2.
  NVFP4, compressed-tensors "nvfp4-pack-quantized": the same with the codes in `weight_packed` and a
  `weight_global_scale` that divides (w = e2m1 * e4m3(scale) / global_scale).
`input_scale` / `input_global_scale` (activation quantization on GPUs) are not used on CPU.
  Block-wise FP8, DeepSeek-V3 / Qwen3 "fp8": `weight` F8_E4M3 (rows, cols) and `weight_scale_inv`
  (ceil(rows/128), ceil(cols/128)) in F32, F16 or BF16, one scale per 128 x 128 block that (despite its
  name) multiplies: w = e4m3(weight) * scale_inv[r // 128, c // 128]. Loaded as FP8_E4M3_BLOCK with the
  scales repeated for each row of their block (rows x ceil(cols/128) float32: 1/32 byte a weight).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.backends.cpu.fpquant import (
    FP8_COL_BLOCK,
    FP8_E4M3,
    FP8_E4M3_BLOCK,
    NVFP4,
    NVFP4_BLOCK,
    block_scales_per_row,
)
from engine.errors import MissingTensorError, ModelFormatError
from engine.weights import Weight, float32_of
from models.formats.safetensors import SafetensorsModel

# dtypes of a linear layer's main tensor that mean "FP8 or NVFP4": fp_matrix takes them
FP_DTYPES = frozenset({"F8_E4M3", "U8"})


def _scale_vector(st: SafetensorsModel, folder: Path, name: str) -> np.ndarray:
    t = st.tensors[name]
    a = st.array(name)
    if t.dtype == "BF16":
        return float32_of(a, True).reshape(-1)
    if t.dtype not in ("F32", "F16"):
        raise ModelFormatError(folder, f"scale tensor {name!r} is {t.dtype}; expected F32, F16 or BF16")
    return np.array(a, dtype=np.float32).reshape(-1)


def fp_matrix(st: SafetensorsModel, folder: Path, hf_name: str, rows: int, cols: int) -> Weight:
    """The Weight (FP8_E4M3 or NVFP4) of the linear layer whose codes are tensor `hf_name`.

    Raises:
        ModelFormatError: a scale is missing or has a layout Hearth does not compute with.
        MissingTensorError: the codes have the wrong shape for (rows, cols).
    """
    t = st.tensors[hf_name]
    base = hf_name.rsplit(".", 1)[0]
    scale_name = base + ".weight_scale"
    if t.dtype == "F8_E4M3" and base + ".weight_scale_inv" in st.tensors:
        return _block_fp8(st, folder, hf_name, base + ".weight_scale_inv", rows, cols)
    if scale_name not in st.tensors:
        raise ModelFormatError(
            folder,
            f"tensor {hf_name!r} is {t.dtype} but {scale_name!r} is missing; Hearth reads FP8 "
            "(per-tensor, per-channel or 128 x 128 block scales) and NVFP4 checkpoints",
        )
    if t.dtype == "F8_E4M3":
        if t.shape != (rows, cols):
            raise MissingTensorError(
                folder, f"tensor {hf_name!r} has shape {t.shape}, expected {(rows, cols)}"
            )
        scale = _scale_vector(st, folder, scale_name)
        if scale.size == 1:
            scale = np.full(rows, scale[0], np.float32)
        elif scale.size != rows:
            raise ModelFormatError(
                folder,
                f"{scale_name!r} has shape {st.tensors[scale_name].shape}; Hearth computes with per-tensor "
                "and per-channel FP8 `weight_scale`s (block scales come as `weight_scale_inv`)",
            )
        codes = np.ascontiguousarray(st.array(hf_name))
        return Weight(FP8_E4M3, codes, rows, cols, np.ascontiguousarray(scale, dtype=np.float32))
    if t.dtype != "U8":
        raise ModelFormatError(folder, f"tensor {hf_name!r} is {t.dtype}, neither FP8 nor NVFP4")
    s = st.tensors[scale_name]
    if (
        cols % NVFP4_BLOCK
        or t.shape != (rows, cols // 2)
        or s.dtype != "F8_E4M3"
        or s.shape != (rows, cols // NVFP4_BLOCK)
    ):
        raise ModelFormatError(
            folder,
            f"tensor {hf_name!r} is U8 {t.shape} with {scale_name!r} {s.dtype} {s.shape}; NVFP4 needs "
            f"({rows}, {cols // 2}) packed codes and ({rows}, {cols // NVFP4_BLOCK}) F8_E4M3 scales",
        )
    if base + ".weight_scale_2" in st.tensors:
        g = _scale_vector(st, folder, base + ".weight_scale_2")
        global_scale = float(g[0])
    elif base + ".weight_global_scale" in st.tensors:
        g = _scale_vector(st, folder, base + ".weight_global_scale")
        global_scale = 1.0 / float(g[0])
    else:
        raise ModelFormatError(
            folder,
            f"NVFP4 tensor {hf_name!r} has no global scale ({base}.weight_scale_2 or "
            f"{base}.weight_global_scale); the checkpoint is incomplete",
        )
    if g.size != 1 and not np.all(g == g[0]):
        raise ModelFormatError(
            folder, f"{base}: NVFP4 global scales that differ per partition are not supported"
        )
    if not np.isfinite(global_scale) or global_scale <= 0:
        raise ModelFormatError(folder, f"{base}: NVFP4 global scale {global_scale} is not a positive number")
    codes = np.ascontiguousarray(st.array(hf_name))
    return Weight(NVFP4, codes, rows, cols, np.ascontiguousarray(st.array(scale_name)), global_scale)


def _block_fp8(
    st: SafetensorsModel, folder: Path, hf_name: str, scale_name: str, rows: int, cols: int
) -> Weight:
    t = st.tensors[hf_name]
    if t.shape != (rows, cols):
        raise MissingTensorError(folder, f"tensor {hf_name!r} has shape {t.shape}, expected {(rows, cols)}")
    b = FP8_COL_BLOCK
    blocks = (-(-rows // b), -(-cols // b))
    shape = st.tensors[scale_name].shape
    if shape != blocks:
        raise ModelFormatError(
            folder,
            f"{scale_name!r} has shape {shape}; Hearth computes with block-wise FP8 in blocks of {b} x {b} "
            f"({blocks} scales for a {rows} x {cols} weight)",
        )
    scale = _scale_vector(st, folder, scale_name).reshape(blocks)
    if not np.isfinite(scale).all():
        raise ModelFormatError(
            folder, f"{scale_name!r} holds NaN or infinite scales; the checkpoint is damaged"
        )
    codes = np.ascontiguousarray(st.array(hf_name))
    return Weight(FP8_E4M3_BLOCK, codes, rows, cols, block_scales_per_row(scale, rows))
