//! lily-synth: writers of checkpoints in the real Qwen3.6-35B-A3B formats.
//!
//! It owns two producers and the machinery they share:
//! - `synth` writes a complete synthetic checkpoint directory (config,
//!   sharded safetensors + index, and the tokenizer, template and
//!   generation files of `files`) with deterministic random weights, in the
//!   MLX 4-bit or the BF16 layout;
//! - `quantize_checkpoint` turns the original BF16 release into the MLX
//!   4-bit layout exactly as mlx-lm's conversion does.
//!
//! Both write exactly `lily_core::weights::expected_tensors` of their config
//! (there is no second list here), planned up front (`plan`) and streamed
//! to disk block by block in parallel (`writer`), so the 20 GB `full`
//! preset never has more than a few MB of weights in memory. It does not
//! read checkpoints for serving, and owns no model math.

pub mod convert;
pub mod files;
pub mod layout;
pub mod plan;
pub mod presets;
pub mod random;
pub mod writer;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use lily_core::config::{to_config_json, Format, ModelConfig};
use lily_core::{Error, Result};

pub use convert::{quantize_checkpoint, QuantizeReport};
pub use files::{generation_config_json, tokenizer_config_json, tokenizer_json};
pub use plan::Plan;
pub use presets::{preset_config, Preset};

/// How far a writer has got, in bytes of shard files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// A progress callback; called from worker threads, often (every few MB).
pub type ProgressFn = dyn Fn(Progress) + Send + Sync;

/// What `synth` writes.
#[derive(Clone)]
pub struct SynthOptions {
    pub preset: Preset,
    /// Number of layers (a multiple of 4); the preset's own when `None`.
    pub layers: Option<usize>,
    pub seed: u64,
    pub format: Format,
    pub out_dir: PathBuf,
    /// Largest shard; the preset's own when `None`.
    pub shard_bytes: Option<u64>,
    pub progress: Option<Arc<ProgressFn>>,
}

impl SynthOptions {
    /// The preset's defaults: its own depth and shard size, seed 0, MLX 4-bit.
    pub fn new(preset: Preset, out_dir: impl Into<PathBuf>) -> Self {
        SynthOptions { preset, layers: None, seed: 0, format: Format::MlxQ4, out_dir: out_dir.into(), shard_bytes: None, progress: None }
    }

    /// The config and shard layout these options produce, without writing.
    pub fn plan(&self) -> Result<Plan> {
        let cfg = preset_config(self.preset, self.layers, self.format)?;
        Plan::new(&cfg, self.shard_bytes.unwrap_or(self.preset.shard_bytes()))
    }
}

impl std::fmt::Debug for SynthOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SynthOptions")
            .field("preset", &self.preset)
            .field("layers", &self.layers)
            .field("seed", &self.seed)
            .field("format", &self.format)
            .field("out_dir", &self.out_dir)
            .field("shard_bytes", &self.shard_bytes)
            .finish_non_exhaustive()
    }
}

/// What `synth` did.
#[derive(Clone, Debug)]
pub struct SynthReport {
    pub out_dir: PathBuf,
    pub config: ModelConfig,
    pub shards: usize,
    pub tensors: usize,
    /// Bytes of all files written.
    pub bytes_written: u64,
    pub seconds: f64,
}

fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<u64> {
    let path = dir.join(name);
    std::fs::write(&path, bytes).map_err(|e| Error::io(&path, e))?;
    Ok(bytes.len() as u64)
}

fn json_bytes(v: &serde_json::Value) -> Result<Vec<u8>> {
    let mut out = serde_json::to_vec_pretty(v).map_err(|e| Error::Other(format!("serialising JSON: {e}")))?;
    out.push(b'\n');
    Ok(out)
}

/// Writes the shards and the index, then `config.json` last: a directory
/// whose writer was interrupted has no `config.json` and can never be
/// mistaken for a complete checkpoint. Returns the bytes written.
pub(crate) fn finish_checkpoint(plan: &Plan, dir: &Path, source: &dyn layout::Source, progress: &(dyn Fn(Progress) + Sync)) -> Result<u64> {
    for stale in ["config.json", "model.safetensors.index.json"] {
        let p = dir.join(stale);
        if p.exists() {
            std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    let mut n = writer::write_shards(plan, dir, source, progress)?;
    n += write_file(dir, "model.safetensors.index.json", &json_bytes(&plan.index_json())?)?;
    n += write_file(dir, "config.json", &json_bytes(&to_config_json(&plan.config))?)?;
    Ok(n)
}

/// Writes a synthetic checkpoint directory as `opts` describe.
pub fn synth(opts: &SynthOptions) -> Result<SynthReport> {
    let plan = opts.plan()?;
    let quiet = |_: Progress| {};
    let progress: &(dyn Fn(Progress) + Sync) = match &opts.progress {
        Some(p) => p.as_ref(),
        None => &quiet,
    };
    write_synthetic(&plan, opts.seed, &opts.out_dir, progress)
}

/// Writes a synthetic checkpoint of any plan (any validated config, e.g. a
/// test model with a small vocabulary) into `dir`. `synth` is this with a
/// preset's plan.
pub fn write_synthetic(plan: &Plan, seed: u64, dir: &Path, progress: &(dyn Fn(Progress) + Sync)) -> Result<SynthReport> {
    let start = Instant::now();
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut n = 0;
    n += write_file(dir, "tokenizer.json", &tokenizer_json()?)?;
    n += write_file(dir, "tokenizer_config.json", &json_bytes(&tokenizer_config_json())?)?;
    n += write_file(dir, "chat_template.jinja", lily_core::chat::DEFAULT_CHAT_TEMPLATE.as_bytes())?;
    n += write_file(dir, "generation_config.json", &json_bytes(&generation_config_json())?)?;
    let source = random::RandomSource { seed, num_layers: plan.config.num_layers, conv_kernel: plan.config.conv_kernel };
    n += finish_checkpoint(plan, dir, &source, progress)?;
    Ok(SynthReport {
        out_dir: dir.to_path_buf(),
        config: plan.config.clone(),
        shards: plan.shards.len(),
        tensors: plan.tensors.len(),
        bytes_written: n,
        seconds: start.elapsed().as_secs_f64(),
    })
}
