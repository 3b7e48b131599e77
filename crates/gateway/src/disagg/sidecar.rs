//! `dprouter decode-sidecar`: a disaggregated request's prefill leg, run beside its decode server, for a picker
//! behind a data plane (`dprouter epp` behind Envoy, or llm-d's EPP). The picker sends each request to the decode
//! pod, whose address is this sidecar's, and names the prefill endpoint in `x-prefiller-host-port` (the header
//! llm-d's EPP sets for its routing sidecar); the sidecar runs both legs as `serve` runs them ([`crate::disagg::legs`]):
//!
//! - SGLang: the same body to the prefill server and to the decode server at once, paired by a bootstrap room.
//!   dprouter's picker chose the room already (its residue names the prefill rank) and put the bootstrap fields and
//!   `disagg_prefill_dp_rank` in the body: the decode leg gets the body as it came, the prefill leg the same
//!   bootstrap fields and its rank as `routed_dp_rank`. A body without a room (another picker's) gets a fresh one,
//!   the prefill server's address as `bootstrap_host` and `--bootstrap-port`, as llm-d's sidecar does.
//! - vLLM: the prefill leg first (`kv_transfer_params` asking for a remote decode, one token, not streamed; on the
//!   rank in `x-dprouter-prefill-dp-rank` when the picker names one), then the decode leg with the prefill answer's
//!   `kv_transfer_params`. A prefill that fails on the server's side, or answers without them, leaves the decode
//!   server to prefill the prompt itself; a prefill 4xx goes to the client as it came.
//!
//! A request without the header, and every other route (health, load, metrics, models), goes to the decode server
//! alone (its headers by the one rule, a POST body without pairing fields): the picker probes the decode pod
//! through the sidecar.
//!
//! Either leg failing ends the other: a prefill leg that fails before the decode answer's head drops the decode
//! request (its connection closes, which aborts it at the engine) and the client gets the prefill's 4xx as it came,
//! or a 502/504 that names the prefill endpoint; one that fails while the decode answer streams ends the stream
//! with an error event; the decode answer's end, or the client going away, aborts the prefill leg.
//!
//! What the sidecar trusts, since whoever reaches its port can send it anything:
//! - **Prefill targets**: only those the operator allows (`--prefill-allow`: addresses, IPs or CIDRs; default
//!   none, said at start). A request naming another is refused (403) before any byte leaves.
//! - **Pairing fields**: SGLang's bootstrap fields are kept only when they name the allowed prefill endpoint the
//!   header names (as dprouter's picker sets them); otherwise the request gets a fresh room. A client's
//!   `kv_transfer_params`, `bootstrap_*` and `disagg_prefill_dp_rank` never reach an engine otherwise: they are
//!   dropped from every other POST body too (a body that is not a JSON object is refused).
//! - **Headers**: a request's headers reach the engines by `serve`'s one rule ([`crate::pipeline::engine_headers`]):
//!   its `Authorization`, `X-Api-Key`, `Proxy-Authorization` and `Cookie` go to no engine; the legs carry the
//!   sidecar's own engine key (`--api-key-file`) when it has one.
//! - **Bodies** are read as `serve` reads them ([`crate::admission::body_reader`]): the size limit, a budget of all
//!   bodies arriving at once, the body timeout.
//! - **Reflected errors**: a prefill server's error answer is passed to the client clipped to
//!   [`MAX_REFLECTED_BYTES`].
//!
//! Each refusal is counted in `dprouter_refused_input_total` and logged, at most every few seconds.
//!
//! The prefill leg has its own deadline for its response head (`--prefill-first-byte-timeout-ms`, by default half
//! of the request's), so that a prefill server that never answers is named in the client's 504, and under vLLM the
//! decode server prefills the prompt itself in the time left.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dprouter_core::request_body::{parse_body, Layout, MemberKind};

use crate::pipeline::routing::laid_out;
use dprouter_core::UsageScanner;
use serde_json::value::RawValue;

use crate::admission::body_budget::BodyBudget;
use crate::common::error::ApiError;
use crate::config::Backend;
use crate::disagg::prefill_leg::{LegFailure, PrefillWatch};
use crate::disagg::sidecar_leg::{failed_answer, prefill_leg, Watched};
use crate::disagg::trust::{names_ip, without_pairing_fields, PrefillAllow, MAX_REFLECTED_BYTES};
use crate::fleet::upstream::{error_chain, Chunks, Upstream};
use crate::pipeline::engine_headers::EngineRequest;

