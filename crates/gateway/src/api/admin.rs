//! The admin API: who may reach it (loopback peers, or everyone with `admin_key`; never a browser page of another
//! origin) and its handlers (`/workers`, `/flush_cache`, `/kv_events`).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use dprouter_core::WorkerId;
use futures_util::future::join_all;
use serde_json::{json, Value};

use crate::common::error::ApiError;
use crate::config::{Backend, WorkerConfig};
use crate::state::AppState;

/// Middleware of the admin routes: [`admin_from_a_browser`], then [`admin_access`] with the connection's peer
/// address, then [`admin_json_post`].
pub(crate) async fn require_admin_key(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: Request,
    next: Next,
) -> Response {
    let peer = request
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|info| info.0);
    let allowed = admin_from_a_browser(&headers, state.config.admin_key.is_some())
        .and_then(|()| {
            admin_access(
                state.config.admin_key.as_deref(),
                peer,
                headers.get(header::AUTHORIZATION),
            )
        })
        .and_then(|()| admin_json_post(request.method(), &headers));
    match allowed {
        Ok(()) => next.run(request).await,
        Err(e) => {
            tracing::debug!(peer = ?peer, error = %e, "admin request refused");
            e.into_response()
        }
    }
}

/// Who may use the admin routes. With an admin key: whoever sends `Authorization: Bearer KEY` (compared in
/// constant time), from any address; 401 otherwise. Without one: loopback clients only (an unknown peer is not
/// loopback); 403 to the others, saying how to open the routes.
fn admin_access(
    admin_key: Option<&str>,
    peer: Option<std::net::SocketAddr>,
    authorization: Option<&axum::http::HeaderValue>,
) -> Result<(), ApiError> {
    match admin_key {
        Some(key) => {
            let given = authorization
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split_once(' '))
                .and_then(|(scheme, token)| scheme.eq_ignore_ascii_case("bearer").then_some(token.trim()));
            match given {
                Some(token) if keys_match(key, token) => Ok(()),
                _ => Err(ApiError::Unauthorized),
            }
        }
        // `to_canonical`: an IPv4 client of a dual-stack listener arrives as `::ffff:127.0.0.1`.
        None if peer.is_some_and(|p| p.ip().to_canonical().is_loopback()) => Ok(()),
        None => Err(ApiError::Forbidden(
            "admin routes answer only loopback clients while no admin key is set: set admin_key in the config \
             file (or --admin-key KEY) and send Authorization: Bearer KEY"
                .into(),
        )),
    }
}

/// What keeps a web page from using the admin routes through its visitor's browser (cross-site requests, DNS
/// rebinding), since a page's `fetch()` reaches loopback too:
/// - a request whose `Origin` is not the gateway's own (the `Host` it was sent to) is refused (403), with or
///   without a key: browsers send `Origin` on every cross-origin request and on same-origin POSTs;
/// - a POST must be `Content-Type: application/json` ([`admin_json_post`], after the access check);
/// - without a key, where access rests on the peer being loopback, the `Host` must be a loopback name or address
///   (`localhost`, `127.0.0.0/8`, `[::1]`; 403 otherwise): a page whose own name was made to resolve to 127.0.0.1
///   sends its own name. With a key, any host name works.
fn admin_from_a_browser(headers: &HeaderMap, keyed: bool) -> Result<(), ApiError> {
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    if let Some(origin) = headers.get(header::ORIGIN) {
        let own = origin
            .to_str()
            .ok()
            .and_then(|o| o.split_once("://"))
            .is_some_and(|(_, authority)| host.is_some_and(|h| h.eq_ignore_ascii_case(authority)));
        if !own {
            return Err(ApiError::Forbidden(
                "admin routes refuse cross-origin requests (the Origin header names another site)".into(),
            ));
        }
    }
    if !keyed && host.is_some_and(|h| !loopback_host(h)) {
        return Err(ApiError::Forbidden(
            "without an admin key, admin routes answer only requests addressed to a loopback name or address \
             (localhost, 127.0.0.1, [::1]): set admin_key to use another host name"
                .into(),
        ));
    }
    Ok(())
}

