//! Fast hashes shared by the hash-based policies: prompt prefixes, chained prompt blocks, rendezvous scores.
//!
//! - A prompt's units hash as bytes: token ids as 4 little-endian bytes each, text as its UTF-8 bytes. XXH3-64
//!   (the `xxhash-rust` crate), ~10+ GB/s, so hashing a 32k-token prompt costs ~10 µs.
//! - [`block_hashes`] chains XXH3 over fixed-size blocks: block `i`'s hash is seeded with block `i − 1`'s, so equal
//!   hashes at position `i` mean (up to 64-bit collisions) equal prompts up to the end of block `i`. Only whole blocks
//!   are hashed: a prompt's last partial block is never cached as a block.
//! - Rendezvous (highest-random-weight) hashing: `score(key, endpoint) = mix(key ^ mix(endpoint id))` with
//!   SplitMix64's finalizer, a bijection, so every endpoint's score for a key is an independent-looking 64-bit value
//!   and one endpoint leaving or joining changes no other endpoint's score (Thaler and Ravishankar, 1998).

use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed, Xxh3};

use crate::endpoint::EndpointId;
use crate::request::Prompt;

/// SplitMix64's finalizer: a bijective 64-bit mix.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A `Hasher` for keys that are already uniform 64-bit hashes (block hashes): it passes them through.
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

/// The build hasher for maps and sets keyed by 64-bit hashes.
pub type PassThroughBuild = BuildHasherDefault<PassThroughHasher>;

/// A stable hash of an endpoint id (worker and dp rank, not its position in a snapshot).
pub fn endpoint_hash(id: EndpointId) -> u64 {
    mix64((u64::from(id.worker.0) << 32) | u64::from(id.dp_rank))
}

/// The rendezvous score of `endpoint` for `key`; an endpoint's preference order for a key is descending score.
pub fn rendezvous_score(key: u64, endpoint: EndpointId) -> u64 {
    mix64(key ^ endpoint_hash(endpoint))
}

const TOKEN_CHUNK: usize = 256;

/// Feeds `tokens` to `f` as little-endian bytes: on a little-endian target the ids' own memory, at once; otherwise
/// converted in stack-sized chunks.
pub(crate) fn token_bytes(tokens: &[u32], mut f: impl FnMut(&[u8])) {
    if cfg!(target_endian = "little") {
        return f(zerocopy::IntoBytes::as_bytes(tokens));
    }
    let mut buf = [0u8; TOKEN_CHUNK * 4];
    for chunk in tokens.chunks(TOKEN_CHUNK) {
        for (dst, id) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&id.to_le_bytes());
        }
        f(&buf[..chunk.len() * 4]);
    }
}

/// XXH3-64 of `tokens` as little-endian bytes, seeded: one pass over the ids' memory on a little-endian target.
fn token_hash(tokens: &[u32], seed: u64) -> u64 {
    if cfg!(target_endian = "little") {
        return xxh3_64_with_seed(zerocopy::IntoBytes::as_bytes(tokens), seed);
    }
    let mut hasher = Xxh3::with_seed(seed);
    token_bytes(tokens, |bytes| hasher.update(bytes));
    hasher.digest()
}

/// XXH3-64 of the prompt's first `len` units (clipped to its length).
pub fn prefix_hash(prompt: &Prompt, len: usize) -> u64 {
    match prompt {
        Prompt::Bytes(b) => xxh3_64(&b[..len.min(b.len())]),
        Prompt::Tokens(t) => token_hash(&t[..len.min(t.len())], 0),
    }
}

/// Replaces `out` with the chained hashes of the prompt's whole blocks of `block` units (`block >= 1`).
pub fn block_hashes(prompt: &Prompt, block: usize, out: &mut Vec<u64>) {
    let block = block.max(1);
    out.clear();
    let mut seed = 0u64;
    match prompt {
        Prompt::Bytes(b) => {
            for chunk in b.chunks_exact(block) {
                seed = xxh3_64_with_seed(chunk, seed);
                out.push(seed);
            }
        }
        Prompt::Tokens(t) => {
            for chunk in t.chunks_exact(block) {
                seed = token_block_hash(seed, chunk);
                out.push(seed);
            }
        }
    }
}

