//! `dynamo_kv`: NVIDIA Dynamo's KV router cost, ported from `ai-dynamo/dynamo`:
//! `lib/llm/src/kv_router/scheduler.rs` @ db19bd2a (`DefaultWorkerSelector`), `lib/llm/src/kv_router/sequence.rs`
//! @ 581ee33e (`ActiveSequences`), `lib/llm/src/kv_router/config.rs` @ 0435b58a (defaults), and the tie rule of
//! `lib/kv-router/src/scheduling/selector/default.rs` @ 07a6c9ce.
//!
//! For each worker: `logit = overlap_score_weight · prefill_blocks + decode_blocks`, lowest wins, where
//!
//! - `prefill_blocks = (isl − overlap · block + active_prefill_tokens) / block`: the request's uncached tokens plus
//!   those of the requests routed there whose first token has not come (fractional blocks);
//! - `decode_blocks = new_blocks + active_blocks`: the distinct prompt blocks of the requests in flight there (a
//!   prefix shared by several counts once), plus this request's blocks not among them.
//!
//! `overlap` is the worker's run of leading blocks in the router's index. Dynamo's default index follows the
//! engines' KV events; this port is its approximate mode (`--no-kv-events`, `use_kv_events = false`): the index
//! records the router's own decisions, each block held for `router_ttl_secs` (120 s) after it was last routed,
//! at most `router_max_tree_size` (2^20) entries, pruned to 80% of that, oldest first. A request's uncached tokens
//! count until its first token ([`crate::EndpointLoad::queued_prefill_tokens`], which the pick's prediction
//! feeds), its blocks until it ends ([`Policy::release`]). Exact ties (temperature 0) are broken uniformly at
//! random, as the current selector does (the older one took the smallest index first); here the draw is
//! deterministic.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::{block_hashes_of, draw};
use crate::endpoint::EndpointId;
use crate::error::RouteError;
use crate::hashing::PassThroughBuild;
use crate::policy::{Branch, Candidates, Ending, Pick, Policy, Prepared};
use crate::request::RouteRequest;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DynamoKvConfig {
    /// The engine's KV block size, tokens (vLLM's default, 16).
    pub block_tokens: usize,
    pub overlap_score_weight: f64,
    /// How long the approximate index holds a routed block, seconds.
    pub ttl_secs: f64,
    /// The most (block, worker) entries the index holds.
    pub max_tree_blocks: usize,
}

impl Default for DynamoKvConfig {
    fn default() -> Self {
        Self {
            block_tokens: 16,
            overlap_score_weight: 1.0,
            ttl_secs: 120.0,
            max_tree_blocks: 1 << 20,
        }
    }
}

/// Blocks routed to workers, each held until its expiry.
#[derive(Default)]
struct ApproxIndex {
    holders: HashMap<u64, Vec<(EndpointId, u64)>, PassThroughBuild>,
    /// Every record in the order made (so in expiry order): (expiry, block, worker). An entry refreshed since
    /// has a later expiry and is skipped when its old record comes up.
    order: VecDeque<(u64, u64, EndpointId)>,
    entries: usize,
}

impl ApproxIndex {
    /// Each worker's run of leading `hashes` held at `now`.
    fn overlaps(&self, hashes: &[u64], now: u64) -> HashMap<EndpointId, usize> {
        let mut runs: HashMap<EndpointId, usize> = HashMap::new();
        for (i, hash) in hashes.iter().enumerate() {
            let Some(holders) = self.holders.get(hash) else { break };
            let mut advanced = false;
            for &(worker, expiry) in holders {
                if expiry > now {
                    let run = runs.entry(worker).or_insert(0);
                    if *run == i {
                        *run += 1;
                        advanced = true;
                    }
                }
            }
            if !advanced {
                break;
            }
        }
        runs
    }

    fn record(&mut self, worker: EndpointId, hashes: &[u64], expiry: u64) {
        for &hash in hashes {
            let holders = self.holders.entry(hash).or_default();
            match holders.iter_mut().find(|(w, _)| *w == worker) {
                Some(held) => held.1 = expiry,
                None => {
                    holders.push((worker, expiry));
                    self.entries += 1;
                }
            }
            self.order.push_back((expiry, hash, worker));
        }
    }

