// qmm.cu: the decode step's matrix work on tensor cores, for 1 to QMM_MAX_TOK
// tokens, every weight read once per step.
//
// Kernels:
//   xnorm          h[t] (+= sum_s w[t][s] y[t][s], the previous MoE's combine,
//                  in slot order) -> RMSNorm(h[t]) * gain (or no norm) ->
//                  packed activations (below). grid (ntok), block 256.
//   qmm_dense_N    y[t][r] = W[r] . x[t] for every row r of up to QMM_MAX_SEGS
//                  4-bit matrices sharing one packed input; epilogue: store,
//                  residual add, or lm_head logits + greedy argmax keys.
//   qmm_moe_N      (p.up) the MoE gate/up projections of every (token, slot)
//                  pair routed to each active expert (the shared expert is
//                  expert N_EXPERTS, taking every token), SwiGLU fused, packed
//                  out; (!p.up) the down projections of the same pairs ->
//                  y[pair] f32.
//   moe_router     RMSNorm(h) (post-attention norm) -> packed x for the
//                  experts, router logits (8-bit, fp32 math) and the shared
//                  expert gate; the last row block of each 8-token chunk (a
//                  ticket) takes its tokens' top-k, and the last chunk writes
//                  the decode plan.
//   N = NT, the 8-column n-tiles (4 tokens each) a warp keeps accumulators
//   for; more tokens run in chunks (dense) or plan items (MoE) of 4 NT.
//   qmm_dense_f16*: n-tiles of 8 tokens, their fp16 x (hi halves) only,
//   for the decode steps DecodeMatrices::f16_from names (stage_math_groups):
//   one n-tile (up to 8 tokens, or chunks of 8), two (_2: 9-16 tokens).
//
// Packed activations ("px"): an activation row x[K] (f32) is stored as fp16
// hi = fp16(x) and lo = fp16(x - hi), [row][2][K] halves, and within every 8
// consecutive columns in the order 0,4,2,6,1,5,3,7 (px_perm, common.cuh). hi + lo keeps
// about 22 significant bits, so the products below are as exact as the fp32
// GEMV they replace while running on the tensor cores; the permutation makes
// the B fragment of one m16n8k16 step one 8-byte word per lane.
//
// Matrix tile math (one warp, 16 weight rows x one K range, all tokens):
// lane (g = lane / 4, c = lane % 4) holds, per quantisation group of 64
// columns, the 16 codes 16c..16c+15 of row g and of row g+8 (two u32 words
// each). A 4-bit word w gives the fp16 pairs (n0,n4), (n2,n6) (times 2^-24)
// and (n1,n5), (n3,n7) (times 2^-20) exactly as fp16 subnormals, one mask
// each (deq_word); the pairing is why x is permuted. The B columns of an n-tile are
// (token 4*nt + col/2, part col%2): hi and lo of 4 tokens, so after the mma
// lane (g, c) holds hi and lo of token 4*nt + c in c0/c1 (row g) and c2/c3
// (row g+8). Per group:
//   y_g = sum_k q_k x_k            (4 mma over the group, codes exact)
//   acc += scale_g * y_g + bias_g * sum_k x_k
// (acc kept in units of 2^20, the high codes' unit, until the task's end)
// which is the affine dequantisation w = scale * q + bias summed exactly;
// the group sums of x are computed once per token set (xs_load).
//
// Work split: a task is 16 output rows; KQ = K / QMM_SLICE_COLS warps (1..QMM_WARPS)
// share a task, each taking a fixed slice of the groups; their partial sums
// are added in slice order in shared memory. Wide matrices (K >= QMM_WIDE_K,
// the out-projections) split K over QMM_WIDE_KQ warps instead (16: one
// stage each), in blocks of as many warps (the *_wide dense entries): their
// 2,048 rows are only 128 tasks, so 4 slices a task left ~4 warps an SM,
// each a long serial chain. The split depends only on K,
// never on the number of tokens, and every token's column is computed
// independently, so a token's result is bit-identical whatever the batch it
// is decoded in. A block of QMM_WARPS warps runs QMM_WARPS / KQ tasks side by
// side. The B fragments (x) are read from global memory (L1-resident: every
// warp of the SM reads the same rows), the next group's before the current
// group's math; the group sums come with x, written by the packing kernels.
//
// Weight streaming: each warp owns a ring of RING stages in shared memory
// (QMM_RING for the experts, QMM_DENSE_RING for the dense matrices of 1-4
// tokens and of more than 8 (chunks of 8), QMM_DENSE2_RING of 5-8,
// QMM_HEAD_RING for the lm_head from 5),
// filled by 16-byte cp.async copies that bypass L1 (swizzled so the 8-byte
// fragment reads are conflict-free); it keeps RING - 1 stages in flight
// across task boundaries, its copy sources computed once per task. Dense
// matrices are known before the previous kernel ends: their first stages
// are requested before griddepcontrol.wait (programmatic dependent launch),
// so a kernel's weight loads overlap the tail of the kernel before it.
//
// Stage layout (QMM_STAGE_BYTES = 2304, QMM_SG = 4 groups): codes of row r
// (0..15) at r * 128, its groups' 32-byte blocks swizzled (code_off); then
// the scales (row r: its 4 groups as bf16, 8 bytes at 2048 + r * 8) and the
// biases (at 2176 + r * 8).
//
// Measured (H200, qmm_probe, one launch of the lm_head, 286 MB, batch 1):
// v1 (8-byte copies, x fetched per group, an all-ones mma for the sums)
// 1.2 TB/s; v2 (x slices in shared memory, one 8-warp block a
// multiprocessor) 0.8 TB/s, issue-bound at 8 warps; v3 (this: 4-warp blocks,
// 4-group stages, sums from the packer) 2.06 TB/s, and 4.1 TB/s with the
// math left out (QMM_PROBE_NO_MATH): the arithmetic, not the memory side,
// is what limits it now.

#if !defined(QMM_RING) || !defined(QMM_DENSE_RING) || !defined(QMM_DENSE2_RING) || !defined(QMM_HEAD_RING) || !defined(QMM_ONE_TOKEN_RING) || !defined(QMM_WARPS) || !defined(QMM_SG) || !defined(QMM_STAGE_BYTES) || !defined(QMM_SLICE_COLS) || !defined(QMM_WIDE_K) || !defined(QMM_WIDE_KQ) || !defined(QMM_WIDE_RING)
#error "QMM_RING, QMM_DENSE_RING, QMM_DENSE2_RING, QMM_HEAD_RING, QMM_ONE_TOKEN_RING, QMM_WARPS, QMM_SG, QMM_STAGE_BYTES, QMM_SLICE_COLS, QMM_WIDE_K, QMM_WIDE_KQ and QMM_WIDE_RING must be defined by the host (qmm.rs)"
#endif
static_assert(QMM_WIDE_KQ > QMM_WARPS && QMM_WIDE_KQ <= 16 && QMM_WIDE_K % (QMM_WIDE_KQ * QMM_SG * 64) == 0,
              "qmm.rs QMM_WIDE_KQ: more slices than a block of QMM_WARPS holds, at most 16 warps, whole stages each");
// QMM_PROBE_NO_MATH (speed probes only): the weights stream through the ring
// but no math runs, which separates the memory side from the arithmetic.
// Finer probes of the stage math (speed probes only, wrong values): with
// QMM_PROBE_NO_X the x fragments are lane constants instead of loads (and
// the group sums zeros), QMM_PROBE_NO_DEQ feeds the raw code words to the
// mma instead of deq_word's masks, QMM_PROBE_NO_FOLD adds the mma sums
// straight into acc instead of the affine fold (the hi/lo entries); each
// leaves the rest of the stage as it is, so the time it saves is that
// part's share.
#ifdef QMM_PROBE_NO_X
#define QMM_X_LOADS false
#else
#define QMM_X_LOADS true
#endif
// A stage: 16 rows x QMM_SG = 4 groups of codes, then their scales and
// biases (the fragment and swizzle math below is written for 4 groups).
static_assert(QMM_SG == 4 && QMM_STAGE_BYTES == 16 * QMM_SG * 32 + 2 * 16 * QMM_SG * 2, "qmm.rs stage constants");
#define MOE_SLOTS (TOPK + 1)
#if !defined(ROUTER_ROWS) || !defined(ROUTER_TOK) || !defined(XN_THREADS)
#error "ROUTER_ROWS, ROUTER_TOK and XN_THREADS must be defined by the host (qmm.rs defines)"
#endif
static_assert(ROUTER_ROWS * 32 == 256 && ROUTER_TOK <= ROUTER_ROWS,
              "qmm.rs ROUTER_ROWS / ROUTER_TOK: moe_router is 256 threads, a warp a row, and its last block a warp a staged token");
#define ROUTER_ITS ((HIDDEN / 16 + 31) / 32)

// ---- packed activations ------------------------------------------------------

// hi/lo fp16 halves of v (saturated to the fp16 range).
__device__ __forceinline__ void px_split(float v, u16& hi, u16& lo) {
    hi = f32_to_f16(v);
    lo = f32_to_f16(v - f16_to_f32(hi));
}

// Writes one value at column `col` of packed row `row` (K columns).
__device__ __forceinline__ void px_store1(u16* px, long long row, int K, int col, float v) {
    u16 hi, lo;
    px_split(v, hi, lo);
    u16* r = px + row * 2 * K + (col & ~7) + px_perm(col & 7);
    r[0] = hi;
    r[K] = lo;
}

// Writes 8 consecutive values starting at column c8 (a multiple of 8) and
// returns the sum of their stored hi + lo (the group sums the matrix
// kernels need are sums of 8 such calls, in column order).
__device__ __forceinline__ float px_store8(u16* px, long long row, int K, int c8, const float* v) {
    u16 hi[8], lo[8];
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        px_split(v[j], hi[px_perm(j)], lo[px_perm(j)]);
        sum += f16_to_f32(hi[px_perm(j)]) + f16_to_f32(lo[px_perm(j)]);
    }
    uint4 H, L;
    H.x = hi[0] | ((u32)hi[1] << 16);
    H.y = hi[2] | ((u32)hi[3] << 16);
    H.z = hi[4] | ((u32)hi[5] << 16);
    H.w = hi[6] | ((u32)hi[7] << 16);
    L.x = lo[0] | ((u32)lo[1] << 16);
    L.y = lo[2] | ((u32)lo[3] << 16);
    L.z = lo[4] | ((u32)lo[5] << 16);
    L.w = lo[6] | ((u32)lo[7] << 16);
    u16* r = px + row * 2 * K + c8;
    *reinterpret_cast<uint4*>(r) = H;
    *reinterpret_cast<uint4*>(r + K) = L;
    return sum;
}

// Group sums: lanes 8j..8j+7 of a warp hold the 8-column sums of one
// group of 64 columns in order; the first of them gets the total (fixed
// order, so a row's sums never depend on the batch).
__device__ __forceinline__ float group_sum8(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    v += __shfl_xor_sync(FULL_MASK, v, 2);
    v += __shfl_xor_sync(FULL_MASK, v, 4);
    return v;
}

// ---- xnorm -----------------------------------------------------------------

struct XnormParams {
    float* h;               // [ntok][cols] f32; combined in place when y != null
    const float* y;         // [ntok * MOE_SLOTS][cols] expert outputs, or null
    const float* topk_w;    // [ntok][MOE_SLOTS]
    const float* gain;      // RMSNorm gain [cols], or null: pack x as it is
    u16* px;                // [ntok][2][cols]
    float* csum;            // [ntok][cols / 64] group sums of the packed values
    const float* gain16;    // with xn16: the RMSNorm gain of the fp16 output
    f16* xn16;              // [ntok][HIDDEN] fp16 RMSNorm(h) * gain16 instead of
                            // the packed rows (the GEMM path's next input), or null
    int cols;
    float eps;
};
LAYOUT_CHECK(XnormParams, XNORM_PARAMS_SIZE)

#define XN_ITS ((XN_MAX_COLS / 8 + XN_THREADS - 1) / XN_THREADS)

// grid (ntok), block XN_THREADS; thread i owns the 8-column blocks i, i+256...
// With xn16 (cols = HIDDEN): after the combine, the row goes through
// shared memory into rmsnorm_row_f16, so xn16 has rmsnorm_f16's bits
// (XN_THREADS = RMSNORM_THREADS, qmm.rs checks), and nothing is packed.
extern "C" __global__ void __launch_bounds__(XN_THREADS) xnorm(const __grid_constant__ XnormParams p) {
    __shared__ float red[32];
    __shared__ __align__(16) float srow[HIDDEN];
    pdl_trigger();
    const int t = blockIdx.x, cols = p.cols;
    // The norm gains (weights, never written by the step) before the
    // dependency wait: read after the block reduction, a gain's DRAM round
    // trip sat on every layer's chain. The packing norm's own columns into
    // registers; the fused fp16 norm's row (read by rmsnorm_row_f16 in its
    // own thread mapping) into L2.
    float gn[XN_ITS][8];
#pragma unroll
    for (int it = 0; it < XN_ITS; ++it) {
        const int c8 = (threadIdx.x + it * XN_THREADS) * 8;
        if (p.gain != nullptr && c8 < cols) {
            const float4 a = *reinterpret_cast<const float4*>(p.gain + c8);
            const float4 b = *reinterpret_cast<const float4*>(p.gain + c8 + 4);
            gn[it][0] = a.x; gn[it][1] = a.y; gn[it][2] = a.z; gn[it][3] = a.w;
            gn[it][4] = b.x; gn[it][5] = b.y; gn[it][6] = b.z; gn[it][7] = b.w;
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) gn[it][j] = 0.f;
        }
    }
    if (p.gain16 != nullptr && threadIdx.x * 32 < HIDDEN) l2_prefetch(p.gain16 + threadIdx.x * 32);
    pdl_wait();
    float* hr = p.h + (size_t)t * cols;
    float v[XN_ITS][8];
    float w[MOE_SLOTS];
    if (p.y != nullptr) {
#pragma unroll
        for (int s = 0; s < MOE_SLOTS; ++s) w[s] = p.topk_w[t * MOE_SLOTS + s];
    }
    float ss = 0.f;
