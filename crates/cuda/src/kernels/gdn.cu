// gdn.cu: the Gated DeltaNet mixer (docs/design.md §2.3), decode step and chunked prefill.
//
// Input: the in-projection row of each token, [qkv CONV_DIM | z VAL_DIM |
// a GV_HEADS | b GV_HEADS] (f32, stride proj_stride). Per value head h (key
// head kh = h / (GV_HEADS / GK_HEADS)):
//   conv:  y[c] = silu(sum_j w[c][j] * x_{t-3+j}[c]) over the qkv channels
//          (depthwise, kernel 4, taps oldest first)
//   q, k:  l2-normalised per head in fp32 (x * rsqrt(sum x^2 + 1e-6)), q also
//          scaled by 1/sqrt(GK_DIM)
//   gates: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
//   delta rule, fp32 state S[h][k][v]:
//          S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q
//   out:   w * o * rsqrt(mean(o^2) + eps) * silu(z)   (gated RMSNorm per head)
//
// State layout: conv windows [slot][layer][4][CONV_DIM] f32, a ring indexed
// by position & 3 (the raw input of position p lives in entry p & 3, so a
// step reads entries of p-1..p-3 and writes entry p, and no block reads what
// another block of the same launch writes); recurrent state
// [slot][layer][GV_HEADS][GK_DIM][GV_DIM] f32. Kernels get the layer's base
// pointers and the per-slot strides.
//
// Prefill uses the chunked form (chunks of GDN_CHUNK = 64 tokens):
//   gdn_prefill_prep  conv + silu + l2norm + gates, head-major outputs,
//   gdn_conv_store    the last raw inputs into the conv ring,
//   gdn_chunk_a       per (chunk, head), all chunks in parallel:
//                     G = cumsum(g); A = -(beta k k^T * exp(G_i - G_j)) strictly lower;
//                     T = (I - A)^-1 by forward substitution;
//                     U = T (beta v); W = T (beta exp(G) k);
//                     Aqk = (q k^T * exp(G_i - G_j)) lower incl. diagonal
//   gdn_chunk_b       per (head, 32 value columns), sequential over chunks:
//                     Vn = U - W S; O = (exp(G) q) S + Aqk Vn;
//                     S = exp(G_last) S + (exp(G_last - G) k)^T Vn
//   gdn_gated_norm    the gated RMSNorm of O.

#define GDN_D GV_DIM
#define GDN_KEY (GK_HEADS * GK_DIM)
#define GDN_VAL (GV_HEADS * GV_DIM)
#define GDN_RATIO (GV_HEADS / GK_HEADS)
#define GDN_KSPLIT 4
#define GDN_THREADS (GDN_D * GDN_KSPLIT)
#define GDN_KPT (GK_DIM / GDN_KSPLIT)
#define GDN_CHUNK 64

#if GK_DIM != GV_DIM
#error "GK_DIM must equal GV_DIM"
#endif
#if CONV_K != 4
#error "the conv ring assumes a kernel of 4"
#endif

struct GdnDecodeParams {
    const float* proj;
    float* conv;            // layer base of the conv rings
    const float* conv_w;    // [CONV_DIM][4]
    const float* a_log;     // [GV_HEADS]
    const float* dt_bias;   // [GV_HEADS]
    const float* norm_w;    // [GV_DIM]
    float* state;           // layer base of the recurrent states
    const int* pos;         // [ntok]
    const int* slot;        // [ntok]
    float* mix_f32;         // [ntok][GDN_VAL], or null
    f16* mix_f16;          // [ntok][GDN_VAL], or null
    u16* mix_px;           // packed activations [ntok][2][GDN_VAL] (qmm.cu), or null
    long long conv_slot_stride;   // floats
    long long state_slot_stride;  // floats
    int proj_stride;
    float eps;
};

