//! What each answered request was, recorded when its answer ends: `dprouter_requests_total` and
//! `dprouter_request_duration_seconds`, and, when `[server] access_log` is on, one structured log line.
//!
//! The status recorded is the response's, or what a stream that broke or stalled after its head ended as (502,
//! 504), or 499 for a client that closed before the end (nginx's number for it); the duration runs from the
//! request's arrival to the end of the body. The proxy puts an [`Exchange`] in the response's extensions and the
//! response body fills it in as the answer passes (first byte, usage report, failure); [`Counted`] wraps every
//! response body and reads it at the end.
//!
//! The access log line goes to the `dprouter::access` log target at `info`, with the fields `method`, `path`,
//! `status`, `duration_ms`, `request_id`, `trace_id` (when tracing is on), and for proxied requests `model`,
//! `policy`, `endpoint`, `rank`, `branch`, `retries`, `ttft_ms`, `prompt_tokens`, `cached_tokens`,
//! `predicted_cached_tokens`, `output_tokens` (absent when unknown). With tracing on, the request's span
//! ([`crate::observe::spans`]) ends here too, with the same facts as attributes.

use std::pin::Pin;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use hyper::body::{Frame, SizeHint};

use crate::observe::telemetry::{DURATION, REQUESTS};

/// A client that closed the connection before the end of the response (nginx's number for it).
pub const CLIENT_CLOSED: u16 = 499;

/// What the proxy and the response body learn about one exchange with an engine.
#[derive(Debug, Clone, Default)]
pub struct Exchange(Arc<ExchangeState>);

#[derive(Debug, Default)]
struct ExchangeState {
    /// The status the answer really ended with, when not its head's (0: the head's).
    status: AtomicU16,
    /// Microseconds from the request's arrival to the first byte of the body; `u64::MAX` before it.
    ttft_us: AtomicU64,
    /// The engine's usage report, `u64::MAX` before it.
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    /// The cached tokens the policy predicted, `u64::MAX` if it did not.
    predicted_cached_tokens: AtomicU64,
    /// Tokens generated, as the engine reported them, `u64::MAX` before (or without) a report.
    output_tokens: AtomicU64,
    routed: OnceLock<Routing>,
    /// The attempt that answered, ended when the exchange is dropped (with the answer).
    attempt: OnceLock<crate::observe::spans::AttemptSpan>,
}

/// Where a request went and how it was chosen.
#[derive(Debug, Clone)]
pub struct Routing {
    pub endpoint: String,
    /// The rank within its worker.
    pub rank: u32,
    pub policy: &'static str,
    pub branch: &'static str,
    /// The request's `model` (as served).
    pub model: Option<String>,
    /// Attempts before the one that answered.
    pub retries: u32,
}

const UNKNOWN: u64 = u64::MAX;

impl Exchange {
    pub fn new() -> Self {
        let state = ExchangeState {
            ttft_us: AtomicU64::new(UNKNOWN),
            prompt_tokens: AtomicU64::new(UNKNOWN),
            cached_tokens: AtomicU64::new(UNKNOWN),
            predicted_cached_tokens: AtomicU64::new(UNKNOWN),
            output_tokens: AtomicU64::new(UNKNOWN),
            ..ExchangeState::default()
        };
        Self(Arc::new(state))
    }

    /// Where the request went.
    pub fn routed(&self, mut routing: Routing) {
        // The model is the client's string: spans and the access log keep a bounded copy.
        if let Some(model) = routing.model.as_mut() {
            if let std::borrow::Cow::Owned(clipped) = crate::observe::refusals::clip_client("model", model) {
                *model = clipped;
            }
        }
        let _ = self.0.routed.set(routing);
    }

    /// The attempt that answered: its span lasts as long as the answer.
    pub fn answered_by(&self, attempt: crate::observe::spans::AttemptSpan) {
        let _ = self.0.attempt.set(attempt);
    }

    /// The answer broke or stalled after its head: it ends as `status`.
    pub fn failed(&self, status: u16) {
        self.0.status.store(status, Relaxed);
    }

    pub fn first_byte(&self, after: std::time::Duration) {
        self.0.ttft_us.store(after.as_micros() as u64, Relaxed);
    }

    /// The engine's usage report, and the tokens it generated when the report says.
    pub fn usage(&self, usage: &dprouter_core::Usage, output_tokens: Option<u64>) {
        self.0.prompt_tokens.store(usage.prompt_tokens, Relaxed);
        self.0.cached_tokens.store(usage.cached_tokens, Relaxed);
        if let Some(out) = output_tokens {
            self.0.output_tokens.store(out, Relaxed);
        }
    }

    /// The cached tokens the policy predicted for the request.
    pub fn predicted(&self, cached_tokens: u64) {
        self.0.predicted_cached_tokens.store(cached_tokens, Relaxed);
    }

    fn status(&self) -> Option<u16> {
        Some(self.0.status.load(Relaxed)).filter(|&s| s != 0)
    }

    /// What the exchange has learned so far.
    pub fn facts(&self) -> Facts<'_> {
        let known = |v: &AtomicU64| Some(v.load(Relaxed)).filter(|&v| v != UNKNOWN);
        let state = &*self.0;
        Facts {
            routed: state.routed.get(),
            ttft_ms: known(&state.ttft_us).map(|us| us as f64 / 1e3),
            prompt_tokens: known(&state.prompt_tokens),
            cached_tokens: known(&state.cached_tokens),
            predicted_cached_tokens: known(&state.predicted_cached_tokens),
            output_tokens: known(&state.output_tokens),
        }
    }
}

