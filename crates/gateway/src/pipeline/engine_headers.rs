//! The one rule for which of a client's request headers an engine gets, whoever carries the request: `serve`
//! (which builds the engine's request with them), `dprouter epp` (which tells Envoy to remove the others), the
//! decode sidecar and the gateway's own requests for a client (stored Responses, `/v1/models`). An allow-list:
//! an engine gets what it reads, and a client's secrets and routing hints go nowhere.
//!
//! | header | fate |
//! |---|---|
//! | `accept`, `user-agent`, `x-request-id`, `anthropic-version`, `anthropic-beta` | passed as they came ([`PASSED`]) |
//! | `content-type` | `application/json` (a body must be JSON: anything else is a 415 first) |
//! | `traceparent`, `tracestate`, `baggage` | the trace context ([`crate::observe::trace_context`]): the gateway's span as the parent when tracing is on |
//! | `authorization` | the worker's own key; without one, the client's, unless clients are configured: a client's key never reaches an engine ([`authorization`]) |
//! | `x-data-parallel-rank` | the gateway's rank, never the client's |
//! | `x-api-key`, `cookie`, `proxy-authorization`, session headers (`x-session-id`, …), `x-gateway-*`, `x-prefiller-*`, `accept-encoding`, anything else | not passed |
//!
//! Headers a data plane adds itself (`x-forwarded-*`, `x-envoy-*`) are its own business, not the client's.

use axum::http::{header, HeaderMap, HeaderName, HeaderValue};

use crate::fleet::registry::Target;

/// The client's headers an engine gets as they came.
pub static PASSED: [HeaderName; 5] = [
    header::ACCEPT,
    header::USER_AGENT,
    HeaderName::from_static(crate::common::names::REQUEST_ID),
    HeaderName::from_static("anthropic-version"),
    HeaderName::from_static("anthropic-beta"),
];

/// The trace context's headers (their values are the trace context's rule).
const TRACE: [&str; 3] = ["traceparent", "tracestate", "baggage"];

/// Whether an engine may get the client's header `name` (lower case) in some form: as it came ([`PASSED`]), or
/// under its own rule (`content-type`, the trace context, `authorization`).
pub fn reaches_engine(name: &str) -> bool {
    PASSED.iter().any(|p| p == name) || TRACE.contains(&name) || name == "content-type" || name == "authorization"
}

/// Whether `name` is a data plane's own header rather than the client's (`x-forwarded-for`, `x-envoy-…`).
pub fn data_planes(name: &str) -> bool {
    name.starts_with("x-forwarded-") || name.starts_with("x-envoy-")
}

/// The client's headers an engine gets as they came, with their values.
pub fn passed(client: &HeaderMap) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    PASSED.iter().filter_map(|name| Some((name, client.get(name)?)))
}

/// The `Authorization` a worker gets: its own key's, when it has one; else the client's as it came, unless the
/// client was keyed (`keyed`: clients are configured, and a client's key never reaches an engine).
pub fn authorization<'a>(keyed: bool, target: &'a Target, client: &'a HeaderMap) -> Option<&'a HeaderValue> {
    match &target.auth {
        Some(own) => Some(own),
        None if keyed => None,
        None => client.get(header::AUTHORIZATION),
    }
}

/// The one builder of an engine request, for `serve`'s attempts (aggregated, and both legs of a pair) and the
/// decode sidecar's legs: the client's headers by the rule above, the trace context (`traceparent`: the attempt's
/// span when tracing is on, else the client's), then what the front end decided: the content type, the engine's
/// key, the rank header.
pub(crate) struct EngineRequest<'a> {
    pub method: axum::http::Method,
    pub url: String,
    /// The client's request headers.
    pub client: &'a HeaderMap,
    pub traceparent: Option<HeaderValue>,
    pub content_type: Option<HeaderValue>,
    pub authorization: Option<HeaderValue>,
    pub rank: Option<(HeaderName, HeaderValue)>,
}

impl EngineRequest<'_> {
    /// The request, its body made of `pieces` (slices of the client's bytes, not a copy).
    pub(crate) fn build(
        self,
        pieces: Vec<bytes::Bytes>,
    ) -> Result<hyper::Request<crate::fleet::upstream::Chunks>, crate::common::error::ApiError> {
        let mut builder = hyper::Request::builder().method(self.method).uri(self.url);
        for (name, value) in passed(self.client) {
            builder = builder.header(name, value);
        }
        for (name, value) in crate::observe::trace_context::propagated(self.client, self.traceparent) {
            builder = builder.header(name, value);
        }
        if let Some(value) = self.content_type {
            builder = builder.header(header::CONTENT_TYPE, value);
        }
        if let Some(auth) = self.authorization {
            builder = builder.header(header::AUTHORIZATION, auth);
        }
        if let Some((name, value)) = self.rank {
            builder = builder.header(name, value);
        }
        builder
            .body(crate::fleet::upstream::Chunks::new(pieces))
            .map_err(|e| crate::common::error::ApiError::BadRequest(format!("cannot build the upstream request: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_gets_what_it_reads_and_no_secret_or_hint() {
        for name in [
            "accept",
            "user-agent",
            "x-request-id",
            "anthropic-version",
            "anthropic-beta",
            "content-type",
            "traceparent",
            "tracestate",
            "baggage",
            "authorization",
        ] {
            assert!(reaches_engine(name), "{name}");
        }
        for name in [
            "x-api-key",
            "cookie",
            "proxy-authorization",
            "x-session-id",
            "x-claude-code-session-id",
            "x-gateway-inference-objective",
            "x-prefiller-host-port",
            "accept-encoding",
            "x-custom",
        ] {
            assert!(!reaches_engine(name), "{name}");
        }
        let mut client = HeaderMap::new();
        client.insert("accept", "*/*".parse().unwrap());
        client.insert("cookie", "a=b".parse().unwrap());
        let names: Vec<&str> = passed(&client).map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["accept"]);
    }
}
