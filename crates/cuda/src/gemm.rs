//! Launchers of kernels/gemm.cu: the tensor-core GEMM with 4/8-bit weights
//! dequantised in the tile (dense and grouped by expert, one launch for up
//! to `GEMM_MAX_SEGS` matrices that share their input, deterministic
//! split-K), the reduction of the split-K partials, and the RMSNorm that
//! produces the GEMM's fp16 input.
//!
//! The tile constants are defined here and reach gemm.cu as defines
//! (`defines`); `plan_dense` is the one place a dense launch's tile height
//! and K splits are chosen, `moe::tile_rows` the one for the grouped expert
//! GEMMs.

use std::mem::size_of;

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::error::{CudaError, CudaResult};
use crate::kernels::Kernels;
use crate::launch::{launch, launch_maybe_pdl};
use crate::weights::QMat;

/// Heights (A rows) of the GEMM tiles, ascending. gemm.cu is compiled once
/// per height and bit width (entry points `gemm_q{4,8}_bm{BM}`), except
/// where `compiled` says not: `GEMM_WIDE_ROWS` is a 4-bit wgmma tile only.
pub const TILE_ROWS: [usize; 5] = [16, 32, 64, GEMM_TALL_ROWS, GEMM_WIDE_ROWS];
/// The tallest tile of both bit widths, and of the grouped expert GEMMs.
pub const GEMM_TALL_ROWS: usize = 128;
/// The 4-bit wgmma tile taller than `GEMM_TALL_ROWS`, for dense passes of
/// 257-288 rows only (a 256-token chat turn with its template): two tiles
/// of 144 instead of three of 128, each W tile dequantised once per tile.
/// Measured on the H200 (prefill A/B, crates/cuda/NOTES.md history 127):
/// 265 tokens +2.2%; wherever it saved a tile of more (4 -> 3 at 400
/// tokens, 8 -> 7 at 1,000) or made one tile of two (140) the pass was
/// 0.9-2.2% slower (its k-tile runs as two wgmma groups to fit 128
/// registers, and 12% more tensor work a tile), and the experts' tiles at
/// 3,000 tokens 2% slower: those keep 128.
pub const GEMM_WIDE_ROWS: usize = 144;
/// Resident blocks per SM each height is compiled for (launch bounds: at
/// most 65536 / (256 * n) registers a thread). The short tiles hold few
/// accumulators and little shared memory, so more of them share an SM and
/// hide each other's weight loads.
const TILE_MIN_BLOCKS: [usize; 5] = [4, 3, 2, 2, 2];
/// Depth of the weight ring per tile height (`TILE_ROWS` order): k-tiles of
/// raw W codes (with the A tile of the same k-tile) in shared memory, of
/// which `stages - 1` are in flight while one is dequantised and
/// multiplied. Chosen so that, per SM, blocks x k-tiles in flight goes up
/// from the register-staged pipeline (one k-tile a block) at every height
/// and bit width without costing a 4-bit tile a block: 16 rows 4 blocks x 3
/// k-tiles (48 KB of 4-bit codes in flight, 16 before), 32 rows 3 x 4
/// (48 KB, 12 before), 64 rows 2 x 4 (32 KB, 8 before), 128 rows 2 x 2
/// (16 KB, 8 before: a third stage of 128 A rows would leave one block),
/// 144 rows as 128.
/// The 8-bit tiles (router + shared gate) give up a block at 16 and 32 rows
/// for 2.3-2.7x the bytes in flight. `ring_keeps_more_weights_in_flight`
/// checks all of it against the shared memory of an SM.
pub const TILE_WSTAGES: [usize; 5] = [4, 5, 5, 3, 3];
/// k-tiles of scales (or biases) of a W row that one 16-byte cp.async
/// brings (bf16: 8); the kernel keeps two such chunks per row.
const GEMM_SCHUNK: usize = 8;
/// Height of the 4-bit tiles that dequantise straight into their mma
/// fragments (no fp16 W tile; gemm.cu `DIRECT`): the short expert tiles,
/// bound by shared-memory traffic and instruction issue.
const GEMM_DIRECT_ROWS: usize = 16;
/// Shortest 4-bit tile height that runs on wgmma (gemm.cu `WG`): the W rows
/// are the A operand, dequantised in registers, and the tile's tokens the
/// N side of `wgmma.m64nBMk16`, read from a 128-byte-swizzled A tile.
const GEMM_WG_ROWS: usize = 64;
/// W rows of a tile.
pub const GEMM_BN: usize = 128;
/// Columns of a k-tile: one quantisation group.
pub const GEMM_BK: usize = 64;
/// fp16 padding after each shared-memory row (16 bytes: ldmatrix rows in
/// distinct banks).
const GEMM_PAD: usize = 8;
/// Threads of a block (8 warps).
pub const GEMM_THREADS: usize = 256;
/// Matrices one launch can run side by side.
pub const GEMM_MAX_SEGS: usize = 4;
/// SMs a dense launch should occupy at least once before K is split; the
/// H200's count, fixed here rather than read from the device so that a
/// prompt gives the same bits on any GPU.
pub const GEMM_FILL_SMS: usize = 132;
/// Floats of the split-K partial scratch (the memory plan's `gemm_partial`,
/// 32 MiB); a launch whose partials would not fit splits less.
pub const SPLITK_FLOATS: usize = 8 << 20;
/// Output columns one thread of `gemm_splitk_reduce` sums (one 16-byte
/// load a split: four times the loads in flight of a thread a column).
pub const GEMM_REDUCE_COLS: usize = 4;
/// Threads of a `gemm_splitk_reduce` block (GEMM_REDUCE_COLS columns each).
const GEMM_REDUCE_THREADS: usize = 256;
/// Most K splits `plan_dense` cuts a launch into, except the 4-bit 64-row
/// wgmma tiles (`GEMM_WG_ROWS`: decode steps of 33-64 tokens). More splits fill
/// more SMs but cost more partial planes for the reduction to read; capped
/// at 8 (H100, session 59 call 4, ms a step / prefill tok/s against the
/// uncapped plan): 16 tokens 5.891 -> 5.837, 32 9.016 -> 8.925 (the
/// out-projections' 16 splits), 256-token prefill 14,810 -> 15,084 (the
/// router's and the shared expert's 16), 128 unchanged; at 64 tokens the
/// out-projection's 64-row tiles keep their 16 (capped: 12.445 -> 12.632).
/// A cap of 4 lost at every size.
pub const SPLITK_MAX: usize = 8;
/// Fewest k-tiles one split walks (a split of one k-tile would spend more on
/// its prologue and partial writes than on its multiply).
const SPLITK_MIN_KT: usize = 2;

