//! Soak: `SOAK_STREAMS` (512) concurrent streams for `SOAK_SECS` (300) through `dprouter serve` in front of a
//! `dprouter mock-engine` that answers 5% of requests with a 500 and breaks 10% of streams mid-way. Every request
//! must end with a complete answer or an explicit error, the fleet must never have zero healthy endpoints, every
//! in-flight gauge must return to 0, and the gateway's memory must not grow by more than 10% after warm-up.
//!
//! Ignored by `cargo test`; run it with `cargo test --release --test soak -- --ignored --nocapture`
//! (docs/operations.md, "Soak").
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{HttpClient, Proc};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use serde_json::{json, Value};

/// A request that takes longer than this is a hang.
const HANG: Duration = Duration::from_secs(60);
/// Shared system prompts: streams are spread over this many prefixes.
const PREFIXES: usize = 8;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a valid value")),
        Err(_) => default,
    }
}

fn tmp(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// Runs `dprouter ARGS` with its log in `log` and waits for its "listening on http://ADDR" line.
fn start(args: &[&str], log: &std::path::Path) -> Proc {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dprouter"));
    command
        .args(args)
        .env("RUST_LOG", std::env::var("SOAK_LOG").unwrap_or_else(|_| "warn".into()))
        .stderr(std::fs::File::create(log).unwrap());
    Proc::spawn(command)
}

/// A process's resident memory, kB, from `/proc/PID/status`.
fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// CPU time a process has used, seconds (user + system, from `/proc/PID/stat`, at 100 ticks a second).
fn cpu_secs(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name is in parentheses and may hold spaces: count fields after the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the state (field 3).
    (ticks(11) + ticks(12)) / 100.0
}

/// How one request ended.
enum Outcome {
    Complete,
    /// An explicit error: a status >= 400 with an OpenAI error body, or a stream ending with an error event.
    Error(String),
    /// Anything else.
    Violation(String),
}

fn system_prompt(prefix: usize) -> String {
    // About 2,000 tokens (the mock engine's tokenizer: about 4 bytes a token), shared by every stream of the prefix.
    (0..1600)
        .map(|i| format!("rule{} ", (i * 7 + prefix * 131) % 997))
        .collect::<String>()
}

fn request_body(system: &str, stream: usize, n: u64, tokens: u32) -> String {
    json!({
        "model": "dprouter/mock",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("stream {stream} request {n}: what comes next?")},
        ],
        "max_tokens": tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string()
}

fn shorten(text: &str) -> String {
    if text.len() <= 1500 {
        return text.to_string();
    }
    let mut head = 700;
    while !text.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = text.len() - 700;
    while !text.is_char_boundary(tail) {
        tail += 1;
    }
    format!("{} [.. {} bytes ..] {}", &text[..head], tail - head, &text[tail..])
}

/// Sends one streamed chat completion and reads its answer to the end.
async fn exchange(c: &HttpClient, url: &str, body: String, tokens: u32) -> Outcome {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = match c.request(req).await {
        Ok(resp) => resp,
        Err(e) => return Outcome::Violation(format!("transport error before the response head: {e:?}")),
    };
    let status = resp.status();
    let mut body = resp.into_body();
    let mut bytes = Vec::new();
    loop {
        match body.frame().await {
            None => break,
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    bytes.extend_from_slice(&data);
                }
            }
            Some(Err(e)) => {
                return Outcome::Violation(format!(
                    "status {status}: transport error reading the body after {} bytes: {e:?}; received: {}",
                    bytes.len(),
                    shorten(&String::from_utf8_lossy(&bytes))
                ))
            }
        }
    }
    let text = String::from_utf8_lossy(&bytes);
    if status.as_u16() >= 400 {
        let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let error = &json["error"];
        return match (error["message"].as_str(), error["type"].as_str()) {
            (Some(_), Some(kind)) => Outcome::Error(format!("HTTP {} {kind}", status.as_u16())),
            _ => Outcome::Violation(format!(
                "status {status} without an OpenAI error body: {}",
                shorten(&text)
            )),
        };
    }
    if status.as_u16() != 200 {
        return Outcome::Violation(format!("status {status}: {}", shorten(&text)));
    }
    classify_stream(&text, tokens)
}

