//! The radix cache against a token-level reference model under random operations: the same matches, sizes, locks
//! and evictions, and KV events that, followed into router blocks and tails, say exactly what it holds.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

/// Token-level reference: every cached page-aligned prefix with the tick of its last page.
struct Naive {
    map: BTreeMap<Vec<u32>, u64>,
    locks: Vec<Vec<u32>>,
    page: usize,
    capacity: usize,
    clock: u64,
}

impl Naive {
    fn floor(&self, n: usize) -> usize {
        n - n % self.page
    }

    fn cached_len(&self, tokens: &[u32]) -> usize {
        let mut k = 0;
        while k + self.page <= tokens.len() && self.map.contains_key(&tokens[..k + self.page]) {
            k += self.page;
        }
        k
    }

    fn touch(&mut self, tokens: &[u32]) {
        for k in (self.page..=tokens.len()).step_by(self.page) {
            self.map.insert(tokens[..k].to_vec(), self.clock);
        }
    }

    fn match_prefix(&mut self, tokens: &[u32]) -> usize {
        self.clock += 1;
        let len = self.cached_len(tokens).min(self.floor(tokens.len().saturating_sub(1)));
        self.touch(&tokens[..len]);
        len
    }

    fn insert(&mut self, tokens: &[u32]) -> usize {
        self.clock += 1;
        let matched = self.cached_len(tokens);
        self.touch(&tokens[..self.floor(tokens.len())]);
        self.evict(self.capacity);
        matched
    }

    fn lock(&mut self, tokens: &[u32], len: usize) {
        let len = self.floor(len.min(self.cached_len(tokens)));
        self.locks.push(tokens[..len].to_vec());
    }

    /// Removes, one page at a time, the unlocked page with no extension and the smallest tick.
    fn evict(&mut self, target: usize) {
        while self.map.len() * self.page > target {
            let victim = self
                .map
                .iter()
                .filter(|(k, _)| !self.map.keys().any(|o| o.len() > k.len() && o.starts_with(k)))
                .filter(|(k, _)| !self.locks.iter().any(|l| l.starts_with(k)))
                .min_by_key(|&(k, t)| (*t, k.clone()));
            let Some((key, _)) = victim else { break };
            let key = key.clone();
            self.map.remove(&key);
        }
    }

    fn locked_size(&self) -> usize {
        self.map
            .keys()
            .filter(|k| self.locks.iter().any(|l| l.starts_with(k)))
            .count()
            * self.page
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert(Vec<u32>),
    Match(Vec<u32>),
    Lock(Vec<u32>, usize),
    Unlock(usize),
    Flush,
    SetCapacity(usize),
}

fn ops(alphabet: u32, max_len: usize) -> impl Strategy<Value = Vec<Op>> {
    let seq = move || prop::collection::vec(0..alphabet, 0..max_len);
    let op = prop_oneof![
        4 => seq().prop_map(Op::Insert),
        3 => seq().prop_map(Op::Match),
        2 => (seq(), 0..max_len + 2).prop_map(|(s, l)| Op::Lock(s, l)),
        2 => any::<usize>().prop_map(Op::Unlock),
        1 => Just(Op::Flush),
        1 => (0..max_len * 3).prop_map(Op::SetCapacity),
    ];
    prop::collection::vec(op, 1..60)
}

/// Runs `ops` on the cache and on a naive model and compares them after each; the cache's KV events, followed
/// into router blocks of `router` tokens, must say exactly which router blocks it holds.
fn agrees(page: usize, capacity: usize, ops: Vec<Op>, router: usize) -> Result<(), TestCaseError> {
    use dprouter_core::engine_blocks::{CacheChange, EngineBlocks, HeldTails};
    let mut radix = RadixCache::with_events(capacity, page);
    let mut followed = EngineBlocks::new(router, usize::MAX);
    let mut tails = HeldTails::default();
    let mut held = std::collections::HashSet::new();
    let mut naive = Naive {
        map: BTreeMap::new(),
        locks: Vec::new(),
        page,
        capacity,
        clock: 0,
    };
    let (mut locks, mut probes) = (Vec::new(), Vec::new());
    for op in ops {
        match op {
            Op::Insert(s) => {
                prop_assert_eq!(radix.insert(&s), naive.insert(&s));
                probes.push(s);
            }
            Op::Match(s) => prop_assert_eq!(radix.match_prefix(&s), naive.match_prefix(&s)),
            Op::Lock(s, len) => {
                locks.push(radix.lock(&s, len));
                naive.lock(&s, len);
            }
            Op::Unlock(i) if !locks.is_empty() => {
                let i = i % locks.len();
                radix.unlock(locks.swap_remove(i));
                naive.locks.swap_remove(i);
                naive.evict(naive.capacity);
            }
            Op::Unlock(_) => {}
            Op::Flush => {
                radix.flush();
                naive.evict(0);
            }
            Op::SetCapacity(c) => {
                radix.set_capacity(c);
                naive.capacity = c;
                naive.evict(c);
            }
        }
        radix.check_invariants();
        for event in radix.take_events() {
            let change = followed.apply(&event);
            if let Ok(Some(change)) = &change {
                tails.apply(change);
            }
            match change {
                Ok(Some(CacheChange::Stored { blocks, .. })) => held.extend(blocks),
                Ok(Some(CacheChange::Removed { blocks, .. })) => blocks.iter().for_each(|h| {
                    held.remove(h);
                }),
                Ok(_) => {}
                Err(e) => prop_assert!(false, "{e}: {event:?}"),
            }
        }
        // Every router block within a cached prefix.
        let expected: std::collections::HashSet<u64> = radix
            .snapshot()
            .keys()
            .flat_map(|prefix| {
                let mut out = Vec::new();
                dprouter_core::hashing::block_hashes(&dprouter_core::Prompt::Tokens(prefix.clone()), router, &mut out);
                out
            })
            .collect();
        prop_assert_eq!(&held, &expected);
        prop_assert_eq!(radix.snapshot(), naive.map.clone());
        prop_assert_eq!(radix.size(), naive.map.len() * page);
        prop_assert_eq!(radix.locked_size(), naive.locked_size());
        for p in &probes {
            prop_assert_eq!(radix.cached_prefix_len(p), naive.cached_len(p));
            // The router's blocks and tails say to the token what the cache holds of any prompt (when a page
            // straddles no router boundary: a router block that ends inside a page is held, but not served).
            if !router.is_multiple_of(page) {
                continue;
            }
            let mut hashes = Vec::new();
            dprouter_core::hashing::block_hashes(&dprouter_core::Prompt::Tokens(p.clone()), router, &mut hashes);
            let blocks = hashes.iter().take_while(|h| held.contains(*h)).count();
            let seed = blocks.checked_sub(1).map_or(0, |last| hashes[last]);
            let predicted = blocks * router + tails.longest(seed, &p[blocks * router..]);
            prop_assert_eq!(predicted, radix.cached_prefix_len(p), "{:?}", p);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn agrees_with_naive_model(capacity in 5usize..40, ops in ops(3, 12), router in 1usize..5) {
        agrees(1, capacity, ops, router)?;
    }

    #[test]
    fn agrees_with_naive_model_paged(page in 2usize..4, capacity in 0usize..40, ops in ops(2, 16), router in 1usize..7) {
        agrees(page, capacity, ops, router)?;
    }
}
