//! Launchers of kernels/qmm.cu: the decode step's matrix work on tensor
//! cores for 1 to `MAX_DECODE_BATCH` tokens (dense projections and the
//! lm_head, the MoE experts grouped by expert), the activation packer
//! (`xnorm`) and the MoE router with its device-side plan.
//!
//! Every constant both sides use is defined here once and handed to NVRTC as
//! a define (`defines`), with the size of every mirrored parameter struct, so
//! the kernel refuses to compile against a drifted layout. Launchers take
//! typed views of the memory plan (`DevSlice`) and check each one holds what
//! the launch touches.

use std::mem::size_of;

use cudarc::driver::DeviceRepr;

use crate::device::{DevSlice, Gpu};
use crate::dims::Dims;
use crate::error::{CudaError, CudaResult, DriverContext};
use crate::kernels::Kernels;
use crate::launch::launch_pdl;
use crate::weights::{MoeDev, QMat};

/// Most tokens one decode step takes (the largest decode batch).
pub const MAX_DECODE_BATCH: usize = 128;
/// Weight stages a warp's ring holds (default; the expert kernels).
pub const QMM_RING: usize = 4;
/// Weight stages a warp's ring holds in the dense kernels (default): their
/// weights are known before the previous kernel ends, so `QMM_DENSE_RING - 1`
/// stages a warp are requested before the dependency wait (at batch 1 the
/// in-projection's warps each take one task of 4 stages: all of it). The
/// expert kernels keep 4 (rings of 5 everywhere made batches of 2 to 128
/// tokens 1-4% slower, session 21).
pub const QMM_DENSE_RING: usize = 5;
/// The dense kernels' ring at 5-8 tokens (two n-tiles a warp): one more
/// stage in flight. `qmm_probe` at 8 tokens (session 36, rings of 6 against
/// 5, each matrix alone): in-projection 11.8 -> 10.9 us, out-projection
/// 10.7 -> 10.2.
pub const QMM_DENSE2_RING: usize = 6;
/// The lm_head's ring from 5 tokens: two stages, so that the SM's rings
/// leave L1 the room for the tokens' packed x (64 KB for 8 tokens of K =
/// 2,048) that every warp reads. `qmm_probe` at 8 tokens: 177.8 -> 164.2
/// us (64 tokens: 1,376.6 -> 1,276.6). With `QMM_DENSE2_RING`, a decode
/// step (session 37, NOTES history 129, three rounds) at 5 tokens 3.211 ->
/// 3.095 ms, at 8 3.794 -> 3.698; the same bits.
pub const QMM_HEAD_RING: usize = 2;
/// Weight stages a warp's ring holds in the one-token expert kernel
/// (`qmm_moe_1_occ3`): at one token a warp has about one task of 4 stages,
/// all requested at once with a ring of 5.
pub const QMM_ONE_TOKEN_RING: usize = 5;
/// Quantisation groups (64 columns) of 16 rows in one stage.
pub const QMM_SG: usize = 4;
/// Bytes of one stage: 16 rows x 4 groups x 32 bytes of codes, then the
/// scales and the biases (bf16) of those groups (qmm.cu, "Stage layout").
pub const QMM_STAGE_BYTES: usize = 16 * QMM_SG * 32 + 2 * 16 * QMM_SG * 2;
/// Warps of a matrix block (default): a 16-row task is shared by
/// K / QMM_SLICE_COLS of them (at most all, each a fixed slice of K), the
/// rest take other tasks.
pub const QMM_WARPS: usize = 4;
/// Columns of K per warp slice of a task (qmm.cu `KSplit`), by default. 1,024 (16
/// groups, 4 stages a task for K = 2,048) rather than 512: a task's fixed
/// costs (sources, block reduction, epilogue) are paid over twice the
/// weights, and at batch 1 a 2,048-wide matrix still keeps every warp of
/// the grid busy for the same number of groups. Depends only on K, so a
/// token's result never depends on its batch.
pub const QMM_SLICE_COLS: usize = 1024;
/// Input width from which a dense matrix is "wide": each 16-row task is
/// split over `QMM_WIDE_KQ` warps (slices of K / `QMM_WIDE_KQ` columns) in
/// blocks of as many warps, one task a block (the `*_wide` entries). In
/// this model that is the out-projections (K = 4,096, 2,048 rows: 128
/// tasks), which with 4 slices a task in blocks of 4 ran ~4 warps an SM,
/// each a chain of 16 groups. The split depends only on K, so a token's
/// result still never depends on its batch. Measured on the H200 (session
/// 38, NOTES.md history 131), the GDN out-projection alone (`qmm_probe`)
/// at 1 / 8 tokens: 5.8 / 10.1 us in 4 slices, 4.9 / 8.2 in 8, 5.0 / 6.9
/// in 16; ms a greedy step at 1 / 4 / 8 tokens (two rounds, one lease):
/// 4 slices 1.712 / 2.557 / 3.706, 8 slices (rings of 3) 1.682 / 2.458 /
/// 3.690, 16 slices (rings of 2) 1.694 / 2.464 / 3.607.
pub const QMM_WIDE_K: usize = 4096;
/// Slices (and warps a block) of a wide matrix's task: 16, one stage of 4
/// groups each at K = 4,096 (16 beat 8 by 2.3% at 8 tokens, the serving
/// batch, and lost 0.7% at 1).
pub const QMM_WIDE_KQ: usize = 16;
/// Weight stages a warp's ring holds in the wide entries: a warp's slice of
/// a task is K / (64 x 4 x QMM_WIDE_KQ) = 1 stage at K = 4,096, requested
/// before the dependency wait with a ring of 2. The dense rings (5, 6 at
/// 5-8 tokens) left one 8-warp block an SM (115 KB) and made the 8-token
/// step 1.6% slower in the graph although the matrix alone was faster
/// (session 38, call 3): the blocks of the kernels launched early beside
/// it had no room.
pub const QMM_WIDE_RING: usize = 2;
/// Tokens from which the MoE plan cuts an expert's pairs into items of 8
/// (qmm_moe_2, 156 registers) rather than 4 (qmm_moe_1, 128). Measured on
/// the H200 (qmm_probe, revision 21db8ab): items of 4 are faster at 16 to
/// 64 tokens (gate/up 67.9 -> 55.4 us at 16, 148.7 -> 125.7 at 64; down
/// 92.7 -> 81.7 at 64): an expert with more than 4 tokens is read twice
/// (the second time mostly from L2), but a block of qmm_moe_1 fits one more
/// block an SM.
pub const MOE_PAIRS8_FROM: usize = 65;
/// Tokens up to which a step's experts run `qmm_moe_1_occ3` (the same
/// kernel bounded to 3 blocks an SM, so ptxas may take 142 registers instead
/// of 128) rather than `qmm_moe_1`. Measured on the H200 (session 22, greedy
/// step, two rounds): every expert launch bounded so, batch 1 1.908 -> 1.870
/// ms but batch 2 / 4 / 8 / 16 / 32 / 64 +2.8 / +3.2 / +2.7 / +4.0 / +4.4 /
/// +3.2%; one token only, 1.911 -> 1.883 ms, the same bits.
pub const MOE_OCC3_UPTO: usize = 1;
/// Matrices one dense launch may compute from the same input.
pub const QMM_MAX_SEGS: usize = 4;
/// Ints before the item list in the MoE plan.
pub const PLAN_HEAD: usize = 4;
/// Ints of the router's ticket buffer: ticket[0] for the plan, then one a
/// token chunk (`router_tok_chunk` keeps the chunks fewer).
pub const ROUTER_TICKETS: usize = 64;
/// Router rows a `moe_router` block computes: one a warp (its block is
/// ROUTER_ROWS warps, and its last block's top-k takes a token a warp).
const ROUTER_ROWS: usize = 8;
/// Most tokens a `moe_router` block stages and routes at once (a chunk).
const ROUTER_TOK: usize = 8;
/// W rows a `moe_router_mma` block computes: one m16 tile of the 257 router
/// rows (the experts' and the shared-expert gate's).
const ROUTER_MMA_ROWS: usize = 16;
/// Most tokens of a step whose MoE runs as one `qmm_moe_fused` launch (its
/// router stages every token in one block, as moe_router's single chunk).
pub const MOE_FUSED_TOK: usize = ROUTER_TOK;
/// Warps of a `qmm_moe_fused` block (the router's 8 rows a block).
const MOE_FUSED_WARPS: usize = ROUTER_ROWS;
/// Threads of an `xnorm` block (one block a token).
const XN_THREADS: u32 = 256;
// `combine_norm_f16` matches rmsnorm_f16's bits only with as many threads.
const _: () = assert!(XN_THREADS as usize == crate::gemm::RMSNORM_THREADS, "xnorm's fp16 norm must sum as rmsnorm_f16 does");

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct QmmSegC {
    codes: u64,
    scales: u64,
    biases: u64,
    out: u64,
    rows: i32,
    out_stride: i32,
    tile_start: i32,
    mode: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct QmmDenseParamsC {
    seg: [QmmSegC; QMM_MAX_SEGS],
    x: u64,
    csum: u64,
    argmax_keys: u64,
    nseg: i32,
    ntiles: i32,
    tok_chunk: i32,
    k: i32,
    ntok: i32,
}
// SAFETY: plain-old-data mirroring `QmmDenseParams` in qmm.cu (size checked
// at compile time through QMM_DENSE_PARAMS_SIZE).
unsafe impl DeviceRepr for QmmDenseParamsC {}

#[repr(C)]
#[derive(Clone, Copy)]
struct QmmMoeParamsC {
    codes: u64,
    scales: u64,
    biases: u64,
    codes2: u64,
    scales2: u64,
    biases2: u64,
    sh_codes: u64,
    sh_scales: u64,
    sh_biases: u64,
    sh_codes2: u64,
    sh_scales2: u64,
    sh_biases2: u64,
    x: u64,
    csum: u64,
    plan: u64,
    act_out: u64,
    y_out: u64,
    max_items: i32,
    up: i32,
    npairs: i32,
    smem_items: i32,
}
// SAFETY: plain-old-data mirroring `QmmMoeParams` in qmm.cu (size checked).
unsafe impl DeviceRepr for QmmMoeParamsC {}

#[repr(C)]
#[derive(Clone, Copy)]
struct XnormParamsC {
    h: u64,
    y: u64,
    topk_w: u64,
    gain: u64,
    px: u64,
    csum: u64,
    gain16: u64,
    xn16: u64,
    cols: i32,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `XnormParams` in qmm.cu (size checked).
unsafe impl DeviceRepr for XnormParamsC {}

#[repr(C)]
#[derive(Clone, Copy)]
struct RouterParamsC {
    codes: u64,
    scales: u64,
    biases: u64,
    sg_codes: u64,
    sg_scales: u64,
    sg_biases: u64,
    h: u64,
    gain: u64,
    logits: u64,
    sg: u64,
    px: u64,
    csum: u64,
    topk_idx: u64,
    topk_w: u64,
    plan: u64,
    ticket: u64,
    ntok: i32,
    chunk: i32,
    max_items: i32,
    eps: f32,
    tok_chunk: i32,
    pad_: i32,
}
// SAFETY: plain-old-data mirroring `RouterParams` in qmm.cu (size checked).
unsafe impl DeviceRepr for RouterParamsC {}

/// Where column `col` of a packed activation row (hi or lo half) is stored:
/// within each 8 columns, column j at j's three bits reversed (the order
/// 0,4,2,6,1,5,3,7). The mirror of `px_perm` in common.cuh, for the tests
/// that read packed rows back.
pub fn px_position(col: usize) -> usize {
    let j = col & 7;
    (col & !7) | ((j & 1) << 2) | (j & 2) | (j >> 2)
}

/// Tokens one router block stages and routes at a step of `ntok` tokens.
/// A warp takes its row against its chunk's tokens one after another, so
/// more chunks (more blocks) shorten that chain, at the price of a second
/// ticket (the last chunk plans from the published top-k). Measured on the
/// H200 (NOTES.md, history 37), ms a step: batch 8 4.738 (one chunk) ->
/// 4.720 (4 chunks) -> 4.553 (8 chunks of 1); batch 4 3.139 -> 3.099
/// (chunks of 1); batch 16 6.839 (2 chunks) -> 6.754 (4) -> 6.868 (8);
/// batch 2 2.650 (one chunk) -> 2.667 (two). So: one chunk up to 2 tokens,
/// one token a chunk up to `ROUTER_TOK`, then 4 chunks until they hold
/// `ROUTER_TOK` each. The logits do not depend on the chunking.
pub fn router_tok_chunk(ntok: usize) -> usize {
    if ntok <= 2 {
        ntok.max(1)
    } else if ntok <= ROUTER_TOK {
        1
    } else {
        ntok.div_ceil(4).min(ROUTER_TOK)
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct MoeFusedParamsC {
    r: RouterParamsC,
    up: QmmMoeParamsC,
    down: QmmMoeParamsC,
    barrier: u64,
    trace: u64,
}
// SAFETY: plain-old-data mirroring `MoeFusedParams` in qmm.cu (size checked).
unsafe impl DeviceRepr for MoeFusedParamsC {}

/// How a dense launch reads its packed activations (qmm.cu
/// `stage_math_groups`): `HiLo`, both fp16 halves (about fp32 precision),
/// 4 tokens an n-tile; `F16`, the hi halves only (x rounded to fp16 once),
/// 8 tokens an n-tile (two of them for 9-16 tokens), at most
/// `state::F16_MAX_TOK` tokens a launch.
/// `DecodeMatrices::dense_x` picks it for a decode step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XPrecision {
    HiLo,
    F16,
}

impl XPrecision {
    /// Tokens an n-tile holds.
    fn tokens_per_tile(self) -> usize {
        match self {
            XPrecision::HiLo => 4,
            XPrecision::F16 => 8,
        }
    }
    /// Accumulators a lane keeps per n-tile (qmm.cu `QMM_ACC`): the
    /// partial sums' floats a lane leaves in shared memory per n-tile.
    fn accs(self) -> usize {
        match self {
            XPrecision::HiLo => 2,
            XPrecision::F16 => 4,
        }
    }
}

/// A dense launch's entry point (`QmmShape::dense_variant`): its name, the
/// n-tiles a warp keeps, the stages of a warp's ring, the warps of a block
/// and how it reads x.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DenseVariant {
    name: &'static str,
    nt: usize,
    ring: usize,
    warps: usize,
    x: XPrecision,
}

/// The block shape of the matrix kernels: warps a block and weight stages a
/// warp's ring holds. Compiled into the kernels (`defines`) and read by the
/// launchers from `Kernels::qmm`, so the two always agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QmmShape {
    pub warps: usize,
    pub ring: usize,
    /// The dense kernels' ring (`QMM_DENSE_RING`).
    pub dense_ring: usize,
    /// The dense kernels' ring at 5-8 tokens (`QMM_DENSE2_RING`).
    pub dense2_ring: usize,
    /// The lm_head's ring from 5 tokens (`QMM_HEAD_RING`).
    pub head_ring: usize,
    /// The one-token expert kernel's ring (`QMM_ONE_TOKEN_RING`).
    pub one_token_ring: usize,
    /// Columns of K a warp slice of a task takes (`QMM_SLICE_COLS`).
    pub slice_cols: usize,
    /// Slices a wide matrix's task is split into (`QMM_WIDE_KQ`).
    pub wide_kq: usize,
    /// The wide entries' ring (`QMM_WIDE_RING`).
    pub wide_ring: usize,
    /// Tokens from which an MoE plan item holds up to 8 pairs (qmm_moe_2)
    /// instead of 4 (`MOE_PAIRS8_FROM`). A launcher choice, not compiled in.
    pub moe_pairs8_from: usize,
    /// Tokens up to which the experts run `qmm_moe_1_occ3`
    /// (`MOE_OCC3_UPTO`). A launcher choice, not compiled in.
    pub moe_occ3_upto: usize,
}

impl Default for QmmShape {
    fn default() -> Self {
        QmmShape {
            warps: QMM_WARPS,
            ring: QMM_RING,
            dense_ring: QMM_DENSE_RING,
            dense2_ring: QMM_DENSE2_RING,
            head_ring: QMM_HEAD_RING,
            one_token_ring: QMM_ONE_TOKEN_RING,
            slice_cols: QMM_SLICE_COLS,
            wide_kq: QMM_WIDE_KQ,
            wide_ring: QMM_WIDE_RING,
            moe_pairs8_from: MOE_PAIRS8_FROM,
            moe_occ3_upto: MOE_OCC3_UPTO,
        }
    }
}

impl QmmShape {
    pub fn defines(&self) -> Vec<String> {
        vec![
            format!("-DQMM_RING={}", self.ring),
            format!("-DQMM_DENSE_RING={}", self.dense_ring),
            format!("-DQMM_DENSE2_RING={}", self.dense2_ring),
            format!("-DQMM_HEAD_RING={}", self.head_ring),
            format!("-DQMM_ONE_TOKEN_RING={}", self.one_token_ring),
            format!("-DQMM_WARPS={}", self.warps),
            format!("-DQMM_SG={QMM_SG}"),
            format!("-DQMM_SLICE_COLS={}", self.slice_cols),
            format!("-DQMM_WIDE_K={QMM_WIDE_K}"),
            format!("-DQMM_WIDE_KQ={}", self.wide_kq),
            format!("-DQMM_WIDE_RING={}", self.wide_ring),
            format!("-DQMM_STAGE_BYTES={QMM_STAGE_BYTES}"),
        ]
    }
    /// Warps sharing one task of a K-wide matrix (qmm.cu `KSplit`).
    fn warps_per_task(&self, k: usize) -> usize {
        if k >= QMM_WIDE_K {
            self.wide_kq
        } else {
            (k / self.slice_cols).clamp(1, self.warps)
        }
    }
    /// `rings_and_partials` of a block of `warps` warps (qmm_moe_fused runs
    /// 8) with the experts' ring.
    fn smem_bytes_for(&self, warps: usize, nt: usize) -> usize {
        Self::rings_and_partials(warps, self.ring, nt, XPrecision::HiLo)
    }
    /// The dense entry point for `ntok` tokens of input width `k`
    /// (`logits`: a launch with the lm_head's epilogue): its n-tiles (4
    /// tokens each) a warp keeps, its ring and its block's warps. More
    /// tokens than 8 run in chunks of 8 (chunks of 16, 4 n-tiles at 184
    /// registers, measured no faster at 16 or 64 tokens: NOTES.md, qmm v9).
    /// Past 8 tokens (the batch-invariant path) the matrices other than the
    /// lm_head keep `dense_ring`: rings of 6 made them slower at 64 tokens
    /// (`qmm_probe`, session 36: in-projection 67.4 -> 75.7 us). A wide
    /// matrix (`QMM_WIDE_K`) takes the `*_wide` entry of the same n-tiles:
    /// blocks of `wide_kq` warps, rings of `wide_ring`. None: a wide logits
    /// matrix (there is no wide lm_head entry).
    fn dense_variant(&self, ntok: usize, logits: bool, k: usize, x: XPrecision) -> Option<DenseVariant> {
        if x == XPrecision::F16 {
            // One n-tile of 8 tokens, or two for 9-16 (the launcher refuses
            // more), on the rings of the 5-8-token entries they replace;
            // the wide matrices in chunks of 8 (no two-n-tile wide entry:
            // it spills in 16-warp blocks).
            let f = |name, nt, ring, warps| Some(DenseVariant { name, nt, ring, warps, x });
            let two = ntok > 8;
            return match (k >= QMM_WIDE_K, logits) {
                (true, true) => None,
                (true, false) => f("qmm_dense_f16_wide", 1, self.wide_ring, self.wide_kq),
                (false, true) if two => f("qmm_dense_f16_2_head", 2, self.head_ring, self.warps),
                (false, true) => f("qmm_dense_f16_head", 1, self.head_ring, self.warps),
                (false, false) if two => f("qmm_dense_f16_2", 2, self.dense2_ring, self.warps),
                (false, false) => f("qmm_dense_f16", 1, self.dense2_ring, self.warps),
            };
        }
        let v = |name, nt, ring, warps| Some(DenseVariant { name, nt, ring, warps, x });
        if k >= QMM_WIDE_K {
            return match (ntok, logits) {
                (_, true) => None,
                (0..=4, false) => v("qmm_dense_1_wide", 1, self.wide_ring, self.wide_kq),
                (5..=8, false) => v("qmm_dense_2_wide", 2, self.wide_ring, self.wide_kq),
                _ => v("qmm_dense_2_chunks_wide", 2, self.wide_ring, self.wide_kq),
            };
        }
        match (ntok, logits) {
            (0..=4, _) => v("qmm_dense_1", 1, self.dense_ring, self.warps),
            (_, true) => v("qmm_dense_2_head", 2, self.head_ring, self.warps),
            (5..=8, false) => v("qmm_dense_2", 2, self.dense2_ring, self.warps),
            _ => v("qmm_dense_2_chunks", 2, self.dense_ring, self.warps),
        }
    }
    /// Dynamic shared memory of a matrix block: per warp its weight ring of
    /// `ring` stages, then the partial sums of every warp (qmm.cu `qmm_run`:
    /// `x.accs()` floats a lane and n-tile).
    fn rings_and_partials(warps: usize, ring: usize, nt: usize, x: XPrecision) -> usize {
        warps * ring * QMM_STAGE_BYTES + warps * nt * 32 * x.accs() * 4
    }
}

/// The defines qmm.cu needs beyond the model dimensions and the block shape.
pub fn defines(dims: &Dims) -> Vec<String> {
    vec![
        format!("-DQMM_MAX_TOK={MAX_DECODE_BATCH}"),
        format!("-DQMM_MAX_SEGS={QMM_MAX_SEGS}"),
        format!("-DXN_MAX_COLS={}", xnorm_max_cols(dims)),
        format!("-DQMM_SEG_SIZE={}", size_of::<QmmSegC>()),
        format!("-DQMM_DENSE_PARAMS_SIZE={}", size_of::<QmmDenseParamsC>()),
        format!("-DQMM_MOE_PARAMS_SIZE={}", size_of::<QmmMoeParamsC>()),
        format!("-DXNORM_PARAMS_SIZE={}", size_of::<XnormParamsC>()),
        format!("-DROUTER_PARAMS_SIZE={}", size_of::<RouterParamsC>()),
        format!("-DROUTER_SMEM={}", router_smem(dims)),
        format!("-DROUTER_MMA_SMEM={}", router_mma_smem(dims)),
        format!("-DROUTER_MMA_ROWS={ROUTER_MMA_ROWS}"),
        format!("-DROUTER_ROWS={ROUTER_ROWS}"),
        format!("-DROUTER_TOK={ROUTER_TOK}"),
        format!("-DXN_THREADS={XN_THREADS}"),
        format!("-DMOE_FUSED_TOK={MOE_FUSED_TOK}"),
        format!("-DMOE_FUSED_WARPS={MOE_FUSED_WARPS}"),
        format!("-DMOE_FUSED_PLAN_BYTES={}", fused_plan_bytes(dims)),
        format!("-DMOE_FUSED_PARAMS_SIZE={}", size_of::<MoeFusedParamsC>()),
        format!("-DMOE_TRACE_WORDS={MOE_TRACE_WORDS}"),
    ]
}

/// Shared memory `qmm_moe_fused` keeps its plan in: the items and pairs of
/// `MOE_FUSED_TOK` tokens (16-byte aligned, the rings follow it).
fn fused_plan_bytes(dims: &Dims) -> usize {
    (4 * (3 * max_plan_items(dims, MOE_FUSED_TOK) + MOE_FUSED_TOK * (dims.topk + 1))).next_multiple_of(16)
}

/// Stamps `qmm_moe_fused` writes for each block when traced: 8 points, a
/// %globaltimer and an SM clock each (qmm.cu `moe_stamp`).
pub const MOE_TRACE_WORDS: usize = 16;

/// Blocks of a `qmm_moe_fused` launch. Every block must be resident at once
/// (they wait for each other): as many as the occupancy allows on every SM,
/// the same for every launch (the barrier counter relies on it), never more.
pub fn moe_fused_grid(gpu: &Gpu, k: &Kernels, dims: &Dims) -> CudaResult<u32> {
    grid(gpu, k, "qmm_moe_fused", (MOE_FUSED_WARPS * 32) as u32, fused_smem(dims, &k.qmm), 0)
}

/// Dynamic shared memory of `qmm_moe_fused`: the plan, then one region the
/// router's staging, the top-k tables and the 8 warps' rings take in turn.
fn fused_smem(dims: &Dims, shape: &QmmShape) -> usize {
    fused_plan_bytes(dims) + router_smem(dims).max(shape.smem_bytes_for(MOE_FUSED_WARPS, 1))
}

/// Widest row `xnorm` packs: the hidden state or a mixer output.
fn xnorm_max_cols(dims: &Dims) -> usize {
    dims.hidden.max(dims.mix_dim())
}

/// The entry points, for kernels.rs.
pub const KERNELS: &[&str] = &[
    "xnorm",
    "qmm_dense_1",
    "qmm_dense_2",
    "qmm_dense_2_head",
    "qmm_dense_2_chunks",
    "qmm_dense_1_wide",
    "qmm_dense_2_wide",
    "qmm_dense_2_chunks_wide",
    "qmm_dense_f16",
    "qmm_dense_f16_head",
    "qmm_dense_f16_wide",
    "qmm_dense_f16_2",
    "qmm_dense_f16_2_head",
    "qmm_moe_1",
    "qmm_moe_1_occ3",
    "qmm_moe_2",
    "qmm_moe_f16",
    "moe_router",
    "moe_router_mma",
    "qmm_moe_fused",
];

/// n-tiles of the MoE variant for a step of `ntok` tokens whose experts read
/// x as `x` says; an expert's pairs are cut into plan items of
/// `moe_chunk(ntok, x)` pairs. fp16 x: one n-tile of 8 tokens.
fn moe_nt(shape: &QmmShape, ntok: usize, x: XPrecision) -> usize {
    if x == XPrecision::F16 || ntok < shape.moe_pairs8_from {
        1
    } else {
        2
    }
}

/// The MoE kernel of a step of `ntok` tokens (its n-tiles: `moe_nt`) and
/// the stages of its warps' rings.
fn moe_kernel(shape: &QmmShape, ntok: usize, x: XPrecision) -> (&'static str, usize) {
    if x == XPrecision::F16 {
        return ("qmm_moe_f16", shape.ring);
    }
    match moe_nt(shape, ntok, x) {
        1 if ntok <= shape.moe_occ3_upto => ("qmm_moe_1_occ3", shape.one_token_ring),
        1 => ("qmm_moe_1", shape.ring),
        _ => ("qmm_moe_2", shape.ring),
    }
}

/// Pairs per plan item for a step of `ntok` tokens with the kernels' shape
/// and the experts' x (what the router's plan and the MoE launch must agree
/// on).
pub fn moe_chunk(shape: &QmmShape, ntok: usize, x: XPrecision) -> usize {
    x.tokens_per_tile() * moe_nt(shape, ntok, x)
}

/// Plan items a step of up to `max_batch` tokens may need: the shared
/// expert's chunks plus at most one item per routed pair.
pub fn max_plan_items(dims: &Dims, max_batch: usize) -> usize {
    max_batch.div_ceil(4) + max_batch * dims.topk
}

/// Ints of the plan buffer for `max_batch` tokens.
pub fn plan_ints(dims: &Dims, max_batch: usize) -> usize {
    PLAN_HEAD + 3 * max_plan_items(dims, max_batch) + max_batch * (dims.topk + 1)
}

/// Blocks of a persistent grid: as many as fit on the GPU at once, at most
/// `tasks` (0 = unknown until the kernel runs).
fn grid(gpu: &Gpu, k: &Kernels, name: &'static str, threads: u32, smem: usize, tasks: usize) -> CudaResult<u32> {
    let per_sm = k.get(name)?.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None).ctx(name)?.max(1);
    let full = gpu.sm_count as usize * per_sm as usize;
    Ok(if tasks == 0 { full } else { full.min(tasks) }.max(1) as u32)
}