/// A POST to the admin routes must be `Content-Type: application/json` (415 otherwise, naming the type sent), which
/// a web page can send cross-origin only after a CORS preflight, and CORS never approves the admin routes. Checked
/// after the caller's access, so that an unauthenticated client learns nothing but 401 or 403.
fn admin_json_post(method: &axum::http::Method, headers: &HeaderMap) -> Result<(), ApiError> {
    if *method != axum::http::Method::POST {
        return Ok(());
    }
    let given = headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("(not text)"));
    let media = given.and_then(|v| v.split(';').next()).map(str::trim);
    if media.is_some_and(|m| m.eq_ignore_ascii_case("application/json")) {
        return Ok(());
    }
    Err(ApiError::UnsupportedMediaType(
        given.unwrap_or("(none)").chars().take(100).collect(),
    ))
}

/// Whether a `Host` header names the loopback interface: `localhost` or a loopback address, with or without a port.
fn loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        // `[::1]:8000`
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                name
            } else {
                host
            }
        }),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// Compares two keys in time independent of where they differ, and of their lengths: equal-length BLAKE2b digests
/// compared with `subtle`'s constant-time equality, no early exit.
fn keys_match(expected: &str, given: &str) -> bool {
    use blake2::{Blake2b512, Digest};
    use subtle::ConstantTimeEq;
    let expected = Blake2b512::digest(expected.as_bytes());
    let given = Blake2b512::digest(given.as_bytes());
    expected.as_slice().ct_eq(given.as_slice()).into()
}

/// `GET /kv_events`: each KV event feed's status (precise mode).
pub(crate) async fn kv_events(State(state): State<Arc<AppState>>) -> Json<Value> {
    let mut feeds: Vec<crate::kv_feeds::FeedStatus> = state
        .kv_feeds
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .cloned()
        .collect();
    feeds.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
    Json(json!({ "feeds": feeds }))
}

/// An endpoint's prefill costs as learned from its requests ([`dprouter_core::cost_fit`]): the samples held,
/// and the fit once there is one (`null` until then).
fn prefill_costs(load: &dprouter_core::EndpointLoad) -> Value {
    let fitted = load
        .fitted_costs()
        .map(|f| json!({"base_ms": f.base_us / 1000.0, "tokens_per_s": f.tokens_per_s(), "samples": f.samples}));
    json!({"samples": load.cost_samples(), "fitted": fitted})
}

/// `GET /workers`: every worker and endpoint with health, load, active sessions and learned prefill costs, and the
/// policy's decisions.
pub(crate) async fn list_workers(State(state): State<Arc<AppState>>) -> Json<Value> {
    let membership = state.registry.membership();
    let now = crate::common::clock::now_us();
    let ranks: std::collections::HashMap<_, _> =
        membership.targets.iter().enumerate().map(|(r, t)| (t.id, r)).collect();
    let rank_of = |id| ranks.get(&id).copied();
    let sessions = state.policies.sessions_by_rank(&membership.snapshot, now);
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
                        "ejected": e.ejected(),
                        "ejections": e.ejections(),
                        "in_flight_requests": e.load.in_flight_requests(),
                        "in_flight_tokens": e.load.in_flight_tokens(),
                        "load_view": {"requests": view.requests, "tokens": view.tokens},
                        "engine_report": e.load.last_report().map(|r| json!({"requests": r.requests, "waiting": r.waiting, "tokens": r.tokens, "timestamp": r.timestamp})),
                        "saturated": state.flow.as_ref().map(|f| f.saturated(&e.load, w.kv_capacity, now)),
                        "sessions": rank_of(e.id).and_then(|r| sessions.get(r)).copied().unwrap_or(0),
                        "prefill_costs": prefill_costs(&e.load),
                    })
                })
                .collect();
            json!({"id": w.id.0, "url": &*w.url, "backend": w.backend.as_str(), "dp_size": w.endpoints.len(),
                   "healthy": w.active_healthy(), "probed": w.unprobed.is_none(), "endpoints": endpoints})
        })
        .collect();
    Json(
        json!({"policy": state.policies.default_policy().name(), "decisions": state.decisions_by_branch(), "panic": membership.panic,
                "workers": workers, "pending": state.pending_workers()}),
    )
}

