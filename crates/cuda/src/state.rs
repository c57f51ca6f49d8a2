//! The memory plan: everything besides the weights, allocated once at start.
//!
//! - KV cache: a pool of fixed blocks of `KV_BLOCK` tokens per attention
//!   layer (K and V, fp16, [block][kv_heads][KV_BLOCK][head_dim]), shared by
//!   all sequences through per-sequence block tables (i32 [slots][max blocks
//!   per sequence] on the device). Full blocks can be shared between forks
//!   (reference counts); a fork copies only the partly filled last block.
//! - DeltaNet state: per sequence slot, the conv rings and fp32 recurrent
//!   states of every DeltaNet layer ([slot][layer][...], so a fork copies one
//!   range).
//! - Scratch: every intermediate of a decode step (up to `max_batch` tokens)
//!   and of a prefill chunk (up to `prefill_chunk` tokens), named so any of
//!   them can be dumped. Nothing is allocated after start, so a decode step
//!   can be captured as a CUDA graph.
//!
//! This module owns sizes and bookkeeping; model.rs owns the math.

use std::collections::BTreeMap;
use std::sync::Arc;

use lily_model::SeqId;

use crate::attention::DecodeScratch;
use crate::device::{copy_device, write_device, DevSlice, DeviceBuffer, Gpu};
use crate::dims::{Dims, GDN_CHUNK, KV_BLOCK};
use crate::error::{CudaError, CudaResult};
use crate::gdn::GdnScratch;
use crate::gemm::{SplitScratch, SPLITK_FLOATS};
use crate::moe::{max_tiles_any, RouteBufs};
use crate::qmm::{self, MoeBufs, PackedRows, MAX_DECODE_BATCH};

/// Sizes chosen by the caller; `Options::default()` fits the benchmark
/// contract (one 262,144-token sequence) in the 28 GB budget with the model.
#[derive(Clone, Debug)]
pub struct Options {
    /// Longest sequence (prompt + generated).
    pub max_seq_len: usize,
    /// Sequences holding state at once (DeltaNet state slots).
    pub max_sequences: usize,
    /// Tokens of KV cache shared by all sequences.
    pub kv_tokens: usize,
    /// Largest decode batch (1..=128): one step takes this many sequences.
    pub max_batch: usize,
    /// Tokens per prefill chunk (a multiple of 64).
    pub prefill_chunk: usize,
    /// Capture decode steps as CUDA graphs.
    pub use_graphs: bool,
    /// Longest run of greedy steps one `decode_greedy` call keeps on the GPU.
    pub max_greedy_steps: usize,
    /// Which kernels carry a decode step's matrices (`DecodeMatrices`).
    pub decode_matrices: DecodeMatrices,
    /// Steps of up to `qmm::MOE_FUSED_TOK` tokens run their MoE (router,
    /// gate/up, down) as one launch (`qmm::moe_fused`, bit-identical to the
    /// three launches it replaces). Off by default: measured slower on the
    /// H200 (crates/cuda/NOTES.md, history 36).
    pub fused_moe: bool,
    /// Prefill passes of at least this many tokens run their dense
    /// projections (in- and out-projections) on `hgemm`: each matrix
    /// dequantised once per pass into fp16 and multiplied by the TMA-fed
    /// fp16 GEMM. `None`: always gemm.cu's 4-bit tiles.
    pub f16_gemm_from: Option<usize>,
    /// On the `hgemm` path, dequantise a layer's out-projection and the next
    /// layer's in-projections on the second stream while the mixer runs
    /// (into `w16_out` and `w16`), instead of just before each multiply on
    /// the main stream: the same fp16 weights, so the same bits. Off: the
    /// in-line order (a measurement and test knob).
    pub dequant_ahead: bool,
    /// The grouped expert GEMMs' tile height (one of `gemm::TILE_ROWS`) at
    /// every prefill pass; `None`: `moe::tile_rows` picks it from the pass
    /// length (the default). A measurement knob (bench `--expert-rows`).
    pub expert_tile_rows: Option<usize>,
    /// Decode steps on the GEMM path (`DecodeMatrices::on_gemm`) of at least
    /// this many sequences run their experts on fp16 activations
    /// (`qmm_moe_f16`: 8 tokens an n-tile, plan items of 8 pairs), the GEMM
    /// path's precision of x; `None`: the exact hi/lo activations at every
    /// size. `MOE_F16_FROM` by default; `LILY_MOE_F16`, bench `--moe-f16 FROM|off`.
    pub moe_f16_from: Option<usize>,
    /// Decode steps on the GEMM path of at least this many sequences route
    /// with `moe_router_mma` (`qmm::RouterMath::TensorCores`: the router's
    /// dot products on mma.sync, the same staging, packing and plan);
    /// `None`: `moe_router` at every size. `ROUTER_MMA_FROM` by default;
    /// `LILY_ROUTER_MMA`, bench `--router-mma FROM|off`.
    pub router_mma_from: Option<usize>,
}

/// Default of `Options::f16_gemm_from`: the pass length from which the
/// dequantise-then-multiply path is the faster one. Session 24, H200, the
/// persistent hgemm against the 4-bit tiles (two rounds, one lease): 1,024
/// tokens -1.2%, 1,536 +3.6%, 2,048 +3.9% prefill tok/s (crates/cuda/NOTES.md
/// history 67, 72).
pub const F16_GEMM_FROM: usize = 1536;

/// Decode steps of at least this many sequences run their dense matrices on
/// the tensor-core GEMM by default (`DecodeMatrices::FASTEST`): the
/// crossover measured on the H200 at 5dd0a2c, where qmm wins at 8 sequences
/// (one 8-token chunk) and the GEMM from the second chunk on (10: 5.11
/// against 5.79 ms a step; 12: 5.49 against 6.30).
pub const DECODE_GEMM_FROM: usize = 9;

/// qmm decode steps of at least this many sequences (below
/// `DECODE_GEMM_FROM`) read the dense matrices' activations in fp16 by
/// default (`DecodeMatrices::f16_from`): 5-8 tokens then fit one 8-token
/// n-tile instead of two hi/lo ones. Measured on the H100 (sessions 47-48,
/// docs/perf/2026-12-05-s48.md): the served batch-8 step 4.145 -> 3.97 ms,
/// 8 clients' inter-token p50 4.10 -> 3.88-3.94 ms; a batch of 5 against
/// each sequence alone 5.2e-4 mean |dlogprob| (gpu_model).
pub const DECODE_F16_FROM: usize = 5;

