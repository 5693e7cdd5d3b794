// Normalization, rotary embedding + KV-cache write, split-K decode attention, activations and sampling.
// Positions come from a device int (pos_base) so that one captured decode step (CUDA graph) replays
// at every position.

// out (n, dim) = x / sqrt(mean(x^2) + eps) * (w (+1 when add_one: HF-style Gemma weights));
// accumulate: out += that (Gemma's post-attention / post-MLP norms on the residual stream);
// half_out: out is float16 (a prefill GEMM's input), written directly. recs (not null; float32 out,
// dim a multiple of 32): row i of out also leaves as the activation records of out * enw at
// recs + i * XREC * rec_units(dim / 32) (ops.records_width; quantize_unit_normed), for the next
// matvec's RMSNorm (its prologue 5). Rows lie ldx (x) and ldo (out) elements apart (dim: packed rows; more:
// a part of each row, e.g. the queries of q|k|v rows for OLMo 2's norm over the whole projection).
// center: a LayerNorm without bias instead (Cohere): (x - mean(x)) / sqrt(var(x) + eps) * w. heads: each
// row holds that many vectors of dim one after another, normed apart (block b: vector b % heads of row
// b / heads), w holding a row of weights for each (Command R+'s per-head q and k LayerNorms); 1 elsewhere.
extern "C" __global__ void rmsnorm(void* __restrict__ out, const float* x, const float* __restrict__ w, int dim,
                                   float eps, int add_one, int accumulate, int half_out,
                                   const float* __restrict__ enw, uint* __restrict__ recs, long long ldx,
                                   long long ldo, int center, int heads) {
    __shared__ float red[32];
    int row = blockIdx.x / heads, head = blockIdx.x % heads;
    const float* xr = x + (long long)row * ldx + (long long)head * dim;
    long long o = (long long)row * ldo + (long long)head * dim;
    w += (long long)head * dim;
    float mean = 0.f;
    if (center) {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) mean += xr[j];
        mean = block_sum(mean, red) / (float)dim;
    }
    float ss = 0.f;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) ss += (xr[j] - mean) * (xr[j] - mean);
    ss = block_sum(ss, red);
    float inv = rsqrtf(ss / (float)dim + eps);
    XIn rec;
    rec.q = recs == nullptr ? nullptr : recs + (long long)row * XREC * rec_units(dim >> 5);
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {  // warp-uniform trips when dim % 32 == 0
        float g = add_one ? 1.f + w[j] : w[j];
        float v = (xr[j] - mean) * inv * g;
        if (half_out) {
            ((ushort*)out)[o + j] = f2h(v);
            continue;
        }
        float r = accumulate ? ((float*)out)[o + j] + v : v;
        ((float*)out)[o + j] = r;
        if (recs != nullptr) quantize_unit_normed(rec, j >> 5, threadIdx.x & 31, r, enw[j]);
    }
}

// row (hd,) in shared memory = src (hd,), RMSNorm'd by nw (may be null), rotated by RoPE at pos on the
// first n_rot dims (neox: pairs (i, i + n_rot/2), else (2i, 2i+1)), the rotated dims then times mscale
// (Phi-4-mini's attention factor of a partly rotated head) and every dim times tscale (a query's
// temperature: attn_temperature). Block-wide, ends synchronised; blockDim.x >= hd / 2.
__device__ void norm_rope(float* row, const float* src, const float* nw, int pos, const float* inv_freq, int hd,
                          int n_rot, int neox, float eps, float* red, float mscale = 1.f, float tscale = 1.f) {
    for (int j = threadIdx.x; j < hd; j += blockDim.x) row[j] = src[j];
    if (nw) {
        float ss = 0.f;
        for (int j = threadIdx.x; j < hd; j += blockDim.x) ss += row[j] * row[j];
        ss = block_sum(ss, red);
        float inv = rsqrtf(ss / (float)hd + eps);
        for (int j = threadIdx.x; j < hd; j += blockDim.x) row[j] = row[j] * inv * nw[j];
    }
    __syncthreads();
    int half = n_rot >> 1;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double s, c;
        sincos((double)pos * (double)inv_freq[i], &s, &c);
        float cs = (float)c, sn = (float)s;
        int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        float a = row[ia], b = row[ib];
        row[ia] = a * cs - b * sn;
        row[ib] = a * sn + b * cs;
    }
    if (mscale != 1.f || tscale != 1.f) {
        __syncthreads();
        for (int j = threadIdx.x; j < hd; j += blockDim.x) row[j] *= (j < n_rot ? mscale : 1.f) * tscale;
    }
    __syncthreads();
}

// Ministral 3's query temperature at position pos: 1 + beta log(1 + floor(pos / len)) (beta 0: 1)
__device__ __forceinline__ float attn_temperature(int pos, float beta, int len) {
    return beta == 0.f ? 1.f : 1.f + beta * log1pf((float)(pos / len));
}

// k, v (hd,) into both caches at element offset o, float32 or float16 (kv_half). Block-wide.
__device__ __forceinline__ void store_kv(void* kc, void* vc, long long o, const float* k, const float* v, int hd,
                                         int kv_half) {
    for (int j = threadIdx.x; j < hd; j += blockDim.x) {
        if (kv_half) {
            ((ushort*)kc)[o + j] = f2h(k[j]);
            ((ushort*)vc)[o + j] = f2h(v[j]);
        } else {
            ((float*)kc)[o + j] = k[j];
            ((float*)vc)[o + j] = v[j];
        }
    }
}

