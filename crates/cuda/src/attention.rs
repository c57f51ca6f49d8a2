//! Launchers of kernels/attention.cu: q/k norm + RoPE + KV-cache write, the
//! split-KV decode attention and its combine, and the causal flash prefill.
//! The paged KV layout, the work decomposition and the expected time of each
//! kernel against its floor are described in the kernel's header; the tile
//! geometry is defined once in dims.rs and passed to the source as defines.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::dims::{
    Dims, ATTN_DEC_KEYS, ATTN_DEC_STAGES, ATTN_DEC_WARPS, ATTN_PAD, ATTN_PF_K_STAGES, ATTN_PF_MAX_PIECES, ATTN_PF_PRODUCER_WARPS, ATTN_PF_TOKENS,
    ATTN_PF_V_STAGES, ATTN_SPLIT_SMALL, KV_BLOCK,
};
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
    ntok: i32,
}
// SAFETY: plain-old-data mirroring `AttnPrepParams` in attention.cu (size
// checked there against `defines`).
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

/// Warps of an `attn_prep` block, each one (token, head).
const ATTN_PREP_WARPS: usize = 8;

/// Norms, rotates and stores q/k/v of `ntok` tokens (positions `pos`, slots `slot`).
#[allow(clippy::too_many_arguments)]
pub fn prep(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    w: &AttentionDev,
    inv_freq: u64,
    proj: u64,
    proj_stride: usize,
    pos: u64,
    slot: u64,
    kv: &KvView,
    q: QOut,
    ntok: usize,
) -> CudaResult<()> {
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
        ntok: i32::try_from(ntok).map_err(|_| CudaError::shape("attn_prep", format!("{ntok} tokens")))?,
    };
    // A warp an item (token, head): the queries, the K heads, the V heads.
    let items = ntok * (dims.a_heads + 2 * dims.a_kv_heads);
    launch(gpu, k, "attn_prep", (items.div_ceil(ATTN_PREP_WARPS) as u32, 1, 1), (32 * ATTN_PREP_WARPS) as u32, 0, &p)
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
    ntok: i32,
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

/// Split-KV partials of the decode attention.
#[derive(Clone, Copy)]
pub struct DecodeScratch {
    /// f32 [ntok][heads][max_splits][head_dim].
    pub part_o: u64,
    /// f32 [ntok][heads][max_splits][2].
    pub part_ml: u64,
    pub max_splits: usize,
}

/// Most splits a decode token's context is cut into (the memory plan's
/// cap, `state::max_splits`; `attn_combine_rows` keeps a head's weights in
/// shared memory for as many).
pub const ATTN_MAX_SPLITS: usize = 128;
/// Tokens from which a decode step merges the splits with
/// `attn_combine_rows` (a block a head and token, a thread a head dim)
/// rather than `attn_combine` (a block a 32-dim chunk): the same sums in the
/// same order, so the same bits. At 64 tokens of 256-key contexts
/// `attn_combine` ran 8,192 blocks of ~5 splits, 21.7 us a layer in the
/// graph on the H100 (session 49's timeline). 5, so that the batch of 5 in
/// gpu_attention's alone-and-in-a-batch test runs it against the tokens
/// alone on `attn_combine`.
pub const COMBINE_ROWS_FROM: usize = 5;
/// Head dims an `attn_combine` block merges (grid.x = head dim / this).
const COMBINE_DIMS: usize = 32;
/// Threads of an `attn_combine` block: COMBINE_DIMS / 4 float4 lanes of
/// dims times the split lanes (`CB_SL` in attention.cu).
const COMBINE_THREADS: usize = 256;

/// Splits for a context of `len` tokens: one KV block per split up to
/// `ATTN_SPLIT_SMALL` blocks (short contexts are latency-bound), at least two
/// blocks per split beyond (the partials stay under 1/8 of the bytes read),
/// more when `max_splits` binds. The kernels compute the same count on the
/// device from each token's own length (`decode_splits` in attention.cu), so
/// a sequence splits the same way alone or in any batch; here it sizes the
/// scratch. Never more than `max_splits`.
pub fn splits_for(len: usize, max_splits: usize) -> usize {
    split_plan(len, max_splits).1
}

