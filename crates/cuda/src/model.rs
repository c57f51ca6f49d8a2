//! The layer sequence on the GPU: which kernels run, in which order, on
//! which buffers. Written once for the two ways tokens arrive:
//!
//! - decode, 1 to `max_batch` tokens (one per sequence) in one step: every
//!   linear through qmm.cu (tensor cores, each weight read once for the
//!   whole batch, RMSNorm and the previous MoE's combine folded into the
//!   packing of its input), the MoE routed and planned on the device and
//!   run grouped by expert, the DeltaNet step and split-K attention;
//! - prefill, in passes of up to `prefill_chunk` tokens of one or several
//!   sequences: GEMMs over every row of the pass, then per sequence the
//!   chunked DeltaNet and causal flash attention on its rows.
//!
//! A decode step only launches kernels on the stream (no host
//! synchronisation, no allocation), so it is captured once per shape as a
//! CUDA graph and replayed; the greedy loop keeps token ids and positions on
//! the GPU (sampling.cu) and the host reads the ids at the end. A served
//! step (the backend's pipelined steps) is captured with its feed and its
//! sampler in the same graph (`run_served_step`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph};
use lily_core::weights::Weights;
use lily_model::{Sampled, SeqId};

use crate::attention::{self, KvView, QOut};
use crate::device::{copy_device, read_device, write_device, zero_device, DevSlice, Gpu, HostStage};
use crate::dims::{Dims, GDN_CHUNK, KV_BLOCK};
use crate::embed;
use crate::error::{CudaError, CudaResult, DriverContext};
use crate::feed::{self, FeedStageParams};
use crate::gdn::{self, GdnState, MixOut};
use crate::gemm::{self, GemmOut, Grouping, KPartials, Seg};
use crate::hgemm;
use crate::kernels::Kernels;
use crate::moe;
use crate::qmm::{self, DenseSeg, Epilogue};
use crate::sampling::{self, DrawIo, KeepDraws, SampleOut, SampleRow};
use crate::state::{Memory, Options};
use crate::weights::{self, DeviceWeights, LayerDev, MixerDev, QMat};

/// What the end of a decode step produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Head {
    /// Logits of every token in `scratch.logits` (and, on the qmm path,
    /// whose lm_head epilogue leaves them for free, the argmax keys).
    Logits,
    /// Greedy: argmax folded into the next step's inputs on the GPU.
    Greedy,
}

/// How a cached decode-step graph ends: the step alone with its head, or a
/// served step (feed, step with logits, sampler; `run_served_step`) whose
/// outputs include the top logprobs or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum StepEnd {
    Head(Head),
    Served { tops: bool },
}

/// The addresses a served step's graph bakes in besides the model's own
/// buffers: the feed's staged inputs (`feed_stage`) and the sampler's rows,
/// outputs and kept draws (`sample_rows_keeping` on the step's logits).
/// The backend keeps them fixed for a batch size (runahead.rs); a cached
/// graph is replayed only for the same ones and captured again otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServedStep {
    pub feed: FeedStageParams,
    /// SampleRow [n].
    pub rows: u64,
    pub out: SampleOut,
    pub keep: KeepDraws,
}

struct Graph {
    exec: CudaGraph,
    /// What a served step's graph was captured with.
    served: Option<ServedStep>,
}
// SAFETY: a graph is only used through `&mut Model`, so never from two
// threads at once; the CUDA objects themselves may be used from any thread
// once the context is current.
unsafe impl Send for Graph {}

/// One sequence's run of tokens inside a prefill pass: rows
/// `row0..row0 + len` of the pass, at positions `p0..`, state in `slot`.
#[derive(Clone, Copy, Debug)]
struct Piece {
    slot: usize,
    p0: usize,
    row0: usize,
    len: usize,
    /// (slot, at): the sequence slot that also receives the DeltaNet state
    /// after the piece's first `at` tokens (a prefix snapshot).
    capture: Option<(usize, usize)>,
}

/// How many of a pass's last pieces are a mixed step's decode rows
/// (`Backend::mixed_steps`): one token continuing a sequence (position
/// past 0), no snapshot, on the pass's last rows, at most `max_batch` (the
/// decode scratch: f32 queries, split-KV partials). Their mixer runs on the
/// decode kernels (`gdn_decode`, `attn_decode`), the same math as a decode
/// step's, instead of the prefill's: the chunked DeltaNet would pad each
/// to a whole 64-row chunk, and the prefill attention would read its
/// context through a one-row query tile.
fn decode_rows(pieces: &[Piece], t: usize, max_batch: usize) -> usize {
    let n = pieces.iter().rev().take_while(|p| p.len == 1 && p.p0 > 0 && p.capture.is_none()).count().min(max_batch);
    // Rows t - n .. t, one each, in order (pieces are laid out so).
    let contiguous = pieces[pieces.len() - n..].iter().enumerate().all(|(j, p)| p.row0 == t - n + j);
    if contiguous {
        n
    } else {
        0
    }
}

/// A prefill's last rows as `Model::last_rows` hands them back: each
/// row's logits (empty where it was drawn) and its draw (if asked).
pub type LastRows = (Vec<Vec<f32>>, Vec<Option<Sampled>>);

/// Rows of logits read back per copy through `Model::logits_stage` (the
/// first tokens of a pass of several new prompts: one row each).
const LOGITS_STAGE_ROWS: usize = 8;

/// The model resident on one GPU.
pub struct Model {
    pub gpu: Arc<Gpu>,
    /// A second stream: a prefill's shared expert runs there while the main
    /// stream routes and runs the routed experts (`moe_gemm`), forked and
    /// joined through the two events.
    side: Gpu,
    fork: CudaEvent,
    join: CudaEvent,
    /// `Options::dequant_ahead`: the main stream's point from which the
    /// side stream may dequantise (`ahead_fork`), and the side's points
    /// after which a layer's out-projection (`ahead_out`) and the next
    /// layer's in-projections (`ahead_in`) lie in fp16.
    ahead_fork: CudaEvent,
    ahead_out: CudaEvent,
    ahead_in: CudaEvent,
    /// Page-locked memory the prefill's logits are read back through,
    /// `LOGITS_STAGE_ROWS` rows at a time.
    logits_stage: HostStage,
    /// Where a prefill's first tokens are drawn (`last_rows`); made by the
    /// first prefill that asks for a draw, before its pass runs.
    draw_io: Option<DrawIo>,
    pub kernels: Kernels,
    pub dims: Dims,
    pub weights: DeviceWeights,
    pub mem: Memory,
    /// One graph per (batch size, how the step ends): nothing in a step
    /// depends on the context lengths (attention reads them on the device),
    /// so the cache is bounded by 4 x `max_batch` graphs and stops growing
    /// once warm.
    graphs: HashMap<(usize, StepEnd), Graph>,
    /// When profiling, an event recorded after every kernel group.
    marks: Mutex<Option<Vec<(&'static str, CudaEvent)>>>,
    /// Measurement only (`set_knockout`): kernel groups left out of qmm-path
    /// decode steps, to read each group's marginal cost inside the graph.
    knockout: Knockout,
    /// Speed probes only (`set_moe_trace`): where the fused MoE's blocks
    /// stamp their phases, one equal share a layer.
    moe_trace: Option<DevSlice<u64>>,
}

/// Kernel groups of a qmm-path decode step that a speed probe may leave out
/// (`Model::set_knockout`). The step then computes garbage (the skipped
/// kernels' outputs keep whatever the last step wrote), but every other
/// kernel reads and writes the same buffers, so the step time without a
/// group is what that group costs inside the graph, overlap included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Knockout(u32);

impl Knockout {
    pub const GROUPS: [&'static str; 8] = ["xnorm", "in_proj", "mixer", "out_proj", "router", "gate_up", "down", "head"];

    /// Parses `a+b+c` (group names from `GROUPS`; empty: nothing left out).
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut bits = 0u32;
        for name in s.split('+').filter(|n| !n.is_empty()) {
            let i = Self::GROUPS.iter().position(|g| *g == name).ok_or_else(|| format!("knockout group `{name}`; known: {}", Self::GROUPS.join(", ")))?;
            bits |= 1 << i;
        }
        Ok(Knockout(bits))
    }

    const XNORM: Knockout = Knockout(1 << 0);
    const IN_PROJ: Knockout = Knockout(1 << 1);
    const MIXER: Knockout = Knockout(1 << 2);
    const OUT_PROJ: Knockout = Knockout(1 << 3);
    const ROUTER: Knockout = Knockout(1 << 4);
    const GATE_UP: Knockout = Knockout(1 << 5);
    const DOWN: Knockout = Knockout(1 << 6);
    const HEAD: Knockout = Knockout(1 << 7);

    fn skips(self, group: Knockout) -> bool {
        self.0 & group.0 != 0
    }
}

impl Model {
    /// Compiles the kernels, uploads the weights and allocates the memory plan.
    pub fn new(gpu: &Arc<Gpu>, w: &Weights, opts: Options, progress: &mut dyn FnMut(u64, u64)) -> CudaResult<Self> {
        let dims = Dims::from_config(&w.config)?;
        let kernels = Kernels::load(gpu, &dims)?;
        let weights = weights::upload(gpu, w, &dims, progress)?;
        Self::assemble(gpu, kernels, dims, weights, opts)
    }

    /// The model of shape `cfg` with random weights made on the GPU (speed
    /// probes; see weights::synthetic).
    pub fn synthetic(gpu: &Arc<Gpu>, cfg: &lily_core::ModelConfig, opts: Options, seed: u64) -> CudaResult<Self> {
        let dims = Dims::from_config(cfg)?;
        let kernels = Kernels::load(gpu, &dims)?;
        let weights = weights::synthetic(gpu, &kernels, &dims, seed)?;
        Self::assemble(gpu, kernels, dims, weights, opts)
    }

