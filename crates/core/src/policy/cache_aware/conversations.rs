//! `cache_aware`'s forecast of conversations (`session_turns`): what a placement costs the turns that follow it.
//!
//! The choice is otherwise greedy: a conversation that starts while another one holds its prefix on a busy
//! endpoint waits there, since that is quicker than a cold prefill elsewhere, and from then on the two
//! conversations' turns queue behind each other on one endpoint for as long as they last (agents that start a few
//! seconds apart all gather on the endpoint that first warmed their system prompt). One cold prefill elsewhere
//! would have spared every later turn that wait.
//!
//! So the router follows conversations: a request whose prompt contains the last whole block of an earlier
//! request's prompt continues that request's conversation (its next turn: the earlier prompt, the answer, a new
//! user turn). A conversation's pace is the share of its endpoint's prefill time it takes: its latest prefill time
//! over its cycle (the time since its previous request, with that request's prefill time replaced by this one's,
//! as a client that waits for each answer would send the next turn). One that has made a single request has no
//! pace yet: it is counted at the fleet's mean pace (as keeping its endpoint busy while none is known), but never
//! above its prefill time over the time since it was sent, since it has not come back in that time. One that has
//! not come back in a hundred times its prefill time is over (a single question, not a conversation), as is any
//! conversation idle for the idle time (`recent_half_life_s`).
//!
//! Placing a request at an endpoint whose other conversations have paces summing to `load` commits its
//! conversation's remaining turns there: each of them, and the other conversations' turns, delay each other by
//! about `load` times one warm prefill per turn (a turn arrives while the others prefill that share of the time,
//! and waits half a prefill on average; the others wait as much on it). That forecast is added to the endpoint's
//! cost. An endpoint where no other conversation runs costs nothing more, so a new conversation pays a cold
//! prefill on an idle endpoint when its remaining turns would wait longer than that in all. When the endpoints'
//! prefills share compute (`prefill_contention`), that share of the conversations elsewhere counts too: with one
//! shared pool, spreading conversations spares no wait.
//!
//! The remaining turns come from the chance that a conversation goes on, learned from the requests that continued
//! one against the conversations that ended, with `session_turns` counted as one conversation of that many
//! requests (so it holds until conversations are seen to end, and fades as they are); never more than
//! `session_turns` in all. Before any conversation has ended that prior decides alone: on a fleet of single
//! questions it spreads the first seconds' questions by load instead of by cache (measured in
//! `docs/measurements.md`), which is why it is off by default.
//!
//! Memory: one entry per conversation active within the idle time, at most [`MAX_CONVERSATIONS`] (the oldest is
//! forgotten first), and queue entries to forget them by, at most twice as many. Cost per request: a look-up per prompt block to find the conversation it continues, and per
//! endpoint a pass over its conversations that have made one request (those of the last hundred prefill times, at
//! most the newest [`MAX_FRESH_PER_SLOT`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

/// The most conversations followed at once.
pub(super) const MAX_CONVERSATIONS: usize = 1 << 16;

/// The counts of continuations and ends halve past this.
const COUNTS_HALVED_AT: f64 = 20_000.0;

/// The most conversations without a pace counted at one endpoint: the newest.
pub(super) const MAX_FRESH_PER_SLOT: usize = 64;

/// A conversation that has made one request is over when it has not come back in this many times its prefill time.
const SINGLE_AFTER_PREFILLS: u64 = 100;

/// One conversation, keyed by the last whole block of its latest prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Conversation {
    /// The slot its latest request went to.
    slot: usize,
    /// When its latest request was routed, microseconds.
    last_us: u64,
    /// Requests so far.
    pub turns: u32,
    /// The share of its endpoint's prefill time it takes; `None` until it has sent two requests.
    pace: Option<f64>,
    /// Its latest prefill time, microseconds.
    service_us: u64,
}

/// Per slot: the sum of its conversations' known paces, and those that have none yet (by end block).
#[derive(Debug, Default, Clone)]
struct SlotPaces {
    known: f64,
    fresh: Vec<(u64, Conversation)>,
}

#[derive(Debug, Default)]
pub(super) struct Conversations {
    by_end: HashMap<u64, Conversation>,
    /// `(idle from, end)` in routing order, to forget conversations that went idle.
    idle: VecDeque<(u64, u64)>,
    /// `(over at, since, end)` of the conversations that made one request, soonest first, to end those that do
    /// not come back.
    single: BinaryHeap<Reverse<(u64, u64, u64)>>,
    slots: Vec<SlotPaces>,
    /// Sum and count of the known paces of all conversations.
    known: (f64, u32),
    /// Requests that continued a conversation, and conversations that ended (went idle), for how likely a
    /// conversation is to go on.
    continuations: f64,
    ends: f64,
}

