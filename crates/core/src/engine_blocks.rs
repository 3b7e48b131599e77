//! One engine endpoint's cache as its KV events tell it, turned into the router's own block hashes.
//!
//! Engines name their blocks with hashes of their own (vLLM's depend on its hash algorithm and seed; SGLang hashes
//! pages of one token), which a router cannot compute from a prompt. But a `BlockStored` event carries its blocks'
//! token ids and the block before them, so the router can follow each stored sequence and compute the chained
//! hashes it uses itself: [`crate::hashing::block_hashes`] of the same tokens, in blocks of the router's size,
//! whatever the engine's block size (SGLang's single-token pages are gathered into router blocks). For every
//! engine block it keeps where that sequence stands at the block's end: the router hash of the last whole router
//! block, and the tokens after it (a window into the event's tokens, shared by the blocks stored together), so a
//! later event that continues from this block picks the chain up there. A router block belongs to the engine
//! block its last token is in, and the endpoint holds it while at least one such engine block is held: when engine
//! blocks do not end on router boundaries, sibling engine blocks (one prefix, then different tokens) can both
//! complete the same router block, so each router block counts its engine blocks.
//!
//! A sequence rarely ends on a router boundary (a prompt and its answer are any length), so the endpoint also holds
//! tokens past its last whole router block: each engine block that ends inside a router block reports them as a
//! [`Tail`] (the router block before them, and the tokens), and [`HeldTails`] answers how many tokens past its
//! matched router blocks a prompt finds there, so precise mode predicts cached tokens to the engine's page rather
//! than to the router's block.
//!
//! What is not followed: events of other media than the GPU (`"CPU"`, disk: each medium removes its own copies
//! with the same hashes), and blocks of LoRA adapters or of a hybrid model's other cache groups (the router's keys
//! do not describe them). A `BlockStored` whose parent was never seen (the subscriber started late, or missed
//! events) cannot be followed: it is an [`Orphan`] error, which the caller answers by replaying or starting over.
//!
//! Cost: O(tokens) hashing per stored event, O(1) per removed block. Memory, counted by the allocator
//! (`tests/follow_memory.rs`, router blocks of 64 tokens): 240 bytes per engine block for vLLM's 16-token blocks
//! stored a prompt at a time (64 of them its tokens), 340 stored one block at a time as a sequence decodes (each
//! event's tokens are their own allocation), 170 per page for SGLang's one-token pages; bounded by `max_blocks`.
//! A policy's index of the router blocks and [`HeldTails`] they feed add 90 to 290 bytes per engine block (the
//! most for one-token pages, where almost every page is a tail; tails share the events' tokens).

use std::collections::HashMap;
use std::sync::Arc;

use crate::hashing::{token_block_hash, PassThroughBuild};
use crate::kv_events::{EngineHash, KvEvent};

/// What the router's index must do for an endpoint after an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheChange {
    /// The endpoint now holds these router blocks (one sequence's, in order) and these tails, in engine blocks
    /// of `page` tokens (an engine reuses whole pages only).
    Stored {
        blocks: Vec<u64>,
        tails: Vec<Tail>,
        page: u32,
    },
    /// It no longer holds these.
    Removed { blocks: Vec<u64>, tails: Vec<Tail> },
    /// It holds nothing.
    Cleared,
    /// Its events stopped or cannot be followed: what the index holds for it is the router's guess again.
    Untracked,
}

/// Why an event could not be followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FollowError {
    #[error("a stored block's parent was never seen")]
    Orphan,
    #[error("more than {0} engine blocks are followed")]
    TooMany(usize),
}

/// Tokens an endpoint holds past a whole router block: the first tokens of a stored sequence after the router
/// block whose hash is `seed` (0: from the sequence's start), fewer than a router block. Its tokens are a window into
/// the event's, shared by the engine blocks stored together.
#[derive(Debug, Clone)]
pub struct Tail {
    pub seed: u64,
    run: Arc<[u32]>,
    from: u32,
    len: u32,
}

