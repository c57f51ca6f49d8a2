//! The endpoint handlers: chat completions, legacy completions, models,
//! health and metrics.
//!
//! A generation request goes: body bytes -> strict parse -> plan
//! (`validate.rs`) -> chat template and tokens (on a blocking thread: long
//! prompts take a while) -> `Driver::start` (engine submit: queue-full and
//! context errors come back here as proper HTTP statuses) -> either a
//! collected response or an SSE stream. The SSE body owns the driver, so a
//! client that goes away drops it and the engine cancels the request.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, StreamExt};
use lily_engine::{FinishReason, GenerateRequest};
use serde::Serialize;

use crate::state::{unix_now, AppState};
use crate::driver::{Driver, ForcedCall, Step};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChoiceLogprobs, ChunkChoice,
    ChunkDelta, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, FunctionCallOut, FunctionDelta,
    ModelCard, ModelList, ToolCallDelta, ToolCallOut, Usage, UsageField,
};
use crate::output::{Batch, ChatAssembler, ChatPiece, Folded};
use crate::validate::{chat_plan, completion_plan, parse_json, GenerationPlan, PromptPlan, ToolMode};

fn fingerprint() -> String {
    format!("lily-{}", env!("CARGO_PKG_VERSION"))
}

fn random_id(prefix: &str) -> String {
    use rand::distr::{Alphanumeric, SampleString};
    format!("{prefix}{}", Alphanumeric.sample_string(&mut rand::rng(), 24))
}

fn body_bytes(app: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rej| {
        if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(app.config.max_body_bytes)
        } else {
            ApiError::invalid(format!("cannot read the request body: {rej}"))
        }
    })
}

/// Every server answers to `lily` too, so examples work whatever the
/// checkpoint is called; other names are refused, as OpenAI does.
pub const MODEL_ALIAS: &str = "lily";

fn check_model(app: &AppState, model: &str) -> Result<(), ApiError> {
    if model == app.info.name || model == MODEL_ALIAS {
        Ok(())
    } else {
        Err(ApiError::model_not_found(model, &app.info.name))
    }
}

fn check_accepting(app: &AppState) -> Result<(), ApiError> {
    if app.is_draining() {
        Err(ApiError::unavailable("the server is shutting down", Some(5)))
    } else {
        Ok(())
    }
}

fn template_error(e: lily_core::Error) -> ApiError {
    match e {
        lily_core::Error::Template(m) => ApiError::invalid_param("messages", format!("cannot render the chat: {m}")),
        other => ApiError::internal(format!("tokenizer: {other}")),
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("worker task failed: {e}"))))
}

/// Builds the engine request once the prompt is known.
fn engine_request(app: &AppState, prompt: Vec<u32>, gen: &GenerationPlan) -> GenerateRequest {
    let room = app.info.context_length.saturating_sub(prompt.len());
    // With no limit asked for, generate up to the context; at least 1 so an
    // over-long prompt is reported as such by the engine.
    let max_tokens = gen.max_tokens.unwrap_or(room).max(1);
    let mut req = GenerateRequest::new(prompt, max_tokens);
    req.sampling = gen.sampling.clone();
    req.stop_strings = gen.stop.clone();
    req.logprobs = gen.logprobs;
    req.deadline = app.config.request_timeout.map(|d| Instant::now() + d);
    req
}

/// Counts a generation in flight, logs its outcome, and notices a client
/// that left early (the guard is dropped before `complete`).
struct InFlight {
    metrics: Arc<Metrics>,
    id: String,
    arrived: Instant,
    first_token: Option<std::time::Duration>,
    completed: bool,
}

impl InFlight {
    fn new(metrics: Arc<Metrics>, id: &str, arrived: Instant) -> Self {
        metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            metrics,
            id: id.to_string(),
            arrived,
            first_token: None,
            completed: false,
        }
    }

    fn token(&mut self) {
        if self.first_token.is_none() {
            let t = self.arrived.elapsed();
            self.first_token = Some(t);
            self.metrics.ttft.observe(t);
        }
    }

    fn complete(&mut self, usage: &Usage, finish: &str) {
        if self.completed {
            return;
        }
        self.completed = true;
        self.metrics
            .record_usage(usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens);
        let total = self.arrived.elapsed();
        self.metrics.request_duration.observe(total);
        tracing::info!(
            id = %self.id,
            prompt = usage.prompt_tokens,
            cached = usage.prompt_tokens_details.cached_tokens,
            completion = usage.completion_tokens,
            finish,
            ttft_ms = self.first_token.map_or(0, |d| d.as_millis() as u64),
            total_ms = total.as_millis() as u64,
            "request done"
        );
    }

    fn failed(&mut self, e: &ApiError) {
        self.completed = true;
        self.metrics.engine_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(id = %self.id, status = e.status.as_u16(), error = %e.message, "request failed");
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        if !self.completed {
            self.metrics.disconnects.fetch_add(1, Ordering::Relaxed);
            tracing::info!(id = %self.id, "client went away; request cancelled");
        }
    }
}

