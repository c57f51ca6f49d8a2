//! `lily bench`: the benchmark contract of docs/design.md §7.1.
//!
//! The parent process is the runner: for each round and each prompt length it
//! starts a fresh `lily bench --single LEN` process, collects its one JSON
//! line, and writes the medians. A single run loads the model (untimed), does
//! an untimed warm-up at the exact shape, then one timed prefill (until the
//! first generated token is on the host) and exactly 64 timed greedy decode
//! steps, and prints the digest of the 64 generated ids.
//!
//! `--batch 1,2,...` measures the backend alone decoding many sequences at
//! once (one process, the batch sweep of the serving work), so the backend
//! and the server can be told apart.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::{json, Value};

use lily_model::contract::{batch_prompt_tokens, fnv1a_digest, prompt_tokens};

use crate::backend::{open_backend, open_backend_with, Device, Sizing};

pub const LENGTHS: [usize; 10] = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072];
pub const DECODE_STEPS: usize = 64;
const SCHEMA_VERSION: u32 = 1;

/// Flags of `lily bench`.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (a full-shape synthetic one stands in for the real model).
    #[arg(long)]
    model: PathBuf,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Comma-separated prompt lengths (default: the ten of the contract).
    #[arg(long, value_delimiter = ',')]
    lengths: Vec<usize>,
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Where the runner writes the JSON summary.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also write a Markdown table here.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Run one length in this process and print one JSON line (used by the runner).
    #[arg(long)]
    single: Option<usize>,
    /// Comma-separated batch sizes: instead of the contract, greedy decode
    /// throughput of that many sequences decoded together on the backend
    /// alone (aggregate tok/s and ms per step), e.g. 1,2,4,8,16,32,64,128.
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// Prompt tokens of every sequence of a `--batch` run.
    #[arg(long, default_value_t = 256)]
    batch_prompt: usize,
    /// With `--batch`: every step batch-invariant (`lily serve
    /// --batch-invariant`), to measure what that costs.
    #[arg(long)]
    batch_invariant: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if !args.batch.is_empty() {
        return run_batches(&args);
    }
    match args.single {
        Some(len) => run_single(&args.model, args.device, len),
        None => run_rounds(&args),
    }
}

