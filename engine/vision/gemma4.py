"""Gemma 4's vision (E2B, E4B, 26B-A4B, 31B): a tower with 2D rotary positions, its patches pooled, then a
normed projection into the language model's input.

As transformers' Gemma4ForConditionalGeneration and its Gemma4 image processor run it:
- the image (RGB, EXIF orientation applied) is resized (bicubic), aspect kept, to the largest size whose
  patches number at most max_soft_tokens * pool^2 and whose sides are multiples of patch x pool, and scaled to
  [0, 1]; the tower maps pixels to [-1, 1] itself;
- each patch (its pixels row by row, the three channels of a pixel together) goes through a linear map
  without bias, plus a learnt embedding of its column and one of its row;
- every layer: RMSNorm -> attention -> RMSNorm -> residual, RMSNorm -> gated GELU (tanh) MLP -> RMSNorm ->
  residual. The attention RMS-norms q and k per head (with weights) and v (without), scales scores by 1, and
  turns the first half of each head by the patch's column, the second half by its row (rotate-half RoPE
  within each half, frequencies of head_dim / 4 pairs); all patches of the image see each other. With
  use_clipped_linears, every linear's input and output are clamped to stored bounds;
- the patch grid is average-pooled in pool x pool squares (rows in row-major order), times sqrt(hidden);
  with `standardize`, minus a stored bias, times a stored scale; then RMS-normed without a weight and
  projected to the text model's width;
- the prompt gets <|image> + one token per row + <image|> where the chat template wrote the image token; the
  rows replace those tokens' embeddings (unscaled). The E models' per-layer inputs at an image row take the
  pad token's per-layer embedding and the projection of the image row itself. With
  use_bidirectional_attention "vision" an image's rows see each other both ways on the windowed layers
  (within the window), causally on the global ones (engine.arch.gemma4); without it, causally everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backends import cpu as ops
from engine.errors import ImageInputError, ModelFormatError
from engine.vision.tower import VisionTower, attend_all, linear, normalized, open_rgb, rmsnorm


@dataclass(frozen=True)
class Gemma4VisionShape:
    hidden: int
    ff: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    patch: int
    pool: int  # the average pool's side, in patches
    positions: int  # rows of each position embedding table (the most patches along a side)
    text_hidden: int
    max_soft_tokens: int = 280  # rows per image at most (the image processor's budget)
    rope_theta: float = 100.0
    eps: float = 1e-6
    standardize: bool = False
    bidirectional: bool = False  # the text config's use_bidirectional_attention == "vision"
    image_token_id: int = 258_880
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    pad_token_id: int = 0  # the per-layer embedding row image positions take

    @property
    def cell(self) -> int:
        """Pixels along a side of one image row's square (patch x pool)."""
        return self.patch * self.pool


@dataclass
class _Clip:
    """A linear map whose input and output may be clamped (use_clipped_linears)."""

    w: object
    bounds: tuple[float, float, float, float] | None  # input min, max, output min, max

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.bounds is None:
            return linear(self.w, x)
        lo, hi, out_lo, out_hi = self.bounds
        y = linear(self.w, np.clip(x, lo, hi))
        return np.clip(y, out_lo, out_hi, out=y)


@dataclass
class _Layer:
    ln1: np.ndarray
    q: _Clip
    k: _Clip
    v: _Clip
    out: _Clip
    q_norm: np.ndarray
    k_norm: np.ndarray
    post_attn: np.ndarray
    ln2: np.ndarray
    gate: _Clip
    up: _Clip
    down: _Clip
    post_ffn: np.ndarray


