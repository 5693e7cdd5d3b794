// The whole decode step of a llama-family or Gemma 3 model in ONE persistent kernel (decode_step): every block
// stays resident for the step and the blocks meet at a software grid barrier between phases, so a
// token costs one launch instead of ~7 per layer, and no kernel boundary drains the memory pipe.
//
// Per layer, phases separated by grid barriers:
//   A  x_in = rmsnorm(x) * attn_norm (layer 0: the token's embedding row)   qkv = [Wq;Wk;Wv] x_in (+ bias)
//   B  attention items (head, split): q/k norms, RoPE, the new k/v written to the cache, online-softmax
//      partial sums over the split's keys (flash decoding)
//   C  attn = combined partials                                              x += Wo attn
//   D  x_in = rmsnorm(x) * ffn_norm                                          gu = [Wg;Wu] x_in
//   E  x_in = silu(g) * u                                                    x += Wd x_in
// (Gemma 3: Wo and Wd write o, which joins the residual post-normed at the start of the next phase;
// GeGLU; per-layer RoPE bases and sliding windows; soft-capped logits),
// then logits = Wout (rmsnorm(x) * out_norm) and, for greedy steps, their argmax (a 64-bit atomicMax
// of (ordered value, inverted index): larger value first, then smaller index, as np.argmax).
//
// Activations reach the matvecs in shared memory in two forms: float32 (float weights) and two int8
// levels per unit of 32 (every GGUF block type: dp4a dot products; x ~ d (256 hi + lo), a 15-bit grade
// like the CPU kernels' int16 activations, ~4 integer ops per 4 weights instead of ~5 float ops per
// weight, which keeps the step memory-bound).
//
// Weights of the next phases are prefetched into L2 (sm_90 bulk prefetch) while the current phase
// runs, up to a byte budget, so the DRAM stream does not stop at the barriers.
//
// Rows are split into a contiguous range per block, warps stride through it; a row is one warp's.
// The grid must be co-resident (the host launches one block per SM after an occupancy check); a barrier
// that waits too long sets status[1] and lets the step finish with garbage instead of hanging the GPU.

#define STEP_WARPS 16  // at most: the kernel runs with any blockDim.x = 32 * (1..16), 512 on GPUs
#define LAYER_SLOTS 20  // u64 per layer in the descriptor table (see engine/backends/cuda/fused.py)
#define MAX_HD 256
#define MAX_BATCH 8  // matvec_qb's activation vectors per launch (engine/backends/cuda/ops.py)
#define MV_WARPS 8  // matvec_qb's block: 256 threads (ops.MATVEC_THREADS)

