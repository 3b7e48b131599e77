//! `dprouter bench`: a workload over real HTTP against an engine or gateway, measuring TTFT from the streams,
//! optionally beside `simulate` on the same workload.
//!
//! Progress goes to stderr as in `simulate` (`--quiet` hides it). Ctrl-C stops the run cleanly: the driver sends no
//! more requests and abandons the ones in flight, and the command still prints (and writes with `--json` and
//! `--plot`) what completed, then exits with 130, the status shells expect after SIGINT. A second Ctrl-C quits at
//! once.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, ValueEnum};
use dprouter_bench::{Api, BenchConfig, BenchOutcome, Routing};
use dprouter_core::PolicyConfig;
use dprouter_sim::report::table;
use dprouter_sim::{simulate, SimConfig, Summary, WorkloadSpec};
use serde_json::json;
use tokio::sync::watch;

use crate::cost_args::CostArgs;
use crate::route::parse_policy;
use crate::simulate::{check_plot_path, progress_bar, write_plot};

/// The exit status after Ctrl-C: 128 + SIGINT, as shells report a command that SIGINT ended.
const INTERRUPTED: u8 = 130;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RouteBy {
    /// The bench routes with --policy and pins each request's rank (`routed_dp_rank`).
    Client,
    /// Requests go out unpinned; the target (a gateway, or the engine's own balancer) routes.
    Server,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ApiArg {
    /// SGLang's `POST /generate` with `input_ids`.
    Generate,
    /// `POST /v1/completions` with the token ids as `prompt`: any OpenAI-compatible server (vLLM, llama.cpp).
    Completions,
    /// `POST /v1/chat/completions` with one user message, a word per token id: any OpenAI-compatible server, through
    /// its chat template.
    Chat,
    /// Anthropic's `POST /v1/messages`, the same message: any Anthropic-compatible server (vLLM, SGLang, a gateway).
    Messages,
}

#[derive(Debug, Args)]
#[command(
    after_help = "Ctrl-C stops sending, abandons the requests in flight (not counted as errors), prints the \
results of the requests completed so far (and writes --json and --plot), says how many were cut off, and exits with \
status 130. A second Ctrl-C quits at once."
)]
pub struct BenchArgs {
    /// agent[:k=v,...], groups[:k=v,...] or trace:PATH[,...], as for `simulate`.
    #[arg(long, value_parser = |s: &str| WorkloadSpec::parse(s).map_err(|e| e.to_string()))]
    workload: WorkloadSpec,
    /// Base URL of the server under test (several, comma-separated, share the requests: gateway replicas); without
    /// it, an embedded mock engine is started for each policy.
    #[arg(long)]
    target: Option<String>,
    /// Who picks ranks.
    #[arg(long, value_enum, default_value = "client")]
    route: RouteBy,
    /// The API the requests use.
    #[arg(long, value_enum, default_value = "generate")]
    api: ApiArg,
    /// The `model` of completions and chat requests (vLLM wants the name it serves).
    #[arg(long, default_value = "default")]
    model: String,
    /// The model's vocabulary size, for completions: the workload's token ids are mapped into it (the workload's
    /// come from 151,936 ids; an engine refuses ids its model does not have).
    #[arg(long)]
    vocab: Option<u32>,
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
    /// Also draw the results as an SVG figure in this file: TTFT CDF, hit rates and each rank's share of the
    /// requests, for every row of the table.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Print only the results: no progress and no per-policy lines on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// Measure flow control under overload instead: the workload's sessions split into two tenants (10:1) and two
    /// priority bands, sent through an embedded gateway (the first --policy, default cache_aware) in front of the
    /// embedded engine three times: the high band alone, everything forwarded, everything through flow control
    /// (docs/bench.md, "Flow control under overload").
    #[arg(long, conflicts_with_all = ["target", "compare_sim", "plot"])]
    flow_control: bool,
    /// With --flow-control: how long a queued request waits for the endpoint holding its prefix while another has
    /// room (`[flow_control] prefix_wait_ms`; default the gateway's, 500).
    #[arg(long, requires = "flow_control")]
    prefix_wait_ms: Option<u64>,
    /// With --flow-control: the requests waiting for a first token that saturate an endpoint (`[flow_control]
    /// queue_depth_threshold`; default the gateway's, 5).
    #[arg(long, requires = "flow_control", value_parser = clap::value_parser!(u64).range(1..))]
    queue_depth_threshold: Option<u64>,
}

impl BenchArgs {
    /// Whether only the results are printed.
    pub fn quiet(&self) -> bool {
        self.quiet
    }

