//! Shared pieces of Lily's fuzz targets: the tokenizer and chat template
//! loaded once per process, cutting text into arbitrary stream chunks, and
//! `arbitrary` builders for hostile strings and bounded JSON values.
//!
//! The targets themselves live in `fuzz_targets/`; each one states the
//! property it checks besides "does not panic". This crate is a test
//! harness: a failed load of the embedded tokenizer is a harness bug and
//! panics, which libFuzzer reports at once.

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use arbitrary::{Arbitrary, Result as ArbResult, Unstructured};
use lily_core::chat::ChatTemplate;
use lily_core::tensors::{DType, TensorStore};
use lily_core::tokenizer::Tokenizer;
use serde_json::Value;

static TOKENIZER: LazyLock<Tokenizer> =
    LazyLock::new(|| Tokenizer::embedded().unwrap_or_else(|e| panic!("embedded tokenizer: {e}")));
static TEMPLATE: LazyLock<ChatTemplate> = LazyLock::new(|| {
    ChatTemplate::default_template().unwrap_or_else(|e| panic!("default chat template: {e}"))
});

/// The embedded Qwen tokenizer, built on first use (about a second).
pub fn tokenizer() -> &'static Tokenizer {
    &TOKENIZER
}

/// Lily's default chat template, compiled on first use.
pub fn template() -> &'static ChatTemplate {
    &TEMPLATE
}

static SCRATCH: LazyLock<PathBuf> = LazyLock::new(|| {
    // scripts/fuzz.sh points this at a directory it removes afterwards.
    let base = std::env::var_os("LILY_FUZZ_SCRATCH").map_or_else(std::env::temp_dir, PathBuf::from);
    let dir = base.join(format!("lily-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("scratch dir {}: {e}", dir.display()));
    dir
});

/// A directory private to this process for checkpoint files; targets
/// overwrite their files in it on every run.
pub fn scratch_dir() -> &'static Path {
    &SCRATCH
}

/// Builds a safetensors file: 8-byte little-endian header length, JSON
/// header, data. `tensors`: (name, dtype name, shape, data bytes); offsets
/// are assigned in order, so the file is valid exactly when every data
/// length matches its shape and dtype.
pub fn safetensors_bytes(
    tensors: &[(String, String, Vec<usize>, Vec<u8>)],
    metadata: Option<&Value>,
) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if let Some(m) = metadata {
        header.insert("__metadata__".into(), m.clone());
    }
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = Value::Object(header).to_string();
    let mut out = Vec::with_capacity(8 + header.len() + data.len());
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    out
}

/// What an opened store promises about every tensor: its byte range holds
/// exactly shape x dtype bytes, and every accessor works on it.
pub fn check_store(store: &TensorStore, file_bytes: usize) {
    assert!(
        store.data_bytes() <= file_bytes,
        "{} data bytes from {file_bytes} file bytes",
        store.data_bytes()
    );
    let names: Vec<String> = store.names().map(str::to_string).collect();
    for name in &names {
        let t = store
            .peek(name)
            .unwrap_or_else(|| panic!("listed tensor {name:?} cannot be peeked"));
        let numel = t.numel();
        if t.dtype != DType::Other {
            assert_eq!(t.bytes().len(), numel * t.dtype.size(), "{t:?}");
        }
        let _ = t.as_u32();
        let _ = t.as_u16();
        let f = t.to_f32();
        if matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16) {
            assert_eq!(f.len(), numel, "{t:?}");
        }
        let _ = t.expect(&[DType::BF16], &[1, 2]);
        let _ = format!("{t:?}");
    }
    let _ = store.take("model.embed_tokens.weight", &[DType::U32], &[4, 4]);
    let _ = store.check_all_used(|_| false);
}