class Gemma4Vision(VisionTower):
    """Gemma 4's vision tower over a weight source with has/matrix/vector/floats (engine.vision.load)."""

    def __init__(self, shape: Gemma4VisionShape, weights, source: Path):
        self.shape = shape
        self.source = source
        self.text_hidden = shape.text_hidden
        self.depth = shape.layers
        self.bidirectional = shape.bidirectional
        d, ff, p, hd = shape.hidden, shape.ff, shape.patch, shape.head_dim
        if hd % 4:
            raise ModelFormatError(source, f"a vision head of {hd} does not split into 2D rotary halves")
        self.patch_w = weights.matrix("v.patch_embd.weight", d, 3 * p * p)
        table = weights.floats("v.position_embd.weight", (2, shape.positions, d))
        self.col_embd, self.row_embd = np.ascontiguousarray(table[0]), np.ascontiguousarray(table[1])

        def clip(name, rows, cols):
            bounds = None
            if weights.has(name + ".input_min"):
                bounds = tuple(
                    float(weights.floats(f"{name}.{b}", ()))
                    for b in ("input_min", "input_max", "output_min", "output_max")
                )
            return _Clip(weights.matrix(name + ".weight", rows, cols), bounds)

        self.layers = []
        for i in range(shape.layers):
            b = f"v.blk.{i}."
            self.layers.append(
                _Layer(
                    ln1=weights.vector(b + "ln1.weight", d),
                    q=clip(b + "attn_q", shape.heads * hd, d),
                    k=clip(b + "attn_k", shape.kv_heads * hd, d),
                    v=clip(b + "attn_v", shape.kv_heads * hd, d),
                    out=clip(b + "attn_out", d, shape.heads * hd),
                    q_norm=weights.vector(b + "attn_q_norm.weight", hd),
                    k_norm=weights.vector(b + "attn_k_norm.weight", hd),
                    post_attn=weights.vector(b + "attn_post_norm.weight", d),
                    ln2=weights.vector(b + "ln2.weight", d),
                    gate=clip(b + "ffn_gate", ff, d),
                    up=clip(b + "ffn_up", ff, d),
                    down=clip(b + "ffn_down", d, ff),
                    post_ffn=weights.vector(b + "ffn_post_norm.weight", d),
                )
            )
        self.std_bias = self.std_scale = None
        if shape.standardize:
            self.std_bias = weights.vector("v.std_bias", d)
            self.std_scale = weights.vector("v.std_scale", d)
        self.projection = weights.matrix("mm.input_projection.weight", shape.text_hidden, d)
        quarter = hd // 4  # rotary pairs per half of a head
        self.inv_freq = (1.0 / shape.rope_theta ** (np.arange(quarter, dtype=np.float64) * 2 / (hd // 2)))

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to: the most pixels within the patch budget,
        aspect kept, both sides multiples of the cell.

        Raises:
            ImageInputError: an image too thin to give one cell along its short side.
        """
        shape, cell = self.shape, self.shape.cell
        budget = shape.max_soft_tokens * shape.pool**2 * shape.patch**2  # pixels
        factor = math.sqrt(budget / (height * width))
        h, w = int(math.floor(factor * height / cell)) * cell, int(math.floor(factor * width / cell)) * cell
        longest = shape.max_soft_tokens * cell  # the processor's cap on a thin image's long side
        if h == 0 and w == 0:
            raise ImageInputError(f"a {width}x{height} image is too small to read")
        if h == 0:
            h, w = cell, min(int(math.floor(width / height)) * cell, longest)
        elif w == 0:
            h, w = min(int(math.floor(height / width)) * cell, longest), cell
        if h * w > budget:
            raise ImageInputError(f"a {width}x{height} image is too thin to read; crop it")
        return h, w

    def pixels(self, data: bytes) -> np.ndarray:
        """(3, H, W) float32 in [0, 1] of an encoded image file (H, W multiples of the cell).

        Raises:
            ImageInputError: not an image Pillow can read, an absurdly large one, or one too thin.
        """
        from PIL import Image

        def resize(w, h):
            th, tw = self.target_size(h, w)
            return (tw, th), Image.Resampling.BICUBIC

        img = open_rgb(data, resize)
        return normalized(img, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))

    def steps(self, pixels: np.ndarray):
        """The encoder layer by layer (yielding the layers done after each), then its outputs pooled,
        standardized and projected (the return value: (rows, text_hidden))."""
        shape = self.shape
        p = shape.patch
        gh, gw = pixels.shape[1] // p, pixels.shape[2] // p
        if max(gh, gw) > shape.positions:
            raise ImageInputError(
                f"the image is {gw}x{gh} patches; the tower places {shape.positions} along a side"
            )
        n = gh * gw
        # patches (n, p * p * 3): pixel rows, then pixels, then channels, as the processor lays them out
        patches = pixels.reshape(3, gh, p, gw, p).transpose(1, 3, 2, 4, 0).reshape(n, 3 * p * p)
        patches = np.ascontiguousarray(2 * (patches - np.float32(0.5)), dtype=np.float32)
        rows, cols = np.divmod(np.arange(n), gw)
        x = linear(self.patch_w, patches)
        x += self.col_embd[cols]
        x += self.row_embd[rows]
        angles = [np.outer(pos, self.inv_freq) for pos in (cols, rows)]
        cos = [np.cos(a).astype(np.float32) for a in angles]
        sin = [np.sin(a).astype(np.float32) for a in angles]
        h = np.empty_like(x)
        for i, layer in enumerate(self.layers):
            with ops.batch_phase(n):
                rmsnorm(h, x, layer.ln1, shape.eps)
                attn = layer.out(self._attention(layer, h, cos, sin))
                rmsnorm(attn, attn, layer.post_attn, shape.eps)
                x += attn
                rmsnorm(h, x, layer.ln2, shape.eps)
                gate = layer.gate(h)
                ops.gelu_tanh_mul(gate, gate, layer.up(h))
                y = layer.down(gate)
                rmsnorm(y, y, layer.post_ffn, shape.eps)
                x += y
            yield i + 1
        return self._project(x, gh, gw)

    def _attention(self, layer: _Layer, h: np.ndarray, cos, sin) -> np.ndarray:
        shape = self.shape
        n, hd, eps = len(h), shape.head_dim, shape.eps
        q = layer.q(h).reshape(n, shape.heads, hd)
        k = layer.k(h).reshape(n, shape.kv_heads, hd)
        v = layer.v(h).reshape(n, shape.kv_heads, hd)
        rmsnorm(q, q, layer.q_norm, eps)
        rmsnorm(k, k, layer.k_norm, eps)
        rmsnorm(v, v, None, eps)
        q, k = _rotate_2d(q, cos, sin), _rotate_2d(k, cos, sin)
        group = shape.heads // shape.kv_heads
        q = q.transpose(1, 0, 2) * np.float32(hd**0.5)  # the tower scales scores by 1, attend_all by hd^-0.5
        k = np.repeat(k.transpose(1, 0, 2), group, axis=0)
        v = np.repeat(v.transpose(1, 0, 2), group, axis=0)
        return attend_all(q, k, v)

    def _project(self, x: np.ndarray, gh: int, gw: int) -> np.ndarray:
        shape, k, d = self.shape, self.shape.pool, self.shape.hidden
        pooled = x.reshape(gh // k, k, gw // k, k, d).mean(axis=(1, 3)).reshape(-1, d)
        pooled *= np.float32(d**0.5)
        if self.std_bias is not None:
            pooled -= self.std_bias
            pooled *= self.std_scale
        pooled = np.ascontiguousarray(pooled, dtype=np.float32)
        rmsnorm(pooled, pooled, None, shape.eps)
        return linear(self.projection, pooled)

    def attach(self, model) -> None:
        super().attach(model)
        model.image_pad_id = self.shape.pad_token_id

    def encode_prompt(self, tokenizer, text: str, images) -> list[int]:
        """Token ids of a rendered prompt whose template wrote the image token once per image.

        Raises:
            ImageInputError: the template placed another number of images, or an image is unreadable.
        """
        shape = self.shape
        try:
            image, boi, eoi = (tokenizer.token_text(t) for t in
                               (shape.image_token_id, shape.boi_token_id, shape.eoi_token_id))
        except (IndexError, KeyError) as e:
            raise ImageInputError("the tokenizer lacks the image tokens the model's config names") from e
        self.check_placed(text, image, images)
        out, n = [], 0
        for t in tokenizer.encode(text.replace(image, boi + eoi), add_special=False):
            out.append(t)
            if t == shape.boi_token_id:
                if n == len(images):
                    raise ImageInputError("the prompt holds more image markers than images")
                out += self.image_ids(images[n])
                n += 1
        if n != len(images):
            raise ImageInputError(f"the prompt holds {n} image marker(s) for {len(images)} images")
        return out


def _rotate_2d(x: np.ndarray, cos, sin) -> np.ndarray:
    """x (n, heads, hd) with its first half turned by the column angles, its second by the row angles
    (rotate-half within each half); cos / sin: per axis (n, hd / 4)."""
    out = np.empty_like(x)
    half, quarter = x.shape[-1] // 2, x.shape[-1] // 4
    for axis in (0, 1):
        part = x[..., axis * half : (axis + 1) * half]
        a, b = part[..., :quarter], part[..., quarter:]
        c, s = cos[axis][:, None, :], sin[axis][:, None, :]
        out[..., axis * half : axis * half + quarter] = a * c - b * s
        out[..., axis * half + quarter : (axis + 1) * half] = b * c + a * s
    return out
