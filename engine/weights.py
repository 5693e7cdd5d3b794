"""The engine's view of one weight matrix: a ggml type id and the raw bytes of its rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# safetensors float dtype -> the ggml type id the kernels take as is
FLOAT_DTYPES = {"F32": 0, "F16": 1, "BF16": 30}


def float32_of(values: np.ndarray, bf16: bool) -> np.ndarray:
    """A float32 copy of a plain tensor's values; bf16: the view holds BF16 bits (uint16), as the GGUF and
    safetensors readers give them (numpy has no bfloat16)."""
    if bf16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return np.array(values, dtype=np.float32)


@dataclass(frozen=True)
class Weight:
    """A 2-D weight as stored in the file, never dequantized as a whole.

    Attributes:
        ggml_type: a `gguf.GGMLQuantizationType` value (F32=0, F16=1, Q4_0=2, Q4_1=3, Q8_0=8, BF16=30, ...),
            or one of the safetensors-only formats above the ggml range (engine.backends.cpu.fpquant:
            FP8_E4M3, NVFP4).
        raw: uint8 (rows, row_nbytes), C-contiguous; usually a zero-copy view of the mapped file.
        rows: output features (numpy order: the weight multiplies x as raw-as-matrix @ x).
        cols: input features; a multiple of the type's block size.
        scales: per-row scales kept beside the rows, for formats that store them in their own tensor:
            FP8_E4M3 float32 (rows,), NVFP4 uint8 E4M3 codes (rows, cols/16). None for ggml types.
        global_scale: NVFP4's per-tensor scale (1.0 otherwise).
    """

    ggml_type: int
    raw: np.ndarray
    rows: int
    cols: int
    scales: np.ndarray | None = None
    global_scale: float = 1.0

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes) + (int(self.scales.nbytes) if self.scales is not None else 0)

    def row_block(self, start: int, stop: int) -> Weight:
        """Rows [start, stop) as a Weight of their own (a view: fused QKV/gate-up tensors split this way)."""
        if not 0 <= start < stop <= self.rows:
            raise ValueError(f"row block [{start}, {stop}) outside a {self.rows}-row weight")
        scales = self.scales[start:stop] if self.scales is not None else None
        return Weight(
            self.ggml_type, self.raw[start:stop], stop - start, self.cols, scales, self.global_scale
        )