/// GEMM-path decode steps of at least this many sequences run their experts
/// on fp16 activations by default (`Options::moe_f16_from`). Measured on the
/// H100 (session 58, docs/perf/2026-12-06-s58.md; crates/cuda/NOTES.md
/// history 198), ms a step with the exact hi/lo experts -> fp16, two rounds
/// each: 16 sequences 5.875 -> 5.882 (no gain: the step waits on other
/// phases), 32 9.046 -> 8.990, 64 12.717 -> 12.439, 128 21.31 -> 19.35.
/// The router keeps the exact activations, so the routing is the exact
/// path's; only the experts' inputs are rounded to fp16 once (gpu_qmm:
/// 3e-3 against the exact reference).
pub const MOE_F16_FROM: usize = 32;

/// GEMM-path decode steps of at least this many sequences route on the
/// tensor cores by default (`Options::router_mma_from`). Measured on the
/// H100 (session 61, docs/perf/2026-12-06-s61.md; NOTES history 210), ms a
/// step moe_router -> moe_router_mma, two interleaved rounds each: 16
/// sequences 5.933 / 5.939 -> 5.935 / 5.927, 24 7.753 / 7.751 -> 7.786 /
/// 7.790, 32 9.031 / 9.020 -> 9.066 / 9.045 (slower), 40 9.963 / 9.970 ->
/// 9.843 / 9.842, 48 -0.5%, 56 -0.7%, 64 12.594 / 12.570 -> 12.511 /
/// 12.503, 96 -3.3%, 128 19.533 / 19.501 -> 19.075 / 19.051.
pub const ROUTER_MMA_FROM: usize = 40;

/// Which kernels carry the matrices of a decode step of `n` sequences.
///
/// qmm.cu reads every weight once for the whole batch with exact packed
/// activations and a K split fixed by shape, so a sequence's logits are
/// bit-identical whatever batch it runs in; but its dense kernels pay per
/// token (the exact affine fold per 4-token tile, the x of each chunk of 8
/// tokens re-staged per weight slice), so from a dozen sequences on they
/// are bound by instruction issue. The prefill's GEMM (gemm.cu: wgmma on
/// fp16 activations) then runs the dense projections and the lm_head
/// faster, at the price of batch invariance: a sequence's activations are
/// rounded to fp16 once per matrix, so its logits move slightly (~2e-4
/// mean |dlogprob| on the 4-layer full-width model) when its batch crosses
/// `gemm_from`. The MoE stays on qmm on both paths: the grouped expert GEMM
/// was slower below 128 sequences and less precise (router logits and
/// expert activations in fp16: 1.6e-3 mean |dlogprob|, and a greedy token
/// of that model flipped; crates/cuda/NOTES.md history 30).
///
/// `f16_from` (`DECODE_F16_FROM` by default; `LILY_DECODE_F16`, bench `--decode-f16`):
/// qmm steps of `f16_from` to `F16_MAX_TOK` (16) sequences read only the
/// fp16 (hi) halves of the packed activations in the dense projections and
/// the lm_head, 8 tokens an n-tile (`qmm::XPrecision::F16`), so 5-8 tokens
/// take one n-tile's mma, x fragments and fold instead of two, and 9-16 two
/// instead of four (those steps run on qmm only where `gemm_from` is above
/// them: by default the GEMM path takes them). The codes stay exact;
/// x is rounded to fp16 once, as on the GEMM path (which also rounds the
/// weights). Like `gemm_from`, it moves a sequence's logits slightly when
/// its batch crosses the threshold. The MoE keeps hi/lo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeMatrices {
    /// Steps of at least this many sequences run the dense projections and
    /// the lm_head on the GEMM; `usize::MAX`: every step on qmm
    /// (batch-invariant decode).
    pub gemm_from: usize,
    /// qmm steps of at least this many sequences (2..=`F16_MAX_TOK`, up to
    /// `F16_MAX_TOK` of them) run the dense matrices on fp16 activations;
    /// `usize::MAX`: never.
    pub f16_from: usize,
}

/// Most tokens of a dense launch on fp16 activations: two n-tiles of 8.
pub const F16_MAX_TOK: usize = 16;

impl DecodeMatrices {
    /// Every step on qmm: a sequence's logits do not depend on its batch.
    pub const BATCH_INVARIANT: DecodeMatrices = DecodeMatrices { gemm_from: usize::MAX, f16_from: usize::MAX };

    /// The default: the GEMM from `DECODE_GEMM_FROM` sequences on, where it
    /// overtakes qmm on the H200 (docs/perf/2026-12-01-h200-s14.md); qmm's
    /// dense matrices on fp16 activations from `DECODE_F16_FROM`, on exact
    /// hi/lo activations below it.
    pub const FASTEST: DecodeMatrices = DecodeMatrices { gemm_from: DECODE_GEMM_FROM, f16_from: DECODE_F16_FROM };

    /// Parses `off` (batch-invariant) or `FROM` (the GEMM path from FROM
    /// sequences on, `f16_from` as in `FASTEST`): the form of the
    /// `LILY_DECODE_GEMM` tuning variable and the probes' flag.
    pub fn parse(s: &str) -> Result<DecodeMatrices, String> {
        match parse_threshold(s, "decode GEMM threshold")? {
            None => Ok(DecodeMatrices::BATCH_INVARIANT),
            Some(0) => Err("decode GEMM threshold 0 (the smallest step has one sequence)".into()),
            Some(gemm_from) => Ok(DecodeMatrices { gemm_from, ..DecodeMatrices::FASTEST }),
        }
    }

    /// Parses `off` or `FROM` (2..=`F16_MAX_TOK`) for `f16_from`: the form
    /// of the `LILY_DECODE_F16` tuning variable and the probes' flag.
    pub fn parse_f16_from(s: &str) -> Result<usize, String> {
        match parse_threshold(s, "fp16 decode threshold")? {
            None => Ok(usize::MAX),
            Some(n) if Self::f16_from_is_valid(n) => Ok(n),
            Some(n) => Err(format!("fp16 decode threshold {n}: want 2..={F16_MAX_TOK} (one token gains nothing from 8-token n-tiles; past {F16_MAX_TOK} the steps are chunked) or off")),
        }
    }

    /// Whether `n` is a threshold `f16_from` may take (2..=`F16_MAX_TOK`;
    /// the field may also be `usize::MAX`, off).
    const fn f16_from_is_valid(n: usize) -> bool {
        n >= 2 && n <= F16_MAX_TOK
    }

    /// Whether a step of `n` sequences runs on the GEMM path.
    pub fn on_gemm(&self, n: usize) -> bool {
        n >= self.gemm_from
    }

