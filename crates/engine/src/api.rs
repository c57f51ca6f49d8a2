//! The engine's public surface: what a caller (the HTTP server, `lily
//! generate`) sends in and what it gets back.
//!
//! This file owns the request and event types, the submit-time errors, the
//! stats snapshot, and `EngineHandle`/`RequestStream`, the cheap cloneable
//! handle that talks to the single engine thread through a queue. It does not
//! own scheduling, sampling or the prefix cache (see `engine.rs`,
//! `scheduler.rs`, `sampling.rs`, `prefix_cache.rs`). Changes here are
//! additive only: the server is written against these names.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use lily_model::MixedSteps;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

/// Most alternatives `GenerateRequest::logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How the next token is chosen. OpenAI semantics: the default is
/// temperature 1 and top-p 1 (plain sampling from the model's distribution);
/// `temperature == 0` means greedy (argmax), whatever the other knobs say
/// about truncation.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise logits are divided by it before softmax.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability
    /// sum reaches `top_p` (1.0 = off).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p` times the top token's
    /// probability (0.0 = off).
    pub min_p: f32,
    /// OpenAI: subtract this once from the logit of every token that already
    /// appeared in the generated text.
    pub presence_penalty: f32,
    /// OpenAI: subtract this times the token's count in the generated text.
    pub frequency_penalty: f32,
    /// HF: for tokens seen in prompt or output, divide a positive logit by it
    /// and multiply a negative one (1.0 = off).
    pub repetition_penalty: f32,
    /// Seeds the request's draws (`lily_model::sample`: draw `k` uses
    /// Philox4x32-10 keyed by the seed with counter `k`); the same seed and
    /// request give the same text. `None` draws a random seed once, when
    /// the request is admitted.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Argmax decoding.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..SamplingParams::default() }
    }

    /// Whether the parameters are in range; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        let finite = |name: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(format!("{name} must be a finite number, got {v}"))
            }
        };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        if self.temperature < 0.0 {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(format!("presence_penalty must be in [-2, 2], got {}", self.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(format!("frequency_penalty must be in [-2, 2], got {}", self.frequency_penalty));
        }
        if self.repetition_penalty <= 0.0 {
            return Err(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        Ok(())
    }
}

/// One generation: a tokenised prompt and how to continue it.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    /// Most tokens to generate (>= 1); prompt + max_tokens must fit the
    /// engine's context.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops before any of these strings would appear in the
    /// text; the stop string itself is never emitted.
    pub stop_strings: Vec<String>,
    /// Token ids that end generation, added to the model's EOS ids. The
    /// stopping token is not emitted as text.
    pub stop_token_ids: Vec<u32>,
    /// `None`: no logprobs. `Some(n)`: the chosen token's logprob plus the `n`
    /// most likely alternatives (n <= MAX_TOP_LOGPROBS).
    pub logprobs: Option<usize>,
    /// After this instant the request finishes with `FinishReason::Deadline`.
    pub deadline: Option<Instant>,
    /// The front end's client the request came from (an opaque id, e.g.
    /// of its connection), when known. An idle engine reached by a request
    /// from another client than the request that ended last holds its first
    /// prefill for a short quiet gap, for other clients' requests right
    /// behind it (`engine::gather_arrivals`): a burst of clients starting
    /// together, whose requests reach the server a fraction of a
    /// millisecond apart. One client's next request never waits.
    pub client: Option<u64>,
}

impl GenerateRequest {
    /// A request with default sampling and no stops, logprobs or deadline.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Self {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_strings: Vec::new(),
            stop_token_ids: Vec::new(),
            logprobs: None,
            deadline: None,
            client: None,
        }
    }
}

