//! From request bytes to something the engine can run, or a 400 that says
//! exactly what is wrong.
//!
//! `parse_json` reads a body into one of the `openai.rs` request types and
//! turns serde's errors into OpenAI errors naming the field (`param`).
//! `chat_plan` / `completion_plan` check values, limits and combinations and
//! produce a plan: the chat-template input, sampling, stops, logprobs,
//! streaming options and tool mode. The prompt's token count is not known
//! here; `max_tokens` against the context is settled after templating.

use lily_core::chat::{ChatMessage, ChatRenderRequest, ToolCall};
use lily_engine::{SamplingParams, MAX_TOP_LOGPROBS};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;
use crate::openai::{ChatCompletionRequest, ChatMessageIn, CompletionRequest, MessageContent, PromptIn, StringOrList, ToolChoiceIn};
use crate::tool_parser::ToolSchemas;

/// OpenAI's limit on stop sequences.
pub const MAX_STOP_STRINGS: usize = 4;
/// Longest stop string accepted, in bytes.
pub const MAX_STOP_BYTES: usize = 256;
/// OpenAI's limit on function names: `^[a-zA-Z0-9_-]{1,64}$`.
pub const MAX_FUNCTION_NAME: usize = 64;
/// Most tools per request (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// Fields some clients send that we do not support, with what to do instead.
const UNSUPPORTED_HINTS: &[(&str, &str)] = &[
    ("functions", "the deprecated `functions` field is not supported; use `tools`"),
    ("function_call", "the deprecated `function_call` field is not supported; use `tool_choice`"),
    ("reasoning_effort", "`reasoning_effort` is not supported; turn thinking on or off with `chat_template_kwargs: {\"enable_thinking\": false}`"),
    ("audio", "audio output is not supported"),
    ("prediction", "predicted outputs are not supported"),
    ("web_search_options", "web search is not supported"),
];

/// Parses a JSON body strictly into `T`.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid("the request body is empty; expected a JSON object"));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(&mut de);
    match parsed {
        Ok(v) => {
            de.end().map_err(|e| ApiError::invalid(format!("invalid JSON: {e}")))?;
            Ok(v)
        }
        Err(err) => {
            let path = err.path().to_string();
            let inner = err.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                return Err(ApiError::invalid(format!("invalid JSON: {inner}")));
            }
            let msg = inner.to_string();
            let msg = msg.split(" at line ").next().unwrap_or(&msg).to_string();
            if let Some(field) = unknown_field_name(&msg) {
                // The path already ends in the field's name when it is known.
                let param = if path == "." {
                    field.clone()
                } else if path == field || path.ends_with(&format!(".{field}")) {
                    path.clone()
                } else {
                    format!("{path}.{field}")
                };
                let hint = UNSUPPORTED_HINTS
                    .iter()
                    .find(|(name, _)| param == *name)
                    .map(|(_, h)| h.to_string())
                    .unwrap_or_else(|| format!("unsupported field `{param}`: Lily rejects request fields it does not implement"));
                return Err(ApiError::invalid_param(param, hint).with_code("unsupported_parameter"));
            }
            if path == "." {
                if let Some(field) = missing_field_name(&msg) {
                    return Err(ApiError::invalid_param(field.clone(), format!("missing required field `{field}`")));
                }
                return Err(ApiError::invalid(format!("invalid request: {msg}")));
            }
            Err(ApiError::invalid_param(path.clone(), format!("invalid value for `{path}`: {msg}")))
        }
    }
}

fn backticked_after(msg: &str, prefix: &str) -> Option<String> {
    let rest = msg.strip_prefix(prefix)?;
    let end = rest.find('`')?;
    Some(rest[..end].to_string())
}

fn unknown_field_name(msg: &str) -> Option<String> {
    backticked_after(msg, "unknown field `")
}

fn missing_field_name(msg: &str) -> Option<String> {
    backticked_after(msg, "missing field `")
}

/// What the server does about tools for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolMode {
    /// No tools in the prompt, no parsing (no tools, or `tool_choice: none`).
    Off,
    /// Tools in the prompt; calls are parsed when the model makes them.
    Auto,
    /// The model must call some tool: the call is started for it.
    Required,
    /// The model must call this tool.
    Named(String),
}

