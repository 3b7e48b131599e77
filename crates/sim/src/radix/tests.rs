use super::*;
use std::collections::BTreeMap;

impl RadixCache {
    /// Every cached page-aligned prefix, mapped to the tick of the node holding its last page.
    pub(super) fn snapshot(&self) -> BTreeMap<Vec<u32>, u64> {
        let mut out = BTreeMap::new();
        let mut stack = vec![(ROOT, Vec::new())];
        while let Some((id, prefix)) = stack.pop() {
            for &child in self.nodes[id].children.values() {
                let mut path = prefix.clone();
                for page in self.nodes[child].label.chunks(self.page) {
                    path.extend_from_slice(page);
                    out.insert(path.clone(), self.nodes[child].tick);
                }
                stack.push((child, path));
            }
        }
        out
    }

    /// Recomputes all incrementally kept state from scratch and compares.
    pub(super) fn check_invariants(&self) {
        let mut lock_refs = vec![0u32; self.nodes.len()];
        for &end in self.locks.values() {
            let mut id = end;
            while id != ROOT {
                lock_refs[id] += 1;
                id = self.nodes[id].parent;
            }
        }
        let (mut size, mut locked, mut live, mut evictable) = (0, 0, 0, BTreeSet::new());
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            let node = &self.nodes[id];
            if id != ROOT {
                live += 1;
                size += node.label.len();
                assert!(
                    !node.label.is_empty() && node.label.len().is_multiple_of(self.page),
                    "label {:?}",
                    node.label
                );
                assert_eq!(node.lock_ref, lock_refs[id], "lock ref of {id}");
                if node.lock_ref > 0 {
                    locked += node.label.len();
                }
            }
            if self.is_evictable(id) {
                evictable.insert((node.tick, id));
            }
            for (key, &child) in &node.children {
                assert_eq!(self.nodes[child].parent, id);
                assert_eq!(**key, self.nodes[child].label[..self.page]);
                assert!(
                    id == ROOT || node.tick >= self.nodes[child].tick,
                    "parent older than child"
                );
                stack.push(child);
            }
        }
        assert_eq!((size, locked, live), (self.size, self.locked_size, self.live_nodes));
        assert_eq!(evictable, self.evictable);
        assert_eq!(live + 1 + self.free.len(), self.nodes.len());
    }
}

#[test]
fn match_after_insert() {
    let mut c = RadixCache::new(100, 1);
    assert_eq!(c.match_prefix(&[1, 2, 3, 4]), 0);
    assert_eq!(c.insert(&[1, 2, 3, 4]), 0);
    assert_eq!(c.match_prefix(&[1, 2, 3, 4, 5, 6]), 4);
    assert_eq!(c.match_prefix(&[1, 2, 9]), 2);
    assert_eq!(c.match_prefix(&[9, 1, 2]), 0);
    assert_eq!(c.match_prefix(&[]), 0);
    assert_eq!(c.insert(&[1, 2, 3, 4]), 4);
    assert_eq!(c.size(), 4);
    c.check_invariants();
}

#[test]
fn last_token_is_always_recomputed() {
    let mut c = RadixCache::new(100, 1);
    c.insert(&[1, 2, 3]);
    assert_eq!(c.match_prefix(&[1, 2, 3]), 2);
    assert_eq!(c.match_prefix(&[1, 2, 3, 4]), 3);
    assert_eq!(c.match_prefix(&[1]), 0);
    assert_eq!(c.cached_prefix_len(&[1, 2, 3]), 3);
    c.check_invariants();
}

#[test]
fn page_alignment() {
    let mut c = RadixCache::new(100, 4);
    let a: Vec<u32> = (0..10).collect();
    assert_eq!(c.insert(&a), 0);
    assert_eq!(c.size(), 8);
    assert_eq!(c.match_prefix(&a), 8);
    assert_eq!(c.match_prefix(&a[..8]), 4); // capped at 7, rounded down
    assert_eq!(c.match_prefix(&[0, 1, 2, 3, 4, 5, 99, 99, 99]), 4);
    assert_eq!(c.insert(&[0, 1, 2, 3, 4, 5, 9, 9]), 4);
    assert_eq!(c.size(), 12);
    let id = c.lock(&a, 7);
    assert_eq!(c.locked_size(), 4);
    c.unlock(id);
    c.check_invariants();

    let mut small = RadixCache::new(6, 4);
    small.insert(&(0..12).collect::<Vec<_>>()); // 12 > 6: cut 6 tokens, rounded up to 8
    assert_eq!(small.size(), 4);
    assert_eq!(RadixCache::new(1, 0).page_size(), 1);
}