    fn api(&self) -> Api {
        match self.api {
            ApiArg::Generate => Api::Generate,
            ApiArg::Completions => Api::Completions {
                model: self.model.clone(),
                vocab: self.vocab,
            },
            ApiArg::Chat => Api::Chat {
                model: self.model.clone(),
            },
            ApiArg::Messages => Api::Messages {
                model: self.model.clone(),
            },
        }
    }
}

/// `--flow-control`: the three runs of [`crate::overload`], printed as one table (and written with `--json`).
fn flow_control(
    args: &BenchArgs,
    cost: dprouter_sim::CostModel,
    runtime: &tokio::runtime::Runtime,
    interrupt: watch::Receiver<bool>,
) -> anyhow::Result<ExitCode> {
    let setup = crate::overload::Setup {
        workload: &args.workload,
        seed: args.seed,
        dp_size: args.dp_size,
        cost,
        time_scale: args.time_scale,
        policy: match args.policy.first() {
            Some(p) => p.clone(),
            None => PolicyConfig::from_name("cache_aware")?,
        },
        api: args.api(),
        prefix_wait_ms: args.prefix_wait_ms,
        queue_depth_threshold: args.queue_depth_threshold,
    };
    // The bar of the run under way.
    let bar = std::cell::RefCell::new(indicatif::ProgressBar::hidden());
    let results = runtime.block_on(crate::overload::run(
        &setup,
        interrupt.clone(),
        &mut |name, expected| {
            bar.borrow().finish_and_clear();
            if let Ok(next) = progress_bar(&format!("{name} over HTTP"), expected, args.quiet) {
                *bar.borrow_mut() = next;
            }
        },
        &mut |done| bar.borrow().set_position(done as u64),
    ));
    bar.borrow().finish_and_clear();
    let results = results?;
    let heading = format!(
        "workload {}, dp {}, preset {}, time scale {}, policy {}, queue_depth_threshold {}, prefix_wait_ms {}; \
         tenants big:small 10:1, bands high:low 1:4 (times below are in the preset's time)",
        args.workload.name(),
        args.dp_size,
        args.cost.preset,
        args.time_scale,
        setup.policy.name(),
        setup.flow_config().queue_depth_threshold,
        setup.flow_config().prefix_wait_ms
    );
    println!("{heading}");
    print!("{}", crate::overload::table(&results));
    let interrupted = *interrupt.borrow();
    if interrupted {
        println!("interrupted by Ctrl-C: the runs not finished are left out");
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "workload": args.workload.name(),
            "dp_size": args.dp_size,
            "preset": args.cost.preset,
            "time_scale": args.time_scale,
            "policy": setup.policy.name(),
            "flow_control": setup.flow_config(),
            "results": results,
            "interrupted": interrupted,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(if interrupted {
        ExitCode::from(INTERRUPTED)
    } else {
        ExitCode::SUCCESS
    })
}

/// The flag that Ctrl-C (SIGINT) sets; a second Ctrl-C exits at once with [`INTERRUPTED`]. The handler is in place
/// when this returns.
fn watch_interrupt(runtime: &tokio::runtime::Runtime) -> anyhow::Result<watch::Receiver<bool>> {
    let (tx, rx) = watch::channel(false);
    #[cfg(unix)]
    let mut sigint = {
        let _entered = runtime.enter();
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).context("listening for Ctrl-C")?
    };
    runtime.spawn(async move {
        for count in 1.. {
            #[cfg(unix)]
            let received = sigint.recv().await.is_some();
            #[cfg(not(unix))]
            let received = tokio::signal::ctrl_c().await.is_ok();
            if !received {
                return;
            }
            if count == 1 {
                let _ = tx.send(true);
            } else {
                eprintln!("dprouter: interrupted again, quitting");
                std::process::exit(i32::from(INTERRUPTED));
            }
        }
    });
    Ok(rx)
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
    check_plot_path(args.plot.as_deref())?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let started = std::time::Instant::now();
    let interrupt = watch_interrupt(&runtime)?;
    if args.flow_control {
        return flow_control(&args, cost, &runtime, interrupt);
    }
    let mut rows = Vec::new();
    // The outcome behind each row, for --plot.
    let mut outcomes = Vec::new();
    let mut ratios = Vec::new();
    let mut cut_off = 0;
    let mut not_run = Vec::new();
    for policy in &policies {
        let name = policy.as_ref().map_or("server", |p| p.name());
        if *interrupt.borrow() {
            not_run.push(name);
            continue;
        }
        let built = policy.as_ref().map(|p| p.build());
        let routing = match &built {
            Some(p) => Routing::Client {
                policy: p.as_ref(),
                dp_size: args.dp_size,
            },
            None => Routing::Server,
        };
        let mut workload = args.workload.build(args.seed)?;
        let bar = progress_bar(&format!("{name} over HTTP"), workload.expected_requests(), args.quiet)?;
        let BenchOutcome {
            outcome,
            stopped,
            failures,
        } = runtime.block_on(async {
            let (target, engine_stop) = match &args.target {
                Some(t) => (t.clone(), None),
                None => {
                    let (addr, stop, _) =
                        crate::overload::embedded_engine(args.dp_size, cost, args.time_scale, args.seed).await?;
                    (format!("http://{addr}"), Some(stop))
                }
            };
            let config = BenchConfig {
                target,
                api: args.api(),
                seed: args.seed,
                time_scale: args.time_scale,
                routing,
                headers: None,
            };
            let outcome = dprouter_bench::run(workload.as_mut(), &config, interrupt.clone(), &mut |done| {
                bar.set_position(done as u64)
            })
            .await;
            drop(engine_stop);
            anyhow::Ok(outcome?)
        })?;
        bar.finish_and_clear();
        let http = Summary::new(&format!("http:{name}"), &outcome);
        if !args.quiet {
            eprintln!(
                "{name}: {} requests over HTTP, {} errors{}",
                outcome.records.len(),
                outcome.errors,
                stopped.map_or(String::new(), |s| format!(", {} cut off by Ctrl-C", s.cut_off))
            );
            // Why the first few failed (the rest are most often the same).
            for f in failures.iter().take(3) {
                let status = f.status.map_or(String::new(), |s| format!(" (status {s})"));
                eprintln!("  request {} failed{status}: {}", f.id, f.message);
            }
        }
        rows.push(http);
        outcomes.push(outcome);
        if let Some(s) = stopped {
            // A partial run compares with no simulation of the whole workload.
            cut_off += s.cut_off;
            continue;
        }
        if let (true, Some(p)) = (args.compare_sim, &built) {
            let sim_config = SimConfig {
                dp_size: args.dp_size,
                cost,
                report_interval: 20_000,
                seed: args.seed,
                removal: None,
                kv_events: None,
            };
            let mut workload = args.workload.build(args.seed)?;
            let bar = progress_bar(&format!("simulating {name}"), workload.expected_requests(), args.quiet)?;
            let sim = simulate(p.as_ref(), workload.as_mut(), &sim_config, &mut |done| {
                bar.set_position(done as u64)
            })?;
            bar.finish_and_clear();
            let summary = Summary::new(&format!("sim:{name}"), &sim);
            let http_mean = rows.last().map_or(0.0, |r: &Summary| r.ttft_mean_ms);
            ratios.push((name.to_string(), http_mean / summary.ttft_mean_ms.max(1e-9)));
            rows.push(summary);
            outcomes.push(sim);
        }
    }
    let interrupted = interrupt.borrow().then(|| started.elapsed().as_secs_f64());
    let heading = format!(
        "workload {}, dp {}, preset {}, time scale {} (times below are in the preset's time)",
        args.workload.name(),
        args.dp_size,
        args.cost.preset,
        args.time_scale
    );
    println!("{heading}");
    print!("{}", table(&rows));
    for (name, ratio) in &ratios {
        println!("{name}: mean TTFT over HTTP / simulated = {ratio:.3}");
    }
    if let Some(after) = interrupted {
        println!(
            "interrupted by Ctrl-C after {after:.1} s: the rows above count the requests completed before it; \
             requests in flight cut off (not counted): {cut_off}{}",
            if not_run.is_empty() {
                String::new()
            } else {
                format!("; not run: {}", not_run.join(", "))
            }
        );
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "workload": args.workload.name(),
            "dp_size": args.dp_size,
            "preset": args.cost.preset,
            "time_scale": args.time_scale,
            "results": rows,
            "http_over_sim_ttft_mean": ratios.iter().map(|(n, r)| json!({"policy": n, "ratio": r})).collect::<Vec<_>>(),
            "interrupted": interrupted.map(|after| json!({"after_s": after, "cut_off": cut_off, "not_run": not_run})),
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let runs: Vec<_> = rows.iter().zip(&outcomes).collect();
        write_plot(path, &heading, &runs)?;
    }
    Ok(if interrupted.is_some() {
        ExitCode::from(INTERRUPTED)
    } else {
        ExitCode::SUCCESS
    })
}
