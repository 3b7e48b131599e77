//! The simulator's tests, from inside the module.

use super::*;
use crate::cost::CostModel;
use crate::report::Summary;
use crate::workload::agent::{AgentConfig, AgentWorkload};
use crate::workload::groups::{GroupsConfig, GroupsWorkload};
use dprouter_core::PolicyConfig;

fn config(dp: u32, preset: &str) -> SimConfig {
    SimConfig {
        dp_size: dp,
        cost: CostModel::preset(preset).unwrap(),
        report_interval: 20_000,
        seed: 0,
        removal: None,
        kv_events: None,
    }
}

fn run(policy: &str, workload: &mut dyn Workload, config: &SimConfig) -> SimOutcome {
    let policy = PolicyConfig::from_name(policy).unwrap().build();
    simulate(policy.as_ref(), workload, config, &mut |_| {}).unwrap()
}

fn agents_workload(config: AgentConfig) -> AgentWorkload {
    AgentWorkload::new(config, 0).unwrap()
}

#[test]
fn prefill_stalling_decode_reproduces_the_seeds_four_agents() {
    // The seed measured 0.41 requests/s for four agents on one prefix under prefix_match.
    let four = || {
        agents_workload(AgentConfig {
            agents: 4,
            ..AgentConfig::default()
        })
    };
    let mut coupled = config(16, "seed-moe");
    assert!(coupled.cost.prefill_stalls_decode);
    let with = Summary::new("p", &run("prefix_match", &mut four(), &coupled)).throughput_rps;
    coupled.cost.prefill_stalls_decode = false;
    let without = Summary::new("p", &run("prefix_match", &mut four(), &coupled)).throughput_rps;
    assert!((with - 0.41).abs() < 0.02, "{with} req/s");
    assert!(without > 0.55, "{without} req/s");
}

#[test]
fn contending_prefills_slow_the_policies_that_spread_them() {
    let four = || {
        agents_workload(AgentConfig {
            agents: 4,
            ..AgentConfig::default()
        })
    };
    let mut shared = config(16, "seed-moe");
    let rps = |policy, c: &SimConfig| Summary::new("p", &run(policy, &mut four(), c)).throughput_rps;
    let (spread, gathered) = (rps("round_robin", &shared), rps("prefix_match", &shared));
    shared.cost.prefill_contention = 1.0;
    // round_robin's prefills overlap on different ranks and now share one pool; prefix_match's never overlap.
    assert!(rps("round_robin", &shared) < 0.6 * spread);
    assert_eq!(rps("prefix_match", &shared), gathered);
}

#[test]
fn seed_agent_is_cold_once_then_warm_with_prefix_match() {
    let out = run(
        "prefix_match",
        &mut agents_workload(AgentConfig::default()),
        &config(16, "seed-moe"),
    );
    let mut records = out.records.clone();
    records.sort_by_key(|r| r.arrival);
    assert_eq!(records.len(), 30);
    let first = records[0].ttft() as f64 / 1e6;
    assert!((first - 7.45).abs() < 0.1, "cold TTFT {first}");
    let s = Summary::new("prefix_match", &out);
    assert!(
        (s.steady_ttft_p50_ms - 1290.0).abs() < 10.0,
        "steady p50 {}",
        s.steady_ttft_p50_ms
    );
}

#[test]
fn round_robin_is_cold_on_every_new_rank() {
    let workload = AgentConfig {
        turns: 16,
        ..AgentConfig::default()
    };
    let out = run("round_robin", &mut agents_workload(workload), &config(16, "seed-moe"));
    assert!(
        out.records.iter().all(|r| r.cached_tokens == 0),
        "16 turns over 16 ranks never meet a warm rank"
    );
    assert_eq!(out.routed_per_rank, vec![1; 16]);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
    #[test]
    fn every_request_completes_and_no_load_leaks(
        groups in 1u64..6, per_group in 1u64..6, system_len in 0usize..3000, rate in 0.0f64..200.0,
        dp in 1u32..6, kv in 500usize..20_000, agents in 1u64..5, turns in 1u32..4,
    ) {
        let mut cfg = config(dp, "h100-8b");
        cfg.cost.kv_capacity = kv;
        let g = GroupsConfig { groups, prompts_per_group: per_group, system_len, rate, ..GroupsConfig::default() };
        let a = AgentConfig { agents, prefixes: 2, prefix_len: system_len, turns, ..AgentConfig::default() };
        for policy in PolicyConfig::NAMES {
            for (expected, out) in [
                (groups * per_group, run(policy, &mut GroupsWorkload::new(g.clone(), 1).unwrap(), &cfg)),
                (agents * u64::from(turns), run(policy, &mut agents_workload(a.clone()), &cfg)),
            ] {
                proptest::prop_assert_eq!(
                    (out.records.len() as u64, out.errors, out.in_flight_at_end, out.queued_prefill_at_end),
                    (expected, 0, 0, 0)
                );
                // The oracle may undercount by less than one of its blocks per request.
                let s = Summary::new(policy, &out);
                let prompt: usize = out.records.iter().map(|r| r.prompt_tokens).sum();
                let slack = (crate::oracle::BLOCK * out.records.len()) as f64 / prompt.max(1) as f64;
                let oracle = out.oracle_hit_rate.unwrap();
                proptest::prop_assert!(s.hit_rate <= oracle + slack, "{} hit {} > oracle {}", policy, s.hit_rate, oracle);
                proptest::prop_assert_eq!(out.routed_per_rank.iter().sum::<u64>(), expected);
                for r in &out.records {
                    proptest::prop_assert!(r.cached_tokens < r.prompt_tokens.max(1));
                    proptest::prop_assert!(r.arrival <= r.first_token && r.first_token <= r.finish);
                }
            }
        }
    }
}

