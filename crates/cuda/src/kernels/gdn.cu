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
// ---- Prefill: the chunked form on tensor cores ------------------------------
//
// Chunks of C = GDN_CHUNK = 64 tokens (the flash-linear-attention
// formulation). Within chunk c, with G_i = g_0 + ... + g_i (cumulative log
// decay inside the chunk, G non-increasing), state S0 at the chunk start, and
// Gamma_ij = exp(G_i - G_j) (only ever evaluated for j <= i, so <= 1):
//   A  = beta_i (k_i . k_j) Gamma_ij, strictly lower         (C x C)
//   T  = (I + A)^-1, unit lower triangular
//   W  = T diag(beta e^G) K,  U = T diag(beta) V               (C x D)
//   Vn = U - W S0                        ("v_new", the true u_i of the chunk)
//   O  = diag(e^G) Q S0 + (Q K^T ⊙ Gamma, lower incl. diagonal) Vn
//   S1 = e^{G_L} S0 + K^T diag(e^{G_L - G}) Vn                 (G_L = G_63)
// (unrolling u_i = beta_i (v_i - (e^{G_i} S0 + sum_{j<i} Gamma_ij k_j u_j^T)^T k_i)
// gives (I + A) Vn = diag(beta) (V - diag(e^G) K S0).) Kernels, in order:
//   gdn_prefill_prep   conv + silu + l2norm + gates, head-major outputs
//   gdn_conv_store     the last raw inputs into the conv ring
//   gdn_chunk_wu       per (chunk, head), all in parallel: G, A, T (blocked
//                      inverse), W, U
//   gdn_chunk_state    per (head, value-column block), sequential over the
//                      chunks: Vn and S, storing every chunk's S0
//   gdn_chunk_out      per (chunk, head), all in parallel: O
//   gdn_gated_norm     the gated RMSNorm of O.
//
// Precision. Every product runs on the tensor cores as three bf16 mma.sync
// m16n8k16 with fp32 accumulation: x = hi + lo with hi = bf16(x), lo =
// bf16(x - hi) (16 significant bits together, fp32's exponent range), and
// a b ~ hi_a hi_b + hi_a lo_b + lo_a hi_b (the dropped lo_a lo_b is 2^-16
// relative). A numpy model of exactly these kernels against the f64
// recurrence (real shape, the tests' inputs, T = 150 .. 4096, mild and strong
// decay) gives a relative L2 error of 4e-6 .. 7e-6 on O and on the final
// state (the lane-level port, scripts/lanesim/gdn_chunk.py, 5e-6 .. 1.6e-5
// with a non-zero start state); plain fp32 gives 1e-7, while one bf16 product gives 4e-3 and one
// tf32 (or fp16) product 4.5e-4, both over the tests' 1e-4 gate. The small
// triangular inverses of the 16x16 diagonal blocks are fp32 on CUDA cores.
//
// "Split" layout: a matrix kept at that precision is stored as bf16 rows
// [hi of the n columns | lo of the n columns] (4n bytes, as much as fp32); in
// shared memory such a row is padded by 8 bf16 (GDN_SPL(n)), so the 8 rows of
// an ldmatrix fall in 8 distinct 4-bank groups.
//
// A pass may hold several sequences ("pieces", gdn.rs `prefill_pieces`):
// their tokens lie one after another in the scratch, each padded to whole
// chunks, so a chunk never spans two sequences; wu and out run over all
// chunks at once, prep, conv_store, state and gated_norm take a piece table
// (blockIdx.z = the piece), and state walks each piece's chunks from its
// own recurrent state, the pieces side by side.
// Scratch (gdn.rs `GdnScratch`; Tp = the pieces' T, each rounded up to C,
// summed; nc = Tp / C):
//   q, k  [GK_HEADS][Tp] split rows of GK_DIM (q scaled)          prep
//   vu    [GV_HEADS][Tp][GV_DIM] f32 v                            prep
//         -> per (head, chunk) tile: U^T [GV_DIM][C] f32          wu
//         -> the same tile: Vn^T split rows [GV_DIM][2C] bf16     state
//   g, beta [GV_HEADS][Tp] f32; G [GV_HEADS][Tp] f32 (cumulative)  prep, wu
//   w     [GV_HEADS][Tp] split rows of GK_DIM                     wu
//   hs    [GV_HEADS][nc][GV_DIM] split rows of GK_DIM: S0^T       state
//   o     [Tp][GV_HEADS * GV_DIM] f32                             out
// A tile is only ever rewritten by the block that read it (vu), and each
// kernel reads what the previous launches wrote.
//
// Cost at T = 4096, real shape (32 heads, D = 128, 64 chunks), per layer:
// useful work 4.1 (wu) + 8.6 (state) + 7.0 (out) GFLOP, three times that in
// bf16 mma (~59 GFLOP: ~90 us at a ~660 TFLOP/s mma.sync rate); DRAM traffic
// about 0.25 (wu) + 0.37 (state) + 0.35 (out) GB, ~260 us at 3.6 TB/s. So the
// parallel kernels are bandwidth-bound (expect ~70 + ~100 us) and the state
// kernel is bound by its serial chain: 64 chunks x 384 mma per warp at 4-8
// cycles each, 50-100 us, if its 170 KB/chunk-block of loads stay hidden
// behind the double buffer. Expected ~250-300 us per layer (the kernels they
// replace took ~2.2 ms). Storing S0 is 268 MB of that traffic; computing
// Q S0 inside the state kernel instead (it already holds S0^T as an A
// operand) would trade it for +50% serial mma.

#define GDN_D GV_DIM
#define GDN_KEY (GK_HEADS * GK_DIM)
#define GDN_VAL (GV_HEADS * GV_DIM)
#define GDN_RATIO (GV_HEADS / GK_HEADS)

#if GK_DIM != GV_DIM
#error "GK_DIM must equal GV_DIM"
#endif
#if CONV_K != 4
#error "the conv ring assumes a kernel of 4"
#endif

// ---- Decode: one step ------------------------------------------------------
//
// Two entry points, one body (gdn_decode_body), the same arithmetic in the
// same order, so a token's outputs and state are the same bits whichever
// runs it (and so whatever the batch):
//   gdn_decode        grid (GV_HEADS, ntok): a block holds a whole head,
//                     GDN_DEC_GROUPS (4) threads a value column.
//   gdn_decode_split  grid (GV_HEADS * GDN_VSPLIT, ntok), clusters of
//                     GDN_VSPLIT blocks along x (one cluster = one value head
//                     of one token): block rank vp owns the value columns
//                     vp * GDN_VCOLS .. + GDN_VCOLS, 16 threads a column. At
//                     batch 1 this spreads a layer's 2 MB of state over
//                     GV_HEADS * GDN_VSPLIT = 128 multiprocessors instead of
//                     32 (H200, 40 layers: a batch-1 step 2.099 -> 2.022
//                     ms); from 2 tokens the whole-head blocks fill the GPU
//                     and the split was slower (it repeats the conv and
//                     norms in every block of a head). The 16 partial sums
//                     are what makes the split fast (a split on 4 chains of
//                     32 keys, 128 threads a block, gave 2.08 ms); the
//                     whole-head kernel keeps them for the same bits,
//                     bounded to 64 registers so two blocks share an SM
//                     (with 72 and one block it was 8% slower at 64 tokens).
// The delta rule is independent per value column (u_v = beta (v_v - decay
// sum_k S[k][v] k_k), S[:, v] = decay S[:, v] + k u_v, o_v = sum_k S[k][v]
// q_k), so a column's state never leaves its block. The sums over keys are
// GDN_DEC_PARTS (16) partial sums of GK_DIM / 16 consecutive keys each
// (fma chains from 0), added in key order through shared memory; a block's
// threads hold 16 / GDN_DEC_GROUPS of a column's partial key ranges (split:
// one) in registers.
//
// The gated RMSNorm needs the whole head: its sum of squares is the warp
// sums of the head's 32-column blocks added in column order; the split
// blocks publish theirs (and their 32 outputs) in shared memory and, after
// one cluster barrier, each reads all of them through distributed shared
// memory. A packed output's 64-column group sum is its two 32-column warp
// sums added in order; in the split kernel the group spans ranks 2j and
// 2j + 1, and the even block also forms its neighbour's packed values (the
// same formula on the same inputs as the neighbour's own stores) to write
// the group's sum. Blocks arrive at a second cluster barrier after their
// remote reads and wait on it before exiting, so no block's shared memory
// is released while a neighbour still reads it.
//
// The state is read right after the dependency wait, before the conv and
// the norms, so its DRAM round trip overlaps theirs.

