//! Launcher of kernels/synth.cu: deterministic random fills of device
//! memory, used to build synthetic weights at the real shape directly on the
//! GPU (weights::synthetic) for speed probes.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::error::CudaResult;
use crate::kernels::Kernels;
use crate::launch::launch;

#[repr(C)]
#[derive(Clone, Copy)]
struct FillParams {
    ptr: u64,
    n: u64,
    seed: u64,
    lo: f32,
    hi: f32,
    kind: i32,
}
// SAFETY: plain-old-data mirroring `FillParams` in synth.cu.
unsafe impl DeviceRepr for FillParams {}

/// What to fill with.
#[derive(Clone, Copy, Debug)]
pub enum Fill {
    /// Uniform random u32 words.
    Words,
    /// f32 uniform in [lo, hi).
    F32(f32, f32),
    /// bf16 uniform in [lo, hi).
    Bf16(f32, f32),
}

pub fn fill(gpu: &Gpu, k: &Kernels, ptr: u64, n: usize, what: Fill, seed: u64) -> CudaResult<()> {
    if n == 0 {
        return Ok(());
    }
    let (kind, lo, hi) = match what {
        Fill::Words => (0, 0.0, 0.0),
        Fill::F32(lo, hi) => (1, lo, hi),
        Fill::Bf16(lo, hi) => (2, lo, hi),
    };
    let p = FillParams { ptr, n: n as u64, seed, lo, hi, kind };
    let grid = n.div_ceil(256).min(gpu.sm_count as usize * 16).max(1) as u32;
    launch(gpu, k, "fill_random", (grid, 1, 1), 256, 0, &p)
}
