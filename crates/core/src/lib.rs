//! lily-core: everything Lily knows about a checkpoint before any backend sees it.
//!
//! It owns config validation (`config`), memory-mapped safetensors reading
//! (`tensors`), the MLX affine quantisation format (`quant`), the mapping of
//! both checkpoint layouts onto one typed weight tree (`weights`), the
//! tokenizer (`tokenizer`) and the chat template (`chat`). It owns no model
//! math and no GPU code.

pub mod chat;
pub mod config;
pub mod error;
pub mod quant;
mod split;
pub mod tensors;
pub mod tokenizer;
pub mod weights;

pub use config::{Format, LayerKind, ModelConfig};
pub use error::{Error, Result};
