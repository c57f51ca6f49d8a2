//! `CudaBackend`: the model on an NVIDIA Hopper GPU behind
//! `lily_model::Backend`, so the engine and the server use it unchanged.
//! Also owns the device side of sampled decode steps: the per-sequence
//! penalty count tables (u32 [vocab], made on a sequence's first penalised
//! draw and freed with it) and the pipeline of `submit_decode` /
//! `collect_decode`, through which `decode_sample` runs too.
//!
//! A step is queued without waiting for the host or for the step before
//! it: its inputs (sampling rows, tokens, positions, state slots, which
//! rows take their previous draw, new KV block-table entries) go up in one
//! async copy from page-locked memory (runahead.rs); `feed_stage` puts
//! them in the decode scratch, a `Feed::Previous` row's token taken from
//! the device table of last draws; the decode step and `sample_rows`
//! (which also counts the drawn token in the row's count table, so the
//! table stays exact across steps in flight, and keeps the draws as the
//! last draws) follow, all three one cached CUDA graph a batch size
//! (`Model::run_served_step`); one async copy brings the outputs back into
//! page-locked memory, and an event marks the step done.
//! `collect_decode` waits for that event only. The one wait left at
//! submit: a sequence's count table is made and uploaded from its state
//! (synchronously) on its first penalised draw, or when the state no
//! longer matches the table.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;

use lily_core::weights::Weights;
use lily_core::ModelConfig;
use lily_model::{Backend, Feed, InFlight, LogitsWanted, MixedSteps, ModelError, ModelResult, SampleState, Sampled, SeqId, MAX_IN_FLIGHT};

use crate::device::{copy_device, DeviceBuffer, Gpu};
use crate::dims::KV_BLOCK;
use crate::error::{CudaError, CudaResult, DriverContext};
use crate::feed::{self, FeedStageParams};
use crate::model::{Head, Model, ServedStep};
use crate::runahead::{put, InLayout, StepIo, IO_SLOTS};
use crate::sampling::{self, OutLayout, SampleRow, SAMPLE_TOP_MAX};
use crate::state::{DecodeMatrices, Options};

pub struct CudaBackend {
    model: Model,
    config: ModelConfig,
    /// Penalty count tables of the sequences sampled with penalties.
    counts: HashMap<SeqId, DeviceBuffer>,
    /// The step slots and the last-draw table; made on the first sampled
    /// step.
    io: Option<StepIo>,
    /// Steps submitted and not collected, oldest first.
    pending: VecDeque<Pending>,
    /// Sequences whose last draw is in the device table (a sampled step
    /// was the last thing fed to them): those `Feed::Previous` may feed.
    device_draws: HashSet<SeqId>,
    next_ticket: u64,
    /// `split_steps`: each collected step's parts in microseconds of GPU
    /// time (None: not measured).
    split: Option<Vec<[f64; SPLIT_PARTS.len()]>>,
}

/// The parts of a sampled step that `split_steps` times, between events
/// recorded in the stream: the input upload, feed_stage, the decode graph,
/// the sampler (which also keeps the draws), for the first group of rows.
pub const SPLIT_PARTS: [&str; 4] = ["upload", "stage", "graph", "sample"];

/// A queued sampled step: its ticket, its step slot, and what reading its
/// outputs needs.
struct Pending {
    ticket: u64,
    slot: usize,
    seqs: Vec<SeqId>,
    /// Each row's top_logprobs at submit.
    asks: Vec<u32>,
    /// Whether the top arrays were written and downloaded.
    tops: bool,
    /// `split_steps`' events around the step's parts (empty when off).
    marks: Vec<CudaEvent>,
}

impl CudaBackend {
    /// Loads the checkpoint in `dir` onto GPU 0. `progress(done, total)`
    /// reports bytes of weights uploaded.
    pub fn open(dir: &Path, opts: Options, progress: &mut dyn FnMut(u64, u64)) -> CudaResult<Self> {
        let gpu = Gpu::open(0)?;
        let weights = Weights::load(dir)?;
        Self::from_weights(&gpu, &weights, opts, progress)
    }

