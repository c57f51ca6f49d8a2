//! lily-cpu: the model on the CPU.
//!
//! Two forward passes over the same weight tree (`lily_core::weights`) and
//! the same per-sequence state (`state`):
//! - `reference`: naive f32, one op per function, written to be read next to
//!   docs/design.md §2. It is the oracle: the fast path and every GPU kernel are
//!   tested against it, and it is tested against transformers' goldens.
//! - `fast`: the serving path for machines without a GPU: multi-threaded
//!   products on the packed 4-bit codes of the mapped checkpoint, top-k
//!   experts only, tokens batched so each weight row is read once per call.
//!
//! `CpuBackend` puts either behind `lily_model::Backend`. This crate owns no
//! tokenizer, sampling or scheduling.

pub mod fast;
pub mod reference;
pub mod state;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use lily_core::weights::Weights;
use lily_core::ModelConfig;
use lily_model::{Backend, LogitsWanted, MixedSteps, ModelError, ModelResult, SeqId};

pub use fast::FastModel;
pub use reference::DeltaRule;
pub use state::{LayerState, SeqState};

/// Which forward a backend runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forward {
    /// The naive f32 reference, with the chosen delta-rule form for prefill.
    Reference(DeltaRule),
    /// The multi-threaded path on packed weights.
    Fast,
}

enum Engine {
    Reference(DeltaRule),
    Fast(Box<FastModel>),
}

/// Sequences the backend holds at once unless told otherwise. CPU state
/// lives in ordinary memory and grows with use, so this only bounds a
/// runaway client.
pub const DEFAULT_MAX_SEQUENCES: usize = 256;

/// Tokens per fast-path prefill call: bounds the activation memory of a long
/// prompt while keeping each weight row's reads shared by many tokens.
pub const PREFILL_CHUNK: usize = 256;

/// Most rows in one forward of `prefill_batch` (several parts' pieces).
pub const BATCH_ROWS: usize = 4 * PREFILL_CHUNK;

/// The model on the CPU behind `lily_model::Backend`.
pub struct CpuBackend {
    weights: Arc<Weights>,
    engine: Engine,
    seqs: BTreeMap<SeqId, SeqState>,
    next_id: u64,
    max_seq_len: usize,
    max_sequences: usize,
}

impl CpuBackend {
    /// The fast path (the serving default).
    pub fn new(weights: Arc<Weights>) -> ModelResult<Self> {
        let fast = FastModel::new(weights.clone())?;
        Ok(Self::build(weights, Engine::Fast(Box::new(fast))))
    }

    /// The naive reference, with the chunked delta rule for prefill.
    pub fn reference(weights: Arc<Weights>) -> Self {
        Self::reference_with(weights, DeltaRule::Chunked)
    }

    /// The naive reference with a chosen delta-rule form.
    pub fn reference_with(weights: Arc<Weights>, rule: DeltaRule) -> Self {
        Self::build(weights, Engine::Reference(rule))
    }

    /// Loads a checkpoint directory onto the fast path. `max_seq_len` caps
    /// the context (the config's `max_position_embeddings` when `None`).
    pub fn open(dir: &Path, max_seq_len: Option<usize>) -> lily_core::Result<Self> {
        let weights = Arc::new(Weights::load(dir)?);
        let backend = Self::new(weights).map_err(|e| lily_core::Error::Other(e.to_string()))?;
        Ok(match max_seq_len {
            Some(n) => backend.with_max_seq_len(n),
            None => backend,
        })
    }

    fn build(weights: Arc<Weights>, engine: Engine) -> Self {
        let max_seq_len = weights.config.max_position_embeddings;
        CpuBackend { weights, engine, seqs: BTreeMap::new(), next_id: 0, max_seq_len, max_sequences: DEFAULT_MAX_SEQUENCES }
    }

    /// Caps the context below the config's limit (never above it).
    pub fn with_max_seq_len(mut self, n: usize) -> Self {
        self.max_seq_len = n.min(self.weights.config.max_position_embeddings);
        self
    }

    pub fn with_max_sequences(mut self, n: usize) -> Self {
        self.max_sequences = n;
        self
    }

    pub fn forward_kind(&self) -> Forward {
        match &self.engine {
            Engine::Reference(rule) => Forward::Reference(*rule),
            Engine::Fast(_) => Forward::Fast,
        }
    }

    pub fn weights(&self) -> &Arc<Weights> {
        &self.weights
    }

