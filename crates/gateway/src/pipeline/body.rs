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
//! body breaks. A stream still open when the shutdown's drain deadline passes ends the same way, with a 503 error
//! event that is not the endpoint's fault.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use dprouter_core::{Framing, Policy, Ticket};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::time::Sleep;

use crate::common::drain_deadline::{DeadlineWait, DrainDeadline};
use crate::common::response_homes::{Owner, ResponseHomes};
use crate::fleet::registry::Registry;
use crate::observe::access::Exchange;
use crate::pipeline::feedback::Feedback;

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

pub struct GuardedBody<B = Incoming> {
    inner: B,
    deadline: Pin<Box<Sleep>>,
    idle: Duration,
    feedback: Feedback,
    registry: Arc<Registry>,
    sse: bool,
    done: bool,
    /// The deadline is the idle one (a byte arrived).
    idle_deadline: bool,
    last_byte: tokio::time::Instant,
    /// SSE bytes not yet handed on, and the scheduler turns already spent waiting for more.
    batch: Batch,
    yields: u32,
    /// A trailers frame that came after bytes still to hand on.
    held: Option<Frame<Bytes>>,
    /// The shutdown's drain deadline, for a stream to end at with an error event.
    cut: Option<DeadlineWait>,
    /// A disaggregated request's prefill leg, while it runs: its failure ends this answer, and this answer's end
    /// before its own aborts it.
    prefill: Option<Box<dyn Watch>>,
}

/// Another leg of the same request (a disaggregated request's prefill leg, [`crate::disagg::legs`]), watched while this
/// answer is relayed.
pub trait Watch: Send {
    /// `Ready(None)` once the leg ended well, `Ready(Some(message))` if it failed.
    fn poll_outcome(&mut self, cx: &mut Context<'_>) -> Poll<Option<String>>;
    /// Lets the leg run to its own end when the watch is dropped (otherwise dropping it ends the leg).
    fn detach(&mut self);
    /// This answer's first byte came: the leg's own work is over (a decode server answers only once it has the
    /// prefill leg's KV cache).
    fn answer_started(&mut self) {}
}

impl<B> GuardedBody<B> {
    pub fn new(
        inner: B,
        ticket: GatewayTicket,
        registry: Arc<Registry>,
        sse: bool,
        timing: Timing,
        exchange: Exchange,
    ) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep_until(timing.first_byte)),
            idle: timing.idle,
            feedback: Feedback::new(ticket, sse, timing.received, exchange),
            registry,
            sse,
            done: false,
            idle_deadline: false,
            last_byte: tokio::time::Instant::now(),
            batch: Batch::Empty,
            yields: 0,
            held: None,
            cut: None,
            prefill: None,
        }
    }

    /// Watches a disaggregated request's prefill leg while the answer is relayed ([`crate::disagg::legs`]).
    pub fn watching(mut self, prefill: Option<Box<dyn Watch>>) -> Self {
        self.prefill = prefill;
        self
    }

    /// Ends an SSE stream with an error event when the shutdown's drain deadline passes (other bodies are cut
    /// with their connection).
    pub fn cut_at(mut self, deadline: &DrainDeadline) -> Self {
        if self.sse {
            self.cut = Some(deadline.wait());
        }
        self
    }

    /// Remembers the endpoint of the response's id (a Responses answer) for `owner`, once the scanner has read it.
    pub fn remembering_the_response(mut self, homes: Arc<ResponseHomes>, owner: Owner) -> Self {
        self.feedback = self.feedback.remembering_the_response(homes, owner);
        self
    }

    /// An answer on a route whose errors take `shape` (its error event, its first token).
    pub fn in_shape(mut self, shape: crate::common::error_shape::ErrorShape) -> Self {
        self.feedback = self.feedback.in_shape(shape);
        self
    }

    fn finish(&mut self) {
        self.done = true;
        self.feedback.finish();
        if let Some(prefill) = self.prefill.as_mut() {
            prefill.detach();
        }
    }

    /// The prefill leg failed while the answer was relayed: the answer ends as it does when its upstream breaks,
    /// counted against the prefill endpoint (by its leg) rather than this one.
    fn prefill_failed(&mut self, message: &str) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        tracing::warn!(endpoint = %self.feedback.label(), "{message}");
        if !self.sse {
            self.done = true;
            self.feedback.failed(502);
            return Poll::Ready(Some(Err(message.to_string().into())));
        }
        self.end_with_error_event(message, "upstream_error", 502)
    }

    /// Ends the response because the upstream broke (`kind` `stream`) or stalled (`timeout`): counts against the
    /// endpoint, releases the load, and ends an SSE stream with an error event, any other body with `err`.
    fn fail(
        &mut self,
        kind: &'static str,
        message: &str,
        err: BoxError,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let branch = self.feedback.ticket().map(|t| t.pick.branch);
        let attempt = crate::pipeline::outcome::Attempt::of(self.feedback.endpoint(), self.feedback.label(), branch);
        let stalled = kind == "timeout";
        crate::pipeline::outcome::record(
            &self.registry,
            attempt,
            crate::pipeline::outcome::Outcome::Cut { stalled },
        );
        let code = if kind == "timeout" { 504 } else { 502 };
        if !self.sse {
            self.done = true;
            self.feedback.failed(code);
            return Poll::Ready(Some(Err(err)));
        }
        self.end_with_error_event(message, "upstream_error", code)
    }

    /// The drain deadline passed: the stream ends with an error event. Not the endpoint's fault.
    fn cut_by_shutdown(&mut self) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        tracing::info!(endpoint = %self.feedback.label(), "a stream was cut at the drain deadline");
        let message = "the gateway is shutting down: the stream was cut at its drain deadline";
        self.end_with_error_event(message, "service_unavailable_error", 503)
    }

    /// Ends an SSE stream: a partial line or event first, then one error event, then a clean end (bytes already
    /// written are not lost to a reset); releases the load.
    fn end_with_error_event(
        &mut self,
        message: &str,
        kind: &str,
        code: u16,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.done = true;
        self.feedback.failed(code);
        let open = match self.feedback.framing() {
            Framing::EventEnded => "",
            Framing::LineEnded => "\n",
            Framing::InLine => "\n\n",
        };
        let event = self.feedback.shape().stream_error(message, kind, code);
        // After the bytes gathered and not yet handed on.
        self.batch.push(Bytes::from(format!("{open}{event}")));
        Poll::Ready(self.take_batch().map(Ok))
    }
}

