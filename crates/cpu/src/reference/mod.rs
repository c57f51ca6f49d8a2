//! The naive f32 reference forward: the oracle every other backend (the CPU
//! fast path, the CUDA kernels) is tested against.
//!
//! It is written to be read next to docs/design.md §2: one function per block,
//! weights dequantised one row at a time through the core crate's plain
//! accessor, dot products summed in f64, no threads, no caching of anything
//! but the sequence state. It shares nothing with the fast path except the
//! state layout (`crate::state`) and the weight tree (`lily_core::weights`).
//! Each op is public so GPU tests can check one kernel at a time.

pub mod attention;
pub mod deltanet;
pub mod moe;
pub mod ops;

use lily_core::weights::{Mixer, Weights};
use lily_model::{LogitsWanted, ModelError, ModelResult};

pub use deltanet::DeltaRule;

use crate::state::{LayerState, SeqState};

/// Embedding of one token: the dequantised (or converted) row of the table.
pub fn embed(weights: &Weights, token: u32) -> Vec<f32> {
    let mut row = vec![0f32; weights.config.hidden_size];
    weights.embed.row_f32(0, token as usize, &mut row);
    row
}

/// The hidden states after every layer (before the final norm) for
/// `tokens`, appended to the sequence in `state`. Token ids must be below
/// the vocabulary size (the backend checks).
pub fn hidden_states(weights: &Weights, state: &mut SeqState, tokens: &[u32], rule: DeltaRule) -> ModelResult<Vec<Vec<f32>>> {
    let cfg = &weights.config;
    let eps = cfg.rms_norm_eps;
    let mut xs: Vec<Vec<f32>> = tokens.iter().map(|&t| embed(weights, t)).collect();
    for (layer, layer_state) in weights.layers.iter().zip(state.layers.iter_mut()) {
        let normed: Vec<Vec<f32>> = xs.iter().map(|x| ops::rms_norm_vec(x, &layer.input_norm, eps)).collect();
        let mixed = match (&layer.mixer, layer_state) {
            (Mixer::DeltaNet(w), LayerState::DeltaNet { conv, recurrent }) => deltanet::deltanet_layer(cfg, w, conv, recurrent, &normed, rule),
            (Mixer::Attention(w), LayerState::Attention { keys, values }) => attention::attention_layer(cfg, w, keys, values, state.len, &normed),
            _ => return Err(ModelError::Invalid("sequence state does not match the model's layer kinds".into())),
        };
        for (x, m) in xs.iter_mut().zip(&mixed) {
            add(x, m);
        }
        for x in xs.iter_mut() {
            let normed = ops::rms_norm_vec(x, &layer.post_norm, eps);
            let y = moe::moe(&layer.moe, cfg.num_experts_per_tok, &normed);
            add(x, &y);
        }
    }
    state.len += tokens.len();
    Ok(xs)
}

/// Appends `tokens` to the sequence and returns the logits of the wanted
/// positions.
pub fn forward(weights: &Weights, state: &mut SeqState, tokens: &[u32], wanted: LogitsWanted, rule: DeltaRule) -> ModelResult<Vec<Vec<f32>>> {
    let xs = hidden_states(weights, state, tokens, rule)?;
    let picked: &[Vec<f32>] = match wanted {
        LogitsWanted::All => &xs,
        LogitsWanted::Last => &xs[xs.len().saturating_sub(1)..],
    };
    let logits = picked
        .iter()
        .map(|x| {
            let normed = ops::rms_norm_vec(x, &weights.final_norm, weights.config.rms_norm_eps);
            ops::linear(&weights.lm_head, 0, &normed)
        })
        .collect();
    Ok(logits)
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
