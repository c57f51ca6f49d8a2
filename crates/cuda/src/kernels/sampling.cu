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
// smaller c). Used when the logits come from the GEMM path (greedy batch
// decode) rather than the fused GEMV. grid (ceil(cols / ARGMAX_CHUNK),
// rows), block ARGMAX_THREADS: block (x, r) reduces columns
// [x ARGMAX_CHUNK, (x + 1) ARGMAX_CHUNK) of row r and merges its key by
// atomicMax into keys[r], which the launcher clears first (the maximum of
// the blocks' keys, so the order they land in does not matter). A thread
// holds ARGMAX_CHUNK / ARGMAX_THREADS / 4 16-byte loads in flight: one block
// a row walking 248,320 logits one load at a time took ~390 us at 64 rows,
// a DRAM round trip an iteration.
#if !defined(ARGMAX_CHUNK) || !defined(ARGMAX_THREADS) || ARGMAX_CHUNK % (4 * ARGMAX_THREADS) != 0
#error "ARGMAX_CHUNK (a multiple of 4 ARGMAX_THREADS) and ARGMAX_THREADS come from sampling.rs"
#endif
#define ARGMAX_LOADS (ARGMAX_CHUNK / (4 * ARGMAX_THREADS))
struct ArgmaxRowsParams {
    const float* logits;   // [rows][cols]
    u64* keys;             // [rows], zero on entry
    int cols;
};

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_rows(const __grid_constant__ ArgmaxRowsParams p) {
    __shared__ u64 red[ARGMAX_THREADS / 32];
    const int cols = p.cols;
    const float* row = p.logits + (size_t)blockIdx.y * cols;
    const int c0 = blockIdx.x * ARGMAX_CHUNK;
    const int c1 = min(cols, c0 + ARGMAX_CHUNK);
    u64 best = 0ull;
    if ((cols & 3) == 0 && (reinterpret_cast<size_t>(p.logits) & 15) == 0) {
        // Whole 16-byte groups (the real vocabulary): all loads first.
        float4 v[ARGMAX_LOADS];
#pragma unroll
        for (int i = 0; i < ARGMAX_LOADS; ++i) {
            const int c = c0 + 4 * (threadIdx.x + i * ARGMAX_THREADS);
            v[i] = c < c1 ? *reinterpret_cast<const float4*>(row + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < ARGMAX_LOADS; ++i) {
            const int c = c0 + 4 * (threadIdx.x + i * ARGMAX_THREADS);
            if (c < c1) {
                const u64 k0 = argmax_key(v[i].x, (u32)c), k1 = argmax_key(v[i].y, (u32)c + 1);
                const u64 k2 = argmax_key(v[i].z, (u32)c + 2), k3 = argmax_key(v[i].w, (u32)c + 3);
                best = max(best, max(max(k0, k1), max(k2, k3)));
            }
        }
    } else {
        for (int c = c0 + threadIdx.x; c < c1; c += ARGMAX_THREADS) best = max(best, argmax_key(row[c], (u32)c));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(FULL_MASK, best, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 b = 0ull;
#pragma unroll
        for (int w = 0; w < ARGMAX_THREADS / 32; ++w) b = max(b, red[w]);
        atomicMax(reinterpret_cast<unsigned long long*>(p.keys + blockIdx.y), (unsigned long long)b);
    }
}

// ---- sample_rows: penalties, temperature, top-k / top-p / min-p, one draw ----
//
// One block of SAMPLE_THREADS threads (512 = 16 warps; 1024 would cap registers at 64 and spill) per row of logits; the row (248,320
// floats at the real shape) is re-read from global memory (L2) in every
// pass rather than staged, and each pass recomputes the penalised logit and
// the weight of a token with the same expression, so every pass sees the
// same values. Semantics are the engine's host sampler
// (crates/engine/src/sampling.rs):
//   the row is cut to its first V = vocab_limit entries (0 or more than the
//   row: the whole row); no pass looks beyond, so ids >= V are never drawn
//   nor reported;
//   l_i  = logit, then repetition penalty for tokens seen (prompt or output),
//          then l_i -= presence + frequency * generated_count_i;
//   logprob = l_tok - M - ln sum exp(l - M)   (penalised, before temperature);
//   top logprobs: the N = top_logprobs (<= SAMPLE_TOP_MAX) largest l by the
//          argmax key (l descending, then id ascending; NaN ranks as -inf),
//          each reported with the logprob expression above;
//   T == 0 (or no finite logit): argmax of l (ties: lowest id);
//   else w_i = exp((l_i - M) / T) in [0, 1] (the top token has 1);
//   candidates C = { w_i > 0, w_i >= min_p, among the top_k by (w desc, id asc) };
//   top-p keeps the shortest prefix of C in (w desc, id asc) order whose mass
//   reaches top_p * mass(C); one draw by inverse CDF in id order with a
//   uniform from Philox4x32-10 keyed by the sequence's seed, counter = step.
//
// Selection is exact (no bisection tolerance): w >= 0, so its float bits
// order like the values; a 4-pass radix select (8 bits a pass, 256-bin
// shared histograms of counts or of f64 mass) finds the boundary weight,
// and ties at the boundary are split by id with one scan in id order. The
// only inexactness is f64 summation order against the host's sorted sum.
// The top logprobs ride on the max pass (no extra pass over the row): each
// warp keeps its N largest keys, one per lane, and the block ranks the
// warps' lists (top_pass).
//
// Count table (optional, per row): u32 [vocab], bit 31 = seen in the
// prompt, bits 0..30 = times generated. The kernel adds 1 for the chosen
// token, so consecutive steps need no host update.
//
// Outputs: out_tokens [n], out_logprobs [n]; when out_top_ids is not null,
// rows with N > 0 write slots 0..N-1 of out_top_ids / out_top_logprobs
// [n][SAMPLE_TOP_MAX], most likely first; a slot beyond the row's V ids
// (N > V) holds id 0xffffffff and -inf. Slots N.. and rows with N = 0 are
// not written. With keep_last set, keep_last[keep_slots[r]] = the token too
// (a pipelined step's draws become its sequences' last draws in the same
// launch).
//
// The two structs below are mirrored by #[repr(C)] structs in sampling.rs,
// which passes its size and field offsets as defines (sampling::defines());
// the static_asserts make a drifted layout a compile error.

#ifndef SAMPLE_THREADS
#error "SAMPLE_THREADS must be defined by the host (sampling.rs)"
#endif
#ifndef SAMPLE_TOP_MAX
#error "SAMPLE_TOP_MAX must be defined by the host (sampling.rs)"
#endif
static_assert(SAMPLE_THREADS % 32 == 0 && SAMPLE_THREADS >= 64 && SAMPLE_THREADS <= 1024, "SAMPLE_THREADS: whole warps, 64..1024");
// A warp's top list holds one key per lane.
static_assert(SAMPLE_TOP_MAX >= 1 && SAMPLE_TOP_MAX <= 32, "SAMPLE_TOP_MAX: 1..32");

// NVRTC has no offsetof (no headers, no __builtin_offsetof); __INTADDR__ is
// the constant-address builtin of its EDG front end, the one its own
// offsetof is made of.
#define MIRRORED(S, f, AT) \
    static_assert((unsigned long long)__INTADDR__(&((S*)0)->f) == AT, "sampling.rs lays out " #S "." #f " elsewhere")

struct SampleRow {
    float temperature;
    float top_p;
    float min_p;
    float presence;
    float frequency;
    float repetition;
    u32 top_k;          // 0 = off
    u32 top_logprobs;   // 0 = none; more than SAMPLE_TOP_MAX reads as SAMPLE_TOP_MAX
    u32 vocab_limit;    // 0 = the whole row
    u32 pad;
    u64 seed;
    u64 step;
    u32* counts;        // [vocab] or null (no penalties)
};
static_assert(sizeof(SampleRow) == SAMPLE_ROW_BYTES, "sampling.rs's SampleRow has another size");
MIRRORED(SampleRow, temperature, SAMPLE_ROW_AT_TEMPERATURE);
MIRRORED(SampleRow, top_p, SAMPLE_ROW_AT_TOP_P);
MIRRORED(SampleRow, min_p, SAMPLE_ROW_AT_MIN_P);
MIRRORED(SampleRow, presence, SAMPLE_ROW_AT_PRESENCE);
MIRRORED(SampleRow, frequency, SAMPLE_ROW_AT_FREQUENCY);
MIRRORED(SampleRow, repetition, SAMPLE_ROW_AT_REPETITION);
MIRRORED(SampleRow, top_k, SAMPLE_ROW_AT_TOP_K);
MIRRORED(SampleRow, top_logprobs, SAMPLE_ROW_AT_TOP_LOGPROBS);
MIRRORED(SampleRow, vocab_limit, SAMPLE_ROW_AT_VOCAB_LIMIT);
MIRRORED(SampleRow, pad, SAMPLE_ROW_AT_PAD);
MIRRORED(SampleRow, seed, SAMPLE_ROW_AT_SEED);
MIRRORED(SampleRow, step, SAMPLE_ROW_AT_STEP);
MIRRORED(SampleRow, counts, SAMPLE_ROW_AT_COUNTS);

struct SampleParams {
    const float* logits;     // row r at logits + r * row_stride
    const SampleRow* rows;   // [n]
    u32* out_tokens;         // [n]
    float* out_logprobs;     // [n]
    u32* out_top_ids;        // [n][SAMPLE_TOP_MAX] or null (no row reports)
    float* out_top_logprobs; // [n][SAMPLE_TOP_MAX] (null with out_top_ids)
    int vocab;               // floats in a row
    int row_stride;          // floats between rows (vocab; 0 = one shared row)
    const int* keep_slots;   // [n]: each row's state slot, or null
    u32* keep_last;          // [slots]: last[keep_slots[r]] = token (null: not kept)
};
static_assert(sizeof(SampleParams) == SAMPLE_PARAMS_BYTES, "sampling.rs's SampleRowsParams has another size");
MIRRORED(SampleParams, logits, SAMPLE_PARAMS_AT_LOGITS);
MIRRORED(SampleParams, rows, SAMPLE_PARAMS_AT_ROWS);
MIRRORED(SampleParams, out_tokens, SAMPLE_PARAMS_AT_OUT_TOKENS);
MIRRORED(SampleParams, out_logprobs, SAMPLE_PARAMS_AT_OUT_LOGPROBS);
MIRRORED(SampleParams, out_top_ids, SAMPLE_PARAMS_AT_OUT_TOP_IDS);
MIRRORED(SampleParams, out_top_logprobs, SAMPLE_PARAMS_AT_OUT_TOP_LOGPROBS);
MIRRORED(SampleParams, vocab, SAMPLE_PARAMS_AT_VOCAB);
MIRRORED(SampleParams, row_stride, SAMPLE_PARAMS_AT_ROW_STRIDE);
MIRRORED(SampleParams, keep_slots, SAMPLE_PARAMS_AT_KEEP_SLOTS);
MIRRORED(SampleParams, keep_last, SAMPLE_PARAMS_AT_KEEP_LAST);

// Row r's drawn token: its output, and, when the launch keeps draws, its
// sequence's last draw (the table `feed_stage` reads for Feed::Previous;
// rows of one launch are distinct sequences, so no two touch one entry).
__device__ __forceinline__ void emit_token(const SampleParams& p, int r, int token) {
    p.out_tokens[r] = (u32)token;
    if (p.keep_last != nullptr) p.keep_last[p.keep_slots[r]] = (u32)token;
}

#define SAMPLE_WARPS (SAMPLE_THREADS / 32)

__device__ __forceinline__ void philox_round(u32& c0, u32& c1, u32& c2, u32& c3, u32 k0, u32 k1) {
    const u32 m0 = 0xD2511F53u, m1 = 0xCD9E8D57u;
    const u32 hi0 = __umulhi(m0, c0), lo0 = m0 * c0;
    const u32 hi1 = __umulhi(m1, c2), lo1 = m1 * c2;
    const u32 n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
}

// Uniform in [0, 1) with 53 random bits: Philox4x32-10(key = seed,
// counter = (step, 0)).
__device__ double philox_uniform(u64 seed, u64 step) {
    u32 c0 = (u32)step, c1 = (u32)(step >> 32), c2 = 0u, c3 = 0u;
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        philox_round(c0, c1, c2, c3, k0, k1);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    const u64 bits = (((u64)c0 << 32) | (u64)c1) >> 11;
    return (double)bits * (1.0 / 9007199254740992.0);
}

__device__ __forceinline__ float penalised(const float* row, const SampleRow& sp, int i) {
    float l = row[i];
    if (sp.counts != nullptr) {
        const u32 c = sp.counts[i];
        const u32 gen = c & 0x7fffffffu;
        if (sp.repetition != 1.0f && c != 0u) l = l > 0.0f ? l / sp.repetition : l * sp.repetition;
        // Explicit roundings: no FMA contraction, the same value in every pass
        // and as the host computes it.
        if (gen != 0u && (sp.presence != 0.0f || sp.frequency != 0.0f))
            l = __fsub_rn(l, __fadd_rn(sp.presence, __fmul_rn(sp.frequency, (float)gen)));
    }
    return l;
}

// The order of the max pass and of the top logprobs: the penalised logit
// (NaN as -inf, so it never wins), then the smaller id. Never 0: the key of
// -inf has the high word 0x007fffff, so 0 marks an empty slot.
__device__ __forceinline__ u64 logit_key(float l, int i) {
    if (l != l) l = NEG_INF;
    return argmax_key(l, (u32)i);
}

// The logit of an argmax key (inverse of argmax_key's order-preserving map).
__device__ __forceinline__ float key_logit(u64 key) {
    const u32 u = (u32)(key >> 32);
    return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

__device__ __forceinline__ float weight_of(float l, float m, float inv_t) {
    const float e = expf((l - m) * inv_t);
    return e == e ? e : 0.0f;
}

// Composite order key: weight bits high, then the smaller id.
__device__ __forceinline__ u64 order_key(float w, int i) {
    return ((u64)__float_as_uint(w) << 32) | (u64)(0xffffffffu - (u32)i);
}

template <typename T>
__device__ T block_sum(T v, T* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    T s = (T)0;
    // Fixed order: the same on every thread. `red` holds SAMPLE_WARPS
    // entries, enough for every block size of this file.
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += red[w];
    return s;
}

__device__ u64 block_max_u64(u64 v, u64* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 x = __shfl_xor_sync(FULL_MASK, v, o);
        v = x > v ? x : v;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 b = 0ull;
    for (int w = 0; w < SAMPLE_WARPS; ++w) b = red[w] > b ? red[w] : b;
    return b;
}

struct SampleSmem {
    u32 hist[256];
    double mass[256];
    double red_d[SAMPLE_WARPS];
    u64 red_u[SAMPLE_WARPS];
    u32 sel_bin;
    double sel_above;      // mass (or count) strictly above the chosen bin
    int tie_id;
    int pick;      // the warp whose id range holds the draw
    int token;     // the drawn token (-1: none)
    u64 warp_top[SAMPLE_WARPS * SAMPLE_TOP_MAX];   // each warp's list, 0 = empty
    u64 top[SAMPLE_TOP_MAX];                       // the block's, most likely first
};

// Token membership in the candidate set: eligible (w > 0, w >= min_p) and
// at or above the top-k cut (composite key >= kcut).
__device__ __forceinline__ bool in_cand(float w, int i, float min_p, u64 kcut) {
    return w > 0.0f && w >= min_p && order_key(w, i) >= kcut;
}

// Radix select over the weight bits of the tokens with in_cand (cut
// `kcut`). by_mass = false: the bits of the `need`-th largest weight;
// by_mass = true: the bits of the weight at which the mass counted from the
// top first reaches `target`. Returns the bits; *above = count (or mass) of
// candidates strictly above them; *reached = false when the target mass is
// never reached (rounding), in which case nothing should be cut.
__device__ u32 radix_select(const float* row, const SampleRow& sp, int vocab, float m, float inv_t, u64 kcut,
                            bool by_mass, double need, double* above, bool* reached, SampleSmem& sm) {
    u32 prefix = 0u, mask = 0u;
    double acc = 0.0;
    bool ok = true;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) { sm.hist[b] = 0u; sm.mass[b] = 0.0; }
        __syncthreads();
        // Warp-aggregated updates: most tokens share a few bins (the
        // exponent byte), so one atomic per distinct bin per warp instead of
        // one per token. Every lane runs every iteration (uniform bound) for
        // the *_sync intrinsics.
        const int lane = threadIdx.x & 31;
        for (int base = 0; base < vocab; base += blockDim.x) {
            const int i = base + threadIdx.x;
            int key = -1;
            float w = 0.0f;
            if (i < vocab) {
                w = weight_of(penalised(row, sp, i), m, inv_t);
                const u32 bits = __float_as_uint(w);
                if (in_cand(w, i, sp.min_p, kcut) && (bits & mask) == prefix) key = (int)((bits >> shift) & 0xffu);
            }
            if (by_mass) {
                u32 todo = __ballot_sync(FULL_MASK, key >= 0);
                while (todo != 0u) {
                    const int leader = __ffs(todo) - 1;
                    const int k = __shfl_sync(FULL_MASK, key, leader);
                    const bool mine = key == k;
                    double v = mine ? (double)w : 0.0;
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
                    if (lane == leader) atomicAdd(&sm.mass[k], v);
                    todo &= ~__ballot_sync(FULL_MASK, mine);
                }
            } else {
                const u32 peers = __match_any_sync(FULL_MASK, key);
                if (key >= 0 && lane == __ffs(peers) - 1) atomicAdd(&sm.hist[key], (u32)__popc(peers));
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int chosen = -1;
            double a = acc;
            for (int b = 255; b >= 0; --b) {
                const double v = by_mass ? sm.mass[b] : (double)sm.hist[b];
                if (v > 0.0 && a + v >= need) { chosen = b; break; }
                a += v;
            }
            if (chosen < 0) {
                // Rounding left the target unreached: keep everything.
                sm.sel_bin = 0xffffffffu;
            } else {
                sm.sel_bin = (u32)chosen;
                sm.sel_above = a;
            }
        }
        __syncthreads();
        if (sm.sel_bin == 0xffffffffu) { ok = false; break; }
        prefix |= sm.sel_bin << shift;
        mask |= 0xffu << shift;
        acc = sm.sel_above;
        __syncthreads();
    }
    *above = acc;
    *reached = ok;
    return prefix;
}

// The id of the `rank`-th (1-based) candidate, in id order, whose weight bits
// equal `bits`: one pass in tiles of blockDim ids.
__device__ int tie_id(const float* row, const SampleRow& sp, int vocab, float m, float inv_t, u64 kcut, u32 bits,
                      u32 rank, SampleSmem& sm) {
    u32 seen = 0u;
    if (threadIdx.x == 0) sm.tie_id = vocab - 1;
    __syncthreads();
    for (int base = 0; base < vocab; base += blockDim.x) {
        const int i = base + threadIdx.x;
        bool tie = false;
        if (i < vocab) {
            const float w = weight_of(penalised(row, sp, i), m, inv_t);
            tie = in_cand(w, i, sp.min_p, kcut) && __float_as_uint(w) == bits;
        }
        const u32 in_tile = (u32)__syncthreads_count(tie);
        if (seen + in_tile >= rank) {
            // Exclusive rank of each tie inside the tile: warp ballots, then
            // the warps before this one.
            const u32 ballot = __ballot_sync(FULL_MASK, tie);
            if ((threadIdx.x & 31) == 0) sm.hist[threadIdx.x >> 5] = __popc(ballot);
            __syncthreads();
            u32 before = seen;
            for (int w = 0; w < (int)(threadIdx.x >> 5); ++w) before += sm.hist[w];
            before += __popc(ballot & ((1u << (threadIdx.x & 31)) - 1u));
            if (tie && before + 1u == rank) sm.tie_id = i;
            __syncthreads();
            break;
        }
        seen += in_tile;
    }
    __syncthreads();
    return sm.tie_id;
}

// A warp's sorted top list: lane j holds its j-th largest key (lanes >=
// ntop stay 0). A tile of 32 keys (one per lane, 0 = none) is compared with
// the list's last entry; each lane that beats it is inserted in turn: lane j
// takes max(list[j], min(list[j-1], k)) (lane 0: max(list[0], k)), which
// shifts the entries below k down by one, and is a no-op for a k that an
// earlier insertion of the tile pushed below the list. Keys are distinct
// (distinct ids), so no tie is lost. Every lane of the warp must call it
// (the *_sync intrinsics).
__device__ __forceinline__ void warp_list_insert(u64& list, u64 key, int ntop) {
    const int lane = threadIdx.x & 31;
    const u64 last = __shfl_sync(FULL_MASK, list, ntop - 1);
    u32 todo = __ballot_sync(FULL_MASK, key > last);
    while (todo != 0u) {
        const int src = __ffs(todo) - 1;
        todo &= todo - 1u;
        const u64 k = __shfl_sync(FULL_MASK, key, src);
        const u64 up = __shfl_up_sync(FULL_MASK, list, 1);
        const u64 c = lane == 0 ? k : (up < k ? up : k);
        if (lane < ntop && c > list) list = c;
    }
}

// Merges nlists sorted warp lists (lists[b * len ..][0..len), largest
// first, 0 = empty; distinct keys): top[rank] = k for each key whose rank
// (the number of larger keys, a binary search per list) is below ntop: the
// ntop largest, largest first. Slots past the non-zero keys keep what the
// caller put there (0). The caller syncs before (lists written) and after
// (top read).
__device__ void rank_merge(const u64* lists, int nlists, int len, int ntop, u64* top) {
    for (int j = threadIdx.x; j < nlists * len; j += blockDim.x) {
        const u64 k = lists[j];
        if (k == 0ull || j % len >= ntop) continue;   // its own list already ranks it too low
        int rank = 0;
        for (int b = 0; b < nlists && rank < ntop; ++b) {
            const u64* l = lists + b * len;
            int lo = 0, hi = len;
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (l[mid] > k) lo = mid + 1; else hi = mid;
            }
            rank += lo;
        }
        if (rank < ntop) top[rank] = k;
    }
}

// The max pass when the row reports ntop (1..SAMPLE_TOP_MAX) top logprobs:
// sm.top[0..ntop) = the ntop largest logit_keys of ids < vocab, largest
// first (0 where the row has fewer); returns sm.top[0], the argmax key.
// Each warp keeps a list (warp_list_insert) over tiles of 32 ids, then the
// SAMPLE_WARPS lists are ranked (rank_merge). The tile bound is uniform so
// every lane runs the *_sync intrinsics.
__device__ u64 top_pass(const float* row, const SampleRow& sp, int vocab, int ntop, SampleSmem& sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int j = threadIdx.x; j < SAMPLE_TOP_MAX; j += blockDim.x) sm.top[j] = 0ull;
    u64 list = 0ull;
    for (int base = 0; base < vocab; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const u64 key = i < vocab ? logit_key(penalised(row, sp, i), i) : 0ull;
        warp_list_insert(list, key, ntop);
    }
    if (lane < SAMPLE_TOP_MAX) sm.warp_top[warp * SAMPLE_TOP_MAX + lane] = list;
    __syncthreads();
    rank_merge(sm.warp_top, SAMPLE_WARPS, SAMPLE_TOP_MAX, ntop, sm.top);
    __syncthreads();
    return sm.top[0];
}

// The ids a row looks at: vocab_limit, or the whole row when it is 0 or
// larger than the row.
__device__ __forceinline__ int row_vocab(const SampleRow& sp, int vocab) {
    return sp.vocab_limit == 0u || sp.vocab_limit > (u32)vocab ? vocab : (int)sp.vocab_limit;
}

// The whole sampler for row r of the launch by one block of SAMPLE_THREADS
// threads (the kernel sample_rows, and the fallback of sample_fast_finish).
__device__ void sample_row_slow(const SampleParams& p, int r, SampleSmem& sm) {
    const float* row = p.logits + (size_t)r * (size_t)p.row_stride;
    const SampleRow sp = p.rows[r];
    // Every pass below runs over ids < vocab only: this is the whole of
    // vocab_limit.
    const int vocab = row_vocab(sp, p.vocab);
    const int ntop = (int)min(sp.top_logprobs, (u32)SAMPLE_TOP_MAX);

    // Pass 1: max (and argmax) of the penalised logits; NaN never wins.
    u64 best = 0ull;
    if (ntop > 0) {
        best = top_pass(row, sp, vocab, ntop, sm);
    } else {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const u64 k = logit_key(penalised(row, sp, i), i);
            best = k > best ? k : best;
        }
        best = block_max_u64(best, sm.red_u);
    }
    const int amax = (int)argmax_key_index(best);
    const float m = penalised(row, sp, amax);

    // Pass 2: log-sum-exp (logprob, before temperature) and the candidate
    // count and mass before any cut.
    const bool sampling = sp.temperature > 0.0f && fabsf(m) <= 3.402823466e38f;
    const float inv_t = sampling ? 1.0f / sp.temperature : 1.0f;
    double se = 0.0;
    u32 nel = 0u;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float l = penalised(row, sp, i);
        se += (double)expf(l - m);
        if (sampling && in_cand(weight_of(l, m, inv_t), i, sp.min_p, 0ull)) ++nel;
    }
    se = block_sum<double>(se, sm.red_d);
    const u32 eligible = block_sum<u32>(nel, (u32*)sm.red_d);

    int token = amax;
    if (sampling && eligible > 0u) {
        // Top-k cut as a composite key (0 = no cut).
        u64 kcut = 0ull;
        if (sp.top_k > 0u && sp.top_k < eligible) {
            double above;
            bool reached;
            const u32 bits = radix_select(row, sp, vocab, m, inv_t, 0ull, false, (double)sp.top_k, &above, &reached, sm);
            if (reached) {
                const u32 rank = sp.top_k - (u32)above;
                const int id = tie_id(row, sp, vocab, m, inv_t, 0ull, bits, rank, sm);
                kcut = order_key(__uint_as_float(bits), id);
            }
        }
        // Top-p cut on what top-k and min-p kept.
        u64 pcut = kcut;
        if (sp.top_p < 1.0f) {
            double mass = 0.0;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float w = weight_of(penalised(row, sp, i), m, inv_t);
                if (in_cand(w, i, sp.min_p, kcut)) mass += (double)w;
            }
            mass = block_sum<double>(mass, sm.red_d);
            const double target = (double)sp.top_p * mass;
            double above;
            bool reached;
            const u32 bits = radix_select(row, sp, vocab, m, inv_t, kcut, true, target, &above, &reached, sm);
            if (reached) {
                const double w = (double)__uint_as_float(bits);
                double need = ceil((target - above) / w);
                if (!(need >= 1.0)) need = 1.0;
                // Clamp to the number of ties (tie_id returns the last id
                // when fewer exist, which keeps them all).
                const u32 rank = need > 4294967295.0 ? 0xffffffffu : (u32)need;
                const int id = tie_id(row, sp, vocab, m, inv_t, kcut, bits, rank, sm);
                const u64 cut = order_key(__uint_as_float(bits), id);
                pcut = cut > pcut ? cut : pcut;
            }
        }
        // The draw: per-warp masses over contiguous id ranges (coalesced),
        // then one warp scans the range that holds the target.
        const int span = (vocab + SAMPLE_WARPS - 1) / SAMPLE_WARPS;
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int lo = warp * span, hi = min(vocab, lo + span);
        double wm = 0.0;
        for (int i = lo + lane; i < hi; i += 32) {
            const float w = weight_of(penalised(row, sp, i), m, inv_t);
            if (in_cand(w, i, sp.min_p, pcut)) wm += (double)w;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) wm += __shfl_xor_sync(FULL_MASK, wm, o);
        __syncthreads();
        if (lane == 0) sm.red_d[warp] = wm;
        __syncthreads();
        if (threadIdx.x == 0) {
            double total = 0.0;
            for (int w = 0; w < SAMPLE_WARPS; ++w) total += sm.red_d[w];
            const double target = philox_uniform(sp.seed, sp.step) * total;
            int pick = -1, last = -1;
            double acc = 0.0;
            for (int w = 0; w < SAMPLE_WARPS; ++w) {
                if (sm.red_d[w] <= 0.0) continue;
                last = w;
                if (acc + sm.red_d[w] > target) { pick = w; break; }
                acc += sm.red_d[w];
            }
            if (pick < 0) {
                // Rounding left the target unreached: the last positive
                // token of the last non-empty range, as the host does.
                pick = last;
                sm.sel_above = __longlong_as_double(0x7ff0000000000000ll);
            } else {
                sm.sel_above = target - acc;   // target inside the picked range
            }
            sm.pick = pick;
            sm.token = -1;
        }
        __syncthreads();
        const int pick = sm.pick;
        if (pick >= 0 && warp == pick) {
            const double t = sm.sel_above;
            double acc = 0.0;
            int chosen = -1, last_pos = -1;
            for (int base = lo; base < hi && chosen < 0; base += 32) {
                const int i = base + lane;
                double w = 0.0;
                if (i < hi) {
                    const float wf = weight_of(penalised(row, sp, i), m, inv_t);
                    if (in_cand(wf, i, sp.min_p, pcut)) w = (double)wf;
                }
                double incl = w;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const double x = __shfl_up_sync(FULL_MASK, incl, o);
                    if (lane >= o) incl += x;
                }
                const u32 pos = __ballot_sync(FULL_MASK, w > 0.0);
                if (pos != 0u) last_pos = base + 31 - __clz(pos);
                const u32 hit = __ballot_sync(FULL_MASK, w > 0.0 && acc + incl > t);
                if (hit != 0u) chosen = base + __ffs(hit) - 1;
                acc += __shfl_sync(FULL_MASK, incl, 31);
            }
            if (lane == 0) sm.token = chosen >= 0 ? chosen : last_pos;
        }
        __syncthreads();
        if (pick >= 0 && sm.token >= 0) token = sm.token;
    }

    // The top logprobs come from the keys (not from the row), so the count
    // update below cannot change them.
    if (ntop > 0 && p.out_top_ids != nullptr) {
        const size_t at = (size_t)r * SAMPLE_TOP_MAX;
        for (int j = threadIdx.x; j < ntop; j += blockDim.x) {
            const u64 k = sm.top[j];
            p.out_top_ids[at + j] = k != 0ull ? argmax_key_index(k) : 0xffffffffu;
            p.out_top_logprobs[at + j] = k != 0ull ? (float)((double)key_logit(k) - (double)m - log(se)) : NEG_INF;
        }
    }
    if (threadIdx.x == 0) {
        const float lt = penalised(row, sp, token);
        emit_token(p, r, token);
        p.out_logprobs[r] = (float)((double)lt - (double)m - log(se));
        if (sp.counts != nullptr) sp.counts[token] += 1u;
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(const __grid_constant__ SampleParams p) {
    __shared__ SampleSmem sm;
    sample_row_slow(p, blockIdx.x, sm);
}


// ---- the fast path: sample_fast_chunks, then sample_fast_finish ----
//
// The same function as sample_rows for the common rows: greedy
// (temperature <= 0 or NaN) and top_k in 1..SAMPLE_FAST_TOP_K. Such a row's
// draw depends only on the few largest logits, the max and the log-sum-exp,
// so the row is read once, spread over many blocks:
//
// sample_fast_chunks, grid (SAMPLE_FAST_CHUNKS, rows), SAMPLE_FAST_THREADS
// threads: chunk c of the row (ids [c * len, (c + 1) * len), len =
// ceil(V / chunks)) leaves in the scratch below its SAMPLE_FAST_KEEP (32)
// largest logit_keys, largest first, 0 = empty (select: every thread holds
// SAMPLE_FAST_HELD keys in registers; the 32nd largest of the threads'
// maxima is a cut no key of the 32 lies below; the keys at or above it,
// those of at most 32 threads, are ranked by counting: select_top) and
// s_c = sum of exp(l - m_c) in f64 over its ids, m_c its largest
// penalised logit (NaN as -inf); a -inf logit adds 0 even when m_c is -inf,
// a NaN adds NaN. Rows off the fast path return at once.
//
// sample_fast_finish, one block of SAMPLE_THREADS per row, launched as a
// programmatic dependent of the chunks (its row parameters read before the
// wait): merges the chunk
// lists into the row's 32 largest keys (exact: every one of them is among
// its chunk's 32; select_top over the chunks' heads), M = the largest,
// se = sum_c exp(m_c - M) * s_c (NaN
// exactly where sample_rows' sum is NaN: a NaN logit, or M infinite), and
// then, on one warp, the 32 candidates' weights w = weight_of(l, m, 1/T):
// eligible (w > 0, w >= min_p) ones ranked by (w desc, id asc), the top-k
// cut, top-p by the same rule as radix_select + tie_id (the first weight
// value, in descending order, whose cumulated mass reaches top_p * mass,
// and of its ties the ceil((target - above) / w) lowest ids), and the draw
// by inverse CDF in id order. Outputs and the count update as sample_rows.
//
// Exactness guard: an id outside the 32 has l <= l_32, so its weight is at
// most w_32 (1 + 2^-16) + 1e-30 (expf is within 2 ulp of a monotone
// function, so w can be off monotone by a few ulp only). The cut is exact
// when the list covers all V ids, or when the top_k-th candidate's weight
// exceeds that bound (nothing outside can enter or tie), or when fewer than
// top_k candidates are eligible and min_p exceeds the bound (nothing outside
// is eligible). Otherwise (flat heads: ties or near-ties across the 32nd
// logit, or weights underflowing before the top_k-th) the block runs
// sample_row_slow for the row, so every row gets sample_rows' answer; the
// only differences left are f64 summation order (the log-sum-exp through
// the chunk sums: logprobs within ~1e-7 relative) at inverse-CDF and
// top-p boundaries. sample_fast_probe is the finish without the fallback:
// rows it cannot decide (or off the fast path) get token
// SAMPLE_UNDECIDED and nothing else, so tests see which rows went fast.
//
// The scratch is this module's own memory, for SAMPLE_FAST_ROWS rows: the
// launcher runs larger batches in groups (one stream orders them).

#ifndef SAMPLE_FAST_CHUNKS
#error "SAMPLE_FAST_CHUNKS and the other SAMPLE_FAST_* must be defined by the host (sampling.rs)"
#endif
static_assert(SAMPLE_FAST_KEEP == 32, "SAMPLE_FAST_KEEP: one key per lane of a warp list");
static_assert(SAMPLE_FAST_TOP_K >= 1 && SAMPLE_FAST_TOP_K < SAMPLE_FAST_KEEP, "SAMPLE_FAST_TOP_K: 1..31, with a margin below the 32 kept");
static_assert(SAMPLE_TOP_MAX <= SAMPLE_FAST_KEEP, "the top logprobs come from the kept keys");
static_assert(SAMPLE_FAST_THREADS % 32 == 0 && SAMPLE_FAST_THREADS >= 32 && SAMPLE_FAST_THREADS <= SAMPLE_THREADS,
              "SAMPLE_FAST_THREADS: whole warps, at most SAMPLE_THREADS (block_sum's scratch)");
static_assert(SAMPLE_FAST_CHUNKS >= 1 && SAMPLE_FAST_CHUNKS <= 65535, "SAMPLE_FAST_CHUNKS: 1..65535 (grid x)");
static_assert(SAMPLE_FAST_ROWS >= 1 && SAMPLE_FAST_ROWS <= 65535, "SAMPLE_FAST_ROWS: 1..65535 (grid y)");

static_assert(SAMPLE_FAST_CHUNKS <= SAMPLE_THREADS, "sample_fast_finish: a thread per chunk head");

__device__ u64 sample_fast_keys[(size_t)SAMPLE_FAST_ROWS * SAMPLE_FAST_CHUNKS * SAMPLE_FAST_KEEP];
__device__ double sample_fast_sums[(size_t)SAMPLE_FAST_ROWS * SAMPLE_FAST_CHUNKS];

// The rows the fast kernels take (the same test in both).
__device__ __forceinline__ bool fast_row(const SampleRow& sp) {
    return !(sp.temperature > 0.0f) || (sp.top_k >= 1u && sp.top_k <= (u32)SAMPLE_FAST_TOP_K);
}

// SAMPLE_FAST_HELD (sampling.rs): keys a sample_fast_chunks thread holds in
// registers at once; a chunk is read in segments of SAMPLE_FAST_HELD *
// SAMPLE_FAST_THREADS ids.
static_assert(SAMPLE_FAST_HELD >= 1 && SAMPLE_FAST_HELD <= 32, "SAMPLE_FAST_HELD: 1..32 keys in registers");

// Candidate slots of a chunk's selection: the running top, then at most
// SAMPLE_FAST_KEEP threads' SAMPLE_FAST_HELD keys (select_top's bound).
#define SAMPLE_FAST_CAND (SAMPLE_FAST_KEEP * (SAMPLE_FAST_HELD + 1))

// The SAMPLE_FAST_KEEP-th largest of the values that threads 0..n-1 offer
// (distinct where non-zero, 0 = none), or 0 when fewer than that many are
// non-zero, into *kth. Every thread of the block calls it; vals holds n
// slots. Syncs before returning.
__device__ void kth_largest(u64 v, int n, u64* vals, u64* kth) {
    if ((int)threadIdx.x < n) vals[threadIdx.x] = v;
    if (threadIdx.x == 0) *kth = 0ull;
    __syncthreads();
    if ((int)threadIdx.x < n && v != 0ull) {
        int rank = 0;
        for (int q = 0; q < n; ++q) rank += vals[q] > v ? 1 : 0;
        if (rank == SAMPLE_FAST_KEEP - 1) *kth = v;
    }
    __syncthreads();
}

// top[r] = the candidate with r larger ones, for r < SAMPLE_FAST_KEEP, over
// the n keys of cand (distinct where non-zero; zeros are skipped): the
// SAMPLE_FAST_KEEP largest, largest first. Slots past the non-zero keys
// keep what the caller put there (0). The caller syncs before and after.
__device__ void rank_candidates(const u64* cand, int n, u64* top) {
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const u64 k = cand[j];
        if (k == 0ull) continue;
        int rank = 0;
        for (int q = 0; q < n; ++q) rank += cand[q] > k ? 1 : 0;
        if (rank < SAMPLE_FAST_KEEP) top[rank] = k;
    }
}

