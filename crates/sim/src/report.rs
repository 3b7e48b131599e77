//! Per-policy summaries of a simulation: the table `dprouter simulate` prints and its JSON.

use std::collections::HashSet;

use serde::Serialize;

use crate::cost::MICROS_PER_SECOND;
use crate::simulator::SimOutcome;

/// One row of the results table (field names are the `--json` keys).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub policy: String,
    pub requests: usize,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Median TTFT excluding the first request of each prefix group (its unavoidable cold start).
    pub steady_ttft_p50_ms: f64,
    /// Cached prompt tokens over all prompt tokens.
    pub hit_rate: f64,
    /// Completed requests per second of virtual time, first arrival to last finish.
    pub throughput_rps: f64,
    /// The busiest rank's routed requests over the mean per rank (1.0 is perfect balance).
    pub max_mean_load: f64,
    pub errors: u64,
}

/// Nearest-rank percentile of sorted values; 0 for none.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(micros: u64) -> f64 {
    micros as f64 / 1000.0
}

impl Summary {
    pub fn new(policy: &str, outcome: &SimOutcome) -> Self {
        let mut records: Vec<_> = outcome.records.iter().collect();
        records.sort_by_key(|r| (r.arrival, r.id));
        let mut ttfts: Vec<f64> = records.iter().map(|r| ms(r.ttft())).collect();
        let mut seen = HashSet::new();
        let mut steady: Vec<f64> = records
            .iter()
            .filter(|r| !seen.insert(r.group))
            .map(|r| ms(r.ttft()))
            .collect();
        ttfts.sort_by(f64::total_cmp);
        steady.sort_by(f64::total_cmp);
        let prompt: usize = records.iter().map(|r| r.prompt_tokens).sum();
        let cached: usize = records.iter().map(|r| r.cached_tokens).sum();
        let span = match (
            records.iter().map(|r| r.arrival).min(),
            records.iter().map(|r| r.finish).max(),
        ) {
            (Some(start), Some(end)) if end > start => (end - start) as f64 / MICROS_PER_SECOND,
            _ => 0.0,
        };
        let routed = &outcome.routed_per_rank;
        let mean = routed.iter().sum::<u64>() as f64 / routed.len().max(1) as f64;
        let max = routed.iter().copied().max().unwrap_or(0) as f64;
        Self {
            policy: policy.into(),
            requests: records.len(),
            ttft_mean_ms: if ttfts.is_empty() {
                0.0
            } else {
                ttfts.iter().sum::<f64>() / ttfts.len() as f64
            },
            ttft_p50_ms: percentile(&ttfts, 50.0),
            ttft_p99_ms: percentile(&ttfts, 99.0),
            steady_ttft_p50_ms: percentile(&steady, 50.0),
            hit_rate: if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            },
            throughput_rps: if span > 0.0 { records.len() as f64 / span } else { 0.0 },
            max_mean_load: if mean > 0.0 { max / mean } else { 0.0 },
            errors: outcome.errors,
        }
    }
}

/// The results as an aligned text table.
pub fn table(rows: &[Summary]) -> String {
    let mut out = format!(
        "{:<22} {:>8} {:>10} {:>10} {:>10} {:>11} {:>6} {:>8} {:>8} {:>6}\n",
        "policy", "requests", "ttft_mean", "ttft_p50", "ttft_p99", "steady_p50", "hit", "req/s", "max/mean", "errors"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<22} {:>8} {:>10.0} {:>10.0} {:>10.0} {:>11.0} {:>6.3} {:>8.3} {:>8.2} {:>6}\n",
            r.policy,
            r.requests,
            r.ttft_mean_ms,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.steady_ttft_p50_ms,
            r.hit_rate,
            r.throughput_rps,
            r.max_mean_load,
            r.errors
        ));
    }
    out.push_str("(TTFT in ms; steady_p50 excludes the first request of each prefix group)\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            (percentile(&v, 50.0), percentile(&v, 99.0), percentile(&v, 100.0)),
            (50.0, 99.0, 100.0)
        );
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
