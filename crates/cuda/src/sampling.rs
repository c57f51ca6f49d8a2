//! Launcher of kernels/sampling.cu: the end of a greedy decode step on the
//! device (argmax keys to token ids, position and step counters advanced),
//! so consecutive steps never return to the host; and `sample_rows`, the
//! full sampler (penalties, temperature, top-k / top-p / min-p, a Philox
//! draw) with the semantics of `lily_model::sample`. Greedy rows and rows
//! with a small top_k take a fast path (the row split over many blocks,
//! then one merge); every other row, and any row whose top-k boundary the
//! fast path cannot prove exact, runs the one-block-per-row kernel.

use cudarc::driver::DeviceRepr;

use std::sync::Arc;

use lily_model::{SampleParams, Sampled};

use crate::device::{zero_device, DeviceBuffer, Gpu};
use crate::error::{CudaError, CudaResult};
use crate::kernels::Kernels;
use crate::launch::{launch, launch_pdl};

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

/// keys[r] = packed argmax of logits row r (f32 [rows][cols]): the keys are
/// cleared, then `ceil(cols / ARGMAX_CHUNK)` blocks a row each merge the
/// largest key of their columns (atomicMax, so the result does not depend
/// on the order the blocks finish).
pub fn argmax_rows(gpu: &Gpu, k: &Kernels, logits: u64, keys: u64, rows: usize, cols: usize) -> CudaResult<()> {
    if rows == 0 {
        return Ok(());
    }
    if cols == 0 || cols > i32::MAX as usize || rows > u16::MAX as usize {
        return Err(CudaError::shape("argmax_rows", format!("{rows} rows of {cols} logits")));
    }
    zero_device(gpu, keys, rows * 8)?;
    let p = ArgmaxRowsParams { logits, keys, cols: cols as i32 };
    launch(gpu, k, "argmax_rows", (cols.div_ceil(ARGMAX_CHUNK) as u32, rows as u32, 1), ARGMAX_THREADS, 0, &p)
}

/// Token id of a packed argmax key (see argmax_key in common.cuh).
pub fn key_index(key: u64) -> u32 {
    0xffff_ffffu32 - (key & 0xffff_ffff) as u32
}

/// Logits one `argmax_rows` block reduces (a multiple of 4 x
/// `ARGMAX_THREADS`: whole 16-byte loads, 8 a thread in flight).
pub const ARGMAX_CHUNK: usize = 8192;
/// Threads of an `argmax_rows` block.
pub const ARGMAX_THREADS: u32 = 256;

/// Threads of a `sample_rows` block (SAMPLE_THREADS in sampling.cu).
pub const SAMPLE_THREADS: u32 = 512;
/// Most top logprobs a row reports (OpenAI's limit for `top_logprobs`);
/// the row stride of the top-logprob outputs.
pub const SAMPLE_TOP_MAX: usize = 20;

/// Blocks a row is split into by the fast path's first kernel
/// (`sample_fast_chunks`).
pub const SAMPLE_FAST_CHUNKS: u32 = 64;
/// Threads of a `sample_fast_chunks` block.
pub const SAMPLE_FAST_THREADS: u32 = 256;
/// Keys a `sample_fast_chunks` thread holds in registers at once: the
/// kernel reads its chunk in segments of this many ids a thread (one
/// segment at the real vocabulary: 3,880 ids a chunk, 16 x 256 a segment).
pub const SAMPLE_FAST_HELD: usize = 16;
/// Keys each chunk keeps and the merge yields (one per lane of a warp
/// list; the kernel asserts 32).
pub const SAMPLE_FAST_KEEP: usize = 32;
/// The largest top_k the fast path takes; the margin up to
/// `SAMPLE_FAST_KEEP` is what lets it prove a top-k boundary exact.
pub const SAMPLE_FAST_TOP_K: u32 = 24;
/// Rows of one fast-path launch pair (the kernels' scratch is sized for
/// them: 64 x 32 keys and 64 sums a row, about 4.2 MB of module memory);
/// larger batches run in groups.
pub const SAMPLE_FAST_ROWS: usize = 256;
/// The token `SamplePath::FastProbe` writes for a row the fast path does
/// not decide.
pub const SAMPLE_UNDECIDED: u32 = u32::MAX - 1;

/// Which kernels `sample_rows_path` runs; all give the same tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplePath {
    /// The fast path for the rows it proves exact, `sample_rows` for the
    /// rest (what `sample_rows` and `sample_rows_strided` use).
    Auto,
    /// The one-block-per-row kernel for every row.
    Slow,
    /// The fast path only: a row it does not decide (off the fast path, or
    /// an unprovable boundary) gets token `SAMPLE_UNDECIDED` and no other
    /// output or count update. For tests and measurements.
    FastProbe,
}

