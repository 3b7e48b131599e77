//! Sessions paused for a tool: their answer ended on tool calls, and their agent will send the next turn, with the
//! tool's result, once the tool has run (86% within a second and 95% within ten in the vLLM router's data on agents).
//! Its prefix is then worth more than any other block the endpoint holds: it is asked for again within seconds. A
//! placement that would push a paused session's prefix out of its endpoint's cache pays the re-prefill of what it
//! pushes out (`pause_weight` times its prefill time, on top of `eviction_weight`'s charge for any block).
//!
//! A paused session is known by the last whole block of its prompt (its next turn's prompt contains it, as a
//! conversation is followed in `conversations`) and by its session id when the client names one. Each learns how
//! long its own pauses last (from its answer's end to its next request: the tool's time, which the conversation
//! forecast's request-to-request cycle does not separate); a new one starts from the mean of all. A session paused
//! more than [`PATIENCE`] times its usual pause (and at least [`MIN_PATIENCE_US`]) is no longer expected.
//!
//! Memory: at most [`MAX_PER_SLOT`] paused sessions per endpoint (the oldest goes first). Cost: per request, a
//! look-up per prompt block to find the session it resumes, and per candidate endpoint a pass over its paused
//! sessions.

use std::collections::HashMap;

/// The most paused sessions kept per endpoint.
pub(super) const MAX_PER_SLOT: usize = 256;

/// A session paused this many times its usual pause is no longer expected.
const PATIENCE: f64 = 8.0;

/// ... but never sooner than this.
const MIN_PATIENCE_US: f64 = 10e6;

/// The pause a session is first expected to take, before any has been seen: two seconds.
const FIRST_GAP_US: f64 = 2e6;

/// The weight of the newest pause in a session's usual pause.
const GAP_WEIGHT: f64 = 0.5;

/// One paused session.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Pause {
    /// The last whole block of its prompt.
    pub(super) end: u64,
    /// Its prompt's whole blocks.
    pub(super) blocks: usize,
    session: Option<u64>,
    since_us: u64,
    /// Its usual pause, microseconds.
    gap_us: f64,
}

#[derive(Debug, Default)]
pub(super) struct Pauses {
    /// Per slot, its paused sessions, oldest first.
    slots: Vec<Vec<Pause>>,
    /// The slot of each paused session, by its last block; and a named session's last block. Entries may outlive
    /// their session (checked against `slots` on use; rebuilt when they pile up).
    slot_of: HashMap<u64, usize>,
    by_session: HashMap<u64, u64>,
    /// The usual pause of the sessions that resumed: carried from a resumed session's request to its next pause
    /// (by that request's last block).
    carried: HashMap<u64, f64>,
    /// The mean pause of all sessions (exponentially weighted), once one resumed.
    mean_gap_us: Option<f64>,
}

impl Pauses {
    /// The request with prompt blocks `hashes` (and session id `session`, if named) is its session's next turn:
    /// that session is paused no more, and its pause is learned.
    pub(super) fn resume(&mut self, session: Option<u64>, hashes: &[u64], now_us: u64) {
        let held = |end: u64| {
            let slot = *self.slot_of.get(&end)?;
            let i = self.slots[slot].iter().position(|p| p.end == end)?;
            Some((slot, i))
        };
        let found = session
            .and_then(|s| self.by_session.get(&s).copied())
            .and_then(held)
            .or_else(|| hashes.iter().rev().find_map(|&h| held(h)));
        let Some((slot, i)) = found else { return };
        let pause = self.slots[slot].remove(i);
        self.slot_of.remove(&pause.end);
        let gap = now_us.saturating_sub(pause.since_us) as f64;
        let usual = pause.gap_us + GAP_WEIGHT * (gap - pause.gap_us);
        self.mean_gap_us = Some(match self.mean_gap_us {
            Some(mean) => mean + 0.05 * (gap - mean),
            None => gap,
        });
        if let Some(&last) = hashes.last() {
            if self.carried.len() >= MAX_PER_SLOT * 64 {
                self.carried.clear();
            }
            self.carried.insert(last, usual);
        }
    }

    /// The request with prompt blocks `hashes`, at `slot`, ended on tool calls at `now_us`: its session pauses.
    pub(super) fn pause(&mut self, slot: usize, session: Option<u64>, hashes: &[u64], now_us: u64) {
        let Some(&end) = hashes.last() else { return };
        let gap_us = self.carried.remove(&end).or(self.mean_gap_us).unwrap_or(FIRST_GAP_US);
        if self.slots.len() <= slot {
            self.slots.resize(slot + 1, Vec::new());
        }
        let paused = &mut self.slots[slot];
        paused.retain(|p| p.end != end && (session.is_none() || p.session != session));
        if paused.len() >= MAX_PER_SLOT {
            paused.remove(0);
        }
        paused.push(Pause {
            end,
            blocks: hashes.len(),
            session,
            since_us: now_us,
            gap_us,
        });
        self.slot_of.insert(end, slot);
        if let Some(session) = session {
            self.by_session.insert(session, end);
        }
        // Entries of sessions no longer paused pile up: rebuilt from the sessions that are.
        let paused: usize = self.slots.iter().map(Vec::len).sum();
        if self.slot_of.len() + self.by_session.len() > 4 * paused + 1024 {
            self.slot_of = self
                .slots
                .iter()
                .enumerate()
                .flat_map(|(s, ps)| ps.iter().map(move |p| (p.end, s)))
                .collect();
            self.by_session = self
                .slots
                .iter()
                .flatten()
                .filter_map(|p| Some((p.session?, p.end)))
                .collect();
        }
    }

