//! Precise mode's feed: the engines' KV cache events, followed per endpoint into the policies' index.
//!
//! For every endpoint of a worker configured with `kv_events`, one task subscribes (ZMQ SUB, every topic) to the
//! rank's publisher, decodes each batch ([`dprouter_core::kv_events`]), follows its events into the router's block
//! hashes ([`EngineBlocks`]) and hands the changes to the policies that may route to the endpoint (the default one
//! and each of its worker's models'), which `cache_aware` applies ([`dprouter_core::policy::Policy::engine_cache`]).
//!
//! Sequence numbers are checked ([`classify`]): a batch after a gap is preceded by a replay of the missing ones
//! from the worker's replay endpoint when one is configured. Events that are lost (a gap that cannot be filled, a
//! batch that cannot be decoded: truncated, an unknown event type) or too many to follow put the endpoint back in
//! approximate mode (`Untracked`: its index entries stay, as guesses, and its decisions are no longer provisional)
//! and the feed starts following afresh; the next stored blocks make it precise again. `GET /kv_events` and
//! `dprouter_kv_event_errors_total` say so. A batch whose sequence number is not past the last one applied is a
//! duplicate (the live stream overlapping a replay) when it is not newer either, and otherwise an engine that
//! restarted, with an empty cache (`Cleared`). On subscribing, the feed
//! replays whatever the engine still holds from sequence 0, so a gateway that starts after the engine learns its
//! cache as far as the engine's replay buffer reaches. A publisher that is down is retried every second; one that
//! never publishes leaves its endpoint in approximate mode. Nothing here blocks routing: the policies' lock is
//! taken once per change.
//!
//! Workers added at run time (`POST /workers`) have no events: only the config file names them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dprouter_core::engine_blocks::{CacheChange, EngineBlocks, FollowError};
use dprouter_core::kv_events::{decode_batch, EventBatch};
use dprouter_core::{EndpointId, PolicyConfig};
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::config::worker_url_key;
use crate::state::AppState;
use crate::telemetry;

/// Engine blocks followed per endpoint at most (about 60 bytes each, plus the events' tokens).
pub const MAX_ENGINE_BLOCKS: usize = 4 << 20;
/// How long a replay may take.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before reconnecting to a publisher.
const RECONNECT: Duration = Duration::from_secs(1);
/// The end-of-replay sequence number.
const END: u64 = u64::MAX;
/// The `kind`s of `dprouter_kv_event_errors_total`.
const ERROR_KINDS: [&str; 7] = ["gap", "restart", "decode", "orphan", "overflow", "replay", "frames"];

/// What one endpoint's feed has seen, for `GET /kv_events`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FeedStatus {
    pub endpoint: String,
    pub publisher: String,
    pub replay: Option<String>,
    /// Subscribed, and caught up with what the engine's replay held then.
    pub connected: bool,
    pub batches: u64,
    pub last_seq: Option<u64>,
    /// Engine blocks followed, and the router blocks they make.
    pub engine_blocks: usize,
    pub router_blocks: usize,
    pub gaps: u64,
    pub replayed_batches: u64,
    pub restarts: u64,
    pub decode_errors: u64,
    /// Stored blocks whose parent was never seen (events before the subscription, or lost).
    pub orphans: u64,
    pub overflows: u64,
    /// The endpoint's index follows the events (false: approximate, after lost events or before any).
    pub precise: bool,
}

/// Every feed's status, by endpoint.
pub type Feeds = Arc<Mutex<HashMap<EndpointId, FeedStatus>>>;

fn lock(feeds: &Feeds) -> std::sync::MutexGuard<'_, HashMap<EndpointId, FeedStatus>> {
    feeds.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the supervisor when a worker has `kv_events` and the policy is `cache_aware`.
pub fn spawn(state: Arc<AppState>, stop: watch::Receiver<bool>) -> Option<JoinHandle<()>> {
    if !state.config.workers.iter().any(|w| w.kv_events.is_some()) {
        return None;
    }
    let PolicyConfig::CacheAware(policy) = &state.config.routing else {
        tracing::warn!("kv_events are configured, but only cache_aware uses them: not subscribing");
        return None;
    };
    let block_tokens = policy.block_tokens;
    Some(tokio::spawn(supervise(state, stop, block_tokens)))
}

