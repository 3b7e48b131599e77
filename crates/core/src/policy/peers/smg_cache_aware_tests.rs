use std::sync::Arc;

use super::*;
use crate::endpoint::{EndpointId, Snapshot};
use crate::load::LoadGuard;
use crate::policy::route;

fn text(s: &str) -> RouteRequest {
    RouteRequest::text(s)
}

/// Holds `n` requests in flight at `rank`.
fn load(snap: &Snapshot, rank: usize, n: usize) -> Vec<LoadGuard> {
    (0..n)
        .map(|_| LoadGuard::acquire(Arc::clone(&snap.endpoints()[rank].load), 1, false))
        .collect()
}

#[test]
fn the_sources_scripted_decisions() {
    // The research notes' script on SMG's own unit-test config (threshold 0.5, abs 32, rel 1.1), eviction off:
    // the version read sends misses to the least loaded worker, the first on ties. A = rank 0, B = rank 1.
    let p = SmgCacheAware::new(SmgCacheAwareConfig {
        cache_threshold: 0.5,
        balance_abs_threshold: 32,
        balance_rel_threshold: 1.1,
        eviction_interval_secs: 0.0,
        max_tree_size: 10_000,
    });
    let snap = Snapshot::single_worker(2);
    let a10 = "a".repeat(10);
    let step = |s: &str, a: usize, b: usize| {
        let (_ga, _gb) = (load(&snap, 0, a), load(&snap, 1, b));
        route(&p, &snap, &text(s)).unwrap().rank
    };
    assert_eq!(
        step(&a10, 33, 0),
        1,
        "1: imbalanced (33 − 0 > 32, 33 > 0): the least loaded, recorded"
    );
    assert_eq!(step(&a10, 0, 0), 1, "2: a full match at B");
    assert_eq!(
        step("bbbbb", 0, 0),
        0,
        "3: a miss: the least loaded, the first on a tie"
    );
    assert_eq!(
        step(&"a".repeat(20), 0, 0),
        0,
        "4: 10 of 20 is not more than 0.5: a miss"
    );
    assert_eq!(step(&"a".repeat(15), 0, 0), 0, "5: all of it, at A's node");
    assert_eq!(step("bbbbbc", 0, 0), 0, "6: 5 of 6 at A");
    assert_eq!(step("cccc", 0, 0), 0, "7: a miss: A");
    assert_eq!(
        step("cccc", 400, 365),
        0,
        "8: not imbalanced (400 is not over 1.1 × 365 = 401.5): the hit at A"
    );
    assert_eq!(
        step("bbbbbc", 140, 105),
        1,
        "9: imbalanced (35 > 32, 140 > 115.5): the least loaded"
    );
    let (a, b) = (EndpointId::new(0, 0), EndpointId::new(0, 1));
    let state = p.state.lock().unwrap();
    // A holds aaaaaaaaaa (shared) + 10 more a's + bbbbb + c + cccc = 30; B: 10 a's + bbbbbc = 16.
    assert_eq!((state.tree.size(a), state.tree.size(b)), (30, 16));
}

#[test]
fn a_matched_worker_that_is_down_sends_the_request_to_the_first_candidate_unrecorded() {
    let p = SmgCacheAware::new(SmgCacheAwareConfig::default());
    let snap = Snapshot::single_worker(3);
    let _busy = (load(&snap, 0, 1), load(&snap, 1, 1));
    assert_eq!(route(&p, &snap, &text("hello world")).unwrap().rank, 2);
    let down = snap.with_health(|r, _| r != 2);
    let pick = route(&p, &down, &text("hello world")).unwrap();
    assert_eq!((pick.rank, pick.branch), (0, Branch::Fallback));
    assert_eq!(p.state.lock().unwrap().tree.size(EndpointId::new(0, 0)), 0);
}

#[test]
fn eviction_trims_the_least_recently_used_leaves_of_a_worker_over_its_size() {
    let mut tree = Tree::default();
    let t = EndpointId::new(0, 0);
    let units = |s: &str| s.bytes().map(u32::from).collect::<Vec<_>>();
    tree.insert(&units("apple"), t, 1);
    tree.insert(&units("banana"), t, 2);
    assert_eq!(tree.size(t), 11);
    tree.evict(6);
    assert_eq!(tree.size(t), 6, "apple (the older) went");
    assert_eq!(tree.prefix_match(&units("apple"), 3), (0, None));
    tree.evict(5);
    assert_eq!(tree.size(t), 0, "whole nodes: banana goes too");
}
