//! A router for one engine's data-parallel ranks, driven from inside the engine: what the Python package's
//! `Router` wraps, so that SGLang's and vLLM's own DP dispatch can pick ranks with dprouter's policies, with no
//! gateway in front.
//!
//! The engine is one worker whose ranks are the endpoints. Each [`DpRouter::pick`] dispatches through the same
//! [`dispatch`](crate::dispatch) as the gateway (so a policy learns the same things in the same order), and, when the engine names
//! the request, keeps its [`Ticket`](crate::Ticket) by request id until the engine reports the request's first token, its finish
//! (with its prompt and cached tokens: the policy's feedback) or its abort. An engine that misses a finish must not
//! leak: tickets are bounded in number and in age ([`TicketLimits`]), the oldest dropped first. Load reports, ranks
//! going inactive, and each rank's KV events ([`crate::kv_feed`], with no replay) reach the policy the same way
//! they do in the gateway.
//!
//! Times are microseconds on the caller's monotonic clock (`now_us`), passed with every call that needs one.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::config::{ConfigError, PolicyConfig};
use crate::endpoint::{Endpoint, EndpointId, Snapshot};
use crate::error::RouteError;
use crate::kv_feed::{Feed, Received, MAX_ENGINE_BLOCKS};
use crate::load::EngineReport;
use crate::policy::{Branch, Pick, Policy};
use crate::request::RouteRequest;
use crate::ticket::dispatch_among;
use crate::ticket::Ticket;
use crate::usage::Usage;

/// The most ranks one router takes (SGLang and vLLM run up to a few hundred).
pub const MAX_RANKS: usize = 4_096;

/// How many tickets a router keeps, and for how long: past either, the oldest are dropped (their requests' load
/// released, as if they had finished without a report).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TicketLimits {
    pub max_tickets: usize,
    pub max_age_us: u64,
}

impl Default for TicketLimits {
    /// 100,000 requests in flight, each for at most 30 minutes.
    fn default() -> Self {
        Self {
            max_tickets: 100_000,
            max_age_us: 30 * 60 * 1_000_000,
        }
    }
}

/// Why a router could not be built, or a call was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DpRouterError {
    #[error(transparent)]
    Route(#[from] RouteError),
    #[error("invalid policy: {0}")]
    Policy(String),
    #[error("num_ranks must be between 1 and {MAX_RANKS}, got {0}")]
    NumRanks(usize),
    #[error("DP rank {rank} is out of range: there are {size} ranks (0..{size})")]
    Rank { rank: i64, size: usize },
    #[error("`eligible` names no rank")]
    NoEligible,
}

impl From<ConfigError> for DpRouterError {
    fn from(e: ConfigError) -> Self {
        DpRouterError::Policy(e.to_string())
    }
}

/// One decision, as the engine sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub rank: usize,
    pub branch: Branch,
    /// Prompt tokens the rank is predicted to hold already (0 when the policy does not predict).
    pub predicted_cached_tokens: u64,
}

impl Decision {
    fn of(pick: &Pick, input_tokens: u64) -> Self {
        Self {
            rank: pick.rank,
            branch: pick.branch,
            predicted_cached_tokens: pick
                .prefill_tokens
                .map_or(0, |prefill| input_tokens.saturating_sub(prefill)),
        }
    }
}

/// What a pick is told besides the prompt.
#[derive(Debug, Clone, Default)]
pub struct PickOptions<'a> {
    /// Keep the ticket under this id for the engine's feedback; `None`: the request is forgotten once routed.
    pub request_id: Option<&'a str>,
    /// The rank the request names itself (SGLang's `routed_dp_rank`, vLLM's `data_parallel_rank`).
    pub routed_rank: Option<i64>,
    pub bootstrap_room: Option<u64>,
    pub session: Option<&'a str>,
    /// The prompt's cache namespace (SGLang's `extra_key`, vLLM's `cache_salt`, a LoRA adapter).
    pub cache_namespace: Option<&'a str>,
    /// The ranks the request may go to (the active ones); `None`: every active rank.
    pub eligible: Option<&'a [i64]>,
}

/// One rank's load as its engine reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReport {
    pub running: u64,
    pub waiting: u64,
    /// KV tokens in use plus queued prompt tokens (`total_tokens`' measure).
    pub tokens: u64,
    /// Uncached prompt tokens of the waiting requests, when the engine says (SGLang's load snapshots): then
    /// the policies see the engine's own prefill queue.
    pub waiting_tokens: Option<u64>,
    /// Any increasing number: a report no newer than the last one applied is ignored.
    pub timestamp: u64,
}

/// What [`DpRouter::apply_kv_events`] did with a batch.
pub type KvOutcome = Received;

struct Held {
    ticket: Ticket<Arc<dyn Policy>>,
    /// When it was issued, and its place in the issue order (a request id issued again gets a new one).
    at_us: u64,
    serial: u64,
}

/// A router over one engine's ranks (see the module documentation).
pub struct DpRouter {
    policy: Arc<dyn Policy>,
    config: PolicyConfig,
    snap: Snapshot,
    tickets: HashMap<String, Held>,
    /// Request ids in issue order, with their serial (stale entries are skipped).
    order: VecDeque<(u64, String)>,
    serial: u64,
    limits: TicketLimits,
    feeds: Vec<Feed>,
}

