//! The registry's unit tests: probes, outlier ejection and its caps, membership and snapshots.

use super::*;

fn worker(url: &str) -> WorkerConfig {
    WorkerConfig {
        url: url.into(),
        backend: Backend::Sglang,
        dp_size: None,
        rank_field: RankField::RoutedDpRank,
        ..WorkerConfig::default()
    }
}

fn info(dp_size: u32) -> WorkerInfo {
    WorkerInfo {
        dp_size,
        kv_capacity: Some(1000),
        models: Vec::new(),
    }
}

fn healthy(r: &Registry) -> Vec<usize> {
    r.membership().snapshot.healthy().to_vec()
}

#[test]
fn workers_expand_to_endpoints_in_order() {
    let r = Registry::new(HealthConfig::default());
    let a = r.add_worker(&worker("http://a:1/"), info(2)).unwrap();
    let b = r.add_worker(&worker("http://b:1"), info(3)).unwrap();
    let m = r.membership();
    assert_eq!(m.snapshot.len(), 5);
    assert_eq!(&*m.targets[1].base, "http://a:1");
    assert_eq!((m.targets[2].id.worker, m.targets[2].id.dp_rank), (b, 0));
    assert_eq!(m.snapshot.endpoints()[4].kv_capacity, Some(1000));
    assert!(r.remove_worker(a));
    assert!(!r.remove_worker(a));
    assert_eq!(r.membership().snapshot.len(), 3);
}

#[test]
fn found_workers_join_in_one_change_and_route_only_once_admitted() {
    let r = Registry::new(HealthConfig::default());
    let ready = r.add_worker(&worker("http://10.0.0.1:8000"), info(1)).unwrap();
    let found = |url: &str| WorkerConfig {
        dp_size: Some(2),
        ..worker(url)
    };
    let batch = vec![
        (found("http://10.0.0.2:8000"), Admission::Unprobed),
        // The same URL in another spelling, and one already registered: the ids they duplicate.
        (found("http://10.0.0.2:8000/"), Admission::Unprobed),
        (found("http://10.0.0.1:8000"), Admission::Unprobed),
        (found("http://10.0.0.3:8000"), Admission::Unprobed),
    ];
    let before = r.membership();
    let added = r.add_workers(batch);
    let (a, b) = (added[0].unwrap(), added[3].unwrap());
    assert_eq!(added[1], Err(a));
    assert_eq!(added[2], Err(ready));
    let m = r.membership();
    assert!(!Arc::ptr_eq(&before, &m));
    assert_eq!(m.snapshot.len(), 5, "the found workers' endpoints are members");
    assert_eq!(healthy(&r), [0], "but not routable before a probe");
    let due: Vec<WorkerId> = r.due_now().iter().map(|w| w.id).collect();
    assert_eq!(due, [a, b]);
    // A passing probe alone does not admit a found worker: its models are asked first.
    r.record_probes(&[(a, true), (a, true), (b, false)]);
    assert_eq!(healthy(&r), [0]);
    let models = WorkerInfo {
        models: vec!["llama".into()],
        ..info(2)
    };
    assert!(r.admit(a, models.clone()));
    assert!(!r.admit(a, models), "admitted once");
    assert!(!r.admit(ready, info(1)), "a worker from the config is not waiting");
    assert_eq!(healthy(&r), [0, 1, 2]);
    assert_eq!(&*r.membership().targets[1].models, ["llama".to_string()]);
    assert_eq!(r.registered("http://10.0.0.3:8000/"), Some(b));
    assert_eq!(r.remove_workers(&[a, b, WorkerId(99)]), 2);
    assert_eq!(r.registered("http://10.0.0.3:8000"), None);
    assert_eq!(r.membership().snapshot.len(), 1);
    assert!(r.due_now().is_empty());
}

fn config(threshold: u32) -> HealthConfig {
    HealthConfig {
        failure_threshold: 2,
        success_threshold: 2,
        passive_failure_threshold: threshold,
        base_ejection_ms: 1000,
        max_ejection_ms: 4000,
        max_ejection_percent: 100,
        panic_threshold_percent: 0,
        ..HealthConfig::default()
    }
}