/// What a dense launch does with a matrix's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// out[t * stride + r] = y
    Store,
    /// out[t * stride + r] += y (the residual add)
    Add,
    /// Store, and fold every row into the per-token greedy argmax keys.
    Logits,
}

/// One matrix of a dense launch.
#[derive(Clone, Copy)]
pub struct DenseSeg<'a> {
    pub w: &'a QMat,
    pub out: DevSlice<f32>,
    pub out_stride: usize,
    pub epilogue: Epilogue,
}

/// Packed activations: `rows` x [hi | lo] x `cols` halves (qmm.cu).
pub fn packed_len(rows: usize, cols: usize) -> usize {
    rows * 2 * cols
}

/// A qmm input: packed activation rows and their group sums (f32
/// [rows][cols / 64]), written together by the packing kernels.
#[derive(Clone, Copy, Debug)]
pub struct PackedRows {
    pub px: DevSlice<u16>,
    pub csum: DevSlice<f32>,
}

impl PackedRows {
    /// (packed, sums) addresses after checking both hold `rows` rows of `cols`.
    fn need(&self, kernel: &'static str, what: &str, rows: usize, cols: usize) -> CudaResult<(u64, u64)> {
        Ok((self.px.need(kernel, what, packed_len(rows, cols))?, self.csum.need(kernel, what, rows * (cols / 64))?))
    }
}