    /// Whether a step of `n` sequences gives each sequence the logits it
    /// has decoded alone, bit for bit: qmm on exact hi/lo activations.
    pub fn exact(&self, n: usize) -> bool {
        !self.on_gemm(n) && self.dense_x(n) == crate::qmm::XPrecision::HiLo
    }

    /// How a qmm step of `n` sequences reads its dense matrices' input.
    pub fn dense_x(&self, n: usize) -> crate::qmm::XPrecision {
        if n >= self.f16_from && n <= F16_MAX_TOK && !self.on_gemm(n) {
            crate::qmm::XPrecision::F16
        } else {
            crate::qmm::XPrecision::HiLo
        }
    }
}

/// The form of the decode-path tuning thresholds (`LILY_DECODE_GEMM`,
/// `LILY_DECODE_F16`, `LILY_MOE_F16` and the probes' flags): `off` (None) or
/// a number of sequences, surrounding blanks ignored; `what` names the
/// threshold in the error. Each caller checks its own range.
fn parse_threshold(s: &str, what: &str) -> Result<Option<usize>, String> {
    let s = s.trim();
    if s == "off" {
        return Ok(None);
    }
    s.parse::<usize>().map(Some).map_err(|e| format!("{what} {s:?}: {e} (want off or a number of sequences)"))
}

/// `parse_threshold` for a number of sequences a step, which is at least 1.
fn parse_step_threshold(s: &str, what: &str) -> Result<Option<usize>, String> {
    match parse_threshold(s, what)? {
        Some(0) => Err(format!("{what} 0 (the smallest step has one sequence)")),
        from => Ok(from),
    }
}

impl Options {
    /// Parses `off` or `FROM` (at least 1) for `moe_f16_from`: the form of
    /// the `LILY_MOE_F16` tuning variable and bench's `--moe-f16`.
    pub fn parse_moe_f16_from(s: &str) -> Result<Option<usize>, String> {
        parse_step_threshold(s, "fp16 experts threshold")
    }

    /// Parses `off` or `FROM` (at least 1) for `router_mma_from`: the form
    /// of `LILY_ROUTER_MMA` and bench's `--router-mma`.
    pub fn parse_router_mma_from(s: &str) -> Result<Option<usize>, String> {
        parse_step_threshold(s, "tensor-core router threshold")
    }

    /// How the router of a decode step of `n` sequences of the model `dims`
    /// computes its logits (`moe_router_mma` only where it is compiled for
    /// the model's width: `qmm::router_mma_fits`).
    pub fn router_math(&self, n: usize, dims: &crate::dims::Dims) -> crate::qmm::RouterMath {
        if crate::qmm::router_mma_fits(dims) && self.decode_matrices.on_gemm(n) && self.router_mma_from.is_some_and(|f| n >= f) {
            crate::qmm::RouterMath::TensorCores
        } else {
            crate::qmm::RouterMath::CudaCores
        }
    }

    /// How the experts of a decode step of `n` sequences read their input.
    pub fn moe_x(&self, n: usize) -> crate::qmm::XPrecision {
        if self.decode_matrices.on_gemm(n) && self.moe_f16_from.is_some_and(|f| n >= f) {
            crate::qmm::XPrecision::F16
        } else {
            crate::qmm::XPrecision::HiLo
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_seq_len: 262_144,
            max_sequences: 8,
            kv_tokens: 262_144 + 4 * KV_BLOCK,
            max_batch: MAX_DECODE_BATCH,
            prefill_chunk: 4096,
            use_graphs: true,
            max_greedy_steps: 1024,
            decode_matrices: DecodeMatrices::FASTEST,
            fused_moe: false,
            f16_gemm_from: Some(F16_GEMM_FROM),
            dequant_ahead: true,
            expert_tile_rows: None,
            moe_f16_from: Some(MOE_F16_FROM),
            router_mma_from: Some(ROUTER_MMA_FROM),
        }
    }
}

impl Options {
    /// Options for a backend that only needs `max_seq_len` tokens per
    /// sequence (tests, the bench at one prompt length).
    pub fn for_context(max_seq_len: usize) -> Self {
        let mut o = Options::default();
        o.max_seq_len = max_seq_len.max(1);
        o.kv_tokens = (o.max_seq_len + KV_BLOCK) * 2;
        o
    }

    fn check(&self) -> CudaResult<()> {
        if self.max_batch == 0 || self.max_batch > MAX_DECODE_BATCH {
            return Err(CudaError::Unsupported(format!("max_batch {} (1..={MAX_DECODE_BATCH})", self.max_batch)));
        }
        if self.prefill_chunk == 0 || !self.prefill_chunk.is_multiple_of(GDN_CHUNK) || self.prefill_chunk > 16384 {
            return Err(CudaError::Unsupported(format!("prefill_chunk {} (a multiple of 64, at most 16384)", self.prefill_chunk)));
        }
        if self.max_sequences == 0 || self.kv_tokens < KV_BLOCK {
            return Err(CudaError::Unsupported("max_sequences and kv_tokens must be positive".into()));
        }
        let f16 = self.decode_matrices.f16_from;
        if f16 != usize::MAX && !DecodeMatrices::f16_from_is_valid(f16) {
            return Err(CudaError::Unsupported(format!("decode_matrices.f16_from {f16} (2..={F16_MAX_TOK}, or usize::MAX: off)")));
        }
        if let Some(bm) = self.expert_tile_rows {
            if !crate::gemm::TILE_ROWS.contains(&bm) {
                return Err(CudaError::Unsupported(format!("expert_tile_rows {bm}: the grouped GEMM is compiled for {:?}", crate::gemm::TILE_ROWS)));
            }
        }
        Ok(())
    }
}

/// Bump allocator of named pieces inside one device buffer.
struct Layout {
    size: usize,
    pieces: Vec<(&'static str, usize, usize)>,
}

impl Layout {
    fn add(&mut self, name: &'static str, bytes: usize) -> usize {
        let off = self.size;
        self.size += bytes.div_ceil(256) * 256;
        self.pieces.push((name, off, bytes));
        off
    }

