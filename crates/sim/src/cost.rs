//! The engine cost model: how long prefill and decode take on one DP rank, and how much KV it holds.
//!
//! ```text
//! TTFT       = queueing + base + uncached_prompt_tokens / prefill_rate
//! prefill    : one rank prefills one request at a time, first come first served (a long prompt delays the queue
//!              behind it, as chunked prefill does when the rank is busy); base is part of each prefill's service time
//! decode     : the remaining output tokens at tpot · (1 + decode_slowdown · (running − 1)) each, with `running` the
//!              requests decoding on that rank when this one starts
//! KV         : a radix cache of `kv_capacity` tokens per rank
//! coupling   : with `prefill_stalls_decode`, decode on every rank stands still while any rank prefills;
//!              with `prefill_contention` c, k ranks prefilling at once each advance at 1 / (1 + c·(k − 1)) speed
//! ```
//!
//! Presets:
//! - `seed-moe`: the Qwen3-class MoE at tp16/dp16/ep16 of SGLANG_SEMANTICS.md. `base` 1.235 s and 3,674 prefill
//!   tokens/s per rank are fitted to its measurement (7.40 s for a cold 22,651-token prompt, 1.29 s when only ~200
//!   tokens are new). tpot 25 ms with 150-token answers and 1 s think time gives its 30 requests in ~180 s.
//!   500k KV tokens per rank. Prefill stalls decode on every rank: at tp16/dp16/ep16 SGLang runs DP attention, where
//!   all ranks take each forward pass together (the MoE layers exchange tokens across them), so a rank's prefill
//!   holds the others' decode steps; that coupling is what brings four agents on one prefix under `prefix_match`
//!   to the seed's 0.41 requests/s (`docs/measurements.md`).
//! - `h100-8b`: a Llama-3-8B-class model on one H100 SXM per rank. Prefill ~25k tokens/s: 16 GFLOP per token
//!   (2 × 8B parameters) at ~40% of the H100's 989 dense BF16 TFLOPS (NVIDIA H100 datasheet); base 25 ms
//!   (scheduling and one forward pass); tpot 8 ms: 16 GB of BF16 weights read per step at 3.35 TB/s is 4.8 ms, plus
//!   overheads, in line with published vLLM/SGLang single-stream figures; KV capacity 400k tokens: Llama-3-8B stores
//!   128 KiB per token (32 layers × 8 KV heads × 128 dims × 2 (K,V) × 2 bytes), and ~52 GB of the 80 GB remain after
//!   weights and activations.
//! - `zero`: no cost at all, for measuring routing and proxy overhead alone.

use serde::{Deserialize, Serialize};

/// Seconds of virtual time are kept as integer microseconds.
pub type Micros = u64;

pub const MICROS_PER_SECOND: f64 = 1e6;

/// One DP rank's costs. Every field can be overridden from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Fixed part of every prefill, seconds.
    pub base_s: f64,
    /// Prefill throughput of one rank, tokens per second (0 = free).
    pub prefill_tokens_per_s: f64,
    /// Time per output token of a lone request, seconds.
    pub tpot_s: f64,
    /// Relative slowdown of decode per additional running request on the rank.
    pub decode_slowdown: f64,
    /// KV cache capacity of one rank, tokens.
    pub kv_capacity: usize,
    /// Radix cache page size, tokens.
    pub page_size: usize,
    /// Decode on every rank pauses while any rank prefills, as under SGLang's DP attention, where all ranks run
    /// each forward pass together (the MoE layers exchange tokens across them).
    #[serde(default)]
    pub prefill_stalls_decode: bool,
    /// How much the ranks' prefills share compute (expert parallelism: every rank's MoE layers run on the same
    /// experts): while k ranks prefill, each advances at `1 / (1 + prefill_contention · (k − 1))` of its speed; 0
    /// independent ranks, 1 one pool ([`crate::shared_prefill`]).
    #[serde(default)]
    pub prefill_contention: f64,
    /// Under prefill/decode disaggregation, how fast a prompt's KV cache moves from a prefill rank to a decode
    /// rank, tokens per second (0 = free).
    #[serde(default)]
    pub kv_transfer_tokens_per_s: f64,
}

