//! Flow control's unit tests (paused clocks): every path leaves nothing pending, pools hold up their own requests,
//! priority and turns, prefix affinity.

use super::*;
use crate::config::{Backend, WorkerConfig};
use dprouter_core::LoadGuard;

/// Adds an SGLang worker of `dp_size` ranks at `url` serving `models` (none: any) to `registry`.
fn add_worker(registry: &Registry, url: &str, dp_size: u32, models: &[&str]) {
    let models: Vec<String> = models.iter().map(|m| m.to_string()).collect();
    let worker = WorkerConfig {
        url: url.into(),
        backend: Backend::Sglang,
        dp_size: Some(dp_size),
        models: models.clone(),
        ..Default::default()
    };
    let info = crate::fleet::upstream::WorkerInfo {
        dp_size,
        kv_capacity: None,
        models,
    };
    registry.add_worker(&worker, info).unwrap();
}

/// Flow control over one worker of one rank, saturated at one request in flight, its queue timeout 1 s.
fn one_slot() -> (Arc<FlowControl>, Arc<Registry>) {
    let config = FlowControlConfig {
        enabled: true,
        max_in_flight_per_endpoint: 1,
        queue_timeout_ms: 1000,
        ..Default::default()
    };
    let registry = Arc::new(Registry::new(Default::default()));
    add_worker(&registry, "http://w:1", 1, &[]);
    (FlowControl::new(&config, 0).unwrap(), registry)
}

fn demand() -> Demand<'static> {
    static DEFAULT: std::sync::LazyLock<FlowId> = std::sync::LazyLock::new(|| FlowId::alone(DEFAULT_FLOW));
    Demand {
        model: None,
        priority: 0,
        flow: &DEFAULT,
        bytes: 100,
        affinity: None,
    }
}

/// The request's share of the load, as a pick takes it.
fn pick(registry: &Registry) -> LoadGuard {
    let load = Arc::clone(&registry.membership().snapshot.endpoints()[0].load);
    LoadGuard::acquire(load, 10, false)
}

fn pending(flow: &FlowControl) -> usize {
    flow.pending.load(Ordering::Relaxed)
}

