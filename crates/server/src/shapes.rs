//! The two answer shapes: a chat completion and a legacy text completion,
//! as [`Shape`]s for the loop in `respond.rs`.
//!
//! A shape owns what differs between the endpoints: the chunk and response
//! types, the opening chunk (the chat's role, a completion's echoed prompt),
//! how logprobs are written, and the reasoning and tool calls of a chat. The
//! loop owns what they share: events, errors, usage, finish reasons,
//! disconnects and SSE framing.

use lily_engine::TokenLogprob;

use crate::openai::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChoiceLogprobs, ChunkChoice, ChunkDelta, Completion, CompletionChoice,
    CompletionLogprobs, Envelope, FunctionCallOut, FunctionDelta, TokenLogprobOut, ToolCallDelta, ToolCallOut, Usage, UsageField,
};
use crate::output::{Batch, ChatAssembler, ChatPiece, Folded};
use crate::respond::Shape;
use crate::state::unix_now;
use crate::validate::GenerationPlan;

fn fingerprint() -> String {
    format!("lily-{}", env!("CARGO_PKG_VERSION"))
}

fn random_id(prefix: &str) -> String {
    use rand::distr::{Alphanumeric, SampleString};
    format!("{prefix}{}", Alphanumeric.sample_string(&mut rand::rng(), 24))
}

/// What every chunk and response of one request repeats.
pub struct Meta {
    pub id: String,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
}

impl Meta {
    /// `prefix`: `chatcmpl-` or `cmpl-`, as OpenAI's ids start.
    pub fn new(prefix: &str, model: &str, gen: &GenerationPlan) -> Self {
        Meta { id: random_id(prefix), created: unix_now(), model: model.to_string(), include_usage: gen.include_usage, logprobs: gen.logprobs.is_some() }
    }

    fn envelope<C>(&self, object: &'static str, choices: Vec<C>, usage: UsageField) -> Envelope<C> {
        Envelope { id: self.id.clone(), object, created: self.created, model: self.model.clone(), choices, usage, system_fingerprint: fingerprint() }
    }

    /// `usage` of a chunk before the last: `null` when usage was asked for
    /// (as OpenAI sends it), absent otherwise.
    fn pending_usage(&self) -> UsageField {
        if self.include_usage {
            UsageField::Null
        } else {
            UsageField::Absent
        }
    }
}

// ---------------------------------------------------------------- chat ----

/// The `object` of a streamed chat chunk.
const CHUNK: &str = "chat.completion.chunk";

/// A chat completion: reasoning, content and tool calls from the assembler.
pub struct ChatShape {
    meta: Meta,
    asm: ChatAssembler,
    /// The prompt opened a think block: usage counts reasoning tokens.
    thinking: bool,
    /// The collected message.
    folded: Folded,
}

impl ChatShape {
    pub fn new(meta: Meta, asm: ChatAssembler, thinking: bool) -> Self {
        ChatShape { meta, asm, thinking, folded: Folded::default() }
    }

    fn chunk(&self, delta: ChunkDelta, logprobs: Option<ChoiceLogprobs>, finish: Option<&'static str>) -> ChatCompletionChunk {
        let choice = ChunkChoice { index: 0, delta, logprobs, finish_reason: finish };
        self.meta.envelope(CHUNK, vec![choice], self.meta.pending_usage())
    }

    fn logprobs(&self, lps: Vec<TokenLogprobOut>) -> Option<ChoiceLogprobs> {
        (self.meta.logprobs && !lps.is_empty()).then_some(ChoiceLogprobs { content: lps, refusal: None })
    }
}

fn tool_call_delta(index: usize, id: Option<String>, name: Option<String>, arguments: String) -> ChunkDelta {
    ChunkDelta {
        tool_calls: Some(vec![ToolCallDelta {
            index,
            kind: id.is_some().then_some("function"),
            id,
            function: FunctionDelta { name, arguments: Some(arguments) },
        }]),
        ..ChunkDelta::default()
    }
}

impl Shape for ChatShape {
    type Piece = Batch;
    type Chunk = ChatCompletionChunk;
    type Response = ChatCompletion;

    fn push(&mut self, text: String, logprob: Option<TokenLogprob>, counted: bool) -> Batch {
        self.asm.push(&text, logprob.as_ref(), counted)
    }

