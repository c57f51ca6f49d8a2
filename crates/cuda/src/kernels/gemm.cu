// gemm.cu: C = A W^T with W packed 4- or 8-bit, dequantised inside the tile,
// on tensor cores (mma.sync m16n8k16 fp16, fp32 accumulators).
//
// A: fp16 [rows][lda] activations; W: [experts][N][K] packed codes with bf16
// scales/biases per 64 columns (as stored). Each k-tile is exactly one
// quantisation group (GEMM_BK = 64), so a thread dequantises its 16-byte
// chunk of codes with one scale and one bias into the shared W tile:
// w = fp16(scale q + bias), as MLX's quantised matmul does with its
// activation type. 4-bit codes go two at a time through fp16x2 arithmetic
// (dq4_pair: a byte's two codes inside the mantissa of 8.0, one exact
// subtraction, one fused multiply-add rounding once to fp16; 4 instructions
// per two weights); 8-bit codes through fp32 (the 2^23 trick of
// byte_to_f32 in common.cuh, fmaf, a saturating conversion).
// 16-row 4-bit tiles (`DIRECT`) skip the W tile: each lane dequantises the
// values of its own mma B fragments from the raw codes in the ring, with
// the same arithmetic (so the same bits), which removes the tile's writes
// and ldmatrix reads from shared memory, the limit of these short tiles.
// 4-bit tiles of GEMM_WG_ROWS (64) rows and more (`WG`) run on wgmma with
// the roles swapped: C^T = W A^T, the 128 W rows of the block as the M side
// of two warpgroups (64 rows each, dequantised into registers by dq4_pair
// exactly as DIRECT does, so the weights have the same bits), the BM tokens
// as the N side, read by the tensor cores straight from the ring's A tile
// (K-major, 128-byte swizzle). No W tile, no ldmatrix, one wgmma per k16
// step for the whole tile instead of MF x NF mma.sync per warp; the
// products are the same fp16 x fp16 -> fp32, summed in another order.
//
// Tiles: BM rows of A x GEMM_BN = 128 rows of W, GEMM_THREADS = 256 threads
// = 8 warps. BM is a template parameter, compiled for every height of
// gemm.rs `TILE_ROWS` (16, 32, 64, 128, 144; entry points gemm_q{4,8}_bm{BM},
// 144 for 4-bit weights only, gemm.rs `compiled`):
//   BM = 144: WG only (below): one wgmma m64n144 a k16 step, so that a pass
//             of 257-288 rows (a 256-token chat turn and its template) is
//             two tiles instead of three, each W tile dequantised twice
//             instead of three times; 72 accumulators a thread, so a
//             k-tile's four k16 steps go as two groups of two (the
//             fragments of one group live at a time) to stay at two blocks
//             an SM, 128 registers, without spilling;
//   BM = 128: warps 2 (M) x 4 (N), warp tile 64 x 32 (4 x 4 mma tiles);
//   BM =  64: warps 2 x 4, warp tile 32 x 32;
//   BM =  32: warps 2 x 4, warp tile 16 x 32;
//   BM =  16: warps 1 x 8, warp tile 16 x 16.
// The W tile (128 x 64, two threads per row) and its dequantisation are the
// same at every height, so a short tile costs the weight traffic and the
// dequantisation but not the multiply-adds of empty rows. BN = 64 for the
// short tiles was considered and left out: the grouped expert GEMMs already
// launch thousands of blocks at short prompts, and the skinny dense GEMMs
// get their blocks from concatenation and split-K (below) without halving
// the W rows each thread dequantises per barrier.
//
// The weight ring (shared memory, per block):
//   fp16 W tile [128][72] | scales [128][16] | biases [128][16] |
//   ring of S stages, each { fp16 A tile [BM][72], raw W codes [128][32 or 64 B] }
// (DIRECT: no W tile; WG: no W tile, and the ring starts on the next
// 1024-byte boundary with A tiles [BM][64] in 128-byte-swizzled rows, the
// layout wgmma reads.) Per k-tile WG waits for its copies, fences them for
// the tensor cores (fence.proxy.async), meets at the barrier, issues the
// next copies, dequantises its two rows' codes into A fragments and runs
// the four k16 steps as one wgmma group, retired before the next k-tile.
// S = GEMM_WSTAGES_T* per tile height (gemm.rs TILE_WSTAGES: 4, 5, 5, 3 for
// 16, 32, 64, 128 rows). K-tile kt's A rows and W codes are copied by
// cp.async.cg (16 bytes; each thread copies the codes it later dequantises)
// into stage kt % S, S - 1 k-tiles ahead, one commit group per k-tile
// (empty past the split's end, so that cp.async.wait_group S - 2 always
// means "k-tile it has landed"). A block thus keeps S - 1 k-tiles of
// weights in flight where the register-staged pipeline before it kept one
// (4 KB of 4-bit codes at 4 blocks per SM: ~16 KB per SM, a Little's-law
// bound near 1.5 TB/s; now 3-4 k-tiles). Scales and biases are bf16 rows of
// K/64 (2-byte values, stride K/64 between W rows): a row's slots hold 16
// k-tiles, k-tile kt in slot kt % 16, filled 8 at a time by one 16-byte
// copy (thread part 0 the scales, part 1 the biases) issued with the
// split's first k-tile and every k-tile that starts a chunk; S - 1 <= 8
// keeps the chunk being overwritten two chunks away from the one being
// read. When K/64 is not a multiple of 8 (the tiny fixture's K = 64 or 128)
// or a scale pointer is not 16-byte aligned, a plain load stores each
// k-tile's value into the same slot when the k-tile is issued. Per k-tile:
//   wait_group S - 2; barrier (k-tile it landed everywhere; k-tile it - 1's
//   stage and the fp16 W tile are free); issue k-tile it + S - 1 into the
//   stage of it - 1; dequantise this thread's codes from stage it % S into
//   the fp16 W tile; barrier; mma over A stage it % S and the W tile.
// The A tile rides in the ring (rather than its own double buffer) so that
// one group per k-tile covers both operands; the taller tiles have fewer
// stages because their A tiles are large (gemm.rs checks the shared memory
// and blocks per SM of every height). crates/cuda/scripts/lanesim/
// sim_gemm.py is a block-level port of this index math and group
// accounting, checked without a GPU.
//
// Instruction budget: the short tiles are bound by instruction issue
// (Nsight Compute on gemm_q4_bm16: issue slots ~70% busy, DRAM ~35%). A
// thread dequantises 32 weights per k-tile, and that was most of the K
// loop: at BM = 16 the loop was 309 SASS instructions a warp per k-tile
// with the register pipeline, 257 with the ring and the fp32 in-place
// dequantisation (8 instructions per two weights), 194 with dq4_pair
// (4 per two weights), ~146 with the lane's offsets held across the loop
// (DIRECT; 64 of them the dequantisation); the rest is the ring's copies
// and bookkeeping. Nsight Compute at 256 tokens then: issue 0.69 a
// scheduler, stalls mostly "not selected", fixed latency and the math
// pipe (the f16x2 sub and fma of dq4_pair). Fewer instructions paid only
// at the same occupancy: 4 warps of 32 rows (-26% instructions, 20 warps
// an SM instead of 32) ran no faster (crates/cuda/NOTES.md history 85).
//
// Grouping (MoE prefill): `tiles` lists (expert, row start, row end) in the
// sorted row space (moe_plan, cut at the same BM), `a_rows` maps a sorted
// row to its A row (the token), and the expert offsets the weight pointers.
// Dense: no tiles, identity rows, blockIdx.y = M tile.
//
// Segments (dense only): up to GEMM_MAX_SEGS matrices that share A, K, the
// bit width and the mode run as one launch (the in-projections of a mixer;
// the router and the shared-expert gate); blockIdx.x runs over the
// concatenated N tiles, each segment has its own output and ldc. Small
// matrices (the DeltaNet a/b projections, 32 rows) then ride along with the
// big ones instead of occupying a whole launch of 2 blocks.
//
// Split-K (dense only; deterministic): blockIdx.z = split z takes k-tiles
// [z * kt_per_split, min(nk, (z + 1) * kt_per_split)) and writes its raw
// fp32 accumulators to partial[z][m][col] (col: the segment's col0 + n; in
// SwiGLU mode gate at col i, up at col N + i). gemm_splitk_reduce then sums
// the splits in order z = 0, 1, ... for every element and applies the mode,
// so the result does not depend on which block finishes first. The launcher
// (gemm.rs `plan_dense`) splits only launches of fewer blocks than one per
// SM: e.g. at 256 rows the router (+ gate) has 6 tiles of 32 serial k-tiles
// and out_proj 32 tiles of 64 k-tiles, each block walking K alone on its SM.
//
// Modes: 0 out_f32 = C; 1 out_f32 += C (residual add); 2 SwiGLU: the tile's
// W rows alternate 8 gate rows / 8 up rows of 64 intermediate rows, and
// out_f16[m][i] = silu(gate . a) * (up . a).