    /// Uploads already loaded weights (tests share one `Weights` between the
    /// CPU reference and the GPU).
    pub fn from_weights(gpu: &Arc<Gpu>, weights: &Weights, opts: Options, progress: &mut dyn FnMut(u64, u64)) -> CudaResult<Self> {
        let model = Model::new(gpu, weights, opts, progress)?;
        Ok(Self::around(model, weights.config.clone()))
    }

    /// A backend of shape `cfg` with random weights made on the GPU (speed
    /// probes at the real shape without a checkpoint; outputs are noise).
    pub fn synthetic(gpu: &Arc<Gpu>, cfg: &ModelConfig, opts: Options, seed: u64) -> CudaResult<Self> {
        Ok(Self::around(Model::synthetic(gpu, cfg, opts, seed)?, cfg.clone()))
    }

    fn around(model: Model, config: ModelConfig) -> Self {
        CudaBackend { model, config, counts: HashMap::new(), io: None, pending: VecDeque::new(), device_draws: HashSet::new(), next_ticket: 1, split: None }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }
    pub fn model_mut(&mut self) -> &mut Model {
        &mut self.model
    }

    /// Steps submitted and not collected yet.
    pub fn steps_in_flight(&self) -> usize {
        self.pending.len()
    }

    fn known(&self, seqs: impl Iterator<Item = SeqId>) -> ModelResult<()> {
        for s in seqs {
            if !self.model.mem.seqs.contains_key(&s) {
                return Err(ModelError::UnknownSequence(s));
            }
        }
        Ok(())
    }

    fn in_flight(&self, seq: SeqId) -> bool {
        self.pending.iter().any(|p| p.seqs.contains(&seq))
    }

    /// Whether `st`'s draws need the count table of `seq` made or uploaded
    /// again from the state before this step.
    fn table_stale(&self, seq: SeqId, st: &SampleState) -> bool {
        st.params.has_penalties() && (st.device_copy() != Some(seq) || !self.counts.contains_key(&seq))
    }

    /// Makes the step buffers on first use (sized for every sequence the
    /// backend holds; their addresses never change after, which the cached
    /// served-step graphs rely on).
    fn step_io(&mut self) -> CudaResult<()> {
        if self.io.is_none() {
            let seqs = self.model.mem.opts.max_sequences;
            self.io = Some(StepIo::new(&self.model.gpu, seqs, seqs)?);
        }
        Ok(())
    }

