//! Decode speed of the CPU fast path on a checkpoint (the full-shape
//! synthetic one by default): load, prefill 32 tokens, then time 16 greedy
//! decode steps. Prompt token i is `((i * 2654435761) mod 2^32) mod vocab`,
//! as in the benchmark contract (docs/design.md §7.1). One untimed decode step runs
//! first so page faults of the first touched experts are not all counted.
//!
//! `cargo run --release -p lily-cpu --example decode_speed -- [DIR] [PROMPT] [STEPS]`
//! (with `PREFAULT=1` in the environment, the mapped checkpoint is faulted
//! in before the prompt, see `CpuBackend::prefault`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use lily_core::weights::Weights;
use lily_cpu::CpuBackend;
use lily_model::{argmax, Backend, LogitsWanted};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "/tmp/lily-full-q4".into()));
    let prompt_len: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(32);
    let steps: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(16);

    let t = Instant::now();
    let weights = Arc::new(Weights::load(&dir)?);
    let mut be = CpuBackend::new(weights.clone())?;
    let load_s = t.elapsed().as_secs_f64();
    let vocab = weights.config.vocab_size as u64;
    println!("{}: {} layers, hidden {}, vocab {vocab}; backend {}", dir.display(), weights.config.num_layers, weights.config.hidden_size, be.name());
    println!("load (mmap + checks): {load_s:.2} s");
    if std::env::var_os("PREFAULT").is_some() {
        let t = Instant::now();
        let bytes = be.prefault();
        println!("prefault {:.1} GB: {:.2} s", bytes as f64 / 1e9, t.elapsed().as_secs_f64());
    }

    let prompt: Vec<u32> = (0..prompt_len as u64).map(|i| (((i * 2_654_435_761) % (1 << 32)) % vocab) as u32).collect();
    let seq = be.alloc()?;
    let t = Instant::now();
    let logits = be.prefill(seq, &prompt, LogitsWanted::Last)?;
    let prefill_s = t.elapsed().as_secs_f64();
    println!("prefill {prompt_len} tokens: {prefill_s:.2} s ({:.2} tok/s)", prompt_len as f64 / prefill_s);

    let mut token = argmax(&logits[0]);
    let t = Instant::now();
    token = argmax(&be.decode(&[(seq, token)])?[0]);
    println!("first decode step (untimed warm-up): {:.3} s", t.elapsed().as_secs_f64());

    let mut ids = Vec::with_capacity(steps);
    let mut per_step = Vec::with_capacity(steps);
    let t = Instant::now();
    for _ in 0..steps {
        let s = Instant::now();
        token = argmax(&be.decode(&[(seq, token)])?[0]);
        per_step.push(s.elapsed().as_secs_f64());
        ids.push(token);
    }
    let decode_s = t.elapsed().as_secs_f64();
    per_step.sort_by(f64::total_cmp);
    println!(
        "decode {steps} steps: {decode_s:.2} s = {:.2} tok/s (step median {:.1} ms, min {:.1} ms, max {:.1} ms)",
        steps as f64 / decode_s,
        per_step[steps / 2] * 1e3,
        per_step[0] * 1e3,
        per_step[steps - 1] * 1e3
    );
    println!("generated ids: {ids:?}");
    Ok(())
}
