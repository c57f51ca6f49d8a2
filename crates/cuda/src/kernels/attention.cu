// attention.cu: the gated full-attention mixer (docs/design.md §2.4) over a paged KV cache.
//
// Input per token: the in-projection row [q_proj (per head: HD queries then
// HD gates) | k KV_DIM | v KV_DIM] (f32, stride proj_stride).
//   attn_prep:      q_norm / k_norm (RMSNorm per head, fp32), RoPE on the
//                   first ROT_DIM dims (NeoX halves, pairs (j, j + ROT_DIM/2),
//                   angle = pos * inv_freq[j]); K and V written to the cache
//                   (fp16), q to a q buffer (f32 for decode, fp16 for prefill).
//   attn_decode:    one query token per sequence, split-KV ("flash decoding")
//                   on tensor cores, one warp per split streaming its K/V
//                   tiles through a private cp.async pipeline.
//   attn_combine:   merges the splits, applies sigmoid(gate).
//   attn_combine_rows: the same sums for steps of many tokens, a block a
//                   (head, token) (attention.rs COMBINE_ROWS_FROM).
//   attn_prefill:   causal flash attention on wgmma (fp16 operands, fp32
//                   accumulators and softmax); a block holds the AG = 8 query
//                   heads of one KV head, so each staged K/V tile serves all
//                   eight.
// Output: mix[t][h * HD + d] = sigmoid(gate[t][h][d]) * sum_j softmax_j(q.k_j
// / sqrt(HD)) v_j[d] over the keys j <= pos[t] of the token's sequence.
// Scores are kept in the log2 domain (scale_log2 = log2(e) / sqrt(HD)).
//
// KV cache layout per layer: [block][A_KV_HEADS][KV_BLOCK][HD] fp16, for K
// and V separately; a sequence's token at position p lives in block
// block_table[slot][p / KV_BLOCK], row p % KV_BLOCK. Rows past a sequence's
// last key may hold anything: the kernels zero-fill them when staging.
//
// The decode kernel's shared-memory rows of K and V are HD + ATT_PAD halves
// (a 16-byte shift per row), so the 8 row addresses of every ldmatrix land in
// distinct bank groups: (HD / 8 + 1) is odd for HD a multiple of 32. The
// prefill kernel's tiles are 128-byte-swizzled atoms instead (wgmma reads).
//
// ---- decode: time against its floor ----------------------------------------
// A decode token reads its whole context once: 2 (K, V) x A_KV_HEADS x HD x 2
// bytes = 2 KiB per context token per layer at the real shape. At 32,768
// tokens that is 64 MiB per layer (671 MB over the 10 layers), at 131,072
// tokens 256 MiB per layer (2.7 GB per step). At ~4.0 TB/s (the measured copy
// bandwidth is 4.3) the floor is ~17 us per layer at 32K and ~67 us at 128K.
// Partials add 8 KiB written and read per (split, KV head): with 128 splits,
// 2 MiB per layer, 3% at 32K. Expected: ~3.5-4 TB/s from 32K up (the old
// kernel: ~0.8 TB/s, 335 us per layer at 128K), and short contexts bounded by
// two launches and a chain of four dependent memory round trips (pos, block
// table and queries, K/V, then the partials in the combine): a few us.
//
// ---- prefill: time against its floor ---------------------------------------
// Causal attention over a T-token prompt from position 0 costs 4 x HD x
// A_HEADS x T^2 / 2 FLOP per layer (QK^T and PV, 2 FLOP per FMA): 137 GFLOP
// per layer at 4,096 tokens (1.4 TFLOP over 10 layers), 141 TFLOP per layer
// at 131,072 (1.4 PFLOP). The old kernel ran at ~230 TFLOP/s (6 s at 128K).
// This one moves each K/V tile into shared memory once per 16 query tokens
// and 8 heads (the old one: once per 64 tokens of one head, 2x the fills);
// v2 was bound by the ldmatrix traffic of mma.sync (~280 B of shared memory
// per m16n8k16) and measured ~250 TFLOP/s (5.5 s of attention at 128K). v3
// (wgmma, operands read by the tensor cores from shared memory, no
// ldmatrix) has no such bound; ~2 x 2M MACs of tensor work a tile against
// ~1 k instructions of softmax a warpgroup.
//
// ---- history ---------------------------------------------------------------
// v1 decode: a CTA per (KV head, split), 4-byte K/V loads in a 64-step loop,
//    fp32 CUDA-core dot products, three barriers per 64-key block: ~0.8 TB/s
//    at 128K. v1 prefill: one query head per block (Q tile 64 x 1 head), each
//    K/V tile staged 8 times per KV head, causal mask on every tile, one tile
//    of prefetch: ~230 TFLOP/s.
// v2 (this file): decode on tensor cores with hi/lo fp16 splits (fp32-grade
//    scores and weights), a warp per split with a 6-stage pipeline of 16-byte
//    cp.async, splits spread over every SM for any batch; prefill with the 8
//    heads of a KV group per block, mask on diagonal tiles only, one barrier
//    per key tile, O rescale skipped once the row maxima settle.
//    Measured: ~250 TFLOP/s in a 131,072-token prefill (5.56 s of attention).
// v3 prefill: wgmma (S = Q K^T with both operands from shared memory, O += P V
//    with P from registers and V read N-major), swizzled atoms, no ldmatrix.
// v4 prefill: a producer warpgroup and full/empty mbarriers instead of a
//    block barrier every KV tile, the consumer warpgroups taking turns at the
//    tensor cores: 411 -> 377 us a 4,096-token attention layer.

#define HD A_HEAD_DIM
#define AG (A_HEADS / A_KV_HEADS)
#define A_QPROJ (2 * A_HEADS * HD)
#define A_KVDIM (A_KV_HEADS * HD)

#if AG != 8
#error "the attention kernels assume 8 query heads per KV head"
#endif
#if HD % 32 != 0 || HD > 256
#error "head dim must be a multiple of 32, at most 256"
#endif
#if ATT_PAD != 8
#error "shared-memory rows are padded by 8 halves (16 bytes)"
#endif

struct AttnPrepParams {
    const float* proj;
    const float* q_norm;     // [HD] gain
    const float* k_norm;     // [HD] gain
    const float* inv_freq;   // [ROT_DIM / 2]
    const int* pos;          // [ntok]
    const int* slot;         // [ntok]
    const int* block_table;  // [slots][bt_stride]
    f16* kcache;            // layer base
    f16* vcache;
    float* q_f32;            // [ntok][A_HEADS][HD] or null
    f16* q_f16;            // [ntok][A_HEADS][HD] or null
    int proj_stride;
    int bt_stride;
    float eps;
    int ntok;
};
LAYOUT_CHECK(AttnPrepParams, ATTN_PREP_PARAMS_SIZE)