#define GM_LD (GEMM_BK + GEMM_PAD)

static_assert(GEMM_BK == GROUP_SIZE, "a k-tile is one quantisation group");
static_assert(GEMM_THREADS == 2 * GEMM_BN, "two threads dequantise each W row of a tile");

// One matrix of a launch (mirrored by gemm.rs `GemmSegC`).
struct GemmSeg {
    const u32* codes;
    const bf16* scales;
    const bf16* biases;
    const u32* codes2;       // up projection (mode 2)
    const bf16* scales2;
    const bf16* biases2;
    float* out_f32;
    f16* out_f16;
    int n;                   // W rows (mode 2: intermediate rows)
    int ldc;
    int tile0;               // first blockIdx.x of this segment
    int col0;                // first column of this segment in a partial row
};
LAYOUT_CHECK(GemmSeg, GEMM_SEG_BYTES)

struct GemmParams {
    const f16* a;
    const int* a_rows;       // sorted row -> A row, or null
    const int* tiles;        // [max_tiles][3] or null
    const int* ntiles;       // device count of tiles, or null
    float* partial;          // split-K partials [splits][M][ncols], or null
    long long e_codes;       // words per expert
    long long e_groups;      // scale/bias entries per expert
    GemmSeg seg[GEMM_MAX_SEGS];
    int nseg;
    int lda;
    int M;                   // rows (dense)
    int K;
    int mode;
    int kt_per_split;        // k-tiles per blockIdx.z (all of K: no split)
    int splits;
    int ncols;               // columns of a partial row
    int pdl;                 // launched with programmatic dependent launch (gemm.rs pdl_launch)
    int pad_;
};
LAYOUT_CHECK(GemmParams, GEMM_PARAMS_BYTES)

// The segment of N tile `bx` (segments in ascending tile0). The kernel then
// reads the segment's fields from the parameter space at this index where
// it needs them, rather than holding a copy in registers across the K loop.
__device__ __forceinline__ int gemm_seg_of_tile(const GemmParams& p, int bx) {
    int s = 0;
#pragma unroll
    for (int i = 1; i < GEMM_MAX_SEGS; ++i)
        if (i < p.nseg && bx >= p.seg[i].tile0) s = i;
    return s;
}

// The 4-bit codes of one byte of `w` (the byte `sel` names: prmt selector
// 0x4_4_ with the byte's index in both low nibbles), dequantised into one
// f16x2 word: {fp16(q_lo * s + b), fp16(q_hi * s + b)} with q_lo the low
// nibble (lower k) and q_hi the high one, from s2 = {128 s, 8 s} and
// b2 = {b, b} (dq4_scale2, dq4_bias2). Four instructions for two weights:
//   prmt   the byte into bits 0-7 and 16-23, zeros elsewhere;
//   lop3   (t & 0x00F0000F) | 0x48004800: the halves are 8 + q_lo / 128 and
//          8 + 16 q_hi / 128 (the code inside the mantissa of 8.0, exact);
//   sub    8 from both halves: q_lo / 128 and q_hi / 8, exact;
//   fma    with {128 s, 8 s} and {b, b}: one rounding of the exact
//          q s + b to fp16 (the product of a power of two is exact).
// This equals fp16(fmaf(s, q, b)) (MLX's dequantisation in fp32, then
// rounded to the activation type) except where the fp32 sum itself had to
// round onto an fp16 tie (|b| below 2^-24 |q s|), and it needs s and b to
// be fp16 values once scaled: 2^-20 <= |s| <= 511 (or 0), |b| >= 2^-17
// (or 0), |w| <= 65504 (a larger weight becomes inf, where the fp32 path
// saturated). Trained weights' groups sit far inside (scales ~1e-4..1e-1);
// outside, the weight is still fp16-rounded but may differ from the fp32
// path in its last bits: e.g. a group of equal weights, which MLX stores
// with its 1e-7 floor as the scale, whose codes then add less than 2e-6.
// The fp32 path took 8 instructions a pair (a shift, 2 lop3, 2 fadd, 2
// fma, a cvt); the short expert tiles are bound by instruction issue.
__device__ __forceinline__ u32 dq4_pair(u32 w, u32 sel, u32 s2, u32 b2, u32 magic8) {
    u32 t;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(t) : "r"(w), "r"(sel));
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(t) : "r"(t), "n"(0x00F0000Fu), "r"(magic8));   // (t & mask) | magic
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(t) : "r"(t), "r"(magic8));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(t) : "r"(t), "r"(s2), "r"(b2));
    return t;
}
// The prmt selector of byte i (0-3) for dq4_pair.
__device__ __forceinline__ u32 dq4_sel(u32 i) { return i | 0x40u | (i << 8) | 0x4000u; }
// {128 s, 8 s} and {b, b} as f16x2 (exact in the range dq4_pair states).
__device__ __forceinline__ u32 dq4_scale2(float s) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(s * 8.f), "f"(s * 128.f));
    return r;
}
__device__ __forceinline__ u32 dq4_bias2(float b) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(b));
    return r;
}