/// y = W x for every matrix of `segs` (same input width) and the first
/// `ntok` rows of the packed input `x`, read as `xprec` says (`XPrecision::F16`
/// takes at most `state::F16_MAX_TOK` tokens).
pub fn dense(gpu: &Gpu, k: &Kernels, segs: &[DenseSeg], x: PackedRows, ntok: usize, xprec: XPrecision, argmax_keys: Option<DevSlice<u64>>) -> CudaResult<()> {
    const NAME: &str = "qmm_dense";
    if segs.is_empty() || segs.len() > QMM_MAX_SEGS {
        return Err(CudaError::shape(NAME, format!("{} matrices, expected 1..={QMM_MAX_SEGS}", segs.len())));
    }
    if ntok == 0 || ntok > MAX_DECODE_BATCH {
        return Err(CudaError::shape(NAME, format!("{ntok} tokens, expected 1..={MAX_DECODE_BATCH}")));
    }
    if xprec == XPrecision::F16 && ntok > crate::state::F16_MAX_TOK {
        return Err(CudaError::shape(NAME, format!("{ntok} tokens on fp16 activations, expected 1..={} (two n-tiles)", crate::state::F16_MAX_TOK)));
    }
    let kdim = segs[0].w.cols;
    if !kdim.is_multiple_of(64) {
        return Err(CudaError::shape(NAME, format!("input width {kdim} is not a multiple of 64")));
    }
    let (xp, xc) = x.need(NAME, "packed input", ntok, kdim)?;
    let mut p = QmmDenseParamsC {
        seg: [QmmSegC::default(); QMM_MAX_SEGS],
        x: xp,
        csum: xc,
        argmax_keys: 0,
        nseg: segs.len() as i32,
        ntiles: 0,
        tok_chunk: 0,
        k: kdim as i32,
        ntok: ntok as i32,
    };
    let mut tiles = 0usize;
    let mut logits = false;
    for (i, s) in segs.iter().enumerate() {
        let w = s.w;
        if w.cols != kdim || w.bits != 4 || w.experts != 1 {
            return Err(CudaError::shape(
                NAME,
                format!("matrix {i}: {}x{} {}-bit, {} experts; expected {kdim} columns, 4-bit, one expert", w.rows, w.cols, w.bits, w.experts),
            ));
        }
        if s.out_stride < w.rows {
            return Err(CudaError::shape(NAME, format!("matrix {i}: output stride {} < {} rows", s.out_stride, w.rows)));
        }
        let out = s.out.need(NAME, "output", (ntok - 1) * s.out_stride + w.rows)?;
        logits |= s.epilogue == Epilogue::Logits;
        p.seg[i] = QmmSegC {
            codes: w.codes,
            scales: w.scales,
            biases: w.biases,
            out,
            rows: w.rows as i32,
            out_stride: s.out_stride as i32,
            tile_start: tiles as i32,
            mode: match s.epilogue {
                Epilogue::Store => 0,
                Epilogue::Add => 1,
                Epilogue::Logits => 2,
            },
        };
        tiles += w.rows.div_ceil(16);
    }
    if logits {
        let keys = argmax_keys.ok_or_else(|| CudaError::shape(NAME, "a logits matrix needs the argmax key buffer"))?;
        p.argmax_keys = keys.need(NAME, "argmax keys", ntok)?;
    }
    let DenseVariant { name, nt, ring, warps, x: xprec } = k
        .qmm
        .dense_variant(ntok, logits, kdim, xprec)
        .ok_or_else(|| CudaError::shape(NAME, format!("a logits matrix of input width {kdim}: the lm_head entry takes widths below {QMM_WIDE_K}")))?;
    let chunk = xprec.tokens_per_tile() * nt;
    p.ntiles = tiles as i32;
    p.tok_chunk = chunk as i32;
    let tasks = tiles * ntok.div_ceil(chunk);
    let threads = (warps * 32) as u32;
    let smem = QmmShape::rings_and_partials(warps, ring, nt, xprec);
    let g = grid(gpu, k, name, threads, smem, tasks.div_ceil(warps / k.qmm.warps_per_task(kdim)))?;
    launch_pdl(gpu, k, name, (g, 1, 1), threads, smem, &p)
}

