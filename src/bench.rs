//! `dprouter bench`: a workload over real HTTP against an engine or gateway, measuring TTFT from the streams,
//! optionally beside `simulate` on the same workload.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, ValueEnum};
use dprouter_bench::{BenchConfig, Routing};
use dprouter_core::PolicyConfig;
use dprouter_mock_engine::{serve, Engine, EngineConfig};
use dprouter_sim::report::table;
use dprouter_sim::{simulate, SimConfig, Summary, WorkloadSpec};
use serde_json::json;

use crate::cost_args::CostArgs;
use crate::route::parse_policy;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RouteBy {
    /// The bench routes with --policy and pins each request's rank (`routed_dp_rank`).
    Client,
    /// Requests go out unpinned; the target (a gateway, or the engine's own balancer) routes.
    Server,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// agent[:k=v,...], groups[:k=v,...] or trace:PATH[,...], as for `simulate`.
    #[arg(long, value_parser = |s: &str| WorkloadSpec::parse(s).map_err(|e| e.to_string()))]
    workload: WorkloadSpec,
    /// Base URL of the server under test; without it, an embedded mock engine is started for each policy.
    #[arg(long)]
    target: Option<String>,
    /// Who picks ranks.
    #[arg(long, value_enum, default_value = "client")]
    route: RouteBy,
    /// Ranks of the embedded engine, and of client-side routing.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    dp_size: u32,
    /// Comma-separated policies for client-side routing (default: round_robin,prefix_match).
    #[arg(long, value_delimiter = ',', value_parser = parse_policy)]
    policy: Vec<PolicyConfig>,
    #[command(flatten)]
    cost: CostArgs,
    /// Real seconds per virtual second, for the embedded engine and the workload's clock.
    #[arg(long, default_value_t = 0.01)]
    time_scale: f64,
    /// Also simulate the same workload and print both, with the HTTP/simulated mean TTFT ratio.
    #[arg(long)]
    compare_sim: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.time_scale > 0.0 && args.time_scale.is_finite(),
        "--time-scale must be > 0"
    );
    let cost = args.cost.model()?;
    let policies = match (args.route, args.policy.is_empty()) {
        (RouteBy::Server, _) => vec![None],
        (RouteBy::Client, true) => vec![
            Some(PolicyConfig::from_name("round_robin")?),
            Some(PolicyConfig::from_name("prefix_match")?),
        ],
        (RouteBy::Client, false) => args.policy.iter().cloned().map(Some).collect(),
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    for policy in &policies {
        let name = policy.as_ref().map_or("server", |p| p.name());
        let built = policy.as_ref().map(|p| p.build());
        let routing = match &built {
            Some(p) => Routing::Client {
                policy: p.as_ref(),
                dp_size: args.dp_size,
            },
            None => Routing::Server,
        };
        let mut workload = args.workload.build(args.seed)?;
        let outcome = runtime.block_on(async {
            let (target, stop) = match &args.target {
                Some(t) => (t.clone(), None),
                None => {
                    let engine = Engine::new(EngineConfig {
                        dp_size: args.dp_size,
                        cost,
                        time_scale: args.time_scale,
                        seed: args.seed,
                        ..EngineConfig::default()
                    });
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                    let addr = listener.local_addr()?;
                    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                    tokio::spawn(serve(listener, Arc::clone(&engine), async {
                        let _ = stopped.await;
                    }));
                    (format!("http://{addr}"), Some(stop))
                }
            };
            let config = BenchConfig {
                target,
                time_scale: args.time_scale,
                routing,
            };
            let outcome = dprouter_bench::run(workload.as_mut(), &config).await;
            drop(stop);
            anyhow::Ok(outcome?)
        })?;
        let http = Summary::new(&format!("http:{name}"), &outcome);
        eprintln!(
            "{name}: {} requests over HTTP, {} errors",
            outcome.records.len(),
            outcome.errors
        );
        if args.compare_sim {
            if let Some(p) = &built {
                let sim_config = SimConfig {
                    dp_size: args.dp_size,
                    cost,
                    report_interval: 20_000,
                    seed: args.seed,
                    removal: None,
                };
                let mut workload = args.workload.build(args.seed)?;
                let sim = simulate(p.as_ref(), workload.as_mut(), &sim_config, &mut |_| {})?;
                let sim = Summary::new(&format!("sim:{name}"), &sim);
                ratios.push((name.to_string(), http.ttft_mean_ms / sim.ttft_mean_ms.max(1e-9)));
                rows.push(http);
                rows.push(sim);
                continue;
            }
        }
        rows.push(http);
    }
    println!(
        "workload {}, dp {}, preset {}, time scale {} (times below are in the preset's time)",
        args.workload.name(),
        args.dp_size,
        args.cost.preset,
        args.time_scale
    );
    print!("{}", table(&rows));
    for (name, ratio) in &ratios {
        println!("{name}: mean TTFT over HTTP / simulated = {ratio:.3}");
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "workload": args.workload.name(),
            "dp_size": args.dp_size,
            "preset": args.cost.preset,
            "time_scale": args.time_scale,
            "results": rows,
            "http_over_sim_ttft_mean": ratios.iter().map(|(n, r)| json!({"policy": n, "ratio": r})).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}