    /// Queues one sampled step (see the file comment) in a free step slot.
    /// Every check and every reservation comes before anything is queued:
    /// on an error no state has advanced and no sequence has moved (a
    /// count table may have been made from its state).
    fn launch(&mut self, batch: &[(SeqId, Feed)], states: &mut [SampleState]) -> CudaResult<Pending> {
        let gpu = self.model.gpu.clone();
        gpu.bind()?;
        let n = batch.len();
        for (i, (&(seq, feed), st)) in batch.iter().zip(states.iter()).enumerate() {
            if batch[..i].iter().any(|b| b.0 == seq) {
                return Err(CudaError::Invalid(format!("sequence {seq:?} appears twice in one decode batch")));
            }
            if st.params.top_logprobs as usize > SAMPLE_TOP_MAX {
                return Err(CudaError::Invalid(format!("top_logprobs {}: the device sampler reports at most {SAMPLE_TOP_MAX}", st.params.top_logprobs)));
            }
            match feed {
                Feed::Token(t) => self.model.check_tokens(&[t])?,
                Feed::Previous if !self.device_draws.contains(&seq) => {
                    return Err(CudaError::Invalid(format!("{seq:?} is fed its previous draw, but its last input was not a sampled step of this backend")));
                }
                Feed::Previous => {}
            }
            // The device table already counts the draws in flight and the
            // state does not yet: rebuilding it from the state would lose them.
            if self.table_stale(seq, st) && self.in_flight(seq) {
                return Err(CudaError::Invalid(format!(
                    "{seq:?}: its penalty counts must be uploaded from a state that does not match the device table while a step of it is in flight; collect that step first"
                )));
            }
        }
        let busy: Vec<usize> = self.pending.iter().map(|p| p.slot).collect();
        let slot = (0..IO_SLOTS).find(|k| !busy.contains(k)).ok_or_else(|| CudaError::Invalid(format!("all {IO_SLOTS} step slots are in use")))?;
        self.step_io()?;
        let rows_cap = self.io.as_ref().map_or(0, |io| io.rows);
        if n > rows_cap {
            return Err(CudaError::Invalid(format!("decode step of {n} sequences; this backend holds at most {rows_cap}")));
        }
        let mut tables = Vec::with_capacity(n);
        for (&(seq, _), st) in batch.iter().zip(states.iter_mut()) {
            tables.push(self.count_table(seq, st)?);
        }
        let seqs: Vec<SeqId> = batch.iter().map(|b| b.0).collect();
        let entries = self.model.mem.reserve_next_deferred(&seqs)?;
        let tops = states.iter().any(|st| st.params.top_logprobs > 0);
        let marks = match self.queue_step(slot, batch, states, &tables, &entries, tops) {
            Ok(marks) => marks,
            Err(e) => {
                // Whatever was queued finishes before the slot's host buffers
                // are written again, and the step may not have written its
                // block-table entries.
                let _ = gpu.synchronize();
                let _ = self.model.mem.write_block_entries(&entries);
                return Err(e);
            }
        };
        for (seq, st) in seqs.iter().zip(states.iter_mut()) {
            st.begin_draw();
            if !st.params.has_penalties() {
                // No table was passed: a device copy (if any) misses this draw.
                st.set_device_copy(None);
            }
            if let Some(s) = self.model.mem.seqs.get_mut(seq) {
                s.len += 1;
            }
            self.device_draws.insert(*seq);
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        Ok(Pending { ticket, slot, seqs, asks: states.iter().map(|st| st.params.top_logprobs).collect(), tops, marks })
    }

    /// The device address of `seq`'s penalty count table for a draw with
    /// `st`, or 0 when its parameters have no penalties; the table is made
    /// and uploaded from the state (synchronously) when the device copy
    /// does not match it.
    fn count_table(&mut self, seq: SeqId, st: &mut SampleState) -> CudaResult<u64> {
        if !st.params.has_penalties() {
            return Ok(0);
        }
        if self.table_stale(seq, st) {
            let vocab = self.model.dims.vocab;
            let buf = match self.counts.entry(seq) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(DeviceBuffer::zeroed(&self.model.gpu, vocab * 4, "sampling count table")?),
            };
            buf.upload_sync_at(0, &st.dense_counts(vocab))?;
            st.set_device_copy(Some(seq));
        }
        Ok(self.counts.get(&seq).map_or(0, |b| b.ptr()))
    }