/// The packed-input rows of one step's MoE, and where its outputs go.
#[derive(Clone, Copy, Debug)]
pub struct MoeBufs {
    /// Packed RMSNorm(h) (post-attention norm) [ntok][2][hidden] and its
    /// group sums, written by `router`.
    pub px_in: PackedRows,
    /// Packed SwiGLU activations [ntok * slots][2][moe_inter].
    pub px_act: DevSlice<u16>,
    /// Expert outputs [ntok * slots][hidden] (slot topk = the shared expert).
    pub y: DevSlice<f32>,
    pub logits: DevSlice<f32>,
    pub sg: DevSlice<f32>,
    pub topk_idx: DevSlice<i32>,
    /// [ntok][slots]: the routing weights, then sigmoid(shared gate).
    pub topk_w: DevSlice<f32>,
    pub plan: DevSlice<i32>,
    /// 1 + token chunks ints, zero between launches.
    pub ticket: DevSlice<i32>,
    /// The grid barrier of `moe_fused` (a counter that only grows).
    pub barrier: DevSlice<u64>,
    /// Plan capacity (`max_plan_items` of the plan's batch size).
    pub max_items: usize,
}

/// How the router computes its 257 dot products a token. Both kernels
/// stage, pack and plan with the same code (so the experts' packed input
/// and the plan's construction are the same); the logits agree to ~1e-7.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterMath {
    /// `moe_router`: one fp32 FMA chain a (row, token) on the CUDA cores;
    /// a token's logits are the same bits at every batch size.
    CudaCores,
    /// `moe_router_mma`: mma.sync on the exact hi/lo activations, a block
    /// of 16 rows against 8 tokens (`Options::router_mma_from`).
    TensorCores,
}

