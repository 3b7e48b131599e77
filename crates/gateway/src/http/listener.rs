//! The gateway's server, HTTP/1 (`serve`, control routes) or HTTP/2 (the Endpoint Picker's gRPC port): the accept
//! loop, per-connection timeouts, the connection limit, and the drain on shutdown (`[server]` in the config; why
//! each default is what it is: `docs/operations.md`, "Timeouts and limits"). With HTTP/2 a connection is idle while
//! no stream is open, has no head timeout (bytes between streams are PINGs and SETTINGS), gets keepalive PINGs, and
//! is sent a GOAWAY when it is closed.
//!
//! Per connection, one task serves it with hyper and watches it: a connection with no request in flight is closed
//! `idle_timeout` after its last response (or after it was accepted), and one whose request head started arriving
//! is closed if the head is not complete `header_read_timeout` after its first byte. hyper's own
//! `header_read_timeout` is not used: it starts when the previous response ends, so it would also close idle
//! keep-alive connections, at the header timeout instead of the idle one.
//!
//! Each open connection holds one permit of a `max_connections` semaphore. A client accepted when none is free
//! waits, accepted but not served, and the loop accepts no other until one frees, so the next clients wait in the
//! kernel's accept queue rather than being accepted and dropped. While a client waits, and when `accept` fails for
//! want of file descriptors, connections idle for a while are asked to close (as nginx reuses keep-alive
//! connections when it runs out), so idle clients cannot keep new ones out. Accept errors never end the loop: they
//! are logged at most every few seconds and the loop pauses briefly.
//!
//! With TLS, the connection's task does the handshake first, within `header_read_timeout` (a client that connects
//! and says nothing costs a slot no longer than one that sends half a head); the timeouts then watch the
//! decrypted bytes.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::response::Response;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::common::drain_deadline::DrainDeadline;
use crate::common::throttled::Throttled;
use crate::config::ServerConfig;
use crate::http::in_flight::WithGuard;
use crate::http::parse_errors::JsonParseErrors;

/// Under pressure (no free connection slot, or no file descriptor), connections idle at least this long are
/// closed. The grace keeps a client's pooled connection that it is about to reuse from being closed under it.
const REAP_MIN_IDLE: Duration = Duration::from_secs(1);
/// While no connection slot is free, idle connections are asked to close this often.
const PRESSURE_RETRY: Duration = Duration::from_millis(250);
/// The accept loop's pause after an error other than a client's aborted connection (e.g. `EMFILE`).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);
/// After the drain deadline, how long the connections still open get to close before `serve` returns anyway (with
/// [`crate::api::server`]'s background tasks' stop, the process exits within half a second of the deadline).
const CLOSE_GRACE: Duration = Duration::from_millis(250);
/// At the drain deadline, how long a connection gets to write the end of a stream cut there.
const CUT_WRITE: Duration = Duration::from_millis(100);
/// File descriptors the gateway needs besides client and upstream connections (logs, the runtime, health probes).
const FD_RESERVE: u64 = 64;
/// HTTP/2: a PING this often on a connection (a peer that has gone, with streams open, is found within
/// [`H2_KEEPALIVE`] + [`H2_KEEPALIVE_TIMEOUT`]); the connection closes if its answer takes longer than the timeout.
const H2_KEEPALIVE: Duration = Duration::from_secs(30);
const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// HTTP/2: streams open at once on one connection (a data plane needing more opens another connection).
const H2_MAX_STREAMS: u32 = 1024;
/// `EMFILE` and `ENFILE` (the same numbers on Linux and the BSDs).
const OUT_OF_FDS: [i32; 2] = [24, 23];

/// Where the server is in its life; every connection task watches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Serving,
    /// Shutdown began: finish the request in flight, then close; close idle connections now.
    Draining,
    /// The drain deadline passed: close now.
    Closing,
}

/// What a listener speaks: HTTP/1 (`serve`, the control routes) or HTTP/2 (gRPC: the Endpoint Picker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    /// HTTP/2 with prior knowledge (gRPC): keepalive PINGs, at most [`H2_MAX_STREAMS`] streams per connection.
    /// A connection is idle while no stream is open; idle, draining or under pressure, it is sent a GOAWAY.
    Http2,
}

struct Shared {
    protocol: Protocol,
    header_read_timeout: Duration,
    idle_timeout: Duration,
    /// Notified when new clients are kept waiting: idle connections close.
    pressure: Notify,
    /// TLS on every connection, when configured.
    tls: Option<tokio_rustls::TlsAcceptor>,
}

