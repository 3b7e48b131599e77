//! End-to-end serving: `dprouter serve` in front of real `dprouter mock-engine` processes on loopback. What a client
//! sees at the front door (clear errors, request ids, CORS, the access log, the official OpenAI client), engines
//! that die (marked down, streams ended with an error), and the load released after bursts and hang-ups.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{client, eventually, get, in_flight, post, read, send, Proc};
use http_body_util::BodyExt;
use hyper::StatusCode;
use serde_json::{json, Value};

fn generate(text: &str) -> Value {
    json!({"text": text, "sampling_params": {"max_new_tokens": 4}, "bootstrap_room": 7})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    let dir = std::env::temp_dir().join(format!("dprouter-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("small.toml");
    std::fs::write(&config, "max_body_bytes = 1000\n[routing]\npolicy = \"round_robin\"\n").unwrap();
    let gw = Proc::gateway(&[&engine], &["--config", config.to_str().unwrap()]);
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url);
    type Case<'a> = (Vec<(&'a str, &'a str)>, String, StatusCode, &'a str);
    let cases: Vec<Case> = vec![
        (vec![], "{not json".into(), StatusCode::BAD_REQUEST, "not valid JSON"),
        (vec![], "[1, 2]".into(), StatusCode::BAD_REQUEST, "JSON object"),
        (
            vec![],
            "{\"model\": \"m\"}".into(),
            StatusCode::BAD_REQUEST,
            "no prompt",
        ),
        (
            vec![("content-type", "text/plain")],
            "{}".into(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "application/json",
        ),
        (
            vec![],
            json!({"messages": [{"role": "user", "content": "x".repeat(2000)}]}).to_string(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "limit of 1000 bytes",
        ),
    ];
    for (headers, body, status, needle) in cases {
        let reply = read(send(&c, &url, &headers, body.clone()).await).await;
        assert_eq!(reply.status, status, "{body:.60}: {}", reply.text);
        let message = reply.json["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{body:.60}: {message}");
        assert_eq!(reply.json["error"]["code"], status.as_u16());
    }
    assert_eq!(
        get(&c, &format!("{}/v2/nothing", gw.url)).await.status,
        StatusCode::NOT_FOUND
    );
    std::fs::remove_dir_all(&dir).unwrap();

    // No healthy endpoint: the only engine reports unhealthy and the probes take it out.
    let sick = Proc::engine(&["--unhealthy"]);
    let config = std::env::temp_dir().join(format!("dprouter-e2e-fast-{}.toml", std::process::id()));
    std::fs::write(&config, "[health]\ninterval_ms = 50\nfailure_threshold = 1\n").unwrap();
    let gw = Proc::gateway(&[&sick], &["--config", config.to_str().unwrap()]);
    let ready = format!("{}/readiness", gw.url);
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(&c, &ready).await.status == StatusCode::SERVICE_UNAVAILABLE
        })
        .await
    );
    let reply = post(&c, &format!("{}/generate", gw.url), &[], &generate("x")).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(reply.json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no healthy endpoint"));
    std::fs::remove_file(&config).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_is_marked_down_and_traffic_moves() {
    let mut a = Proc::engine(&["--dp-size", "1"]);
    let b = Proc::engine(&["--dp-size", "1"]);
    let gw = Proc::gateway(&[&a, &b], &["--policy", "round_robin"]);
    let c = client();
    let url = format!("{}/generate", gw.url);
    for _ in 0..4 {
        assert_eq!(post(&c, &url, &[], &generate("x")).await.status, StatusCode::OK);
    }
    a.kill();
    // A dead engine's port refuses connections; held here, no other test's server can take it meanwhile.
    let (_held, _) = common::hold_port(common::port_of(&a.url));
    for i in 0..6 {
        let reply = post(&c, &url, &[], &generate("x")).await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "request {i} after the kill: {}",
            reply.text
        );
    }
    // The refused connection asked for a probe, which confirms the worker is down.
    let workers_url = format!("{}/workers", gw.url);
    let down = eventually(Duration::from_secs(5), || async {
        get(&c, &workers_url).await.json["workers"][0]["healthy"] == false
    })
    .await;
    assert!(down, "the killed worker was never marked down");
    let workers = get(&c, &workers_url).await.json;
    assert_eq!(workers["workers"][1]["healthy"], true);
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    let retries: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("dprouter_retries_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(
        (1..=3).contains(&retries),
        "a retry or two until the probe took the worker out: {retries}"
    );
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mid_stream_upstream_death_ends_the_stream_with_an_error() {
    let engine = Proc::engine(&["--dp-size", "2", "--drop-after-tokens", "3"]);
    let gw = Proc::gateway(&[&engine], &[]);
    let c = client();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": true});
    let resp = send(&c, &format!("{}/v1/chat/completions", gw.url), &[], body.to_string()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut text = String::new();
    while let Some(Ok(frame)) = body.frame().await {
        text.push_str(&String::from_utf8_lossy(&frame.into_data().unwrap_or_default()));
    }
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    assert!(
        last.contains("\"upstream_error\""),
        "the stream ends with an error event: {text}"
    );
    assert!(!text.contains("[DONE]"), "{text}");
    assert!(eventually(Duration::from_secs(2), || async { in_flight(&c, &gw.url).await == 0 }).await);
    // Counted as what it was: a 502, not the 200 its head said.
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    assert!(
        metrics.contains(r#"dprouter_requests_total{route="/v1/chat/completions",status="502"} 1"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_returns_to_zero_after_a_burst_with_cancellations() {
    let engine = Proc::engine(&["--dp-size", "4", "--tpot-ms", "10"]);
    let gw = Proc::gateway(&[&engine], &["--policy", "total_requests"]);
    let c = client();
    let tasks: Vec<_> = (0..1000)
        .map(|i| {
            let (c, base) = (c.clone(), gw.url.clone());
            tokio::spawn(async move {
                let stream = i % 2 == 0;
                let cancel = i % 5 == 0;
                // Cancelled requests ask for long answers, so the hang-up surely reaches the engine mid-answer.
                let n = if cancel { 400 } else { 32 };
                let (path, body) = match i % 3 {
                    0 => ("/generate", json!({"text": format!("p{}", i % 7), "stream": stream, "sampling_params": {"max_new_tokens": n}})),
                    1 => ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": format!("q{}", i % 5)}], "max_tokens": n, "stream": stream})),
                    _ => ("/v1/completions", json!({"prompt": "r", "max_tokens": n, "stream": stream, "routed_dp_rank": i % 4})),
                };
                let resp = send(&c, &format!("{base}{path}"), &[], body.to_string()).await;
                assert_eq!(resp.status(), StatusCode::OK);
                let mut body = resp.into_body();
                if cancel {
                    // Cancel: read one frame at most, then hang up.
                    let _ = body.frame().await;
                    return;
                }
                while let Some(frame) = body.frame().await {
                    frame.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert!(
        eventually(Duration::from_secs(5), || async { in_flight(&c, &gw.url).await == 0 }).await,
        "in-flight leaked"
    );
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    for line in metrics
        .lines()
        .filter(|l| l.starts_with("dprouter_endpoint_in_flight_requests"))
    {
        assert!(line.ends_with(" 0"), "{line}");
    }
    // Hanging up on the gateway cancelled requests at the engine too.
    let info = format!("{}/get_server_info", engine.url);
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(&c, &info).await.json["aborted_requests"].as_u64().unwrap() > 0
        })
        .await
    );
    assert_eq!(
        get(&c, &format!("{}/get_load", engine.url))
            .await
            .json
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["num_reqs"].as_u64().unwrap())
            .sum::<u64>(),
        0
    );
}

#[test]
fn the_official_openai_client_works_through_the_gateway() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&engine], &["--policy", "prefix_match"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = std::process::Command::new(common::python())
        .arg(script)
        .arg(format!("{}/v1", gw.url))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the openai client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The README's first command and its `curl`: `serve` with no worker fronts an embedded mock engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_without_workers_fronts_an_embedded_engine() {
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0"]);
    let c = client();
    let body = json!({"model": "dprouter/mock", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16});
    let reply = post(&c, &format!("{}/v1/chat/completions", gw.url), &[], &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let answer = reply.json["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(answer.split_whitespace().count(), 16, "{answer}");
    let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
    assert_eq!(workers["policy"], "cache_aware");
    assert_eq!(workers["workers"][0]["endpoints"].as_array().unwrap().len(), 4);
    assert!(get(&c, &format!("{}/metrics", gw.url))
        .await
        .text
        .contains("dprouter_requests_total"));
}

/// Every answer carries a request id: the client's when it sends one (and the engine gets it), a fresh one
/// otherwise; a client that hangs up mid-stream is counted as 499.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_round_trip_and_hang_ups_are_counted() {
    let engine = Proc::engine(&["--dp-size", "1", "--tpot-ms", "20"]);
    let gw = Proc::gateway(&[&engine], &[]);
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url);
    let chat = |stream: bool| {
        json!({"model": "m", "max_tokens": 50, "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
            .to_string()
    };
    let response = send(&c, &url, &[("x-request-id", "client-id-7")], chat(false)).await;
    assert_eq!(response.headers()["x-request-id"], "client-id-7");
    let response = send(&c, &url, &[("x-request-id", "Trace_1.2:a-b")], chat(false)).await;
    assert_eq!(response.headers()["x-request-id"], "Trace_1.2:a-b");
    // An id that could forge the access log's fields (spaces, `=`, quotes) is replaced by a generated one.
    for forged in ["a status=200", "id\"x", "k=v", "tab\tid"] {
        let response = send(&c, &url, &[("x-request-id", forged)], chat(false)).await;
        let id = response.headers()["x-request-id"].to_str().unwrap().to_string();
        assert!(
            id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "{forged:?} -> {id:?}"
        );
    }
    let ids: Vec<String> = futures_util::future::join_all((0..2).map(|_| send(&c, &url, &[], chat(false))))
        .await
        .iter()
        .map(|r| r.headers()["x-request-id"].to_str().unwrap().to_string())
        .collect();
    assert!(
        ids.iter()
            .all(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())),
        "{ids:?}"
    );
    assert_ne!(ids[0], ids[1]);
    // Errors the gateway answers itself carry one too.
    let bad = send(&c, &url, &[], "{").await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    assert!(bad.headers().contains_key("x-request-id"));
    // A client that reads the first event of a 50-token stream and closes.
    let mut body = send(&c, &url, &[], chat(true)).await.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    let counted = eventually(Duration::from_secs(5), || async {
        get(&c, &format!("{}/metrics", gw.url))
            .await
            .text
            .contains(r#"dprouter_requests_total{route="/v1/chat/completions",status="499"} 1"#)
    })
    .await;
    assert!(counted, "the hang-up was not counted as 499");
    assert!(eventually(Duration::from_secs(2), || async { in_flight(&c, &gw.url).await == 0 }).await);
}

/// CORS is off unless configured: then a browser's preflight is answered and answers carry the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_is_opt_in() {
    let engine = Proc::engine(&["--dp-size", "1"]);
    let c = client();
    let preflight = |url: String| {
        hyper::Request::options(url)
            .header("origin", "https://app.example.com")
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "authorization, content-type")
            .body(Default::default())
            .unwrap()
    };
    let plain = Proc::gateway(&[&engine], &[]);
    let response = c
        .request(preflight(format!("{}/v1/chat/completions", plain.url)))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert!(!response.headers().contains_key("access-control-allow-origin"));
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-cors.toml");
    std::fs::write(
        &config,
        "[server]\ncors_allow_origins = [\"https://app.example.com\"]\n",
    )
    .unwrap();
    let gw = Proc::gateway(&[&engine], &["--config", config.to_str().unwrap()]);
    let response = c
        .request(preflight(format!("{}/v1/chat/completions", gw.url)))
        .await
        .unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    assert_eq!(
        response.headers()["access-control-allow-origin"],
        "https://app.example.com"
    );
    let allowed = response.headers()["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    assert!(allowed.contains("authorization"), "{allowed}");
    let request = hyper::Request::post(format!("{}/generate", gw.url))
        .header("origin", "https://app.example.com")
        .header("content-type", "application/json")
        .body(generate("x").to_string().into())
        .unwrap();
    let response = c.request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()["access-control-allow-origin"],
        "https://app.example.com"
    );
    // CORS never approves the admin routes, even for an allowed origin, or with `*`.
    let any = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-cors-any.toml");
    std::fs::write(&any, "[server]\ncors_allow_origins = [\"*\"]\n").unwrap();
    let open = Proc::gateway(&[&engine], &["--config", any.to_str().unwrap()]);
    for gateway in [&gw, &open] {
        let response = c
            .request(preflight(format!("{}/v1/chat/completions", gateway.url)))
            .await
            .unwrap();
        assert!(response.headers().contains_key("access-control-allow-origin"));
        for admin in ["/workers", "/workers/0", "/flush_cache", "/kv_events"] {
            let response = c.request(preflight(format!("{}{admin}", gateway.url))).await.unwrap();
            assert!(
                !response.headers().contains_key("access-control-allow-origin"),
                "{admin}: {:?}",
                response.headers()
            );
        }
    }
}

/// `[server] access_log = true`: one line per answered request, with what the gateway did and what the engine
/// reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_says_what_happened() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    let (gw, log) = Proc::logging_access(&engine, "e2e-access-log");
    let c = client();
    let chat = json!({"model": "the-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let response = send(
        &c,
        &format!("{}/v1/chat/completions", gw.url),
        &[("x-request-id", "log-me-1")],
        chat.to_string(),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    let endpoint = response.headers()["x-dprouter-endpoint"].to_str().unwrap().to_string();
    read(response).await;
    let line = eventually(Duration::from_secs(5), || async {
        std::fs::read_to_string(&log).unwrap().contains("request_id=log-me-1")
    })
    .await;
    assert!(line, "no access log line");
    let text = std::fs::read_to_string(&log).unwrap();
    let line = text.lines().find(|l| l.contains("request_id=log-me-1")).unwrap();
    for field in [
        "dprouter::access".to_string(),
        "method=POST".into(),
        "path=/v1/chat/completions".into(),
        "status=200".into(),
        "model=\"the-model\"".into(),
        format!("endpoint=\"{endpoint}\""),
        "branch=".into(),
        "ttft_ms=".into(),
        "prompt_tokens=".into(),
        "cached_tokens=0".into(),
        // cache_aware (the default) predicts: nothing cached for a first, short prompt.
        "predicted_cached_tokens=0".into(),
        "duration_ms=".into(),
    ] {
        assert!(line.contains(&field), "{field} missing: {line}");
    }
    // The gateway's own answers are logged too, without the engine's fields.
    let bad = send(
        &c,
        &format!("{}/v1/chat/completions", gw.url),
        &[("x-request-id", "log-me-2")],
        "{",
    )
    .await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    read(bad).await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            let text = std::fs::read_to_string(&log).unwrap();
            text.lines()
                .any(|l| l.contains("request_id=log-me-2") && l.contains("status=400") && !l.contains("endpoint="))
        })
        .await
    );
}