#pragma unroll
    for (int it = 0; it < XN_ITS; ++it) {
        const int c8 = (threadIdx.x + it * XN_THREADS) * 8;
        if (c8 >= cols) break;
        const float4 a = *reinterpret_cast<const float4*>(hr + c8);
        const float4 b = *reinterpret_cast<const float4*>(hr + c8 + 4);
        float* x = v[it];
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
        x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
        if (p.y != nullptr) {
            // h += sum_s w_s y_s, the slots in a fixed order (deterministic).
            float add[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int s = 0; s < MOE_SLOTS; ++s) {
                const float* yr = p.y + ((size_t)t * MOE_SLOTS + s) * cols + c8;
                const float4 ya = *reinterpret_cast<const float4*>(yr);
                const float4 yb = *reinterpret_cast<const float4*>(yr + 4);
                add[0] = fmaf(w[s], ya.x, add[0]);
                add[1] = fmaf(w[s], ya.y, add[1]);
                add[2] = fmaf(w[s], ya.z, add[2]);
                add[3] = fmaf(w[s], ya.w, add[3]);
                add[4] = fmaf(w[s], yb.x, add[4]);
                add[5] = fmaf(w[s], yb.y, add[5]);
                add[6] = fmaf(w[s], yb.z, add[6]);
                add[7] = fmaf(w[s], yb.w, add[7]);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) x[j] += add[j];
            *reinterpret_cast<float4*>(hr + c8) = make_float4(x[0], x[1], x[2], x[3]);
            *reinterpret_cast<float4*>(hr + c8 + 4) = make_float4(x[4], x[5], x[6], x[7]);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) ss = fmaf(x[j], x[j], ss);
        if (p.xn16 != nullptr) {
            *reinterpret_cast<float4*>(srow + c8) = make_float4(x[0], x[1], x[2], x[3]);
            *reinterpret_cast<float4*>(srow + c8 + 4) = make_float4(x[4], x[5], x[6], x[7]);
        }
    }
    if (p.xn16 != nullptr) {
        __syncthreads();
        rmsnorm_row_f16<HIDDEN, XN_THREADS>(srow, p.gain16, p.xn16 + (size_t)t * HIDDEN, p.eps, red);
        return;
    }
    float r = 1.f;
    if (p.gain != nullptr) r = rsqrtf(block_sum(ss, red) / (float)cols + p.eps);
#pragma unroll
    for (int it = 0; it < XN_ITS; ++it) {
        // Uniform per warp (cols is a multiple of 64), so the shuffles of
        // the group sums see whole groups.
        const int c8 = (threadIdx.x + it * XN_THREADS) * 8;
        if (c8 - (threadIdx.x & 31) * 8 >= cols) break;
        float part = 0.f;
        if (c8 < cols) {
            float o[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) o[j] = p.gain != nullptr ? v[it][j] * r * gn[it][j] : v[it][j];
            part = px_store8(p.px, t, cols, c8, o);
        }
        const float gs = group_sum8(part);
        if (c8 < cols && (threadIdx.x & 7) == 0) p.csum[(size_t)t * (cols / GROUP_SIZE) + c8 / GROUP_SIZE] = gs;
    }
}

// ---- the tensor-core matrix engine -------------------------------------------

// Exact 4-bit codes as fp16 subnormals: an fp16 with a zero exponent field
// is its 10-bit mantissa m times 2^-24, so masking a word of codes n0..n7
// (n_i at bits 4i) leaves codes in the mantissas with nothing to subtract:
// w & 0x000F000F is (n0, n4) * 2^-24 and w & 0x00F000F0 is (n1, n5) * 2^-20;
// the same on w >> 8 gives (n2, n6) and (n3, n7). Five instructions a word
// where 1024 + n (lop3 with 0x6400) then a subtract took nine. The tensor
// cores take fp16 subnormals exactly (the packed x's lo halves are often
// subnormal too), and every product n x 2^-24 is an exact fp32 value, so the
// sums have the same precision as on the integer codes, scaled by a power of
// two. p[0..1]: (n0,n4), (n2,n6) at 2^-24; p[2..3]: (n1,n5), (n3,n7) at 2^-20.
#define QMM_SUM_SCALE 1048576.f   // 2^20: the unit of acc and of the folded sums
__device__ __forceinline__ void deq_word(u32 w, u32 (&p)[4]) {
#ifdef QMM_PROBE_NO_DEQ
    p[0] = p[2] = w;
    p[1] = p[3] = w ^ 0x11111111u;
    return;
#endif
    const u32 w8 = w >> 8;
    p[0] = w & 0x000F000Fu;
    p[1] = w8 & 0x000F000Fu;
    p[2] = w & 0x00F000F0u;
    p[3] = w8 & 0x00F000F0u;
}

__device__ __forceinline__ uint2 lds64(const void* p) {
    uint2 r;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(smem_u32(p)));
    return r;
}

// A 16-byte read of data an earlier kernel wrote (not volatile: the
// compiler may issue several before their first use).
__device__ __forceinline__ uint4 ldg128(const void* p) {
    uint4 r;
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ float ldg_f32(const float* p) {
    float r;
    asm("ld.global.nc.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}

// The weights of one task: mma rows 0-7 come from half 0, rows 8-15 from half
// 1 (the two halves of a dense 16-row tile, or the gate and up rows of a
// SwiGLU tile). Pointers are at the half's first row; n = valid rows (0..8).
struct QTask {
    const u32* codes[2];
    const bf16* scales[2];
    const bf16* biases[2];
    int n[2];
};

// Geometry of the K split, from K alone (so a token's result never depends
// on the batch): KQ = K / QMM_SLICE_COLS warps share a task (1 to
// QMM_WARPS), warp q taking the groups from q * GQ, GQ a multiple of the
// stage's QMM_SG groups.
struct KSplit {
    int K, G, KQ, GQ, SQ, wpr;
    __device__ KSplit(int k) : K(k) {
        G = k / GROUP_SIZE;
        KQ = k >= QMM_WIDE_K ? QMM_WIDE_KQ : min(QMM_WARPS, max(1, k / QMM_SLICE_COLS));
        GQ = QMM_SG * ((G + QMM_SG * KQ - 1) / (QMM_SG * KQ));
        SQ = GQ / QMM_SG;
        wpr = k / 8;
    }
};

// Stage layout (QMM_STAGE_BYTES = 2304): codes of row r (0..15) at r * 128,
// its groups' 32-byte blocks swizzled: group grp at ((grp ^ (r & 3)) << 5),
// so the 8-byte fragment reads of a half warp (rows g..g+3) hit distinct
// banks; then at 2048 the scales (row r: 4 groups as bf16, 8 bytes at r * 8)
// and at 2176 the biases.
#define QMM_STAGE_CODES 2048
__device__ __forceinline__ int code_off(int r, int grp) { return r * 128 + ((grp ^ (r & 3)) << 5); }

// The lane's share of a task's stage copies: four 16-byte code pieces and
// one 8-byte scale or bias piece, each a source at the stage the warp
// requests next (set at the warp slice's first group once per task, then
// advanced a stage per request: qmm_produce), and whether it exists (`ok`:
// bit i piece i, bit 4 the scale/bias row; a row past the matrix points at
// the half's first row, so it stays inside the matrix, and copies zeros).
struct StageSrc {
    const u32* code[4];
    const bf16* sb;
    u32 ok;
};

// Piece i (0..3) of lane l: 16 bytes of row r = (l + 32 i) >> 3, group
// grp = ((l + 32 i) >> 1) & 3 of the stage, half h = l & 1.
__device__ __forceinline__ StageSrc stage_src(const QTask& tk, bool valid, const KSplit& ks, int q, int lane) {
    StageSrc src;
    src.ok = 0;
    const int G0 = q * ks.GQ;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int pc = lane + 32 * i;
        const int r = pc >> 3, grp = (pc >> 1) & 3, h = pc & 1;
        const int hr = r >> 3, gr = r & 7;
        const int nh = hr ? tk.n[1] : tk.n[0];
        const u32* base = hr ? tk.codes[1] : tk.codes[0];
        const bool ok = valid && gr < nh;
        src.code[i] = base + (ok ? (size_t)gr * ks.wpr : 0) + (G0 + grp) * 8 + h * 4;
        src.ok |= (u32)ok << i;
    }
    const int kind = lane >> 4, r = lane & 15, h = r >> 3, g = r & 7;
    const bf16* base = kind ? (h ? tk.biases[1] : tk.biases[0]) : (h ? tk.scales[1] : tk.scales[0]);
    const bool sb_ok = valid && g < (h ? tk.n[1] : tk.n[0]);
    src.sb = base + (sb_ok ? (size_t)g * ks.G : 0) + G0;
    src.ok |= (u32)sb_ok << 4;
    return src;
}

// The byte offset in a stage of lane `lane`'s code piece 0 (piece i is 512 i
// further: its row is 4 i further, with the same swizzle, code_off).
__device__ __forceinline__ u32 stage_piece_off(int lane) { return code_off(lane >> 3, (lane >> 1) & 3) + (lane & 1) * 16; }

// Issues the cp.async pieces of stage `s` from `src` (at that stage) into
// the stage at shared address `st` (always commits one group, possibly
// empty). Codes: 16-byte copies that bypass L1; scales and biases: 8-byte
// copies (2-byte plain loads when a row's groups are not a multiple of 4,
// so its scales are not 8-byte aligned). A full stage (every production
// shape: K / 64 groups split evenly) takes the short path: fixed offsets
// from the stage's address and predicated copies, the sources as they are.
// `piece_off`: stage_piece_off(lane).
__device__ __forceinline__ void stage_load(u32 st, const StageSrc& src, const KSplit& ks, int q, int s, int lane, u32 piece_off,
                                           const void* any) {
    const int G0 = q * ks.GQ + QMM_SG * s;
    const int left = min((q + 1) * ks.GQ, ks.G) - G0;  // groups of this stage in the slice
    const u32 dst = st + QMM_STAGE_CODES + (lane >> 4) * 128 + (lane & 15) * 8;
    if (left >= QMM_SG && (ks.G & 3) == 0) {
        const u32 d = st + piece_off;
#pragma unroll
        for (int i = 0; i < 4; ++i) cp_async16_or_zero(d + 512 * i, src.code[i], src.ok & (1u << i));
        cp_async8_or_zero(dst, src.sb, src.ok & 16u);
    } else if (left > 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int pc = lane + 32 * i;
            const int r = pc >> 3, grp = (pc >> 1) & 3, h = pc & 1;
            const bool ok = ((src.ok >> i) & 1) && grp < left;
            cp_async16_or_zero(st + code_off(r, grp) + h * 16, ok ? (const void*)src.code[i] : any, (u32)ok);
        }
        const int have = ((src.ok >> 4) & 1) ? min(QMM_SG, left) : 0;
        const bf16* sp = src.sb;
        if ((ks.G & 3) == 0) {
            cp_async8_bytes(dst, have > 0 ? (const void*)sp : any, have * 2);
        } else {
            u32 v0 = 0, v1 = 0;
            if (have > 0) v0 = ld_nc_u16(sp);
            if (have > 1) v0 |= (u32)ld_nc_u16(sp + 1) << 16;
            if (have > 2) v1 = ld_nc_u16(sp + 2);
            if (have > 3) v1 |= (u32)ld_nc_u16(sp + 3) << 16;
            st_shared_v2(dst, v0, v1);
        }
    }
    cp_async_commit();
}

// One stage's math: up to QMM_SG groups, NT n-tiles of tokens (cnt valid,
// cnt >= 1). xoff[nt]: the lane's B column (token 4 nt + g / 2, part g % 2)
// as an offset into x, or -1; csoff[nt]: the row offset of its C token's
// group sums (token 4 nt + c), or -1. CSUM_MMA: no sums were given, they
// come from an all-ones mma. FULL: the stage holds all QMM_SG groups (every
// production shape), so the group loop has no data-dependent exits (no
// per-group compare, branch and warp re-convergence before the mma).
//
// F16 (the dense matrices of steps of up to 16 tokens, from
// DecodeMatrices::f16_from; the experts from Options::moe_f16_from):
// the B columns are 8 tokens' hi halves only (token 8 nt + g, x's fp16
// value), so 8 tokens share one n-tile's mma, x fragments and fold where
// hi/lo needs two. Lane (g, c) then holds rows g and g + 8 of tokens
// 8 nt + 2c (c0, c2) and 8 nt + 2c + 1 (c1, c3): acc[nt][0..3] = (g, 2c),
// (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1), and csoff[nt] / csoff2[nt] the
// two tokens' group sums. The codes are exact as on the hi/lo path; x is
// rounded to fp16 once (the GEMM path's precision of x, which from
// DECODE_GEMM_FROM also rounds the weights), and the bias term keeps the
// packed sum of hi + lo, so only the scale term loses the lo half. With
// CSUM_MMA (no packer sums: the experts' down projections) the sums come
// from an all-ones mma over the same B fragments, i.e. of the hi halves.
//
// A lane whose B column is no token (xoff -1) reads its fragments from x's
// row 0 instead of zero-filling them: an mma's column n of C depends only on
// column n of B, and such columns' sums are never used (the epilogue writes
// tokens j < cnt only), so the valid columns' bits are unchanged and each
// group's x read is one address (a stage pointer plus a constant offset).
// Accumulators a lane keeps per n-tile: 2 (hi/lo columns), 4 (F16 columns).
#define QMM_ACC(F16) ((F16) ? 4 : 2)

// cs4[nt][k] = the group sums of group G0 + k (k < n) of the token whose
// sums start at csum + csoff[nt] (0 where csoff[nt] < 0 or CSUM_MMA), in
// acc's unit.
template <int NT, bool CSUM_MMA>
__device__ __forceinline__ void stage_sums(const float* csum, const KSplit& ks, int G0, int n, const int (&csoff)[NT], float (&cs4)[NT][QMM_SG]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int k = 0; k < QMM_SG; ++k) cs4[nt][k] = 0.f;
        if (QMM_X_LOADS && !CSUM_MMA && csoff[nt] >= 0) {
            const float* cp = csum + csoff[nt] + G0;
            if ((ks.G & 3) == 0 && n == QMM_SG) {
                const uint4 v = ldg128(cp);
                cs4[nt][0] = __uint_as_float(v.x);
                cs4[nt][1] = __uint_as_float(v.y);
                cs4[nt][2] = __uint_as_float(v.z);
                cs4[nt][3] = __uint_as_float(v.w);
            } else {
#pragma unroll
                for (int k = 0; k < QMM_SG; ++k)
                    if (k < n) cs4[nt][k] = ldg_f32(cp + k);
            }
            // In acc's unit (2^20): exact, a power of two.
#pragma unroll
            for (int k = 0; k < QMM_SG; ++k) cs4[nt][k] = __fmul_rn(cs4[nt][k], 1.f / QMM_SUM_SCALE);
        }
    }
}