#if !defined(GDN_VCOLS) || !defined(GDN_DEC_THREADS) || !defined(GDN_DEC_GROUPS)
#error "GDN_VCOLS, GDN_DEC_THREADS and GDN_DEC_GROUPS must be defined by the host (gdn.rs)"
#endif
#define GDN_VSPLIT (GV_DIM / GDN_VCOLS)
#define GDN_DEC_PARTS 16
#define GDN_DEC_KPT (GK_DIM / GDN_DEC_PARTS)
#define GDN_DEC_PREP (2 * GK_DIM + GV_DIM + GV_DIM)
static_assert(GDN_VCOLS == 32 && GV_DIM % GDN_VCOLS == 0, "a split block owns one warp-width of value columns");
static_assert(GK_DIM % GDN_DEC_PARTS == 0, "every partial key range has the same length");
static_assert(GDN_DEC_THREADS == GDN_DEC_PARTS * GDN_VCOLS, "gdn.rs DECODE_THREADS: a split block is one thread per (column, key range)");
static_assert(GDN_DEC_GROUPS * GV_DIM <= 1024 && GDN_DEC_PARTS % GDN_DEC_GROUPS == 0, "a whole-head block is GDN_DEC_GROUPS threads a column");

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
    float* mix_csum;       // with mix_px: their group sums [ntok][GDN_VAL / 64]
    long long conv_slot_stride;   // floats
    long long state_slot_stride;  // floats
    int proj_stride;
    float eps;
};

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// A float of the shared memory of block `rank` of this cluster, at the
// offset `p` has in this block's.
__device__ __forceinline__ float ld_cluster_f32(const float* p, u32 rank) {
    u32 a;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_u32(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}

// Conv element e of a decode block (key head kh, value head h, first value
// column c0): which of q (0), k (1) or the block's v channels (2), its index
// i there, and its in-projection channel ch.
struct GdnConvElem {
    int which, i, ch;
};
__device__ __forceinline__ GdnConvElem gdn_conv_elem(int e, int kh, int h, int c0) {
    const int which = e < GK_DIM ? 0 : e < 2 * GK_DIM ? 1 : 2;
    const int i = e - which * GK_DIM;
    return {which, i, which == 0 ? kh * GK_DIM + i : which == 1 ? GDN_KEY + kh * GK_DIM + i : 2 * GDN_KEY + h * GV_DIM + c0 + i};
}

// SPLIT: a cluster's block (columns vp * 32 ..), else a whole head. CPB:
// columns a block; threads: CPB * (16 / PPT), thread (grp, v) holding the
// partial key ranges grp * PPT .. + PPT of column v.
template <bool SPLIT>
__device__ __forceinline__ void gdn_decode_body(const GdnDecodeParams& p) {
    constexpr int CPB = SPLIT ? GDN_VCOLS : GV_DIM;
    constexpr int PPT = SPLIT ? 1 : GDN_DEC_PARTS / GDN_DEC_GROUPS;
    constexpr int NT = CPB * (GDN_DEC_PARTS / PPT);
    // z of this block's columns and (split, even ranks) the next block's.
    constexpr int NZ = SPLIT ? 2 * GDN_VCOLS : GV_DIM;
    __shared__ float sq[GK_DIM], sk[GK_DIM], sv[CPB], sz[NZ];
    __shared__ float part[GDN_DEC_PARTS][CPB];
    __shared__ float red[32];
    // Split: published to the cluster, this block's outputs (before the
    // norm) and their sum of squares.
    __shared__ float pub_o[SPLIT ? GDN_VCOLS : 1];
    __shared__ float pub_ss;
    pdl_trigger();
    const int vp = SPLIT ? (int)cluster_rank() : 0;
    const int h = SPLIT ? blockIdx.x / GDN_VSPLIT : blockIdx.x, t = blockIdx.y, kh = h / GDN_RATIO, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int c0 = vp * CPB;  // first value column of this block within the head
    // Before the dependency wait: the step's positions and slots (written
    // before the step's first, fully serialised launches) and the state,
    // last written by this layer's previous step, so its loads are in
    // flight during the in-projection's tail as well as the conv and norms.
    const int ps = p.pos[t], sl = p.slot[t];
    const int v = tid % CPB, grp = tid / CPB;
    float* S = p.state + (size_t)sl * p.state_slot_stride + (size_t)h * GK_DIM * GV_DIM + c0;
    float s[PPT][GDN_DEC_KPT];
#pragma unroll
    for (int i = 0; i < PPT; ++i)
#pragma unroll
        for (int j = 0; j < GDN_DEC_KPT; ++j) s[i][j] = S[(size_t)((grp * PPT + i) * GDN_DEC_KPT + j) * GV_DIM + v];
    // Also before the wait: the layer's weights this thread uses (nothing
    // in the step writes them: its channels' conv taps, the gate constants
    // and its column's norm weight) and its channels' last three raw
    // inputs in the conv ring (entries of positions ps-1..ps-3, written by
    // earlier steps, as the state). Read where they are used, each was a
    // DRAM round trip on the chain (the gates and the norm weight after
    // block reductions).
    constexpr int NE = 2 * GK_DIM + CPB + NZ;    // conv channels, then z
    constexpr int EPT = (NE + NT - 1) / NT;
    float* cs = p.conv + (size_t)sl * p.conv_slot_stride;
    float cw[EPT][4], cr[EPT][3];
#pragma unroll
    for (int r = 0; r < EPT; ++r) {
        const int e = tid + r * NT;
#pragma unroll
        for (int j = 0; j < 4; ++j) cw[r][j] = 0.f;
#pragma unroll
        for (int j = 0; j < 3; ++j) cr[r][j] = 0.f;
        if (e < 2 * GK_DIM + CPB) {
            const int ch = gdn_conv_elem(e, kh, h, c0).ch;
#pragma unroll
            for (int j = 0; j < 4; ++j) cw[r][j] = p.conv_w[ch * 4 + j];
#pragma unroll
            for (int j = 0; j < 3; ++j) cr[r][j] = cs[((ps - 1 - j) & 3) * CONV_DIM + ch];
        }
    }
    const float a_log = p.a_log[h], dt_bias = p.dt_bias[h];
    const int ncol = c0 + (SPLIT ? warp * GDN_VCOLS + lane : tid);   // the norm's column (below)
    const float nw = ncol < GV_DIM ? p.norm_w[ncol] : 0.f;
    pdl_wait();
    const float* pr = p.proj + (size_t)t * p.proj_stride;
    // The head's gate inputs with the conv inputs (one round trip; read
    // after the norms' block reductions, they were a second one).
    const float a = pr[CONV_DIM + GDN_VAL + h], b = pr[CONV_DIM + GDN_VAL + GV_HEADS + h];

    // Conv + SiLU of the head's q and k channels and this block's v
    // channels; z.
#pragma unroll
    for (int r = 0; r < EPT; ++r) {
        const int e = tid + r * NT;
        if (e >= NE) break;
        if (e < 2 * GK_DIM + CPB) {
            const auto [which, i, ch] = gdn_conv_elem(e, kh, h, c0);
            const float raw = pr[ch];
            const float* w = cw[r];
            float y = w[3] * raw;
            y = fmaf(w[2], cr[r][0], y);
            y = fmaf(w[1], cr[r][1], y);
            y = fmaf(w[0], cr[r][2], y);
            y = siluf_(y);
            if (which == 0) sq[i] = y;
            else if (which == 1) sk[i] = y;
            else sv[i] = y;
            // q/k channels are shared by GDN_RATIO value heads and read by
            // every block of a head: rank 0 of the first head writes them.
            if (which == 2 || ((h % GDN_RATIO) == 0 && vp == 0)) cs[(ps & 3) * CONV_DIM + ch] = raw;
        } else {
            const int i = e - 2 * GK_DIM - CPB;
            if (c0 + i < GV_DIM) sz[i] = pr[CONV_DIM + h * GV_DIM + c0 + i];
        }
    }
    __syncthreads();
    const float qq = tid < GK_DIM ? sq[tid] * sq[tid] : 0.f;
    const float kk = (tid >= GK_DIM && tid < 2 * GK_DIM) ? sk[tid - GK_DIM] * sk[tid - GK_DIM] : 0.f;
    // (Warps past the q and k channels add zeros: the same sums at any
    // block size.)
    const float sum_q = block_sum(qq, red);
    const float sum_k = block_sum(kk, red);
    const float rq = rsqrtf(sum_q + 1e-6f) * rsqrtf((float)GK_DIM);
    const float rk = rsqrtf(sum_k + 1e-6f);
    const float g = -expf(a_log) * softplusf_(a + dt_bias);
    const float beta = sigmoidf_(b);
    const float decay = expf(g);

#pragma unroll
    for (int i = 0; i < PPT; ++i) {
        const int k0 = (grp * PPT + i) * GDN_DEC_KPT;
        float kv = 0.f;
#pragma unroll
        for (int j = 0; j < GDN_DEC_KPT; ++j) kv = fmaf(s[i][j], sk[k0 + j], kv);
        part[grp * PPT + i][v] = kv * rk;
    }
    __syncthreads();
    float kvm = 0.f;
#pragma unroll
    for (int q = 0; q < GDN_DEC_PARTS; ++q) kvm += part[q][v];
    const float u = beta * (sv[v] - decay * kvm);
    float o[PPT];
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
        const int k0 = (grp * PPT + i) * GDN_DEC_KPT;
        o[i] = 0.f;
#pragma unroll
        for (int j = 0; j < GDN_DEC_KPT; ++j) {
            s[i][j] = fmaf(decay, s[i][j], sk[k0 + j] * rk * u);
            o[i] = fmaf(s[i][j], sq[k0 + j], o[i]);
            S[(size_t)(k0 + j) * GV_DIM + v] = s[i][j];
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PPT; ++i) part[grp * PPT + i][v] = o[i] * rq;
    __syncthreads();
    // The head's outputs before the norm (thread c < CPB: column c0 + c)
    // and the warp sums of their squares.
    float ov = 0.f;
    if (tid < CPB) {
#pragma unroll
        for (int q = 0; q < GDN_DEC_PARTS; ++q) ov += part[q][tid];
    }
    const float wss = warp_sum(tid < CPB ? ov * ov : 0.f);
    // Warp 0 (split: also warp 1 of an even rank with a neighbour, for the
    // packed group sum) produces 32 columns each.
    const bool pair = SPLIT && p.mix_px != nullptr && (vp & 1) == 0 && vp + 1 < GDN_VSPLIT;
    float ss = 0.f;
    if (SPLIT) {
        if (warp == 0) {
            pub_o[lane] = ov;
            if (lane == 0) pub_ss = wss;
        }
        cluster_arrive();
        cluster_wait();
        if (warp == 0 || (warp == 1 && pair)) {
            for (int r = 0; r < GDN_VSPLIT; ++r) ss += ld_cluster_f32(&pub_ss, (u32)r);
            if (warp == 1) ov = ld_cluster_f32(&pub_o[lane], (u32)(vp + 1));
        }
        // Remote reads done: the neighbours may exit once everyone arrives.
        cluster_arrive();
    } else {
        __syncthreads();  // block_sum may still be reading red
        if (lane == 0 && warp < GV_DIM / 32) red[warp] = wss;
        __syncthreads();
        for (int r = 0; r < GV_DIM / 32; ++r) ss += red[r];
    }
    const bool active = SPLIT ? (warp == 0 || (warp == 1 && pair)) : tid < GV_DIM;
    // Column within the head (split warp 1: the neighbour's).
    const int col = ncol;
    float packed = 0.f;
    if (active) {
        const float y = ov * rsqrtf(ss / (float)GV_DIM + p.eps) * nw * siluf_(sz[col - c0]);
        const bool own = !SPLIT || warp == 0;
        const size_t oi = (size_t)t * GDN_VAL + h * GV_DIM + col;
        if (own && p.mix_f32 != nullptr) p.mix_f32[oi] = y;
        if (own && p.mix_f16 != nullptr) p.mix_f16[oi] = f32_to_f16(y);
        if (p.mix_px != nullptr) {
            // hi/lo halves at the packed position (px_perm, common.cuh).
            const f16 hi = f32_to_f16(y), lo = f32_to_f16(y - f16_to_f32(hi));
            if (own) {
                const int pc = h * GV_DIM + col;
                u16* r = p.mix_px + (size_t)t * 2 * GDN_VAL + (pc & ~7) + px_perm(pc & 7);
                r[0] = hi;
                r[GDN_VAL] = lo;
            }
            packed = f16_to_f32(hi) + f16_to_f32(lo);
        }
    }
    if (p.mix_px != nullptr && (!SPLIT || pair)) {
        // Group sums of the packed values: 64 columns = two warps' sums,
        // added in column order (heads are whole 64-column groups, checked
        // by the host).
        const float ws = warp_sum(packed);
        __syncthreads();  // red is read above
        if (lane == 0) red[warp] = ws;
        __syncthreads();
        // A split block holds one group (at column c0), a whole head
        // GV_DIM / 64 of them (c0 = 0).
        if (tid < (SPLIT ? 1 : GV_DIM / 64)) p.mix_csum[(size_t)t * (GDN_VAL / 64) + (h * GV_DIM + c0) / 64 + tid] = red[2 * tid] + red[2 * tid + 1];
    }
    if (SPLIT) cluster_wait();
}

extern "C" __global__ void __launch_bounds__(GDN_DEC_GROUPS * GV_DIM, 2) gdn_decode(const __grid_constant__ GdnDecodeParams p) {
    gdn_decode_body<false>(p);
}

extern "C" __global__ void __cluster_dims__(GDN_VSPLIT, 1, 1) __launch_bounds__(GDN_DEC_THREADS, 1)
gdn_decode_split(const __grid_constant__ GdnDecodeParams p) {
    gdn_decode_body<true>(p);
}

// ---- chunked prefill ------------------------------------------------------

#ifndef GDN_CHUNK
#error "GDN_CHUNK must be defined by the host (gdn.rs)"
#endif
#if GDN_CHUNK != 64
#error "the chunk kernels tile a chunk as 4 row blocks of 16"
#endif
#if GK_DIM % 32 != 0
#error "the chunk kernels tile the head dim in steps of 32"
#endif

// Parameter structs are mirrored in gdn.rs; the host passes each mirror's
// size, so a field added on one side only fails the compile.
#define GDN_LAYOUT(T, BYTES) static_assert(sizeof(T) == (BYTES), #T " differs from its #[repr(C)] mirror in gdn.rs")

GDN_LAYOUT(GdnDecodeParams, GDN_DECODE_PARAMS_BYTES);

// bf16 row stride (elements) of a shared-memory split tile of n columns.
#define GDN_SPL(n) (2 * (n) + 8)

// One sequence's run of rows in a prefill pass (gdn.rs `PieceDev`). A pass
// of several sequences lays their tokens out in the scratch one after
// another, each padded to whole chunks (piece i from chunk c0); the chunk
// kernels (wu, out) work per chunk and need no piece, the others take the
// piece table and blockIdx.z = the piece.
#ifndef GDN_MAX_PIECES
#error "GDN_MAX_PIECES must be defined by the host (gdn.rs)"
#endif
struct GdnPiece {
    const float* proj;     // its first in-projection row
    float* conv;           // its conv ring (this layer's, its slot)
    float* state;          // its recurrent state (this layer's, its slot)
    float* cap_conv;       // a prefix snapshot's conv ring and state, after
    float* cap_state;      // its first capture_chunk chunks; or null
    float* mix_f32;        // its first output row (f32 or fp16), or null
    f16* mix_f16;
    int T;                 // tokens
    int p0;                // position of its first token
    int c0;                // its first chunk in the scratch
    int capture_chunk;     // 1 .. chunks - 1, or -1
};
GDN_LAYOUT(GdnPiece, GDN_PIECE_BYTES);

struct GdnPrepParams {
    GdnPiece pc[GDN_MAX_PIECES];
    const float* conv_w;
    const float* a_log;
    const float* dt_bias;
    bf16* q;                // [GK_HEADS][Tp] split rows of GK_DIM (scaled)
    bf16* k;                // [GK_HEADS][Tp] split rows of GK_DIM
    float* vv;              // [GV_HEADS][Tp][GV_DIM]
    float* gg;              // [GV_HEADS][Tp]
    float* bb;              // [GV_HEADS][Tp]
    int proj_stride;
    int Tp;                 // scratch rows of the pass (every piece padded to GDN_CHUNK)
};
GDN_LAYOUT(GdnPrepParams, GDN_PREP_PARAMS_BYTES);

#ifndef GDN_PREP_TOKENS
#error "GDN_PREP_TOKENS must be defined by the host (gdn.rs)"
#endif
static_assert(GDN_CHUNK % GDN_PREP_TOKENS == 0, "a prep block's tokens lie all inside its piece's padded rows or all past them");

// x, y -> bf16x2 hi = (bf16(x), bf16(y)) and lo = the bf16 of what hi misses
// (the hardware round to nearest even: for finite x the bits of
// common.cuh's f32_to_bf16, in one instruction for the pair).
__device__ __forceinline__ void split2(float x, float y, u32& hi, u32& lo) {
    hi = pack_bf16x2(x, y);
    lo = pack_bf16x2(x - bf16lo(hi), y - bf16hi(hi));
}

// A lane's channels of a head (q, k and v alike): in each 64-channel group g
// the adjacent pair 64 g + 2 l, 64 g + 2 l + 1 (inputs are float2 loads,
// the taps two float4, the outputs one bf16x2 hi and one lo word or a
// float2); when GK_DIM is an odd multiple of 32, one more channel in the
// last 32, 64 PREP_PAIRS + prep_tail(l). Slot s of a lane's arrays is
// channel 64 (s / 2) + 2 l + (s & 1), the tail slot 2 PREP_PAIRS.
#define PREP_PER_LANE (GK_DIM / 32)
#define PREP_PAIRS (GK_DIM / 64)
#define PREP_TAIL (PREP_PER_LANE - 2 * PREP_PAIRS)
// Raw input rows a block's conv reads: its tokens and the three before.
#define PREP_ROWS (GDN_PREP_TOKENS + 3)

// The tail channel of lane l: sigma(l) = 2 (l & 15) + (l >> 4), the channel
// whose sum of squares lane l forms (see the l2 norm in gdn_prefill_prep).
__device__ __forceinline__ int prep_tail(int lane) { return 2 * (lane & 15) + (lane >> 4); }

// A lane's values of one row of a head: `lp` = its pair of group 0 in that
// row (the head's channel 2 l), `tail` = its tail channel's offset from lp.
__device__ __forceinline__ void prep_ld_row(const float* lp, int tail, float (&x)[PREP_PER_LANE]) {
#pragma unroll
    for (int g = 0; g < PREP_PAIRS; ++g) {
        const float2 v = *reinterpret_cast<const float2*>(lp + 64 * g);
        x[2 * g] = v.x;
        x[2 * g + 1] = v.y;
    }
    if constexpr (PREP_TAIL) x[2 * PREP_PAIRS] = lp[tail];
}

// A head's conv taps and raw inputs (channel 0 = ch0): X[k] is the row of
// token t0 - 3 + k, for the three before the block's first token and its
// nt valid tokens (rows past the piece's last token are not read). A
// negative token's input comes from the conv ring (entry (p0 + t) & 3), which
// holds the inputs before this call. All loads are issued before any is
// used, so a lane's DRAM round trips overlap (consumed one at a time, they
// had Nsight Compute put half of this kernel's stall samples on
// long-scoreboard waits).
__device__ __forceinline__ void prep_load(const GdnPrepParams& p, const float* proj, const float* conv, int p0, int t0, int nt, int ch0,
                                          int lane, float4 (&w)[PREP_PER_LANE], float (&X)[PREP_ROWS][PREP_PER_LANE]) {
    // A channel's four taps are one 16-byte load (the weights are one
    // 256-byte-aligned [CONV_DIM][4] allocation).
    const float4* const w4 = reinterpret_cast<const float4*>(p.conv_w) + ch0 + 2 * lane;
    const int tail = 64 * PREP_PAIRS + prep_tail(lane) - 2 * lane;
#pragma unroll
    for (int g = 0; g < PREP_PAIRS; ++g) {
        w[2 * g] = w4[64 * g];
        w[2 * g + 1] = w4[64 * g + 1];
    }
    if constexpr (PREP_TAIL) w[2 * PREP_PAIRS] = w4[tail];
    // Row k at lp + (k - 3) stride (lp: the block's first token), one 64-bit
    // add a row; only a piece's first block (t0 < 3) has rows in the ring.
    const ptrdiff_t stride = p.proj_stride;
    const float* lp = proj + t0 * stride + ch0 + 2 * lane;
    const float* const lc = conv + ch0 + 2 * lane;
    if (t0 < 3) {
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            const int tt = t0 - 3 + k;
            prep_ld_row(tt < 0 ? lc + ((p0 + tt) & 3) * CONV_DIM : lp - (3 - k) * stride, tail, X[k]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < 3; ++k) prep_ld_row(lp - (3 - k) * stride, tail, X[k]);
    }
#pragma unroll
    for (int k = 3; k < PREP_ROWS; ++k, lp += stride) {
        if (k - 3 >= nt) break;
        prep_ld_row(lp, tail, X[k]);
    }
}

// silu for gdn_prefill_prep (common.cuh's siluf_, which the other kernels
// use, stays exact): x / (1 + 2^(-x log2 e)) on the special-function unit,
// five instructions (FMUL, MUFU.EX2, FADD, MUFU.RCP, FMUL) where expf and the
// IEEE division take ~20 and a slow-path call. ex2.approx.ftz (exp2_ftz, common.cuh) is __expf's
// exponential without the fix-up of subnormal results that __expf gets
// without -ftz (three more instructions; 1 + e absorbs such an e anyway);
// __fdividef is a reciprocal and a multiply.
// Any finite x gives a finite result: x > 87.3 flushes e to 0 (the result
// is x); x < -88.7 makes e = inf and x * rcp(inf) = -0, silu's limit
// (silu(-89) is -2e-37); in between, 1 + e in [2^126, 2^128) and the
// reciprocal underflows, so the result is 0 or about -1e-36, again within
// 1e-36 of silu.
// Error, from the documented bounds (not yet measured on the GPU): e to
// (2 + 1.17 |x|) ulp (__expf's bound: the rounding of x log2 e, amplified by
// |x|), __fdividef to 2 ulp, the add half an ulp, so silu to about
// (e / (1 + e)) (2 + 1.17 |x|) + 2.5 ulp: at most ~3.5 ulp (4e-7) for x >= 0;
// for x < 0 the relative error grows with |x| (~14 ulp at x = -10) while
// silu shrinks like x e^x, so the absolute error stays under ~2e-7. Against
// the tests' 1e-4 gate on the prefill that is noise; the prefill's q, k, v
// are no longer the bits of the decode step's (siluf_), which no test
// compares bit for bit.
__device__ __forceinline__ float silu_fast(float x) {
    return __fdividef(x, 1.f + exp2_ftz(x * -1.4426950408889634f));
}

// Conv of one channel over raw inputs x0 .. x3 (oldest first) and silu.
__device__ __forceinline__ float conv_silu(const float4& w, float x0, float x1, float x2, float x3) {
    float y = w.w * x3;
    y = fmaf(w.z, x2, y);
    y = fmaf(w.y, x1, y);
    y = fmaf(w.x, x0, y);
    return silu_fast(y);
}

// grid (the longest piece's padded tokens / GDN_PREP_TOKENS, 3, pieces),
// block 32 * GK_HEADS. Block (b, part, i): tokens t0 = b GDN_PREP_TOKENS ..
// t0 + GDN_PREP_TOKENS - 1 of piece i, scratch rows c0 * C + t. blockIdx.y:
// 0 = q, 1 = k (warp = key head, with its l2 norm; written as split rows for
// the tensor cores), 2 = v (warps stride over value heads) plus the gates. A
// warp walks its head's tokens in order over one window of raw input rows
// (each row loaded once, the taps once a head), which spreads the block's
// address setup over its tokens. Lanes hold channel pairs (PREP_PER_LANE).
// Padded tokens (T <= t < its chunks' end) get zeros, which add nothing to
// the state; GDN_PREP_TOKENS divides C, so a block never spans two pieces'
// rows. At most 64 registers, so that 1024 threads share an SM (with the
// window's loads all in flight ptxas took 92 unbounded: one 512-thread
// block an SM).
extern "C" __global__ void __launch_bounds__(32 * GK_HEADS, 32 / GK_HEADS) gdn_prefill_prep(const __grid_constant__ GdnPrepParams p) {
    const GdnPiece& pc = p.pc[blockIdx.z];
    const int t0 = blockIdx.x * GDN_PREP_TOKENS, part = blockIdx.y;
    const int T = pc.T;
    if (t0 >= (T + GDN_CHUNK - 1) / GDN_CHUNK * GDN_CHUNK) return;
    const float* const proj = pc.proj;
    const float* const conv = pc.conv;
    const int p0 = pc.p0;
    const int r0 = pc.c0 * GDN_CHUNK + t0;
    const int nt = T - t0;  // tokens i < nt are real, the rest padding (nt may be <= 0)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (part < 2) {
        bf16* const out = (part == 0 ? p.q : p.k) + ((size_t)warp * p.Tp + r0) * 2 * GK_DIM;
        float4 w[PREP_PER_LANE];
        float X[PREP_ROWS][PREP_PER_LANE];
        if (nt > 0) prep_load(p, proj, conv, p0, t0, nt, part * GDN_KEY + warp * GK_DIM, lane, w, X);
        const bool low = lane < 16;
#pragma unroll
        for (int i = 0; i < GDN_PREP_TOKENS; ++i) {
            if (i >= nt) break;
            bf16* const o = out + (size_t)i * 2 * GK_DIM;
            u32* const o32 = reinterpret_cast<u32*>(o);
            float y[PREP_PER_LANE];
#pragma unroll
            for (int s = 0; s < PREP_PER_LANE; ++s) y[s] = conv_silu(w[s], X[i][s], X[i + 1][s], X[i + 2][s], X[i + 3][s]);
            // The sum of squares in exactly the order of one channel a lane
            // (lane m: channels m + 32 j, j ascending, an fma chain from 0,
            // then warp_sum), so the norm's bits do not depend on the layout.
            // In group g lane l < 16 holds j = 2g of m = 2l and 2l + 1, lane
            // l + 16 j = 2g + 1 of the same two; the halves swap one value
            // each, so lane l chains m = sigma(l) = 2 (l & 15) + (l >> 4)
            // (the tail channel is sigma(l) too), and the butterfly pairs
            // lanes in warp_sum's order of m's bits: m ^ 16, 8, 4, 2, 1 is
            // l ^ 8, 4, 2, 1, 16 (a + b == b + a, so every lane ends with
            // the same sum).
            float ss = 0.f;
#pragma unroll
            for (int g = 0; g < PREP_PAIRS; ++g) {
                const float got = __shfl_xor_sync(FULL_MASK, low ? y[2 * g + 1] : y[2 * g], 16);
                const float e0 = low ? y[2 * g] : got, e1 = low ? got : y[2 * g + 1];
                ss = fmaf(e0, e0, ss);
                ss = fmaf(e1, e1, ss);
            }
            if constexpr (PREP_TAIL) ss = fmaf(y[2 * PREP_PAIRS], y[2 * PREP_PAIRS], ss);
            ss += __shfl_xor_sync(FULL_MASK, ss, 8);
            ss += __shfl_xor_sync(FULL_MASK, ss, 4);
            ss += __shfl_xor_sync(FULL_MASK, ss, 2);
            ss += __shfl_xor_sync(FULL_MASK, ss, 1);
            ss += __shfl_xor_sync(FULL_MASK, ss, 16);
            // rsqrtf's bits without its guard for a subnormal argument
            // (ss + 1e-6 is normal; both are MUFU.RSQ of it).
            float rn;
            asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(rn) : "f"(ss + 1e-6f));
            if (part == 0) rn *= rsqrtf((float)GK_DIM);
#pragma unroll
            for (int g = 0; g < PREP_PAIRS; ++g) {
                u32 hi, lo;
                split2(y[2 * g] * rn, y[2 * g + 1] * rn, hi, lo);
                o32[32 * g + lane] = hi;
                o32[GK_DIM / 2 + 32 * g + lane] = lo;
            }
            if constexpr (PREP_TAIL) {
                u32 hi, lo;
                split2(y[2 * PREP_PAIRS] * rn, 0.f, hi, lo);
                o[64 * PREP_PAIRS + prep_tail(lane)] = (bf16)hi;
                o[GK_DIM + 64 * PREP_PAIRS + prep_tail(lane)] = (bf16)lo;
            }
        }
        // Padded rows: a split row of GK_DIM is GK_DIM 32-bit words.
        if (nt < GDN_PREP_TOKENS) {
            u32* const o32 = reinterpret_cast<u32*>(out);
            for (int i = max(nt, 0); i < GDN_PREP_TOKENS; ++i) {
#pragma unroll
                for (int j = 0; j < PREP_PER_LANE; ++j) o32[i * GK_DIM + lane + 32 * j] = 0u;
            }
        }
    } else {
        for (int hh = warp; hh < GV_HEADS; hh += nw) {
            float* const out = p.vv + ((size_t)hh * p.Tp + r0) * GV_DIM;
            float4 w[PREP_PER_LANE];
            float X[PREP_ROWS][PREP_PER_LANE];
            if (nt > 0) prep_load(p, proj, conv, p0, t0, nt, 2 * GDN_KEY + hh * GV_DIM, lane, w, X);
#pragma unroll
            for (int i = 0; i < GDN_PREP_TOKENS; ++i) {
                if (i >= nt) break;
                float* const o = out + (size_t)i * GV_DIM;
#pragma unroll
                for (int g = 0; g < PREP_PAIRS; ++g) {
                    const int s = 2 * g;
                    *reinterpret_cast<float2*>(o + 64 * g + 2 * lane) =
                        make_float2(conv_silu(w[s], X[i][s], X[i + 1][s], X[i + 2][s], X[i + 3][s]),
                                    conv_silu(w[s + 1], X[i][s + 1], X[i + 1][s + 1], X[i + 2][s + 1], X[i + 3][s + 1]));
                }
                if constexpr (PREP_TAIL) {
                    const int s = 2 * PREP_PAIRS;
                    o[64 * PREP_PAIRS + prep_tail(lane)] = conv_silu(w[s], X[i][s], X[i + 1][s], X[i + 2][s], X[i + 3][s]);
                }
            }
            if (nt < GDN_PREP_TOKENS) {
                for (int i = max(nt, 0); i < GDN_PREP_TOKENS; ++i) {
#pragma unroll
                    for (int j = 0; j < PREP_PER_LANE; ++j) out[i * GV_DIM + lane + 32 * j] = 0.f;
                }
            }
        }
        // The gates, a (token, head) a thread (lane 0 of each warp took its
        // heads' gates one after another while its other 31 lanes waited:
        // ~60 instructions of expf, log1pf and a division a head, a sixth of
        // this part's issue slots).
        for (unsigned e = threadIdx.x; e < GDN_PREP_TOKENS * GV_HEADS; e += blockDim.x) {
            const int hh = e % GV_HEADS, i = e / GV_HEADS;
            float g = 0.f, beta = 0.f;
            if (i < nt) {
                const float* pr = proj + (size_t)(t0 + i) * p.proj_stride;
                const float a = pr[CONV_DIM + GDN_VAL + hh], b = pr[CONV_DIM + GDN_VAL + GV_HEADS + hh];
                g = -expf(p.a_log[hh]) * softplusf_(a + p.dt_bias[hh]);
                beta = sigmoidf_(b);
            }
            p.gg[(size_t)hh * p.Tp + r0 + i] = g;
            p.bb[(size_t)hh * p.Tp + r0 + i] = beta;
        }
    }
}