impl<B> GuardedBody<B> {
    /// A data frame arrived: the feedback, the idle deadline.
    fn on_data(&mut self, data: &Bytes) {
        let started = self.feedback.started();
        self.feedback.on_data(data);
        if !started && self.feedback.started() {
            if let Some(prefill) = self.prefill.as_mut() {
                prefill.answer_started();
            }
        }
        // From the first byte on, the deadline is the idle one, moved lazily: only when it fires is it checked
        // against the last byte (no timer update per event).
        let now = tokio::time::Instant::now();
        if !std::mem::replace(&mut self.idle_deadline, true) {
            self.deadline.as_mut().reset(now + self.idle);
        }
        self.last_byte = now;
    }

    /// The deadline fired; `true` if it really passed (otherwise it was moved past the last byte).
    fn deadline_passed(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.deadline.as_mut().poll(cx).is_pending() {
                return false;
            }
            if !self.idle_deadline {
                return true;
            }
            let next = self.last_byte + self.idle;
            if next <= tokio::time::Instant::now() {
                return true;
            }
            self.deadline.as_mut().reset(next);
        }
    }

    /// Takes the SSE bytes gathered so far as one frame.
    fn take_batch(&mut self) -> Option<Frame<Bytes>> {
        match std::mem::take(&mut self.batch) {
            Batch::Empty => None,
            Batch::One(bytes) => Some(Frame::data(bytes)),
            Batch::Many(bytes) => Some(Frame::data(bytes.freeze())),
        }
    }
}

