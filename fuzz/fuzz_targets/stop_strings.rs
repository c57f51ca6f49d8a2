//! The engine's text stream: incremental detokenisation plus stop strings
//! (`lily_engine::text::TextStream`), fed token by token.
//!
//! Property: the deltas concatenate to exactly what a plain reading of its
//! promise gives. After each token, the text so far is what a fresh
//! `StreamDecoder` has released; at the first token after which some stop
//! string occurs in it, the output is that text cut at the leftmost
//! occurrence and the stream reports `stopped`; if none ever occurs, the
//! output is all of the text (with the decoder's flush) and `stopped` is
//! false. So a stop string's text is never emitted, even when it spans
//! tokens or splits a UTF-8 character, and nothing else is held back at the
//! end. Stops are often cut from the text itself, so they do fire.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use lily_engine::text::TextStream;
use lily_fuzz::{tokenizer, Hostile};

#[derive(Debug)]
struct Input {
    ids: Vec<u32>,
    stops: Vec<String>,
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let tok = tokenizer();
        let text = u.arbitrary::<Hostile>()?.0;
        let ids = if u.ratio(1, 4)? {
            // Raw ids inside the vocabulary: byte tokens that split UTF-8.
            let n = u.int_in_range(0..=64)?;
            (0..n)
                .map(|_| u.int_in_range(0..=tok.vocab_size() as u32 - 1))
                .collect::<arbitrary::Result<Vec<u32>>>()?
                .into_iter()
                .filter(|&id| tok.token_bytes(id).is_ok())
                .collect()
        } else {
            tok.encode(&text)
                .map_err(|_| arbitrary::Error::IncorrectFormat)?
        };
        let n = u.int_in_range(1..=4)?;
        let mut stops = Vec::with_capacity(n);
        for _ in 0..n {
            let s = if u.ratio(2, 3)? && !text.is_empty() {
                let mut a = u.int_in_range(0..=text.len() - 1)?;
                while !text.is_char_boundary(a) {
                    a -= 1;
                }
                let mut b = u.int_in_range(a + 1..=text.len())?;
                while !text.is_char_boundary(b) {
                    b += 1;
                }
                text[a..b].to_string()
            } else {
                u.arbitrary::<Hostile>()?.0
            };
            // The server refuses empty and over-long stops (validate.rs).
            if !s.is_empty() && s.len() <= 256 {
                stops.push(s);
            }
        }
        if stops.is_empty() {
            stops.push("\n".into());
        }
        Ok(Input { ids, stops })
    }
}

fn leftmost(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter_map(|s| text.find(s.as_str())).min()
}

/// The promise, restated on the whole text prefix after each token.
fn expected(ids: &[u32], stops: &[String]) -> (String, bool) {
    let mut dec = tokenizer().stream_decoder();
    let mut so_far = String::new();
    for &id in ids {
        if let Some(t) = dec.push(id).unwrap_or_else(|e| panic!("id {id}: {e}")) {
            so_far.push_str(&t);
        }
        if let Some(p) = leftmost(&so_far, stops) {
            so_far.truncate(p);
            return (so_far, true);
        }
    }
    if let Some(t) = dec.flush() {
        so_far.push_str(&t);
    }
    match leftmost(&so_far, stops) {
        Some(p) => {
            so_far.truncate(p);
            (so_far, true)
        }
        None => (so_far, false),
    }
}

fuzz_target!(|input: Input| {
    let tok = tokenizer();
    let mut s = TextStream::new(tok.stream_decoder(), input.stops.clone());
    let mut out = String::new();
    let mut stopped = false;
    for &id in &input.ids {
        let d = s.push(id).unwrap_or_else(|e| panic!("push {id}: {e}"));
        out.push_str(&d.text);
        if d.stopped {
            stopped = true;
            break;
        }
    }
    if !stopped {
        let d = s.finish();
        out.push_str(&d.text);
        stopped = d.stopped;
    }
    let (want, want_stopped) = expected(&input.ids, &input.stops);
    assert_eq!(
        (out.as_str(), stopped),
        (want.as_str(), want_stopped),
        "stops {:?}",
        input.stops
    );
});
