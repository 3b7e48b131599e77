//! `least_loaded`: the candidate with the fewest prompt tokens in flight (then the fewest requests in flight), as
//! the router itself counts them; among equals, the first from a start that moves one candidate per request, so
//! idle endpoints share a sequential client's requests instead of the lowest rank taking them all (what
//! `total_tokens` does, for SGLang parity). The default decode policy under prefill/decode disaggregation, where a
//! request's cost is its KV cache held through a long decode. O(candidates) per request.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::error::RouteError;
use crate::policy::{Branch, Candidates, Pick, Policy, Prepared};
use crate::request::RouteRequest;

#[derive(Debug, Default)]
pub struct LeastLoaded {
    start: AtomicU64,
}

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
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
        let turn = if req.dry_run {
            self.start.load(Relaxed)
        } else {
            self.start.fetch_add(1, Relaxed)
        };
        let start = (turn % n as u64) as usize;
        let snap = candidates.snap();
        let load = |r: usize| {
            let l = snap.load(r);
            (l.in_flight_tokens(), l.in_flight_requests())
        };
        candidates
            .iter()
            .skip(start)
            .chain(candidates.iter().take(start))
            .min_by_key(|&r| load(r))
            .map(|r| Pick::new(r, Branch::LeastLoaded))
            .ok_or(RouteError::NoHealthyEndpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::policy::testing::ranks;

    #[test]
    fn idle_endpoints_take_turns() {
        let snap = Snapshot::single_worker(3);
        let reqs: Vec<RouteRequest> = (0..3).map(|_| RouteRequest::tokens(vec![1; 10])).collect();
        // Each ticket is dropped at once: every endpoint is idle at each pick, and the ties rotate.
        let policy = LeastLoaded::default();
        let chosen: Vec<usize> = reqs
            .iter()
            .map(|r| crate::ticket::dispatch(&policy, &snap, r.clone()).unwrap().pick.rank)
            .collect();
        assert_eq!(chosen, vec![0, 1, 2]);
    }

    #[test]
    fn the_fewest_tokens_in_flight_win() {
        let snap = Snapshot::single_worker(3);
        let big = RouteRequest::tokens(vec![1; 1000]);
        let small = RouteRequest::tokens(vec![1; 10]);
        // Held: rank 0 gets 1000 tokens, rank 1 10 tokens; rank 2 is idle and takes the next; then rank 1.
        let policy = LeastLoaded::default();
        let (first, _held) = ranks(&policy, &snap, &[big, small.clone(), small.clone(), small]);
        assert_eq!(first, vec![0, 1, 2, 1]);
    }
}
