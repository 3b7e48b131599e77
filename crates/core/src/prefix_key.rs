//! The `prefix_match` key: a BLAKE2b-64 digest of the prompt's leading, window-aligned units.
//!
//! ```text
//! units  = token ids (u32, 4 bytes little-endian each) | raw UTF-8 bytes of the prompt text
//! n      = min(len(units), MAX)          MAX    = 4096 tokens | 16384 bytes
//! w      = n - n % WINDOW                WINDOW = 256 tokens  | 1024 bytes
//! if w == 0: w = n                       (prompts shorter than one window hash whole)
//! digest = blake2b(units[:w], digest_size = 8)
//! key    = u64::from_le_bytes(digest)
//! ```
//!
//! Cost: one BLAKE2b pass over at most 16 KiB, whatever the prompt length. The window makes two prompts that share
//! their first `w` units share a key even when their tails differ; the cap bounds the work.

use blake2::digest::consts::U8;
use blake2::{Blake2b, Digest};
use serde::{Deserialize, Serialize};

use crate::request::Prompt;

type Blake2b64 = Blake2b<U8>;

/// How much of the prompt the key covers. Defaults are the spec's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixWindow {
    /// At most this many leading tokens are hashed.
    pub max_tokens: usize,
    /// The hashed token count is cut down to a multiple of this.
    pub window_tokens: usize,
    /// At most this many leading bytes of a text prompt are hashed.
    pub max_bytes: usize,
    /// The hashed byte count is cut down to a multiple of this.
    pub window_bytes: usize,
}

impl Default for PrefixWindow {
    fn default() -> Self {
        Self {
            max_tokens: 4096,
            window_tokens: 256,
            max_bytes: 16384,
            window_bytes: 1024,
        }
    }
}

/// The number of leading units hashed for a prompt of `len` units.
pub fn hashed_len(len: usize, max: usize, window: usize) -> usize {
    let n = len.min(max);
    let w = if window == 0 { n } else { n - n % window };
    if w == 0 {
        n
    } else {
        w
    }
}

impl PrefixWindow {
    /// The number of leading units of `prompt` the key covers.
    pub fn covered(&self, prompt: &Prompt) -> usize {
        match prompt {
            Prompt::Tokens(t) => hashed_len(t.len(), self.max_tokens, self.window_tokens),
            Prompt::Bytes(b) => hashed_len(b.len(), self.max_bytes, self.window_bytes),
        }
    }

    /// The prompt's 8-byte BLAKE2b digest over the covered units.
    pub fn digest(&self, prompt: &Prompt) -> [u8; 8] {
        let covered = self.covered(prompt);
        let mut hasher = Blake2b64::new();
        match prompt {
            Prompt::Tokens(tokens) => crate::hashing::token_bytes(&tokens[..covered], |bytes| hasher.update(bytes)),
            Prompt::Bytes(bytes) => hasher.update(&bytes[..covered]),
        }
        hasher.finalize().into()
    }

    /// The key `prefix_match` reduces modulo the number of ranks.
    pub fn key(&self, prompt: &Prompt) -> u64 {
        u64::from_le_bytes(self.digest(prompt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashed_len_follows_the_spec() {
        assert_eq!(hashed_len(0, 4096, 256), 0);
        assert_eq!(hashed_len(1, 4096, 256), 1);
        assert_eq!(hashed_len(255, 4096, 256), 255);
        assert_eq!(hashed_len(256, 4096, 256), 256);
        assert_eq!(hashed_len(4001, 4096, 256), 3840);
        assert_eq!(hashed_len(4095, 4096, 256), 3840);
        assert_eq!(hashed_len(100_000, 4096, 256), 4096);
        assert_eq!(hashed_len(1023, 16384, 1024), 1023);
        assert_eq!(hashed_len(16383, 16384, 1024), 15360);
    }

    #[test]
    fn token_digest_equals_digest_of_little_endian_bytes() {
        let ids: Vec<u32> = (0..700u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let bytes: Vec<u8> = ids[..512].iter().flat_map(|i| i.to_le_bytes()).collect();
        let expected: [u8; 8] = Blake2b64::digest(&bytes).into();
        assert_eq!(PrefixWindow::default().digest(&Prompt::Tokens(ids)), expected);
    }

    #[test]
    fn matches_every_reference_vector() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/prefix_match.jsonl");
        let text = std::fs::read_to_string(path).unwrap();
        let window = PrefixWindow::default();
        let mut checked = 0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let prompt = match (v.get("input_ids"), v.get("text")) {
                (Some(ids), _) => Prompt::Tokens(serde_json::from_value(ids.clone()).unwrap()),
                (None, Some(t)) => Prompt::Bytes(t.as_str().unwrap().as_bytes().to_vec()),
                _ => panic!("vector without a prompt: {line}"),
            };
            let digest = window.digest(&prompt);
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(hex, v["blake2b8"].as_str().unwrap(), "digest of {line:.80}");
            let dp = v["dp_size"].as_u64().unwrap();
            assert_eq!(u64::from_le_bytes(digest) % dp, v["rank"].as_u64().unwrap());
            checked += 1;
        }
        assert!(checked >= 50, "only {checked} vectors read");
    }
}
