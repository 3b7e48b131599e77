//! What a policy knows about one request.

/// The prompt a policy keys on: token ids when the client sent them, otherwise the prompt's UTF-8 bytes (the
/// router never tokenizes; see [`crate::prompt`] for how chat conversations are rendered to bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Tokens(Vec<u32>),
    Bytes(Vec<u8>),
}

impl Prompt {
    /// Number of units (tokens or bytes).
    pub fn len(&self) -> usize {
        match self {
            Prompt::Tokens(t) => t.len(),
            Prompt::Bytes(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Estimated prompt length in tokens: exact for token ids, `ceil(bytes / 4)` for text.
    pub fn estimated_tokens(&self) -> u64 {
        match self {
            Prompt::Tokens(t) => t.len() as u64,
            Prompt::Bytes(b) => (b.len() as u64).div_ceil(BYTES_PER_TOKEN),
        }
    }
}

/// The hash of a session hint, as [`RouteRequest::session`] holds it.
pub fn session_hash(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), 0x5e55_10e5)
}

/// The bytes-per-token ratio used to estimate a text prompt's token count.
pub const BYTES_PER_TOKEN: u64 = 4;

/// Everything routing needs from one request, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRequest {
    pub prompt: Prompt,
    /// Prompt length in tokens (exact or estimated), for token-based load.
    pub input_tokens: u64,
    /// A client's rank override (`routed_dp_rank`, `data_parallel_rank`, `X-Data-Parallel-Rank`), unvalidated.
    pub rank_override: Option<i64>,
    /// SGLang's PD-disaggregation `bootstrap_room`.
    pub bootstrap_room: Option<u64>,
    /// When the request is routed, microseconds on the caller's monotonic clock (the one it also passes to
    /// [`crate::load::LoadGuard::first_token`]); 0 when the caller keeps no clock.
    pub now_us: u64,
    /// The client's session hint (OpenAI's `prompt_cache_key`, or the gateway's session header), hashed: requests
    /// with the same one prefer the same endpoint under the cache-aware policies (`prefix_affinity` keys on it,
    /// `cache_aware` places its cold requests by it). SGLang's methods ignore it.
    pub session: Option<u64>,
    /// The cache namespace the request's prompt is cached in, hashed ([`crate::hashing::namespaced`]); `None` is
    /// the plain one. Prompts in different namespaces share no keys.
    pub namespace: Option<u64>,
    /// Decide without recording the decision (a query: which rank would take the request now?): the round-robin
    /// turn does not advance and `cache_aware`'s index records nothing.
    pub dry_run: bool,
}

impl RouteRequest {
    /// A request with no override and no bootstrap room.
    pub fn new(prompt: Prompt) -> Self {
        Self {
            input_tokens: prompt.estimated_tokens(),
            prompt,
            rank_override: None,
            bootstrap_room: None,
            now_us: 0,
            session: None,
            namespace: None,
            dry_run: false,
        }
    }

    pub fn tokens(ids: Vec<u32>) -> Self {
        Self::new(Prompt::Tokens(ids))
    }

    pub fn text(text: &str) -> Self {
        Self::new(Prompt::Bytes(text.as_bytes().to_vec()))
    }

    pub fn with_override(mut self, rank: i64) -> Self {
        self.rank_override = Some(rank);
        self
    }

    pub fn with_bootstrap_room(mut self, room: u64) -> Self {
        self.bootstrap_room = Some(room);
        self
    }

    /// The request with the session hint `key` (hashed).
    pub fn with_session(mut self, key: &str) -> Self {
        self.session = Some(session_hash(key));
        self
    }

    /// The request in the cache namespace `key` (hashed).
    pub fn with_namespace(mut self, key: &str) -> Self {
        self.namespace = Some(xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), 0x6e5));
        self
    }

    /// The request routed at `now_us` on the caller's clock.
    pub fn at(mut self, now_us: u64) -> Self {
        self.now_us = now_us;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_estimate_is_exact_for_ids_and_rounds_up_for_bytes() {
        assert_eq!(RouteRequest::tokens(vec![1, 2, 3]).input_tokens, 3);
        assert_eq!(RouteRequest::text("abcde").input_tokens, 2);
        assert_eq!(RouteRequest::text("").input_tokens, 0);
    }
}
