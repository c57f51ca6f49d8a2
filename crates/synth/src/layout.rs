//! From stored tensors to the logical parameters they encode.
//!
//! The two layouts name and pack the same parameters differently: MLX splits
//! a linear into codes, scales and biases; HF fuses the experts' gate and up
//! projections into one `gate_up_proj`; the prefixes differ. This module
//! gives every parameter one layout-free key (`layers.3.mlp.experts.gate_proj`,
//! `embed_tokens`, `layers.0.input_layernorm.weight`) and groups a plan's
//! tensors into write units, each filled from a `Source` of logical values.
//! Because synthetic values are drawn per logical key, an `hf-bf16` and an
//! `mlx-q4` synth of the same seed hold the same model, and quantising the
//! first gives the second byte for byte.

use lily_core::config::Format;
use lily_core::weights::{LinearPart, Role};
use lily_core::{Error, Result};

use crate::plan::Plan;

/// A linear map with its logical key: `experts` stacked `[rows, cols]`
/// matrices, addressed as one `[experts * rows, cols]` matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearParam {
    pub key: String,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
}

/// A vector-like parameter (norm gain, conv taps, `A_log`, `dt_bias`).
#[derive(Clone, Debug, PartialEq)]
pub struct VectorParam {
    pub key: String,
    pub role: Role,
    pub len: usize,
}

/// Logical values for a writer. Linear values are the weights a quantiser
/// sees; one-centred norms are given as gains (the writer stores `gain - 1`
/// for HF); every other vector is given as stored.
pub trait Source: Sync {
    /// Rows `row0 .. row0 + out.len() / cols` of the flattened matrix.
    fn linear_rows(&self, param: &LinearParam, row0: usize, out: &mut [f32]) -> Result<()>;
    fn vector(&self, param: &VectorParam) -> Result<Vec<f32>>;
}

/// How the rows of a dense (HF) tensor map onto logical parameters.
#[derive(Clone, Debug)]
pub enum DenseRows {
    Direct(LinearParam),
    /// `mlp.experts.gate_up_proj` `[experts, 2 * im, cols]`: per expert the
    /// `im` gate rows, then the `im` up rows.
    GateUp {
        gate: LinearParam,
        up: LinearParam,
    },
}

/// A group of stored tensors written from one computation.
#[derive(Clone, Debug)]
pub enum Unit {
    /// MLX linear: tensor indices (into `Plan::tensors`) of its three parts.
    Quant {
        param: LinearParam,
        bits: u32,
        group: usize,
        codes: usize,
        scales: usize,
        biases: usize,
    },
    /// A bf16 (HF) linear tensor.
    Dense {
        tensor: usize,
        rows: DenseRows,
        total_rows: usize,
        cols: usize,
    },
    Vector {
        tensor: usize,
        param: VectorParam,
    },
}

/// The layout-free key of a stored tensor or module path.
pub fn canonical_key(name: &str) -> String {
    if name == "language_model.lm_head" || name == "lm_head.weight" || name == "lm_head" {
        return "lm_head".into();
    }
    let rest = name.strip_prefix("language_model.model.").or_else(|| name.strip_prefix("model.language_model.")).unwrap_or(name);
    rest.replace(".mlp.switch_mlp.", ".mlp.experts.")
}

/// Strips the part suffix of an MLX linear tensor or the `.weight` of an
/// HF one, giving the module path.
fn module_path(name: &str) -> &str {
    for suffix in [".weight", ".scales", ".biases"] {
        if let Some(p) = name.strip_suffix(suffix) {
            return p;
        }
    }
    name
}