/// Every entry point of gemm.cu: the GEMM per bit width (4, 8) and tile
/// height (`TILE_ROWS` order), unsplit, then the same for split-K launches
/// (`_split`: the epilogue that writes the partials), then the split-K
/// reduction and the RMSNorm.
pub const KERNELS: &[&str] = &[
    "gemm_q4_bm16",
    "gemm_q4_bm32",
    "gemm_q4_bm64",
    "gemm_q4_bm128",
    "gemm_q4_bm144",
    "gemm_q8_bm16",
    "gemm_q8_bm32",
    "gemm_q8_bm64",
    "gemm_q8_bm128",
    "gemm_q4_bm16_split",
    "gemm_q4_bm32_split",
    "gemm_q4_bm64_split",
    "gemm_q4_bm128_split",
    "gemm_q4_bm144_split",
    "gemm_q8_bm16_split",
    "gemm_q8_bm32_split",
    "gemm_q8_bm64_split",
    "gemm_q8_bm128_split",
    "gemm_splitk_reduce",
    "rmsnorm_f16",
];

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GemmSegC {
    codes: u64,
    scales: u64,
    biases: u64,
    codes2: u64,
    scales2: u64,
    biases2: u64,
    out_f32: u64,
    out_f16: u64,
    n: i32,
    ldc: i32,
    tile0: i32,
    col0: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct GemmParams {
    a: u64,
    a_rows: u64,
    tiles: u64,
    ntiles: u64,
    partial: u64,
    e_codes: i64,
    e_groups: i64,
    seg: [GemmSegC; GEMM_MAX_SEGS],
    nseg: i32,
    lda: i32,
    m: i32,
    k: i32,
    mode: i32,
    kt_per_split: i32,
    splits: i32,
    ncols: i32,
    /// 1: launched with programmatic dependent launch (`pdl_launch`): the
    /// kernel lets its successor launch at its start.
    pdl: i32,
    pad_: i32,
}
// SAFETY: plain-old-data mirroring `GemmParams` in gemm.cu (size checked by
// the kernel's LAYOUT_CHECK against `defines`).
unsafe impl DeviceRepr for GemmParams {}

/// Bytes of dynamic shared memory of the entry point for `bits`-bit
/// weights and tiles of `TILE_ROWS[t]` rows: the fp16 W tile, two chunks of
/// scales and biases per W row, and the ring (per stage the fp16 A tile and
/// the raw W codes of one k-tile).
fn smem_bytes(bits: u32, t: usize) -> usize {
    let bm = TILE_ROWS[t];
    let wg = is_wgmma(bits, bm);
    // wgmma reads unpadded, swizzled A rows from a ring that starts on a
    // 1024-byte boundary (the slack lets the kernel align it).
    let ld = if wg { GEMM_BK } else { GEMM_BK + GEMM_PAD };
    let stage = bm * ld * 2 + GEMM_BN * GEMM_BK * bits as usize / 8;
    let w_tile = if is_direct(bits, bm) || wg { 0 } else { GEMM_BN * ld * 2 };
    let slack = if wg { 1024 } else { 0 };
    w_tile + 4 * GEMM_BN * GEMM_SCHUNK * 2 + TILE_WSTAGES[t] * stage + slack
}

/// Whether gemm.cu has an entry point for `bits`-bit weights and tiles of
/// `bm` rows: 4-bit at every height of `TILE_ROWS`, 8-bit up to
/// `GEMM_TALL_ROWS` (its mma.sync warp tiling needs BM / 2 in whole m16
/// tiles, which 144 is not).
pub fn compiled(bits: u32, bm: usize) -> bool {
    TILE_ROWS.contains(&bm) && (bits == 4 || (bits == 8 && bm <= GEMM_TALL_ROWS))
}

/// Whether tiles of `bm` rows of `bits`-bit weights run on wgmma (gemm.cu
/// `WG`; no fp16 W tile either).
fn is_wgmma(bits: u32, bm: usize) -> bool {
    bits == 4 && bm >= GEMM_WG_ROWS
}

/// Whether tiles of `bm` rows of `bits`-bit weights skip the fp16 W tile:
/// each lane dequantises its own mma fragments from the ring's raw codes
/// (gemm.cu `DIRECT`), so no W tile is allocated.
fn is_direct(bits: u32, bm: usize) -> bool {
    bits == 4 && bm == GEMM_DIRECT_ROWS
}

/// Whether tiles of `bm` rows of `bits`-bit weights dequantise into
/// registers (DIRECT or WG) rather than through the shared fp16 W tile.
pub fn dequantises_in_registers(bits: u32, bm: usize) -> bool {
    is_direct(bits, bm) || is_wgmma(bits, bm)
}

/// The defines gemm.cu needs beyond the model dimensions.
pub fn defines() -> Vec<String> {
    let mut v = vec![
        format!("-DGEMM_BN={GEMM_BN}"),
        format!("-DGEMM_BK={GEMM_BK}"),
        format!("-DGEMM_PAD={GEMM_PAD}"),
        format!("-DGEMM_THREADS={GEMM_THREADS}"),
        format!("-DGEMM_MAX_SEGS={GEMM_MAX_SEGS}"),
        format!("-DGEMM_SCHUNK={GEMM_SCHUNK}"),
        format!("-DGEMM_DIRECT_ROWS={GEMM_DIRECT_ROWS}"),
        format!("-DGEMM_WG_ROWS={GEMM_WG_ROWS}"),
        format!("-DRMSNORM_THREADS={RMSNORM_THREADS}"),
        format!("-DGEMM_REDUCE_COLS={GEMM_REDUCE_COLS}"),
        format!("-DGEMM_REDUCE_THREADS={GEMM_REDUCE_THREADS}"),
        format!("-DGEMM_SEG_BYTES={}", size_of::<GemmSegC>()),
        format!("-DGEMM_PARAMS_BYTES={}", size_of::<GemmParams>()),
    ];
    for (i, bm) in TILE_ROWS.iter().enumerate() {
        v.push(format!("-DGEMM_BM_T{i}={bm}"));
        v.push(format!("-DGEMM_MINB_T{i}={}", TILE_MIN_BLOCKS[i]));
        v.push(format!("-DGEMM_WSTAGES_T{i}={}", TILE_WSTAGES[i]));
        v.push(format!("-DGEMM_SMEM_Q4_T{i}={}", smem_bytes(4, i)));
        if compiled(8, *bm) {
            v.push(format!("-DGEMM_SMEM_Q8_T{i}={}", smem_bytes(8, i)));
        }
    }
    v
}

/// The entry point of `bits`-bit weights on tiles of `bm` rows (`split`:
/// the split-K one, which writes the partials) and its shared memory.
fn kernel_for(bits: u32, bm: usize, split: bool) -> CudaResult<(&'static str, usize)> {
    if bits != 4 && bits != 8 {
        return Err(CudaError::shape("gemm", format!("{bits}-bit weights")));
    }
    let t = TILE_ROWS.iter().position(|r| *r == bm).filter(|_| compiled(bits, bm));
    let t =
        t.ok_or_else(|| CudaError::shape("gemm", format!("tile height {bm} for {bits}-bit weights (compiled: {:?})", heights(bits).collect::<Vec<_>>())))?;
    // KERNELS: the 4-bit heights, then the 8-bit ones, each ascending;
    // then the split entries in the same order.
    let at = if bits == 4 { t } else { heights(4).count() + t };
    let at = if split { at + heights(4).count() + heights(8).count() } else { at };
    Ok((KERNELS[at], smem_bytes(bits, t)))
}

/// The tile heights compiled for `bits`-bit weights, ascending.
pub fn heights(bits: u32) -> impl Iterator<Item = usize> {
    TILE_ROWS.into_iter().filter(move |bm| compiled(bits, *bm))
}

/// What the GEMM does with its result.
#[derive(Clone, Copy)]
pub enum GemmOut {
    /// f32 out[m][n] = C.
    Store(u64),
    /// f32 out[m][n] += C (residual add).
    Add(u64),
    /// fp16 out[m][i] = silu(C_gate) * C_up (second matrix = up).
    SwiGlu(u64),
}

impl GemmOut {
    fn mode(&self) -> i32 {
        match self {
            GemmOut::Store(_) => 0,
            GemmOut::Add(_) => 1,
            GemmOut::SwiGlu(_) => 2,
        }
    }
}

/// Row grouping of an MoE GEMM.
#[derive(Clone, Copy)]
pub struct Grouping {
    /// i32 [max_tiles][3] (expert, row start, row end) and its device count.
    pub tiles: u64,
    pub ntiles: u64,
    pub max_tiles: usize,
    /// i32: sorted row -> A row (0: identity).
    pub a_rows: u64,
    /// The tile height the tile list was cut at (`moe::route`); the GEMM
    /// runs with tiles of exactly this height.
    pub bm: usize,
}

/// One matrix of a launch: W (and the up matrix of SwiGLU), where its
/// result goes and that output's row stride.
#[derive(Clone, Copy)]
pub struct Seg<'a> {
    pub w: &'a QMat,
    pub up: Option<&'a QMat>,
    pub out: GemmOut,
    pub ldc: usize,
}

