//! Workers, their endpoints, health, and the membership snapshot every request routes against.
//!
//! A worker is one upstream URL with `dp_size` endpoints (one per rank). Endpoints are listed worker by worker in
//! the order workers were added, ranks ascending; an endpoint's position in that list is its global rank (what a
//! client's rank override names). Each endpoint keeps one `Arc<EndpointLoad>` for its whole life, so in-flight
//! accounting survives snapshot rebuilds.
//!
//! Health is decided here and only here, in two layers (Envoy's active health checking and outlier detection):
//! - **Active**: a worker is down after `failure_threshold` failed `GET /health` probes in a row, or after one when
//!   a request just failed to connect to it or lost its connection (a probe is asked for at once then), and back
//!   after `success_threshold` good probes. It takes all its endpoints with it, and when it comes back its
//!   endpoints come back in good standing (ejections and failure records cleared: they predate its restart).
//! - **Passive, per endpoint**: `passive_failure_threshold` failures in a row (5xx answers, refused connections,
//!   broken streams, first-byte timeouts) eject an outlier (its recent failure rate above twice the median of the
//!   other routable endpoints' plus [`OUTLIER_MARGIN`]: failures every endpoint sees alike eject nobody) for `base_ejection_ms · 2^(n−1)` (at most
//!   `max_ejection_ms`), `n` counting its ejections in a row; once back it is on probation (one failure ejects it
//!   again) until `n` decays, by one per `base_ejection_ms` spent routable. An ejection that would put more than
//!   `max_ejection_percent` of all endpoints out (at least one may always be) does not happen. A request's own
//!   fault never counts: 4xx answers, client disconnects, and exchanges that broke after the request was sent
//!   without an answer (the engine may have refused that request's body), which only ask for a probe.
//! - **Panic**: when fewer than `panic_threshold_percent` of the endpoints of workers that pass their probes are
//!   routable, ejections are ignored and requests route across all of them.
//!
//! Every change rebuilds the [`Membership`] (O(endpoints)) and swaps it atomically; routing reads it without locks.
//! Time is passed in (`now`), so tests drive it.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use dprouter_core::{Endpoint, EndpointId, EndpointLoad, Snapshot, WorkerId};
use tokio::sync::Notify;

use crate::config::{Backend, HealthConfig, RankField, WorkerConfig, WorkerEvents};
use crate::upstream::WorkerInfo;

/// Where and how to send a request for one endpoint.
/// How long after its last answer a worker with requests in flight counts as serving when its `/health` is slow
/// ([`Registry::record_slow_probe`]): a hung engine with requests in flight is marked down this long (plus the
/// failed probes) after it stopped answering, instead of after its requests' first-byte timeouts.
pub const BUSY_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Target {
    pub id: EndpointId,
    /// Base URL without a trailing slash.
    pub base: String,
    pub backend: Backend,
    pub rank_field: RankField,
    /// The endpoint's passive-health state, to record a success without the registry's lock.
    pub state: Arc<EndpointState>,
    /// The models its worker serves; empty when unknown (it takes any).
    pub models: Arc<[String]>,
    /// Where its worker's ranks publish KV events, when it was given them.
    pub events: Option<Arc<WorkerEvents>>,
}

impl Target {
    /// Whether a request for `model` may go here.
    pub fn serves(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }
}

impl Target {
    /// `w{worker}r{rank}`, for logs and metric labels.
    pub fn label(&self) -> String {
        self.id.to_string()
    }
}

/// One consistent view: the snapshot policies route on, and the target of each of its endpoints.
#[derive(Debug, Default)]
pub struct Membership {
    pub snapshot: Snapshot,
    pub targets: Vec<Target>,
    /// Too few endpoints were routable: ejections are ignored in this snapshot.
    pub panic: bool,
    /// Every model some worker serves, sorted, once each (computed once per membership, not per request).
    models: Vec<String>,
    /// The one model every worker serves, when their models are known and there is one.
    sole_model: Option<String>,
}

impl Membership {
    fn new(snapshot: Snapshot, targets: Vec<Target>, panic: bool) -> Self {
        let mut models: Vec<String> = targets.iter().flat_map(|t| t.models.iter().cloned()).collect();
        models.sort();
        models.dedup();
        let sole_model = match models.as_slice() {
            [one] if targets.iter().all(|t| t.models.len() == 1) => Some(one.clone()),
            _ => None,
        };
        Self {
            snapshot,
            targets,
            panic,
            models,
            sole_model,
        }
    }

