//! `cache_aware` at scale: one routing decision plus recording (what `route` does) for 32,768-token prompts, with
//! the index holding 1M (block, endpoint) pairs over 16 endpoints.
//!
//! Run: `cargo bench -p dprouter-core --bench cache_aware`. The index is filled through rank overrides with 2,048
//! distinct 32,768-token prompts (512 blocks of 64 tokens each), 128 per endpoint, so each endpoint is at its
//! capacity of 65,536 blocks and every further decision records and forgets as in steady state. The group
//! `cache_aware_32768_sessions` repeats the decisions with `session_turns = 30` (conversations followed).
#![allow(clippy::unwrap_used)]

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use dprouter_core::hashing::mix64;
use dprouter_core::{
    route, CacheAware, CacheAwareConfig, Candidates, Endpoint, EndpointId, Policy, RouteRequest, Snapshot,
};

const PROMPT: usize = 32_768;
const ENDPOINTS: u32 = 16;
const BLOCK: usize = 64;
const PER_ENDPOINT_BLOCKS: u64 = 65_536;

fn prompt(id: u64, shared_with: Option<u64>, shared: usize) -> RouteRequest {
    let tokens = (0..PROMPT as u64)
        .map(|i| {
            let owner = match shared_with {
                Some(other) if (i as usize) < shared => other,
                _ => id,
            };
            (mix64(owner << 20 ^ i) % 151_936) as u32
        })
        .collect();
    RouteRequest::tokens(tokens)
}

/// A policy of `config` whose index is filled as the module says.
fn filled(snap: &Snapshot, config: CacheAwareConfig) -> (CacheAware, u64) {
    let policy = CacheAware::new(config);
    let prompts = u64::from(ENDPOINTS) * PER_ENDPOINT_BLOCKS / (PROMPT / BLOCK) as u64;
    for id in 0..prompts {
        let req = prompt(id, None, 0).with_override((id % u64::from(ENDPOINTS)) as i64);
        route(&policy, snap, &req).unwrap();
    }
    (policy, prompts)
}

fn bench(c: &mut Criterion) {
    let snap = Snapshot::new(
        (0..ENDPOINTS)
            .map(|r| Endpoint::new(EndpointId::new(0, r)).with_kv_capacity(PER_ENDPOINT_BLOCKS * BLOCK as u64))
            .collect(),
    );
    let config = CacheAwareConfig {
        block_tokens: BLOCK,
        ..CacheAwareConfig::default()
    };
    for (name, config) in [
        ("cache_aware_32768", config),
        (
            "cache_aware_32768_sessions",
            CacheAwareConfig {
                session_turns: 30,
                ..config
            },
        ),
    ] {
        let (policy, prompts) = filled(&snap, config);
        let stats = policy.index_stats();
        eprintln!(
            "{name}: index {} blocks (capacity {}), {:.1} MiB, {:.1} bytes per block",
            stats.blocks,
            stats.capacity_blocks,
            stats.bytes as f64 / (1 << 20) as f64,
            stats.bytes as f64 / stats.blocks as f64
        );
        let mut group = c.benchmark_group(name);
        group.throughput(Throughput::Elements(1));
        // A later turn of an indexed conversation: its first 30,000 tokens are held by one endpoint.
        let hit = prompt(1 << 40, Some(prompts - 1), 30_000);
        group.bench_function("route_hit", |b| {
            b.iter(|| route(&policy, &snap, black_box(&hit)).unwrap())
        });
        let mut next = 1u64 << 41;
        group.bench_function("route_cold", |b| {
            b.iter_batched(
                || {
                    next += 1;
                    prompt(next, None, 0)
                },
                |req| route(&policy, &snap, &req).unwrap(),
                BatchSize::LargeInput,
            )
        });
        // The decision and its record without hashing: what a retry costs (its ticket keeps the hashes).
        let prepared = policy.prepare(&hit);
        group.bench_function("choose_prepared_hit", |b| {
            b.iter(|| {
                policy
                    .choose(&Candidates::all(&snap), black_box(&hit), &prepared)
                    .unwrap()
            })
        });
        group.finish();
        let stats = policy.index_stats();
        eprintln!(
            "{name}: index after {} blocks (capacity {}), {:.1} MiB",
            stats.blocks,
            stats.capacity_blocks,
            stats.bytes as f64 / (1 << 20) as f64
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
