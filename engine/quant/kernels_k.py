"""Numba encoders for ggml's K-quants (super-blocks of 256): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

The scale search is ggml's reference one (no importance matrix), in float32:
  * Q4_K/Q5_K: per 32-element sub-block an affine fit x ~ scale*q - min, searched over nstep+1
    candidate inverse scales around nmax/(max-min) with weights av|x| + |x|, each candidate refit
    by weighted least squares (`_make_qkx2`); sub-block scales/mins then quantized to 6 bits
    against the super-block's f16 d/dmin and the 4/5-bit values recomputed from the quantized scales.
  * Q2_K: same affine search on 16-element sub-blocks, 2-bit values, weights |x|, absolute error;
    4-bit sub-block scales/mins.
  * Q3_K: symmetric 3-bit values per 16 elements with the iterative coordinate refinement of
    `_make_q3` (weights x^2); 6-bit signed sub-block scales.
  * Q6_K: symmetric 6-bit values per 16 elements, scale chosen from 19 candidates by weighted
    (x^2) least squares (`_make_qx`); int8 sub-block scales.

Block layouts (bytes, little-endian), as gguf.quants decodes them:
    Q2_K (84):  scales[16] (lo nibble scale, hi nibble min), qs[64], f16 d, f16 dmin
    Q3_K (110): hmask[32], qs[64], scales[12] (6-bit packed), f16 d
    Q4_K (144): f16 d, f16 dmin, scales[12] (6-bit packed scale/min pairs), qs[128]
    Q5_K (176): f16 d, f16 dmin, scales[12], qh[32], qs[128]
    Q6_K (210): ql[128], qh[64], int8 scales[16], f16 d
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from engine.quant.kernels_legacy import f16_round, put_f16

F0 = np.float32(0.0)
F1 = np.float32(1.0)
GROUP_MAX_EPS = np.float32(1e-15)
F63 = np.float32(63.0)
F15 = np.float32(15.0)
F32_ = np.float32(32.0)
FM32 = np.float32(-32.0)
FM128 = np.float32(-128.0)
F0_1 = np.float32(0.1)


@njit(cache=True, nogil=True, inline="always")
def _nint(v):
    return int(np.rint(v))


@njit(cache=True, nogil=True)
def _make_qkx2(n, nmax, x, w, L, Laux, rmin, rdelta, nstep, use_mad):
    """Affine fit x ~ scale*L - mn. x, w (n,) float32; L, Laux (n,) int32. Returns (scale, mn)."""
    lo = x[0]
    hi = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if lo > 0:
        lo = F0
    if hi == lo:
        for i in range(n):
            L[i] = 0
        return F0, -lo
    iscale = np.float32(nmax) / (hi - lo)
    scale = F1 / iscale
    best = F0
    for i in range(n):
        li = max(0, min(nmax, _nint(iscale * (x[i] - lo))))
        L[i] = li
        diff = scale * np.float32(li) + lo - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best += w[i] * diff
    if nstep < 1:
        return scale, -lo
    mn = lo
    for s in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(s) + np.float32(nmax)) / (hi - lo)
        sum_l = F0
        sum_l2 = F0
        sum_xl = F0
        for i in range(n):
            li = max(0, min(nmax, _nint(iscale * (x[i] - lo))))
            Laux[i] = li
            fl = np.float32(li)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > 0:
                this_min = F0
                this_scale = sum_xl / sum_l2
            err = F0
            for i in range(n):
                diff = this_scale * np.float32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                err += w[i] * diff
            if err < best:
                for i in range(n):
                    L[i] = Laux[i]
                best = err
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(cache=True, nogil=True)
def _make_q3(n, nmax, x, L):
    """Symmetric fit with coordinate refinement (weights x^2). L gets values in [0, 2*nmax)."""
    amax = F0
    vmax = F0
    for i in range(n):
        if abs(x[i]) > amax:
            amax = abs(x[i])
            vmax = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F0
    iscale = np.float32(-nmax) / vmax
    sumlx = F0
    suml2 = F0
    for i in range(n):
        li = max(-nmax, min(nmax - 1, _nint(iscale * x[i])))
        L[i] = li
        w = x[i] * x[i]
        sumlx += w * x[i] * np.float32(li)
        suml2 += w * np.float32(li) * np.float32(li)
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = x[i] * x[i]
            slx = sumlx - w * x[i] * np.float32(L[i])
            if slx > 0:
                sl2 = suml2 - w * np.float32(L[i]) * np.float32(L[i])
                new_l = max(-nmax, min(nmax - 1, _nint(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * x[i] * np.float32(new_l)
                    sl2 += w * np.float32(new_l) * np.float32(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else F0


@njit(cache=True, nogil=True)
def _make_qx(n, nmax, x, L):
    """Symmetric fit, best of 19 inverse scales by weighted (x^2) least squares. L in [0, 2*nmax)."""
    amax = F0
    vmax = F0
    for i in range(n):
        if abs(x[i]) > amax:
            amax = abs(x[i])
            vmax = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F0
    iscale = np.float32(-nmax) / vmax
    sumlx = F0
    suml2 = F0
    for i in range(n):
        li = max(-nmax, min(nmax - 1, _nint(iscale * x[i])))
        L[i] = li + nmax
        w = x[i] * x[i]
        sumlx += w * x[i] * np.float32(li)
        suml2 += w * np.float32(li) * np.float32(li)
    scale = sumlx / suml2 if suml2 != 0 else F0
    best = scale * sumlx
    for s in range(-9, 10):
        if s == 0:
            continue
        iscale = -(np.float32(nmax) + F0_1 * np.float32(s)) / vmax
        sumlx = F0
        suml2 = F0
        for i in range(n):
            li = max(-nmax, min(nmax - 1, _nint(iscale * x[i])))
            w = x[i] * x[i]
            sumlx += w * x[i] * np.float32(li)
            suml2 += w * np.float32(li) * np.float32(li)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, _nint(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True, nogil=True, inline="always")
def _scale_min_k4(j, q, base):
    # the 6-bit (scale, min) pair j of the 12 packed bytes q[base:base+12]
    if j < 4:
        return int(q[base + j]) & 63, int(q[base + j + 4]) & 63
    a = int(q[base + j + 4])
    sc = (a & 0x0F) | ((int(q[base + j - 4]) >> 6) << 4)
    mn = (a >> 4) | ((int(q[base + j]) >> 6) << 4)
    return sc, mn


@njit(cache=True, nogil=True, inline="always")
def _pack_scales_k4(o, base, j, ls, lm):
    if j < 4:
        o[base + j] = ls
        o[base + j + 4] = lm
    else:
        o[base + j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4)
        o[base + j - 4] |= (ls >> 4) << 6
        o[base + j] |= (lm >> 4) << 6


@njit(cache=True, nogil=True)
def _q45k_block(o, p, xb, nmax, rmin, nstep, L, Laux, w, scales, mins):
    # one Q4_K (nmax 15) or Q5_K (nmax 31) super-block: xb (256,) -> d, dmin, scales at o[p:p+16]; L codes
    max_scale = F0
    max_min = F0
    for j in range(8):
        xs = xb[32 * j : 32 * j + 32]
        sum_x2 = F0
        for i in range(32):
            sum_x2 += xs[i] * xs[i]
        av_x = np.float32(math.sqrt(sum_x2 / F32_))
        for i in range(32):
            w[i] = av_x + abs(xs[i])
        sc, mn = _make_qkx2(32, nmax, xs, w, L[32 * j : 32 * j + 32], Laux, rmin, F0_1, nstep, False)
        scales[j] = sc
        mins[j] = mn
        max_scale = max(max_scale, sc)
        max_min = max(max_min, mn)
    inv_scale = F63 / max_scale if max_scale > 0 else F0
    inv_min = F63 / max_min if max_min > 0 else F0
    for k in range(12):
        o[p + 4 + k] = 0
    for j in range(8):
        ls = min(63, _nint(inv_scale * scales[j]) & 0xFF)
        lm = min(63, _nint(inv_min * mins[j]) & 0xFF)
        _pack_scales_k4(o, p + 4, j, ls, lm)
    d = max_scale / F63
    dmin = max_min / F63
    put_f16(o, p, d)
    put_f16(o, p + 2, dmin)
    d16 = f16_round(d)
    dmin16 = f16_round(dmin)
    for j in range(8):
        sc, mn = _scale_min_k4(j, o, p + 4)
        dj = d16 * np.float32(sc)
        if dj == 0:
            continue
        dm = dmin16 * np.float32(mn)
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, _nint((xb[32 * j + i] + dm) / dj)))


@njit(cache=True, nogil=True, parallel=True)
def quantize_q4_k(out, x):
    # x (rows, cols) float32 -> out (rows, cols//256*144) uint8
    rows, cols = x.shape
    for r in prange(rows):
        L = np.empty(256, np.int32)
        Laux = np.empty(32, np.int32)
        w = np.empty(32, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        o = out[r]
        for b in range(cols // 256):
            p = b * 144
            _q45k_block(
                o, p, x[r, b * 256 : b * 256 + 256], 15, np.float32(-1.0), 20, L, Laux, w, scales, mins
            )
            for j in range(4):  # 64 values per 32 bytes: low nibbles first 32, high nibbles next 32
                for i in range(32):
                    o[p + 16 + 32 * j + i] = L[64 * j + i] | (L[64 * j + 32 + i] << 4)


@njit(cache=True, nogil=True, parallel=True)
def quantize_q5_k(out, x):
    # x (rows, cols) float32 -> out (rows, cols//256*176) uint8
    rows, cols = x.shape
    for r in prange(rows):
        L = np.empty(256, np.int32)
        Laux = np.empty(32, np.int32)
        w = np.empty(32, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        o = out[r]
        for b in range(cols // 256):
            p = b * 176
            _q45k_block(
                o, p, x[r, b * 256 : b * 256 + 256], 31, np.float32(-0.5), 15, L, Laux, w, scales, mins
            )
            for i in range(32):
                o[p + 16 + i] = 0
            m1 = 1
            m2 = 2
            for j in range(4):
                for i in range(32):
                    l1 = L[64 * j + i]
                    l2 = L[64 * j + 32 + i]
                    if l1 > 15:
                        l1 -= 16
                        o[p + 16 + i] |= m1
                    if l2 > 15:
                        l2 -= 16
                        o[p + 16 + i] |= m2
                    o[p + 48 + 32 * j + i] = l1 | (l2 << 4)
                m1 <<= 2
                m2 <<= 2


@njit(cache=True, nogil=True, parallel=True)
def quantize_q2_k(out, x):
    # x (rows, cols) float32 -> out (rows, cols//256*84) uint8
    rows, cols = x.shape
    q4 = np.float32(15.0)
    for r in prange(rows):
        L = np.empty(256, np.int32)
        Laux = np.empty(16, np.int32)
        w = np.empty(16, np.float32)
        scales = np.empty(16, np.float32)
        mins = np.empty(16, np.float32)
        o = out[r]
        for b in range(cols // 256):
            p = b * 84
            xb = x[r, b * 256 : b * 256 + 256]
            max_scale = F0
            max_min = F0
            for j in range(16):
                xs = xb[16 * j : 16 * j + 16]
                for i in range(16):
                    w[i] = abs(xs[i])
                sc, mn = _make_qkx2(
                    16, 3, xs, w, L[16 * j : 16 * j + 16], Laux, np.float32(-0.5), F0_1, 15, True
                )
                scales[j] = sc
                mins[j] = mn
                max_scale = max(max_scale, sc)
                max_min = max(max_min, mn)
            if max_scale > 0:
                iscale = q4 / max_scale
                for j in range(16):
                    o[p + j] = _nint(iscale * scales[j]) & 0xFF
                put_f16(o, p + 80, max_scale / q4)
            else:
                for j in range(16):
                    o[p + j] = 0
                put_f16(o, p + 80, F0)
            if max_min > 0:
                iscale = q4 / max_min
                for j in range(16):
                    o[p + j] = (int(o[p + j]) | (_nint(iscale * mins[j]) << 4)) & 0xFF
                put_f16(o, p + 82, max_min / q4)
            else:
                put_f16(o, p + 82, F0)
            d16 = f16_round(max_scale / q4) if max_scale > 0 else F0
            dmin16 = f16_round(max_min / q4) if max_min > 0 else F0
            for j in range(16):
                sm = int(o[p + j])
                dj = d16 * np.float32(sm & 0x0F)
                if dj == 0:
                    continue
                dm = dmin16 * np.float32(sm >> 4)
                for i in range(16):
                    L[16 * j + i] = max(0, min(3, _nint((xb[16 * j + i] + dm) / dj)))
            for h in range(2):
                for i in range(32):
                    k = 128 * h + i
                    o[p + 16 + 32 * h + i] = L[k] | (L[k + 32] << 2) | (L[k + 64] << 4) | (L[k + 96] << 6)


@njit(cache=True, nogil=True, parallel=True)
def quantize_q3_k(out, x):
    # x (rows, cols) float32 -> out (rows, cols//256*110) uint8
    rows, cols = x.shape
    for r in prange(rows):
        L = np.empty(256, np.int32)
        scales = np.empty(16, np.float32)
        qsc = np.empty(16, np.int64)
        o = out[r]
        for b in range(cols // 256):
            p = b * 110
            xb = x[r, b * 256 : b * 256 + 256]
            max_scale = F0
            amax = F0
            for j in range(16):
                sc = _make_q3(16, 4, xb[16 * j : 16 * j + 16], L[16 * j : 16 * j + 16])
                scales[j] = sc
                if abs(sc) > amax:
                    amax = abs(sc)
                    max_scale = sc
            sp = p + 96  # scales[12]
            for k in range(12):
                o[sp + k] = 0
            for j in range(16):
                qsc[j] = 32
            if max_scale != 0:
                iscale = FM32 / max_scale
                for j in range(16):
                    lv = max(-32, min(31, _nint(iscale * scales[j]))) + 32
                    qsc[j] = lv
                    if j < 8:
                        o[sp + j] = lv & 0x0F
                    else:
                        o[sp + j - 8] |= (lv & 0x0F) << 4
                    o[sp + 8 + j % 4] |= (lv >> 4) << (2 * (j // 4))
                d = F1 / iscale
                put_f16(o, p + 108, d)
                d16 = f16_round(d)
            else:
                put_f16(o, p + 108, F0)
                d16 = F0
            for j in range(16):
                dj = d16 * np.float32(qsc[j] - 32)
                if dj == 0:
                    continue
                for i in range(16):
                    L[16 * j + i] = max(-4, min(3, _nint(xb[16 * j + i] / dj))) + 4
            for k in range(32):
                o[p + k] = 0
            m = 0
            hm = 1
            for j in range(256):
                if L[j] > 3:
                    o[p + m] |= hm
                    L[j] -= 4
                m += 1
                if m == 32:
                    m = 0
                    hm <<= 1
            for h in range(2):
                for i in range(32):
                    k = 128 * h + i
                    o[p + 32 + 32 * h + i] = L[k] | (L[k + 32] << 2) | (L[k + 64] << 4) | (L[k + 96] << 6)


@njit(cache=True, nogil=True, parallel=True)
def quantize_q6_k(out, x):
    # x (rows, cols) float32 -> out (rows, cols//256*210) uint8
    rows, cols = x.shape
    for r in prange(rows):
        L = np.empty(256, np.int32)
        scales = np.empty(16, np.float32)
        o = out[r]
        for b in range(cols // 256):
            p = b * 210
            xb = x[r, b * 256 : b * 256 + 256]
            max_scale = F0
            max_abs = F0
            for j in range(16):
                sc = _make_qx(16, 32, xb[16 * j : 16 * j + 16], L[16 * j : 16 * j + 16])
                scales[j] = sc
                if abs(sc) > max_abs:
                    max_abs = abs(sc)
                    max_scale = sc
            if max_abs < GROUP_MAX_EPS:
                for k in range(210):
                    o[p + k] = 0
                continue
            iscale = FM128 / max_scale
            d = F1 / iscale
            put_f16(o, p + 208, d)
            d16 = f16_round(d)
            for j in range(16):
                o[p + 192 + j] = min(127, _nint(iscale * scales[j])) & 0xFF
            for j in range(16):
                isc = int(o[p + 192 + j])
                if isc > 127:
                    isc -= 256
                dj = d16 * np.float32(isc)
                if dj == 0:
                    continue
                for i in range(16):
                    L[16 * j + i] = max(-32, min(31, _nint(xb[16 * j + i] / dj))) + 32
            for h in range(2):
                for i in range(32):
                    k = 128 * h + i
                    q1 = L[k] & 0x0F
                    q2 = L[k + 32] & 0x0F
                    q3 = L[k + 64] & 0x0F
                    q4 = L[k + 96] & 0x0F
                    o[p + 64 * h + i] = q1 | (q3 << 4)
                    o[p + 64 * h + 32 + i] = q2 | (q4 << 4)
                    o[p + 128 + 32 * h + i] = (
                        (L[k] >> 4)
                        | ((L[k + 32] >> 4) << 2)
                        | ((L[k + 64] >> 4) << 4)
                        | ((L[k + 96] >> 4) << 6)
                    )
