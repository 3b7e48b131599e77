//! The hit-rate ladder's references: one infinite prefix cache ([`Oracle`], what any routing over any number of
//! ranks could at best reuse) and one pooled LRU cache of all the ranks' capacity ([`PooledCache`]).
//!
//! Fed every request in arrival order: first its prompt is matched (the longest prefix seen before, at most the
//! prompt length − 1, as the ranks' radix caches count), then its prompt and prompt + answer are remembered. The
//! trace README's bound (0.374 for the Mooncake conversation trace) is this.
//!
//! Instead of an unbounded radix tree (hundreds of MB of token ids on the Mooncake trace), it keeps a set of 64-bit
//! chained hashes: one per whole block of [`BLOCK`] tokens of every remembered sequence, plus one per token of each
//! sequence's last partial block. A match walks whole blocks, then single tokens of the tail. It equals an infinite
//! radix cache's match except where a new prompt leaves a remembered sequence in the middle of one of its whole
//! blocks: then it stops at that block's start, so it reports at most `BLOCK − 1` tokens fewer (never more, up to
//! 64-bit hash collisions). Cost: O(prompt + answer) per request; memory: ~16 bytes per `BLOCK` unique tokens.

use dprouter_core::hashing::PassThroughBuild;
use std::collections::HashSet;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::radix::RadixCache;
use crate::tokens::mix;

/// Tokens per hashed block.
pub const BLOCK: usize = 16;

/// XXH3 of the block's little-endian bytes, seeded with the previous block's hash.
fn block_hash(prev: u64, block: &[u32]) -> u64 {
    let mut bytes = [0u8; BLOCK * 4];
    for (dst, t) in bytes.chunks_exact_mut(4).zip(block) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes[..block.len() * 4], prev ^ 0xB10C)
}

fn token_hash(prev: u64, token: u32) -> u64 {
    mix(prev ^ 0x70C3_0000_0000 ^ u64::from(token))
}

/// One infinite prefix cache's hit count; see the module documentation.
#[derive(Default)]
pub struct Oracle {
    seen: HashSet<u64, PassThroughBuild>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

impl Oracle {
    /// Matches `prompt` against everything remembered, counts it, then remembers `prompt` and `full` (the prompt
    /// followed by its answer; `full` must start with `prompt`). Returns the matched length. Each token is hashed
    /// once, and only blocks not yet remembered are inserted.
    pub fn request(&mut self, prompt: &[u32], full: &[u32]) -> usize {
        debug_assert!(full.starts_with(prompt));
        let whole = prompt.len() - prompt.len() % BLOCK;
        let mut blocks = Vec::with_capacity(whole / BLOCK);
        let mut h = 0;
        for block in prompt[..whole].chunks_exact(BLOCK) {
            h = block_hash(h, block);
            blocks.push(h);
        }
        let known = blocks.iter().take_while(|b| self.seen.contains(b)).count();
        let mut matched = known * BLOCK;
        let mut t = if known == 0 { 0 } else { blocks[known - 1] };
        for &token in &prompt[matched..(matched + BLOCK - 1).min(prompt.len())] {
            t = token_hash(t, token);
            if !self.seen.contains(&t) {
                break;
            }
            matched += 1;
        }
        let matched = matched.min(prompt.len().saturating_sub(1));
        self.prompt_tokens += prompt.len() as u64;
        self.cached_tokens += matched as u64;
        // Remember the prompt: its new whole blocks, then its tail token by token.
        self.seen.extend(blocks[known..].iter().copied());
        self.remember_tail(h, &prompt[whole..]);
        // And the prompt with its answer, continuing the prompt's chain of whole blocks.
        let rest = &full[whole..];
        let rest_whole = rest.len() - rest.len() % BLOCK;
        for block in rest[..rest_whole].chunks_exact(BLOCK) {
            h = block_hash(h, block);
            self.seen.insert(h);
        }
        self.remember_tail(h, &rest[rest_whole..]);
        matched
    }

    fn remember_tail(&mut self, mut h: u64, tail: &[u32]) {
        for &token in tail {
            h = token_hash(h, token);
            self.seen.insert(h);
        }
    }

    /// Cached over prompt tokens so far.
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }

