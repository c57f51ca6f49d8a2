// moe.cu: the mixture-of-experts block.
//
// Router (every path): logits = router(x) (8-bit GEMV or GEMM elsewhere);
// softmax in fp32, top TOPK (ties: lower expert index first), the TOPK
// weights renormalised to sum 1, which equals a softmax over the selected
// logits. The shared expert is weighted by sigmoid(shared_expert_gate x).
//
// Decode (a few tokens, fused, only the chosen experts' weights are read):
//   moe_gate_up: act[t][s][i] = silu(gate_e . xn) * (up_e . xn) for the TOPK
//                chosen experts e of token t (slots 0..TOPK-1) and the shared
//                expert (slot TOPK); xn = RMSNorm(h) recomputed per block.
//   moe_down:    h[t][r] += sum_s w[t][s] * (down_{e_s}[r] . act[t][s]).
// Prefill (many tokens; grouped GEMMs in gemm.cu do the matrix work):
//   moe_route:   top-k per token, per-expert counts and ranks (atomics),
//   moe_plan:    exclusive scan of the counts and the tile list of the
//                grouped GEMM (one block),
//   moe_scatter: sorted position of every (token, slot) pair,
//   moe_combine: h[t] += sum_k w[t][k] * y[pos(t, k)] + sigmoid(sg[t]) * ys[t].

#define MOE_THREADS 256
#define MOE_SLOTS (TOPK + 1)
#define EXPERTS_PER_LANE ((N_EXPERTS + 31) / 32)

// Top-k of one token's router logits by one warp. Lane l holds experts
// l, l + 32, ...; TOPK rounds of a warp argmax. Writes idx[TOPK] and the
// renormalised weights w[TOPK] (lane 0 writes).
__device__ __forceinline__ void warp_topk(const float* __restrict__ logits, int* idx, float* w) {
    const int lane = threadIdx.x & 31;
    float v[EXPERTS_PER_LANE];
#pragma unroll
    for (int i = 0; i < EXPERTS_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < N_EXPERTS ? logits[e] : NEG_INF;
    }
    float sel_v[TOPK];
    int sel_i[TOPK];
#pragma unroll
    for (int k = 0; k < TOPK; ++k) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < EXPERTS_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            if (e < N_EXPERTS && (v[i] > bv || (v[i] == bv && e < bi))) {
                bv = v[i];
                bi = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        sel_v[k] = bv;
        sel_i[k] = bi;
#pragma unroll
        for (int i = 0; i < EXPERTS_PER_LANE; ++i)
            if (lane + 32 * i == bi) v[i] = NEG_INF;
    }
    if (lane == 0) {
        // softmax over all experts then renormalising the top k equals a
        // softmax over the k selected logits; sel_v[0] is their maximum.
        float tot = 0.f;
        float e[TOPK];
#pragma unroll
        for (int k = 0; k < TOPK; ++k) {
            e[k] = expf(sel_v[k] - sel_v[0]);
            tot += e[k];
        }
#pragma unroll
        for (int k = 0; k < TOPK; ++k) {
            idx[k] = sel_i[k];
            w[k] = e[k] / tot;
        }
    }
}

struct QMat {
    const u32* codes;
    const bf16* scales;
    const bf16* biases;
};

struct MoeUpParams {
    QMat gate;       // [N_EXPERTS][MOE_INTER][HIDDEN] 4-bit
    QMat up;
    QMat sh_gate;    // [MOE_INTER][HIDDEN]
    QMat sh_up;
    const float* x;  // residual stream [ntok][x_stride]
    const float* gain;
    const float* router_logits;  // [ntok][N_EXPERTS]
    const float* sg_logits;      // [ntok] (shared expert gate, before sigmoid)
    float* act;                  // [ntok][MOE_SLOTS][MOE_INTER]
    int* topk_idx;               // [ntok][TOPK]
    float* topk_w;               // [ntok][MOE_SLOTS]; slot TOPK = sigmoid(sg)
    int x_stride;
    int ntok;
    float eps;
};