/// One row's sampling parameters, mirroring `SampleRow` in sampling.cu
/// (64 bytes: six f32 at 0..24, top_k 24, top_logprobs 28, vocab_limit 32,
/// padding 36, seed 40, step 48, count-table pointer 56; `defines` hands
/// these offsets to the kernel, which asserts them).
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
    /// 0 = none; the kernel reads more than `SAMPLE_TOP_MAX` as
    /// `SAMPLE_TOP_MAX` (`CudaBackend::decode_sample` refuses them).
    pub top_logprobs: u32,
    /// 0 = the whole row; ids at or beyond it are never drawn nor reported.
    pub vocab_limit: u32,
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
            top_logprobs: p.top_logprobs,
            vocab_limit: p.vocab_limit,
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
    out_top_ids: u64,
    out_top_logprobs: u64,
    vocab: i32,
    row_stride: i32,
    keep_slots: u64,
    keep_last: u64,
}
// SAFETY: plain-old-data mirroring `SampleParams` in sampling.cu.
unsafe impl DeviceRepr for SampleRowsParams {}

/// `-D<PREFIX>_BYTES=size` and `-D<PREFIX>_AT_<FIELD>=offset` for the
/// listed fields of a mirrored struct.
macro_rules! layout_defines {
    ($ty:ty, $prefix:literal, $($field:ident),+ $(,)?) => {
        vec![
            format!("-D{}_BYTES={}", $prefix, std::mem::size_of::<$ty>()),
            $(format!("-D{}_AT_{}={}", $prefix, stringify!($field).to_uppercase(), std::mem::offset_of!($ty, $field)),)+
        ]
    };
}
// feed.rs mirrors its parameter structs the same way.
pub(crate) use layout_defines;

/// Tests of a mirrored layout: asserts that kernel source `source` (file
/// `file`) checks every `_AT_` offset and `_BYTES` size of `defs` (a
/// `MIRRORED(...)` or a `== NAME,` static_assert), and returns how many
/// fields it found.
#[cfg(test)]
pub(crate) fn count_asserted_fields(source: &str, file: &str, defs: &[String]) -> usize {
    let mut fields = 0;
    for d in defs {
        let name = d.trim_start_matches("-D").split('=').next().unwrap_or("");
        if name.contains("_AT_") {
            fields += 1;
            assert!(source.contains(&format!("{name});")), "{file} does not assert {name}");
        } else if name.ends_with("_BYTES") {
            assert!(source.contains(&format!("== {name},")), "{file} does not assert the size {name}");
        }
    }
    fields
}

/// The constants and struct layouts sampling.cu shares with this file, as
/// NVRTC defines (every family is compiled with them, see `Dims::defines`):
/// the block sizes, the top-logprob stride, the fast path's shape, and the size and every field
/// offset of `SampleRow` and of the parameter struct, which the kernel
/// checks with static_asserts.
pub fn defines() -> Vec<String> {
    let mut v = vec![
        format!("-DARGMAX_CHUNK={ARGMAX_CHUNK}"),
        format!("-DARGMAX_THREADS={ARGMAX_THREADS}"),
        format!("-DSAMPLE_THREADS={SAMPLE_THREADS}"),
        format!("-DSAMPLE_TOP_MAX={SAMPLE_TOP_MAX}"),
        format!("-DSAMPLE_FAST_CHUNKS={SAMPLE_FAST_CHUNKS}"),
        format!("-DSAMPLE_FAST_THREADS={SAMPLE_FAST_THREADS}"),
        format!("-DSAMPLE_FAST_KEEP={SAMPLE_FAST_KEEP}"),
        format!("-DSAMPLE_FAST_HELD={SAMPLE_FAST_HELD}"),
        format!("-DSAMPLE_FAST_TOP_K={SAMPLE_FAST_TOP_K}"),
        format!("-DSAMPLE_FAST_ROWS={SAMPLE_FAST_ROWS}"),
        format!("-DSAMPLE_UNDECIDED={SAMPLE_UNDECIDED}u"),
    ];
    v.extend(layout_defines!(
        SampleRow,
        "SAMPLE_ROW",
        temperature,
        top_p,
        min_p,
        presence,
        frequency,
        repetition,
        top_k,
        top_logprobs,
        vocab_limit,
        pad,
        seed,
        step,
        counts,
    ));
    v.extend(layout_defines!(
        SampleRowsParams,
        "SAMPLE_PARAMS",
        logits,
        rows,
        out_tokens,
        out_logprobs,
        out_top_ids,
        out_top_logprobs,
        vocab,
        row_stride,
        keep_slots,
        keep_last,
    ));
    v
}

/// Byte offsets of one step's outputs for `n` rows, as `sample_rows`
/// writes them and the host reads them: tokens u32 [n], logprobs f32 [n],
/// top ids u32 [n][SAMPLE_TOP_MAX], top logprobs f32 [n][SAMPLE_TOP_MAX].
/// `bytes(false)` covers the first two only (no row asked for top
/// logprobs, so only they come back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutLayout {
    pub n: usize,
    pub tokens: usize,
    pub logprobs: usize,
    pub top_ids: usize,
    pub top_logprobs: usize,
}

impl OutLayout {
    pub fn new(n: usize) -> Self {
        OutLayout { n, tokens: 0, logprobs: 4 * n, top_ids: 8 * n, top_logprobs: 8 * n + 4 * n * SAMPLE_TOP_MAX }
    }
    pub fn bytes(&self, tops: bool) -> usize {
        if tops {
            self.top_logprobs + 4 * self.n * SAMPLE_TOP_MAX
        } else {
            self.top_ids
        }
    }

