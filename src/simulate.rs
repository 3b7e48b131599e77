//! `dprouter simulate`: each policy on the identical workload over simulated DP ranks, in virtual time.
//!
//! `cache_aware` learns each rank's prefill costs from its requests, as on a real engine (`learn_costs=false`: it is
//! given the preset's prefill rate and base instead, as an operator would set them from the engine's measured
//! costs); each simulated endpoint reports the preset's KV capacity.
//!
//! Progress (requests done of the workload's expected count, elapsed time, ETA) goes to stderr while a terminal is
//! there to see it; `--quiet` hides it and the per-policy timing lines. `--plot` draws the run as one SVG figure
//! ([`dprouter_bench::plot`]).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use dprouter_bench::plot::{self, PolicyPlot};
use dprouter_core::PolicyConfig;
use dprouter_sim::report::table;
use dprouter_sim::{
    simulate_disaggregated, simulate_replicas, CostModel, DecodePool, RankRemoval, RemovalMode, SimConfig, SimOutcome,
    Summary, WorkloadSpec,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

use crate::cost_args::CostArgs;
use crate::route::parse_policy;

#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// agent[:k=v,...], groups[:k=v,...] or trace:PATH[,speedup=X,limit=N] (see docs/simulator.md).
    #[arg(long, value_parser = parse_workload)]
    workload: WorkloadSpec,
    /// Number of data-parallel ranks (with --decode-ranks, the prefill ranks).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    dp_size: u32,
    /// Prefill/decode disaggregation: this many decode ranks on servers of their own; each --policy then routes the
    /// prefill legs, and --decode-policy the decode legs (docs/disaggregation.md).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    decode_ranks: Option<u32>,
    /// With --decode-ranks: the decode legs' policy, one for every --policy or one each, in the same order
    /// (default least_loaded).
    #[arg(long, value_parser = parse_policies, requires = "decode_ranks")]
    decode_policy: Vec<Vec<String>>,
    /// Policies to compare, separated by `;` or repeated (default: all but least_loaded, the decode servers' policy
    /// under disaggregation); each `NAME` or `NAME:key=value,...`.
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
    /// Precise mode: also run `cache_aware` (as `cache_aware+events`) with the ranks' KV cache events reaching it
    /// this long after each cache change, and print each one's prediction error.
    #[arg(long, value_name = "MS")]
    kv_events_delay_ms: Option<f64>,
    /// Route with this many gateway replicas, each with its own policy and in-flight counts (request i goes to
    /// replica i mod N); engine load reports and KV events reach them all.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    replicas: u32,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the results as an SVG figure in this file: TTFT CDF, hit rates (with the oracle) and each rank's
    /// share of the requests, for every policy.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Print only the results: no progress and no per-policy timing lines on stderr.
    #[arg(long, short)]
    quiet: bool,
}

/// A progress bar on stderr for `message`: requests done of `expected` with elapsed time and ETA, or a spinner with
/// the count when the total is unknown. Hidden when `quiet` or when stderr is not a terminal.
pub(crate) fn progress_bar(message: &str, expected: Option<u64>, quiet: bool) -> anyhow::Result<ProgressBar> {
    if quiet {
        return Ok(ProgressBar::hidden());
    }
    let bar = match expected {
        Some(total) => ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr()).with_style(
            ProgressStyle::with_template(
                "{msg} [{bar:30}] {pos}/{len} requests, {elapsed_precise} elapsed, ETA {eta_precise}",
            )?
            .progress_chars("=> "),
        ),
        None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()).with_style(
            ProgressStyle::with_template("{spinner} {msg}: {pos} requests done, {elapsed_precise} elapsed")?,
        ),
    };
    bar.set_message(message.to_owned());
    bar.enable_steady_tick(Duration::from_millis(200));
    Ok(bar)
}