/// Log-probability of a generated token and, when asked, its alternatives.
/// Logprobs are the log-softmax of the logits after the penalties
/// (presence/frequency/repetition) and before temperature and truncation, so
/// they describe the model (as penalised) and do not collapse under top-k.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (lossy if the token is part of a UTF-8 character).
    pub token: String,
    pub logprob: f32,
    /// The token's raw bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at this position: (text, logprob, bytes),
    /// most likely first.
    pub top: Vec<(String, f32, Vec<u8>)>,
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS id, a request stop id or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The stream was dropped or cancelled.
    Cancelled,
    /// The request's deadline passed.
    Deadline,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Deadline => "deadline",
        }
    }
}

/// A failure of one accepted request; the engine keeps serving others.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The backend failed on this request (device error, out of memory...).
    #[error("backend: {0}")]
    Backend(String),
    /// The backend has no room for this sequence right now.
    #[error("capacity: {0}")]
    Capacity(String),
    /// Detokenisation failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The engine stopped before the request could finish.
    #[error("engine stopped: {0}")]
    Stopped(String),
}

/// What the engine sends about one request, in order: `Started`, zero or
/// more `Token`, then exactly one of `Finished` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Admitted; `cached_tokens` of the prompt came from the prefix cache.
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// One generated token. `text` is the UTF-8-safe text delta released by
    /// this token: empty while bytes of a character or of a possible stop
    /// string are held back, longer when held text is released. Special
    /// tokens (`<think>`, `<tool_call>`) appear as their text. The token that
    /// ends a request on a stop id (EOS or `stop_token_ids`) is sent too and
    /// counted in `completion_tokens`, but its own text is never in `text`
    /// and its `logprob` is `None`; the token completing a stop string
    /// carries only the text before the stop string.
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The request ended. On `Stop` and `Length`, held-back text that
    /// turned out not to be a stop string was released in the last `Token`
    /// event; on `Cancelled` and `Deadline` it is dropped (at most a partial
    /// stop string or the bytes of one character).
    Finished {
        reason: FinishReason,
        completion_tokens: usize,
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Failed(EngineError),
}

/// Why `EngineHandle::submit` refused a request (nothing was started).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// Too many requests are waiting; retry later (HTTP 429/503 with
    /// Retry-After).
    #[error("the engine queue is full ({waiting} waiting); retry in {}s", retry_after.as_secs().max(1))]
    QueueFull { waiting: usize, retry_after: Duration },
    /// The prompt alone leaves no room to generate (HTTP 400).
    #[error("the prompt has {prompt} tokens; the context holds {max}, and at least one must be left to generate")]
    PromptTooLong { prompt: usize, max: usize },
    /// prompt + max_tokens exceeds the context (HTTP 400).
    #[error("prompt ({prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of {max} tokens; at most {} can be generated", max - prompt)]
    MaxTokensTooLarge { prompt: usize, max_tokens: usize, max: usize },
    /// Malformed request: empty prompt, token id beyond the vocabulary, bad
    /// sampling values, max_tokens 0, too many logprobs (HTTP 400).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The engine is draining or stopped (HTTP 503).
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// Snapshot of the engine's counters for `/metrics`. Counters are totals
/// since start; gauges are the state at the time of the snapshot.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Gauge: admitted requests (prefilling, decoding, or preempted and
    /// waiting to be recomputed).
    pub running: usize,
    /// Gauge: requests accepted but not admitted yet.
    pub waiting: usize,
    pub requests_submitted: u64,
    /// Answered with `Finished` (any reason, cancellations included).
    pub requests_finished: u64,
    /// Answered with `Failed`.
    pub requests_failed: u64,
    /// `Finished` with `Cancelled` (a subset of `requests_finished`).
    pub requests_cancelled: u64,
    /// Prompt tokens of admitted requests (cached ones included).
    pub prompt_tokens: u64,
    /// Prompt tokens actually run through the backend.
    pub prefill_tokens: u64,
    pub generated_tokens: u64,
    /// Requests that restored a prefix from the cache / looked it up.
    pub prefix_cache_hits: u64,
    pub prefix_cache_lookups: u64,
    /// Prompt tokens served from the cache.
    pub prefix_cache_tokens: u64,
    /// Gauge: snapshots held and the tokens they cover.
    pub prefix_cache_entries: usize,
    pub prefix_cache_held_tokens: usize,
    pub prefix_cache_evictions: u64,
    pub decode_steps: u64,
    /// `decode_batch_sizes[b]` = number of decode steps run with batch size b.
    pub decode_batch_sizes: Vec<u64>,
    /// Times a running request gave its KV memory back to older ones and
    /// waited to be recomputed (out of KV memory).
    pub preemptions: u64,
    /// Gauge: (free, total) tokens of the backend's KV pool, when it has one.
    pub kv_tokens: Option<(usize, usize)>,
    /// Times an engine with nothing running held its first prefill for
    /// requests still arriving (`EngineOptions::arrival_wait`), and the
    /// requests those waits gathered beyond the first.
    pub arrival_waits: u64,
    pub arrival_gathered: u64,
    /// Decode steps that rode in a prefill call beside prompt chunks
    /// (`EngineOptions::mixed_steps`; counted in `decode_steps` too).
    pub mixed_steps: u64,
    /// Where the engine thread's time goes (seconds since start): `step_s`
    /// in engine steps that had work; of it, `decode_submit_s` inside
    /// `submit_decode` (staging and launching a step), `decode_wait_s`
    /// inside `collect_decode` (blocked until the device finishes a step:
    /// the device is the bottleneck while this grows with `step_s`) and
    /// `prefill_s` inside prefill calls. The rest is host work: admission,
    /// detokenising, streaming. `arrival_wait_s`, outside the steps: waiting
    /// for arriving requests before a first prefill.
    pub time: EngineTime,
}

