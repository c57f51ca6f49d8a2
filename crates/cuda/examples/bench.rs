//! Speed probe of the CUDA backend (the measurement `lily bench` wraps):
//! load a checkpoint (or write a full-width synthetic one into RAM first),
//! then for each prompt length an untimed warm-up at the exact shape, one
//! timed greedy prefill and `--steps` timed greedy decode steps, one JSON line
//! per length; `--profile` adds the GPU time of each kernel group of a
//! prefill (CUDA events between the groups). Decode steps are profiled per
//! kernel with Nsight Compute (scripts/h200.sh, stage `ncu`). `--served`
//! also times decode steps the way the engine runs them under the server
//! (`submit_decode` of step t + 1 before `collect_decode` of step t: the
//! staged inputs, the sampler on the device, the download), greedy and
//! with the thinking-mode sampling defaults, at each `--batch` size (1 if
//! none): against the greedy graph loop above, what a served stream pays
//! per token for being served.
//!
//!   bench --model DIR [--lengths 256,4096] [--steps 64] [--profile] [--batch 8,32] [--served [--split]]
//!         [--parts K] [--decode-gemm FROM|off]   (the dense matrices on the GEMM from FROM sequences)
//!         [--decode-f16 FROM|off]   (below the GEMM, qmm's dense matrices on fp16 x from FROM sequences)
//!         [--fused-moe]   (the MoE of steps of up to 8 tokens as one launch, qmm_moe_fused)
//!         [--expert-rows BM]   (the grouped expert GEMMs' tile height at every pass)
//!         [--moe-f16 FROM|off]   (GEMM-path decode steps of FROM+ sequences: the experts on fp16 x)
//!         [--router-mma FROM|off]   (GEMM-path decode steps of FROM+ sequences: the router on mma.sync)
//!         [--knockout GROUPS,...]   (each batch's step time with kernel groups left out: model::Knockout)
//!         [--timeline]   (each batch's steps and each length's prefill traced by CUPTI: every kernel's start, length
//!                         and gap; kernel_trace;
//!                         the trace runs from the start, so the run's other numbers are not the contract's)
//!   bench --synth-layers 40 [...]     (synthetic real-shape checkpoint, /dev/shm)
//!   bench --random-layers 40 [...]    (random real-shape weights made on the GPU)

use std::path::PathBuf;
use std::time::Instant;

use lily_core::weights::Weights;
use lily_cuda::backend::SPLIT_PARTS;
use lily_cuda::bench::{fnv1a_digest, prompt_tokens, timed_run};
use lily_cuda::{CudaBackend, Gpu, Options};
use lily_model::sample::{SampleParams, SampleState};

