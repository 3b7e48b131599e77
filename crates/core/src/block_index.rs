//! The block index behind `cache_aware`: which endpoints recently received which prompt blocks.
//!
//! Keys are chained block hashes ([`crate::hashing::block_hashes`]), so holding block `i` of a prompt means holding
//! the prompt up to the end of block `i`. Each endpoint (a *slot*, numbered by the caller) keeps its blocks in its own
//! LRU list with its own capacity in blocks, and forgets the least recently used block first, as the engine's
//! radix cache does. A prompt's blocks are touched from the last to the first, so within a prompt the deeper blocks
//! are older and go first: a block is never forgotten while a longer prefix through it is kept (unless removed by
//! [`BlockIndex::forget_from`]).
//!
//! Layout: one slab of nodes, one per (block, slot) pair, each on its slot's doubly linked LRU list and on its
//! block's singly linked list of holders; one hash map from block hash to its first holder (the hashes are already
//! uniform, so the map does not rehash them). About 62 bytes per (block, slot) pair, reported by
//! [`BlockIndex::memory_bytes`].
//!
//! Cost: [`BlockIndex::match_lengths`] is one map look-up per matched block plus one step per holder of it, so
//! O(blocks × holders), independent of how many endpoints hold nothing; [`BlockIndex::record`] is O(blocks) plus the
//! holders walked to find the pair, and O(1) per block forgotten.

use crate::hashing::PassThroughBuild;
use std::collections::HashMap;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    slot: u32,
    /// Towards the slot's most recently used end.
    prev: u32,
    /// Towards its least recently used end.
    next: u32,
    /// The next holder of the same block.
    sibling: u32,
    /// The slot's clock when the block was last recorded there.
    stamp: u32,
}

#[derive(Debug, Clone, Copy)]
struct Lru {
    head: u32,
    tail: u32,
    len: usize,
    capacity: usize,
    /// Blocks recorded in the slot so far (wrapping): the clock of [`BlockIndex::age`].
    clock: u32,
}

/// Per-slot LRU sets of chained block hashes; see the module documentation.
#[derive(Debug, Default)]
pub struct BlockIndex {
    map: HashMap<u64, u32, PassThroughBuild>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    slots: Vec<Lru>,
}

impl BlockIndex {
    /// Adds an empty slot holding at most `capacity` blocks; returns its number (slots are numbered from 0).
    pub fn add_slot(&mut self, capacity: usize) -> usize {
        self.slots.push(Lru {
            head: NIL,
            tail: NIL,
            len: 0,
            capacity,
            clock: 0,
        });
        self.slots.len() - 1
    }

    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Changes a slot's capacity, forgetting its least recently used blocks down to it.
    pub fn set_capacity(&mut self, slot: usize, capacity: usize) {
        self.slots[slot].capacity = capacity;
        self.evict(slot);
    }

    pub fn capacity(&self, slot: usize) -> usize {
        self.slots[slot].capacity
    }

    /// Blocks held by one slot.
    pub fn slot_len(&self, slot: usize) -> usize {
        self.slots[slot].len
    }

    /// (block, slot) pairs held in all.
    pub fn len(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Heap bytes allocated by the index (nodes, free list, map, slots).
    pub fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free.capacity() * std::mem::size_of::<u32>()
            + self.map.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
            + self.slots.capacity() * std::mem::size_of::<Lru>()
    }

    /// For every slot, how many leading blocks of `hashes` it holds, written to `lens` (indexed by slot; every entry
    /// must be 0 on entry and `lens.len() >= slot_count()`). Returns the longest. Does not touch the LRU order.
    pub fn match_lengths(&self, hashes: &[u64], lens: &mut [u32]) -> usize {
        let mut best = 0;
        for (i, hash) in hashes.iter().enumerate() {
            let Some(&first) = self.map.get(hash) else { break };
            let mut advanced = false;
            let mut n = first;
            while n != NIL {
                let node = &self.nodes[n as usize];
                let len = &mut lens[node.slot as usize];
                if *len as usize == i {
                    *len += 1;
                    advanced = true;
                }
                n = node.sibling;
            }
            if !advanced {
                break;
            }
            best = i + 1;
        }
        best
    }

    /// How many blocks `slot` has recorded since it last recorded `hash` (`None` if it does not hold it): at least
    /// the number of other blocks used more recently there, more when blocks were recorded again. An engine that
    /// no longer holds the block has stored at least its capacity of other blocks since, so its capacity is at most
    /// this.
    pub fn age(&self, slot: usize, hash: u64) -> Option<u32> {
        let n = self.find(hash, slot)?;
        let lru = &self.slots[slot];
        Some(lru.clock.wrapping_sub(self.nodes[n as usize].stamp).wrapping_sub(1))
    }

