// common.cuh: types and device helpers shared by every kernel family.
//
// Prepended by the Rust side (kernels.rs) to each family's source before
// NVRTC compiles it, after the model-dimension defines. It includes no CUDA
// header: bf16 is handled as raw 16-bit words with our own conversions and
// the tensor-core, async-copy and cache-hint instructions are inline PTX, so
// NVRTC needs no include directory at start-up.
//
// Quantised layout (MLX affine, group GROUP_SIZE = 64): a row of `cols`
// weights is `cols * bits / 32` u32 words, code j at bit (j % per_word) *
// bits of word j / per_word; every group of 64 weights has one bf16 scale and
// one bf16 bias, w = scale * q + bias.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
typedef u16 bf16;

#ifndef GROUP_SIZE
#error "GROUP_SIZE must be defined by the host"
#endif

#define WARP 32
#define FULL_MASK 0xffffffffu

// Parameter structs passed by value are mirrored by #[repr(C)] structs on
// the Rust side; the host passes each mirror's size as a define, so a layout
// that drifts on either side stops the compile (also in CI, without a GPU).
#define LAYOUT_CHECK(T, SIZE) static_assert(sizeof(T) == (SIZE), #T " differs from its Rust mirror");

// ---- programmatic dependent launch (sm_90) -------------------------------
//
// A kernel launched with the programmatic-serialization attribute may start
// while the kernel before it is still running: pdl_wait() blocks until that
// kernel has completed and its writes are visible, so nothing before it may
// read what earlier kernels write or write what they read. pdl_trigger()
// lets the next kernel start launching (it still waits in its pdl_wait()).
// Both are no-ops for a kernel launched normally.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" :::); }
#define POS_INF __int_as_float(0x7f800000)
#define NEG_INF __int_as_float(0xff800000)

// ---- bf16 <-> f32 -------------------------------------------------------

__device__ __forceinline__ float bf16_to_f32(bf16 h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even, NaN kept quiet.
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u32 lsb = (u >> 16) & 1u;
    u += 0x7fffu + lsb;
    return (bf16)(u >> 16);
}

// Two f32 into one bf16x2 word (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float bf16lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// ---- fp16 (the activations of the tensor-core path and the KV cache) ----
//
// fp16 keeps 11 significant bits (bf16: 8), which is what lets the GEMM and
// attention paths stay close to the fp32 reference; values are saturated to
// the fp16 range on conversion so an outlier cannot become inf.
typedef u16 f16;
#define F16_MAX 65504.f

