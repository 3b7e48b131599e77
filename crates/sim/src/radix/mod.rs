//! A model of one SGLang data-parallel rank's prefix cache (SGLang's `RadixCache`) over token ids.
//!
//! # What is modelled
//! - Matches are page-aligned and the last prompt token is always recomputed, so a match is capped at
//!   `tokens.len() - 1` and rounded down to a multiple of the page size.
//! - Inserts cache whole pages only; every label in the tree is a multiple of the page size long.
//! - Eviction is LRU over unreferenced leaves. Unlike SGLang, which frees whole leaf nodes, this model cuts exactly as
//!   many tokens (rounded up to a page) off the end of the least recently used leaf as are needed, so the capacity is
//!   exact. Locked paths (requests in flight) are never evicted, so locks may keep `size()` above the capacity.
//!
//! # Algorithm
//! A radix tree with compressed edges: each node holds a `Vec<u32>` label. Nodes live in a slab `Vec` with a free
//! list and refer to each other by index; children are found through a `HashMap` keyed on the first page of the
//! child's label. A logical clock advances once per `match_prefix`/`insert`; every node on the touched path gets the
//! new tick (a match that ends inside an edge first splits it, so all tokens of a node share one tick). The
//! unreferenced leaves are kept incrementally in a `BTreeSet<(tick, node)>`, so the LRU leaf is found in O(log n).
//! Splitting keeps the original node id for the lower part, so a [`LockId`], which names the node where its path
//! ends, stays valid.
//!
//! # Events
//! A cache made with [`RadixCache::with_events`] also keeps what an engine publishes as KV events
//! ([`dprouter_core::kv_events`]), for [`RadixCache::take_events`]: each page has a chained hash (of its tokens and
//! the page before it), an insert is one `BlockStored` of its new pages (their parent is the page before them), and
//! every page cut off by eviction or a flush is in a `BlockRemoved`. The hashes are the mock engine's own, opaque
//! to a router, as an engine's are.
//!
//! # Cost per operation
//! With `L` the prompt length, `d` the depth of the path and `n` the number of nodes:
//! - `match_prefix`, `insert`, `lock`: O(L) token comparisons (slice compares) plus O(d) hash look-ups, plus
//!   O(log n) for the one leaf whose position in the LRU set changes; `insert` also copies the new tokens.
//! - eviction: O(log n) per leaf truncated or removed; `unlock`: O(d); the accessors are O(1).
//! - memory: O(cached tokens + n).

use std::collections::{BTreeSet, HashMap};

use dprouter_core::kv_events::KvEvent;

mod events;

const ROOT: usize = 0;

/// Opaque handle of one lock taken with [`RadixCache::lock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LockId(u64);

#[derive(Debug, Default)]
struct Node {
    label: Vec<u32>,
    /// With events: the chained hash of each page of the label.
    hashes: Vec<u64>,
    parent: usize,
    /// Keyed on the first page of the child's label.
    children: HashMap<Box<[u32]>, usize>,
    /// Number of live locks whose path passes through this node.
    lock_ref: u32,
    tick: u64,
}

/// One data-parallel rank's prefix cache; see the module documentation.
#[derive(Debug)]
pub struct RadixCache {
    nodes: Vec<Node>,
    free: Vec<usize>,
    /// Exactly the nodes that are evictable (not the root, no children, lock_ref 0), keyed by (tick, id).
    evictable: BTreeSet<(u64, usize)>,
    /// Live locks and the node where each one's path ends.
    locks: HashMap<u64, usize>,
    next_lock: u64,
    clock: u64,
    page: usize,
    capacity: usize,
    size: usize,
    locked_size: usize,
    live_nodes: usize,
    /// With events: the events not taken yet (`None`: none kept).
    events: Option<Vec<KvEvent>>,
}

