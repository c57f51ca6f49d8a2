//! A fake engine for driving the router in-process: it keeps the real
//! engine's contract (validation, Started/Token/Finished, cancel on drop,
//! queue bound, deadline, stop ids, stop strings on token boundaries) but its
//! "model" replies with scripted text chosen by what the prompt contains.

#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, Response};
use http_body_util::BodyExt;
use lily_core::chat::ChatTemplate;
use lily_core::tokenizer::{Tokenizer, STOP_IDS};
use lily_engine::{EngineError, EngineStats, Event, FinishReason, GenerateRequest, ModelInfo, SubmitError, TokenLogprob};
use lily_server::{AppState, EventStream, Generator, ServerConfig};
use tower::ServiceExt;

pub const MODEL: &str = "lily-test";
pub const CONTEXT: usize = 2048;

/// The tokenizer of the tests: the vocabulary with the added-token flags of
/// the real release (12 of the 33 added tokens, `<think>` and `<tool_call>`
/// among them, not marked special), so the injection tests see what a
/// downloaded checkpoint brings.
pub fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let json = lily_synth::tokenizer_json().expect("release-flagged tokenizer.json");
        Arc::new(Tokenizer::from_bytes(&json).expect("tokenizer"))
    })
    .clone()
}

#[derive(Default)]
pub struct Counters {
    pub submitted: AtomicUsize,
    pub live: AtomicUsize,
    pub cancelled: AtomicUsize,
    pub finished: AtomicUsize,
    /// Arrival guards handed out, and those not yet dropped
    /// (`Generator::arrival`).
    pub announced: AtomicUsize,
    pub arriving: AtomicUsize,
    /// `arriving` as each announced submit saw it.
    pub arriving_at_submit: Mutex<Vec<usize>>,
}

struct ArrivalCount(Arc<Counters>);

impl Drop for ArrivalCount {
    fn drop(&mut self) {
        self.0.arriving.fetch_sub(1, Ordering::SeqCst);
    }
}

pub struct FakeEngine {
    /// (prompt substring, reply), first match wins; the last rule should
    /// match everything ("").
    pub rules: Vec<(String, String)>,
    pub token_delay: Duration,
    pub max_live: usize,
    pub fail_with: Option<EngineError>,
    pub counters: Arc<Counters>,
    pub prompts: Mutex<Vec<Vec<u32>>>,
    pub requests: Mutex<Vec<GenerateRequest>>,
}

impl FakeEngine {
    pub fn new(rules: &[(&str, &str)]) -> Self {
        FakeEngine {
            rules: rules.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
            token_delay: Duration::ZERO,
            max_live: usize::MAX,
            fail_with: None,
            counters: Arc::new(Counters::default()),
            prompts: Mutex::new(Vec::new()),
            requests: Mutex::new(Vec::new()),
        }
    }

    pub fn last_prompt_text(&self) -> String {
        let prompts = self.prompts.lock().unwrap();
        tokenizer().decode(prompts.last().unwrap()).unwrap()
    }
}

