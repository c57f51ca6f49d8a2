//! Qwen's XML tool calls, parsed incrementally into OpenAI `tool_calls`.
//!
//! The model writes a call as
//! `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>`
//! (docs/design.md §4.3); older Qwen habits (`<tool_call>{"name":..,"arguments":..}</tool_call>`)
//! are accepted too. [`ToolParser`] is fed the assistant's visible text in
//! arbitrary pieces (a token's worth, a byte's worth) and returns
//! [`ToolEvent`]s: plain content, the start of a call (id and name), and
//! fragments of the call's `arguments` JSON string. Concatenating the
//! fragments of one call always gives one JSON object.
//!
//! Text that might be the start of a tag is held back until it is decided,
//! so a client never sees half of `<tool_call>` as content. String-typed
//! parameters (per the tool's JSON schema) stream as they are generated;
//! others are converted when complete: JSON-parsed when the schema says
//! non-string or when the text is valid JSON, otherwise sent as a string.
//! This module does not know about HTTP or tokens; `output.rs` wraps it.

use std::collections::HashMap;

use serde_json::Value;

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const FUNC_OPEN: &str = "<function=";
const FUNC_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
/// Longest name we wait for inside `<function=...>` / `<parameter=...>`
/// before deciding the tag is not one.
const MAX_NAME_BYTES: usize = 256;

/// What a parameter's schema says about its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// `"type": "string"` (possibly among others): sent as a JSON string.
    String,
    /// A declared non-string type: JSON-parsed, falling back to a string.
    Json,
    /// No schema for it: JSON-parsed when valid JSON, else a string.
    Unknown,
}

/// Parameter kinds per function, from the request's `tools`.
#[derive(Clone, Debug, Default)]
pub struct ToolSchemas {
    functions: HashMap<String, HashMap<String, ParamKind>>,
}

impl ToolSchemas {
    /// Reads `properties.<name>.type` of each function's parameter schema.
    pub fn from_functions<'a>(functions: impl IntoIterator<Item = (&'a str, Option<&'a Value>)>) -> Self {
        let mut out = HashMap::new();
        for (name, params) in functions {
            let mut kinds = HashMap::new();
            if let Some(props) = params.and_then(|p| p.get("properties")).and_then(Value::as_object) {
                for (pname, schema) in props {
                    kinds.insert(pname.clone(), kind_of_schema(schema));
                }
            }
            out.insert(name.to_string(), kinds);
        }
        ToolSchemas { functions: out }
    }

    pub fn kind(&self, function: &str, param: &str) -> ParamKind {
        self.functions.get(function).and_then(|m| m.get(param)).copied().unwrap_or(ParamKind::Unknown)
    }
}

fn kind_of_schema(schema: &Value) -> ParamKind {
    match schema.get("type") {
        Some(Value::String(t)) if t == "string" => ParamKind::String,
        Some(Value::String(_)) => ParamKind::Json,
        Some(Value::Array(ts)) => {
            if ts.iter().any(|t| t.as_str() == Some("string")) {
                ParamKind::String
            } else {
                ParamKind::Json
            }
        }
        _ => {
            if schema.get("enum").and_then(Value::as_array).is_some_and(|e| e.iter().all(Value::is_string)) {
                ParamKind::String
            } else {
                ParamKind::Unknown
            }
        }
    }
}

/// Converts a complete parameter value to its JSON text.
pub fn param_value_json(raw: &str, kind: ParamKind) -> String {
    let as_string = || Value::String(raw.to_string()).to_string();
    match kind {
        ParamKind::String => as_string(),
        ParamKind::Json | ParamKind::Unknown => {
            let trimmed = raw.trim();
            match serde_json::from_str::<Value>(trimmed) {
                Ok(v) => v.to_string(),
                Err(_) if kind == ParamKind::Json => match trimmed {
                    // Python spellings the model sometimes uses.
                    "True" => "true".into(),
                    "False" => "false".into(),
                    "None" => "null".into(),
                    _ => as_string(),
                },
                Err(_) => as_string(),
            }
        }
    }
}

