//! `lily serve`: the OpenAI-compatible server, the main-job command.
//!
//! It owns the flags, finding or making the model (with no `--model`, the
//! built-in demo checkpoint: `lily_synth`'s tiny preset with random weights,
//! written once into a cache directory), loading it with a progress bar,
//! starting the engine thread, printing the start-up summary, binding the
//! socket, and the shutdown sequence (SIGTERM/SIGINT: stop accepting, drain
//! requests in flight, stop the engine, exit). Everything about HTTP is
//! `lily_server`'s; everything about generation is `lily_engine`'s.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lily_core::chat::ChatTemplate;
use lily_core::tokenizer::Tokenizer;
use lily_engine::{Engine, EngineOptions, MixPolicy, SamplingParams};
use lily_server::validate::Limits;
use lily_server::{AppState, Generator, ServerConfig};

use crate::backend::{open_backend_with, Device, Sizing};

/// Model id of the built-in demo checkpoint.
const DEMO_NAME: &str = "lily-demo";
/// Bump when the demo checkpoint's format changes, so a stale cache is not
/// reused.
const DEMO_DIR: &str = "demo-tiny-v1";

/// Flags of `lily serve`.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json, safetensors, tokenizer.json, chat
    /// template). Without it, a small demo checkpoint with random weights is
    /// made and served, so the API can be tried at once.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to listen on. The default only accepts local connections;
    /// use 0.0.0.0:8000 to accept others (set an API key then).
    #[arg(long, default_value = "127.0.0.1:8000")]
    bind: SocketAddr,
    /// Longest sequence (prompt + completion) in tokens; the model's own
    /// limit when unset.
    #[arg(long)]
    max_seq: Option<usize>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Tokens of KV cache all requests share on the GPU (default: one
    /// full-length context plus 256). Smaller saves GPU memory: requests
    /// then wait for room, the youngest pause when generation outgrows it,
    /// and one that could never fit fails alone. Ignored on the CPU.
    #[arg(long, value_parser = clap::value_parser!(u64).range(64..))]
    kv_cache_tokens: Option<u64>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    /// Also read from the LILY_API_KEY environment variable.
    #[arg(long)]
    api_key: Option<String>,
    /// Send CORS headers so that web pages on other origins may call the API.
    #[arg(long)]
    cors: bool,
    /// Largest request body accepted (413 beyond it).
    #[arg(long, default_value_t = 8 << 20)]
    max_body_bytes: usize,
    /// Most messages in one chat request.
    #[arg(long, default_value_t = 1024)]
    max_messages: usize,
    /// Most requests generating at once (one decode batch).
    #[arg(long, default_value_t = 64)]
    max_concurrent: usize,
    /// Most requests waiting for a slot; beyond it, 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Prompt tokens prefilled per engine step, all new requests together.
    /// Running streams get one token per step, so each waits at most this
    /// much prefill between two tokens; larger starts long prompts sooner,
    /// smaller keeps streams smoother while prompts arrive. Default: what the
    /// backend prefers (2,048 on CUDA, where several prompts share one pass),
    /// else 512.
    #[arg(long, value_parser = clap::value_parser!(u64).range(16..=65536))]
    prefill_chunk: Option<u64>,
    /// When nothing is running and a request comes while others are still
    /// being tokenized, or just after several requests ended together (their
    /// clients' next requests are expected too), wait up to this many
    /// milliseconds for them, so that requests sent together start in one
    /// prefill pass; a request on another connection than the request that
    /// ended last waits a twelfth of it for others right behind it (one
    /// client's next request never waits). 0 disables it.
    #[arg(long, default_value_t = lily_engine::DEFAULT_ARRIVAL_WAIT.as_millis() as u64, value_parser = clap::value_parser!(u64).range(0..=1000))]
    arrival_wait_ms: u64,
    /// Run a step's decode rows inside its prefill pass when prompts are
    /// being prefilled beside generating streams (every weight read once
    /// for both): `auto` where the backend has measured it to pay (the CPU;
    /// CUDA up to a decode batch of rows, not with --batch-invariant), `on`
    /// also where a backend only allows it, `off` never.
    #[arg(long, value_enum, default_value_t = MixedStepsArg::Auto)]
    mixed_steps: MixedStepsArg,
    /// Decode every step batch-invariantly: a request's tokens the same
    /// whatever other requests run beside it (CUDA; by default steps of 5
    /// to 8 sequences read their dense matrices' activations in fp16 and
    /// steps of 9 or more run them on the faster fp16 GEMM, which moves
    /// logits by ~2e-4 to 5e-4 and, rarely, a near-tied token).
    #[arg(long)]
    batch_invariant: bool,
    /// Per-request time limit in seconds (0 = none); a request past it ends
    /// with a `timeout` error.
    #[arg(long, default_value_t = 0)]
    request_timeout_s: u64,
    /// Model id clients must send (default: the checkpoint directory's name,
    /// or `lily-demo`).
    #[arg(long)]
    served_model_name: Option<String>,
    /// On SIGTERM/SIGINT, how long requests in flight may take to finish.
    #[arg(long, default_value_t = 60)]
    drain_timeout_s: u64,
    /// FOR TESTS ONLY: replace the model's replies to matching prompts with
    /// scripted text (see lily_server::scripted). The server says so at
    /// start-up and in /v1/models.
    #[arg(long, hide = true)]
    test_script_file: Option<PathBuf>,
}

