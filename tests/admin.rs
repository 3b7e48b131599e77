//! End-to-end: who may use the admin routes, what `POST /workers` accepts, and options rejected at start.
//! (Refusing a non-loopback client without a key is tested on the decision itself, in `server.rs`: every client of
//! these tests is on loopback.)
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{call, client, get, post, read, Proc};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};

/// Runs `dprouter ARGS` to its exit (killing it and failing after 20 s: a command that should have refused to
/// start must not serve instead); returns its status and standard error.
fn run_to_exit(args: &[&str]) -> (ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dprouter"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("dprouter {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    (status, stderr)
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A fake SGLang server that answers every request with `body` (as JSON); returns its URL.
fn fake_engine(body: Value) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let body = body.to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{}",
                body.len(),
                body
            );
        }
    });
    url
}

/// A web page cannot use the admin routes through its visitor's browser: a `text/plain` POST (a CORS "simple"
/// request, sent without a preflight) is a 415 naming the type (a 401 first, without the key of a keyed gateway), a request with a foreign `Origin` a 403 with or without the key,
/// and without a key a request addressed to a name that is not loopback (DNS rebinding) a 403; the gateway's own
/// origin, loopback names, and keyed admin through any host name keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_refuse_what_a_web_page_can_send() {
    let a = Proc::engine(&["--dp-size", "1"]);
    let open = Proc::gateway(&[&a], &[]);
    let keyed = Proc::gateway(&[&a], &["--admin-key", "k3y"]);
    let c = client();
    let spare = format!("http://127.0.0.1:{}", closed_port());
    let worker = json!({"url": spare, "backend": "vllm", "dp_size": 1});
    let bearer = ("authorization", "Bearer k3y");
    let host = |gw: &Proc| format!("127.0.0.1:{}", common::port_of(&gw.url));
    for (gw, auth) in [(&open, None), (&keyed, Some(bearer))] {
        let workers = format!("{}/workers", gw.url);
        let with_auth = |mut h: Vec<(&'static str, String)>| {
            if let Some((k, v)) = auth {
                h.push((k, v.to_string()));
            }
            h
        };
        type Headers = Vec<(&'static str, String)>;
        let cases: Vec<(Headers, StatusCode, &str)> = vec![
            (
                vec![("content-type", "text/plain".into())],
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported content type `text/plain`: send application/json",
            ),
            (
                vec![
                    ("content-type", "application/json".into()),
                    ("origin", "https://evil.example".into()),
                ],
                StatusCode::FORBIDDEN,
                "cross-origin",
            ),
            (
                vec![("content-type", "text/plain".into()), ("origin", "null".into())],
                StatusCode::FORBIDDEN,
                "cross-origin",
            ),
        ];
        for (headers, status, needle) in cases {
            let headers = with_auth(headers);
            let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let reply = post(&c, &workers, &headers, &worker).await;
            assert_eq!(reply.status, status, "{headers:?}: {}", reply.text);
            assert!(
                reply.json["error"]["message"].as_str().unwrap().contains(needle),
                "{}",
                reply.text
            );
        }
        // Access is checked before the content type: without the key, a keyed gateway answers 401 whatever the body.
        if auth.is_some() {
            for path in ["/workers", "/flush_cache"] {
                let reply = post(
                    &c,
                    &format!("{}{path}", gw.url),
                    &[("content-type", "text/plain")],
                    &worker,
                )
                .await;
                assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{path}: {}", reply.text);
            }
        }
        // A GET with a foreign Origin too (a page reading the fleet).
        let headers = with_auth(vec![("origin", "https://evil.example".into())]);
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let reply = call(&c, Method::GET, &workers, &headers, None).await;
        assert_eq!(reply.status, StatusCode::FORBIDDEN, "{}", reply.text);
        // Nothing was added.
        let headers = with_auth(vec![]);
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let listed = call(&c, Method::GET, &workers, &headers, None).await;
        assert_eq!(listed.json["workers"].as_array().unwrap().len(), 1, "{}", listed.text);
        // The gateway's own origin is fine.
        let own = format!("http://{}", host(gw));
        let headers = with_auth(vec![("origin", own)]);
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let reply = call(&c, Method::GET, &workers, &headers, None).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    }
    // DNS rebinding: without a key, a request addressed to another name is refused; loopback names are fine.
    let workers = format!("{}/workers", open.url);
    for (name, status) in [
        ("attacker.example:8000", StatusCode::FORBIDDEN),
        ("localhost", StatusCode::OK),
        ("LOCALHOST:1", StatusCode::OK),
        ("127.0.0.2:80", StatusCode::OK),
        ("[::1]:8000", StatusCode::OK),
    ] {
        let reply = call(&c, Method::GET, &workers, &[("host", name)], None).await;
        assert_eq!(reply.status, status, "{name}: {}", reply.text);
    }
    // With a key, any host name works.
    let workers = format!("{}/workers", keyed.url);
    let reply = call(
        &c,
        Method::GET,
        &workers,
        &[("host", "gateway.internal:8000"), bearer],
        None,
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_admin_routes_answer_loopback_clients() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let b = Proc::engine(&["--dp-size", "1"]);
    let gw = Proc::gateway(&[&a], &[]);
    let c = client();
    let listed = get(&c, &format!("{}/workers", gw.url)).await;
    assert_eq!(listed.status, StatusCode::OK, "{}", listed.text);
    let added = post(&c, &format!("{}/workers", gw.url), &[], &json!({"url": b.url})).await;
    assert_eq!(added.status, StatusCode::CREATED, "{}", added.text);
    let flushed = post(&c, &format!("{}/flush_cache", gw.url), &[], &json!({})).await;
    assert_eq!(flushed.status, StatusCode::OK, "{}", flushed.text);
    let removed = call(&c, Method::DELETE, &format!("{}/workers/1", gw.url), &[], None).await;
    assert_eq!(removed.status, StatusCode::OK, "{}", removed.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_key_admin_routes_need_it_from_loopback_too() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&a], &["--admin-key", "s3cret"]);
    let c = client();
    let workers = format!("{}/workers", gw.url);
    for headers in [
        &[][..],
        &[("authorization", "Bearer wrong")][..],
        &[("authorization", "Bearer s3cret2")][..],
        &[("authorization", "Bearer s3cre")][..],
        &[("authorization", "s3cret")][..],
    ] {
        let reply = call(&c, Method::GET, &workers, headers, None).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{headers:?}: {}", reply.text);
        assert_eq!(reply.json["error"]["type"], "authentication_error", "{}", reply.text);
        let reply = call(&c, Method::DELETE, &format!("{workers}/0"), headers, None).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{headers:?}");
        let reply = post(&c, &workers, headers, &json!({"url": "http://127.0.0.1:1"})).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{headers:?}");
    }
    let ok = call(&c, Method::GET, &workers, &[("authorization", "Bearer s3cret")], None).await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.text);
    assert_eq!(ok.json["workers"].as_array().unwrap().len(), 1);
    // Non-admin routes stay open.
    assert_eq!(get(&c, &format!("{}/health", gw.url)).await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_workers_validates_its_input() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&a], &[]);
    let c = client();
    let workers = format!("{}/workers", gw.url);
    let spare = closed_port();
    let spare_url = format!("http://127.0.0.1:{spare}");
    for (body, needle) in [
        (json!({"url": spare_url, "dp_size": 4_294_967_295u64}), "dp_size"),
        (
            json!({"url": spare_url, "backend": "vllm", "dp_size": 4_294_967_295u64}),
            "dp_size",
        ),
        (json!({"url": spare_url, "backend": "vllm", "dp_size": 1025}), "1024"),
        (json!({"url": spare_url, "dp_size": 0}), "dp_size"),
        (json!({"url": spare_url, "dp_size": 4_294_967_296u64}), "u32"),
        (json!({"url": "not a url"}), "url"),
        (json!({"url": format!("ftp://127.0.0.1:{spare}")}), "http://host:port"),
        (
            json!({"url": format!("http://user:pw@127.0.0.1:{spare}")}),
            "no user, path or query",
        ),
        (json!({"url": format!("{spare_url}/v1")}), "no user, path or query"),
        (
            json!({"url": "http://127.0.0.1:0", "dp_size": 1}),
            "port must be a number from 1 to 65535",
        ),
        (
            json!({"url": "http://127.0.0.1:99999", "dp_size": 1}),
            "port must be a number from 1 to 65535",
        ),
        (
            json!({"url": format!("http://0.0.0.0:{spare}"), "dp_size": 1}),
            "no address to connect to",
        ),
        (
            json!({"url": format!("http://[::]:{spare}"), "dp_size": 1}),
            "no address to connect to",
        ),
        (json!({"url": spare_url, "kv_events": "127.0.0.1:5557"}), "kv_events"),
        (
            json!({"url": spare_url, "kv_events_replay": "tcp://127.0.0.1:5558"}),
            "kv_events_replay needs",
        ),
        (json!({"url": spare_url, "weight": 2}), "weight"),
        (json!([spare_url, "vllm", 1, "routed_dp_rank"]), "JSON object"),
        (json!("http://127.0.0.1:1"), "JSON object"),
    ] {
        let reply = post(&c, &workers, &[], &body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}: {}", reply.text);
        let message = reply.json["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{body}: {message}");
    }
    // The gateway is alive and its fleet unchanged.
    assert_eq!(get(&c, &format!("{}/health", gw.url)).await.status, StatusCode::OK);
    let listed = get(&c, &workers).await.json;
    assert_eq!(listed["workers"].as_array().unwrap().len(), 1, "{listed}");

    // The same URL twice, however it is spelled, is a conflict.
    let port = common::port_of(&a.url);
    for url in [
        a.url.clone(),
        format!("{}/", a.url),
        format!("{}//", a.url),
        format!("http://127.1:{port}"),
        format!("http://2130706433:{port}"),
        format!("http://[::ffff:127.0.0.1]:{port}"),
    ] {
        let reply = post(&c, &workers, &[], &json!({"url": url, "backend": "vllm", "dp_size": 2})).await;
        assert_eq!(reply.status, StatusCode::CONFLICT, "{url}: {}", reply.text);
        assert_eq!(reply.json["error"]["type"], "conflict_error");
        let message = reply.json["error"]["message"].as_str().unwrap();
        assert!(message.contains("already registered"), "{message}");
    }
    assert_eq!(get(&c, &workers).await.json["workers"].as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_tell_its_ranks_is_a_502_that_reveals_nothing() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&a], &[]);
    let c = client();
    let workers = format!("{}/workers", gw.url);
    let claims_billions = fake_engine(json!({"dp_size": 4_294_967_295u64, "max_total_num_tokens": 1000}));
    let no_dp_size = fake_engine(json!({"version": "0"}));
    // A usable answer, but of 2 MiB: the gateway reads at most 1 MiB of an engine's small answers.
    let huge = fake_engine(json!({"dp_size": 1, "padding": "x".repeat(2 << 20)}));
    let cases = [
        format!("http://127.0.0.1:{}", closed_port()),
        claims_billions.clone(),
        no_dp_size,
        huge,
    ];
    let mut messages = Vec::new();
    for url in &cases {
        let reply = post(&c, &workers, &[], &json!({"url": url})).await;
        assert_eq!(reply.status, StatusCode::BAD_GATEWAY, "{url}: {}", reply.text);
        let message = reply.json["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains("get_server_info"), "{message}");
        for leak in [
            "refused",
            "Connect",
            "tcp",
            "timed out",
            "4294967295",
            "JSON",
            "os error",
            "bytes",
        ] {
            assert!(!message.contains(leak), "{url}: `{leak}` in {message}");
        }
        messages.push(message.replace(url.as_str(), "URL"));
    }
    assert!(
        messages.windows(2).all(|w| w[0] == w[1]),
        "one answer whatever the reason: {messages:?}"
    );
    assert_eq!(get(&c, &format!("{}/health", gw.url)).await.status, StatusCode::OK);
    assert_eq!(get(&c, &workers).await.json["workers"].as_array().unwrap().len(), 1);
    // Told its ranks, the gateway does not need the worker's word (the health checks judge it).
    let reply = post(&c, &workers, &[], &json!({"url": claims_billions, "dp_size": 2})).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text);
}

