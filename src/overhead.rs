//! `dprouter overhead`: what the gateway costs, measured against the engine itself in one run.
//!
//! Starts a zero-cost mock engine and a gateway in front of it (child processes of this binary, on free loopback
//! ports, stopped on exit), then for each case and concurrency drives the engine directly and through the gateway
//! with the same closed loop of clients for the same time, and reports the throughput ratio, the latency the
//! gateway adds at the median and at p99, and the gateway's CPU time per request (from its own
//! `/proc/PID/stat`, all its threads). Everything shares this machine's cores, so the figures are ratios of one
//! run, not absolute capacities; `docs/operations.md` ("Overhead") has the command and a run.
//!
//! With `--traced` they also run through a second gateway with tracing on, every request sampled (two spans each),
//! exporting over OTLP/HTTP to a collector this command runs, which takes each export and keeps nothing: what
//! tracing costs the gateway (the gateway measured first runs with tracing off, `OTEL_SDK_DISABLED=true`).
//!
//! With `--nginx PATH` the same loops also run through nginx, configured as a plain keep-alive reverse proxy to
//! the same engine: a reference for what any proxy costs on the machine (two HTTP hops, four socket operations per
//! request), which no routing work can go below.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;

#[derive(Debug, Parser)]
pub struct OverheadArgs {
    /// Cases to run: `small` (200 B chat), `large` (90 KB chat), each `-stream` or not.
    #[arg(long, value_delimiter = ',', default_value = "small,large,small-stream,large-stream")]
    cases: Vec<Case>,
    /// Concurrent clients (closed loop), one measurement per value.
    #[arg(long, value_delimiter = ',', default_value = "1,16,256")]
    concurrency: Vec<usize>,
    /// Seconds each side of each measurement runs (after a short warm-up).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Tokens in each answer (a streamed answer is this many events plus the role, usage and `[DONE]` events).
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Extra arguments for the gateway (`--policy cache_aware`, …).
    #[arg(long, allow_hyphen_values = true, num_args = 1..)]
    gateway_args: Vec<String>,
    /// Also write the rows as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Also measure nginx (this binary, e.g. `/usr/sbin/nginx`) as a plain reverse proxy to the same engine, as a
    /// reference: a row `nginx` under each gateway row.
    #[arg(long)]
    nginx: Option<std::path::PathBuf>,
    /// Also measure a gateway that samples every request and exports its spans over OTLP/HTTP to a collector this
    /// command runs: a row `traced` under each gateway row.
    #[arg(long)]
    traced: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Case {
    Small,
    Large,
    SmallStream,
    LargeStream,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Small => "200 B",
            Case::Large => "90 KB",
            Case::SmallStream => "200 B streamed",
            Case::LargeStream => "90 KB streamed",
        }
    }

    /// A chat request of about the case's size.
    fn body(self, max_tokens: u32) -> Bytes {
        let (stream, filler) = match self {
            Case::Small => (false, 60),
            Case::Large => (false, 90_000),
            Case::SmallStream => (true, 60),
            Case::LargeStream => (true, 90_000),
        };
        let content: String = "lorem ipsum dolor sit amet ".chars().cycle().take(filler).collect();
        let body = serde_json::json!({
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": stream,
            "stream_options": {"include_usage": stream},
        });
        Bytes::from(body.to_string())
    }
}

/// One measurement of one side.
#[derive(Debug, Clone, Copy, Default, Serialize)]
struct Side {
    requests: u64,
    errors: u64,
    per_s: f64,
    p50_us: u64,
    p99_us: u64,
}

#[derive(Debug, Serialize)]
struct Row {
    case: Case,
    concurrency: usize,
    direct: Side,
    gateway: Side,
    throughput_ratio: f64,
    added_p50_us: i64,
    added_p99_us: i64,
    gateway_cpu_us_per_request: f64,
    /// The same through nginx, with `--nginx`.
    #[serde(skip_serializing_if = "Option::is_none")]
    nginx: Option<Through>,
    /// The same through a gateway with every request traced, with `--traced`.
    #[serde(skip_serializing_if = "Option::is_none")]
    traced: Option<Through>,
}