/// The split-K partial scratch: f32, `floats` long.
#[derive(Clone, Copy)]
pub struct SplitScratch {
    pub ptr: u64,
    pub floats: usize,
}

/// How a launch is cut: tile height and number of K splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmPlan {
    pub bm: usize,
    pub splits: usize,
}

/// The tile height and K splits of a dense launch of `bits`-bit weights,
/// `m` rows, `n_tiles` W tiles, K = `k` and partial rows of `ncols` floats:
/// - height: the shortest tile up to `GEMM_TALL_ROWS` that holds all `m`
///   rows, else `GEMM_TALL_ROWS` (a taller tile would multiply empty rows; a
///   shorter one re-reads and re-dequantises W once more per extra M tile);
///   4-bit passes that two `GEMM_WIDE_ROWS` tiles hold but two of 128 do
///   not (257-288 rows) run those two;
/// - splits: none when the launch has a block for every SM
///   (`GEMM_FILL_SMS`); else as many as two blocks per SM hold (rounded down), with at
///   least `SPLITK_MIN_KT` k-tiles per split, at most `SPLITK_MAX` (but
///   at the 64-row wgmma tiles), the partials within `SPLITK_FLOATS`, and
///   no empty split. A block that walks K alone on its
///   SM is latency-bound (one k-tile in flight), so short prompts gain
///   most: at 256 rows out_proj goes from 32 blocks of 64 k-tiles to 256 of
///   8, the router (+ shared-expert gate) from 6 blocks of 32 to 48 of 4 (`SPLITK_MAX`).
pub fn plan_dense(bits: u32, m: usize, n_tiles: usize, k: usize, ncols: usize) -> GemmPlan {
    let wide = compiled(bits, GEMM_WIDE_ROWS) && m > 2 * GEMM_TALL_ROWS && m <= 2 * GEMM_WIDE_ROWS;
    let bm = if wide { GEMM_WIDE_ROWS } else { TILE_ROWS.into_iter().find(|t| *t >= m && *t <= GEMM_TALL_ROWS).unwrap_or(GEMM_TALL_ROWS) };
    let blocks = n_tiles * m.div_ceil(bm);
    let nk = k / GEMM_BK;
    let mut splits = 1;
    if blocks > 0 && blocks < GEMM_FILL_SMS {
        // Rounded down: one more split than fits two blocks an SM leaves a
        // nearly empty second wave (grid (98, 1, 3) = 294 blocks against
        // 264 slots for the in-projection of a 64-token decode step).
        let want = (2 * GEMM_FILL_SMS) / blocks;
        let by_k = nk / SPLITK_MIN_KT;
        let by_mem = SPLITK_FLOATS / (m * ncols).max(1);
        let by_cap = if is_wgmma(bits, bm) && bm == GEMM_WG_ROWS { usize::MAX } else { SPLITK_MAX };
        splits = want.min(by_k).min(by_mem).min(by_cap).max(1);
        splits = nk.div_ceil(nk.div_ceil(splits).max(1)).max(1);
    }
    GemmPlan { bm, splits }
}

