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
use axum::http::{header, HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dprouter_core::request_body::{parse_body, Layout, Piece, RequestBody};
use dprouter_core::{dispatch_among, Branch, EndpointId, WorkerId};
use http_body_util::BodyExt;

use crate::body::{GatewayTicket, GuardedBody, Timing};
use crate::config::Backend;
use crate::error::ApiError;
use crate::registry::{Failure, Membership, Target};
use crate::state::AppState;
use crate::telemetry;
use crate::upstream::Chunks;

/// The client header that pins a rank (SGLang `/v1/*` since PR #19832).
pub const RANK_HEADER: &str = "x-data-parallel-rank";
/// The header vLLM reads.
const VLLM_RANK_HEADER: &str = "x-data-parallel-rank";

/// Request headers passed on to the worker (everything else, hop-by-hop headers included, stays here); the request
/// id is always there (the client's or a generated one).
/// `Accept-Encoding` is not among them: a compressed answer would hide the engine's usage report.
const FORWARDED_HEADERS: [HeaderName; 4] = [
    header::AUTHORIZATION,
    header::ACCEPT,
    header::USER_AGENT,
    HeaderName::from_static(crate::names::REQUEST_ID),
];

/// `POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/embeddings`, `/generate`.
pub async fn generate(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let received = Instant::now();
    match forward(&state, request, received).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

/// The parsed request: the client's bytes and what routing read from them.
struct Parsed {
    bytes: Bytes,
    body: RequestBody,
}

/// Bodies larger than this are parsed on the blocking pool, off the async runtime's threads.
const BLOCKING_PARSE_BYTES: usize = 1 << 20;

async fn read_body(state: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("").to_ascii_lowercase();
        let essence = ct.split(';').next().unwrap_or("").trim();
        if essence != "application/json" {
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
    // One buffer, grown by doubling as bytes arrive but never past the declared length: the body is held once
    // (not in frames and then in a copy), and a client only makes the gateway allocate what it actually sends.
    let collect = async {
        let mut buf: Vec<u8> = Vec::new();
        let mut body = body;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ApiError::BadRequest(format!("could not read the request body: {e}")))?;
            if let Ok(data) = frame.into_data() {
                let needed = buf.len() + data.len();
                if needed > limit {
                    return Err(ApiError::TooLarge { limit });
                }
                if needed > buf.capacity() {
                    let grown = needed.max(2 * buf.capacity()).max(16 << 10);
                    let target = declared.map_or(grown, |d| grown.min(d).max(needed)).min(limit);
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

/// Reads the routing fields of `bytes` (on the blocking pool when the body is large) and the rank header.
async fn parse(state: &AppState, headers: &HeaderMap, bytes: Bytes) -> Result<Parsed, ApiError> {
    let allow_overrides = state.config.allow_client_overrides;
    let (bytes, mut body) = if bytes.len() > BLOCKING_PARSE_BYTES {
        tokio::task::spawn_blocking(move || parse_body(&bytes, allow_overrides).map(|b| (bytes, b)))
            .await
            .map_err(|e| ApiError::Unavailable(format!("the request could not be parsed: {e}")))??
    } else {
        let body = parse_body(&bytes, allow_overrides)?;
        (bytes, body)
    };
    if body.route.session.is_none() {
        let named = state
            .config
            .session_header
            .as_deref()
            .and_then(|name| headers.get(name));
        body.route.session = named
            .and_then(|v| v.to_str().ok())
            .map(dprouter_core::request::session_hash);
    }
    if let (true, Some(h)) = (allow_overrides, headers.get(RANK_HEADER)) {
        let rank = h.to_str().ok().and_then(|s| s.trim().parse::<i64>().ok());
        body.route.rank_override =
            Some(rank.ok_or_else(|| ApiError::BadRequest("X-Data-Parallel-Rank must be an integer".into()))?);
    }
    Ok(Parsed { bytes, body })
}

/// The upstream request for `target`: the same path and query, the client's body without its rank override
/// fields, and the rank the way the backend reads it. Pieces of the client's bytes, not a copy.
fn upstream_request(
    target: &Target,
    path_and_query: &str,
    headers: &HeaderMap,
    bytes: &Bytes,
    layout: &Layout,
    model_member: Option<Bytes>,
) -> Result<hyper::Request<Chunks>, ApiError> {
    let mut builder = hyper::Request::post(format!("{}{}", target.base, path_and_query))
        .header(header::CONTENT_TYPE, "application/json");
    for name in &FORWARDED_HEADERS {
        if let Some(v) = headers.get(name) {
            builder = builder.header(name, v);
        }
    }
    let rank_member = match target.backend {
        Backend::Sglang => match target.rank_field.body_field(path_and_query) {
            Some(field) => Some(Bytes::from(format!("\"{field}\":{}", target.id.dp_rank))),
            None => {
                builder = builder.header(RANK_HEADER, target.id.dp_rank);
                None
            }
        },
        Backend::Vllm => {
            builder = builder.header(VLLM_RANK_HEADER, target.id.dp_rank);
            None
        }
        Backend::Openai => None,
    };
    let pieces = layout
        .forwarded(
            bytes,
            rank_member.into_iter().chain(model_member.clone()),
            model_member.is_some(),
            |b: &Bytes, range| b.slice(range),
        )
        .into_iter()
        .map(|p| match p {
            Piece::Text(t) => Bytes::from_static(t.as_bytes()),
            Piece::Bytes(b) => b,
        });
    builder
        .body(Chunks::new(pieces))
        .map_err(|e| ApiError::BadRequest(format!("cannot build the upstream request: {e}")))
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

/// The model a request is for, as the workers know it (after the config's aliases); `None` for a request that
/// names none, or when the fleet serves one model or unknown ones (any name goes then, as SGLang and llama.cpp
/// take any). In a fleet of several known models, a 404 for a model no worker serves (workers whose models are
/// unknown take any).
fn served_model(state: &AppState, membership: &Membership, asked: Option<&str>) -> Result<Option<String>, ApiError> {
    let Some(asked) = asked else { return Ok(None) };
    let served = state.config.model_aliases.get(asked).map_or(asked, String::as_str);
    if membership.models().len() < 2 {
        // One model (or none known): every worker serves the request whatever it names, with the alias mapped.
        return Ok((served != asked).then(|| served.to_string()));
    }
    if membership.targets.iter().any(|t| t.serves(served)) {
        return Ok(Some(served.to_string()));
    }
    Err(ApiError::ModelNotFound(asked.to_string()))
}

/// Counts a routing decision (metrics and `GET /workers`).
fn count_decision(state: &AppState, branch: Branch) {
    metrics::counter!(telemetry::DECISIONS, "policy" => state.policies.default_policy().name(), "branch" => branch.as_str()).increment(1);
    state.count_decision(branch);
}

async fn forward(state: &Arc<AppState>, request: Request, received: Instant) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let path_and_query = upstream_path(&parts.uri);
    let bytes = read_body(state, &parts.headers, body).await?;
    let Parsed {
        bytes,
        body:
            RequestBody {
                mut route,
                layout,
                model,
                previous_response_id,
            },
    } = parse(state, &parts.headers, bytes).await?;
    let responses_api = matches!(parts.uri.path(), "/v1/responses" | "/responses");
    let first_byte_timeout = first_byte_timeout(state, &parts.headers)?;
    let membership = state.registry.membership();
    let served = served_model(state, &membership, model.as_deref())?;
    // The model's name as the worker knows it, when the client used an alias.
    let model_member = match (&served, &model) {
        (Some(s), Some(asked)) if s != asked => Some(Bytes::from(format!("\"model\":{}", serde_json::json!(s)))),
        _ => None,
    };
    let serving = |rank: usize| served.as_deref().is_none_or(|m| membership.targets[rank].serves(m));
    // A rank the client pinned must serve the model too (a rank out of range is the policy's error).
    if let (Some(model), Some(rank)) = (
        served.as_deref(),
        route
            .rank_override
            .and_then(|r| usize::try_from(r).ok())
            .filter(|&r| r < membership.targets.len()),
    ) {
        if !serving(rank) {
            return Err(ApiError::BadRequest(format!(
                "DP rank {rank} does not serve model `{model}`"
            )));
        }
    }
    // Per-model state for the models workers are known to serve only: a name a client makes up (taken by a worker
    // whose models are unknown) shares the default policy rather than growing the table.
    let known = served.as_deref().filter(|m| membership.models().iter().any(|k| k == m));
    let policy = state.policies.for_model(known.or(membership.sole_model()));
    if let Some(tokenizer) = state
        .tokenizers
        .for_model(served.as_deref().or(membership.sole_model()))
    {
        crate::tokens::exact_prompt(&state.tokenizers, tokenizer, &bytes, &mut route).await;
    }
    route.now_us = crate::clock::now_us();
    let home = previous_response_id
        .filter(|_| responses_api)
        .and_then(|id| state.responses.home(&id));
    let scope = Scope::of(home, &membership, &serving);
    let accept = |rank: usize| serving(rank) && scope.contains(membership.targets[rank].id);
    let mut ticket = dispatch_among(policy, &membership.snapshot, &accept, route)?;
    count_decision(state, ticket.pick.branch);
    // Workers that refused this request's connection.
    let mut refused: Vec<WorkerId> = Vec::new();
    loop {
        let target = &membership.targets[ticket.pick.rank];
        let label = target.label();
        let upstream = upstream_request(
            target,
            &path_and_query,
            &parts.headers,
            &bytes,
            &layout,
            model_member.clone(),
        )?;
        let timing = Timing {
            received,
            first_byte: tokio::time::Instant::now() + first_byte_timeout,
            idle: Duration::from_millis(state.config.stream_idle_timeout_ms),
        };
        let sent = tokio::time::timeout_at(timing.first_byte, state.upstream.send(upstream)).await;
        let Ok(sent) = sent else {
            // The engine took the request and said nothing in time: it may still be working on it, so no retry.
            metrics::counter!(telemetry::UPSTREAM_ERRORS, "endpoint" => label.clone(), "kind" => "timeout")
                .increment(1);
            tracing::warn!(endpoint = %label, "no response head within {first_byte_timeout:?}");
            state
                .registry
                .record_failure(target.id, Failure::engine(ticket.pick.branch), Instant::now());
            return Err(ApiError::UpstreamTimeout {
                endpoint: label,
                after_ms: first_byte_timeout.as_millis() as u64,
            });
        };
        match sent {
            Ok(response) => {
                let status = response.status();
                if status.is_server_error() {
                    metrics::counter!(telemetry::UPSTREAM_ERRORS, "endpoint" => label.clone(), "kind" => "status_5xx")
                        .increment(1);
                    state
                        .registry
                        .record_failure(target.id, Failure::engine(ticket.pick.branch), Instant::now());
                } else if status.is_success() {
                    target.state.record_success();
                }
                let remember = responses_api && status.is_success();
                let model = served.clone().or(model);
                return Ok(relay(state, response, ticket, target, timing, model, remember));
            }
            Err(err) => {
                let message = crate::upstream::error_chain(&err);
                let kind = if err.is_connect() { "connect" } else { "server" };
                metrics::counter!(telemetry::UPSTREAM_ERRORS, "endpoint" => label.clone(), "kind" => kind).increment(1);
                tracing::warn!(endpoint = %label, error = %message, "upstream request failed");
                // A connection that broke after the request was sent may be this request's own fault (an engine
                // refusing its body by closing the connection): it asks for a probe but does not count.
                let failure = if err.is_connect() {
                    Failure::Connect
                } else {
                    Failure::Ambiguous
                };
                state.registry.record_failure(target.id, failure, Instant::now());
                // Only a connection that was never made is safe to retry, and never a pinned request.
                let retry = err.is_connect()
                    && ticket.pick.branch != Branch::Override
                    && refused.len() < state.config.retries as usize;
                if !retry {
                    return Err(ApiError::Upstream {
                        endpoint: label,
                        message,
                    });
                }
                metrics::counter!(telemetry::RETRIES).increment(1);
                // A refused connection means the whole worker is down: the retry skips all its endpoints, and the
                // policy forgets that the prompt went there.
                refused.push(target.id.worker);
                let accept = |rank: usize| serving(rank) && !refused.contains(&membership.targets[rank].id.worker);
                ticket = ticket.reroute(&membership.snapshot, &accept, crate::clock::now_us())?;
                count_decision(state, ticket.pick.branch);
            }
        }
    }
}

/// The client's header that asks for a shorter first-byte timeout than the configured one.
pub const FIRST_BYTE_TIMEOUT_HEADER: &str = "x-dprouter-first-byte-timeout-ms";

/// How long to wait for the engine's response head: the configured bound, or less if the client asks.
fn first_byte_timeout(state: &AppState, headers: &HeaderMap) -> Result<Duration, ApiError> {
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

/// Where a request may go besides its model's workers: anywhere, or, for the continuation of a stored Responses
/// answer, the endpoint that made it, else another routable rank of its worker, else anywhere (the engine's 404
/// then says the response is gone; [`crate::responses`]).
#[derive(Debug, Clone, Copy)]
enum Scope {
    Any,
    Worker(WorkerId),
    Endpoint(EndpointId),
}

impl Scope {
    fn of(home: Option<EndpointId>, membership: &Membership, serving: &dyn Fn(usize) -> bool) -> Self {
        let Some(home) = home else { return Scope::Any };
        let routable = |scope: Scope| {
            membership
                .snapshot
                .healthy()
                .iter()
                .any(|&rank| serving(rank) && scope.contains(membership.targets[rank].id))
        };
        [Scope::Endpoint(home), Scope::Worker(home.worker)]
            .into_iter()
            .find(|&scope| routable(scope))
            .unwrap_or(Scope::Any)
    }

    fn contains(self, id: EndpointId) -> bool {
        match self {
            Scope::Any => true,
            Scope::Worker(worker) => id.worker == worker,
            Scope::Endpoint(endpoint) => id == endpoint,
        }
    }
}

/// The client's response: the upstream status and headers, and the upstream body behind the load guard; with
/// `remember`, the endpoint of the Responses answer's id is remembered.
fn relay(
    state: &Arc<AppState>,
    response: hyper::Response<hyper::body::Incoming>,
    ticket: GatewayTicket,
    target: &Target,
    timing: Timing,
    model: Option<String>,
    remember: bool,
) -> Response {
    let (parts, incoming) = response.into_parts();
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let exchange = crate::access::Exchange::new();
    exchange.routed(target.label(), ticket.pick.branch.as_str(), model);
    let body = GuardedBody::new(
        incoming,
        ticket,
        Arc::clone(&state.registry),
        sse,
        timing,
        exchange.clone(),
    );
    let body = body.cut_at(&state.drain_deadline);
    let body = if remember {
        body.remembering_the_response(Arc::clone(&state.responses))
    } else {
        body
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
fn is_hop_by_hop(name: &HeaderName) -> bool {
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
