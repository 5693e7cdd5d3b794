// Shared helpers for Hearth's CUDA kernels. Self-contained: no CUDA headers, so NVRTC compiles
// these sources without a toolkit (cuda_fp16.h is not needed: halves go through PTX cvt).
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;

__device__ __forceinline__ float h2f(ushort h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ ushort f2h(float f) {
    ushort h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf2f(ushort h) { return __uint_as_float(((uint)h) << 16); }

// Programmatic dependent launch (engine/backends/cuda/pdl.py; sm_90+, no-ops elsewhere and for a kernel
// launched the ordinary way). pdl_launch_dependents: the next kernel in the stream may start now;
// pdl_wait: block until the kernels before this one have finished and their writes are visible.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// A value (float or int) another block wrote in this launch, read from L2 (after its writer's __threadfence)
template <class T>
__device__ __forceinline__ T ld_l2(const T* p) {
#ifdef __CUDA_ARCH__
    return __ldcg(p);
#else
    return *(const volatile T*)p;
#endif
}

// little-endian f16 at a 2-byte-aligned address
__device__ __forceinline__ float ldh(const uchar* p) { return h2f(*(const ushort*)p); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// sum over the block (blockDim.x a multiple of 32, <= 1024); red: 32 floats of shared memory
__device__ __forceinline__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : -3.0e38f;
    return warp_max(v);
}
__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }
__device__ __forceinline__ float relu2(float g) {  // Nemotron-H's MLP activation: relu(g)^2
    g = fmaxf(g, 0.f);
    return g * g;
}
__device__ __forceinline__ float gelu_tanh(float g) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * g * (1.f + tanhf(c * (g + 0.044715f * g * g * g)));
}
// ---- activations quantized per unit of 32 for integer dot products (step.cu's matvecs) -------------
#define XQ_SCALE 32512.f  // 127 * 256: |x| max of a unit -> |256 hi + lo| <= 32512, hi and lo int8
#ifndef __CUDA_ARCH__  // the host build of the tests (tests/engine/cuda/simt.py)
static inline int __float2int_rn(float v) { return (int)std::nearbyint(v); }
#endif

// Views of one matvec's input activation (cols elements, units = cols / 32): in shared memory, or
// q alone in global memory (records handed from one kernel to the next).
struct XIn {
    float* f;   // (cols,) natural order
    float* t;   // (cols,) the fused step's scratch (embedding row, folded residual)
    uint* q;    // (XREC * rec_units(units)) unit u's record at rec_of(x, u) (16-byte aligned): see below
    int cols, units;
};
// A unit's record of the two int8 levels (x ~ d * (256 hi + lo)): words 0-7 hi (4 elements each, in
// order), 8-15 lo, 16 d (float), 17 the sum of its quantized values (float, d * Σ(256 hi + lo)), 18 and
// 19 the integer sums Σ(256 hi + lo) of its two halves. Five 16-byte loads read one; 20 words apart,
// consecutive units' loads by 8 lanes fall in distinct banks.
#define XREC 20
// Where unit u's record sits: slot rec_slot(u) of its aligned group of 8 (a vector's records take
// rec_units(units) slots: whole groups). Records 20 words apart put 8 consecutive units' 16-byte loads
// in distinct banks, but the K-quant dot products read every other unit (Q4_K/Q5_K/Q2_K/Q3_K: units
// 2p; Q6_K: 8b + {0, 1, 4, 5}) and those met two to a bank; swapping the low two bits of the units of
// every odd group spreads each of these patterns over the 32 banks (checked for all of them).
__device__ __forceinline__ int rec_slot(int u) { return u ^ (((u >> 3) & 1) * 3); }
__device__ __forceinline__ int rec_units(int units) { return (units + 7) & ~7; }
__device__ __forceinline__ uint* rec_of(const XIn& x, int u) { return x.q + XREC * rec_slot(u); }
// One lane's view of the records of units u0 + 16 i (i >= 0): the permutation leaves bits 0-3 of a unit
// alone, so it is one shift for all of them, and a loop over them steps through memory evenly
struct XView {
    const uint* q;  // unit u's record at q + XREC * u
};
__device__ __forceinline__ XView xview(const XIn& x, int u0) { return XView{x.q + XREC * (rec_slot(u0) - u0)}; }
__device__ __forceinline__ const uint* rec_of(XView v, int u) { return v.q + XREC * u; }
// unit u's scale d, value sum s and half sums i (the record's words 16-19)
template <class X>
__device__ __forceinline__ float xd(const X& x, int u) { return __uint_as_float(rec_of(x, u)[16]); }
template <class X>
__device__ __forceinline__ float xs(const X& x, int u) { return __uint_as_float(rec_of(x, u)[17]); }
template <class X>
__device__ __forceinline__ int xi(const X& x, int u, int half) { return (int)rec_of(x, u)[18 + half]; }
// unit u's scale, value sum and half sums into its record
__device__ __forceinline__ void set_unit(const XIn& x, int u, float d, float s, int i0, int i1) {
    uint* r = rec_of(x, u);
    r[16] = __float_as_uint(d);
    r[17] = __float_as_uint(s);
    r[18] = (uint)i0;
    r[19] = (uint)i1;
}