// grid (ceil(CONV_DIM / 256), pieces, 2), block 256: the raw inputs of the
// last three positions of each piece go into its conv ring (z = 0, after
// gdn_prefill_prep has read the old entries) and, for a piece with a
// capture, those before its capture point into the snapshot's ring (z = 1).
struct GdnConvStoreParams {
    GdnPiece pc[GDN_MAX_PIECES];
    int proj_stride;
};
GDN_LAYOUT(GdnConvStoreParams, GDN_CONV_STORE_PARAMS_BYTES);

extern "C" __global__ void gdn_conv_store(const __grid_constant__ GdnConvStoreParams p) {
    const GdnPiece& pc = p.pc[blockIdx.y];
    const bool cap = blockIdx.z == 1;
    if (cap && pc.cap_conv == nullptr) return;
    const float* proj = pc.proj;
    float* conv = cap ? pc.cap_conv : pc.conv;
    const int proj_stride = p.proj_stride, T = cap ? pc.capture_chunk * GDN_CHUNK : pc.T, p0 = pc.p0;
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= CONV_DIM) return;
    for (int d = 1; d <= 3; ++d) {
        const int t = T - d;
        if (t >= 0) conv[((p0 + t) & 3) * CONV_DIM + ch] = proj[(size_t)t * proj_stride + ch];
    }
}

