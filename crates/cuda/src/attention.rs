//! Launchers of kernels/attention.cu: q/k norm + RoPE + KV-cache write, the
//! split-K decode attention and its combine, and the causal flash prefill.
//! The paged KV layout is described in the kernel's header.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::dims::{Dims, KV_BLOCK};
use crate::error::{CudaError, CudaResult};
use crate::gdn::MixOut;
use crate::kernels::Kernels;
use crate::launch::launch;
use crate::weights::AttentionDev;

#[repr(C)]
#[derive(Clone, Copy)]
struct AttnPrepParams {
    proj: u64,
    q_norm: u64,
    k_norm: u64,
    inv_freq: u64,
    pos: u64,
    slot: u64,
    block_table: u64,
    kcache: u64,
    vcache: u64,
    q_f32: u64,
    q_f16: u64,
    proj_stride: i32,
    bt_stride: i32,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `AttnPrepParams` in attention.cu.
unsafe impl DeviceRepr for AttnPrepParams {}

/// A layer's KV cache and the block tables that index it.
#[derive(Clone, Copy)]
pub struct KvView {
    /// K blocks of this layer: [blocks][kv_heads][KV_BLOCK][head_dim] fp16.
    pub k: u64,
    pub v: u64,
    /// i32 [slots][bt_stride].
    pub block_table: u64,
    pub bt_stride: usize,
}

/// Where prep writes the queries.
#[derive(Clone, Copy)]
pub enum QOut {
    F32(u64),
    F16(u64),
}

/// Norms, rotates and stores q/k/v of `ntok` tokens (positions `pos`, slots `slot`).
#[allow(clippy::too_many_arguments)]
pub fn prep(gpu: &Gpu, k: &Kernels, dims: &Dims, w: &AttentionDev, inv_freq: u64, proj: u64, proj_stride: usize, pos: u64, slot: u64, kv: &KvView, q: QOut, ntok: usize) -> CudaResult<()> {
    if proj_stride < dims.attn_proj() {
        return Err(CudaError::shape("attn_prep", format!("proj stride {proj_stride} < {}", dims.attn_proj())));
    }
    if ntok == 0 {
        return Ok(());
    }
    let (q_f32, q_f16) = match q {
        QOut::F32(p) => (p, 0),
        QOut::F16(p) => (0, p),
    };
    let p = AttnPrepParams {
        proj,
        q_norm: w.q_norm,
        k_norm: w.k_norm,
        inv_freq,
        pos,
        slot,
        block_table: kv.block_table,
        kcache: kv.k,
        vcache: kv.v,
        q_f32,
        q_f16,
        proj_stride: proj_stride as i32,
        bt_stride: kv.bt_stride as i32,
        eps: dims.rms_eps,
    };
    let grid = (dims.a_heads + 2 * dims.a_kv_heads) as u32;
    launch(gpu, k, "attn_prep", (grid, ntok as u32, 1), dims.a_head_dim as u32, 0, &p)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct AttnDecodeParams {
    q: u64,
    kcache: u64,
    vcache: u64,
    block_table: u64,
    pos: u64,
    slot: u64,
    part_o: u64,
    part_ml: u64,
    bt_stride: i32,
    max_splits: i32,
    scale_log2: f32,
}
// SAFETY: plain-old-data mirroring `AttnDecodeParams` in attention.cu.
unsafe impl DeviceRepr for AttnDecodeParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct AttnCombineParams {
    part_o: u64,
    part_ml: u64,
    proj: u64,
    mix_f32: u64,
    mix_f16: u64,
    pos: u64,
    max_splits: i32,
    proj_stride: i32,
}
// SAFETY: plain-old-data mirroring `AttnCombineParams` in attention.cu.
unsafe impl DeviceRepr for AttnCombineParams {}

/// Split-K partials of the decode attention.
#[derive(Clone, Copy)]
pub struct DecodeScratch {
    /// f32 [ntok][heads][max_splits][head_dim].
    pub part_o: u64,
    /// f32 [ntok][heads][max_splits][2].
    pub part_ml: u64,
    pub max_splits: usize,
}

/// Splits for a context of `len` tokens: about 4 KV blocks per split, but
/// one block per split for up to 16 blocks, so short contexts still spread
/// over several multiprocessors; at most `max_splits`. The kernels compute
/// the same count on the device from each token's own length
/// (`decode_splits` in attention.cu); here it sizes the scratch.
pub fn splits_for(len: usize, max_splits: usize) -> usize {
    let blocks = len.div_ceil(KV_BLOCK);
    blocks.div_ceil(4).max(blocks.min(16)).clamp(1, max_splits.max(1))
}

/// CTAs per (KV head, token) of the decode attention for a batch of `ntok`:
/// enough for one split each at one token (up to `max_splits`), fewer as the
/// batch grows (each CTA then loops over several splits), so the grid stays
/// near 512 CTAs whatever the context lengths. It depends on the batch size
/// only, so one captured graph per batch size serves every length.
pub fn grid_splits(ntok: usize, max_splits: usize) -> usize {
    (512 / ntok.max(1)).clamp(1, max_splits.max(1))
}

pub fn scale_log2(dims: &Dims) -> f32 {
    (1.0 / (dims.a_head_dim as f64).sqrt() * std::f64::consts::LOG2_E) as f32
}

/// Decode attention for `ntok` tokens then the combine with the gates. Each
/// token's split count follows its own length (read from `pos` on the
/// device), so nothing here depends on the context lengths.
#[allow(clippy::too_many_arguments)]
pub fn decode(gpu: &Gpu, k: &Kernels, dims: &Dims, q: u64, kv: &KvView, pos: u64, slot: u64, s: &DecodeScratch, proj: u64, proj_stride: usize, mix: MixOut, ntok: usize) -> CudaResult<()> {
    if s.max_splits == 0 {
        return Err(CudaError::shape("attn_decode", "scratch holds no splits"));
    }
    if ntok == 0 {
        return Ok(());
    }
    let p = AttnDecodeParams {
        q,
        kcache: kv.k,
        vcache: kv.v,
        block_table: kv.block_table,
        pos,
        slot,
        part_o: s.part_o,
        part_ml: s.part_ml,
        bt_stride: kv.bt_stride as i32,
        max_splits: s.max_splits as i32,
        scale_log2: scale_log2(dims),
    };
    let grid_y = grid_splits(ntok, s.max_splits) as u32;
    launch(gpu, k, "attn_decode", (dims.a_kv_heads as u32, grid_y, ntok as u32), 256, 0, &p)?;
    let (mix_f32, mix_f16) = match mix {
        MixOut::F32(p) => (p, 0),
        MixOut::F16(p) => (0, p),
        MixOut::Packed(_) => return Err(CudaError::shape("attention", "writes f32 or fp16 rows, not packed activations")),
    };
    let c = AttnCombineParams { part_o: s.part_o, part_ml: s.part_ml, proj, mix_f32, mix_f16, pos, max_splits: s.max_splits as i32, proj_stride: proj_stride as i32 };
    launch(gpu, k, "attn_combine", (dims.a_heads as u32, ntok as u32, 1), dims.a_head_dim as u32, 0, &c)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct AttnPrefillParams {
    q: u64,
    kcache: u64,
    vcache: u64,
    block_table: u64,
    proj: u64,
    mix_f32: u64,
    mix_f16: u64,
    proj_stride: i32,
    t: i32,
    p0: i32,
    scale_log2: f32,
}
// SAFETY: plain-old-data mirroring `AttnPrefillParams` in attention.cu.
unsafe impl DeviceRepr for AttnPrefillParams {}

pub fn prefill_smem(dims: &Dims) -> usize {
    3 * 64 * (dims.a_head_dim + 8) * 2
}

/// Causal attention of `t` query tokens (fp16 q, positions p0..p0+t) of one
/// sequence over its cache (block table row `block_table`).
#[allow(clippy::too_many_arguments)]
pub fn prefill(gpu: &Gpu, k: &Kernels, dims: &Dims, q: u64, kv_k: u64, kv_v: u64, block_table: u64, proj: u64, proj_stride: usize, t: usize, p0: usize, mix: MixOut) -> CudaResult<()> {
    if t == 0 {
        return Ok(());
    }
    let (mix_f32, mix_f16) = match mix {
        MixOut::F32(p) => (p, 0),
        MixOut::F16(p) => (0, p),
        MixOut::Packed(_) => return Err(CudaError::shape("attention", "writes f32 or fp16 rows, not packed activations")),
    };
    let p = AttnPrefillParams {
        q,
        kcache: kv_k,
        vcache: kv_v,
        block_table,
        proj,
        mix_f32,
        mix_f16,
        proj_stride: proj_stride as i32,
        t: t as i32,
        p0: p0 as i32,
        scale_log2: scale_log2(dims),
    };
    launch(gpu, k, "attn_prefill", (t.div_ceil(64) as u32, dims.a_heads as u32, 1), 128, prefill_smem(dims), &p)
}
