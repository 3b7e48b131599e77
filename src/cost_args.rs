//! Engine cost options shared by `simulate` and `mock-engine`: a preset plus per-field overrides.

use anyhow::Context;
use clap::Args;
use dprouter_sim::CostModel;

#[derive(Debug, Clone, Args)]
pub struct CostArgs {
    /// Engine cost preset: seed-moe, h100-8b or zero.
    #[arg(long, default_value = "h100-8b", value_parser = parse_preset)]
    pub preset: String,
    /// KV cache capacity per rank, tokens.
    #[arg(long)]
    kv_capacity: Option<usize>,
    /// Fixed part of each prefill, milliseconds.
    #[arg(long)]
    base_ms: Option<f64>,
    /// Prefill throughput per rank, tokens per second.
    #[arg(long)]
    prefill_rate: Option<f64>,
    /// Time per output token, milliseconds.
    #[arg(long)]
    tpot_ms: Option<f64>,
    /// Decode slowdown per additional running request.
    #[arg(long)]
    decode_slowdown: Option<f64>,
    /// Radix cache page size, tokens.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    page_size: Option<u64>,
    /// Whether decode on every rank pauses while any rank prefills (DP attention): true or false.
    #[arg(long)]
    prefill_stalls_decode: Option<bool>,
    /// How much the ranks' prefills share compute (expert parallelism): while k ranks prefill, each advances at
    /// 1 / (1 + C·(k − 1)) of its speed; 0 independent ranks, 1 one shared pool.
    #[arg(long, value_name = "C", value_parser = parse_contention)]
    prefill_contention: Option<f64>,
    /// Under prefill/decode disaggregation, how fast a prompt's KV cache moves from a prefill rank to a decode
    /// rank, tokens per second (0: free).
    #[arg(long, value_name = "TOKENS_PER_S")]
    kv_transfer_rate: Option<f64>,
}

fn parse_contention(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(c) if (0.0..=1.0).contains(&c) => Ok(c),
        _ => Err(format!("`{value}` is not a number from 0 to 1")),
    }
}

fn parse_preset(name: &str) -> Result<String, String> {
    match CostModel::preset(name) {
        Some(_) => Ok(name.into()),
        None => Err(format!(
            "unknown preset `{name}`; expected one of: {}",
            CostModel::PRESETS.join(", ")
        )),
    }
}

impl CostArgs {
    /// The preset with the overrides applied.
    pub fn model(&self) -> anyhow::Result<CostModel> {
        let mut cost = CostModel::preset(&self.preset).context("unknown preset")?;
        if let Some(v) = self.kv_capacity {
            cost.kv_capacity = v;
        }
        // Times and rates are 0 or more (a rate of 0: prefill is free, as in the `zero` preset).
        for (flag, value) in [
            ("--base-ms", self.base_ms),
            ("--prefill-rate", self.prefill_rate),
            ("--tpot-ms", self.tpot_ms),
            ("--decode-slowdown", self.decode_slowdown),
        ] {
            if let Some(v) = value {
                anyhow::ensure!(v.is_finite() && v >= 0.0, "{flag} must be a number, 0 or more; got {v}");
            }
        }
        if let Some(v) = self.base_ms {
            cost.base_s = v / 1000.0;
        }
        if let Some(v) = self.prefill_rate {
            cost.prefill_tokens_per_s = v;
        }
        if let Some(v) = self.tpot_ms {
            cost.tpot_s = v / 1000.0;
        }
        if let Some(v) = self.decode_slowdown {
            cost.decode_slowdown = v;
        }
        if let Some(v) = self.prefill_stalls_decode {
            cost.prefill_stalls_decode = v;
        }
        if let Some(v) = self.prefill_contention {
            cost.prefill_contention = v;
        }
        if let Some(v) = self.kv_transfer_rate {
            anyhow::ensure!(
                v.is_finite() && v >= 0.0,
                "--kv-transfer-rate must be a number of tokens per second, 0 or more"
            );
            cost.kv_transfer_tokens_per_s = v;
        }
        if let Some(v) = self.page_size {
            cost.page_size = usize::try_from(v).context("page size too large")?;
        }
        Ok(cost)
    }
}