// ---- wgmma (the 4-bit tiles of GEMM_WG_ROWS rows and more) -------------------
// W is the A operand, from registers: warp wi of a warpgroup holds W rows
// 16 wi .. 16 wi + 15 of the group's 64 in the m16n8k16 A-fragment layout
// (lane (g, c): a0 row g, k 2c..2c+1; a1 row g + 8; a2 row g, k 2c+8..;
// a3 row g + 8, k 2c+8..), which is what dq4_pair makes from byte c of a
// row's words 2 ks and 2 ks + 1 (the DIRECT tiles' B fragments). The
// activations are the B operand (N = the tile's BM tokens), read by the
// tensor cores from the ring's A tile, stored K-major in 128-byte rows with
// the 128-byte swizzle (16-byte chunk j of row r at chunk j ^ (r & 7)). The
// accumulator of lane (g, c) of warp wi, value 4 j + v: W row 16 wi + g +
// 8 (v >> 1), token 8 j + 2 c + (v & 1).

// The descriptors, fences, waits and products of wgmma are in common.cuh.
template <int N>
__device__ __forceinline__ void wgmma_tile(float* d, const u32* a, unsigned long long desc) {
    static_assert(N == 64 || N == 128 || N == 144, "wgmma tile widths compiled: 64, 128, 144");
    if constexpr (N == 64) wgmma_rs_m64n64<0>(d, a, desc);
    else if constexpr (N == 128) wgmma_rs_m64n128<0>(d, a, desc);
    else wgmma_rs_m64n144<0>(d, a, desc);
}

