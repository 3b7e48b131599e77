//! The data path: parse once, route, target the rank, forward, stream the answer back.
//!
//! Cost per request: one validating pass over the body that parses only the routing fields
//! ([`dprouter_core::request_body`]; bodies over 1 MiB on the blocking pool), one routing decision, and the
//! client's own bytes forwarded as slices (the client's rank override members left out, SGLang's rank member
//! added), then a streaming copy of the response without buffering. The body is held once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use crate::common::error::ApiError;
use crate::fleet::registry::Target;
use crate::observe::spans::RequestSpan;
use crate::pipeline::body::Timing;
use crate::pipeline::relay::{answered, exchange_failed, no_head, relay, upstream_request, Answer};
use crate::pipeline::retry::Refused;
use crate::state::AppState;

pub use crate::pipeline::routing::RANK_HEADER;

/// `POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/embeddings`, `/generate`.
pub async fn generate(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let received = Instant::now();
    match forward(&state, request, received).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

async fn read_body(state: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    crate::pipeline::routing::check_content_type(headers)?;
    let timeout = Duration::from_millis(state.config.server.request_body_timeout_ms);
    crate::admission::body_reader::read(&state.bodies, state.config.max_body_bytes, timeout, headers, body).await
}

/// The path and query the worker gets: the client's, with `/v1` put in front of the OpenAI paths a client sent
/// without it (`/chat/completions`, `/completions`, `/responses`), which not every engine serves.
fn upstream_path(uri: &axum::http::Uri) -> String {
    let path_and_query = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    match uri.path() {
        "/chat/completions" | "/completions" | "/responses" => format!("/v1{path_and_query}"),
        _ => path_and_query.to_string(),
    }
}

async fn forward(state: &Arc<AppState>, request: Request, received: Instant) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let path_and_query = upstream_path(&parts.uri);
    // Who calls, before its body is read: an unknown client's body is never held.
    let client = state.clients.admit(&parts.headers)?;
    let bytes = read_body(state, &parts.headers, body).await?;
    let first_byte_timeout = first_byte_timeout(state, &parts.headers)?;
    let route = (path_and_query.as_str(), &parts.headers);
    let mut routed = crate::pipeline::routing::route(state, route, bytes, client, &|_| true).await?;
    let membership = Arc::clone(&routed.membership);
    let span = parts
        .extensions
        .get::<RequestSpan>()
        .cloned()
        .unwrap_or_else(RequestSpan::none);
    if routed.pair.is_some() {
        let timing = Timing {
            received,
            first_byte: tokio::time::Instant::now() + first_byte_timeout,
            idle: Duration::from_millis(state.config.stream_idle_timeout_ms),
        };
        return crate::disagg::legs::forward(
            state,
            &parts.headers,
            &path_and_query,
            routed,
            span,
            timing,
            first_byte_timeout,
        )
        .await;
    }
    // Workers that refused this request's connection.
    let mut refused = Refused::default();
    loop {
        let target = &membership.targets[routed.ticket.pick.rank];
        let branch = routed.ticket.pick.branch;
        let label = target.label();
        let attempt = span.attempt(&label, target.id.dp_rank, refused.count() as u32 + 1);
        let upstream = upstream_request(&routed, target, &path_and_query, &parts.headers, attempt.traceparent())?;
        let timing = Timing {
            received,
            first_byte: tokio::time::Instant::now() + first_byte_timeout,
            idle: Duration::from_millis(state.config.stream_idle_timeout_ms),
        };
        let sent = tokio::time::timeout_at(timing.first_byte, state.upstream.send(upstream)).await;
        let Ok(sent) = sent else {
            return Err(no_head(state, target, branch, &attempt, first_byte_timeout));
        };
        match sent {
            Ok(response) => {
                let status = response.status();
                answered(state, target, branch, &attempt, status.as_u16());
                let remember = routed.remember(status.as_u16());
                let routing = routed.routing(target, state.policies.default_policy().name(), refused.count() as u32);
                let answer = Answer {
                    response,
                    routing,
                    attempt,
                    timing,
                    remember,
                    prefill: None,
                    shape: crate::common::error_shape::ErrorShape::of_route(&path_and_query),
                };
                return Ok(relay(state, answer, routed.ticket, target));
            }
            Err(err) => {
                exchange_failed(state, target, branch, &attempt, &err, &mut refused)?;
                let served = routed.served.as_deref();
                let serves = |t: &Target, _| served.is_none_or(|m| t.serves(m));
                routed.ticket = refused.reroute(state, &membership, routed.ticket, serves)?;
            }
        }
    }
}