template <int NT, bool CSUM_MMA, bool FULL, bool F16>
__device__ __forceinline__ void stage_math_groups(const unsigned char* st, const u16* x, const float* csum, const KSplit& ks, int q,
                                                  int s, int lane, int cnt, const int (&xoff)[NT], const int (&csoff)[NT],
                                                  const int (&csoff2)[NT], float (&acc)[NT][QMM_ACC(F16)], int ng) {
    constexpr int TPN = F16 ? 8 : 4;   // tokens an n-tile
    const int g = lane >> 2, c = lane & 3;
    const int G0 = q * ks.GQ + QMM_SG * s;
    const int n = FULL ? QMM_SG : ng;
    const uint2 sA4 = lds64(st + QMM_STAGE_CODES + g * 8), sB4 = lds64(st + QMM_STAGE_CODES + (g + 8) * 8);
    const uint2 bA4 = lds64(st + QMM_STAGE_CODES + 128 + g * 8), bB4 = lds64(st + QMM_STAGE_CODES + 128 + (g + 8) * 8);
    // The C token's group sums of the stage's groups, one read per stage
    // (F16: cs4b, the lane's second token's).
    float cs4[NT][QMM_SG];
    stage_sums<NT, CSUM_MMA>(csum, ks, G0, n, csoff, cs4);
    float cs4b[NT][QMM_SG];
    if constexpr (F16) stage_sums<NT, CSUM_MMA>(csum, ks, G0, n, csoff2, cs4b);
    // The lane's x of this stage's first group, per n-tile.
    const u16* xs[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xs[nt] = x + (xoff[nt] >= 0 ? xoff[nt] : 0) + G0 * GROUP_SIZE + 16 * c;
    uint4 b01[NT], b23[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#ifdef QMM_PROBE_NO_X
        b01[nt] = make_uint4(lane, lane + 1, lane + 2, lane + 3);
        b23[nt] = make_uint4(lane + 4, lane + 5, lane + 6, lane + 7);
#else
        b01[nt] = ldg128(xs[nt]);
        b23[nt] = ldg128(xs[nt] + 8);
#endif
    }
#pragma unroll
    for (int grp = 0; grp < QMM_SG; ++grp) {
        if (!FULL && grp >= n) break;
        // The next group's x is requested before this group's math.
        uint4 n01[NT], n23[NT];
        const bool more = FULL ? grp + 1 < QMM_SG : grp + 1 < n;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if (more) {
#ifdef QMM_PROBE_NO_X
                n01[nt] = make_uint4(b01[nt].y, b01[nt].z, b01[nt].w, b01[nt].x + grp);
                n23[nt] = make_uint4(b23[nt].y, b23[nt].z, b23[nt].w, b23[nt].x + grp);
#else
                n01[nt] = ldg128(xs[nt] + (grp + 1) * GROUP_SIZE);
                n23[nt] = ldg128(xs[nt] + (grp + 1) * GROUP_SIZE + 8);
#endif
            } else {
                n01[nt] = b01[nt];
                n23[nt] = b23[nt];
            }
        }
        const uint2 wr = lds64(st + code_off(g, grp) + c * 8);
        const uint2 wh = lds64(st + code_off(g + 8, grp) + c * 8);
        const u32 sAw = grp < 2 ? sA4.x : sA4.y, sBw = grp < 2 ? sB4.x : sB4.y;
        const u32 bAw = grp < 2 ? bA4.x : bA4.y, bBw = grp < 2 ? bB4.x : bB4.y;
        const float sA = (grp & 1) ? bf16hi(sAw) : bf16lo(sAw), sB = (grp & 1) ? bf16hi(sBw) : bf16lo(sBw);
        const float bA = (grp & 1) ? bf16hi(bAw) : bf16lo(bAw), bB = (grp & 1) ? bf16hi(bBw) : bf16lo(bBw);
        u32 pr0[4], pr1[4], ph0[4], ph1[4];
        deq_word(wr.x, pr0);
        deq_word(wh.x, ph0);
        deq_word(wr.y, pr1);
        deq_word(wh.y, ph1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if (nt > 0 && nt * TPN >= cnt) break;
            // Two independent mma chains: d the low-nibble codes (2^-24),
            // e the high ones (2^-20). px_perm puts columns (0,4), (2,6),
            // (1,5), (3,7) of 8 in b.x, .y, .z, .w: deq_word's p[0..3], so
            // each chain's B pair is two adjacent registers (no moves).
            float d[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};
            mma_f16(d, pr0[0], ph0[0], pr0[1], ph0[1], b01[nt].x, b01[nt].y);
            mma_f16(e, pr0[2], ph0[2], pr0[3], ph0[3], b01[nt].z, b01[nt].w);
            mma_f16(d, pr1[0], ph1[0], pr1[1], ph1[1], b23[nt].x, b23[nt].y);
            mma_f16(e, pr1[2], ph1[2], pr1[3], ph1[3], b23[nt].z, b23[nt].w);
            if constexpr (F16) {
                // Four outputs: rows g / g + 8 of tokens 2c / 2c + 1, each
                // y / 2^20 = 16 (low sums) + (high sums).
                const float y0 = __fmaf_rn(d[0], 16.f, e[0]), y1 = __fmaf_rn(d[1], 16.f, e[1]);
                const float y2 = __fmaf_rn(d[2], 16.f, e[2]), y3 = __fmaf_rn(d[3], 16.f, e[3]);
                float c0, c1;
                if constexpr (CSUM_MMA) {
                    // The two C tokens' group sums from an all-ones A (2^-20
                    // each, so in acc's unit): row g's columns 2c and 2c + 1.
                    const u32 ONE2 = 0x00100010u;
                    float f[4] = {0.f, 0.f, 0.f, 0.f};
                    mma_f16(f, ONE2, ONE2, ONE2, ONE2, b01[nt].x, b01[nt].y);
                    mma_f16(f, ONE2, ONE2, ONE2, ONE2, b01[nt].z, b01[nt].w);
                    mma_f16(f, ONE2, ONE2, ONE2, ONE2, b23[nt].x, b23[nt].y);
                    mma_f16(f, ONE2, ONE2, ONE2, ONE2, b23[nt].z, b23[nt].w);
                    c0 = f[0];
                    c1 = f[1];
                } else {
                    c0 = cs4[nt][grp];
                    c1 = cs4b[nt][grp];
                }
                // Two fused steps an output, acc + b sum, then + s y: one
                // instruction an output fewer than a product, a fused step
                // and an add, and one rounding fewer (NOTES history 206).
                acc[nt][0] = __fmaf_rn(sA, y0, __fmaf_rn(bA, c0, acc[nt][0]));
                acc[nt][1] = __fmaf_rn(sA, y1, __fmaf_rn(bA, c1, acc[nt][1]));
                acc[nt][2] = __fmaf_rn(sB, y2, __fmaf_rn(bB, c0, acc[nt][2]));
                acc[nt][3] = __fmaf_rn(sB, y3, __fmaf_rn(bB, c1, acc[nt][3]));
            } else {
#ifdef QMM_PROBE_NO_FOLD
                acc[nt][0] += d[0] + e[1];
                acc[nt][1] += d[2] + e[3];
                continue;
#endif
                float cs;
                if (CSUM_MMA) {
                    // 2^-20 (an fp16 subnormal): the sums come out in acc's unit.
                    const u32 ONE2 = 0x00100010u;
                    float f[4] = {0.f, 0.f, 0.f, 0.f};
                    mma_f16(f, ONE2, ONE2, ONE2, ONE2, b01[nt].x, b01[nt].y);
                    mma_f16(f, ONE2, ONE2, ONE2, ONE2, b01[nt].z, b01[nt].w);
                    mma_f16(f, ONE2, ONE2, ONE2, ONE2, b23[nt].x, b23[nt].y);
                    mma_f16(f, ONE2, ONE2, ONE2, ONE2, b23[nt].z, b23[nt].w);
                    cs = __fadd_rn(f[0], f[1]);
                } else {
                    cs = cs4[nt][grp];
                }
                // y / 2^20 = 16 (low sums) + (high sums): hi and lo of the token
                // added first, as before.
                const float yA = __fmaf_rn(__fadd_rn(d[0], d[1]), 16.f, __fadd_rn(e[0], e[1]));
                const float yB = __fmaf_rn(__fadd_rn(d[2], d[3]), 16.f, __fadd_rn(e[2], e[3]));
                acc[nt][0] = __fadd_rn(acc[nt][0], __fmaf_rn(sA, yA, __fmul_rn(bA, cs)));
                acc[nt][1] = __fadd_rn(acc[nt][1], __fmaf_rn(sB, yB, __fmul_rn(bB, cs)));
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            b01[nt] = n01[nt];
            b23[nt] = n23[nt];
        }
    }
}

template <int NT, bool CSUM_MMA, bool F16>
__device__ __forceinline__ void stage_math(const unsigned char* st, const u16* x, const float* csum, const KSplit& ks, int q,
                                           int s, int lane, int cnt, const int (&xoff)[NT], const int (&csoff)[NT],
                                           const int (&csoff2)[NT], float (&acc)[NT][QMM_ACC(F16)]) {
    const int G0 = q * ks.GQ + QMM_SG * s;
    const int ng = min(QMM_SG, min((q + 1) * ks.GQ, ks.G) - G0);
    if (ng == QMM_SG) stage_math_groups<NT, CSUM_MMA, true, F16>(st, x, csum, ks, q, s, lane, cnt, xoff, csoff, csoff2, acc, ng);
    else stage_math_groups<NT, CSUM_MMA, false, F16>(st, x, csum, ks, q, s, lane, cnt, xoff, csoff, csoff2, acc, ng);
}

// Producer side of the ring: the warp's next stage z (block iteration
// pc.it, stage pc.s of its slice), or an empty commit past the end; the copy
// sources are recomputed only when the task changes. The position advances
// by counting (no division: this runs once a stage).
struct ProdCursor {
    int z, it, s;   // next stage to request: index, block iteration, stage of the slice
    int ti;         // task whose sources psrc holds (-1: none yet)
    StageSrc src;
};

template <int RING, class Job>
__device__ __forceinline__ void qmm_produce(const Job& job, u32 ring, const KSplit& ks, int zmax, int tpb, int mt, int q,
                                            int lane, u32 piece_off, int ntasks, const u16* any, ProdCursor& pc) {
    if (pc.z < zmax) {
        if (pc.s == 0) {
            const int tz = ((int)blockIdx.x + pc.it * (int)gridDim.x) * tpb + mt;
            if (tz != pc.ti) {
                pc.ti = tz;
                bool v = false;
                const QTask tk = job.task(job.pos(tz), v);
                pc.src = stage_src(tk, v && tz < ntasks, ks, q, lane);
            }
        }
        stage_load(ring + (pc.z % RING) * QMM_STAGE_BYTES, pc.src, ks, q, pc.s, lane, piece_off, any);
        // The sources of the slice's next stage.
#pragma unroll
        for (int i = 0; i < 4; ++i) pc.src.code[i] += QMM_SG * 8;
        pc.src.sb += QMM_SG;
        if (++pc.s == ks.SQ) {
            pc.s = 0;
            ++pc.it;
        }
    } else {
        cp_async_commit();
    }
    ++pc.z;
}


// The finished sums of an F16 task (dense and MoE jobs) to the job's
// epilogue_at, a call per C token of the lane: tokens j = 8 nt + 2c (rows
// g, g + 8 in acc[nt][0], [2]) and 8 nt + 2c + 1 ([1], [3]). Every lane
// calls each epilogue (they shuffle). (The hi/lo path calls epilogue(pos,
// nt, ...) in line: through this helper the accumulators' reference made
// qmm_moe_1 spill.)
template <int NT, class Job>
__device__ __forceinline__ void qmm_epilogues_f16(Job& job, const typename Job::Pos& tp, int lane, const float (&acc)[NT][QMM_ACC(true)], int cnt) {
    const int c = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        job.epilogue_at(tp, nt * 8 + 2 * c, lane, acc[nt][0], acc[nt][2], cnt);
        job.epilogue_at(tp, nt * 8 + 2 * c + 1, lane, acc[nt][1], acc[nt][3], cnt);
    }
}

// Where a matrix kernel waits for its dependency (programmatic dependent
// launch) relative to its first weight stages and to letting the next
// kernel launch:
//   StagesBeforeWait  trigger, plan the tasks and request the ring's first
//                     stages, then wait: the weights are known before the
//                     previous kernel ends (dense matrices; the experts'
//                     down projections, whose plan the router wrote two
//                     kernels back);
//   WaitThenTrigger   wait, then trigger: the next kernel launches only
//                     once this one's dependency is complete (the experts'
//                     gate/up, so the down kernel may read the plan early);
//   None              inside a kernel that already waited (qmm_moe_fused).
enum class QmmPdl { StagesBeforeWait, WaitThenTrigger, None };