// SPLIT: the split-K entry (gemm.rs picks it for launches of 2+ K splits,
// with p.partial set), whose epilogue writes the split's raw sums to the
// partials. In the unsplit entry the partial row is null at compile time,
// so its per-value tests fold away (NOTES history 192). The split entry
// still carries the output path behind its tests of the row: ptxas does not
// prove it dead, and writing the tests as `if constexpr (SPLIT)` instead
// made two entries spill (session 55), so they stay as they are.
template <int BITS, int BM, int S, int SMEM, bool SPLIT>
__device__ __forceinline__ void gemm_body(const GemmParams& p) {
    constexpr int BN = GEMM_BN, BK = GEMM_BK, LD = GM_LD, NT = GEMM_THREADS, SG = GEMM_SCHUNK;
    constexpr int WM = BM >= 32 ? 2 : 1;          // warps along M
    constexpr int WN = NT / 32 / WM;              // warps along N
    constexpr int WTM = BM / WM, WTN = BN / WN;   // warp tile
    constexpr int MF = WTM / 16, NF = WTN / 8;    // m16 / n8 mma tiles per warp
    constexpr int RB = BK * BITS / 8;             // bytes of codes of a W row per k-tile (32 or 64)
    // WG (4-bit tiles of GEMM_WG_ROWS rows and more): wgmma, W from
    // registers dequantised as in DIRECT, the A tile read by the tensor
    // cores from the ring (128-byte swizzled rows, no padding); no W tile.
    constexpr bool WG = BITS == 4 && BM >= GEMM_WG_ROWS;
    // The mma.sync warp tiling (every tile but WG; 144 rows are WG only).
    static_assert(WG || (WTM % 16 == 0 && MF >= 1), "whole m16 tiles per warp");
    static_assert(NF % 2 == 0, "n8 tiles in pairs (one ldmatrix_x4; a SwiGLU gate/up pair)");
    static_assert(!WG || GEMM_THREADS == 256, "WG: two warpgroups of 64 W rows");
    constexpr int ALD = WG ? BK : LD;             // A tile row stride (halves)
    constexpr int A_BYTES = BM * ALD * 2;         // a ring stage: the A tile, then the W codes
    constexpr int STAGE = A_BYTES + BN * RB;
    constexpr int SROW = 2 * SG;                  // scale (bias) slots of a row: two chunks, k-tile kt in kt % SROW
    // Direct (16-row 4-bit tiles, the experts of short prompts): each lane
    // dequantises the W values of its own B fragments straight from the raw
    // codes in the ring (dq4_pair, so the same bits as the W tile), and no
    // fp16 W tile is allocated: Nsight Compute showed these tiles bound by
    // shared-memory traffic (L1/shared at ~80%, DRAM at ~32%), of which
    // writing the W tile and reading it back by ldmatrix was ~60%.
    constexpr bool DIRECT = BITS == 4 && BM == GEMM_DIRECT_ROWS && !WG;
    constexpr int S_OFF = (DIRECT || WG) ? 0 : BN * LD * 2;   // byte offsets: scales, biases, ring
    constexpr int B_OFF = S_OFF + BN * SROW * 2;
    constexpr int R_OFF = B_OFF + BN * SROW * 2;
    static_assert(S >= 2, "a ring of at least two k-tiles");
    static_assert(S - 1 <= SG, "the k-tiles in flight span at most two scale chunks");
    static_assert(SG * 2 == 16, "a scale chunk of a row is one 16-byte copy");
    constexpr int SLACK = WG ? 1024 : 0;          // WG: the ring starts on a 1024-byte boundary (swizzle atoms)
    static_assert(!WG || (STAGE % 1024 == 0 && A_BYTES % 1024 == 0), "WG: stages of whole swizzle atoms");
    static_assert(R_OFF + S * STAGE + SLACK == SMEM, "shared memory differs from gemm.rs smem_bytes");

    extern __shared__ __align__(16) unsigned char gm_smem[];
    f16* sW = reinterpret_cast<f16*>(gm_smem);                      // [BN][LD] fp16 W tile
    bf16* sS = reinterpret_cast<bf16*>(gm_smem + S_OFF);            // [BN][SROW] scales
    const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned wm = warp / WN, wn = warp % WN;

    // Programmatic dependent launch (p.pdl: gemm.rs pdl_launch): the next
    // kernel may start launching now and waits for this one in its own
    // pdl_wait. This kernel reads what the previous one wrote (A, and a
    // grouped launch's tile list) only after its pdl_wait: at once for a
    // grouped launch, after its first weights were requested for a dense
    // one (below). Without it pdl_wait returns at once.
    if (p.pdl) pdl_trigger();
    if (p.tiles != nullptr) pdl_wait();
    int e = 0, m0, m1;
    if (p.tiles != nullptr) {
        if ((int)blockIdx.y >= *p.ntiles) return;
        const int* tl = p.tiles + 3 * blockIdx.y;
        e = tl[0];
        m0 = tl[1];
        m1 = tl[2];
    } else {
        m0 = blockIdx.y * BM;
        m1 = min(p.M, m0 + BM);
        if (m0 >= m1) return;
    }
    const int kt0 = blockIdx.z * p.kt_per_split;
    const int kt1 = min(p.K / BK, kt0 + p.kt_per_split);
    if (kt0 >= kt1) return;
    const GemmSeg& sg = p.seg[gemm_seg_of_tile(p, blockIdx.x)];
    const bool swiglu = p.mode == 2;
    const int n0 = ((int)blockIdx.x - sg.tile0) * (swiglu ? BN / 2 : BN);
    const int wpr = p.K * BITS / 32;          // words per W row
    const int gpr = p.K / GROUP_SIZE;         // groups per W row

    // This thread's W row in the tile and its source.
    const int tr = (int)(tid >> 1);
    constexpr int LPT = RB / 32;              // 16-byte chunks per thread per k-tile (1 or 2)
    constexpr int CPU4 = 128 / BITS;          // codes per uint4 (32 or 16)
    const int part = (int)(tid & 1);
    int wrow;
    const u32* wc;
    const bf16 *ws, *wb;
    if (swiglu) {
        const int j8 = tr >> 3;
        wrow = n0 + (j8 >> 1) * 8 + (tr & 7);
        const bool up = j8 & 1;
        wc = (up ? sg.codes2 : sg.codes) + e * p.e_codes;
        ws = (up ? sg.scales2 : sg.scales) + e * p.e_groups;
        wb = (up ? sg.biases2 : sg.biases) + e * p.e_groups;
    } else {
        wrow = n0 + tr;
        wc = sg.codes + e * p.e_codes;
        ws = sg.scales + e * p.e_groups;
        wb = sg.biases + e * p.e_groups;
    }
    const bool wvalid = wrow < sg.n;
    // Scales and biases come in chunks of SG k-tiles per row, one 16-byte
    // cp.async each, when every row's chunk is 16-byte aligned (K a
    // multiple of SG groups: every production matrix); else (the tiny
    // fixture's K = 64/128, or an unaligned pointer) a plain load per
    // k-tile stores them into the same slots when the k-tile is issued.
    // The same for both threads of a row.
    const bool sring = gpr % SG == 0 && ((reinterpret_cast<size_t>(ws) | reinterpret_cast<size_t>(wb)) & 15) == 0;
    const size_t wr = wvalid ? wrow : 0;
    // Sources: this thread's codes of its row from the split's first k-tile
    // on (advanced a k-tile per copy); the row's scales (thread part 0) or
    // biases (part 1), by absolute k-tile (chunks are aligned to SG groups).
    const u32* wsrc = wc + wr * wpr + (size_t)kt0 * (BK * BITS / 32) + part * LPT * 4;
    const bf16* wrow_sb = (part ? wb : ws) + wr * gpr;
    const int nkt = kt1 - kt0;
    if (p.tiles == nullptr) {
        // A dense launch's weights are no kernel's output: the lines of
        // this thread's codes for the ring's first S - 1 k-tiles, and its
        // row's scales (part 0) or biases (part 1), go to L2 while the
        // previous kernel finishes (at 33-128 decode tokens, the launches
        // pdl_launch picks, a block walks a few k-tiles, and its first DRAM
        // round trip was on the step's chain).
        if (p.pdl && wvalid) {
            constexpr int KT_LINE = 128 / RB;     // k-tiles of a row's codes in one 128-byte line
            for (int i = 0; i < S - 1 && i < nkt; i += KT_LINE) l2_prefetch(wsrc + (size_t)i * (BK * BITS / 32));
            l2_prefetch(wrow_sb + kt0);
        }
        pdl_wait();
    }

    // 32-bit shared addresses of what this thread copies (the base made
    // opaque so that the compiler keeps it rather than recomputing it).
    u32 s_base = smem_u32(gm_smem);
    asm volatile("" : "+r"(s_base));
    const u32 r_off = WG ? ((s_base + R_OFF + 1023u) & ~1023u) - s_base : (u32)R_OFF;   // the ring's byte offset
    const u32 s_ring = s_base + r_off;
    const u32 s_wq = s_ring + A_BYTES + tr * RB + part * LPT * 16;       // its codes in stage 0
    const int sb_slot = (part ? B_OFF - S_OFF : 0) / 2 + tr * SROW;     // its scale/bias slots (bf16 from sS)
    const unsigned char* ring_wq = gm_smem + r_off + A_BYTES + tr * RB + part * LPT * 16;

    u32 magic8 = 0x48004800u;                     // {8.0, 8.0} in a register (dq4_pair)
    asm volatile("" : "+r"(magic8));
    const u32 dsel = dq4_sel(lane & 3);            // DIRECT: byte c = lane % 4 of each word
    // Dequantise this thread's codes of a k-tile (LPT uint4 in shared memory)
    // into its half row of the fp16 W tile: w = fp16(scale q + bias), 4-bit
    // by dq4_pair (a byte's two codes at a time), 8-bit in fp32, saturated.
    auto store_w = [&](const uint4* src, float wsc, float wbi) {
        f16* dst = sW + tr * LD + part * LPT * CPU4;
        const u32 s2 = dq4_scale2(wsc), b2 = dq4_bias2(wbi);
#pragma unroll
        for (int i = 0; i < LPT; ++i) {
            const uint4 q = src[i];
            const u32 wv[4] = {q.x, q.y, q.z, q.w};
            u32 packed[CPU4 / 2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (BITS == 4) {
                    // Byte i holds the codes of k 8j + 2i, +1.
#pragma unroll
                    for (int i = 0; i < 4; ++i) packed[j * 4 + i] = dq4_pair(wv[j], dq4_sel(i), s2, b2, magic8);
                } else {
#pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        const float lo = fmaf(wsc, byte_to_f32(wv[j], 2 * k), wbi);
                        const float hi = fmaf(wsc, byte_to_f32(wv[j], 2 * k + 1), wbi);
                        packed[j * 2 + k] = pack_f16x2_sat(lo, hi);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < CPU4 / 8; ++j)
                reinterpret_cast<uint4*>(dst + i * CPU4)[j] =
                    make_uint4(packed[4 * j], packed[4 * j + 1], packed[4 * j + 2], packed[4 * j + 3]);
        }
    };
    // A rows of this tile: BM * BK / 8 chunks of 16 bytes (fewer than the
    // threads when BM = 16).
    constexpr int CPR = BK / 8;                  // chunks per A row
    constexpr int A_CHUNKS = BM * CPR;
    constexpr int A_ITERS = (A_CHUNKS + NT - 1) / NT;
    // Element offsets (from p.a) of this thread's A chunks at the split's
    // first k-tile, computed once: 32-bit, so the K loop holds one register
    // per chunk, not a pointer; rows past the tile read row 0, zero-filled.
    int a_off[A_ITERS];
    // With one chunk a thread (BM <= 32), its source as a pointer advanced a
    // k-tile per copy instead of recomputed from p.a at every k-tile.
    const f16* a_src = p.a;
    u32 a_ok = 0;                                // bit i: chunk i is a row of the tile
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
        const unsigned idx = tid + i * NT;
        const int m = m0 + (int)(idx / CPR);
        const bool ok = (A_CHUNKS % NT == 0 || idx < A_CHUNKS) && m < m1;
        const int arow = ok ? (p.a_rows != nullptr ? p.a_rows[m] : m) : 0;
        a_off[i] = arow * p.lda + kt0 * BK + (int)(idx % CPR) * 8;
        if (A_ITERS == 1) a_src += a_off[i];
        a_ok |= (u32)ok << i;
    }
    // Copies of k-tile `it` of the split (if any) into the ring stage at
    // byte offset `stage`, as one commit group: its A tile, this thread's
    // codes of its W row and, at the split's first k-tile and every
    // SG-aligned one, the row's chunk of SG scales (part 0) or biases
    // (part 1). A group is committed even when there is nothing to copy, so
    // that group g is always k-tile g and cp.async.wait_group counts stages.
    auto issue = [&](int it, u32 stage) {
        if (it < nkt) {
#pragma unroll
            for (int i = 0; i < A_ITERS; ++i) {
                const unsigned idx = tid + i * NT;
                if (A_CHUNKS % NT == 0 || idx < A_CHUNKS)
                {
                    const unsigned r = idx / CPR, j = idx % CPR;
                    const u32 dst = WG ? r * (BK * 2) + ((j ^ (r & 7)) << 4) : r * LD * 2 + j * 16;
                    cp_async16_or_zero(s_ring + stage + dst, A_ITERS == 1 ? a_src : p.a + a_off[i] + it * BK, (a_ok >> i) & 1u);
                }
            }
#pragma unroll
            for (int i = 0; i < LPT; ++i) cp_async16_or_zero(s_wq + stage + 16 * i, wsrc + 4 * i, wvalid);
            wsrc += BK * BITS / 32;
            a_src += BK;
            const unsigned kt = (unsigned)(kt0 + it);
            if (sring) {
                if (it == 0 || kt % SG == 0)
                    cp_async16_or_zero(s_base + S_OFF + 2 * (sb_slot + (kt & SG)), wrow_sb + (kt & ~(unsigned)(SG - 1)), wvalid);
            } else {
                sS[sb_slot + kt % SROW] = wvalid ? ld_nc_u16(wrow_sb + kt) : (bf16)0;
            }
        }
        cp_async_commit();
    };

    // DIRECT and WG: the 8 code words of W row `row` of a ring stage's
    // codes `wq` (4-bit: 32 bytes a row).
    auto row_codes = [&](const unsigned char* wq, int row, u32* w) {
        const uint4 q0 = *reinterpret_cast<const uint4*>(wq + row * RB);
        const uint4 q1 = *reinterpret_cast<const uint4*>(wq + row * RB + 16);
        w[0] = q0.x;
        w[1] = q0.y;
        w[2] = q0.z;
        w[3] = q0.w;
        w[4] = q1.x;
        w[5] = q1.y;
        w[6] = q1.z;
        w[7] = q1.w;
    };
    // WG: a lane dequantises W rows g and g + 8 (g = lane / 4),
    // as do the other three lanes of its quad, so their four dq4_pair
    // words, {128 s, 8 s} and {b, b} of each row at scale slot `slot`, are
    // converted once a quad: lane c takes row g + 8 (c / 2), the scale
    // (c even) or the bias (c odd), and the quad swaps them (4 shuffles
    // where each lane converted all four: 16 instructions a k-tile a lane
    // down to 9). The same operations as dq4_scale2 / dq4_bias2 (a bias
    // is scaled by 1, exactly), so the same bits. q_sb: this lane's slot
    // offset from sS, made opaque by the caller.
    const float q_mhi = (lane & 1) ? 1.f : 8.f, q_mlo = (lane & 1) ? 1.f : 128.f;
    auto quad_scales = [&](u32 q_sb, unsigned slot, u32 (&s2)[2], u32 (&b2)[2]) {
        const float f = bf16_to_f32(sS[q_sb + slot]);
        u32 mine;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(mine) : "f"(f * q_mhi), "f"(f * q_mlo));
        const int base = (int)(lane & ~3u);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            s2[h] = __shfl_sync(0xffffffffu, mine, base + 2 * h);
            b2[h] = __shfl_sync(0xffffffffu, mine, base + 2 * h + 1);
        }
    };
    // The quad's value of this lane (above), for W row `row` (its g).
    auto quad_slot = [&](int row) {
        u32 o = (u32)(row + 8 * (int)((lane & 3) >> 1)) * SROW + (lane & 1) * ((B_OFF - S_OFF) / 2);
        asm volatile("" : "+r"(o));
        return o;
    };
    float acc[WG ? 1 : MF][NF][4];