/// (blocks per split, splits) for a context of `len` tokens; the same
/// arithmetic as `decode_per` / `decode_splits` in attention.cu.
fn split_plan(len: usize, max_splits: usize) -> (usize, usize) {
    let blocks = len.div_ceil(KV_BLOCK).max(1);
    let min_per = if blocks > ATTN_SPLIT_SMALL { 2 } else { 1 };
    let per = blocks.div_ceil(max_splits.max(1)).max(min_per);
    (per, blocks.div_ceil(per))
}

/// Dynamic shared memory of `attn_decode` for a batch of `ntok`: every
/// warp's pipeline stages (K and V tiles of `ATTN_DEC_KEYS` padded rows) and
/// query fragments (16 bytes per lane per 16 dims), then the batch's item
/// prefix sums, lengths and slots.
pub fn decode_smem(dims: &Dims, ntok: usize) -> usize {
    let stages = ATTN_DEC_STAGES * 2 * ATTN_DEC_KEYS * (dims.a_head_dim + ATTN_PAD) * 2;
    let queries = dims.a_head_dim / 16 * 32 * 16;
    ATTN_DEC_WARPS * (stages + queries) + (3 * ntok + 1) * 4
}

/// Blocks of the persistent decode grid: one per SM, fewer only when the
/// batch cannot have that many items (`ntok x max_splits x kv_heads`); item
/// i goes to warp i / grid of block i % grid, so the first items of a step
/// spread over every SM. Depends on the batch size only, never on context
/// lengths.
pub fn decode_grid(gpu: &Gpu, dims: &Dims, ntok: usize, max_splits: usize) -> u32 {
    let items = ntok * max_splits.max(1) * dims.a_kv_heads;
    items.clamp(1, gpu.sm_count.max(1) as usize) as u32
}

pub fn scale_log2(dims: &Dims) -> f32 {
    (1.0 / (dims.a_head_dim as f64).sqrt() * std::f64::consts::LOG2_E) as f32
}

/// Decode attention for `ntok` tokens (one query each) then the combine with
/// the gates: two launches. Each token's split count follows its own length
/// (read from `pos` on the device) and the grids depend on `ntok` and the
/// scratch only, so one captured graph per batch size serves every context
/// length.
#[allow(clippy::too_many_arguments)]
pub fn decode(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    q: u64,
    kv: &KvView,
    pos: u64,
    slot: u64,
    s: &DecodeScratch,
    proj: u64,
    proj_stride: usize,
    mix: MixOut,
    ntok: usize,
) -> CudaResult<()> {
    if s.max_splits == 0 || s.max_splits > ATTN_MAX_SPLITS {
        return Err(CudaError::shape("attn_decode", format!("scratch holds {} splits, expected 1..={ATTN_MAX_SPLITS}", s.max_splits)));
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
        ntok: ntok as i32,
        scale_log2: scale_log2(dims),
    };
    let smem = decode_smem(dims, ntok);
    if smem > gpu.max_smem_optin as usize {
        return Err(CudaError::shape(
            "attn_decode",
            format!("a batch of {ntok} tokens needs {smem} bytes of shared memory, the device allows {}", gpu.max_smem_optin),
        ));
    }
    let grid = decode_grid(gpu, dims, ntok, s.max_splits);
    launch(gpu, k, "attn_decode", (grid, 1, 1), (ATTN_DEC_WARPS * 32) as u32, smem, &p)?;
    let (mix_f32, mix_f16) = match mix {
        MixOut::F32(p) => (p, 0),
        MixOut::F16(p) => (0, p),
        MixOut::Packed { .. } => return Err(CudaError::shape("attention", "writes f32 or fp16 rows, not packed activations")),
    };
    let c = AttnCombineParams {
        part_o: s.part_o,
        part_ml: s.part_ml,
        proj,
        mix_f32,
        mix_f16,
        pos,
        max_splits: s.max_splits as i32,
        proj_stride: proj_stride as i32,
    };
    if ntok >= COMBINE_ROWS_FROM {
        launch(gpu, k, "attn_combine_rows", (dims.a_heads as u32, ntok as u32, 1), dims.a_head_dim as u32, 0, &c)
    } else {
        launch(gpu, k, "attn_combine", ((dims.a_head_dim / COMBINE_DIMS) as u32, dims.a_heads as u32, ntok as u32), COMBINE_THREADS as u32, 0, &c)
    }
}