// The scratch of select_top: OFFERS offered values, CAND candidate slots.
template <int OFFERS, int CAND>
struct SelectSmem {
    u64 offers[OFFERS];
    u64 cand[CAND];
    u64 cut;
    int ncand;
};

// top[0..SAMPLE_FAST_KEEP) = the SAMPLE_FAST_KEEP largest of the keys the
// block's threads hold (N each, 0 = none; distinct where non-zero) and, when
// `running`, of the keys top holds already; largest first, 0 = empty. Every
// key of that top is at or above the cut, the SAMPLE_FAST_KEEP-th largest
// of the values threads 0..OFFERS-1 offer (each a held key: its thread's
// largest, or a sorted list's head), so only the keys at or above the cut
// are ranked; the caller bounds how many there can be by CAND. Every thread
// calls it; it syncs before returning.
template <int N, int OFFERS, int CAND>
__device__ void select_top(const u64 (&held)[N], u64 offer, bool running, SelectSmem<OFFERS, CAND>& s, u64* top) {
    // The running top leads the candidates (read before the barrier inside
    // kth_largest; zeroed after it for the ranking).
    if (running && threadIdx.x < SAMPLE_FAST_KEEP) s.cand[threadIdx.x] = top[threadIdx.x];
    if (threadIdx.x == 0) s.ncand = running ? SAMPLE_FAST_KEEP : 0;
    kth_largest(offer, OFFERS, s.offers, &s.cut);
    const u64 cut = s.cut;
#pragma unroll
    for (int e = 0; e < N; ++e)
        if (held[e] != 0ull && held[e] >= cut) s.cand[atomicAdd(&s.ncand, 1)] = held[e];
    if (threadIdx.x < SAMPLE_FAST_KEEP) top[threadIdx.x] = 0ull;
    __syncthreads();
    rank_candidates(s.cand, s.ncand, top);
    __syncthreads();
}

