//! Errors as the client sees them: an HTTP status plus OpenAI's error body
//! `{"error": {"message", "type", "param", "code"}}`, and a `Retry-After`
//! header when the server is full.
//!
//! Every failure on the HTTP path ends up as an [`ApiError`]; handlers never
//! panic and never return a bare status, so clients written against OpenAI
//! (which read `error.message`) always get something they can show.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// One error response.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`,
    /// `not_found_error`, `rate_limit_error`, `server_error`...
    pub kind: &'static str,
    /// The request field at fault, in OpenAI's dotted form (`messages[1].role`).
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for the `Retry-After` header (429 / 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    /// 400 for a request we cannot or will not serve as written.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the field at fault.
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::invalid(message).with_param(param)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message).with_code("invalid_api_key")
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    pub fn model_not_found(model: &str, served: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist; this server serves `{served}` (also reachable as `lily`; see GET /v1/models)"),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", message)
    }

    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", format!("request body is larger than the server's limit of {limit} bytes"))
            .with_code("request_too_large")
    }

    /// 429: the waiting queue is full; try again shortly.
    pub fn too_many_requests(message: impl Into<String>, retry_after: u64) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message).with_code("server_busy");
        e.retry_after = Some(retry_after);
        e
    }

    /// 503: the server cannot take work now (shutting down, engine gone).
    pub fn unavailable(message: impl Into<String>, retry_after: Option<u64>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message).with_code("service_unavailable");
        e.retry_after = retry_after;
        e
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message).with_code("timeout")
    }

    /// 500: the engine failed while serving an accepted request.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body, also used for the `error` event of a broken stream.
    pub fn body(&self) -> serde_json::Value {
        #[derive(Serialize)]
        struct Inner<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<&'a str>,
            code: Option<&'a str>,
        }
        #[derive(Serialize)]
        struct Outer<'a> {
            error: Inner<'a>,
        }
        serde_json::to_value(Outer { error: Inner { message: &self.message, kind: self.kind, param: self.param.as_deref(), code: self.code } })
            .unwrap_or(serde_json::Value::Null)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        let mut resp = (self.status, body).into_response();
        let headers = resp.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_openai_shape() {
        let e = ApiError::invalid_param("messages[0].role", "unknown role `robot`");
        let v = e.body();
        assert_eq!(v["error"]["message"], "unknown role `robot`");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "messages[0].role");
        assert!(v["error"]["code"].is_null());
        assert_eq!(v.as_object().map(|o| o.len()), Some(1));
    }

    #[test]
    fn retry_after_header_is_set() {
        let resp = ApiError::too_many_requests("queue full", 2).into_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers().get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()), Some("2"));
        assert_eq!(resp.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()), Some("application/json"));
    }

    #[test]
    fn unauthorized_asks_for_bearer() {
        let resp = ApiError::unauthorized("no key").into_response();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(resp.headers().get(header::WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()), Some("Bearer"));
    }
}