    /// Where `sample_rows` writes these outputs when they start at device
    /// address `base` (the top arrays only when `tops`).
    pub fn sample_out(&self, base: u64, tops: bool) -> SampleOut {
        SampleOut {
            tokens: base + self.tokens as u64,
            logprobs: base + self.logprobs as u64,
            top_ids: if tops { base + self.top_ids as u64 } else { 0 },
            top_logprobs: if tops { base + self.top_logprobs as u64 } else { 0 },
        }
    }

    /// Row `r`'s draw from these outputs read back into `buf`: its token,
    /// logprob and, when `tops`, its first `asked` top logprobs (up to a
    /// slot past the row's vocabulary limit).
    pub fn draw(&self, buf: &[u8], r: usize, asked: usize, tops: bool) -> CudaResult<Sampled> {
        let token = word(buf, self.tokens, r)?;
        let logprob = f32::from_bits(word(buf, self.logprobs, r)?);
        let mut top = Vec::new();
        if tops {
            for j in 0..asked.min(SAMPLE_TOP_MAX) {
                let id = word(buf, self.top_ids, r * SAMPLE_TOP_MAX + j)?;
                // u32::MAX marks slots beyond a row shorter than the ask.
                if id == u32::MAX {
                    break;
                }
                top.push((id, f32::from_bits(word(buf, self.top_logprobs, r * SAMPLE_TOP_MAX + j)?)));
            }
        }
        Ok(Sampled { token, logprob, top })
    }
}

/// Where `sample_rows` writes (device addresses, row 0 of the launch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleOut {
    /// u32 [n]: the chosen tokens.
    pub tokens: u64,
    /// f32 [n]: their logprobs (penalised, before temperature).
    pub logprobs: u64,
    /// u32 [n][SAMPLE_TOP_MAX]: the top ids of the rows that ask, or 0
    /// (with `top_logprobs`) when no row's are wanted.
    pub top_ids: u64,
    /// f32 [n][SAMPLE_TOP_MAX]: their logprobs, or 0.
    pub top_logprobs: u64,
}

impl SampleOut {
    /// The same outputs seen from row `first` on (one launch per group of
    /// rows into one set of arrays).
    pub fn from_row(&self, first: usize) -> SampleOut {
        let at = |base: u64, bytes_per_row: usize| if base == 0 { 0 } else { base + (first * bytes_per_row) as u64 };
        SampleOut {
            tokens: at(self.tokens, 4),
            logprobs: at(self.logprobs, 4),
            top_ids: at(self.top_ids, 4 * SAMPLE_TOP_MAX),
            top_logprobs: at(self.top_logprobs, 4 * SAMPLE_TOP_MAX),
        }
    }
}

/// The u32 word `i` of an output array at byte `at`.
pub(crate) fn word(buf: &[u8], at: usize, i: usize) -> CudaResult<u32> {
    let o = at + 4 * i;
    buf.get(o..o + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_ne_bytes)
        .ok_or_else(|| CudaError::Invalid(format!("output word {i} at {at} past a {}-byte buffer", buf.len())))
}

/// Device memory for draws outside a decode step (a prefill's first
/// tokens, `Model::last_rows`): up to `cap` rows' parameters and
/// `sample_rows`' outputs (laid out as a decode step's, `OutLayout`), read
/// back with one copy.
pub struct DrawIo {
    cap: usize,
    /// SampleRow [cap].
    params: DeviceBuffer,
    /// The outputs of up to `cap` rows (`OutLayout` of the rows drawn).
    out: DeviceBuffer,
}

impl DrawIo {
    pub fn new(gpu: &Arc<Gpu>, cap: usize) -> CudaResult<Self> {
        let params = DeviceBuffer::zeroed(gpu, cap * std::mem::size_of::<SampleRow>(), "first-token sampling rows")?;
        let out = DeviceBuffer::zeroed(gpu, OutLayout::new(cap).bytes(true), "first-token draws")?;
        Ok(DrawIo { cap, params, out })
    }

    /// Draws row r of `logits` (f32 [rows.len()][vocab]) with `rows[r]`
    /// where that is `Some` (`sample_rows`, so the draw and the count
    /// update of `sample_host`'s semantics); rows that are `None` are drawn
    /// greedily and come back `None`. Waits for the stream.
    pub fn draw(&self, gpu: &Gpu, k: &Kernels, logits: u64, rows: &[Option<SampleRow>], vocab: usize) -> CudaResult<Vec<Option<Sampled>>> {
        let n = rows.len();
        if n > self.cap {
            return Err(CudaError::shape("DrawIo::draw", format!("{n} rows; room for {}", self.cap)));
        }
        let greedy = SampleRow::new(&SampleParams::greedy(), 0, 0);
        let params: Vec<SampleRow> = rows.iter().map(|r| r.unwrap_or(greedy)).collect();
        // Landed before `draw` returns: the download below waits for the stream.
        self.params.upload_at(0, &params)?;
        let tops = rows.iter().flatten().any(|r| r.top_logprobs > 0);
        let l = OutLayout::new(n);
        sample_rows(gpu, k, logits, self.params.ptr(), &l.sample_out(self.out.ptr(), tops), n, vocab)?;
        let mut buf = vec![0u8; l.bytes(tops)];
        self.out.download_at(0, &mut buf)?;
        rows.iter().enumerate().map(|(r, row)| row.as_ref().map(|row| l.draw(&buf, r, row.top_logprobs as usize, tops)).transpose()).collect()
    }
}

