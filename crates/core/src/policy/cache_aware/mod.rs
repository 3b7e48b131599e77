//! `cache_aware`: the endpoint with the lowest predicted time to first token, from an index of which endpoint
//! recently received which prompt blocks.
//!
//! Algorithm, per request:
//! 1. Hash the prompt's whole blocks, chained ([`crate::hashing::block_hashes`]; `block_tokens` tokens, or
//!    `4 · block_tokens` bytes of a text prompt), once per request ([`Policy::prepare`]; the request's ticket
//!    keeps them for its retries and feedback).
//! 2. Look the blocks up in the [`BlockIndex`]: for every endpoint, how many leading blocks it holds, so how many
//!    prompt tokens it has cached (`cached`, at most the prompt length − 1: the engine recomputes the last token).
//! 3. For every healthy endpoint predict
//!    `TTFT = base · (queued + 1) + (queued_tokens + prompt − cached) / prefill_rate − done`, with `queued` and
//!    `queued_tokens` the endpoint's requests waiting for their first token and their predicted uncached tokens
//!    (the load model's queued prefill, [`crate::load`]); `base` is paid per prefill, as on an engine that prefills
//!    one request at a time. `done` is the part of the queue already prefilled: the time the oldest queued request
//!    has been prefilling ([`EndpointLoad::prefill_elapsed_us`](crate::load::EndpointLoad::prefill_elapsed_us) at
//!    the request's `now_us`), at most one queued request's mean share of the queue (an engine slower than
//!    predicted cannot make a queue look empty; `prefill_progress = false` leaves it out). Without it a request
//!    arriving seconds into a long prefill would count that prefill whole and go cold elsewhere when waiting for
//!    the prefix is quicker. Take the lowest `TTFT + congestion_weight · queued · own`, where `own` is this
//!    request's own prefill time there (`(prompt − cached) / prefill_rate`): recomputing a prefix on a busy
//!    endpoint also delays the requests that will queue behind it there, about as many as queue there now.
//!    Without that term (`congestion_weight = 0`) a busy fleet spreads every request to the shortest queue,
//!    recomputes prefixes it already holds, and the extra work makes the queues longer still. The term counts the
//!    candidate's own queue, not the fleet's: an idle endpoint delays nobody, so a burst on one hot prefix still
//!    spreads to idle endpoints (both choices are measured in `docs/measurements.md`, "Choices measured"). Add
//!    `eviction_weight` times the prefill time of the blocks of other prompts this request would make the
//!    endpoint forget (what the index would hold there beyond its capacity, less what it holds beyond it already:
//!    in precise mode the index also holds the requests still queued there, which evict whatever this choice is):
//!    they cost that again if asked for. When the endpoints' prefills share compute (`prefill_contention`,
//!    [`contention`]), TTFT also grows by that share of the time it overlaps the prefill work queued at the other
//!    endpoints. Ties go to
//!    the longer match, then endpoints within their share of recent requests ([`recent`]), then the fewer requests
//!    in flight, then the fewer blocks to forget, then the higher rendezvous score of the prompt's first block (or
//!    of the client's session hint, [`RouteRequest::session`]). So a prompt that no endpoint holds (branch `cold`)
//!    goes to the least loaded endpoints with room for it, by rendezvous among them: two sessions on engines that
//!    each hold one prompt (a llama.cpp slot) split instead of evicting each other, and replicas agree on cold
//!    placements of an idle fleet with room.
//!    Cache affinity and load balance come from one cost, with no hit or miss thresholds. The choice is greedy,
//!    per request: sessions that arrive one by one on a warm prefix gather on its endpoint
//!    (`docs/measurements.md`, "Agents that arrive apart"), unless `session_turns` is set: then the cost also
//!    counts the delay the conversation's remaining turns and the endpoint's other conversations would cause each
//!    other there (module `conversations`). An active named session ([`RouteRequest::session`]) goes to the
//!    endpoint of its last request instead (branch `session`, [`SessionHomes`]) while that endpoint's cost is within
//!    `session_home_margin_ms` of the lowest: its home may hold what the index does not see, by that much at most.
//! 4. Record the prompt's blocks for the chosen endpoint, under the same lock as the look-up (a rank override:
//!    [`Policy::pinned`]); each endpoint forgets its least recently used blocks beyond its KV capacity
//!    ([`Endpoint::kv_capacity`](crate::endpoint::Endpoint::kv_capacity), else `kv_capacity_tokens`). A request
//!    whose connection was refused and that is routed again ([`Policy::retract`]) is forgotten at the endpoint
//!    that never got it, past what the endpoint held before.
//! 5. [`Policy::observe`]: when the engine reports it held fewer cached tokens than the pick predicted, the
//!    prediction was refuted: the endpoint keeps less of the prompts the index sees than its capacity says (a
//!    llama.cpp slot holds one prompt; engines also cache answers; a capacity set too high). The refutation bounds
//!    the capacity the index uses for that endpoint, and confirmed predictions let it grow back ([`learned`];
//!    `correct_on_feedback`). The prompt's own blocks stay: the engine holds them once it has prefilled them.
//!
//! Branches: `hit` (the chosen endpoint holds the longest match), `spill` (a shorter match cost less: an earlier
//! first token), `cold` (no endpoint holds any block), `empty` (no prompt: round-robin turn).
//!
//! State: the index is keyed by stable [`EndpointId`]s through slots; the rank-to-slot table and capacities are
//! rebuilt when the snapshot's generation changes, never per request; endpoints that left the snapshot are
//! forgotten then. One `std::sync::Mutex` guards it, taken once per decision (look-up, choice and record) and
//! once per correction, never while hashing. Cost per request: O(prompt) hashing, O(blocks × holders) look-ups, O(healthy endpoints) to compare
//! predictions; memory O(Σ capacity in blocks), ~62 bytes a block, see [`CacheAware::index_stats`].
//!
//! Precise mode ([`events`]): an endpoint whose engine publishes its KV events has its index entries from them,
//! what the engine says it holds, with its own decisions as short-lived entries until the events confirm them.
//!
//! References: SGLang's router `cache_aware` policy (an approximate radix tree per worker, with balance
//! thresholds); Mooncake's KVCache-centric scheduler (FAST'25), which also picks the prefill instance by predicted
//! TTFT from prefix-match length and queue.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use crate::block_index::BlockIndex;
use crate::endpoint::{EndpointId, Snapshot};
use crate::error::RouteError;
use crate::hashing::{block_hashes, prefix_hash, rendezvous_score};
use crate::policy::session_homes::{SessionHomes, SESSION_CAPACITY};
use crate::policy::{Branch, Candidates, Ending, Matched, Pick, Policy, Prepared, RoundRobin};
use crate::request::{Prompt, RouteRequest, BYTES_PER_TOKEN};

