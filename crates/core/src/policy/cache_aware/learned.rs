//! Capacities learned from the engines' reports, for endpoints whose KV capacity the index only assumes.
//!
//! The index forgets an endpoint's least recently used blocks at the capacity it is given (the engine's report, or
//! `kv_capacity_tokens`). When that is larger than what the engine keeps of the prompts the index sees (a
//! llama.cpp slot holds one prompt; an engine also caches the answers it generated, which the index never sees),
//! the index believes prompts the engine has evicted, and a policy that trusts it sends sessions where they will
//! miss, request after request. So each refuted prediction bounds the capacity: the engine no longer held the
//! first block of the prompt that it lacked, so since that block was last recorded there it stored at least its
//! capacity of other blocks, and the index counts those ([`BlockIndex::age`](crate::block_index::BlockIndex::age)).
//! The decision keeps the age of the deepest block it matched; every record of that block recorded the shallower
//! ones after it (a prompt's blocks are recorded last to first), so the first missing block, `k` blocks
//! shallower, is at most that age less `k`. (From the first block's age instead, a block every prompt shares
//! would bound the capacity far too low.)
//! The learned capacity drops to that bound (never below the prompt itself, which the engine holds once it has
//! prefilled it) and grows back by an eighth on each confirmed prediction, up to the given capacity: a bound taken
//! in a burst of evictions (an engine flushed or restarted) does not stay.
//!
//! Not for endpoints in precise mode: their index is what the engine's events say it holds.

use crate::endpoint::EndpointId;
use crate::policy::{Matched, Prepared};
use crate::request::{Prompt, RouteRequest, BYTES_PER_TOKEN};

use super::CacheAware;

impl CacheAware {
    /// Learns from the engine's report whether `endpoint` kept what the index predicted: `refuted` is what it held
    /// instead, when less.
    pub(super) fn learn(
        &self,
        endpoint: EndpointId,
        req: &RouteRequest,
        prepared: &Prepared,
        matched: Matched,
        refuted: Option<u64>,
    ) {
        let mut state = self.lock();
        let Some(&slot) = state.slots.get(&endpoint) else {
            return;
        };
        // Precise mode: the events say what the engine holds.
        if state.events.is_tracked(slot) {
            return;
        }
        let given = state.given[slot];
        let capacity = match refuted {
            Some(cached) => {
                let (held, prompt) = (self.blocks_of(req, cached), prepared.block_hashes.len());
                state.learned.refuted(slot, given, matched, held, prompt)
            }
            None => state.learned.confirmed(slot, given),
        };
        if capacity != state.index.capacity(slot) {
            state.index.set_capacity(slot, capacity);
        }
    }
}

impl CacheAware {
    /// Whole index blocks in `tokens` of `req`'s prompt.
    pub(super) fn blocks_of(&self, req: &RouteRequest, tokens: u64) -> usize {
        let units_per_token = match req.prompt {
            Prompt::Tokens(_) => 1,
            Prompt::Bytes(_) => BYTES_PER_TOKEN as usize,
        };
        tokens as usize * units_per_token / self.block_units(&req.prompt)
    }

    /// `endpoint` holds no more than `cached_tokens` of `req`'s prompt: it loses the prompt's blocks past them.
    pub(super) fn forget_past(
        &self,
        endpoint: EndpointId,
        req: &RouteRequest,
        prepared: &Prepared,
        cached_tokens: u64,
    ) {
        let held = self.blocks_of(req, cached_tokens);
        let mut state = self.lock();
        if let Some(&slot) = state.slots.get(&endpoint) {
            state.index.forget_from(slot, &prepared.block_hashes, held);
        }
    }
}

/// The learned capacity of each slot, in blocks; `None` is the given capacity.
#[derive(Debug, Default)]
pub(super) struct Learned {
    caps: Vec<Option<usize>>,
}

impl Learned {
    /// The capacity to give the index for `slot`, whose given capacity is `given`.
    pub(super) fn capacity(&self, slot: usize, given: usize) -> usize {
        self.caps.get(slot).copied().flatten().map_or(given, |c| c.min(given))
    }

    /// The engine held `held` leading blocks of a prompt of `prompt` blocks where the index predicted `matched`.
    /// Returns the slot's new capacity.
    pub(super) fn refuted(&mut self, slot: usize, given: usize, matched: Matched, held: usize, prompt: usize) -> usize {
        // Nothing but the prompt's own blocks was recorded there since: the engine lost it to something the index
        // cannot count (blocks pinned by requests in flight, the answers it caches), not to other prompts.
        if matched.age < matched.blocks {
            return self.capacity(slot, given);
        }
        // The age of block `held`, at most the deepest matched block's less the blocks between them. Requests in
        // flight pin their blocks, which the engine keeps however old: each may have held about a prompt's worth.
        let shallower = matched.blocks.saturating_sub(1).saturating_sub(held);
        let pinned = (matched.in_flight as usize).saturating_mul(prompt);
        let bound = matched.age.saturating_sub(shallower).saturating_add(pinned).max(prompt);
        let capacity = self.capacity(slot, given).min(bound);
        self.set(slot, given, capacity);
        capacity
    }

    /// The engine held all the index predicted at `slot`. Returns the slot's new capacity.
    pub(super) fn confirmed(&mut self, slot: usize, given: usize) -> usize {
        let current = self.capacity(slot, given);
        let capacity = current.saturating_add((current / 8).max(1)).min(given);
        self.set(slot, given, capacity);
        capacity
    }

