// Matrix-vector products read straight from GGUF blocks, and row dequantization (prefill tiles,
// embeddings). Layouts as engine/backends/cpu/quant.py and _llvm_kquant.py describe them; every
// type has one decoder dec_<type>(block, sub, v) that writes the 32 values of sub-block `sub`
// (0 for 32-element types, 0..7 for the 256-element K-quants), so the matvec and the dequant
// kernels cannot disagree.

__device__ __forceinline__ void dec_q8_0(const uchar* b, int s, float* v) {
    float d = ldh(b);
    const signed char* q = (const signed char*)(b + 2);
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = d * (float)q[i];
}
__device__ __forceinline__ void dec_q4_0(const uchar* b, int s, float* v) {
    float d = ldh(b);
    const uchar* q = b + 2;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        v[j] = d * (float)((q[j] & 15) - 8);
        v[j + 16] = d * (float)((q[j] >> 4) - 8);
    }
}
__device__ __forceinline__ void dec_q4_1(const uchar* b, int s, float* v) {
    float d = ldh(b), m = ldh(b + 2);
    const uchar* q = b + 4;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        v[j] = d * (float)(q[j] & 15) + m;
        v[j + 16] = d * (float)(q[j] >> 4) + m;
    }
}
__device__ __forceinline__ uint ld32_2(const uchar* p) {  // u32 at a 2-byte-aligned address
    const ushort* h = (const ushort*)p;
    return (uint)h[0] | ((uint)h[1] << 16);
}
// (hi:lo) >> s, low 32 bits, s in 0..31 (one funnel shift)
__device__ __forceinline__ uint funnel_r(uint lo, uint hi, int s) {
#ifdef __CUDA_ARCH__
    uint d;
    asm("shf.r.clamp.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(s));
    return d;
#else
    return s ? (lo >> s) | (hi << (32 - s)) : lo;
#endif
}
// N consecutive u32 at a 2-byte-aligned address p: the N aligned words from p rounded down and a 16-bit
// load of the last two bytes, funnel-shifted (N + 1 loads, branch-free, instead of 2N 16-bit ones).
// Reads nothing outside [p - 2, p + 4N) (and p - 2 only when p is not 4-byte aligned). extra (0..15)
// shifts each word right by that many bits more in the same funnel shift: its top extra bits are then
// the next byte's low bits (unspecified for the last word).
template <int N>
__device__ __forceinline__ void ld32n_2(const uchar* p, uint* out, int extra = 0) {
    int s = (int)((unsigned long long)p & 2ULL) * 8;
    const uint* w = (const uint*)((unsigned long long)p & ~3ULL);
    uint cur = w[0];
#pragma unroll
    for (int i = 0; i < N; i++) {
        uint next = i + 1 < N ? w[i + 1] : (uint)*(const ushort*)(p + 4 * N - 2);
        out[i] = funnel_r(cur, next, s + extra);
        cur = next;
    }
}
// N consecutive u32 at any address p (MXFP4's 17-byte blocks): the aligned words holding bytes of
// [p, p + 4N), funnel-shifted (N + 1 loads, N when p is 4-byte aligned); reads nothing outside them.
template <int N>
__device__ __forceinline__ void ld32n_1(const uchar* p, uint* out) {
    int s = (int)((unsigned long long)p & 3ULL) * 8;
    const uint* w = (const uint*)((unsigned long long)p & ~3ULL);
    uint cur = w[0];
#pragma unroll
    for (int i = 0; i < N; i++) {
        uint next = i + 1 < N || s ? w[i + 1] : 0u;
        out[i] = funnel_r(cur, next, s);
        cur = next;
    }
}
__device__ __forceinline__ void dec_q5_0(const uchar* b, int s, float* v) {
    float d = ldh(b);
    uint qh = ld32_2(b + 2);
    const uchar* q = b + 6;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        v[j] = d * (float)((int)((q[j] & 15) | (((qh >> j) & 1) << 4)) - 16);
        v[j + 16] = d * (float)((int)((q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}
__device__ __forceinline__ void dec_q5_1(const uchar* b, int s, float* v) {
    float d = ldh(b), m = ldh(b + 2);
    uint qh = ld32_2(b + 4);
    const uchar* q = b + 8;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        v[j] = d * (float)((q[j] & 15) | (((qh >> j) & 1) << 4)) + m;
        v[j + 16] = d * (float)((q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
}
// Q2_K: 16 scales | 64 qs | f16 d | f16 dmin; sub-block s = 4n + t reads qs[32n..] >> 2t
__device__ __forceinline__ void dec_q2_k(const uchar* b, int s, float* v) {
    float d = ldh(b + 80), dmin = ldh(b + 82);
    int n = s >> 2, t = s & 3;
    const uchar* q = b + 16 + 32 * n;
    uchar sc0 = b[2 * s], sc1 = b[2 * s + 1];
    float d0 = d * (float)(sc0 & 15), m0 = dmin * (float)(sc0 >> 4);
    float d1 = d * (float)(sc1 & 15), m1 = dmin * (float)(sc1 >> 4);
#pragma unroll
    for (int l = 0; l < 16; l++) {
        v[l] = d0 * (float)((q[l] >> (2 * t)) & 3) - m0;
        v[l + 16] = d1 * (float)((q[l + 16] >> (2 * t)) & 3) - m1;
    }
}
// Q3_K: 32 hmask | 64 qs | 12 scales (6-bit, -32) | f16 d
__device__ __forceinline__ int q3k_scale(const uchar* sc, int i) {
    int low = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4);
    int high = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (low | (high << 4)) - 32;
}
__device__ __forceinline__ void dec_q3_k(const uchar* b, int s, float* v) {
    float d = ldh(b + 108);
    int n = s >> 2, t = s & 3;
    const uchar* hm = b;
    const uchar* q = b + 32 + 32 * n;
    float d0 = d * (float)q3k_scale(b + 96, 2 * s), d1 = d * (float)q3k_scale(b + 96, 2 * s + 1);
    uchar m = (uchar)(1u << s);
#pragma unroll
    for (int l = 0; l < 16; l++) {
        v[l] = d0 * (float)((int)((q[l] >> (2 * t)) & 3) - ((hm[l] & m) ? 0 : 4));
        v[l + 16] = d1 * (float)((int)((q[l + 16] >> (2 * t)) & 3) - ((hm[l + 16] & m) ? 0 : 4));
    }
}
// Q4_K / Q5_K block header h (the block's first 16 bytes, one 128-bit load: f16 d | f16 dmin | 12
// scale bytes q[0..11] in h.y, h.z, h.w): the 6-bit scales and mins of sub-blocks 4 half .. 4 half + 3,
// one a byte (byte i: sub-block 4 half + i) of *sc and *mn. Sub-block j < 4: q[j] & 63, q[j + 4] & 63;
// else the low nibbles of q[j + 4] and the top bits of q[j - 4] (scale), the high nibbles of q[j + 4]
// and the top bits of q[j] (min): a few word operations for four of them.
__device__ __forceinline__ void scales_k4(uint4 h, int half, uint* sc, uint* mn) {
    *sc = half ? (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u) : h.y & 0x3F3F3F3Fu;
    *mn = half ? ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u) : h.z & 0x3F3F3F3Fu;
}
// sub-block j's scale and min as floats
__device__ __forceinline__ void scale_min_k4(int j, uint4 h, float* sc, float* mn) {
    uint s, m;
    scales_k4(h, j >> 2, &s, &m);
    int sh = 8 * (j & 3);
    *sc = (float)((s >> sh) & 255u);
    *mn = (float)((m >> sh) & 255u);
}
__device__ __forceinline__ float k4_d(uint4 h) { return h2f((ushort)(h.x & 0xffffu)); }
__device__ __forceinline__ float k4_dmin(uint4 h) { return h2f((ushort)(h.x >> 16)); }
// Q4_K: f16 d | f16 dmin | 12 scales | 128 qs; qs of sub-block s: bytes [32(s/2), +32) >> 4(s%2).
// The block is 144 bytes (a multiple of 16), so the qs come in as two 128-bit loads.
__device__ __forceinline__ void dec_q4_k(const uchar* b, int s, float* v) {
    uint4 h = *(const uint4*)b;
    float sc, mn;
    scale_min_k4(s, h, &sc, &mn);
    float ds = k4_d(h) * sc, dm = k4_dmin(h) * mn;
    const uint4* q4 = (const uint4*)(b + 16 + 32 * (s >> 1));
    uint4 a = q4[0], c = q4[1];
    uint w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
    int sh = 4 * (s & 1);
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = ds * (float)((w[i >> 2] >> (8 * (i & 3) + sh)) & 15) - dm;
}
// Q5_K: as Q4_K with 32 qh bytes before the qs (bit s of qh[l] is the 5th bit of element l)
__device__ __forceinline__ void dec_q5_k(const uchar* b, int s, float* v) {
    uint4 hd = *(const uint4*)b;  // a 176-byte block: 16-byte aligned
    float sc, mn;
    scale_min_k4(s, hd, &sc, &mn);
    float ds = k4_d(hd) * sc, dm = k4_dmin(hd) * mn;
    const uint4* h4 = (const uint4*)(b + 16);
    const uint4* q4 = (const uint4*)(b + 48 + 32 * (s >> 1));
    uint4 a = q4[0], c = q4[1], ha = h4[0], hc = h4[1];
    uint w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
    uint h[8] = {ha.x, ha.y, ha.z, ha.w, hc.x, hc.y, hc.z, hc.w};
    int sh = 4 * (s & 1);
#pragma unroll
    for (int i = 0; i < 32; i++) {
        int lo = (w[i >> 2] >> (8 * (i & 3) + sh)) & 15;
        int hi = (h[i >> 2] >> (8 * (i & 3) + s)) & 1;
        v[i] = ds * (float)(lo | (hi << 4)) - dm;
    }
}
// Q6_K: 128 ql | 64 qh | 16 int8 scales | f16 d; sub-block s = 4n + t: ql[64n + 32(t&1)] >> 4(t>>1),
// qh[32n] >> 2t, scale 8n + 2t + l/16
__device__ __forceinline__ void dec_q6_k(const uchar* b, int s, float* v) {
    float d = ldh(b + 208);
    int n = s >> 2, t = s & 3;
    const uchar* ql = b + 64 * n + 32 * (t & 1);
    const uchar* qh = b + 128 + 32 * n;
    const signed char* sc = (const signed char*)(b + 192 + 8 * n + 2 * t);
    float d0 = d * (float)sc[0], d1 = d * (float)sc[1];
    int sl = 4 * (t >> 1), shh = 2 * t;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int q = (int)(((ql[l] >> sl) & 15) | (((qh[l] >> shh) & 3) << 4)) - 32;
        v[l] = (l < 16 ? d0 : d1) * (float)q;
    }
}

// IQ4_NL / IQ4_XS: 4-bit indices into a non-linear codebook of 16 int8 values (gguf's
// IQ4_NL.kvalues), here as four words, byte i of the four the value of index i
#define IQ4_T0 0xBFAD9881u  // -127 -104 -83 -65
#define IQ4_T1 0xF6EADDCFu  //  -49  -35 -22 -10
#define IQ4_T2 0x26190D01u  //    1   13  25  38
#define IQ4_T3 0x71594535u  //   53   69  89 113
// MXFP4's E2M1 values doubled, so that they are integers (gguf's MXFP4.kvalues), the same way
#define MXFP4_T0 0x03020100u  //  0  1  2   3
#define MXFP4_T1 0x0C080604u  //  4  6  8  12
#define MXFP4_T2 0xFDFEFF00u  //  0 -1 -2  -3
#define MXFP4_T3 0xF4F8FAFCu  // -4 -6 -8 -12
// value i of a 16-entry int8 table held as four words t0..t3
__device__ __forceinline__ float lut4_value(int i, uint t0, uint t1, uint t2, uint t3) {
    uint w = i < 8 ? (i < 4 ? t0 : t1) : (i < 12 ? t2 : t3);
    return (float)(signed char)(w >> (8 * (i & 3)));
}
// sixteen indices (bytes j: element j low, element j + 16 high) -> 32 values d * table value
__device__ __forceinline__ void dec_lut4(const uchar* q, float d, uint t0, uint t1, uint t2, uint t3, float* v) {
#pragma unroll
    for (int j = 0; j < 16; j++) {
        v[j] = d * lut4_value(q[j] & 15, t0, t1, t2, t3);
        v[j + 16] = d * lut4_value(q[j] >> 4, t0, t1, t2, t3);
    }
}
__device__ __forceinline__ void dec_iq4(const uchar* q, float d, float* v) {
    dec_lut4(q, d, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3, v);
}
// IQ4_NL: f16 d | 16 qs
__device__ __forceinline__ void dec_iq4_nl(const uchar* b, int s, float* v) { dec_iq4(b + 2, ldh(b), v); }
// IQ4_XS: f16 d | u16 scales_h | 4 scales_l | 128 qs; sub-block s: the 6-bit scale (nibble s % 2 of
// scales_l[s / 2], bits 2s and 2s + 1 of scales_h above it) less 32, its 16 qs bytes at 8 + 16 s
__device__ __forceinline__ int iq4xs_scale(uint head_hi, uint scales_l, int s) {
    return (int)(((scales_l >> (4 * s)) & 15u) | (((head_hi >> (2 * s)) & 3u) << 4)) - 32;
}
__device__ __forceinline__ void dec_iq4_xs(const uchar* b, int s, float* v) {
    uint h = (uint)b[2] | ((uint)b[3] << 8);
    uint l = (uint)b[4] | ((uint)b[5] << 8) | ((uint)b[6] << 16) | ((uint)b[7] << 24);
    dec_iq4(b + 8 + 16 * s, ldh(b) * (float)iq4xs_scale(h, l, s), v);
}

// MXFP4: u8 e (E8M0) | 16 qs (IQ4_NL's nibbles); value 2^(e-127) E2M1 = 2^(e-128) times the doubled
// value. 2^(e-128) as ggml_e8m0_to_fp32_half: the bits (e - 1) << 23, or the denormals 2^-128, 2^-127
// for e = 0, 1 (ggml writes all-zero blocks with e = 0); NVRTC_OPTIONS has no --use_fast_math, so
// they are not flushed.
__device__ __forceinline__ float e8m0_half(uint e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}
__device__ __forceinline__ void dec_mxfp4(const uchar* b, int s, float* v) {
    dec_lut4(b + 1, e8m0_half(b[0]), MXFP4_T0, MXFP4_T1, MXFP4_T2, MXFP4_T3, v);
}

// FP8 E4M3 and NVFP4, the safetensors formats (layouts as engine/backends/cpu/fpquant.py gives them):
//   FP8:   codes (rows, cols) uint8 E4M3 and a float32 scale per row
//   NVFP4: codes (rows, cols/2) uint8, element 2i in the low nibble of byte i; E4M3 block scales
//          (rows, cols/16) uint8; one float32 global scale per matrix
// Codes widen to halves, then to float. sm_89+ converts two E4M3 codes in one instruction
// (cvt.rn.f16x2.e4m3x2, exact values); elsewhere (and in the host builds of the tests) their bits move
// into the half's fields as the CPU kernels do, which leaves value / 256: E4M3_UNIT is what a decoded
// code must be multiplied by, folded into the row / global scale. E2M1 moves into a half the same way
// everywhere (value / 16384), subnormal codes included. The E4M3 NaN codes (0x7F/0xFF) are no weights
// (the encoders never write them): NaN through cvt, +-480 through the bit moves.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define E4M3_UNIT 1.f
#else
#define E4M3_UNIT 256.f
#endif
#define E2M1_UNIT 16384.f

// two E4M3 codes (the low 16 bits of p, low byte first) -> two halves (low half first), value / E4M3_UNIT
__device__ __forceinline__ uint e4m3x2_h2(uint p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((ushort)p));
    return h;
#else
    // s eeee mmm -> half s 0eeee mmm0000000
    return ((p & 0x80u) << 8) | ((p & 0x7Fu) << 7) | ((p & 0x8000u) << 16) | ((p & 0x7F00u) << 15);
#endif
}
// the two E2M1 codes of byte q (low nibble first) -> two halves, value / E2M1_UNIT
__device__ __forceinline__ uint e2m1x2_h2(uint q) {
    // s ee m -> half s 000ee m000000000
    return ((q & 0x8u) << 12) | ((q & 0x7u) << 9) | ((q & 0x80u) << 24) | ((q & 0x70u) << 21);
}
__device__ __forceinline__ void h2_to_f2(uint h, float* v) {
    v[0] = h2f((ushort)(h & 0xffffu));
    v[1] = h2f((ushort)(h >> 16));
}
// FP8: the 32 codes at b (16-byte aligned) -> E4M3 values / E4M3_UNIT (times the row scale elsewhere)
__device__ __forceinline__ void dec_fp8(const uchar* b, float* v) {
    const uint4* q4 = (const uint4*)b;
    uint4 a = q4[0], c = q4[1];
    uint w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        h2_to_f2(e4m3x2_h2(w[i] & 0xffffu), v + 4 * i);
        h2_to_f2(e4m3x2_h2(w[i] >> 16), v + 4 * i + 2);
    }
}
// NVFP4: the 16 code bytes at q (16-byte aligned: 32 elements, two blocks) -> E2M1 values / E2M1_UNIT,
// unscaled; the two block scales at sc (2-byte aligned) -> E4M3 values / E4M3_UNIT
__device__ __forceinline__ void dec_nvfp4_codes(const uchar* q, const uchar* sc, float* v, float* s) {
    uint4 a = *(const uint4*)q;
    uint w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int k = 0; k < 4; k++) h2_to_f2(e2m1x2_h2(w[i] >> (8 * k)), v + 8 * i + 2 * k);
    }
    h2_to_f2(e4m3x2_h2(*(const ushort*)sc), s);
}
// NVFP4: 32 elements with their block scales applied (value / (E2M1_UNIT * E4M3_UNIT), before the
// global scale)
__device__ __forceinline__ void dec_nvfp4(const uchar* q, const uchar* sc, float* v) {
    float s[2];
    dec_nvfp4_codes(q, sc, v, s);
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] *= s[i >> 4];
}

