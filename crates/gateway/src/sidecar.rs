//! `dprouter decode-sidecar`: a disaggregated request's prefill leg, run beside its decode server, for a picker
//! behind a data plane (`dprouter epp` behind Envoy, or llm-d's EPP). The picker sends each request to the decode
//! pod, whose address is this sidecar's, and names the prefill endpoint in `x-prefiller-host-port` (the header
//! llm-d's EPP sets for its routing sidecar); the sidecar runs both legs as `serve` runs them ([`crate::legs`]):
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
//! as it came: the picker probes the decode pod through the sidecar.
//!
//! Either leg failing ends the other: a prefill leg that fails before the decode answer's head drops the decode
//! request (its connection closes, which aborts it at the engine) and the client gets the prefill's 4xx as it came,
//! or a 502/504 that names the prefill endpoint; one that fails while the decode answer streams ends the stream
//! with an error event; the decode answer's end, or the client going away, aborts the prefill leg.
//!
//! The sidecar trusts the header: it sends the prefill leg to the address the header names (an IP address and a
//! port, nothing else). Only the data plane should reach it; dprouter's picker removes clients' copies of the header.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dprouter_core::request_body::{parse_body, Layout, MemberKind};

use crate::routing::laid_out;
use dprouter_core::{Framing, UsageScanner};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use serde_json::value::RawValue;
use tokio::task::JoinHandle;

use crate::config::Backend;
use crate::error::ApiError;
use crate::upstream::{error_chain, Chunks, Upstream};

/// The header that names a request's prefill endpoint, `ip:port` (llm-d's; a list takes its first).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The name llm-d's sidecar read before, still read when the other is absent.
pub const OLD_PREFILLER_HEADER: &str = "x-llm-d-prefiller-host-port";
/// The prefill endpoint's DP rank, which dprouter's picker names for a vLLM prefill leg.
pub const PREFILL_RANK_HEADER: &str = "x-dprouter-prefill-dp-rank";
/// Every header that steers the prefill leg: a picker never passes a client's copy on.
pub const PREFILL_HEADERS: [&str; 3] = [PREFILLER_HEADER, OLD_PREFILLER_HEADER, PREFILL_RANK_HEADER];

/// The response header that says the answer is the prefill leg's failure (value `prefill`), so that a picker
/// counts it against the prefill endpoint rather than the decode one.
pub const FAILED_LEG_HEADER: &str = "x-dprouter-failed-leg";

/// The rank header vLLM reads.
const RANK_HEADER: HeaderName = HeaderName::from_static(crate::routing::RANK_HEADER);

/// The most of a vLLM prefill answer kept, to read its `kv_transfer_params`, and of a prefill error answer.
const MAX_KEPT_BYTES: usize = 1 << 20;

/// What the sidecar is beside and how long it waits.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    /// The decode server's base URL.
    pub decode: String,
    /// How the legs are paired: SGLang's bootstrap room or vLLM's `kv_transfer_params`.
    pub backend: Backend,
    /// The SGLang prefill servers' bootstrap port, for a request whose picker named none.
    pub bootstrap_port: Option<u16>,
    /// The largest request body taken.
    pub max_body_bytes: usize,
    pub connect_timeout: Duration,
    /// Each leg's response head must come within this.
    pub first_byte_timeout: Duration,
    /// A prefill answer's bytes, each within this of the one before.
    pub idle_timeout: Duration,
}

#[derive(Clone)]
struct Sidecar {
    config: Arc<SidecarConfig>,
    upstream: Upstream,
}

