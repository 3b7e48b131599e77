//! `cache_aware`'s choices: where cold prompts and their continuations go, queued work, congestion, overrides,
//! membership and capacity changes (the capacities learned from feedback are in `capacity_tests`).

use super::*;
use crate::endpoint::Endpoint;
use crate::policy::route;
use crate::policy::testing::{empty_requests, ranks};
use crate::ticket::dispatch;

fn usage(prompt_tokens: u64, cached_tokens: u64) -> crate::usage::Usage {
    crate::usage::Usage {
        prompt_tokens,
        cached_tokens,
    }
}

fn policy() -> CacheAware {
    CacheAware::new(CacheAwareConfig {
        block_tokens: 16,
        ..CacheAwareConfig::default()
    })
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| seed.wrapping_mul(1_000_003) ^ i.wrapping_mul(2_654_435_761))
        .collect()
}

#[test]
fn a_cold_prompt_goes_to_the_rendezvous_choice_and_its_continuation_follows() {
    let snap = Snapshot::single_worker(8);
    let p = policy();
    let first = prompt(1, 1000);
    let cold = route(&p, &snap, &RouteRequest::tokens(first.clone())).unwrap();
    assert_eq!(cold.branch, Branch::Cold);
    assert_eq!(cold.prefill_tokens, Some(1000));
    // Another replica (a fresh index) places the same cold prompt on the same endpoint.
    assert_eq!(
        route(&policy(), &snap, &RouteRequest::tokens(first.clone())).unwrap(),
        cold
    );
    let next = [first, prompt(2, 300)].concat();
    let hit = route(&p, &snap, &RouteRequest::tokens(next)).unwrap();
    // 992 of the first 1000 tokens are in whole blocks of 16.
    assert_eq!(
        (hit.rank, hit.branch, hit.prefill_tokens),
        (cold.rank, Branch::Hit, Some(308))
    );
}

/// 1 s of base per prefill, 1000 tokens/s, 10-token blocks, no congestion charge.
fn slow_engine() -> CacheAwareConfig {
    CacheAwareConfig {
        block_tokens: 10,
        prefill_tokens_per_s: 1000.0,
        base_ms: 1000.0,
        congestion_weight: 0.0,
        ..CacheAwareConfig::default()
    }
}

#[test]
fn queued_prefill_work_makes_a_cold_endpoint_cheaper() {
    // A 10-token tail behind one queued 5000-token prefill takes 2 + 5.01 s at home; a cold endpoint takes
    // 1 + 5.01 s.
    let snap = Snapshot::single_worker(2);
    let p = CacheAware::new(slow_engine());
    let shared = prompt(3, 5000);
    let a = dispatch(&p, &snap, RouteRequest::tokens([shared.clone(), vec![1; 10]].concat())).unwrap();
    let b = dispatch(&p, &snap, RouteRequest::tokens([shared.clone(), vec![2; 10]].concat())).unwrap();
    assert_eq!((a.pick.branch, b.pick.branch), (Branch::Cold, Branch::Spill));
    assert_ne!(a.pick.rank, b.pick.rank);
    assert_eq!(snap.load(b.pick.rank).queued_prefill_tokens(), 5010);
    // Once both have their first tokens, a third goes to a warm endpoint: the longer match at equal cost.
    let (mut a, mut b) = (a, b);
    a.first_token(0);
    b.first_token(0);
    let c = route(&p, &snap, &RouteRequest::tokens([shared, vec![3; 10]].concat())).unwrap();
    assert_eq!((c.branch, c.prefill_tokens), (Branch::Hit, Some(10)));
}

#[test]
fn a_request_arriving_late_in_a_prefill_waits_for_its_prefix() {
    // As above: `a` takes 1 + 5.01 s to prefill on its endpoint. Arriving 0.5 s in, `b` would wait 5.51 s more
    // plus its own 1.01 s there against 6.01 s cold elsewhere; arriving 3 s in, only 3.01 + 1.01 s.
    let shared = prompt(3, 5000);
    for (arrival_us, branch) in [(500_000, Branch::Spill), (3_000_000, Branch::Hit)] {
        let snap = Snapshot::single_worker(2);
        let p = CacheAware::new(slow_engine());
        let a = dispatch(
            &p,
            &snap,
            RouteRequest::tokens([shared.clone(), vec![1; 10]].concat()).at(0),
        )
        .unwrap();
        let b = route(
            &p,
            &snap,
            &RouteRequest::tokens([shared.clone(), vec![2; 10]].concat()).at(arrival_us),
        )
        .unwrap();
        assert_eq!(b.branch, branch, "arriving at {arrival_us} µs");
        assert_eq!(b.rank == a.pick.rank, branch == Branch::Hit);
    }
}

