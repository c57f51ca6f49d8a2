// attention.cu: the gated full-attention mixer (docs/design.md §2.4) over a paged KV cache.
//
// Input per token: the in-projection row [q_proj (per head: HD queries then
// HD gates) | k KV_DIM | v KV_DIM] (f32, stride proj_stride).
//   attn_prep:      q_norm / k_norm (RMSNorm per head, fp32), RoPE on the
//                   first ROT_DIM dims (NeoX halves, pairs (j, j + ROT_DIM/2),
//                   angle = pos * inv_freq[j]); K and V written to the cache
//                   (fp16), q to a q buffer (f32 for decode, fp16 for prefill).
//   attn_decode:    one query token per sequence, split-K over KV blocks
//                   ("flash decoding"); a block serves the AG = 8 query heads
//                   of one KV head, so each K and V row is loaded once.
//   attn_combine:   merges the splits, applies sigmoid(gate).
//   attn_prefill:   causal flash attention with tensor cores (mma.sync fp16,
//                   fp32 softmax), Q tile 64 x one head, KV tiles = cache blocks.
// Scale 1/sqrt(HD); scores are kept in the log2 domain (scale * log2(e)).
//
// KV cache layout per layer: [block][A_KV_HEADS][KV_BLOCK][HD] fp16, for K
// and V separately; a sequence's token at position p lives in block
// block_table[slot][p / KV_BLOCK], row p % KV_BLOCK.

#define HD A_HEAD_DIM
#define AG (A_HEADS / A_KV_HEADS)
#define A_QPROJ (2 * A_HEADS * HD)
#define A_KVDIM (A_KV_HEADS * HD)

#if AG != 8
#error "decode attention assumes 8 query heads per KV head"
#endif
#if HD % 32 != 0 || HD > 256
#error "head dim must be a multiple of 32, at most 256"
#endif

struct AttnPrepParams {
    const float* proj;
    const float* q_norm;     // [HD] gain
    const float* k_norm;     // [HD] gain
    const float* inv_freq;   // [ROT_DIM / 2]
    const int* pos;          // [ntok]
    const int* slot;         // [ntok]
    const int* block_table;  // [slots][bt_stride]
    f16* kcache;            // layer base
    f16* vcache;
    float* q_f32;            // [ntok][A_HEADS][HD] or null
    f16* q_f16;            // [ntok][A_HEADS][HD] or null
    int proj_stride;
    int bt_stride;
    float eps;
};

// grid (A_HEADS + 2 * A_KV_HEADS, ntok), block HD. blockIdx.x < A_HEADS: a
// query head; then the K heads; then the V heads (copied as is).
extern "C" __global__ void attn_prep(const __grid_constant__ AttnPrepParams p) {
    __shared__ float buf[HD];
    __shared__ float red[32];
    const int head = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    const int ps = p.pos[t];
    const float* pr = p.proj + (size_t)t * p.proj_stride;
    const int blk = p.block_table[(size_t)p.slot[t] * p.bt_stride + ps / KV_BLOCK];
    const int row = ps % KV_BLOCK;
    if (head >= A_HEADS + A_KV_HEADS) {
        const int g = head - A_HEADS - A_KV_HEADS;
        const float v = pr[A_QPROJ + A_KVDIM + g * HD + d];
        p.vcache[(((size_t)blk * A_KV_HEADS + g) * KV_BLOCK + row) * HD + d] = f32_to_f16(v);
        return;
    }
    const bool is_q = head < A_HEADS;
    const float x = is_q ? pr[head * 2 * HD + d] : pr[A_QPROJ + (head - A_HEADS) * HD + d];
    const float ss = block_sum(x * x, red);
    const float y = x * rsqrtf(ss / (float)HD + p.eps) * (is_q ? p.q_norm[d] : p.k_norm[d]);
    buf[d] = y;
    __syncthreads();
    float out = y;
    if (d < ROT_DIM) {
        const int half = ROT_DIM / 2;
        const int j = d % half;
        float sn, cs;
        sincosf((float)ps * p.inv_freq[j], &sn, &cs);
        out = d < half ? y * cs - buf[d + half] * sn : y * cs + buf[d - half] * sn;
    }
    if (is_q) {
        const size_t qi = ((size_t)t * A_HEADS + head) * HD + d;
        if (p.q_f32 != nullptr) p.q_f32[qi] = out;
        if (p.q_f16 != nullptr) p.q_f16[qi] = f32_to_f16(out);
    } else {
        const int g = head - A_HEADS;
        p.kcache[(((size_t)blk * A_KV_HEADS + g) * KV_BLOCK + row) * HD + d] = f32_to_f16(out);
    }
}