struct FastChunkSmem {
    SelectSmem<SAMPLE_FAST_THREADS, SAMPLE_FAST_CAND> sel;   // offers: each thread's largest key of the segment
    u64 top[SAMPLE_FAST_KEEP];
    double red[SAMPLE_WARPS];
};

extern "C" __global__ void __launch_bounds__(SAMPLE_FAST_THREADS) sample_fast_chunks(const __grid_constant__ SampleParams p) {
    __shared__ FastChunkSmem sm;
    // The finish may launch at once (it waits for this grid to complete).
    pdl_trigger();
    const int r = blockIdx.y, c = blockIdx.x;
    const SampleRow sp = p.rows[r];
    if (!fast_row(sp)) return;   // the finish runs sample_row_slow for it
    const float* row = p.logits + (size_t)r * (size_t)p.row_stride;
    const int vocab = row_vocab(sp, p.vocab);
    const int len = (vocab + SAMPLE_FAST_CHUNKS - 1) / SAMPLE_FAST_CHUNKS;
    const int lo = min(vocab, c * len), hi = min(vocab, lo + len);
    // Zero until a segment ranks into it (an empty chunk keeps it so).
    for (int j = threadIdx.x; j < SAMPLE_FAST_KEEP; j += blockDim.x) sm.top[j] = 0ull;
    // Per segment: every key in registers (all loads in flight at once),
    // then a cut no key of the top can be below: the 32nd largest of the
    // threads' maxima (32 distinct keys reach it). Only the keys at or
    // above it (those of at most 32 threads) and the running top are
    // ranked; no serial insertion chain.
    for (int base = lo; base < hi; base += SAMPLE_FAST_HELD * blockDim.x) {
        u64 key[SAMPLE_FAST_HELD];
        u64 mk = 0ull;
#pragma unroll
        for (int e = 0; e < SAMPLE_FAST_HELD; ++e) {
            const int i = base + e * blockDim.x + threadIdx.x;
            key[e] = i < hi ? logit_key(penalised(row, sp, i), i) : 0ull;
            mk = key[e] > mk ? key[e] : mk;
        }
        select_top(key, mk, base != lo, sm.sel, sm.top);
    }
    const u64 best = sm.top[0];
    // Second read of the chunk (from L1): the sum needs the chunk's max.
    double se = 0.0;
    if (best != 0ull) {
        const float mc = key_logit(best);
#pragma unroll 4
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const float l = penalised(row, sp, i);
            if (l != NEG_INF) se += (double)expf(l - mc);
        }
    }
    se = block_sum<double>(se, sm.red);
    const size_t at = (size_t)r * SAMPLE_FAST_CHUNKS + c;
    if (threadIdx.x < SAMPLE_FAST_KEEP) sample_fast_keys[at * SAMPLE_FAST_KEEP + threadIdx.x] = sm.top[threadIdx.x];
    if (threadIdx.x == 0) sample_fast_sums[at] = se;
}