#[test]
fn progress_counts_at_most_one_queued_requests_share() {
    let p = CacheAware::new(slow_engine());
    // Two queued prefills of 1 + 5 s each; an engine slower than predicted, 100 s into the first, still has
    // the second ahead of a new request.
    assert_eq!(p.predicted_ttft_us(2, 10_000, 0, 0), 13_000_000);
    assert_eq!(p.predicted_ttft_us(2, 10_000, 2_000_000, 0), 11_000_000);
    assert_eq!(p.predicted_ttft_us(2, 10_000, 100_000_000, 0), 7_000_000);
    assert_eq!(p.predicted_ttft_us(0, 0, 100_000_000, 500), 1_500_000);
}

#[test]
fn congestion_charges_a_cold_prefill_for_the_requests_it_delays() {
    // Endpoint X queues a (5010 tokens, sharing 5000 with b) and a pinned 1000-token prompt; Y queues a pinned
    // 10-token prompt. For b, X predicts 3 + 6.02 s and Y 2 + 5.02 s: plain TTFT sends b cold to Y. With the
    // congestion charge Y also costs 1 queued × 5.01 s of b's own prefill (12.03 s) against 2 × 0.01 s at X.
    let snap = Snapshot::single_worker(2);
    let shared = prompt(3, 5000);
    for (weight, branch) in [(1.0, Branch::Hit), (0.0, Branch::Spill)] {
        let p = CacheAware::new(CacheAwareConfig {
            congestion_weight: weight,
            ..slow_engine()
        });
        let a = dispatch(&p, &snap, RouteRequest::tokens([shared.clone(), vec![1; 10]].concat())).unwrap();
        let (x, y) = (a.pick.rank as i64, 1 - a.pick.rank as i64);
        let c = dispatch(&p, &snap, RouteRequest::tokens(prompt(8, 1000)).with_override(x)).unwrap();
        let z = dispatch(&p, &snap, RouteRequest::tokens(prompt(9, 10)).with_override(y)).unwrap();
        let b = route(&p, &snap, &RouteRequest::tokens([shared.clone(), vec![2; 10]].concat())).unwrap();
        let expected = if branch == Branch::Hit { x } else { y };
        assert_eq!((b.rank as i64, b.branch), (expected, branch), "weight {weight}");
        drop((a, c, z));
    }
}

#[test]
fn overrides_are_recorded_and_a_refuted_prediction_bounds_the_capacity() {
    let snap = Snapshot::single_worker(4);
    let p = policy();
    let req = RouteRequest::tokens(prompt(4, 640));
    let mut pinned = dispatch(&p, &snap, req.clone().with_override(2)).unwrap();
    pinned.first_token(0);
    assert_eq!(p.predicted_cached(&snap, &req), vec![0, 0, 639, 0]);
    let given = p.index_stats().capacity_blocks;
    // A pick without a prediction teaches nothing.
    pinned.usage(usage(640, 0));
    drop(pinned);
    assert_eq!(p.index_stats().capacity_blocks, given);
    // Another prompt goes there after it.
    let other = RouteRequest::tokens(prompt(5, 640));
    drop(dispatch(&p, &snap, other.clone().with_override(2)).unwrap());
    let mut hit = dispatch(&p, &snap, req.clone()).unwrap();
    let pick = hit.pick;
    assert_eq!((pick.rank, pick.branch, pick.prefill_tokens), (2, Branch::Hit, Some(1)));
    // The engine held 100 tokens (6 blocks) of it: since its block 6 was recorded there, the endpoint got 6
    // more of its blocks and the other prompt's 40, and it no longer held block 6: it keeps at most 46 blocks.
    hit.usage(usage(640, 100));
    drop(hit);
    assert_eq!(p.index_stats().capacity_blocks, given / 4 * 3 + 46);
    // It holds this prompt now that it has prefilled it, and what fits of the other (its first 6 blocks).
    assert_eq!(p.predicted_cached(&snap, &req), vec![0, 0, 639, 0]);
    assert_eq!(p.predicted_cached(&snap, &other), vec![0, 0, 96, 0]);
    // A confirmed prediction lets the capacity grow back, by an eighth.
    let mut again = dispatch(&p, &snap, req.clone()).unwrap();
    assert_eq!(again.pick.rank, 2);
    again.usage(usage(640, 639));
    assert_eq!(p.index_stats().capacity_blocks, given / 4 * 3 + 51);
}