// grid (GV_HEADS, ntok), block GDN_THREADS = 4 * GV_DIM. Thread (kq, v)
// holds S[kq * GDN_KPT .. +GDN_KPT][v] in registers; the S^T k and S^T q
// sums over k are finished through shared memory.
extern "C" __global__ void __launch_bounds__(GDN_THREADS)
gdn_decode(const __grid_constant__ GdnDecodeParams p) {
    __shared__ float sq[GK_DIM], sk[GK_DIM], sv[GV_DIM], sz[GV_DIM];
    __shared__ float part[GDN_KSPLIT][GV_DIM];
    __shared__ float red[32];
    pdl_trigger();
    pdl_wait();
    const int h = blockIdx.x, t = blockIdx.y, kh = h / GDN_RATIO, tid = threadIdx.x;
    const int ps = p.pos[t], sl = p.slot[t];
    const float* pr = p.proj + (size_t)t * p.proj_stride;
    float* cs = p.conv + (size_t)sl * p.conv_slot_stride;

    if (tid < 3 * GDN_D) {
        const int which = tid / GDN_D, i = tid - which * GDN_D;
        const int ch = which == 0 ? kh * GK_DIM + i : which == 1 ? GDN_KEY + kh * GK_DIM + i : 2 * GDN_KEY + h * GV_DIM + i;
        const float raw = pr[ch];
        const float* w = p.conv_w + ch * 4;
        float y = w[3] * raw;
        y = fmaf(w[2], cs[((ps - 1) & 3) * CONV_DIM + ch], y);
        y = fmaf(w[1], cs[((ps - 2) & 3) * CONV_DIM + ch], y);
        y = fmaf(w[0], cs[((ps - 3) & 3) * CONV_DIM + ch], y);
        y = siluf_(y);
        if (which == 0) sq[i] = y;
        else if (which == 1) sk[i] = y;
        else sv[i] = y;
        // q/k channels are shared by GDN_RATIO value heads: the first writes.
        if (which == 2 || (h % GDN_RATIO) == 0) cs[(ps & 3) * CONV_DIM + ch] = raw;
    } else {
        const int i = tid - 3 * GDN_D;
        sz[i] = pr[CONV_DIM + h * GV_DIM + i];
    }
    __syncthreads();
    const float qq = tid < GK_DIM ? sq[tid] * sq[tid] : 0.f;
    const float kk = (tid >= GK_DIM && tid < 2 * GK_DIM) ? sk[tid - GK_DIM] * sk[tid - GK_DIM] : 0.f;
    const float sum_q = block_sum(qq, red);
    const float sum_k = block_sum(kk, red);
    const float rq = rsqrtf(sum_q + 1e-6f) * rsqrtf((float)GK_DIM);
    const float rk = rsqrtf(sum_k + 1e-6f);
    const float a = pr[CONV_DIM + GDN_VAL + h], b = pr[CONV_DIM + GDN_VAL + GV_HEADS + h];
    const float g = -expf(p.a_log[h]) * softplusf_(a + p.dt_bias[h]);
    const float beta = sigmoidf_(b);
    const float decay = expf(g);

    const int v = tid % GV_DIM, kq = tid / GV_DIM, k0 = kq * GDN_KPT;
    float* S = p.state + (size_t)sl * p.state_slot_stride + (size_t)h * GK_DIM * GV_DIM;
    float s[GDN_KPT];
#pragma unroll
    for (int j = 0; j < GDN_KPT; ++j) s[j] = S[(size_t)(k0 + j) * GV_DIM + v];
    float kv = 0.f;
#pragma unroll
    for (int j = 0; j < GDN_KPT; ++j) kv = fmaf(s[j], sk[k0 + j], kv);
    part[kq][v] = kv * rk;
    __syncthreads();
    float kvm = 0.f;
#pragma unroll
    for (int q = 0; q < GDN_KSPLIT; ++q) kvm += part[q][v];
    const float u = beta * (sv[v] - decay * kvm);
    float o = 0.f;
#pragma unroll
    for (int j = 0; j < GDN_KPT; ++j) {
        s[j] = fmaf(decay, s[j], sk[k0 + j] * rk * u);
        o = fmaf(s[j], sq[k0 + j], o);
        S[(size_t)(k0 + j) * GV_DIM + v] = s[j];
    }
    __syncthreads();
    part[kq][v] = o * rq;
    __syncthreads();
    float ov = 0.f;
    if (tid < GV_DIM) {
#pragma unroll
        for (int q = 0; q < GDN_KSPLIT; ++q) ov += part[q][tid];
    }
    const float ss = block_sum(tid < GV_DIM ? ov * ov : 0.f, red);
    if (tid < GV_DIM) {
        const float y = ov * rsqrtf(ss / (float)GV_DIM + p.eps) * p.norm_w[tid] * siluf_(sz[tid]);
        const size_t oi = (size_t)t * GDN_VAL + h * GV_DIM + tid;
        if (p.mix_f32 != nullptr) p.mix_f32[oi] = y;
        if (p.mix_f16 != nullptr) p.mix_f16[oi] = f32_to_f16(y);
        if (p.mix_px != nullptr) {
            // hi/lo halves at the packed position (px_perm in qmm.cu).
            const int col = h * GV_DIM + tid;
            const f16 hi = f32_to_f16(y), lo = f32_to_f16(y - f16_to_f32(hi));
            u16* r = p.mix_px + (size_t)t * 2 * GDN_VAL + (col & ~7) + (((col & 3) << 1) | ((col & 7) >> 2));
            r[0] = hi;
            r[GDN_VAL] = lo;
        }
    }
}

