//! Deterministic synthetic token ids.
//!
//! Workloads need token sequences that share exactly where they should (the same system prompt, the same earlier
//! turns, the same trace block) and nowhere else. Every token is a pure function of a namespace, an id and a
//! position, mixed with SplitMix64, so two runs (and two policies) see identical prompts. O(1) per token.

/// The vocabulary size synthetic ids are drawn from (a Qwen/Llama-3-class tokenizer).
pub const VOCAB: u64 = 151_936;

/// SplitMix64's finalizer: a bijective 64-bit mix (the one core's hashing uses).
pub use dprouter_core::hashing::mix64 as mix;

/// What a token sequence belongs to; keeps ids of different kinds apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Namespace {
    SystemPrompt = 1,
    UserTurn = 2,
    Output = 3,
    TraceBlock = 4,
    Question = 5,
}

/// `len` tokens of sequence `id` in `ns`, appended to `out`. The same `(seed, ns, id)` always gives the same tokens.
pub fn extend(out: &mut Vec<u32>, seed: u64, ns: Namespace, id: u64, len: usize) {
    let base = mix(mix(seed ^ ((ns as u64) << 56)) ^ id);
    out.extend((0..len as u64).map(|i| (mix(base.wrapping_add(i)) % VOCAB) as u32));
}

/// The token sequence alone.
pub fn sequence(seed: u64, ns: Namespace, id: u64, len: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(len);
    extend(&mut out, seed, ns, id, len);
    out
}

/// The output a simulated engine "generates" for request `request_id`: what it caches after the request finishes
/// and what a multi-turn workload appends to the conversation.
pub fn output(seed: u64, request_id: u64, len: usize) -> Vec<u32> {
    sequence(seed, Namespace::Output, request_id, len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_inputs_same_tokens_and_different_ids_differ() {
        assert_eq!(
            sequence(1, Namespace::SystemPrompt, 7, 100),
            sequence(1, Namespace::SystemPrompt, 7, 100)
        );
        assert_ne!(
            sequence(1, Namespace::SystemPrompt, 7, 100),
            sequence(1, Namespace::SystemPrompt, 8, 100)
        );
        assert_ne!(
            sequence(1, Namespace::SystemPrompt, 7, 100),
            sequence(2, Namespace::SystemPrompt, 7, 100)
        );
        assert_ne!(
            sequence(1, Namespace::SystemPrompt, 7, 100),
            sequence(1, Namespace::UserTurn, 7, 100)
        );
        // A shorter sequence is a prefix of a longer one.
        let long = sequence(3, Namespace::TraceBlock, 9, 512);
        assert_eq!(sequence(3, Namespace::TraceBlock, 9, 100)[..], long[..100]);
        assert!(long.iter().all(|&t| u64::from(t) < VOCAB));
    }
}