// Activations for a matvec, built in shared memory by the whole block:
//   prologue 0: x; 1: rmsnorm(x) * nw (the layer's input norm, fused); 2: silu(x) * x2; 3: gelu_tanh(x) * x2;
//   6: relu(x)^2 (Nemotron-H's MLP, not gated).
// transposed: element e goes to sx[(e % 32) * units + e / 32], so the 32 lanes of a warp, each on its
// own 32-element unit, read 32 consecutive words (no bank conflicts).
__device__ __forceinline__ void load_x(float* sx, const float* __restrict__ x, const float* __restrict__ x2,
                                       const float* __restrict__ nw, float eps, int cols, int prologue,
                                       int transposed) {
    __shared__ float red[32];
    float inv = 1.f;
    if (prologue == 1) {
        float ss = 0.f;
        for (int e = threadIdx.x; e < cols; e += blockDim.x) ss += x[e] * x[e];
        ss = block_sum(ss, red);
        inv = rsqrtf(ss / (float)cols + eps);
    }
    int units = cols >> 5;
    for (int e = threadIdx.x; e < cols; e += blockDim.x) {
        float a = x[e];
        if (prologue == 1) a = a * inv * nw[e];
        else if (prologue == 2) a = silu(a) * x2[e];
        else if (prologue == 3) a = gelu_tanh(a) * x2[e];
        else if (prologue == 6) a = relu2(a);
        sx[transposed ? (e & 31) * units + (e >> 5) : e] = a;
    }
    __syncthreads();
}

