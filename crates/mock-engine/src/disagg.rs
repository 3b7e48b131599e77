//! Prefill/decode disaggregation as SGLang does it (`--disaggregation-mode prefill|decode`), for the gateway's
//! tests and benchmarks.
//!
//! Every request carries a **bootstrap room**, which pairs its prefill leg with its decode leg; one without is
//! refused by both, as SGLang refuses it. A **prefill** mock puts a request on rank `room % dp_size` (SGLang's
//! `follow_bootstrap_room`, a prefill server's default; a `routed_dp_rank` that disagrees fails the request),
//! prefills it against that rank's radix cache, then holds the room's KV cache ([`Rooms`]) until a decode server
//! fetches it through the prefill mock's **bootstrap server** (`GET /kv/{room}?rank=R` on
//! `--disaggregation-bootstrap-port`), or fails the request after the bootstrap timeout; once fetched it takes
//! the transfer time and answers with one token. A **decode** mock takes the rank `routed_dp_rank` names (else
//! its own round robin), fetches the room from `bootstrap_host:bootstrap_port` (its own bootstrap port when the
//! request's is `null`) naming the prefill rank `disagg_prefill_dp_rank` (else the room's residue is the prefill
//! server's business), takes the transfer time, and decodes; its usage reports the prompt tokens the prefill rank
//! had cached. A fetch that fails (nothing at that address, a rank that does not hold the room, no room within the
//! bootstrap timeout) fails the request with a 500 (an error event once a stream has begun).
//!
//! Under `--api vllm` the mock follows vLLM's KV connectors' flow instead, in sequence: a prefill mock given
//! `kv_transfer_params` with `do_remote_decode` prefills, answers at once with `kv_transfer_params` that name its
//! bootstrap server and a room of its own (`remote_host`, `remote_port`, `remote_request_id`), and holds the KV
//! cache until it is fetched or the timeout passes; a decode mock given `do_remote_prefill` fetches it from there,
//! and one given no `kv_transfer_params` prefills the prompt itself. A request without them is served whole.
//!
//! The bootstrap protocol is the mock's own (SGLang's moves KV through Mooncake or NIXL, which the mock has no
//! use for); what the gateway must get right, the fields and the ranks, is checked the way SGLang checks it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, Notify};

/// A server's part under disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Prefill,
    Decode,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Prefill => "prefill",
            Mode::Decode => "decode",
        }
    }
}

/// The largest bootstrap room (SGLang's routers draw them in [0, 2^63 − 1]).
pub const MAX_ROOM: u64 = (1 << 63) - 1;

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// How a mock takes part in disaggregation.
#[derive(Debug, Clone)]
pub struct Disaggregation {
    pub mode: Mode,
    /// The host its bootstrap server is reached at (vLLM's `kv_transfer_params` name it).
    pub host: String,
    /// A prefill mock's bootstrap server's port; a decode mock's for requests whose `bootstrap_port` is `null`.
    pub bootstrap_port: u16,
    /// How long a prefill mock holds a room's KV cache for a decode server, and a decode mock waits for it
    /// (SGLang's `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` and `_WAITING_TIMEOUT`, 300 s by default).
    pub timeout: Duration,
    /// Fault: a prefill mock's bootstrap server takes connections and never answers.
    pub bootstrap_hangs: bool,
}

impl Disaggregation {
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            host: "127.0.0.1".into(),
            bootstrap_port: DEFAULT_BOOTSTRAP_PORT,
            timeout: Duration::from_secs(300),
            bootstrap_hangs: false,
        }
    }
}

/// What a decode server learns of a room's KV cache when it fetches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kv {
    /// The prefill rank that holds it.
    pub rank: u32,
    pub prompt_tokens: usize,
    /// The prompt tokens the prefill rank had cached.
    pub cached_tokens: usize,
}

/// A prefill server's rooms: those being prefilled, and those whose KV cache waits for its decode server.
#[derive(Default)]
pub struct Rooms {
    rooms: Mutex<HashMap<u64, Room>>,
    changed: Notify,
}

struct Room {
    rank: u32,
    ready: Option<(Kv, oneshot::Sender<()>)>,
}

/// A room a request holds: it is forgotten when the request ends, whichever way.
pub struct RoomGuard {
    rooms: Arc<Rooms>,
    pub room: u64,
}

impl Rooms {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Room>> {
        self.rooms.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request on `rank` takes `room`; a room in use is refused.
    pub fn open(self: &Arc<Self>, room: u64, rank: u32) -> Result<RoomGuard, String> {
        let mut rooms = self.lock();
        if rooms.contains_key(&room) {
            return Err(format!("bootstrap_room {room} is already in use"));
        }
        rooms.insert(room, Room { rank, ready: None });
        drop(rooms);
        self.changed.notify_waiters();
        Ok(RoomGuard {
            rooms: Arc::clone(self),
            room,
        })
    }