/// For each of `n` rows of `logits` (f32 [n][vocab]) with parameters
/// `rows` (SampleRow [n]): out.tokens[r] = the chosen token,
/// out.logprobs[r] = its logprob (penalised, before temperature), and for
/// a row with top_logprobs = N > 0 (when out.top_ids is set) its N most
/// likely ids and their logprobs in out.top_ids / out.top_logprobs
/// [r][0..N] (ties: lower id first; a slot beyond the row's vocab_limit
/// holds id u32::MAX); the chosen token's count in the row's table (if
/// any) is incremented. Greedy rows and rows with top_k in
/// 1..=`SAMPLE_FAST_TOP_K` take the fast path (see `SamplePath::Auto`).
pub fn sample_rows(gpu: &Gpu, k: &Kernels, logits: u64, rows: u64, out: &SampleOut, n: usize, vocab: usize) -> CudaResult<()> {
    sample_rows_strided(gpu, k, logits, vocab, rows, out, n, vocab)
}

/// `sample_rows` with row r of the logits at `logits + r * row_stride`
/// floats; `row_stride` 0 makes every row read the same logits (many draws
/// of one distribution, e.g. `n` beams or the tests' histograms).
#[allow(clippy::too_many_arguments)]
pub fn sample_rows_strided(gpu: &Gpu, k: &Kernels, logits: u64, row_stride: usize, rows: u64, out: &SampleOut, n: usize, vocab: usize) -> CudaResult<()> {
    sample_rows_path(gpu, k, logits, row_stride, rows, out, n, vocab, SamplePath::Auto)
}

/// Where a pipelined step's draws are kept as its sequences' last draws
/// (the table `feed_stage` reads for `Feed::Previous`): `last[slots[r]] =
/// token of row r`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeepDraws {
    /// i32 [n]: each row's state slot.
    pub slots: u64,
    /// u32 [max_sequences]: the last draw of each state slot.
    pub last: u64,
}

/// `sample_rows` that also keeps each row's draw in `keep`, in the same
/// launches (a pipelined decode step's sampler).
#[allow(clippy::too_many_arguments)]
pub fn sample_rows_keeping(gpu: &Gpu, k: &Kernels, logits: u64, rows: u64, out: &SampleOut, keep: KeepDraws, n: usize, vocab: usize) -> CudaResult<()> {
    if keep.slots == 0 || keep.last == 0 {
        return Err(CudaError::shape("sample_rows", "null slots or last-draw table to keep the draws in"));
    }
    launch_rows(gpu, k, logits, vocab, rows, out, Some(keep), n, vocab, SamplePath::Auto)
}

/// `sample_rows_strided` through the kernels `path` names.
#[allow(clippy::too_many_arguments)]
pub fn sample_rows_path(
    gpu: &Gpu,
    k: &Kernels,
    logits: u64,
    row_stride: usize,
    rows: u64,
    out: &SampleOut,
    n: usize,
    vocab: usize,
    path: SamplePath,
) -> CudaResult<()> {
    launch_rows(gpu, k, logits, row_stride, rows, out, None, n, vocab, path)
}

