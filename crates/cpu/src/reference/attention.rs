//! Gated full attention of the reference (docs/design.md §2.4).
//!
//! q_proj yields, per head, `head_dim` query values followed by `head_dim`
//! gate values. q and k get a per-head RMSNorm, then NeoX RoPE on the first
//! `rotary_dim` dims. Attention is causal with scale 1/sqrt(head_dim); query
//! head h reads KV head h / (heads / kv heads). The output is multiplied by
//! sigmoid(gate) before o_proj. Tokens are processed one after another, so
//! a prefill and the same tokens decoded one by one do the same arithmetic.

use lily_core::weights::AttentionWeights;
use lily_core::ModelConfig;

use super::ops::{linear, rms_norm_vec, rope, rope_inv_freq, sigmoid, softmax};

/// Causal attention of one query head over `positions` cached keys/values
/// (`[positions][kv heads][head dim]`), reading kv head `kv_head`.
pub fn attend(q: &[f32], keys: &[f32], values: &[f32], kv_heads: usize, kv_head: usize, positions: usize) -> Vec<f32> {
    let hd = q.len();
    let scale = 1.0 / (hd as f64).sqrt();
    let mut scores: Vec<f32> = (0..positions)
        .map(|p| {
            let k = &keys[(p * kv_heads + kv_head) * hd..][..hd];
            (q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale) as f32
        })
        .collect();
    softmax(&mut scores);
    let mut out = vec![0f64; hd];
    for (p, &w) in scores.iter().enumerate() {
        let v = &values[(p * kv_heads + kv_head) * hd..][..hd];
        for d in 0..hd {
            out[d] += w as f64 * v[d] as f64;
        }
    }
    out.into_iter().map(|v| v as f32).collect()
}

/// The whole mixer for consecutive tokens of one sequence starting at
/// position `start`. `keys`/`values` are the layer's cache and grow.
pub fn attention_layer(cfg: &ModelConfig, w: &AttentionWeights, keys: &mut Vec<f32>, values: &mut Vec<f32>, start: usize, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let (heads, kv_heads, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
    let group = heads / kv_heads;
    let inv_freq = rope_inv_freq(cfg.rotary_dim(), cfg.rope_theta);
    let eps = cfg.rms_norm_eps;
    xs.iter()
        .enumerate()
        .map(|(t, x)| {
            let pos = start + t;
            let qg = linear(&w.q, 0, x);
            let k = linear(&w.k, 0, x);
            let v = linear(&w.v, 0, x);
            for kh in 0..kv_heads {
                let mut kn = rms_norm_vec(&k[kh * hd..(kh + 1) * hd], &w.k_norm, eps);
                rope(&mut kn, pos, &inv_freq);
                keys.extend(kn);
            }
            values.extend_from_slice(&v);
            let mut gated = Vec::with_capacity(heads * hd);
            for h in 0..heads {
                let base = h * 2 * hd;
                let mut q = rms_norm_vec(&qg[base..base + hd], &w.q_norm, eps);
                rope(&mut q, pos, &inv_freq);
                let o = attend(&q, keys, values, kv_heads, h / group, pos + 1);
                let gate = &qg[base + hd..base + 2 * hd];
                gated.extend(o.iter().zip(gate).map(|(&ov, &gv)| ov * sigmoid(gv)));
            }
            linear(&w.o, 0, &gated)
        })
        .collect()
}
