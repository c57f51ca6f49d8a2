// gemv.cu: y = W x for a few tokens (decode), W packed 4- or 8-bit.
//
// One launch computes several matrices that read the same input (the
// "segments": e.g. in_proj_qkv, in_proj_z, in_proj_a, in_proj_b of a DeltaNet
// layer), with the input's RMSNorm fused in (optional), the residual add
// fused in (a segment may accumulate into its output) and, for the lm_head,
// the greedy argmax fused in (packed keys, one atomicMax per block and token).
//
// Formula per segment row r and token t:
//   y[t][r] = sum_g scale[r][g] * (sum_{c in g} q[r][c] * x[t][c]) + bias[r][g] * (sum_{c in g} x[t][c])
// computed in fp32 with x staged in shared memory (PAD32 layout, common.cuh).
//
// Thread mapping: 256 threads = 8 warps; a warp task is GEMV_ROWS = 4
// consecutive rows of one segment. Lane l reads 16-byte chunks l, l+32, ...
// of each row (32 four-bit or 16 eight-bit codes each), so a warp reads 512
// contiguous bytes per row per step; the four rows' loads are issued before
// the arithmetic. Blocks stride over tasks (a persistent grid sized by the
// host to the SM count), so each block stages x once.
//
// Limits: ntok <= GEMV_MAX_TOK, cols % 64 == 0, at most GEMV_MAX_SEGS segments.

#define GEMV_MAX_SEGS 8
#define GEMV_ROWS 4
#define GEMV_THREADS 256

struct GemvSeg {
    const u32* codes;    // [rows][cols * bits / 32]
    const bf16* scales;  // [rows][cols / 64]
    const bf16* biases;  // [rows][cols / 64]
    float* out;          // out[t * out_stride + r]
    int rows;
    int bits;            // 4 or 8
    int out_stride;
    int accumulate;      // 1: out += y (residual add)
    int task_start;      // index of this segment's first task
    int argmax;          // 1: fold rows into argmax_keys[t]
};

struct GemvParams {
    GemvSeg seg[GEMV_MAX_SEGS];
    const float* x;      // [ntok][x_stride]
    const float* gain;   // RMSNorm gain [cols], or null for no norm
    u64* argmax_keys;    // [ntok], used by segments with argmax
    int nseg;
    int ntasks;
    int cols;
    int x_stride;
    int ntok;
    float eps;
};

extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
gemv_q(const __grid_constant__ GemvParams p) {
    extern __shared__ float smem[];
    const int cols = p.cols, ntok = p.ntok;
    const int P = PADDED_LEN(cols);
    float* sx = smem;                         // [ntok][P]
    float* csum = sx + ntok * P;              // [ntok][cols / 16]
    float* red = csum + ntok * (cols / 16);   // [32]
    u64* best_smem = reinterpret_cast<u64*>(red + 32);  // [8 warps][GEMV_MAX_TOK]

    stage_activations(sx, csum, red, p.x, p.x_stride, p.gain, ntok, cols, p.eps);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nc16 = cols / 16;
    u64 best[GEMV_MAX_TOK];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOK; ++t) best[t] = 0ull;
    bool any_argmax = false;

    for (int task = blockIdx.x * (GEMV_THREADS / 32) + warp; task < p.ntasks; task += gridDim.x * (GEMV_THREADS / 32)) {
        int s = 0;
#pragma unroll
        for (int i = 1; i < GEMV_MAX_SEGS; ++i)
            if (i < p.nseg && task >= p.seg[i].task_start) s = i;
        const GemvSeg& sg = p.seg[s];
        const int row0 = (task - sg.task_start) * GEMV_ROWS;
        float acc[GEMV_ROWS][GEMV_MAX_TOK];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
            for (int t = 0; t < GEMV_MAX_TOK; ++t) acc[r][t] = 0.f;

        if (sg.bits == 4) {
            const int nch = cols / 32, wpr = cols / 8, gpr = cols / GROUP_SIZE;
            for (int ch = lane; ch < nch; ch += 32) {
                uint4 w[GEMV_ROWS];
                float sc[GEMV_ROWS], bi[GEMV_ROWS];
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) {
                    const int row = row0 + r;
                    if (row < sg.rows) {
                        w[r] = ld_stream_u4(sg.codes + (size_t)row * wpr + ch * 4);
                        sc[r] = bf16_to_f32(ld_nc_u16(sg.scales + (size_t)row * gpr + (ch >> 1)));
                        bi[r] = bf16_to_f32(ld_nc_u16(sg.biases + (size_t)row * gpr + (ch >> 1)));
                    } else {
                        w[r] = make_uint4(0, 0, 0, 0);
                        sc[r] = 0.f;
                        bi[r] = 0.f;
                    }
                }
#pragma unroll
                for (int t = 0; t < GEMV_MAX_TOK; ++t) {
                    if (t < ntok) {
                        float xv[32];
                        load_x32(sx + t * P + ch * 36, xv);
                        const float cs = csum[t * nc16 + 2 * ch] + csum[t * nc16 + 2 * ch + 1];
#pragma unroll
                        for (int r = 0; r < GEMV_ROWS; ++r) acc[r][t] += fmaf(sc[r], dot32_q4(w[r], xv), bi[r] * cs);
                    }
                }
            }
        } else {
            const int nch = cols / 16, wpr = cols / 4, gpr = cols / GROUP_SIZE;
            for (int ch = lane; ch < nch; ch += 32) {
                uint4 w[GEMV_ROWS];
                float sc[GEMV_ROWS], bi[GEMV_ROWS];
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) {
                    const int row = row0 + r;
                    if (row < sg.rows) {
                        w[r] = ld_stream_u4(sg.codes + (size_t)row * wpr + ch * 4);
                        sc[r] = bf16_to_f32(ld_nc_u16(sg.scales + (size_t)row * gpr + (ch >> 2)));
                        bi[r] = bf16_to_f32(ld_nc_u16(sg.biases + (size_t)row * gpr + (ch >> 2)));
                    } else {
                        w[r] = make_uint4(0, 0, 0, 0);
                        sc[r] = 0.f;
                        bi[r] = 0.f;
                    }
                }
#pragma unroll
                for (int t = 0; t < GEMV_MAX_TOK; ++t) {
                    if (t < ntok) {
                        const float* xs = sx + t * P + PAD32(ch * 16);
                        float xv[16];
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const float4 v = reinterpret_cast<const float4*>(xs)[i];
                            xv[4 * i] = v.x;
                            xv[4 * i + 1] = v.y;
                            xv[4 * i + 2] = v.z;
                            xv[4 * i + 3] = v.w;
                        }
                        const float cs = csum[t * nc16 + ch];
#pragma unroll
                        for (int r = 0; r < GEMV_ROWS; ++r) acc[r][t] += fmaf(sc[r], dot16_q8(w[r], xv), bi[r] * cs);
                    }
                }
            }
        }

#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
            for (int t = 0; t < GEMV_MAX_TOK; ++t)
                if (t < ntok) acc[r][t] = warp_sum(acc[r][t]);

        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                const int row = row0 + r;
                if (row >= sg.rows) continue;
#pragma unroll
                for (int t = 0; t < GEMV_MAX_TOK; ++t) {
                    if (t >= ntok) continue;
                    float* o = sg.out + (size_t)t * sg.out_stride + row;
                    const float v = acc[r][t];
                    if (sg.accumulate) *o += v;
                    else *o = v;
                    if (sg.argmax) {
                        const u64 key = argmax_key(v, (u32)row);
                        if (key > best[t]) best[t] = key;
                    }
                }
            }
        }
        if (sg.argmax) any_argmax = true;
    }

    // Fold the block's argmax candidates: one atomic per block and token.
    if (p.argmax_keys != nullptr) {
        __syncthreads();
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < GEMV_MAX_TOK; ++t) best_smem[warp * GEMV_MAX_TOK + t] = any_argmax ? best[t] : 0ull;
        }
        __syncthreads();
        if (threadIdx.x < ntok) {
            u64 b = 0ull;
            for (int w = 0; w < GEMV_THREADS / 32; ++w) {
                const u64 k = best_smem[w * GEMV_MAX_TOK + threadIdx.x];
                if (k > b) b = k;
            }
            if (b != 0ull) atomicMax(p.argmax_keys + threadIdx.x, b);
        }
    }
}
