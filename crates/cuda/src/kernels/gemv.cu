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
// contiguous bytes per row per step. Blocks stride over tasks (a persistent
// grid sized by the host), so each block stages x once.
//
// Latency hiding: a warp's work is the sequence of (task, chunk step) items;
// the loads of the next item are issued before the arithmetic of the current
// one, and the first item's loads are issued before x is staged, so the
// staging overlaps the first weight loads. One entry point per token count
// (gemv_q1 .. gemv_q4) keeps the accumulators of small batches out of the
// register budget.
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

// One item's weights: the lane's 16-byte chunk of each of the task's rows.
struct GemvLoad {
    uint4 w[GEMV_ROWS];
    float sc[GEMV_ROWS];
    float bi[GEMV_ROWS];
};

// Where a task lives.
struct GemvTask {
    int seg;
    int row0;
    int bits;
    int nch;   // 16-byte chunks per row
    int its;   // chunk steps of a warp (ceil(nch / 32))
};

__device__ __forceinline__ GemvTask gemv_task(const GemvParams& p, int task) {
    int s = 0;
#pragma unroll
    for (int i = 1; i < GEMV_MAX_SEGS; ++i)
        if (i < p.nseg && task >= p.seg[i].task_start) s = i;
    GemvTask t;
    t.seg = s;
    t.row0 = (task - p.seg[s].task_start) * GEMV_ROWS;
    t.bits = p.seg[s].bits;
    t.nch = t.bits == 4 ? p.cols / 32 : p.cols / 16;
    t.its = (t.nch + 31) / 32;
    return t;
}

__device__ __forceinline__ void gemv_fetch(const GemvParams& p, const GemvTask& t, int it, int lane, GemvLoad& L) {
    const GemvSeg& sg = p.seg[t.seg];
    const int ch = lane + 32 * it;
    const int wpr = p.cols * t.bits / 32, gpr = p.cols / GROUP_SIZE;
    const int g = t.bits == 4 ? (ch >> 1) : (ch >> 2);
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        const int row = t.row0 + r;
        if (row < sg.rows && ch < t.nch) {
            L.w[r] = ld_stream_u4(sg.codes + (size_t)row * wpr + ch * 4);
            L.sc[r] = bf16_to_f32(ld_nc_u16(sg.scales + (size_t)row * gpr + g));
            L.bi[r] = bf16_to_f32(ld_nc_u16(sg.biases + (size_t)row * gpr + g));
        } else {
            L.w[r] = make_uint4(0, 0, 0, 0);
            L.sc[r] = 0.f;
            L.bi[r] = 0.f;
        }
    }
}

template <int NT>
__device__ __forceinline__ void gemv_compute(const GemvTask& t, int it, int lane, const GemvLoad& L, const float* sx,
                                             const float* csum, int P, int nc16, float (&acc)[GEMV_ROWS][NT]) {
    const int ch = lane + 32 * it;
    if (ch >= t.nch) return;
    if (t.bits == 4) {
#pragma unroll
        for (int tk = 0; tk < NT; ++tk) {
            float xv[32];
            load_x32(sx + tk * P + ch * 36, xv);
            const float cs = csum[tk * nc16 + 2 * ch] + csum[tk * nc16 + 2 * ch + 1];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) acc[r][tk] += fmaf(L.sc[r], dot32_q4(L.w[r], xv), L.bi[r] * cs);
        }
    } else {
#pragma unroll
        for (int tk = 0; tk < NT; ++tk) {
            const float* xs = sx + tk * P + PAD32(ch * 16);
            float xv[16];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float4 v = reinterpret_cast<const float4*>(xs)[i];
                xv[4 * i] = v.x;
                xv[4 * i + 1] = v.y;
                xv[4 * i + 2] = v.z;
                xv[4 * i + 3] = v.w;
            }
            const float cs = csum[tk * nc16 + ch];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) acc[r][tk] += fmaf(L.sc[r], dot16_q8(L.w[r], xv), L.bi[r] * cs);
        }
    }
}

