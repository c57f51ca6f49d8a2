//! Launcher of kernels/gemv.cu: several packed matrices that read the same
//! input, for up to `GEMV_MAX_TOK` tokens, with the input's RMSNorm, the
//! residual add and the lm_head argmax fused in (see the kernel's header).

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::dims::GEMV_MAX_TOK;
use crate::error::{CudaError, CudaResult};
use crate::kernels::Kernels;
use crate::launch::{launch, persistent_grid};
use crate::weights::QMat;

pub const GEMV_MAX_SEGS: usize = 8;
const GEMV_ROWS: usize = 4;
const GEMV_WARPS: usize = 8;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GemvSegC {
    codes: u64,
    scales: u64,
    biases: u64,
    out: u64,
    rows: i32,
    bits: i32,
    out_stride: i32,
    accumulate: i32,
    task_start: i32,
    argmax: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct GemvParamsC {
    seg: [GemvSegC; GEMV_MAX_SEGS],
    x: u64,
    gain: u64,
    argmax_keys: u64,
    nseg: i32,
    ntasks: i32,
    cols: i32,
    x_stride: i32,
    ntok: i32,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `GemvParams` in gemv.cu.
unsafe impl DeviceRepr for GemvParamsC {}

/// One output matrix of a GEMV launch.
#[derive(Clone, Copy)]
pub struct GemvSeg<'a> {
    pub w: &'a QMat,
    /// out[t * out_stride + row] (f32).
    pub out: u64,
    pub out_stride: usize,
    /// Add into `out` (residual) instead of storing.
    pub accumulate: bool,
    /// Fold this segment's rows into the per-token argmax keys.
    pub argmax: bool,
}

/// The input of a GEMV launch.
#[derive(Clone, Copy)]
pub struct GemvInput {
    /// f32 [ntok][stride].
    pub x: u64,
    pub stride: usize,
    pub ntok: usize,
    /// RMSNorm gain (f32 [cols]) applied to x first, with `eps`.
    pub norm: Option<(u64, f32)>,
}

pub fn gemv(gpu: &Gpu, k: &Kernels, segs: &[GemvSeg], input: GemvInput, argmax_keys: u64) -> CudaResult<()> {
    const NAME: &str = "gemv_q";
    if segs.is_empty() || segs.len() > GEMV_MAX_SEGS {
        return Err(CudaError::shape(NAME, format!("{} segments, expected 1..={GEMV_MAX_SEGS}", segs.len())));
    }
    if input.ntok == 0 || input.ntok > GEMV_MAX_TOK {
        return Err(CudaError::shape(NAME, format!("{} tokens, expected 1..={GEMV_MAX_TOK}", input.ntok)));
    }
    let cols = segs[0].w.cols;
    if !cols.is_multiple_of(64) || input.stride < cols || !input.stride.is_multiple_of(4) {
        return Err(CudaError::shape(NAME, format!("cols {cols} (multiple of 64), input stride {}", input.stride)));
    }
    let mut p = GemvParamsC {
        seg: [GemvSegC::default(); GEMV_MAX_SEGS],
        x: input.x,
        gain: input.norm.map(|n| n.0).unwrap_or(0),
        argmax_keys,
        nseg: segs.len() as i32,
        ntasks: 0,
        cols: cols as i32,
        x_stride: input.stride as i32,
        ntok: input.ntok as i32,
        eps: input.norm.map(|n| n.1).unwrap_or(0.0),
    };
    let mut tasks = 0usize;
    for (i, s) in segs.iter().enumerate() {
        if s.w.cols != cols || s.w.experts != 1 || !(s.w.bits == 4 || s.w.bits == 8) {
            return Err(CudaError::shape(
                NAME,
                format!("segment {i}: {}x{} {}-bit with {} experts; expected {cols} cols, 4/8-bit, one expert", s.w.rows, s.w.cols, s.w.bits, s.w.experts),
            ));
        }
        if s.argmax && argmax_keys == 0 {
            return Err(CudaError::shape(NAME, "argmax segment without a key buffer"));
        }
        p.seg[i] = GemvSegC {
            codes: s.w.codes,
            scales: s.w.scales,
            biases: s.w.biases,
            out: s.out,
            rows: s.w.rows as i32,
            bits: s.w.bits as i32,
            out_stride: s.out_stride as i32,
            accumulate: s.accumulate as i32,
            task_start: tasks as i32,
            argmax: s.argmax as i32,
        };
        tasks += s.w.rows.div_ceil(GEMV_ROWS);
    }
    p.ntasks = tasks as i32;
    let padded = cols + cols / 32 * 4;
    let smem = (input.ntok * padded + input.ntok * cols / 16 + 32) * 4 + GEMV_WARPS * GEMV_MAX_TOK * 8;
    // One entry point per token count (register budget); as many resident
    // blocks per multiprocessor as the kernel's registers allow.
    let (name, per_sm) = match input.ntok {
        1 => ("gemv_q1", 2),
        2 => ("gemv_q2", 1),
        3 => ("gemv_q3", 1),
        _ => ("gemv_q4", 1),
    };
    let grid = persistent_grid(gpu, tasks, GEMV_WARPS, per_sm);
    launch(gpu, k, name, (grid, 1, 1), (GEMV_WARPS * 32) as u32, smem, &p)
}
