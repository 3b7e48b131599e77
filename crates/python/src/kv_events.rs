//! A rank's KV event feed inside an engine: a background thread (one tokio runtime per `Router`, one task per
//! rank) subscribes to the rank's publisher with the gateway's bounded ZMTP reader (`dprouter-zmtp`: a frame
//! declaring a petabyte, an endless message or a garbage greeting ends that connection, never the engine's
//! process) and hands each batch to the router's [`DpRouter::apply_kv_events`] (the core's decoder, gap and
//! restart rules). Both socket shapes: the publisher binds and the feed connects, or the feed binds where the
//! publisher connects; either way a connection that ends is made again after a second. No replay: a gap makes the
//! rank approximate until its next stored blocks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dprouter_core::dp_router::{DpRouter, KvOutcome};
use dprouter_zmtp::kv;
use tokio::net::{TcpListener, TcpStream};

/// Pause before connecting again, or accepting again, after a connection ended.
const RECONNECT: Duration = Duration::from_secs(1);

/// What one rank's feed has seen.
#[derive(Debug, Clone, Default)]
pub struct FeedStatus {
    pub rank: usize,
    pub endpoint: String,
    pub bind: bool,
    pub connected: bool,
    pub batches: u64,
    pub gaps: u64,
    pub restarts: u64,
    pub decode_errors: u64,
    /// Messages that were not `[topic, seq, payload]`, or past the limits (the connection then ends).
    pub frame_errors: u64,
}

/// The feeds of one router: their runtime (stopped with them) and their statuses.
pub struct Feeds {
    runtime: Option<tokio::runtime::Runtime>,
    pub statuses: Vec<Arc<Mutex<FeedStatus>>>,
}

impl Feeds {
    pub fn new() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("dprouter-kv-events")
            .enable_io()
            .enable_time()
            .build()?;
        Ok(Self {
            runtime: Some(runtime),
            statuses: Vec::new(),
        })
    }

    /// Follows `rank`'s publisher at `endpoint` (`tcp://host:port`), connecting to it or, with `bind`, binding
    /// there for it to connect; messages whose topic does not start with `topic` are not sent by the publisher.
    pub fn follow(
        &mut self,
        router: Arc<Mutex<DpRouter>>,
        rank: usize,
        endpoint: &str,
        bind: bool,
        topic: Vec<u8>,
        clock: fn() -> u64,
    ) -> Result<(), String> {
        let address =
            dprouter_zmtp::tcp_address(endpoint).ok_or_else(|| format!("{endpoint} is not tcp://host:port"))?;
        let status = Arc::new(Mutex::new(FeedStatus {
            rank,
            endpoint: endpoint.to_string(),
            bind,
            ..FeedStatus::default()
        }));
        self.statuses.push(Arc::clone(&status));
        let runtime = self.runtime.as_ref().ok_or("the feeds are stopped")?;
        let feed = Feed {
            router,
            rank,
            status,
            topic,
            clock,
        };
        runtime.spawn(feed.run(address, bind));
        Ok(())
    }
}

impl Drop for Feeds {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

struct Feed {
    router: Arc<Mutex<DpRouter>>,
    rank: usize,
    status: Arc<Mutex<FeedStatus>>,
    topic: Vec<u8>,
    clock: fn() -> u64,
}

impl Feed {
    fn status(&self, f: impl FnOnce(&mut FeedStatus)) {
        f(&mut self.status.lock().unwrap_or_else(|e| e.into_inner()));
    }

    async fn run(self, address: String, bind: bool) {
        let listener = match bind {
            false => None,
            true => loop {
                match TcpListener::bind(&address).await {
                    Ok(listener) => break Some(listener),
                    Err(_) => tokio::time::sleep(RECONNECT).await,
                }
            },
        };
        loop {
            let stream = match &listener {
                Some(listener) => listener.accept().await.map(|(s, _)| s).ok(),
                None => tokio::time::timeout(kv::HANDSHAKE_TIMEOUT, TcpStream::connect(&address))
                    .await
                    .ok()
                    .and_then(Result::ok),
            };
            if let Some(stream) = stream {
                self.read(stream).await;
                self.status(|s| s.connected = false);
            }
            tokio::time::sleep(RECONNECT).await;
        }
    }

    /// Reads one publisher's connection until it ends.
    async fn read(&self, stream: TcpStream) {
        let Ok(mut conn) = kv::subscribe(stream, &self.topic).await else {
            return;
        };
        self.status(|s| s.connected = true);
        loop {
            let frames = match conn.recv().await {
                Ok(frames) => frames,
                Err(e) => {
                    if e.is_too_large() {
                        self.status(|s| s.frame_errors += 1);
                    }
                    return;
                }
            };
            let Some((seq, payload)) = kv::sequenced(&frames) else {
                self.status(|s| s.frame_errors += 1);
                continue;
            };
            let now = (self.clock)();
            let outcome = {
                let mut router = self.router.lock().unwrap_or_else(|e| e.into_inner());
                router.apply_kv_events(self.rank as i64, seq, payload, now)
            };
            self.status(|s| match outcome {
                Ok(KvOutcome::Applied(_)) => s.batches += 1,
                Ok(KvOutcome::Restarted(_)) => {
                    s.batches += 1;
                    s.restarts += 1;
                }
                Ok(KvOutcome::Gap { .. }) => {
                    s.batches += 1;
                    s.gaps += 1;
                }
                Ok(KvOutcome::Duplicate) => {}
                Ok(KvOutcome::Undecodable(_)) | Err(_) => s.decode_errors += 1,
            });
        }
    }
}
