//! Splits a thinking model's output into `reasoning_content` and `content`.
//!
//! With thinking on, the generation prompt ends in `<think>\n` (docs/design.md §4.2),
//! so the output starts inside the reasoning: everything up to `</think>` is
//! reasoning, the rest is the answer. The newlines the model puts around the
//! tag (`\n</think>\n\n`) are layout and dropped, as the chat template drops
//! them when it renders the turn back. Like the tool parser this works on
//! arbitrary pieces of text and holds back what might be the start of the
//! tag, so a streamed client never sees a fragment of `</think>`.

use crate::tool_parser::partial_suffix_len;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Before any reasoning text (a stray `<think>` or newlines are skipped).
    Start,
    Reasoning,
    /// Right after `</think>`: leading newlines are skipped.
    AfterClose,
    Content,
}

/// One per response.
#[derive(Debug)]
pub struct ReasoningSplitter {
    phase: Phase,
    buf: String,
}

impl ReasoningSplitter {
    /// `thinking`: whether the prompt opened a `<think>` block. Without it,
    /// everything is content and this is a pass-through.
    pub fn new(thinking: bool) -> Self {
        ReasoningSplitter { phase: if thinking { Phase::Start } else { Phase::Content }, buf: String::new() }
    }

    /// Whether the output is still inside the reasoning.
    pub fn in_reasoning(&self) -> bool {
        matches!(self.phase, Phase::Start | Phase::Reasoning)
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        if self.phase == Phase::Content {
            return if text.is_empty() { Vec::new() } else { vec![Piece::Content(text.to_string())] };
        }
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.phase {
                Phase::Start => {
                    let trimmed = self.buf.trim_start_matches('\n');
                    if trimmed.is_empty() {
                        break;
                    }
                    if let Some(rest) = trimmed.strip_prefix(THINK_OPEN) {
                        self.buf = rest.to_string();
                        continue;
                    }
                    if THINK_OPEN.starts_with(trimmed) {
                        break;
                    }
                    self.buf = trimmed.to_string();
                    self.phase = Phase::Reasoning;
                }
                Phase::Reasoning => {
                    if let Some(pos) = self.buf.find(THINK_CLOSE) {
                        let reasoning = self.buf[..pos].trim_end_matches('\n');
                        if !reasoning.is_empty() {
                            out.push(Piece::Reasoning(reasoning.to_string()));
                        }
                        self.buf.drain(..pos + THINK_CLOSE.len());
                        self.phase = Phase::AfterClose;
                        continue;
                    }
                    // Hold back a partial `</think>` and trailing newlines
                    // (they belong to the layout if the tag follows).
                    let hold = partial_suffix_len(&self.buf, &[THINK_CLOSE]);
                    let cut = self.buf.len() - hold;
                    let cut = self.buf[..cut].trim_end_matches('\n').len();
                    if cut > 0 {
                        let piece: String = self.buf.drain(..cut).collect();
                        out.push(Piece::Reasoning(piece));
                    }
                    break;
                }
                Phase::AfterClose => {
                    let trimmed = self.buf.trim_start_matches('\n');
                    if trimmed.is_empty() {
                        self.buf.clear();
                        break;
                    }
                    out.push(Piece::Content(trimmed.to_string()));
                    self.buf.clear();
                    self.phase = Phase::Content;
                    break;
                }
                Phase::Content => break,
            }
        }
        out
    }

    /// End of output: a reasoning block cut short (length limit, stop
    /// string) is returned as reasoning, held newlines included.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        // Leading newlines are skipped only before the reasoning starts; once
        // inside it, held newlines are reasoning text (even when nothing else
        // is held).
        let rest = match self.phase {
            Phase::Start => rest.trim_start_matches('\n').to_string(),
            Phase::Reasoning => rest,
            Phase::AfterClose | Phase::Content => String::new(),
        };
        if rest.is_empty() {
            Vec::new()
        } else {
            vec![Piece::Reasoning(rest)]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(thinking: bool, text: &str, step: usize) -> (String, String) {
        let mut s = ReasoningSplitter::new(thinking);
        let (mut r, mut c) = (String::new(), String::new());
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < text.len() {
            let mut j = (i + step).min(text.len());
            while !text.is_char_boundary(j) {
                j += 1;
            }
            pieces.extend(s.push(&text[i..j]));
            i = j;
        }
        pieces.extend(s.finish());
        for p in pieces {
            match p {
                Piece::Reasoning(t) => r.push_str(&t),
                Piece::Content(t) => c.push_str(&t),
            }
        }
        (r, c)
    }

    #[test]
    fn splits_at_think_close_for_every_chunk_size() {
        let text = "Let me think.\nStep 2 é.\n</think>\n\nThe answer is 4.\n";
        for step in 1..=text.len() {
            let (r, c) = split(true, text, step);
            assert_eq!(r, "Let me think.\nStep 2 é.", "step {step}");
            assert_eq!(c, "The answer is 4.\n", "step {step}");
        }
    }

    #[test]
    fn thinking_off_is_all_content() {
        let text = "Hi </think> there";
        assert_eq!(split(false, text, 3), (String::new(), text.to_string()));
    }

    #[test]
    fn cut_short_reasoning_stays_reasoning() {
        let (r, c) = split(true, "hmm, maybe </thi", 2);
        assert_eq!(r, "hmm, maybe </thi");
        assert_eq!(c, "");
    }

    #[test]
    fn stray_open_tag_is_dropped() {
        let (r, c) = split(true, "<think>\nidea\n</think>\n\nok", 1);
        assert_eq!((r.as_str(), c.as_str()), ("idea", "ok"));
    }

    #[test]
    fn empty_reasoning() {
        let (r, c) = split(true, "\n</think>\n\nanswer", 1);
        assert_eq!((r.as_str(), c.as_str()), ("", "answer"));
    }
}
