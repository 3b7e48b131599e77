//! `cache_aware`'s precise mode: an endpoint whose engine publishes KV events has its index entries from them.
//!
//! The gateway follows each such endpoint's events into the router's block hashes
//! ([`crate::engine_blocks`]) and hands the changes to [`crate::policy::Policy::engine_cache`]: stored blocks are recorded (and
//! count as *confirmed*), removed ones forgotten, a clear empties the endpoint; the tokens held past each sequence's
//! last whole block ([`crate::engine_blocks::Tail`]) are kept beside them, so a prediction there counts the
//! engine's cached tokens to its page; and as an engine reuses whole pages only, and always computes a prompt's
//! last token, a prediction there is what the index holds, less the prompt's last token, rounded down to the
//! engine's page (vLLM's 128-token CPU blocks: a fully cached 1,024-token prompt reuses 896). The endpoint is then *precise*:
//! the blocks of a request routed there are recorded at once, as in approximate mode (a burst of requests on one
//! prefix must see where the first went before any event can say so), but only for `event_grace_ms`: when that
//! has passed, those the events have not confirmed by then are forgotten (the engine did not keep them: the
//! request failed, was cancelled, or was evicted before it finished). An endpoint whose events stop or break
//! ([`CacheChange::Untracked`]) is approximate again: its entries stay, and its decisions are no longer
//! provisional.
//!
//! Cost: one hash-set insert or removal per stored or removed block; per decision at a precise endpoint, a copy
//! of its block hashes until it expires, and one set look-up per block then. Expired decisions are swept at the
//! next decision.

use std::collections::{HashSet, VecDeque};

use crate::endpoint::EndpointId;
use crate::engine_blocks::{CacheChange, HeldTails};
use crate::hashing::PassThroughBuild;

use super::{CacheAware, State};

/// Precise mode's bookkeeping.
#[derive(Debug, Default)]
pub(super) struct EventState {
    /// Per slot: what its engine's events say it holds; `None` while the slot is approximate.
    held: Vec<Option<Held>>,
    /// Decisions at precise slots, oldest first.
    pending: VecDeque<Pending>,
}

/// What a precise slot's engine holds, as its events say.
#[derive(Debug, Default)]
struct Held {
    /// Router blocks.
    confirmed: HashSet<u64, PassThroughBuild>,
    /// Tokens past the last whole router block of each sequence.
    tails: HeldTails,
    /// The engine's page (block) size in tokens, from its latest stored blocks: it reuses whole pages only.
    page: u32,
}

#[derive(Debug)]
struct Pending {
    expires_us: u64,
    slot: usize,
    hashes: Box<[u64]>,
}

/// A precise slot's index holds this many times the endpoint's capacity: the engine's events, not the index's
/// LRU, say what it dropped (the slack covers decisions not yet confirmed, and an engine's locked blocks past its
/// capacity), and a full index would forget blocks the engine still holds.
const PRECISE_SLACK: usize = 4;

impl EventState {
    /// The index capacity of `slot` for an endpoint of `capacity` blocks.
    pub(super) fn capacity(&self, slot: usize, capacity: usize) -> usize {
        match self.confirmed(slot) {
            Some(_) => capacity.saturating_mul(PRECISE_SLACK),
            None => capacity,
        }
    }

    /// The engine's capacity at `slot`, whose index holds `index_capacity` blocks (more, in precise mode).
    pub(super) fn engine_capacity(&self, slot: usize, index_capacity: usize) -> usize {
        match self.confirmed(slot) {
            Some(_) => index_capacity / PRECISE_SLACK,
            None => index_capacity,
        }
    }

    /// Whether `slot` follows its engine's events.
    pub(super) fn is_tracked(&self, slot: usize) -> bool {
        self.confirmed(slot).is_some()
    }

    /// Tokens of `rest` past the router block `seed` (0: none) that `slot`'s engine holds: its tails' longest
    /// match, in precise mode (0 in approximate mode, whose index knows whole blocks alone).
    pub(super) fn tail_tokens(&self, slot: usize, seed: u64, rest: &[u32]) -> usize {
        self.held(slot).map_or(0, |held| held.tails.longest(seed, rest))
    }

    /// The engine's page size at `slot` in precise mode, once its events said (1: any number of tokens).
    pub(super) fn page(&self, slot: usize) -> u64 {
        self.held(slot).map_or(1, |held| u64::from(held.page.max(1)))
    }

    fn held(&self, slot: usize) -> Option<&Held> {
        self.held.get(slot).and_then(Option::as_ref)
    }

