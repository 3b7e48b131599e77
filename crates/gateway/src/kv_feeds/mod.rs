//! Precise mode's feed: the engines' KV cache events, followed per endpoint into the policies' index.
//!
//! For every endpoint of a worker configured with `kv_events`, one task subscribes (ZMQ SUB, every topic) to the
//! rank's publisher, decodes each batch ([`dprouter_core::kv_events`]), follows its events into the router's block
//! hashes ([`EngineBlocks`]) and hands the changes to the policies that may route to the endpoint (the default one
//! and each of its worker's models'), which `cache_aware` applies ([`dprouter_core::policy::Policy::engine_cache`]).
//!
//! Sequence numbers are checked ([`kv_feed::classify`]): a batch after a gap is preceded by a replay of the missing ones
//! from the worker's replay endpoint when one is configured. Events that are lost (a gap that cannot be filled, a
//! batch that cannot be decoded: truncated, an unknown event type) or too many to follow put the endpoint back in
//! approximate mode (`Untracked`: its index entries stay, as guesses, and its decisions are no longer provisional)
//! and the feed starts following afresh; the next stored blocks make it precise again. `GET /kv_events` and
//! `dprouter_kv_event_errors_total` say so. A batch whose sequence number is not past the last one applied is a
//! duplicate (the live stream overlapping a replay) when it is not newer either, and otherwise an engine that
//! restarted, with an empty cache (`Cleared`). On subscribing, the feed
//! replays whatever the engine still holds from sequence 0, so a gateway that starts after the engine learns its
//! cache as far as the engine's replay buffer reaches. One that never publishes leaves its endpoint in
//! approximate mode. Nothing here blocks routing: the policies' lock is taken once per change.
//!
//! Two shapes ([`Shape`]): the feed connects to a publisher that binds (`kv_events`; SGLang, the mock engine, vLLM
//! with `tcp://*:PORT`), or binds where a publisher connects (`kv_events_bind`; vLLM with `tcp://HOST:PORT`). Each
//! publisher's connection is a ZMTP connection of [`dprouter_zmtp`] in a task of its own, which reads its messages
//! within [`kv::LIMITS`] (a message over 4 MiB ends the connection and counts as an error) into a queue of at most
//! [`PEER_QUEUE`] messages, and tells the feed when it is up and when it ends: `connected` turns false as soon as
//! the publisher's connection closes, and a connecting feed connects afresh every second. A replay's answer is
//! bounded too ([`MAX_REPLAY_BYTES`]). When
//! a publisher comes back after the feed had applied batches, the feed asks the replay endpoint for the last
//! batch it applied: the same batch means the same engine (what it published meanwhile is replayed), none or
//! another means the engine restarted, and its endpoint's index is emptied then, before any request goes there.
//! Without a replay endpoint the feed cannot tell, and the endpoint is approximate until the next stored blocks.
//! A host that vanishes without closing its connection (powered off, cut from the network) is noticed by TCP
//! keepalive ([`kv::KEEPALIVE`]): about 16 s after the last byte, the connection fails and the feed is not connected.
//!
//! A worker added at run time (`POST /workers`) with `kv_events` gets its feeds within a second, and a removed one's
//! stop and leave `/kv_events`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dprouter_core::engine_blocks::CacheChange;
use dprouter_core::kv_events::{decode_batch, EventBatch};
use dprouter_core::kv_feed::{self, Verdict};
use dprouter_core::{EndpointId, PolicyConfig};
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Role;
use crate::fleet::policies::Policies;
use crate::fleet::registry::Registry;
use crate::observe::telemetry;
use dprouter_zmtp::{self as zmtp, kv};

mod peers;

pub use dprouter_core::kv_feed::MAX_ENGINE_BLOCKS;
use peers::{accept_loop, connect_loop, fetch_replay, Peer};
/// How long a replay may take.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before reconnecting to a publisher.
const RECONNECT: Duration = Duration::from_secs(1);
/// The end-of-replay sequence number.
const END: u64 = u64::MAX;
/// A replay's whole answer, at most (vLLM keeps 10,000 batches).
const MAX_REPLAY_BYTES: usize = 64 << 20;
const MAX_REPLAY_BATCHES: usize = 20_000;
/// Messages read ahead of the feed, per endpoint (so at most this many times a message's limit in memory).
const PEER_QUEUE: usize = 16;
/// Publishers connected at once to a binding feed.
const MAX_PUBLISHERS: usize = 8;
/// How long connecting and greeting may take.
const HANDSHAKE_TIMEOUT: Duration = kv::HANDSHAKE_TIMEOUT;
/// The `kind`s of `dprouter_kv_event_errors_total`.
const ERROR_KINDS: [&str; 7] = ["gap", "restart", "decode", "orphan", "overflow", "replay", "frames"];