#[test]
fn a_rerouted_request_is_forgotten_where_it_never_went() {
    let snap = Snapshot::single_worker(4);
    let p = policy();
    let req = RouteRequest::tokens(prompt(5, 640));
    // Endpoint 1 holds the first 10 blocks; the request goes there first.
    drop(dispatch(&p, &snap, RouteRequest::tokens(prompt(5, 160)).with_override(1)).unwrap());
    let ticket = dispatch(&p, &snap, req.clone()).unwrap();
    assert_eq!(ticket.pick.rank, 1);
    assert_eq!(p.predicted_cached(&snap, &req)[1], 639);
    // Its connection was refused: it goes elsewhere, and endpoint 1 keeps only what it held before.
    let ticket = ticket.reroute(&snap, &|r| r != 1, 0).unwrap();
    assert_ne!(ticket.pick.rank, 1);
    let cached = p.predicted_cached(&snap, &req);
    assert_eq!(cached[1], 160);
    assert_eq!(cached[ticket.pick.rank], 639);
}

#[test]
fn each_endpoint_forgets_at_its_own_capacity_and_membership_changes_keep_ids() {
    let endpoints = vec![
        Endpoint::new(EndpointId::new(0, 0)).with_kv_capacity(160),
        Endpoint::new(EndpointId::new(1, 0)),
    ];
    let snap = Snapshot::new(endpoints.clone());
    let p = policy();
    let (a, b) = (
        RouteRequest::tokens(prompt(5, 160)),
        RouteRequest::tokens(prompt(6, 160)),
    );
    for req in [&a, &b] {
        route(&p, &snap, &req.clone().with_override(0)).unwrap();
        route(&p, &snap, &req.clone().with_override(1)).unwrap();
    }
    // Endpoint 0 holds 10 blocks of 16: b pushed a out. Endpoint 1 holds both.
    assert_eq!(p.predicted_cached(&snap, &a), vec![0, 159]);
    assert_eq!(p.predicted_cached(&snap, &b), vec![159, 159]);
    assert_eq!(p.index_stats().blocks, 30);
    // Endpoint 0 leaves; endpoint 1, now at rank 0, keeps its blocks; endpoint 0 is forgotten.
    let fewer = Snapshot::new(vec![endpoints[1].clone()]);
    assert_eq!(p.predicted_cached(&fewer, &a), vec![159]);
    assert_eq!(p.index_stats().blocks, 20);
}

#[test]
fn a_stale_snapshot_never_forgets_a_newer_membership() {
    let (e0, e1) = (
        Endpoint::new(EndpointId::new(0, 0)),
        Endpoint::new(EndpointId::new(0, 1)),
    );
    let old = Snapshot::new(vec![e0.clone()]);
    let new = Snapshot::new(vec![e0, e1]);
    let p = policy();
    let req = RouteRequest::tokens(prompt(10, 320));
    route(&p, &new, &req.clone().with_override(1)).unwrap();
    // A request still routing with the old snapshot (no endpoint 1) goes to endpoint 0...
    assert_eq!(route(&p, &old, &req).unwrap().rank, 0);
    // ...and endpoint 1 keeps its blocks.
    assert_eq!(p.predicted_cached(&new, &req), vec![319, 319]);
    assert_eq!(p.index_stats().blocks, 40);
}

