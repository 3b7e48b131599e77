//! `smg_cache_aware`: SMG's (the SGLang Model Gateway's, formerly sgl-router's) `cache_aware` policy, ported from
//! `sgl-project/sglang`: `sgl-model-gateway/src/policies/cache_aware.rs` @ b93974f1 (the version after PR #14650,
//! whose misses go to the least loaded worker), its tree (`sgl-router/src/policies/tree.rs` @ 4d40eec0, same
//! semantics in the gateway's), and the defaults its launcher passes (`sgl-model-gateway/src/main.rs` @ 01f6c92a,
//! `bindings/python/sglang_router/router_args.py` @ 61c660a3): `cache_threshold` 0.3, `balance_abs_threshold` 64,
//! `balance_rel_threshold` 1.5, eviction every 120 s to 2^26 units per worker.
//!
//! A worker's load is the requests this router has in flight there. When the fleet is imbalanced (the most loaded
//! worker has more than `balance_abs_threshold` requests above the least loaded, and more than
//! `balance_rel_threshold` times it; over every worker, up or down) the request goes to the least loaded healthy
//! one. Otherwise the prompt is matched in an approximate radix tree of what was routed where
//! ([`super::smg_tree`]): if more than `cache_threshold` of it matched, it goes to the tenant of the deepest node
//! reached, otherwise to the least loaded healthy worker (the first in rank order on ties, as that version does).
//! Either way the prompt is then recorded in the tree for the chosen worker. A matched tenant that is not a
//! candidate (down, or refused by a retry) sends the request to the first candidate unrecorded, as the source
//! falls back to its first healthy worker. Eviction runs at most every `eviction_interval_secs`, on the requests'
//! clock, at a decision. The source matches characters; this port matches token ids (a text prompt's bytes).

use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::smg_tree::Tree;
use crate::error::RouteError;
use crate::policy::{Branch, Candidates, Pick, Policy, Prepared};
use crate::request::{Prompt, RouteRequest};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SmgCacheAwareConfig {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u64,
    pub balance_rel_threshold: f64,
    pub eviction_interval_secs: f64,
    /// Units (tokens, or bytes of text) a worker may hold in the tree before eviction trims it.
    pub max_tree_size: usize,
}

impl Default for SmgCacheAwareConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_secs: 120.0,
            max_tree_size: 1 << 26,
        }
    }
}

struct State {
    tree: Tree,
    last_eviction_us: u64,
}

pub struct SmgCacheAware {
    config: SmgCacheAwareConfig,
    state: Mutex<State>,
}

impl SmgCacheAware {
    pub fn new(config: SmgCacheAwareConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State {
                tree: Tree::default(),
                last_eviction_us: 0,
            }),
        }
    }
}

/// The prompt as the tree's units.
fn units(prompt: &Prompt) -> std::borrow::Cow<'_, [u32]> {
    match prompt {
        Prompt::Tokens(t) => std::borrow::Cow::Borrowed(t),
        Prompt::Bytes(b) => std::borrow::Cow::Owned(b.iter().map(|&b| u32::from(b)).collect()),
    }
}

impl Policy for SmgCacheAware {
    fn name(&self) -> &'static str {
        "smg_cache_aware"
    }

    fn choose(&self, c: &Candidates<'_>, req: &RouteRequest, _prepared: &Prepared) -> Result<Pick, RouteError> {
        let snap = c.snap();
        let load = |rank: usize| snap.load(rank).in_flight_requests();
        let loads = (0..snap.len()).map(load);
        let (min, max) = loads.fold((u64::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        let imbalanced = max.saturating_sub(min) > self.config.balance_abs_threshold
            && max as f64 > min as f64 * self.config.balance_rel_threshold;
        let least_loaded = || c.iter().min_by_key(|&r| load(r)).ok_or(RouteError::NoHealthyEndpoint);
        let text = units(&req.prompt);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let interval_us = (self.config.eviction_interval_secs * 1e6) as u64;
        if interval_us > 0 && req.now_us.saturating_sub(state.last_eviction_us) >= interval_us {
            state.last_eviction_us = req.now_us;
            state.tree.evict(self.config.max_tree_size);
        }
        let (rank, branch) = if imbalanced {
            (least_loaded()?, Branch::Spill)
        } else {
            let (matched, tenant) = state.tree.prefix_match(&text, req.now_us);
            let rate = if text.is_empty() {
                0.0
            } else {
                matched as f64 / text.len() as f64
            };
            match tenant {
                Some(tenant) if rate > self.config.cache_threshold => {
                    match c.iter().find(|&r| snap.endpoints()[r].id == tenant) {
                        Some(rank) => (rank, Branch::Hit),
                        // The source's fallback: the first healthy worker, nothing recorded.
                        None => {
                            return c
                                .nth(0)
                                .map(|r| Pick::new(r, Branch::Fallback))
                                .ok_or(RouteError::NoHealthyEndpoint)
                        }
                    }
                }
                _ => (least_loaded()?, Branch::LeastLoaded),
            }
        };
        if !req.dry_run {
            state.tree.insert(&text, snap.endpoints()[rank].id, req.now_us);
        }
        Ok(Pick::new(rank, branch))
    }
}

#[cfg(test)]
#[path = "smg_cache_aware_tests.rs"]
mod tests;