fn finish_reason(reason: FinishReason, calls: usize) -> Result<&'static str, ApiError> {
    match reason {
        FinishReason::Stop if calls > 0 => Ok("tool_calls"),
        FinishReason::Stop => Ok("stop"),
        FinishReason::Length => Ok("length"),
        FinishReason::Deadline => Err(ApiError::timeout("the request exceeded the server's time limit")),
        FinishReason::Cancelled => Err(ApiError::unavailable("the request was cancelled by the server", Some(1))),
    }
}

fn sse_frame(v: &impl Serialize) -> Bytes {
    match serde_json::to_string(v) {
        Ok(s) => Bytes::from(format!("data: {s}\n\n")),
        Err(e) => Bytes::from(format!(
            "data: {}\n\n",
            ApiError::internal(format!("cannot serialise a chunk: {e}")).body()
        )),
    }
}

const SSE_DONE: &str = "data: [DONE]\n\n";

fn sse_response(frames: impl futures::Stream<Item = Bytes> + Send + 'static) -> Response {
    let body = Body::from_stream(frames.map(Ok::<_, Infallible>));
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Ask reverse proxies not to buffer the stream.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

// ---------------------------------------------------------------- chat ----

pub async fn chat_completions(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let arrived = Instant::now();
    match chat_inner(app, body, arrived).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(app: Arc<AppState>, body: Result<Bytes, BytesRejection>, arrived: Instant) -> Result<Response, ApiError> {
    let bytes = body_bytes(&app, body)?;
    let req: ChatCompletionRequest = parse_json(&bytes)?;
    check_model(&app, &req.model)?;
    let plan = chat_plan(&req, &app.config.limits, &app.config.sampling_defaults)?;
    check_accepting(&app)?;

    let forced = match &plan.tool_mode {
        ToolMode::Required => Some(ForcedCall::any()),
        ToolMode::Named(name) => Some(ForcedCall::named(name)),
        ToolMode::Off | ToolMode::Auto => None,
    };
    let prompt = {
        let (template, tokenizer) = (app.template.clone(), app.tokenizer.clone());
        let render = plan.render.clone();
        let opening = forced.as_ref().filter(|_| !plan.thinking).map(|f| f.opening.clone());
        blocking(move || {
            let mut ids = template.render_tokens(&render, &tokenizer).map_err(template_error)?;
            if let Some(opening) = opening {
                // Thinking off: the call is opened at the end of the prompt.
                ids.extend(tokenizer.encode_with_specials(&opening).map_err(template_error)?);
            }
            Ok(ids)
        })
        .await?
    };
    let greq = engine_request(&app, prompt, &plan.gen);
    let driver = Driver::start(
        app.engine.clone(),
        app.tokenizer.clone(),
        greq,
        forced,
        plan.thinking,
        app.config.request_timeout,
    )?;
    let tools = (plan.tool_mode != ToolMode::Off).then(|| plan.schemas.clone());
    let asm = ChatAssembler::new(plan.thinking, tools);
    let asm = if plan.single_call { asm.single_call() } else { asm };
    let meta = ChunkMeta {
        id: random_id("chatcmpl-"),
        created: unix_now(),
        model: app.info.name.clone(),
        include_usage: plan.gen.include_usage,
        logprobs: plan.gen.logprobs.is_some(),
        thinking: plan.thinking,
    };
    let flight = InFlight::new(app.metrics.clone(), &meta.id, arrived);
    if plan.gen.stream {
        Ok(chat_stream(driver, asm, meta, flight))
    } else {
        chat_collect(driver, asm, meta, flight).await.map(|c| Json(c).into_response())
    }
}

struct ChunkMeta {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
    thinking: bool,
}

impl ChunkMeta {
    fn chunk(&self, delta: ChunkDelta, logprobs: Option<ChoiceLogprobs>, finish: Option<&'static str>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                logprobs,
                finish_reason: finish,
            }],
            usage: if self.include_usage { UsageField::Null } else { UsageField::Absent },
            system_fingerprint: fingerprint(),
        }
    }

    fn usage_chunk(&self, usage: Usage) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices: Vec::new(),
            usage: UsageField::Some(usage),
            system_fingerprint: fingerprint(),
        }
    }

    fn logprobs(&self, lps: Vec<crate::openai::TokenLogprobOut>) -> Option<ChoiceLogprobs> {
        (self.logprobs && !lps.is_empty()).then_some(ChoiceLogprobs {
            content: lps,
            refusal: None,
        })
    }

    fn usage(&self, prompt: usize, completion: usize, cached: usize, asm: &ChatAssembler) -> Usage {
        Usage::new(prompt, completion, cached, self.thinking.then(|| asm.reasoning_tokens()))
    }
}