fn ep(worker: WorkerId, dp_rank: u32) -> EndpointId {
    EndpointId { worker, dp_rank }
}

fn fail(r: &Registry, e: EndpointId, times: usize, now: Instant) {
    for _ in 0..times {
        r.record_failure(e, Failure::Engine, now);
    }
}

#[test]
fn a_slow_probe_of_a_serving_worker_counts_neither_way() {
    let r = Registry::new(HealthConfig {
        interval_ms: 1000,
        ..HealthConfig::default()
    });
    let w = r.add_worker(&worker("http://a:1"), info(1)).unwrap();
    let now = crate::common::clock::now_us() + 10_000_000;
    // Never answered a request: a slow probe is a failed one.
    for _ in 0..HealthConfig::default().failure_threshold {
        assert!(!r.record_slow_probe(w, now));
    }
    assert!(!r.workers()[0].active_healthy());
    r.record_probe(w, true);
    r.record_probe(w, true);
    assert!(r.workers()[0].active_healthy());
    // It answers a request; slow probes within the interval after that leave it up, later ones do not.
    r.record_success(ep(w, 0));
    let answered = r.workers()[0].endpoints[0].last_answer_us.load(Relaxed);
    for _ in 0..5 {
        assert!(r.record_slow_probe(w, answered + 900_000));
    }
    assert!(r.workers()[0].active_healthy());
    for _ in 0..HealthConfig::default().failure_threshold {
        assert!(!r.record_slow_probe(w, answered + 1_100_000));
    }
    assert!(!r.workers()[0].active_healthy());
}

#[test]
fn a_slow_probe_of_a_worker_with_requests_in_flight_counts_neither_way_for_a_grace() {
    let r = Registry::new(HealthConfig {
        interval_ms: 1000,
        ..HealthConfig::default()
    });
    let w = r.add_worker(&worker("http://a:1"), info(2)).unwrap();
    r.record_success(ep(w, 1));
    let answered = r.workers()[0].endpoints[1].last_answer_us.load(Relaxed);
    let grace = BUSY_GRACE.as_micros() as u64;
    // A request in flight on rank 0 (a burst of long prompts: the next answer is seconds away).
    let guard = dprouter_core::LoadGuard::acquire(Arc::clone(&r.workers()[0].endpoints[0].load), 500, false);
    for _ in 0..5 {
        assert!(r.record_slow_probe(w, answered + 5_000_000));
        assert!(r.record_slow_probe(w, answered + grace));
    }
    assert!(r.workers()[0].active_healthy());
    // No answer for longer than the grace: it is hung, requests in flight or not.
    for _ in 0..HealthConfig::default().failure_threshold {
        assert!(!r.record_slow_probe(w, answered + grace + 1));
    }
    assert!(!r.workers()[0].active_healthy());
    // Without requests in flight, only the probe interval counts.
    drop(guard);
    r.record_probe(w, true);
    r.record_probe(w, true);
    assert!(!r.record_slow_probe(w, answered + 5_000_000));
}

#[test]
fn probes_change_worker_health() {
    let r = Registry::new(config(2));
    let w = r.add_worker(&worker("http://a:1"), info(2)).unwrap();
    r.record_probe(w, false);
    assert_eq!(healthy(&r), vec![0, 1], "one failed probe is not enough");
    r.record_probe(w, false);
    assert!(healthy(&r).is_empty());
    r.record_probe(w, true);
    assert!(healthy(&r).is_empty());
    r.record_probe(w, true);
    assert_eq!(healthy(&r), vec![0, 1]);
}

