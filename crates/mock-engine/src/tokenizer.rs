//! The mock engine's deterministic tokenizer and "model" output.
//!
//! Text is split into pieces, each a run of non-whitespace bytes followed by its whitespace; each piece is cut into
//! tokens of at most 4 bytes from its start, and a token's id is a hash of its bytes. So a text that extends
//! another at a piece boundary (a chat turn appended after the previous one) tokenizes to an extension of its token
//! ids, as a real BPE tokenizer nearly does, and English averages about 4 bytes per token.
//!
//! The "model" answers request `id` with words of three letters and a space: each word is exactly one token, so the
//! answer's text, sent back in the next turn, re-tokenizes to the very ids the engine generated and cached.

use dprouter_sim::tokens::{mix, VOCAB};

/// Maximum bytes per token.
pub const MAX_TOKEN_BYTES: usize = 4;

fn token_id(bytes: &[u8]) -> u32 {
    let mut x = 0xD1B5_4A32_D192_ED03u64;
    for &b in bytes {
        x = mix(x ^ u64::from(b));
    }
    (x % VOCAB) as u32
}

/// Token ids of `text`.
pub fn encode(text: &str) -> Vec<u32> {
    let bytes = text.as_bytes();
    let mut ids = Vec::with_capacity(bytes.len() / MAX_TOKEN_BYTES + 1);
    let mut start = 0;
    while start < bytes.len() {
        // A piece: non-whitespace, then whitespace.
        let mut end = start;
        while end < bytes.len() && !bytes[end].is_ascii_whitespace() {
            end += 1;
        }
        while end < bytes.len() && bytes[end].is_ascii_whitespace() {
            end += 1;
        }
        ids.extend(bytes[start..end].chunks(MAX_TOKEN_BYTES).map(token_id));
        start = end;
    }
    ids
}

const LETTERS: &[u8; 26] = b"abcdefghijklmnopqrstuvwxyz";

/// The `i`-th word (one token) of the answer to request `seed`.
pub fn output_word(seed: u64, i: u64) -> String {
    let x = mix(seed ^ mix(i));
    let letter = |k: u32| LETTERS[((x >> (k * 8)) % 26) as usize] as char;
    format!("{}{}{} ", letter(0), letter(1), letter(2))
}

/// The token id of an output word.
pub fn output_token(seed: u64, i: u64) -> u32 {
    token_id(output_word(seed, i).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extension_at_a_piece_boundary_extends_the_tokens() {
        let a = "<|system|>\nYou are terse.\n<|user|>\nhello there\n<|assistant|>\n";
        let answer: String = (0..5).map(|i| output_word(9, i)).collect();
        let b = format!("{a}{answer}\n<|user|>\nmore\n<|assistant|>\n");
        let (ta, tb) = (encode(a), encode(&b));
        assert_eq!(tb[..ta.len()], ta[..]);
        let generated: Vec<u32> = (0..5).map(|i| output_token(9, i)).collect();
        // All but the last word re-tokenize exactly (the last one absorbs the following newline).
        assert_eq!(tb[ta.len()..ta.len() + 4], generated[..4]);
    }

    #[test]
    fn about_four_bytes_per_token() {
        let text = "The quick brown fox jumps over the lazy dog, again and again, until evening falls. ".repeat(20);
        let ratio = text.len() as f64 / encode(&text).len() as f64;
        assert!((3.0..=5.0).contains(&ratio), "{ratio}");
        assert!(encode("").is_empty());
        assert_eq!(encode("abcdefgh").len(), 2);
    }
}
