//! Launcher of kernels/sampling.cu: the end of a greedy decode step on the
//! device (argmax keys to token ids, position and step counters advanced),
//! so consecutive steps never return to the host; and `sample_rows`, the
//! full sampler (penalties, temperature, top-k / top-p / min-p, a Philox
//! draw) with the semantics of `lily_model::sample`.

use cudarc::driver::DeviceRepr;

use lily_model::SampleParams;

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

/// One row's sampling parameters, mirroring `SampleRow` in sampling.cu
/// (56 bytes: six f32, top_k, padding, seed, step, count-table pointer).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleRow {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub presence: f32,
    pub frequency: f32,
    pub repetition: f32,
    pub top_k: u32,
    pad: u32,
    pub seed: u64,
    pub step: u64,
    /// Device address of the row's count table (u32 [vocab], see
    /// `lily_model::sample::SEEN_IN_PROMPT`), or 0 for no penalties.
    pub counts: u64,
}
// SAFETY: plain-old-data mirroring `SampleRow` in sampling.cu.
unsafe impl DeviceRepr for SampleRow {}

impl SampleRow {
    pub fn new(p: &SampleParams, step: u64, counts: u64) -> Self {
        SampleRow {
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            presence: p.presence_penalty,
            frequency: p.frequency_penalty,
            repetition: p.repetition_penalty,
            top_k: p.top_k,
            pad: 0,
            seed: p.seed,
            step,
            counts,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct SampleRowsParams {
    logits: u64,
    rows: u64,
    out_tokens: u64,
    out_logprobs: u64,
    vocab: i32,
    row_stride: i32,
}
// SAFETY: plain-old-data mirroring `SampleParams` in sampling.cu.
unsafe impl DeviceRepr for SampleRowsParams {}

/// Threads of a `sample_rows` block (SAMPLE_THREADS in sampling.cu).
pub const SAMPLE_THREADS: u32 = 512;

/// For each of `n` rows of `logits` (f32 [n][vocab]) with parameters
/// `rows` (SampleRow [n]): out_tokens[r] = the chosen token, out_logprobs[r]
/// = its logprob (penalised, before temperature); the chosen token's count
/// in the row's table (if any) is incremented. One block per row.
#[allow(clippy::too_many_arguments)]
pub fn sample_rows(gpu: &Gpu, k: &Kernels, logits: u64, rows: u64, out_tokens: u64, out_logprobs: u64, n: usize, vocab: usize) -> CudaResult<()> {
    sample_rows_strided(gpu, k, logits, vocab, rows, out_tokens, out_logprobs, n, vocab)
}

/// `sample_rows` with row r of the logits at `logits + r * row_stride`
/// floats; `row_stride` 0 makes every row read the same logits (many draws
/// of one distribution, e.g. `n` beams or the tests' histograms).
#[allow(clippy::too_many_arguments)]
pub fn sample_rows_strided(
    gpu: &Gpu,
    k: &Kernels,
    logits: u64,
    row_stride: usize,
    rows: u64,
    out_tokens: u64,
    out_logprobs: u64,
    n: usize,
    vocab: usize,
) -> CudaResult<()> {
    if n == 0 {
        return Ok(());
    }
    if vocab == 0 || vocab > i32::MAX as usize || row_stride > i32::MAX as usize || (row_stride != 0 && row_stride < vocab) {
        return Err(CudaError::shape("sample_rows", format!("vocab {vocab}, row stride {row_stride}: expected 1..2^31 and a stride of 0 or >= vocab")));
    }
    if n > i32::MAX as usize {
        return Err(CudaError::shape("sample_rows", format!("{n} rows")));
    }
    let p = SampleRowsParams { logits, rows, out_tokens, out_logprobs, vocab: vocab as i32, row_stride: row_stride as i32 };
    launch(gpu, k, "sample_rows", (n as u32, 1, 1), SAMPLE_THREADS, 0, &p)
}
