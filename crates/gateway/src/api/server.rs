//! The HTTP front end: routes, request metrics, and `serve` (the admin API's handlers and access: [`crate::api::admin`]).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::api::{admin, proxy, responses};
use crate::background::health;
use crate::common::error::ApiError;
use crate::common::names::{MAX_HEADERS, MAX_HEADER_BYTES, MAX_URI_BYTES, REQUEST_ID};
use crate::http::in_flight::{self, InFlightLimit};
use crate::http::listener;
use crate::observe::{access, telemetry};
use crate::state::AppState;

/// The admin routes' paths.
const ADMIN_PATHS: [&str; 3] = ["/workers", "/flush_cache", "/kv_events"];

fn is_admin_path(path: &str) -> bool {
    ADMIN_PATHS
        .iter()
        .any(|p| path == *p || path.strip_prefix(p).is_some_and(|rest| rest.starts_with('/')))
}

/// The paths whose requests the policy routes (POST, with a prompt); a client given the base URL without `/v1`
/// (llama.cpp serves both) gets the same, sent on with `/v1`.
pub const GENERATE_PATHS: [&str; 9] = [
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/chat/completions",
    "/completions",
    "/responses",
    "/generate",
];

/// The other public routes that reach an engine or the gateway's own answer (`{id}`: any one path segment), with
/// their methods (GET includes HEAD).
const OTHER_PUBLIC_ROUTES: [(&str, &[&str]); 6] = [
    ("/v1/messages/count_tokens", &["POST"]),
    ("/v1/responses/{id}", &["GET", "DELETE"]),
    ("/v1/responses/{id}/cancel", &["POST"]),
    ("/v1/responses/{id}/input_items", &["GET"]),
    ("/v1/models", &["GET"]),
    ("/models", &["GET"]),
];

/// Whether the gateway's public router serves `method` on `path` (a query string is ignored): `Ok` with the route
/// (as the router names it: `/v1/responses/{id}`), or the gateway's answer for a path it does not serve (404) or
/// a method the path does not take (405). The Endpoint Picker answers requests the data plane hands it as `serve`
/// would.
pub fn public_route(method: &str, path: &str) -> Result<&'static str, ApiError> {
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let (route, methods): (&'static str, &[&str]) = match GENERATE_PATHS.iter().find(|p| **p == path) {
        Some(route) => (route, &["POST"]),
        None => match OTHER_PUBLIC_ROUTES
            .iter()
            .find(|(pattern, _)| path_matches(pattern, path))
        {
            Some((pattern, methods)) => (pattern, methods),
            None => return Err(ApiError::NotFound("no such route".into())),
        },
    };
    let head_of_get = method == "HEAD" && methods.contains(&"GET");
    if methods.contains(&method) || head_of_get {
        Ok(route)
    } else {
        Err(ApiError::MethodNotAllowed(method.to_string()))
    }
}

/// `path` matched against a route's `pattern`, whose `{…}` segments match any one segment (an empty one too, as
/// the router's do).
fn path_matches(pattern: &str, path: &str) -> bool {
    let mut given = path.split('/');
    for wanted in pattern.split('/') {
        match given.next() {
            Some(segment) if wanted.starts_with('{') || segment == wanted => {}
            _ => return false,
        }
    }
    given.next().is_none()
}

/// Every route of the gateway.
pub fn router(state: Arc<AppState>) -> Router {
    let data = GENERATE_PATHS
        .iter()
        .fold(Router::new(), |router, path| router.route(path, post(proxy::generate)))
        .route_layer(middleware::from_fn_with_state(
            InFlightLimit::new(state.config.server.max_in_flight),
            in_flight::limit_in_flight,
        ))
        // As `OTHER_PUBLIC_ROUTES` lists them.
        .route("/v1/responses/{id}", get(responses::stored).delete(responses::stored))
        .route("/v1/responses/{id}/cancel", post(responses::stored))
        .route("/v1/responses/{id}/input_items", get(responses::stored))
        .route("/v1/messages/count_tokens", post(proxy::count_tokens))
        .route("/v1/models", get(models))
        .route("/models", get(models));
    finish(data.merge(control_routes(&state)), state)
}

