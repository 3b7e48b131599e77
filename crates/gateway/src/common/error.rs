//! The one place errors become HTTP responses: an OpenAI-style body `{"error": {"message", "type", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use dprouter_core::prompt::PromptError;
use dprouter_core::RouteError;
use serde_json::json;

/// An error the gateway answers with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("request body is larger than the limit of {limit} bytes")]
    TooLarge { limit: usize },
    #[error("the request body did not arrive within {after_ms} ms")]
    BodyTimeout { after_ms: u64 },
    #[error("unsupported content type `{0}`: send application/json")]
    UnsupportedMediaType(String),
    #[error("method {0} is not allowed here")]
    MethodNotAllowed(String),
    #[error("the request URI is longer than {0} bytes")]
    UriTooLong(usize),
    #[error("{0}")]
    HeadersTooLarge(String),
    #[error("{0}")]
    NotFound(String),
    #[error("the model `{0}` does not exist here: GET /v1/models lists the models served")]
    ModelNotFound(String),
    #[error("missing or wrong admin key")]
    Unauthorized,
    /// A client key missing or unknown, where clients are configured.
    #[error("{0}")]
    NoClientKey(String),
    /// A client over its rate limit: retry after this many seconds (none: never, as asked).
    #[error("{message}")]
    RateLimited {
        message: String,
        retry_after_s: Option<u64>,
    },
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Conflict(String),
    #[error(transparent)]
    Route(#[from] RouteError),
    #[error("upstream {endpoint} failed: {message}")]
    Upstream { endpoint: String, message: String },
    #[error("upstream {endpoint} sent no response within {after_ms} ms")]
    UpstreamTimeout { endpoint: String, after_ms: u64 },
    #[error("{0}")]
    Unavailable(String),
    /// Flow control refused or gave up on the request: the pool is saturated (503 with `Retry-After: 1`).
    #[error("{0}")]
    Overloaded(String),
    /// A route the gateway serves, but not for this fleet (501).
    #[error("{0}")]
    NotImplemented(String),
}

impl From<PromptError> for ApiError {
    fn from(e: PromptError) -> Self {
        ApiError::BadRequest(e.to_string())
    }
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UriTooLong(_) => StatusCode::URI_TOO_LONG,
            ApiError::HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::NotFound(_) | ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unauthorized | ApiError::NoClientKey(_) => StatusCode::UNAUTHORIZED,
            ApiError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Route(e) if e.is_client_error() => StatusCode::BAD_REQUEST,
            ApiError::Route(_) | ApiError::Unavailable(_) | ApiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Upstream { .. } => StatusCode::BAD_GATEWAY,
            ApiError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ApiError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
        }
    }

    fn kind(&self) -> &'static str {
        match self.status() {
            StatusCode::BAD_REQUEST
            | StatusCode::REQUEST_TIMEOUT
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::UNSUPPORTED_MEDIA_TYPE
            | StatusCode::METHOD_NOT_ALLOWED
            | StatusCode::URI_TOO_LONG
            | StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => "invalid_request_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::CONFLICT => "conflict_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT => "upstream_error",
            StatusCode::NOT_IMPLEMENTED => "not_implemented_error",
            _ => "service_unavailable_error",
        }
    }

    /// The seconds a client should wait before it tries again (`Retry-After`), when the error says.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            ApiError::RateLimited { retry_after_s, .. } => *retry_after_s,
            ApiError::Overloaded(_) => Some(1),
            _ => None,
        }
    }

    /// The JSON body for this error.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.to_string(), "type": self.kind(), "code": self.status().as_u16()}})
    }
}

/// A gateway error's body, kept in its response's extensions so that the ids of its request and trace are added
/// as it leaves ([`identified`]).
#[derive(Debug, Clone)]
pub struct ErrorBody(serde_json::Value);

/// `request_id` and `trace_id` (when there are) into an error body's `error` object.
pub fn add_ids(body: &mut serde_json::Value, request_id: Option<&str>, trace_id: Option<&str>) {
    if let Some(error) = body.get_mut("error").and_then(serde_json::Value::as_object_mut) {
        if let Some(id) = request_id {
            error.insert("request_id".into(), id.into());
        }
        if let Some(id) = trace_id {
            error.insert("trace_id".into(), id.into());
        }
    }
}

