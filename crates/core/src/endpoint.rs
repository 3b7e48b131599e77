//! Endpoints and the immutable membership snapshot.
//!
//! An endpoint is one data-parallel rank of one worker: `(worker, dp_rank)`. A [`Snapshot`] lists every endpoint
//! the gateway knows, in a fixed order, with its health and its shared load counters. The position of an endpoint in
//! that order is its **global rank**: the number a client's rank override names and the `N` of `% dp_size` in the
//! hash-based policies. For a single SGLang worker with `--dp-size N`, global rank and `dp_rank` coincide.
//!
//! A snapshot never changes; membership or health changes build a new one (keeping each endpoint's
//! [`EndpointLoad`] so in-flight accounting survives). Building costs O(endpoints); routing reads it without locks.
//! Each snapshot built carries a process-unique [`Snapshot::generation`], so a policy that derives structures from
//! the membership (hash orders, index slots) rebuilds them when, and only when, the snapshot changes.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use crate::load::EndpointLoad;

/// Identifies one worker (one engine process or one upstream URL).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

/// One data-parallel rank of one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId {
    pub worker: WorkerId,
    pub dp_rank: u32,
}

impl EndpointId {
    pub const fn new(worker: u32, dp_rank: u32) -> Self {
        Self {
            worker: WorkerId(worker),
            dp_rank,
        }
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}r{}", self.worker.0, self.dp_rank)
    }
}

/// One routable endpoint as the snapshot sees it.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub id: EndpointId,
    pub healthy: bool,
    pub load: Arc<EndpointLoad>,
    /// The endpoint's KV cache capacity in tokens (SGLang's `max_total_num_tokens`), when known; cache-aware
    /// policies forget at this size, else at their configured default.
    pub kv_capacity: Option<u64>,
}

impl Endpoint {
    /// A healthy endpoint with fresh (zero) load counters.
    pub fn new(id: EndpointId) -> Self {
        Self {
            id,
            healthy: true,
            load: Arc::new(EndpointLoad::default()),
            kv_capacity: None,
        }
    }

    pub fn with_kv_capacity(mut self, tokens: u64) -> Self {
        self.kv_capacity = Some(tokens);
        self
    }
}

/// Source of [`Snapshot::generation`] numbers; 0 is the empty default snapshot's.
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// The endpoints a policy may route to, in global-rank order, with the healthy subset precomputed.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    endpoints: Vec<Endpoint>,
    healthy: Vec<usize>,
    generation: u64,
}

impl Snapshot {
    pub fn new(endpoints: Vec<Endpoint>) -> Self {
        let healthy = endpoints
            .iter()
            .enumerate()
            .filter(|(_, e)| e.healthy)
            .map(|(i, _)| i)
            .collect();
        Self {
            endpoints,
            healthy,
            generation: GENERATION.fetch_add(1, Relaxed),
        }
    }

    /// Unique per snapshot built in this process (clones share it): equal generations mean equal membership.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// One worker (id 0) with `dp_size` healthy ranks: what `dprouter route` and the simulator use.
    pub fn single_worker(dp_size: u32) -> Self {
        Self::new((0..dp_size).map(|r| Endpoint::new(EndpointId::new(0, r))).collect())
    }

    /// The same endpoints (sharing their load counters) with `healthy` set per global rank by `health`.
    pub fn with_health(&self, health: impl Fn(usize, &Endpoint) -> bool) -> Self {
        Self::new(
            self.endpoints
                .iter()
                .enumerate()
                .map(|(i, e)| Endpoint {
                    healthy: health(i, e),
                    ..e.clone()
                })
                .collect(),
        )
    }

    /// Number of endpoints, healthy or not (the `dp_size` of a single worker).
    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// The endpoint at a global rank.
    pub fn get(&self, rank: usize) -> Option<&Endpoint> {
        self.endpoints.get(rank)
    }

    /// Global ranks of the healthy endpoints, ascending.
    pub fn healthy(&self) -> &[usize] {
        &self.healthy
    }

    pub fn is_healthy(&self, rank: usize) -> bool {
        self.endpoints.get(rank).is_some_and(|e| e.healthy)
    }

    /// The endpoint's shared load counters.
    ///
    /// # Panics
    /// If `rank >= len()`; policies only pass ranks taken from this snapshot.
    pub fn load(&self, rank: usize) -> &EndpointLoad {
        &self.endpoints[rank].load
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthy_subset_is_precomputed_in_rank_order() {
        let snap = Snapshot::single_worker(4).with_health(|i, _| i != 1);
        assert_eq!(snap.healthy(), &[0, 2, 3]);
        assert!(!snap.is_healthy(1));
        assert!(!snap.is_healthy(9));
        assert_eq!(snap.get(2).map(|e| e.id), Some(EndpointId::new(0, 2)));
    }

    #[test]
    fn with_health_shares_load_counters() {
        let snap = Snapshot::single_worker(2);
        let next = snap.with_health(|_, _| true);
        assert!(Arc::ptr_eq(&snap.endpoints()[1].load, &next.endpoints()[1].load));
        assert_ne!(snap.generation(), next.generation());
        assert_eq!(snap.clone().generation(), snap.generation());
    }
}
