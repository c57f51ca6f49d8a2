//! lily-cuda: the CUDA backend for NVIDIA Hopper (H100/H200).
//!
//! Hand-written CUDA C++ kernels (`src/kernels/<family>.cu`, each beside its
//! Rust launcher `src/<family>.rs`), compiled at start-up by NVRTC for
//! sm_90a with the model's dimensions as defines (`dims`), cached per shape
//! (`kernels`). Weights stay packed 4-bit (8-bit router and shared-expert
//! gate) in GPU memory (`weights`); the memory plan (`state`) allocates the
//! paged KV cache, the DeltaNet state and all scratch once; `model` strings
//! the kernels into decode steps (captured as CUDA graphs) and chunked
//! prefill; `backend` puts it behind `lily_model::Backend`; `bench` holds the
//! timed entry points of `lily bench`.
//!
//! The CUDA driver is loaded dynamically: on machines without one,
//! `CudaBackend::open` returns `CudaError::NoDevice` instead of panicking.
//! KERNELS.md at the repository root indexes every kernel.

pub mod attention;
pub mod backend;
pub mod bench;
pub mod device;
pub mod dims;
pub mod embed;
pub mod error;
pub mod feed;
pub mod gdn;
pub mod gemm;
pub mod hgemm;
pub mod kernel_trace;
pub mod kernels;
pub mod launch;
pub mod model;
pub mod moe;
pub mod nvrtc;
pub mod qmm;
pub mod runahead;
pub mod sampling;
pub mod state;
pub mod synth;
pub mod weights;

pub use backend::CudaBackend;
pub use device::{driver_present, Gpu};
pub use dims::Dims;
pub use error::{CudaError, CudaResult};
pub use state::{DecodeMatrices, Options};