/// One step of parser output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Ordinary assistant text.
    Content(String),
    /// A call begins (its `arguments` are still empty).
    CallStart { index: usize, id: String, name: String },
    /// A piece of the call's `arguments` JSON text.
    Arguments { index: usize, fragment: String },
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Outside any call. `after_call`: a call just ended, so whitespace
    /// before the next one is not content.
    Text { after_call: bool },
    /// Saw `<tool_call>`, waiting for `<function=NAME>` or a JSON body.
    AwaitFunction,
    /// Old-style `{"name":..,"arguments":..}` body up to `</tool_call>`.
    JsonBody,
    /// Inside `<function=...>`, between parameters.
    InFunction,
    /// Inside `<parameter=NAME>`.
    InParam { name: String, kind: ParamKind, started: bool },
    /// After `</function>`, waiting for `</tool_call>`.
    AwaitCallEnd,
}

/// Incremental parser; one per response.
#[derive(Debug)]
pub struct ToolParser {
    schemas: ToolSchemas,
    state: State,
    /// Unconsumed text.
    buf: String,
    /// Raw text of the current call since `<tool_call>`, to give back as
    /// content if it turns out not to be a call.
    raw_call: String,
    /// Whitespace held back in `Text`: dropped when a call follows.
    pending_ws: String,
    calls: usize,
    /// Name of the function being parsed and whether it has parameters yet.
    function: String,
    params_emitted: usize,
    id_source: fn() -> String,
}

impl ToolParser {
    pub fn new(schemas: ToolSchemas) -> Self {
        ToolParser {
            schemas,
            state: State::Text { after_call: false },
            buf: String::new(),
            raw_call: String::new(),
            pending_ws: String::new(),
            calls: 0,
            function: String::new(),
            params_emitted: 0,
            id_source: new_call_id,
        }
    }

    /// A parser whose output starts inside a call, because the prompt
    /// already ended with `<tool_call>\n` (forced tool choice).
    pub fn new_in_call(schemas: ToolSchemas) -> Self {
        let mut p = Self::new(schemas);
        // The tag was the prompt's, so it is not given back as content.
        p.state = State::AwaitFunction;
        p
    }

    /// Replaces the id generator (tests want stable ids).
    pub fn with_id_source(mut self, f: fn() -> String) -> Self {
        self.id_source = f;
        self
    }