/// How a feed meets its engine's publisher.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// The publisher binds; the feed connects to it.
    #[default]
    Connect,
    /// The feed binds; the publisher connects to it.
    Bind,
}

/// What one endpoint's feed has seen, for `GET /kv_events`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FeedStatus {
    pub endpoint: String,
    /// The publisher's address (`shape` connect), or the feed's own (`shape` bind).
    pub publisher: String,
    pub shape: Shape,
    pub replay: Option<String>,
    /// A publisher is attached, and the feed has caught up with what the engine's replay held then.
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

/// What the feeds take of the gateway: the registry, whose membership says which endpoints exist and where their
/// workers publish events (the config file's workers and those added by `POST /workers` alike), the policies to
/// hand the changes to, and where each feed's status goes.
#[derive(Clone)]
pub struct FeedParts {
    pub registry: Arc<Registry>,
    pub policies: Arc<Policies>,
    pub feeds: Feeds,
}

/// Starts the supervisor when the policy, `routing`, is `cache_aware` (the only one that uses events): it follows
/// the workers with events as they come and go.
pub fn spawn(parts: FeedParts, routing: &PolicyConfig, stop: watch::Receiver<bool>) -> Option<JoinHandle<()>> {
    let PolicyConfig::CacheAware(policy) = routing else {
        return None;
    };
    let block_tokens = policy.block_tokens;
    Some(tokio::spawn(supervise(Arc::new(parts), stop, block_tokens)))
}

/// Keeps one feed per endpoint with events, as endpoints come and go: those of the endpoints present now are
/// started (and listed) before this returns, the rest once a second.
fn supervise(
    parts: Arc<FeedParts>,
    mut stop: watch::Receiver<bool>,
    block_tokens: usize,
) -> impl std::future::Future<Output = ()> {
    let mut feeds: HashMap<EndpointId, Running> = HashMap::new();
    reconcile(&parts, &mut feeds, block_tokens);
    async move {
        let mut ticker = tokio::time::interval(RECONNECT);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.changed() => break,
            }
            reconcile(&parts, &mut feeds, block_tokens);
        }
        for running in feeds.into_values() {
            running.task.abort();
        }
    }
}

/// A feed's task, and the models its events are delivered to (its worker's, when the feed started).
struct Running {
    task: JoinHandle<()>,
    models: Arc<[String]>,
}

/// Starts a feed (listed at once, not connected) for each present endpoint with events that has none, and stops
/// those of endpoints gone. A feed whose worker's models changed (a worker found by discovery says what it serves
/// at its first probe) starts again, delivering to them.
fn reconcile(parts: &Arc<FeedParts>, feeds: &mut HashMap<EndpointId, Running>, block_tokens: usize) {
    let membership = parts.registry.membership();
    let mut present = HashSet::new();
    for target in &membership.targets {
        let Some(worker) = target.events.as_deref() else {
            continue;
        };
        let rank = target.id.dp_rank;
        let (shape, endpoints) = match (&worker.kv_events, &worker.kv_events_bind) {
            (Some(endpoints), _) => (Shape::Connect, endpoints),
            (None, Some(endpoints)) => (Shape::Bind, endpoints),
            (None, None) => continue,
        };
        let Some(publisher) = endpoints.for_rank(rank) else {
            continue;
        };
        present.insert(target.id);
        match feeds.get(&target.id) {
            Some(running) if running.models == target.models => continue,
            Some(running) => running.task.abort(),
            None => {}
        }
        let replay = worker.kv_events_replay.as_ref().and_then(|e| e.for_rank(rank));
        let feed = Feed {
            parts: Arc::clone(parts),
            endpoint: target.id,
            role: target.role,
            models: target.models.to_vec(),
            publisher,
            shape,
            replay,
            follow: kv_feed::Feed::new(block_tokens, MAX_ENGINE_BLOCKS),
        };
        feed.status(|_| {});
        let running = Running {
            task: tokio::spawn(feed.run()),
            models: Arc::clone(&target.models),
        };
        feeds.insert(target.id, running);
    }
    feeds.retain(|id, running| {
        let keep = present.contains(id);
        if !keep {
            running.task.abort();
            lock(&parts.feeds).remove(id);
        }
        keep
    });
}

struct Feed {
    parts: Arc<FeedParts>,
    endpoint: EndpointId,
    /// Its worker's role: which policies route to it.
    role: Role,
    models: Vec<String>,
    publisher: String,
    shape: Shape,
    replay: Option<String>,
    /// The batches' sequence and the engine blocks, followed.
    follow: kv_feed::Feed,
}

