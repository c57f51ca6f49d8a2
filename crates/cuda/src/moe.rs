//! Launchers of kernels/moe.cu: the prefill routing (top-k, grouping of
//! tokens by expert, the weighted combine). The grouped expert GEMMs
//! themselves are in gemm.rs; the decode step's MoE is in qmm.rs.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::dims::Dims;
use crate::error::CudaResult;
use crate::kernels::Kernels;
use crate::launch::launch;

#[repr(C)]
#[derive(Clone, Copy)]
struct MoeRouteParams {
    logits: u64,
    topk_idx: u64,
    topk_w: u64,
    counts: u64,
    rank: u64,
    ntok: i32,
}
// SAFETY: plain-old-data mirroring `MoeRouteParams` in moe.cu.
unsafe impl DeviceRepr for MoeRouteParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct MoePlanParams {
    counts: u64,
    offsets: u64,
    tiles: u64,
    ntiles: u64,
    bm: i32,
}
// SAFETY: plain-old-data mirroring `MoePlanParams` in moe.cu.
unsafe impl DeviceRepr for MoePlanParams {}

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
}
// SAFETY: plain-old-data mirroring `MoeCombineParams` in moe.cu.
unsafe impl DeviceRepr for MoeCombineParams {}

/// Device buffers of the prefill routing.
#[derive(Clone, Copy)]
pub struct RouteBufs {
    pub logits: u64,
    pub topk_idx: u64,
    pub topk_w: u64,
    /// i32 [experts]; zeroed by `route`.
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
}

/// Upper bound of the grouped-GEMM tiles for `ntok` tokens.
pub fn max_tiles(dims: &Dims, ntok: usize, bm: usize) -> usize {
    (ntok * dims.topk).div_ceil(bm) + dims.n_experts
}

/// Top-k, counts, ranks, offsets, tile list, sorted positions.
pub fn route(gpu: &Gpu, k: &Kernels, dims: &Dims, b: &RouteBufs, ntok: usize, bm: usize) -> CudaResult<()> {
    if ntok == 0 {
        return Ok(());
    }
    crate::device::zero_device(gpu, b.counts, dims.n_experts * 4)?;
    let r = MoeRouteParams { logits: b.logits, topk_idx: b.topk_idx, topk_w: b.topk_w, counts: b.counts, rank: b.rank, ntok: ntok as i32 };
    launch(gpu, k, "moe_route", (ntok.div_ceil(8) as u32, 1, 1), 256, 0, &r)?;
    let pl = MoePlanParams { counts: b.counts, offsets: b.offsets, tiles: b.tiles, ntiles: b.ntiles, bm: bm as i32 };
    launch(gpu, k, "moe_plan", (1, 1, 1), 256, 0, &pl)?;
    let s = MoeScatterParams { topk_idx: b.topk_idx, rank: b.rank, offsets: b.offsets, perm: b.perm, inv: b.inv, ntok: ntok as i32 };
    launch(gpu, k, "moe_scatter", ((ntok * dims.topk).div_ceil(256) as u32, 1, 1), 256, 0, &s)
}

/// h[t] += sum_k w[t][k] y[inv[t][k]] + sigmoid(sg[t]) ys[t].
#[allow(clippy::too_many_arguments)]
pub fn combine(gpu: &Gpu, k: &Kernels, h: u64, y: u64, ys: u64, sg_logits: u64, b: &RouteBufs, ntok: usize) -> CudaResult<()> {
    if ntok == 0 {
        return Ok(());
    }
    let p = MoeCombineParams { h, y, ys, sg_logits, inv: b.inv, topk_w: b.topk_w };
    launch(gpu, k, "moe_combine", (ntok as u32, 1, 1), 256, 0, &p)
}