    /// Stages and launches one checked and reserved step in step slot
    /// `slot`: one upload, then `feed_stage`, the decode step and
    /// `sample_rows` (the draws kept as the last draws) as one cached graph
    /// (`Model::run_served_step`), then the download of the outputs into
    /// the slot's host buffer and the slot's event. No host wait. A step of
    /// more than `max_batch` rows, or one timed by parts (`split_steps`),
    /// runs them as separate launches per group of `max_batch` rows, the
    /// step itself still through its own graph.
    /// Returns `split_steps`' events (none when it is off).
    fn queue_step(
        &mut self,
        slot: usize,
        batch: &[(SeqId, Feed)],
        states: &[SampleState],
        tables: &[u64],
        entries: &[(i32, i32)],
        tops: bool,
    ) -> CudaResult<Vec<CudaEvent>> {
        let n = batch.len();
        let gpu = self.model.gpu.clone();
        let mut marks = Vec::new();
        let timed = self.split.is_some();
        let mark = |marks: &mut Vec<CudaEvent>| -> CudaResult<()> {
            if timed {
                let e = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ctx("cuEventCreate (step split)")?;
                e.record(&gpu.stream).ctx("cuEventRecord (step split)")?;
                marks.push(e);
            }
            Ok(())
        };
        let layout = InLayout::new(n);
        if entries.len() > n {
            return Err(CudaError::Invalid(format!("{} new block-table entries for a step of {n} sequences (at most one each)", entries.len())));
        }
        let mut rows = Vec::with_capacity(n);
        let mut tokens = Vec::with_capacity(n);
        let mut pos = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        let mut prev = Vec::with_capacity(n);
        for ((&(seq, feed), st), &table) in batch.iter().zip(states).zip(tables) {
            let sq = self.model.mem.seq(seq)?;
            rows.push(SampleRow::new(&st.params, st.step, table));
            let (t, p) = match feed {
                Feed::Token(t) => (t, 0u32),
                Feed::Previous => (0, 1),
            };
            tokens.push(t);
            prev.push(p);
            pos.push(sq.len as i32);
            slots.push(sq.slot as i32);
        }
        let bt_at: Vec<i32> = entries.iter().map(|e| e.0).collect();
        let bt_block: Vec<i32> = entries.iter().map(|e| e.1).collect();
        let io = self.io.as_mut().ok_or_else(|| CudaError::Invalid("step buffers missing".into()))?;
        let buf = io.host_in(slot)?;
        put(buf, layout.rows, &rows)?;
        put(buf, layout.tokens, &tokens)?;
        put(buf, layout.pos, &pos)?;
        put(buf, layout.slot, &slots)?;
        put(buf, layout.prev, &prev)?;
        put(buf, layout.bt_at, &bt_at)?;
        put(buf, layout.bt_block, &bt_block)?;
        put(buf, layout.bt_count, &[entries.len() as i32])?;
        put(buf, layout.bt_none, &[0i32])?;
        mark(&mut marks)?;
        io.upload(slot, layout.bytes)?;
        mark(&mut marks)?;
        let out = io.dev_out(n, tops)?;
        let model = &mut self.model;
        let s = model.mem.scratch;
        let group = model.mem.opts.max_batch;
        let vocab = model.dims.vocab;
        let block_table = model.mem.block_table.ptr();
        let at = |off: usize, first: usize, bytes: usize| io.dev_in(off + first * bytes);
        let feed_at = |first: usize, cnt: usize| feed_params(io, &layout, first, cnt, s.tokens, s.pos, s.slot, block_table);
        if n <= group && !timed {
            model.run_served_step(n, &served_step(io, model, n, tops)?)?;
        } else {
            for first in (0..n).step_by(group) {
                let cnt = group.min(n - first);
                let p = feed_at(first, cnt)?;
                let timed_group = |marks: &mut Vec<CudaEvent>| if first == 0 { mark(marks) } else { Ok(()) };
                feed::stage(&gpu, &model.kernels, &p)?;
                timed_group(&mut marks)?;
                model.run_step(cnt, Head::Logits)?;
                timed_group(&mut marks)?;
                let rows_at = at(layout.rows, first, std::mem::size_of::<SampleRow>())?;
                let o = out.from_row(first);
                let keep = sampling::KeepDraws { slots: p.in_slot, last: io.last.ptr() };
                sampling::sample_rows_keeping(&gpu, &model.kernels, s.logits, rows_at, &o, keep, cnt, vocab)?;
                timed_group(&mut marks)?;
            }
        }
        io.download(slot, n, tops)?;
        Ok(marks)
    }

