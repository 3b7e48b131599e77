use super::*;

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| seed.wrapping_mul(7_919) ^ i.wrapping_mul(2_654_435_761))
        .collect()
}

fn with_id(id: &str) -> PickOptions<'_> {
    PickOptions {
        request_id: Some(id),
        ..PickOptions::default()
    }
}

#[test]
fn specs_ranks_and_options_are_checked_with_the_cores_messages() {
    assert!(DpRouter::new("cache_aware:prefill_tokens_per_s=12000", 8, TicketLimits::default()).is_ok());
    let err = DpRouter::new("nope", 8, TicketLimits::default()).unwrap_err();
    assert!(
        matches!(err, DpRouterError::Policy(ref m) if m.contains("nope")),
        "{err}"
    );
    let err = DpRouter::new("cache_aware:block_tokens=0", 8, TicketLimits::default()).unwrap_err();
    assert!(err.to_string().contains("block_tokens"), "{err}");
    assert_eq!(
        DpRouter::new("round_robin", 0, TicketLimits::default()).unwrap_err(),
        DpRouterError::NumRanks(0)
    );
    let mut router = DpRouter::new("round_robin", 4, TicketLimits::default()).unwrap();
    let pinned = PickOptions {
        routed_rank: Some(4),
        ..PickOptions::default()
    };
    let err = router.pick(vec![1], &pinned, 0).unwrap_err();
    assert_eq!(err.to_string(), "DP rank 4 is out of range: there are 4 ranks (0..4)");
    assert!(router.report_load(-1, LoadReport::default()).is_err());
    let none = PickOptions {
        eligible: Some(&[]),
        ..PickOptions::default()
    };
    assert!(matches!(router.pick(vec![1], &none, 0), Err(DpRouterError::NoEligible)));
}

#[test]
fn same_prefix_requests_gather_and_a_pinned_rank_wins() {
    for spec in ["prefix_match", "cache_aware", "prefix_affinity"] {
        let mut router = DpRouter::new(spec, 8, TicketLimits::default()).unwrap();
        // A system prompt of whole windows (prefix_match hashes the first 4,096 tokens).
        let system = prompt(1, 4_096);
        let ranks: Vec<usize> = (0..6)
            .map(|turn| {
                let tokens = [&system[..], &prompt(100 + turn, 50)[..]].concat();
                router
                    .pick(tokens, &PickOptions::default(), turn as u64 * 1_000)
                    .unwrap()
                    .rank
            })
            .collect();
        assert!(ranks.windows(2).all(|w| w[0] == w[1]), "{spec}: {ranks:?}");
        let pinned = PickOptions {
            routed_rank: Some(((ranks[0] + 1) % 8) as i64),
            ..PickOptions::default()
        };
        let d = router.pick(system.clone(), &pinned, 10_000).unwrap();
        assert_eq!((d.rank, d.branch), ((ranks[0] + 1) % 8, Branch::Override), "{spec}");
    }
}

#[test]
fn inactive_and_ineligible_ranks_are_skipped() {
    let mut router = DpRouter::new("round_robin", 4, TicketLimits::default()).unwrap();
    router.set_active(1, false).unwrap();
    let ranks: Vec<usize> = (0..6)
        .map(|_| router.pick(vec![], &PickOptions::default(), 0).unwrap().rank)
        .collect();
    assert_eq!(ranks, [0, 2, 3, 0, 2, 3]);
    let pinned = PickOptions {
        routed_rank: Some(1),
        ..PickOptions::default()
    };
    assert_eq!(
        router.pick(vec![], &pinned, 0).unwrap_err().to_string(),
        "DP rank 1 is not active (the endpoint is down)"
    );
    let only_three = PickOptions {
        eligible: Some(&[3]),
        ..PickOptions::default()
    };
    assert_eq!(router.pick(vec![], &only_three, 0).unwrap().rank, 3);
    router.set_active(1, true).unwrap();
    assert!(router.is_active(1));
}