    /// Number of calls started so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Feeds more text; returns what can be decided now.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        merge(out)
    }

    /// Ends the input: everything held back is decided.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        while self.step(&mut out) {}
        match std::mem::replace(&mut self.state, State::Text { after_call: true }) {
            State::Text { after_call } => {
                let rest = std::mem::take(&mut self.buf);
                let text = std::mem::take(&mut self.pending_ws) + &rest;
                let text = if after_call { text.trim_start().to_string() } else { text };
                self.content(&mut out, text);
            }
            State::AwaitFunction | State::JsonBody => {
                // Never became a call: it was text after all.
                let raw = std::mem::take(&mut self.pending_ws) + &std::mem::take(&mut self.raw_call) + &std::mem::take(&mut self.buf);
                self.content(&mut out, raw);
            }
            State::InParam { name, kind, started } => {
                let mut value = std::mem::take(&mut self.buf);
                if !started && value.starts_with('\n') {
                    value.remove(0);
                }
                self.finish_param(&mut out, &name, kind, started, &value);
                self.close_arguments(&mut out);
            }
            State::InFunction | State::AwaitCallEnd => {
                self.close_arguments(&mut out);
            }
        }
        merge(out)
    }

    fn content(&mut self, out: &mut Vec<ToolEvent>, text: String) {
        if !text.is_empty() {
            out.push(ToolEvent::Content(text));
        }
    }

    fn args(&self, out: &mut Vec<ToolEvent>, fragment: String) {
        out.push(ToolEvent::Arguments { index: self.calls - 1, fragment });
    }

    fn close_arguments(&mut self, out: &mut Vec<ToolEvent>) {
        if self.calls == 0 || self.function.is_empty() {
            return;
        }
        let close = if self.params_emitted == 0 { "{}" } else { "}" };
        self.args(out, close.to_string());
        self.function.clear();
    }

    /// One transition; returns whether to keep going.
    fn step(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        match self.state.clone() {
            State::Text { after_call } => self.step_text(out, after_call),
            State::AwaitFunction => self.step_await_function(out),
            State::JsonBody => self.step_json_body(out),
            State::InFunction => self.step_in_function(out),
            State::InParam { name, kind, started } => self.step_in_param(out, name, kind, started),
            State::AwaitCallEnd => self.step_await_call_end(),
        }
    }

    fn step_text(&mut self, out: &mut Vec<ToolEvent>, after_call: bool) -> bool {
        let found = self.buf.find(CALL_OPEN);
        // Without a tag, hold back a possible partial `<tool_call>`.
        let decided_end = found.unwrap_or_else(|| self.buf.len() - partial_suffix_len(&self.buf, &[CALL_OPEN]));
        let decided = self.buf[..decided_end].to_string();
        let body_end = decided.trim_end().len();
        let body = &decided[..body_end];
        let mut after_call = after_call;
        if !body.is_empty() {
            let ws = std::mem::take(&mut self.pending_ws);
            let text = if after_call { body.trim_start().to_string() } else { ws + body };
            self.content(out, text);
            after_call = false;
            self.state = State::Text { after_call };
        }
        // Trailing whitespace waits: it is layout if a call follows. Right
        // after a call it is layout in any case.
        if !after_call {
            self.pending_ws.push_str(&decided[body_end..]);
        }
        match found {
            Some(pos) => {
                self.buf.drain(..pos + CALL_OPEN.len());
                self.raw_call = CALL_OPEN.to_string();
                self.state = State::AwaitFunction;
                true
            }
            None => {
                self.buf.drain(..decided_end);
                false
            }
        }
    }

    fn step_await_function(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let trimmed = self.buf.trim_start();
        if trimmed.is_empty() {
            return false;
        }
        if trimmed.starts_with('{') {
            self.state = State::JsonBody;
            return true;
        }
        if trimmed.len() < FUNC_OPEN.len() {
            if FUNC_OPEN.starts_with(trimmed) {
                return false;
            }
            return self.abandon_call(out);
        }
        if !trimmed.starts_with(FUNC_OPEN) {
            return self.abandon_call(out);
        }
        let after = &trimmed[FUNC_OPEN.len()..];
        match after.find('>') {
            Some(end) => {
                let name = after[..end].trim().to_string();
                // The same rules as the `None` arm below decides early, so a
                // call is recognised the same way however the text is cut.
                if name.is_empty() || name.contains('\n') || name.contains('<') || end > MAX_NAME_BYTES {
                    return self.abandon_call(out);
                }
                let consumed = self.buf.len() - after.len() + end + 1;
                self.raw_call.push_str(&self.buf[..consumed]);
                self.buf.drain(..consumed);
                self.start_call(out, name);
                self.state = State::InFunction;
                true
            }
            // Give up only when no `>` can make it a name: too long, a `<`,
            // or a newline with text on both sides (one at either end would
            // be trimmed away).
            None if after.len() > MAX_NAME_BYTES || after.contains('<') || after.trim().contains('\n') => self.abandon_call(out),
            None => false,
        }
    }

    fn start_call(&mut self, out: &mut Vec<ToolEvent>, name: String) {
        self.pending_ws.clear();
        self.calls += 1;
        self.function = name.clone();
        self.params_emitted = 0;
        out.push(ToolEvent::CallStart { index: self.calls - 1, id: (self.id_source)(), name });
    }

    /// What followed `<tool_call>` was not a call: it is content.
    fn abandon_call(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let raw = std::mem::take(&mut self.raw_call);
        let ws = std::mem::take(&mut self.pending_ws);
        self.content(out, format!("{ws}{raw}"));
        self.state = State::Text { after_call: false };
        // The buffer is re-scanned as text (it may hold another `<tool_call>`).
        true
    }

    fn step_json_body(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let Some(end) = self.buf.find(CALL_CLOSE) else {
            return false;
        };
        let body = self.buf[..end].trim().to_string();
        let parsed: Option<(String, String)> = serde_json::from_str::<Value>(&body).ok().and_then(|v| {
            let name = v.get("name")?.as_str()?.to_string();
            let args = match v.get("arguments").or_else(|| v.get("parameters")) {
                Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok()?.to_string(),
                Some(a @ Value::Object(_)) => a.to_string(),
                None | Some(Value::Null) => "{}".to_string(),
                Some(_) => return None,
            };
            Some((name, args))
        });
        match parsed {
            Some((name, args)) => {
                self.buf.drain(..end + CALL_CLOSE.len());
                self.raw_call.clear();
                self.start_call(out, name);
                self.args(out, args);
                self.function.clear();
                self.state = State::Text { after_call: true };
                true
            }
            None => {
                self.raw_call.push_str(&self.buf[..end + CALL_CLOSE.len()]);
                self.buf.drain(..end + CALL_CLOSE.len());
                let raw = std::mem::take(&mut self.raw_call);
                let ws = std::mem::take(&mut self.pending_ws);
                self.content(out, format!("{ws}{raw}"));
                self.state = State::Text { after_call: false };
                true
            }
        }
    }

    fn step_in_function(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        // Skip layout and stray text until the next tag we know.
        let tags = [PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE];
        let Some((pos, tag)) = earliest(&self.buf, &tags) else {
            let hold = partial_suffix_len(&self.buf, &tags);
            let cut = self.buf.len() - hold;
            self.buf.drain(..cut);
            return false;
        };
        match tag {
            PARAM_OPEN => {
                let after = &self.buf[pos + PARAM_OPEN.len()..];
                match after.find('>') {
                    // A name longer than the streaming arm below waits for is
                    // skipped the same way, so the cut of the text cannot
                    // change the result.
                    Some(end) if end <= MAX_NAME_BYTES => {
                        let name = after[..end].trim().to_string();
                        let consumed = pos + PARAM_OPEN.len() + end + 1;
                        self.buf.drain(..consumed);
                        let kind = self.schemas.kind(&self.function, &name);
                        self.state = State::InParam { name, kind, started: false };
                        true
                    }
                    Some(_) => {
                        self.buf.drain(..pos + PARAM_OPEN.len());
                        true
                    }
                    None if after.len() > MAX_NAME_BYTES => {
                        // Not a parameter tag after all: skip past it.
                        self.buf.drain(..pos + PARAM_OPEN.len());
                        true
                    }
                    None => false,
                }
            }
            FUNC_CLOSE => {
                self.buf.drain(..pos + FUNC_CLOSE.len());
                self.close_arguments(out);
                self.state = State::AwaitCallEnd;
                true
            }
            _ => {
                // `</tool_call>` without `</function>`: close both.
                self.buf.drain(..pos + CALL_CLOSE.len());
                self.close_arguments(out);
                self.state = State::Text { after_call: true };
                true
            }
        }
    }

    fn step_in_param(&mut self, out: &mut Vec<ToolEvent>, name: String, kind: ParamKind, started: bool) -> bool {
        // The value sits between `>\n` and `\n</parameter>`; a missing close
        // tag is tolerated when the next tag shows the value is over.
        let ends = [PARAM_CLOSE, PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE];
        let mut started = started;
        if !started {
            if self.buf.is_empty() {
                return false;
            }
            if self.buf.starts_with('\n') {
                self.buf.drain(..1);
            }
            started = true;
            if kind == ParamKind::String {
                let sep = if self.params_emitted == 0 { "{" } else { ", " };
                let key = Value::String(name.clone()).to_string();
                self.args(out, format!("{sep}{key}: \""));
                self.params_emitted += 1;
            }
            self.state = State::InParam { name: name.clone(), kind, started };
        }
        match earliest(&self.buf, &ends) {
            Some((pos, tag)) => {
                let value = self.buf[..pos].to_string();
                let value = value.strip_suffix('\n').unwrap_or(&value).to_string();
                let consumed = if tag == PARAM_CLOSE { pos + PARAM_CLOSE.len() } else { pos };
                self.buf.drain(..consumed);
                self.finish_param(out, &name, kind, started, &value);
                self.state = State::InFunction;
                true
            }
            None => {
                if kind == ParamKind::String {
                    // Stream what cannot be part of the closing `\n</parameter>`.
                    let mut hold = partial_suffix_len(&self.buf, &ends);
                    let cut = self.buf.len() - hold;
                    if self.buf[..cut].ends_with('\n') {
                        hold += 1;
                    }
                    let cut = self.buf.len() - hold;
                    if cut > 0 {
                        let piece: String = self.buf.drain(..cut).collect();
                        self.args(out, json_string_body(&piece));
                    }
                }
                false
            }
        }
    }

    /// Emits the end of a parameter. For streamed strings, `value` is the
    /// tail not yet sent.
    fn finish_param(&mut self, out: &mut Vec<ToolEvent>, name: &str, kind: ParamKind, started: bool, value: &str) {
        if kind == ParamKind::String && started {
            self.args(out, format!("{}\"", json_string_body(value)));
            return;
        }
        let sep = if self.params_emitted == 0 { "{" } else { ", " };
        let key = Value::String(name.to_string()).to_string();
        let json = param_value_json(value, kind);
        self.args(out, format!("{sep}{key}: {json}"));
        self.params_emitted += 1;
    }

    fn step_await_call_end(&mut self) -> bool {
        let trimmed = self.buf.trim_start();
        if trimmed.starts_with(CALL_CLOSE) {
            let consumed = self.buf.len() - trimmed.len() + CALL_CLOSE.len();
            self.buf.drain(..consumed);
            self.state = State::Text { after_call: true };
            return true;
        }
        if !trimmed.is_empty() && !CALL_CLOSE.starts_with(trimmed) {
            // `</tool_call>` missing: the call is over anyway.
            self.state = State::Text { after_call: true };
            return true;
        }
        false
    }
}

