//! `CudaBackend`: the model on an NVIDIA Hopper GPU behind
//! `lily_model::Backend`, so the engine and the server use it unchanged.

use std::path::Path;
use std::sync::Arc;

use lily_core::weights::Weights;
use lily_core::ModelConfig;
use lily_model::{Backend, LogitsWanted, ModelError, ModelResult, SeqId};

use crate::device::Gpu;
use crate::error::CudaResult;
use crate::model::Model;
use crate::state::Options;

pub struct CudaBackend {
    model: Model,
    config: ModelConfig,
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
        Ok(CudaBackend { model, config: weights.config.clone() })
    }

    /// A backend of shape `cfg` with random weights made on the GPU (speed
    /// probes at the real shape without a checkpoint; outputs are noise).
    pub fn synthetic(gpu: &Arc<Gpu>, cfg: &ModelConfig, opts: Options, seed: u64) -> CudaResult<Self> {
        Ok(CudaBackend { model: Model::synthetic(gpu, cfg, opts, seed)?, config: cfg.clone() })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }
    pub fn model_mut(&mut self) -> &mut Model {
        &mut self.model
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
    fn memory_in_use(&self) -> Option<u64> {
        Some(self.model.gpu.allocated())
    }
}
