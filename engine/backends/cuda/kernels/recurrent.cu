// LFM2's gated short convolution (engine/arch/shortconv.py), Qwen3.5's gated DeltaNet layers
// (engine/arch/deltanet.py: the causal convolution of their q|k|v rows and the gated delta rule with its
// gated RMSNorm) and Mamba-2's (engine/arch/mamba2.py: the same convolution of x|B|C, with a bias, and the
// selective scan). The recurrent state and the convolution's last inputs are
// one sequence's (its cache's), read and rewritten in place: a captured decode step replays at every
// position.

#define DELTA_MAX_TAPS 9   // the convolution's history lives in registers
#define DELTA_MAX_HEAD 512  // head_k: q and k in shared memory; head_v: a thread a column
#define SSM_MAX_STATE 256   // Mamba-2's state size: a row of the state in a warp's registers, 8 a lane

// LFM2's convolution over the n rows bcx (n, 3d) [B | C | x] at positions p0 = pos[0]..: bx = B * x goes to
// the row p of the layer's history (n_ctx, d), float32 or float16 (half), which keeps every position's (a
// trim needs no state rolled back: ShortConvKVCache); out (n, d, ldo apart) = C * sum over j of w[c, j]
// bx(p - taps + 1 + j), zero before position 0. Positions before p0 are read from the history; the pass's
// own from bcx, rounded as the history holds them (the CPU model reads them back from its cache), so no
// thread reads what another writes. A thread a channel (blockIdx.x) and token (blockIdx.y, strided).
extern "C" __global__ void short_conv(float* __restrict__ out, long long ldo, const float* __restrict__ bcx,
                                      void* __restrict__ hist, const float* __restrict__ w,
                                      const int* __restrict__ pos, int d, int taps, int n, int half) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    int p0 = pos[0];
    const float* wc = w + (long long)c * taps;
    for (int t = blockIdx.y; t < n; t += gridDim.y) {
        int p = p0 + t;
        float acc = 0.f;
        for (int j = 0; j < taps; j++) {
            int q = p - taps + 1 + j;
            if (q < 0) continue;
            float v;
            if (q >= p0) {
                const float* r = bcx + 3LL * d * (q - p0);
                v = r[c] * r[2 * d + c];
                if (half) v = h2f(f2h(v));
            } else {
                long long o = (long long)q * d + c;
                v = half ? h2f(((const ushort*)hist)[o]) : ((const float*)hist)[o];
            }
            acc = fmaf(wc[j], v, acc);
        }
        const float* r = bcx + 3LL * d * t;
        float bx = r[c] * r[2 * d + c];
        long long o = (long long)p * d + c;
        if (half) ((ushort*)hist)[o] = f2h(bx);
        else ((float*)hist)[o] = bx;
        out[t * ldo + c] = acc * r[d + c];
    }
}

// out (n, C) = SiLU of the causal depthwise convolution (taps per channel, weights w (C, taps); plus
// bias (C,) where not null: Mamba-2's) of the rows x (n, C, ldx apart) after the conv_state rows
// (taps - 1, C) that come before them; conv_state then holds the last taps - 1 inputs. One thread a
// channel, its tokens in order, so it alone reads and rewrites its channel of conv_state.
extern "C" __global__ void delta_conv(float* __restrict__ out, const float* __restrict__ x, long long ldx,
                                      float* __restrict__ conv_state, const float* __restrict__ w,
                                      const float* __restrict__ bias, int C, int taps, int n) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float hist[DELTA_MAX_TAPS - 1];  // oldest first
    int h = taps - 1;
    for (int j = 0; j < h; j++) hist[j] = conv_state[(long long)j * C + c];
    const float* wc = w + (long long)c * taps;
    float b = bias ? bias[c] : 0.f;
    for (int t = 0; t < n; t++) {
        float xt = x[(long long)t * ldx + c];
        float acc = wc[h] * xt;
        for (int j = 0; j < h; j++) acc += wc[j] * hist[j];
        acc += b;
        out[(long long)t * C + c] = acc / (1.f + expf(-acc));
        for (int j = 0; j + 1 < h; j++) hist[j] = hist[j + 1];
        if (h > 0) hist[h - 1] = xt;
    }
    for (int j = 0; j < h; j++) conv_state[(long long)j * C + c] = hist[j];
}

