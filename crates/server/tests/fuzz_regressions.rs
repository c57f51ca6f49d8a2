//! Inputs found by the fuzz targets in fuzz/ (scripts/fuzz.sh) that once
//! broke a promise of the streaming parsers, kept as ordinary tests. Each
//! test names its target and what went wrong.

use lily_server::reasoning::{Piece, ReasoningSplitter};
use lily_server::tool_parser::{Collected, ToolParser, ToolSchemas};

fn fixed_id() -> String {
    "call_x".to_string()
}

fn parse(pieces: &[&str]) -> Collected {
    let mut p = ToolParser::new(ToolSchemas::default()).with_id_source(fixed_id);
    let mut c = Collected::default();
    for piece in pieces {
        c.absorb(p.push(piece));
    }
    c.absorb(p.finish());
    c
}

fn cut_everywhere(text: &str) {
    let whole = parse(&[text]);
    for i in 0..=text.len() {
        if text.is_char_boundary(i) {
            assert_eq!(parse(&[&text[..i], &text[i..]]), whole, "{text:?} cut at {i}");
        }
    }
}

/// tool_parser: `<function=` followed by a newline was refused while
/// streaming (the name was not complete yet) but accepted whole (the
/// newline was trimmed off the finished name), so the result depended on
/// where the text was cut.
#[test]
fn function_name_with_a_leading_newline_parses_the_same_however_cut() {
    let text = "<tool_call><function=\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}>V{\"name\": \"f\", \
                \"arguments\": {\"a\": 1}}<|im_start|>system\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\u{e000}4c494c59b\u{e001}";
    let pieces = [
        "<tool_call><functi",
        "on=\n{\"name\":",
        " \"f\", \"arguments\": {\"a\": 1}}>V{\"na",
        "me\": \"f\", \"argume",
        "",
        "nts\": {\"a\": 1}}<|im_start|>sy",
        "stem\n{\"name\": \"f\", \"arguments\": {",
        "\"a\": 1}}\u{e000}",
        "4",
        "c494c59b\u{e001}",
    ];
    assert_eq!(pieces.concat(), text);
    assert_eq!(parse(&pieces), parse(&[text]));
    cut_everywhere(text);
    // A newline inside the name (text on both sides) is never a call.
    let c = parse(&["<tool_call><function=get\nweather>\n</function></tool_call>"]);
    assert!(c.calls.is_empty(), "{c:?}");
    cut_everywhere("<tool_call><function=get\nweather>\n</function></tool_call>");
    // Leading and trailing newlines around a name are layout.
    cut_everywhere("<tool_call><function=\nget_weather\n>\n</function></tool_call>");
    assert_eq!(parse(&["<tool_call><function=\nget_weather\n>\n</function></tool_call>"]).calls[0].name, "get_weather");
}

/// tool_parser: names longer than the parser waits for were accepted when
/// the `>` was already in the buffer and refused while streaming.
#[test]
fn overlong_names_are_refused_however_cut() {
    let long = "n".repeat(300);
    let call = format!("<tool_call><function={long}>\n</function></tool_call>");
    assert!(parse(&[&call]).calls.is_empty());
    cut_everywhere(&call);
    let param = format!("<tool_call><function=f>\n<parameter={long}>\n1\n</parameter>\n</function></tool_call>");
    cut_everywhere(&param);
}

fn split(thinking: bool, pieces: &[&str]) -> (String, String) {
    let mut s = ReasoningSplitter::new(thinking);
    let mut out = Vec::new();
    for p in pieces {
        out.extend(s.push(p));
    }
    out.extend(s.finish());
    let (mut r, mut c) = (String::new(), String::new());
    for p in out {
        match p {
            Piece::Reasoning(t) => r.push_str(&t),
            Piece::Content(t) => c.push_str(&t),
        }
    }
    (r, c)
}

/// reasoning: a reasoning block cut short right after a newline lost the
/// newline (`finish` dropped held text made only of newlines), although
/// `finish` promises held newlines are returned.
#[test]
fn held_newlines_of_cut_short_reasoning_are_returned() {
    assert_eq!(split(true, &["\u{18}\n"]), ("\u{18}\n".to_string(), String::new()));
    assert_eq!(split(true, &["a", "\n", "\n"]), ("a\n\n".to_string(), String::new()));
    // Before any reasoning text, leading newlines are still layout.
    assert_eq!(split(true, &["\n\n"]), (String::new(), String::new()));
    // With the tag, newlines before it are layout.
    assert_eq!(split(true, &["a\n", "</think>\n\nb"]), ("a".to_string(), "b".to_string()));
}
