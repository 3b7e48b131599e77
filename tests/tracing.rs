//! Tracing end to end, through the `dprouter` binary: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, `serve` exports a
//! `request` span (kind server) and an `upstream` span (kind client) per request to an OTLP collector, over gRPC
//! and over HTTP with protobuf, with the routing facts as attributes; the engine gets the `upstream` span as the
//! parent in its `traceparent`, in the client's trace; the trace id is in the access log line and in the gateway's
//! error bodies; and a collector that accepts connections and never answers costs the requests nothing: no wait,
//! a bounded queue (the drops counted).
//!
//! The collector is the tests' (`common::otlp`). The engine is an OpenAI-style server here that answers with a
//! usage report and the headers it got.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use common::otlp::{attribute, grpc_collector, hex, http_collector, int, string, AnyValue, Span};
use common::{client, get, memory, post, Proc};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use serde_json::{json, Map, Value};

/// An OpenAI-style engine that answers every request with a usage report and the headers it got.
async fn echo_engine() -> String {
    let echo = |headers: HeaderMap| async move {
        let got: Map<String, Value> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v.to_str().unwrap_or("?"))))
            .collect();
        axum::Json(json!({
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}},
            "headers": got,
        }))
    };
    let app = axum::Router::new().fallback(echo);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// `dprouter serve` in front of `engine` with `env` (its standard error's lines sent to `log` when given).
fn gateway(engine: &str, env: &[(&str, &str)], args: &[&str], log: Option<std::sync::mpsc::Sender<String>>) -> Proc {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dprouter"));
    command
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "openai",
            "--worker",
            engine,
        ])
        .args(args)
        .env("RUST_LOG", if log.is_some() { "info" } else { "warn" })
        .envs(env.iter().copied());
    match log {
        Some(lines) => {
            command.stderr(Stdio::piped());
            let mut proc = Proc::spawn(command);
            let stderr = proc.child.stderr.take().unwrap();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                    let _ = lines.send(line);
                }
            });
            proc
        }
        None => {
            command.stderr(Stdio::inherit());
            Proc::spawn(command)
        }
    }
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_PARENT: &str = "00f067aa0ba902b7";

fn chat() -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}]})
}

/// Checks the two spans of one request that answered with the echo engine's report, and that the engine's
/// `traceparent` named the `upstream` span; returns the `request` span.
fn check_spans(spans: &[(String, Span)], engine_saw: &Value, client_parent: Option<&str>) -> Span {
    assert_eq!(spans.len(), 2, "{spans:#?}");
    assert!(
        spans.iter().all(|(service, _)| service == "dprouter-test"),
        "{spans:#?}"
    );
    let find = |name: &str| spans.iter().map(|(_, s)| s).find(|s| s.name == name).unwrap().clone();
    let (request, upstream) = (find("POST /v1/chat/completions"), find("upstream"));
    assert_eq!(request.kind, SpanKind::Server as i32);
    assert_eq!(upstream.kind, SpanKind::Client as i32);
    assert_eq!(hex(&request.parent_span_id), client_parent.unwrap_or(""));
    assert_eq!(upstream.parent_span_id, request.span_id);
    assert!(request.start_time_unix_nano <= upstream.start_time_unix_nano);
    assert!(request.end_time_unix_nano >= upstream.end_time_unix_nano);
    // The engine's parent is the attempt's span, in the same trace.
    let traceparent = engine_saw["traceparent"].as_str().unwrap();
    assert_eq!(
        traceparent,
        format!("00-{}-{}-01", hex(&request.trace_id), hex(&upstream.span_id))
    );
    let a = &request.attributes;
    assert_eq!(string(a, "http.request.method").as_deref(), Some("POST"));
    assert_eq!(string(a, "http.route").as_deref(), Some("/v1/chat/completions"));
    assert_eq!(int(a, "http.response.status_code"), Some(200));
    assert_eq!(string(a, "gen_ai.request.model").as_deref(), Some("m"));
    assert_eq!(string(a, "dprouter.policy").as_deref(), Some("cache_aware"));
    assert_eq!(string(a, "dprouter.endpoint").as_deref(), Some("w0r0"));
    assert_eq!(int(a, "dprouter.rank"), Some(0));
    assert!(string(a, "dprouter.branch").is_some(), "{a:?}");
    assert_eq!(int(a, "dprouter.retries"), Some(0));
    assert_eq!(int(a, "gen_ai.usage.input_tokens"), Some(12));
    assert_eq!(int(a, "dprouter.cached_tokens"), Some(8));
    assert_eq!(int(a, "gen_ai.usage.output_tokens"), Some(3));
    assert!(int(a, "dprouter.predicted_cached_tokens").is_some(), "{a:?}");
    assert!(matches!(attribute(a, "dprouter.ttft_ms"), Some(AnyValue::DoubleValue(ms)) if *ms >= 0.0));
    let u = &upstream.attributes;
    assert_eq!(string(u, "dprouter.endpoint").as_deref(), Some("w0r0"));
    assert_eq!(int(u, "dprouter.attempt"), Some(1));
    assert_eq!(int(u, "http.response.status_code"), Some(200));
    request
}

const FAST: [(&str, &str); 2] = [
    ("OTEL_BSP_SCHEDULE_DELAY", "50"),
    ("OTEL_SERVICE_NAME", "dprouter-test"),
];