struct Args {
    model: Option<PathBuf>,
    synth_layers: Option<usize>,
    random_layers: Option<usize>,
    lengths: Vec<usize>,
    steps: usize,
    profile: bool,
    batch: Vec<usize>,
    served: bool,
    /// `--split`: with `--served`, a second run of each served case with
    /// the step's parts timed by events (CudaBackend::split_steps).
    split: bool,
    /// `--parts K`: also prefill each length as K sequences of length / K
    /// tokens in one `prefill_batch` (many short prompts at once).
    parts: usize,
    /// `--decode-gemm FROM|off`: the decode path (Options::decode_matrices).
    decode_matrices: Option<lily_cuda::DecodeMatrices>,
    /// `--decode-f16 FROM|off`: DecodeMatrices::f16_from.
    decode_f16_from: Option<usize>,
    /// `--knockout a,b+c`: also time each `--batch` step with these kernel
    /// groups left out (model::Knockout; measurement only, garbage tokens),
    /// each with the name it was given.
    knockouts: Vec<(String, lily_cuda::model::Knockout)>,
    /// `--fused-moe`: steps of up to 8 tokens run the MoE as one launch.
    fused_moe: bool,
    /// `--moe-trace`: with `--fused-moe`, one traced step at each batch size
    /// (the fused MoE's phases by %globaltimer, per layer).
    moe_trace: bool,
    /// `--f16-gemm-from N|off`: prefill passes of N tokens and more run
    /// their dense projections on hgemm (Options::f16_gemm_from).
    f16_gemm_from: Option<Option<usize>>,
    /// `--expert-rows BM`: the grouped expert GEMMs' tile height at every
    /// pass (Options::expert_tile_rows).
    expert_rows: Option<usize>,
    /// `--router-mma FROM|off`: Options::router_mma_from.
    router_mma_from: Option<Option<usize>>,
    /// `--moe-f16 FROM|off`: Options::moe_f16_from.
    moe_f16_from: Option<Option<usize>>,
    /// `--timeline`: `TIMELINE_STEPS` steps of each `--batch` size and each
    /// `--lengths` prefill traced by CUPTI (lily_cuda::kernel_trace).
    timeline: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        model: None,
        synth_layers: None,
        random_layers: None,
        lengths: vec![256, 4096],
        steps: 64,
        profile: false,
        batch: Vec::new(),
        served: false,
        split: false,
        parts: 0,
        decode_matrices: None,
        decode_f16_from: None,
        knockouts: Vec::new(),
        fused_moe: false,
        moe_trace: false,
        timeline: false,
        f16_gemm_from: None,
        expert_rows: None,
        moe_f16_from: None,
        router_mma_from: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = Some(PathBuf::from(val()?)),
            "--synth-layers" => a.synth_layers = Some(val()?.parse().map_err(|e| format!("--synth-layers: {e}"))?),
            "--random-layers" => a.random_layers = Some(val()?.parse().map_err(|e| format!("--random-layers: {e}"))?),
            "--lengths" => {
                a.lengths = val()?.split(',').filter(|s| !s.is_empty()).map(|s| s.parse().map_err(|e| format!("--lengths: {e}"))).collect::<Result<_, _>>()?
            }
            "--steps" => a.steps = val()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--batch" => a.batch = val()?.split(',').map(|s| s.parse().map_err(|e| format!("--batch: {e}"))).collect::<Result<_, _>>()?,
            "--profile" => a.profile = true,
            "--served" => a.served = true,
            "--split" => a.split = true,
            "--parts" => a.parts = val()?.parse().map_err(|e| format!("--parts: {e}"))?,
            "--fused-moe" => a.fused_moe = true,
            "--moe-trace" => a.moe_trace = true,
            "--timeline" => a.timeline = true,
            "--knockout" => {
                for name in val()?.split(',') {
                    a.knockouts.push((name.to_string(), lily_cuda::model::Knockout::parse(name)?));
                }
            }
            "--f16-gemm-from" => {
                let v = val()?;
                a.f16_gemm_from = Some(match v.as_str() {
                    "off" => None,
                    n => Some(n.parse().map_err(|e| format!("--f16-gemm-from: {e}"))?),
                });
            }
            "--expert-rows" => a.expert_rows = Some(val()?.parse().map_err(|e| format!("--expert-rows: {e}"))?),
            "--router-mma" => {
                a.router_mma_from = Some(lily_cuda::Options::parse_router_mma_from(&val()?).map_err(|e| format!("--router-mma: {e}"))?);
            }
            "--moe-f16" => {
                a.moe_f16_from = Some(lily_cuda::Options::parse_moe_f16_from(&val()?).map_err(|e| format!("--moe-f16: {e}"))?);
            }
            "--decode-gemm" => a.decode_matrices = Some(lily_cuda::DecodeMatrices::parse(&val()?)?),
            "--decode-f16" => a.decode_f16_from = Some(lily_cuda::DecodeMatrices::parse_f16_from(&val()?)?),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.model.is_none() && a.synth_layers.is_none() && a.random_layers.is_none() {
        return Err("give --model DIR, --synth-layers N or --random-layers N".into());
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("bench: {e}");
        std::process::exit(1);
    }
}