// The gated delta rule of value head h = blockIdx.x over n tokens, from and into its state S (head_k, head_v)
// at state + h head_k head_v. Thread j owns column j of S, so the decay, the read S^T k, the write
// k delta^T and the read S^T q need no exchange between threads; q and k (L2-normed, q also by
// 1/sqrt(head_k)) are shared. conv (n, C): delta_conv's rows [q (k_heads hk) | k (k_heads hk) |
// v (v_heads hv)]; value head h reads key head h % k_heads (tiled: llama.cpp's GGUF order) or h / rep
// (grouped, rep = v_heads / k_heads). b and a: rows ba (n, 2 v_heads), [b | a]. beta = sigmoid(b), decay
// exp(neg_a[h] softplus(a + dt_bias[h])). out (n, v_heads hv) = RMSNorm(S^T q) * norm * SiLU(z), z the rows
// at proj + zoff (ldp apart). blockDim.x: hv rounded up to 32.
extern "C" __global__ void delta_rule(float* __restrict__ out, const float* __restrict__ conv,
                                      const float* __restrict__ proj, long long ldp, long long zoff,
                                      const float* __restrict__ ba, float* __restrict__ state,
                                      const float* __restrict__ dt_bias, const float* __restrict__ neg_a,
                                      const float* __restrict__ norm, int k_heads, int v_heads, int hk, int hv,
                                      int tiled, float eps, int n) {
    __shared__ float sq[DELTA_MAX_HEAD];
    __shared__ float sk[DELTA_MAX_HEAD];
    __shared__ float red[32];
    int h = blockIdx.x, rep = v_heads / k_heads, j = threadIdx.x;
    int kh = tiled ? h % k_heads : h / rep;
    long long C = 2LL * k_heads * hk + (long long)v_heads * hv;
    int bi = h, ai = v_heads + h;
    float* S = state + (long long)h * hk * hv;
    for (int t = 0; t < n; t++) {
        const float* row = conv + t * C;
        float qs = 0.f, ks = 0.f;
        for (int i = threadIdx.x; i < hk; i += blockDim.x) {
            float q = row[kh * hk + i], k = row[(long long)(k_heads + kh) * hk + i];
            sq[i] = q;
            sk[i] = k;
            qs += q * q;
            ks += k * k;
        }
        qs = block_sum(qs, red);  // its barriers also publish sq and sk
        ks = block_sum(ks, red);
        float qn = rsqrtf((float)hk) / sqrtf(qs + 1e-6f), kn = 1.f / sqrtf(ks + 1e-6f);
        const float* bat = ba + (long long)t * 2 * v_heads;
        float beta = 1.f / (1.f + expf(-bat[bi]));
        float av = bat[ai] + dt_bias[h];
        float decay = expf(neg_a[h] * (av > 20.f ? av : log1pf(expf(av))));  // softplus
        float o = 0.f;
        if (j < hv) {
            float mem = 0.f;
            for (int i = 0; i < hk; i++) {
                float s = S[(long long)i * hv + j] * decay;
                S[(long long)i * hv + j] = s;
                mem += s * (sk[i] * kn);
            }
            float delta = (row[2LL * k_heads * hk + (long long)h * hv + j] - mem) * beta;
            for (int i = 0; i < hk; i++) {
                float s = S[(long long)i * hv + j] + (sk[i] * kn) * delta;
                S[(long long)i * hv + j] = s;
                o += s * (sq[i] * qn);
            }
        }
        float ss = block_sum(j < hv ? o * o : 0.f, red);
        if (j < hv) {
            float z = proj[t * ldp + zoff + (long long)h * hv + j];
            out[(long long)t * v_heads * hv + (long long)h * hv + j] =
                o * rsqrtf(ss / (float)hv + eps) * norm[j] * (z / (1.f + expf(-z)));
        }
        __syncthreads();  // sq and sk are the next token's
    }
}

// Mamba-2's selective scan of head h = blockIdx.x over n tokens, from and into its state S (head_dim, size)
// at state + h head_dim size. Warp w of the block takes row p = blockIdx.y * warps + w of S, its lanes the
// columns lane, lane + 32, .. (held in registers through the tokens), so no thread reads what another
// writes. conv (n, C): delta_conv's rows [x (heads head_dim) | B (groups size) | C (groups size)], head h
// reading group h / (heads / groups). With dt the column dt_off + h of proj's rows (ldp apart),
// step = clamp(softplus(dt + dt_bias[h]), dt_min, dt_max); S_p = S_p exp(step neg_a[h]) + step x_p B;
// out (n, heads head_dim): y_p = (S_p . C + d[h] x_p) SiLU(z_p), z_p the column h head_dim + p of proj's rows
// (the grouped RMSNorm after it is rmsnorm's, with heads = groups).
extern "C" __global__ void ssm_scan(float* __restrict__ out, const float* __restrict__ conv,
                                    const float* __restrict__ proj, long long ldp, long long dt_off,
                                    float* __restrict__ state, const float* __restrict__ dt_bias,
                                    const float* __restrict__ neg_a, const float* __restrict__ dskip, int heads,
                                    int head_dim, int size, int groups, float dt_min, float dt_max, int n) {
    int h = blockIdx.x, lane = threadIdx.x & 31;
    int p = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (p >= head_dim) return;  // a whole warp: nothing below meets the block's other warps
    int g = h / (heads / groups);
    long long di = (long long)heads * head_dim, C = di + 2LL * groups * size;
    float* S = state + ((long long)h * head_dim + p) * size;
    float s[SSM_MAX_STATE / 32];
#pragma unroll
    for (int k = 0; k < SSM_MAX_STATE / 32; k++) {
        int i = lane + 32 * k;
        s[k] = i < size ? S[i] : 0.f;
    }
    float a = neg_a[h], bias = dt_bias[h], dd = dskip[h];
    for (int t = 0; t < n; t++) {
        const float* row = conv + t * C;
        const float* pr = proj + t * ldp;
        float v = pr[dt_off + h] + bias;
        float step = fminf(fmaxf(v > 20.f ? v : log1pf(expf(v)), dt_min), dt_max);  // softplus, clamped
        float decay = expf(step * a);
        float x = row[(long long)h * head_dim + p];
        float w = step * x;
        const float* Bg = row + di + (long long)g * size;
        const float* Cg = Bg + (long long)groups * size;
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < SSM_MAX_STATE / 32; k++) {
            int i = lane + 32 * k;
            if (i < size) {
                s[k] = fmaf(s[k], decay, w * Bg[i]);
                acc = fmaf(s[k], Cg[i], acc);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            float z = pr[(long long)h * head_dim + p];
            out[t * di + (long long)h * head_dim + p] = fmaf(dd, x, acc) * silu(z);
        }
    }
#pragma unroll
    for (int k = 0; k < SSM_MAX_STATE / 32; k++) {
        int i = lane + 32 * k;
        if (i < size) S[i] = s[k];
    }
}