// One item of a fused expert kernel: the lane's 16-byte chunk of 4 rows.
struct MoeLoad {
    uint4 w[4];
    float sc[4];
    float bi[4];
};

__device__ __forceinline__ void moe_fetch_rows(const u32* c0, const u32* c1, const u32* c2, const u32* c3,
                                               const bf16* s0, const bf16* s1, const bf16* s2, const bf16* s3,
                                               const bf16* b0, const bf16* b1, const bf16* b2, const bf16* b3, int ch,
                                               int g, MoeLoad& L) {
    L.w[0] = ld_stream_u4(c0 + ch * 4);
    L.w[1] = ld_stream_u4(c1 + ch * 4);
    L.w[2] = ld_stream_u4(c2 + ch * 4);
    L.w[3] = ld_stream_u4(c3 + ch * 4);
    L.sc[0] = bf16_to_f32(ld_nc_u16(s0 + g));
    L.sc[1] = bf16_to_f32(ld_nc_u16(s1 + g));
    L.sc[2] = bf16_to_f32(ld_nc_u16(s2 + g));
    L.sc[3] = bf16_to_f32(ld_nc_u16(s3 + g));
    L.bi[0] = bf16_to_f32(ld_nc_u16(b0 + g));
    L.bi[1] = bf16_to_f32(ld_nc_u16(b1 + g));
    L.bi[2] = bf16_to_f32(ld_nc_u16(b2 + g));
    L.bi[3] = bf16_to_f32(ld_nc_u16(b3 + g));
}

// gate_up task (token t, slot s, row pair i0): rows 0, 1 = gate i0, i0+1 and
// 2, 3 = up i0, i0+1 of the slot's expert; step `it` covers chunk lane + 32 it.
__device__ __forceinline__ void moe_up_task(const MoeUpParams& p, const int* sel_idx, int task, int& t, int& s, int& i0) {
    const int pairs = MOE_INTER / 2;
    t = task / (MOE_SLOTS * pairs);
    const int rem = task - t * (MOE_SLOTS * pairs);
    s = rem / pairs;
    i0 = (rem - s * pairs) * 2;
}

__device__ __forceinline__ void moe_up_fetch(const MoeUpParams& p, const int* sel_idx, int t, int s, int i0, int ch, MoeLoad& L) {
    const int wpr = HIDDEN / 8, gpr = HIDDEN / GROUP_SIZE;
    const u32 *cg, *cu;
    const bf16 *sgp, *bgp, *sup, *bup;
    if (s < TOPK) {
        const size_t rbase = (size_t)sel_idx[t * TOPK + s] * MOE_INTER + i0;
        cg = p.gate.codes + rbase * wpr;
        cu = p.up.codes + rbase * wpr;
        sgp = p.gate.scales + rbase * gpr;
        bgp = p.gate.biases + rbase * gpr;
        sup = p.up.scales + rbase * gpr;
        bup = p.up.biases + rbase * gpr;
    } else {
        cg = p.sh_gate.codes + (size_t)i0 * wpr;
        cu = p.sh_up.codes + (size_t)i0 * wpr;
        sgp = p.sh_gate.scales + (size_t)i0 * gpr;
        bgp = p.sh_gate.biases + (size_t)i0 * gpr;
        sup = p.sh_up.scales + (size_t)i0 * gpr;
        bup = p.sh_up.biases + (size_t)i0 * gpr;
    }
    moe_fetch_rows(cg, cg + wpr, cu, cu + wpr, sgp, sgp + gpr, sup, sup + gpr, bgp, bgp + gpr, bup, bup + gpr, ch, ch >> 1, L);
}

