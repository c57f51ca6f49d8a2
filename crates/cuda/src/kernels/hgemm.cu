// hgemm.cu: the fp16 tensor-core GEMM of long prefill passes, fed by the
// bulk tensor copy engine (TMA), and the dequantisation that feeds it.
//
//   out[m][n] (=, or +=) sum_k A[m][k] W[n][k]        m < M tokens, n < N rows
//
// A: the pass's fp16 activations, [M][lda]. W: fp16 [N][K], a 4- or 8-bit
// matrix (or the concatenated matrices of one launch) dequantised once per
// pass by dq_f16 into the `w16` scratch as fp16(fmaf(scale, q, bias)), the
// value gemm.cu's tiles form in registers. out: f32, [M][ldc].
//
// Why a second GEMM (hgemm.rs): the 4-bit tiles of gemm.cu spend most of
// their issue slots on the dequantisation and on per-thread copy addresses
// (NOTES: ~277 instructions a warp a k-tile, 4 of them HGMMA; the tensor
// pipe 48% busy). At thousands of tokens a matrix is multiplied by so many
// rows that dequantising it once per pass costs a few percent of the
// multiply, and what is left is a plain fp16 GEMM.
//
// Tiles: HG_BM tokens x HG_BN W rows, k-tiles of HG_BK = 64 columns (128
// bytes, one 128-byte swizzle row), a ring of HG_STAGES stages in shared
// memory, each { A tile [HG_BM][64], W tile [HG_BN][64] } as the tensor
// maps write them (128-byte swizzle: 16-byte chunk j of row r at chunk
// j ^ (r & 7)), which is the K-major layout wgmma reads through a
// descriptor. Block: 3 warpgroups (HG_THREADS = 384).
//   warpgroup 0, the producer: gives up registers (setmaxnreg 40); one
//     thread waits for a stage's `empty` barrier, arms its `full` barrier
//     with the stage's bytes and issues the two bulk tensor copies;
//   warpgroups 1 and 2, the consumers (setmaxnreg 232): each owns 64 of
//     the tile's token rows x HG_BN columns (128 f32 accumulators a
//     thread), waits for `full`, issues the k-tile's 4 wgmma.m64n256k16
//     (both operands from shared memory) as one group, keeps that group in
//     flight while the previous one retires, then releases the previous
//     k-tile's stage (every consumer thread arrives on `empty`).
// No block-wide barrier after the set-up, so the producer's idle threads
// may leave. Persistent: a block per SM (at most one fits) walks tiles
// blockIdx.x, + gridDim.x, ..., M tile fastest, so the blocks at work at
// any time share a few W tiles (W read from DRAM about once; A, a few MB,
// stays in L2), and the producer fills the next tile's stages while the
// consumers store the last one. Rows past M or N are zero-filled by the
// copies and not stored.
// Epilogue: each consumer thread writes its accumulators straight from
// registers, a float2 per (row, column pair): acc[4j + e] is row
// 16 (warp % 4) + lane / 4 + 8 (e / 2) of the warpgroup's 64, column
// 8 j + 2 (lane % 4) + (e % 2).

#if !defined(HG_BM) || !defined(HG_BN) || !defined(HG_BK) || !defined(HG_STAGES) || !defined(HG_THREADS) || !defined(HG_EPI_COLS)
#error "HG_BM, HG_BN, HG_BK, HG_STAGES, HG_THREADS and HG_EPI_COLS must be defined by the host (hgemm.rs)"
#endif
static_assert(HG_BK == 64, "a k-tile is one 128-byte swizzle row of fp16");
static_assert(HG_BM == 128 && HG_BN == 256 && HG_THREADS == 384, "two consumer warpgroups of m64n256");
#define HG_A_BYTES (HG_BM * HG_BK * 2)
#define HG_B_BYTES (HG_BN * HG_BK * 2)
#define HG_STAGE_BYTES (HG_A_BYTES + HG_B_BYTES)
static_assert(HG_STAGE_BYTES % 1024 == 0, "stages start on 1024-byte swizzle atoms");
// Dynamic shared memory: up to 1023 bytes to align the ring to 1024, the
// ring, then 2 x HG_STAGES mbarriers (8 bytes each).
static_assert(HG_SMEM == 1024 + HG_STAGES * HG_STAGE_BYTES + 2 * HG_STAGES * 8, "hgemm shared memory differs from hgemm.rs");

#define HG_STORE 0
#define HG_ADD 1
static_assert((HG_BN / 8) % HG_EPI_COLS == 0, "the epilogue's column groups tile a row of the tile");