/// The engine thread's time by activity (see `EngineStats::time`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineTime {
    pub step_s: f64,
    pub decode_submit_s: f64,
    pub decode_wait_s: f64,
    pub prefill_s: f64,
    pub arrival_wait_s: f64,
}

/// What is being served.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelInfo {
    /// Model id for `/v1/models`.
    pub name: String,
    /// The backend's own name ("cpu", "cuda:0 NVIDIA H200", ...).
    pub backend: String,
    /// Longest prompt + completion the engine accepts.
    pub context_length: usize,
    pub vocab_size: usize,
    pub eos_token_ids: Vec<u32>,
    /// The weights are random (a `lily synth` or built-in demo checkpoint).
    pub synthetic: bool,
}

/// How the engine runs. `Default` suits a server; tests shrink it.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Reported by `model_info().name`.
    pub model_name: String,
    /// Reported by `model_info().synthetic`.
    pub synthetic: bool,
    /// Most sequences decoded together in one step (also capped by the
    /// backend's `max_sequences`, less the prefix cache's snapshots).
    pub max_batch: usize,
    /// Most requests waiting for admission; beyond it submit says QueueFull.
    pub max_queue: usize,
    /// Prompt tokens prefilled per engine step, for all requests together
    /// (oldest first; a preempted request's recompute counts too; a prompt
    /// whose rest past the budget is at most a quarter of it finishes in the
    /// same step instead of taking a step for its tail). Every step also
    /// runs one decode step for every generating request, so a running
    /// stream waits at most this much prefill (and that quarter) between
    /// two tokens however many prompts arrive, while a long prompt takes
    /// about `prompt / prefill_chunk` steps to start. The chunks of several
    /// requests within it go to the backend in one `prefill_batch` call (on
    /// the GPU one pass, costing little more than one request's alone), so
    /// a larger budget starts more joining requests per step. At least 1.
    pub prefill_chunk: usize,
    /// Context cap below the backend's `max_seq_len` (None = the backend's).
    pub max_seq_len: Option<usize>,
    /// Prefix-cache budget, in tokens held by snapshots (0 disables it).
    pub prefix_cache_tokens: usize,
    /// Most snapshots held at once (each one holds a backend sequence).
    pub prefix_cache_max_entries: usize,
    /// A snapshot is taken every `snapshot_interval` prompt tokens.
    pub snapshot_interval: usize,
    /// Submit each decode step before collecting the previous one
    /// (`Backend::submit_decode`), so the device never waits for the host
    /// to stream tokens. A request that stops has had one more step
    /// computed, whose draw is discarded. Same tokens either way.
    pub run_ahead: bool,
    /// Longest an engine with nothing running waits, once a request has
    /// come, for the requests a front end is still preparing (`Arrival`s
    /// held: being rendered and tokenized, not yet queued) and for the
    /// follow-ups of requests that ended together with the last one, so
    /// that requests which arrive together start in one prefill pass
    /// instead of the first alone and the rest after it; a request from
    /// another client than the one whose request ended last
    /// (`GenerateRequest::client`) waits a twelfth of it for others right
    /// behind it. It waits only while such requests exist or are expected
    /// (one client's next request never waits) and never while a stream
    /// is generating. Zero disables it.
    pub arrival_wait: Duration,
    /// Whether a step whose decode batch and prompt chunks are both due
    /// runs them as one prefill call, every generating request a one-token
    /// part beside the chunks (`Backend::mixed_steps`): each weight is then
    /// read once for both, and running streams wait for one pass instead
    /// of a decode step and a pass.
    pub mixed_steps: MixPolicy,
}