    fn flush(&mut self) -> Batch {
        self.asm.finish()
    }

    fn calls(&self) -> usize {
        self.asm.calls()
    }

    fn usage(&self, prompt: usize, completion: usize, cached: usize) -> Usage {
        Usage::new(prompt, completion, cached, self.thinking.then(|| self.asm.reasoning_tokens()))
    }

    fn include_usage(&self) -> bool {
        self.meta.include_usage
    }

    fn opening(&mut self) -> Option<ChatCompletionChunk> {
        let delta = ChunkDelta { role: Some("assistant"), content: Some(String::new()), ..ChunkDelta::default() };
        Some(self.chunk(delta, None, None))
    }

    /// One chunk a piece; the batch's logprobs ride on the first.
    fn chunks(&self, batch: Batch) -> Vec<ChatCompletionChunk> {
        let mut logprobs = self.logprobs(batch.logprobs);
        let mut out = Vec::with_capacity(batch.pieces.len());
        for piece in batch.pieces {
            let delta = match piece {
                ChatPiece::Reasoning(t) => ChunkDelta { reasoning_content: Some(t), ..ChunkDelta::default() },
                ChatPiece::Content(t) => ChunkDelta { content: Some(t), ..ChunkDelta::default() },
                ChatPiece::CallStart { index, id, name } => tool_call_delta(index, Some(id), Some(name), String::new()),
                ChatPiece::Arguments { index, fragment } => tool_call_delta(index, None, None, fragment),
            };
            out.push(self.chunk(delta, logprobs.take(), None));
        }
        out
    }

    /// The last batch's logprobs go on the finish chunk: the batch may have
    /// no piece to carry them.
    fn closing(&self, mut flushed: Batch, finish: Option<&'static str>) -> Vec<ChatCompletionChunk> {
        let leftover = std::mem::take(&mut flushed.logprobs);
        let mut out = self.chunks(flushed);
        if let Some(finish) = finish {
            out.push(self.chunk(ChunkDelta::default(), self.logprobs(leftover), Some(finish)));
        }
        out
    }

    fn usage_chunk(&self, usage: Usage) -> ChatCompletionChunk {
        self.meta.envelope(CHUNK, Vec::new(), UsageField::Some(usage))
    }

    fn absorb(&mut self, batch: Batch) {
        self.folded.absorb(batch);
    }

    fn response(self, finish: &'static str, usage: Usage) -> ChatCompletion {
        let folded = self.folded;
        let calls: Vec<ToolCallOut> = folded
            .calls
            .calls
            .into_iter()
            .map(|c| ToolCallOut { id: c.id, kind: "function", function: FunctionCallOut { name: c.name, arguments: c.arguments } })
            .collect();
        let content = folded.calls.content;
        let content = if content.is_empty() && !calls.is_empty() { None } else { Some(content) };
        let reasoning = (!folded.reasoning.is_empty()).then_some(folded.reasoning);
        let logprobs = self.meta.logprobs.then_some(ChoiceLogprobs { content: folded.logprobs, refusal: None });
        ChatCompletion {
            id: self.meta.id,
            object: "chat.completion",
            created: self.meta.created,
            model: self.meta.model,
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage { role: "assistant", content, reasoning_content: reasoning, tool_calls: calls, refusal: None },
                logprobs,
                finish_reason: finish,
            }],
            usage,
            system_fingerprint: fingerprint(),
        }
    }
}

// ---------------------------------------------------------- completions ----

/// The `object` of a legacy completion, streamed or not.
const TEXT: &str = "text_completion";

/// The text of one token, at byte `offset` of the returned text.
pub struct TextPiece {
    text: String,
    logprob: Option<TokenLogprob>,
    offset: usize,
}

/// A legacy text completion: the text as generated, after the prompt when
/// it is echoed.
pub struct TextShape {
    meta: Meta,
    /// The echoed prompt, until the stream's opening chunk sends it.
    echo: Option<String>,
    /// Bytes of text returned so far, echo included (logprob offsets).
    offset: usize,
    /// The collected text and logprobs.
    text: String,
    logprobs: CompletionLogprobs,
}

impl TextShape {
    /// `echo`: the prompt's text when it is echoed, else empty.
    pub fn new(meta: Meta, echo: String) -> Self {
        TextShape { meta, offset: echo.len(), text: echo.clone(), echo: (!echo.is_empty()).then_some(echo), logprobs: CompletionLogprobs::default() }
    }