// A CUtensorMap, filled on the host by cuTensorMapEncodeTiled (opaque).
struct __align__(64) TmaMap {
    u64 opaque[16];
};

struct HgemmParams {
    TmaMap a;       // A: fp16, dims {K, M}, box {HG_BK, HG_BM}, 128-byte swizzle
    TmaMap w;       // W: fp16, dims {K, N}, box {HG_BK, HG_BN}, 128-byte swizzle
    float* out;     // out[m * ldc + n]
    int M, N, K;
    int ldc;
    int mode;       // HG_STORE / HG_ADD
};
LAYOUT_CHECK(HgemmParams, HGEMM_PARAMS_BYTES)

// ---- bulk tensor copies (the mbarriers are in common.cuh) ---------------

// Box (c0, c1) of `map` (c0 the contiguous coordinate) into shared memory at
// `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}

// ---- hgemm_f16 ------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(HG_THREADS, 1) hgemm_f16(const __grid_constant__ HgemmParams p) {
    extern __shared__ __align__(16) unsigned char hg_smem[];
    const u32 base = (smem_u32(hg_smem) + 1023u) & ~1023u;
    const u32 bars = base + HG_STAGES * HG_STAGE_BYTES;   // full[s] at bars + 8 s, empty[s] at bars + 8 (HG_STAGES + s)
    const int wgi = threadIdx.x >> 7;
    const int nk = p.K / HG_BK;
    const int tm = (p.M + HG_BM - 1) / HG_BM, ntiles = tm * ((p.N + HG_BN - 1) / HG_BN);
    if (threadIdx.x == 0) {
#pragma unroll 1
        for (int s = 0; s < HG_STAGES; ++s) {
            mbar_init(bars + 8 * s, 1);                      // the producer's arrival (+ the copies' bytes)
            mbar_init(bars + 8 * (HG_STAGES + s), HG_THREADS - 128);   // every consumer thread arrives
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    // Tiles t = blockIdx.x, + gridDim.x, ...: M tile t % tm, N tile t / tm.
    // Producer and consumers count k-tiles across the block's tiles (`it`),
    // so a stage's use number and its barriers' parities run on, and the
    // producer fills the next tile's stages while the consumers store.
    if (wgi == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            int it = 0;
#pragma unroll 1
            for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
                const int m0 = (t % tm) * HG_BM, n0 = (t / tm) * HG_BN;
#pragma unroll 1
                for (int kt = 0; kt < nk; ++kt, ++it) {
                    const int s = it % HG_STAGES, use = it / HG_STAGES;
                    if (use > 0) mbar_wait(bars + 8 * (HG_STAGES + s), (use - 1) & 1);
                    const u32 full = bars + 8 * s, a = base + s * HG_STAGE_BYTES;
                    mbar_expect_tx(full, HG_STAGE_BYTES);
                    tma_load_2d(a, &p.a, kt * HG_BK, m0, full);
                    tma_load_2d(a + HG_A_BYTES, &p.w, kt * HG_BK, n0, full);
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int cw = wgi - 1;   // consumer warpgroup: token rows 64 cw .. + 64 of the tile
    const int lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    float acc[HG_BN / 2];
    int it = 0;
#pragma unroll 1
    for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const int m0 = (t % tm) * HG_BM, n0 = (t / tm) * HG_BN;
#pragma unroll
        for (int i = 0; i < HG_BN / 2; ++i) acc[i] = 0.f;
#pragma unroll 1
        for (int kt = 0; kt < nk; ++kt, ++it) {
            const int s = it % HG_STAGES;
            mbar_wait(bars + 8 * s, (it / HG_STAGES) & 1);
            const u32 a = base + s * HG_STAGE_BYTES + cw * (64 * HG_BK * 2), w = base + s * HG_STAGE_BYTES + HG_A_BYTES;
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < HG_BK / 16; ++ks) wgmma_ss_m64n256(acc, wg_desc_sw128(a + ks * 32), wg_desc_sw128(w + ks * 32));
            wgmma_commit();
            // The group of k-tile it - 1 has retired (this thread's part of
            // it): its stage may be refilled once every consumer thread says so.
            wgmma_wait<1>();
            if (kt > 0) mbar_arrive(bars + 8 * (HG_STAGES + (it - 1) % HG_STAGES));
        }
        wgmma_wait<0>();
        // The tile's last stage, for the producer's next tile.
        mbar_arrive(bars + 8 * (HG_STAGES + (it - 1) % HG_STAGES));
#pragma unroll
        for (int i = 0; i < HG_BN / 2; ++i) wg_reg_fence(acc[i]);

        const int r0 = m0 + 64 * cw + 16 * wq + (lane >> 2);
        const int cl = n0 + 2 * (lane & 3);
        // In groups of HG_EPI_COLS column pairs: with HG_ADD, every old
        // value of the group is loaded before the first store. A load after
        // a store to the same array waits for it (ptxas cannot tell the
        // addresses apart), so one load a store made the epilogue of an
        // out-projection (K = 4,096, two tiles a block) a chain of 64 L2
        // round trips a thread.
#pragma unroll
        for (int j0 = 0; j0 < HG_BN / 8; j0 += HG_EPI_COLS) {
            float2 old[HG_EPI_COLS][2];
#pragma unroll
            for (int j = 0; j < HG_EPI_COLS; ++j)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = r0 + 8 * half, col = cl + 8 * (j0 + j);
                    old[j][half] = make_float2(0.f, 0.f);
                    if (p.mode == HG_ADD && col < p.N && row < p.M)
                        old[j][half] = *reinterpret_cast<const float2*>(p.out + (size_t)row * p.ldc + col);
                }
#pragma unroll
            for (int j = 0; j < HG_EPI_COLS; ++j) {
                const int col = cl + 8 * (j0 + j);
                if (col >= p.N) continue;   // N is even (hgemm.rs), so col + 1 < N too
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = r0 + 8 * half;
                    if (row >= p.M) continue;
                    const int a = 4 * (j0 + j) + 2 * half;
                    float2 v = make_float2(acc[a], acc[a + 1]);
                    if (p.mode == HG_ADD) {
                        v.x += old[j][half].x;
                        v.y += old[j][half].y;
                    }
                    *reinterpret_cast<float2*>(p.out + (size_t)row * p.ldc + col) = v;
                }
            }
        }
    }
}

