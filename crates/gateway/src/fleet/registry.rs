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
//!   other routable endpoints' plus [`crate::fleet::worker_state::OUTLIER_MARGIN`]: failures every endpoint sees alike eject nobody) for `base_ejection_ms · 2^(n−1)` (at most
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

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use dprouter_core::{Endpoint, EndpointId, Snapshot, WorkerId};
use tokio::sync::Notify;

use crate::config::{Backend, HealthConfig, RankField, Role, WorkerConfig, WorkerEvents};
use crate::fleet::upstream::WorkerInfo;
use crate::fleet::worker_state::OUTLIER_MARGIN;
pub use crate::fleet::worker_state::{Admission, EndpointState, Failure, WorkerState};

/// Where and how to send a request for one endpoint.
/// How long after its last answer a worker with requests in flight counts as serving when its `/health` is slow
/// ([`Registry::record_slow_probe`]): a hung engine with requests in flight is marked down this long (plus the
/// failed probes) after it stopped answering, instead of after its requests' first-byte timeouts.
pub const BUSY_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Target {
    pub id: EndpointId,
    /// Base URL without a trailing slash (shared by the worker's endpoints and every snapshot).
    pub base: Arc<str>,
    pub backend: Backend,
    pub rank_field: RankField,
    /// Its worker's role, and a prefill SGLang worker's bootstrap port.
    pub role: Role,
    pub bootstrap_port: Option<u16>,
    /// How many ranks its worker has (a prefill rank under SGLang is the bootstrap room's residue modulo this).
    pub dp_size: u32,
    /// The endpoint's passive-health state, to record a success without the registry's lock.
    pub state: Arc<EndpointState>,
    /// The models its worker serves; empty when unknown (it takes any).
    pub models: Arc<[String]>,
    /// Where its worker's ranks publish KV events, when it was given them.
    pub events: Option<Arc<WorkerEvents>>,
    /// `Authorization` for requests to its worker (the worker's `api_key`), when it has one.
    pub auth: Option<hyper::header::HeaderValue>,
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

/// The workers, in the order they were added (so by ascending id), and an index of their URLs.
#[derive(Default)]
struct Workers {
    list: Vec<Arc<WorkerState>>,
    /// Each worker's id by its URL's canonical key ([`crate::config::worker_url_key`]).
    by_url: std::collections::HashMap<String, WorkerId>,
}

impl Workers {
    fn position(&self, id: WorkerId) -> Option<usize> {
        self.list.binary_search_by_key(&id, |w| w.id).ok()
    }

    fn get(&self, id: WorkerId) -> Option<&Arc<WorkerState>> {
        self.position(id).map(|i| &self.list[i])
    }
}

impl std::ops::Deref for Workers {
    type Target = [Arc<WorkerState>];

    fn deref(&self) -> &Self::Target {
        &self.list
    }
}

/// Workers whose health changed in one batch of probes, logged one by one when few and summed up when many (a
/// fleet of dead endpoints must not write a line each).
#[derive(Default)]
struct Changes {
    up: Vec<String>,
    down: Vec<String>,
}

impl Changes {
    /// Lines logged one by one at most.
    const ONE_BY_ONE: usize = 3;

    fn log(&self) {
        if self.up.len() <= Self::ONE_BY_ONE {
            for url in &self.up {
                tracing::info!(worker = %url, "worker healthy");
            }
        } else {
            tracing::info!(workers = self.up.len(), first = ?&self.up[..Self::ONE_BY_ONE], "workers healthy");
        }
        if self.down.len() <= Self::ONE_BY_ONE {
            for url in &self.down {
                tracing::warn!(worker = %url, "worker failed its health checks: marked down");
            }
        } else {
            tracing::warn!(workers = self.down.len(), first = ?&self.down[..Self::ONE_BY_ONE],
                           "workers failed their health checks: marked down");
        }
    }
}

pub struct Registry {
    workers: Mutex<Workers>,
    next_worker: AtomicU32,
    membership: ArcSwap<Membership>,
    health: HealthConfig,
    /// Woken when a worker should be probed now (see [`Failure`]).
    probe_now: Notify,
}

impl Registry {
    pub fn new(health: HealthConfig) -> Self {
        Self {
            workers: Mutex::new(Workers::default()),
            next_worker: AtomicU32::new(0),
            membership: ArcSwap::from_pointee(Membership::default()),
            health,
            probe_now: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Workers> {
        self.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current membership.
    pub fn membership(&self) -> Arc<Membership> {
        self.membership.load_full()
    }

    pub fn workers(&self) -> Vec<Arc<WorkerState>> {
        self.lock().list.clone()
    }

    /// The worker registered under `url`'s canonical key ([`crate::config::worker_url_key`]), if any.
    pub fn registered(&self, url: &str) -> Option<WorkerId> {
        self.lock().by_url.get(&crate::config::worker_url_key(url)).copied()
    }

    /// The workers of one backend.
    pub fn workers_of(&self, backend: Backend) -> Vec<Arc<WorkerState>> {
        self.lock()
            .list
            .iter()
            .filter(|w| w.backend == backend)
            .cloned()
            .collect()
    }

    /// Completes when a request failure asks for a probe round now.
    pub async fn probe_requested(&self) {
        self.probe_now.notified().await;
    }

    /// Adds a worker whose ranks and models were asked ([`Admission::Ready`]); its id, or that of the worker already
    /// registered under the same URL.
    pub fn add_worker(&self, config: &WorkerConfig, info: WorkerInfo) -> Result<WorkerId, WorkerId> {
        let mut added = self.add_workers(vec![(config.clone(), Admission::Ready(info))]);
        added.pop().expect("one result per worker")
    }

    /// Adds workers in one membership change (one snapshot rebuild however many): for each, its id, or that of
    /// the worker already registered under the same URL (in any spelling, or earlier in `batch`).
    pub fn add_workers(&self, batch: Vec<(WorkerConfig, Admission)>) -> Vec<Result<WorkerId, WorkerId>> {
        let mut workers = self.lock();
        let mut results = Vec::with_capacity(batch.len());
        let mut unprobed = false;
        for (config, admission) in batch {
            let key = crate::config::worker_url_key(&config.url);
            if let Some(&existing) = workers.by_url.get(&key) {
                results.push(Err(existing));
                continue;
            }
            let id = WorkerId(self.next_worker.fetch_add(1, Relaxed));
            unprobed |= matches!(admission, Admission::Unprobed);
            workers.by_url.insert(key, id);
            workers.list.push(Arc::new(WorkerState::new(id, &config, admission)));
            results.push(Ok(id));
        }
        if results.iter().any(Result::is_ok) {
            self.rebuild(&workers);
        }
        if unprobed {
            // Probed now rather than at their turn in the round.
            self.probe_now.notify_one();
        }
        results
    }

    /// Removes a worker; requests already sent to it finish. Returns whether it existed.
    pub fn remove_worker(&self, id: WorkerId) -> bool {
        self.remove_workers(&[id]) == 1
    }

    /// Removes workers in one membership change; requests already sent to them finish. Returns how many existed.
    pub fn remove_workers(&self, ids: &[WorkerId]) -> usize {
        let gone: std::collections::HashSet<WorkerId> = ids.iter().copied().collect();
        let mut workers = self.lock();
        let before = workers.list.len();
        workers.list.retain(|w| !gone.contains(&w.id));
        let removed = before - workers.list.len();
        if removed > 0 {
            workers.by_url.retain(|_, id| !gone.contains(id));
            self.rebuild(&workers);
        }
        removed
    }

    /// A worker found by discovery passed its first probe and answered what it serves: routable from now on, with
    /// its models and capacity. Returns whether it was waiting for that.
    pub fn admit(&self, id: WorkerId, info: WorkerInfo) -> bool {
        self.admit_all(vec![(id, info)]) == 1
    }

    /// [`Registry::admit`] for many workers in one membership change; how many were waiting.
    pub fn admit_all(&self, admitted: Vec<(WorkerId, WorkerInfo)>) -> usize {
        let mut workers = self.lock();
        let mut count = 0;
        for (id, info) in admitted {
            let Some(i) = workers.position(id) else {
                continue;
            };
            let old = &workers.list[i];
            let Some(config) = old.unprobed.clone() else {
                continue;
            };
            let mut ready = WorkerState::new(id, &config, Admission::Ready(info));
            // The same endpoints (their load and outlier state live on), as many as the worker was given.
            ready.endpoints.clone_from(&old.endpoints);
            tracing::debug!(worker = %ready.url, "worker found by discovery passed its first probe: routable");
            workers.list[i] = Arc::new(ready);
            count += 1;
        }
        if count > 0 {
            self.rebuild(&workers);
        }
        count
    }

    /// Records one active probe of `worker`.
    pub fn record_probe(&self, worker: WorkerId, ok: bool) {
        self.record_probes(&[(worker, ok)]);
    }

    /// Records active probes (one snapshot rebuild for the batch, if any worker's health changed). A worker not
    /// probed before ([`Admission::Unprobed`]) becomes routable only through [`Registry::admit`].
    pub fn record_probes(&self, probes: &[(WorkerId, bool)]) {
        let workers = self.lock();
        let mut changes = Changes::default();
        for &(worker, ok) in probes {
            let Some(w) = workers.get(worker) else {
                continue;
            };
            let suspect = w.suspect.swap(false, Relaxed);
            if ok {
                w.probe_failures.store(0, Relaxed);
                let streak = w.probe_successes.fetch_add(1, Relaxed) + 1;
                if streak >= self.health.success_threshold && !w.active_healthy() && w.unprobed.is_none() {
                    w.active_healthy.store(true, Relaxed);
                    // The worker was down and is back (a restart, most often): what its endpoints failed before says
                    // nothing about them now, so their ejections end with it (as Envoy's
                    // `successful_active_health_check_uneject_host`; a worker that stays up keeps them), and so do
                    // the prefill costs learned from them.
                    for e in &w.endpoints {
                        e.restarted();
                    }
                    changes.up.push(w.url.to_string());
                }
            } else {
                w.probe_successes.store(0, Relaxed);
                let streak = w.probe_failures.fetch_add(1, Relaxed) + 1;
                if (streak >= self.health.failure_threshold || suspect) && w.active_healthy() {
                    w.active_healthy.store(false, Relaxed);
                    changes.down.push(w.url.to_string());
                }
            }
        }
        if !changes.up.is_empty() || !changes.down.is_empty() {
            self.rebuild(&workers);
            drop(workers);
            changes.log();
        }
    }

    /// Workers a request failure made suspect (a probe is due now), and workers not probed yet.
    pub fn due_now(&self) -> Vec<Arc<WorkerState>> {
        let workers = self.lock();
        workers
            .iter()
            .filter(|w| w.suspect.load(Relaxed) || w.unprobed.is_some())
            .cloned()
            .collect()
    }

    /// A health probe of `worker` that got no answer within its timeout, at `now_us` ([`crate::common::clock::now_us`]):
    /// when the worker is serving, its `/health` is merely slow (a burst keeps it busy, or its API server is
    /// starved of CPU), so the probe counts neither way and `true` is returned; otherwise it is a failed probe.
    /// Serving means one of its endpoints answered a request within the last probe interval, or, while it has
    /// requests in flight (answers to a burst of long prompts can be seconds apart), within [`BUSY_GRACE`].
    pub fn record_slow_probe(&self, worker: WorkerId, now_us: u64) -> bool {
        let idle_window_us = self.health.interval_ms.saturating_mul(1000);
        let busy_window_us = (BUSY_GRACE.as_micros() as u64).max(idle_window_us);
        let serving = self.lock().get(worker).is_some_and(|w| {
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
        let Some(w) = workers.get(endpoint.worker) else {
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
            .get(endpoint.worker)
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
                    base: Arc::clone(&w.url),
                    backend: w.backend,
                    rank_field: w.rank_field,
                    role: w.role,
                    bootstrap_port: w.bootstrap_port,
                    dp_size: w.endpoints.len() as u32,
                    state: Arc::clone(e),
                    models: Arc::clone(&w.models),
                    events: w.events.clone(),
                    auth: w.auth.clone(),
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