    /// The model around its loaded parts: the memory plan, no graphs yet.
    fn assemble(gpu: &Arc<Gpu>, kernels: Kernels, dims: Dims, weights: DeviceWeights, opts: Options) -> CudaResult<Self> {
        let mem = Memory::new(gpu, &dims, opts)?;
        let event = || gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)).ctx("cuEventCreate");
        let logits_stage = HostStage::new(gpu, LOGITS_STAGE_ROWS * dims.vocab)?;
        Ok(Model {
            gpu: gpu.clone(),
            side: gpu.side_stream()?,
            fork: event()?,
            join: event()?,
            ahead_fork: event()?,
            ahead_out: event()?,
            ahead_in: event()?,
            kernels,
            dims,
            weights,
            mem,
            graphs: HashMap::new(),
            marks: Mutex::new(None),
            knockout: Knockout::default(),
            moe_trace: None,
            logits_stage,
            draw_io: None,
        })
    }

    /// Records a profiling event named `what` (the time since the previous
    /// mark is attributed to it); a no-op unless `profile_prefill` is running.
    /// (Decode steps are profiled per kernel with Nsight Compute instead:
    /// inside a graph, launch gaps are what matters and events cannot see them.)
    fn mark(&self, what: &'static str) -> CudaResult<()> {
        let mut guard = self.marks.lock().map_err(|_| CudaError::Invalid("profiler lock poisoned".into()))?;
        if let Some(marks) = guard.as_mut() {
            let ev = self.gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ctx("cuEventCreate")?;
            ev.record(&self.gpu.stream).ctx("cuEventRecord")?;
            marks.push((what, ev));
        }
        Ok(())
    }

    /// Measurement only: leaves `k`'s kernel groups out of every later
    /// qmm-path decode step (the cached graphs are dropped). The results of
    /// such steps are meaningless; `Knockout::default()` restores the model.
    pub fn set_knockout(&mut self, k: Knockout) {
        if k != self.knockout {
            self.graphs.clear();
        }
        self.knockout = k;
    }

    /// Speed probes only: the fused MoE of every later decode step stamps
    /// its phases into `buf` (layer i in the i-th of `dims.layers` equal
    /// shares, each `qmm::MOE_TRACE_WORDS` words a block of the grid); None
    /// stops. Drops the cached graphs.
    pub fn set_moe_trace(&mut self, buf: Option<DevSlice<u64>>) {
        self.graphs.clear();
        self.moe_trace = buf;
    }

    fn kv_view(&self, layer: usize) -> KvView {
        let (k, v) = self.mem.kv_layer(layer);
        KvView { k, v, block_table: self.mem.block_table.ptr(), bt_stride: self.mem.blocks_per_seq }
    }

    fn gdn_state(&self, layer: usize) -> GdnState {
        let (conv, state) = self.mem.gdn_layer(layer);
        GdnState { conv, conv_slot_stride: self.mem.gdn_conv_slot_stride(), state, state_slot_stride: self.mem.gdn_state_slot_stride() }
    }

    // ---- pieces shared by the paths -----------------------------------------

    /// The in-projection outputs of a layer: (matrix, column offset in proj).
    fn in_projections<'a>(&self, l: &'a LayerDev) -> Vec<(&'a QMat, usize)> {
        let d = &self.dims;
        match &l.mixer {
            MixerDev::DeltaNet(g) => {
                vec![(&g.in_qkv, 0), (&g.in_z, d.conv_dim), (&g.in_a, d.conv_dim + d.gdn_val_dim()), (&g.in_b, d.conv_dim + d.gdn_val_dim() + d.gv_heads)]
            }
            MixerDev::Attention(a) => {
                let q = 2 * d.a_heads * d.a_head_dim;
                vec![(&a.q, 0), (&a.k, q), (&a.v, q + d.kv_dim())]
            }
        }
    }

    fn out_projection(l: &LayerDev) -> QMat {
        match &l.mixer {
            MixerDev::DeltaNet(g) => g.out,
            MixerDev::Attention(a) => a.o,
        }
    }

    // ---- decode ----------------------------------------------------------------

    /// The decode-step buffers as typed views.
    fn moe_bufs(&self) -> qmm::MoeBufs {
        self.mem.decode.moe
    }

    /// One layer of a decode step for `n` tokens (one per sequence):
    /// h += Mixer(RMSNorm(h)); h += MoE(RMSNorm(h)), every matrix read once
    /// for the whole batch. The MoE's weighted sum is folded into h by the
    /// next packing step (`combine_prev` on the next layer, or the final
    /// norm) unless `combine_now`.
    fn layer_decode(&self, i: usize, n: usize, combine_prev: bool) -> CudaResult<()> {
        self.mixer_decode(i, n, combine_prev)?;
        self.moe_decode(i, n)
    }

    /// h += Mixer(RMSNorm(h)) (after folding in the previous MoE output
    /// when `combine_prev`).
    fn mixer_decode(&self, i: usize, n: usize, combine_prev: bool) -> CudaResult<()> {
        let (g, k, d, s) = (&*self.gpu, &self.kernels, &self.dims, &self.mem.scratch);
        let dec = &self.mem.decode;
        let l = &self.weights.layers[i];
        let combine = if combine_prev { Some((dec.moe.y, dec.moe.topk_w)) } else { None };
        let ko = self.knockout;
        let xp = self.mem.opts.decode_matrices.dense_x(n);
        if !ko.skips(Knockout::XNORM) {
            qmm::xnorm(g, k, d, dec.h, d.hidden, combine, Some(l.input_norm), dec.moe.px_in, n)?;
        }
        self.mark("xnorm (+ moe combine)")?;
        let ps = d.proj_stride();
        let projs = self.in_projections(l);
        let segs: Vec<DenseSeg> =
            projs.iter().map(|(m, off)| DenseSeg { w: m, out: dec.proj.from(*off).unwrap_or(dec.proj), out_stride: ps, epilogue: Epilogue::Store }).collect();
        if !ko.skips(Knockout::IN_PROJ) {
            qmm::dense(g, k, &segs, dec.moe.px_in, n, xp, None)?;
        }
        let attn = matches!(l.mixer, MixerDev::Attention(_));
        self.mark(if attn { "attn in_proj" } else { "gdn in_proj" })?;
        let out = Self::out_projection(l);
        // The DeltaNet step packs its output itself when its heads are whole
        // 64-column groups; otherwise (test shapes) and for attention the
        // mixer writes f32 and `xnorm` packs it with the group sums.
        let packed = MixOut::Packed { px: dec.px_mix.px.ptr(), csum: dec.px_mix.csum.ptr() };
        let gdn_packs = d.gv_dim.is_multiple_of(64);
        if !ko.skips(Knockout::MIXER) {
            self.mixer_step(i, n, if gdn_packs { packed } else { MixOut::F32(s.mix_f32) }, MixOut::F32(s.mix_f32))?;
        }
        if (attn || !gdn_packs) && !ko.skips(Knockout::XNORM) {
            qmm::xnorm(g, k, d, dec.mix_f32, out.cols, None, None, dec.px_mix, n)?;
        }
        self.mark(if attn { "attention" } else { "gdn step" })?;
        if !ko.skips(Knockout::OUT_PROJ) {
            qmm::dense(g, k, &[DenseSeg { w: &out, out: dec.h, out_stride: d.hidden, epilogue: Epilogue::Add }], dec.px_mix, n, xp, None)?;
        }
        self.mark(if attn { "attn out_proj" } else { "gdn out_proj" })
    }

    /// The mixer of layer `i` for a decode step of `n` tokens, from the
    /// in-projection rows in scratch.proj: the DeltaNet step writing
    /// `gdn_mix`, or the attention (q/k norms, rotation, cache stores, then
    /// split-KV decode) writing `attn_mix`.
    fn mixer_step(&self, i: usize, n: usize, gdn_mix: MixOut, attn_mix: MixOut) -> CudaResult<()> {
        let (g, k, d, s) = (&*self.gpu, &self.kernels, &self.dims, &self.mem.scratch);
        let ps = d.proj_stride();
        match &self.weights.layers[i].mixer {
            MixerDev::DeltaNet(w) => gdn::decode(g, k, d, w, &self.gdn_state(i), s.proj, ps, s.pos, s.slot, gdn_mix, n),
            MixerDev::Attention(w) => {
                let kv = self.kv_view(i);
                attention::prep(g, k, d, w, self.weights.inv_freq, s.proj, ps, s.pos, s.slot, &kv, QOut::F32(s.q_f32), n)?;
                attention::decode(g, k, d, s.q_f32, &kv, s.pos, s.slot, &s.attn_decode(), s.proj, ps, attn_mix, n)
            }
        }
    }

    /// The MoE of layer `i`: router, top-k and plan, then the experts; the
    /// outputs stay in the step's y rows until the next packing step.
    fn moe_decode(&self, i: usize, n: usize) -> CudaResult<()> {
        let (g, k, d) = (&*self.gpu, &self.kernels, &self.dims);
        let dec = &self.mem.decode;
        let l = &self.weights.layers[i];
        let m = &l.moe;
        let bufs = self.moe_bufs();
        let ko = self.knockout;
        let moe_knocked = ko.skips(Knockout::ROUTER) || ko.skips(Knockout::GATE_UP) || ko.skips(Knockout::DOWN);
        if self.mem.opts.fused_moe && n <= qmm::MOE_FUSED_TOK && !moe_knocked {
            let trace = match self.moe_trace {
                Some(t) => Some(t.from(i * t.len() / self.dims.layers)?),
                None => None,
            };
            qmm::moe_fused(g, k, d, m, l.post_norm, dec.h, &bufs, n, trace)?;
            return self.mark("moe (fused)");
        }
        let x = self.mem.opts.moe_x(n);
        if !ko.skips(Knockout::ROUTER) {
            qmm::router(g, k, d, m, l.post_norm, dec.h, &bufs, n, x, self.mem.opts.router_math(n, d))?;
        }
        self.mark("moe router")?;
        if !ko.skips(Knockout::GATE_UP) {
            qmm::experts(g, k, d, m, true, &bufs, n, x)?;
        }
        self.mark("moe gate_up")?;
        if !ko.skips(Knockout::DOWN) {
            qmm::experts(g, k, d, m, false, &bufs, n, x)?;
        }
        self.mark("moe down")
    }

    /// h += the last layer's MoE output now (instead of inside the next
    /// packing step); the packed rows it also writes are not used.
    fn combine_moe_now(&self, n: usize) -> CudaResult<()> {
        let (g, k, d) = (&*self.gpu, &self.kernels, &self.dims);
        let dec = &self.mem.decode;
        qmm::xnorm(g, k, d, dec.h, d.hidden, Some((dec.moe.y, dec.moe.topk_w)), None, dec.moe.px_in, n)
    }

    /// Final norm (with the last MoE's combine) and the lm_head for `n`
    /// rows of h: logits and the greedy argmax keys (cleared by the embed).
    fn head_decode(&self, n: usize, combine_prev: bool) -> CudaResult<()> {
        let (g, k, d) = (&*self.gpu, &self.kernels, &self.dims);
        if self.knockout.skips(Knockout::HEAD) {
            return Ok(());
        }
        let dec = &self.mem.decode;
        let combine = if combine_prev { Some((dec.moe.y, dec.moe.topk_w)) } else { None };
        qmm::xnorm(g, k, d, dec.h, d.hidden, combine, Some(self.weights.final_norm), dec.moe.px_in, n)?;
        let seg = DenseSeg { w: &self.weights.lm_head, out: dec.logits, out_stride: d.vocab, epilogue: Epilogue::Logits };
        qmm::dense(g, k, &[seg], dec.moe.px_in, n, self.mem.opts.decode_matrices.dense_x(n), Some(dec.argmax))
    }

    // ---- the GEMM path (prefill, large decode batches) ------------------------

    /// One layer of a decode step on the GEMM path (`DecodeMatrices`): the
    /// in- and out-projections through the tensor-core GEMM on fp16
    /// activations with the mixer's decode kernels between them, then the
    /// MoE on qmm as on the qmm path. `combine_prev`: fold the previous
    /// layer's MoE output into h first.
    fn layer_decode_gemm(&self, i: usize, n: usize, combine_prev: bool) -> CudaResult<()> {
        let s = &self.mem.scratch;
        let l = &self.weights.layers[i];
        if combine_prev {
            self.combine_norm_f16_now(l.input_norm, n)?;
        }
        self.in_proj_gemm(l, n, combine_prev)?;
        let mix = MixOut::F16(s.mix_f16);
        self.mixer_step(i, n, mix, mix)?;
        self.mark(if matches!(l.mixer, MixerDev::Attention(_)) { "attention" } else { "gdn step" })?;
        let out = Self::out_projection(l);
        self.dense_gemms(s.mix_f16, out.cols, n, &[self.out_proj_seg(&out)])?;
        self.mark("gemm out_proj")?;
        self.moe_decode(i, n)
    }

    /// The GEMM path's `combine_moe_now`: the previous MoE folded into h
    /// and xn = fp16 RMSNorm(h) * `gain` in one launch (rmsnorm_f16's bits).
    fn combine_norm_f16_now(&self, gain: u64, n: usize) -> CudaResult<()> {
        let dec = &self.mem.decode;
        qmm::combine_norm_f16(&self.gpu, &self.kernels, &self.dims, dec.h, (dec.moe.y, dec.moe.topk_w), gain, self.mem.scratch.xn, n)
    }

    /// The final norm and the lm_head on the GEMM path: logits, then, for a
    /// greedy step, each row's argmax key (what the qmm head's epilogue
    /// leaves for free). A `Head::Logits` step's keys would be a pass over
    /// every logit (64 x 1 MB at 64 rows) that nothing reads: the sampler
    /// and the host take the logits.
    fn head_decode_gemm(&self, n: usize, combine_prev: bool, head: Head) -> CudaResult<()> {
        let (g, k, d, s) = (&*self.gpu, &self.kernels, &self.dims, &self.mem.scratch);
        if combine_prev {
            self.combine_norm_f16_now(self.weights.final_norm, n)?;
        } else {
            gemm::rmsnorm_f16(g, k, s.h, self.weights.final_norm, s.xn, n, d.rms_eps)?;
        }
        self.dense_gemms(s.xn, d.hidden, n, &[Seg { w: &self.weights.lm_head, up: None, out: GemmOut::Store(s.logits), ldc: d.vocab }])?;
        if head == Head::Greedy {
            sampling::argmax_rows(g, k, s.logits, s.argmax, n, d.vocab)?;
        }
        Ok(())
    }

    /// xn = RMSNorm(h) in fp16 (unless `normed`: the previous layer's MoE
    /// combine left it there), then the in-projections into proj, all in
    /// one GEMM launch (the 32-row a/b projections ride along with qkv and z).
    fn in_proj_gemm(&self, l: &LayerDev, n: usize, normed: bool) -> CudaResult<()> {
        self.in_proj_gemm_from(l, n, normed, false)
    }

    /// `in_proj_gemm`; `dequantised`: the side stream has dequantised the
    /// in-projections into `w16` (`dequant_ahead`), so only their multiply
    /// runs here, after `ahead_in`.
    fn in_proj_gemm_from(&self, l: &LayerDev, n: usize, normed: bool, dequantised: bool) -> CudaResult<()> {
        let (g, k, d, s) = (&*self.gpu, &self.kernels, &self.dims, &self.mem.scratch);
        if !normed {
            gemm::rmsnorm_f16(g, k, s.h, l.input_norm, s.xn, n, d.rms_eps)?;
        }
        let segs = self.in_proj_segs(l);
        match self.f16_gemm_output(n, &segs).filter(|_| dequantised) {
            Some(out) => {
                self.gpu.stream.wait(&self.ahead_in).ctx("cuStreamWaitEvent (in-projections dequantised)")?;
                let mats: Vec<&QMat> = segs.iter().map(|x| x.w).collect();
                hgemm::hgemm(g, k, s.xn, d.hidden, n, hgemm::stacked_rows(&mats, s.w16)?, out, segs[0].ldc)?;
            }
            None => self.dense_gemms(s.xn, d.hidden, n, &segs)?,
        }
        self.mark("gemm norm+in_proj")
    }

    /// A layer's in-projections as one launch's matrices: each into its
    /// columns of the proj rows.
    fn in_proj_segs<'a>(&self, l: &'a LayerDev) -> Vec<Seg<'a>> {
        let (d, s) = (&self.dims, &self.mem.scratch);
        self.in_projections(l)
            .into_iter()
            .map(|(m, off)| Seg { w: m, up: None, out: GemmOut::Store(s.proj + (off * 4) as u64), ldc: d.proj_stride() })
            .collect()
    }

    /// Dense GEMMs of `n` rows of one input: one launch per bit width (up
    /// to `GEMM_MAX_SEGS` matrices each), split over K when short.
    fn dense_gemms(&self, a: u64, lda: usize, n: usize, segs: &[Seg]) -> CudaResult<()> {
        self.dense_gemms_on(&self.gpu, a, lda, n, segs)
    }

    /// `dense_gemms` on `g`'s stream (the main one or `side`).
    fn dense_gemms_on(&self, g: &Gpu, a: u64, lda: usize, n: usize, segs: &[Seg]) -> CudaResult<()> {
        let (k, s) = (&self.kernels, &self.mem.scratch);
        if let Some(out) = self.f16_gemm_output(n, segs) {
            let mats: Vec<&QMat> = segs.iter().map(|x| x.w).collect();
            return hgemm::dequant_and_multiply(g, k, a, lda, n, &mats, s.w16, out, segs[0].ldc);
        }
        let mut widths: Vec<u32> = segs.iter().map(|x| x.w.bits).collect();
        widths.sort_unstable();
        widths.dedup();
        for bits in widths {
            let same: Vec<Seg> = segs.iter().filter(|x| x.w.bits == bits).copied().collect();
            for part in same.chunks(gemm::GEMM_MAX_SEGS) {
                gemm::gemm_segs(g, k, a, lda, n, part, s.split_k())?;
            }
        }
        Ok(())
    }

    /// Where `hgemm` writes, when the matrices `segs` of an `n`-row pass go
    /// there: passes of at least `Options::f16_gemm_from` rows whose
    /// matrices store or add plain f32 outputs lying one after another in
    /// the output row (a mixer's in-projections, an out-projection), with
    /// an even total width and K of at least `hgemm::MIN_K`. Anything else
    /// (SwiGLU, the shared expert's one-row gate, its down projection
    /// beside the routed experts) stays on gemm.cu, as does the router
    /// (`gemm::gemm_unreduced`).
    fn f16_gemm_output(&self, n: usize, segs: &[Seg]) -> Option<GemmOut> {
        let from = self.mem.opts.f16_gemm_from?;
        let first = segs.first()?;
        if n < from || !first.ldc.is_multiple_of(2) || segs.iter().any(|x| x.up.is_some() || x.ldc != first.ldc || x.w.cols < hgemm::MIN_K) {
            return None;
        }
        // (address, adds): plain f32 outputs only, all of one kind, each
        // matrix's columns right after the previous one's.
        let plain = |o: GemmOut| match o {
            GemmOut::Store(p) => Some((p, false)),
            GemmOut::Add(p) => Some((p, true)),
            GemmOut::SwiGlu(_) => None,
        };
        let (base, add) = plain(first.out)?;
        let mut next = base;
        for x in segs {
            if plain(x.out)? != (next, add) {
                return None;
            }
            next += (x.w.rows * 4) as u64;
        }
        // The epilogue writes column pairs: an even total width.
        ((next - base) / 4).is_multiple_of(2).then_some(first.out)
    }

    /// h += MoE(RMSNorm(h)) for `n` rows through the grouped GEMM; with
    /// `next_norm` (the next layer's input-norm gain) the combine also
    /// leaves that layer's normalised input in xn.
    fn moe_gemm(&self, l: &LayerDev, n: usize, next_norm: Option<u64>) -> CudaResult<()> {
        let (g, k, d, s) = (&*self.gpu, &self.kernels, &self.dims, &self.mem.scratch);
        let m = &l.moe;
        gemm::rmsnorm_f16(g, k, s.h, l.post_norm, s.xn, n, d.rms_eps)?;
        let router = Seg { w: &m.router, up: None, out: GemmOut::Store(s.router_logits), ldc: d.n_experts };
        let gate = Seg { w: &m.sh_expert_gate, up: None, out: GemmOut::Store(s.sg), ldc: 1 };
        let rb = s.route();
        let bm = self.mem.opts.expert_tile_rows.unwrap_or_else(|| moe::tile_rows(d, n));
        // The shared expert and its gate need only xn: they run on the side
        // stream while this one routes and runs the routed experts. Their
        // split-K partials cannot meet another GEMM's: the grouped expert
        // GEMMs split nothing, and the next dense GEMM comes after the join.
        let fork_side = || -> CudaResult<()> {
            self.fork.record(&self.gpu.stream).ctx("cuEventRecord (fork)")?;
            self.side.stream.wait(&self.fork).ctx("cuStreamWaitEvent (fork)")
        };
        let sh_gate_up = Seg { w: &m.sh_gate, up: Some(&m.sh_up), out: GemmOut::SwiGlu(s.act_sh), ldc: d.moe_inter };
        let sh_down = Seg { w: &m.sh_down, up: None, out: GemmOut::Store(s.ys), ldc: d.hidden };
        let shared_expert = || -> CudaResult<()> {
            self.dense_gemms_on(&self.side, s.xn, d.hidden, n, &[sh_gate_up])?;
            self.dense_gemms_on(&self.side, s.act_sh, d.moe_inter, n, &[sh_down])
        };
        let join_side = || self.join.record(&self.side.stream).ctx("cuEventRecord (join)");
        if gemm::leaves_partials(n, &router) {
            // Long passes (a few K splits): the router alone (its 256 rows
            // are two whole W tiles; the gate's one row would take a third),
            // its partials summed by the top-k instead of a reduction
            // launch. The gate's own split GEMM reuses the partial scratch,
            // so it forks after the route has read them. The shared
            // expert's two GEMMs fork before the router when neither splits
            // (a block for every SM, from ~2,100 tokens): they then run
            // beside the router and the route, whose few waves leave most
            // of the GPU idle, instead of finishing after the routed
            // experts (2.8 ms of a 4,096-token pass waited for them).
            let early = gemm::dense_splits(n, &[sh_gate_up]) == 1 && gemm::dense_splits(n, &[sh_down]) == 1;
            if early {
                fork_side()?;
                shared_expert()?;
            }
            let logits = gemm::gemm_unreduced(g, k, s.xn, d.hidden, n, router, s.split_k())?;
            self.mark("gemm moe norm+router")?;
            moe::route(g, k, d, &rb, logits, n, bm)?;
            self.mark("moe route")?;
            fork_side()?;
            self.dense_gemms_on(&self.side, s.xn, d.hidden, n, &[gate])?;
            if !early {
                shared_expert()?;
            }
            join_side()?;
        } else {
            // Short passes (K cut into many splits, reduced anyway): the
            // router and the gate in one launch, and the side forks right
            // after it, so that the shared expert also runs beside the
            // route (forked after the route, a 256-token pass was 6% slower).
            self.dense_gemms(s.xn, d.hidden, n, &[router, gate])?;
            self.mark("gemm moe norm+router")?;
            fork_side()?;
            shared_expert()?;
            join_side()?;
            moe::route(g, k, d, &rb, KPartials { ptr: s.router_logits, splits: 1, plane: n * d.n_experts }, n, bm)?;
            self.mark("moe route")?;
        }
        let mt = moe::max_tiles(d, n, bm);
        let gather = Grouping { tiles: s.tiles, ntiles: s.ntiles, max_tiles: mt, a_rows: s.perm, bm };
        let sorted = Grouping { a_rows: 0, ..gather };
        gemm::gemm(g, k, s.xn, d.hidden, n * d.topk, &m.gate, Some(&m.up), GemmOut::SwiGlu(s.act_sorted), d.moe_inter, Some(&gather))?;
        gemm::gemm(g, k, s.act_sorted, d.moe_inter, n * d.topk, &m.down, None, GemmOut::Store(s.y_sorted), d.hidden, Some(&sorted))?;
        self.mark("gemm moe experts (shared beside)")?;
        self.gpu.stream.wait(&self.join).ctx("cuStreamWaitEvent (join)")?;
        self.mark("gemm moe shared (after the experts)")?;
        let norm = next_norm.map(|gain| moe::NextNorm { gain, xn: s.xn, eps: d.rms_eps });
        moe::combine(g, k, s.h, s.y_sorted, s.ys, s.sg, &rb, n, norm)?;
        self.mark("moe combine")
    }

    /// Every launch of one decode step for `n` tokens staged in
    /// scratch.tokens / pos / slot. No host synchronisation inside.
    pub fn step_launches(&self, n: usize, head: Head) -> CudaResult<()> {
        let (g, k, d, s) = (&*self.gpu, &self.kernels, &self.dims, &self.mem.scratch);
        if n == 0 || n > self.mem.opts.max_batch {
            return Err(CudaError::Invalid(format!("decode step of {n} tokens; this backend takes 1..={}", self.mem.opts.max_batch)));
        }
        embed::embed(g, k, d, &self.weights.embed, s.tokens, s.h, s.argmax, n)?;
        self.mark("embed")?;
        if self.mem.opts.decode_matrices.on_gemm(n) {
            // Each layer's MoE output waits in its y rows until the next
            // layer (or the head) folds it into h.
            for i in 0..d.layers {
                self.layer_decode_gemm(i, n, i > 0)?;
            }
            self.head_decode_gemm(n, d.layers > 0, head)?;
        } else {
            for i in 0..d.layers {
                self.layer_decode(i, n, i > 0)?;
            }
            self.head_decode(n, d.layers > 0)?;
        }
        self.mark("lm_head")?;
        if head == Head::Greedy {
            sampling::argmax_finish(g, k, s.argmax, s.tokens, s.out_ids, s.pos, s.step, n)?;
        }
        Ok(())
    }

    /// Runs one decode step, through a cached CUDA graph when enabled.
    pub fn run_step(&mut self, n: usize, head: Head) -> CudaResult<()> {
        self.run_graph((n, StepEnd::Head(head)), None, |m| m.step_launches(n, head))
    }

    /// Runs a served decode step of `n` tokens as one cached graph: the
    /// feed (`feed_stage`: the staged inputs into the decode scratch, the
    /// new block-table entries), the step ending in logits, and the sampler
    /// (`sample_rows_keeping`: each row's draw, kept for `Feed::Previous`).
    /// Inside one graph the feed and the sampler cost no kernel-to-graph
    /// boundaries (measured ~20 us a served step at batch 1 as separate
    /// launches, history 134).
    pub fn run_served_step(&mut self, n: usize, io: &ServedStep) -> CudaResult<()> {
        let key = Self::served_key("run_served_step", n, io)?;
        self.run_graph(key, Some(*io), |m| m.served_launches(n, io))
    }

    /// Captures the graph of a served step of `n` tokens ahead of its first
    /// use (`run_served_step` replays it), without running it.
    pub fn prepare_served_step(&mut self, n: usize, io: &ServedStep) -> CudaResult<()> {
        let key = Self::served_key("prepare_served_step", n, io)?;
        if !self.mem.opts.use_graphs {
            return Ok(());
        }
        self.gpu.bind()?;
        self.cached_graph(key, Some(*io), |m| m.served_launches(n, io)).map(|_| ())
    }

    /// The graph cache's key of a served step of `n` tokens, after checking
    /// that its feed stages `n` rows.
    fn served_key(what: &'static str, n: usize, io: &ServedStep) -> CudaResult<(usize, StepEnd)> {
        if io.feed.n as usize != n {
            return Err(CudaError::shape(what, format!("a feed of {} rows for a step of {n}", io.feed.n)));
        }
        Ok((n, StepEnd::Served { tops: io.out.top_ids != 0 }))
    }

    fn served_launches(&self, n: usize, io: &ServedStep) -> CudaResult<()> {
        feed::stage(&self.gpu, &self.kernels, &io.feed)?;
        self.step_launches(n, Head::Logits)?;
        sampling::sample_rows_keeping(&self.gpu, &self.kernels, self.mem.scratch.logits, io.rows, &io.out, io.keep, n, self.dims.vocab)
    }

    /// Runs `launches` through the graph cached for `key` (see
    /// `cached_graph`), or directly when graphs are off.
    fn run_graph(&mut self, key: (usize, StepEnd), served: Option<ServedStep>, launches: impl Fn(&Self) -> CudaResult<()>) -> CudaResult<()> {
        self.gpu.bind()?;
        if !self.mem.opts.use_graphs {
            return launches(self);
        }
        self.cached_graph(key, served, launches)?.exec.launch().ctx("cuGraphLaunch")
    }

    /// The graph cached for `key`, captured from `launches` first when
    /// there is none or a served step's addresses changed.
    fn cached_graph(&mut self, key: (usize, StepEnd), served: Option<ServedStep>, launches: impl Fn(&Self) -> CudaResult<()>) -> CudaResult<&Graph> {
        if self.graphs.get(&key).is_some_and(|g| g.served != served) {
            self.graphs.remove(&key);
        }
        if !self.graphs.contains_key(&key) {
            let stream = self.gpu.stream.clone();
            stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).ctx("cuStreamBeginCapture")?;
            let launched = launches(self);
            let graph = stream.end_capture(CUgraphInstantiate_flags(0));
            launched?;
            let graph = graph.ctx("cuStreamEndCapture")?.ok_or_else(|| CudaError::Driver { what: "graph capture".into(), message: "empty graph".into() })?;
            self.graphs.insert(key, Graph { exec: graph, served });
        }
        self.graphs.get(&key).ok_or_else(|| CudaError::Driver { what: "graph cache".into(), message: "graph missing after capture".into() })
    }

    // ---- prefill -------------------------------------------------------------

    /// One layer over the `t` rows of a prefill pass, made of `pieces`
    /// (each one sequence's run of tokens, in row order, covering 0..t):
    /// the in-projection, out-projection and MoE over all rows at once, the
    /// mixer over every piece's rows in one set of launches (each piece from
    /// its own state).
    ///
    /// `nd`: the pass's trailing decode rows (`decode_rows`, the same for
    /// every layer), whose mixer runs on the decode kernels.
    /// `in_dequantised`: the previous layer had the side stream dequantise
    /// this one's in-projections (`dequantise_ahead`). Returns whether this
    /// layer did so for the next one.
    fn layer_prefill(&self, i: usize, pieces: &[Piece], t: usize, nd: usize, in_dequantised: bool) -> CudaResult<bool> {
        let (g, k, d, s) = (&*self.gpu, &self.kernels, &self.dims, &self.mem.scratch);
        let l = &self.weights.layers[i];
        let ps = d.proj_stride();
        let ahead = self.dequantises_ahead(l, t);
        let next = self.weights.layers.get(i + 1).filter(|nl| ahead && self.dequantises_ahead(nl, t));
        let start_ahead = || self.dequantise_ahead(l, next);
        // Every layer but the first finds its normalised input left in xn
        // by the previous layer's combine.
        self.in_proj_gemm_from(l, t, i > 0, in_dequantised)?;
        // Row r of proj and of the mixer output, as the kernels lay them out.
        let proj_row = |r: usize| s.proj + (r * ps * 4) as u64;
        // A mixed step's decode rows (rows r0..t) take the decode kernels'
        // mixer; the prompts' pieces the prefill's.
        let (pieces, r0) = (&pieces[..pieces.len() - nd], t - nd);
        let row_i32 = |base: u64| base + (r0 * 4) as u64;
        match &l.mixer {
            MixerDev::DeltaNet(w) => {
                // Every piece in one set of launches: the recurrences of
                // many short prompts run side by side.
                let runs: Vec<gdn::PrefillPiece> = pieces
                    .iter()
                    .map(|p| {
                        let (conv, state) = self.mem.gdn_layer_slot(i, p.slot);
                        let capture = p.capture.map(|(cslot, at)| {
                            let (conv, state) = self.mem.gdn_layer_slot(i, cslot);
                            gdn::GdnCapture { conv, state, at }
                        });
                        let mix = MixOut::F16(s.mix_f16 + (p.row0 * d.gdn_val_dim() * 2) as u64);
                        gdn::PrefillPiece { conv, state, proj: proj_row(p.row0), t: p.len, p0: p.p0, mix, capture }
                    })
                    .collect();
                // The side stream dequantises during the state recurrence,
                // whose serial chain leaves the GPU mostly idle.
                let hook: Option<gdn::BeforeState> = if ahead { Some(&start_ahead) } else { None };
                gdn::prefill_pieces_with(g, k, d, w, &runs, ps, &s.gdn_scratch(), hook)?;
                if nd > 0 {
                    let mix = MixOut::F16(s.mix_f16 + (r0 * d.gdn_val_dim() * 2) as u64);
                    gdn::decode(g, k, d, w, &self.gdn_state(i), proj_row(r0), ps, row_i32(s.pos), row_i32(s.slot), mix, nd)?;
                }
                self.mark("prefill gdn (chunked)")?;
            }
            MixerDev::Attention(w) => {
                let kv = self.kv_view(i);
                // q/k norms, rotation and the cache stores take every row's
                // own position and slot; the decode rows' queries in f32
                // for the decode attention.
                attention::prep(g, k, d, w, self.weights.inv_freq, s.proj, ps, s.pos, s.slot, &kv, QOut::F16(s.q_f16), r0)?;
                if nd > 0 {
                    attention::prep(g, k, d, w, self.weights.inv_freq, proj_row(r0), ps, row_i32(s.pos), row_i32(s.slot), &kv, QOut::F32(s.q_f32), nd)?;
                }
                if ahead {
                    start_ahead()?;
                }
                // Every piece in one launch: the query tiles of many short
                // prompts fill the GPU together.
                let runs: Vec<attention::PrefillPiece> =
                    pieces.iter().map(|p| attention::PrefillPiece { block_table: self.mem.bt_row(p.slot), row0: p.row0, t: p.len, p0: p.p0 }).collect();
                attention::prefill_pieces(g, k, d, s.q_f16, kv.k, kv.v, s.proj, ps, &runs, MixOut::F16(s.mix_f16))?;
                if nd > 0 {
                    let mix = MixOut::F16(s.mix_f16 + (r0 * d.attn_out_dim() * 2) as u64);
                    attention::decode(g, k, d, s.q_f32, &kv, row_i32(s.pos), row_i32(s.slot), &s.attn_decode(), proj_row(r0), ps, mix, nd)?;
                }
                self.mark("prefill attention")?;
            }
        }
        let out = Self::out_projection(l);
        let out_seg = self.out_proj_seg(&out);
        if ahead {
            self.gpu.stream.wait(&self.ahead_out).ctx("cuStreamWaitEvent (out-projection dequantised)")?;
            hgemm::hgemm(g, k, s.mix_f16, out.cols, t, hgemm::stacked_rows(&[&out], s.w16_out)?, out_seg.out, out_seg.ldc)?;
        } else {
            self.dense_gemms(s.mix_f16, out.cols, t, &[out_seg])?;
        }
        self.mark("gemm out_proj")?;
        self.moe_gemm(l, t, self.weights.layers.get(i + 1).map(|next| next.input_norm))?;
        Ok(next.is_some())
    }

    /// Whether layer `l` of an `n`-row pass has its projections dequantised
    /// ahead on the side stream (`Options::dequant_ahead`): its in- and
    /// out-projections both on `hgemm` and `w16_out` planned for the latter.
    fn dequantises_ahead(&self, l: &LayerDev, n: usize) -> bool {
        let out = Self::out_projection(l);
        self.mem.opts.dequant_ahead
            && self.mem.scratch.w16_out.elems >= out.rows * out.cols
            && self.f16_gemm_output(n, &[self.out_proj_seg(&out)]).is_some()
            && self.f16_gemm_output(n, &self.in_proj_segs(l)).is_some()
    }

    /// A layer's out-projection as a launch's matrix: added into h.
    fn out_proj_seg<'a>(&self, out: &'a QMat) -> Seg<'a> {
        Seg { w: out, up: None, out: GemmOut::Add(self.mem.scratch.h), ldc: self.dims.hidden }
    }

    /// From this point of the main stream (past the multiply by layer
    /// `l`'s in-projections, the last reader of `w16`), the side stream
    /// dequantises `l`'s out-projection into `w16_out` (then records
    /// `ahead_out`) and `next`'s in-projections into `w16` (then
    /// `ahead_in`). The main stream waits for each event just before the
    /// multiply that reads those rows, so the dequantisation (30 us a layer
    /// at 4,096 tokens, DRAM-bound) runs beside the mixer instead of before
    /// each multiply.
    fn dequantise_ahead(&self, l: &LayerDev, next: Option<&LayerDev>) -> CudaResult<()> {
        let (k, s) = (&self.kernels, &self.mem.scratch);
        self.ahead_fork.record(&self.gpu.stream).ctx("cuEventRecord (dequantise ahead)")?;
        self.side.stream.wait(&self.ahead_fork).ctx("cuStreamWaitEvent (dequantise ahead)")?;
        let out = Self::out_projection(l);
        hgemm::dequant_rows(&self.side, k, &[&out], s.w16_out)?;
        self.ahead_out.record(&self.side.stream).ctx("cuEventRecord (out-projection dequantised)")?;
        if let Some(nl) = next {
            let mats: Vec<&QMat> = self.in_projections(nl).into_iter().map(|(m, _)| m).collect();
            hgemm::dequant_rows(&self.side, k, &mats, s.w16)?;
            self.ahead_in.record(&self.side.stream).ctx("cuEventRecord (in-projections dequantised)")?;
        }
        Ok(())
    }

    /// One prefill pass over rows `tokens` (their positions and state slots
    /// row by row, `pieces` the sequences' runs of rows): inputs staged,
    /// embedded, then every layer. The argmax keys of the pass start cleared.
    fn prefill_pass(&self, tokens: &[u32], pos: &[i32], slots: &[i32], pieces: &[Piece]) -> CudaResult<()> {
        let (d, s) = (&self.dims, &self.mem.scratch);
        let t = tokens.len();
        write_device(&self.gpu, s.tokens, tokens)?;
        write_device(&self.gpu, s.pos, pos)?;
        write_device(&self.gpu, s.slot, slots)?;
        embed::embed(&self.gpu, &self.kernels, d, &self.weights.embed, s.tokens, s.h, s.argmax, t)?;
        self.mark("embed")?;
        let nd = decode_rows(pieces, t, self.mem.opts.max_batch);
        let mut in_dequantised = false;
        for i in 0..d.layers {
            in_dequantised = self.layer_prefill(i, pieces, t, nd, in_dequantised)?;
        }
        Ok(())
    }

    /// Checks ids against the vocabulary.
    pub fn check_tokens(&self, tokens: &[u32]) -> CudaResult<()> {
        if let Some(bad) = tokens.iter().find(|t| **t as usize >= self.dims.vocab) {
            return Err(CudaError::Invalid(format!("token id {bad} is outside the vocabulary of {}", self.dims.vocab)));
        }
        Ok(())
    }

    /// Appends `tokens` to `seq`. `want_all`: return the logits of every
    /// position; otherwise the returned vector has the last position's
    /// logits when `want_last_logits`, and the argmax of the last position
    /// is always returned.
    pub fn prefill(&mut self, seq: SeqId, tokens: &[u32], want_all: bool, want_last_logits: bool) -> CudaResult<(Vec<Vec<f32>>, u32)> {
        if tokens.is_empty() {
            return Err(CudaError::Invalid("empty prompt".into()));
        }
        self.check_tokens(tokens)?;
        self.gpu.bind()?;
        let len0 = self.mem.seq(seq)?.len;
        self.mem.reserve(seq, len0 + tokens.len())?;
        let slot = self.mem.seq(seq)?.slot;
        let chunk = self.mem.opts.prefill_chunk;
        let d = self.dims.clone();
        let s = self.mem.scratch;
        let mut all = Vec::new();
        let mut p0 = len0;
        let mut last_id = 0u32;
        let mut last_logits = Vec::new();
        let n_chunks = tokens.len().div_ceil(chunk);
        for (ci, part) in tokens.chunks(chunk).enumerate() {
            let t = part.len();
            let pos: Vec<i32> = (0..t).map(|i| (p0 + i) as i32).collect();
            self.prefill_pass(part, &pos, &vec![slot as i32; t], &[Piece { slot, p0, row0: 0, len: t, capture: None }])?;
            if want_all {
                all.extend(self.logits_rows(t)?);
            } else if ci + 1 == n_chunks {
                // The last position only: its row through the decode head
                // (the embed above cleared the argmax keys).
                self.logits_of_rows(t - 1, 1)?;
                let key: Vec<u64> = read_device(&self.gpu, s.argmax, 1)?;
                last_id = sampling::key_index(key[0]);
                if want_last_logits {
                    last_logits = self.logits_stage.read_rows(&self.gpu, s.logits, 1, d.vocab)?.swap_remove(0);
                }
            }
            p0 += t;
            if let Some(sq) = self.mem.seqs.get_mut(&seq) {
                sq.len = p0;
            }
        }
        self.gpu.synchronize()?;
        if want_all {
            last_id = all.last().map(|v| lily_model::argmax(v)).unwrap_or(0);
            return Ok((all, last_id));
        }
        Ok((if want_last_logits { vec![last_logits] } else { Vec::new() }, last_id))
    }

    /// Prefills several distinct sequences (each part non-empty) in passes
    /// of up to `prefill_chunk` rows: the parts' tokens are concatenated
    /// and cut only where a pass is full, so a pass holds pieces of several
    /// sequences and each matrix is read once per pass for all of them
    /// (`layer_prefill`). Returns each part's last-position logits, in
    /// part order.
    ///
    /// Every part is checked and every KV block reserved before anything
    /// runs: a `Capacity` or `Invalid` error changes no sequence.
    pub fn prefill_batch(&mut self, parts: &[(SeqId, &[u32])]) -> CudaResult<Vec<Vec<f32>>> {
        Ok(self.prefill_batch_capturing(parts, &vec![None; parts.len()], &vec![None; parts.len()])?.0)
    }

    /// Whether `prefill_capture` can take these capture points inside one
    /// pass: every part in one pass (at most `prefill_chunk` rows in all),
    /// every point a whole number of DeltaNet chunks into its part.
    pub fn captures_in_one_pass(&self, parts: &[lily_model::CapturePart]) -> bool {
        let rows: usize = parts.iter().map(|p| p.1.len()).sum();
        rows <= self.mem.opts.prefill_chunk && parts.iter().all(|&(_, t, at)| at.is_none_or(|a| a > 0 && a < t.len() && a.is_multiple_of(GDN_CHUNK)))
    }

    /// `prefill_batch`, and for each part with a capture point `at` a new
    /// sequence holding its state after `at` tokens, taken inside the one
    /// pass (`captures_in_one_pass` must hold when any part captures;
    /// without captures the parts may take several passes): the DeltaNet layers write
    /// the state at that chunk boundary into the new sequence's slot
    /// (`gdn::GdnCapture`), and it shares the KV blocks of those positions.
    /// A capture with no free sequence slot or KV block comes back None.
    /// Each part with a `draws` entry has its next token drawn with it on
    /// the device instead of its logits read back (`last_rows`).
    /// Errors as `prefill_batch`'s; the new sequences are freed then.
    pub fn prefill_capture(&mut self, parts: &[lily_model::CapturePart], draws: &[Option<SampleRow>]) -> CudaResult<lily_model::CapturedDraws> {
        if draws.len() != parts.len() {
            return Err(CudaError::Invalid(format!("{} draws for a prefill of {} parts", draws.len(), parts.len())));
        }
        if parts.iter().any(|p| p.2.is_some()) && !self.captures_in_one_pass(parts) {
            return Err(CudaError::Invalid("prefill_capture: the capture points do not fit one pass".into()));
        }
        // Checked before any snapshot is allocated, so an error leaks none.
        let lens: Vec<usize> = parts.iter().map(|p| self.mem.seq(p.0).map(|s| s.len)).collect::<CudaResult<_>>()?;
        // Per part, the snapshot and the (slot, at) its capture writes to,
        // taken together so that a snapshot always has its capture.
        let mut snaps: Vec<Option<SeqId>> = Vec::with_capacity(parts.len());
        let mut caps: Vec<Option<(usize, usize)>> = Vec::with_capacity(parts.len());
        for p in parts {
            let snap = p.2.and_then(|at| {
                let id = self.mem.alloc().ok()?;
                match self.mem.seq(id) {
                    Ok(s) => Some((id, (s.slot, at))),
                    Err(_) => {
                        self.mem.free(id);
                        None
                    }
                }
            });
            snaps.push(snap.map(|s| s.0));
            caps.push(snap.map(|s| s.1));
        }
        let whole: Vec<(SeqId, &[u32])> = parts.iter().map(|p| (p.0, p.1)).collect();
        let (rows, drawn) = match self.prefill_batch_capturing(&whole, &caps, draws) {
            Ok(r) => r,
            Err(e) => {
                for id in snaps.into_iter().flatten() {
                    self.mem.free(id);
                }
                return Err(e);
            }
        };
        for ((p, snap), len0) in parts.iter().zip(snaps.iter_mut()).zip(lens) {
            if let (Some(at), Some(id)) = (p.2, *snap) {
                if self.mem.share_prefix(id, p.0, len0 + at).is_err() {
                    self.mem.free(id);
                    *snap = None;
                }
            }
        }
        Ok(((rows, snaps), drawn))
    }

    /// `prefill_batch` with, per part, the (slot, at) a capture writes to
    /// and the parameters its next token is drawn with on the device (its
    /// logits row then empty; see `last_rows`).
    fn prefill_batch_capturing(&mut self, parts: &[(SeqId, &[u32])], caps: &[Option<(usize, usize)>], draws: &[Option<SampleRow>]) -> CudaResult<LastRows> {
        if caps.len() != parts.len() || draws.len() != parts.len() {
            return Err(CudaError::Invalid(format!("{} captures and {} draws for a prefill of {} parts", caps.len(), draws.len(), parts.len())));
        }
        if parts.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        self.gpu.bind()?;
        let mut lens = Vec::with_capacity(parts.len());
        let mut need = 0usize;
        for (i, &(seq, tokens)) in parts.iter().enumerate() {
            if tokens.is_empty() {
                return Err(CudaError::Invalid(format!("empty prefill for {seq:?}")));
            }
            if parts[..i].iter().any(|p| p.0 == seq) {
                return Err(CudaError::Invalid(format!("sequence {seq:?} appears twice in one prefill batch")));
            }
            self.check_tokens(tokens)?;
            let sq = self.mem.seq(seq)?;
            let new_len = sq.len + tokens.len();
            if new_len > self.mem.opts.max_seq_len {
                return Err(CudaError::Capacity(format!(
                    "sequence would hold {new_len} tokens; this backend was sized for at most {} per sequence",
                    self.mem.opts.max_seq_len
                )));
            }
            need += new_len.div_ceil(KV_BLOCK).saturating_sub(sq.blocks.len());
            lens.push(sq.len);
        }
        let free = self.mem.free_block_count();
        if need > free {
            return Err(CudaError::Capacity(format!(
                "KV cache full: {need} more blocks of {KV_BLOCK} tokens needed for a prefill batch of {}, {free} free of {}",
                parts.len(),
                self.mem.num_blocks
            )));
        }
        // Made before anything runs, so that running out of memory for it
        // changes no sequence (the `Capacity` contract).
        if self.draw_io.is_none() && draws.iter().any(Option::is_some) {
            self.draw_io = Some(DrawIo::new(&self.gpu, self.mem.opts.max_batch)?);
        }
        for (&(seq, tokens), &len) in parts.iter().zip(&lens) {
            self.mem.reserve(seq, len + tokens.len())?;
        }

        let chunk = self.mem.opts.prefill_chunk;
        let (d, s) = (self.dims.clone(), self.mem.scratch);
        let mut out = vec![Vec::new(); parts.len()];
        let mut drawn = vec![None; parts.len()];
        // The cursor: part `k`, of which `done` tokens are in earlier passes.
        let (mut k, mut done) = (0usize, 0usize);
        while k < parts.len() {
            let (mut toks, mut pos, mut slots) = (Vec::with_capacity(chunk), Vec::with_capacity(chunk), Vec::with_capacity(chunk));
            let mut pieces: Vec<(SeqId, Piece)> = Vec::new();
            // (part, row) of every part whose last token is in this pass.
            let mut ends: Vec<(usize, usize)> = Vec::new();
            while k < parts.len() && toks.len() < chunk {
                let (seq, tokens) = parts[k];
                let take = (tokens.len() - done).min(chunk - toks.len());
                let (slot, p0) = (self.mem.seq(seq)?.slot, lens[k] + done);
                // A capture rides with the piece that holds the whole part.
                let capture = if done == 0 && take == tokens.len() { caps[k] } else { None };
                pieces.push((seq, Piece { slot, p0, row0: toks.len(), len: take, capture }));
                toks.extend_from_slice(&tokens[done..done + take]);
                pos.extend((p0..p0 + take).map(|p| p as i32));
                slots.extend(std::iter::repeat_n(slot as i32, take));
                done += take;
                if done == tokens.len() {
                    ends.push((k, toks.len() - 1));
                    k += 1;
                    done = 0;
                }
            }
            let layout: Vec<Piece> = pieces.iter().map(|p| p.1).collect();
            self.prefill_pass(&toks, &pos, &slots, &layout)?;
            for (seq, p) in &pieces {
                if let Some(sq) = self.mem.seqs.get_mut(seq) {
                    sq.len = p.p0 + p.len;
                }
            }
            if ends.is_empty() {
                continue;
            }
            // The last rows of the parts that end here, gathered into rows
            // 0.. of h for one head pass. Row j's source is at row >= j and
            // later sources lie past every earlier destination, so the
            // in-order copies never overwrite a row still to be read.
            let row_bytes = d.hidden * 4;
            for (j, &(_, row)) in ends.iter().enumerate() {
                if row != j {
                    copy_device(&self.gpu, s.h + (j * row_bytes) as u64, s.h + (row * row_bytes) as u64, row_bytes)?;
                }
            }
            let wanted: Vec<Option<SampleRow>> = ends.iter().map(|&(part, _)| draws[part]).collect();
            let (rows, draws_here) = self.last_rows(&wanted)?;
            for ((&(part, _), logits), d) in ends.iter().zip(rows).zip(draws_here) {
                out[part] = logits;
                drawn[part] = d;
            }
        }
        self.gpu.synchronize()?;
        Ok((out, drawn))
    }

    /// Final norm + lm_head of rows `first..first + n` of h (n at most
    /// the decode batch): logits in scratch rows 0..n, argmax keys folded
    /// into keys 0..n (the caller clears them).
    fn logits_of_rows(&self, first: usize, n: usize) -> CudaResult<()> {
        let (g, k, d) = (&*self.gpu, &self.kernels, &self.dims);
        let dec = &self.mem.decode;
        let rows = dec.h.from(first * d.hidden)?;
        qmm::xnorm(g, k, d, rows, d.hidden, None, Some(self.weights.final_norm), dec.moe.px_in, n)?;
        let seg = DenseSeg { w: &self.weights.lm_head, out: dec.logits, out_stride: d.vocab, epilogue: Epilogue::Logits };
        // A prefill's logits: the exact path, whatever the decode steps use.
        qmm::dense(g, k, &[seg], dec.moe.px_in, n, qmm::XPrecision::HiLo, Some(dec.argmax))
    }

    /// Logits of the first `t` rows of h (final norm + lm_head), in groups
    /// of the decode batch size.
    fn logits_rows(&mut self, t: usize) -> CudaResult<Vec<Vec<f32>>> {
        Ok(self.last_rows(&vec![None; t])?.0)
    }

    /// The final norm and lm_head of the first `draws.len()` rows of h, in
    /// groups of the decode batch size: row r's logits read back where
    /// `draws[r]` is None, else its next token drawn on the device with
    /// those parameters (`DrawIo::draw`) and an empty logits row: a new
    /// prompt's first token without the ~1 MB read-back and host draw.
    fn last_rows(&mut self, draws: &[Option<SampleRow>]) -> CudaResult<LastRows> {
        let (t, vocab, max_batch) = (draws.len(), self.dims.vocab, self.mem.opts.max_batch);
        let s = self.mem.scratch;
        if self.draw_io.is_none() && draws.iter().any(Option::is_some) {
            return Err(CudaError::Invalid("last_rows: draws asked before the draw buffers were made (prefill_batch_capturing makes them)".into()));
        }
        let (mut logits, mut drawn) = (Vec::with_capacity(t), Vec::with_capacity(t));
        let mut r = 0;
        while r < t {
            let group = &draws[r..t.min(r + max_batch)];
            let n = group.len();
            zero_device(&self.gpu, s.argmax, n * 8)?;
            self.logits_of_rows(r, n)?;
            let mut read = if group.iter().any(Option::is_none) { self.logits_stage.read_rows(&self.gpu, s.logits, n, vocab)? } else { vec![Vec::new(); n] };
            let mut got = match &self.draw_io {
                Some(io) if group.iter().any(Option::is_some) => io.draw(&self.gpu, &self.kernels, s.logits, group, vocab)?,
                _ => vec![None; n],
            };
            for (j, want) in group.iter().enumerate() {
                logits.push(if want.is_some() { Vec::new() } else { std::mem::take(&mut read[j]) });
                drawn.push(got[j].take());
            }
            r += n;
        }
        Ok((logits, drawn))
    }

    /// One decode step for a batch of distinct sequences; returns logits.
    /// The whole batch is one step (every weight read once), in groups of
    /// `max_batch` if it is larger.
    pub fn decode(&mut self, batch: &[(SeqId, u32)]) -> CudaResult<Vec<Vec<f32>>> {
        self.reserve_batch(batch, 1)?;
        let mut out = Vec::with_capacity(batch.len());
        for part in batch.chunks(self.mem.opts.max_batch) {
            out.extend(self.decode_part(part)?);
        }
        Ok(out)
    }

    /// Checks a whole batch and reserves KV slots for each sequence's next
    /// `steps` tokens before any group of it runs, so that a batch refused
    /// for lack of memory (or a bad entry) has changed no sequence's length:
    /// the caller may retry any subset. (Blocks reserved for the entries
    /// before a refused one stay with their sequences; their next tokens use
    /// them.)
    fn reserve_batch(&mut self, batch: &[(SeqId, u32)], steps: usize) -> CudaResult<()> {
        let toks: Vec<u32> = batch.iter().map(|b| b.1).collect();
        self.check_tokens(&toks)?;
        for (i, (id, _)) in batch.iter().enumerate() {
            if batch[..i].iter().any(|b| b.0 == *id) {
                return Err(CudaError::Invalid(format!("sequence {id:?} appears twice in one decode batch")));
            }
            let len = self.mem.seq(*id)?.len;
            self.mem.reserve(*id, len + steps)?;
        }
        Ok(())
    }

    /// Counts `steps` more tokens into each sequence of `batch` (after the
    /// steps that fed them were queued).
    fn advance(&mut self, batch: &[(SeqId, u32)], steps: usize) {
        for (id, _) in batch {
            if let Some(s) = self.mem.seqs.get_mut(id) {
                s.len += steps;
            }
        }
    }

    /// Writes one decode step's inputs (token, position, state slot per
    /// entry) to the scratch. The caller has run `reserve_batch` (on the
    /// whole batch, of which this may be one group).
    fn stage_batch(&mut self, batch: &[(SeqId, u32)]) -> CudaResult<()> {
        let toks: Vec<u32> = batch.iter().map(|b| b.1).collect();
        let mut pos = Vec::with_capacity(batch.len());
        let mut slots = Vec::with_capacity(batch.len());
        for (id, _) in batch {
            let sq = self.mem.seq(*id)?;
            pos.push(sq.len as i32);
            slots.push(sq.slot as i32);
        }
        let s = self.mem.scratch;
        write_device(&self.gpu, s.tokens, &toks)?;
        write_device(&self.gpu, s.pos, &pos)?;
        write_device(&self.gpu, s.slot, &slots)?;
        Ok(())
    }

    fn decode_part(&mut self, batch: &[(SeqId, u32)]) -> CudaResult<Vec<Vec<f32>>> {
        self.gpu.bind()?;
        self.stage_batch(batch)?;
        let n = batch.len();
        self.run_step(n, Head::Logits)?;
        let v = self.dims.vocab;
        let flat: Vec<f32> = read_device(&self.gpu, self.mem.scratch.logits, n * v)?;
        self.advance(batch, 1);
        Ok(flat.chunks_exact(v).map(|c| c.to_vec()).collect())
    }

    /// `steps` greedy steps of one sequence from `first` (not yet fed): every
    /// step runs on the GPU back to back; the ids are read once at the end.
    pub fn decode_greedy(&mut self, seq: SeqId, first: u32, steps: usize) -> CudaResult<Vec<u32>> {
        Ok(self.decode_greedy_batch(&[(seq, first)], steps)?.pop().unwrap_or_default())
    }

    /// `steps` greedy steps of every sequence of `batch` (each from its
    /// given first token, not yet fed), as one batch: the steps run back to
    /// back on the GPU (ids fed back on the device); the ids are read at the
    /// end of each run of `max_greedy_steps`. Returns each sequence's ids.
    pub fn decode_greedy_batch(&mut self, batch: &[(SeqId, u32)], steps: usize) -> CudaResult<Vec<Vec<u32>>> {
        let n = batch.len();
        if n == 0 || n > self.mem.opts.max_batch {
            return Err(CudaError::Invalid(format!("greedy batch of {n} sequences; this backend takes 1..={}", self.mem.opts.max_batch)));
        }
        self.gpu.bind()?;
        let mut out: Vec<Vec<u32>> = vec![Vec::with_capacity(steps); n];
        let mut feed = batch.to_vec();
        let run = self.mem.opts.max_greedy_steps;
        let mut done = 0;
        while done < steps {
            let m = (steps - done).min(run);
            self.reserve_batch(&feed, m)?;
            self.stage_batch(&feed)?;
            let s = self.mem.scratch;
            write_device(&self.gpu, s.step, &[0i32])?;
            for _ in 0..m {
                self.run_step(n, Head::Greedy)?;
            }
            let ids: Vec<u32> = read_device(&self.gpu, s.out_ids, m * n)?;
            self.advance(&feed, m);
            for step in ids.chunks_exact(n) {
                for (o, &t) in out.iter_mut().zip(step) {
                    o.push(t);
                }
            }
            for (f, o) in feed.iter_mut().zip(&out) {
                f.1 = *o.last().unwrap_or(&f.1);
            }
            done += m;
        }
        Ok(out)
    }

    /// Runs `work` with a profiling event recorded after every kernel group
    /// and returns the GPU time of each group, summed over its occurrences:
    /// (group, microseconds).
    fn profiled(&mut self, work: impl FnOnce(&mut Self) -> CudaResult<()>) -> CudaResult<Vec<(&'static str, f64)>> {
        self.gpu.bind()?;
        *self.marks.lock().map_err(|_| CudaError::Invalid("profiler lock poisoned".into()))? = Some(Vec::new());
        let r = self.mark("start").and_then(|_| work(self));
        let marks = self.marks.lock().map_err(|_| CudaError::Invalid("profiler lock poisoned".into()))?.take().unwrap_or_default();
        r?;
        self.gpu.synchronize()?;
        let mut totals: Vec<(&'static str, f64)> = Vec::new();
        for w in marks.windows(2) {
            let us = w[0].1.elapsed_ms(&w[1].1).ctx("cuEventElapsedTime")? as f64 * 1000.0;
            match totals.iter_mut().find(|t| t.0 == w[1].0) {
                Some(t) => t.1 += us,
                None => totals.push((w[1].0, us)),
            }
        }
        Ok(totals)
    }

    /// GPU time of each kernel group of a prefill of `tokens` into `seq`,
    /// summed over layers and chunks: (group, microseconds). Launches run
    /// directly (prefill kernels are long enough that launch gaps are small).
    pub fn profile_prefill(&mut self, seq: SeqId, tokens: &[u32]) -> CudaResult<Vec<(&'static str, f64)>> {
        self.profiled(|m| m.prefill(seq, tokens, false, false).map(|_| ()))
    }

    /// `profile_prefill` of a `prefill_batch` of several sequences: what a
    /// pass of many short prompts (the server under load) costs by group.
    pub fn profile_prefill_batch(&mut self, parts: &[(SeqId, &[u32])]) -> CudaResult<Vec<(&'static str, f64)>> {
        self.profiled(|m| m.prefill_batch(parts).map(|_| ()))
    }

    /// GPU time of each kernel group of one decode step of `batch` (direct
    /// launches with an event after every group, no graph, so each group
    /// starts after the previous one ends: what each costs alone), summed
    /// over layers: (group, microseconds). The step advances the sequences.
    pub fn profile_decode(&mut self, batch: &[(SeqId, u32)]) -> CudaResult<Vec<(&'static str, f64)>> {
        self.gpu.bind()?;
        self.reserve_batch(batch, 1)?;
        self.stage_batch(batch)?;
        let totals = self.profiled(|m| m.step_launches(batch.len(), Head::Logits))?;
        self.advance(batch, 1);
        Ok(totals)
    }

    /// One decode step of one sequence, stopping after every stage to read
    /// the residual stream: ("embed", h), then per layer ("layer i in_proj",
    /// the in-projection row), ("layer i mixer", h), ("layer i moe", h), then
    /// ("logits", logits). For
    /// locating a divergence from the reference; slow (a sync per stage).
    pub fn trace_decode(&mut self, seq: SeqId, token: u32) -> CudaResult<Vec<(String, Vec<f32>)>> {
        self.gpu.bind()?;
        self.reserve_batch(&[(seq, token)], 1)?;
        self.stage_batch(&[(seq, token)])?;
        let (d, s) = (self.dims.clone(), self.mem.scratch);
        let mut out = Vec::new();
        embed::embed(&self.gpu, &self.kernels, &d, &self.weights.embed, s.tokens, s.h, s.argmax, 1)?;
        out.push(("embed".to_string(), read_device(&self.gpu, s.h, d.hidden)?));
        for i in 0..d.layers {
            // Each layer folds its MoE output into h at once (the step defers
            // that into the next layer's packing), so every stage is complete.
            self.mixer_decode(i, 1, false)?;
            let width = self.in_projections(&self.weights.layers[i]).iter().map(|(m, _)| m.rows).sum::<usize>();
            out.push((format!("layer {i} in_proj"), read_device(&self.gpu, s.proj, width)?));
            out.push((format!("layer {i} mixer"), read_device(&self.gpu, s.h, d.hidden)?));
            self.moe_decode(i, 1)?;
            self.combine_moe_now(1)?;
            out.push((format!("layer {i} moe"), read_device(&self.gpu, s.h, d.hidden)?));
        }
        self.head_decode(1, false)?;
        out.push(("logits".to_string(), read_device(&self.gpu, s.logits, d.vocab)?));
        self.advance(&[(seq, token)], 1);
        Ok(out)
    }

    /// Bytes of device memory held: weights + memory plan.
    pub fn bytes(&self) -> usize {
        self.weights.bytes + self.mem.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::{decode_rows, Knockout, Piece};

    #[test]
    fn knockout_names_match_their_bits() {
        let bits =
            [Knockout::XNORM, Knockout::IN_PROJ, Knockout::MIXER, Knockout::OUT_PROJ, Knockout::ROUTER, Knockout::GATE_UP, Knockout::DOWN, Knockout::HEAD];
        for (name, bit) in Knockout::GROUPS.iter().zip(bits) {
            assert_eq!(Knockout::parse(name).unwrap(), bit, "{name}");
        }
        assert_eq!(Knockout::parse("router+down").unwrap(), Knockout(Knockout::ROUTER.0 | Knockout::DOWN.0));
        assert_eq!(Knockout::parse("").unwrap(), Knockout::default());
        assert!(Knockout::parse("routers").unwrap_err().contains("routers"));
    }

    /// A pass laid out as `prefill_batch_capturing` lays it: each piece's
    /// rows after the previous one's.
    fn pass(pieces: &[(usize, usize, bool)]) -> (Vec<Piece>, usize) {
        let mut row0 = 0;
        let out = pieces
            .iter()
            .enumerate()
            .map(|(slot, &(p0, len, capture))| {
                let p = Piece { slot, p0, row0, len, capture: capture.then_some((99, 64)) };
                row0 += len;
                p
            })
            .collect();
        (out, row0)
    }

    #[test]
    fn decode_rows_are_the_trailing_one_token_continuations() {
        let rows = |pieces: &[(usize, usize, bool)], max_batch: usize| {
            let (p, t) = pass(pieces);
            decode_rows(&p, t, max_batch)
        };
        // A prompt chunk, then three sequences' next tokens.
        assert_eq!(rows(&[(0, 100, false), (40, 1, false), (75, 1, false), (9, 1, false)], 64), 3);
        // Rows alone, and no rows.
        assert_eq!(rows(&[(40, 1, false), (75, 1, false)], 64), 2);
        assert_eq!(rows(&[(0, 100, false)], 64), 0);
        assert_eq!(rows(&[], 64), 0);
        // Only the trailing run: a one-token piece before a prompt chunk
        // stays with the prefill.
        assert_eq!(rows(&[(40, 1, false), (0, 100, false), (9, 1, false)], 64), 1);
        // A fresh sequence's one-token prompt (nothing to continue) and a
        // piece that takes a snapshot are not decode rows.
        assert_eq!(rows(&[(0, 100, false), (40, 1, false), (0, 1, false)], 64), 0);
        assert_eq!(rows(&[(0, 100, false), (40, 1, true), (9, 1, false)], 64), 1);
        // At most a decode batch: the rest stay with the prefill.
        assert_eq!(rows(&[(0, 10, false), (40, 1, false), (75, 1, false), (9, 1, false)], 2), 2);
        // Rows not on the pass's last rows (a layout this function does
        // not know) take the prefill path.
        let (mut p, t) = pass(&[(0, 10, false), (40, 1, false), (75, 1, false)]);
        p.swap(1, 2);
        assert_eq!(decode_rows(&p, t, 64), 0);
    }
}