// The driver loop shared by every matrix kernel, QMM_WARPS warps a block.
// `Job` provides: prepare() (after the dependency wait when the tasks need
// it), ntasks(), pos(i) -> Job::Pos (task i decoded once, so the divisions
// run once a task, not once a call), task(pos, &valid) -> QTask, count(pos)
// (tokens of the task), xrow(pos, j) (the packed x row of its token j; its
// group sums are row xrow of `csum`, K / 64 wide), epilogue(pos, nt, lane,
// v0, v1, count): called by every lane of the slice-0 warp for each n-tile
// with the finished sums of rows g and g + 8 for token 4 nt + c (with F16,
// epilogue_at(pos, j, ...) for each of its tokens j: qmm_epilogues_f16), and
// finish().
// F16: the n-tiles' B columns are 8 tokens' fp16 x (stage_math_groups):
// the dense matrices of small steps, and the experts (qmm_moe_f16) from
// Options::moe_f16_from.
// PDL: where the dependency wait goes (QmmPdl).
// WARPS: warps of the block (the fused MoE kernel runs 8); the K split
// (KSplit) does not depend on it, so neither do the results.
// smem_off: where the rings start in the dynamic shared memory (16-byte
// aligned).
template <int NT, bool CSUM_MMA, class Job, int WARPS, QmmPdl PDL, int RING = QMM_RING, bool F16 = false>
__device__ __forceinline__ void qmm_run(Job& job, const u16* x, const float* csum, int K, int smem_off = 0) {
    constexpr int NA = QMM_ACC(F16);
    extern __shared__ __align__(16) unsigned char qsm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const KSplit ks(K);
    const int tpb = WARPS / ks.KQ;
    // A wide K in a block narrower than its slices (qmm.rs routes wide
    // matrices to the *_wide entries; never reached).
    if (tpb == 0) __trap();
    const int mt = warp / ks.KQ, q = warp - mt * ks.KQ;
    unsigned char* ring = qsm + smem_off + warp * (RING * QMM_STAGE_BYTES);
    const u32 ring32 = smem_u32(ring), piece_off = stage_piece_off(lane);
    float* red = reinterpret_cast<float*>(qsm + smem_off + WARPS * RING * QMM_STAGE_BYTES);  // [W][NT][32][NA]
    const int SQ = ks.SQ;

    if (PDL == QmmPdl::WaitThenTrigger) {
        pdl_wait();
        pdl_trigger();
    } else if (PDL == QmmPdl::StagesBeforeWait) {
        pdl_trigger();
    }
    job.prepare();
    const int ntasks = job.ntasks();
    const int nbt = (ntasks + tpb - 1) / tpb;
    const int my_bt = (int)blockIdx.x < nbt ? (nbt - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int zmax = my_bt * SQ;

    // Producer state: the next stage to request, the task whose stages are
    // being requested and the lane's copy sources for it (once per task).
    ProdCursor pc;
    pc.z = pc.it = pc.s = 0;
    pc.ti = -1;
#pragma unroll 1
    for (int z = 0; z < RING - 1; ++z) qmm_produce<RING>(job, ring32, ks, zmax, tpb, mt, q, lane, piece_off, ntasks, x, pc);
    if (PDL == QmmPdl::StagesBeforeWait) pdl_wait();

    float acc[NT][NA];
    int xoff[NT], csoff[NT], csoff2[NT];   // csoff2: F16's second C token
    int cnt = 0;
    typename Job::Pos tp = job.pos(0);
    const int g = lane >> 2, c = lane & 3, G = ks.G;
    // Consumer position: block iteration `it`, stage `s` of the slice,
    // counted rather than divided out of z.
    int it = 0, s = 0;
#pragma unroll 1
    for (int z = 0; z < zmax; ++z) {
        if (s == 0) {
            const int ti = ((int)blockIdx.x + it * (int)gridDim.x) * tpb + mt;
            tp = job.pos(ti < ntasks ? ti : 0);
            cnt = ti < ntasks ? job.count(tp) : 0;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                if constexpr (F16) {
                    acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
                    // B column g: token 8 nt + g's hi half; C tokens 8 nt + 2c (+ 1).
                    const int jb = nt * 8 + g, jc = nt * 8 + 2 * c;
                    xoff[nt] = jb < cnt ? job.xrow(tp, jb) * 2 * K : -1;
                    csoff[nt] = jc < cnt ? job.xrow(tp, jc) * G : -1;
                    csoff2[nt] = jc + 1 < cnt ? job.xrow(tp, jc + 1) * G : -1;
                } else {
                    acc[nt][0] = acc[nt][1] = 0.f;
                    const int jb = nt * 4 + (g >> 1), jc = nt * 4 + c;
                    xoff[nt] = jb < cnt ? job.xrow(tp, jb) * 2 * K + (g & 1) * K : -1;
                    csoff[nt] = (!CSUM_MMA && jc < cnt) ? job.xrow(tp, jc) * G : -1;
                    csoff2[nt] = -1;
                }
            }
        }
        cp_async_wait<RING - 2>();
        __syncwarp();
#ifndef QMM_PROBE_NO_MATH
        if (cnt > 0) stage_math<NT, CSUM_MMA, F16>(ring + (z % RING) * QMM_STAGE_BYTES, x, csum, ks, q, s, lane, cnt, xoff, csoff, csoff2, acc);
#endif
        __syncwarp();
        qmm_produce<RING>(job, ring32, ks, zmax, tpb, mt, q, lane, piece_off, ntasks, x, pc);
        if (s == SQ - 1) {
            // acc was summed in units of 2^20 (deq_word): back to the
            // products' own unit, exactly.
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                acc[nt][0] = __fmul_rn(acc[nt][0], QMM_SUM_SCALE);
                acc[nt][1] = __fmul_rn(acc[nt][1], QMM_SUM_SCALE);
                if constexpr (F16) {
                    acc[nt][2] = __fmul_rn(acc[nt][2], QMM_SUM_SCALE);
                    acc[nt][3] = __fmul_rn(acc[nt][3], QMM_SUM_SCALE);
                }
            }
            if (ks.KQ == 1) {
                // One warp holds the whole K: its sums are final.
                if (cnt > 0) {
                    if constexpr (F16) {
                        qmm_epilogues_f16<NT>(job, tp, lane, acc, cnt);
                    } else {
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) job.epilogue(tp, nt, lane, acc[nt][0], acc[nt][1], cnt);
                    }
                }
            } else {
                // Every slice's partial to shared memory, then the slice-0
                // warp adds them in slice order (deterministic) and runs the
                // epilogue. Only the KQ warps of this task meet (named
                // barrier 1 + mt), so other tasks' warps keep streaming.
                float* part = red + (size_t)warp * NT * 32 * NA;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    if constexpr (F16) *reinterpret_cast<float4*>(part + (nt * 32 + lane) * NA) = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
                    else *reinterpret_cast<float2*>(part + (nt * 32 + lane) * NA) = make_float2(acc[nt][0], acc[nt][1]);
                }
                named_barrier(1 + mt, ks.KQ * 32);
                if (q == 0 && cnt > 0) {
#pragma unroll 1
                    for (int src = 1; src < ks.KQ; ++src) {
                        const float* o = red + (size_t)(warp + src) * NT * 32 * NA;
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            if constexpr (F16) {
                                const float4 v = *reinterpret_cast<const float4*>(o + (nt * 32 + lane) * NA);
                                acc[nt][0] = __fadd_rn(acc[nt][0], v.x);
                                acc[nt][1] = __fadd_rn(acc[nt][1], v.y);
                                acc[nt][2] = __fadd_rn(acc[nt][2], v.z);
                                acc[nt][3] = __fadd_rn(acc[nt][3], v.w);
                            } else {
                                const float2 v = *reinterpret_cast<const float2*>(o + (nt * 32 + lane) * NA);
                                acc[nt][0] = __fadd_rn(acc[nt][0], v.x);
                                acc[nt][1] = __fadd_rn(acc[nt][1], v.y);
                            }
                        }
                    }
                    if constexpr (F16) {
                        qmm_epilogues_f16<NT>(job, tp, lane, acc, cnt);
                    } else {
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) job.epilogue(tp, nt, lane, acc[nt][0], acc[nt][1], cnt);
                    }
                }
                // The partials are read before any of the task's warps
                // writes its next task's.
                named_barrier(1 + mt, ks.KQ * 32);
            }
        }
        if (++s == SQ) {
            s = 0;
            ++it;
        }
    }
    cp_async_wait<0>();
    job.finish();
}

// ---- dense matrices ----------------------------------------------------------

#define QMM_STORE 0
#define QMM_ADD 1
#define QMM_LOGITS 2

struct QmmSeg {
    const u32* codes;     // [rows][K / 8]
    const bf16* scales;   // [rows][K / 64]
    const bf16* biases;
    float* out;           // out[t * out_stride + row]
    int rows;
    int out_stride;
    int tile_start;       // first 16-row tile of this segment
    int mode;             // QMM_STORE / QMM_ADD / QMM_LOGITS
};
LAYOUT_CHECK(QmmSeg, QMM_SEG_SIZE)

// Tasks: tile-major within a token chunk: task = chunk * ntiles + tile, a
// chunk being tok_chunk tokens (the variant's 4 * NT). Tokens beyond one
// chunk re-read the weights (from L2); per-token arithmetic is the same.
struct QmmDenseParams {
    QmmSeg seg[QMM_MAX_SEGS];
    const u16* x;         // packed [ntok][2][K]
    const float* csum;    // [ntok][K / 64] group sums of x
    u64* argmax_keys;     // [ntok] for QMM_LOGITS, else null
    int nseg;
    int ntiles;           // 16-row tiles over all segments
    int tok_chunk;
    int K;
    int ntok;
};
LAYOUT_CHECK(QmmDenseParams, QMM_DENSE_PARAMS_SIZE)

struct DenseJob {
    const QmmDenseParams& p;
    u64* best;            // shared [QMM_MAX_TOK] argmax keys of this block, or null
    __device__ DenseJob(const QmmDenseParams& pp, u64* b) : p(pp), best(b) {}
    __device__ void prepare() {
        if (best != nullptr) {
            for (int i = threadIdx.x; i < p.ntok; i += blockDim.x) best[i] = 0ull;
            __syncthreads();
        }
    }
    __device__ int ntasks() const { return p.ntiles * ((p.ntok + p.tok_chunk - 1) / p.tok_chunk); }
    __device__ int seg_of(int tile) const {
        int s = 0;
#pragma unroll
        for (int i = 1; i < QMM_MAX_SEGS; ++i)
            if (i < p.nseg && tile >= p.seg[i].tile_start) s = i;
        return s;
    }
    // A task: its 16-row tile and its chunk of tok_chunk tokens.
    struct Pos {
        int tile, chunk;
    };
    __device__ Pos pos(int ti) const {
        const int chunk = ti / p.ntiles;
        return Pos{ti - chunk * p.ntiles, chunk};
    }
    __device__ QTask task(Pos ps, bool& valid) const {
        QTask t;
        valid = ps.chunk * p.tok_chunk < p.ntok;
        const int tile = ps.tile;
        const QmmSeg& sg = p.seg[seg_of(tile)];
        const int r0 = (tile - sg.tile_start) * 16;
        const int wpr = p.K / 8, gpr = p.K / GROUP_SIZE;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int rh = r0 + 8 * h;
            t.n[h] = max(0, min(8, sg.rows - rh));
            const int rc = t.n[h] > 0 ? rh : 0;
            t.codes[h] = sg.codes + (size_t)rc * wpr;
            t.scales[h] = sg.scales + (size_t)rc * gpr;
            t.biases[h] = sg.biases + (size_t)rc * gpr;
        }
        return t;
    }
    __device__ int count(Pos ps) const { return min(p.tok_chunk, p.ntok - ps.chunk * p.tok_chunk); }
    __device__ int xrow(Pos ps, int j) const { return ps.chunk * p.tok_chunk + j; }
    __device__ void epilogue(Pos ps, int nt, int lane, float v0, float v1, int cnt) { epilogue_at(ps, nt * 4 + (lane & 3), lane, v0, v1, cnt); }
    // j: the lane's token in the task (every lane of the warp calls it).
    __device__ void epilogue_at(Pos ps, int j, int lane, float v0, float v1, int cnt) {
        const int g = lane >> 2;
        const QmmSeg& sg = p.seg[seg_of(ps.tile)];
        const int r0 = (ps.tile - sg.tile_start) * 16;
        const int t = ps.chunk * p.tok_chunk + j;
        u64 key = 0ull;
        if (j < cnt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = r0 + g + 8 * h;
                if (row >= sg.rows) continue;
                const float v = h ? v1 : v0;
                float* o = sg.out + (size_t)t * sg.out_stride + row;
                if (sg.mode == QMM_ADD) *o += v;
                else *o = v;
                const u64 k = argmax_key(v, (u32)row);
                if (k > key) key = k;
            }
        }
        if (sg.mode == QMM_LOGITS && best != nullptr) {
            // Lanes 4 apart hold the same token: fold the 8 rows, then one
            // shared atomic per token and tile.
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) {
                const u64 other = __shfl_xor_sync(FULL_MASK, key, o);
                if (other > key) key = other;
            }
            if (g == 0 && j < cnt) atomicMax(best + t, key);
        }
    }
    __device__ void finish() {
        if (best != nullptr) {
            __syncthreads();
            for (int i = threadIdx.x; i < p.ntok; i += blockDim.x)
                if (best[i] != 0ull) atomicMax(p.argmax_keys + i, best[i]);
        }
    }
};

template <int NT, int RING, int WARPS, bool F16>
__device__ __forceinline__ void qmm_dense_body(const QmmDenseParams& p) {
    __shared__ u64 best[QMM_MAX_TOK];
    DenseJob job(p, p.argmax_keys != nullptr ? best : nullptr);
    qmm_run<NT, false, DenseJob, WARPS, QmmPdl::StagesBeforeWait, RING, F16>(job, p.x, p.csum, p.K);
}

// One entry point per (n-tiles, ring, block width, columns) that qmm.rs
// `dense_variant` picks: QMM_WARPS warps a block, or (the *_wide entries,
// K >= QMM_WIDE_K) QMM_WIDE_KQ, one task a block; the qmm_dense_f16*
// entries take 8 tokens' fp16 x an n-tile (F16 in stage_math_groups).
// MINB: blocks an SM the registers must allow (__launch_bounds__).
#define QMM_DENSE_B(NAME, NT, RING, WARPS, F16, MINB)                                                 \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) NAME(const __grid_constant__ QmmDenseParams p) { \
        qmm_dense_body<NT, RING, WARPS, F16>(p);                                                      \
    }