/// One proxy's side of a measurement, against the same direct run.
#[derive(Debug, Serialize)]
struct Through {
    side: Side,
    throughput_ratio: f64,
    added_p50_us: i64,
    added_p99_us: i64,
    cpu_us_per_request: f64,
}

impl Through {
    fn new(direct: &Side, side: Side, cpu_ticks: u64, clock_ticks: u64) -> Self {
        Self {
            side,
            throughput_ratio: side.per_s / direct.per_s.max(f64::MIN_POSITIVE),
            added_p50_us: side.p50_us as i64 - direct.p50_us as i64,
            added_p99_us: side.p99_us as i64 - direct.p99_us as i64,
            cpu_us_per_request: cpu_ticks as f64 * 1e6 / clock_ticks as f64 / side.requests.max(1) as f64,
        }
    }

    fn print(&self, name: &str, c: usize, direct: &Side) {
        println!(
            "{:<16} {:>5} {:>12.0} {:>12.0} {:>6.2} {:>10} {:>10} {:>12.1}",
            name,
            c,
            direct.per_s,
            self.side.per_s,
            self.throughput_ratio,
            self.added_p50_us,
            self.added_p99_us,
            self.cpu_us_per_request
        );
    }
}

pub fn run(args: OverheadArgs) -> anyhow::Result<ExitCode> {
    if args.seconds <= 0.0 || args.concurrency.contains(&0) {
        bail!("--seconds and every --concurrency must be positive");
    }
    let engine = Started::start(
        &[
            "mock-engine",
            "--listen",
            "127.0.0.1:0",
            "--preset",
            "zero",
            "--dp-size",
            "4",
        ],
        &[],
    )?;
    let mut serve = vec!["serve", "--listen", "127.0.0.1:0", "--worker", engine.url.as_str()];
    serve.extend(args.gateway_args.iter().map(String::as_str));
    let gateway = Started::start(&serve, &[("OTEL_SDK_DISABLED", "true")])?;
    let nginx = match &args.nginx {
        Some(path) => Some(Nginx::start(path, &engine.url)?),
        None => None,
    };
    let clock_ticks = clock_ticks_per_s();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let traced = if args.traced {
        let collector = runtime.block_on(otlp_sink())?;
        let env = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_TRACES_SAMPLER", "always_on"),
            ("OTEL_SERVICE_NAME", "dprouter-overhead"),
            // Full batches go at once under load; this only sends the last ones sooner.
            ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ];
        Some(Started::start(&serve, &env)?)
    } else {
        None
    };
    let mut rows = Vec::new();
    println!(
        "{:<16} {:>5} {:>12} {:>12} {:>6} {:>10} {:>10} {:>12}",
        "case", "c", "direct/s", "gateway/s", "ratio", "+p50 µs", "+p99 µs", "CPU µs/req"
    );
    for &case in &args.cases {
        let body = case.body(args.max_tokens);
        for &c in &args.concurrency {
            let time = Duration::from_secs_f64(args.seconds);
            let direct = runtime.block_on(drive(&engine.url, &body, c, time));
            let before = cpu_ticks(gateway.id())?;
            let through = runtime.block_on(drive(&gateway.url, &body, c, time));
            let gateway_row = Through::new(&direct, through, cpu_ticks(gateway.id())? - before, clock_ticks);
            gateway_row.print(case.name(), c, &direct);
            let traced_row = match &traced {
                Some(traced) => {
                    let before = cpu_ticks(traced.id())?;
                    let side = runtime.block_on(drive(&traced.url, &body, c, time));
                    let row = Through::new(&direct, side, cpu_ticks(traced.id())? - before, clock_ticks);
                    row.print("  traced", c, &direct);
                    Some(row)
                }
                None => None,
            };
            let reference = match &nginx {
                Some(nginx) => {
                    let before = nginx.cpu_ticks()?;
                    let side = runtime.block_on(drive(&nginx.url, &body, c, time));
                    let row = Through::new(&direct, side, nginx.cpu_ticks()? - before, clock_ticks);
                    row.print("  nginx", c, &direct);
                    Some(row)
                }
                None => None,
            };
            let errors = reference.as_ref().map_or(0, |r| r.side.errors);
            let row = Row {
                case,
                concurrency: c,
                direct,
                gateway: through,
                throughput_ratio: gateway_row.throughput_ratio,
                added_p50_us: gateway_row.added_p50_us,
                added_p99_us: gateway_row.added_p99_us,
                gateway_cpu_us_per_request: gateway_row.cpu_us_per_request,
                nginx: reference,
                traced: traced_row,
            };
            if errors > 0 {
                println!("  errors: {errors} through nginx");
            }
            if direct.errors + through.errors > 0 {
                println!(
                    "  errors: {} direct, {} through the gateway",
                    direct.errors, through.errors
                );
            }
            rows.push(row);
        }
    }
    if let Some(traced) = &traced {
        // The last batch goes within the schedule delay.
        std::thread::sleep(Duration::from_millis(600));
        let scrape = runtime.block_on(metrics_text(&traced.url));
        let count = |prefix: &str| -> f64 {
            scrape
                .lines()
                .filter(|l| l.starts_with(prefix))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        let (exported, dropped) = (
            count("dprouter_trace_spans_exported_total"),
            count("dprouter_trace_spans_dropped_total"),
        );
        println!("traced gateway: {exported} spans exported, {dropped} dropped");
        if exported < 1.0 {
            bail!("the traced gateway exported no span: its rows did not measure tracing");
        }
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&serde_json::json!({ "rows": rows }))?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `c` clients, each sending `body` and reading the whole answer in a loop: a warm-up, then `time` measured.
async fn drive(base: &str, body: &Bytes, c: usize, time: Duration) -> Side {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let url: hyper::Uri = match format!("{base}/v1/chat/completions").parse() {
        Ok(url) => url,
        Err(_) => return Side::default(),
    };
    let warm_up = (time / 5).min(Duration::from_secs(1));
    let start = Instant::now();
    let measure_from = start + warm_up;
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..c)
        .map(|_| {
            let (client, url, body, stop) = (client.clone(), url.clone(), body.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    let ok = exchange(&client, &url, &body).await;
                    if sent >= measure_from && !stop.load(Ordering::Relaxed) {
                        if ok {
                            latencies.push(sent.elapsed().as_micros() as u64);
                        } else {
                            errors += 1;
                        }
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    tokio::time::sleep_until((measure_from + time).into()).await;
    stop.store(true, Ordering::Relaxed);
    let measured = measure_from.elapsed().as_secs_f64().max(time.as_secs_f64());
    let mut latencies = Vec::new();
    let mut errors = 0;
    for task in tasks {
        if let Ok((l, e)) = task.await {
            latencies.extend(l);
            errors += e;
        }
    }
    latencies.sort_unstable();
    let at = |q: f64| latencies.get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)));
    Side {
        requests: latencies.len() as u64,
        errors,
        per_s: latencies.len() as f64 / measured,
        p50_us: at(0.5).copied().unwrap_or(0),
        p99_us: at(0.99).copied().unwrap_or(0),
    }
}

/// One request, its whole answer read; whether it succeeded.
async fn exchange(client: &Client<HttpConnector, Full<Bytes>>, url: &hyper::Uri, body: &Bytes) -> bool {
    let request = hyper::Request::post(url.clone())
        .header("content-type", "application/json")
        .body(Full::new(body.clone()));
    let Ok(request) = request else { return false };
    match client.request(request).await {
        Ok(response) => response.status().is_success() && response.into_body().collect().await.is_ok(),
        Err(_) => false,
    }
}

/// An OTLP/HTTP collector that takes every export and keeps nothing: its base URL. Served on the runtime.
async fn otlp_sink() -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|request: hyper::Request<hyper::body::Incoming>| async move {
                    let _ = request.into_body().collect().await;
                    // An empty ExportTraceServiceResponse: no bytes.
                    hyper::Response::builder()
                        .header("content-type", "application/x-protobuf")
                        .body(Full::new(Bytes::new()))
                });
                let io = hyper_util::rt::TokioIo::new(socket);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
    Ok(url)
}