/// The header that names a request's prefill endpoint, `ip:port` (llm-d's; a list takes its first).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The name llm-d's sidecar read before, still read when the other is absent.
pub const OLD_PREFILLER_HEADER: &str = "x-llm-d-prefiller-host-port";
/// The prefill endpoint's DP rank, which dprouter's picker names for a vLLM prefill leg.
pub const PREFILL_RANK_HEADER: &str = "x-dprouter-prefill-dp-rank";

/// The response header that says the answer is the prefill leg's failure (value `prefill`), so that a picker
/// counts it against the prefill endpoint rather than the decode one.
pub const FAILED_LEG_HEADER: &str = "x-dprouter-failed-leg";

/// The rank header vLLM reads.
const RANK_HEADER: HeaderName = HeaderName::from_static(crate::pipeline::routing::RANK_HEADER);

/// What the sidecar is beside and how long it waits.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    /// The decode server's base URL.
    pub decode: String,
    /// How the legs are paired: SGLang's bootstrap room or vLLM's `kv_transfer_params`.
    pub backend: Backend,
    /// The SGLang prefill servers' bootstrap port, for a request whose picker named none.
    pub bootstrap_port: Option<u16>,
    /// The prefill endpoints a request may name (none: every request naming one is refused).
    pub prefill_allow: Vec<PrefillAllow>,
    /// The key the legs carry to the engines (`Authorization: Bearer`), if they need one.
    pub api_key: Option<String>,
    /// The largest request body taken.
    pub max_body_bytes: usize,
    /// Request body bytes held across all requests while they arrive (`serve`'s `max_buffered_body_bytes`).
    pub max_buffered_body_bytes: usize,
    /// A request body must arrive whole within this (`serve`'s `request_body_timeout_ms`).
    pub request_body_timeout: Duration,
    pub connect_timeout: Duration,
    /// The decode leg's response head must come within this of the request's arrival.
    pub first_byte_timeout: Duration,
    /// The prefill leg's response head must come within this (and within the request's deadline).
    pub prefill_first_byte_timeout: Duration,
    /// A prefill answer's bytes, each within this of the one before.
    pub idle_timeout: Duration,
}

#[derive(Clone)]
struct Sidecar {
    config: Arc<SidecarConfig>,
    upstream: Upstream,
    /// `Authorization` for the engines, from [`SidecarConfig::api_key`].
    authorization: Option<HeaderValue>,
    /// The bodies arriving at once.
    bodies: Arc<BodyBudget>,
}

/// The sidecar's routes: every path, every method.
pub fn router(config: SidecarConfig) -> Result<axum::Router, String> {
    let tls = crate::http::tls::client_config(None, "the decode and prefill servers")?;
    let upstream = Upstream::new(config.connect_timeout, Duration::from_secs(90), tls);
    let authorization = match &config.api_key {
        Some(key) => Some(
            HeaderValue::from_str(&format!("Bearer {}", key.trim()))
                .map_err(|_| "the engines' API key is not a header value".to_string())?,
        ),
        None => None,
    };
    if config.prefill_allow.is_empty() {
        tracing::warn!(
            "no --prefill-allow: every request that names a prefill endpoint ({PREFILLER_HEADER}) is refused; \
             allow the prefill servers' addresses or network"
        );
    }
    let sidecar = Sidecar {
        bodies: BodyBudget::new(config.max_buffered_body_bytes),
        config: Arc::new(config),
        upstream,
        authorization,
    };
    Ok(axum::Router::new().fallback(handle).with_state(sidecar))
}

/// Serves the sidecar on `listener` until `shutdown` completes, then lets the requests in flight finish: the
/// gateway's own listener, with `serve`'s connection limits and timeouts (`server`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: SidecarConfig,
    server: &crate::config::ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let app = router(config)?;
    let deadline = crate::common::drain_deadline::DrainDeadline::default();
    crate::http::listener::run(
        listener,
        crate::http::listener::Protocol::Http1,
        app,
        server,
        None,
        &deadline,
        shutdown,
    )
    .await
    .map_err(|e| e.to_string())
}