// ---- split-precision tensor-core helpers (one warp each) --------------------
// (split2, a pair of floats -> hi and lo bf16x2 words, is above, with
// gdn_prefill_prep.)

// Four consecutive floats -> split row at `dst` (hi) and `dst + n` (lo).
__device__ __forceinline__ void st_split4(bf16* dst, int n, float x0, float x1, float x2, float x3) {
    uint2 hi, lo;
    split2(x0, x1, hi.x, lo.x);
    split2(x2, x3, hi.y, lo.y);
    *reinterpret_cast<uint2*>(dst) = hi;
    *reinterpret_cast<uint2*>(dst + n) = lo;
}

__device__ __forceinline__ void ldsm_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// A value the optimiser cannot see through, so address arithmetic built on it
// is not hoisted out of a loop into many live registers.
__device__ __forceinline__ u32 opaque(u32 x) {
    u32 r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// d[0..1] += (Ah + Al)(Bh + Bl) on two n-tiles (b[0..1] and b[2..3]) without
// the Al Bl term; small terms first, the two tiles interleaved.
__device__ __forceinline__ void mma3x2(float (*d)[4], const u32* ah, const u32* al, const u32* bh, const u32* bl) {
    mma_bf16(d[0], al[0], al[1], al[2], al[3], bh[0], bh[1]);
    mma_bf16(d[1], al[0], al[1], al[2], al[3], bh[2], bh[3]);
    mma_bf16(d[0], ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
    mma_bf16(d[1], ah[0], ah[1], ah[2], ah[3], bl[2], bl[3]);
    mma_bf16(d[0], ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
    mma_bf16(d[1], ah[0], ah[1], ah[2], ah[3], bh[2], bh[3]);
}

// Split tiles are addressed by their shared-memory address (u32): a lane's
// part of each ldmatrix address is one register per tile and pattern, and
// the block offsets fold into the instruction's immediate.

// A fragment (rows r0..r0+15, k columns k0..k0+15) of a split tile at shared
// address t with row stride ld (bf16) and n columns.
__device__ __forceinline__ void lda_split(u32* ah, u32* al, u32 t, int ld, int n, int r0, int k0) {
    const int lane = threadIdx.x & 31;
    const u32 a = t + 2 * ((lane & 15) * ld + (lane >> 4) * 8) + 2 * (r0 * ld + k0);
    ldsm_x4(ah, a);
    ldsm_x4(al, a + 2 * n);
}

// B fragments of the two n-tiles n0.., n0+8.. at k0..k0+15, from a split
// tile whose rows are n (k contiguous): B[k][n] = t[n][k].
__device__ __forceinline__ void ldb_split_nk(u32* bh, u32* bl, u32 t, int ld, int n, int n0, int k0) {
    const int lane = threadIdx.x & 31;
    const u32 a = t + 2 * (((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8) + 2 * (n0 * ld + k0);
    ldsm_x4(bh, a);
    ldsm_x4(bl, a + 2 * n);
}

// The same from a split tile whose rows are k (n contiguous): B[k][n] = t[k][n].
__device__ __forceinline__ void ldb_split_kn(u32* bh, u32* bl, u32 t, int ld, int n, int k0, int n0) {
    const int lane = threadIdx.x & 31;
    const u32 a = t + 2 * (((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8) + 2 * (k0 * ld + n0);
    ldsm_x4_t(bh, a);
    ldsm_x4_t(bl, a + 2 * n);
}

// A fragment (16 x 16 at r0, k0) of a row-major fp32 matrix, split.
__device__ __forceinline__ void lda_f32(u32* ah, u32* al, const float* m, int ld, int r0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = 2 * (lane & 3);
    const float2 x0 = *reinterpret_cast<const float2*>(m + (r0 + g) * ld + k0 + c);
    const float2 x1 = *reinterpret_cast<const float2*>(m + (r0 + g + 8) * ld + k0 + c);
    const float2 x2 = *reinterpret_cast<const float2*>(m + (r0 + g) * ld + k0 + c + 8);
    const float2 x3 = *reinterpret_cast<const float2*>(m + (r0 + g + 8) * ld + k0 + c + 8);
    split2(x0.x, x0.y, ah[0], al[0]);
    split2(x1.x, x1.y, ah[1], al[1]);
    split2(x2.x, x2.y, ah[2], al[2]);
    split2(x3.x, x3.y, ah[3], al[3]);
}

// B fragments of the two n-tiles n0.., n0+8.. at k0 of a row-major [k][n]
// fp32 matrix, split.
__device__ __forceinline__ void ldb_f32(u32* bh, u32* bl, const float* m, int ld, int k0, int n0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float* col = m + n0 + 8 * j + g;
        split2(col[(k0 + c) * ld], col[(k0 + c + 1) * ld], bh[2 * j], bl[2 * j]);
        split2(col[(k0 + c + 8) * ld], col[(k0 + c + 9) * ld], bh[2 * j + 1], bl[2 * j + 1]);
    }
}

// The C fragments of two n-tiles (16 rows x 16 columns) as a split A fragment
// whose k runs over those 16 columns.
__device__ __forceinline__ void c2a(u32* ah, u32* al, const float* c0, const float* c1) {
    split2(c0[0], c0[1], ah[0], al[0]);
    split2(c0[2], c0[3], ah[1], al[1]);
    split2(c1[0], c1[1], ah[2], al[2]);
    split2(c1[2], c1[3], ah[3], al[3]);
}

// s * (the C fragments of two n-tiles) -> row-major fp32 at (r0, n0).
__device__ __forceinline__ void stc_f32(float* m, int ld, int r0, int n0, const float (*c)[4], float s) {
    const int lane = threadIdx.x & 31, g = lane >> 2, cc = 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        *reinterpret_cast<float2*>(m + (r0 + g) * ld + n0 + 8 * j + cc) = make_float2(s * c[j][0], s * c[j][1]);
        *reinterpret_cast<float2*>(m + (r0 + g + 8) * ld + n0 + 8 * j + cc) = make_float2(s * c[j][2], s * c[j][3]);
    }
}

// ROWS rows of ROW_BYTES (a multiple of 16) from global memory (rows
// contiguous) into shared rows LD_BYTES apart, by cp.async, NT threads (the
// block) 16 bytes a copy. All of it known at compile time, so a thread's
// copies unroll into constant offsets from one source and one destination
// address (the loop with run-time bounds was ~10 instructions a copy, ~360
// a chunk a warp of gdn_chunk_state's ~1,800).
template <int NT, int LD_BYTES, int ROW_BYTES, int ROWS>
__device__ __forceinline__ void cp_rows(void* dst, const void* src) {
    constexpr int PER = ROW_BYTES / 16, TOTAL = ROWS * PER, STEPS = (TOTAL + NT - 1) / NT;
    static_assert(ROW_BYTES % 16 == 0 && LD_BYTES % 16 == 0, "16-byte copies");
    static_assert(NT % PER == 0, "a step of the block covers whole rows");
    const int r0 = (int)threadIdx.x / PER, q = (int)threadIdx.x % PER;
    char* const d = static_cast<char*>(dst) + r0 * LD_BYTES + 16 * q;
    const char* const s = static_cast<const char*>(src) + (size_t)r0 * ROW_BYTES + 16 * q;
#pragma unroll
    for (int k = 0; k < STEPS; ++k)
        if (TOTAL % NT == 0 || (int)threadIdx.x + k * NT < TOTAL)
            cp_async16(d + k * (NT / PER) * LD_BYTES, s + (size_t)k * (NT / PER) * ROW_BYTES, 16);
}

// The 10 lower 16x16 blocks (I, J), J <= I, of a 64x64 matrix, by index.
__device__ __forceinline__ int tri_i(int b) { return b >= 6 ? 3 : b >= 3 ? 2 : b >= 1 ? 1 : 0; }
__device__ __forceinline__ int tri_j(int b) { return b - tri_i(b) * (tri_i(b) + 1) / 2; }

// ---- gdn_chunk_wu: G, A, T = (I + A)^-1, W, U per (chunk, value head) -------

struct GdnWuParams {
    const bf16* k;     // [GK_HEADS][Tp] split rows of GK_DIM
    const float* gg;   // [GV_HEADS][Tp]
    const float* bb;   // [GV_HEADS][Tp]
    float* vu;         // in: v [GV_HEADS][Tp][GV_DIM]; out: U^T [GV_DIM][C] per (head, chunk) tile
    bf16* w;           // [GV_HEADS][Tp] split rows of GK_DIM
    float* gc;         // [GV_HEADS][Tp]: G, cumulative within each chunk
    int Tp;
};
GDN_LAYOUT(GdnWuParams, GDN_WU_PARAMS_BYTES);

#define WU_THREADS GDN_WU_THREADS    // the block (gdn.rs WU_THREADS)
static_assert(WU_THREADS == 128, "gdn_chunk_wu splits its phases over 4 warps");
#define WU_LD GDN_SPL(GDN_D)        // bf16 row stride of the k and v tiles
#define WU_LDF (GDN_CHUNK + 8)      // float row stride of A and T (float2 fragment reads without conflicts)
#define WU_SMEM_BYTES (2 * GDN_CHUNK * WU_LD * 2 + 2 * GDN_CHUNK * WU_LDF * 4 + 2 * GDN_CHUNK * 4)
static_assert(WU_SMEM_BYTES == GDN_WU_SMEM, "gdn_chunk_wu shared memory differs from gdn.rs wu_smem");

// grid (Tp / C, GV_HEADS), block 128 = 4 warps. Dynamic smem: sK split
// [C][WU_LD] (raw k, then beta e^G k), sV split [C][WU_LD] (beta v), sA and
// sT f32 [C][WU_LDF], G and beta [C]. 105 KB at D = 128: two blocks per SM.
// Phases (barriers between):
//   0  G = inclusive scan of g (warp 0) and beta; k by cp.async; beta v split
//   1  A: the 10 lower 16x16 blocks of k k^T (warp w: blocks w, w+4, w+8),
//      scaled by beta_i Gamma_ij, strictly lower; k restaged as beta e^G k
//   2  T: warp w inverts diagonal block w (lane j < 16 solves column j by
//      forward substitution in fp32); then T_10 = -T_11 A_10 T_00 and
//      T_32 = -T_33 A_32 T_22 (warps 0, 1); then the 32x32 corner
//      T_HL = -T_HH A_HL T_LL (warp w: block (2 + w/2, w%2))
//   3  W = T (beta e^G k), U = T (beta v): warp w takes the 16-column pairs
//      w, w+4, ... and all 4 row blocks, k-steps up to the diagonal
//      (T is lower); W out as split rows, U transposed into the v tile.
extern "C" __global__ void __launch_bounds__(WU_THREADS)
gdn_chunk_wu(const __grid_constant__ GdnWuParams p) {
    extern __shared__ __align__(16) unsigned char gdn_smem[];
    bf16* sK = reinterpret_cast<bf16*>(gdn_smem);
    bf16* sV = sK + GDN_CHUNK * WU_LD;
    float* sA = reinterpret_cast<float*>(sV + GDN_CHUNK * WU_LD);
    float* sT = sA + GDN_CHUNK * WU_LDF;
    float* sG = sT + GDN_CHUNK * WU_LDF;
    float* sB = sG + GDN_CHUNK;
    const int c = blockIdx.x, h = blockIdx.y, kh = h / GDN_RATIO, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const size_t row0 = (size_t)h * p.Tp + (size_t)c * GDN_CHUNK;   // this chunk's first row of the value-head arrays
    const bf16* K = p.k + ((size_t)kh * p.Tp + (size_t)c * GDN_CHUNK) * 2 * GDN_D;
    float* VU = p.vu + row0 * GDN_D;

    // ---- 0: G, beta, k, beta v
    // The k tile and the raw v tile (f32, into the A and T tiles' space,
    // free until phase 1) requested together: v read by plain loads, one
    // float4 a thread per step, each consumed at once, was a DRAM round
    // trip per step (Nsight Compute: a third of this kernel's stall samples
    // on the first use of each load).
    float* sVraw = sA;
    static_assert(GDN_CHUNK * GDN_D <= 2 * GDN_CHUNK * WU_LDF, "the raw v tile fits in the A and T tiles");
    cp_rows<WU_THREADS, WU_LD * 2, 4 * GDN_D, GDN_CHUNK>(sK, K);
    cp_rows<WU_THREADS, GDN_D * 4, GDN_D * 4, GDN_CHUNK>(sVraw, VU);
    cp_async_commit();
    if (warp == 0) {
        const float* gp = p.gg + row0;
        const float a = gp[2 * lane], b = gp[2 * lane + 1];
        float s = a + b;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float n = __shfl_up_sync(FULL_MASK, s, o);
            if (lane >= o) s += n;
        }
        const float g0 = s - b;
        sG[2 * lane] = g0;
        sG[2 * lane + 1] = s;
        p.gc[row0 + 2 * lane] = g0;
        p.gc[row0 + 2 * lane + 1] = s;
    } else if (tid < 32 + GDN_CHUNK) {
        sB[tid - 32] = p.bb[row0 + tid - 32];
    }
    cp_async_wait<0>();
    __syncthreads();
    for (int i = tid; i < GDN_CHUNK * GDN_D / 4; i += blockDim.x) {
        const int t = i / (GDN_D / 4), d = (i - t * (GDN_D / 4)) * 4;
        const float4 x = *reinterpret_cast<const float4*>(sVraw + t * GDN_D + d);
        const float b = sB[t];
        st_split4(sV + t * WU_LD + d, GDN_D, b * x.x, b * x.y, b * x.z, b * x.w);
    }
    __syncthreads();

    // ---- 1: A = beta_i (k_i . k_j) Gamma_ij, strictly lower
    for (int b = warp; b < 10; b += 4) {
        const int I = tri_i(b), J = tri_j(b);
        float acc[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < GDN_D / 16; ++ks) {
            u32 ah[4], al[4], bh[4], bl[4];
            lda_split(ah, al, smem_u32(sK), WU_LD, GDN_D, 16 * I, 16 * ks);
            ldb_split_nk(bh, bl, smem_u32(sK), WU_LD, GDN_D, 16 * J, 16 * ks);
            mma3x2(acc, ah, al, bh, bl);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = 16 * I + g + 8 * r, col = 16 * J + 8 * j + 2 * tq;
                const float x0 = col < i ? sB[i] * acc[j][2 * r] * expf(sG[i] - sG[col]) : 0.f;
                const float x1 = col + 1 < i ? sB[i] * acc[j][2 * r + 1] * expf(sG[i] - sG[col + 1]) : 0.f;
                *reinterpret_cast<float2*>(sA + i * WU_LDF + col) = make_float2(x0, x1);
            }
    }
    __syncthreads();

    // ---- 2: T. The k tile becomes beta e^G k (each thread rewrites what it reads).
    for (int i = tid; i < GDN_CHUNK * GDN_D / 4; i += blockDim.x) {
        const int t = i / (GDN_D / 4), d = (i - t * (GDN_D / 4)) * 4;
        bf16* r = sK + t * WU_LD + d;
        const uint2 hi = *reinterpret_cast<const uint2*>(r), lo = *reinterpret_cast<const uint2*>(r + GDN_D);
        const float s = sB[t] * expf(sG[t]);
        st_split4(r, GDN_D, s * (bf16lo(hi.x) + bf16lo(lo.x)), s * (bf16hi(hi.x) + bf16hi(lo.x)),
                  s * (bf16lo(hi.y) + bf16lo(lo.y)), s * (bf16hi(hi.y) + bf16hi(lo.y)));
    }
    if (lane < 16) {
        // Column j of the inverse of diagonal block `warp`: x_i = [i == j] - sum_{m<i} A_im x_m.
        const int o = 16 * warp, j = lane;
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            float s = i == j ? 1.f : 0.f;
#pragma unroll
            for (int m = 0; m < i; ++m) s = fmaf(-sA[(o + i) * WU_LDF + o + m], x[m], s);
            x[i] = s;
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) sT[(o + i) * WU_LDF + o + j] = x[i];
    }
    __syncthreads();
    if (warp < 2) {
        // T_IJ = -(T_II A_IJ) T_JJ for (I, J) = (1, 0), (3, 2).
        const int I = 2 * warp + 1, J = 2 * warp;
        float y[2][4] = {}, z[2][4] = {};
        u32 ah[4], al[4], bh[4], bl[4];
        lda_f32(ah, al, sT, WU_LDF, 16 * I, 16 * I);
        ldb_f32(bh, bl, sA, WU_LDF, 16 * I, 16 * J);
        mma3x2(y, ah, al, bh, bl);
        c2a(ah, al, y[0], y[1]);
        ldb_f32(bh, bl, sT, WU_LDF, 16 * J, 16 * J);
        mma3x2(z, ah, al, bh, bl);
        stc_f32(sT, WU_LDF, 16 * I, 16 * J, z, -1.f);
    }
    __syncthreads();
    {
        // T_IJ = -sum_{M=J..1} (sum_{N=2..I} T_IN A_NM) T_MJ for I in {2, 3}, J in {0, 1}.
        const int I = 2 + (warp >> 1), J = warp & 1;
        float z[2][4] = {};
#pragma unroll
        for (int M = 0; M < 2; ++M) {
            if (M < J) continue;
            float y[2][4] = {};
            u32 ah[4], al[4], bh[4], bl[4];
#pragma unroll
            for (int N = 2; N < 4; ++N) {
                if (N > I) continue;
                lda_f32(ah, al, sT, WU_LDF, 16 * I, 16 * N);
                ldb_f32(bh, bl, sA, WU_LDF, 16 * N, 16 * M);
                mma3x2(y, ah, al, bh, bl);
            }
            c2a(ah, al, y[0], y[1]);
            ldb_f32(bh, bl, sT, WU_LDF, 16 * M, 16 * J);
            mma3x2(z, ah, al, bh, bl);
        }
        stc_f32(sT, WU_LDF, 16 * I, 16 * J, z, -1.f);
    }
    __syncthreads();

    // ---- 3: W = T (beta e^G k), U = T (beta v)
    for (int np = warp; np < GDN_D / 16; np += 4) {
#pragma unroll
        for (int rb = 0; rb < 4; ++rb) {
            float aw[2][4] = {}, au[2][4] = {};
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                if (kk > rb) continue;
                u32 ah[4], al[4], bh[4], bl[4];
                lda_f32(ah, al, sT, WU_LDF, 16 * rb, 16 * kk);
                ldb_split_kn(bh, bl, smem_u32(sK), WU_LD, GDN_D, 16 * kk, 16 * np);
                mma3x2(aw, ah, al, bh, bl);
                ldb_split_kn(bh, bl, smem_u32(sV), WU_LD, GDN_D, 16 * kk, 16 * np);
                mma3x2(au, ah, al, bh, bl);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int t = 16 * rb + g + 8 * r, d = 16 * np + 8 * j + 2 * tq;
                    u32 hi, lo;
                    split2(aw[j][2 * r], aw[j][2 * r + 1], hi, lo);
                    bf16* wr = p.w + (row0 + t) * 2 * GDN_D + d;
                    *reinterpret_cast<u32*>(wr) = hi;
                    *reinterpret_cast<u32*>(wr + GDN_D) = lo;
                    VU[d * GDN_CHUNK + t] = au[j][2 * r];
                    VU[(d + 1) * GDN_CHUNK + t] = au[j][2 * r + 1];
                }
        }
    }
}

// ---- gdn_chunk_state: the recurrence over chunks -----------------------------

struct GdnStateParams {
    const bf16* k;     // [GK_HEADS][Tp] split rows of GK_DIM
    const bf16* w;     // [GV_HEADS][Tp] split rows of GK_DIM
    float* vu;         // per (head, chunk) tile: in U^T [GV_DIM][C] f32, out Vn^T split rows [GV_DIM][2C] bf16
    const float* gc;   // [GV_HEADS][Tp]
    bf16* hs;          // [GV_HEADS][Tp / C] x S0^T: split rows [GV_DIM][2 GK_DIM]
    // Per piece: state [GV_HEADS][GK_DIM][GV_DIM] of this layer and sequence
    // (in and out), cap_state like it (S at the start of chunk
    // capture_chunk of the piece, a prefix snapshot) or null.
    GdnPiece pc[GDN_MAX_PIECES];
    int Tp;
};
GDN_LAYOUT(GdnStateParams, GDN_STATE_PARAMS_BYTES);

#define ST_W GDN_STATE_WARPS            // value groups per block, each 16 value columns
#define ST_KS GDN_STATE_KSPLIT          // warps sharing a value group, each a slice of the keys
#define ST_KH (GDN_D / ST_KS)           // keys a warp holds
#define ST_BV (16 * ST_W)               // value columns per block
#define ST_THREADS (32 * ST_W * ST_KS)  // the block (gdn.rs: 32 x state_warps x state_key_split)
#define ST_LD GDN_SPL(GDN_D)            // bf16 row stride of the w and k tiles
#define ST_LDU (GDN_CHUNK + 8)          // float row stride of the U^T rows
#define ST_BUF_BYTES (2 * GDN_CHUNK * ST_LD * 2 + ST_BV * ST_LDU * 4 + GDN_CHUNK * 4)
#define ST_X_FLOATS (GDN_CHUNK / 2 * 32)   // a warp's Vn partial (its vn registers, lane-minor)
static_assert(GDN_D % ST_BV == 0, "the value columns split into whole blocks");
static_assert(ST_KS == 1 || ST_KS == 2, "keys whole or in two halves");
static_assert(ST_KH % 16 == 0, "a warp's keys are whole k16 steps");
static_assert(2 * ST_BUF_BYTES + (ST_KS > 1 ? ST_W * ST_KS * ST_X_FLOATS * 4 : 0) == GDN_STATE_SMEM,
              "gdn_chunk_state shared memory differs from gdn.rs state_smem");

// grid (GV_HEADS, GV_DIM / ST_BV, pieces), block 32 * ST_W * ST_KS; a
// piece's chunks in sequence, the pieces side by side. Warp (w, kh) =
// (warp % ST_W, warp / ST_W) owns the value columns v0 + 16w .. +16 and the
// keys kh ST_KH .. +ST_KH of S for the whole call, as S^T (16 v rows x ST_KH
// key columns) in mma accumulators (ST_KH/2 floats a thread), so S^T is the
// A operand of Vn^T = U^T - S^T W^T directly (two n8 accumulator tiles = one
// k16 A fragment) and the accumulator of S^T = e^{G_L} S^T + Vn^T diag(e^{G_L
// - G}) K. With the keys in two halves (ST_KS = 2) each warp of a pair sums
// its half of S^T W^T (warp kh = 0 starting from U^T, kh = 1 from zero), the
// pair swaps the partials through shared memory, and both add them as
// X0 + X1 (so both hold the same Vn); each then updates its own keys. Per
// chunk a warp runs ST_KH/16 x 4 x 6 + 4 x ST_KH/16 x 6 mma (192 at D = 128
// in halves; one warp for all keys took 384 and, with 64 blocks of 4 warps
// walking the 64 chunks of a 4,096-token pass in sequence, 435 us a layer).
// The chain per chunk is what bounds this kernel, so halving a warp's keys
// halves it. Dynamic smem: two buffers of {w split [C][ST_LD], k split
// [C][ST_LD], U^T rows [ST_BV][ST_LDU] f32, G [C]}, then (ST_KS = 2) a Vn
// partial per warp; chunk c + 1 loads by cp.async while chunk c computes.
// The block's 16 x ST_W rows of Vn^T overwrite its own U^T rows (already in
// shared memory; warps kh = 0 write them), and S0^T is stored from the A
// fragments (already split) before each chunk.
extern "C" __global__ void __launch_bounds__(ST_THREADS, 1)
gdn_chunk_state(const __grid_constant__ GdnStateParams p) {
    extern __shared__ __align__(16) unsigned char gdn_smem[];
    const int h = blockIdx.x, kh = h / GDN_RATIO, v0 = blockIdx.y * ST_BV;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int wv = warp % ST_W, ks = warp / ST_W;   // value group, key slice
    const int lv = 16 * wv;     // this warp's first row of S^T within the block
    const int k0 = ks * ST_KH;  // its first key
    const GdnPiece& pc = p.pc[blockIdx.z];
    const int nch = p.Tp / GDN_CHUNK;                               // chunks of the pass (hs rows)
    const int cb = pc.c0, ce = pc.c0 + (pc.T + GDN_CHUNK - 1) / GDN_CHUNK;  // this piece's
    auto sW = [&](int b) { return reinterpret_cast<bf16*>(gdn_smem + b * ST_BUF_BYTES); };
    auto sK = [&](int b) { return sW(b) + GDN_CHUNK * ST_LD; };
    auto sU = [&](int b) { return reinterpret_cast<float*>(sK(b) + GDN_CHUNK * ST_LD); };
    auto sG = [&](int b) { return sU(b) + ST_BV * ST_LDU; };
    float* sX = reinterpret_cast<float*>(gdn_smem + 2 * ST_BUF_BYTES);   // [warp][ST_X_FLOATS] Vn partials
    auto prefetch = [&](int c, int b) {
        const size_t row = (size_t)h * p.Tp + (size_t)c * GDN_CHUNK;
        cp_rows<ST_THREADS, ST_LD * 2, 4 * GDN_D, GDN_CHUNK>(sW(b), p.w + row * 2 * GDN_D);
        cp_rows<ST_THREADS, ST_LD * 2, 4 * GDN_D, GDN_CHUNK>(sK(b), p.k + ((size_t)kh * p.Tp + (size_t)c * GDN_CHUNK) * 2 * GDN_D);
        cp_rows<ST_THREADS, ST_LDU * 4, GDN_CHUNK * 4, ST_BV>(sU(b), p.vu + row * GDN_D + (size_t)v0 * GDN_CHUNK);
        cp_rows<ST_THREADS, GDN_CHUNK * 4, GDN_CHUNK * 4, 1>(sG(b), p.gc + row);
    };

    // S^T accumulators: s[nk][e] = S[8 nk + 2 tq + (e & 1)][v0 + lv + g + 8 (e >> 1)]
    // (offsets from Sg are constants, so no per-element address stays live).
    float* Sg = pc.state + (size_t)h * GDN_D * GDN_D + (size_t)(k0 + 2 * tq) * GDN_D + v0 + lv + g;
    float s[ST_KH / 8][4];
#pragma unroll
    for (int nk = 0; nk < ST_KH / 8; ++nk)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nk][e] = Sg[(8 * nk + (e & 1)) * GDN_D + 8 * (e >> 1)];

    prefetch(cb, 0);
    cp_async_commit();
    for (int c = cb; c < ce; ++c) {
        const int b = (c - cb) & 1;
        if (c + 1 < ce) prefetch(c + 1, b ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const u32 tw = opaque(smem_u32(sW(b)));
        const u32 tk = tw + GDN_CHUNK * ST_LD * 2;
        const float* tu = sU(b);
        const float* G = sG(b);

        // Vn^T = U^T - S^T W^T: vn[nt][e] = Vn^T[lv + g + 8 (e >> 1)][8 nt + 2 tq + (e & 1)].
        float vn[GDN_CHUNK / 8][4];
#pragma unroll
        for (int nt = 0; nt < GDN_CHUNK / 8; ++nt) {
            float2 a = make_float2(0.f, 0.f), bb = a;
            if (ks == 0) {
                a = *reinterpret_cast<const float2*>(tu + (lv + g) * ST_LDU + 8 * nt + 2 * tq);
                bb = *reinterpret_cast<const float2*>(tu + (lv + g + 8) * ST_LDU + 8 * nt + 2 * tq);
            }
            vn[nt][0] = a.x;
            vn[nt][1] = a.y;
            vn[nt][2] = bb.x;
            vn[nt][3] = bb.y;
        }
        if (pc.cap_state != nullptr && c - cb == pc.capture_chunk) {
            // The state after the piece's first c - cb chunks, in fp32 as a
            // pass ending there would leave it (a prefix snapshot inside the
            // prompt).
            float* Cg = pc.cap_state + (Sg - pc.state);
#pragma unroll
            for (int nk = 0; nk < ST_KH / 8; ++nk)
#pragma unroll
                for (int e = 0; e < 4; ++e) Cg[(8 * nk + (e & 1)) * GDN_D + 8 * (e >> 1)] = s[nk][e];
        }
        bf16* H = p.hs + (((size_t)h * nch + c) * GDN_D + v0 + lv + g) * 2 * GDN_D + k0 + 2 * tq;
#pragma unroll
        for (int kk = 0; kk < ST_KH / 16; ++kk) {
            u32 ah[4], al[4];
            c2a(ah, al, s[2 * kk], s[2 * kk + 1]);
            u32* h0 = reinterpret_cast<u32*>(H + 16 * kk);                       // row g, keys 16 kk + 2 tq
            u32* h8 = reinterpret_cast<u32*>(H + 8 * 2 * GDN_D + 16 * kk);       // row g + 8
            h0[0] = ah[0];
            h8[0] = ah[1];
            h0[4] = ah[2];   // +8 keys
            h8[4] = ah[3];
            h0[GDN_D / 2] = al[0];
            h8[GDN_D / 2] = al[1];
            h0[GDN_D / 2 + 4] = al[2];
            h8[GDN_D / 2 + 4] = al[3];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                ah[i] ^= 0x80008000u;   // -S^T: flip both bf16 signs (exact)
                al[i] ^= 0x80008000u;
            }
#pragma unroll
            for (int np = 0; np < GDN_CHUNK / 16; ++np) {
                u32 bh[4], bl[4];
                ldb_split_nk(bh, bl, tw, ST_LD, GDN_D, 16 * np, k0 + 16 * kk);
                mma3x2(vn + 2 * np, ah, al, bh, bl);
            }
        }
        if constexpr (ST_KS > 1) {
            // Swap the partials with the other warp of the pair (same lane
            // layout) and add them in one order, X0 + X1, in both warps.
            float* mine = sX + warp * ST_X_FLOATS;
            const float* other = sX + (ks == 0 ? warp + ST_W : warp - ST_W) * ST_X_FLOATS;   // warp (wv, 1 - ks)
#pragma unroll
            for (int nt = 0; nt < GDN_CHUNK / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) mine[(4 * nt + e) * 32 + lane] = vn[nt][e];
            __syncthreads();
#pragma unroll
            for (int nt = 0; nt < GDN_CHUNK / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float o = other[(4 * nt + e) * 32 + lane];
                    vn[nt][e] = ks == 0 ? vn[nt][e] + o : o + vn[nt][e];
                }
        }

        // Vn^T out, split rows [hi C | lo C], over this warp's U^T rows.
        bf16* VN = reinterpret_cast<bf16*>(p.vu + ((size_t)h * p.Tp + (size_t)c * GDN_CHUNK) * GDN_D + (size_t)(v0 + lv + g) * GDN_CHUNK) + 2 * tq;
        if (ks == 0) {   // one warp of a pair stores Vn^T
#pragma unroll
            for (int nt = 0; nt < GDN_CHUNK / 8; ++nt) {
                u32 hi, lo;
                split2(vn[nt][0], vn[nt][1], hi, lo);
                *reinterpret_cast<u32*>(VN + 8 * nt) = hi;
                *reinterpret_cast<u32*>(VN + GDN_CHUNK + 8 * nt) = lo;
                split2(vn[nt][2], vn[nt][3], hi, lo);
                *reinterpret_cast<u32*>(VN + 8 * 2 * GDN_CHUNK + 8 * nt) = hi;
                *reinterpret_cast<u32*>(VN + 8 * 2 * GDN_CHUNK + GDN_CHUNK + 8 * nt) = lo;
            }
        }

        // S^T = e^{G_L} S^T + (Vn^T diag(e^{G_L - G})) K
        const float gl = G[GDN_CHUNK - 1];
        const float el = expf(gl);
#pragma unroll
        for (int nk = 0; nk < ST_KH / 8; ++nk)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nk][e] *= el;
#pragma unroll
        for (int kt = 0; kt < GDN_CHUNK / 16; ++kt) {
            const int t = 16 * kt + 2 * tq;
            const float d0 = expf(gl - G[t]), d1 = expf(gl - G[t + 1]), d8 = expf(gl - G[t + 8]), d9 = expf(gl - G[t + 9]);
            u32 ah[4], al[4];
            split2(d0 * vn[2 * kt][0], d1 * vn[2 * kt][1], ah[0], al[0]);
            split2(d0 * vn[2 * kt][2], d1 * vn[2 * kt][3], ah[1], al[1]);
            split2(d8 * vn[2 * kt + 1][0], d9 * vn[2 * kt + 1][1], ah[2], al[2]);
            split2(d8 * vn[2 * kt + 1][2], d9 * vn[2 * kt + 1][3], ah[3], al[3]);
#pragma unroll
            for (int nk2 = 0; nk2 < ST_KH / 16; ++nk2) {
                u32 bh[4], bl[4];
                ldb_split_kn(bh, bl, tk, ST_LD, GDN_D, 16 * kt, k0 + 16 * nk2);
                mma3x2(s + 2 * nk2, ah, al, bh, bl);
            }
        }
        __syncthreads();   // every warp is done with buffer b before it is refilled
    }
    cp_async_wait<0>();

#pragma unroll
    for (int nk = 0; nk < ST_KH / 8; ++nk)
#pragma unroll
        for (int e = 0; e < 4; ++e) Sg[(8 * nk + (e & 1)) * GDN_D + 8 * (e >> 1)] = s[nk][e];
}