// ---- chunked prefill ------------------------------------------------------

struct GdnPrepParams {
    const float* proj;      // [T][proj_stride]
    const float* conv;      // conv ring of this layer and sequence (slot base)
    const float* conv_w;
    const float* a_log;
    const float* dt_bias;
    float* qn;              // [GK_HEADS][Tp][GK_DIM]  (scaled)
    float* kn;              // [GK_HEADS][Tp][GK_DIM]
    float* vv;              // [GV_HEADS][Tp][GV_DIM]
    float* gg;              // [GV_HEADS][Tp]
    float* bb;              // [GV_HEADS][Tp]
    int proj_stride;
    int T;                  // real tokens
    int Tp;                 // padded to GDN_CHUNK
    int p0;                 // position of token 0
};

#define PREP_PER_LANE (GK_DIM / 32)

// Raw qkv input of relative token `t` (may be negative: then it comes from
// the conv ring, which holds the inputs before this call).
__device__ __forceinline__ float gdn_raw(const GdnPrepParams& p, int t, int ch) {
    if (t >= 0) return p.proj[(size_t)t * p.proj_stride + ch];
    return p.conv[((p.p0 + t) & 3) * CONV_DIM + ch];
}

__device__ __forceinline__ float gdn_conv_at(const GdnPrepParams& p, int t, int ch) {
    const float* w = p.conv_w + ch * 4;
    float y = w[3] * gdn_raw(p, t, ch);
    y = fmaf(w[2], gdn_raw(p, t - 1, ch), y);
    y = fmaf(w[1], gdn_raw(p, t - 2, ch), y);
    y = fmaf(w[0], gdn_raw(p, t - 3, ch), y);
    return siluf_(y);
}