#[test]
fn text_prompts_use_four_bytes_per_token_and_empty_prompts_go_round_robin() {
    let snap = Snapshot::single_worker(3);
    let p = policy();
    let text = "x".repeat(700);
    let req = RouteRequest::text(&text);
    let first = route(&p, &snap, &req).unwrap();
    let again = route(&p, &snap, &RouteRequest::text(&format!("{text}y"))).unwrap();
    // 10 blocks of 64 bytes: 640 bytes = 160 tokens cached of 176.
    assert_eq!((again.rank, again.prefill_tokens), (first.rank, Some(16)));
    let (got, _held) = ranks(&p, &snap, &empty_requests(3));
    assert_eq!(got, vec![0, 1, 2]);
}

proptest::proptest! {
    #[test]
    fn the_index_never_exceeds_the_endpoints_capacities(
        capacities in proptest::collection::vec(0u64..400, 1..6),
        requests in proptest::collection::vec((0u32..6, 0usize..300, proptest::option::of(0i64..6)), 1..60),
    ) {
        let snap = Snapshot::new(
            capacities
                .iter()
                .enumerate()
                .map(|(r, &c)| Endpoint::new(EndpointId::new(0, r as u32)).with_kv_capacity(c))
                .collect(),
        );
        let p = policy();
        let capacity_blocks: usize = capacities.iter().map(|&c| (c / 16) as usize).sum();
        for (seed, len, pin) in requests {
            let mut req = RouteRequest::tokens(prompt(seed, len));
            req.rank_override = pin.filter(|&r| (r as usize) < capacities.len());
            dispatch(&p, &snap, req.clone()).unwrap().usage(usage(len as u64, (seed as u64 * 37) % 200));
            let stats = p.index_stats();
            // (The index learns the membership from its first non-empty prompt; refuted predictions lower
            // the capacities it uses.)
            proptest::prop_assert!(stats.capacity_blocks <= capacity_blocks, "{:?}", stats);
            proptest::prop_assert!(stats.blocks <= stats.capacity_blocks, "{:?}", stats);
            for (r, &cached) in p.predicted_cached(&snap, &req).iter().enumerate() {
                proptest::prop_assert!(cached <= capacities[r], "rank {} holds {} of capacity {}", r, cached, capacities[r]);
            }
        }
    }
}

#[test]
fn down_endpoints_are_never_chosen_even_holding_the_prefix() {
    let snap = Snapshot::single_worker(3);
    let p = policy();
    let req = RouteRequest::tokens(prompt(7, 500));
    let home = route(&p, &snap, &req).unwrap().rank;
    let degraded = snap.with_health(|i, _| i != home);
    let pick = route(&p, &degraded, &req).unwrap();
    assert_ne!(pick.rank, home);
    assert_eq!(pick.branch, Branch::Cold);
}

#[test]
fn cold_tolerance_places_a_new_prefix_by_rendezvous_whatever_the_replicas_own_queues() {
    // Two replicas: one has sent a prompt to the cold rendezvous choice of another prefix, the other has not.
    // By the lowest prediction they place a second new prefix differently when its rendezvous choice is the
    // endpoint the first replica loaded; within the tolerance they agree on the rendezvous choice.
    let snap_a = Snapshot::single_worker(4);
    let snap_b = Snapshot::single_worker(4);
    let config = |tolerance| CacheAwareConfig {
        cold_tolerance_ms: tolerance,
        ..slow_engine()
    };
    let new = prompt(7, 2000);
    let home = route(
        &CacheAware::new(config(0.0)),
        &snap_b,
        &RouteRequest::tokens(new.clone()),
    )
    .unwrap()
    .rank;
    // A prompt of another prefix that replica A sends to `home` (its rendezvous choice, found by trying seeds).
    let other = (100..)
        .map(|seed| prompt(seed, 2000))
        .find(|p| {
            route(&CacheAware::new(config(0.0)), &snap_b, &RouteRequest::tokens(p.clone()))
                .unwrap()
                .rank
                == home
        })
        .unwrap();
    for (tolerance, agree) in [(0.0, false), (60_000.0, true)] {
        let (a, b) = (CacheAware::new(config(tolerance)), CacheAware::new(config(tolerance)));
        let sent = dispatch(&a, &snap_a, RouteRequest::tokens(other.clone())).unwrap();
        assert_eq!((sent.pick.rank, sent.pick.branch), (home, Branch::Cold));
        let on_a = route(&a, &snap_a, &RouteRequest::tokens(new.clone())).unwrap();
        let on_b = route(&b, &snap_b, &RouteRequest::tokens(new.clone())).unwrap();
        assert_eq!((on_a.branch, on_b.branch), (Branch::Cold, Branch::Cold));
        assert_eq!(on_b.rank, home);
        assert_eq!(
            on_a.rank == on_b.rank,
            agree,
            "tolerance {tolerance}: {} and {}",
            on_a.rank,
            on_b.rank
        );
        drop(sent);
    }
}