// Prefill: one block per (token t = blockIdx.y of n = gridDim.y, head h = blockIdx.x) of the rows qkv
// (n, (H + 2 KV) hd), each [q (H, hd) | k (KV, hd) | v (KV, hd)]: norm_rope of q (by qn) and k (by kn)
// at position pos_base[0] + t. The rotated q goes to qg (KV, n * rep, hd) grouped by KV head, token-major
// (query head g * rep + r of token t in row t * rep + r of qg[g]: attention's GEMM operand), float32
// or float16 (q_half: the GEMM against a float16 cache); k (rotated) and v are written to this layer's
// cache (KV, n_ctx, hd), float32 or float16 (kv_half). gated: the q part holds per head its query then its
// output gate (H, 2, hd) (gate_heads applies the gates).
extern "C" __global__ void rope_store(void* __restrict__ qg, const float* __restrict__ qkv, void* __restrict__ kc,
                                      void* __restrict__ vc, const int* __restrict__ pos_base,
                                      const float* __restrict__ inv_freq, const float* __restrict__ qn,
                                      const float* __restrict__ kn, int H, int KV, int hd, int n_rot, int neox,
                                      int n_ctx, float eps, int kv_half, int q_half, float mscale, float beta,
                                      int tlen, int gated) {
    __shared__ float red[32];
    __shared__ float row[512];
    int t = blockIdx.y, h = blockIdx.x, n = gridDim.y, rep = H / KV;
    int pos = pos_base[0] + t;
    bool is_q = h < H;
    int kh = h - H;
    long long qs = gated ? 2LL * hd : hd;  // gated (Qwen3.5): each query head's rows then its output gate's
    const float* src = qkv + (long long)t * (H * qs + 2LL * KV * hd)
                       + (is_q ? h * qs : H * qs + (long long)kh * hd);  // q head h, or k head h - H
    float tscale = is_q ? attn_temperature(pos, beta, tlen) : 1.f;
    norm_rope(row, src, is_q ? qn : kn, pos, inv_freq, hd, n_rot, neox, eps, red, mscale, tscale);
    if (is_q) {
        long long dst = (((long long)(h / rep) * n + t) * rep + h % rep) * hd;
        for (int j = threadIdx.x; j < hd; j += blockDim.x) {
            if (q_half) ((ushort*)qg)[dst + j] = f2h(row[j]);
            else ((float*)qg)[dst + j] = row[j];
        }
        return;
    }
    store_kv(kc, vc, ((long long)kh * n_ctx + pos) * hd, row, src + (long long)KV * hd, hd, kv_half);
}

// Piece p (16 bytes: N = 8 halves or 4 floats) of the cache row starting at element `row`
template <int N>
__device__ __forceinline__ uint4 kv_load(const void* c, long long row, int p) {
    return ((const uint4*)((const uchar*)c + row * (N == 8 ? 2 : 4)))[p];
}
// ... as floats
template <int N>
__device__ __forceinline__ void kv_unpack(uint4 w, float* v) {
    if (N == 8) unpack8_f16(w, v);
    else unpack4_f32(w, v);
}
// the cache's rounding of a float (N = 8: float16)
template <int N>
__device__ __forceinline__ float kv_round(float x) { return N == 8 ? h2f(f2h(x)) : x; }

// One split of decode attention (attn_decode's block): keys k0..k1-1 of the KV head whose rows start at
// row `base` of the caches, position pos's key and value taken from sk and vnew. The scores go to sc,
// the block's (max, sum) to *m, *l and its unnormalised weighted sum of values to vsum[0] (hd,).
// 16 key slots (4 warps x 4 groups of 8 lanes); lane gl of a group takes pieces gl, gl + 8, .. of a
// row, so a warp's load covers 4 whole rows. Keys go 64 at a time (4 rounds of the 16 slots), each
// lane's 4 pieces loaded before the first is used, so a split of 64 keys waits on memory once for its
// scores and once for its values. Rows past k1 - 1 are read as row k1 - 1 (in the cache) and left out.
// A score is scale q.k, or cap tanh(scale q.k / cap) with cap > 0 (Gemma 2's soft-capping).
// N: cache elements per 16-byte piece (8 float16, 4 float32).
template <int N>
__device__ void attend_split(float* sc, float (*vsum)[512], const float* sq, const float* sk, const void* kc,
                             const void* vc, const float* vnew, long long base, int hd, int k0, int k1, int pos,
                             float scale, float cap, float* red, float* m_out, float* l_out) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gl = lane & 7;
    int slot = (warp << 2) | (lane >> 3), pieces = hd / N;
    for (int key0 = k0 + slot; key0 - slot < k1; key0 += 64) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        for (int p = gl; p < pieces; p += 8) {
            uint4 raw[4];
#pragma unroll
            for (int r = 0; r < 4; r++) raw[r] = kv_load<N>(kc, (base + min(key0 + 16 * r, k1 - 1)) * hd, p);
#pragma unroll
            for (int r = 0; r < 4; r++) {
                float v[N];
                if (key0 + 16 * r == pos) {
#pragma unroll
                    for (int e = 0; e < N; e++) v[e] = sk[p * N + e];
                } else {
                    kv_unpack<N>(raw[r], v);
                }
#pragma unroll
                for (int e = 0; e < N; e++) d[r] += sq[p * N + e] * v[e];
            }
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
            float t = d[r];
            t += __shfl_xor_sync(0xffffffffu, t, 1);
            t += __shfl_xor_sync(0xffffffffu, t, 2);
            t += __shfl_xor_sync(0xffffffffu, t, 4);
            int key = key0 + 16 * r;
            if (gl == 0 && key < k1) sc[key - k0] = cap > 0.f ? cap * tanhf(t * (scale / cap)) : t * scale;
        }
    }
    __syncthreads();
    float m = -3.0e38f;
    for (int i = threadIdx.x; i < k1 - k0; i += blockDim.x) m = fmaxf(m, sc[i]);
    m = block_max(m, red);
    float l = 0.f;
    for (int i = threadIdx.x; i < k1 - k0; i += blockDim.x) {
        float e = expf(sc[i] - m);
        sc[i] = e;
        l += e;
    }
    l = block_sum(l, red);  // its leading __syncthreads also publishes sc
    for (int p0 = 0; p0 < pieces; p0 += 8) {
        int p = p0 + gl;
        float a[N];
#pragma unroll
        for (int e = 0; e < N; e++) a[e] = 0.f;
        if (p < pieces) {
            for (int key0 = k0 + slot; key0 - slot < k1; key0 += 64) {
                uint4 raw[4];
#pragma unroll
                for (int r = 0; r < 4; r++) raw[r] = kv_load<N>(vc, (base + min(key0 + 16 * r, k1 - 1)) * hd, p);
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    int key = key0 + 16 * r;
                    if (key >= k1) break;  // the clamped rows count for nothing (not even a 0 * NaN)
                    float v[N], w = sc[key - k0];
                    if (key == pos) {  // the new value, from qkv, rounded as the cache stores it
#pragma unroll
                        for (int e = 0; e < N; e++) v[e] = kv_round<N>(vnew[p * N + e]);
                    } else {
                        kv_unpack<N>(raw[r], v);
                    }
#pragma unroll
                    for (int e = 0; e < N; e++) a[e] += w * v[e];
                }
            }
        }