// grid (Tp, 3), block 32 * GK_HEADS. blockIdx.y: 0 = q, 1 = k (warp = key
// head, with its l2 norm), 2 = v (warps stride over value heads) plus the
// gates. Padded tokens (t >= T) get zeros, which add nothing to the state.
extern "C" __global__ void gdn_prefill_prep(const __grid_constant__ GdnPrepParams p) {
    const int t = blockIdx.x, part = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (part < 2) {
        float* out = (part == 0 ? p.qn : p.kn) + ((size_t)warp * p.Tp + t) * GK_DIM;
        if (t >= p.T) {
#pragma unroll
            for (int j = 0; j < PREP_PER_LANE; ++j) out[lane + 32 * j] = 0.f;
            return;
        }
        float y[PREP_PER_LANE];
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < PREP_PER_LANE; ++j) {
            const int ch = part * GDN_KEY + warp * GK_DIM + lane + 32 * j;
            y[j] = gdn_conv_at(p, t, ch);
            ss += y[j] * y[j];
        }
        ss = warp_sum(ss);
        float r = rsqrtf(ss + 1e-6f);
        if (part == 0) r *= rsqrtf((float)GK_DIM);
#pragma unroll
        for (int j = 0; j < PREP_PER_LANE; ++j) out[lane + 32 * j] = y[j] * r;
    } else {
        for (int hh = warp; hh < GV_HEADS; hh += nw) {
            float* out = p.vv + ((size_t)hh * p.Tp + t) * GV_DIM;
#pragma unroll
            for (int j = 0; j < PREP_PER_LANE; ++j) {
                const int ch = 2 * GDN_KEY + hh * GV_DIM + lane + 32 * j;
                out[lane + 32 * j] = t < p.T ? gdn_conv_at(p, t, ch) : 0.f;
            }
            if (lane == 0) {
                float g = 0.f, beta = 0.f;
                if (t < p.T) {
                    const float* pr = p.proj + (size_t)t * p.proj_stride;
                    const float a = pr[CONV_DIM + GDN_VAL + hh], b = pr[CONV_DIM + GDN_VAL + GV_HEADS + hh];
                    g = -expf(p.a_log[hh]) * softplusf_(a + p.dt_bias[hh]);
                    beta = sigmoidf_(b);
                }
                p.gg[(size_t)hh * p.Tp + t] = g;
                p.bb[(size_t)hh * p.Tp + t] = beta;
            }
        }
    }
}

// grid (ceil(CONV_DIM / 256)), block 256: the raw inputs of the last three
// positions of this call go into the conv ring (after gdn_prefill_prep has
// read the old entries).
struct GdnConvStoreParams {
    const float* proj;
    float* conv;           // conv ring of this layer and sequence
    int proj_stride;
    int T;
    int p0;
};

extern "C" __global__ void gdn_conv_store(const __grid_constant__ GdnConvStoreParams p) {
    const float* proj = p.proj;
    float* conv = p.conv;
    const int proj_stride = p.proj_stride, T = p.T, p0 = p.p0;
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= CONV_DIM) return;
    for (int d = 1; d <= 3; ++d) {
        const int t = T - d;
        if (t >= 0) conv[((p0 + t) & 3) * CONV_DIM + ch] = proj[(size_t)t * proj_stride + ch];
    }
}

struct GdnChunkAParams {
    const float* qn;
    const float* kn;
    const float* vv;
    const float* gg;
    const float* bb;
    float* U;       // [GV_HEADS][Tp][GV_DIM]
    float* W;       // [GV_HEADS][Tp][GK_DIM]
    float* Aqk;     // [GV_HEADS][nchunks][64][64]
    float* Gc;      // [GV_HEADS][Tp]  cumulative g within each chunk
    int Tp;
};

#define CA_LD (GDN_CHUNK + 4)   // row stride of the transposed [dim][token] tiles
#define CA_LDT (GDN_CHUNK + 1)  // row stride of the 64x64 matrix
#define CA_LDR (GK_DIM + 4)     // row stride of the row-major [token][dim] tiles
// The q tile [GK_DIM][CA_LD] is later reused for the row-major k tile
// [64][CA_LDR]; the region holds whichever is larger.
#define CA_QT_SIZE ((GK_DIM * CA_LD) > (GDN_CHUNK * CA_LDR) ? (GK_DIM * CA_LD) : (GDN_CHUNK * CA_LDR))

