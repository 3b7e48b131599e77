//! The request pipeline in process, on a paused clock: `serve(listener, …)` in front of an engine scripted at the
//! TCP level in the same runtime, on loopback. Tokio's paused clock jumps to the next deadline whenever every task
//! waits (after polling the sockets once), so the timeouts under test pass at once and exactly, with the
//! gateway's own defaults (a 300 s first-byte timeout, a 300 s stream idle timeout) rather than shortened ones.
//!
//! Each test's subject is a pipeline step: what counts against an endpoint (the outcome recorder), the retry after
//! a refused connection, the deadlines of an answer, and the load released on every path (no in-flight count
//! leaks). They moved here from `tests/faults.rs`, where each spawned a `dprouter serve` process and waited out
//! real timeouts.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use dprouter_core::config::NoOptions;
use dprouter_core::PolicyConfig;
use dprouter_gateway::upstream::{Chunks, Upstream};
use dprouter_gateway::{AppState, Backend, GatewayConfig, WorkerConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// The tests of this file one at a time: the metrics recorder is the process's, and each test reads its counters
/// before and after.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The sum of the counter `name`'s series whose labels contain `labels`, from `/metrics`.
async fn counter(c: &Upstream, gw: &str, name: &str, labels: &str) -> f64 {
    let metrics = send(c, "GET", &format!("{gw}/metrics"), &[], None).await.text;
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// How the scripted engine answers a POST.
#[derive(Clone, Copy)]
enum Script {
    /// A JSON answer with a usage report; a body over 100 kB is refused by closing the connection without a
    /// word (as engines and proxies in front of them do with bodies over their limit); `"stream": true` gets half
    /// an event, then nothing more, ever.
    Answers,
    /// Reads the request and never answers.
    Silent,
    /// Sends an event stream's head at once, and nothing after it.
    HeadOnly,
}

/// An SGLang-like engine with two ranks, scripted at the TCP level: `/health` and `/get_server_info` answered,
/// POSTs as `script` says.
async fn engine(script: Script) -> String {
    engine_and_its_listener(script).await.0
}

/// The engine, and its accept loop: aborted, the engine's port refuses connections.
async fn engine_and_its_listener(script: Script) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepting = tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(serve_one(socket, script));
        }
    });
    (url, accepting)
}

