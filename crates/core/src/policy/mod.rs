//! The routing policy trait and the one entry point every front end calls.
//!
//! [`dispatch`](crate::dispatch) applies a client's rank override first (for every policy: it wins, is range- and health-checked,
//! never advances a policy's counters and is never counted speculatively), then asks the policy, and returns a
//! [`Ticket`](crate::Ticket) holding the request's share of the endpoint's load. Policies never see down endpoints as candidates:
//! they choose among [`Candidates`], the snapshot's healthy endpoints less any a retry refused.
//!
//! Feedback reaches a policy only through the ticket: [`Ticket::first_token`](crate::Ticket::first_token) (the queued-prefill share is
//! released), [`Ticket::usage`](crate::Ticket::usage) (the engine said how much of the prompt it had cached: [`Policy::observe`]),
//! [`Ticket::reroute`](crate::Ticket::reroute) (the endpoint never got the request: [`Policy::retract`], then a new decision), and its drop
//! (the request ended: [`Policy::release`]).

use crate::endpoint::{EndpointId, Snapshot};
use crate::error::RouteError;
use crate::request::RouteRequest;

pub mod cache_aware;
pub mod follow_bootstrap_room;
pub mod least_loaded;
pub mod peers;
pub mod prefix_affinity;
pub mod prefix_match;
pub mod random;
pub mod round_robin;
pub mod session_homes;
pub mod total_requests;
pub mod total_tokens;

pub use cache_aware::{CacheAware, CacheAwareConfig, IndexStats};
pub use follow_bootstrap_room::FollowBootstrapRoom;
pub use least_loaded::LeastLoaded;
pub use peers::dynamo_kv::{DynamoKv, DynamoKvConfig};
pub use peers::llm_d::{LlmD, LlmDConfig};
pub use peers::smg_cache_aware::{SmgCacheAware, SmgCacheAwareConfig};
pub use prefix_affinity::{AffinityLoad, PrefixAffinity, PrefixAffinityConfig};
pub use prefix_match::PrefixMatch;
pub use random::{Random, RandomConfig};
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
    /// Drawn at random.
    Drawn,
    /// An active session's endpoint took it ([`session_homes`]).
    Session,
}

impl Branch {
    /// Every branch, in the order of [`Branch::index`].
    pub const ALL: [Branch; 12] = [
        Branch::Override,
        Branch::Turn,
        Branch::LeastLoaded,
        Branch::Hashed,
        Branch::Fallback,
        Branch::Empty,
        Branch::Affine,
        Branch::Spill,
        Branch::Hit,
        Branch::Cold,
        Branch::Drawn,
        Branch::Session,
    ];

    /// The branch's position in [`Branch::ALL`] (for per-branch counters in an array).
    pub fn index(self) -> usize {
        self as usize
    }

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
            Branch::Drawn => "random",
            Branch::Session => "session",
        }
    }
}

/// A routing decision: the endpoint's global rank in the snapshot, why, and (from cache-aware policies) how many
/// prompt tokens the endpoint is predicted to have to prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    pub rank: usize,
    pub branch: Branch,
    /// Predicted uncached prompt tokens; `None` means the whole prompt. [`dispatch`](crate::dispatch) counts it as queued prefill.
    pub prefill_tokens: Option<u64>,
    /// What an index-based policy believed the endpoint held of the prompt, for learning from the engine's report.
    pub matched: Option<Matched>,
}

/// What [`Pick::matched`] saw at the chosen endpoint when it predicted a hit there: the prompt's leading blocks
/// the index held, how many blocks it had recorded there since the deepest of them was last recorded
/// ([`BlockIndex::age`](crate::block_index::BlockIndex::age)), and the other requests in flight there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matched {
    pub blocks: usize,
    pub age: usize,
    pub in_flight: u64,
}

impl Pick {
    pub fn new(rank: usize, branch: Branch) -> Self {
        Self {
            rank,
            branch,
            prefill_tokens: None,
            matched: None,
        }
    }

    pub fn with_prefill(mut self, tokens: u64) -> Self {
        self.prefill_tokens = Some(tokens);
        self
    }

    pub fn with_matched(mut self, matched: Option<Matched>) -> Self {
        self.matched = matched;
        self
    }
}

/// How a request ended, as [`Policy::release`] hears it ([`Ticket::end`](crate::Ticket::end); a ticket dropped
/// without it ended unanswered).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ending {
    /// The answer came whole.
    pub answered: bool,
    /// It ended on tool calls (OpenAI's `finish_reason` `tool_calls`, Anthropic's `stop_reason` `tool_use`, a
    /// Responses `function_call`, [`crate::tool_calls`]): its client will send the next turn once the tool has run.
    pub tool_call: bool,
    /// When, on the requests' clock (0 when unanswered).
    pub now_us: u64,
}