/// Sampling, stops and logprobs shared by both endpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationPlan {
    pub sampling: SamplingParams,
    /// Requested completion limit; `None` means "up to the context".
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    /// Top alternatives per token when logprobs are on.
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
}

/// A validated chat request.
#[derive(Clone, Debug)]
pub struct ChatPlan {
    pub render: ChatRenderRequest,
    pub gen: GenerationPlan,
    pub tool_mode: ToolMode,
    pub schemas: ToolSchemas,
    pub thinking: bool,
    /// `parallel_tool_calls: false`: only the first call is returned.
    pub single_call: bool,
}

/// Limits that come from the server's flags.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_messages: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_messages: 1024 }
    }
}

struct Knobs<'a> {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    seed: Option<i64>,
    stop: Option<&'a StringOrList>,
    n: Option<u32>,
    logit_bias: Option<&'a serde_json::Map<String, Value>>,
}

/// The sampling knobs of a chat or a completions request (the two request
/// types name them alike).
macro_rules! knobs_of {
    ($req:expr) => {
        Knobs {
            temperature: $req.temperature,
            top_p: $req.top_p,
            top_k: $req.top_k,
            min_p: $req.min_p,
            presence_penalty: $req.presence_penalty,
            frequency_penalty: $req.frequency_penalty,
            repetition_penalty: $req.repetition_penalty,
            seed: $req.seed,
            stop: $req.stop.as_ref(),
            n: $req.n,
            logit_bias: $req.logit_bias.as_ref(),
        }
    };
}

fn finite(name: &str, v: Option<f32>) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !x.is_finite() => Err(ApiError::invalid_param(name, format!("`{name}` must be a finite number"))),
        other => Ok(other),
    }
}

fn in_range(name: &str, v: Option<f32>, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match finite(name, v)? {
        Some(x) if x < lo || x > hi => Err(ApiError::invalid_param(name, format!("`{name}` must be between {lo} and {hi}, got {x}"))),
        other => Ok(other),
    }
}

/// `defaults`: the values for fields the request leaves out (OpenAI's, or
/// the checkpoint's `generation_config.json`). A request that sets
/// `temperature` alone gets untruncated sampling at that temperature only
/// if the defaults do not truncate; this matches vLLM's handling.
fn sampling(k: &Knobs<'_>, defaults: &SamplingParams) -> Result<(SamplingParams, Vec<String>), ApiError> {
    let mut s = defaults.clone();
    if let Some(t) = in_range("temperature", k.temperature, 0.0, 2.0)? {
        s.temperature = t;
    }
    if let Some(p) = in_range("top_p", k.top_p, 0.0, 1.0)? {
        if p == 0.0 {
            // Nucleus of mass 0 keeps only the most likely token.
            s.temperature = 0.0;
        } else {
            s.top_p = p;
        }
    }
    match k.top_k {
        None | Some(-1) | Some(0) => {}
        Some(n) if n > 0 => s.top_k = n as usize,
        Some(n) => return Err(ApiError::invalid_param("top_k", format!("`top_k` must be -1 or 0 (off) or a positive count, got {n}"))),
    }
    if let Some(p) = in_range("min_p", k.min_p, 0.0, 1.0)? {
        s.min_p = p;
    }
    if let Some(p) = in_range("presence_penalty", k.presence_penalty, -2.0, 2.0)? {
        s.presence_penalty = p;
    }
    if let Some(p) = in_range("frequency_penalty", k.frequency_penalty, -2.0, 2.0)? {
        s.frequency_penalty = p;
    }
    if let Some(p) = finite("repetition_penalty", k.repetition_penalty)? {
        if p <= 0.0 || p > 10.0 {
            return Err(ApiError::invalid_param("repetition_penalty", format!("`repetition_penalty` must be in (0, 10] (1 = off), got {p}")));
        }
        s.repetition_penalty = p;
    }
    // Negative seeds are valid OpenAI input; any 64-bit pattern is a seed.
    s.seed = k.seed.map(|x| x as u64);
    match k.n {
        None | Some(1) => {}
        Some(n) => {
            return Err(ApiError::invalid_param("n", format!("`n` must be 1: Lily returns one choice per request (got {n}); send several requests instead")))
        }
    }
    if let Some(bias) = k.logit_bias {
        if !bias.is_empty() {
            return Err(ApiError::invalid_param("logit_bias", "`logit_bias` is not supported").with_code("unsupported_parameter"));
        }
    }
    let stop = match k.stop {
        None => Vec::new(),
        Some(s) => s.clone().into_vec(),
    };
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid_param("stop", format!("at most {MAX_STOP_STRINGS} stop sequences are allowed, got {}", stop.len())));
    }
    for (i, st) in stop.iter().enumerate() {
        if st.is_empty() {
            return Err(ApiError::invalid_param(format!("stop[{i}]"), "stop sequences must not be empty"));
        }
        if st.len() > MAX_STOP_BYTES {
            return Err(ApiError::invalid_param(format!("stop[{i}]"), format!("stop sequences may be at most {MAX_STOP_BYTES} bytes")));
        }
    }
    s.validate().map_err(ApiError::invalid)?;
    Ok((s, stop))
}

