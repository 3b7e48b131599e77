//! The engine behind the mock server: DP ranks with radix caches and the simulator's cost model, in scaled real
//! time.
//!
//! A request on a rank waits for the rank's prefill server (a FIFO lock: first come first served), matches its prompt
//! against the rank's [`RadixCache`] and pins the hit, sleeps `(base + uncached / prefill_rate) · time_scale`, caches
//! the prompt and emits its first token; then emits one token per `tpot · (1 + slowdown · (running − 1)) · time_scale`
//! of decode time (which stands still while any rank prefills when the cost model's `prefill_stalls_decode` is set:
//! [`crate::stall`]), and finally caches prompt + answer and releases the pin. Each request runs in its own task and
//! sends [`Emit`] events to its HTTP response; when the response is dropped (the client went away) the task notices at
//! its next wait, undoes its accounting and counts an abort, as SGLang aborts a disconnected request.
//!
//! With `kv_events` on, each rank's cache keeps its KV events, and every change to a rank's cache hands them, in
//! order and while the cache is still locked, to that rank's event stream ([`Engine::take_event_streams`]), which
//! [`crate::kv_publisher`] publishes.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use dprouter_core::kv_events::KvEvent;
use dprouter_core::policy::RoundRobin;
use dprouter_core::{route, RouteRequest, Snapshot};
use dprouter_sim::radix::RadixCache;
use dprouter_sim::tokens::mix;
use dprouter_sim::CostModel;
use tokio::sync::mpsc;

use crate::disagg::{Disaggregation, Kv, RoomGuard, Rooms, Source};
use crate::stall::DecodeStall;
use crate::tokenizer::{output_token, output_word};

mod slot;

use slot::{wait, Slot};

/// Which server's rank-targeting rules the mock follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// SGLang: body `routed_dp_rank` (or deprecated `data_parallel_rank`), header `X-Data-Parallel-Rank` on `/v1/*`.
    Sglang,
    /// vLLM: header `X-data-parallel-rank` only; an unparsable value is ignored.
    Vllm,
}

/// Failures to inject, for testing what sits in front of the engine.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// Fraction of generation requests answered `500 Internal Server Error` at once.
    pub error_rate: f64,
    /// Fraction of generation requests answered `503 Service Unavailable` at once.
    pub unavailable_rate: f64,
    /// Streaming responses break the connection after this many tokens.
    pub drop_after_tokens: Option<u32>,
    /// Fraction of streaming responses that break the connection (no final event, no `[DONE]`) after a number of
    /// tokens drawn from 0 to `max_new_tokens`, from the seed and the request's number.
    pub drop_rate: f64,
    /// Delay before the first response byte of every generation request (added to TTFT).
    pub first_byte_delay: Duration,
    /// Ranks that failed to start: skipped by the engine's own round robin, requests pinned to them get 503.
    pub dead_ranks: Vec<u32>,
    /// `/health` answers 503.
    pub unhealthy: bool,
    /// `/health` answers after this long (a probe slower than the gateway's timeout, while requests are served).
    pub health_delay: Duration,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub dp_size: u32,
    pub cost: CostModel,
    /// Real seconds per simulated second (0.01 runs 100x faster than the preset).
    pub time_scale: f64,
    pub api: Api,
    pub model: String,
    pub faults: Faults,
    pub seed: u64,
    /// Keep each rank's KV cache events for a publisher.
    pub kv_events: bool,
    /// Tokenize text and chat prompts with a model's own tokenizer and chat template instead of the mock's.
    pub tokenizer: Option<Arc<dprouter_tokenize::ModelTokenizer>>,
    /// The longest prompt taken, tokens: a longer one is refused with 400, as SGLang refuses a prompt of the
    /// model's context length or more.
    pub context_length: u32,
    /// Prefill or decode only, as SGLang's `--disaggregation-mode` ([`crate::disagg`]); `None`: both.
    pub disaggregation: Option<Disaggregation>,
    /// The engine's `--api-key`: requests must carry `Authorization: Bearer KEY` where the engine asks for it
    /// (SGLang: every route but `/health*` and `/metrics`; vLLM: the `/v1` routes).
    pub api_key: Option<String>,
}

/// The default context length, tokens (1,048,576, a long-context model's).
pub const CONTEXT_LENGTH: u32 = 1 << 20;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            dp_size: 1,
            cost: CostModel::ZERO,
            time_scale: 1.0,
            api: Api::Sglang,
            model: "dprouter/mock".into(),
            faults: Faults::default(),
            seed: 0,
            kv_events: false,
            tokenizer: None,
            context_length: CONTEXT_LENGTH,
            disaggregation: None,
            api_key: None,
        }
    }
}