// grid: persistent (host-sized), block MOE_THREADS. Warp task = (token,
// slot, pair of intermediate rows): it reads gate rows i, i+1 and up rows
// i, i+1 of the slot's expert (4 rows, each HIDDEN 4-bit codes) and writes
// act for the two rows. The next chunk's loads are issued before the current
// chunk's arithmetic, the first ones before xn is staged. Dynamic smem:
// staged xn + chunk sums + selection.
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
moe_gate_up(const __grid_constant__ MoeUpParams p) {
    extern __shared__ float smem[];
    const int ntok = p.ntok;
    const int P = PADDED_LEN(HIDDEN);
    float* sx = smem;
    float* csum = sx + ntok * P;
    float* red = csum + ntok * (HIDDEN / 16);
    int* sel_idx = reinterpret_cast<int*>(red + 32);      // [ntok][TOPK]
    float* sel_w = reinterpret_cast<float*>(sel_idx + 8 * TOPK);  // [ntok][TOPK]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp < ntok) warp_topk(p.router_logits + (size_t)warp * N_EXPERTS, sel_idx + warp * TOPK, sel_w + warp * TOPK);
    __syncthreads();

    const int ntasks = ntok * MOE_SLOTS * (MOE_INTER / 2);
    const int stride = gridDim.x * (MOE_THREADS / 32);
    const int nch = HIDDEN / 32, nc16 = HIDDEN / 16;
    const int its = (nch + 31) / 32;
    int task = blockIdx.x * (MOE_THREADS / 32) + warp;
    int t = 0, s = 0, i0 = 0;
    MoeLoad cur, nxt;
    if (task < ntasks) {
        moe_up_task(p, sel_idx, task, t, s, i0);
        if (lane < nch) moe_up_fetch(p, sel_idx, t, s, i0, lane, cur);
    }
    stage_activations(sx, csum, red, p.x, p.x_stride, p.gain, ntok, HIDDEN, p.eps);  // ends with __syncthreads

    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < ntok * MOE_SLOTS; i += blockDim.x) {
            const int tt = i / MOE_SLOTS, ss = i - tt * MOE_SLOTS;
            if (ss < TOPK) {
                p.topk_idx[tt * TOPK + ss] = sel_idx[tt * TOPK + ss];
                p.topk_w[i] = sel_w[tt * TOPK + ss];
            } else {
                p.topk_w[i] = sigmoidf_(p.sg_logits[tt]);
            }
        }
    }

    while (task < ntasks) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const int next = task + stride;
        int nt_ = t, ns = s, ni = i0;
        for (int it = 0; it < its; ++it) {
            const int ch = lane + 32 * it;
            if (it + 1 < its) {
                if (ch + 32 < nch) moe_up_fetch(p, sel_idx, t, s, i0, ch + 32, nxt);
            } else if (next < ntasks) {
                moe_up_task(p, sel_idx, next, nt_, ns, ni);
                if (lane < nch) moe_up_fetch(p, sel_idx, nt_, ns, ni, lane, nxt);
            }
            if (ch < nch) {
                float xv[32];
                load_x32(sx + t * P + ch * 36, xv);
                const float cs = csum[t * nc16 + 2 * ch] + csum[t * nc16 + 2 * ch + 1];
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[r] += fmaf(cur.sc[r], dot32_q4(cur.w[r], xv), cur.bi[r] * cs);
            }
            cur = nxt;
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[r] = warp_sum(acc[r]);
        if (lane == 0) {
            float* o = p.act + ((size_t)t * MOE_SLOTS + s) * MOE_INTER + i0;
            o[0] = siluf_(acc[0]) * acc[2];
            o[1] = siluf_(acc[1]) * acc[3];
        }
        task = next;
        t = nt_;
        s = ns;
        i0 = ni;
    }
}

struct MoeDownParams {
    QMat down;       // [N_EXPERTS][HIDDEN][MOE_INTER]
    QMat sh_down;    // [HIDDEN][MOE_INTER]
    const float* act;       // [ntok][MOE_SLOTS][MOE_INTER]
    const int* topk_idx;    // [ntok][TOPK]
    const float* topk_w;    // [ntok][MOE_SLOTS]
    float* h;               // residual stream [ntok][h_stride], += result
    int h_stride;
    int ntok;
};

