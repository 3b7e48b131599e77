//! The data path: parse once, route, target the rank, forward, stream the answer back.
//!
//! Cost per request: one JSON parse and one re-serialization of the body (to add the rank field), one routing
//! decision, and a streaming copy of the response without buffering.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dprouter_core::prompt::parse_request;
use dprouter_core::{dispatch, Branch, Dispatch, RouteRequest};
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{Map, Value};

use crate::body::{GuardedBody, Observer};
use crate::config::Backend;
use crate::error::ApiError;
use crate::registry::{Failure, Membership, Target};
use crate::state::AppState;
use crate::telemetry;

/// The client header that pins a rank (SGLang `/v1/*` since PR #19832).
pub const RANK_HEADER: &str = "x-data-parallel-rank";
/// The header vLLM reads.
const VLLM_RANK_HEADER: &str = "x-data-parallel-rank";
const OVERRIDE_FIELDS: [&str; 2] = ["routed_dp_rank", "data_parallel_rank"];

/// Request headers passed on to the worker (everything else, hop-by-hop headers included, stays here).
const FORWARDED_HEADERS: [HeaderName; 4] = [
    header::AUTHORIZATION,
    header::ACCEPT,
    header::USER_AGENT,
    header::ACCEPT_ENCODING,
];

/// `POST /v1/chat/completions`, `/v1/completions`, `/generate`.
pub async fn generate(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let received = Instant::now();
    match forward(&state, request, received).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

/// The parsed request: the JSON body (override fields removed) and what routing needs.
struct Parsed {
    body: Map<String, Value>,
    route: RouteRequest,
}

async fn read_body(state: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("").to_ascii_lowercase();
        if !ct.starts_with("application/json") {
            return Err(ApiError::UnsupportedMediaType(ct));
        }
    }
    let limit = state.config.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::TooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::TooLarge { limit }),
        Err(e) => Err(ApiError::BadRequest(format!("could not read the request body: {e}"))),
    }
}

fn parse(state: &AppState, headers: &HeaderMap, bytes: &[u8]) -> Result<Parsed, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::BadRequest(format!("the request body is not valid JSON: {e}")))?;
    let mut route = parse_request(&value)?;
    let Value::Object(mut body) = value else {
        return Err(ApiError::BadRequest("the request body must be a JSON object".into()));
    };
    if let Some(h) = headers.get(RANK_HEADER) {
        let rank = h.to_str().ok().and_then(|s| s.trim().parse::<i64>().ok());
        route.rank_override =
            Some(rank.ok_or_else(|| ApiError::BadRequest("X-Data-Parallel-Rank must be an integer".into()))?);
    }
    if !state.config.allow_client_overrides {
        route.rank_override = None;
    }
    // The gateway consumes the client's override; the worker gets the rank the gateway chose.
    for field in OVERRIDE_FIELDS {
        body.remove(field);
    }
    Ok(Parsed { body, route })
}

/// The upstream request for `target`: the same path and query, the rank injected the way the backend expects.
/// `body` is lent, not copied: the rank field is added for serialization and removed again.
fn upstream_request(
    target: &Target,
    path_and_query: &str,
    headers: &HeaderMap,
    body: &mut Map<String, Value>,
) -> Result<hyper::Request<Full<Bytes>>, ApiError> {
    let mut builder = hyper::Request::post(format!("{}{}", target.base, path_and_query))
        .header(header::CONTENT_TYPE, "application/json");
    for name in &FORWARDED_HEADERS {
        if let Some(v) = headers.get(name) {
            builder = builder.header(name, v);
        }
    }
    let encoded = match target.backend {
        Backend::Sglang => {
            let field = target.rank_field.as_str();
            body.insert(field.into(), Value::from(target.id.dp_rank));
            let encoded = serde_json::to_vec(body);
            body.remove(field);
            encoded
        }
        Backend::Vllm => {
            builder = builder.header(VLLM_RANK_HEADER, target.id.dp_rank);
            serde_json::to_vec(body)
        }
        Backend::Openai => serde_json::to_vec(body),
    }
    .map_err(|e| ApiError::BadRequest(format!("cannot encode the request: {e}")))?;
    builder
        .body(Full::new(Bytes::from(encoded)))
        .map_err(|e| ApiError::BadRequest(format!("cannot build the upstream request: {e}")))
}

