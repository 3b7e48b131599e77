//! The `dprouter` binary: one subcommand per job, each in its own module.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod route;
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
    /// Route JSON Lines requests offline and print one decision per line.
    Route(Box<route::RouteArgs>),
    /// Compare policies on a workload over simulated DP ranks, in virtual time.
    Simulate(Box<simulate::SimulateArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Route(args) => route::run(*args),
        Command::Simulate(args) => simulate::run(*args),
    };
    result.unwrap_or_else(|err| {
        eprintln!("dprouter: {err:#}");
        ExitCode::FAILURE
    })
}
