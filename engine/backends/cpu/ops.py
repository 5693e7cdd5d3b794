"""Element-wise, normalization, rotary and attention kernels (float32; attention also over float16 caches).

Cheap ops run serially: at decode sizes a parallel region costs more than the work. Attention is
the exception and runs one parallel region over (query, head) pairs, or, for queries with many keys,
over (query, kv head, chunk of keys) (attention_long).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from engine.backends.cpu._llvm import half_to_f32, pow2_f32

# error_model="numpy": a float division by zero gives inf instead of raising, so that loops with a division
# (silu, gelu, the softmaxes) vectorize; Numba's default checks every divisor (scalar code, 3-4x slower).
_KW = dict(nogil=True, cache=True, fastmath=True, error_model="numpy")
# softmax/argmax see logits a sampler may have masked with -inf (and may see NaN): fastmath would let
# LLVM assume neither occurs, so these two keep IEEE semantics. They are O(vocab) and cheap anyway.
_KW_IEEE = dict(nogil=True, cache=True, fastmath=False)


_LOG2E = np.float32(1.4426950408889634)
_FLT_MIN = np.float32(1.1754943508222875e-38)  # the smallest normal float32
_LN2_HI = np.float32(0.693145751953125)  # ln 2 split so that k * _LN2_HI is exact for |k| < 256
_LN2_LO = np.float32(1.428606765330187e-06)


@njit(inline="always", **_KW)
def fast_exp(x):
    # exp(x) for float32 x, within 4e-7 relative of the exact value (libm's expf: 6e-8), in arithmetic
    # LLVM vectorizes: expf stays a scalar call (Numba has no vector math library here), so np.exp
    # loops ran ~2.5 ns an element, this ~0.6. x is clamped to [-87, 88] (2^-126 .. 2^127: no
    # denormals, no infinity); x = k ln 2 + r with |r| <= ln 2 / 2, and e^r is its Taylor series to r^7.
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    k = np.floor(x * _LOG2E + np.float32(0.5))
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * pow2_f32(k)


@njit(**_KW)
def rmsnorm(out, x, weight, eps):
    # x, out (n_tok, dim) f32; weight (dim,) f32; out = x / sqrt(mean(x^2) + eps) * weight
    n, dim = x.shape
    for t in range(n):
        ss = np.float32(0.0)
        for j in range(dim):
            ss += x[t, j] * x[t, j]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(dim) + np.float32(eps))
        for j in range(dim):
            out[t, j] = x[t, j] * inv * weight[j]


@njit(**_KW)
def layernorm(out, x, weight, eps):
    # x, out (n_tok, dim) f32; weight (dim,) f32; out = (x - mean(x)) / sqrt(var(x) + eps) * weight, no bias
    # (Cohere's norms); out may be x
    n, dim = x.shape
    for t in range(n):
        mean = np.float32(0.0)
        for j in range(dim):
            mean += x[t, j]
        mean /= np.float32(dim)
        ss = np.float32(0.0)
        for j in range(dim):
            c = x[t, j] - mean
            ss += c * c
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(dim) + np.float32(eps))
        for j in range(dim):
            out[t, j] = (x[t, j] - mean) * inv * weight[j]


@njit(**_KW)
def rope(x, positions, inv_freq, n_rot, neox):
    # x (n_tok, n_heads, head_dim) f32, rotated in place; positions (n_tok,) int; inv_freq (n_rot/2,) f32.
    # neox=False pairs (2i, 2i+1); neox=True pairs (i, i + n_rot/2). Dims >= n_rot are left as they are.
    n_tok, n_heads, _ = x.shape
    half = n_rot // 2
    cs = np.empty(half, np.float32)
    sn = np.empty(half, np.float32)
    for t in range(n_tok):
        pos = np.float64(positions[t])
        for i in range(half):
            # angle in float64: positions up to ~1e6 times inv_freq lose too much in float32
            ang = pos * np.float64(inv_freq[i])
            cs[i] = math.cos(ang)
            sn[i] = math.sin(ang)
        for h in range(n_heads):
            if neox:
                for i in range(half):
                    a = x[t, h, i]
                    b = x[t, h, i + half]
                    x[t, h, i] = a * cs[i] - b * sn[i]
                    x[t, h, i + half] = a * sn[i] + b * cs[i]
            else:
                for i in range(half):
                    a = x[t, h, 2 * i]
                    b = x[t, h, 2 * i + 1]
                    x[t, h, 2 * i] = a * cs[i] - b * sn[i]
                    x[t, h, 2 * i + 1] = a * sn[i] + b * cs[i]


@njit(inline="always", **_KW)
def capped(score, cap):
    # a score soft-capped as Gemma 2 does (cap * tanh(score / cap)); cap 0: as it is
    return cap * np.tanh(score / cap) if cap > 0 else score


# An attention sink (gpt-oss) is a learned logit per head that joins the softmax's denominator and has
# no value: out = sum_s exp(score_s - m) v_s / (exp(sink - m) + sum_s exp(score_s - m)). NO_SINK stands
# for none (max(m, NO_SINK) = m: every score is above it, and no weight is added: the bits are unchanged).
NO_SINK = np.float32(-3.0e38)


@njit(inline="always", **_KW)
def head_sink(sinks, h):
    # head h's sink logit from sinks (n_heads,), NO_SINK for an empty array (a model without sinks)
    return sinks[h] if sinks.shape[0] else NO_SINK


@njit(inline="always", **_KW)
def _sink_weight(sink, m):
    # the sink's term of the softmax denominator, with m the row's max (sink included)
    return fast_exp(sink - m) if sink > NO_SINK else np.float32(0.0)


@njit(inline="always", **_KW)
def attend(out, q, keys, values, n_keys, scale, cap, sink):
    # One query head over the first n_keys rows of its kv head: out (hd,) = softmax(scale q . k) @ v
    # (the scores soft-capped when cap > 0; sink > NO_SINK: an attention sink, a logit in the softmax's
    # denominator with no value, gpt-oss). q (hd,), keys, values (>= n_keys, hd) f32. attention() and
    # the draft's fused step (engine.backends.cpu.draft) both attend with it.
    hd = q.shape[0]
    scores = np.empty(n_keys, np.float32)
    m = np.float32(-3.0e38)  # not -inf: fastmath lets LLVM assume no infinities
    for s in range(n_keys):
        acc = np.float32(0.0)
        for d in range(hd):
            acc += q[d] * keys[s, d]
        acc = capped(acc * scale, cap)
        scores[s] = acc
        m = max(m, acc)
    m = max(m, sink)
    total = _sink_weight(sink, m)
    for s in range(n_keys):
        e = fast_exp(scores[s] - m)
        scores[s] = e
        total += e
    inv = np.float32(1.0) / total
    for d in range(hd):
        out[d] = 0.0
    for s in range(n_keys):
        p = scores[s] * inv
        for d in range(hd):
            out[d] += p * values[s, d]


@njit(parallel=True, **_KW)
def attention(out, q, k_cache, v_cache, pos0, scale, cap, sinks):
    # q (n_tok, n_heads, hd) f32; k_cache, v_cache (n_kv, max_ctx, hd) f32 holding [0, pos0+n_tok);
    # out (n_tok, n_heads, hd) f32. Query t is at position pos0+t and sees keys [0, pos0+t]. cap > 0:
    # soft-capped scores (Gemma 2), 0: none. sinks: (n_heads,) attention-sink logits, or empty for none.
    n_tok, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[0]
    for item in prange(n_tok * n_heads):
        t = item // n_heads
        h = item - t * n_heads
        kv = h // group
        sink = head_sink(sinks, h)
        attend(out[t, h], q[t, h], k_cache[kv], v_cache[kv], pos0 + t + 1, scale, cap, sink)


@njit(parallel=True, **_KW)
def attention_f16(out, q, k_bits, v_bits, pos0, scale, cap, sinks):
    # attention() over a float16 cache. k_bits, v_bits: the (n_kv, ctx, hd) half caches viewed as
    # uint16 (Numba has no float16 on the CPU); each half is widened in registers (vcvtph2ps).
    n_tok, n_heads, hd = q.shape
    group = n_heads // k_bits.shape[0]
    for item in prange(n_tok * n_heads):
        t = item // n_heads
        h = item - t * n_heads
        kv = h // group
        n_keys = pos0 + t + 1
        scores = np.empty(n_keys, np.float32)
        m = np.float32(-3.0e38)
        for s in range(n_keys):
            acc = np.float32(0.0)
            for d in range(hd):
                acc += q[t, h, d] * half_to_f32(k_bits[kv, s, d])
            acc = capped(acc * scale, cap)
            scores[s] = acc
            m = max(m, acc)
        sink = head_sink(sinks, h)
        m = max(m, sink)
        total = _sink_weight(sink, m)
        for s in range(n_keys):
            e = fast_exp(scores[s] - m)
            scores[s] = e
            total += e
        inv = np.float32(1.0) / total
        for d in range(hd):
            out[t, h, d] = 0.0
        for s in range(n_keys):
            p = scores[s] * inv
            for d in range(hd):
                out[t, h, d] += p * half_to_f32(v_bits[kv, s, d])


def _widen(x):
    """float32 of a cache element: a float32 as it is, a float16's uint16 bits widened (float16 caches
    reach the kernels as uint16 views: Numba has no float16 on the CPU)."""
    raise NotImplementedError  # only its Numba overload runs


@overload(_widen, inline="always")
def _widen_overload(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: half_to_f32(x)
    return None


# attention_long takes the queries with at least long_keys(head_dim) keys. Their keys go in chunks of about
# LONG_CHUNK_KEYS (at most LONG_MAX_CHUNKS), one parallel item a (query, kv head, chunk) that reads
# each key and value row once for all the query heads sharing the kv head; the chunks merge after.
# attention()'s items, one a (query, head), read a kv head's rows once a query head: past the caches
# (SmolLM2 at 4000 keys: 1 MiB of keys a kv head) that is 3x the memory traffic. SmolLM2 decode on 2
# cores, ms a token, per-head kernel -> this one: 4000 keys 21.2 -> 19.1 (f16 cache), 27.2 -> 22.5 (f32);
# 8000 keys 38.7 -> 30.0 (f16), 53.9 -> 36.7 (f32). Below about 2000 keys the chunked kernel lost (600
# keys: 7.8 -> 8.4 ms), hence the switch.
# Wide heads cross over far sooner: a kv head's rows outgrow the caches at fewer keys, and the per-head kernel
# then re-reads them once a query head. ms a decode query (2 cores, f32 cache; f16 alike), per-head kernel /
# this one: head 512, 8 heads on 1 kv head (Gemma 4's global layers) at 64 keys 0.18 / 0.05, 1024 keys
# 5.44 / 0.36; 32 heads on 4 kv heads at 16 keys 0.07 / 0.09, 1024 keys 31.2 / 1.23; head 256, 8 heads on
# 1 (Gemma 4's windowed layers) at 512 keys 0.14 / 0.17, 1024 keys 0.44 / 0.14 (in the E2B-shaped model at
# its 512-key window the switch at 384 cost 2.5 ms a token over 28 layers); 4 on 1 (Gemma 3 270M) at 512
# keys 0.15 / 0.10, 1024 keys 0.32 / 0.08. Heads of 128 keep LONG_KEYS (32 on 8 at 512 keys: 0.18 / 0.22,
# 1024 keys: 0.40 / 0.38).
LONG_KEYS = 3072
LONG_KEYS_HEAD_256 = 768
LONG_KEYS_HEAD_512 = 1
LONG_CHUNK_KEYS = 256
LONG_MAX_CHUNKS = 32


def long_keys(head_dim: int) -> int:
    """The key count from which a query goes to attention_long, for heads of head_dim."""
    if head_dim >= 512:
        return LONG_KEYS_HEAD_512
    return LONG_KEYS_HEAD_256 if head_dim >= 256 else LONG_KEYS


@njit(inline="always", **_KW)
def _long_chunks(n_keys):
    return min(LONG_MAX_CHUNKS, (n_keys + LONG_CHUNK_KEYS - 1) // LONG_CHUNK_KEYS)


@njit(parallel=True, **_KW)
def attention_long(out, q, k_cache, v_cache, pos0, scale, cap, sinks):
    # attention() for queries that each see at least LONG_KEYS keys. k_cache, v_cache: float32, or float16
    # caches as uint16 bits. A query's keys split into _long_chunks(its key count) chunks, so its result
    # is the same bits alone (decode) or among others (a verify pass).
    n_tok, n_heads, hd = q.shape
    n_kv = k_cache.shape[0]
    rep = n_heads // n_kv
    chunks = _long_chunks(pos0 + n_tok)  # the most any query has
    part_m = np.empty((n_tok, n_heads, chunks), np.float32)  # a chunk's max score
    part_l = np.empty((n_tok, n_heads, chunks), np.float32)  # its sum of exp(score - max)
    part_o = np.empty((n_tok, n_heads, chunks, hd), np.float32)  # its sum of exp(score - max) v
    for item in prange(n_tok * n_kv * chunks):
        t = item // (n_kv * chunks)
        g = (item // chunks) % n_kv
        c = item % chunks
        n_keys = pos0 + t + 1
        own = _long_chunks(n_keys)
        if c >= own:
            continue
        lo = n_keys * c // own
        hi = n_keys * (c + 1) // own
        h0 = g * rep
        scores = np.empty((rep, hi - lo), np.float32)
        for s in range(lo, hi):
            key = k_cache[g, s]
            for j in range(rep):
                qh = q[t, h0 + j]
                acc = np.float32(0.0)
                for d in range(hd):
                    acc += qh[d] * _widen(key[d])
                scores[j, s - lo] = capped(acc * scale, cap)
        for j in range(rep):
            row = scores[j]
            m = np.float32(-3.0e38)  # not -inf: fastmath lets LLVM assume no infinities
            for s in range(row.shape[0]):
                m = max(m, row[s])
            total = np.float32(0.0)
            for s in range(row.shape[0]):
                e = fast_exp(row[s] - m)
                row[s] = e
                total += e
            part_m[t, h0 + j, c] = m
            part_l[t, h0 + j, c] = total
            part_o[t, h0 + j, c, :] = 0.0
        for s in range(lo, hi):
            value = v_cache[g, s]
            for j in range(rep):
                p = scores[j, s - lo]
                o = part_o[t, h0 + j, c]
                for d in range(hd):
                    o[d] += p * _widen(value[d])
    for t in range(n_tok):
        own = _long_chunks(pos0 + t + 1)
        for h in range(n_heads):
            m = part_m[t, h, 0]
            for c in range(1, own):
                m = max(m, part_m[t, h, c])
            sink = head_sink(sinks, h)
            m = max(m, sink)
            total = _sink_weight(sink, m)
            o = out[t, h]
            o[:] = 0.0
            for c in range(own):
                w = fast_exp(part_m[t, h, c] - m)
                total += w * part_l[t, h, c]
                po = part_o[t, h, c]
                for d in range(hd):
                    o[d] += w * po[d]
            inv = np.float32(1.0) / total
            for d in range(hd):
                o[d] *= inv


@njit(**_KW)
def silu_mul(out, gate, up):
    # out, gate, up (n,) f32 (flattened by the caller): out = gate * sigmoid(gate) * up
    for i in range(out.shape[0]):
        g = gate[i]
        out[i] = g / (np.float32(1.0) + fast_exp(-g)) * up[i]


@njit(**_KW)
def swiglu_oai_mul(out, gate, up, alpha, limit):
    # out, gate, up (n,) f32: gpt-oss's clamped SwiGLU, g = min(gate, limit), u = clamp(up, -limit, limit),
    # out = g * sigmoid(alpha g) * (u + 1)
    one = np.float32(1.0)
    for i in range(out.shape[0]):
        g = min(gate[i], limit)
        u = min(max(up[i], -limit), limit)
        out[i] = g / (one + fast_exp(-alpha * g)) * (u + one)


@njit(**_KW)
def gelu_tanh_mul(out, gate, up):
    # out, gate, up (n,) f32: out = gelu_tanh(gate) * up, gelu_tanh(g) = g/2 (1 + tanh(c (g + 0.044715 g^3)))
    # computed as g * sigmoid(2 c (g + 0.044715 g^3)) (1 + tanh(u) = 2 sigmoid(2u)) with fast_exp, which
    # vectorizes where tanh is a scalar libm call: 15.8 ms -> under 1 for 512 x 2048 on 2 cores.
    c2 = np.float32(2.0 * math.sqrt(2.0 / math.pi))
    for i in range(out.shape[0]):
        g = gate[i]
        u = c2 * (g + np.float32(0.044715) * g * g * g)
        out[i] = g * up[i] / (np.float32(1.0) + fast_exp(-u))


@njit(**_KW)
def gelu_tanh_fast(x):
    # x (n, m) f32 in place: GELU's tanh approximation (PyTorch's gelu(approximate='tanh')) computed as
    # gelu_tanh_mul does, g * sigmoid(2 c (g + 0.044715 g^3)) with fast_exp
    c2 = np.float32(2.0 * math.sqrt(2.0 / math.pi))
    n, m = x.shape
    for r in range(n):
        for j in range(m):
            g = x[r, j]
            x[r, j] = g / (np.float32(1.0) + fast_exp(-c2 * (g + np.float32(0.044715) * g * g * g)))


@njit(**_KW)
def gelu_quick_fast(x):
    # x (n, m) f32 in place: GELU's sigmoid approximation x * sigmoid(1.702 x) (transformers' quick_gelu)
    n, m = x.shape
    for r in range(n):
        for j in range(m):
            g = x[r, j]
            x[r, j] = g / (np.float32(1.0) + fast_exp(np.float32(-1.702) * g))


@njit(**_KW)
def causal_softmax(scores, rep, p0, key0, window, scale, sinks, ends):
    # scores (n * rep, m) f32: row r holds query (r // rep)'s raw q.k over the keys at positions
    # key0 .. key0 + m - 1; that query sits at position p0 + r // rep and sees positions
    # [max(0, p - window + 1) if window else 0, p]. In place: the softmax of scale * scores over the
    # keys it sees, 0 for the others (so that scores @ V is the attention's output). sinks: the rep
    # heads' sink logits (row r: head r % rep), or empty. ends: empty, or (n,) int64: query t sees keys
    # up to position ends[t] - 1 instead of p (an image's tokens see the whole image).
    rows = scores.shape[0]
    for r in range(rows):
        p = p0 + r // rep
        lo = max(0, (0 if window == 0 else max(0, p - window + 1)) - key0)
        hi = p - key0 + 1 if ends.shape[0] == 0 else ends[r // rep] - key0
        row = scores[r]
        seen = row[lo:hi]  # a view of its own: loops from 0 over it vectorize (no index wraparound)
        mx = np.float32(-3.0e38)
        for j in range(seen.shape[0]):
            mx = max(mx, seen[j])
        sink = head_sink(sinks, r % rep)
        if sink > NO_SINK:  # a sink is a logit, the scores are not scaled yet (scale > 0)
            mx = max(mx, sink / scale)
        total = _sink_weight(sink, mx * scale)
        for j in range(seen.shape[0]):
            e = fast_exp((seen[j] - mx) * scale)  # scale > 0: max(scale * s) = scale * max(s)
            seen[j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(seen.shape[0]):
            p = seen[j] * inv
            seen[j] = p if p >= _FLT_MIN else np.float32(0.0)  # no denormals into P @ V (see softmax_fast)
        row[:lo] = 0.0
        row[hi:] = 0.0


@njit(**_KW)
def gelu_erf_fast(x):
    # x (n, m) f32 in place: the exact GELU x / 2 (1 + erf(x / sqrt 2)) (PyTorch's default gelu), with erf
    # from Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7, so the GELU is within ~1e-6 of the exact one for
    # |x| < 8) over fast_exp, in arithmetic LLVM vectorizes: math.erf is a scalar libm call (~8 ns an
    # element, a third of a BERT pass on 2 threads); this ~1 ns
    n, m = x.shape
    one, half = np.float32(1.0), np.float32(0.5)
    for r in range(n):
        for j in range(m):
            v = x[r, j]
            a = abs(v) * np.float32(0.7071067811865476)
            t = one / (one + np.float32(0.3275911) * a)
            p = np.float32(1.061405429) * t - np.float32(1.453152027)
            p = p * t + np.float32(1.421413741)
            p = p * t - np.float32(0.284496736)
            p = p * t + np.float32(0.254829592)
            erf = one - p * t * fast_exp(-a * a)
            x[r, j] = half * v * (one + (erf if v >= 0 else -erf))


@njit(**_KW)
def softmax_fast(x, scale):
    # x (n, m) f32 raw scores; in place: the softmax of scale * x over each row (scale > 0), by fast_exp.
    # Probabilities below float32's smallest normal become 0: a product with denormals runs ~40x slower in
    # BLAS (a 1024 x 4096 by 4096 x 72 sgemm, 2 cores: 13 ms without, 520 ms with a sixth of them
    # denormal), and such a weight adds nothing a float32 sum keeps.
    n, m = x.shape
    for r in range(n):
        row = x[r]
        mx = np.float32(-3.0e38)
        for j in range(m):
            mx = max(mx, row[j])
        total = np.float32(0.0)
        for j in range(m):
            e = fast_exp((row[j] - mx) * scale)
            row[j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(m):
            p = row[j] * inv
            row[j] = p if p >= _FLT_MIN else np.float32(0.0)


@njit(**_KW_IEEE)
def softmax_rows(x):
    # x (n, m) f32, softmax over each row in place (max subtracted for stability)
    n, m = x.shape
    for r in range(n):
        mx = np.float32(-np.inf)
        for j in range(m):
            mx = max(mx, x[r, j])
        total = np.float32(0.0)
        for j in range(m):
            e = np.exp(x[r, j] - mx)
            x[r, j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(m):
            x[r, j] *= inv


@njit(**_KW_IEEE)
def argmax_rows(out, x):
    # x (n, m) f32 -> out (n,) int64 index of each row's first maximum (NaNs never win)
    n, m = x.shape
    for r in range(n):
        best = 0
        bv = x[r, 0]
        for j in range(1, m):
            if x[r, j] > bv:
                bv = x[r, j]
                best = j
        out[r] = best