    /// Records that `slot` now holds `hashes` (a prompt's blocks, in order): each becomes most recently used, the
    /// first block most recent of all. Then forgets the slot's least recently used blocks beyond its capacity.
    pub fn record(&mut self, slot: usize, hashes: &[u64]) {
        let keep = hashes.len().min(self.slots[slot].capacity);
        for &hash in hashes[..keep].iter().rev() {
            let n = match self.find(hash, slot) {
                Some(n) => {
                    self.unlink(n);
                    n
                }
                None => self.insert(hash, slot),
            };
            self.link_front(n);
        }
        self.evict(slot);
    }

    /// Forgets `slot`'s holding of `hashes[from..]`.
    pub fn forget_from(&mut self, slot: usize, hashes: &[u64], from: usize) {
        for &hash in hashes.iter().skip(from) {
            if let Some(n) = self.find(hash, slot) {
                self.remove(n);
            }
        }
    }

    /// Forgets everything `slot` holds.
    pub fn clear_slot(&mut self, slot: usize) {
        while self.slots[slot].tail != NIL {
            self.remove(self.slots[slot].tail);
        }
    }

    fn find(&self, hash: u64, slot: usize) -> Option<u32> {
        let mut n = *self.map.get(&hash)?;
        while n != NIL {
            let node = &self.nodes[n as usize];
            if node.slot as usize == slot {
                return Some(n);
            }
            n = node.sibling;
        }
        None
    }

