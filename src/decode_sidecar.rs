//! `dprouter decode-sidecar`: beside a decode server under prefill/decode disaggregation, the prefill leg of each
//! request a picker sends with `x-prefiller-host-port` (`dprouter epp` behind Envoy, or llm-d's EPP); everything
//! else goes to the decode server as it came (`docs/disaggregation.md`).

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use dprouter_gateway::decode_sidecar::{serve, PrefillAllow, SidecarConfig};
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
    /// The prefill endpoints a picker may name, comma-separated or repeated: addresses (10.0.0.5:8000), IPs or
    /// networks (10.0.0.0/16, fd00::/8). None by default: every request naming one is refused (403).
    #[arg(long, value_delimiter = ',', value_parser = PrefillAllow::parse)]
    prefill_allow: Vec<PrefillAllow>,
    /// A file holding the key the legs send to the decode and prefill servers (Authorization: Bearer), when they
    /// need one: a request's own Authorization, X-Api-Key and Cookie never reach them.
    #[arg(long)]
    api_key_file: Option<std::path::PathBuf>,
    /// The largest request body taken, bytes.
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Request body bytes held across all requests while they arrive (at least --max-body-bytes; a body past it
    /// is a 503 at once). Default: 512 MiB, or twice --max-body-bytes if that is more (serve's).
    #[arg(long)]
    max_buffered_body_bytes: Option<usize>,
    /// A request body must arrive whole within this, milliseconds (a 408 otherwise; serve's).
    #[arg(long, default_value_t = 60_000)]
    request_body_timeout_ms: u64,
    /// The decode answer's head must come within this of the request's arrival, milliseconds.
    #[arg(long, default_value_t = 300_000)]
    first_byte_timeout_ms: u64,
    /// The prefill leg's response head must come within this, milliseconds (default: half of
    /// --first-byte-timeout-ms, so that a prefill server that never answers is the one named and the decode leg
    /// has the rest).
    #[arg(long)]
    prefill_first_byte_timeout_ms: Option<u64>,
    /// A prefill answer's bytes must come within this of each other, milliseconds.
    #[arg(long, default_value_t = 300_000)]
    stream_idle_timeout_ms: u64,
}

pub fn run(args: DecodeSidecarArgs) -> anyhow::Result<ExitCode> {
    let first_byte = Duration::from_millis(args.first_byte_timeout_ms);
    let api_key = match &args.api_key_file {
        Some(file) => Some(
            std::fs::read_to_string(file)
                .with_context(|| format!("reading --api-key-file {}", file.display()))?
                .trim()
                .to_string(),
        ),
        None => None,
    };
    let config = SidecarConfig {
        decode: args.decode.trim_end_matches('/').to_string(),
        backend: match args.backend {
            BackendArg::Sglang => Backend::Sglang,
            BackendArg::Vllm => Backend::Vllm,
        },
        bootstrap_port: Some(args.bootstrap_port),
        prefill_allow: args.prefill_allow,
        api_key,
        max_body_bytes: args.max_body_bytes,
        max_buffered_body_bytes: args
            .max_buffered_body_bytes
            .unwrap_or(dprouter_gateway::config::default_body_budget(args.max_body_bytes))
            .max(args.max_body_bytes),
        request_body_timeout: Duration::from_millis(args.request_body_timeout_ms),
        connect_timeout: Duration::from_secs(2),
        first_byte_timeout: first_byte,
        prefill_first_byte_timeout: args
            .prefill_first_byte_timeout_ms
            .map_or(first_byte / 2, |ms| Duration::from_millis(ms).min(first_byte)),
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