fn report(running: u64, waiting: u64, tokens: u64, waiting_tokens: Option<u64>, timestamp: u64) -> LoadReport {
    LoadReport {
        running,
        waiting,
        tokens,
        waiting_tokens,
        timestamp,
    }
}

fn ranks_of(router: &mut DpRouter, seeds: std::ops::Range<u32>, len: usize) -> Vec<usize> {
    seeds
        .map(|i| router.pick(prompt(i, len), &PickOptions::default(), 0).unwrap().rank)
        .collect()
}

#[test]
fn load_reports_move_requests_away_from_a_loaded_rank() {
    let mut router = DpRouter::new("total_tokens", 2, TicketLimits::default()).unwrap();
    // Rank 0 reports a long queue; rank 1 idles.
    router.report_load(0, report(8, 40, 300_000, None, 1)).unwrap();
    router.report_load(1, report(0, 0, 0, None, 1)).unwrap();
    let ranks = ranks_of(&mut router, 500..508, 1_000);
    assert!(ranks.iter().all(|&r| r == 1), "{ranks:?}");
    // A stale report changes nothing.
    assert!(!router.report_load(1, report(50, 50, 300_000, None, 1)).unwrap());
}

#[test]
fn a_reported_prefill_queue_moves_new_prefixes_away_under_cache_aware() {
    // As inside SGLang's controller: no ticket held (it never sees a first token), loads from snapshots.
    let mut router = DpRouter::new("cache_aware", 2, TicketLimits::default()).unwrap();
    let cold = ranks_of(&mut router, 500..508, 1_000);
    assert!(cold.contains(&0) && cold.contains(&1), "{cold:?}");
    // Rank 0 reports 200,000 uncached tokens waiting (8 s at 25,000 tokens/s); rank 1 nothing.
    router.report_load(0, report(4, 40, 300_000, Some(200_000), 2)).unwrap();
    router.report_load(1, report(0, 0, 0, Some(0), 2)).unwrap();
    let ranks = ranks_of(&mut router, 900..908, 1_000);
    assert!(ranks.iter().all(|&r| r == 1), "{ranks:?}");
    // Even a prefix rank 0 holds goes to rank 1 when rank 0's queue costs more than the prefill.
    let held = prompt(500 + cold.iter().position(|&r| r == 0).unwrap() as u32, 1_000);
    assert_eq!(router.pick(held, &PickOptions::default(), 0).unwrap().rank, 1);
    // What was dispatched since a report counts: rank 1 fills up until rank 0 is cheaper.
    let mut router = DpRouter::new("cache_aware", 2, TicketLimits::default()).unwrap();
    router.report_load(0, report(1, 1, 0, Some(30_000), 1)).unwrap();
    router.report_load(1, report(0, 0, 0, Some(0), 1)).unwrap();
    let ranks = ranks_of(&mut router, 2_000..2_012, 4_000);
    assert!(ranks.contains(&0) && ranks[0] == 1, "{ranks:?}");
}

#[test]
fn best_rank_records_nothing() {
    let mut router = DpRouter::new("cache_aware", 4, TicketLimits::default()).unwrap();
    let tokens = prompt(9, 1_000);
    let asked = router.best_rank(tokens.clone(), &PickOptions::default(), 0).unwrap();
    let again = router.best_rank(tokens.clone(), &PickOptions::default(), 0).unwrap();
    assert_eq!((asked.branch, again.branch), (Branch::Cold, Branch::Cold));
    let picked = router.pick(tokens.clone(), &with_id("a"), 0).unwrap();
    assert_eq!(picked.rank, asked.rank);
    assert!(router.finish("a", None));
    let after = router.best_rank(tokens, &PickOptions::default(), 0).unwrap();
    assert_eq!((after.rank, after.branch), (picked.rank, Branch::Hit));
    assert!(after.predicted_cached_tokens > 900, "{after:?}");
    // Round-robin's turn does not advance on a query.
    let mut rr = DpRouter::new("round_robin", 4, TicketLimits::default()).unwrap();
    assert_eq!(rr.best_rank(vec![], &PickOptions::default(), 0).unwrap().rank, 0);
    assert_eq!(rr.pick(vec![], &PickOptions::default(), 0).unwrap().rank, 0);
    assert_eq!(rr.best_rank(vec![], &PickOptions::default(), 0).unwrap().rank, 1);
}