/// Serves `router` on `listener` in `protocol` (over TLS with `tls`) until `shutdown` completes, then drains (see
/// the module documentation).
pub async fn run(
    listener: TcpListener,
    protocol: Protocol,
    router: Router,
    config: &ServerConfig,
    tls: Option<tokio_rustls::TlsAcceptor>,
    deadline: &DrainDeadline,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    warn_if_short_of_fds(config);
    let shared = Arc::new(Shared {
        protocol,
        header_read_timeout: Duration::from_millis(config.header_read_timeout_ms),
        idle_timeout: Duration::from_millis(config.idle_timeout_ms),
        pressure: Notify::new(),
        tls,
    });
    let slots = Arc::new(Semaphore::new(config.max_connections as usize));
    let (phase, watching) = watch::channel(Phase::Serving);
    let mut accept_log = Throttled::new();
    let mut full_log = Throttled::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            // A client that gave up before it was accepted: nothing is wrong here.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                ) =>
            {
                continue
            }
            Err(e) => {
                let out_of_fds = e.raw_os_error().is_some_and(|code| OUT_OF_FDS.contains(&code));
                if out_of_fds {
                    shared.pressure.notify_waiters();
                }
                if let Some(suppressed) = accept_log.ready() {
                    tracing::error!(error = %e, out_of_fds, suppressed, "accept failed; retrying");
                }
                tokio::select! {
                    () = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                    () = &mut shutdown => break,
                }
            }
        };
        // At the limit this one client waits, accepted, and the next ones wait in the kernel's accept queue.
        let slot = match Arc::clone(&slots).try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => tokio::select! {
                slot = free_slot(&slots, &shared, config.max_connections, &mut full_log) => slot,
                () = &mut shutdown => break,
            },
        };
        let _ = tcp.set_nodelay(true);
        let task = serve_connection(tcp, peer, router.clone(), Arc::clone(&shared), watching.clone(), slot);
        tokio::spawn(task);
    }
    drop(listener);
    drain(&phase, &slots, config, deadline).await;
    Ok(())
}

/// A connection slot for a client kept waiting: asks idle connections to close until one frees.
async fn free_slot(slots: &Arc<Semaphore>, shared: &Shared, max: u32, log: &mut Throttled) -> OwnedSemaphorePermit {
    if let Some(suppressed) = log.ready() {
        tracing::warn!(
            max_connections = max,
            suppressed,
            "at max_connections: new clients wait to be accepted"
        );
    }
    loop {
        shared.pressure.notify_waiters();
        tokio::select! {
            Ok(slot) = Arc::clone(slots).acquire_owned() => return slot,
            () = tokio::time::sleep(PRESSURE_RETRY) => {}
        }
    }
}

/// Closes idle connections now, gives the others `drain_timeout` to finish their request, then closes them.
async fn drain(phase: &watch::Sender<Phase>, slots: &Semaphore, config: &ServerConfig, cut: &DrainDeadline) {
    let max = config.max_connections;
    let open = |slots: &Semaphore| max as usize - slots.available_permits();
    tracing::info!(
        open_connections = open(slots),
        drain_timeout_ms = config.drain_timeout_ms,
        "draining"
    );
    phase.send_replace(Phase::Draining);
    let deadline = Duration::from_millis(config.drain_timeout_ms);
    if tokio::time::timeout(deadline, slots.acquire_many(max)).await.is_err() {
        tracing::warn!(
            open_connections = open(slots),
            drain_timeout_ms = config.drain_timeout_ms,
            "drain deadline reached: closing the connections still open"
        );
        // Streams end with an error event, then their connections close.
        cut.fire();
        phase.send_replace(Phase::Closing);
        let _ = tokio::time::timeout(CLOSE_GRACE, slots.acquire_many(max)).await;
    }
}

/// Serves one connection until it ends, a timeout closes it, or the drain does; `_slot` is released at the end.
async fn serve_connection(
    tcp: TcpStream,
    peer: SocketAddr,
    router: Router,
    shared: Arc<Shared>,
    phase: watch::Receiver<Phase>,
    slot: OwnedSemaphorePermit,
) {
    let Some(acceptor) = shared.tls.clone() else {
        return serve_stream(tcp, peer, router, shared, phase, slot).await;
    };
    match tokio::time::timeout(shared.header_read_timeout, acceptor.accept(tcp)).await {
        Ok(Ok(stream)) => serve_stream(stream, peer, router, shared, phase, slot).await,
        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
    }
}

