"""LFM2's gated short convolution, the operator of its non-attention layers.

For the layer's normed input h: B, C, x = split(in_proj h) into three parts of hidden_size; the causal
depthwise convolution (a kernel of L taps per channel, no bias) runs over B * x along the positions; the
result times C goes through out_proj. The convolution at position p reads the gated inputs of positions
p - L + 1..p (zeros before the first), which the cache keeps per position (ShortConvKVCache).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.backends import cpu as ops
from engine.weights import Weight


@dataclass
class ShortConv:
    in_proj: Weight  # (3 * hidden, hidden): B, C and x rows
    kernel: np.ndarray  # (hidden, L) float32: tap j multiplies position p - L + 1 + j
    out_proj: Weight  # (hidden, hidden)

    def weights(self) -> list[Weight]:
        return [self.in_proj, self.out_proj]


def load_shortconv(weights, p: str, d: int, taps: int) -> ShortConv:
    """Layer prefix p's convolution (llama.cpp's names): shortconv.in_proj / conv / out_proj."""
    return ShortConv(
        in_proj=weights.matrix(p + "shortconv.in_proj.weight", 3 * d, d),
        kernel=weights.floats(p + "shortconv.conv.weight", (d, taps)),
        out_proj=weights.matrix(p + "shortconv.out_proj.weight", d, d),
    )


def gated_inputs(bcx: np.ndarray, conv: ShortConv, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """in_proj h into bcx (n, 3 * hidden); returns (B * x, C), each (n, hidden)."""
    ops.linear(bcx, conv.in_proj, h)
    d = h.shape[1]
    return bcx[:, :d] * bcx[:, 2 * d :], bcx[:, d : 2 * d]


def convolve(out: np.ndarray, history: np.ndarray, pos0: int, kernel: np.ndarray) -> None:
    """out (n, hidden) = the causal convolution at positions pos0..pos0+n-1 of history (n_ctx, hidden), which
    holds the gated inputs of every position up to pos0 + n (in float32 or float16)."""
    n = len(out)
    taps = kernel.shape[1]
    lo = max(pos0 - taps + 1, 0)
    window = history[lo : pos0 + n].astype(np.float32, copy=False)
    pad = taps - 1 - (pos0 - lo)  # taps that fall before position 0 for the first output
    out[:] = 0.0
    for j in range(taps):  # out[t] += kernel[:, j] * input at position pos0 + t - (taps - 1) + j
        t0 = max(pad - j, 0)
        if t0 < n:
            out[t0:] += kernel[:, j] * window[t0 + j - pad : n + j - pad]