impl std::fmt::Debug for DpRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DpRouter")
            .field("policy", &self.config.name())
            .field("num_ranks", &self.snap.len())
            .field("tickets", &self.tickets.len())
            .finish_non_exhaustive()
    }
}

impl DpRouter {
    /// A router with the policy of `spec` (as `--policy` takes it: `cache_aware:prefill_tokens_per_s=12000`) over
    /// `num_ranks` ranks, all active.
    pub fn new(spec: &str, num_ranks: usize, limits: TicketLimits) -> Result<Self, DpRouterError> {
        if !(1..=MAX_RANKS).contains(&num_ranks) {
            return Err(DpRouterError::NumRanks(num_ranks));
        }
        let config = PolicyConfig::from_spec(spec)?;
        config.validate().map_err(|e| DpRouterError::Policy(e.to_string()))?;
        let block_tokens = match &config {
            PolicyConfig::CacheAware(c) => c.block_tokens,
            _ => 1,
        };
        Ok(Self {
            policy: Arc::from(config.build()),
            config,
            snap: Snapshot::single_worker(num_ranks as u32),
            tickets: HashMap::new(),
            order: VecDeque::new(),
            serial: 0,
            limits,
            feeds: (0..num_ranks)
                .map(|_| Feed::new(block_tokens, MAX_ENGINE_BLOCKS))
                .collect(),
        })
    }

    pub fn num_ranks(&self) -> usize {
        self.snap.len()
    }

