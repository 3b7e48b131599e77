//! Faults that must not take the gateway's fleet down: requests the engine refuses, engines that fail, stall or
//! never answer. `dprouter serve` processes in front of `dprouter mock-engine` processes or of a scripted engine
//! in this test, on loopback.
#![allow(clippy::unwrap_used)]

mod common;
#[path = "faults/workers.rs"]
mod workers;

use std::time::{Duration, Instant};

use common::{client, get, in_flight, post, Proc};
use hyper::StatusCode;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A config file for `serve --config`, in the test's own temporary directory.
fn config_file(name: &str, text: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("faults-{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn gateway(worker: &str, config: Option<&str>, extra: &[&str]) -> Proc {
    let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--worker", worker];
    if let Some(path) = config {
        args.extend(["--config", path]);
    }
    args.extend_from_slice(extra);
    Proc::start(&args)
}

/// Endpoint health from `GET /workers`, in global rank order.
async fn health(c: &common::HttpClient, gw: &str) -> Vec<bool> {
    let workers = get(c, &format!("{gw}/workers")).await.json;
    workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["endpoints"].as_array().unwrap().iter())
        .map(|e| e["healthy"].as_bool().unwrap())
        .collect()
}

fn generate(text: &str, stream: bool) -> Value {
    json!({"text": text, "sampling_params": {"max_new_tokens": 4}, "stream": stream})
}

/// An SGLang-like engine with two ranks, scripted at the TCP level: it answers `/health` and `/get_server_info`,
/// closes the connection without a word on any body over 100 kB (as engines and proxies in front of them do
/// with bodies over their limit), answers small requests, and for `"stream": true` sends half an event and then
/// stalls for good.
async fn scripted_engine() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(serve_one(socket));
        }
    });
    url
}

async fn serve_one(mut socket: TcpStream) {
    let Some((head, length)) = common::read_head(&mut socket).await else {
        return;
    };
    let answer = common::json_answer;
    if head.starts_with("get /health") {
        let _ = socket.write_all(answer("{}").as_bytes()).await;
    } else if head.starts_with("get /get_server_info") {
        let _ = socket
            .write_all(answer(r#"{"dp_size": 2, "max_total_num_tokens": 100000}"#).as_bytes())
            .await;
    } else if length > 100_000 {
        // Refused: the connection closes under the client's feet.
    } else {
        let mut body = vec![0u8; length];
        if socket.read_exact(&mut body).await.is_err() {
            return;
        }
        if String::from_utf8_lossy(&body).contains(r#""stream":true"#) {
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            let half = "data: {\"text\": \"par";
            let _ = socket
                .write_all(format!("{head}{:x}\r\n{half}\r\n", half.len()).as_bytes())
                .await;
            tokio::time::sleep(Duration::from_secs(30)).await;
        } else {
            // It tells whether the gateway passed `Accept-Encoding` on, and tries to set a cookie.
            let text = if head.contains("accept-encoding") {
                "compressible"
            } else {
                "ok"
            };
            let body = format!(r#"{{"text": "{text}", "meta_info": {{"prompt_tokens": 3, "cached_tokens": 0}}}}"#);
            let reply = answer(&body).replacen("\r\n\r\n", "\r\nset-cookie: engine=1\r\nx-engine: scripted\r\n\r\n", 1);
            let _ = socket.write_all(reply.as_bytes()).await;
        }
    }
}

/// Outlier ejection: endpoints that fail while the others do not are ejected (at most half the fleet, the default
/// `max_ejection_percent`: the rule itself is unit-tested in `registry.rs`), the rest keep serving, and clients
/// see the engine's own errors, never a gateway 503 for want of endpoints. When every endpoint fails alike, none
/// is an outlier and none is ejected: ejecting would only cut capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ejection_takes_outliers_only_and_never_more_than_half_of_the_fleet() {
    let failing = Proc::engine(&["--dp-size", "2", "--error-rate", "1"]);
    let fine = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&failing, &fine], &["--policy", "round_robin"]);
    let c = client();
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..60 {
        let reply = post(
            &c,
            &format!("{}/generate", gw.url),
            &[],
            &generate(&format!("p{i}"), false),
        )
        .await;
        *statuses.entry(reply.status.as_u16()).or_insert(0) += 1;
    }
    assert_eq!(
        statuses.keys().copied().collect::<Vec<_>>(),
        vec![200, 500],
        "{statuses:?}"
    );
    assert_eq!(
        health(&c, &gw.url).await,
        vec![false, false, true, true],
        "the failing worker's ranks are out"
    );
    assert_eq!(in_flight(&c, &gw.url).await, 0);

    let engine = Proc::engine(&["--dp-size", "4", "--error-rate", "1"]);
    let gw = gateway(&engine.url, None, &["--policy", "round_robin"]);
    for i in 0..40 {
        let reply = post(
            &c,
            &format!("{}/generate", gw.url),
            &[],
            &generate(&format!("q{i}"), false),
        )
        .await;
        assert_eq!(
            reply.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "request {i}: {}",
            reply.text
        );
    }
    assert_eq!(
        health(&c, &gw.url).await,
        vec![true; 4],
        "failing alike, nobody is an outlier"
    );
}