pub use config::CacheAwareConfig;

mod config;
mod contention;
mod conversations;
mod costs;
mod events;
mod learned;
mod pauses;
mod recent;

/// The index's size, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// (block, endpoint) pairs held.
    pub blocks: usize,
    /// The most the index may hold: the sum of the endpoints' capacities in blocks.
    pub capacity_blocks: usize,
    /// Heap bytes allocated.
    pub bytes: usize,
}

#[derive(Debug, Default)]
struct State {
    index: BlockIndex,
    slots: HashMap<EndpointId, usize>,
    /// The snapshot generation `slot_of_rank` was built for.
    generation: Option<u64>,
    /// The newest generation seen: capacities and membership follow it alone.
    newest: u64,
    slot_of_rank: Vec<usize>,
    /// Precise mode's bookkeeping, per slot.
    events: events::EventState,
    /// Capacities learned from refuted predictions, per slot.
    learned: learned::Learned,
    /// Each slot's given capacity, in blocks (the engine's, or `kv_capacity_tokens`; precise mode's).
    given: Vec<usize>,
    /// Requests sent to each slot recently.
    recent: recent::Recent,
    /// The conversations followed, when `session_turns` is set.
    conversations: conversations::Conversations,
    /// Where the active sessions went last (`session_ttl_ms`).
    homes: SessionHomes,
    /// The sessions paused for a tool, per slot (`pause_weight`).
    pauses: pauses::Pauses,
}

