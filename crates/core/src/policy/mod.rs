//! The routing policy trait and the one entry point every front end calls.
//!
//! [`route`] applies a client's rank override first (for every policy: it wins, is range- and health-checked, never
//! advances a policy's counters and is never counted speculatively), then asks the policy. [`dispatch`] also takes
//! the request's share of the endpoint's load in a [`LoadGuard`]. Policies never see down endpoints as candidates:
//! they choose among [`Snapshot::healthy`].
//!
//! Feedback hooks (default no-ops): `route` calls [`Policy::routed`] after every decision, overrides included, so
//! a cache-aware policy records where each prompt went; the front end calls [`Policy::observe`] when the engine
//! reports how much of a routed prompt it had cached (SGLang's `cached_tokens`).

use std::sync::Arc;

use crate::endpoint::{EndpointId, Snapshot};
use crate::error::RouteError;
use crate::load::LoadGuard;
use crate::request::RouteRequest;

pub mod cache_aware;
pub mod follow_bootstrap_room;
pub mod prefix_affinity;
pub mod prefix_match;
pub mod round_robin;
pub mod total_requests;
pub mod total_tokens;

pub use cache_aware::{CacheAware, CacheAwareConfig, IndexStats};
pub use follow_bootstrap_room::FollowBootstrapRoom;
pub use prefix_affinity::{AffinityLoad, PrefixAffinity, PrefixAffinityConfig};
pub use prefix_match::PrefixMatch;
pub use round_robin::RoundRobin;
pub use total_requests::TotalRequests;
pub use total_tokens::TotalTokens;

/// Why a policy chose an endpoint; a metrics label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Branch {
    /// The client named the rank.
    Override,
    /// Round-robin turn.
    Turn,
    /// Least loaded by the policy's measure.
    LeastLoaded,
    /// The request's key (bootstrap room or prefix hash) named this endpoint.
    Hashed,
    /// The key named a down endpoint; the next healthy one in rank order took it.
    Fallback,
    /// Nothing to key on (empty prompt); round-robin turn.
    Empty,
    /// The key's first choice (rendezvous order) took it.
    Affine,
    /// The preferred endpoint was over its load bound, or a less cached endpoint promised an earlier first token.
    Spill,
    /// The endpoint holding the longest cached prefix took it.
    Hit,
    /// No endpoint holds any of the prompt: placed by rendezvous hashing among the least loaded.
    Cold,
}

impl Branch {
    pub fn as_str(self) -> &'static str {
        match self {
            Branch::Override => "override",
            Branch::Turn => "turn",
            Branch::LeastLoaded => "least_loaded",
            Branch::Hashed => "hashed",
            Branch::Fallback => "fallback",
            Branch::Empty => "empty",
            Branch::Affine => "affine",
            Branch::Spill => "spill",
            Branch::Hit => "hit",
            Branch::Cold => "cold",
        }
    }
}

/// A routing decision: the endpoint's global rank in the snapshot, why, and (from cache-aware policies) how many
/// prompt tokens the endpoint is predicted to have to prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    pub rank: usize,
    pub branch: Branch,
    /// Predicted uncached prompt tokens; `None` means the whole prompt. [`dispatch`] counts it as queued prefill.
    pub prefill_tokens: Option<u64>,
}

impl Pick {
    pub fn new(rank: usize, branch: Branch) -> Self {
        Self {
            rank,
            branch,
            prefill_tokens: None,
        }
    }

    pub fn with_prefill(mut self, tokens: u64) -> Self {
        self.prefill_tokens = Some(tokens);
        self
    }
}

/// A load-balancing method.
///
/// `choose` is called only for requests without a rank override, with a snapshot that has at least one healthy
/// endpoint, and must return a healthy endpoint's rank. Implementations use interior mutability (atomics, short
/// locks) and are shared across threads.
pub trait Policy: Send + Sync {
    /// The config name (`round_robin`, `prefix_match`, …).
    fn name(&self) -> &'static str;