#define QMM_DENSE(NAME, NT, RING, WARPS, F16) QMM_DENSE_B(NAME, NT, RING, WARPS, F16, (16 / WARPS > 1 ? 16 / WARPS : 1))
QMM_DENSE(qmm_dense_1, 1, QMM_DENSE_RING, QMM_WARPS, false)
QMM_DENSE(qmm_dense_2, 2, QMM_DENSE2_RING, QMM_WARPS, false)
QMM_DENSE(qmm_dense_2_head, 2, QMM_HEAD_RING, QMM_WARPS, false)
QMM_DENSE(qmm_dense_2_chunks, 2, QMM_DENSE_RING, QMM_WARPS, false)
QMM_DENSE(qmm_dense_1_wide, 1, QMM_WIDE_RING, QMM_WIDE_KQ, false)
QMM_DENSE(qmm_dense_2_wide, 2, QMM_WIDE_RING, QMM_WIDE_KQ, false)
QMM_DENSE(qmm_dense_2_chunks_wide, 2, QMM_WIDE_RING, QMM_WIDE_KQ, false)
QMM_DENSE(qmm_dense_f16, 1, QMM_DENSE2_RING, QMM_WARPS, true)
QMM_DENSE(qmm_dense_f16_head, 1, QMM_HEAD_RING, QMM_WARPS, true)
QMM_DENSE(qmm_dense_f16_wide, 1, QMM_WIDE_RING, QMM_WIDE_KQ, true)
// Two fp16 n-tiles (9-16 tokens in one chunk): at 4 blocks an SM (128
// registers) they spill 28-36 bytes; at 3 they take ~160 and none. (No wide
// entry: in 16-warp blocks 128 registers is the bound; the wide matrices
// take the one-n-tile entry in chunks of 8.)
QMM_DENSE_B(qmm_dense_f16_2, 2, QMM_DENSE2_RING, QMM_WARPS, true, 3)
QMM_DENSE_B(qmm_dense_f16_2_head, 2, QMM_HEAD_RING, QMM_WARPS, true, 3)

// ---- MoE decode ----------------------------------------------------------------
//
// The plan (written by moe_router): plan[0] = number of items; items at
// plan + PLAN_HEAD, [max_items][3] = (expert, first pair, pair count <=
// chunk); the pair list after the items: pair = token * MOE_SLOTS + slot.
// Items of the shared expert (expert N_EXPERTS, slot TOPK, every token)
// come first, then the routed experts in expert order, each expert's pairs
// in token order.
#define PLAN_HEAD 4

struct QmmMoeParams {
    const u32* codes;        // [N_EXPERTS][rows][K / 8] (gate for up)
    const bf16* scales;
    const bf16* biases;
    const u32* codes2;       // up: the up projection; down: unused
    const bf16* scales2;
    const bf16* biases2;
    const u32* sh_codes;     // the shared expert's matrices (same shapes, one expert)
    const bf16* sh_scales;
    const bf16* sh_biases;
    const u32* sh_codes2;
    const bf16* sh_scales2;
    const bf16* sh_biases2;
    const u16* x;            // packed: up [ntok][2][HIDDEN], down [ntok * MOE_SLOTS][2][MOE_INTER]
    const float* csum;       // up: [ntok][HIDDEN / 64] group sums of x; down: unused
    const int* plan;
    u16* act_out;            // up: packed [ntok * MOE_SLOTS][2][MOE_INTER]
    float* y_out;            // down: [ntok * MOE_SLOTS][HIDDEN]
    int max_items;
    int up;                  // 1 = gate/up + SwiGLU, 0 = down
    int npairs;              // ntok * MOE_SLOTS: the pair list's length
    int smem_items;          // items the shared-memory copy of the plan holds
};
LAYOUT_CHECK(QmmMoeParams, QMM_MOE_PARAMS_SIZE)

struct MoeJob {
    const QmmMoeParams& p;
    int* smem_plan;          // p.smem_items * 3 + p.npairs ints of shared memory
    int preset;              // >= 0: the plan's item count, already in smem_plan (qmm_moe_fused)
    int nitems;
    const int* items;
    const int* pairs;
    __device__ MoeJob(const QmmMoeParams& pp, int* sp, int planned = -1)
        : p(pp), smem_plan(sp), preset(planned), nitems(0), items(nullptr), pairs(nullptr) {}
    __device__ int tiles() const { return p.up ? MOE_INTER / 8 : HIDDEN / 16; }
    // The plan is copied into shared memory once: every task start reads
    // its item and pairs (and the producer its expert), which from global
    // memory were dependent L2 round trips in the middle of the stream.
    // The whole capacity is copied, not plan[0] items, so the copy does
    // not wait for the count (one round trip, not two); entries past the
    // count are never read. The down kernel runs this before its
    // dependency wait (the plan is the router's, two kernels back: the
    // gate/up kernel lets it launch only after its own wait), so the plan
    // is read through L2, never from a line an earlier kernel left in L1.
    __device__ void prepare() {
        if (preset >= 0) {
            nitems = preset;
            items = smem_plan;
            pairs = smem_plan + 3 * p.smem_items;
            return;
        }
        const int* gi = p.plan + PLAN_HEAD;
        const int* gp = gi + 3 * p.max_items;
        int* si = smem_plan;
        int* sp = si + 3 * p.smem_items;
        for (int i = threadIdx.x; i < 3 * p.smem_items; i += blockDim.x) si[i] = ldcg_i32(gi + i);
        for (int i = threadIdx.x; i < p.npairs; i += blockDim.x) sp[i] = ldcg_i32(gp + i);
        nitems = ldcg_i32(p.plan);
        __syncthreads();
        if (nitems <= p.smem_items) {
            items = si;
            pairs = sp;
        } else {
            // Read from global memory by plain loads later: only after the
            // dependency wait (a second wait is a no-op).
            pdl_wait();
            items = gi;
            pairs = gp;
        }
    }
    __device__ int ntasks() const { return nitems * tiles(); }
    // A task: its plan item and its tile of weight rows (a constant
    // number of tiles per item, so the division is by a constant).
    struct Pos {
        int item, tile;
    };
    __device__ Pos pos(int ti) const {
        const int item = p.up ? ti / (MOE_INTER / 8) : ti / (HIDDEN / 16);
        return Pos{item, ti - item * tiles()};
    }
    __device__ QTask task(Pos ps, bool& valid) const {
        QTask t;
        valid = ps.item < nitems;
        const int item = valid ? ps.item : 0;
        const int tile = ps.tile;
        const int e = valid ? items[3 * item] : N_EXPERTS;
        const bool sh = e >= N_EXPERTS;
        if (p.up) {
            // rows 0-7: gate rows 8*tile.., rows 8-15: up rows 8*tile..
            const int wpr = HIDDEN / 8, gpr = HIDDEN / GROUP_SIZE;
            const size_t r = (sh ? 0 : (size_t)e * MOE_INTER) + (size_t)tile * 8;
            t.codes[0] = (sh ? p.sh_codes : p.codes) + r * wpr;
            t.scales[0] = (sh ? p.sh_scales : p.scales) + r * gpr;
            t.biases[0] = (sh ? p.sh_biases : p.biases) + r * gpr;
            t.codes[1] = (sh ? p.sh_codes2 : p.codes2) + r * wpr;
            t.scales[1] = (sh ? p.sh_scales2 : p.scales2) + r * gpr;
            t.biases[1] = (sh ? p.sh_biases2 : p.biases2) + r * gpr;
            t.n[0] = t.n[1] = min(8, MOE_INTER - tile * 8);
        } else {
            const int wpr = MOE_INTER / 8, gpr = MOE_INTER / GROUP_SIZE;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int rh = tile * 16 + 8 * h;
                t.n[h] = max(0, min(8, HIDDEN - rh));
                const size_t r = (sh ? 0 : (size_t)e * HIDDEN) + (t.n[h] > 0 ? rh : 0);
                t.codes[h] = (sh ? p.sh_codes : p.codes) + r * wpr;
                t.scales[h] = (sh ? p.sh_scales : p.scales) + r * gpr;
                t.biases[h] = (sh ? p.sh_biases : p.biases) + r * gpr;
            }
        }
        return t;
    }
    __device__ int count(Pos ps) const { return items[3 * ps.item + 2]; }
    __device__ int pair(Pos ps, int j) const { return pairs[items[3 * ps.item + 1] + j]; }
    __device__ int xrow(Pos ps, int j) const { return p.up ? pair(ps, j) / MOE_SLOTS : pair(ps, j); }
    __device__ void epilogue(Pos ps, int nt, int lane, float v0, float v1, int cnt) { epilogue_at(ps, nt * 4 + (lane & 3), lane, v0, v1, cnt); }
    // The sums of rows g and g + 8 for the task's pair j (every lane calls it).
    __device__ void epilogue_at(Pos ps, int j, int lane, float v0, float v1, int cnt) {
        const int g = lane >> 2;
        if (j >= cnt) return;
        const int tile = ps.tile;
        const int pr = pair(ps, j);
        if (p.up) {
            const int col = tile * 8 + g;
            if (col < MOE_INTER) px_store1(p.act_out, pr, MOE_INTER, col, siluf_(v0) * v1);
        } else {
            const int r0 = tile * 16 + g;
            float* o = p.y_out + (size_t)pr * HIDDEN;
            if (r0 < HIDDEN) o[r0] = v0;
            if (r0 + 8 < HIDDEN) o[r0 + 8] = v1;
        }
    }
    __device__ void finish() {}
};

// BOUNDS: the kernel's __launch_bounds__. qmm_moe_1 at least 4 blocks an SM
// (128 registers: left to itself, ptxas gave it 136 in the first version of
// the subnormal codes, 3 blocks an SM; NOTES history 124); qmm_moe_2 left to
// ptxas; qmm_moe_1_occ3 at most 3 blocks an SM, for the step sizes qmm.rs
// MOE_OCC3_UPTO names (and measures). The arithmetic is the same, so are the
// bits.
// RING: the warps' ring; the one-token kernel's holds QMM_ONE_TOKEN_RING
// stages, so a warp requests all 4 stages of its task at once (at one token
// a warp has about one task: a 4-stage ring requested the last stage only
// after the first was consumed, a second DRAM round trip on its timeline).
#define QMM_MOE(NAME, NT, BOUNDS, RING, F16)                                                        \
    extern "C" __global__ void BOUNDS NAME(const __grid_constant__ QmmMoeParams p) {               \
        extern __shared__ __align__(16) unsigned char msm[];                                         \
        MoeJob job(p, reinterpret_cast<int*>(msm + QMM_WARPS * RING * QMM_STAGE_BYTES + QMM_WARPS * NT * 32 * QMM_ACC(F16) * 4)); \
        if (p.up) qmm_run<NT, false, MoeJob, QMM_WARPS, QmmPdl::WaitThenTrigger, RING, F16>(job, p.x, p.csum, HIDDEN); \
        else qmm_run<NT, true, MoeJob, QMM_WARPS, QmmPdl::StagesBeforeWait, RING, F16>(job, p.x, nullptr, MOE_INTER); \
    }
QMM_MOE(qmm_moe_1, 1, __launch_bounds__(QMM_WARPS * 32, 4), QMM_RING, false)
QMM_MOE(qmm_moe_1_occ3, 1, __launch_bounds__(QMM_WARPS * 32, 3), QMM_ONE_TOKEN_RING, false)
QMM_MOE(qmm_moe_2, 2, __launch_bounds__(QMM_WARPS * 32), QMM_RING, false)
// fp16 x (F16): 8 tokens an n-tile, items of up to 8 pairs, the down
// projections' group sums from the all-ones mma (Options::moe_f16_from).
QMM_MOE(qmm_moe_f16, 1, __launch_bounds__(QMM_WARPS * 32, 4), QMM_RING, true)

// ---- router, top-k and the decode plan ------------------------------------------

struct RouterParams {
    const u32* codes;        // router [N_EXPERTS][HIDDEN] 8-bit
    const bf16* scales;
    const bf16* biases;
    const u32* sg_codes;     // shared expert gate [1][HIDDEN] 8-bit
    const bf16* sg_scales;
    const bf16* sg_biases;
    const float* h;          // residual [ntok][HIDDEN]
    const float* gain;       // post-attention norm gain
    float* logits;           // [ntok][N_EXPERTS]
    float* sg;               // [ntok]
    u16* px;                 // packed RMSNorm(h) [ntok][2][HIDDEN] (block 0 writes)
    float* csum;             // [ntok][HIDDEN / 64] its group sums (block 0 writes)
    int* topk_idx;           // [ntok][TOPK]
    float* topk_w;           // [ntok][MOE_SLOTS]
    int* plan;
    int* ticket;             // [1 + token chunks], 0 on entry, left 0
    int ntok;
    int chunk;               // pairs per plan item
    int max_items;
    float eps;
    int tok_chunk;           // tokens a block stages and routes (1..ROUTER_TOK): grid.y = ceil(ntok / tok_chunk)
    int pad_;
};
LAYOUT_CHECK(RouterParams, ROUTER_PARAMS_SIZE)

// Shared memory of the plan (floats from the start of the dynamic smem): the
// top-k tables of a chunk's last block ([ROUTER_ROWS][N_EXPERTS] logits,
// [ROUTER_ROWS][TOPK] ids and weights), then the selection bitmap
// [ROUTER_SEL_WORDS][N_EXPERTS] (qmm.rs router_smem).
#define ROUTER_PLAN_OFF (ROUTER_ROWS * N_EXPERTS + 2 * ROUTER_ROWS * TOPK)
#define ROUTER_SEL_WORDS ((QMM_MAX_TOK * TOPK + 31) / 32)
// Selections (token, slot) a thread of the plan block gathers: all of them
// for up to QMM_MAX_TOK tokens (the launcher's limit), 256 threads.
#define ROUTER_SELS ((QMM_MAX_TOK * TOPK + 255) / 256)
static_assert(ROUTER_SMEM >= 4 * (ROUTER_TOK * (PADDED_LEN(HIDDEN) + HIDDEN / 16) + PADDED_LEN(HIDDEN)) &&
                  ROUTER_SMEM >= 4 * (ROUTER_PLAN_OFF + ROUTER_SEL_WORDS * N_EXPERTS),
              "qmm.rs router_smem is smaller than moe_router's shared-memory layout");