impl Conversations {
    /// The conversation `hashes` (a prompt's chained block hashes) continues, with the block that keys it: the
    /// deepest block of the prompt that ended an earlier prompt.
    pub(super) fn continued(&self, hashes: &[u64]) -> Option<(u64, Conversation)> {
        hashes.iter().rev().find_map(|h| self.by_end.get(h).map(|c| (*h, *c)))
    }

    /// The requests a conversation that has made `made` is expected to make after this one: from the chance
    /// that a conversation goes on (the continuations seen against the conversations that ended, with `prior`
    /// counted as one ended conversation of that many requests), and never past `prior` requests in all.
    pub(super) fn remaining_turns(&self, prior: u32, made: u32) -> f64 {
        let prior_continuations = f64::from(prior.saturating_sub(1));
        let went_on = prior_continuations + self.continuations;
        let chance = went_on / (went_on + 1.0 + self.ends);
        (chance / (1.0 - chance)).min(f64::from(prior.saturating_sub(made)))
    }

    /// The summed pace at `now_us` of the conversations at `slot` other than `own` (keyed by its end block).
    pub(super) fn load(&self, slot: usize, own: Option<u64>, now_us: u64) -> f64 {
        let Some(paces) = self.slots.get(slot) else {
            return 0.0;
        };
        let mut load = paces.known;
        if let Some(c) = own.and_then(|end| self.by_end.get(&end)).filter(|c| c.slot == slot) {
            load -= c.pace.unwrap_or(0.0);
        }
        let mean = self.mean_pace();
        for (end, c) in &paces.fresh {
            if Some(*end) != own {
                load += fresh_pace(c, mean, now_us);
            }
        }
        load.max(0.0)
    }

    /// The pace a conversation without one is counted at, at most: the mean of the known, or a busy endpoint's.
    fn mean_pace(&self) -> f64 {
        match self.known {
            (sum, count) if count > 0 => sum / f64::from(count),
            _ => 1.0,
        }
    }

    /// Records a request of prompt `hashes` routed to `slot` at `now_us`, prefilling there for `service_us`:
    /// the conversation `continued` (from [`Self::continued`]) goes on there, or a new one starts. Conversations
    /// idle for `idle_us` are forgotten.
    pub(super) fn record(
        &mut self,
        slot: usize,
        hashes: &[u64],
        continued: Option<(u64, Conversation)>,
        service_us: u64,
        now_us: u64,
        idle_us: u64,
    ) {
        self.forget_idle(now_us, idle_us);
        self.forget_single(now_us);
        let Some(&end) = hashes.last() else { return };
        // A conversation recorded under this end at this very time is already queued to go idle.
        let queued = self.by_end.get(&end).is_some_and(|c| c.last_us == now_us);
        let (turns, pace) = match continued {
            // The same prompt again (a retry, a regenerated answer): no new turn.
            Some((key, earlier)) if key == end && self.by_end.get(&key) == Some(&earlier) => {
                self.remove(key);
                (earlier.turns, earlier.pace)
            }
            Some((key, earlier)) if self.by_end.get(&key) == Some(&earlier) => {
                self.remove(key);
                // The next gap, if the client waits for each answer: this one, with the earlier prefill's time
                // (cold, for a first request) replaced by this one's.
                let gap = (now_us
                    .saturating_sub(earlier.last_us)
                    .saturating_sub(earlier.service_us)
                    + service_us)
                    .max(1);
                self.continuations += 1.0;
                (earlier.turns + 1, Some((service_us as f64 / gap as f64).min(1.0)))
            }
            _ => (1, None),
        };
        // The chance follows the recent conversations: halve the counts now and then.
        if self.continuations + self.ends > COUNTS_HALVED_AT {
            self.continuations /= 2.0;
            self.ends /= 2.0;
        }
        // Another conversation that ended on the same prompt is replaced.
        self.remove(end);
        while self.by_end.len() >= MAX_CONVERSATIONS {
            let Some((_, oldest)) = self.idle.pop_front() else {
                break;
            };
            self.end(oldest);
        }
        let conversation = Conversation {
            slot,
            last_us: now_us,
            turns,
            pace,
            service_us,
        };
        self.add(end, conversation);
        if !queued {
            self.idle.push_back((now_us, end));
            if pace.is_none() {
                let over = now_us.saturating_add(service_us.saturating_mul(SINGLE_AFTER_PREFILLS).min(idle_us));
                self.single.push(Reverse((over, now_us, end)));
            }
        }
    }

