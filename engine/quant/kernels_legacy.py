"""Numba encoders for ggml's 32-element block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.

Each follows ggml's reference quantizer step by step in float32 arithmetic (scale from the block's
absolute maximum or its range, truncating/rounding rules as ggml has them), so the bytes equal what
`gguf.quants.quantize` (the executable spec) and llama.cpp write. Block layouts (little-endian):

    Q8_0 (34 B): f16 d, int8 qs[32]                       x = d * q
    Q4_0 (18 B): f16 d, qs[16] (lo nibble x[j], hi x[j+16])   x = d * (q - 8)
    Q4_1 (20 B): f16 d, f16 m, qs[16]                     x = d * q + m
    Q5_0 (22 B): f16 d, u32 qh (bit j = bit 4 of q[j]), qs[16]   x = d * (q - 16)
    Q5_1 (24 B): f16 d, f16 m, u32 qh, qs[16]             x = d * q + m
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

F0 = np.float32(0.0)
F1 = np.float32(1.0)
F_HALF = np.float32(0.5)
F8_5 = np.float32(8.5)
F16_5 = np.float32(16.5)
F127 = np.float32(127.0)
F15 = np.float32(15.0)
F31 = np.float32(31.0)
FM8 = np.float32(-8.0)
FM16 = np.float32(-16.0)


@njit(cache=True, nogil=True, inline="always")
def f16_round(x):
    """x (float32) rounded to the nearest float16 value (ties to even), returned as float32."""
    ax = abs(np.float64(x))
    if ax == 0.0 or not math.isfinite(ax):
        return x
    if ax < 6.103515625e-05:  # below 2**-14: float16 subnormals, spacing 2**-24
        r = np.rint(ax * 16777216.0) / 16777216.0
    else:
        m, e = math.frexp(ax)
        r = math.ldexp(np.rint(m * 2048.0), e - 11)
    if r > 65504.0:
        r = np.inf
    return np.float32(-r if x < 0 else r)


@njit(cache=True, nogil=True, inline="always")
def f16_bits(x):
    """The float16 bit pattern of x (float32), rounded to nearest even."""
    v = np.float64(f16_round(x))
    sign = 0x8000 if (v < 0.0 or (v == 0.0 and math.copysign(1.0, v) < 0.0)) else 0
    a = abs(v)
    if a == 0.0:
        return sign
    if a == np.inf:
        return sign | 0x7C00
    if a < 6.103515625e-05:
        return sign | int(np.rint(a * 16777216.0))
    m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    return sign | ((e + 14) << 10) | int(np.rint((m * 2.0 - 1.0) * 1024.0))


@njit(cache=True, nogil=True, inline="always")
def put_f16(out, pos, x):
    # out (n,) uint8: writes x as a little-endian float16 at out[pos:pos+2]
    b = f16_bits(x)
    out[pos] = b & 0xFF
    out[pos + 1] = b >> 8


@njit(cache=True, nogil=True, inline="always")
def round_away(x):
    # C roundf: halves away from zero
    return np.float32(math.floor(abs(x) + 0.5)) * (F1 if x >= 0 else -F1)


@njit(cache=True, nogil=True, parallel=True)
def quantize_q8_0(out, x):
    # x (rows, cols) float32 -> out (rows, cols//32*34) uint8
    rows, cols = x.shape
    for r in prange(rows):
        o = out[r]
        for b in range(cols // 32):
            amax = F0
            for j in range(32):
                v = abs(x[r, b * 32 + j])
                if v > amax:
                    amax = v
            d = amax / F127
            inv = F1 / d if d != 0 else F0
            put_f16(o, b * 34, d)
            for j in range(32):
                q = int(round_away(x[r, b * 32 + j] * inv))
                o[b * 34 + 2 + j] = q & 0xFF


@njit(cache=True, nogil=True, inline="always")
def _signed_max(x, r, start, n):
    # the element of largest magnitude (the first one on ties), with its sign
    amax = F0
    vmax = F0
    for j in range(n):
        v = x[r, start + j]
        if abs(v) > amax:
            amax = abs(v)
            vmax = v
    return vmax


@njit(cache=True, nogil=True, parallel=True)
def quantize_q4_0(out, x):
    # x (rows, cols) float32 -> out (rows, cols//32*18) uint8
    rows, cols = x.shape
    for r in prange(rows):
        o = out[r]
        for b in range(cols // 32):
            s = b * 32
            d = _signed_max(x, r, s, 32) / FM8
            inv = F1 / d if d != 0 else F0
            put_f16(o, b * 18, d)
            for j in range(16):
                q0 = min(15, int(x[r, s + j] * inv + F8_5))
                q1 = min(15, int(x[r, s + 16 + j] * inv + F8_5))
                o[b * 18 + 2 + j] = q0 | (q1 << 4)


@njit(cache=True, nogil=True, parallel=True)
def quantize_q4_1(out, x):
    # x (rows, cols) float32 -> out (rows, cols//32*20) uint8
    rows, cols = x.shape
    for r in prange(rows):
        o = out[r]
        for b in range(cols // 32):
            s = b * 32
            lo = x[r, s]
            hi = x[r, s]
            for j in range(1, 32):
                v = x[r, s + j]
                lo = min(lo, v)
                hi = max(hi, v)
            d = (hi - lo) / F15
            inv = F1 / d if d != 0 else F0
            put_f16(o, b * 20, d)
            put_f16(o, b * 20 + 2, lo)
            for j in range(16):
                q0 = min(15, int((x[r, s + j] - lo) * inv + F_HALF))
                q1 = min(15, int((x[r, s + 16 + j] - lo) * inv + F_HALF))
                o[b * 20 + 4 + j] = q0 | (q1 << 4)


@njit(cache=True, nogil=True, parallel=True)
def quantize_q5_0(out, x):
    # x (rows, cols) float32 -> out (rows, cols//32*22) uint8
    rows, cols = x.shape
    for r in prange(rows):
        o = out[r]
        for b in range(cols // 32):
            s = b * 32
            d = _signed_max(x, r, s, 32) / FM16
            inv = F1 / d if d != 0 else F0
            put_f16(o, b * 22, d)
            qh = 0
            for j in range(16):
                q0 = min(31, int(x[r, s + j] * inv + F16_5))
                q1 = min(31, int(x[r, s + 16 + j] * inv + F16_5))
                o[b * 22 + 6 + j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4)
                qh |= ((q0 >> 4) & 1) << j
                qh |= ((q1 >> 4) & 1) << (j + 16)
            for k in range(4):
                o[b * 22 + 2 + k] = (qh >> (8 * k)) & 0xFF


@njit(cache=True, nogil=True, parallel=True)
def quantize_q5_1(out, x):
    # x (rows, cols) float32 -> out (rows, cols//32*24) uint8
    rows, cols = x.shape
    for r in prange(rows):
        o = out[r]
        for b in range(cols // 32):
            s = b * 32
            lo = x[r, s]
            hi = x[r, s]
            for j in range(1, 32):
                v = x[r, s + j]
                lo = min(lo, v)
                hi = max(hi, v)
            d = (hi - lo) / F31
            inv = F1 / d if d != 0 else F0
            put_f16(o, b * 24, d)
            put_f16(o, b * 24 + 2, lo)
            qh = 0
            for j in range(16):
                q0 = min(31, int((x[r, s + j] - lo) * inv + F_HALF))
                q1 = min(31, int((x[r, s + 16 + j] - lo) * inv + F_HALF))
                o[b * 24 + 8 + j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4)
                qh |= ((q0 >> 4) & 1) << j
                qh |= ((q1 >> 4) & 1) << (j + 16)
            for k in range(4):
                o[b * 24 + 4 + k] = (qh >> (8 * k)) & 0xFF
