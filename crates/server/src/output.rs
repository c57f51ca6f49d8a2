//! Generated text -> what a chat response says: reasoning, content, tool
//! calls and logprobs, in the order they become known.
//!
//! [`ChatAssembler`] chains the reasoning splitter and (when tools are on)
//! the tool-call parser, and tags each piece with the logprobs of the tokens
//! that produced it. Streaming turns each [`ChatPiece`] batch into one or more
//! `chat.completion.chunk`s; a non-streamed response folds them all into one
//! message. Both paths use this, so they cannot disagree.

use lily_engine::TokenLogprob;

use crate::openai::{TokenLogprobOut, TopLogprob};
use crate::reasoning::{Piece, ReasoningSplitter};
use crate::tool_parser::{Collected, ToolEvent, ToolParser, ToolSchemas};

/// One piece of assistant output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatPiece {
    Reasoning(String),
    Content(String),
    CallStart { index: usize, id: String, name: String },
    Arguments { index: usize, fragment: String },
}

/// What one push produced: the pieces and the logprobs of the tokens that
/// were pushed since the last batch that carried logprobs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    pub pieces: Vec<ChatPiece>,
    pub logprobs: Vec<TokenLogprobOut>,
}

pub fn logprob_out(lp: &TokenLogprob) -> TokenLogprobOut {
    TokenLogprobOut {
        token: lp.token.clone(),
        logprob: lp.logprob,
        bytes: lp.bytes.clone(),
        top_logprobs: lp.top.iter().map(|(token, logprob, bytes)| TopLogprob { token: token.clone(), logprob: *logprob, bytes: bytes.clone() }).collect(),
    }
}

#[derive(Debug)]
pub struct ChatAssembler {
    splitter: ReasoningSplitter,
    parser: Option<ToolParser>,
    /// Logprobs waiting for a batch with pieces to ride on.
    pending_logprobs: Vec<TokenLogprobOut>,
    reasoning_tokens: usize,
    calls: usize,
    /// Calls past this many are dropped (`parallel_tool_calls: false`).
    max_calls: usize,
}

impl ChatAssembler {
    /// `thinking`: the prompt opened a think block. `tools`: parse tool
    /// calls with these schemas (None: tools are off, all text is content).
    pub fn new(thinking: bool, tools: Option<ToolSchemas>) -> Self {
        ChatAssembler {
            splitter: ReasoningSplitter::new(thinking),
            parser: tools.map(ToolParser::new),
            pending_logprobs: Vec::new(),
            reasoning_tokens: 0,
            calls: 0,
            max_calls: usize::MAX,
        }
    }

    /// Keep only the first tool call.
    pub fn single_call(mut self) -> Self {
        self.max_calls = 1;
        self
    }

    /// Tokens generated while inside the reasoning.
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// Tool calls started so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Adds the text released by one token (`counted`: it was generated;
    /// false for text the server injected, such as a forced call's opening).
    pub fn push(&mut self, text: &str, logprob: Option<&TokenLogprob>, counted: bool) -> Batch {
        if counted && self.splitter.in_reasoning() {
            self.reasoning_tokens += 1;
        }
        if let Some(lp) = logprob {
            self.pending_logprobs.push(logprob_out(lp));
        }
        let pieces = self.splitter.push(text);
        let pieces = self.route(pieces);
        self.batch(pieces, false)
    }

    /// End of output: everything held back is released.
    pub fn finish(&mut self) -> Batch {
        let pieces = self.splitter.finish();
        let mut out = self.route(pieces);
        if let Some(p) = self.parser.as_mut() {
            let events = p.finish();
            out.extend(self.convert(events));
        }
        self.batch(out, true)
    }

    fn batch(&mut self, pieces: Vec<ChatPiece>, last: bool) -> Batch {
        let logprobs = if !pieces.is_empty() || last { std::mem::take(&mut self.pending_logprobs) } else { Vec::new() };
        Batch { pieces, logprobs }
    }

