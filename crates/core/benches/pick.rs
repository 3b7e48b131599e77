//! The routing hot path: `route` (override check + the policy's choice) per policy and prompt length.
//!
//! Run: `cargo bench -p dprouter-core --bench pick`. Tickets are dropped after each pick, so load-based
//! policies see a steady state rather than an ever-growing count.
#![allow(clippy::unwrap_used)]

use criterion::{black_box, criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use dprouter_core::{dispatch, route, EngineReport, PolicyConfig, RouteRequest, Snapshot};

fn prompt(len: usize) -> RouteRequest {
    RouteRequest::tokens((0..len as u32).map(|i| i.wrapping_mul(2_654_435_761) >> 15).collect())
}

fn pick(c: &mut Criterion) {
    let snap = Snapshot::single_worker(16);
    for (r, e) in snap.endpoints().iter().enumerate() {
        e.load.apply_report(EngineReport {
            requests: r as u64 % 5,
            tokens: 1000 * r as u64,
            timestamp: 1,
            waiting: 0,
            queued_prefill_tokens: None,
        });
    }
    let mut group = c.benchmark_group("pick");
    for len in [256usize, 4096, 32768] {
        let mut req = prompt(len);
        req.bootstrap_room = Some(12345);
        group.throughput(Throughput::Elements(1));
        for name in PolicyConfig::NAMES {
            let policy = PolicyConfig::from_name(name).unwrap().build();
            group.bench_with_input(BenchmarkId::new(*name, len), &req, |b, req| {
                b.iter(|| route(policy.as_ref(), &snap, black_box(req)).unwrap())
            });
        }
    }
    group.finish();

    let policy = PolicyConfig::from_name("total_tokens").unwrap().build();
    let req = prompt(4096);
    c.bench_function("dispatch/total_tokens/4096", |b| {
        // The request is moved into its ticket: each iteration gets its own copy, made outside the timing.
        b.iter_batched(
            || req.clone(),
            |req| dispatch(policy.as_ref(), &snap, black_box(req)).unwrap(),
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, pick);
criterion_main!(benches);