/// A client that pins a rank and gets the engine's failures there (here a rank that answers 503 to everything)
/// cannot eject that rank, however often it tries, while the other rank serves: a request's own fault never
/// counts against an endpoint. The same failures on requests the gateway placed do eject it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_of_requests_pinned_to_a_rank_never_eject_it() {
    let engine = Proc::engine(&["--dp-size", "2", "--dead-rank", "1"]);
    let gw = gateway(&engine.url, None, &["--policy", "round_robin"]);
    let c = client();
    for i in 0..32 {
        let mut body = generate(&format!("pinned {i}"), false);
        body["routed_dp_rank"] = json!(i % 2);
        let reply = post(&c, &format!("{}/generate", gw.url), &[], &body).await;
        let expected = [StatusCode::OK, StatusCode::SERVICE_UNAVAILABLE][i % 2];
        assert_eq!(reply.status, expected, "{}", reply.text);
    }
    assert_eq!(health(&c, &gw.url).await, vec![true, true]);
    for i in 0..8 {
        post(
            &c,
            &format!("{}/generate", gw.url),
            &[],
            &generate(&format!("placed {i}"), false),
        )
        .await;
    }
    assert_eq!(health(&c, &gw.url).await, vec![true, false]);
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}

/// A worker whose `/health` answers slower than the probe's timeout (busy with a burst) while it serves requests
/// stays up: every request of a steady stream is answered. Once no request is answered within a probe interval,
/// the slow probes count again and mark it down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_health_check_does_not_take_down_a_worker_that_is_serving() {
    let engine = Proc::engine(&["--dp-size", "2", "--health-delay-ms", "400"]);
    let config = config_file(
        "slow-health",
        "[health]\ninterval_ms = 300\ntimeout_ms = 150\nfailure_threshold = 2\n",
    );
    let gw = gateway(&engine.url, Some(&config), &[]);
    let c = client();
    let until = Instant::now() + Duration::from_secs(3);
    let mut statuses = Vec::new();
    while Instant::now() < until {
        let reply = post(&c, &format!("{}/generate", gw.url), &[], &generate("busy", false)).await;
        statuses.push(reply.status);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(statuses.iter().all(|s| *s == StatusCode::OK), "{statuses:?}");
    assert_eq!(health(&c, &gw.url).await, vec![true, true]);
    let down = common::eventually(Duration::from_secs(5), || async {
        health(&c, &gw.url).await == vec![false, false]
    });
    assert!(down.await, "idle, its slow probes count");
}

/// The engine's cookies and the gateway's own hop-by-hop headers stay behind; `Accept-Encoding` is not passed on
/// (a compressed answer would hide the usage report); the engine's other headers reach the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_are_filtered_both_ways() {
    let engine = scripted_engine().await;
    let gw = gateway(&engine, None, &["--policy", "round_robin"]);
    let c = client();
    let response = common::send(
        &c,
        &format!("{}/generate", gw.url),
        &[("accept-encoding", "gzip, br")],
        generate("hi", false).to_string(),
    )
    .await;
    let headers = response.headers().clone();
    let reply = common::read(response).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(reply.json["text"], "ok", "Accept-Encoding reached the engine");
    assert!(headers.get("set-cookie").is_none(), "{headers:?}");
    assert_eq!(headers.get("x-engine").unwrap(), "scripted");
}