#[test]
fn a_removed_rank_moves_every_prefix_for_prefix_match_but_only_its_own_for_prefix_affinity() {
    let groups = GroupsConfig {
        groups: 200,
        prompts_per_group: 8,
        system_len: 1024,
        question_len: 64,
        output_tokens: 8,
        rate: 200.0,
    };
    // No cost, so no load: every move is the removal's, none a load spill.
    let moved = |policy: &str, mode: RemovalMode| {
        let mut cfg = config(8, "zero");
        cfg.removal = Some(RankRemoval {
            rank: 3,
            at: 4_000_000,
            mode,
        });
        let out = run(policy, &mut GroupsWorkload::new(groups.clone(), 1).unwrap(), &cfg);
        assert_eq!((out.errors, out.records.len()), (0, 1600));
        if mode != RemovalMode::Control {
            assert!(out.records.iter().all(|r| r.rank != 3 || r.arrival < 4_000_000));
        }
        Summary::new(policy, &out).moved_groups.unwrap()
    };
    // Marked down, prefix_match moves only rank 3's keys (to rank 4); dropped, `% 7` moves nearly all.
    assert_eq!(moved("prefix_match", RemovalMode::Control), 0.0);
    assert!(moved("prefix_match", RemovalMode::Down) < 0.25);
    assert!(moved("prefix_match", RemovalMode::Drop) > 0.75);
    assert!(moved("prefix_affinity", RemovalMode::Drop) < 0.25);
    assert!(moved("cache_aware", RemovalMode::Drop) < 0.25);
}

#[test]
fn the_oracle_bounds_every_policy_and_matches_the_seed_workload() {
    let out = run(
        "round_robin",
        &mut agents_workload(AgentConfig::default()),
        &config(16, "seed-moe"),
    );
    // One infinite cache misses only the first prompt and the new user turns.
    let oracle = out.oracle_hit_rate.unwrap();
    assert!((oracle - 0.966).abs() < 0.001, "{oracle}");
    assert!(Summary::new("round_robin", &out).hit_rate < oracle);
}

#[test]
fn unroutable_requests_are_counted_as_errors() {
    let mut cfg = config(4, "zero");
    cfg.dp_size = 0;
    let out = run(
        "round_robin",
        &mut agents_workload(AgentConfig {
            agents: 3,
            ..AgentConfig::default()
        }),
        &cfg,
    );
    assert_eq!((out.records.len(), out.errors, out.in_flight_at_end), (0, 3, 0));
}

#[test]
fn identical_inputs_give_identical_runs() {
    let workload = AgentConfig {
        agents: 6,
        prefixes: 2,
        prefix_len: 3000,
        turns: 5,
        ..AgentConfig::default()
    };
    let a = run(
        "total_tokens",
        &mut agents_workload(workload.clone()),
        &config(4, "h100-8b"),
    );
    let b = run("total_tokens", &mut agents_workload(workload), &config(4, "h100-8b"));
    assert_eq!(a.records, b.records);
}

#[test]
fn a_small_cache_forgets_and_capacity_holds() {
    // Two agents with distinct 3000-token prefixes on one rank that holds only 4000 tokens: they evict each other.
    let workload = AgentConfig {
        agents: 2,
        prefixes: 2,
        prefix_len: 3000,
        turns: 4,
        ..AgentConfig::default()
    };
    let mut small = config(1, "h100-8b");
    small.cost.kv_capacity = 4000;
    let out = run("round_robin", &mut agents_workload(workload.clone()), &small);
    let big = run("round_robin", &mut agents_workload(workload), &config(1, "h100-8b"));
    let hit = |o: &SimOutcome| Summary::new("x", o).hit_rate;
    assert!(hit(&out) < hit(&big), "{} vs {}", hit(&out), hit(&big));
}

