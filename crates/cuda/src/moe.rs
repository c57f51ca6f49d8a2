//! Launchers of kernels/moe.cu: the prefill routing (top-k, grouping of
//! tokens by expert, the weighted combine). The grouped expert GEMMs
//! themselves are in gemm.rs; the decode step's MoE is in qmm.rs.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::dims::Dims;
use crate::error::{CudaError, CudaResult};
use crate::gemm::{KPartials, TILE_ROWS};
use crate::kernels::Kernels;
use crate::launch::{launch, launch_pdl};

#[repr(C)]
#[derive(Clone, Copy)]
struct MoeRoutePlanParams {
    logits: u64,
    topk_idx: u64,
    topk_w: u64,
    counts: u64,
    rank: u64,
    offsets: u64,
    tiles: u64,
    ntiles: u64,
    ticket: u64,
    plane: i64,
    splits: i32,
    ntok: i32,
    bm: i32,
}
// SAFETY: plain-old-data mirroring `MoeRoutePlanParams` in moe.cu (size
// checked there against `defines`).
unsafe impl DeviceRepr for MoeRoutePlanParams {}

/// Tokens a `moe_route_plan` block routes, a warp each (its block is
/// ROUTE_WARPS warps; its last block scans the experts' counts with them).
const ROUTE_WARPS: usize = 8;

/// The layout sizes moe.cu checks its parameter structs against, and its
/// block shapes.
pub fn defines() -> Vec<String> {
    vec![
        format!("-DMOE_ROUTE_PLAN_PARAMS_SIZE={}", std::mem::size_of::<MoeRoutePlanParams>()),
        format!("-DMOE_COMBINE_PARAMS_SIZE={}", std::mem::size_of::<MoeCombineParams>()),
        format!("-DMOE_COMBINE_THREADS={MOE_COMBINE_THREADS}"),
        format!("-DMOE_ROUTE_WARPS={ROUTE_WARPS}"),
    ]
}