// The row r of up to three matrices stacked (q|k|v or gate|up in one launch); all share cols and type.
__device__ __forceinline__ const uchar* stacked_row(const uchar* w0, const uchar* w1, const uchar* w2,
                                                   int rows0, int rows1, int r, long long row_bytes) {
    if (r < rows0) return w0 + (long long)r * row_bytes;
    if (r < rows0 + rows1) return w1 + (long long)(r - rows0) * row_bytes;
    return w2 + (long long)(r - rows0 - rows1) * row_bytes;
}

// The float kernels' batch: B <= FMV_MAX_BATCH activation vectors x_b = x + b * ldx (x2 likewise), each
// built by load_x in shared memory at sx + b * cols; outputs out[b * ldo + r]. Each weight row is read
// once for the B of them (ops.matvec_batch). A body templated on MAXB (its accumulators a row) makes two
// kernels (FMV_KERNELS): matvec_NAME for one vector (B = 1: one accumulator, the registers it always
// had) and matvec_NAME_batch for up to FMV_MAX_BATCH.
#define FMV_MAX_BATCH 8
#define FMV_KERNELS(NAME, PARAMS, ARGS)                                                                   \
    extern "C" __global__ void __launch_bounds__(256) matvec_##NAME PARAMS { NAME##_rows<1> ARGS; }      \
    extern "C" __global__ void __launch_bounds__(256) matvec_##NAME##_batch PARAMS {                     \
        NAME##_rows<FMV_MAX_BATCH> ARGS;                                                                 \
    }