struct Guard {
    counters: Arc<Counters>,
    done: bool,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.counters.live.fetch_sub(1, Ordering::SeqCst);
        if !self.done {
            self.counters.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

struct Run {
    guard: Guard,
    tokens: Vec<u32>,
    pos: usize,
    req: GenerateRequest,
    prompt_tokens: usize,
    cached: usize,
    text: String,
    decoder: lily_core::tokenizer::StreamDecoder,
    started: bool,
    finished: bool,
    stop_next: bool,
    delay: Duration,
    fail: Option<EngineError>,
}

impl Run {
    fn finish(&mut self, reason: FinishReason, emitted: usize) -> Event {
        self.finished = true;
        self.guard.done = true;
        self.guard.counters.finished.fetch_add(1, Ordering::SeqCst);
        Event::Finished { reason, completion_tokens: emitted, prompt_tokens: self.prompt_tokens, cached_tokens: self.cached }
    }

    async fn next(&mut self) -> Option<Event> {
        if self.finished {
            return None;
        }
        if !self.started {
            self.started = true;
            return Some(Event::Started { prompt_tokens: self.prompt_tokens, cached_tokens: self.cached });
        }
        if self.stop_next {
            return Some(self.finish(FinishReason::Stop, self.pos));
        }
        if let Some(e) = self.fail.take() {
            self.finished = true;
            self.guard.done = true;
            return Some(Event::Failed(e));
        }
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        if self.req.deadline.is_some_and(|d| Instant::now() >= d) {
            return Some(self.finish(FinishReason::Deadline, self.pos));
        }
        if self.pos >= self.req.max_tokens {
            return Some(self.finish(FinishReason::Length, self.pos));
        }
        let Some(&id) = self.tokens.get(self.pos) else {
            return Some(self.finish(FinishReason::Stop, self.pos));
        };
        self.pos += 1;
        if STOP_IDS.contains(&id) || self.req.stop_token_ids.contains(&id) {
            // As the engine does: the stopping token is sent, without text
            // or logprob, then the request finishes.
            self.tokens.truncate(self.pos);
            self.stop_next = true;
            return Some(Event::Token { id, text: String::new(), logprob: None });
        }
        let piece = self.decoder.push(id).unwrap().unwrap_or_default();
        let before = self.text.len();
        self.text.push_str(&piece);
        if let Some(s) = self.req.stop_strings.iter().find_map(|s| self.text.find(s.as_str())) {
            let visible = if s > before { self.text[before..s].to_string() } else { String::new() };
            if !visible.is_empty() {
                // Release what came before the stop string, then stop.
                self.text.truncate(s);
                self.tokens.truncate(self.pos);
                return Some(Event::Token { id, text: visible, logprob: None });
            }
            return Some(self.finish(FinishReason::Stop, self.pos));
        }
        let logprob = self.req.logprobs.map(|n| {
            let tok = tokenizer();
            let bytes = tok.token_bytes(id).unwrap().to_vec();
            let token = String::from_utf8_lossy(&bytes).into_owned();
            TokenLogprob {
                token: token.clone(),
                logprob: -0.25,
                bytes: bytes.clone(),
                top: (0..n).map(|i| (format!("{token}{i}"), -0.25 - i as f32, bytes.clone())).collect(),
            }
        });
        Some(Event::Token { id, text: piece, logprob })
    }
}

impl Generator for FakeEngine {
    fn arrival(&self) -> Option<lily_server::engine::ArrivalGuard> {
        self.counters.announced.fetch_add(1, Ordering::SeqCst);
        self.counters.arriving.fetch_add(1, Ordering::SeqCst);
        Some(Box::new(ArrivalCount(self.counters.clone())))
    }

    /// Records the arrivals held as the request is queued (its own among
    /// them), then ends its own, as the engine does.
    fn submit_announced(&self, req: GenerateRequest, arrival: Option<lily_server::engine::ArrivalGuard>) -> Result<EventStream, SubmitError> {
        self.counters.arriving_at_submit.lock().unwrap().push(self.counters.arriving.load(Ordering::SeqCst));
        let r = self.submit(req);
        drop(arrival);
        r
    }

    fn submit(&self, req: GenerateRequest) -> Result<EventStream, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        if req.prompt.len() >= CONTEXT {
            return Err(SubmitError::PromptTooLong { prompt: req.prompt.len(), max: CONTEXT });
        }
        if req.prompt.len() + req.max_tokens > CONTEXT {
            return Err(SubmitError::MaxTokensTooLarge { prompt: req.prompt.len(), max_tokens: req.max_tokens, max: CONTEXT });
        }
        let live = self.counters.live.load(Ordering::SeqCst);
        if live >= self.max_live {
            return Err(SubmitError::QueueFull { waiting: live, retry_after: Duration::from_secs(2) });
        }
        let tok = tokenizer();
        let text = tok.decode(&req.prompt).unwrap();
        let reply = self.rules.iter().find(|(k, _)| text.contains(k.as_str())).map(|(_, r)| r.clone()).unwrap_or_default();
        let tokens = tok.encode_with_specials(&reply).unwrap();
        // Prefix reuse: the longest common prefix with an earlier prompt.
        let cached = {
            let prompts = self.prompts.lock().unwrap();
            prompts.iter().map(|p| p.iter().zip(&req.prompt).take_while(|(a, b)| a == b).count()).max().unwrap_or(0).min(req.prompt.len() - 1)
        };
        self.prompts.lock().unwrap().push(req.prompt.clone());
        self.requests.lock().unwrap().push(req.clone());
        self.counters.submitted.fetch_add(1, Ordering::SeqCst);
        self.counters.live.fetch_add(1, Ordering::SeqCst);
        let run = Run {
            guard: Guard { counters: self.counters.clone(), done: false },
            tokens,
            pos: 0,
            prompt_tokens: req.prompt.len(),
            cached,
            req,
            text: String::new(),
            decoder: tok.stream_decoder(),
            started: false,
            finished: false,
            stop_next: false,
            delay: self.token_delay,
            fail: self.fail_with.clone(),
        };
        Ok(Box::pin(futures::stream::unfold(run, |mut r| async move {
            let e = r.next().await?;
            Some((e, r))
        })))
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.counters.live.load(Ordering::SeqCst),
            requests_submitted: self.counters.submitted.load(Ordering::SeqCst) as u64,
            decode_batch_sizes: vec![0, 4, 1],
            ..EngineStats::default()
        }
    }

    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            name: MODEL.to_string(),
            backend: "fake".to_string(),
            context_length: CONTEXT,
            vocab_size: 248_320,
            eos_token_ids: STOP_IDS.to_vec(),
            synthetic: true,
        }
    }

    fn shutdown(&self) {}
}

pub fn app_with(engine: Arc<FakeEngine>, config: ServerConfig) -> Arc<AppState> {
    let template = Arc::new(ChatTemplate::default_template().expect("template"));
    AppState::new(engine, tokenizer(), template, config)
}

pub async fn send(app: &Arc<AppState>, req: Request<Body>) -> Response<Body> {
    lily_server::router(app.clone()).oneshot(req).await.unwrap()
}

pub fn post(path: &str, body: &serde_json::Value) -> Request<Body> {
    Request::post(path).header("content-type", "application/json").body(Body::from(body.to_string())).unwrap()
}

pub fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

pub async fn body_text(resp: Response<Body>) -> String {
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

pub async fn json_of(resp: Response<Body>) -> serde_json::Value {
    let text = body_text(resp).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The `data:` payloads of an SSE body, `[DONE]` included as a string.
pub fn sse_events(text: &str) -> Vec<String> {
    assert!(text.ends_with("\n\n") || text.is_empty(), "SSE body must end with a blank line: {text:?}");
    text.split("\n\n")
        .filter(|f| !f.is_empty())
        .map(|f| f.strip_prefix("data: ").unwrap_or_else(|| panic!("frame without `data: `: {f:?}")).to_string())
        .collect()
}

pub async fn next_frame(body: &mut Body) -> Option<String> {
    loop {
        let frame = body.frame().await?.ok()?;
        if let Ok(data) = frame.into_data() {
            if !data.is_empty() {
                return Some(String::from_utf8(data.to_vec()).unwrap());
            }
        }
    }
}

pub async fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..200 {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}
