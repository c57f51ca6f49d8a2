//! Chat template: OpenAI-style messages -> the prompt text (and tokens) the
//! model sees.
//!
//! It owns loading a checkpoint's Jinja template (`chat_template.jinja`, else
//! the `chat_template` field of `tokenizer_config.json`), rendering it with
//! minijinja configured like Hugging Face's Jinja (trim_blocks, lstrip_blocks,
//! Python string/dict methods, a Python-style `tojson`, `raise_exception`),
//! Lily's own template (`assets/chat_template.jinja`, the Qwen3.6 format of
//! docs/design.md §4.2, which `lily synth` ships), and `render_tokens`, which keeps
//! special-token text typed by users out of the special-token ids. It does not
//! own parsing the model's output back into tool calls.
//!
//! Serving the real checkpoint uses the checkpoint's own template (`from_dir`);
//! ours only has to produce the same format for the checkpoints we make.
//!
//! Message preparation shared by both render paths: roles are checked,
//! `content` and `reasoning_content` are trimmed (Qwen's templates trim them
//! anyway), reasoning embedded in assistant content as `<think>..</think>` is
//! moved to `reasoning_content` when that field is absent (as Qwen's template
//! does), and tool-call arguments are parsed from the OpenAI JSON string into
//! a mapping whose key order is the string's.

use std::path::Path;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind, State};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// Lily's chat template (Qwen3.6 format), written into synthetic checkpoints.
pub const DEFAULT_CHAT_TEMPLATE: &str = include_str!("../assets/chat_template.jinja");

const TEMPLATE_NAME: &str = "chat_template.jinja";

/// One tool call made by the assistant, as the OpenAI API carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as the OpenAI JSON string (an object); parsed before
    /// rendering, an unparsable or non-object string is an error.
    pub arguments_json: String,
}

/// One message of the conversation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    pub content: Option<String>,
    /// Assistant messages only.
    pub tool_calls: Vec<ToolCall>,
    /// Tool messages only: which call this result answers.
    pub tool_call_id: Option<String>,
    /// Assistant messages only: the thinking that preceded `content`.
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    fn with(role: &str, content: impl Into<String>) -> Self {
        Self { role: role.to_string(), content: Some(content.into()), ..Self::default() }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::with("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::with("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::with("assistant", content)
    }
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Self { tool_call_id: Some(tool_call_id.into()), ..Self::with("tool", content) }
    }
}

/// Everything a template renders from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatRenderRequest {
    pub messages: Vec<ChatMessage>,
    /// OpenAI tool objects (`{"type": "function", "function": {...}}`), passed
    /// to the template unchanged (key order kept).
    pub tools: Option<Vec<Json>>,
    /// End with the opening of an assistant turn. Default true.
    pub add_generation_prompt: bool,
    /// Let the model think first (`<think>\n`) or skip it (an empty think
    /// block). Default true.
    pub enable_thinking: bool,
}

impl Default for ChatRenderRequest {
    fn default() -> Self {
        Self { messages: Vec::new(), tools: None, add_generation_prompt: true, enable_thinking: true }
    }
}