/// Keeps one feed per endpoint with events, as endpoints come and go.
async fn supervise(state: Arc<AppState>, mut stop: watch::Receiver<bool>, block_tokens: usize) {
    let mut feeds: HashMap<EndpointId, JoinHandle<()>> = HashMap::new();
    let mut ticker = tokio::time::interval(RECONNECT);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.changed() => break,
        }
        let membership = state.registry.membership();
        let mut present = Vec::new();
        for target in &membership.targets {
            let key = worker_url_key(&target.base);
            let Some(worker) = state.config.workers.iter().find(|w| worker_url_key(&w.url) == key) else {
                continue;
            };
            let rank = target.id.dp_rank;
            let Some(publisher) = worker.kv_events.as_ref().and_then(|e| e.for_rank(rank)) else {
                continue;
            };
            present.push(target.id);
            if feeds.contains_key(&target.id) {
                continue;
            }
            let replay = worker.kv_events_replay.as_ref().and_then(|e| e.for_rank(rank));
            let feed = Feed {
                state: Arc::clone(&state),
                endpoint: target.id,
                models: target.models.to_vec(),
                publisher,
                replay,
                blocks: EngineBlocks::new(block_tokens, MAX_ENGINE_BLOCKS),
                last: None,
            };
            feeds.insert(target.id, tokio::spawn(feed.run()));
        }
        feeds.retain(|id, task| {
            let keep = present.contains(id);
            if !keep {
                task.abort();
                lock(&state.kv_feeds).remove(id);
            }
            keep
        });
    }
    for task in feeds.into_values() {
        task.abort();
    }
}

struct Feed {
    state: Arc<AppState>,
    endpoint: EndpointId,
    models: Vec<String>,
    publisher: String,
    replay: Option<String>,
    blocks: EngineBlocks,
    /// The last sequence number applied, and its batch's time.
    last: Option<(u64, f64)>,
}

/// What to do with a batch, given the last one applied.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Verdict {
    Apply,
    /// Already applied (a replay and the live stream overlap).
    Duplicate,
    /// The engine restarted: its cache is empty; its batches from 0 are replayed, then this one applies.
    Restart,
    /// The first batch seen, not the engine's first: the earlier ones are replayed first, if the engine has them.
    Join,
    /// Batches `from..to` were missed: replay them first.
    Gap {
        from: u64,
        to: u64,
    },
}

/// Checks a batch's sequence number `seq` and time `ts` against the last batch applied.
fn classify(last: Option<(u64, f64)>, seq: u64, ts: f64) -> Verdict {
    match last {
        None if seq > 0 => Verdict::Join,
        None => Verdict::Apply,
        Some((last, last_ts)) if seq <= last => {
            if ts > last_ts {
                Verdict::Restart
            } else {
                Verdict::Duplicate
            }
        }
        Some((last, _)) if seq > last + 1 => Verdict::Gap {
            from: last + 1,
            to: seq,
        },
        Some(_) => Verdict::Apply,
    }
}

impl Feed {
    fn status(&self, f: impl FnOnce(&mut FeedStatus)) {
        let mut feeds = lock(&self.state.kv_feeds);
        let status = feeds.entry(self.endpoint).or_insert_with(|| FeedStatus {
            endpoint: self.endpoint.to_string(),
            publisher: self.publisher.clone(),
            replay: self.replay.clone(),
            ..FeedStatus::default()
        });
        f(status);
        status.engine_blocks = self.blocks.len();
        status.router_blocks = self.blocks.router_blocks();
        status.last_seq = self.last.map(|(seq, _)| seq);
    }

    fn count(&self, kind: &'static str) {
        self.count_n(kind, 1);
    }

    fn count_n(&self, kind: &'static str, n: u64) {
        metrics::counter!(telemetry::KV_EVENT_ERRORS, "endpoint" => self.endpoint.to_string(), "kind" => kind)
            .increment(n);
    }

    /// Hands a change to every policy that may route to the endpoint.
    fn deliver(&self, change: &CacheChange) {
        let now = crate::clock::now_us();
        self.state.policy.engine_cache(self.endpoint, change, now);
        for model in &self.models {
            self.state
                .policy_for(Some(model))
                .engine_cache(self.endpoint, change, now);
        }
    }

    /// The engine's cache is empty (it restarted): so is the endpoint's index.
    fn clear(&mut self) {
        self.blocks.clear();
        self.deliver(&CacheChange::Cleared);
    }