// ---- gdn_chunk_out: O per (chunk, value head) ---------------------------------

struct GdnOutParams {
    const bf16* q;     // [GK_HEADS][Tp] split rows of GK_DIM (scaled)
    const bf16* k;     // [GK_HEADS][Tp] split rows of GK_DIM
    const float* vu;   // per (head, chunk) tile: Vn^T split rows [GV_DIM][2C] bf16
    const float* gc;   // [GV_HEADS][Tp]
    const bf16* hs;    // [GV_HEADS][Tp / C] x S0^T split rows [GV_DIM][2 GK_DIM]
    float* o;          // [Tp][GV_HEADS * GV_DIM]
    int Tp;
};
GDN_LAYOUT(GdnOutParams, GDN_OUT_PARAMS_BYTES);

#define OUT_THREADS GDN_OUT_THREADS  // the block (gdn.rs OUT_THREADS)
static_assert(OUT_THREADS == 256, "gdn_chunk_out splits its tiles over 8 warps");
#define OUT_LD GDN_SPL(GDN_D)        // bf16 row stride of the q, k and S0^T tiles
#define OUT_LDC GDN_SPL(GDN_CHUNK)   // bf16 row stride of the Vn^T and P tiles
#define OUT_SMEM_BYTES ((2 * GDN_CHUNK + GDN_D) * OUT_LD * 2 + (GDN_D + GDN_CHUNK) * OUT_LDC * 2 + GDN_CHUNK * 4)
static_assert(OUT_SMEM_BYTES == GDN_OUT_SMEM, "gdn_chunk_out shared memory differs from gdn.rs out_smem");