fn json_answer(body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

async fn read_head(socket: &mut TcpStream) -> Option<(String, usize)> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > 65_536 || socket.read(&mut byte).await.unwrap_or(0) == 0 {
            return None;
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    Some((head, length))
}

async fn serve_one(mut socket: TcpStream, script: Script) {
    let Some((head, length)) = read_head(&mut socket).await else {
        return;
    };
    if head.starts_with("get /health") {
        let _ = socket.write_all(json_answer("{}").as_bytes()).await;
        return;
    }
    if head.starts_with("get /get_server_info") {
        let info = r#"{"dp_size": 2, "max_total_num_tokens": 100000}"#;
        let _ = socket.write_all(json_answer(info).as_bytes()).await;
        return;
    }
    if matches!(script, Script::Answers) && length > 100_000 {
        // Refused: the connection closes under the client's feet.
        return;
    }
    let mut body = vec![0u8; length];
    if socket.read_exact(&mut body).await.is_err() {
        return;
    }
    match script {
        Script::Silent => std::future::pending().await,
        Script::HeadOnly => {
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            let _ = socket.write_all(head.as_bytes()).await;
            std::future::pending().await
        }
        Script::Answers if String::from_utf8_lossy(&body).contains(r#""stream":true"#) => {
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            let half = "data: {\"text\": \"par";
            let _ = socket
                .write_all(format!("{head}{:x}\r\n{half}\r\n", half.len()).as_bytes())
                .await;
            std::future::pending().await
        }
        Script::Answers => {
            let body = r#"{"text": "ok", "meta_info": {"prompt_tokens": 3, "cached_tokens": 0}}"#;
            let _ = socket.write_all(json_answer(body).as_bytes()).await;
        }
    }
}

/// A gateway in process in front of `workers`, round robin, with `tune` applied to its config.
async fn gateway(workers: &[&str], tune: impl FnOnce(&mut GatewayConfig)) -> String {
    let mut config = GatewayConfig::default();
    for url in workers {
        config.workers.push(WorkerConfig {
            url: url.to_string(),
            backend: Backend::Sglang,
            ..Default::default()
        });
    }
    config.routing = PolicyConfig::RoundRobin(NoOptions {});
    tune(&mut config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    config.listen = listener.local_addr().unwrap();
    let state = AppState::new(config.clone()).await.unwrap();
    tokio::spawn(dprouter_gateway::serve(listener, state, std::future::pending()));
    format!("http://{}", config.listen)
}

/// The client: no timeout of its own that the paused clock could reach first.
fn client() -> Upstream {
    let tls = dprouter_gateway::upstream::client_config(None, "ca").unwrap();
    Upstream::new(Duration::from_secs(3600), Duration::from_secs(3600), tls)
}

struct Reply {
    status: u16,
    text: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or(Value::Null)
    }
}

async fn send(c: &Upstream, method: &str, url: &str, headers: &[(&str, &str)], body: Option<&Value>) -> Reply {
    let mut request = hyper::Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let pieces = match body {
        Some(body) => {
            request = request.header("content-type", "application/json");
            vec![Bytes::from(body.to_string())]
        }
        None => Vec::new(),
    };
    let request = request.body(Chunks::new(pieces)).unwrap();
    let (status, _, bytes) = c.exchange(request, Duration::from_secs(3600), 64 << 20).await.unwrap();
    Reply {
        status: status.as_u16(),
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

fn generate(text: &str, stream: bool) -> Value {
    json!({"text": text, "sampling_params": {"max_new_tokens": 4}, "stream": stream})
}

/// Each endpoint's health and the requests in flight on all of them, from `GET /workers`.
async fn workers(c: &Upstream, gw: &str) -> (Vec<bool>, u64) {
    let workers = send(c, "GET", &format!("{gw}/workers"), &[], None).await.json();
    let endpoints: Vec<&Value> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["endpoints"].as_array().unwrap())
        .collect();
    let healthy = endpoints.iter().map(|e| e["healthy"].as_bool().unwrap()).collect();
    let in_flight = endpoints
        .iter()
        .map(|e| e["in_flight_requests"].as_u64().unwrap())
        .sum();
    (healthy, in_flight)
}

/// A body the engine refuses by closing the connection is the request's fault: a client that sends them over
/// and over must not eject a single endpoint.
#[tokio::test(start_paused = true)]
async fn bodies_the_engine_refuses_never_eject_an_endpoint() {
    let _serial = SERIAL.lock().await;
    let gw = gateway(&[&engine(Script::Answers).await], |_| {}).await;
    let c = client();
    let big = json!({"input_ids": vec![7u32; 60_000], "sampling_params": {"max_new_tokens": 1}});
    for _ in 0..12 {
        let reply = send(&c, "POST", &format!("{gw}/generate"), &[], Some(&big)).await;
        assert_eq!(reply.status, 502, "{}", reply.text);
        assert!(reply.json()["error"]["message"].is_string(), "{}", reply.text);
    }
    for i in 0..4 {
        let reply = send(
            &c,
            "POST",
            &format!("{gw}/generate"),
            &[],
            Some(&generate(&format!("small {i}"), false)),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text);
    }
    assert_eq!(workers(&c, &gw).await, (vec![true, true], 0));
}

/// A stream that stalls mid-way ends, after the stream idle timeout (the default, 300 s), with the partial line
/// closed and one error event that an OpenAI client can parse; the stall counts against the endpoint.
#[tokio::test(start_paused = true)]
async fn a_stream_that_stalls_ends_with_a_parsable_error_event_after_the_idle_timeout() {
    let _serial = SERIAL.lock().await;
    let gw = gateway(&[&engine(Script::Answers).await], |_| {}).await;
    let c = client();
    let timeouts = counter(&c, &gw, "dprouter_upstream_errors_total", "kind=\"timeout\"").await;
    let started = Instant::now();
    let reply = send(
        &c,
        "POST",
        &format!("{gw}/generate"),
        &[],
        Some(&generate("hello", true)),
    )
    .await;
    let took = started.elapsed();
    assert!(
        (Duration::from_secs(300)..Duration::from_secs(301)).contains(&took),
        "the idle timeout is 300 s: {took:?}"
    );
    assert_eq!(reply.status, 200);
    let events: Vec<&str> = reply.text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 2, "{:?}", reply.text);
    assert_eq!(
        events[0], "data: {\"text\": \"par",
        "the partial event is ended before the error"
    );
    let error: Value = serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["code"], 504, "{error}");
    assert!(!reply.text.contains("[DONE]"));
    let now = counter(&c, &gw, "dprouter_upstream_errors_total", "kind=\"timeout\"").await;
    assert_eq!(now - timeouts, 1.0, "the stall counts against the endpoint");
    assert_eq!(workers(&c, &gw).await.1, 0);
}