// ---- dq_f16: quantised matrices into fp16 rows -----------------------------

// One matrix of a launch (mirrored by hgemm.rs `DqMatC`).
struct DqMat {
    const u32* codes;     // [rows][K * bits / 32]
    const bf16* scales;   // [rows][K / GROUP_SIZE]
    const bf16* biases;
    f16* out;             // [rows][K], 16-byte aligned
    long long word0;      // the launch's first code word of this matrix
    int bits;             // 4 or 8
    int pad;
};
struct DqParams {
    DqMat mat[DQ_MAX_MATS];
    long long words;      // all matrices' code words
    int nmat;
    int pad;
};
LAYOUT_CHECK(DqParams, DQ_PARAMS_BYTES)

// One thread a code word (a warp loads 128 contiguous bytes and stores 512
// or 256: a thread a quad of words stored 64 bytes apart a lane and ran
// 1.5x slower), w = fp16(fmaf(scale, q, bias)), saturated. A launch takes
// up to DQ_MAX_MATS matrices (a mixer's in-projections) one after another.
extern "C" __global__ void __launch_bounds__(256) dq_f16(const __grid_constant__ DqParams p) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.words) return;
    int mi = 0;
#pragma unroll
    for (int j = 1; j < DQ_MAX_MATS; ++j)
        if (j < p.nmat && i >= p.mat[j].word0) mi = j;
    const DqMat& m = p.mat[mi];
    const long long wi = i - m.word0;
    const u32 w = m.codes[wi];
    const int per = 32 / m.bits;                   // codes a word
    const long long first = wi * per;              // flat index of the word's first weight
    const long long grp = first / GROUP_SIZE;      // a word never straddles a group (64 % per == 0)
    const float s = bf16_to_f32(m.scales[grp]), b = bf16_to_f32(m.biases[grp]);
    if (m.bits == 4) {
        uint4 v;
        v.x = pack_f16x2(fmaf(s, (float)(w & 15u), b), fmaf(s, (float)((w >> 4) & 15u), b));
        v.y = pack_f16x2(fmaf(s, (float)((w >> 8) & 15u), b), fmaf(s, (float)((w >> 12) & 15u), b));
        v.z = pack_f16x2(fmaf(s, (float)((w >> 16) & 15u), b), fmaf(s, (float)((w >> 20) & 15u), b));
        v.w = pack_f16x2(fmaf(s, (float)((w >> 24) & 15u), b), fmaf(s, (float)(w >> 28), b));
        *reinterpret_cast<uint4*>(m.out + first) = v;
    } else {
        uint2 v;
        v.x = pack_f16x2(fmaf(s, (float)(w & 255u), b), fmaf(s, (float)((w >> 8) & 255u), b));
        v.y = pack_f16x2(fmaf(s, (float)((w >> 16) & 255u), b), fmaf(s, (float)(w >> 24), b));
        *reinterpret_cast<uint2*>(m.out + first) = v;
    }
}
