//! `dprouter decode-sidecar`: beside a decode server under prefill/decode disaggregation, the prefill leg of each
//! request a picker sends with `x-prefiller-host-port` (`dprouter epp` behind Envoy, or llm-d's EPP); everything
//! else goes to the decode server as it came (`docs/disaggregation.md`).

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use dprouter_gateway::sidecar::{serve, SidecarConfig};
use dprouter_gateway::Backend;

use crate::mock_engine::shutdown_signal;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendArg {
    Sglang,
    Vllm,
}

#[derive(Debug, Args)]
pub struct DecodeSidecarArgs {
    /// Address to listen on: the decode pod's address for the picker (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// The decode server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8200")]
    decode: String,
    /// How the legs are paired: sglang (both at once, by a bootstrap room) or vllm (prefill first, then decode
    /// with its kv_transfer_params).
    #[arg(long, value_enum, default_value = "sglang")]
    backend: BackendArg,
    /// The SGLang prefill servers' bootstrap port, for a request whose picker named none (SGLang's default).
    #[arg(long, default_value_t = 8998)]
    bootstrap_port: u16,
    /// The largest request body taken, bytes.
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Each leg's response head must come within this, milliseconds.
    #[arg(long, default_value_t = 300_000)]
    first_byte_timeout_ms: u64,
    /// A prefill answer's bytes must come within this of each other, milliseconds.
    #[arg(long, default_value_t = 300_000)]
    stream_idle_timeout_ms: u64,
}

pub fn run(args: DecodeSidecarArgs) -> anyhow::Result<ExitCode> {
    let config = SidecarConfig {
        decode: args.decode.trim_end_matches('/').to_string(),
        backend: match args.backend {
            BackendArg::Sglang => Backend::Sglang,
            BackendArg::Vllm => Backend::Vllm,
        },
        bootstrap_port: Some(args.bootstrap_port),
        max_body_bytes: args.max_body_bytes,
        connect_timeout: Duration::from_secs(2),
        first_byte_timeout: Duration::from_millis(args.first_byte_timeout_ms),
        idle_timeout: Duration::from_millis(args.stream_idle_timeout_ms),
    };
    let runtime = dprouter_gateway::runtime::build().context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let addr = listener.local_addr()?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "dprouter decode-sidecar listening on http://{addr}")?;
        out.flush()?;
        drop(out);
        tracing::info!(%addr, decode = %args.decode, "decode sidecar started");
        let server = dprouter_gateway::config::ServerConfig::default();
        serve(listener, config, &server, shutdown_signal())
            .await
            .map_err(anyhow::Error::msg)
            .context("serving")?;
        Ok(ExitCode::SUCCESS)
    })
}