    /// (offset, bytes) of piece `name`; a name the plan does not hold is an
    /// error, never a null address.
    fn piece(&self, name: &str) -> CudaResult<(usize, usize)> {
        self.pieces
            .iter()
            .find(|p| p.0 == name)
            .map(|p| (p.1, p.2))
            .ok_or_else(|| CudaError::Invalid(format!("the memory plan has no scratch piece named {name}")))
    }
}

/// The decode step's buffers as typed views (lengths in elements), so every
/// launcher checks what it touches. `h`, `proj`, `mix_f32`, `logits` and
/// `argmax` are the same memory as the `Scratch` pieces of those names; the
/// MoE's (the packed layer input among them) are in `moe`.
#[derive(Clone, Copy, Debug)]
pub struct DecodeBufs {
    pub h: DevSlice<f32>,
    pub proj: DevSlice<f32>,
    pub mix_f32: DevSlice<f32>,
    pub logits: DevSlice<f32>,
    pub argmax: DevSlice<u64>,
    /// Packed mixer output (the out-projection's input) with its group sums.
    pub px_mix: PackedRows,
    pub moe: MoeBufs,
}

/// Device addresses of the step scratch (rows = max(max_batch, prefill_chunk)).
#[derive(Clone, Copy, Debug)]
pub struct Scratch {
    pub rows: usize,
    // step inputs
    pub tokens: u64,
    pub pos: u64,
    pub slot: u64,
    pub step: u64,
    pub out_ids: u64,
    // activations
    pub h: u64,
    pub proj: u64,
    pub mix_f32: u64,
    pub mix_f16: u64,
    pub xn: u64,
    pub q_f32: u64,
    pub q_f16: u64,
    pub logits: u64,
    pub logit_rows: usize,
    pub argmax: u64,
    // attention decode
    pub part_o: u64,
    pub part_ml: u64,
    pub max_splits: usize,
    // moe
    pub router_logits: u64,
    pub sg: u64,
    pub topk_idx: u64,
    pub topk_w: u64,
    pub counts: u64,
    pub rank: u64,
    pub offsets: u64,
    pub tiles: u64,
    pub ntiles: u64,
    pub max_tiles: usize,
    pub perm: u64,
    pub inv: u64,
    /// The prefill routing's ticket (i32, 0 between launches).
    pub route_ticket: u64,
    pub act_sorted: u64,
    pub y_sorted: u64,
    pub act_sh: u64,
    pub ys: u64,
    /// f32 [SPLITK_FLOATS]: the split-K partials of a dense GEMM.
    pub gemm_partial: u64,
    /// fp16 rows of the dense matrices `hgemm` multiplies (the largest
    /// mixer projection, dequantised once per prefill pass).
    pub w16: crate::hgemm::F16Scratch,
    /// fp16 rows of a layer's out-projection, dequantised ahead
    /// (`Options::dequant_ahead`) while `w16` holds the in-projections.
    pub w16_out: crate::hgemm::F16Scratch,
    // deltanet prefill
    pub gdn: GdnScratchAddrs,
}

#[derive(Clone, Copy, Debug)]
pub struct GdnScratchAddrs {
    pub q: u64,
    pub k: u64,
    pub vu: u64,
    pub gg: u64,
    pub bb: u64,
    pub w: u64,
    pub gc: u64,
    pub hs: u64,
    pub o: u64,
    pub max_tokens: usize,
}

impl Scratch {
    pub fn route(&self) -> RouteBufs {
        RouteBufs {
            topk_idx: self.topk_idx,
            topk_w: self.topk_w,
            counts: self.counts,
            rank: self.rank,
            offsets: self.offsets,
            tiles: self.tiles,
            ntiles: self.ntiles,
            perm: self.perm,
            inv: self.inv,
            ticket: self.route_ticket,
        }
    }
    pub fn split_k(&self) -> SplitScratch {
        SplitScratch { ptr: self.gemm_partial, floats: SPLITK_FLOATS }
    }
    pub fn attn_decode(&self) -> DecodeScratch {
        DecodeScratch { part_o: self.part_o, part_ml: self.part_ml, max_splits: self.max_splits }
    }
    pub fn gdn_scratch(&self) -> GdnScratch {
        let g = &self.gdn;
        GdnScratch { q: g.q, k: g.k, vu: g.vu, gg: g.gg, bb: g.bb, w: g.w, gc: g.gc, hs: g.hs, o: g.o, max_tokens: g.max_tokens }
    }
}

/// One sequence's bookkeeping on the host.
#[derive(Clone, Debug)]
pub struct Seq {
    pub slot: usize,
    pub len: usize,
    pub blocks: Vec<u32>,
}

/// All memory besides the weights, and the sequences using it.
pub struct Memory {
    pub gpu: Arc<Gpu>,
    pub opts: Options,
    pub dims: Dims,
    // KV
    kv: DeviceBuffer,
    pub num_blocks: usize,
    pub blocks_per_seq: usize,
    pub block_table: DeviceBuffer,
    free_blocks: Vec<u32>,
    refcount: Vec<u32>,
    // DeltaNet state
    gdn_state: DeviceBuffer,
    gdn_conv: DeviceBuffer,
    free_slots: Vec<usize>,
    // scratch
    _scratch_buf: DeviceBuffer,
    pub scratch: Scratch,
    pub decode: DecodeBufs,
    pub scratch_pieces: Vec<(&'static str, u64, usize)>,
    // sequences
    pub seqs: BTreeMap<SeqId, Seq>,
    next_id: u64,
    attn_layers: Vec<usize>,
    gdn_layers: Vec<usize>,
}

/// Where each layer's state lives: the index among the attention (or
/// DeltaNet) layers.
pub fn layer_indices(dims: &Dims) -> (Vec<usize>, Vec<usize>) {
    let mut attn = vec![usize::MAX; dims.layers];
    let mut gdn = vec![usize::MAX; dims.layers];
    let (mut na, mut ng) = (0, 0);
    for i in 0..dims.layers {
        if i % 4 == 3 {
            attn[i] = na;
            na += 1;
        } else {
            gdn[i] = ng;
            ng += 1;
        }
    }
    (attn, gdn)
}

impl Memory {
    /// Bytes the plan will allocate for `opts` (for budgeting before loading).
    pub fn planned_bytes(dims: &Dims, opts: &Options) -> usize {
        let (attn, _) = layer_indices(dims);
        let n_attn = attn.iter().filter(|i| **i != usize::MAX).count();
        let n_gdn = dims.layers - n_attn;
        let num_blocks = opts.kv_tokens.div_ceil(KV_BLOCK);
        let kv = n_attn * num_blocks * dims.kv_block_bytes();
        let gdn = opts.max_sequences * n_gdn * (dims.gdn_state_floats() + dims.gdn_conv_floats()) * 4;
        kv + gdn + scratch_layout(dims, opts).size
    }

