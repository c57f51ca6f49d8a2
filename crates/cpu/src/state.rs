//! Per-sequence decode state, shared by the reference and the fast path.
//!
//! Attention layers keep a KV cache (keys after q/k-norm and RoPE, values as
//! projected), DeltaNet layers keep the conv window (the last `kernel - 1`
//! raw in_proj_qkv outputs) and the fp32 recurrent state. Everything is f32
//! and grows with the sequence; a fork is a deep copy. This module owns the
//! layouts, not the math that reads them.

use lily_core::{LayerKind, ModelConfig};

/// State of one layer of one sequence.
#[derive(Clone, Debug)]
pub enum LayerState {
    DeltaNet {
        /// `[kernel - 1][conv channels]`, oldest input first; zeros at start
        /// (the causal conv's left padding).
        conv: Vec<f32>,
        /// `[value heads][key dim][value dim]`.
        recurrent: Vec<f32>,
    },
    Attention {
        /// `[positions][kv heads][head dim]`, RoPE applied.
        keys: Vec<f32>,
        /// `[positions][kv heads][head dim]`.
        values: Vec<f32>,
    },
}

/// Everything one sequence carries between calls.
#[derive(Clone, Debug)]
pub struct SeqState {
    /// Tokens consumed so far (the position of the next token).
    pub len: usize,
    pub layers: Vec<LayerState>,
}

impl SeqState {
    /// An empty sequence for `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        let layers = cfg
            .layer_kinds()
            .map(|kind| match kind {
                LayerKind::DeltaNet => LayerState::DeltaNet {
                    conv: vec![0.0; (cfg.conv_kernel - 1) * cfg.linear_conv_dim()],
                    recurrent: vec![0.0; cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim],
                },
                LayerKind::Attention => LayerState::Attention { keys: Vec::new(), values: Vec::new() },
            })
            .collect();
        SeqState { len: 0, layers }
    }

    /// Bytes of state held (for memory accounting).
    pub fn bytes(&self) -> usize {
        let floats: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::DeltaNet { conv, recurrent } => conv.len() + recurrent.len(),
                LayerState::Attention { keys, values } => keys.capacity() + values.capacity(),
            })
            .sum();
        floats * std::mem::size_of::<f32>()
    }
}