/// Prompt tokens of each sequence of a `--batch` run (`prefilled`).
const BATCH_PROMPT: usize = 256;
/// Timed decode steps of a `--batch` run at each batch size.
const BATCH_STEPS: usize = 32;
/// Untimed decode steps before each timed run.
const BATCH_WARM: usize = 4;
/// Tokens one timed run (and each knockout's) adds to a sequence.
const BATCH_RUN_TOKENS: usize = BATCH_WARM + BATCH_STEPS;

fn run() -> Result<(), String> {
    let args = parse()?;
    let max_len = args.lengths.iter().copied().max().unwrap_or(256);
    // A `--batch` sequence holds its prompt, the timed run and one more run
    // per knockout (before this, two knockouts at --steps 16 outgrew the
    // plan: "sequence would hold 364 tokens; sized for at most 336") and
    // the traced steps of `--timeline`; a `--served` one its prompt and the
    // warm-up and `--steps` draws.
    let traced = if args.timeline { BATCH_WARM + TIMELINE_STEPS } else { 0 };
    let batch_seq = BATCH_PROMPT + BATCH_RUN_TOKENS * (1 + args.knockouts.len()) + traced;
    let mut opts = Options::for_context((max_len.max(BATCH_PROMPT) + args.steps).max(batch_seq) + 64);
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    opts.max_sequences = 4.max(max_batch + 2).max(args.parts + 2);
    opts.kv_tokens = opts.kv_tokens.max((batch_seq + 128) * opts.max_sequences);
    if let Some(m) = args.decode_matrices {
        opts.decode_matrices = m;
    }
    if let Some(f) = args.decode_f16_from {
        opts.decode_matrices.f16_from = f;
    }
    opts.fused_moe = args.fused_moe;
    if let Some(f) = args.f16_gemm_from {
        opts.f16_gemm_from = f;
    }
    // Checked with the other options when the backend is made.
    opts.expert_tile_rows = args.expert_rows;
    if let Some(f) = args.moe_f16_from {
        opts.moe_f16_from = f;
    }
    if let Some(f) = args.router_mma_from {
        opts.router_mma_from = f;
    }
    let gpu = Gpu::open(0).map_err(|e| e.to_string())?;
    // Before any graph exists, so that CUPTI sees every one.
    let trace = if args.timeline { Some(lily_cuda::kernel_trace::KernelTrace::start()?) } else { None };
    let t = Instant::now();
    let mut be = if let Some(layers) = args.random_layers {
        let mut cfg = lily_core::config::production();
        cfg.num_layers = layers;
        CudaBackend::synthetic(&gpu, &cfg, opts, 1).map_err(|e| e.to_string())?
    } else {
        let dir = match (&args.model, args.synth_layers) {
            (Some(m), _) => m.clone(),
            (None, Some(layers)) => {
                let base = if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
                let dir = base.join(format!("lily-synth-full-{layers}"));
                if !dir.join("config.json").exists() {
                    let t = Instant::now();
                    let mut o = lily_synth::SynthOptions::new(lily_synth::Preset::Full, &dir);
                    o.layers = Some(layers);
                    let r = lily_synth::synth(&o).map_err(|e| e.to_string())?;
                    eprintln!("synth: {} layers, {:.1} GB in {:.1} s", layers, r.bytes_written as f64 / 1e9, t.elapsed().as_secs_f64());
                }
                dir
            }
            _ => return Err("no model".into()),
        };
        let weights = Weights::load(&dir).map_err(|e| e.to_string())?;
        let mut last = Instant::now();
        CudaBackend::from_weights(&gpu, &weights, opts, &mut |done, total| {
            if last.elapsed().as_secs_f64() > 2.0 || done == total {
                eprintln!("upload: {:.1} / {:.1} GB", done as f64 / 1e9, total as f64 / 1e9);
                last = Instant::now();
            }
        })
        .map_err(|e| e.to_string())?
    };
    let load_s = t.elapsed().as_secs_f64();
    eprintln!("loaded in {load_s:.1} s on {}; device memory {:.2} GB", gpu.name, gpu.allocated() as f64 / 1e9);
    let vocab = lily_model::Backend::config(&be).vocab_size;
    let mut table = Vec::new();
    for &len in &args.lengths {
        let prompt = prompt_tokens(len, vocab);
        timed_run(&mut be, &prompt, args.steps).map_err(|e| format!("warm-up at {len}: {e}"))?;
        let r = timed_run(&mut be, &prompt, args.steps).map_err(|e| format!("run at {len}: {e}"))?;
        let line = format!(
            "{{\"prompt_tokens\":{len},\"prefill_s\":{:.4},\"prefill_tok_s\":{:.1},\"decode_s\":{:.4},\"decode_tok_s\":{:.1},\"first_token\":{},\"digest\":\"{}\",\"peak_bytes\":{}}}",
            r.prefill_s,
            r.prefill_tok_s(),
            r.decode_s,
            r.decode_tok_s(),
            r.first_token,
            fnv1a_digest(&r.ids),
            gpu.peak_allocated()
        );
        println!("{line}");
        table.push((len, r.prefill_tok_s(), r.decode_tok_s()));
        if args.profile {
            let m = be.model_mut();
            let pseq = m.mem.alloc().map_err(|e| e.to_string())?;
            let pprof = m.profile_prefill(pseq, &prompt).map_err(|e| e.to_string())?;
            m.mem.free(pseq);
            print_prefill_groups(&format!("prefill of {len} tokens"), &pprof);
        }
        if let Some(trace) = &trace {
            prefill_timeline(&gpu, trace, &mut be, &prompt)?;
        }
        if args.parts > 1 {
            let line = parts_prefill(&mut be, len, args.parts, args.profile, vocab)?;
            println!("{line}");
        }
    }
    for &b in &args.batch {
        // Aggregate greedy decode throughput of b sequences stepping together
        // (ids fed back on the device), each from its own 256-token prompt.
        let mut batch = prefilled(&mut be, b, vocab)?;
        let warm = be.model_mut().decode_greedy_batch(&batch, BATCH_WARM).map_err(|e| e.to_string())?;
        for (e, ids) in batch.iter_mut().zip(&warm) {
            e.1 = *ids.last().unwrap_or(&e.1);
        }
        let steps = BATCH_STEPS;
        let t = Instant::now();
        let ids = be.model_mut().decode_greedy_batch(&batch, steps).map_err(|e| e.to_string())?;
        let dt = t.elapsed().as_secs_f64();
        println!(
            "{{\"batch\":{b},\"steps\":{steps},\"aggregate_tok_s\":{:.1},\"step_ms\":{:.3},\"seq0_digest\":\"{}\"}}",
            (b * steps) as f64 / dt,
            dt * 1e3 / steps as f64,
            fnv1a_digest(&ids[0])
        );
        if args.moe_trace && args.fused_moe && b <= lily_cuda::qmm::MOE_FUSED_TOK {
            moe_trace(&gpu, &mut be, &batch)?;
        }
        if let Some(trace) = &trace {
            timeline(&gpu, trace, &mut be, &batch)?;
        }
        for (name, ko) in &args.knockouts {
            let m = be.model_mut();
            m.set_knockout(*ko);
            m.decode_greedy_batch(&batch, BATCH_WARM).map_err(|e| e.to_string())?;
            let t = Instant::now();
            m.decode_greedy_batch(&batch, steps).map_err(|e| e.to_string())?;
            let dt = t.elapsed().as_secs_f64();
            m.set_knockout(lily_cuda::model::Knockout::default());
            println!("{{\"batch\":{b},\"knockout\":\"{name}\",\"step_ms\":{:.4}}}", dt * 1e3 / steps as f64);
        }
        if args.profile {
            let next: Vec<_> = batch.iter().zip(&ids).map(|(e, v)| (e.0, *v.last().unwrap_or(&e.1))).collect();
            let prof = be.model_mut().profile_decode(&next).map_err(|e| e.to_string())?;
            let total: f64 = prof.iter().map(|p| p.1).sum();
            eprintln!("decode step of batch {b}: {:.3} ms of GPU time by kernel group (no graph, groups serialised)", total / 1000.0);
            for (name, us) in &prof {
                eprintln!("  {name:<24} {:9.1} us  {:5.1}%", us, 100.0 * us / total);
            }
        }
        for (s, _) in batch {
            lily_model::Backend::free(&mut be, s);
        }
    }
    if args.served {
        let sizes = if args.batch.is_empty() { vec![1] } else { args.batch.clone() };
        let greedy = SampleParams { temperature: 0.0, ..SampleParams::default() };
        // The checkpoint's thinking-mode defaults (generation_config.json).
        let thinking = SampleParams { temperature: 0.6, top_k: 20, top_p: 0.95, seed: 1, ..SampleParams::default() };
        for &b in &sizes {
            for (label, params) in [("greedy", greedy), ("sampled", thinking)] {
                let (ms, _) = served_step_ms(&mut be, b, params, vocab, args.steps, false).map_err(|e| format!("served {label} at batch {b}: {e}"))?;
                println!(
                    "{{\"served\":\"{label}\",\"batch\":{b},\"steps\":{},\"step_ms\":{ms:.4},\"aggregate_tok_s\":{:.1}}}",
                    args.steps,
                    b as f64 * 1e3 / ms
                );
                if args.split {
                    let (ms, parts) = served_step_ms(&mut be, b, params, vocab, args.steps, true).map_err(|e| format!("split {label} at batch {b}: {e}"))?;
                    let median = |i: usize| {
                        let mut v: Vec<f64> = parts.iter().map(|p| p[i]).collect();
                        v.sort_by(f64::total_cmp);
                        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
                    };
                    let cells: Vec<String> = SPLIT_PARTS.iter().enumerate().map(|(i, name)| format!("\"{name}\":{:.1}", median(i))).collect();
                    println!(
                        "{{\"served_split\":\"{label}\",\"batch\":{b},\"steps\":{},\"step_ms_with_events\":{ms:.4},\"median_us\":{{{}}}}}",
                        parts.len(),
                        cells.join(",")
                    );
                }
            }
        }
    }
    eprintln!("\n| prompt | prefill tok/s | decode tok/s |\n|---|---|---|");
    for (len, p, d) in table {
        eprintln!("| {len} | {p:.0} | {d:.1} |");
    }
    Ok(())
}