fn max_tokens(param: &str, v: Option<u64>) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(0) => Err(ApiError::invalid_param(param, format!("`{param}` must be at least 1"))),
        Some(n) => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
    }
}

fn stream_flags(stream: Option<bool>, opts: Option<&crate::openai::StreamOptions>) -> Result<(bool, bool), ApiError> {
    let stream = stream.unwrap_or(false);
    if opts.is_some() && !stream {
        return Err(ApiError::invalid_param("stream_options", "`stream_options` is only allowed when `stream` is true"));
    }
    let usage = opts.and_then(|o| o.include_usage).unwrap_or(false);
    Ok((stream, usage))
}

fn message_text(i: usize, content: Option<&MessageContent>) -> Result<Option<String>, ApiError> {
    match content {
        None => Ok(None),
        Some(MessageContent::Text(s)) => Ok(Some(s.clone())),
        Some(MessageContent::Parts(parts)) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                let param = format!("messages[{i}].content[{j}]");
                match p.kind.as_str() {
                    "text" | "input_text" => match &p.text {
                        Some(t) => out.push_str(t),
                        None => return Err(ApiError::invalid_param(format!("{param}.text"), "a text part needs `text`")),
                    },
                    other => {
                        return Err(ApiError::invalid_param(
                            format!("{param}.type"),
                            format!("content parts of type `{other}` are not supported: this model takes text only"),
                        ))
                    }
                }
            }
            Ok(Some(out))
        }
    }
}

fn arguments_string(v: &Option<Value>) -> String {
    match v {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

fn convert_message(i: usize, m: &ChatMessageIn) -> Result<ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        "tool" => "tool",
        other => {
            return Err(ApiError::invalid_param(
                format!("messages[{i}].role"),
                format!("unknown role `{other}`: expected system, developer, user, assistant or tool"),
            ))
        }
    };
    if m.function_call.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::invalid_param(format!("messages[{i}].function_call"), "the deprecated `function_call` is not supported; use `tool_calls`"));
    }
    let content = message_text(i, m.content.as_ref())?;
    let mut msg = ChatMessage { role: role.to_string(), content, ..ChatMessage::default() };
    match role {
        "assistant" => {
            msg.reasoning_content = m.reasoning_content.clone().or_else(|| m.reasoning.clone());
            for (j, c) in m.tool_calls.iter().flatten().enumerate() {
                if c.kind.as_deref().is_some_and(|k| k != "function") {
                    return Err(ApiError::invalid_param(format!("messages[{i}].tool_calls[{j}].type"), "only `function` tool calls are supported"));
                }
                let arguments_json = arguments_string(&c.function.arguments);
                match serde_json::from_str::<Value>(&arguments_json) {
                    Ok(Value::Object(_)) => {}
                    _ if arguments_json.trim().is_empty() => {}
                    _ => {
                        return Err(ApiError::invalid_param(
                            format!("messages[{i}].tool_calls[{j}].function.arguments"),
                            "tool call arguments must be a JSON object (as a string)",
                        ))
                    }
                }
                check_function_name(&format!("messages[{i}].tool_calls[{j}].function.name"), &c.function.name)?;
                msg.tool_calls.push(ToolCall { id: c.id.clone().unwrap_or_default(), name: c.function.name.clone(), arguments_json });
            }
            if msg.content.is_none() && msg.tool_calls.is_empty() {
                msg.content = Some(String::new());
            }
        }
        "tool" => {
            msg.tool_call_id = m.tool_call_id.clone();
            if msg.content.is_none() {
                return Err(ApiError::invalid_param(format!("messages[{i}].content"), "a tool message needs `content`"));
            }
        }
        _ => {
            if m.tool_calls.as_ref().is_some_and(|c| !c.is_empty()) {
                return Err(ApiError::invalid_param(format!("messages[{i}].tool_calls"), "only assistant messages may carry `tool_calls`"));
            }
            if msg.content.is_none() {
                return Err(ApiError::invalid_param(format!("messages[{i}].content"), format!("a {role} message needs `content`")));
            }
        }
    }
    Ok(msg)
}