    fn choose(&self, snap: &Snapshot, req: &RouteRequest) -> Result<Pick, RouteError>;

    /// Called by [`route`] after every successful decision, rank overrides included: `req` goes to `pick.rank`.
    fn routed(&self, _snap: &Snapshot, _req: &RouteRequest, _pick: &Pick) {}

    /// Engine feedback: `endpoint` had `cached_tokens` of `req`'s prompt in its prefix cache when it started it
    /// (SGLang `meta_info.cached_tokens`, OpenAI `usage.prompt_tokens_details.cached_tokens`). `pick` is the
    /// decision that sent it there. Call it once per request, as soon as the number is known.
    fn observe(&self, _endpoint: EndpointId, _req: &RouteRequest, _pick: &Pick, _cached_tokens: u64) {}
}

/// Routes one request: the override if the client gave one, otherwise the policy's choice; then tells the policy
/// ([`Policy::routed`]).
pub fn route(policy: &dyn Policy, snap: &Snapshot, req: &RouteRequest) -> Result<Pick, RouteError> {
    let pick = match req.rank_override {
        Some(rank) => override_pick(snap, rank)?,
        None if snap.healthy().is_empty() => return Err(RouteError::NoHealthyEndpoint),
        None => policy.choose(snap, req)?,
    };
    debug_assert!(snap.is_healthy(pick.rank), "{} chose a down endpoint", policy.name());
    policy.routed(snap, req, &pick);
    Ok(pick)
}

fn override_pick(snap: &Snapshot, rank: i64) -> Result<Pick, RouteError> {
    let index = usize::try_from(rank)
        .ok()
        .filter(|&r| r < snap.len())
        .ok_or(RouteError::OverrideOutOfRange { rank, size: snap.len() })?;
    if !snap.is_healthy(index) {
        return Err(RouteError::OverrideDown { rank: index });
    }
    Ok(Pick::new(index, Branch::Override))
}

/// A routed request holding its share of the endpoint's load until dropped.
#[derive(Debug)]
pub struct Dispatch {
    pub pick: Pick,
    pub endpoint: EndpointId,
    pub guard: LoadGuard,
}

/// [`route`], then counts the request in flight at the chosen endpoint (speculatively too, unless overridden) and
/// its predicted uncached tokens (the whole prompt without a prediction) as queued prefill, at the request's
/// `now_us`. The front end calls [`LoadGuard::first_token`] on the guard when the first token arrives.
pub fn dispatch(policy: &dyn Policy, snap: &Snapshot, req: &RouteRequest) -> Result<Dispatch, RouteError> {
    let pick = route(policy, snap, req)?;
    let endpoint = &snap.endpoints()[pick.rank];
    let guard = LoadGuard::acquire_with_prefill(
        Arc::clone(&endpoint.load),
        req.input_tokens,
        pick.prefill_tokens.unwrap_or(req.input_tokens),
        pick.branch != Branch::Override,
        req.now_us,
    );
    Ok(Dispatch {
        pick,
        endpoint: endpoint.id,
        guard,
    })
}

