//! The response body handed to the client: the upstream body, unchanged and unbuffered, holding the request's load
//! guard until it ends.
//!
//! Whatever way the exchange ends (the upstream finishes, the upstream breaks, or the client disconnects and hyper
//! drops this body), the [`LoadGuard`] is dropped exactly once with it, releasing the endpoint's in-flight count,
//! and dropping the upstream body closes the upstream connection, which cancels the request at the engine. On the
//! way it records the time to the first byte and releases the request's queued-prefill share there (the engine has
//! finished its prefill), and keeps the tail of the response to read the engine's usage report (prompt and cached
//! tokens) at the end, which goes to the metrics and to the policy's `observe`.
//!
//! Two deadlines bound a response that stalls: its first byte must come by the request's first-byte deadline,
//! and each later byte within the stream idle timeout of the one before. An upstream body that breaks or stalls
//! mid-way counts against the endpoint and ends an SSE stream with one `data: {"error": …}` event (after ending
//! a partial line, so clients parse it as an event) and no `[DONE]`, which OpenAI clients raise on; any other
//! body breaks.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dprouter_core::{EndpointId, LoadGuard};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use serde_json::Value;
use tokio::time::Sleep;

use crate::registry::{Failure, Registry};
use crate::telemetry;

/// Called once with the engine-reported cached tokens of the request (the policy's `observe`).
pub type Observer = Box<dyn FnOnce(u64) + Send>;

/// How much of the end of a response is kept for the usage report.
const TAIL_BYTES: usize = 64 << 10;
/// Whole JSON (non-streaming) responses up to this size are kept to read their usage.
const WHOLE_BYTES: usize = 4 << 20;

/// The error a relayed body ends with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// When the request arrived, and when its response must make progress.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// The request was received (time to first token is measured from here).
    pub received: Instant,
    /// The first byte of the body must arrive by then.
    pub first_byte: tokio::time::Instant,
    /// Each later byte within this of the one before.
    pub idle: Duration,
}

pub struct GuardedBody {
    inner: Incoming,
    deadline: Pin<Box<Sleep>>,
    idle: Duration,
    guard: Option<LoadGuard>,
    endpoint: EndpointId,
    label: String,
    registry: Arc<Registry>,
    observer: Option<Observer>,
    received: Instant,
    first_byte: bool,
    sse: bool,
    tail: Vec<u8>,
    truncated: bool,
    done: bool,
}

impl GuardedBody {
    pub fn new(
        inner: Incoming,
        guard: LoadGuard,
        endpoint: EndpointId,
        registry: Arc<Registry>,
        observer: Observer,
        sse: bool,
        timing: Timing,
    ) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep_until(timing.first_byte)),
            idle: timing.idle,
            guard: Some(guard),
            endpoint,
            label: endpoint.to_string(),
            registry,
            observer: Some(observer),
            received: timing.received,
            first_byte: false,
            sse,
            tail: Vec::new(),
            truncated: false,
            done: false,
        }
    }

    fn keep(&mut self, data: &Bytes) {
        self.tail.extend_from_slice(data);
        let limit = if self.sse { TAIL_BYTES } else { WHOLE_BYTES };
        if self.tail.len() > limit {
            let cut = self.tail.len() - limit;
            self.tail.drain(..cut);
            self.truncated = true;
        }
    }

    fn finish(&mut self) {
        self.done = true;
        if let Some((prompt, cached)) = usage(&self.tail, self.sse, self.truncated) {
            metrics::counter!(telemetry::PROMPT_TOKENS, "endpoint" => self.label.clone()).increment(prompt);
            metrics::counter!(telemetry::CACHED_TOKENS, "endpoint" => self.label.clone()).increment(cached);
            if let Some(observe) = self.observer.take() {
                observe(cached);
            }
        }
        self.guard = None;
    }
}

