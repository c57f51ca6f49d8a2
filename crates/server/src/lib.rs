//! lily-server: the OpenAI-compatible HTTP edge of Lily.
//!
//! It owns everything between a socket and the engine queue: request JSON and
//! its validation, the chat template call, auth, limits, turning engine
//! events into OpenAI responses (reasoning split, tool-call parsing, stop
//! strings, logprobs), SSE streaming, and metrics. It owns no model state:
//! the engine thread does (STYLE habit 10).

pub mod error;
pub mod tool_parser;
pub mod openai;
pub mod reasoning;
pub mod validate;