    /// A new node for (hash, slot), first on the block's holder list, not yet on the LRU list.
    fn insert(&mut self, hash: u64, slot: usize) -> u32 {
        let node = Node {
            hash,
            slot: slot as u32,
            prev: NIL,
            next: NIL,
            sibling: self.map.get(&hash).copied().unwrap_or(NIL),
            stamp: 0,
        };
        let n = match self.free.pop() {
            Some(n) => {
                self.nodes[n as usize] = node;
                n
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(hash, n);
        self.slots[slot].len += 1;
        n
    }

    fn link_front(&mut self, n: u32) {
        let slot = self.nodes[n as usize].slot as usize;
        let head = self.slots[slot].head;
        self.nodes[n as usize].stamp = self.slots[slot].clock;
        self.slots[slot].clock = self.slots[slot].clock.wrapping_add(1);
        self.nodes[n as usize].prev = NIL;
        self.nodes[n as usize].next = head;
        if head == NIL {
            self.slots[slot].tail = n;
        } else {
            self.nodes[head as usize].prev = n;
        }
        self.slots[slot].head = n;
    }

    fn unlink(&mut self, n: u32) {
        let Node { slot, prev, next, .. } = self.nodes[n as usize];
        let lru = &mut self.slots[slot as usize];
        if prev == NIL {
            lru.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            lru.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    /// Takes a node off its LRU list and its holder list and frees it.
    fn remove(&mut self, n: u32) {
        self.unlink(n);
        let Node {
            hash, slot, sibling, ..
        } = self.nodes[n as usize];
        let head = self.map.get(&hash).copied().unwrap_or(NIL);
        if head == n {
            if sibling == NIL {
                self.map.remove(&hash);
            } else {
                self.map.insert(hash, sibling);
            }
        } else {
            let mut p = head;
            while p != NIL && self.nodes[p as usize].sibling != n {
                p = self.nodes[p as usize].sibling;
            }
            if p != NIL {
                self.nodes[p as usize].sibling = sibling;
            }
        }
        self.slots[slot as usize].len -= 1;
        self.free.push(n);
    }

    fn evict(&mut self, slot: usize) {
        while self.slots[slot].len > self.slots[slot].capacity {
            self.remove(self.slots[slot].tail);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    impl BlockIndex {
        /// A slot's blocks, most recently used first.
        fn order(&self, slot: usize) -> Vec<u64> {
            let mut out = Vec::new();
            let mut n = self.slots[slot].head;
            while n != NIL {
                out.push(self.nodes[n as usize].hash);
                n = self.nodes[n as usize].next;
            }
            out
        }
    }

    /// Reference model: per slot, its blocks most recently used first.
    struct Naive {
        lists: Vec<Vec<u64>>,
        capacity: Vec<usize>,
    }

    impl Naive {
        fn record(&mut self, slot: usize, hashes: &[u64]) {
            let keep = hashes.len().min(self.capacity[slot]);
            for &h in hashes[..keep].iter().rev() {
                self.lists[slot].retain(|&x| x != h);
                self.lists[slot].insert(0, h);
            }
            self.lists[slot].truncate(self.capacity[slot]);
        }

        fn matched(&self, slot: usize, hashes: &[u64]) -> usize {
            hashes.iter().take_while(|h| self.lists[slot].contains(h)).count()
        }
    }

    /// Chained hashes of a short path over a tiny alphabet, so paths share prefixes.
    fn chain(path: &[u8]) -> Vec<u64> {
        let mut h = 0u64;
        path.iter()
            .map(|&b| {
                h = crate::hashing::mix64(h ^ u64::from(b) ^ 0x5555);
                h
            })
            .collect()
    }

    #[derive(Debug, Clone)]
    enum Op {
        Record(usize, Vec<u8>),
        Forget(usize, Vec<u8>, usize),
        Capacity(usize, usize),
        Clear(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let path = || proptest::collection::vec(0u8..3, 0..8);
        prop_oneof![
            6 => (0usize..3, path()).prop_map(|(s, p)| Op::Record(s, p)),
            2 => (0usize..3, path(), 0usize..8).prop_map(|(s, p, f)| Op::Forget(s, p, f)),
            1 => (0usize..3, 0usize..12).prop_map(|(s, c)| Op::Capacity(s, c)),
            1 => (0usize..3).prop_map(Op::Clear),
        ]
    }

    #[test]
    fn age_counts_the_blocks_recorded_since() {
        let mut index = BlockIndex::default();
        let slot = index.add_slot(100);
        let (p, q) = (chain(&[1, 2, 3]), chain(&[7, 8]));
        index.record(slot, &p);
        // Recorded last to first: the deepest block is the oldest.
        assert_eq!((index.age(slot, p[0]), index.age(slot, p[2])), (Some(0), Some(2)));
        index.record(slot, &q);
        assert_eq!((index.age(slot, p[0]), index.age(slot, p[2])), (Some(2), Some(4)));
        // Recorded again: it counts again (an upper bound of the blocks ahead, which are 2 here).
        index.record(slot, &q);
        assert_eq!(index.age(slot, p[0]), Some(4));
        assert_eq!(index.age(slot, 12345), None);
    }

    #[test]
    fn longest_prefix_per_slot_and_deep_blocks_forgotten_first() {
        let mut index = BlockIndex::default();
        let (a, b) = (index.add_slot(4), index.add_slot(10));
        let p = chain(&[1, 2, 3]);
        let q = chain(&[1, 2, 4, 5]);
        index.record(a, &p);
        index.record(b, &q);
        let mut lens = vec![0; 2];
        assert_eq!(index.match_lengths(&chain(&[1, 2, 3, 9]), &mut lens), 3);
        assert_eq!(lens, vec![3, 2]);
        // Slot a holds 4 blocks: recording q (4 blocks) forgets p's tail block 3 but keeps the shared 1, 2.
        index.record(a, &q);
        let mut lens = vec![0; 2];
        index.match_lengths(&p, &mut lens);
        assert_eq!(lens, vec![2, 2]);
        assert_eq!((index.slot_len(a), index.len()), (4, 8));
        index.forget_from(b, &q, 1);
        let mut lens = vec![0; 2];
        assert_eq!(index.match_lengths(&q, &mut lens), 4);
        assert_eq!(lens, vec![4, 1]);
        index.clear_slot(a);
        assert_eq!((index.slot_len(a), index.len()), (0, 1));
        assert!(index.memory_bytes() > 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn agrees_with_the_naive_model_and_never_exceeds_capacity(
            capacity in proptest::collection::vec(0usize..12, 3),
            ops in proptest::collection::vec(op(), 1..60),
            probes in proptest::collection::vec(proptest::collection::vec(0u8..3, 0..8), 4),
        ) {
            let mut index = BlockIndex::default();
            for &c in &capacity {
                index.add_slot(c);
            }
            let mut naive = Naive { lists: vec![Vec::new(); 3], capacity: capacity.clone() };
            for op in ops {
                match op {
                    Op::Record(s, p) => {
                        index.record(s, &chain(&p));
                        naive.record(s, &chain(&p));
                    }
                    Op::Forget(s, p, from) => {
                        index.forget_from(s, &chain(&p), from);
                        let gone: Vec<u64> = chain(&p).into_iter().skip(from).collect();
                        naive.lists[s].retain(|h| !gone.contains(h));
                    }
                    Op::Capacity(s, c) => {
                        index.set_capacity(s, c);
                        naive.capacity[s] = c;
                        naive.lists[s].truncate(c);
                    }
                    Op::Clear(s) => {
                        index.clear_slot(s);
                        naive.lists[s].clear();
                    }
                }
                for s in 0..3 {
                    prop_assert!(index.slot_len(s) <= index.capacity(s));
                    prop_assert_eq!(index.order(s), naive.lists[s].clone());
                    // A block's age is at least the number of blocks used more recently in its slot.
                    for (ahead, &h) in naive.lists[s].iter().enumerate() {
                        prop_assert!(index.age(s, h).is_some_and(|age| age as usize >= ahead));
                    }
                }
                prop_assert_eq!(index.len(), naive.lists.iter().map(Vec::len).sum::<usize>());
                for p in &probes {
                    let hashes = chain(p);
                    let mut lens = vec![0u32; 3];
                    let best = index.match_lengths(&hashes, &mut lens);
                    let expected: Vec<u32> = (0..3).map(|s| naive.matched(s, &hashes) as u32).collect();
                    prop_assert_eq!(&lens, &expected);
                    prop_assert_eq!(best, *expected.iter().max().unwrap_or(&0) as usize);
                }
            }
        }
    }
}