/// A gateway's `/metrics` text (empty if it cannot be read).
async fn metrics_text(base: &str) -> String {
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let Ok(url) = format!("{base}/metrics").parse::<hyper::Uri>() else {
        return String::new();
    };
    match client.get(url).await {
        Ok(response) => match response.into_body().collect().await {
            Ok(body) => String::from_utf8_lossy(&body.to_bytes()).into_owned(),
            Err(_) => String::new(),
        },
        Err(_) => String::new(),
    }
}

/// A `dprouter` child process listening on a loopback port; killed when dropped.
struct Started {
    child: Child,
    url: String,
}

impl Started {
    /// `dprouter ARGS`, with `env` added to its environment.
    fn start(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .args(args)
            .env("RUST_LOG", "error")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting dprouter {}", args.join(" ")))?;
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            BufReader::new(out).read_line(&mut line)?;
        }
        let url = line.trim().rsplit(' ').next().unwrap_or_default().to_string();
        if !url.starts_with("http://") {
            let _ = child.kill();
            bail!("dprouter {} did not start (said {line:?})", args.join(" "));
        }
        let _ = std::io::stdout().flush();
        Ok(Self { child, url })
    }

    fn id(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// nginx as a plain keep-alive reverse proxy (two worker processes, as the gateway has two runtime threads on this
/// machine's two cores; no buffering of answers, as a streaming gateway must), in a temporary folder of its own;
/// stopped when dropped.
struct Nginx {
    child: Child,
    url: String,
    folder: std::path::PathBuf,
}

impl Nginx {
    fn start(binary: &std::path::Path, engine_url: &str) -> anyhow::Result<Self> {
        let engine = engine_url.trim_start_matches("http://");
        // A free port, asked of the kernel and released for nginx to take (a race only another program could win).
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let folder = std::env::temp_dir().join(format!("dprouter-overhead-nginx-{}", std::process::id()));
        std::fs::create_dir_all(&folder)?;
        let dir = folder.display();
        let config = format!(
            "daemon off;\nworker_processes 2;\nerror_log stderr error;\npid {dir}/nginx.pid;\n\
             events {{ worker_connections 4096; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {dir}/body;\n  proxy_temp_path {dir}/proxy;\n\
             \x20 fastcgi_temp_path {dir}/fastcgi;\n  uwsgi_temp_path {dir}/uwsgi;\n  scgi_temp_path {dir}/scgi;\n\
             \x20 upstream engine {{ server {engine}; keepalive 512; }}\n\
             \x20 server {{\n    listen 127.0.0.1:{port};\n    client_max_body_size 16m;\n\
             \x20   client_body_buffer_size 1m;\n    location / {{\n      proxy_pass http://engine;\n\
             \x20     proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n\
             \x20   }}\n  }}\n}}\n"
        );
        let config_path = folder.join("nginx.conf");
        std::fs::write(&config_path, config)?;
        let child = Command::new(binary)
            .arg("-p")
            .arg(&folder)
            .arg("-c")
            .arg(&config_path)
            .arg("-e")
            .arg("stderr")
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let nginx = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            folder,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("nginx did not listen on 127.0.0.1:{port} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(nginx)
    }

    /// CPU time of the master and its worker processes.
    fn cpu_ticks(&self) -> anyhow::Result<u64> {
        let master = self.child.id();
        let mut total = cpu_ticks(master)?;
        for entry in std::fs::read_dir("/proc")?.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if stat_field(pid, 4) == Some(u64::from(master)) {
                total += cpu_ticks(pid).unwrap_or(0);
            }
        }
        Ok(total)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGKILL to the master leaves its workers running: ask it to stop (SIGQUIT through `kill`), then make sure.
        let _ = Command::new("kill")
            .arg("-QUIT")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

/// Field `n` (1-based, as in proc(5)) of `/proc/PID/stat`, for the numeric fields after the command name.
fn stat_field(pid: u32, n: usize) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is parenthesized and may hold spaces: count fields after its closing parenthesis.
    let after = stat.rsplit_once(')')?.1;
    after.split_whitespace().nth(n.checked_sub(3)?)?.parse().ok()
}

/// User plus system CPU time of a process, all its threads, in clock ticks (`/proc/PID/stat` fields 14 and 15).
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let user = stat_field(pid, 14).context("reading a process's CPU time")?;
    Ok(user + stat_field(pid, 15).unwrap_or(0))
}

/// The kernel's clock ticks per second for `/proc` CPU times (`getconf CLK_TCK`; 100 on Linux unless told).
fn clock_ticks_per_s() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|&t| t > 0)
        .unwrap_or(100)
}