impl State {
    /// A new, empty slot for `endpoint`, of `capacity` blocks.
    fn add_slot(&mut self, endpoint: EndpointId, capacity: usize) -> usize {
        let slot = self.index.add_slot(capacity);
        self.slots.insert(endpoint, slot);
        self.given.push(capacity);
        slot
    }
}

#[derive(Debug)]
pub struct CacheAware {
    config: CacheAwareConfig,
    state: Mutex<State>,
    empty: RoundRobin,
}

impl Default for CacheAware {
    fn default() -> Self {
        Self::new(CacheAwareConfig::default())
    }
}

impl CacheAware {
    pub fn new(config: CacheAwareConfig) -> Self {
        let state = State {
            homes: SessionHomes::new(config.session_ttl_ms.saturating_mul(1000), SESSION_CAPACITY),
            ..State::default()
        };
        Self {
            config,
            state: Mutex::new(state),
            empty: RoundRobin::default(),
        }
    }

    pub fn config(&self) -> &CacheAwareConfig {
        &self.config
    }

    /// Units (tokens or bytes) per block of this prompt's kind.
    fn block_units(&self, prompt: &Prompt) -> usize {
        let tokens = self.config.block_tokens.max(1);
        match prompt {
            Prompt::Tokens(_) => tokens,
            Prompt::Bytes(_) => tokens * BYTES_PER_TOKEN as usize,
        }
    }

    fn hashes(&self, prompt: &Prompt) -> Vec<u64> {
        let mut out = Vec::with_capacity(prompt.len() / self.block_units(prompt));
        block_hashes(prompt, self.block_units(prompt), &mut out);
        out
    }

    /// Cached tokens of `req` (of block hashes `hashes`) at `slot`, whose index holds `blocks` of its leading
    /// blocks; in precise mode, also the tokens of the next block its engine holds, in whole engine pages. Never
    /// the prompt's last token, which an engine always computes.
    fn cached_tokens(&self, state: &State, slot: usize, req: &RouteRequest, hashes: &[u64], blocks: usize) -> u64 {
        let units = (blocks * self.block_units(&req.prompt)) as u64;
        let tokens = match &req.prompt {
            Prompt::Tokens(t) => {
                let seed = blocks.checked_sub(1).map_or(0, |last| hashes[last]);
                let rest = t.get(units as usize..).unwrap_or_default();
                units + state.events.tail_tokens(slot, seed, rest) as u64
            }
            Prompt::Bytes(_) => units / BYTES_PER_TOKEN,
        };
        let page = state.events.page(slot);
        tokens.min(req.input_tokens.saturating_sub(1)) / page * page
    }

    /// The predicted TTFT in microseconds of `uncached` new tokens behind `queued` requests of `queued_tokens`,
    /// the oldest of which has been prefilling for `elapsed_us`, at the configured costs.
    pub fn predicted_ttft_us(&self, queued: u64, queued_tokens: u64, elapsed_us: u64, uncached: u64) -> u64 {
        Self::predicted_ttft_at(self.configured_costs(), queued, queued_tokens, elapsed_us, uncached)
    }