__device__ __forceinline__ f16 f32_to_f16(float f) {
    f = fminf(fmaxf(f, -F16_MAX), F16_MAX);
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ float f16_to_f32(f16 h) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}
// Two f32 into one f16x2 word (lo in the low half), saturated.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    lo = fminf(fmaxf(lo, -F16_MAX), F16_MAX);
    hi = fminf(fmaxf(hi, -F16_MAX), F16_MAX);
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// Two f32 into one f16x2 word (lo in the low half), saturated to +-65504:
// pack_f16x2 in one instruction (cvt's .satfinite instead of two clamps per
// value). Identical for every value but NaN, which stays NaN here (a NaN
// scale or bias; pack_f16x2 would give -65504).
__device__ __forceinline__ u32 pack_f16x2_sat(float lo, float hi) {
    u32 r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// 2^x on the special-function unit with denormal results flushed to 0:
// exp2f adds a range check and two multiplies a call to produce them. For
// attention's probabilities a result below 2^-126 is lost anyway: P is
// rounded to fp16, and each row sum already holds its maximum's 1.
__device__ __forceinline__ float exp2_ftz(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float f16lo(u32 w) { return f16_to_f32((f16)(w & 0xffffu)); }
__device__ __forceinline__ float f16hi(u32 w) { return f16_to_f32((f16)(w >> 16)); }

// ---- loads with cache hints --------------------------------------------

// Streaming read-only 16-byte load (weights: read once per step, keep out of L1).
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ u16 ld_nc_u16(const u16* p) {
    unsigned short r;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

// ---- reductions ---------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block; `red` holds at least blockDim.x / 32 floats. Every
// thread gets the result. Contains two __syncthreads.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += red[i];
    return t;
}

// One row of COLS f32 values (`row`: global or shared memory) normalised
// into fp16 by a block of THREADS threads: out[c] = fp16(row[c] *
// rsqrt(mean(row^2) + eps) * gain[c]). Thread i holds columns i, i +
// THREADS, ... in registers (every load issued before the first use) and
// sums their squares in that order before block_sum, so every caller with
// the same THREADS gets the same bits: rmsnorm_f16 (gemm.cu) and the MoE
// combine's fused next-layer norm (moe.cu). `red`: 32 floats of shared
// memory. Contains two __syncthreads.
template <int COLS, int THREADS>
__device__ __forceinline__ void rmsnorm_row_f16(const float* row, const float* gain, f16* out, float eps, float* red) {
    constexpr int HELD = (COLS + THREADS - 1) / THREADS;
    // The gain is loaded with the row, before the reduction: after it (two
    // barriers), its loads were a second DRAM round trip of every norm.
    float v[HELD], w[HELD];
#pragma unroll
    for (int i = 0; i < HELD; ++i) {
        const int c = threadIdx.x + THREADS * i;
        v[i] = c < COLS ? row[c] : 0.f;
        w[i] = c < COLS ? gain[c] : 0.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < HELD; ++i)
        if ((int)threadIdx.x + THREADS * i < COLS) ss += v[i] * v[i];
    const float r = rsqrtf(block_sum(ss, red) / (float)COLS + eps);
#pragma unroll
    for (int i = 0; i < HELD; ++i) {
        const int c = threadIdx.x + THREADS * i;
        if (c < COLS) out[c] = f32_to_f16(v[i] * r * w[i]);
    }
}

__device__ __forceinline__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = NEG_INF;
    for (int i = 0; i < nw; ++i) t = fmaxf(t, red[i]);
    return t;
}

// ---- math ---------------------------------------------------------------

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// ---- MoE routing ----------------------------------------------------------

#define EXPERTS_PER_LANE ((N_EXPERTS + 31) / 32)

// A float's order as an unsigned key (larger float, larger key), -0 as +0
// so that they tie as floats do, NaN below every number (key 0, as a
// removed expert): for the warp's max by redux.sync.
__device__ __forceinline__ u32 topk_key(float f) {
    if (f != f) return 0u;
    const u32 u = __float_as_uint(f + 0.f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float topk_value(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// Top-k of one token's router logits by one warp. Lane l holds experts
// l, l + 32, ...; TOPK rounds, each the warp's largest key by one
// redux.sync (max) and, among the experts holding it, the lowest index by
// a second (min): the same choice as a float argmax with ties to the lower
// index, in two reductions where a shuffle butterfly took five dependent
// steps of two shuffles. Writes idx[TOPK] and the renormalised weights
// w[TOPK] (lane k writes entry k: the caller syncs the warp before reading
// them from other lanes). key[i]: topk_key of expert lane + 32 i's logit
// (0 past the experts).
__device__ __forceinline__ void warp_topk_keys(u32 (&key)[EXPERTS_PER_LANE], int* idx, float* w) {
    const int lane = threadIdx.x & 31;
    // Lane k keeps the k-th choice (a register each, not TOPK a lane).
    float my_v = 0.f;
    int my_i = 0;
#pragma unroll 1
    for (int k = 0; k < TOPK; ++k) {
        u32 best = 0u;
#pragma unroll
        for (int i = 0; i < EXPERTS_PER_LANE; ++i) best = max(best, key[i]);
        best = __reduce_max_sync(FULL_MASK, best);
        // This lane's lowest expert holding it (only real experts: with
        // every key 0, i.e. NaN or removed, the index stays in range).
        u32 mine = 0xFFFFFFFFu;
#pragma unroll
        for (int i = EXPERTS_PER_LANE - 1; i >= 0; --i)
            if (key[i] == best && lane + 32 * i < N_EXPERTS) mine = (u32)(lane + 32 * i);
        const int bi = (int)__reduce_min_sync(FULL_MASK, mine);
        if (lane == k) {
            my_v = topk_value(best);
            my_i = bi;
        }
#pragma unroll
        for (int i = 0; i < EXPERTS_PER_LANE; ++i)
            if (lane + 32 * i == bi) key[i] = 0u;
    }
    // softmax over all experts then renormalising the top k equals a
    // softmax over the k selected logits; choice 0 is their maximum. Lane k
    // takes e_k, every lane sums them in choice order (the same operations
    // as one lane computing all TOPK), lane k writes choice k.
    const float e = expf(my_v - __shfl_sync(FULL_MASK, my_v, 0));
    float tot = 0.f;
#pragma unroll
    for (int k = 0; k < TOPK; ++k) tot += __shfl_sync(FULL_MASK, e, k);
    if (lane < TOPK) {
        idx[lane] = my_i;
        w[lane] = e / tot;
    }
}
__device__ __forceinline__ void warp_topk(const float* __restrict__ logits, int* idx, float* w) {
    const int lane = threadIdx.x & 31;
    u32 key[EXPERTS_PER_LANE];
#pragma unroll
    for (int i = 0; i < EXPERTS_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        key[i] = e < N_EXPERTS ? topk_key(logits[e]) : 0u;
    }
    warp_topk_keys(key, idx, w);
}

// ---- 4-bit / 8-bit dequantisation ---------------------------------------

// float(code) for the byte `k` of `w` through the 2^23 trick: the byte is
// placed in the low mantissa of 8388608.0f, then 8388608 is subtracted
// (exact), which is cheaper than an integer-to-float conversion.
#define MAGIC_SEL(k) (0x7540u + (k))
__device__ __forceinline__ float byte_to_f32(u32 w, int k) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, MAGIC_SEL(k))) - 8388608.f;
}

// sum_j q_j * x[j] for the 4 eight-bit codes of one word (code j in byte j).
__device__ __forceinline__ float dot4_q8(u32 w, const float* x) {
    float a = byte_to_f32(w, 0) * x[0];
    float b = byte_to_f32(w, 1) * x[1];
    a = fmaf(byte_to_f32(w, 2), x[2], a);
    b = fmaf(byte_to_f32(w, 3), x[3], b);
    return a + b;
}

// Dequantised 4-bit code `j` (0..7) of a word.
__device__ __forceinline__ float q4_at(u32 w, int j) { return (float)((w >> (4 * j)) & 15u); }

// ---- packed activations' column order ------------------------------------
// Within every 8 consecutive columns of a packed activation row, column j is
// stored at position px_perm(j): the order 0,4,2,6,1,5,3,7 (j's three bits
// reversed). qmm's B fragments then read, as four u32 words, the column
// pairs (0,4), (2,6), (1,5), (3,7): the pairs deq_word (qmm.cu) masks out of
// a word of codes, low nibbles first, so that each mma takes codes of one
// scale. qmm.rs `px_position` mirrors it for the tests.
__device__ __forceinline__ int px_perm(int j) { return ((j & 1) << 2) | (j & 2) | ((j >> 2) & 1); }

// ---- padded shared-memory vectors ---------------------------------------
//
// Activation vectors that warps read 32 (4-bit) or 16 (8-bit) consecutive
// floats at a time per lane are stored with 4 floats of padding after every
// 32, so that the 16-byte reads of lanes 32 floats apart fall in different
// banks.
#define PAD32(c) ((c) + ((c) >> 5) * 4)
#define PADDED_LEN(n) ((n) + ((n) >> 5) * 4)

// Keys for a packed argmax with atomicMax: larger value first, then the
// smaller index (the first one, as lily_model::argmax).
__device__ __forceinline__ u64 argmax_key(float v, u32 idx) {
    u32 u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((u64)u << 32) | (u64)(0xffffffffu - idx);
}
__device__ __forceinline__ u32 argmax_key_index(u64 key) { return 0xffffffffu - (u32)(key & 0xffffffffu); }

// sum_j q_j x_j over the 16 codes of an 8-bit chunk.
__device__ __forceinline__ float dot16_q8(uint4 w, const float* xv) {
    return dot4_q8(w.x, xv) + dot4_q8(w.y, xv + 4) + dot4_q8(w.z, xv + 8) + dot4_q8(w.w, xv + 12);
}

// ---- tensor cores and async copies (sm_80+ instructions, used on sm_90a) --

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Asks L2 for the 128-byte line holding p (a hint: nothing waits for it).
__device__ __forceinline__ void l2_prefetch(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// 16-byte global -> shared copy; `bytes` < 16 zero-fills the rest (0: all zeros).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// 16-byte (bypassing L1) and 8-byte global -> shared copies to a 32-bit
// shared address, zeros instead of the source when `ok` is 0 (the
// ignore-src predicate: no byte count to compute, nothing read; any
// nonzero `ok` copies, so a caller may pass a masked flag word).
__device__ __forceinline__ void cp_async16_or_zero(u32 saddr, const void* gmem, u32 ok) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.eq.u32 p, %2, 0;\n\tcp.async.cg.shared.global [%0], [%1], 16, p;\n\t}" ::"r"(saddr),
        "l"(gmem), "r"(ok));
}
__device__ __forceinline__ void cp_async8_or_zero(u32 saddr, const void* gmem, u32 ok) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.eq.u32 p, %2, 0;\n\tcp.async.ca.shared.global [%0], [%1], 8, p;\n\t}" ::"r"(saddr),
        "l"(gmem), "r"(ok));
}
// 8-byte global -> shared copy of `bytes` (0..8) source bytes, zeros after.
__device__ __forceinline__ void cp_async8_bytes(u32 saddr, const void* gmem, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(saddr), "l"(gmem), "r"(bytes));
}
// Two words to a 32-bit shared address (8-byte aligned).
__device__ __forceinline__ void st_shared_v2(u32 saddr, u32 a, u32 b) { asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(saddr), "r"(a), "r"(b)); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}