/// On every path (let through, released, timed out, client gone) nothing stays pending or queued.
#[tokio::test(start_paused = true)]
async fn every_path_leaves_nothing_pending_or_queued() {
    let (flow, registry) = one_slot();
    let (stop, stopped) = watch::channel(false);
    let dispatcher = tokio::spawn(dispatch(Arc::clone(&flow), Arc::clone(&registry), stopped));
    // Let through at once; it picks and holds the only slot, and a second request waits for it.
    let first = flow.admit(&registry, demand()).await.unwrap();
    assert!(!first.waited);
    assert_eq!(pending(&flow), 1);
    let held = pick(&registry);
    drop(first);
    assert_eq!(pending(&flow), 0);
    let second = tokio::spawn({
        let (flow, registry) = (Arc::clone(&flow), Arc::clone(&registry));
        async move { flow.admit(&registry, demand()).await.map(|a| a.waited) }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(flow.lock().entries.len(), 1);
    // The slot frees: the second is released and picks.
    drop(held);
    assert!(second.await.unwrap().unwrap(), "it waited");
    assert_eq!(pending(&flow), 0);
    assert!(flow.lock().entries.is_empty());
    // Saturated: a request times out, and one whose client goes leaves at once.
    let held = pick(&registry);
    let late = flow.admit(&registry, demand()).await;
    assert!(matches!(late, Err(ApiError::Overloaded(m)) if m.contains("waited 1000 ms")));
    let gone = tokio::spawn({
        let (flow, registry) = (Arc::clone(&flow), Arc::clone(&registry));
        async move { flow.admit(&registry, demand()).await.is_ok() }
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(flow.lock().entries.len(), 1);
    assert_eq!(flow.lock().entries.bytes(), 100);
    gone.abort();
    let _ = gone.await;
    assert!(flow.lock().entries.is_empty());
    assert_eq!(flow.lock().entries.bytes(), 0);
    drop(held);
    assert_eq!(pending(&flow), 0);
    stop.send_replace(true);
    dispatcher.await.unwrap();
}

/// A pool that is saturated holds up its own requests only: another model's go at once, and leave the queue
/// as soon as their pool has room, past the first pool's.
#[tokio::test(start_paused = true)]
async fn a_saturated_pool_holds_up_its_own_requests_only() {
    let (flow, registry) = one_slot();
    add_worker(&registry, "http://w:2", 1, &["b"]);
    let (stop, stopped) = watch::channel(false);
    let dispatcher = tokio::spawn(dispatch(Arc::clone(&flow), Arc::clone(&registry), stopped));
    let membership = registry.membership();
    let rank_of = |url: &str| membership.targets.iter().position(|t| &*t.base == url).unwrap();
    let hold = |rank: usize| LoadGuard::acquire(Arc::clone(&membership.snapshot.endpoints()[rank].load), 1, false);
    let model = |m: &'static str| Demand {
        model: Some(m),
        ..demand()
    };
    // Model a's pool (the first worker serves any model, b's serves b) full; one of its requests waits.
    let held_a = hold(rank_of("http://w:1"));
    let waiting_a = tokio::spawn({
        let (flow, registry) = (Arc::clone(&flow), Arc::clone(&registry));
        async move { flow.admit(&registry, model("a")).await.map(|a| a.waited) }
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(flow.lock().entries.len(), 1);
    // Model b goes at once.
    assert!(!flow.admit(&registry, model("b")).await.unwrap().waited);
    // Both pools full (b's request waits behind nothing of its own pool, yet its pool is full): when b's frees
    // first, b's request leaves first, past a's.
    let held_b = hold(rank_of("http://w:2"));
    let held_any = hold(rank_of("http://w:1"));
    let waiting_b = tokio::spawn({
        let (flow, registry) = (Arc::clone(&flow), Arc::clone(&registry));
        async move { flow.admit(&registry, model("b")).await.map(|a| a.waited) }
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(flow.lock().entries.len(), 2);
    drop(held_b);
    assert!(waiting_b.await.unwrap().unwrap());
    assert_eq!(flow.lock().entries.len(), 1, "a's request still waits");
    drop((held_a, held_any));
    assert!(waiting_a.await.unwrap().unwrap());
    stop.send_replace(true);
    dispatcher.await.unwrap();
}

/// A scripted run: with the one slot held, three requests of flow a, one of flow b and then one of a higher
/// band wait; as the slot frees, one request at a time, the higher band goes first, then flows a and b take
/// turns, each first come first served.
#[tokio::test(start_paused = true)]
async fn strict_priority_between_bands_and_turns_between_flows() {
    let (flow, registry) = one_slot();
    let (stop, stopped) = watch::channel(false);
    let dispatcher = tokio::spawn(dispatch(Arc::clone(&flow), Arc::clone(&registry), stopped));
    let mut held = pick(&registry);
    // Each request, once let through, takes the slot and hands it to the test with its name.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for (name, flow_id, priority) in [
        ("a1", "a", 0),
        ("a2", "a", 0),
        ("a3", "a", 0),
        ("b1", "b", 0),
        ("h1", "a", 5),
    ] {
        tokio::spawn({
            let (flow, registry, tx) = (Arc::clone(&flow), Arc::clone(&registry), tx.clone());
            async move {
                let flow_id = FlowId::alone(flow_id);
                let demand = Demand {
                    flow: &flow_id,
                    priority,
                    ..demand()
                };
                let admitted = flow.admit(&registry, demand).await.unwrap();
                let slot = pick(&registry);
                drop(admitted);
                tx.send((name, slot)).unwrap();
            }
        });
        // Each waits before the next comes.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(flow.lock().entries.len(), 5);
    let mut order = Vec::new();
    for _ in 0..5 {
        drop(held);
        let (name, slot) = rx.recv().await.unwrap();
        order.push(name);
        held = slot;
    }
    assert_eq!(order, ["h1", "a1", "b1", "a2", "a3"]);
    drop(held);
    assert_eq!(pending(&flow), 0);
    assert!(flow.lock().entries.is_empty());
    stop.send_replace(true);
    dispatcher.await.unwrap();
}

#[test]
fn a_keyed_clients_flow_is_its_own_and_objectives_set_priorities() {
    let config = FlowControlConfig {
        enabled: true,
        objectives: [("critical".to_string(), 10), ("batch".to_string(), -1)].into(),
        ..Default::default()
    };
    let flow = FlowControl::new(&config, 0).unwrap();
    let mut headers = HeaderMap::new();
    assert_eq!(
        flow.classify(None, &headers, None).unwrap(),
        (FlowId::alone(DEFAULT_FLOW), 0)
    );
    headers.insert(FAIRNESS_HEADER, "tenant-a".parse().unwrap());
    headers.insert(OBJECTIVE_HEADER, "critical".parse().unwrap());
    assert_eq!(
        flow.classify(None, &headers, None).unwrap(),
        (FlowId::alone("tenant-a"), 10)
    );
    headers.insert(OBJECTIVE_HEADER, "unknown".parse().unwrap());
    assert_eq!(flow.classify(None, &headers, None).unwrap().1, 0);
    headers.insert(FAIRNESS_HEADER, "x".repeat(300).parse().unwrap());
    assert_eq!(flow.classify(None, &headers, None).unwrap_err().status(), 400);
    // An agent's program is its flow, before the fairness header; a keyed client's flow stays its own.
    headers.insert(FAIRNESS_HEADER, "tenant-a".parse().unwrap());
    let program = flow.classify(None, &headers, Some(0xabc)).unwrap().0;
    assert_eq!(program, FlowId::alone("program:0000000000000abc"));
}

#[test]
fn a_keyed_clients_programs_are_flows_within_its_group() {
    let flow = FlowControl::new(
        &FlowControlConfig {
            enabled: true,
            ..Default::default()
        },
        0,
    )
    .unwrap();
    // `printf %s key-alice | sha256sum`.
    let alice = crate::config::clients::ClientConfig {
        name: "alice".into(),
        key_sha256: "87844ec0b0d738e89628640588acaa48537b814a5c4f9697e3b352d11ffedaef".into(),
        ..Default::default()
    };
    let clients = crate::admission::clients::Clients::new(&[alice]);
    let mut headers = HeaderMap::new();
    headers.insert("authorization", "Bearer key-alice".parse().unwrap());
    let client = clients.admit(&headers).unwrap().unwrap();
    headers.insert(FAIRNESS_HEADER, "mallory".parse().unwrap());
    let (id, _) = flow.classify(Some(&client), &headers, Some(7)).unwrap();
    assert_eq!(
        (id.group.as_str(), id.flow.as_str()),
        ("alice", "program:0000000000000007")
    );
    let (id, _) = flow.classify(Some(&client), &headers, None).unwrap();
    assert_eq!(id, FlowId::alone("alice"));
}

#[test]
fn unkeyed_objectives_can_be_ignored() {
    let config = FlowControlConfig {
        enabled: true,
        objectives: [("critical".to_string(), 10), ("batch".to_string(), -1)].into(),
        trust_unkeyed_objectives: false,
        ..Default::default()
    };
    let flow = FlowControl::new(&config, 0).unwrap();
    let mut headers = HeaderMap::new();
    headers.insert(OBJECTIVE_HEADER, "critical".parse().unwrap());
    assert_eq!(
        flow.classify(None, &headers, None).unwrap().1,
        0,
        "an unkeyed objective is ignored"
    );
    headers.insert(OBJECTIVE_HEADER, "batch".parse().unwrap());
    assert_eq!(
        flow.classify(None, &headers, None).unwrap().1,
        0,
        "even one that lowers the priority"
    );
}

/// With `prefix_wait_ms`, a queued request waits for the endpoint that holds its prefix while another has
/// room: a request without a prefix passes it, and it takes the other endpoint only `prefix_wait_ms` after
/// it first let one pass; it goes to its own endpoint as soon as that has room.
#[tokio::test(start_paused = true)]
async fn a_request_waits_a_bounded_time_for_the_endpoint_holding_its_prefix() {
    let config = FlowControlConfig {
        enabled: true,
        max_in_flight_per_endpoint: 1,
        prefix_wait_ms: 200,
        ..Default::default()
    };
    let registry = Arc::new(Registry::new(Default::default()));
    add_worker(&registry, "http://w:1", 2, &[]);
    let flow = FlowControl::new(&config, 0).unwrap();
    let (stop, stopped) = watch::channel(false);
    let dispatcher = tokio::spawn(dispatch(Arc::clone(&flow), Arc::clone(&registry), stopped));
    let policy: Arc<dyn dprouter_core::Policy> =
        Arc::from(dprouter_core::PolicyConfig::from_name("cache_aware").unwrap().build());
    let membership = registry.membership();
    let snapshot = &membership.snapshot;
    // Rank 0 holds the prompt, and is busy.
    let prompt: Vec<u32> = (0..512).collect();
    let cached = RouteRequest::tokens(prompt.clone());
    let only_0 = |r: usize| r == 0;
    let placed = dprouter_core::dispatch_among(Arc::clone(&policy), snapshot, &only_0, cached).unwrap();
    assert_eq!(placed.pick.rank, 0);
    drop(placed);
    let busy = || LoadGuard::acquire(Arc::clone(&snapshot.endpoints()[0].load), 1, false);
    let held = busy();
    let wait_for = |tokens: Vec<u32>| {
        let (flow, registry, policy) = (Arc::clone(&flow), Arc::clone(&registry), Arc::clone(&policy));
        tokio::spawn(async move {
            let affinity = Affinity::new(policy, RouteRequest::tokens(tokens));
            let demand = Demand {
                affinity: Some(affinity),
                ..demand()
            };
            let admitted = flow.admit(&registry, demand).await.unwrap();
            (
                tokio::time::Instant::now(),
                admitted.route.as_ref().map(|r| r.input_tokens),
            )
        })
    };
    let start = tokio::time::Instant::now();
    // Its endpoint frees in time: it goes there, having waited for it.
    let warm = wait_for(prompt.clone());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(flow.lock().entries.len(), 1, "it waits while rank 1 has room");
    drop(held);
    let (at, route) = warm.await.unwrap();
    assert_eq!(route, Some(512), "its request comes back with it");
    assert!(at - start < Duration::from_millis(100));
    // Its endpoint stays busy: a request with no prefix anywhere passes it, and it goes after 200 ms.
    let held = busy();
    let start = tokio::time::Instant::now();
    let warm = wait_for(prompt);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let cold = wait_for((10_000..10_512).collect());
    let (at, _) = cold.await.unwrap();
    assert!(at - start < Duration::from_millis(100), "the cold request passed");
    assert_eq!(flow.lock().entries.len(), 1);
    let (at, _) = warm.await.unwrap();
    let waited = at - start;
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_millis(300),
        "{waited:?}"
    );
    drop(held);
    assert_eq!(pending(&flow), 0);
    stop.send_replace(true);
    dispatcher.await.unwrap();
}