// ---- decode ---------------------------------------------------------------

#define ATT_THREADS 256
#define DPL (HD / 32)
#define HPT_RAW (AG * HD / 2 / ATT_THREADS)
#define HPT (HPT_RAW > 0 ? HPT_RAW : 1)
#define NHG (AG / HPT)
#define SPL (KV_BLOCK / 32)

struct AttnDecodeParams {
    const float* q;          // [ntok][A_HEADS][HD]
    const f16* kcache;
    const f16* vcache;
    const int* block_table;
    const int* pos;
    const int* slot;
    float* part_o;           // [ntok][A_HEADS][max_splits][HD]
    float* part_ml;          // [ntok][A_HEADS][max_splits][2]  (max, sum) in the log2 domain
    int bt_stride;
    int max_splits;
    float scale_log2;
};

template <int N>
__device__ __forceinline__ void load_f16_row(const f16* p, float* out);
template <>
__device__ __forceinline__ void load_f16_row<8>(const f16* p, float* out) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    out[0] = f16lo(v.x); out[1] = f16hi(v.x); out[2] = f16lo(v.y); out[3] = f16hi(v.y);
    out[4] = f16lo(v.z); out[5] = f16hi(v.z); out[6] = f16lo(v.w); out[7] = f16hi(v.w);
}
template <>
__device__ __forceinline__ void load_f16_row<4>(const f16* p, float* out) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    out[0] = f16lo(v.x); out[1] = f16hi(v.x); out[2] = f16lo(v.y); out[3] = f16hi(v.y);
}
template <>
__device__ __forceinline__ void load_f16_row<2>(const f16* p, float* out) {
    const u32 v = *reinterpret_cast<const u32*>(p);
    out[0] = f16lo(v); out[1] = f16hi(v);
}
template <>
__device__ __forceinline__ void load_f16_row<1>(const f16* p, float* out) { out[0] = f16_to_f32(*p); }

// Sums 8 per-lane partials over the warp with 9 shuffles; lane l ends with the
// total of value ((l >> 4) & 1) * 4 + ((l >> 3) & 1) * 2 + ((l >> 2) & 1).
__device__ __forceinline__ float warp_reduce8(const float* v) {
    const int lane = threadIdx.x & 31;
    float a[4], b[2];
    const bool b4 = (lane >> 4) & 1, b3 = (lane >> 3) & 1, b2 = (lane >> 2) & 1;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float send = b4 ? v[j] : v[j + 4];
        const float keep = b4 ? v[j + 4] : v[j];
        a[j] = keep + __shfl_xor_sync(FULL_MASK, send, 16);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float send = b3 ? a[j] : a[j + 2];
        const float keep = b3 ? a[j + 2] : a[j];
        b[j] = keep + __shfl_xor_sync(FULL_MASK, send, 8);
    }
    const float send = b2 ? b[0] : b[1];
    const float keep = b2 ? b[1] : b[0];
    float c = keep + __shfl_xor_sync(FULL_MASK, send, 4);
    c += __shfl_xor_sync(FULL_MASK, c, 2);
    c += __shfl_xor_sync(FULL_MASK, c, 1);
    return c;
}

// How many splits the KV blocks of a context of `len` tokens are cut into:
// about 4 blocks per split, but one block per split for up to 16 blocks, so
// short contexts still spread over several multiprocessors; at most
// `max_splits`. Mirrors attention::splits_for in Rust (the scratch sizing).
// Each token of a batch decides its own count from its own length, on the
// device, so a captured decode graph serves every context length.
__device__ __forceinline__ int decode_splits(int len, int max_splits) {
    const int blocks = (len + KV_BLOCK - 1) / KV_BLOCK;
    const int s = max((blocks + 3) / 4, min(blocks, 16));
    return min(max(s, 1), max_splits);
}

