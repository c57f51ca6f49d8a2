//! The embedded tokenizer: decoding arbitrary ids, streaming them through a
//! `StreamDecoder`, and encoding hostile text.
//!
//! Properties:
//! - `decode` of any ids is text or an error (an id outside the vocabulary),
//!   never a panic;
//! - a `StreamDecoder` fed the same ids one at a time gives exactly
//!   `decode`'s text once flushed, never holds back more than 3 bytes, and
//!   fails on exactly the ids `decode` refuses;
//! - `encode` then `decode` gives the NFC form of the text back, and no plain
//!   encoding contains a special id; `encode_with_specials` decodes back too;
//! - `encode` (the hand split for text in NFC) gives the ids of the
//!   `tokenizers` crate's whole pipeline (`encode_reference`).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use lily_fuzz::{tokenizer, Hostile};
use unicode_normalization::UnicodeNormalization;

#[derive(Arbitrary, Debug)]
struct Input {
    /// Raw ids; most are folded into the vocabulary (plus a margin past its
    /// end) so decoding gets past the first id.
    ids: Vec<u32>,
    fold: bool,
    text: Hostile,
}

fuzz_target!(|input: Input| {
    let tok = tokenizer();
    let vocab = tok.vocab_size() as u32;
    let ids: Vec<u32> = if input.fold {
        input.ids.iter().map(|&i| i % (vocab + 300)).collect()
    } else {
        input.ids.clone()
    };
    let all_valid = ids.iter().all(|&id| tok.token_bytes(id).is_ok());
    match tok.decode(&ids) {
        Ok(text) => {
            assert!(all_valid);
            let mut dec = tok.stream_decoder();
            let mut streamed = String::new();
            for &id in &ids {
                match dec.push(id) {
                    Ok(Some(s)) => {
                        assert!(!s.is_empty());
                        streamed.push_str(&s)
                    }
                    Ok(None) => {}
                    Err(e) => panic!("stream decoder refused id {id} that decode accepted: {e}"),
                }
                assert!(
                    dec.pending_bytes() <= 3,
                    "held {} bytes",
                    dec.pending_bytes()
                );
            }
            if let Some(s) = dec.flush() {
                streamed.push_str(&s);
            }
            assert_eq!(dec.pending_bytes(), 0);
            assert_eq!(
                streamed, text,
                "streamed text differs from decode for {ids:?}"
            );
        }
        Err(_) => assert!(!all_valid, "decode refused valid ids {ids:?}"),
    }
    for &id in &ids {
        let _ = (tok.id_to_token(id), tok.is_special(id));
    }

    let text = input.text.0.as_str();
    let nfc: String = text.nfc().collect();
    let plain = tok
        .encode(text)
        .unwrap_or_else(|e| panic!("encode {text:?}: {e}"));
    assert!(
        plain.iter().all(|&id| !tok.is_special(id)),
        "plain encoding of {text:?} has a special id"
    );
    let reference = tok
        .encode_reference(text)
        .unwrap_or_else(|e| panic!("encode_reference {text:?}: {e}"));
    assert_eq!(
        plain, reference,
        "the hand split and the library differ on {text:?}"
    );
    let back = tok
        .decode(&plain)
        .unwrap_or_else(|e| panic!("decode of encode: {e}"));
    assert_eq!(back, nfc, "encode/decode round trip of {text:?}");
    let with = tok
        .encode_with_specials(text)
        .unwrap_or_else(|e| panic!("encode_with_specials {text:?}: {e}"));
    let back = tok
        .decode(&with)
        .unwrap_or_else(|e| panic!("decode of encode_with_specials: {e}"));
    if nfc == text {
        assert_eq!(back, text, "encode_with_specials/decode round trip");
    }
});
