"""Qwen2.5-VL's and Qwen2-VL's vision (Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration):
Qwen3.5's ViT (engine.vision.qwen35) without learned positions, windowed in Qwen2.5-VL.

As transformers runs it, Qwen2.5-VL's tower differs from Qwen3.5's in that:
- there are no learned position embeddings and the patch convolution has no bias: the 2D rotary positions
  alone say where a patch is;
- every norm is an RMSNorm (eps 1e-6, a weight and no bias), the merger's too, and the MLP is gated:
  down(silu(gate(x)) * up(x)), each linear with a bias;
- attention is windowed: the merged grid is cut into windows of window_size pixels a side (window_size / patch
  / merge merged rows; the last row and column of windows may be narrower), taken row by row, and every block
  not in fullatt_block_indexes attends within each window only. transformers reorders the patches into window
  order (windows one after another, each window's merge squares row by row) before the blocks and the merged
  rows back after the merger; so does this tower, which makes each window a contiguous run of patches.

Qwen2-VL's tower is the older one: LayerNorms (with biases) in the blocks and the merger, a plain MLP
fc2(quick_gelu(fc1(x))) (quick_gelu(x) = x * sigmoid(1.702 x)), every block attending over the whole image.

Their language model is Qwen2 (QKV biases) whose M-RoPE sections lie in a row (the first
mrope_section[0] rotary pairs turn by t, the next mrope_section[1] by h, the rest by w;
engine.vision.qwen35.mrope_masks). The prompt layout (<|vision_start|><|image_pad|>...<|vision_end|>), the
image rows' positions and the text's after an image are Qwen3.5's.

llama.cpp's mmproj for Qwen2.5-VL (projector "qwen2.5vl_merger") keeps q, k and v apart
(v.blk.N.attn_{q,k,v}), the gated MLP as ffn_gate / ffn_up / ffn_down, the merger as v.post_ln, mm.0, mm.2,
and gives the full-attention blocks as a period (clip.vision.n_wa_pattern: block i attends over the whole
image when (i + 1) % n == 0). Qwen2-VL's ("qwen2vl_merger") has the same names with LayerNorm biases and
ffn_up / ffn_down only, and neither clip.use_silu nor clip.use_gelu (llama.cpp's quick GELU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backends import cpu as ops
from engine.vision.qwen35 import Qwen35Vision, Qwen35VisionShape
from engine.vision.tower import attend_all, gelu_quick, layernorm, linear, rmsnorm, rotate_half

# the published Qwen2.5-VL image processor's pixel bounds (preprocessor_config.json's min_pixels, max_pixels)
QWEN25_MIN_PIXELS, QWEN25_MAX_PIXELS = 3136, 12845056


@dataclass(frozen=True)
class Qwen25VisionShape(Qwen35VisionShape):
    window: int = 112  # pixels along a window's side
    full_blocks: tuple[int, ...] = ()  # the blocks that attend over the whole image (fullatt_block_indexes)
    # Qwen2.5-VL: RMSNorms and gated SiLU MLPs; Qwen2-VL (False): LayerNorms and quick-GELU MLPs
    gated: bool = True

    @property
    def window_rows(self) -> int:
        """Merged rows along a window's side."""
        return max(1, self.window // self.cell)


@dataclass
class _Block:
    ln1: tuple[np.ndarray, np.ndarray | None]  # weight, bias (None: an RMSNorm)
    qkv: list  # the q, k, v projections (hidden, hidden) each
    qkv_b: list[np.ndarray]
    proj: object
    proj_b: np.ndarray
    ln2: tuple[np.ndarray, np.ndarray | None]
    gate: object | None  # None: Qwen2-VL's plain MLP
    gate_b: np.ndarray | None
    up: object
    up_b: np.ndarray
    down: object
    down_b: np.ndarray


def periodic_blocks(period: int, layers: int) -> tuple[int, ...]:
    """The full-attention blocks llama.cpp's n_wa_pattern gives: every period-th, (i + 1) % period == 0."""
    return tuple(i for i in range(layers) if (i + 1) % period == 0)


def window_order(rows: int, cols: int, side: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """A merged grid of rows x cols in window order (transformers' get_vision_window_index for one image):
    the merged rows' indices (row-major in the grid), windows of side x side taken row by row, each window's
    rows row by row; and each window's [start, end) in that order."""
    order, spans = [], []
    start = 0
    for r0 in range(0, rows, side):
        for c0 in range(0, cols, side):
            cells = np.arange(r0, min(r0 + side, rows))[:, None] * cols + np.arange(c0, min(c0 + side, cols))
            order.append(cells.reshape(-1))
            spans.append((start, start + cells.size))
            start += cells.size
    return np.concatenate(order), spans


class Qwen25Vision(Qwen35Vision):
    """Qwen2.5-VL's (or Qwen2-VL's) vision tower over a weight source with llama.cpp's mmproj names
    (engine.vision.load maps transformers' `visual.*` onto them): v.patch_embd (the 3D convolution, or its
    temporal slices as v.patch_embd.weight and .weight.1), v.blk.N.{ln1, attn_qkv (or attn_q, attn_k,
    attn_v), attn_out, ln2, ffn_gate (Qwen2.5-VL), ffn_up, ffn_down}, the merger's norm and linears as
    v.post_ln, mm.0, mm.2."""

    def __init__(self, shape: Qwen25VisionShape, weights, source: Path):
        self._setup(shape, weights, source)
        d, ff = shape.hidden, shape.ff

        def norm(name: str) -> tuple[np.ndarray, np.ndarray | None]:
            bias = None if shape.gated else weights.vector(name + ".bias", d)  # Qwen2-VL's LayerNorms
            return weights.vector(name + ".weight", d), bias

        self.blocks = []
        for i in range(shape.layers):
            b = f"v.blk.{i}."
            if weights.has(b + "attn_qkv.weight"):  # transformers' fused projection: its thirds
                fused = weights.matrix(b + "attn_qkv.weight", 3 * d, d)
                fused_b = weights.vector(b + "attn_qkv.bias", 3 * d)
                qkv = [fused.row_block(k * d, (k + 1) * d) for k in range(3)]
                qkv_b = [fused_b[k * d : (k + 1) * d] for k in range(3)]
            else:  # llama.cpp's mmproj keeps them apart
                qkv = [weights.matrix(f"{b}attn_{x}.weight", d, d) for x in "qkv"]
                qkv_b = [weights.vector(f"{b}attn_{x}.bias", d) for x in "qkv"]
            self.blocks.append(
                _Block(
                    ln1=norm(b + "ln1"),
                    qkv=qkv,
                    qkv_b=qkv_b,
                    proj=weights.matrix(b + "attn_out.weight", d, d),
                    proj_b=weights.vector(b + "attn_out.bias", d),
                    ln2=norm(b + "ln2"),
                    gate=weights.matrix(b + "ffn_gate.weight", ff, d) if shape.gated else None,
                    gate_b=weights.vector(b + "ffn_gate.bias", ff) if shape.gated else None,
                    up=weights.matrix(b + "ffn_up.weight", ff, d),
                    up_b=weights.vector(b + "ffn_up.bias", ff),
                    down=weights.matrix(b + "ffn_down.weight", d, ff),
                    down_b=weights.vector(b + "ffn_down.bias", d),
                )
            )
        self._load_merger(weights, norm)

    def steps(self, pixels: np.ndarray):
        """encode as a generator that yields the blocks done after each; returns the merged rows, in the
        merged grid's row-major order."""
        shape = self.shape
        mm = shape.merge * shape.merge
        x, rows, cols = self._patches(pixels)
        grid_rows, grid_cols = pixels.shape[1] // shape.cell, pixels.shape[2] // shape.cell
        order, windows = window_order(grid_rows, grid_cols, shape.window_rows)
        patches = (order[:, None] * mm + np.arange(mm)).reshape(-1)  # each square's patches follow it
        x, rows, cols = np.ascontiguousarray(x[patches]), rows[patches], cols[patches]
        spans = [(a * mm, b * mm) for a, b in windows]
        cos, sin = self._rotary(rows, cols)
        h = np.empty_like(x)
        for i, block in enumerate(self.blocks):
            with ops.batch_phase(len(x)):
                self._norm(h, x, block.ln1)
                attn = self._windowed_attention(block, h, cos, sin, None if i in shape.full_blocks else spans)
                x += linear(block.proj, attn, block.proj_b)
                self._norm(h, x, block.ln2)
                up = linear(block.up, h, block.up_b)
                if block.gate is None:  # Qwen2-VL
                    gelu_quick(up)
                else:
                    ops.silu_mul(up, linear(block.gate, h, block.gate_b), up)
                x += linear(block.down, up, block.down_b)
            yield i + 1
        self._norm(h, x, self.merge_ln)
        merged = self._merge(h)
        out = np.empty_like(merged)
        out[order] = merged  # back to the grid's order
        return out

    def _norm(self, out: np.ndarray, x: np.ndarray, norm: tuple[np.ndarray, np.ndarray | None]) -> None:
        """out = RMSNorm(x) (Qwen2.5-VL) or LayerNorm(x) (Qwen2-VL's norms, which have biases)."""
        weight, bias = norm
        if bias is None:
            rmsnorm(out, x, weight, self.shape.eps)
        else:
            layernorm(out, x, weight, bias, self.shape.eps)

    def _windowed_attention(self, block: _Block, h: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                            spans: list[tuple[int, int]] | None) -> np.ndarray:
        """(n, hidden) attention of the patches h over the whole image (spans None) or within each span."""
        shape = self.shape
        n, heads, hd = len(h), shape.heads, shape.head_dim
        q, k, v = (
            linear(w, h, b).reshape(n, heads, hd).transpose(1, 0, 2) for w, b in zip(block.qkv, block.qkv_b)
        )
        q, k, v = rotate_half(q, cos, sin), rotate_half(k, cos, sin), np.ascontiguousarray(v)
        if spans is None:
            return attend_all(q, k, v)
        out = np.empty((n, heads * hd), np.float32)
        for a, b in spans:
            out[a:b] = attend_all(q[:, a:b], k[:, a:b], v[:, a:b])
        return out