impl Tail {
    pub fn tokens(&self) -> &[u32] {
        &self.run[self.from as usize..(self.from + self.len) as usize]
    }
}

impl PartialEq for Tail {
    fn eq(&self, other: &Self) -> bool {
        let same_window = Arc::ptr_eq(&self.run, &other.run) && self.from == other.from && self.len == other.len;
        self.seed == other.seed && (same_window || self.tokens() == other.tokens())
    }
}

impl Eq for Tail {}

/// The tails an endpoint holds (see the module documentation), found by the router block before them and their
/// tokens: a look-up probes each prefix of what follows the block, so its cost does not grow with the number of
/// sequences that branch there.
#[derive(Debug, Default)]
pub struct HeldTails {
    /// By [`tail_key`]: each distinct tail with how many engine blocks report it.
    tails: HashMap<u64, (Tail, u32), PassThroughBuild>,
    /// Tails whose key another tail holds (a collision of 64-bit keys: practically never).
    collided: Vec<(u64, Tail, u32)>,
    /// Per seed: the tails held there and the longest length seen while any is (it bounds a look-up's probes).
    seeds: HashMap<u64, (usize, usize), PassThroughBuild>,
    count: usize,
}

/// The key of a tail, one token at a time from its seed's.
fn tail_key(key: u64, token: u32) -> u64 {
    (key ^ u64::from(token))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(29)
}

/// The keys of `tails`, in order. An event's tails after one block are prefixes of one window of its tokens (one
/// per page, stored in order, removed in any), so the keys of a window's prefixes are computed once:
/// O(tokens of the window), not O(tokens of every tail).
fn keys_of(tails: &[Tail]) -> impl Iterator<Item = u64> + '_ {
    let mut window: Option<&Tail> = None;
    let mut keys: Vec<u64> = Vec::new();
    tails.iter().map(move |tail| {
        let same = window.is_some_and(|w| w.seed == tail.seed && Arc::ptr_eq(&w.run, &tail.run) && w.from == tail.from);
        if !same {
            window = Some(tail);
            keys.clear();
        }
        let run = &tail.run[tail.from as usize..];
        while keys.len() < tail.len as usize {
            let key = keys.last().copied().unwrap_or(tail.seed);
            keys.push(tail_key(key, run[keys.len()]));
        }
        // A tail holds at least one token.
        keys[tail.len.max(1) as usize - 1]
    })
}

impl HeldTails {
    /// Follows `change` (blocks are the index's business; a clear or an untracked endpoint empties this).
    pub fn apply(&mut self, change: &CacheChange) {
        match change {
            CacheChange::Stored { tails, .. } => {
                for (tail, key) in tails.iter().zip(keys_of(tails)) {
                    if self.add(key, tail) {
                        self.count += 1;
                        let seed = self.seeds.entry(tail.seed).or_insert((0, 0));
                        seed.0 += 1;
                        seed.1 = seed.1.max(tail.len as usize);
                    }
                }
            }
            CacheChange::Removed { tails, .. } => {
                for (tail, key) in tails.iter().zip(keys_of(tails)) {
                    if !self.drop(key, tail) {
                        continue;
                    }
                    self.count -= 1;
                    if let Some(seed) = self.seeds.get_mut(&tail.seed) {
                        seed.0 -= 1;
                        if seed.0 == 0 {
                            self.seeds.remove(&tail.seed);
                        }
                    }
                }
            }
            CacheChange::Cleared | CacheChange::Untracked => {
                self.tails.clear();
                self.collided.clear();
                self.seeds.clear();
                self.count = 0;
            }
        }
    }