#ifdef __CUDA_ARCH__
__device__ __forceinline__ int dp4a(uint a, uint b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// bytes: a multiple of 16 (smaller requests are dropped), p 16-byte aligned
__device__ __forceinline__ void prefetch_l2(const uchar* p, uint bytes) {
#if __CUDA_ARCH__ >= 900
    if (bytes >= 16) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}
// the 128-byte line holding p into this SM's L1 (no register waits for it)
__device__ __forceinline__ void prefetch_l1(const uchar* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
// byte n of the result: byte (s >> 4n) & 7 of (b:a) (one prmt)
__device__ __forceinline__ uint byte_perm(uint a, uint b, uint s) { return __byte_perm(a, b, s); }
#else  // the host build of the tests (tests/engine/cuda/simt.py)
__device__ __forceinline__ int dp4a(uint a, uint b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
__device__ __forceinline__ uint byte_perm(uint a, uint b, uint s) {
    unsigned long long v = ((unsigned long long)b << 32) | a;
    uint r = 0;
    for (int n = 0; n < 4; n++) r |= (uint)((v >> (8 * ((s >> (4 * n)) & 7))) & 255u) << (8 * n);
    return r;
}
__device__ __forceinline__ void prefetch_l2(const uchar* p, uint bytes) {}
__device__ __forceinline__ void prefetch_l1(const uchar* p) {}
#endif

// ggml type ids (as ops.py)
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_BF16 30
#define T_MXFP4 39

__device__ __forceinline__ long long row_bytes_of(int t, int cols) {
    switch (t) {
        case T_F32: return 4LL * cols;
        case T_F16: case T_BF16: return 2LL * cols;
        case T_Q8_0: return (cols / 32) * 34LL;
        case T_Q4_0: return (cols / 32) * 18LL;
        case T_Q4_1: return (cols / 32) * 20LL;
        case T_Q5_0: return (cols / 32) * 22LL;
        case T_Q5_1: return (cols / 32) * 24LL;
        case T_Q2_K: return (cols / 256) * 84LL;
        case T_Q3_K: return (cols / 256) * 110LL;
        case T_Q4_K: return (cols / 256) * 144LL;
        case T_Q5_K: return (cols / 256) * 176LL;
        case T_IQ4_NL: return (cols / 32) * 18LL;
        case T_IQ4_XS: return (cols / 256) * 136LL;
        case T_MXFP4: return (cols / 32) * 17LL;
        default: return (cols / 256) * 210LL;  // Q6_K
    }
}

// Row r of [W0; W1; W2], each matrix its own GGUF type (t0..t2): its bytes, and its type in *type.
__device__ __forceinline__ const uchar* mixed_row(const uchar* w0, const uchar* w1, const uchar* w2, int t0, int t1,
                                                  int t2, int rows0, int rows1, int r, int cols, int* type) {
    int k, lr = stacked_local(rows0, rows1, r, &k);
    *type = k == 0 ? t0 : k == 1 ? t1 : t2;
    return (k == 0 ? w0 : k == 1 ? w1 : w2) + row_bytes_of(*type, cols) * lr;
}

// A row of [W0; W1; W2] resolved once: its bytes (null past the last row), its type and length.
struct RowRef {
    const uchar* w;
    int type, bytes;
};
// Row r of [W0; W1; W2], each matrix its own GGUF type (t0..t2) and bytes a row (b0..b2: launch
// arguments, so they take no registers; row_bytes_of's switch made ptxas keep them in local memory)
__device__ __forceinline__ RowRef row_ref(const uchar* w0, const uchar* w1, const uchar* w2, int t0, int t1,
                                          int t2, int b0, int b1, int b2, int rows0, int rows1, int rows, int r) {
    RowRef ref = {nullptr, t0, 0};
    if (r < rows) {
        int k, lr = stacked_local(rows0, rows1, r, &k);
        ref.type = k == 0 ? t0 : k == 1 ? t1 : t2;
        ref.bytes = k == 0 ? b0 : k == 1 ? b1 : b2;
        ref.w = (k == 0 ? w0 : k == 1 ? w1 : w2) + (long long)ref.bytes * lr;
    }
    return ref;
}

// A row (none when ref.w is null) into L2 (the 16-byte-aligned part of it)
__device__ __forceinline__ void prefetch_row(RowRef ref) {
    if (ref.w == nullptr) return;
    unsigned long long lo = ((unsigned long long)ref.w + 15) & ~15ULL;
    unsigned long long hi = ((unsigned long long)ref.w + ref.bytes) & ~15ULL;
    if (hi > lo) prefetch_l2((const uchar*)lo, (uint)(hi - lo));
}

// A row (none when ref.w is null) into L1, `lanes` lanes (the warps sharing the row, lane counted across
// them) a 128-byte line each at a time: the row a warp takes next is on its SM by the time the warp gets
// to it.
__device__ __forceinline__ void prefetch_row_l1(RowRef ref, int lane, int lanes = 32) {
    if (ref.w == nullptr) return;
    for (int off = 128 * lane; off < ref.bytes; off += 128 * lanes) prefetch_l1(ref.w + off);
}

// One weight matrix of a phase (up to three stacked ones share the phase's input and output buffer).
struct Mat {
    const uchar* w;
    int type, rows;
};

// After xin.f holds the activation: its two int8 levels, one unit per warp at a time (lane = element).
__device__ void quantize_x(XIn& xin) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, units = xin.units;
    for (int u = warp; u < units; u += blockDim.x >> 5) quantize_unit(xin, u, lane, xin.f[u * 32 + lane]);
    __syncthreads();
}

// Σ over 4 words of q . the 4 words h (hi) and l (lo): 256 Σ q hi + Σ q lo
__device__ __forceinline__ int dot4(const uint* q, uint4 h, uint4 l) {
    int hi = dp4a(q[0], h.x, dp4a(q[1], h.y, dp4a(q[2], h.z, dp4a(q[3], h.w, 0))));
    int lo = dp4a(q[0], l.x, dp4a(q[1], l.y, dp4a(q[2], l.z, dp4a(q[3], l.w, 0))));
    return 256 * hi + lo;
}
// Σ over 8 words of q . x for unit u (both int8 levels): 256 Σ q hi + Σ q lo (x: an XIn or an XView)
template <class X>
__device__ __forceinline__ int dot8(const uint* q, const X& x, int u) {
    const uint4* r = (const uint4*)rec_of(x, u);
    uint4 h0 = r[0], h1 = r[1], l0 = r[2], l1 = r[3];
    return dot4(q, h0, l0) + dot4(q + 4, h1, l1);
}
// the same over words k0..k0+3 (a 16-element half; k0 0 or 4)
template <class X>
__device__ __forceinline__ int dot4h(const uint* q, const X& x, int u, int k0) {
    const uint4* r = (const uint4*)rec_of(x, u);
    return dot4(q, r[k0 >> 2], r[2 + (k0 >> 2)]);
}

// bits 0-3 of v at bits 4, 12, 20, 28: a Q5 block's fifth bits over four elements' bytes
__device__ __forceinline__ uint spread4(uint v) {
    return ((v & 1u) << 4) | ((v & 2u) << 11) | ((v & 4u) << 18) | ((v & 8u) << 25);
}

// This lane's part of a Q4_K/Q5_K block (header h) . x over its sub-blocks 2j and 2j + 1 (units ua and
// ua + 1, in views xa and xb), from their integer dot products da = Σ qa (256 hi + lo)_a, db likewise:
// d (sa xd_a da + sb xd_b db) - dmin (ma s_a + mb s_b)
__device__ __forceinline__ float k4_pair_sums(uint4 h, int j, int da, int db, XView xa, XView xb, int ua) {
    uint sc, mn;
    scales_k4(h, j >> 1, &sc, &mn);
    int sh = 16 * (j & 1);
    float sa = (float)((sc >> sh) & 255u), sb = (float)((sc >> (sh + 8)) & 255u);
    float ma = (float)((mn >> sh) & 255u), mb = (float)((mn >> (sh + 8)) & 255u);
    float dots = sa * xd(xa, ua) * (float)da + sb * xd(xb, ua + 1) * (float)db;
    return k4_d(h) * dots - k4_dmin(h) * (ma * xs(xa, ua) + mb * xs(xb, ua + 1));
}
// The table values (int8) of the eight 4-bit indices in w (byte j: element j low, j + 16 high) in a
// 16-entry table held as four words t0..t3 (IQ4_T*, MXFP4_T*): *lo those of the low nibbles (elements
// j .. j + 3 of the word's four bytes), *hi those of the high ones. byte_perm picks by the low 3 bits of
// each selector nibble, from (t0, t1) and (t2, t3); bit 3 of the index then picks one of the two (+4 in
// the selector of a third byte_perm).
__device__ __forceinline__ void lut4_lookup(uint w, uint t0, uint t1, uint t2, uint t3, uint* lo, uint* hi) {
    uint sel = 0x32103210u | ((w & 0x88888888u) >> 1);
    uint a = byte_perm(byte_perm(t0, t1, w), byte_perm(t2, t3, w), sel);  // j, j+16, j+1, j+17
    uint c = byte_perm(byte_perm(t0, t1, w >> 16), byte_perm(t2, t3, w >> 16), sel >> 16);
    *lo = byte_perm(a, c, 0x6420u);
    *hi = byte_perm(a, c, 0x7531u);
}
__device__ __forceinline__ void iq4_lookup(uint w, uint* lo, uint* hi) {
    lut4_lookup(w, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3, lo, hi);
}
__device__ __forceinline__ void mxfp4_lookup(uint w, uint* lo, uint* hi) {
    lut4_lookup(w, MXFP4_T0, MXFP4_T1, MXFP4_T2, MXFP4_T3, lo, hi);
}

// This lane's part of row . x (the caller sums the warp). Each case's loop takes its pieces (units, or
// pairs of them) lane + first, lane + first + step, ...: one warp a row (first 0, step 32), or `split`
// warps a row (first 32 part, step 32 split; matvec_qb). first and step are multiples of 32, so the units
// a lane meets stay 16 apart and the views (xview) made for the ones it starts from hold for them all.
__device__ float row_dot(int type, const uchar* __restrict__ row, const XIn& xin, int lane, int first = 0,
                         int step = 32) {
    float acc = 0.f;
    int units = xin.units;
    XView x = xview(xin, lane);  // the types that take one unit a lane: units lane + 32 i
    switch (type) {
        case T_Q8_0:
            for (int u = lane + first; u < units; u += step) {
                const uchar* b = row + 34LL * u;
                uint q[8];
                ld32n_2<8>(b + 2, q);
                acc = fmaf(ldh(b) * xd(x, u), (float)dot8(q, x, u), acc);
            }
            break;
        case T_Q4_0:
        case T_Q4_1: {
            int bytes = type == T_Q4_0 ? 18 : 20, off = type == T_Q4_0 ? 2 : 4;
            for (int u = lane + first; u < units; u += step) {
                const uchar* b = row + (long long)bytes * u;
                uint q[8], w[4];
                ld32n_2<4>(b + off, w);  // byte j: element j low, j + 16 high
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    q[k] = w[k] & 0x0F0F0F0Fu;
                    q[k + 4] = (w[k] >> 4) & 0x0F0F0F0Fu;
                }
                int dot = dot8(q, x, u);
                if (type == T_Q4_0) {
                    acc = fmaf(ldh(b) * xd(x, u), (float)(dot - 8 * (xi(x, u, 0) + xi(x, u, 1))), acc);
                } else {
                    acc = fmaf(ldh(b) * xd(x, u), (float)dot, fmaf(ldh(b + 2), xs(x, u), acc));
                }
            }
            break;
        }
        case T_Q5_0:
        case T_Q5_1: {  // d (, m), qh (bit j: element j's fifth bit), qs as Q4_0's
            int off = type == T_Q5_0 ? 2 : 4, bytes = off + 20;
            for (int u = lane + first; u < units; u += step) {
                const uchar* b = row + (long long)bytes * u;
                uint h = ld32_2(b + off), q[8], w[4];
                ld32n_2<4>(b + off + 4, w);
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    q[k] = (w[k] & 0x0F0F0F0Fu) | spread4(h >> (4 * k));
                    q[k + 4] = ((w[k] >> 4) & 0x0F0F0F0Fu) | spread4(h >> (16 + 4 * k));
                }
                int dot = dot8(q, x, u);
                if (type == T_Q5_0) {
                    acc = fmaf(ldh(b) * xd(x, u), (float)(dot - 16 * (xi(x, u, 0) + xi(x, u, 1))), acc);
                } else {
                    acc = fmaf(ldh(b) * xd(x, u), (float)dot, fmaf(ldh(b + 2), xs(x, u), acc));
                }
            }
            break;
        }
        case T_Q2_K: {
            // lane p takes units u and u + 1 (t and t + 1, t = 2 (p % 2)) of half n = p / 2 % 2 of block
            // p / 4 (84 bytes: 16 scale|min nibble pairs, one per 16 elements, 64 qs, f16 d, f16 dmin):
            // their elements are bits 2t and 2t + 2 of the half's 32 qs bytes; value d sc q - dmin m
            int u0 = 8 * (lane >> 2) + 4 * ((lane >> 1) & 1) + 2 * (lane & 1);  // this lane's first unit
            XView xa = xview(xin, u0), xb = xview(xin, u0 + 1);
            for (int p = lane + first; p < units / 2; p += step) {
                const uchar* b = row + 84LL * (p >> 2);
                int n = (p >> 1) & 1, t2 = 4 * (p & 1), u = 8 * (p >> 2) + 4 * n + (t2 >> 1);
                const uint* qs = (const uint*)(b + 16 + 32 * n);  // 84-byte blocks: 4-byte aligned
                uint sm = *(const uint*)(b + 8 * n + t2);  // bytes: unit u's halves 0, 1, then u + 1's
                int da = 0, db = 0, ma = 0, mb = 0;
#pragma unroll
                for (int g = 0; g < 2; g++) {  // elements 16g .. 16g + 15 of both units
                    uint qa[4], qb[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        uint w = qs[4 * g + k] >> t2;
                        qa[k] = w & 0x03030303u;
                        qb[k] = (w >> 2) & 0x03030303u;
                    }
                    int sa = (sm >> (8 * g)) & 255, sb = (sm >> (16 + 8 * g)) & 255;
                    da += (sa & 15) * dot4h(qa, xa, u, 4 * g);
                    db += (sb & 15) * dot4h(qb, xb, u + 1, 4 * g);
                    ma += (sa >> 4) * xi(xa, u, g);
                    mb += (sb >> 4) * xi(xb, u + 1, g);
                }
                float d = ldh(b + 80), dmin = ldh(b + 82);
                float fa = d * (float)da - dmin * (float)ma, fb = d * (float)db - dmin * (float)mb;
                acc += xd(xa, u) * fa + xd(xb, u + 1) * fb;
            }
            break;
        }
        case T_Q3_K: {
            // lane p takes units u and u + 1 (t and t + 1, t = 2 (p % 2)) of half n = p / 2 % 2 of block
            // p / 4 (110 bytes: 32 hmask, 64 qs, 12 bytes of 6-bit scales, f16 d): low bits 2t and 2t + 2
            // of the half's 32 qs bytes, high bits 4n + t and 4n + t + 1 of the 32 hmask bytes; value
            // d (sc - 32) (low + 4 high - 4)
            int u0 = 8 * (lane >> 2) + 4 * ((lane >> 1) & 1) + 2 * (lane & 1);  // this lane's first unit
            XView xa = xview(xin, u0), xb = xview(xin, u0 + 1);
            for (int p = lane + first; p < units / 2; p += step) {
                const uchar* b = row + 110LL * (p >> 2);
                int n = (p >> 1) & 1, tp = p & 1, m = 2 * n + tp, u = 8 * (p >> 2) + 2 * m;
                uint lw[8], hw[8], sw[3];
                ld32n_2<8>(b + 32 + 32 * n, lw, 4 * tp);
                ld32n_2<8>(b, hw, 4 * n + 2 * tp);
                ld32n_2<3>(b + 96, sw);
                // the four 6-bit scales of units u, u + 1 (halves 0, 1 each): scales 4m .. 4m + 3
                uint lo = m & 1 ? sw[1] : sw[0];
                lo = m < 2 ? lo & 0x0F0F0F0Fu : (lo >> 4) & 0x0F0F0F0Fu;
                uint sc = lo | (((sw[2] >> (2 * m)) & 0x03030303u) << 4);
                int ia[2], ib[2];
#pragma unroll
                for (int g = 0; g < 2; g++) {
                    uint qa[4], qb[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        uint l = lw[4 * g + k], h = hw[4 * g + k];
                        qa[k] = (l & 0x03030303u) | ((h & 0x01010101u) << 2);
                        qb[k] = ((l >> 2) & 0x03030303u) | ((h & 0x02020202u) << 1);
                    }
                    ia[g] = dot4h(qa, xa, u, 4 * g) - 4 * xi(xa, u, g);
                    ib[g] = dot4h(qb, xb, u + 1, 4 * g) - 4 * xi(xb, u + 1, g);
                }
                int s0 = (int)(sc & 255u) - 32, s1 = (int)((sc >> 8) & 255u) - 32;
                int s2 = (int)((sc >> 16) & 255u) - 32, s3 = (int)(sc >> 24) - 32;
                float fa = (float)(s0 * ia[0] + s1 * ia[1]), fb = (float)(s2 * ib[0] + s3 * ib[1]);
                acc = fmaf(ldh(b + 108), xd(xa, u) * fa + xd(xb, u + 1) * fb, acc);
            }
            break;
        }
        case T_Q4_K: {
            // lane p takes the sub-block pair (2j, 2j + 1) of block p / 4 (j = p % 4): 32 qs bytes, low
            // nibbles then high
            XView xa = xview(xin, 2 * lane), xb = xview(xin, 2 * lane + 1);
            for (int p = lane + first; p < units / 2; p += step) {
                const uchar* b = row + 144LL * (p >> 2);
                int j = p & 3, ua = 2 * p, da = 0, db = 0;
                const uint4* q4 = (const uint4*)(b + 16 + 32 * j);
#pragma unroll
                for (int g = 0; g < 2; g++) {
                    uint4 c = q4[g];
                    uint w[4] = {c.x, c.y, c.z, c.w}, qa[4], qb[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        qa[k] = w[k] & 0x0F0F0F0Fu;
                        qb[k] = (w[k] >> 4) & 0x0F0F0F0Fu;
                    }
                    da += dot4h(qa, xa, ua, 4 * g);
                    db += dot4h(qb, xb, ua + 1, 4 * g);
                }
                acc += k4_pair_sums(*(const uint4*)b, j, da, db, xa, xb, ua);
            }
            break;
        }
        case T_Q5_K: {
            // as Q4_K, with bits 2j and 2j + 1 of the block's 32 qh bytes as the pair's fifth bits
            XView xa = xview(xin, 2 * lane), xb = xview(xin, 2 * lane + 1);
            for (int p = lane + first; p < units / 2; p += step) {
                const uchar* b = row + 176LL * (p >> 2);
                int j = p & 3, ua = 2 * p, da = 0, db = 0;
                const uint4* q4 = (const uint4*)(b + 48 + 32 * j);
                const uint4* h4 = (const uint4*)(b + 16);
#pragma unroll
                for (int g = 0; g < 2; g++) {
                    uint4 c = q4[g], e = h4[g];
                    uint w[4] = {c.x, c.y, c.z, c.w}, qa[4], qb[4];
                    uint f[4] = {e.x >> 2 * j, e.y >> 2 * j, e.z >> 2 * j, e.w >> 2 * j};  // bits 0, 1 ours
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        qa[k] = (w[k] & 0x0F0F0F0Fu) | ((f[k] & 0x01010101u) << 4);
                        qb[k] = ((w[k] >> 4) & 0x0F0F0F0Fu) | ((f[k] & 0x02020202u) << 3);
                    }
                    da += dot4h(qa, xa, ua, 4 * g);
                    db += dot4h(qb, xb, ua + 1, 4 * g);
                }
                acc += k4_pair_sums(*(const uint4*)b, j, da, db, xa, xb, ua);
            }
            break;
        }
        case T_Q6_K: {
            // lane p takes sub-blocks t and t + 2 (t = p % 2) of half n = p / 2 % 2 of block p / 4, which
            // share their 32 ql bytes (low nibbles, high nibbles) and 32 qh bytes (bits 2t, 2t + 4):
            // units u and u + 2, a scale per 16 elements
            int u0 = 8 * (lane >> 2) + 4 * ((lane >> 1) & 1) + (lane & 1);  // this lane's first unit
            XView xa = xview(xin, u0), xb = xview(xin, u0 + 2);
            for (int p = lane + first; p < units / 2; p += step) {
                const uchar* b = row + 210LL * (p >> 2);
                int n = (p >> 1) & 1, t = p & 1, u = 8 * (p >> 2) + 4 * n + t;
                const signed char* sc = (const signed char*)(b + 192 + 8 * n + 2 * t);
                uint lw[8], hw[8];  // hw: the qh words >> 2t, bits 0-1 and 4-5 of each byte ours
                ld32n_2<8>(b + 64 * n + 32 * t, lw);
                ld32n_2<8>(b + 128 + 32 * n, hw, 2 * t);
                float ds = 0.f;
#pragma unroll
                for (int g = 0; g < 2; g++) {  // elements 16g .. 16g + 15 of both units
                    uint qa[4], qb[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        uint l = lw[4 * g + k], h = hw[4 * g + k];
                        qa[k] = (l & 0x0F0F0F0Fu) | ((h & 0x03030303u) << 4);
                        qb[k] = ((l >> 4) & 0x0F0F0F0Fu) | (h & 0x30303030u);
                    }
                    int ia = dot4h(qa, xa, u, 4 * g) - 32 * xi(xa, u, g);
                    int ib = dot4h(qb, xb, u + 2, 4 * g) - 32 * xi(xb, u + 2, g);
                    ds += (float)sc[g] * xd(xa, u) * (float)ia + (float)sc[4 + g] * xd(xb, u + 2) * (float)ib;
                }
                acc = fmaf(ldh(b + 208), ds, acc);
            }
            break;
        }
        case T_IQ4_NL:
            for (int u = lane + first; u < units; u += step) {  // f16 d | 16 qs (Q4_0's nibbles, codebook values)
                const uchar* b = row + 18LL * u;
                uint w[4], q[8];
                ld32n_2<4>(b + 2, w);
#pragma unroll
                for (int k = 0; k < 4; k++) iq4_lookup(w[k], &q[k], &q[k + 4]);
                acc = fmaf(ldh(b) * xd(x, u), (float)dot8(q, x, u), acc);
            }
            break;
        case T_IQ4_XS:
            for (int u = lane + first; u < units; u += step) {  // unit u = sub-block u % 8 of block u / 8
                const uchar* b = row + 136LL * (u >> 3);
                int s = u & 7;
                const uint2* q2 = (const uint2*)(b + 8 + 16 * s);
                uint2 h = *(const uint2*)b, c0 = q2[0], c1 = q2[1];
                uint w[4] = {c0.x, c0.y, c1.x, c1.y}, q[8];  // 136-byte blocks: 8-byte aligned
#pragma unroll
                for (int k = 0; k < 4; k++) iq4_lookup(w[k], &q[k], &q[k + 4]);
                float d = h2f((ushort)(h.x & 0xffffu)) * (float)iq4xs_scale(h.x >> 16, h.y, s);
                acc = fmaf(d * xd(x, u), (float)dot8(q, x, u), acc);
            }
            break;
        case T_MXFP4:
            for (int u = lane + first; u < units; u += step) {  // u8 e (E8M0) | 16 qs (IQ4_NL's nibbles)
                const uchar* b = row + 17LL * u;
                uint w[4], q[8];
                ld32n_1<4>(b + 1, w);
#pragma unroll
                for (int k = 0; k < 4; k++) mxfp4_lookup(w[k], &q[k], &q[k + 4]);
                acc = fmaf(e8m0_half(b[0]) * xd(x, u), (float)dot8(q, x, u), acc);
            }
            break;
        case T_F32:
            for (int u = lane + first; u < xin.cols / 4; u += step) {
                float v[4];
                unpack4_f32(((const uint4*)row)[u], v);
                for (int i = 0; i < 4; i++) acc = fmaf(v[i], xin.f[4 * u + i], acc);
            }
            break;
        case T_F16:
        case T_BF16:
            for (int u = lane + first; u < xin.cols / 8; u += step) {
                float v[8];
                if (type == T_F16) unpack8_f16(((const uint4*)row)[u], v);
                else unpack8_bf16(((const uint4*)row)[u], v);
#pragma unroll
                for (int i = 0; i < 8; i++) acc = fmaf(v[i], xin.f[8 * u + i], acc);
            }
            break;
        default: break;
    }
    return acc;
}