    /// [`CacheAware::predicted_ttft_us`] at `costs`.
    fn predicted_ttft_at(costs: costs::Costs, queued: u64, queued_tokens: u64, elapsed_us: u64, uncached: u64) -> u64 {
        let queue = costs.prefill_us(queued, queued_tokens);
        let done = queue.checked_div(queued).map_or(0, |share| elapsed_us.min(share));
        queue - done + costs.prefill_us(1, uncached)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Brings the slot table in line with `snap` (only when its generation changed). Capacities and membership
    /// (forgetting endpoints that left) follow only a snapshot at least as new as any seen, so a request still
    /// routing with an older snapshot remaps ranks but never drops what a newer membership holds.
    fn sync(&self, state: &mut State, snap: &Snapshot) {
        if state.generation == Some(snap.generation()) {
            return;
        }
        let current = snap.generation() >= state.newest;
        let block = self.config.block_tokens.max(1) as u64;
        let mut present = vec![false; state.index.slot_count()];
        state.slot_of_rank.clear();
        for e in snap.endpoints() {
            let capacity = (e.kv_capacity.unwrap_or(self.config.kv_capacity_tokens) / block) as usize;
            let slot = match state.slots.get(&e.id) {
                Some(&slot) => {
                    if current {
                        let capacity = state.events.capacity(slot, capacity);
                        state.given[slot] = capacity;
                        let capacity = state.learned.capacity(slot, capacity);
                        state.index.set_capacity(slot, capacity);
                    }
                    slot
                }
                None => {
                    let slot = state.add_slot(e.id, capacity);
                    present.push(false);
                    slot
                }
            };
            present[slot] = true;
            state.slot_of_rank.push(slot);
        }
        if current {
            for (slot, here) in present.into_iter().enumerate() {
                if !here {
                    state.index.clear_slot(slot);
                    state.learned.reset(slot);
                    state.recent.reset(slot);
                    state.conversations.reset(slot);
                    state.pauses.reset(slot);
                }
            }
            state.newest = snap.generation();
        }
        state.generation = Some(snap.generation());
    }

    /// The index's current size.
    pub fn index_stats(&self) -> IndexStats {
        let state = self.lock();
        IndexStats {
            blocks: state.index.len(),
            capacity_blocks: (0..state.index.slot_count()).map(|s| state.index.capacity(s)).sum(),
            bytes: state.index.memory_bytes(),
        }
    }

    /// Cached tokens of `req` the index expects at each endpoint of `snap`, by global rank (for tests and tools).
    pub fn predicted_cached(&self, snap: &Snapshot, req: &RouteRequest) -> Vec<u64> {
        let hashes = self.hashes(&req.prompt);
        let mut state = self.lock();
        self.sync(&mut state, snap);
        let mut lens = vec![0u32; state.index.slot_count()];
        state.index.match_lengths(&hashes, &mut lens);
        state
            .slot_of_rank
            .iter()
            .map(|&s| self.cached_tokens(&state, s, req, &hashes, lens[s] as usize))
            .collect()
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn prepare(&self, req: &RouteRequest) -> Prepared {
        let mut block_hashes = self.hashes(&req.prompt);
        if req.namespace.is_some() {
            for h in &mut block_hashes {
                *h = crate::hashing::namespaced(*h, req.namespace);
            }
        }
        Prepared { block_hashes }
    }

    fn choose(&self, c: &Candidates<'_>, req: &RouteRequest, prepared: &Prepared) -> Result<Pick, RouteError> {
        if req.prompt.is_empty() {
            return self.empty.next(c, req, Branch::Empty);
        }
        let snap = c.snap();
        let hashes = &prepared.block_hashes;
        // Cold placements by the session hint when there is one: a session's requests stay together even before
        // the index holds any of them (prompts shorter than a block), and sessions spread over the endpoints.
        let key = req.session.unwrap_or_else(|| {
            hashes
                .first()
                .copied()
                .unwrap_or_else(|| crate::hashing::namespaced(prefix_hash(&req.prompt, usize::MAX), req.namespace))
        });
        // One lock for the look-up, the choice and the record of where the prompt went.
        let mut state = self.lock();
        self.sync(&mut state, snap);
        state.expire_unconfirmed(req.now_us);
        let mut lens = vec![0u32; state.index.slot_count()];
        state.index.match_lengths(hashes, &mut lens);
        // Each endpoint's prefill costs, by rank (learned or configured).
        let costs = self.costs_by_rank(snap);
        // This request resumes its session if it was paused for a tool; the others paused where it may go.
        if !req.dry_run {
            state.pauses.resume(req.session, hashes, req.now_us);
        }
        let paused = self.pause_costs(&mut state, c, &lens, hashes.len(), &costs, req.now_us);
        let blocks_at = |r: usize| lens[state.slot_of_rank[r]] as usize;
        // Blocks of other prompts the endpoint's cache would have to drop to take this one's new blocks: beyond its
        // capacity, less what it is beyond it already (in precise mode the index also holds the blocks of requests
        // still queued there, which the engine will store whatever this choice is).
        let evicted_at = |r: usize, blocks: usize| {
            let slot = state.slot_of_rank[r];
            let capacity = state.events.engine_capacity(slot, state.index.capacity(slot));
            let held = state.index.slot_len(slot);
            (held + hashes.len() - blocks).saturating_sub(capacity) - held.saturating_sub(capacity)
        };
        let best_match = c.iter().map(blocks_at).max().unwrap_or(0);
        let half_life_us = self.config.recent_half_life_s * 1e6;
        let block = self.config.block_tokens as u64;
        // Each candidate's recent count, in candidate order (one decay each).
        let recents: Vec<f64> = c
            .iter()
            .map(|r| state.recent.count(state.slot_of_rank[r], req.now_us, half_life_us))
            .collect();
        let mean_recent = recents.iter().sum::<f64>() / recents.len().max(1) as f64;
        let progress_at = |r: usize| {
            let load = snap.load(r);
            match self.config.prefill_progress {
                true => load.prefill_elapsed_us(req.now_us),
                false => 0,
            }
        };
        // Each endpoint's queued prefill work, when prefills contend across endpoints.
        let queued_work = |r: usize| {
            let load = snap.load(r);
            Self::predicted_ttft_at(
                costs[r],
                load.queued_prefill_requests(),
                load.queued_prefill_tokens(),
                progress_at(r),
                0,
            )
            .saturating_sub(costs[r].prefill_us(1, 0))
        };
        let contention = self.config.prefill_contention;
        let overlap = match contention > 0.0 {
            true => contention::Overlap::new(c.iter().map(queued_work).collect()),
            false => contention::Overlap::default(),
        };
        // Each candidate's uncached prompt tokens, in candidate order.
        let uncached_at: Vec<u64> = c
            .iter()
            .map(|r| req.input_tokens - self.cached_tokens(&state, state.slot_of_rank[r], req, hashes, blocks_at(r)))
            .collect();
        // The conversation this request continues, its remaining turns, and one warm turn's prefill.
        let sessions = self.config.session_turns;
        let continued = (sessions > 0).then(|| state.conversations.continued(hashes)).flatten();
        let own = continued.map(|(end, _)| end);
        let remaining = match sessions {
            0 => 0.0,
            _ => {
                let made = continued.map_or(0, |(_, c)| c.turns) + 1;
                state.conversations.remaining_turns(sessions, made)
            }
        };
        // One warm turn's prefill: the fewest uncached tokens, at that candidate's costs.
        let warm_turn = match remaining > 0.0 {
            false => 0,
            true => c
                .iter()
                .zip(&uncached_at)
                .min_by_key(|&(_, &uncached)| uncached)
                .map_or(0, |(r, &uncached)| costs[r].prefill_us(1, uncached)),
        };
        // The other conversations' summed pace at each candidate; when prefills contend, a share of those
        // elsewhere too.
        let mut loads: Vec<f64> = match remaining > 0.0 {
            false => Vec::new(),
            true => c
                .iter()
                .map(|r| state.conversations.load(state.slot_of_rank[r], own, req.now_us))
                .collect(),
        };
        if contention > 0.0 {
            let total: f64 = loads.iter().sum();
            loads.iter_mut().for_each(|l| *l += contention * (total - *l));
        }
        let scored = c
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let blocks = blocks_at(r);
                let load = snap.load(r);
                let uncached = uncached_at[i];
                let mut ttft = Self::predicted_ttft_at(
                    costs[r],
                    load.queued_prefill_requests(),
                    load.queued_prefill_tokens(),
                    progress_at(r),
                    uncached,
                );
                if contention > 0.0 {
                    // Work queued elsewhere slows this endpoint's queue and prefill while they overlap.
                    ttft += (contention * overlap.with_others(ttft, queued_work(r)) as f64) as u64;
                }
                let own_prefill = costs[r].prefill_us(0, uncached);
                let congestion = self.config.congestion_weight.max(0.0) * load.queued_prefill_requests() as f64;
                let evicted = evicted_at(r, blocks);
                let eviction = self.config.eviction_weight * costs[r].prefill_us(0, evicted as u64 * block) as f64;
                let sharing = loads.get(i).map_or(0.0, |load| remaining * load * warm_turn as f64);
                let cost = ttft
                    .saturating_add((congestion * own_prefill as f64) as u64)
                    .saturating_add(eviction as u64)
                    .saturating_add(paused.get(i).copied().unwrap_or(0))
                    .saturating_add(sharing as u64);
                // A session's cold requests go where its earlier ones did (the rendezvous below), not by count.
                let recent = match req.session {
                    Some(_) => 0.0,
                    None => recents[i],
                };
                let over_bound = recent + 1.0 > (1.0 + self.config.recent_epsilon) * (mean_recent + 1.0);
                let order = (
                    cost,
                    std::cmp::Reverse(blocks),
                    over_bound,
                    load.in_flight_requests(),
                    evicted,
                    std::cmp::Reverse(rendezvous_score(key, snap.endpoints()[r].id)),
                );
                (order, (r, blocks, uncached))
            })
            .collect::<Vec<_>>();
        let tolerance_us = (self.config.cold_tolerance_ms.max(0.0) * 1000.0) as u64;
        let lowest = scored.iter().map(|(order, _)| order.0).min().unwrap_or(0);
        // An active session goes home while its endpoint is routable and predicted within the margin of the best.
        let margin_us = (self.config.session_home_margin_ms.max(0.0) * 1000.0) as u64;
        let home = req
            .session
            .and_then(|session| state.homes.home(session, req.now_us))
            .and_then(|home| scored.iter().find(|(_, (r, _, _))| snap.endpoints()[*r].id == home))
            .filter(|(order, _)| order.0 <= lowest.saturating_add(margin_us))
            .map(|(_, chosen)| *chosen);
        let (rank, blocks, uncached) = match best_match == 0 && tolerance_us > 0 {
            _ if home.is_some() => home,
            // A prompt nobody holds: the rendezvous choice among the endpoints predicted within the tolerance.
            true => scored
                .iter()
                .filter(|(order, _)| order.0 <= lowest.saturating_add(tolerance_us))
                .min_by_key(|(order, _)| order.5)
                .map(|(_, chosen)| *chosen),
            false => scored.iter().min_by_key(|(order, _)| *order).map(|(_, chosen)| *chosen),
        }
        .ok_or(RouteError::NoHealthyEndpoint)?;
        let slot = state.slot_of_rank[rank];
        let branch = match (best_match, blocks) {
            _ if home.is_some() => Branch::Session,
            (0, _) => Branch::Cold,
            (best, got) if got == best => Branch::Hit,
            _ => Branch::Spill,
        };
        if req.dry_run {
            return Ok(Pick::new(rank, branch).with_prefill(uncached));
        }
        state.recent.record(slot, req.now_us, half_life_us);
        if let Some(session) = req.session {
            state.homes.record(session, snap.endpoints()[rank].id, req.now_us);
        }
        if sessions > 0 {
            let service = costs[rank].prefill_us(1, uncached);
            let idle = half_life_us as u64;
            state
                .conversations
                .record(slot, hashes, continued, service, req.now_us, idle);
        }
        // How long ago the endpoint got the deepest block it holds, before this request makes it the newest.
        let matched = (blocks > 0)
            .then(|| state.index.age(slot, hashes[blocks - 1]))
            .flatten()
            .map(|age| Matched {
                blocks,
                age: age as usize,
                in_flight: snap.load(rank).in_flight_requests(),
            });
        if !hashes.is_empty() {
            state.index.record(slot, hashes);
            state.provisional(slot, hashes, req.now_us + self.config.event_grace_ms * 1000);
        }
        Ok(Pick::new(rank, branch).with_prefill(uncached).with_matched(matched))
    }