#[test]
fn senseless_options_stop_the_start_with_one_line() {
    for (args, field) in [
        (&["serve", "--policy", "cache_aware:block_tokens=0"][..], "block_tokens"),
        (
            &["serve", "--policy", "cache_aware:prefill_tokens_per_s=0"][..],
            "prefill_tokens_per_s",
        ),
        (
            &["serve", "--policy", "cache_aware:congestion_weight=-1"][..],
            "congestion_weight",
        ),
        (&["serve", "--policy", "prefix_affinity:epsilon=-0.5"][..], "epsilon"),
        (
            &["serve", "--policy", "prefix_match:window_tokens=0"][..],
            "window_tokens",
        ),
        (&["serve", "--admin-key", ""][..], "admin_key"),
        (&["serve", "--admin-key", "   "][..], "admin_key"),
        (
            &[
                "route",
                "--dp-size",
                "2",
                "--policy",
                "cache_aware:kv_capacity_tokens=0",
            ][..],
            "kv_capacity_tokens",
        ),
        (
            &[
                "simulate",
                "--workload",
                "agent",
                "--dp-size",
                "2",
                "--policy",
                "cache_aware:base_ms=-1",
            ][..],
            "base_ms",
        ),
        (
            &[
                "simulate",
                "--workload",
                "agent",
                "--dp-size",
                "2",
                "--prefill-rate=-5",
                "--base-ms=-1",
                "--policy",
                "cache_aware",
            ][..],
            // The simulated engine's own costs, whatever the policy (cache_aware learns them, it is not given them).
            "--base-ms",
        ),
    ] {
        let mut args = args.to_vec();
        if args[0] == "serve" {
            args.extend(["--listen", "127.0.0.1:0"]);
        }
        let (status, stderr) = run_to_exit(&args);
        assert!(!status.success(), "{args:?} started:\n{stderr}");
        let naming: Vec<&str> = stderr.lines().filter(|l| l.contains(field)).collect();
        assert_eq!(naming.len(), 1, "{args:?}: one line names `{field}`:\n{stderr}");
    }
}