/// A compiled chat template. Cheap to share between threads (`&self` only).
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Lily's own template ([`DEFAULT_CHAT_TEMPLATE`]).
    pub fn default_template() -> Result<Self> {
        Self::from_source(DEFAULT_CHAT_TEMPLATE)
    }

    /// The checkpoint's template: `dir/chat_template.jinja`, else the
    /// `chat_template` field of `dir/tokenizer_config.json` (a string, or
    /// Hugging Face's list of named templates, where `default` is taken).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let src = std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
            return Self::from_source(&src).map_err(|e| prefix_path(e, &jinja));
        }
        let cfg_path = dir.join("tokenizer_config.json");
        if !cfg_path.is_file() {
            return Err(Error::Template(format!("{}: no chat_template.jinja and no tokenizer_config.json", dir.display())));
        }
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
        let cfg: Json = serde_json::from_str(&text).map_err(|e| Error::Json { path: cfg_path.clone(), message: e.to_string() })?;
        let src = match cfg.get("chat_template") {
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .map(str::to_string)
                .ok_or_else(|| Error::Template(format!("{}: `chat_template` is a list without a template named `default`", cfg_path.display())))?,
            _ => {
                return Err(Error::Template(format!(
                    "{}: no chat_template.jinja in {} and no `chat_template` string in tokenizer_config.json",
                    cfg_path.display(),
                    dir.display()
                )))
            }
        };
        Self::from_source(&src).map_err(|e| prefix_path(e, &cfg_path))
    }

    /// Compiles a template; a syntax error is an `Error::Template`.
    pub fn from_source(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        // Hugging Face renders chat templates with these two options on.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", py_tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(template_error)?;
        Ok(Self { env })
    }

    /// Renders the prompt text.
    pub fn render(&self, req: &ChatRenderRequest) -> Result<String> {
        let prepared = prepare(req)?;
        self.render_ctx(context(&prepared, req, None))
    }

    /// Renders and tokenises so that only the template's own markup can
    /// become special tokens: text from message contents, reasoning, tool
    /// names, tool arguments, tool results and tool definitions is encoded as
    /// plain text even if it spells `<|im_start|>` or `<tool_call>`. When no
    /// such text occurs, the result equals
    /// `tok.encode_with_specials(&self.render(req)?)`.
    ///
    /// How: the template is rendered a second time with every such string
    /// replaced by a marker that cannot occur in the prompt, and with `tojson`
    /// output bracketed; special tokens are taken only from the text outside
    /// markers and brackets. Putting the strings back must reproduce the plain
    /// rendering exactly; a template that inspects or edits message text in a
    /// way that breaks this is refused with an error rather than guessed at.
    pub fn render_tokens(&self, req: &ChatRenderRequest, tok: &Tokenizer) -> Result<Vec<u32>> {
        let prepared = prepare(req)?;
        let plain = self.render_ctx(context(&prepared, req, None))?;
        let nonce = pick_nonce(&plain);
        let mut markers = Markers::new(nonce);
        let marked = self.render_ctx(context(&prepared, req, Some(&mut markers)))?;
        let (text, specials) = markers.resolve(&marked, tok)?;
        if text != plain {
            return Err(Error::Template(
                "render_tokens: the template changes message text in a way that cannot be traced \
                 (rendering with markers did not reproduce the prompt); refusing to guess which \
                 special tokens are markup"
                    .into(),
            ));
        }
        tok.encode_with_specials_at(&text, &specials)
    }

    fn render_ctx(&self, ctx: Value) -> Result<String> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(template_error)?;
        tmpl.render(ctx).map_err(template_error)
    }
}

fn prefix_path(e: Error, path: &Path) -> Error {
    match e {
        Error::Template(m) => Error::Template(format!("{}: {m}", path.display())),
        other => other,
    }
}

fn template_error(e: minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::Template(msg)
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// A message after preparation (see the module comment).
struct Prepared {
    role: String,
    content: Option<String>,
    reasoning: Option<String>,
    tool_call_id: Option<String>,
    calls: Vec<(String, String, Json)>,
}

fn prepare(req: &ChatRenderRequest) -> Result<Vec<Prepared>> {
    let mut out = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        match m.role.as_str() {
            "system" | "user" | "assistant" | "tool" => {}
            other => return Err(Error::Template(format!("message {i}: role must be system, user, assistant or tool, found `{other}`"))),
        }
        let mut content = m.content.clone();
        let mut reasoning = m.reasoning_content.clone();
        if m.role == "assistant" && reasoning.is_none() {
            if let Some(c) = &content {
                if let Some(end) = c.find("</think>") {
                    let before = &c[..end];
                    let thought = before.rsplit("<think>").next().unwrap_or(before);
                    reasoning = Some(thought.to_string());
                    let after = c.rsplit("</think>").next().unwrap_or("");
                    content = Some(after.to_string());
                }
            }
        }
        let mut calls = Vec::with_capacity(m.tool_calls.len());
        for (j, call) in m.tool_calls.iter().enumerate() {
            calls.push((call.id.clone(), call.name.clone(), parse_arguments(i, j, call)?));
        }
        out.push(Prepared {
            role: m.role.clone(),
            content: content.map(|s| s.trim().to_string()),
            reasoning: reasoning.map(|s| s.trim().to_string()),
            tool_call_id: m.tool_call_id.clone(),
            calls,
        });
    }
    Ok(out)
}