/// The routes of a process that routes without proxying (the Endpoint Picker's HTTP side): health, readiness,
/// metrics and the admin API, under the same rules as the gateway's.
pub fn control_router(state: Arc<AppState>) -> Router {
    finish(control_routes(&state), state)
}

fn control_routes(state: &Arc<AppState>) -> Router<Arc<AppState>> {
    let admin = Router::new()
        .route("/workers", get(admin::list_workers).post(admin::add_worker))
        .route("/workers/{id}", delete(admin::remove_worker))
        .route("/flush_cache", post(admin::flush_cache))
        .route("/kv_events", get(admin::kv_events))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(state),
            admin::require_admin_key,
        ));
    Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route("/readiness", get(readiness))
        .route("/metrics", get(render_metrics))
        .merge(admin)
}

/// The fallbacks and the layers every route gets.
fn finish(routes: Router<Arc<AppState>>, state: Arc<AppState>) -> Router {
    let router = routes
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|request: Request| async move {
            ApiError::MethodNotAllowed(request.method().to_string())
        })
        .layer(middleware::from_fn(check_request_head))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), count_requests))
        .layer(middleware::from_fn(request_id));
    let router = match cors(&state.config.server.cors_allow_origins) {
        Some(cors) => router.layer(cors),
        None => router,
    };
    router.with_state(state)
}

/// The CORS layer for `origins` (`None` when empty: CORS off). Preflights are answered by the layer itself.
fn cors(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    // Never for the admin routes, whatever the origin: their preflights go unapproved.
    let any = origins.iter().any(|o| o == "*");
    let exact: Vec<axum::http::HeaderValue> = origins.iter().filter_map(|o| o.parse().ok()).collect();
    let allow = AllowOrigin::predicate(move |origin, request| {
        !is_admin_path(request.uri.path()) && (any || exact.contains(origin))
    });
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([axum::http::Method::GET, axum::http::Method::POST])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                header::ACCEPT,
                axum::http::HeaderName::from_static(REQUEST_ID),
                axum::http::HeaderName::from_static(proxy::RANK_HEADER),
                axum::http::HeaderName::from_static(proxy::FIRST_BYTE_TIMEOUT_HEADER),
            ])
            .expose_headers([
                axum::http::HeaderName::from_static(REQUEST_ID),
                axum::http::HeaderName::from_static("x-dprouter-endpoint"),
            ])
            .max_age(Duration::from_secs(600)),
    )
}

/// The longest client request id kept (longer ones are replaced by a generated one).
const MAX_REQUEST_ID_BYTES: usize = 200;

/// A client's request id is kept when it is made of `[A-Za-z0-9._:-]` alone (so it cannot forge the access log's
/// fields: no spaces, `=` or quotes), and replaced by a generated one otherwise.
fn usable_request_id(id: &axum::http::HeaderValue) -> bool {
    !id.is_empty()
        && id.len() <= MAX_REQUEST_ID_BYTES
        && id
            .as_bytes()
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(b))
}

async fn request_id(mut request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get(REQUEST_ID)
        .filter(|v| usable_request_id(v))
        .cloned();
    let id = given.unwrap_or_else(new_request_id);
    request.headers_mut().insert(REQUEST_ID, id.clone());
    let mut response = next.run(request).await;
    response.headers_mut().insert(REQUEST_ID, id);
    response
}

/// 128 bits, as 32 hex digits: a process-wide counter through two randomly keyed hashes (unique within the
/// process; across processes as unlikely to collide as random ids).
fn new_request_id() -> axum::http::HeaderValue {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static KEYS: OnceLock<(
        std::collections::hash_map::RandomState,
        std::collections::hash_map::RandomState,
    )> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let (a, b) = KEYS.get_or_init(Default::default);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let id = format!("{:016x}{:016x}", a.hash_one(n), b.hash_one(n));
    axum::http::HeaderValue::from_str(&id).unwrap_or_else(|_| axum::http::HeaderValue::from_static("0"))
}