impl Feed {
    fn status(&self, f: impl FnOnce(&mut FeedStatus)) {
        let mut feeds = lock(&self.parts.feeds);
        let status = feeds.entry(self.endpoint).or_insert_with(|| FeedStatus {
            endpoint: self.endpoint.to_string(),
            publisher: self.publisher.clone(),
            shape: self.shape,
            replay: self.replay.clone(),
            ..FeedStatus::default()
        });
        f(status);
        status.engine_blocks = self.follow.engine_blocks();
        status.router_blocks = self.follow.router_blocks();
        status.last_seq = self.follow.last().map(|(seq, _)| seq);
    }

    fn count(&self, kind: &'static str) {
        self.count_n(kind, 1);
    }

    fn count_n(&self, kind: &'static str, n: u64) {
        metrics::counter!(telemetry::KV_EVENT_ERRORS, "endpoint" => self.endpoint.to_string(), "kind" => kind)
            .increment(n);
    }

    /// The engine's cache is empty (it restarted): so is the endpoint's index.
    fn clear(&mut self) {
        self.follow
            .clear(deliver(&self.parts, self.endpoint, self.role, &self.models));
    }

    /// Events were lost: the endpoint is approximate until the next stored blocks, followed afresh.
    fn untrack(&mut self) {
        self.follow
            .untrack(deliver(&self.parts, self.endpoint, self.role, &self.models));
        self.status(|s| s.precise = false);
    }

    async fn run(mut self) {
        // Every kind of trouble starts counted at 0, so its rate is defined before the first one.
        for kind in ERROR_KINDS {
            self.count_n(kind, 0);
        }
        metrics::counter!(telemetry::KV_EVENT_BATCHES, "endpoint" => self.endpoint.to_string()).increment(0);
        // The publishers' connections, each in a task of its own (stopped with this one), tell what they see here.
        let (tell, mut told) = tokio::sync::mpsc::channel(PEER_QUEUE);
        let mut peers_tasks = tokio::task::JoinSet::new();
        match self.shape {
            Shape::Connect => {
                peers_tasks.spawn(connect_loop(self.publisher.clone(), tell));
            }
            Shape::Bind => {
                peers_tasks.spawn(accept_loop(self.endpoint, self.publisher.clone(), tell));
            }
        }
        let mut peers = 0usize;
        while let Some(event) = told.recv().await {
            match event {
                Peer::Up => {
                    peers += 1;
                    if peers == 1 {
                        tracing::info!(endpoint = %self.endpoint, publisher = %self.publisher, shape = ?self.shape, "KV events: subscribed");
                        self.attached().await;
                    }
                }
                Peer::Message(frames) => {
                    let Some((seq, payload)) = kv::sequenced(&frames) else {
                        self.count("frames");
                        continue;
                    };
                    self.receive(seq, payload).await;
                }
                Peer::Down(reason) => {
                    peers = peers.saturating_sub(1);
                    if let Some(too_large) = reason.filter(|r| r.is_too_large()) {
                        tracing::warn!(endpoint = %self.endpoint, publisher = %self.publisher, error = %too_large, "KV events: the publisher sent more than a message may hold: disconnected");
                        self.count("frames");
                        self.status(|s| s.decode_errors += 1);
                    }
                    if peers == 0 {
                        self.status(|s| s.connected = false);
                        tracing::warn!(endpoint = %self.endpoint, publisher = %self.publisher, "KV events: the publisher went away");
                    }
                }
            }
        }
    }

    /// A publisher is attached: catch up with what the engine published before (or while) the feed was away, as
    /// far as its replay reaches, and tell a restarted engine from the same one; then the feed is connected.
    async fn attached(&mut self) {
        match self.follow.last() {
            None => {
                self.replay_range(0, u64::MAX).await;
            }
            Some((last, ts)) => self.rejoin(last, ts).await,
        }
        self.status(|s| s.connected = true);
    }

    /// Back after batch `last` (of time `ts`): the engine's replay from `last` says whether it is the same engine
    /// (it still has that batch) or a restarted one (it has no such batch, or another one by that number).
    async fn rejoin(&mut self, last: u64, ts: f64) {
        let batches = match self.fetch(last).await {
            Some(batches) => batches,
            None => {
                // No replay, or a failed one: what was published meanwhile, or whether the engine restarted, is
                // unknown.
                self.untrack();
                return;
            }
        };
        let same = batches
            .first()
            .filter(|(seq, _)| *seq == last)
            .and_then(|(_, payload)| decode_batch(payload).ok())
            .is_some_and(|batch| batch.ts == ts);
        if batches.first().is_some_and(|(seq, _)| *seq > last) {
            // The same engine, but its replay no longer reaches back to where the feed stopped.
            self.count("gap");
            self.status(|s| s.gaps += 1);
            self.untrack();
            self.apply_replayed(batches, last + 1);
        } else if same {
            self.apply_replayed(batches, last + 1);
        } else {
            tracing::warn!(endpoint = %self.endpoint, last, "KV events: the engine does not have the last batch applied (it restarted): index emptied");
            self.restarted(0).await;
            self.replay_range(0, u64::MAX).await;
        }
    }