/// Steps of a `--timeline` trace (the middle ones are printed whole).
const TIMELINE_STEPS: usize = 5;

/// `TIMELINE_STEPS` greedy steps of `batch` traced by CUPTI: one JSON line a
/// step (span, busy time, every kernel as [name, start, length, gap] in
/// us; a negative gap overlaps the kernels before it), then on stderr the
/// middle step's kernels summed by name, with each name's share of the
/// step's span (`ChainRow::extends_us`).
fn timeline(
    gpu: &std::sync::Arc<Gpu>,
    trace: &lily_cuda::kernel_trace::KernelTrace,
    be: &mut CudaBackend,
    batch: &[(lily_model::SeqId, u32)],
) -> Result<(), String> {
    use lily_cuda::kernel_trace::{chain, split_steps};
    let m = be.model_mut();
    m.decode_greedy_batch(batch, BATCH_WARM).map_err(|e| e.to_string())?;
    // What ran before (loading, the timed runs) is dropped.
    trace.take(gpu)?;
    let t = Instant::now();
    m.decode_greedy_batch(batch, TIMELINE_STEPS).map_err(|e| e.to_string())?;
    let wall = t.elapsed().as_secs_f64();
    let records = trace.take(gpu)?;
    let b = batch.len();
    let Some(steps) = split_steps(&records, TIMELINE_STEPS) else {
        let names: Vec<&str> = records.iter().take(8).map(|r| r.name.as_str()).collect();
        return Err(format!("timeline of batch {b}: {} kernels (first {names:?}), none ran once a step", records.len()));
    };
    for (i, step) in steps.iter().enumerate() {
        let c = chain(step);
        println!(
            "{{\"timeline\":{b},\"step\":{i},\"traced_ms_a_step\":{:.4},\"span_us\":{:.1},\"busy_us\":{:.1},\"kernels\":[{}]}}",
            wall * 1e3 / TIMELINE_STEPS as f64,
            c.span_us,
            c.busy_us,
            kernel_rows(&c)
        );
    }
    let mid = chain(steps[steps.len() / 2]);
    print_by_name(&format!("timeline of batch {b}, step {} of {}", steps.len() / 2, steps.len()), &mid);
    Ok(())
}