impl GuardedBody {
    /// Ends the response because the upstream broke (`kind` `stream`) or stalled (`timeout`): counts against the
    /// endpoint, releases the load, and ends an SSE stream with an error event, any other body with `err`.
    fn fail(
        &mut self,
        kind: &'static str,
        message: &str,
        err: BoxError,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        metrics::counter!(telemetry::UPSTREAM_ERRORS, "endpoint" => self.label.clone(), "kind" => kind).increment(1);
        self.registry
            .record_failure(self.endpoint, Failure::Engine, Instant::now());
        self.done = true;
        self.guard = None;
        if !self.sse {
            return Poll::Ready(Some(Err(err)));
        }
        // End a partial line or event first, then the error event, then a clean end: bytes already written are
        // not lost to a reset.
        let open = if self.tail.is_empty() || self.tail.ends_with(b"\n\n") {
            ""
        } else if self.tail.ends_with(b"\n") {
            "\n"
        } else {
            "\n\n"
        };
        let code = if kind == "timeout" { 504 } else { 502 };
        let event = serde_json::json!({"error": {"message": message, "type": "upstream_error", "code": code}});
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!("{open}data: {event}\n\n"))))))
    }
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => {
                if this.deadline.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let what = if this.first_byte {
                    "stalled mid-way"
                } else {
                    "sent no first byte"
                };
                tracing::warn!(endpoint = %this.label, "upstream stream {what}: timed out");
                let message = format!("the upstream stream {what} in time");
                this.fail("timeout", &message, message.clone().into())
            }
            Poll::Ready(None) => {
                this.finish();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if !this.first_byte && !data.is_empty() {
                        this.first_byte = true;
                        // The engine finished prefill: the request's queued-prefill share is released.
                        if let Some(guard) = this.guard.as_mut() {
                            guard.first_token(crate::clock::now_us());
                        }
                        if this.sse {
                            let ttft = this.received.elapsed().as_secs_f64();
                            metrics::histogram!(telemetry::TTFT, "endpoint" => this.label.clone()).record(ttft);
                        }
                    }
                    let data = data.clone();
                    this.keep(&data);
                    let next = tokio::time::Instant::now() + this.idle;
                    this.deadline.as_mut().reset(next);
                }
                // A body of known length ends without a final `None` poll.
                if this.inner.is_end_stream() {
                    this.finish();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => {
                tracing::warn!(endpoint = %this.label, error = %err, "upstream stream broke");
                this.fail(
                    "stream",
                    "the upstream stream broke before the response was complete",
                    err.into(),
                )
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// `(prompt_tokens, cached_tokens)` from the end of a response: OpenAI `usage` (with
/// `prompt_tokens_details.cached_tokens`) or SGLang `meta_info`, in the last event that has one.
pub fn usage(tail: &[u8], sse: bool, truncated: bool) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(tail).ok().or_else(|| {
        // The tail may start inside a multi-byte character.
        let start = tail.iter().position(|b| b.is_ascii())?;
        std::str::from_utf8(&tail[start..]).ok()
    })?;
    let from = |v: &Value| -> Option<(u64, u64)> {
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            let prompt = u.get("prompt_tokens")?.as_u64()?;
            let cached = u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            return Some((prompt, cached));
        }
        let meta = v.get("meta_info")?;
        Some((
            meta.get("prompt_tokens")?.as_u64()?,
            meta.get("cached_tokens").and_then(Value::as_u64).unwrap_or(0),
        ))
    };
    if sse {
        let events: Vec<&str> = text.split("\n\n").collect();
        events
            .into_iter()
            .rev()
            .filter_map(|e| e.trim().strip_prefix("data:").map(str::trim))
            .filter(|e| *e != "[DONE]")
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find_map(|v| from(&v))
    } else if truncated {
        None
    } else {
        from(&serde_json::from_str::<Value>(text).ok()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_from_openai_sglang_and_streams() {
        let openai =
            br#"{"choices": [], "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}}"#;
        assert_eq!(usage(openai, false, false), Some((100, 64)));
        assert_eq!(usage(openai, false, true), None, "a truncated JSON body is not parsed");
        let sglang = br#"{"text": "x", "meta_info": {"prompt_tokens": 9, "cached_tokens": 8}}"#;
        assert_eq!(usage(sglang, false, false), Some((9, 8)));
        let stream = b"data: {\"choices\": [{\"delta\": {}}], \"usage\": null}\n\ndata: {\"choices\": [], \"usage\": {\"prompt_tokens\": 7}}\n\ndata: [DONE]\n\n";
        assert_eq!(usage(stream, true, true), Some((7, 0)));
        assert_eq!(usage(b"data: [DONE]\n\n", true, false), None);
    }
}