// ---- the graph path's integer matvec -------------------------------------------------------------
// Vector b's view of the batched kernel's shared memory: B blocks of 80 * units bytes.
__device__ __forceinline__ XIn xin_of(float* sq, int b, int cols) {
    int units = cols >> 5;
    XIn xin;
    xin.cols = cols;
    xin.units = units;
    xin.q = (uint*)((uchar*)sq + (long long)b * 4 * XREC * rec_units(units));
    xin.f = xin.t = nullptr;
    return xin;
}

// Quarter k (8 elements: k % quarters of vector k / quarters) of matvec_qb's input before the prologue's
// scale: prologue 1 gives x * nw (its RMS comes after), 2 and 3 the gated activations, 6 relu(x)^2, 0 x. Lanes past
// the end (k >= n) give zeros; *ss takes the sum of the quarter's x squared (prologue 1).
__device__ __forceinline__ void load_quarter(float* a, float* ss, const float* __restrict__ x,
                                             const float* __restrict__ x2, long long ldx,
                                             const float* __restrict__ nw, int prologue, int k, int n,
                                             int quarters) {
    bool live = k < n;
    int b = live ? k / quarters : 0, e0 = live ? 8 * (k % quarters) : 0;
    const float* xe = x + b * ldx + e0;
    float v[8], g[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {  // every load first: they are all in flight together
        v[i] = live ? xe[i] : 0.f;
        g[i] = prologue == 1 ? nw[e0 + i] : (prologue == 2 || prologue == 3) && live ? x2[b * ldx + e0 + i] : 0.f;
    }
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        sum += v[i] * v[i];
        if (prologue == 1) a[i] = v[i] * g[i];
        else if (prologue == 2) a[i] = silu(v[i]) * g[i];
        else if (prologue == 3) a[i] = gelu_tanh(v[i]) * g[i];
        else if (prologue == 6) a[i] = relu2(v[i]);
        else a[i] = v[i];
    }
    *ss = sum;
}

