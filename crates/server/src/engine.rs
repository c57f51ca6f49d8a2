//! The server's view of the engine: submit a request, read its events.
//!
//! [`Generator`] is what the HTTP handlers call. The real implementation is
//! `lily_engine::EngineHandle`; tests use fakes, and `scripted.rs` wraps a
//! generator to replace the model's continuation for end-to-end tests. The
//! event stream is boxed so that all of them look alike; dropping it is how
//! a request is cancelled (the engine's `RequestStream` cancels on drop).

use std::pin::Pin;

use futures::Stream;
use lily_engine::{EngineHandle, EngineStats, Event, GenerateRequest, ModelInfo, SubmitError};

/// Events of one request; dropping it cancels the request.
pub type EventStream = Pin<Box<dyn Stream<Item = Event> + Send>>;

/// Held by a handler from a request's arrival until it is submitted with
/// it (`Generator::submit_announced`) or refused (`Generator::arrival`).
pub type ArrivalGuard = Box<dyn Send>;

pub trait Generator: Send + Sync + 'static {
    /// Queues a request; `Err` means nothing was started.
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, SubmitError>;
    /// Announces a request that this front end will submit once it is
    /// rendered and tokenized, with `submit_announced`
    /// (`lily_engine::Arrival`: an idle engine waits for it before a
    /// prefill it could share). None where the generator has no use for it.
    fn arrival(&self) -> Option<ArrivalGuard> {
        None
    }
    /// `submit` for a request announced by `arrival` (if the handler took
    /// one), which ends once the request is queued (by default: just before
    /// it is submitted).
    fn submit_announced(&self, req: GenerateRequest, arrival: Option<ArrivalGuard>) -> Result<EventStream, SubmitError> {
        drop(arrival);
        self.submit(req)
    }
    fn stats(&self) -> EngineStats;
    fn model_info(&self) -> ModelInfo;
    /// Stop taking requests and finish the accepted ones.
    fn shutdown(&self);
}

impl Generator for EngineHandle {
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, SubmitError> {
        let stream = EngineHandle::submit(self, req)?;
        Ok(Box::pin(stream))
    }

    fn arrival(&self) -> Option<ArrivalGuard> {
        Some(Box::new(EngineHandle::arrival(self)))
    }

    fn submit_announced(&self, req: GenerateRequest, arrival: Option<ArrivalGuard>) -> Result<EventStream, SubmitError> {
        let stream = EngineHandle::submit_announced(self, req, arrival)?;
        Ok(Box::pin(stream))
    }

    fn stats(&self) -> EngineStats {
        EngineHandle::stats(self)
    }

    fn model_info(&self) -> ModelInfo {
        EngineHandle::model_info(self)
    }

    fn shutdown(&self) {
        EngineHandle::shutdown(self)
    }
}
