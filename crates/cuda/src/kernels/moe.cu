// moe.cu: the mixture-of-experts block.
//
// Router: logits = router(x) (the prefill's GEMM); softmax in fp32, top TOPK
// (ties: lower expert index first, warp_topk in common.cuh), the TOPK
// weights renormalised to sum 1, which equals a softmax over the selected
// logits. The shared expert is weighted by sigmoid(shared_expert_gate x).
// (The decode step's MoE is in qmm.cu.)
//
// Prefill (many tokens; grouped GEMMs in gemm.cu do the matrix work):
//   moe_route_plan: top-k per token, per-expert counts and ranks (atomics);
//                the last block (a ticket) scans the counts into offsets
//                and the tile list of the grouped GEMM, and leaves the
//                counts and the ticket at 0 for the next launch,
//   moe_scatter: sorted position of every (token, slot) pair,
//   moe_combine: h[t] += sum_k w[t][k] * y[pos(t, k)] + sigmoid(sg[t]) * ys[t],
//                and optionally the next layer's input norm of the new h[t].

#define MOE_SLOTS (TOPK + 1)
// ---- prefill routing ----------------------------------------------------

// grid (ceil(ntok / MOE_ROUTE_WARPS)), block 32 * MOE_ROUTE_WARPS (moe.rs
// ROUTE_WARPS): warp w handles token blockIdx.x * MOE_ROUTE_WARPS + w.
// The logits are the router GEMM's output or, when that GEMM was split
// over K, its unreduced partials (one launch and a 4 MB round trip fewer
// at 4,096 tokens). Writes topk_idx/topk_w [ntok][TOPK], counts[e] (+= via atomics) and
// rank[t][k] = the pair's index among its expert's pairs (the order of
// the atomics: any order gives the same results, each row of the grouped
// GEMM being computed on its own). The last block to finish (ticket) then
// writes offsets[e] = sum_{e' < e} counts[e'] (N_EXPERTS + 1 entries),
// tiles[i] = (expert, row start, row end) of each BM-row tile of each
// expert in expert order and *ntiles = their count, and sets the counts
// and the ticket back to 0 (the memory plan zeroes them once).
struct MoeRoutePlanParams {
    const float* logits;   // [splits][ntok][N_EXPERTS], planes `plane` apart
    int* topk_idx;         // [ntok][TOPK]
    float* topk_w;         // [ntok][TOPK]
    int* counts;           // [N_EXPERTS], 0 on entry, left 0
    int* rank;             // [ntok][TOPK]
    int* offsets;          // [N_EXPERTS + 1]
    int* tiles;            // [max_tiles][3]
    int* ntiles;
    int* ticket;           // 0 on entry, left 0
    long long plane;       // floats between two splits' partials
    int splits;            // 1: the logits themselves
    int ntok;
    int bm;
};
LAYOUT_CHECK(MoeRoutePlanParams, MOE_ROUTE_PLAN_PARAMS_SIZE)