// grid (A_KV_HEADS, G, ntok), block ATT_THREADS, with G <= max_splits fixed
// by the host for the batch size. A CTA computes splits blockIdx.y,
// blockIdx.y + G, ... of its token; split s of a context of n KV blocks cut
// into S splits covers blocks [s * ceil(n / S), ...). Scores: warp w takes
// tokens w, w + 8, ... of a KV block, lane l holds dims l * DPL .. of the 8
// queries (pre-scaled) and of the key row. Softmax update: warp h for head
// h. P V: thread (hg, d0) accumulates dims d0, d0 + 1 of heads
// hg * HPT .. + HPT.
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1)
attn_decode(const __grid_constant__ AttnDecodeParams p) {
    __shared__ float s_p[AG][KV_BLOCK];
    __shared__ float s_alpha[AG], s_m[AG], s_l[AG];
    const int g = blockIdx.x, t = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int len = p.pos[t] + 1;
    const int nsplit = decode_splits(len, p.max_splits);
    // Uniform over the CTA, so no thread skips a barrier.
    if ((int)blockIdx.y >= nsplit) return;
    const int nblk = (len + KV_BLOCK - 1) / KV_BLOCK;
    const int per = (nblk + nsplit - 1) / nsplit;
    const int* table = p.block_table + (size_t)p.slot[t] * p.bt_stride;

    float qr[AG][DPL];
#pragma unroll
    for (int h = 0; h < AG; ++h) {
        float tmp[DPL];
        const float* qp = p.q + ((size_t)t * A_HEADS + g * AG + h) * HD + lane * DPL;
#pragma unroll
        for (int j = 0; j < DPL; ++j) tmp[j] = qp[j];
#pragma unroll
        for (int j = 0; j < DPL; ++j) qr[h][j] = tmp[j] * p.scale_log2;
    }
    const int d0 = (tid % (HD / 2)) * 2, hg = tid / (HD / 2);
    const bool active = hg < NHG;
    for (int split = blockIdx.y; split < nsplit; split += gridDim.y) {
        const int b0 = split * per, b1 = min(nblk, b0 + per);
        // The previous split's results were written by the same threads that
        // reset them here, and its last block ended with a barrier.
        if (tid < AG) {
            s_m[tid] = NEG_INF;
            s_l[tid] = 0.f;
        }
        float acc[HPT][2];
#pragma unroll
        for (int hh = 0; hh < HPT; ++hh) acc[hh][0] = acc[hh][1] = 0.f;
        __syncthreads();

        for (int blk = b0; blk < b1; ++blk) {
            const int phys = table[blk];
            const f16* kb = p.kcache + ((size_t)phys * A_KV_HEADS + g) * KV_BLOCK * HD;
            const f16* vb = p.vcache + ((size_t)phys * A_KV_HEADS + g) * KV_BLOCK * HD;
            const int nt = min(KV_BLOCK, len - blk * KV_BLOCK);
            for (int j = warp; j < KV_BLOCK; j += ATT_THREADS / 32) {
                float part[AG];
                if (j < nt) {
                    float kf[DPL];
                    load_f16_row<DPL>(kb + (size_t)j * HD + lane * DPL, kf);
#pragma unroll
                    for (int h = 0; h < AG; ++h) {
                        float s = 0.f;
#pragma unroll
                        for (int jj = 0; jj < DPL; ++jj) s = fmaf(qr[h][jj], kf[jj], s);
                        part[h] = s;
                    }
                } else {
#pragma unroll
                    for (int h = 0; h < AG; ++h) part[h] = 0.f;
                }
                const float val = warp_reduce8(part);
                if ((lane & 3) == 0) {
                    const int hsel = ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1);
                    s_p[hsel][j] = j < nt ? val : NEG_INF;
                }
            }
            __syncthreads();
            if (warp < AG) {
                float x[SPL];
                float mx = NEG_INF;
#pragma unroll
                for (int i = 0; i < SPL; ++i) {
                    x[i] = s_p[warp][lane + 32 * i];
                    mx = fmaxf(mx, x[i]);
                }
                mx = warp_max(mx);
                const float m_old = s_m[warp];
                const float m_new = fmaxf(m_old, mx);
                const float alpha = exp2f(m_old - m_new);
                float sum = 0.f;
#pragma unroll
                for (int i = 0; i < SPL; ++i) {
                    const float e = exp2f(x[i] - m_new);
                    s_p[warp][lane + 32 * i] = e;
                    sum += e;
                }
                sum = warp_sum(sum);
                if (lane == 0) {
                    s_alpha[warp] = alpha;
                    s_m[warp] = m_new;
                    s_l[warp] = s_l[warp] * alpha + sum;
                }
            }
            __syncthreads();
            if (active) {
#pragma unroll
                for (int hh = 0; hh < HPT; ++hh) {
                    const float al = s_alpha[hg * HPT + hh];
                    acc[hh][0] *= al;
                    acc[hh][1] *= al;
                }
                for (int j = 0; j < nt; ++j) {
                    const u32 vv = *reinterpret_cast<const u32*>(vb + (size_t)j * HD + d0);
                    const float v0 = f16lo(vv), v1 = f16hi(vv);
#pragma unroll
                    for (int hh = 0; hh < HPT; ++hh) {
                        const float pp = s_p[hg * HPT + hh][j];
                        acc[hh][0] = fmaf(pp, v0, acc[hh][0]);
                        acc[hh][1] = fmaf(pp, v1, acc[hh][1]);
                    }
                }
            }
            __syncthreads();
        }
        if (active) {
#pragma unroll
            for (int hh = 0; hh < HPT; ++hh) {
                const int head = g * AG + hg * HPT + hh;
                float* o = p.part_o + (((size_t)t * A_HEADS + head) * p.max_splits + split) * HD + d0;
                o[0] = acc[hh][0];
                o[1] = acc[hh][1];
            }
        }
        if (tid < AG) {
            float* ml = p.part_ml + (((size_t)t * A_HEADS + g * AG + tid) * p.max_splits + split) * 2;
            ml[0] = s_m[tid];
            ml[1] = s_l[tid];
        }
    }
}

