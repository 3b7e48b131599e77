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
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dprouter_core::WorkerId;
use http_body_util::BodyExt;

use crate::access::Routing;
use crate::body::Timing;
use crate::error::ApiError;
use crate::relay::{answered, exchange_failed, no_head, relay, upstream_request, Answer};
use crate::spans::RequestSpan;
use crate::state::AppState;

pub use crate::routing::RANK_HEADER;

/// `POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/embeddings`, `/generate`.
pub async fn generate(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let received = Instant::now();
    match forward(&state, request, received).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

async fn read_body(state: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    crate::routing::check_content_type(headers)?;
    let limit = state.config.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let mut body = body;
    if declared.is_some_and(|n| n > limit) {
        // A client that waits for `100 Continue` sends nothing more; any other is sending its body already.
        let waits = headers
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if !waits {
            discard(&mut body).await;
        }
        return Err(ApiError::TooLarge { limit });
    }
    // One buffer, grown by doubling as bytes arrive but never past the declared length: the body is held once
    // (not in frames and then in a copy), and a client only makes the gateway allocate what it actually sends.
    // Its capacity is held in the budget of all bodies arriving at once (`body_budget`) until it is routed.
    let collect = async {
        let mut buf: Vec<u8> = Vec::new();
        let mut held = state.bodies.hold();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ApiError::BadRequest(format!("could not read the request body: {e}")))?;
            if let Ok(data) = frame.into_data() {
                let needed = buf.len() + data.len();
                if needed > limit {
                    drop(buf);
                    discard(&mut body).await;
                    return Err(ApiError::TooLarge { limit });
                }
                if needed > buf.capacity() {
                    let grown = needed.max(2 * buf.capacity()).max(16 << 10);
                    let target = declared.map_or(grown, |d| grown.min(d).max(needed)).min(limit);
                    if let Err(full) = held.grow(target - held.bytes()) {
                        drop(buf);
                        discard(&mut body).await;
                        return Err(full);
                    }
                    buf.reserve_exact(target - buf.len());
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok(Bytes::from(buf))
    };
    // A client that declares more than it sends would hold the request (and its connection) open forever.
    let after_ms = state.config.server.request_body_timeout_ms;
    tokio::time::timeout(std::time::Duration::from_millis(after_ms), collect)
        .await
        .map_err(|_| ApiError::BodyTimeout { after_ms })?
}

/// How long the rest of a body refused as too large is read, at most in all and between two of its frames.
const LINGER: Duration = Duration::from_secs(5);
const LINGER_IDLE: Duration = Duration::from_secs(1);

/// Reads and drops the rest of a body refused as too large (at most [`LINGER`], and no longer than
/// [`LINGER_IDLE`] without a frame), as nginx's lingering close does: a client that sends its whole body before it
/// reads the answer (most do) otherwise gets its connection reset mid-body instead of the 413. Nothing is kept;
/// the answer closes the connection.
async fn discard(body: &mut Body) {
    let deadline = tokio::time::Instant::now() + LINGER;
    loop {
        let next = tokio::time::timeout_at(deadline.min(tokio::time::Instant::now() + LINGER_IDLE), body.frame());
        match next.await {
            Ok(Some(Ok(_))) => {}
            _ => return,
        }
    }
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
    let mut routed = crate::routing::route(state, route, bytes, client, &|_| true).await?;
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
        return crate::legs::forward(
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
    let mut refused: Vec<WorkerId> = Vec::new();
    loop {
        let target = &membership.targets[routed.ticket.pick.rank];
        let branch = routed.ticket.pick.branch;
        let label = target.label();
        let attempt = span.attempt(&label, target.id.dp_rank, refused.len() as u32 + 1);
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
                let routing = Routing {
                    endpoint: label,
                    rank: target.id.dp_rank,
                    policy: state.policies.default_policy().name(),
                    branch: branch.as_str(),
                    model: routed.served.clone().or(routed.model.clone()),
                    retries: refused.len() as u32,
                };
                let answer = Answer {
                    response,
                    routing,
                    attempt,
                    timing,
                    remember,
                    prefill: None,
                };
                return Ok(relay(state, answer, routed.ticket, target));
            }
            Err(err) => {
                exchange_failed(state, target, branch, &attempt, &err, refused.len())?;
                // A refused connection means the whole worker is down: the retry skips all its endpoints, and the
                // policy forgets that the prompt went there.
                refused.push(target.id.worker);
                let served = routed.served.as_deref();
                let accept = |rank: usize| {
                    let t = &membership.targets[rank];
                    served.is_none_or(|m| t.serves(m)) && !refused.contains(&t.id.worker)
                };
                routed.ticket = routed
                    .ticket
                    .reroute(&membership.snapshot, &accept, crate::clock::now_us())?;
                crate::routing::count_decision(state, routed.ticket.pick.branch);
            }
        }
    }
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