// grid (ceil(ntok * AP_HEADS / ATT_PREP_WARPS)), block 32 * ATT_PREP_WARPS:
// warp w of block b takes item i = b * ATT_PREP_WARPS + w, token i /
// AP_HEADS, head i % AP_HEADS (a token's heads in consecutive warps, so a
// block reads whole stretches of its projection row): heads < A_HEADS are
// query heads, then the K heads, then the V heads (copied as is). Lane l
// holds dims l + 32 j (j < HD / 32): the norm is a warp sum, and the
// rotation's partner dims come through a per-warp row in shared memory.
// (A block a (head, token) of HD threads, with a block-wide sum and two
// barriers, took 125 us for 4,096 tokens: ~82K blocks of a few loads each.)
#define AP_HEADS (A_HEADS + 2 * A_KV_HEADS)
#define AP_PER (HD / 32)
extern "C" __global__ void __launch_bounds__(32 * ATT_PREP_WARPS) attn_prep(const __grid_constant__ AttnPrepParams p) {
    __shared__ float buf[ATT_PREP_WARPS][HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int item = blockIdx.x * ATT_PREP_WARPS + warp;
    if (item >= p.ntok * AP_HEADS) return;
    const int t = item / AP_HEADS, head = item % AP_HEADS;
    const int ps = p.pos[t];
    const float* pr = p.proj + (size_t)t * p.proj_stride;
    const int blk = p.block_table[(size_t)p.slot[t] * p.bt_stride + ps / KV_BLOCK];
    const int row = ps % KV_BLOCK;
    // This lane's first element of KV head g's row of this token in a cache.
    auto cache_row = [&](int g) { return (((size_t)blk * A_KV_HEADS + g) * KV_BLOCK + row) * HD + lane; };
    if (head >= A_HEADS + A_KV_HEADS) {
        const int g = head - A_HEADS - A_KV_HEADS;
        const float* v = pr + A_QPROJ + A_KVDIM + g * HD + lane;
        f16* out = p.vcache + cache_row(g);
        float x[AP_PER];
#pragma unroll
        for (int j = 0; j < AP_PER; ++j) x[j] = v[32 * j];
#pragma unroll
        for (int j = 0; j < AP_PER; ++j) out[32 * j] = f32_to_f16(x[j]);
        return;
    }
    const bool is_q = head < A_HEADS;
    const float* src = pr + (is_q ? head * 2 * HD : A_QPROJ + (head - A_HEADS) * HD) + lane;
    const float* gain = (is_q ? p.q_norm : p.k_norm) + lane;
    constexpr int half = ROT_DIM / 2;
    // Every load (x, the gain, the rotation frequencies) issued before the
    // sum needs the first.
    float x[AP_PER], gn[AP_PER], freq[AP_PER];
#pragma unroll
    for (int j = 0; j < AP_PER; ++j) {
        const int d = lane + 32 * j;
        x[j] = src[32 * j];
        gn[j] = gain[32 * j];
        freq[j] = d < ROT_DIM ? p.inv_freq[d % half] : 0.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < AP_PER; ++j) ss += x[j] * x[j];
    const float rn = rsqrtf(warp_sum(ss) / (float)HD + p.eps);
    float y[AP_PER];
#pragma unroll
    for (int j = 0; j < AP_PER; ++j) {
        y[j] = x[j] * rn * gn[j];
        buf[warp][lane + 32 * j] = y[j];
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < AP_PER; ++j) {
        const int d = lane + 32 * j;
        if (d < ROT_DIM) {
            float sn, cs;
            sincosf((float)ps * freq[j], &sn, &cs);
            y[j] = d < half ? y[j] * cs - buf[warp][d + half] * sn : y[j] * cs + buf[warp][d - half] * sn;
        }
    }
    if (is_q) {
        const size_t qi = ((size_t)t * A_HEADS + head) * HD + lane;
#pragma unroll
        for (int j = 0; j < AP_PER; ++j) {
            if (p.q_f32 != nullptr) p.q_f32[qi + 32 * j] = y[j];
            if (p.q_f16 != nullptr) p.q_f16[qi + 32 * j] = f32_to_f16(y[j]);
        }
    } else {
        f16* out = p.kcache + cache_row(head - A_HEADS);
#pragma unroll
        for (int j = 0; j < AP_PER; ++j) out[32 * j] = f32_to_f16(y[j]);
    }
}

// Two f32 as a hi and a lo fp16x2 word: hi = fp16(x), lo = fp16(x - hi).
// hi + lo carries ~22 significant bits, so a product with an fp16 operand
// summed over hi and lo in an fp32 accumulator is fp32-grade.
__device__ __forceinline__ void split_f16x2(float a, float b, u32& hi, u32& lo) {
    hi = pack_f16x2(a, b);
    lo = pack_f16x2(a - f16lo(hi), b - f16hi(hi));
}

// 8-byte global -> shared copy (cp.async.ca: the 16-byte .cg form of
// common.cuh cannot gather two 8-byte pieces into one 16-byte slot).
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_u32(smem)), "l"(gmem));
}

// ---- decode ---------------------------------------------------------------
//
// Work: token t with a context of len = pos[t] + 1 keys (n = ceil(len / 64)
// cache blocks) is cut into S = decode_splits(len) splits of `per` blocks
// (the last one shorter); an item is one (token, split, KV head). The count
// depends on the token's own length only, so a sequence gets the same
// splits, and bit for bit the same result, alone or in any batch, and a
// captured graph serves every context length.
//
// Grid: a persistent set of CTAs (at most one per SM), ATT_DEC_WARPS warps
// each. Every CTA lists the items of the whole batch from pos[] (prefix sums
// in shared memory, the only CTA barriers); warp slot L = warp * gridDim.x +
// blockIdx.x takes items L, L + W, L + 2W, ... (W = all warps), so the first
// items land on distinct SMs and a long context spreads over the whole GPU
// while many short ones share it.
//
// A warp streams the 16-key tiles of its items (K and V, 2 x 8 KiB at the
// real shape) through ATT_DEC_STAGES shared-memory stages with 16-byte
// cp.async: ATT_DEC_STAGES - 1 tiles are in flight while it computes one,
// across item boundaries too. No CTA barrier in the loop: the stages are
// private to the warp (a cp.async.wait_group + __syncwarp per tile).
// Shared memory at the real shape: 2 warps x (6 x 16.5 KiB of stages + 8 KiB
// of query fragments) = 214 KiB, one CTA per SM, plus 12 bytes per batch
// token (the launcher refuses a batch that does not fit).
//
// Tile math on tensor cores (m16n8k16, fp16 in, fp32 accumulate):
//   S = Q K^T: A = the 8 query heads of the KV head as rows 0-7 (fp16 hi
//     part) and rows 8-15 (lo part), B = K rows (ldmatrix, keys = n), so
//     S[h][key] = C[h][key] + C[h + 8][key]: fp32-grade scores for free.
//     The A fragments wait in shared memory (8 KiB a warp) rather than in
//     64 registers.
//   O^T += V^T P^T: A = V^T (ldmatrix.trans, dims = m, keys = k), B = P^T
//     (heads = n) taken straight from the S accumulators of the thread, twice
//     (hi and lo parts of P). O^T lives in 4 x HD / 16 registers per thread:
//     lane (r = lane / 4, c = lane % 4) holds dims 16 mt + r (+ 8) of heads
//     2c and 2c + 1.
// Online softmax per head in the quad of lanes of that head (row r); the
// rescale factors of heads 2c, 2c + 1 come over by two shuffles.
// Output per item: unnormalised O and (max, sum) in the log2 domain.

#define DEC_KEYS ATT_DEC_KEYS                  // keys per tile (the k of P V)
#define DEC_LD (HD + ATT_PAD)                  // shared row stride, halves
#define DEC_TILE (DEC_KEYS * DEC_LD)           // halves of one K or V tile
#define DEC_TPB (KV_BLOCK / DEC_KEYS)          // tiles per cache block
#define DEC_KS (HD / 16)                       // k-steps of Q K^T = m-tiles of V^T P^T
#define DEC_CP (DEC_KEYS * (HD / 8) / 32)      // 16-byte copies per lane per K (or V) tile
#define DEC_TILE_BYTES (ATT_DEC_WARPS * ATT_DEC_STAGES * 2 * DEC_TILE * 2)
#define DEC_Q_BYTES (ATT_DEC_WARPS * DEC_KS * 32 * 16)   // per warp: the A fragments of Q, [k-step][lane] x 16 bytes

