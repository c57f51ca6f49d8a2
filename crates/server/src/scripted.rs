//! A test hook: replace the model's continuation with scripted text.
//!
//! The demo checkpoint has random weights, so an end-to-end test cannot make
//! it call a tool. `lily serve --test-script-file FILE` (a hidden flag, loud
//! at start-up and in `/v1/models`) wraps the engine in a
//! [`ScriptedGenerator`]: when a prompt contains a rule's `when_prompt_contains`
//! text, the request still goes through the real engine (same validation,
//! queue, prefill and prefix cache, so `Started` and `cached_tokens` are
//! real), but once it has started the model's tokens are dropped (and the
//! engine request cancelled) and the rule's `reply` is tokenised and sent as
//! the generated tokens instead. `max_tokens` and stop token ids (EOS, and
//! the `</think>` stop of a forced call) are honoured; stop strings are not.
//! Prompts that match no rule are served by the model as usual.
//!
//! File format: `{"rules": [{"when_prompt_contains": "...", "reply": "..."}]}`;
//! the first matching rule wins, so put specific rules first.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;

use futures::StreamExt;
use lily_core::tokenizer::{Tokenizer, STOP_IDS};
use lily_engine::{EngineStats, Event, FinishReason, GenerateRequest, ModelInfo, SubmitError, TokenLogprob};
use serde::Deserialize;

use crate::engine::{ArrivalGuard, EventStream, Generator};

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub when_prompt_contains: String,
    pub reply: String,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    pub rules: Vec<Rule>,
}

impl Script {
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

pub struct ScriptedGenerator {
    inner: Arc<dyn Generator>,
    tokenizer: Arc<Tokenizer>,
    script: Script,
}

impl ScriptedGenerator {
    pub fn new(inner: Arc<dyn Generator>, tokenizer: Arc<Tokenizer>, script: Script) -> Self {
        ScriptedGenerator { inner, tokenizer, script }
    }
}

/// Scripted tokens of one request, after the real `Started`.
struct Replay {
    inner: Option<EventStream>,
    tokens: VecDeque<u32>,
    decoder: lily_core::tokenizer::StreamDecoder,
    tokenizer: Arc<Tokenizer>,
    req: GenerateRequest,
    started: Option<(usize, usize)>,
    emitted: usize,
    stop_next: bool,
    done: bool,
}

impl Replay {
    fn finished(&mut self, reason: FinishReason) -> Event {
        self.done = true;
        let (prompt_tokens, cached_tokens) = self.started.unwrap_or((self.req.prompt.len(), 0));
        Event::Finished { reason, completion_tokens: self.emitted, prompt_tokens, cached_tokens }
    }

    async fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        if let Some(inner) = self.inner.as_mut() {
            // Wait for the real admission; anything the model says is dropped.
            loop {
                match inner.next().await {
                    Some(Event::Started { prompt_tokens, cached_tokens }) => {
                        self.started = Some((prompt_tokens, cached_tokens));
                        self.inner = None;
                        return Some(Event::Started { prompt_tokens, cached_tokens });
                    }
                    Some(Event::Failed(e)) => {
                        self.done = true;
                        return Some(Event::Failed(e));
                    }
                    Some(Event::Finished { reason, .. }) => {
                        // Ended before starting (deadline, shutdown).
                        self.inner = None;
                        return Some(self.finished(reason));
                    }
                    Some(Event::Token { .. }) => {}
                    None => {
                        self.done = true;
                        return None;
                    }
                }
            }
        }
        if self.stop_next {
            return Some(self.finished(FinishReason::Stop));
        }
        if self.emitted >= self.req.max_tokens {
            return Some(self.finished(FinishReason::Length));
        }
        let Some(id) = self.tokens.pop_front() else {
            return Some(self.finished(FinishReason::Stop));
        };
        if STOP_IDS.contains(&id) || self.req.stop_token_ids.contains(&id) {
            // As the engine does: the stopping token is sent without text or
            // logprob, then the request finishes.
            self.emitted += 1;
            self.tokens.clear();
            self.stop_next = true;
            return Some(Event::Token { id, text: String::new(), logprob: None });
        }
        self.emitted += 1;
        let text = match self.decoder.push(id) {
            Ok(t) => t.unwrap_or_default(),
            Err(e) => {
                self.done = true;
                return Some(Event::Failed(lily_engine::EngineError::Tokenizer(e.to_string())));
            }
        };
        let logprob = self.req.logprobs.map(|n| {
            let bytes = self.tokenizer.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default();
            let token = String::from_utf8_lossy(&bytes).into_owned();
            TokenLogprob { token: token.clone(), logprob: 0.0, bytes: bytes.clone(), top: if n > 0 { vec![(token, 0.0, bytes)] } else { Vec::new() } }
        });
        Some(Event::Token { id, text, logprob })
    }
}

impl Generator for ScriptedGenerator {
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, SubmitError> {
        self.submit_announced(req, None)
    }

    fn submit_announced(&self, req: GenerateRequest, arrival: Option<ArrivalGuard>) -> Result<EventStream, SubmitError> {
        let prompt = self.tokenizer.decode(&req.prompt).unwrap_or_default();
        let rule = self.script.rules.iter().find(|r| prompt.contains(&r.when_prompt_contains));
        let Some(rule) = rule else {
            return self.inner.submit_announced(req, arrival);
        };
        let tokens = self.tokenizer.encode_with_specials(&rule.reply).map_err(|e| SubmitError::Invalid(format!("scripted reply cannot be encoded: {e}")))?;
        let inner = self.inner.submit_announced(req.clone(), arrival)?;
        tracing::info!(rule = %rule.when_prompt_contains, "test script: replacing the model's reply");
        let replay = Replay {
            inner: Some(inner),
            tokens: tokens.into(),
            decoder: self.tokenizer.stream_decoder(),
            tokenizer: self.tokenizer.clone(),
            req,
            started: None,
            emitted: 0,
            stop_next: false,
            done: false,
        };
        Ok(Box::pin(futures::stream::unfold(replay, |mut r| async move {
            let e = r.next().await?;
            Some((e, r))
        })))
    }

    fn arrival(&self) -> Option<ArrivalGuard> {
        self.inner.arrival()
    }

    fn stats(&self) -> EngineStats {
        self.inner.stats()
    }

    fn model_info(&self) -> ModelInfo {
        self.inner.model_info()
    }

    fn shutdown(&self) {
        self.inner.shutdown()
    }
}