// grid (nchunks, GV_HEADS), block 256. Dynamic smem (floats):
//   kt [GK_DIM][CA_LD], qt [CA_QT_SIZE] (the q tile, later the row-major k tile),
//   vr [64][CA_LDR], tm [64][CA_LDT], G [64], beta [64].
extern "C" __global__ void __launch_bounds__(256)
gdn_chunk_a(const __grid_constant__ GdnChunkAParams p) {
    extern __shared__ float sm[];
    float* kt = sm;
    float* qt = kt + GK_DIM * CA_LD;
    float* vr = qt + CA_QT_SIZE;
    float* tm = vr + GDN_CHUNK * CA_LDR;
    float* G = tm + GDN_CHUNK * CA_LDT;
    float* beta = G + GDN_CHUNK;
    const int c = blockIdx.x, h = blockIdx.y, kh = h / GDN_RATIO, tid = threadIdx.x;
    const int t0 = c * GDN_CHUNK;
    const float* K = p.kn + ((size_t)kh * p.Tp + t0) * GK_DIM;
    const float* Q = p.qn + ((size_t)kh * p.Tp + t0) * GK_DIM;
    const float* V = p.vv + ((size_t)h * p.Tp + t0) * GV_DIM;

    for (int i = tid; i < GDN_CHUNK * GK_DIM; i += 256) {
        const int t = i / GK_DIM, d = i - t * GK_DIM;
        kt[d * CA_LD + t] = K[i];
        qt[d * CA_LD + t] = Q[i];
        vr[t * CA_LDR + d] = V[i];
    }
    if (tid < 32) {
        // inclusive scan of g over the chunk, 2 values per lane
        const float* gp = p.gg + (size_t)h * p.Tp + t0;
        float a = gp[2 * tid], b = gp[2 * tid + 1];
        float s = a + b;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float n = __shfl_up_sync(FULL_MASK, s, o);
            if (tid >= o) s += n;
        }
        const float excl = s - (a + b);
        G[2 * tid] = excl + a;
        G[2 * tid + 1] = excl + a + b;
        p.Gc[(size_t)h * p.Tp + t0 + 2 * tid] = excl + a;
        p.Gc[(size_t)h * p.Tp + t0 + 2 * tid + 1] = excl + a + b;
    } else if (tid < 96) {
        beta[tid - 32] = p.bb[(size_t)h * p.Tp + t0 + tid - 32];
    }
    __syncthreads();

    // k k^T and q k^T, 4x4 outputs per thread.
    {
        const int ti = tid >> 4, tj = tid & 15;
        float kk[4][4], qk[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) kk[a][b] = qk[a][b] = 0.f;
        for (int d = 0; d < GK_DIM; ++d) {
            const float4 ka = *reinterpret_cast<const float4*>(kt + d * CA_LD + 4 * ti);
            const float4 qa = *reinterpret_cast<const float4*>(qt + d * CA_LD + 4 * ti);
            const float4 kb = *reinterpret_cast<const float4*>(kt + d * CA_LD + 4 * tj);
            const float ka_[4] = {ka.x, ka.y, ka.z, ka.w}, qa_[4] = {qa.x, qa.y, qa.z, qa.w}, kb_[4] = {kb.x, kb.y, kb.z, kb.w};
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    kk[a][b] = fmaf(ka_[a], kb_[b], kk[a][b]);
                    qk[a][b] = fmaf(qa_[a], kb_[b], qk[a][b]);
                }
        }
        float* aq = p.Aqk + (((size_t)h * (p.Tp / GDN_CHUNK) + c) * GDN_CHUNK) * GDN_CHUNK;
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int i = 4 * ti + a;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int j = 4 * tj + b;
                const float dec = j <= i ? expf(G[i] - G[j]) : 0.f;
                tm[i * CA_LDT + j] = j < i ? -(beta[i] * kk[a][b] * dec) : 0.f;
                aq[i * GDN_CHUNK + j] = qk[a][b] * dec;
            }
        }
    }
    __syncthreads();

    // The row-major k tile for W replaces the q tile (q is no longer needed).
    float* kr = qt;
    for (int i = tid; i < GDN_CHUNK * GK_DIM; i += 256) {
        const int t = i / GK_DIM, d = i - t * GK_DIM;
        kr[t * CA_LDR + d] = K[i] * beta[t] * expf(G[t]);
        vr[t * CA_LDR + d] *= beta[t];
    }

    // Forward substitution, row by row: T[i][j] = A[i][j] + sum_{j<m<i} A[i][m] T[m][j].
    for (int i = 1; i < GDN_CHUNK; ++i) {
        float val = 0.f;
        const int j = tid;
        if (j < i) {
            val = tm[i * CA_LDT + j];
            for (int m = j + 1; m < i; ++m) val = fmaf(tm[i * CA_LDT + m], tm[m * CA_LDT + j], val);
        }
        __syncthreads();
        if (j < i) tm[i * CA_LDT + j] = val;
        __syncthreads();
    }
    if (tid < GDN_CHUNK) tm[tid * CA_LDT + tid] = 1.f;
    __syncthreads();

    // U = T (beta v), W = T (beta exp(G) k): rows 8 * warp .. +8, columns 4 * lane .. +4.
    {
        const int warp = tid >> 5, lane = tid & 31;
        for (int cb = 4 * lane; cb < GK_DIM; cb += 128) {
            float u[8][4], w[8][4];
#pragma unroll
            for (int r = 0; r < 8; ++r)
#pragma unroll
                for (int q = 0; q < 4; ++q) u[r][q] = w[r][q] = 0.f;
            for (int m = 0; m < GDN_CHUNK; ++m) {
                const float4 vb = *reinterpret_cast<const float4*>(vr + m * CA_LDR + cb);
                const float4 kb = *reinterpret_cast<const float4*>(kr + m * CA_LDR + cb);
                const float vb_[4] = {vb.x, vb.y, vb.z, vb.w}, kb_[4] = {kb.x, kb.y, kb.z, kb.w};
#pragma unroll
                for (int r = 0; r < 8; ++r) {
                    const float tv = tm[(8 * warp + r) * CA_LDT + m];
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        u[r][q] = fmaf(tv, vb_[q], u[r][q]);
                        w[r][q] = fmaf(tv, kb_[q], w[r][q]);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                const size_t row = (size_t)h * p.Tp + t0 + 8 * warp + r;
                *reinterpret_cast<float4*>(p.U + row * GV_DIM + cb) = make_float4(u[r][0], u[r][1], u[r][2], u[r][3]);
                *reinterpret_cast<float4*>(p.W + row * GK_DIM + cb) = make_float4(w[r][0], w[r][1], w[r][2], w[r][3]);
            }
        }
    }
}