#[test]
fn feedback_releases_the_load_and_unknown_ids_are_told() {
    let mut router = DpRouter::new("total_requests", 2, TicketLimits::default()).unwrap();
    let first = router.pick(vec![1, 2, 3], &with_id("a"), 0).unwrap().rank;
    assert_eq!(router.endpoints()[first].load.in_flight_requests(), 1);
    assert!(router.first_token("a", 10, None));
    assert!(router.finish(
        "a",
        Some(Usage {
            prompt_tokens: 3,
            cached_tokens: 0
        })
    ));
    assert_eq!(router.endpoints()[first].load.in_flight_requests(), 0);
    assert!(!router.finish("a", None), "finished once");
    assert!(!router.first_token("zzz", 10, None));
    router.pick(vec![1], &with_id("b"), 0).unwrap();
    assert!(router.abort("b"));
    assert_eq!(router.tickets(), 0);
    // Without an id nothing is held.
    router.pick(vec![1], &PickOptions::default(), 0).unwrap();
    assert_eq!(router.tickets(), 0);
}

#[test]
fn tickets_are_bounded_in_number_and_in_age() {
    let limits = TicketLimits {
        max_tickets: 10,
        max_age_us: 1_000,
    };
    let mut router = DpRouter::new("total_requests", 2, limits).unwrap();
    for i in 0..25 {
        router.pick(vec![1], &with_id(&format!("r{i}")), 0).unwrap();
    }
    assert_eq!(router.tickets(), 10);
    assert!(!router.abort("r14"), "the oldest were dropped");
    assert!(router.abort("r15"));
    let in_flight: u64 = router.endpoints().iter().map(|e| e.load.in_flight_requests()).sum();
    assert_eq!(in_flight, 9);
    // The same id again replaces its ticket; the rest age out.
    router.pick(vec![1], &with_id("r16"), 0).unwrap();
    router.pick(vec![1], &with_id("late"), 5_000).unwrap();
    assert_eq!(router.tickets(), 1);
    let in_flight: u64 = router.endpoints().iter().map(|e| e.load.in_flight_requests()).sum();
    assert_eq!(in_flight, 1);
    // Many ids issued again and again keep the order's entries bounded.
    for i in 0..10_000 {
        router.pick(vec![1], &with_id("same"), 5_000 + i).unwrap();
    }
    assert!(
        router.order.len() <= 2 * router.tickets() + 65,
        "{}",
        router.order.len()
    );
}

#[test]
fn kv_events_make_a_rank_precise_and_a_restart_empties_it() {
    use rmpv::Value;
    let mut router = DpRouter::new("cache_aware:block_tokens=16", 2, TicketLimits::default()).unwrap();
    let tokens = prompt(3, 64);
    let stored = Value::Array(vec![
        "BlockStored".into(),
        Value::Array((1..=4u64).map(Value::from).collect()),
        Value::Nil,
        Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        Value::from(16),
        Value::Nil,
    ]);
    let encode = |ts: f64, events: Vec<Value>| {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &Value::Array(vec![Value::F64(ts), Value::Array(events)])).unwrap();
        out
    };
    let outcome = router.apply_kv_events(1, 0, &encode(1.0, vec![stored]), 0).unwrap();
    assert!(matches!(outcome, Received::Applied(_)), "{outcome:?}");
    let d = router
        .best_rank([&tokens[..], &[7, 7, 7]].concat(), &PickOptions::default(), 0)
        .unwrap();
    assert_eq!((d.rank, d.branch, d.predicted_cached_tokens), (1, Branch::Hit, 64));
    // The engine restarted: numbered from 0 again, later, holding nothing.
    let outcome = router.apply_kv_events(1, 0, &encode(2.0, vec![]), 0).unwrap();
    assert!(matches!(outcome, Received::Restarted(_)), "{outcome:?}");
    let d = router
        .best_rank([&tokens[..], &[7, 7, 7]].concat(), &PickOptions::default(), 0)
        .unwrap();
    assert_eq!((d.branch, d.predicted_cached_tokens), (Branch::Cold, 0));
    assert!(matches!(
        router.apply_kv_events(1, 1, b"\xc1", 0).unwrap(),
        Received::Undecodable(_)
    ));
    assert!(router.apply_kv_events(2, 0, b"", 0).is_err());
}