/// What a request task tells its response.
#[derive(Debug, Clone, PartialEq)]
pub enum Emit {
    /// The first token, with the prompt accounting SGLang reports.
    First {
        text: String,
        token: u32,
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Token {
        text: String,
        token: u32,
    },
    /// The answer is complete.
    Done {
        completion_tokens: u32,
    },
    /// Injected fault: break the connection now.
    Drop,
    /// The request failed: an error answer, or an error event once a stream has begun.
    Fail {
        status: u16,
        message: String,
    },
}

/// Which part of a request a rank runs.
pub enum Leg {
    /// Prefill, then decode.
    Whole,
    /// Prefill, then hold the room's KV cache until a decode server takes it; one token.
    Prefill(RoomGuard),
    /// Fetch the KV cache from a prefill server, then decode.
    Decode(Source),
    /// vLLM's prefill: prefill, answer at once, and hold the room's KV cache (past the answer) until a decode
    /// server takes it or the timeout passes.
    Hand(RoomGuard),
}

/// Per-rank load as `/get_load` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankLoad {
    pub running: u64,
    pub waiting: u64,
    pub used_tokens: u64,
    pub pending_tokens: u64,
}

struct Rank {
    cache: Mutex<RadixCache>,
    /// Where the cache's events go, with `kv_events`.
    events: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
    prefill: tokio::sync::Mutex<()>,
    waiting: AtomicU64,
    running: AtomicU64,
    pending_tokens: AtomicU64,
}

pub struct Engine {
    config: EngineConfig,
    ranks: Vec<Rank>,
    snapshot: Snapshot,
    round_robin: RoundRobin,
    requests: AtomicU64,
    aborted: AtomicU64,
    completed: AtomicU64,
    stall: DecodeStall,
    /// The ranks' event streams, until a publisher takes them.
    event_streams: Mutex<Vec<mpsc::UnboundedReceiver<Vec<KvEvent>>>>,
    /// Where each rank publishes its events and serves their replay, once a publisher has bound them.
    pub kv_endpoints: std::sync::OnceLock<Vec<(String, Option<String>)>>,
    /// A prefill server's rooms ([`crate::disagg`]).
    rooms: Arc<Rooms>,
    /// KV caches a decode server fetched from its prefill servers.
    transfers: AtomicU64,
}

/// A rank's cache, locked; its new events go to the rank's stream when the lock is released.
struct CacheGuard<'a> {
    cache: MutexGuard<'a, RadixCache>,
    events: Option<&'a mpsc::UnboundedSender<Vec<KvEvent>>>,
}

impl std::ops::Deref for CacheGuard<'_> {
    type Target = RadixCache;
    fn deref(&self) -> &RadixCache {
        &self.cache
    }
}

impl std::ops::DerefMut for CacheGuard<'_> {
    fn deref_mut(&mut self) -> &mut RadixCache {
        &mut self.cache
    }
}

impl Drop for CacheGuard<'_> {
    fn drop(&mut self) {
        if let Some(events) = self.events {
            let new = self.cache.take_events();
            if !new.is_empty() {
                // Sent before the cache's lock is released, so the stream keeps the cache's order. A publisher
                // that went away loses them.
                let _ = events.send(new);
            }
        }
    }
}

impl Rank {
    fn cache(&self) -> CacheGuard<'_> {
        CacheGuard {
            cache: lock(&self.cache),
            events: self.events.as_ref(),
        }
    }
}

/// A request the engine took: its rank, and its number, which names its fault draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    pub rank: usize,
    pub request: u64,
}

