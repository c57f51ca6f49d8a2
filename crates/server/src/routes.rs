//! The endpoint handlers: chat completions, legacy completions, models,
//! health and metrics.
//!
//! A generation request goes: body bytes -> strict parse -> plan
//! (`validate.rs`) -> chat template and tokens (small prompts on the
//! request's task, others on a blocking thread: long prompts take a while)
//! -> `Driver::start` (engine submit: queue-full and context errors come
//! back here as proper HTTP statuses) -> the endpoint's answer shape
//! (`shapes.rs`) -> `respond`, which collects the response or streams it
//! (`respond.rs`). The handlers differ only up to the shape.

use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use lily_core::chat::ChatRenderRequest;
use lily_engine::GenerateRequest;
use serde::de::DeserializeOwned;

use crate::driver::{Driver, ForcedCall};
use crate::engine::ArrivalGuard;
use crate::error::ApiError;
use crate::openai::{ChatCompletionRequest, CompletionRequest, ModelCard, ModelList};
use crate::output::ChatAssembler;
use crate::respond::{respond, InFlight};
use crate::shapes::{ChatShape, Meta, TextShape};
use crate::state::AppState;
use crate::validate::{chat_plan, completion_plan, parse_json, GenerationPlan, PromptPlan, ToolMode};

/// Reads a generation request: its body, parsed strictly, naming a model
/// this server serves.
fn read_request<R: DeserializeOwned>(app: &AppState, body: Result<Bytes, BytesRejection>, model: impl Fn(&R) -> &str) -> Result<R, ApiError> {
    let bytes = body.map_err(|rej| {
        if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(app.config.max_body_bytes)
        } else {
            ApiError::invalid(format!("cannot read the request body: {rej}"))
        }
    })?;
    let req = parse_json(&bytes)?;
    check_model(app, model(&req))?;
    Ok(req)
}

/// Every server answers to `lily` too, so examples work whatever the
/// checkpoint is called; other names are refused, as OpenAI does.
pub const MODEL_ALIAS: &str = "lily";

fn check_model(app: &AppState, model: &str) -> Result<(), ApiError> {
    if model == app.info.name || model == MODEL_ALIAS {
        Ok(())
    } else {
        Err(ApiError::model_not_found(model, &app.info.name))
    }
}

fn check_accepting(app: &AppState) -> Result<(), ApiError> {
    if app.is_draining() {
        Err(ApiError::unavailable("the server is shutting down", Some(5)))
    } else {
        Ok(())
    }
}

fn template_error(e: lily_core::Error) -> ApiError {
    match e {
        lily_core::Error::Template(m) => ApiError::invalid_param("messages", format!("cannot render the chat: {m}")),
        other => ApiError::internal(format!("tokenizer: {other}")),
    }
}

/// Prompts of at most this many bytes of ASCII text are rendered and
/// tokenized on the request's own task; longer ones on a blocking thread.
/// ASCII encodes at ~50 ns a byte at worst (the tokenizer's hand split,
/// words new to the BPE cache), so the task is held for at most ~0.4 ms,
/// while the hand-over to a blocking thread cost ~70-140 us of a ~0.3-0.45
/// ms preparation on the CPU demo (one client, 265-token prompts).
const INLINE_ASCII_BYTES: usize = 8 << 10;
/// The same bound for prompts with other characters, which can cost more a
/// byte: CJK's long pieces are BPE merges (~180 ns a byte), text not in NFC
/// takes the library's whole pipeline (~400), so at most ~0.8 ms here.
/// Long prompts take milliseconds: those never hold an async worker.
const INLINE_OTHER_BYTES: usize = 2 << 10;

/// Whether `texts` together are short enough to prepare inline: at most
/// `INLINE_ASCII_BYTES` if all ASCII, else `INLINE_OTHER_BYTES`.
fn small_prompt<'a>(texts: impl IntoIterator<Item = &'a str>) -> bool {
    let (mut bytes, mut ascii) = (0, true);
    for t in texts {
        bytes += t.len();
        ascii &= t.is_ascii();
        if bytes > if ascii { INLINE_ASCII_BYTES } else { INLINE_OTHER_BYTES } {
            return false;
        }
    }
    true
}

