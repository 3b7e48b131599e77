//! The `dprouter` binary: one subcommand per job, each in its own module.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod alloc;
mod bench;
mod cost_args;
mod decode_sidecar;
#[cfg(feature = "epp")]
mod epp;
mod logging;
mod mock_engine;
mod overhead;
mod overload;
mod route;
mod serve;
mod simulate;

/// dprouter: a cache-aware data-parallel load balancer for LLM serving.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway (fronting an embedded mock engine when no worker is given).
    Serve(serve::ServeArgs),
    /// Pick endpoints for Envoy or a Gateway API implementation: an Endpoint Picker over ext_proc gRPC.
    #[cfg(feature = "epp")]
    Epp(Box<epp::EppArgs>),
    /// Route JSON Lines requests offline and print one decision per line.
    Route(Box<route::RouteArgs>),
    /// Compare policies on a workload over simulated DP ranks, in virtual time.
    Simulate(Box<simulate::SimulateArgs>),
    /// Run an SGLang-compatible engine over the simulator (no GPU), in scaled real time.
    MockEngine(mock_engine::MockEngineArgs),
    /// Run beside a decode server: the prefill leg of each request a picker sends with x-prefiller-host-port.
    DecodeSidecar(decode_sidecar::DecodeSidecarArgs),
    /// Drive a workload over HTTP against an engine or gateway and measure TTFT from the streams.
    Bench(bench::BenchArgs),
    /// Measure what the gateway adds over the engine itself: throughput, latency and CPU per request.
    Overhead(overhead::OverheadArgs),
}

impl Command {
    /// Whether the command may export trace spans (`[tracing]`, `OTEL_*`).
    fn traces(&self) -> bool {
        match self {
            Command::Serve(_) => true,
            #[cfg(feature = "epp")]
            Command::Epp(_) => true,
            _ => false,
        }
    }
}

fn main() -> ExitCode {
    alloc::configure();
    let cli = Cli::parse();
    // `serve` and `epp` install theirs once they know whether they trace.
    if !cli.command.traces() {
        // `bench` runs embedded gateways and engines: their routine lines would bury its own.
        let level = match &cli.command {
            Command::Bench(args) if args.quiet() => "error",
            Command::Bench(_) => "warn",
            _ => "info",
        };
        logging::init_at(None, level);
    }
    let result = match cli.command {
        Command::Serve(args) => serve::run(args),
        #[cfg(feature = "epp")]
        Command::Epp(args) => epp::run(*args),
        Command::Route(args) => route::run(*args),
        Command::Simulate(args) => simulate::run(*args),
        Command::MockEngine(args) => mock_engine::run(args),
        Command::DecodeSidecar(args) => decode_sidecar::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Overhead(args) => overhead::run(args),
    };
    result.unwrap_or_else(|err| {
        eprintln!("dprouter: {err:#}");
        ExitCode::FAILURE
    })
}
