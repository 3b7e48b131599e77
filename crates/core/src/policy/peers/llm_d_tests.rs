use super::*;
use crate::endpoint::{Endpoint, Snapshot};
use crate::load::EngineReport;
use crate::policy::route;

fn snapshot(pods: usize) -> Snapshot {
    Snapshot::new(
        (0..pods as u32)
            .map(|r| Endpoint::new(EndpointId::new(0, r)).with_kv_capacity(1_000))
            .collect(),
    )
}

fn report(snap: &Snapshot, rank: usize, waiting: u64, kv_tokens: u64) {
    snap.load(rank).apply_report(EngineReport {
        requests: waiting,
        waiting,
        tokens: kv_tokens,
        timestamp: 1,
        queued_prefill_tokens: None,
    });
}

/// Puts `blocks` leading blocks of `req` in `rank`'s index.
fn hold(p: &LlmD, snap: &Snapshot, req: &RouteRequest, rank: usize, blocks: usize) {
    let hashes = p.prepare(req).block_hashes;
    let mut state = p.lock();
    let next = state.index.slot_count();
    let slot = *state.slots.entry(snap.endpoints()[rank].id).or_insert(next);
    if slot == next {
        state.index.add_slot(31_250);
    }
    state.index.record(slot, &hashes[..blocks]);
}

#[test]
fn the_weights_decide_between_a_cached_busy_pod_and_an_idle_one() {
    // Pod A: 6 waiting, KV 60% used, 3 of the prompt's 4 blocks; pod B: idle, empty, nothing cached.
    // Default weights 3/2/2: A = 3·0.75 + 2·0 + 2·0.4 = 3.05, B = 0 + 2 + 2 = 4: B.
    // Weights 3/1/1: A = 2.25 + 0 + 0.4 = 2.65, B = 2: A.
    let req = RouteRequest::tokens((0..64).collect());
    for (queue_weight, kv_weight, expected) in [(2.0, 2.0, 1), (1.0, 1.0, 0)] {
        let p = LlmD::new(LlmDConfig {
            queue_weight,
            kv_weight,
            ..LlmDConfig::default()
        });
        let snap = snapshot(2);
        report(&snap, 0, 6, 600);
        report(&snap, 1, 0, 0);
        hold(&p, &snap, &req, 0, 3);
        let pick = route(&p, &snap, &req).unwrap();
        assert_eq!(pick.rank, expected, "weights 3/{queue_weight}/{kv_weight}");
    }
}

#[test]
fn the_index_learns_at_the_pick_and_scores_leading_blocks_over_the_prompts() {
    let p = LlmD::new(LlmDConfig::default());
    let snap = snapshot(3);
    // 50 tokens: 3 whole blocks of 16 (the last 2 tokens are not hashed).
    let first = RouteRequest::tokens((0..50).collect());
    let rank = route(&p, &snap, &first).unwrap().rank;
    // Sharing the first 32 tokens: 2 of its 3 blocks at that pod. Equal queues and KV: the prefix decides.
    let follow: Vec<u32> = (0..32).chain(1_000..1_018).collect();
    let pick = route(&p, &snap, &RouteRequest::tokens(follow)).unwrap();
    assert_eq!((pick.rank, pick.branch), (rank, Branch::Hit));
    // A queue and 10% of its KV used at that pod: 3 · 2/3 + 2 · 0 + 2 · 0.9 = 3.8 there, 0 + 2 + 2 = 4 elsewhere.
    report(&snap, rank, 4, 100);
    // (A third prompt: the second's own blocks are all at that pod now.)
    let third: Vec<u32> = (0..32).chain(2_000..2_018).collect();
    let other = route(&p, &snap, &RouteRequest::tokens(third)).unwrap();
    assert_ne!(other.rank, rank);
    // Shorter than a block: no hashes, prefix 0 everywhere.
    assert!(p
        .prepare(&RouteRequest::tokens((0..15).collect()))
        .block_hashes
        .is_empty());
    // Only the first 256 blocks count.
    assert_eq!(
        p.prepare(&RouteRequest::tokens((0..10_000).collect()))
            .block_hashes
            .len(),
        256
    );
}
