"""Mistral 3's vision (Mistral Small 3.1/3.2, Ministral 3, Magistral Small): a Pixtral tower, patches merged,
and rows of the language model's input laid out in the image's shape.

As transformers' Mistral3ForConditionalGeneration and its PixtralProcessor run it:
- the image (RGB, EXIF orientation applied) is scaled down, aspect kept, until its longest edge is at most
  `longest_edge`, then resized (bicubic) to the next multiples of patch x merge on both sides, scaled to
  [0, 1] and normalized by CLIP's mean and std;
- Pixtral encodes its patches (a convolution without bias, RMSNorm, then layers of RMSNorm -> attention
  with 2D rotary positions (a quarter of each head's pairs turn by the patch's row, a quarter by its column,
  rotate-half layout) -> residual, RMSNorm -> gated MLP -> residual);
- the projector RMS-norms the patches, concatenates each merge x merge square (the merged row's features are
  channel-major: c * merge^2 + dy * merge + dx) through the merging layer, then linear -> GELU -> linear;
- the prompt holds, where the template wrote [IMG], a row of [IMG] per merged column closed by [IMG_BREAK],
  per merged row, the last break an [IMG_END]; the image's rows replace the [IMG] tokens in order. They
  attend causally, like text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backends import cpu as ops
from engine.backends.cpu.ops import gelu_erf_fast
from engine.errors import ImageInputError, ModelFormatError
from engine.vision.tower import (
    CLIP_MEAN,
    CLIP_STD,
    VisionTower,
    attend_all,
    linear,
    rmsnorm,
    rotate_half,
    single_token,
)

IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"


@dataclass(frozen=True)
class PixtralShape:
    hidden: int
    ff: int
    layers: int
    heads: int
    patch: int
    longest_edge: int
    text_hidden: int
    merge: int = 2
    rope_theta: float = 10000.0
    act: str = "silu"  # the tower's MLP: "silu" or "gelu"
    projector_eps: float = 1e-5  # the projector's norm (the text model's rms_norm_eps)
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def cell(self) -> int:
        """Pixels along a side of one image row's square (patch x merge)."""
        return self.patch * self.merge


@dataclass
class _Layer:
    ln1: np.ndarray
    q: object
    k: object
    v: object
    out: object
    ln2: np.ndarray
    gate: object
    up: object
    down: object