/// A chat whose rendered prompt is small (`small_prompt` of every string a
/// message carries) and has no tool definitions (they are rendered as JSON,
/// of any size).
fn chat_renders_inline(render: &ChatRenderRequest) -> bool {
    render.tools.is_none()
        && small_prompt(render.messages.iter().flat_map(|m| {
            let calls = m.tool_calls.iter().flat_map(|c| [c.id.as_str(), c.name.as_str(), c.arguments_json.as_str()]);
            [m.content.as_deref(), m.reasoning_content.as_deref(), m.tool_call_id.as_deref()].into_iter().flatten().chain(calls)
        }))
}

/// Runs a prompt's preparation on the request's task when `inline` (small
/// prompts), else on a blocking thread. Either way a panic in it
/// becomes a JSON 500 for this request, not a dropped connection.
async fn prepare_prompt<T: Send + 'static>(inline: bool, f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    if inline {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .unwrap_or_else(|panic| Err(ApiError::internal(format!("preparing the prompt panicked: {}", lily_engine::panic_message(&panic)))))
    } else {
        tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| Err(ApiError::internal(format!("worker task failed: {e}"))))
    }
}

/// The connection a request came on, when the server knows it, as the
/// engine's opaque client id (`GenerateRequest::client`): requests on one
/// kept-alive connection are one client's.
pub(crate) type Peer = Option<Extension<ConnectInfo<SocketAddr>>>;

pub(crate) fn client_of(peer: &Peer) -> Option<u64> {
    peer.as_ref().map(|Extension(ConnectInfo(addr))| {
        let mut h = std::hash::DefaultHasher::new();
        addr.hash(&mut h);
        h.finish()
    })
}

/// Builds the engine request once the prompt is known and submits it with
/// its announcement and its client.
#[allow(clippy::too_many_arguments)]
fn start(
    app: &AppState,
    prompt: Vec<u32>,
    gen: &GenerationPlan,
    forced: Option<ForcedCall>,
    thinking: bool,
    arrival: Option<ArrivalGuard>,
    client: Option<u64>,
) -> Result<Driver, ApiError> {
    let room = app.info.context_length.saturating_sub(prompt.len());
    // With no limit asked for, generate up to the context; at least 1 so an
    // over-long prompt is reported as such by the engine.
    let max_tokens = gen.max_tokens.unwrap_or(room).max(1);
    let mut req = GenerateRequest::new(prompt, max_tokens);
    req.sampling = gen.sampling.clone();
    req.stop_strings = gen.stop.clone();
    req.logprobs = gen.logprobs;
    req.deadline = app.config.request_timeout.map(|d| Instant::now() + d);
    req.client = client;
    Driver::start(app.engine.clone(), app.tokenizer.clone(), req, forced, thinking, app.config.request_timeout, arrival)
}

// ---------------------------------------------------------------- chat ----

