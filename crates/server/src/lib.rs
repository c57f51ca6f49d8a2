//! lily-server: the OpenAI-compatible HTTP edge of Lily.
//!
//! It owns everything between a socket and the engine queue: request JSON and
//! its validation (`openai`, `validate`), the chat template call, the state
//! the handlers share (`state`), auth, limits and CORS (`app`), turning
//! engine events into OpenAI responses (`driver`, `output`, `reasoning`,
//! `tool_parser`), the one loop that collects or streams them (`respond`)
//! in each endpoint's shape (`shapes`), the handlers (`routes`), metrics
//! (`metrics`), and a scripted stand-in for the model's continuation used by
//! end-to-end tests (`scripted`). It owns no model state: the engine thread
//! does (STYLE habit 10).

pub mod app;
pub mod driver;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod output;
pub mod reasoning;
mod respond;
pub mod routes;
pub mod scripted;
mod shapes;
pub mod state;
pub mod tool_parser;
pub mod validate;

pub use app::{router, serve};
pub use engine::{EventStream, Generator};
pub use error::ApiError;
pub use state::{AppState, ServerConfig};