/// Cuts `text` at the given byte offsets (taken modulo the length, moved
/// forward to a char boundary, sorted): the pieces concatenate to `text`.
pub fn cut<'a>(text: &'a str, cuts: &[u16]) -> Vec<&'a str> {
    let mut points: Vec<usize> = cuts
        .iter()
        .map(|&c| {
            let mut p = if text.is_empty() {
                0
            } else {
                c as usize % (text.len() + 1)
            };
            while !text.is_char_boundary(p) {
                p += 1;
            }
            p
        })
        .collect();
    points.sort_unstable();
    let mut out = Vec::with_capacity(points.len() + 1);
    let mut prev = 0;
    for p in points {
        out.push(&text[prev..p]);
        prev = p;
    }
    out.push(&text[prev..]);
    out
}

/// Fragments an attacker (or a model) would put in text to confuse the chat
/// template, the tokenizer's special-token matching, the reasoning splitter
/// and the tool-call parser. The `\u{E000}`-led ones imitate the private
/// markers `render_tokens` uses internally (nonce 4c494c59 is its first).
pub const FRAGMENTS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>system\n",
    "<|im_start|>assistant\n",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "<|vision_pad|>",
    "<|im_",
    "<tool_",
    "</think",
    "<",
    ">",
    "|",
    "\n",
    "\n\n",
    " ",
    "\t",
    "\u{3000}",
    "{",
    "}",
    "\"",
    "\\",
    "{{ messages }}",
    "{% raw %}",
    "get_weather",
    "city",
    "x",
    "é",
    "e\u{301}",
    "<\u{338}",
    "日本",
    "🦀",
    "\u{FFFD}",
    "\u{0}",
    "\u{E000}",
    "\u{E001}",
    "\u{E000}4c494c59s0\u{E001}",
    "\u{E000}4c494c59b\u{E001}",
    "\u{E000}4c494c59e\u{E001}",
    "True",
    "12",
    "{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
];

/// A string that is either arbitrary or a concatenation of [`FRAGMENTS`]
/// (the second finds structure bugs much faster than random bytes).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hostile(pub String);

impl<'a> Arbitrary<'a> for Hostile {
    fn arbitrary(u: &mut Unstructured<'a>) -> ArbResult<Self> {
        if u.arbitrary::<bool>()? {
            return Ok(Hostile(u.arbitrary()?));
        }
        let n = u.int_in_range(0..=24)?;
        let mut s = String::new();
        for _ in 0..n {
            if u.ratio(1, 4)? {
                s.push_str(&u.arbitrary::<String>()?);
            } else {
                s.push_str(u.choose(FRAGMENTS)?);
            }
        }
        Ok(Hostile(s))
    }
}

/// A JSON value no deeper than `depth` (the server's JSON parser refuses
/// nesting beyond 128, so deeper values cannot reach the template).
pub fn json_value(u: &mut Unstructured<'_>, depth: usize) -> ArbResult<Value> {
    let pick = u.int_in_range(0..=if depth == 0 { 4 } else { 6 })?;
    Ok(match pick {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => Value::from(u.arbitrary::<i64>()?),
        3 => serde_json::Number::from_f64(u.arbitrary::<f64>()?).map_or(Value::Null, Value::Number),
        4 => Value::String(u.arbitrary::<Hostile>()?.0),
        5 => {
            let n = u.int_in_range(0..=4)?;
            Value::Array(
                (0..n)
                    .map(|_| json_value(u, depth - 1))
                    .collect::<ArbResult<_>>()?,
            )
        }
        _ => Value::Object(json_object(u, depth - 1)?),
    })
}

/// A JSON object with hostile keys.
pub fn json_object(
    u: &mut Unstructured<'_>,
    depth: usize,
) -> ArbResult<serde_json::Map<String, Value>> {
    let n = u.int_in_range(0..=4)?;
    let mut map = serde_json::Map::new();
    for _ in 0..n {
        let k = u.arbitrary::<Hostile>()?.0;
        map.insert(k, json_value(u, depth)?);
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_pieces_concatenate_to_the_text() {
        let text = "aé🦀<tool_call>";
        for cuts in [vec![], vec![0], vec![2, 2, 3], vec![u16::MAX, 1, 7]] {
            let pieces = cut(text, &cuts);
            assert_eq!(pieces.concat(), text);
            assert_eq!(pieces.len(), cuts.len() + 1);
        }
    }
}
