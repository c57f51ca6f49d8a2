//! The reasoning splitter, fed arbitrary chunks.
//!
//! Properties (reasoning.rs's module promise): with thinking off the output
//! is the input, as content. With thinking on, leading newlines and stray
//! `<think>` tags are skipped; everything up to the first `</think>` is
//! reasoning (newlines before the tag dropped), everything after it is
//! content (newlines right after the tag dropped); without `</think>` all of
//! it is reasoning, released by `finish`. `expected` restates that on the
//! whole text, and every chunking must give exactly that, with no empty
//! pieces.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use lily_fuzz::{cut, Hostile};
use lily_server::reasoning::{Piece, ReasoningSplitter};

#[derive(Arbitrary, Debug)]
struct Input {
    text: Hostile,
    cuts: Vec<u16>,
    thinking: bool,
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

fn expected(text: &str, thinking: bool) -> (String, String) {
    if !thinking {
        return (String::new(), text.to_string());
    }
    let mut s = text;
    loop {
        s = s.trim_start_matches('\n');
        match s.strip_prefix(OPEN) {
            Some(rest) => s = rest,
            None => break,
        }
    }
    match s.find(CLOSE) {
        Some(pos) => (
            s[..pos].trim_end_matches('\n').to_string(),
            s[pos + CLOSE.len()..].trim_start_matches('\n').to_string(),
        ),
        None => (s.to_string(), String::new()),
    }
}

fn split(pieces: &[&str], thinking: bool) -> (String, String) {
    let mut sp = ReasoningSplitter::new(thinking);
    let (mut r, mut c) = (String::new(), String::new());
    let mut out = Vec::new();
    for p in pieces {
        out.extend(sp.push(p));
    }
    out.extend(sp.finish());
    for p in out {
        match p {
            Piece::Reasoning(t) => {
                assert!(!t.is_empty(), "empty reasoning piece from {pieces:?}");
                assert!(c.is_empty(), "reasoning after content from {pieces:?}");
                r.push_str(&t)
            }
            Piece::Content(t) => {
                assert!(!t.is_empty(), "empty content piece from {pieces:?}");
                c.push_str(&t)
            }
        }
    }
    (r, c)
}

fuzz_target!(|input: Input| {
    let text = input.text.0.as_str();
    let want = expected(text, input.thinking);
    assert_eq!(split(&[text], input.thinking), want, "{text:?} whole");
    let pieces = cut(text, &input.cuts);
    assert_eq!(
        split(&pieces, input.thinking),
        want,
        "{text:?} cut into {pieces:?}"
    );
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(split(&chars, input.thinking), want, "{text:?} char by char");
});