    fn most_cached(&self, c: &Candidates<'_>, req: &RouteRequest, prepared: &Prepared) -> Option<(usize, u64)> {
        let snap = c.snap();
        let hashes = &prepared.block_hashes;
        let mut state = self.lock();
        self.sync(&mut state, snap);
        let mut lens = vec![0u32; state.index.slot_count()];
        state.index.match_lengths(hashes, &mut lens);
        c.iter()
            .map(|r| {
                let slot = state.slot_of_rank[r];
                (r, self.cached_tokens(&state, slot, req, hashes, lens[slot] as usize))
            })
            .filter(|&(_, cached)| cached > 0)
            .min_by_key(|&(r, cached)| (std::cmp::Reverse(cached), snap.load(r).queued_prefill_requests(), r))
    }

    fn sessions_by_rank(&self, snap: &Snapshot, now_us: u64) -> Option<Vec<usize>> {
        let state = self.lock();
        Some(snap.endpoints().iter().map(|e| state.homes.at(e.id, now_us)).collect())
    }

    fn pinned(&self, snap: &Snapshot, req: &RouteRequest, prepared: &Prepared, pick: &Pick) {
        let mut state = self.lock();
        self.sync(&mut state, snap);
        if let Some(&slot) = state.slot_of_rank.get(pick.rank) {
            state
                .recent
                .record(slot, req.now_us, self.config.recent_half_life_s * 1e6);
        }
        if let Some(&slot) = state
            .slot_of_rank
            .get(pick.rank)
            .filter(|_| !prepared.block_hashes.is_empty())
        {
            state.index.record(slot, &prepared.block_hashes);
            let expires = req.now_us + self.config.event_grace_ms * 1000;
            state.provisional(slot, &prepared.block_hashes, expires);
        }
    }

