use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::*;
use crate::tokens;
use crate::workload::agentic::PlanWorkload;
use crate::workload::{SimRequest, Workload};

/// Runs `plan` closed loop with every request taking 1 s: its requests in arrival order.
fn drive(plan: Plan, seed: u64) -> Vec<SimRequest> {
    let mut w = PlanWorkload::new(plan, seed, "agentic").unwrap();
    let mut queue = BinaryHeap::new();
    let mut held = HashMap::new();
    while let Some(r) = w.next_arrival() {
        queue.push(Reverse((r.arrival, r.id)));
        held.insert(r.id, r);
    }
    let mut sent = Vec::new();
    while let Some(Reverse((_, id))) = queue.pop() {
        let r = held.remove(&id).unwrap();
        let output = tokens::output(seed, r.id, r.output_tokens as usize);
        for next in w.on_finish(&r, &output, r.arrival + 1_000_000) {
            queue.push(Reverse((next.arrival, next.id)));
            held.insert(next.id, next);
        }
        sent.push(r);
    }
    sent
}

#[test]
fn the_plan_matches_its_parameters() {
    let config = AgenticConfig {
        programs: 400,
        turns: 30.0,
        fork_p: 0.1,
        ..AgenticConfig::default()
    };
    let plan = plan(&config, 3).unwrap();
    let main: Vec<&Step> = plan.steps.iter().filter(|s| s.session < config.programs).collect();
    let mean_turns = main.len() as f64 / config.programs as f64;
    assert!((mean_turns / config.turns - 1.0).abs() < 0.1, "mean turns {mean_turns}");
    let most = (0..config.programs)
        .map(|p| main.iter().filter(|s| s.session == p).count())
        .max()
        .unwrap();
    assert!(most > 90, "a long tail of sessions: the longest has {most} turns");
    // Tool waits: the steps after a tool call (one parent, a continued conversation, not a fork's first step).
    let waits: Vec<f64> = plan
        .steps
        .iter()
        .filter(|s| s.after.len() == 1 && s.continues.is_some())
        .map(|s| s.wait as f64 / 1e6)
        .collect();
    let share = |limit: f64| waits.iter().filter(|&&w| w < limit).count() as f64 / waits.len() as f64;
    assert!((share(1.0) - 0.86).abs() < 0.02, "under 1 s: {}", share(1.0));
    assert!((share(10.0) - 0.95).abs() < 0.015, "under 10 s: {}", share(10.0));
    assert!(waits.iter().all(|&w| (0.05..=60.0).contains(&w)));
    // Forks: a share fork_p of the main turns after the first joins subagents.
    let joins = main.iter().filter(|s| s.after.len() > 1).count();
    let later_turns = main.len() - config.programs as usize;
    assert!(
        (joins as f64 / later_turns as f64 - 0.1).abs() < 0.015,
        "{joins} joins of {later_turns}"
    );
    let subagents = plan
        .steps
        .iter()
        .filter(|s| s.session >= config.programs && s.continues.is_none())
        .count();
    let per_fork = subagents as f64 / joins as f64;
    assert!(
        (per_fork - 2.5).abs() < 0.2,
        "{per_fork} subagents per fork (uniform in 1..=4)"
    );
    // Programs start as a Poisson process of `rate`.
    let starts: Vec<Micros> = plan
        .steps
        .iter()
        .filter(|s| s.after.is_empty())
        .map(|s| s.wait)
        .collect();
    assert_eq!(starts.len() as u64, config.programs);
    let span = (starts.last().unwrap() - starts[0]) as f64 / 1e6;
    assert!(
        (span / (config.programs - 1) as f64 * config.rate - 1.0).abs() < 0.15,
        "{span} s"
    );
}

#[test]
fn programs_share_their_apps_prefix_grow_by_each_answer_and_compact_at_the_limit() {
    let config = AgenticConfig {
        programs: 6,
        apps: 2,
        turns: 60.0,
        turns_sigma: 0.0,
        app_prefix_len: 1_000,
        fork_p: 0.2,
        context_limit: 12_000,
        ..AgenticConfig::default()
    };
    let sent = drive(plan(&config, 5).unwrap(), 5);
    let firsts: Vec<&SimRequest> = (0..6).map(|p| sent.iter().find(|r| r.session == p).unwrap()).collect();
    assert_eq!(
        firsts[0].tokens[..1_000],
        firsts[2].tokens[..1_000],
        "programs 0 and 2 are app 0's"
    );
    assert_ne!(
        firsts[0].tokens[..1_000],
        firsts[1].tokens[..1_000],
        "program 1 is app 1's"
    );
    assert!(sent.iter().all(|r| r.tokens.len() + r.output_tokens as usize <= 12_000));
    assert!(sent.iter().all(|r| r.named_session));
    let main0: Vec<&SimRequest> = sent.iter().filter(|r| r.session == 0).collect();
    assert_eq!(main0.len(), 60);
    let mut compactions = 0;
    for pair in main0.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let conversation = [&a.tokens[..], &tokens::output(5, a.id, a.output_tokens as usize)].concat();
        if b.tokens.starts_with(&conversation) {
            assert!(b.arrival >= a.arrival + 1_000_000, "sent after the answer");
        } else {
            compactions += 1;
            assert_eq!(
                b.tokens[..1_000],
                a.tokens[..1_000],
                "compacted back to the app's prefix"
            );
        }
    }
    assert!(compactions >= 1, "60 turns of ~700 tokens outgrow 12,000");
    assert!(sent.iter().any(|r| r.session >= 6), "subagents ran");
    assert_eq!(sent.len(), plan(&config, 5).unwrap().steps.len(), "every step was sent");
}

#[test]
fn a_fanout_past_what_a_steps_parts_can_number_is_an_error() {
    let config = |fanout| AgenticConfig {
        fanout,
        ..AgenticConfig::default()
    };
    assert!(config(254).check().is_ok());
    let err = config(255).check().unwrap_err().to_string();
    assert!(err.contains("fanout must be at most 254"), "{err}");
}