/// Established TCP connections to `port` on this machine (IPv4 and IPv6), from `/proc/net`.
fn established_to(port: u16) -> usize {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|t| t.lines().skip(1).map(str::to_owned).collect::<Vec<_>>())
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // local_address remote_address st: the engine's side is local on `port`, state 01 = ESTABLISHED.
            f.len() > 3 && f[1].ends_with(&format!(":{port:04X}")) && f[3] == "01"
        })
        .count()
}

/// Upstream connections left idle after a burst are closed after `upstream_idle_timeout_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_are_closed() {
    let engine = Proc::engine(&["--dp-size", "2", "--first-byte-delay-ms", "300"]);
    let port: u16 = engine.url.rsplit(':').next().unwrap().parse().unwrap();
    let config = config_file("idle-pool", "upstream_idle_timeout_ms = 500\n");
    let gw = gateway(&engine.url, Some(&config), &["--policy", "round_robin"]);
    let c = client();
    let url = format!("{}/generate", gw.url);
    let bodies: Vec<Value> = (0..8).map(|i| generate(&format!("b{i}"), false)).collect();
    let burst = bodies.iter().map(|b| post(&c, &url, &[], b));
    for reply in futures_util::future::join_all(burst).await {
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    }
    assert!(
        established_to(port) >= 4,
        "the burst opened connections: {}",
        established_to(port)
    );
    let closed = common::eventually(Duration::from_secs(5), || async { established_to(port) == 0 }).await;
    assert!(closed, "{} connections still open", established_to(port));
}

/// The worker gets the client's own bytes (numbers, spacing and key order as sent), minus the client's rank
/// override members, plus the rank member for SGLang: the gateway never re-serializes a body, so it never
/// reformats what the engine reads, and never holds a second copy of a large body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_gets_the_clients_bytes() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = format!("http://{}", listener.local_addr().unwrap());
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let seen_tx = seen_tx.clone();
            tokio::spawn(async move {
                let mut data = Vec::new();
                let mut buf = [0u8; 4096];
                let (head_end, length) = loop {
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    data.extend_from_slice(&buf[..n]);
                    if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&data[..end]).to_ascii_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        break (end + 4, length);
                    }
                };
                while data.len() < head_end + length {
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    data.extend_from_slice(&buf[..n]);
                }
                let head = String::from_utf8_lossy(&data[..head_end]).to_string();
                let reply = if head.starts_with("GET /get_server_info") {
                    r#"{"dp_size": 2}"#.to_string()
                } else {
                    if head.starts_with("POST") {
                        let _ = seen_tx.send(String::from_utf8_lossy(&data).to_string());
                    }
                    "{}".to_string()
                };
                let _ = socket
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{reply}",
                            reply.len()
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });
    let gw = gateway(&engine, None, &["--policy", "round_robin"]);
    let c = client();
    let body = "{ \"routed_dp_rank\" : 1 ,\"text\":  \"h\\u00e9llo\", \"temperature\": 1e2,\n \"z\": [ 1 , 2.50 ], \"data_parallel_rank\": 0 }";
    let response = common::send(&c, &format!("{}/generate", gw.url), &[], body.to_string()).await;
    assert_eq!(response.status(), StatusCode::OK);
    let seen = seen_rx.recv().await.unwrap();
    let (head, sent) = seen.split_once("\r\n\r\n").unwrap();
    assert_eq!(
        sent,
        "{\"routed_dp_rank\":1,\"text\":  \"h\\u00e9llo\",\"temperature\": 1e2,\"z\": [ 1 , 2.50 ]}"
    );
    assert!(!head.to_ascii_lowercase().contains("x-data-parallel-rank"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("\r\nx-request-id: "),
        "the engine gets the request id: {head}"
    );
    // `rank_field = "header"`: on `/v1/*` the rank goes in the header and the body exactly as the client sent it
    // (less the client's own override members); `/generate` keeps the body field.
    let config = config_file(
        "rank-header",
        &format!("[[workers]]\nurl = \"{engine}\"\nrank_field = \"header\"\n"),
    );
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--config",
        &config,
        "--policy",
        "round_robin",
    ]);
    let completion = "{\"prompt\": \"h\\u00e9llo\",\n \"routed_dp_rank\": 1, \"max_tokens\" :2}";
    let response = common::send(&c, &format!("{}/v1/completions", gw.url), &[], completion.to_string()).await;
    assert_eq!(response.status(), StatusCode::OK);
    let seen = seen_rx.recv().await.unwrap();
    let (head, sent) = seen.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase().contains("x-data-parallel-rank: 1\r\n"),
        "{head}"
    );
    assert_eq!(sent, "{\"prompt\": \"h\\u00e9llo\",\"max_tokens\" :2}");
    let response = common::send(&c, &format!("{}/generate", gw.url), &[], body.to_string()).await;
    assert_eq!(response.status(), StatusCode::OK);
    let seen = seen_rx.recv().await.unwrap();
    assert!(seen.contains("\r\n\r\n{\"routed_dp_rank\":1,\"text\""), "{seen}");
}