__device__ __forceinline__ void load_batch(float* sx, const float* __restrict__ x, const float* __restrict__ x2,
                                           long long ldx, const float* __restrict__ nw, float eps, int cols,
                                           int prologue, int transposed, int B) {
    for (int b = 0; b < B; b++)
        load_x(sx + (long long)b * cols, x + b * ldx, x2 ? x2 + b * ldx : x2, nw, eps, cols, prologue, transposed);
}

// acc[b] summed over the warp, times scale, to out[b * ldo + r] (= or +=), for b < B <= MAXB
template <int MAXB>
__device__ __forceinline__ void store_batch(float* __restrict__ out, long long ldo, int r, const float* acc,
                                            float scale, int B, int lane, int accumulate) {
#pragma unroll
    for (int b = 0; b < MAXB; b++) {
        if (b < B) {
            float a = warp_sum(acc[b]) * scale;
            float* o = out + b * ldo + r;
            if (lane == 0) *o = accumulate ? *o + a : a;
        }
    }
}

// A dequant launch's thread: unit *u of row *row (ids[i], or r0 + i) of the weight; false past the
// n rows' units (such a thread still calls store_staged).
__device__ __forceinline__ bool dequant_item(int n, int units, const int* ids, int r0, long long* row, int* u) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * units) return false;
    int i = (int)(idx / units);
    *u = (int)(idx % units);
    *row = ids ? ids[i] : (long long)(r0 + i);
    return true;
}