// RMSNorm's scale on B quantized vectors in sq whose units' s slots hold their sums of x squared (the
// integer levels are those of x * nw: they do not depend on the common factor 1 / RMS): each unit's d
// and s times its vector's 1 / RMS, the sums added up in a fixed order by the vector's warp (warp b).
// Starts and ends with the block synchronised.
__device__ void rms_scale(float* sq, float eps, int cols, int B) {
    __shared__ float inv[MAX_BATCH];
    int units = cols >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < B) {  // blockDim >= 32 * MAX_BATCH
        XIn xin = xin_of(sq, warp, cols);
        float t = 0.f;
        for (int u = lane; u < units; u += 32) t += xs(xin, u);
        t = warp_sum(t);
        if (lane == 0) inv[warp] = rsqrtf(t / (float)cols + eps);
    }
    __syncthreads();
    for (int k = threadIdx.x; k < B * units; k += blockDim.x) {
        int b = k / units, u = k % units;
        XIn xin = xin_of(sq, b, cols);
        float d = xd(xin, u) * inv[b];
        set_unit(xin, u, d, d * (float)(xi(xin, u, 0) + xi(xin, u, 1)), xi(xin, u, 0), xi(xin, u, 1));
    }
    __syncthreads();
}

// matvec_qb's input: act(x_b) quantized per unit of 32 as quantize_unit does, into B xin_of views of
// sq. A thread takes 8 consecutive elements (a quarter of a unit) at a time: the unit's four quarters
// are four neighbouring lanes, which meet in two shuffles for the unit's max and its sums. Two rounds'
// loads are in flight at once. Prologue 1 (RMSNorm) quantizes x * nw and scales each unit's d and s by
// the vector's 1 / RMS afterwards (the integer levels do not depend on a common factor): the sums of
// squares come from the same loads, a unit's in its s slot until its vector's warp (warp b) adds them
// up in a fixed order. Ends with the block synchronised.
__device__ void quantize_pieces(float* sq, const float* __restrict__ x, const float* __restrict__ x2, long long ldx,
                                const float* __restrict__ nw, float eps, int prologue, int cols, int B) {
    int quarters = cols >> 3, n = B * quarters, lane = threadIdx.x & 31;
    // the whole warp runs every round (its shuffles need all lanes); lanes past the end sit out the stores
    for (int k0 = threadIdx.x - lane; k0 < n; k0 += 2 * blockDim.x) {
        float a[2][8], ss[2];
#pragma unroll
        for (int r = 0; r < 2; r++)
            load_quarter(a[r], &ss[r], x, x2, ldx, nw, prologue, k0 + r * blockDim.x + lane, n, quarters);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (k0 + r * (int)blockDim.x >= n) break;  // the warp's condition
            int k = k0 + r * blockDim.x + lane;
            float amax = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(a[r][i]));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            uint hi[2] = {0u, 0u}, lo[2] = {0u, 0u};
            int sum = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int q = amax > 0.f ? __float2int_rn(a[r][i] * (XQ_SCALE / amax)) : 0;
                int h = (q + 128) >> 8, l = q - 256 * h;
                hi[i >> 2] |= (uint)(uchar)(signed char)h << (8 * (i & 3));
                lo[i >> 2] |= (uint)(uchar)(signed char)l << (8 * (i & 3));
                sum += q;
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // quarters 0+1 (elements 0..15), 2+3 (16..31)
            int other = __shfl_xor_sync(0xffffffffu, sum, 2);
            float sq_unit = ss[r] + __shfl_xor_sync(0xffffffffu, ss[r], 1);
            sq_unit += __shfl_xor_sync(0xffffffffu, sq_unit, 2);
            if (k < n) {
                int b = k / quarters, c = k % quarters, u = c >> 2, part = c & 3;
                XIn xin = xin_of(sq, b, cols);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    rec_of(xin, u)[2 * part + j] = hi[j];
                    rec_of(xin, u)[2 * part + j + 8] = lo[j];
                }
                if (part == 0) {
                    float d = amax / XQ_SCALE;
                    set_unit(xin, u, d, prologue == 1 ? sq_unit : d * (float)(sum + other), sum, other);
                }
            }
        }
    }
    __syncthreads();
    if (prologue == 1) rms_scale(sq, eps, cols, B);
}

// The activation records another matvec_qb's epilogue wrote (emit_records): B vectors of cols / 32 records,
// ldx floats apart, copied into sq in 16-byte pieces; prologue 5 (records of x * nw whose s slots hold
// the units' sums of x squared) then takes the RMS (rms_scale). Ends with the block synchronised.
__device__ void load_records(float* sq, const float* __restrict__ x, long long ldx, float eps, int prologue, int cols,
                             int B) {
    int per = rec_units(cols >> 5) * XREC / 4;  // 16-byte pieces a vector (its whole groups of 8 slots)
    for (int k = threadIdx.x; k < B * per; k += blockDim.x) {
        int b = k / per, i = k % per;
        ((uint4*)xin_of(sq, b, cols).q)[i] = ((const uint4*)(x + b * ldx))[i];
    }
    __syncthreads();
    if (prologue == 5) rms_scale(sq, eps, cols, B);
}

// ---- the hand-off: a matvec's outputs quantized once for the next matvec ------------------------------
// Without it every block of the next matvec_qb reads and quantizes the whole input for itself (the
// prologue was 51-77% of the per-op matvecs' warp time in the H200 profile). With emit, matvec_qb's
// outputs leave as the next matvec's activation records too, each unit written once, by the block that
// completes it: emit 1 (a residual stream, before an RMSNorm): unit u of out * enw (enw: the next norm's
// weight), its s slot the unit's sum of out squared (the consumer's prologue 5 takes the RMS); emit 2/3
// (gate|up, rows0 = ff gate rows then ff up rows): silu or gelu_tanh(gate) * up, complete (prologue 4); emit 4
// (one matrix: Nemotron-H's up projection): relu(out)^2 (prologue 4).
// Vector b's records at xr + b * XREC * units. cnt: one counter per output unit, zero between launches
// (the completing block resets its units').
__device__ __forceinline__ int emit_unit_of(int emit, int rows0, int r) {
    return (emit == 1 || emit == 4 || r < rows0 ? r : r - rows0) >> 5;
}

// The records of unit u for the B vectors (one warp; lane = element), from outputs other blocks wrote
__device__ __forceinline__ void emit_unit(const float* out, long long ldo, int rows0, int emit,
                                          const float* __restrict__ enw, uint* xr, int units, int u, int B) {
    int lane = threadIdx.x & 31, e = 32 * u + lane;
    for (int b = 0; b < B; b++) {
        const float* ob = out + b * ldo;
        float v = ld_l2(ob + e);
        XIn rec;
        rec.q = xr + (long long)b * XREC * rec_units(units);
        if (emit == 1) quantize_unit_normed(rec, u, lane, v, enw[e]);
        else if (emit == 4) quantize_unit(rec, u, lane, relu2(v));
        else quantize_unit(rec, u, lane, (emit == 2 ? silu(v) : gelu_tanh(v)) * ld_l2(ob + rows0 + e));
    }
}