#[test]
fn shared_prefix_counted_once() {
    let mut c = RadixCache::new(100, 1);
    assert_eq!(c.insert(&[1, 2, 3, 4]), 0);
    assert_eq!(c.insert(&[1, 2, 5, 6]), 2);
    assert_eq!(c.size(), 6);
    assert_eq!(c.node_count(), 3);
    assert_eq!(c.match_prefix(&[1, 2, 5, 6, 7]), 4);
    assert_eq!(c.match_prefix(&[1, 2, 3, 4, 7]), 4);
    c.check_invariants();
}

#[test]
fn lru_leaf_tail_is_evicted_first() {
    let (a, b, cc) = ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10]);
    let mut c = RadixCache::new(8, 1);
    c.insert(&a);
    c.insert(&b);
    assert_eq!(c.match_prefix(&[1, 2, 3, 4, 99]), 4); // touches all of A (a bare A would touch only 3 tokens)
    c.insert(&cc);
    assert_eq!(c.size(), 8);
    assert_eq!(c.cached_prefix_len(&b), 2);
    assert_eq!(c.cached_prefix_len(&a), 4);
    assert_eq!(c.cached_prefix_len(&cc), 2);
    c.insert(&[11, 12, 13]); // B's rest (2), then 1 token off A, the next LRU leaf
    assert_eq!((c.cached_prefix_len(&b), c.cached_prefix_len(&a), c.size()), (0, 3, 8));
    c.check_invariants();
}

#[test]
fn locked_paths_survive_eviction() {
    let a = [1, 2, 3, 4];
    let mut c = RadixCache::new(8, 1);
    c.insert(&a);
    let id = c.lock(&a, 10);
    assert_eq!(c.locked_size(), 4);
    c.insert(&[5, 6, 7, 8]);
    c.insert(&[9, 10, 11, 12]); // A is the LRU leaf but locked: B goes instead
    assert_eq!(
        (c.cached_prefix_len(&a), c.cached_prefix_len(&[5, 6, 7, 8]), c.size()),
        (4, 0, 8)
    );
    c.set_capacity(2);
    assert_eq!(c.size(), 4); // above capacity while locked
    assert_eq!(c.cached_prefix_len(&a), 4);
    c.check_invariants();
    c.unlock(id);
    assert_eq!((c.size(), c.locked_size(), c.cached_prefix_len(&a)), (2, 0, 2));
    c.check_invariants();
}

#[test]
fn lock_ids_survive_splits_and_nest() {
    let a = [1, 2, 3, 4, 5, 6];
    let mut c = RadixCache::new(100, 1);
    c.insert(&a);
    let whole = c.lock(&a, 6);
    let half = c.lock(&[1, 2, 3, 9, 9], 5); // clipped to the cached 3 tokens; splits A's node
    assert_eq!(c.match_prefix(&[1, 2, 7]), 2); // splits again
    c.insert(&[1, 2, 3, 4, 5, 6, 7, 8]); // A's end is locked: a new child instead of growing it
    assert_eq!((c.locked_size(), c.node_count(), c.size()), (6, 4, 8));
    c.check_invariants();
    c.unlock(whole);
    assert_eq!(c.locked_size(), 3);
    c.unlock(half);
    assert_eq!(c.locked_size(), 0);
    c.flush();
    assert_eq!((c.size(), c.node_count()), (0, 0));
    c.check_invariants();
}

#[test]
fn flush_keeps_locked_paths() {
    let mut c = RadixCache::new(100, 1);
    c.insert(&[1, 2, 3, 4]);
    c.insert(&[5, 6, 7]);
    let id = c.lock(&[1, 2, 3, 4], 2);
    c.flush();
    assert_eq!((c.size(), c.locked_size()), (2, 2));
    assert_eq!(
        (c.cached_prefix_len(&[1, 2, 3, 4]), c.cached_prefix_len(&[5, 6, 7])),
        (2, 0)
    );
    c.check_invariants();
    c.unlock(id);
    assert_eq!(c.size(), 2);
    c.flush();
    assert_eq!((c.size(), c.node_count()), (0, 0));
    c.check_invariants();
}

#[test]
fn long_prompt() {
    let a: Vec<u32> = (0..200_000).collect();
    let mut c = RadixCache::new(1_000_000, 1);
    assert_eq!(c.insert(&a), 0);
    assert_eq!(c.match_prefix(&a), 199_999);
    assert_eq!(c.cached_prefix_len(&a), 200_000);
    let mut b = a[..150_000].to_vec();
    b.extend(1_000_000..1_050_000);
    assert_eq!(c.match_prefix(&b), 150_000);
    assert_eq!(c.insert(&b), 150_000);
    // Nodes: a[..150k], a[150k..199_999], a[199_999] (the capped match of `a` split there), b's tail.
    assert_eq!((c.size(), c.node_count()), (250_000, 4));
    assert_eq!(c.match_prefix(&b), 199_999);
    c.set_capacity(200_000); // the LRU leaf is A's tail (50k tokens)
    assert_eq!((c.cached_prefix_len(&a), c.cached_prefix_len(&b)), (150_000, 200_000));
    c.check_invariants();
}
