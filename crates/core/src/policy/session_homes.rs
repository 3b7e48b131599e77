//! Where each active session went last, so that its next turn goes home. An agent's turn comes back seconds after
//! its previous answer, once its tool has run (the vLLM router's data: 86% within 1 s, 95% within 10 s), expecting
//! its prefix still cached where it left it; its prompt alone may not say where that is (a turn whose new part
//! outweighs what the index still holds of it, a prompt shorter than a block, an index that lost track). The
//! cache-aware policies send a session's request to its home while the session is active: `prefix_affinity` keys
//! on the session itself; `cache_aware` keeps it home while the home is routable and predicted within
//! `session_home_margin_ms` of the best endpoint (a home busy prefilling, or whose cache the turn would overflow,
//! is left: measured in `docs/measurements.md`, "Session homes").
//!
//! Bounded: a session idle past `ttl_us` is forgotten, and at most `capacity` sessions are remembered (the least
//! recently seen go first). Each costs one map entry and at most two queue entries: about 100 bytes.

use std::collections::{HashMap, VecDeque};

use crate::endpoint::EndpointId;

/// The most sessions a policy remembers.
pub const SESSION_CAPACITY: usize = 65_536;

/// Where the active sessions went last.
#[derive(Debug, Default)]
pub struct SessionHomes {
    ttl_us: u64,
    capacity: usize,
    homes: HashMap<u64, Home>,
    /// `(session, seen_us)` in the order they were recorded; an entry whose time is not its session's last is stale.
    order: VecDeque<(u64, u64)>,
}

#[derive(Debug, Clone, Copy)]
struct Home {
    endpoint: EndpointId,
    seen_us: u64,
}

impl SessionHomes {
    pub fn new(ttl_us: u64, capacity: usize) -> Self {
        Self {
            ttl_us,
            capacity: capacity.max(1),
            homes: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Whether sessions are kept at all (a TTL of 0 keeps none).
    pub fn enabled(&self) -> bool {
        self.ttl_us > 0
    }

    /// The home of `session`, if it is active at `now_us`.
    pub fn home(&self, session: u64, now_us: u64) -> Option<EndpointId> {
        let home = self.homes.get(&session)?;
        (now_us.saturating_sub(home.seen_us) < self.ttl_us).then_some(home.endpoint)
    }

    /// `session` was sent to `endpoint` at `now_us`.
    pub fn record(&mut self, session: u64, endpoint: EndpointId, now_us: u64) {
        if !self.enabled() {
            return;
        }
        self.homes.insert(
            session,
            Home {
                endpoint,
                seen_us: now_us,
            },
        );
        self.order.push_back((session, now_us));
        self.expire(now_us);
    }

    /// Forgets the sessions idle past the TTL, and the least recently seen beyond the capacity.
    pub fn expire(&mut self, now_us: u64) {
        while let Some(&(session, seen_us)) = self.order.front() {
            let idle = now_us.saturating_sub(seen_us) >= self.ttl_us;
            if !idle && self.homes.len() <= self.capacity && self.order.len() <= 2 * self.capacity {
                break;
            }
            self.order.pop_front();
            let last = self.homes.get(&session).map(|h| h.seen_us);
            if last == Some(seen_us) && (idle || self.homes.len() > self.capacity) {
                self.homes.remove(&session);
            } else if last == Some(seen_us) {
                // Only the queue was too long (a busy session's older entries): its entry goes back, at the end.
                self.order.push_back((session, seen_us));
            }
        }
    }

    /// The sessions remembered.
    pub fn len(&self) -> usize {
        self.homes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.homes.is_empty()
    }

    /// The sessions active at `now_us` whose home is `endpoint`.
    pub fn at(&self, endpoint: EndpointId, now_us: u64) -> usize {
        self.homes
            .values()
            .filter(|h| h.endpoint == endpoint && now_us.saturating_sub(h.seen_us) < self.ttl_us)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(rank: u32) -> EndpointId {
        EndpointId {
            worker: crate::endpoint::WorkerId(0),
            dp_rank: rank,
        }
    }

    #[test]
    fn a_session_is_home_until_it_idles_past_the_ttl() {
        let mut homes = SessionHomes::new(1_000, 10);
        homes.record(7, endpoint(1), 0);
        assert_eq!(homes.home(7, 999), Some(endpoint(1)));
        assert_eq!(homes.home(7, 1_000), None);
        homes.record(7, endpoint(2), 900);
        assert_eq!(homes.home(7, 1_800), Some(endpoint(2)), "each turn renews it");
        assert_eq!(homes.home(8, 0), None);
        homes.expire(5_000);
        assert!(homes.is_empty());
        assert!(!SessionHomes::new(0, 10).enabled());
    }

    #[test]
    fn at_most_the_capacity_is_kept_the_least_recently_seen_go_first() {
        let mut homes = SessionHomes::new(u64::MAX, 100);
        for session in 0..1_000u64 {
            homes.record(session, endpoint((session % 4) as u32), session);
            // A busy session renewed on every request stays.
            homes.record(u64::MAX, endpoint(0), session);
        }
        assert_eq!(homes.len(), 100);
        assert!(homes.order.len() <= 200, "{}", homes.order.len());
        assert_eq!(homes.home(u64::MAX, 1_000), Some(endpoint(0)));
        assert_eq!(homes.home(999, 1_000), Some(endpoint(3)));
        assert_eq!(homes.home(0, 1_000), None, "the oldest went first");
        assert_eq!(homes.at(endpoint(3), 1_000), 25);
    }

    #[test]
    fn a_hundred_thousand_sessions_cost_bounded_memory() {
        let mut homes = SessionHomes::new(60_000_000, 65_536);
        for session in 0..100_000u64 {
            homes.record(session, endpoint(0), session * 10);
        }
        assert_eq!(homes.len(), 65_536);
        assert!(homes.order.len() <= 2 * 65_536);
        // All idle past the TTL: forgotten at the next record.
        homes.record(1, endpoint(1), 10_000_000_000);
        assert_eq!(homes.len(), 1);
    }
}
