//! The upstream side of one exchange, for the proxy ([`crate::api::proxy`]) and a disaggregated request's legs
//! ([`crate::disagg::legs`]) alike: the request an endpoint gets (the client's bytes laid out for it, the headers passed
//! on) and the client's response made of the engine's answer (its status and headers, its body behind the ticket).

use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;

use std::time::Duration;

use dprouter_core::Branch;

use crate::common::error::ApiError;
use crate::fleet::registry::Target;
use crate::fleet::upstream::{Chunks, UpstreamError};
use crate::observe::access::Routing;
use crate::observe::spans::AttemptSpan;
use crate::pipeline::body::{GatewayTicket, GuardedBody, Timing, Watch};
use crate::pipeline::engine_headers::{self, EngineRequest};
use crate::pipeline::outcome::{record, Attempt, Outcome};
use crate::pipeline::retry::Refused;
use crate::pipeline::routing::Routed;
use crate::state::AppState;

/// The upstream request for `target`: the same path and query, the client's headers by the one rule
/// ([`engine_headers`]; the request id is always there, the client's or a generated one), the client's body
/// without its rank override fields, and the rank the way the backend reads it. Pieces of the client's bytes, not
/// a copy.
/// The engine's parent span is `traceparent` when tracing is on (the attempt's span), the client's otherwise.
pub(crate) fn upstream_request(
    routed: &Routed,
    target: &Target,
    path_and_query: &str,
    headers: &HeaderMap,
    traceparent: Option<HeaderValue>,
) -> Result<hyper::Request<Chunks>, ApiError> {
    let (pieces, rank_header) = routed.upstream_body(target, path_and_query);
    EngineRequest {
        method: axum::http::Method::POST,
        url: format!("{}{}", target.base, path_and_query),
        client: headers,
        traceparent,
        content_type: Some(HeaderValue::from_static("application/json")),
        authorization: engine_headers::authorization(routed.client.is_some(), target, headers).cloned(),
        rank: rank_header.map(|(name, rank)| (name, HeaderValue::from(rank))),
    }
    .build(pieces)
}

/// An engine's answer, and what the gateway knows of how it came.
pub(crate) struct Answer {
    pub response: hyper::Response<hyper::body::Incoming>,
    pub routing: Routing,
    pub attempt: AttemptSpan,
    pub timing: Timing,
    /// Remember the endpoint of the Responses answer's id, for this owner (its keyed client).
    pub remember: Option<crate::common::response_homes::Owner>,
    /// A disaggregated request's prefill leg, while it runs.
    pub prefill: Option<Box<dyn Watch>>,
    /// The route's error shape (Anthropic's on the Messages routes).
    pub shape: crate::common::error_shape::ErrorShape,
}

/// The client's response: the upstream status and headers, and the upstream body behind the load guard.
pub(crate) fn relay(state: &Arc<AppState>, answer: Answer, ticket: GatewayTicket, target: &Target) -> Response {
    let Answer {
        response,
        routing,
        attempt,
        timing,
        remember,
        prefill,
        shape,
    } = answer;
    let (parts, incoming) = response.into_parts();
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let exchange = crate::observe::access::Exchange::new();
    exchange.routed(routing);
    exchange.answered_by(attempt);
    let body = GuardedBody::new(
        incoming,
        ticket,
        Arc::clone(&state.registry),
        sse,
        timing,
        exchange.clone(),
    );
    let body = body.cut_at(&state.drain_deadline).watching(prefill).in_shape(shape);
    let body = match remember {
        Some(owner) => body.remembering_the_response(Arc::clone(&state.responses), owner),
        None => body,
    };
    let mut out = Response::new(Body::new(body));
    out.extensions_mut().insert(exchange);
    *out.status_mut() = parts.status;
    let named_by_connection: Vec<String> = parts
        .headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .collect();
    for (name, value) in &parts.headers {
        if !is_hop_by_hop(name) && !named_by_connection.iter().any(|n| n == name.as_str()) {
            out.headers_mut().append(name.clone(), value.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(&target.label()) {
        out.headers_mut().insert("x-dprouter-endpoint", v);
    }
    out
}

/// Response headers the client never gets from a worker: hop-by-hop ones (RFC 9110 §7.6.1; the length is the
/// gateway's own framing) and cookies, which a worker has no business setting on the gateway's origin.
pub(crate) fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "set-cookie"
            | "set-cookie2"
            | "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "content-length"
    )
}

/// The engine at `target` sent no response head within `after`: counted against it. It may still be working on the
/// request, so there is no retry; the client's error.
pub(crate) fn no_head(
    state: &AppState,
    target: &Target,
    branch: Branch,
    attempt: &AttemptSpan,
    after: Duration,
) -> ApiError {
    let label = target.label();
    tracing::warn!(endpoint = %label, "no response head within {after:?}");
    attempt.failed("no response head in time");
    record(&state.registry, Attempt::at(target, Some(branch)), Outcome::NoHead);
    ApiError::UpstreamTimeout {
        endpoint: label,
        after_ms: after.as_millis() as u64,
    }
}

/// The engine at `target` answered `status`: a 5xx counts against it, a success for it.
pub(crate) fn answered(state: &AppState, target: &Target, branch: Branch, attempt: &AttemptSpan, status: u16) {
    record(
        &state.registry,
        Attempt::at(target, Some(branch)),
        Outcome::Answered(status),
    );
    attempt.answered(status);
}

/// The exchange with `target` failed before an answer: counted and recorded. `Ok(())` when it may be retried
/// elsewhere ([`Refused::may_retry`]: a connection never made, a request not pinned, fewer than `retries` tries so
/// far); otherwise the client's error.
pub(crate) fn exchange_failed(
    state: &AppState,
    target: &Target,
    branch: Branch,
    attempt: &AttemptSpan,
    err: &UpstreamError,
    refused: &mut Refused,
) -> Result<(), ApiError> {
    let label = target.label();
    let message = crate::fleet::upstream::error_chain(err);
    tracing::warn!(endpoint = %label, error = %message, "upstream request failed");
    attempt.failed(&message);
    let outcome = Outcome::Failed {
        connect: err.is_connect(),
    };
    record(&state.registry, Attempt::at(target, Some(branch)), outcome);
    // Only a connection that was never made is safe to retry.
    if err.is_connect() && refused.may_retry(state, target.id.worker, branch) {
        return Ok(());
    }
    Err(ApiError::Upstream {
        endpoint: label,
        message,
    })
}
