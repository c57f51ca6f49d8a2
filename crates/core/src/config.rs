//! `config.json` of a Qwen3.6-35B-A3B checkpoint, parsed and validated.
//!
//! The file is the `qwen3_5_moe` vision-language wrapper: the language model's
//! dimensions live in `text_config`; an MLX checkpoint adds a `quantization`
//! block whose per-module entries override the default bits (the router and
//! the shared-expert gate are 8-bit). Lily serves exactly one model, so
//! validation is strict: the production shape is accepted, small test configs
//! of the same architecture (same layer rule, same head relations) are accepted
//! and labelled as such, and anything else is refused naming the field. So are
//! settings that would change the model's math in a way Lily does not
//! implement (a rope scaling, an attention without its output gate, routing
//! weights that are not renormalised), rather than being read past.
//!
//! The quantisation block is parsed here but its per-module entries are
//! checked by the loader (`weights::check_quantization`), which knows the
//! modules Lily loads: entries for other modules (the vision tower) are
//! ignored whatever they say.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::tokenizer::IM_END_ID;

/// Which token mixer a layer uses. Layer `i` is full attention when
/// `i % 4 == 3`, Gated DeltaNet otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    DeltaNet,
    Attention,
}

/// The two on-disk layouts Lily reads (docs/design.md §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// MLX affine, 4-bit with 8-bit router/shared gate, group 64.
    MlxQ4,
    /// The original BF16 release (transformers names, fused experts).
    HfBf16,
}

/// Whether the dimensions are the real model's or a small test model's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShapeClass {
    Production,
    /// Same architecture, small dimensions: tests and the demo checkpoint.
    Test,
}

/// Bits and group size of one quantised linear.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
}

/// The MLX `quantization` block: a default plus per-module overrides.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantization {
    pub default: QuantSpec,
    /// Module path (e.g. `language_model.model.layers.0.mlp.gate`) to its
    /// spec; `None` means the module is stored unquantised. Entries are kept
    /// as written; only those of modules Lily loads are checked (by
    /// `weights::check_quantization`).
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl Quantization {
    /// The spec of the module at `path`, if it is quantised.
    pub fn spec_for(&self, path: &str) -> Option<QuantSpec> {
        match self.overrides.get(path) {
            Some(spec) => *spec,
            None => Some(self.default),
        }
    }
}

/// Dimensions and constants of the text model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    // Gated attention.
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    // Gated DeltaNet.
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub conv_kernel: usize,
    // Mixture of experts.
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    // Tokens.
    /// Ids that end generation; always holds `<|im_end|>`, which ends every
    /// chat turn even where the config names only `<|endoftext|>`.
    pub eos_token_ids: Vec<u32>,
    /// Present for MLX checkpoints only.
    pub quantization: Option<Quantization>,
    pub shape_class: ShapeClass,
}

/// The real Qwen3.6-35B-A3B text model (quantisation and EOS aside).
pub fn production() -> ModelConfig {
    ModelConfig {
        hidden_size: 2048,
        num_layers: 40,
        vocab_size: 248_320,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 262_144,
        num_attention_heads: 16,
        num_kv_heads: 2,
        head_dim: 256,
        rope_theta: 10_000_000.0,
        partial_rotary_factor: 0.25,
        linear_num_key_heads: 16,
        linear_num_value_heads: 32,
        linear_key_head_dim: 128,
        linear_value_head_dim: 128,
        conv_kernel: 4,
        num_experts: 256,
        num_experts_per_tok: 8,
        moe_intermediate_size: 512,
        shared_expert_intermediate_size: 512,
        eos_token_ids: vec![248_046, 248_044],
        quantization: None,
        shape_class: ShapeClass::Production,
    }
}

/// The largest hidden size accepted for a test config.
pub const MAX_TEST_HIDDEN: usize = 1024;