#if DEC_KEYS != 16
#error "a decode tile is one m16n8k16 k-step of keys"
#endif
#if KV_BLOCK % DEC_KEYS != 0
#error "cache blocks must hold whole decode tiles"
#endif
#if ATT_DEC_STAGES < 2
#error "the decode pipeline needs at least 2 stages"
#endif

struct AttnDecodeParams {
    const float* q;          // [ntok][A_HEADS][HD]
    const f16* kcache;
    const f16* vcache;
    const int* block_table;
    const int* pos;
    const int* slot;
    float* part_o;           // [ntok][A_HEADS][max_splits][HD]
    float* part_ml;          // [ntok][A_HEADS][max_splits][2]  (max, sum) in the log2 domain
    int bt_stride;
    int max_splits;
    int ntok;
    float scale_log2;
};

// Cache blocks per split for a context of `nblk` blocks: one for contexts of
// up to ATT_SPLIT_SMALL blocks (short contexts are latency-bound: every
// block in flight at once), at least two beyond (a split's partials, 8 KiB,
// then stay under 1/8 of the 64 KiB it reads), more when max_splits binds.
// Mirrors attention::splits_for in Rust (which also sizes the scratch).
__device__ __forceinline__ int decode_per(int nblk, int max_splits) {
    return max(nblk > ATT_SPLIT_SMALL ? 2 : 1, (nblk + max_splits - 1) / max_splits);
}
__device__ __forceinline__ int decode_splits(int len, int max_splits) {
    const int nblk = (len + KV_BLOCK - 1) / KV_BLOCK;
    const int per = decode_per(nblk, max_splits);
    return (nblk + per - 1) / per;
}

// One item: token t, split, KV head g, its tiles [j, j_end) of 16 keys.
struct DecItem {
    int t, g, split, j, j_end, len;
};

// Item `it` (< the batch's total): token t owns items s_first[t] ..
// s_first[t + 1] - 1, split-major, KV head minor.
__device__ __forceinline__ DecItem dec_item(int it, const int* s_first, const int* s_len, int ntok, int max_splits) {
    int lo = 0, hi = ntok;   // s_first[lo] <= it < s_first[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (s_first[mid] <= it) lo = mid;
        else hi = mid;
    }
    DecItem d;
    d.t = lo;
    const int r = it - s_first[lo];
    d.split = r / A_KV_HEADS;
    d.g = r - d.split * A_KV_HEADS;
    d.len = s_len[lo];
    const int nblk = (d.len + KV_BLOCK - 1) / KV_BLOCK;
    const int per = decode_per(nblk, max_splits);
    const int b0 = d.split * per;
    d.j = b0 * DEC_TPB;
    // Tiles wholly past the last key are skipped; j < j_end since b0 < nblk.
    d.j_end = min((d.len + DEC_KEYS - 1) / DEC_KEYS, (b0 + per) * DEC_TPB);
    return d;
}

// Block-table entries b0 .. b0 + 31 of a sequence of `len` keys, one per
// lane (0 past its last block, never read past the row).
__device__ __forceinline__ int dec_table_chunk(const int* row, int b0, int len, int lane) {
    const int nblk = (len + KV_BLOCK - 1) / KV_BLOCK;
    return b0 + lane < nblk ? row[b0 + lane] : 0;
}

// grid (CTAs <= SMs), block ATT_DEC_WARPS * 32, dynamic shared memory
// DEC_TILE_BYTES + DEC_Q_BYTES + (3 ntok + 1) ints. See above.
extern "C" __global__ void __launch_bounds__(ATT_DEC_WARPS * 32, 1)
attn_decode(const __grid_constant__ AttnDecodeParams p) {
    extern __shared__ __align__(16) unsigned char dec_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ntok = p.ntok;
    int* s_first = reinterpret_cast<int*>(dec_smem + DEC_TILE_BYTES + DEC_Q_BYTES);   // [ntok + 1]
    int* s_len = s_first + ntok + 1;                                    // [ntok]
    int* s_slot = s_len + ntok;                                         // [ntok]

    for (int t = threadIdx.x; t < ntok; t += blockDim.x) {
        const int len = p.pos[t] + 1;
        s_len[t] = len;
        s_slot[t] = p.slot[t];
        s_first[t + 1] = decode_splits(len, p.max_splits) * A_KV_HEADS;
    }
    __syncthreads();
    if (warp == 0) {
        // In-place inclusive scan of the item counts, 32 tokens at a time.
        int run = 0;
        for (int base = 0; base < ntok; base += 32) {
            const int i = base + lane;
            int v = i < ntok ? s_first[i + 1] : 0;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int u = __shfl_up_sync(FULL_MASK, v, o);
                if (lane >= o) v += u;
            }
            if (i < ntok) s_first[i + 1] = run + v;
            run += __shfl_sync(FULL_MASK, v, 31);
        }
        if (lane == 0) s_first[0] = 0;
    }
    __syncthreads();
    const int total = s_first[ntok];
    const int nw = gridDim.x * ATT_DEC_WARPS;
    const int first = warp * gridDim.x + blockIdx.x;
    // Warp-uniform; no CTA barrier follows.
    if (first >= total) return;

    f16* wbuf = reinterpret_cast<f16*>(dec_smem) + (size_t)warp * ATT_DEC_STAGES * 2 * DEC_TILE;
    // The item's query fragments live in shared memory, not in 64 registers:
    // lane l's 16 bytes of k-step ks at sq[ks * 32 + l] (each lane reads back
    // only what it wrote, so no barrier; a warp's 512 contiguous bytes per
    // k-step are conflict-free).
    uint4* sq = reinterpret_cast<uint4*>(dec_smem + DEC_TILE_BYTES) + (size_t)warp * DEC_KS * 32;

    // Producer cursor: the next tile to request. Its block-table entries come
    // 32 at a time, one per lane, and go round by shuffle.
    int ld_item = first;
    DecItem ld = dec_item(first, s_first, s_len, ntok, p.max_splits);
    const int* ld_row = p.block_table + (size_t)s_slot[ld.t] * p.bt_stride;
    int ld_b0 = ld.j / DEC_TPB;
    int ld_tab = dec_table_chunk(ld_row, ld_b0, ld.len, lane);

    // Requests the producer's tile into `stage` (one commit group, empty once
    // the warp's items are exhausted, so the wait counts stay uniform).
    auto issue = [&](int stage) {
        if (ld_item < total) {
            const int b = ld.j / DEC_TPB;
            if (b - ld_b0 >= 32) {
                ld_b0 = b;
                ld_tab = dec_table_chunk(ld_row, b, ld.len, lane);
            }
            const int phys = __shfl_sync(FULL_MASK, ld_tab, b - ld_b0);
            const size_t row0 = (((size_t)phys * A_KV_HEADS + ld.g) * KV_BLOCK + (ld.j - b * DEC_TPB) * DEC_KEYS) * HD;
            const int valid = ld.len - ld.j * DEC_KEYS;   // rows holding keys (> 0); the rest are zero-filled
            f16* dk = wbuf + stage * 2 * DEC_TILE;
            f16* dv = dk + DEC_TILE;
#pragma unroll
            for (int it = 0; it < DEC_CP; ++it) {
                const int i = it * 32 + lane;
                const int r = i / (HD / 8), c = (i - r * (HD / 8)) * 8;
                const bool ok = r < valid;
                const size_t src = row0 + (size_t)(ok ? r : 0) * HD + c;
                cp_async16(dk + r * DEC_LD + c, p.kcache + src, ok ? 16 : 0);
                cp_async16(dv + r * DEC_LD + c, p.vcache + src, ok ? 16 : 0);
            }
            if (++ld.j == ld.j_end) {
                ld_item += nw;
                if (ld_item < total) {
                    ld = dec_item(ld_item, s_first, s_len, ntok, p.max_splits);
                    ld_row = p.block_table + (size_t)s_slot[ld.t] * p.bt_stride;
                    ld_b0 = ld.j / DEC_TPB;
                    ld_tab = dec_table_chunk(ld_row, ld_b0, ld.len, lane);
                }
            }
        }
        cp_async_commit();
    };

    // Consumer cursor: the tile being computed.
    int cs_item = first;
    DecItem cs = dec_item(first, s_first, s_len, ntok, p.max_splits);
    const int qr = lane >> 2, qc = lane & 3;
    // Lane (qr, qc) needs dims 16 ks + 2qc (+1) and 16 ks + 8 + 2qc (+1) of
    // query head qr of the item's KV group: two float2 per k-step.
    auto q_row = [&]() { return p.q + ((size_t)cs.t * A_HEADS + cs.g * AG + qr) * HD + 2 * qc; };
    // The first item's queries travel with its first tile (commit group 0),
    // into the slots their fragments will take, so the two round trips
    // overlap at no register cost.
    {
        const float* qrow = q_row();
#pragma unroll
        for (int ks = 0; ks < DEC_KS; ++ks) {
            cp_async8(&sq[ks * 32 + lane].x, qrow + ks * 16);
            cp_async8(&sq[ks * 32 + lane].z, qrow + ks * 16 + 8);
        }
    }