// down item (token t, rows r0..r0+3, step `it`): lane handles the (slot,
// chunk) pair pc = lane + 32 it of the MOE_SLOTS x (MOE_INTER / 32) pairs.
__device__ __forceinline__ void moe_down_fetch(const MoeDownParams& p, const int* se, int t, int r0, int pc, MoeLoad& L) {
    const int nch = MOE_INTER / 32, wpr = MOE_INTER / 8, gpr = MOE_INTER / GROUP_SIZE;
    const int s = pc / nch, ch = pc - s * nch;
    const u32* cp;
    const bf16 *sp, *bp;
    if (s < TOPK) {
        const size_t rb = (size_t)se[t * TOPK + s] * HIDDEN + r0;
        cp = p.down.codes + rb * wpr;
        sp = p.down.scales + rb * gpr;
        bp = p.down.biases + rb * gpr;
    } else {
        cp = p.sh_down.codes + (size_t)r0 * wpr;
        sp = p.sh_down.scales + (size_t)r0 * gpr;
        bp = p.sh_down.biases + (size_t)r0 * gpr;
    }
    moe_fetch_rows(cp, cp + wpr, cp + 2 * wpr, cp + 3 * wpr, sp, sp + gpr, sp + 2 * gpr, sp + 3 * gpr, bp, bp + gpr,
                   bp + 2 * gpr, bp + 3 * gpr, ch, ch >> 1, L);
}

// grid: persistent, block MOE_THREADS. Warp task = (token, 4 output rows):
// for each of the MOE_SLOTS slots it reads the 4 rows of that slot's down
// matrix (MOE_INTER 4-bit codes each); lanes stride over (slot, chunk)
// pairs, the next pair's loads issued before the current pair's arithmetic.
// Dynamic smem: act staged in PAD32 layout plus chunk sums.
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
moe_down(const __grid_constant__ MoeDownParams p) {
    extern __shared__ float smem[];
    const int ntok = p.ntok;
    const int P = PADDED_LEN(MOE_INTER);
    const int nrows = ntok * MOE_SLOTS;
    float* sa = smem;                              // [ntok * MOE_SLOTS][P]
    float* csum = sa + nrows * P;                  // [ntok * MOE_SLOTS][MOE_INTER / 16]
    float* sw = csum + nrows * (MOE_INTER / 16);   // [ntok][MOE_SLOTS]
    int* se = reinterpret_cast<int*>(sw + 8 * MOE_SLOTS);  // [ntok][TOPK]

    for (int i = threadIdx.x; i < ntok * MOE_SLOTS; i += blockDim.x) sw[i] = p.topk_w[i];
    for (int i = threadIdx.x; i < ntok * TOPK; i += blockDim.x) se[i] = p.topk_idx[i];
    __syncthreads();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int quads = HIDDEN / 4;
    const int ntasks = ntok * quads;
    const int nch = MOE_INTER / 32, npairs = MOE_SLOTS * nch;
    const int its = (npairs + 31) / 32;
    const int stride = gridDim.x * (MOE_THREADS / 32);
    int task = blockIdx.x * (MOE_THREADS / 32) + warp;
    int t = 0, r0 = 0;
    MoeLoad cur, nxt;
    if (task < ntasks) {
        t = task / quads;
        r0 = (task - t * quads) * 4;
        if (lane < npairs) moe_down_fetch(p, se, t, r0, lane, cur);
    }

    for (int i = threadIdx.x; i < nrows * (MOE_INTER / 4); i += blockDim.x) {
        const int r = i / (MOE_INTER / 4), c = (i - r * (MOE_INTER / 4)) * 4;
        *reinterpret_cast<float4*>(sa + r * P + PAD32(c)) =
            *reinterpret_cast<const float4*>(p.act + (size_t)r * MOE_INTER + c);
    }
    __syncthreads();
    const int nc16 = MOE_INTER / 16;
    for (int i = threadIdx.x; i < nrows * nc16; i += blockDim.x) {
        const int r = i / nc16, k = i - r * nc16;
        const float* q = sa + r * P + PAD32(k * 16);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) s += q[j];
        csum[i] = s;
    }
    __syncthreads();

    while (task < ntasks) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const int next = task + stride;
        const int nt_ = next / quads, nr0 = (next - nt_ * quads) * 4;
        for (int it = 0; it < its; ++it) {
            const int pc = lane + 32 * it;
            if (it + 1 < its) {
                if (pc + 32 < npairs) moe_down_fetch(p, se, t, r0, pc + 32, nxt);
            } else if (next < ntasks) {
                if (lane < npairs) moe_down_fetch(p, se, nt_, nr0, lane, nxt);
            }
            if (pc < npairs) {
                const int s = pc / nch, ch = pc - s * nch;
                const int arow = t * MOE_SLOTS + s;
                float xv[32];
                load_x32(sa + arow * P + ch * 36, xv);
                const float cs = csum[arow * nc16 + 2 * ch] + csum[arow * nc16 + 2 * ch + 1];
                const float ws = sw[arow];
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[r] += ws * fmaf(cur.sc[r], dot32_q4(cur.w[r], xv), cur.bi[r] * cs);
            }
            cur = nxt;
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[r] = warp_sum(acc[r]);
        if (lane == 0) {
            float* o = p.h + (size_t)t * p.h_stride + r0;
#pragma unroll
            for (int r = 0; r < 4; ++r) o[r] += acc[r];
        }
        task = next;
        t = nt_;
        r0 = nr0;
    }
}