    /// Forgets the conversations at `slot` (its endpoint left).
    pub(super) fn reset(&mut self, slot: usize) {
        let ends: Vec<u64> = self
            .by_end
            .iter()
            .filter(|(_, c)| c.slot == slot)
            .map(|(end, _)| *end)
            .collect();
        for end in ends {
            self.remove(end);
        }
    }

    /// How many conversations are followed.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by_end.len()
    }

    /// Ends the conversations that made one request and have not come back in a hundred times its prefill time (a
    /// single question, not a conversation), or in the idle time.
    fn forget_single(&mut self, now_us: u64) {
        while let Some(&Reverse((over, since, end))) = self.single.peek() {
            if over > now_us {
                break;
            }
            self.single.pop();
            if self
                .by_end
                .get(&end)
                .is_some_and(|c| c.last_us == since && c.pace.is_none())
            {
                self.end(end);
            }
        }
        // Entries of conversations that went on or were forgotten leave as they come due; past twice the most
        // conversations followed, they leave at once.
        if self.single.len() > 2 * MAX_CONVERSATIONS {
            let by_end = &self.by_end;
            self.single.retain(|Reverse((_, since, end))| {
                by_end.get(end).is_some_and(|c| c.last_us == *since && c.pace.is_none())
            });
        }
    }

    fn forget_idle(&mut self, now_us: u64, idle_us: u64) {
        while let Some(&(since, end)) = self.idle.front() {
            if since.saturating_add(idle_us) > now_us {
                break;
            }
            self.idle.pop_front();
            // A conversation that went on since is queued again under its newer time.
            if self.by_end.get(&end).is_some_and(|c| c.last_us == since) {
                self.end(end);
            }
        }
        // Entries of conversations that went on leave the queue as they reach its front.
        if self.idle.len() > 2 * MAX_CONVERSATIONS {
            let by_end = &self.by_end;
            self.idle
                .retain(|(since, end)| by_end.get(end).is_some_and(|c| c.last_us == *since));
        }
    }

    fn add(&mut self, end: u64, c: Conversation) {
        if self.slots.len() <= c.slot {
            self.slots.resize(c.slot + 1, SlotPaces::default());
        }
        let paces = &mut self.slots[c.slot];
        match c.pace {
            Some(p) => {
                paces.known += p;
                self.known.0 += p;
                self.known.1 += 1;
            }
            None => {
                // The oldest beyond the bound stop counting (they would count least), and stay followed.
                if paces.fresh.len() >= MAX_FRESH_PER_SLOT {
                    paces.fresh.remove(0);
                }
                paces.fresh.push((end, c));
            }
        }
        self.by_end.insert(end, c);
    }

    /// `end`'s conversation is over.
    fn end(&mut self, end: u64) {
        if self.by_end.contains_key(&end) {
            self.ends += 1.0;
            self.remove(end);
        }
    }

    fn remove(&mut self, end: u64) {
        let Some(c) = self.by_end.remove(&end) else { return };
        let paces = &mut self.slots[c.slot];
        match c.pace {
            Some(p) => {
                paces.known = (paces.known - p).max(0.0);
                self.known.0 = (self.known.0 - p).max(0.0);
                self.known.1 -= 1;
            }
            None => paces.fresh.retain(|(e, _)| *e != end),
        }
    }
}

