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

    /// The real time of the next completion if no prefill starts before it; `None` while stalled or with no
    /// decode running.
    pub fn next_due(&self) -> Option<Micros> {
        let Reverse((due, _, _)) = self.due.peek()?;
        self.running().then(|| self.at + due.saturating_sub(self.progress))
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
