//! The gateway's client-side timeouts and limits (`[server]`), end to end: `dprouter serve` processes on loopback,
//! driven with raw TCP where a well-behaved HTTP client cannot misbehave enough.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{client, eventually, get, in_flight, post, Proc};
use hyper::StatusCode;
use serde_json::{json, Value};

/// A config file holding `text`, removed when dropped.
struct ConfigFile(PathBuf);

impl ConfigFile {
    fn new(name: &str, text: &str) -> Self {
        let path = std::env::temp_dir().join(format!("dprouter-limits-{}-{name}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        ConfigFile(path)
    }

    fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn gateway(engine: &Proc, name: &str, config: &str) -> (Proc, ConfigFile) {
    let file = ConfigFile::new(name, config);
    (Proc::gateway(&[engine], &["--config", file.arg()]), file)
}

fn connect(p: &Proc) -> TcpStream {
    let stream = TcpStream::connect(p.url.trim_start_matches("http://")).unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n";

/// The head of a generation request that declares a 1,000-byte body, and the first 10 bytes of it.
const SHORT_BODY: &[u8] =
    b"POST /generate HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"text\": \"";

/// Reads until the peer closes the connection or `limit` passes: what arrived, and when it closed if it did.
fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (String, Option<Duration>) {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = limit.saturating_sub(start.elapsed());
        if left.is_zero() {
            return (String::from_utf8_lossy(&got).into_owned(), None);
        }
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&got).into_owned(), Some(start.elapsed())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted) => {
                return (String::from_utf8_lossy(&got).into_owned(), Some(start.elapsed()))
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// Reads one response (its head and a `Content-Length` body) within `limit`; `None` if none came.
fn read_response(stream: &mut TcpStream, limit: Duration) -> Option<String> {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_string())
                })
                .map_or(0, |v| v.parse::<usize>().unwrap());
            if got.len() >= end + 4 + length {
                return Some(text);
            }
        }
        let left = limit.saturating_sub(start.elapsed());
        if left.is_zero() {
            return None;
        }
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return None,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted) => return None,
            Err(e) => panic!("read: {e}"),
        }
    }
}

fn json_body(response: &str) -> Value {
    serde_json::from_str(response.split("\r\n\r\n").nth(1).unwrap()).unwrap()
}

fn generate() -> Value {
    json!({"text": "hello", "sampling_params": {"max_new_tokens": 2}})
}

