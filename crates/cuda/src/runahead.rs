//! The buffers of pipelined decode steps (`CudaBackend::submit_decode`):
//! per step slot, a page-locked host buffer the host writes the step's
//! inputs into and one the step's outputs come back to, and an event
//! recorded after the step; one device buffer every step's inputs land in
//! (one async copy) and its sampler writes its outputs to (one async copy
//! back); plus the device table of each sequence slot's last draw
//! (`Feed::Previous`).
//!
//! One device buffer serves every slot because a step's copies and kernels
//! are ordered on one stream: step t + 1's upload runs after step t's
//! sampler, and step t's download before step t + 1's sampler. Its
//! addresses, with `InLayout`'s offsets depending only on the number of
//! rows, are what lets the feed, the step and the sampler of a served step
//! be one cached CUDA graph per batch size (`Model::run_served_step`).
//! (Mapped host outputs, written by the sampler in place, measured no
//! faster than this copy: history 133.)
//!
//! There are `MAX_IN_FLIGHT + 1` step slots: a step uses one no uncollected
//! step holds, so a new step is staged while the ones before it still run,
//! and a synchronous `decode_sample` finds one too. This file owns the
//! input layout and the copies (the outputs' layout, `OutLayout`, is
//! sampling.rs', whose kernel writes them); backend.rs owns what goes in
//! and what the draws mean, feed.rs and sampling.rs the launches.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{result, CudaEvent, PinnedHostSlice};

use lily_model::MAX_IN_FLIGHT;

use crate::device::{DeviceBuffer, Gpu};
use crate::error::{CudaError, CudaResult, DriverContext};
use crate::sampling::{OutLayout, SampleOut, SampleRow};

/// Step slots: one per step in flight, and one more for a synchronous step.
pub const IO_SLOTS: usize = MAX_IN_FLIGHT + 1;

const ROW_BYTES: usize = std::mem::size_of::<SampleRow>();

/// Byte offsets of one step's staged inputs, packed for `n` rows:
/// SampleRow [n], tokens u32 [n], positions i32 [n], state slots i32 [n],
/// fed-previous flags u32 [n], block-table indices i32 [n], blocks i32 [n]
/// (the first `bt_count` of each used: a step adds at most one KV block a
/// sequence), then the count `bt_count` i32 and a zero i32 (`bt_none`: the
/// count of a group that writes no entries). Every offset depends on `n`
/// alone, so a step graph captured for `n` rows stays valid whatever
/// entries a later step writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InLayout {
    pub rows: usize,
    pub tokens: usize,
    pub pos: usize,
    pub slot: usize,
    pub prev: usize,
    pub bt_at: usize,
    pub bt_block: usize,
    pub bt_count: usize,
    pub bt_none: usize,
    pub bytes: usize,
}

impl InLayout {
    pub fn new(n: usize) -> Self {
        // SampleRow holds u64s; everything after it is 4-byte words.
        let tokens = n * ROW_BYTES;
        let pos = tokens + 4 * n;
        let slot = pos + 4 * n;
        let prev = slot + 4 * n;
        let bt_at = prev + 4 * n;
        let bt_block = bt_at + 4 * n;
        let bt_count = bt_block + 4 * n;
        let bt_none = bt_count + 4;
        InLayout { rows: 0, tokens, pos, slot, prev, bt_at, bt_block, bt_count, bt_none, bytes: bt_none + 4 }
    }
}

/// One step slot's buffers.
pub struct IoSlot {
    input: PinnedHostSlice<u8>,
    output: PinnedHostSlice<u8>,
    /// Recorded after the slot's download: when it has completed, the
    /// slot's host buffers may be rewritten and its outputs read.
    done: CudaEvent,
}

/// Every step slot, the device buffer they share and the table of last
/// draws.
pub struct StepIo {
    gpu: Arc<Gpu>,
    slots: Vec<IoSlot>,
    /// Inputs at 0 (`InLayout`), outputs at `out_at` (`OutLayout`).
    dev: DeviceBuffer,
    out_at: usize,
    /// u32 [max_sequences]: the last draw of each sequence slot, written by
    /// the sampler (`sample_rows_keeping`), read by `feed_stage`.
    pub last: DeviceBuffer,
    /// Most rows one step may carry.
    pub rows: usize,
}