    fn route(&mut self, pieces: Vec<Piece>) -> Vec<ChatPiece> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Reasoning(t) => out.push(ChatPiece::Reasoning(t)),
                Piece::Content(t) => match self.parser.as_mut() {
                    None => out.push(ChatPiece::Content(t)),
                    Some(parser) => {
                        let events = parser.push(&t);
                        out.extend(self.convert(events));
                    }
                },
            }
        }
        out
    }

    fn convert(&mut self, events: Vec<ToolEvent>) -> Vec<ChatPiece> {
        let max = self.max_calls;
        events
            .into_iter()
            .filter_map(|e| match e {
                ToolEvent::Content(t) => Some(ChatPiece::Content(t)),
                ToolEvent::CallStart { index, .. } | ToolEvent::Arguments { index, .. } if index >= max => None,
                ToolEvent::CallStart { index, id, name } => {
                    self.calls += 1;
                    Some(ChatPiece::CallStart { index, id, name })
                }
                ToolEvent::Arguments { index, fragment } => Some(ChatPiece::Arguments { index, fragment }),
            })
            .collect()
    }
}

/// A whole message, folded from pieces.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Folded {
    pub reasoning: String,
    pub calls: Collected,
    pub logprobs: Vec<TokenLogprobOut>,
}

impl Folded {
    pub fn absorb(&mut self, batch: Batch) {
        for p in batch.pieces {
            match p {
                ChatPiece::Reasoning(t) => self.reasoning.push_str(&t),
                ChatPiece::Content(t) => self.calls.absorb([ToolEvent::Content(t)]),
                ChatPiece::CallStart { index, id, name } => self.calls.absorb([ToolEvent::CallStart { index, id, name }]),
                ChatPiece::Arguments { index, fragment } => self.calls.absorb([ToolEvent::Arguments { index, fragment }]),
            }
        }
        self.logprobs.extend(batch.logprobs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lp(t: &str) -> TokenLogprob {
        TokenLogprob { token: t.to_string(), logprob: -0.5, bytes: t.as_bytes().to_vec(), top: vec![] }
    }

    #[test]
    fn reasoning_content_and_a_call() {
        let schemas = ToolSchemas::from_functions([("f", Some(&json!({"properties": {"x": {"type": "integer"}}})))]);
        let mut a = ChatAssembler::new(true, Some(schemas));
        let tokens = [
            "I should",
            " call f.",
            "\n</think>\n\n",
            "Calling.",
            "\n<tool_call>",
            "\n<function=f>\n<parameter=x>\n",
            "5\n</parameter>\n</function>\n</tool_call>",
        ];
        let mut folded = Folded::default();
        for t in tokens {
            folded.absorb(a.push(t, Some(&lp(t)), true));
        }
        folded.absorb(a.finish());
        assert_eq!(folded.reasoning, "I should call f.");
        assert_eq!(folded.calls.content, "Calling.");
        assert_eq!(folded.calls.calls.len(), 1);
        assert_eq!(folded.calls.calls[0].arguments, "{\"x\": 5}");
        assert_eq!(folded.logprobs.len(), tokens.len());
        assert_eq!(a.reasoning_tokens(), 3);
        assert_eq!(a.calls(), 1);
    }

    #[test]
    fn logprobs_wait_for_held_text() {
        let mut a = ChatAssembler::new(false, None);
        let b = a.push("Hi", Some(&lp("Hi")), true);
        assert_eq!(b.pieces, vec![ChatPiece::Content("Hi".into())]);
        assert_eq!(b.logprobs.len(), 1);
        let mut a = ChatAssembler::new(true, None);
        let b = a.push("<", Some(&lp("<")), true);
        assert!(b.pieces.is_empty() && b.logprobs.is_empty());
        let b = a.push("x", Some(&lp("x")), true);
        assert_eq!(b.pieces, vec![ChatPiece::Reasoning("<x".into())]);
        assert_eq!(b.logprobs.len(), 2);
    }

    #[test]
    fn single_call_drops_the_rest() {
        let mut a = ChatAssembler::new(false, Some(ToolSchemas::default())).single_call();
        let mut f = Folded::default();
        let two = "<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n</function>\n</tool_call>";
        f.absorb(a.push(two, None, true));
        f.absorb(a.finish());
        assert_eq!(f.calls.calls.len(), 1);
        assert_eq!(f.calls.calls[0].name, "a");
        assert_eq!(a.calls(), 1);
    }

    #[test]
    fn tools_off_leaves_tags_as_content() {
        let mut a = ChatAssembler::new(false, None);
        let mut f = Folded::default();
        f.absorb(a.push("<tool_call>\n<function=f>\n</function>\n</tool_call>", None, true));
        f.absorb(a.finish());
        assert!(f.calls.calls.is_empty());
        assert!(f.calls.content.starts_with("<tool_call>"));
    }
}
