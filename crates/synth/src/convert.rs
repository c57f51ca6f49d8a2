//! `quantize_checkpoint`: the original BF16 release to the MLX 4-bit layout.
//!
//! The input is loaded with `Weights::load`, so it is fully validated
//! (every tensor present, shaped and used) before a byte is written, and
//! norms arrive as plain gains whichever convention the file used. The
//! output is planned from `expected_tensors` of the same config with the
//! MLX quantisation block and streamed like a synthetic checkpoint. What
//! follows MLX (mlx-lm's conversion of this model) exactly:
//! - linears: affine, group 64, 4-bit, 8-bit for the router and the
//!   shared-expert gate (`lily_core::quant`); scales and biases computed in
//!   f32 from the bf16 weights, stored as bf16 rounded to nearest even;
//! - the fused `experts.gate_up_proj` `[E, 2 im, h]` splits into
//!   `switch_mlp.gate_proj` (first `im` rows per expert) and `up_proj`;
//! - `conv1d.weight` `[C, 1, K]` becomes `[C, K, 1]` (same memory order);
//! - one-centred norms are stored as the gain `1 + w`, rounded to bf16;
//! - `A_log` stays f32; every other vector is bf16.
//!
//! The tokenizer, template and generation files are copied unchanged.

use std::path::{Path, PathBuf};
use std::time::Instant;

use lily_core::config::{mlx_quantization, Format};
use lily_core::tensors::{DType, TensorRef};
use lily_core::weights::{Linear, Mixer, Weights};
use lily_core::{Error, Result};

use crate::layout::{LinearParam, Source, VectorParam};
use crate::plan::Plan;
use crate::presets::FULL_SHARD_BYTES;
use crate::{finish_checkpoint, Progress};

/// Files copied unchanged from the input checkpoint when present.
pub const COPIED_FILES: [&str; 4] = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"];

/// What `quantize_checkpoint` did.
#[derive(Clone, Debug)]
pub struct QuantizeReport {
    pub out_dir: PathBuf,
    pub shards: usize,
    pub tensors: usize,
    /// Bytes written (shards, index, config and copied files).
    pub bytes_written: u64,
    /// Which of `COPIED_FILES` were copied, and which the input lacked.
    pub copied: Vec<String>,
    pub missing: Vec<String>,
    pub seconds: f64,
}

/// Converts the BF16 checkpoint in `in_dir` into the MLX 4-bit layout in
/// `out_dir` (created if needed). `progress` hears about every block.
pub fn quantize_checkpoint(in_dir: &Path, out_dir: &Path, progress: Option<&(dyn Fn(Progress) + Sync)>) -> Result<QuantizeReport> {
    let start = Instant::now();
    let weights = Weights::load(in_dir)?;
    if weights.config.format() != Format::HfBf16 {
        return Err(Error::Other(format!("{}: already an MLX quantised checkpoint (config.json has a quantization block)", in_dir.display())));
    }
    let mut cfg = weights.config.clone();
    cfg.quantization = Some(mlx_quantization(&cfg));
    let cfg = cfg.validated()?;
    let plan = Plan::new(&cfg, FULL_SHARD_BYTES)?;

    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    let mut copied = Vec::new();
    let mut missing = Vec::new();
    let mut extra_bytes = 0u64;
    for name in COPIED_FILES {
        let from = in_dir.join(name);
        if from.exists() {
            let to = out_dir.join(name);
            extra_bytes += std::fs::copy(&from, &to).map_err(|e| Error::io(&to, e))?;
            copied.push(name.to_string());
        } else {
            missing.push(name.to_string());
        }
    }
    let quiet = |_: Progress| {};
    let source = WeightsSource { weights: &weights };
    let written = finish_checkpoint(&plan, out_dir, &source, progress.unwrap_or(&quiet))?;
    Ok(QuantizeReport {
        out_dir: out_dir.to_path_buf(),
        shards: plan.shards.len(),
        tensors: plan.tensors.len(),
        bytes_written: written + extra_bytes,
        copied,
        missing,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Logical values read from loaded weights.
struct WeightsSource<'a> {
    weights: &'a Weights,
}

fn unknown(key: &str) -> Error {
    Error::Other(format!("quantize: no weight for logical parameter `{key}`"))
}

impl WeightsSource<'_> {
    /// Splits `layers.N.rest` into the layer and the rest.
    fn layer<'k>(&self, key: &'k str) -> Result<(usize, &'k str)> {
        let rest = key.strip_prefix("layers.").ok_or_else(|| unknown(key))?;
        let (n, rest) = rest.split_once('.').ok_or_else(|| unknown(key))?;
        let n: usize = n.parse().map_err(|_| unknown(key))?;
        if n >= self.weights.layers.len() {
            return Err(unknown(key));
        }
        Ok((n, rest))
    }

    fn linear(&self, key: &str) -> Result<&Linear> {
        let w = self.weights;
        match key {
            "embed_tokens" => return Ok(&w.embed),
            "lm_head" => return Ok(&w.lm_head),
            _ => {}
        }
        let (n, rest) = self.layer(key)?;
        let layer = &w.layers[n];
        let moe = &layer.moe;
        let found = match (&layer.mixer, rest) {
            (Mixer::DeltaNet(d), "linear_attn.in_proj_qkv") => &d.in_qkv,
            (Mixer::DeltaNet(d), "linear_attn.in_proj_z") => &d.in_z,
            (Mixer::DeltaNet(d), "linear_attn.in_proj_a") => &d.in_a,
            (Mixer::DeltaNet(d), "linear_attn.in_proj_b") => &d.in_b,
            (Mixer::DeltaNet(d), "linear_attn.out_proj") => &d.out,
            (Mixer::Attention(a), "self_attn.q_proj") => &a.q,
            (Mixer::Attention(a), "self_attn.k_proj") => &a.k,
            (Mixer::Attention(a), "self_attn.v_proj") => &a.v,
            (Mixer::Attention(a), "self_attn.o_proj") => &a.o,
            (_, "mlp.gate") => &moe.router,
            (_, "mlp.experts.gate_proj") => &moe.gate,
            (_, "mlp.experts.up_proj") => &moe.up,
            (_, "mlp.experts.down_proj") => &moe.down,
            (_, "mlp.shared_expert.gate_proj") => &moe.shared_gate,
            (_, "mlp.shared_expert.up_proj") => &moe.shared_up,
            (_, "mlp.shared_expert.down_proj") => &moe.shared_down,
            (_, "mlp.shared_expert_gate") => &moe.shared_expert_gate,
            _ => return Err(unknown(key)),
        };
        Ok(found)
    }
}

