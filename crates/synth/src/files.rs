//! The small files of a checkpoint directory, in the shape of the Qwen3.6
//! release's: `tokenizer.json`, `tokenizer_config.json` and
//! `generation_config.json` (`chat_template.jinja` is Lily's template,
//! written as is).
//!
//! This is where the tokenizer's data (the vocabulary and added tokens Lily
//! ships, in `lily_core::tokenizer`) and the chat format's data (Lily's
//! template, in `lily_core::chat`) meet, because a checkpoint writer needs
//! both; neither of those modules knows about the other's files. It does not
//! read these files for serving (`lily_core` does).

use lily_core::tokenizer::{embedded_tokenizer_json, FIRST_SPECIAL_ID, NOT_FLAGGED_SPECIAL_IN_RELEASE, SPECIAL_TOKENS};
use lily_core::{Error, Result};

/// Longest prompt, in tokens, the real tokenizer_config.json advertises.
const MODEL_MAX_LENGTH: u32 = 262_144;

/// Whether the release flags an added token `"special": true`.
fn flagged_special_in_release(token: &str) -> bool {
    !NOT_FLAGGED_SPECIAL_IN_RELEASE.contains(&token)
}

/// The `tokenizer.json` Lily ships with the release's `special` flags: the
/// 12 tokens of `NOT_FLAGGED_SPECIAL_IN_RELEASE` (`<think>`, `<tool_call>`,
/// the FIM tokens, ...) are `"special": false`, as in the file people
/// download, so every test that loads a synthetic checkpoint loads the
/// tokenizer as a real checkpoint brings it.
pub fn tokenizer_json() -> Result<Vec<u8>> {
    let bad = |what: &str| Error::Tokenizer(format!("embedded tokenizer.json: {what}"));
    let mut json: serde_json::Value = serde_json::from_slice(&embedded_tokenizer_json()?).map_err(|e| bad(&format!("not JSON: {e}")))?;
    let added = json.get_mut("added_tokens").and_then(serde_json::Value::as_array_mut).ok_or_else(|| bad("no `added_tokens` list"))?;
    let mut unflagged = 0;
    for token in added {
        let content = token.get("content").and_then(serde_json::Value::as_str).ok_or_else(|| bad("an added token without `content`"))?;
        let special = flagged_special_in_release(content);
        unflagged += usize::from(!special);
        token["special"] = special.into();
    }
    if unflagged != NOT_FLAGGED_SPECIAL_IN_RELEASE.len() {
        return Err(bad(&format!("{unflagged} of the {} tokens the release leaves unflagged are added tokens", NOT_FLAGGED_SPECIAL_IN_RELEASE.len())));
    }
    serde_json::to_vec(&json).map_err(|e| Error::Other(format!("serialising tokenizer.json: {e}")))
}

/// A `tokenizer_config.json` in the shape of the release's: eos
/// `<|im_end|>`, pad `<|endoftext|>`, no bos, the 33 added tokens in
/// `added_tokens_decoder` with the release's `special` flags, and Lily's
/// chat template inline.
pub fn tokenizer_config_json() -> serde_json::Value {
    let mut decoder = serde_json::Map::new();
    for (i, tok) in SPECIAL_TOKENS.iter().enumerate() {
        decoder.insert(
            (FIRST_SPECIAL_ID + i as u32).to_string(),
            serde_json::json!({
                "content": tok,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": flagged_special_in_release(tok),
            }),
        );
    }
    let additional: Vec<&str> = SPECIAL_TOKENS[1..].iter().copied().filter(|t| flagged_special_in_release(t)).collect();
    serde_json::json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": additional,
        "bos_token": null,
        "chat_template": lily_core::chat::DEFAULT_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    })
}

/// The `generation_config.json` of the Qwen3.5/3.6 releases: stop on
/// `<|im_end|>` and `<|endoftext|>`, and the model card's sampling for
/// thinking mode (temperature 1.0, top-p 0.95, top-k 20).
pub fn generation_config_json() -> serde_json::Value {
    serde_json::json!({
        "bos_token_id": 248044,
        "do_sample": true,
        "eos_token_id": [248046, 248044],
        "pad_token_id": 248044,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_json_has_the_release_flags_and_loads() {
        let bytes = tokenizer_json().expect("tokenizer.json");
        let json: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        let added = json["added_tokens"].as_array().expect("added tokens");
        assert_eq!(added.len(), SPECIAL_TOKENS.len());
        let unflagged: Vec<&str> = added.iter().filter(|t| t["special"] == false).map(|t| t["content"].as_str().expect("content")).collect();
        let mut want = NOT_FLAGGED_SPECIAL_IN_RELEASE.to_vec();
        want.sort_unstable();
        let mut got = unflagged.clone();
        got.sort_unstable();
        assert_eq!(got, want);
        // Everything but the flags is the embedded file.
        let mut embedded: serde_json::Value = serde_json::from_slice(&embedded_tokenizer_json().expect("embedded")).expect("JSON");
        for t in embedded["added_tokens"].as_array_mut().expect("added") {
            let content = t["content"].as_str().expect("content").to_string();
            t["special"] = flagged_special_in_release(&content).into();
        }
        assert_eq!(json, embedded);
        // And the control tokens stay control tokens when loaded.
        let tok = lily_core::tokenizer::Tokenizer::from_bytes(&bytes).expect("loads");
        let think = FIRST_SPECIAL_ID + 24;
        assert_eq!(SPECIAL_TOKENS[24], "<think>");
        assert!(tok.is_special(think));
        assert!(!tok.encode("<think>").expect("encode").contains(&think));
    }

    #[test]
    fn tokenizer_config_has_the_release_shape() {
        let cfg = tokenizer_config_json();
        assert_eq!(cfg["eos_token"], "<|im_end|>");
        assert_eq!(cfg["pad_token"], "<|endoftext|>");
        assert_eq!(cfg["chat_template"], lily_core::chat::DEFAULT_CHAT_TEMPLATE);
        let decoder = cfg["added_tokens_decoder"].as_object().expect("decoder");
        assert_eq!(decoder.len(), 33);
        assert_eq!(decoder["248069"]["content"], "</think>");
        assert_eq!(decoder["248069"]["special"], false);
        assert_eq!(decoder["248046"]["content"], "<|im_end|>");
        assert_eq!(decoder["248046"]["special"], true);
        let additional = cfg["additional_special_tokens"].as_array().expect("list");
        assert_eq!(additional.len(), 33 - 1 - 12);
        assert!(!additional.iter().any(|t| t == "<think>"));
    }
}