/// SSE bytes received and not yet handed to hyper: one frame as it came, or several copied together.
#[derive(Default)]
enum Batch {
    #[default]
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Batch {
    fn len(&self) -> usize {
        match self {
            Batch::Empty => 0,
            Batch::One(b) => b.len(),
            Batch::Many(b) => b.len(),
        }
    }

    fn push(&mut self, data: Bytes) {
        *self = match std::mem::take(self) {
            Batch::Empty => Batch::One(data),
            Batch::One(first) => {
                let mut many = BytesMut::with_capacity((first.len() + data.len()).max(4096));
                many.extend_from_slice(&first);
                many.extend_from_slice(&data);
                Batch::Many(many)
            }
            Batch::Many(mut many) => {
                many.extend_from_slice(&data);
                Batch::Many(many)
            }
        }
    }
}

/// The most SSE bytes gathered into one write.
const MAX_BATCH_BYTES: usize = 64 << 10;

/// How many scheduler turns a gathered batch waits for the next event before it goes out. One is not enough on a
/// multi-threaded runtime (the upstream connection's task often has not run yet); two gather nearly all of what
/// is ready (`docs/measurements.md`, "Gateway overhead").
const MAX_YIELDS: u32 = 2;

impl<B> Body for GuardedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    type Data = Bytes;
    type Error = BoxError;

    /// SSE events that are ready together go out together: after an event, the upstream is asked again, then
    /// again after letting other tasks run (the upstream connection's among them; a yield, not a timer, at most
    /// [`MAX_YIELDS`] times), and what it has by then joins the same write. hyper writes each frame it gets and
    /// flushes whenever the body is not ready, so without this every event of a fast stream costs its own `writev`
    /// (and the client a wake-up); the delay is a scheduler turn or two, microseconds.
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(frame) = this.held.take() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if this.done {
            return Poll::Ready(this.take_batch().map(Ok));
        }
        if this.cut.as_ref().is_some_and(DeadlineWait::passed) {
            return this.cut_by_shutdown();
        }
        if let Some(prefill) = this.prefill.as_mut() {
            match prefill.poll_outcome(cx) {
                Poll::Pending => {}
                Poll::Ready(None) => {
                    prefill.detach();
                    this.prefill = None;
                }
                Poll::Ready(Some(message)) => {
                    this.prefill = None;
                    return this.prefill_failed(&message);
                }
            }
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => {
                    if this.batch.len() > 0 {
                        if this.yields < MAX_YIELDS {
                            this.yields += 1;
                            cx.waker().wake_by_ref();
                            return Poll::Pending;
                        }
                        this.yields = 0;
                        return Poll::Ready(this.take_batch().map(Ok));
                    }
                    if this.cut.as_mut().is_some_and(|cut| cut.poll_passed(cx)) {
                        return this.cut_by_shutdown();
                    }
                    if !this.deadline_passed(cx) {
                        return Poll::Pending;
                    }
                    let what = if this.feedback.started() {
                        "stalled mid-way"
                    } else {
                        "sent no first byte"
                    };
                    tracing::warn!(endpoint = %this.feedback.label(), "upstream stream {what}: timed out");
                    let message = format!("the upstream stream {what} in time");
                    return this.fail("timeout", &message, message.clone().into());
                }
                Poll::Ready(None) => {
                    this.finish();
                    return Poll::Ready(this.take_batch().map(Ok));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let frame = match frame.into_data() {
                        Ok(data) => {
                            this.on_data(&data);
                            if !this.sse {
                                // A body of known length ends without a final `None` poll.
                                if this.inner.is_end_stream() {
                                    this.finish();
                                }
                                return Poll::Ready(Some(Ok(Frame::data(data))));
                            }
                            this.batch.push(data);
                            this.yields = 0;
                            if this.inner.is_end_stream() {
                                this.finish();
                                return Poll::Ready(this.take_batch().map(Ok));
                            }
                            if this.batch.len() >= MAX_BATCH_BYTES {
                                return Poll::Ready(this.take_batch().map(Ok));
                            }
                            continue;
                        }
                        Err(frame) => frame,
                    };
                    // Trailers: after the bytes gathered before them.
                    if let Some(batch) = this.take_batch() {
                        this.held = Some(frame);
                        return Poll::Ready(Some(Ok(batch)));
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(Some(Err(err))) => {
                    tracing::warn!(endpoint = %this.feedback.label(), error = %err, "upstream stream broke");
                    return this.fail(
                        "stream",
                        "the upstream stream broke before the response was complete",
                        err.into(),
                    );
                }
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

#[cfg(test)]
#[path = "body_tests.rs"]
mod tests;
