"""Mamba-2's selective state space layer, the mixer of Granite 4.0-H's layers but every few (which attend).

For the layer's normed input h, in_proj h gives z (d_inner: the output gate), x|B|C (conv_dim) and dt (one
per head). x|B|C goes through a causal depthwise convolution of `taps` with a bias and SiLU after it; x is
split into heads of head_dim, B and C (state_size each) into groups that heads / groups consecutive heads
share. Per head, with step = softplus(dt + dt_bias) (clamped to time_step_limit) and A = -exp(A_log), the
state S (head_dim, state_size) becomes S exp(step A) + step x B^T, and the output is S C + D x. The outputs
times SiLU(z) are RMS-normed in groups of d_inner / groups (weight `norm`) and projected by out_proj.

As Qwen3.5's DeltaNet (engine/arch/deltanet.py), the state after the last token is all a sequence needs:
RecurrentKVCache keeps it and the convolution's last taps - 1 inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from engine.arch.shortconv import convolve
from engine.backends import cpu as ops
from engine.errors import MissingTensorError
from engine.weights import Weight


@dataclass(frozen=True)
class MambaShape:
    """A Mamba-2 layer's sizes (Granite 4.0-H's mamba_* config fields, llama.cpp's ssm.* keys)."""

    heads: int
    head_dim: int
    state_size: int
    groups: int
    taps: int
    dt_min: float = 0.0  # time_step_limit
    dt_max: float = math.inf

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.groups * self.state_size

    @property
    def in_rows(self) -> int:
        return self.d_inner + self.conv_dim + self.heads

    @property
    def state_dims(self) -> tuple[int, int, int]:
        return self.heads, self.head_dim, self.state_size

    @property
    def state_floats(self) -> int:
        """float32 values of one layer's recurrent state: S per head and the convolution's tail."""
        return self.heads * self.head_dim * self.state_size + (self.taps - 1) * self.conv_dim


@dataclass
class Mamba2:
    in_proj: Weight  # (d_inner + conv_dim + heads, hidden): z, x|B|C, dt rows
    conv: np.ndarray  # (conv_dim, taps) float32
    conv_bias: np.ndarray  # (conv_dim,)
    dt_bias: np.ndarray  # (heads,)
    neg_a: np.ndarray  # (heads,) = -exp(A_log)
    d: np.ndarray  # (heads,) the skip of x past the state
    norm: np.ndarray  # (d_inner,)
    out_proj: Weight  # (hidden, d_inner)

    def weights(self) -> list[Weight]:
        return [self.in_proj, self.out_proj]


def _floats(weights, name: str, *shapes: tuple[int, ...]) -> np.ndarray:
    """A small tensor in the first of `shapes` the source has it in (llama.cpp keeps ssm_a and ssm_d as
    (heads, 1) and ssm_norm as (groups, d_inner / groups); HF as vectors), flattened."""
    for shape in shapes[:-1]:
        try:
            return weights.floats(name, shape).reshape(-1)
        except MissingTensorError:
            continue
    return weights.floats(name, shapes[-1]).reshape(-1)


def load_mamba2(weights, p: str, d: int, shape: MambaShape) -> Mamba2:
    """Layer prefix p's Mamba-2 mixer (llama.cpp's names: ssm_in, ssm_conv1d, ssm_dt, ssm_a, ssm_d, ssm_norm,
    ssm_out; ssm_a holds -exp(A_log))."""
    h, c = shape.heads, shape.conv_dim
    bias = p + "ssm_conv1d.bias"
    return Mamba2(
        in_proj=weights.matrix(p + "ssm_in.weight", shape.in_rows, d),
        conv=weights.floats(p + "ssm_conv1d.weight", (c, shape.taps)),
        conv_bias=weights.vector(bias, c) if weights.has(bias) else np.zeros(c, np.float32),
        dt_bias=weights.vector(p + "ssm_dt.bias", h),
        neg_a=_floats(weights, p + "ssm_a", (h, 1), (h,)),
        d=_floats(weights, p + "ssm_d", (h, 1), (h,)),
        norm=_floats(weights, p + "ssm_norm.weight", (shape.groups, shape.d_inner // shape.groups),
                     (shape.d_inner,)),
        out_proj=weights.matrix(p + "ssm_out.weight", d, shape.d_inner),
    )


def project(net: Mamba2, h: np.ndarray) -> tuple[np.ndarray]:
    """in_proj of h (n, hidden): one (n, in_rows) array, z | x|B|C | dt per token."""
    y = np.empty((len(h), net.in_proj.rows), np.float32)
    ops.linear(y, net.in_proj, h)
    return (y,)


def mix(
    net: Mamba2, shape: MambaShape, eps: float, proj: np.ndarray, conv_state: np.ndarray, state: np.ndarray
) -> np.ndarray:
    """One sequence's n tokens through the convolution, the state space scan and the gated norm, from and into
    its conv_state (taps - 1, conv_dim) and state (heads, head_dim, state_size), updated in place. Returns
    the (n, d_inner) input of out_proj."""
    n, di, c = len(proj), shape.d_inner, shape.conv_dim
    z, xbc, dt = proj[:, :di], proj[:, di : di + c], proj[:, di + c :]
    window = np.concatenate([conv_state, xbc])  # (taps - 1 + n, conv_dim): inputs t .. t + taps - 1 make t
    conv = np.empty((n, c), np.float32)
    convolve(conv, window, shape.taps - 1, net.conv)
    conv_state[:] = window[n:]
    conv += net.conv_bias
    conv *= _sigmoid(conv)  # SiLU
    step = np.logaddexp(np.float32(0), dt + net.dt_bias).astype(np.float32)  # softplus
    np.clip(step, shape.dt_min, shape.dt_max, out=step)
    y = np.empty((n, di), np.float32)
    gs = shape.groups * shape.state_size
    _scan(y, np.ascontiguousarray(conv[:, :di]), step, np.ascontiguousarray(conv[:, di : di + gs]),
          np.ascontiguousarray(conv[:, di + gs :]), net.neg_a, net.d, state, shape.groups)
    y *= z * _sigmoid(z)  # the gate before the norm (Granite's norm_before_gate=False)
    rows = y.reshape(n * shape.groups, di // shape.groups)
    ops.rmsnorm(rows, rows, np.ones(rows.shape[1], np.float32), eps)
    y *= net.norm
    return y


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)


@njit(parallel=True, cache=True, fastmath=True)
def _scan(y, x, step, b, c, neg_a, d, state, groups):
    # y, x (n, heads * head_dim); step (n, heads); b, c (n, groups * state_size); state (heads, head_dim,
    # state_size) updated in place. Token by token, heads in parallel.
    n = x.shape[0]
    heads, head_dim, size = state.shape
    per_group = heads // groups
    for h in prange(heads):
        g0 = (h // per_group) * size
        for t in range(n):
            dt = step[t, h]
            decay = np.float32(math.exp(dt * neg_a[h]))
            for p in range(head_dim):
                xi = x[t, h * head_dim + p]
                w = dt * xi
                acc = np.float32(0.0)
                for s in range(size):
                    v = state[h, p, s] * decay + w * b[t, g0 + s]
                    state[h, p, s] = v
                    acc += v * c[t, g0 + s]
                y[t, h * head_dim + p] = acc + d[h] * xi