// grid (A_HEADS, ntok), block HD. mix[t][h * HD + d] = sigmoid(gate) * O / L.
struct AttnCombineParams {
    const float* part_o;
    const float* part_ml;
    const float* proj;     // for the gates
    float* mix_f32;
    f16* mix_f16;
    const int* pos;        // the token's position: its context length - 1
    int max_splits;        // stride of the partials
    int proj_stride;
};

extern "C" __global__ void attn_combine(const __grid_constant__ AttnCombineParams p) {
    const float* part_o = p.part_o;
    const float* part_ml = p.part_ml;
    const float* proj = p.proj;
    float* mix_f32 = p.mix_f32;
    f16* mix_f16 = p.mix_f16;
    const int proj_stride = p.proj_stride, ms = p.max_splits;
    const int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    const int nsplit = decode_splits(p.pos[t] + 1, ms);
    const float* ml = part_ml + ((size_t)t * A_HEADS + h) * ms * 2;
    float M = NEG_INF;
    for (int s = 0; s < nsplit; ++s) M = fmaxf(M, ml[2 * s]);
    float o = 0.f, L = 0.f;
    const float* po = part_o + ((size_t)t * A_HEADS + h) * ms * HD + d;
    for (int s = 0; s < nsplit; ++s) {
        const float m = ml[2 * s];
        if (m == NEG_INF) continue;
        const float w = exp2f(m - M);
        o = fmaf(w, po[(size_t)s * HD], o);
        L = fmaf(w, ml[2 * s + 1], L);
    }
    const float gate = proj[(size_t)t * proj_stride + h * 2 * HD + HD + d];
    const float y = (o / L) * sigmoidf_(gate);
    const size_t oi = (size_t)t * A_HEADS * HD + h * HD + d;
    if (mix_f32 != nullptr) mix_f32[oi] = y;
    if (mix_f16 != nullptr) mix_f16[oi] = f32_to_f16(y);
}

