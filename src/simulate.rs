//! `dprouter simulate`: each policy on the identical workload over simulated DP ranks, in virtual time.
//!
//! `cache_aware` is given the preset's prefill rate and base unless its spec sets them, as an operator would set
//! them from the engine's measured costs; each simulated endpoint reports the preset's KV capacity.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use dprouter_core::PolicyConfig;
use dprouter_sim::report::table;
use dprouter_sim::{simulate, CostModel, RankRemoval, RemovalMode, SimConfig, Summary, WorkloadSpec};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::cost_args::CostArgs;
use crate::route::parse_policy;

#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// agent[:k=v,...], groups[:k=v,...] or trace:PATH[,speedup=X,limit=N] (see the README).
    #[arg(long, value_parser = parse_workload)]
    workload: WorkloadSpec,
    /// Number of data-parallel ranks.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    dp_size: u32,
    /// Policies to compare, separated by `;` or repeated (default: all); each `NAME` or `NAME:key=value,...`.
    /// A plain comma-separated list of names also works.
    #[arg(long, value_parser = parse_policies)]
    policy: Vec<Vec<String>>,
    #[command(flatten)]
    cost: CostArgs,
    /// Interval of engine load reports to the router, milliseconds.
    #[arg(long, default_value_t = 20.0)]
    report_interval_ms: f64,
    /// Seed of the synthetic tokens (and any random arrivals).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Take rank R out of service at SECONDS of virtual time: R@SECONDS.
    #[arg(long, value_parser = parse_removal)]
    remove_rank: Option<(usize, f64)>,
    /// How the removed rank leaves: `down` (marked down in the snapshot), `drop` (dropped from it; the ranks after
    /// it are renumbered, as when an engine restarts with one rank fewer) or `control` (nothing removed: how often
    /// groups change rank at that time anyway).
    #[arg(long, default_value = "down", value_parser = ["down", "drop", "control"])]
    remove_mode: String,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// `a;b:k=v,x=y` or `a,b,c` (names only) into policy specs, each validated.
fn parse_policies(list: &str) -> Result<Vec<String>, String> {
    let names_only = !list.contains(':') && !list.contains(';');
    let specs: Vec<String> = if names_only {
        list.split(',').map(str::to_owned).collect()
    } else {
        list.split(';').map(str::to_owned).collect()
    };
    for spec in &specs {
        parse_policy(spec)?;
    }
    Ok(specs)
}

fn parse_removal(spec: &str) -> Result<(usize, f64), String> {
    let bad = || format!("`{spec}`: expected RANK@SECONDS, e.g. 3@60");
    let (rank, at) = spec.split_once('@').ok_or_else(bad)?;
    let at: f64 = at.parse().map_err(|_| bad())?;
    if !(at >= 0.0 && at.is_finite()) {
        return Err(bad());
    }
    Ok((rank.parse().map_err(|_| bad())?, at))
}

/// The policy of `spec`, with cache_aware's cost fields taken from `cost` unless the spec sets them.
fn build_config(spec: &str, cost: &CostModel) -> anyhow::Result<PolicyConfig> {
    let mut obj = PolicyConfig::spec_object(spec)?;
    if obj.get("policy").and_then(|p| p.as_str()) == Some("cache_aware") {
        obj.entry("prefill_tokens_per_s")
            .or_insert(cost.prefill_tokens_per_s.into());
        obj.entry("base_ms").or_insert((cost.base_s * 1000.0).into());
    }
    Ok(PolicyConfig::from_object(obj)?)
}

fn parse_workload(spec: &str) -> Result<WorkloadSpec, String> {
    WorkloadSpec::parse(spec).map_err(|e| e.to_string())
}

pub fn run(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    let cost = args.cost.model()?;
    let removal = args.remove_rank.map(|(rank, at)| RankRemoval {
        rank,
        at: dprouter_sim::cost::to_micros(at),
        mode: match args.remove_mode.as_str() {
            "drop" => RemovalMode::Drop,
            "control" => RemovalMode::Control,
            _ => RemovalMode::Down,
        },
    });
    if let Some(r) = removal {
        anyhow::ensure!(
            r.rank < args.dp_size as usize,
            "--remove-rank {} is out of range for --dp-size {}",
            r.rank,
            args.dp_size
        );
    }
    let config = SimConfig {
        dp_size: args.dp_size,
        cost,
        report_interval: (args.report_interval_ms.max(0.0) * 1000.0) as u64,
        seed: args.seed,
        removal,
    };
    let specs: Vec<String> = if args.policy.is_empty() {
        PolicyConfig::NAMES.iter().map(|n| (*n).to_owned()).collect()
    } else {
        args.policy.concat()
    };
    let mut rows = Vec::new();
    for spec in &specs {
        let policy = build_config(spec, &cost)?;
        let bar = ProgressBar::new_spinner().with_message(format!("simulating {spec}"));
        bar.set_style(ProgressStyle::with_template(
            "{spinner} {msg}: {pos} requests done ({elapsed})",
        )?);
        bar.enable_steady_tick(Duration::from_millis(200));
        let started = Instant::now();
        let mut workload = args.workload.build(args.seed)?;
        let outcome = simulate(policy.build().as_ref(), workload.as_mut(), &config, &mut |done| {
            bar.set_position(done as u64)
        })?;
        bar.finish_and_clear();
        eprintln!(
            "{spec}: {} requests simulated in {:.2} s",
            outcome.records.len(),
            started.elapsed().as_secs_f64()
        );
        rows.push(Summary::new(spec, &outcome));
    }
    let removal_note = removal.map_or(String::new(), |r| {
        format!(
            ", rank {} {} at {} s",
            r.rank,
            match r.mode {
                RemovalMode::Down => "down",
                RemovalMode::Drop => "dropped",
                RemovalMode::Control => "kept (control)",
            },
            r.at as f64 / 1e6
        )
    });
    println!(
        "workload {}, dp {}, preset {}{removal_note}",
        args.workload.name(),
        args.dp_size,
        args.cost.preset
    );
    print!("{}", table(&rows));
    if let Some(path) = &args.json {
        let doc = json!({
            "workload": args.workload.name(),
            "dp_size": args.dp_size,
            "preset": args.cost.preset,
            "cost": cost,
            "seed": args.seed,
            "removal": removal.map(|r| json!({"rank": r.rank, "at_s": r.at as f64 / 1e6, "mode": args.remove_mode})),
            "results": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}