// ---- wgmma (sm_90a): descriptors, fences, waits ---------------------------
//
// Shared-memory matrix descriptor of a K-major, 128-byte-swizzled operand
// at 32-bit shared address `saddr` (a k16 step within the 1024-byte swizzle
// atom is +32 bytes): start >> 4 in bits 0-13, leading offset (unused by
// swizzled K-major layouts) 1, stride 1024 bytes between 8-row groups
// (>> 4 in bits 32-45), swizzle mode 1 (128 B) in bits 62-63.
__device__ __forceinline__ unsigned long long wg_desc_sw128(u32 saddr) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
// wg_desc_sw128 of the address `bytes` past `desc`'s: shared addresses are
// below 2^18, so the sum stays inside the 14-bit address field (no carry
// into the other fields) and one add replaces building a descriptor from
// the address (~13 instructions a wgmma where a loop builds one a step).
__device__ __forceinline__ unsigned long long wg_desc_advance(unsigned long long desc, u32 bytes) {
    return desc + (bytes >> 4);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// Shared memory written by cp.async (generic proxy) and read next by the
// tensor cores (async proxy): each writer fences before the barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- mbarriers and named barriers -------------------------------------------
// An mbarrier (8 bytes of shared memory at `bar`) completes a phase when its
// expected arrivals have arrived; waiters name the phase by its parity.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// One arrival that also tells the barrier how many bytes of copies to wait for.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// Arrives on `bar` once every cp.async this thread has issued so far has
// landed (.noinc: the arrival is one of the count the barrier was made with).
__device__ __forceinline__ void mbar_arrive_cp_async(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// bar.sync on barrier `id` (1..15; 0 is __syncthreads) for `threads`
// threads (a multiple of 32): the warps of one task meet without the block.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// bar.arrive: counts this warp among `threads` without waiting (the others
// bar.sync on `id`).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator across a wgmma
// wait (the asm above updates them asynchronously).
__device__ __forceinline__ void wg_reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// Shared-memory matrix descriptor of an MN-major (N contiguous),
// 128-byte-swizzled B operand: rows are K (128 bytes = 64 N values each,
// chunk j of row r at chunk j ^ (r & 7) within a 1024-byte atom of 8 rows),
// `lbo` bytes between atoms of 64 N values, 1024 bytes between groups of 8
// K rows (CUTLASS's canonical MN-major SW128 layout). Used with imm-trans-b 1.
__device__ __forceinline__ unsigned long long wg_desc_sw128_mn(u32 saddr, u32 lbo) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// D (64 x N, f32) += A (64 x 16, fp16 registers in the m16n8k16 A-fragment
// layout of each warp's 16 rows) B (16 x N, shared-memory descriptor;
// TRANS_B 0: K-major, 1: N-major).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_rs_m64n64(float* d, const u32* a, unsigned long long db) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n\t}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1), "n"(TRANS_B));
}
// The first 64 f32 accumulators of a wgmma of N >= 128: their register
// list (%0 .. %63, the first operands of the asm) and their "+f" operands.
#define WG_N64_REGS \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_N64_ACC(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), "+f"((d)[7]), \
    "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), \
    "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), \
    "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31]), \
    "+f"((d)[32]), "+f"((d)[33]), "+f"((d)[34]), "+f"((d)[35]), "+f"((d)[36]), "+f"((d)[37]), "+f"((d)[38]), "+f"((d)[39]), \
    "+f"((d)[40]), "+f"((d)[41]), "+f"((d)[42]), "+f"((d)[43]), "+f"((d)[44]), "+f"((d)[45]), "+f"((d)[46]), "+f"((d)[47]), \
    "+f"((d)[48]), "+f"((d)[49]), "+f"((d)[50]), "+f"((d)[51]), "+f"((d)[52]), "+f"((d)[53]), "+f"((d)[54]), "+f"((d)[55]), \
    "+f"((d)[56]), "+f"((d)[57]), "+f"((d)[58]), "+f"((d)[59]), "+f"((d)[60]), "+f"((d)[61]), "+f"((d)[62]), "+f"((d)[63])