/// An engine that answers 503 to everything (a rank that failed to start, an engine shutting down): clients see
/// its 503s until its endpoint is ejected, a few requests in, and none after; the healthy worker serves the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_503s_ejects_the_endpoint_after_a_few_requests() {
    let bad = Proc::engine(&["--dp-size", "1", "--unavailable-rate", "1"]);
    let good = Proc::engine(&["--dp-size", "1"]);
    let gw = Proc::gateway(&[&bad, &good], &["--policy", "round_robin"]);
    let c = client();
    let mut statuses = Vec::new();
    for i in 0..30 {
        statuses.push(
            post(
                &c,
                &format!("{}/generate", gw.url),
                &[],
                &generate(&format!("r{i}"), false),
            )
            .await
            .status,
        );
    }
    let unavailable = statuses
        .iter()
        .filter(|s| **s == StatusCode::SERVICE_UNAVAILABLE)
        .count();
    assert!((3..=4).contains(&unavailable), "{statuses:?}");
    assert!(statuses[10..].iter().all(|s| *s == StatusCode::OK), "{statuses:?}");
    assert_eq!(health(&c, &gw.url).await, vec![false, true]);
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}

/// `GET /v1/models` from a worker that accepts connections and never answers: it is passed over after a bounded
/// wait and the next worker answers; the client's `Authorization` goes with the question (an engine with an API
/// key answers 401 without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_pass_over_a_stuck_worker_and_carry_the_key() {
    let stuck = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stuck_url = format!("http://{}", stuck.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = stuck.accept().await {
            held.push(socket);
        }
    });
    let keyed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let keyed_url = format!("http://{}", keyed.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = keyed.accept().await {
            tokio::spawn(async move {
                let Some((head, _)) = common::read_head(&mut socket).await else {
                    return;
                };
                let reply = if head.starts_with("get /health") {
                    common::json_answer("{}")
                } else if head.contains("authorization: bearer sk-test\r\n") {
                    common::json_answer(r#"{"object":"list","data":[{"id":"smollm2","object":"model"}]}"#)
                } else {
                    common::json_answer(r#"{"error":{"message":"Invalid API Key"}}"#).replacen(
                        "200 OK",
                        "401 Unauthorized",
                        1,
                    )
                };
                let _ = socket.write_all(reply.as_bytes()).await;
            });
        }
    });
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--backend",
        "openai",
        "--worker",
        &stuck_url,
        "--worker",
        &keyed_url,
    ]);
    let c = client();
    let models = format!("{}/v1/models", gw.url);
    let asked = Instant::now();
    let request = hyper::Request::get(&models)
        .header("authorization", "Bearer sk-test")
        .body(Default::default());
    let reply = common::read(c.request(request.unwrap()).await.unwrap()).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(reply.json["data"][0]["id"], "smollm2");
    assert!(asked.elapsed() < Duration::from_secs(15), "took {:?}", asked.elapsed());
    // Without the key the engine's own 401 comes back; `/models` (no `/v1`) is the same route.
    let reply = get(&c, &format!("{}/models", gw.url)).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.text);
}