#[test]
fn most_cached_names_the_endpoint_holding_the_longest_prefix_and_records_nothing() {
    let snap = Snapshot::single_worker(4);
    let p = policy();
    let first = prompt(7, 640);
    let placed = route(&p, &snap, &RouteRequest::tokens(first.clone())).unwrap();
    let all = crate::policy::Candidates::all(&snap);
    // A continuation: the endpoint that got the first prompt holds its 640 tokens.
    let mut longer = first.clone();
    longer.extend(prompt(8, 320));
    let req = RouteRequest::tokens(longer);
    let prepared = p.prepare(&req);
    assert_eq!(p.most_cached(&all, &req, &prepared), Some((placed.rank, 640)));
    // Nobody holds an unrelated prompt; asking recorded nothing.
    let other = RouteRequest::tokens(prompt(9, 640));
    let prepared_other = p.prepare(&other);
    assert_eq!(p.most_cached(&all, &other, &prepared_other), None);
    assert_eq!(p.most_cached(&all, &other, &prepared_other), None);
    // Among candidates without that endpoint, none holds it.
    let elsewhere = |r: usize| r != placed.rank;
    let without = crate::policy::Candidates::accepting(&snap, &elsewhere);
    assert_eq!(p.most_cached(&without, &req, &prepared), None);
}

/// An active session's turn goes to the endpoint of its last one even when its prompt alone would move it (here
/// another client's prompt, which the turn now starts with, is cached at the other endpoint), while the home is
/// predicted within `session_home_margin_ms` of the best endpoint, until that endpoint is out, or busy, or the
/// session has idled past its TTL.
#[test]
fn an_active_session_goes_home_until_its_endpoint_is_out_or_busy_or_it_idled() {
    let config = CacheAwareConfig {
        block_tokens: 16,
        session_ttl_ms: 10_000,
        ..CacheAwareConfig::default()
    };
    let snap = Snapshot::single_worker(2);
    let p = CacheAware::new(config);
    let first = RouteRequest::tokens(prompt(1, 500)).with_session("agent-a").at(0);
    let home = route(&p, &snap, &first).unwrap().rank;
    let other = 1 - home;
    // 3,000 tokens cached at the other endpoint: 120 ms of prefill at the default costs, within the margin.
    let shared = prompt(9, 3_000);
    drop(
        dispatch(
            &p,
            &snap,
            RouteRequest::tokens(shared.clone()).with_override(other as i64),
        )
        .unwrap(),
    );
    let next = [shared, prompt(2, 100)].concat();
    let by_prompt = route(&p, &snap, &RouteRequest::tokens(next.clone()).at(1_000_000)).unwrap();
    assert_eq!(
        (by_prompt.rank, by_prompt.branch),
        (other, Branch::Hit),
        "the prompt alone moves it"
    );
    let turn = |now_us: u64| RouteRequest::tokens(next.clone()).with_session("agent-a").at(now_us);
    let mut dry = turn(2_000_000);
    dry.dry_run = true;
    let strict = CacheAware::new(CacheAwareConfig {
        session_home_margin_ms: 100.0,
        ..config
    });
    let kept = route(&p, &snap, &turn(2_000_000)).unwrap();
    assert_eq!((kept.rank, kept.branch), (home, Branch::Session));
    assert_eq!(p.sessions_by_rank(&snap, 2_000_000).unwrap()[home], 1);
    // With a margin under the 120 ms the home costs more, the prompt decides.
    assert_eq!(route(&strict, &snap, &first).unwrap().rank, home);
    drop(
        dispatch(
            &strict,
            &snap,
            RouteRequest::tokens(prompt(9, 3_000)).with_override(other as i64),
        )
        .unwrap(),
    );
    assert_eq!(route(&strict, &snap, &dry).unwrap().branch, Branch::Hit);
    // Its endpoint out: the prompt decides.
    let without_home = snap.with_health(|r, _| r != home);
    assert_eq!(route(&p, &without_home, &turn(3_000_000)).unwrap().rank, other);
    // Its endpoint busy prefilling (5,000 queued tokens: 225 ms more, past the margin): the prompt decides.
    let busy = RouteRequest::tokens(prompt(5, 5_000)).with_override(home as i64);
    let queued = dispatch(&p, &snap, busy).unwrap();
    assert_eq!(route(&p, &snap, &turn(4_000_000)).unwrap().rank, other);
    drop(queued);
    // Home again (the last turn went `other`: that is its home now), until it idles past the TTL.
    assert_eq!(route(&p, &snap, &turn(5_000_000)).unwrap().branch, Branch::Session);
    let idle = route(&p, &snap, &turn(20_000_000)).unwrap();
    assert_ne!(
        idle.branch,
        Branch::Session,
        "idle past its TTL, the session is forgotten"
    );
}