    /// Forgets what was learned of `slot` (its endpoint left, or follows KV events).
    pub(super) fn reset(&mut self, slot: usize) {
        if let Some(c) = self.caps.get_mut(slot) {
            *c = None;
        }
    }

    fn set(&mut self, slot: usize, given: usize, capacity: usize) {
        if self.caps.len() <= slot {
            self.caps.resize(slot + 1, None);
        }
        self.caps[slot] = (capacity < given).then_some(capacity);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::{Endpoint, EndpointId, Snapshot};
    use crate::policy::{CacheAware, CacheAwareConfig};
    use crate::request::RouteRequest;
    use crate::ticket::dispatch;
    use crate::usage::Usage;

    /// Two agents take turns (A1 B1 A2 B2 …) on two engines that each keep one prompt (a llama.cpp slot) while
    /// the policy assumes the default capacity. Returns each agent's hits after its first turn: turns where the
    /// engine held the agent's whole previous prompt.
    fn one_slot_engines(config: CacheAwareConfig, seeds: (u32, u32), turns: usize) -> [usize; 2] {
        let policy = CacheAware::new(config);
        let snap = Snapshot::new((0..2).map(|r| Endpoint::new(EndpointId::new(r, 0))).collect());
        let mut engines: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
        let mut conversations: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
        let mut hits = [0; 2];
        for turn in 0..turns {
            for (agent, seed) in [seeds.0, seeds.1].into_iter().enumerate() {
                // A 450-token system prompt of its own, then 60 tokens per turn.
                let conversation = &mut conversations[agent];
                let before = conversation.len();
                let grow = if turn == 0 { 450 } else { 60 };
                conversation.extend((0..grow as u32).map(|i| seed.wrapping_mul(7919) ^ (before as u32 + i) << 8));
                let mut req = RouteRequest::tokens(conversation.clone());
                req.now_us = (2 * turn + agent) as u64 * 1_000_000;
                let mut ticket = dispatch(&policy, &snap, req).unwrap();
                let engine = &mut engines[ticket.pick.rank];
                let cached = engine
                    .iter()
                    .zip(conversation.iter())
                    .take_while(|(a, b)| a == b)
                    .count();
                let cached = cached.min(conversation.len() - 1);
                if turn > 0 && cached >= before {
                    hits[agent] += 1;
                }
                ticket.usage(Usage {
                    prompt_tokens: conversation.len() as u64,
                    cached_tokens: cached as u64,
                });
                *engine = conversation.clone();
            }
        }
        hits
    }

    #[test]
    fn sessions_split_over_engines_that_keep_less_than_the_index_assumes() {
        // Cold placements by rendezvous alone (recent counts forgotten at once), so that some pairs of agents
        // start on one engine, as they do behind several gateways or beside other traffic.
        let learning = CacheAwareConfig {
            recent_half_life_s: 1e-9,
            ..CacheAwareConfig::default()
        };
        let trusting = CacheAwareConfig {
            correct_on_feedback: false,
            ..learning
        };
        let mut trusting_missed = false;
        for pair in 0..8u32 {
            let seeds = (2 * pair + 1, 2 * pair + 2);
            let [a, b] = one_slot_engines(learning, seeds, 7);
            // The agents share an engine at most until the first refuted prediction: one miss each at most.
            assert!(a >= 5 && b >= 5, "pair {pair}: {a} and {b} hits of 6");
            let [a, b] = one_slot_engines(trusting, seeds, 7);
            trusting_missed |= a + b < 10;
        }
        assert!(trusting_missed, "no pair collided: the test does not exercise learning");
    }

    /// A prediction whose deepest block is the first one the engine lacked.
    fn m(age: usize, held: usize) -> Matched {
        Matched {
            blocks: held + 1,
            age,
            in_flight: 0,
        }
    }

    #[test]
    fn a_refutation_bounds_the_capacity_and_confirmations_restore_it() {
        let mut learned = Learned::default();
        assert_eq!(learned.capacity(3, 6250), 6250);
        // One-slot engine: the prompt (7 blocks) was recorded, then another of 7; the engine kept only that one.
        assert_eq!(learned.refuted(3, 6250, m(7, 0), 0, 7), 7);
        assert_eq!(learned.capacity(3, 6250), 7);
        // Never below the prompt itself, never above what was learned.
        assert_eq!(learned.refuted(3, 6250, m(2, 0), 0, 9), 7);
        assert_eq!(learned.refuted(3, 6250, m(2, 0), 0, 5), 5);
        assert_eq!(learned.refuted(3, 6250, m(1, 0), 0, 3), 3);
        assert_eq!(learned.capacity(3, 6250), 3);
        // A given capacity below the learned one wins.
        assert_eq!(learned.capacity(3, 2), 2);
        let mut last = 3;
        for _ in 0..100 {
            let next = learned.confirmed(3, 6250);
            assert!(next > last || next == 6250);
            last = next;
        }
        assert_eq!((last, learned.capacity(3, 6250)), (6250, 6250));
        // The first missing block (3) is 6 shallower than the deepest matched one (9, recorded 20 blocks ago).
        let deep = Matched {
            blocks: 10,
            age: 20,
            in_flight: 0,
        };
        assert_eq!(learned.refuted(1, 100, deep, 3, 4), 14);
        // Two requests in flight there may have pinned two prompts' worth of older blocks.
        let busy = Matched { in_flight: 2, ..deep };
        assert_eq!(learned.refuted(2, 100, busy, 3, 4), 22);
        learned.refuted(0, 100, m(10, 0), 0, 1);
        learned.reset(0);
        assert_eq!(learned.capacity(0, 100), 100);
    }
}