/// The healthy rank with the smallest `key`, ties to the lowest rank. `None` only if none is healthy.
pub(crate) fn argmin_healthy<K: Ord>(snap: &Snapshot, key: impl Fn(usize) -> K) -> Option<usize> {
    // `min_by_key` returns the first minimum, and `healthy()` is in ascending rank order.
    snap.healthy().iter().copied().min_by_key(|&r| key(r))
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Routes every request through `dispatch` and returns the ranks with the load guards: as long as the caller
    /// holds them, it is as if no request completed.
    pub fn ranks(policy: &dyn Policy, snap: &Snapshot, reqs: &[RouteRequest]) -> (Vec<usize>, Vec<LoadGuard>) {
        reqs.iter()
            .map(|r| {
                let d = dispatch(policy, snap, r).unwrap();
                (d.pick.rank, d.guard)
            })
            .unzip()
    }

    pub fn empty_requests(n: usize) -> Vec<RouteRequest> {
        vec![RouteRequest::tokens(vec![]); n]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PolicyConfig;
    use crate::load::EngineReport;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn no_policy_ever_returns_a_down_endpoint(
            health in proptest::collection::vec(any::<bool>(), 1..10),
            loads in proptest::collection::vec((0u64..20, 0u64..5000), 10),
            prompts in proptest::collection::vec((proptest::collection::vec(any::<u32>(), 0..600), any::<u64>()), 1..40),
        ) {
            for name in PolicyConfig::NAMES {
                let policy = PolicyConfig::from_name(name).unwrap().build();
                let snap = Snapshot::single_worker(health.len() as u32).with_health(|i, _| health[i]);
                for (r, &(requests, tokens)) in loads.iter().take(snap.len()).enumerate() {
                    snap.load(r).apply_report(EngineReport { requests, tokens, timestamp: 1, waiting: 0 });
                }
                let mut held = Vec::new();
                for (ids, room) in &prompts {
                    let req = RouteRequest::tokens(ids.clone()).with_bootstrap_room(*room);
                    match dispatch(policy.as_ref(), &snap, &req) {
                        Ok(d) => {
                            prop_assert!(snap.is_healthy(d.pick.rank), "{} picked down rank {}", name, d.pick.rank);
                            held.push(d.guard);
                        }
                        Err(e) => prop_assert!(
                            snap.healthy().is_empty() || matches!(e, RouteError::BootstrapRankDown { .. }),
                            "{} failed with healthy endpoints: {}", name, e
                        ),
                    }
                }
            }
        }
    }

    #[test]
    fn override_wins_and_is_validated() {
        let policy = RoundRobin::default();
        let snap = Snapshot::single_worker(4).with_health(|i, _| i != 2);
        let req = RouteRequest::text("x");
        assert_eq!(
            route(&policy, &snap, &req.clone().with_override(3)).unwrap(),
            Pick::new(3, Branch::Override)
        );
        assert_eq!(
            route(&policy, &snap, &req.clone().with_override(4)),
            Err(RouteError::OverrideOutOfRange { rank: 4, size: 4 })
        );
        assert_eq!(
            route(&policy, &snap, &req.clone().with_override(-1)),
            Err(RouteError::OverrideOutOfRange { rank: -1, size: 4 })
        );
        assert_eq!(
            route(&policy, &snap, &req.with_override(2)),
            Err(RouteError::OverrideDown { rank: 2 })
        );
    }

    #[test]
    fn no_healthy_endpoint_is_a_typed_error() {
        let snap = Snapshot::single_worker(2).with_health(|_, _| false);
        let req = RouteRequest::text("x");
        assert_eq!(
            route(&RoundRobin::default(), &snap, &req),
            Err(RouteError::NoHealthyEndpoint)
        );
        assert_eq!(
            route(&RoundRobin::default(), &Snapshot::default(), &req),
            Err(RouteError::NoHealthyEndpoint)
        );
    }

    #[test]
    fn dispatch_counts_overrides_in_flight_but_not_speculatively() {
        let snap = Snapshot::single_worker(2);
        let policy = TotalRequests;
        let pinned = dispatch(&policy, &snap, &RouteRequest::tokens(vec![1, 2]).with_override(0)).unwrap();
        assert_eq!(snap.load(0).in_flight_requests(), 1);
        assert_eq!(snap.load(0).view().requests, 0);
        let chosen = dispatch(&policy, &snap, &RouteRequest::tokens(vec![1, 2])).unwrap();
        assert_eq!(chosen.pick.rank, 0, "the override did not count toward total_requests");
        assert_eq!(snap.load(0).view().requests, 1);
        drop((pinned, chosen));
        assert_eq!(snap.load(0).in_flight_requests(), 0);
    }
}