#pragma unroll 1
    for (int s = 0; s < ATT_DEC_STAGES - 1; ++s) issue(s);

    float acc[DEC_KS][4];    // O^T fragments
    float m_i = NEG_INF, l_i = 0.f;   // head qr, replicated over its quad
    bool fresh = true;
    int st = 0;
#pragma unroll 1
    while (true) {
        // Groups committed so far: ATT_DEC_STAGES - 1 + (tiles consumed); the
        // oldest pending one is this tile's.
        cp_async_wait<ATT_DEC_STAGES - 2>();
        __syncwarp();   // every lane's copies visible; every lane done with the previous stage
        issue(st == 0 ? ATT_DEC_STAGES - 1 : st - 1);
        if (fresh) {
            const float* qrow = q_row();
#pragma unroll
            for (int ks = 0; ks < DEC_KS; ++ks) {
                float4 x;
                if (cs_item == first) {
                    x = *reinterpret_cast<const float4*>(&sq[ks * 32 + lane]);
                } else {
                    const float2 k0 = *reinterpret_cast<const float2*>(qrow + ks * 16);
                    const float2 k8 = *reinterpret_cast<const float2*>(qrow + ks * 16 + 8);
                    x = make_float4(k0.x, k0.y, k8.x, k8.y);
                }
                // A fragment: hi (rows 0-7) and lo (rows 8-15) of the 8 queries.
                uint4 a;
                split_f16x2(x.x, x.y, a.x, a.y);
                split_f16x2(x.z, x.w, a.z, a.w);
                sq[ks * 32 + lane] = a;
            }
#pragma unroll
            for (int mt = 0; mt < DEC_KS; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
            m_i = NEG_INF;
            l_i = 0.f;
            fresh = false;
        }
        const f16* sk = wbuf + st * 2 * DEC_TILE;
        const f16* sv = sk + DEC_TILE;
        st = st + 1 == ATT_DEC_STAGES ? 0 : st + 1;

        // S = Q K^T: n-tile nf = keys 8 nf .. 8 nf + 7; two accumulator sets
        // (even / odd k-steps) halve the dependent mma chain.
        float sa[2][2][4];
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int b = 0; b < 2; ++b) sa[a][b][0] = sa[a][b][1] = sa[a][b][2] = sa[a][b][3] = 0.f;
        const f16* kaddr = sk + ((lane & 7) + ((lane >> 4) << 3)) * DEC_LD + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int ks = 0; ks < DEC_KS; ++ks) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3, kaddr + ks * 16);
            const uint4 a = sq[ks * 32 + lane];
            mma_f16(sa[ks & 1][0], a.x, a.y, a.z, a.w, b0, b1);
            mma_f16(sa[ks & 1][1], a.x, a.y, a.z, a.w, b2, b3);
        }
        // Lane (qr, qc): head qr, keys 2qc, 2qc + 1 (nf 0) and 8 + 2qc, 9 + 2qc (nf 1).
        const int key0 = cs.j * DEC_KEYS;
        float sc[4];
#pragma unroll
        for (int nf = 0; nf < 2; ++nf) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float v = (sa[0][nf][e] + sa[0][nf][e + 2]) + (sa[1][nf][e] + sa[1][nf][e + 2]);
                const int key = key0 + nf * 8 + 2 * qc + e;
                sc[nf * 2 + e] = key < cs.len ? v * p.scale_log2 : NEG_INF;
            }
        }
        float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        // Finite: the tile's first key is always inside the context.
        const float m_new = fmaxf(m_i, mx);
        const float alpha = exp2f(m_i - m_new);   // 0 on the item's first tile
        float pr[4];
        float rs = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            pr[e] = exp2f(sc[e] - m_new);
            rs += pr[e];
        }
        rs += __shfl_xor_sync(FULL_MASK, rs, 1);
        rs += __shfl_xor_sync(FULL_MASK, rs, 2);
        l_i = l_i * alpha + rs;
        m_i = m_new;
        // B fragments of P^T: b0 = keys 2qc, 2qc + 1, b1 = keys 8 + 2qc, 9 + 2qc, head qr.
        u32 ph0, pl0, ph1, pl1;
        split_f16x2(pr[0], pr[1], ph0, pl0);
        split_f16x2(pr[2], pr[3], ph1, pl1);
        // Rescale factors of the O^T columns of this lane: heads 2qc, 2qc + 1.
        const float al0 = __shfl_sync(FULL_MASK, alpha, qc * 8);
        const float al1 = __shfl_sync(FULL_MASK, alpha, qc * 8 + 4);
        const f16* vaddr = sv + ((lane & 7) + ((lane >> 4) << 3)) * DEC_LD + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int mt = 0; mt < DEC_KS; ++mt) {
            acc[mt][0] *= al0;
            acc[mt][1] *= al1;
            acc[mt][2] *= al0;
            acc[mt][3] *= al1;
            u32 a0, a1, a2, a3;
            ldmatrix_x4_trans(a0, a1, a2, a3, vaddr + mt * 16);
            mma_f16(acc[mt], a0, a1, a2, a3, ph0, ph1);
            mma_f16(acc[mt], a0, a1, a2, a3, pl0, pl1);
        }

        if (++cs.j == cs.j_end) {
            const size_t hs = (size_t)p.max_splits * HD;   // head stride of the partials
            float* po = p.part_o + (((size_t)cs.t * A_HEADS + cs.g * AG) * p.max_splits + cs.split) * HD;
#pragma unroll
            for (int mt = 0; mt < DEC_KS; ++mt) {
                const int d = mt * 16 + qr;
                po[(2 * qc) * hs + d] = acc[mt][0];
                po[(2 * qc + 1) * hs + d] = acc[mt][1];
                po[(2 * qc) * hs + d + 8] = acc[mt][2];
                po[(2 * qc + 1) * hs + d + 8] = acc[mt][3];
            }
            if (qc == 0) {
                float* ml = p.part_ml + (((size_t)cs.t * A_HEADS + cs.g * AG + qr) * p.max_splits + cs.split) * 2;
                ml[0] = m_i;
                ml[1] = l_i;
            }
            cs_item += nw;
            if (cs_item >= total) break;
            cs = dec_item(cs_item, s_first, s_len, ntok, p.max_splits);
            fresh = true;
        }
    }
    cp_async_wait<0>();
}