#pragma unroll
        for (int e = 0; e < N; e++) {  // over the warp's 4 groups
            a[e] += __shfl_xor_sync(0xffffffffu, a[e], 8);
            a[e] += __shfl_xor_sync(0xffffffffu, a[e], 16);
        }
        if (lane < 8 && p < pieces) {
#pragma unroll
            for (int e = 0; e < N; e++) vsum[warp][p * N + e] = a[e];
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < hd; j += blockDim.x) vsum[0][j] += vsum[1][j] + vsum[2][j] + vsum[3][j];
    *m_out = m;
    *l_out = l;
}

// Decode attention of one token, in one launch (split-K, "flash decoding"). Grid (H, S): block (head h,
// split s) covers keys [s*chunk, (s+1)*chunk) clipped to the visible range [start, pos] (start > 0 with
// a sliding window), pos = pos_p[0]. It forms its query from qkv ([q (H, hd) | k (KV, hd) | v (KV, hd)],
// norm_rope by qn); the split that holds pos also forms the new key of its KV head (norm_rope by kn) and
// takes it and the new value from qkv instead of the cache (rounded as the cache would store them), and
// the block of the KV head's first query head writes both to the cache (no block reads position pos
// there). A split without visible keys does nothing (the grid is sized by the cache: captured once, it
// runs at every position). Unnormalised partial sums go to acc (H, S, hd), (max, sum) pairs to ml
// (H, S, 2); the last of a head's splits with keys to finish (count[h], which it resets for the next
// step) combines them into out (H, hd), and with xr (not null; hd a multiple of 32) into the
// activation records of out for the output projection's matvec too (common.cuh's quantize_unit).
// A batch of sequences in one launch (table not null; grid (H, S, B)): sequence z = blockIdx.z takes its
// caches and their n_ctx from table[3 z ..] (k, v, n_ctx), its rows out + z ldo and qkv + z ldq, its
// position pos_p[z], its scratch acc + z H S hd, ml + 2 z H S, count + z H, and its records (xr) the
// (H hd / 32) z-th; the caches share one dtype. gated (Qwen3.5): q rows (H, 2, hd) as rope_store's, each
// head's output times sigmoid of its gate. cap > 0: soft-capped scores (attend_split). sinks (H,)
// (not null; gpt-oss): head h's sink logit joins its softmax's denominator (a key whose value is 0).
// The cache is read in 16-byte pieces (attend_split), so rows must be 16-byte aligned (hd a multiple
// of 8). 128 threads; chunk <= ATTN_MAX_CHUNK; hd <= 512; S <= ATTN_MAX_CHUNK / 2 (the combine keeps
// each split's pair in sc: caches up to 8M positions).
#define ATTN_MAX_CHUNK 4096
extern "C" __global__ void __launch_bounds__(128) attn_decode(
    float* __restrict__ out, float* __restrict__ acc, float* __restrict__ ml, uint* __restrict__ count,
    const float* __restrict__ qkv, void* __restrict__ kc, void* __restrict__ vc, const int* __restrict__ pos_p,
    const float* __restrict__ inv_freq, const float* __restrict__ qn, const float* __restrict__ kn, int H, int KV,
    int hd, int n_ctx, int n_rot, int neox, float eps, float scale, int window, int chunk, int kv_half,
    uint* __restrict__ xr, const unsigned long long* __restrict__ table, long long ldo, long long ldq,
    float cap, const float* __restrict__ sinks, float mscale, float beta, int tlen, int gated) {
    __shared__ float red[32];
    __shared__ float sq[512];
    __shared__ float sk[512];
    __shared__ float sc[ATTN_MAX_CHUNK];
    __shared__ float vsum[4][512];  // each warp's part of the weighted sum of values
    __shared__ int last;
    pdl_launch_dependents();
    pdl_wait();  // qkv, the position and the caches come from the kernels before (pdl.py)
    int h = blockIdx.x, s = blockIdx.y, S = gridDim.y;
    if (table != nullptr) {  // sequence blockIdx.z of a batch: its caches, its rows, its position, its scratch
        int b = blockIdx.z;
        kc = (void*)table[3 * b];
        vc = (void*)table[3 * b + 1];
        n_ctx = (int)table[3 * b + 2];
        out += b * ldo;
        qkv += b * ldq;
        pos_p += b;
        acc += (long long)b * H * S * hd;
        ml += 2LL * b * H * S;
        count += (long long)b * H;
        if (xr != nullptr) xr += (long long)b * XREC * rec_units(H * hd >> 5);
    }
    int pos = pos_p[0];
    int start = window > 0 ? max(0, pos - window + 1) : 0;
    int k0 = max(start, s * chunk), k1 = min(pos + 1, (s + 1) * chunk);
    long long part = (long long)h * S + s;
    // splits s_lo..s_hi hold visible keys; the others (most of a long cache's near its start) leave at once
    int s_lo = start / chunk, s_hi = min(S - 1, pos / chunk), n_s = s_hi - s_lo + 1;
    if (k0 >= k1) return;  // the same for the whole block
    int g = h / (H / KV);
    long long qs = gated ? 2LL * hd : hd;  // as rope_store's
    const float* vnew = qkv + H * qs + (long long)(KV + g) * hd;
    float tscale = attn_temperature(pos, beta, tlen);
    norm_rope(sq, qkv + h * qs, qn, pos, inv_freq, hd, n_rot, neox, eps, red, mscale, tscale);
    bool holds_pos = k1 == pos + 1;
    if (holds_pos) {
        norm_rope(sk, qkv + H * qs + (long long)g * hd, kn, pos, inv_freq, hd, n_rot, neox, eps, red, mscale);
        if (kv_half)  // as the cache holds it (each thread its own elements, as store_kv)
            for (int j = threadIdx.x; j < hd; j += blockDim.x) sk[j] = h2f(f2h(sk[j]));
        if (h % (H / KV) == 0) store_kv(kc, vc, ((long long)g * n_ctx + pos) * hd, sk, vnew, hd, kv_half);
        __syncthreads();
    }
    long long base = (long long)g * n_ctx;  // the KV head's first row
    float m, l;
    if (kv_half) attend_split<8>(sc, vsum, sq, sk, kc, vc, vnew, base, hd, k0, k1, pos, scale, cap, red, &m, &l);
    else attend_split<4>(sc, vsum, sq, sk, kc, vc, vnew, base, hd, k0, k1, pos, scale, cap, red, &m, &l);
    for (int j = threadIdx.x; j < hd; j += blockDim.x) acc[part * hd + j] = vsum[0][j];
    if (threadIdx.x == 0) {
        ml[2 * part] = m;
        ml[2 * part + 1] = l;
    }
    // the last of the head's n_s blocks with keys to get here combines their partials
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&count[h], 1u) == (uint)(n_s - 1);
        if (last) count[h] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // the other blocks' partials, read from L2 (ld_l2: past L1, which another SM's writes do not reach):
    // each split's (max, sum) by a thread of its own, then each split's weight exp(m_i - M) / L, then
    // every thread's elements over the splits, their loads independent of one another
    const float* hml = ml + 2LL * (h * S + s_lo);
    float M = -3.0e38f;
    for (int i = threadIdx.x; i < n_s; i += blockDim.x) {
        float mi = ld_l2(hml + 2 * i), li = ld_l2(hml + 2 * i + 1);
        sc[2 * i] = mi;
        sc[2 * i + 1] = li;
        if (li > 0.f) M = fmaxf(M, mi);
    }
    M = block_max(M, red);
    if (sinks != nullptr) M = fmaxf(M, sinks[h]);
    float L = 0.f;
    for (int i = threadIdx.x; i < n_s; i += blockDim.x) {  // a thread rereads only its own splits' pairs
        float li = sc[2 * i + 1], w = li > 0.f ? expf(sc[2 * i] - M) : 0.f;
        sc[2 * i] = w;
        L += li * w;
    }
    L = block_sum(L, red);  // its leading __syncthreads also publishes the weights
    if (sinks != nullptr) L += expf(sinks[h] - M);
    float inv = 1.f / L;
    const float* hacc = acc + ((long long)h * S + s_lo) * hd;
    for (int j0 = 0; j0 < hd; j0 += blockDim.x) {
        int j = j0 + threadIdx.x;
        float a = 0.f;
        if (j < hd) {
#pragma unroll 8
            for (int i = 0; i < n_s; i++) a += ld_l2(hacc + (long long)i * hd + j) * sc[2 * i];
            a *= inv;
            if (gated) a /= 1.f + expf(-qkv[h * qs + hd + j]);  // times sigmoid(its gate)
            out[(long long)h * hd + j] = a;
        }
        if (xr != nullptr && j0 + (threadIdx.x & ~31) < hd) {  // the warp's 32 elements are a unit (hd % 32 == 0)
            XIn rec;
            rec.q = xr;
            quantize_unit(rec, (h * hd + j) >> 5, threadIdx.x & 31, a);
        }
    }
}

