"""gpt-oss's expert tensors in Hugging Face folders, as the GGUF layout the architecture reads.

A gpt-oss folder keeps each layer's experts in two fused tensors, `mlp.experts.gate_up_proj` (gate and
up rows interleaved: gate_e row i is row 2i, up row i is row 2i + 1) and `mlp.experts.down_proj`, with
biases `*_bias` (experts, rows). OpenAI's own checkpoints store them MXFP4 (`*_blocks` (experts, rows,
cols/32, 16) uint8: element 2j of a block is the low nibble of byte j, 2j + 1 the high one; `*_scales`
(experts, rows, cols/32) uint8 E8M0 exponents, value 2^(scale - 127) * E2M1(nibble)). Dequantized
checkpoints store them as float (experts, cols, rows): transposed, x @ W.

GGUF (llama.cpp's gpt-oss) has separate ffn_gate_exps / ffn_up_exps / ffn_down_exps (experts, rows,
cols) tensors, MXFP4 blocks as `1 byte exponent | 16 bytes` with element j in the low nibble of byte j
and j + 16 in its high nibble (gguf.quants.MXFP4; the same E2M1 codes, read as doubled values with a
half scale: the same numbers). Here the HF tensors are repacked into that layout once, at load: every
backend then runs one MXFP4 type, and `hearth convert` writes the GGUF as llama.cpp does, losslessly.

Qwen3-VL-MoE folders fuse their experts the same way, with gate and up as halves instead of interleaved rows
(gate_e row i is row i of gate_up_proj, up row i is row ff + i) and no biases. Qwen's own checkpoints store
them transposed, (experts, hidden, 2 ff) and (experts, ff, hidden); transformers 5 writes them back rows
first, (experts, 2 ff, hidden) and (experts, hidden, ff). Which one a tensor holds is told by its shape, as
transformers tells it (a shape that fits both is read rows first).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.errors import MissingTensorError, ModelFormatError
from engine.weights import FLOAT_DTYPES, Weight, float32_of

MXFP4 = 39  # ggml type id


def mxfp4_blocks_from_hf(blocks: np.ndarray, scales: np.ndarray, first: int = 0, step: int = 1) -> np.ndarray:
    """GGML MXFP4 rows (experts, rows, groups * 17) uint8 from HF blocks (experts, all rows, groups, 16) and
    scales (experts, all rows, groups), taking rows first, first + step, ... (gate_up's gate or up rows)."""
    if blocks.ndim != 4 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    n, all_rows, groups, _ = blocks.shape
    out = np.empty((n, len(range(first, all_rows, step)), groups * 17), np.uint8)
    _repack(blocks, scales, first, step, out)
    return out


@njit(parallel=True, cache=True, nogil=True)
def _repack(blocks, scales, first, step, out):
    # element i of a block: HF keeps it in byte i // 2 (nibble i % 2), GGML element j (< 16) in the low
    # nibble of byte j and j + 16 in its high nibble. A numpy version took 2.4 s for one gpt-oss-20b
    # layer's gate and up (32 experts of 2880 x 2880), this one a few percent of that.
    n, rows, size = out.shape
    groups = size // 17
    for item in prange(n * rows):
        e = item // rows
        r = item - e * rows
        src = first + r * step
        for g in range(groups):
            o = g * 17
            out[e, r, o] = scales[e, src, g]
            b = blocks[e, src, g]
            for j in range(16):
                shift = 4 * (j & 1)
                lo = (b[j >> 1] >> shift) & 15
                hi = (b[8 + (j >> 1)] >> shift) & 15
                out[e, r, o + 1 + j] = lo | (hi << 4)


def _fused(kind: str, rows: int, halves: bool = False) -> tuple[str, slice]:
    """(HF tensor, its rows that are kind's) for a kind of `rows` rows an expert: gate_up's even rows are
    gate's and its odd rows up's (gpt-oss), or its first and second halves (halves: Qwen3-VL-MoE); down_proj
    is as it is."""
    if kind == "down":
        return "down_proj", slice(0, rows)
    if halves:
        return "gate_up_proj", slice(0, rows) if kind == "gate" else slice(rows, 2 * rows)
    return "gate_up_proj", slice(0 if kind == "gate" else 1, 2 * rows, 2)


class FusedExperts:
    """One layer's fused experts (gpt-oss's, Qwen3-VL-MoE's) from a safetensors repo: merged
    (experts * rows, cols) Weights per kind (GGUF's gate, up and down) and their biases, built on first use
    and kept."""

    def __init__(self, st, folder, prefix: str, halves: bool = False):
        # prefix: "model.layers.N.mlp.experts." (or "model.language_model.layers.N.mlp.experts."); halves:
        # gate_up_proj holds gate then up (Qwen3-VL-MoE), not interleaved rows (gpt-oss)
        self.st, self.folder, self.prefix, self.halves = st, folder, prefix, halves
        self._weights: dict[str, Weight] = {}
        self._biases: dict[str, np.ndarray] = {}

    def _tensor(self, name: str) -> np.ndarray:
        full = self.prefix + name
        if full not in self.st.tensors:
            raise MissingTensorError(self.folder, f"tensor {full!r} is missing from the safetensors files")
        return self.st.array(full)

    def _checked(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = self._tensor(name)
        if array.shape != shape:
            raise ModelFormatError(
                self.folder, f"{self.prefix}{name} has shape {array.shape}, expected {shape}"
            )
        return array

    def _mxfp4(self) -> bool:
        return self.prefix + "gate_up_proj_blocks" in self.st.tensors

    def stack(self, kind: str, n: int, rows: int, cols: int) -> Weight:
        """Kind's experts as one (n * rows, cols) Weight, expert e rows [e * rows, (e + 1) * rows); built
        once and kept (the model's weights)."""
        if kind not in self._weights:
            self._weights[kind] = self.build(kind, n, rows, cols)
        return self._weights[kind]

    def build(self, kind: str, n: int, rows: int, cols: int) -> Weight:
        """stack(), built anew and not kept (conversion reads one tensor at a time)."""
        name, part = _fused(kind, rows, self.halves)
        all_rows = rows if kind == "down" else 2 * rows
        ggml_type = self.source_type()
        if ggml_type == MXFP4:
            groups = (n, all_rows, cols // 32)
            if cols % 32:
                raise ModelFormatError(self.folder, f"{self.prefix}{name}: {cols} columns, not blocks of 32")
            blocks = self._checked(name + "_blocks", (*groups, 16))
            raw = mxfp4_blocks_from_hf(blocks, self._checked(name + "_scales", groups), part.start,
                                       part.step or 1)
        else:
            raw = np.ascontiguousarray(self._rows_first(name, n, all_rows, cols)[:, part]).view(np.uint8)
        return Weight(ggml_type, raw.reshape(n * rows, -1), n * rows, cols)

    def _rows_first(self, name: str, n: int, rows: int, cols: int) -> np.ndarray:
        """Float tensor `name` as (n, rows, cols): gpt-oss's is stored transposed (x @ W: the rows are the
        last axis); Qwen3-VL-MoE's either way, told by its shape (rows first when it fits both)."""
        array = self._tensor(name)
        if self.halves and array.shape == (n, rows, cols):
            return array
        if array.shape != (n, cols, rows):
            want = f"{(n, rows, cols)} or {(n, cols, rows)}" if self.halves else str((n, cols, rows))
            raise ModelFormatError(
                self.folder, f"{self.prefix}{name} has shape {array.shape}, expected {want}"
            )
        return np.swapaxes(array, 1, 2)

    def source_type(self) -> int:
        """The ggml type the experts come in (MXFP4, or the float dtype of a dequantized checkpoint)."""
        if self._mxfp4():
            return MXFP4
        tensor = self.st.tensors.get(self.prefix + "gate_up_proj")
        dtype = None if tensor is None else tensor.dtype
        if dtype not in FLOAT_DTYPES:
            raise ModelFormatError(
                self.folder, f"{self.prefix}gate_up_proj is {dtype}; expected MXFP4 or BF16/F16/F32"
            )
        return FLOAT_DTYPES[dtype]

    def bias(self, kind: str, n: int, rows: int) -> np.ndarray:
        """Kind's biases, float32 (n, rows)."""
        if kind not in self._biases:
            name, part = _fused(kind, rows, self.halves)
            array = self._checked(name + "_bias", (n, rows if kind == "down" else 2 * rows))
            values = float32_of(array, self.st.tensors[self.prefix + name + "_bias"].dtype == "BF16")
            self._biases[kind] = np.ascontiguousarray(values[:, part])
        return self._biases[kind]

    def has(self, kind: str, part: str) -> bool:
        name = "down_proj" if kind == "down" else "gate_up_proj"
        if part == "bias":
            return self.prefix + name + "_bias" in self.st.tensors
        return self._mxfp4() or self.prefix + name in self.st.tensors
