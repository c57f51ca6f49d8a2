//! Error values of the CUDA backend. Every driver call, NVRTC compile and
//! kernel launch returns one of these; the `Backend` boundary turns them into
//! `ModelError`s with the same text.

use lily_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA driver or device on this machine (CPU-only hosts).
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A CUDA driver call failed; `what` names the call site.
    #[error("CUDA driver error in {what}: {message}")]
    Driver { what: String, message: String },
    /// NVRTC could not be loaded (library missing).
    #[error("NVRTC unavailable: {0}")]
    NvrtcMissing(String),
    /// A kernel source failed to compile; `log` is NVRTC's log.
    #[error("NVRTC failed to compile {file}: {log}")]
    Compile { file: String, log: String },
    /// A model dimension outside what the kernels support.
    #[error("unsupported model shape: {0}")]
    Unsupported(String),
    /// A launcher's shape or dtype check failed (expected vs actual).
    #[error("shape check failed in {kernel}: {message}")]
    Shape { kernel: &'static str, message: String },
    /// Out of capacity (KV blocks, sequence slots, device memory plan).
    #[error("capacity: {0}")]
    Capacity(String),
    /// Bad request input (token id out of range, unknown sequence...).
    #[error("invalid input: {0}")]
    Invalid(String),
    /// The checkpoint could not be read or converted.
    #[error("weights: {0}")]
    Weights(String),
}

pub type CudaResult<T> = Result<T, CudaError>;

impl CudaError {
    pub fn driver(what: impl Into<String>, err: cudarc::driver::DriverError) -> Self {
        CudaError::Driver { what: what.into(), message: err.to_string() }
    }
    pub fn shape(kernel: &'static str, message: impl Into<String>) -> Self {
        CudaError::Shape { kernel, message: message.into() }
    }
}

impl From<lily_core::Error> for CudaError {
    fn from(e: lily_core::Error) -> Self {
        CudaError::Weights(e.to_string())
    }
}

impl From<CudaError> for ModelError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Capacity(m) => ModelError::Capacity(m),
            CudaError::Invalid(m) => ModelError::Invalid(m),
            other => ModelError::Device(other.to_string()),
        }
    }
}

/// `result.map_err(|e| CudaError::driver(what, e))` in short.
pub(crate) trait DriverContext<T> {
    fn ctx(self, what: &str) -> CudaResult<T>;
}

impl<T> DriverContext<T> for Result<T, cudarc::driver::DriverError> {
    fn ctx(self, what: &str) -> CudaResult<T> {
        self.map_err(|e| CudaError::driver(what, e))
    }
}
