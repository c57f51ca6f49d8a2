// sampling.cu: the end of a decode step on the device.
//
// argmax_finish: turns the packed argmax keys that the lm_head GEMV left
// (argmax_key in common.cuh: value, then the smaller index) into token ids,
// and advances the step state that stays on the GPU between steps:
//   tokens[t]    <- id          (the next step's input)
//   out_ids[step * ntok + t] <- id   (history the host reads at the end)
//   positions[t] += 1
//   *step += 1
// One block of at least ntok threads; ntok <= 1024.

struct ArgmaxFinishParams {
    const u64* keys;
    u32* tokens;
    u32* out_ids;     // [steps][ntok] or null
    int* positions;
    int* step;
    int ntok;
};

extern "C" __global__ void argmax_finish(const __grid_constant__ ArgmaxFinishParams p) {
    const u64* keys = p.keys;
    u32* tokens = p.tokens;
    u32* out_ids = p.out_ids;
    int* positions = p.positions;
    int* step = p.step;
    const int ntok = p.ntok;
    const int t = threadIdx.x;
    const int s = *step;
    if (t < ntok) {
        const u32 id = argmax_key_index(keys[t]);
        tokens[t] = id;
        if (out_ids != nullptr) out_ids[(size_t)s * ntok + t] = id;
        positions[t] += 1;
    }
    __syncthreads();
    if (t == 0) *step = s + 1;
}

// argmax_rows: keys[r] = argmax_key of the largest logits[r][c] (ties: the
// smaller c). grid (rows), block 256. Used when the logits come from the
// GEMM path (batch decode) rather than the fused GEMV.
struct ArgmaxRowsParams {
    const float* logits;   // [rows][cols]
    u64* keys;             // [rows]
    int cols;
};

extern "C" __global__ void __launch_bounds__(256) argmax_rows(const __grid_constant__ ArgmaxRowsParams p) {
    __shared__ u64 red[8];
    const float* row = p.logits + (size_t)blockIdx.x * p.cols;
    u64 best = 0ull;
    for (int c = threadIdx.x; c < p.cols; c += blockDim.x) {
        const u64 k = argmax_key(row[c], (u32)c);
        if (k > best) best = k;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(FULL_MASK, best, o);
        if (other > best) best = other;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 b = 0ull;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w)
            if (red[w] > b) b = red[w];
        p.keys[blockIdx.x] = b;
    }
}