// Prefill attention's output in token order: out (n, H, hd) float32, or float16 (half_out: the output
// projection's GEMM input) = og (KV, n * rep, hd), laid out as rope_store's qg.
extern "C" __global__ void ungroup_heads(void* __restrict__ out, const float* __restrict__ og, int n, int H, int KV,
                                         int hd, int half_out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;  // element i of a token's H * hd (grid x), tokens grid y
    if (i >= H * hd) return;
    int j = i % hd, h = i / hd, rep = H / KV;
    for (long long t = blockIdx.y; t < n; t += gridDim.y) {
        float v = og[(((long long)(h / rep) * n + t) * rep + h % rep) * hd + j];
        long long o = t * H * hd + i;
        if (half_out) ((ushort*)out)[o] = f2h(v);
        else ((float*)out)[o] = v;
    }
}

// Prefill attention's softmax, in place over score rows s (rows, T) from a GEMM: rows come in groups
// of rep (the query heads of one KV head), group g is query g % nq of the chunk, at position
// pos_first + g % nq; column j is the key at position key0 + j. Keys [start, pos] count
// (start = pos - window + 1 with a sliding window, else 0), the rest become 0. One block per row.
// p16 (rows, T) float16, when not null, takes the probabilities instead (the float16 GEMM's operand).
// cap > 0: scores cap tanh(scale s / cap) (Gemma 2). sinks (not null; gpt-oss): the sink logits of the
// query heads of the rows' first KV head onwards (row group g's KV head is the g / nq-th from there, a
// row's query head g / nq * rep + its place in the group), each joining its rows' denominators.
__device__ __forceinline__ float capped(float v, float scale, float cap) {
    return cap > 0.f ? cap * tanhf(v * (scale / cap)) : v * scale;
}
extern "C" __global__ void softmax_causal(float* __restrict__ s, ushort* __restrict__ p16, int T, int nq, int rep,
                                          int pos_first, int key0, float scale, int window, float cap,
                                          const float* __restrict__ sinks) {
    __shared__ float red[32];
    int pos = pos_first + (int)((blockIdx.x / rep) % nq) - key0;  // in columns
    int start = (window > 0 ? max(0, pos + key0 - window + 1) : 0) - key0;
    float* r = s + (long long)blockIdx.x * T;
    float m = -3.0e38f;
    for (int j = max(start, 0) + threadIdx.x; j <= pos; j += blockDim.x) m = fmaxf(m, capped(r[j], scale, cap));
    m = block_max(m, red);
    float sink = 0.f;
    if (sinks != nullptr) {
        sink = sinks[blockIdx.x / (rep * nq) * rep + blockIdx.x % rep];
        m = fmaxf(m, sink);
    }
    float l = 0.f;
    for (int j = threadIdx.x; j < T; j += blockDim.x) {
        float e = j >= start && j <= pos ? expf(capped(r[j], scale, cap) - m) : 0.f;
        r[j] = e;
        l += e;
    }
    l = block_sum(l, red);
    if (sinks != nullptr) l += expf(sink - m);
    float inv = 1.f / l;
    if (p16 != nullptr) {
        ushort* p = p16 + (long long)blockIdx.x * T;
        for (int j = threadIdx.x; j < T; j += blockDim.x) p[j] = f2h(r[j] * inv);
    } else {
        for (int j = threadIdx.x; j < T; j += blockDim.x) r[j] *= inv;
    }
}

