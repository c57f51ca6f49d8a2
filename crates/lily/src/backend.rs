//! Opening a checkpoint on a device: the one place the binary chooses between
//! the CPU and CUDA backends, shared by `serve`, `generate`, `bench` and `agree`.

use std::path::Path;

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
    let _ = (dir, max_seq, &progress);
    anyhow::bail!("no backend is wired into this build yet (device {})", device.as_str())
}
