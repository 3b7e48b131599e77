//! `random`: each request to a candidate drawn uniformly, as SGLang's router's `random` policy and the mini load
//! balancer of SGLang's prefill/decode disaggregation pick their prefill and decode servers. The baseline a
//! cache-aware router is measured against under disaggregation.
//!
//! The draws are SplitMix64's sequence from the policy's seed (a counter through [`mix64`]), mapped onto the
//! candidates by a 128-bit multiply: uniform, lock-free, and the same sequence in every run of the simulator for
//! the same seed. O(candidates) per request (the candidates are counted and walked).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

use crate::error::RouteError;
use crate::hashing::mix64;
use crate::policy::{Branch, Candidates, Pick, Policy, Prepared};
use crate::request::RouteRequest;

/// SplitMix64's increment: the golden ratio in 64 bits.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// `random`'s options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomConfig {
    /// Where the sequence of draws starts.
    #[serde(default)]
    pub seed: u64,
}

#[derive(Debug, Default)]
pub struct Random {
    state: AtomicU64,
}

impl Random {
    pub fn new(config: RandomConfig) -> Self {
        Self {
            state: AtomicU64::new(config.seed),
        }
    }
}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn choose(
        &self,
        candidates: &Candidates<'_>,
        req: &RouteRequest,
        _prepared: &Prepared,
    ) -> Result<Pick, RouteError> {
        let n = candidates.count();
        if n == 0 {
            return Err(RouteError::NoHealthyEndpoint);
        }
        let state = if req.dry_run {
            self.state.load(Relaxed).wrapping_add(GAMMA)
        } else {
            self.state.fetch_add(GAMMA, Relaxed).wrapping_add(GAMMA)
        };
        let slot = ((u128::from(mix64(state)) * n as u128) >> 64) as usize;
        candidates
            .nth(slot)
            .map(|rank| Pick::new(rank, Branch::Drawn))
            .ok_or(RouteError::NoHealthyEndpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::policy::testing::{empty_requests, ranks};

    #[test]
    fn draws_spread_evenly_skip_down_ranks_and_repeat_for_a_seed() {
        let snap = Snapshot::single_worker(4).with_health(|i, _| i != 2);
        let policy = Random::default();
        let (got, _held) = ranks(&policy, &snap, &empty_requests(3000));
        let mut counts = [0usize; 4];
        for r in &got {
            counts[*r] += 1;
        }
        assert_eq!(counts[2], 0);
        for r in [0, 1, 3] {
            assert!((900..1100).contains(&counts[r]), "{counts:?}");
        }
        let policy = Random::default();
        let (again, _held) = ranks(&policy, &snap, &empty_requests(3000));
        assert_eq!(got, again);
        let policy = Random::new(RandomConfig { seed: 7 });
        let (other, _held) = ranks(&policy, &snap, &empty_requests(3000));
        assert_ne!(got, other);
    }

    #[test]
    fn a_dry_run_does_not_advance_the_sequence() {
        let snap = Snapshot::single_worker(8);
        let policy = Random::default();
        let mut dry = RouteRequest::tokens(vec![1, 2, 3]);
        dry.dry_run = true;
        let first = crate::ticket::dispatch(&policy, &snap, dry.clone()).unwrap().pick.rank;
        assert_eq!(crate::ticket::dispatch(&policy, &snap, dry).unwrap().pick.rank, first);
        let real = crate::ticket::dispatch(&policy, &snap, RouteRequest::tokens(vec![1, 2, 3])).unwrap();
        assert_eq!(real.pick.rank, first);
    }
}
