//! Prometheus metrics: names, the process-wide recorder, and the per-scrape gauges.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `dprouter_requests_total` | counter | `route`, `status` (counted when the answer ends: [`crate::observe::access`]) |
//! | `dprouter_routing_decisions_total` | counter | `policy`, `branch` |
//! | `dprouter_upstream_errors_total` | counter | `endpoint`, `kind` (`connect`, `server`, `status_5xx`, `stream`, `timeout`) |
//! | `dprouter_retries_total` | counter | |
//! | `dprouter_endpoint_in_flight_requests` | gauge | `endpoint` |
//! | `dprouter_endpoint_healthy` | gauge | `endpoint` |
//! | `dprouter_endpoint_sessions` | gauge | `endpoint` (the sessions active there: `cache_aware` keeps them home) |
//! | `dprouter_endpoint_prefill_tokens_per_second`, `dprouter_endpoint_prefill_base_seconds` | gauge | `endpoint` (its prefill costs as fitted from its requests, once there is a fit: `dprouter_core::cost_fit`) |
//! | `dprouter_ttft_seconds` | histogram | `endpoint` (streaming responses: request received to first byte) |
//! | `dprouter_request_duration_seconds` | histogram | `route` (request received to the end of the response body) |
//! | `dprouter_prompt_tokens_total`, `dprouter_cached_tokens_total` | counter | `endpoint` (from engine usage reports; their ratio is the observed cache hit rate) |
//! | `dprouter_cache_prediction_error_tokens` | histogram | `endpoint` (the policy's predicted cached tokens minus the engine's report, absolute) |
//! | `dprouter_kv_event_batches_total` | counter | `endpoint` (KV event batches applied) |
//! | `dprouter_kv_event_blocks` | gauge | `endpoint` (router blocks the endpoint holds, as its KV events tell) |
//! | `dprouter_kv_event_errors_total` | counter | `endpoint`, `kind` (`gap`, `restart`, `decode`, `orphan`, `overflow`, `replay`, `frames`) |
//! | `dprouter_tokenize_cut_total` | counter | (text and chat prompts tokenized only up to `tokenize_max_bytes`: their keys cover that head) |
//! | `dprouter_client_requests_total` | counter | `client` (`[[clients]]` name; `(none)` without a known key), `outcome` (`admitted`, `no_key`, `unknown_key`, `rate_limited`, `model_refused`, `tokens_limited`) |
//! | `dprouter_client_prompt_tokens_total` | counter | `client` (the prompt tokens of its admitted requests, as the gateway counts them) |
//! | `dprouter_endpoint_saturated` | gauge | `endpoint` (flow control on: 1 while saturated) |
//! | `dprouter_queue_requests`, `dprouter_queue_bytes` | gauge | `band` (flow control: requests and body bytes waiting, per priority) |
//! | `dprouter_queue_wait_seconds` | histogram | `band` (flow control: time queued, of the requests released) |
//! | `dprouter_queue_refusals_total` | counter | `reason` (`shed`, `queue_full`, `queue_bytes`, `timeout`, `client_gone`) |
//! | `dprouter_refused_input_total` | counter | `what` (an untrusted input dropped, clipped or refused: `client_field`, `client_string`, `prefill_target`, `kubernetes_answer`, `served_elsewhere`, `late_body`, `unkeyed_objective`, `prefill_leg_cut`; [`crate::observe::refusals`]) |
//! | `dprouter_trace_spans_exported_total` | counter | (tracing on: spans the collector accepted; `dprouter_otel::queue`) |
//! | `dprouter_trace_spans_dropped_total` | counter | `reason` (`queue_full`, `export_failed`) |

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::fleet::registry::Membership;