// grid (Tp / C, GV_HEADS), block 256 = 8 warps. Dynamic smem: q, k split
// [C][OUT_LD], S0^T split [D][OUT_LD], Vn^T split [D][OUT_LDC], P split
// [C][OUT_LDC], G [C]; 188 KB at D = 128 (one block per SM). Three cp.async
// groups (q, k, G | S0^T | Vn^T) so each phase starts when its operands are in:
//   1  P = (q k^T) ⊙ Gamma, lower incl. diagonal, split into shared memory:
//      the 10 lower 16x16 blocks, warp w takes blocks w and w + 8
//   2  warp w: rows 16 (w % 4) .. +16, value columns (w / 4) D/2 .. +D/2:
//      acc = diag(e^G) q S0 (D/16 k-steps x D/32 column pairs, 192 mma at
//      D = 128)
//   3  acc += P Vn over the k-steps up to the diagonal; acc -> o (f32).
extern "C" __global__ void __launch_bounds__(OUT_THREADS, 1)
gdn_chunk_out(const __grid_constant__ GdnOutParams p) {
    extern __shared__ __align__(16) unsigned char gdn_smem[];
    bf16* sQ = reinterpret_cast<bf16*>(gdn_smem);
    bf16* sK = sQ + GDN_CHUNK * OUT_LD;
    bf16* sS = sK + GDN_CHUNK * OUT_LD;
    bf16* sV = sS + GDN_D * OUT_LD;
    bf16* sP = sV + GDN_D * OUT_LDC;
    float* sG = reinterpret_cast<float*>(sP + GDN_CHUNK * OUT_LDC);
    const int c = blockIdx.x, h = blockIdx.y, kh = h / GDN_RATIO;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int nch = p.Tp / GDN_CHUNK;
    const size_t row0 = (size_t)h * p.Tp + (size_t)c * GDN_CHUNK;
    const size_t krow0 = (size_t)kh * p.Tp + (size_t)c * GDN_CHUNK;

    cp_rows<OUT_THREADS, OUT_LD * 2, 4 * GDN_D, GDN_CHUNK>(sQ, p.q + krow0 * 2 * GDN_D);
    cp_rows<OUT_THREADS, OUT_LD * 2, 4 * GDN_D, GDN_CHUNK>(sK, p.k + krow0 * 2 * GDN_D);
    cp_rows<OUT_THREADS, GDN_CHUNK * 4, GDN_CHUNK * 4, 1>(sG, p.gc + row0);
    cp_async_commit();
    cp_rows<OUT_THREADS, OUT_LD * 2, 4 * GDN_D, GDN_D>(sS, p.hs + ((size_t)h * nch + c) * GDN_D * 2 * GDN_D);
    cp_async_commit();
    cp_rows<OUT_THREADS, OUT_LDC * 2, 4 * GDN_CHUNK, GDN_D>(sV, p.vu + row0 * GDN_D);
    cp_async_commit();

    // ---- 1: P
    cp_async_wait<2>();
    __syncthreads();
    for (int b = warp; b < 10; b += 8) {
        const int I = tri_i(b), J = tri_j(b);
        float acc[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < GDN_D / 16; ++ks) {
            u32 ah[4], al[4], bh[4], bl[4];
            lda_split(ah, al, smem_u32(sQ), OUT_LD, GDN_D, 16 * I, 16 * ks);
            ldb_split_nk(bh, bl, smem_u32(sK), OUT_LD, GDN_D, 16 * J, 16 * ks);
            mma3x2(acc, ah, al, bh, bl);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = 16 * I + g + 8 * r, col = 16 * J + 8 * j + 2 * tq;
                const float x0 = col <= i ? acc[j][2 * r] * expf(sG[i] - sG[col]) : 0.f;
                const float x1 = col + 1 <= i ? acc[j][2 * r + 1] * expf(sG[i] - sG[col + 1]) : 0.f;
                u32 hi, lo;
                split2(x0, x1, hi, lo);
                *reinterpret_cast<u32*>(sP + i * OUT_LDC + col) = hi;
                *reinterpret_cast<u32*>(sP + i * OUT_LDC + GDN_CHUNK + col) = lo;
            }
    }

    // ---- 2: diag(e^G) q S0
    const int rb = warp & 3, vc = (warp >> 2) * (GDN_D / 2);
    float acc[GDN_D / 16][4] = {};
    cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < GDN_D / 16; ++ks) {
        u32 ah[4], al[4];
        lda_split(ah, al, smem_u32(sQ), OUT_LD, GDN_D, 16 * rb, 16 * ks);
#pragma unroll
        for (int np = 0; np < GDN_D / 32; ++np) {
            u32 bh[4], bl[4];
            ldb_split_nk(bh, bl, smem_u32(sS), OUT_LD, GDN_D, vc + 16 * np, 16 * ks);
            mma3x2(acc + 2 * np, ah, al, bh, bl);
        }
    }
    const float e0 = expf(sG[16 * rb + g]), e8 = expf(sG[16 * rb + g + 8]);