/// When the engine mixes its decode rows into the prefill call
/// (`EngineOptions::mixed_steps`), by what the backend says of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MixPolicy {
    /// Where the backend says it pays (`MixedSteps::Pays`).
    #[default]
    Auto,
    /// Wherever the backend allows it (`Pays` or `Possible`).
    On,
    /// Never: a decode step and the prefill apart, every step.
    Off,
}

impl MixPolicy {
    /// Whether a backend that says `said` gets mixed steps.
    pub fn mixes(self, said: MixedSteps) -> bool {
        match self {
            MixPolicy::Auto => said == MixedSteps::Pays,
            MixPolicy::On => said != MixedSteps::Never,
            MixPolicy::Off => false,
        }
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            model_name: "lily".to_string(),
            synthetic: false,
            max_batch: 64,
            max_queue: 256,
            prefill_chunk: 512,
            max_seq_len: None,
            prefix_cache_tokens: 262_144,
            prefix_cache_max_entries: 64,
            snapshot_interval: 256,
            run_ahead: true,
            arrival_wait: DEFAULT_ARRIVAL_WAIT,
            mixed_steps: MixPolicy::Auto,
        }
    }
}

/// `EngineOptions::arrival_wait` by default. Measured on the H200 (8
/// streaming clients that send their next request when the last one ends,
/// docs/perf/2026-12-02-h200-s17-5e0d8fc-prefill-passes.txt): every round
/// prefilled one request alone (265 tokens, 20 ms) and the other seven in
/// the next pass (71 ms), because the first was submitted while the rest
/// were still being tokenized (~1.1 ms each). With the wait (4 ms then),
/// session 44's 8-client rounds gathered all 7 in 3.0-4.1 ms from the
/// first request's submission (Python client threads ~0.45 ms apart); a
/// request is now prepared in ~0.3 ms instead of ~1 ms, so the first is
/// submitted sooner and the same burst takes ~1 ms longer from there:
/// 6 ms. The bound matters only while requests keep coming (or a front
/// end holds an `Arrival` for long); expected ones that do not come cost
/// all of it when none of them came, a quarter of it after the last that
/// did (`engine::gather_arrivals`).
pub const DEFAULT_ARRIVAL_WAIT: Duration = Duration::from_millis(6);

/// A request a front end has taken and is still preparing (rendering,
/// tokenizing); take it with `EngineHandle::arrival` as the request comes
/// in, and hand it over with the request (`EngineHandle::submit_announced`:
/// the engine drops it once the request is in its queue) or drop it if the
/// request is refused. While any is held, an engine with nothing running
/// waits for them before its first prefill (at most
/// `EngineOptions::arrival_wait`), so requests that come together share one
/// prefill pass; handed over, it ends exactly when its request is queued,
/// so the engine neither waits for a request it already has nor starts
/// between a request's announcement and its arrival in the queue.
pub struct Arrival {
    shared: Arc<Shared>,
}