// Every thread's 32 values (its unit: elements 32 idx.. of out), times scale, to out (float32, or
// float16 bits when half_out). A block's units lie back to back in out, so they are staged in shared
// memory and written by consecutive threads in 16-byte stores that fill whole 32-byte sectors (a
// thread storing its own 32 values would touch a sector for every 4 or 16 bytes it writes).
// Called by every thread of a block of 256 (no early return); ok: this thread has a unit (idx < units).
__device__ __forceinline__ void store_staged(void* __restrict__ out, long long units, const float* v, float scale,
                                             int half_out, bool ok) {
    __shared__ uint4 stage[256 * 8];
    int t = threadIdx.x, per = half_out ? 4 : 8;  // 16-byte words per unit
    if (ok) {
        uint4* st = stage + t * per;
        if (half_out) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float* e = v + 8 * j;
                uint w[4];
#pragma unroll
                for (int k = 0; k < 4; k++) w[k] = (uint)f2h(e[2 * k] * scale) | ((uint)f2h(e[2 * k + 1] * scale) << 16);
                st[j] = make_uint4(w[0], w[1], w[2], w[3]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float* e = v + 4 * j;
                st[j] = make_uint4(__float_as_uint(e[0] * scale), __float_as_uint(e[1] * scale),
                                   __float_as_uint(e[2] * scale), __float_as_uint(e[3] * scale));
            }
        }
    }
    __syncthreads();
    long long first = (long long)blockIdx.x * 256;
    int words = (int)min(256LL, units - first) * per;
    uint4* o = (uint4*)out + first * per;
    for (int k = t; k < words; k += 256) o[k] = stage[k];
}

