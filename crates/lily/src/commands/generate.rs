//! `lily generate`: one prompt or one chat message through the engine,
//! streamed to stdout.
//!
//! It owns the flags, building the prompt (raw text, or the checkpoint's
//! chat template around a user message) and printing. Sampling, stops and
//! detokenisation are the engine's (`lily_engine`), exactly as the server
//! uses them, so what this prints is what the API would return. Progress and
//! a one-line summary go to stderr, the generated text alone to stdout.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use lily_core::chat::{ChatMessage, ChatRenderRequest, ChatTemplate};
use lily_core::tokenizer::Tokenizer;
use lily_engine::{Engine, EngineOptions, Event, GenerateRequest, SamplingParams};

use crate::backend::{open_backend, Device};

/// Flags of `lily generate`.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "chat"])))]
pub struct Args {
    /// Checkpoint directory (config.json, safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Raw prompt, tokenised as is; special-token text such as
    /// `<|im_start|>` becomes the special token, so a hand-written chat
    /// format works.
    #[arg(long)]
    prompt: Option<String>,
    /// A user message, wrapped in the checkpoint's chat template (special
    /// tokens in it stay plain text).
    #[arg(long)]
    chat: Option<String>,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: skip the model's thinking (an empty think block).
    #[arg(long, requires = "chat")]
    no_think: bool,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 = greedy. Unset sampling flags take the checkpoint's
    /// generation_config.json values, else OpenAI's defaults.
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    top_p: Option<f32>,
    /// 0 = off.
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    min_p: Option<f32>,
    #[arg(long)]
    presence_penalty: Option<f32>,
    #[arg(long)]
    frequency_penalty: Option<f32>,
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Same seed, same text.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop before this string (repeatable); it is not printed.
    #[arg(long = "stop")]
    stop: Vec<String>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let tokenizer = Arc::new(Tokenizer::from_dir(&args.model).with_context(|| format!("loading the tokenizer of {}", args.model.display()))?);
    let prompt = build_prompt(&args, &tokenizer)?;
    let sampling = sampling_params(&args)?;

    let load = Instant::now();
    let backend = open_backend(&args.model, args.device, None, &mut |_, _| {})?;
    let vocab = backend.config().vocab_size;
    if tokenizer.vocab_size() > vocab {
        bail!(
            "the tokenizer of {} defines {} ids but the model's vocabulary has only {vocab}; this checkpoint cannot generate text with it",
            args.model.display(),
            tokenizer.vocab_size()
        );
    }
    eprintln!("loaded {} on {} in {:.1}s", args.model.display(), backend.name(), load.elapsed().as_secs_f64());

    let opts = EngineOptions {
        model_name: model_name(&args.model),
        max_batch: 1,
        max_queue: 1,
        // One request: nothing to reuse.
        prefix_cache_tokens: 0,
        ..EngineOptions::default()
    };
    let engine = Engine::start(backend, tokenizer, opts).context("starting the engine thread")?;
    let request = GenerateRequest { sampling, stop_strings: args.stop.clone(), ..GenerateRequest::new(prompt, args.max_tokens) };
    let mut stream = engine.submit(request)?;

    let start = Instant::now();
    let mut first_token = None;
    let mut stdout = std::io::stdout().lock();
    let mut outcome = Err(anyhow::anyhow!("the engine stopped without finishing the request"));
    while let Some(event) = stream.blocking_recv() {
        match event {
            Event::Started { .. } => {}
            Event::Token { text, .. } => {
                first_token.get_or_insert_with(|| start.elapsed());
                stdout.write_all(text.as_bytes())?;
                stdout.flush()?;
            }
            Event::Finished { reason, completion_tokens, prompt_tokens, .. } => {
                outcome = Ok((reason, completion_tokens, prompt_tokens));
                break;
            }
            Event::Failed(e) => {
                outcome = Err(anyhow::anyhow!("generation failed: {e}"));
                break;
            }
        }
    }
    writeln!(stdout)?;
    drop(stdout);
    engine.shutdown();
    let (reason, completion, prompt_tokens) = outcome?;
    let total = start.elapsed().as_secs_f64();
    let ttft = first_token.map_or(total, |d| d.as_secs_f64());
    let decode_tps = if completion > 1 && total > ttft { (completion - 1) as f64 / (total - ttft) } else { 0.0 };
    eprintln!(
        "[{prompt_tokens} prompt tokens, {completion} generated, finish: {}; first token {:.2}s ({:.1} prompt tok/s), decode {:.1} tok/s]",
        reason.as_str(),
        ttft,
        prompt_tokens as f64 / ttft.max(1e-9),
        decode_tps
    );
    Ok(())
}

fn build_prompt(args: &Args, tokenizer: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    let ids = match (&args.prompt, &args.chat) {
        (Some(text), _) => tokenizer.encode_with_specials(text)?,
        (None, Some(user)) => {
            let template = match ChatTemplate::from_dir(&args.model) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("warning: {e}; using Lily's built-in Qwen3.6 chat template");
                    ChatTemplate::default_template()?
                }
            };
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(ChatMessage::system(system.clone()));
            }
            messages.push(ChatMessage::user(user.clone()));
            let req = ChatRenderRequest { messages, enable_thinking: !args.no_think, ..ChatRenderRequest::default() };
            template.render_tokens(&req, tokenizer)?
        }
        (None, None) => bail!("give --prompt or --chat"),
    };
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    Ok(ids)
}

/// Flags over generation_config.json over OpenAI's defaults.
fn sampling_params(args: &Args) -> anyhow::Result<SamplingParams> {
    let gen = read_generation_config(&args.model)?;
    let from_file = |key: &str| gen.as_ref().and_then(|g| g.get(key)).and_then(serde_json::Value::as_f64);
    let d = SamplingParams::default();
    let p = SamplingParams {
        temperature: args.temperature.or(from_file("temperature").map(|v| v as f32)).unwrap_or(d.temperature),
        top_p: args.top_p.or(from_file("top_p").map(|v| v as f32)).unwrap_or(d.top_p),
        top_k: args.top_k.or(from_file("top_k").map(|v| v as usize)).unwrap_or(d.top_k),
        min_p: args.min_p.or(from_file("min_p").map(|v| v as f32)).unwrap_or(d.min_p),
        presence_penalty: args.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: args.frequency_penalty.unwrap_or(d.frequency_penalty),
        repetition_penalty: args.repetition_penalty.or(from_file("repetition_penalty").map(|v| v as f32)).unwrap_or(d.repetition_penalty),
        seed: args.seed,
    };
    p.validate().map_err(|e| anyhow::anyhow!("sampling flags: {e}"))?;
    Ok(p)
}

/// `generation_config.json` if the checkpoint has one.
fn read_generation_config(dir: &Path) -> anyhow::Result<Option<serde_json::Value>> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let v = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(Some(v))
}

fn model_name(dir: &Path) -> String {
    dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned())
}
