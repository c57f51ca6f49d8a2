//! One generation's engine steps turned into an HTTP answer: a collected
//! JSON response or an SSE stream, the same for every endpoint.
//!
//! [`Generation`] is the one loop over the driver's steps: it counts the
//! request in flight (first token, usage, failures, clients that leave), asks
//! the endpoint's [`Shape`] to turn text into pieces, flushes what the shape
//! held back at the end, and decides the finish reason. [`respond`] then
//! either folds the pieces into one response or streams them as chunks,
//! with the final chunk, the optional usage chunk and `[DONE]` after them.
//! What differs between chat and legacy completions (the chunk and response
//! types, the opening chunk, logprob formats) is the shape's, in `shapes.rs`;
//! this file knows neither wire format.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, StreamExt};
use lily_engine::{FinishReason, TokenLogprob};
use serde::Serialize;

use crate::driver::{Driver, Step};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::Usage;

/// What one endpoint makes of the generated text, streamed or collected.
pub trait Shape {
    /// What the text of one token (or the end of output) turns into.
    type Piece;
    /// One streamed chunk.
    type Chunk: Serialize;
    /// The collected response.
    type Response: Serialize;

    /// The text released by one token (`counted`: it was generated; false
    /// for text the server injected).
    fn push(&mut self, text: String, logprob: Option<TokenLogprob>, counted: bool) -> Self::Piece;
    /// End of output: whatever was held back.
    fn flush(&mut self) -> Self::Piece;
    /// Tool calls made so far: a stop after calls finishes as `tool_calls`.
    fn calls(&self) -> usize;
    fn usage(&self, prompt: usize, completion: usize, cached: usize) -> Usage;