fn check_function_name(param: &str, name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty() && name.len() <= MAX_FUNCTION_NAME && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid_param(param, format!("function names must be 1-{MAX_FUNCTION_NAME} characters of a-z, A-Z, 0-9, `_`, `-` or `.`, got {name:?}")))
    }
}

/// Checks a chat request and plans it.
pub fn chat_plan(req: &ChatCompletionRequest, limits: &Limits, defaults: &SamplingParams) -> Result<ChatPlan, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "`messages` must contain at least one message"));
    }
    if req.messages.len() > limits.max_messages {
        return Err(ApiError::invalid_param(
            "messages",
            format!("too many messages: {} (this server accepts at most {})", req.messages.len(), limits.max_messages),
        )
        .with_code("too_many_messages"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let msg = convert_message(i, m)?;
        if msg.role == "system" && i != 0 {
            return Err(ApiError::invalid_param(
                format!("messages[{i}].role"),
                "a system (or developer) message is only allowed as the first message with this model's chat template",
            ));
        }
        messages.push(msg);
    }

    let (sampling, stop) = sampling(&knobs_of!(req), defaults)?;
    let mt = max_tokens("max_tokens", req.max_tokens)?;
    let mct = max_tokens("max_completion_tokens", req.max_completion_tokens)?;
    let max_tokens = match (mt, mct) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::invalid_param(
                "max_completion_tokens",
                format!("`max_tokens` ({a}) and `max_completion_tokens` ({b}) disagree; send one of them"),
            ))
        }
        (a, b) => b.or(a),
    };
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, None) => None,
        (false, Some(_)) => return Err(ApiError::invalid_param("top_logprobs", "`top_logprobs` requires `logprobs: true`")),
        (true, n) => {
            let n = n.unwrap_or(0) as usize;
            if n > MAX_TOP_LOGPROBS {
                return Err(ApiError::invalid_param("top_logprobs", format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}")));
            }
            Some(n)
        }
    };
    let (stream, include_usage) = stream_flags(req.stream, req.stream_options.as_ref())?;
    if let Some(rf) = &req.response_format {
        if rf.kind != "text" {
            return Err(ApiError::invalid_param("response_format.type", format!("response_format `{}` is not supported; only `text`", rf.kind))
                .with_code("unsupported_parameter"));
        }
    }
    if let Some(m) = &req.modalities {
        if m.iter().any(|x| x != "text") {
            return Err(ApiError::invalid_param("modalities", "only the `text` modality is supported"));
        }
    }

    // Tools.
    let tools = req.tools.as_deref().unwrap_or(&[]);
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid_param("tools", format!("at most {MAX_TOOLS} tools are allowed")));
    }
    let mut names = std::collections::HashSet::new();
    for (i, t) in tools.iter().enumerate() {
        if t.kind != "function" {
            return Err(ApiError::invalid_param(format!("tools[{i}].type"), format!("only `function` tools are supported, got `{}`", t.kind)));
        }
        check_function_name(&format!("tools[{i}].function.name"), &t.function.name)?;
        if !names.insert(t.function.name.as_str()) {
            return Err(ApiError::invalid_param(format!("tools[{i}].function.name"), format!("duplicate function name `{}`", t.function.name)));
        }
        if let Some(p) = &t.function.parameters {
            if !p.is_object() {
                return Err(ApiError::invalid_param(format!("tools[{i}].function.parameters"), "`parameters` must be a JSON Schema object"));
            }
        }
    }
    let tool_mode = match (&req.tool_choice, tools.is_empty()) {
        (None, true) => ToolMode::Off,
        (None, false) => ToolMode::Auto,
        (Some(ToolChoiceIn::Mode(m)), empty) => match m.as_str() {
            "none" => ToolMode::Off,
            "auto" if empty => ToolMode::Off,
            "auto" => ToolMode::Auto,
            "required" if empty => return Err(ApiError::invalid_param("tool_choice", "`tool_choice: required` needs at least one tool in `tools`")),
            "required" => ToolMode::Required,
            other => {
                return Err(ApiError::invalid_param("tool_choice", format!("`tool_choice` must be none, auto, required or a named function, got `{other}`")))
            }
        },
        (Some(ToolChoiceIn::Named(n)), _) => {
            if n.kind != "function" {
                return Err(ApiError::invalid_param("tool_choice.type", "`tool_choice.type` must be `function`"));
            }
            if !names.contains(n.function.name.as_str()) {
                return Err(ApiError::invalid_param(
                    "tool_choice.function.name",
                    format!("`tool_choice` names `{}`, which is not among `tools`", n.function.name),
                ));
            }
            ToolMode::Named(n.function.name.clone())
        }
    };
    let schemas = ToolSchemas::from_functions(tools.iter().map(|t| (t.function.name.as_str(), t.function.parameters.as_ref())));
    let prompt_tools: Option<Vec<Value>> = match &tool_mode {
        ToolMode::Off => None,
        // Only the named tool is shown, so the model's view matches the choice.
        ToolMode::Named(name) => Some(tool_json(tools.iter().filter(|t| &t.function.name == name))),
        _ => Some(tool_json(tools.iter())),
    };

    let thinking = req.chat_template_kwargs.as_ref().and_then(|k| k.enable_thinking).unwrap_or(true);
    Ok(ChatPlan {
        render: ChatRenderRequest { messages, tools: prompt_tools, add_generation_prompt: true, enable_thinking: thinking },
        gen: GenerationPlan { sampling, max_tokens, stop, logprobs, stream, include_usage },
        tool_mode,
        schemas,
        thinking,
        single_call: req.parallel_tool_calls == Some(false),
    })
}

