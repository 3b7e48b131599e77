//! SMG's approximate radix tree (`sgl-router/src/policies/tree.rs` @ 4d40eec0 in `sgl-project/sglang`), over
//! units (token ids, or a text prompt's bytes) where the source reads characters.
//!
//! Every node carries the tenants (endpoints) whose routed prompts pass through it, each with its last access;
//! a tenant's size is the length of all the nodes it is on. [`Tree::prefix_match`] walks the prompt as far as the
//! tree goes (into a node's label where they part) and names a tenant of the last node reached; the source takes
//! the first in a hash map's order (arbitrary), this port the tenant that has been on the node longest.
//! [`Tree::insert`] records a prompt for a tenant, splitting a node where the prompt leaves it (both halves keep
//! its tenants). [`Tree::evict`] trims every tenant over a size: its least recently used leaf entries first, whole
//! nodes at a time. Cost: O(prompt) per match and insert; eviction O(nodes) per pass.

use std::collections::{BinaryHeap, HashMap};

use crate::endpoint::EndpointId;

struct Node {
    label: Vec<u32>,
    children: HashMap<u32, usize>,
    parent: usize,
    /// Tenants on the node with their last access, oldest arrival first.
    tenants: Vec<(EndpointId, u64)>,
}

impl Node {
    fn touch(&mut self, tenant: EndpointId, now: u64) -> bool {
        match self.tenants.iter_mut().find(|(t, _)| *t == tenant) {
            Some(entry) => {
                entry.1 = now;
                false
            }
            None => {
                self.tenants.push((tenant, now));
                true
            }
        }
    }
}

pub(crate) struct Tree {
    nodes: Vec<Node>,
    free: Vec<usize>,
    sizes: HashMap<EndpointId, usize>,
}

const ROOT: usize = 0;

impl Default for Tree {
    fn default() -> Self {
        Self {
            nodes: vec![Node {
                label: Vec::new(),
                children: HashMap::new(),
                parent: ROOT,
                tenants: Vec::new(),
            }],
            free: Vec::new(),
            sizes: HashMap::new(),
        }
    }
}

impl Tree {
    fn alloc(&mut self, node: Node) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// The tenant's size: the units of every node it is on.
    pub fn size(&self, tenant: EndpointId) -> usize {
        self.sizes.get(&tenant).copied().unwrap_or(0)
    }

    /// How far `text` goes into the tree, and a tenant of the node where it stops (`None` at the root); that
    /// tenant's accesses on the path are refreshed to `now`.
    pub fn prefix_match(&mut self, text: &[u32], now: u64) -> (usize, Option<EndpointId>) {
        let mut node = ROOT;
        let mut matched = 0;
        while matched < text.len() {
            let Some(&child) = self.nodes[node].children.get(&text[matched]) else {
                break;
            };
            let label = &self.nodes[child].label;
            let shared = label.iter().zip(&text[matched..]).take_while(|(a, b)| a == b).count();
            matched += shared;
            node = child;
            if shared < label.len() {
                break;
            }
        }
        let tenant = self.nodes[node].tenants.first().map(|&(t, _)| t);
        if let Some(tenant) = tenant {
            let mut n = node;
            while n != ROOT {
                self.nodes[n].touch(tenant, now);
                n = self.nodes[n].parent;
            }
        }
        (matched, tenant)
    }

    /// Records `text` for `tenant` at `now`.
    pub fn insert(&mut self, text: &[u32], tenant: EndpointId, now: u64) {
        self.sizes.entry(tenant).or_insert(0);
        let mut node = ROOT;
        let mut at = 0;
        while at < text.len() {
            let Some(&child) = self.nodes[node].children.get(&text[at]) else {
                let leaf = self.alloc(Node {
                    label: text[at..].to_vec(),
                    children: HashMap::new(),
                    parent: node,
                    tenants: vec![(tenant, now)],
                });
                self.nodes[node].children.insert(text[at], leaf);
                *self.sizes.entry(tenant).or_insert(0) += text.len() - at;
                return;
            };
            let label = &self.nodes[child].label;
            let shared = label.iter().zip(&text[at..]).take_while(|(a, b)| a == b).count();
            let child = if shared < label.len() {
                self.split(child, shared)
            } else {
                child
            };
            if self.nodes[child].touch(tenant, now) {
                *self.sizes.entry(tenant).or_insert(0) += shared;
            }
            at += shared;
            node = child;
        }
    }

    /// Cuts `node`'s label after `at` units: a new node takes the first part (and the node's tenants) in its
    /// place, with `node` below it. Returns the new node.
    fn split(&mut self, node: usize, at: usize) -> usize {
        let parent = self.nodes[node].parent;
        let rest = self.nodes[node].label.split_off(at);
        let head = std::mem::replace(&mut self.nodes[node].label, rest);
        let first = head[0];
        let tenants = self.nodes[node].tenants.clone();
        let upper = self.alloc(Node {
            label: head,
            children: HashMap::new(),
            parent,
            tenants,
        });
        let lower_key = self.nodes[node].label[0];
        self.nodes[upper].children.insert(lower_key, node);
        self.nodes[node].parent = upper;
        self.nodes[parent].children.insert(first, upper);
        upper
    }

    /// Trims every tenant whose size is over `max`: its least recently used leaf entries (nodes it is on and
    /// none of whose children it is on) go first, whole nodes at a time, until it is at most `max`.
    pub fn evict(&mut self, max: usize) {
        let over: Vec<EndpointId> = self.sizes.iter().filter(|&(_, &s)| s > max).map(|(&t, _)| t).collect();
        for tenant in over {
            let leaf = |tree: &Self, n: usize| {
                n != ROOT
                    && tree.nodes[n].tenants.iter().any(|(t, _)| *t == tenant)
                    && !tree.nodes[n]
                        .children
                        .values()
                        .any(|&c| tree.nodes[c].tenants.iter().any(|(t, _)| *t == tenant))
            };
            let access = |tree: &Self, n: usize| {
                tree.nodes[n]
                    .tenants
                    .iter()
                    .find(|(t, _)| *t == tenant)
                    .map_or(0, |&(_, a)| a)
            };
            // Freed nodes have empty labels (only the root has one otherwise).
            let mut heap: BinaryHeap<std::cmp::Reverse<(u64, usize)>> = (1..self.nodes.len())
                .filter(|&n| !self.nodes[n].label.is_empty() && leaf(self, n))
                .map(|n| std::cmp::Reverse((access(self, n), n)))
                .collect();
            while self.size(tenant) > max {
                let Some(std::cmp::Reverse((_, n))) = heap.pop() else {
                    break;
                };
                self.nodes[n].tenants.retain(|(t, _)| *t != tenant);
                let len = self.nodes[n].label.len();
                if let Some(size) = self.sizes.get_mut(&tenant) {
                    *size = size.saturating_sub(len);
                }
                let parent = self.nodes[n].parent;
                if self.nodes[n].tenants.is_empty() && self.nodes[n].children.is_empty() {
                    let key = self.nodes[n].label[0];
                    self.nodes[parent].children.remove(&key);
                    self.nodes[n].label = Vec::new();
                    self.free.push(n);
                }
                if leaf(self, parent) {
                    heap.push(std::cmp::Reverse((access(self, parent), parent)));
                }
            }
        }
    }
}