    /// Streamed: whether a usage chunk goes before `[DONE]`.
    fn include_usage(&self) -> bool;
    /// Streamed: the chunk sent before the engine's first step, if any.
    fn opening(&mut self) -> Option<Self::Chunk>;
    fn chunks(&self, piece: Self::Piece) -> Vec<Self::Chunk>;
    /// Streamed: the chunks that end the output: the flushed piece's, then,
    /// unless the request failed (`finish` is None), the finish reason's.
    fn closing(&self, flushed: Self::Piece, finish: Option<&'static str>) -> Vec<Self::Chunk>;
    fn usage_chunk(&self, usage: Usage) -> Self::Chunk;

    /// Collected: adds a piece to the response.
    fn absorb(&mut self, piece: Self::Piece);
    fn response(self, finish: &'static str, usage: Usage) -> Self::Response;
}

/// Counts a generation in flight, logs its outcome, and notices a client
/// that left early (the guard is dropped before `complete`).
pub struct InFlight {
    metrics: Arc<Metrics>,
    id: String,
    arrived: Instant,
    first_token: Option<Duration>,
    completed: bool,
}

impl InFlight {
    pub fn new(metrics: Arc<Metrics>, id: &str, arrived: Instant) -> Self {
        metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight { metrics, id: id.to_string(), arrived, first_token: None, completed: false }
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
        self.metrics.record_usage(usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens);
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

/// What the loop hands on: a piece of output, the end, or a failure.
enum Outcome<P> {
    Piece(P),
    /// The engine finished: what the shape held back, then the finish
    /// reason and usage (or why the request failed after all).
    Finished {
        flushed: P,
        end: Result<(&'static str, Usage), ApiError>,
    },
    Failed(ApiError),
}

/// The one loop over a request's steps. It is over once it has returned
/// `Finished` or `Failed`.
struct Generation<S> {
    driver: Driver,
    shape: S,
    flight: InFlight,
}

impl<S: Shape> Generation<S> {
    async fn next(&mut self) -> Outcome<S::Piece> {
        loop {
            match self.driver.next().await {
                Some(Step::Started { .. }) => {}
                Some(Step::Text { text, logprob, counted }) => {
                    if counted {
                        self.flight.token();
                    }
                    return Outcome::Piece(self.shape.push(text, logprob, counted));
                }
                Some(Step::Finished { reason, prompt_tokens, completion_tokens, cached_tokens }) => {
                    // Flushed first: held-back text may hold a tool call,
                    // which decides the finish reason.
                    let flushed = self.shape.flush();
                    let end = match finish_reason(reason, self.shape.calls()) {
                        Ok(finish) => {
                            let usage = self.shape.usage(prompt_tokens, completion_tokens, cached_tokens);
                            self.flight.complete(&usage, finish);
                            Ok((finish, usage))
                        }
                        Err(e) => {
                            self.flight.failed(&e);
                            Err(e)
                        }
                    };
                    return Outcome::Finished { flushed, end };
                }
                Some(Step::Failed(e)) => return self.fail(e),
                None => return self.fail(ApiError::internal("the engine stopped answering")),
            }
        }
    }

    fn fail(&mut self, e: ApiError) -> Outcome<S::Piece> {
        self.flight.failed(&e);
        Outcome::Failed(e)
    }
}

/// Runs the request to its end and answers with one JSON response, or
/// streams it as SSE. The answer owns the driver, so a client that goes away
/// drops it and the engine cancels the request.
pub async fn respond<S>(driver: Driver, shape: S, flight: InFlight, stream: bool) -> Result<Response, ApiError>
where
    S: Shape + Send + 'static,
{
    let generation = Generation { driver, shape, flight };
    if stream {
        Ok(sse_stream(generation))
    } else {
        collect(generation).await.map(|r| Json(r).into_response())
    }
}

async fn collect<S: Shape>(mut generation: Generation<S>) -> Result<S::Response, ApiError> {
    loop {
        match generation.next().await {
            Outcome::Piece(piece) => generation.shape.absorb(piece),
            Outcome::Finished { flushed, end } => {
                generation.shape.absorb(flushed);
                let (finish, usage) = end?;
                return Ok(generation.shape.response(finish, usage));
            }
            Outcome::Failed(e) => return Err(e),
        }
    }
}

pub fn sse_frame(v: &impl Serialize) -> Bytes {
    match serde_json::to_string(v) {
        Ok(s) => Bytes::from(format!("data: {s}\n\n")),
        Err(e) => Bytes::from(format!("data: {}\n\n", ApiError::internal(format!("cannot serialise a chunk: {e}")).body())),
    }
}

const SSE_DONE: &str = "data: [DONE]\n\n";

/// A streamed generation: the opening chunk first, then one step's frames
/// at a time until the end.
struct Streamed<S> {
    generation: Generation<S>,
    opened: bool,
    ended: bool,
}

impl<S: Shape> Streamed<S> {
    /// The frames for the next step; `None` when the stream is over.
    async fn step(&mut self) -> Option<Vec<Bytes>> {
        if self.ended {
            return None;
        }
        if !self.opened {
            self.opened = true;
            if let Some(chunk) = self.generation.shape.opening() {
                return Some(vec![sse_frame(&chunk)]);
            }
        }
        let outcome = self.generation.next().await;
        let shape = &self.generation.shape;
        let frames = match outcome {
            Outcome::Piece(piece) => shape.chunks(piece).iter().map(sse_frame).collect(),
            Outcome::Finished { flushed, end } => {
                self.ended = true;
                let finish = end.as_ref().ok().map(|(finish, _)| *finish);
                let mut frames: Vec<Bytes> = shape.closing(flushed, finish).iter().map(sse_frame).collect();
                match end {
                    Ok((_, usage)) => {
                        if shape.include_usage() {
                            frames.push(sse_frame(&shape.usage_chunk(usage)));
                        }
                        frames.push(Bytes::from_static(SSE_DONE.as_bytes()));
                    }
                    Err(e) => frames.push(sse_frame(&e.body())),
                }
                frames
            }
            Outcome::Failed(e) => {
                self.ended = true;
                vec![sse_frame(&e.body())]
            }
        };
        Some(frames)
    }
}

fn sse_stream<S: Shape + Send + 'static>(generation: Generation<S>) -> Response {
    let state = Streamed { generation, opened: false, ended: false };
    let frames = stream::unfold(state, |mut st| async move {
        let frames = st.step().await?;
        Some((stream::iter(frames), st))
    })
    .flatten();
    let body = Body::from_stream(frames.map(Ok::<_, Infallible>));
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Ask reverse proxies not to buffer the stream.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn sse_frames_are_single_data_lines() {
        let chunk = serde_json::json!({"content": "line one\nline \"two\"\n\n", "usage": null});
        let frame = sse_frame(&chunk);
        let text = std::str::from_utf8(&frame).unwrap();
        // One `data:` line (newlines in content are JSON-escaped), then a blank line.
        assert!(text.starts_with("data: {") && text.ends_with("}\n\n"), "{text:?}");
        assert_eq!(text.matches('\n').count(), 2);
        let v: serde_json::Value = serde_json::from_str(&text[6..text.len() - 2]).unwrap();
        assert_eq!(v["content"], "line one\nline \"two\"\n\n");
        assert_eq!(SSE_DONE, "data: [DONE]\n\n");
    }

    #[test]
    fn finish_reasons() {
        assert_eq!(finish_reason(FinishReason::Stop, 0), Ok("stop"));
        assert_eq!(finish_reason(FinishReason::Stop, 2), Ok("tool_calls"));
        assert_eq!(finish_reason(FinishReason::Length, 1), Ok("length"));
        assert_eq!(finish_reason(FinishReason::Deadline, 0).unwrap_err().status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(finish_reason(FinishReason::Cancelled, 0).unwrap_err().status, StatusCode::SERVICE_UNAVAILABLE);
    }
}