/// `response` with `request_id` and `trace_id` (when there are) in its `error` object, in the route's `shape`, when
/// it is one of the gateway's own errors; any other response as it is.
pub fn identified(
    mut response: Response,
    (request_id, trace_id): (Option<&str>, Option<&str>),
    shape: crate::common::error_shape::ErrorShape,
) -> Response {
    let Some(ErrorBody(mut body)) = response.extensions_mut().remove::<ErrorBody>() else {
        return response;
    };
    add_ids(&mut body, request_id, trace_id);
    let body = shape.reshape(body);
    let Ok(bytes) = serde_json::to_vec(&body) else {
        return response;
    };
    response.headers_mut().remove(axum::http::header::CONTENT_LENGTH);
    *response.body_mut() = axum::body::Body::from(bytes);
    response
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        let mut response = (self.status(), Json(&body)).into_response();
        response.extensions_mut().insert(ErrorBody(body));
        if let Some(after) = self.retry_after() {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from(after));
        }
        if matches!(self, ApiError::TooLarge { .. }) {
            // The rest of a refused body may still be on its way: the connection is not reused.
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_bodies() {
        let cases = [
            (ApiError::BadRequest("x".into()), 400, "invalid_request_error"),
            (ApiError::TooLarge { limit: 10 }, 413, "invalid_request_error"),
            (ApiError::BodyTimeout { after_ms: 10 }, 408, "invalid_request_error"),
            (
                ApiError::UnsupportedMediaType("text/plain".into()),
                415,
                "invalid_request_error",
            ),
            (ApiError::NotFound("x".into()), 404, "not_found_error"),
            (ApiError::ModelNotFound("x".into()), 404, "not_found_error"),
            (ApiError::Unauthorized, 401, "authentication_error"),
            (ApiError::NoClientKey("x".into()), 401, "authentication_error"),
            (
                ApiError::RateLimited {
                    message: "x".into(),
                    retry_after_s: Some(2),
                },
                429,
                "rate_limit_error",
            ),
            (ApiError::Forbidden("x".into()), 403, "permission_error"),
            (ApiError::Conflict("x".into()), 409, "conflict_error"),
            (
                RouteError::OverrideOutOfRange { rank: 9, size: 4 }.into(),
                400,
                "invalid_request_error",
            ),
            (RouteError::NoHealthyEndpoint.into(), 503, "service_unavailable_error"),
            (
                ApiError::Upstream {
                    endpoint: "w0r1".into(),
                    message: "reset".into(),
                },
                502,
                "upstream_error",
            ),
        ];
        for (err, status, kind) in cases {
            assert_eq!(err.status().as_u16(), status, "{err}");
            let body = err.body();
            assert_eq!(
                (body["error"]["code"].as_u64(), body["error"]["type"].as_str()),
                (Some(u64::from(status)), Some(kind))
            );
            assert_eq!(body["error"]["message"], err.to_string());
        }
    }

    #[tokio::test]
    async fn the_ids_go_into_the_gateways_own_error_bodies_only() {
        use http_body_util::BodyExt;
        let read = |r: Response| async move {
            let bytes = r.into_body().collect().await.unwrap().to_bytes();
            serde_json::from_slice::<serde_json::Value>(&bytes).unwrap()
        };
        let openai = crate::common::error_shape::ErrorShape::OpenAi;
        let ours = identified(
            ApiError::NotFound("x".into()).into_response(),
            (Some("r1"), Some("t1")),
            openai,
        );
        let body = read(ours).await;
        assert_eq!(
            (body["error"]["request_id"].as_str(), body["error"]["trace_id"].as_str()),
            (Some("r1"), Some("t1"))
        );
        assert_eq!(body["error"]["code"], 404);
        let untraced = read(identified(
            ApiError::Unauthorized.into_response(),
            (Some("r2"), None),
            openai,
        ))
        .await;
        assert_eq!(untraced["error"]["request_id"], "r2");
        assert!(untraced["error"].get("trace_id").is_none());
        // An engine's answer is not the gateway's to change.
        let engine = (StatusCode::BAD_REQUEST, Json(json!({"error": {"message": "engine"}}))).into_response();
        let body = read(identified(engine, (Some("r3"), Some("t3")), openai)).await;
        assert!(body["error"].get("request_id").is_none());
        // On the Messages routes, in Anthropic's shape, ids and all.
        let anthropic = crate::common::error_shape::ErrorShape::Anthropic;
        let ours = read(identified(
            ApiError::Unauthorized.into_response(),
            (Some("r4"), None),
            anthropic,
        ))
        .await;
        assert_eq!(ours["type"], "error");
        assert_eq!(ours["error"]["type"], "authentication_error");
        assert_eq!(ours["request_id"], "r4");
    }
}