/// Decodes `out.len()` float elements starting at element `start`.
fn decode_into(t: &TensorRef, start: usize, out: &mut [f32]) -> Result<()> {
    let es = t.dtype.size();
    let bytes = t.bytes().get(start * es..(start + out.len()) * es).ok_or_else(|| Error::Tensor {
        tensor: t.name.clone(),
        file: t.file.clone(),
        message: format!("elements {start}..{} are out of range", start + out.len()),
    })?;
    match t.dtype {
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        other => {
            return Err(Error::Tensor { tensor: t.name.clone(), file: t.file.clone(), message: format!("a {} tensor is not a float linear", other.name()) })
        }
    }
    Ok(())
}

impl Source for WeightsSource<'_> {
    fn linear_rows(&self, p: &LinearParam, row0: usize, out: &mut [f32]) -> Result<()> {
        let lin = self.linear(&p.key)?;
        let d = match lin {
            Linear::Dense(d) => d,
            Linear::Quant(_) => return Err(Error::Other(format!("quantize: `{}` is already quantised", p.key))),
        };
        if (d.experts, d.rows, d.cols) != (p.experts, p.rows, p.cols) {
            return Err(Error::Other(format!(
                "quantize: `{}` is [{}, {}, {}] in the input, expected [{}, {}, {}]",
                p.key, d.experts, d.rows, d.cols, p.experts, p.rows, p.cols
            )));
        }
        let rows = out.len() / p.cols;
        // Logical row R = e * rows + r lives at tensor row
        // e * tensor_rows + row_offset + r (the fused gate_up views).
        let mut r = 0;
        while r < rows {
            let global = row0 + r;
            let (e, local) = (global / d.rows, global % d.rows);
            let n = (d.rows - local).min(rows - r);
            let start = (e * d.tensor_rows + d.row_offset + local) * d.cols;
            decode_into(&d.tensor, start, &mut out[r * p.cols..(r + n) * p.cols])?;
            r += n;
        }
        Ok(())
    }

    fn vector(&self, p: &VectorParam) -> Result<Vec<f32>> {
        let w = self.weights;
        if p.key == "norm.weight" {
            return Ok(w.final_norm.clone());
        }
        let (n, rest) = self.layer(&p.key)?;
        let layer = &w.layers[n];
        let v = match (&layer.mixer, rest) {
            (_, "input_layernorm.weight") => &layer.input_norm,
            (_, "post_attention_layernorm.weight") => &layer.post_norm,
            (Mixer::DeltaNet(d), "linear_attn.conv1d.weight") => &d.conv,
            (Mixer::DeltaNet(d), "linear_attn.A_log") => &d.a_log,
            (Mixer::DeltaNet(d), "linear_attn.dt_bias") => &d.dt_bias,
            (Mixer::DeltaNet(d), "linear_attn.norm.weight") => &d.norm,
            (Mixer::Attention(a), "self_attn.q_norm.weight") => &a.q_norm,
            (Mixer::Attention(a), "self_attn.k_norm.weight") => &a.k_norm,
            _ => return Err(unknown(&p.key)),
        };
        // One-centred norms arrive as gains: `Weights` resolved the file's
        // convention, which is also the form the MLX layout stores.
        Ok(v.clone())
    }
}
