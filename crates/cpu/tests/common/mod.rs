//! Test support: a tiny random checkpoint of the real architecture, written
//! to a temp dir in either format through the same name/shape list the
//! loader checks (`expected_tensors`), so the tests exercise the real load
//! path. Values are uniform with 1/sqrt(fan_in) scale so activations stay
//! in a sane range; MLX linears go through `lily_core::quant::quantize`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use lily_core::config::{mlx_quantization, production, to_config_json, ShapeClass};
use lily_core::tensors::DType;
use lily_core::weights::{expected_tensors, LinearPart, Role, Weights};
use lily_core::{Format, ModelConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A small config of the same architecture: 4 layers (3 DeltaNet + 1
/// attention), 8 experts top-2, every quantised width a multiple of 64.
pub fn tiny_config(format: Format, layers: usize) -> ModelConfig {
    let mut cfg = production();
    cfg.hidden_size = 64;
    cfg.num_layers = layers;
    cfg.vocab_size = 320;
    cfg.max_position_embeddings = 4096;
    cfg.num_attention_heads = 8;
    cfg.num_kv_heads = 1;
    cfg.head_dim = 32;
    cfg.linear_num_key_heads = 2;
    cfg.linear_num_value_heads = 4;
    cfg.linear_key_head_dim = 32;
    cfg.linear_value_head_dim = 32;
    cfg.num_experts = 8;
    cfg.num_experts_per_tok = 2;
    cfg.moe_intermediate_size = 64;
    cfg.shared_expert_intermediate_size = 64;
    cfg.shape_class = ShapeClass::Test;
    if format == Format::MlxQ4 {
        cfg.quantization = Some(mlx_quantization(&cfg));
    }
    cfg
}

fn bytes_of(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
    }
}

/// Packed codes, scales and biases of one quantised linear.
type Quantised = (Vec<u32>, Vec<f32>, Vec<f32>);

/// Writes a random checkpoint of `cfg` into `dir` and loads it.
pub fn write_checkpoint(cfg: &ModelConfig, dir: &Path, seed: u64) -> Arc<Weights> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let specs = expected_tensors(cfg);
    let mlx = cfg.format() == Format::MlxQ4;
    // Quantised linears come as three tensors; the matrix is drawn once per
    // module path and its three parts are filled from one quantisation.
    let mut quantised: HashMap<String, Quantised> = HashMap::new();
    let mut data: Vec<(String, DType, Vec<usize>, Vec<u8>)> = Vec::new();
    for spec in &specs {
        let n: usize = spec.shape.iter().product();
        let bytes = match &spec.role {
            Role::Linear { part, rows, cols, experts, fan_in } => {
                let bound = (3.0 / *fan_in as f32).sqrt();
                match part {
                    LinearPart::Dense => {
                        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
                        bytes_of(&v, spec.dtype)
                    }
                    LinearPart::Codes { bits } | LinearPart::Scales { bits } | LinearPart::Biases { bits } => {
                        let path = spec.name.rsplit_once('.').map(|(p, _)| p.to_string()).unwrap_or_default();
                        let entry = quantised.entry(path).or_insert_with(|| {
                            let total_rows = rows * experts.max(&1);
                            let w: Vec<f32> = (0..total_rows * cols).map(|_| rng.random_range(-bound..bound)).collect();
                            lily_core::quant::quantize(&w, total_rows, *cols, *bits, 64).expect("quantize")
                        });
                        match part {
                            LinearPart::Codes { .. } => entry.0.iter().flat_map(|w| w.to_le_bytes()).collect(),
                            LinearPart::Scales { .. } => bytes_of(&entry.1, spec.dtype),
                            _ => bytes_of(&entry.2, spec.dtype),
                        }
                    }
                }
            }
            Role::NormOneCentered => {
                let center = if mlx { 1.0 } else { 0.0 };
                let v: Vec<f32> = (0..n).map(|_| center + rng.random_range(-0.2..0.2)).collect();
                bytes_of(&v, spec.dtype)
            }
            Role::NormPlain => {
                let v: Vec<f32> = (0..n).map(|_| 1.0 + rng.random_range(-0.2..0.2)).collect();
                bytes_of(&v, spec.dtype)
            }
            Role::ConvWeight => {
                let v: Vec<f32> = (0..n).map(|_| rng.random_range(-0.6..0.6)).collect();
                bytes_of(&v, spec.dtype)
            }
            Role::ALog => {
                let v: Vec<f32> = (0..n).map(|_| rng.random_range(0.1f32..4.0).ln()).collect();
                bytes_of(&v, spec.dtype)
            }
            Role::DtBias => {
                let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
                bytes_of(&v, spec.dtype)
            }
        };
        data.push((spec.name.clone(), spec.dtype, spec.shape.clone(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(name, dtype, shape, bytes)| (name.clone(), safetensors::tensor::TensorView::new(dtype.to_st(), shape.clone(), bytes).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("write safetensors");
    std::fs::write(dir.join("config.json"), to_config_json(cfg).to_string()).expect("write config");
    Arc::new(Weights::load(dir).expect("load tiny checkpoint"))
}

/// A tiny checkpoint in a fresh temp dir (kept alive by the returned guard).
pub fn tiny(format: Format, layers: usize, seed: u64) -> (tempfile::TempDir, Arc<Weights>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write_checkpoint(&tiny_config(format, layers), dir.path(), seed);
    (dir, w)
}

/// Deterministic pseudo-random token ids below `vocab`.
pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// Largest absolute difference between two logit sets.
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "different number of positions");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

/// Largest absolute value, to put differences in scale.
pub fn max_abs(a: &[Vec<f32>]) -> f32 {
    a.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()))
}

pub fn argmax(v: &[f32]) -> usize {
    lily_model::argmax(v) as usize
}
