//! `total_tokens`: the healthy rank with the least `(tokens, requests)`, compared in that order, ties to the lowest
//! rank.
//!
//! Tokens are the engine's used KV plus pending prompt tokens; each dispatch since the last report adds its prompt
//! length and one request speculatively (SGLang's `DPBudget`). O(healthy endpoints) per request.

use crate::error::RouteError;
use crate::policy::{argmin, Branch, Candidates, Pick, Policy, Prepared};
use crate::request::RouteRequest;

#[derive(Debug, Default)]
pub struct TotalTokens;

impl Policy for TotalTokens {
    fn name(&self) -> &'static str {
        "total_tokens"
    }

    fn choose(
        &self,
        candidates: &Candidates<'_>,
        _req: &RouteRequest,
        _prepared: &Prepared,
    ) -> Result<Pick, RouteError> {
        let snap = candidates.snap();
        argmin(candidates, |r| {
            let view = snap.load(r).view();
            (view.tokens, view.requests)
        })
        .map(|r| Pick::new(r, Branch::LeastLoaded))
        .ok_or(RouteError::NoHealthyEndpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::load::EngineReport;
    use crate::policy::testing::ranks;

    fn report(snap: &Snapshot, loads: &[(u64, u64)]) {
        for (r, &(tokens, requests)) in loads.iter().enumerate() {
            snap.load(r).apply_report(EngineReport {
                requests,
                tokens,
                timestamp: 1,
                ..Default::default()
            });
        }
    }

    #[test]
    fn fewest_tokens_wins_and_requests_break_ties() {
        let snap = Snapshot::single_worker(3);
        report(&snap, &[(100, 1), (50, 3), (50, 2)]);
        let (first, _held) = ranks(&TotalTokens, &snap, &[RouteRequest::tokens(vec![1; 10])]);
        assert_eq!(first, vec![2]);
        // Rank 2 now holds 60 tokens and 3 requests: rank 1 (50, 3) is next.
        assert_eq!(
            ranks(&TotalTokens, &snap, &[RouteRequest::tokens(vec![1; 10])]).0,
            vec![1]
        );
    }

    #[test]
    fn speculative_tokens_follow_prompt_length() {
        let snap = Snapshot::single_worker(2);
        let reqs = [
            RouteRequest::tokens(vec![1; 100]),
            RouteRequest::tokens(vec![1; 10]),
            RouteRequest::tokens(vec![1; 10]),
        ];
        // 0 gets 100 tokens; 1 gets 10, then 1 again (20 < 100).
        assert_eq!(ranks(&TotalTokens, &snap, &reqs).0, vec![0, 1, 1]);
    }
}