#[test]
fn prefix_match_rank_is_the_policys_choice() {
    let tokens = prompt(11, 4_000);
    let mut router = DpRouter::new("prefix_match", 8, TicketLimits::default()).unwrap();
    let via_router = router.pick(tokens.clone(), &PickOptions::default(), 0).unwrap().rank;
    assert_eq!(prefix_match_rank(tokens, 8).unwrap(), via_router);
    assert!(prefix_match_rank(vec![1], 0).is_err());
}

/// The scripted run shared with the Python package's tests (`crates/python/tests/test_router.py`): the same
/// operations, driven through the core here and through `dprouter.Router` there, must give the recorded ranks.
/// `DPROUTER_RECORD=1` rewrites the file from this scenario.
mod scripted {
    use super::*;
    use serde_json::{json, Value};

    const FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/dp_router_script.jsonl");

    /// A run of token ids: `len` of them from `seed` (the Python tests compute the same).
    fn run(seed: u64, len: u64) -> Vec<u32> {
        (0..len)
            .map(|i| ((seed * 7_919 + i * 2_654_435_761) % 151_936) as u32)
            .collect()
    }

    fn prompt(runs: &Value) -> Vec<u32> {
        runs.as_array()
            .unwrap()
            .iter()
            .flat_map(|r| run(r[0].as_u64().unwrap(), r[1].as_u64().unwrap()))
            .collect()
    }

    /// The operations, without their outcomes.
    fn scenario() -> Vec<Value> {
        let mut ops = Vec::new();
        for (p, policy) in [
            "cache_aware",
            "prefix_match",
            "prefix_affinity",
            "total_tokens",
            "round_robin",
        ]
        .iter()
        .enumerate()
        {
            ops.push(json!({"op": "router", "policy": policy, "num_ranks": 4}));
            let mut now = 0u64;
            let mut history: Vec<Vec<[u64; 2]>> = (0..6u64).map(|a| vec![[1, 700], [100 + a, 40]]).collect();
            for turn in 0..4u64 {
                for agent in 0..6u64 {
                    now += 50_000;
                    let id = format!("p{p}a{agent}t{turn}");
                    let runs = history[agent as usize].clone();
                    let mut op = json!({"op": "pick", "prompt": runs, "id": id, "now_us": now});
                    if agent == 5 && turn == 2 {
                        op["routed_rank"] = json!(2);
                    }
                    ops.push(op);
                    let len: u64 = runs.iter().map(|r| r[1]).sum();
                    ops.push(json!({"op": "first_token", "id": id, "now_us": now + 20_000,
                        "prompt_tokens": len, "cached_tokens": if turn == 0 { 0 } else { len - 60 }}));
                    if agent % 2 == 0 {
                        ops.push(json!({"op": "finish", "id": id}));
                    }
                    history[agent as usize].push([1_000 + agent * 10 + turn, 30 + 7 * turn]);
                }
                for rank in 0..4u64 {
                    let mut op = json!({"op": "report_load", "rank": rank, "running": turn + rank,
                        "waiting": rank % 2, "tokens": 1_000 * (rank + 1), "timestamp": turn + 1});
                    // From the third round on, with SGLang's prefill queue.
                    if turn >= 2 {
                        op["waiting_tokens"] = json!(3_000 * (rank % 2) * turn);
                    }
                    ops.push(op);
                }
                if turn == 1 {
                    ops.push(json!({"op": "set_active", "rank": 3, "active": false}));
                }
                if turn == 2 {
                    ops.push(json!({"op": "set_active", "rank": 3, "active": true}));
                }
            }
            for agent in (1..6).step_by(2) {
                for turn in 0..4 {
                    ops.push(json!({"op": "abort", "id": format!("p{p}a{agent}t{turn}")}));
                }
            }
            ops.push(json!({"op": "best_rank", "prompt": [[1, 700], [100, 40]], "now_us": now + 1}));
        }
        ops
    }