#[test]
fn a_worker_back_from_down_comes_back_with_every_endpoint() {
    let r = Registry::new(config(2));
    let w = r.add_worker(&worker("http://a:1"), info(2)).unwrap();
    let t0 = Instant::now();
    // Killed: its streams broke and requests were refused before the probes took it down.
    fail(&r, ep(w, 0), 3, t0);
    assert_eq!(healthy(&r), vec![1], "ejected");
    r.record_failure(ep(w, 0), Failure::Connect, t0);
    r.record_probe(w, false);
    assert!(healthy(&r).is_empty(), "down (the refused connection made it suspect)");
    // What was learned of its prefill costs before is about the engine that was there then.
    let load = std::sync::Arc::clone(&r.workers()[0].endpoints[1].load);
    for tokens in 0..20 {
        load.observe_prefill(100 + tokens * 100, 1_000 + tokens * 50);
    }
    assert!(load.fitted_costs().is_some());
    // Restarted well within the ejection time: both endpoints serve again at once.
    r.record_probe(w, true);
    assert!(load.fitted_costs().is_some(), "not back yet");
    r.record_probe(w, true);
    assert_eq!(healthy(&r), vec![0, 1]);
    assert_eq!(
        r.workers()[0].endpoints[0].ejections(),
        0,
        "in good standing, not on probation"
    );
    assert_eq!(load.cost_samples(), 0, "the restarted engine's costs are learned anew");
}

#[test]
fn failures_eject_one_endpoint_with_doubling_back_off_and_time_readmits_it() {
    let r = Registry::new(config(2));
    let w = r.add_worker(&worker("http://a:1"), info(2)).unwrap();
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    r.record_failure(ep(w, 1), Failure::Engine, t0);
    r.record_success(ep(w, 1));
    r.record_failure(ep(w, 1), Failure::Engine, t0);
    assert_eq!(healthy(&r), vec![0, 1], "a success ends the run");
    r.record_failure(ep(w, 1), Failure::Engine, t0);
    assert_eq!(healthy(&r), vec![0], "two in a row eject it, and only it");
    r.record_probe(w, true);
    r.record_probe(w, true);
    assert_eq!(
        healthy(&r),
        vec![0],
        "good probes of the worker do not re-admit an ejected endpoint"
    );
    r.sweep(ms(999));
    assert_eq!(healthy(&r), vec![0]);
    r.sweep(ms(1000));
    assert_eq!(healthy(&r), vec![0, 1], "back after the base ejection time");
    // On probation: one failure ejects it again, for twice as long, then four times, capped at the maximum.
    let mut at = 1000;
    for length in [2000, 4000, 4000] {
        r.record_failure(ep(w, 1), Failure::Engine, ms(at));
        assert_eq!(healthy(&r), vec![0]);
        r.sweep(ms(at + length - 1));
        assert_eq!(healthy(&r), vec![0], "ejected for {length} ms");
        at += length;
        r.sweep(ms(at));
        assert_eq!(healthy(&r), vec![0, 1]);
    }
    // Routable long enough, the back-off decays one step per base ejection time, probation ends with it.
    assert_eq!(r.workers()[0].endpoints[1].ejections(), 4);
    for step in 1..=4 {
        r.sweep(ms(at + 1000 * step));
    }
    assert_eq!(r.workers()[0].endpoints[1].ejections(), 0);
    r.record_failure(ep(w, 1), Failure::Engine, ms(at + 5000));
    assert_eq!(
        healthy(&r),
        vec![0, 1],
        "in good standing again: one failure is not enough"
    );
}

#[test]
fn at_most_max_ejection_percent_is_ejected() {
    let r = Registry::new(HealthConfig {
        max_ejection_percent: 50,
        ..config(1)
    });
    let w = r.add_worker(&worker("http://a:1"), info(4)).unwrap();
    let now = Instant::now();
    for rank in 0..4 {
        fail(&r, ep(w, rank), 5, now);
    }
    assert_eq!(healthy(&r), vec![2, 3], "half of four may be out");
    let r = Registry::new(HealthConfig {
        max_ejection_percent: 10,
        ..config(1)
    });
    let w = r.add_worker(&worker("http://a:1"), info(2)).unwrap();
    fail(&r, ep(w, 0), 5, now);
    fail(&r, ep(w, 1), 5, now);
    assert_eq!(healthy(&r), vec![1], "one may always be ejected");
}