impl ModelConfig {
    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        if layer % 4 == 3 {
            LayerKind::Attention
        } else {
            LayerKind::DeltaNet
        }
    }

    pub fn layer_kinds(&self) -> impl Iterator<Item = LayerKind> + '_ {
        (0..self.num_layers).map(|i| self.layer_kind(i))
    }

    pub fn format(&self) -> Format {
        if self.quantization.is_some() {
            Format::MlxQ4
        } else {
            Format::HfBf16
        }
    }

    /// Query projection width: per head, `head_dim` queries then `head_dim` gates.
    pub fn q_proj_dim(&self) -> usize {
        2 * self.num_attention_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    pub fn attn_out_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    /// Number of leading dims of each attention head that RoPE rotates.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor).round() as usize
    }
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the DeltaNet conv: q | k | v.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }
    pub fn num_attention_layers(&self) -> usize {
        self.layer_kinds().filter(|k| *k == LayerKind::Attention).count()
    }
    pub fn num_deltanet_layers(&self) -> usize {
        self.num_layers - self.num_attention_layers()
    }

    /// Reads and validates `config.json` in `dir` (and `generation_config.json`
    /// for extra EOS ids, when present; without it the EOS ids are the
    /// config's plus `<|im_end|>`).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let mut cfg = Self::from_json_str(&text).map_err(|e| match e {
            Error::Json { message, .. } => Error::Json { path: path.clone(), message },
            other => other,
        })?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path).map_err(|e| Error::io(&gen_path, e))?;
            let value: Value = serde_json::from_str(&text).map_err(|e| Error::Json { path: gen_path.clone(), message: e.to_string() })?;
            for id in eos_ids(value.get("eos_token_id"), "generation_config.eos_token_id")? {
                if !cfg.eos_token_ids.contains(&id) {
                    cfg.eos_token_ids.push(id);
                }
            }
        }
        Ok(cfg)
    }

    /// Parses the text of `config.json` and validates it.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|e| Error::Json { path: "config.json".into(), message: e.to_string() })?;
        let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        if model_type != "qwen3_5_moe" {
            return Err(Error::config("model_type", "\"qwen3_5_moe\"", format!("{model_type:?}")));
        }
        let text_cfg = root.get("text_config").ok_or_else(|| Error::config("text_config", "an object", "nothing"))?;
        let t = Fields { obj: text_cfg, prefix: "text_config" };
        refuse_unimplemented(text_cfg)?;
        let rope = text_cfg.get("rope_parameters").or_else(|| text_cfg.get("rope_scaling"));
        let rope_f64 = |key: &str, default: f64| -> Result<f64> {
            match rope.and_then(|r| r.get(key)).or_else(|| text_cfg.get(key)) {
                None => Ok(default),
                Some(v) => v.as_f64().ok_or_else(|| Error::config(format!("text_config.rope_parameters.{key}"), "a number", v)),
            }
        };

        let mut eos = eos_ids(root.get("eos_token_id"), "eos_token_id")?;
        for id in eos_ids(text_cfg.get("eos_token_id"), "text_config.eos_token_id")? {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        if eos.is_empty() {
            eos = production().eos_token_ids;
        }
        // The original release's text_config names only `<|endoftext|>` (its
        // generation_config.json adds `<|im_end|>`): a chat turn must end at
        // `<|im_end|>` even when that file is missing.
        if !eos.contains(&IM_END_ID) {
            eos.push(IM_END_ID);
        }

        let quantization = match root.get("quantization").or_else(|| root.get("quantization_config")) {
            None | Some(Value::Null) => None,
            Some(q) => Some(parse_quantization(q)?),
        };

        let cfg = ModelConfig {
            hidden_size: t.usize("hidden_size")?,
            num_layers: t.usize("num_hidden_layers")?,
            vocab_size: t.usize("vocab_size")?,
            rms_norm_eps: t.f64_or("rms_norm_eps", 1e-6)? as f32,
            max_position_embeddings: t.usize("max_position_embeddings")?,
            num_attention_heads: t.usize("num_attention_heads")?,
            num_kv_heads: t.usize("num_key_value_heads")?,
            head_dim: t.usize("head_dim")?,
            rope_theta: rope_f64("rope_theta", 10_000_000.0)?,
            partial_rotary_factor: rope_f64("partial_rotary_factor", 0.25)?,
            linear_num_key_heads: t.usize("linear_num_key_heads")?,
            linear_num_value_heads: t.usize("linear_num_value_heads")?,
            linear_key_head_dim: t.usize("linear_key_head_dim")?,
            linear_value_head_dim: t.usize("linear_value_head_dim")?,
            conv_kernel: t.usize("linear_conv_kernel_dim")?,
            num_experts: t.usize("num_experts")?,
            num_experts_per_tok: t.usize("num_experts_per_tok")?,
            moe_intermediate_size: t.usize("moe_intermediate_size")?,
            shared_expert_intermediate_size: t.usize("shared_expert_intermediate_size")?,
            eos_token_ids: eos,
            quantization,
            shape_class: ShapeClass::Production,
        };
        if let Some(v) = text_cfg.get("tie_word_embeddings").and_then(Value::as_bool) {
            if v {
                return Err(Error::config("text_config.tie_word_embeddings", false, true));
            }
        }
        if let Some(types) = text_cfg.get("layer_types").and_then(Value::as_array) {
            if types.len() != cfg.num_layers {
                return Err(Error::config("text_config.layer_types", format!("{} entries", cfg.num_layers), format!("{} entries", types.len())));
            }
            for (i, ty) in types.iter().enumerate() {
                let want = match cfg.layer_kind(i) {
                    LayerKind::Attention => "full_attention",
                    LayerKind::DeltaNet => "linear_attention",
                };
                if ty.as_str() != Some(want) {
                    return Err(Error::config(format!("text_config.layer_types[{i}]"), format!("{want:?}"), ty));
                }
            }
        }
        cfg.validated()
    }

    /// Checks the architecture rules and classifies the shape.
    pub fn validated(mut self) -> Result<Self> {
        let prod = production();
        let dims: [(&str, usize, usize); 15] = [
            ("hidden_size", self.hidden_size, prod.hidden_size),
            ("num_hidden_layers", self.num_layers, prod.num_layers),
            ("vocab_size", self.vocab_size, prod.vocab_size),
            ("num_attention_heads", self.num_attention_heads, prod.num_attention_heads),
            ("num_key_value_heads", self.num_kv_heads, prod.num_kv_heads),
            ("head_dim", self.head_dim, prod.head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads, prod.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads, prod.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim, prod.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim, prod.linear_value_head_dim),
            ("num_experts", self.num_experts, prod.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok, prod.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size, prod.moe_intermediate_size),
            ("shared_expert_intermediate_size", self.shared_expert_intermediate_size, prod.shared_expert_intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings, prod.max_position_embeddings),
        ];
        // Rules every accepted config must satisfy, test or production.
        let check = |field: &str, ok: bool, expected: String, actual: String| -> Result<()> {
            if ok {
                Ok(())
            } else {
                Err(Error::config(format!("text_config.{field}"), expected, actual))
            }
        };
        check(
            "num_hidden_layers",
            self.num_layers >= 4 && self.num_layers.is_multiple_of(4),
            "a positive multiple of 4 (layer i is attention when i % 4 == 3)".into(),
            self.num_layers.to_string(),
        )?;
        check(
            "linear_num_value_heads",
            // checked/saturating: the values are not bounded yet.
            self.linear_num_key_heads.checked_mul(2) == Some(self.linear_num_value_heads),
            format!("2 x linear_num_key_heads = {}", self.linear_num_key_heads.saturating_mul(2)),
            self.linear_num_value_heads.to_string(),
        )?;
        check(
            "num_attention_heads",
            self.num_kv_heads.checked_mul(8) == Some(self.num_attention_heads),
            format!("8 x num_key_value_heads = {}", self.num_kv_heads.saturating_mul(8)),
            self.num_attention_heads.to_string(),
        )?;
        check(
            "linear_value_head_dim",
            self.linear_value_head_dim == self.linear_key_head_dim,
            self.linear_key_head_dim.to_string(),
            self.linear_value_head_dim.to_string(),
        )?;
        check("linear_conv_kernel_dim", self.conv_kernel == 4, "4".into(), self.conv_kernel.to_string())?;
        // The f64 in the file is narrowed to f32: 1e80 would become inf.
        check(
            "rms_norm_eps",
            self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0,
            "a positive number within f32 range".into(),
            self.rms_norm_eps.to_string(),
        )?;
        check("rope_parameters.rope_theta", self.rope_theta.is_finite() && self.rope_theta > 0.0, "a positive number".into(), self.rope_theta.to_string())?;
        check("rope_parameters.partial_rotary_factor", self.partial_rotary_factor == 0.25, "0.25".into(), self.partial_rotary_factor.to_string())?;
        check("head_dim", self.head_dim.is_multiple_of(8) && self.head_dim >= 16, "a multiple of 8, at least 16".into(), self.head_dim.to_string())?;
        check(
            "num_experts_per_tok",
            self.num_experts_per_tok >= 1 && self.num_experts_per_tok <= self.num_experts,
            format!("between 1 and num_experts = {}", self.num_experts),
            self.num_experts_per_tok.to_string(),
        )?;
        check(
            "shared_expert_intermediate_size",
            self.shared_expert_intermediate_size == self.moe_intermediate_size,
            self.moe_intermediate_size.to_string(),
            self.shared_expert_intermediate_size.to_string(),
        )?;
        if let Some(q) = &self.quantization {
            if q.default.bits != 4 || q.default.group_size != 64 {
                return Err(Error::config("quantization", "bits 4, group_size 64", format!("bits {}, group_size {}", q.default.bits, q.default.group_size)));
            }
        }

        // No dimension may exceed the real model's: Lily serves that model
        // and smaller test shapes of it. Checked before any size is derived
        // from the config (tensor shapes, layer loops), so a hostile
        // config.json cannot overflow them or loop for ever.
        if let Some(&(field, got, want)) = dims.iter().find(|(_, got, want)| got > want) {
            return Err(Error::config(format!("text_config.{field}"), format!("at most {want} (Qwen3.6-35B-A3B)"), got));
        }
        let first_diff = dims.iter().find(|(_, got, want)| got != want);
        self.shape_class = match first_diff {
            None => ShapeClass::Production,
            Some(&(field, got, want)) => {
                // A small model of the same architecture is a test config, and
                // so is the real shape cut to fewer layers (`lily synth
                // --preset full --layers 4`); any other large model is some
                // other model and is refused.
                let fewer_layers = self.num_layers < prod.num_layers && dims.iter().all(|(f, got, want)| got == want || *f == "num_hidden_layers");
                if fewer_layers || (self.hidden_size <= MAX_TEST_HIDDEN && self.num_experts <= prod.num_experts) {
                    ShapeClass::Test
                } else {
                    return Err(Error::config(format!("text_config.{field}"), format!("{want} (Qwen3.6-35B-A3B)"), got));
                }
            }
        };
        if self.shape_class == ShapeClass::Production && (self.rope_theta - prod.rope_theta).abs() > 1.0 {
            return Err(Error::config("text_config.rope_parameters.rope_theta", prod.rope_theta, self.rope_theta));
        }
        Ok(self)
    }
}