/// `--mixed-steps` (`lily_engine::MixPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MixedStepsArg {
    Auto,
    On,
    Off,
}

impl From<MixedStepsArg> for MixPolicy {
    fn from(a: MixedStepsArg) -> Self {
        match a {
            MixedStepsArg::Auto => MixPolicy::Auto,
            MixedStepsArg::On => MixPolicy::On,
            MixedStepsArg::Off => MixPolicy::Off,
        }
    }
}

fn cache_root() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("lily");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(h).join(".cache").join("lily");
    }
    std::env::temp_dir().join("lily")
}

fn bar(prefix: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{prefix} [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes}") {
        bar.set_style(style);
    }
    bar.set_prefix(prefix.to_string());
    bar
}

/// Writes the demo checkpoint into `dir` (a fresh one each time asked).
fn make_demo(dir: &Path) -> anyhow::Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing the stale demo checkpoint {}", dir.display()))?;
    }
    eprintln!("making the demo checkpoint (random weights, tiny shape) in {}", dir.display());
    let progress = bar("writing demo");
    let p2 = progress.clone();
    let mut opts = lily_synth::SynthOptions::new(lily_synth::Preset::Tiny, dir);
    opts.progress = Some(Arc::new(move |p: lily_synth::Progress| {
        p2.set_length(p.bytes_total);
        p2.set_position(p.bytes_done);
    }));
    let report = lily_synth::synth(&opts).context("writing the demo checkpoint")?;
    progress.finish_and_clear();
    eprintln!("  wrote {} tensors, {:.1} MB in {:.1}s", report.tensors, report.bytes_written as f64 / 1e6, report.seconds);
    Ok(())
}

/// The model directory, its id and whether it is the random demo.
fn resolve_model(args: &Args) -> anyhow::Result<(PathBuf, String, bool)> {
    if let Some(dir) = &args.model {
        if !dir.join("config.json").is_file() {
            bail!("{} is not a checkpoint directory (no config.json)", dir.display());
        }
        let name = args.served_model_name.clone().unwrap_or_else(|| {
            dir.canonicalize().ok().and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_else(|| "lily".to_string())
        });
        return Ok((dir.clone(), name, false));
    }
    let dir = cache_root().join(DEMO_DIR);
    // synth writes config.json last: its presence means the write finished.
    if !dir.join("config.json").is_file() {
        make_demo(&dir)?;
    }
    Ok((dir, args.served_model_name.clone().unwrap_or_else(|| DEMO_NAME.to_string()), true))
}