/// Page-locked host memory of `bytes` bytes, zeroed.
fn pinned(gpu: &Gpu, bytes: usize, flags: u32) -> CudaResult<PinnedHostSlice<u8>> {
    // SAFETY: the allocation is zeroed below, before any read.
    let mut buf = unsafe { gpu.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), flags) }
        .map_err(|e| CudaError::Capacity(format!("allocating {bytes} bytes of page-locked host memory: {e}")))?;
    let p = buf.as_mut_ptr().ctx("pinned host buffer")?;
    // SAFETY: `p` is the start of this allocation of at least `bytes` bytes
    // (never fewer than 1), owned here and not yet shared with the device.
    unsafe { std::ptr::write_bytes(p, 0, bytes.max(1)) };
    Ok(buf)
}

impl StepIo {
    /// Buffers for steps of up to `rows` rows and a last-draw table of
    /// `sequences` slots.
    pub fn new(gpu: &Arc<Gpu>, rows: usize, sequences: usize) -> CudaResult<Self> {
        let in_bytes = InLayout::new(rows).bytes;
        let out_bytes = OutLayout::new(rows).bytes(true);
        let out_at = in_bytes.div_ceil(256) * 256;
        let mut slots = Vec::with_capacity(IO_SLOTS);
        for _ in 0..IO_SLOTS {
            slots.push(IoSlot {
                // The host only writes the inputs (write-combined suits that)
                // and reads the outputs (cached memory suits that).
                input: pinned(gpu, in_bytes, cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED)?,
                output: pinned(gpu, out_bytes, 0)?,
                done: gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)).ctx("cuEventCreate")?,
            });
        }
        let dev = DeviceBuffer::zeroed(gpu, out_at + out_bytes, "decode step io")?;
        let last = DeviceBuffer::zeroed(gpu, sequences.max(1) * 4, "last draws")?;
        Ok(StepIo { gpu: gpu.clone(), slots, dev, out_at, last, rows })
    }

    fn slot(&self, k: usize) -> CudaResult<&IoSlot> {
        self.slots.get(k).ok_or_else(|| CudaError::Invalid(format!("step slot {k} of {IO_SLOTS}")))
    }

    /// Device address of the inputs' byte `at` (every slot's inputs land
    /// there in turn).
    pub fn dev_in(&self, at: usize) -> CudaResult<u64> {
        self.dev.at(at)
    }

    /// Where `sample_rows` writes a step's outputs for `n` rows (the top
    /// arrays only when `tops`), to be copied back by `download`.
    pub fn dev_out(&self, n: usize, tops: bool) -> CudaResult<SampleOut> {
        Ok(OutLayout::new(n).sample_out(self.dev.at(self.out_at)?, tops))
    }

    /// Waits until slot `k`'s last use is over, then returns its host input
    /// buffer to be written.
    pub fn host_in(&mut self, k: usize) -> CudaResult<&mut [u8]> {
        let s = self.slots.get_mut(k).ok_or_else(|| CudaError::Invalid(format!("step slot {k} of {IO_SLOTS}")))?;
        s.done.synchronize().ctx("cuEventSynchronize (step slot reuse)")?;
        s.input.as_mut_slice().ctx("pinned host buffer")
    }

    /// Queues the one upload of slot `k`'s first `bytes` input bytes.
    pub fn upload(&self, k: usize, bytes: usize) -> CudaResult<()> {
        let s = self.slot(k)?;
        let src = s.input.as_slice().ctx("pinned host buffer")?;
        let src = src.get(..bytes).ok_or_else(|| CudaError::Capacity(format!("step inputs of {bytes} bytes, the slot holds {}", src.len())))?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the destination is the start of the device buffer, which
        // holds the inputs' capacity (the slot's host buffer has the same,
        // checked by `src.get`) and is read by this step's kernels only,
        // queued after this copy and before the next step's; the source is
        // page-locked memory owned by the slot, not rewritten before the
        // slot's `done` event (recorded after this step) has completed.
        unsafe { result::memcpy_htod_async(self.dev.ptr(), src, self.gpu.cu_stream()) }.ctx("cuMemcpyHtoDAsync (step inputs)")
    }

    /// Ends slot `k`'s step on the stream: queues the download of its
    /// outputs (`OutLayout` of `n` rows, the top arrays only when `tops`)
    /// and records the slot's event.
    pub fn download(&mut self, k: usize, n: usize, tops: bool) -> CudaResult<()> {
        let stream = self.gpu.cu_stream();
        let gpu_stream = self.gpu.stream.clone();
        let bytes = OutLayout::new(n).bytes(tops);
        let src = self.dev.at(self.out_at)?;
        let s = self.slots.get_mut(k).ok_or_else(|| CudaError::Invalid(format!("step slot {k} of {IO_SLOTS}")))?;
        let dst = s.output.as_mut_slice().ctx("pinned host buffer")?;
        let dst = dst.get_mut(..bytes).ok_or_else(|| CudaError::Capacity(format!("step outputs of {bytes} bytes, the slot holds fewer")))?;
        // SAFETY: the source is the device buffer's output region (`bytes`
        // fit: it was sized for `rows` rows with their top arrays), written
        // by this step's sampler, queued before this copy, and not by the
        // next step's sampler before it (one stream); the destination is
        // page-locked memory owned by the slot, read only after the `done`
        // event recorded right below has completed.
        unsafe { result::memcpy_dtoh_async(dst, src, stream) }.ctx("cuMemcpyDtoHAsync (step outputs)")?;
        s.done.record(&gpu_stream).ctx("cuEventRecord (step done)")
    }

    /// Waits for slot `k`'s download and returns its host output buffer.
    pub fn host_out(&self, k: usize) -> CudaResult<&[u8]> {
        let s = self.slot(k)?;
        s.done.synchronize().ctx("cuEventSynchronize (step outputs)")?;
        s.output.as_slice().ctx("pinned host buffer")
    }
}

