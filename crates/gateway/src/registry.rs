//! Workers, their endpoints, health, and the membership snapshot every request routes against.
//!
//! A worker is one upstream URL with `dp_size` endpoints (one per rank). Endpoints are listed worker by worker in
//! the order workers were added, ranks ascending; an endpoint's position in that list is its global rank (what a
//! client's rank override names). Each endpoint keeps one `Arc<EndpointLoad>` for its whole life, so in-flight
//! accounting survives snapshot rebuilds.
//!
//! Health is decided here and only here. An endpoint is routable when its worker passes active checks and the
//! endpoint itself is not passively marked down. A refused connection marks the whole worker down at once; 5xx
//! answers count against one endpoint until `passive_failure_threshold` in a row; 4xx never count. A worker comes
//! back (all its endpoints) after `success_threshold` successful probes in a row. Every change rebuilds the
//! [`Membership`] (O(endpoints)) and swaps it atomically; routing reads it without locks.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwap;
use dprouter_core::{Endpoint, EndpointId, EndpointLoad, Snapshot, WorkerId};

use crate::config::{Backend, HealthConfig, RankField, WorkerConfig};
use crate::upstream::WorkerInfo;

/// Where and how to send a request for one endpoint.
#[derive(Debug, Clone)]
pub struct Target {
    pub id: EndpointId,
    /// Base URL without a trailing slash.
    pub base: String,
    pub backend: Backend,
    pub rank_field: RankField,
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
}

#[derive(Debug)]
pub struct EndpointState {
    pub id: EndpointId,
    pub load: Arc<EndpointLoad>,
    passive_failures: AtomicU32,
    passive_down: AtomicBool,
}

impl EndpointState {
    pub fn passive_down(&self) -> bool {
        self.passive_down.load(Relaxed)
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
    pub endpoints: Vec<EndpointState>,
    active_healthy: AtomicBool,
    probe_failures: AtomicU32,
    probe_successes: AtomicU32,
}

impl WorkerState {
    pub fn active_healthy(&self) -> bool {
        self.active_healthy.load(Relaxed)
    }

    pub fn endpoint_healthy(&self, e: &EndpointState) -> bool {
        self.active_healthy() && !e.passive_down()
    }
}

/// What went wrong talking to an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The connection could not be made: the worker is down.
    Connect,
    /// A 5xx answer or a broken response.
    Server,
}

pub struct Registry {
    workers: Mutex<Vec<Arc<WorkerState>>>,
    next_worker: AtomicU32,
    membership: ArcSwap<Membership>,
    health: HealthConfig,
}

