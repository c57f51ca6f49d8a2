//! The chunked delta rule (chunks of 64, triangular solve, scan across
//! chunks) against the plain recurrence: on random inputs with a non-zero
//! starting state, and through the whole reference model.

mod common;

use lily_core::Format;
use lily_cpu::reference::deltanet::{delta_rule_chunked, delta_rule_recurrent, DeltaDims, DeltaInputs, CHUNK};
use lily_cpu::{CpuBackend, DeltaRule};
use lily_model::{Backend, LogitsWanted};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn unit(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter().map(|x| x / norm * scale).collect()
}

fn random_inputs(dims: &DeltaDims, tokens: usize, seed: u64) -> DeltaInputs {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut x = DeltaInputs { tokens, q: vec![], k: vec![], v: vec![], g: vec![], beta: vec![] };
    for _ in 0..tokens {
        for _ in 0..dims.key_heads {
            x.q.extend(unit(&mut rng, dims.key_dim, 1.0 / (dims.key_dim as f32).sqrt()));
            x.k.extend(unit(&mut rng, dims.key_dim, 1.0));
        }
        for _ in 0..dims.value_heads {
            x.v.extend((0..dims.value_dim).map(|_| rng.random_range(-2.0f32..2.0)));
            // Mix near-zero and strong decays, as trained models have both.
            x.g.push(if rng.random_bool(0.5) { rng.random_range(-0.05f32..0.0) } else { rng.random_range(-4.0f32..0.0) });
            x.beta.push(rng.random_range(0.0f32..1.0));
        }
    }
    x
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn chunked_equals_recurrent_on_random_inputs() {
    let dims = DeltaDims { key_heads: 2, value_heads: 4, key_dim: 16, value_dim: 24 };
    // 150 tokens: two full chunks and a partial one.
    let x = random_inputs(&dims, 150, 7);
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let start: Vec<f32> = (0..dims.state_len()).map(|_| rng.random_range(-0.5f32..0.5)).collect();

    let mut s_rec = start.clone();
    let o_rec = delta_rule_recurrent(&dims, &mut s_rec, &x);
    assert!(o_rec.iter().any(|v| v.abs() > 0.1), "outputs are not trivially zero");
    for chunk in [CHUNK, 1, 7, 200] {
        let mut s_chunk = start.clone();
        let o_chunk = delta_rule_chunked(&dims, &mut s_chunk, &x, chunk);
        let (d_out, d_state) = (max_diff(&o_rec, &o_chunk), max_diff(&s_rec, &s_chunk));
        // Both sum in f64 and store f32: what remains is f32 storage rounding
        // carried through 150 steps.
        assert!(d_out < 1e-4, "chunk {chunk}: outputs differ by {d_out}");
        assert!(d_state < 1e-4, "chunk {chunk}: final states differ by {d_state}");
    }
}

#[test]
fn chunked_continues_from_a_recurrent_state() {
    // Split a sequence: recurrence on the first part, chunks on the rest,
    // must equal the recurrence over the whole.
    let dims = DeltaDims { key_heads: 1, value_heads: 2, key_dim: 8, value_dim: 8 };
    let x = random_inputs(&dims, 100, 11);
    let mut s_all = vec![0f32; dims.state_len()];
    let o_all = delta_rule_recurrent(&dims, &mut s_all, &x);

    let split = 30;
    let part = |from: usize, to: usize| DeltaInputs {
        tokens: to - from,
        q: x.q[from * 8..to * 8].to_vec(),
        k: x.k[from * 8..to * 8].to_vec(),
        v: x.v[from * 16..to * 16].to_vec(),
        g: x.g[from * 2..to * 2].to_vec(),
        beta: x.beta[from * 2..to * 2].to_vec(),
    };
    let mut s = vec![0f32; dims.state_len()];
    let mut o = delta_rule_recurrent(&dims, &mut s, &part(0, split));
    o.extend(delta_rule_chunked(&dims, &mut s, &part(split, 100), CHUNK));
    assert!(max_diff(&o_all, &o) < 1e-4);
    assert!(max_diff(&s_all, &s) < 1e-4);
}

#[test]
fn chunked_equals_recurrent_through_the_model() {
    let (_dir, w) = common::tiny(Format::MlxQ4, 4, 1);
    let prompt = common::tokens(150, w.config.vocab_size, 2);
    let mut chunked = CpuBackend::reference_with(w.clone(), DeltaRule::Chunked);
    let mut recurrent = CpuBackend::reference_with(w.clone(), DeltaRule::Recurrent);
    let (a, b) = (chunked.alloc().unwrap(), recurrent.alloc().unwrap());
    let la = chunked.prefill(a, &prompt, LogitsWanted::All).unwrap();
    let lb = recurrent.prefill(b, &prompt, LogitsWanted::All).unwrap();
    let diff = common::max_abs_diff(&la, &lb);
    let scale = common::max_abs(&la);
    assert!(diff <= 1e-4 * scale.max(1.0), "chunked vs recurrent logits differ by {diff} (scale {scale})");
    for (x, y) in la.iter().zip(&lb) {
        assert_eq!(common::argmax(x), common::argmax(y));
    }
}
