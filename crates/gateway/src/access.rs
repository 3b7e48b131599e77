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
//! `status`, `duration_ms`, `request_id`, and for proxied requests `model`, `endpoint`, `branch`, `ttft_ms`,
//! `prompt_tokens`, `cached_tokens`, `predicted_cached_tokens` (absent when unknown).

use std::pin::Pin;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use hyper::body::{Frame, SizeHint};

use crate::telemetry::{DURATION, REQUESTS};

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
    /// The endpoint, the routing branch and the request's `model`.
    routed: OnceLock<(String, &'static str, Option<String>)>,
}

const UNKNOWN: u64 = u64::MAX;

impl Exchange {
    pub fn new() -> Self {
        let state = ExchangeState {
            ttft_us: AtomicU64::new(UNKNOWN),
            prompt_tokens: AtomicU64::new(UNKNOWN),
            cached_tokens: AtomicU64::new(UNKNOWN),
            predicted_cached_tokens: AtomicU64::new(UNKNOWN),
            ..ExchangeState::default()
        };
        Self(Arc::new(state))
    }

    /// Where the request went.
    pub fn routed(&self, endpoint: String, branch: &'static str, model: Option<String>) {
        let _ = self.0.routed.set((endpoint, branch, model));
    }

    /// The answer broke or stalled after its head: it ends as `status`.
    pub fn failed(&self, status: u16) {
        self.0.status.store(status, Relaxed);
    }

    pub fn first_byte(&self, after: std::time::Duration) {
        self.0.ttft_us.store(after.as_micros() as u64, Relaxed);
    }

    pub fn usage(&self, prompt_tokens: u64, cached_tokens: u64) {
        self.0.prompt_tokens.store(prompt_tokens, Relaxed);
        self.0.cached_tokens.store(cached_tokens, Relaxed);
    }

    /// The cached tokens the policy predicted for the request.
    pub fn predicted(&self, cached_tokens: u64) {
        self.0.predicted_cached_tokens.store(cached_tokens, Relaxed);
    }

    fn status(&self) -> Option<u16> {
        Some(self.0.status.load(Relaxed)).filter(|&s| s != 0)
    }
}

/// What the metrics and the access log say of a request besides the exchange, taken when it arrives.
pub struct Request {
    route: String,
    started: Instant,
    /// Method, path and request id, kept only when the access log is on.
    logged: Option<(String, String, String)>,
}

impl Request {
    /// `request`, arrived at `started`, matched to `route` (the metrics label); with `access_log`, what its line
    /// needs.
    pub fn of(request: &axum::extract::Request, route: String, started: Instant, access_log: bool) -> Self {
        let logged = access_log.then(|| {
            let id = request
                .headers()
                .get(crate::names::REQUEST_ID)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            (
                request.method().to_string(),
                request.uri().path().to_string(),
                id.to_string(),
            )
        });
        Self { route, started, logged }
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
        let Some((method, path, request_id)) = &self.request.logged else {
            return;
        };
        let known = |v: &AtomicU64| Some(v.load(Relaxed)).filter(|&v| v != UNKNOWN);
        let state = self.exchange.as_ref().map(|e| &*e.0);
        let routed = state.and_then(|s| s.routed.get());
        tracing::info!(
            target: "dprouter::access",
            method = %method,
            path = %path,
            status,
            duration_ms = duration.as_secs_f64() * 1e3,
            request_id = %request_id,
            model = routed.and_then(|r| r.2.as_deref()),
            endpoint = routed.map(|r| r.0.as_str()),
            branch = routed.map(|r| r.1),
            ttft_ms = state.and_then(|s| known(&s.ttft_us)).map(|us| us as f64 / 1e3),
            prompt_tokens = state.and_then(|s| known(&s.prompt_tokens)),
            cached_tokens = state.and_then(|s| known(&s.cached_tokens)),
            predicted_cached_tokens = state.and_then(|s| known(&s.predicted_cached_tokens)),
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
