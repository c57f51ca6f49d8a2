//! Sparse MoE block of the reference (docs/design.md §2.5).
//!
//! Router logits, softmax in f32, top-k, renormalise the k weights to sum to
//! one; each chosen expert is SwiGLU `down(silu(gate x) * up x)`; the shared
//! expert (same shape) is added scaled by `sigmoid(shared_expert_gate x)`.

use lily_core::weights::{Linear, MoeWeights};

use super::ops::{linear, sigmoid, silu, softmax};

/// The chosen experts and their renormalised weights, best first. Ties go to
/// the lower expert index.
pub fn route(router_logits: &[f32], top_k: usize) -> Vec<(usize, f32)> {
    let mut probs = router_logits.to_vec();
    softmax(&mut probs);
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    let sum: f64 = order.iter().map(|&e| probs[e] as f64).sum();
    order.into_iter().map(|e| (e, (probs[e] as f64 / sum) as f32)).collect()
}

/// One SwiGLU expert: `down(silu(gate x) * up x)`.
pub fn swiglu(gate: &Linear, up: &Linear, down: &Linear, expert: usize, x: &[f32]) -> Vec<f32> {
    let g = linear(gate, expert, x);
    let u = linear(up, expert, x);
    let h: Vec<f32> = g.iter().zip(&u).map(|(&gv, &uv)| silu(gv) * uv).collect();
    linear(down, expert, &h)
}

/// The MoE block for one (normed) token.
pub fn moe(w: &MoeWeights, top_k: usize, x: &[f32]) -> Vec<f32> {
    let logits = linear(&w.router, 0, x);
    let mut out = vec![0f64; x.len()];
    for (e, weight) in route(&logits, top_k) {
        let y = swiglu(&w.gate, &w.up, &w.down, e, x);
        for (o, v) in out.iter_mut().zip(y) {
            *o += weight as f64 * v as f64;
        }
    }
    let shared = swiglu(&w.shared_gate, &w.shared_up, &w.shared_down, 0, x);
    let scale = sigmoid(linear(&w.shared_expert_gate, 0, x)[0]);
    out.iter().zip(shared).map(|(&o, s)| (o + scale as f64 * s as f64) as f32).collect()
}
