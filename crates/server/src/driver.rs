//! Runs one request against the engine and yields its steps: started, text
//! (with logprobs), finished or failed.
//!
//! Most requests are one engine submission. A forced tool call
//! (`tool_choice: required` or a named function) with thinking on is two:
//! the model thinks until `</think>` (a stop token), then a second
//! submission continues from the prompt, the thinking and the opening of the
//! call, so the model only writes the call's name and arguments. The prefix
//! cache makes the second prefill cheap. The injected text is yielded as
//! uncounted text, so the client sees it exactly as if the model had written
//! it. With thinking off, the opening of the call is already at the end of
//! the prompt (see `routes.rs`) and this is a single submission.
//!
//! Dropping a [`Driver`] drops the engine stream, which cancels the request.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lily_core::tokenizer::{Tokenizer, STOP_IDS, THINK_END_ID};
use lily_engine::{EngineError, Event, FinishReason, GenerateRequest, SubmitError, TokenLogprob};

use crate::engine::{ArrivalGuard, EventStream, Generator};
use crate::error::ApiError;

/// One thing that happened to the request.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Text {
        text: String,
        logprob: Option<TokenLogprob>,
        /// False for text the server injected (it is not a generated token).
        counted: bool,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Failed(ApiError),
}

/// A call the model must make, opened by the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForcedCall {
    /// The call's opening: `<tool_call>\n<function=NAME>\n` or
    /// `<tool_call>\n<function=` (the model picks the name).
    pub opening: String,
}

impl ForcedCall {
    pub fn named(name: &str) -> Self {
        ForcedCall { opening: format!("<tool_call>\n<function={name}>\n") }
    }

    pub fn any() -> Self {
        ForcedCall { opening: "<tool_call>\n<function=".to_string() }
    }
}

/// The second half of a thinking + forced-call request.
struct AfterThinking {
    call: ForcedCall,
    /// User stop strings, applied to the second half only (a stop string in
    /// the thinking would otherwise be mistaken for the end of it).
    stop_strings: Vec<String>,
}

pub fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull { retry_after, .. } => ApiError::too_many_requests(e.to_string(), retry_after.as_secs().max(1)),
        SubmitError::PromptTooLong { .. } => ApiError::invalid_param("messages", e.to_string()).with_code("context_length_exceeded"),
        SubmitError::MaxTokensTooLarge { .. } => ApiError::invalid_param("max_tokens", e.to_string()).with_code("context_length_exceeded"),
        SubmitError::Invalid(m) => ApiError::invalid(m),
        SubmitError::ShuttingDown => ApiError::unavailable("the server is shutting down", Some(5)),
    }
}

pub fn engine_error(e: &EngineError) -> ApiError {
    match e {
        EngineError::Capacity(m) => ApiError::unavailable(format!("the engine is out of capacity: {m}"), Some(1)),
        EngineError::Stopped(m) => ApiError::unavailable(format!("the engine stopped: {m}"), Some(5)),
        other => ApiError::internal(format!("generation failed: {other}")),
    }
}

pub struct Driver {
    engine: Arc<dyn Generator>,
    tokenizer: Arc<Tokenizer>,
    context: usize,
    base: GenerateRequest,
    stream: Option<EventStream>,
    after: Option<AfterThinking>,
    /// Leading text to yield before anything else (a forced call's opening
    /// when the prompt already holds it).
    preamble: Option<String>,
    generated: Vec<u32>,
    last_text: String,
    first: Option<(usize, usize)>,
    completion_before: usize,
    queue: VecDeque<Step>,
    done: bool,
    timeout: Option<Duration>,
}

impl Driver {
    /// Submits `req`, announced by `arrival` if the handler took one
    /// (`Generator::arrival`). `forced`: a call to force; `thinking`: the
    /// prompt ends inside a think block (so the call comes after it); when
    /// not thinking, the caller has already appended `forced.opening` to the
    /// prompt.
    pub fn start(
        engine: Arc<dyn Generator>,
        tokenizer: Arc<Tokenizer>,
        mut req: GenerateRequest,
        forced: Option<ForcedCall>,
        thinking: bool,
        timeout: Option<Duration>,
        arrival: Option<ArrivalGuard>,
    ) -> Result<Self, ApiError> {
        let context = engine.model_info().context_length;
        let base = req.clone();
        let mut after = None;
        let mut preamble = None;
        match forced {
            Some(call) if thinking => {
                after = Some(AfterThinking { call, stop_strings: std::mem::take(&mut req.stop_strings) });
                req.stop_token_ids.push(THINK_END_ID);
            }
            Some(call) => preamble = Some(call.opening),
            None => {}
        }
        let stream = engine.submit_announced(req, arrival).map_err(submit_error)?;
        Ok(Driver {
            engine,
            tokenizer,
            context,
            base,
            stream: Some(stream),
            after,
            preamble,
            generated: Vec::new(),
            last_text: String::new(),
            first: None,
            completion_before: 0,
            queue: VecDeque::new(),
            done: false,
            timeout,
        })
    }