async fn chat_collect(mut driver: Driver, mut asm: ChatAssembler, meta: ChunkMeta, mut flight: InFlight) -> Result<ChatCompletion, ApiError> {
    let mut folded = Folded::default();
    let (reason, prompt, completion, cached) = loop {
        match driver.next().await {
            Some(Step::Started { .. }) => {}
            Some(Step::Text { text, logprob, counted }) => {
                if counted {
                    flight.token();
                }
                folded.absorb(asm.push(&text, logprob.as_ref(), counted));
            }
            Some(Step::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => break (reason, prompt_tokens, completion_tokens, cached_tokens),
            Some(Step::Failed(e)) => {
                flight.failed(&e);
                return Err(e);
            }
            None => {
                let e = ApiError::internal("the engine stopped answering");
                flight.failed(&e);
                return Err(e);
            }
        }
    };
    folded.absorb(asm.finish());
    let finish = finish_reason(reason, asm.calls()).inspect_err(|e| flight.failed(e))?;
    let usage = meta.usage(prompt, completion, cached, &asm);
    flight.complete(&usage, finish);
    let calls: Vec<ToolCallOut> = folded
        .calls
        .calls
        .into_iter()
        .map(|c| ToolCallOut {
            id: c.id,
            kind: "function",
            function: FunctionCallOut {
                name: c.name,
                arguments: c.arguments,
            },
        })
        .collect();
    let content = folded.calls.content;
    let content = if content.is_empty() && !calls.is_empty() { None } else { Some(content) };
    let reasoning = (!folded.reasoning.is_empty()).then_some(folded.reasoning);
    let logprobs = if meta.logprobs {
        Some(ChoiceLogprobs {
            content: folded.logprobs,
            refusal: None,
        })
    } else {
        None
    };
    Ok(ChatCompletion {
        id: meta.id,
        object: "chat.completion",
        created: meta.created,
        model: meta.model,
        choices: vec![ChatChoice {
            index: 0,
            message: AssistantMessage {
                role: "assistant",
                content,
                reasoning_content: reasoning,
                tool_calls: calls,
                refusal: None,
            },
            logprobs,
            finish_reason: finish,
        }],
        usage,
        system_fingerprint: fingerprint(),
    })
}

/// Chunks for one batch of pieces; logprobs ride on the first chunk.
fn piece_chunks(meta: &ChunkMeta, batch: Batch) -> Vec<ChatCompletionChunk> {
    let mut logprobs = meta.logprobs(batch.logprobs);
    let mut out = Vec::with_capacity(batch.pieces.len());
    for piece in batch.pieces {
        let delta = match piece {
            ChatPiece::Reasoning(t) => ChunkDelta {
                reasoning_content: Some(t),
                ..ChunkDelta::default()
            },
            ChatPiece::Content(t) => ChunkDelta {
                content: Some(t),
                ..ChunkDelta::default()
            },
            ChatPiece::CallStart { index, id, name } => ChunkDelta {
                tool_calls: Some(vec![ToolCallDelta {
                    index,
                    id: Some(id),
                    kind: Some("function"),
                    function: FunctionDelta {
                        name: Some(name),
                        arguments: Some(String::new()),
                    },
                }]),
                ..ChunkDelta::default()
            },
            ChatPiece::Arguments { index, fragment } => ChunkDelta {
                tool_calls: Some(vec![ToolCallDelta {
                    index,
                    id: None,
                    kind: None,
                    function: FunctionDelta {
                        name: None,
                        arguments: Some(fragment),
                    },
                }]),
                ..ChunkDelta::default()
            },
        };
        out.push(meta.chunk(delta, logprobs.take(), None));
    }
    out
}

struct ChatStream {
    driver: Driver,
    asm: ChatAssembler,
    meta: ChunkMeta,
    flight: InFlight,
    sent_role: bool,
    ended: bool,
}

impl ChatStream {
    /// The frames for the next step; `None` when the stream is over.
    async fn step(&mut self) -> Option<Vec<Bytes>> {
        if self.ended {
            return None;
        }
        if !self.sent_role {
            self.sent_role = true;
            let delta = ChunkDelta {
                role: Some("assistant"),
                content: Some(String::new()),
                ..ChunkDelta::default()
            };
            return Some(vec![sse_frame(&self.meta.chunk(delta, None, None))]);
        }
        match self.driver.next().await {
            Some(Step::Started { .. }) => Some(Vec::new()),
            Some(Step::Text { text, logprob, counted }) => {
                if counted {
                    self.flight.token();
                }
                let batch = self.asm.push(&text, logprob.as_ref(), counted);
                Some(piece_chunks(&self.meta, batch).iter().map(sse_frame).collect())
            }
            Some(Step::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                self.ended = true;
                let mut batch = self.asm.finish();
                let leftover = std::mem::take(&mut batch.logprobs);
                let mut frames: Vec<Bytes> = piece_chunks(&self.meta, batch).iter().map(sse_frame).collect();
                let finish = match finish_reason(reason, self.asm.calls()) {
                    Ok(f) => f,
                    Err(e) => {
                        self.flight.failed(&e);
                        frames.push(sse_frame(&e.body()));
                        return Some(frames);
                    }
                };
                let last = self.meta.chunk(ChunkDelta::default(), self.meta.logprobs(leftover), Some(finish));
                frames.push(sse_frame(&last));
                let usage = self.meta.usage(prompt_tokens, completion_tokens, cached_tokens, &self.asm);
                self.flight.complete(&usage, finish);
                if self.meta.include_usage {
                    frames.push(sse_frame(&self.meta.usage_chunk(usage)));
                }
                frames.push(Bytes::from_static(SSE_DONE.as_bytes()));
                Some(frames)
            }
            Some(Step::Failed(e)) => {
                self.ended = true;
                self.flight.failed(&e);
                Some(vec![sse_frame(&e.body())])
            }
            None => {
                self.ended = true;
                let e = ApiError::internal("the engine stopped answering");
                self.flight.failed(&e);
                Some(vec![sse_frame(&e.body())])
            }
        }
    }
}

fn chat_stream(driver: Driver, asm: ChatAssembler, meta: ChunkMeta, flight: InFlight) -> Response {
    let state = ChatStream {
        driver,
        asm,
        meta,
        flight,
        sent_role: false,
        ended: false,
    };
    let frames = stream::unfold(state, |mut st| async move {
        let frames = st.step().await?;
        Some((stream::iter(frames), st))
    })
    .flatten();
    sse_response(frames)
}

// ---------------------------------------------------------- completions ----

pub async fn completions(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let arrived = Instant::now();
    match completions_inner(app, body, arrived).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

struct TextMeta {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
}

impl TextMeta {
    fn completion(&self, text: String, logprobs: Option<CompletionLogprobs>, finish: Option<&'static str>, usage: UsageField) -> Completion {
        Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: vec![CompletionChoice {
                index: 0,
                text,
                logprobs,
                finish_reason: finish,
            }],
            usage,
            system_fingerprint: fingerprint(),
        }
    }
}

/// Legacy logprobs of one token, at byte `offset` of the returned text.
fn legacy_logprobs(acc: &mut CompletionLogprobs, lp: &lily_engine::TokenLogprob, offset: usize) {
    acc.tokens.push(lp.token.clone());
    acc.token_logprobs.push(lp.logprob);
    let mut top = serde_json::Map::new();
    for (t, l, _) in &lp.top {
        top.insert(t.clone(), serde_json::json!(l));
    }
    acc.top_logprobs.push(top);
    acc.text_offset.push(offset);
}

async fn completions_inner(app: Arc<AppState>, body: Result<Bytes, BytesRejection>, arrived: Instant) -> Result<Response, ApiError> {
    let bytes = body_bytes(&app, body)?;
    let req: CompletionRequest = parse_json(&bytes)?;
    check_model(&app, &req.model)?;
    let plan = completion_plan(&req, &app.config.sampling_defaults)?;
    check_accepting(&app)?;
    let tokenizer = app.tokenizer.clone();
    let (prompt, prompt_text) = match plan.prompt.clone() {
        // A raw prompt is the model's input as written: special-token text
        // in it is markup (unlike chat messages, whose text never is).
        PromptPlan::Text(s) => {
            let ids = blocking(move || {
                tokenizer
                    .encode_with_specials(&s)
                    .map(|ids| (ids, s))
                    .map_err(|e| ApiError::internal(format!("tokenizer: {e}")))
            })
            .await?;
            (ids.0, ids.1)
        }
        PromptPlan::Tokens(ids) => {
            let text = if plan.echo {
                tokenizer
                    .decode(&ids)
                    .map_err(|e| ApiError::invalid_param("prompt", format!("cannot decode the prompt: {e}")))?
            } else {
                String::new()
            };
            (ids, text)
        }
    };
    let greq = engine_request(&app, prompt, &plan.gen);
    let mut driver = Driver::start(
        app.engine.clone(),
        app.tokenizer.clone(),
        greq,
        None,
        false,
        app.config.request_timeout,
    )?;
    let meta = TextMeta {
        id: random_id("cmpl-"),
        created: unix_now(),
        model: app.info.name.clone(),
        include_usage: plan.gen.include_usage,
        logprobs: plan.gen.logprobs.is_some(),
    };
    let echo = if plan.echo { prompt_text } else { String::new() };
    let mut flight = InFlight::new(app.metrics.clone(), &meta.id, arrived);

    if !plan.gen.stream {
        let mut text = echo;
        let mut lps = CompletionLogprobs::default();
        loop {
            match driver.next().await {
                Some(Step::Started { .. }) => {}
                Some(Step::Text { text: t, logprob, counted }) => {
                    if counted {
                        flight.token();
                    }
                    if let Some(lp) = &logprob {
                        legacy_logprobs(&mut lps, lp, text.len());
                    }
                    text.push_str(&t);
                }
                Some(Step::Finished {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                }) => {
                    let finish = finish_reason(reason, 0).inspect_err(|e| flight.failed(e))?;
                    let usage = Usage::new(prompt_tokens, completion_tokens, cached_tokens, None);
                    flight.complete(&usage, finish);
                    let c = meta.completion(text, meta.logprobs.then_some(lps), Some(finish), UsageField::Some(usage));
                    return Ok(Json(c).into_response());
                }
                Some(Step::Failed(e)) => {
                    flight.failed(&e);
                    return Err(e);
                }
                None => {
                    let e = ApiError::internal("the engine stopped answering");
                    flight.failed(&e);
                    return Err(e);
                }
            }
        }
    }

    struct TextStream {
        driver: Driver,
        meta: TextMeta,
        flight: InFlight,
        echo: Option<String>,
        offset: usize,
        ended: bool,
    }
    let state = TextStream {
        driver,
        meta,
        flight,
        echo: (!echo.is_empty()).then_some(echo),
        offset: 0,
        ended: false,
    };
    let frames = stream::unfold(state, |mut st| async move {
        if st.ended {
            return None;
        }
        let no_usage = || UsageField::Absent;
        let usage_null = |m: &TextMeta| if m.include_usage { UsageField::Null } else { no_usage() };
        if let Some(echo) = st.echo.take() {
            st.offset = echo.len();
            let c = st.meta.completion(echo, None, None, usage_null(&st.meta));
            return Some((stream::iter(vec![sse_frame(&c)]), st));
        }
        let frames = match st.driver.next().await {
            Some(Step::Started { .. }) => Vec::new(),
            Some(Step::Text { text, logprob, counted }) => {
                if counted {
                    st.flight.token();
                }
                let lps = logprob.as_ref().filter(|_| st.meta.logprobs).map(|lp| {
                    let mut acc = CompletionLogprobs::default();
                    legacy_logprobs(&mut acc, lp, st.offset);
                    acc
                });
                st.offset += text.len();
                if text.is_empty() && lps.is_none() {
                    Vec::new()
                } else {
                    vec![sse_frame(&st.meta.completion(text, lps, None, usage_null(&st.meta)))]
                }
            }
            Some(Step::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                st.ended = true;
                match finish_reason(reason, 0) {
                    Ok(finish) => {
                        let usage = Usage::new(prompt_tokens, completion_tokens, cached_tokens, None);
                        st.flight.complete(&usage, finish);
                        let mut frames = vec![sse_frame(&st.meta.completion(
                            String::new(),
                            None,
                            Some(finish),
                            usage_null(&st.meta),
                        ))];
                        if st.meta.include_usage {
                            let mut c = st.meta.completion(String::new(), None, None, UsageField::Some(usage));
                            c.choices.clear();
                            frames.push(sse_frame(&c));
                        }
                        frames.push(Bytes::from_static(SSE_DONE.as_bytes()));
                        frames
                    }
                    Err(e) => {
                        st.flight.failed(&e);
                        vec![sse_frame(&e.body())]
                    }
                }
            }
            Some(Step::Failed(e)) => {
                st.ended = true;
                st.flight.failed(&e);
                vec![sse_frame(&e.body())]
            }
            None => {
                st.ended = true;
                let e = ApiError::internal("the engine stopped answering");
                st.flight.failed(&e);
                vec![sse_frame(&e.body())]
            }
        };
        Some((stream::iter(frames), st))
    })
    .flatten();
    Ok(sse_response(frames))
}

// ------------------------------------------------------- small endpoints ----

fn model_card(app: &AppState) -> ModelCard {
    let mut notes = Vec::new();
    if app.info.synthetic {
        notes.push("random weights (a synthetic demo checkpoint): the output is meaningless text".to_string());
    }
    if let Some(n) = &app.config.model_note {
        notes.push(n.clone());
    }
    ModelCard {
        id: app.info.name.clone(),
        object: "model",
        created: app.started,
        owned_by: "lily",
        context_length: app.info.context_length,
        backend: app.info.backend.clone(),
        synthetic: app.info.synthetic,
        note: (!notes.is_empty()).then(|| notes.join("; ")),
    }
}

pub async fn list_models(State(app): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![model_card(&app)],
    })
}