fn parse_quantization(q: &Value) -> Result<Quantization> {
    let obj = q.as_object().ok_or_else(|| Error::config("quantization", "an object", q))?;
    // Read as written (bits and group size as numbers, no range check): the
    // default is checked in `validated`, per-module entries by the loader,
    // which ignores those of modules Lily does not load.
    let spec = |v: &Value| -> Option<QuantSpec> {
        let bits = v.get("bits").and_then(Value::as_u64).and_then(|b| u32::try_from(b).ok())?;
        let group = v.get("group_size").and_then(Value::as_u64).and_then(|g| usize::try_from(g).ok())?;
        Some(QuantSpec { bits, group_size: group })
    };
    if let Some(mode) = obj.get("mode").and_then(Value::as_str) {
        if mode != "affine" {
            return Err(Error::config("quantization.mode", "\"affine\"", format!("{mode:?}")));
        }
    }
    let default = spec(q).ok_or_else(|| {
        Error::config(
            "quantization",
            "integer `bits` and `group_size`",
            format!("bits {}, group_size {}", q.get("bits").unwrap_or(&Value::Null), q.get("group_size").unwrap_or(&Value::Null)),
        )
    })?;
    let mut overrides = BTreeMap::new();
    for (key, value) in obj {
        match value {
            // An entry whose bits or group size are not numbers can never be
            // run; keep it as "unquantised" so that, if Lily loads the module,
            // the loader refuses it, and otherwise it is ignored.
            Value::Object(_) => {
                overrides.insert(key.clone(), spec(value));
            }
            Value::Bool(false) => {
                overrides.insert(key.clone(), None);
            }
            _ => {}
        }
    }
    Ok(Quantization { default, overrides })
}