/// A traced chain's kernels as JSON arrays [name, start, length, gap] (us).
fn kernel_rows(c: &lily_cuda::kernel_trace::StepChain) -> String {
    let rows: Vec<String> = c.kernels.iter().map(|k| format!("[\"{}\",{:.2},{:.2},{:.2}]", k.name, k.start_us, k.dur_us, k.gap_us)).collect();
    rows.join(",")
}

/// A traced chain's kernels summed by name on stderr: launches, summed
/// share of the span (what each run added to the latest end), length,
/// overlap (negative gaps) and idle time before them (positive gaps).
fn print_by_name(what: &str, c: &lily_cuda::kernel_trace::StepChain) {
    let mut by: Vec<(String, usize, [f64; 4])> = Vec::new();
    for k in &c.kernels {
        let i = match by.iter().position(|e| e.0 == k.name) {
            Some(i) => i,
            None => {
                by.push((k.name.clone(), 0, [0.0; 4]));
                by.len() - 1
            }
        };
        let e = &mut by[i];
        e.1 += 1;
        e.2[0] += k.extends_us;
        e.2[1] += k.dur_us;
        e.2[2] += (-k.gap_us).max(0.0);
        e.2[3] += k.gap_us.max(0.0);
    }
    by.sort_by(|a, b| b.2[0].total_cmp(&a.2[0]));
    eprintln!("{what}: span {:.1} us, busy {:.1} us, {} kernels", c.span_us, c.busy_us, c.kernels.len());
    eprintln!("  {:<28} {:>5} {:>10} {:>10} {:>10} {:>10}", "kernel", "runs", "span us", "length us", "overlap us", "idle us");
    for (name, n, [x, d, o, g]) in &by {
        eprintln!("  {name:<28} {n:>5} {x:>10.1} {d:>10.1} {o:>10.1} {g:>10.1}");
    }
}