/// C = A W^T for one matrix: `a` fp16 [rows][lda]; `m` rows (dense) or the
/// grouping's rows; `up` is the second matrix of SwiGLU. Dense launches use
/// the tile height of `plan_dense` and no split.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    gpu: &Gpu,
    k: &Kernels,
    a: u64,
    lda: usize,
    m: usize,
    w: &QMat,
    up: Option<&QMat>,
    out: GemmOut,
    ldc: usize,
    group: Option<&Grouping>,
) -> CudaResult<()> {
    let seg = Seg { w, up, out, ldc };
    let plan = match group {
        Some(g) => GemmPlan { bm: g.bm, splits: 1 },
        None => GemmPlan { bm: plan_dense(w.bits, m, 1, w.cols, 0).bm, splits: 1 },
    };
    gemm_with(gpu, k, a, lda, m, &[seg], group, plan, None)
}

/// Dense C = A W^T for up to `GEMM_MAX_SEGS` matrices that share A, K, the
/// bit width and the kind of output, in one launch, cut by `plan_dense`
/// (split over K into `scratch` when that fills the GPU better).
pub fn gemm_segs(gpu: &Gpu, k: &Kernels, a: u64, lda: usize, m: usize, segs: &[Seg], scratch: SplitScratch) -> CudaResult<()> {
    gemm_with(gpu, k, a, lda, m, segs, None, segs_plan(m, segs), Some(scratch))
}

/// `plan_dense`'s cut of a `gemm_segs` launch.
fn segs_plan(m: usize, segs: &[Seg]) -> GemmPlan {
    let (n_tiles, ncols) = seg_tiles(segs);
    let (bits, k_cols) = segs.first().map(|s| (s.w.bits, s.w.cols)).unwrap_or((4, 0));
    plan_dense(bits, m, n_tiles, k_cols, ncols)
}

/// The K splits `gemm_segs` cuts a launch of `segs` over `m` rows into
/// (1: none, so it leaves nothing in the partial scratch).
pub fn dense_splits(m: usize, segs: &[Seg]) -> usize {
    let nk = segs.first().map_or(0, |s| s.w.cols / GEMM_BK);
    if nk == 0 {
        return 1;
    }
    split_count(nk, segs_plan(m, segs).splits)
}

/// W tiles (blockIdx.x) of the segments and the width of a partial row.
fn seg_tiles(segs: &[Seg]) -> (usize, usize) {
    let mut tiles = 0;
    let mut cols = 0;
    for s in segs {
        if matches!(s.out, GemmOut::SwiGlu(_)) {
            tiles += s.w.rows.div_ceil(GEMM_BN / 2);
            cols += 2 * s.w.rows;
        } else {
            tiles += s.w.rows.div_ceil(GEMM_BN);
            cols += s.w.rows;
        }
    }
    (tiles, cols)
}

/// A split launch's partial sums, left for their reader to add: `splits`
/// planes of [m][ncols] f32, `plane` floats apart, from `ptr`. With one
/// split, `ptr` is the output itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KPartials {
    pub ptr: u64,
    pub splits: usize,
    pub plane: usize,
}

/// Splits `gemm_unreduced` leaves to its reader; more are reduced here.
/// Its reader loads every split of a value (4 at 4,096 tokens: the router
/// plus its top-k 72.3 -> 54.1 us a layer, NOTES history 114); at short
/// prompts the planner cuts K into 8 and the one reduction launch is
/// cheaper than 8 rounds of loads in the reader.
pub const MAX_UNREDUCED_SPLITS: usize = 4;

/// One matrix stored as [m][rows] f32 (`seg.ldc == rows`), cut by
/// `plan_dense`, without the split-K reduction when it has at most
/// `MAX_UNREDUCED_SPLITS` splits: its reader sums the partials in split
/// order (the router's top-k does, `moe::route`), which saves a launch and
/// a round trip of the output.
pub fn gemm_unreduced(gpu: &Gpu, k: &Kernels, a: u64, lda: usize, m: usize, seg: Seg, scratch: SplitScratch) -> CudaResult<KPartials> {
    let GemmOut::Store(out) = seg.out else {
        return Err(CudaError::shape("gemm", "unreduced partials are plain stores"));
    };
    if seg.ldc != seg.w.rows {
        return Err(CudaError::shape("gemm", format!("unreduced partials of {} rows stored {} apart (their planes are dense)", seg.w.rows, seg.ldc)));
    }
    let plan = unreduced_plan(m, &seg);
    let plane = m * seg.w.rows;
    Ok(match gemm_launch(gpu, k, a, lda, m, &[seg], None, plan, Some(scratch))? {
        Some(r) if (r.p.splits as usize) <= MAX_UNREDUCED_SPLITS => KPartials { ptr: r.p.partial, splits: r.p.splits as usize, plane },
        Some(r) => {
            r.launch(gpu, k)?;
            KPartials { ptr: out, splits: 1, plane }
        }
        None => KPartials { ptr: out, splits: 1, plane },
    })
}

/// `plan_dense`'s cut of `gemm_unreduced`'s one matrix.
fn unreduced_plan(m: usize, seg: &Seg) -> GemmPlan {
    plan_dense(seg.w.bits, m, seg_tiles(std::slice::from_ref(seg)).0, seg.w.cols, seg.w.rows)
}