// ---- combine --------------------------------------------------------------
//
// mix[t][h * HD + d] = sigmoid(gate) * sum_s w_s O_s[d] / sum_s w_s l_s with
// w_s = 2^(m_s - M), M = max_s m_s, over the token's own split count.
// grid (HD / 32, A_HEADS, ntok), block 256: thread (sl = tid / 8, quad =
// tid % 8) sums float4 dims 4 quad .. of splits sl, sl + 32, ... (up to four
// loads in flight each at 128 splits, every partial of a head read by one
// wave of CTAs); one barrier, then 32 threads add the 32 split lanes in
// order (deterministic). Every warp finds M and L itself (a few reads of the
// L1-resident (max, sum) pairs) rather than waiting on a second barrier.
#if !defined(ATT_COMBINE_DIMS) || !defined(ATT_COMBINE_THREADS)
#error "ATT_COMBINE_DIMS and ATT_COMBINE_THREADS must be defined by the host (attention.rs defines)"
#endif
#define CB_DIMS ATT_COMBINE_DIMS
#define CB_Q (CB_DIMS / 4)
#define CB_SL (ATT_COMBINE_THREADS / CB_Q)
static_assert(HD % CB_DIMS == 0 && CB_DIMS % 4 == 0 && ATT_COMBINE_THREADS % 32 == 0 && ATT_COMBINE_THREADS % CB_Q == 0 &&
                  CB_DIMS <= ATT_COMBINE_THREADS,
              "attention.rs COMBINE_DIMS / COMBINE_THREADS: whole float4 lanes of dims, whole warps, a thread for each dim's ordered sum");

struct AttnCombineParams {
    const float* part_o;
    const float* part_ml;
    const float* proj;     // for the gates
    float* mix_f32;
    f16* mix_f16;
    const int* pos;        // the token's position: its context length - 1
    int max_splits;        // stride of the partials
    int proj_stride;
};

// The max M of a head's split maxima and L = sum_s 2^(m_s - M) l_s, each
// computed by one whole warp (lane-strided, then the warp's tree): the same
// bits in every warp that computes them.
__device__ __forceinline__ void combine_ml(const float* ml, int ns, int lane, float& M, float& L) {
    float mloc = NEG_INF;
    for (int s = lane; s < ns; s += 32) mloc = fmaxf(mloc, ml[2 * s]);
    M = warp_max(mloc);   // finite: every split holds at least one key
    float lloc = 0.f;
    for (int s = lane; s < ns; s += 32) lloc += exp2f(ml[2 * s] - M) * ml[2 * s + 1];
    L = warp_sum(lloc);
}

// Dim d of head h, token t: (sum / L) * sigmoid(gate), to the f32 and/or
// fp16 mixer row (both combine kernels, so both give the same bits).
__device__ __forceinline__ void combine_store(const AttnCombineParams& p, int t, int h, int d, float sum, float L) {
    const float gate = p.proj[(size_t)t * p.proj_stride + h * 2 * HD + HD + d];
    const float y = (sum / L) * sigmoidf_(gate);
    const size_t oi = (size_t)t * A_HEADS * HD + h * HD + d;
    if (p.mix_f32 != nullptr) p.mix_f32[oi] = y;
    if (p.mix_f16 != nullptr) p.mix_f16[oi] = f32_to_f16(y);
}

extern "C" __global__ void __launch_bounds__(ATT_COMBINE_THREADS) attn_combine(const __grid_constant__ AttnCombineParams p) {
    __shared__ float4 red[CB_SL][CB_Q];
    const int chunk = blockIdx.x, h = blockIdx.y, t = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31;
    const int quad = tid % CB_Q, sl = tid / CB_Q;
    const int ms = p.max_splits;
    const int ns = decode_splits(p.pos[t] + 1, ms);
    const float* ml = p.part_ml + ((size_t)t * A_HEADS + h) * ms * 2;
    float M, L;
    combine_ml(ml, ns, lane, M, L);
    const float* po = p.part_o + ((size_t)t * A_HEADS + h) * ms * HD + chunk * CB_DIMS + quad * 4;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = sl; s < ns; s += CB_SL) {
        const float w = exp2f(ml[2 * s] - M);
        const float4 v = *reinterpret_cast<const float4*>(po + (size_t)s * HD);
        o.x = fmaf(w, v.x, o.x);
        o.y = fmaf(w, v.y, o.y);
        o.z = fmaf(w, v.z, o.z);
        o.w = fmaf(w, v.w, o.w);
    }
    red[sl][quad] = o;
    __syncthreads();
    if (tid < CB_DIMS) {
        const float* r = reinterpret_cast<const float*>(&red[0][0]);
        float sum = 0.f;
        for (int s = 0; s < CB_SL; ++s) sum += r[s * CB_DIMS + tid];
        combine_store(p, t, h, chunk * CB_DIMS + tid, sum, L);
    }
}

// attn_combine_rows: attn_combine's result, bit for bit, with a block a
// (head, token) and a thread a head dim: grid (A_HEADS, ntok), block HD.
// attn_combine cuts a head's dims into HD / 32 blocks of 256 threads, most
// of which hold no split at short contexts (8,192 blocks of ~5 splits for
// 64 tokens at 256 keys: ~8 waves of short blocks, 22 us on the H100).
// Here warp 0 finds M and L (combine_ml) and the weights w_s = 2^(m_s - M)
// go to shared memory once, then thread d forms attn_combine's sums in
// attn_combine's order: lane sl's partial is the fma chain over splits sl,
// sl + CB_SL, ... from 0, and the partials are added in lane order from 0
// (lanes past the split count add +0, which changes no sum: one that
// starts at +0 is never -0).
static_assert(HD <= 1024 && HD % 32 == 0, "attn_combine_rows: a thread a head dim, whole warps (warp 0 finds M and L)");
extern "C" __global__ void __launch_bounds__(HD) attn_combine_rows(const __grid_constant__ AttnCombineParams p) {
    __shared__ float ws[ATT_MAX_SPLITS];
    __shared__ float sML[2];
    const int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    const int ms = p.max_splits;
    const int ns = decode_splits(p.pos[t] + 1, ms);
    const float* ml = p.part_ml + ((size_t)t * A_HEADS + h) * ms * 2;
    if (threadIdx.x < 32) {
        float M, L;
        combine_ml(ml, ns, threadIdx.x, M, L);
        if (threadIdx.x == 0) {
            sML[0] = M;
            sML[1] = L;
        }
    }
    __syncthreads();
    const float M = sML[0];
    for (int s = threadIdx.x; s < ns; s += blockDim.x) ws[s] = exp2f(ml[2 * s] - M);
    __syncthreads();
    const float* po = p.part_o + ((size_t)t * A_HEADS + h) * ms * HD + d;
    float sum = 0.f;
    for (int sl = 0; sl < min(ns, CB_SL); ++sl) {
        float o = 0.f;
#pragma unroll 4
        for (int s = sl; s < ns; s += CB_SL) o = fmaf(ws[s], po[(size_t)s * HD], o);
        sum += o;
    }
    combine_store(p, t, h, d, sum, sML[1]);
}