    /// Events were lost: the endpoint is approximate until the next stored blocks, followed afresh.
    fn untrack(&mut self) {
        self.blocks.clear();
        self.deliver(&CacheChange::Untracked);
        self.status(|s| s.precise = false);
    }

    async fn run(mut self) {
        // Every kind of trouble starts counted at 0, so its rate is defined before the first one.
        for kind in ERROR_KINDS {
            self.count_n(kind, 0);
        }
        metrics::counter!(telemetry::KV_EVENT_BATCHES, "endpoint" => self.endpoint.to_string()).increment(0);
        loop {
            let mut socket = zeromq::SubSocket::new();
            let connected = async {
                socket.connect(&self.publisher).await?;
                socket.subscribe("").await
            };
            if let Err(e) = connected.await {
                tracing::debug!(endpoint = %self.endpoint, publisher = %self.publisher, error = %e, "KV events: cannot subscribe yet");
                tokio::time::sleep(RECONNECT).await;
                continue;
            }
            tracing::info!(endpoint = %self.endpoint, publisher = %self.publisher, "KV events: subscribed");
            // What the engine published before (or while) we subscribed, as far as it still holds it; the feed
            // counts as connected once it has caught up.
            let from = self.last.map_or(0, |(seq, _)| seq + 1);
            self.replay_range(from, u64::MAX).await;
            self.status(|s| s.connected = true);
            while let Ok(message) = socket.recv().await {
                let frames = message.into_vec();
                let Some((seq, payload)) = sequenced(&frames) else {
                    self.count("frames");
                    continue;
                };
                self.receive(seq, payload).await;
            }
            self.status(|s| s.connected = false);
            tracing::warn!(endpoint = %self.endpoint, "KV events: the subscription ended; reconnecting");
            tokio::time::sleep(RECONNECT).await;
        }
    }

    /// One batch: the sequence checked (replaying or clearing as needed), then applied.
    async fn receive(&mut self, seq: u64, payload: &[u8]) {
        let batch = match decode_batch(payload) {
            Ok(batch) => batch,
            Err(e) => {
                tracing::warn!(endpoint = %self.endpoint, seq, error = %e, "KV events: a batch could not be read: approximate mode");
                self.count("decode");
                self.status(|s| s.decode_errors += 1);
                self.untrack();
                let ts = self.last.map_or(0.0, |(_, ts)| ts);
                self.last = Some((seq, ts));
                return;
            }
        };
        match classify(self.last, seq, batch.ts) {
            Verdict::Apply => {}
            Verdict::Duplicate => return,
            Verdict::Restart => {
                tracing::warn!(endpoint = %self.endpoint, seq, "KV events: the sequence went back (engine restart): index emptied");
                self.count("restart");
                self.status(|s| s.restarts += 1);
                self.clear();
                self.last = None;
                self.replay_range(0, seq).await;
            }
            Verdict::Join => {
                self.replay_range(0, seq).await;
            }
            Verdict::Gap { from, to } => {
                self.count("gap");
                self.status(|s| s.gaps += 1);
                if !self.replay_range(from, to).await {
                    tracing::warn!(endpoint = %self.endpoint, from, to, "KV events: missed batches could not be replayed: approximate mode");
                    self.untrack();
                }
            }
        }
        self.apply(seq, &batch);
    }

    fn apply(&mut self, seq: u64, batch: &EventBatch) {
        self.last = Some((seq, batch.ts));
        let (mut orphans, mut overflow) = (0, false);
        for event in &batch.events {
            match self.blocks.apply(event) {
                Ok(Some(change)) => {
                    self.deliver(&change);
                    if !matches!(change, CacheChange::Untracked) {
                        self.status(|s| s.precise = true);
                    }
                }
                Ok(None) => {}
                Err(FollowError::Orphan) => orphans += 1,
                Err(FollowError::TooMany(_)) => overflow = true,
            }
        }
        if overflow {
            tracing::warn!(endpoint = %self.endpoint, max = MAX_ENGINE_BLOCKS, "KV events: too many engine blocks to follow: approximate mode");
            self.count("overflow");
            self.untrack();
        }
        if orphans > 0 {
            self.count_n("orphan", orphans);
        }
        metrics::counter!(telemetry::KV_EVENT_BATCHES, "endpoint" => self.endpoint.to_string()).increment(1);
        self.status(|s| {
            s.batches += 1;
            s.orphans += orphans;
            s.overflows += u64::from(overflow);
        });
    }