/// Serves the gateway on `listener` until `shutdown` completes, running its background tasks meanwhile; then drains
/// for at most `server.drain_timeout_ms` ([`listener::run`]).
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let background = Background::start(&state);
    let config = state.config.server.clone();
    let tls = state.tls_acceptor.clone();
    let deadline = state.drain_deadline.clone();
    let served = listener::run(
        listener,
        listener::Protocol::Http1,
        router(state),
        &config,
        tls,
        &deadline,
        shutdown,
    )
    .await;
    background.stop().await;
    served
}

/// The gateway's background work: health probes, ejection sweeps, load polls, KV event feeds.
/// How long background tasks (probes, load polls, KV-event feeds, discovery) get to stop at shutdown.
const BACKGROUND_STOP: std::time::Duration = std::time::Duration::from_millis(200);

pub struct Background {
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Background {
    /// Starts it for `state` (the metrics recorder too).
    pub fn start(state: &Arc<AppState>) -> Self {
        telemetry::handle();
        if !state.tokenizers.is_empty() {
            // Defined from the start on a gateway that tokenizes, so its rate is.
            metrics::counter!(telemetry::TOKENIZE_CUT).increment(0);
        }
        if matches!(state.config.tracing_settings(), Ok(Some(_))) {
            // The process exports spans (it was started with this config): its span counters are defined from
            // the start, so their rates are.
            metrics::counter!(dprouter_otel::SPANS_EXPORTED).increment(0);
            for reason in ["queue_full", "export_failed"] {
                metrics::counter!(dprouter_otel::SPANS_DROPPED, "reason" => reason).increment(0);
            }
        }
        let (stop, stopped) = watch::channel(false);
        let mut tasks = health::spawn(Arc::clone(state), stopped.clone());
        if !matches!(state.config.routing, dprouter_core::PolicyConfig::CacheAware(_))
            && state.config.workers.iter().any(|w| w.events().is_some())
        {
            tracing::warn!("kv_events are configured, but only cache_aware uses them: not subscribing");
        }
        let feeds = crate::kv_feeds::FeedParts {
            registry: Arc::clone(&state.registry),
            policies: Arc::clone(&state.policies),
            feeds: state.kv_feeds.clone(),
        };
        tasks.extend(crate::kv_feeds::spawn(feeds, &state.config.routing, stopped.clone()));
        if let Some(flow) = &state.flow {
            let dispatcher =
                crate::admission::flow::dispatch(Arc::clone(flow), Arc::clone(&state.registry), stopped.clone());
            tasks.push(tokio::spawn(dispatcher));
        }
        tasks.extend(crate::background::joining::spawn(state, stopped));
        Self { stop, tasks }
    }

    /// Stops it and waits for its tasks to end, at most [`BACKGROUND_STOP`]; those still running then are aborted
    /// (the process's exit must come within half a second of the drain deadline).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let deadline = tokio::time::Instant::now() + BACKGROUND_STOP;
        for mut task in self.tasks {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                tracing::debug!("a background task did not stop in time: aborted");
                task.abort();
            }
        }
    }
}

/// Refuses request heads over the gateway's limits with a JSON error, before any handler runs. (hyper's own limits
/// are set above these, so that the gateway answers first: [`crate::http::listener`].)
async fn check_request_head(request: Request, next: Next) -> Response {
    if request.uri().to_string().len() > MAX_URI_BYTES {
        return ApiError::UriTooLong(MAX_URI_BYTES).into_response();
    }
    let headers = request.headers();
    let sizes = headers.iter().map(|(n, v)| (n.as_str().len(), v.len()));
    if let Err(e) = check_header_sizes(sizes) {
        return e.into_response();
    }
    next.run(request).await
}

