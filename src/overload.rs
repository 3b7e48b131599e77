//! `dprouter bench --flow-control`: what the gateway's flow control (`[flow_control]`) does under overload, measured
//! over HTTP on the same engines in one run.
//!
//! The workload's sessions (a `groups` workload's prefix groups, an `agent` workload's agents) are split among two
//! tenants and two priority bands, each request naming them as a client of the Gateway API Inference Extension
//! would, in `x-gateway-inference-fairness-id` and `x-gateway-inference-objective`:
//!
//! - tenant `small` owns session `s` when `s % 11 == 10`, tenant `big` the others (ten sessions in eleven, so it
//!   sends about ten times the small tenant's requests);
//! - band `high` (objective `interactive`, priority 1) takes session `s` when `s % 5 == 0`, band `low` (objective
//!   `batch`, priority 0) the others.
//!
//! Three runs follow, each through a fresh embedded gateway (`dprouter serve` in the process, with the policy given)
//! in front of a fresh embedded mock engine (the same engine config and seed each time):
//!
//! 1. `high alone`: the high band's requests only, forwarded: the high band's TTFT with the low band's load gone,
//!    the reference its TTFT under overload is held to;
//! 2. `forward`: every request, flow control off: the gateway forwards each at once and it waits in its rank's queue;
//! 3. `flow control`: every request, flow control on with its defaults: while every rank is saturated requests wait
//!    in the gateway's queue (strict priority between bands, tenants taking turns within one) and are routed when
//!    they leave it.
//!
//! For each run: the hit rate, the TTFT p50/p99 of every request, of the high band and of the small tenant, the
//! small tenant's share of the requests completed while the workload was still arriving (its share of the
//! throughput under overload, beside its share of the requests sent), and the requests refused (a 429 or 503).

use anyhow::Context;
use dprouter_bench::{Api, BenchConfig, BenchOutcome, Failure, Routing};
use dprouter_core::PolicyConfig;
use dprouter_gateway::config::flow::FlowControlConfig;
use dprouter_gateway::{serve, AppState, GatewayConfig};
use dprouter_mock_engine::{Engine, EngineConfig};
use dprouter_sim::{CostModel, SimOutcome, SimRequest, Summary, Workload, WorkloadSpec};
use serde::Serialize;
use std::net::SocketAddr;

use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// The tenant that owns session `session`.
pub fn tenant(session: u64) -> &'static str {
    if session % 11 == 10 {
        "small"
    } else {
        "big"
    }
}

/// The objective (priority band) of session `session`.
pub fn objective(session: u64) -> &'static str {
    if session.is_multiple_of(5) {
        "interactive"
    } else {
        "batch"
    }
}

/// The headers a request of `req`'s session carries.
fn tag(req: &SimRequest) -> Vec<(&'static str, String)> {
    vec![
        ("x-gateway-inference-fairness-id", tenant(req.session).to_string()),
        ("x-gateway-inference-objective", objective(req.session).to_string()),
    ]
}

/// The runs, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arm {
    HighAlone,
    Forward,
    FlowControl,
}

impl Arm {
    const ALL: [Arm; 3] = [Arm::HighAlone, Arm::Forward, Arm::FlowControl];

    fn name(self) -> &'static str {
        match self {
            Arm::HighAlone => "high alone",
            Arm::Forward => "forward",
            Arm::FlowControl => "flow control",
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct ArmResult {
    pub run: &'static str,
    pub sent: usize,
    pub completed: usize,
    /// Answered 429 or 503 (refused by the gateway's limits or its queue).
    pub refused: usize,
    /// Failed otherwise (a broken exchange, another status).
    pub failed: usize,
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub high_ttft_p50_ms: f64,
    pub high_ttft_p99_ms: f64,
    pub small_ttft_p50_ms: f64,
    pub small_ttft_p99_ms: f64,
    /// The small tenant's share of the requests sent.
    pub small_sent_share: f64,
    /// Its share of the requests completed before the last request arrived.
    pub small_throughput_share: f64,
    /// The high band's requests refused or failed.
    pub high_not_served: usize,
    /// The small tenant's requests refused or failed.
    pub small_not_served: usize,
}

/// The engine and gateway every run starts afresh.
pub struct Setup<'a> {
    pub workload: &'a WorkloadSpec,
    pub seed: u64,
    pub dp_size: u32,
    pub cost: CostModel,
    pub time_scale: f64,
    pub policy: PolicyConfig,
    pub api: Api,
    /// `[flow_control] prefix_wait_ms` of the flow control run; `None`: the gateway's default.
    pub prefix_wait_ms: Option<u64>,
    /// `[flow_control] queue_depth_threshold` of the flow control run; `None`: the gateway's default.
    pub queue_depth_threshold: Option<u64>,
}

impl Setup<'_> {
    /// The flow control run's `[flow_control]`: the gateway's defaults, with the objectives `interactive` (1) and
    /// `batch` (0), and the settings given.
    pub fn flow_config(&self) -> FlowControlConfig {
        let mut config = FlowControlConfig {
            enabled: true,
            objectives: [("interactive".to_string(), 1), ("batch".to_string(), 0)].into(),
            ..FlowControlConfig::default()
        };
        if let Some(ms) = self.prefix_wait_ms {
            config.prefix_wait_ms = ms;
        }
        if let Some(depth) = self.queue_depth_threshold {
            config.queue_depth_threshold = depth;
        }
        config
    }
}

