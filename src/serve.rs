//! `dprouter serve`: the gateway. Without `--worker` (or workers in the config) it fronts an embedded mock engine.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, ValueEnum};
use dprouter_core::PolicyConfig;
use dprouter_gateway::config::discovery::{DnsSource, KubernetesSource, WorkerTemplate};
use dprouter_gateway::{serve, AppState, Backend, GatewayConfig, Role, WorkerConfig};
use dprouter_mock_engine::{Engine, EngineConfig};
use dprouter_sim::CostModel;

use crate::mock_engine::shutdown_signal;
use crate::route::parse_policy;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendArg {
    Sglang,
    Vllm,
    Openai,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on (default 127.0.0.1:8000; port 0 picks a free port).
    #[arg(long)]
    listen: Option<SocketAddr>,
    #[command(flatten)]
    pub fleet: FleetArgs,
}

/// The config file and the flags that override it, shared by `serve` and `epp`.
#[derive(Debug, Args)]
pub struct FleetArgs {
    /// TOML config file (every field is in docs/gateway.md); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Upstream worker base URL (repeatable). Replaces the config file's workers.
    #[arg(long = "worker")]
    workers: Vec<String>,
    /// Backend of the --worker URLs (and of workers --inference-pool or --dns find).
    #[arg(long, value_enum, default_value = "sglang")]
    backend: BackendArg,
    /// DP ranks behind each --worker (or discovered worker; SGLang: read from /get_server_info when absent).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    dp_size: Option<u32>,
    /// A prefill server under prefill/decode disaggregation, with its SGLang bootstrap port if not 8998
    /// (repeatable; with --decode, replaces the config file's workers; docs/disaggregation.md).
    #[arg(long = "prefill", value_name = "URL[:BOOTSTRAP_PORT]", value_parser = parse_prefill)]
    prefill: Vec<(String, Option<u16>)>,
    /// A decode server under prefill/decode disaggregation (repeatable).
    #[arg(long = "decode", value_name = "URL")]
    decode: Vec<String>,
    /// Load-balancing policy (overrides the config's [routing]).
    #[arg(long, value_parser = parse_policy)]
    policy: Option<PolicyConfig>,
    /// The policy that picks a disaggregated request's prefill endpoint (overrides [prefill_routing]; default
    /// cache_aware).
    #[arg(long, value_parser = parse_policy)]
    prefill_policy: Option<PolicyConfig>,
    /// The policy that picks a disaggregated request's decode endpoint (overrides [decode_routing]; default
    /// least_loaded).
    #[arg(long, value_parser = parse_policy)]
    decode_policy: Option<PolicyConfig>,
    /// Require `Authorization: Bearer KEY` on admin routes (without it they answer only loopback clients).
    #[arg(long)]
    admin_key: Option<String>,
    /// Ignore and strip clients' rank overrides (multi-tenant deployments).
    #[arg(long)]
    no_client_overrides: bool,
    /// Poll SGLang /get_load every N milliseconds (0: off).
    #[arg(long)]
    poll_load_ms: Option<u64>,
    /// Find workers as the Pods of this InferencePool (inference.networking.k8s.io/v1), with the pod's service
    /// account (its API server, token and namespace); --backend and --dp-size describe them (docs/discovery.md).
    #[arg(long, value_name = "NAME")]
    inference_pool: Option<String>,
    /// Find workers at the addresses of NAME, resolved again every 5 s, at PORT (repeatable); --backend and
    /// --dp-size describe them.
    #[arg(long = "dns", value_name = "NAME:PORT", value_parser = parse_dns)]
    dns: Vec<(String, u16)>,
}

/// `URL` or `URL:BOOTSTRAP_PORT` (a port after the URL's own): SGLang's router takes the bootstrap port as a
/// second value.
fn parse_prefill(text: &str) -> Result<(String, Option<u16>), String> {
    let text = text.trim().trim_end_matches('/');
    let (_, rest) = text
        .split_once("://")
        .ok_or("expected http://host:port[:bootstrap_port]")?;
    // The colons after an IPv6 address's bracket, or in the whole authority.
    let tail = rest.rsplit_once(']').map_or(rest, |(_, tail)| tail);
    if tail.matches(':').count() < 2 {
        return Ok((text.to_string(), None));
    }
    let (url, port) = text
        .rsplit_once(':')
        .ok_or("expected http://host:port[:bootstrap_port]")?;
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| format!("{port:?} is not a bootstrap port"))?;
    Ok((url.to_string(), Some(port)))
}

fn parse_dns(text: &str) -> Result<(String, u16), String> {
    let (name, port) = text.rsplit_once(':').ok_or("expected NAME:PORT")?;
    let port = port.parse().map_err(|_| format!("{port:?} is not a port"))?;
    Ok((name.to_string(), port))
}