fn parse_arguments(i: usize, j: usize, call: &ToolCall) -> Result<Json> {
    // Some clients send "" for a call without arguments.
    if call.arguments_json.trim().is_empty() {
        return Ok(Json::Object(serde_json::Map::new()));
    }
    match serde_json::from_str::<Json>(&call.arguments_json) {
        Ok(v @ Json::Object(_)) => Ok(v),
        Ok(other) => {
            Err(Error::Template(format!("message {i}, tool call {j} (`{}`): arguments must be a JSON object, found {}", call.name, json_kind(&other))))
        }
        Err(e) => Err(Error::Template(format!("message {i}, tool call {j} (`{}`): arguments are not valid JSON: {e}", call.name))),
    }
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// Builds the template context. With `markers`, every string that comes from
/// the request is replaced by a marker (see `Markers`); roles stay (they were
/// checked), and so do `type` fields of tool definitions, which templates
/// compare against.
fn context(prepared: &[Prepared], req: &ChatRenderRequest, mut markers: Option<&mut Markers>) -> Value {
    fn text(s: &str, m: &mut Option<&mut Markers>) -> Json {
        match m {
            Some(mk) if !s.is_empty() => Json::String(mk.mark(s)),
            _ => Json::String(s.to_string()),
        }
    }
    let mut messages = Vec::with_capacity(prepared.len());
    for p in prepared {
        let mut obj = serde_json::Map::new();
        obj.insert("role".into(), Json::String(p.role.clone()));
        obj.insert("content".into(), p.content.as_deref().map_or(Json::Null, |s| text(s, &mut markers)));
        if let Some(r) = &p.reasoning {
            obj.insert("reasoning_content".into(), text(r, &mut markers));
        }
        if let Some(id) = &p.tool_call_id {
            obj.insert("tool_call_id".into(), text(id, &mut markers));
        }
        if !p.calls.is_empty() {
            let calls: Vec<Json> = p
                .calls
                .iter()
                .map(|(id, name, args)| {
                    let args = match &mut markers {
                        Some(mk) => mk.mark_json(args, false),
                        None => args.clone(),
                    };
                    serde_json::json!({
                        "id": text(id, &mut markers),
                        "type": "function",
                        "function": {"name": text(name, &mut markers), "arguments": args},
                    })
                })
                .collect();
            obj.insert("tool_calls".into(), Json::Array(calls));
        }
        messages.push(Json::Object(obj));
    }
    let tools = req.tools.as_ref().map(|tools| {
        Json::Array(
            tools
                .iter()
                .map(|t| match &mut markers {
                    Some(mk) => mk.mark_json(t, true),
                    None => t.clone(),
                })
                .collect(),
        )
    });
    let mut ctx = serde_json::Map::new();
    ctx.insert("messages".into(), Json::Array(messages));
    ctx.insert("tools".into(), tools.unwrap_or(Json::Null));
    ctx.insert("add_generation_prompt".into(), Json::Bool(req.add_generation_prompt));
    ctx.insert("enable_thinking".into(), Json::Bool(req.enable_thinking));
    // HF passes these; some templates print them.
    ctx.insert("bos_token".into(), Json::String(String::new()));
    ctx.insert("eos_token".into(), Json::String("<|im_end|>".into()));
    if let Some(mk) = &markers {
        ctx.insert(MARKER_VAR.into(), Json::String(mk.nonce.clone()));
    }
    Value::from_serialize(Json::Object(ctx))
}

/// Context variable present only in the marker rendering; `tojson` brackets
/// its output when it is set.
const MARKER_VAR: &str = "__lily_marker_nonce";
const MARK_OPEN: char = '\u{E000}';
const MARK_CLOSE: char = '\u{E001}';

/// A nonce such that `MARK_OPEN + nonce` does not occur in the plain
/// rendering. Any text that could reach the marked rendering unmarked (the
/// template's own text, roles, tool `type` fields) is also in the plain
/// rendering, so no such text can forge a marker.
fn pick_nonce(plain: &str) -> String {
    let mut n: u64 = 0x4c49_4c59; // "LILY"
    loop {
        let nonce = format!("{n:x}");
        if !plain.contains(&format!("{MARK_OPEN}{nonce}")) {
            return nonce;
        }
        n = n.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    }
}

/// Markers for the second rendering of `render_tokens`:
/// `OPEN nonce s<index> CLOSE` stands for `strings[index]`;
/// `OPEN nonce b CLOSE` ... `OPEN nonce e CLOSE` brackets `tojson` output.
struct Markers {
    nonce: String,
    strings: Vec<String>,
}

impl Markers {
    fn new(nonce: String) -> Self {
        Self { nonce, strings: Vec::new() }
    }

    fn mark(&mut self, s: &str) -> String {
        self.strings.push(s.to_string());
        format!("{MARK_OPEN}{}s{}{MARK_CLOSE}", self.nonce, self.strings.len() - 1)
    }

    /// Replaces strings (and, for arguments, object keys) inside a JSON value.
    /// In tool definitions keys and `type` values stay, because templates look
    /// them up and compare them; they only reach the prompt through `tojson`,
    /// whose output is plain text anyway.
    fn mark_json(&mut self, v: &Json, is_tool_def: bool) -> Json {
        match v {
            Json::String(s) if s.is_empty() => v.clone(),
            Json::String(s) => Json::String(self.mark(s)),
            Json::Array(items) => Json::Array(items.iter().map(|x| self.mark_json(x, is_tool_def)).collect()),
            Json::Object(map) => {
                let mut out = serde_json::Map::new();
                for (k, x) in map {
                    let key = if is_tool_def || k.is_empty() { k.clone() } else { self.mark(k) };
                    let val = if is_tool_def && k == "type" { x.clone() } else { self.mark_json(x, is_tool_def) };
                    out.insert(key, val);
                }
                Json::Object(out)
            }
            _ => v.clone(),
        }
    }

    /// Rebuilds the prompt from the marked rendering and lists the special
    /// tokens that lie in the template's own text (outside markers and
    /// `tojson` brackets), as byte ranges of the rebuilt prompt.
    fn resolve(&self, marked: &str, tok: &Tokenizer) -> Result<(String, SpecialSpans)> {
        let open = format!("{MARK_OPEN}{}", self.nonce);
        let mut out = String::with_capacity(marked.len() * 2);
        let mut specials = Vec::new();
        let mut depth = 0usize;
        let mut rest = marked;
        loop {
            let (chunk, after) = match rest.find(&open) {
                Some(p) => (&rest[..p], Some(&rest[p + open.len()..])),
                None => (rest, None),
            };
            if depth == 0 {
                let base = out.len();
                specials.extend(tok.find_specials(chunk).into_iter().map(|(r, id)| (r.start + base..r.end + base, id)));
            }
            out.push_str(chunk);
            let Some(after) = after else { break };
            let close = after.find(MARK_CLOSE).ok_or_else(|| malformed("unterminated marker"))?;
            let body = &after[..close];
            rest = &after[close + MARK_CLOSE.len_utf8()..];
            match body {
                "b" => depth += 1,
                "e" => depth = depth.checked_sub(1).ok_or_else(|| malformed("unbalanced tojson bracket"))?,
                _ => {
                    let idx: usize = body.strip_prefix('s').and_then(|n| n.parse().ok()).ok_or_else(|| malformed("unknown marker"))?;
                    let s = self.strings.get(idx).ok_or_else(|| malformed("marker index out of range"))?;
                    if depth == 0 {
                        out.push_str(s);
                    } else {
                        // Inside tojson output the string was serialised with
                        // its quotes around the marker; put back its escaped form.
                        let quoted = serde_json::to_string(s).map_err(|e| Error::Template(e.to_string()))?;
                        out.push_str(&quoted[1..quoted.len() - 1]);
                    }
                }
            }
        }
        if depth != 0 {
            return Err(malformed("unbalanced tojson bracket"));
        }
        Ok((out, specials))
    }
}

/// Special-token ids with the byte range of the prompt they stand for.
type SpecialSpans = Vec<(std::ops::Range<usize>, u32)>;

fn malformed(what: &str) -> Error {
    Error::Template(format!("render_tokens: {what} in the marked rendering (the template altered a marker)"))
}

/// `tojson` as Hugging Face defines it for chat templates: Python's
/// `json.dumps(x, ensure_ascii=False)`, i.e. `", "` and `": "` separators, keys
/// in insertion order, no HTML escaping; `indent=n` gives the indented form.
fn py_tojson(state: &State, value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_py_json(&json, indent, 0, &mut out);
    if let Some(nonce) = state.lookup(MARKER_VAR).filter(|v| !v.is_undefined() && !v.is_none()) {
        let nonce = nonce.as_str().unwrap_or_default();
        out = format!("{MARK_OPEN}{nonce}b{MARK_CLOSE}{out}{MARK_OPEN}{nonce}e{MARK_CLOSE}");
    }
    Ok(Value::from_safe_string(out))
}

fn write_py_json(v: &Json, indent: Option<usize>, level: usize, out: &mut String) {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_py_json(x, indent, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, x)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                write_py_json(x, indent, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
        // Scalars and empty containers print the same in serde and Python.
        other => out.push_str(&other.to_string()),
    }
}