/// Router logits, shared-expert gate, top-k and the step's expert plan for
/// `ntok` tokens whose residual stream is `h`; also packs RMSNorm(h) for the
/// experts.
#[allow(clippy::too_many_arguments)]
pub fn router(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    m: &MoeDev,
    post_norm: u64,
    h: DevSlice<f32>,
    b: &MoeBufs,
    ntok: usize,
    x: XPrecision,
    math: RouterMath,
) -> CudaResult<()> {
    let (name, rows, smem) = match math {
        RouterMath::CudaCores => ("moe_router", ROUTER_ROWS, router_smem(dims)),
        RouterMath::TensorCores => ("moe_router_mma", ROUTER_MMA_ROWS, router_mma_smem(dims)),
    };
    if math == RouterMath::TensorCores && !router_mma_fits(dims) {
        return Err(CudaError::shape(
            name,
            format!("hidden {} in groups of {}: compiled for {} columns in groups of 64", dims.hidden, dims.group_size, ROUTER_ROWS * 256),
        ));
    }
    let p = router_params(k, dims, m, post_norm, h, b, ntok, x)?;
    let blocks = (dims.n_experts + 1).div_ceil(rows) as u32;
    let chunks = ntok.div_ceil(p.tok_chunk as usize);
    b.ticket.need(name, "tickets", 1 + chunks)?;
    launch_pdl(gpu, k, name, (blocks, chunks as u32, 1), (ROUTER_ROWS * 32) as u32, smem, &p)
}