/// An engine that takes requests and never answers: the client gets a 504 with a JSON body exactly at the
/// first-byte timeout (the configured one, or a shorter one the client asks for; a malformed one is a 400), and
/// the load is released. An engine that sent its stream's head and no byte after it: the stream ends with an
/// error event that carries the 504.
#[tokio::test(start_paused = true)]
async fn an_engine_that_never_answers_gets_a_504_at_the_first_byte_timeout() {
    let _serial = SERIAL.lock().await;
    let gw = gateway(&[&engine(Script::Silent).await], |_| {}).await;
    let c = client();
    for (headers, after) in [
        (vec![], Duration::from_secs(300)),
        (
            vec![("x-dprouter-first-byte-timeout-ms", "200")],
            Duration::from_millis(200),
        ),
    ] {
        let started = Instant::now();
        let reply = send(
            &c,
            "POST",
            &format!("{gw}/generate"),
            &headers,
            Some(&generate("stuck", false)),
        )
        .await;
        let took = started.elapsed();
        assert!(
            (after..after + Duration::from_millis(100)).contains(&took),
            "{headers:?}: {took:?}"
        );
        assert_eq!(reply.status, 504, "{}", reply.text);
        assert_eq!(reply.json()["error"]["code"], 504, "{}", reply.text);
    }
    let bad = send(
        &c,
        "POST",
        &format!("{gw}/generate"),
        &[("x-dprouter-first-byte-timeout-ms", "soon")],
        Some(&generate("x", false)),
    )
    .await;
    assert_eq!(bad.status, 400, "{}", bad.text);
    assert_eq!(workers(&c, &gw).await.1, 0);

    let gw = gateway(&[&engine(Script::HeadOnly).await], |_| {}).await;
    let started = Instant::now();
    let reply = send(
        &c,
        "POST",
        &format!("{gw}/generate"),
        &[],
        Some(&generate("stuck", true)),
    )
    .await;
    let took = started.elapsed();
    assert!(
        (Duration::from_secs(300)..Duration::from_secs(301)).contains(&took),
        "{took:?}"
    );
    assert_eq!(reply.status, 200, "the stream's head was sent: {}", reply.text);
    let event = reply.text.trim().strip_prefix("data: ").unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(event).unwrap()["error"]["code"],
        504,
        "{}",
        reply.text
    );
    assert_eq!(workers(&c, &gw).await.1, 0);
}

/// A refused connection is retried on the policy's next choice before any byte reached the client (the one retry
/// rule), counted in `dprouter_retries_total`, and the endpoint that refused is counted, not the request.
#[tokio::test(start_paused = true)]
async fn a_refused_connection_is_retried_on_another_endpoint() {
    let _serial = SERIAL.lock().await;
    let live = engine(Script::Answers).await;
    let (dying, accepting) = engine_and_its_listener(Script::Answers).await;
    let gw = gateway(&[&live, &dying], |_| {}).await;
    let c = client();
    // The second worker's port refuses from now on; its ranks are still in the fleet until a probe says so.
    accepting.abort();
    let _ = accepting.await;
    let retries = counter(&c, &gw, "dprouter_retries_total", "").await;
    let refused = counter(&c, &gw, "dprouter_upstream_errors_total", "kind=\"connect\"").await;
    for i in 0..4 {
        let reply = send(
            &c,
            "POST",
            &format!("{gw}/generate"),
            &[],
            Some(&generate(&format!("r{i}"), false)),
        )
        .await;
        assert_eq!(reply.status, 200, "request {i}: {}", reply.text);
    }
    let retried = counter(&c, &gw, "dprouter_retries_total", "").await - retries;
    let connects = counter(&c, &gw, "dprouter_upstream_errors_total", "kind=\"connect\"").await - refused;
    assert!(retried >= 1.0, "a refused connection was retried");
    assert_eq!(
        retried, connects,
        "each retry follows one refused connection, counted against its endpoint"
    );
    let (healthy, in_flight) = workers(&c, &gw).await;
    assert_eq!(in_flight, 0);
    assert_eq!(
        healthy,
        [true, true, false, false],
        "the refusing worker is down after one probe"
    );
}

/// On Anthropic's Messages route the same faults end in Anthropic's shape: a stalled stream with an `event: error`
/// (`api_error`) after the idle timeout, an engine that never answers with a 504 body `{"type": "error", …}`.
#[tokio::test(start_paused = true)]
async fn on_the_messages_route_the_gateways_errors_are_anthropics() {
    let _serial = SERIAL.lock().await;
    let messages = |stream: bool| {
        json!({"model": "m", "max_tokens": 4, "stream": stream, "system": "s",
               "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]})
    };
    let gw = gateway(&[&engine(Script::Answers).await], |_| {}).await;
    let c = client();
    let reply = send(&c, "POST", &format!("{gw}/v1/messages"), &[], Some(&messages(true))).await;
    assert_eq!(reply.status, 200);
    let error = reply
        .text
        .split("\n\n")
        .find(|e| e.starts_with("event: error\n"))
        .unwrap_or_else(|| panic!("{}", reply.text));
    let data: Value = serde_json::from_str(error.lines().nth(1).unwrap().strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(
        (data["type"].as_str(), data["error"]["type"].as_str()),
        (Some("error"), Some("api_error")),
        "{data}"
    );
    assert_eq!(workers(&c, &gw).await.1, 0);

    let gw = gateway(&[&engine(Script::Silent).await], |_| {}).await;
    let reply = send(&c, "POST", &format!("{gw}/v1/messages"), &[], Some(&messages(false))).await;
    assert_eq!(reply.status, 504, "{}", reply.text);
    assert_eq!(reply.json()["type"], "error", "{}", reply.text);
    assert_eq!(reply.json()["error"]["type"], "api_error", "{}", reply.text);
    assert_eq!(workers(&c, &gw).await.1, 0);
}