    pub fn new(gpu: &Arc<Gpu>, dims: &Dims, opts: Options) -> CudaResult<Self> {
        opts.check()?;
        let (attn_layers, gdn_layers) = layer_indices(dims);
        let n_attn = attn_layers.iter().filter(|i| **i != usize::MAX).count();
        let n_gdn = dims.layers - n_attn;
        let num_blocks = opts.kv_tokens.div_ceil(KV_BLOCK);
        let blocks_per_seq = opts.max_seq_len.div_ceil(KV_BLOCK) + 1;
        let kv = DeviceBuffer::zeroed(gpu, n_attn.max(1) * num_blocks * dims.kv_block_bytes(), "KV cache")?;
        let block_table = DeviceBuffer::zeroed(gpu, opts.max_sequences * blocks_per_seq * 4, "block tables")?;
        let gdn_state = DeviceBuffer::zeroed(gpu, opts.max_sequences * n_gdn.max(1) * dims.gdn_state_floats() * 4, "DeltaNet state")?;
        let gdn_conv = DeviceBuffer::zeroed(gpu, opts.max_sequences * n_gdn.max(1) * dims.gdn_conv_floats() * 4, "DeltaNet conv windows")?;
        let layout = scratch_layout(dims, &opts);
        let buf = DeviceBuffer::zeroed(gpu, layout.size, "step scratch")?;
        let base = buf.ptr();
        let get = |name: &str| -> CudaResult<u64> { Ok(base + layout.piece(name)?.0 as u64) };
        fn view<T>(base: u64, layout: &Layout, name: &str) -> CudaResult<DevSlice<T>> {
            let (off, bytes) = layout.piece(name)?;
            Ok(DevSlice::new(base + off as u64, bytes / std::mem::size_of::<T>()))
        }
        let decode = DecodeBufs {
            h: view(base, &layout, "h")?,
            proj: view(base, &layout, "proj")?,
            mix_f32: view(base, &layout, "mix_f32")?,
            logits: view(base, &layout, "logits")?,
            argmax: view(base, &layout, "argmax")?,
            px_mix: PackedRows { px: view(base, &layout, "px_mix")?, csum: view(base, &layout, "csum_mix")? },
            moe: MoeBufs {
                px_in: PackedRows { px: view(base, &layout, "px_in")?, csum: view(base, &layout, "csum_in")? },
                px_act: view(base, &layout, "px_act")?,
                y: view(base, &layout, "moe_y")?,
                logits: view(base, &layout, "router_logits")?,
                sg: view(base, &layout, "sg")?,
                topk_idx: view(base, &layout, "topk_idx")?,
                topk_w: view(base, &layout, "topk_w")?,
                plan: view(base, &layout, "moe_plan")?,
                ticket: view(base, &layout, "moe_ticket")?,
                barrier: view(base, &layout, "moe_barrier")?,
                max_items: qmm::max_plan_items(dims, opts.max_batch),
            },
        };
        let rows = opts.max_batch.max(opts.prefill_chunk);
        let tp = opts.prefill_chunk.div_ceil(GDN_CHUNK) * GDN_CHUNK;
        let scratch = Scratch {
            rows,
            tokens: get("tokens")?,
            pos: get("pos")?,
            slot: get("slot")?,
            step: get("step")?,
            out_ids: get("out_ids")?,
            h: get("h")?,
            proj: get("proj")?,
            mix_f32: get("mix_f32")?,
            mix_f16: get("mix_f16")?,
            xn: get("xn")?,
            q_f32: get("q_f32")?,
            q_f16: get("q_f16")?,
            logits: get("logits")?,
            logit_rows: logit_rows(&opts),
            argmax: get("argmax")?,
            part_o: get("part_o")?,
            part_ml: get("part_ml")?,
            max_splits: max_splits(&opts),
            router_logits: get("router_logits")?,
            sg: get("sg")?,
            topk_idx: get("topk_idx")?,
            topk_w: get("topk_w")?,
            counts: get("counts")?,
            rank: get("rank")?,
            offsets: get("offsets")?,
            tiles: get("tiles")?,
            ntiles: get("ntiles")?,
            max_tiles: max_tiles_any(dims, rows),
            perm: get("perm")?,
            inv: get("inv")?,
            route_ticket: get("route_ticket")?,
            act_sorted: get("act_sorted")?,
            y_sorted: get("y_sorted")?,
            act_sh: get("act_sh")?,
            ys: get("ys")?,
            gemm_partial: get("gemm_partial")?,
            w16: crate::hgemm::F16Scratch { ptr: get("w16")?, elems: w16_elems(dims, &opts) },
            w16_out: crate::hgemm::F16Scratch { ptr: get("w16_out")?, elems: w16_out_elems(dims, &opts) },
            gdn: GdnScratchAddrs {
                q: get("gdn_q")?,
                k: get("gdn_k")?,
                vu: get("gdn_vu")?,
                gg: get("gdn_gg")?,
                bb: get("gdn_bb")?,
                w: get("gdn_w")?,
                gc: get("gdn_gc")?,
                hs: get("gdn_hs")?,
                o: get("gdn_o")?,
                max_tokens: tp,
            },
        };
        let scratch_pieces = layout.pieces.iter().map(|(n, o, b)| (*n, base + *o as u64, *b)).collect();
        Ok(Memory {
            gpu: gpu.clone(),
            dims: dims.clone(),
            kv,
            num_blocks,
            blocks_per_seq,
            block_table,
            free_blocks: (0..num_blocks as u32).rev().collect(),
            refcount: vec![0; num_blocks],
            gdn_state,
            gdn_conv,
            free_slots: (0..opts.max_sequences).rev().collect(),
            _scratch_buf: buf,
            scratch,
            decode,
            scratch_pieces,
            seqs: BTreeMap::new(),
            next_id: 1,
            attn_layers,
            gdn_layers,
            opts,
        })
    }

    // ---- addresses ---------------------------------------------------------

    /// K and V base of layer `layer` (an attention layer).
    pub fn kv_layer(&self, layer: usize) -> (u64, u64) {
        let a = self.attn_layers[layer];
        let half = self.num_blocks * self.dims.kv_block_bytes() / 2;
        let base = self.kv.ptr() + (a * 2 * half) as u64;
        (base, base + half as u64)
    }

    pub fn bt_row(&self, slot: usize) -> u64 {
        self.block_table.ptr() + (slot * self.blocks_per_seq * 4) as u64
    }