#[repr(C)]
#[derive(Clone, Copy)]
struct MoeScatterParams {
    topk_idx: u64,
    rank: u64,
    offsets: u64,
    perm: u64,
    inv: u64,
    ntok: i32,
}
// SAFETY: plain-old-data mirroring `MoeScatterParams` in moe.cu.
unsafe impl DeviceRepr for MoeScatterParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct MoeCombineParams {
    h: u64,
    y: u64,
    ys: u64,
    sg_logits: u64,
    inv: u64,
    topk_w: u64,
    gain: u64,
    xn: u64,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `MoeCombineParams` in moe.cu (size
// checked by the kernel's LAYOUT_CHECK against `defines`).
unsafe impl DeviceRepr for MoeCombineParams {}

/// Threads of a `moe_combine` block. Its fused norm sums a row's squares
/// in `rmsnorm_f16`'s order only when both run with as many threads.
const MOE_COMBINE_THREADS: usize = 256;
const _: () = assert!(MOE_COMBINE_THREADS == crate::gemm::RMSNORM_THREADS, "the fused norm must sum as rmsnorm_f16 does");

/// The next layer's input norm, computed by `combine` from the rows it
/// has just written: xn = fp16(RMSNorm(h) * gain), bit for bit what
/// `gemm::rmsnorm_f16` would give.
#[derive(Clone, Copy)]
pub struct NextNorm {
    pub gain: u64,
    /// fp16 [ntok][hidden].
    pub xn: u64,
    pub eps: f32,
}

/// Device buffers of the prefill routing.
#[derive(Clone, Copy)]
pub struct RouteBufs {
    pub topk_idx: u64,
    pub topk_w: u64,
    /// i32 [experts]; 0 between launches (zeroed once with the memory plan,
    /// set back to 0 by `route`'s last block).
    pub counts: u64,
    pub rank: u64,
    /// i32 [experts + 1].
    pub offsets: u64,
    /// i32 [max_tiles][3].
    pub tiles: u64,
    pub ntiles: u64,
    /// i32 [ntok * topk].
    pub perm: u64,
    pub inv: u64,
    /// i32, 0 between launches: `route`'s blocks count themselves out on it.
    pub ticket: u64,
}

/// Upper bound of the grouped-GEMM tiles of `bm` rows for `ntok` tokens.
pub fn max_tiles(dims: &Dims, ntok: usize, bm: usize) -> usize {
    (ntok * dims.topk).div_ceil(bm) + dims.n_experts
}

/// Upper bound of the grouped-GEMM tiles for `ntok` tokens at any tile
/// height (the shortest tile cuts the most): what the memory plan holds.
pub fn max_tiles_any(dims: &Dims, ntok: usize) -> usize {
    max_tiles(dims, ntok, TILE_ROWS[0])
}

/// The tile height of the grouped expert GEMMs for `ntok` tokens, chosen
/// here and nowhere else: the shortest of `gemm::TILE_ROWS` that holds 1.6
/// times the average tokens per expert (ntok * topk / n_experts), else the
/// tallest. Tokens spread over experts roughly as a Poisson count around
/// that average, so such a tile holds nearly every expert's rows at once
/// (each expert's weights are read and dequantised once; at an average of
/// 10, 2.7% of the experts need a second tile), while the multiply-adds
/// spent on empty rows stay bounded. With 256 experts and top-8: 16 rows up
/// to 320 tokens, 64 up to 1,280, 128 beyond (the 144-row tile, which
/// would take most of the second tiles at 4,096 tokens, measured 2% slower
/// at 3,000 and no faster at 4,096: `gemm::GEMM_WIDE_ROWS`). Measured on the
/// H200 (revision 3b1ea06): a 265-token prompt's experts took 21.3 ms at
/// 32 rows where 256 tokens took 18.6 ms at 16 (the taller tile costs more
/// than the few second tiles of the shorter one); the factor was 2 before.
/// Only heights whose 4-bit tiles dequantise into registers (16: DIRECT,
/// 64 and 128: wgmma) are chosen: the 32-row tile goes through the shared
/// fp16 W tile, and prompts of 384-640 tokens ran 3.7-4.4% faster with
/// their experts in 64-row wgmma tiles (crates/cuda/NOTES.md history 81,
/// 84), so 64 rows from 321 tokens.
pub fn tile_rows(dims: &Dims, ntok: usize) -> usize {
    let pairs = ntok * dims.topk;
    let tallest = crate::gemm::GEMM_TALL_ROWS;
    TILE_ROWS
        .iter()
        .copied()
        .filter(|bm| *bm <= tallest && crate::gemm::dequantises_in_registers(4, *bm))
        .find(|bm| 5 * bm * dims.n_experts >= 8 * pairs)
        .unwrap_or(tallest)
}

/// Top-k of `logits` (f32 [ntok][experts], or the router GEMM's unreduced
/// split-K partials of that shape, summed here in split order), counts,
/// ranks, offsets, the tile list cut at `bm` rows (the height the grouped
/// GEMMs then run with), sorted positions.
pub fn route(gpu: &Gpu, k: &Kernels, dims: &Dims, b: &RouteBufs, logits: KPartials, ntok: usize, bm: usize) -> CudaResult<()> {
    if !TILE_ROWS.contains(&bm) {
        return Err(CudaError::shape("moe_plan", format!("tile height {bm}; the grouped GEMM is compiled for {TILE_ROWS:?}")));
    }
    if logits.splits == 0 || logits.plane < ntok * dims.n_experts {
        return Err(CudaError::shape(
            "moe_plan",
            format!("{} logit planes of {} floats for {ntok} tokens of {} experts", logits.splits, logits.plane, dims.n_experts),
        ));
    }
    if ntok == 0 {
        return Ok(());
    }
    let r = MoeRoutePlanParams {
        logits: logits.ptr,
        topk_idx: b.topk_idx,
        topk_w: b.topk_w,
        counts: b.counts,
        rank: b.rank,
        offsets: b.offsets,
        tiles: b.tiles,
        ntiles: b.ntiles,
        ticket: b.ticket,
        plane: logits.plane as i64,
        splits: logits.splits as i32,
        ntok: ntok as i32,
        bm: bm as i32,
    };
    launch_pdl(gpu, k, "moe_route_plan", (ntok.div_ceil(ROUTE_WARPS) as u32, 1, 1), (32 * ROUTE_WARPS) as u32, 0, &r)?;
    let s = MoeScatterParams { topk_idx: b.topk_idx, rank: b.rank, offsets: b.offsets, perm: b.perm, inv: b.inv, ntok: ntok as i32 };
    launch_pdl(gpu, k, "moe_scatter", ((ntok * dims.topk).div_ceil(256) as u32, 1, 1), 256, 0, &s)
}

/// h[t] += sum_k w[t][k] y[inv[t][k]] + sigmoid(sg[t]) ys[t]; with `norm`,
/// also the next layer's normalised input of the new rows.
#[allow(clippy::too_many_arguments)]
pub fn combine(gpu: &Gpu, k: &Kernels, h: u64, y: u64, ys: u64, sg_logits: u64, b: &RouteBufs, ntok: usize, norm: Option<NextNorm>) -> CudaResult<()> {
    if ntok == 0 {
        return Ok(());
    }
    let (gain, xn, eps) = norm.map_or((0, 0, 0.0), |n| (n.gain, n.xn, n.eps));
    let p = MoeCombineParams { h, y, ys, sg_logits, inv: b.inv, topk_w: b.topk_w, gain, xn, eps };
    launch(gpu, k, "moe_combine", (ntok as u32, 1, 1), MOE_COMBINE_THREADS as u32, 0, &p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_tile_height_holds_1_6_times_the_average_group_in_register_tiles() {
        let d = Dims::from_config(&lily_core::config::production()).expect("dims");
        // 256 experts, top-8: average tokens per expert = ntok / 32.
        for (ntok, bm) in [(1, 16), (265, 16), (320, 16), (321, 64), (640, 64), (641, 64), (1280, 64), (1281, 128), (4096, 128), (16384, 128)] {
            assert_eq!(tile_rows(&d, ntok), bm, "{ntok} tokens");
        }
        for ntok in [1usize, 100, 256, 1000, 4096] {
            let bm = tile_rows(&d, ntok);
            assert!(max_tiles(&d, ntok, bm) <= max_tiles_any(&d, ntok), "the plan's tile list holds every height");
        }
    }
}