    pub fn policy_name(&self) -> &'static str {
        self.config.name()
    }

    /// Tickets held (requests routed with an id and not finished, aborted or expired).
    pub fn tickets(&self) -> usize {
        self.tickets.len()
    }

    fn rank(&self, rank: i64) -> Result<usize, DpRouterError> {
        usize::try_from(rank)
            .ok()
            .filter(|&r| r < self.snap.len())
            .ok_or(DpRouterError::Rank {
                rank,
                size: self.snap.len(),
            })
    }

    fn request(&self, tokens: Vec<u32>, options: &PickOptions<'_>, now_us: u64) -> RouteRequest {
        let mut req = RouteRequest::tokens(tokens).at(now_us);
        req.rank_override = options.routed_rank;
        req.bootstrap_room = options.bootstrap_room;
        if let Some(session) = options.session {
            req = req.with_session(session);
        }
        if let Some(namespace) = options.cache_namespace {
            req = req.with_namespace(namespace);
        }
        req
    }

    /// The eligible ranks as a mask, checked.
    fn eligible(&self, eligible: Option<&[i64]>) -> Result<Option<Vec<bool>>, DpRouterError> {
        let Some(ranks) = eligible else { return Ok(None) };
        let mut mask = vec![false; self.snap.len()];
        for &rank in ranks {
            mask[self.rank(rank)?] = true;
        }
        if !mask.iter().any(|&m| m) {
            return Err(DpRouterError::NoEligible);
        }
        Ok(Some(mask))
    }

    /// Picks the rank for a prompt of `tokens` at `now_us`, and keeps its ticket under `options.request_id`.
    pub fn pick(
        &mut self,
        tokens: Vec<u32>,
        options: &PickOptions<'_>,
        now_us: u64,
    ) -> Result<Decision, DpRouterError> {
        self.expire(now_us);
        let mask = self.eligible(options.eligible)?;
        let req = self.request(tokens, options, now_us);
        let input = req.input_tokens;
        let accept = |r: usize| mask.as_ref().is_none_or(|m| m[r]);
        let ticket = dispatch_among(Arc::clone(&self.policy), &self.snap, &accept, req)?;
        let decision = Decision::of(&ticket.pick, input);
        if let Some(id) = options.request_id {
            self.hold(id, ticket, now_us);
        }
        Ok(decision)
    }

    /// The rank a pick would choose now, recording nothing (no ticket, no turn taken, nothing indexed).
    pub fn best_rank(
        &self,
        tokens: Vec<u32>,
        options: &PickOptions<'_>,
        now_us: u64,
    ) -> Result<Decision, DpRouterError> {
        let mask = self.eligible(options.eligible)?;
        let mut req = self.request(tokens, options, now_us);
        req.dry_run = true;
        let accept = |r: usize| mask.as_ref().is_none_or(|m| m[r]);
        let candidates = crate::policy::Candidates::accepting(&self.snap, &accept);
        // A named rank is only checked: the policy's `pinned` would record it.
        let pick = match req.rank_override {
            Some(rank) => crate::policy::override_pick(&self.snap, rank)?,
            None => crate::policy::decide(&*self.policy, &candidates, &req, &self.policy.prepare(&req))?,
        };
        Ok(Decision::of(&pick, req.input_tokens))
    }

    fn hold(&mut self, id: &str, ticket: Ticket<Arc<dyn Policy>>, now_us: u64) {
        self.serial += 1;
        let held = Held {
            ticket,
            at_us: now_us,
            serial: self.serial,
        };
        // The same id again: the earlier request is over as far as the router can tell.
        self.tickets.insert(id.to_owned(), held);
        self.order.push_back((self.serial, id.to_owned()));
        while self.tickets.len() > self.limits.max_tickets {
            self.drop_oldest();
        }
        // Entries of ids issued again or already finished: compacted once they outnumber the live ones.
        if self.order.len() > 2 * self.tickets.len() + 64 {
            let tickets = &self.tickets;
            self.order
                .retain(|(serial, id)| tickets.get(id).is_some_and(|h| h.serial == *serial));
        }
    }

    fn drop_oldest(&mut self) {
        while let Some((serial, id)) = self.order.pop_front() {
            if self.tickets.get(&id).is_some_and(|h| h.serial == serial) {
                self.tickets.remove(&id);
                return;
            }
        }
    }

    /// Drops the tickets older than the limit at `now_us`.
    fn expire(&mut self, now_us: u64) {
        while let Some((serial, id)) = self.order.front() {
            match self.tickets.get(id) {
                Some(h) if h.serial == *serial => {
                    if now_us.saturating_sub(h.at_us) <= self.limits.max_age_us {
                        return;
                    }
                    let id = id.clone();
                    self.tickets.remove(&id);
                }
                _ => {}
            }
            self.order.pop_front();
        }
    }

    /// The request's first token came at `now_us`: its queued-prefill share is released; with the engine's
    /// `usage` (vLLM reports its cached tokens with the first token), the policy learns what the rank had cached.
    /// `false` if the router holds no ticket by that id.
    pub fn first_token(&mut self, request_id: &str, now_us: u64, usage: Option<Usage>) -> bool {
        let Some(held) = self.tickets.get_mut(request_id) else {
            return false;
        };
        held.ticket.first_token(now_us);
        if let Some(usage) = usage {
            held.ticket.usage(usage);
        }
        true
    }

    /// The request finished: its load is released; with the engine's `usage`, unless an earlier call gave it, the
    /// policy learns what the rank had cached. `false` if the router holds no ticket by that id.
    pub fn finish(&mut self, request_id: &str, usage: Option<Usage>) -> bool {
        let Some(mut held) = self.tickets.remove(request_id) else {
            return false;
        };
        if let Some(usage) = usage {
            held.ticket.usage(usage);
        }
        true
    }

    /// The request ended without a report: its load is released. `false` if the router holds no ticket by that id.
    pub fn abort(&mut self, request_id: &str) -> bool {
        self.tickets.remove(request_id).is_some()
    }

    /// A rank's load, as the engine reports it; applied only when its timestamp is newer than the last one
    /// applied. Returns whether it was.
    pub fn report_load(&mut self, rank: i64, report: LoadReport) -> Result<bool, DpRouterError> {
        let rank = self.rank(rank)?;
        Ok(self.snap.load(rank).apply_report(EngineReport {
            requests: report.running.saturating_add(report.waiting),
            waiting: report.waiting,
            tokens: report.tokens,
            timestamp: report.timestamp,
            queued_prefill_tokens: report.waiting_tokens,
        }))
    }

    /// Marks a rank active or not (an inactive rank is never picked, and a request naming it is refused).
    pub fn set_active(&mut self, rank: i64, active: bool) -> Result<(), DpRouterError> {
        let rank = self.rank(rank)?;
        if self.snap.is_healthy(rank) != active {
            self.snap = self.snap.with_health(|r, e| if r == rank { active } else { e.healthy });
        }
        Ok(())
    }

    pub fn is_active(&self, rank: usize) -> bool {
        self.snap.is_healthy(rank)
    }

    /// Applies batch `seq` of a rank's KV events (its msgpack `payload`, as the engine publishes it) at `now_us`.
    pub fn apply_kv_events(
        &mut self,
        rank: i64,
        seq: u64,
        payload: &[u8],
        now_us: u64,
    ) -> Result<KvOutcome, DpRouterError> {
        let rank = self.rank(rank)?;
        let endpoint = EndpointId::new(0, rank as u32);
        let policy = &self.policy;
        Ok(self.feeds[rank]
            .receive_without_replay(seq, payload, |change| policy.engine_cache(endpoint, change, now_us)))
    }

    /// The endpoints, for tests and metrics.
    pub fn endpoints(&self) -> &[Endpoint] {
        self.snap.endpoints()
    }
}

/// SGLang's proposed `prefix_match` method on its own: the rank for `tokens` among `num_ranks`, every rank active.
pub fn prefix_match_rank(tokens: Vec<u32>, num_ranks: usize) -> Result<usize, DpRouterError> {
    if !(1..=MAX_RANKS).contains(&num_ranks) {
        return Err(DpRouterError::NumRanks(num_ranks));
    }
    let policy = crate::policy::PrefixMatch::new(crate::prefix_key::PrefixWindow::default());
    let snap = Snapshot::single_worker(num_ranks as u32);
    Ok(crate::policy::route(&policy, &snap, &RouteRequest::tokens(tokens))?.rank)
}

#[cfg(test)]
mod tests;
