//! The state every handler shares: the engine, the tokenizer and chat
//! template, the HTTP edge's configuration, the metrics, and whether the
//! server is draining.
//!
//! It has its own module because both the router (`app.rs`) and the handlers
//! (`routes.rs`) read it: each depends on this file, and neither on the other
//! for it. It owns no behaviour beyond building the state.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lily_core::chat::ChatTemplate;
use lily_core::tokenizer::Tokenizer;
use lily_engine::{ModelInfo, SamplingParams};

use crate::engine::Generator;
use crate::metrics::Metrics;
use crate::validate::Limits;

/// What `lily serve`'s flags decide about the HTTP edge.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Required as `Authorization: Bearer KEY` when set.
    pub api_key: Option<String>,
    /// Send permissive CORS headers (browsers on other origins may call us).
    pub cors: bool,
    pub max_body_bytes: usize,
    pub limits: Limits,
    /// Per-request deadline, passed to the engine.
    pub request_timeout: Option<Duration>,
    /// Extra words for `/v1/models` (e.g. that the output is scripted).
    pub model_note: Option<String>,
    /// Sampling for fields a request leaves out.
    pub sampling_defaults: SamplingParams,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            cors: false,
            max_body_bytes: 8 << 20,
            limits: Limits::default(),
            request_timeout: None,
            model_note: None,
            sampling_defaults: SamplingParams::default(),
        }
    }
}

/// Shared by every handler.
pub struct AppState {
    pub engine: Arc<dyn Generator>,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    pub config: ServerConfig,
    pub metrics: Arc<Metrics>,
    pub info: ModelInfo,
    /// Unix time the server started (`created` of the model card).
    pub started: u64,
    /// Set once shutdown began: new generations get 503.
    pub draining: AtomicBool,
}

impl AppState {
    pub fn new(engine: Arc<dyn Generator>, tokenizer: Arc<Tokenizer>, template: Arc<ChatTemplate>, config: ServerConfig) -> Arc<Self> {
        let info = engine.model_info();
        Arc::new(AppState {
            engine,
            tokenizer,
            template,
            config,
            metrics: Arc::new(Metrics::default()),
            info,
            started: unix_now(),
            draining: AtomicBool::new(false),
        })
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