    /// Waits for a queued step and reads its draws; each state records its
    /// draw (`end_draw`).
    fn land(&mut self, p: Pending, states: &mut [SampleState]) -> CudaResult<Vec<Sampled>> {
        let io = self.io.as_ref().ok_or_else(|| CudaError::Invalid("step buffers missing".into()))?;
        let buf = io.host_out(p.slot)?;
        if let (Some(split), true) = (self.split.as_mut(), p.marks.len() == SPLIT_PARTS.len() + 1) {
            let mut us = [0.0; SPLIT_PARTS.len()];
            for (t, w) in us.iter_mut().zip(p.marks.windows(2)) {
                *t = 1e3 * w[0].elapsed_ms(&w[1]).ctx("cuEventElapsedTime (step split)")? as f64;
            }
            split.push(us);
        }
        let n = p.seqs.len();
        if states.len() != n {
            return Err(CudaError::Invalid(format!("{} sampling states to collect a step of {n}", states.len())));
        }
        let l = OutLayout::new(n);
        let mut draws = Vec::with_capacity(n);
        for (r, st) in states.iter_mut().enumerate() {
            let d = l.draw(buf, r, p.asks[r] as usize, p.tops)?;
            st.end_draw(d.token);
            draws.push(d);
        }
        Ok(draws)
    }

    /// Starts (or stops, dropping what was kept) timing each sampled
    /// step's parts (`SPLIT_PARTS`) with events in the stream: a
    /// measurement (`bench --served --split`); the events themselves add a
    /// little to each step.
    pub fn split_steps(&mut self, on: bool) {
        self.split = on.then(Vec::new);
    }

