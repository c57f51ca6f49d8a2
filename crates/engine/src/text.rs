//! Generated tokens to text deltas: incremental detokenisation plus stop
//! strings.
//!
//! The tokenizer's `StreamDecoder` already holds back the bytes of a UTF-8
//! character split across tokens. On top of it this file holds back any tail
//! of the text that could be the start of a stop string, so the text of a stop
//! string is never emitted even when it spans several tokens, and cuts the
//! text at the first complete stop string. It does not decide when a request
//! ends on token ids or length (`scheduler.rs`).

use lily_core::tokenizer::StreamDecoder;

/// What one pushed token released.
#[derive(Debug, PartialEq, Eq)]
pub struct Delta {
    /// Text now safe to emit (may be empty).
    pub text: String,
    /// A stop string completed: `text` is everything before it and the
    /// request must end.
    pub stopped: bool,
}

/// One request's detokeniser and stop-string matcher.
pub struct TextStream {
    decoder: StreamDecoder,
    stops: Vec<String>,
    /// Decoded text not emitted yet because it may begin a stop string.
    held: String,
}

impl TextStream {
    pub fn new(decoder: StreamDecoder, stops: Vec<String>) -> Self {
        TextStream { decoder, stops, held: String::new() }
    }

    /// Adds one generated token.
    pub fn push(&mut self, id: u32) -> lily_core::Result<Delta> {
        if let Some(t) = self.decoder.push(id)? {
            self.held.push_str(&t);
        }
        Ok(self.release(false))
    }

    /// Ends the stream (EOS or length): flushes the decoder's partial
    /// character and releases the held text, still cut at a stop string
    /// if one completed.
    pub fn finish(&mut self) -> Delta {
        if let Some(t) = self.decoder.flush() {
            self.held.push_str(&t);
        }
        self.release(true)
    }

    fn release(&mut self, at_end: bool) -> Delta {
        if self.stops.is_empty() {
            return Delta { text: std::mem::take(&mut self.held), stopped: false };
        }
        let first_stop = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(p) = first_stop {
            let mut text = std::mem::take(&mut self.held);
            text.truncate(p);
            return Delta { text, stopped: true };
        }
        let keep_from = if at_end { self.held.len() } else { self.hold_from() };
        let rest = self.held.split_off(keep_from);
        Delta { text: std::mem::replace(&mut self.held, rest), stopped: false }
    }

    /// Start of the longest tail of `held` that is a proper prefix of some
    /// stop string (`held.len()` if none). Anything before it can never
    /// become part of a stop string, because no stop string occurs in `held`.
    fn hold_from(&self) -> usize {
        for (i, _) in self.held.char_indices() {
            let tail = &self.held[i..];
            if self.stops.iter().any(|s| s.len() > tail.len() && s.starts_with(tail)) {
                return i;
            }
        }
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lily_core::tokenizer::Tokenizer;

    /// Loaded once: parsing the 10 MB vocabulary dominates these tests.
    fn tokenizer() -> &'static Tokenizer {
        static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
        TOK.get_or_init(|| Tokenizer::embedded().expect("embedded tokenizer"))
    }

    /// Pushes the tokens of `pieces` one piece per token id run, collecting
    /// the emitted text and whether a stop fired.
    fn run(tok: &Tokenizer, text: &str, stops: &[&str]) -> (String, bool, Vec<String>) {
        let ids = tok.encode(text).expect("encode");
        let mut s = TextStream::new(tok.stream_decoder(), stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        let mut deltas = Vec::new();
        for id in ids {
            let d = s.push(id).expect("push");
            out.push_str(&d.text);
            deltas.push(d.text);
            if d.stopped {
                return (out, true, deltas);
            }
        }
        let d = s.finish();
        out.push_str(&d.text);
        deltas.push(d.text);
        (out, d.stopped, deltas)
    }

    #[test]
    fn no_stops_round_trips_text() {
        let tok = tokenizer();
        let text = "Hello, wörld! 你好 🎉 done";
        let (out, stopped, _) = run(tok, text, &[]);
        assert_eq!(out, text);
        assert!(!stopped);
    }

    #[test]
    fn stop_string_spanning_tokens_is_never_emitted() {
        let tok = tokenizer();
        let text = "The answer is forty-two. END OF STORY and more text";
        // Make sure the stop string really spans several tokens.
        assert!(tok.encode(" END OF STORY").expect("encode").len() >= 3);
        let (out, stopped, deltas) = run(tok, text, &["END OF STORY"]);
        assert!(stopped);
        assert_eq!(out, "The answer is forty-two. ");
        assert!(deltas.iter().all(|d| !d.contains("END")));
    }

    #[test]
    fn partial_stop_prefix_is_released_when_it_does_not_complete() {
        let tok = tokenizer();
        let (out, stopped, _) = run(tok, "alpha ENDING beta END", &["END!"]);
        assert!(!stopped);
        assert_eq!(out, "alpha ENDING beta END");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let tok = tokenizer();
        let (out, stopped, _) = run(tok, "one two three four", &["four", "two"]);
        assert!(stopped);
        assert_eq!(out, "one ");
    }

    #[test]
    fn stop_inside_a_multibyte_character_run() {
        let tok = tokenizer();
        let (out, stopped, _) = run(tok, "价格是🎉一百元", &["🎉"]);
        assert!(stopped);
        assert_eq!(out, "价格是");
    }
}