    /// Drops what expired by `now`, then the oldest entries while more than `max` remain (down to 80% of it).
    fn prune(&mut self, now: u64, max: usize) {
        let target = if self.entries > max { max / 5 * 4 } else { usize::MAX };
        while let Some(&(expiry, hash, worker)) = self.order.front() {
            if expiry > now && self.entries <= target.min(max) {
                break;
            }
            self.order.pop_front();
            let Some(holders) = self.holders.get_mut(&hash) else {
                continue;
            };
            // Only the record that set the entry's current expiry removes it.
            if let Some(i) = holders.iter().position(|&(w, e)| w == worker && e == expiry) {
                holders.swap_remove(i);
                self.entries -= 1;
                if holders.is_empty() {
                    self.holders.remove(&hash);
                }
            }
        }
        // Refreshed entries leave their old records behind: once those outnumber the entries, they go.
        if self.order.len() > 2 * self.entries + 1024 {
            let holders = &self.holders;
            self.order
                .retain(|&(expiry, hash, worker)| holders.get(&hash).is_some_and(|h| h.contains(&(worker, expiry))));
        }
    }
}

#[derive(Default)]
struct State {
    index: ApproxIndex,
    /// Per worker: the prompt blocks of its requests in flight, with how many requests hold each.
    active: HashMap<EndpointId, HashMap<u64, u32, PassThroughBuild>>,
    draws: u64,
}

pub struct DynamoKv {
    config: DynamoKvConfig,
    state: Mutex<State>,
}

impl DynamoKv {
    pub fn new(config: DynamoKvConfig) -> Self {
        Self {
            config,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn let_go(&self, endpoint: EndpointId, prepared: &Prepared) {
        let mut state = self.lock();
        let Some(active) = state.active.get_mut(&endpoint) else {
            return;
        };
        for hash in &prepared.block_hashes {
            if let Some(n) = active.get_mut(hash) {
                *n -= 1;
                if *n == 0 {
                    active.remove(hash);
                }
            }
        }
    }
}

impl Policy for DynamoKv {
    fn name(&self) -> &'static str {
        "dynamo_kv"
    }

    fn prepare(&self, req: &RouteRequest) -> Prepared {
        Prepared {
            block_hashes: block_hashes_of(req, self.config.block_tokens),
        }
    }

    fn choose(&self, c: &Candidates<'_>, req: &RouteRequest, prepared: &Prepared) -> Result<Pick, RouteError> {
        let block = self.config.block_tokens as f64;
        let hashes = &prepared.block_hashes;
        let ttl_us = (self.config.ttl_secs * 1e6) as u64;
        let mut state = self.lock();
        state.index.prune(req.now_us, self.config.max_tree_blocks);
        let overlaps = state.index.overlaps(hashes, req.now_us);
        let snap = c.snap();
        let mut best: Vec<(usize, usize)> = Vec::new();
        let mut best_logit = f64::INFINITY;
        for rank in c.iter() {
            let endpoint = &snap.endpoints()[rank];
            let overlap = overlaps.get(&endpoint.id).copied().unwrap_or(0);
            let uncached = req
                .input_tokens
                .saturating_sub((overlap * self.config.block_tokens) as u64);
            let prefill_blocks = (uncached + endpoint.load.queued_prefill_tokens()) as f64 / block;
            let decode_blocks = match state.active.get(&endpoint.id) {
                Some(active) => active.len() + hashes.iter().filter(|h| !active.contains_key(h)).count(),
                None => hashes.len(),
            };
            let logit = self.config.overlap_score_weight * prefill_blocks + decode_blocks as f64;
            if logit < best_logit {
                best_logit = logit;
                best.clear();
            }
            if logit == best_logit {
                best.push((rank, overlap));
            }
        }
        let (rank, overlap) = draw(&best, &mut state.draws);
        let id = snap.endpoints()[rank].id;
        if !req.dry_run {
            state.index.record(id, hashes, req.now_us.saturating_add(ttl_us));
            let active = state.active.entry(id).or_default();
            for &hash in hashes {
                *active.entry(hash).or_insert(0) += 1;
            }
        }
        let uncached = req
            .input_tokens
            .saturating_sub((overlap * self.config.block_tokens) as u64);
        let branch = if overlap > 0 { Branch::Hit } else { Branch::LeastLoaded };
        Ok(Pick::new(rank, branch).with_prefill(uncached))
    }

    fn release(&self, endpoint: EndpointId, _req: &RouteRequest, prepared: &Prepared, pick: &Pick, _ending: Ending) {
        if pick.branch != Branch::Override {
            self.let_go(endpoint, prepared);
        }
    }

    fn retract(&self, endpoint: EndpointId, _req: &RouteRequest, prepared: &Prepared, pick: &Pick) {
        if pick.branch != Branch::Override {
            self.let_go(endpoint, prepared);
        }
    }
}

#[cfg(test)]
#[path = "dynamo_kv_tests.rs"]
mod tests;