    /// Applies `op` and returns what it gave.
    fn apply(router: &mut Option<DpRouter>, op: &Value) -> Value {
        let kind = op["op"].as_str().unwrap();
        if kind == "router" {
            *router = Some(
                DpRouter::new(
                    op["policy"].as_str().unwrap(),
                    op["num_ranks"].as_u64().unwrap() as usize,
                    TicketLimits::default(),
                )
                .unwrap(),
            );
            return Value::Null;
        }
        let r = router.as_mut().unwrap();
        let id = op["id"].as_str();
        let now = op["now_us"].as_u64().unwrap_or(0);
        let decision = |d: Decision| json!([d.rank, d.branch.as_str(), d.predicted_cached_tokens]);
        match kind {
            "pick" | "best_rank" => {
                let options = PickOptions {
                    request_id: id,
                    routed_rank: op["routed_rank"].as_i64(),
                    ..PickOptions::default()
                };
                let tokens = prompt(&op["prompt"]);
                let d = match kind {
                    "pick" => r.pick(tokens, &options, now),
                    _ => r.best_rank(tokens, &options, now),
                };
                decision(d.unwrap())
            }
            "first_token" => json!(r.first_token(
                id.unwrap(),
                now,
                Some(Usage {
                    prompt_tokens: op["prompt_tokens"].as_u64().unwrap(),
                    cached_tokens: op["cached_tokens"].as_u64().unwrap(),
                })
            )),
            "finish" => json!(r.finish(id.unwrap(), None)),
            "abort" => json!(r.abort(id.unwrap())),
            "report_load" => json!(r
                .report_load(
                    op["rank"].as_i64().unwrap(),
                    LoadReport {
                        running: op["running"].as_u64().unwrap(),
                        waiting: op["waiting"].as_u64().unwrap(),
                        tokens: op["tokens"].as_u64().unwrap(),
                        waiting_tokens: op["waiting_tokens"].as_u64(),
                        timestamp: op["timestamp"].as_u64().unwrap(),
                    },
                )
                .unwrap()),
            "set_active" => {
                r.set_active(op["rank"].as_i64().unwrap(), op["active"].as_bool().unwrap())
                    .unwrap();
                Value::Null
            }
            other => panic!("unknown op {other}"),
        }
    }

    #[test]
    fn the_scripted_run_gives_its_recorded_outcomes() {
        if std::env::var_os("DPROUTER_RECORD").is_some() {
            let mut router = None;
            let lines: Vec<String> = scenario()
                .into_iter()
                .map(|mut op| {
                    let got = apply(&mut router, &op);
                    if !got.is_null() {
                        op["expect"] = got;
                    }
                    op.to_string()
                })
                .collect();
            std::fs::write(FILE, lines.join("\n") + "\n").unwrap();
        }
        let text = std::fs::read_to_string(FILE).unwrap();
        let mut router = None;
        let mut checked = 0;
        for (n, line) in text.lines().enumerate() {
            let op: Value = serde_json::from_str(line).unwrap();
            let got = apply(&mut router, &op);
            assert_eq!(
                got,
                op.get("expect").cloned().unwrap_or(Value::Null),
                "line {}: {line:.200}",
                n + 1
            );
            checked += usize::from(op["op"] == "pick");
        }
        assert_eq!(checked, 5 * 24);
    }
}