/// Sampling defaults from `generation_config.json` (as vLLM applies them),
/// over OpenAI's.
fn sampling_defaults(dir: &Path) -> anyhow::Result<SamplingParams> {
    let mut s = SamplingParams::default();
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(s);
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let f = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).map(|x| x as f32);
    if let Some(t) = f("temperature") {
        s.temperature = t;
    }
    if let Some(p) = f("top_p") {
        s.top_p = p;
    }
    if let Some(k) = v.get("top_k").and_then(serde_json::Value::as_u64) {
        s.top_k = k as usize;
    }
    if let Some(p) = f("min_p") {
        s.min_p = p;
    }
    if let Some(p) = f("repetition_penalty") {
        s.repetition_penalty = p;
    }
    s.validate().map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(s)
}

fn checkpoint_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Resident memory of this process (Linux), for the summary.
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else {
        format!("{:.1} MB", b / 1e6)
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let api_key = args.api_key.clone().or_else(|| std::env::var("LILY_API_KEY").ok()).filter(|k| !k.is_empty());
    if args.max_concurrent == 0 || args.max_queue == 0 {
        bail!("--max-concurrent and --max-queue must be at least 1");
    }
    let script = match &args.test_script_file {
        Some(p) => Some(lily_server::scripted::Script::load(p).map_err(|e| anyhow::anyhow!("--test-script-file: {e}"))?),
        None => None,
    };

    let (dir, name, demo) = resolve_model(&args)?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))?);
    let template = Arc::new(ChatTemplate::from_dir(&dir).with_context(|| format!("loading the chat template of {}", dir.display()))?);
    let defaults = sampling_defaults(&dir)?;

    let mut opts = EngineOptions {
        model_name: name.clone(),
        synthetic: demo,
        max_batch: args.max_concurrent,
        max_queue: args.max_queue,
        max_seq_len: args.max_seq,
        arrival_wait: Duration::from_millis(args.arrival_wait_ms),
        mixed_steps: args.mixed_steps.into(),
        ..EngineOptions::default()
    };
    // Room for every running request plus the prefix cache's snapshots.
    let sequences = args.max_concurrent + opts.prefix_cache_max_entries;

    let load = Instant::now();
    let progress = bar("loading weights");
    let mut on_progress = |done: u64, total: u64| {
        progress.set_length(total);
        progress.set_position(done);
    };
    let sizing =
        Sizing { max_seq: args.max_seq, max_sequences: sequences, kv_tokens: args.kv_cache_tokens.map(|n| n as usize), batch_invariant: args.batch_invariant };
    let mut backend = match open_backend_with(&dir, args.device, sizing, &mut on_progress) {
        Ok(b) => b,
        Err(e) if demo && args.device != Device::Cuda => {
            // A demo cache written by an older build: make it again, once.
            // (A GPU that cannot be used is not the cache's fault.)
            progress.finish_and_clear();
            eprintln!("the cached demo checkpoint does not load ({e:#}); making it again");
            make_demo(&dir)?;
            open_backend_with(&dir, args.device, sizing, &mut |_, _| {})?
        }
        Err(e) => return Err(e),
    };
    progress.finish_and_clear();
    let loaded_s = load.elapsed().as_secs_f64();
    // Decode steps of every batch size readied now (CUDA: their graphs
    // captured), not by the first step of each size while streams wait.
    let prepare = Instant::now();
    let prepared = backend.prepare_decode(args.max_concurrent).context("preparing the decode steps")?;
    let prepared_s = prepare.elapsed().as_secs_f64();
    let backend_name = backend.name();
    let backend_memory = backend.memory_in_use();
    let max_sequences = backend.max_sequences();
    let kv_room = backend.kv_room();
    opts.prefill_chunk = match args.prefill_chunk {
        Some(n) => n as usize,
        None => backend.preferred_prefill_chunk().unwrap_or(opts.prefill_chunk),
    };

    let handle = Engine::start(backend, tokenizer.clone(), opts).context("starting the engine thread")?;
    let mut engine: Arc<dyn Generator> = Arc::new(handle.clone());
    let mut note = None;
    if let Some(script) = script {
        eprintln!("WARNING: --test-script-file is set: replies to matching prompts are SCRIPTED, not generated ({} rules)", script.rules.len());
        note = Some("test mode: replies to some prompts are scripted (--test-script-file)".to_string());
        engine = Arc::new(lily_server::scripted::ScriptedGenerator::new(engine, tokenizer.clone(), script));
    }
    let info = engine.model_info();
    let request_timeout = (args.request_timeout_s > 0).then(|| Duration::from_secs(args.request_timeout_s));
    let config = ServerConfig {
        api_key: api_key.clone(),
        cors: args.cors,
        max_body_bytes: args.max_body_bytes,
        limits: Limits { max_messages: args.max_messages },
        request_timeout,
        model_note: note,
        sampling_defaults: defaults,
    };
    let app = AppState::new(engine, tokenizer, template, config);

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("lily-http").build().context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.bind).await.with_context(|| format!("binding {}", args.bind))?;
        let addr = listener.local_addr().unwrap_or(args.bind);

        eprintln!("lily serve");
        if demo {
            eprintln!("  model:    {name} ({}) -- DEMO CHECKPOINT WITH RANDOM WEIGHTS: the output is meaningless text", dir.display());
        } else {
            eprintln!("  model:    {name} ({})", dir.display());
        }
        let prepared = if prepared > 0 { format!(", decode steps of 1..={prepared} sequences prepared in {prepared_s:.1}s") } else { String::new() };
        eprintln!("  device:   {backend_name} (loaded in {loaded_s:.1}s{prepared})");
        let mut mem = format!("weights {} on disk", human(checkpoint_bytes(&dir)));
        if let Some(b) = backend_memory {
            mem.push_str(&format!(", backend {}", human(b)));
        }
        if let Some(b) = rss_bytes() {
            mem.push_str(&format!(", process resident {}", human(b)));
        }
        eprintln!("  memory:   {mem}");
        if let Some(r) = kv_room {
            eprintln!("  kv cache: {} tokens shared by all requests (--kv-cache-tokens)", r.total_tokens);
        }
        eprintln!(
            "  context:  {} tokens per sequence; {} generating at once (backend holds {} sequences), queue {}",
            info.context_length, args.max_concurrent, max_sequences, args.max_queue
        );
        eprintln!(
            "  access:   {}{}",
            if api_key.is_some() { "API key required (Authorization: Bearer)" } else { "no API key" },
            if args.cors { ", CORS on" } else { "" }
        );
        eprintln!("  listening on http://{addr}  (OpenAI base URL: http://{addr}/v1)");
        if !addr.ip().is_loopback() && api_key.is_none() {
            eprintln!("WARNING: listening beyond this machine with no API key: anyone who can reach {addr} can use it");
        }
        tracing::info!(%addr, model = %name, "ready");

        let (tx, mut rx) = tokio::sync::watch::channel(false);
        let shutdown = async move {
            wait_for_signal().await;
            let _ = tx.send(true);
        };
        let server = lily_server::serve(listener, app.clone(), shutdown);
        tokio::pin!(server);
        let drain = Duration::from_secs(args.drain_timeout_s);
        tokio::select! {
            r = &mut server => r.context("serving")?,
            _ = async {
                let _ = rx.wait_for(|s| *s).await;
                tokio::time::sleep(drain).await;
            } => {
                eprintln!("requests still running after {}s; stopping anyway", drain.as_secs());
                app.engine.shutdown();
            }
        }
        if tokio::time::timeout(Duration::from_secs(10), handle.stopped()).await.is_err() {
            eprintln!("the engine did not stop within 10s; exiting");
        }
        eprintln!("lily serve: stopped");
        anyhow::Ok(())
    })
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => eprintln!("SIGTERM: draining requests in flight, then exiting"),
                    _ = tokio::signal::ctrl_c() => eprintln!("SIGINT: draining requests in flight, then exiting"),
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
