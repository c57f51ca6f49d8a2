//! lily-model: the boundary between the engine and a backend.
//!
//! A backend owns the weights on its device and the per-sequence state (KV
//! cache for the attention layers, conv window and recurrent state for the
//! DeltaNet layers). The engine only sees sequence handles, token ids and
//! logits; how a backend fuses the layer sequence is its own business, and
//! every backend is tested against the CPU reference and the goldens.

pub mod contract;
pub mod sample;

pub use sample::{SampleParams, SampleState, Sampled, MAX_TOP_LOGPROBS};

use lily_core::ModelConfig;

/// Handle of one sequence's state inside a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The backend has no room for another sequence or more tokens.
    #[error("capacity: {0}")]
    Capacity(String),
    /// The request is malformed for this model (token id out of range...).
    #[error("invalid input: {0}")]
    Invalid(String),
    #[error("unknown sequence {0:?}")]
    UnknownSequence(SeqId),
    /// A device error (CUDA launch failure, out of memory...).
    #[error("device: {0}")]
    Device(String),
}

pub type ModelResult<T> = Result<T, ModelError>;

/// Which positions' logits a prefill returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Only the last position (normal generation).
    Last,
    /// Every position (goldens, accuracy checks, teacher forcing).
    All,
}

/// A model on some device, serving many sequences.
pub trait Backend: Send {
    /// Short name for logs and `/v1/models` (e.g. "cpu", "cuda:0 NVIDIA H200").
    fn name(&self) -> String;
    fn config(&self) -> &ModelConfig;
    /// Longest sequence (prompt + generated) one sequence may hold.
    fn max_seq_len(&self) -> usize;
    /// How many sequences can hold state at once.
    fn max_sequences(&self) -> usize;

    /// Creates an empty sequence.
    fn alloc(&mut self) -> ModelResult<SeqId>;
    /// Releases a sequence's memory; unknown ids are ignored.
    fn free(&mut self, seq: SeqId);
    /// Copies a sequence's whole state into a new sequence (prefix-cache
    /// snapshots, `n > 1` sampling).
    fn fork(&mut self, seq: SeqId) -> ModelResult<SeqId>;
    /// Tokens consumed so far by the sequence.
    fn seq_len(&self, seq: SeqId) -> ModelResult<usize>;

    /// Appends `tokens` to the sequence and returns logits (`vocab_size`
    /// floats per returned position).
    fn prefill(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> ModelResult<Vec<Vec<f32>>>;
    /// Appends one token to each sequence of the batch (distinct sequences)
    /// and returns each one's next-token logits, in batch order.
    fn decode(&mut self, batch: &[(SeqId, u32)]) -> ModelResult<Vec<Vec<f32>>>;

    /// Prefills `tokens` and returns the greedy next token. Backends that can
    /// take the argmax on the device override this to avoid copying logits.
    fn prefill_greedy(&mut self, seq: SeqId, tokens: &[u32]) -> ModelResult<u32> {
        let logits = self.prefill(seq, tokens, LogitsWanted::Last)?;
        let last = logits
            .last()
            .ok_or_else(|| ModelError::Invalid("empty prompt".into()))?;
        Ok(argmax(last))
    }

    /// Runs `steps` greedy decode steps starting from `first` (already
    /// sampled, not yet fed) and returns the `steps` tokens produced. Backends
    /// override this with a loop that never returns to the host per token.
    fn decode_greedy(&mut self, seq: SeqId, first: u32, steps: usize) -> ModelResult<Vec<u32>> {
        let mut out = Vec::with_capacity(steps);
        let mut token = first;
        for _ in 0..steps {
            let logits = self.decode(&[(seq, token)])?;
            token = argmax(&logits[0]);
            out.push(token);
        }
        Ok(out)
    }

    /// One decode step for a batch (as `decode`) that also chooses each
    /// sequence's next token with its `SampleState` (same order, one per
    /// entry) and advances that state (`SampleState::record_draw`). The
    /// chosen tokens are not fed; the next call feeds them. The draw is
    /// `sample::sample_host`'s, whatever the device: `vocab_limit` and
    /// `top_logprobs` included. On an error no state has advanced; as with
    /// `decode`, a `Capacity` error changed no sequence. Backends that
    /// sample on the device override this to avoid copying logits; this
    /// default samples on the host (sample.rs). The engine decodes through
    /// this (or `submit_decode`), never through `decode`.
    fn decode_sample(
        &mut self,
        batch: &[(SeqId, u32)],
        states: &mut [SampleState],
    ) -> ModelResult<Vec<Sampled>> {
        if states.len() != batch.len() {
            return Err(ModelError::Invalid(format!(
                "{} sampling states for a batch of {}",
                states.len(),
                batch.len()
            )));
        }
        let logits = self.decode(batch)?;
        Ok(logits
            .iter()
            .zip(states.iter_mut())
            .map(|(l, s)| sample::sample_host(l, s))
            .collect())
    }

    /// Bytes of device memory in use (weights + state), if the backend knows.
    fn memory_in_use(&self) -> Option<u64> {
        None
    }

    /// Room left in the KV memory all sequences share, for backends whose
    /// KV cache is a fixed pool (the CUDA backend); `None` where memory
    /// grows on demand (the CPU backend). The engine admits work only when
    /// it fits, so requests wait rather than fail.
    fn kv_room(&self) -> Option<KvRoom> {
        None
    }
}

/// A fixed KV pool's state, in tokens. Memory is handed out in blocks of
/// `block_tokens`: a sequence of `n` tokens holds `ceil(n / block_tokens)`
/// blocks (forks share their full blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRoom {
    pub free_tokens: usize,
    pub total_tokens: usize,
    pub block_tokens: usize,
}

/// Index of the largest value (the first one on ties); 0 for an empty slice.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best as u32
}