struct FastSmem {
    // Offers: each chunk's head; candidates: at most 32 lists' 32 keys.
    SelectSmem<SAMPLE_FAST_CHUNKS, SAMPLE_FAST_KEEP * SAMPLE_FAST_KEEP> sel;
    int nf;                         // candidates kept for the draw (0: none)
    u64 top[SAMPLE_FAST_KEEP];      // the row's 32 largest keys, largest first
    double se;
    float cw[SAMPLE_FAST_KEEP];     // eligible candidates by (w desc, id asc)
    int cid[SAMPLE_FAST_KEEP];
    float dw[SAMPLE_FAST_KEEP];     // the kept ones in id order (the draw)
    int did[SAMPLE_FAST_KEEP];
    int token;
    int slow;                       // 1: the guard failed, run sample_row_slow
};

// The top-k / min-p cut and top-p of fast_decide, on one lane: fs.slow = 1
// when the guard cannot prove the cut exact; else the number of candidates
// (in fs.cw / fs.cid order) the draw keeps (0: none eligible).
__device__ int fast_cut(const SampleRow& sp, int vocab, int have, int ne, float wlast, FastSmem& fs) {
    const bool full = have == vocab;
    const float outside = __fadd_rn(__fmul_rn(wlast, 1.0000152587890625f), 1e-30f);
    const int k = (int)sp.top_k;
    int nc;
    bool exact;
    if (full) {
        nc = ne < k ? ne : k;
        exact = true;
    } else if (ne >= k) {
        nc = k;
        exact = fs.cw[k - 1] > outside;
    } else {
        nc = ne;
        exact = sp.min_p > outside;
    }
    fs.slow = exact ? 0 : 1;
    if (!exact || nc == 0) return 0;
    // Top-p: radix_select's boundary value and tie_id's rank, over the
    // candidates in (w desc, id asc) order (ties: consecutive, ids ascending).
    int nf = nc;
    if (sp.top_p < 1.0f) {
        double mass = 0.0;
        for (int j = 0; j < nc; ++j) mass += (double)fs.cw[j];
        const double target = (double)sp.top_p * mass;
        double above = 0.0;
        for (int j = 0; j < nc;) {
            const float b = fs.cw[j];
            int e = j;
            double v = 0.0;
            while (e < nc && fs.cw[e] == b) v += (double)fs.cw[e++];
            if (v > 0.0 && above + v >= target) {
                double need = ceil((target - above) / (double)b);
                if (!(need >= 1.0)) need = 1.0;
                const double run = (double)(e - j);
                nf = j + (int)(need < run ? need : run);
                break;
            }
            above += v;
            j = e;
        }
    }
    return nf;
}