/// `POST /v1/messages/count_tokens`: a Messages request's prompt counted by an engine serving its model. It changes
/// no cache, so no policy places it and no ticket holds it: the least loaded healthy endpoint gets it
/// ([`crate::pipeline::routing::route_uncached`]), and its answer comes back whole. Counted apart by its route in
/// `dprouter_requests_total`.
pub async fn count_tokens(State(state): State<Arc<AppState>>, request: Request) -> Response {
    match count(&state, request).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

async fn count(state: &Arc<AppState>, request: Request) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let client = state.clients.admit(&parts.headers)?;
    let bytes = read_body(state, &parts.headers, body).await?;
    let first_byte_timeout = first_byte_timeout(state, &parts.headers)?;
    let placed = crate::pipeline::routing::route_uncached(state, bytes, client.as_deref(), &|_| true)?;
    let target = &placed.target;
    let path_and_query = upstream_path(&parts.uri);
    let request = crate::pipeline::engine_headers::EngineRequest {
        method: axum::http::Method::POST,
        url: format!("{}{path_and_query}", target.base),
        client: &parts.headers,
        traceparent: None,
        content_type: Some(axum::http::HeaderValue::from_static("application/json")),
        authorization: crate::pipeline::engine_headers::authorization(client.is_some(), target, &parts.headers)
            .cloned(),
        rank: None,
    }
    .build(placed.pieces)?;
    let label = target.label();
    let record = |outcome| {
        let attempt = crate::pipeline::outcome::Attempt::at(target, None);
        crate::pipeline::outcome::record(&state.registry, attempt, outcome);
    };
    let response = match tokio::time::timeout(first_byte_timeout, state.upstream.send(request)).await {
        Err(_) => {
            record(crate::pipeline::outcome::Outcome::NoHead);
            return Err(ApiError::UpstreamTimeout {
                endpoint: label,
                after_ms: first_byte_timeout.as_millis() as u64,
            });
        }
        Ok(Err(err)) => {
            record(crate::pipeline::outcome::Outcome::Failed {
                connect: err.is_connect(),
            });
            let message = crate::fleet::upstream::error_chain(&err);
            return Err(ApiError::Upstream {
                endpoint: label,
                message,
            });
        }
        Ok(Ok(response)) => response,
    };
    record(crate::pipeline::outcome::Outcome::Answered(response.status().as_u16()));
    let (parts, body) = response.into_parts();
    let mut out = Response::new(Body::new(body));
    *out.status_mut() = parts.status;
    if let Some(ct) = parts.headers.get(axum::http::header::CONTENT_TYPE) {
        out.headers_mut().insert(axum::http::header::CONTENT_TYPE, ct.clone());
    }
    Ok(out)
}

/// The client's header that asks for a shorter first-byte timeout than the configured one.
pub const FIRST_BYTE_TIMEOUT_HEADER: &str = "x-dprouter-first-byte-timeout-ms";

/// How long to wait for the engine's response head: the configured bound, or less if the client asks.
pub fn first_byte_timeout(state: &AppState, headers: &HeaderMap) -> Result<Duration, ApiError> {
    let configured = state.config.first_byte_timeout_ms;
    let asked = match headers.get(FIRST_BYTE_TIMEOUT_HEADER) {
        None => configured,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&ms| ms > 0)
            .ok_or_else(|| {
                ApiError::BadRequest(format!(
                    "{FIRST_BYTE_TIMEOUT_HEADER} must be a positive number of milliseconds"
                ))
            })?,
    };
    Ok(Duration::from_millis(asked.min(configured)))
}