/// A 200 stream: complete when it ends with `[DONE]` after every token and the usage report, an explicit error
/// when its last event is an error event, a violation otherwise.
fn classify_stream(text: &str, tokens: u32) -> Outcome {
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.trim().is_empty()).collect();
    let done_at = events.iter().position(|e| *e == "data: [DONE]");
    let last = events.last().copied().unwrap_or("");
    if done_at.is_some_and(|i| i + 1 != events.len()) {
        return Outcome::Violation(format!("events after [DONE]: {}", shorten(text)));
    }
    if done_at.is_some() {
        let mut content = 0;
        let mut usage = None;
        for event in &events[..events.len() - 1] {
            let Some(json) = event
                .strip_prefix("data: ")
                .and_then(|e| serde_json::from_str::<Value>(e).ok())
            else {
                return Outcome::Violation(format!("unparsable event {event:?} in a complete stream"));
            };
            if !json["error"].is_null() {
                return Outcome::Violation(format!("an error event before [DONE]: {}", shorten(text)));
            }
            if json.pointer("/choices/0/delta/content").is_some_and(Value::is_string) {
                content += 1;
            }
            if let Some(n) = json.pointer("/usage/completion_tokens").and_then(Value::as_u64) {
                usage = Some(n);
            }
        }
        if content != tokens || usage != Some(u64::from(tokens)) {
            return Outcome::Violation(format!(
                "[DONE] after {content} tokens (usage {usage:?}), {tokens} asked for: {}",
                shorten(text)
            ));
        }
        return Outcome::Complete;
    }
    let error = last
        .strip_prefix("data: ")
        .and_then(|e| serde_json::from_str::<Value>(e).ok())
        .map(|e| e["error"].clone())
        .unwrap_or(Value::Null);
    match (error["message"].as_str(), error["code"].as_u64()) {
        (Some(_), code) => Outcome::Error(format!(
            "stream error event, code {}",
            code.map_or("none".into(), |c| c.to_string())
        )),
        _ => Outcome::Violation(format!(
            "the stream ended without [DONE] or an error event: {}",
            shorten(text)
        )),
    }
}

#[derive(Default)]
struct Tally {
    complete: u64,
    errors: BTreeMap<String, u64>,
    violations: Vec<String>,
    /// Durations of complete requests.
    durations: Vec<Duration>,
}

/// One sample of the gateway's state.
#[derive(Clone, Copy)]
struct Sample {
    at: Duration,
    healthy: Option<usize>,
    in_flight: u64,
    rss_kb: u64,
    engine_rss_kb: u64,
    panic: bool,
}

struct Endpoints {
    healthy: usize,
    in_flight_requests: u64,
    in_flight_tokens: u64,
    ejections: u64,
    panic: bool,
}

async fn endpoints(c: &HttpClient, gateway: &str) -> Option<Endpoints> {
    let fetch = async {
        let resp = c.get(format!("{gateway}/workers").parse().unwrap()).await.ok()?;
        let bytes = resp.into_body().collect().await.ok()?.to_bytes();
        serde_json::from_slice::<Value>(&bytes).ok()
    };
    let workers = tokio::time::timeout(Duration::from_secs(5), fetch).await.ok()??;
    let all: Vec<&Value> = workers["workers"]
        .as_array()?
        .iter()
        .flat_map(|w| w["endpoints"].as_array().into_iter().flatten())
        .collect();
    Some(Endpoints {
        healthy: all.iter().filter(|e| e["healthy"] == true).count(),
        in_flight_requests: all.iter().filter_map(|e| e["in_flight_requests"].as_u64()).sum(),
        in_flight_tokens: all.iter().filter_map(|e| e["in_flight_tokens"].as_u64()).sum(),
        ejections: all.iter().filter_map(|e| e["ejections"].as_u64()).sum(),
        panic: workers["panic"] == true,
    })
}

