//! Time of one host draw (`sample_host`) over a full-vocabulary row of
//! logits (248,320) with the checkpoint's thinking-mode defaults (T 0.6,
//! top-k 20, top-p 0.95): what the engine spends on every request's first
//! token after its prefill (without the logprob pass when the request asked
//! for no logprobs).
//!
//!   cargo run -p lily-model --release --example sample_bench

use lily_model::sample::{sample_host, SampleParams, SampleState};

fn main() {
    let n = 248_320usize;
    let mut seed = 12_345u64;
    let logits: Vec<f32> = (0..n)
        .map(|_| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 20.0 - 10.0
        })
        .collect();
    // `logprob: false` is the engine's first draw of a request that asked
    // for no logprobs (no log-sum-exp pass).
    for (label, top_k, logprob) in [("top-k 20", 20u32, true), ("top-k 20, no logprob", 20, false), ("top-k 0 (top-p only)", 0, true)] {
        let params = SampleParams { temperature: 0.6, top_k, top_p: 0.95, seed: 1, logprob, ..SampleParams::default() };
        let mut st = SampleState::new(params, &[]);
        let reps = 50;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            std::hint::black_box(sample_host(std::hint::black_box(&logits), &mut st));
        }
        println!("sample_host, {label}: {:.3} ms a draw over {n} logits", t.elapsed().as_secs_f64() * 1000.0 / reps as f64);
    }
}
