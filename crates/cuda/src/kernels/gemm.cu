// gemm.cu: C = A W^T with W packed 4- or 8-bit, dequantised inside the tile,
// on tensor cores (mma.sync m16n8k16 fp16, fp32 accumulators).
//
// A: fp16 [rows][lda] activations; W: [experts][N][K] packed codes with bf16
// scales/biases per 64 columns (as stored). Each k-tile is exactly one quantisation group
// (BK = 64), so a thread dequantises its 16-byte chunk of codes with one
// scale and one bias (w = scale * q + bias in fp32, rounded to fp16) into the
// shared W tile, as MLX's quantised matmul does with its activation type.
//
// Tiles: BM = 128 rows of A x BN = 128 rows of W, 256 threads = 8 warps as
// 2 (M) x 4 (N), warp tile 64 x 32. A tiles arrive by cp.async (double
// buffered), W codes for the next k-tile are loaded into registers while the
// current one is multiplied.
//
// Grouping (MoE prefill): `tiles` lists (expert, row start, row end) in the
// sorted row space, `a_rows` maps a sorted row to its A row (the token), and
// the expert offsets the weight pointers. Dense: no tiles, identity rows.
//
// Modes: 0 out_f32 = C; 1 out_f32 += C (residual add); 2 SwiGLU: the tile's
// W rows alternate 8 gate rows / 8 up rows of 64 intermediate rows, and
// out_f16[m][i] = silu(gate . a) * (up . a).

#define GM_BM 128
#define GM_BN 128
#define GM_BK 64
#define GM_LD (GM_BK + 8)
#define GM_THREADS 256

struct GemmParams {
    const f16* a;
    const int* a_rows;       // sorted row -> A row, or null
    const u32* codes;
    const bf16* scales;
    const bf16* biases;
    const u32* codes2;       // up projection (mode 2)
    const bf16* scales2;
    const bf16* biases2;
    float* out_f32;
    f16* out_f16;
    const int* tiles;        // [max_tiles][3] or null
    const int* ntiles;       // device count of tiles, or null
    long long e_codes;       // words per expert
    long long e_groups;      // scale/bias entries per expert
    int lda;
    int ldc;
    int M;                   // rows (dense)
    int N;                   // W rows (mode 2: intermediate rows)
    int K;
    int mode;
};