    /// Counts one more engine block reporting `tail`; true if it is new.
    fn add(&mut self, key: u64, tail: &Tail) -> bool {
        match self.tails.entry(key) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert((tail.clone(), 1));
                true
            }
            std::collections::hash_map::Entry::Occupied(mut o) if o.get().0 == *tail => {
                o.get_mut().1 += 1;
                false
            }
            std::collections::hash_map::Entry::Occupied(_) => {
                match self.collided.iter_mut().find(|(k, t, _)| *k == key && t == tail) {
                    Some((_, _, n)) => {
                        *n += 1;
                        false
                    }
                    None => {
                        self.collided.push((key, tail.clone(), 1));
                        true
                    }
                }
            }
        }
    }

    /// Counts one engine block fewer reporting `tail`; true if none does any more.
    fn drop(&mut self, key: u64, tail: &Tail) -> bool {
        if let Some((_, n)) = self.tails.get_mut(&key).filter(|(held, _)| held == tail) {
            *n -= 1;
            let gone = *n == 0;
            if gone {
                self.tails.remove(&key);
            }
            return gone;
        }
        let Some(i) = self.collided.iter().position(|(k, t, _)| *k == key && t == tail) else {
            return false;
        };
        self.collided[i].2 -= 1;
        let gone = self.collided[i].2 == 0;
        if gone {
            self.collided.swap_remove(i);
        }
        gone
    }

    /// Tokens of `rest` (what follows the router block `seed` in a prompt; 0: the prompt's start) the endpoint
    /// holds: the longest tail there that `rest` begins with (engines evict a sequence's pages from its end, so the
    /// shorter ones are held too).
    pub fn longest(&self, seed: u64, rest: &[u32]) -> usize {
        let Some(&(_, longest)) = self.seeds.get(&seed) else {
            return 0;
        };
        let (mut key, mut best) = (seed, 0);
        let is_it = |t: &Tail, len: usize| t.seed == seed && t.tokens() == &rest[..len];
        for (i, &token) in rest.iter().take(longest).enumerate() {
            key = tail_key(key, token);
            let held = self.tails.get(&key).is_some_and(|(t, _)| is_it(t, i + 1))
                || self.collided.iter().any(|(k, t, _)| *k == key && is_it(t, i + 1));
            if held {
                best = i + 1;
            }
        }
        best
    }

    /// Distinct tails held.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// Where a stored sequence stands at the end of one engine block.
#[derive(Debug, Clone)]
struct Point {
    /// The router hash of the last whole router block ending at or before this block's end (0: none).
    seed: u64,
    /// Tokens from the start of the sequence to this block's end.
    end: u64,
    /// Tokens of the sequence from `run_start` on, shared by the blocks stored with this one; this block's tokens
    /// since its last router boundary are among them.
    run: Arc<[u32]>,
    run_start: u64,
    /// Router blocks whose last token is in this engine block.
    completed: Box<[u64]>,
}

impl Point {
    /// Its tokens past its last router boundary, if it does not end on one.
    fn tail(&self, block: u64) -> Option<Tail> {
        let boundary = self.end - self.end % block;
        (boundary < self.end).then(|| Tail {
            seed: self.seed,
            run: Arc::clone(&self.run),
            from: (boundary - self.run_start) as u32,
            len: (self.end - boundary) as u32,
        })
    }
}

/// One endpoint's engine blocks, followed (see the module documentation).
#[derive(Debug)]
pub struct EngineBlocks {
    /// The router's block size, tokens.
    block: u64,
    points: HashMap<EngineHash, Point>,
    /// Router blocks held, with how many engine blocks complete each.
    held: HashMap<u64, u32>,
    max_blocks: usize,
}

impl EngineBlocks {
    /// Follows an endpoint's events into router blocks of `block_tokens`, for at most `max_blocks` engine blocks.
    pub fn new(block_tokens: usize, max_blocks: usize) -> Self {
        Self {
            block: block_tokens.max(1) as u64,
            points: HashMap::new(),
            held: HashMap::new(),
            max_blocks,
        }
    }

    /// Engine blocks followed.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// Router blocks the endpoint holds, as its events tell.
    pub fn router_blocks(&self) -> usize {
        self.held.len()
    }

