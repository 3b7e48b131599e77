//! `llm_d`: llm-d's default scheduling profile (the Gateway API Inference Extension's endpoint picker with its
//! default plugins), ported from `kubernetes-sigs/gateway-api-inference-extension`:
//! `pkg/epp/config/loader/defaults.go` @ 0c8fd519 (the profile: three scorers, weights 3 / 2 / 2, no filter, the
//! max-score picker), `pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go` @ 00913f92 and
//! `indexer.go` @ e7255c8f (the prefix scorer), `plugins/scorer/queue.go` and `kvcache_utilization.go` @ 02308be3,
//! `scheduler_profile.go` @ b41c483e (the weighted sum), `plugins/picker/max_score_picker.go` @ 02308be3. The llm-d
//! inference-scheduling guide deploys the same defaults (`guides/inference-scheduling/scheduler/
//! inference-scheduling.values.yaml` @ 086f217d, chart v1.4.0).
//!
//! Each candidate scores `3 · prefix + 2 · queue + 2 · kv`, highest wins:
//!
//! - **prefix**: the prompt's chained block hashes (blocks of 16 tokens, the source's 64 characters; at most the
//!   first 256 blocks) matched against an index of what was routed where: a candidate's leading blocks held,
//!   over the prompt's blocks (0 for a prompt shorter than a block). The index records a prompt's blocks for
//!   the chosen endpoint as soon as it is chosen (the plugin's `PreRequest`), in an LRU of 31,250 blocks per
//!   endpoint.
//! - **queue**: `(max − q) / (max − min)` of the candidates' waiting requests as their engines last reported them
//!   (`num_requests_waiting`), 1 for all when they are equal.
//! - **kv**: `1 − KV usage`, the engine's last reported KV tokens over its capacity (0 usage without either).
//!
//! Exact ties are broken uniformly at random (the picker shuffles before sorting); here the draw is
//! deterministic. Departures: the index counts a candidate's *leading* blocks (the source counts every block it
//! holds until no endpoint holds one, which differs only when an endpoint lost an early block and kept a later
//! one), and its LRU touches a prompt's first block last (the source's, its last).

use std::collections::HashMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::{block_hashes_of, draw};
use crate::block_index::BlockIndex;
use crate::endpoint::EndpointId;
use crate::error::RouteError;
use crate::policy::{Branch, Candidates, Pick, Policy, Prepared};
use crate::request::RouteRequest;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LlmDConfig {
    /// Tokens per hashed block (the source's 64 characters at 4 per token).
    pub block_tokens: usize,
    /// Only the prompt's first blocks are matched (`maxPrefixBlocksToMatch`).
    pub max_prefix_blocks: usize,
    /// Blocks the index keeps per endpoint (`lruCapacityPerServer`).
    pub lru_capacity_per_server: usize,
    pub prefix_weight: f64,
    pub queue_weight: f64,
    pub kv_weight: f64,
}

impl Default for LlmDConfig {
    fn default() -> Self {
        Self {
            block_tokens: 16,
            max_prefix_blocks: 256,
            lru_capacity_per_server: 31_250,
            prefix_weight: 3.0,
            queue_weight: 2.0,
            kv_weight: 2.0,
        }
    }
}

#[derive(Default)]
struct State {
    index: BlockIndex,
    slots: HashMap<EndpointId, usize>,
    draws: u64,
}

pub struct LlmD {
    config: LlmDConfig,
    state: Mutex<State>,
}

impl LlmD {
    pub fn new(config: LlmDConfig) -> Self {
        Self {
            config,
            state: Mutex::default(),
        }
    }
}

impl Policy for LlmD {
    fn name(&self) -> &'static str {
        "llm_d"
    }

    fn prepare(&self, req: &RouteRequest) -> Prepared {
        let mut block_hashes = block_hashes_of(req, self.config.block_tokens);
        block_hashes.truncate(self.config.max_prefix_blocks);
        Prepared { block_hashes }
    }

    fn choose(&self, c: &Candidates<'_>, req: &RouteRequest, prepared: &Prepared) -> Result<Pick, RouteError> {
        let hashes = &prepared.block_hashes;
        let snap = c.snap();
        let mut state = self.lock();
        let mut lens = vec![0u32; state.index.slot_count()];
        state.index.match_lengths(hashes, &mut lens);
        // Each candidate's waiting requests, read once: a report arriving meanwhile cannot put one past the max.
        let waiting: Vec<u64> = c
            .iter()
            .map(|rank| snap.load(rank).last_report().map_or(0, |r| r.waiting))
            .collect();
        let (min_q, max_q) = waiting
            .iter()
            .fold((u64::MAX, 0), |(lo, hi), &q| (lo.min(q), hi.max(q)));
        let mut best: Vec<(usize, u32)> = Vec::new();
        let mut best_score = f64::NEG_INFINITY;
        for (i, rank) in c.iter().enumerate() {
            let endpoint = &snap.endpoints()[rank];
            let matched = state.slots.get(&endpoint.id).map_or(0, |&s| lens[s]);
            let prefix = if hashes.is_empty() {
                0.0
            } else {
                f64::from(matched) / hashes.len() as f64
            };
            let queue = if max_q == min_q {
                1.0
            } else {
                (max_q - waiting[i]) as f64 / (max_q - min_q) as f64
            };
            let usage = match (endpoint.load.last_report(), endpoint.kv_capacity) {
                (Some(report), Some(capacity)) if capacity > 0 => (report.tokens as f64 / capacity as f64).min(1.0),
                _ => 0.0,
            };
            let score = self.config.prefix_weight * prefix
                + self.config.queue_weight * queue
                + self.config.kv_weight * (1.0 - usage);
            if score > best_score {
                best_score = score;
                best.clear();
            }
            if score == best_score {
                best.push((rank, matched));
            }
        }
        let (rank, matched) = draw(&best, &mut state.draws);
        if !req.dry_run {
            let id = snap.endpoints()[rank].id;
            let capacity = self.config.lru_capacity_per_server;
            let next = state.index.slot_count();
            let slot = *state.slots.entry(id).or_insert(next);
            if slot == next {
                state.index.add_slot(capacity);
            }
            state.index.record(slot, hashes);
        }
        let branch = if matched > 0 { Branch::Hit } else { Branch::LeastLoaded };
        Ok(Pick::new(rank, branch))
    }
}

impl LlmD {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
#[path = "llm_d_tests.rs"]
mod tests;