pub async fn chat_completions(State(app): State<Arc<AppState>>, peer: Peer, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    // Held while the request is prepared and handed over with it (the
    // engine ends it once the request is queued), or dropped if it is
    // refused: an idle engine waits for it before a prefill it could share.
    let arrival = app.engine.arrival();
    let req = read_request(&app, body, |r: &ChatCompletionRequest| &r.model)?;
    let plan = chat_plan(&req, &app.config.limits, &app.config.sampling_defaults)?;
    check_accepting(&app)?;

    let forced = match &plan.tool_mode {
        ToolMode::Required => Some(ForcedCall::any()),
        ToolMode::Named(name) => Some(ForcedCall::named(name)),
        ToolMode::Off | ToolMode::Auto => None,
    };
    let prompt = {
        let (template, tokenizer) = (app.template.clone(), app.tokenizer.clone());
        let render = plan.render.clone();
        let opening = forced.as_ref().filter(|_| !plan.thinking).map(|f| f.opening.clone());
        prepare_prompt(chat_renders_inline(&render), move || {
            let mut ids = template.render_tokens(&render, &tokenizer).map_err(template_error)?;
            if let Some(opening) = opening {
                // Thinking off: the call is opened at the end of the prompt.
                ids.extend(tokenizer.encode_with_specials(&opening).map_err(template_error)?);
            }
            Ok(ids)
        })
        .await?
    };
    tracing::debug!(prompt_tokens = prompt.len(), since_arrival_us = arrived.elapsed().as_micros() as u64, "chat prompt rendered and tokenized");
    let driver = start(&app, prompt, &plan.gen, forced, plan.thinking, arrival, client_of(&peer))?;
    let tools = (plan.tool_mode != ToolMode::Off).then(|| plan.schemas.clone());
    let asm = ChatAssembler::new(plan.thinking, tools);
    let asm = if plan.single_call { asm.single_call() } else { asm };
    let meta = Meta::new("chatcmpl-", &app.info.name, &plan.gen);
    let flight = InFlight::new(app.metrics.clone(), &meta.id, arrived);
    respond(driver, ChatShape::new(meta, asm, plan.thinking), flight, plan.gen.stream).await
}

// ---------------------------------------------------------- completions ----

pub async fn completions(State(app): State<Arc<AppState>>, peer: Peer, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let arrival = app.engine.arrival();
    let req = read_request(&app, body, |r: &CompletionRequest| &r.model)?;
    let plan = completion_plan(&req, &app.config.sampling_defaults)?;
    check_accepting(&app)?;
    let tokenizer = app.tokenizer.clone();
    let (prompt, prompt_text) = match plan.prompt.clone() {
        // A raw prompt is the model's input as written: special-token text
        // in it is markup (unlike chat messages, whose text never is).
        PromptPlan::Text(s) => {
            prepare_prompt(small_prompt([s.as_str()]), move || {
                tokenizer.encode_with_specials(&s).map(|ids| (ids, s)).map_err(|e| ApiError::internal(format!("tokenizer: {e}")))
            })
            .await?
        }
        PromptPlan::Tokens(ids) => {
            let text = if plan.echo {
                tokenizer.decode(&ids).map_err(|e| ApiError::invalid_param("prompt", format!("cannot decode the prompt: {e}")))?
            } else {
                String::new()
            };
            (ids, text)
        }
    };
    let driver = start(&app, prompt, &plan.gen, None, false, arrival, client_of(&peer))?;
    let meta = Meta::new("cmpl-", &app.info.name, &plan.gen);
    let echo = if plan.echo { prompt_text } else { String::new() };
    let flight = InFlight::new(app.metrics.clone(), &meta.id, arrived);
    respond(driver, TextShape::new(meta, echo), flight, plan.gen.stream).await
}

// ------------------------------------------------------- small endpoints ----

fn model_card(app: &AppState) -> ModelCard {
    let mut notes = Vec::new();
    if app.info.synthetic {
        notes.push("random weights (a synthetic demo checkpoint): the output is meaningless text".to_string());
    }
    if let Some(n) = &app.config.model_note {
        notes.push(n.clone());
    }
    ModelCard {
        id: app.info.name.clone(),
        object: "model",
        created: app.started,
        owned_by: "lily",
        context_length: app.info.context_length,
        backend: app.info.backend.clone(),
        synthetic: app.info.synthetic,
        note: (!notes.is_empty()).then(|| notes.join("; ")),
    }
}

pub async fn list_models(State(app): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList { object: "list", data: vec![model_card(&app)] })
}

