//! Speed probe for serving: how much of a prefill pass hides under decode
//! steps when the two run at once on separate streams, against the engine's
//! order today (a step decodes the running streams, then prefills, and every
//! running stream waits out the pass).
//!
//! Two backends on one GPU (one context, a stream each; random real-shape
//! weights, `--layers` of them, so twice the weights' memory): A decodes
//! `--batch` sequences (each after its own 256-token prompt) in greedy
//! graph steps; B prefills `--parts` prompts of `--part-tokens` in one
//! `prefill_batch` pass, `--passes` times. Each alone, then together: B's
//! passes on a second thread while A keeps stepping until they end. Prints
//! one JSON line: ms a step and a pass alone and together, and the time the
//! overlapped work would have taken in the engine's order today.
//!
//!   overlap_probe [--batch 64] [--parts 8] [--part-tokens 256] [--passes 6] [--layers 40]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use lily_cuda::{CudaBackend, Gpu, Options};
use lily_model::{Backend, SeqId};

const PROMPT: usize = 256;
/// Decode steps a timed call runs (the graph path of `decode_greedy_batch`).
const STEPS_A_CALL: usize = 4;
/// Decode steps of the decode-alone measurement.
const ALONE_STEPS: usize = 64;

struct Args {
    batch: usize,
    parts: usize,
    part_tokens: usize,
    passes: usize,
    layers: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args { batch: 64, parts: 8, part_tokens: 256, passes: 6, layers: 40 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || -> Result<usize, String> { it.next().ok_or(format!("{flag} needs a value"))?.parse::<usize>().map_err(|e| format!("{flag}: {e}")) };
        match flag.as_str() {
            "--batch" => a.batch = val()?,
            "--parts" => a.parts = val()?,
            "--part-tokens" => a.part_tokens = val()?,
            "--passes" => a.passes = val()?,
            "--layers" => a.layers = val()?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.batch == 0 || a.parts == 0 || a.part_tokens == 0 || a.passes == 0 || a.layers == 0 {
        return Err("every count must be positive".into());
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("overlap_probe: {e}");
        std::process::exit(1);
    }
}

/// One prefill pass of `prompts` (fresh sequences, freed after): seconds.
fn pass(be: &mut CudaBackend, prompts: &[Vec<u32>]) -> Result<f64, String> {
    let seqs = prompts.iter().map(|_| be.alloc().map_err(|e| e.to_string())).collect::<Result<Vec<_>, _>>()?;
    let work: Vec<(SeqId, &[u32])> = seqs.iter().zip(prompts).map(|(s, p)| (*s, &p[..])).collect();
    let t = Instant::now();
    be.model_mut().prefill_batch(&work).map_err(|e| e.to_string())?;
    let dt = t.elapsed().as_secs_f64();
    for s in seqs {
        be.free(s);
    }
    Ok(dt)
}

/// `STEPS_A_CALL` greedy steps of `batch`, each sequence fed its last token:
/// seconds.
fn steps(be: &mut CudaBackend, batch: &mut [(SeqId, u32)]) -> Result<f64, String> {
    let t = Instant::now();
    let ids = be.model_mut().decode_greedy_batch(batch, STEPS_A_CALL).map_err(|e| e.to_string())?;
    let dt = t.elapsed().as_secs_f64();
    for (e, v) in batch.iter_mut().zip(&ids) {
        e.1 = *v.last().unwrap_or(&e.1);
    }
    Ok(dt)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn run() -> Result<(), String> {
    let a = parse()?;
    let e = |x: lily_cuda::CudaError| x.to_string();
    let mut cfg = lily_core::config::production();
    cfg.num_layers = a.layers;
    let vocab = cfg.vocab_size;
    // A's sequences hold their prompt and every step this probe runs: the
    // alone run, and the overlapped run (at most `overlap_cap` calls: ~13
    // ms a step at 64 sequences, so ~5 s, past any pass count measured).
    let overlap_cap = 100;
    let a_len = PROMPT + ALONE_STEPS + STEPS_A_CALL * (2 + overlap_cap) + 64;
    let mut opts_a = Options::for_context(a_len);
    opts_a.max_sequences = a.batch + 2;
    opts_a.kv_tokens = (a_len + 128) * opts_a.max_sequences;
    let mut opts_b = Options::for_context(a.part_tokens + 64);
    opts_b.max_sequences = a.parts + 2;
    opts_b.kv_tokens = (a.part_tokens + 128) * opts_b.max_sequences;
    let gpu_a = Gpu::open(0).map_err(e)?;
    let gpu_b = Gpu::open(0).map_err(e)?;
    let mut be_a = CudaBackend::synthetic(&gpu_a, &cfg, opts_a, 1).map_err(e)?;
    let mut be_b = CudaBackend::synthetic(&gpu_b, &cfg, opts_b, 2).map_err(e)?;
    eprintln!(
        "{}: two backends of {} layers, device memory {:.2} + {:.2} GB",
        gpu_a.name,
        a.layers,
        gpu_a.allocated() as f64 / 1e9,
        gpu_b.allocated() as f64 / 1e9
    );

    let mut batch = lily_cuda::bench::prefilled(&mut be_a, a.batch, PROMPT, vocab).map_err(e)?;
    let prompts: Vec<Vec<u32>> = (0..a.parts).map(|i| lily_model::contract::batch_prompt_tokens(1000 + i, a.part_tokens, vocab)).collect();

    // Alone: warm-up (graphs captured, kernels loaded), then timed.
    steps(&mut be_a, &mut batch)?;
    let mut alone_a = Vec::new();
    for _ in 0..ALONE_STEPS / STEPS_A_CALL {
        alone_a.push(steps(&mut be_a, &mut batch)? / STEPS_A_CALL as f64);
    }
    pass(&mut be_b, &prompts)?;
    let alone_b: Vec<f64> = (0..a.passes).map(|_| pass(&mut be_b, &prompts)).collect::<Result<_, _>>()?;
    let (step_alone, pass_alone) = (median(alone_a), median(alone_b));

    // Together: B's passes on a second thread, A stepping until they end.
    let done = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let (together_b, together_a) = std::thread::scope(|sc| -> Result<(Vec<f64>, Vec<f64>), String> {
        let flag = done.clone();
        let prompts = &prompts;
        let be_b = &mut be_b;
        let passes = a.passes;
        let h = sc.spawn(move || -> Result<Vec<f64>, String> {
            let r = (0..passes).map(|_| pass(be_b, prompts)).collect::<Result<Vec<_>, _>>();
            flag.store(true, Ordering::Release);
            r
        });
        let mut ta = Vec::new();
        while !done.load(Ordering::Acquire) && ta.len() < overlap_cap {
            ta.push(steps(&mut be_a, &mut batch)?);
        }
        let tb = h.join().map_err(|_| "the prefill thread panicked".to_string())??;
        Ok((tb, ta))
    })?;
    let wall = t0.elapsed().as_secs_f64();
    let n_steps = together_a.len() * STEPS_A_CALL;
    // The same work in the engine's order today: every step and every pass
    // one after another, each at its alone speed.
    let serial = n_steps as f64 * step_alone + a.passes as f64 * pass_alone;
    let step_together = together_a.iter().sum::<f64>() / n_steps as f64;
    println!(
        "{{\"gpu\":\"{}\",\"layers\":{},\"batch\":{},\"parts\":{},\"part_tokens\":{},\"passes\":{},\"step_ms_alone\":{:.3},\"pass_ms_alone\":{:.2},\"step_ms_together\":{:.3},\"pass_ms_together\":{:.2},\"steps_together\":{},\"wall_s_together\":{:.4},\"serial_s_same_work\":{:.4},\"saved\":{:.3}}}",
        gpu_a.name,
        a.layers,
        a.batch,
        a.parts,
        a.part_tokens,
        a.passes,
        step_alone * 1e3,
        pass_alone * 1e3,
        step_together * 1e3,
        median(together_b) * 1e3,
        n_steps,
        wall,
        serial,
        1.0 - wall / serial
    );
    for (s, _) in batch {
        be_a.free(s);
    }
    Ok(())
}