/// Gives `rank`'s endpoint a fit of `us_per_token` µs a token and no base.
fn learned(snap: &Snapshot, rank: usize, us_per_token: u64) {
    for i in 1..=20u64 {
        snap.load(rank).observe_prefill(i * 100, i * 100 * us_per_token);
    }
    assert!(snap.load(rank).fitted_costs().is_some());
}

#[test]
fn learned_costs_steer_away_from_a_slow_endpoint_and_lend_the_fleets_to_the_unfitted() {
    // Four endpoints; 0 is fitted at 400 µs a token (2,500 tokens/s), 1 and 2 at 20 µs, 3 has no fit yet.
    let snap = Snapshot::single_worker(4);
    learned(&snap, 0, 400);
    learned(&snap, 1, 20);
    learned(&snap, 2, 20);
    let ranks_of = |p: &CacheAware| -> Vec<usize> {
        (0..40)
            .map(|i| {
                route(p, &snap, &RouteRequest::tokens(prompt(100 + i, 2_000)))
                    .unwrap()
                    .rank
            })
            .collect()
    };
    // Cold prompts on idle endpoints: learned, the slow one is predicted 20 times longer and never chosen; the
    // unfitted one is predicted at the fleet's median (20 µs, no base), as fast as 1 and 2 (at the configured
    // costs, 25 ms + 40 µs a token, it would never be).
    let got = ranks_of(&policy());
    assert!(!got.contains(&0), "{got:?}");
    assert!(got.contains(&3), "{got:?}");
    // With the configured costs for all, the rendezvous spreads them over every endpoint.
    let configured = CacheAware::new(CacheAwareConfig {
        block_tokens: 16,
        learn_costs: false,
        ..CacheAwareConfig::default()
    });
    assert!(ranks_of(&configured).contains(&0));
}

#[test]
fn a_cold_prompt_spares_the_prefix_of_a_session_paused_for_a_tool() {
    // Two endpoints of 100 16-token blocks, each nearly full: endpoint 0 with a session whose answer ended on
    // tool calls, endpoint 1 with one that ended for good. A cold 800-token prompt pushes most of either out.
    let snap = Snapshot::new(
        (0..2)
            .map(|r| Endpoint::new(EndpointId::new(0, r)).with_kv_capacity(1_600))
            .collect(),
    );
    let chosen = |pause_weight: f64| -> Vec<usize> {
        let p = CacheAware::new(CacheAwareConfig {
            block_tokens: 16,
            pause_weight,
            ..CacheAwareConfig::default()
        });
        for (rank, tool_call) in [(0, true), (1, false)] {
            let req = RouteRequest::tokens(prompt(50 + rank as u32, 1_500))
                .with_override(rank)
                .at(1_000);
            dispatch(&p, &snap, req).unwrap().end(2_000, tool_call);
        }
        (0..24)
            .map(|i| {
                let mut cold = RouteRequest::tokens(prompt(900 + i, 800)).at(3_000);
                cold.dry_run = true;
                route(&p, &snap, &cold).unwrap().rank
            })
            .collect()
    };
    let followed = chosen(1.0);
    assert!(followed.iter().all(|&r| r == 1), "{followed:?}");
    // Without following pauses both cost the same evictions: the rendezvous splits them.
    let ignored = chosen(0.0);
    assert!(ignored.contains(&0) && ignored.contains(&1), "{ignored:?}");
}