/// The tools as the template sees them: OpenAI's shape, fields we know only.
fn tool_json<'a>(tools: impl Iterator<Item = &'a crate::openai::ToolDef>) -> Vec<Value> {
    tools
        .map(|t| {
            let mut f = serde_json::Map::new();
            f.insert("name".into(), Value::String(t.function.name.clone()));
            if let Some(d) = &t.function.description {
                f.insert("description".into(), Value::String(d.clone()));
            }
            if let Some(p) = &t.function.parameters {
                f.insert("parameters".into(), p.clone());
            }
            serde_json::json!({"type": "function", "function": Value::Object(f)})
        })
        .collect()
}

/// The prompt of a legacy completion request.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptPlan {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct CompletionPlan {
    pub prompt: PromptPlan,
    pub gen: GenerationPlan,
    pub echo: bool,
}

/// OpenAI's default for legacy completions.
pub const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

pub fn completion_plan(req: &CompletionRequest, defaults: &SamplingParams) -> Result<CompletionPlan, ApiError> {
    let one = |what: &str, n: usize| -> Result<(), ApiError> {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::invalid_param("prompt", format!("exactly one prompt is supported per request, got {n} {what}; send several requests instead")))
        }
    };
    let prompt = match &req.prompt {
        PromptIn::Text(s) => PromptPlan::Text(s.clone()),
        PromptIn::Texts(v) => {
            one("prompts", v.len())?;
            PromptPlan::Text(v[0].clone())
        }
        PromptIn::Tokens(t) => PromptPlan::Tokens(t.clone()),
        PromptIn::TokenLists(v) => {
            one("token lists", v.len())?;
            PromptPlan::Tokens(v[0].clone())
        }
    };
    match &prompt {
        PromptPlan::Text(s) if s.is_empty() => return Err(ApiError::invalid_param("prompt", "the prompt is empty")),
        PromptPlan::Tokens(t) if t.is_empty() => return Err(ApiError::invalid_param("prompt", "the prompt is empty")),
        _ => {}
    }
    let (sampling, stop) = sampling(&knobs_of!(req), defaults)?;
    match req.best_of {
        None | Some(1) => {}
        Some(n) => return Err(ApiError::invalid_param("best_of", format!("`best_of` must be 1, got {n}"))),
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "`suffix` (fill-in-the-middle) is not supported").with_code("unsupported_parameter"));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(n) if n as usize > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid_param("logprobs", format!("`logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}")))
        }
        Some(n) => Some(n as usize),
    };
    let echo = req.echo.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err(ApiError::invalid_param("echo", "`echo` together with `logprobs` (prompt logprobs) is not supported"));
    }
    let (stream, include_usage) = stream_flags(req.stream, req.stream_options.as_ref())?;
    let max_tokens = max_tokens("max_tokens", req.max_tokens)?.or(Some(COMPLETION_DEFAULT_MAX_TOKENS));
    Ok(CompletionPlan { prompt, gen: GenerationPlan { sampling, max_tokens, stop, logprobs, stream, include_usage }, echo })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> Result<ChatPlan, ApiError> {
        let req: ChatCompletionRequest = parse_json(v.to_string().as_bytes())?;
        chat_plan(&req, &Limits { max_messages: 8 }, &SamplingParams::default())
    }

    fn base() -> Value {
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    }

    fn with(extra: Value) -> Value {
        let mut b = base();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    }

    fn err_param(v: Value) -> (String, Option<String>) {
        let e = chat(v).unwrap_err();
        assert_eq!(e.status.as_u16(), 400, "{e:?}");
        (e.message, e.param)
    }

    #[test]
    fn minimal_request_plans_defaults() {
        let p = chat(base()).unwrap();
        assert!(p.thinking);
        assert_eq!(p.tool_mode, ToolMode::Off);
        assert_eq!(p.gen.max_tokens, None);
        assert_eq!(p.gen.sampling, SamplingParams::default());
        assert!(!p.gen.stream);
        assert_eq!(p.render.messages[0].content.as_deref(), Some("hi"));
        assert!(p.render.enable_thinking);
    }

    #[test]
    fn full_request_maps_every_knob() {
        let p = chat(with(json!({
            "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": -3,
            "stop": "END", "n": 1, "stream": true, "stream_options": {"include_usage": true},
            "logprobs": true, "top_logprobs": 5, "chat_template_kwargs": {"enable_thinking": false},
            "user": "u", "metadata": {"a": "b"}, "store": false, "parallel_tool_calls": true,
            "response_format": {"type": "text"}, "service_tier": "auto"
        })))
        .unwrap();
        let s = &p.gen.sampling;
        assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p), (0.5, 0.9, 40, 0.05));
        assert_eq!((s.presence_penalty, s.frequency_penalty, s.repetition_penalty), (0.5, -0.5, 1.1));
        assert_eq!(s.seed, Some((-3i64) as u64));
        assert_eq!(p.gen.max_tokens, Some(7));
        assert_eq!(p.gen.stop, vec!["END".to_string()]);
        assert!(p.gen.stream && p.gen.include_usage);
        assert_eq!(p.gen.logprobs, Some(5));
        assert!(!p.thinking);
    }

    #[test]
    fn content_parts_are_joined() {
        let p = chat(json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}))
        .unwrap();
        assert_eq!(p.render.messages[0].content.as_deref(), Some("ab"));
    }

    #[test]
    fn invalid_requests_name_the_field() {
        let cases: Vec<(Value, &str)> = vec![
            (with(json!({"n": 2})), "n"),
            (with(json!({"temperature": 3.0})), "temperature"),
            (with(json!({"temperature": "hot"})), "temperature"),
            (with(json!({"top_p": 1.5})), "top_p"),
            (with(json!({"top_k": -5})), "top_k"),
            (with(json!({"min_p": -0.1})), "min_p"),
            (with(json!({"presence_penalty": 2.5})), "presence_penalty"),
            (with(json!({"frequency_penalty": -3})), "frequency_penalty"),
            (with(json!({"repetition_penalty": 0})), "repetition_penalty"),
            (with(json!({"max_tokens": 0})), "max_tokens"),
            (with(json!({"max_tokens": -1})), "max_tokens"),
            (with(json!({"max_tokens": 5, "max_completion_tokens": 6})), "max_completion_tokens"),
            (with(json!({"stop": ["a", "b", "c", "d", "e"]})), "stop"),
            (with(json!({"stop": [""]})), "stop[0]"),
            (with(json!({"top_logprobs": 3})), "top_logprobs"),
            (with(json!({"logprobs": true, "top_logprobs": 21})), "top_logprobs"),
            (with(json!({"stream_options": {"include_usage": true}})), "stream_options"),
            (with(json!({"stream": true, "stream_options": {"bogus": 1}})), "stream_options.bogus"),
            (with(json!({"frobnicate": 1})), "frobnicate"),
            (with(json!({"functions": []})), "functions"),
            (with(json!({"logit_bias": {"1": 5}})), "logit_bias"),
            (with(json!({"response_format": {"type": "json_object"}})), "response_format.type"),
            (with(json!({"tool_choice": "required"})), "tool_choice"),
            (with(json!({"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]})), "tool_choice"),
            (
                with(json!({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]})),
                "tool_choice.function.name",
            ),
            (with(json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]})), "tools[0].type"),
            (with(json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]})), "tools[0].function.name"),
            (
                with(json!({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]})),
                "tools[1].function.name",
            ),
            (with(json!({"chat_template_kwargs": {"foo": true}})), "chat_template_kwargs.foo"),
            (json!({"model": "m", "messages": []}), "messages"),
            (json!({"model": "m"}), "messages"),
            (json!({"messages": [{"role": "user", "content": "x"}]}), "model"),
            (json!({"model": "m", "messages": [{"role": "robot", "content": "x"}]}), "messages[0].role"),
            (json!({"model": "m", "messages": [{"role": "user"}]}), "messages[0].content"),
            (json!({"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}), "messages[1].role"),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
                "messages[0].content[0].type",
            ),
            (json!({"model": "m", "messages": [{"role": "user", "content": "x", "weird": 1}]}), "messages[0].weird"),
            (
                json!({"model": "m", "messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}),
                "messages[0].tool_calls[0].function.arguments",
            ),
            (json!({"model": "m", "messages": (0..9).map(|_| json!({"role": "user", "content": "x"})).collect::<Vec<_>>()}), "messages"),
        ];
        for (v, param) in cases {
            let (msg, got) = err_param(v.clone());
            assert_eq!(got.as_deref(), Some(param), "request {v}: message {msg}");
            assert!(!msg.is_empty());
        }
    }

    #[test]
    fn bad_json_is_a_clear_400() {
        for body in ["", "{", "[1,2]", "{\"model\": \"m\", \"messages\": [] } trailing", "null"] {
            let e = parse_json::<ChatCompletionRequest>(body.as_bytes()).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{body}");
            assert_eq!(e.kind, "invalid_request_error");
        }
    }

    #[test]
    fn tool_modes() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}},
                           {"type": "function", "function": {"name": "g"}}]);
        let p = chat(with(json!({"tools": tools}))).unwrap();
        assert_eq!(p.tool_mode, ToolMode::Auto);
        assert_eq!(p.render.tools.as_ref().map(Vec::len), Some(2));
        assert_eq!(p.schemas.kind("f", "x"), crate::tool_parser::ParamKind::String);
        let p = chat(with(json!({"tools": tools, "tool_choice": "none"}))).unwrap();
        assert_eq!(p.tool_mode, ToolMode::Off);
        assert!(p.render.tools.is_none());
        let p = chat(with(json!({"tools": tools, "tool_choice": "required"}))).unwrap();
        assert_eq!(p.tool_mode, ToolMode::Required);
        let p = chat(with(json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}}))).unwrap();
        assert_eq!(p.tool_mode, ToolMode::Named("g".into()));
        assert_eq!(p.render.tools.as_ref().map(Vec::len), Some(1));
    }

    #[test]
    fn assistant_tool_calls_and_tool_results_are_kept() {
        let p = chat(json!({"model": "m", "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "refusal": null, "annotations": [],
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
        ]}))
        .unwrap();
        let m = &p.render.messages;
        assert_eq!(m[0].role, "system");
        assert_eq!(m[2].tool_calls[0].name, "get_weather");
        assert_eq!(m[2].tool_calls[0].arguments_json, "{\"city\":\"Paris\"}");
        assert_eq!(m[3].tool_call_id.as_deref(), Some("call_1"));
    }

    #[test]
    fn defaults_fill_what_the_request_leaves_out() {
        let defaults = SamplingParams { top_k: 20, top_p: 0.95, ..SamplingParams::default() };
        let req: ChatCompletionRequest = parse_json(with(json!({"top_p": 0.5})).to_string().as_bytes()).unwrap();
        let p = chat_plan(&req, &Limits::default(), &defaults).unwrap();
        assert_eq!((p.gen.sampling.top_k, p.gen.sampling.top_p), (20, 0.5));
    }

    /// Mangled bodies never panic: each is planned or refused with a 400.
    #[test]
    fn mangled_bodies_are_refused_cleanly() {
        use rand::{Rng, SeedableRng};
        let good = json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hé"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "1"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "auto", "stop": ["x"], "max_tokens": 5, "logprobs": true, "top_logprobs": 2, "seed": 1})
        .to_string()
        .into_bytes();
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for _ in 0..3000 {
            let mut body = good.clone();
            for _ in 0..rng.random_range(1..4) {
                let i = rng.random_range(0..body.len());
                match rng.random_range(0..3) {
                    0 => {
                        const BYTES: &[u8] = b" {}[]\",:0-9a\xc3z\\";
                        body[i] = BYTES[rng.random_range(0..BYTES.len())];
                    }
                    1 => {
                        body.remove(i);
                    }
                    _ => body.insert(i, b"\"0[{"[rng.random_range(0..4)]),
                }
            }
            let r = parse_json::<ChatCompletionRequest>(&body).and_then(|req| chat_plan(&req, &Limits::default(), &SamplingParams::default()));
            if let Err(e) = r {
                assert_eq!(e.status.as_u16(), 400, "{e:?}");
            }
        }
    }

    #[test]
    fn top_p_zero_means_greedy() {
        let p = chat(with(json!({"top_p": 0}))).unwrap();
        assert_eq!(p.gen.sampling.temperature, 0.0);
        assert_eq!(p.gen.sampling.top_p, 1.0);
    }

    #[test]
    fn completion_requests() {
        let req: CompletionRequest = parse_json(br#"{"model": "m", "prompt": "hello"}"#).unwrap();
        let p = completion_plan(&req, &SamplingParams::default()).unwrap();
        assert_eq!(p.prompt, PromptPlan::Text("hello".into()));
        assert_eq!(p.gen.max_tokens, Some(COMPLETION_DEFAULT_MAX_TOKENS));
        let req: CompletionRequest = parse_json(br#"{"model": "m", "prompt": [[1, 2, 3]], "logprobs": 2}"#).unwrap();
        let p = completion_plan(&req, &SamplingParams::default()).unwrap();
        assert_eq!(p.prompt, PromptPlan::Tokens(vec![1, 2, 3]));
        assert_eq!(p.gen.logprobs, Some(2));
        for bad in [
            r#"{"model": "m", "prompt": ["a", "b"]}"#,
            r#"{"model": "m", "prompt": ""}"#,
            r#"{"model": "m", "prompt": "a", "best_of": 3}"#,
            r#"{"model": "m", "prompt": "a", "suffix": "z"}"#,
            r#"{"model": "m", "prompt": "a", "echo": true, "logprobs": 1}"#,
            r#"{"model": "m", "prompt": {"x": 1}}"#,
        ] {
            let r = parse_json::<CompletionRequest>(bad.as_bytes()).and_then(|r| completion_plan(&r, &SamplingParams::default()).map(|_| ()));
            assert_eq!(r.unwrap_err().status.as_u16(), 400, "{bad}");
        }
    }
}