#[test]
fn panic_mode_ignores_ejections_but_not_failed_probes() {
    let r = Registry::new(HealthConfig {
        panic_threshold_percent: 50,
        ..config(1)
    });
    let a = r.add_worker(&worker("http://a:1"), info(4)).unwrap();
    let b = r.add_worker(&worker("http://b:1"), info(2)).unwrap();
    let now = Instant::now();
    r.record_probe(b, false);
    r.record_probe(b, false);
    assert_eq!(healthy(&r), vec![0, 1, 2, 3]);
    fail(&r, ep(a, 0), 5, now);
    fail(&r, ep(a, 1), 5, now);
    assert_eq!(healthy(&r), vec![2, 3], "two of four routable: not below half");
    assert!(!r.membership().panic);
    fail(&r, ep(a, 2), 5, now);
    assert!(r.membership().panic, "one of four routable");
    assert_eq!(
        healthy(&r),
        vec![0, 1, 2, 3],
        "every endpoint of the worker that passes its probes"
    );
    r.sweep(now + Duration::from_millis(1000));
    assert!(!r.membership().panic);
    assert_eq!(healthy(&r), vec![0, 1, 2, 3]);
}

#[test]
fn a_refused_connection_takes_a_worker_down_only_when_a_probe_confirms() {
    let r = Registry::new(config(3));
    let w = r.add_worker(&worker("http://a:1"), info(2)).unwrap();
    r.record_failure(ep(w, 0), Failure::Connect, Instant::now());
    assert_eq!(healthy(&r), vec![0, 1], "one refused connection downs nothing");
    r.record_probe(w, true);
    r.record_probe(w, false);
    assert_eq!(healthy(&r), vec![0, 1], "a good probe cleared the suspicion");
    r.record_failure(ep(w, 1), Failure::Connect, Instant::now());
    r.record_probe(w, false);
    assert!(
        healthy(&r).is_empty(),
        "a failed probe right after it confirms the worker is down"
    );
}

#[test]
fn failures_every_endpoint_sees_alike_eject_nobody_but_an_outlier_is_ejected() {
    let r = Registry::new(HealthConfig {
        max_ejection_percent: 50,
        ..config(3)
    });
    let w = r.add_worker(&worker("http://a:1"), info(4)).unwrap();
    let now = Instant::now();
    // 15% of requests fail on every endpoint alike (a fixed pseudo-random sequence), 4,000 requests.
    let mut x: u64 = 7;
    let mut ejections = 0;
    for i in 0..4000u32 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let e = ep(w, i % 4);
        if (x >> 33) % 100 < 15 {
            r.record_failure(e, Failure::Engine, now);
        } else {
            r.record_success(e);
        }
        ejections += 4 - healthy(&r).len();
        r.sweep(now + Duration::from_secs(3600));
    }
    assert_eq!(ejections, 0, "nobody is an outlier");
    // Now rank 2 alone fails every request: it stands out, and goes.
    for _ in 0..20 {
        r.record_failure(ep(w, 2), Failure::Engine, now);
    }
    assert_eq!(healthy(&r), vec![0, 1, 3]);
}

#[test]
fn a_broken_exchange_without_an_answer_never_ejects() {
    let r = Registry::new(config(1));
    let w = r.add_worker(&worker("http://a:1"), info(2)).unwrap();
    for _ in 0..20 {
        r.record_failure(ep(w, 0), Failure::Ambiguous, Instant::now());
    }
    assert_eq!(healthy(&r), vec![0, 1]);
    r.record_probe(w, true);
    assert_eq!(healthy(&r), vec![0, 1]);
}

#[test]
fn load_counters_survive_rebuilds() {
    let r = Registry::new(config(1));
    let w = r.add_worker(&worker("http://a:1"), info(1)).unwrap();
    let before = Arc::clone(&r.membership().snapshot.endpoints()[0].load);
    r.record_failure(EndpointId { worker: w, dp_rank: 0 }, Failure::Engine, Instant::now());
    assert!(Arc::ptr_eq(&before, &r.membership().snapshot.endpoints()[0].load));
}
