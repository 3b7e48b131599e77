//! `dprouter simulate`: each policy on the identical workload over simulated DP ranks, in virtual time.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use dprouter_core::PolicyConfig;
use dprouter_sim::report::table;
use dprouter_sim::{simulate, SimConfig, Summary, WorkloadSpec};
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
    /// Comma-separated policies to compare (default: all).
    #[arg(long, value_delimiter = ',', value_parser = parse_policy)]
    policy: Vec<PolicyConfig>,
    #[command(flatten)]
    cost: CostArgs,
    /// Interval of engine load reports to the router, milliseconds.
    #[arg(long, default_value_t = 20.0)]
    report_interval_ms: f64,
    /// Seed of the synthetic tokens (and any random arrivals).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn parse_workload(spec: &str) -> Result<WorkloadSpec, String> {
    WorkloadSpec::parse(spec).map_err(|e| e.to_string())
}

pub fn run(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    let cost = args.cost.model()?;
    let config = SimConfig {
        dp_size: args.dp_size,
        cost,
        report_interval: (args.report_interval_ms.max(0.0) * 1000.0) as u64,
        seed: args.seed,
    };
    let policies = if args.policy.is_empty() {
        PolicyConfig::NAMES
            .iter()
            .map(|n| PolicyConfig::from_name(n))
            .collect::<Result<Vec<_>, _>>()?
    } else {
        args.policy.clone()
    };
    let mut rows = Vec::new();
    for policy in &policies {
        let bar = ProgressBar::new_spinner().with_message(format!("simulating {}", policy.name()));
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
            "{}: {} requests simulated in {:.2} s",
            policy.name(),
            outcome.records.len(),
            started.elapsed().as_secs_f64()
        );
        rows.push(Summary::new(policy.name(), &outcome));
    }
    println!(
        "workload {}, dp {}, preset {}",
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
            "results": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}