/// Runs the three runs in order; `on_run` is told each run's name before it starts, `on_progress` the requests
/// finished so far within it. A stop signal ends the run under way early and skips the rest.
pub async fn run(
    setup: &Setup<'_>,
    stop: watch::Receiver<bool>,
    on_run: &mut dyn FnMut(&'static str, Option<u64>),
    on_progress: &mut dyn FnMut(usize),
) -> anyhow::Result<Vec<ArmResult>> {
    let mut results = Vec::new();
    for arm in Arm::ALL {
        if *stop.borrow() {
            break;
        }
        let mut workload: Box<dyn Workload> = setup.workload.build(setup.seed)?;
        if arm == Arm::HighAlone {
            workload = Box::new(HighBand(workload));
        }
        on_run(arm.name(), workload.expected_requests());
        let outcome = run_arm(setup, arm, workload.as_mut(), stop.clone(), on_progress).await?;
        if outcome.stopped.is_some() {
            break;
        }
        results.push(measure(arm, &outcome));
    }
    Ok(results)
}

/// One run: a fresh engine, a fresh gateway in front of it, the workload through the gateway.
async fn run_arm(
    setup: &Setup<'_>,
    arm: Arm,
    workload: &mut dyn Workload,
    stop: watch::Receiver<bool>,
    on_progress: &mut dyn FnMut(usize),
) -> anyhow::Result<BenchOutcome> {
    let (engine_addr, engine_stop, engine_task) =
        embedded_engine(setup.dp_size, setup.cost, setup.time_scale, setup.seed).await?;

    let mut config = GatewayConfig::from_toml(&format!(
        "[[workers]]\nurl = \"http://{engine_addr}\"\ndp_size = {}\n",
        setup.dp_size
    ))?;
    config.routing = setup.policy.clone();
    if arm == Arm::FlowControl {
        config.flow_control = setup.flow_config();
    }
    // Thousands of requests may be in flight at once when forwarded.
    config.server.max_in_flight = 8192;
    config.validate()?;
    let state = AppState::new(config).await.context("starting the embedded gateway")?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let gateway_addr = listener.local_addr()?;
    let (gateway_stop, gateway_stopped) = tokio::sync::oneshot::channel::<()>();
    let gateway_task = tokio::spawn(serve(listener, state, async {
        let _ = gateway_stopped.await;
    }));

    let config = BenchConfig {
        target: format!("http://{gateway_addr}"),
        api: setup.api.clone(),
        seed: setup.seed,
        time_scale: setup.time_scale,
        routing: Routing::Server,
        headers: Some(&tag),
    };
    let outcome = dprouter_bench::run(workload, &config, stop, on_progress).await;
    let _ = gateway_stop.send(());
    let _ = gateway_task.await;
    let _ = engine_stop.send(());
    let _ = engine_task.await;
    Ok(outcome?)
}

/// A mock engine of `dp_size` ranks on a free loopback port: its address, the sender that stops it, and its task.
pub async fn embedded_engine(
    dp_size: u32,
    cost: CostModel,
    time_scale: f64,
    seed: u64,
) -> std::io::Result<(SocketAddr, oneshot::Sender<()>, JoinHandle<std::io::Result<()>>)> {
    let engine = Engine::new(EngineConfig {
        dp_size,
        cost,
        time_scale,
        seed,
        ..EngineConfig::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(dprouter_mock_engine::serve(listener, engine, async {
        let _ = stopped.await;
    }));
    Ok((addr, stop, task))
}

/// A workload's high-band sessions only.
struct HighBand(Box<dyn Workload>);

impl Workload for HighBand {
    fn next_arrival(&mut self) -> Option<SimRequest> {
        loop {
            let req = self.0.next_arrival()?;
            if objective(req.session) == "interactive" {
                return Some(req);
            }
        }
    }

    fn on_finish(&mut self, finished: &SimRequest, output: &[u32], now: dprouter_sim::Micros) -> Vec<SimRequest> {
        self.0.on_finish(finished, output, now)
    }

    fn expected_requests(&self) -> Option<u64> {
        None
    }

    fn take_error(&mut self) -> Option<dprouter_sim::WorkloadError> {
        self.0.take_error()
    }
}

/// The figures of one run.
fn measure(arm: Arm, run: &BenchOutcome) -> ArmResult {
    let outcome = &run.outcome;
    let subset = |keep: &dyn Fn(u64) -> bool| SimOutcome {
        records: outcome.records.iter().filter(|r| keep(r.session)).cloned().collect(),
        routed_per_rank: outcome.routed_per_rank.clone(),
        ..SimOutcome::default()
    };
    let all = Summary::new(arm.name(), outcome);
    let high = Summary::new("high", &subset(&|s| objective(s) == "interactive"));
    let small = Summary::new("small", &subset(&|s| tenant(s) == "small"));
    let refused = |f: &&Failure| matches!(f.status, Some(429 | 503));
    let sent = outcome.records.len() + run.failures.len();
    let small_sent = outcome.records.iter().filter(|r| tenant(r.session) == "small").count()
        + run.failures.iter().filter(|f| tenant(f.session) == "small").count();
    // The requests completed while the workload was still arriving: the throughput under overload.
    let last_arrival = outcome.records.iter().map(|r| r.arrival).max().unwrap_or(0);
    let in_window: Vec<_> = outcome.records.iter().filter(|r| r.finish <= last_arrival).collect();
    let small_in_window = in_window.iter().filter(|r| tenant(r.session) == "small").count();
    let share = |part: usize, whole: usize| if whole == 0 { 0.0 } else { part as f64 / whole as f64 };
    ArmResult {
        run: arm.name(),
        sent,
        completed: outcome.records.len(),
        refused: run.failures.iter().filter(refused).count(),
        failed: run.failures.iter().filter(|f| !refused(f)).count(),
        hit_rate: all.hit_rate,
        ttft_p50_ms: all.ttft_p50_ms,
        ttft_p99_ms: all.ttft_p99_ms,
        high_ttft_p50_ms: high.ttft_p50_ms,
        high_ttft_p99_ms: high.ttft_p99_ms,
        small_ttft_p50_ms: small.ttft_p50_ms,
        small_ttft_p99_ms: small.ttft_p99_ms,
        small_sent_share: share(small_sent, sent),
        small_throughput_share: share(small_in_window, in_window.len()),
        high_not_served: run
            .failures
            .iter()
            .filter(|f| objective(f.session) == "interactive")
            .count(),
        small_not_served: run.failures.iter().filter(|f| tenant(f.session) == "small").count(),
    }
}

/// The results as a table, one row per run.
pub fn table(results: &[ArmResult]) -> String {
    let mut out = format!(
        "{:<13} {:>6} {:>6} {:>7} {:>6} {:>9} {:>9} {:>10} {:>10} {:>11} {:>11} {:>11} {:>12}\n",
        "run",
        "sent",
        "done",
        "refused",
        "hit",
        "ttft_p50",
        "ttft_p99",
        "high_p50",
        "high_p99",
        "small_p50",
        "small_p99",
        "small_sent",
        "small_served"
    );
    for r in results {
        out.push_str(&format!(
            "{:<13} {:>6} {:>6} {:>7} {:>6.3} {:>9.0} {:>9.0} {:>10.0} {:>10.0} {:>11.0} {:>11.0} {:>10.1}% {:>11.1}%\n",
            r.run,
            r.sent,
            r.completed,
            r.refused,
            r.hit_rate,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.high_ttft_p50_ms,
            r.high_ttft_p99_ms,
            r.small_ttft_p50_ms,
            r.small_ttft_p99_ms,
            100.0 * r.small_sent_share,
            100.0 * r.small_throughput_share
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_are_ten_to_one_and_bands_one_in_five() {
        let small = (0..1100).filter(|&s| tenant(s) == "small").count();
        let high = (0..1100).filter(|&s| objective(s) == "interactive").count();
        assert_eq!((small, high), (100, 220));
    }
}