/// The sidecar's routes: every path, every method.
pub fn router(config: SidecarConfig) -> Result<axum::Router, String> {
    let tls = crate::tls::client_config(None, "the decode and prefill servers")?;
    let upstream = Upstream::new(config.connect_timeout, Duration::from_secs(90), tls);
    let sidecar = Sidecar {
        config: Arc::new(config),
        upstream,
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
    let deadline = crate::drain_deadline::DrainDeadline::default();
    crate::listener::run(
        listener,
        crate::listener::Protocol::Http1,
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

/// How a prefill leg failed.
enum Failed {
    /// The server answered with an error status (the start of its body).
    Status { status: u16, body: Bytes },
    /// No answer in time, or one that stalled: what, and after how long.
    Timeout(String, Duration),
    /// No connection, or a broken exchange.
    Broken(String),
}

impl Failed {
    fn message(&self, endpoint: &str) -> String {
        match self {
            Failed::Status { status, body } => format!(
                "the prefill leg at {endpoint} answered {status}: {}",
                crate::throttled::clip(String::from_utf8_lossy(body).trim())
            ),
            Failed::Timeout(m, _) => format!("the prefill leg at {endpoint} timed out: {m}"),
            Failed::Broken(m) => format!("the prefill leg at {endpoint} failed: {m}"),
        }
    }

    /// What the client gets when the leg failed before the decode answer began.
    fn answer(self, endpoint: &str) -> Response {
        let mut out = match self {
            Failed::Status { status, body } if (400..500).contains(&status) => crate::legs::client_error(status, body),
            Failed::Timeout(_, after) => ApiError::UpstreamTimeout {
                endpoint: endpoint.to_string(),
                after_ms: after.as_millis() as u64,
            }
            .into_response(),
            failed => ApiError::Upstream {
                message: failed.message(endpoint),
                endpoint: endpoint.to_string(),
            }
            .into_response(),
        };
        out.headers_mut()
            .insert(FAILED_LEG_HEADER, HeaderValue::from_static("prefill"));
        out
    }
}

/// A running prefill leg: aborted when dropped.
struct Leg(JoinHandle<Result<Option<Bytes>, Failed>>);

impl Drop for Leg {
    fn drop(&mut self) {
        self.0.abort();
    }
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
        let prefill = prefill_address(&parts.headers)?;
        let limit = self.config.max_body_bytes;
        let bytes = axum::body::to_bytes(body, limit).await.map_err(|e| {
            let inner = e.into_inner();
            if inner.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                ApiError::TooLarge { limit }
            } else {
                ApiError::BadRequest(format!("the request body broke: {inner}"))
            }
        })?;
        let decode = self.config.decode.clone();
        let Some(prefill) = prefill.filter(|_| parts.method == Method::POST) else {
            let request = leg_request(&parts.method, &decode, &path, &parts.headers, None, vec![bytes])?;
            return self.decode_leg(request, None).await;
        };
        let parsed = parse_body(&bytes, true)?;
        let (layout, rank) = (parsed.layout, parsed.route.rank_override);
        match self.config.backend {
            Backend::Vllm => self.vllm(prefill, &path, &parts.headers, bytes, &layout).await,
            _ => {
                self.sglang(prefill, &path, &parts.headers, (bytes, &layout), rank)
                    .await
            }
        }
    }

    /// SGLang's way: both legs at once, paired by the room (`decode_rank`: the client's body's `routed_dp_rank`,
    /// the decode rank).
    async fn sglang(
        &self,
        prefill: SocketAddr,
        path: &str,
        headers: &HeaderMap,
        (bytes, layout): (Bytes, &Layout),
        decode_rank: Option<i64>,
    ) -> Result<Response, ApiError> {
        let fields: Bootstrap = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::BadRequest(format!("a bootstrap field is not what SGLang takes: {e}")))?;
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
                let prefill_body = laid_out(&bytes, layout, [Bytes::from(members)], |k| {
                    k == MemberKind::Disaggregation
                });
                (prefill_body, vec![bytes.clone()])
            }
            _ => {
                let host = serde_json::Value::from(prefill.ip().to_string());
                let port = self
                    .config
                    .bootstrap_port
                    .map_or_else(|| "null".to_string(), |p| p.to_string());
                let room = crate::pairing::draw() & crate::pairing::MAX_ROOM;
                let members = format!(r#""bootstrap_host":{host},"bootstrap_port":{port},"bootstrap_room":{room}"#);
                let mut decode_members = members.clone();
                if let Some(rank) = decode_rank {
                    decode_members.push_str(&format!(r#","routed_dp_rank":{rank}"#));
                }
                let disaggregation = |k| k == MemberKind::Disaggregation;
                (
                    laid_out(&bytes, layout, [Bytes::from(members)], disaggregation),
                    laid_out(&bytes, layout, [Bytes::from(decode_members)], disaggregation),
                )
            }
        };
        let endpoint = prefill.to_string();
        let base = format!("http://{endpoint}");
        let request = leg_request(&Method::POST, &base, path, headers, Some(None), prefill_body)?;
        let leg = Leg(tokio::spawn(prefill_leg(
            self.upstream.clone(),
            request,
            Arc::clone(&self.config),
            false,
        )));
        let decode = leg_request(&Method::POST, &self.config.decode, path, headers, None, decode_body)?;
        self.decode_leg(decode, Some((leg, endpoint))).await
    }

    /// vLLM's way: the prefill leg to its end, then the decode leg with its `kv_transfer_params`.
    async fn vllm(
        &self,
        prefill: SocketAddr,
        path: &str,
        headers: &HeaderMap,
        bytes: Bytes,
        layout: &Layout,
    ) -> Result<Response, ApiError> {
        let endpoint = prefill.to_string();
        let members = crate::pairing::vllm_prefill_members(path);
        let prefill_body = laid_out(&bytes, layout, [members], |k| {
            matches!(
                k,
                MemberKind::Disaggregation | MemberKind::Streaming | MemberKind::Length
            )
        });
        let rank = headers.get(PREFILL_RANK_HEADER).cloned();
        let base = format!("http://{endpoint}");
        let request = leg_request(&Method::POST, &base, path, headers, Some(rank), prefill_body)?;
        let params = match prefill_leg(self.upstream.clone(), request, Arc::clone(&self.config), true).await {
            Ok(answer) => answer.as_deref().and_then(crate::legs::kv_transfer_params),
            Err(Failed::Status { status, body }) if (400..500).contains(&status) => {
                return Ok(crate::legs::client_error(status, body));
            }
            Err(failed) => {
                tracing::warn!(
                    endpoint,
                    "{}: the decode server prefills the prompt itself",
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
        let decode_body = laid_out(&bytes, layout, member, |k| k == MemberKind::Disaggregation);
        let decode = leg_request(&Method::POST, &self.config.decode, path, headers, None, decode_body)?;
        self.decode_leg(decode, None).await
    }

    /// Sends the decode leg and relays its answer, watching `prefill` (the leg and its endpoint) while it runs.
    async fn decode_leg(
        &self,
        request: hyper::Request<Chunks>,
        mut prefill: Option<(Leg, String)>,
    ) -> Result<Response, ApiError> {
        let after = self.config.first_byte_timeout;
        let decode = self.config.decode.clone();
        let send = tokio::time::timeout(after, self.upstream.send(request));
        tokio::pin!(send);
        let sent = loop {
            let Some((leg, endpoint)) = prefill.as_mut() else {
                break send.as_mut().await;
            };
            tokio::select! {
                sent = send.as_mut() => break sent,
                ended = &mut leg.0 => match ended {
                    // The prefill is done: the decode answer comes next.
                    Ok(Ok(_)) => prefill = None,
                    // The decode request waits for a room that will never be ready: dropped, it is aborted.
                    Ok(Err(failed)) => return Ok(failed.answer(endpoint)),
                    Err(e) => return Err(ApiError::Upstream { endpoint: endpoint.clone(), message: e.to_string() }),
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
            Some((leg, endpoint)) => Body::new(Watched {
                inner: incoming,
                leg: Some(leg),
                endpoint,
                scanner: UsageScanner::new(sse),
                sse,
                done: false,
            }),
            None => Body::new(incoming),
        };
        let mut out = Response::new(body);
        *out.status_mut() = parts.status;
        for (name, value) in &parts.headers {
            if !crate::relay::is_hop_by_hop(name) {
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

/// A leg's request: the client's headers but the hop-by-hop ones, its length (the body's own) and those that
/// steer the prefill leg; `rank`, when given, is the leg's own rank header (`Some(None)`: none).
fn leg_request(
    method: &Method,
    base: &str,
    path: &str,
    headers: &HeaderMap,
    rank: Option<Option<HeaderValue>>,
    pieces: Vec<Bytes>,
) -> Result<hyper::Request<Chunks>, ApiError> {
    let mut builder = hyper::Request::builder()
        .method(method.clone())
        .uri(format!("{}{path}", base.trim_end_matches('/')));
    for (name, value) in headers {
        let steering = PREFILL_HEADERS.contains(&name.as_str());
        let replaced = rank.is_some() && name == RANK_HEADER;
        if !steering && !replaced && name != header::HOST && !crate::relay::is_hop_by_hop(name) {
            builder = builder.header(name, value);
        }
    }
    if let Some(Some(rank)) = rank {
        builder = builder.header(RANK_HEADER, rank);
    }
    builder
        .body(Chunks::new(pieces))
        .map_err(|e| ApiError::BadRequest(format!("cannot build the upstream request: {e}")))
}

/// Sends a prefill leg and reads its answer to the end; returns the answer's first [`MAX_KEPT_BYTES`] when `keep`.
async fn prefill_leg(
    upstream: Upstream,
    request: hyper::Request<Chunks>,
    config: Arc<SidecarConfig>,
    keep: bool,
) -> Result<Option<Bytes>, Failed> {
    let response = match tokio::time::timeout(config.first_byte_timeout, upstream.send(request)).await {
        Err(_) => {
            return Err(Failed::Timeout(
                "no response head in time".into(),
                config.first_byte_timeout,
            ))
        }
        Ok(Err(e)) => return Err(Failed::Broken(error_chain(&e))),
        Ok(Ok(response)) => response,
    };
    let status = response.status();
    let mut body = response.into_body();
    let mut kept = (keep || !status.is_success()).then(Vec::new);
    loop {
        let frame = match tokio::time::timeout(config.idle_timeout, body.frame()).await {
            Err(_) => return Err(Failed::Timeout("its answer stalled".into(), config.idle_timeout)),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(Failed::Broken(format!("its answer broke: {e}"))),
            Ok(Some(Ok(frame))) => frame,
        };
        if let (Ok(data), Some(kept)) = (frame.into_data(), kept.as_mut()) {
            let room = MAX_KEPT_BYTES.saturating_sub(kept.len());
            kept.extend_from_slice(&data[..data.len().min(room)]);
        }
    }
    let kept = kept.map(Bytes::from);
    if !status.is_success() {
        return Err(Failed::Status {
            status: status.as_u16(),
            body: kept.unwrap_or_default(),
        });
    }
    Ok(kept)
}

/// The decode answer, with the prefill leg watched while both run: its failure ends the answer (an SSE stream
/// with an error event), and the answer's end, or its being dropped, aborts it.
struct Watched {
    inner: Incoming,
    leg: Option<Leg>,
    endpoint: String,
    scanner: UsageScanner,
    sse: bool,
    done: bool,
}

impl Watched {
    fn prefill_failed(&mut self, message: String) -> Poll<Option<Result<Frame<Bytes>, crate::body::BoxError>>> {
        tracing::warn!(endpoint = %self.endpoint, "{message}");
        self.done = true;
        self.leg = None;
        if !self.sse {
            return Poll::Ready(Some(Err(message.into())));
        }
        let open = match self.scanner.framing() {
            Framing::EventEnded => "",
            Framing::LineEnded => "\n",
            Framing::InLine => "\n\n",
        };
        let event = serde_json::json!({"error": {"message": message, "type": "upstream_error", "code": 502}});
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!("{open}data: {event}\n\n"))))))
    }
}

impl hyper::body::Body for Watched {
    type Data = Bytes;
    type Error = crate::body::BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(leg) = this.leg.as_mut() {
            if let Poll::Ready(ended) = Pin::new(&mut leg.0).poll(cx) {
                match ended {
                    Ok(Ok(_)) => this.leg = None,
                    Ok(Err(failed)) => {
                        let message = failed.message(&this.endpoint);
                        return this.prefill_failed(message);
                    }
                    Err(e) => return this.prefill_failed(format!("the prefill leg at {} ended: {e}", this.endpoint)),
                }
            }
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.scanner.feed(data);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.done = true;
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                this.done = true;
                this.leg = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    }

    #[test]
    fn the_prefill_endpoint_is_an_ip_and_a_port() {
        assert_eq!(prefill_address(&headers(&[])).unwrap(), None);
        let named = prefill_address(&headers(&[(PREFILLER_HEADER, "10.0.0.5:8000")])).unwrap();
        assert_eq!(named, Some("10.0.0.5:8000".parse().unwrap()));
        // A list takes its first; the older name is read when the header is absent.
        let listed = prefill_address(&headers(&[(OLD_PREFILLER_HEADER, "[fd00::1]:80, 10.0.0.6:80")])).unwrap();
        assert_eq!(listed, Some("[fd00::1]:80".parse().unwrap()));
        for bad in ["prefill-0.svc:8000", "10.0.0.5", "http://10.0.0.5:8000"] {
            let err = prefill_address(&headers(&[(PREFILLER_HEADER, bad)])).unwrap_err();
            assert_eq!(err.status(), 400, "{bad}");
        }
    }

    #[test]
    fn a_leg_gets_the_clients_headers_but_those_that_steer_the_prefill_and_the_hop_by_hop_ones() {
        let client = headers(&[
            (PREFILLER_HEADER, "10.0.0.5:8000"),
            (PREFILL_RANK_HEADER, "1"),
            ("x-data-parallel-rank", "3"),
            ("x-request-id", "abc"),
            ("connection", "keep-alive"),
            ("host", "decode"),
            ("content-length", "99"),
        ]);
        let decode = leg_request(&Method::POST, "http://d:1/", "/v1/completions", &client, None, vec![]).unwrap();
        assert_eq!(decode.uri(), "http://d:1/v1/completions");
        let names: Vec<&str> = decode.headers().keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-data-parallel-rank", "x-request-id"]);
        assert_eq!(decode.headers()["x-data-parallel-rank"], "3");
        let prefill = leg_request(
            &Method::POST,
            "http://p:1",
            "/v1/completions",
            &client,
            Some(client.get(PREFILL_RANK_HEADER).cloned()),
            vec![],
        )
        .unwrap();
        assert_eq!(prefill.headers()["x-data-parallel-rank"], "1");
        assert_eq!(prefill.headers()["x-request-id"], "abc");
        let unranked = leg_request(&Method::POST, "http://p:1", "/", &client, Some(None), vec![]).unwrap();
        assert!(unranked.headers().get("x-data-parallel-rank").is_none());
    }
}