// The router's pieces, shared by moe_router and qmm_moe_fused (256 threads,
// ROUTER_ROWS warps; `rsm` is the dynamic shared memory, router_smem bytes).

// A warp's router row (row N_EXPERTS = the shared expert gate), loaded
// into registers before the previous kernel ends.
struct RouterRow {
    uint4 w[ROUTER_ITS];
    float ws[ROUTER_ITS], wb[ROUTER_ITS];
    int row;
    bool has_row, sgrow;
};

__device__ __forceinline__ void router_row_load(const RouterParams& p, int row, RouterRow& rr) {
    const int lane = threadIdx.x & 31;
    rr.row = row;
    rr.has_row = row >= 0 && row <= N_EXPERTS;
    rr.sgrow = row == N_EXPERTS;
    const u32* codes = rr.sgrow ? p.sg_codes : p.codes + (size_t)(rr.has_row ? row : 0) * (HIDDEN / 4);
    const bf16* sc = rr.sgrow ? p.sg_scales : p.scales + (size_t)(rr.has_row ? row : 0) * (HIDDEN / GROUP_SIZE);
    const bf16* bi = rr.sgrow ? p.sg_biases : p.biases + (size_t)(rr.has_row ? row : 0) * (HIDDEN / GROUP_SIZE);
#pragma unroll
    for (int i = 0; i < ROUTER_ITS; ++i) {
        const int ch = lane + 32 * i;
        if (rr.has_row && ch < HIDDEN / 16) {
            rr.w[i] = ld_stream_u4(codes + ch * 4);
            rr.ws[i] = bf16_to_f32(ld_nc_u16(sc + ch / 4));
            rr.wb[i] = bf16_to_f32(ld_nc_u16(bi + ch / 4));
        } else {
            rr.w[i] = make_uint4(0, 0, 0, 0);
            rr.ws[i] = rr.wb[i] = 0.f;
        }
    }
}

// Shared memory: the staged tokens [ROUTER_TOK][P] (padded rows), their
// 16-column sums [ROUTER_TOK][HIDDEN / 16] (formed once here, not by each
// of the 8 rows: ((((0 + s0) + s1) + s2) + s3), s_j = (x_4j + x_4j+1) +
// (x_4j+2 + x_4j+3), the order that fixes a row's logit bits), and the
// norm gain [P]. router_gain_copy requests the gain (a constant) before the
// previous kernel ends.
__device__ __forceinline__ void router_gain_copy(const RouterParams& p, float* rsm) {
    float* const gain = rsm + ROUTER_TOK * PADDED_LEN(HIDDEN) + ROUTER_TOK * (HIDDEN / 16);
    for (int c = threadIdx.x * 4; c < HIDDEN; c += blockDim.x * 4) cp_async16(gain + PAD32(c), p.gain + c, 16);
    cp_async_commit();
}

// A lane's 8 columns of a token in the router's staging (router_stage and
// moe_router_mma: the same code, so the same sums of squares, norms and
// packed bits): its share of the sum of squares, and the normalised values
// x r g.
__device__ __forceinline__ float router_ss8(float4 v, float4 u) {
    float ss = v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    ss += u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w;
    return ss;
}
// Each of the nt tokens' 1 / RMS from its NB column blocks' sums of squares,
// added in block order (thread t: token t).
template <int NB>
__device__ __forceinline__ void router_rinv(const float (*seg)[NB], float* rinv, int nt, float eps) {
    if ((int)threadIdx.x < nt) {
        float ss = 0.f;
        for (int b = 0; b < NB; ++b) ss += seg[threadIdx.x][b];
        rinv[threadIdx.x] = rsqrtf(ss / (float)HIDDEN + eps);
    }
}
__device__ __forceinline__ void router_norm8(float4 a, float4 bb, float r, float4 ga, float4 gb, float (&o)[8]) {
    o[0] = a.x * r * ga.x;
    o[1] = a.y * r * ga.y;
    o[2] = a.z * r * ga.z;
    o[3] = a.w * r * ga.w;
    o[4] = bb.x * r * gb.x;
    o[5] = bb.y * r * gb.y;
    o[6] = bb.z * r * gb.z;
    o[7] = bb.w * r * gb.w;
}

// The nt tokens t0.. normalised into their staging rows, with each row's
// 16-column sums; `pack`: also written packed (and their group sums) for the
// experts. Every warp takes the same 256-column blocks of every token
// (block b to warp b % ROUTER_ROWS), so a step of one token keeps all 8
// warps busy instead of one (Nsight Compute at batch 1: 41% of the router's
// stall cycles were warps waiting at this stage's barriers). A token's sum
// of squares is its blocks' warp sums added in block order: the same for
// every batch size. The first pass leaves h in the staging row, so the
// second reads it from shared memory, not again from L2. Ends with a block
// barrier.
__device__ __forceinline__ void router_stage(const RouterParams& p, float* rsm, int t0, int nt, bool pack) {
    constexpr int NB = (HIDDEN + 255) / 256;
    __shared__ __align__(16) float seg[ROUTER_TOK][NB];
    __shared__ float rinv[ROUTER_TOK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int P = PADDED_LEN(HIDDEN);
    float* const csum16 = rsm + ROUTER_TOK * P;
    float* const gain = csum16 + ROUTER_TOK * (HIDDEN / 16);
#pragma unroll
    for (int k = 0; k < ROUTER_TOK; ++k) {
        if (k >= nt) break;
        const float* hr = p.h + (size_t)(t0 + k) * HIDDEN;
        float* const sx = rsm + k * P;
        for (int b = warp; b < NB; b += ROUTER_ROWS) {
            const int c = b * 256 + lane * 8;
            float ss = 0.f;
            if (c < HIDDEN) {
                const float4 v = *reinterpret_cast<const float4*>(hr + c);
                const float4 u = *reinterpret_cast<const float4*>(hr + c + 4);
                *reinterpret_cast<float4*>(sx + PAD32(c)) = v;
                *reinterpret_cast<float4*>(sx + PAD32(c) + 4) = u;
                ss = router_ss8(v, u);
            }
            ss = warp_sum(ss);
            if (lane == 0) seg[k][b] = ss;
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the gain, the staged columns and the blocks' sums
    router_rinv<NB>(seg, rinv, nt, p.eps);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < ROUTER_TOK; ++k) {
        if (k >= nt) break;
        const int t = t0 + k;
        const float r = rinv[k];
        float* const sx = rsm + k * P;
        float* const cs16 = csum16 + k * (HIDDEN / 16);
        // Uniform over the warp (the sums shuffle across lanes).
        for (int b = warp; b < NB; b += ROUTER_ROWS) {
            const int c = b * 256 + lane * 8;
            float part = 0.f, q0 = 0.f, q1 = 0.f;
            if (c < HIDDEN) {
                float* xs = sx + PAD32(c);
                const float4 a = *reinterpret_cast<const float4*>(xs);
                const float4 bb = *reinterpret_cast<const float4*>(xs + 4);
                const float4 ga = *reinterpret_cast<const float4*>(gain + PAD32(c));
                const float4 gb = *reinterpret_cast<const float4*>(gain + PAD32(c) + 4);
                float o[8];
                router_norm8(a, bb, r, ga, gb, o);
                *reinterpret_cast<float4*>(xs) = make_float4(o[0], o[1], o[2], o[3]);
                *reinterpret_cast<float4*>(xs + 4) = make_float4(o[4], o[5], o[6], o[7]);
                // __fadd_rn: never fused with the products above into an
                // fma, so these are the sums of the stored values exactly.
                q0 = __fadd_rn(__fadd_rn(o[0], o[1]), __fadd_rn(o[2], o[3]));
                q1 = __fadd_rn(__fadd_rn(o[4], o[5]), __fadd_rn(o[6], o[7]));
                if (pack) part = px_store8(p.px, t, HIDDEN, c, o);
            }
            // 16 columns = lanes 2j (columns 0-7) and 2j + 1 (8-15).
            const float n0 = __shfl_down_sync(FULL_MASK, q0, 1);
            const float n1 = __shfl_down_sync(FULL_MASK, q1, 1);
            if (c < HIDDEN && (lane & 1) == 0) cs16[c / 16] = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(0.f, q0), q1), n0), n1);
            if (pack) {
                const float gs = group_sum8(part);
                if (c < HIDDEN && (lane & 7) == 0) p.csum[(size_t)t * (HIDDEN / GROUP_SIZE) + c / GROUP_SIZE] = gs;
            }
        }
    }
    __syncthreads();
}

// The warp's row against the nt staged tokens: logits[t0 + k][row] (or the
// shared gate sg[t0 + k]).
__device__ __forceinline__ void router_dot(const RouterParams& p, const float* rsm, const RouterRow& rr, int t0, int nt) {
    const int lane = threadIdx.x & 31;
    const int P = PADDED_LEN(HIDDEN);
    const float* const csum16 = rsm + ROUTER_TOK * P;
    if (!rr.has_row) return;
    for (int k = 0; k < nt; ++k) {
        const float* sx = rsm + k * P;
        const float* cs16 = csum16 + k * (HIDDEN / 16);
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < ROUTER_ITS; ++i) {
            const int ch = lane + 32 * i;
            if (ch < HIDDEN / 16) {
                const float* xs = sx + PAD32(ch * 16);
                float xv[16];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float4 v = reinterpret_cast<const float4*>(xs)[j];
                    xv[4 * j] = v.x;
                    xv[4 * j + 1] = v.y;
                    xv[4 * j + 2] = v.z;
                    xv[4 * j + 3] = v.w;
                }
                acc += fmaf(rr.ws[i], dot16_q8(rr.w[i], xv), rr.wb[i] * cs16[ch]);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            if (rr.sgrow) p.sg[t0 + k] = acc;
            else p.logits[(size_t)(t0 + k) * N_EXPERTS + rr.row] = acc;
        }
    }
}

// Top-k of tokens t0.. (warp w: token t0 + w < t0 + nt) from the logits in
// global memory (written by other blocks: read through L2), into the
// block's top-k tables in shared memory ([ROUTER_ROWS][N_EXPERTS] logits,
// then [ROUTER_ROWS][TOPK] ids and weights); `publish`: also to topk_idx /
// topk_w. Ends with a block barrier.
__device__ __forceinline__ void router_topk(const RouterParams& p, float* rsm, int t0, int nt, bool publish) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* l = rsm + warp * N_EXPERTS;
    int* sel = reinterpret_cast<int*>(rsm + ROUTER_ROWS * N_EXPERTS) + warp * TOPK;
    float* selw = reinterpret_cast<float*>(rsm + ROUTER_ROWS * N_EXPERTS + ROUTER_ROWS * TOPK) + warp * TOPK;
    if (warp < nt) {
        const int t = t0 + warp;
        // Every load of the token (its logits, the shared gate) in
        // flight at once: one L2 round trip, not one per 32 experts.
        float lv[EXPERTS_PER_LANE];
#pragma unroll
        for (int i = 0; i < EXPERTS_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            lv[i] = e < N_EXPERTS ? ldcg_f32(p.logits + (size_t)t * N_EXPERTS + e) : 0.f;
        }
        const float sgv = lane == 0 ? ldcg_f32(p.sg + t) : 0.f;
#pragma unroll
        for (int i = 0; i < EXPERTS_PER_LANE; ++i)
            if (lane + 32 * i < N_EXPERTS) l[lane + 32 * i] = lv[i];
        __syncwarp();
        warp_topk(l, sel, selw);
        __syncwarp();
        if (publish) {
            if (lane < TOPK) {
                p.topk_idx[t * TOPK + lane] = sel[lane];
                p.topk_w[t * MOE_SLOTS + lane] = selw[lane];
            }
            if (lane == 0) p.topk_w[t * MOE_SLOTS + TOPK] = sigmoidf_(sgv);
        }
    }
    __syncthreads();
}

// The step's plan from the expert ids of its selections (thread j holds
// selections j, j + 256, ...; token * TOPK + slot; -1 past the end): items
// [..][3] = (expert, first pair, count) and the pair list, written through
// `items` / `pairs` (global memory for moe_router, shared memory for
// qmm_moe_fused). Returns the item count (every thread). Uses the bitmap
// region of `rsm` (past the top-k tables).
//
// The plan is built from a bitmap per expert over the step's n * TOPK
// selections (bit i: selection i = token i / TOPK, slot i % TOPK chose the
// expert), set with atomicOr (the result does not depend on their order):
// an expert's count is the popcount of its words, and walking its set bits
// in word order lists its pairs in token order: n * TOPK / 32 words an
// expert instead of a scan of all n * TOPK selections.
__device__ __forceinline__ int router_plan(float* rsm, const int (&sid)[ROUTER_SELS], int n, int ch, int* items, int* pairs) {
    const int ns = n * TOPK;
    // The bitmap: word wd of expert e at bits[wd * N_EXPERTS + e] (a warp's
    // 32 experts read one word index from 32 banks). It lies past the top-k
    // tables, so zeroing it cannot race the gathering of the ids.
    const int nw = (ns + 31) / 32;
    u32* bits = reinterpret_cast<u32*>(rsm + ROUTER_PLAN_OFF);
    for (int i = threadIdx.x; i < nw * N_EXPERTS; i += blockDim.x) bits[i] = 0u;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < ROUTER_SELS; ++k) {
        const int i = threadIdx.x + 256 * k;
        // An id outside 0..N_EXPERTS-1 matches no expert and is not planned.
        if (i < ns && (unsigned)sid[k] < (unsigned)N_EXPERTS) atomicOr(bits + (i >> 5) * N_EXPERTS + sid[k], 1u << (i & 31));
    }
    __syncthreads();

    const int n_sh = (n + ch - 1) / ch;
    // Shared expert: pairs n*TOPK.. in token order, items 0..n_sh-1.
    for (int t = threadIdx.x; t < n; t += blockDim.x) pairs[n * TOPK + t] = t * MOE_SLOTS + TOPK;
    for (int i = threadIdx.x; i < n_sh; i += blockDim.x) {
        items[3 * i] = N_EXPERTS;
        items[3 * i + 1] = n * TOPK + i * ch;
        items[3 * i + 2] = min(ch, n - i * ch);
    }
    __shared__ int scan_tmp[ROUTER_ROWS];
    int item_base = n_sh, pair_base = 0;
    for (int e0 = 0; e0 < N_EXPERTS; e0 += 32 * ROUTER_ROWS) {
        const int e = e0 + threadIdx.x;
        const u32* eb = bits + min(e, N_EXPERTS - 1);
        int c = 0;
        if (e < N_EXPERTS)
            for (int wd = 0; wd < nw; ++wd) c += __popc(eb[wd * N_EXPERTS]);
        int tot_pairs, tot_items;
        const int poff = pair_base + block_scan_excl<ROUTER_ROWS>(c, scan_tmp, tot_pairs);
        const int ni = (c + ch - 1) / ch;
        const int ioff = item_base + block_scan_excl<ROUTER_ROWS>(ni, scan_tmp, tot_items);
        if (c > 0) {
            int pos = poff;
            for (int wd = 0; wd < nw; ++wd) {
                for (u32 b = eb[wd * N_EXPERTS]; b != 0u; b &= b - 1u) {
                    const int i = wd * 32 + __ffs(b) - 1;
                    pairs[pos++] = (i / TOPK) * MOE_SLOTS + (i % TOPK);
                }
            }
            for (int j = 0; j < ni; ++j) {
                items[3 * (ioff + j)] = e;
                items[3 * (ioff + j) + 1] = poff + j * ch;
                items[3 * (ioff + j) + 2] = min(ch, c - j * ch);
            }
        }
        pair_base += tot_pairs;
        item_base += tot_items;
    }
    return item_base;
}

