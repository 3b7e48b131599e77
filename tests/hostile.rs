//! Hostile requests, table-driven: each gets the right status with an OpenAI-style JSON error body, none reaches
//! the worker, and the gateway serves the next good request. Raw HTTP over TCP, so malformed requests can be
//! sent as they are. The answers hyper gives before the gateway sees the request (a request line or headers it
//! cannot parse, a head or URI over its own limits) are in the same JSON (`parse_errors.rs`).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::Proc;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A worker that counts the generation requests reaching it and answers them; it answers probes and discovery.
async fn counting_engine() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(answer(socket, Arc::clone(&counter)));
        }
    });
    (url, seen)
}

async fn answer(mut socket: TcpStream, seen: Arc<AtomicUsize>) {
    let Some((head, length)) = common::read_head(&mut socket).await else {
        return;
    };
    let mut body = vec![0u8; length];
    let _ = socket.read_exact(&mut body).await;
    let reply = if head.starts_with("get /get_server_info") {
        r#"{"dp_size": 2}"#
    } else if head.starts_with("post ") {
        seen.fetch_add(1, Ordering::SeqCst);
        r#"{"text": "ok", "meta_info": {"prompt_tokens": 1, "cached_tokens": 0}}"#
    } else {
        "{}"
    };
    let _ = socket.write_all(common::json_answer(reply).as_bytes()).await;
}

/// Sends `request` as raw bytes and reads the answer: its status and body. The connection is closed by the
/// request (`Connection: close`) or by the gateway.
async fn raw(addr: &str, request: &[u8]) -> (u16, String) {
    let mut socket = TcpStream::connect(addr).await.unwrap();
    // The gateway may answer (and close) before it has read everything: that is not this helper's failure.
    let _ = socket.write_all(request).await;
    let mut response = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 8192];
        loop {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => response.extend_from_slice(&buf[..n]),
            }
            if complete(&response) {
                break;
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "no answer within 10 s to {:.200}",
        String::from_utf8_lossy(request)
    );
    let text = String::from_utf8_lossy(&response).to_string();
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    (status, body)
}

/// Whether `response` holds a whole response with a `Content-Length`.
fn complete(response: &[u8]) -> bool {
    let text = String::from_utf8_lossy(response);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    head.to_ascii_lowercase()
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .is_some_and(|n| body.len() >= n)
}