#[allow(clippy::too_many_arguments)]
fn launch_rows(
    gpu: &Gpu,
    k: &Kernels,
    logits: u64,
    row_stride: usize,
    rows: u64,
    out: &SampleOut,
    keep: Option<KeepDraws>,
    n: usize,
    vocab: usize,
    path: SamplePath,
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
    if logits == 0 || rows == 0 || out.tokens == 0 || out.logprobs == 0 {
        return Err(CudaError::shape("sample_rows", "null logits, rows, tokens or logprobs address"));
    }
    if (out.top_ids == 0) != (out.top_logprobs == 0) {
        return Err(CudaError::shape("sample_rows", "top ids and top logprobs: give both addresses or neither"));
    }
    let p = SampleRowsParams {
        logits,
        rows,
        out_tokens: out.tokens,
        out_logprobs: out.logprobs,
        out_top_ids: out.top_ids,
        out_top_logprobs: out.top_logprobs,
        vocab: vocab as i32,
        row_stride: row_stride as i32,
        keep_slots: keep.map_or(0, |k| k.slots),
        keep_last: keep.map_or(0, |k| k.last),
    };
    let finish = match path {
        SamplePath::Slow => return launch(gpu, k, "sample_rows", (n as u32, 1, 1), SAMPLE_THREADS, 0, &p),
        SamplePath::Auto => "sample_fast_finish",
        SamplePath::FastProbe => "sample_fast_probe",
    };
    // Groups of SAMPLE_FAST_ROWS rows share the kernels' scratch, in
    // stream order.
    for first in (0..n).step_by(SAMPLE_FAST_ROWS) {
        let cnt = SAMPLE_FAST_ROWS.min(n - first);
        let row_bytes = (first as u64).checked_mul(row_stride as u64 * 4);
        let logits_at = row_bytes.and_then(|b| logits.checked_add(b));
        let rows_at = rows.checked_add(first as u64 * std::mem::size_of::<SampleRow>() as u64);
        let slots_at = if p.keep_slots == 0 { Some(0) } else { p.keep_slots.checked_add(first as u64 * 4) };
        let (Some(logits_at), Some(rows_at), Some(keep_slots)) = (logits_at, rows_at, slots_at) else {
            return Err(CudaError::shape("sample_rows", format!("row {first} of {n} lies beyond the address space")));
        };
        let o = out.from_row(first);
        let g = SampleRowsParams {
            logits: logits_at,
            rows: rows_at,
            out_tokens: o.tokens,
            out_logprobs: o.logprobs,
            out_top_ids: o.top_ids,
            out_top_logprobs: o.top_logprobs,
            keep_slots,
            ..p
        };
        launch(gpu, k, "sample_fast_chunks", (SAMPLE_FAST_CHUNKS, cnt as u32, 1), SAMPLE_FAST_THREADS, 0, &g)?;
        // The finish reads its rows' parameters while the chunks run.
        launch_pdl(gpu, k, finish, (cnt as u32, 1, 1), SAMPLE_THREADS, 0, &g)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_draw_reads_its_words_and_stops_its_top_list_at_the_marker() {
        let o = OutLayout::new(2);
        let mut buf = vec![0u8; o.bytes(true)];
        let mut set = |at: usize, i: usize, v: u32| buf[at + 4 * i..at + 4 * i + 4].copy_from_slice(&v.to_ne_bytes());
        set(o.tokens, 1, 77);
        set(o.logprobs, 1, (-0.5f32).to_bits());
        for (j, id) in [77u32, 3, u32::MAX, 9].into_iter().enumerate() {
            set(o.top_ids, SAMPLE_TOP_MAX + j, id);
            set(o.top_logprobs, SAMPLE_TOP_MAX + j, (-(j as f32)).to_bits());
        }
        let d = o.draw(&buf, 1, 4, true).expect("draw");
        assert_eq!((d.token, d.logprob, d.top), (77, -0.5, vec![(77, -0.0), (3, -1.0)]));
        assert_eq!(o.draw(&buf, 1, 1, true).expect("draw").top, vec![(77, -0.0)], "only the ask");
        assert!(o.draw(&buf, 1, 4, false).expect("draw").top.is_empty(), "no top arrays read back");
        assert!(o.draw(&buf[..o.bytes(false)], 1, 4, true).is_err(), "top arrays past the buffer");
        let out = o.sample_out(1000, false);
        assert_eq!((out.tokens, out.logprobs, out.top_ids, out.top_logprobs), (1000, 1008, 0, 0));
    }

    /// The tests' random numbers (xorshift64).
    fn xorshift(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    const SOURCE: &str = include_str!("kernels/sampling.cu");

    #[test]
    fn every_mirrored_field_is_asserted_by_the_kernel() {
        let defs = defines();
        assert_eq!(count_asserted_fields(SOURCE, "sampling.cu", &defs), 13 + 10);
        assert!(defs.contains(&"-DSAMPLE_ROW_BYTES=64".to_string()), "{defs:?}");
        for (f, at) in [("TOP_K", 24), ("TOP_LOGPROBS", 28), ("VOCAB_LIMIT", 32), ("SEED", 40), ("STEP", 48), ("COUNTS", 56)] {
            assert!(defs.contains(&format!("-DSAMPLE_ROW_AT_{f}={at}")), "{f} not at {at}: {defs:?}");
        }
        assert!(defs.contains(&"-DSAMPLE_PARAMS_BYTES=72".to_string()), "{defs:?}");
        // The kernel takes its block size and top stride from here only.
        assert!(!SOURCE.contains("#define SAMPLE_THREADS") && !SOURCE.contains("#define SAMPLE_TOP_MAX"));
    }

    #[test]
    fn out_addresses_advance_by_row() {
        let out = SampleOut { tokens: 1000, logprobs: 2000, top_ids: 3000, top_logprobs: 9000 };
        let o = out.from_row(3);
        assert_eq!((o.tokens, o.logprobs), (1012, 2012));
        assert_eq!((o.top_ids, o.top_logprobs), (3000 + 3 * 80, 9000 + 3 * 80));
        let none = SampleOut { top_ids: 0, top_logprobs: 0, ..out }.from_row(5);
        assert_eq!((none.top_ids, none.top_logprobs), (0, 0));
    }

    // A model of `top_pass` in sampling.cu, lane by lane, for its index
    // math: the keys (logit_key / key_logit), the warp lists with their
    // tile-wise insertion, and the rank merge.

    fn logit_key(l: f32, i: u32) -> u64 {
        let l = if l.is_nan() { f32::NEG_INFINITY } else { l };
        let u = l.to_bits();
        let u = if u & 0x8000_0000 != 0 { !u } else { u | 0x8000_0000 };
        (u as u64) << 32 | (0xffff_ffff - i) as u64
    }

    fn key_logit(k: u64) -> f32 {
        let u = (k >> 32) as u32;
        f32::from_bits(if u & 0x8000_0000 != 0 { u & 0x7fff_ffff } else { !u })
    }

    fn top_pass(row: &[f32], threads: usize, ntop: usize) -> Vec<u64> {
        let warps = threads / 32;
        let mut lists = vec![[0u64; 32]; warps];
        for base in (0..row.len()).step_by(threads) {
            for (w, list) in lists.iter_mut().enumerate() {
                let key: Vec<u64> = (0..32).map(|l| base + w * 32 + l).map(|i| if i < row.len() { logit_key(row[i], i as u32) } else { 0 }).collect();
                let last = list[ntop - 1];
                for src in (0..32).filter(|&l| key[l] > last) {
                    let k = key[src];
                    let old = *list;
                    for lane in 0..32 {
                        let up = if lane == 0 { old[0] } else { old[lane - 1] };
                        let c = if lane == 0 { k } else { up.min(k) };
                        if lane < ntop && c > old[lane] {
                            list[lane] = c;
                        }
                    }
                }
            }
        }
        // rank_merge: a key's rank is, summed over the sorted lists, the
        // number of its entries above it (a binary search in the kernel).
        let lists: Vec<&[u64]> = lists.iter().map(|l| &l[..SAMPLE_TOP_MAX]).collect();
        let mut top = vec![0u64; SAMPLE_TOP_MAX];
        for (j, &k) in lists.iter().flat_map(|l| l.iter().enumerate()) {
            if k == 0 || j >= ntop {
                continue;
            }
            let rank: usize = lists.iter().map(|l| l.partition_point(|&q| q > k)).sum();
            if rank < ntop {
                top[rank] = k;
            }
        }
        top
    }

    /// The host order of lily_model::sample: logit descending (NaN as
    /// -inf), then id.
    fn reference(row: &[f32], ntop: usize) -> Vec<(u32, f32)> {
        let mut idx: Vec<(u32, f32)> = row.iter().enumerate().map(|(i, &l)| (i as u32, if l.is_nan() { f32::NEG_INFINITY } else { l })).collect();
        idx.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        idx.truncate(ntop);
        idx
    }

    #[test]
    fn the_top_pass_model_finds_the_host_top_ids() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || xorshift(&mut state);
        let mut rows: Vec<(&str, Vec<f32>)> = vec![
            ("flat", vec![0.0; 3000]),
            ("ascending", (0..3000).map(|i| i as f32).collect()),
            ("descending", (0..3000).map(|i| -(i as f32)).collect()),
            ("short", vec![1.0, 3.0, f32::NAN, -0.0, 0.0, f32::NEG_INFINITY, 3.0]),
        ];
        // Random logits with many exact ties (a few distinct values).
        rows.push(("ties", (0..5000).map(|_| (next() % 7) as f32 - 3.0).collect()));
        rows.push(("random", (0..10_000).map(|_| (next() % 1_000_000) as f32 / 1e5 - 5.0).collect()));
        for (label, row) in &rows {
            for ntop in [1, 2, 7, SAMPLE_TOP_MAX] {
                for threads in [64usize, SAMPLE_THREADS as usize] {
                    let got = top_pass(row, threads, ntop);
                    let want = reference(row, ntop);
                    for (j, &k) in got.iter().enumerate() {
                        if j < want.len() {
                            let (id, l) = want[j];
                            assert_ne!(k, 0, "{label} ntop {ntop} threads {threads}: slot {j} empty");
                            assert_eq!(key_index(k), id, "{label} ntop {ntop} threads {threads}: slot {j}");
                            assert_eq!(key_logit(k).to_bits(), l.to_bits(), "{label}: slot {j} logit");
                        } else {
                            assert_eq!(k, 0, "{label} ntop {ntop}: slot {j} beyond the row filled");
                        }
                    }
                }
            }
        }
    }

    // A model of `fast_decide` in sampling.cu (with the host's f32 `exp`
    // for expf): the 32 largest keys, the exactness guard, the top-k cut,
    // top-p by weight value and tie rank, the draw in id order. None where
    // the kernel would fall back to the one-block path.
    fn fast_model(row: &[f32], p: &SampleParams, u: f64) -> Option<u32> {
        let mut keys: Vec<u64> = row.iter().enumerate().map(|(i, &l)| logit_key(l, i as u32)).collect();
        keys.sort_unstable_by(|a, b| b.cmp(a));
        keys.truncate(SAMPLE_FAST_KEEP);
        let amax = key_index(keys[0]);
        let m = row[amax as usize];
        if !(p.temperature > 0.0 && m.is_finite()) {
            return Some(amax);
        }
        let inv_t = 1.0 / p.temperature;
        let weight = |k: u64| {
            let e = ((key_logit(k) - m) * inv_t).exp();
            if e.is_nan() {
                0.0
            } else {
                e
            }
        };
        let mut cand: Vec<(u32, f32)> = keys.iter().map(|&k| (key_index(k), weight(k))).filter(|&(_, w)| w > 0.0 && w >= p.min_p).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let full = keys.len() == row.len();
        let outside = weight(keys[keys.len() - 1]) * 1.000_015_3 + 1e-30;
        let k = p.top_k as usize;
        let (nc, exact) = if full {
            (cand.len().min(k), true)
        } else if cand.len() >= k {
            (k, cand[k - 1].1 > outside)
        } else {
            (cand.len(), p.min_p > outside)
        };
        if !exact {
            return None;
        }
        if nc == 0 {
            return Some(amax);
        }
        let mut nf = nc;
        if p.top_p < 1.0 {
            let mass: f64 = cand[..nc].iter().map(|c| c.1 as f64).sum();
            let target = p.top_p as f64 * mass;
            let (mut above, mut j) = (0.0f64, 0);
            while j < nc {
                let b = cand[j].1;
                let e = j + cand[j..nc].iter().take_while(|c| c.1 == b).count();
                let v: f64 = cand[j..e].iter().map(|c| c.1 as f64).sum();
                if v > 0.0 && above + v >= target {
                    let need = ((target - above) / b as f64).ceil().max(1.0);
                    nf = j + (need.min((e - j) as f64) as usize);
                    break;
                }
                above += v;
                j = e;
            }
        }
        let mut kept = cand[..nf].to_vec();
        kept.sort_by_key(|c| c.0);
        let total: f64 = kept.iter().map(|c| c.1 as f64).sum();
        let t = u * total;
        let mut acc = 0.0;
        for &(id, w) in &kept {
            if acc + w as f64 > t {
                return Some(id);
            }
            acc += w as f64;
        }
        Some(kept[kept.len() - 1].0)
    }

    #[test]
    fn the_fast_decision_model_draws_the_host_token() {
        use lily_model::sample::{philox_uniform, Distribution};
        use lily_model::SampleState;
        fn unif(s: &mut u64, lo: f32, hi: f32) -> f32 {
            lo + (xorshift(s) >> 40) as f32 / (1u64 << 24) as f32 * (hi - lo)
        }
        let mut st = 0x9e37_79b9_7f4a_7c15u64;
        let (mut decided, mut sampled) = (0usize, 0usize);
        for case in 0..7000usize {
            let vocab = [20usize, 33, 1000, 5000][case % 4];
            let kind = case % 7;
            let mut row: Vec<f32> = match kind {
                0 | 1 => (0..vocab).map(|_| unif(&mut st, -4.0, 4.0)).collect(),
                2 => (0..vocab).map(|_| (unif(&mut st, 0.0, 7.0) as i32) as f32 - 3.0).collect(),
                3 => (0..vocab).map(|_| unif(&mut st, -4.0, 4.0) * 40.0).collect(),
                4 => (0..vocab).map(|_| if unif(&mut st, 0.0, 1.0) < 0.05 { f32::NAN } else { unif(&mut st, -4.0, 4.0) }).collect(),
                // Logits close to 0: many distinct logits share a weight.
                6 => (0..vocab).map(|_| unif(&mut st, -1e-6, 1e-6)).collect(),
                _ => (0..vocab).map(|_| unif(&mut st, -4.0, 0.0)).collect(),
            };
            let hot = [30, 3, 0, 30, 30, 30, 0][kind];
            for j in 0..hot {
                let i = (xorshift(&mut st) % vocab as u64) as usize;
                row[i] = if kind == 5 { f32::from_bits(5.0f32.to_bits() - j) } else { unif(&mut st, 4.0, 10.0) };
            }
            let pick = |opts: &[f32], r: u64| opts[(r % opts.len() as u64) as usize];
            let p = SampleParams {
                temperature: pick(&[0.0, 0.6, 1.0, 1.7], xorshift(&mut st)),
                top_k: pick(&[1.0, 2.0, 7.0, 20.0, 24.0], xorshift(&mut st)) as u32,
                top_p: pick(&[1.0, 0.95, 0.5, 0.0], xorshift(&mut st)),
                min_p: pick(&[0.0, 0.05, 0.3], xorshift(&mut st)),
                seed: xorshift(&mut st),
                ..Default::default()
            };
            let d = Distribution::new(&row, &SampleState::new(p, &[]));
            let u = philox_uniform(p.seed, case as u64);
            if p.temperature > 0.0 {
                sampled += 1;
            }
            if let Some(tok) = fast_model(&row, &p, u) {
                decided += usize::from(p.temperature > 0.0);
                assert_eq!(tok, d.draw(u).token, "case {case} vocab {vocab} {p:?}");
            } else {
                assert!(p.temperature > 0.0, "case {case}: a greedy row undecided");
            }
        }
        eprintln!("fast model: {decided} of {sampled} sampled rows decided");
        // Most sampled rows are decided (the tied and near-tied kinds fall back).
        assert!(decided * 2 > sampled, "{decided} of {sampled} sampled rows decided");
    }

    // A model of the fast kernels' selection in sampling.cu: the cut (the
    // SAMPLE_FAST_KEEP-th largest offered value, kth_largest), the
    // candidates at or above it, their rank by counting (rank_candidates).
    // Returns the top (largest first, 0 = empty) and how many candidates
    // were ranked.
    fn kth_largest(offered: &[u64]) -> u64 {
        let mut v: Vec<u64> = offered.iter().copied().filter(|&k| k != 0).collect();
        v.sort_unstable_by(|a, b| b.cmp(a));
        v.get(SAMPLE_FAST_KEEP - 1).copied().unwrap_or(0)
    }

    fn rank_candidates(cand: &[u64]) -> Vec<u64> {
        let mut top = vec![0u64; SAMPLE_FAST_KEEP];
        for &k in cand.iter().filter(|&&k| k != 0) {
            let rank = cand.iter().filter(|&&q| q > k).count();
            if rank < SAMPLE_FAST_KEEP {
                top[rank] = k;
            }
        }
        top
    }

    /// `sample_fast_chunks` over one chunk of keys: segments of
    /// SAMPLE_FAST_HELD keys a thread (id base + e * threads + t).
    fn chunk_select(chunk: &[u64], threads: usize) -> (Vec<u64>, usize) {
        let mut top = vec![0u64; SAMPLE_FAST_KEEP];
        let mut most = 0;
        for seg in chunk.chunks(SAMPLE_FAST_HELD * threads) {
            let held: Vec<Vec<u64>> = (0..threads).map(|t| (0..SAMPLE_FAST_HELD).map(|e| seg.get(e * threads + t).copied().unwrap_or(0)).collect()).collect();
            let maxes: Vec<u64> = held.iter().map(|h| h.iter().copied().max().unwrap_or(0)).collect();
            let cut = kth_largest(&maxes);
            let mut cand = top.clone();
            cand.extend(held.iter().flatten().copied().filter(|&k| k != 0 && k >= cut));
            most = most.max(cand.len());
            top = rank_candidates(&cand);
        }
        (top, most)
    }

    /// `sample_fast_finish`'s merge of the chunks' lists.
    fn merge_select(lists: &[Vec<u64>]) -> (Vec<u64>, usize) {
        let heads: Vec<u64> = lists.iter().map(|l| l[0]).collect();
        let cut = kth_largest(&heads);
        let cand: Vec<u64> = lists.iter().flatten().copied().filter(|&k| k != 0 && k >= cut).collect();
        (rank_candidates(&cand), cand.len())
    }

    fn top_of(keys: &[u64]) -> Vec<u64> {
        let mut v: Vec<u64> = keys.iter().copied().filter(|&k| k != 0).collect();
        v.sort_unstable_by(|a, b| b.cmp(a));
        v.resize(SAMPLE_FAST_KEEP, 0);
        v
    }

    #[test]
    fn the_fast_selection_model_keeps_the_top_within_its_candidate_slots() {
        let mut state = 0x1234_5678_9abc_def1u64;
        let mut next = move || xorshift(&mut state);
        let threads = SAMPLE_FAST_THREADS as usize;
        let seg = SAMPLE_FAST_HELD * threads;
        let mut rows: Vec<(&str, Vec<f32>)> = vec![
            ("random", (0..3880).map(|_| (next() % 1_000_000) as f32 / 1e5).collect()),
            ("flat", vec![0.5; 3880]),
            ("ascending", (0..3880).map(|i| i as f32).collect()),
            ("short", vec![1.0, f32::NAN, 3.0, f32::NEG_INFINITY]),
            ("two segments", (0..seg + 700).map(|_| (next() % 1000) as f32).collect()),
        ];
        // The worst case for the slots: the largest keys all held by the
        // same few threads (every HELD-th... id of 32 threads).
        let mut packed = vec![-1.0f32; seg];
        for t in 0..SAMPLE_FAST_KEEP {
            for e in 0..SAMPLE_FAST_HELD {
                packed[e * threads + t * 7] = 100.0 + (t * SAMPLE_FAST_HELD + e) as f32;
            }
        }
        rows.push(("packed", packed));
        for (label, row) in &rows {
            let keys: Vec<u64> = row.iter().enumerate().map(|(i, &l)| logit_key(l, i as u32)).collect();
            let (top, most) = chunk_select(&keys, threads);
            assert_eq!(top, top_of(&keys), "{label}: chunk top");
            assert!(most <= SAMPLE_FAST_KEEP * (SAMPLE_FAST_HELD + 1), "{label}: {most} candidates");
            if *label == "packed" {
                // 32 slots of the running top, 31 whole threads and the
                // cut's own key: near the bound.
                assert_eq!(most, SAMPLE_FAST_KEEP + (SAMPLE_FAST_KEEP - 1) * SAMPLE_FAST_HELD + 1, "packed: the worst case");
            }
            // The merge over chunk lists of this row split into chunks.
            for chunks in [1usize, 20, SAMPLE_FAST_CHUNKS as usize] {
                let len = keys.len().div_ceil(chunks);
                let lists: Vec<Vec<u64>> = (0..chunks).map(|c| top_of(&keys[(c * len).min(keys.len())..((c + 1) * len).min(keys.len())])).collect();
                let (merged, n) = merge_select(&lists);
                assert_eq!(merged, top_of(&keys), "{label}: merge of {chunks} chunks");
                assert!(n <= SAMPLE_FAST_KEEP * SAMPLE_FAST_KEEP, "{label}: {n} merge candidates");
            }
        }
    }

    #[test]
    fn keys_order_like_the_host_and_decode_exactly() {
        let vals = [f32::NEG_INFINITY, -3.5, -0.0, 0.0, 1e-30, 2.0, f32::INFINITY];
        for w in vals.windows(2) {
            assert!(logit_key(w[0], 5) < logit_key(w[1], 5), "{} vs {}", w[0], w[1]);
        }
        for &v in &vals {
            assert_eq!(key_logit(logit_key(v, 9)).to_bits(), v.to_bits());
            assert!(logit_key(v, 1) > logit_key(v, 2), "a tie goes to the lower id");
            assert_ne!(logit_key(v, u32::MAX), 0, "0 must mean an empty slot");
        }
        assert_eq!(logit_key(f32::NAN, 3), logit_key(f32::NEG_INFINITY, 3));
    }
}