    fn confirmed(&self, slot: usize) -> Option<&HashSet<u64, PassThroughBuild>> {
        self.held(slot).map(|held| &held.confirmed)
    }

    fn held_mut(&mut self, slot: usize) -> &mut Held {
        if self.held.len() <= slot {
            self.held.resize_with(slot + 1, || None);
        }
        self.held[slot].get_or_insert_with(Held::default)
    }
}

impl State {
    /// A decision recorded `hashes` at `slot`: provisional there until `expires_us` if the slot is precise.
    pub(super) fn provisional(&mut self, slot: usize, hashes: &[u64], expires_us: u64) {
        let Some(confirmed) = self.events.confirmed(slot) else {
            return;
        };
        if hashes.iter().all(|h| confirmed.contains(h)) {
            return;
        }
        self.events.pending.push_back(Pending {
            expires_us,
            slot,
            hashes: hashes.into(),
        });
    }

    /// Forgets the blocks of decisions whose grace has passed by `now_us` that the events did not confirm.
    pub(super) fn expire_unconfirmed(&mut self, now_us: u64) {
        while self.events.pending.front().is_some_and(|p| p.expires_us <= now_us) {
            let Some(p) = self.events.pending.pop_front() else {
                break;
            };
            let Some(confirmed) = self.events.confirmed(p.slot) else {
                continue;
            };
            let unconfirmed: Vec<u64> = p.hashes.iter().copied().filter(|h| !confirmed.contains(h)).collect();
            self.index.forget_from(p.slot, &unconfirmed, 0);
        }
    }

    fn apply(&mut self, slot: usize, change: &CacheChange) {
        let was_precise = self.events.confirmed(slot).is_some();
        match change {
            CacheChange::Stored { blocks, page, .. } => {
                self.index.record(slot, blocks);
                let held = self.events.held_mut(slot);
                held.page = *page;
                held.confirmed.extend(blocks.iter().copied());
                held.tails.apply(change);
            }
            CacheChange::Removed { blocks, .. } => {
                self.index.forget_from(slot, blocks, 0);
                let held = self.events.held_mut(slot);
                for h in blocks {
                    held.confirmed.remove(h);
                }
                held.tails.apply(change);
            }
            CacheChange::Cleared => {
                self.index.clear_slot(slot);
                *self.events.held_mut(slot) = Held::default();
            }
            CacheChange::Untracked => {
                if let Some(held) = self.events.held.get_mut(slot) {
                    *held = None;
                }
            }
        }
        let precise = self.events.confirmed(slot).is_some();
        if precise != was_precise {
            // What was learned from refuted predictions is moot once the events say what the engine holds.
            self.learned.reset(slot);
            let given = self.given[slot];
            self.given[slot] = if precise {
                given.saturating_mul(PRECISE_SLACK)
            } else {
                given / PRECISE_SLACK
            };
            self.index.set_capacity(slot, self.given[slot]);
        }
    }
}

impl CacheAware {
    /// Applies a change the engine's events reported at `endpoint` (see the module documentation); `now_us` on
    /// the requests' clock sweeps expired decisions first.
    pub(super) fn apply_engine_cache(&self, endpoint: EndpointId, change: &CacheChange, now_us: u64) {
        let mut state = self.lock();
        state.expire_unconfirmed(now_us);
        let slot = match state.slots.get(&endpoint) {
            Some(&slot) => slot,
            // Events before the endpoint's first decision: its slot starts now, at the default capacity until a
            // snapshot says otherwise.
            None => {
                let capacity = (self.config.kv_capacity_tokens / self.config.block_tokens.max(1) as u64) as usize;
                state.add_slot(endpoint, capacity)
            }
        };
        state.apply(slot, change);
    }