/// `key` in a cache namespace: requests in different namespaces (SGLang's `extra_key`, vLLM's `cache_salt`, a LoRA
/// adapter) never share an engine's cache, so their keys must not meet; `None` is the plain namespace, unchanged.
pub fn namespaced(key: u64, namespace: Option<u64>) -> u64 {
    match namespace {
        None => key,
        Some(ns) => mix64(key ^ mix64(ns ^ 0x6e61_6d65_7370_6163)),
    }
}

/// The chained hash of one block of token ids after the block hashed to `seed` (0 before the first block), as
/// [`block_hashes`] computes it.
pub fn token_block_hash(seed: u64, tokens: &[u32]) -> u64 {
    token_hash(tokens, seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_hashes_are_hashes_of_little_endian_bytes() {
        let ids: Vec<u32> = (0..1000u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        assert_eq!(
            prefix_hash(&Prompt::Tokens(ids.clone()), 700),
            prefix_hash(&Prompt::Bytes(bytes.clone()), 2800)
        );
        let (mut a, mut b) = (Vec::new(), Vec::new());
        block_hashes(&Prompt::Tokens(ids), 300, &mut a);
        block_hashes(&Prompt::Bytes(bytes), 1200, &mut b);
        assert_eq!((a.len(), &a), (3, &b));
    }

    /// The hashes are part of what the docs' simulations print (rendezvous ties, the simulated engine's pages): a
    /// faster way to compute them must give the same values as XXH3's streaming form, one id at a time.
    #[test]
    fn hashes_equal_streaming_xxh3_of_each_id() {
        let ids: Vec<u32> = (0..300u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let streamed = |seed: u64, ids: &[u32]| {
            let mut h = Xxh3::with_seed(seed);
            ids.iter().for_each(|id| h.update(&id.to_le_bytes()));
            h.digest()
        };
        let mut out = Vec::new();
        block_hashes(&Prompt::Tokens(ids.clone()), 64, &mut out);
        let mut seed = 0;
        for (block, hash) in ids.chunks_exact(64).zip(&out) {
            seed = streamed(seed, block);
            assert_eq!(*hash, seed);
        }
        assert_eq!(out.len(), 4);
        assert_eq!(prefix_hash(&Prompt::Tokens(ids.clone()), 250), streamed(0, &ids[..250]));
    }

    #[test]
    fn block_hashes_chain_so_a_change_moves_every_later_block() {
        let a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        b[25] = 9999;
        let (mut ha, mut hb) = (Vec::new(), Vec::new());
        block_hashes(&Prompt::Tokens(a.clone()), 10, &mut ha);
        block_hashes(&Prompt::Tokens(b), 10, &mut hb);
        assert_eq!(ha[..2], hb[..2]);
        assert!(ha[2..].iter().zip(&hb[2..]).all(|(x, y)| x != y));
        // Only whole blocks: 100 tokens of blocks of 30 give 3 hashes, equal to the first 90 tokens' hashes.
        block_hashes(&Prompt::Tokens(a.clone()), 30, &mut ha);
        block_hashes(&Prompt::Tokens(a[..90].to_vec()), 30, &mut hb);
        assert_eq!((ha.len(), &ha), (3, &hb));
    }

    #[test]
    fn rendezvous_scores_depend_on_the_endpoint_id_not_its_position() {
        let a = EndpointId::new(0, 3);
        assert_eq!(rendezvous_score(42, a), rendezvous_score(42, EndpointId::new(0, 3)));
        assert_ne!(rendezvous_score(42, a), rendezvous_score(42, EndpointId::new(1, 3)));
        assert_ne!(rendezvous_score(42, a), rendezvous_score(43, a));
    }
}
