"""Qwen3.5's gated DeltaNet, the linear-attention operator of three layers in four.

For the layer's normed input h: q|k|v = in_proj_qkv h goes through a causal depthwise convolution of
`taps` (SiLU after it); q and k are L2-normed per head (q then scaled by 1/sqrt(head_k_dim)), each key head
serving num_v_heads / num_k_heads value heads. Per value head, a state S (head_k_dim, head_v_dim) decays by
exp(g) with g = -exp(A_log) * softplus(a + dt_bias), then takes the delta rule's write
S += k (beta (v - S^T k))^T with beta = sigmoid(b), and the output is S^T q. The outputs are RMS-normed per
head (weight `norm`), multiplied by SiLU(z) and projected by out_proj.

The state after the last token is all a sequence needs: RecurrentKVCache keeps it (and the convolution's
last taps - 1 inputs) at the cache's end, not per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from engine.arch.shortconv import convolve
from engine.backends import cpu as ops
from engine.weights import Weight


@dataclass
class DeltaNet:
    in_qkv: Weight  # (2 * key_dim + value_dim, hidden): q, k, v rows
    in_z: Weight  # (value_dim, hidden): the output gate
    in_b: Weight  # (v_heads, hidden): write strength, sigmoid(b)
    in_a: Weight  # (v_heads, hidden): decay, with dt_bias and neg_a
    conv: np.ndarray  # (2 * key_dim + value_dim, taps) float32
    dt_bias: np.ndarray  # (v_heads,)
    neg_a: np.ndarray  # (v_heads,) = -exp(A_log)
    norm: np.ndarray  # (head_v_dim,)
    out_proj: Weight  # (hidden, value_dim)

    def weights(self) -> list[Weight]:
        return [self.in_qkv, self.in_z, self.in_b, self.in_a, self.out_proj]


@dataclass(frozen=True)
class DeltaShape:
    """A DeltaNet layer's sizes (Qwen3.5's linear_* config fields)."""

    k_heads: int
    v_heads: int
    head_k: int
    head_v: int
    taps: int
    # the order of the value heads: grouped by key head (HF: key head i serves value heads i*r .. i*r + r - 1)
    # or tiled (llama.cpp's GGUFs: value head j is served by key head j % k_heads)
    tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.head_k

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.head_v

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def state_floats(self) -> int:
        """float32 values of one layer's recurrent state: S per value head and the convolution's tail."""
        return self.v_heads * self.head_k * self.head_v + (self.taps - 1) * self.conv_dim


def load_deltanet(weights, p: str, d: int, shape: DeltaShape) -> DeltaNet:
    """Layer prefix p's DeltaNet (llama.cpp's qwen35 names: attn_qkv, attn_gate, ssm_*)."""
    return DeltaNet(
        in_qkv=weights.matrix(p + "attn_qkv.weight", shape.conv_dim, d),
        in_z=weights.matrix(p + "attn_gate.weight", shape.value_dim, d),
        in_b=weights.matrix(p + "ssm_beta.weight", shape.v_heads, d),
        in_a=weights.matrix(p + "ssm_alpha.weight", shape.v_heads, d),
        conv=weights.floats(p + "ssm_conv1d.weight", (shape.conv_dim, shape.taps)),
        dt_bias=weights.vector(p + "ssm_dt.bias", shape.v_heads),
        neg_a=weights.vector(p + "ssm_a", shape.v_heads),
        norm=weights.vector(p + "ssm_norm.weight", shape.head_v),
        out_proj=weights.matrix(p + "ssm_out.weight", d, shape.value_dim),
    )


def tile_value_heads(x: np.ndarray, shape: DeltaShape, per_head: int, axis: int = 0) -> np.ndarray:
    """x with its value heads (blocks of per_head along `axis`) from HF's grouped order into llama.cpp's
    tiled one: grouped [K0v0, K0v1, .., K1v0, ..] -> tiled [K0v0, K1v0, .., K0v1, K1v1, ..]."""
    rep = shape.v_heads // shape.k_heads
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(shape.k_heads, rep, per_head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(x, 0, axis))


def project(net: DeltaNet, h: np.ndarray) -> tuple[np.ndarray, ...]:
    """The input projections of h (n, hidden): (qkv, z, b, a), rows per token."""
    n = len(h)
    out = []
    for w in (net.in_qkv, net.in_z, net.in_b, net.in_a):
        y = np.empty((n, w.rows), np.float32)
        ops.linear(y, w, h)
        out.append(y)
    return tuple(out)


def mix(
    net: DeltaNet, shape: DeltaShape, eps: float, qkv: np.ndarray, z: np.ndarray, b: np.ndarray,
    a: np.ndarray, conv_state: np.ndarray, state: np.ndarray,
) -> np.ndarray:
    """One sequence's n tokens through the convolution, the delta rule and the gated norm, from and into its
    conv_state (taps - 1, conv_dim) and state (v_heads, head_k, head_v), updated in place. Returns the
    (n, value_dim) input of out_proj."""
    n = len(qkv)
    window = np.concatenate([conv_state, qkv])  # (taps - 1 + n, conv_dim): inputs t .. t + taps - 1 make t
    conv = np.empty_like(qkv)
    convolve(conv, window, shape.taps - 1, net.conv)
    conv_state[:] = window[n:]
    conv *= 1.0 / (1.0 + np.exp(-conv))  # SiLU
    kd, rep = shape.key_dim, shape.v_heads // shape.k_heads
    q = _l2norm(conv[:, :kd].reshape(n, shape.k_heads, shape.head_k)) * np.float32(shape.head_k**-0.5)
    k = _l2norm(conv[:, kd : 2 * kd].reshape(n, shape.k_heads, shape.head_k))
    v = np.ascontiguousarray(conv[:, 2 * kd :].reshape(n, shape.v_heads, shape.head_v))
    if rep > 1 and shape.tiled:  # value head j: key head j % k_heads
        q, k = np.tile(q, (1, rep, 1)), np.tile(k, (1, rep, 1))
    elif rep > 1:  # key head i serves value heads i * rep .. (i + 1) * rep - 1
        q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
    beta = (1.0 / (1.0 + np.exp(-b))).astype(np.float32)
    g = (net.neg_a * np.logaddexp(0.0, a + net.dt_bias)).astype(np.float32)  # -exp(A_log) softplus(a + dt)
    out = np.empty_like(v)
    _delta_rule(np.ascontiguousarray(q), np.ascontiguousarray(k), v, g, beta, state, out)
    rows = out.reshape(n * shape.v_heads, shape.head_v)
    ops.rmsnorm(rows, rows, net.norm, eps)
    ops.silu_mul(rows, z.reshape(n * shape.v_heads, shape.head_v), rows)
    return out.reshape(n, shape.value_dim)


def _l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + np.float32(1e-6))


@njit(cache=True, nogil=True, parallel=True)
def _delta_rule(q, k, v, g, beta, state, out):
    """The gated delta rule over n tokens, per value head: q, k (n, heads, dk), v (n, heads, dv), g, beta
    (n, heads); state (heads, dk, dv) read and updated; out (n, heads, dv).

    Two passes over the state a token, each along its rows (dv contiguous): decay and read S^T k, then
    write k delta^T and read S^T q.
    """
    n, heads, dk = k.shape
    dv = v.shape[2]
    for h in prange(heads):
        s = state[h]
        mem = np.empty(dv, np.float32)
        for t in range(n):
            decay = np.float32(np.exp(g[t, h]))
            mem[:] = 0.0
            for i in range(dk):
                ki = k[t, h, i]
                for j in range(dv):
                    s[i, j] *= decay
                    mem[j] += s[i, j] * ki
            bt = beta[t, h]
            for j in range(dv):
                mem[j] = (v[t, h, j] - mem[j]) * bt  # the delta
                out[t, h, j] = 0.0
            for i in range(dk):
                ki, qi = k[t, h, i], q[t, h, i]
                for j in range(dv):
                    s[i, j] += ki * mem[j]
                    out[t, h, j] += s[i, j] * qi