#ifndef MOE_ROUTE_WARPS
#error "MOE_ROUTE_WARPS must be defined by the host (moe.rs defines)"
#endif
extern "C" __global__ void __launch_bounds__(32 * MOE_ROUTE_WARPS)
moe_route_plan(const __grid_constant__ MoeRoutePlanParams p) {
    __shared__ int s_idx[MOE_ROUTE_WARPS][TOPK];
    __shared__ float s_w[MOE_ROUTE_WARPS][TOPK];
    __shared__ __align__(16) int scan_tmp[MOE_ROUTE_WARPS];
    pdl_trigger();
    pdl_wait();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (t < p.ntok) {
        // The router GEMM's split-K partials summed in split order, as
        // gemm_splitk_reduce would have (its leading 0.f + only changes
        // the sign of a zero, which topk_key ignores); a split's loads for
        // all of the lane's experts at once.
        const float* row = p.logits + (size_t)t * N_EXPERTS;
        float v[EXPERTS_PER_LANE];
#pragma unroll
        for (int i = 0; i < EXPERTS_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            v[i] = e < N_EXPERTS ? row[e] : 0.f;
        }
        for (int z = 1; z < p.splits; ++z) {
            const float* part = row + z * p.plane;
#pragma unroll
            for (int i = 0; i < EXPERTS_PER_LANE; ++i) {
                const int e = lane + 32 * i;
                if (e < N_EXPERTS) v[i] += part[e];
            }
        }
        u32 key[EXPERTS_PER_LANE];
#pragma unroll
        for (int i = 0; i < EXPERTS_PER_LANE; ++i) key[i] = lane + 32 * i < N_EXPERTS ? topk_key(v[i]) : 0u;
        warp_topk_keys(key, s_idx[warp], s_w[warp]);
        __syncwarp();
        if (lane < TOPK) {
            const int e = s_idx[warp][lane];
            p.topk_idx[t * TOPK + lane] = e;
            p.topk_w[t * TOPK + lane] = s_w[warp][lane];
            p.rank[t * TOPK + lane] = atomicAdd(p.counts + e, 1);
        }
    }
    if (!last_block_arrives(p.ticket, (int)gridDim.x)) return;
    const int bm = p.bm;
    int base = 0, tbase = 0;
    for (int e0 = 0; e0 < N_EXPERTS; e0 += 32 * MOE_ROUTE_WARPS) {
        const int e = e0 + threadIdx.x;
        const int c = e < N_EXPERTS ? ldcg_i32(p.counts + e) : 0;
        const int nt = (c + bm - 1) / bm;
        int tot_rows, tot_tiles;
        const int off = base + block_scan_excl<MOE_ROUTE_WARPS>(c, scan_tmp, tot_rows);
        const int toff = tbase + block_scan_excl<MOE_ROUTE_WARPS>(nt, scan_tmp, tot_tiles);
        if (e < N_EXPERTS) {
            p.offsets[e] = off;
            for (int j = 0; j < nt; ++j) {
                int* tl = p.tiles + 3 * (toff + j);
                tl[0] = e;
                tl[1] = off + j * bm;
                tl[2] = min(off + (j + 1) * bm, off + c);
            }
            p.counts[e] = 0;
        }
        base += tot_rows;
        tbase += tot_tiles;
    }
    if (threadIdx.x == 0) {
        p.offsets[N_EXPERTS] = base;
        *p.ntiles = tbase;
        *p.ticket = 0;
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
    pdl_trigger();
    pdl_wait();
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

// grid (ntok), block MOE_COMBINE_THREADS (256, moe.rs):
// h[t][c] += sum_k w[t][k] * y[inv[t][k]][c] + sigmoid(sg[t]) * ys[t][c];
// with a gain, also xn[t] = fp16(RMSNorm(h[t]) * gain), as rmsnorm_f16.
// The sum order is fixed (slot order, then the shared expert), so the result
// does not depend on how the grouped GEMM ordered tokens. A thread owns 8
// consecutive columns, read as 16-byte loads (the TOPK rows of y, ys, h:
// two each): with one column a thread, ptxas kept about two 4-byte loads
// in flight (each consumed by the next fma) and a 256-token combine ran at
// ~1.4 TB/s (17 us a layer); now about five 16-byte loads.
struct MoeCombineParams {
    float* h;              // [ntok][HIDDEN]
    const float* y;        // [ntok * TOPK][HIDDEN] sorted
    const float* ys;       // [ntok][HIDDEN] shared expert
    const float* sg_logits;  // [ntok]
    const int* inv;
    const float* topk_w;
    const float* gain;     // the next layer's input-norm gain [HIDDEN], or null
    f16* xn;               // [ntok][HIDDEN]: RMSNorm(h) * gain (with gain)
    float eps;
};
LAYOUT_CHECK(MoeCombineParams, MOE_COMBINE_PARAMS_SIZE)

extern "C" __global__ void __launch_bounds__(MOE_COMBINE_THREADS)
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
    __shared__ __align__(16) float srow[HIDDEN];   // the new row, for the fused norm
    if (threadIdx.x < TOPK) {
        s_inv[threadIdx.x] = inv[t * TOPK + threadIdx.x];
        s_w[threadIdx.x] = topk_w[t * TOPK + threadIdx.x];
    }
    if (threadIdx.x == 0) s_w[TOPK] = sigmoidf_(sg_logits[t]);
    __syncthreads();
    static_assert(HIDDEN % 8 == 0, "a thread's 8 columns are two aligned float4");
    for (int c = threadIdx.x * 8; c < HIDDEN; c += blockDim.x * 8) {
        float4 yv[TOPK + 1][2];
#pragma unroll
        for (int k = 0; k < TOPK; ++k) {
            const float4* yr = reinterpret_cast<const float4*>(y + (size_t)s_inv[k] * HIDDEN + c);
            yv[k][0] = yr[0];
            yv[k][1] = yr[1];
        }
        const float4* sr = reinterpret_cast<const float4*>(ys + (size_t)t * HIDDEN + c);
        yv[TOPK][0] = sr[0];
        yv[TOPK][1] = sr[1];
        float4* hr = reinterpret_cast<float4*>(h + (size_t)t * HIDDEN + c);
        float4 hv[2] = {hr[0], hr[1]};
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            // Per column: acc = fma(w_0, y_0, 0), then fma over the slots in
            // order and the shared expert last, then h += acc (the same
            // operations, in the same order, as one column a thread).
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int k = 0; k <= TOPK; ++k) {
                const float w = s_w[k];
                acc.x = fmaf(w, yv[k][q].x, acc.x);
                acc.y = fmaf(w, yv[k][q].y, acc.y);
                acc.z = fmaf(w, yv[k][q].z, acc.z);
                acc.w = fmaf(w, yv[k][q].w, acc.w);
            }
            hv[q].x += acc.x;
            hv[q].y += acc.y;
            hv[q].z += acc.z;
            hv[q].w += acc.w;
        }
        hr[0] = hv[0];
        hr[1] = hv[1];
        if (p.gain != nullptr) {
            *reinterpret_cast<float4*>(srow + c) = hv[0];
            *reinterpret_cast<float4*>(srow + c + 4) = hv[1];
        }
    }
    if (p.gain == nullptr) return;
    // The next layer's input norm of the new row, bit for bit what
    // rmsnorm_f16 (gemm.cu, launched with as many threads) computes from
    // h: the same rmsnorm_row_f16. This saves that launch and its read of
    // h.
    __syncthreads();
    __shared__ float red[32];
    rmsnorm_row_f16<HIDDEN, MOE_COMBINE_THREADS>(srow, p.gain, p.xn + (size_t)t * HIDDEN, p.eps, red);
}