// ---- prefill routing ----------------------------------------------------

// grid (ceil(ntok / 8)), block 256: warp w handles token blockIdx.x * 8 + w.
// Writes topk_idx/topk_w [ntok][TOPK], counts[e] (+= via atomics, zeroed by
// the host) and rank[t][k] = the pair's index among its expert's pairs.
struct MoeRouteParams {
    const float* logits;   // [ntok][N_EXPERTS]
    int* topk_idx;         // [ntok][TOPK]
    float* topk_w;         // [ntok][TOPK]
    int* counts;           // [N_EXPERTS], zeroed before
    int* rank;             // [ntok][TOPK]
    int ntok;
};

extern "C" __global__ void __launch_bounds__(256)
moe_route(const __grid_constant__ MoeRouteParams p) {
    const float* logits = p.logits;
    int* topk_idx = p.topk_idx;
    float* topk_w = p.topk_w;
    int* counts = p.counts;
    int* rank = p.rank;
    const int ntok = p.ntok;
    __shared__ int s_idx[8][TOPK];
    __shared__ float s_w[8][TOPK];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * 8 + warp;
    if (t >= ntok) return;
    warp_topk(logits + (size_t)t * N_EXPERTS, s_idx[warp], s_w[warp]);
    __syncwarp();
    if (lane < TOPK) {
        const int e = s_idx[warp][lane];
        topk_idx[t * TOPK + lane] = e;
        topk_w[t * TOPK + lane] = s_w[warp][lane];
        rank[t * TOPK + lane] = atomicAdd(counts + e, 1);
    }
}

// One block of 256 threads. offsets[e] = sum_{e' < e} counts[e'] (offsets
// has N_EXPERTS + 1 entries); tiles[i] = (expert, row start, row end) of
// each BM-row tile of each expert, in expert order; *ntiles = their count.
struct MoePlanParams {
    const int* counts;
    int* offsets;          // [N_EXPERTS + 1]
    int* tiles;            // [max_tiles][3]
    int* ntiles;
    int bm;
};

