//! Precise mode's tails ([`HeldTails`]) where many sequences branch after one router block: 2,048 conversations on
//! SGLang's one-token pages share a 1,000-token system prompt (15 blocks of 64 and 40 tokens more), so after the
//! 15th block each leaves 23 tails (its pages ending at tokens 1,001 to 1,023), 47,144 there with the system
//! prompt's 40 (about 200,000 tails in all); a look-up there finds a prompt's longest.
//!
//! Run: `cargo bench -p dprouter-core --bench tails`.
#![allow(clippy::unwrap_used)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use dprouter_core::engine_blocks::{EngineBlocks, HeldTails};
use dprouter_core::hashing::{block_hashes, mix64};
use dprouter_core::kv_events::KvEvent;
use dprouter_core::Prompt;

const BLOCK: usize = 64;
const SHARED: usize = 1_000;
const CONVERSATIONS: u64 = 2_048;
const OWN: usize = 100;

fn stored(first_hash: u64, parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::Stored {
        hashes: (first_hash..first_hash + tokens.len() as u64).collect(),
        parent,
        tokens,
        block_size: 1,
        medium: None,
        plain: true,
    }
}

fn bench(c: &mut Criterion) {
    let shared: Vec<u32> = (0..SHARED as u64).map(|i| (mix64(i) % 151_936) as u32).collect();
    let own = |j: u64| -> Vec<u32> { (0..OWN as u64).map(|i| (mix64(j << 20 ^ i) % 151_936) as u32).collect() };
    let mut engine = EngineBlocks::new(BLOCK, usize::MAX);
    let mut tails = HeldTails::default();
    let mut follow = |event: KvEvent| {
        if let Some(change) = engine.apply(&event).unwrap() {
            tails.apply(&change);
        }
    };
    follow(stored(0, None, shared.clone()));
    for j in 1..=CONVERSATIONS {
        follow(stored(j << 32, Some(SHARED as u64 - 1), own(j)));
    }
    eprintln!("{} tails held", tails.len());
    let mut blocks = Vec::new();
    block_hashes(&Prompt::Tokens(shared.clone()), BLOCK, &mut blocks);
    let seed = blocks[SHARED / BLOCK - 1];
    let whole = SHARED / BLOCK * BLOCK;
    // A conversation's next turn, and a new one on the system prompt.
    let next = [&shared[whole..], &own(7)[..]].concat();
    let new = [&shared[whole..], &own(1 << 30)[..]].concat();
    assert_eq!(tails.longest(seed, &next), BLOCK - 1);
    assert_eq!(tails.longest(seed, &new), SHARED - whole);
    let mut group = c.benchmark_group("held_tails_2048_branches");
    group.bench_function("longest_continuation", |b| {
        b.iter(|| tails.longest(seed, black_box(&next)))
    });
    group.bench_function("longest_new_conversation", |b| {
        b.iter(|| tails.longest(seed, black_box(&new)))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
