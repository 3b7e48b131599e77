//! Prometheus metrics: names, the process-wide recorder, and the per-scrape gauges.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `dprouter_requests_total` | counter | `route`, `status` (the response's; 502 or 504 for a stream that broke or stalled after its head, 499 for a client that closed first) |
//! | `dprouter_routing_decisions_total` | counter | `policy`, `branch` |
//! | `dprouter_upstream_errors_total` | counter | `endpoint`, `kind` (`connect`, `server`, `status_5xx`, `stream`, `timeout`) |
//! | `dprouter_retries_total` | counter | |
//! | `dprouter_endpoint_in_flight_requests` | gauge | `endpoint` |
//! | `dprouter_endpoint_healthy` | gauge | `endpoint` |
//! | `dprouter_ttft_seconds` | histogram | `endpoint` (streaming responses: request received to first byte) |
//! | `dprouter_request_duration_seconds` | histogram | `route` (request received to the end of the response body) |
//! | `dprouter_prompt_tokens_total`, `dprouter_cached_tokens_total` | counter | `endpoint` (from engine usage reports; their ratio is the observed cache hit rate) |

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::registry::Membership;

pub const REQUESTS: &str = "dprouter_requests_total";
pub const DECISIONS: &str = "dprouter_routing_decisions_total";
pub const UPSTREAM_ERRORS: &str = "dprouter_upstream_errors_total";
pub const RETRIES: &str = "dprouter_retries_total";
pub const IN_FLIGHT: &str = "dprouter_endpoint_in_flight_requests";
pub const HEALTHY: &str = "dprouter_endpoint_healthy";
pub const TTFT: &str = "dprouter_ttft_seconds";
pub const DURATION: &str = "dprouter_request_duration_seconds";
pub const PROMPT_TOKENS: &str = "dprouter_prompt_tokens_total";
pub const CACHED_TOKENS: &str = "dprouter_cached_tokens_total";

/// Every metric the gateway exports (histograms by their base name). `deploy/grafana/dprouter.json` charts each one;
/// `tests/dashboard.rs` keeps the two in step.
pub const ALL: &[&str] = &[
    REQUESTS,
    DECISIONS,
    UPSTREAM_ERRORS,
    RETRIES,
    IN_FLIGHT,
    HEALTHY,
    TTFT,
    DURATION,
    PROMPT_TOKENS,
    CACHED_TOKENS,
];

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// The process-wide Prometheus recorder, installed on first use. `None` if another recorder was installed first.
pub fn handle() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .ok()?;
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            Some(handle)
        })
        .as_ref()
}

/// Sets the per-endpoint gauges from the current membership, then renders everything.
pub fn render(membership: &Membership) -> String {
    for (endpoint, target) in membership.snapshot.endpoints().iter().zip(&membership.targets) {
        let label = target.label();
        metrics::gauge!(IN_FLIGHT, "endpoint" => label.clone()).set(endpoint.load.in_flight_requests() as f64);
        metrics::gauge!(HEALTHY, "endpoint" => label).set(if endpoint.healthy { 1.0 } else { 0.0 });
    }
    handle().map(PrometheusHandle::render).unwrap_or_default()
}

/// How a relayed response really ended, when not as its status line said: the proxy puts one in the response's
/// extensions and its body sets it when the upstream breaks (502) or stalls (504) after the head was sent.
#[derive(Debug, Clone, Default)]
pub struct Outcome(std::sync::Arc<std::sync::atomic::AtomicU16>);

impl Outcome {
    pub fn set(&self, status: u16) {
        self.0.store(status, std::sync::atomic::Ordering::Relaxed);
    }

    fn get(&self) -> Option<u16> {
        Some(self.0.load(std::sync::atomic::Ordering::Relaxed)).filter(|&s| s != 0)
    }
}

/// A client that closed the connection before the end of the response (nginx's number for it).
pub const CLIENT_CLOSED: u16 = 499;

/// A response body that records `dprouter_requests_total` and `dprouter_request_duration_seconds` when it ends:
/// the status is the response's, or what a broken stream ended as ([`Outcome`]), or [`CLIENT_CLOSED`]; the
/// duration runs from the request's arrival to the end of the body.
pub struct Counted {
    inner: axum::body::Body,
    route: String,
    status: u16,
    outcome: Option<Outcome>,
    started: std::time::Instant,
    recorded: bool,
}

impl Counted {
    /// `response` with its body counted.
    pub fn wrap(
        response: axum::response::Response,
        route: String,
        started: std::time::Instant,
    ) -> axum::response::Response {
        let outcome = response.extensions().get::<Outcome>().cloned();
        let status = response.status().as_u16();
        let (parts, inner) = response.into_parts();
        let body = Counted {
            inner,
            route,
            status,
            outcome,
            started,
            recorded: false,
        };
        axum::response::Response::from_parts(parts, axum::body::Body::new(body))
    }

    fn record(&mut self, status: u16) {
        if std::mem::replace(&mut self.recorded, true) {
            return;
        }
        let status = self.outcome.as_ref().and_then(Outcome::get).unwrap_or(status);
        metrics::counter!(REQUESTS, "route" => self.route.clone(), "status" => status.to_string()).increment(1);
        metrics::histogram!(DURATION, "route" => std::mem::take(&mut self.route))
            .record(self.started.elapsed().as_secs_f64());
    }
}

impl hyper::body::Body for Counted {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(None) => this.record(this.status),
            std::task::Poll::Ready(Some(Err(_))) => this.record(502),
            // A body of known length ends without a final poll.
            std::task::Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.record(this.status),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
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
