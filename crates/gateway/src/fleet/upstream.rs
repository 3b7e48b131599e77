//! The HTTP client to workers (plain HTTP, or TLS for `https://` ones): forwarding, probes, discovery and load
//! polling.

use std::time::Duration;

use bytes::Bytes;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::body::{Body, Frame, SizeHint};
use hyper::header::HeaderValue;
use hyper::{Method, Request, Response, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde_json::Value;

use crate::config::{Backend, WorkerConfig, MAX_DP_SIZE};

pub type UpstreamError = hyper_util::client::legacy::Error;

/// Why a health probe did not pass.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// No answer within the probe's timeout.
    #[error("{0}")]
    Slow(String),
    /// Anything else: a refused connection, a TLS handshake that failed, a status other than 200, a bad answer.
    #[error("{0}")]
    Failed(String),
}

/// The most the gateway reads of an engine's answer that it reads itself and that is small by nature (`/health`,
/// `/get_server_info`, `/get_load`, `/v1/models`, `/flush_cache`): an engine streaming gigabytes there must not
/// make the gateway hold them.
pub const SMALL_ANSWER_BYTES: usize = 1 << 20;

/// A pooled HTTP/1 client.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, Chunks>,
}

impl Upstream {
    /// A client whose connections take at most `connect_timeout` to open (TCP; a TLS handshake counts against
    /// the first-byte timeout) and are closed after `idle_timeout` unused in the pool (the pool enforces its idle
    /// timeout only with a timer). `tls` serves `https://` workers.
    pub fn new(connect_timeout: Duration, idle_timeout: Duration, tls: rustls::ClientConfig) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        connector.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        Self {
            client: Client::builder(TokioExecutor::new())
                .pool_timer(TokioTimer::new())
                .pool_idle_timeout(idle_timeout)
                .build(connector),
        }
    }

    pub async fn send(&self, request: Request<Chunks>) -> Result<Response<Incoming>, UpstreamError> {
        self.client.request(request).await
    }

    /// A request with no body and a deadline; returns the status and the whole body, of at most
    /// [`SMALL_ANSWER_BYTES`].
    async fn simple(
        &self,
        method: Method,
        url: &str,
        auth: Option<&HeaderValue>,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), String> {
        let mut builder = Request::builder().method(method).uri(url);
        if let Some(auth) = auth {
            builder = builder.header(hyper::header::AUTHORIZATION, auth);
        }
        let request = builder
            .body(Chunks::default())
            .map_err(|e| format!("bad URL {url}: {e}"))?;
        let (status, _, body) = self.exchange(request, timeout, SMALL_ANSWER_BYTES).await?;
        Ok((status, body))
    }

    /// Sends `request` and reads the whole answer, all within `timeout`: status, headers and body, which must not
    /// exceed `max_bytes` (it is read up to there, and no further, before it is an error).
    pub async fn exchange(
        &self,
        request: Request<Chunks>,
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<(StatusCode, hyper::HeaderMap, Bytes), String> {
        let url = request.uri().to_string();
        let exchange = async {
            let response = self.client.request(request).await.map_err(|e| error_chain(&e))?;
            let (parts, body) = response.into_parts();
            let body = http_body_util::Limited::new(body, max_bytes)
                .collect()
                .await
                .map_err(|e| format!("{url}: {e} (at most {max_bytes} bytes are read)"))?
                .to_bytes();
            Ok((parts.status, parts.headers, body))
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| format!("{url}: no answer within {timeout:?}"))?
    }

    /// `GET url/health` answered 200 within the timeout (with a body of at most [`SMALL_ANSWER_BYTES`]); otherwise
    /// why not (a refused connection, a failed TLS handshake and its reason, a status), or that it was slow.
    pub async fn probe(&self, base: &str, auth: Option<&HeaderValue>, timeout: Duration) -> Result<(), ProbeError> {
        let url = format!("{base}/health");
        // The exchange's own deadline is a little later, so that this one tells a slow answer from the others.
        let answer = tokio::time::timeout(timeout, self.simple(Method::GET, &url, auth, timeout + timeout / 2)).await;
        match answer {
            Err(_) => Err(ProbeError::Slow(format!("{url}: no answer within {timeout:?}"))),
            Ok(Err(reason)) => Err(ProbeError::Failed(reason)),
            Ok(Ok((StatusCode::OK, _))) => Ok(()),
            Ok(Ok((status, _))) => Err(ProbeError::Failed(format!("{url}: status {status}"))),
        }
    }

    /// `GET url` (with the worker's `auth`), its JSON answer.
    pub async fn get_json(&self, url: &str, auth: Option<&HeaderValue>, timeout: Duration) -> Result<Value, String> {
        let (status, body) = self.simple(Method::GET, url, auth, timeout).await?;
        if !status.is_success() {
            return Err(format!("{url}: status {status}"));
        }
        serde_json::from_slice(&body).map_err(|e| format!("{url}: invalid JSON: {e}"))
    }

    /// `POST url` with an empty body; the answer's status.
    pub async fn post_empty(
        &self,
        url: &str,
        auth: Option<&HeaderValue>,
        timeout: Duration,
    ) -> Result<StatusCode, String> {
        Ok(self.simple(Method::POST, url, auth, timeout).await?.0)
    }

    /// What a worker serves: its DP ranks (configured, or read from SGLang's `/get_server_info`) and, from SGLang,
    /// each rank's KV capacity (`max_total_num_tokens`).
    pub async fn discover(&self, worker: &WorkerConfig, timeout: Duration) -> Result<WorkerInfo, String> {
        let mut info = self.discover_ranks(worker, timeout).await?;
        info.models = if worker.models.is_empty() {
            self.served_models(worker, timeout).await
        } else {
            worker.models.clone()
        };
        Ok(info)
    }

    /// The model ids of an OpenAI-style `GET /v1/models` (`data[].id`); none when it does not answer so.
    async fn served_models(&self, worker: &WorkerConfig, timeout: Duration) -> Vec<String> {
        let url = format!("{}/v1/models", worker.url.trim_end_matches('/'));
        let auth = worker.api_key.as_ref().and_then(|k| k.bearer());
        let listed = self.get_json(&url, auth.as_ref(), timeout).await.unwrap_or_default();
        listed["data"]
            .as_array()
            .map(|models| {
                models
                    .iter()
                    .filter_map(|m| m["id"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }

    async fn discover_ranks(&self, worker: &WorkerConfig, timeout: Duration) -> Result<WorkerInfo, String> {
        match worker.backend {
            Backend::Vllm | Backend::Openai => Ok(WorkerInfo {
                dp_size: worker.dp_size.unwrap_or(1),
                kv_capacity: None,
                models: Vec::new(),
            }),
            Backend::Sglang => {
                let url = format!("{}/get_server_info", worker.url.trim_end_matches('/'));
                let auth = worker.api_key.as_ref().and_then(|k| k.bearer());
                let info = match (self.get_json(&url, auth.as_ref(), timeout).await, worker.dp_size) {
                    (Ok(info), _) => info,
                    // The rank count is known; the capacity is a refinement.
                    (Err(_), Some(dp_size)) => {
                        return Ok(WorkerInfo {
                            dp_size,
                            kv_capacity: None,
                            models: Vec::new(),
                        })
                    }
                    (Err(e), None) => return Err(format!("{e}; pass --dp-size")),
                };
                let dp_size = match worker.dp_size {
                    Some(n) => n,
                    None => {
                        let reported = info
                            .get("dp_size")
                            .and_then(Value::as_u64)
                            .ok_or_else(|| format!("{url}: no dp_size in the answer; pass --dp-size"))?;
                        // A worker claiming billions of ranks must not make the gateway allocate for them.
                        u32::try_from(reported)
                            .ok()
                            .filter(|n| (1..=MAX_DP_SIZE).contains(n))
                            .ok_or_else(|| {
                                format!("{url}: reported dp_size {reported} is not between 1 and {MAX_DP_SIZE}")
                            })?
                    }
                };
                Ok(WorkerInfo {
                    dp_size,
                    kv_capacity: info.get("max_total_num_tokens").and_then(Value::as_u64),
                    models: Vec::new(),
                })
            }
        }
    }
}

/// What discovery learned about a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    pub dp_size: u32,
    /// KV cache tokens per rank, when the engine says.
    pub kv_capacity: Option<u64>,
    /// The models it serves (configured, or from its `/v1/models`); empty when unknown.
    pub models: Vec<String>,
}

/// An error with its causes, for logs and messages ("client error (Connect): tcp connect error: refused").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// A request body sent as a list of byte slices (zero-copy pieces of the client's body), with its exact length,
/// so that it goes out with a `Content-Length`.
#[derive(Debug, Default)]
pub struct Chunks {
    pieces: VecDeque<Bytes>,
    remaining: u64,
}

impl Chunks {
    pub fn new(pieces: impl IntoIterator<Item = Bytes>) -> Self {
        let pieces: VecDeque<Bytes> = pieces.into_iter().filter(|b| !b.is_empty()).collect();
        let remaining = pieces.iter().map(|b| b.len() as u64).sum();
        Self { pieces, remaining }
    }
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let piece = self.pieces.pop_front();
        if let Some(p) = &piece {
            self.remaining -= p.len() as u64;
        }
        Poll::Ready(piece.map(|p| Ok(Frame::data(p))))
    }

    fn is_end_stream(&self) -> bool {
        self.pieces.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}
