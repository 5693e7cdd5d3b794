"""Fast approximate decoding for speculative drafts: int8 activations, one fused Numba pass per step.

A draft model only proposes tokens; the target verifies every one of them, so the draft's arithmetic
need not match the engine's exact kernels. `DraftForward` runs a Llama-family draft whose matrices are
Q4_0, Q4_1 or Q8_0 with:

- weights repacked once (`repack`) so that AVX512-VNNI's vpdpbusd multiplies 16 rows at a time
  (`_llvm.dot16_q4` / `dot16_q8`), activations quantized per block of 32 to two int8 levels
  (`quantize_act8`: int16-grade, so the draft proposes what the exact kernels would): ~3.7x the exact
  int16 kernel's weights per second on SmolLM2's Q4_1 matrices;
- the whole step (all layers, the output projection) in one Numba call: no Python between the ~15
  ops of a layer, q/k/v in one parallel region, gate/up/SwiGLU in one, five regions a layer instead of
  eight (each region is a barrier, which costs most on shared cores).

It reads the weights where they lie (flat byte offsets into the model file's one mapping) and keeps
keys and values in the draft's ordinary KVCache, so `trim` rolls it back as before. Drafts it cannot
run (other architectures, biases, q/k norms, sinks, sliding windows, other weight types, float16 caches)
return None from `DraftForward.build`, and the caller keeps the model's exact forward.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from engine.backends.cpu._llvm import dot16_q4, dot16_q8
from engine.backends.cpu.ops import NO_SINK, attend, fast_exp

QK = 32
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml type ids the fast path computes with
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
# The output projection keeps its own bits by default. Requantizing SmolLM2-135M's Q8_0 one to 4 bits
# (a fifth of the model's weights: the step is bound by memory reads) made the step ~10% faster but
# the draft agreed with the target on 91% of tokens instead of 100%: fewer accepted tokens, slower.
OUTPUT_BITS = None
MAX_TOKENS = 4  # tokens per fused step (a draft step feeds 1, or 2 after an all-accepted round)

_KW = dict(nogil=True, cache=True, fastmath=True, error_model="numpy")


@njit(**_KW)
def quantize_act8(x, xq, xd, xs, xz):
    """Quantize activations per block of 32 to two int8 levels: x ~= (254 hi + lo) * xd.

    hi = rint(x / s) with s = max|x| / 127, lo = rint((x - hi s) / xd) with xd = s / 254: an error of
    at most max|x| / 64516, as fine as int16, in bytes the u8 x s8 dot products take.

    x (n,) float32 -> xq (2n,) int8, per block 32 hi bytes then 32 lo bytes; xd (n/32,) float32;
    xs (n/32,) float32 block sum of x (the 4-bit offsets c); xz (n/32,) float32 block sum of the
    quantized x (the 8-bit offset).
    """
    for b in range(x.shape[0] // QK):
        base = b * QK
        amax = np.float32(0.0)
        total = np.float32(0.0)
        for j in range(QK):
            amax = max(amax, abs(x[base + j]))
            total += x[base + j]
        s = amax / np.float32(127.0)
        fine = s / np.float32(254.0)
        inv = np.float32(1.0) / s if amax > 0 else np.float32(0.0)
        inv_fine = np.float32(1.0) / fine if amax > 0 else np.float32(0.0)
        isum = 0
        for j in range(QK):
            v = x[base + j]
            hi = np.rint(v * inv)
            lo = min(max(np.rint((v - hi * s) * inv_fine), np.float32(-127.0)), np.float32(127.0))
            xq[2 * base + j] = np.int8(hi)
            xq[2 * base + QK + j] = np.int8(lo)
            isum += 254 * np.int32(hi) + np.int32(lo)
        xd[b] = fine
        xs[b] = total
        xz[b] = np.float32(isum) * fine


def _as_blocks(w) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(quants (rows, nb, 32), d (rows, nb), Q4_1 min or None) of a Q4_0/Q4_1/Q8_0 weight; Q8_0
    quants as uint8 q + 128, 4-bit ones as their nibbles 0..15."""
    rows, nb = w.rows, w.cols // QK
    blocks = np.asarray(w.raw).reshape(rows, nb, BLOCK_BYTES[w.ggml_type])
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if w.ggml_type == Q8_0:
        return blocks[:, :, 2:34] ^ np.uint8(0x80), d, None
    off = 4 if w.ggml_type == Q4_1 else 2
    qs = blocks[:, :, off : off + 16]
    q = np.concatenate([qs & 15, qs >> 4], axis=2)
    m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32) if w.ggml_type == Q4_1 else None
    return q, d, m