/// The inside of a JSON string literal for `s` (no surrounding quotes).
fn json_string_body(s: &str) -> String {
    let quoted = Value::String(s.to_string()).to_string();
    quoted[1..quoted.len() - 1].to_string()
}

/// Length of the longest suffix of `buf` that is a proper prefix of one of
/// `tags` (ASCII tags: compared as bytes, so no char-boundary panics).
pub fn partial_suffix_len(buf: &str, tags: &[&str]) -> usize {
    let b = buf.as_bytes();
    let mut best = 0;
    for tag in tags {
        let t = tag.as_bytes();
        let max = (t.len() - 1).min(b.len());
        for k in (best + 1..=max).rev() {
            if b[b.len() - k..] == t[..k] {
                best = k;
                break;
            }
        }
    }
    best
}

/// The first occurrence of any of `tags`: (byte position, tag).
fn earliest<'t>(buf: &str, tags: &[&'t str]) -> Option<(usize, &'t str)> {
    tags.iter().filter_map(|t| buf.find(t).map(|p| (p, *t))).min_by_key(|(p, _)| *p)
}

/// Joins adjacent events of the same kind so a chunk carries one delta.
fn merge(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
    let mut out: Vec<ToolEvent> = Vec::with_capacity(events.len());
    for e in events {
        match (out.last_mut(), e) {
            (Some(ToolEvent::Content(a)), ToolEvent::Content(b)) => a.push_str(&b),
            (Some(ToolEvent::Arguments { index: i, fragment: a }), ToolEvent::Arguments { index: j, fragment: b }) if *i == j => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

/// `call_` followed by 24 random alphanumerics, like OpenAI's ids.
pub fn new_call_id() -> String {
    use rand::distr::{Alphanumeric, SampleString};
    format!("call_{}", Alphanumeric.sample_string(&mut rand::rng(), 24))
}

/// A complete tool call, for non-streamed responses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// Folds events into content and complete calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Collected {
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

impl Collected {
    pub fn absorb(&mut self, events: impl IntoIterator<Item = ToolEvent>) {
        for e in events {
            match e {
                ToolEvent::Content(t) => self.content.push_str(&t),
                ToolEvent::CallStart { id, name, .. } => self.calls.push(ParsedCall { id, name, arguments: String::new() }),
                ToolEvent::Arguments { index, fragment } => {
                    if let Some(c) = self.calls.get_mut(index) {
                        c.arguments.push_str(&fragment);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixed_id() -> String {
        "call_test".to_string()
    }

    fn schemas() -> ToolSchemas {
        let weather = json!({"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"enum": ["c", "f"]},
            "detail": {"type": ["boolean", "null"]},
            "code": {"type": "string"}
        }});
        ToolSchemas::from_functions([("get_weather", Some(&weather)), ("noop", None)])
    }

    fn run_whole(text: &str) -> Collected {
        let mut p = ToolParser::new(schemas()).with_id_source(fixed_id);
        let mut c = Collected::default();
        c.absorb(p.push(text));
        c.absorb(p.finish());
        c
    }

    /// Feeds `text` split at byte `cut` (as two pushes of raw bytes; a cut
    /// inside a UTF-8 character is moved to the next boundary, as the
    /// detokenizer only ever hands out whole characters).
    fn run_split(text: &str, cuts: &[usize]) -> (Collected, Vec<ToolEvent>) {
        let mut p = ToolParser::new(schemas()).with_id_source(fixed_id);
        let mut c = Collected::default();
        let mut all = Vec::new();
        let mut prev = 0;
        for &cut in cuts {
            let mut cut = cut.max(prev);
            while !text.is_char_boundary(cut) {
                cut += 1;
            }
            let ev = p.push(&text[prev..cut]);
            all.extend(ev.clone());
            c.absorb(ev);
            prev = cut;
        }
        let ev = p.push(&text[prev..]);
        all.extend(ev.clone());
        c.absorb(ev);
        let ev = p.finish();
        all.extend(ev.clone());
        c.absorb(ev);
        (c, all)
    }

    const ONE_CALL: &str = "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, \"Île\"\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn parses_one_call_with_typed_params() {
        let c = run_whole(ONE_CALL);
        assert_eq!(c.content, "Let me check.");
        assert_eq!(c.calls.len(), 1);
        assert_eq!(c.calls[0].name, "get_weather");
        assert_eq!(c.calls[0].id, "call_test");
        let args: Value = serde_json::from_str(&c.calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "Paris, \"Île\"", "days": 3}));
    }

    #[test]
    fn every_split_point_gives_the_same_result() {
        let texts = [
            ONE_CALL.to_string(),
            format!("{ONE_CALL}\n<tool_call>\n<function=noop>\n</function>\n</tool_call>"),
            "no calls here, just <tool text and < signs\n".to_string(),
            "<tool_call>\n<function=get_weather>\n<parameter=code>\nfn main() {\n  x\n}\n\n</parameter>\n<parameter=detail>\nTrue\n</parameter>\n</function>\n</tool_call>\n".to_string(),
            "<tool_call>\n{\"name\": \"noop\", \"arguments\": {\"a\": [1, 2]}}\n</tool_call>".to_string(),
            "a<tool_call>\nnot a call</tool_call> b".to_string(),
        ];
        for text in &texts {
            let whole = run_whole(text);
            for cut in 0..=text.len() {
                let (split, _) = run_split(text, &[cut]);
                assert_eq!(split, whole, "text {text:?} cut at {cut}");
            }
            // Byte by byte.
            let cuts: Vec<usize> = (0..=text.len()).collect();
            let (bytewise, events) = run_split(text, &cuts);
            assert_eq!(bytewise, whole, "text {text:?} byte by byte");
            // A call's header comes before any of its arguments.
            let mut started = 0;
            for e in &events {
                match e {
                    ToolEvent::CallStart { index, .. } => {
                        assert_eq!(*index, started);
                        started += 1;
                    }
                    ToolEvent::Arguments { index, .. } => assert!(*index < started),
                    ToolEvent::Content(_) => {}
                }
            }
        }
    }

    #[test]
    fn string_params_stream_before_the_call_ends() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=code>\nline one\nline two\n</parameter>\n</function>\n</tool_call>";
        let cut = text.find("line two").unwrap();
        let mut p = ToolParser::new(schemas()).with_id_source(fixed_id);
        let first = p.push(&text[..cut]);
        assert!(first.contains(&ToolEvent::Arguments { index: 0, fragment: "{\"code\": \"line one".to_string() }));
        let mut c = Collected::default();
        c.absorb(first);
        c.absorb(p.push(&text[cut..]));
        c.absorb(p.finish());
        let args: Value = serde_json::from_str(&c.calls[0].arguments).unwrap();
        assert_eq!(args, json!({"code": "line one\nline two"}));
    }

    #[test]
    fn parameter_value_conversion() {
        assert_eq!(param_value_json("12", ParamKind::String), "\"12\"");
        assert_eq!(param_value_json("12", ParamKind::Json), "12");
        assert_eq!(param_value_json("12", ParamKind::Unknown), "12");
        assert_eq!(param_value_json("Paris", ParamKind::Unknown), "\"Paris\"");
        assert_eq!(param_value_json("Paris", ParamKind::Json), "\"Paris\"");
        assert_eq!(param_value_json("False", ParamKind::Json), "false");
        assert_eq!(param_value_json("{\"a\": 1}", ParamKind::Json), "{\"a\":1}");
        assert_eq!(param_value_json(" [1, 2] ", ParamKind::Unknown), "[1,2]");
    }

    #[test]
    fn parallel_calls_get_their_own_index() {
        let text = "<tool_call>\n<function=noop>\n</function>\n</tool_call>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>";
        let c = run_whole(text);
        assert_eq!(c.content, "");
        assert_eq!(c.calls.len(), 2);
        assert_eq!(c.calls[0].arguments, "{}");
        assert_eq!(c.calls[1].arguments, "{\"city\": \"Rome\"}");
    }

    #[test]
    fn truncated_call_still_gives_valid_json() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
        let c = run_whole(text);
        assert_eq!(c.calls.len(), 1);
        let args: Value = serde_json::from_str(&c.calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "Par"}));

        let c = run_whole("<tool_call>\n<function=get_weather>\n<parameter=days>\n4");
        let args: Value = serde_json::from_str(&c.calls[0].arguments).unwrap();
        assert_eq!(args, json!({"days": 4}));
    }

    #[test]
    fn not_a_call_is_content() {
        let c = run_whole("see <tool_call>\nhello");
        assert_eq!(c.content, "see <tool_call>\nhello");
        assert!(c.calls.is_empty());
        let c = run_whole("x <tool_ca");
        assert_eq!(c.content, "x <tool_ca");
    }

    #[test]
    fn missing_close_tags_are_tolerated() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>\n</tool_call>after";
        let c = run_whole(text);
        let args: Value = serde_json::from_str(&c.calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "Oslo", "days": 2}));
        assert_eq!(c.content, "after");
    }

    #[test]
    fn forced_start_inside_a_call() {
        let mut p = ToolParser::new_in_call(schemas()).with_id_source(fixed_id);
        let mut c = Collected::default();
        c.absorb(p.push("\n<function=noop>\n</function>\n</tool_call>"));
        c.absorb(p.finish());
        assert_eq!(c.calls.len(), 1);
        assert_eq!(c.calls[0].name, "noop");
    }

    /// Random soup of tag fragments: whole and split parses agree, nothing
    /// panics, and every call's arguments are one JSON object.
    #[test]
    fn random_inputs_are_handled() {
        use rand::{Rng, SeedableRng};
        const FRAGMENTS: &[&str] = &[
            "<tool_call>",
            "</tool_call>",
            "<function=",
            "</function>",
            "<parameter=",
            "</parameter>",
            ">",
            "\n",
            "get_weather",
            "city",
            "days",
            "x",
            "{",
            "}",
            "\"",
            "é",
            "<",
            "/",
            "12",
            " ",
            "True",
            "{\"name\": \"noop\", \"arguments\": {\"a\": 1}}",
            "<tool_",
            "</param",
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..400 {
            let n = rng.random_range(0..40);
            let text: String = (0..n).map(|_| FRAGMENTS[rng.random_range(0..FRAGMENTS.len())]).collect();
            let whole = run_whole(&text);
            for c in &whole.calls {
                let v: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|e| panic!("{e}: {:?} from {text:?}", c.arguments));
                assert!(v.is_object(), "{text:?}");
            }
            let mut cuts: Vec<usize> = (0..rng.random_range(0..6)).map(|_| rng.random_range(0..=text.len())).collect();
            cuts.sort_unstable();
            let (split, _) = run_split(&text, &cuts);
            assert_eq!(split, whole, "{text:?} cut at {cuts:?}");
        }
    }

    #[test]
    fn partial_suffix() {
        assert_eq!(partial_suffix_len("abc<tool", &[CALL_OPEN]), 5);
        assert_eq!(partial_suffix_len("abc<tool_call>", &[CALL_OPEN]), 0);
        assert_eq!(partial_suffix_len("é<", &[CALL_OPEN]), 1);
        assert_eq!(partial_suffix_len("", &[CALL_OPEN]), 0);
    }
}