/// Length of the common prefix of `a` and `b`.
fn common_len(a: &[u32], b: &[u32]) -> usize {
    const CHUNK: usize = 32;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl RadixCache {
    /// `page_size >= 1` (0 is treated as 1). Capacity in tokens.
    pub fn new(capacity_tokens: usize, page_size: usize) -> Self {
        Self {
            nodes: vec![Node::default()],
            free: Vec::new(),
            evictable: BTreeSet::new(),
            locks: HashMap::new(),
            next_lock: 0,
            clock: 0,
            page: page_size.max(1),
            capacity: capacity_tokens,
            size: 0,
            locked_size: 0,
            live_nodes: 0,
            events: None,
        }
    }

    /// Length of the longest cached prefix of `tokens`, capped at `tokens.len() - 1` (at least the last prompt token
    /// is always recomputed; 0 for an empty prompt) and rounded down to a multiple of the page size. Marks every node
    /// on the matched path as used now (one clock tick per call). A match ending inside an edge splits it there.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> usize {
        self.clock += 1;
        let Some(last) = tokens.len().checked_sub(1) else {
            return 0;
        };
        let (node, len) = self.descend(&tokens[..self.floor(last)]);
        self.touch_path(node, self.clock);
        len
    }

    /// Length of the longest cached prefix of `tokens` in whole pages, without the last-token cap and without
    /// touching anything (a read-only peek, e.g. for a router oracle).
    pub fn cached_prefix_len(&self, tokens: &[u32]) -> usize {
        let (_, pos, partial) = self.walk(tokens);
        pos + partial.map_or(0, |(_, common)| common)
    }

    /// Inserts `tokens[..len - len % page_size]`, marking the whole path used now (one tick), then evicts until
    /// `size() <= capacity()` or nothing unlocked is left. Returns how many of the inserted tokens were already cached.
    pub fn insert(&mut self, tokens: &[u32]) -> usize {
        self.clock += 1;
        let tokens = &tokens[..self.floor(tokens.len())];
        let (mut node, matched) = self.descend(tokens);
        if matched < tokens.len() {
            let rest = &tokens[matched..];
            if node != ROOT && self.nodes[node].children.is_empty() && self.nodes[node].lock_ref == 0 {
                // Grow an unreferenced leaf in place (multi-turn chats stay one node): no lock ends there, and all
                // its tokens get this call's tick below either way.
                self.nodes[node].label.extend_from_slice(rest);
            } else {
                node = self.add_child(node, rest);
            }
            self.stored(node, rest);
            self.size += rest.len();
        }
        self.touch_path(node, self.clock);
        self.evict_to(self.capacity);
        matched
    }

    /// Pins the cached prefix `tokens[..len]` against eviction (`len` is clipped to the cached prefix length and
    /// rounded down to a page multiple; an edge is split if `len` ends inside it). Does not change LRU ticks. Locks
    /// nest (reference counts).
    pub fn lock(&mut self, tokens: &[u32], len: usize) -> LockId {
        let len = self.floor(len.min(tokens.len()));
        let (end, _) = self.descend(&tokens[..len]);
        let mut id = end;
        while id != ROOT {
            self.unlist(id);
            let node = &mut self.nodes[id];
            node.lock_ref += 1;
            if node.lock_ref == 1 {
                self.locked_size += node.label.len();
            }
            id = node.parent;
        }
        self.next_lock += 1;
        self.locks.insert(self.next_lock, end);
        LockId(self.next_lock)
    }

    /// Releases one lock; then evicts if `size() > capacity()` (locked tokens may have kept it above). Releasing an
    /// unknown or already released lock is a no-op (and a debug assertion failure).
    pub fn unlock(&mut self, lock: LockId) {
        let end = self.locks.remove(&lock.0);
        debug_assert!(end.is_some(), "unlock of an unknown or already released {lock:?}");
        let Some(mut id) = end else {
            return;
        };
        while id != ROOT {
            let node = &mut self.nodes[id];
            node.lock_ref -= 1;
            let parent = node.parent;
            if node.lock_ref == 0 {
                self.locked_size -= node.label.len();
                self.relist(id);
            }
            id = parent;
        }
        self.evict_to(self.capacity);
    }

    /// Evicts every unlocked token (SGLang's `flush_cache`).
    pub fn flush(&mut self) {
        self.evict_to(0);
    }

    /// Changes the capacity, evicting down to it at once (as far as locks allow).
    pub fn set_capacity(&mut self, capacity_tokens: usize) {
        self.capacity = capacity_tokens;
        self.evict_to(capacity_tokens);
    }

    /// Cached tokens.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Capacity in tokens.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Page size in tokens (at least 1).
    pub fn page_size(&self) -> usize {
        self.page
    }

    /// Tokens on at least one locked path.
    pub fn locked_size(&self) -> usize {
        self.locked_size
    }

    /// Live nodes excluding the root (for memory reporting).
    pub fn node_count(&self) -> usize {
        self.live_nodes
    }

    fn floor(&self, n: usize) -> usize {
        n - n % self.page
    }

    /// Walks down from the root along `tokens` in whole pages. Returns the deepest node whose label was fully
    /// matched, the matched length up to its end, and, if the match goes on part-way into a child's label, that child
    /// and the (page-aligned, non-zero) number of its tokens matched.
    fn walk(&self, tokens: &[u32]) -> (usize, usize, Option<(usize, usize)>) {
        let (mut node, mut pos) = (ROOT, 0);
        while pos + self.page <= tokens.len() {
            let rest = &tokens[pos..];
            let Some(&child) = self.nodes[node].children.get(&rest[..self.page]) else {
                break;
            };
            let label = &self.nodes[child].label;
            let common = self.floor(common_len(label, rest));
            if common < label.len() {
                return (node, pos, Some((child, common)));
            }
            node = child;
            pos += common;
        }
        (node, pos, None)
    }

    /// Like [`Self::walk`], but splits a part-way matched edge so the returned node ends exactly at the match.
    fn descend(&mut self, tokens: &[u32]) -> (usize, usize) {
        match self.walk(tokens) {
            (_, pos, Some((child, common))) => (self.split(child, common), pos + common),
            (node, pos, None) => (node, pos),
        }
    }

    /// Splits `id`'s label after `at` tokens: a new node takes the upper part and becomes `id`'s parent, copying its
    /// lock count and tick; `id` keeps the lower part. Returns the new node.
    fn split(&mut self, id: usize, at: usize) -> usize {
        let upper = self.alloc();
        let page = self.page;
        let node = &mut self.nodes[id];
        let lower_label = node.label.split_off(at);
        let label = std::mem::replace(&mut node.label, lower_label);
        let upper_hashes = if node.hashes.is_empty() {
            Vec::new()
        } else {
            let lower_hashes = node.hashes.split_off(at / page);
            std::mem::replace(&mut node.hashes, lower_hashes)
        };
        let (parent, lock_ref, tick) = (node.parent, node.lock_ref, node.tick);
        node.parent = upper;
        let lower_key: Box<[u32]> = node.label[..self.page].into();
        if let Some(slot) = self.nodes[parent].children.get_mut(&label[..self.page]) {
            *slot = upper;
        }
        self.nodes[upper] = Node {
            label,
            hashes: upper_hashes,
            parent,
            children: HashMap::from([(lower_key, id)]),
            lock_ref,
            tick,
        };
        upper
    }

    /// Adds a new unlocked leaf holding `label` under `parent`, with the current tick.
    fn add_child(&mut self, parent: usize, label: &[u32]) -> usize {
        let id = self.alloc();
        self.unlist(parent);
        self.nodes[parent].children.insert(label[..self.page].into(), id);
        self.nodes[id] = Node {
            label: label.to_vec(),
            hashes: Vec::new(),
            parent,
            children: HashMap::new(),
            lock_ref: 0,
            tick: self.clock,
        };
        self.relist(id);
        id
    }

    fn alloc(&mut self) -> usize {
        self.live_nodes += 1;
        self.free.pop().unwrap_or_else(|| {
            self.nodes.push(Node::default());
            self.nodes.len() - 1
        })
    }

    fn is_evictable(&self, id: usize) -> bool {
        let node = &self.nodes[id];
        id != ROOT && node.children.is_empty() && node.lock_ref == 0
    }

    /// Takes `id` out of the LRU set before a change to its tick, children or lock count.
    fn unlist(&mut self, id: usize) {
        if self.is_evictable(id) {
            self.evictable.remove(&(self.nodes[id].tick, id));
        }
    }

    /// Puts `id` back into the LRU set after such a change, if it is evictable.
    fn relist(&mut self, id: usize) {
        if self.is_evictable(id) {
            self.evictable.insert((self.nodes[id].tick, id));
        }
    }

    /// Sets the tick of every node from `id` up to the root.
    fn touch_path(&mut self, mut id: usize, tick: u64) {
        while id != ROOT {
            self.unlist(id);
            self.nodes[id].tick = tick;
            self.relist(id);
            id = self.nodes[id].parent;
        }
    }

    /// Cuts tokens off the least recently used unlocked leaves until `size <= target` or nothing unlocked is left.
    fn evict_to(&mut self, target: usize) {
        while self.size > target {
            let Some(&(tick, id)) = self.evictable.first() else {
                break;
            };
            let excess = (self.size - target).div_ceil(self.page) * self.page;
            let len = self.nodes[id].label.len();
            if excess < len {
                let label = &mut self.nodes[id].label;
                label.truncate(len - excess);
                if label.capacity() > 2 * label.len() {
                    label.shrink_to_fit();
                }
                self.size -= excess;
                let hashes = &mut self.nodes[id].hashes;
                let cut = hashes.split_off(((len - excess) / self.page).min(hashes.len()));
                self.removed(cut);
            } else {
                self.evictable.remove(&(tick, id));
                let mut node = std::mem::take(&mut self.nodes[id]);
                self.removed(std::mem::take(&mut node.hashes));
                self.nodes[node.parent].children.remove(&node.label[..self.page]);
                self.size -= len;
                self.live_nodes -= 1;
                self.free.push(id);
                self.relist(node.parent);
            }
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod model_tests;