    /// Faults the whole mapped checkpoint in (fast path; see
    /// [`FastModel::prefault`]). Returns the bytes covered (0 for the
    /// reference, which reads rows through the core accessors).
    pub fn prefault(&self) -> usize {
        match &self.engine {
            Engine::Fast(fast) => fast.prefault(),
            Engine::Reference(_) => 0,
        }
    }

    /// A sequence's state (tests compare states; GPU tests seed from it).
    pub fn state(&self, seq: SeqId) -> Option<&SeqState> {
        self.seqs.get(&seq)
    }

    fn check_tokens(&self, tokens: &[u32]) -> ModelResult<()> {
        let vocab = self.weights.config.vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(t) => Err(ModelError::Invalid(format!("token id {t} is not below the vocabulary size {vocab}"))),
            None => Ok(()),
        }
    }

    fn check_room(&self, seq: SeqId, extra: usize) -> ModelResult<()> {
        let len = self.seqs.get(&seq).ok_or(ModelError::UnknownSequence(seq))?.len;
        if len + extra > self.max_seq_len {
            return Err(ModelError::Capacity(format!("sequence {seq:?} holds {len} tokens; {extra} more exceed the limit of {}", self.max_seq_len)));
        }
        Ok(())
    }

    fn new_id(&mut self) -> ModelResult<SeqId> {
        if self.seqs.len() >= self.max_sequences {
            return Err(ModelError::Capacity(format!("all {} sequence slots are in use", self.max_sequences)));
        }
        let id = SeqId(self.next_id);
        self.next_id += 1;
        Ok(id)
    }

    /// Runs one forward over several sequences' spans (already validated).
    fn run(&mut self, work: &[(SeqId, &[u32], LogitsWanted)]) -> ModelResult<Vec<Vec<Vec<f32>>>> {
        match &self.engine {
            Engine::Fast(fast) => {
                // Take the states out of the map so each span can hold its own
                // `&mut`; they go back whatever the outcome.
                let mut states: Vec<SeqState> = Vec::with_capacity(work.len());
                let mut missing = None;
                for (seq, _, _) in work {
                    match self.seqs.remove(seq) {
                        Some(s) => states.push(s),
                        None => {
                            missing = Some(*seq);
                            break;
                        }
                    }
                }
                let result = match missing {
                    Some(seq) => Err(ModelError::UnknownSequence(seq)),
                    None => {
                        let mut spans: Vec<fast::Span> =
                            states.iter_mut().zip(work).map(|(state, &(_, tokens, wanted))| fast::Span { state, tokens, wanted }).collect();
                        fast.forward(&mut spans)
                    }
                };
                for ((id, _, _), s) in work.iter().zip(states) {
                    self.seqs.insert(*id, s);
                }
                result
            }
            Engine::Reference(rule) => {
                let rule = *rule;
                let mut out = Vec::with_capacity(work.len());
                for &(seq, tokens, wanted) in work {
                    let state = self.seqs.get_mut(&seq).ok_or(ModelError::UnknownSequence(seq))?;
                    out.push(reference::forward(&self.weights, state, tokens, wanted, rule)?);
                }
                Ok(out)
            }
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        match &self.engine {
            Engine::Reference(rule) => format!("cpu reference ({rule:?} delta rule)"),
            Engine::Fast(_) => {
                format!("cpu ({} threads, {:?} kernels)", rayon::current_num_threads(), fast::matmul::isa())
            }
        }
    }

    fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    fn max_sequences(&self) -> usize {
        self.max_sequences
    }

    fn alloc(&mut self) -> ModelResult<SeqId> {
        let id = self.new_id()?;
        self.seqs.insert(id, SeqState::new(&self.weights.config));
        Ok(id)
    }

    fn free(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }

    fn fork(&mut self, seq: SeqId) -> ModelResult<SeqId> {
        let state = self.seqs.get(&seq).ok_or(ModelError::UnknownSequence(seq))?.clone();
        let id = self.new_id()?;
        self.seqs.insert(id, state);
        Ok(id)
    }

    fn seq_len(&self, seq: SeqId) -> ModelResult<usize> {
        self.seqs.get(&seq).map(|s| s.len).ok_or(ModelError::UnknownSequence(seq))
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32], wanted: LogitsWanted) -> ModelResult<Vec<Vec<f32>>> {
        self.check_room(seq, tokens.len())?;
        self.check_tokens(tokens)?;
        let chunk = match self.engine {
            Engine::Fast(_) => PREFILL_CHUNK,
            // The reference takes the whole prompt at once: its chunked delta
            // rule then sees the prompt exactly as transformers does.
            Engine::Reference(_) => tokens.len().max(1),
        };
        let mut logits = Vec::new();
        let pieces: Vec<&[u32]> = tokens.chunks(chunk).collect();
        for (i, piece) in pieces.iter().enumerate() {
            // With `Last`, earlier pieces still produce their last row (one
            // lm_head row, cheap); only the final piece's is kept.
            let mut out = self.run(&[(seq, piece, wanted)])?;
            let rows = out.pop().unwrap_or_default();
            if wanted == LogitsWanted::All || i + 1 == pieces.len() {
                logits.extend(rows);
            }
        }
        Ok(logits)
    }

    /// Every part checked first (room, token ids), so a refusal changes no
    /// sequence; then the fast path runs the parts together, each matrix
    /// row block read once for all of them: each forward takes the next
    /// piece (up to `PREFILL_CHUNK` tokens) of every part not done yet, as
    /// many as fit `BATCH_ROWS` rows, so a part's pieces run in order and a
    /// short part (a one-token decode row of a mixed step) shares the first
    /// forward with the long ones. The reference runs part by part.
    fn prefill_batch(&mut self, parts: &[(SeqId, &[u32])]) -> ModelResult<Vec<Vec<f32>>> {
        lily_model::check_batch_room(self, parts)?;
        for (_, tokens) in parts {
            self.check_tokens(tokens)?;
        }
        if !matches!(self.engine, Engine::Fast(_)) {
            return lily_model::prefill_each(self, parts);
        }
        let mut done = vec![0usize; parts.len()];
        let mut out = vec![Vec::new(); parts.len()];
        while let Some(first) = done.iter().zip(parts).position(|(&d, p)| d < p.1.len()) {
            let mut work: Vec<(SeqId, &[u32], LogitsWanted)> = Vec::new();
            let mut which = Vec::new();
            let mut rows = 0;
            for (k, &(seq, tokens)) in parts.iter().enumerate().skip(first) {
                let take = (tokens.len() - done[k]).min(PREFILL_CHUNK);
                if take == 0 || (rows + take > BATCH_ROWS && !work.is_empty()) {
                    continue;
                }
                work.push((seq, &tokens[done[k]..done[k] + take], LogitsWanted::Last));
                which.push(k);
                rows += take;
            }
            let got = self.run(&work)?;
            for ((k, rows), (seq, piece, _)) in which.into_iter().zip(got).zip(&work) {
                done[k] += piece.len();
                if done[k] == parts[k].1.len() {
                    out[k] = lily_model::last_row(*seq, rows)?;
                }
            }
        }
        Ok(out)
    }

    fn mixed_steps(&self, _rows: usize) -> MixedSteps {
        // A decode step is this same forward over one-token spans, so
        // carrying them beside prompt chunks changes nothing but the rows
        // a weight read serves (and the summation order, as any batch).
        match self.engine {
            Engine::Fast(_) => MixedSteps::Pays,
            Engine::Reference(_) => MixedSteps::Never,
        }
    }

    fn decode(&mut self, batch: &[(SeqId, u32)]) -> ModelResult<Vec<Vec<f32>>> {
        let mut seen = std::collections::BTreeSet::new();
        for &(seq, token) in batch {
            if !seen.insert(seq) {
                return Err(ModelError::Invalid(format!("sequence {seq:?} appears twice in one decode batch")));
            }
            self.check_room(seq, 1)?;
            self.check_tokens(&[token])?;
        }
        let tokens: Vec<[u32; 1]> = batch.iter().map(|&(_, t)| [t]).collect();
        let work: Vec<(SeqId, &[u32], LogitsWanted)> = batch.iter().zip(&tokens).map(|(&(seq, _), t)| (seq, &t[..], LogitsWanted::Last)).collect();
        let out = self.run(&work)?;
        Ok(out.into_iter().map(|mut rows| rows.pop().unwrap_or_default()).collect())
    }

    fn memory_in_use(&self) -> Option<u64> {
        let state: usize = self.seqs.values().map(SeqState::bytes).sum();
        // The tensors the model reads, not every byte of the files: a vision
        // tower or MTP head in the checkpoint is mapped but never touched.
        Some(self.weights.model_bytes + state as u64)
    }
}