/// Settings of `text_config` that change the model's math and that Lily does
/// not implement: present with any value but the one Lily computes, they are
/// refused naming the field and the value (absent, they take that value).
fn refuse_unimplemented(text_cfg: &Value) -> Result<()> {
    // The rope variant: Lily computes the default rope (the model's 3-axis
    // mRoPE, which for text positions is the default rope). YaRN, linear,
    // dynamic, longrope, llama3 and the like scale frequencies differently.
    for key in ["rope_parameters", "rope_scaling"] {
        let Some(rope) = text_cfg.get(key) else {
            continue;
        };
        match rope {
            Value::Null => continue,
            Value::Object(_) => {}
            other => return Err(Error::config(format!("text_config.{key}"), "an object or null", other)),
        }
        let mut named = false;
        for ty in ["rope_type", "type"] {
            if let Some(v) = rope.get(ty) {
                named = true;
                if !matches!(v.as_str(), Some("default" | "mrope")) {
                    return Err(Error::config(format!("text_config.{key}.{ty}"), "\"default\" (Lily implements no rope scaling)", v));
                }
            }
        }
        // A scaling factor without a type is a scaled rope all the same.
        if let Some(v) = rope.get("factor") {
            if !named || v.as_f64() != Some(1.0) {
                return Err(Error::config(format!("text_config.{key}.factor"), "no factor (Lily implements no rope scaling)", v));
            }
        }
    }
    let bool_must_be = |field: &str, want: bool, why: &str| -> Result<()> {
        match text_cfg.get(field) {
            None | Some(Value::Null) => Ok(()),
            Some(Value::Bool(b)) if *b == want => Ok(()),
            Some(other) => Err(Error::config(format!("text_config.{field}"), format!("{want} ({why})"), other)),
        }
    };
    bool_must_be("attn_output_gate", true, "Lily's attention always applies the sigmoid output gate")?;
    bool_must_be("norm_topk_prob", true, "Lily always renormalises the top-k routing weights")?;
    bool_must_be("attention_bias", false, "Lily's attention projections have no bias")?;
    if let Some(v) = text_cfg.get("hidden_act") {
        if v.as_str() != Some("silu") {
            return Err(Error::config("text_config.hidden_act", "\"silu\" (the experts' SwiGLU)", v));
        }
    }
    if let Some(v) = text_cfg.get("full_attention_interval") {
        if v.as_u64() != Some(4) {
            return Err(Error::config("text_config.full_attention_interval", "4 (layer i is attention when i % 4 == 3)", v));
        }
    }
    if let Some(v) = text_cfg.get("mlp_only_layers") {
        if !matches!(v, Value::Null) && v.as_array().is_none_or(|a| !a.is_empty()) {
            return Err(Error::config("text_config.mlp_only_layers", "[] (every layer ends in the MoE)", v));
        }
    }
    if let Some(v) = text_cfg.get("decoder_sparse_step") {
        if v.as_u64() != Some(1) {
            return Err(Error::config("text_config.decoder_sparse_step", "1 (every layer ends in the MoE)", v));
        }
    }
    Ok(())
}

