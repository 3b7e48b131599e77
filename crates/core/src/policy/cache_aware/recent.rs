//! How many requests each endpoint was sent recently: a count that halves every `recent_half_life_s` of request time.
//!
//! `cache_aware` compares predicted times to first token, and when the fleet's queues are empty (a trace at a few
//! requests per second over 32 ranks) every endpoint predicts the same for a prompt nobody holds. Such a cold
//! placement goes to the rendezvous choice of the prompt's first block (or session), as before, but passes over
//! an endpoint sent more than `1 + recent_epsilon` times the mean recent count (consistent hashing with bounded
//! loads, over recent requests). Without the bound every conversation that begins with the same block (a shared
//! system prompt) chose the same endpoint, which then held them all: on the Mooncake conversation trace at dp 32
//! the busiest rank took 2.3 times the mean, and the conversations it held evicted each other. The counts decay so
//! that an endpoint that joins, or comes back, takes its share of new conversations within about a half-life, not
//! after it has caught up with the others' totals.

/// Per slot: the decayed count and the request time it was last brought to, microseconds.
#[derive(Debug, Default)]
pub(super) struct Recent {
    counts: Vec<(f64, u64)>,
}

impl Recent {
    /// `slot`'s count at `now_us`, with a half-life of `half_life_us`.
    pub(super) fn count(&self, slot: usize, now_us: u64, half_life_us: f64) -> f64 {
        self.counts.get(slot).map_or(0.0, |&(count, at)| {
            decayed(count, now_us.saturating_sub(at), half_life_us)
        })
    }

    /// One more request sent to `slot` at `now_us`.
    pub(super) fn record(&mut self, slot: usize, now_us: u64, half_life_us: f64) {
        if self.counts.len() <= slot {
            self.counts.resize(slot + 1, (0.0, 0));
        }
        let (count, at) = self.counts[slot];
        // Requests may finish routing out of clock order: never decay backwards.
        self.counts[slot] = (
            decayed(count, now_us.saturating_sub(at), half_life_us) + 1.0,
            at.max(now_us),
        );
    }

    /// Forgets `slot` (its endpoint left).
    pub(super) fn reset(&mut self, slot: usize) {
        if let Some(c) = self.counts.get_mut(slot) {
            *c = (0.0, 0);
        }
    }
}

fn decayed(count: f64, elapsed_us: u64, half_life_us: f64) -> f64 {
    count * (-(elapsed_us as f64) / half_life_us * std::f64::consts::LN_2).exp()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::policy::{CacheAware, CacheAwareConfig};
    use crate::request::RouteRequest;
    use crate::ticket::dispatch;

    /// Requests per endpoint for 40 identical prompts too short to index, one a second: all cold, all with the
    /// same rendezvous choice.
    fn spread(config: CacheAwareConfig) -> Vec<usize> {
        let policy = CacheAware::new(config);
        let snap = Snapshot::single_worker(4);
        let mut per_rank = vec![0; 4];
        for i in 0..40u64 {
            let mut req = RouteRequest::tokens(vec![7, 8, 9]);
            req.now_us = i * 1_000_000;
            per_rank[dispatch(&policy, &snap, req).unwrap().pick.rank] += 1;
        }
        per_rank
    }

    #[test]
    fn cold_placements_pass_over_endpoints_sent_more_than_their_share() {
        // The rendezvous order fills each endpoint up to about 1 + recent_epsilon times the mean, then the next.
        let bounded = spread(CacheAwareConfig::default());
        assert!(bounded.iter().all(|&n| (5..=12).contains(&n)), "{bounded:?}");
        let unbounded = spread(CacheAwareConfig {
            recent_epsilon: 1e9,
            ..CacheAwareConfig::default()
        });
        assert_eq!(unbounded.iter().max(), Some(&40), "{unbounded:?}");
    }

    #[test]
    fn counts_halve_every_half_life() {
        let mut recent = Recent::default();
        let half_life = 60e6;
        for _ in 0..8 {
            recent.record(2, 0, half_life);
        }
        assert_eq!(recent.count(2, 0, half_life), 8.0);
        assert!((recent.count(2, 60_000_000, half_life) - 4.0).abs() < 1e-9);
        assert!((recent.count(2, 120_000_000, half_life) - 2.0).abs() < 1e-9);
        assert_eq!(
            (recent.count(0, 0, half_life), recent.count(9, 0, half_life)),
            (0.0, 0.0)
        );
        // A request routed with an older clock adds without decaying the count backwards.
        recent.record(2, 60_000_000, half_life);
        recent.record(2, 30_000_000, half_life);
        assert!((recent.count(2, 60_000_000, half_life) - 6.0).abs() < 1e-9);
        recent.reset(2);
        assert_eq!(recent.count(2, 60_000_000, half_life), 0.0);
    }
}