/// Why a request was refused before it started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("DP rank {0} is not active.")]
    RankNotActive(i64),
    #[error("DP rank {0} failed to start")]
    RankDead(u32),
    #[error("injected fault: internal error")]
    Internal,
    #[error("injected fault: service unavailable")]
    Unavailable,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Engine {
    pub fn new(config: EngineConfig) -> Arc<Self> {
        let mut streams = Vec::new();
        let ranks = (0..config.dp_size)
            .map(|_| Rank {
                cache: Mutex::new(if config.kv_events {
                    RadixCache::with_events(config.cost.kv_capacity, config.cost.page_size)
                } else {
                    RadixCache::new(config.cost.kv_capacity, config.cost.page_size)
                }),
                events: config.kv_events.then(|| {
                    let (tx, rx) = mpsc::unbounded_channel();
                    streams.push(rx);
                    tx
                }),
                prefill: tokio::sync::Mutex::new(()),
                waiting: AtomicU64::new(0),
                running: AtomicU64::new(0),
                pending_tokens: AtomicU64::new(0),
            })
            .collect();
        let dead = config.faults.dead_ranks.clone();
        let snapshot = Snapshot::single_worker(config.dp_size).with_health(|i, _| !dead.contains(&(i as u32)));
        Arc::new(Self {
            ranks,
            snapshot,
            round_robin: RoundRobin::default(),
            requests: AtomicU64::new(0),
            aborted: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            stall: DecodeStall::new(config.cost.prefill_stalls_decode),
            event_streams: Mutex::new(streams),
            kv_endpoints: std::sync::OnceLock::new(),
            rooms: Arc::default(),
            transfers: AtomicU64::new(0),
            config,
        })
    }

    /// KV caches this decode server fetched from prefill servers.
    pub fn transfers(&self) -> u64 {
        self.transfers.load(Relaxed)
    }

    /// A prefill server's rooms: those being prefilled and those waiting for their decode server.
    pub fn rooms(&self) -> &Arc<Rooms> {
        &self.rooms
    }

    /// Each rank's stream of KV events, in rank order (empty without `kv_events`, or once taken).
    pub fn take_event_streams(&self) -> Vec<mpsc::UnboundedReceiver<Vec<KvEvent>>> {
        std::mem::take(&mut *lock(&self.event_streams))
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Requests aborted because their client disconnected.
    pub fn aborted(&self) -> u64 {
        self.aborted.load(Relaxed)
    }

    pub fn completed(&self) -> u64 {
        self.completed.load(Relaxed)
    }

    pub fn load(&self) -> Vec<RankLoad> {
        self.ranks
            .iter()
            .map(|r| {
                let pending = r.pending_tokens.load(Relaxed);
                RankLoad {
                    running: r.running.load(Relaxed),
                    waiting: r.waiting.load(Relaxed),
                    used_tokens: r.cache().locked_size() as u64 + pending,
                    pending_tokens: pending,
                }
            })
            .collect()
    }

    /// Evicts every unpinned cached token on every rank.
    pub fn flush_cache(&self) {
        for r in &self.ranks {
            r.cache().flush();
        }
    }

    /// Picks the serving rank (the override if any, else round robin over live ranks) and applies injected faults.
    pub fn admit(&self, rank_override: Option<i64>) -> Result<Admission, Refusal> {
        let n = self.requests.fetch_add(1, Relaxed);
        let rank = match rank_override {
            Some(r) => {
                let rank = usize::try_from(r)
                    .ok()
                    .filter(|&i| i < self.ranks.len())
                    .ok_or(Refusal::RankNotActive(r))?;
                if self.config.faults.dead_ranks.contains(&(rank as u32)) {
                    return Err(Refusal::RankDead(rank as u32));
                }
                rank
            }
            None => {
                let req = RouteRequest::tokens(Vec::new());
                route(&self.round_robin, &self.snapshot, &req)
                    .map_err(|_| Refusal::Unavailable)?
                    .rank
            }
        };
        let draw = (mix(self.config.seed ^ mix(n)) >> 11) as f64 / (1u64 << 53) as f64;
        let faults = &self.config.faults;
        if draw < faults.error_rate {
            return Err(Refusal::Internal);
        }
        if draw < faults.error_rate + faults.unavailable_rate {
            return Err(Refusal::Unavailable);
        }
        Ok(Admission { rank, request: n })
    }

    /// How many tokens a streamed request sends before its connection breaks, if it does: `drop_after_tokens` (at
    /// least one, when fewer than the answer's), else for a `drop_rate` fraction of requests a number from 0 to
    /// `max_new_tokens` (all of them: the final event and `[DONE]` are what is missing), drawn independently of
    /// the error draws from the seed and the request's number.
    fn break_point(&self, request: u64, max_new_tokens: u32) -> Option<u64> {
        let max = u64::from(max_new_tokens);
        let faults = &self.config.faults;
        if let Some(k) = faults.drop_after_tokens {
            return Some(u64::from(k).max(1)).filter(|&k| k < max);
        }
        let h = mix(mix(self.config.seed ^ mix(request)) ^ 0x6472_6f70); // "drop"
        let draw = (h >> 11) as f64 / (1u64 << 53) as f64;
        (draw < faults.drop_rate).then(|| mix(h) % (max + 1))
    }

    fn scaled(&self, seconds_micros: u64) -> Duration {
        Duration::from_secs_f64(seconds_micros as f64 / 1e6 * self.config.time_scale.max(0.0))
    }

    /// Runs one admitted request (its `leg` of it) to completion or until `tx`'s receiver is dropped. `seed` names
    /// the answer.
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        self: Arc<Self>,
        admission: Admission,
        tokens: Vec<u32>,
        max_new_tokens: u32,
        seed: u64,
        streaming: bool,
        leg: Leg,
        tx: mpsc::Sender<Emit>,
    ) {
        let rank = admission.rank;
        let break_after = if streaming {
            self.break_point(admission.request, max_new_tokens)
        } else {
            None
        };
        let mut slot = Slot::new(Arc::clone(&self), rank, tokens.len() as u64);
        let r = &self.ranks[rank];
        let delay = self.config.faults.first_byte_delay;
        if !delay.is_zero() && !wait(tokio::time::sleep(delay), &tx).await {
            return;
        }
        // How long a room's KV cache waits for its decode server, and a decode server for it.
        let timeout = self.config.disaggregation.as_ref().map_or(Duration::MAX, |d| d.timeout);
        let cached = match &leg {
            Leg::Decode(source) => {
                let fetched = tokio::select! {
                    fetched = crate::disagg::fetch_kv(source, timeout) => fetched,
                    _ = tx.closed() => return,
                };
                let kv = match fetched {
                    Ok(kv) => kv,
                    Err(message) => {
                        let _ = tx.send(Emit::Fail { status: 500, message }).await;
                        return;
                    }
                };
                self.transfers.fetch_add(1, Relaxed);
                let transfer = self.scaled(self.config.cost.transfer(kv.prompt_tokens));
                if !transfer.is_zero() && !wait(tokio::time::sleep(transfer), &tx).await {
                    return;
                }
                let mut cache = r.cache();
                cache.insert(&tokens);
                slot.pin = Some(cache.lock(&tokens, tokens.len()));
                drop(cache);
                slot.start_decoding();
                kv.cached_tokens
            }
            _ => match self.prefill(&mut slot, &tokens, &tx).await {
                Some(cached) => cached,
                None => return,
            },
        };
        let kv = Kv {
            rank: rank as u32,
            prompt_tokens: tokens.len(),
            cached_tokens: cached,
        };
        if let Leg::Prefill(room) = &leg {
            let fetched = room.ready(kv);
            let taken = tokio::select! {
                taken = tokio::time::timeout(timeout, fetched) => taken,
                _ = tx.closed() => return,
            };
            if !matches!(taken, Ok(Ok(()))) {
                let message = format!(
                    "KV transfer failed: no decode server took bootstrap_room {} within {} s",
                    room.room,
                    timeout.as_secs_f64()
                );
                let _ = tx.send(Emit::Fail { status: 500, message }).await;
                return;
            }
            let transfer = self.scaled(self.config.cost.transfer(tokens.len()));
            if !transfer.is_zero() && !wait(tokio::time::sleep(transfer), &tx).await {
                return;
            }
        }
        if let Leg::Hand(room) = leg {
            let fetched = room.ready(kv);
            tokio::spawn(async move {
                let _ = tokio::time::timeout(timeout, fetched).await;
                drop(room);
            });
        }
        if break_after == Some(0) {
            let _ = tx.send(Emit::Drop).await;
            return;
        }

        let first = Emit::First {
            text: output_word(seed, 0),
            token: output_token(seed, 0),
            prompt_tokens: tokens.len(),
            cached_tokens: cached,
        };
        if tx.send(first).await.is_err() {
            return;
        }
        let started = self.stall.now();
        let per_token = self.scaled(self.config.cost.decode(2, r.running.load(Relaxed) as usize));
        for i in 1..u64::from(max_new_tokens) {
            if break_after == Some(i) {
                let _ = tx.send(Emit::Drop).await;
                return;
            }
            // Decode time, which stands still while any rank prefills when prefill stalls decode.
            if !wait(self.stall.until(started + per_token.mul_f64(i as f64)), &tx).await {
                return;
            }
            if tx
                .send(Emit::Token {
                    text: output_word(seed, i),
                    token: output_token(seed, i),
                })
                .await
                .is_err()
            {
                return;
            }
        }
        if break_after == Some(u64::from(max_new_tokens)) {
            let _ = tx.send(Emit::Drop).await;
            return;
        }
        let mut answer = tokens;
        answer.extend((0..u64::from(max_new_tokens)).map(|i| output_token(seed, i)));
        {
            let mut cache = r.cache();
            cache.insert(&answer);
            if let Some(pin) = slot.pin.take() {
                cache.unlock(pin);
            }
        }
        slot.finish();
        let _ = tx
            .send(Emit::Done {
                completion_tokens: max_new_tokens,
            })
            .await;
    }
}
