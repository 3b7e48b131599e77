//! The radix cache's KV events ([`RadixCache::with_events`]): each page's chained hash, kept beside the node's
//! label, and the `BlockStored` and `BlockRemoved` events of its inserts and evictions.

use dprouter_core::hashing::token_block_hash;
use dprouter_core::kv_events::KvEvent;

use super::{RadixCache, ROOT};

/// An engine page's hash: its tokens chained after the page before it (seeded apart from the router's hashes).
fn page_hash(parent: Option<u64>, page: &[u32]) -> u64 {
    token_block_hash(parent.unwrap_or(0) ^ 0x9e37_79b9_7f4a_7c15, page)
}

impl RadixCache {
    /// A cache that also keeps its KV events (see the module documentation).
    pub fn with_events(capacity_tokens: usize, page_size: usize) -> Self {
        Self {
            events: Some(Vec::new()),
            ..Self::new(capacity_tokens, page_size)
        }
    }

    /// The events since the last call, oldest first (none without [`Self::with_events`]).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Records `node`'s new pages `rest` (appended to its label) as stored, after the page before them.
    pub(super) fn stored(&mut self, node: usize, rest: &[u32]) {
        if self.events.is_none() || rest.is_empty() {
            return;
        }
        let parent = match self.nodes[node].hashes.last() {
            Some(&h) => Some(h),
            None => self.last_hash(self.nodes[node].parent),
        };
        let mut hashes = Vec::with_capacity(rest.len() / self.page);
        let mut before = parent;
        for page in rest.chunks(self.page) {
            let h = page_hash(before, page);
            hashes.push(h);
            before = Some(h);
        }
        self.nodes[node].hashes.extend_from_slice(&hashes);
        if let Some(events) = self.events.as_mut() {
            events.push(KvEvent::Stored {
                hashes,
                parent,
                tokens: rest.to_vec(),
                block_size: self.page as u32,
                medium: None,
                plain: true,
            });
        }
    }

    /// The hash of the last page of `node` (`None` at the root).
    fn last_hash(&self, node: usize) -> Option<u64> {
        if node == ROOT {
            return None;
        }
        self.nodes[node].hashes.last().copied()
    }

    pub(super) fn removed(&mut self, hashes: Vec<u64>) {
        if let (Some(events), false) = (self.events.as_mut(), hashes.is_empty()) {
            events.push(KvEvent::Removed {
                hashes,
                medium: None,
                plain: true,
            });
        }
    }
}