impl CostModel {
    pub const PRESETS: &'static [&'static str] = &["seed-moe", "h100-8b", "zero"];

    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "seed-moe" => Some(Self {
                base_s: 1.235,
                prefill_tokens_per_s: 3674.0,
                tpot_s: 0.025,
                decode_slowdown: 0.02,
                kv_capacity: 500_000,
                page_size: 1,
                prefill_stalls_decode: true,
                prefill_contention: 0.0,
                // MLA's ~70 KB of KV per token over ~35 GB/s of RDMA.
                kv_transfer_tokens_per_s: 500_000.0,
            }),
            "h100-8b" => Some(Self {
                base_s: 0.025,
                prefill_tokens_per_s: 25_000.0,
                tpot_s: 0.008,
                decode_slowdown: 0.01,
                kv_capacity: 400_000,
                page_size: 1,
                prefill_stalls_decode: false,
                prefill_contention: 0.0,
                // 128 KB of KV per token (Llama 3 8B, bf16) over ~25 GB/s.
                kv_transfer_tokens_per_s: 200_000.0,
            }),
            "zero" => Some(Self::ZERO),
            _ => None,
        }
    }

    /// The `zero` preset: nothing costs time.
    pub const ZERO: Self = Self {
        base_s: 0.0,
        prefill_tokens_per_s: 0.0,
        tpot_s: 0.0,
        decode_slowdown: 0.0,
        kv_capacity: 1_000_000,
        page_size: 1,
        prefill_stalls_decode: false,
        prefill_contention: 0.0,
        kv_transfer_tokens_per_s: 0.0,
    };

    /// Service time of one prefill with `uncached` new tokens.
    pub fn prefill(&self, uncached: usize) -> Micros {
        let rate = if self.prefill_tokens_per_s > 0.0 {
            uncached as f64 / self.prefill_tokens_per_s
        } else {
            0.0
        };
        to_micros(self.base_s + rate)
    }

    /// Time to move the KV cache of `tokens` prompt tokens from a prefill rank to a decode rank.
    pub fn transfer(&self, tokens: usize) -> Micros {
        if self.kv_transfer_tokens_per_s > 0.0 {
            to_micros(tokens as f64 / self.kv_transfer_tokens_per_s)
        } else {
            0
        }
    }

    /// Time to decode `output_tokens` after the first one, with `running` requests decoding on the rank (this one
    /// included).
    pub fn decode(&self, output_tokens: u32, running: usize) -> Micros {
        let per_token = self.tpot_s * (1.0 + self.decode_slowdown * running.saturating_sub(1) as f64);
        to_micros(per_token * f64::from(output_tokens.saturating_sub(1)))
    }
}

pub fn to_micros(seconds: f64) -> Micros {
    (seconds.max(0.0) * MICROS_PER_SECOND).round() as Micros
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_preset_reproduces_the_seed_measurement() {
        let seed = CostModel::preset("seed-moe").unwrap();
        let cold = seed.prefill(22_651) as f64 / MICROS_PER_SECOND;
        let warm = seed.prefill(200) as f64 / MICROS_PER_SECOND;
        assert!((cold - 7.40).abs() < 0.01, "cold {cold}");
        assert!((warm - 1.29).abs() < 0.01, "warm {warm}");
    }

    #[test]
    fn decode_slows_with_running_requests_and_zero_is_free() {
        let m = CostModel::preset("h100-8b").unwrap();
        assert_eq!(m.decode(101, 1), 800_000);
        assert!(m.decode(101, 11) > m.decode(101, 1));
        let zero = CostModel::preset("zero").unwrap();
        assert_eq!((zero.prefill(100_000), zero.decode(500, 64)), (0, 0));
        assert!(CostModel::preset("a100").is_none());
    }
}