// matvec_qb's epilogue: this block's rows (blockIdx.x * per + w + k * stride, w < per: per rows a round)
// counted into their units; the units they complete get their records. done: shared scratch of one int
// per output unit.
__device__ __forceinline__ void emit_records(const float* out, long long ldo, int rows0, int rows, int stride,
                                             int emit, const float* __restrict__ enw, uint* xr, int* cnt, int B,
                                             int* done, int per) {
    __shared__ int n_done;
    int warps = MV_WARPS, warp = threadIdx.x >> 5, base = blockIdx.x * per;
    bool one = emit == 1 || emit == 4;  // one matrix's outputs make a unit (else gate's and up's)
    int units = (one ? rows : rows0) >> 5, need = one ? 32 : 64;
    if (threadIdx.x == 0) n_done = 0;
    __threadfence();  // this block's outputs are visible before its counts are
    __syncthreads();
    for (int k = threadIdx.x; base + (long long)k * stride < rows; k += blockDim.x) {  // round k of the block
        int r = base + k * stride, end = min(rows, r + per);
        while (r < end) {  // the round's rows, a run of them per unit
            int u = emit_unit_of(emit, rows0, r), n = 0;
            for (; r < end && emit_unit_of(emit, rows0, r) == u; r++) n++;
            if (atomicAdd(&cnt[u], n) + n == need) {
                cnt[u] = 0;  // no other block counts into u in this launch
                done[atomicAdd(&n_done, 1)] = u;
            }
        }
    }
    __syncthreads();
    __threadfence();  // the other blocks' outputs, after their counts
    for (int i = warp; i < n_done; i += warps) emit_unit(out, ldo, rows0, emit, enw, xr, units, done[i], B);
}

// out[b * ldo + r] (=, or += when accumulate) = ([W0; W1; W2] @ act(x_b))[r] for B activation vectors
// x_b = x + b * ldx (B = 1: one vector; up to MAX_BATCH: batched decode), for the types row_dot takes
// with integer dot products (every GGUF block type), each matrix its own (t0..t2) and its bytes a row
// (b0..b2). act as quant.cu's load_x prologue (0 x, 1 rmsnorm(x) * nw, 2 silu(x) * x2, 3 gelu_tanh(x) *
// x2, x2_b = x2 + b * ldx, 6 relu(x)^2), each vector quantized per 32 to two int8 levels in shared memory, as the fused step does;
// or prologue 4/5: x holds the records an earlier matvec_qb emitted (ldx floats a vector; 5: RMSNorm's
// scale still to take, nw already applied). emit (0: none) makes the outputs the next matvec's records
// too (emit_records). Each row of W comes from DRAM once for all B (the B - 1 further reads hit L1). 256
// threads (at least one warp per vector: quantize_pieces), one row per `split` warps at a time (1, 2, 4
// or 8: ops.row_split; more warps a row for stacks of few rows), rows grid-strided. Dynamic shared
// memory: B * 4 * ops.records_width(cols) bytes, and at least 4 bytes an
// output unit with emit.
// matvec_qb (one warp a row: split is 1, and the body compiles as it did without the split, 64 registers)
// and matvec_qb_split (split warps a row) are this body.
#define MATVEC_QB_PARAMS                                                                                      \
    (float* __restrict__ out, long long ldo, const uchar* __restrict__ w0, const uchar* __restrict__ w1,     \
     const uchar* __restrict__ w2, int t0, int t1, int t2, int rows0, int rows1, int rows2, int b0, int b1,  \
     int b2, int cols, const float* __restrict__ x, const float* __restrict__ x2, long long ldx,            \
     const float* __restrict__ nw, float eps, int prologue, int accumulate, int B, int emit,                \
     const float* __restrict__ enw, uint* __restrict__ xr, int* __restrict__ cnt, int split)
#define MATVEC_QB_ARGS                                                                                        \
    (out, ldo, w0, w1, w2, t0, t1, t2, rows0, rows1, rows2, b0, b1, b2, cols, x, x2, ldx, nw, eps, prologue, \
     accumulate, B, emit, enw, xr, cnt, split)
template <bool SPLIT>
__device__ __forceinline__ void matvec_qb_body MATVEC_QB_PARAMS {
    extern __shared__ __align__(16) float sq[];  // 16-byte loads of the activation records
    if (!SPLIT) split = 1;  // a constant: the one-warp kernel's first and step fold away
    __shared__ float part_sum[2][MAX_BATCH][MV_WARPS];  // split > 1: the warps' shares of their rows
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = MV_WARPS;
    // split warps (1, 2, 4 or 8) take a row together, warp w its part w % split of the row's pieces
    int per = warps / split, part = warp % split, rows = rows0 + rows1 + rows2;
    int base = blockIdx.x * per, r0 = base + warp / split, stride = gridDim.x * per;
    int first = 32 * part, step = 32 * split, plane = lane + first;  // plane: the lane across the row's warps
    // the next kernel may launch now (a programmatic dependent launch: its blocks wait in pdl_wait)
    pdl_launch_dependents();
    // this warp's first two rows start coming into L2 while the block prepares its input (or, launched
    // programmatically, while the kernel before it finishes); each row is resolved once (RowRef) and
    // carried from prefetch to use
    RowRef cur = row_ref(w0, w1, w2, t0, t1, t2, b0, b1, b2, rows0, rows1, rows, r0);
    RowRef nxt = row_ref(w0, w1, w2, t0, t1, t2, b0, b1, b2, rows0, rows1, rows, r0 + stride);
    if (plane == 0) {
        prefetch_row(cur);
        prefetch_row(nxt);
    }
    prefetch_row_l1(cur, plane, step);
    pdl_wait();  // x, x2 and out come from the kernels before
    if (prologue == 4 || prologue == 5) load_records(sq, x, ldx, eps, prologue, cols, B);
    else quantize_pieces(sq, x, x2, ldx, nw, eps, prologue, cols, B);
    // with split, every warp of the block goes round the same number of times (the block's rows are
    // base + k stride + w / split), so that a row's warps can meet at __syncthreads
    for (int k = 0, r = r0; split == 1 ? r < rows : base + k * stride < rows; k++, r += stride) {
        // the row after this one: into L1 now (it is in L2 already), the one after that into L2
        RowRef later = row_ref(w0, w1, w2, t0, t1, t2, b0, b1, b2, rows0, rows1, rows, r + 2 * stride);
        prefetch_row_l1(nxt, plane, step);
        if (plane == 0) prefetch_row(later);
        for (int b = 0; b < B; b++) {
            XIn xb = xin_of(sq, b, cols);
            float acc = r < rows ? warp_sum(row_dot(cur.type, cur.w, xb, lane, first, step)) : 0.f;
            if (split > 1) {
                if (lane == 0) part_sum[k & 1][b][warp] = acc;
            } else if (lane == 0) {
                out[b * ldo + r] = accumulate ? out[b * ldo + r] + acc : acc;
            }
        }
        if (split > 1) {
            // the row's first warp adds its parts in order; the slots alternate between rounds, so one
            // barrier a round keeps a round's writes from overtaking the previous round's reads
            __syncthreads();
            if (part == 0 && lane < B && r < rows) {
                float acc = 0.f;
                for (int q = 0; q < split; q++) acc += part_sum[k & 1][lane][warp + q];
                out[lane * ldo + r] = accumulate ? out[lane * ldo + r] + acc : acc;
            }
        }
        cur = nxt;
        nxt = later;
    }
    if (emit) {
        __syncthreads();  // sq is free: the completed units' list
        emit_records(out, ldo, rows0, rows, stride, emit, enw, xr, cnt, B, (int*)sq, per);
    }
}

extern "C" __global__ void __launch_bounds__(256, 4) matvec_qb MATVEC_QB_PARAMS {
    matvec_qb_body<false> MATVEC_QB_ARGS;
}
extern "C" __global__ void __launch_bounds__(256, 4) matvec_qb_split MATVEC_QB_PARAMS {
    matvec_qb_body<true> MATVEC_QB_ARGS;
}

// Mixture-of-experts matvecs: slot s = blockIdx.y (of B tokens x k chosen experts) runs matvec_qb's one-
// vector body over expert ids[s]'s rows of the merged expert tensors: w0 (and w1: gate then up, rows0 and
// rows1 rows) start e0 (e1) bytes per expert apart, so the expert's rows start at w0 + ids[s] * e0 (a
// merged gate|up tensor: w1 = w0 + its gate rows' bytes). Its input is x + (s / group) * ldx (group k: a
// token's k slots read its one hidden state, prologue 1; group 1: each slot its own, e.g. its gate|up
// rows with prologue 2 and x2 = x + x2_off), its output out + s * ostep. The body reads blockIdx.x and
// gridDim.x only, so the slots are independent launches in one, and the expert ids stay in device memory
// (a captured decode step picks its experts as it runs).
extern "C" __global__ void __launch_bounds__(256, 4) matvec_qb_experts(
    float* __restrict__ out, long long ostep, const uchar* __restrict__ w0, const uchar* __restrict__ w1,
    long long e0, long long e1, int t0, int t1, int rows0, int rows1, int b0, int b1, int cols,
    const float* __restrict__ x, long long ldx, int group, long long x2_off, const float* __restrict__ nw,
    float eps, int prologue, const int* __restrict__ ids) {
    int s = blockIdx.y;
    long long e = ids[s];
    const float* xs = x + (long long)(s / group) * ldx;
    matvec_qb_body<false>(out + (long long)s * ostep, 0, w0 + e * e0, w1 ? w1 + e * e1 : w1, nullptr, t0, t1, t0,
                          rows0, w1 ? rows1 : 0, 0, b0, b1, 0, cols, xs, prologue == 2 ? xs + x2_off : nullptr,
                          0, nw, eps, prologue, 0, 1, 0, nullptr, nullptr, nullptr, 1);
}

