//! The decode sidecar's prefill leg: sent, read to its end (its answer kept for vLLM's `kv_transfer_params`),
//! watched while the decode answer streams, and how it failed ([`crate::disagg::sidecar`] runs it).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dprouter_core::{Framing, UsageScanner};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use tokio::task::JoinHandle;

use crate::common::error::ApiError;
use crate::disagg::sidecar::{SidecarConfig, FAILED_LEG_HEADER};
use crate::disagg::trust::MAX_REFLECTED_BYTES;
use crate::fleet::upstream::{error_chain, Chunks, Upstream};

/// The most of a vLLM prefill answer kept, to read its `kv_transfer_params`.
const MAX_KEPT_BYTES: usize = 1 << 20;

/// How a prefill leg failed.
pub(crate) enum Failed {
    /// The server answered with an error status (the start of its body).
    Status { status: u16, body: Bytes },
    /// No answer in time, or one that stalled: what, and after how long.
    Timeout(String, Duration),
    /// No connection, or a broken exchange.
    Broken(String),
}

impl Failed {
    pub(crate) fn message(&self, endpoint: &str) -> String {
        match self {
            Failed::Status { status, body } => format!(
                "the prefill leg at {endpoint} answered {status}: {}",
                crate::common::throttled::clip(String::from_utf8_lossy(body).trim())
            ),
            Failed::Timeout(m, _) => format!("the prefill leg at {endpoint} timed out: {m}"),
            Failed::Broken(m) => format!("the prefill leg at {endpoint} failed: {m}"),
        }
    }

    /// What the client gets when the leg failed before the decode answer began.
    pub(crate) fn answer(self, endpoint: &str) -> Response {
        let mut out = match self {
            Failed::Status { status, body } if (400..500).contains(&status) => {
                crate::disagg::legs::client_error(status, body.slice(..body.len().min(MAX_REFLECTED_BYTES)))
            }
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
pub(crate) struct Leg(pub(crate) JoinHandle<Result<Option<Bytes>, Failed>>);

impl Drop for Leg {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Sends a prefill leg and reads its answer to the end; returns the answer's first [`MAX_KEPT_BYTES`] when `keep`.
pub(crate) async fn prefill_leg(
    upstream: Upstream,
    request: hyper::Request<Chunks>,
    (deadline, config): (tokio::time::Instant, Arc<SidecarConfig>),
    keep: bool,
) -> Result<Option<Bytes>, Failed> {
    let started = tokio::time::Instant::now();
    let response = match tokio::time::timeout_at(deadline, upstream.send(request)).await {
        Err(_) => {
            return Err(Failed::Timeout(
                "no response head in time".into(),
                deadline.duration_since(started),
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
            let most = if status.is_success() {
                MAX_KEPT_BYTES
            } else {
                MAX_REFLECTED_BYTES
            };
            let room = most.saturating_sub(kept.len());
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
pub(crate) struct Watched {
    pub(crate) inner: Incoming,
    pub(crate) leg: Option<Leg>,
    pub(crate) endpoint: String,
    pub(crate) scanner: UsageScanner,
    pub(crate) sse: bool,
    pub(crate) done: bool,
}

impl Watched {
    fn prefill_failed(
        &mut self,
        message: String,
    ) -> Poll<Option<Result<Frame<Bytes>, crate::pipeline::body::BoxError>>> {
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
    type Error = crate::pipeline::body::BoxError;

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