extern "C" __global__ void __launch_bounds__(256)
moe_plan(const __grid_constant__ MoePlanParams p) {
    const int* counts = p.counts;
    int* offsets = p.offsets;
    int* tiles = p.tiles;
    int* ntiles = p.ntiles;
    const int bm = p.bm;
    __shared__ int s_off[N_EXPERTS + 1];
    __shared__ int s_toff[N_EXPERTS + 1];
    if (threadIdx.x == 0) {
        int o = 0, to = 0;
        for (int e = 0; e < N_EXPERTS; ++e) {
            s_off[e] = o;
            s_toff[e] = to;
            o += counts[e];
            to += (counts[e] + bm - 1) / bm;
        }
        s_off[N_EXPERTS] = o;
        s_toff[N_EXPERTS] = to;
        *ntiles = to;
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= N_EXPERTS; e += blockDim.x) offsets[e] = s_off[e];
    for (int e = threadIdx.x; e < N_EXPERTS; e += blockDim.x) {
        const int n = counts[e];
        for (int j = 0; j * bm < n; ++j) {
            int* tl = tiles + 3 * (s_toff[e] + j);
            tl[0] = e;
            tl[1] = s_off[e] + j * bm;
            tl[2] = min(s_off[e] + (j + 1) * bm, s_off[e] + n);
        }
    }
}

// grid over ntok * TOPK pairs. perm[sorted] = token, inv[t][k] = sorted.
struct MoeScatterParams {
    const int* topk_idx;
    const int* rank;
    const int* offsets;
    int* perm;             // [ntok * TOPK] sorted pair -> token
    int* inv;              // [ntok][TOPK] pair -> sorted position
    int ntok;
};

extern "C" __global__ void moe_scatter(const __grid_constant__ MoeScatterParams p) {
    const int* topk_idx = p.topk_idx;
    const int* rank = p.rank;
    const int* offsets = p.offsets;
    int* perm = p.perm;
    int* inv = p.inv;
    const int ntok = p.ntok;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ntok * TOPK) return;
    const int pos = offsets[topk_idx[i]] + rank[i];
    perm[pos] = i / TOPK;
    inv[i] = pos;
}

// grid (ntok), block 256: h[t][c] += sum_k w[t][k] * y[inv[t][k]][c] + sigmoid(sg[t]) * ys[t][c].
// The sum order is fixed (slot order, then the shared expert), so the result
// does not depend on how the grouped GEMM ordered tokens.
struct MoeCombineParams {
    float* h;              // [ntok][HIDDEN]
    const float* y;        // [ntok * TOPK][HIDDEN] sorted
    const float* ys;       // [ntok][HIDDEN] shared expert
    const float* sg_logits;  // [ntok]
    const int* inv;
    const float* topk_w;
};

extern "C" __global__ void __launch_bounds__(256)
moe_combine(const __grid_constant__ MoeCombineParams p) {
    float* h = p.h;
    const float* y = p.y;
    const float* ys = p.ys;
    const float* sg_logits = p.sg_logits;
    const int* inv = p.inv;
    const float* topk_w = p.topk_w;
    const int t = blockIdx.x;
    __shared__ int s_inv[TOPK];
    __shared__ float s_w[MOE_SLOTS];
    if (threadIdx.x < TOPK) {
        s_inv[threadIdx.x] = inv[t * TOPK + threadIdx.x];
        s_w[threadIdx.x] = topk_w[t * TOPK + threadIdx.x];
    }
    if (threadIdx.x == 0) s_w[TOPK] = sigmoidf_(sg_logits[t]);
    __syncthreads();
    for (int c = threadIdx.x; c < HIDDEN; c += blockDim.x) {
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < TOPK; ++k) acc += s_w[k] * y[(size_t)s_inv[k] * HIDDEN + c];
        acc += s_w[TOPK] * ys[(size_t)t * HIDDEN + c];
        h[(size_t)t * HIDDEN + c] += acc;
    }
}