// Decides a sampled row from its 32 largest keys (fs.top) on warp 0; sets
// fs.token, or fs.slow = 1 when the guard cannot prove the answer exact.
__device__ void fast_decide(const SampleRow& sp, int vocab, float m, int amax, FastSmem& fs) {
    const int lane = threadIdx.x & 31;
    const float inv_t = 1.0f / sp.temperature;
    const u64 key = fs.top[lane];
    const bool valid = key != 0ull;
    const int id = valid ? (int)argmax_key_index(key) : 0;
    // key_logit is the penalised logit (a NaN's key reads -inf: weight 0 either way).
    const float w = valid ? weight_of(key_logit(key), m, inv_t) : 0.0f;
    const bool el = valid && w > 0.0f && w >= sp.min_p;
    const int have = __popc(__ballot_sync(FULL_MASK, valid));
    const int ne = __popc(__ballot_sync(FULL_MASK, el));
    const u64 ok = el ? order_key(w, id) : 0ull;
    int rank = 0;
    for (int q = 0; q < 32; ++q) rank += __shfl_sync(FULL_MASK, ok, q) > ok ? 1 : 0;
    if (el) { fs.cw[rank] = w; fs.cid[rank] = id; }
    // Bound on the weight of any id outside the list (have == 32 then).
    const float wlast = __shfl_sync(FULL_MASK, w, 31);
    __syncwarp();
    if (lane == 0) fs.nf = fast_cut(sp, vocab, have, ne, wlast, fs);
    __syncwarp();
    const int nf = fs.nf;
    if (nf == 0) return;
    // The kept candidates in id order: each lane places its own (distinct ids).
    if (lane < nf) {
        const int cid = fs.cid[lane];
        int q = 0;
        for (int j = 0; j < nf; ++j) q += fs.cid[j] < cid ? 1 : 0;
        fs.did[q] = cid;
        fs.dw[q] = fs.cw[lane];
    }
    __syncwarp();
    if (lane != 0) return;
    double total = 0.0;
    for (int j = 0; j < nf; ++j) total += (double)fs.dw[j];
    const double t = philox_uniform(sp.seed, sp.step) * total;
    double acc = 0.0;
    int chosen = fs.did[nf - 1];   // rounding left t unreached: the last, as sample_rows
    for (int j = 0; j < nf; ++j) {
        if (acc + (double)fs.dw[j] > t) { chosen = fs.did[j]; break; }
        acc += (double)fs.dw[j];
    }
    fs.token = chosen;
}