    /// The engine restarted: its cache is empty, and so is the endpoint's index; its batches before `seq` are
    /// replayed.
    async fn restarted(&mut self, seq: u64) {
        self.count("restart");
        self.status(|s| s.restarts += 1);
        self.clear();
        self.follow.forget_sequence();
        if seq > 0 {
            self.replay_range(0, seq).await;
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
                self.follow.skip(seq);
                return;
            }
        };
        match self.follow.verdict(seq, batch.ts) {
            Verdict::Apply => {}
            Verdict::Duplicate => return,
            Verdict::Restart => {
                tracing::warn!(endpoint = %self.endpoint, seq, "KV events: the sequence went back (engine restart): index emptied");
                self.restarted(seq).await;
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
        let applied = self
            .follow
            .apply(seq, batch, deliver(&self.parts, self.endpoint, self.role, &self.models));
        if applied.precise {
            self.status(|s| s.precise = true);
        }
        if applied.overflow {
            tracing::warn!(endpoint = %self.endpoint, max = MAX_ENGINE_BLOCKS, "KV events: too many engine blocks to follow: approximate mode");
            self.count("overflow");
            self.status(|s| s.precise = false);
        }
        if applied.orphans > 0 {
            self.count_n("orphan", applied.orphans);
        }
        metrics::counter!(telemetry::KV_EVENT_BATCHES, "endpoint" => self.endpoint.to_string()).increment(1);
        self.status(|s| {
            s.batches += 1;
            s.orphans += applied.orphans;
            s.overflows += u64::from(applied.overflow);
        });
    }

    /// Replays batches `from..to` from the replay endpoint and applies them in order; `true` if all of them came
    /// (`to = u64::MAX`: whatever there is).
    async fn replay_range(&mut self, from: u64, to: u64) -> bool {
        let Some(batches) = self.fetch(from).await else {
            return false;
        };
        let wanted: Vec<(u64, Bytes)> = batches.into_iter().filter(|(s, _)| (from..to).contains(s)).collect();
        let complete =
            to == u64::MAX || (wanted.len() as u64 == to - from && wanted.first().is_none_or(|(s, _)| *s == from));
        self.apply_replayed(wanted, from) && complete
    }

    /// Every batch from `from` that the replay endpoint still holds; `None` without one, or when it fails.
    async fn fetch(&mut self, from: u64) -> Option<Vec<(u64, Bytes)>> {
        let replay = self.replay.clone()?;
        match tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(&replay, from)).await {
            Ok(Ok(batches)) => Some(batches),
            Ok(Err(e)) => {
                tracing::warn!(endpoint = %self.endpoint, %replay, error = %e, "KV events: replay failed");
                self.count("replay");
                None
            }
            Err(_) => {
                tracing::warn!(endpoint = %self.endpoint, %replay, "KV events: replay timed out");
                self.count("replay");
                None
            }
        }
    }

    /// Applies replayed `batches` numbered from `from` on, in order, skipping those already applied; `false` if one
    /// could not be read (the endpoint is approximate then).
    fn apply_replayed(&mut self, batches: Vec<(u64, Bytes)>, from: u64) -> bool {
        let mut n = 0;
        for (seq, payload) in batches.into_iter().filter(|(s, _)| *s >= from) {
            n += 1;
            match decode_batch(&payload) {
                Ok(batch) if self.follow.verdict(seq, batch.ts) != Verdict::Duplicate => self.apply(seq, &batch),
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
        true
    }
}

/// Hands each change to every policy that may route to `endpoint` (of a worker with `role`): the role's default
/// one, and its models'.
fn deliver<'a>(
    parts: &'a FeedParts,
    endpoint: EndpointId,
    role: Role,
    models: &'a [String],
) -> impl FnMut(&CacheChange) + 'a {
    move |change| {
        let now = crate::common::clock::now_us();
        parts.policies.role_default(role).engine_cache(endpoint, change, now);
        for model in models {
            parts
                .policies
                .for_role(role, Some(model))
                .engine_cache(endpoint, change, now);
        }
    }
}