/// The sum of the `dprouter_endpoint_in_flight_requests` gauges in `/metrics`.
async fn metrics_in_flight(c: &HttpClient, gateway: &str) -> Option<f64> {
    let resp = c.get(format!("{gateway}/metrics").parse().unwrap()).await.ok()?;
    let bytes = resp.into_body().collect().await.ok()?.to_bytes();
    Some(
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter(|l| l.starts_with("dprouter_endpoint_in_flight_requests"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a 5-minute soak: cargo test --release --test soak -- --ignored --nocapture"]
async fn soak() {
    let secs: u64 = env_or("SOAK_SECS", 300);
    let streams: usize = env_or("SOAK_STREAMS", 512);
    let time_scale: String = env_or("SOAK_TIME_SCALE", "0.05".to_string());
    let tokens: u32 = env_or("SOAK_MAX_TOKENS", 16);
    // Scrape `/metrics` every N seconds, as Prometheus would (0: never, the default).
    let scrape_secs: u64 = env_or("SOAK_SCRAPE_SECS", 0);
    let run = Duration::from_secs(secs);
    let warm_up = (run / 10).min(Duration::from_secs(30));

    let engine_args = [
        "mock-engine",
        "--listen",
        "127.0.0.1:0",
        "--dp-size",
        "4",
        "--preset",
        "h100-8b",
        "--time-scale",
        &time_scale,
        "--error-rate",
        "0.05",
        "--drop-rate",
        "0.1",
        "--seed",
        "1",
    ];
    let engine = start(&engine_args, &tmp("soak-engine.log"));
    // The limits well above the load, so they are not what is measured; health settings are the defaults.
    let config = tmp("soak-gateway.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nmax_connections = {}\nmax_in_flight = {}\n",
            (4 * streams).max(4096),
            (2 * streams).max(2048)
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let gateway_args = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        &engine.url,
        "--policy",
        "cache_aware",
        "--config",
        &config,
    ];
    let gateway = start(&gateway_args, &tmp("soak-gateway.log"));
    let gateway_pid = gateway.child.id();
    let engine_pid = engine.child.id();
    println!("engine:  dprouter {}", engine_args.join(" "));
    println!("gateway: dprouter {}", gateway_args.join(" "));
    println!(
        "{streams} streams for {secs} s, {tokens} tokens an answer, warm-up {} s, /metrics scraped {}; logs in {}",
        warm_up.as_secs(),
        if scrape_secs > 0 {
            format!("every {scrape_secs} s")
        } else {
            "never".into()
        },
        tmp("soak-*.log").display()
    );

    let c = common::client();
    let url = format!("{}/v1/chat/completions", gateway.url);
    let systems: Arc<Vec<String>> = Arc::new((0..PREFIXES).map(system_prompt).collect());
    let tally = Arc::new(Mutex::new(Tally::default()));
    let started = Instant::now();
    let deadline = started + run;
    let cpu_start = [
        cpu_secs(&gateway_pid.to_string()),
        cpu_secs(&engine_pid.to_string()),
        cpu_secs("self"),
    ];

    // The sampler: healthy endpoints, in-flight requests and memory, every second until the load stops.
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (c, gw, stop) = (c.clone(), gateway.url.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                if scrape_secs > 0 && (samples.len() as u64).is_multiple_of(scrape_secs) {
                    metrics_in_flight(&c, &gw).await;
                }
                let e = endpoints(&c, &gw).await;
                samples.push(Sample {
                    at: started.elapsed(),
                    healthy: e.as_ref().map(|e| e.healthy),
                    in_flight: e.as_ref().map_or(0, |e| e.in_flight_requests),
                    rss_kb: rss_kb(gateway_pid),
                    engine_rss_kb: rss_kb(engine_pid),
                    panic: e.as_ref().is_some_and(|e| e.panic),
                });
                if samples.len() % 30 == 0 {
                    let s = samples.last().unwrap();
                    println!(
                        "{:>4} s: healthy {:?}, in flight {}, gateway RSS {} kB, engine RSS {} kB",
                        s.at.as_secs(),
                        s.healthy,
                        s.in_flight,
                        s.rss_kb,
                        s.engine_rss_kb
                    );
                }
            }
            samples
        })
    };

    let drivers: Vec<_> = (0..streams)
        .map(|stream| {
            let (c, url, systems, tally) = (c.clone(), url.clone(), Arc::clone(&systems), Arc::clone(&tally));
            tokio::spawn(async move {
                // Stagger the start over the first second.
                tokio::time::sleep(Duration::from_millis((stream as u64 * 1000) / streams as u64)).await;
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let body = request_body(&systems[stream % PREFIXES], stream, n, tokens);
                    let sent = Instant::now();
                    let outcome = tokio::time::timeout(HANG, exchange(&c, &url, body, tokens))
                        .await
                        .unwrap_or_else(|_| Outcome::Violation(format!("no complete answer after {HANG:?}")));
                    let took = sent.elapsed();
                    let mut t = tally.lock().unwrap();
                    match outcome {
                        Outcome::Complete => {
                            t.complete += 1;
                            t.durations.push(took);
                        }
                        Outcome::Error(kind) => *t.errors.entry(kind).or_default() += 1,
                        Outcome::Violation(what) => t.violations.push(format!(
                            "stream {stream} request {n}, sent at {:.3} s, after {took:?}: {what}",
                            (sent - started).as_secs_f64()
                        )),
                    }
                    n += 1;
                }
            })
        })
        .collect();
    for d in drivers {
        d.await.unwrap();
    }
    let load_time = started.elapsed();
    let cpu_end = [
        cpu_secs(&gateway_pid.to_string()),
        cpu_secs(&engine_pid.to_string()),
        cpu_secs("self"),
    ];
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.await.unwrap();

    // After the load: every in-flight gauge back to 0 within 10 s.
    let settle_until = Instant::now() + Duration::from_secs(10);
    let (settled, last) = loop {
        let e = endpoints(&c, &gateway.url).await;
        let m = metrics_in_flight(&c, &gateway.url).await;
        let zero = e
            .as_ref()
            .is_some_and(|e| e.in_flight_requests == 0 && e.in_flight_tokens == 0)
            && m == Some(0.0);
        let reading = (e.map(|e| (e.in_flight_requests, e.in_flight_tokens, e.ejections)), m);
        if zero || Instant::now() >= settle_until {
            break (zero, reading);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let rss_after = rss_kb(gateway_pid);

    let t = tally.lock().unwrap();
    let errors: u64 = t.errors.values().sum();
    let total = t.complete + errors + t.violations.len() as u64;
    let mut durations = t.durations.clone();
    durations.sort_unstable();
    let under_load: Vec<&Sample> = samples.iter().filter(|s| s.at <= run).collect();
    let min_healthy = samples.iter().filter_map(|s| s.healthy).min();
    let sampler_failures = samples.iter().filter(|s| s.healthy.is_none()).count();
    let rss_warm = under_load.iter().find(|s| s.at >= warm_up).map_or(0, |s| s.rss_kb);
    let rss_end = under_load.last().map_or(0, |s| s.rss_kb);
    let rss_max = samples.iter().map(|s| s.rss_kb).max().unwrap_or(0);
    let engine_rss = (
        under_load
            .iter()
            .find(|s| s.at >= warm_up)
            .map_or(0, |s| s.engine_rss_kb),
        under_load.last().map_or(0, |s| s.engine_rss_kb),
    );
    let cpu = |i: usize| 100.0 * (cpu_end[i] - cpu_start[i]) / load_time.as_secs_f64();

    println!("--- soak summary ---");
    println!(
        "requests: {total} in {:.1} s ({:.1}/s): {} complete, {errors} explicit errors, {} violations",
        load_time.as_secs_f64(),
        total as f64 / load_time.as_secs_f64(),
        t.complete,
        t.violations.len()
    );
    for (kind, n) in &t.errors {
        println!("  {kind}: {n} ({:.1}%)", 100.0 * *n as f64 / total.max(1) as f64);
    }
    println!(
        "complete requests: p50 {:?}, p99 {:?}, max {:?}",
        percentile(&durations, 0.5),
        percentile(&durations, 0.99),
        durations.last().copied().unwrap_or_default()
    );
    let mut by_healthy = BTreeMap::new();
    for s in &samples {
        *by_healthy.entry(s.healthy).or_insert(0u32) += 1;
    }
    println!(
        "healthy endpoints: min {min_healthy:?} of 4 over {} samples ({sampler_failures} failed; samples by count: \
         {by_healthy:?}), panic mode in {}",
        samples.len(),
        samples.iter().filter(|s| s.panic).count()
    );
    println!("in flight after the load: {settled} (last reading: requests, tokens, ejections; metrics: {last:?})");
    println!(
        "gateway RSS: {rss_warm} kB after warm-up, max {rss_max} kB, {rss_end} kB at the end of the load ({:+.1}%), \
         {rss_after} kB after it",
        100.0 * (rss_end as f64 / rss_warm.max(1) as f64 - 1.0)
    );
    println!(
        "engine RSS: {} kB after warm-up, {} kB at the end",
        engine_rss.0, engine_rss.1
    );
    println!(
        "CPU over the load: gateway {:.0}%, engine {:.0}%, driver {:.0}% (of one core; 2 cores in all)",
        cpu(0),
        cpu(1),
        cpu(2)
    );
    for v in t.violations.iter().take(20) {
        println!("VIOLATION {v}");
    }

    assert!(t.violations.is_empty(), "{} violations", t.violations.len());
    assert!(total > 0, "no request was sent");
    assert_eq!(sampler_failures, 0, "GET /workers failed or took over 5 s");
    assert!(
        min_healthy.is_some_and(|h| h > 0),
        "healthy endpoints fell to {min_healthy:?}"
    );
    assert!(settled, "in-flight gauges did not return to 0: {last:?}");
    assert!(rss_warm > 0 && rss_end > 0, "no RSS reading");
    assert!(
        rss_end as f64 <= 1.10 * rss_warm as f64,
        "gateway RSS grew from {rss_warm} kB to {rss_end} kB"
    );
}
