//! Launcher of kernels/sampling.cu: the end of a greedy decode step on the
//! device (argmax keys to token ids, position and step counters advanced),
//! so consecutive steps never return to the host.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::error::{CudaError, CudaResult};
use crate::kernels::Kernels;
use crate::launch::launch;

#[repr(C)]
#[derive(Clone, Copy)]
struct ArgmaxFinishParams {
    keys: u64,
    tokens: u64,
    out_ids: u64,
    positions: u64,
    step: u64,
    ntok: i32,
}
// SAFETY: plain-old-data mirroring `ArgmaxFinishParams` in sampling.cu.
unsafe impl DeviceRepr for ArgmaxFinishParams {}

/// tokens[t] = argmax; out_ids[*step][t] = argmax (when out_ids != 0);
/// positions[t] += 1; *step += 1.
#[allow(clippy::too_many_arguments)]
pub fn argmax_finish(gpu: &Gpu, k: &Kernels, keys: u64, tokens: u64, out_ids: u64, positions: u64, step: u64, ntok: usize) -> CudaResult<()> {
    if ntok == 0 || ntok > 1024 {
        return Err(CudaError::shape("argmax_finish", format!("{ntok} tokens, expected 1..=1024")));
    }
    let p = ArgmaxFinishParams { keys, tokens, out_ids, positions, step, ntok: ntok as i32 };
    let threads = (ntok.div_ceil(32) * 32) as u32;
    launch(gpu, k, "argmax_finish", (1, 1, 1), threads, 0, &p)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct ArgmaxRowsParams {
    logits: u64,
    keys: u64,
    cols: i32,
}
// SAFETY: plain-old-data mirroring `ArgmaxRowsParams` in sampling.cu.
unsafe impl DeviceRepr for ArgmaxRowsParams {}

/// keys[r] = packed argmax of logits row r (f32 [rows][cols]).
pub fn argmax_rows(gpu: &Gpu, k: &Kernels, logits: u64, keys: u64, rows: usize, cols: usize) -> CudaResult<()> {
    if rows == 0 {
        return Ok(());
    }
    let p = ArgmaxRowsParams { logits, keys, cols: cols as i32 };
    launch(gpu, k, "argmax_rows", (rows as u32, 1, 1), 256, 0, &p)
}

/// Token id of a packed argmax key (see argmax_key in common.cuh).
pub fn key_index(key: u64) -> u32 {
    0xffff_ffffu32 - (key & 0xffff_ffff) as u32
}