    /// Floats between consecutive slots of the DeltaNet buffers.
    pub fn gdn_state_slot_stride(&self) -> usize {
        self.gdn_count() * self.dims.gdn_state_floats()
    }
    pub fn gdn_conv_slot_stride(&self) -> usize {
        self.gdn_count() * self.dims.gdn_conv_floats()
    }
    fn gdn_count(&self) -> usize {
        self.gdn_layers.iter().filter(|i| **i != usize::MAX).count().max(1)
    }
    /// (conv, state) of layer `layer` (a DeltaNet layer) in slot 0.
    pub fn gdn_layer(&self, layer: usize) -> (u64, u64) {
        let g = self.gdn_layers[layer];
        (self.gdn_conv.ptr() + (g * self.dims.gdn_conv_floats() * 4) as u64, self.gdn_state.ptr() + (g * self.dims.gdn_state_floats() * 4) as u64)
    }
    /// (conv, state) of layer `layer` for `slot`.
    pub fn gdn_layer_slot(&self, layer: usize, slot: usize) -> (u64, u64) {
        let (c, s) = self.gdn_layer(layer);
        (c + (slot * self.gdn_conv_slot_stride() * 4) as u64, s + (slot * self.gdn_state_slot_stride() * 4) as u64)
    }

    /// Bytes allocated by the plan (KV, state, scratch).
    pub fn bytes(&self) -> usize {
        self.kv.bytes() + self.block_table.bytes() + self.gdn_state.bytes() + self.gdn_conv.bytes() + self._scratch_buf.bytes()
    }

    // ---- sequences -----------------------------------------------------------

    pub fn alloc(&mut self) -> CudaResult<SeqId> {
        let slot = self
            .free_slots
            .pop()
            .ok_or_else(|| CudaError::Capacity(format!("all {} sequence slots are in use; free a sequence first", self.opts.max_sequences)))?;
        // A fresh sequence starts from zero state.
        let g = &self.gpu;
        let (c0, s0) = self.gdn_layer_slot_first(slot);
        crate::device::zero_device(g, c0, self.gdn_conv_slot_stride() * 4)?;
        crate::device::zero_device(g, s0, self.gdn_state_slot_stride() * 4)?;
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, Seq { slot, len: 0, blocks: Vec::new() });
        Ok(id)
    }

    fn gdn_layer_slot_first(&self, slot: usize) -> (u64, u64) {
        (self.gdn_conv.ptr() + (slot * self.gdn_conv_slot_stride() * 4) as u64, self.gdn_state.ptr() + (slot * self.gdn_state_slot_stride() * 4) as u64)
    }

    pub fn free(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.remove(&id) {
            for b in s.blocks {
                self.release_block(b);
            }
            self.free_slots.push(s.slot);
        }
    }

    fn release_block(&mut self, b: u32) {
        let rc = &mut self.refcount[b as usize];
        *rc = rc.saturating_sub(1);
        if *rc == 0 {
            self.free_blocks.push(b);
        }
    }

    pub fn seq(&self, id: SeqId) -> CudaResult<&Seq> {
        self.seqs.get(&id).ok_or_else(|| CudaError::Invalid(format!("unknown sequence {id:?}")))
    }

    /// Makes sure sequence `id` has KV blocks for positions < `new_len`,
    /// writing new block-table entries to the device.
    pub fn reserve(&mut self, id: SeqId, new_len: usize) -> CudaResult<()> {
        if new_len > self.opts.max_seq_len {
            return Err(CudaError::Capacity(format!(
                "sequence would hold {new_len} tokens; this backend was sized for at most {} per sequence",
                self.opts.max_seq_len
            )));
        }
        let need = new_len.div_ceil(KV_BLOCK);
        let have = self.seq(id)?.blocks.len();
        if need <= have {
            return Ok(());
        }
        if need - have > self.free_blocks.len() {
            return Err(CudaError::Capacity(format!(
                "KV cache full: {} more blocks of {KV_BLOCK} tokens needed, {} free of {}",
                need - have,
                self.free_blocks.len(),
                self.num_blocks
            )));
        }
        let mut new = Vec::with_capacity(need - have);
        for _ in have..need {
            let b = self.free_blocks.pop().ok_or_else(|| CudaError::Capacity("KV cache full".into()))?;
            self.refcount[b as usize] = 1;
            new.push(b);
        }
        let slot = self.seq(id)?.slot;
        let row = self.bt_row(slot) + (have * 4) as u64;
        let ids: Vec<i32> = new.iter().map(|b| *b as i32).collect();
        write_device(&self.gpu, row, &ids)?;
        if let Some(s) = self.seqs.get_mut(&id) {
            s.blocks.extend(new);
        }
        Ok(())
    }

    /// KV blocks for one more token of each sequence of `ids` (distinct),
    /// all or none: a refusal (too long, pool too small for the whole set)
    /// takes no block. The new block-table entries are not written here:
    /// they come back as (index into the block table, block) for the
    /// caller to write on the stream before the step that uses them
    /// (`feed_stage`), so no host copy waits for the steps in flight.
    pub fn reserve_next_deferred(&mut self, ids: &[SeqId]) -> CudaResult<Vec<(i32, i32)>> {
        let mut grow = Vec::new();
        for id in ids {
            let s = self.seq(*id)?;
            let new_len = s.len + 1;
            if new_len > self.opts.max_seq_len {
                return Err(CudaError::Capacity(format!(
                    "sequence would hold {new_len} tokens; this backend was sized for at most {} per sequence",
                    self.opts.max_seq_len
                )));
            }
            if new_len.div_ceil(KV_BLOCK) > s.blocks.len() {
                grow.push(*id);
            }
        }
        if grow.len() > self.free_blocks.len() {
            return Err(CudaError::Capacity(format!(
                "KV cache full: {} more blocks of {KV_BLOCK} tokens needed, {} free of {}",
                grow.len(),
                self.free_blocks.len(),
                self.num_blocks
            )));
        }
        let mut entries = Vec::with_capacity(grow.len());
        for id in grow {
            let b = self.free_blocks.pop().ok_or_else(|| CudaError::Capacity("KV cache full".into()))?;
            self.refcount[b as usize] = 1;
            let bps = self.blocks_per_seq;
            if let Some(s) = self.seqs.get_mut(&id) {
                entries.push(((s.slot * bps + s.blocks.len()) as i32, b as i32));
                s.blocks.push(b);
            }
        }
        Ok(entries)
    }

    /// Writes block-table entries as `reserve_next_deferred` returned them,
    /// synchronously (when the step meant to write them never launched).
    pub fn write_block_entries(&self, entries: &[(i32, i32)]) -> CudaResult<()> {
        for &(at, b) in entries {
            write_device(&self.gpu, self.block_table.ptr() + (at as u64) * 4, &[b])?;
        }
        Ok(())
    }

