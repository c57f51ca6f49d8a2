//! Opening a checkpoint on a device: the one place the binary chooses between
//! the CPU and CUDA backends, shared by `serve`, `generate`, `bench` and `agree`.

use std::path::Path;

use anyhow::Context;
use lily_model::Backend;

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// CUDA when a GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

impl Device {
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Auto => "auto",
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// Sequences a one-shot command (`generate`, `bench`, `agree`) holds at once.
const COMMAND_SEQUENCES: usize = 8;

/// Loads the checkpoint in `dir` onto `device` for a one-shot command.
/// `max_seq` caps the context a sequence may hold (the backend's own limit
/// when `None`). `progress` gets (bytes done, bytes total) while weights load.
pub fn open_backend(dir: &Path, device: Device, max_seq: Option<usize>, progress: &mut dyn FnMut(u64, u64)) -> anyhow::Result<Box<dyn Backend>> {
    open_backend_with(dir, device, Sizing { max_seq, max_sequences: COMMAND_SEQUENCES, kv_tokens: None, batch_invariant: false }, progress)
}

/// How much a backend holds.
#[derive(Clone, Copy, Debug)]
pub struct Sizing {
    /// Longest sequence (the backend's own limit when `None`).
    pub max_seq: Option<usize>,
    /// Sequences at once (running requests plus prefix-cache snapshots).
    pub max_sequences: usize,
    /// Tokens in the KV pool all sequences share (GPU); `None`: one
    /// full-length context plus the backend's slack blocks. The CPU
    /// backend grows its caches on demand and has no pool.
    pub kv_tokens: Option<usize>,
    /// Every decode step batch-invariant: a sequence's logits the same bits
    /// whatever else runs beside it (CUDA; `lily_cuda::DecodeMatrices`),
    /// at the cost of large-batch throughput. The CPU backend ignores it.
    pub batch_invariant: bool,
}

/// Like `open_backend`, sized by `sizing` (the server).
pub fn open_backend_with(dir: &Path, device: Device, sizing: Sizing, progress: &mut dyn FnMut(u64, u64)) -> anyhow::Result<Box<dyn Backend>> {
    let Sizing { max_seq, max_sequences, kv_tokens, batch_invariant } = sizing;
    let use_cuda = match device {
        Device::Cuda => true,
        Device::Cpu => false,
        // A machine with a driver but no usable GPU falls back to the CPU
        // with a warning; an explicit --device cuda does not.
        Device::Auto => lily_cuda::driver_present(),
    };
    if use_cuda {
        match open_cuda(dir, max_seq, max_sequences, kv_tokens, batch_invariant, progress) {
            Ok(b) => return Ok(b),
            Err(e) if device == Device::Auto => {
                tracing::warn!("CUDA unavailable ({e:#}); running on the CPU");
            }
            Err(e) => return Err(e),
        }
    }
    // The CPU backend maps the checkpoint; there is nothing to copy, so
    // progress jumps from 0 to done.
    progress(0, 1);
    let backend =
        lily_cpu::CpuBackend::open(dir, max_seq).with_context(|| format!("loading {} on the CPU", dir.display()))?.with_max_sequences(max_sequences.max(1));
    progress(1, 1);
    Ok(Box::new(backend))
}

fn open_cuda(
    dir: &Path,
    max_seq: Option<usize>,
    max_sequences: usize,
    kv_tokens: Option<usize>,
    batch_invariant: bool,
    progress: &mut dyn FnMut(u64, u64),
) -> anyhow::Result<Box<dyn Backend>> {
    let defaults = lily_cuda::Options::default();
    let max_seq_len = max_seq.unwrap_or(defaults.max_seq_len);
    let opts = lily_cuda::Options {
        max_seq_len,
        max_sequences: max_sequences.max(1),
        // By default a KV pool of one full-length context plus the
        // backend's slack blocks; sequences share it, so many short ones
        // fit as well.
        kv_tokens: kv_tokens.unwrap_or(max_seq_len + (defaults.kv_tokens - defaults.max_seq_len)),
        decode_matrices: decode_matrices(
            batch_invariant,
            defaults.decode_matrices,
            std::env::var("LILY_DECODE_GEMM").ok().as_deref(),
            std::env::var("LILY_DECODE_F16").ok().as_deref(),
        )?,
        moe_f16_from: moe_f16_from(defaults.moe_f16_from, std::env::var("LILY_MOE_F16").ok().as_deref())?,
        router_mma_from: router_mma_from(defaults.router_mma_from, std::env::var("LILY_ROUTER_MMA").ok().as_deref())?,
        ..defaults
    };
    let backend = lily_cuda::CudaBackend::open(dir, opts, progress).with_context(|| format!("loading {} on the GPU", dir.display()))?;
    Ok(Box::new(backend))
}

/// The decode path: `batch_invariant` keeps every step on qmm's exact path;
/// else `LILY_DECODE_GEMM` (`off`, or the batch size from which the GEMM
/// path runs) and `LILY_DECODE_F16` (`off`, or the batch size from which
/// qmm's dense matrices take fp16 activations: `lily_cuda::DecodeMatrices`)
/// override the backend's defaults, tuning knobs for measuring where each
/// path starts to pay.
/// (`gemm` and `f16`: the two variables' values, when set.)
fn decode_matrices(
    batch_invariant: bool,
    default: lily_cuda::DecodeMatrices,
    gemm: Option<&str>,
    f16: Option<&str>,
) -> anyhow::Result<lily_cuda::DecodeMatrices> {
    if batch_invariant {
        return Ok(lily_cuda::DecodeMatrices::BATCH_INVARIANT);
    }
    let mut m = match gemm {
        Some(v) => lily_cuda::DecodeMatrices::parse(v).map_err(|e| anyhow::anyhow!("LILY_DECODE_GEMM: {e}"))?,
        None => default,
    };
    if let Some(v) = f16 {
        m.f16_from = lily_cuda::DecodeMatrices::parse_f16_from(v).map_err(|e| anyhow::anyhow!("LILY_DECODE_F16: {e}"))?;
    }
    Ok(m)
}

/// The smallest GEMM-path decode step whose experts read fp16 activations:
/// `LILY_MOE_F16` (`off`, or a number of sequences), when set, overrides the
/// backend's default (`lily_cuda::Options::moe_f16_from`), a tuning knob like
/// the two above (`--batch-invariant` keeps every step off the GEMM path, so
/// off fp16 experts too).
fn moe_f16_from(default: Option<usize>, var: Option<&str>) -> anyhow::Result<Option<usize>> {
    threshold_var(default, var, "LILY_MOE_F16", lily_cuda::Options::parse_moe_f16_from)
}

/// The smallest GEMM-path decode step whose router runs on the tensor
/// cores: `LILY_ROUTER_MMA` (`off`, or a number of sequences), when set,
/// overrides the backend's default (`lily_cuda::Options::router_mma_from`).
fn router_mma_from(default: Option<usize>, var: Option<&str>) -> anyhow::Result<Option<usize>> {
    threshold_var(default, var, "LILY_ROUTER_MMA", lily_cuda::Options::parse_router_mma_from)
}

/// A step-size threshold from the variable `name` (its value `var`, parsed
/// by `parse`) when set, else `default`.
fn threshold_var(default: Option<usize>, var: Option<&str>, name: &str, parse: fn(&str) -> Result<Option<usize>, String>) -> anyhow::Result<Option<usize>> {
    match var {
        Some(v) => parse(v).map_err(|e| anyhow::anyhow!("{name}: {e}")),
        None => Ok(default),
    }
}

#[cfg(test)]
mod tests {
    use super::{decode_matrices, moe_f16_from, router_mma_from};
    use lily_cuda::DecodeMatrices;