    /// The one model every worker serves, when the workers' models are known and there is one: the model of a
    /// request that names none (SGLang's `/generate`).
    pub fn sole_model(&self) -> Option<&str> {
        self.sole_model.as_deref()
    }

    /// Every model some worker serves, sorted, once each.
    pub fn models(&self) -> &[String] {
        &self.models
    }
}

/// One endpoint's outlier-detection state.
#[derive(Debug, Default, Clone, Copy)]
struct Outlier {
    /// Failures in a row.
    consecutive: u32,
    /// Ejections in a row: the back-off exponent, decaying while the endpoint stays routable.
    ejections: u32,
    ejected_until: Option<Instant>,
    /// When `ejections` last changed.
    since: Option<Instant>,
    /// Recent share of failed requests: an exponentially weighted average over about the last
    /// `1 / FAILURE_RATE_WEIGHT` requests.
    failure_rate: f64,
}

/// The weight of one request in an endpoint's recent failure rate (about the last 50 requests count).
const FAILURE_RATE_WEIGHT: f64 = 0.02;

/// A recent failure rate below this is no failure at all: the endpoint is clean again, and its successes are
/// recorded with one atomic read (about 350 successes after a single failure).
const CLEAN_RATE: f64 = 1e-3;

/// An endpoint is an outlier, and may be ejected, only while its recent failure rate is above twice the median of
/// the other routable endpoints' plus this margin: failures that most endpoints see alike (a bad request mix, an
/// upstream dependency, faults spread evenly) are not an endpoint's, and ejecting would only cut capacity.
const OUTLIER_MARGIN: f64 = 0.05;

impl Outlier {
    fn observe(&mut self, failed: bool) {
        self.failure_rate += FAILURE_RATE_WEIGHT * (f64::from(u8::from(failed)) - self.failure_rate);
    }
}

#[derive(Debug)]
pub struct EndpointState {
    pub id: EndpointId,
    pub load: Arc<EndpointLoad>,
    outlier: Mutex<Outlier>,
    /// No failure in its recent record: a success changes nothing and takes no lock.
    clean: AtomicBool,
    /// When it last answered a request successfully ([`crate::clock::now_us`]; 0: never).
    last_answer_us: AtomicU64,
}

impl EndpointState {
    fn new(id: EndpointId) -> Self {
        Self {
            id,
            load: Arc::new(EndpointLoad::default()),
            outlier: Mutex::new(Outlier::default()),
            clean: AtomicBool::new(true),
            last_answer_us: AtomicU64::new(0),
        }
    }

    /// Back in good standing: no ejection, no failures on record.
    fn readmit(&self) {
        *self.outlier() = Outlier::default();
        self.clean.store(true, Relaxed);
    }

    /// A successful answer: the endpoint's run of failures ends and its recent failure rate decays.
    pub fn record_success(&self) {
        self.last_answer_us.store(crate::clock::now_us().max(1), Relaxed);
        if self.clean.load(Relaxed) {
            return;
        }
        let mut o = self.outlier();
        o.consecutive = 0;
        o.observe(false);
        if o.failure_rate < CLEAN_RATE {
            o.failure_rate = 0.0;
            self.clean.store(true, Relaxed);
        }
    }

    fn outlier(&self) -> MutexGuard<'_, Outlier> {
        self.outlier.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ejected by outlier detection (until the next sweep past its deadline).
    pub fn ejected(&self) -> bool {
        self.outlier().ejected_until.is_some()
    }

    /// Its ejections in a row (0: in good standing).
    pub fn ejections(&self) -> u32 {
        self.outlier().ejections
    }
}

#[derive(Debug)]
pub struct WorkerState {
    pub id: WorkerId,
    pub url: String,
    pub backend: Backend,
    pub rank_field: RankField,
    /// KV cache tokens per rank, when the engine reported it.
    pub kv_capacity: Option<u64>,
    /// The models it serves; empty when unknown.
    pub models: Arc<[String]>,
    /// Where its ranks publish KV events, when it was given them.
    pub events: Option<Arc<WorkerEvents>>,
    pub endpoints: Vec<Arc<EndpointState>>,
    active_healthy: AtomicBool,
    /// A request failed to reach it since its last probe: one failed probe confirms it is down.
    suspect: AtomicBool,
    probe_failures: AtomicU32,
    probe_successes: AtomicU32,
}