// out[b * ldo + r] (=, or += when accumulate) = ([W0; W1; W2] (.., cols) @ act(x_b))[r] for the B
// vectors (load_batch). 256 threads = 8 warps, one row per warp at a time, rows grid-strided; lane l
// takes 32-element units l, l+32, ... of the row (consecutive lanes read consecutive blocks). Dynamic
// shared memory: B * cols floats.
#define QMATVEC(NAME, BYTES, SUBS)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) matvec_##NAME(                                      \
        float* __restrict__ out, const uchar* __restrict__ w0, const uchar* __restrict__ w1,               \
        const uchar* __restrict__ w2, int rows0, int rows1, int rows2, int cols,                           \
        const float* __restrict__ x, const float* __restrict__ x2, const float* __restrict__ nw, float eps, \
        int prologue, int accumulate, int B, long long ldx, long long ldo) {                               \
        extern __shared__ float sx[];                                                                      \
        load_batch(sx, x, x2, ldx, nw, eps, cols, prologue, 1, B);                                         \
        int units = cols >> 5, rows = rows0 + rows1 + rows2;                                               \
        long long row_bytes = (long long)(units / SUBS) * BYTES;                                           \
        int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;                                              \
        for (int r = blockIdx.x * 8 + warp; r < rows; r += gridDim.x * 8) {                                \
            const uchar* w = stacked_row(w0, w1, w2, rows0, rows1, r, row_bytes);                          \
            float acc[FMV_MAX_BATCH] = {};                                                                 \
            for (int u = lane; u < units; u += 32) {                                                       \
                float v[32];                                                                               \
                dec_##NAME(w + (long long)(u / SUBS) * BYTES, u % SUBS, v);                                \
                _Pragma("unroll") for (int b = 0; b < FMV_MAX_BATCH; b++) {                                \
                    if (b < B) {                                                                           \
                        const float* xb = sx + (long long)b * cols + u;                                    \
                        _Pragma("unroll") for (int i = 0; i < 32; i++) acc[b] = fmaf(v[i], xb[i * units], acc[b]); \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            store_batch<FMV_MAX_BATCH>(out, ldo, r, acc, 1.f, B, lane, accumulate);                        \
        }                                                                                                  \
    }

QMATVEC(q8_0, 34, 1)
QMATVEC(q4_0, 18, 1)
QMATVEC(q4_1, 20, 1)
QMATVEC(q5_0, 22, 1)
QMATVEC(q5_1, 24, 1)
QMATVEC(q2_k, 84, 8)
QMATVEC(q3_k, 110, 8)
QMATVEC(q4_k, 144, 8)
QMATVEC(q5_k, 176, 8)
QMATVEC(q6_k, 210, 8)
QMATVEC(iq4_nl, 18, 1)
QMATVEC(iq4_xs, 136, 8)
QMATVEC(mxfp4, 17, 1)

// Float types: 8 elements (F16/BF16) or 4 (F32) per 128-bit load, lanes on consecutive loads; B vectors
// as QMATVEC's. Rows must be 16-byte aligned (cols a multiple of 8, weights in their own allocation:
// checked by the caller). x in shared memory in natural order. (unpack8_f16 and co.: common.cuh)
#define FMATVEC(NAME, PER, ESIZE)                                                                         \
    template <int MAXB>                                                                                    \
    __device__ __forceinline__ void NAME##_rows(                                                           \
        float* __restrict__ out, const uchar* __restrict__ w0, const uchar* __restrict__ w1,               \
        const uchar* __restrict__ w2, int rows0, int rows1, int rows2, int cols,                           \
        const float* __restrict__ x, const float* __restrict__ x2, const float* __restrict__ nw, float eps, \
        int prologue, int accumulate, int B, long long ldx, long long ldo) {                               \
        extern __shared__ float sx[];                                                                      \
        load_batch(sx, x, x2, ldx, nw, eps, cols, prologue, 0, B);                                         \
        int loads = cols / PER, rows = rows0 + rows1 + rows2;                                              \
        long long row_bytes = (long long)cols * ESIZE;                                                     \
        int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;                                              \
        for (int r = blockIdx.x * 8 + warp; r < rows; r += gridDim.x * 8) {                                \
            const uint4* w = (const uint4*)stacked_row(w0, w1, w2, rows0, rows1, r, row_bytes);            \
            float acc[MAXB] = {};                                                                          \
            for (int u = lane; u < loads; u += 32) {                                                       \
                float v[PER];                                                                              \
                unpack##PER##_##NAME(w[u], v);                                                             \
                _Pragma("unroll") for (int b = 0; b < MAXB; b++) {                                         \
                    if (b < B) {                                                                           \
                        const float4* s4 = (const float4*)(sx + (long long)b * cols + u * PER);            \
                        _Pragma("unroll") for (int i = 0; i < PER / 4; i++) {                              \
                            float4 a = s4[i];                                                              \
                            acc[b] = fmaf(v[4 * i], a.x, fmaf(v[4 * i + 1], a.y, fmaf(v[4 * i + 2], a.z, fmaf(v[4 * i + 3], a.w, acc[b])))); \
                        }                                                                                  \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            store_batch<MAXB>(out, ldo, r, acc, 1.f, B, lane, accumulate);                                 \
        }                                                                                                  \
    }                                                                                                      \
    FMV_KERNELS(NAME,                                                                                      \
                (float* __restrict__ out, const uchar* __restrict__ w0, const uchar* __restrict__ w1,      \
                 const uchar* __restrict__ w2, int rows0, int rows1, int rows2, int cols,                  \
                 const float* __restrict__ x, const float* __restrict__ x2, const float* __restrict__ nw,   \
                 float eps, int prologue, int accumulate, int B, long long ldx, long long ldo),            \
                (out, w0, w1, w2, rows0, rows1, rows2, cols, x, x2, nw, eps, prologue, accumulate, B, ldx, ldo)) \
    extern "C" __global__ void dequant_##NAME(void* __restrict__ out, const uchar* __restrict__ w,          \
                                              const int* __restrict__ ids, int r0, int n, int cols,   \
                                              int half_out, float scale) {                                 \
        int loads = cols / PER;                                                                            \
        long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                  \
        if (idx >= (long long)n * loads) return;                                                           \
        int i = (int)(idx / loads), u = (int)(idx % loads);                                                \
        long long row = ids ? ids[i] : (long long)(r0 + i);                                                \
        float v[PER];                                                                                      \
        unpack##PER##_##NAME(((const uint4*)(w + row * (long long)cols * ESIZE))[u], v);                   \
        long long o = (long long)i * cols + (long long)u * PER;                                            \
        /* vector stores: consecutive threads fill consecutive 16-byte words */                            \
        if (half_out) {                                                                                    \
            uint h[4];                                                                                     \
            for (int j = 0; j < PER / 2; j++)                                                              \
                h[j] = (uint)f2h(v[2 * j] * scale) | ((uint)f2h(v[2 * j + 1] * scale) << 16);              \
            if (PER == 8) ((uint4*)((ushort*)out + o))[0] = make_uint4(h[0], h[1], h[2], h[3]);           \
            else ((uint2*)((ushort*)out + o))[0] = make_uint2(h[0], h[1]);                                 \
        } else {                                                                                           \
            for (int j = 0; j < PER; j += 4)                                                               \
                ((float4*)((float*)out + o + j))[0] = make_float4(v[j] * scale, v[j + 1] * scale,          \
                                                                  v[j + 2] * scale, v[j + 3] * scale);     \
        }                                                                                                  \
    }

FMATVEC(f16, 8, 2)
FMATVEC(bf16, 8, 2)
FMATVEC(f32, 4, 4)

// Mixture-of-experts matvecs over float experts (Hugging Face folders' BF16/F16/F32), as step.cu's
// matvec_qb_experts: slot s = blockIdx.y runs the float kernel's one-vector body over expert ids[s]'s rows
// of the merged tensors w0 (and w1, of the same type: gate then up), e0 (e1) bytes per expert apart, on
// x + (s / group) ldx (prologue 2: x2 at + x2_off), into out + s ostep.
#define FMV_EXPERTS(NAME)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) matvec_##NAME##_experts(                           \
        float* __restrict__ out, long long ostep, const uchar* __restrict__ w0, const uchar* __restrict__ w1, \
        long long e0, long long e1, int rows0, int rows1, int cols, const float* __restrict__ x,          \
        long long ldx, int group, long long x2_off, const float* __restrict__ nw, float eps, int prologue, \
        const int* __restrict__ ids) {                                                                     \
        int s = blockIdx.y;                                                                                \
        long long e = ids[s];                                                                              \
        const float* xs = x + (long long)(s / group) * ldx;                                                \
        NAME##_rows<1>(out + (long long)s * ostep, w0 + e * e0, w1 ? w1 + e * e1 : w1, nullptr, rows0,     \
                       w1 ? rows1 : 0, 0, cols, xs, prologue == 2 ? xs + x2_off : nullptr, nw, eps, prologue, \
                       0, 1, 0, 0);                                                                        \
    }
FMV_EXPERTS(f16)
FMV_EXPERTS(bf16)
FMV_EXPERTS(f32)

// FP8 / NVFP4 (decoders above): the quantized matvec's loop with the scales beside the codes. Stacked
// weights each bring their own row scales (s0..s2) and, for NVFP4, their own global scale (g0..g2).
// Row r of the stack: weight *k, local row returned
__device__ __forceinline__ int stacked_local(int rows0, int rows1, int r, int* k) {
    if (r < rows0) return *k = 0, r;
    if (r < rows0 + rows1) return *k = 1, r - rows0;
    return *k = 2, r - rows0 - rows1;
}

// out (rows,) (= or +=) [W0; W1; W2] @ act(x): codes (rows_k, cols) uint8 E4M3, s_k (rows_k,) float32
#define FP8_PARAMS                                                                                        \
    (float* __restrict__ out, const uchar* __restrict__ w0, const uchar* __restrict__ w1,                 \
     const uchar* __restrict__ w2, const float* __restrict__ s0, const float* __restrict__ s1,             \
     const float* __restrict__ s2, int rows0, int rows1, int rows2, int cols, const float* __restrict__ x, \
     const float* __restrict__ x2, const float* __restrict__ nw, float eps, int prologue, int accumulate,  \
     int B, long long ldx, long long ldo)
#define FP8_ARGS (out, w0, w1, w2, s0, s1, s2, rows0, rows1, rows2, cols, x, x2, nw, eps, prologue, accumulate, B, ldx, ldo)
// BLOCKS (block-wise FP8, FP8_E4M3_BLOCK): s_k (rows_k, ceil(cols/128)) float32, a scale per row and 128
// columns (FP8_COL_BLOCK: 4 units); each unit's sum is scaled into the row's accumulator
#define FP8_COL_UNITS 4
template <int MAXB, bool BLOCKS>
__device__ __forceinline__ void fp8_scaled_rows FP8_PARAMS {
    extern __shared__ float sx[];
    load_batch(sx, x, x2, ldx, nw, eps, cols, prologue, 1, B);
    int units = cols >> 5, rows = rows0 + rows1 + rows2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int scales_a_row = BLOCKS ? (units + FP8_COL_UNITS - 1) / FP8_COL_UNITS : 1;
    for (int r = blockIdx.x * 8 + warp; r < rows; r += gridDim.x * 8) {
        int k, lr = stacked_local(rows0, rows1, r, &k);
        const uchar* w = (k == 0 ? w0 : k == 1 ? w1 : w2) + (long long)lr * cols;
        const float* sc = (k == 0 ? s0 : k == 1 ? s1 : s2) + (long long)lr * scales_a_row;
        float acc[MAXB] = {};
        for (int u = lane; u < units; u += 32) {
            float v[32];
            dec_fp8(w + 32 * u, v);
#pragma unroll
            for (int b = 0; b < MAXB; b++) {
                if (b < B) {
                    const float* xb = sx + (long long)b * cols + u;
                    float a = BLOCKS ? 0.f : acc[b];
#pragma unroll
                    for (int i = 0; i < 32; i++) a = fmaf(v[i], xb[i * units], a);
                    acc[b] = BLOCKS ? fmaf(a, sc[u / FP8_COL_UNITS], acc[b]) : a;
                }
            }
        }
        store_batch<MAXB>(out, ldo, r, acc, (BLOCKS ? 1.f : sc[0]) * E4M3_UNIT, B, lane, accumulate);
    }
}
template <int MAXB>
__device__ __forceinline__ void fp8_rows FP8_PARAMS { fp8_scaled_rows<MAXB, false> FP8_ARGS; }
template <int MAXB>
__device__ __forceinline__ void fp8b_rows FP8_PARAMS { fp8_scaled_rows<MAXB, true> FP8_ARGS; }
FMV_KERNELS(fp8, FP8_PARAMS, FP8_ARGS)
FMV_KERNELS(fp8b, FP8_PARAMS, FP8_ARGS)

// out (rows,) (= or +=) [W0; W1; W2] @ act(x): codes (rows_k, cols/2) uint8, s_k (rows_k, cols/16) uint8
// E4M3 block scales, g_k the global scales. Per 32 elements: two block sums, each times its scale.
#define NVFP4_PARAMS                                                                                      \
    (float* __restrict__ out, const uchar* __restrict__ w0, const uchar* __restrict__ w1,                 \
     const uchar* __restrict__ w2, const uchar* __restrict__ s0, const uchar* __restrict__ s1,             \
     const uchar* __restrict__ s2, float g0, float g1, float g2, int rows0, int rows1, int rows2, int cols, \
     const float* __restrict__ x, const float* __restrict__ x2, const float* __restrict__ nw, float eps,   \
     int prologue, int accumulate, int B, long long ldx, long long ldo)
template <int MAXB>
__device__ __forceinline__ void nvfp4_rows NVFP4_PARAMS {
    extern __shared__ float sx[];
    load_batch(sx, x, x2, ldx, nw, eps, cols, prologue, 1, B);
    int units = cols >> 5, rows = rows0 + rows1 + rows2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = blockIdx.x * 8 + warp; r < rows; r += gridDim.x * 8) {
        int k, lr = stacked_local(rows0, rows1, r, &k);
        const uchar* w = (k == 0 ? w0 : k == 1 ? w1 : w2) + (long long)lr * (cols >> 1);
        const uchar* sc = (k == 0 ? s0 : k == 1 ? s1 : s2) + (long long)lr * (cols >> 4);
        float acc[MAXB] = {};
        for (int u = lane; u < units; u += 32) {
            float v[32], s[2];
            dec_nvfp4_codes(w + 16 * u, sc + 2 * u, v, s);
#pragma unroll
            for (int b = 0; b < MAXB; b++) {
                if (b < B) {
                    const float* xb = sx + (long long)b * cols + u;
                    float a0 = 0.f, a1 = 0.f;
#pragma unroll
                    for (int i = 0; i < 16; i++) {
                        a0 = fmaf(v[i], xb[i * units], a0);
                        a1 = fmaf(v[i + 16], xb[(i + 16) * units], a1);
                    }
                    acc[b] = fmaf(a0, s[0], fmaf(a1, s[1], acc[b]));
                }
            }
        }
        store_batch<MAXB>(out, ldo, r, acc, (k == 0 ? g0 : k == 1 ? g1 : g2) * (E2M1_UNIT * E4M3_UNIT), B, lane,
                          accumulate);
    }
}
FMV_KERNELS(nvfp4, NVFP4_PARAMS,
            (out, w0, w1, w2, s0, s1, s2, g0, g1, g2, rows0, rows1, rows2, cols, x, x2, nw, eps, prologue,
             accumulate, B, ldx, ldo))

// out (n, cols) float32 or float16 bits = rows (ids[i] or r0 + i) of an FP8 weight, times scale; ws: the row
// scales (rows,), or BLOCKS (block-wise FP8) (rows, ceil(cols/128)), a scale per row and 128 columns
#define DEQUANT_FP_PARAMS                                                                              \
    (void* __restrict__ out, const uchar* __restrict__ w, const float* __restrict__ ws,                 \
     const int* __restrict__ ids, int r0, int n, int cols, int half_out, float scale)
template <bool BLOCKS>
__device__ __forceinline__ void dequant_fp8_rows DEQUANT_FP_PARAMS {
    int units = cols >> 5;
    long long row;
    int u;
    bool ok = dequant_item(n, units, ids, r0, &row, &u);
    float v[32], s = 0.f;
    if (ok) {
        dec_fp8(w + row * cols + 32 * u, v);
        int per_row = (units + FP8_COL_UNITS - 1) / FP8_COL_UNITS;
        s = BLOCKS ? ws[row * per_row + u / FP8_COL_UNITS] : ws[row];
    }
    store_staged(out, (long long)n * units, v, s * E4M3_UNIT * scale, half_out, ok);
}
extern "C" __global__ void dequant_fp8 DEQUANT_FP_PARAMS {
    dequant_fp8_rows<false>(out, w, ws, ids, r0, n, cols, half_out, scale);
}
extern "C" __global__ void dequant_fp8b DEQUANT_FP_PARAMS {
    dequant_fp8_rows<true>(out, w, ws, ids, r0, n, cols, half_out, scale);
}

// the same for NVFP4 (ws: block scales); scale carries the global scale
extern "C" __global__ void dequant_nvfp4(void* __restrict__ out, const uchar* __restrict__ w,
                                         const uchar* __restrict__ ws, const int* __restrict__ ids, int r0,
                                         int n, int cols, int half_out, float scale) {
    int units = cols >> 5;
    long long row;
    int u;
    bool ok = dequant_item(n, units, ids, r0, &row, &u);
    float v[32];
    if (ok) {
        dec_nvfp4(w + row * (cols >> 1) + 16 * u, ws + row * (cols >> 4) + 2 * u, v);
    }
    store_staged(out, (long long)n * units, v, scale * (E2M1_UNIT * E4M3_UNIT), half_out, ok);
}