/// One greedy prefill of `prompt` traced by CUPTI (`--timeline` with
/// `--lengths`): a JSON line of its kernels (as `timeline`'s steps), then
/// on stderr its kernels by name. The prefill is not a graph: its launches
/// on the second stream (the shared expert) show as overlaps.
fn prefill_timeline(gpu: &std::sync::Arc<Gpu>, trace: &lily_cuda::kernel_trace::KernelTrace, be: &mut CudaBackend, prompt: &[u32]) -> Result<(), String> {
    use lily_model::Backend;
    let seq = be.alloc().map_err(|e| e.to_string())?;
    trace.take(gpu)?;
    let first = be.prefill_greedy(seq, prompt).map_err(|e| e.to_string());
    let records = trace.take(gpu);
    be.free(seq);
    first?;
    let c = lily_cuda::kernel_trace::chain(&records?);
    println!("{{\"prefill_timeline\":{},\"span_us\":{:.1},\"busy_us\":{:.1},\"kernels\":[{}]}}", prompt.len(), c.span_us, c.busy_us, kernel_rows(&c));
    print_by_name(&format!("prefill of {} tokens", prompt.len()), &c);
    Ok(())
}

/// `b` new sequences, each prefilled (greedy) with its own 256-token
/// prompt: (sequence, first token).
fn prefilled(be: &mut CudaBackend, b: usize, vocab: usize) -> Result<Vec<(lily_model::SeqId, u32)>, String> {
    lily_cuda::bench::prefilled(be, b, BATCH_PROMPT, vocab).map_err(|e| e.to_string())
}

