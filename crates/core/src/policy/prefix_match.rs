//! `prefix_match`: the prompt's prefix key modulo the number of ranks (SGLang PR #26612, our fixed key spec in
//! [`crate::prefix_key`]).
//!
//! Requests sharing their first window-aligned units land on the same rank, so its prefix cache serves them. An
//! empty prompt has nothing to key on and takes a round-robin turn. Unlike upstream, a key naming a down rank goes
//! to the next healthy rank in rank order (wrapping), so only that rank's keys move. Cost per request: hashing at
//! most 16 KiB plus, when the rank is down, a walk over the ranks.

use crate::error::RouteError;
use crate::policy::{Branch, Candidates, Pick, Policy, Prepared, RoundRobin};
use crate::prefix_key::PrefixWindow;
use crate::request::RouteRequest;

#[derive(Debug, Default)]
pub struct PrefixMatch {
    window: PrefixWindow,
    empty: RoundRobin,
}

impl PrefixMatch {
    pub fn new(window: PrefixWindow) -> Self {
        Self {
            window,
            empty: RoundRobin::default(),
        }
    }
}

impl Policy for PrefixMatch {
    fn name(&self) -> &'static str {
        "prefix_match"
    }

    fn choose(
        &self,
        candidates: &Candidates<'_>,
        req: &RouteRequest,
        _prepared: &Prepared,
    ) -> Result<Pick, RouteError> {
        if req.prompt.is_empty() {
            return self.empty.next(candidates, req, Branch::Empty);
        }
        let n = candidates.snap().len();
        let key = crate::hashing::namespaced(self.window.key(&req.prompt), req.namespace);
        let home = (key % n as u64) as usize;
        if candidates.contains(home) {
            return Ok(Pick::new(home, Branch::Hashed));
        }
        (1..n)
            .map(|step| (home + step) % n)
            .find(|&r| candidates.contains(r))
            .map(|r| Pick::new(r, Branch::Fallback))
            .ok_or(RouteError::NoHealthyEndpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::policy::route;
    use crate::policy::testing::{empty_requests, ranks};
    use crate::request::Prompt;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn rank_of(snap: &Snapshot, req: &RouteRequest) -> usize {
        route(&PrefixMatch::default(), snap, req).unwrap().rank
    }

    #[test]
    fn prompts_sharing_their_first_4000_tokens_share_a_rank() {
        let snap = Snapshot::single_worker(16);
        let shared: Vec<u32> = (0..4000).map(|i| i * 7 + 3).collect();
        let a = [shared.clone(), vec![1]].concat();
        let b = [shared, vec![2, 3]].concat();
        assert_eq!(
            rank_of(&snap, &RouteRequest::tokens(a)),
            rank_of(&snap, &RouteRequest::tokens(b))
        );
    }

    #[test]
    fn uniform_prompts_spread_over_at_least_12_of_16_ranks() {
        let snap = Snapshot::single_worker(16);
        let used: HashSet<usize> = (0..256u32)
            .map(|s| rank_of(&snap, &RouteRequest::tokens(vec![s; 4096])))
            .collect();
        assert!(used.len() >= 12, "only {} ranks used", used.len());
    }

    #[test]
    fn empty_prompts_go_round_robin() {
        let policy = PrefixMatch::default();
        let (got, _held) = ranks(&policy, &Snapshot::single_worker(4), &empty_requests(4));
        assert_eq!(got, vec![0, 1, 2, 3]);
        let picks = route(
            &PrefixMatch::default(),
            &Snapshot::single_worker(4),
            &RouteRequest::text(""),
        );
        assert_eq!(picks.unwrap().branch, Branch::Empty);
    }

    #[test]
    fn override_wins_over_the_hash() {
        let snap = Snapshot::single_worker(8);
        let req = RouteRequest::tokens(vec![9; 300]);
        let hashed = rank_of(&snap, &req);
        let target = if hashed == 5 { 6 } else { 5 };
        assert_eq!(rank_of(&snap, &req.with_override(target as i64)), target);
    }

    #[test]
    fn a_down_home_rank_moves_to_the_next_healthy_one() {
        let snap = Snapshot::single_worker(8);
        let req = RouteRequest::text("a system prompt");
        let home = rank_of(&snap, &req);
        let degraded = snap.with_health(|i, _| i != home);
        let pick = route(&PrefixMatch::default(), &degraded, &req).unwrap();
        assert_eq!(pick, Pick::new((home + 1) % 8, Branch::Fallback));
    }

    proptest! {
        #[test]
        fn depends_only_on_the_window_aligned_prefix(
            prompt in proptest::collection::vec(any::<u32>(), 256..6000),
            tail in proptest::collection::vec(any::<u32>(), 0..300),
            dp in 1u32..64,
        ) {
            // `other` agrees with `prompt` on the units its key covers, then differs arbitrarily.
            let covered = PrefixWindow::default().covered(&Prompt::Tokens(prompt.clone()));
            let other = [&prompt[..covered], &tail[..]].concat();
            prop_assume!(PrefixWindow::default().covered(&Prompt::Tokens(other.clone())) == covered);
            let snap = Snapshot::single_worker(dp);
            prop_assert_eq!(rank_of(&snap, &RouteRequest::tokens(prompt)), rank_of(&snap, &RouteRequest::tokens(other)));
        }

        #[test]
        fn text_keys_ignore_bytes_past_the_window(
            prompt in proptest::collection::vec(any::<u8>(), 1024..20000),
            tail in proptest::collection::vec(any::<u8>(), 0..1100),
        ) {
            let window = PrefixWindow::default();
            let covered = window.covered(&Prompt::Bytes(prompt.clone()));
            let other = Prompt::Bytes([&prompt[..covered], &tail[..]].concat());
            prop_assume!(window.covered(&other) == covered);
            prop_assert_eq!(window.key(&Prompt::Bytes(prompt)), window.key(&other));
        }
    }

    #[test]
    fn a_change_inside_the_window_changes_the_key() {
        let window = PrefixWindow::default();
        let a: Vec<u32> = (0..1000).collect();
        let mut b = a.clone();
        b[700] += 1;
        assert_ne!(window.key(&Prompt::Tokens(a)), window.key(&Prompt::Tokens(b)));
    }
}