/// `POST /workers` with a worker config: a JSON object of the fields a `[[workers]]` entry takes (`url`,
/// `backend`, `dp_size` (1 to [`MAX_DP_SIZE`](crate::config::MAX_DP_SIZE)), `rank_field`, `kv_events`, ...). Its KV
/// event feeds start with it (under `cache_aware`). 400 for an invalid one, 409 for a URL already registered, 502
/// when the worker cannot tell its ranks: the reason (refused, timed out, …) goes to the log only, so the answer
/// cannot be used to scan ports.
pub(crate) async fn add_worker(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    use crate::config::{worker_url_key, ConfigError};
    use crate::state::StartError;
    let invalid = |e: &dyn std::fmt::Display| ApiError::BadRequest(format!("invalid worker: {e}"));
    let value: Value = serde_json::from_slice(&body).map_err(|e| invalid(&e))?;
    if !value.is_object() {
        return Err(invalid(
            &"send a JSON object with `url` and optionally `backend`, `dp_size`, `rank_field`",
        ));
    }
    let worker: WorkerConfig = serde_json::from_value(value).map_err(|e| invalid(&e))?;
    let uses_events = matches!(state.config.routing, dprouter_core::PolicyConfig::CacheAware(_));
    if !uses_events && (worker.events().is_some() || worker.kv_events_replay.is_some()) {
        return Err(invalid(&format!(
            "KV events are followed under cache_aware only, and this gateway routes with {}",
            state.config.routing.name()
        )));
    }
    let key = worker_url_key(&worker.url);
    if state.pending_workers().iter().any(|url| worker_url_key(url) == key) {
        return Err(ApiError::Conflict(format!(
            "worker {} is configured already and is added when it answers",
            worker.url
        )));
    }
    let (id, dp_size) = state.add_worker(&worker).await.map_err(|e| match e {
        StartError::Config(ConfigError::Invalid(message)) => invalid(&message),
        StartError::Config(other) => invalid(&other),
        // Only the start reads TLS files; an added worker uses the client built then.
        e @ StartError::Tls(_) => ApiError::Unavailable(e.to_string()),
        e @ StartError::Duplicate { .. } => ApiError::Conflict(e.to_string()),
        StartError::Worker { url, message } => {
            tracing::warn!(%url, error = %message, "POST /workers: the worker did not tell its ranks");
            ApiError::Upstream {
                endpoint: url,
                message: "it did not answer GET /get_server_info with a usable dp_size (the gateway's log says \
                          why); check the URL, or give dp_size"
                    .into(),
            }
        }
    })?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"id": id.0, "url": worker.url, "dp_size": dp_size})),
    )
        .into_response())
}