/// The pace counted at `now_us` for a conversation that has made one request: at most `mean`, and at most its
/// prefill time over the time since (it has not come back).
fn fresh_pace(c: &Conversation, mean: f64, now_us: u64) -> f64 {
    let since = now_us.saturating_sub(c.last_us).max(1);
    mean.min(c.service_us as f64 / since as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: u64 = 60_000_000;
    const S: u64 = 1_000_000;

    #[test]
    fn a_prompt_that_contains_an_earlier_prompts_last_block_continues_it() {
        let mut c = Conversations::default();
        c.record(2, &[1, 2, 3], None, S, 0, IDLE);
        let next = [1, 2, 3, 4, 5];
        let (key, earlier) = c.continued(&next).expect("continues");
        assert_eq!((key, earlier.slot, earlier.turns), (3, 2, 1));
        // Another prompt on the same prefix does not (its deepest shared block ended no prompt).
        assert_eq!(c.continued(&[1, 2, 9]), None);
        c.record(2, &next, Some((key, earlier)), S, 4 * S, IDLE);
        assert_eq!(c.len(), 1);
        let (end, now) = c.continued(&[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!((end, now.turns), (5, 2));
        // 1 s of prefill every 4 s.
        assert_eq!(c.load(2, None, 5 * S), 0.25);
        assert_eq!(c.load(2, Some(5), 5 * S), 0.0, "its own pace is left out");
        // The same prompt again is no new turn, and queues no second entry to go idle, even at the same time.
        c.record(2, &next, Some((end, now)), S, 5 * S, IDLE);
        assert_eq!(c.continued(&next).unwrap().1.turns, 2);
        for _ in 0..3 {
            c.record(2, &next, c.continued(&next), S, 5 * S, IDLE);
        }
        assert_eq!(c.idle.len(), 3, "the first two records' entries and one at 5 s");
        // No conversation has ended: the prior's 30 continuations and one end, and the one continuation seen.
        assert_eq!(c.remaining_turns(31, 2), 29.0, "never past the prior");
        assert_eq!(c.remaining_turns(3, 1), 2.0);
        assert_eq!(c.remaining_turns(1, 1), 0.0);
    }

    #[test]
    fn conversations_that_end_lower_the_chance_that_one_goes_on() {
        let mut c = Conversations::default();
        // Ten single questions 1 s apart, each 10 ms of prefill: each is over a second (a hundred prefill times)
        // after it was asked, whenever a request comes.
        for i in 0..10u64 {
            c.record((i % 2) as usize, &[100 + i], None, S / 100, i * S + S / 2, IDLE);
        }
        assert_eq!(c.len(), 1, "the nine asked a second or more before the last are over");
        // The prior (29 continuations, one end) and nine ends: a 29-in-39 chance, 2.9 more turns.
        let remaining = c.remaining_turns(30, 1);
        assert!((remaining - 29.0 / 10.0).abs() < 1e-9, "{remaining}");
        // Idle conversations end too.
        c.record(1, &[1], None, S, 20 * S + IDLE, IDLE);
        assert_eq!(c.len(), 1);
        assert!(c.remaining_turns(30, 1) < remaining);
    }

    #[test]
    fn a_conversation_without_a_pace_counts_at_most_the_mean_and_fades_while_it_does_not_come_back() {
        let mut c = Conversations::default();
        c.record(0, &[10], None, 2 * S, 0, IDLE);
        assert_eq!(c.load(0, None, S), 1.0, "no pace known yet: busy");
        assert_eq!(
            c.load(0, None, 4 * S),
            0.5,
            "not back after 4 s: at most 2 s of prefill in 4"
        );
        assert_eq!(c.load(1, None, S), 0.0);
        let first = c.continued(&[10, 11]);
        c.record(0, &[10, 11], first, S, 5 * S, IDLE);
        c.record(1, &[20], None, S, 5 * S, IDLE);
        // 1 s of prefill in a 4 s cycle: 5 s between the requests, less the first one's 2 s, plus this one's 1 s.
        assert_eq!(c.load(0, None, 6 * S), 0.25);
        assert_eq!(c.load(1, None, 6 * S), 0.25, "at most the mean known pace");
        assert_eq!(c.load(1, None, 15 * S), 0.1);
        // Below 1% it is dropped from the slot's count when the slot next takes a conversation.
        c.record(1, &[30], None, S, 200 * S, IDLE);
        assert_eq!(c.load(1, Some(30), 200 * S), 0.0);
    }

    #[test]
    fn idle_conversations_are_forgotten_and_the_count_is_bounded() {
        let mut c = Conversations::default();
        c.record(0, &[1], None, S, 0, IDLE);
        let went_on = c.continued(&[1, 2]);
        c.record(0, &[1, 2], went_on, S, IDLE / 2, IDLE);
        c.record(1, &[7], None, S, IDLE / 2, IDLE);
        // At IDLE the first record's queue entry is stale (the conversation went on), so nothing is forgotten.
        c.record(1, &[8], None, S, IDLE, IDLE);
        assert_eq!(c.len(), 3);
        c.record(1, &[9], None, S, IDLE / 2 + IDLE, IDLE);
        assert_eq!(c.len(), 2, "the two idle since IDLE / 2 are over");
        assert_eq!(c.load(0, None, IDLE / 2 + IDLE), 0.0);
        for i in 0..(MAX_CONVERSATIONS as u64 + 10) {
            c.record(0, &[1_000 + i], None, S, 2 * IDLE, IDLE);
        }
        assert_eq!(c.len(), MAX_CONVERSATIONS);
        // All made one request just now, but only the newest count, each as busy (no pace known).
        assert_eq!(c.load(0, None, 2 * IDLE + 1), MAX_FRESH_PER_SLOT as f64);
        c.reset(0);
        assert_eq!((c.len(), c.load(0, None, 2 * IDLE)), (0, 0.0));
    }
}