/// Per-request work a policy does once, before the request's first decision, and gets back in every later hook
/// of that request (a retry's decision, the engine's feedback): `cache_aware` keeps the prompt's block hashes here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prepared {
    pub block_hashes: Vec<u64>,
}

/// The endpoints a policy may choose in one decision: the snapshot's healthy endpoints that `accept` lets through
/// (a retry refuses the worker that failed it), without building another snapshot.
#[derive(Clone, Copy)]
pub struct Candidates<'a> {
    snap: &'a Snapshot,
    accept: Option<&'a dyn Fn(usize) -> bool>,
}

impl<'a> Candidates<'a> {
    /// Every healthy endpoint of `snap`.
    pub fn all(snap: &'a Snapshot) -> Self {
        Self { snap, accept: None }
    }

    /// The healthy endpoints of `snap` whose global rank `accept` lets through.
    pub fn accepting(snap: &'a Snapshot, accept: &'a dyn Fn(usize) -> bool) -> Self {
        Self {
            snap,
            accept: Some(accept),
        }
    }

    pub fn snap(&self) -> &'a Snapshot {
        self.snap
    }

    pub fn contains(&self, rank: usize) -> bool {
        self.snap.is_healthy(rank) && self.accept.is_none_or(|accept| accept(rank))
    }

    /// The candidates' global ranks, ascending.
    pub fn iter(&self) -> impl Iterator<Item = usize> + 'a {
        let accept = self.accept;
        self.snap
            .healthy()
            .iter()
            .copied()
            .filter(move |&r| accept.is_none_or(|accept| accept(r)))
    }

    pub fn count(&self) -> usize {
        match self.accept {
            None => self.snap.healthy().len(),
            Some(_) => self.iter().count(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.count() == 0
    }

    /// The `n`-th candidate in rank order.
    pub fn nth(&self, n: usize) -> Option<usize> {
        match self.accept {
            None => self.snap.healthy().get(n).copied(),
            Some(_) => self.iter().nth(n),
        }
    }
}

impl std::fmt::Debug for Candidates<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A load-balancing method.
///
/// `choose` is called only for requests without a rank override, with at least one candidate, and must return a
/// candidate's rank. Implementations use interior mutability (atomics, short locks) and are shared across threads.
///
/// Every hook of one request gets the same [`Prepared`], made once by `prepare`. Front ends do not call the hooks
/// themselves: [`dispatch`](crate::dispatch) calls `prepare`, `choose` or `pinned`, and the [`Ticket`](crate::Ticket) it returns carries the
/// request's feedback (`observe`, `retract`), so every front end (gateway, simulator, bench client) feeds a policy
/// the same way.
pub trait Policy: Send + Sync {
    /// The config name (`round_robin`, `prefix_match`, …).
    fn name(&self) -> &'static str;

    /// Work done once per request, before its first decision.
    fn prepare(&self, _req: &RouteRequest) -> Prepared {
        Prepared::default()
    }

    /// Chooses among `candidates`; a policy that keeps state records its decision here, in the same step.
    fn choose(&self, candidates: &Candidates<'_>, req: &RouteRequest, prepared: &Prepared) -> Result<Pick, RouteError>;

    /// The candidate predicted to hold the most of `req`'s prompt in its prefix cache, and how many tokens of it
    /// (ties: the fewer requests waiting for a first token, then the lower rank); `None` when no candidate is
    /// predicted to hold any, or the policy keeps no index of what endpoints hold (all but `cache_aware`). Records
    /// nothing. Flow control's queue uses it to wait for that endpoint ([`Candidates`] with room aside).
    fn most_cached(
        &self,
        _candidates: &Candidates<'_>,
        _req: &RouteRequest,
        _prepared: &Prepared,
    ) -> Option<(usize, u64)> {
        None
    }

    /// The sessions active at `now_us` at each of `snap`'s endpoints, by rank, for a policy that keeps sessions at
    /// home (`cache_aware`: [`session_homes`]); `None` for the others.
    fn sessions_by_rank(&self, _snap: &Snapshot, _now_us: u64) -> Option<Vec<usize>> {
        None
    }

    /// A client's rank override sent `req` to `pick.rank`: record it as `choose` records its own decisions.
    fn pinned(&self, _snap: &Snapshot, _req: &RouteRequest, _prepared: &Prepared, _pick: &Pick) {}

    /// Engine feedback: `endpoint` had `cached_tokens` of `req`'s prompt in its prefix cache when it started it
    /// (SGLang `meta_info.cached_tokens`, OpenAI `usage.prompt_tokens_details.cached_tokens`, llama.cpp
    /// `timings.cache_n`). `pick` is the decision that sent it there. Called at most once per request, as soon as
    /// the number is known.
    fn observe(
        &self,
        _endpoint: EndpointId,
        _req: &RouteRequest,
        _prepared: &Prepared,
        _pick: &Pick,
        _cached_tokens: u64,
    ) {
    }

    /// The request never reached `endpoint` (its connection was refused) and is routed again: `endpoint` did not
    /// get its prompt.
    fn retract(&self, _endpoint: EndpointId, _req: &RouteRequest, _prepared: &Prepared, _pick: &Pick) {}

    /// The request sent to `endpoint` ended, as `ending` says (answered, on tool calls or not; or failed or
    /// abandoned): its ticket ended. Not called for a rerouted request's first endpoint (that one hears
    /// [`Policy::retract`]). A policy that tracks what is active per endpoint (Dynamo's KV router) lets it go here;
    /// `cache_aware` marks a session paused for a tool.
    fn release(&self, _endpoint: EndpointId, _req: &RouteRequest, _prepared: &Prepared, _pick: &Pick, _ending: Ending) {
    }

    /// What `endpoint`'s engine reported of its own cache: its KV events, followed into the router's block hashes
    /// ([`crate::engine_blocks`]), at `now_us` on the requests' clock. Only `cache_aware` keeps an index to apply
    /// it to (its precise mode); the other policies ignore it.
    fn engine_cache(&self, _endpoint: EndpointId, _change: &crate::engine_blocks::CacheChange, _now_us: u64) {}
}

/// One decision: the override if the client gave one (range- and health-checked against the snapshot, never
/// against `accept`), otherwise the policy's choice among the candidates.
pub fn decide(
    policy: &dyn Policy,
    candidates: &Candidates<'_>,
    req: &RouteRequest,
    prepared: &Prepared,
) -> Result<Pick, RouteError> {
    let snap = candidates.snap();
    if let Some(rank) = req.rank_override {
        let pick = override_pick(snap, rank)?;
        policy.pinned(snap, req, prepared, &pick);
        return Ok(pick);
    }
    if candidates.is_empty() {
        return Err(RouteError::NoHealthyEndpoint);
    }
    let pick = policy.choose(candidates, req, prepared)?;
    debug_assert!(
        candidates.contains(pick.rank),
        "{} chose a non-candidate",
        policy.name()
    );
    Ok(pick)
}

/// Routes one request among all healthy endpoints of `snap` (tools and tests; front ends use [`dispatch`](crate::dispatch)).
pub fn route(policy: &dyn Policy, snap: &Snapshot, req: &RouteRequest) -> Result<Pick, RouteError> {
    decide(policy, &Candidates::all(snap), req, &policy.prepare(req))
}

/// A client's rank override checked against `snap`: in range and healthy.
pub(crate) fn override_pick(snap: &Snapshot, rank: i64) -> Result<Pick, RouteError> {
    let index = usize::try_from(rank)
        .ok()
        .filter(|&r| r < snap.len())
        .ok_or(RouteError::OverrideOutOfRange { rank, size: snap.len() })?;
    if !snap.is_healthy(index) {
        return Err(RouteError::OverrideDown { rank: index });
    }
    Ok(Pick::new(index, Branch::Override))
}

/// The candidate with the smallest `key`, ties to the lowest rank. `None` only if there is none.
pub(crate) fn argmin<K: Ord>(candidates: &Candidates<'_>, key: impl Fn(usize) -> K) -> Option<usize> {
    // `min_by_key` returns the first minimum, and candidates come in ascending rank order.
    candidates.iter().min_by_key(|&r| key(r))
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::ticket::{dispatch, Ticket};

    /// Routes every request through `dispatch` and returns the ranks with the tickets: as long as the caller
    /// holds them, it is as if no request completed.
    pub fn ranks<'a>(
        policy: &'a dyn Policy,
        snap: &Snapshot,
        reqs: &[RouteRequest],
    ) -> (Vec<usize>, Vec<Ticket<&'a dyn Policy>>) {
        reqs.iter()
            .map(|r| {
                let d = dispatch(policy, snap, r.clone()).unwrap();
                (d.pick.rank, d)
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
    use crate::ticket::dispatch;

    #[test]
    fn cache_namespaces_share_no_keys() {
        let snap = Snapshot::single_worker(64);
        let prompts: Vec<Vec<u32>> = (0..32u32).map(|i| (0..300).map(|t| i * 1_000 + t).collect()).collect();
        for name in ["prefix_match", "prefix_affinity", "cache_aware"] {
            let policy = PolicyConfig::from_name(name).unwrap().build();
            let mut moved = 0;
            for prompt in &prompts {
                let plain = RouteRequest::tokens(prompt.clone());
                let a = route(policy.as_ref(), &snap, &plain.clone().with_namespace("a")).unwrap();
                let again = route(policy.as_ref(), &snap, &plain.clone().with_namespace("a")).unwrap();
                let b = route(policy.as_ref(), &snap, &plain.with_namespace("b")).unwrap();
                assert_eq!(a.rank, again.rank, "{name}: one namespace, one rank");
                moved += usize::from(a.rank != b.rank);
            }
            // Over 64 ranks two unrelated keys meet 1 time in 64.
            assert!(
                moved >= 28,
                "{name}: only {moved} of 32 prompts moved with their namespace"
            );
        }
        // Under cache_aware a namespace's cached prefix is a hit there only.
        let policy = PolicyConfig::from_name("cache_aware").unwrap().build();
        let first = dispatch(
            policy.as_ref(),
            &snap,
            RouteRequest::tokens(prompts[0].clone()).with_namespace("a"),
        )
        .unwrap();
        drop(first);
        let same = route(
            policy.as_ref(),
            &snap,
            &RouteRequest::tokens(prompts[0].clone()).with_namespace("a"),
        )
        .unwrap();
        let other = route(
            policy.as_ref(),
            &snap,
            &RouteRequest::tokens(prompts[0].clone()).with_namespace("b"),
        )
        .unwrap();
        assert_eq!(same.branch, Branch::Hit);
        assert_eq!(other.branch, Branch::Cold);
    }

    #[test]
    fn a_session_hint_keeps_a_session_together_and_sessions_apart() {
        for name in ["prefix_affinity", "cache_aware"] {
            let policy = PolicyConfig::from_name(name).unwrap().build();
            let snap = Snapshot::single_worker(4);
            let mut homes = std::collections::BTreeSet::new();
            for session in 0..16 {
                let mut ranks = std::collections::BTreeSet::new();
                for turn in 0..20u32 {
                    // Prompts that share nothing, not even a block: only the hint ties them.
                    let req = RouteRequest::tokens(vec![session * 1000 + turn; 3]).with_session(&format!("s{session}"));
                    ranks.insert(dispatch(policy.as_ref(), &snap, req).unwrap().pick.rank);
                }
                assert_eq!(ranks.len(), 1, "{name}: session {session} moved: {ranks:?}");
                homes.extend(ranks);
            }
            assert!(homes.len() >= 3, "{name}: 16 sessions on {homes:?}");
        }
    }

    #[test]
    fn sglang_methods_ignore_session_hints() {
        let snap = Snapshot::single_worker(4);
        for name in ["round_robin", "prefix_match", "total_requests"] {
            let a = PolicyConfig::from_name(name).unwrap().build();
            let b = PolicyConfig::from_name(name).unwrap().build();
            for i in 0..8u32 {
                let plain = RouteRequest::tokens(vec![i; 300]);
                let hinted = plain.clone().with_session("same");
                assert_eq!(
                    route(a.as_ref(), &snap, &plain).unwrap(),
                    route(b.as_ref(), &snap, &hinted).unwrap(),
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn branch_indices_follow_all() {
        for (i, b) in Branch::ALL.iter().enumerate() {
            assert_eq!(b.index(), i, "{}", b.as_str());
        }
    }
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
                    snap.load(r).apply_report(EngineReport { requests, tokens, timestamp: 1, waiting: 0, queued_prefill_tokens: None });
                }
                let mut held = Vec::new();
                for (ids, room) in &prompts {
                    let req = RouteRequest::tokens(ids.clone()).with_bootstrap_room(*room);
                    match dispatch(policy.as_ref(), &snap, req.clone()) {
                        Ok(d) => {
                            prop_assert!(snap.is_healthy(d.pick.rank), "{} picked down rank {}", name, d.pick.rank);
                            held.push(d);
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
        let pinned = dispatch(&policy, &snap, RouteRequest::tokens(vec![1, 2]).with_override(0)).unwrap();
        assert_eq!(snap.load(0).in_flight_requests(), 1);
        assert_eq!(snap.load(0).view().requests, 0);
        let chosen = dispatch(&policy, &snap, RouteRequest::tokens(vec![1, 2])).unwrap();
        assert_eq!(chosen.pick.rank, 0, "the override did not count toward total_requests");
        assert_eq!(snap.load(0).view().requests, 1);
        drop((pinned, chosen));
        assert_eq!(snap.load(0).in_flight_requests(), 0);
    }
}