async fn handle(State(sidecar): State<Sidecar>, request: Request) -> Response {
    sidecar
        .handle(request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// The bootstrap fields dprouter's picker put in an SGLang body, as they came.
#[derive(serde::Deserialize, Default)]
struct Bootstrap<'a> {
    #[serde(borrow)]
    bootstrap_host: Option<&'a RawValue>,
    #[serde(borrow)]
    bootstrap_port: Option<&'a RawValue>,
    #[serde(borrow)]
    bootstrap_room: Option<&'a RawValue>,
    disagg_prefill_dp_rank: Option<u32>,
}

impl Sidecar {
    async fn handle(&self, request: Request) -> Result<Response, ApiError> {
        let (parts, body) = request.into_parts();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
        let prefill = prefill_address(&parts.headers)?.filter(|_| parts.method == Method::POST);
        if let Some(at) = prefill {
            if !self.config.prefill_allow.iter().any(|a| a.allows(at)) {
                crate::observe::refusals::refused("prefill_target", || {
                    format!("a request named the prefill endpoint {at}, which --prefill-allow does not allow: refused")
                });
                return Err(ApiError::Forbidden(format!(
                    "the prefill endpoint {at} is not allowed here (--prefill-allow)"
                )));
            }
        }
        let deadline = tokio::time::Instant::now() + self.config.first_byte_timeout;
        let (limit, timeout) = (self.config.max_body_bytes, self.config.request_body_timeout);
        let bytes = crate::admission::body_reader::read(&self.bodies, limit, timeout, &parts.headers, body).await?;
        let decode = self.config.decode.clone();
        let Some(prefill) = prefill else {
            let bytes = if parts.method == Method::POST {
                without_pairing_fields(bytes)?
            } else {
                bytes
            };
            let request = self.leg_request(&parts.method, &decode, &path, &parts.headers, None, vec![bytes])?;
            return self.decode_leg(request, None, deadline).await;
        };
        let parsed = parse_body(&bytes, true)?;
        let (layout, rank) = (parsed.layout, parsed.route.rank_override);
        let legs = Legs {
            prefill,
            path: &path,
            headers: &parts.headers,
            deadline,
        };
        match self.config.backend {
            Backend::Vllm => self.vllm(legs, bytes, &layout).await,
            _ => self.sglang(legs, (bytes, &layout), rank).await,
        }
    }

    /// The prefill leg's deadline: its own budget, within the request's.
    fn prefill_deadline(&self, request: tokio::time::Instant) -> tokio::time::Instant {
        request.min(tokio::time::Instant::now() + self.config.prefill_first_byte_timeout)
    }

    /// A leg's request: the client's headers by the one rule (`crate::pipeline::engine_headers`: as they came
    /// or under their own rule, the trace context as it came), the picker's rank header, the sidecar's own engine
    /// key rather than any request's; `rank`, when given, is the leg's own rank header (`Some(None)`: none).
    fn leg_request(
        &self,
        method: &Method,
        base: &str,
        path: &str,
        headers: &HeaderMap,
        rank: Option<Option<HeaderValue>>,
        pieces: Vec<Bytes>,
    ) -> Result<hyper::Request<Chunks>, ApiError> {
        let rank = match rank {
            Some(rank) => rank,
            None => headers.get(RANK_HEADER).cloned(),
        };
        EngineRequest {
            method: method.clone(),
            url: format!("{}{path}", base.trim_end_matches('/')),
            client: headers,
            traceparent: None,
            content_type: headers.get(header::CONTENT_TYPE).cloned(),
            authorization: self.authorization.clone(),
            rank: rank.map(|rank| (RANK_HEADER, rank)),
        }
        .build(pieces)
    }

    /// SGLang's way: both legs at once, paired by the room (`decode_rank`: the client's body's `routed_dp_rank`,
    /// the decode rank).
    async fn sglang(
        &self,
        legs: Legs<'_>,
        (bytes, layout): (Bytes, &Layout),
        decode_rank: Option<i64>,
    ) -> Result<Response, ApiError> {
        let Legs {
            prefill,
            path,
            headers,
            deadline,
        } = legs;
        let mut fields: Bootstrap = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::BadRequest(format!("a bootstrap field is not what SGLang takes: {e}")))?;
        // The picker's pairing names the prefill endpoint the header names; any other is not the picker's.
        if let Some(host) = fields.bootstrap_host.filter(|h| !names_ip(h, prefill.ip())) {
            let host = crate::common::throttled::clip(host.get()).into_owned();
            crate::observe::refusals::refused("client_field", move || {
                format!("bootstrap_host {host} is not the prefill endpoint {prefill}: the request gets a fresh room")
            });
            fields = Bootstrap::default();
        }
        let rank_of_header = headers
            .get(PREFILL_RANK_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u32>().ok());
        let (prefill_body, decode_body) = match (fields.bootstrap_host, fields.bootstrap_room) {
            // The picker paired the legs: the decode leg gets the body as it came.
            (Some(host), Some(room)) => {
                let port = fields.bootstrap_port.map_or("null", RawValue::get);
                let mut members = format!(
                    r#""bootstrap_host":{},"bootstrap_port":{port},"bootstrap_room":{}"#,
                    host.get(),
                    room.get()
                );
                if let Some(rank) = fields.disagg_prefill_dp_rank.or(rank_of_header) {
                    members.push_str(&format!(r#","routed_dp_rank":{rank}"#));
                }
                let prefill_body = laid_out(&bytes, layout, [Bytes::from(members)], MemberKind::is_pairing);
                (prefill_body, vec![bytes.clone()])
            }
            _ => {
                let host = serde_json::Value::from(prefill.ip().to_string());
                let port = self
                    .config
                    .bootstrap_port
                    .map_or_else(|| "null".to_string(), |p| p.to_string());
                let room = crate::pipeline::pairing::draw() & crate::pipeline::pairing::MAX_ROOM;
                let members = format!(r#""bootstrap_host":{host},"bootstrap_port":{port},"bootstrap_room":{room}"#);
                let mut decode_members = members.clone();
                if let Some(rank) = decode_rank {
                    decode_members.push_str(&format!(r#","routed_dp_rank":{rank}"#));
                }
                let disaggregation = MemberKind::is_pairing;
                (
                    laid_out(&bytes, layout, [Bytes::from(members)], disaggregation),
                    laid_out(&bytes, layout, [Bytes::from(decode_members)], disaggregation),
                )
            }
        };
        let endpoint = prefill.to_string();
        let base = format!("http://{endpoint}");
        let request = self.leg_request(&Method::POST, &base, path, headers, Some(None), prefill_body)?;
        let (upstream, config) = (self.upstream.clone(), Arc::clone(&self.config));
        let leg_deadline = self.prefill_deadline(deadline);
        let leg = PrefillWatch::spawn(endpoint, |decode_started| async move {
            let leg = prefill_leg(upstream, request, (leg_deadline, config), false, Some(decode_started));
            leg.await.map(|_| ())
        });
        let decode = self.leg_request(&Method::POST, &self.config.decode, path, headers, None, decode_body)?;
        self.decode_leg(decode, Some(leg), deadline).await
    }

    /// vLLM's way: the prefill leg to its end, then the decode leg with its `kv_transfer_params`.
    async fn vllm(&self, legs: Legs<'_>, bytes: Bytes, layout: &Layout) -> Result<Response, ApiError> {
        let Legs {
            prefill,
            path,
            headers,
            deadline,
        } = legs;
        let endpoint = prefill.to_string();
        let members = crate::pipeline::pairing::vllm_prefill_members(path);
        let prefill_body = laid_out(&bytes, layout, [members], |k| {
            matches!(
                k,
                MemberKind::Disaggregation | MemberKind::BootstrapRoom | MemberKind::Streaming | MemberKind::Length
            )
        });
        let rank = headers.get(PREFILL_RANK_HEADER).cloned();
        let base = format!("http://{endpoint}");
        let request = self.leg_request(&Method::POST, &base, path, headers, Some(rank), prefill_body)?;
        let config = (self.prefill_deadline(deadline), Arc::clone(&self.config));
        let params = match prefill_leg(self.upstream.clone(), request, config, true, None).await {
            Ok(answer) => answer.as_deref().and_then(crate::disagg::legs::kv_transfer_params),
            Err(LegFailure::Status { status, body }) if (400..500).contains(&status) => {
                let body = body.slice(..body.len().min(MAX_REFLECTED_BYTES));
                return Ok(crate::disagg::legs::client_error(status, body));
            }
            Err(failed) => {
                tracing::warn!(
                    endpoint,
                    "{}: the decode server prefills the prompt itself (in the time left)",
                    failed.message(&endpoint)
                );
                None
            }
        };
        if params.is_none() {
            tracing::debug!(endpoint, "no kv_transfer_params from the prefill leg");
        }
        let member = params.map(|params| {
            let mut member = b"\"kv_transfer_params\":".to_vec();
            member.extend_from_slice(&params);
            Bytes::from(member)
        });
        let decode_body = laid_out(&bytes, layout, member, MemberKind::is_pairing);
        let decode = self.leg_request(&Method::POST, &self.config.decode, path, headers, None, decode_body)?;
        self.decode_leg(decode, None, deadline).await
    }

    /// Sends the decode leg and relays its answer, watching `prefill` (the leg and its endpoint) while it runs.
    async fn decode_leg(
        &self,
        request: hyper::Request<Chunks>,
        mut prefill: Option<PrefillWatch>,
        deadline: tokio::time::Instant,
    ) -> Result<Response, ApiError> {
        let after = self.config.first_byte_timeout;
        let decode = self.config.decode.clone();
        let send = tokio::time::timeout_at(deadline, self.upstream.send(request));
        tokio::pin!(send);
        let sent = loop {
            let Some(leg) = prefill.as_mut() else {
                break send.as_mut().await;
            };
            tokio::select! {
                sent = send.as_mut() => break sent,
                ended = &mut leg.handle => match ended {
                    // The prefill is done: the decode answer comes next.
                    Ok(Ok(())) => prefill = None,
                    // The decode request waits for a room that will never be ready: dropped, it is aborted.
                    Ok(Err(failed)) => return Ok(failed_answer(failed, &leg.endpoint)),
                    Err(e) => return Err(ApiError::Upstream { endpoint: leg.endpoint.clone(), message: e.to_string() }),
                },
            }
        };
        let response = match sent {
            Err(_) => {
                return Err(ApiError::UpstreamTimeout {
                    endpoint: decode,
                    after_ms: after.as_millis() as u64,
                })
            }
            Ok(Err(e)) => {
                return Err(ApiError::Upstream {
                    endpoint: decode,
                    message: error_chain(&e),
                })
            }
            Ok(Ok(response)) => response,
        };
        let (parts, incoming) = response.into_parts();
        if !parts.status.is_success() {
            // No decode server will fetch the room: the prefill leg ends now.
            prefill = None;
        }
        let sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("text/event-stream"));
        let body = match prefill {
            Some(leg) => Body::new(Watched {
                inner: incoming,
                leg: Some(leg),
                scanner: UsageScanner::new(sse),
                sse,
                done: false,
            }),
            None => Body::new(incoming),
        };
        let mut out = Response::new(body);
        *out.status_mut() = parts.status;
        for (name, value) in &parts.headers {
            if !crate::pipeline::relay::is_hop_by_hop(name) {
                out.headers_mut().append(name.clone(), value.clone());
            }
        }
        Ok(out)
    }
}

/// The prefill endpoint a request names, if any: the first address of the header, which must be `ip:port`.
fn prefill_address(headers: &HeaderMap) -> Result<Option<SocketAddr>, ApiError> {
    let Some(value) = headers
        .get(PREFILLER_HEADER)
        .or_else(|| headers.get(OLD_PREFILLER_HEADER))
    else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or("");
    let first = text.split(',').next().unwrap_or("").trim();
    if first.is_empty() {
        return Ok(None);
    }
    first.parse().map(Some).map_err(|_| {
        ApiError::BadRequest(format!(
            "{PREFILLER_HEADER} must name the prefill endpoint as ip:port, not {first:?}"
        ))
    })
}

/// Where a request's two legs go, and by when.
#[derive(Clone, Copy)]
struct Legs<'a> {
    prefill: SocketAddr,
    path: &'a str,
    headers: &'a HeaderMap,
    /// The decode answer's head must come by then.
    deadline: tokio::time::Instant,
}

#[cfg(test)]
#[path = "sidecar_tests.rs"]
mod tests;