// Unit u's two int8 levels, scale and sums from its 32 values, one per lane (v: this lane's element).
// The sums are of the quantized values (d * (256 hi + lo)), so a block's dot product is exactly that
// of its weights with the quantized activation. On sm_80+ the max and the integer sums are one
// redux.sync each (a shuffle tree costs 5 shuffles, at one warp shuffle per clock per SM).
__device__ __forceinline__ void quantize_unit(XIn& xin, int u, int lane, float v) {
    uchar* wb = (uchar*)rec_of(xin, u);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    // non-negative floats order as their bit patterns
    float amax = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(fabsf(v))));
#else
    float amax = warp_max(fabsf(v));
#endif
    int q = amax > 0.f ? __float2int_rn(v * (XQ_SCALE / amax)) : 0;
    int hi = (q + 128) >> 8, lo = q - 256 * hi;  // hi in [-127, 127], lo in [-128, 127]
    int k = lane >> 2, byte = lane & 3;
    wb[k * 4 + byte] = (uchar)(signed char)hi;
    wb[(k + 8) * 4 + byte] = (uchar)(signed char)lo;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    int h0 = __reduce_add_sync(0xffffffffu, lane < 16 ? q : 0), h1 = __reduce_add_sync(0xffffffffu, lane < 16 ? 0 : q);
#else
    int h = q;  // each half-warp's sum, then lane 0 fetches the upper half's
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) h += __shfl_xor_sync(0xffffffffu, h, o);
    int h0 = h, h1 = __shfl_xor_sync(0xffffffffu, h, 16);
#endif
    if (lane == 0) {
        float d = amax / XQ_SCALE;
        set_unit(xin, u, d, d * (float)(h0 + h1), h0, h1);
    }
}

// Unit u's record of v * w for a matvec that RMS-normalises v (its prologue 5): quantize_unit of v * w,
// with the unit's sum of v squared in its s slot instead (the consumer takes 1 / RMS from those sums)
__device__ __forceinline__ void quantize_unit_normed(XIn& rec, int u, int lane, float v, float w) {
    quantize_unit(rec, u, lane, v * w);
    float ss = warp_sum(v * v);
    if (lane == 0) rec_of(rec, u)[17] = __float_as_uint(ss);  // after quantize_unit's s (same thread)
}

// 16 bytes as 8 halves, 8 bfloat16s or 4 floats
__device__ __forceinline__ void unpack8_f16(uint4 p, float* v) {
    uint w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[2 * i] = h2f((ushort)(w[i] & 0xffff));
        v[2 * i + 1] = h2f((ushort)(w[i] >> 16));
    }
}
__device__ __forceinline__ void unpack8_bf16(uint4 p, float* v) {
    uint w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void unpack4_f32(uint4 p, float* v) {
    v[0] = __uint_as_float(p.x);
    v[1] = __uint_as_float(p.y);
    v[2] = __uint_as_float(p.z);
    v[3] = __uint_as_float(p.w);
}