// ---- prefill: causal flash attention with mma.sync ------------------------

#define FA_BM 64
#define FA_BN KV_BLOCK
#define FA_LD (HD + 8)   // fp16 row stride in shared memory (16-byte shift per row)
#define FA_NF (FA_BN / 8)   // score n-fragments per warp
#define FA_OF (HD / 8)      // output n-fragments per warp

#if KV_BLOCK != 64
#error "the prefill kernel takes one cache block per KV tile of 64"
#endif

struct AttnPrefillParams {
    const f16* q;            // [T][A_HEADS][HD]
    const f16* kcache;       // layer base
    const f16* vcache;
    const int* block_table;   // this sequence's row
    const float* proj;        // for the gates
    float* mix_f32;           // [T][A_HEADS * HD] or null
    f16* mix_f16;           // or this
    int proj_stride;
    int T;
    int p0;                   // position of query row 0 (keys 0 .. p0 + T - 1 are in the cache)
    float scale_log2;
};

// grid (ceil(T / 64), A_HEADS), block 128 = 4 warps; warp w owns query rows
// 16w .. 16w + 15 of the tile. Dynamic smem: Q, K, V tiles [64][FA_LD] fp16.
// Pipeline: K of the next tile loads during softmax and P V, V of the next
// tile during the next Q K^T.
extern "C" __global__ void __launch_bounds__(128, 1)
attn_prefill(const __grid_constant__ AttnPrefillParams p) {
    extern __shared__ __align__(16) unsigned char fa_smem[];
    f16* sQ = reinterpret_cast<f16*>(fa_smem);
    f16* sK = sQ + FA_BM * FA_LD;
    f16* sV = sK + FA_BN * FA_LD;
    const int ntile = (p.T + FA_BM - 1) / FA_BM;
    const int qt = ntile - 1 - blockIdx.x;   // longest tiles first
    const int h = blockIdx.y, kvh = h / AG;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int q0 = qt * FA_BM;
    const int qlast = min(q0 + FA_BM, p.T) - 1;
    const int kb_last = (p.p0 + qlast) / KV_BLOCK;

    // Q tile (rows past T are zeros).
    for (int i = tid; i < FA_BM * (HD / 8); i += 128) {
        const int r = i / (HD / 8), c = (i - r * (HD / 8)) * 8;
        const int row = q0 + r;
        const f16* src = p.q + ((size_t)min(row, p.T - 1) * A_HEADS + h) * HD + c;
        cp_async16(sQ + r * FA_LD + c, src, row < p.T ? 16 : 0);
    }
    cp_async_commit();
    auto load_kv = [&](f16* dst, const f16* cache, int kb) {
        const int phys = p.block_table[kb];
        const f16* base = cache + ((size_t)phys * A_KV_HEADS + kvh) * KV_BLOCK * HD;
        for (int i = tid; i < FA_BN * (HD / 8); i += 128) {
            const int r = i / (HD / 8), c = (i - r * (HD / 8)) * 8;
            cp_async16(dst + r * FA_LD + c, base + (size_t)r * HD + c, 16);
        }
        cp_async_commit();
    };
    load_kv(sK, p.kcache, 0);
    load_kv(sV, p.vcache, 0);

    float o[FA_OF][4];
#pragma unroll
    for (int i = 0; i < FA_OF; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_r[2] = {NEG_INF, NEG_INF}, l_r[2] = {0.f, 0.f};
    const int g = lane >> 2, c4 = lane & 3;
    const int qpos0 = p.p0 + q0 + warp * 16 + g;   // position of this thread's first row; second is +8

    for (int kb = 0; kb <= kb_last; ++kb) {
        cp_async_wait<1>();   // Q and K(kb) are in; V(kb) may still be loading
        __syncthreads();
        float s[FA_NF][4];
#pragma unroll
        for (int i = 0; i < FA_NF; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) {
            u32 a0, a1, a2, a3;
            ldmatrix_x4(a0, a1, a2, a3, sQ + (warp * 16 + (lane & 15)) * FA_LD + ks * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int nf = 0; nf < FA_NF; nf += 2) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, sK + (nf * 8 + (lane & 7) + (lane >> 4) * 8) * FA_LD + ks * 16 + ((lane >> 3) & 1) * 8);
                mma_f16(s[nf], a0, a1, a2, a3, b0, b1);
                mma_f16(s[nf + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        __syncthreads();   // every warp is done with sK
        const bool more = kb < kb_last;
        if (more) load_kv(sK, p.kcache, kb + 1);

        // scale, causal mask, online softmax (rows g and g + 8 of the warp)
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nf = 0; nf < FA_NF; ++nf) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int kpos = kb * KV_BLOCK + nf * 8 + 2 * c4 + (e & 1);
                const int qpos = qpos0 + (e >> 1) * 8;
                const float v = kpos <= qpos ? s[nf][e] * p.scale_log2 : NEG_INF;
                s[nf][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
            const float m_new = fmaxf(m_r[r], mx[r]);
            alpha[r] = m_new == NEG_INF ? 1.f : exp2f(m_r[r] - m_new);
            m_r[r] = m_new;
        }
        float rs[2] = {0.f, 0.f};
        u32 pa[FA_NF][2];
#pragma unroll
        for (int nf = 0; nf < FA_NF; ++nf) {
            float e[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float mm = m_r[k >> 1];
                e[k] = mm == NEG_INF ? 0.f : exp2f(s[nf][k] - mm);
                rs[k >> 1] += e[k];
            }
            pa[nf][0] = pack_f16x2(e[0], e[1]);
            pa[nf][1] = pack_f16x2(e[2], e[3]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            rs[r] += __shfl_xor_sync(FULL_MASK, rs[r], 1);
            rs[r] += __shfl_xor_sync(FULL_MASK, rs[r], 2);
            l_r[r] = l_r[r] * alpha[r] + rs[r];
        }
#pragma unroll
        for (int i = 0; i < FA_OF; ++i) {
            o[i][0] *= alpha[0];
            o[i][1] *= alpha[0];
            o[i][2] *= alpha[1];
            o[i][3] *= alpha[1];
        }

        if (more) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();   // V(kb) visible to all
#pragma unroll
        for (int ks = 0; ks < FA_BN / 16; ++ks) {
            const u32 a0 = pa[2 * ks][0], a1 = pa[2 * ks][1], a2 = pa[2 * ks + 1][0], a3 = pa[2 * ks + 1][1];
#pragma unroll
            for (int df = 0; df < FA_OF; df += 2) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3,
                                  sV + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * FA_LD + df * 8 + (lane >> 4) * 8);
                mma_f16(o[df], a0, a1, a2, a3, b0, b1);
                mma_f16(o[df + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        __syncthreads();   // every warp is done with sV
        if (more) load_kv(sV, p.vcache, kb + 1);
    }

    // normalise, gate, store
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = q0 + warp * 16 + g + 8 * r;
        if (row >= p.T) continue;
        const float inv = 1.f / l_r[r];
        const float* gate = p.proj + (size_t)row * p.proj_stride + h * 2 * HD + HD;
        const size_t ob = (size_t)row * A_HEADS * HD + h * HD;
#pragma unroll
        for (int df = 0; df < FA_OF; ++df) {
            const int d = df * 8 + 2 * c4;
            const float y0 = o[df][2 * r] * inv * sigmoidf_(gate[d]);
            const float y1 = o[df][2 * r + 1] * inv * sigmoidf_(gate[d + 1]);
            if (p.mix_f32 != nullptr) {
                p.mix_f32[ob + d] = y0;
                p.mix_f32[ob + d + 1] = y1;
            }
            if (p.mix_f16 != nullptr) *reinterpret_cast<u32*>(p.mix_f16 + ob + d) = pack_f16x2(y0, y1);
        }
    }
}
