//! The peers' routing methods, ported from their sources so the simulator (and any comparison) runs them beside
//! dprouter's own: SMG's `cache_aware` ([`smg_cache_aware`]), llm-d's default scheduling profile ([`llm_d`]) and
//! Dynamo's KV router cost ([`dynamo_kv`]). Each module cites the repository, file and commit it follows, and says
//! where the port departs from it (a deterministic draw where the source draws at random, token ids where it reads
//! characters). They are selectable like any policy (`--policy smg_cache_aware`), but made to be measured against,
//! not deployed: each peer's own gateway is the way to run it.

use crate::hashing::{block_hashes, mix64, namespaced};
use crate::request::{Prompt, RouteRequest, BYTES_PER_TOKEN};

pub mod dynamo_kv;
pub mod llm_d;
pub mod smg_cache_aware;
mod smg_tree;

/// The chained hashes of `req`'s whole blocks of `block_tokens` tokens (of `block_tokens` × 4 bytes for a text
/// prompt), in its cache namespace.
pub(crate) fn block_hashes_of(req: &RouteRequest, block_tokens: usize) -> Vec<u64> {
    let units = match req.prompt {
        Prompt::Tokens(_) => block_tokens.max(1),
        Prompt::Bytes(_) => block_tokens.max(1) * BYTES_PER_TOKEN as usize,
    };
    let mut out = Vec::with_capacity(req.prompt.len() / units);
    block_hashes(&req.prompt, units, &mut out);
    if req.namespace.is_some() {
        for h in &mut out {
            *h = namespaced(*h, req.namespace);
        }
    }
    out
}

/// Where a source breaks a tie uniformly at random: one of `tied` (non-empty), drawn from the policy's own counter,
/// so a run is reproducible.
pub(crate) fn draw<T: Copy>(tied: &[T], counter: &mut u64) -> T {
    *counter += 1;
    tied[(mix64(*counter ^ 0x7_1ED) % tied.len() as u64) as usize]
}