// ---- the grid barrier ------------------------------------------------------------------------
// sync[0]: arrivals, sync[1]: generation, status[1]: set when a wait timed out
__device__ __forceinline__ void grid_sync(uint* sync, uint* gen, int* status) {
    __syncthreads();
    if (threadIdx.x == 0) {
        uint g = *gen;
        __threadfence();
        if (atomicAdd(&sync[0], 1u) == gridDim.x - 1) {
            sync[0] = 0;
            __threadfence();
            atomicExch(&sync[1], g + 1);
        } else {
            long long t0 = clock64();
            while (*(volatile uint*)&sync[1] == g) {
                if (*(volatile int*)&status[1]) break;  // an earlier barrier gave up: do not wait again
                if (clock64() - t0 > (1LL << 34)) {  // ~10 s: a block never arrived
                    atomicExch((uint*)&status[1], 1u);
                    break;
                }
            }
        }
        __threadfence();
        *gen = g + 1;
    }
    __syncthreads();
}

// ---- L2 prefetch of the coming phases' weights -------------------------------------------------
// A weight phase of the step: up to 3 matrices (the output projection: 1).
struct Phase {
    Mat m[3];
    int n, cols;
};

__device__ long long phase_bytes(const Phase& p) {
    long long b = 0;
    for (int i = 0; i < p.n; i++) b += row_bytes_of(p.m[i].type, p.cols) * p.m[i].rows;
    return b;
}

// This block's 1/gridDim share of the phase's matrices (thread 0 issues). A phase larger than the
// budget is not prefetched here: phase_rows streams it with a rolling prefetch of its own rows.
__device__ void prefetch_phase(const Phase& p, long long budget) {
    if (threadIdx.x != 0 || budget < 0 || phase_bytes(p) > budget) return;  // budget < 0: no prefetch
    for (int i = 0; i < p.n; i++) {
        long long bytes = row_bytes_of(p.m[i].type, p.cols) * p.m[i].rows;
        long long lo = (bytes * blockIdx.x / gridDim.x) & ~15LL, hi = (bytes * (blockIdx.x + 1) / gridDim.x) & ~15LL;
        for (long long o = lo; o < hi; o += 32768) prefetch_l2(p.m[i].w + o, (uint)min(32768LL, hi - o));
    }
}

// ---- phases ---------------------------------------------------------------------------------
// What the phase helpers read (the kernel body uses its own parameters for the rest).
struct Step {
    const unsigned long long* layers;
    int n_layers, d, H, KV, hd, ff, vocab, n_rot, neox, n_ctx, kv_half, max_splits, split_keys, pos;
    float eps, scale;
    long long prefetch_budget;
    const uchar* out_w;
    int out_type;
    void* kc;
    void* vc;
    float* qkv;
    float* parts;
};

// Weight phase k of the step (4 per layer: qkv, wo, gate|up, down; then the output projection).
__device__ Phase weight_phase(const Step& s, int k) {
    Phase p;
    p.n = 0;
    if (k >= 4 * s.n_layers) {
        if (s.out_w != nullptr && k == 4 * s.n_layers) {
            p.m[0] = {s.out_w, s.out_type, s.vocab};
            p.n = 1;
            p.cols = s.d;
        }
        return p;
    }
    const unsigned long long* L = s.layers + (long long)(k >> 2) * LAYER_SLOTS;
    unsigned long long types = L[14];
    int qd = s.H * s.hd, kvd = s.KV * s.hd;
    switch (k & 3) {
        case 0:
            p.m[0] = {(const uchar*)L[7], (int)(types & 255), qd};
            p.m[1] = {(const uchar*)L[8], (int)((types >> 8) & 255), kvd};
            p.m[2] = {(const uchar*)L[9], (int)((types >> 16) & 255), kvd};
            p.n = 3;
            p.cols = s.d;
            break;
        case 1:
            p.m[0] = {(const uchar*)L[10], (int)((types >> 24) & 255), s.d};
            p.n = 1;
            p.cols = qd;
            break;
        case 2:
            p.m[0] = {(const uchar*)L[11], (int)((types >> 32) & 255), s.ff};
            p.m[1] = {(const uchar*)L[12], (int)((types >> 40) & 255), s.ff};
            p.n = 2;
            p.cols = s.d;
            break;
        default:
            p.m[0] = {(const uchar*)L[13], (int)((types >> 48) & 255), s.d};
            p.n = 1;
            p.cols = s.ff;
    }
    return p;
}

// At the start of weight phase k: phase k+1 unless phase k-1 prefetched it, and phase k+2 when k+1 and
// k+2 fit the budget together (so each phase is prefetched once, at most a budget ahead).
__device__ void prefetch_ahead(const Step& s, int k) {
    long long b0 = phase_bytes(weight_phase(s, k)), b1 = phase_bytes(weight_phase(s, k + 1));
    long long b2 = phase_bytes(weight_phase(s, k + 2));
    if (k == 0) prefetch_phase(weight_phase(s, 0), s.prefetch_budget);
    if (k == 0 || b0 + b1 > s.prefetch_budget) prefetch_phase(weight_phase(s, k + 1), s.prefetch_budget);
    if (b1 + b2 <= s.prefetch_budget) prefetch_phase(weight_phase(s, k + 2), s.prefetch_budget);
}

// out rows of the phase's stacked matrices: out[r] = dot (+ bias), or out[r] += dot when accumulate.
// With best: the argmax candidates of this block's rows go into *best (thread 0, atomicMax).
// A single matrix over the prefetch budget streams: warp 0 prefetches the rows ROLL_AHEAD rounds ahead.
#define ROLL_AHEAD 4
// cap > 0: out = cap * tanh(dot / cap) (Gemma's final logit soft-capping)
__device__ void phase_rows(const Phase& p, const XIn& x, float* out, const float* const* bias, int accumulate,
                           unsigned long long* best, float* red, long long budget, float cap = 0.f) {
    int rows = 0;
    for (int i = 0; i < p.n; i++) rows += p.m[i].rows;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r0 = (int)((long long)rows * blockIdx.x / gridDim.x), r1 = (int)((long long)rows * (blockIdx.x + 1) / gridDim.x);
    long long rb0 = row_bytes_of(p.m[0].type, p.cols);
    bool roll = budget >= 0 && p.n == 1 && phase_bytes(p) > budget && threadIdx.x == 0;
    if (roll) {
        int e = min(r1, r0 + ROLL_AHEAD * (int)(blockDim.x >> 5));
        if (e > r0) prefetch_l2(p.m[0].w + ((rb0 * r0) & ~15LL), (uint)((rb0 * (e - r0)) & ~15LL));
    }
    float bv = -3.4e38f;
    int bi = 0x7fffffff;
    for (int r = r0 + warp; r < r1; r += blockDim.x >> 5) {
        if (roll) {
            int a = r + ROLL_AHEAD * (int)(blockDim.x >> 5), e = min(r1, a + (int)(blockDim.x >> 5));
            if (e > a) prefetch_l2(p.m[0].w + ((rb0 * a) & ~15LL), (uint)((rb0 * (e - a)) & ~15LL));
        }
        // the stacked matrix of row r by selects (an indexed p.m[k] would live in local memory)
        int k = r < p.m[0].rows ? 0 : r < p.m[0].rows + p.m[1].rows ? 1 : 2;
        int lr = k == 0 ? r : k == 1 ? r - p.m[0].rows : r - p.m[0].rows - p.m[1].rows;
        int type = k == 0 ? p.m[0].type : k == 1 ? p.m[1].type : p.m[2].type;
        const uchar* w = k == 0 ? p.m[0].w : k == 1 ? p.m[1].w : p.m[2].w;
        float acc = warp_sum(row_dot(type, w + row_bytes_of(type, p.cols) * lr, x, lane));
        const float* b = bias == nullptr ? nullptr : k == 0 ? bias[0] : k == 1 ? bias[1] : bias[2];
        if (b != nullptr) acc += b[lr];
        if (accumulate) acc += out[r];
        if (cap > 0.f) acc = cap * tanhf(acc / cap);
        if (lane == 0) out[r] = acc;
        if (acc > bv) { bv = acc; bi = r; }  // rows rise, so ties keep the smaller index
    }
    if (best == nullptr) return;
    int* ri = (int*)(red + STEP_WARPS);
    if (lane == 0) { red[warp] = bv; ri[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (red[w] > bv || (red[w] == bv && ri[w] < bi)) { bv = red[w]; bi = ri[w]; }
        if (bi != 0x7fffffff) {
            uint bits = __float_as_uint(bv);
            bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);  // order-preserving
            atomicMax(best, ((unsigned long long)bits << 32) | (unsigned long long)(0xFFFFFFFFu - (uint)bi));
        }
    }
    __syncthreads();
}

// xin.f = rmsnorm(src) * w over n elements (block-wide), then quantize.
__device__ void load_normed(XIn& xin, const float* src, const float* w, float eps, float* red) {
    float ss = 0.f;
    for (int e = threadIdx.x; e < xin.cols; e += blockDim.x) ss += src[e] * src[e];
    ss = block_sum(ss, red);
    float inv = rsqrtf(ss / (float)xin.cols + eps);
    for (int e = threadIdx.x; e < xin.cols; e += blockDim.x) xin.f[e] = src[e] * inv * w[e];
    __syncthreads();
    quantize_x(xin);
}