// The plan of a one-token step, written by warp 0 alone from its top-k
// table when the token's TOPK ids are valid and distinct (always, unless
// its logits are not finite): the plan router_plan builds (the shared
// expert's item, then one item of one pair a selected expert in ascending
// id, the pair being the token's slot), without its block-wide bitmap,
// scans and barriers on the batch-1 critical path. Returns whether it
// wrote the plan (the same answer in every thread); otherwise the caller
// runs router_plan. Ends with a block barrier.
static_assert(TOPK < 32, "router_plan_one_token: a lane a selection and one more for the shared expert");
__device__ __forceinline__ bool router_plan_one_token(const RouterParams& p, const float* rsm) {
    __shared__ int s_fast;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp == 0) {
        const int* sel = reinterpret_cast<const int*>(rsm + ROUTER_ROWS * N_EXPERTS);  // token 0 = warp 0's table
        const int e = lane < TOPK ? sel[lane] : -1;
        int rank = 0;
        bool dup = false;
#pragma unroll
        for (int j = 0; j < TOPK; ++j) {
            const int ej = __shfl_sync(FULL_MASK, e, j);
            rank += ej < e ? 1 : 0;
            dup |= j != lane && ej == e;
        }
        const bool fast = __all_sync(FULL_MASK, lane >= TOPK || ((unsigned)e < (unsigned)N_EXPERTS && !dup));
        if (fast) {
            int* items = p.plan + PLAN_HEAD;
            int* pairs = items + 3 * p.max_items;
            if (lane < TOPK) {
                items[3 * (1 + rank)] = e;
                items[3 * (1 + rank) + 1] = rank;
                items[3 * (1 + rank) + 2] = 1;
                pairs[rank] = lane;  // token 0, slot lane
            } else if (lane == TOPK) {
                items[0] = N_EXPERTS;
                items[1] = TOPK;
                items[2] = 1;
                pairs[TOPK] = TOPK;  // token 0, the shared expert's slot
                p.plan[0] = 1 + TOPK;
                *p.ticket = 0;
            }
        }
        if (lane == 0) s_fast = fast ? 1 : 0;
    }
    __syncthreads();
    return s_fast != 0;
}

// The selections of one token chunk's block from its top-k tables (thread
// j: selection j = token j / TOPK, slot j % TOPK, up to ROUTER_TOK tokens).
__device__ __forceinline__ void router_sel_from_tables(const float* rsm, int ns, int (&sid)[ROUTER_SELS]) {
    const int* sel = reinterpret_cast<const int*>(rsm + ROUTER_ROWS * N_EXPERTS);
#pragma unroll
    for (int k = 0; k < ROUTER_SELS; ++k) {
        const int i = threadIdx.x + 256 * k;
        sid[k] = i < ns ? sel[i] : -1;
    }
}

// The tail of a router launch, after a block's logits are written: the last
// row block of its token chunk (ticket ticket[1 + blockIdx.y]) takes the
// top-k of the chunk's tokens, one warp each, and the last chunk to be
// routed (ticket[0]; with one chunk, that block at once) writes the plan.
// Both router kernels end with it, so their plans are built alike.
__device__ __forceinline__ void router_route_and_plan(const RouterParams& p, float* rsm, int t0, int nt) {
    // The last row block of this token chunk routes its tokens.
    if (!last_block_arrives(p.ticket + 1 + blockIdx.y, (int)gridDim.x)) return;
    router_topk(p, rsm, t0, nt, true);
    // The last chunk to be routed writes the plan. Thread j gathers the
    // expert ids of selections j, j + 256, ... (token * TOPK + slot).
    const int n = p.ntok, ns = n * TOPK;
    int sid[ROUTER_SELS];
    if (gridDim.y == 1) {
        // One token chunk (up to tok_chunk tokens): this block routed every
        // token and its selections are still in shared memory, [token][TOPK]
        // with token = warp: no second ticket, no reload from global memory
        // (two dependent round trips less on the batch-1 critical path).
        if (threadIdx.x == 0) p.ticket[1] = 0;
        if (n == 1 && router_plan_one_token(p, rsm)) return;
        router_sel_from_tables(rsm, ns, sid);
    } else {
        if (!last_block_arrives(p.ticket, (int)gridDim.y, p.ticket + 1 + blockIdx.y)) return;
        // All of a thread's loads in flight at once (one round trip).
#pragma unroll
        for (int k = 0; k < ROUTER_SELS; ++k) {
            const int i = threadIdx.x + 256 * k;
            sid[k] = i < ns ? ldcg_i32(p.topk_idx + i) : -1;
        }
    }
    int* items = p.plan + PLAN_HEAD;
    const int nitems = router_plan(rsm, sid, n, p.chunk, items, items + 3 * p.max_items);
    if (threadIdx.x == 0) {
        p.plan[0] = nitems;
        *p.ticket = 0;
    }
}

// grid (ceil((N_EXPERTS + 1) / ROUTER_ROWS), ceil(ntok / tok_chunk)), block
// 256 (ROUTER_ROWS warps): block (x, y) stages tokens y * tok_chunk..
// (normalised, warp k token k) in shared memory with their 16-column sums,
// and warp w computes row x * 8 + w (N_EXPERTS = the shared expert gate)
// for them (a warp's row against its chunk's tokens one after another, so
// smaller chunks shorten that chain; the bits do not depend on it). The
// last row block of a token chunk (ticket ticket[1 + y]) takes the top-k of
// its tokens, one warp each; the last chunk to finish (ticket[0]; with one
// chunk, that block at once) writes the plan. Dynamic smem (router_smem):
// max(ROUTER_TOK * (PADDED_LEN(HIDDEN) + HIDDEN / 16) + PADDED_LEN(HIDDEN)
// floats (staging), the plan's tables and selection bitmap).
extern "C" __global__ void __launch_bounds__(ROUTER_ROWS * 32) moe_router(const __grid_constant__ RouterParams p) {
    extern __shared__ __align__(16) float rsm[];
    const int warp = threadIdx.x >> 5;
    RouterRow rr;
    router_row_load(p, blockIdx.x * ROUTER_ROWS + warp, rr);
    router_gain_copy(p, rsm);
    pdl_trigger();
    pdl_wait();
    const int t0 = blockIdx.y * p.tok_chunk;
    const int nt = min(p.tok_chunk, p.ntok - t0);
    // The first row block also packs the tokens for the experts.
    router_stage(p, rsm, t0, nt, blockIdx.x == 0);
    router_dot(p, rsm, rr, t0, nt);

    router_route_and_plan(p, rsm, t0, nt);
}

// ---- moe_router_mma: the router's dot products on tensor cores -------------
//
// What moe_router computes (logits, shared gate, top-k, plan, and block 0's
// packed RMSNorm(h) and group sums for the experts, through the same
// staging arithmetic and the same tail, so px, csum and the plan's
// construction are the same code), with the 257 x HIDDEN 8-bit dot products
// on mma.sync m16n8k16 instead of one fp32 FMA chain a (row, token): the
// decode steps of the GEMM path (Options::router_mma_from), where moe_router
// spent ~11 of its ~21 us at 64 tokens staging and dotting (NOTES history
// 137: every one of its 33 row blocks normalises its 8 tokens, and each row
// reads every token's x from shared memory once).
//
// grid (ROUTER_MMA_TILES = ceil((N_EXPERTS + 1) / 16), ceil(ntok / tok_chunk)),
// block 256 (8 warps). Block (x, y): W rows 16x .. 16x + 15 (row N_EXPERTS
// = the shared expert gate; rows past it are zeros, never stored) against
// the chunk's up to ROUTER_TOK = 8 tokens; warp w takes the K range
// [256 w, 256 w + 256) (4 quantisation groups), its 32 words of codes a lane
// and its rows' scales and biases loaded before the dependency wait.
//
// Exactness, as qmm's matrix engine: x as fp16 hi + lo (px_split, ~22
// significant bits), the codes as fp16 subnormals (a byte b at bits 0-7 of a
// half is b 2^-24: w & 0x00FF00FF gives bytes 0 and 2 of a word, (w >> 8) &
// 0x00FF00FF bytes 1 and 3, one mask a pair), every product exact in fp32;
// per group y = sum q (hi + lo) 2^-24 and logit += (2^24 s) y + b sum(hi + lo).
// The logits are the fp32 ones to ~1e-7 (not moe_router's bits: another
// summation order), and a token's logits do not depend on the tokens beside
// it (each output element of an mma is its own column's dot product).
//
// The B operand (x): staged rows 2t (hi) and 2t + 1 (lo) of the chunk's
// token t, so n-tile nt holds tokens 4 nt .. 4 nt + 3 as (hi, lo) column
// pairs (qmm's order) and an accumulator pair (c0, c1) / (c2, c3) is one
// token's hi and lo sums. Within warp w's range, k16 step s (0..15) and
// position p (0..15) hold column 256 w + 4 j + byte with
//   j = 16 (s / 4) + 4 (p % 8 / 2) + s % 4,  byte = 2 (p % 2) + p / 8,
// which puts in lane (g, c)'s A fragment the two masks of word j of its rows
// g and g + 8 (a0 = (bytes 0, 2) at positions 2c, 2c + 1; a2 = (bytes 1, 3)
// at 2c + 8, 2c + 9), and makes steps 4q .. 4q + 3 exactly group q; a lane's
// 16 words of a row are 4 uint4 loads. Staged rows are HIDDEN + 8 halves,
// so ldmatrix's 8 rows fall in different banks.
//
// Dynamic shared memory (ROUTER_MMA_SMEM, qmm.rs router_mma_smem): the
// staged rows [2 ROUTER_TOK][RM_XROW] halves, the group sums of hi + lo
// [ROUTER_TOK][HIDDEN / 64], the warps' partial logits [8][16][ROUTER_TOK];
// later the tail's top-k tables and bitmap over the same bytes.
#if !defined(ROUTER_MMA_SMEM) || !defined(ROUTER_MMA_ROWS)
#error "ROUTER_MMA_SMEM and ROUTER_MMA_ROWS must be defined by the host (qmm.rs defines)"
#endif
#define RM_KW 256
#define RM_XROW (HIDDEN + 8)
#define RM_XSUM_OFF (2 * ROUTER_TOK * RM_XROW * 2)
#define RM_RED_OFF (RM_XSUM_OFF + ROUTER_TOK * (HIDDEN / GROUP_SIZE) * 4)
static_assert(ROUTER_MMA_ROWS == 16, "qmm.rs ROUTER_MMA_ROWS: a block's rows are one m16 tile");
static_assert(ROUTER_TOK == 8, "moe_router_mma: a chunk is two n-tiles of 4 tokens (hi, lo)");
// A warp a 256-column K range of 4 groups (the staging's column block): the
// model's width, 2,048 (qmm.rs `router_mma_fits`). The tiny test models are
// narrower; there the entry exists (every family's kernels load by name) but
// the launcher refuses it, and it traps if launched anyway.
#if HIDDEN == ROUTER_ROWS * RM_KW && GROUP_SIZE == 64
#define RM_FITS 1
#else
#define RM_FITS 0
#endif
static_assert(ROUTER_MMA_SMEM >= RM_RED_OFF + ROUTER_ROWS * ROUTER_MMA_ROWS * ROUTER_TOK * 4 &&
                  ROUTER_MMA_SMEM >= 4 * (ROUTER_PLAN_OFF + ROUTER_SEL_WORDS * N_EXPERTS),
              "qmm.rs router_mma_smem is smaller than moe_router_mma's shared-memory layout");