pub const REQUESTS: &str = "dprouter_requests_total";
pub const DECISIONS: &str = "dprouter_routing_decisions_total";
pub const UPSTREAM_ERRORS: &str = "dprouter_upstream_errors_total";
pub const RETRIES: &str = "dprouter_retries_total";
pub const IN_FLIGHT: &str = "dprouter_endpoint_in_flight_requests";
pub const HEALTHY: &str = "dprouter_endpoint_healthy";
pub const SESSIONS: &str = "dprouter_endpoint_sessions";
pub const PREFILL_RATE: &str = "dprouter_endpoint_prefill_tokens_per_second";
pub const PREFILL_BASE: &str = "dprouter_endpoint_prefill_base_seconds";
pub const TTFT: &str = "dprouter_ttft_seconds";
pub const DURATION: &str = "dprouter_request_duration_seconds";
pub const PROMPT_TOKENS: &str = "dprouter_prompt_tokens_total";
pub const CACHED_TOKENS: &str = "dprouter_cached_tokens_total";
pub const PREDICTION_ERROR: &str = "dprouter_cache_prediction_error_tokens";
pub const KV_EVENT_BATCHES: &str = "dprouter_kv_event_batches_total";
pub const KV_EVENT_ERRORS: &str = "dprouter_kv_event_errors_total";
pub const KV_EVENT_BLOCKS: &str = "dprouter_kv_event_blocks";
pub const TOKENIZE_CUT: &str = "dprouter_tokenize_cut_total";
pub const CLIENT_REQUESTS: &str = "dprouter_client_requests_total";
pub const CLIENT_PROMPT_TOKENS: &str = "dprouter_client_prompt_tokens_total";
pub const SATURATED: &str = "dprouter_endpoint_saturated";
pub const QUEUE_REQUESTS: &str = "dprouter_queue_requests";
pub const QUEUE_BYTES: &str = "dprouter_queue_bytes";
pub const QUEUE_WAIT: &str = "dprouter_queue_wait_seconds";
pub const QUEUE_REFUSALS: &str = "dprouter_queue_refusals_total";
pub const REFUSED_INPUT: &str = "dprouter_refused_input_total";

/// Every metric the gateway exports (histograms by their base name). `deploy/grafana/dprouter.json` charts each one;
/// `tests/dashboard.rs` keeps the two in step.
pub const ALL: &[&str] = &[
    REQUESTS,
    DECISIONS,
    UPSTREAM_ERRORS,
    RETRIES,
    IN_FLIGHT,
    HEALTHY,
    SESSIONS,
    PREFILL_RATE,
    PREFILL_BASE,
    TTFT,
    DURATION,
    PROMPT_TOKENS,
    CACHED_TOKENS,
    PREDICTION_ERROR,
    KV_EVENT_BATCHES,
    KV_EVENT_ERRORS,
    KV_EVENT_BLOCKS,
    TOKENIZE_CUT,
    CLIENT_REQUESTS,
    CLIENT_PROMPT_TOKENS,
    SATURATED,
    QUEUE_REQUESTS,
    QUEUE_BYTES,
    QUEUE_WAIT,
    QUEUE_REFUSALS,
    REFUSED_INPUT,
    dprouter_otel::SPANS_EXPORTED,
    dprouter_otel::SPANS_DROPPED,
];

const TOKEN_BUCKETS: &[f64] = &[0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0];

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
                .ok()?
                .set_buckets_for_metric(Matcher::Suffix("_tokens".into()), TOKEN_BUCKETS)
                .ok()?;
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            Some(handle)
        })
        .as_ref()
}

/// Sets the per-endpoint gauges from the current membership (and the sessions active at each endpoint, by rank),
/// then renders everything.
pub fn render(membership: &Membership, sessions: &[usize]) -> String {
    for (rank, (endpoint, target)) in membership
        .snapshot
        .endpoints()
        .iter()
        .zip(&membership.targets)
        .enumerate()
    {
        let label = target.label();
        let active = sessions.get(rank).copied().unwrap_or(0);
        metrics::gauge!(SESSIONS, "endpoint" => label.clone()).set(active as f64);
        if let Some(costs) = endpoint.load.fitted_costs() {
            metrics::gauge!(PREFILL_RATE, "endpoint" => label.clone()).set(costs.tokens_per_s());
            metrics::gauge!(PREFILL_BASE, "endpoint" => label.clone()).set(costs.base_us / 1e6);
        }
        metrics::gauge!(IN_FLIGHT, "endpoint" => label.clone()).set(endpoint.load.in_flight_requests() as f64);
        metrics::gauge!(HEALTHY, "endpoint" => label).set(if endpoint.healthy { 1.0 } else { 0.0 });
    }
    handle().map(PrometheusHandle::render).unwrap_or_default()
}