impl Drop for StepIo {
    fn drop(&mut self) {
        // No copy may still target the page-locked buffers when they are
        // freed.
        if self.gpu.bind().is_ok() {
            let _ = self.gpu.synchronize();
        }
    }
}

/// Plain data that may be copied into a staging buffer byte for byte: no
/// padding, no pointers the host follows.
pub trait Staged: Copy {}
impl Staged for u32 {}
impl Staged for i32 {}
impl Staged for SampleRow {}

/// Copies `data` into `buf` at byte `at`.
pub fn put<T: Staged>(buf: &mut [u8], at: usize, data: &[T]) -> CudaResult<()> {
    let n = std::mem::size_of_val(data);
    let len = buf.len();
    let dst = buf.get_mut(at..at + n).ok_or_else(|| CudaError::Capacity(format!("{n} bytes at {at} past a {len}-byte staging buffer")))?;
    // SAFETY: `dst` holds exactly `n` bytes and does not overlap `data`
    // (a host slice of the caller); `Staged` types have no padding bytes,
    // so every byte read is initialised.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().cast::<u8>(), dst.as_mut_ptr(), n) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::word;

    #[test]
    fn layouts_pack_without_overlap() {
        let l = InLayout::new(3);
        assert_eq!(
            (l.rows, l.tokens, l.pos, l.slot, l.prev, l.bt_at, l.bt_block, l.bt_count, l.bt_none, l.bytes),
            (0, 192, 204, 216, 228, 240, 252, 264, 268, 272)
        );
        assert_eq!(l.tokens % 8, 0, "SampleRow stays 8-byte aligned");
        let o = OutLayout::new(3);
        assert_eq!((o.tokens, o.logprobs, o.top_ids, o.top_logprobs), (0, 12, 24, 24 + 240));
        assert_eq!((o.bytes(false), o.bytes(true)), (24, 24 + 480));
        // The device side sees the same offsets as `SampleOut::from_row`.
        let out = SampleOut { tokens: 1000, logprobs: 1000 + o.logprobs as u64, top_ids: 1000 + o.top_ids as u64, top_logprobs: 1000 + o.top_logprobs as u64 };
        let r2 = out.from_row(2);
        assert_eq!((r2.tokens, r2.top_ids), (1008, 1000 + 24 + 2 * 80));
        assert!(r2.top_logprobs + 80 <= 1000 + o.bytes(true) as u64);
    }

    #[test]
    fn staging_round_trips_and_refuses_overflow() {
        let mut buf = vec![0u8; 16];
        put(&mut buf, 4, &[7u32, u32::MAX]).expect("fits");
        put(&mut buf, 12, &[-2i32]).expect("fits");
        assert_eq!(word(&buf, 4, 0).expect("word"), 7);
        assert_eq!(word(&buf, 4, 1).expect("word"), u32::MAX);
        assert_eq!(word(&buf, 12, 0).expect("word") as i32, -2);
        assert!(put(&mut buf, 12, &[1u32, 2]).is_err());
        assert!(word(&buf, 16, 0).is_err());
    }
}