    /// A new sequence with the same state: DeltaNet state copied, full KV
    /// blocks shared, the partly filled last block copied.
    pub fn fork(&mut self, id: SeqId) -> CudaResult<SeqId> {
        let src = self.seq(id)?.clone();
        let child = self.alloc()?;
        let cslot = self.seq(child)?.slot;
        let (sc, ss) = self.gdn_layer_slot_first(src.slot);
        let (dc, ds) = self.gdn_layer_slot_first(cslot);
        copy_device(&self.gpu, dc, sc, self.gdn_conv_slot_stride() * 4)?;
        copy_device(&self.gpu, ds, ss, self.gdn_state_slot_stride() * 4)?;
        if let Err(e) = self.share_prefix(child, id, src.len) {
            self.free(child);
            return Err(e);
        }
        Ok(child)
    }

    /// Gives `child` (an empty sequence whose DeltaNet state is already
    /// written) the attention KV of the first `len` tokens of `src`: full
    /// blocks shared, a partly filled last block copied (positions past
    /// `len` in it are never read: the child's length is `len`).
    pub fn share_prefix(&mut self, child: SeqId, src: SeqId, len: usize) -> CudaResult<()> {
        let sblocks = self.seq(src)?.blocks.clone();
        let cslot = self.seq(child)?.slot;
        if len > sblocks.len() * KV_BLOCK {
            return Err(CudaError::Invalid(format!("a prefix of {len} tokens of {src:?}, which holds {} blocks", sblocks.len())));
        }
        let full = len / KV_BLOCK;
        let mut blocks: Vec<u32> = sblocks.iter().take(full).copied().collect();
        if !len.is_multiple_of(KV_BLOCK) {
            let last = sblocks[full];
            let Some(nb) = self.free_blocks.pop() else {
                return Err(CudaError::Capacity("KV cache full while forking".into()));
            };
            self.refcount[nb as usize] = 1;
            let per_layer_half = self.num_blocks * self.dims.kv_block_bytes() / 2;
            let bb = self.dims.kv_block_bytes() / 2;
            let n_attn = self.attn_layers.iter().filter(|i| **i != usize::MAX).count();
            for a in 0..n_attn {
                for kv in 0..2 {
                    let base = self.kv.ptr() + ((2 * a + kv) * per_layer_half) as u64;
                    if let Err(e) = copy_device(&self.gpu, base + (nb as usize * bb) as u64, base + (last as usize * bb) as u64, bb) {
                        self.release_block(nb);
                        return Err(e);
                    }
                }
            }
            blocks.push(nb);
        }
        for b in blocks.iter().take(full) {
            self.refcount[*b as usize] += 1;
        }
        let ids: Vec<i32> = blocks.iter().map(|b| *b as i32).collect();
        if !ids.is_empty() {
            write_device(&self.gpu, self.bt_row(cslot), &ids)?;
        }
        if let Some(s) = self.seqs.get_mut(&child) {
            s.blocks = blocks;
            s.len = len;
        }
        Ok(())
    }