pub async fn get_model(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<ModelCard>, ApiError> {
    if id == app.info.name || id == MODEL_ALIAS {
        Ok(Json(model_card(&app)))
    } else {
        Err(ApiError::model_not_found(&id, &app.info.name).with_param("id"))
    }
}

pub async fn health(State(app): State<Arc<AppState>>) -> Response {
    let stats = app.engine.stats();
    let status = if app.is_draining() { "draining" } else { "ok" };
    let body = serde_json::json!({
        "status": status,
        "model": app.info.name,
        "synthetic": app.info.synthetic,
        "running": stats.running,
        "waiting": stats.waiting,
    });
    let code = if app.is_draining() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    (code, Json(body)).into_response()
}

pub async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    let text = app.metrics.render(&app.engine.stats());
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_frames_are_single_data_lines() {
        let meta = ChunkMeta {
            id: "chatcmpl-x".into(),
            created: 1,
            model: "m".into(),
            include_usage: true,
            logprobs: false,
            thinking: false,
        };
        let delta = ChunkDelta {
            content: Some("line one\nline \"two\"\n\n".into()),
            ..ChunkDelta::default()
        };
        let frame = sse_frame(&meta.chunk(delta, None, None));
        let text = std::str::from_utf8(&frame).unwrap();
        // One `data:` line (newlines in content are JSON-escaped), then a blank line.
        assert!(text.starts_with("data: {") && text.ends_with("}\n\n"), "{text:?}");
        assert_eq!(text.matches('\n').count(), 2);
        let v: serde_json::Value = serde_json::from_str(&text[6..text.len() - 2]).unwrap();
        assert_eq!(v["choices"][0]["delta"]["content"], "line one\nline \"two\"\n\n");
        assert!(v["usage"].is_null() && v.as_object().unwrap().contains_key("usage"));
        assert_eq!(SSE_DONE, "data: [DONE]\n\n");
    }

    #[test]
    fn finish_reasons() {
        assert_eq!(finish_reason(FinishReason::Stop, 0), Ok("stop"));
        assert_eq!(finish_reason(FinishReason::Stop, 2), Ok("tool_calls"));
        assert_eq!(finish_reason(FinishReason::Length, 1), Ok("length"));
        assert_eq!(finish_reason(FinishReason::Deadline, 0).unwrap_err().status, StatusCode::GATEWAY_TIMEOUT);
    }
}
