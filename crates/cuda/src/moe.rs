//! Launchers of kernels/moe.cu: the fused decode experts (only the chosen
//! experts' weights are read) and the prefill routing (top-k, grouping of
//! tokens by expert, the weighted combine). The grouped expert GEMMs
//! themselves are in gemm.rs.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::dims::{Dims, GEMV_MAX_TOK};
use crate::error::{CudaError, CudaResult};
use crate::kernels::Kernels;
use crate::launch::{launch, persistent_grid};
use crate::weights::{MoeDev, QMat};

#[repr(C)]
#[derive(Clone, Copy)]
struct QMatC {
    codes: u64,
    scales: u64,
    biases: u64,
}

impl From<&QMat> for QMatC {
    fn from(m: &QMat) -> Self {
        QMatC { codes: m.codes, scales: m.scales, biases: m.biases }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct MoeUpParams {
    gate: QMatC,
    up: QMatC,
    sh_gate: QMatC,
    sh_up: QMatC,
    x: u64,
    gain: u64,
    router_logits: u64,
    sg_logits: u64,
    act: u64,
    topk_idx: u64,
    topk_w: u64,
    x_stride: i32,
    ntok: i32,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `MoeUpParams` in moe.cu.
unsafe impl DeviceRepr for MoeUpParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct MoeDownParams {
    down: QMatC,
    sh_down: QMatC,
    act: u64,
    topk_idx: u64,
    topk_w: u64,
    h: u64,
    h_stride: i32,
    ntok: i32,
}
// SAFETY: plain-old-data mirroring `MoeDownParams` in moe.cu.
unsafe impl DeviceRepr for MoeDownParams {}

/// Device buffers of the decode MoE.
#[derive(Clone, Copy)]
pub struct MoeDecodeBufs {
    /// f32 [ntok][experts] router logits (written by the router GEMV).
    pub router_logits: u64,
    /// f32 [ntok] shared-expert gate logits.
    pub sg_logits: u64,
    /// f32 [ntok][topk + 1][inter].
    pub act: u64,
    /// i32 [ntok][topk].
    pub topk_idx: u64,
    /// f32 [ntok][topk + 1].
    pub topk_w: u64,
}

fn check_moe(dims: &Dims, m: &MoeDev, name: &'static str) -> CudaResult<()> {
    let ok = |q: &QMat, rows: usize, cols: usize, experts: usize| q.rows == rows && q.cols == cols && q.experts == experts && q.bits == 4;
    let (h, i, e) = (dims.hidden, dims.moe_inter, dims.n_experts);
    if !(ok(&m.gate, i, h, e) && ok(&m.up, i, h, e) && ok(&m.down, h, i, e) && ok(&m.sh_gate, i, h, 1) && ok(&m.sh_up, i, h, 1) && ok(&m.sh_down, h, i, 1)) {
        return Err(CudaError::shape(name, format!("expert matrices do not match hidden {h}, intermediate {i}, {e} experts, 4-bit")));
    }
    Ok(())
}

/// act = silu(gate x) * (up x) for the chosen experts and the shared one;
/// x = RMSNorm(h) with `gain`.
#[allow(clippy::too_many_arguments)]
pub fn gate_up(gpu: &Gpu, k: &Kernels, dims: &Dims, m: &MoeDev, h: u64, h_stride: usize, gain: u64, ntok: usize, b: &MoeDecodeBufs) -> CudaResult<()> {
    const NAME: &str = "moe_gate_up";
    check_moe(dims, m, NAME)?;
    if ntok == 0 || ntok > GEMV_MAX_TOK {
        return Err(CudaError::shape(NAME, format!("{ntok} tokens, expected 1..={GEMV_MAX_TOK}")));
    }
    let p = MoeUpParams {
        gate: (&m.gate).into(),
        up: (&m.up).into(),
        sh_gate: (&m.sh_gate).into(),
        sh_up: (&m.sh_up).into(),
        x: h,
        gain,
        router_logits: b.router_logits,
        sg_logits: b.sg_logits,
        act: b.act,
        topk_idx: b.topk_idx,
        topk_w: b.topk_w,
        x_stride: h_stride as i32,
        ntok: ntok as i32,
        eps: dims.rms_eps,
    };
    let hd = dims.hidden;
    let smem = (ntok * (hd + hd / 32 * 4) + ntok * hd / 16 + 32) * 4 + 8 * dims.topk * 4 * 2;
    let tasks = ntok * (dims.topk + 1) * dims.moe_inter / 2;
    let grid = persistent_grid(gpu, tasks, 8, 2);
    launch(gpu, k, NAME, (grid, 1, 1), 256, smem, &p)
}

/// h += sum over slots of w_slot * down_slot(act_slot).
#[allow(clippy::too_many_arguments)]
pub fn down(gpu: &Gpu, k: &Kernels, dims: &Dims, m: &MoeDev, h: u64, h_stride: usize, ntok: usize, b: &MoeDecodeBufs) -> CudaResult<()> {
    const NAME: &str = "moe_down";
    check_moe(dims, m, NAME)?;
    if ntok == 0 || ntok > GEMV_MAX_TOK {
        return Err(CudaError::shape(NAME, format!("{ntok} tokens, expected 1..={GEMV_MAX_TOK}")));
    }
    let p = MoeDownParams {
        down: (&m.down).into(),
        sh_down: (&m.sh_down).into(),
        act: b.act,
        topk_idx: b.topk_idx,
        topk_w: b.topk_w,
        h,
        h_stride: h_stride as i32,
        ntok: ntok as i32,
    };
    let i = dims.moe_inter;
    let slots = dims.topk + 1;
    let smem = (ntok * slots * (i + i / 32 * 4) + ntok * slots * i / 16 + 8 * slots + 8 * dims.topk) * 4;
    let tasks = ntok * dims.hidden / 4;
    let grid = persistent_grid(gpu, tasks, 8, 2);
    launch(gpu, k, NAME, (grid, 1, 1), 256, smem, &p)
}

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