/// Whether `gemm_unreduced` of `seg` over `m` rows leaves its partials to
/// the reader (a split launch of at most `MAX_UNREDUCED_SPLITS` splits, or
/// no split) rather than reducing them itself.
pub fn leaves_partials(m: usize, seg: &Seg) -> bool {
    split_count(seg.w.cols / GEMM_BK, unreduced_plan(m, seg).splits) <= MAX_UNREDUCED_SPLITS
}

/// The K splits a launch of `nk` k-tiles runs for a plan of `planned`:
/// normalised so that no split is empty (the kernel's blockIdx.z count),
/// and the k-tiles of each.
pub fn split_count(nk: usize, planned: usize) -> usize {
    nk.div_ceil(split_kt(nk, planned))
}
fn split_kt(nk: usize, planned: usize) -> usize {
    nk.div_ceil(planned.clamp(1, nk.max(1)))
}

/// Whether a launch goes out with programmatic dependent launch: a dense
/// 4-bit launch of one M tile on wgmma (`GEMM_WG_ROWS` rows and more), i.e.
/// the GEMM path's decode steps of 33-128 tokens. There its weights'
/// first lines load and its blocks start while the kernel before it ends,
/// and its successor's do during its own tail: a 64-token step 13.27 ->
/// 13.08 ms on the H100 (NOTES.md history 173). Every launch so was
/// slower at 16 tokens (5.99 -> 6.29 ms) and in the 256-token prefill
/// (-1.7% tok/s), so the others keep plain launches.
fn pdl_launch(bits: u32, bm: usize, m_tiles: usize, grouped: bool) -> bool {
    !grouped && bits == 4 && bm >= GEMM_WG_ROWS && m_tiles == 1
}

/// A split launch's pending reduction.
struct Reduce {
    p: GemmParams,
    blocks: u32,
}

impl Reduce {
    fn launch(&self, gpu: &Gpu, k: &Kernels) -> CudaResult<()> {
        launch_maybe_pdl(self.p.pdl != 0, gpu, k, "gemm_splitk_reduce", (self.blocks, 1, 1), GEMM_REDUCE_THREADS as u32, 0, &self.p)
    }
}

/// The GEMM with an explicit plan (tests force every height and split
/// count this way). Checks every shape before launching.
#[allow(clippy::too_many_arguments)]
pub fn gemm_with(
    gpu: &Gpu,
    k: &Kernels,
    a: u64,
    lda: usize,
    m: usize,
    segs: &[Seg],
    group: Option<&Grouping>,
    plan: GemmPlan,
    scratch: Option<SplitScratch>,
) -> CudaResult<()> {
    if let Some(r) = gemm_launch(gpu, k, a, lda, m, segs, group, plan, scratch)? {
        r.launch(gpu, k)?;
    }
    Ok(())
}