/// Fails before a long run when `--plot`'s file cannot be created (an existing file is left as it is until the end).
pub(crate) fn check_plot_path(path: Option<&std::path::Path>) -> anyhow::Result<()> {
    if let Some(path) = path {
        // Its folder is made if missing, as `-o DIR/FILE` does for most tools.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot make the folder {}", dir.display()))?;
        }
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("cannot write the chart to {}", path.display()))?;
    }
    Ok(())
}

/// Writes `--plot`'s figure of `runs` (each row's summary and outcome).
pub(crate) fn write_plot(path: &std::path::Path, title: &str, runs: &[(&Summary, &SimOutcome)]) -> anyhow::Result<()> {
    let policies: Vec<PolicyPlot<'_>> = runs
        .iter()
        .map(|(summary, outcome)| PolicyPlot {
            name: &summary.policy,
            outcome,
            hit_rate: summary.hit_rate,
            oracle_hit_rate: summary.oracle_hit_rate,
        })
        .collect();
    Ok(plot::write(path, title, &policies)?)
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

/// The policy of `spec`. `cache_aware` learns each rank's prefill costs from its requests (`learn_costs`, the
/// default), so it starts from its own defaults as on a real engine; with `learn_costs=false` it is given the
/// preset's prefill rate and base, as an operator would set them from the engine's measured costs, unless the spec
/// sets them. Either way it is given the preset's `prefill_contention` unless the spec sets it (no fit learns that).
fn build_config(spec: &str, cost: &CostModel) -> anyhow::Result<PolicyConfig> {
    let mut obj = PolicyConfig::spec_object(spec)?;
    if obj.get("policy").and_then(|p| p.as_str()) == Some("cache_aware") {
        let learns = obj.get("learn_costs").and_then(|l| l.as_bool()) != Some(false);
        // A cost-free engine (preset `zero`) has no prefill rate to copy: cache_aware needs a positive one, so it
        // keeps its default.
        if !learns {
            if cost.prefill_tokens_per_s > 0.0 && cost.prefill_tokens_per_s.is_finite() {
                obj.entry("prefill_tokens_per_s")
                    .or_insert(cost.prefill_tokens_per_s.into());
            }
            obj.entry("base_ms").or_insert((cost.base_s * 1000.0).into());
        }
        obj.entry("prefill_contention")
            .or_insert(cost.prefill_contention.into());
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
        kv_events: None,
    };
    if let Some(ms) = args.kv_events_delay_ms {
        anyhow::ensure!(ms >= 0.0 && ms.is_finite(), "--kv-events-delay-ms must be >= 0");
    }
    let specs: Vec<String> = if args.policy.is_empty() {
        // `least_loaded` picks decode servers, which keep no prefix worth routing on: name it to compare it.
        // The peers' ports run when named.
        PolicyConfig::NAMES
            .iter()
            .filter(|&&n| n != "least_loaded" && n != "random" && !PolicyConfig::PEERS.contains(&n))
            .map(|n| (*n).to_owned())
            .collect()
    } else {
        args.policy.concat()
    };
    let decode_specs: Vec<String> = match args.decode_policy.concat() {
        none if none.is_empty() => vec!["least_loaded".to_owned(); specs.len()],
        one if one.len() == 1 => vec![one[0].clone(); specs.len()],
        each if each.len() == specs.len() => each,
        other => anyhow::bail!(
            "--decode-policy names {} policies for {} --policy: give one for all, or one each",
            other.len(),
            specs.len()
        ),
    };
    anyhow::ensure!(
        args.decode_ranks.is_none() || args.kv_events_delay_ms.is_none(),
        "--kv-events-delay-ms is not simulated with --decode-ranks yet"
    );
    check_plot_path(args.plot.as_deref())?;
    let mut rows = Vec::new();
    let mut outcomes = Vec::new();
    // Each policy as given; with --kv-events-delay-ms, each cache_aware again in precise mode.
    let mut runs: Vec<(String, PolicyConfig, SimConfig)> = Vec::new();
    let mut decode_policies = Vec::new();
    for (spec, decode_spec) in specs.iter().zip(&decode_specs) {
        let policy = build_config(spec, &cost)?;
        match args.decode_ranks {
            Some(_) => {
                decode_policies.push(build_config(decode_spec, &cost)?);
                runs.push((format!("{spec} / {decode_spec}"), policy.clone(), config.clone()));
            }
            None => runs.push((spec.clone(), policy.clone(), config.clone())),
        }
        if let (Some(ms), PolicyConfig::CacheAware(c)) = (args.kv_events_delay_ms, &policy) {
            let events = dprouter_sim::KvEventsConfig {
                delay: (ms * 1000.0) as u64,
                block_tokens: c.block_tokens,
            };
            let precise = SimConfig {
                kv_events: Some(events),
                ..config.clone()
            };
            runs.push((format!("{spec}+events"), policy, precise));
        }
    }
    for (i, (name, policy, config)) in runs.iter().enumerate() {
        let started = Instant::now();
        let mut workload = args.workload.build(args.seed)?;
        let bar = progress_bar(&format!("simulating {name}"), workload.expected_requests(), args.quiet)?;
        let built: Vec<Box<dyn dprouter_core::Policy>> = (0..args.replicas).map(|_| policy.build()).collect();
        let replicas: Vec<&dyn dprouter_core::Policy> = built.iter().map(|p| p.as_ref()).collect();
        let mut progress = |done: usize| bar.set_position(done as u64);
        let outcome = match args.decode_ranks {
            Some(ranks) => {
                let built: Vec<Box<dyn dprouter_core::Policy>> =
                    (0..args.replicas).map(|_| decode_policies[i].build()).collect();
                let policies: Vec<&dyn dprouter_core::Policy> = built.iter().map(|p| p.as_ref()).collect();
                let pool = DecodePool {
                    ranks,
                    policies: &policies,
                };
                simulate_disaggregated(&replicas, pool, workload.as_mut(), config, &mut progress)?
            }
            None => simulate_replicas(&replicas, workload.as_mut(), config, &mut progress)?,
        };
        bar.finish_and_clear();
        if !args.quiet {
            eprintln!(
                "{name}: {} requests simulated in {:.2} s",
                outcome.records.len(),
                started.elapsed().as_secs_f64()
            );
        }
        rows.push(Summary::new(name, &outcome));
        // Only the figure needs the records.
        if args.plot.is_some() {
            outcomes.push(outcome);
        }
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
    let replicas_note = match args.replicas {
        1 => String::new(),
        n => format!(", {n} gateway replicas"),
    };
    let ranks = match args.decode_ranks {
        Some(decode) => format!("{} prefill + {decode} decode ranks", args.dp_size),
        None => format!("dp {}", args.dp_size),
    };
    let heading = format!(
        "workload {}, {ranks}, preset {}{removal_note}{replicas_note}",
        args.workload.name(),
        args.cost.preset
    );
    println!("{heading}");
    print!("{}", table(&rows));
    if let Some(ms) = args.kv_events_delay_ms {
        let errors: Vec<String> = rows
            .iter()
            .filter_map(|r| Some(format!("{} {:.1}", r.policy, r.prediction_error?)))
            .collect();
        println!(
            "(KV events reach +events policies {ms} ms after each cache change; mean |predicted - cached| tokens: {})",
            errors.join(", ")
        );
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "workload": args.workload.name(),
            "dp_size": args.dp_size,
            "decode_ranks": args.decode_ranks,
            "preset": args.cost.preset,
            "cost": cost,
            "seed": args.seed,
            "removal": removal.map(|r| json!({"rank": r.rank, "at_s": r.at as f64 / 1e6, "mode": args.remove_mode})),
            "results": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let runs: Vec<_> = rows.iter().zip(&outcomes).collect();
        write_plot(path, &heading, &runs)?;
    }
    Ok(ExitCode::SUCCESS)
}