template <int TRANS_B>
__device__ __forceinline__ void wgmma_rs_m64n128(float* d, const u32* a, unsigned long long db) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %69, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{" WG_N64_REGS "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n\t}"
        : WG_N64_ACC(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1), "n"(TRANS_B));
}
// m64n144: tiles of 144 tokens (gemm.cu's widest wgmma tile: 72 accumulators
// a thread).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_rs_m64n144(float* d, const u32* a, unsigned long long db) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %77, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n144k16.f32.f16.f16 "
        "{" WG_N64_REGS ", %64, %65, %66, %67, %68, %69, %70, %71}, {%72, %73, %74, %75}, %76, p, 1, 1, %78;\n\t}"
        : WG_N64_ACC(d), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1), "n"(TRANS_B));
}
// The 128 f32 accumulators of an m64n256 wgmma: their register list (%0 ..
// %127, the first operands of the asm) and their "+f" operands, shared by
// the register-A and shared-memory-A forms.
#define WG_N256_REGS \
    WG_N64_REGS ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WG_N256_ACC(d) \
    WG_N64_ACC(d), \
    "+f"((d)[64]), "+f"((d)[65]), "+f"((d)[66]), "+f"((d)[67]), "+f"((d)[68]), "+f"((d)[69]), "+f"((d)[70]), "+f"((d)[71]), \
    "+f"((d)[72]), "+f"((d)[73]), "+f"((d)[74]), "+f"((d)[75]), "+f"((d)[76]), "+f"((d)[77]), "+f"((d)[78]), "+f"((d)[79]), \
    "+f"((d)[80]), "+f"((d)[81]), "+f"((d)[82]), "+f"((d)[83]), "+f"((d)[84]), "+f"((d)[85]), "+f"((d)[86]), "+f"((d)[87]), \
    "+f"((d)[88]), "+f"((d)[89]), "+f"((d)[90]), "+f"((d)[91]), "+f"((d)[92]), "+f"((d)[93]), "+f"((d)[94]), "+f"((d)[95]), \
    "+f"((d)[96]), "+f"((d)[97]), "+f"((d)[98]), "+f"((d)[99]), "+f"((d)[100]), "+f"((d)[101]), "+f"((d)[102]), "+f"((d)[103]), \
    "+f"((d)[104]), "+f"((d)[105]), "+f"((d)[106]), "+f"((d)[107]), "+f"((d)[108]), "+f"((d)[109]), "+f"((d)[110]), "+f"((d)[111]), \
    "+f"((d)[112]), "+f"((d)[113]), "+f"((d)[114]), "+f"((d)[115]), "+f"((d)[116]), "+f"((d)[117]), "+f"((d)[118]), "+f"((d)[119]), \
    "+f"((d)[120]), "+f"((d)[121]), "+f"((d)[122]), "+f"((d)[123]), "+f"((d)[124]), "+f"((d)[125]), "+f"((d)[126]), "+f"((d)[127])