    /// Replays batches `from..to` from the replay endpoint and applies them in order; `true` if all of them came
    /// (`to = u64::MAX`: whatever there is).
    async fn replay_range(&mut self, from: u64, to: u64) -> bool {
        let Some(replay) = self.replay.clone() else {
            return false;
        };
        let fetched = tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(&replay, from)).await;
        let batches = match fetched {
            Ok(Ok(batches)) => batches,
            Ok(Err(e)) => {
                tracing::warn!(endpoint = %self.endpoint, %replay, error = %e, "KV events: replay failed");
                self.count("replay");
                return false;
            }
            Err(_) => {
                tracing::warn!(endpoint = %self.endpoint, %replay, "KV events: replay timed out");
                self.count("replay");
                return false;
            }
        };
        let wanted: Vec<(u64, Bytes)> = batches.into_iter().filter(|(s, _)| (from..to).contains(s)).collect();
        let complete =
            to == u64::MAX || (wanted.len() as u64 == to - from && wanted.first().is_none_or(|(s, _)| *s == from));
        let n = wanted.len() as u64;
        for (seq, payload) in wanted {
            match decode_batch(&payload) {
                Ok(batch) if classify(self.last, seq, batch.ts) != Verdict::Duplicate => self.apply(seq, &batch),
                Ok(_) => {}
                Err(_) => {
                    self.count("decode");
                    self.status(|s| s.decode_errors += 1);
                    self.untrack();
                    return false;
                }
            }
        }
        self.status(|s| s.replayed_batches += n);
        complete
    }
}

/// The sequence number and payload of a message: `[topic, seq, payload]` (or without the topic).
fn sequenced(frames: &[Bytes]) -> Option<(u64, &[u8])> {
    let [.., seq, payload] = frames else { return None };
    let seq = <[u8; 8]>::try_from(seq.as_ref()).ok()?;
    Some((u64::from_be_bytes(seq), payload.as_ref()))
}

/// Asks a replay endpoint for every batch from `from`; returns them in order. Replies are
/// `[empty, seq, payload]` or, from newer vLLM, `[empty, topic, seq, payload]`, ending with sequence -1.
async fn fetch_replay(endpoint: &str, from: u64) -> Result<Vec<(u64, Bytes)>, String> {
    let mut socket = zeromq::DealerSocket::new();
    socket.connect(endpoint).await.map_err(|e| e.to_string())?;
    let request = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())])
        .map_err(|e| e.to_string())?;
    socket.send(request).await.map_err(|e| e.to_string())?;
    let mut batches = Vec::new();
    loop {
        let frames = socket.recv().await.map_err(|e| e.to_string())?.into_vec();
        let (seq, payload) = sequenced(&frames).ok_or("a replay reply without a sequence number")?;
        if seq == END {
            return Ok(batches);
        }
        batches.push((seq, Bytes::copy_from_slice(payload)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_tell_gaps_duplicates_and_restarts() {
        assert_eq!(classify(None, 0, 1.0), Verdict::Apply);
        assert_eq!(classify(None, 5, 1.0), Verdict::Join);
        assert_eq!(classify(Some((4, 1.0)), 5, 1.0), Verdict::Apply);
        assert_eq!(classify(Some((4, 1.0)), 9, 2.0), Verdict::Gap { from: 5, to: 9 });
        assert_eq!(
            classify(Some((9, 2.0)), 7, 1.5),
            Verdict::Duplicate,
            "an older batch seen again"
        );
        assert_eq!(classify(Some((9, 2.0)), 9, 2.0), Verdict::Duplicate);
        assert_eq!(
            classify(Some((9, 2.0)), 0, 3.0),
            Verdict::Restart,
            "numbered from 0 again, and newer"
        );
    }

    #[test]
    fn sequence_numbers_are_read_with_or_without_the_topic() {
        let seq = Bytes::copy_from_slice(&7u64.to_be_bytes());
        let payload = Bytes::from_static(b"p");
        assert_eq!(
            sequenced(&[Bytes::new(), seq.clone(), payload.clone()]),
            Some((7, &b"p"[..]))
        );
        assert_eq!(sequenced(&[seq, payload.clone()]), Some((7, &b"p"[..])));
        assert_eq!(sequenced(&[Bytes::from_static(b"short"), payload]), None);
        assert_eq!(sequenced(&[]), None);
    }
}