/// Milliseconds a decode step of `b` sequences (each after its own 256-token
/// prompt) takes when run ahead as the engine runs it: step t + 1 is
/// submitted (fed the previous draw on the device) before step t is
/// collected, so the host's turnaround hides behind the step in flight.
/// With `split`, each timed step's parts (CudaBackend::split_steps) too.
fn served_step_ms(
    be: &mut CudaBackend,
    b: usize,
    params: SampleParams,
    vocab: usize,
    steps: usize,
    split: bool,
) -> Result<(f64, Vec<[f64; SPLIT_PARTS.len()]>), String> {
    use lily_model::{Backend, Feed};
    let err = |e: lily_model::ModelError| e.to_string();
    let firsts = prefilled(be, b, vocab)?;
    let seqs: Vec<_> = firsts.iter().map(|f| f.0).collect();
    let feeds: Vec<_> = firsts.iter().map(|&(s, first)| (s, Feed::Token(first))).collect();
    let mut states: Vec<_> = (0..b).map(|i| SampleState::new(params, &lily_model::contract::batch_prompt_tokens(i, BATCH_PROMPT, vocab))).collect();
    let previous: Vec<_> = seqs.iter().map(|s| (*s, Feed::Previous)).collect();
    let warm = BATCH_WARM;
    let mut pending = be.submit_decode(&feeds, &mut states).map_err(err)?;
    let mut t0 = Instant::now();
    for i in 0..warm + steps {
        if i == warm {
            t0 = Instant::now();
            be.split_steps(split);
        }
        let next = be.submit_decode(&previous, &mut states).map_err(err)?;
        be.collect_decode(pending, &mut states).map_err(err)?;
        pending = next;
    }
    be.collect_decode(pending, &mut states).map_err(err)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
    let parts = be.take_step_split();
    be.split_steps(false);
    for s in seqs {
        be.free(s);
    }
    Ok((ms, parts))
}

