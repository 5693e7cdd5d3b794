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
__device__ __forceinline__ float gelu_tanh(float g) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * g * (1.f + tanhf(c * (g + 0.044715f * g * g * g)));
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
