//! `total_requests`: the healthy rank with the fewest running + waiting requests, ties to the lowest rank.
//!
//! Reads [`EndpointLoad::view`](crate::load::EndpointLoad::view): the latest engine report plus one speculative
//! request per dispatch since it, so a burst between two reports spreads out instead of piling onto one rank
//! (SGLang's `DPBudget`). O(healthy endpoints) per request.

use crate::error::RouteError;
use crate::policy::{argmin, Branch, Candidates, Pick, Policy, Prepared};
use crate::request::RouteRequest;

#[derive(Debug, Default)]
pub struct TotalRequests;

impl Policy for TotalRequests {
    fn name(&self) -> &'static str {
        "total_requests"
    }

    fn choose(
        &self,
        candidates: &Candidates<'_>,
        _req: &RouteRequest,
        _prepared: &Prepared,
    ) -> Result<Pick, RouteError> {
        let snap = candidates.snap();
        argmin(candidates, |r| snap.load(r).view().requests)
            .map(|r| Pick::new(r, Branch::LeastLoaded))
            .ok_or(RouteError::NoHealthyEndpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::load::EngineReport;
    use crate::policy::testing::{empty_requests, ranks};
    use crate::ticket::dispatch;

    fn report(snap: &Snapshot, requests: &[u64], timestamp: u64) {
        for (r, &n) in requests.iter().enumerate() {
            snap.load(r).apply_report(EngineReport {
                requests: n,
                timestamp,
                ..Default::default()
            });
        }
    }

    #[test]
    fn picks_least_loaded_and_counts_it_speculatively() {
        let snap = Snapshot::single_worker(4);
        report(&snap, &[5, 3, 1, 4], 1);
        let d = dispatch(&TotalRequests, &snap, RouteRequest::tokens(vec![7])).unwrap();
        assert_eq!(d.pick, Pick::new(2, Branch::LeastLoaded));
        assert_eq!(snap.load(2).view().requests, 2);
    }

    #[test]
    fn all_zero_ties_go_round_the_ranks() {
        let (got, _held) = ranks(&TotalRequests, &Snapshot::single_worker(3), &empty_requests(4));
        assert_eq!(got, vec![0, 1, 2, 0]);
    }

    #[test]
    fn stale_report_keeps_speculative_counts() {
        let snap = Snapshot::single_worker(2);
        report(&snap, &[0, 0], 7);
        let (_, _held) = ranks(&TotalRequests, &snap, &empty_requests(3));
        assert_eq!((snap.load(0).view().requests, snap.load(1).view().requests), (2, 1));
        report(&snap, &[0, 0], 7);
        assert_eq!((snap.load(0).view().requests, snap.load(1).view().requests), (2, 1));
        report(&snap, &[0, 9], 8);
        assert_eq!((snap.load(0).view().requests, snap.load(1).view().requests), (0, 9));
    }

    #[test]
    fn never_picks_a_down_rank_even_when_least_loaded() {
        let snap = Snapshot::single_worker(3);
        report(&snap, &[5, 0, 3], 1);
        let snap = snap.with_health(|i, _| i != 1);
        assert_eq!(ranks(&TotalRequests, &snap, &empty_requests(1)).0, vec![2]);
    }
}