#pragma unroll
    for (int nt = 0; nt < GDN_D / 16; ++nt) {
        acc[nt][0] *= e0;
        acc[nt][1] *= e0;
        acc[nt][2] *= e8;
        acc[nt][3] *= e8;
    }

    // ---- 3: + P Vn
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < GDN_CHUNK / 16; ++kk) {
        if (kk > rb) continue;
        u32 ah[4], al[4];
        lda_split(ah, al, smem_u32(sP), OUT_LDC, GDN_CHUNK, 16 * rb, 16 * kk);
#pragma unroll
        for (int np = 0; np < GDN_D / 32; ++np) {
            u32 bh[4], bl[4];
            ldb_split_nk(bh, bl, smem_u32(sV), OUT_LDC, GDN_CHUNK, vc + 16 * np, 16 * kk);
            mma3x2(acc + 2 * np, ah, al, bh, bl);
        }
    }
    float* o = p.o + ((size_t)c * GDN_CHUNK + 16 * rb + g) * GDN_VAL + (size_t)h * GDN_D + vc + 2 * tq;
#pragma unroll
    for (int nt = 0; nt < GDN_D / 16; ++nt) {
        *reinterpret_cast<float2*>(o + 8 * nt) = make_float2(acc[nt][0], acc[nt][1]);
        *reinterpret_cast<float2*>(o + 8 * GDN_VAL + 8 * nt) = make_float2(acc[nt][2], acc[nt][3]);
    }
}