#pragma unroll
    for (int i = 0; i < (WG ? 1 : MF); ++i)
#pragma unroll
        for (int j = 0; j < NF; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    // WG: the warpgroup's 64 W rows x BM tokens (module comment above wgmma).
    float wacc[WG ? BM / 2 : 1];
#pragma unroll
    for (int i = 0; i < (WG ? BM / 2 : 1); ++i) wacc[i] = 0.f;
    const int wg_row = (int)(warp >> 2) * 64 + (int)(warp & 3) * 16 + (int)(lane >> 2);   // WG: W row g of the warp

    // The ring: k-tile it + S - 1 is copied while k-tile it is dequantised
    // and multiplied, so S - 1 k-tiles of weights are in flight per block.
#pragma unroll
    for (int s = 0; s < S - 1; ++s) issue(s, s * STAGE);
    u32 rd = 0;                                   // byte offset of the stage of k-tile it
    // DIRECT: this lane's fixed offsets (bytes from gm_smem: its first
    // row's codes in stage 0 and its A fragment row; bf16 slots from sS:
    // its first row's scales), made opaque so that the compiler keeps them
    // in registers instead of recomputing them from the lane at every
    // k-tile.
    u32 d_codes = 0, d_sb = 0, d_a = 0;
    if constexpr (DIRECT) {
        static_assert(WM == 1 && MF == 1, "DIRECT: one m16 tile, every warp along N");
        const u32 row0 = wn * WTN + (lane >> 2);
        d_codes = r_off + A_BYTES + row0 * RB;
        d_sb = row0 * SROW;
        d_a = r_off + ((lane & 15) * LD + (lane >> 4) * 8) * 2;
        asm volatile("" : "+r"(d_codes), "+r"(d_sb), "+r"(d_a));
    }
    const u32 wg_sb = WG ? quad_slot(wg_row) : 0u;   // WG: this lane's quad value
    const bf16* my_s = sS + tr * SROW;
    const bf16* my_b = my_s + (B_OFF - S_OFF) / 2;
    if constexpr (WG) {
        for (int it = 0; it < nkt; ++it) {
            const unsigned slot = (unsigned)(kt0 + it) % SROW;
            // As below, and the landed copies made visible to the tensor
            // cores; the barrier also ends k-tile it - 1, whose wgmma every
            // warpgroup waited for.
            cp_async_wait<S - 2>();
            fence_proxy_async();
            __syncthreads();
            issue(it + S - 1, rd == 0 ? (S - 1) * STAGE : rd - STAGE);
            // af[ks] = {row g words 2ks, row g + 8 words 2ks, row g words
            // 2ks + 1, row g + 8 words 2ks + 1}, byte c of each (a quad
            // reads the same rows).
            const unsigned char* wq = gm_smem + r_off + rd + A_BYTES;
            u32 qs2[2], qb2[2];
            quad_scales(wg_sb, slot, qs2, qb2);
            const u32 a_tile = s_ring + rd;
            // The k-tile's k16 steps in WG_PARTS groups of KP, each
            // dequantised, then issued and retired before the next (one
            // group up to 128 rows: a version that dequantised k-tile it + 1
            // while this group ran, double-buffered fragments and one more
            // stage, measured the same at 256 and 4,096 tokens, the other
            // warpgroups of the SM already keeping the tensor cores fed; at
            // 144 rows two, so that 72 accumulators and the fragments of
            // two k16 steps fit 128 registers without spilling).
            // (wacc holds BM / 2 accumulators a thread: 64 at 128 rows.)
            constexpr int WG_PARTS = BM / 2 > 64 ? 2 : 1, KP = BK / 16 / WG_PARTS;
#pragma unroll
            for (int part = 0; part < WG_PARTS; ++part) {
                // af[j] = k16 step ks = KP part + j: {row g words 2ks, row
                // g + 8 words 2ks, row g words 2ks + 1, row g + 8 words
                // 2ks + 1}, byte c of each (a quad reads the same rows).
                u32 af[KP][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    u32 w8[8];
                    row_codes(wq, wg_row + 8 * h, w8);
#pragma unroll
                    for (int j = 0; j < KP; ++j) {
                        const int ks = KP * part + j;
                        af[j][h] = dq4_pair(w8[2 * ks], dsel, qs2[h], qb2[h], magic8);
                        af[j][2 + h] = dq4_pair(w8[2 * ks + 1], dsel, qs2[h], qb2[h], magic8);
                    }
                }
                wgmma_fence();
#pragma unroll
                for (int j = 0; j < KP; ++j) wgmma_tile<BM>(wacc, af[j], wg_desc_sw128(a_tile + (KP * part + j) * 32));
                wgmma_commit();
                wgmma_wait<0>();
            }
            rd = rd == (S - 1) * STAGE ? 0 : rd + STAGE;
        }
#pragma unroll
        for (int i = 0; i < (WG ? BM / 2 : 1); ++i) wg_reg_fence(wacc[i]);
    } else {
        for (int it = 0; it < nkt; ++it) {
            const unsigned slot = (unsigned)(kt0 + it) % SROW;
            // Group it landed (S - 2 younger groups may be pending) for this
            // thread; the barrier makes every thread's copies visible and ends
            // k-tile it - 1 (its stage and the fp16 W tile are free again).
            cp_async_wait<S - 2>();
            __syncthreads();
            issue(it + S - 1, rd == 0 ? (S - 1) * STAGE : rd - STAGE);
            // DIRECT: lane (g, c) needs, of W row wn WTN + 8 nf + g, the codes
            // 16 ks + 2c, +1 (b0) and 16 ks + 8 + 2c, +1 (b1): byte c of the
            // row's words 2 ks and 2 ks + 1. Its two rows' 32 bytes are read
            // once (a quad reads the same row: a broadcast), with their scales.
            u32 dw[DIRECT ? NF : 1][8];
            u32 ds2[DIRECT ? NF : 1], db2[DIRECT ? NF : 1];
            if constexpr (DIRECT) {
                // Row wn WTN + 8 nf + g: its codes at d_codes + rd + 8 nf RB,
                // its scale at d_sb + 8 nf SROW (+ the bias plane). Each lane
                // converts its own (quad_scales' shuffles made these tiles
                // 1.3% slower at 256 tokens: NOTES history 94).
                const unsigned char* wq = gm_smem + d_codes + rd;
                const bf16* ssl = sS + d_sb + slot;
#pragma unroll
                for (int nf = 0; nf < NF; ++nf) {
                    row_codes(wq, nf * 8, dw[nf]);   // row 8 nf from the lane's first
                    ds2[nf] = dq4_scale2(bf16_to_f32(ssl[nf * 8 * SROW]));
                    db2[nf] = dq4_bias2(bf16_to_f32(ssl[(B_OFF - S_OFF) / 2 + nf * 8 * SROW]));
                }
            } else {
                store_w(reinterpret_cast<const uint4*>(ring_wq + rd), bf16_to_f32(my_s[slot]), bf16_to_f32(my_b[slot]));
                __syncthreads();
            }
            const f16* a_s = reinterpret_cast<const f16*>(gm_smem + r_off + rd);
            const f16* a_lane = reinterpret_cast<const f16*>(gm_smem + d_a + rd);   // DIRECT
            const f16* w_s = sW;
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) {
                u32 af[MF][4];
#pragma unroll
                for (int mf = 0; mf < MF; ++mf)
                    ldmatrix_x4(af[mf][0], af[mf][1], af[mf][2], af[mf][3],
                                DIRECT ? a_lane + ks * 16
                                       : a_s + (wm * WTM + mf * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
                u32 bf[NF][2];
                if constexpr (DIRECT) {
                    // Byte c's low nibble is code 2c, its high one 2c + 1.
#pragma unroll
                    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
                        for (int h = 0; h < 2; ++h) bf[nf][h] = dq4_pair(dw[nf][2 * ks + h], dsel, ds2[nf], db2[nf], magic8);
                } else {
#pragma unroll
                    for (int np = 0; np < NF / 2; ++np)
                        ldmatrix_x4(bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0], bf[2 * np + 1][1],
                                    w_s + (wn * WTN + np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + ks * 16 + ((lane >> 3) & 1) * 8);
                }
#pragma unroll
                for (int mf = 0; mf < MF; ++mf)
#pragma unroll
                    for (int nf = 0; nf < NF; ++nf)
                        mma_f16(acc[mf][nf], af[mf][0], af[mf][1], af[mf][2], af[mf][3], bf[nf][0], bf[nf][1]);
            }
            rd = rd == (S - 1) * STAGE ? 0 : rd + STAGE;
        }
    }

    // Epilogue: the mode's output, or this split's raw partial sums. The
    // segment is looked up again (cheap) instead of being kept in registers
    // through the K loop, which needs all 128 of them at BM = 128.
    const GemmSeg& so = p.seg[gemm_seg_of_tile(p, blockIdx.x)];
    const int o0 = ((int)blockIdx.x - so.tile0) * (swiglu ? BN / 2 : BN);
    const int g = (int)(lane >> 2), c4 = (int)(lane & 3);
    // Row m's partial sums of this split in the split-K entry; null in the
    // unsplit one, where every test of it below folds away.
    auto partial_row = [&](int m) -> float* {
        if constexpr (SPLIT) return p.partial + ((size_t)blockIdx.z * p.M + m) * p.ncols;
        else return nullptr;
    };
    // Modes 0/1 (or the split's partial): column n of the segment, row m.
    auto put = [&](float* prow, int m, int n, float v) {
        if (prow != nullptr) {
            prow[so.col0 + n] = v;
        } else {
            float* o = so.out_f32 + (size_t)m * so.ldc + n;
            if (p.mode == 1) *o += v;
            else *o = v;
        }
    };
    // SwiGLU's partial: gate at column i, up at column N + i.
    auto put_glu_partial = [&](float* prow, int i, float gt, float up) {
        prow[i] = gt;
        prow[so.n + i] = up;
    };
    if constexpr (WG) {
        // Lane (g, c), value 4 j + v: token 8 j + 2 c + (v & 1), W row
        // wg_row + 8 (v >> 1); in SwiGLU mode that row pair is the gate
        // and up rows of intermediate o0 + wg_row / 16 * 8 + g.
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const int m = m0 + 8 * j + 2 * c4 + t;
                if (m >= m1) continue;
                float* prow = partial_row(m);
                if (swiglu) {
                    const int i = o0 + (wg_row >> 4) * 8 + g;
                    if (i >= so.n) continue;
                    const float gt = wacc[4 * j + t], up = wacc[4 * j + 2 + t];
                    if (prow != nullptr) put_glu_partial(prow, i, gt, up);
                    else so.out_f16[(size_t)m * so.ldc + i] = f32_to_f16(siluf_(gt) * up);
                } else {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int n = o0 + wg_row + 8 * h;
                        if (n < so.n) put(prow, m, n, wacc[4 * j + 2 * h + t]);
                    }
                }
            }
        }
    } else {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int m = m0 + wm * WTM + mf * 16 + g + 8 * hr;
                if (m >= m1) continue;
                float* prow = partial_row(m);
                if (swiglu) {
#pragma unroll
                    for (int q = 0; q < NF / 2; ++q) {
                        const int i = o0 + (wn * (NF / 2) + q) * 8 + 2 * c4;
                        if (i >= so.n) continue;
                        const float* gt = acc[mf][2 * q];
                        const float* up = acc[mf][2 * q + 1];
                        if (prow != nullptr) {
                            put_glu_partial(prow, i, gt[2 * hr], up[2 * hr]);
                            put_glu_partial(prow, i + 1, gt[2 * hr + 1], up[2 * hr + 1]);
                        } else {
                            const float y0 = siluf_(gt[2 * hr]) * up[2 * hr];
                            const float y1 = siluf_(gt[2 * hr + 1]) * up[2 * hr + 1];
                            *reinterpret_cast<u32*>(so.out_f16 + (size_t)m * so.ldc + i) = pack_f16x2(y0, y1);
                        }
                    }
                } else {
#pragma unroll
                    for (int nf = 0; nf < NF; ++nf) {
                        const int n = o0 + wn * WTN + nf * 8 + 2 * c4;
#pragma unroll
                        for (int j = 0; j < 2; ++j)
                            if (n + j < so.n) put(prow, m, n + j, acc[mf][nf][2 * hr + j]);
                    }
                }
            }
        }
    }
}

