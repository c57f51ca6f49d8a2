//! Launcher of kernels/feed.cu: the device half of a pipelined decode step's
//! inputs (`CudaBackend::submit_decode`). `feed_stage` copies a group of the
//! step's uploaded inputs into the decode scratch, taking a `Feed::Previous`
//! row's token from the device table of last draws and writing the step's
//! new block-table entries (the sampler keeps the step's draws in that
//! table: `sampling::sample_rows_keeping`). The staging layout and the pinned buffers are
//! the backend's (backend.rs); this file owns only the launches.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::error::{CudaError, CudaResult};
use crate::kernels::Kernels;
use crate::launch::launch;
use crate::sampling::layout_defines;

/// Threads of the one block of `feed_stage`.
pub const FEED_THREADS: u32 = 256;

/// Device addresses of one group's staged inputs (row 0 of the group) and
/// of what `feed_stage` writes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedStageParams {
    /// u32 [n]: the fed token (ignored for a row fed `Previous`).
    pub in_tokens: u64,
    /// i32 [n]: the fed token's position.
    pub in_pos: u64,
    /// i32 [n]: the sequence's state slot.
    pub in_slot: u64,
    /// u32 [n]: 1 = the token is `last[in_slot[r]]`.
    pub in_prev: u64,
    /// i32 [*n_bt]: block-table indices; i32 [*n_bt]: the blocks.
    pub bt_at: u64,
    pub bt_block: u64,
    /// u32 [max_sequences]: each slot's last draw.
    pub last: u64,
    /// The decode scratch: tokens u32 [n], positions i32 [n], slots i32 [n].
    pub tokens: u64,
    pub pos: u64,
    pub slots: u64,
    /// i32 [max_sequences][blocks per sequence].
    pub block_table: u64,
    /// i32: the number of block-table entries (0..=n), read on the device
    /// so that a captured step graph serves any count.
    pub n_bt: u64,
    pub n: i32,
}
// SAFETY: plain-old-data mirroring `FeedStageParams` in feed.cu.
unsafe impl DeviceRepr for FeedStageParams {}

/// The block size and the parameter struct's layout, as NVRTC
/// defines (every family is compiled with them, see `Dims::defines`).
pub fn defines() -> Vec<String> {
    let mut v = vec![format!("-DFEED_THREADS={FEED_THREADS}")];
    v.extend(layout_defines!(
        FeedStageParams,
        "FEED_STAGE",
        in_tokens,
        in_pos,
        in_slot,
        in_prev,
        bt_at,
        bt_block,
        last,
        tokens,
        pos,
        slots,
        block_table,
        n_bt,
        n,
    ));
    v
}

/// Stages one group of `p.n` rows (1..=1024) and the block-table entries
/// counted at `p.n_bt` (see feed.cu).
pub fn stage(gpu: &Gpu, k: &Kernels, p: &FeedStageParams) -> CudaResult<()> {
    if p.n <= 0 || p.n > 1024 {
        return Err(CudaError::shape("feed_stage", format!("{} rows: expected 1..=1024", p.n)));
    }
    let addrs = [p.in_tokens, p.in_pos, p.in_slot, p.in_prev, p.bt_at, p.bt_block, p.n_bt, p.last, p.tokens, p.pos, p.slots, p.block_table];
    if addrs.contains(&0) {
        return Err(CudaError::shape("feed_stage", "a null input, output, block-table or entry-count address"));
    }
    launch(gpu, k, "feed_stage", (1, 1, 1), FEED_THREADS, 0, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = include_str!("kernels/feed.cu");

    #[test]
    fn every_mirrored_field_is_asserted_by_the_kernel() {
        let defs = defines();
        assert_eq!(crate::sampling::count_asserted_fields(SOURCE, "feed.cu", &defs), 13);
        assert!(defs.contains(&"-DFEED_STAGE_BYTES=104".to_string()), "{defs:?}");
        assert!(!SOURCE.contains("#define FEED_THREADS"));
    }
}