// v (32,) = unit u (elements 32 u ..) of a row of a GGUF block type
__device__ __forceinline__ void dec_unit(int type, const uchar* row, int u, float* v) {
    switch (type) {
        case T_Q8_0: dec_q8_0(row + 34LL * u, 0, v); break;
        case T_Q4_0: dec_q4_0(row + 18LL * u, 0, v); break;
        case T_Q4_1: dec_q4_1(row + 20LL * u, 0, v); break;
        case T_Q5_0: dec_q5_0(row + 22LL * u, 0, v); break;
        case T_Q5_1: dec_q5_1(row + 24LL * u, 0, v); break;
        case T_Q2_K: dec_q2_k(row + 84LL * (u / 8), u % 8, v); break;
        case T_Q3_K: dec_q3_k(row + 110LL * (u / 8), u % 8, v); break;
        case T_Q4_K: dec_q4_k(row + 144LL * (u / 8), u % 8, v); break;
        case T_Q5_K: dec_q5_k(row + 176LL * (u / 8), u % 8, v); break;
        case T_IQ4_NL: dec_iq4_nl(row + 18LL * u, 0, v); break;
        case T_IQ4_XS: dec_iq4_xs(row + 136LL * (u / 8), u % 8, v); break;
        case T_MXFP4: dec_mxfp4(row + 17LL * u, 0, v); break;
        default: dec_q6_k(row + 210LL * (u / 8), u % 8, v); break;
    }
}

// dst (d,) natural order = row `token` of the embedding, times scale (block-wide)
__device__ void embed_row(float* dst, const uchar* embd, int type, int token, int d, float scale) {
    const uchar* row = embd + row_bytes_of(type, d) * token;
    if (type == T_F32 || type == T_F16 || type == T_BF16) {
        for (int e = threadIdx.x; e < d; e += blockDim.x) {
            float v = type == T_F32 ? ((const float*)row)[e] : type == T_F16 ? ldh(row + 2 * e) : bf2f(((const ushort*)row)[e]);
            dst[e] = v * scale;
        }
        return;
    }
    for (int u = threadIdx.x; u < d / 32; u += blockDim.x) {
        float v[32];
        dec_unit(type, row, u, v);
        for (int i = 0; i < 32; i++) dst[u * 32 + i] = v[i] * scale;
    }
}

// out (n, cols) float32 or float16 bits = rows (ids[i], or r0 + i) of [W0; W1; W2], times scale: up to
// three matrices of GGUF block types (each its own: a Q4_K_M file's Q6_K wv beside Q4_K wq and wk)
// stacked, so that a prefill tile spanning q|k|v or gate|up is one launch. One thread per 32 values;
// blocks of 256 threads (store_staged).
extern "C" __global__ void __launch_bounds__(256) dequant_qb(void* __restrict__ out, const uchar* __restrict__ w0,
        const uchar* __restrict__ w1, const uchar* __restrict__ w2, int t0, int t1, int t2, int rows0, int rows1,
        const int* __restrict__ ids, int r0, int n, int cols, int half_out, float scale) {
    int units = cols >> 5, u, type;
    long long row;
    bool ok = dequant_item(n, units, ids, r0, &row, &u);
    float v[32];
    if (ok) {  // two statements: mixed_row sets type, and argument order is unspecified in C++
        const uchar* w = mixed_row(w0, w1, w2, t0, t1, t2, rows0, rows1, (int)row, cols, &type);
        dec_unit(type, w, u, v);
    }
    store_staged(out, (long long)n * units, v, scale, half_out, ok);
}

__device__ __forceinline__ float kv_at(const void* c, long long i, int half) {
    return half ? h2f(((const ushort*)c)[i]) : ((const float*)c)[i];
}

// dst (hd,) = rope(optional rmsnorm(src) * nw) at pos; block-wide, sq: shared scratch
__device__ void rope_head(float* dst, const float* src, const float* nw, const float* inv_freq, const Step& s,
                          float* red) {
    for (int j = threadIdx.x; j < s.hd; j += blockDim.x) dst[j] = src[j];
    __syncthreads();
    if (nw != nullptr) {
        float ss = 0.f;
        for (int j = threadIdx.x; j < s.hd; j += blockDim.x) ss += dst[j] * dst[j];
        ss = block_sum(ss, red);
        float inv = rsqrtf(ss / (float)s.hd + s.eps);
        for (int j = threadIdx.x; j < s.hd; j += blockDim.x) dst[j] = dst[j] * inv * nw[j];
        __syncthreads();
    }
    int half = s.n_rot >> 1;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double sn, cs;
        sincos((double)s.pos * (double)inv_freq[i], &sn, &cs);
        int ia = s.neox ? i : 2 * i, ib = s.neox ? i + half : 2 * i + 1;
        float a = dst[ia], b = dst[ib];
        dst[ia] = a * (float)cs - b * (float)sn;
        dst[ib] = a * (float)sn + b * (float)cs;
    }
    __syncthreads();
}

// the first key position query s.pos sees (a sliding window of `window` keys, or all)
__device__ __forceinline__ int first_key(const Step& s, int window) { return window > 0 ? max(0, s.pos - window + 1) : 0; }
__device__ __forceinline__ int n_splits(const Step& s, int window) {
    return min(s.max_splits, max(1, (s.pos - first_key(s, window) + s.split_keys) / s.split_keys));
}

// Phase B: attention item (h, sp) -> parts[(h * max_splits + sp) * (hd + 2) + ...] = unnormalised
// output (hd), max, sum. sm: shared scratch of 3 * MAX_HD + STEP_WARPS * (MAX_HD + 2) floats.
__device__ void attention_item(const Step& s, int layer, int h, int sp, int S, const float* qn, const float* kn,
                               const float* inv_freq, int window, float* sm, float* red) {
    float *sq = sm, *sk = sm + MAX_HD, *sv = sm + 2 * MAX_HD, *wpart = sm + 3 * MAX_HD;
    int hd = s.hd, g = h / (s.H / s.KV), pos = s.pos, start = first_key(s, window);
    int chunk = (pos + 1 - start + S - 1) / S;  // the visible keys [start, pos] in S splits
    int k0 = start + sp * chunk, k1 = min(pos + 1, k0 + chunk);
    float* part = s.parts + ((long long)h * s.max_splits + sp) * (hd + 2);
    const float* qkv = s.qkv;
    rope_head(sq, qkv + (long long)h * hd, qn, inv_freq, s, red);
    bool has_pos = k1 == pos + 1 && k0 < k1;
    long long lay = (long long)layer * s.KV * s.n_ctx * hd, base = lay + (long long)g * s.n_ctx * hd;
    if (has_pos) {
        rope_head(sk, qkv + (long long)s.H * hd + (long long)g * hd, kn, inv_freq, s, red);
        const float* v = qkv + (long long)(s.H + s.KV) * hd + (long long)g * hd;
        for (int j = threadIdx.x; j < hd; j += blockDim.x) {
            float kv = sk[j], vv = v[j];
            if (s.kv_half) {  // what the cache will hold
                kv = h2f(f2h(kv));
                vv = h2f(f2h(vv));
            }
            sk[j] = kv;
            sv[j] = vv;
            if (h % (s.H / s.KV) == 0) {  // one writer per KV head
                long long o = base + (long long)pos * hd + j;
                if (s.kv_half) {
                    ((ushort*)s.kc)[o] = f2h(kv);
                    ((ushort*)s.vc)[o] = f2h(vv);
                } else {
                    ((float*)s.kc)[o] = kv;
                    ((float*)s.vc)[o] = vv;
                }
            }
        }
        __syncthreads();
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float m = -3.0e38f, l = 0.f, acc[MAX_HD / 32];
#pragma unroll
    for (int i = 0; i < MAX_HD / 32; i++) acc[i] = 0.f;
    for (int key = k0 + warp; key < k1; key += blockDim.x >> 5) {
        bool own = key == pos;
        long long kr = base + (long long)key * hd;
        float dsum = 0.f;
        for (int j = lane; j < hd; j += 32) dsum += sq[j] * (own ? sk[j] : kv_at(s.kc, kr + j, s.kv_half));
        float sc = warp_sum(dsum) * s.scale;
        float mn = fmaxf(m, sc), corr = expf(m - mn), pw = expf(sc - mn);
        l = l * corr + pw;
        m = mn;
#pragma unroll
        for (int i = 0; i < MAX_HD / 32; i++) {
            int j = lane + 32 * i;
            if (j < hd) acc[i] = acc[i] * corr + pw * (own ? sv[j] : kv_at(s.vc, kr + j, s.kv_half));
        }
    }
    float* mine = wpart + warp * (MAX_HD + 2);
#pragma unroll
    for (int i = 0; i < MAX_HD / 32; i++)
        if (lane + 32 * i < hd) mine[lane + 32 * i] = acc[i];
    if (lane == 0) {
        mine[MAX_HD] = m;
        mine[MAX_HD + 1] = l;
    }
    __syncthreads();
    float M = -3.0e38f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) M = fmaxf(M, wpart[w * (MAX_HD + 2) + MAX_HD]);
    for (int j = threadIdx.x; j < hd + 2; j += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
            const float* pw = wpart + w * (MAX_HD + 2);
            if (pw[MAX_HD + 1] > 0.f) {
                float e = expf(pw[MAX_HD] - M);
                a += e * (j < hd ? pw[j] : pw[MAX_HD + 1]);
            }
        }
        part[j] = j == hd ? M : a;  // j == hd: the max; j == hd + 1: the sum
        if (j == hd && k0 >= k1) part[j] = -3.0e38f;
    }
    __syncthreads();
}