    /// The next step; `None` after `Finished` or `Failed`.
    pub async fn next(&mut self) -> Option<Step> {
        loop {
            if let Some(step) = self.queue.pop_front() {
                return Some(step);
            }
            if self.done {
                return None;
            }
            let Some(stream) = self.stream.as_mut() else {
                self.done = true;
                return None;
            };
            let Some(event) = stream.next().await else {
                self.finish_with(Step::Failed(ApiError::internal("the engine ended the request without a final event")));
                continue;
            };
            self.on_event(event);
        }
    }

    fn finish_with(&mut self, step: Step) {
        self.done = true;
        self.stream = None;
        self.queue.push_back(step);
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Started { prompt_tokens, cached_tokens } => {
                // The second half of a forced call starts again; the client
                // only hears about the first.
                if self.first.is_none() {
                    self.first = Some((prompt_tokens, cached_tokens));
                    self.queue.push_back(Step::Started { prompt_tokens, cached_tokens });
                    if let Some(text) = self.preamble.take() {
                        self.queue.push_back(Step::Text { text, logprob: None, counted: false });
                    }
                }
            }
            Event::Token { id, text, logprob } => {
                self.generated.push(id);
                if !text.is_empty() {
                    self.last_text.clone_from(&text);
                }
                self.queue.push_back(Step::Text { text, logprob, counted: true });
            }
            Event::Finished { reason, completion_tokens, prompt_tokens, cached_tokens } => {
                let (p, c) = self.first.unwrap_or((prompt_tokens, cached_tokens));
                let total = self.completion_before + completion_tokens;
                if reason == FinishReason::Stop {
                    if let Some(after) = self.after.take() {
                        self.completion_before = total;
                        match self.second_half(after) {
                            Ok(Some(text)) => self.queue.push_back(Step::Text { text, logprob: None, counted: false }),
                            Ok(None) => {
                                self.finish_with(Step::Finished { reason: FinishReason::Length, prompt_tokens: p, completion_tokens: total, cached_tokens: c })
                            }
                            Err(e) => self.finish_with(Step::Failed(e)),
                        }
                        return;
                    }
                }
                if reason == FinishReason::Deadline {
                    let secs = self.timeout.map(|d| d.as_secs()).unwrap_or(0);
                    self.finish_with(Step::Failed(ApiError::timeout(format!("the request exceeded the server's time limit of {secs} s"))));
                    return;
                }
                self.finish_with(Step::Finished { reason, prompt_tokens: p, completion_tokens: total, cached_tokens: c });
            }
            Event::Failed(e) => self.finish_with(Step::Failed(engine_error(&e))),
        }
    }

    /// Submits the call after the thinking; returns the injected text, or
    /// `None` when no room is left to generate.
    fn second_half(&mut self, after: AfterThinking) -> Result<Option<String>, ApiError> {
        let sep = if self.last_text.ends_with('\n') || self.generated.is_empty() { "" } else { "\n" };
        let injected = format!("{sep}</think>\n\n{}", after.call.opening);
        let injected_ids =
            self.tokenizer.encode_with_specials(&injected).map_err(|e| ApiError::internal(format!("cannot encode the forced tool call: {e}")))?;
        // The engine sends the token that stopped the first half (`</think>`,
        // or an EOS) as an event too; the injected text replaces it.
        while self.generated.last().is_some_and(|t| *t == THINK_END_ID || STOP_IDS.contains(t)) {
            self.generated.pop();
        }
        let mut prompt = self.base.prompt.clone();
        prompt.extend_from_slice(&self.generated);
        prompt.extend_from_slice(&injected_ids);
        let left = self.base.max_tokens.saturating_sub(self.completion_before);
        let room = self.context.saturating_sub(prompt.len());
        let max_tokens = left.min(room);
        if max_tokens == 0 {
            return Ok(None);
        }
        let mut req = self.base.clone();
        req.prompt = prompt;
        req.max_tokens = max_tokens;
        req.stop_strings = after.stop_strings;
        self.stream = Some(self.engine.submit(req).map_err(submit_error)?);
        Ok(Some(injected))
    }
}
