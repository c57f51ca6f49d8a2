//! Launchers of kernels/gemm.cu: the tensor-core GEMM with 4/8-bit weights
//! dequantised in the tile (dense and grouped by expert) and the RMSNorm
//! that produces its fp16 input.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::dims::{GEMM_BM, GEMM_BN};
use crate::error::{CudaError, CudaResult};
use crate::kernels::Kernels;
use crate::launch::launch;
use crate::weights::QMat;

#[repr(C)]
#[derive(Clone, Copy)]
struct GemmParams {
    a: u64,
    a_rows: u64,
    codes: u64,
    scales: u64,
    biases: u64,
    codes2: u64,
    scales2: u64,
    biases2: u64,
    out_f32: u64,
    out_f16: u64,
    tiles: u64,
    ntiles: u64,
    e_codes: i64,
    e_groups: i64,
    lda: i32,
    ldc: i32,
    m: i32,
    n: i32,
    k: i32,
    mode: i32,
}
// SAFETY: plain-old-data mirroring `GemmParams` in gemm.cu.
unsafe impl DeviceRepr for GemmParams {}

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

/// Row grouping of an MoE GEMM.
#[derive(Clone, Copy)]
pub struct Grouping {
    /// i32 [max_tiles][3] (expert, row start, row end) and its device count.
    pub tiles: u64,
    pub ntiles: u64,
    pub max_tiles: usize,
    /// i32: sorted row -> A row (0: identity).
    pub a_rows: u64,
}

/// C = A W^T: `a` fp16 [rows][lda]; `m` rows (dense) or the grouping's
/// rows; `up` is the second matrix of SwiGLU.
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
    const NAME: &str = "gemm";
    if !w.cols.is_multiple_of(64) || lda < w.cols || !lda.is_multiple_of(8) {
        return Err(CudaError::shape(NAME, format!("K = {} (multiple of 64), lda = {lda} (multiple of 8, >= K)", w.cols)));
    }
    if group.is_none() && w.experts != 1 {
        return Err(CudaError::shape(NAME, "stacked experts need a grouping"));
    }
    let swiglu = matches!(out, GemmOut::SwiGlu(_));
    let upm = match (swiglu, up) {
        (true, Some(u)) => {
            if u.rows != w.rows || u.cols != w.cols || u.experts != w.experts || u.bits != w.bits {
                return Err(CudaError::shape(NAME, "gate and up matrices differ in shape"));
            }
            *u
        }
        (true, None) => return Err(CudaError::shape(NAME, "SwiGLU needs the up matrix")),
        (false, _) => QMat::default(),
    };
    let (mode, out_f32, out_f16) = match out {
        GemmOut::Store(p) => (0, p, 0),
        GemmOut::Add(p) => (1, p, 0),
        GemmOut::SwiGlu(p) => (2, 0, p),
    };
    let name = match w.bits {
        4 => "gemm_q4",
        8 => "gemm_q8",
        b => return Err(CudaError::shape(NAME, format!("{b}-bit weights"))),
    };
    let p = GemmParams {
        a,
        a_rows: group.map(|g| g.a_rows).unwrap_or(0),
        codes: w.codes,
        scales: w.scales,
        biases: w.biases,
        codes2: upm.codes,
        scales2: upm.scales,
        biases2: upm.biases,
        out_f32,
        out_f16,
        tiles: group.map(|g| g.tiles).unwrap_or(0),
        ntiles: group.map(|g| g.ntiles).unwrap_or(0),
        e_codes: w.expert_words() as i64,
        e_groups: w.expert_groups() as i64,
        lda: lda as i32,
        ldc: ldc as i32,
        m: m as i32,
        n: w.rows as i32,
        k: w.cols as i32,
        mode,
    };
    let n_tiles = if swiglu { w.rows.div_ceil(GEMM_BN / 2) } else { w.rows.div_ceil(GEMM_BN) };
    let m_tiles = match group {
        Some(g) => g.max_tiles,
        None => m.div_ceil(GEMM_BM),
    };
    if m_tiles == 0 {
        return Ok(());
    }
    let smem = 2 * 2 * GEMM_BM * (64 + 8) * 2;
    launch(gpu, k, name, (n_tiles as u32, m_tiles as u32, 1), 256, smem, &p)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct RmsnormParams {
    x: u64,
    gain: u64,
    out: u64,
    cols: i32,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `RmsnormParams` in gemm.cu.
unsafe impl DeviceRepr for RmsnormParams {}

/// out (fp16 [rows][cols]) = RMSNorm(x (f32 [rows][cols])) * gain.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_f16(gpu: &Gpu, k: &Kernels, x: u64, gain: u64, out: u64, rows: usize, cols: usize, eps: f32) -> CudaResult<()> {
    if rows == 0 {
        return Ok(());
    }
    let p = RmsnormParams { x, gain, out, cols: cols as i32, eps };
    launch(gpu, k, "rmsnorm_f16", (rows as u32, 1, 1), 256, 0, &p)
}
