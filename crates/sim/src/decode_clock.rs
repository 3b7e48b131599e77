//! When decodes finish, with or without prefill stalling them.
//!
//! Every decode needs a fixed amount of decode time (the [`CostModel`](crate::cost::CostModel)'s `decode`). When
//! prefill does not stall decode, decode time is real time. When it does (`prefill_stalls_decode`, SGLang's DP
//! attention: all ranks run each forward pass together, so a long prefill on any rank holds every rank's decode
//! step), decode time stands still while any rank is prefilling. The clock keeps `progress`, the decode time
//! elapsed so far, and each running decode's completion as a `progress` value; the real time of the next
//! completion is known only until the next prefill starts, so the simulator asks again after every change.
//!
//! Cost: O(log decodes) per start and completion, O(1) per prefill start or end.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::cost::Micros;

#[derive(Debug, Default)]
pub struct DecodeClock {
    stalls: bool,
    /// Ranks prefilling now.
    prefilling: usize,
    /// Decode time elapsed up to `at`.
    progress: Micros,
    at: Micros,
    /// Running decodes: (progress at which it completes, start order, slot).
    due: BinaryHeap<Reverse<(Micros, u64, usize)>>,
    started: u64,
}

impl DecodeClock {
    /// A clock on which decode stalls while any rank prefills if `stalls`.
    pub fn new(stalls: bool) -> Self {
        Self {
            stalls,
            ..Self::default()
        }
    }

    fn running(&self) -> bool {
        !self.stalls || self.prefilling == 0
    }

    fn advance(&mut self, now: Micros) {
        if self.running() {
            self.progress += now.saturating_sub(self.at);
        }
        self.at = self.at.max(now);
    }

    /// A rank began a prefill at `now`.
    pub fn prefill_started(&mut self, now: Micros) {
        self.advance(now);
        self.prefilling += 1;
    }

    /// A rank finished a prefill at `now`.
    pub fn prefill_ended(&mut self, now: Micros) {
        self.advance(now);
        self.prefilling = self.prefilling.saturating_sub(1);
    }

    /// The decode of `slot` starts at `now` and needs `duration` of decode time.
    pub fn start(&mut self, now: Micros, duration: Micros, slot: usize) {
        self.advance(now);
        self.started += 1;
        self.due.push(Reverse((self.progress + duration, self.started, slot)));
    }

    /// The real time of the next completion if no prefill starts before it: now for a decode already complete
    /// (even if a prefill has just stalled the rest), `None` while stalled or with no decode running.
    pub fn next_due(&self) -> Option<Micros> {
        let &Reverse((due, _, _)) = self.due.peek()?;
        (due <= self.progress || self.running()).then(|| self.at + due.saturating_sub(self.progress))
    }

    /// The decodes complete by `now`, in completion order (ties in start order).
    pub fn take_due(&mut self, now: Micros) -> Vec<usize> {
        self.advance(now);
        let mut done = Vec::new();
        while let Some(&Reverse((due, _, slot))) = self.due.peek() {
            if due > self.progress {
                break;
            }
            self.due.pop();
            done.push(slot);
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Against a naive model that walks time one microsecond at a time: a decode completes once the time
        /// since its start during which no rank prefilled (any time, without stalls) reaches its duration.
        #[test]
        fn agrees_with_walking_time(
            stalls in any::<bool>(),
            prefills in proptest::collection::vec((0u64..400, 1u64..60), 0..8),
            decodes in proptest::collection::vec((0u64..400, 0u64..120), 1..8),
        ) {
            let stalled = |t: u64| stalls && prefills.iter().any(|&(s, d)| s <= t && t < s + d);
            let naive: Vec<u64> = decodes
                .iter()
                .map(|&(start, duration)| {
                    let (mut t, mut done) = (start, 0);
                    while done < duration {
                        if !stalled(t) {
                            done += 1;
                        }
                        t += 1;
                    }
                    t
                })
                .collect();
            // Drive the clock with every event in time order, then ask at every microsecond what completed.
            let mut events: Vec<(u64, u8, usize)> = Vec::new();
            for (i, &(s, d)) in prefills.iter().enumerate() {
                events.push((s + d, 0, i));
                events.push((s, 1, i));
            }
            for (i, &(s, _)) in decodes.iter().enumerate() {
                events.push((s, 2, i));
            }
            events.sort();
            let mut clock = DecodeClock::new(stalls);
            let mut finished = vec![None; decodes.len()];
            let (mut next, mut predicted) = (0, None);
            for t in 0..2_000 {
                while next < events.len() && events[next].0 == t {
                    let (_, kind, i) = events[next];
                    match kind {
                        0 => clock.prefill_ended(t),
                        1 => clock.prefill_started(t),
                        _ => clock.start(t, decodes[i].1, i),
                    }
                    next += 1;
                    predicted = clock.next_due();
                }
                let done = clock.take_due(t);
                if !done.is_empty() {
                    // The simulator wakes up only at the predicted time: it must be exactly when decodes finish.
                    prop_assert_eq!(predicted, Some(t));
                    predicted = clock.next_due();
                }
                for slot in done {
                    finished[slot] = Some(t);
                }
            }
            let expected: Vec<Option<u64>> = naive.into_iter().map(Some).collect();
            prop_assert_eq!(finished, expected);
        }
    }

    #[test]
    fn without_stalls_decode_time_is_real_time() {
        let mut c = DecodeClock::new(false);
        c.start(10, 100, 1);
        c.prefill_started(20);
        c.start(30, 50, 2);
        assert_eq!(c.next_due(), Some(80));
        assert_eq!(c.take_due(79), Vec::<usize>::new());
        assert_eq!(c.take_due(80), vec![2]);
        c.prefill_ended(90);
        assert_eq!(c.next_due(), Some(110));
        assert_eq!(c.take_due(200), vec![1]);
        assert_eq!(c.next_due(), None);
    }

    #[test]
    fn a_prefill_anywhere_holds_every_decode() {
        let mut c = DecodeClock::new(true);
        c.start(0, 100, 1);
        c.start(0, 100, 2);
        // Two overlapping prefills, 40..70 and 60..90: decode stands still from 40 to 90.
        c.prefill_started(40);
        assert_eq!(c.next_due(), None);
        c.prefill_started(60);
        c.prefill_ended(70);
        assert_eq!(c.next_due(), None);
        assert_eq!(c.take_due(80), Vec::<usize>::new());
        c.prefill_ended(90);
        assert_eq!(c.next_due(), Some(150));
        assert_eq!(c.take_due(150), vec![1, 2]);
    }
}
