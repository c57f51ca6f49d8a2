//! `CudaBackend`: the model on an NVIDIA Hopper GPU behind
//! `lily_model::Backend`, so the engine and the server use it unchanged.
//! Also owns the device side of `decode_sample`: the per-sequence penalty
//! count tables (u32 [vocab], made on a sequence's first penalised draw and
//! freed with it) and the small per-call buffers of the sampling kernel.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use lily_core::weights::Weights;
use lily_core::ModelConfig;
use lily_model::{Backend, LogitsWanted, ModelError, ModelResult, SampleState, Sampled, SeqId};

use crate::device::{read_device, DeviceBuffer, Gpu};
use crate::dims::KV_BLOCK;
use crate::error::CudaResult;
use crate::model::Model;
use crate::sampling::{self, SampleRow};
use crate::state::Options;

pub struct CudaBackend {
    model: Model,
    config: ModelConfig,
    /// Penalty count tables of the sequences sampled with penalties.
    counts: HashMap<SeqId, DeviceBuffer>,
    /// SampleRow [max_batch], tokens u32 [max_batch], logprobs f32
    /// [max_batch]; made on the first `decode_sample`.
    sample_io: Option<DeviceBuffer>,
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
        Ok(CudaBackend { model, config: weights.config.clone(), counts: HashMap::new(), sample_io: None })
    }

    /// A backend of shape `cfg` with random weights made on the GPU (speed
    /// probes at the real shape without a checkpoint; outputs are noise).
    pub fn synthetic(gpu: &Arc<Gpu>, cfg: &ModelConfig, opts: Options, seed: u64) -> CudaResult<Self> {
        Ok(CudaBackend { model: Model::synthetic(gpu, cfg, opts, seed)?, config: cfg.clone(), counts: HashMap::new(), sample_io: None })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }
    pub fn model_mut(&mut self) -> &mut Model {
        &mut self.model
    }

    /// `decode_sample` on the device: the decode step, then `sample_rows`
    /// on the logits it left in scratch; only tokens and logprobs are read.
    fn sample_on_device(&mut self, batch: &[(SeqId, u32)], states: &mut [SampleState]) -> CudaResult<Vec<Sampled>> {
        let gpu = self.model.gpu.clone();
        gpu.bind()?;
        let vocab = self.model.dims.vocab;
        let n = batch.len();
        let mut rows = Vec::with_capacity(n);
        for ((seq, _), st) in batch.iter().zip(states.iter_mut()) {
            let counts = if st.params.has_penalties() {
                if st.device_copy() != Some(*seq) || !self.counts.contains_key(seq) {
                    if !self.counts.contains_key(seq) {
                        self.counts.insert(*seq, DeviceBuffer::zeroed(&gpu, vocab * 4, "sampling count table")?);
                    }
                    if let Some(buf) = self.counts.get(seq) {
                        buf.upload_sync_at(0, &st.dense_counts(vocab))?;
                    }
                    st.set_device_copy(Some(*seq));
                }
                self.counts.get(seq).map_or(0, |b| b.ptr())
            } else {
                // No table passed: the device copy (if any) misses this draw.
                st.set_device_copy(None);
                0
            };
            rows.push(SampleRow::new(&st.params, st.step, counts));
        }
        let row_bytes = std::mem::size_of::<SampleRow>();
        let need = n * (row_bytes + 8);
        if self.sample_io.as_ref().is_none_or(|b| b.bytes() < need) {
            let cap = n.max(self.model.mem.opts.max_batch);
            self.sample_io = Some(DeviceBuffer::zeroed(&gpu, cap * (row_bytes + 8), "sampling io")?);
        }
        let io = self.sample_io.as_ref().ok_or_else(|| crate::error::CudaError::Invalid("sampling buffers missing".into()))?;
        io.upload_sync_at(0, &rows)?;
        let (rows_at, tok_at, lp_at) = (io.ptr(), io.at(n * row_bytes)?, io.at(n * row_bytes + n * 4)?);
        self.model.decode_on_device(batch, &mut |m, first, cnt, logits| {
            sampling::sample_rows(
                &m.gpu,
                &m.kernels,
                logits,
                rows_at + (first * row_bytes) as u64,
                tok_at + (first * 4) as u64,
                lp_at + (first * 4) as u64,
                cnt,
                vocab,
            )
        })?;
        let tokens: Vec<u32> = read_device(&gpu, tok_at, n)?;
        let logprobs: Vec<f32> = read_device(&gpu, lp_at, n)?;
        let mut out = Vec::with_capacity(n);
        for ((st, token), logprob) in states.iter_mut().zip(tokens).zip(logprobs) {
            st.record_draw(token);
            out.push(Sampled { token, logprob, top: Vec::new() });
        }
        Ok(out)
    }
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
        }
    }
    fn fork(&mut self, seq: SeqId) -> ModelResult<SeqId> {
        self.model.gpu.bind().map_err(ModelError::from)?;
        if !self.model.mem.seqs.contains_key(&seq) {
            return Err(ModelError::UnknownSequence(seq));
        }
        Ok(self.model.mem.fork(seq)?)
    }
    fn seq_len(&self, seq: SeqId) -> ModelResult<usize> {
        self.model.mem.seqs.get(&seq).map(|s| s.len).ok_or(ModelError::UnknownSequence(seq))
    }
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], wanted: LogitsWanted) -> ModelResult<Vec<Vec<f32>>> {
        if !self.model.mem.seqs.contains_key(&seq) {
            return Err(ModelError::UnknownSequence(seq));
        }
        let (logits, _) = self.model.prefill(seq, tokens, wanted == LogitsWanted::All, true)?;
        Ok(logits)
    }
    fn decode(&mut self, batch: &[(SeqId, u32)]) -> ModelResult<Vec<Vec<f32>>> {
        for (s, _) in batch {
            if !self.model.mem.seqs.contains_key(s) {
                return Err(ModelError::UnknownSequence(*s));
            }
        }
        Ok(self.model.decode(batch)?)
    }
    fn prefill_greedy(&mut self, seq: SeqId, tokens: &[u32]) -> ModelResult<u32> {
        if !self.model.mem.seqs.contains_key(&seq) {
            return Err(ModelError::UnknownSequence(seq));
        }
        Ok(self.model.prefill(seq, tokens, false, false)?.1)
    }
    fn decode_greedy(&mut self, seq: SeqId, first: u32, steps: usize) -> ModelResult<Vec<u32>> {
        if !self.model.mem.seqs.contains_key(&seq) {
            return Err(ModelError::UnknownSequence(seq));
        }
        Ok(self.model.decode_greedy(seq, first, steps)?)
    }
    fn decode_sample(&mut self, batch: &[(SeqId, u32)], states: &mut [SampleState]) -> ModelResult<Vec<Sampled>> {
        if states.len() != batch.len() {
            return Err(ModelError::Invalid(format!("{} sampling states for a batch of {}", states.len(), batch.len())));
        }
        for (s, _) in batch {
            if !self.model.mem.seqs.contains_key(s) {
                return Err(ModelError::UnknownSequence(*s));
            }
        }
        // `sample_rows` does not limit the vocabulary or report
        // alternatives yet: such draws take the host math on copied logits
        // (the device count tables then miss them, so they upload again).
        let vocab = self.model.dims.vocab;
        if states.iter().any(|s| s.params.top_logprobs > 0 || s.params.row_len(vocab) < vocab) {
            let logits = self.decode(batch)?;
            return Ok(logits
                .iter()
                .zip(states.iter_mut())
                .map(|(l, s)| {
                    s.set_device_copy(None);
                    lily_model::sample::sample_host(l, s)
                })
                .collect());
        }
        Ok(self.sample_on_device(batch, states)?)
    }
    fn memory_in_use(&self) -> Option<u64> {
        Some(self.model.gpu.allocated())
    }
    fn kv_room(&self) -> Option<lily_model::KvRoom> {
        let mem = &self.model.mem;
        Some(lily_model::KvRoom {
            free_tokens: mem.free_block_count() * KV_BLOCK,
            total_tokens: mem.num_blocks * KV_BLOCK,
            block_tokens: KV_BLOCK,
        })
    }
}
