// moe.cu: the mixture-of-experts block.
//
// Router: logits = router(x) (the prefill's GEMM); softmax in fp32, top TOPK
// (ties: lower expert index first, warp_topk in common.cuh), the TOPK
// weights renormalised to sum 1, which equals a softmax over the selected
// logits. The shared expert is weighted by sigmoid(shared_expert_gate x).
// (The decode step's MoE is in qmm.cu.)
//
// Prefill (many tokens; grouped GEMMs in gemm.cu do the matrix work):
//   moe_route:   top-k per token, per-expert counts and ranks (atomics),
//   moe_plan:    exclusive scan of the counts and the tile list of the
//                grouped GEMM (one block),
//   moe_scatter: sorted position of every (token, slot) pair,
//   moe_combine: h[t] += sum_k w[t][k] * y[pos(t, k)] + sigmoid(sg[t]) * ys[t].

#define MOE_SLOTS (TOPK + 1)
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
