//! lily-model: the boundary between the engine and a backend.
//!
//! A backend owns the weights on its device and the per-sequence state (KV
//! cache for the attention layers, conv window and recurrent state for the
//! DeltaNet layers). The engine only sees sequence handles, token ids and
//! logits; how a backend fuses the layer sequence is its own business, and
//! every backend is tested against the CPU reference and the goldens.

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
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], wanted: LogitsWanted) -> ModelResult<Vec<Vec<f32>>>;
    /// Appends one token to each sequence of the batch (distinct sequences)
    /// and returns each one's next-token logits, in batch order.
    fn decode(&mut self, batch: &[(SeqId, u32)]) -> ModelResult<Vec<Vec<f32>>>;
}
