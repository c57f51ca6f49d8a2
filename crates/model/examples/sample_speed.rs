//! Times one host draw (`sample_host`) over a row of the real vocabulary's
//! size (248,320 logits, uniform in [-10, 10): flat, as random weights
//! give), with the checkpoint's sampling defaults and greedy:
//!
//!     cargo run --release -p lily-model --example sample_speed
//!
//! The engine draws each request's first token this way (NOTES.md of
//! lily-cuda: ~0.94 ms a draw measured in the server before the blocked
//! scans).

use std::time::Instant;

use lily_model::sample::{sample_host, SampleParams, SampleState};

fn main() {
    let n = 248_320usize;
    let mut x: u64 = 12345;
    let logits: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 20.0 - 10.0
        })
        .collect();
    let base = SampleParams { seed: 1, logprob: false, ..Default::default() };
    for (name, p) in [
        ("temperature 0.6, top-k 20, top-p 0.95", SampleParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..base }),
        ("temperature 1.0, top-k 20, top-p 0.95, presence 1.5", SampleParams { temperature: 1.0, top_k: 20, top_p: 0.95, presence_penalty: 1.5, ..base }),
        ("greedy", SampleParams { temperature: 0.0, ..base }),
        ("greedy with its logprob", SampleParams { temperature: 0.0, logprob: true, ..base }),
    ] {
        let mut st = SampleState::new(p, &[1, 2, 3]);
        let reps = 200;
        let t0 = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(sample_host(&logits, &mut st));
        }
        println!("{name}: {:.3} ms a draw", t0.elapsed().as_secs_f64() * 1e3 / reps as f64);
    }
}