    /// Whether `endpoint` is in precise mode (its events are followed).
    pub fn is_precise(&self, endpoint: EndpointId) -> bool {
        let state = self.lock();
        state
            .slots
            .get(&endpoint)
            .is_some_and(|&slot| state.events.confirmed(slot).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::hashing::block_hashes;
    use crate::policy::{route, Branch, CacheAwareConfig, Policy};
    use crate::request::{Prompt, RouteRequest};

    const BLOCK: usize = 16;

    fn policy() -> CacheAware {
        CacheAware::new(CacheAwareConfig {
            block_tokens: BLOCK,
            event_grace_ms: 1_000,
            ..CacheAwareConfig::default()
        })
    }

    fn tokens(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32)
            .map(|i| seed.wrapping_mul(7_919) ^ i.wrapping_mul(2_654_435_761))
            .collect()
    }

    fn blocks(t: &[u32]) -> Vec<u64> {
        let mut out = Vec::new();
        block_hashes(&Prompt::Tokens(t.to_vec()), BLOCK, &mut out);
        out
    }

    fn at(t: &[u32], now_us: u64) -> RouteRequest {
        let mut req = RouteRequest::tokens(t.to_vec());
        req.now_us = now_us;
        req
    }

    #[test]
    fn what_the_engine_stored_is_where_a_prompt_goes() {
        let snap = Snapshot::single_worker(4);
        let p = policy();
        let prompt = tokens(1, 640);
        let third = snap.endpoints()[2].id;
        p.engine_cache(
            third,
            &CacheChange::Stored {
                blocks: blocks(&prompt),
                tails: Vec::new(),
                page: 1,
            },
            0,
        );
        assert!(p.is_precise(third));
        let pick = route(&p, &snap, &at(&prompt, 1)).unwrap();
        assert_eq!((pick.rank, pick.branch), (2, Branch::Hit));
        // The engine evicted it, then flushed everything: the index follows.
        p.engine_cache(
            third,
            &CacheChange::Removed {
                blocks: blocks(&prompt)[10..].to_vec(),
                tails: Vec::new(),
            },
            2,
        );
        assert_eq!(p.predicted_cached(&snap, &at(&prompt, 3))[2], 160);
        p.engine_cache(third, &CacheChange::Cleared, 4);
        assert_eq!(p.predicted_cached(&snap, &at(&prompt, 5))[2], 0);
    }

    #[test]
    fn predictions_are_whole_engine_pages_short_of_the_prompts_last_token() {
        use crate::engine_blocks::EngineBlocks;
        use crate::kv_events::KvEvent;
        let snap = Snapshot::single_worker(2);
        let p = policy();
        let id = snap.endpoints()[0].id;
        // vLLM's CPU blocks: 128 tokens. The engine stored a 1,024-token prompt's eight pages.
        let prompt = tokens(3, 1024);
        let mut engine = EngineBlocks::new(BLOCK, usize::MAX);
        let change = engine
            .apply(&KvEvent::Stored {
                hashes: (0..8).collect(),
                parent: None,
                tokens: prompt.clone(),
                block_size: 128,
                medium: None,
                plain: true,
            })
            .unwrap()
            .unwrap();
        p.engine_cache(id, &change, 0);
        // The same prompt again: the engine computes its last token, so it reuses seven pages, not 1,023 tokens.
        assert_eq!(p.predicted_cached(&snap, &at(&prompt, 1))[0], 896);
        // A longer prompt reuses all eight.
        let mut longer = prompt.clone();
        longer.extend(tokens(4, 100));
        assert_eq!(p.predicted_cached(&snap, &at(&longer, 1))[0], 1024);
        // A request routed there and not yet confirmed counts the router's blocks it added in whole pages too:
        // 1,024 + 100 + 60 tokens, of which the engine will hold nine pages.
        let mut next = longer.clone();
        next.extend(tokens(5, 60));
        route(&p, &snap, &at(&next, 2)).unwrap();
        let mut after = next.clone();
        after.extend(tokens(6, 40));
        assert_eq!(p.predicted_cached(&snap, &at(&after, 3))[0], 1152);
    }

    #[test]
    fn predictions_count_the_engines_tokens_past_the_last_whole_block() {
        use crate::engine_blocks::EngineBlocks;
        use crate::kv_events::KvEvent;
        let snap = Snapshot::single_worker(2);
        let p = policy();
        let id = snap.endpoints()[1].id;
        // SGLang's one-token pages: a 600-token prompt and its 50-token answer, 650 tokens, 40 blocks and 10 more.
        let answered = tokens(7, 650);
        let mut engine = EngineBlocks::new(BLOCK, usize::MAX);
        let mut follow = |event: KvEvent| {
            if let Some(change) = engine.apply(&event).unwrap() {
                p.engine_cache(id, &change, 0);
            }
        };
        follow(KvEvent::Stored {
            hashes: (0..650).collect(),
            parent: None,
            tokens: answered.clone(),
            block_size: 1,
            medium: None,
            plain: true,
        });
        let mut next = answered.clone();
        next.extend(tokens(8, 100));
        assert_eq!(p.predicted_cached(&snap, &at(&next, 1))[1], 650);
        // A turn that edits the answer's last tokens finds only what it shares.
        let mut edited = answered[..645].to_vec();
        edited.extend(tokens(9, 100));
        assert_eq!(p.predicted_cached(&snap, &at(&edited, 1))[1], 645);
        // The engine evicts the last three pages, then the rest past the 40th block: the whole blocks remain.
        follow(KvEvent::Removed {
            hashes: vec![647, 648, 649],
            medium: None,
            plain: true,
        });
        assert_eq!(p.predicted_cached(&snap, &at(&next, 2))[1], 647);
        follow(KvEvent::Removed {
            hashes: (640..647).rev().collect(),
            medium: None,
            plain: true,
        });
        assert_eq!(p.predicted_cached(&snap, &at(&next, 3))[1], 640);
        // Without events: whole blocks of what was routed there.
        let approximate = policy();
        let one = Snapshot::single_worker(1);
        route(&approximate, &one, &at(&answered, 0)).unwrap();
        assert_eq!(approximate.predicted_cached(&one, &at(&next, 1))[0], 640);
    }

    #[test]
    fn requests_queued_at_a_full_endpoint_do_not_count_as_evictions_of_the_next_one() {
        // Engines of 64 blocks, both full: the first holds a 32-block prefix, the second other prompts.
        let p = CacheAware::new(CacheAwareConfig {
            block_tokens: BLOCK,
            kv_capacity_tokens: 64 * BLOCK as u64,
            event_grace_ms: 60_000,
            ..CacheAwareConfig::default()
        });
        let snap = Snapshot::single_worker(2);
        let prefix = tokens(1, 32 * BLOCK);
        let store = |rank: usize, t: &[u32]| {
            let change = CacheChange::Stored {
                blocks: blocks(t),
                tails: Vec::new(),
                page: 1,
            };
            p.engine_cache(snap.endpoints()[rank].id, &change, 0);
        };
        let mut first = prefix.clone();
        first.extend(tokens(2, 32 * BLOCK));
        store(0, &first);
        store(1, &tokens(3, 64 * BLOCK));
        // Requests on the prefix, each with 16 blocks of its own, before any event confirms them: every one
        // evicts 16 blocks at the first endpoint (what the earlier ones add there is evicted whatever this one
        // does), 48 at the second.
        for i in 0..8 {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(100 + i, 16 * BLOCK));
            let pick = route(&p, &snap, &at(&prompt, 1 + u64::from(i))).unwrap();
            assert_eq!((pick.rank, pick.branch), (0, Branch::Hit), "request {i}");
        }
    }

