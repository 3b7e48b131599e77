//! `dprouter epp`: the policies as an Endpoint Picker behind Envoy (or a Gateway API implementation), over
//! ext_proc gRPC. The same workers, policies and config file as `serve`; `--listen` is the gRPC address, and an
//! HTTP side serves `/health`, `/readiness`, `/metrics` and the admin API (`docs/epp.md`).

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use dprouter_gateway::AppState;

use crate::mock_engine::shutdown_signal;
use crate::serve::{embed_an_engine_if_no_worker, finish_tracing, start_tracing, FleetArgs};

#[derive(Debug, Args)]
pub struct EppArgs {
    /// The gRPC address (ext_proc and gRPC health; port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:9002")]
    listen: SocketAddr,
    /// The HTTP side's address: /health, /readiness, /metrics, /kv_events and the admin API.
    #[arg(long, default_value = "127.0.0.1:9090")]
    http_listen: SocketAddr,
    /// Endpoints listed after the chosen one in `x-gateway-destination-endpoint`, for data planes that retry on
    /// them (only for workers that take no rank; Envoy's original destination cluster reads one address).
    #[arg(long, default_value_t = 0)]
    fallbacks: usize,
    #[command(flatten)]
    fleet: FleetArgs,
}

pub fn run(args: EppArgs) -> anyhow::Result<ExitCode> {
    let mut config = args.fleet.gateway_config()?;
    config.listen = args.http_listen;
    config.validate()?;
    let runtime = dprouter_gateway::runtime::build().context("starting the async runtime")?;
    runtime.block_on(async move {
        let tracing = start_tracing(&config)?;
        embed_an_engine_if_no_worker(&mut config).await?;
        let state = AppState::new(config).await?;
        let membership = state.registry.membership();
        for target in &membership.targets {
            if dprouter_epp::picker::address(target).is_none() {
                tracing::warn!(worker = %target.base, "the worker's host is not an IP address: the data plane cannot be sent there, and it is never chosen");
            }
        }
        let grpc = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        let http = tokio::net::TcpListener::bind(args.http_listen).await.with_context(|| format!("binding {}", args.http_listen))?;
        let (grpc_addr, http_addr) = (grpc.local_addr()?, http.local_addr()?);
        let mut out = std::io::stdout().lock();
        writeln!(out, "dprouter epp listening on grpc://{grpc_addr} and http://{http_addr}")?;
        out.flush()?;
        drop(out);
        tracing::info!(%grpc_addr, %http_addr, policy = state.policies.default_policy().name(), endpoints = membership.snapshot.len(), "endpoint picker started");
        let options = dprouter_epp::Options { fallbacks: args.fallbacks };
        let served = dprouter_epp::run(grpc, http, state, options, shutdown_signal()).await.context("serving");
        finish_tracing(tracing).await;
        served?;
        Ok(ExitCode::SUCCESS)
    })
}
