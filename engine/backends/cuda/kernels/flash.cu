// Prefill attention in one kernel on tensor cores (flash attention: the scores never reach memory).
//
// One block of 4 warps takes 64 rows of one KV head's grouped queries qg (KV, n * rep, hd) float16 (row
// t * rep + r is query head g * rep + r of token t, at position pos0 + t) and walks that head's cached
// keys and values (KV, n_ctx, hd) float16 in tiles of 64: S = Q K^T and O += P V as mma.sync m16n8k16
// (float16 operands, float32 accumulators), an online softmax in between (running max and sum per
// row, in base 2). Keys past a row's position, or before its sliding window, are masked; tiles past the
// block's last row are never read. Each warp owns 16 rows: its score fragment becomes the P operand in
// registers. out (n, H, hd) float32 or float16 (the output projection's GEMM input), written directly.
// hd is 64 or 128 (flash_prefill_64 / _128); sm_80+ (the host checks).

#define FLASH_ROWS 64
#define FLASH_KEYS 64

// D += A B for one warp: A 16x16 (row major), B 16x8 (column major), float16 in, float32 accumulate.
// Fragments as the PTX ISA lays them out (g = lane / 4, c = lane % 4): a[0] = A[g][2c..2c+1],
// a[1] = A[g+8][2c..], a[2] = A[g][2c+8..], a[3] = A[g+8][2c+8..]; b0 = B[2c..2c+1][g],
// b1 = B[2c+8..2c+9][g]; d[0..1] = D[g][2c..2c+1], d[2..3] = D[g+8][2c..2c+1].
__device__ __forceinline__ void mma16816(float* d, const uint* a, uint b0, uint b1) {
#ifdef __CUDA_ARCH__
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();  // the host runs this kernel on sm_80+ only
#endif
#else
    host_mma16816(d, a, b0, b1);  // tests/engine/cuda/simt.py: the warp's fragments gathered on the host
#endif
}

__device__ __forceinline__ uint pack_h2(float lo, float hi) { return (uint)f2h(lo) | ((uint)f2h(hi) << 16); }

