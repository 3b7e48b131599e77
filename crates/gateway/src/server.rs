//! The HTTP front end: routes, the admin API, request metrics, and `serve`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use bytes::Bytes;
use dprouter_core::WorkerId;
use futures_util::future::join_all;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::{Backend, WorkerConfig};
use crate::error::ApiError;
use crate::state::AppState;
use crate::{health, proxy, telemetry};

/// Every route of the gateway.
pub fn router(state: Arc<AppState>) -> Router {
    let admin = Router::new()
        .route("/workers", get(list_workers).post(add_worker))
        .route("/workers/{id}", delete(remove_worker))
        .route("/flush_cache", post(flush_cache))
        .route_layer(middleware::from_fn_with_state(Arc::clone(&state), require_admin_key));
    Router::new()
        .route("/v1/chat/completions", post(proxy::generate))
        .route("/v1/completions", post(proxy::generate))
        .route("/generate", post(proxy::generate))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok\n" }))
        .route("/readiness", get(readiness))
        .route("/metrics", get(render_metrics))
        .merge(admin)
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .layer(middleware::from_fn(count_requests))
        .with_state(state)
}

/// Serves the gateway on `listener` until `shutdown` completes, running its background tasks meanwhile.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    telemetry::handle();
    let (stop, stopped) = watch::channel(false);
    let tasks = health::spawn(Arc::clone(&state), stopped);
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let served = axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await;
    let _ = stop.send(true);
    for task in tasks {
        let _ = task.await;
    }
    served
}

async fn count_requests(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched".to_string(), |p| p.as_str().to_string());
    let started = Instant::now();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!(telemetry::REQUESTS, "route" => route.clone(), "status" => status).increment(1);
    metrics::histogram!(telemetry::DURATION, "route" => route).record(started.elapsed().as_secs_f64());
    response
}

async fn require_admin_key(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.config.admin_key {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(request).await
}

async fn readiness(State(state): State<Arc<AppState>>) -> Response {
    let healthy = state.registry.membership().snapshot.healthy().len();
    let status = if healthy > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({"ready": healthy > 0, "healthy_endpoints": healthy})),
    )
        .into_response()
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = telemetry::render(&state.registry.membership());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// `GET /v1/models`, answered by a healthy worker.
async fn models(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let membership = state.registry.membership();
    let target = membership
        .snapshot
        .healthy()
        .first()
        .map(|&i| &membership.targets[i])
        .ok_or(dprouter_core::RouteError::NoHealthyEndpoint)?;
    let request = hyper::Request::get(format!("{}/v1/models", target.base))
        .body(Full::new(Bytes::new()))
        .map_err(|e| ApiError::Unavailable(e.to_string()))?;
    let response = state.upstream.send(request).await.map_err(|e| ApiError::Upstream {
        endpoint: target.label(),
        message: crate::upstream::error_chain(&e),
    })?;
    let (parts, body) = response.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(|e| ApiError::Upstream {
            endpoint: target.label(),
            message: e.to_string(),
        })?
        .to_bytes();
    let mut out = Response::new(axum::body::Body::from(bytes));
    *out.status_mut() = parts.status;
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        out.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
    }
    Ok(out)
}

/// `GET /workers`: every worker and endpoint with health and load, and the policy's decisions.
async fn list_workers(State(state): State<Arc<AppState>>) -> Json<Value> {
    let membership = state.registry.membership();
    let rank_of = |id| membership.targets.iter().position(|t| t.id == id);
    let workers: Vec<Value> = state
        .registry
        .workers()
        .iter()
        .map(|w| {
            let endpoints: Vec<Value> = w
                .endpoints
                .iter()
                .map(|e| {
                    let view = e.load.view();
                    json!({
                        "id": e.id.to_string(),
                        "rank": rank_of(e.id),
                        "dp_rank": e.id.dp_rank,
                        "healthy": w.endpoint_healthy(e),
                        "in_flight_requests": e.load.in_flight_requests(),
                        "in_flight_tokens": e.load.in_flight_tokens(),
                        "load_view": {"requests": view.requests, "tokens": view.tokens},
                        "engine_report": e.load.last_report().map(|r| json!({"requests": r.requests, "waiting": r.waiting, "tokens": r.tokens, "timestamp": r.timestamp})),
                    })
                })
                .collect();
            json!({"id": w.id.0, "url": w.url, "backend": w.backend.as_str(), "dp_size": w.endpoints.len(),
                   "healthy": w.active_healthy(), "endpoints": endpoints})
        })
        .collect();
    Json(json!({"policy": state.policy.name(), "decisions": state.decisions_by_branch(), "workers": workers}))
}

/// `POST /workers` with a worker config (`url`, `backend`, `dp_size`, `rank_field`).
async fn add_worker(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let worker: WorkerConfig =
        serde_json::from_slice(&body).map_err(|e| ApiError::BadRequest(format!("invalid worker: {e}")))?;
    let (id, dp_size) = state.add_worker(&worker).await.map_err(|e| match e {
        crate::state::StartError::Config(c) => ApiError::BadRequest(c.to_string()),
        other => ApiError::Upstream {
            endpoint: worker.url.clone(),
            message: other.to_string(),
        },
    })?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"id": id.0, "url": worker.url, "dp_size": dp_size})),
    )
        .into_response())
}

/// `DELETE /workers/{id}`.
async fn remove_worker(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let id: u32 = id
        .parse()
        .map_err(|_| ApiError::BadRequest(format!("worker id `{id}` is not a number")))?;
    if state.registry.remove_worker(WorkerId(id)) {
        tracing::info!(worker = id, "worker removed");
        Ok(Json(json!({"removed": id})))
    } else {
        Err(ApiError::NotFound(format!("no worker {id}")))
    }
}

/// `POST /flush_cache`: fans out to every SGLang worker.
async fn flush_cache(State(state): State<Arc<AppState>>) -> Response {
    let workers = state.registry.workers_of(Backend::Sglang);
    let timeout = Duration::from_millis(state.config.health.timeout_ms.max(5000));
    let urls: Vec<String> = workers.iter().map(|w| format!("{}/flush_cache", w.url)).collect();
    let answers = join_all(urls.iter().map(|u| state.upstream.post_empty(u, timeout))).await;
    let mut all_ok = true;
    let results: Vec<Value> = workers
        .iter()
        .zip(answers)
        .map(|(w, answer)| match answer {
            Ok(status) => {
                all_ok &= status.is_success();
                json!({"worker": w.id.0, "url": w.url, "status": status.as_u16()})
            }
            Err(e) => {
                all_ok = false;
                json!({"worker": w.id.0, "url": w.url, "error": e})
            }
        })
        .collect();
    let status = if all_ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_GATEWAY
    };
    (status, Json(json!({"results": results}))).into_response()
}