impl WorkerState {
    pub fn active_healthy(&self) -> bool {
        self.active_healthy.load(Relaxed)
    }

    pub fn endpoint_healthy(&self, e: &EndpointState) -> bool {
        self.active_healthy() && !e.ejected()
    }
}

/// What went wrong talking to an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The connection could not be made. Counts against the endpoint and asks for a probe of its worker.
    Connect,
    /// The engine answered 5xx, broke a stream mid-way, or sent nothing before the first-byte timeout.
    Engine,
    /// The exchange broke after the request was sent and before any answer (a reset, a closed connection): the
    /// engine may have refused this request (a body too large for it) or died. Does not count; asks for a probe.
    Ambiguous,
}

impl Failure {
    /// How an engine's failure to answer a request routed by `branch` (5xx, nothing in time, a broken stream)
    /// counts: against the endpoint ([`Failure::Engine`]), unless the client pinned the rank
    /// ([`dprouter_core::Branch::Override`]), when it may be the request's own fault (a body that makes the engine fail, sent to
    /// one rank again and again) and only asks for a probe ([`Failure::Ambiguous`]).
    pub fn engine(branch: dprouter_core::Branch) -> Self {
        match branch {
            dprouter_core::Branch::Override => Failure::Ambiguous,
            _ => Failure::Engine,
        }
    }
}

pub struct Registry {
    workers: Mutex<Vec<Arc<WorkerState>>>,
    next_worker: AtomicU32,
    membership: ArcSwap<Membership>,
    health: HealthConfig,
    /// Woken when a worker should be probed now (see [`Failure`]).
    probe_now: Notify,
}

