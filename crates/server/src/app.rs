//! The axum application: the router, auth, CORS, body limits, per-endpoint
//! metrics, and serving with a graceful drain.
//!
//! Handlers live in `routes.rs` and the state they share in `state.rs`; this
//! file wires them up and owns the cross-cutting rules: every error is
//! OpenAI-shaped JSON (unknown routes, wrong methods and oversized bodies
//! included), `/health` is open while everything else needs the API key when
//! one is set, and CORS headers exist only when asked for.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use tower_http::cors::{Any, CorsLayer};

use crate::error::ApiError;
use crate::routes;
use crate::state::AppState;

/// The endpoint label for metrics.
fn endpoint_of(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat_completions",
        "/v1/completions" => "completions",
        "/health" => "health",
        "/metrics" => "metrics",
        p if p == "/v1/models" || p.starts_with("/v1/models/") => "models",
        _ => "other",
    }
}

async fn record_status(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let endpoint = endpoint_of(req.uri().path());
    let resp = next.run(req).await;
    app.metrics.record_request(endpoint, resp.status().as_u16());
    resp
}

/// Compares in time that depends only on the lengths, so the key cannot be
/// guessed byte by byte from response times.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn check_key(headers: &HeaderMap, key: &str) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err(ApiError::unauthorized("missing API key: send `Authorization: Bearer <key>`"));
    };
    let value = value.as_bytes();
    let token = value
        .strip_prefix(b"Bearer ")
        .or_else(|| value.strip_prefix(b"bearer "))
        .ok_or_else(|| ApiError::unauthorized("the Authorization header must be `Bearer <key>`"))?;
    if constant_time_eq(token, key.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::unauthorized("invalid API key"))
    }
}

async fn require_key(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.config.api_key {
        // Preflights carry no credentials; CORS (outside) answers them.
        if req.method() != Method::OPTIONS {
            if let Err(e) = check_key(req.headers(), key) {
                return e.into_response();
            }
        }
    }
    next.run(req).await
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no route for {} {}", req.method(), req.uri().path()))
}

async fn wrong_method(req: Request) -> ApiError {
    ApiError::method_not_allowed(format!("{} is not allowed on {}", req.method(), req.uri().path()))
}

/// The whole application.
pub fn router(app: Arc<AppState>) -> Router {
    let protected = Router::new()
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/models", get(routes::list_models))
        .route("/v1/models/{*id}", get(routes::get_model))
        .route("/metrics", get(routes::metrics))
        .route_layer(middleware::from_fn_with_state(app.clone(), require_key));
    let mut router = Router::new()
        .route("/health", get(routes::health))
        .merge(protected)
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(app.config.max_body_bytes))
        .layer(middleware::from_fn_with_state(app.clone(), record_status))
        .with_state(app.clone());
    if app.config.cors {
        router = router.layer(CorsLayer::new().allow_origin(Any).allow_methods([Method::GET, Method::POST, Method::OPTIONS]).allow_headers(Any));
    }
    router
}

/// `listener` with Nagle's algorithm off on every accepted connection. A
/// streamed token is a small SSE write; with Nagle on, a write waits until
/// the one before is acknowledged, and a client on a kept-alive connection
/// delays that ACK by up to 40 ms (Linux's delayed ACK): measured with a
/// one-client stream, the first token's chunk reached the client ~35 ms
/// after the server wrote it. Token streams want every write on the wire.
/// (A named type, not `impl Listener`: axum's connect info for the peer
/// address is implemented for `TapIo`.)
fn no_delay(listener: tokio::net::TcpListener) -> axum::serve::TapIo<tokio::net::TcpListener, fn(&mut tokio::net::TcpStream)> {
    listener.tap_io(set_nodelay)
}

fn set_nodelay(tcp: &mut tokio::net::TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::warn!("TCP_NODELAY on an accepted connection: {e}");
    }
}

/// Serves until `shutdown` resolves, then stops taking connections and
/// waits for the requests in flight to finish (streams included) before
/// telling the engine to stop.
pub async fn serve(listener: tokio::net::TcpListener, app: Arc<AppState>, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    let state = app.clone();
    let signal = async move {
        shutdown.await;
        state.draining.store(true, Ordering::SeqCst);
        tracing::info!("shutting down: no new connections; draining requests in flight");
    };
    // Each request knows its connection's peer (`routes::client_of`): the
    // engine tells one client's next request from another client's.
    let service = router(app.clone()).into_make_service_with_connect_info::<std::net::SocketAddr>();
    let result = axum::serve(no_delay(listener), service).with_graceful_shutdown(signal).await;
    app.engine.shutdown();
    result
}

#[cfg(test)]
mod tests {
    use axum::serve::Listener;

    #[tokio::test]
    async fn accepted_connections_send_without_delay() {
        let bound = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = bound.local_addr().expect("local addr");
        let mut listener = super::no_delay(bound);
        let client = tokio::spawn(async move { tokio::net::TcpStream::connect(addr).await });
        let (io, _) = listener.accept().await;
        let _client = client.await.expect("join").expect("connect");
        assert!(io.nodelay().expect("TCP_NODELAY readable"), "an accepted connection keeps Nagle's algorithm on");
    }
}