    /// The parts of the steps collected since `split_steps(true)` (or the
    /// last call), in microseconds of GPU time, `SPLIT_PARTS` order.
    pub fn take_step_split(&mut self) -> Vec<[f64; SPLIT_PARTS.len()]> {
        self.split.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Something other than a sampled step was fed to these sequences: the
    /// device's last draw is no longer their input.
    fn forget_draws(&mut self, seqs: impl Iterator<Item = SeqId>) {
        for s in seqs {
            self.device_draws.remove(&s);
        }
    }

    /// Runs a batched prefill of `seqs` (`run`, on the model) once they are
    /// all known. As after `prefill`, a prefilled sequence's last input is
    /// no draw, unless the batch was refused before anything ran
    /// (`Capacity`, `Invalid`).
    fn prefill_parts<T>(&mut self, seqs: impl Iterator<Item = SeqId> + Clone, run: impl FnOnce(&mut Model) -> CudaResult<T>) -> ModelResult<T> {
        self.known(seqs.clone())?;
        let r = run(&mut self.model);
        if !matches!(r, Err(CudaError::Capacity(_) | CudaError::Invalid(_))) {
            self.forget_draws(seqs);
        }
        Ok(r?)
    }
}

/// `feed_stage`'s parameters for rows `first..first + cnt` of a step
/// staged in `io` with `layout`; only the first group writes the step's
/// block-table entries (the others read the zero count `bt_none`).
#[allow(clippy::too_many_arguments)]
fn feed_params(io: &StepIo, layout: &InLayout, first: usize, cnt: usize, tokens: u64, pos: u64, slots: u64, block_table: u64) -> CudaResult<FeedStageParams> {
    let at = |off: usize, bytes: usize| io.dev_in(off + first * bytes);
    let count = if first == 0 { layout.bt_count } else { layout.bt_none };
    Ok(FeedStageParams {
        in_tokens: at(layout.tokens, 4)?,
        in_pos: at(layout.pos, 4)?,
        in_slot: at(layout.slot, 4)?,
        in_prev: at(layout.prev, 4)?,
        bt_at: io.dev_in(layout.bt_at)?,
        bt_block: io.dev_in(layout.bt_block)?,
        n_bt: io.dev_in(count)?,
        last: io.last.ptr(),
        tokens,
        pos,
        slots,
        block_table,
        n: cnt as i32,
    })
}

/// What a served step of `n` sequences (one group) hands the model
/// (`Model::run_served_step`): the same for every step of that size, so
/// its graph is captured once.
fn served_step(io: &StepIo, model: &Model, n: usize, tops: bool) -> CudaResult<ServedStep> {
    let s = model.mem.scratch;
    let layout = InLayout::new(n);
    let feed = feed_params(io, &layout, 0, n, s.tokens, s.pos, s.slot, model.mem.block_table.ptr())?;
    Ok(ServedStep { feed, rows: io.dev_in(layout.rows)?, out: io.dev_out(n, tops)?, keep: sampling::KeepDraws { slots: feed.in_slot, last: io.last.ptr() } })
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:0 {}", self.model.gpu.name)
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn max_seq_len(&self) -> usize {
        self.model.mem.opts.max_seq_len
    }
    fn max_sequences(&self) -> usize {
        self.model.mem.opts.max_sequences
    }
    fn alloc(&mut self) -> ModelResult<SeqId> {
        self.model.gpu.bind().map_err(ModelError::from)?;
        Ok(self.model.mem.alloc()?)
    }
    fn free(&mut self, seq: SeqId) {
        if self.model.gpu.bind().is_ok() {
            self.model.mem.free(seq);
            self.counts.remove(&seq);
            self.device_draws.remove(&seq);
        }
    }
    fn fork(&mut self, seq: SeqId) -> ModelResult<SeqId> {
        self.model.gpu.bind().map_err(ModelError::from)?;
        self.known(std::iter::once(seq))?;
        let child = self.model.mem.fork(seq)?;
        // The copy's last input is the parent's last draw (in flight or
        // not): copied on the stream, after the step that draws it.
        if let (true, Some(io)) = (self.device_draws.contains(&seq), self.io.as_ref()) {
            let mem = &self.model.mem;
            let (from, to) = (mem.seq(seq)?.slot, mem.seq(child)?.slot);
            let copied = copy_device(&self.model.gpu, io.last.ptr() + (to * 4) as u64, io.last.ptr() + (from * 4) as u64, 4);
            if let Err(e) = copied {
                self.model.mem.free(child);
                return Err(e.into());
            }
            self.device_draws.insert(child);
        }
        Ok(child)
    }
    fn seq_len(&self, seq: SeqId) -> ModelResult<usize> {
        self.model.mem.seqs.get(&seq).map(|s| s.len).ok_or(ModelError::UnknownSequence(seq))
    }
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], wanted: LogitsWanted) -> ModelResult<Vec<Vec<f32>>> {
        self.known(std::iter::once(seq))?;
        self.forget_draws(std::iter::once(seq));
        let (logits, _) = self.model.prefill(seq, tokens, wanted == LogitsWanted::All, true)?;
        Ok(logits)
    }
    fn prefill_batch(&mut self, parts: &[(SeqId, &[u32])]) -> ModelResult<Vec<Vec<f32>>> {
        self.prefill_parts(parts.iter().map(|p| p.0), |m| m.prefill_batch(parts))
    }
    fn prefill_capture(&mut self, parts: &[lily_model::CapturePart]) -> ModelResult<lily_model::Captured> {
        // One pass when the points allow it; otherwise prefixes, forks and
        // the rest (the trait's default).
        if parts.iter().all(|p| p.2.is_none()) || !self.model.captures_in_one_pass(parts) {
            return lily_model::prefill_capture_split(self, parts);
        }
        Ok(self.prefill_parts(parts.iter().map(|p| p.0), |m| m.prefill_capture(parts, &vec![None; parts.len()]))?.0)
    }
    /// The first tokens drawn by the device sampler right after the pass
    /// (`Model::last_rows`): no logits read back, no host draw. Declined
    /// (drawn by the caller) where the captures need more than one pass,
    /// and for a state asking more than `SAMPLE_TOP_MAX` top logprobs.
    fn prefill_capture_sampling(&mut self, parts: &[lily_model::CapturePart], states: &mut [Option<SampleState>]) -> ModelResult<lily_model::CapturedDraws> {
        if states.len() != parts.len() {
            return Err(ModelError::Invalid(format!("{} sampling states for a prefill of {} parts", states.len(), parts.len())));
        }
        if states.iter().all(Option::is_none) || (parts.iter().any(|p| p.2.is_some()) && !self.model.captures_in_one_pass(parts)) {
            return Ok((self.prefill_capture(parts)?, vec![None; parts.len()]));
        }
        // Known before their count tables are made below.
        self.known(parts.iter().map(|p| p.0))?;
        self.model.gpu.bind()?;
        let mut rows = Vec::with_capacity(parts.len());
        for (p, st) in parts.iter().zip(states.iter_mut()) {
            rows.push(match st {
                Some(st) if st.params.top_logprobs as usize <= SAMPLE_TOP_MAX => {
                    let table = self.count_table(p.0, st)?;
                    Some(SampleRow::new(&st.params, st.step, table))
                }
                _ => None,
            });
        }
        let (captured, drawn) = self.prefill_parts(parts.iter().map(|p| p.0), |m| m.prefill_capture(parts, &rows))?;
        for (d, st) in drawn.iter().zip(states.iter_mut()) {
            if let (Some(d), Some(st)) = (d, st) {
                // The sampler counted the draw in the table it was given.
                st.record_draw(d.token);
                if !st.params.has_penalties() {
                    st.set_device_copy(None);
                }
            }
        }
        Ok((captured, drawn))
    }
    fn decode(&mut self, batch: &[(SeqId, u32)]) -> ModelResult<Vec<Vec<f32>>> {
        self.known(batch.iter().map(|b| b.0))?;
        self.forget_draws(batch.iter().map(|b| b.0));
        Ok(self.model.decode(batch)?)
    }
    fn prefill_greedy(&mut self, seq: SeqId, tokens: &[u32]) -> ModelResult<u32> {
        self.known(std::iter::once(seq))?;
        self.forget_draws(std::iter::once(seq));
        Ok(self.model.prefill(seq, tokens, false, false)?.1)
    }
    fn decode_greedy(&mut self, seq: SeqId, first: u32, steps: usize) -> ModelResult<Vec<u32>> {
        self.known(std::iter::once(seq))?;
        self.forget_draws(std::iter::once(seq));
        Ok(self.model.decode_greedy(seq, first, steps)?)
    }
    fn decode_greedy_batch(&mut self, batch: &[(SeqId, u32)], steps: usize) -> ModelResult<Vec<Vec<u32>>> {
        self.known(batch.iter().map(|b| b.0))?;
        self.forget_draws(batch.iter().map(|b| b.0));
        Ok(self.model.decode_greedy_batch(batch, steps)?)
    }
    fn decode_sample(&mut self, batch: &[(SeqId, u32)], states: &mut [SampleState]) -> ModelResult<Vec<Sampled>> {
        if states.len() != batch.len() {
            return Err(ModelError::Invalid(format!("{} sampling states for a batch of {}", states.len(), batch.len())));
        }
        self.known(batch.iter().map(|b| b.0))?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        // A step of its own, collected at once (a free step slot exists
        // whatever is in flight); it does not count as in flight.
        let feeds: Vec<(SeqId, Feed)> = batch.iter().map(|&(s, t)| (s, Feed::Token(t))).collect();
        let step = self.launch(&feeds, states)?;
        Ok(self.land(step, states)?)
    }
    fn submit_decode(&mut self, batch: &[(SeqId, Feed)], states: &mut [SampleState]) -> ModelResult<InFlight> {
        if states.len() != batch.len() {
            return Err(ModelError::Invalid(format!("{} sampling states for a batch of {}", states.len(), batch.len())));
        }
        if self.pending.len() >= MAX_IN_FLIGHT {
            return Err(ModelError::Invalid(format!("{} decode steps are in flight already (at most {MAX_IN_FLIGHT}); collect one first", self.pending.len())));
        }
        self.known(batch.iter().map(|b| b.0))?;
        if batch.is_empty() {
            return Ok(InFlight::Ready(Vec::new()));
        }
        let step = self.launch(batch, states)?;
        let (ticket, len) = (step.ticket, step.seqs.len());
        self.pending.push_back(step);
        Ok(InFlight::Device { ticket, len })
    }
    fn collect_decode(&mut self, step: InFlight, states: &mut [SampleState]) -> ModelResult<Vec<Sampled>> {
        let (ticket, len) = match step {
            InFlight::Ready(draws) if draws.len() == states.len() => return Ok(draws),
            InFlight::Ready(draws) => return Err(ModelError::Invalid(format!("{} sampling states to collect a step of {}", states.len(), draws.len()))),
            InFlight::Device { ticket, len } => (ticket, len),
        };
        match self.pending.front() {
            None => return Err(ModelError::Invalid(format!("step {ticket} collected, but no step is in flight"))),
            Some(p) if p.ticket != ticket || p.seqs.len() != len => {
                return Err(ModelError::Invalid(format!(
                    "step {ticket} of {len} collected out of order: the oldest in flight is step {} of {}",
                    p.ticket,
                    p.seqs.len()
                )))
            }
            Some(_) => {}
        }
        self.model.gpu.bind().map_err(ModelError::from)?;
        let p = self.pending.pop_front().ok_or_else(|| ModelError::Invalid("no step in flight".into()))?;
        Ok(self.land(p, states)?)
    }
    /// 2,048: measured on the H200 (docs/perf/2026-12-01-h200-serving.md), a
    /// 256-token prompt prefills in ~31 ms alone, one pass of 1,024 tokens in
    /// ~60 ms; 64 streaming clients got 1,856 tok/s with 2,048 against 1,572
    /// with 512, TTFT p99 1.5 s against 2.6 s (ITL p99 179 ms against 88).
    fn preferred_prefill_chunk(&self) -> Option<usize> {
        Some(2048)
    }
    /// Captures the served-step graph of every batch size up to
    /// `max_batch` (as far as the backend holds; without top logprobs), so
    /// that no step pays for its size's capture (~400 launches recorded
    /// and instantiated) while every running stream waits.
    fn prepare_decode(&mut self, max_batch: usize) -> ModelResult<usize> {
        if !self.model.mem.opts.use_graphs {
            return Ok(0);
        }
        self.model.gpu.bind().map_err(ModelError::from)?;
        self.step_io()?;
        let io = self.io.as_ref().ok_or_else(|| ModelError::Invalid("step buffers missing".into()))?;
        let sizes = max_batch.min(io.rows).min(self.model.mem.opts.max_batch);
        for n in 1..=sizes {
            let served = served_step(io, &self.model, n, false)?;
            self.model.prepare_served_step(n, &served)?;
        }
        Ok(sizes)
    }
    /// Decode rows in a prefill pass run the pass's matrices (the prefill
    /// path's fp16 GEMMs, ~1e-4 from the decode kernels' exact ones) and
    /// the decode kernels' mixer (`Model`'s `decode_rows`), so a stream's
    /// logits move by that much against its decode steps': never under
    /// `--batch-invariant`, nor for more rows than a decode step takes
    /// (`max_batch`, the decode mixer's scratch). Otherwise the pass saves
    /// a whole decode step's weight reads for a few more matrix rows, and
    /// it pays on the H200 (docs/perf/2026-12-05-h200-s44.md): 64 clients
    /// 3,960 -> 4,130 tok/s, TTFT p50 195 -> 170 ms; 8 clients arriving at
    /// random 1,493 -> 1,578 tok/s.
    fn mixed_steps(&self, rows: usize) -> MixedSteps {
        if self.model.mem.opts.decode_matrices == DecodeMatrices::BATCH_INVARIANT || rows > self.model.mem.opts.max_batch {
            MixedSteps::Never
        } else {
            MixedSteps::Pays
        }
    }
    fn memory_in_use(&self) -> Option<u64> {
        Some(self.model.gpu.allocated())
    }
    fn kv_room(&self) -> Option<lily_model::KvRoom> {
        let mem = &self.model.mem;
        Some(lily_model::KvRoom { free_tokens: mem.free_block_count() * KV_BLOCK, total_tokens: mem.num_blocks * KV_BLOCK, block_tokens: KV_BLOCK })
    }
}