// ---- prefill: causal flash attention on wgmma -------------------------------
//
// grid (the query tiles of up to ATT_PF_MAX_PIECES sequences' runs of rows,
// each piece ceil(t / 16) of them, A_KV_HEADS), block PF_THREADS = two
// consumer warpgroups and a producer warpgroup (ATT_PF_PRODUCER_WARPS): the many
// short prompts of one pass fill the GPU together, and each block finds its
// piece in the parameter table (pieces longest first). The block's 128
// query rows are the AG = 8 heads of KV head blockIdx.y times its 16
// tokens: row R = hh * 16 + r is token q0 + r of head kvh * 8 + hh, so warp
// w owns head w (rows g and g + 8 of lane (g, c) are tokens q0 + g and
// q0 + g + 8) and warpgroup wg rows 64 wg .. 64 wg + 63. Query tiles run
// longest first.
//
// Shared memory (dynamic, aligned here to 1,024 bytes; no padding): every
// row of Q, K and V is cut into HD / 64 "atoms" of 64 head dims (128
// bytes), each atom stored as rows of 128 bytes with the 128-byte swizzle
// (16-byte chunk j of row r at chunk j ^ (r & 7)):
//   Q [HD / 64][128 rows][128 B], then K of 64 keys (one cache block) in
//   two stages and V in three, each [HD / 64][64 keys][128 B], then the
//   stages' mbarriers: full K[2], full V[3], empty K[2], empty V[3].
// At HD 256: 64 + 5 x 32 KiB = 224 KiB, one block an SM.
//
// The producer warpgroup copies tile t's K and V (cp.async, 16 bytes a lane
// a row, 16 rows a warp; rows past the sequence zero-filled; it gives its
// registers to the consumers, setmaxnreg 80 / 208, as three warps a
// scheduler at the 168 registers of a 384-thread launch would spill the
// consumers' accumulators) into K stage t % 2 and V stage
// t % 3 once the consumers have released the tiles that held them (empty
// barriers: every consumer warp arrives when its products reading them
// have retired), and each lane's copies arrive on the stage's full barrier
// when they land (cp.async.mbarrier.arrive.noinc). No block barrier after
// the set-up: each warpgroup waits only for the stages it reads, so the two
// drift apart, and a scheduling barrier pair makes them take turns at the
// tensor cores (FA3's ping-pong): warpgroup 0 issues its products, lets
// warpgroup 1 issue its own, and runs its softmax while the tensor cores
// work through warpgroup 1's; then the roles swap.
//
// Per 64-key tile kb, in each warpgroup:
//   S (64 x 64) = Q K^T: HD / 16 wgmma.m64n64k16, both operands from shared
//     memory, K-major;
//   the causal mask (only on tiles that reach past the block's first query
//     position) and the online softmax in registers: the accumulator of lane
//     (g, c) of warp w holds rows 16 w + g (+ 8), columns 8 j + 2 c (+ 1),
//     which is mma.sync's C layout, so the softmax is v1's;
//   O (64 x HD) += P V: P rounded to fp16 in registers is the A operand (the
//     accumulator layout of S for keys 16 ks.. is the A fragment of k-step
//     ks), V the B operand read N-major (head dims contiguous: the same
//     staged layout as K, described with imm-trans-b) by 4
//     wgmma.m64n{HD}k16.
// A turn issues PV(kb) and S(kb + 1) together; one wgmma wait retires both
// (groups retire in order), the warpgroup releases V(kb) and K(kb + 1),
// then runs the softmax of kb + 1. Nothing stays in flight across a loop
// iteration (ptxas serialises every wgmma of a kernel when it cannot
// follow them).

#define PF_BQ ATT_PF_TOKENS
#define PF_BN KV_BLOCK
#define PF_NF (PF_BN / 8)   // score n-fragments (8 columns) a lane holds
#define PF_OF (HD / 8)      // output n-fragments
#define PF_CONSUMERS (AG * 32)
#define PF_THREADS (PF_CONSUMERS + 32 * ATT_PF_PRODUCER_WARPS)
#define PF_ATOMS (HD / 64)
#define PF_ROWS (AG * PF_BQ)                    // query rows of a block
#define PF_Q_BYTES (PF_ATOMS * PF_ROWS * 128)
#define PF_T_BYTES (PF_ATOMS * PF_BN * 128)     // one K or V tile
#define PF_K_STAGES ATT_PF_K_STAGES
#define PF_V_STAGES ATT_PF_V_STAGES
#define PF_CPR (HD / 8)                         // 16-byte chunks of a K/V row
// Named barriers: 1 + wg, a warpgroup's Q landed; 3 + wg, warpgroup wg's
// turn at the tensor cores.
#define PF_BAR_Q 1
#define PF_BAR_TURN 3
#define PF_PRODUCERS (32 * ATT_PF_PRODUCER_WARPS)
#define PF_PROWS (PF_BN / ATT_PF_PRODUCER_WARPS)   // rows of a tile a producer warp copies
#define PF_RSTEP (32 / PF_CPR)                      // rows a producer warp copies at once
// Registers a thread: the launch gives every thread 65,536 / PF_THREADS
// (rounded down to 8: 168); setmaxnreg moves them within the block's own
// pool, so what the consumers take must be what the producers give back,
// or their setmaxnreg.inc waits forever.
#define PF_REGS_LAUNCH ((65536 / PF_THREADS) & ~7)
#define PF_REGS_PRODUCER 80
#define PF_REGS_CONSUMER 208
static_assert((PF_REGS_CONSUMER - PF_REGS_LAUNCH) * PF_CONSUMERS <= (PF_REGS_LAUNCH - PF_REGS_PRODUCER) * PF_PRODUCERS,
              "attn_prefill: the consumers' registers exceed what the producers give back");
#if ATT_PF_PRODUCER_WARPS != 4 || 32 % PF_CPR != 0 || PF_PROWS % PF_RSTEP != 0
#error "attn_prefill's producer: a warpgroup (setmaxnreg), whole rows a warp a copy"
#endif
#if PF_K_STAGES != 2 || PF_V_STAGES != 3
#error "attn_prefill's ring: tile t + 2 is copied while PV(t - 1) and S(t) may still read: 2 K stages, 3 V stages"
#endif

#if PF_BQ != 16
#error "a prefill block holds 16 query tokens of each of its 8 heads"
#endif
#if KV_BLOCK != 64
#error "the prefill kernel takes one cache block per KV tile of 64"
#endif
#if HD % 64 != 0 || (HD != 64 && HD != 256)
#error "attn_prefill's wgmma shapes are compiled for head dims 64 and 256"
#endif

// The wgmma products (register and shared-memory A) are in common.cuh.

template <int N>
__device__ __forceinline__ void wgmma_pv(float* d, const u32* a, unsigned long long db) {
    if constexpr (N == 64) wgmma_rs_m64n64<1>(d, a, db);
    else wgmma_rs_m64n256<1>(d, a, db);
}

