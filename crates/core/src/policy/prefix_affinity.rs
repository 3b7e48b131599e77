//! `prefix_affinity`: consistent hashing with bounded loads over a prefix key; stateless, so gateway replicas agree
//! without coordination.
//!
//! Algorithm:
//! 1. Key: XXH3-64 of the prompt's first `min(len, W)` units, `W` = `key_tokens` (token ids) or `key_bytes` (text).
//!    The defaults (1,024 tokens; 1,024 bytes ≈ 250 tokens of a chat rendering, chosen against real chat agents:
//!    `docs/policies.md`) are shorter than a typical first turn (system prompt, tools, first user message), so a
//!    conversation keeps one key as it grows: every later turn extends the first
//!    and shares its first `W` units. A prompt shorter than `W` hashes whole (a short conversation changes key until
//!    it reaches `W`, once per turn, instead of every 256 tokens up to 4,096 as `prefix_match` does). Conversations
//!    whose common prefix (system prompt) is longer than `W` share a key, so they share a home endpoint and its
//!    cached prefix, and the load bound spreads them when they are many.
//!    A client's session hint ([`RouteRequest::session`]) is the key instead, when given.
//! 2. Order all healthy endpoints by rendezvous (highest-random-weight) score of (key, endpoint id), see
//!    [`crate::hashing`]. Scores depend on stable endpoint ids, not snapshot positions, so an endpoint going down or
//!    leaving moves only the keys it held, and one joining takes about `1/(n+1)` of them.
//! 3. Take the first endpoint in that order whose load after taking this request stays within
//!    `ceil((1 + ε) · (total + w) / n)` (consistent hashing with bounded loads: Mirrokni, Thorup and Zadimoghaddam,
//!    "Consistent Hashing with Bounded Loads", SODA 2018), with `total` the load over the `n` healthy endpoints and
//!    `w` this request's weight. With unit weights (the request-count measures) some endpoint always fits: the
//!    bounds sum to at least `(1 + ε)(total + 1) > total + 1`. With token weights none may fit; then the least
//!    loaded takes it.
//!
//! The load measure ([`AffinityLoad`]) is configurable. The default is `prefill`: requests dispatched to the
//! endpoint whose first token has not arrived, the queue that delays a first token. Counting requests in flight
//! (`requests`) also counts requests that are only decoding, so a conversation's home looks full while it is
//! merely streaming answers and its turns spill to endpoints without its history; weighting by tokens
//! (`prefill_tokens`) spills a long prompt away from a home with one other long prompt queued. The three are
//! compared in `docs/measurements.md` ("Choices measured").
//!
//! Branches: `affine` (the key's first choice), `fallback` (its first choice is down; the first healthy one in its
//! order took it), `spill` (over the bound: a later choice), `empty` (no prompt: round-robin turn). Overrides are
//! applied by [`crate::policy::route`]. Cost per request: hashing at most `W` units, one score per healthy endpoint,
//! and a sort of the healthy endpoints only when the first choice is over its bound: O(W + n log n).

use serde::{Deserialize, Serialize};

use crate::error::RouteError;
use crate::hashing::{prefix_hash, rendezvous_score};
use crate::load::EndpointLoad;
use crate::policy::{Branch, Candidates, Pick, Policy, Prepared, RoundRobin};
use crate::request::{Prompt, RouteRequest};

/// What `prefix_affinity` bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AffinityLoad {
    /// Requests in flight (dispatched, not finished): prefilling, queued or decoding.
    Requests,
    /// Requests waiting for their first token (queued or prefilling).
    Prefill,
    /// Predicted uncached prompt tokens waiting for their first token; each request weighs its prompt length.
    PrefillTokens,
}

impl AffinityLoad {
    fn of(self, load: &EndpointLoad) -> u64 {
        match self {
            AffinityLoad::Requests => load.in_flight_requests(),
            AffinityLoad::Prefill => load.queued_prefill_requests(),
            AffinityLoad::PrefillTokens => load.queued_prefill_tokens(),
        }
    }

