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
use crate::error::{CudaError, CudaResult};
use crate::model::Model;
use crate::sampling::{self, SampleOut, SampleRow, SAMPLE_TOP_MAX};
use crate::state::Options;

pub struct CudaBackend {
    model: Model,
    config: ModelConfig,
    /// Penalty count tables of the sequences sampled with penalties.
    counts: HashMap<SeqId, DeviceBuffer>,
    /// SampleRow [max_batch], then tokens u32, logprobs f32, top ids u32
    /// [SAMPLE_TOP_MAX] and top logprobs f32 [SAMPLE_TOP_MAX] per row;
    /// made on the first `decode_sample`.
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
    /// on the logits it left in scratch. One download brings the tokens and
    /// logprobs back, and the top logprobs too when any row asked for them.
    fn sample_on_device(&mut self, batch: &[(SeqId, u32)], states: &mut [SampleState]) -> CudaResult<Vec<Sampled>> {
        let gpu = self.model.gpu.clone();
        gpu.bind()?;
        let vocab = self.model.dims.vocab;
        let n = batch.len();
        if let Some(st) = states.iter().find(|st| st.params.top_logprobs as usize > SAMPLE_TOP_MAX) {
            return Err(CudaError::Invalid(format!("top_logprobs {}: the device sampler reports at most {SAMPLE_TOP_MAX}", st.params.top_logprobs)));
        }
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
        // Layout of the io buffer for this call: SampleRow [n], then the
        // outputs read back, contiguous: tokens u32 [n], logprobs f32 [n],
        // top ids u32 [n][SAMPLE_TOP_MAX], top logprobs f32 [n][SAMPLE_TOP_MAX].
        let row_bytes = std::mem::size_of::<SampleRow>();
        let per_row = row_bytes + 8 + 8 * SAMPLE_TOP_MAX;
        if self.sample_io.as_ref().is_none_or(|b| b.bytes() < n * per_row) {
            let cap = n.max(self.model.mem.opts.max_batch);
            self.sample_io = Some(DeviceBuffer::zeroed(&gpu, cap * per_row, "sampling io")?);
        }
        let io = self.sample_io.as_ref().ok_or_else(|| CudaError::Invalid("sampling buffers missing".into()))?;
        io.upload_sync_at(0, &rows)?;
        let outputs = io.at(n * row_bytes)?;
        let out = SampleOut {
            tokens: outputs,
            logprobs: outputs + (n * 4) as u64,
            top_ids: outputs + (n * 8) as u64,
            top_logprobs: outputs + (n * (8 + 4 * SAMPLE_TOP_MAX)) as u64,
        };
        let rows_at = io.ptr();
        self.model.decode_on_device(batch, &mut |m, first, cnt, logits| {
            sampling::sample_rows(&m.gpu, &m.kernels, logits, rows_at + (first * row_bytes) as u64, &out.from_row(first), cnt, vocab)
        })?;
        // Words: tokens, logprob bits, and (only when asked) the top arrays.
        let tops = states.iter().any(|st| st.params.top_logprobs > 0);
        let words: Vec<u32> = read_device(&gpu, outputs, if tops { n * (2 + 2 * SAMPLE_TOP_MAX) } else { 2 * n })?;
        let mut result = Vec::with_capacity(n);
        for (r, st) in states.iter_mut().enumerate() {
            let token = words[r];
            let logprob = f32::from_bits(words[n + r]);
            let mut top = Vec::new();
            if tops {
                let ids = &words[2 * n + r * SAMPLE_TOP_MAX..][..st.params.top_logprobs as usize];
                let lps = &words[2 * n + n * SAMPLE_TOP_MAX + r * SAMPLE_TOP_MAX..][..st.params.top_logprobs as usize];
                // u32::MAX marks slots beyond a row shorter than the ask.
                top = ids.iter().zip(lps).take_while(|(&id, _)| id != u32::MAX).map(|(&id, &lp)| (id, f32::from_bits(lp))).collect();
            }
            st.record_draw(token);
            result.push(Sampled { token, logprob, top });
        }
        Ok(result)
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
    fn prefill_batch(&mut self, parts: &[(SeqId, &[u32])]) -> ModelResult<Vec<Vec<f32>>> {
        for (s, _) in parts {
            if !self.model.mem.seqs.contains_key(s) {
                return Err(ModelError::UnknownSequence(*s));
            }
        }
        Ok(self.model.prefill_batch(parts)?)
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
    fn decode_greedy_batch(&mut self, batch: &[(SeqId, u32)], steps: usize) -> ModelResult<Vec<Vec<u32>>> {
        for (s, _) in batch {
            if !self.model.mem.seqs.contains_key(s) {
                return Err(ModelError::UnknownSequence(*s));
            }
        }
        Ok(self.model.decode_greedy_batch(batch, steps)?)
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
        Ok(self.sample_on_device(batch, states)?)
    }
    fn memory_in_use(&self) -> Option<u64> {
        Some(self.model.gpu.allocated())
    }
    fn kv_room(&self) -> Option<lily_model::KvRoom> {
        let mem = &self.model.mem;
        Some(lily_model::KvRoom { free_tokens: mem.free_block_count() * KV_BLOCK, total_tokens: mem.num_blocks * KV_BLOCK, block_tokens: KV_BLOCK })
    }
}
