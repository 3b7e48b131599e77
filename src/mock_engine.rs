//! `dprouter mock-engine`: an SGLang-compatible engine over the simulator, for tests, demos and benchmarks.

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use dprouter_core::kv_events::Encoding;
use dprouter_mock_engine::disagg::{Disaggregation, Mode};
use dprouter_mock_engine::{serve, serve_bootstrap, Api, Engine, EngineConfig, Faults};

use crate::cost_args::CostArgs;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ApiArg {
    Sglang,
    Vllm,
}

#[derive(Debug, Args)]
pub struct MockEngineArgs {
    /// Address to listen on; port 0 picks a free port (the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:30000")]
    listen: SocketAddr,
    /// Number of data-parallel ranks.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    dp_size: u32,
    #[command(flatten)]
    cost: CostArgs,
    /// Real seconds per simulated second (0.01 runs 100x faster than the preset).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Rank targeting rules: sglang (body routed_dp_rank, header on /v1/*) or vllm (header only).
    #[arg(long, value_enum, default_value = "sglang")]
    api: ApiArg,
    /// Model name reported by /v1/models and responses; several, comma-separated, for an engine serving several
    /// (all listed by /v1/models).
    #[arg(long, default_value = "dprouter/mock")]
    model: String,
    /// Seed of the generated answers and fault draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Fault: fraction of generation requests answered 500 at once.
    #[arg(long, default_value_t = 0.0)]
    error_rate: f64,
    /// Fault: fraction of generation requests answered 503 at once.
    #[arg(long, default_value_t = 0.0)]
    unavailable_rate: f64,
    /// Fault: break streaming connections after this many tokens.
    #[arg(long)]
    drop_after_tokens: Option<u32>,
    /// Fault: fraction of streaming requests whose connection breaks, with no [DONE], after a random number of
    /// tokens (drawn from the seed and the request).
    #[arg(long, default_value_t = 0.0)]
    drop_rate: f64,
    /// Require `Authorization: Bearer KEY` as the engines' `--api-key` does (SGLang: every route but /health*
    /// and /metrics; vLLM: the /v1 routes).
    #[arg(long)]
    api_key: Option<String>,
    /// Fault: delay the first byte of every generation response, milliseconds (real time).
    #[arg(long, default_value_t = 0)]
    first_byte_delay_ms: u64,
    /// Fault: this rank failed to start (repeatable); requests pinned to it get 503.
    #[arg(long = "dead-rank")]
    dead_ranks: Vec<u32>,
    /// Fault: /health answers 503.
    #[arg(long)]
    unhealthy: bool,
    /// Fault: /health answers after this many milliseconds (real time).
    #[arg(long, default_value_t = 0)]
    health_delay_ms: u64,
    /// Publish each rank's KV cache events on ZMQ, as vLLM and SGLang do: rank r on this endpoint's port + r
    /// (tcp://127.0.0.1:0: a free port each; /get_server_info lists them).
    #[arg(long, value_name = "tcp://HOST:PORT")]
    kv_events: Option<String>,
    /// Serve replays of the last 10,000 batches per rank (port + rank, or 0 for free ports).
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "kv_events")]
    kv_events_replay: Option<String>,
    /// How events are encoded: positional arrays (older engines) or maps with a "type" key (newer ones).
    #[arg(long, value_enum, default_value = "positional")]
    kv_events_encoding: EncodingArg,
    /// Tokenize text and chat prompts with this model's tokenizer and chat template (a directory with
    /// tokenizer.json and tokenizer_config.json) instead of the mock's own pieces.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<std::path::PathBuf>,
    /// The longest prompt taken, tokens: one of this length or more is refused with 400, as SGLang refuses it.
    #[arg(long, default_value_t = dprouter_mock_engine::engine::CONTEXT_LENGTH,
          value_parser = clap::value_parser!(u32).range(1..))]
    context_length: u32,
    /// Prefill or decode only, as SGLang's --disaggregation-mode (docs/disaggregation.md): a prefill mock holds each
    /// request's KV cache for its decode server, a decode mock fetches it. Both refuse a request without
    /// bootstrap_room.
    #[arg(long, value_enum)]
    disaggregation_mode: Option<ModeArg>,
    /// A prefill mock's bootstrap server's port (0: a free one, printed); a decode mock's for requests whose
    /// bootstrap_port is null.
    #[arg(long, default_value_t = dprouter_mock_engine::disagg::DEFAULT_BOOTSTRAP_PORT)]
    disaggregation_bootstrap_port: u16,
    /// How long a prefill mock holds a room's KV cache for its decode server, and a decode mock waits for it,
    /// seconds (real time; SGLang's default is 300).
    #[arg(long, default_value_t = 300.0)]
    disaggregation_timeout_s: f64,
    /// Fault: a prefill mock's bootstrap server takes connections and never answers.
    #[arg(long, requires = "disaggregation_mode")]
    bootstrap_hangs: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModeArg {
    Prefill,
    Decode,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum EncodingArg {
    Positional,
    Named,
}

impl MockEngineArgs {
    pub fn engine_config(&self) -> anyhow::Result<EngineConfig> {
        anyhow::ensure!(
            self.time_scale >= 0.0 && self.time_scale.is_finite(),
            "--time-scale must be >= 0"
        );
        for rate in [self.error_rate, self.unavailable_rate, self.drop_rate] {
            anyhow::ensure!((0.0..=1.0).contains(&rate), "fault rates must be within [0, 1]");
        }
        let cost = self.cost.model()?;
        anyhow::ensure!(
            cost.prefill_contention == 0.0,
            "--prefill-contention is modelled by `simulate` alone: the mock engine's ranks prefill independently"
        );
        Ok(EngineConfig {
            dp_size: self.dp_size,
            cost,
            time_scale: self.time_scale,
            api: match self.api {
                ApiArg::Sglang => Api::Sglang,
                ApiArg::Vllm => Api::Vllm,
            },
            model: self.model.clone(),
            faults: Faults {
                error_rate: self.error_rate,
                unavailable_rate: self.unavailable_rate,
                drop_after_tokens: self.drop_after_tokens,
                drop_rate: self.drop_rate,
                first_byte_delay: Duration::from_millis(self.first_byte_delay_ms),
                dead_ranks: self.dead_ranks.clone(),
                unhealthy: self.unhealthy,
                health_delay: Duration::from_millis(self.health_delay_ms),
            },
            seed: self.seed,
            kv_events: self.kv_events.is_some(),
            tokenizer: match &self.tokenizer {
                Some(path) => Some(std::sync::Arc::new(
                    dprouter_tokenize::ModelTokenizer::load(path).map_err(anyhow::Error::msg)?,
                )),
                None => None,
            },
            context_length: self.context_length,
            disaggregation: self.disaggregation()?,
            api_key: self.api_key.clone(),
        })
    }

    fn disaggregation(&self) -> anyhow::Result<Option<Disaggregation>> {
        let Some(mode) = self.disaggregation_mode else {
            return Ok(None);
        };
        anyhow::ensure!(
            self.disaggregation_timeout_s.is_finite() && self.disaggregation_timeout_s > 0.0,
            "--disaggregation-timeout-s must be a positive number of seconds"
        );
        let mut d = Disaggregation::new(match mode {
            ModeArg::Prefill => Mode::Prefill,
            ModeArg::Decode => Mode::Decode,
        });
        d.bootstrap_port = self.disaggregation_bootstrap_port;
        d.timeout = Duration::from_secs_f64(self.disaggregation_timeout_s);
        d.bootstrap_hangs = self.bootstrap_hangs;
        Ok(Some(d))
    }
}

pub fn run(args: MockEngineArgs) -> anyhow::Result<ExitCode> {
    let mut config = args.engine_config()?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        let addr = listener.local_addr()?;
        // A prefill mock's bootstrap server, on the same host.
        let bootstrap = match &mut config.disaggregation {
            Some(d) if d.mode == Mode::Prefill => {
                let at = std::net::SocketAddr::new(addr.ip(), d.bootstrap_port);
                let bootstrap = tokio::net::TcpListener::bind(at)
                    .await
                    .with_context(|| format!("binding the bootstrap server at {at}"))?;
                d.bootstrap_port = bootstrap.local_addr()?.port();
                d.host = addr.ip().to_string();
                Some(bootstrap)
            }
            _ => None,
        };
        let mut out = std::io::stdout().lock();
        writeln!(out, "dprouter mock-engine listening on http://{addr}")?;
        out.flush()?;
        if let Some(bootstrap) = &bootstrap {
            // Also in /get_server_info's `disaggregation_bootstrap_port`.
            tracing::info!(port = bootstrap.local_addr()?.port(), "bootstrap server started");
        }
        drop(out);
        tracing::info!(%addr, dp_size = config.dp_size, preset = %args.cost.preset, time_scale = config.time_scale, "mock engine started");
        let engine = Engine::new(config);
        if let Some(endpoint) = &args.kv_events {
            let encoding = match args.kv_events_encoding {
                EncodingArg::Positional => Encoding::Positional,
                EncodingArg::Named => Encoding::Named,
            };
            let bound = dprouter_mock_engine::kv_publisher::start(&engine, endpoint, args.kv_events_replay.as_deref(), encoding)
                .await
                .map_err(anyhow::Error::msg)?;
            tracing::info!(?bound, "publishing KV events");
        }
        if let Some(bootstrap) = bootstrap {
            let engine = std::sync::Arc::clone(&engine);
            tokio::spawn(async move {
                if let Err(e) = serve_bootstrap(bootstrap, engine, std::future::pending()).await {
                    tracing::error!(error = %e, "the bootstrap server stopped");
                }
            });
        }
        serve(listener, engine, shutdown_signal()).await.context("serving")?;
        Ok(ExitCode::SUCCESS)
    })
}

/// Completes on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