// Gated activation of rows stacked as gu (n, 2, ff) [gate | up] -> out (n, ff), float32 or float16
// (half_out: a prefill GEMM's input): silu(gate) * up (mode 0, SwiGLU), gelu_tanh(gate) * up (mode 1,
// GeGLU) or gpt-oss's clamped SwiGLU (mode 2: g = min(gate, limit), u = clamp(up, -limit, limit),
// g sigmoid(alpha g) (u + 1)); mode 3 (Nemotron-H's MLP, not gated): relu(x)^2 of rows x (n, ff), no up half.
// bias (not null; gpt-oss's experts): a [gate | up] bias row (2 ff) added
// first, row ids[t] of bias for row t (ids null: bias's first row for all). Grid (ceil(ff / 4 /
// blockDim.x), tokens grid-strided by gridDim.y): a thread takes 4 consecutive elements of a row, in
// 16-byte loads when ff % 4 == 0 (the rows are then 16-byte aligned), and no 64-bit division per element.
__device__ __forceinline__ float swiglu_oai(float g, float u, float alpha, float limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return g / (1.f + expf(-alpha * g)) * (u + 1.f);
}
extern "C" __global__ void glu(void* __restrict__ out, const float* __restrict__ gu, int ff, long long n,
                               int mode, int half_out, const float* __restrict__ bias, const int* __restrict__ ids,
                               float alpha, float limit) {
    int j = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= ff) return;
    bool vec = (ff & 3) == 0;
    for (long long t = blockIdx.y; t < n; t += gridDim.y) {
        bool gated = mode != 3;
        const float* g = gu + t * (gated ? 2 : 1) * ff + j;
        float gv[4], uv[4] = {0.f, 0.f, 0.f, 0.f}, v[4];
        if (vec) {
            float4 a = *(const float4*)g;
            gv[0] = a.x, gv[1] = a.y, gv[2] = a.z, gv[3] = a.w;
            if (gated) {
                float4 b = *(const float4*)(g + ff);
                uv[0] = b.x, uv[1] = b.y, uv[2] = b.z, uv[3] = b.w;
            }
        } else {
            for (int i = 0; i < 4; i++) {
                gv[i] = j + i < ff ? g[i] : 0.f;
                uv[i] = gated && j + i < ff ? g[ff + i] : 0.f;
            }
        }
        if (bias != nullptr) {
            const float* b = bias + (ids ? (long long)ids[t] : 0LL) * 2 * ff + j;
            for (int i = 0; i < 4 && j + i < ff; i++) {
                gv[i] += b[i];
                uv[i] += b[ff + i];
            }
        }
#pragma unroll
        for (int i = 0; i < 4; i++)
            v[i] = mode == 3   ? relu2(gv[i])
                   : mode == 2 ? swiglu_oai(gv[i], uv[i], alpha, limit)
                               : (mode ? gelu_tanh(gv[i]) : silu(gv[i])) * uv[i];
        long long o = t * ff + j;
        if (vec && half_out) {
            uint2 h = {(uint)f2h(v[0]) | ((uint)f2h(v[1]) << 16), (uint)f2h(v[2]) | ((uint)f2h(v[3]) << 16)};
            *(uint2*)((ushort*)out + o) = h;
        } else if (vec) {
            *(float4*)((float*)out + o) = make_float4(v[0], v[1], v[2], v[3]);
        } else {
            for (int i = 0; i < 4 && j + i < ff; i++) {
                if (half_out) ((ushort*)out)[o + i] = f2h(v[i]);
                else ((float*)out)[o + i] = v[i];
            }
        }
    }
}

// x (n,) += scale * y repeated: x[i] += scale y[i % m] (a bias over the rows of a batch; Granite's scaled
// residual branch)
extern "C" __global__ void add_inplace(float* __restrict__ x, const float* __restrict__ y, long long n, long long m,
                                       float scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += scale * y[i % m];
}
// Prefill's gated attention output (Qwen3.5): attn (n, H, hd) float32 or float16 (half) times sigmoid of
// each head's gate in the q part (H, 2, hd) of the q|k|v rows (ldq apart). Grid-strided over n H hd.
extern "C" __global__ void gate_heads(void* __restrict__ attn, const float* __restrict__ qkv, long long ldq,
                                      int H, int hd, long long n, int half) {
    long long total = n * H * hd;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long t = i / ((long long)H * hd);
        int hj = (int)(i - t * H * hd), h = hj / hd, j = hj - h * hd;
        float g = 1.f / (1.f + expf(-qkv[t * ldq + 2LL * h * hd + hd + j]));
        if (half) ((ushort*)attn)[i] = f2h(h2f(((ushort*)attn)[i]) * g);
        else ((float*)attn)[i] *= g;
    }
}
// out (n,) = x as float32, or float16 (half_out: a prefill GEMM's input from a branch without an input norm)
extern "C" __global__ void convert(void* __restrict__ out, const float* __restrict__ x, long long n, int half_out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (half_out) ((ushort*)out)[i] = f2h(x[i]);
    else ((float*)out)[i] = x[i];
}
// logits (n,) <- cap * tanh(logits / cap)
extern "C" __global__ void softcap(float* __restrict__ x, float cap, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}
// Increment the device position (after a captured decode step).
// The repetition penalty (CTRL, as engine/sampling.py's): x[ids[i]] divided by penalty where positive,
// multiplied where not, for n distinct ids.
extern "C" __global__ void penalize(float* __restrict__ x, const int* __restrict__ ids, int n, float penalty) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[ids[i]];
    x[ids[i]] = v > 0.f ? v / penalty : v * penalty;
}
extern "C" __global__ void bump(int* __restrict__ pos, int by) {
    if (threadIdx.x == 0) pos[0] += by;
}