/// `DELETE /workers/{id}`.
pub(crate) async fn remove_worker(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
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
pub(crate) async fn flush_cache(State(state): State<Arc<AppState>>) -> Response {
    let workers = state.registry.workers_of(Backend::Sglang);
    let timeout = Duration::from_millis(state.config.health.timeout_ms.max(5000));
    let urls: Vec<String> = workers.iter().map(|w| format!("{}/flush_cache", w.url)).collect();
    let asked = urls
        .iter()
        .zip(&workers)
        .map(|(u, w)| state.upstream.post_empty(u, w.auth.as_ref(), timeout));
    let answers = join_all(asked).await;
    let mut all_ok = true;
    let results: Vec<Value> = workers
        .iter()
        .zip(answers)
        .map(|(w, answer)| match answer {
            Ok(status) => {
                all_ok &= status.is_success();
                json!({"worker": w.id.0, "url": &*w.url, "status": status.as_u16()})
            }
            Err(e) => {
                all_ok = false;
                json!({"worker": w.id.0, "url": &*w.url, "error": e})
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use std::net::SocketAddr;

    fn peer(addr: &str) -> Option<SocketAddr> {
        Some(addr.parse().unwrap())
    }

    fn status(result: Result<(), ApiError>) -> u16 {
        result.map_or_else(|e| e.status().as_u16(), |()| 200)
    }

    #[test]
    fn loopback_hosts_are_told_from_other_names() {
        for host in [
            "localhost",
            "LocalHost:8000",
            "127.0.0.1",
            "127.1.2.3:80",
            "[::1]",
            "[::1]:8000",
        ] {
            assert!(loopback_host(host), "{host}");
        }
        for host in [
            "example.com",
            "localhost.example.com",
            "10.0.0.1:8000",
            "[::2]:1",
            "127.0.0.1.nip.io",
            "",
        ] {
            assert!(!loopback_host(host), "{host}");
        }
    }

    #[test]
    fn without_a_key_only_loopback_peers_reach_admin_routes() {
        for (addr, expected) in [
            ("127.0.0.1:5000", 200),
            ("127.8.9.10:5000", 200),
            ("[::1]:5000", 200),
            ("[::ffff:127.0.0.1]:5000", 200),
            ("10.0.0.1:5000", 403),
            ("192.168.1.2:5000", 403),
            ("[2001:db8::1]:5000", 403),
            ("[::ffff:10.0.0.1]:5000", 403),
            ("0.0.0.0:5000", 403),
        ] {
            assert_eq!(status(admin_access(None, peer(addr), None)), expected, "{addr}");
        }
        let refused = admin_access(None, None, None).unwrap_err();
        assert_eq!(
            refused.status(),
            StatusCode::FORBIDDEN,
            "an unknown peer is not loopback"
        );
        let body = refused.body();
        assert_eq!(body["error"]["type"], "permission_error");
        assert!(
            body["error"]["message"].as_str().unwrap().contains("admin_key"),
            "{body}"
        );
        // A bearer token does not open them while no key is configured.
        let token = HeaderValue::from_static("Bearer anything");
        assert_eq!(status(admin_access(None, peer("10.0.0.1:1"), Some(&token))), 403);
    }

    #[test]
    fn with_a_key_everyone_needs_it() {
        let key = Some("s3cret");
        let header = |v: &'static str| HeaderValue::from_static(v);
        for addr in ["10.0.0.1:5000", "127.0.0.1:5000", "[::1]:5000"] {
            assert_eq!(
                status(admin_access(key, peer(addr), Some(&header("Bearer s3cret")))),
                200,
                "{addr}"
            );
            assert_eq!(
                status(admin_access(key, peer(addr), Some(&header("bearer  s3cret ")))),
                200,
                "{addr}: the scheme is case-insensitive"
            );
            for wrong in [
                "Bearer s3cre",
                "Bearer s3cret2",
                "Bearer S3CRET",
                "Basic s3cret",
                "s3cret",
                "Bearer ",
            ] {
                assert_eq!(
                    status(admin_access(key, peer(addr), Some(&header(wrong)))),
                    401,
                    "{addr} {wrong}"
                );
            }
            assert_eq!(status(admin_access(key, peer(addr), None)), 401, "{addr}: no header");
        }
        assert_eq!(status(admin_access(key, None, Some(&header("Bearer s3cret")))), 200);
    }

    #[test]
    fn keys_match_exactly() {
        assert!(keys_match("k", "k"));
        assert!(keys_match("a longer key with spaces", "a longer key with spaces"));
        for other in ["", "K", "k ", "kk", "j"] {
            assert!(!keys_match("k", other), "{other:?}");
        }
    }
}
