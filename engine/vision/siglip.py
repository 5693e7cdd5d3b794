"""SigLIP's vision transformer: an image's patches through a pre-norm encoder without a causal mask.

The image (3, size, size) is cut into patches of `patch` pixels, each projected (the patch convolution as a
matrix product) and given its learned position embedding; every layer runs LayerNorm -> attention (all
patches see all patches, heads of hidden / heads, biases on q, k, v, out) -> residual, LayerNorm -> fc1,
GELU (tanh), fc2 -> residual; a last LayerNorm. Weights are read by llama.cpp's mmproj names (v.patch_embd,
v.position_embd, v.blk.N.{ln1, attn_q, attn_k, attn_v, attn_out, ln2, ffn_up, ffn_down}, v.post_ln), the
matrices in their stored type through the CPU backend's linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.backends import cpu as ops
from engine.vision.tower import attend_all, gelu_tanh, layernorm, linear
from engine.weights import Weight


@dataclass(frozen=True)
class SiglipShape:
    hidden: int
    ff: int
    layers: int
    heads: int
    image_size: int
    patch: int
    eps: float = 1e-6

    @property
    def side(self) -> int:
        """Patches along each side of the image."""
        return self.image_size // self.patch

    @property
    def patches(self) -> int:
        return self.side * self.side


@dataclass
class _Layer:
    ln1: tuple[np.ndarray, np.ndarray]
    q: tuple[Weight, np.ndarray]
    k: tuple[Weight, np.ndarray]
    v: tuple[Weight, np.ndarray]
    out: tuple[Weight, np.ndarray]
    ln2: tuple[np.ndarray, np.ndarray]
    up: tuple[Weight, np.ndarray]
    down: tuple[Weight, np.ndarray]


class SiglipEncoder:
    """The encoder over a weight source with has/matrix/vector/floats by mmproj names."""

    def __init__(self, shape: SiglipShape, weights):
        self.shape = shape
        d, ff, p = shape.hidden, shape.ff, shape.patch
        self.patch_w = weights.floats("v.patch_embd.weight", (d, 3, p, p)).reshape(d, 3 * p * p).T.copy()
        self.patch_b = weights.vector("v.patch_embd.bias", d)
        self.positions = weights.floats("v.position_embd.weight", (shape.patches, d))

        def norm(name):
            return weights.vector(name + ".weight", d), weights.vector(name + ".bias", d)

        def affine(name, rows, cols):
            return weights.matrix(name + ".weight", rows, cols), weights.vector(name + ".bias", rows)

        self.layers = []
        for i in range(shape.layers):
            b = f"v.blk.{i}."
            # fc1 / fc2: llama.cpp's early Gemma 3 mmproj files have them as ffn_down / ffn_up (its loader
            # swaps them by shape, as here): fc1 is the one that reads the hidden width
            up, down = b + "ffn_up", b + "ffn_down"
            if weights.has(down + ".weight") and _cols(weights, down) == d and ff != d:
                up, down = down, up
            self.layers.append(
                _Layer(
                    ln1=norm(b + "ln1"),
                    q=affine(b + "attn_q", d, d),
                    k=affine(b + "attn_k", d, d),
                    v=affine(b + "attn_v", d, d),
                    out=affine(b + "attn_out", d, d),
                    ln2=norm(b + "ln2"),
                    up=affine(up, ff, d),
                    down=affine(down, d, ff),
                )
            )
        self.post_ln = norm("v.post_ln")

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        """(patches, hidden) float32 outputs of one image's pixels (3, image_size, image_size)."""
        steps = self.steps(pixels)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def steps(self, pixels: np.ndarray):
        """__call__ as a generator that yields the number of layers done after each (so that a caller can
        report progress and stop between layers); its return value is the outputs."""
        shape = self.shape
        n, p = shape.patches, shape.patch
        patches = (
            pixels.reshape(3, shape.side, p, shape.side, p).transpose(1, 3, 0, 2, 4).reshape(n, 3 * p * p)
        )
        x = patches @ self.patch_w + self.patch_b + self.positions
        x = np.ascontiguousarray(x, dtype=np.float32)
        h = np.empty_like(x)
        for i, layer in enumerate(self.layers):
            with ops.batch_phase(n):
                layernorm(h, x, *layer.ln1, shape.eps)
                x += _linear(layer.out, self._attention(layer, h))
                layernorm(h, x, *layer.ln2, shape.eps)
                x += _linear(layer.down, gelu_tanh(_linear(layer.up, h)))
            yield i + 1
        layernorm(h, x, *self.post_ln, shape.eps)
        return h

    def _attention(self, layer: _Layer, h: np.ndarray) -> np.ndarray:
        shape = self.shape
        n, heads = len(h), shape.heads
        hd = shape.hidden // heads
        q, k, v = (
            _linear(w, h).reshape(n, heads, hd).transpose(1, 0, 2) for w in (layer.q, layer.k, layer.v)
        )
        return attend_all(q, k, v)


def _cols(weights, name: str) -> int:
    """Input width of a stored matrix (its last axis)."""
    return int(weights.shape(name + ".weight")[-1])


def _linear(w: tuple[Weight, np.ndarray], x: np.ndarray) -> np.ndarray:
    return linear(w[0], x, w[1])