/// The router's parameters, every buffer checked.
#[allow(clippy::too_many_arguments)]
fn router_params(k: &Kernels, dims: &Dims, m: &MoeDev, post_norm: u64, h: DevSlice<f32>, b: &MoeBufs, ntok: usize, x: XPrecision) -> CudaResult<RouterParamsC> {
    const NAME: &str = "moe_router";
    if ntok == 0 || ntok > MAX_DECODE_BATCH {
        return Err(CudaError::shape(NAME, format!("{ntok} tokens, expected 1..={MAX_DECODE_BATCH}")));
    }
    let (e, hd) = (dims.n_experts, dims.hidden);
    if m.router.rows != e || m.router.cols != hd || m.router.bits != 8 || m.sh_expert_gate.rows != 1 || m.sh_expert_gate.bits != 8 {
        return Err(CudaError::shape(
            NAME,
            format!(
                "router {}x{} {}-bit, shared gate {} rows {}-bit; expected {e}x{hd} and 1 row, 8-bit",
                m.router.rows, m.router.cols, m.router.bits, m.sh_expert_gate.rows, m.sh_expert_gate.bits
            ),
        ));
    }
    if b.max_items < max_plan_items(dims, ntok) {
        return Err(CudaError::shape(NAME, format!("plan holds {} items, {} tokens may need {}", b.max_items, ntok, max_plan_items(dims, ntok))));
    }
    let slots = dims.topk + 1;
    let px_in = b.px_in.need(NAME, "packed input", ntok, hd)?;
    let h = h.need(NAME, "residual", ntok * hd)?;
    // The kernel reads the residual and the norm gain 16 bytes at a time.
    if !h.is_multiple_of(16) || !post_norm.is_multiple_of(16) {
        return Err(CudaError::shape(NAME, format!("residual at {h:#x}, norm gain at {post_norm:#x}: both must be 16-byte aligned")));
    }
    let p = RouterParamsC {
        codes: m.router.codes,
        scales: m.router.scales,
        biases: m.router.biases,
        sg_codes: m.sh_expert_gate.codes,
        sg_scales: m.sh_expert_gate.scales,
        sg_biases: m.sh_expert_gate.biases,
        h,
        gain: post_norm,
        logits: b.logits.need(NAME, "router logits", ntok * e)?,
        sg: b.sg.need(NAME, "shared gate", ntok)?,
        px: px_in.0,
        csum: px_in.1,
        topk_idx: b.topk_idx.need(NAME, "top-k ids", ntok * dims.topk)?,
        topk_w: b.topk_w.need(NAME, "top-k weights", ntok * slots)?,
        plan: b.plan.need(NAME, "plan", PLAN_HEAD + 3 * b.max_items + ntok * slots)?,
        ticket: b.ticket.need(NAME, "ticket", 1)?,
        ntok: ntok as i32,
        chunk: moe_chunk(&k.qmm, ntok, x) as i32,
        max_items: b.max_items as i32,
        eps: dims.rms_eps,
        tok_chunk: router_tok_chunk(ntok) as i32,
        pad_: 0,
    };
    Ok(p)
}

/// Dynamic shared memory of `moe_router` (qmm.cu): the staged tokens (padded
/// rows) with their 16-column sums and the norm gain (a padded row); later,
/// in a chunk's last block, the top-k tables followed (in the plan's block)
/// by the selection bitmap, one bit per (token, slot) of up to
/// `MAX_DECODE_BATCH` tokens for every expert.
pub fn router_smem(dims: &Dims) -> usize {
    let padded = dims.hidden + dims.hidden / 32 * 4;
    let stage = (ROUTER_TOK * (padded + dims.hidden / 16) + padded) * 4;
    stage.max(router_tail_smem(dims))
}

/// Whether `moe_router_mma` runs for this model: a warp of its 8 takes 256
/// columns, 4 quantisation groups (qmm.cu `RM_FITS`); the model's width is
/// 2,048, the tiny test models' less.
pub fn router_mma_fits(dims: &Dims) -> bool {
    dims.hidden == ROUTER_ROWS * 256 && dims.group_size == 64
}

/// Dynamic shared memory of `moe_router_mma` (qmm.cu): the chunk's staged
/// hi and lo rows (`ROUTER_TOK` tokens, rows of hidden + 8 halves), their
/// group sums, the warps' partial logits (`ROUTER_ROWS` warps x 16 rows x
/// `ROUTER_TOK` tokens); later, as in `moe_router`, the top-k tables and
/// the selection bitmap over the same bytes.
pub fn router_mma_smem(dims: &Dims) -> usize {
    let staged = 2 * ROUTER_TOK * (dims.hidden + 8) * 2;
    let sums = ROUTER_TOK * (dims.hidden / dims.group_size) * 4;
    let partials = ROUTER_ROWS * ROUTER_MMA_ROWS * ROUTER_TOK * 4;
    (staged + sums + partials).max(router_tail_smem(dims))
}

/// Shared memory of both routers' tail (qmm.cu `router_route_and_plan`):
/// a chunk's last block's top-k tables, then the plan's selection bitmap,
/// one bit per (token, slot) of up to `MAX_DECODE_BATCH` tokens for every
/// expert.
fn router_tail_smem(dims: &Dims) -> usize {
    let topk = (ROUTER_ROWS * dims.n_experts + 2 * ROUTER_ROWS * dims.topk) * 4;
    let bitmap = (MAX_DECODE_BATCH * dims.topk).div_ceil(32) * dims.n_experts * 4;
    topk + bitmap
}

/// The experts of one step as planned by `router`: `up` = the gate/up
/// projections with SwiGLU (packed into `px_act`), else the down projections
/// (into `y`). The shared expert runs as one more expert taking every token.
/// `x`: the activations as the router planned for (`moe_chunk`): exact
/// hi/lo halves, or the hi halves alone (`qmm_moe_f16`, items of 8 pairs).
#[allow(clippy::too_many_arguments)]
pub fn experts(gpu: &Gpu, k: &Kernels, dims: &Dims, m: &MoeDev, up: bool, b: &MoeBufs, ntok: usize, x: XPrecision) -> CudaResult<()> {
    let (p, nt) = moe_params(k, dims, m, up, b, ntok, x)?;
    let (name, ring) = moe_kernel(&k.qmm, ntok, x);
    let rings = QmmShape::rings_and_partials(k.qmm.warps, ring, nt, x);
    let threads = (k.qmm.warps * 32) as u32;
    let smem = rings + (3 * p.smem_items as usize + p.npairs as usize) * 4;
    let g = grid(gpu, k, name, threads, smem, 0)?;
    launch_pdl(gpu, k, name, (g, 1, 1), threads, smem, &p)
}