#[test]
fn slowloris_connections_are_closed_after_the_header_timeout() {
    let engine = Proc::engine(&[]);
    let (gw, _config) = gateway(&engine, "slowloris", "[server]\nheader_read_timeout_ms = 300\n");
    // A head trickled a byte every 50 ms: the timer runs from its first byte, later bytes do not extend it.
    let mut trickled = connect(&gw);
    let mut writer = trickled.try_clone().unwrap();
    let trickle = std::thread::spawn(move || {
        for byte in b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
            if writer.write_all(&[*byte]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    // And 20 connections that each sent part of a head and stopped.
    let mut partial: Vec<TcpStream> = (0..20).map(|_| connect(&gw)).collect();
    for s in &mut partial {
        s.write_all(b"POST /generate HTTP/1.1\r\nHost: gw\r\nContent-Le")
            .unwrap();
    }
    // A connection that has sent nothing is idle, not slow: the header timeout does not apply to it.
    let mut quiet = connect(&gw);
    let (_, closed) = read_until_closed(&mut trickled, Duration::from_secs(3));
    let closed = closed.expect("the trickled head was not cut off");
    assert!(closed >= Duration::from_millis(250), "closed after {closed:?}");
    for s in &mut partial {
        let (got, closed) = read_until_closed(s, Duration::from_secs(2));
        assert!(closed.is_some(), "a partial head was left open (read {got:?})");
    }
    trickle.join().unwrap();
    quiet.write_all(HEALTH).unwrap();
    let reply = read_response(&mut quiet, Duration::from_secs(2)).expect("the quiet connection was closed");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_shorter_than_its_content_length_gets_408() {
    let engine = Proc::engine(&[]);
    let (gw, _config) = gateway(&engine, "body", "[server]\nrequest_body_timeout_ms = 300\n");
    let started = Instant::now();
    let (reply, closed) = tokio::task::spawn_blocking({
        let mut s = connect(&gw);
        move || {
            s.write_all(SHORT_BODY).unwrap();
            read_until_closed(&mut s, Duration::from_secs(5))
        }
    })
    .await
    .unwrap();
    let took = started.elapsed();
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(closed.is_some(), "the connection stays open after a broken body");
    assert!(
        (Duration::from_millis(250)..Duration::from_secs(3)).contains(&took),
        "{took:?}"
    );
    let error = &json_body(&reply)["error"];
    assert_eq!(error["code"], 408);
    assert!(error["message"].as_str().unwrap().contains("within 300 ms"), "{error}");
    let c = client();
    // The gateway serves on, and nothing was dispatched.
    assert_eq!(
        post(&c, &format!("{}/generate", gw.url), &[], &generate()).await.status,
        StatusCode::OK
    );
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_but_busy_ones_are_not() {
    let engine = Proc::engine(&["--first-byte-delay-ms", "1000"]);
    let (gw, _config) = gateway(
        &engine,
        "idle",
        "[server]\nidle_timeout_ms = 400\nheader_read_timeout_ms = 5000\n",
    );
    let (after_response, never_used) = tokio::task::spawn_blocking({
        let (mut kept, mut fresh) = (connect(&gw), connect(&gw));
        move || {
            kept.write_all(HEALTH).unwrap();
            let reply = read_response(&mut kept, Duration::from_secs(2)).unwrap();
            assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
            let (_, after_response) = read_until_closed(&mut kept, Duration::from_secs(3));
            let (_, never_used) = read_until_closed(&mut fresh, Duration::from_secs(3));
            (after_response, never_used)
        }
    })
    .await
    .unwrap();
    let after_response = after_response.expect("an idle keep-alive connection was left open");
    assert!(after_response >= Duration::from_millis(300), "{after_response:?}");
    assert!(
        never_used.is_some(),
        "a connection that never sent a byte was left open"
    );
    // A request that takes longer than the idle timeout is not idle.
    let c = client();
    let reply = post(&c, &format!("{}/generate", gw.url), &[], &generate()).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_connections_clients_wait_until_one_closes() {
    let engine = Proc::engine(&[]);
    let (gw, _config) = gateway(
        &engine,
        "maxconn",
        "[server]\nmax_connections = 4\nrequest_body_timeout_ms = 20000\n",
    );
    let url = gw.url.clone();
    let waited = tokio::task::spawn_blocking({
        let gw_conns: Vec<TcpStream> = (0..4).map(|_| connect(&gw)).collect();
        let mut fifth = connect(&gw);
        move || {
            let mut busy = gw_conns;
            for s in &mut busy {
                s.write_all(SHORT_BODY).unwrap();
            }
            std::thread::sleep(Duration::from_millis(300));
            fifth.write_all(HEALTH).unwrap();
            assert_eq!(
                read_response(&mut fifth, Duration::from_millis(700)),
                None,
                "a fifth connection was served while four were busy"
            );
            let started = Instant::now();
            drop(busy.remove(0));
            let reply = read_response(&mut fifth, Duration::from_secs(3)).expect("not served after one closed");
            assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
            started.elapsed()
        }
    })
    .await
    .unwrap();
    assert!(waited < Duration::from_secs(1), "{waited:?}");
    let c = client();
    assert!(
        eventually(Duration::from_secs(3), || async {
            get(&c, &format!("{url}/health")).await.status == StatusCode::OK
        })
        .await
    );
    assert_eq!(
        post(&c, &format!("{url}/generate"), &[], &generate()).await.status,
        StatusCode::OK
    );
    assert_eq!(in_flight(&c, &url).await, 0);
}

#[test]
fn idle_connections_make_room_for_new_clients_at_the_limit() {
    let engine = Proc::engine(&[]);
    let (gw, _config) = gateway(
        &engine,
        "reap",
        "[server]\nmax_connections = 4\nidle_timeout_ms = 60000\n",
    );
    let mut idle: Vec<TcpStream> = (0..4).map(|_| connect(&gw)).collect();
    for s in &mut idle {
        s.write_all(HEALTH).unwrap();
        let reply = read_response(s, Duration::from_secs(2)).unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    }
    let started = Instant::now();
    let mut fifth = connect(&gw);
    fifth.write_all(HEALTH).unwrap();
    let reply = read_response(&mut fifth, Duration::from_secs(4)).expect("idle connections kept a new client out");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    let closed = idle
        .iter_mut()
        .filter_map(|s| read_until_closed(s, Duration::from_millis(200)).1)
        .count();
    assert!(closed >= 1, "no idle connection was closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_does_not_stop_the_gateway() {
    let engine = Proc::engine(&[]);
    let config = ConfigFile::new("fds", "[server]\nmax_connections = 1000\n");
    // 64 descriptors for the whole process: the 100 clients below exhaust them.
    let mut command = Command::new("bash");
    command
        .args(["-c", "ulimit -n 64 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_dprouter"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--worker",
            &engine.url,
            "--config",
            config.arg(),
        ])
        .env("RUST_LOG", "warn")
        .stderr(Stdio::inherit());
    let gw = Proc::spawn(command);
    let url = gw.url.clone();
    let served = tokio::task::spawn_blocking({
        let idle: Vec<TcpStream> = (0..100).map(|_| connect(&gw)).collect();
        let mut probe = connect(&gw);
        move || {
            probe.write_all(HEALTH).unwrap();
            let reply = read_response(&mut probe, Duration::from_secs(8));
            drop(idle);
            reply
        }
    })
    .await
    .unwrap()
    .expect("no answer while idle clients held every file descriptor");
    assert!(served.starts_with("HTTP/1.1 200"), "{served}");
    let c = client();
    let generated = eventually(Duration::from_secs(10), || async {
        post(&c, &format!("{url}/generate"), &[], &generate()).await.status == StatusCode::OK
    })
    .await;
    assert!(generated, "the gateway did not recover");
    assert!(eventually(Duration::from_secs(2), || async { in_flight(&c, &url).await == 0 }).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_in_flight_requests_get_503_with_retry_after() {
    let engine = Proc::engine(&["--first-byte-delay-ms", "2000"]);
    let (gw, _config) = gateway(&engine, "inflight", "[server]\nmax_in_flight = 1\n");
    let c = client();
    let url = format!("{}/generate", gw.url);
    let first = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move { post(&c, &url, &[], &generate()).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let response = common::send(&c, &url, &[], generate().to_string()).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["retry-after"], "1");
    let second = common::read(response).await;
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(second.json["error"]["code"], 503);
    assert_eq!(second.json["error"]["type"], "service_unavailable_error");
    assert!(
        second.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_in_flight"),
        "{}",
        second.text
    );
    // Only generation is limited.
    assert_eq!(get(&c, &format!("{}/health", gw.url)).await.status, StatusCode::OK);
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    // The permit came back with the first response.
    assert_eq!(post(&c, &url, &[], &generate()).await.status, StatusCode::OK);
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_requests_in_flight_then_exits() {
    let engine = Proc::engine(&["--first-byte-delay-ms", "1000"]);
    let (mut gw, _config) = gateway(&engine, "drain", "[server]\ndrain_timeout_ms = 5000\n");
    let c = client();
    let request = tokio::spawn({
        let (c, url) = (c.clone(), format!("{}/generate", gw.url));
        async move { post(&c, &url, &[], &generate()).await }
    });
    // An idle keep-alive connection does not hold the drain up.
    let mut idle = connect(&gw);
    idle.write_all(HEALTH).unwrap();
    assert!(read_response(&mut idle, Duration::from_secs(2)).is_some());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let addr = gw.url.trim_start_matches("http://").to_string();
    let exited = tokio::task::spawn_blocking(move || {
        let took = gw.terminate(Duration::from_secs(4));
        (took, gw)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        TcpStream::connect(&addr).is_err(),
        "a new connection was accepted while draining"
    );
    let reply = request.await.unwrap();
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "the request in flight was cut: {}",
        reply.text
    );
    let (took, _gw) = exited.await.unwrap();
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_stuck_request_exits_at_the_drain_deadline() {
    let engine = Proc::engine(&["--first-byte-delay-ms", "60000"]);
    let (mut gw, _config) = gateway(&engine, "stuck", "[server]\ndrain_timeout_ms = 500\n");
    let c = client();
    let request = tokio::spawn({
        let url = format!("{}/generate", gw.url);
        async move {
            let req = hyper::Request::post(url)
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(generate().to_string())))
                .unwrap();
            c.request(req).await.map(|r| r.status())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let took = tokio::task::spawn_blocking(move || gw.terminate(Duration::from_secs(3)))
        .await
        .unwrap();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_millis(1_000),
        "exited {took:?} after SIGTERM (the drain deadline is 500 ms)"
    );
    // The stuck request's connection was closed, not left hanging.
    let outcome = tokio::time::timeout(Duration::from_secs(2), request)
        .await
        .unwrap()
        .unwrap();
    assert!(outcome.is_err(), "{outcome:?}");
}

#[test]
fn a_stream_cut_at_the_drain_deadline_ends_with_an_error_event_and_the_process_exits_soon_after() {
    // 100 ms a token: a 100-token stream outlives the drain.
    let engine = Proc::engine(&["--tpot-ms", "100"]);
    let (mut gw, _config) = gateway(&engine, "cut", "[server]\ndrain_timeout_ms = 500\n");
    let mut stream = connect(&gw);
    let body = json!({"text": "hello", "stream": true, "sampling_params": {"max_new_tokens": 100}}).to_string();
    let request = format!(
        "POST /generate HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    // The stream is under way.
    let mut first = [0u8; 512];
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let n = stream.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    let reader = std::thread::spawn(move || read_until_closed(&mut stream, Duration::from_secs(5)));
    let took = gw.terminate(Duration::from_secs(5));
    let (rest, closed) = reader.join().unwrap();
    assert!(closed.is_some(), "the stream was not closed: {rest:.300}");
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_millis(1_000),
        "exited {took:?} after SIGTERM (the drain deadline is 500 ms)"
    );
    // Events, then one error event, then the chunked body's end: the client can tell the stream was cut.
    let events: Vec<&str> = rest.lines().filter(|l| l.starts_with("data: ")).collect();
    let last = events.last().copied().unwrap_or_default();
    assert!(events.len() >= 2, "{rest:.500}");
    let error: Value = serde_json::from_str(last.trim_start_matches("data: ")).unwrap();
    assert_eq!(error["error"]["code"], 503, "{last}");
    assert!(
        error["error"]["message"].as_str().unwrap().contains("shutting down"),
        "{last}"
    );
    assert!(!rest.contains("[DONE]"), "{rest:.500}");
    assert!(
        rest.ends_with("0\r\n\r\n"),
        "the response did not end cleanly: {rest:.500}"
    );
}

#[test]
fn sigterm_does_not_wait_for_background_probes_in_flight() {
    // Every health probe and load poll hangs for its whole 3 s timeout: one is always in flight.
    let engine = Proc::engine(&["--health-delay-ms", "10000"]);
    let (mut gw, _config) = gateway(
        &engine,
        "probes",
        "[server]\ndrain_timeout_ms = 200\n[health]\ninterval_ms = 100\ntimeout_ms = 3000\n",
    );
    std::thread::sleep(Duration::from_millis(500));
    let took = gw.terminate(Duration::from_secs(5));
    assert!(took < Duration::from_millis(700), "exited {took:?} after SIGTERM");
}