/// Groups the plan's tensors into write units.
pub fn units(plan: &Plan) -> Result<Vec<Unit>> {
    let format = plan.config.format();
    let group = plan.config.quantization.as_ref().map(|q| q.default.group_size).unwrap_or(64);
    let index: std::collections::HashMap<&str, usize> = plan.tensors.iter().enumerate().map(|(i, t)| (t.spec.name.as_str(), i)).collect();
    let find = |name: String| -> Result<usize> {
        index.get(name.as_str()).copied().ok_or_else(|| Error::Other(format!("layout: `{name}` is not in the tensor list")))
    };
    let mut out = Vec::new();
    for (i, t) in plan.tensors.iter().enumerate() {
        match (&t.spec.role, format) {
            (Role::Linear { part: LinearPart::Codes { bits }, rows, cols, experts, .. }, Format::MlxQ4) => {
                let path = module_path(&t.spec.name);
                out.push(Unit::Quant {
                    param: LinearParam { key: canonical_key(path), experts: *experts, rows: *rows, cols: *cols },
                    bits: *bits,
                    group,
                    codes: i,
                    scales: find(format!("{path}.scales"))?,
                    biases: find(format!("{path}.biases"))?,
                });
            }
            // Scales and biases are written by their codes' unit.
            (Role::Linear { part: LinearPart::Scales { .. } | LinearPart::Biases { .. }, .. }, Format::MlxQ4) => {}
            (Role::Linear { part: LinearPart::Dense, rows, cols, experts, .. }, Format::HfBf16) => {
                let name = &t.spec.name;
                let rows_map = if let Some(prefix) = name.strip_suffix("experts.gate_up_proj") {
                    let base = canonical_key(prefix);
                    let half = rows / 2;
                    DenseRows::GateUp {
                        gate: LinearParam { key: format!("{base}experts.gate_proj"), experts: *experts, rows: half, cols: *cols },
                        up: LinearParam { key: format!("{base}experts.up_proj"), experts: *experts, rows: half, cols: *cols },
                    }
                } else {
                    DenseRows::Direct(LinearParam { key: canonical_key(module_path(name)), experts: *experts, rows: *rows, cols: *cols })
                };
                out.push(Unit::Dense { tensor: i, rows: rows_map, total_rows: experts * rows, cols: *cols });
            }
            (Role::Linear { part, .. }, _) => {
                return Err(Error::Other(format!("layout: `{}` is a {part:?} part in a {format:?} checkpoint", t.spec.name)));
            }
            (role, _) => {
                let len = t.spec.shape.iter().product();
                out.push(Unit::Vector { tensor: i, param: VectorParam { key: canonical_key(&t.spec.name), role: role.clone(), len } });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::{preset_config, Preset};

    #[test]
    fn keys_agree_between_layouts() {
        assert_eq!(canonical_key("language_model.model.layers.3.mlp.switch_mlp.gate_proj"), "layers.3.mlp.experts.gate_proj");
        assert_eq!(canonical_key("model.language_model.layers.3.mlp.experts.down_proj"), "layers.3.mlp.experts.down_proj");
        assert_eq!(canonical_key("language_model.lm_head"), canonical_key("lm_head.weight"));
        assert_eq!(canonical_key("language_model.model.norm.weight"), canonical_key("model.language_model.norm.weight"));
    }

    /// Both layouts of one config must describe the same logical linears.
    #[test]
    fn both_layouts_cover_the_same_parameters() {
        let mut keys = Vec::new();
        for format in [Format::MlxQ4, Format::HfBf16] {
            let cfg = preset_config(Preset::Tiny, Some(4), format).expect("config");
            let plan = Plan::new(&cfg, u64::MAX).expect("plan");
            let mut k: Vec<(String, usize, usize, usize)> = Vec::new();
            for u in units(&plan).expect("units") {
                match u {
                    Unit::Quant { param, .. } | Unit::Dense { rows: DenseRows::Direct(param), .. } => {
                        k.push((param.key, param.experts, param.rows, param.cols))
                    }
                    Unit::Dense { rows: DenseRows::GateUp { gate, up }, .. } => {
                        k.push((gate.key, gate.experts, gate.rows, gate.cols));
                        k.push((up.key, up.experts, up.rows, up.cols));
                    }
                    Unit::Vector { param, .. } => k.push((param.key, param.len, 0, 0)),
                }
            }
            k.sort();
            keys.push(k);
        }
        assert_eq!(keys[0], keys[1]);
        assert!(keys[0].iter().any(|k| k.0 == "layers.0.mlp.experts.up_proj"));
    }
}
