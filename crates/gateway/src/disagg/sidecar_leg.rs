//! The decode sidecar's prefill leg, run by the one runner ([`crate::disagg::prefill_leg`]): what the client gets
//! when it failed, and the decode answer that watches it while streaming ([`crate::disagg::sidecar`] runs it).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dprouter_core::{Framing, UsageScanner};
use hyper::body::{Frame, Incoming};

use crate::common::error::ApiError;
use crate::disagg::prefill_leg::{self, LegFailure, LegRun, PrefillWatch, Unheard};
use crate::disagg::sidecar::{SidecarConfig, FAILED_LEG_HEADER};
use crate::disagg::trust::MAX_REFLECTED_BYTES;
use crate::fleet::upstream::{Chunks, Upstream};
use crate::pipeline::body::Watch;

/// What the client gets when the prefill leg failed before the decode answer began: its 4xx as it came (clipped
/// to [`MAX_REFLECTED_BYTES`]), a 504 when it timed out, a 502 otherwise, each marked as the prefill leg's.
pub(crate) fn failed_answer(failed: LegFailure, endpoint: &str) -> Response {
    let mut out = match failed {
        LegFailure::Status { status, body } if (400..500).contains(&status) => {
            crate::disagg::legs::client_error(status, body.slice(..body.len().min(MAX_REFLECTED_BYTES)))
        }
        LegFailure::Timeout { after, .. } => ApiError::UpstreamTimeout {
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

/// Sends a prefill leg ([`prefill_leg::run`], with nothing to hear: the sidecar holds no ticket) and reads its
/// answer to the end; returns the answer's first bytes when `keep`.
pub(crate) async fn prefill_leg(
    upstream: Upstream,
    request: hyper::Request<Chunks>,
    (deadline, config): (tokio::time::Instant, Arc<SidecarConfig>),
    keep: bool,
    decode_started: Option<tokio::sync::oneshot::Receiver<()>>,
) -> Result<Option<Bytes>, LegFailure> {
    let run = LegRun {
        head_by: deadline,
        idle: config.idle_timeout,
        keep,
        decode_started,
    };
    prefill_leg::run(&upstream, request, run, &mut Unheard).await
}

/// The decode answer, with the prefill leg watched while both run: its failure ends the answer (an SSE stream
/// with an error event), and the answer's end, or its being dropped, aborts it.
pub(crate) struct Watched {
    pub(crate) inner: Incoming,
    pub(crate) leg: Option<PrefillWatch>,
    pub(crate) scanner: UsageScanner,
    pub(crate) sse: bool,
    pub(crate) done: bool,
}

impl Watched {
    fn prefill_failed(
        &mut self,
        message: String,
    ) -> Poll<Option<Result<Frame<Bytes>, crate::pipeline::body::BoxError>>> {
        tracing::warn!("{message}");
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
            if let Poll::Ready(ended) = leg.poll_outcome(cx) {
                match ended {
                    None => this.leg = None,
                    Some(message) => return this.prefill_failed(message),
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