/// `gemm_with`'s checks and main launch; a split launch returns the
/// reduction its outputs still need.
#[allow(clippy::too_many_arguments)]
fn gemm_launch(
    gpu: &Gpu,
    k: &Kernels,
    a: u64,
    lda: usize,
    m: usize,
    segs: &[Seg],
    group: Option<&Grouping>,
    plan: GemmPlan,
    scratch: Option<SplitScratch>,
) -> CudaResult<Option<Reduce>> {
    const NAME: &str = "gemm";
    let first = segs.first().ok_or_else(|| CudaError::shape(NAME, "no matrix"))?;
    if segs.len() > GEMM_MAX_SEGS {
        return Err(CudaError::shape(NAME, format!("{} matrices in one launch (at most {GEMM_MAX_SEGS})", segs.len())));
    }
    let w0 = first.w;
    let kk = w0.cols;
    if !kk.is_multiple_of(GEMM_BK) || kk == 0 || lda < kk || !lda.is_multiple_of(8) {
        return Err(CudaError::shape(NAME, format!("K = {kk} (a positive multiple of {GEMM_BK}), lda = {lda} (multiple of 8, >= K)")));
    }
    // The kernel addresses A with 32-bit element offsets.
    if m.saturating_mul(lda) > i32::MAX as usize {
        return Err(CudaError::shape(NAME, format!("{m} rows of {lda} elements exceed 32-bit offsets")));
    }
    let mode = first.out.mode();
    let swiglu = mode == 2;
    if swiglu && segs.len() != 1 {
        return Err(CudaError::shape(NAME, "SwiGLU runs one gate/up pair per launch"));
    }
    if group.is_some() && segs.len() != 1 {
        return Err(CudaError::shape(NAME, "a grouped GEMM runs one matrix"));
    }
    if let Some(g) = group {
        if g.bm != plan.bm {
            return Err(CudaError::shape(NAME, format!("tile list cut at {} rows, launch with tiles of {}", g.bm, plan.bm)));
        }
    }
    let mut segc = [GemmSegC::default(); GEMM_MAX_SEGS];
    let (mut tile0, mut col0) = (0usize, 0usize);
    for (i, s) in segs.iter().enumerate() {
        let w = s.w;
        if w.cols != kk || w.bits != w0.bits || w.experts != w0.experts {
            return Err(CudaError::shape(
                NAME,
                format!(
                    "matrix {i}: {}x{} {}-bit x{} differs from matrix 0 ({}x{kk} {}-bit x{})",
                    w.rows, w.cols, w.bits, w.experts, w0.rows, w0.bits, w0.experts
                ),
            ));
        }
        if s.out.mode() != mode {
            return Err(CudaError::shape(NAME, "the matrices of one launch have one kind of output"));
        }
        if w.rows == 0 || s.ldc < w.rows {
            return Err(CudaError::shape(NAME, format!("matrix {i}: {} rows, ldc {} (rows >= 1, ldc >= rows)", w.rows, s.ldc)));
        }
        if group.is_none() && w.experts != 1 {
            return Err(CudaError::shape(NAME, "stacked experts need a grouping"));
        }
        let upm = match (swiglu, s.up) {
            (true, Some(u)) => {
                if u.rows != w.rows || u.cols != w.cols || u.experts != w.experts || u.bits != w.bits {
                    return Err(CudaError::shape(NAME, "gate and up matrices differ in shape"));
                }
                if !w.rows.is_multiple_of(8) || !s.ldc.is_multiple_of(2) {
                    return Err(CudaError::shape(NAME, format!("SwiGLU of {} rows, ldc {} (rows a multiple of 8, ldc even)", w.rows, s.ldc)));
                }
                *u
            }
            (true, None) => return Err(CudaError::shape(NAME, "SwiGLU needs the up matrix")),
            (false, _) => QMat::default(),
        };
        let (out_f32, out_f16) = match s.out {
            GemmOut::Store(p) | GemmOut::Add(p) => (p, 0),
            GemmOut::SwiGlu(p) => (0, p),
        };
        segc[i] = GemmSegC {
            codes: w.codes,
            scales: w.scales,
            biases: w.biases,
            codes2: upm.codes,
            scales2: upm.scales,
            biases2: upm.biases,
            out_f32,
            out_f16,
            n: w.rows as i32,
            ldc: s.ldc as i32,
            tile0: tile0 as i32,
            col0: col0 as i32,
        };
        let (t, c) = seg_tiles(std::slice::from_ref(s));
        tile0 += t;
        col0 += c;
    }
    let (n_tiles, ncols) = (tile0, col0);
    let nk = kk / GEMM_BK;
    let kt_per_split = split_kt(nk, plan.splits);
    let splits = split_count(nk, plan.splits);
    let m_tiles = match group {
        Some(g) => g.max_tiles,
        None => m.div_ceil(plan.bm),
    };
    if m_tiles == 0 {
        return Ok(None);
    }
    let (name, smem) = kernel_for(w0.bits, plan.bm, splits > 1)?;
    let partial = if splits > 1 {
        if group.is_some() {
            return Err(CudaError::shape(NAME, "split-K is for dense launches"));
        }
        let s = scratch.ok_or_else(|| CudaError::shape(NAME, format!("{splits} K splits need the partial scratch")))?;
        let need = splits * m * ncols;
        if need > s.floats {
            return Err(CudaError::shape(NAME, format!("{splits} splits of {m} x {ncols} partials = {need} floats, the scratch holds {}", s.floats)));
        }
        s.ptr
    } else {
        0
    };
    let p = GemmParams {
        a,
        a_rows: group.map(|g| g.a_rows).unwrap_or(0),
        tiles: group.map(|g| g.tiles).unwrap_or(0),
        ntiles: group.map(|g| g.ntiles).unwrap_or(0),
        partial,
        e_codes: w0.expert_words() as i64,
        e_groups: w0.expert_groups() as i64,
        seg: segc,
        nseg: segs.len() as i32,
        lda: lda as i32,
        m: m as i32,
        k: kk as i32,
        mode,
        kt_per_split: kt_per_split as i32,
        splits: splits as i32,
        ncols: ncols as i32,
        pdl: pdl_launch(w0.bits, plan.bm, m_tiles, group.is_some()) as i32,
        pad_: 0,
    };
    launch_maybe_pdl(p.pdl != 0, gpu, k, name, (n_tiles as u32, m_tiles as u32, splits as u32), GEMM_THREADS as u32, smem, &p)?;
    if splits == 1 {
        return Ok(None);
    }
    let nout = if swiglu { w0.rows } else { ncols };
    Ok(Some(Reduce { p, blocks: (m * nout.div_ceil(GEMM_REDUCE_COLS)).div_ceil(GEMM_REDUCE_THREADS) as u32 }))
}