impl Drop for Arrival {
    fn drop(&mut self) {
        self.shared.arriving.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A submitted request as the engine thread receives it.
pub(crate) struct Submission {
    pub(crate) id: u64,
    pub(crate) req: GenerateRequest,
    pub(crate) events: UnboundedSender<Event>,
    pub(crate) cancel: Arc<AtomicBool>,
    /// Its front end's announcement (`Arrival` or the like), dropped by the
    /// engine thread once the request is queued.
    pub(crate) arrival: Option<Box<dyn Send>>,
}

/// Messages to the engine thread. (Nearly every message is a `Submit`,
/// one a request; boxing it would only add an allocation to each.)
#[allow(clippy::large_enum_variant)]
pub(crate) enum Command {
    Submit(Submission),
    /// Stop accepting, finish what is running and waiting, then exit.
    Shutdown,
}

/// State shared by every handle and the engine thread. The command sender
/// lives in the handles, not here, so that dropping the last handle
/// disconnects the queue and lets the engine thread drain and exit.
pub(crate) struct Shared {
    pub(crate) info: ModelInfo,
    pub(crate) max_queue: usize,
    /// Submitted and not yet admitted (the engine decrements on admission).
    pub(crate) waiting: AtomicUsize,
    /// Requests a front end has announced that are not yet queued (`Arrival`).
    pub(crate) arriving: AtomicUsize,
    pub(crate) shutting_down: AtomicBool,
    pub(crate) next_id: AtomicU64,
    pub(crate) stats: Mutex<EngineStats>,
    stopped: Mutex<bool>,
    stopped_cv: Condvar,
    stopped_tx: tokio::sync::watch::Sender<bool>,
}

impl Shared {
    pub(crate) fn new(info: ModelInfo, max_queue: usize) -> Self {
        Shared {
            info,
            max_queue,
            waiting: AtomicUsize::new(0),
            arriving: AtomicUsize::new(0),
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            stats: Mutex::new(EngineStats::default()),
            stopped: Mutex::new(false),
            stopped_cv: Condvar::new(),
            stopped_tx: tokio::sync::watch::channel(false).0,
        }
    }

    /// Called by the engine thread as its last act.
    pub(crate) fn mark_stopped(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        // The watch first: whoever wakes from the condvar may check
        // `is_stopped` at once.
        self.stopped_tx.send_replace(true);
        if let Ok(mut s) = self.stopped.lock() {
            *s = true;
        }
        self.stopped_cv.notify_all();
    }

    pub(crate) fn with_stats(&self, f: impl FnOnce(&mut EngineStats)) {
        // A poisoned lock only means a panic elsewhere; the counters are
        // still usable.
        let mut guard = match self.stats.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut guard);
    }
}

/// Cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) shared: Arc<Shared>,
    pub(crate) commands: std::sync::mpsc::Sender<Command>,
}