template <int HD>
__device__ void flash_prefill(void* __restrict__ out, const ushort* __restrict__ qg, const ushort* __restrict__ kc,
                              const ushort* __restrict__ vc, int n, int rep, int H, int n_ctx, int pos0,
                              float scale, int window, int half_out) {
    constexpr int KS = HD / 16;  // k-steps of Q K^T
    constexpr int ND = HD / 8;   // 8-wide column groups of O
    constexpr int KP = HD + 8;   // padded row of the key tile (halves)
    constexpr int VP = FLASH_KEYS + 8;
    __shared__ __align__(16) ushort ks[FLASH_KEYS * KP];  // written in 16-byte pieces
    __shared__ __align__(16) ushort vt[HD * VP];  // the value tile transposed: vt[dim][key]
    int t = threadIdx.x, warp = t >> 5, lane = t & 31, g = lane >> 2, c = lane & 3;
    int head = blockIdx.y, rows = n * rep;
    int row0 = blockIdx.x * FLASH_ROWS;
    const ushort* q = qg + (long long)head * rows * HD;
    const ushort* kh = kc + (long long)head * n_ctx * HD;
    const ushort* vh = vc + (long long)head * n_ctx * HD;
    // this thread's two rows (g and g + 8 of the warp's 16) and their positions
    int r_lo = row0 + warp * 16 + g, r_hi = r_lo + 8;
    int p_lo = pos0 + min(r_lo, rows - 1) / rep, p_hi = pos0 + min(r_hi, rows - 1) / rep;
    uint qa[KS][4];
#pragma unroll
    for (int s = 0; s < KS; s++) {
        int col = 16 * s + 2 * c;
        qa[s][0] = r_lo < rows ? *(const uint*)(q + (long long)r_lo * HD + col) : 0u;
        qa[s][1] = r_hi < rows ? *(const uint*)(q + (long long)r_hi * HD + col) : 0u;
        qa[s][2] = r_lo < rows ? *(const uint*)(q + (long long)r_lo * HD + col + 8) : 0u;
        qa[s][3] = r_hi < rows ? *(const uint*)(q + (long long)r_hi * HD + col + 8) : 0u;
    }
    float o[ND][4];
#pragma unroll
    for (int j = 0; j < ND; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    const float NEG = -3.0e38f;
    float m_lo = NEG, m_hi = NEG, l_lo = 0.f, l_hi = 0.f;
    float sl2 = scale * 1.4426950408889634f;  // scores in base 2
    // the keys some row of the block sees
    int first = pos0 + row0 / rep, last = pos0 + (min(row0 + FLASH_ROWS, rows) - 1) / rep;
    int k_begin = window > 0 ? max(0, first - window + 1) : 0;
    k_begin -= k_begin % FLASH_KEYS;
    for (int k0 = k_begin; k0 <= last; k0 += FLASH_KEYS) {
        __syncthreads();  // the previous tile is no longer read
        for (int i = t; i < FLASH_KEYS * HD / 8; i += blockDim.x) {  // 16-byte pieces: 8 dims of one key
            int key = i / (HD / 8), d0 = (i % (HD / 8)) * 8, j = k0 + key;
            uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = make_uint4(0u, 0u, 0u, 0u);
            if (j <= last) {
                kv = *(const uint4*)(kh + (long long)j * HD + d0);
                vv = *(const uint4*)(vh + (long long)j * HD + d0);
            }
            *(uint4*)(ks + key * KP + d0) = kv;
            uint w[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                vt[(d0 + 2 * e) * VP + key] = (ushort)(w[e] & 0xffffu);
                vt[(d0 + 2 * e + 1) * VP + key] = (ushort)(w[e] >> 16);
            }
        }
        __syncthreads();
        // S = Q K^T: 8 groups of 8 keys
        float s[FLASH_KEYS / 8][4];
#pragma unroll
        for (int nb = 0; nb < FLASH_KEYS / 8; nb++) {
            s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
            const ushort* kr = ks + (nb * 8 + g) * KP + 2 * c;
#pragma unroll
            for (int st = 0; st < KS; st++)
                mma16816(s[nb], qa[st], *(const uint*)(kr + 16 * st), *(const uint*)(kr + 16 * st + 8));
        }
        // mask, scale, and the tile's row maxima (each row's 64 keys are spread over the 4 lanes of a quad)
        float t_lo = NEG, t_hi = NEG;
#pragma unroll
        for (int nb = 0; nb < FLASH_KEYS / 8; nb++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int j = k0 + nb * 8 + 2 * c + e;
                bool see_lo = j <= p_lo && (window <= 0 || j > p_lo - window);
                bool see_hi = j <= p_hi && (window <= 0 || j > p_hi - window);
                s[nb][e] = see_lo ? s[nb][e] * sl2 : NEG;
                s[nb][2 + e] = see_hi ? s[nb][2 + e] * sl2 : NEG;
                t_lo = fmaxf(t_lo, s[nb][e]);
                t_hi = fmaxf(t_hi, s[nb][2 + e]);
            }
        }
#pragma unroll
        for (int x = 1; x < 4; x <<= 1) {
            t_lo = fmaxf(t_lo, __shfl_xor_sync(0xffffffffu, t_lo, x));
            t_hi = fmaxf(t_hi, __shfl_xor_sync(0xffffffffu, t_hi, x));
        }
        float n_lo = fmaxf(m_lo, t_lo), n_hi = fmaxf(m_hi, t_hi);
        // a row with nothing visible yet keeps its sums at 0 (its base stays NEG: exp2 of NEG - NEG = 1 x 0)
        float a_lo = exp2f(m_lo - n_lo), a_hi = exp2f(m_hi - n_hi);
        m_lo = n_lo;
        m_hi = n_hi;
        l_lo *= a_lo;
        l_hi *= a_hi;
#pragma unroll
        for (int j = 0; j < ND; j++) {
            o[j][0] *= a_lo;
            o[j][1] *= a_lo;
            o[j][2] *= a_hi;
            o[j][3] *= a_hi;
        }
        // P = exp2(S - max) as the A operand of P V: key steps of 16 are score groups 2ks and 2ks + 1
        uint pa[FLASH_KEYS / 16][4];
#pragma unroll
        for (int nb = 0; nb < FLASH_KEYS / 8; nb++) {
            float e0 = s[nb][0] > NEG ? exp2f(s[nb][0] - m_lo) : 0.f;
            float e1 = s[nb][1] > NEG ? exp2f(s[nb][1] - m_lo) : 0.f;
            float e2 = s[nb][2] > NEG ? exp2f(s[nb][2] - m_hi) : 0.f;
            float e3 = s[nb][3] > NEG ? exp2f(s[nb][3] - m_hi) : 0.f;
            l_lo += e0 + e1;
            l_hi += e2 + e3;
            pa[nb >> 1][(nb & 1) * 2] = pack_h2(e0, e1);
            pa[nb >> 1][(nb & 1) * 2 + 1] = pack_h2(e2, e3);
        }
        // O += P V: B[k][n] = V[key k][dim n] = vt[dim n][key k]
#pragma unroll
        for (int j = 0; j < ND; j++) {
            const ushort* vr = vt + (j * 8 + g) * VP + 2 * c;
#pragma unroll
            for (int st = 0; st < FLASH_KEYS / 16; st++)
                mma16816(o[j], pa[st], *(const uint*)(vr + 16 * st), *(const uint*)(vr + 16 * st + 8));
        }
    }
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, x);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, x);
    }
    float i_lo = l_lo > 0.f ? 1.f / l_lo : 0.f, i_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int r = half ? r_hi : r_lo;
        if (r >= rows) continue;
        float inv = half ? i_hi : i_lo;
        long long base = ((long long)(r / rep) * H + head * rep + r % rep) * HD;  // out[token][head]
#pragma unroll
        for (int j = 0; j < ND; j++) {
            int col = j * 8 + 2 * c;
            float v0 = o[j][2 * half] * inv, v1 = o[j][2 * half + 1] * inv;
            if (half_out) {
                *(uint*)((ushort*)out + base + col) = pack_h2(v0, v1);
            } else {
                ((float*)out)[base + col] = v0;
                ((float*)out)[base + col + 1] = v1;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) flash_prefill_64(void* out, const ushort* qg, const ushort* kc,
                                                                   const ushort* vc, int n, int rep, int H,
                                                                   int n_ctx, int pos0, float scale, int window,
                                                                   int half_out) {
    flash_prefill<64>(out, qg, kc, vc, n, rep, H, n_ctx, pos0, scale, window, half_out);
}
extern "C" __global__ void __launch_bounds__(128) flash_prefill_128(void* out, const ushort* qg, const ushort* kc,
                                                                    const ushort* vc, int n, int rep, int H,
                                                                    int n_ctx, int pos0, float scale, int window,
                                                                    int half_out) {
    flash_prefill<128>(out, qg, kc, vc, n, rep, H, n_ctx, pos0, scale, window, half_out);
}