/// `lily bench --batch`: for each batch size, that many sequences prefilled
/// with `--batch-prompt` tokens each, a short untimed warm-up, then per
/// round 64 timed greedy steps of the whole batch (the ids stay on the
/// device until the end); aggregate tok/s = batch * 64 / time.
fn run_batches(args: &Args) -> anyhow::Result<()> {
    let max_b = args.batch.iter().copied().max().unwrap_or(1);
    let warm_steps = 4;
    let max_seq = args.batch_prompt + warm_steps + DECODE_STEPS * args.rounds + 64;
    let sizing = Sizing { max_seq: Some(max_seq), max_sequences: max_b, kv_tokens: Some(max_b * (max_seq + 64)), batch_invariant: args.batch_invariant };
    let mut backend = open_backend_with(&args.model, args.device, sizing, &mut |_, _| {})?;
    let vocab = backend.config().vocab_size;
    let mut rows = Vec::new();
    for &b in &args.batch {
        if b == 0 || b > max_b {
            bail!("batch size {b} out of range");
        }
        let mut batch = Vec::with_capacity(b);
        for i in 0..b {
            let s = backend.alloc()?;
            let first = backend.prefill_greedy(s, &batch_prompt_tokens(i, args.batch_prompt, vocab))?;
            batch.push((s, first));
        }
        let warm = backend.decode_greedy_batch(&batch, warm_steps)?;
        for (e, ids) in batch.iter_mut().zip(&warm) {
            e.1 = *ids.last().unwrap_or(&e.1);
        }
        let mut rounds = Vec::new();
        let mut digest = String::new();
        for r in 0..args.rounds {
            let t = Instant::now();
            let ids = backend.decode_greedy_batch(&batch, DECODE_STEPS)?;
            let secs = t.elapsed().as_secs_f64();
            if ids.len() != b || ids.iter().any(|v| v.len() != DECODE_STEPS) {
                bail!("batch {b}: the backend returned the wrong number of tokens");
            }
            if r == 0 {
                digest = fnv1a_digest(&ids[0]);
            }
            for (e, v) in batch.iter_mut().zip(&ids) {
                e.1 = *v.last().unwrap_or(&e.1);
            }
            rounds.push(json!({ "seconds": secs, "tok_s": (b * DECODE_STEPS) as f64 / secs, "ms_per_step": secs * 1e3 / DECODE_STEPS as f64 }));
        }
        for (s, _) in &batch {
            backend.free(*s);
        }
        let tok_s = median(rounds.iter().filter_map(|r| r["tok_s"].as_f64()).collect());
        let ms = median(rounds.iter().filter_map(|r| r["ms_per_step"].as_f64()).collect());
        eprintln!("bench: batch {b:>3}: {tok_s:>9.1} tok/s aggregate, {ms:.3} ms per step");
        rows.push(json!({ "batch": b, "tok_s": tok_s, "ms_per_step": ms, "seq0_digest": digest, "rounds": rounds }));
    }
    let summary = json!({
        "schema_version": SCHEMA_VERSION,
        "kind": "batch_decode",
        "git_revision": env!("LILY_GIT_REV"),
        "backend": backend.name(),
        "checkpoint": checkpoint_identity(&args.model)?,
        "prompt_tokens": args.batch_prompt,
        "batch_invariant": args.batch_invariant,
        "decode_gemm": std::env::var("LILY_DECODE_GEMM").ok(),
        "decode_f16": std::env::var("LILY_DECODE_F16").ok(),
        "decode_steps": DECODE_STEPS,
        "rounds": args.rounds,
        "memory_bytes": backend.memory_in_use(),
        "batches": rows,
    });
    if let Some(mut f) = write_summary(args, &summary)? {
        writeln!(f, "| batch | aggregate tok/s | ms per step |")?;
        writeln!(f, "|---:|---:|---:|")?;
        for r in summary["batches"].as_array().into_iter().flatten() {
            writeln!(f, "| {} | {:.1} | {:.3} |", r["batch"], r["tok_s"].as_f64().unwrap_or(0.0), r["ms_per_step"].as_f64().unwrap_or(0.0))?;
        }
    }
    Ok(())
}

fn run_single(model: &Path, device: Device, len: usize) -> anyhow::Result<()> {
    let load_start = Instant::now();
    let mut backend = open_backend(model, device, Some(len + DECODE_STEPS + 1), &mut |_, _| {})?;
    let load_s = load_start.elapsed().as_secs_f64();
    let vocab = backend.config().vocab_size;
    let prompt = prompt_tokens(len, vocab);

    // Untimed warm-up at the exact shape.
    let warm = backend.alloc()?;
    let first = backend.prefill_greedy(warm, &prompt)?;
    backend.decode_greedy(warm, first, DECODE_STEPS)?;
    backend.free(warm);

    let seq = backend.alloc()?;
    let t0 = Instant::now();
    let first = backend.prefill_greedy(seq, &prompt)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let ids = backend.decode_greedy(seq, first, DECODE_STEPS)?;
    let decode_s = t1.elapsed().as_secs_f64();
    if ids.len() != DECODE_STEPS {
        bail!("backend returned {} decode tokens, expected {DECODE_STEPS}", ids.len());
    }
    let line = json!({
        "prompt_tokens": len,
        "prefill_s": prefill_s,
        "prefill_tok_s": len as f64 / prefill_s,
        "decode_s": decode_s,
        "decode_tok_s": DECODE_STEPS as f64 / decode_s,
        "first_token": first,
        "digest": fnv1a_digest(&ids),
        "memory_bytes": backend.memory_in_use(),
        "load_s": load_s,
        "backend": backend.name(),
    });
    backend.free(seq);
    println!("{line}");
    Ok(())
}