template <int NT>
__device__ __forceinline__ void gemv_body(const GemvParams& p) {
    extern __shared__ float smem[];
    const int cols = p.cols;
    const int P = PADDED_LEN(cols);
    float* sx = smem;                         // [NT][P]
    float* csum = sx + NT * P;                // [NT][cols / 16]
    float* red = csum + NT * (cols / 16);     // [32]
    u64* best_smem = reinterpret_cast<u64*>(red + 32);  // [8 warps][GEMV_MAX_TOK]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nc16 = cols / 16;
    const int stride = gridDim.x * (GEMV_THREADS / 32);
    int task = blockIdx.x * (GEMV_THREADS / 32) + warp;

    // The first item's loads go out before x is staged.
    GemvLoad cur, nxt;
    GemvTask t;
    if (task < p.ntasks) {
        t = gemv_task(p, task);
        gemv_fetch(p, t, 0, lane, cur);
    }
    stage_activations(sx, csum, red, p.x, p.x_stride, p.gain, NT, cols, p.eps);

    u64 best[NT];
#pragma unroll
    for (int k = 0; k < NT; ++k) best[k] = 0ull;
    bool any_argmax = false;

    while (task < p.ntasks) {
        float acc[GEMV_ROWS][NT];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
            for (int k = 0; k < NT; ++k) acc[r][k] = 0.f;
        const int next_task = task + stride;
        GemvTask nt = t;
        for (int it = 0; it < t.its; ++it) {
            // Prefetch the next item: the next chunk step of this task, or
            // the first step of the warp's next task.
            if (it + 1 < t.its) {
                gemv_fetch(p, t, it + 1, lane, nxt);
            } else if (next_task < p.ntasks) {
                nt = gemv_task(p, next_task);
                gemv_fetch(p, nt, 0, lane, nxt);
            }
            gemv_compute<NT>(t, it, lane, cur, sx, csum, P, nc16, acc);
            cur = nxt;
        }
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
            for (int k = 0; k < NT; ++k) acc[r][k] = warp_sum(acc[r][k]);
        const GemvSeg& sg = p.seg[t.seg];
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                const int row = t.row0 + r;
                if (row >= sg.rows) continue;
#pragma unroll
                for (int k = 0; k < NT; ++k) {
                    float* o = sg.out + (size_t)k * sg.out_stride + row;
                    const float v = acc[r][k];
                    if (sg.accumulate) *o += v;
                    else *o = v;
                    if (sg.argmax) {
                        const u64 key = argmax_key(v, (u32)row);
                        if (key > best[k]) best[k] = key;
                    }
                }
            }
        }
        if (sg.argmax) any_argmax = true;
        task = next_task;
        t = nt;
    }

    // Fold the block's argmax candidates: one atomic per block and token.
    if (p.argmax_keys != nullptr) {
        __syncthreads();
        if (lane == 0) {
#pragma unroll
            for (int k = 0; k < GEMV_MAX_TOK; ++k) best_smem[warp * GEMV_MAX_TOK + k] = (any_argmax && k < NT) ? best[k < NT ? k : 0] : 0ull;
        }
        __syncthreads();
        if (threadIdx.x < NT) {
            u64 b = 0ull;
            for (int w = 0; w < GEMV_THREADS / 32; ++w) {
                const u64 k = best_smem[w * GEMV_MAX_TOK + threadIdx.x];
                if (k > b) b = k;
            }
            if (b != 0ull) atomicMax(p.argmax_keys + threadIdx.x, b);
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_q1(const __grid_constant__ GemvParams p) { gemv_body<1>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_q2(const __grid_constant__ GemvParams p) { gemv_body<2>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_q3(const __grid_constant__ GemvParams p) { gemv_body<3>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_q4(const __grid_constant__ GemvParams p) { gemv_body<4>(p); }
