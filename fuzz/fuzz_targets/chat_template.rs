//! The chat template with hostile messages and tools: `render` and
//! `render_tokens` of Lily's default template.
//!
//! Every string a client controls (content, reasoning, tool-call ids, names,
//! argument keys and values, tool results, tool definitions) is built from
//! fragments such as `<|im_start|>system`, `<tool_call>`, `</think>` and
//! imitations of `render_tokens`' private markers. Properties:
//! - no panic; refusals are errors;
//! - `render_tokens` decodes back to exactly what `render` printed (when that
//!   text is already NFC, since encoding normalises);
//! - special-token injection is impossible: the special ids in the tokens
//!   are exactly those of the same conversation with every `<` in client
//!   text replaced by `[`, i.e. they all come from the template's markup.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use lily_core::chat::{ChatMessage, ChatRenderRequest, ToolCall};
use lily_fuzz::{json_object, json_value, template, tokenizer, Hostile};
use serde_json::{json, Value};
use unicode_normalization::UnicodeNormalization;

#[derive(Debug)]
struct Input {
    req: ChatRenderRequest,
}

fn call(u: &mut Unstructured<'_>) -> arbitrary::Result<ToolCall> {
    let arguments_json = match u.int_in_range(0..=5)? {
        0 => u.arbitrary::<Hostile>()?.0,
        1 => String::new(),
        _ => Value::Object(json_object(u, 3)?).to_string(),
    };
    Ok(ToolCall {
        id: u.arbitrary::<Hostile>()?.0,
        name: if u.arbitrary()? {
            "get_weather".into()
        } else {
            u.arbitrary::<Hostile>()?.0
        },
        arguments_json,
    })
}

fn message(u: &mut Unstructured<'_>) -> arbitrary::Result<ChatMessage> {
    let role = match u.int_in_range(0..=8)? {
        0 => "system".to_string(),
        1..=3 => "user".to_string(),
        4..=5 => "assistant".to_string(),
        6..=7 => "tool".to_string(),
        _ => u.arbitrary::<Hostile>()?.0,
    };
    let opt = |u: &mut Unstructured<'_>| -> arbitrary::Result<Option<String>> {
        Ok(if u.ratio(3, 4)? {
            Some(u.arbitrary::<Hostile>()?.0)
        } else {
            None
        })
    };
    let content = opt(u)?;
    let reasoning_content = if role == "assistant" { opt(u)? } else { None };
    let tool_call_id = if role == "tool" { opt(u)? } else { None };
    let n_calls = if role == "assistant" {
        u.int_in_range(0..=2)?
    } else {
        0
    };
    let tool_calls = (0..n_calls)
        .map(|_| call(u))
        .collect::<arbitrary::Result<_>>()?;
    Ok(ChatMessage {
        role,
        content,
        tool_calls,
        tool_call_id,
        reasoning_content,
    })
}

fn tool(u: &mut Unstructured<'_>) -> arbitrary::Result<Value> {
    if u.ratio(1, 8)? {
        return json_value(u, 4);
    }
    let mut f = serde_json::Map::new();
    f.insert("name".into(), Value::String(u.arbitrary::<Hostile>()?.0));
    if u.arbitrary()? {
        f.insert(
            "description".into(),
            Value::String(u.arbitrary::<Hostile>()?.0),
        );
    }
    if u.arbitrary()? {
        let props = json_object(u, 3)?;
        f.insert(
            "parameters".into(),
            json!({"type": "object", "properties": props}),
        );
    }
    Ok(json!({"type": "function", "function": f}))
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let n = u.int_in_range(0..=6)?;
        let messages = (0..n)
            .map(|_| message(u))
            .collect::<arbitrary::Result<_>>()?;
        let tools = if u.arbitrary()? {
            let k = u.int_in_range(0..=3)?;
            Some((0..k).map(|_| tool(u)).collect::<arbitrary::Result<_>>()?)
        } else {
            None
        };
        Ok(Input {
            req: ChatRenderRequest {
                messages,
                tools,
                add_generation_prompt: u.arbitrary()?,
                enable_thinking: u.arbitrary()?,
            },
        })
    }
}