template <int TRANS_B>
__device__ __forceinline__ void wgmma_rs_m64n256(float* d, const u32* a, unsigned long long db) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %133, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{" WG_N256_REGS "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n\t}"
        : WG_N256_ACC(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1), "n"(TRANS_B));
}
// D (64 x 256, f32) += A (64 x 16) B^T (B: 256 x 16), both K-major from
// shared-memory descriptors.
__device__ __forceinline__ void wgmma_ss_m64n256(float* d, unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %130, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{" WG_N256_REGS "}, %128, %129, p, 1, 1, 0, 0;\n\t}"
        : WG_N256_ACC(d)
        : "l"(da), "l"(db), "r"(1));
}
// D (64 x 64, f32) (+)= A (64 x 16) B (64 x 16), both from shared-memory
// descriptors, K-major; `accumulate` 0 starts D from zero.
__device__ __forceinline__ void wgmma_ss_m64n64(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0;\n\t}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
}


// D = A B + D, m16n8k16, fp16 inputs, fp32 accumulators.
// A frag: a0 (row g, k 2c..2c+1), a1 (row g+8), a2 (row g, k+8), a3 (row g+8, k+8);
// B frag: b0 (k 2c..2c+1, col g), b1 (k 2c+8..); C: c0,c1 (row g, cols 2c, 2c+1), c2,c3 (row g+8),
// with g = lane / 4, c = lane % 4.
__device__ __forceinline__ void mma_f16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D = A B + D, m16n8k16, bf16 inputs, fp32 accumulators; fragments as mma_f16.
__device__ __forceinline__ void mma_bf16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- reads of data other blocks of the same grid wrote, and a block scan ----
// (the last block of a grid, after a ticket, reading through L2)
__device__ __forceinline__ float ldcg_f32(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ int ldcg_i32(const int* p) {
    int r;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

// Whether this block is the last of `of` blocks to take a ticket from
// `*ticket` (called once by every thread of each of those blocks). Every
// block's global writes before the call are fenced before it takes its
// ticket, and the last block fences again, so it may then read them all
// (through L2: ldcg). When `reset` is given, thread 0 zeroes it before
// taking the ticket (a counter of an earlier round, for the next launch).
__device__ __forceinline__ bool last_block_arrives(int* ticket, int of, int* reset = nullptr) {
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        if (reset != nullptr) *reset = 0;
        s_last = atomicAdd(ticket, 1) == of - 1;
    }
    __syncthreads();
    const bool last = s_last != 0;
    if (last) __threadfence();
    return last;
}

// Exclusive scan of v over the block of WARPS warps (blockDim.x == 32 *
// WARPS; tmp holds WARPS ints); returns the total.
template <int WARPS>
__device__ __forceinline__ int block_scan_excl(int v, int* tmp, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) tmp[warp] = incl;
    __syncthreads();
    int before = 0, tot = 0;
    for (int w = 0; w < WARPS; ++w) {
        if (w < warp) before += tmp[w];
        tot += tmp[w];
    }
    __syncthreads();
    total = tot;
    return before + incl - v;
}

