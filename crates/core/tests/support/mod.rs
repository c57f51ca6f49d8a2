//! Shared by the integration tests of lily-core: small checkpoints written
//! from `expected_tensors` with the `safetensors` crate's own writer
//! (independent of `lily-synth`), and the tokenizer.json of the Qwen3.6
//! release, whose `special` flags differ from the embedded file's.
//!
//! Each test file uses part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use lily_core::config::{mlx_quantization, production, to_config_json, Format, ModelConfig};
use lily_core::tensors::DType;
use lily_core::tokenizer::{embedded_tokenizer_json, NOT_FLAGGED_SPECIAL_IN_RELEASE};
use lily_core::weights::{expected_tensors, Role};
use safetensors::tensor::TensorView;

/// A small model of the real architecture.
pub fn small_config(format: Format) -> ModelConfig {
    let mut cfg = production();
    cfg.hidden_size = 64;
    cfg.num_layers = 4;
    cfg.vocab_size = 128;
    cfg.num_attention_heads = 8;
    cfg.num_kv_heads = 1;
    cfg.head_dim = 16;
    cfg.linear_num_key_heads = 2;
    cfg.linear_num_value_heads = 4;
    cfg.linear_key_head_dim = 16;
    cfg.linear_value_head_dim = 16;
    cfg.num_experts = 4;
    cfg.num_experts_per_tok = 2;
    cfg.moe_intermediate_size = 64;
    cfg.shared_expert_intermediate_size = 64;
    if format == Format::MlxQ4 {
        cfg.quantization = Some(mlx_quantization(&cfg));
    }
    cfg.validated().expect("small config")
}

/// One tensor to write: dtype, shape, bytes.
#[derive(Clone)]
pub struct Raw {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// The tensors of a valid checkpoint: zeros, except one-centred norms,
/// which hold gains of 1 in the MLX layout (values that agree with the
/// layout's convention, as in real checkpoints).
pub fn valid_tensors(cfg: &ModelConfig) -> BTreeMap<String, Raw> {
    expected_tensors(cfg)
        .into_iter()
        .map(|s| {
            let n: usize = s.shape.iter().product();
            let mut data = vec![0u8; n * s.dtype.size()];
            if s.role == Role::NormOneCentered && cfg.format() == Format::MlxQ4 {
                let one = half::bf16::from_f32(1.0).to_bits().to_le_bytes();
                for c in data.chunks_exact_mut(2) {
                    c.copy_from_slice(&one);
                }
            }
            (s.name, Raw { dtype: s.dtype, shape: s.shape, data })
        })
        .collect()
}

pub const SHARDS: [&str; 2] = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];

/// Which shard a tensor goes to: layers 0-1 and the embedding in the
/// first, the rest in the second.
pub fn shard_of(name: &str) -> usize {
    let first = name.contains("embed_tokens") || name.contains("layers.0.") || name.contains("layers.1.");
    if first {
        0
    } else {
        1
    }
}

/// Writes config, two shards and the index into `dir`.
pub fn write_checkpoint(dir: &Path, cfg: &ModelConfig, tensors: &BTreeMap<String, Raw>) {
    std::fs::write(dir.join("config.json"), to_config_json(cfg).to_string()).expect("config");
    let mut weight_map = BTreeMap::new();
    for (s, file) in SHARDS.iter().enumerate() {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .filter(|(name, _)| shard_of(name) == s)
            .map(|(name, t)| {
                weight_map.insert(name.clone(), file.to_string());
                (name.clone(), TensorView::new(t.dtype.to_st(), t.shape.clone(), &t.data).expect("view"))
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(file)).expect("shard");
    }
    let index = serde_json::json!({ "metadata": { "total_size": 0 }, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
}

/// Sets every one-centred norm of `tensors` (bf16) to `value`.
pub fn fill_norms(cfg: &ModelConfig, tensors: &mut BTreeMap<String, Raw>, value: f32) {
    let bits = half::bf16::from_f32(value).to_bits().to_le_bytes();
    for s in expected_tensors(cfg) {
        if s.role == Role::NormOneCentered {
            let t = tensors.get_mut(&s.name).expect("norm present");
            assert_eq!(t.dtype, DType::BF16);
            for c in t.data.chunks_exact_mut(2) {
                c.copy_from_slice(&bits);
            }
        }
    }
}

/// The embedded tokenizer.json with the `special` flags of the Qwen3.6
/// release: the 12 tokens of `NOT_FLAGGED_SPECIAL_IN_RELEASE` (`<think>`,
/// `<tool_call>`, the FIM tokens, ...) are `"special": false`.
pub fn release_flagged_tokenizer_json() -> Vec<u8> {
    let mut json: serde_json::Value = serde_json::from_slice(&embedded_tokenizer_json().expect("embedded")).expect("JSON");
    let mut unflagged = 0;
    for t in json["added_tokens"].as_array_mut().expect("added tokens") {
        let content = t["content"].as_str().expect("content").to_string();
        if NOT_FLAGGED_SPECIAL_IN_RELEASE.contains(&content.as_str()) {
            t["special"] = false.into();
            unflagged += 1;
        }
    }
    assert_eq!(unflagged, 12, "the 12 unflagged tokens are added tokens");
    serde_json::to_vec(&json).expect("serialise")
}
