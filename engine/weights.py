"""The engine's view of one weight matrix: a ggml type id and the raw bytes of its rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Weight:
    """A 2-D weight as stored in the file, never dequantized as a whole.

    Attributes:
        ggml_type: a `gguf.GGMLQuantizationType` value (F32=0, F16=1, Q4_0=2, Q4_1=3, Q8_0=8, BF16=30, ...).
        raw: uint8 (rows, row_nbytes), C-contiguous; usually a zero-copy view of the mapped file.
        rows: output features (numpy order: the weight multiplies x as raw-as-matrix @ x).
        cols: input features; a multiple of the type's block size.
    """

    ggml_type: int
    raw: np.ndarray
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def row_block(self, start: int, stop: int) -> Weight:
        """Rows [start, stop) as a Weight of their own (a view: fused QKV/gate-up tensors split this way)."""
        if not 0 <= start < stop <= self.rows:
            raise ValueError(f"row block [{start}, {stop}) outside a {self.rows}-row weight")
        return Weight(self.ggml_type, self.raw[start:stop], stop - start, self.cols)