// Two entry points per bit width and tile height, unsplit and split-K
// (gemm_body's SPLIT); the names carry the height (gemm_q4_bm16 and
// gemm_q4_bm16_split ...), which the host's defines supply (gemm.rs
// TILE_ROWS), with the height's ring depth and the shared memory of each
// bit width.
#define GEMM_ENTRY_(BITS, BM, MINB, S, SMEM)                                                              \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, MINB)                                      \
        gemm_q##BITS##_bm##BM(const __grid_constant__ GemmParams p) { gemm_body<BITS, BM, S, SMEM, false>(p); } \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, MINB)                                      \
        gemm_q##BITS##_bm##BM##_split(const __grid_constant__ GemmParams p) { gemm_body<BITS, BM, S, SMEM, true>(p); }
#define GEMM_ENTRY(BITS, BM, MINB, S, SMEM) GEMM_ENTRY_(BITS, BM, MINB, S, SMEM)
GEMM_ENTRY(4, GEMM_BM_T0, GEMM_MINB_T0, GEMM_WSTAGES_T0, GEMM_SMEM_Q4_T0)
GEMM_ENTRY(4, GEMM_BM_T1, GEMM_MINB_T1, GEMM_WSTAGES_T1, GEMM_SMEM_Q4_T1)
GEMM_ENTRY(4, GEMM_BM_T2, GEMM_MINB_T2, GEMM_WSTAGES_T2, GEMM_SMEM_Q4_T2)
GEMM_ENTRY(4, GEMM_BM_T3, GEMM_MINB_T3, GEMM_WSTAGES_T3, GEMM_SMEM_Q4_T3)
GEMM_ENTRY(4, GEMM_BM_T4, GEMM_MINB_T4, GEMM_WSTAGES_T4, GEMM_SMEM_Q4_T4)
GEMM_ENTRY(8, GEMM_BM_T0, GEMM_MINB_T0, GEMM_WSTAGES_T0, GEMM_SMEM_Q8_T0)
GEMM_ENTRY(8, GEMM_BM_T1, GEMM_MINB_T1, GEMM_WSTAGES_T1, GEMM_SMEM_Q8_T1)
GEMM_ENTRY(8, GEMM_BM_T2, GEMM_MINB_T2, GEMM_WSTAGES_T2, GEMM_SMEM_Q8_T2)
GEMM_ENTRY(8, GEMM_BM_T3, GEMM_MINB_T3, GEMM_WSTAGES_T3, GEMM_SMEM_Q8_T3)