fn run_disaggregated(
    prefill: &str,
    decode: &str,
    decode_ranks: u32,
    workload: &mut dyn Workload,
    config: &SimConfig,
) -> SimOutcome {
    let prefill = PolicyConfig::from_name(prefill).unwrap().build();
    let decode = PolicyConfig::from_name(decode).unwrap().build();
    let pool = DecodePool {
        ranks: decode_ranks,
        policies: &[decode.as_ref()],
    };
    simulate_disaggregated(&[prefill.as_ref()], pool, workload, config, &mut |_| {}).unwrap()
}

#[test]
fn the_first_token_waits_for_the_prefill_and_the_transfer() {
    let cfg = config(2, "h100-8b");
    let mut one = agents_workload(AgentConfig {
        agents: 1,
        turns: 1,
        ..AgentConfig::default()
    });
    let out = run_disaggregated("round_robin", "least_loaded", 2, &mut one, &cfg);
    let r = &out.records[0];
    let expected = cfg.cost.prefill(r.prompt_tokens) + cfg.cost.transfer(r.prompt_tokens);
    assert!(cfg.cost.transfer(r.prompt_tokens) > 0);
    assert_eq!((r.ttft(), r.floor), (expected, Some(expected)));
    assert_eq!(out.routed_per_decode_rank.iter().sum::<u64>(), 1);
}

#[test]
fn a_prefill_rank_caches_the_prompt_but_never_the_answer() {
    let workload = || {
        agents_workload(AgentConfig {
            agents: 1,
            turns: 2,
            ..AgentConfig::default()
        })
    };
    let cfg = config(1, "h100-8b");
    let sorted = |mut out: SimOutcome| {
        out.records.sort_by_key(|r| r.arrival);
        out.records
    };
    let aggregated = sorted(run("round_robin", &mut workload(), &cfg));
    let split = sorted(run_disaggregated(
        "round_robin",
        "least_loaded",
        1,
        &mut workload(),
        &cfg,
    ));
    // The second turn holds the first prompt, its answer and a new message: aggregated it finds the first two cached.
    assert_eq!(split[1].cached_tokens, split[0].prompt_tokens);
    assert!(aggregated[1].cached_tokens > split[1].cached_tokens);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(12))]
    #[test]
    fn disaggregated_runs_complete_and_release_both_legs(
        agents in 1u64..6, turns in 1u32..4, prefill_dp in 1u32..4, decode_dp in 1u32..5, kv in 2_000usize..20_000,
    ) {
        let mut cfg = config(prefill_dp, "h100-8b");
        cfg.cost.kv_capacity = kv;
        let a = AgentConfig { agents, prefixes: 2, prefix_len: 1500, turns, ..AgentConfig::default() };
        for (prefill, decode) in [("cache_aware", "least_loaded"), ("random", "random"), ("round_robin", "round_robin")] {
            let out = run_disaggregated(prefill, decode, decode_dp, &mut agents_workload(a.clone()), &cfg);
            let expected = agents * u64::from(turns);
            proptest::prop_assert_eq!(
                (out.records.len() as u64, out.errors, out.in_flight_at_end, out.queued_prefill_at_end),
                (expected, 0, 0, 0)
            );
            proptest::prop_assert_eq!(out.routed_per_decode_rank.len(), decode_dp as usize);
            proptest::prop_assert_eq!(out.routed_per_decode_rank.iter().sum::<u64>(), expected);
            proptest::prop_assert_eq!(out.routed_per_rank.iter().sum::<u64>(), expected);
        }
    }
}

#[test]
fn least_loaded_spreads_the_decode_legs_that_cache_aware_gathers_on_one_prefill_rank() {
    let workload = AgentConfig {
        agents: 8,
        prefixes: 1,
        prefix_len: 3000,
        turns: 4,
        ..AgentConfig::default()
    };
    let out = run_disaggregated(
        "cache_aware",
        "least_loaded",
        4,
        &mut agents_workload(workload),
        &config(4, "h100-8b"),
    );
    let s = Summary::new("x", &out);
    assert!(
        s.decode_max_mean_load.unwrap() <= 1.25,
        "{:?}",
        out.routed_per_decode_rank
    );
    assert!(s.hit_rate > 0.5, "{}", s.hit_rate);
}