/// Writes the JSON summary to `--out` (or stdout) and opens the Markdown
/// file of `--markdown`, if asked for.
fn write_summary(args: &Args, summary: &Value) -> anyhow::Result<Option<std::fs::File>> {
    let text = serde_json::to_string_pretty(summary)?;
    match &args.out {
        Some(p) => std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?,
        None => println!("{text}"),
    }
    match &args.markdown {
        Some(p) => Ok(Some(std::fs::File::create(p).with_context(|| format!("writing {}", p.display()))?)),
        None => Ok(None),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn checkpoint_identity(model: &Path) -> anyhow::Result<Value> {
    let config = lily_core::ModelConfig::from_dir(model)?;
    let index = std::fs::read(model.join("model.safetensors.index.json")).unwrap_or_default();
    let config_bytes = std::fs::read(model.join("config.json")).with_context(|| format!("{}", model.display()))?;
    let mut ids: Vec<u32> = config_bytes.iter().map(|b| *b as u32).collect();
    ids.extend(index.iter().map(|b| *b as u32));
    Ok(json!({
        "path": model.display().to_string(),
        "format": format!("{:?}", config.format()),
        "shape": format!("{:?}", config.shape_class),
        "layers": config.num_layers,
        "config_and_index_fnv1a": fnv1a_digest(&ids),
    }))
}

fn run_rounds(args: &Args) -> anyhow::Result<()> {
    let lengths: Vec<usize> = if args.lengths.is_empty() { LENGTHS.to_vec() } else { args.lengths.clone() };
    let exe = std::env::current_exe().context("locating the lily binary")?;
    let mut per_len: Vec<Vec<Value>> = vec![Vec::new(); lengths.len()];
    for round in 0..args.rounds {
        for (i, &len) in lengths.iter().enumerate() {
            eprintln!("bench: round {} length {len}", round + 1);
            let out = Command::new(&exe)
                .args(["bench", "--single", &len.to_string(), "--model"])
                .arg(&args.model)
                .args(["--device", args.device.as_str()])
                .output()
                .context("starting a bench process")?;
            if !out.status.success() {
                bail!("bench at length {len} failed: {}", String::from_utf8_lossy(&out.stderr));
            }
            let stdout = String::from_utf8_lossy(&out.stdout);
            let line = stdout.lines().last().unwrap_or("");
            let v: Value = serde_json::from_str(line).with_context(|| format!("bench output at length {len}: {line:?}"))?;
            eprintln!("  {v}");
            per_len[i].push(v);
        }
    }
    let mut results = Vec::new();
    let mut peak_memory: u64 = 0;
    let mut backend_name = String::new();
    for (len, runs) in lengths.iter().zip(&per_len) {
        let f = |key: &str| median(runs.iter().filter_map(|r| r[key].as_f64()).collect());
        let digests: Vec<&str> = runs.iter().filter_map(|r| r["digest"].as_str()).collect();
        let digest_repeats = digests.windows(2).all(|w| w[0] == w[1]);
        for r in runs {
            peak_memory = peak_memory.max(r["memory_bytes"].as_u64().unwrap_or(0));
            if let Some(b) = r["backend"].as_str() {
                backend_name = b.to_string();
            }
        }
        results.push(json!({
            "prompt_tokens": len,
            "prefill_tok_s": f("prefill_tok_s"),
            "decode_tok_s": f("decode_tok_s"),
            "prefill_s": f("prefill_s"),
            "decode_s": f("decode_s"),
            "digest": digests.first().copied().unwrap_or(""),
            "digest_repeats": digest_repeats,
            "rounds": runs,
        }));
    }
    let summary = json!({
        "schema_version": SCHEMA_VERSION,
        "git_revision": env!("LILY_GIT_REV"),
        "backend": backend_name,
        "checkpoint": checkpoint_identity(&args.model)?,
        "decode_steps": DECODE_STEPS,
        "rounds": args.rounds,
        "peak_memory_bytes": peak_memory,
        "results": results,
    });
    if let Some(mut f) = write_summary(args, &summary)? {
        writeln!(f, "| prompt tokens | prefill tok/s | decode tok/s | digest | repeats |")?;
        writeln!(f, "|---:|---:|---:|---|---|")?;
        for r in summary["results"].as_array().into_iter().flatten() {
            writeln!(
                f,
                "| {} | {:.0} | {:.1} | {} | {} |",
                r["prompt_tokens"],
                r["prefill_tok_s"].as_f64().unwrap_or(0.0),
                r["decode_tok_s"].as_f64().unwrap_or(0.0),
                r["digest"].as_str().unwrap_or(""),
                r["digest_repeats"]
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_two_is_their_mean() {
        assert_eq!(median(vec![1.0, 3.0]), 2.0);
        assert_eq!(median(vec![5.0, 1.0, 3.0]), 3.0);
    }
}
