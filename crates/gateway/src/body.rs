//! The response body handed to the client: the upstream body, unchanged and unbuffered, holding the request's
//! ticket until it ends.
//!
//! Whatever way the exchange ends (the upstream finishes, the upstream breaks, or the client disconnects and hyper
//! drops this body), the [`Ticket`] is dropped exactly once with it, releasing the endpoint's in-flight count, and
//! dropping the upstream body closes the upstream connection, which cancels the request at the engine. On the way
//! it records the time to the first byte and tells the ticket (the engine has finished its prefill: the request's
//! queued-prefill share is released). A non-streamed answer's first byte is the whole answer, so its share is held
//! until the answer is ready (the engine has then finished that request's prefill too). Every byte also passes
//! once through a [`UsageScanner`]: the engine's usage report (prompt and cached tokens) goes to the metrics and
//! to the ticket (the policy's feedback) as soon as it has been read, so a client that hangs up right after it
//! (the OpenAI SDK reads `[DONE]` and closes) loses nothing.
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
use dprouter_core::{EndpointId, Framing, Policy, Ticket, Usage, UsageScanner};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::time::Sleep;

use crate::registry::{Failure, Registry};
use crate::telemetry;

/// The ticket of a request the gateway routed.
pub type GatewayTicket = Ticket<Arc<dyn Policy>>;

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
    ticket: Option<GatewayTicket>,
    endpoint: EndpointId,
    label: String,
    registry: Arc<Registry>,
    received: Instant,
    first_byte: bool,
    sse: bool,
    scanner: UsageScanner,
    done: bool,
}

impl GuardedBody {
    pub fn new(inner: Incoming, ticket: GatewayTicket, registry: Arc<Registry>, sse: bool, timing: Timing) -> Self {
        let endpoint = ticket.endpoint;
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep_until(timing.first_byte)),
            idle: timing.idle,
            ticket: Some(ticket),
            endpoint,
            label: endpoint.to_string(),
            registry,
            received: timing.received,
            first_byte: false,
            sse,
            scanner: UsageScanner::new(sse),
            done: false,
        }
    }

    /// The engine's usage report was read: to the metrics and to the policy.
    fn report(&mut self, usage: Usage) {
        metrics::counter!(telemetry::PROMPT_TOKENS, "endpoint" => self.label.clone()).increment(usage.prompt_tokens);
        metrics::counter!(telemetry::CACHED_TOKENS, "endpoint" => self.label.clone()).increment(usage.cached_tokens);
        if let Some(ticket) = self.ticket.as_mut() {
            ticket.usage(usage);
        }
    }

    fn finish(&mut self) {
        self.done = true;
        if let Some(usage) = self.scanner.finish() {
            self.report(usage);
        }
        self.ticket = None;
    }

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
        self.ticket = None;
        if !self.sse {
            return Poll::Ready(Some(Err(err)));
        }
        // End a partial line or event first, then the error event, then a clean end: bytes already written are
        // not lost to a reset.
        let open = match self.scanner.framing() {
            Framing::EventEnded => "",
            Framing::LineEnded => "\n",
            Framing::InLine => "\n\n",
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
                        if let Some(ticket) = this.ticket.as_mut() {
                            ticket.first_token(crate::clock::now_us());
                        }
                        if this.sse {
                            let ttft = this.received.elapsed().as_secs_f64();
                            metrics::histogram!(telemetry::TTFT, "endpoint" => this.label.clone()).record(ttft);
                        }
                    }
                    if let Some(usage) = this.scanner.feed(data) {
                        this.report(usage);
                    }
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