template <bool PROBE>
__device__ __forceinline__ void fast_finish(const SampleParams& p, SampleSmem& sm, FastSmem& fs) {
    const int r = blockIdx.x;
    // Launched as a programmatic dependent of sample_fast_chunks: the row's
    // parameters (the step's upload) are read while the chunks still run;
    // everything the chunks write, and the logits, after the wait.
    const SampleRow sp = p.rows[r];
    pdl_wait();
    if (!fast_row(sp)) {
        if (PROBE) {
            if (threadIdx.x == 0) p.out_tokens[r] = SAMPLE_UNDECIDED;
        } else {
            sample_row_slow(p, r, sm);
        }
        return;
    }
    const float* row = p.logits + (size_t)r * (size_t)p.row_stride;
    const int vocab = row_vocab(sp, p.vocab);
    const int ntop = (int)min(sp.top_logprobs, (u32)SAMPLE_TOP_MAX);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t at = (size_t)r * SAMPLE_FAST_CHUNKS;
    // Merge: the row's 32 largest keys are among the chunks' lists (each
    // holds its chunk's 32), and none is below the 32nd largest chunk head
    // (32 distinct keys reach it), so only the keys at or above that cut
    // (of at most 32 lists) are ranked.
    const u64* keys = sample_fast_keys + at * SAMPLE_FAST_KEEP;
    constexpr int all = SAMPLE_FAST_CHUNKS * SAMPLE_FAST_KEEP;
    constexpr int per = (all + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    u64 held[per];
#pragma unroll
    for (int q = 0; q < per; ++q) {
        const int j = q * SAMPLE_THREADS + threadIdx.x;
        held[q] = j < all ? keys[j] : 0ull;
    }
    const u64 head = threadIdx.x < SAMPLE_FAST_CHUNKS ? keys[threadIdx.x * SAMPLE_FAST_KEEP] : 0ull;
    select_top(held, head, false, fs.sel, fs.top);
    const u64 best = fs.top[0];   // vocab >= 1: never 0
    const int amax = (int)argmax_key_index(best);
    const float m = penalised(row, sp, amax);
    const bool sampling = sp.temperature > 0.0f && fabsf(m) <= 3.402823466e38f;
    if (warp == 0) {
        // Log-sum-exp from the chunk sums, in chunk order per lane, then a
        // fixed shuffle tree.
        const float mx = key_logit(best);
        double s = 0.0;
        for (int c = lane; c < SAMPLE_FAST_CHUNKS; c += 32) {
            const u64 kc = sample_fast_keys[(at + c) * SAMPLE_FAST_KEEP];
            if (kc != 0ull) s += exp((double)key_logit(kc) - (double)mx) * sample_fast_sums[at + c];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
        if (lane == 0) {
            fs.se = s;
            fs.token = amax;
            fs.slow = 0;
        }
        __syncwarp();
        if (sampling) fast_decide(sp, vocab, m, amax, fs);
    }
    __syncthreads();
    if (fs.slow != 0) {
        if (PROBE) {
            if (threadIdx.x == 0) p.out_tokens[r] = SAMPLE_UNDECIDED;
        } else {
            // Every thread reads fs.slow after the barrier: block-uniform.
            sample_row_slow(p, r, sm);
        }
        return;
    }
    const double se = fs.se;
    const int token = fs.token;
    if (ntop > 0 && p.out_top_ids != nullptr) {
        const size_t to = (size_t)r * SAMPLE_TOP_MAX;
        for (int j = threadIdx.x; j < ntop; j += blockDim.x) {
            const u64 k = fs.top[j];
            p.out_top_ids[to + j] = k != 0ull ? argmax_key_index(k) : 0xffffffffu;
            p.out_top_logprobs[to + j] = k != 0ull ? (float)((double)key_logit(k) - (double)m - log(se)) : NEG_INF;
        }
    }
    if (threadIdx.x == 0) {
        const float lt = penalised(row, sp, token);
        emit_token(p, r, token);
        p.out_logprobs[r] = (float)((double)lt - (double)m - log(se));
        if (sp.counts != nullptr) sp.counts[token] += 1u;
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_fast_finish(const __grid_constant__ SampleParams p) {
    __shared__ SampleSmem sm;
    __shared__ FastSmem fs;
    fast_finish<false>(p, sm, fs);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_fast_probe(const __grid_constant__ SampleParams p) {
    __shared__ SampleSmem sm;
    __shared__ FastSmem fs;
    fast_finish<true>(p, sm, fs);
}
