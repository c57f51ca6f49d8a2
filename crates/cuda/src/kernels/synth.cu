// synth.cu: random fills for synthetic weights made directly in GPU memory
// (speed probes at the real shape without writing 20 GB of checkpoint).
//
// Values come from a 64-bit integer hash of (seed, index) (splitmix64), so a
// fill is deterministic and independent of the launch shape. grid-stride
// loops; any grid works.

__device__ __forceinline__ u64 mix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Uniform in [0, 1) from the top 24 bits of the hash.
__device__ __forceinline__ float hash_unit(u64 seed, u64 i) {
    return (float)(mix64(seed ^ (i * 0x2545f4914f6cdd1dull)) >> 40) * (1.0f / 16777216.0f);
}

struct FillParams {
    void* ptr;
    u64 n;          // elements
    u64 seed;
    float lo;       // uniform range (f32 / bf16 fills)
    float hi;
    int kind;       // 0: random u32 words, 1: f32 uniform, 2: bf16 uniform
};

extern "C" __global__ void fill_random(const __grid_constant__ FillParams p) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride) {
        if (p.kind == 0) {
            reinterpret_cast<u32*>(p.ptr)[i] = (u32)(mix64(p.seed ^ (i * 0x2545f4914f6cdd1dull)) >> 16);
        } else {
            const float v = p.lo + (p.hi - p.lo) * hash_unit(p.seed, i);
            if (p.kind == 1) reinterpret_cast<float*>(p.ptr)[i] = v;
            else reinterpret_cast<bf16*>(p.ptr)[i] = f32_to_bf16(v);
        }
    }
}