/// The parameters of one expert launch (`up`: gate/up, else down), every
/// buffer checked, and the n-tiles of its variant.
fn moe_params(k: &Kernels, dims: &Dims, m: &MoeDev, up: bool, b: &MoeBufs, ntok: usize, xprec: XPrecision) -> CudaResult<(QmmMoeParamsC, usize)> {
    const NAME: &str = "qmm_moe";
    if ntok == 0 || ntok > MAX_DECODE_BATCH {
        return Err(CudaError::shape(NAME, format!("{ntok} tokens, expected 1..={MAX_DECODE_BATCH}")));
    }
    let (hd, inter, e) = (dims.hidden, dims.moe_inter, dims.n_experts);
    let expect = |w: &QMat, rows: usize, cols: usize, experts: usize| w.rows == rows && w.cols == cols && w.experts == experts && w.bits == 4;
    let ok = if up {
        expect(&m.gate, inter, hd, e) && expect(&m.up, inter, hd, e) && expect(&m.sh_gate, inter, hd, 1) && expect(&m.sh_up, inter, hd, 1)
    } else {
        expect(&m.down, hd, inter, e) && expect(&m.sh_down, hd, inter, 1)
    };
    if !ok {
        return Err(CudaError::shape(NAME, format!("expert matrices do not match {e} experts of {inter}x{hd} (4-bit) and a shared expert")));
    }
    let slots = dims.topk + 1;
    let pairs = ntok * slots;
    let (a, a2, s, s2) = if up { (&m.gate, &m.up, &m.sh_gate, &m.sh_up) } else { (&m.down, &m.down, &m.sh_down, &m.sh_down) };
    let (x, csum) = if up { b.px_in.need(NAME, "packed input", ntok, hd)? } else { (b.px_act.need(NAME, "packed activations", packed_len(pairs, inter))?, 0) };
    // The plan of `ntok` tokens has at most max_plan_items(ntok) items; each
    // block copies them and the pair list into shared memory.
    let smem_items = max_plan_items(dims, ntok).min(b.max_items);
    let p = QmmMoeParamsC {
        codes: a.codes,
        scales: a.scales,
        biases: a.biases,
        codes2: a2.codes,
        scales2: a2.scales,
        biases2: a2.biases,
        sh_codes: s.codes,
        sh_scales: s.scales,
        sh_biases: s.biases,
        sh_codes2: s2.codes,
        sh_scales2: s2.scales,
        sh_biases2: s2.biases,
        x,
        csum,
        plan: b.plan.need(NAME, "plan", PLAN_HEAD + 3 * b.max_items + pairs)?,
        act_out: if up { b.px_act.need(NAME, "packed activations", packed_len(pairs, inter))? } else { 0 },
        y_out: if up { 0 } else { b.y.need(NAME, "expert outputs", pairs * hd)? },
        max_items: b.max_items as i32,
        up: up as i32,
        npairs: pairs as i32,
        smem_items: smem_items as i32,
    };
    Ok((p, moe_nt(&k.qmm, ntok, xprec)))
}

/// The whole MoE of a step of up to `MOE_FUSED_TOK` tokens in one launch
/// (`qmm_moe_fused`): what `router` and both `experts` launches compute,
/// bit for bit, with grid-wide barriers instead of two kernel boundaries.
/// `trace`: speed probes only, `MOE_TRACE_WORDS` stamps for each block of
/// the grid (`moe_fused_grid`; qmm.cu `moe_stamp`).
#[allow(clippy::too_many_arguments)]
pub fn moe_fused(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    m: &MoeDev,
    post_norm: u64,
    h: DevSlice<f32>,
    b: &MoeBufs,
    ntok: usize,
    trace: Option<DevSlice<u64>>,
) -> CudaResult<()> {
    const NAME: &str = "qmm_moe_fused";
    if ntok == 0 || ntok > MOE_FUSED_TOK {
        return Err(CudaError::shape(NAME, format!("{ntok} tokens, expected 1..={MOE_FUSED_TOK}")));
    }
    // (The fused kernel stages every token in each router block: it reads
    // ntok, not tok_chunk.)
    let r = router_params(k, dims, m, post_norm, h, b, ntok, XPrecision::HiLo)?;
    let (up, nt_up) = moe_params(k, dims, m, true, b, ntok, XPrecision::HiLo)?;
    let (down, nt_down) = moe_params(k, dims, m, false, b, ntok, XPrecision::HiLo)?;
    if nt_up != 1 || nt_down != 1 || r.chunk != 4 {
        return Err(CudaError::shape(NAME, format!("{ntok} tokens plan items of {} pairs; the fused kernel runs items of 4", r.chunk)));
    }
    let plan_ints = 3 * up.smem_items as usize + up.npairs as usize;
    if plan_ints * 4 > fused_plan_bytes(dims) {
        return Err(CudaError::shape(NAME, format!("a plan of {plan_ints} ints exceeds the kernel's {} bytes", fused_plan_bytes(dims))));
    }
    let g = moe_fused_grid(gpu, k, dims)?;
    let trace = match trace {
        Some(t) => t.need(NAME, "trace", g as usize * MOE_TRACE_WORDS)?,
        None => 0,
    };
    let p = MoeFusedParamsC { r, up, down, barrier: b.barrier.need(NAME, "grid barrier", 1)?, trace };
    let threads = (MOE_FUSED_WARPS * 32) as u32;
    let smem = fused_smem(dims, &k.qmm);
    if (g as usize) * ROUTER_ROWS <= dims.n_experts {
        return Err(CudaError::shape(NAME, format!("{g} resident blocks cannot hold the router's {} rows", dims.n_experts + 1)));
    }
    launch_pdl(gpu, k, NAME, (g, 1, 1), threads, smem, &p)
}

/// Packs the first `ntok` rows of `h` (`cols` wide) for a qmm input:
/// optionally first h += sum_s w[t][s] y[t][s] (the previous MoE, written
/// back to h), then RMSNorm with `gain` (None: no norm).
#[allow(clippy::too_many_arguments)]
pub fn xnorm(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    h: DevSlice<f32>,
    cols: usize,
    combine: Option<(DevSlice<f32>, DevSlice<f32>)>,
    gain: Option<u64>,
    out: PackedRows,
    ntok: usize,
) -> CudaResult<()> {
    const NAME: &str = "xnorm";
    if ntok == 0 {
        return Ok(());
    }
    if !cols.is_multiple_of(64) || cols > xnorm_max_cols(dims) {
        return Err(CudaError::shape(NAME, format!("{cols} columns (a multiple of 64, at most {})", xnorm_max_cols(dims))));
    }
    let slots = dims.topk + 1;
    let (y, w) = match combine {
        Some((y, w)) => (y.need(NAME, "expert outputs", ntok * slots * cols)?, w.need(NAME, "slot weights", ntok * slots)?),
        None => (0, 0),
    };
    let packed = out.need(NAME, "packed output", ntok, cols)?;
    // The kernel reads the gain 16 bytes at a time.
    if let Some(g) = gain.filter(|g| !g.is_multiple_of(16)) {
        return Err(CudaError::shape(NAME, format!("norm gain at {g:#x}: must be 16-byte aligned")));
    }
    let p = XnormParamsC {
        h: h.need(NAME, "rows", ntok * cols)?,
        y,
        topk_w: w,
        gain: gain.unwrap_or(0),
        px: packed.0,
        csum: packed.1,
        gain16: 0,
        xn16: 0,
        cols: cols as i32,
        eps: dims.rms_eps,
    };
    launch_pdl(gpu, k, NAME, (ntok as u32, 1, 1), XN_THREADS, 0, &p)
}

