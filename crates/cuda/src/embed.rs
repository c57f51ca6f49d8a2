//! Launcher of kernels/embed.cu: the embedding gather from the packed 4-bit
//! table into the f32 residual stream.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::dims::Dims;
use crate::error::{CudaError, CudaResult};
use crate::kernels::Kernels;
use crate::launch::launch;
use crate::weights::QMat;

#[repr(C)]
#[derive(Clone, Copy)]
struct EmbedParams {
    codes: u64,
    scales: u64,
    biases: u64,
    tokens: u64,
    h: u64,
    argmax_keys: u64,
}
// SAFETY: plain-old-data mirroring `EmbedParams` in embed.cu.
unsafe impl DeviceRepr for EmbedParams {}

/// h[t] = dequant(embed[tokens[t]]) for `ntok` tokens (u32 ids on the
/// device); also zeroes `argmax_keys[t]` when given (0 = none).
#[allow(clippy::too_many_arguments)]
pub fn embed(gpu: &Gpu, k: &Kernels, dims: &Dims, table: &QMat, tokens: u64, h: u64, argmax_keys: u64, ntok: usize) -> CudaResult<()> {
    if table.bits != 4 || table.rows != dims.vocab || table.cols != dims.hidden {
        return Err(CudaError::shape(
            "embed_q4",
            format!("table {}x{} {}-bit, expected {}x{} 4-bit", table.rows, table.cols, table.bits, dims.vocab, dims.hidden),
        ));
    }
    if ntok == 0 {
        return Ok(());
    }
    let p = EmbedParams { codes: table.codes, scales: table.scales, biases: table.biases, tokens, h, argmax_keys };
    launch(gpu, k, "embed_q4", (ntok as u32, 1, 1), 256, 0, &p)
}