/// One sequence's rows of a prefill pass, as `attn_prefill` reads them
/// (attention.cu `PfPiece`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PfPiece {
    block_table: u64,
    row0: i32,
    t: i32,
    p0: i32,
    tile0: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct AttnPrefillParams {
    q: u64,
    kcache: u64,
    vcache: u64,
    proj: u64,
    mix_f32: u64,
    mix_f16: u64,
    proj_stride: i32,
    npieces: i32,
    scale_log2: f32,
    pad: i32,
    piece: [PfPiece; ATTN_PF_MAX_PIECES],
}
// SAFETY: plain-old-data mirroring `AttnPrefillParams` in attention.cu.
unsafe impl DeviceRepr for AttnPrefillParams {}

/// The layout sizes attention.cu checks against these mirrors.
pub fn defines() -> Vec<String> {
    vec![
        format!("-DATT_MAX_SPLITS={ATTN_MAX_SPLITS}"),
        format!("-DATTN_PREFILL_PARAMS_SIZE={}", std::mem::size_of::<AttnPrefillParams>()),
        format!("-DATTN_PREP_PARAMS_SIZE={}", std::mem::size_of::<AttnPrepParams>()),
        format!("-DATT_PREP_WARPS={ATTN_PREP_WARPS}"),
        format!("-DATT_COMBINE_DIMS={COMBINE_DIMS}"),
        format!("-DATT_COMBINE_THREADS={COMBINE_THREADS}"),
    ]
}

/// Dynamic shared memory of `attn_prefill`: the Q tile (8 heads x
/// `ATTN_PF_TOKENS` rows), then K tiles of one cache block in
/// `ATTN_PF_K_STAGES` stages and V tiles in `ATTN_PF_V_STAGES`, unpadded
/// (128-byte-swizzled rows), a full and an empty mbarrier a stage, plus
/// 1,024 bytes the kernel may skip to align its swizzle atoms. 225 KiB at
/// the real shape.
pub fn prefill_smem(dims: &Dims) -> usize {
    let group = dims.a_heads / dims.a_kv_heads;
    let stages = ATTN_PF_K_STAGES + ATTN_PF_V_STAGES;
    (group * ATTN_PF_TOKENS + stages * KV_BLOCK) * dims.a_head_dim * 2 + 2 * stages * 8 + 1024
}

/// Threads of an `attn_prefill` block: a consumer warp a query head of the
/// KV group, then the producer warps.
pub fn prefill_threads(dims: &Dims) -> usize {
    (dims.a_heads / dims.a_kv_heads + ATTN_PF_PRODUCER_WARPS) * 32
}

/// One sequence's run of rows in a prefill pass: its block-table row
/// (device address), the pass row of its first token, its token count and
/// that token's position.
#[derive(Clone, Copy, Debug)]
pub struct PrefillPiece {
    pub block_table: u64,
    pub row0: usize,
    pub t: usize,
    pub p0: usize,
}