template <int BITS>
__device__ __forceinline__ void gemm_body(const GemmParams& p) {
    extern __shared__ __align__(16) unsigned char gm_smem[];
    f16* sA = reinterpret_cast<f16*>(gm_smem);          // [2][GM_BM][GM_LD]
    f16* sW = sA + 2 * GM_BM * GM_LD;                    // [2][GM_BN][GM_LD]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;

    int e = 0, m0, m1;
    if (p.tiles != nullptr) {
        if ((int)blockIdx.y >= *p.ntiles) return;
        const int* tl = p.tiles + 3 * blockIdx.y;
        e = tl[0];
        m0 = tl[1];
        m1 = tl[2];
    } else {
        m0 = blockIdx.y * GM_BM;
        m1 = min(p.M, m0 + GM_BM);
        if (m0 >= m1) return;
    }
    const bool swiglu = p.mode == 2;
    const int n0 = blockIdx.x * (swiglu ? GM_BN / 2 : GM_BN);
    const int nk = p.K / GM_BK;
    const int wpr = p.K * BITS / 32;          // words per W row
    const int gpr = p.K / GROUP_SIZE;         // groups per W row

    // This thread's W row in the tile and its source.
    const int tr = tid >> 1;
    constexpr int UPR = GM_BK * BITS / 128;   // uint4 per row per k-tile (2 or 4)
    constexpr int LPT = UPR / 2;              // uint4 per thread (1 or 2)
    constexpr int CPU4 = 128 / BITS;          // codes per uint4 (32 or 16)
    const int part = tid & 1;
    int wrow;
    const u32* wc;
    const bf16 *ws, *wb;
    if (swiglu) {
        const int j8 = tr >> 3;
        wrow = n0 + (j8 >> 1) * 8 + (tr & 7);
        const bool up = j8 & 1;
        wc = (up ? p.codes2 : p.codes) + e * p.e_codes;
        ws = (up ? p.scales2 : p.scales) + e * p.e_groups;
        wb = (up ? p.biases2 : p.biases) + e * p.e_groups;
    } else {
        wrow = n0 + tr;
        wc = p.codes + e * p.e_codes;
        ws = p.scales + e * p.e_groups;
        wb = p.biases + e * p.e_groups;
    }
    const bool wvalid = wrow < p.N;
    const u32* wrow_codes = wc + (size_t)(wvalid ? wrow : 0) * wpr;

    uint4 wreg[LPT];
    float wsc = 0.f, wbi = 0.f;
    auto load_w = [&](int kt) {
#pragma unroll
        for (int i = 0; i < LPT; ++i)
            wreg[i] = wvalid ? ld_stream_u4(wrow_codes + (size_t)kt * (GM_BK * BITS / 32) + (part * LPT + i) * 4)
                             : make_uint4(0, 0, 0, 0);
        wsc = wvalid ? bf16_to_f32(ld_nc_u16(ws + (size_t)wrow * gpr + kt)) : 0.f;
        wbi = wvalid ? bf16_to_f32(ld_nc_u16(wb + (size_t)wrow * gpr + kt)) : 0.f;
    };
    auto store_w = [&](int stage) {
        f16* dst = sW + stage * GM_BN * GM_LD + tr * GM_LD + part * LPT * CPU4;
#pragma unroll
        for (int i = 0; i < LPT; ++i) {
            const u32 wv[4] = {wreg[i].x, wreg[i].y, wreg[i].z, wreg[i].w};
            u32 packed[CPU4 / 2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (BITS == 4) {
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const float lo = fmaf(wsc, (float)((wv[j] >> (8 * k)) & 15u), wbi);
                        const float hi = fmaf(wsc, (float)((wv[j] >> (8 * k + 4)) & 15u), wbi);
                        packed[j * 4 + k] = pack_f16x2(lo, hi);
                    }
                } else {
#pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        const float lo = fmaf(wsc, (float)((wv[j] >> (16 * k)) & 255u), wbi);
                        const float hi = fmaf(wsc, (float)((wv[j] >> (16 * k + 8)) & 255u), wbi);
                        packed[j * 2 + k] = pack_f16x2(lo, hi);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < CPU4 / 8; ++j)
                reinterpret_cast<uint4*>(dst + i * CPU4)[j] =
                    make_uint4(packed[4 * j], packed[4 * j + 1], packed[4 * j + 2], packed[4 * j + 3]);
        }
    };
    // A rows of this tile: 4 chunks of 16 bytes per thread per k-tile.
    auto load_a = [&](int kt, int stage) {
        f16* dst = sA + stage * GM_BM * GM_LD;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int idx = tid + i * GM_THREADS;
            const int r = idx >> 3, c = (idx & 7) * 8;
            const int m = m0 + r;
            const bool ok = m < m1;
            const int arow = ok ? (p.a_rows != nullptr ? p.a_rows[m] : m) : 0;
            cp_async16(dst + r * GM_LD + c, p.a + (size_t)arow * p.lda + kt * GM_BK + c, ok ? 16 : 0);
        }
        cp_async_commit();
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

    load_a(0, 0);
    load_w(0);
    for (int kt = 0; kt < nk; ++kt) {
        const int st = kt & 1;
        store_w(st);
        if (kt + 1 < nk) {
            load_a(kt + 1, st ^ 1);
            load_w(kt + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const f16* a_s = sA + st * GM_BM * GM_LD;
        const f16* w_s = sW + st * GM_BN * GM_LD;
#pragma unroll
        for (int ks = 0; ks < GM_BK / 16; ++ks) {
            u32 af[4][4];
#pragma unroll
            for (int mf = 0; mf < 4; ++mf)
                ldmatrix_x4(af[mf][0], af[mf][1], af[mf][2], af[mf][3],
                            a_s + (wm * 64 + mf * 16 + (lane & 15)) * GM_LD + ks * 16 + (lane >> 4) * 8);
            u32 bf[4][2];
#pragma unroll
            for (int np = 0; np < 2; ++np)
                ldmatrix_x4(bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0], bf[2 * np + 1][1],
                            w_s + (wn * 32 + np * 16 + (lane & 7) + (lane >> 4) * 8) * GM_LD + ks * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int mf = 0; mf < 4; ++mf)
#pragma unroll
                for (int nf = 0; nf < 4; ++nf)
                    mma_f16(acc[mf][nf], af[mf][0], af[mf][1], af[mf][2], af[mf][3], bf[nf][0], bf[nf][1]);
        }
        __syncthreads();
    }

    const int g = lane >> 2, c4 = lane & 3;
#pragma unroll
    for (int mf = 0; mf < 4; ++mf) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int m = m0 + wm * 64 + mf * 16 + g + 8 * hr;
            if (m >= m1) continue;
            if (swiglu) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int i = n0 + (wn * 2 + q) * 8 + 2 * c4;
                    if (i >= p.N) continue;
                    const float* gt = acc[mf][2 * q];
                    const float* up = acc[mf][2 * q + 1];
                    const float y0 = siluf_(gt[2 * hr]) * up[2 * hr];
                    const float y1 = siluf_(gt[2 * hr + 1]) * up[2 * hr + 1];
                    *reinterpret_cast<u32*>(p.out_f16 + (size_t)m * p.ldc + i) = pack_f16x2(y0, y1);
                }
            } else {
#pragma unroll
                for (int nf = 0; nf < 4; ++nf) {
                    const int n = n0 + wn * 32 + nf * 8 + 2 * c4;
                    float* o = p.out_f32 + (size_t)m * p.ldc + n;
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        if (n + j >= p.N) continue;
                        const float v = acc[mf][nf][2 * hr + j];
                        if (p.mode == 1) o[j] += v;
                        else o[j] = v;
                    }
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(GM_THREADS, 2) gemm_q4(const __grid_constant__ GemmParams p) { gemm_body<4>(p); }
extern "C" __global__ void __launch_bounds__(GM_THREADS, 2) gemm_q8(const __grid_constant__ GemmParams p) { gemm_body<8>(p); }

// grid (T), block 256: out[t][c] = f16(x[t][c] * rsqrt(mean(x[t]^2) + eps) * gain[c]).
// The normalised activations that feed the GEMMs.
struct RmsnormParams {
    const float* x;        // [rows][cols]
    const float* gain;
    f16* out;              // [rows][cols]
    int cols;
    float eps;
};

extern "C" __global__ void __launch_bounds__(256)
rmsnorm_f16(const __grid_constant__ RmsnormParams p) {
    const float* x = p.x;
    const float* gain = p.gain;
    f16* out = p.out;
    const int cols = p.cols;
    const float eps = p.eps;
    __shared__ float red[32];
    const float* xr = x + (size_t)blockIdx.x * cols;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
    const float r = rsqrtf(block_sum(ss, red) / (float)cols + eps);
    f16* o = out + (size_t)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = f32_to_f16(xr[c] * r * gain[c]);
}