impl FleetArgs {
    /// The config file's settings with the flags applied (not validated).
    pub fn gateway_config(&self) -> anyhow::Result<GatewayConfig> {
        let mut config = match &self.config {
            Some(path) => GatewayConfig::from_file(path)?,
            None => GatewayConfig::default(),
        };
        let backend = match self.backend {
            BackendArg::Sglang => Backend::Sglang,
            BackendArg::Vllm => Backend::Vllm,
            BackendArg::Openai => Backend::Openai,
        };
        let template = WorkerTemplate {
            backend,
            dp_size: self.dp_size,
            ..WorkerTemplate::default()
        };
        if let Some(pool) = &self.inference_pool {
            config.discovery.kubernetes.push(KubernetesSource {
                inference_pool: Some(pool.clone()),
                worker: template.clone(),
                ..KubernetesSource::default()
            });
        }
        for (name, port) in &self.dns {
            config.discovery.dns.push(DnsSource {
                name: name.clone(),
                port: *port,
                interval_ms: 5000,
                worker: template.clone(),
            });
        }
        if !self.workers.is_empty() {
            config.workers = self
                .workers
                .iter()
                .map(|url| WorkerConfig {
                    url: url.clone(),
                    backend,
                    dp_size: self.dp_size,
                    ..WorkerConfig::default()
                })
                .collect();
        }
        if !self.prefill.is_empty() || !self.decode.is_empty() {
            if self.workers.is_empty() {
                config.workers.clear();
            }
            let role = |url: &str, role: Role, bootstrap_port: Option<u16>| WorkerConfig {
                url: url.to_string(),
                backend,
                dp_size: self.dp_size,
                role,
                bootstrap_port,
                ..WorkerConfig::default()
            };
            let prefill = self.prefill.iter().map(|(url, port)| role(url, Role::Prefill, *port));
            let decode = self.decode.iter().map(|url| role(url, Role::Decode, None));
            config.workers.extend(prefill.chain(decode));
        }
        if let Some(policy) = &self.policy {
            config.routing = policy.clone();
        }
        if let Some(policy) = &self.prefill_policy {
            config.prefill_routing = policy.clone();
        }
        if let Some(policy) = &self.decode_policy {
            config.decode_routing = policy.clone();
        }
        if self.admin_key.is_some() {
            config.admin_key = self.admin_key.clone();
        }
        if self.no_client_overrides {
            config.allow_client_overrides = false;
        }
        if let Some(ms) = self.poll_load_ms {
            config.load.poll_interval_ms = ms;
        }
        Ok(config)
    }
}

impl ServeArgs {
    fn gateway_config(&self) -> anyhow::Result<GatewayConfig> {
        let mut config = self.fleet.gateway_config()?;
        if let Some(listen) = self.listen {
            config.listen = listen;
        }
        config.validate()?;
        Ok(config)
    }
}

/// Ranks and preset of the embedded engine.
const EMBEDDED_DP: u32 = 4;
const EMBEDDED_PRESET: &str = "h100-8b";

pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let mut config = args.gateway_config()?;
    let runtime = dprouter_gateway::runtime::build().context("starting the async runtime")?;
    runtime.block_on(async move {
        let tracing = start_tracing(&config)?;
        embed_an_engine_if_no_worker(&mut config).await?;
        let listen = config.listen;
        let state = AppState::new(config).await?;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding {listen}"))?;
        let addr = listener.local_addr()?;
        let scheme = if state.tls_acceptor.is_some() { "https" } else { "http" };
        let mut out = std::io::stdout().lock();
        writeln!(out, "dprouter serve listening on {scheme}://{addr}")?;
        out.flush()?;
        drop(out);
        let endpoints = state.registry.membership().snapshot.len();
        tracing::info!(%addr, policy = state.policies.default_policy().name(), endpoints, "gateway started");
        let served = serve(listener, state, shutdown_signal()).await.context("serving");
        finish_tracing(tracing).await;
        served?;
        Ok(ExitCode::SUCCESS)
    })
}

/// Starts exporting spans when `config` (or the environment) says so, and installs the process's log output with
/// it (`crate::logging`). Inside the runtime.
pub fn start_tracing(config: &GatewayConfig) -> anyhow::Result<Option<dprouter_otel::Tracing>> {
    let tracing = match config.tracing_settings()? {
        Some(settings) => {
            let tracing = dprouter_otel::Tracing::start(&settings)?;
            Some((tracing, settings))
        }
        None => None,
    };
    crate::logging::init(tracing.as_ref().map(|(t, _)| t));
    Ok(tracing.map(|(tracing, settings)| {
        tracing::info!(endpoint = %settings.endpoint, protocol = ?settings.protocol, sampler = ?settings.sampler, "exporting trace spans");
        tracing
    }))
}

/// Sends the spans still queued (for at most 5 s) once the gateway has stopped.
pub async fn finish_tracing(tracing: Option<dprouter_otel::Tracing>) {
    if let Some(tracing) = tracing {
        tracing.finish(std::time::Duration::from_secs(5)).await;
    }
}

/// Without workers, fronts a mock engine started in this process.
pub async fn embed_an_engine_if_no_worker(config: &mut GatewayConfig) -> anyhow::Result<()> {
    if config.workers.is_empty() && config.discovery.sources() == 0 {
        let url = start_embedded_engine().await?;
        tracing::info!(%url, dp_size = EMBEDDED_DP, preset = EMBEDDED_PRESET, "no worker given: fronting an embedded mock engine");
        config.workers.push(WorkerConfig {
            url,
            backend: Backend::Sglang,
            dp_size: Some(EMBEDDED_DP),
            ..WorkerConfig::default()
        });
    }
    Ok(())
}

/// Starts a mock engine (4 ranks, h100-8b) on a free loopback port inside this process.
async fn start_embedded_engine() -> anyhow::Result<String> {
    let cost = CostModel::preset(EMBEDDED_PRESET).context("embedded preset")?;
    let engine = Engine::new(EngineConfig {
        dp_size: EMBEDDED_DP,
        cost,
        ..EngineConfig::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(dprouter_mock_engine::serve(
        listener,
        Arc::clone(&engine),
        std::future::pending(),
    ));
    Ok(format!("http://{addr}"))
}
