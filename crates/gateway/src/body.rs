//! The response body handed to the client: the upstream body, unchanged and unbuffered, holding the request's load
//! guard until it ends.
//!
//! Whatever way the exchange ends (the upstream finishes, the upstream breaks, or the client disconnects and hyper
//! drops this body), the [`LoadGuard`] is dropped exactly once with it, releasing the endpoint's in-flight count,
//! and dropping the upstream body closes the upstream connection, which cancels the request at the engine. On the
//! way it records the time to the first byte and releases the request's queued-prefill share there (the engine has
//! finished its prefill), and keeps the tail of the response to read the engine's usage report (prompt and cached
//! tokens) at the end, which goes to the metrics and to the policy's `observe`. An upstream body that breaks mid-way ends an SSE stream with one
//! `data: {"error": …}` event and no `[DONE]` (what OpenAI clients raise on), and breaks any other body.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use dprouter_core::{EndpointId, LoadGuard};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use serde_json::Value;

use crate::registry::{Failure, Registry};
use crate::telemetry;

/// Called once with the engine-reported cached tokens of the request (the policy's `observe`).
pub type Observer = Box<dyn FnOnce(u64) + Send>;

/// How much of the end of a response is kept for the usage report.
const TAIL_BYTES: usize = 64 << 10;
/// Whole JSON (non-streaming) responses up to this size are kept to read their usage.
const WHOLE_BYTES: usize = 4 << 20;

pub struct GuardedBody {
    inner: Incoming,
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
        received: Instant,
        sse: bool,
    ) -> Self {
        Self {
            inner,
            guard: Some(guard),
            endpoint,
            label: endpoint.to_string(),
            registry,
            observer: Some(observer),
            received,
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

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
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
                }
                // A body of known length ends without a final `None` poll.
                if this.inner.is_end_stream() {
                    this.finish();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => {
                tracing::warn!(endpoint = %this.label, error = %err, "upstream stream broke");
                metrics::counter!(telemetry::UPSTREAM_ERRORS, "endpoint" => this.label.clone(), "kind" => "stream")
                    .increment(1);
                this.registry.record_failure(this.endpoint, Failure::Server);
                this.done = true;
                this.guard = None;
                if this.sse {
                    // The error event, then a clean end: bytes already written are not lost to a reset.
                    let event = serde_json::json!({"error": {"message": "the upstream stream broke before the response was complete",
                        "type": "upstream_error", "code": 502}});
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!("data: {event}\n\n"))))));
                }
                Poll::Ready(Some(Err(err)))
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