#[tokio::test]
async fn over_grpc_the_spans_join_the_clients_trace_and_the_engine_nests_under_the_attempt() {
    let (collector, endpoint) = grpc_collector().await;
    let engine = echo_engine().await;
    let env = [FAST[0], FAST[1], ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())];
    let gw = gateway(&engine, &env, &[], None);
    let c = client();
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_PARENT}-01");
    let headers = [
        ("traceparent", traceparent.as_str()),
        ("tracestate", "rojo=00f067aa0ba902b7"),
        ("baggage", "user=alice"),
        ("x-request-id", "req-1"),
    ];
    let reply = post(&c, &format!("{}/v1/chat/completions", gw.url), &headers, &chat()).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let saw = &reply.json["headers"];
    // The client's state and baggage go on as they came.
    assert_eq!(saw["tracestate"], "rojo=00f067aa0ba902b7");
    assert_eq!(saw["baggage"], "user=alice");
    let spans = collector.trace(CLIENT_TRACE, 2).await;
    let request = check_spans(&spans, saw, Some(CLIENT_PARENT));
    assert_eq!(
        string(&request.attributes, "dprouter.request_id").as_deref(),
        Some("req-1")
    );
}

#[tokio::test]
async fn over_http_a_request_without_a_valid_trace_starts_one_named_in_the_access_log_and_error_bodies() {
    let (collector, base) = http_collector().await;
    let engine = echo_engine().await;
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("tracing-access-log.toml");
    std::fs::write(&config, "[server]\naccess_log = true\n").unwrap();
    let env = [
        FAST[0],
        FAST[1],
        ("OTEL_EXPORTER_OTLP_ENDPOINT", base.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
    ];
    let (lines, log) = std::sync::mpsc::channel();
    let gw = gateway(&engine, &env, &["--config", config.to_str().unwrap()], Some(lines));
    let c = client();
    // A traceparent that does not parse is no parent: the request starts a trace of its own (its span is a root:
    // `check_spans`).
    let malformed = [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01")];
    let reply = post(&c, &format!("{}/v1/chat/completions", gw.url), &malformed, &chat()).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let saw = &reply.json["headers"];
    let trace_id = saw["traceparent"].as_str().unwrap()[3..35].to_string();
    let spans = collector.trace(&trace_id, 2).await;
    check_spans(&spans, saw, None);
    // The access log line names the trace.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut logged = None;
    while let Ok(line) = log.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if line.contains("dprouter::access") && line.contains("/v1/chat/completions") {
            logged = Some(line);
            break;
        }
    }
    let logged = logged.expect("an access log line");
    assert!(
        logged.contains(&format!("trace_id=\"{trace_id}\"")) || logged.contains(&format!("trace_id={trace_id}")),
        "{logged}"
    );
    // A request the gateway refuses itself: its body names the request and the trace, and the trace has it.
    let refused = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url),
        &[("x-request-id", "bad-1")],
        &json!([1]),
    )
    .await;
    assert_eq!(refused.status, 400, "{}", refused.text);
    let error = &refused.json["error"];
    assert_eq!(error["request_id"], "bad-1");
    let refused_trace = error["trace_id"].as_str().unwrap().to_string();
    assert_eq!(refused_trace.len(), 32, "{error}");
    let spans = collector.trace(&refused_trace, 1).await;
    assert_eq!(spans.len(), 1, "no attempt for a refused request: {spans:#?}");
    assert_eq!(int(&spans[0].1.attributes, "http.response.status_code"), Some(400));
}

#[tokio::test]
async fn a_collector_that_never_answers_costs_the_requests_no_wait_and_a_bounded_queue() {
    // It accepts every connection and never reads or writes.
    let stalled = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", stalled.local_addr().unwrap());
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = Arc::clone(&held);
    tokio::spawn(async move {
        while let Ok((socket, _)) = stalled.accept().await {
            keep.lock().unwrap().push(socket);
        }
    });
    let engine = echo_engine().await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "10"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "64"),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "16"),
        // Far longer than any request may take here: an export in a request's way would show.
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "60000"),
    ];
    let gw = gateway(&engine, &env, &[], None);
    let pid = gw.child.id();
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url);
    let send_all = |n: usize| {
        let (c, url) = (c.clone(), url.clone());
        async move {
            let mut slowest = Duration::ZERO;
            for _ in 0..n {
                let started = Instant::now();
                let reply = post(&c, &url, &[], &chat()).await;
                assert_eq!(reply.status, 200, "{}", reply.text);
                slowest = slowest.max(started.elapsed());
            }
            slowest
        }
    };
    send_all(300).await;
    let warm = memory::rss(pid);
    let slowest = send_all(3000).await;
    let after = memory::rss(pid);
    assert!(slowest < Duration::from_secs(5), "a request took {slowest:?}");
    assert!(
        after < warm + (16 << 20),
        "memory grew from {} MB to {} MB",
        warm >> 20,
        after >> 20
    );
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    let dropped: f64 = metrics
        .lines()
        .find(|l| l.starts_with("dprouter_trace_spans_dropped_total{reason=\"queue_full\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no queue_full drops counted:\n{metrics}"));
    // 6,600 spans, at most 64 queued and 16 in the export that hangs.
    assert!(dropped >= 6000.0, "{dropped}");
}
