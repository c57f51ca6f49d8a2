//! The two model shapes `lily synth` writes: `full` (the real
//! Qwen3.6-35B-A3B dimensions) and `tiny` (same architecture, small
//! dimensions, the real 248,320-token vocabulary so the real tokenizer
//! works with it). Both go through `ModelConfig::validated`, so a preset can
//! never describe a model the loader would refuse.

use lily_core::config::{mlx_quantization, production, Format, ModelConfig};
use lily_core::{Error, Result};

/// Which shape to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// Hidden 128, 8 layers, 16 experts: 40.3 MB of 4-bit shards (plus the
    /// 15 MB tokenizer), written in about a second by a release build. The
    /// demo checkpoint of `lily serve`.
    Tiny,
    /// The real shape: 40 layers, 256 experts, 19.5 GB in 4-bit.
    Full,
}

impl Preset {
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Full => "full",
        }
    }

    /// Largest shard the preset writes. `full` uses the 5 GB of the real
    /// releases; `tiny` uses a small limit so that even the demo checkpoint
    /// is sharded and every reader exercises the index.
    pub fn shard_bytes(self) -> u64 {
        match self {
            Preset::Tiny => 16 << 20,
            Preset::Full => FULL_SHARD_BYTES,
        }
    }
}

/// Shard limit of the real releases (transformers' and mlx-lm's "5GB").
pub const FULL_SHARD_BYTES: u64 = 5_000_000_000;

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "full" => Ok(Preset::Full),
            other => Err(format!("unknown preset {other:?}; expected \"tiny\" or \"full\"")),
        }
    }
}

/// The validated config of `preset` with `layers` layers (default: 8 for
/// tiny, 40 for full) in `format` (MLX adds the real quantisation block).
pub fn preset_config(preset: Preset, layers: Option<usize>, format: Format) -> Result<ModelConfig> {
    let mut cfg = production();
    if preset == Preset::Tiny {
        cfg.hidden_size = 128;
        cfg.num_layers = 8;
        cfg.num_attention_heads = 8;
        cfg.num_kv_heads = 1;
        cfg.head_dim = 64;
        cfg.linear_num_key_heads = 2;
        cfg.linear_num_value_heads = 4;
        cfg.linear_key_head_dim = 64;
        cfg.linear_value_head_dim = 64;
        cfg.num_experts = 16;
        cfg.num_experts_per_tok = 4;
        cfg.moe_intermediate_size = 128;
        cfg.shared_expert_intermediate_size = 128;
    }
    if let Some(n) = layers {
        if n == 0 || n % 4 != 0 {
            return Err(Error::config("--layers", "a positive multiple of 4 (layer i is attention when i % 4 == 3)", n));
        }
        cfg.num_layers = n;
    }
    if format == Format::MlxQ4 {
        cfg.quantization = Some(mlx_quantization(&cfg));
    }
    cfg.validated()
}

#[cfg(test)]
mod tests {
    use super::*;
    use lily_core::config::ShapeClass;

    #[test]
    fn presets_validate_and_classify() {
        let full = preset_config(Preset::Full, None, Format::MlxQ4).expect("full");
        assert_eq!(full.shape_class, ShapeClass::Production);
        assert_eq!(full.format(), Format::MlxQ4);
        let tiny = preset_config(Preset::Tiny, None, Format::HfBf16).expect("tiny");
        assert_eq!(tiny.shape_class, ShapeClass::Test);
        assert_eq!(tiny.format(), Format::HfBf16);
        assert_eq!(tiny.vocab_size, 248_320);
        assert_eq!(tiny.num_layers, 8);
    }

    #[test]
    fn layers_must_be_a_multiple_of_four() {
        let err = preset_config(Preset::Tiny, Some(6), Format::MlxQ4).unwrap_err().to_string();
        assert!(err.contains("--layers") && err.contains('6'), "{err}");
        assert_eq!(preset_config(Preset::Tiny, Some(4), Format::MlxQ4).expect("4 layers").num_layers, 4);
        // The real widths with fewer layers are accepted as a test shape.
        let cut = preset_config(Preset::Full, Some(4), Format::MlxQ4).expect("full, 4 layers");
        assert_eq!((cut.num_layers, cut.hidden_size, cut.shape_class), (4, 2048, ShapeClass::Test));
    }
}
