//! The gateway's trace spans, made with `tracing` under [`dprouter_otel::SPAN_TARGET`] and recorded only when
//! tracing is on (`dprouter_otel::Tracing`'s layer; otherwise each is a disabled span, and costs a cached check).
//!
//! - `request` (kind server), one per proxied request, from its arrival to the end of its answer; a child of the
//!   client's `traceparent` when it sent a valid one. When the answer ends it gets what the access log line says
//!   of the request: model, policy, endpoint and rank, branch, predicted and reported cached tokens, prompt and
//!   output tokens, retries, status and time to the first byte.
//! - `upstream` (kind client), one per attempt to reach an engine, a child of `request`; the engine gets it as its
//!   `traceparent`, so that the engine's own spans (vLLM's `--otlp-traces-endpoint`, SGLang's) nest under the
//!   routing decision.
//!
//! Attribute names follow OpenTelemetry's HTTP and GenAI conventions where they have one (`http.request.method`,
//! `http.route`, `http.response.status_code`, `gen_ai.request.model`, `gen_ai.usage.input_tokens`,
//! `gen_ai.usage.output_tokens`), and are `dprouter.*` otherwise.

use axum::http::{HeaderMap, HeaderValue};
use dprouter_otel::SPAN_TARGET;
use opentelemetry::trace::{SpanContext, SpanId, Status, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::KeyValue;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::observe::trace_context;

/// A proxied request's span (see the module documentation); cheap to clone.
#[derive(Debug, Clone)]
pub struct RequestSpan(tracing::Span);

/// One attempt's span.
#[derive(Debug, Clone)]
pub struct AttemptSpan(tracing::Span);

impl RequestSpan {
    /// The span of a `method` request to `route` (the router's pattern) with `headers`.
    pub fn start(method: &str, route: &str, headers: &HeaderMap) -> Self {
        let span = tracing::info_span!(
            target: SPAN_TARGET,
            parent: None,
            "request",
            otel.name = %format_args!("{method} {route}"),
            otel.kind = "server",
        );
        if span.is_disabled() {
            return Self(span);
        }
        if let Some(parent) = remote_parent(headers) {
            let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
        }
        span.set_attribute("http.request.method", method.to_string());
        span.set_attribute("http.route", route.to_string());
        if let Some(id) = headers
            .get(crate::common::names::REQUEST_ID)
            .and_then(|v| v.to_str().ok())
        {
            span.set_attribute("dprouter.request_id", id.to_string());
        }
        Self(span)
    }

    /// A span that records nothing.
    pub fn none() -> Self {
        Self(tracing::Span::none())
    }

    /// Whether tracing is on (the span is recorded, if its trace is sampled).
    pub fn is_recording(&self) -> bool {
        !self.0.is_disabled()
    }

    /// The trace id (32 hex digits) when tracing is on.
    pub fn trace_id(&self) -> Option<String> {
        if self.0.is_disabled() {
            return None;
        }
        let cx = self.0.context();
        let id = cx.span().span_context().trace_id();
        (id != TraceId::INVALID).then(|| id.to_string())
    }

    /// A `traceparent` naming this span, for the engine when the gateway does not make the attempt itself (the
    /// Endpoint Picker); `None` when tracing is off.
    pub fn traceparent(&self) -> Option<HeaderValue> {
        traceparent_of(&self.0)
    }

    /// The request ended without an answer (the stream broke, a deadline passed): `why`, as an error status.
    pub fn failed(&self, why: &str) {
        if !self.0.is_disabled() {
            self.0.set_status(Status::error(why.to_string()));
        }
    }

    /// The span of attempt `attempt` (1 for the first) to `endpoint`, rank `rank` of its worker.
    pub fn attempt(&self, endpoint: &str, rank: u32, attempt: u32) -> AttemptSpan {
        let span = tracing::info_span!(
            target: SPAN_TARGET,
            parent: &self.0,
            "upstream",
            otel.name = "upstream",
            otel.kind = "client",
        );
        if !span.is_disabled() {
            span.set_attribute("dprouter.endpoint", endpoint.to_string());
            span.set_attribute("dprouter.rank", i64::from(rank));
            span.set_attribute("dprouter.attempt", i64::from(attempt));
        }
        AttemptSpan(span)
    }

    /// The request ended with `status` (when it got an answer); `attributes` are what the answer taught (the
    /// access log's fields).
    pub fn finish(&self, status: Option<u16>, attributes: Vec<KeyValue>) {
        if self.0.is_disabled() {
            return;
        }
        for kv in attributes {
            self.0.set_attribute(kv.key, kv.value);
        }
        if let Some(status) = status {
            self.0.set_attribute("http.response.status_code", i64::from(status));
            if status >= 500 {
                self.0.set_status(Status::error(format!("status {status}")));
            }
        }
    }
}

impl AttemptSpan {
    /// The `traceparent` the engine gets: this span as its parent; `None` when tracing is off.
    pub fn traceparent(&self) -> Option<HeaderValue> {
        traceparent_of(&self.0)
    }

    /// The engine answered with `status`.
    pub fn answered(&self, status: u16) {
        self.0.set_attribute("http.response.status_code", i64::from(status));
        if status >= 500 {
            self.0.set_status(Status::error(format!("status {status}")));
        }
    }

    /// The attempt failed before an answer: `why`.
    pub fn failed(&self, why: &str) {
        self.0.set_status(Status::error(why.to_string()));
    }
}

/// A `traceparent` naming `span` (W3C version `00`), when it is recorded.
fn traceparent_of(span: &tracing::Span) -> Option<HeaderValue> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    if !sc.is_valid() {
        return None;
    }
    let value = format!("00-{}-{}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8());
    HeaderValue::from_str(&value).ok()
}

/// The client's span context, from a valid `traceparent` (and its `tracestate`).
fn remote_parent(headers: &HeaderMap) -> Option<SpanContext> {
    let value = trace_context::single(headers, &trace_context::TRACEPARENT).and_then(trace_context::traceparent)?;
    let value = value.to_str().ok()?;
    // `00-{trace id}-{parent id}-{flags}`, checked by `traceparent`.
    let trace_id = TraceId::from_hex(value.get(3..35)?).ok()?;
    let span_id = SpanId::from_hex(value.get(36..52)?).ok()?;
    let flags = u8::from_str_radix(value.get(53..55)?, 16).ok()?;
    let state = trace_context::tracestate(headers)
        .and_then(|v| v.to_str().ok().and_then(|s| s.parse::<TraceState>().ok()))
        .unwrap_or_default();
    Some(SpanContext::new(trace_id, span_id, TraceFlags::new(flags), true, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clients_context_is_read_from_a_valid_traceparent_only() {
        let mut headers = HeaderMap::new();
        headers.insert(
            trace_context::TRACEPARENT,
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        headers.insert(
            trace_context::TRACESTATE,
            HeaderValue::from_static("rojo=00f067aa0ba902b7"),
        );
        let parent = remote_parent(&headers).unwrap();
        assert_eq!(parent.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(parent.span_id().to_string(), "00f067aa0ba902b7");
        assert!(parent.is_sampled() && parent.is_remote());
        assert_eq!(parent.trace_state().get("rojo"), Some("00f067aa0ba902b7"));
        headers.insert(trace_context::TRACEPARENT, HeaderValue::from_static("00-abc"));
        assert!(remote_parent(&headers).is_none());
    }

    #[test]
    fn without_tracing_on_spans_are_disabled_and_say_nothing() {
        let span = RequestSpan::start("POST", "/v1/chat/completions", &HeaderMap::new());
        assert_eq!(span.trace_id(), None);
        assert_eq!(span.attempt("0:0", 0, 1).traceparent(), None);
    }
}