pub async fn get_model(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<ModelCard>, ApiError> {
    if id == app.info.name || id == MODEL_ALIAS {
        Ok(Json(model_card(&app)))
    } else {
        Err(ApiError::model_not_found(&id, &app.info.name).with_param("id"))
    }
}

pub async fn health(State(app): State<Arc<AppState>>) -> Response {
    let stats = app.engine.stats();
    let status = if app.is_draining() { "draining" } else { "ok" };
    let body = serde_json::json!({
        "status": status,
        "model": app.info.name,
        "synthetic": app.info.synthetic,
        "running": stats.running,
        "waiting": stats.waiting,
    });
    let code = if app.is_draining() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    (code, Json(body)).into_response()
}

pub async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    let text = app.metrics.render(&app.engine.stats());
    let mut resp = text.into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use lily_core::chat::{ChatMessage, ToolCall};

    fn chat(messages: Vec<ChatMessage>) -> ChatRenderRequest {
        ChatRenderRequest { messages, ..Default::default() }
    }

    #[test]
    fn a_connections_requests_are_one_client_and_other_connections_others() {
        let peer = |addr: &str| -> Peer { Some(Extension(ConnectInfo(addr.parse().expect("address")))) };
        let a = client_of(&peer("127.0.0.1:40000"));
        assert!(a.is_some());
        assert_eq!(a, client_of(&peer("127.0.0.1:40000")), "one connection, one client");
        assert_ne!(a, client_of(&peer("127.0.0.1:40001")), "another connection of the same host");
        assert_eq!(client_of(&None), None, "no peer known (a request not served over TCP)");
    }

    #[test]
    fn small_prompts_are_prepared_inline() {
        let at_limit = "x".repeat(INLINE_ASCII_BYTES - 5);
        assert!(chat_renders_inline(&chat(vec![ChatMessage::system("hi"), ChatMessage::user(at_limit.clone())])));
        // One byte over, counted across messages.
        assert!(!chat_renders_inline(&chat(vec![ChatMessage::system("hi!!!!"), ChatMessage::user(at_limit)])));
        // Any non-ASCII character, in any string a message carries, sets the
        // smaller bound.
        let other = "\u{e9}".repeat(INLINE_OTHER_BYTES / 2);
        assert!(chat_renders_inline(&chat(vec![ChatMessage::user(other.clone())])));
        assert!(!chat_renders_inline(&chat(vec![ChatMessage::user(format!("{other}x"))])));
        assert!(!chat_renders_inline(&chat(vec![ChatMessage::user(format!("{}\u{e9}", "x".repeat(INLINE_OTHER_BYTES)))])));
        let mut call = ChatMessage::assistant("ok");
        call.tool_calls.push(ToolCall {
            id: "c1".into(),
            name: "f".into(),
            arguments_json: format!("{{\"q\": \"{}\"}}", "\u{4e2d}".repeat(INLINE_OTHER_BYTES / 3)),
        });
        assert!(!chat_renders_inline(&chat(vec![ChatMessage::user("hi"), call.clone()])));
        call.tool_calls[0].arguments_json = "{\"q\": \"\u{4e2d}\"}".into();
        assert!(chat_renders_inline(&chat(vec![ChatMessage::user("hi"), call])));
        // Tool definitions render as JSON of any size: never inline.
        let mut with_tools = chat(vec![ChatMessage::user("hi")]);
        with_tools.tools = Some(vec![serde_json::json!({"type": "function", "function": {"name": "f"}})]);
        assert!(!chat_renders_inline(&with_tools));
        assert!(small_prompt(["abc", "def"]));
        assert!(small_prompt(["\u{a0}"]));
        assert!(!small_prompt(["\u{a0}", &"x".repeat(INLINE_OTHER_BYTES)]));
    }

    #[test]
    fn a_panic_while_preparing_is_an_internal_error_either_way() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        for inline in [true, false] {
            let got = rt.block_on(prepare_prompt(inline, || -> Result<(), ApiError> { panic!("template bug") }));
            let err = got.expect_err("a panic must not pass as a prompt");
            assert_eq!(err.status, StatusCode::INTERNAL_SERVER_ERROR, "inline {inline}");
            assert!(err.message.contains("template bug"), "{}", err.message);
            assert!(rt.block_on(prepare_prompt(inline, || Ok(7))).is_ok_and(|v| v == 7));
        }
    }
}