/// The request head's limits, for `serve` and the Endpoint Picker alike: at most [`MAX_HEADERS`] headers and
/// [`MAX_HEADER_BYTES`] bytes of them (`sizes`: each header's name and value lengths, pseudo-headers left out).
pub fn check_header_sizes(sizes: impl Iterator<Item = (usize, usize)>) -> Result<(), ApiError> {
    let (mut count, mut bytes) = (0usize, 0usize);
    for (name, value) in sizes {
        count += 1;
        bytes += name + value + 4;
    }
    if count > MAX_HEADERS || bytes > MAX_HEADER_BYTES {
        return Err(ApiError::HeadersTooLarge(format!(
            "request headers too large: {count} headers, {bytes} bytes (at most {MAX_HEADERS} headers and {MAX_HEADER_BYTES} bytes)"
        )));
    }
    Ok(())
}

/// Routes whose requests get a trace span: those that go to an engine.
pub fn is_traced(route: &str) -> bool {
    GENERATE_PATHS.contains(&route) || route.starts_with("/v1/responses/")
}

async fn count_requests(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched".to_string(), |p| p.as_str().to_string());
    let span = if is_traced(&route) {
        crate::observe::spans::RequestSpan::start(request.method().as_str(), &route, request.headers())
    } else {
        crate::observe::spans::RequestSpan::none()
    };
    let arrived = access::Request::of(
        &request,
        route,
        Instant::now(),
        state.config.server.access_log,
        span.clone(),
    );
    let request_id = request.headers().get(REQUEST_ID).cloned();
    let trace_id = span.trace_id();
    let mut request = request;
    request.extensions_mut().insert(span);
    let shape = crate::common::error_shape::ErrorShape::of_route(request.uri().path());
    let response = crate::common::error::identified(
        next.run(request).await,
        (request_id.as_ref().and_then(|v| v.to_str().ok()), trace_id.as_deref()),
        shape,
    );
    access::Counted::wrap(response, arrived)
}

async fn readiness(State(state): State<Arc<AppState>>) -> Response {
    let healthy = state.registry.membership().snapshot.healthy().len();
    let synced = state.discovery_synced();
    let ready = healthy > 0 && synced;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({"ready": ready, "healthy_endpoints": healthy, "discovery_synced": synced})),
    )
        .into_response()
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> Response {
    for (endpoint, feed) in state.kv_feeds.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        metrics::gauge!(telemetry::KV_EVENT_BLOCKS, "endpoint" => endpoint.to_string()).set(feed.router_blocks as f64);
    }
    let membership = state.registry.membership();
    if let Some(flow) = &state.flow {
        let now = crate::common::clock::now_us();
        for (endpoint, target) in membership.snapshot.endpoints().iter().zip(&membership.targets) {
            let saturated = flow.saturated(&endpoint.load, endpoint.kv_capacity, now);
            metrics::gauge!(telemetry::SATURATED, "endpoint" => target.label()).set(f64::from(u8::from(saturated)));
        }
    }
    let sessions = state
        .policies
        .sessions_by_rank(&membership.snapshot, crate::common::clock::now_us());
    let text = telemetry::render(&membership, &sessions);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// `GET /v1/models`, answered by a healthy worker.
/// How long `GET /v1/models` waits for one worker's answer before it asks the next one.
const MODELS_TIMEOUT: Duration = Duration::from_secs(5);