// grid (ceil(M * ceil(nout / 4) / 256)), block 256, the GEMM's own
// parameters: each thread takes 4 consecutive output columns c..c+3 of one
// row m and sums their splits' partials in split order (fixed, so the
// result is the same on every run, and each column's sum is the same
// ((0 + p_0) + p_1) + ... as one thread per column formed), then applies
// the mode:
//   mode 0/1: nout = ncols; column c belongs to the segment with the largest
//             col0 <= c: out_f32[m][c - col0] = (or +=) sum;
//   mode 2:   nout = N (one segment); out_f16[m][i] = silu(sum gate) * sum up.
// Four columns a thread, read as one 16-byte load a split when the rows
// allow it (ncols a multiple of 4), keep four times the loads in flight of
// a thread a column: the reduction reads L2-resident partials and was
// bound by how many loads were outstanding (at 64 decode tokens the
// in-projection's 6.3 MB took 6.2 us, 1.0 TB/s, on the H100), and the
// loads of up to GEMM_REDUCE_BATCH splits go out before their sums.
#define GEMM_REDUCE_BATCH 4
static_assert(GEMM_REDUCE_COLS == 4, "gemm.rs GEMM_REDUCE_COLS: gemm_splitk_reduce is written for a float4 of columns a thread");

// Adds splits z0.. z0 + GEMM_REDUCE_BATCH - 1 (those below `splits`) of the
// 4 columns at `pr` (plane floats apart) into v, in split order.
__device__ __forceinline__ void splitk_add4(const float* pr, size_t plane, int z0, int splits, bool vec, int nv, float (&v)[4]) {
    float t[GEMM_REDUCE_BATCH][4];
#pragma unroll
    for (int b = 0; b < GEMM_REDUCE_BATCH; ++b) {
        if (z0 + b >= splits) break;
        const float* q = pr + (size_t)(z0 + b) * plane;
        if (vec) {
            const float4 f = __ldcg(reinterpret_cast<const float4*>(q));
            t[b][0] = f.x;
            t[b][1] = f.y;
            t[b][2] = f.z;
            t[b][3] = f.w;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) t[b][j] = j < nv ? __ldcg(q + j) : 0.f;
        }
    }