// Phase C's input: attn (H * hd) = the splits' partial sums combined, into xin.f
__device__ void load_attention(XIn& xin, const Step& s, int window) {
    int S = n_splits(s, window), hd = s.hd;
    for (int e = threadIdx.x; e < s.H * hd; e += blockDim.x) {
        int h = e / hd, j = e % hd;
        const float* p = s.parts + (long long)h * s.max_splits * (hd + 2);
        float M = -3.0e38f;
        for (int sp = 0; sp < S; sp++) M = fmaxf(M, p[sp * (hd + 2) + hd]);
        float a = 0.f, L = 0.f;
        for (int sp = 0; sp < S; sp++) {
            const float* q = p + sp * (hd + 2);
            if (q[hd + 1] > 0.f) {
                float e2 = expf(q[hd] - M);
                a += e2 * q[j];
                L += e2 * q[hd + 1];
            }
        }
        xin.f[e] = a / L;
    }
    __syncthreads();
    quantize_x(xin);
}

// Gemma's post-norm residual add, block-wide: dst (d,) = resid + rmsnorm(o) * w; block 0 also stores it
// to `keep` (the next residual buffer: every block still reads `resid` in this phase)
__device__ void fold(float* dst, const float* resid, const float* o, const float* w, float* keep, int d, float eps,
                     float* red) {
    float ss = 0.f;
    for (int e = threadIdx.x; e < d; e += blockDim.x) ss += o[e] * o[e];
    float inv = rsqrtf(block_sum(ss, red) / (float)d + eps);
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float v = resid[e] + o[e] * inv * w[e];
        dst[e] = v;
        if (blockIdx.x == 0) keep[e] = v;
    }
    __syncthreads();
}

// The start of weight phase k: prefetch ahead, and the input's width
__device__ __forceinline__ void start_phase(const Step& s, int k, XIn& xin, int cols) {
    prefetch_ahead(s, k);
    xin.cols = cols;
    xin.units = cols / 32;
}

// One decode step; see the top of this file. Launch: grid = co-resident blocks (<= one per SM x
// occupancy), 512 threads (any multiple of 32 up to 512 works), dynamic shared memory = step_smem_bytes (fused.py).
// layers: (n_layers, LAYER_SLOTS) u64: 0 attn_norm, 1 ffn_norm, 2 q_norm, 3 k_norm, 4 bq, 5 bk, 6 bv,
// 7 wq, 8 wk, 9 wv, 10 wo, 11 w_gate, 12 w_up, 13 w_down (device pointers, 0 when absent), 14 the
// seven matrices' ggml types, a byte each (q, k, v, o, gate, up, down from the low byte), 15 the layer's
// RoPE inv_freq, 16 its sliding window (0: none), 17 post_attn_norm, 18 post_ffn_norm (Gemma).
// gemma: post-norms (x += rmsnorm(o) * w after attention and MLP, through xr (2, d) and o (d,)), GeGLU,
// final logit soft-capping when softcap > 0.
// status: [0] the greedy token (when greedy), [1] nonzero when a barrier timed out.
extern "C" __global__ void __launch_bounds__(512, 1) decode_step(
    const unsigned long long* __restrict__ layers, int n_layers, const uchar* __restrict__ embd, int embd_type,
    float embed_scale, const uchar* __restrict__ out_w, int out_type, const float* __restrict__ out_norm,
    void* kc, void* vc, int kv_half, int n_ctx, float* x, float* xr, float* o, float* qkv, float* gu, float* parts,
    float* logits, uint* sync, unsigned long long* best, int* status, int d, int H, int KV, int hd, int ff,
    int vocab, int n_rot, int neox, float eps, float scale, int max_splits, int split_keys, int token, int pos,
    int greedy,
    int gemma, float softcap, long long prefetch_budget) {
    extern __shared__ __align__(16) float sx[];
    Step s;
    s.layers = layers;
    s.n_layers = n_layers;
    s.d = d; s.H = H; s.KV = KV; s.hd = hd; s.ff = ff; s.vocab = vocab; s.n_rot = n_rot; s.neox = neox;
    s.n_ctx = n_ctx; s.kv_half = kv_half; s.max_splits = max_splits; s.split_keys = split_keys; s.pos = pos;
    s.eps = eps; s.scale = scale; s.prefetch_budget = prefetch_budget; s.out_w = out_w; s.out_type = out_type;
    s.kc = kc; s.vc = vc; s.qkv = qkv; s.parts = parts;

    int maxc = max(d, max(H * hd, ff)), mu = maxc / 32;
    float* red = sx;  // 32 floats of reductions, then this block's barrier generation
    uint* gen = (uint*)(sx + 32);
    XIn xin;
    xin.f = sx + 64;
    xin.t = xin.f + maxc;
    xin.q = (uint*)(xin.t + maxc);
    float* att = (float*)(xin.q + XREC * rec_units(mu));  // attention scratch (phase B only)
    if (threadIdx.x == 0) *gen = *(volatile uint*)&sync[1];
    __syncthreads();

    int wk = 0;     // weight phase counter
    int cur = 0;    // Gemma: xr + cur * d holds the residual stream (block 0 writes the other half)
    const unsigned long long* L = layers;
    for (int layer = 0; layer < n_layers; layer++) {
        const unsigned long long* prev = L;
        L = layers + (long long)layer * LAYER_SLOTS;
        const float* inv_freq = (const float*)L[15];
        int window = (int)L[16];
        // A: qkv
        start_phase(s, wk, xin, d);
        if (layer == 0) {  // the embedding row, every block its own copy; block 0 seeds the residual
            embed_row(xin.t, embd, embd_type, token, d, embed_scale);
            __syncthreads();
            if (blockIdx.x == 0)
                for (int e = threadIdx.x; e < d; e += blockDim.x) (gemma ? xr : x)[e] = xin.t[e];
        } else if (gemma) {  // the previous layer's MLP output, post-normed, joins the residual
            fold(xin.t, xr + cur * d, o, (const float*)prev[18], xr + (cur ^ 1) * d, d, eps, red);
            cur ^= 1;
        }
        // (xin.t is read in full before quantize_x rewrites it)
        load_normed(xin, layer == 0 || gemma ? xin.t : x, (const float*)L[0], eps, red);
        {
            const float* bias[3] = {(const float*)L[4], (const float*)L[5], (const float*)L[6]};
            phase_rows(weight_phase(s, wk++), xin, qkv, bias, 0, nullptr, red, prefetch_budget);
        }
        grid_sync(sync, gen, status);
        // B: attention
        {
            int S = n_splits(s, window);
            for (int item = blockIdx.x; item < H * S; item += gridDim.x)
                attention_item(s, layer, item / S, item % S, S, (const float*)L[2], (const float*)L[3], inv_freq,
                               window, att, red);
        }
        grid_sync(sync, gen, status);
        // C: x += Wo attn (Gemma: o = Wo attn, post-normed into the residual in D)
        start_phase(s, wk, xin, H * hd);
        load_attention(xin, s, window);
        phase_rows(weight_phase(s, wk++), xin, gemma ? o : x, nullptr, !gemma, nullptr, red, prefetch_budget);
        grid_sync(sync, gen, status);
        // D: gate | up
        start_phase(s, wk, xin, d);
        if (gemma) {
            fold(xin.t, xr + cur * d, o, (const float*)L[17], xr + (cur ^ 1) * d, d, eps, red);
            cur ^= 1;
        }
        load_normed(xin, gemma ? xin.t : x, (const float*)L[1], eps, red);
        phase_rows(weight_phase(s, wk++), xin, gu, nullptr, 0, nullptr, red, prefetch_budget);
        grid_sync(sync, gen, status);
        // E: x += Wd (silu(g) * u) (Gemma: o = Wd (gelu_tanh(g) * u))
        start_phase(s, wk, xin, ff);
        for (int e = threadIdx.x; e < ff; e += blockDim.x)
            xin.f[e] = (gemma ? gelu_tanh(gu[e]) : silu(gu[e])) * gu[ff + e];
        __syncthreads();
        quantize_x(xin);
        phase_rows(weight_phase(s, wk++), xin, gemma ? o : x, nullptr, !gemma, nullptr, red, prefetch_budget);
        grid_sync(sync, gen, status);
    }
    start_phase(s, wk, xin, d);
    if (gemma)  // the last MLP output joins the residual, which lands in x (the head decoder's result)
        fold(xin.t, xr + cur * d, o, (const float*)L[18], x, d, eps, red);
    if (out_w == nullptr) return;  // head decoder: x is the result
    load_normed(xin, gemma ? xin.t : x, out_norm, eps, red);
    phase_rows(weight_phase(s, wk), xin, logits, nullptr, 0, greedy ? best : nullptr, red, prefetch_budget, softcap);
    if (!greedy) return;
    // the last block to finish publishes the token and resets the slot for the next step
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&sync[2], 1u) == gridDim.x - 1) {
            __threadfence();
            unsigned long long b = *(volatile unsigned long long*)best;
            status[0] = (int)(0xFFFFFFFFu - (uint)(b & 0xFFFFFFFFull));
            *best = 0ull;
            sync[2] = 0;
            __threadfence();
        }
    }
}