    #[test]
    fn a_decision_the_events_do_not_confirm_is_forgotten_after_the_grace() {
        let snap = Snapshot::single_worker(2);
        let p = policy();
        for e in snap.endpoints() {
            p.engine_cache(e.id, &CacheChange::Cleared, 0);
        }
        let (kept, lost) = (tokens(2, 320), tokens(3, 320));
        let kept_at = route(&p, &snap, &at(&kept, 0)).unwrap().rank;
        let lost_at = route(&p, &snap, &at(&lost, 0)).unwrap().rank;
        // Only the first was stored by its engine.
        p.engine_cache(
            snap.endpoints()[kept_at].id,
            &CacheChange::Stored {
                blocks: blocks(&kept),
                tails: Vec::new(),
                page: 1,
            },
            500,
        );
        let held = |t: &[u32], rank: usize, now| p.predicted_cached(&snap, &at(t, now))[rank];
        assert_eq!(
            (held(&kept, kept_at, 999_000), held(&lost, lost_at, 999_000)),
            (319, 319),
            "both within the grace"
        );
        // The next decision after the grace sweeps the unconfirmed one.
        route(&p, &snap, &at(&tokens(4, 32), 1_000_000)).unwrap();
        assert_eq!(
            (held(&kept, kept_at, 1_000_001), held(&lost, lost_at, 1_000_001)),
            (319, 0)
        );
    }

    #[test]
    fn an_untracked_endpoint_keeps_its_decisions() {
        let snap = Snapshot::single_worker(1);
        let p = policy();
        let id = snap.endpoints()[0].id;
        p.engine_cache(id, &CacheChange::Cleared, 0);
        p.engine_cache(id, &CacheChange::Untracked, 0);
        assert!(!p.is_precise(id));
        let prompt = tokens(5, 320);
        route(&p, &snap, &at(&prompt, 0)).unwrap();
        route(&p, &snap, &at(&tokens(6, 32), 5_000_000)).unwrap();
        assert_eq!(
            p.predicted_cached(&snap, &at(&prompt, 5_000_001))[0],
            319,
            "approximate: no expiry"
        );
    }
}