    fn weight(self, req: &RouteRequest) -> u64 {
        match self {
            AffinityLoad::Requests | AffinityLoad::Prefill => 1,
            AffinityLoad::PrefillTokens => req.input_tokens.max(1),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixAffinityConfig {
    /// The key covers at most this many leading tokens of a token-id prompt.
    pub key_tokens: usize,
    /// The key covers at most this many leading bytes of a text prompt.
    pub key_bytes: usize,
    /// Load slack ε: an endpoint takes a request while its load stays within `ceil((1 + ε) · average)`.
    pub epsilon: f64,
    /// What the bound counts.
    pub load: AffinityLoad,
}

impl Default for PrefixAffinityConfig {
    fn default() -> Self {
        Self {
            key_tokens: 1024,
            key_bytes: 1024,
            epsilon: 0.25,
            load: AffinityLoad::Prefill,
        }
    }
}

#[derive(Debug, Default)]
pub struct PrefixAffinity {
    config: PrefixAffinityConfig,
    empty: RoundRobin,
}

impl PrefixAffinity {
    pub fn new(config: PrefixAffinityConfig) -> Self {
        Self {
            config,
            empty: RoundRobin::default(),
        }
    }

    /// The request's key: the hash of its first `min(len, W)` units.
    pub fn key(&self, prompt: &Prompt) -> u64 {
        let window = match prompt {
            Prompt::Tokens(_) => self.config.key_tokens,
            Prompt::Bytes(_) => self.config.key_bytes,
        };
        prefix_hash(prompt, window)
    }

    /// The load bound for a request of weight `w` when the healthy endpoints carry `total` over `n` of them.
    pub fn bound(&self, total: u64, w: u64, n: usize) -> u64 {
        let slack = 1.0 + self.config.epsilon.max(0.0);
        (slack * (total + w) as f64 / n.max(1) as f64).ceil() as u64
    }
}

impl Policy for PrefixAffinity {
    fn name(&self) -> &'static str {
        "prefix_affinity"
    }

    fn choose(&self, c: &Candidates<'_>, req: &RouteRequest, _prepared: &Prepared) -> Result<Pick, RouteError> {
        let snap = c.snap();
        if req.prompt.is_empty() {
            return self.empty.next(c, req, Branch::Empty);
        }
        // A session hint keys the whole session, whatever its prompts.
        let key = req
            .session
            .unwrap_or_else(|| crate::hashing::namespaced(self.key(&req.prompt), req.namespace));
        let measure = self.config.load;
        let score = |r: usize| rendezvous_score(key, snap.endpoints()[r].id);
        // (score, load) of every healthy endpoint, in rank order.
        let mut candidates: Vec<(u64, u64, usize)> =
            c.iter().map(|r| (score(r), measure.of(snap.load(r)), r)).collect();
        let top_is_down = (0..snap.len())
            .max_by_key(|&r| score(r))
            .is_some_and(|r| !c.contains(r));
        let w = measure.weight(req);
        let total: u64 = candidates.iter().map(|c| c.1).sum();
        let bound = self.bound(total, w, candidates.len());
        let fits = |load: u64| load + w <= bound;
        let first = candidates
            .iter()
            .copied()
            .max_by_key(|c| c.0)
            .ok_or(RouteError::NoHealthyEndpoint)?;
        if fits(first.1) {
            let branch = if top_is_down { Branch::Fallback } else { Branch::Affine };
            return Ok(Pick::new(first.2, branch));
        }
        candidates.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
        let spill = candidates
            .iter()
            .find(|c| fits(c.1))
            // Token weights only: nothing fits, so the least loaded (first in key order among equals) takes it.
            .or_else(|| candidates.iter().min_by_key(|c| c.1))
            .ok_or(RouteError::NoHealthyEndpoint)?;
        Ok(Pick::new(spill.2, Branch::Spill))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::endpoint::{Endpoint, EndpointId};
    use crate::load::LoadGuard;
    use crate::policy::route;
    use crate::policy::testing::{empty_requests, ranks};
    use crate::ticket::dispatch;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn request(key: u64) -> RouteRequest {
        RouteRequest::tokens(vec![(key & 0xffff_ffff) as u32, (key >> 32) as u32, 7])
    }

    /// The endpoint id each of `keys` goes to on an idle snapshot.
    fn placements(snap: &Snapshot, keys: std::ops::Range<u64>) -> Vec<EndpointId> {
        let policy = PrefixAffinity::default();
        keys.map(|k| snap.endpoints()[route(&policy, snap, &request(k)).unwrap().rank].id)
            .collect()
    }

    fn workers(ids: &[u32]) -> Snapshot {
        Snapshot::new(ids.iter().map(|&i| Endpoint::new(EndpointId::new(i, 0))).collect())
    }

    #[test]
    fn a_conversation_keeps_its_key_and_endpoint_as_it_grows() {
        let snap = Snapshot::single_worker(16);
        let policy = PrefixAffinity::default();
        let first: Vec<u32> = (0..1500).map(|i| i * 31 + 7).collect();
        let rank = route(&policy, &snap, &RouteRequest::tokens(first.clone())).unwrap();
        assert_eq!(rank.branch, Branch::Affine);
        for turn in 1..20u32 {
            let grown = [first.clone(), (0..turn * 350).collect()].concat();
            assert_eq!(route(&policy, &snap, &RouteRequest::tokens(grown)).unwrap(), rank);
        }
        let text = "s".repeat(5000);
        let a = policy.key(&Prompt::Bytes(text.as_bytes().to_vec()));
        let b = policy.key(&Prompt::Bytes(format!("{text} and more").into_bytes()));
        assert_eq!(a, b);
        assert_ne!(a, policy.key(&Prompt::Bytes(b"s short prompt".to_vec())));
    }

    #[test]
    fn a_hot_key_spills_to_its_next_choices_and_comes_back() {
        let snap = Snapshot::single_worker(4);
        let policy = PrefixAffinity::new(PrefixAffinityConfig {
            load: AffinityLoad::Requests,
            ..PrefixAffinityConfig::default()
        });
        let req = request(5);
        let (got, held) = ranks(&policy, &snap, &vec![req.clone(); 8]);
        // Bounds ceil(1.25 (t + 1) / 4) for t = 0..7: 1, 1, 1, 2, 2, 2, 3, 3. The first three go to the key's first
        // three choices, one each; then each of those takes one more per bound step, in key order.
        assert_eq!(got[3..], [got[0], got[1], got[2], got[0], got[1]], "{got:?}");
        assert!(got[0] != got[1] && got[1] != got[2] && got[0] != got[2], "{got:?}");
        drop(held);
        let back = route(&policy, &snap, &req).unwrap();
        assert_eq!((back.rank, back.branch), (got[0], Branch::Affine));
    }

    #[test]
    fn prefill_measure_ignores_decoding_requests() {
        let snap = Snapshot::single_worker(4);
        let policy = PrefixAffinity::default();
        let req = request(11);
        let home = route(&policy, &snap, &req).unwrap().rank;
        let (mut used, mut decoding) = (std::collections::HashSet::new(), Vec::new());
        for _ in 0..6 {
            let d = dispatch(&policy, &snap, req.clone()).unwrap();
            used.insert(d.pick.rank);
            decoding.push(d);
        }
        // Each of the six still waits for its first token, so they spread...
        assert!(used.len() > 1, "{used:?}");
        // ...and once they have their first tokens (decoding), the home takes new requests again.
        decoding.iter_mut().for_each(|g| g.first_token(0));
        let pick = route(&policy, &snap, &req).unwrap();
        assert_eq!((pick.rank, pick.branch), (home, Branch::Affine));
    }

    #[test]
    fn a_down_first_choice_is_a_fallback_and_empty_prompts_go_round_robin() {
        let snap = Snapshot::single_worker(8);
        let policy = PrefixAffinity::default();
        let req = request(3);
        let home = route(&policy, &snap, &req).unwrap().rank;
        let degraded = snap.with_health(|i, _| i != home);
        let pick = route(&policy, &degraded, &req).unwrap();
        assert_eq!(pick.branch, Branch::Fallback);
        assert_ne!(pick.rank, home);
        let (got, _held) = ranks(&policy, &Snapshot::single_worker(3), &empty_requests(4));
        assert_eq!(got, vec![0, 1, 2, 0]);
    }

    #[test]
    fn token_weights_take_the_least_loaded_when_nothing_fits() {
        let snap = Snapshot::single_worker(4);
        let policy = PrefixAffinity::new(PrefixAffinityConfig {
            load: AffinityLoad::PrefillTokens,
            ..PrefixAffinityConfig::default()
        });
        let _busy: Vec<LoadGuard> = (0..4)
            .map(|r| LoadGuard::acquire(Arc::clone(&snap.endpoints()[r].load), 1000 * (r as u64 + 1), true))
            .collect();
        let pick = route(&policy, &snap, &RouteRequest::tokens(vec![1; 100_000])).unwrap();
        assert_eq!(pick.rank, 0);
    }

    #[test]
    fn adding_an_endpoint_moves_about_one_in_n_plus_one_keys_all_to_it() {
        let keys = 0..20_000u64;
        let before = placements(&workers(&(0..8).collect::<Vec<_>>()), keys.clone());
        let after = placements(&workers(&(0..9).collect::<Vec<_>>()), keys);
        let moved: Vec<_> = before.iter().zip(&after).filter(|(a, b)| a != b).collect();
        assert!(moved.iter().all(|(_, b)| b.worker.0 == 8));
        let fraction = moved.len() as f64 / before.len() as f64;
        assert!((fraction - 1.0 / 9.0).abs() < 0.01, "moved {fraction}");
    }

    proptest! {
        #[test]
        fn removing_one_endpoint_moves_only_its_keys(n in 2u32..20, gone in 0u32..20, down in any::<bool>()) {
            let gone = gone % n;
            let all = workers(&(0..n).collect::<Vec<_>>());
            let fewer = if down {
                all.with_health(|_, e| e.id.worker.0 != gone)
            } else {
                workers(&(0..n).filter(|&i| i != gone).collect::<Vec<_>>())
            };
            let (before, after) = (placements(&all, 0..500), placements(&fewer, 0..500));
            for (b, a) in before.iter().zip(&after) {
                prop_assert!(b == a || b.worker.0 == gone, "{} moved to {}", b, a);
                prop_assert!(a.worker.0 != gone);
            }
        }

        #[test]
        fn bounded_load_is_never_exceeded(
            n in 1u32..12,
            preload in proptest::collection::vec(0u64..6, 12),
            keys in proptest::collection::vec(0u64..8, 1..80),
            epsilon in 0.0f64..1.0,
            prefill in any::<bool>(),
        ) {
            let snap = Snapshot::single_worker(n);
            let load = if prefill { AffinityLoad::Prefill } else { AffinityLoad::Requests };
            let policy = PrefixAffinity::new(PrefixAffinityConfig { epsilon, load, ..PrefixAffinityConfig::default() });
            let mut preloaded: Vec<LoadGuard> = Vec::new();
            let mut held = Vec::new();
            for (r, &k) in preload.iter().take(n as usize).enumerate() {
                for _ in 0..k {
                    preloaded.push(LoadGuard::acquire(Arc::clone(&snap.endpoints()[r].load), 1, false));
                }
            }
            // Few distinct keys: hot keys that must spill.
            for k in keys {
                let loads: Vec<u64> = (0..n as usize).map(|r| load.of(snap.load(r))).collect();
                let bound = policy.bound(loads.iter().sum(), 1, n as usize);
                prop_assume!(loads.iter().any(|&l| l < bound));
                let d = dispatch(&policy, &snap, request(k)).unwrap();
                prop_assert!(loads[d.pick.rank] < bound, "rank {} at {} with bound {}", d.pick.rank, loads[d.pick.rank], bound);
                held.push(d);
            }
        }
    }
}