/// Causal attention of `t` query tokens (fp16 q, positions p0..p0+t) of one
/// sequence over its cache (block table row `block_table`); `q`, `proj`
/// and `mix` at the sequence's first row.
#[allow(clippy::too_many_arguments)]
pub fn prefill(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    q: u64,
    kv_k: u64,
    kv_v: u64,
    block_table: u64,
    proj: u64,
    proj_stride: usize,
    t: usize,
    p0: usize,
    mix: MixOut,
) -> CudaResult<()> {
    prefill_pieces(gpu, k, dims, q, kv_k, kv_v, proj, proj_stride, &[PrefillPiece { block_table, row0: 0, t, p0 }], mix)
}

/// Causal attention of every piece of a prefill pass (each its own
/// sequence) in one launch per `ATTN_PF_MAX_PIECES` pieces, so the query
/// tiles of many short prompts fill the GPU together; `q`, `proj` and `mix`
/// at the pass's row 0. The pieces run longest first.
#[allow(clippy::too_many_arguments)]
pub fn prefill_pieces(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    q: u64,
    kv_k: u64,
    kv_v: u64,
    proj: u64,
    proj_stride: usize,
    pieces: &[PrefillPiece],
    mix: MixOut,
) -> CudaResult<()> {
    let (mix_f32, mix_f16) = match mix {
        MixOut::F32(p) => (p, 0),
        MixOut::F16(p) => (0, p),
        MixOut::Packed { .. } => return Err(CudaError::shape("attention", "writes f32 or fp16 rows, not packed activations")),
    };
    if let Some(bad) = pieces.iter().find(|p| p.t == 0 || p.block_table == 0 || p.row0 + p.t > i32::MAX as usize || p.p0 + p.t > i32::MAX as usize) {
        return Err(CudaError::shape("attn_prefill", format!("piece {bad:?}: empty, without a block table or past i32")));
    }
    let mut order: Vec<&PrefillPiece> = pieces.iter().collect();
    order.sort_by_key(|p| std::cmp::Reverse(p.p0 + p.t));
    for part in order.chunks(ATTN_PF_MAX_PIECES) {
        let mut table = [PfPiece::default(); ATTN_PF_MAX_PIECES];
        let mut tiles = 0usize;
        for (slot, pc) in table.iter_mut().zip(part) {
            *slot = PfPiece { block_table: pc.block_table, row0: pc.row0 as i32, t: pc.t as i32, p0: pc.p0 as i32, tile0: tiles as i32 };
            tiles += pc.t.div_ceil(ATTN_PF_TOKENS);
        }
        let p = AttnPrefillParams {
            q,
            kcache: kv_k,
            vcache: kv_v,
            proj,
            mix_f32,
            mix_f16,
            proj_stride: proj_stride as i32,
            npieces: part.len() as i32,
            scale_log2: scale_log2(dims),
            pad: 0,
            piece: table,
        };
        launch(gpu, k, "attn_prefill", (tiles as u32, dims.a_kv_heads as u32, 1), prefill_threads(dims) as u32, prefill_smem(dims), &p)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_the_context_within_the_limit() {
        let lens = (1usize..70_000).step_by(37).chain([64, 65, 1024, 1025, 1088, 4096, 16384, 40960, 131_072, 262_144]);
        for len in lens {
            let blocks = len.div_ceil(KV_BLOCK);
            for ms in [1usize, 7, 16, 64, 128] {
                let (per, s) = split_plan(len, ms);
                assert!(s >= 1 && s <= ms, "len {len} max {ms}: {s} splits");
                // Every split holds at least one block and together they hold all.
                assert!((s - 1) * per < blocks && blocks <= s * per, "len {len} max {ms}: {s} x {per} for {blocks} blocks");
                if blocks <= ATTN_SPLIT_SMALL && blocks <= ms {
                    assert_eq!(s, blocks, "short context {len}: one block per split");
                }
                if blocks > ATTN_SPLIT_SMALL {
                    assert!(per >= 2, "len {len}: at least two blocks per split");
                }
            }
        }
        assert_eq!(splits_for(262_144, 128), 128, "the memory plan's cap is reached at the longest context");
    }
}
