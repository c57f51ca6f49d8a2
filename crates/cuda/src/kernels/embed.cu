// embed.cu: token embedding gather from the packed 4-bit table.
//
// embed_q4: h[t][c] = scale[tok][c / 64] * q[tok][c] + bias[tok][c / 64]
// (f32 out, the residual stream). Codes [VOCAB][HIDDEN / 8] u32, scales and
// biases [VOCAB][HIDDEN / 64] bf16. grid (ntok), block 256: each thread
// dequantises one word (8 columns) at a time. Also clears the per-token
// argmax keys that the lm_head GEMV of this step folds its rows into.
// Token ids are checked by the host (or produced on the device by the
// argmax); the clamp only keeps a bad id from reading out of bounds.

struct EmbedParams {
    const u32* codes;
    const bf16* scales;
    const bf16* biases;
    const u32* tokens;     // [ntok]
    float* h;              // [ntok][HIDDEN]
    u64* argmax_keys;      // [ntok] or null
};

extern "C" __global__ void __launch_bounds__(256)
embed_q4(const __grid_constant__ EmbedParams p) {
    const u32* __restrict__ codes = p.codes;
    const bf16* __restrict__ scales = p.scales;
    const bf16* __restrict__ biases = p.biases;
    float* __restrict__ h = p.h;
    u64* argmax_keys = p.argmax_keys;
    const u32* tokens = p.tokens;
    const int t = blockIdx.x;
    u32 tok = tokens[t];
    if (tok >= (u32)VOCAB) tok = 0;
    const u32* row = codes + (size_t)tok * (HIDDEN / 8);
    const bf16* srow = scales + (size_t)tok * (HIDDEN / GROUP_SIZE);
    const bf16* brow = biases + (size_t)tok * (HIDDEN / GROUP_SIZE);
    float* out = h + (size_t)t * HIDDEN;
    for (int w = threadIdx.x; w < HIDDEN / 8; w += blockDim.x) {
        const u32 word = row[w];
        const int g = (w * 8) / GROUP_SIZE;
        const float s = bf16_to_f32(srow[g]), b = bf16_to_f32(brow[g]);
        float4 lo, hi;
        lo.x = fmaf(s, q4_at(word, 0), b);
        lo.y = fmaf(s, q4_at(word, 1), b);
        lo.z = fmaf(s, q4_at(word, 2), b);
        lo.w = fmaf(s, q4_at(word, 3), b);
        hi.x = fmaf(s, q4_at(word, 4), b);
        hi.y = fmaf(s, q4_at(word, 5), b);
        hi.z = fmaf(s, q4_at(word, 6), b);
        hi.w = fmaf(s, q4_at(word, 7), b);
        reinterpret_cast<float4*>(out + w * 8)[0] = lo;
        reinterpret_cast<float4*>(out + w * 8)[1] = hi;
    }
    if (argmax_keys != nullptr && threadIdx.x == 0) argmax_keys[t] = 0ull;
}