/// What an exchange taught: the access log's fields, and the request span's attributes.
#[derive(Debug, Default, Clone, Copy)]
pub struct Facts<'a> {
    pub routed: Option<&'a Routing>,
    pub ttft_ms: Option<f64>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub predicted_cached_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
}

impl Facts<'_> {
    /// As trace span attributes ([`crate::observe::spans`]).
    pub fn span_attributes(&self) -> Vec<opentelemetry::KeyValue> {
        use opentelemetry::{KeyValue, Value};
        let int = |v: u64| Value::I64(v.min(i64::MAX as u64) as i64);
        let mut out = Vec::with_capacity(12);
        if let Some(r) = self.routed {
            if let Some(model) = &r.model {
                out.push(KeyValue::new("gen_ai.request.model", model.clone()));
            }
            out.push(KeyValue::new("dprouter.policy", r.policy));
            out.push(KeyValue::new("dprouter.endpoint", r.endpoint.clone()));
            out.push(KeyValue::new("dprouter.rank", int(u64::from(r.rank))));
            out.push(KeyValue::new("dprouter.branch", r.branch));
            out.push(KeyValue::new("dprouter.retries", int(u64::from(r.retries))));
        }
        let numbers = [
            ("gen_ai.usage.input_tokens", self.prompt_tokens),
            ("dprouter.cached_tokens", self.cached_tokens),
            ("dprouter.predicted_cached_tokens", self.predicted_cached_tokens),
            ("gen_ai.usage.output_tokens", self.output_tokens),
        ];
        out.extend(numbers.into_iter().filter_map(|(k, v)| Some(KeyValue::new(k, int(v?)))));
        if let Some(ms) = self.ttft_ms {
            out.push(KeyValue::new("dprouter.ttft_ms", ms));
        }
        out
    }
}

/// What the metrics, the access log and the trace say of a request besides the exchange, taken when it arrives.
pub struct Request {
    route: String,
    started: Instant,
    /// Method, path and request id, kept only when the access log is on.
    logged: Option<(String, String, String)>,
    span: crate::observe::spans::RequestSpan,
}

impl Request {
    /// `request`, arrived at `started`, matched to `route` (the metrics label), traced in `span`; with
    /// `access_log`, what its line needs.
    pub fn of(
        request: &axum::extract::Request,
        route: String,
        started: Instant,
        access_log: bool,
        span: crate::observe::spans::RequestSpan,
    ) -> Self {
        let logged = access_log.then(|| {
            let id = request
                .headers()
                .get(crate::common::names::REQUEST_ID)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            (
                request.method().to_string(),
                request.uri().path().to_string(),
                id.to_string(),
            )
        });
        Self {
            route,
            started,
            logged,
            span,
        }
    }
}

/// A response body that records the request when it ends (see the module documentation).
pub struct Counted {
    inner: Body,
    request: Request,
    status: u16,
    exchange: Option<Exchange>,
    recorded: bool,
}

impl Counted {
    /// `response` to `request`, with its body counted.
    pub fn wrap(response: Response, request: Request) -> Response {
        let exchange = response.extensions().get::<Exchange>().cloned();
        let status = response.status().as_u16();
        let (parts, inner) = response.into_parts();
        let body = Counted {
            inner,
            request,
            status,
            exchange,
            recorded: false,
        };
        Response::from_parts(parts, Body::new(body))
    }

    fn record(&mut self, status: u16) {
        if std::mem::replace(&mut self.recorded, true) {
            return;
        }
        let status = self.exchange.as_ref().and_then(Exchange::status).unwrap_or(status);
        let duration = self.request.started.elapsed();
        metrics::counter!(REQUESTS, "route" => self.request.route.clone(), "status" => status.to_string()).increment(1);
        metrics::histogram!(DURATION, "route" => self.request.route.clone()).record(duration.as_secs_f64());
        let span = &self.request.span;
        if !span.is_recording() && self.request.logged.is_none() {
            return;
        }
        let facts = self.exchange.as_ref().map(Exchange::facts).unwrap_or_default();
        if span.is_recording() {
            span.finish(Some(status), facts.span_attributes());
        }
        let Some((method, path, request_id)) = &self.request.logged else {
            return;
        };
        tracing::info!(
            target: "dprouter::access",
            method = %method,
            path = %path,
            status,
            duration_ms = duration.as_secs_f64() * 1e3,
            request_id = %request_id,
            trace_id = span.trace_id().as_deref(),
            model = facts.routed.and_then(|r| r.model.as_deref()),
            policy = facts.routed.map(|r| r.policy),
            endpoint = facts.routed.map(|r| r.endpoint.as_str()),
            rank = facts.routed.map(|r| r.rank),
            branch = facts.routed.map(|r| r.branch),
            retries = facts.routed.map(|r| r.retries),
            ttft_ms = facts.ttft_ms,
            prompt_tokens = facts.prompt_tokens,
            cached_tokens = facts.cached_tokens,
            predicted_cached_tokens = facts.predicted_cached_tokens,
            output_tokens = facts.output_tokens,
        );
    }
}

impl hyper::body::Body for Counted {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.record(this.status),
            Poll::Ready(Some(Err(_))) => this.record(502),
            // A body of known length ends without a final poll.
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.record(this.status),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let status = if hyper::body::Body::is_end_stream(&self.inner) {
            self.status
        } else {
            CLIENT_CLOSED
        };
        self.record(status);
    }
}