    /// Applies one event; returns what the router's index must do (`None`: nothing, e.g. another medium's event).
    pub fn apply(&mut self, event: &KvEvent) -> Result<Option<CacheChange>, FollowError> {
        match event {
            KvEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                medium,
                plain,
            } => {
                if !plain || !on_gpu(medium.as_deref()) {
                    return Ok(None);
                }
                let (blocks, tails) = self.stored(hashes, *parent, tokens, *block_size as usize)?;
                Ok(
                    (!blocks.is_empty() || !tails.is_empty()).then_some(CacheChange::Stored {
                        blocks,
                        tails,
                        page: *block_size,
                    }),
                )
            }
            KvEvent::Removed { hashes, medium, plain } => {
                if !plain || !on_gpu(medium.as_deref()) {
                    return Ok(None);
                }
                let (mut removed, mut tails) = (Vec::new(), Vec::new());
                for point in hashes.iter().filter_map(|h| self.points.remove(h)) {
                    tails.extend(point.tail(self.block));
                    for &h in point.completed.iter() {
                        if let Some(count) = self.held.get_mut(&h) {
                            *count -= 1;
                            if *count == 0 {
                                self.held.remove(&h);
                                removed.push(h);
                            }
                        }
                    }
                }
                Ok((!removed.is_empty() || !tails.is_empty())
                    .then_some(CacheChange::Removed { blocks: removed, tails }))
            }
            KvEvent::Cleared => {
                self.clear();
                Ok(Some(CacheChange::Cleared))
            }
        }
    }

    /// Forgets everything (the engine restarted, or the events can no longer be trusted).
    pub fn clear(&mut self) {
        self.points.clear();
        self.held.clear();
    }

    fn stored(
        &mut self,
        hashes: &[EngineHash],
        parent: Option<EngineHash>,
        tokens: &[u32],
        block_size: usize,
    ) -> Result<(Vec<u64>, Vec<Tail>), FollowError> {
        let (mut seed, start, carried): (u64, u64, &[u32]) = match parent {
            None => (0, 0, &[]),
            Some(parent) => {
                let p = self.points.get(&parent).ok_or(FollowError::Orphan)?;
                let boundary = p.end - p.end % self.block;
                let from = (boundary - p.run_start) as usize;
                let to = (p.end - p.run_start) as usize;
                (p.seed, p.end, &p.run[from..to])
            }
        };
        let blocks = hashes.len().min(tokens.len() / block_size.max(1));
        if self.points.len() + blocks > self.max_blocks {
            return Err(FollowError::TooMany(self.max_blocks));
        }
        let run_start = start - carried.len() as u64;
        let mut run = Vec::with_capacity(carried.len() + blocks * block_size);
        run.extend_from_slice(carried);
        run.extend_from_slice(&tokens[..blocks * block_size]);
        let run: Arc<[u32]> = run.into();
        let mut boundary = run_start;
        let (mut stored, mut tails) = (Vec::new(), Vec::new());
        for (i, &hash) in hashes[..blocks].iter().enumerate() {
            let end = start + ((i + 1) * block_size) as u64;
            let first = stored.len();
            while boundary + self.block <= end {
                let from = (boundary - run_start) as usize;
                seed = token_block_hash(seed, &run[from..from + self.block as usize]);
                stored.push(seed);
                boundary += self.block;
            }
            let point = Point {
                seed,
                end,
                run: Arc::clone(&run),
                run_start,
                completed: stored[first..].into(),
            };
            for &h in &stored[first..] {
                *self.held.entry(h).or_insert(0) += 1;
            }
            let tail = point.tail(self.block);
            // The same engine block stored again (an engine that re-announces it): it completes its router
            // blocks once, and holds its tail once.
            match self.points.insert(hash, point) {
                Some(old) => {
                    for h in old.completed.iter() {
                        if let Some(count) = self.held.get_mut(h) {
                            *count = count.saturating_sub(1).max(1);
                        }
                    }
                }
                None => tails.extend(tail),
            }
        }
        Ok((stored, tails))
    }
}

/// Events that say nothing of their medium are the GPU's (engines without offloading).
fn on_gpu(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("gpu"))
}

#[cfg(test)]
#[path = "engine_blocks_tests.rs"]
mod tests;