/// `GET /v1/models` (and `/models`): every model the workers serve (learned when they were added) and the
/// config's aliases of them; when no worker's models are known, the answer of the first healthy worker that gives
/// one within [`MODELS_TIMEOUT`], with the worker's key or the client's `Authorization` (an engine started with an
/// API key wants it; a keyed client's never goes on), a worker that fails or stalls passed over for the next (502
/// when none answers). With clients configured, a client's key is needed.
async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Result<Response, ApiError> {
    let client = state.clients.admit(&headers)?;
    let membership = state.registry.membership();
    // Known models: the union over the workers, and the aliases of served ones.
    let served = membership.models();
    if !served.is_empty() {
        let aliases = state
            .config
            .model_aliases
            .iter()
            .filter(|(_, target)| served.contains(target))
            .map(|(alias, _)| alias.clone());
        let mut ids: Vec<String> = served.iter().cloned().chain(aliases).collect();
        ids.sort();
        ids.dedup();
        let data: Vec<Value> = ids
            .iter()
            .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "dprouter"}))
            .collect();
        return Ok(Json(json!({"object": "list", "data": data})).into_response());
    }
    let mut asked = Vec::new();
    let mut failure = None;
    for &i in membership.snapshot.healthy() {
        let target = &membership.targets[i];
        if asked.contains(&target.id.worker) {
            continue;
        }
        asked.push(target.id.worker);
        let request = crate::pipeline::engine_headers::EngineRequest {
            method: axum::http::Method::GET,
            url: format!("{}/v1/models", target.base),
            client: &headers,
            traceparent: None,
            content_type: None,
            authorization: crate::pipeline::engine_headers::authorization(client.is_some(), target, &headers).cloned(),
            rank: None,
        }
        .build(Vec::new())?;
        match state
            .upstream
            .exchange(request, MODELS_TIMEOUT, crate::fleet::upstream::SMALL_ANSWER_BYTES)
            .await
        {
            Ok((status, upstream_headers, bytes)) => {
                let mut out = Response::new(axum::body::Body::from(bytes));
                *out.status_mut() = status;
                if let Some(ct) = upstream_headers.get(header::CONTENT_TYPE) {
                    out.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
                }
                return Ok(out);
            }
            Err(message) => {
                tracing::warn!(endpoint = %target.label(), error = %message, "GET /v1/models failed");
                failure = Some(ApiError::Upstream {
                    endpoint: target.label(),
                    message: "no answer to GET /v1/models".into(),
                });
            }
        }
    }
    Err(failure.unwrap_or_else(|| dprouter_core::RouteError::NoHealthyEndpoint.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `public_route` answers as the router does: for every route in its tables, their methods, others, and
    /// paths near them.
    #[tokio::test]
    async fn public_route_answers_as_the_router_does() {
        use hyper::service::Service as _;
        let state = AppState::new(crate::GatewayConfig::default()).await.unwrap();
        let router = hyper_util::service::TowerToHyperService::new(router(state));
        let mut paths: Vec<String> = GENERATE_PATHS.iter().map(|p| p.to_string()).collect();
        paths.extend(OTHER_PUBLIC_ROUTES.iter().map(|(p, _)| p.replace("{id}", "resp_1")));
        for path in paths.clone() {
            paths.extend([format!("{path}/x"), format!("{path}?q=1"), format!("/x{path}")]);
        }
        paths.extend(["/", "/v1", "/v1/responses//cancel", "/v1/models/", "/nope"].map(String::from));
        let mut served = 0;
        for path in &paths {
            // HEAD is GET's (its answer has no body to tell a route's 404 from the fallback's).
            let status = |m| public_route(m, path).map_err(|e| e.status());
            assert_eq!(status("HEAD"), status("GET"), "{path}");
            for method in ["GET", "POST", "DELETE", "PUT"] {
                let request = axum::http::Request::builder()
                    .method(method)
                    .uri(path.as_str())
                    .header("content-type", "application/json")
                    .body(axum::body::Body::from("{}"))
                    .unwrap();
                let answer = router.call(request).await.unwrap();
                let status = answer.status().as_u16();
                let body = axum::body::to_bytes(answer.into_body(), 1 << 20).await.unwrap();
                let unrouted = status == 405 || String::from_utf8_lossy(&body).contains("no such route");
                let expected = match public_route(method, path) {
                    Ok(_) => {
                        served += 1;
                        None
                    }
                    Err(e) => Some(e.status().as_u16()),
                };
                let got = unrouted.then_some(status);
                assert_eq!(got, expected, "{method} {path}: the router answered {status}");
            }
        }
        assert!(served >= 14, "{served}");
    }
}
