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

/// Loads the checkpoint in `dir` onto `device`. `max_seq` caps the context a
/// sequence may hold (the backend's own limit when `None`). `progress` gets
/// (bytes done, bytes total) while weights load.
pub fn open_backend(
    dir: &Path,
    device: Device,
    max_seq: Option<usize>,
    progress: &mut dyn FnMut(u64, u64),
) -> anyhow::Result<Box<dyn Backend>> {
    match device {
        Device::Cpu | Device::Auto => {
            // The CPU backend maps the checkpoint; there is nothing to copy,
            // so progress jumps from 0 to done.
            progress(0, 1);
            let backend = lily_cpu::CpuBackend::open(dir, max_seq)
                .with_context(|| format!("loading {} on the CPU", dir.display()))?;
            progress(1, 1);
            Ok(Box::new(backend))
        }
        Device::Cuda => anyhow::bail!("this build of lily has no CUDA backend; use --device cpu"),
    }
}