    fn observe(&self, endpoint: EndpointId, req: &RouteRequest, prepared: &Prepared, pick: &Pick, cached_tokens: u64) {
        let (Some(matched), Some(prefill)) = (pick.matched, pick.prefill_tokens) else {
            return;
        };
        if self.config.correct_on_feedback {
            let refuted = cached_tokens < req.input_tokens.saturating_sub(prefill);
            self.learn(endpoint, req, prepared, matched, refuted.then_some(cached_tokens));
        }
    }

    fn engine_cache(&self, endpoint: EndpointId, change: &crate::engine_blocks::CacheChange, now_us: u64) {
        self.apply_engine_cache(endpoint, change, now_us);
    }

    fn release(&self, endpoint: EndpointId, req: &RouteRequest, prepared: &Prepared, _pick: &Pick, ending: Ending) {
        self.ended(endpoint, req, &prepared.block_hashes, ending);
    }

    fn retract(&self, endpoint: EndpointId, req: &RouteRequest, prepared: &Prepared, pick: &Pick) {
        // What the endpoint held before this request: the pick's prediction (an override predicts nothing, so
        // the whole prompt is forgotten there).
        let held = pick
            .prefill_tokens
            .map_or(0, |prefill| req.input_tokens.saturating_sub(prefill));
        self.forget_past(endpoint, req, prepared, held);
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod capacity_tests;