#[repr(C)]
#[derive(Clone, Copy)]
struct RmsnormParams {
    x: u64,
    gain: u64,
    out: u64,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `RmsnormParams` in gemm.cu.
unsafe impl DeviceRepr for RmsnormParams {}

/// Threads of an `rmsnorm_f16` block (a row; each thread holds its
/// ceil(hidden / RMSNORM_THREADS) columns in registers).
pub(crate) const RMSNORM_THREADS: usize = 256;

/// out (fp16 [rows][hidden]) = RMSNorm(x (f32 [rows][hidden])) * gain: rows
/// of the model's hidden size, which the kernel is compiled for (HIDDEN).
pub fn rmsnorm_f16(gpu: &Gpu, k: &Kernels, x: u64, gain: u64, out: u64, rows: usize, eps: f32) -> CudaResult<()> {
    if rows == 0 {
        return Ok(());
    }
    let p = RmsnormParams { x, gain, out, eps };
    launch(gpu, k, "rmsnorm_f16", (rows as u32, 1, 1), RMSNORM_THREADS as u32, 0, &p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_decode_steps_wgmma_tiles_launch_programmatically() {
        // Dense 4-bit passes, as plan_dense cuts them.
        let pdl = |m: usize| {
            let bm = plan_dense(4, m, 97, 2048, 12352).bm;
            pdl_launch(4, bm, m.div_ceil(bm), false)
        };
        assert!(pdl(64) && pdl(33) && pdl(128), "33-128 tokens: one wgmma M tile");
        assert!(!pdl(16) && !pdl(32), "16-32 tokens: mma.sync tiles");
        assert!(!pdl(256) && !pdl(4096), "prefill passes: several M tiles");
        assert!(!pdl_launch(4, 64, 1, true), "grouped expert launches");
        assert!(!pdl_launch(8, 64, 1, false), "8-bit tiles are mma.sync");
    }

    #[test]
    fn the_router_leaves_its_partials_only_when_few() {
        // The real router: 256 rows of 2,048 8-bit columns.
        let w = QMat { rows: 256, cols: 2048, bits: 8, experts: 1, ..QMat::default() };
        let seg = Seg { w: &w, up: None, out: GemmOut::Store(0), ldc: 256 };
        let splits = |m: usize| split_count(w.cols / GEMM_BK, unreduced_plan(m, &seg).splits);
        // 4,096 rows: 64 tiles, 4 splits of 8 k-tiles, left to the top-k.
        assert_eq!(splits(4096), 4);
        assert!(leaves_partials(4096, &seg));
        // 256 and 1,024 rows: SPLITK_MAX (8) splits, reduced by the GEMM.
        assert_eq!(splits(256), SPLITK_MAX);
        assert!(!leaves_partials(256, &seg) && !leaves_partials(1024, &seg));
        // No split at all (a block for every SM) also leaves the output to the reader.
        assert_eq!(splits(16384), 1);
        assert!(leaves_partials(16384, &seg));
        // Splits are never empty: 32 k-tiles cut for 12 run as 11 of 3.
        assert_eq!((split_count(32, 12), split_kt(32, 12)), (11, 3));
    }

    #[test]
    fn the_shared_expert_splits_nothing_from_a_block_per_sm() {
        // The real shared expert: gate/up 512 + 512 rows of 2,048 4-bit
        // columns (SwiGLU), down 2,048 rows of 512.
        let (g, u) =
            (QMat { rows: 512, cols: 2048, bits: 4, experts: 1, ..QMat::default() }, QMat { rows: 512, cols: 2048, bits: 4, experts: 1, ..QMat::default() });
        let dn = QMat { rows: 2048, cols: 512, bits: 4, experts: 1, ..QMat::default() };
        let gate_up = Seg { w: &g, up: Some(&u), out: GemmOut::SwiGlu(0), ldc: 512 };
        let down = Seg { w: &dn, up: None, out: GemmOut::Store(0), ldc: 2048 };
        // 4,096 rows: 32 M tiles x 8 (gate/up) or 16 (down) W tiles.
        assert_eq!(dense_splits(4096, &[gate_up]), 1);
        assert_eq!(dense_splits(4096, &[down]), 1);
        // 1,536 rows: 12 x 8 = 96 gate/up blocks, fewer than the SMs.
        assert!(dense_splits(1536, &[gate_up]) > 1);
        assert_eq!(dense_splits(1, &[]), 1, "no matrix, no split");
    }

    #[test]
    fn kernel_names_follow_the_tile_heights() {
        let names: Vec<String> = ["", "_split"]
            .iter()
            .flat_map(|sfx| [4u32, 8].into_iter().flat_map(move |bits| heights(bits).map(move |bm| format!("gemm_q{bits}_bm{bm}{sfx}"))))
            .collect();
        assert_eq!(KERNELS[..names.len()], names, "the 4-bit heights, then the 8-bit ones; unsplit, then split");
        for bits in [4u32, 8] {
            for bm in heights(bits) {
                assert_eq!(kernel_for(bits, bm, false).expect("compiled height").0, format!("gemm_q{bits}_bm{bm}"));
                assert_eq!(kernel_for(bits, bm, true).expect("compiled height").0, format!("gemm_q{bits}_bm{bm}_split"));
            }
        }
        assert_eq!(heights(4).collect::<Vec<_>>(), TILE_ROWS, "4-bit: every height");
        assert_eq!(heights(8).collect::<Vec<_>>(), [16, 32, 64, 128], "8-bit: not the wgmma-only 144");
        for split in [false, true] {
            assert!(kernel_for(8, 144, split).is_err());
            assert!(kernel_for(4, 48, split).is_err());
            assert!(kernel_for(3, 16, split).is_err());
        }
        assert!(TILE_ROWS.windows(2).all(|w| w[0] < w[1]), "ascending");
    }

    #[test]
    fn dense_plan_holds_the_rows_in_the_shortest_tile() {
        for bits in [4u32, 8] {
            assert_eq!(plan_dense(bits, 1, 200, 2048, 0).bm, 16);
            assert_eq!(plan_dense(bits, 16, 200, 2048, 0).bm, 16);
            assert_eq!(plan_dense(bits, 17, 200, 2048, 0).bm, 32);
            assert_eq!(plan_dense(bits, 64, 200, 2048, 0).bm, 64);
            assert_eq!(plan_dense(bits, 65, 200, 2048, 0).bm, 128);
            assert_eq!(plan_dense(bits, 128, 200, 2048, 0).bm, 128);
        }
        // The wide tile only where it makes three M tiles two (257-288 rows).
        assert_eq!(plan_dense(4, 130, 200, 2048, 0).bm, 128, "two of 128, not one of 144");
        assert_eq!(plan_dense(4, 256, 200, 2048, 0).bm, 128);
        assert_eq!(plan_dense(4, 257, 200, 2048, 0).bm, 144, "two tiles of 144, not three of 128");
        assert_eq!(plan_dense(4, 265, 200, 2048, 0).bm, 144);
        assert_eq!(plan_dense(4, 288, 200, 2048, 0).bm, 144);
        assert_eq!(plan_dense(4, 289, 200, 2048, 0).bm, 128, "three tiles either way");
        assert_eq!(plan_dense(4, 400, 200, 2048, 0).bm, 128, "four of 128 measured faster than three of 144");
        assert_eq!(plan_dense(4, 4096, 200, 2048, 0).bm, 128);
        // 8-bit weights have no 144-row tile.
        assert_eq!(plan_dense(8, 265, 200, 2048, 0).bm, 128);
    }

    #[test]
    fn dense_plan_splits_only_below_one_block_per_sm() {
        // One block per SM or more: no split.
        assert_eq!(plan_dense(4, 256, 66, 2048, 66 * 128).splits, 1);
        assert_eq!(plan_dense(4, 4096, 16, 4096, 2048).splits, 1);
        // Just below: split.
        assert!(plan_dense(4, 128, 131, 2048, 131 * 128).splits > 1);
        // The router + gate at 256 rows: 6 blocks of 32 k-tiles -> 8 splits
        // of 4 (16 of 2 before SPLITK_MAX).
        assert_eq!(plan_dense(8, 256, 3, 2048, 257), GemmPlan { bm: 128, splits: SPLITK_MAX });
        // out_proj at 256 rows: 32 blocks of 64 k-tiles -> 8 splits of 8.
        assert_eq!(plan_dense(4, 256, 16, 4096, 2048), GemmPlan { bm: 128, splits: 8 });
        // No more blocks than two an SM: 98 tiles (a 64-token decode
        // step's in-projection) split in 2, not 3.
        assert_eq!(plan_dense(4, 64, 98, 2048, 98 * 128), GemmPlan { bm: 64, splits: 2 });
        assert_eq!(plan_dense(4, 64, 72, 2048, 72 * 128), GemmPlan { bm: 64, splits: 3 });
        // K of one k-tile cannot split.
        assert_eq!(plan_dense(4, 256, 1, 64, 1).splits, 1);
        // The out-projections of decode steps (16 W tiles, K = 4,096): at
        // most SPLITK_MAX splits at 16, 32 and 128 tokens, but the 64-row
        // wgmma tiles of 33-64 tokens keep 16.
        for m in [16usize, 32, 128] {
            assert_eq!(plan_dense(4, m, 16, 4096, 2048).splits, SPLITK_MAX, "{m} tokens");
        }
        assert_eq!(plan_dense(4, 64, 16, 4096, 2048), GemmPlan { bm: 64, splits: 16 });
        // 8-bit 64-row tiles are mma.sync ones: capped (a 33-64-token
        // prompt's router + gate, 3 blocks of 32 k-tiles).
        assert_eq!(plan_dense(8, 64, 3, 2048, 257), GemmPlan { bm: 64, splits: SPLITK_MAX });
    }

    #[test]
    fn dense_plan_never_leaves_a_split_empty_or_overflows_the_scratch() {
        for (bits, m) in [4u32, 8].into_iter().flat_map(|b| [1usize, 5, 16, 100, 140, 256, 265, 1000, 1024, 2048, 4096, 16384].map(|m| (b, m))) {
            for n_tiles in [1usize, 3, 16, 40, 98, 131] {
                for k in [64usize, 128, 512, 2048, 4096] {
                    let ncols = n_tiles * GEMM_BN;
                    let p = plan_dense(bits, m, n_tiles, k, ncols);
                    assert!(compiled(bits, p.bm), "{bits}-bit {m}: {p:?}");
                    let nk = k / GEMM_BK;
                    assert!(p.splits >= 1 && p.splits <= nk.max(1), "{m} {n_tiles} {k}: {p:?}");
                    let per = nk.div_ceil(p.splits);
                    assert_eq!(nk.div_ceil(per), p.splits, "{m} {n_tiles} {k}: an empty split");
                    if p.splits > 1 {
                        assert!(p.splits * m * ncols <= SPLITK_FLOATS, "{m} {n_tiles} {k}: partials overflow");
                        assert!(p.splits <= SPLITK_MAX || (bits == 4 && p.bm == GEMM_WG_ROWS), "{bits}-bit {m} {n_tiles} {k}: {p:?} past the cap");
                        assert!(per >= SPLITK_MIN_KT, "{m} {n_tiles} {k}: {per} k-tiles a split");
                    }
                }
            }
        }
    }

    /// Shared memory of an H200 SM (228 KiB), the 1 KiB the runtime reserves
    /// per resident block, and the most one block may opt into (227 KiB).
    const SM_SMEM: usize = 228 << 10;
    const BLOCK_RESERVED_SMEM: usize = 1 << 10;
    const BLOCK_SMEM_MAX: usize = 227 << 10;

    /// Resident blocks per SM of the entry point of height index `t` with
    /// `smem` bytes: the launch bounds' register target, unless shared
    /// memory holds fewer.
    fn blocks_per_sm(t: usize, smem: usize) -> usize {
        TILE_MIN_BLOCKS[t].min(SM_SMEM / (smem + BLOCK_RESERVED_SMEM))
    }

    #[test]
    fn ring_keeps_more_weights_in_flight() {
        for (t, bm) in TILE_ROWS.iter().enumerate() {
            let stages = TILE_WSTAGES[t];
            assert!(stages >= 2 && stages - 1 <= GEMM_SCHUNK, "{bm} rows: {stages} stages (2..={})", GEMM_SCHUNK + 1);
            for bits in [4u32, 8].into_iter().filter(|b| compiled(*b, *bm)) {
                let ktile = GEMM_BN * GEMM_BK * bits as usize / 8;
                let smem = smem_bytes(bits, t);
                assert!(smem <= BLOCK_SMEM_MAX, "{bits}-bit {bm} rows: {smem} bytes of shared memory");
                // Before the ring: fp16 A and W tiles double buffered, the
                // next k-tile of codes in registers (one a block in flight).
                let before = blocks_per_sm(t, 2 * (bm + GEMM_BN) * (GEMM_BK + GEMM_PAD) * 2) * ktile;
                let blocks = blocks_per_sm(t, smem);
                let after = blocks * (stages - 1) * ktile;
                assert!(after > before, "{bits}-bit {bm} rows: {after} bytes in flight per SM, {before} before");
                if bits == 4 {
                    assert_eq!(blocks, TILE_MIN_BLOCKS[t], "4-bit {bm} rows: the ring costs a block");
                }
            }
        }
    }

    #[test]
    fn defines_carry_every_tile_height() {
        let d = defines();
        for (i, bm) in TILE_ROWS.iter().enumerate() {
            assert!(d.contains(&format!("-DGEMM_BM_T{i}={bm}")), "{d:?}");
            assert!(d.contains(&format!("-DGEMM_WSTAGES_T{i}={}", TILE_WSTAGES[i])), "{d:?}");
            for bits in [4u32, 8] {
                let smem = smem_bytes(bits, i);
                let define = format!("-DGEMM_SMEM_Q{bits}_T{i}=");
                if compiled(bits, *bm) {
                    assert!(d.contains(&format!("{define}{smem}")), "{d:?}");
                    assert_eq!(kernel_for(bits, *bm, false).expect("compiled height").1, smem);
                    assert_eq!(kernel_for(bits, *bm, true).expect("compiled height").1, smem);
                } else {
                    assert!(!d.iter().any(|x| x.starts_with(&define)), "no {bits}-bit entry at {bm} rows: {d:?}");
                }
            }
        }
        assert_eq!(size_of::<GemmSegC>(), 80);
    }
}