    fn chunk(&self, text: String, logprobs: Option<CompletionLogprobs>, finish: Option<&'static str>) -> Completion {
        self.meta.envelope(TEXT, vec![choice(text, logprobs, finish)], self.meta.pending_usage())
    }
}

fn choice(text: String, logprobs: Option<CompletionLogprobs>, finish: Option<&'static str>) -> CompletionChoice {
    CompletionChoice { index: 0, text, logprobs, finish_reason: finish }
}

/// Legacy logprobs of one token, at byte `offset` of the returned text.
fn legacy_logprobs(acc: &mut CompletionLogprobs, lp: &TokenLogprob, offset: usize) {
    acc.tokens.push(lp.token.clone());
    acc.token_logprobs.push(lp.logprob);
    let mut top = serde_json::Map::new();
    for (t, l, _) in &lp.top {
        top.insert(t.clone(), serde_json::json!(l));
    }
    acc.top_logprobs.push(top);
    acc.text_offset.push(offset);
}

impl Shape for TextShape {
    type Piece = TextPiece;
    type Chunk = Completion;
    type Response = Completion;

    fn push(&mut self, text: String, logprob: Option<TokenLogprob>, _counted: bool) -> TextPiece {
        let offset = self.offset;
        self.offset += text.len();
        TextPiece { text, logprob: logprob.filter(|_| self.meta.logprobs), offset }
    }

    /// Nothing is held back: text is returned as the engine releases it.
    fn flush(&mut self) -> TextPiece {
        TextPiece { text: String::new(), logprob: None, offset: self.offset }
    }

    fn calls(&self) -> usize {
        0
    }

    fn usage(&self, prompt: usize, completion: usize, cached: usize) -> Usage {
        Usage::new(prompt, completion, cached, None)
    }

    fn include_usage(&self) -> bool {
        self.meta.include_usage
    }

    fn opening(&mut self) -> Option<Completion> {
        let echo = self.echo.take()?;
        Some(self.chunk(echo, None, None))
    }

    fn chunks(&self, piece: TextPiece) -> Vec<Completion> {
        let logprobs = piece.logprob.map(|lp| {
            let mut acc = CompletionLogprobs::default();
            legacy_logprobs(&mut acc, &lp, piece.offset);
            acc
        });
        if piece.text.is_empty() && logprobs.is_none() {
            return Vec::new();
        }
        vec![self.chunk(piece.text, logprobs, None)]
    }

    fn closing(&self, flushed: TextPiece, finish: Option<&'static str>) -> Vec<Completion> {
        let mut out = self.chunks(flushed);
        if let Some(finish) = finish {
            out.push(self.chunk(String::new(), None, Some(finish)));
        }
        out
    }

    fn usage_chunk(&self, usage: Usage) -> Completion {
        self.meta.envelope(TEXT, Vec::new(), UsageField::Some(usage))
    }

    fn absorb(&mut self, piece: TextPiece) {
        if let Some(lp) = &piece.logprob {
            legacy_logprobs(&mut self.logprobs, lp, piece.offset);
        }
        self.text.push_str(&piece.text);
    }

    fn response(self, finish: &'static str, usage: Usage) -> Completion {
        let logprobs = self.meta.logprobs.then_some(self.logprobs);
        let choices = vec![choice(self.text, logprobs, Some(finish))];
        self.meta.envelope(TEXT, choices, UsageField::Some(usage))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::respond::sse_frame;

    fn meta(include_usage: bool, logprobs: bool) -> Meta {
        Meta { id: "x-1".into(), created: 1, model: "m".into(), include_usage, logprobs }
    }

    fn lp(t: &str) -> TokenLogprob {
        TokenLogprob { token: t.to_string(), logprob: -0.5, bytes: t.as_bytes().to_vec(), top: vec![(t.to_string(), -0.5, t.as_bytes().to_vec())] }
    }

    fn json(v: &impl serde::Serialize) -> serde_json::Value {
        serde_json::to_value(v).unwrap()
    }

    /// The streamed end of output, as JSON.
    fn close<S: Shape>(shape: &mut S, finish: Option<&'static str>) -> Vec<serde_json::Value> {
        let flushed = shape.flush();
        shape.closing(flushed, finish).iter().map(json).collect()
    }

    #[test]
    fn chat_chunks_carry_null_usage_only_when_asked() {
        let mut shape = ChatShape::new(meta(true, false), ChatAssembler::new(false, None), false);
        let opening = json(&shape.opening().unwrap());
        assert_eq!(opening["choices"][0]["delta"], serde_json::json!({"role": "assistant", "content": ""}));
        assert!(opening["usage"].is_null() && opening.as_object().unwrap().contains_key("usage"));
        let mut shape = ChatShape::new(meta(false, false), ChatAssembler::new(false, None), false);
        let batch = shape.push("line one\nline \"two\"\n\n".into(), None, true);
        let chunks = shape.chunks(batch);
        assert_eq!(chunks.len(), 1);
        let frame = sse_frame(&chunks[0]);
        let text = std::str::from_utf8(&frame).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text[6..text.len() - 2]).unwrap();
        assert_eq!(v["choices"][0]["delta"]["content"], "line one\nline \"two\"\n\n");
        assert!(v.get("usage").is_none());
    }