// 16-byte chunk `c` (0 .. HD / 8 - 1) of row `r` in a tile of `rows` rows
// stored as swizzled atoms (above).
__device__ __forceinline__ int pf_chunk_off(int rows, int r, int c) {
    return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// One sequence's rows of the pass: its block-table row, the pass row of
// its first token, its token count, that token's position and the first
// query tile (blockIdx.x) of the piece.
struct PfPiece {
    const int* block_table;
    int row0;
    int t;
    int p0;
    int tile0;
};

struct AttnPrefillParams {
    const f16* q;             // [rows][A_HEADS][HD] of the pass
    const f16* kcache;        // layer base
    const f16* vcache;
    const float* proj;        // the pass's in-projection rows (for the gates)
    float* mix_f32;           // [rows][A_HEADS * HD] or null
    f16* mix_f16;             // or this
    int proj_stride;
    int npieces;              // 1 .. ATT_PF_MAX_PIECES
    float scale_log2;
    int pad;
    PfPiece piece[ATT_PF_MAX_PIECES];   // longest first
};
LAYOUT_CHECK(AttnPrefillParams, ATTN_PREFILL_PARAMS_SIZE)

// A ring of tile stages: tile t in stage t % STAGES, each stage with a full
// mbarrier (the producers' copies landed) and an empty one (every consumer
// warp's products that read it retired); a stage's n-th use is phase n.
template <int STAGES>
struct PfRing {
    unsigned char* tiles;   // STAGES tiles of PF_T_BYTES
    u32 full, empty;        // STAGES mbarriers each
    __device__ __forceinline__ void init() const {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, PF_PRODUCERS);         // every producer thread, as its copies land
            mbar_init(empty + 8 * s, PF_CONSUMERS / 32);   // every consumer warp
        }
    }
    __device__ __forceinline__ unsigned char* tile(int t) const { return tiles + (t % STAGES) * PF_T_BYTES; }
    // Producer: waits until tile t's stage is free (tile t - STAGES released).
    __device__ __forceinline__ void acquire(int t) const {
        if (t >= STAGES) mbar_wait(empty + 8 * (t % STAGES), (u32)((t / STAGES - 1) & 1));
    }
    // Producer: this thread's copies of tile t arrive on its full barrier as they land.
    __device__ __forceinline__ void commit(int t) const { mbar_arrive_cp_async(full + 8 * (t % STAGES)); }
    // Consumer: waits until tile t has landed.
    __device__ __forceinline__ void wait(int t) const { mbar_wait(full + 8 * (t % STAGES), (u32)((t / STAGES) & 1)); }
    // Consumer warp: done with tile t (its products retired).
    __device__ __forceinline__ void release(int t, int lane) const {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + 8 * (t % STAGES));
    }
};