/// The GEMM path's combine and norm in one launch: h += sum_s w[t][s]
/// y[t][s] (the previous MoE, as `xnorm` folds it) over the first `ntok`
/// rows of `h` (hidden wide), then `out` (fp16 [ntok][hidden]) =
/// RMSNorm(h) * gain with `gemm::rmsnorm_f16`'s bits; nothing is packed.
#[allow(clippy::too_many_arguments)]
pub fn combine_norm_f16(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    h: DevSlice<f32>,
    combine: (DevSlice<f32>, DevSlice<f32>),
    gain: u64,
    out: u64,
    ntok: usize,
) -> CudaResult<()> {
    const NAME: &str = "xnorm";
    if ntok == 0 {
        return Ok(());
    }
    let (cols, slots) = (dims.hidden, dims.topk + 1);
    let p = XnormParamsC {
        h: h.need(NAME, "rows", ntok * cols)?,
        y: combine.0.need(NAME, "expert outputs", ntok * slots * cols)?,
        topk_w: combine.1.need(NAME, "slot weights", ntok * slots)?,
        gain: 0,
        px: 0,
        csum: 0,
        gain16: gain,
        xn16: out,
        cols: cols as i32,
        eps: dims.rms_eps,
    };
    launch_pdl(gpu, k, NAME, (ntok as u32, 1, 1), XN_THREADS, 0, &p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_columns_pair_as_the_dequantisation_masks_them() {
        // Each 8-column block is a permutation, and the u32 words of a B
        // fragment (positions 2i, 2i + 1) hold the column pairs deq_word
        // makes from a code word: (0,4), (2,6) low nibbles, (1,5), (3,7) high.
        for base in [0usize, 8, 2040] {
            let mut seen = [false; 8];
            for c in base..base + 8 {
                let p = px_position(c);
                assert!(p >= base && p < base + 8, "column {c} leaves its block: {p}");
                seen[p - base] = true;
            }
            assert!(seen.iter().all(|s| *s), "block at {base} is not a permutation");
        }
        let word_of = |pair: [usize; 2]| pair.map(px_position);
        assert_eq!(word_of([0, 4]), [0, 1]);
        assert_eq!(word_of([2, 6]), [2, 3]);
        assert_eq!(word_of([1, 5]), [4, 5]);
        assert_eq!(word_of([3, 7]), [6, 7]);
    }

    #[test]
    fn moe_kernels_follow_the_shape() {
        let s = QmmShape::default();
        let hl = XPrecision::HiLo;
        assert_eq!(moe_kernel(&s, 1, hl), ("qmm_moe_1_occ3", s.one_token_ring));
        assert_eq!(moe_kernel(&s, 2, hl), ("qmm_moe_1", s.ring));
        assert_eq!(moe_kernel(&s, s.moe_pairs8_from, hl), ("qmm_moe_2", s.ring));
        assert_eq!((moe_chunk(&s, 2, hl), moe_chunk(&s, s.moe_pairs8_from, hl)), (4, 8));
        for n in 1..=MAX_DECODE_BATCH {
            for x in [hl, XPrecision::F16] {
                let (name, _) = moe_kernel(&s, n, x);
                assert!(KERNELS.contains(&name), "{n} tokens: {name} is not an entry point");
            }
            // fp16 x: one n-tile of 8 tokens, items of 8 pairs at every size.
            assert_eq!((moe_kernel(&s, n, XPrecision::F16).0, moe_chunk(&s, n, XPrecision::F16)), ("qmm_moe_f16", 8));
        }
    }

    #[test]
    fn dense_kernels_follow_the_shape_and_fit_an_sm() {
        let s = QmmShape::default();
        let of = |ntok, logits, k| s.dense_variant(ntok, logits, k, XPrecision::HiLo).map(|v| (v.name, v.nt, v.ring));
        assert_eq!(of(4, true, 2048), Some(("qmm_dense_1", 1, s.dense_ring)));
        assert_eq!(of(5, false, 2048), Some(("qmm_dense_2", 2, s.dense2_ring)));
        assert_eq!(of(8, true, 2048), Some(("qmm_dense_2_head", 2, s.head_ring)));
        assert_eq!(of(64, true, 2048), Some(("qmm_dense_2_head", 2, s.head_ring)));
        assert_eq!(of(9, false, 2048), Some(("qmm_dense_2_chunks", 2, s.dense_ring)));
        assert_eq!(of(1, false, QMM_WIDE_K), Some(("qmm_dense_1_wide", 1, s.wide_ring)));
        assert_eq!(of(8, false, QMM_WIDE_K), Some(("qmm_dense_2_wide", 2, s.wide_ring)));
        assert_eq!(of(9, false, QMM_WIDE_K), Some(("qmm_dense_2_chunks_wide", 2, s.wide_ring)));
        assert_eq!(of(1, true, QMM_WIDE_K), None, "no wide lm_head entry");
        let f16 = |ntok, logits, k| s.dense_variant(ntok, logits, k, XPrecision::F16).map(|v| (v.name, v.nt, v.ring));
        assert_eq!(f16(8, false, 2048), Some(("qmm_dense_f16", 1, s.dense2_ring)));
        assert_eq!(f16(8, true, 2048), Some(("qmm_dense_f16_head", 1, s.head_ring)));
        assert_eq!(f16(8, false, QMM_WIDE_K), Some(("qmm_dense_f16_wide", 1, s.wide_ring)));
        assert_eq!(f16(8, true, QMM_WIDE_K), None, "no wide lm_head entry");
        assert_eq!(f16(9, false, 2048), Some(("qmm_dense_f16_2", 2, s.dense2_ring)));
        assert_eq!(f16(16, true, 2048), Some(("qmm_dense_f16_2_head", 2, s.head_ring)));
        assert_eq!(f16(16, false, QMM_WIDE_K), Some(("qmm_dense_f16_wide", 1, s.wide_ring)), "wide: chunks of 8");
        let sizes = |xp| if xp == XPrecision::F16 { 1..=crate::state::F16_MAX_TOK } else { 1..=MAX_DECODE_BATCH };
        for xp in [XPrecision::HiLo, XPrecision::F16] {
            for n in sizes(xp) {
                for (logits, wide) in [(false, false), (true, false), (false, true)] {
                    let k = if wide { QMM_WIDE_K } else { 2048 };
                    let DenseVariant { name, nt, ring, warps, x } = s.dense_variant(n, logits, k, xp).expect("an entry point");
                    assert_eq!(x, xp, "{name}");
                    assert!(KERNELS.contains(&name), "{n} tokens: {name} is not an entry point");
                    assert_eq!(name.ends_with("_wide"), wide, "{name}");
                    assert_eq!(name.contains("_f16"), xp == XPrecision::F16, "{name}");
                    assert!(xp == XPrecision::HiLo || wide || x.tokens_per_tile() * nt >= n, "{name}: {n} tokens in one chunk");
                    assert_eq!(warps % s.warps_per_task(k), 0, "{name}: {warps} warps, {} a task", s.warps_per_task(k));
                    // Two blocks an SM (227 KiB a block at most, 1 KiB reserved
                    // each), and room beside them for a block of the kernel
                    // launched early after them.
                    let smem = QmmShape::rings_and_partials(warps, ring, nt, x);
                    assert!(2 * (smem + 1024) <= 228 << 10, "{name}: {smem} bytes of shared memory");
                    // A wide warp's ring holds its whole slice of a task.
                    if wide {
                        assert!(ring > (QMM_WIDE_K / 64 / s.wide_kq).div_ceil(QMM_SG), "{name}: ring {ring}");
                    }
                }
            }
        }
        // The K split: wide matrices by QMM_WIDE_KQ, the others by slices.
        assert_eq!((s.warps_per_task(4096), s.warps_per_task(2048), s.warps_per_task(512)), (QMM_WIDE_KQ, 2, 1));
    }

    #[test]
    fn router_chunks_fit_the_tickets_and_the_staging() {
        for n in 1..=MAX_DECODE_BATCH {
            let c = router_tok_chunk(n);
            assert!((1..=ROUTER_TOK).contains(&c), "{n} tokens: chunk {c}");
            // 1 + chunks tickets in the ticket buffer.
            assert!(n.div_ceil(c) < ROUTER_TICKETS, "{n} tokens: {} chunks", n.div_ceil(c));
        }
        assert_eq!(router_tok_chunk(1), 1);
        assert_eq!(router_tok_chunk(2), 2);
        assert_eq!(router_tok_chunk(8), 1);
        assert_eq!(router_tok_chunk(16), 4);
        assert_eq!(router_tok_chunk(64), ROUTER_TOK);
    }
}
