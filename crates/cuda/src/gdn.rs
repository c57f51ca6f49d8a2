//! Launchers of kernels/gdn.cu: the Gated DeltaNet decode step and the
//! chunked prefill (prep, conv store, W/U per chunk, the state recurrence
//! across chunks, the output per chunk, gated norm), and the family's NVRTC
//! defines (chunk, tiles, shared-memory sizes, parameter-struct sizes), which
//! the kernels check with static_asserts. Layouts are described in the
//! kernel's header; the memory plan (state.rs) owns the buffers.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::dims::{Dims, GDN_CHUNK};
use crate::error::{CudaError, CudaResult};
use crate::kernels::Kernels;
use crate::launch::{launch, launch_pdl};
use crate::weights::DeltaNetDev;

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnDecodeParams {
    proj: u64,
    conv: u64,
    conv_w: u64,
    a_log: u64,
    dt_bias: u64,
    norm_w: u64,
    state: u64,
    pos: u64,
    slot: u64,
    mix_f32: u64,
    mix_f16: u64,
    mix_px: u64,
    mix_csum: u64,
    conv_slot_stride: i64,
    state_slot_stride: i64,
    proj_stride: i32,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `GdnDecodeParams` in gdn.cu.
unsafe impl DeviceRepr for GdnDecodeParams {}

/// Where a DeltaNet layer's per-sequence state lives.
#[derive(Clone, Copy)]
pub struct GdnState {
    /// Conv ring of this layer in slot 0; slot s is at + s * conv_slot_stride floats.
    pub conv: u64,
    pub conv_slot_stride: usize,
    /// Recurrent state of this layer in slot 0.
    pub state: u64,
    pub state_slot_stride: usize,
}

/// Where the mixer output goes: f32, fp16 (the prefill GEMM's input), or
/// packed fp16 hi/lo activations with their group sums (the decode step's
/// qmm input, see qmm.cu).
#[derive(Clone, Copy)]
pub enum MixOut {
    F32(u64),
    F16(u64),
    Packed { px: u64, csum: u64 },
}

impl MixOut {
    /// (f32, fp16, packed, group sums) pointers, 0 for the ones not written.
    pub fn split(self) -> (u64, u64, u64, u64) {
        match self {
            MixOut::F32(p) => (p, 0, 0, 0),
            MixOut::F16(p) => (0, p, 0, 0),
            MixOut::Packed { px, csum } => (0, 0, px, csum),
        }
    }
}

/// One decode step for `ntok` tokens (each its own sequence slot).
#[allow(clippy::too_many_arguments)]
pub fn decode(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    w: &DeltaNetDev,
    st: &GdnState,
    proj: u64,
    proj_stride: usize,
    pos: u64,
    slot: u64,
    mix: MixOut,
    ntok: usize,
) -> CudaResult<()> {
    if proj_stride < dims.gdn_proj() {
        return Err(CudaError::shape("gdn_decode", format!("proj stride {proj_stride} < {}", dims.gdn_proj())));
    }
    if ntok == 0 {
        return Ok(());
    }
    let (mix_f32, mix_f16, mix_px, mix_csum) = mix.split();
    if mix_px != 0 && !dims.gv_dim.is_multiple_of(64) {
        return Err(CudaError::shape("gdn_decode", format!("packed output needs heads of whole 64-column groups, head dim {}", dims.gv_dim)));
    }
    let p = GdnDecodeParams {
        proj,
        conv: st.conv,
        conv_w: w.conv_w,
        a_log: w.a_log,
        dt_bias: w.dt_bias,
        norm_w: w.norm,
        state: st.state,
        pos,
        slot,
        mix_f32,
        mix_f16,
        mix_px,
        mix_csum,
        conv_slot_stride: st.conv_slot_stride as i64,
        state_slot_stride: st.state_slot_stride as i64,
        proj_stride: proj_stride as i32,
        eps: dims.rms_eps,
    };
    // One token: a head's columns over a cluster of blocks (more
    // multiprocessors streaming the state); more: a block a head. The same
    // bits either way (gdn.cu).
    let split = dims.gv_dim / DECODE_VCOLS;
    if ntok == 1 && split > 1 {
        launch_pdl(gpu, k, "gdn_decode_split", ((dims.gv_heads * split) as u32, 1, 1), DECODE_THREADS as u32, 0, &p)
    } else {
        launch_pdl(gpu, k, "gdn_decode", (dims.gv_heads as u32, ntok as u32, 1), (DECODE_GROUPS * dims.gv_dim) as u32, 0, &p)
    }
}

/// Value columns of a head one `gdn_decode_split` block owns (a warp's
/// width); a head's blocks form one cluster of `gv_dim / DECODE_VCOLS`.
pub const DECODE_VCOLS: usize = 32;
/// Threads of a `gdn_decode_split` block: one per (column, sixteenth of the
/// keys).
pub const DECODE_THREADS: usize = 16 * DECODE_VCOLS;
/// Threads a value column in a `gdn_decode` (whole-head) block (gdn.cu's
/// GDN_DEC_GROUPS, defined from this).
pub const DECODE_GROUPS: usize = 4;

/// Tokens a `gdn_prefill_prep` block takes (each warp walks its head over
/// them, loading each raw input row once); divides `GDN_CHUNK`, so a block
/// is all real-or-padded rows of one piece.
pub const PREP_TOKENS: usize = 4;
const _: () = assert!(GDN_CHUNK.is_multiple_of(PREP_TOKENS));

/// Sequences a chunked-prefill launch takes at once (the piece tables of
/// gdn.cu's parameter structs); `prefill_pieces` launches more in groups.
pub const MAX_PIECES: usize = 16;

/// One sequence's run of a prefill pass, as the kernels take it (gdn.cu
/// `GdnPiece`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PieceDev {
    proj: u64,
    conv: u64,
    state: u64,
    cap_conv: u64,
    cap_state: u64,
    mix_f32: u64,
    mix_f16: u64,
    t: i32,
    p0: i32,
    c0: i32,
    capture_chunk: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnPrepParams {
    pc: [PieceDev; MAX_PIECES],
    conv_w: u64,
    a_log: u64,
    dt_bias: u64,
    q: u64,
    k: u64,
    vv: u64,
    gg: u64,
    bb: u64,
    proj_stride: i32,
    tp: i32,
}
// SAFETY: plain-old-data mirroring `GdnPrepParams` in gdn.cu.
unsafe impl DeviceRepr for GdnPrepParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnConvStoreParams {
    pc: [PieceDev; MAX_PIECES],
    proj_stride: i32,
}
// SAFETY: plain-old-data mirroring `GdnConvStoreParams` in gdn.cu.
unsafe impl DeviceRepr for GdnConvStoreParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnWuParams {
    k: u64,
    gg: u64,
    bb: u64,
    vu: u64,
    w: u64,
    gc: u64,
    tp: i32,
}
// SAFETY: plain-old-data mirroring `GdnWuParams` in gdn.cu.
unsafe impl DeviceRepr for GdnWuParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnStateParams {
    k: u64,
    w: u64,
    vu: u64,
    gc: u64,
    hs: u64,
    pc: [PieceDev; MAX_PIECES],
    tp: i32,
}
// SAFETY: plain-old-data mirroring `GdnStateParams` in gdn.cu.
unsafe impl DeviceRepr for GdnStateParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnOutParams {
    q: u64,
    k: u64,
    vu: u64,
    gc: u64,
    hs: u64,
    o: u64,
    tp: i32,
}
// SAFETY: plain-old-data mirroring `GdnOutParams` in gdn.cu.
unsafe impl DeviceRepr for GdnOutParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnGatedNormParams {
    pc: [PieceDev; MAX_PIECES],
    o: u64,
    norm_w: u64,
    proj_stride: i32,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `GdnGatedNormParams` in gdn.cu.
unsafe impl DeviceRepr for GdnGatedNormParams {}

/// Scratch of the chunked prefill for up to `max_tokens` tokens; layouts in
/// the header of gdn.cu ("Scratch"). Split rows hold bf16 pairs, so every
/// buffer is counted in 4-byte words.
#[derive(Clone, Copy)]
pub struct GdnScratch {
    /// q, split rows [key heads][Tp][2 dk] bf16.
    pub q: u64,
    /// k, split rows [key heads][Tp][2 dk] bf16.
    pub k: u64,
    /// v f32, then U^T, then Vn^T per (head, chunk) tile.
    pub vu: u64,
    pub gg: u64,
    pub bb: u64,
    /// W, split rows [value heads][Tp][2 dk] bf16.
    pub w: u64,
    /// G, the log decay summed within each chunk, [value heads][Tp] f32.
    pub gc: u64,
    /// S^T at the start of every chunk, split rows [value heads][chunks][dv][2 dk] bf16.
    pub hs: u64,
    /// Delta-rule output before the gated norm, [Tp][value dim] f32.
    pub o: u64,
    /// Tokens (rounded up to the chunk) the buffers hold.
    pub max_tokens: usize,
}

impl GdnScratch {
    /// 4-byte words of each buffer for `tp` padded tokens, in field order.
    pub fn sizes(dims: &Dims, tp: usize) -> [usize; 9] {
        let kd = dims.gk_heads * tp * dims.gk_dim;
        let vd = dims.gv_heads * tp * dims.gv_dim;
        let per_head = dims.gv_heads * tp;
        let states = dims.gv_heads * tp.div_ceil(GDN_CHUNK) * dims.gv_dim * dims.gk_dim;
        [kd, kd, vd, per_head, per_head, vd, per_head, states, tp * dims.gdn_val_dim()]
    }
}

/// Threads of a `gdn_chunk_wu` block (4 warps: the 10 lower 16 x 16 blocks
/// of A and the blocked inverse are split over them).
const WU_THREADS: usize = 128;
/// Threads of a `gdn_chunk_out` block.
const OUT_THREADS: usize = 256;
/// Heads a `gdn_gated_norm` block normalises, a warp each.
const GATED_NORM_HEADS: usize = 8;

/// Value groups of a `gdn_chunk_state` block (16 value columns each): two
/// when the head divides, so that the real shape (128 columns) runs 4
/// blocks a head, 128 blocks in all, each walking the chunks in sequence.
pub fn state_warps(dims: &Dims) -> usize {
    let tiles = dims.gv_dim / 16;
    [2, 1].into_iter().find(|w| tiles.is_multiple_of(*w)).unwrap_or(1)
}

/// Warps sharing one value group's keys in `gdn_chunk_state`: two halves
/// when each is whole k16 steps (the serial chain a warp runs per chunk is
/// what bounds the kernel, and halving its keys halves it), else one.
pub fn state_key_split(dims: &Dims) -> usize {
    if dims.gk_dim.is_multiple_of(32) {
        2
    } else {
        1
    }
}

/// bf16 row stride of a shared-memory split tile of `n` columns (GDN_SPL).
fn spl(n: usize) -> usize {
    2 * n + 8
}

/// Shared-memory bytes of the chunk kernels, as laid out in their headers
/// (each kernel checks its own sum against these at compile time).
pub fn wu_smem(dims: &Dims) -> usize {
    let c = GDN_CHUNK;
    2 * c * spl(dims.gk_dim) * 2 + 2 * c * (c + 8) * 4 + 2 * c * 4
}
pub fn state_smem(dims: &Dims) -> usize {
    let c = GDN_CHUNK;
    let bv = 16 * state_warps(dims);
    let ks = state_key_split(dims);
    // With split keys, a Vn partial per warp: its C/8 x 4 accumulators a lane.
    let partials = if ks > 1 { state_warps(dims) * ks * (c / 2) * 32 * 4 } else { 0 };
    2 * (2 * c * spl(dims.gk_dim) * 2 + bv * (c + 8) * 4 + c * 4) + partials
}
pub fn out_smem(dims: &Dims) -> usize {
    let (c, d) = (GDN_CHUNK, dims.gk_dim);
    (2 * c + d) * spl(d) * 2 + (d + c) * spl(c) * 2 + c * 4
}

/// The family's own defines: the chunk, the state kernel's warps, the chunk
/// kernels' shared memory and the size of every parameter struct, each
/// checked by a static_assert in gdn.cu.
pub fn defines(dims: &Dims) -> Vec<String> {
    use std::mem::size_of;
    vec![
        format!("-DGDN_CHUNK={GDN_CHUNK}"),
        format!("-DGDN_VCOLS={DECODE_VCOLS}"),
        format!("-DGDN_DEC_THREADS={DECODE_THREADS}"),
        format!("-DGDN_DEC_GROUPS={DECODE_GROUPS}"),
        format!("-DGDN_WU_THREADS={WU_THREADS}"),
        format!("-DGDN_OUT_THREADS={OUT_THREADS}"),
        format!("-DGDN_NORM_HEADS={GATED_NORM_HEADS}"),
        format!("-DGDN_STATE_WARPS={}", state_warps(dims)),
        format!("-DGDN_STATE_KSPLIT={}", state_key_split(dims)),
        format!("-DGDN_WU_SMEM={}", wu_smem(dims)),
        format!("-DGDN_STATE_SMEM={}", state_smem(dims)),
        format!("-DGDN_OUT_SMEM={}", out_smem(dims)),
        format!("-DGDN_MAX_PIECES={MAX_PIECES}"),
        format!("-DGDN_PREP_TOKENS={PREP_TOKENS}"),
        format!("-DGDN_PIECE_BYTES={}", size_of::<PieceDev>()),
        format!("-DGDN_DECODE_PARAMS_BYTES={}", size_of::<GdnDecodeParams>()),
        format!("-DGDN_PREP_PARAMS_BYTES={}", size_of::<GdnPrepParams>()),
        format!("-DGDN_CONV_STORE_PARAMS_BYTES={}", size_of::<GdnConvStoreParams>()),
        format!("-DGDN_WU_PARAMS_BYTES={}", size_of::<GdnWuParams>()),
        format!("-DGDN_STATE_PARAMS_BYTES={}", size_of::<GdnStateParams>()),
        format!("-DGDN_OUT_PARAMS_BYTES={}", size_of::<GdnOutParams>()),
        format!("-DGDN_GATED_NORM_PARAMS_BYTES={}", size_of::<GdnGatedNormParams>()),
    ]
}

/// Where a prefill also leaves the state after its first `at` tokens (a
/// prefix snapshot inside the pass): that sequence's conv ring and
/// recurrent state of this layer. `at` is a whole number of chunks, inside
/// the pass.
#[derive(Clone, Copy, Debug)]
pub struct GdnCapture {
    pub conv: u64,
    pub state: u64,
    pub at: usize,
}

/// The chunked DeltaNet over `t` tokens of one sequence starting at
/// position `p0`: reads the in-projection rows `proj`, updates the conv ring
/// `conv` and recurrent state `state` of that sequence (this layer), writes
/// the gated-norm output; with `capture`, also the state after `at` tokens.
#[allow(clippy::too_many_arguments)]
pub fn prefill(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    w: &DeltaNetDev,
    conv: u64,
    state: u64,
    proj: u64,
    proj_stride: usize,
    t: usize,
    p0: usize,
    s: &GdnScratch,
    mix: MixOut,
    capture: Option<GdnCapture>,
) -> CudaResult<()> {
    prefill_pieces(gpu, k, dims, w, &[PrefillPiece { conv, state, proj, t, p0, mix, capture }], proj_stride, s)
}

/// One sequence's run of rows in a prefill pass: its conv ring and
/// recurrent state (this layer, its slot), its first in-projection row, its
/// tokens and the position of the first, where its output rows go, and a
/// prefix snapshot to take inside it.
#[derive(Clone, Copy)]
pub struct PrefillPiece {
    pub conv: u64,
    pub state: u64,
    pub proj: u64,
    pub t: usize,
    pub p0: usize,
    pub mix: MixOut,
    pub capture: Option<GdnCapture>,
}

/// The chunked prefill of several sequences' pieces (distinct sequences)
/// in one set of launches: their tokens one after another in the scratch,
/// each padded to whole chunks, the chunk kernels over all of them and the
/// state recurrence of every piece side by side. Each piece's results are
/// the bits `prefill` gives it alone. Pieces beyond `MAX_PIECES` or the
/// scratch's rows go in further groups.
#[allow(clippy::too_many_arguments)]
pub fn prefill_pieces(gpu: &Gpu, k: &Kernels, dims: &Dims, w: &DeltaNetDev, pieces: &[PrefillPiece], proj_stride: usize, s: &GdnScratch) -> CudaResult<()> {
    prefill_pieces_with(gpu, k, dims, w, pieces, proj_stride, s, None)
}

/// Work another stream may start once this one reaches a point of the
/// chunked prefill (it records an event there): `prefill_pieces_with`
/// calls it once, just before the first `gdn_chunk_state` launch, whose
/// serial chain leaves most of the GPU's issue slots and DRAM bandwidth
/// idle for ~250 us a layer at 4,096 tokens.
pub type BeforeState<'a> = &'a dyn Fn() -> CudaResult<()>;

/// `prefill_pieces`, calling `before_state` (if any) on the way.
#[allow(clippy::too_many_arguments)]
pub fn prefill_pieces_with(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    w: &DeltaNetDev,
    pieces: &[PrefillPiece],
    proj_stride: usize,
    s: &GdnScratch,
    mut before_state: Option<BeforeState>,
) -> CudaResult<()> {
    if proj_stride < dims.gdn_proj() {
        return Err(CudaError::shape("gdn_prefill", format!("proj stride {proj_stride} < {}", dims.gdn_proj())));
    }
    let mut group: Vec<PieceDev> = Vec::with_capacity(MAX_PIECES);
    let mut rows = 0;
    for p in pieces.iter().filter(|p| p.t > 0) {
        let dev = piece_dev(p)?;
        let tp = p.t.div_ceil(GDN_CHUNK) * GDN_CHUNK;
        if tp > s.max_tokens {
            return Err(CudaError::shape("gdn_prefill", format!("{} tokens, scratch holds {}", p.t, s.max_tokens)));
        }
        if group.len() == MAX_PIECES || rows + tp > s.max_tokens {
            prefill_group(gpu, k, dims, w, &group, rows, proj_stride, s, before_state.take())?;
            group.clear();
            rows = 0;
        }
        group.push(PieceDev { c0: (rows / GDN_CHUNK) as i32, ..dev });
        rows += tp;
    }
    if !group.is_empty() {
        prefill_group(gpu, k, dims, w, &group, rows, proj_stride, s, before_state.take())?;
    }
    // No piece had tokens: the point was never reached, but the other
    // stream's work must still be started for whoever waits on it.
    if let Some(f) = before_state {
        f()?;
    }
    Ok(())
}

/// A piece's kernel entry (c0 set by the caller), after its checks.
fn piece_dev(p: &PrefillPiece) -> CudaResult<PieceDev> {
    let t = p.t;
    if let Some(c) = p.capture {
        if c.at == 0 || c.at >= t || !c.at.is_multiple_of(GDN_CHUNK) {
            return Err(CudaError::shape(
                "gdn_prefill",
                format!("capture after {} of {t} tokens: not a whole number of {GDN_CHUNK}-token chunks inside", c.at),
            ));
        }
    }
    let (mix_f32, mix_f16, mix_px, _) = p.mix.split();
    if mix_px != 0 {
        return Err(CudaError::shape("gdn_gated_norm", "the prefill writes f32 or fp16 rows, not packed activations"));
    }
    if i32::try_from(t + p.p0).is_err() {
        return Err(CudaError::shape("gdn_prefill", format!("{t} tokens from position {}", p.p0)));
    }
    Ok(PieceDev {
        proj: p.proj,
        conv: p.conv,
        state: p.state,
        cap_conv: p.capture.map_or(0, |c| c.conv),
        cap_state: p.capture.map_or(0, |c| c.state),
        mix_f32,
        mix_f16,
        t: t as i32,
        p0: p.p0 as i32,
        c0: 0,
        capture_chunk: p.capture.map_or(-1, |c| (c.at / GDN_CHUNK) as i32),
    })
}

/// The six launches for one group of pieces laid out over `tp` scratch rows.
#[allow(clippy::too_many_arguments)]
fn prefill_group(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    w: &DeltaNetDev,
    group: &[PieceDev],
    tp: usize,
    proj_stride: usize,
    s: &GdnScratch,
    before_state: Option<BeforeState>,
) -> CudaResult<()> {
    // gdn_prefill_prep reads a channel's four conv taps as one 16-byte load.
    if !w.conv_w.is_multiple_of(16) {
        return Err(CudaError::shape("gdn_prefill_prep", format!("conv weights at {:#x}: not 16-byte aligned", w.conv_w)));
    }
    // It reads a lane's adjacent channel pairs of a projection row or a conv
    // ring entry as one 8-byte load.
    if !proj_stride.is_multiple_of(2) {
        return Err(CudaError::shape("gdn_prefill_prep", format!("proj stride {proj_stride}: odd (rows must be 8-byte aligned)")));
    }
    if let Some(p) = group.iter().find(|p| !p.proj.is_multiple_of(8) || !p.conv.is_multiple_of(8)) {
        return Err(CudaError::shape("gdn_prefill_prep", format!("proj at {:#x}, conv ring at {:#x}: not 8-byte aligned", p.proj, p.conv)));
    }
    let n = group.len() as u32;
    let mut pc = [PieceDev::default(); MAX_PIECES];
    pc[..group.len()].copy_from_slice(group);
    let max_t = group.iter().map(|p| p.t as usize).max().unwrap_or(0);
    let max_tp = max_t.div_ceil(GDN_CHUNK) * GDN_CHUNK;
    let prep = GdnPrepParams {
        pc,
        conv_w: w.conv_w,
        a_log: w.a_log,
        dt_bias: w.dt_bias,
        q: s.q,
        k: s.k,
        vv: s.vu,
        gg: s.gg,
        bb: s.bb,
        proj_stride: proj_stride as i32,
        tp: tp as i32,
    };
    launch(gpu, k, "gdn_prefill_prep", ((max_tp / PREP_TOKENS) as u32, 3, n), (32 * dims.gk_heads) as u32, 0, &prep)?;
    // z = 1: the captured conv rings (the inputs before each capture
    // point, as a pass of that many tokens leaves them); pieces without a
    // capture return at once.
    let any_capture = pc.iter().any(|p| p.cap_conv != 0);
    let cs = GdnConvStoreParams { pc, proj_stride: proj_stride as i32 };
    launch(gpu, k, "gdn_conv_store", (dims.conv_dim.div_ceil(256) as u32, n, if any_capture { 2 } else { 1 }), 256, 0, &cs)?;
    let nchunks = (tp / GDN_CHUNK) as u32;
    let heads = dims.gv_heads as u32;
    let wu = GdnWuParams { k: s.k, gg: s.gg, bb: s.bb, vu: s.vu, w: s.w, gc: s.gc, tp: tp as i32 };
    launch(gpu, k, "gdn_chunk_wu", (nchunks, heads, 1), WU_THREADS as u32, wu_smem(dims), &wu)?;
    let sw = state_warps(dims);
    let st = GdnStateParams { k: s.k, w: s.w, vu: s.vu, gc: s.gc, hs: s.hs, pc, tp: tp as i32 };
    let col_blocks = (dims.gv_dim / (16 * sw)) as u32;
    if let Some(f) = before_state {
        f()?;
    }
    launch(gpu, k, "gdn_chunk_state", (heads, col_blocks, n), (32 * sw * state_key_split(dims)) as u32, state_smem(dims), &st)?;
    let out = GdnOutParams { q: s.q, k: s.k, vu: s.vu, gc: s.gc, hs: s.hs, o: s.o, tp: tp as i32 };
    launch(gpu, k, "gdn_chunk_out", (nchunks, heads, 1), OUT_THREADS as u32, out_smem(dims), &out)?;
    let gn = GdnGatedNormParams { pc, o: s.o, norm_w: w.norm, proj_stride: proj_stride as i32, eps: dims.rms_eps };
    launch(gpu, k, "gdn_gated_norm", (max_t as u32, dims.gv_heads.div_ceil(GATED_NORM_HEADS) as u32, n), (32 * GATED_NORM_HEADS) as u32, 0, &gn)
}