impl Registry {
    pub fn new(health: HealthConfig) -> Self {
        Self {
            workers: Mutex::new(Vec::new()),
            next_worker: AtomicU32::new(0),
            membership: ArcSwap::from_pointee(Membership::default()),
            health,
            probe_now: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Arc<WorkerState>>> {
        self.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current membership.
    pub fn membership(&self) -> Arc<Membership> {
        self.membership.load_full()
    }

    pub fn workers(&self) -> Vec<Arc<WorkerState>> {
        self.lock().clone()
    }

    /// The workers of one backend.
    pub fn workers_of(&self, backend: Backend) -> Vec<Arc<WorkerState>> {
        self.lock().iter().filter(|w| w.backend == backend).cloned().collect()
    }

    /// Completes when a request failure asks for a probe round now.
    pub async fn probe_requested(&self) {
        self.probe_now.notified().await;
    }

    /// Adds a discovered worker (healthy until proven otherwise) and returns its id.
    pub fn add_worker(&self, config: &WorkerConfig, info: WorkerInfo) -> WorkerId {
        let id = WorkerId(self.next_worker.fetch_add(1, Relaxed));
        let worker = Arc::new(WorkerState {
            id,
            url: config.url.trim_end_matches('/').to_string(),
            backend: config.backend,
            rank_field: config.rank_field,
            kv_capacity: config.kv_capacity_tokens.or(info.kv_capacity),
            models: info.models.into(),
            events: config.events().map(Arc::new),
            endpoints: (0..info.dp_size)
                .map(|rank| {
                    Arc::new(EndpointState::new(EndpointId {
                        worker: id,
                        dp_rank: rank,
                    }))
                })
                .collect(),
            active_healthy: AtomicBool::new(true),
            suspect: AtomicBool::new(false),
            probe_failures: AtomicU32::new(0),
            probe_successes: AtomicU32::new(0),
        });
        let mut workers = self.lock();
        workers.push(worker);
        self.rebuild(&workers);
        id
    }

    /// Removes a worker; requests already sent to it finish. Returns whether it existed.
    pub fn remove_worker(&self, id: WorkerId) -> bool {
        let mut workers = self.lock();
        let before = workers.len();
        workers.retain(|w| w.id != id);
        let removed = workers.len() != before;
        if removed {
            self.rebuild(&workers);
        }
        removed
    }

    /// Records one active probe of `worker`.
    pub fn record_probe(&self, worker: WorkerId, ok: bool) {
        let workers = self.lock();
        let Some(w) = workers.iter().find(|w| w.id == worker) else {
            return;
        };
        let suspect = w.suspect.swap(false, Relaxed);
        let changed = if ok {
            w.probe_failures.store(0, Relaxed);
            let streak = w.probe_successes.fetch_add(1, Relaxed) + 1;
            if streak >= self.health.success_threshold && !w.active_healthy() {
                w.active_healthy.store(true, Relaxed);
                // The worker was down and is back (a restart, most often): what its endpoints failed before says
                // nothing about them now, so their ejections end with it (as Envoy's
                // `successful_active_health_check_uneject_host`; a worker that stays up keeps them).
                for e in &w.endpoints {
                    e.readmit();
                }
                tracing::info!(worker = %w.url, "worker healthy");
                true
            } else {
                false
            }
        } else {
            w.probe_successes.store(0, Relaxed);
            let streak = w.probe_failures.fetch_add(1, Relaxed) + 1;
            if (streak >= self.health.failure_threshold || suspect) && w.active_healthy() {
                w.active_healthy.store(false, Relaxed);
                tracing::warn!(worker = %w.url, "worker failed {streak} health checks: marked down");
                true
            } else {
                false
            }
        };
        if changed {
            self.rebuild(&workers);
        }
    }

    /// A health probe of `worker` that got no answer within its timeout, at `now_us` ([`crate::clock::now_us`]):
    /// when the worker is serving, its `/health` is merely slow (a burst keeps it busy, or its API server is
    /// starved of CPU), so the probe counts neither way and `true` is returned; otherwise it is a failed probe.
    /// Serving means one of its endpoints answered a request within the last probe interval, or, while it has
    /// requests in flight (answers to a burst of long prompts can be seconds apart), within [`BUSY_GRACE`].
    pub fn record_slow_probe(&self, worker: WorkerId, now_us: u64) -> bool {
        let idle_window_us = self.health.interval_ms.saturating_mul(1000);
        let busy_window_us = (BUSY_GRACE.as_micros() as u64).max(idle_window_us);
        let serving = self.lock().iter().find(|w| w.id == worker).is_some_and(|w| {
            let busy = w.endpoints.iter().any(|e| e.load.in_flight_requests() > 0);
            let window_us = if busy { busy_window_us } else { idle_window_us };
            w.endpoints.iter().any(|e| {
                let at = e.last_answer_us.load(Relaxed);
                at > 0 && now_us.saturating_sub(at) <= window_us
            })
        });
        if !serving {
            self.record_probe(worker, false);
        }
        serving
    }

    /// Records a failed request to `endpoint` at `now` (passive health).
    pub fn record_failure(&self, endpoint: EndpointId, failure: Failure, now: Instant) {
        let workers = self.lock();
        let Some(w) = workers.iter().find(|w| w.id == endpoint.worker) else {
            return;
        };
        if matches!(failure, Failure::Connect | Failure::Ambiguous) {
            w.suspect.store(true, Relaxed);
            w.probe_successes.store(0, Relaxed);
            self.probe_now.notify_one();
        }
        if failure == Failure::Ambiguous {
            return;
        }
        let Some(e) = w.endpoints.iter().find(|e| e.id == endpoint) else {
            return;
        };
        let (mut total, mut ejected, mut others) = (0usize, 0usize, Vec::new());
        for other in workers.iter().flat_map(|w| &w.endpoints) {
            let o = other.outlier();
            total += 1;
            ejected += usize::from(o.ejected_until.is_some());
            if other.id != endpoint && o.ejected_until.is_none() {
                others.push(o.failure_rate);
            }
        }
        let allowed = (total * self.health.max_ejection_percent as usize / 100).max(1);
        let mut o = e.outlier();
        e.clean.store(false, Relaxed);
        o.consecutive += 1;
        o.observe(true);
        // Back from an ejection, an endpoint is on probation: its next failure ejects it again.
        let threshold = if o.ejections > 0 {
            1
        } else {
            self.health.passive_failure_threshold
        };
        if o.ejected_until.is_some() || o.consecutive < threshold {
            return;
        }
        others.sort_by(f64::total_cmp);
        let fleet_rate = others.get(others.len() / 2).copied().unwrap_or(0.0);
        if o.failure_rate <= 2.0 * fleet_rate + OUTLIER_MARGIN {
            tracing::debug!(endpoint = %endpoint, rate = o.failure_rate, fleet_rate,
                            "failures in a row, not ejected: the other endpoints fail as often");
            return;
        }
        if ejected >= allowed {
            tracing::warn!(endpoint = %endpoint, "{} failures in a row, not ejected: {ejected} of {total} endpoints are out already",
                           o.consecutive);
            return;
        }
        o.ejections += 1;
        let factor = 1u64 << (o.ejections - 1).min(20);
        let length = Duration::from_millis(
            self.health
                .base_ejection_ms
                .saturating_mul(factor)
                .min(self.health.max_ejection_ms),
        );
        o.ejected_until = Some(now + length);
        o.since = Some(now);
        o.consecutive = 0;
        tracing::warn!(endpoint = %endpoint, ejections = o.ejections, "endpoint ejected for {length:?}");
        drop(o);
        self.rebuild(&workers);
    }

    /// Records a successful answer from `endpoint` ([`EndpointState::record_success`]; the proxy calls that
    /// directly through the request's [`Target`]).
    pub fn record_success(&self, endpoint: EndpointId) {
        let found = self
            .lock()
            .iter()
            .find(|w| w.id == endpoint.worker)
            .and_then(|w| w.endpoints.iter().find(|e| e.id == endpoint).cloned());
        if let Some(e) = found {
            e.record_success();
        }
    }

    /// Re-admits endpoints whose ejection ended by `now` and decays the back-off of those in good standing.
    pub fn sweep(&self, now: Instant) {
        let workers = self.lock();
        let base = Duration::from_millis(self.health.base_ejection_ms);
        let mut changed = false;
        for e in workers.iter().flat_map(|w| &w.endpoints) {
            let mut o = e.outlier();
            match (o.ejected_until, o.since) {
                (Some(until), _) if until <= now => {
                    o.ejected_until = None;
                    o.since = Some(now);
                    changed = true;
                    tracing::info!(endpoint = %e.id, "endpoint back from ejection, on probation");
                }
                (None, Some(since)) if o.ejections > 0 && now.saturating_duration_since(since) >= base => {
                    o.ejections -= 1;
                    o.since = Some(now);
                }
                _ => {}
            }
        }
        if changed {
            self.rebuild(&workers);
        }
    }

    fn rebuild(&self, workers: &[Arc<WorkerState>]) {
        let mut endpoints = Vec::new();
        let mut targets = Vec::new();
        let (mut active, mut routable) = (0usize, 0usize);
        for w in workers {
            for e in &w.endpoints {
                let healthy = w.endpoint_healthy(e);
                active += usize::from(w.active_healthy());
                routable += usize::from(healthy);
                endpoints.push(Endpoint {
                    id: e.id,
                    healthy,
                    load: Arc::clone(&e.load),
                    kv_capacity: w.kv_capacity,
                });
                targets.push(Target {
                    id: e.id,
                    base: w.url.clone(),
                    backend: w.backend,
                    rank_field: w.rank_field,
                    state: Arc::clone(e),
                    models: Arc::clone(&w.models),
                    events: w.events.clone(),
                });
            }
        }
        let panic = routable * 100 < active * self.health.panic_threshold_percent as usize;
        if panic {
            // Ejections are guesses; probes are not: route across every endpoint of a worker that answers them.
            let mut i = 0;
            for w in workers {
                for _ in &w.endpoints {
                    endpoints[i].healthy = w.active_healthy();
                    i += 1;
                }
            }
        }
        if panic != self.membership.load().panic {
            if panic {
                tracing::warn!("panic mode: {routable} of {active} endpoints routable, ejections ignored");
            } else {
                tracing::info!("panic mode over: {routable} of {active} endpoints routable");
            }
        }
        self.membership
            .store(Arc::new(Membership::new(Snapshot::new(endpoints), targets, panic)));
    }
}

#[cfg(test)]
#[path = "registry_tests.rs"]
mod tests;