    #[test]
    fn chat_closing_puts_held_logprobs_on_the_finish_chunk() {
        let mut shape = ChatShape::new(meta(false, true), ChatAssembler::new(true, None), true);
        // "<" is held back: it may open `</think>`.
        let held = shape.push("<".into(), Some(lp("<")), true);
        assert!(shape.chunks(held).is_empty());
        let out = close(&mut shape, Some("stop"));
        assert_eq!(out.len(), 2);
        assert_eq!(out[0]["choices"][0]["delta"]["reasoning_content"], "<");
        assert!(out[0]["choices"][0]["logprobs"].is_null());
        assert_eq!(out[1]["choices"][0]["finish_reason"], "stop");
        assert_eq!(out[1]["choices"][0]["logprobs"]["content"][0]["token"], "<");
        // A failed request ends without the finish chunk.
        let mut shape = ChatShape::new(meta(false, true), ChatAssembler::new(true, None), true);
        let _ = shape.push("<".into(), Some(lp("<")), true);
        assert_eq!(close(&mut shape, None).len(), 1);
    }

    #[test]
    fn text_offsets_count_the_echo_in_both_modes() {
        let mut shape = TextShape::new(meta(false, true), "Start:".into());
        for (t, offset) in [(" one", 6), (" two", 10)] {
            let p = shape.push(t.into(), Some(lp(t)), true);
            let streamed = json(&shape.chunks(p)[0]);
            assert_eq!(streamed["choices"][0]["text"], t);
            assert_eq!(streamed["choices"][0]["logprobs"]["text_offset"], serde_json::json!([offset]));
        }
        let opening = json(&shape.opening().unwrap());
        assert_eq!(opening["choices"][0]["text"], "Start:");
        assert!(shape.opening().is_none(), "the echo is sent once");

        let mut shape = TextShape::new(meta(false, true), "Start:".into());
        for t in [" one", " two"] {
            let p = shape.push(t.into(), Some(lp(t)), true);
            shape.absorb(p);
        }
        let flushed = shape.flush();
        shape.absorb(flushed);
        let v = json(&shape.response("stop", Usage::new(1, 2, 0, None)));
        assert_eq!(v["choices"][0]["text"], "Start: one two");
        assert_eq!(v["choices"][0]["logprobs"]["text_offset"], serde_json::json!([6, 10]));
        assert_eq!(v["choices"][0]["logprobs"]["top_logprobs"][1][" two"], -0.5);
        assert_eq!(v["usage"]["total_tokens"], 3);
    }

    #[test]
    fn text_without_logprobs_asked_sends_none() {
        let mut shape = TextShape::new(meta(false, false), String::new());
        assert!(shape.opening().is_none());
        let p = shape.push("hi".into(), Some(lp("hi")), true);
        let v = json(&shape.chunks(p)[0]);
        assert!(v["choices"][0]["logprobs"].is_null());
        // An empty token with no logprob makes no chunk.
        let p = shape.push(String::new(), None, true);
        assert!(shape.chunks(p).is_empty());
        let out = close(&mut shape, Some("length"));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0]["choices"][0]["finish_reason"], "length");
        assert!(shape.response("length", Usage::new(1, 1, 0, None)).choices[0].logprobs.is_none());
    }
}