fn defang(s: &str) -> String {
    s.replace('<', "[")
}

fn defang_json(v: &Value) -> Value {
    match v {
        Value::String(s) => Value::String(defang(s)),
        Value::Array(a) => Value::Array(a.iter().map(defang_json).collect()),
        Value::Object(m) => {
            Value::Object(m.iter().map(|(k, x)| (defang(k), defang_json(x))).collect())
        }
        other => other.clone(),
    }
}

/// The conversation with every `<` in client text replaced by `[`: one char
/// for one char, so emptiness and trimming (which the template looks at)
/// are unchanged, and no client text can spell a special token.
fn defanged(req: &ChatRenderRequest) -> ChatRenderRequest {
    let messages = req
        .messages
        .iter()
        .map(|m| ChatMessage {
            role: m.role.clone(),
            content: m.content.as_deref().map(defang),
            reasoning_content: m.reasoning_content.as_deref().map(defang),
            tool_call_id: m.tool_call_id.as_deref().map(defang),
            tool_calls: m
                .tool_calls
                .iter()
                .map(|c| ToolCall {
                    id: defang(&c.id),
                    name: defang(&c.name),
                    arguments_json: defang(&c.arguments_json),
                })
                .collect(),
        })
        .collect();
    ChatRenderRequest {
        messages,
        tools: req
            .tools
            .as_ref()
            .map(|t| t.iter().map(defang_json).collect()),
        ..req.clone()
    }
}

/// The template splits an assistant message's `content` at `</think>` when
/// it has no `reasoning_content`; do that split up front so that the
/// defanged twin (where `</think>` is gone) has the same structure.
fn pre_split(req: &ChatRenderRequest) -> ChatRenderRequest {
    let mut out = req.clone();
    for m in &mut out.messages {
        if m.role == "assistant" && m.reasoning_content.is_none() {
            if let Some(c) = &m.content {
                if let Some(end) = c.find("</think>") {
                    let before = &c[..end];
                    let thought = before
                        .rsplit("<think>")
                        .next()
                        .unwrap_or(before)
                        .to_string();
                    let after = c.rsplit("</think>").next().unwrap_or("").to_string();
                    m.reasoning_content = Some(thought);
                    m.content = Some(after);
                }
            }
        }
    }
    out
}

fn specials(ids: &[u32]) -> Vec<u32> {
    ids.iter()
        .copied()
        .filter(|&id| tokenizer().is_special(id))
        .collect()
}

fuzz_target!(|input: Input| {
    let tok = tokenizer();
    let tmpl = template();
    let req = &input.req;
    let plain = tmpl.render(req);
    let ids = tmpl.render_tokens(req, tok);
    let (plain, ids) = match (plain, ids) {
        (Ok(p), Ok(i)) => (p, i),
        (Err(_), Err(_)) => return,
        // render_tokens may refuse a template that edits text in a way it
        // cannot trace; Lily's own template never does that.
        (p, i) => panic!(
            "render and render_tokens disagree: {:?} vs {:?}",
            p.map(|_| ()),
            i.map(|_| ())
        ),
    };
    let decoded = tok.decode(&ids).unwrap_or_else(|e| panic!("decode: {e}"));
    let nfc: String = plain.nfc().collect();
    if nfc == plain {
        assert_eq!(
            decoded, plain,
            "tokens do not decode to the rendered prompt"
        );
    }

    let split = pre_split(req);
    let ids = tmpl
        .render_tokens(&split, tok)
        .unwrap_or_else(|e| panic!("pre-split request: {e}"));
    let twin = defanged(&split);
    let twin_ids = match tmpl.render_tokens(&twin, tok) {
        Ok(i) => i,
        Err(e) => panic!("defanged twin fails where the original renders: {e}"),
    };
    assert_eq!(
        specials(&ids),
        specials(&twin_ids),
        "client text produced special tokens\nprompt: {plain:?}"
    );
});