    /// The sessions paused at `slot` and still expected at `now_us` (those past their patience are forgotten).
    pub(super) fn at(&mut self, slot: usize, now_us: u64) -> &[Pause] {
        let Some(paused) = self.slots.get_mut(slot) else {
            return &[];
        };
        paused.retain(|p| (now_us.saturating_sub(p.since_us) as f64) < (PATIENCE * p.gap_us).max(MIN_PATIENCE_US));
        paused
    }

    /// Forgets `slot`'s paused sessions (its endpoint left).
    pub(super) fn reset(&mut self, slot: usize) {
        if let Some(paused) = self.slots.get_mut(slot) {
            paused.clear();
        }
    }
}

impl super::CacheAware {
    /// For each candidate of `c` (in candidate order): the re-prefill, at its `costs`, of the paused sessions'
    /// prefixes that placing a prompt of `blocks` blocks there would push out of its cache, of which it holds
    /// `lens[slot]` already: a paused session's last block that has `age` blocks recorded after it goes once
    /// `age` plus the new blocks reach the capacity, and with it the blocks of its prompt beyond that.
    pub(super) fn pause_costs(
        &self,
        state: &mut super::State,
        c: &crate::policy::Candidates<'_>,
        lens: &[u32],
        blocks: usize,
        costs: &[super::costs::Costs],
        now_us: u64,
    ) -> Vec<u64> {
        let weight = self.config.pause_weight;
        if weight <= 0.0 {
            return Vec::new();
        }
        let block = self.config.block_tokens as u64;
        let super::State {
            pauses,
            index,
            events,
            slot_of_rank,
            ..
        } = state;
        c.iter()
            .map(|r| {
                let slot = slot_of_rank[r];
                let new = blocks.saturating_sub(lens[slot] as usize);
                let capacity = events.engine_capacity(slot, index.capacity(slot));
                let out: usize = pauses
                    .at(slot, now_us)
                    .iter()
                    .filter_map(|p| {
                        let age = index.age(slot, p.end)? as usize;
                        (age < capacity && age + new >= capacity).then(|| p.blocks.min(age + new + 1 - capacity))
                    })
                    .sum();
                (weight * costs[r].prefill_us(0, out as u64 * block) as f64) as u64
            })
            .collect()
    }

    /// `req`'s answer from `endpoint` ended as `ending` says: on tool calls, its session pauses there.
    pub(super) fn ended(
        &self,
        endpoint: crate::EndpointId,
        req: &crate::RouteRequest,
        hashes: &[u64],
        ending: crate::policy::Ending,
    ) {
        if !ending.tool_call || self.config.pause_weight <= 0.0 {
            return;
        }
        let mut state = self.lock();
        if let Some(&slot) = state.slots.get(&endpoint) {
            state.pauses.pause(slot, req.session, hashes, ending.now_us);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_pauses_resumes_by_containment_or_id_and_learns_its_pause() {
        let mut p = Pauses::default();
        p.pause(1, None, &[10, 11, 12], 1_000_000);
        assert_eq!(p.at(1, 1_000_000).len(), 1);
        // Its next turn contains block 12: resumed 500 ms later.
        p.resume(None, &[10, 11, 12, 13, 14], 1_500_000);
        assert!(p.at(1, 1_500_000).is_empty());
        assert_eq!(p.mean_gap_us, Some(500_000.0));
        // It pauses again: it is expected back about as soon (2 s to start, halfway to 500 ms).
        p.pause(1, None, &[10, 11, 12, 13, 14], 2_000_000);
        assert_eq!(p.at(1, 2_000_000)[0].gap_us, 1_250_000.0);
        // Past eight times that (and 10 s), it is no longer expected.
        assert_eq!(p.at(1, 2_000_000 + 9_000_000).len(), 1);
        assert!(p.at(1, 2_000_000 + 10_000_001).is_empty());
        // A named session resumes by its id, whatever its prompt.
        p.pause(0, Some(7), &[20, 21], 0);
        p.resume(Some(7), &[99], 100);
        assert!(p.at(0, 100).is_empty());
    }

    #[test]
    fn at_most_max_per_slot_are_kept_the_oldest_going_first() {
        let mut p = Pauses::default();
        for i in 0..(MAX_PER_SLOT as u64 + 10) {
            p.pause(0, None, &[i], 0);
        }
        let kept = p.at(0, 0);
        assert_eq!(kept.len(), MAX_PER_SLOT);
        assert_eq!(kept[0].end, 10);
    }
}
