//! The streaming tool-call parser, and the whole chat assembler (reasoning
//! splitter + tool parser + logprob bookkeeping), fed arbitrary chunks.
//!
//! Properties, from the modules' own promises:
//! - the result does not depend on where the text is cut (one piece, the
//!   fuzzer's cuts, or byte by byte);
//! - every call's `arguments` fragments concatenate to one JSON object, and a
//!   call's header comes before its arguments, with indices 0, 1, 2...;
//! - text without `<tool_call>` is passed through unchanged (held text is
//!   released by `finish`);
//! - the assembler hands back exactly one logprob entry per pushed token.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use lily_engine::TokenLogprob;
use lily_fuzz::{cut, Hostile};
use lily_server::output::{ChatAssembler, ChatPiece, Folded};
use lily_server::tool_parser::{Collected, ToolEvent, ToolParser, ToolSchemas};
use serde_json::{json, Value};

#[derive(Arbitrary, Debug)]
struct Input {
    text: Hostile,
    cuts: Vec<u16>,
    /// Start inside a call, as for a forced tool choice.
    in_call: bool,
    thinking: bool,
}

fn fixed_id() -> String {
    "call_fuzz".to_string()
}

fn schemas() -> ToolSchemas {
    let weather = json!({"type": "object", "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "code": {"type": ["string", "null"]},
        "unit": {"enum": ["c", "f"]},
        "detail": {"type": "boolean"},
    }});
    let noop = json!({"type": "object", "properties": {}});
    ToolSchemas::from_functions([
        ("get_weather", Some(&weather)),
        ("noop", Some(&noop)),
        ("f", None),
    ])
}

fn parser(in_call: bool) -> ToolParser {
    let p = if in_call {
        ToolParser::new_in_call(schemas())
    } else {
        ToolParser::new(schemas())
    };
    p.with_id_source(fixed_id)
}

fn run(pieces: &[&str], in_call: bool) -> (Collected, Vec<ToolEvent>) {
    let mut p = parser(in_call);
    let mut events = Vec::new();
    for piece in pieces {
        events.extend(p.push(piece));
    }
    events.extend(p.finish());
    let mut c = Collected::default();
    c.absorb(events.clone());
    (c, events)
}

fn check_events(events: &[ToolEvent], collected: &Collected, text: &str) {
    let mut started = 0;
    for e in events {
        match e {
            ToolEvent::CallStart { index, name, .. } => {
                assert_eq!(*index, started, "{text:?}");
                assert!(!name.is_empty(), "{text:?}");
                started += 1;
            }
            ToolEvent::Arguments { index, .. } => assert!(*index < started, "{text:?}"),
            ToolEvent::Content(c) => assert!(!c.is_empty(), "{text:?}"),
        }
    }
    for call in &collected.calls {
        let v: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|e| {
            panic!(
                "arguments {:?} of {text:?} are not JSON: {e}",
                call.arguments
            )
        });
        assert!(v.is_object(), "arguments {:?} of {text:?}", call.arguments);
    }
}

fn lp(t: &str) -> TokenLogprob {
    TokenLogprob {
        token: t.to_string(),
        logprob: -1.0,
        bytes: t.as_bytes().to_vec(),
        top: Vec::new(),
    }
}

fn assemble(pieces: &[&str], thinking: bool) -> Folded {
    let mut a = ChatAssembler::new(thinking, Some(schemas()));
    let mut f = Folded::default();
    for p in pieces {
        f.absorb(a.push(p, Some(&lp(p)), true));
    }
    let last = a.finish();
    for piece in &last.pieces {
        if let ChatPiece::Content(t) | ChatPiece::Reasoning(t) = piece {
            assert!(!t.is_empty());
        }
    }
    f.absorb(last);
    assert_eq!(
        f.logprobs.len(),
        pieces.len(),
        "one logprob entry per token"
    );
    assert_eq!(a.calls(), f.calls.calls.len());
    // Tool-call ids are random in the assembler; compare everything else.
    for c in &mut f.calls.calls {
        c.id.clear();
    }
    f.logprobs.clear();
    f
}

fuzz_target!(|input: Input| {
    let text = input.text.0.as_str();
    let (whole, events) = run(&[text], input.in_call);
    check_events(&events, &whole, text);

    let pieces = cut(text, &input.cuts);
    let (split, events) = run(&pieces, input.in_call);
    check_events(&events, &split, text);
    assert_eq!(split, whole, "{text:?} cut into {pieces:?}");

    let bytes: Vec<&str> = {
        let mut v = Vec::new();
        let mut start = 0;
        for (i, _) in text.char_indices().skip(1) {
            v.push(&text[start..i]);
            start = i;
        }
        v.push(&text[start..]);
        v
    };
    let (bytewise, _) = run(&bytes, input.in_call);
    assert_eq!(bytewise, whole, "{text:?} char by char");

    if !input.in_call && !text.contains("<tool_call>") {
        assert!(whole.calls.is_empty(), "{text:?}");
        assert_eq!(whole.content, text, "text without a call must pass through");
    }

    let a_whole = assemble(&[text], input.thinking);
    let a_split = assemble(&pieces, input.thinking);
    assert_eq!(a_split, a_whole, "{text:?} cut into {pieces:?}");
    // The assembler's parser starts outside a call (forced calls are
    // wired in by the driver), so compare only that case.
    if !input.thinking && !input.in_call {
        assert!(a_whole.reasoning.is_empty());
        assert_eq!(a_whole.calls, {
            let mut c = whole.clone();
            for call in &mut c.calls {
                call.id.clear();
            }
            c
        });
    }
});