/// GPU time by kernel group: (group, microseconds).
type GroupTimes = Vec<(&'static str, f64)>;

/// A prefill's GPU time by kernel group on stderr, in ms and shares.
fn print_prefill_groups(what: &str, prof: &[(&'static str, f64)]) {
    let total: f64 = prof.iter().map(|p| p.1).sum();
    eprintln!("{what}: {:.1} ms of GPU time by kernel group", total / 1000.0);
    for (name, us) in prof {
        eprintln!("  {name:<24} {:9.1} ms  {:5.1}%", us / 1000.0, 100.0 * us / total);
    }
}

/// Prefill of `len` tokens as `k` sequences of `len / k` tokens in one
/// `prefill_batch` (after an untimed warm-up): a JSON line with the wall
/// time; with `profile`, the GPU time by kernel group on stderr.
fn parts_prefill(be: &mut CudaBackend, len: usize, k: usize, profile: bool, vocab: usize) -> Result<String, String> {
    use lily_model::Backend;
    let part_len = len / k;
    if part_len == 0 {
        return Err(format!("--parts {k} leaves no token per part of {len}"));
    }
    let prompts: Vec<Vec<u32>> = (0..k).map(|i| lily_model::contract::batch_prompt_tokens(i, part_len, vocab)).collect();
    let once = |be: &mut CudaBackend, profiled: bool| -> Result<(f64, GroupTimes), String> {
        let seqs = (0..k).map(|_| be.alloc().map_err(|e| e.to_string())).collect::<Result<Vec<_>, _>>()?;
        let work: Vec<(lily_model::SeqId, &[u32])> = seqs.iter().zip(&prompts).map(|(s, p)| (*s, &p[..])).collect();
        let t = Instant::now();
        let prof = if profiled {
            be.model_mut().profile_prefill_batch(&work).map_err(|e| e.to_string())?
        } else {
            be.model_mut().prefill_batch(&work).map_err(|e| e.to_string())?;
            Vec::new()
        };
        let dt = t.elapsed().as_secs_f64();
        for s in seqs {
            be.free(s);
        }
        Ok((dt, prof))
    };
    once(be, false)?;
    let (dt, _) = once(be, false)?;
    if profile {
        let (_, prof) = once(be, true)?;
        print_prefill_groups(&format!("prefill_batch of {k} x {part_len} tokens"), &prof);
    }
    Ok(format!("{{\"parts\":{k},\"part_tokens\":{part_len},\"prefill_s\":{dt:.4},\"prefill_tok_s\":{:.1}}}", (k * part_len) as f64 / dt))
}

/// One traced greedy step of `batch`: where the fused MoE's blocks are at
/// each of its points (qmm.cu `moe_stamp`), in us from the first block past
/// the dependency wait, averaged over the layers; and the gap from the
/// previous layer's last block to this layer's first.
fn moe_trace(gpu: &std::sync::Arc<Gpu>, be: &mut CudaBackend, batch: &[(lily_model::SeqId, u32)]) -> Result<(), String> {
    use lily_cuda::qmm::{moe_fused_grid, MOE_TRACE_WORDS};
    let m = be.model_mut();
    let layers = m.dims.layers;
    let g = moe_fused_grid(&m.gpu, &m.kernels, &m.dims).map_err(|e| e.to_string())? as usize;
    let words = layers * g * MOE_TRACE_WORDS;
    let buf = lily_cuda::device::DeviceBuffer::zeroed(gpu, words * 8, "moe trace").map_err(|e| e.to_string())?;
    m.set_moe_trace(Some(lily_cuda::device::DevSlice::new(buf.ptr(), words)));
    let run = m.decode_greedy_batch(batch, 2);
    m.set_moe_trace(None);
    run.map_err(|e| e.to_string())?;
    let t: Vec<u64> = lily_cuda::device::read_device(gpu, buf.ptr(), words).map_err(|e| e.to_string())?;
    let pts = MOE_TRACE_WORDS / 2;
    let names = ["entry", "waited", "router rows", "barrier 1", "plan", "gate/up", "barrier 2", "down"];
    let mut sum = vec![[0f64; 3]; pts];
    let (mut gap, mut clk) = (0f64, vec![0f64; pts]);
    let mut prev_end = None;
    for l in 0..layers {
        let st = |b: usize, i: usize| t[(l * g + b) * MOE_TRACE_WORDS + i];
        let r0 = (0..g).map(|b| st(b, 1)).min().unwrap_or(0) as f64;
        for (i, acc) in sum.iter_mut().enumerate() {
            let mut v: Vec<f64> = (0..g).map(|b| (st(b, i) as f64 - r0) / 1e3).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            acc[0] += v[0] / layers as f64;
            acc[1] += v[g / 2] / layers as f64;
            acc[2] += v[g - 1] / layers as f64;
        }
        for (i, c) in clk.iter_mut().enumerate().skip(1) {
            let mut v: Vec<f64> = (0..g).map(|b| st(b, pts + i) as f64 - st(b, pts + i - 1) as f64).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            *c += v[g / 2] / layers as f64;
        }
        let first = (0..g).map(|b| st(b, 0)).min().unwrap_or(0) as f64;
        if let Some(e) = prev_end {
            gap += (first - e) / 1e3 / (layers - 1) as f64;
        }
        prev_end = Some((0..g).map(|b| st(b, pts - 1)).max().unwrap_or(0) as f64);
    }
    eprintln!("fused MoE trace, batch {} ({g} blocks, {layers} layers): us from the first block past its wait (min / median / max over blocks), median SM cycles since the previous point", batch.len());
    for (i, n) in names.iter().enumerate() {
        eprintln!("  {i} {n:<12} {:8.2} {:8.2} {:8.2}   {:9.0}", sum[i][0], sum[i][1], sum[i][2], clk[i]);
    }
    eprintln!("  previous layer's last block done -> this layer's first block entered: {gap:.2} us");
    Ok(())
}
