//! `round_robin`: SGLang's default method.
//!
//! A counter starts at 0; each request goes to `healthy[counter % len(healthy)]` and advances the counter, so the
//! first request goes to the lowest healthy rank and down ranks are skipped. Rank overrides never advance it
//! (see [`crate::policy::route`]). O(1) per request.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::error::RouteError;
use crate::policy::{Branch, Candidates, Pick, Policy, Prepared};
use crate::request::RouteRequest;

#[derive(Debug, Default)]
pub struct RoundRobin {
    counter: AtomicU64,
}

impl RoundRobin {
    /// The next turn among the healthy endpoints, labelled `branch`; it advances unless `req` is a dry run.
    /// Shared by policies that fall back to it.
    pub(crate) fn next(
        &self,
        candidates: &Candidates<'_>,
        req: &RouteRequest,
        branch: Branch,
    ) -> Result<Pick, RouteError> {
        let n = candidates.count();
        if n == 0 {
            return Err(RouteError::NoHealthyEndpoint);
        }
        let turn = if req.dry_run {
            self.counter.load(Relaxed)
        } else {
            self.counter.fetch_add(1, Relaxed)
        };
        let slot = (turn % n as u64) as usize;
        candidates
            .nth(slot)
            .map(|rank| Pick::new(rank, branch))
            .ok_or(RouteError::NoHealthyEndpoint)
    }
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn choose(
        &self,
        candidates: &Candidates<'_>,
        req: &RouteRequest,
        _prepared: &Prepared,
    ) -> Result<Pick, RouteError> {
        self.next(candidates, req, Branch::Turn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::policy::testing::{empty_requests, ranks};
    use proptest::prelude::*;

    #[test]
    fn eight_requests_over_four_ranks_start_at_zero_two_each() {
        let policy = RoundRobin::default();
        let (got, _held) = ranks(&policy, &Snapshot::single_worker(4), &empty_requests(8));
        assert_eq!(got, vec![0, 1, 2, 3, 0, 1, 2, 3]);
    }

    #[test]
    fn down_ranks_are_skipped() {
        let snap = Snapshot::single_worker(4).with_health(|i, _| i != 1);
        let policy = RoundRobin::default();
        let (got, _held) = ranks(&policy, &snap, &empty_requests(6));
        assert_eq!(got, vec![0, 2, 3, 0, 2, 3]);
    }

    #[test]
    fn override_does_not_advance_the_counter() {
        let snap = Snapshot::single_worker(4);
        let policy = RoundRobin::default();
        let plain = RouteRequest::tokens(vec![1]);
        let pinned = plain.clone().with_override(3);
        let (got, _held) = ranks(
            &policy,
            &snap,
            &[plain.clone(), pinned.clone(), pinned, plain.clone(), plain],
        );
        assert_eq!(got, vec![0, 3, 3, 1, 2]);
    }

    proptest! {
        #[test]
        fn fair_over_healthy_endpoints(
            health in proptest::collection::vec(any::<bool>(), 1..12),
            rounds in 1usize..6,
        ) {
            let snap = Snapshot::single_worker(health.len() as u32).with_health(|i, _| health[i]);
            let healthy = snap.healthy().len();
            prop_assume!(healthy > 0);
            let policy = RoundRobin::default();
            let (got, _held) = ranks(&policy, &snap, &empty_requests(healthy * rounds));
            let mut counts = vec![0usize; health.len()];
            for r in got {
                counts[r] += 1;
            }
            for (i, c) in counts.into_iter().enumerate() {
                prop_assert_eq!(c, if health[i] { rounds } else { 0 });
            }
        }
    }
}