    #[test]
    fn the_decode_path_variables_override_the_default_unless_batch_invariant() {
        let d = DecodeMatrices::FASTEST;
        assert_eq!(decode_matrices(false, d, None, None).unwrap(), d);
        assert_eq!(decode_matrices(false, d, Some("12"), None).unwrap(), DecodeMatrices { gemm_from: 12, ..d });
        assert_eq!(decode_matrices(false, d, None, Some("7")).unwrap(), DecodeMatrices { f16_from: 7, ..d });
        assert_eq!(decode_matrices(false, d, None, Some("off")).unwrap(), DecodeMatrices { f16_from: usize::MAX, ..d });
        assert_eq!(decode_matrices(false, d, Some("off"), Some("2")).unwrap(), DecodeMatrices { gemm_from: usize::MAX, f16_from: 2 });
        assert_eq!(decode_matrices(true, d, Some("12"), Some("5")).unwrap(), DecodeMatrices::BATCH_INVARIANT, "--batch-invariant wins");
        let e = decode_matrices(false, d, None, Some("17")).unwrap_err().to_string();
        assert!(e.contains("LILY_DECODE_F16") && e.contains("2..=16"), "{e}");
        let e = decode_matrices(false, d, Some("0"), None).unwrap_err().to_string();
        assert!(e.contains("LILY_DECODE_GEMM"), "{e}");
    }

    #[test]
    fn the_fp16_experts_variable_overrides_the_default() {
        assert_eq!(moe_f16_from(Some(32), None).unwrap(), Some(32));
        assert_eq!(moe_f16_from(Some(32), Some("off")).unwrap(), None);
        assert_eq!(moe_f16_from(None, Some(" 64 ")).unwrap(), Some(64));
        let e = moe_f16_from(Some(32), Some("0")).unwrap_err().to_string();
        assert!(e.contains("LILY_MOE_F16"), "{e}");
        let e = moe_f16_from(Some(32), Some("many")).unwrap_err().to_string();
        assert!(e.contains("LILY_MOE_F16") && e.contains("many"), "{e}");
    }

    #[test]
    fn the_tensor_core_router_variable_overrides_the_default() {
        assert_eq!(router_mma_from(Some(9), None).unwrap(), Some(9));
        assert_eq!(router_mma_from(Some(9), Some("off")).unwrap(), None);
        assert_eq!(router_mma_from(None, Some("16")).unwrap(), Some(16));
        let e = router_mma_from(Some(9), Some("0")).unwrap_err().to_string();
        assert!(e.contains("LILY_ROUTER_MMA"), "{e}");
    }
}
