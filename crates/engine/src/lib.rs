//! lily-engine: turns a `lily_model::Backend` into a service that many
//! callers share.
//!
//! One engine thread owns the backend and is fed through a queue
//! (`Engine::start` returns an `EngineHandle`). The engine owns sequences,
//! chunked prefill interleaved with decode (continuous batching), sampling,
//! stop handling with incremental detokenisation, the prefix cache of
//! backend snapshots, and the 4-bit vs reference agreement check
//! (`agree`). It owns no HTTP, JSON or chat templating (the server and the
//! CLI do that) and no model math (the backends do).

pub mod agree;
pub mod api;
mod engine;
mod kv;
pub mod prefix_cache;
pub mod sampling;
mod scheduler;
pub mod text;

pub use api::{
    Arrival, EngineError, EngineHandle, EngineOptions, EngineStats, EngineTime, Event, FinishReason, GenerateRequest, MixPolicy, ModelInfo, RequestStream,
    SamplingParams, SubmitError, TokenLogprob, DEFAULT_ARRIVAL_WAIT, MAX_TOP_LOGPROBS,
};
pub use engine::{panic_message, Engine};