    /// Blocks free in the pool.
    pub fn free_block_count(&self) -> usize {
        self.free_blocks.len()
    }
}

fn max_splits(opts: &Options) -> usize {
    crate::attention::splits_for(opts.max_seq_len, crate::attention::ATTN_MAX_SPLITS).max(1)
}

fn logit_rows(opts: &Options) -> usize {
    opts.max_batch.max(64)
}

/// fp16 values of the `w16` scratch: room for the largest dense matrix (or
/// concatenation of a mixer's in-projections) a prefill pass multiplies on
/// `hgemm`: the in-projections fill at most a `proj` row (proj_stride
/// outputs of K = hidden), an out-projection hidden rows of K = mix_dim or
/// attn_out_dim. 0 when no pass can be that long (`f16_gemm_from` off
/// or above the scratch's rows), so the path never runs.
fn w16_elems(dims: &Dims, opts: &Options) -> usize {
    let rows = opts.max_batch.max(opts.prefill_chunk);
    if opts.f16_gemm_from.is_none_or(|from| from > rows) {
        return 0;
    }
    (dims.proj_stride() * dims.hidden).max(out_proj_elems(dims))
}

/// fp16 values of an out-projection (hidden rows of K = mix_dim or
/// attn_out_dim, the larger).
fn out_proj_elems(dims: &Dims) -> usize {
    dims.hidden * dims.mix_dim().max(dims.attn_out_dim())
}

/// fp16 values of the `w16_out` scratch: an out-projection, where `w16`
/// is planned and `Options::dequant_ahead` is on; else 0.
fn w16_out_elems(dims: &Dims, opts: &Options) -> usize {
    if opts.dequant_ahead && w16_elems(dims, opts) > 0 {
        out_proj_elems(dims)
    } else {
        0
    }
}

fn scratch_layout(dims: &Dims, opts: &Options) -> Layout {
    let rows = opts.max_batch.max(opts.prefill_chunk);
    let b = opts.max_batch;
    let tp = opts.prefill_chunk.div_ceil(GDN_CHUNK) * GDN_CHUNK;
    let mut l = Layout { size: 0, pieces: Vec::new() };
    let h = dims.hidden;
    let f = 4usize;
    l.add("tokens", rows * 4);
    l.add("pos", rows * 4);
    l.add("slot", rows * 4);
    l.add("step", 16);
    l.add("out_ids", opts.max_greedy_steps * b * 4);
    l.add("h", rows * h * f);
    l.add("proj", rows * dims.proj_stride() * f);
    l.add("mix_f32", b * dims.mix_dim() * f);
    l.add("mix_f16", rows * dims.mix_dim() * 2);
    l.add("xn", rows * h * 2);
    l.add("q_f32", b * dims.attn_out_dim() * f);
    l.add("q_f16", rows * dims.attn_out_dim() * 2);
    l.add("logits", logit_rows(opts) * dims.vocab * f);
    l.add("argmax", rows * 8);
    let ms = max_splits(opts);
    l.add("part_o", b * dims.a_heads * ms * dims.a_head_dim * f);
    l.add("part_ml", b * dims.a_heads * ms * 2 * f);
    let slots = dims.topk + 1;
    l.add("router_logits", rows * dims.n_experts * f);
    l.add("sg", rows * f);
    l.add("px_in", qmm::packed_len(b, h) * 2);
    l.add("px_mix", qmm::packed_len(b, dims.mix_dim()) * 2);
    l.add("csum_in", b * h / 64 * f);
    l.add("csum_mix", b * dims.mix_dim() / 64 * f);
    l.add("px_act", qmm::packed_len(b * slots, dims.moe_inter) * 2);
    l.add("moe_y", b * slots * h * f);
    l.add("moe_plan", qmm::plan_ints(dims, b) * 4);
    l.add("moe_ticket", qmm::ROUTER_TICKETS * 4);
    l.add("moe_barrier", 64);
    l.add("topk_idx", rows * dims.topk * 4);
    l.add("topk_w", rows * slots * f);
    l.add("counts", dims.n_experts * 4);
    l.add("rank", rows * dims.topk * 4);
    l.add("offsets", (dims.n_experts + 1) * 4);
    l.add("tiles", max_tiles_any(dims, rows) * 3 * 4);
    l.add("ntiles", 16);
    l.add("perm", rows * dims.topk * 4);
    l.add("inv", rows * dims.topk * 4);
    l.add("route_ticket", 16);
    l.add("act_sorted", rows * dims.topk * dims.moe_inter * 2);
    l.add("y_sorted", rows * dims.topk * h * f);
    l.add("act_sh", rows * dims.moe_inter * 2);
    l.add("ys", rows * h * f);
    l.add("gemm_partial", SPLITK_FLOATS * f);
    l.add("w16", w16_elems(dims, opts) * 2);
    l.add("w16_out", w16_out_elems(dims, opts) * 2);
    let sizes = GdnScratch::sizes(dims, tp);
    for (name, n) in ["gdn_q", "gdn_k", "gdn_vu", "gdn_gg", "gdn_bb", "gdn_w", "gdn_gc", "gdn_hs", "gdn_o"].iter().zip(sizes) {
        l.add(name, n * f);
    }
    l
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fp16_weight_scratch_is_planned_only_where_hgemm_can_run() {
        let d = Dims::from_config(&lily_core::config::production()).expect("dims");
        let o = Options::default();
        assert!(w16_elems(&d, &o) >= d.proj_stride() * d.hidden, "the in-projections fit");
        assert_eq!(w16_elems(&d, &Options { f16_gemm_from: None, ..Options::default() }), 0);
        assert_eq!(w16_elems(&d, &Options { prefill_chunk: 1024, ..Options::default() }), 0, "no pass reaches F16_GEMM_FROM rows");
        assert!(w16_out_elems(&d, &o) >= d.hidden * d.mix_dim().max(d.attn_out_dim()), "an out-projection fits beside");
        assert_eq!(w16_out_elems(&d, &Options { dequant_ahead: false, ..Options::default() }), 0);
        assert_eq!(w16_out_elems(&d, &Options { f16_gemm_from: None, ..Options::default() }), 0);
    }

    #[test]
    fn a_forced_expert_tile_height_must_be_compiled() {
        for bm in crate::gemm::TILE_ROWS {
            assert!(Options { expert_tile_rows: Some(bm), ..Options::default() }.check().is_ok(), "{bm} rows");
        }
        for bm in [0usize, 8, 48, 256] {
            let e = Options { expert_tile_rows: Some(bm), ..Options::default() }.check().expect_err("refused");
            assert!(e.to_string().contains("expert_tile_rows"), "{e}");
        }
    }

    #[test]
    fn decode_matrices_parse_and_choose_the_path_by_batch_size() {
        assert_eq!(DecodeMatrices::parse("off"), Ok(DecodeMatrices::BATCH_INVARIANT));
        assert_eq!(DecodeMatrices::parse(" 12 "), Ok(DecodeMatrices { gemm_from: 12, f16_from: DECODE_F16_FROM }));
        for bad in ["0", "-3", "twelve", "12,moe", ""] {
            assert!(DecodeMatrices::parse(bad).is_err(), "{bad:?} is refused");
        }
        let m = DecodeMatrices { gemm_from: 16, f16_from: usize::MAX };
        assert!(!m.on_gemm(15) && m.on_gemm(16) && m.on_gemm(128));
        assert!(!(1..=128).any(|n| DecodeMatrices::BATCH_INVARIANT.on_gemm(n)), "batch-invariant decode never takes the GEMM");
        assert_eq!(Options::default().decode_matrices, DecodeMatrices::FASTEST);
        assert_eq!(DecodeMatrices::FASTEST.gemm_from, DECODE_GEMM_FROM);
    }

    #[test]
    fn fp16_dense_inputs_from_f16_from_and_only_on_qmm_up_to_16_tokens() {
        use crate::qmm::XPrecision::{HiLo, F16};
        assert_eq!(DecodeMatrices::parse_f16_from("off"), Ok(usize::MAX));
        assert_eq!(DecodeMatrices::parse_f16_from(" 5 "), Ok(5));
        assert_eq!(DecodeMatrices::parse_f16_from("16"), Ok(16));
        for bad in ["0", "1", "17", "five", ""] {
            assert!(DecodeMatrices::parse_f16_from(bad).is_err(), "{bad:?} is refused");
        }
        assert!((1..=128).all(|n| DecodeMatrices::BATCH_INVARIANT.dense_x(n) == HiLo));
        assert!((1..=128).all(|n| DecodeMatrices::BATCH_INVARIANT.exact(n)));
        let m = DecodeMatrices::FASTEST;
        assert_eq!(m.f16_from, DECODE_F16_FROM);
        let picks: Vec<_> = (1..=12).map(|n| m.dense_x(n)).collect();
        assert_eq!(picks, [HiLo, HiLo, HiLo, HiLo, F16, F16, F16, F16, HiLo, HiLo, HiLo, HiLo], "5-8 on fp16, 9+ on the GEMM");
        let exact: Vec<usize> = (1..=128).filter(|&n| m.exact(n)).collect();
        assert_eq!(exact, [1, 2, 3, 4], "by default only steps of 1-4 sequences are batch-invariant");
        let off = DecodeMatrices { f16_from: usize::MAX, ..m };
        assert!((1..=128).all(|n| off.dense_x(n) == HiLo) && (1..=8).all(|n| off.exact(n)) && !off.exact(9));
        // With the GEMM path earlier than 8, its steps keep the GEMM.
        let early = DecodeMatrices { gemm_from: 7, f16_from: 2 };
        assert_eq!(early.dense_x(6), F16);
        assert_eq!(early.dense_x(7), HiLo);
        // With the GEMM path later (or off), qmm takes fp16 up to two
        // n-tiles; past them (chunks) it stays on hi/lo.
        let late = DecodeMatrices { gemm_from: 17, f16_from: 5 };
        assert_eq!((late.dense_x(12), late.dense_x(16), late.dense_x(17)), (F16, F16, HiLo));
        let inv = DecodeMatrices { gemm_from: usize::MAX, f16_from: 2 };
        assert_eq!((inv.dense_x(16), inv.dense_x(17)), (F16, HiLo));
        let bad = Options { decode_matrices: DecodeMatrices { f16_from: 1, ..DecodeMatrices::FASTEST }, ..Options::default() };
        assert!(bad.check().unwrap_err().to_string().contains("f16_from"));
    }
}