impl Registry {
    pub fn new(health: HealthConfig) -> Self {
        Self {
            workers: Mutex::new(Vec::new()),
            next_worker: AtomicU32::new(0),
            membership: ArcSwap::from_pointee(Membership::default()),
            health,
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

    /// Adds a discovered worker (healthy until proven otherwise) and returns its id.
    pub fn add_worker(&self, config: &WorkerConfig, info: WorkerInfo) -> WorkerId {
        let id = WorkerId(self.next_worker.fetch_add(1, Relaxed));
        let worker = Arc::new(WorkerState {
            id,
            url: config.url.trim_end_matches('/').to_string(),
            backend: config.backend,
            rank_field: config.rank_field,
            kv_capacity: info.kv_capacity,
            endpoints: (0..info.dp_size)
                .map(|rank| EndpointState {
                    id: EndpointId {
                        worker: id,
                        dp_rank: rank,
                    },
                    load: Arc::new(EndpointLoad::default()),
                    passive_failures: AtomicU32::new(0),
                    passive_down: AtomicBool::new(false),
                })
                .collect(),
            active_healthy: AtomicBool::new(true),
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
        let changed = if ok {
            w.probe_failures.store(0, Relaxed);
            let streak = w.probe_successes.fetch_add(1, Relaxed) + 1;
            let passive = w.endpoints.iter().any(EndpointState::passive_down);
            if streak >= self.health.success_threshold && (!w.active_healthy() || passive) {
                w.active_healthy.store(true, Relaxed);
                for e in &w.endpoints {
                    e.passive_down.store(false, Relaxed);
                    e.passive_failures.store(0, Relaxed);
                }
                tracing::info!(worker = %w.url, "worker healthy");
                true
            } else {
                false
            }
        } else {
            w.probe_successes.store(0, Relaxed);
            let streak = w.probe_failures.fetch_add(1, Relaxed) + 1;
            if streak >= self.health.failure_threshold && w.active_healthy() {
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

    /// Records a failed request to `endpoint` (passive health).
    pub fn record_failure(&self, endpoint: EndpointId, failure: Failure) {
        let workers = self.lock();
        let Some(w) = workers.iter().find(|w| w.id == endpoint.worker) else {
            return;
        };
        w.probe_successes.store(0, Relaxed);
        let changed = match failure {
            Failure::Connect => {
                let was = w.active_healthy.swap(false, Relaxed);
                if was {
                    tracing::warn!(worker = %w.url, "connection refused: worker marked down");
                }
                was
            }
            Failure::Server => {
                let Some(e) = w.endpoints.iter().find(|e| e.id == endpoint) else {
                    return;
                };
                let streak = e.passive_failures.fetch_add(1, Relaxed) + 1;
                if streak >= self.health.passive_failure_threshold && !e.passive_down.swap(true, Relaxed) {
                    tracing::warn!(endpoint = %endpoint, "{streak} server errors in a row: endpoint marked down");
                    true
                } else {
                    false
                }
            }
        };
        if changed {
            self.rebuild(&workers);
        }
    }

    /// Records a successful answer from `endpoint`: its run of server errors ends.
    pub fn record_success(&self, endpoint: EndpointId) {
        let workers = self.lock();
        if let Some(e) = workers
            .iter()
            .find(|w| w.id == endpoint.worker)
            .and_then(|w| w.endpoints.iter().find(|e| e.id == endpoint))
        {
            e.passive_failures.store(0, Relaxed);
        }
    }

    fn rebuild(&self, workers: &[Arc<WorkerState>]) {
        let mut endpoints = Vec::new();
        let mut targets = Vec::new();
        for w in workers {
            for e in &w.endpoints {
                endpoints.push(Endpoint {
                    id: e.id,
                    healthy: w.endpoint_healthy(e),
                    load: Arc::clone(&e.load),
                    kv_capacity: w.kv_capacity,
                });
                targets.push(Target {
                    id: e.id,
                    base: w.url.clone(),
                    backend: w.backend,
                    rank_field: w.rank_field,
                });
            }
        }
        self.membership.store(Arc::new(Membership {
            snapshot: Snapshot::new(endpoints),
            targets,
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(url: &str) -> WorkerConfig {
        WorkerConfig {
            url: url.into(),
            backend: Backend::Sglang,
            dp_size: None,
            rank_field: RankField::RoutedDpRank,
        }
    }

    fn info(dp_size: u32) -> WorkerInfo {
        WorkerInfo {
            dp_size,
            kv_capacity: Some(1000),
        }
    }

    fn healthy(r: &Registry) -> Vec<usize> {
        r.membership().snapshot.healthy().to_vec()
    }

    #[test]
    fn workers_expand_to_endpoints_in_order() {
        let r = Registry::new(HealthConfig::default());
        let a = r.add_worker(&worker("http://a:1/"), info(2));
        let b = r.add_worker(&worker("http://b:1"), info(3));
        let m = r.membership();
        assert_eq!(m.snapshot.len(), 5);
        assert_eq!(m.targets[1].base, "http://a:1");
        assert_eq!((m.targets[2].id.worker, m.targets[2].id.dp_rank), (b, 0));
        assert_eq!(m.snapshot.endpoints()[4].kv_capacity, Some(1000));
        assert!(r.remove_worker(a));
        assert!(!r.remove_worker(a));
        assert_eq!(r.membership().snapshot.len(), 3);
    }

    #[test]
    fn probes_and_passive_failures_change_health() {
        let r = Registry::new(HealthConfig {
            failure_threshold: 2,
            success_threshold: 2,
            passive_failure_threshold: 2,
            ..HealthConfig::default()
        });
        let w = r.add_worker(&worker("http://a:1"), info(2));
        r.record_probe(w, false);
        assert_eq!(healthy(&r), vec![0, 1], "one failed probe is not enough");
        r.record_probe(w, false);
        assert!(healthy(&r).is_empty());
        r.record_probe(w, true);
        assert!(healthy(&r).is_empty());
        r.record_probe(w, true);
        assert_eq!(healthy(&r), vec![0, 1]);

        let e1 = EndpointId { worker: w, dp_rank: 1 };
        r.record_failure(e1, Failure::Server);
        r.record_success(e1);
        r.record_failure(e1, Failure::Server);
        assert_eq!(healthy(&r), vec![0, 1], "a success ends the run");
        r.record_failure(e1, Failure::Server);
        assert_eq!(healthy(&r), vec![0]);
        r.record_failure(EndpointId { worker: w, dp_rank: 0 }, Failure::Connect);
        assert!(healthy(&r).is_empty(), "a refused connection takes the worker down");
        r.record_probe(w, true);
        r.record_probe(w, true);
        assert_eq!(healthy(&r), vec![0, 1]);
    }

    #[test]
    fn load_counters_survive_rebuilds() {
        let r = Registry::new(HealthConfig::default());
        let w = r.add_worker(&worker("http://a:1"), info(1));
        let before = Arc::clone(&r.membership().snapshot.endpoints()[0].load);
        r.record_failure(EndpointId { worker: w, dp_rank: 0 }, Failure::Connect);
        assert!(Arc::ptr_eq(&before, &r.membership().snapshot.endpoints()[0].load));
    }
}
