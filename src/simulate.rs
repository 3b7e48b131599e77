//! `dprouter simulate`: each policy on the identical workload over simulated DP ranks, in virtual time.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use dprouter_core::PolicyConfig;
use dprouter_sim::report::table;
use dprouter_sim::{simulate, CostModel, SimConfig, Summary, WorkloadSpec};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

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
    /// Engine cost preset: seed-moe, h100-8b or zero.
    #[arg(long, default_value = "h100-8b", value_parser = parse_preset)]
    preset: String,
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

fn parse_preset(name: &str) -> Result<String, String> {
    match CostModel::preset(name) {
        Some(_) => Ok(name.into()),
        None => Err(format!(
            "unknown preset `{name}`; expected one of: {}",
            CostModel::PRESETS.join(", ")
        )),
    }
}

impl SimulateArgs {
    fn cost(&self) -> anyhow::Result<CostModel> {
        let mut cost = CostModel::preset(&self.preset).context("unknown preset")?;
        if let Some(v) = self.kv_capacity {
            cost.kv_capacity = v;
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
        if let Some(v) = self.page_size {
            cost.page_size = usize::try_from(v).context("page size too large")?;
        }
        Ok(cost)
    }
}

pub fn run(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    let cost = args.cost()?;
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
        args.preset
    );
    print!("{}", table(&rows));
    if let Some(path) = &args.json {
        let doc = json!({
            "workload": args.workload.name(),
            "dp_size": args.dp_size,
            "preset": args.preset,
            "cost": cost,
            "seed": args.seed,
            "results": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}
