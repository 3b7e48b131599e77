//! One prefill leg, run the one way for `serve` ([`crate::disagg::legs`]) and the decode sidecar
//! ([`crate::disagg::sidecar`]): sent with a deadline for its response head, read to its end with an idle timeout
//! between frames (its first bytes kept when asked: vLLM's answer carries the `kv_transfer_params` the decode leg
//! needs), its error answer read up to [`MAX_ERROR_BYTES`], and how it failed ([`LegFailure`]). Whoever runs it
//! hears what happens through [`LegEvents`] (`serve`: the ticket, the outcome recorder, the attempt's span; the
//! sidecar, which has no ticket: nothing). A running leg is watched from the decode side through [`PrefillWatch`],
//! which aborts it when dropped.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::fleet::upstream::{error_chain, Chunks, Upstream};
use crate::pipeline::body::Watch;
use crate::pipeline::outcome::Outcome;

/// The most of a prefill server's error answer kept, to hand to the client.
pub(crate) const MAX_ERROR_BYTES: usize = 64 << 10;

/// The most of a prefill answer kept when asked, to read vLLM's `kv_transfer_params` (one token's answer is a few
/// KiB).
pub(crate) const MAX_KEPT_BYTES: usize = 1 << 20;

/// How long a prefill leg may go on after the decode answer the client got has ended. By then the prefill is long
/// over (the decode server's first token came after it): what is left of its answer is a few bytes and a usage
/// report, which 5 s covers on a slow link; a leg still open then has stalled, and would hold its endpoint in
/// flight until `stream_idle_timeout_ms`.
pub const DETACHED_PREFILL_GRACE: Duration = Duration::from_secs(5);

/// How a prefill leg failed.
#[derive(Debug)]
pub(crate) enum LegFailure {
    /// Its connection was refused: the server never got the request.
    Refused(String),
    /// The server answered with an error status (its body, at most [`MAX_ERROR_BYTES`]).
    Status { status: u16, body: Bytes },
    /// No response head in time, or an answer that stalled: what, and the deadline it missed.
    Timeout { what: &'static str, after: Duration },
    /// The exchange broke.
    Broken(String),
}

impl LegFailure {
    /// What a client whose answer had begun (or a log line) is told.
    pub(crate) fn message(&self, endpoint: &str) -> String {
        match self {
            LegFailure::Refused(m) => format!("the prefill leg at {endpoint} could not connect: {m}"),
            LegFailure::Status { status, body } => format!(
                "the prefill leg at {endpoint} answered {status}: {}",
                crate::common::throttled::clip(String::from_utf8_lossy(body).trim())
            ),
            LegFailure::Timeout { what, .. } => format!("the prefill leg at {endpoint} timed out: {what}"),
            LegFailure::Broken(m) => format!("the prefill leg at {endpoint} failed: {m}"),
        }
    }
}

/// What a leg's runner tells whoever runs it, as it happens.
pub(crate) trait LegEvents: Send {
    /// The attempt's outcome: its head, or why none came, or how its answer was cut (`detail` says what).
    fn outcome(&mut self, _outcome: Outcome, _detail: &str) {}
    /// The prefill is over: its answer's first byte came, or the decode answer began.
    fn prefill_over(&mut self) {}
    /// A chunk of its (successful) answer; `sse` whether the answer is an event stream.
    fn data(&mut self, _data: &[u8], _sse: bool) {}
    /// The answer ended whole.
    fn ended(&mut self) {}
}

/// A leg whose runner needs to hear nothing (the decode sidecar's: it holds no ticket).
pub(crate) struct Unheard;

impl LegEvents for Unheard {}

/// How one leg runs.
pub(crate) struct LegRun {
    /// Its response head by then.
    pub head_by: Instant,
    /// The longest wait between two frames of its answer.
    pub idle: Duration,
    /// Keep the answer's first [`MAX_KEPT_BYTES`] (vLLM's way reads its `kv_transfer_params`).
    pub keep: bool,
    /// Fires when the decode answer began (SGLang's way runs both legs at once): the prefill is over.
    pub decode_started: Option<oneshot::Receiver<()>>,
}

/// Sends a prefill leg and reads its answer to the end; returns the answer's first bytes when `run.keep`.
pub(crate) async fn run(
    upstream: &Upstream,
    request: hyper::Request<Chunks>,
    mut run: LegRun,
    events: &mut impl LegEvents,
) -> Result<Option<Bytes>, LegFailure> {
    let started = Instant::now();
    let send = tokio::time::timeout_at(run.head_by, upstream.send(request));
    tokio::pin!(send);
    let sent = loop {
        let Some(decode_started) = run.decode_started.as_mut() else {
            break send.as_mut().await;
        };
        tokio::select! {
            sent = send.as_mut() => break sent,
            _ = decode_started => {
                run.decode_started = None;
                events.prefill_over();
            }
        }
    };
    let response = match sent {
        Err(_) => {
            let what = "no response head in time";
            events.outcome(Outcome::NoHead, what);
            let after = run.head_by.saturating_duration_since(started);
            return Err(LegFailure::Timeout { what, after });
        }
        Ok(Err(err)) => {
            let message = error_chain(&err);
            let connect = err.is_connect();
            events.outcome(Outcome::Failed { connect }, &message);
            return Err(if connect {
                LegFailure::Refused(message)
            } else {
                LegFailure::Broken(message)
            });
        }
        Ok(Ok(response)) => response,
    };
    let status = response.status();
    events.outcome(Outcome::Answered(status.as_u16()), "");
    if !status.is_success() {
        let body = read_bounded(response.into_body(), run.idle).await;
        return Err(LegFailure::Status {
            status: status.as_u16(),
            body,
        });
    }
    let sse = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let mut body = response.into_body();
    let mut first = true;
    let mut kept = run.keep.then(Vec::new);
    loop {
        let next = tokio::time::timeout(run.idle, body.frame());
        let next = match run.decode_started.as_mut() {
            None => next.await,
            Some(decode_started) => tokio::select! {
                next = next => next,
                _ = decode_started => {
                    run.decode_started = None;
                    events.prefill_over();
                    continue;
                }
            },
        };
        let frame = match next {
            Err(_) => {
                let what = "its answer stalled";
                events.outcome(Outcome::Cut { stalled: true }, what);
                return Err(LegFailure::Timeout { what, after: run.idle });
            }
            Ok(None) => break,
            Ok(Some(Err(err))) => {
                let message = format!("its answer broke: {err}");
                events.outcome(Outcome::Cut { stalled: false }, &message);
                return Err(LegFailure::Broken(message));
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else { continue };
        if first && !data.is_empty() {
            first = false;
            // The prefill is over: the endpoint's next queued request begins its prefill.
            events.prefill_over();
        }
        events.data(&data, sse);
        if let Some(kept) = kept.as_mut() {
            let room = MAX_KEPT_BYTES.saturating_sub(kept.len());
            kept.extend_from_slice(&data[..data.len().min(room)]);
        }
    }
    events.ended();
    Ok(kept.map(Bytes::from))
}

/// Reads at most [`MAX_ERROR_BYTES`] of an error answer, each frame within `idle`.
async fn read_bounded(mut body: hyper::body::Incoming, idle: Duration) -> Bytes {
    let mut out = Vec::new();
    while out.len() < MAX_ERROR_BYTES {
        match tokio::time::timeout(idle, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    let room = MAX_ERROR_BYTES - out.len();
                    out.extend_from_slice(&data[..data.len().min(room)]);
                }
            }
            _ => break,
        }
    }
    Bytes::from(out)
}

/// How a leg task's failure reads in the decode answer's error (its endpoint named).
pub(crate) trait Described: Send + 'static {
    fn message(&self, endpoint: &str) -> String;
}

