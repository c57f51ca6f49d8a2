//! `config.json` parsing and validation (`ModelConfig::from_json_str`).
//!
//! Input is either raw text or a real config (production, or the tiny test
//! model) with a few fields replaced by fuzzed JSON, which reaches the
//! validation rules far more often than random text. Properties: no panic
//! (integer overflow included: targets are built with debug assertions);
//! an accepted config's derived sizes and tensor list can be computed; and
//! it survives `to_config_json` -> `from_json_str` unchanged (the writer
//! keeps only the first EOS id, so that one is compared alone, and
//! rope_theta may move by an ulp through serde_json's float parsing).
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use lily_core::config::{mlx_quantization, production, to_config_json};
use lily_core::weights::expected_tensors;
use lily_core::ModelConfig;
use lily_fuzz::{json_value, Hostile};
use serde_json::Value;

/// Paths (inside the root object) the structured mode replaces.
const FIELDS: &[&str] = &[
    "model_type",
    "eos_token_id",
    "quantization",
    "quantization/bits",
    "quantization/group_size",
    "quantization/mode",
    "quantization/language_model.model.layers.0.mlp.gate",
    "quantization_config",
    "text_config",
    "text_config/hidden_size",
    "text_config/num_hidden_layers",
    "text_config/vocab_size",
    "text_config/rms_norm_eps",
    "text_config/max_position_embeddings",
    "text_config/num_attention_heads",
    "text_config/num_key_value_heads",
    "text_config/head_dim",
    "text_config/linear_num_key_heads",
    "text_config/linear_num_value_heads",
    "text_config/linear_key_head_dim",
    "text_config/linear_value_head_dim",
    "text_config/linear_conv_kernel_dim",
    "text_config/num_experts",
    "text_config/num_experts_per_tok",
    "text_config/moe_intermediate_size",
    "text_config/shared_expert_intermediate_size",
    "text_config/tie_word_embeddings",
    "text_config/layer_types",
    "text_config/eos_token_id",
    "text_config/rope_parameters",
    "text_config/rope_parameters/rope_theta",
    "text_config/rope_parameters/partial_rotary_factor",
    "text_config/rope_scaling",
    "text_config/rope_theta",
];

const TINY: &str = include_str!("../../tests/fixtures/tiny/mlx-q4/config.json");

#[derive(Debug)]
enum Input {
    Raw(String),
    Edited { base: u8, edits: Vec<(u8, Value)> },
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        if u.ratio(1, 4)? {
            return Ok(Input::Raw(u.arbitrary::<Hostile>()?.0));
        }
        let base = u.arbitrary()?;
        let n = u.int_in_range(1..=4)?;
        let mut edits = Vec::with_capacity(n);
        for _ in 0..n {
            let field = u.arbitrary()?;
            // Numbers are the interesting values for most fields.
            let value = match u.int_in_range(0..=3)? {
                0 => Value::from(u.arbitrary::<u64>()?),
                1 => Value::from(u.int_in_range(0u64..=4096)?),
                2 => Value::from(
                    u.choose(&[
                        4u64,
                        8,
                        64,
                        248_320,
                        262_144,
                        1 << 31,
                        1 << 32,
                        1 << 62,
                        u64::MAX,
                    ])?
                    .to_owned(),
                ),
                _ => json_value(u, 4)?,
            };
            edits.push((field, value));
        }
        Ok(Input::Edited { base, edits })
    }
}

fn set_path(root: &mut Value, path: &str, value: Value) {
    let mut cur = root;
    let parts: Vec<&str> = path.split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        let Some(obj) = cur.as_object_mut() else {
            return;
        };
        if i + 1 == parts.len() {
            obj.insert(part.to_string(), value);
            return;
        }
        cur = obj
            .entry(part.to_string())
            .or_insert_with(|| Value::Object(Default::default()));
    }
}

fn text_of(input: &Input) -> Option<String> {
    match input {
        Input::Raw(s) => Some(s.clone()),
        Input::Edited { base, edits } => {
            let mut root = if base % 2 == 0 {
                let mut cfg = production();
                cfg.quantization = Some(mlx_quantization(&cfg));
                to_config_json(&cfg)
            } else {
                serde_json::from_str(TINY).ok()?
            };
            for (field, value) in edits {
                set_path(
                    &mut root,
                    FIELDS[*field as usize % FIELDS.len()],
                    value.clone(),
                );
            }
            Some(root.to_string())
        }
    }
}

/// The input text, cut short for assertion messages.
fn head(text: &str) -> &str {
    let mut end = text.len().min(600);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fuzz_target!(|input: Input| {
    let Some(text) = text_of(&input) else { return };
    let Ok(cfg) = ModelConfig::from_json_str(&text) else {
        return;
    };
    let _ = (
        cfg.q_proj_dim(),
        cfg.kv_dim(),
        cfg.attn_out_dim(),
        cfg.rotary_dim(),
    );
    let _ = (
        cfg.linear_key_dim(),
        cfg.linear_value_dim(),
        cfg.linear_conv_dim(),
    );
    let _ = (
        cfg.num_attention_layers(),
        cfg.num_deltanet_layers(),
        cfg.format(),
    );
    assert!(!cfg.eos_token_ids.is_empty());
    let tensors = expected_tensors(&cfg);
    assert!(!tensors.is_empty());
    let back = ModelConfig::from_json_str(&to_config_json(&cfg).to_string()).unwrap_or_else(|e| {
        panic!(
            "written config does not read back: {e}\nfrom {}",
            head(&text)
        )
    });
    assert_eq!(back.eos_token_ids.first(), cfg.eos_token_ids.first());
    let mut a = back.clone();
    a.eos_token_ids = cfg.eos_token_ids.clone();
    // serde_json parses floats best-effort (its `float_roundtrip` feature is
    // off), so a written rope_theta may come back an ulp away.
    let rel = ((a.rope_theta - cfg.rope_theta) / cfg.rope_theta).abs();
    assert!(
        rel < 1e-14,
        "rope_theta {} came back as {}",
        cfg.rope_theta,
        a.rope_theta
    );
    a.rope_theta = cfg.rope_theta;
    assert_eq!(
        a,
        cfg,
        "config changed through to_config_json\nfrom {}",
        head(&text)
    );
});