/// Serves one connection's byte stream (TCP, or TLS over it).
async fn serve_stream<S>(
    stream: S,
    peer: SocketAddr,
    router: Router,
    shared: Arc<Shared>,
    phase: watch::Receiver<Phase>,
    _slot: OwnedSemaphorePermit,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // With HTTP/2, bytes between requests are PINGs and SETTINGS, not a request head arriving.
    let activity = Arc::new(Activity::new(shared.protocol == Protocol::Http1));
    let watched = Watched {
        inner: stream,
        activity: Arc::clone(&activity),
    };
    let service = ConnService {
        inner: TowerToHyperService::new(router),
        peer,
        activity: Arc::clone(&activity),
    };
    let watch = Watch {
        peer,
        activity,
        shared,
        phase,
    };
    match watch.shared.protocol {
        Protocol::Http1 => {
            let mut builder = http1::Builder::new();
            // hyper's own limits sit above the gateway's (`names::MAX_HEADERS`, `MAX_HEADER_BYTES`,
            // `MAX_URI_BYTES`), so the gateway answers an oversized head itself; heads past these get hyper's
            // answer, in JSON too ([`JsonParseErrors`]).
            builder
                .keep_alive(true)
                .header_read_timeout(None)
                .max_headers(4 * crate::common::names::MAX_HEADERS)
                .max_buf_size(256 << 10);
            let conn = builder.serve_connection(TokioIo::new(JsonParseErrors::new(watched)), service);
            watch.drive(conn, |c| c.graceful_shutdown()).await;
        }
        Protocol::Http2 => {
            let mut builder = http2::Builder::new(TokioExecutor::new());
            builder
                .timer(TokioTimer::new())
                .keep_alive_interval(Some(H2_KEEPALIVE))
                .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT)
                .max_concurrent_streams(H2_MAX_STREAMS)
                .max_header_list_size(crate::common::names::MAX_HEADER_BYTES as u32);
            let conn = builder.serve_connection(TokioIo::new(watched), service);
            watch.drive(conn, |c| c.graceful_shutdown()).await;
        }
    }
}

/// Closes a connection the server no longer wants: an HTTP/2 one is told to go away (and given a moment to) rather
/// than dropped.
async fn close<C: Future<Output = Result<(), hyper::Error>>>(
    http2: bool,
    mut conn: Pin<&mut C>,
    graceful: &impl Fn(Pin<&mut C>),
) {
    if http2 {
        graceful(conn.as_mut());
        let _ = tokio::time::timeout(CUT_WRITE, conn).await;
    }
}

/// What watches one connection: its peer, activity and the server's phase.
struct Watch {
    peer: SocketAddr,
    activity: Arc<Activity>,
    shared: Arc<Shared>,
    phase: watch::Receiver<Phase>,
}

impl Watch {
    /// Runs `conn` until it ends, a timeout closes it or the drain does; `graceful` asks it to finish (HTTP/1:
    /// after the response in flight; HTTP/2: a GOAWAY, the open streams finishing).
    async fn drive<C>(mut self, conn: C, graceful: impl Fn(Pin<&mut C>))
    where
        C: Future<Output = Result<(), hyper::Error>>,
    {
        let Watch {
            peer,
            ref activity,
            ref shared,
            ..
        } = self;
        let mut conn = std::pin::pin!(conn);
        let http2 = shared.protocol == Protocol::Http2;
        loop {
            let deadline = activity.deadline(shared);
            let changed = activity.changed.notified();
            let pressure = shared.pressure.notified();
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(e) = result {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                    return;
                }
                () = tokio::time::sleep_until(deadline) => {
                    if let Some(reason) = activity.expired(shared, Instant::now()) {
                        tracing::debug!(%peer, reason, "closing the connection");
                        return close(http2, conn.as_mut(), &graceful).await;
                    }
                }
                () = changed => {}
                () = pressure => {
                    if activity.idle_for(Instant::now()).is_some_and(|idle| idle >= REAP_MIN_IDLE) {
                        tracing::debug!(%peer, "closing an idle connection to make room");
                        return close(http2, conn.as_mut(), &graceful).await;
                    }
                }
                Ok(()) = self.phase.changed() => {
                    // Copied out: the guard must not live across the await below.
                    let now = *self.phase.borrow_and_update();
                    match now {
                        Phase::Serving => {}
                        Phase::Draining => {
                            if activity.idle_for(Instant::now()).is_some() {
                                return close(http2, conn.as_mut(), &graceful).await;
                            }
                            graceful(conn.as_mut());
                        }
                        Phase::Closing => {
                            // A stream still open is ending with an error event (`body.rs`): a moment to write it.
                            let _ = tokio::time::timeout(CUT_WRITE, conn.as_mut()).await;
                            return;
                        }
                    }
                }
            }
        }
    }
}

const NONE: u64 = u64::MAX;

/// What one connection is doing, for its timeouts. Times are milliseconds since `born`.
struct Activity {
    born: Instant,
    /// Requests handed to the router whose response has not ended (0 or 1 with HTTP/1).
    in_flight: AtomicU32,
    /// When the last response ended (or the connection was accepted).
    idle_since: AtomicU64,
    /// When the first byte of the next request head arrived; `NONE` while none has.
    head_since: AtomicU64,
    /// Notified when a request ends or a head starts: the deadline moves.
    changed: Notify,
    /// Whether bytes with no request in flight start a request head (HTTP/1), with its timeout.
    heads: bool,
}