// grid (the longest piece's tokens, ceil(GV_HEADS / 8), pieces), block 256:
// warp = one (token, head) of a piece, O row c0 * C + t.
// mix[t][h * D + i] = w[i] * O * rsqrt(mean(O^2) + eps) * silu(z).
struct GdnGatedNormParams {
    GdnPiece pc[GDN_MAX_PIECES];   // proj (for z) and the output rows
    const float* O;        // [Tp][GDN_VAL]
    const float* norm_w;
    int proj_stride;
    float eps;
};
GDN_LAYOUT(GdnGatedNormParams, GDN_GATED_NORM_PARAMS_BYTES);

#ifndef GDN_NORM_HEADS
#error "GDN_NORM_HEADS must be defined by the host (gdn.rs defines)"
#endif
// grid (tokens, ceil(GV_HEADS / GDN_NORM_HEADS), pieces), block 32 *
// GDN_NORM_HEADS: warp w normalises head blockIdx.y * GDN_NORM_HEADS + w.
extern "C" __global__ void __launch_bounds__(32 * GDN_NORM_HEADS)
gdn_gated_norm(const __grid_constant__ GdnGatedNormParams p) {
    const GdnPiece& pc = p.pc[blockIdx.z];
    const float* O = p.O;
    const float* proj = pc.proj;
    const float* norm_w = p.norm_w;
    float* mix_f32 = pc.mix_f32;
    f16* mix_f16 = pc.mix_f16;
    const int proj_stride = p.proj_stride;
    const float eps = p.eps;
    const int t = blockIdx.x, h = blockIdx.y * GDN_NORM_HEADS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (h >= GV_HEADS || t >= pc.T) return;
    const float* o = O + ((size_t)pc.c0 * GDN_CHUNK + t) * GDN_VAL + h * GV_DIM;
    const float* z = proj + (size_t)t * proj_stride + CONV_DIM + h * GV_DIM;
    // Every load of the warp (O, z, the gain) issued before the first use:
    // z and the gain read after the first store were one L2 round trip
    // each (the stores might alias them), three more a warp.
    float v[PREP_PER_LANE], zv[PREP_PER_LANE], nw[PREP_PER_LANE];
#pragma unroll
    for (int j = 0; j < PREP_PER_LANE; ++j) {
        v[j] = o[lane + 32 * j];
        zv[j] = z[lane + 32 * j];
        nw[j] = norm_w[lane + 32 * j];
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < PREP_PER_LANE; ++j) ss += v[j] * v[j];
    ss = warp_sum(ss);
    const float r = rsqrtf(ss / (float)GV_DIM + eps);
#pragma unroll
    for (int j = 0; j < PREP_PER_LANE; ++j) {
        const int i = lane + 32 * j;
        const float y = v[j] * r * nw[j] * siluf_(zv[j]);
        const size_t oi = (size_t)t * GDN_VAL + h * GV_DIM + i;
        if (mix_f32 != nullptr) mix_f32[oi] = y;
        if (mix_f16 != nullptr) mix_f16[oi] = f32_to_f16(y);
    }
}