fn route_once(
    state: &AppState,
    membership: &Membership,
    excluded: &HashSet<usize>,
    req: &RouteRequest,
) -> Result<Dispatch, ApiError> {
    let dispatched = if excluded.is_empty() {
        dispatch(state.policy.as_ref(), &membership.snapshot, req)
    } else {
        let snapshot = membership
            .snapshot
            .with_health(|i, e| e.healthy && !excluded.contains(&i));
        dispatch(state.policy.as_ref(), &snapshot, req)
    }?;
    let branch = dispatched.pick.branch.as_str();
    metrics::counter!(telemetry::DECISIONS, "policy" => state.policy.name(), "branch" => branch).increment(1);
    state.count_decision(dispatched.pick.branch);
    Ok(dispatched)
}

async fn forward(state: &Arc<AppState>, request: Request, received: Instant) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |p| p.as_str())
        .to_string();
    let bytes = read_body(state, &parts.headers, body).await?;
    let mut parsed = parse(state, &parts.headers, &bytes)?;
    drop(bytes);
    let membership = state.registry.membership();
    let mut excluded = HashSet::new();
    let mut attempt = 0;
    loop {
        parsed.route.now_us = crate::clock::now_us();
        let dispatched = route_once(state, &membership, &excluded, &parsed.route)?;
        let target = &membership.targets[dispatched.pick.rank];
        let label = target.label();
        let upstream = upstream_request(target, &path_and_query, &parts.headers, &mut parsed.body)?;
        match state.upstream.send(upstream).await {
            Ok(response) => {
                let status = response.status();
                if status.is_server_error() {
                    metrics::counter!(telemetry::UPSTREAM_ERRORS, "endpoint" => label.clone(), "kind" => "status_5xx")
                        .increment(1);
                    state.registry.record_failure(target.id, Failure::Server);
                } else if status.is_success() {
                    state.registry.record_success(target.id);
                }
                return Ok(relay(state, response, dispatched, target, parsed.route, received));
            }
            Err(err) => {
                let message = crate::upstream::error_chain(&err);
                let kind = if err.is_connect() { "connect" } else { "server" };
                metrics::counter!(telemetry::UPSTREAM_ERRORS, "endpoint" => label.clone(), "kind" => kind).increment(1);
                tracing::warn!(endpoint = %label, error = %message, "upstream request failed");
                state.registry.record_failure(
                    target.id,
                    if err.is_connect() {
                        Failure::Connect
                    } else {
                        Failure::Server
                    },
                );
                // Only a connection that was never made is safe to retry, and never a pinned request.
                let retry =
                    err.is_connect() && dispatched.pick.branch != Branch::Override && attempt < state.config.retries;
                if !retry {
                    return Err(ApiError::Upstream {
                        endpoint: label,
                        message,
                    });
                }
                attempt += 1;
                metrics::counter!(telemetry::RETRIES).increment(1);
                // A refused connection means the whole worker is down: skip all its endpoints.
                for (i, t) in membership.targets.iter().enumerate() {
                    if t.id.worker == target.id.worker {
                        excluded.insert(i);
                    }
                }
            }
        }
    }
}

/// The client's response: the upstream status and headers, and the upstream body behind the load guard.
fn relay(
    state: &Arc<AppState>,
    response: hyper::Response<hyper::body::Incoming>,
    dispatched: Dispatch,
    target: &Target,
    route: RouteRequest,
    received: Instant,
) -> Response {
    let (parts, incoming) = response.into_parts();
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let (policy_state, pick, endpoint) = (Arc::clone(state), dispatched.pick, target.id);
    let observer: Observer = Box::new(move |cached| policy_state.policy.observe(endpoint, &route, &pick, cached));
    let body = GuardedBody::new(
        incoming,
        dispatched.guard,
        target.id,
        Arc::clone(&state.registry),
        observer,
        received,
        sse,
    );
    let mut out = Response::new(Body::new(body));
    *out.status_mut() = parts.status;
    for (name, value) in &parts.headers {
        if !is_hop_by_hop(name) {
            out.headers_mut().append(name.clone(), value.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(&target.label()) {
        out.headers_mut().insert("x-dprouter-endpoint", v);
    }
    out
}

fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "content-length"
    )
}
