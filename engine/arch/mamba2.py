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
    x, b, c = (np.ascontiguousarray(a) for a in (conv[:, :di], conv[:, di : di + gs], conv[:, di + gs :]))
    if n >= CHUNKED_MIN_TOKENS:
        _scan_chunked(y, x, step, b, c, net.neg_a, net.d, state, shape)
    else:
        _scan(y, x, step, b, c, net.neg_a, net.d, state, shape.groups)
    y *= z * _sigmoid(z)  # the gate before the norm (Granite's norm_before_gate=False)
    rows = y.reshape(n * shape.groups, di // shape.groups)
    ops.rmsnorm(rows, rows, np.ones(rows.shape[1], np.float32), eps)
    y *= net.norm
    return y


# Passes of at least this many tokens (prompts) scan in chunks of SCAN_CHUNK tokens with matrix products
# (_scan_chunked); shorter ones (decode, verify passes) token by token (_scan). A Granite-4.0-H-1B shape
# (48 heads of 64, state 128; Q4_K_M, 2 cores) prefilling 512 tokens: 52.7 tok/s token by token, 76.2 in
# chunks of 64 (73.9 in 32, 71.6 in 128); the scan 60 ms a layer (token by token the prompt's Numba kernels
# run on one thread: ops.batch_phase).
CHUNKED_MIN_TOKENS = 16
SCAN_CHUNK = 64


def _scan_chunked(y, x, step, b, c, neg_a, d, state, shape: MambaShape) -> None:
    """_scan's results by chunks (Mamba-2's state space duality): within a chunk each output is a
    decay-masked, C.B-weighted sum of the chunk's inputs plus the chunk's start state read through C; the
    state then moves to the chunk's end. All heads at once, each product a batched matmul over heads."""
    n = x.shape[0]
    heads, p, size = state.shape
    rep = heads // shape.groups
    xh = x.reshape(n, heads, p)
    bh = np.repeat(b.reshape(n, shape.groups, size), rep, axis=1)  # (n, heads, size): each head's group
    ch = np.repeat(c.reshape(n, shape.groups, size), rep, axis=1)
    for t0 in range(0, n, SCAN_CHUNK):
        t1 = min(n, t0 + SCAN_CHUNK)
        cum = np.cumsum((step[t0:t1] * neg_a).T, axis=1, dtype=np.float32)  # (heads, T): log decay to t
        xdt = (xh[t0:t1] * step[t0:t1, :, None]).transpose(1, 0, 2)  # (heads, T, p)
        bt, ct = bh[t0:t1].transpose(1, 0, 2), ch[t0:t1].transpose(1, 0, 2)  # (heads, T, size)
        diff = cum[:, :, None] - cum[:, None, :]  # (heads, T, T): log decay from s to t
        causal = np.tri(t1 - t0, dtype=bool)
        decay = np.exp(np.where(causal, diff, np.float32(-np.inf)), dtype=np.float32)
        out = np.matmul(np.matmul(ct, bt.transpose(0, 2, 1)) * decay, xdt)  # (heads, T, p)
        out += np.exp(cum)[:, :, None] * np.matmul(ct, state.transpose(0, 2, 1))
        to_end = np.exp(cum[:, -1:] - cum)  # (heads, T)
        state *= np.exp(cum[:, -1])[:, None, None]
        state += np.matmul((xdt * to_end[:, :, None]).transpose(0, 2, 1), bt)
        y[t0:t1] = (out.transpose(1, 0, 2) + d[None, :, None] * xh[t0:t1]).reshape(t1 - t0, heads * p)


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