    /// How many rooms are open.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits (at most `timeout`) for `room`'s KV cache and takes it; `rank`, when given, must be the rank that
    /// holds it.
    pub async fn fetch(&self, room: u64, rank: Option<u32>, timeout: Duration) -> Result<Kv, (StatusCode, String)> {
        let wait = async {
            loop {
                let changed = self.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                {
                    let mut rooms = self.lock();
                    if let Some(held) = rooms.get_mut(&room) {
                        if let Some(asked) = rank.filter(|&r| r != held.rank) {
                            return Err((
                                StatusCode::NOT_FOUND,
                                format!("bootstrap_room {room} is on prefill rank {}, not {asked}", held.rank),
                            ));
                        }
                        if let Some((kv, fetched)) = held.ready.take() {
                            let _ = fetched.send(());
                            return Ok(kv);
                        }
                    }
                }
                changed.await;
            }
        };
        tokio::time::timeout(timeout, wait).await.unwrap_or_else(|_| {
            Err((
                StatusCode::GATEWAY_TIMEOUT,
                format!("bootstrap_room {room} was not ready within {} s", timeout.as_secs_f64()),
            ))
        })
    }
}

impl RoomGuard {
    /// The room's KV cache is ready: the receiver hears when a decode server has taken it.
    pub fn ready(&self, kv: Kv) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        if let Some(room) = self.rooms.lock().get_mut(&self.room) {
            room.ready = Some((kv, tx));
        }
        self.rooms.changed.notify_waiters();
        rx
    }
}

impl Drop for RoomGuard {
    fn drop(&mut self) {
        self.rooms.lock().remove(&self.room);
        self.rooms.changed.notify_waiters();
    }
}

#[derive(Deserialize)]
struct FetchQuery {
    rank: Option<u32>,
}

#[derive(Clone)]
struct BootstrapState {
    rooms: Arc<Rooms>,
    timeout: Duration,
    hangs: bool,
}

/// The prefill mock's bootstrap server.
pub fn bootstrap_router(rooms: Arc<Rooms>, config: &Disaggregation) -> Router {
    Router::new()
        .route("/kv/{room}", get(fetch))
        .with_state(BootstrapState {
            rooms,
            timeout: config.timeout,
            hangs: config.bootstrap_hangs,
        })
}

async fn fetch(State(s): State<BootstrapState>, Path(room): Path<u64>, Query(q): Query<FetchQuery>) -> Response {
    if s.hangs {
        std::future::pending::<()>().await;
    }
    match s.rooms.fetch(room, q.rank, s.timeout).await {
        Ok(kv) => Json(kv).into_response(),
        Err((status, message)) => (status, message).into_response(),
    }
}

/// Where a decode mock fetches a request's KV cache from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub host: String,
    pub port: u16,
    pub room: u64,
    /// The prefill rank the request names (`disagg_prefill_dp_rank`).
    pub rank: Option<u32>,
}

/// Fetches `source`'s KV cache from its prefill server's bootstrap server, within `timeout`.
pub async fn fetch_kv(source: &Source, timeout: Duration) -> Result<Kv, String> {
    let what = format!(
        "KV transfer of bootstrap_room {} from {}:{}",
        source.room, source.host, source.port
    );
    let exchange = async {
        let host = if source.host.contains(':') {
            format!("[{}]", source.host)
        } else {
            source.host.clone()
        };
        let address = format!("{host}:{}", source.port);
        let stream = tokio::net::TcpStream::connect(&address)
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake::<_, http_body_util::Empty<bytes::Bytes>>(
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let rank = source.rank.map(|r| format!("?rank={r}")).unwrap_or_default();
        let request = hyper::Request::get(format!("/kv/{}{rank}", source.room))
            .header(hyper::header::HOST, address)
            .body(http_body_util::Empty::new())
            .map_err(|e| e.to_string())?;
        let response = sender.send_request(request).await.map_err(|e| e.to_string())?;
        let status = response.status();
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("{status}: {}", String::from_utf8_lossy(&body)));
        }
        serde_json::from_slice::<Kv>(&body).map_err(|e| e.to_string())
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(kv)) => Ok(kv),
        Ok(Err(e)) => Err(format!("{what} failed: {e}")),
        Err(_) => Err(format!("{what} timed out after {} s", timeout.as_secs_f64())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(rank: u32) -> Kv {
        Kv {
            rank,
            prompt_tokens: 10,
            cached_tokens: 4,
        }
    }

    #[tokio::test]
    async fn a_fetch_waits_for_the_room_and_takes_it_once() {
        let rooms = Arc::new(Rooms::default());
        let early = {
            let rooms = Arc::clone(&rooms);
            tokio::spawn(async move { rooms.fetch(7, Some(1), Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        let guard = rooms.open(7, 1).unwrap();
        assert!(rooms.open(7, 1).is_err(), "a room in use is refused");
        let fetched = guard.ready(kv(1));
        assert_eq!(early.await.unwrap(), Ok(kv(1)));
        fetched.await.unwrap();
        // Taken: a second fetch waits until its timeout.
        let again = rooms.fetch(7, None, Duration::from_millis(20)).await;
        assert_eq!(again.unwrap_err().0, StatusCode::GATEWAY_TIMEOUT);
        drop(guard);
        assert!(rooms.is_empty());
    }

    #[tokio::test]
    async fn a_fetch_naming_another_rank_is_refused() {
        let rooms = Arc::new(Rooms::default());
        let guard = rooms.open(9, 0).unwrap();
        let _fetched = guard.ready(kv(0));
        let wrong = rooms.fetch(9, Some(1), Duration::from_secs(1)).await;
        assert_eq!(wrong.unwrap_err().0, StatusCode::NOT_FOUND);
        assert_eq!(rooms.fetch(9, Some(0), Duration::from_secs(1)).await, Ok(kv(0)));
    }
}