struct GdnChunkBParams {
    const float* qn;
    const float* kn;
    const float* U;
    const float* W;
    const float* Aqk;
    const float* Gc;
    float* state;    // this layer's recurrent state of the sequence (slot base), [GV_HEADS][GK_DIM][GV_DIM]
    float* O;        // [Tp][GDN_VAL] (f32, before the gated norm)
    int Tp;
};

#define CB_COLS 32
#define CB_LDR (GK_DIM + 4)
#define CB_LDV (CB_COLS + 4)
#define CB_LDA (GDN_CHUNK + 4)

// grid (GV_HEADS, GV_DIM / CB_COLS), block 256. The block owns
// S[:, v0 .. v0 + CB_COLS) in shared memory for the whole call. Dynamic smem
// (floats): S [GK_DIM][CB_LDV], w [64][CB_LDR], qg [64][CB_LDR],
// kd [64][CB_LDR], u [64][CB_LDV], vn [64][CB_LDV], a [64][CB_LDA], G [64].
extern "C" __global__ void __launch_bounds__(256)
gdn_chunk_b(const __grid_constant__ GdnChunkBParams p) {
    extern __shared__ float sm[];
    float* S = sm;
    float* w = S + GK_DIM * CB_LDV;
    float* qg = w + GDN_CHUNK * CB_LDR;
    float* kd = qg + GDN_CHUNK * CB_LDR;
    float* u = kd + GDN_CHUNK * CB_LDR;
    float* vn = u + GDN_CHUNK * CB_LDV;
    float* a = vn + GDN_CHUNK * CB_LDV;
    float* G = a + GDN_CHUNK * CB_LDA;
    const int h = blockIdx.x, kh = h / GDN_RATIO, v0 = blockIdx.y * CB_COLS, tid = threadIdx.x;
    float* Sg = p.state + (size_t)h * GK_DIM * GV_DIM;
    for (int i = tid; i < GK_DIM * CB_COLS; i += 256) {
        const int k = i / CB_COLS, v = i - k * CB_COLS;
        S[k * CB_LDV + v] = Sg[(size_t)k * GV_DIM + v0 + v];
    }
    const int nchunks = p.Tp / GDN_CHUNK;
    for (int c = 0; c < nchunks; ++c) {
        const int t0 = c * GDN_CHUNK;
        if (tid < GDN_CHUNK) G[tid] = p.Gc[(size_t)h * p.Tp + t0 + tid];
        __syncthreads();
        const float glast = G[GDN_CHUNK - 1];
        const float* Wg = p.W + ((size_t)h * p.Tp + t0) * GK_DIM;
        const float* Qg = p.qn + ((size_t)kh * p.Tp + t0) * GK_DIM;
        const float* Kg = p.kn + ((size_t)kh * p.Tp + t0) * GK_DIM;
        for (int i = tid * 4; i < GDN_CHUNK * GK_DIM; i += 256 * 4) {
            const int t = i / GK_DIM, d = i - t * GK_DIM;
            const float eg = expf(G[t]), ed = expf(glast - G[t]);
            float4 x = *reinterpret_cast<const float4*>(Wg + i);
            *reinterpret_cast<float4*>(w + t * CB_LDR + d) = x;
            x = *reinterpret_cast<const float4*>(Qg + i);
            *reinterpret_cast<float4*>(qg + t * CB_LDR + d) = make_float4(x.x * eg, x.y * eg, x.z * eg, x.w * eg);
            x = *reinterpret_cast<const float4*>(Kg + i);
            *reinterpret_cast<float4*>(kd + t * CB_LDR + d) = make_float4(x.x * ed, x.y * ed, x.z * ed, x.w * ed);
        }
        const float* Ug = p.U + ((size_t)h * p.Tp + t0) * GV_DIM + v0;
        for (int i = tid; i < GDN_CHUNK * CB_COLS; i += 256) {
            const int t = i / CB_COLS, v = i - t * CB_COLS;
            u[t * CB_LDV + v] = Ug[(size_t)t * GV_DIM + v];
        }
        const float* Ag = p.Aqk + ((size_t)h * nchunks + c) * GDN_CHUNK * GDN_CHUNK;
        for (int i = tid; i < GDN_CHUNK * GDN_CHUNK; i += 256) {
            const int r = i / GDN_CHUNK, j = i - r * GDN_CHUNK;
            a[r * CB_LDA + j] = Ag[i];
        }
        __syncthreads();

        // Vn = U - W S: rows 2 * ri .. +2, columns 4 * cj .. +4.
        const int ri = tid >> 3, cj = tid & 7;
        {
            float acc[2][4];
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[r][q] = 0.f;
            for (int k = 0; k < GK_DIM; ++k) {
                const float4 sv = *reinterpret_cast<const float4*>(S + k * CB_LDV + 4 * cj);
                const float s_[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float wv = w[(2 * ri + r) * CB_LDR + k];
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[r][q] = fmaf(wv, s_[q], acc[r][q]);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int idx = (2 * ri + r) * CB_LDV + 4 * cj + q;
                    vn[idx] = u[idx] - acc[r][q];
                }
        }
        __syncthreads();

        // O = qg S + A Vn (same mapping), written to global.
        {
            float acc[2][4];
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[r][q] = 0.f;
            for (int k = 0; k < GK_DIM; ++k) {
                const float4 sv = *reinterpret_cast<const float4*>(S + k * CB_LDV + 4 * cj);
                const float s_[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float qv = qg[(2 * ri + r) * CB_LDR + k];
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[r][q] = fmaf(qv, s_[q], acc[r][q]);
                }
            }
            for (int j = 0; j < GDN_CHUNK; ++j) {
                const float4 nv = *reinterpret_cast<const float4*>(vn + j * CB_LDV + 4 * cj);
                const float n_[4] = {nv.x, nv.y, nv.z, nv.w};
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float av = a[(2 * ri + r) * CB_LDA + j];
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[r][q] = fmaf(av, n_[q], acc[r][q]);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float* o = p.O + (size_t)(t0 + 2 * ri + r) * GDN_VAL + h * GV_DIM + v0 + 4 * cj;
                *reinterpret_cast<float4*>(o) = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
            }
        }
        __syncthreads();

        // S = exp(G_last) S + kd^T Vn: k rows 4 * rk .. +4 (rk = tid / 8), columns 4 * cj .. +4.
        {
            const int rk = tid >> 3;
            const float gl = expf(glast);
            for (int kb = 4 * rk; kb < GK_DIM; kb += 128) {
                float acc[4][4];
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[r][q] = 0.f;
                for (int i = 0; i < GDN_CHUNK; ++i) {
                    const float4 kv = *reinterpret_cast<const float4*>(kd + i * CB_LDR + kb);
                    const float4 nv = *reinterpret_cast<const float4*>(vn + i * CB_LDV + 4 * cj);
                    const float k_[4] = {kv.x, kv.y, kv.z, kv.w}, n_[4] = {nv.x, nv.y, nv.z, nv.w};
#pragma unroll
                    for (int r = 0; r < 4; ++r)
#pragma unroll
                        for (int q = 0; q < 4; ++q) acc[r][q] = fmaf(k_[r], n_[q], acc[r][q]);
                }
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        float* sp = S + (kb + r) * CB_LDV + 4 * cj + q;
                        *sp = fmaf(gl, *sp, acc[r][q]);
                    }
            }
        }
        __syncthreads();
    }
    for (int i = tid; i < GK_DIM * CB_COLS; i += 256) {
        const int k = i / CB_COLS, v = i - k * CB_COLS;
        Sg[(size_t)k * GV_DIM + v0 + v] = S[k * CB_LDV + v];
    }
}