class PixtralVision(VisionTower):
    """Mistral 3's vision tower over a weight source with mmproj names (engine.vision.load)."""

    bidirectional = False

    def __init__(self, shape: PixtralShape, weights, source: Path):
        self.shape = shape
        self.source = source
        self.text_hidden = shape.text_hidden
        self.depth = shape.layers

        d, ff, p, m = shape.hidden, shape.ff, shape.patch, shape.merge
        if shape.act not in ("silu", "gelu"):
            raise ModelFormatError(
                source, f"the vision MLP's activation {shape.act!r} is not one Hearth runs"
            )
        self.patch_w = weights.floats("v.patch_embd.weight", (d, 3, p, p)).reshape(d, 3 * p * p).T.copy()
        self.pre_ln = weights.vector("v.pre_ln.weight", d)
        self.layers = []
        for i in range(shape.layers):
            b = f"v.blk.{i}."
            self.layers.append(
                _Layer(
                    ln1=weights.vector(b + "ln1.weight", d),
                    q=weights.matrix(b + "attn_q.weight", d, d),
                    k=weights.matrix(b + "attn_k.weight", d, d),
                    v=weights.matrix(b + "attn_v.weight", d, d),
                    out=weights.matrix(b + "attn_out.weight", d, d),
                    ln2=weights.vector(b + "ln2.weight", d),
                    gate=weights.matrix(b + "ffn_gate.weight", ff, d),
                    up=weights.matrix(b + "ffn_up.weight", ff, d),
                    down=weights.matrix(b + "ffn_down.weight", d, ff),
                )
            )
        t = shape.text_hidden
        self.input_norm = weights.vector("mm.input_norm.weight", d)
        self.merger = weights.matrix("mm.patch_merger.weight", d, d * m * m)
        self.linear_1 = weights.matrix("mm.1.weight", t, d)
        self.linear_2 = weights.matrix("mm.2.weight", t, t)
        zeros = np.zeros(t, np.float32)
        self.bias_1 = weights.vector("mm.1.bias", t) if weights.has("mm.1.bias") else zeros
        self.bias_2 = weights.vector("mm.2.bias", t) if weights.has("mm.2.bias") else zeros
        half = shape.head_dim // 2  # RoPE pairs: the first half turn by row, the second by column
        inv = 1.0 / shape.rope_theta ** (np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
        self.inv_row, self.inv_col = inv[0::2][: half // 2], inv[1::2][: half - half // 2]
        self._grids: dict[str, tuple[int, int]] = {}  # image digest -> (rows, columns) of its merged grid

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to: within longest_edge, multiples of the cell."""
        ratio = max(height / self.shape.longest_edge, width / self.shape.longest_edge)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        cell = self.shape.cell
        return ((height - 1) // cell + 1) * cell, ((width - 1) // cell + 1) * cell

    def steps(self, pixels: np.ndarray):
        """encode as a generator that yields the layers done after each; returns the rows."""
        shape = self.shape
        p = shape.patch
        gh, gw = pixels.shape[1] // p, pixels.shape[2] // p
        n = gh * gw
        patches = pixels.reshape(3, gh, p, gw, p).transpose(1, 3, 0, 2, 4).reshape(n, 3 * p * p)
        x = np.ascontiguousarray(patches @ self.patch_w, dtype=np.float32)
        rmsnorm(x, x, self.pre_ln, 1e-5)
        rows, cols = np.divmod(np.arange(n), gw)
        angles = np.concatenate([np.outer(rows, self.inv_row), np.outer(cols, self.inv_col)], axis=1)
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        h = np.empty_like(x)
        for i, layer in enumerate(self.layers):
            with ops.batch_phase(n):
                rmsnorm(h, x, layer.ln1, 1e-5)
                x += linear(layer.out, self._attention(layer, h, cos, sin))
                rmsnorm(h, x, layer.ln2, 1e-5)
                gate, up = linear(layer.gate, h), linear(layer.up, h)
                if shape.act == "silu":
                    ops.silu_mul(gate, gate, up)
                else:
                    gelu_erf_fast(gate)
                    gate *= up
                x += linear(layer.down, gate)
            yield i + 1
        return self._project(x, gh, gw)

    def _attention(self, layer: _Layer, h: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        shape = self.shape
        n, heads, hd = len(h), shape.heads, shape.head_dim
        q, k, v = (
            linear(w, h).reshape(n, heads, hd).transpose(1, 0, 2) for w in (layer.q, layer.k, layer.v)
        )
        return attend_all(rotate_half(q, cos, sin), rotate_half(k, cos, sin), v)

    def _project(self, x: np.ndarray, gh: int, gw: int) -> np.ndarray:
        shape, m, d = self.shape, self.shape.merge, self.shape.hidden
        rmsnorm(x, x, self.input_norm, shape.projector_eps)
        merged = x.reshape(gh // m, m, gw // m, m, d).transpose(0, 2, 4, 1, 3).reshape(-1, d * m * m)
        y = linear(self.merger, np.ascontiguousarray(merged))
        y = linear(self.linear_1, y, self.bias_1)
        gelu_erf_fast(y)
        return linear(self.linear_2, y, self.bias_2)

    def _remember(self, digest: str, pixels: np.ndarray) -> None:
        self._grids[digest] = (pixels.shape[1] // self.shape.cell, pixels.shape[2] // self.shape.cell)

    def encode_prompt(self, tokenizer, text: str, images) -> list[int]:
        """Token ids of a rendered prompt whose template wrote [IMG] once per image.

        Raises:
            ImageInputError: the template placed another number of images, or an image is unreadable.
        """
        self.check_placed(text, IMG, images)
        pieces = text.split(IMG)
        img = single_token(tokenizer, IMG)
        if img is None or None in (single_token(tokenizer, IMG_BREAK), single_token(tokenizer, IMG_END)):
            raise ImageInputError("the tokenizer has no [IMG] / [IMG_BREAK] / [IMG_END] tokens")
        rows = []
        for i, data in enumerate(images):
            ids = self.image_ids(data)
            gh, gw = self._grids[self.images.digest(data)]
            layout = [IMG * gw + IMG_BREAK] * gh
            pieces[i] += "".join(layout)[: -len(IMG_BREAK)] + IMG_END
            rows += ids
        out, n = [], 0
        for t in tokenizer.encode("".join(pieces), add_special=False):
            if t == img:
                t, n = rows[n], n + 1
            out.append(t)
        if n != len(rows):
            raise ImageInputError(f"the prompt holds {n} image positions for {len(rows)} image rows")
        return out