fn eos_ids(value: Option<&Value>, field: &str) -> Result<Vec<u32>> {
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        // An id past u32 is refused, not truncated into some other token.
        Some(Value::Number(n)) => n.as_u64().and_then(|id| u32::try_from(id).ok()).map(|id| vec![id]).ok_or_else(|| Error::config(field, "a token id", n)),
        Some(Value::Array(items)) => {
            items.iter().map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| Error::config(field, "token ids", v))).collect()
        }
        Some(other) => Err(Error::config(field, "a token id or a list of them", other)),
    }
}

/// Typed access to the fields of `text_config`, with errors naming the field.
struct Fields<'a> {
    obj: &'a Value,
    prefix: &'a str,
}

impl Fields<'_> {
    fn usize(&self, key: &str) -> Result<usize> {
        match self.obj.get(key) {
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| Error::config(format!("{}.{key}", self.prefix), "a non-negative integer", v)),
            None => Err(Error::config(format!("{}.{key}", self.prefix), "a value", "nothing")),
        }
    }
    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.obj.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| Error::config(format!("{}.{key}", self.prefix), "a number", v)),
        }
    }
}

/// Serialises a config in the real checkpoint's `config.json` shape. Used by
/// `synth` and `quantize`, so every checkpoint Lily writes reads back through
/// the same parser as a downloaded one.
pub fn to_config_json(cfg: &ModelConfig) -> Value {
    let layer_types: Vec<&str> = cfg
        .layer_kinds()
        .map(|k| match k {
            LayerKind::Attention => "full_attention",
            LayerKind::DeltaNet => "linear_attention",
        })
        .collect();
    let text = serde_json::json!({
        "model_type": "qwen3_5_moe_text",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        // Through the shortest f32 text, so 1e-6 is written as 1e-06 and
        // not as the f64 widening of the f32 (9.99999997e-07).
        "rms_norm_eps": cfg.rms_norm_eps.to_string().parse::<f64>().unwrap_or(cfg.rms_norm_eps as f64),
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.conv_kernel,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "hidden_act": "silu",
        "attn_output_gate": true,
        "tie_word_embeddings": false,
        "full_attention_interval": 4,
        "layer_types": layer_types,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": true,
        },
        "eos_token_id": cfg.eos_token_ids.first().copied().unwrap_or(248_046),
        "dtype": "bfloat16",
    });
    let mut root = serde_json::json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": false,
        "eos_token_id": cfg.eos_token_ids.first().copied().unwrap_or(248_046),
        "image_token_id": 248_056,
        "video_token_id": 248_057,
        "vision_start_token_id": 248_053,
        "vision_end_token_id": 248_054,
    });
    if let Some(q) = &cfg.quantization {
        let mut block = serde_json::Map::new();
        block.insert("group_size".into(), q.default.group_size.into());
        block.insert("bits".into(), q.default.bits.into());
        block.insert("mode".into(), "affine".into());
        for (path, spec) in &q.overrides {
            let v = match spec {
                Some(s) => serde_json::json!({"group_size": s.group_size, "bits": s.bits}),
                None => Value::Bool(false),
            };
            block.insert(path.clone(), v);
        }
        root["quantization"] = Value::Object(block.clone());
        root["quantization_config"] = Value::Object(block);
    }
    root
}