    /// Hashes remembered (for memory reporting).
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// One LRU prefix cache as large as all the ranks together (`dp` × a rank's capacity), fed every request in
/// arrival order: its prompt is matched as a rank matches it (page-aligned, at most the prompt length − 1), then
/// the prompt and its answer are cached at once, as if there were one rank with every rank's memory and no
/// queueing. A fair reference for what capacity allows, not a bound: it keeps one copy of a prefix that `dp`
/// ranks would each need (so it beats any routing there), but LRU is not the best replacement, and a router
/// could, in principle, keep a prefix longer by placing around it. Cost: a radix cache's match and insert per
/// request; memory: up to `dp` × capacity tokens.
pub struct PooledCache {
    cache: RadixCache,
    prompt_tokens: u64,
    cached_tokens: u64,
}

impl PooledCache {
    pub fn new(ranks: usize, capacity_tokens: usize, page_size: usize) -> Self {
        Self {
            cache: RadixCache::new(capacity_tokens.saturating_mul(ranks), page_size),
            prompt_tokens: 0,
            cached_tokens: 0,
        }
    }

    /// Matches `prompt`, counts it, then caches `cached` (the prompt with its answer, or the prompt alone where
    /// the ranks never cache answers). Returns the matched length.
    pub fn request(&mut self, prompt: &[u32], cached: &[u32]) -> usize {
        let matched = self.cache.match_prefix(prompt);
        self.prompt_tokens += prompt.len() as u64;
        self.cached_tokens += matched as u64;
        self.cache.insert(cached);
        matched
    }

    /// Cached over prompt tokens so far.
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn counts_the_longest_prefix_seen_before() {
        let mut o = Oracle::default();
        let a: Vec<u32> = (0..100).collect();
        assert_eq!(o.request(&a, &a), 0);
        assert_eq!(o.request(&a, &a), 99);
        // Leaving `a` inside its third whole block: the match stops at that block's start (32, not 39).
        assert_eq!(o.request(&a[..40], &a[..40]), 32);
        let mut b = a[..70].to_vec();
        b.push(1000);
        // Likewise inside the fifth: 64 of the 70 shared tokens.
        assert_eq!(o.request(&b, &b), 64);
        assert!((o.hit_rate() - 195.0 / 311.0).abs() < 1e-12);
        // `a[..40]`'s own tail was remembered token by token: now it matches exactly.
        assert_eq!(o.request(&a[..41], &a[..41]), 40);
    }

    #[test]
    fn the_pooled_cache_holds_all_ranks_capacity_and_evicts_the_least_recent() {
        // Two ranks of 100 tokens: 200 in the pool. `a` and `b` fit together; `c` cuts the least recent one down to
        // what still fits (eviction takes exactly the tokens needed off a leaf's end).
        let mut pool = PooledCache::new(2, 100, 1);
        let (a, b, c): (Vec<u32>, Vec<u32>, Vec<u32>) = ((0..90).collect(), (100..190).collect(), (200..290).collect());
        assert_eq!(pool.request(&a, &a), 0);
        assert_eq!(pool.request(&b, &b), 0);
        assert_eq!(pool.request(&a, &a), 89, "both fit in 2 × 100");
        assert_eq!(pool.request(&c, &c), 0);
        assert_eq!(
            pool.request(&b, &b),
            20,
            "b was the least recent: 70 of it evicted for c"
        );
        assert_eq!(pool.request(&a, &a), 20, "then a, for b");
        assert!((pool.hit_rate() - 129.0 / 540.0).abs() < 1e-12);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn within_a_block_of_an_infinite_radix_cache(
            seqs in proptest::collection::vec((proptest::collection::vec(0u32..3, 0..80), 0usize..20), 1..30),
        ) {
            let mut oracle = Oracle::default();
            let mut radix = RadixCache::new(usize::MAX, 1);
            for (prompt, answer) in seqs {
                let full: Vec<u32> = prompt.iter().copied().chain((0..answer as u32).map(|i| 7 + i % 2)).collect();
                let exact = radix.match_prefix(&prompt);
                let got = oracle.request(&prompt, &full);
                prop_assert!(got <= exact && exact - got < BLOCK, "oracle {} radix {}", got, exact);
                radix.insert(&prompt);
                radix.insert(&full);
            }
        }
    }
}
