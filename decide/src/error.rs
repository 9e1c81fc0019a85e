//! Errors the sidecar returns to clients, in OpenAI's JSON error shape, as plain data.
//!
//! Clients use OpenAI SDKs, which turn `{"error": {"message", "type", "param", "code"}}` plus
//! the HTTP status into typed exceptions (`BadRequestError`, `NotFoundError`,
//! `RateLimitError`, …), so every error the sidecar itself produces takes that shape. An
//! [`ApiError`] is only the status, the fields and the `Retry-After` hint; the sidecar's
//! response layer turns it into an HTTP response at the edge.

use bytes::Bytes;
use http::StatusCode;
use serde::Serialize;

/// An error response produced by the sidecar (not passed through from a provider).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `rate_limit_error`, `server_error`, …
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<&'static str>,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u64>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code: None,
            param: None,
            retry_after: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "The model `{model}` does not exist or is not served by any route of this sidecar."
            ),
        );
        e.code = Some("model_not_found");
        e.param = Some("model");
        e
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("Unknown path {path}: this sidecar serves the OpenAI API below /v1/."),
        )
    }

    pub fn method_not_allowed(method: &http::Method, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("Method {method} is not allowed on {path}."),
        )
    }

    pub fn too_large(limit: u64) -> Self {
        let mut e = Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!(
                "The request body is larger than the route's limit of {limit} bytes (spec.limits.maxBodyBytes)."
            ),
        );
        e.code = Some("request_too_large");
        e
    }

    pub fn body_timeout() -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "The request body was not received in time.",
        )
    }

    pub fn upstream_unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message);
        e.code = Some("no_provider_available");
        e
    }

    pub fn bad_gateway(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_GATEWAY, "server_error", message);
        e.code = Some("upstream_error");
        e
    }

    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message);
        e.code = Some("upstream_timeout");
        e
    }

    /// A follow-up whose state lives on a provider that cannot take it now: it is not sent
    /// elsewhere, where the history would be missing.
    pub fn owner_unavailable(id: &str, provider: &str, why: &str) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!(
                "`{id}` was created by provider {provider}, which is unavailable ({why}); the request was not sent to another provider because the response's state lives on {provider}."
            ),
        );
        e.code = Some("owner_unavailable");
        e
    }

    /// A follow-up whose owner is not a provider of the route its model chose.
    pub fn owner_not_in_route(id: &str, provider: &str, route: &str) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!(
                "`{id}` was created by provider {provider}, which is not a provider of route {route} (the route of this request's model); send the follow-up with a model served by a route that has provider {provider}."
            ),
        );
        e.code = Some("owner_not_in_route");
        e
    }

    pub fn shutting_down() -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "The sidecar is shutting down.",
        );
        e.retry_after = Some(1);
        e
    }

    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    /// The JSON body.
    pub fn body_json(&self) -> Bytes {
        let envelope = Envelope {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param,
                code: self.code,
            },
        };
        // Serialising plain strings cannot fail; fall back to a fixed body all the same.
        serde_json::to_vec(&envelope)
            .map(Bytes::from)
            .unwrap_or_else(|_| Bytes::from_static(b"{\"error\":{\"message\":\"internal error\",\"type\":\"server_error\",\"param\":null,\"code\":null}}"))
    }
}