impl Activity {
    fn new(heads: bool) -> Self {
        Self {
            heads,
            born: Instant::now(),
            in_flight: AtomicU32::new(0),
            idle_since: AtomicU64::new(0),
            head_since: AtomicU64::new(NONE),
            changed: Notify::new(),
        }
    }

    fn ms(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.born).as_millis()).unwrap_or(NONE - 1)
    }

    fn at(&self, ms: u64) -> Instant {
        self.born + Duration::from_millis(ms)
    }

    /// Bytes arrived: with no request in flight they start the next request's head.
    fn bytes_in(&self, now: Instant) {
        if self.heads
            && self.in_flight.load(Ordering::Acquire) == 0
            && self
                .head_since
                .compare_exchange(NONE, self.ms(now), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.changed.notify_one();
        }
    }

    /// The router took a request (its head is complete).
    fn start_request(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.head_since.store(NONE, Ordering::Release);
    }

    /// A response ended (or its request was dropped).
    fn end_request(&self, now: Instant) {
        self.idle_since.store(self.ms(now), Ordering::Release);
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.changed.notify_one();
        }
    }

    fn request_started(self: &Arc<Self>) -> RequestGuard {
        self.start_request();
        RequestGuard(Arc::clone(self))
    }

    /// How long the connection has had nothing to do; `None` while a request is in flight or arriving.
    fn idle_for(&self, now: Instant) -> Option<Duration> {
        if self.in_flight.load(Ordering::Acquire) > 0 || self.head_since.load(Ordering::Acquire) != NONE {
            return None;
        }
        let since = self.idle_since.load(Ordering::Acquire);
        Some(Duration::from_millis(self.ms(now).saturating_sub(since)))
    }

    /// When the connection is to be closed if nothing changes (far away while a request is in flight).
    fn deadline(&self, shared: &Shared) -> Instant {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return self.born + Duration::from_secs(86_400 * 365);
        }
        match self.head_since.load(Ordering::Acquire) {
            NONE => self.at(self.idle_since.load(Ordering::Acquire)) + shared.idle_timeout,
            head => self.at(head) + shared.header_read_timeout,
        }
    }

    /// Why the connection is to be closed now, if it is.
    fn expired(&self, shared: &Shared, now: Instant) -> Option<&'static str> {
        if self.in_flight.load(Ordering::Acquire) > 0 || now < self.deadline(shared) {
            return None;
        }
        Some(if self.head_since.load(Ordering::Acquire) == NONE {
            "idle timeout"
        } else {
            "header read timeout"
        })
    }
}

/// A request in flight on a connection, until its response body is done or dropped.
struct RequestGuard(Arc<Activity>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.end_request(Instant::now());
    }
}

/// The client's stream, reporting the bytes it reads to the connection's [`Activity`].
struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.bytes_in(Instant::now());
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The router as one connection's hyper service: marks requests in flight and gives handlers the peer address
/// (`ConnectInfo<SocketAddr>`, as `into_make_service_with_connect_info` would).
#[derive(Clone)]
struct ConnService {
    inner: TowerToHyperService<Router>,
    peer: SocketAddr,
    activity: Arc<Activity>,
}

type ServiceFuture = Pin<Box<dyn Future<Output = Result<Response<WithGuard<RequestGuard>>, Infallible>> + Send>>;

impl hyper::service::Service<hyper::Request<Incoming>> for ConnService {
    type Response = Response<WithGuard<RequestGuard>>;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, mut request: hyper::Request<Incoming>) -> Self::Future {
        let guard = self.activity.request_started();
        request.extensions_mut().insert(ConnectInfo(self.peer));
        let response = hyper::service::Service::call(&self.inner, request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|body| WithGuard::new(body, guard)))
        })
    }
}

/// Warns at start when `max_connections` clients plus `max_in_flight` upstream connections would not fit under
/// the process's open-file limit (Linux: read from `/proc/self/limits`).
/// Once per process: `epp` runs two listeners (gRPC and HTTP) over one limit.
fn warn_if_short_of_fds(config: &ServerConfig) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let Some(limit) = open_files_limit() else {
        return;
    };
    let wanted = u64::from(config.max_connections) + u64::from(config.max_in_flight) + FD_RESERVE;
    if wanted > limit && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            open_files_limit = limit,
            max_connections = config.max_connections,
            max_in_flight = config.max_in_flight,
            "max_connections + max_in_flight + {FD_RESERVE} exceeds the open-file limit: raise it (ulimit -n, \
             systemd LimitNOFILE=) or lower server.max_connections; until then accept fails with EMFILE first \
             (the gateway keeps serving, closing idle connections to make room)"
        );
    }
}

/// The soft `RLIMIT_NOFILE`, where the system tells it.
fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
#[path = "listener_tests.rs"]
mod tests;