// grid (T, ceil(GV_HEADS / 8)), block 256: warp = one (token, head).
// mix[t][h * D + i] = w[i] * O * rsqrt(mean(O^2) + eps) * silu(z).
struct GdnGatedNormParams {
    const float* O;        // [T][GDN_VAL]
    const float* proj;     // for z
    const float* norm_w;
    float* mix_f32;
    f16* mix_f16;
    int proj_stride;
    float eps;
};

extern "C" __global__ void __launch_bounds__(256)
gdn_gated_norm(const __grid_constant__ GdnGatedNormParams p) {
    const float* O = p.O;
    const float* proj = p.proj;
    const float* norm_w = p.norm_w;
    float* mix_f32 = p.mix_f32;
    f16* mix_f16 = p.mix_f16;
    const int proj_stride = p.proj_stride;
    const float eps = p.eps;
    const int t = blockIdx.x, h = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (h >= GV_HEADS) return;
    const float* o = O + (size_t)t * GDN_VAL + h * GV_DIM;
    const float* z = proj + (size_t)t * proj_stride + CONV_DIM + h * GV_DIM;
    float v[PREP_PER_LANE];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < PREP_PER_LANE; ++j) {
        v[j] = o[lane + 32 * j];
        ss += v[j] * v[j];
    }
    ss = warp_sum(ss);
    const float r = rsqrtf(ss / (float)GV_DIM + eps);
#pragma unroll
    for (int j = 0; j < PREP_PER_LANE; ++j) {
        const int i = lane + 32 * j;
        const float y = v[j] * r * norm_w[i] * siluf_(z[i]);
        const size_t oi = (size_t)t * GDN_VAL + h * GV_DIM + i;
        if (mix_f32 != nullptr) mix_f32[oi] = y;
        if (mix_f16 != nullptr) mix_f16[oi] = f32_to_f16(y);
    }
}
