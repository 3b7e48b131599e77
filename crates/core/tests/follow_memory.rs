//! What precise mode's memory costs per engine block, counted by the allocator: the bytes live after following
//! an endpoint's events, divided by the engine blocks followed. The gateway caps the engine blocks it follows per
//! endpoint (`MAX_ENGINE_BLOCKS`); this is what that cap is sized from, and what docs/operations.md quotes.
//!
//! Run: `cargo test -p dprouter-core --test follow_memory -- --nocapture` (it prints the figures). The bounds it
//! asserts are generous multiples; the figures are what to read.
#![allow(clippy::unwrap_used)]

use std::alloc::System;

use dprouter_core::engine_blocks::{CacheChange, EngineBlocks};
use dprouter_core::hashing::mix64;
use dprouter_core::kv_events::KvEvent;
use dprouter_core::policy::{CacheAware, CacheAwareConfig, Policy};
use dprouter_core::EndpointId;
use stats_alloc::{StatsAlloc, INSTRUMENTED_SYSTEM};

/// Counts the bytes and allocations live (the one test in this binary, so nothing else allocates meanwhile).
#[global_allocator]
static ALLOCATOR: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Bytes live now, charging each live allocation 16 bytes for glibc's 8-byte header and its rounding to 16.
fn live() -> isize {
    let s = ALLOCATOR.stats();
    let bytes = s.bytes_allocated as isize - s.bytes_deallocated as isize + s.bytes_reallocated;
    bytes + 16 * (s.allocations as isize - s.deallocations as isize)
}

/// One stored event: `blocks` engine blocks of `page` tokens after `parent`, hashes from `first`.
fn stored(first: u64, parent: Option<u64>, blocks: usize, page: usize, salt: u64) -> KvEvent {
    KvEvent::Stored {
        hashes: (first..first + blocks as u64).collect(),
        parent,
        tokens: (0..(blocks * page) as u64)
            .map(|i| (mix64(salt << 24 ^ i) % 151_936) as u32)
            .collect(),
        block_size: page as u32,
        medium: None,
        plain: true,
    }
}

/// An engine's events for `total` engine blocks of `page` tokens: sequences of `per_event` blocks, each event
/// continuing the sequence before it for `chain` events, then a new sequence.
fn events(total: usize, page: usize, per_event: usize, chain: usize) -> impl Iterator<Item = KvEvent> {
    (0..total / per_event).map(move |e| {
        let first = (e * per_event) as u64 + 1;
        let parent = (e % chain != 0).then_some(first - 1);
        stored(first, parent, per_event, page, e as u64)
    })
}

struct Shape {
    name: &'static str,
    page: usize,
    per_event: usize,
    chain: usize,
}

const SHAPES: [Shape; 4] = [
    Shape {
        name: "vLLM, 2,048-token prompts (128 blocks of 16 per event)",
        page: 16,
        per_event: 128,
        chain: 1,
    },
    Shape {
        name: "vLLM, decoding (1 block of 16 per event, 64 per sequence)",
        page: 16,
        per_event: 1,
        chain: 64,
    },
    Shape {
        name: "SGLang, 2,048-token prompts (2,048 pages of 1 per event)",
        page: 1,
        per_event: 2_048,
        chain: 1,
    },
    Shape {
        name: "SGLang, decoding (16 pages of 1 per event, 1,024 per sequence)",
        page: 1,
        per_event: 16,
        chain: 64,
    },
];

const BLOCKS: usize = 262_144;

/// Bytes per engine block that following `shape` holds: with the follower alone, and with the policy's index
/// (blocks and tails) that it feeds, as the gateway's feed does.
fn measure(shape: &Shape, with_policy: bool) -> f64 {
    let before = live();
    let mut follower = EngineBlocks::new(64, usize::MAX);
    let policy = CacheAware::new(CacheAwareConfig {
        // Room for every router block: what is measured is the cost of holding them, not the LRU dropping them.
        kv_capacity_tokens: (BLOCKS * shape.page) as u64 * 2,
        ..CacheAwareConfig::default()
    });
    let endpoint = EndpointId::new(0, 0);
    for event in events(BLOCKS, shape.page, shape.per_event, shape.chain) {
        let change: Option<CacheChange> = follower.apply(&event).unwrap();
        if let Some(change) = change.filter(|_| with_policy) {
            policy.engine_cache(endpoint, &change, 0);
        }
    }
    assert_eq!(follower.len(), BLOCKS);
    assert_eq!(policy.is_precise(endpoint), with_policy);
    let bytes = (live() - before) as f64;
    drop((follower, policy));
    bytes / BLOCKS as f64
}

#[test]
fn what_following_an_engine_costs_per_block() {
    println!("{BLOCKS} engine blocks, router blocks of 64 tokens; bytes per engine block:");
    for shape in &SHAPES {
        let (follower, total) = (measure(shape, false), measure(shape, true));
        println!(
            "  {:<70} follower {follower:>6.0}, with the policy's index {total:>6.0}",
            shape.name
        );
        // Generous (the worst shape measures about 630): a regression that adds half fails; the figures are in docs/operations.md.
        assert!(total < 900.0, "{}: {total:.0} bytes per engine block", shape.name);
    }
}