#pragma unroll
    for (int b = 0; b < GEMM_REDUCE_BATCH; ++b) {
        if (z0 + b >= splits) break;
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] += t[b][j];
    }
}

#ifndef GEMM_REDUCE_THREADS
#error "GEMM_REDUCE_THREADS must be defined by the host (gemm.rs defines)"
#endif
extern "C" __global__ void __launch_bounds__(GEMM_REDUCE_THREADS) gemm_splitk_reduce(const __grid_constant__ GemmParams p) {
    // Launched as its GEMM was (p.pdl): the partials (and a residual
    // output) are read after the GEMM's end.
    if (p.pdl) pdl_trigger();
    pdl_wait();
    const bool swiglu = p.mode == 2;
    const int nout = swiglu ? p.seg[0].n : p.ncols;
    const int nq = (nout + GEMM_REDUCE_COLS - 1) / GEMM_REDUCE_COLS;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)p.M * nq) return;
    const int m = (int)(idx / nq), c = GEMM_REDUCE_COLS * (int)(idx % nq);
    const int nv = min(GEMM_REDUCE_COLS, nout - c);
    const size_t plane = (size_t)p.M * p.ncols;
    const float* pr = p.partial + (size_t)m * p.ncols + c;
    // 16-byte loads: every row (and plane) starts on a 16-byte boundary and
    // the 4 columns are all outputs (SwiGLU's up half starts nout floats in).
    const bool vec = p.ncols % 4 == 0 && nv == 4 && (!swiglu || nout % 4 == 0);
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (swiglu) {
        float u[4] = {0.f, 0.f, 0.f, 0.f};
        for (int z = 0; z < p.splits; z += GEMM_REDUCE_BATCH) {
            splitk_add4(pr, plane, z, p.splits, vec, nv, v);
            splitk_add4(pr + nout, plane, z, p.splits, vec, nv, u);
        }
        const GemmSeg& s0 = p.seg[0];
        f16* o = s0.out_f16 + (size_t)m * s0.ldc + c;
        f16 r[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) r[j] = f32_to_f16(siluf_(v[j]) * u[j]);
        if (nv == 4 && (reinterpret_cast<size_t>(o) & 7) == 0) {
            *reinterpret_cast<uint2*>(o) = make_uint2(r[0] | ((u32)r[1] << 16), r[2] | ((u32)r[3] << 16));
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < nv) o[j] = r[j];
        }
        return;
    }
    for (int z = 0; z < p.splits; z += GEMM_REDUCE_BATCH) splitk_add4(pr, plane, z, p.splits, vec, nv, v);
    // The segment of each column (a segment's columns are contiguous).
    int si[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        si[j] = 0;
#pragma unroll
        for (int i = 1; i < GEMM_MAX_SEGS; ++i)
            if (i < p.nseg && c + j >= p.seg[i].col0) si[j] = i;
    }
    const GemmSeg& s = p.seg[si[0]];
    float* o = s.out_f32 + (size_t)m * s.ldc + (c - s.col0);
    if (nv == 4 && si[3] == si[0] && (reinterpret_cast<size_t>(o) & 15) == 0) {
        float4* o4 = reinterpret_cast<float4*>(o);
        float4 r = make_float4(v[0], v[1], v[2], v[3]);
        if (p.mode == 1) {
            const float4 h = *o4;
            r = make_float4(h.x + v[0], h.y + v[1], h.z + v[2], h.w + v[3]);
        }
        *o4 = r;
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (j >= nv) break;
        const GemmSeg& sj = p.seg[si[j]];
        float* oj = sj.out_f32 + (size_t)m * sj.ldc + (c + j - sj.col0);
        if (p.mode == 1) *oj += v[j];
        else *oj = v[j];
    }
}

// grid (T), block RMSNORM_THREADS: out[t][c] = f16(x[t][c] * rsqrt(mean(x[t]^2)
// + eps) * gain[c]) over rows of HIDDEN columns. The normalised activations
// that feed the GEMMs (common.cuh rmsnorm_row_f16: a row read once into
// registers, thread i holding columns i, i + RMSNORM_THREADS, ...).
struct RmsnormParams {
    const float* x;        // [rows][HIDDEN]
    const float* gain;
    f16* out;              // [rows][HIDDEN]
    float eps;
};

extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
rmsnorm_f16(const __grid_constant__ RmsnormParams p) {
    __shared__ float red[32];
    rmsnorm_row_f16<HIDDEN, RMSNORM_THREADS>(p.x + (size_t)blockIdx.x * HIDDEN, p.gain, p.out + (size_t)blockIdx.x * HIDDEN, p.eps, red);
}