impl EngineHandle {
    /// Validates and queues a request. On success the stream yields its
    /// events; dropping the stream cancels the request.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError> {
        self.submit_announced(req, None)
    }

    /// `submit` for a request announced by `arrival` (see `Arrival`), which
    /// the engine releases once the request is in its queue (or which is
    /// dropped here if the request is refused).
    pub fn submit_announced(&self, req: GenerateRequest, arrival: Option<Box<dyn Send>>) -> Result<RequestStream, SubmitError> {
        let shared = &self.shared;
        if shared.shutting_down.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        validate(&req, &shared.info)?;
        // Reserve a queue slot before sending so concurrent submitters cannot
        // overshoot the bound.
        let reserved = shared.waiting.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| (w < shared.max_queue).then_some(w + 1));
        if let Err(waiting) = reserved {
            return Err(SubmitError::QueueFull { waiting, retry_after: Duration::from_secs(1) });
        }
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let sub = Submission { id, req, events: tx, cancel: cancel.clone(), arrival };
        if self.commands.send(Command::Submit(sub)).is_err() {
            shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::ShuttingDown);
        }
        shared.with_stats(|s| s.requests_submitted += 1);
        Ok(RequestStream { id, rx, cancel })
    }

    /// Announces a request that will be submitted soon (see `Arrival`).
    pub fn arrival(&self) -> Arrival {
        self.shared.arriving.fetch_add(1, Ordering::SeqCst);
        Arrival { shared: self.shared.clone() }
    }

    /// Counters and gauges for `/metrics`.
    pub fn stats(&self) -> EngineStats {
        let mut s = match self.shared.stats.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        };
        s.waiting = self.shared.waiting.load(Ordering::SeqCst);
        s
    }

    pub fn model_info(&self) -> ModelInfo {
        self.shared.info.clone()
    }

    /// Stops accepting requests (submit answers ShuttingDown) and lets the
    /// engine finish every accepted request, then exit. Returns at once; use
    /// `wait_stopped` / `stopped` to wait for the drain.
    pub fn shutdown(&self) {
        self.shared.shutting_down.store(true, Ordering::SeqCst);
        // A send error means the engine thread is already gone.
        let _ = self.commands.send(Command::Shutdown);
    }

    pub fn is_stopped(&self) -> bool {
        *self.shared.stopped_tx.borrow()
    }

    /// Blocks until the engine thread has exited or `timeout` passes;
    /// returns whether it has exited.
    pub fn wait_stopped(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut stopped = match self.shared.stopped.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        while !*stopped {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            stopped = match self.shared.stopped_cv.wait_timeout(stopped, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    /// Resolves when the engine thread has exited.
    pub async fn stopped(&self) {
        let mut rx = self.shared.stopped_tx.subscribe();
        // An error means the sender is gone, which only happens once the
        // shared state is dropped: stopped either way.
        let _ = rx.wait_for(|s| *s).await;
    }
}

fn validate(req: &GenerateRequest, info: &ModelInfo) -> Result<(), SubmitError> {
    if req.prompt.is_empty() {
        return Err(SubmitError::Invalid("the prompt is empty".into()));
    }
    if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
        return Err(SubmitError::Invalid(format!("prompt token id {bad} is beyond the vocabulary ({} ids)", info.vocab_size)));
    }
    if req.max_tokens == 0 {
        return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
    }
    if let Some(n) = req.logprobs {
        if n > MAX_TOP_LOGPROBS {
            return Err(SubmitError::Invalid(format!("at most {MAX_TOP_LOGPROBS} top logprobs may be requested, got {n}")));
        }
    }
    if req.stop_strings.iter().any(|s| s.is_empty()) {
        return Err(SubmitError::Invalid("stop strings must not be empty".into()));
    }
    req.sampling.validate().map_err(SubmitError::Invalid)?;
    let max = info.context_length;
    if req.prompt.len() >= max {
        return Err(SubmitError::PromptTooLong { prompt: req.prompt.len(), max });
    }
    if req.prompt.len() + req.max_tokens > max {
        return Err(SubmitError::MaxTokensTooLarge { prompt: req.prompt.len(), max_tokens: req.max_tokens, max });
    }
    Ok(())
}

/// The events of one request. Dropping it cancels the request; the engine
/// frees its sequence at the next step.
pub struct RequestStream {
    id: u64,
    rx: UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl RequestStream {
    /// Engine-wide unique id of the request (for logs).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event; `None` once the request's final event was received.
    pub async fn recv(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// Blocking variant for synchronous callers (not inside a tokio runtime).
    pub fn blocking_recv(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }

    /// Asks the engine to stop the request; it still answers with
    /// `Finished { reason: Cancelled }` unless it had already finished.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

impl futures_core::Stream for RequestStream {
    type Item = Event;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        self.get_mut().rx.poll_recv(cx)
    }
}