impl Described for LegFailure {
    fn message(&self, endpoint: &str) -> String {
        LegFailure::message(self, endpoint)
    }
}

/// A running prefill leg, watched from the decode side: dropped before the leg ended, it aborts it.
pub(crate) struct PrefillWatch<F: Described = LegFailure> {
    pub(crate) handle: JoinHandle<Result<(), F>>,
    pub(crate) endpoint: String,
    /// Tells the leg the decode answer began.
    decode_started: Option<oneshot::Sender<()>>,
    /// The answer the client got ended whole: the leg may finish its own (its usage report still teaches the
    /// prefill policy) rather than be aborted.
    detached: bool,
}

impl<F: Described> PrefillWatch<F> {
    /// Spawns the leg `task` makes of the receiver that hears when the decode answer began.
    pub(crate) fn spawn<T>(endpoint: String, task: impl FnOnce(oneshot::Receiver<()>) -> T) -> Self
    where
        T: Future<Output = Result<(), F>> + Send + 'static,
    {
        let (started, decode_started) = oneshot::channel();
        Self {
            handle: tokio::spawn(task(decode_started)),
            endpoint,
            decode_started: Some(started),
            detached: false,
        }
    }
}

impl<F: Described> Watch for PrefillWatch<F> {
    fn poll_outcome(&mut self, cx: &mut Context<'_>) -> Poll<Option<String>> {
        Pin::new(&mut self.handle).poll(cx).map(|joined| match joined {
            Ok(Ok(())) => None,
            Ok(Err(failure)) => Some(failure.message(&self.endpoint)),
            Err(e) => Some(format!("the prefill leg at {} ended: {e}", self.endpoint)),
        })
    }

    fn detach(&mut self) {
        if self.detached || self.handle.is_finished() {
            self.detached = true;
            return;
        }
        self.detached = true;
        // The leg may finish its answer (a few events and its usage report), not hold its endpoint's in-flight
        // count for a stalled stream's idle timeout.
        let leg = self.handle.abort_handle();
        let endpoint = self.endpoint.clone();
        tokio::spawn(async move {
            tokio::time::sleep(DETACHED_PREFILL_GRACE).await;
            if !leg.is_finished() {
                leg.abort();
                crate::observe::refusals::refused("prefill_leg_cut", || {
                    format!(
                        "the prefill leg at {endpoint} was still answering {DETACHED_PREFILL_GRACE:?} after the \
                         decode answer ended: cut"
                    )
                });
            }
        });
    }

    fn answer_started(&mut self) {
        if let Some(started) = self.decode_started.take() {
            let _ = started.send(());
        }
    }
}

impl<F: Described> Drop for PrefillWatch<F> {
    fn drop(&mut self) {
        if !self.detached {
            self.handle.abort();
        }
    }
}
