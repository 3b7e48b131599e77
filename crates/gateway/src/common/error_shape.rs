//! The shape of the gateway's own errors on a route: OpenAI's `{"error": {"message", "type", "code"}}` everywhere
//! but on Anthropic's Messages routes (`/v1/messages`, `/v1/messages/count_tokens`), whose clients read
//! `{"type": "error", "error": {"type", "message"}}` and, mid-stream, an `event: error`. An engine's own errors
//! pass as the engine wrote them (SGLang and vLLM answer these routes in Anthropic's shape themselves).

use serde_json::{json, Value};

/// Which shape a route's errors take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorShape {
    #[default]
    OpenAi,
    Anthropic,
}

impl ErrorShape {
    /// The shape of the errors of `route` (a path, or the router's name for it).
    pub fn of_route(route: &str) -> Self {
        let path = route.split(['?', '#']).next().unwrap_or_default();
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            ErrorShape::Anthropic
        } else {
            ErrorShape::OpenAi
        }
    }

    /// Anthropic's error type for an answer of `status`.
    pub fn anthropic_type(status: u16) -> &'static str {
        match status {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        }
    }

    /// `body`, one of the gateway's error bodies in OpenAI's shape (its ids included), in this shape.
    pub fn reshape(self, body: Value) -> Value {
        match self {
            ErrorShape::OpenAi => body,
            ErrorShape::Anthropic => {
                let error = &body["error"];
                let status = error["code"]
                    .as_u64()
                    .and_then(|c| u16::try_from(c).ok())
                    .unwrap_or(500);
                let mut out = json!({
                    "type": "error",
                    "error": {"type": Self::anthropic_type(status), "message": error["message"]},
                });
                for id in ["request_id", "trace_id"] {
                    if let Some(value) = error.get(id) {
                        out[id] = value.clone();
                    }
                }
                out
            }
        }
    }

    /// The SSE event that ends a stream the gateway cuts (the engine broke or stalled, or the drain deadline
    /// passed): `data: {"error": …}` (OpenAI's clients raise on it), or Anthropic's `event: error`.
    pub fn stream_error(self, message: &str, openai_kind: &str, status: u16) -> String {
        match self {
            ErrorShape::OpenAi => {
                let event = json!({"error": {"message": message, "type": openai_kind, "code": status}});
                format!("data: {event}\n\n")
            }
            ErrorShape::Anthropic => {
                let event =
                    json!({"type": "error", "error": {"type": Self::anthropic_type(status), "message": message}});
                format!("event: error\ndata: {event}\n\n")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_messages_routes_answer_in_anthropics_shape() {
        assert_eq!(ErrorShape::of_route("/v1/messages"), ErrorShape::Anthropic);
        assert_eq!(
            ErrorShape::of_route("/v1/messages/count_tokens?beta=true"),
            ErrorShape::Anthropic
        );
        assert_eq!(ErrorShape::of_route("/v1/messagesx"), ErrorShape::OpenAi);
        assert_eq!(ErrorShape::of_route("/v1/chat/completions"), ErrorShape::OpenAi);
        let body =
            json!({"error": {"message": "no such model", "type": "not_found_error", "code": 404, "request_id": "r1"}});
        assert_eq!(
            ErrorShape::Anthropic.reshape(body.clone()),
            json!({"type": "error", "error": {"type": "not_found_error", "message": "no such model"}, "request_id": "r1"})
        );
        assert_eq!(ErrorShape::OpenAi.reshape(body.clone()), body);
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (503, "overloaded_error"),
            (504, "api_error"),
            (502, "api_error"),
        ] {
            assert_eq!(ErrorShape::anthropic_type(status), kind, "{status}");
        }
        let event = ErrorShape::Anthropic.stream_error("stalled", "upstream_error", 504);
        assert!(event.starts_with("event: error\ndata: {"), "{event}");
        let data: Value = serde_json::from_str(event.lines().nth(1).unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(data["error"]["type"], "api_error");
    }
}