/// The MLX quantisation block the real 4-bit checkpoint carries: 4-bit group
/// 64 by default, 8-bit for every layer's router and shared-expert gate.
pub fn mlx_quantization(cfg: &ModelConfig) -> Quantization {
    let eight = Some(QuantSpec { bits: 8, group_size: 64 });
    let mut overrides = BTreeMap::new();
    for layer in 0..cfg.num_layers {
        overrides.insert(format!("language_model.model.layers.{layer}.mlp.gate"), eight);
        overrides.insert(format!("language_model.model.layers.{layer}.mlp.shared_expert_gate"), eight);
    }
    Quantization { default: QuantSpec { bits: 4, group_size: 64 }, overrides }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prod_json() -> Value {
        let mut cfg = production();
        cfg.quantization = Some(mlx_quantization(&cfg));
        to_config_json(&cfg)
    }

    #[test]
    fn production_round_trips_through_json() {
        let cfg = ModelConfig::from_json_str(&prod_json().to_string()).expect("valid");
        assert_eq!(cfg.shape_class, ShapeClass::Production);
        assert_eq!(cfg.format(), Format::MlxQ4);
        assert_eq!(cfg.num_attention_layers(), 10);
        assert_eq!(cfg.num_deltanet_layers(), 30);
        assert_eq!(cfg.rotary_dim(), 64);
        assert_eq!(cfg.linear_conv_dim(), 8192);
        let q = cfg.quantization.as_ref().expect("quantised");
        assert_eq!(q.spec_for("language_model.model.layers.7.mlp.gate").map(|s| s.bits), Some(8));
        assert_eq!(q.spec_for("language_model.model.layers.7.mlp.shared_expert_gate").map(|s| s.bits), Some(8));
        assert_eq!(q.spec_for("language_model.model.layers.7.mlp.switch_mlp.up_proj").map(|s| s.bits), Some(4));
    }

    #[test]
    fn a_larger_model_is_refused_naming_the_field() {
        let mut v = prod_json();
        v["text_config"]["hidden_size"] = 4096.into();
        let err = ModelConfig::from_json_str(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("text_config.hidden_size"), "{err}");
        assert!(err.contains("2048") && err.contains("4096"), "{err}");
    }

    #[test]
    fn broken_head_relation_is_refused() {
        let mut v = prod_json();
        v["text_config"]["num_key_value_heads"] = 4.into();
        let err = ModelConfig::from_json_str(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("num_attention_heads"), "{err}");
    }

    #[test]
    fn wrong_model_type_and_layer_types_are_refused() {
        let mut v = prod_json();
        v["model_type"] = "qwen3_next".into();
        let err = ModelConfig::from_json_str(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("model_type"), "{err}");
        let mut v = prod_json();
        v["text_config"]["layer_types"][2] = "full_attention".into();
        let err = ModelConfig::from_json_str(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("layer_types[2]"), "{err}");
    }

    #[test]
    fn small_test_config_is_accepted_and_labelled() {
        let mut v = prod_json();
        let t = &mut v["text_config"];
        t["hidden_size"] = 64.into();
        t["num_hidden_layers"] = 8.into();
        t["layer_types"] = Value::Null;
        t["num_attention_heads"] = 8.into();
        t["num_key_value_heads"] = 1.into();
        t["head_dim"] = 32.into();
        t["linear_num_key_heads"] = 2.into();
        t["linear_num_value_heads"] = 4.into();
        t["linear_key_head_dim"] = 32.into();
        t["linear_value_head_dim"] = 32.into();
        t["num_experts"] = 8.into();
        t["num_experts_per_tok"] = 2.into();
        let cfg = ModelConfig::from_json_str(&v.to_string()).expect("test config");
        assert_eq!(cfg.shape_class, ShapeClass::Test);
        assert_eq!(cfg.layer_kind(3), LayerKind::Attention);
        assert_eq!(cfg.layer_kind(4), LayerKind::DeltaNet);
    }

    #[test]
    fn bad_quantization_is_refused() {
        let mut v = prod_json();
        v["quantization"]["bits"] = 3.into();
        v["quantization_config"]["bits"] = 3.into();
        let err = ModelConfig::from_json_str(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("quantization"), "{err}");
    }

    #[test]
    fn eos_ids_merge_top_level_and_text_config() {
        let mut v = prod_json();
        v["eos_token_id"] = serde_json::json!([248046, 248044]);
        let cfg = ModelConfig::from_json_str(&v.to_string()).expect("valid");
        assert_eq!(cfg.eos_token_ids, vec![248046, 248044]);
    }
}