fn post(path: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

fn json_post(body: &str) -> Vec<u8> {
    post("/v1/completions", "application/json", body.as_bytes())
}

fn with_header(header: &str, body: &str) -> Vec<u8> {
    let body = body.as_bytes();
    let mut out = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{header}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

fn method(method: &str, path: &str) -> Vec<u8> {
    format!("{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").into_bytes()
}

const CHAT: &str = r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}"#;

/// (name, request, expected status)
fn cases() -> Vec<(&'static str, Vec<u8>, u16)> {
    let deep = format!("{}1{}", "[".repeat(5000), "]".repeat(5000));
    let deep_messages = format!(r#"{{"messages": [{{"role": "user", "content": {deep}}}]}}"#);
    let huge_ids = format!(r#"{{"input_ids": [{}]}}"#, vec!["7"; 40_000].join(","));
    let long_path = format!("/v1/completions?{}", "a".repeat(20_000));
    let big_header = format!("x-filler: {}", "b".repeat(70_000));
    let many_headers = (0..200).map(|i| format!("x-h{i}: v")).collect::<Vec<_>>().join("\r\n");
    let mut cases: Vec<(&'static str, Vec<u8>, u16)> = vec![
        // Malformed JSON.
        ("empty body", json_post(""), 400),
        ("open brace", json_post("{"), 400),
        ("unclosed array", json_post("[1, 2"), 400),
        ("trailing comma", json_post(r#"{"prompt": "x",}"#), 400),
        ("bare word", json_post("nul"), 400),
        ("trailing garbage", json_post(r#"{"prompt": "x"} x"#), 400),
        ("single quotes", json_post("{'prompt': 'x'}"), 400),
        ("lone surrogate", json_post(r#"{"prompt": "\ud800"}"#), 400),
        ("bad escape", json_post(r#"{"prompt": "\q"}"#), 400),
        (
            "control character in string",
            json_post("{\"prompt\": \"a\u{1}b\"}"),
            400,
        ),
        ("NaN", json_post(r#"{"prompt": "x", "temperature": NaN}"#), 400),
        ("deep nesting", json_post(&deep), 400),
        ("deep nesting in messages", json_post(&deep_messages), 400),
        // Not an object, or no prompt.
        ("array body", json_post("[]"), 400),
        ("string body", json_post(r#""prompt""#), 400),
        ("number body", json_post("42"), 400),
        ("null body", json_post("null"), 400),
        ("empty object", json_post("{}"), 400),
        ("only nulls", json_post(r#"{"prompt": null, "messages": null}"#), 400),
        // Wrong types.
        ("prompt number", json_post(r#"{"prompt": 5}"#), 400),
        ("prompt object", json_post(r#"{"prompt": {"a": 1}}"#), 400),
        ("prompt batch", json_post(r#"{"prompt": ["a", "b"]}"#), 400),
        ("messages string", json_post(r#"{"messages": "hi"}"#), 400),
        ("messages numbers", json_post(r#"{"messages": [1, 2]}"#), 400),
        (
            "message role number",
            json_post(r#"{"messages": [{"role": 1, "content": "x"}]}"#),
            400,
        ),
        ("text number", json_post(r#"{"text": 12}"#), 400),
        ("input_ids string", json_post(r#"{"input_ids": "abc"}"#), 400),
        ("input_ids mixed", json_post(r#"{"input_ids": [1, "a"]}"#), 400),
        ("input_ids float", json_post(r#"{"input_ids": [1.5]}"#), 400),
        ("input_ids negative", json_post(r#"{"input_ids": [-1]}"#), 400),
        ("input_ids huge", json_post(r#"{"input_ids": [99999999999]}"#), 400),
        ("input_ids 1e400", json_post(r#"{"input_ids": [1e400]}"#), 400),
        ("input_ids batch", json_post(r#"{"input_ids": [[1, 2], [3]]}"#), 400),
        (
            "bootstrap_room string",
            json_post(r#"{"prompt": "x", "bootstrap_room": "r"}"#),
            400,
        ),
        (
            "bootstrap_room negative",
            json_post(r#"{"prompt": "x", "bootstrap_room": -5}"#),
            400,
        ),
        // Bad overrides.
        (
            "override negative",
            json_post(r#"{"prompt": "x", "routed_dp_rank": -1}"#),
            400,
        ),
        (
            "override out of range",
            json_post(r#"{"prompt": "x", "routed_dp_rank": 99}"#),
            400,
        ),
        (
            "override string",
            json_post(r#"{"prompt": "x", "routed_dp_rank": "1"}"#),
            400,
        ),
        (
            "override float",
            json_post(r#"{"prompt": "x", "routed_dp_rank": 1.5}"#),
            400,
        ),
        (
            "override 1e100",
            json_post(r#"{"prompt": "x", "data_parallel_rank": 1e100}"#),
            400,
        ),
        (
            "override i64 max",
            json_post(r#"{"prompt": "x", "routed_dp_rank": 9223372036854775807}"#),
            400,
        ),
        (
            "override header text",
            with_header("x-data-parallel-rank: two", CHAT),
            400,
        ),
        (
            "override header negative",
            with_header("x-data-parallel-rank: -3", CHAT),
            400,
        ),
        (
            "override header out of range",
            with_header("x-data-parallel-rank: 7", CHAT),
            400,
        ),
        (
            "first-byte timeout header",
            with_header("x-dprouter-first-byte-timeout-ms: soon", CHAT),
            400,
        ),
        // Invalid UTF-8.
        (
            "invalid utf-8 in string",
            post("/generate", "application/json", b"{\"text\": \"\xff\xfe\"}"),
            400,
        ),
        (
            "invalid utf-8 body",
            post("/generate", "application/json", b"\xc3\x28\xa0\xa1"),
            400,
        ),
        // Wrong methods.
        ("GET chat", method("GET", "/v1/chat/completions"), 405),
        ("PUT generate", method("PUT", "/generate"), 405),
        ("DELETE completions", method("DELETE", "/v1/completions"), 405),
        ("POST models", method("POST", "/v1/models"), 405),
        ("POST health", method("POST", "/health"), 405),
        // Wrong content types.
        (
            "text/plain",
            post("/v1/completions", "text/plain", br#"{"prompt": "x"}"#),
            415,
        ),
        (
            "form",
            post("/v1/completions", "application/x-www-form-urlencoded", b"prompt=x"),
            415,
        ),
        (
            "multipart",
            post("/generate", "multipart/form-data; boundary=x", b"--x--"),
            415,
        ),
        (
            "json lookalike",
            post("/generate", "application/jsonp", br#"{"text": "x"}"#),
            415,
        ),
        // Unknown routes.
        ("unknown route", method("POST", "/v1/embeddings/x"), 404),
        ("path traversal", method("GET", "/../../etc/passwd"), 404),
        // Sizes.
        ("declared too large", with_declared_length(100 << 20), 413),
        ("body over the limit", json_post(&huge_ids), 413),
        ("truncated body", truncated_body(), 408),
        ("long URL", method("POST", &long_path), 414),
        ("large header", with_header(&big_header, CHAT), 431),
        ("many headers", with_header(&many_headers, CHAT), 431),
        // Past hyper's own limits, and malformed HTTP: answered by hyper before the gateway sees a request, with
        // the gateway's JSON errors.
        (
            "URI past hyper's limit",
            method("GET", &format!("/v1/models?{}", "u".repeat(70_000))),
            414,
        ),
        (
            "head past hyper's buffer",
            with_header(&format!("x-filler: {}", "b".repeat(1_000_000)), CHAT),
            431,
        ),
        (
            "headers past hyper's count",
            with_header(
                &(0..500).map(|i| format!("x-h{i}: v")).collect::<Vec<_>>().join("\r\n"),
                CHAT,
            ),
            431,
        ),
        ("garbage request line", b"GARBAGE\r\n\r\n".to_vec(), 400),
        (
            "bad header name",
            b"POST /generate HTTP/1.1\r\nbad header: x\r\n\r\n".to_vec(),
            400,
        ),
        (
            "bad content-length",
            b"POST /generate HTTP/1.1\r\ncontent-length: abc\r\n\r\n".to_vec(),
            400,
        ),
    ];
    cases.sort_by_key(|c| c.0);
    cases
}

fn with_declared_length(n: usize) -> Vec<u8> {
    format!(
        "POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {n}\r\nconnection: close\r\n\r\n{{"
    )
    .into_bytes()
}

fn truncated_body() -> Vec<u8> {
    b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\nconnection: close\r\n\r\n{\"text\": \"x"
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_clear_errors_and_never_reach_the_worker() {
    let (engine, seen) = counting_engine().await;
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hostile.toml");
    std::fs::write(
        &config,
        "max_body_bytes = 65536\n[server]\nrequest_body_timeout_ms = 500\n",
    )
    .unwrap();
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        &engine,
        "--policy",
        "round_robin",
        "--config",
        config.to_str().unwrap(),
    ]);
    let addr = gw.url.trim_start_matches("http://").to_string();
    let cases = cases();
    assert!(cases.len() >= 60, "{} cases", cases.len());
    let mut failures = Vec::new();
    for (name, request, status) in &cases {
        let (got, body) = raw(&addr, request).await;
        let parsed: Option<Value> = serde_json::from_str(&body).ok();
        let json_ok = parsed.as_ref().is_some_and(|v| {
            v["error"]["message"].as_str().is_some_and(|m| !m.is_empty())
                && v["error"]["type"].is_string()
                && v["error"]["code"] == *status
        });
        if got != *status || !json_ok {
            failures.push(format!("{name}: got {got} {body:.300}"));
        }
        // The next good request still succeeds.
        let (good, body) = raw(&addr, &json_post(r#"{"prompt": "fine", "max_tokens": 1}"#)).await;
        if good != 200 {
            failures.push(format!("after {name}: a good request got {good} {body:.200}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert_eq!(
        seen.load(Ordering::SeqCst),
        cases.len(),
        "only the good requests reached the worker"
    );
}
