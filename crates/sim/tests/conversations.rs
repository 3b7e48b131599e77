//! `cache_aware`'s conversation forecast (`session_turns`) on agents that start apart (`seed-moe`, dp 16).

#![allow(clippy::unwrap_used)]

use dprouter_core::PolicyConfig;
use dprouter_sim::workload::agent::{AgentConfig, AgentWorkload};
use dprouter_sim::{simulate, CostModel, SimConfig, Summary};

/// Steady p99 TTFT (ms) and requests/s of `spec` on `agents` agents on one prefix, started `apart_s` apart.
fn agents_apart(agents: u64, apart_s: f64, spec: &str) -> (f64, f64) {
    let cost = CostModel::preset("seed-moe").unwrap();
    let config = SimConfig {
        dp_size: 16,
        cost,
        report_interval: 20_000,
        seed: 0,
        removal: None,
        kv_events: None,
    };
    let mut workload = AgentWorkload::new(
        AgentConfig {
            agents,
            stagger_s: apart_s,
            ..AgentConfig::default()
        },
        0,
    )
    .unwrap();
    // The preset's prefill cost, as `dprouter simulate` gives it to cache_aware.
    let spec = match spec.starts_with("cache_aware") {
        true => format!(
            "{spec},base_ms={},prefill_tokens_per_s={}",
            cost.base_s * 1000.0,
            cost.prefill_tokens_per_s
        ),
        false => spec.to_string(),
    };
    let policy = PolicyConfig::from_spec(&spec).unwrap().build();
    let out = simulate(policy.as_ref(), &mut workload, &config, &mut |_| {}).unwrap();
    let s = Summary::new(&spec, &out);
    (s.steady_ttft_p99_ms, s.throughput_rps)
}

#[test]
fn forecasting_conversations_spreads_agents_that_start_apart() {
    for agents in [4, 16] {
        let (gathered_p99, gathered_rps) = agents_apart(agents, 8.0, "prefix_match");
        let (greedy_p99, _) = agents_apart(agents, 8.0, "cache_aware:session_turns=0");
        let (forecast_p99, forecast_rps) = agents_apart(agents, 8.0, "cache_aware:session_turns=30");
        // Greedy, each newcomer waits for the rank that holds the prefix; forecasting, it pays one cold prefill
        // elsewhere and its later turns do not queue behind the others'.
        assert!(
            forecast_p99 <= 0.5 * gathered_p99,
            "{agents}: {forecast_p99} vs prefix_match {gathered_p99}"
        );
        assert!(
            forecast_p99 < 0.8 * greedy_p99,
            "{agents}: {forecast_p99} vs greedy {greedy_p99}"
        );
        assert!(
            forecast_rps >= gathered_rps,
            "{agents}: {forecast_rps} vs {gathered_rps} req/s"
        );
    }
}
