"""Qwen3.5's gated DeltaNet, the linear-attention operator of three layers in four.

For the layer's normed input h: q|k|v = in_proj_qkv h goes through a causal depthwise convolution of
`taps` (SiLU after it); q and k are L2-normed per head (q then scaled by 1/sqrt(head_k_dim)), each key head
serving num_v_heads / num_k_heads value heads. Per value head, a state S (head_k_dim, head_v_dim) decays by
exp(g) with g = -exp(A_log) * softplus(a + dt_bias), then takes the delta rule's write
S += k (beta (v - S^T k))^T with beta = sigmoid(b), and the output is S^T q. The outputs are RMS-normed per
head (weight `norm`), multiplied by SiLU(z) and projected by out_proj.

Qwen3-Next's layers are the same operator with fused input projections, as its checkpoints keep them:
in_proj_qkvz gives per key head its q, its k, then its value heads' v and z; in_proj_ba per key head its value
heads' b, then their a. llama.cpp's qwen3next GGUFs split the first into Qwen3.5's attn_qkv and attn_gate
(its older files keep it whole, as ssm_in) and keep ssm_ba fused; both keep the value heads grouped.

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
    in_qkv: Weight | None  # (2 * key_dim + value_dim, hidden): q, k, v rows; None: in in_qkvz
    in_z: Weight | None  # (value_dim, hidden): the output gate; None: in in_qkvz
    in_b: Weight | None  # (v_heads, hidden): write strength, sigmoid(b); None: in in_ba
    in_a: Weight | None  # (v_heads, hidden): decay, with dt_bias and neg_a; None: in in_ba
    conv: np.ndarray  # (2 * key_dim + value_dim, taps) float32
    dt_bias: np.ndarray  # (v_heads,)
    neg_a: np.ndarray  # (v_heads,) = -exp(A_log)
    norm: np.ndarray  # (head_v_dim,)
    out_proj: Weight  # (hidden, value_dim)
    # Qwen3-Next's fused projections (split_qkvz, split_ba give the parts): (2 * key_dim + 2 * value_dim,
    # hidden) and (2 * v_heads, hidden); None where the parts are separate tensors
    in_qkvz: Weight | None = None
    in_ba: Weight | None = None

    def weights(self) -> list[Weight]:
        inputs = (self.in_qkvz, self.in_ba, self.in_qkv, self.in_z, self.in_b, self.in_a)
        return [w for w in inputs if w is not None] + [self.out_proj]


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
    """Layer prefix p's DeltaNet (llama.cpp's qwen35 names: attn_qkv, attn_gate, ssm_*; its qwen3next ones
    add ssm_ba, and ssm_in in its older files: Qwen3-Next's fused projections)."""

    def matrix(name: str, rows: int) -> Weight | None:
        return weights.matrix(p + name, rows, d) if weights.has(p + name) else None

    qkvz = matrix("ssm_in.weight", shape.conv_dim + shape.value_dim)
    ba = matrix("ssm_ba.weight", 2 * shape.v_heads)
    return DeltaNet(
        in_qkv=None if qkvz is not None else weights.matrix(p + "attn_qkv.weight", shape.conv_dim, d),
        in_z=None if qkvz is not None else weights.matrix(p + "attn_gate.weight", shape.value_dim, d),
        in_b=None if ba is not None else weights.matrix(p + "ssm_beta.weight", shape.v_heads, d),
        in_a=None if ba is not None else weights.matrix(p + "ssm_alpha.weight", shape.v_heads, d),
        conv=weights.floats(p + "ssm_conv1d.weight", (shape.conv_dim, shape.taps)),
        dt_bias=weights.vector(p + "ssm_dt.bias", shape.v_heads),
        neg_a=weights.vector(p + "ssm_a", shape.v_heads),
        norm=weights.vector(p + "ssm_norm.weight", shape.head_v),
        out_proj=weights.matrix(p + "ssm_out.weight", d, shape.value_dim),
        in_qkvz=qkvz,
        in_ba=ba,
    )


def _per_key_head(x: np.ndarray, shape: DeltaShape, sizes: tuple[int, ...], axis: int) -> list[np.ndarray]:
    """x's rows along `axis` as blocks per key head of the given part sizes -> each part gathered over the key
    heads in order (rows along the same axis)."""
    x = np.moveaxis(x, axis, -1)
    lead = x.shape[:-1]
    parts = np.split(x.reshape(*lead, shape.k_heads, sum(sizes)), np.cumsum(sizes)[:-1], axis=-1)
    return [np.ascontiguousarray(np.moveaxis(part.reshape(*lead, -1), -1, axis)) for part in parts]


def split_qkvz(x: np.ndarray, shape: DeltaShape, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's fused in_proj_qkvz rows (weights: axis 0; outputs: axis -1) -> (q|k|v, z) as Qwen3.5's
    in_proj_qkv and in_proj_z order them (the value heads grouped by key head, as they were)."""
    rv = shape.v_heads // shape.k_heads * shape.head_v
    q, k, v, z = _per_key_head(x, shape, (shape.head_k, shape.head_k, rv, rv), axis)
    return np.concatenate([q, k, v], axis=axis), z


def split_ba(x: np.ndarray, shape: DeltaShape, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's fused in_proj_ba rows (per key head its value heads' b, then their a) -> (b, a)."""
    rep = shape.v_heads // shape.k_heads
    b, a = _per_key_head(x, shape, (rep, rep), axis)
    return b, a


def tile_value_heads(x: np.ndarray, shape: DeltaShape, per_head: int, axis: int = 0) -> np.ndarray:
    """x with its value heads (blocks of per_head along `axis`) from HF's grouped order into llama.cpp's
    tiled one: grouped [K0v0, K0v1, .., K1v0, ..] -> tiled [K0v0, K1v0, .., K0v1, K1v1, ..]."""
    rep = shape.v_heads // shape.k_heads
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(shape.k_heads, rep, per_head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(x, 0, axis))


def project(net: DeltaNet, h: np.ndarray, shape: DeltaShape) -> tuple[np.ndarray, ...]:
    """The input projections of h (n, hidden): (qkv, z, b, a), rows per token."""

    def run(w: Weight) -> np.ndarray:
        y = np.empty((len(h), w.rows), np.float32)
        ops.linear(y, w, h)
        return y

    fused_qkvz, fused_ba = net.in_qkvz is not None, net.in_ba is not None
    qkv_z = split_qkvz(run(net.in_qkvz), shape, -1) if fused_qkvz else (run(net.in_qkv), run(net.in_z))
    b_a = split_ba(run(net.in_ba), shape, -1) if fused_ba else (run(net.in_b), run(net.in_a))
    return (*qkv_z, *b_a)


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