def _requant4(q8: np.ndarray, d8: np.ndarray, chunk: int = 4096):
    """Q8_0 blocks (quants + 128, d) -> 4-bit (nibbles, d, min): x = q d + m, min/max per block."""
    rows, nb, _ = q8.shape
    q4 = np.empty((rows, nb, 32), np.uint8)
    d4 = np.empty((rows, nb), np.float32)
    m4 = np.empty((rows, nb), np.float32)
    for r0 in range(0, rows, chunk):
        x = (q8[r0 : r0 + chunk].astype(np.float32) - 128.0) * d8[r0 : r0 + chunk, :, None]
        lo, hi = x.min(axis=2), x.max(axis=2)
        d = (hi - lo) / 15.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
        q4[r0 : r0 + chunk] = np.clip(np.rint((x - lo[:, :, None]) * inv[:, :, None]), 0, 15)
        d4[r0 : r0 + chunk], m4[r0 : r0 + chunk] = d, lo
    return q4, d4, m4


def repack(w, bits: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """A Q4_0 / Q4_1 / Q8_0 Weight in the draft kernels' 16-row layout (see _llvm.dot16_q4).

    Args:
        w: the weight.
        bits: 4 or 8; None keeps the weight's own (4 for Q4_0/Q4_1, 8 for Q8_0). Q8_0 at 4 bits is
            requantized (min/max per block of 32): half the bytes to read for a small accuracy loss.

    Returns:
        (uint8 (groups * nb * block bytes,) weights, uint16 (groups * nb * 32,) float16 scales, bits),
        rows padded with zeros to a multiple of 16 (groups = padded rows / 16, nb = cols / 32).
    """
    rows, nb = w.rows, w.cols // QK
    q, d, m = _as_blocks(w)
    own = 8 if w.ggml_type == Q8_0 else 4
    bits = own if bits is None else bits
    if bits not in (4, 8):
        raise ValueError(f"repack: bits must be 4 or 8, got {bits}")
    if bits == 4 and own == 8:
        q, d, m = _requant4(q, d)
    elif bits == 8 and own == 4:
        raise ValueError("repack: 4-bit weights stay 4-bit")
    padded = -(-rows // 16) * 16
    g = padded // 16
    scales = np.zeros((padded, nb, 2), np.float32)
    scales[:rows, :, 0] = d
    u = np.zeros((padded, nb, 32), np.uint8)
    u[:rows] = q
    if bits == 8:
        scales[:rows, :, 1] = -128.0 * d
        packed = u.reshape(g, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4)  # (g, nb, vector j, row, e)
    else:
        scales[:rows, :, 1] = m if m is not None else -8.0 * d
        lo = u[:, :, :16].reshape(g, 16, nb, 4, 4)  # elements 4p + e
        hi = u[:, :, 16:].reshape(g, 16, nb, 4, 4)  # elements 16 + 4p + e
        packed = (lo | (hi << 4)).transpose(0, 2, 3, 1, 4)
    sc = scales.astype(np.float16).reshape(g, 16, nb, 2).transpose(0, 2, 3, 1)  # (g, nb, [d, c], 16)
    sc16 = np.ascontiguousarray(sc).view(np.uint16).reshape(-1)
    return np.ascontiguousarray(packed).reshape(-1), sc16, bits


@njit(**_KW)
def _rows16(out, col0, wbuf, sbuf, wo, so, bits, nb, g, xq, xd, xs, xz, n):
    # rows 16g..16g+15 of the repacked matrix whose first group is at wbuf[wo:] / sbuf[so:], for the
    # n activation rows of xq/xd/xs/xz -> out[t, col0 + 16g ..]
    if bits == 4:
        gw = wo + g * nb * 256
        gs = so + g * nb * 32
        for t in range(n):
            dot16_q4(out[t], col0 + 16 * g, wbuf, gw, sbuf, gs, nb, xq[t], xd[t], xs[t])
    else:
        gw = wo + g * nb * 512
        gs = so + g * nb * 32
        for t in range(n):
            dot16_q8(out[t], col0 + 16 * g, wbuf, gw, sbuf, gs, nb, xq[t], xd[t], xz[t])


@njit(parallel=True, **_KW)
def matvec_i8(out, wbuf, sbuf, bits, rows, cols, x):
    """out (n, rows16) ~= x (n, cols) @ W.T for a matrix repacked by `repack` (rows16 = rows padded).

    Activations are quantized to int8 per block of 32 (approximate: for drafts).
    """
    n = x.shape[0]
    nb = cols // QK
    xq = np.empty((n, 2 * cols), np.int8)
    xd = np.empty((n, nb), np.float32)
    xs = np.empty((n, nb), np.float32)
    xz = np.empty((n, nb), np.float32)
    for t in range(n):
        quantize_act8(x[t], xq[t], xd[t], xs[t], xz[t])
    for g in prange((rows + 15) // 16):
        _rows16(out, 0, wbuf, sbuf, 0, 0, bits, nb, g, xq, xd, xs, xz, n)


@njit(**_KW)
def _rmsnorm_q8(x, weight, eps, h, xq, xd, xs, xz, n):
    # h[t] = rmsnorm(x[t]) * weight, then int8-quantized into xq/xd/xs/xz[t], for t < n
    dim = x.shape[1]
    for t in range(n):
        ss = np.float32(0.0)
        for j in range(dim):
            ss += x[t, j] * x[t, j]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(dim) + eps)
        for j in range(dim):
            h[t, j] = x[t, j] * inv * weight[j]
        quantize_act8(h[t], xq[t], xd[t], xs[t], xz[t])


@njit(**_KW)
def _rotate(v, o, cs, sn, half, neox):
    # RoPE on the head at v[o : o + 2 half] (cos/sin of this position), as ops.rope
    if neox:
        for i in range(half):
            a = v[o + i]
            b = v[o + i + half]
            v[o + i] = a * cs[i] - b * sn[i]
            v[o + i + half] = a * sn[i] + b * cs[i]
    else:
        for i in range(half):
            a = v[o + 2 * i]
            b = v[o + 2 * i + 1]
            v[o + 2 * i] = a * cs[i] - b * sn[i]
            v[o + 2 * i + 1] = a * sn[i] + b * cs[i]


@njit(**_KW)
def _mat(out, col0, wbuf, sbuf, m, nb, g, xq, xd, xs, xz, n):
    # _rows16 for the matrix described by m = (weight offset, scale offset, bits)
    _rows16(out, col0, wbuf, sbuf, m[0], m[1], m[2], nb, g, xq, xd, xs, xz, n)


@njit(parallel=True, **_KW)
def forward_llama(logits, x, n, pos0, wbuf, sbuf, mats, out_w, attn_norms, ffn_norms, out_norm,
                  k_cache, v_cache, inv_freq, n_rot, neox, n_heads, n_kv, head_dim, eps, scale,
                  h, qkv, att, act, o, xq, xd, xs, xz):
    """One approximate decode step of a Llama-family draft for n <= x.shape[0] tokens.

    logits (>= n, vocab) f32 out; x (>= n, d) f32: the tokens' embeddings in, the residual after;
    positions pos0..pos0+n-1; wbuf uint8, sbuf uint16: every matrix repacked (`repack`); mats
    (layers, 7, 3) int64: weight offset, scale offset and bits of q, k, v, o, gate, up, down; out_w (3,)
    int64: the same for the output projection (logits columns past vocab are its zero padding rows);
    attn_norms, ffn_norms (layers, d) f32; out_norm (d,) f32;
    k_cache, v_cache (layers, n_kv, n_ctx, head_dim) f32, written at the n positions;
    inv_freq (n_rot/2,) f32. Scratch: h (>= n, d), qkv (>= n, q + 2 kv), att (>= n, q), act (>= n, ffn),
    o (>= n, d) f32; xq (>= n, 2 max cols) int8; xd, xs, xz (>= n, max cols / 32) f32.
    """
    n_layers = mats.shape[0]
    d = x.shape[1]
    qd = n_heads * head_dim
    kvd = n_kv * head_dim
    ff = act.shape[1]
    vocab = logits.shape[1]
    half = n_rot // 2
    rep = n_heads // n_kv
    cs = np.empty((n, half), np.float32)
    sn = np.empty((n, half), np.float32)
    for t in range(n):
        for i in range(half):
            ang = np.float64(pos0 + t) * np.float64(inv_freq[i])  # float64 as ops.rope
            cs[t, i] = math.cos(ang)
            sn[t, i] = math.sin(ang)
    gq = qd // 16
    gk = kvd // 16
    gd = d // 16
    for layer in range(n_layers):
        lm = mats[layer]
        _rmsnorm_q8(x, attn_norms[layer], eps, h, xq, xd, xs, xz, n)
        for g in prange(gq + 2 * gk):
            if g < gq:
                _mat(qkv, 0, wbuf, sbuf, lm[0], d // QK, g, xq, xd, xs, xz, n)
            elif g < gq + gk:
                _mat(qkv, qd, wbuf, sbuf, lm[1], d // QK, g - gq, xq, xd, xs, xz, n)
            else:
                _mat(qkv, qd + kvd, wbuf, sbuf, lm[2], d // QK, g - gq - gk, xq, xd, xs, xz, n)
        for t in range(n):
            row = qkv[t]
            for hh in range(n_heads):
                _rotate(row, hh * head_dim, cs[t], sn[t], half, neox)
            for hh in range(n_kv):
                _rotate(row, qd + hh * head_dim, cs[t], sn[t], half, neox)
                for j in range(head_dim):
                    k_cache[layer, hh, pos0 + t, j] = row[qd + hh * head_dim + j]
                    v_cache[layer, hh, pos0 + t, j] = row[qd + kvd + hh * head_dim + j]
        for item in prange(n * n_heads):
            t = item // n_heads
            hh = item - t * n_heads
            kv = hh // rep
            n_keys = pos0 + t + 1
            qo = hh * head_dim
            # views: an index like qo + j that Numba cannot prove non-negative gets a wraparound check
            # per element, which kept this loop scalar (3x slower at 600 keys)
            attend(att[t, qo : qo + head_dim], qkv[t, qo : qo + head_dim], k_cache[layer, kv],
                   v_cache[layer, kv], n_keys, scale, np.float32(0.0), NO_SINK)
        for t in range(n):
            quantize_act8(att[t], xq[t], xd[t], xs[t], xz[t])
        for g in prange(gd):
            _mat(o, 0, wbuf, sbuf, lm[3], qd // QK, g, xq, xd, xs, xz, n)
        for t in range(n):
            for j in range(d):
                x[t, j] += o[t, j]
        _rmsnorm_q8(x, ffn_norms[layer], eps, h, xq, xd, xs, xz, n)
        for g in prange(ff // 16):
            r0 = g * 16
            _mat(qkv, 0, wbuf, sbuf, lm[4], d // QK, g, xq, xd, xs, xz, n)  # gate -> qkv
            _mat(act, 0, wbuf, sbuf, lm[5], d // QK, g, xq, xd, xs, xz, n)  # up -> act
            for t in range(n):
                for r in range(r0, r0 + 16):
                    gv = qkv[t, r]
                    act[t, r] = gv / (np.float32(1.0) + fast_exp(-gv)) * act[t, r]
        for t in range(n):
            quantize_act8(act[t], xq[t], xd[t], xs[t], xz[t])
        for g in prange(gd):
            _mat(o, 0, wbuf, sbuf, lm[6], ff // QK, g, xq, xd, xs, xz, n)
        for t in range(n):
            for j in range(d):
                x[t, j] += o[t, j]
    _rmsnorm_q8(x, out_norm, eps, h, xq, xd, xs, xz, n)
    if out_w[2] == 0:  # the caller projects h itself
        return
    for g in prange(vocab // 16):
        _mat(logits, 0, wbuf, sbuf, out_w, d // QK, g, xq, xd, xs, xz, n)


def _repackable(w) -> bool:
    return (w.ggml_type in BLOCK_BYTES and w.raw.dtype == np.uint8
            and w.raw.shape == (w.rows, w.cols // QK * BLOCK_BYTES[w.ggml_type]))


class DraftForward:
    """The fused approximate decode step of one Llama-family draft model (see the module docstring).

    Build with `DraftForward.build(model)`; `forward(tokens, cache)` then stands in for
    `model.forward(tokens, cache)` for up to MAX_TOKENS tokens, returning approximate logits. The
    repacked weights are a copy (about the size of the model's matrices, plus 1/8 for scales).
    """

    _NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

    def __init__(self, model, wbuf: np.ndarray, sbuf: np.ndarray, mats: np.ndarray, out_w: np.ndarray,
                 vocab_padded: int):
        cfg = model.cfg
        self.model = model
        self.wbuf, self.sbuf, self.mats, self.out_w = wbuf, sbuf, mats, out_w
        self.attn_norms = np.ascontiguousarray(np.stack([lay.attn_norm for lay in model.layers]), np.float32)
        self.ffn_norms = np.ascontiguousarray(np.stack([lay.ffn_norm for lay in model.layers]), np.float32)
        self.out_norm = np.ascontiguousarray(model.output_norm, np.float32)
        self.inv_freq = np.ascontiguousarray(model.inv_freq, np.float32)
        n, d, ff = MAX_TOKENS, cfg.hidden_size, cfg.intermediate_size
        width = max(d, cfg.q_dim, ff)
        f32 = np.float32
        self.x = np.empty((n, d), f32)
        self.h = np.empty((n, d), f32)
        self.qkv = np.empty((n, max(cfg.q_dim + 2 * cfg.kv_dim, ff)), f32)
        self.att = np.empty((n, cfg.q_dim), f32)
        self.act = np.empty((n, ff), f32)
        self.o = np.empty((n, d), f32)
        self.xq = np.empty((n, 2 * width), np.int8)
        self.xd = np.empty((n, width // QK), f32)
        self.xs = np.empty((n, width // QK), f32)
        self.xz = np.empty((n, width // QK), f32)
        self.logits = np.empty((n, vocab_padded), f32)

    @classmethod
    def build(cls, model, output_bits: int | None = OUTPUT_BITS) -> DraftForward | None:
        """The fast step for `model`, or None when it is not a Llama-family model this path covers.

        Args:
            output_bits: bits of the repacked output projection (vocab x hidden, the largest matrix of
                a small draft): 4 requantizes a Q8_0 one, None keeps its own, 0 runs the engine's exact
                kernel on it (also what an output of another type gets).
        """
        from engine.arch.llama import LlamaModel

        if type(model) is not LlamaModel:
            return None
        cfg = model.cfg
        if cfg.rotary_dim % 2 or cfg.rotary_dim > cfg.head_dim or model.rope_mscale != 1:
            return None
        if cfg.rope_scaling.kind == "longrope":  # two sets of frequencies; the step keeps one
            return None
        if cfg.sliding_window:  # the step attends over every key
            return None
        if not all(getattr(cfg, "rope_layers", None) or ()):  # the step rotates every layer
            return None
        if getattr(cfg, "scaled", False) or cfg.attn_temperature_beta:  # Granite's, Ministral 3's scales
            return None
        if cfg.parallel_block or cfg.logit_scale != 1.0:  # Cohere's LayerNorm, parallel blocks, logit scale
            return None
        if cfg.hidden_size % QK or cfg.q_dim % QK or cfg.intermediate_size % QK or cfg.kv_dim % 16:
            return None
        mats = []
        for lay in model.layers:
            if any(v is not None for v in (lay.bq, lay.bk, lay.bv, lay.bo, lay.sinks, lay.q_norm, lay.k_norm,
                                           lay.moe, lay.post_attn_norm, lay.post_ffn_norm, lay.conv,
                                           lay.delta, lay.mamba)):
                return None
            mats.extend(getattr(lay, name) for name in cls._NAMES)
        out = model.output
        if not _repackable(out):  # any type the engine computes: projected exactly
            output_bits = 0
        for w in mats:
            if not _repackable(w):
                return None
        packs = [repack(w) for w in mats]
        if output_bits:
            packs.append(repack(out, None if out.ggml_type != Q8_0 else output_bits))
        else:
            packs.append((np.empty(0, np.uint8), np.empty(0, np.uint16), 0))
        wbuf = np.empty(sum(p[0].size for p in packs), np.uint8)
        sbuf = np.empty(sum(p[1].size for p in packs), np.uint16)
        table, wo, so = [], 0, 0
        for qs, sc, bits in packs:
            wbuf[wo : wo + qs.size] = qs
            sbuf[so : so + sc.size] = sc
            table.append((wo, so, bits))
            wo, so = wo + qs.size, so + sc.size
        n_layers = cfg.num_hidden_layers
        layers = np.array(table[:-1], np.int64).reshape(n_layers, 7, 3)
        out_w = np.array(table[-1], np.int64)
        width = -(-cfg.vocab_size // 16) * 16 if output_bits else cfg.vocab_size
        return cls(model, wbuf, sbuf, layers, out_w, width)

    def supports(self, cache) -> bool:
        """Whether this step can run on `cache` (float32 keys and values)."""
        return cache.k.dtype == np.float32

    def forward(self, tokens, cache) -> np.ndarray:
        """Approximate logits (n, vocab) of tokens (n <= MAX_TOKENS) at positions cache.offset..

        Appends the tokens to the cache as model.forward does. The array is a view of a reused buffer.
        """
        from engine.backends import cpu as ops

        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = len(tokens)
        if not 1 <= n <= MAX_TOKENS:
            raise ValueError(f"DraftForward takes 1..{MAX_TOKENS} tokens, got {n}")
        cache.check_room(n)
        cfg, model = self.model.cfg, self.model
        ops.get_rows(self.x[:n], model.token_embd, tokens)
        forward_llama(self.logits, self.x, n, cache.offset, self.wbuf, self.sbuf, self.mats, self.out_w,
                      self.attn_norms, self.ffn_norms, self.out_norm, cache.k, cache.v,
                      self.inv_freq, cfg.rotary_dim, cfg.rope_neox, cfg.num_attention_heads,
                      cfg.num_key_value_heads, cfg.head_dim, np.float32(cfg.rms_norm_eps), model.scale,
                      self.h, self.qkv, self.att, self.act, self.o, self.xq, self.xd, self.xs, self.xz)
        cache.advance(tokens)
        if not self.out_w[2]:
            ops.linear(self.logits[:n, : cfg.vocab_size], model.output, self.h[:n])
        return self.logits[:n, : cfg.vocab_size]