#[test]
fn each_config_error_is_printed_once() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("admin-configs");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text, needle) in [
        ("unknown.toml", "listn = \"127.0.0.1:0\"\n", "unknown field `listn`"),
        ("body.toml", "max_body_bytes = 0\n", "max_body_bytes"),
        ("key.toml", "admin_key = \"\"\n", "admin_key must not be empty"),
        (
            "policy.toml",
            "[routing]\npolicy = \"cache_aware\"\nblock_tokens = 0\n",
            "block_tokens must be",
        ),
        (
            "dp.toml",
            "[[workers]]\nurl = \"http://127.0.0.1:1\"\nbackend = \"vllm\"\ndp_size = 4294967295\n",
            "dp_size must be",
        ),
        (
            "twice.toml",
            "[[workers]]\nurl = \"http://127.0.0.1:1\"\nbackend = \"vllm\"\n[[workers]]\nurl = \"http://127.0.0.1:1/\"\nbackend = \"vllm\"\n",
            "listed twice",
        ),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let (status, stderr) = run_to_exit(&["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()]);
        assert!(!status.success(), "{name} started:\n{stderr}");
        assert_eq!(stderr.matches(needle).count(), 1, "{name}:\n{stderr}");
    }
    let missing = dir.join("missing.toml");
    let (status, stderr) = run_to_exit(&["serve", "--config", missing.to_str().unwrap()]);
    assert!(!status.success());
    assert_eq!(stderr.matches("No such file").count(), 1, "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_adds_removes_and_flushes_workers() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let b = Proc::engine(&["--dp-size", "3"]);
    let gw = Proc::gateway(&[&a], &["--admin-key", "s3cret"]);
    let c = client();
    let auth = [("authorization", "Bearer s3cret")];
    assert_eq!(
        get(&c, &format!("{}/workers", gw.url)).await.status,
        StatusCode::UNAUTHORIZED
    );
    let added = post(&c, &format!("{}/workers", gw.url), &auth, &json!({"url": b.url})).await;
    assert_eq!(added.status, StatusCode::CREATED, "{}", added.text);
    assert_eq!(added.json["dp_size"], 3, "discovered from /get_server_info");
    let list = |c: common::HttpClient, url: String| async move {
        let req = hyper::Request::get(format!("{url}/workers"))
            .header("authorization", "Bearer s3cret")
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        read(c.request(req).await.unwrap()).await.json
    };
    let workers = list(c.clone(), gw.url.clone()).await;
    assert_eq!(workers["workers"].as_array().unwrap().len(), 2);
    assert_eq!(
        workers["workers"][1]["endpoints"][2]["rank"], 4,
        "global ranks continue across workers"
    );
    // A pinned request to global rank 4 reaches worker b's rank 2.
    let reply = post(
        &c,
        &format!("{}/generate", gw.url),
        &[],
        &json!({"text": "x", "routed_dp_rank": 4}),
    )
    .await;
    assert_eq!(reply.rank, Some(2));
    let flushed = post(&c, &format!("{}/flush_cache", gw.url), &auth, &json!({})).await;
    assert_eq!(flushed.status, StatusCode::OK, "{}", flushed.text);
    assert_eq!(flushed.json["results"].as_array().unwrap().len(), 2);
    let req = hyper::Request::delete(format!("{}/workers/0", gw.url))
        .header("authorization", "Bearer s3cret")
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    assert_eq!(c.request(req).await.unwrap().status(), StatusCode::OK);
    let workers = list(c.clone(), gw.url.clone()).await;
    assert_eq!(workers["workers"].as_array().unwrap().len(), 1);
    let bad = post(&c, &format!("{}/workers", gw.url), &auth, &json!({"url": "not a url"})).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}
