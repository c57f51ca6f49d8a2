//! Request body -> validated plan -> prompt tokens, as the server does it.
//!
//! The bytes are read as a chat request (`parse_json` + `chat_plan`, then
//! the template's `render_tokens` and, for a forced tool call, the call's
//! opening) and as a legacy completion request (`completion_plan`, then the
//! prompt's encoding). Besides "no panic": every refusal is a 400 with a
//! message and an error body that serialises, and a plan never carries
//! values the engine would reject.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lily_engine::SamplingParams;
use lily_fuzz::{template, tokenizer};
use lily_server::driver::ForcedCall;
use lily_server::openai::{ChatCompletionRequest, CompletionRequest};
use lily_server::validate::{chat_plan, completion_plan, parse_json, Limits, PromptPlan, ToolMode};
use lily_server::ApiError;

fn check_refusal(e: &ApiError) {
    assert_eq!(
        e.status.as_u16(),
        400,
        "validation must refuse with 400: {e:?}"
    );
    assert!(!e.message.is_empty(), "{e:?}");
    let body = serde_json::to_string(&e.body()).unwrap_or_else(|err| panic!("error body: {err}"));
    assert!(body.contains("invalid_request_error"), "{body}");
}

fn chat(data: &[u8]) {
    let req: ChatCompletionRequest = match parse_json(data) {
        Ok(r) => r,
        Err(e) => return check_refusal(&e),
    };
    let plan = match chat_plan(&req, &Limits::default(), &SamplingParams::default()) {
        Ok(p) => p,
        Err(e) => return check_refusal(&e),
    };
    assert!(
        plan.gen.sampling.validate().is_ok(),
        "{:?}",
        plan.gen.sampling
    );
    assert!(!plan.render.messages.is_empty());
    assert!(plan.gen.max_tokens != Some(0));
    // The template may refuse (e.g. tool arguments that are not an object);
    // the server turns that into a 400. It must not panic.
    let Ok(mut ids) = template().render_tokens(&plan.render, tokenizer()) else {
        return;
    };
    let forced = match &plan.tool_mode {
        ToolMode::Required => Some(ForcedCall::any()),
        ToolMode::Named(name) => Some(ForcedCall::named(name)),
        ToolMode::Off | ToolMode::Auto => None,
    };
    if let Some(f) = forced.filter(|_| !plan.thinking) {
        let opening = tokenizer()
            .encode_with_specials(&f.opening)
            .unwrap_or_else(|e| panic!("forced opening {:?}: {e}", f.opening));
        ids.extend(opening);
    }
    assert!(!ids.is_empty());
}

fn completion(data: &[u8]) {
    let req: CompletionRequest = match parse_json(data) {
        Ok(r) => r,
        Err(e) => return check_refusal(&e),
    };
    let plan = match completion_plan(&req, &SamplingParams::default()) {
        Ok(p) => p,
        Err(e) => return check_refusal(&e),
    };
    assert!(
        plan.gen.sampling.validate().is_ok(),
        "{:?}",
        plan.gen.sampling
    );
    match &plan.prompt {
        PromptPlan::Text(s) => {
            assert!(!s.is_empty());
            let ids = tokenizer()
                .encode_with_specials(s)
                .unwrap_or_else(|e| panic!("encode: {e}"));
            assert!(!ids.is_empty());
        }
        PromptPlan::Tokens(ids) => {
            assert!(!ids.is_empty());
            // `echo` decodes the prompt; an id outside the vocabulary is an
            // error value, never a panic.
            let _ = tokenizer().decode(ids);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    chat(data);
    completion(data);
});