extern "C" __global__ void __launch_bounds__(PF_THREADS, 1)
attn_prefill(const __grid_constant__ AttnPrefillParams p) {
    extern __shared__ __align__(16) unsigned char fa_raw[];
    unsigned char* fa_smem = fa_raw + ((1024u - (smem_u32(fa_raw) & 1023u)) & 1023u);
    unsigned char* sQ = fa_smem;
    unsigned char* sK = sQ + PF_Q_BYTES;                  // PF_K_STAGES stages
    unsigned char* sV = sK + PF_K_STAGES * PF_T_BYTES;    // PF_V_STAGES stages
    // full K, full V, empty K, empty V (8 bytes each).
    const u32 bars = smem_u32(sV + PF_V_STAGES * PF_T_BYTES);
    const PfRing<PF_K_STAGES> kring{sK, bars, bars + 8 * (PF_K_STAGES + PF_V_STAGES)};
    const PfRing<PF_V_STAGES> vring{sV, bars + 8 * PF_K_STAGES, bars + 8 * (2 * PF_K_STAGES + PF_V_STAGES)};
    // The piece of this block (the last whose first tile is at most blockIdx.x).
    int pi = 0;
#pragma unroll
    for (int i = 1; i < ATT_PF_MAX_PIECES; ++i)
        if (i < p.npieces && (int)blockIdx.x >= p.piece[i].tile0) pi = i;
    const PfPiece& pc = p.piece[pi];
    const int T = pc.t, P0 = pc.p0;
    const int* block_table = pc.block_table;
    const int ntile = (T + PF_BQ - 1) / PF_BQ;
    const int qt = ntile - 1 - ((int)blockIdx.x - pc.tile0);   // longest tiles first
    const int kvh = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int q0 = qt * PF_BQ;
    const int qlast = min(q0 + PF_BQ, T) - 1;
    const int nkeys = P0 + qlast + 1;             // keys any query of this CTA sees
    const int kb_last = (nkeys - 1) / KV_BLOCK;
    const int kb_diag = (P0 + q0) / KV_BLOCK;     // tiles before it are below every query: no mask

    if (tid == 0) {
        kring.init();
        vring.init();
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp >= PF_CONSUMERS / 32) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PF_REGS_PRODUCER));
        // The producers: warp pw copies rows PF_PROWS pw .. of every tile,
        // lane l chunk l % PF_CPR of rows l / PF_CPR + PF_RSTEP j. The rows'
        // swizzle phases are the same for every tile, so each copy is a
        // fixed offset from the lane's first.
        const int rl = lane / PF_CPR, pc = lane % PF_CPR;
        const int pr0 = (warp - PF_CONSUMERS / 32) * PF_PROWS + rl;   // PF_PROWS % 8 == 0: the phase of row pr0 + r is (rl + r) & 7
        const u32 dst0 = (u32)pf_chunk_off(PF_BN, pr0, pc);
        const int src0 = pr0 * HD + pc * 8;
        auto copy_tile = [&](unsigned char* dst, const f16* cache, int phys, int t) {
            const f16* base = cache + ((size_t)phys * A_KV_HEADS + kvh) * KV_BLOCK * HD + src0;
            const int valid = nkeys - t * PF_BN - pr0;   // copy j's row exists when PF_RSTEP j < valid
#pragma unroll
            for (int j = 0; j < PF_PROWS / PF_RSTEP; ++j) {
                const int r = PF_RSTEP * j;
                const bool ok = r < valid;
                const u32 off = (u32)(r * 128) + ((u32)((pc & 7) ^ ((rl + r) & 7)) << 4) - ((u32)((pc & 7) ^ rl) << 4);
                cp_async16(dst + dst0 + off, base + (ok ? r * HD : 0), ok ? 16 : 0);
            }
        };
        for (int t = 0; t <= kb_last; ++t) {
            const int phys = block_table[t];
            kring.acquire(t);
            copy_tile(kring.tile(t), p.kcache, phys, t);
            kring.commit(t);
            vring.acquire(t);
            copy_tile(vring.tile(t), p.vcache, phys, t);
            vring.commit(t);
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(PF_REGS_CONSUMER));
    const int wg = warp >> 2, wtid = tid & 127;
    const int h = kvh * AG + warp;
    const f16* qsrc = p.q + (size_t)pc.row0 * A_HEADS * HD;
    const float* proj = p.proj + (size_t)pc.row0 * p.proj_stride;
    const size_t mix_row0 = (size_t)pc.row0 * A_HEADS * HD;
    // Q: row hh * 16 + r = token q0 + r of head kvh * 8 + hh (rows past T
    // are zeros); each warpgroup copies its own 64 rows, the only ones its
    // products read.
    for (int i = wtid; i < 64 * (HD / 8); i += 128) {
        const int row = wg * 64 + i / (HD / 8), c = i % (HD / 8);
        const int hh = row / PF_BQ, r = row - hh * PF_BQ;
        const int tok = q0 + r;
        const f16* src = qsrc + ((size_t)min(tok, T - 1) * A_HEADS + kvh * AG + hh) * HD + c * 8;
        cp_async16(sQ + pf_chunk_off(PF_ROWS, row, c), src, tok < T ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    named_barrier(PF_BAR_Q + wg, 128);

    float o[PF_OF * 4];
#pragma unroll
    for (int i = 0; i < PF_OF * 4; ++i) o[i] = 0.f;
    // Raw-score maxima (the scale is applied inside exp2) and sums of rows
    // g and g + 8; finite after tile 0, whose key 0 every query sees.
    float m_r[2] = {NEG_INF, NEG_INF}, l_r[2] = {0.f, 0.f};
    const int g = lane >> 2, c4 = lane & 3;
    const int qpos0 = P0 + q0 + g;   // position of this thread's first row; second is +8
    const float sl2 = p.scale_log2;
    const u32 q_base = smem_u32(sQ) + wg * 64 * 128;   // this warpgroup's 64 rows in each atom

    // Turns at the tensor cores: warpgroup 0 starts; each warpgroup lets the
    // other go once its products are issued. Warpgroup 1 skips its last
    // pass, so that both barriers end with every arrival consumed.
    auto turn_begin = [&](bool first) {
        if (!(wg == 0 && first)) named_barrier(PF_BAR_TURN + wg, 2 * 128);
    };
    auto turn_end = [&](bool last) {
        if (!(wg == 1 && last)) named_barrier_arrive(PF_BAR_TURN + (1 - wg), 2 * 128);
    };
    float s[PF_NF * 4];
    // S = Q K(kb)^T, issued (not waited). Each k16 step's descriptors are
    // the tile's first advanced by the step's offset (wg_desc_advance: ~7
    // instructions a step where building each took ~13, ~200 a warp a KV
    // tile).
    const unsigned long long q_desc = wg_desc_sw128(q_base);
    auto issue_s = [&](int kb) {
        const unsigned long long k_desc = wg_desc_sw128(smem_u32(kring.tile(kb)));
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) {
            const u32 off = (u32)((ks & 3) * 32);   // a k16 step within the 128-byte atom row
            const unsigned long long da = wg_desc_advance(q_desc, (ks >> 2) * (PF_ROWS * 128) + off);
            const unsigned long long db = wg_desc_advance(k_desc, (ks >> 2) * (PF_BN * 128) + off);
            wgmma_ss_m64n64(s, da, db, ks > 0);
        }
        wgmma_commit();
    };
    // Retires every product in flight (S, and the PV before it).
    auto retire = [&]() {
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < PF_NF * 4; ++i) wg_reg_fence(s[i]);
#pragma unroll
        for (int i = 0; i < PF_OF * 4; ++i) wg_reg_fence(o[i]);
    };
    u32 pa[PF_NF][2];
    // The causal mask and the online softmax of tile kb's scores: P (fp16,
    // the A operand of its PV) in pa; O rescaled.
    auto softmax = [&](int kb) {
        if (kb >= kb_diag) {   // uniform over the CTA
#pragma unroll
            for (int nf = 0; nf < PF_NF; ++nf) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int kpos = kb * KV_BLOCK + nf * 8 + 2 * c4 + (e & 1);
                    const int qpos = qpos0 + (e >> 1) * 8;
                    if (kpos > qpos) s[4 * nf + e] = NEG_INF;
                }
            }
        }
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nf = 0; nf < PF_NF; ++nf) {
            mx[0] = fmaxf(mx[0], fmaxf(s[4 * nf], s[4 * nf + 1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[4 * nf + 2], s[4 * nf + 3]));
        }
        float alpha[2], msc[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
            const float m_new = fmaxf(m_r[r], mx[r]);
            alpha[r] = exp2_ftz((m_r[r] - m_new) * sl2);   // 0 on tile 0
            m_r[r] = m_new;
            msc[r] = m_new * sl2;
        }
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int nf = 0; nf < PF_NF; ++nf) {
            float e[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                e[k] = exp2_ftz(fmaf(s[4 * nf + k], sl2, -msc[k >> 1]));   // masked: exp2(-inf) = 0
                rs[k >> 1] += e[k];
            }
            // e in [0, 1]: no clamps needed (the same bits as pack_f16x2).
            pa[nf][0] = pack_f16x2_sat(e[0], e[1]);
            pa[nf][1] = pack_f16x2_sat(e[2], e[3]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            rs[r] += __shfl_xor_sync(FULL_MASK, rs[r], 1);
            rs[r] += __shfl_xor_sync(FULL_MASK, rs[r], 2);
            l_r[r] = l_r[r] * alpha[r] + rs[r];
        }
        // 2 x HD / 4 multiplies a tile; once the running maxima settle
        // (alpha == 1 exactly) the warp skips them.
        if (__any_sync(FULL_MASK, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int i = 0; i < PF_OF; ++i) {
                o[4 * i] *= alpha[0];
                o[4 * i + 1] *= alpha[0];
                o[4 * i + 2] *= alpha[1];
                o[4 * i + 3] *= alpha[1];
            }
        }
    };

    // Tile 0: S alone.
    kring.wait(0);
    fence_proxy_async();   // orders what the barrier made visible before this thread's products read it
    turn_begin(true);
    issue_s(0);
    turn_end(false);
    retire();
    kring.release(0, lane);
    softmax(0);
    for (int kb = 0; kb <= kb_last; ++kb) {
        // O += P V(kb) and S(kb + 1) in one turn, retired together.
        const bool next = kb < kb_last;
        vring.wait(kb);
        if (next) kring.wait(kb + 1);
        fence_proxy_async();
        turn_begin(false);
        const u32 v_base = smem_u32(vring.tile(kb));
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < PF_BN / 16; ++ks) {
            const u32 a[4] = {pa[2 * ks][0], pa[2 * ks][1], pa[2 * ks + 1][0], pa[2 * ks + 1][1]};
            // Keys 16 ks .. 16 ks + 15: two groups of 8 rows of 128 bytes.
            wgmma_pv<HD>(o, a, wg_desc_sw128_mn(v_base + ks * 16 * 128, PF_BN * 128));
        }
        wgmma_commit();
        if (next) issue_s(kb + 1);
        turn_end(!next);
        retire();
        vring.release(kb, lane);
        if (!next) break;
        kring.release(kb + 1, lane);
        softmax(kb + 1);
    }

    // normalise, gate, store
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = q0 + g + 8 * r;
        if (row >= T) continue;
        const float inv = 1.f / l_r[r];
        const float* gate = proj + (size_t)row * p.proj_stride + h * 2 * HD + HD;
        const size_t ob = mix_row0 + (size_t)row * A_HEADS * HD + h * HD;
#pragma unroll
        for (int df = 0; df < PF_OF; ++df) {
            const int d = df * 8 + 2 * c4;
            const float y0 = o[4 * df + 2 * r] * inv * sigmoidf_(gate[d]);
            const float y1 = o[4 * df + 2 * r + 1] * inv * sigmoidf_(gate[d + 1]);
            if (p.mix_f32 != nullptr) {
                p.mix_f32[ob + d] = y0;
                p.mix_f32[ob + d + 1] = y1;
            }
            if (p.mix_f16 != nullptr) *reinterpret_cast<u32*>(p.mix_f16 + ob + d) = pack_f16x2(y0, y1);
        }
    }
}