#if RM_FITS
extern "C" __global__ void __launch_bounds__(ROUTER_ROWS * 32, 2) moe_router_mma(const __grid_constant__ RouterParams p) {
    extern __shared__ __align__(16) float rsm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int row0 = blockIdx.x * ROUTER_MMA_ROWS;

    // Weights before the wait: words 64 w + 16 q + 4 c .. + 3 of rows g and
    // g + 8 (k16 steps 4 q .. 4 q + 3), scales (times 2^24, the codes' unit)
    // and biases of groups 4 w + q.
    uint4 wc[2][4];
    float ws[2][4], wb[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + g + 8 * h;
        const bool has = r <= N_EXPERTS, sgr = r == N_EXPERTS;
        const size_t rr = has && !sgr ? (size_t)r : 0;
        const u32* codes = sgr ? p.sg_codes : p.codes + rr * (HIDDEN / 4);
        const bf16* sc = sgr ? p.sg_scales : p.scales + rr * (HIDDEN / GROUP_SIZE);
        const bf16* bi = sgr ? p.sg_biases : p.biases + rr * (HIDDEN / GROUP_SIZE);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int gi = warp * (RM_KW / GROUP_SIZE) + q;
            wc[h][q] = has ? ld_stream_u4(codes + warp * (RM_KW / 4) + 16 * q + 4 * c) : make_uint4(0, 0, 0, 0);
            ws[h][q] = has ? bf16_to_f32(ld_nc_u16(sc + gi)) * 16777216.f : 0.f;
            wb[h][q] = has ? bf16_to_f32(ld_nc_u16(bi + gi)) : 0.f;
        }
    }
    // The lane's 8 columns of the norm gain (a weight).
    const int col = warp * RM_KW + lane * 8;
    const float4 ga = __ldg(reinterpret_cast<const float4*>(p.gain + col));
    const float4 gb = __ldg(reinterpret_cast<const float4*>(p.gain + col + 4));
    pdl_trigger();
    pdl_wait();

    const int t0 = blockIdx.y * p.tok_chunk;
    const int nt = min(p.tok_chunk, p.ntok - t0);
    u16* const xs = reinterpret_cast<u16*>(rsm);
    float* const xsum = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(rsm) + RM_XSUM_OFF);
    float* const red = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(rsm) + RM_RED_OFF);

    // Staging, as router_stage: warp w's column block w of each token, the
    // sum of squares in block order, then x = h r g.
    __shared__ __align__(16) float seg[ROUTER_TOK][ROUTER_ROWS];
    __shared__ float rinv[ROUTER_TOK];
#pragma unroll
    for (int k = 0; k < ROUTER_TOK; ++k) {
        if (k >= nt) break;
        const float* hr = p.h + (size_t)(t0 + k) * HIDDEN + col;
        const float ss = warp_sum(router_ss8(*reinterpret_cast<const float4*>(hr), *reinterpret_cast<const float4*>(hr + 4)));
        if (lane == 0) seg[k][warp] = ss;
    }
    __syncthreads();
    router_rinv<ROUTER_ROWS>(seg, rinv, nt, p.eps);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < ROUTER_TOK; ++k) {
        if (k >= nt) break;
        const int t = t0 + k;
        const float* hr = p.h + (size_t)t * HIDDEN + col;
        float o[8];
        router_norm8(*reinterpret_cast<const float4*>(hr), *reinterpret_cast<const float4*>(hr + 4), rinv[k], ga, gb, o);
        if (blockIdx.x == 0) {
            const float gs = group_sum8(px_store8(p.px, t, HIDDEN, col, o));
            if ((lane & 7) == 0) p.csum[(size_t)t * (HIDDEN / GROUP_SIZE) + col / GROUP_SIZE] = gs;
        }
        u16 hi[8], lo[8];
        float part = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            px_split(o[i], hi[i], lo[i]);
            part += f16_to_f32(hi[i]) + f16_to_f32(lo[i]);
        }
        const float gs = group_sum8(part);
        if ((lane & 7) == 0) xsum[k * (HIDDEN / GROUP_SIZE) + col / GROUP_SIZE] = gs;
        // Words 2 lane and 2 lane + 1 of the warp's range (the lane's 8
        // columns) to their step and positions.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int j = 2 * lane + half, i0 = 4 * half;
            const int s = 4 * (j >> 4) + (j & 3), cc = (j >> 2) & 3;
            const int pos = warp * RM_KW + 16 * s + 2 * cc;
            u16* const rh = xs + (2 * k) * RM_XROW + pos;
            u16* const rl = rh + RM_XROW;
            *reinterpret_cast<u32*>(rh) = hi[i0] | ((u32)hi[i0 + 2] << 16);
            *reinterpret_cast<u32*>(rh + 8) = hi[i0 + 1] | ((u32)hi[i0 + 3] << 16);
            *reinterpret_cast<u32*>(rl) = lo[i0] | ((u32)lo[i0 + 2] << 16);
            *reinterpret_cast<u32*>(rl + 8) = lo[i0 + 1] | ((u32)lo[i0 + 3] << 16);
        }
    }
    __syncthreads();

    // The dots: lane (g, c) keeps rows g / g + 8 of tokens c and 4 + c.
    // ldmatrix: lane l addresses row 8 (m / 2) + l % 8 (m = l / 8: n-tile
    // m / 2, positions 8 (m % 2) ..) of the step.
    const int m = lane >> 3;
    const u16* const bp = xs + (8 * (m >> 1) + (lane & 7)) * RM_XROW + warp * RM_KW + 8 * (m & 1);
    float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int sm = 0; sm < 4; ++sm) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3, bp + (4 * q + sm) * 16);
            const u32 wg = sm == 0 ? wc[0][q].x : sm == 1 ? wc[0][q].y : sm == 2 ? wc[0][q].z : wc[0][q].w;
            const u32 w8 = sm == 0 ? wc[1][q].x : sm == 1 ? wc[1][q].y : sm == 2 ? wc[1][q].z : wc[1][q].w;
            const u32 a0 = wg & 0x00FF00FFu, a1 = w8 & 0x00FF00FFu;
            const u32 a2 = (wg >> 8) & 0x00FF00FFu, a3 = (w8 >> 8) & 0x00FF00FFu;
            mma_f16(d[0], a0, a1, a2, a3, b0, b1);
            mma_f16(d[1], a0, a1, a2, a3, b2, b3);
        }
#pragma unroll
        for (int n8 = 0; n8 < 2; ++n8) {
            const float sx = xsum[(4 * n8 + c) * (HIDDEN / GROUP_SIZE) + warp * (RM_KW / GROUP_SIZE) + q];
            acc[n8][0] = fmaf(ws[0][q], d[n8][0] + d[n8][1], fmaf(wb[0][q], sx, acc[n8][0]));
            acc[n8][1] = fmaf(ws[1][q], d[n8][2] + d[n8][3], fmaf(wb[1][q], sx, acc[n8][1]));
        }
    }
    // The warps' K ranges summed in warp order: red[w][row][token].
#pragma unroll
    for (int n8 = 0; n8 < 2; ++n8) {
        red[(warp * ROUTER_MMA_ROWS + g) * ROUTER_TOK + 4 * n8 + c] = acc[n8][0];
        red[(warp * ROUTER_MMA_ROWS + g + 8) * ROUTER_TOK + 4 * n8 + c] = acc[n8][1];
    }
    __syncthreads();
    if ((int)threadIdx.x < ROUTER_MMA_ROWS * ROUTER_TOK) {
        const int r = row0 + (int)threadIdx.x / ROUTER_TOK, k = (int)threadIdx.x % ROUTER_TOK;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < ROUTER_ROWS; ++w) v += red[w * ROUTER_MMA_ROWS * ROUTER_TOK + threadIdx.x];
        if (k < nt && r < N_EXPERTS) p.logits[(size_t)(t0 + k) * N_EXPERTS + r] = v;
        else if (k < nt && r == N_EXPERTS) p.sg[t0 + k] = v;
    }
    router_route_and_plan(p, rsm, t0, nt);
}
#else
extern "C" __global__ void moe_router_mma(const __grid_constant__ RouterParams) { __trap(); }
#endif

// ---- the fused MoE of a small decode step -------------------------------------
//
// qmm_moe_fused: moe_router, qmm_moe_1 (gate/up) and qmm_moe_1 (down) of a
// step of up to MOE_FUSED_TOK tokens in one launch, the three separated by
// grid-wide barriers instead of kernel boundaries:
//   1. blocks 0..32 (ROUTER_ROWS rows each): router logits and shared gate,
//      block 0 also packs RMSNorm(h) for the experts (moe_router's code);
//   -- grid barrier --
//   2. every block: the top-k of every token and the plan, built in its own
//      shared memory (the same code as moe_router's last block, so the same
//      plan everywhere); block 0 publishes topk_idx / topk_w;
//   3. the gate/up tasks of the plan over the grid (qmm_run, 8 warps);
//   -- grid barrier --
//   4. the down tasks.
// Every value is computed by the same code in the same order as the three
// kernels, so the results are bit-identical to theirs. Measured slower than
// the three launches on the H200 (NOTES.md, history 36): a barrier costs
// ~1 us, and the phases, not the kernel boundaries, hold a step's time; so
// it is off by default (Options::fused_moe).
//
// The grid must be resident at once (the launcher sizes it from the
// occupancy, every SM's slots): blocks spin at the barriers. The kernel
// triggers its dependents at its start, which lets the next kernel launch
// only once every block of this one is running, so it cannot take the
// slots a block of this grid still waits for.
//
// Dynamic shared memory: the plan (MOE_FUSED_PLAN_BYTES: items [..][3],
// then the pairs), then one region used in turn by the router's staging
// (router_smem), the top-k tables and bitmap, and the 8 warps' weight
// rings with their partial sums.

#if !defined(MOE_FUSED_TOK) || !defined(MOE_FUSED_WARPS) || !defined(MOE_FUSED_PLAN_BYTES)
#error "MOE_FUSED_TOK, MOE_FUSED_WARPS and MOE_FUSED_PLAN_BYTES must be defined by the host (qmm.rs)"
#endif
static_assert(MOE_FUSED_WARPS == ROUTER_ROWS && MOE_FUSED_TOK <= ROUTER_TOK, "the fused kernel runs the router's block shape");
static_assert(MOE_FUSED_PLAN_BYTES % 16 == 0 &&
                  MOE_FUSED_PLAN_BYTES >= 4 * (3 * ((MOE_FUSED_TOK + 3) / 4 + MOE_FUSED_TOK * TOPK) + MOE_FUSED_TOK * MOE_SLOTS),
              "qmm.rs MOE_FUSED_PLAN_BYTES cannot hold the plan of MOE_FUSED_TOK tokens");

struct MoeFusedParams {
    RouterParams r;          // ticket and plan unused
    QmmMoeParams up;         // plan unused (it is in shared memory); smem_items sizes it
    QmmMoeParams down;
    unsigned long long* barrier;  // a counter that only grows (a multiple of the grid between launches)
    unsigned long long* trace;    // speed probes: [grid][MOE_TRACE_WORDS] stamps, or null
};
LAYOUT_CHECK(MoeFusedParams, MOE_FUSED_PARAMS_SIZE)

// All blocks of the grid meet. The counter is never reset: each block adds
// one, and waits for the next multiple of the grid size, so a launch needs
// only that every earlier launch on the counter had the same grid (64 bits
// do not wrap). A poll that never ends (a grid that could not be resident
// at once) traps instead of hanging: the step then fails with an error.
__device__ __forceinline__ void grid_sync(unsigned long long* ctr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned long long n = gridDim.x;
        __threadfence();
        const unsigned long long old = atomicAdd(ctr, 1ull);
        const unsigned long long target = (old / n + 1) * n;
        unsigned long long v;
        int polls = 0;
        while (true) {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory");
            if (v >= target) break;
            if (++polls > 1024) __nanosleep(100);
            if (polls > (1 << 25)) __trap();
        }
        __threadfence();
    }
    __syncthreads();
}

// Speed probes: block b's thread 0 stores at point i its %globaltimer (ns,
// comparable across SMs) in trace[b][i] and its SM's clock in
// trace[b][MOE_TRACE_POINTS + i]. Points: entry, after the dependency wait,
// router rows done, barrier 1 passed, plan built, gate/up done, barrier 2
// passed, down done.
#if !defined(MOE_TRACE_WORDS) || MOE_TRACE_WORDS % 2 != 0
#error "MOE_TRACE_WORDS (two words a point) must be defined by the host (qmm.rs)"
#endif
#define MOE_TRACE_POINTS (MOE_TRACE_WORDS / 2)
__device__ __forceinline__ void moe_stamp(unsigned long long* trace, int i) {
    if (trace != nullptr && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        trace[(size_t)blockIdx.x * MOE_TRACE_WORDS + i] = t;
        trace[(size_t)blockIdx.x * MOE_TRACE_WORDS + MOE_TRACE_POINTS + i] = clock64();
    }
}

extern "C" __global__ void __launch_bounds__(MOE_FUSED_WARPS * 32, 2) qmm_moe_fused(const __grid_constant__ MoeFusedParams p) {
    extern __shared__ __align__(16) unsigned char fsm[];
    moe_stamp(p.trace, 0);
    int* const plan = reinterpret_cast<int*>(fsm);
    float* const rsm = reinterpret_cast<float*>(fsm + MOE_FUSED_PLAN_BYTES);
    const int warp = threadIdx.x >> 5;
    const bool router_block = (int)blockIdx.x * ROUTER_ROWS <= N_EXPERTS;
    RouterRow rr;
    router_row_load(p.r, (int)blockIdx.x * ROUTER_ROWS + warp, rr);
    if (router_block) router_gain_copy(p.r, rsm);
    pdl_trigger();
    pdl_wait();
    moe_stamp(p.trace, 1);
    const int n = p.r.ntok;
    if (router_block) {
        router_stage(p.r, rsm, 0, n, blockIdx.x == 0);
        router_dot(p.r, rsm, rr, 0, n);
    }
    moe_stamp(p.trace, 2);
    grid_sync(p.barrier);
    moe_stamp(p.trace, 3);
    router_topk(p.r, rsm, 0, n, blockIdx.x == 0);
    int sid[ROUTER_SELS];
    router_sel_from_tables(rsm, n * TOPK, sid);
    const int nitems = router_plan(rsm, sid, n, p.r.chunk, plan, plan + 3 * p.up.smem_items);
    __syncthreads();  // the plan is complete, and the tables may be overwritten by the rings
    moe_stamp(p.trace, 4);
    {
        MoeJob job(p.up, plan, nitems);
        qmm_run<1, false, MoeJob, MOE_FUSED_WARPS, QmmPdl::None>(job, p.up.x, p.up.csum, HIDDEN, MOE_FUSED_PLAN_BYTES);
    }
    moe_stamp(p.trace, 5);
    grid_sync(p.barrier);
    moe_stamp(p.trace, 6);
    {
        MoeJob job(p.down, plan, nitems);
        qmm_run<1, true, MoeJob, MOE_FUSED_WARPS, QmmPdl::None>(job, p.down.x, nullptr, MOE_INTER, MOE_FUSED_PLAN_BYTES);
    }
    moe_stamp(p.trace, 7);
}