// (value, index) order: larger value first, then smaller index (np.argmax's tie rule).
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}
__device__ __forceinline__ void block_best(float* v, int* i, float* rv, int* ri) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, *v, o);
        int oi = __shfl_xor_sync(0xffffffffu, *i, o);
        if (better(ov, oi, *v, *i)) { *v = ov; *i = oi; }
    }
    __syncthreads();
    if (lane == 0) { rv[warp] = *v; ri[warp] = *i; }
    __syncthreads();
    *v = lane < nw ? rv[lane] : -3.4e38f;
    *i = lane < nw ? ri[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, *v, o);
        int oi = __shfl_xor_sync(0xffffffffu, *i, o);
        if (better(ov, oi, *v, *i)) { *v = ov; *i = oi; }
    }
}

// Greedy: token[0] = argmax(logits (n,)). Each block takes a grid-strided share and leaves its best in
// pv/pi[blockIdx.x]; the last block to finish (count[0], which it resets for the next call) picks
// the best of those.
extern "C" __global__ void argmax(int* __restrict__ token, const float* __restrict__ x, int n,
                                  float* __restrict__ pv, int* __restrict__ pi, uint* __restrict__ count) {
    __shared__ float rv[32];
    __shared__ int ri[32];
    __shared__ int last;
    float bv = -3.4e38f;
    int bi = 0x7fffffff;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x)
        if (better(x[j], j, bv, bi)) { bv = x[j]; bi = j; }
    block_best(&bv, &bi, rv, ri);
    if (threadIdx.x == 0) {
        pv[blockIdx.x] = bv;
        pi[blockIdx.x] = bi;
        __threadfence();
        last = atomicAdd(count, 1u) == gridDim.x - 1;
        if (last) count[0] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = -3.4e38f;
    bi = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {  // past L1: the other blocks wrote them
        float v = ((const volatile float*)pv)[b];
        int i = ((const volatile int*)pi)[b];
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_best(&bv, &bi, rv, ri);
    if (threadIdx.x == 0) token[0] = bi;
}

// Sampling on the GPU: token[0] drawn from logits x (n,) as engine/sampling.py's `draw` does it with the
// uniform u in [0, 1): softmax of the k best at temperature temp (k = 0: top-k off), then the smallest
// prefix whose probability reaches top_p (top_p >= 1: off) and the tokens at least min_p times as likely
// as the best (min_p 0: off), then the first candidate whose running mass exceeds u * the kept mass.
// Candidates in (value, index) order, ties to the lower index, as the CPU's stable sort.
// With top-k off the SAMPLE_MAX_K best are the candidates and the whole row's softmax mass normalises
// them: when the cuts (or, with none, the draw) fall among them the pick is the CPU's; otherwise
// token[0] = -1 and the caller draws on the host with the same u.
// Each block takes a contiguous chunk of x, selects its kw best (kw = k, or SAMPLE_MAX_K with top-k
// off) by a radix select on order-preserving integer keys (4 passes of 8 bits, counts in shared
// memory) and writes them in index order to pv/pi[block * kw ..] (and, top-k off, its chunk's max and
// softmax sum to pm); the last block to finish (count[0], which it resets for the next call) selects
// the kw best of the gridDim.x * kw candidates the same way, sorts them (bitonic, in shared memory) and
// draws. 256 threads; dynamic shared memory 8 bytes a candidate.
// Several draws in one launch (rows not null): draw y = blockIdx.y takes its parameters from rows[6 y ..]
// (temp, top_p, min_p, u, k, and the row of x it draws from, ldx floats apart; integers as floats),
// writes token[y], and has scratch of its own: pv/pi + y * gridDim.x * SAMPLE_MAX_K, pm + 2 y gridDim.x,
// count + y.
#define SAMPLE_MAX_K 256
#define SAMPLE_THREADS 256

// float -> uint with the same order (larger float, larger key; NaNs aside)
__device__ __forceinline__ uint fkey(float v) {
    uint u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float kfloat(uint k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

// exclusive prefix sum of v over the block's SAMPLE_THREADS threads; *total: the sum of all.
// buf: 2 * SAMPLE_THREADS uints of shared memory
__device__ uint block_excl_scan(uint v, uint* buf, uint* total) {
    int t = threadIdx.x;
    uint *a = buf, *b = buf + SAMPLE_THREADS;
    a[t] = v;
    __syncthreads();
    for (int o = 1; o < SAMPLE_THREADS; o <<= 1) {
        b[t] = a[t] + (t >= o ? a[t - o] : 0u);
        __syncthreads();
        uint* s = a;
        a = b;
        b = s;
    }
    uint incl = a[t];
    *total = a[SAMPLE_THREADS - 1];
    __syncthreads();
    return incl - v;
}

// The kk best of c items (larger key first, then lower position), kk <= c, written in position order to
// out_key/out_pos[0..kk). key_of(j): item j's key. hist: 256 uints, scan: 2 * SAMPLE_THREADS, sel: 2.
template <typename KeyOf>
__device__ void block_select(KeyOf key_of, int c, int kk, uint* hist, uint* scan, uint* sel, uint* out_key,
                             int* out_pos) {
    if (kk <= 0) return;  // an empty chunk (the whole block returns)
    int t = threadIdx.x;
    uint prefix = 0, mask = 0, remaining = (uint)kk;
    for (int shift = 24; shift >= 0; shift -= 8) {  // the kk-th best key, 8 bits a pass from the top
        hist[t] = 0;
        __syncthreads();
        for (int j = t; j < c; j += SAMPLE_THREADS) {
            uint key = key_of(j);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        uint digit = 255u - (uint)t, cnt = hist[digit], total;
        uint before = block_excl_scan(cnt, scan, &total);  // items with a larger digit
        if (before < remaining && remaining <= before + cnt) {
            sel[0] = digit;
            sel[1] = remaining - before;
        }
        __syncthreads();
        prefix |= sel[0] << shift;
        mask |= 255u << shift;
        remaining = sel[1];
        __syncthreads();
    }
    // every key above the threshold, and the first `remaining` equal to it; each thread a contiguous run
    int per = (c + SAMPLE_THREADS - 1) / SAMPLE_THREADS, j0 = min(c, t * per), j1 = min(c, j0 + per);
    uint gt = 0, eq = 0, total;
    for (int j = j0; j < j1; j++) {
        uint key = key_of(j);
        gt += key > prefix;
        eq += key == prefix;
    }
    uint eq_before = block_excl_scan(eq, scan, &total);
    uint take = eq_before < remaining ? min(eq, remaining - eq_before) : 0u;
    uint o = block_excl_scan(gt + take, scan, &total);
    for (int j = j0; j < j1; j++) {
        uint key = key_of(j);
        bool in = key > prefix;
        if (key == prefix) in = eq_before++ < remaining;
        if (in) {
            out_key[o] = key;
            out_pos[o] = j;
            o++;
        }
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(256) sample_topk(int* __restrict__ token, const float* __restrict__ x,
                                                             int n, int k, float temp, float top_p, float min_p,
                                                             float u, float* __restrict__ pv, int* __restrict__ pi,
                                                             float* __restrict__ pm, uint* __restrict__ count,
                                                             const float* __restrict__ rows, long long ldx) {
    extern __shared__ uint cand[];  // the last block: gridDim.x * kw keys, then as many indices
    __shared__ uint hist[256], scan[2 * SAMPLE_THREADS], sel[2], sk[SAMPLE_MAX_K];
    __shared__ int si[SAMPLE_MAX_K];
    __shared__ float red[32], tv[SAMPLE_MAX_K];
    __shared__ int last;
    if (rows != nullptr) {  // one draw per blockIdx.y: its (temp, top_p, min_p, u, k, row of x), its scratch
        const float* r = rows + 6 * blockIdx.y;
        temp = r[0], top_p = r[1], min_p = r[2], u = r[3], k = (int)r[4];
        x += (long long)r[5] * ldx;
        token += blockIdx.y;
        pv += (long long)blockIdx.y * gridDim.x * SAMPLE_MAX_K;
        pi += (long long)blockIdx.y * gridDim.x * SAMPLE_MAX_K;
        pm += 2LL * blockIdx.y * gridDim.x;
        count += blockIdx.y;
    }
    int t = threadIdx.x, open = k == 0, kw = open ? SAMPLE_MAX_K : k;
    int chunk = (n + gridDim.x - 1) / gridDim.x, lo = min(n, (int)blockIdx.x * chunk), c = min(n, lo + chunk) - lo;
    int kk = min(kw, c);
    const float* xs = x + lo;
    block_select([=](int j) { return fkey(xs[j]); }, c, kk, hist, scan, sel, sk, si);
    for (int r = t; r < kw; r += SAMPLE_THREADS) {  // fewer items than kw: (key 0, INT_MAX) fill the rest
        pv[blockIdx.x * kw + r] = r < kk ? kfloat(sk[r]) : kfloat(0u);
        pi[blockIdx.x * kw + r] = r < kk ? lo + si[r] : 0x7fffffff;
    }
    if (open) {  // this chunk's max and softmax sum at temp, for the whole row's mass
        float m = __uint_as_float(0xff800000u);  // -inf
        for (int j = t; j < c; j += SAMPLE_THREADS) m = fmaxf(m, xs[j]);
        m = block_max(m, red);
        float s = 0.f;
        if (m > -3.4e38f)
            for (int j = t; j < c; j += SAMPLE_THREADS) s += expf((xs[j] - m) / temp);
        s = block_sum(s, red);
        if (t == 0) {
            pm[2 * blockIdx.x] = m;
            pm[2 * blockIdx.x + 1] = s;
        }
    }
    __threadfence();
    __syncthreads();
    if (t == 0) {
        last = atomicAdd(count, 1u) == gridDim.x - 1;
        if (last) count[0] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    int m = gridDim.x * kw;
    int* cand_i = (int*)(cand + m);
    for (int j = t; j < m; j += SAMPLE_THREADS) {  // the other blocks' writes, from L2; in index order
        cand[j] = fkey(ld_l2(pv + j));
        cand_i[j] = ld_l2(pi + j);
    }
    __syncthreads();
    int real = min(kw, n);  // candidates that are logits (the fill comes after them all)
    const uint* ck = cand;
    block_select([=](int j) { return ck[j]; }, m, real, hist, scan, sel, sk, si);
    for (int r = t; r < SAMPLE_MAX_K; r += SAMPLE_THREADS) {  // positions -> indices; pad with the fill
        si[r] = r < real ? cand_i[si[r]] : 0x7fffffff;
        if (r >= real) sk[r] = 0u;
    }
    __syncthreads();
    // bitonic sort of SAMPLE_MAX_K (key, index): larger key first, then lower index
    for (int size = 2; size <= SAMPLE_MAX_K; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            int a = t, b = t ^ stride;
            if (b > a) {
                bool desc = (a & size) == 0;  // this run's direction
                bool a_first = sk[a] > sk[b] || (sk[a] == sk[b] && si[a] < si[b]);
                if (a_first != desc) {
                    uint tk = sk[a];
                    sk[a] = sk[b];
                    sk[b] = tk;
                    int ti = si[a];
                    si[a] = si[b];
                    si[b] = ti;
                }
            }
            __syncthreads();
        }
    }
    float top = kfloat(sk[0]);
    if (t < real) tv[t] = expf((kfloat(sk[t]) - top) / temp);  // tv[0] = 1: min_p compares with it
    float whole = 0.f;                                          // the row's mass relative to the top's
    if (open)
        for (int b = t; b < gridDim.x; b += SAMPLE_THREADS) {
            float mb = ld_l2(pm + 2 * b), sb = ld_l2(pm + 2 * b + 1);
            if (sb > 0.f) whole += sb * expf((mb - top) / temp);
        }
    whole = block_sum(whole, red);
    __syncthreads();
    if (t != 0) return;
    float total = 0.f;
    for (int r = 0; r < real; r++) total += tv[r];
    bool known = !open || real == n;  // the candidates are the whole distribution the cuts apply to
    if (!known) total = whole;
    int keep = known ? real : 0;
    if (top_p < 1.f) {
        float cum = 0.f;
        for (int r = 0; r < real; r++) {
            cum += tv[r] / total;
            if (cum >= top_p) {
                keep = r + 1;
                known = true;
                break;
            }
        }
    }
    if (min_p > 0.f) {
        int above = 0;
        while (above < real && tv[above] >= min_p) above++;
        if (above < real || known) {
            keep = keep ? min(keep, max(1, above)) : max(1, above);
            known = true;
        }
    }
    float mass = total;  // everything kept (no cut): the row's mass
    if (known) {
        mass = 0.f;
        for (int r = 0; r < keep; r++) mass += tv[r];
    } else if (top_p < 1.f || min_p > 0.f) {
        token[0] = -1;  // a cut reaches past the candidates
        return;
    } else {
        keep = real;
    }
    float target = u * mass, cum = 0.f;
    int pick = known ? si[keep - 1] : -1;  // past the candidates' mass: the host's
    for (int r = 0; r < keep; r++) {
        cum += tv[r];
        if (cum > target) {
            pick = si[r];
            break;
        }
    }
    token[0] = pick;
}

// ---- mixture-of-experts routing and combination (engine/arch/moe.py's route and sum) ----------------
#define MOE_MAX_EXPERTS 512  // 16 router logits a lane
#define MOE_NEG_INF __uint_as_float(0xff800000u)
// Routing of n tokens (one warp a token, blockIdx.x grid-strided) among E <= MOE_MAX_EXPERTS experts from
// their router logits (n, E): ids (n, k) int32 the k chosen, wts (n, k) float32 their weights. Softmax
// gating (sigmoid 0): the k largest logits, or the k largest of probability + bias (ERNIE 4.5 MoE),
// weighed by their probabilities (normalize: over the k chosen; without a bias, the sum then taken over the
// chosen, as moe.route divides the chosen exp by their sum; with a bias clamped at 1e-12). Sigmoid gating
// (GLM-4.5): the k largest of sigmoid + bias, weighed by their sigmoid scores (normalize: over the k, + 1e-20).
// Ties go to the lower index, as moe.route's stable argsort. Weights times scale.
extern "C" __global__ void __launch_bounds__(32) moe_route(int* __restrict__ ids, float* __restrict__ wts,
                                                          const float* __restrict__ logits,
                                                          const float* __restrict__ bias, int n, int E, int k,
                                                          int sigmoid, int normalize, float scale) {
    int lane = threadIdx.x;
    for (int t = blockIdx.x; t < n; t += gridDim.x) {
        const float* lg = logits + (long long)t * E;
        float p[MOE_MAX_EXPERTS / 32], c[MOE_MAX_EXPERTS / 32];
        float mx = MOE_NEG_INF;
#pragma unroll
        for (int i = 0; i < MOE_MAX_EXPERTS / 32; i++) {
            int e = lane + 32 * i;
            p[i] = e < E ? lg[e] : MOE_NEG_INF;
            mx = fmaxf(mx, p[i]);
        }
        mx = warp_max(mx);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < MOE_MAX_EXPERTS / 32; i++) {
            int e = lane + 32 * i;
            float logit = p[i];
            if (sigmoid) p[i] = e < E ? 1.f / (1.f + expf(-logit)) : 0.f;
            else p[i] = e < E ? expf(logit - mx) : 0.f;
            sum += p[i];
            // the choice: the logit itself (softmax, no bias: the same order as the probabilities)
            c[i] = e >= E ? MOE_NEG_INF : (bias ? p[i] + bias[e] : (sigmoid ? p[i] : logit));
        }
        sum = warp_sum(sum);
        if (!sigmoid) {  // probabilities, before any bias is added for the choice
#pragma unroll
            for (int i = 0; i < MOE_MAX_EXPERTS / 32; i++) {
                int e = lane + 32 * i;
                p[i] /= sum;
                if (bias && e < E) c[i] = p[i] + bias[e];
            }
        }
        float chosen = 0.f, w_lane = 0.f;  // lane j < k keeps the j-th pick's weight
        int id_lane = 0;
        for (int j = 0; j < k; j++) {
            float bv = MOE_NEG_INF;
            int bi = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < MOE_MAX_EXPERTS / 32; i++) {
                int e = lane + 32 * i;
                if (e < E && better(c[i], e, bv, bi)) bv = c[i], bi = e;
            }
            for (int off = 16; off; off >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, bv, off);
                int oi = __shfl_xor_sync(0xffffffffu, bi, off);
                if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
            }
            float w = 0.f;
#pragma unroll
            for (int i = 0; i < MOE_MAX_EXPERTS / 32; i++) {
                if (lane + 32 * i == bi) {
                    w = p[i];
                    c[i] = MOE_NEG_INF;
                }
            }
            w = warp_sum(w);  // the owner's probability or score, to every lane
            chosen += w;
            if (lane == j) w_lane = w, id_lane = bi;
        }
        float div = 1.f;
        if (normalize) div = sigmoid ? chosen + 1e-20f : (bias ? fmaxf(chosen, 1e-12f) : chosen);
        if (lane < k) {
            ids[(long long)t * k + lane] = id_lane;
            wts[(long long)t * k + lane] = w_lane / div * scale;
        }
    }
}

// x (n, d) += scale times, for each token t, the weighted sum of its k experts' outputs y (n, k, d) (weights
// wts (n, k)), plus the shared expert's output ys (n, d) where given, times sigmoid(sg[t]) where its gate sg
// (n,) is given. yb (not null; gpt-oss): the experts' down biases (experts, d), row ids[t k + j] added to
// y[t, j]. scale: Granite's residual multiplier (1: none). Grid (ceil(d / blockDim.x), tokens grid-strided
// by gridDim.y).
extern "C" __global__ void moe_combine(float* __restrict__ x, const float* __restrict__ y,
                                       const float* __restrict__ wts, const float* __restrict__ ys,
                                       const float* __restrict__ sg, int k, int d, long long n,
                                       const float* __restrict__ yb, const int* __restrict__ ids, float scale) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d) return;
    for (long long t = blockIdx.y; t < n; t += gridDim.y) {
        const float* yt = y + t * k * d + i;
        float acc = 0.f;
        for (int j = 0; j < k; j++) {
            float b = yb ? yb[(long long)ids[t * k + j] * d + i] : 0.f;
            acc += wts[t * k + j] * (yt[(long long)j * d] + b);
        }
        if (ys) acc += (sg ? 1.f / (1.f + expf(-sg[t])) : 1.f) * ys[t * d + i];
        x[t * d + i] += scale * acc;
    }
}
