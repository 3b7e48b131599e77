//! End-to-end: `dprouter serve` in front of real `dprouter mock-engine` processes on loopback.
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
async fn every_policy_routes() {
    let engine = Proc::engine(&["--dp-size", "4"]);
    let c = client();
    for policy in dprouter_core::PolicyConfig::NAMES {
        let gw = Proc::gateway(&[&engine], &["--policy", policy]);
        let mut ranks = std::collections::BTreeSet::new();
        for i in 0..8 {
            let reply = post(
                &c,
                &format!("{}/generate", gw.url),
                &[],
                &generate(&format!("prompt {i}")),
            )
            .await;
            assert_eq!(reply.status, StatusCode::OK, "{policy}: {}", reply.text);
            ranks.insert(reply.rank.unwrap());
        }
        let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
        assert_eq!(workers["policy"], *policy);
        let decisions: u64 = workers["decisions"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(decisions, 8, "{policy}");
        if *policy == "round_robin" {
            assert_eq!(ranks.len(), 4, "{policy} spreads sequential requests: {ranks:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_affine_policies_send_the_second_request_to_the_cache() {
    for policy in ["prefix_match", "prefix_affinity", "cache_aware"] {
        second_request_hits_the_cache(policy).await;
    }
}

async fn second_request_hits_the_cache(policy: &str) {
    let engine = Proc::engine(&["--dp-size", "4"]);
    let gw = Proc::gateway(&[&engine], &["--policy", policy]);
    let c = client();
    let system = "You are an agent with many tools. ".repeat(300);
    let chat = |user: &str| json!({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]});
    let first = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url),
        &[],
        &chat("first question"),
    )
    .await;
    let second = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url),
        &[],
        &chat("second question"),
    )
    .await;
    assert_eq!(
        (first.status, second.status),
        (StatusCode::OK, StatusCode::OK),
        "{policy}"
    );
    assert_eq!(first.rank, second.rank, "{policy}: same prefix, same rank");
    assert_eq!(first.json["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = second.json["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = second.json["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached * 10 >= prompt * 9, "{policy}: cached {cached} of {prompt}");
    // The gateway saw the engine's usage report.
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    assert!(metrics.contains("dprouter_cached_tokens_total"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_overrides_are_validated_and_can_be_disabled() {
    let engine = Proc::engine(&["--dp-size", "4"]);
    let gw = Proc::gateway(&[&engine], &["--policy", "round_robin"]);
    let c = client();
    let url = format!("{}/v1/completions", gw.url);
    let body = |extra: Value| {
        let mut b = json!({"prompt": "x", "max_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    assert_eq!(
        post(&c, &url, &[], &body(json!({"routed_dp_rank": 2}))).await.rank,
        Some(2)
    );
    assert_eq!(
        post(&c, &url, &[], &body(json!({"data_parallel_rank": 1}))).await.rank,
        Some(1)
    );
    assert_eq!(
        post(
            &c,
            &url,
            &[("X-Data-Parallel-Rank", "3")],
            &body(json!({"routed_dp_rank": 2}))
        )
        .await
        .rank,
        Some(3)
    );
    let out_of_range = post(&c, &url, &[], &body(json!({"routed_dp_rank": 9}))).await;
    assert_eq!(out_of_range.status, StatusCode::BAD_REQUEST);
    assert!(out_of_range.json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("DP rank 9 is out of range"));
    let bad_header = post(&c, &url, &[("X-Data-Parallel-Rank", "x")], &body(json!({}))).await;
    assert_eq!(bad_header.status, StatusCode::BAD_REQUEST);

    let strict = Proc::gateway(&[&engine], &["--policy", "round_robin", "--no-client-overrides"]);
    let url = format!("{}/v1/completions", strict.url);
    let ranks: Vec<_> = futures_ranks(&c, &url, body(json!({"routed_dp_rank": 3}))).await;
    assert_eq!(
        ranks,
        vec![Some(0), Some(1), Some(2)],
        "overrides ignored: round robin decides"
    );
    for (headers, extra) in [
        (vec![], json!({"routed_dp_rank": "two"})),
        (vec![], json!({"data_parallel_rank": [1]})),
        (vec![("X-Data-Parallel-Rank", "x")], json!({})),
    ] {
        let reply = post(&c, &url, &headers, &body(extra.clone())).await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "malformed overrides are ignored too: {extra} {}",
            reply.text
        );
    }
}

async fn futures_ranks(c: &common::HttpClient, url: &str, body: Value) -> Vec<Option<u64>> {
    let mut ranks = Vec::new();
    for _ in 0..3 {
        ranks.push(post(c, url, &[], &body).await.rank);
    }
    ranks
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_and_openai_backends_are_targeted_their_way() {
    let vllm = Proc::engine(&["--dp-size", "2", "--api", "vllm"]);
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        &vllm.url,
        "--backend",
        "vllm",
        "--dp-size",
        "2",
        "--policy",
        "round_robin",
    ]);
    let c = client();
    let body = json!({"prompt": "x", "max_tokens": 2});
    let ranks: Vec<_> = futures_ranks(&c, &format!("{}/v1/completions", gw.url), body.clone()).await;
    assert_eq!(
        ranks,
        vec![Some(0), Some(1), Some(0)],
        "the rank travels in the vLLM header"
    );

    let one = Proc::engine(&["--dp-size", "1"]);
    let two = Proc::engine(&["--dp-size", "1"]);
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        &one.url,
        "--worker",
        &two.url,
        "--backend",
        "openai",
        "--policy",
        "round_robin",
    ]);
    let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
    assert_eq!(workers["workers"].as_array().unwrap().len(), 2);
    for _ in 0..2 {
        assert_eq!(
            post(&c, &format!("{}/v1/completions", gw.url), &[], &body).await.status,
            StatusCode::OK
        );
    }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_load_reports_reach_the_load_table() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&engine], &["--policy", "total_requests", "--poll-load-ms", "50"]);
    let c = client();
    let url = format!("{}/workers", gw.url);
    let reported = eventually(Duration::from_secs(5), || async {
        let workers = get(&c, &url).await.json;
        workers["workers"][0]["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["engine_report"]["timestamp"].as_u64().is_some_and(|t| t > 0))
    })
    .await;
    assert!(reported, "{}", get(&c, &url).await.text);
}

/// A request that arrives while its prefix is being prefilled waits for it when that is quicker than a cold
/// prefill elsewhere: the gateway stamps routing and first tokens with one clock, and `cache_aware` counts the
/// part of the queue already done. Without that (`prefill_progress=false`) the same request goes cold elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_waits_for_a_prefix_that_is_being_prefilled() {
    // seed-moe at a tenth of its time: a cold 22,001-token prompt takes ~0.72 s, a warm one ~0.12 s. The policy
    // is told the same (3,674 tokens/s and 1.235 s of base, scaled).
    let spec = "cache_aware:prefill_tokens_per_s=36740,base_ms=123.5,congestion_weight=0";
    for (progress, waits) in [(true, true), (false, false)] {
        let engine = Proc::start(&[
            "mock-engine",
            "--listen",
            "127.0.0.1:0",
            "--dp-size",
            "2",
            "--preset",
            "seed-moe",
            "--time-scale",
            "0.1",
        ]);
        let gw = Proc::gateway(
            &[&engine],
            &["--policy", &format!("{spec},prefill_progress={progress}")],
        );
        let c = client();
        let url = format!("{}/generate", gw.url);
        let prefix: Vec<u32> = (0..22_000).map(|i| (i * 7_919 % 150_000) as u32).collect();
        let ids = |tail: &[u32]| [prefix.as_slice(), tail].concat();
        let body = json!({"input_ids": ids(&[1]), "sampling_params": {"max_new_tokens": 2}, "stream": true});
        let first = send(&c, &url, &[], body.to_string()).await;
        let first_rank = first.headers().get("x-dp-rank").cloned();
        let first = tokio::spawn(read(first));
        // ~0.35 s into the first prompt's 0.72 s prefill: waiting for it (~0.37 + 0.12 s) beats a cold prefill.
        tokio::time::sleep(Duration::from_millis(350)).await;
        let second = post(
            &c,
            &url,
            &[],
            &json!({"input_ids": ids(&[2, 3]), "sampling_params": {"max_new_tokens": 1}}),
        )
        .await;
        assert_eq!(first.await.unwrap().status, StatusCode::OK);
        assert_eq!(second.status, StatusCode::OK);
        let same_rank = first_rank.and_then(|r| r.to_str().ok()?.parse::<u64>().ok()) == second.rank;
        let cached = second.json["meta_info"]["cached_tokens"].as_u64().unwrap();
        assert_eq!(same_rank, waits, "prefill_progress={progress}");
        if waits {
            assert!(cached >= 21_900, "waited for the prefix, cached {cached}");
        } else {
            assert_eq!(cached, 0, "went cold elsewhere");
        }
    }
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

/// A client given the base URL without `/v1` (as llama.cpp users often are) reaches the same routes, and the
/// engine (which serves only `/v1/...`) gets the `/v1` path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_without_v1_reach_the_engine_with_it() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&engine], &[]);
    let c = client();
    let chat = json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let reply = post(&c, &format!("{}/chat/completions", gw.url), &[], &chat).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(reply.json["object"], "chat.completion");
    let completion = json!({"model": "m", "max_tokens": 2, "prompt": "hi"});
    let reply = post(&c, &format!("{}/completions?x=1", gw.url), &[], &completion).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(reply.json["object"], "text_completion");
    let reply = get(&c, &format!("{}/models", gw.url)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
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

/// A session header (configured) or OpenAI's `prompt_cache_key` keeps a session on one endpoint, turn after turn,
/// while different sessions start on different endpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_hints_keep_sessions_together() {
    let engine = Proc::engine(&["--dp-size", "4"]);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-session.toml");
    std::fs::write(&config, "session_header = \"x-session-id\"\n").unwrap();
    let gw = Proc::gateway(&[&engine], &["--config", config.to_str().unwrap()]);
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url);
    let mut homes = std::collections::BTreeSet::new();
    for session in 0..8 {
        let mut endpoints = std::collections::BTreeSet::new();
        for turn in 0..20 {
            let id = format!("session-{session}");
            // Half the sessions name themselves in a header, half in the body; every turn's prompt is new.
            let mut chat = json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": format!("{session}/{turn}")}]});
            let headers: Vec<(&str, &str)> = if session % 2 == 0 {
                vec![("x-session-id", id.as_str())]
            } else {
                chat["prompt_cache_key"] = json!(id);
                vec![]
            };
            let response = send(&c, &url, &headers, chat.to_string()).await;
            assert_eq!(response.status(), StatusCode::OK);
            endpoints.insert(response.headers()["x-dprouter-endpoint"].to_str().unwrap().to_string());
            read(response).await;
        }
        assert_eq!(endpoints.len(), 1, "session {session} moved: {endpoints:?}");
        homes.extend(endpoints);
    }
    assert!(homes.len() >= 2, "every session on {homes:?}");
}

/// Several models: each request goes only to the workers serving its model (learned from their `/v1/models`), an
/// alias from the config reaches its model, an unknown model is a 404, `/v1/models` lists the union, and the
/// policy's state is kept per model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_to_the_workers_serving_their_model() {
    let alpha = Proc::engine(&["--dp-size", "1", "--model", "alpha"]);
    let beta = Proc::engine(&["--dp-size", "1", "--model", "beta"]);
    let both = Proc::engine(&["--dp-size", "1", "--model", "alpha,beta"]);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-models.toml");
    std::fs::write(&config, "[model_aliases]\n\"gpt-x\" = \"alpha\"\n").unwrap();
    let gw = Proc::gateway(
        &[&alpha, &beta, &both],
        &["--policy", "round_robin", "--config", config.to_str().unwrap()],
    );
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url);
    let chat = |model: &str, text: &str| json!({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]});
    let mut served = std::collections::BTreeMap::<&str, std::collections::BTreeSet<String>>::new();
    for i in 0..8 {
        for model in ["alpha", "beta", "gpt-x"] {
            let response = send(&c, &url, &[], chat(model, &format!("q{i}")).to_string()).await;
            assert_eq!(response.status(), StatusCode::OK, "{model}");
            let endpoint = response.headers()["x-dprouter-endpoint"].to_str().unwrap().to_string();
            served.entry(model).or_default().insert(endpoint);
            read(response).await;
        }
    }
    // Workers in order: alpha (w0), beta (w1), both (w2); round_robin alternates among those serving the model.
    let set = |s: &[&str]| {
        s.iter()
            .map(|e| e.to_string())
            .collect::<std::collections::BTreeSet<_>>()
    };
    // (The alias shares alpha's policy, so the two alternate together.)
    let alpha_or_alias: std::collections::BTreeSet<String> = served["alpha"].union(&served["gpt-x"]).cloned().collect();
    assert_eq!(
        alpha_or_alias,
        set(&["w0r0", "w2r0"]),
        "the alias reaches alpha's workers"
    );
    assert_eq!(served["beta"], set(&["w1r0", "w2r0"]));
    let unknown = post(&c, &url, &[], &chat("gamma", "q")).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{}", unknown.text);
    assert!(
        unknown.json["error"]["message"].as_str().unwrap().contains("gamma"),
        "{}",
        unknown.text
    );
    // A pinned rank gets the same check: alpha's request pinned to beta's worker (global rank 1) is refused,
    // pinned to the worker serving both it goes there, and a model that is not a string is a 400.
    let mut pinned = chat("alpha", "q");
    pinned["routed_dp_rank"] = json!(1);
    let refused = post(&c, &url, &[], &pinned).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.text);
    assert!(refused.text.contains("alpha"), "{}", refused.text);
    pinned["routed_dp_rank"] = json!(2);
    let taken = post(&c, &url, &[], &pinned).await;
    assert_eq!(
        (taken.status, taken.endpoint.as_deref()),
        (StatusCode::OK, Some("w2r0")),
        "{}",
        taken.text
    );
    let numeric = post(
        &c,
        &url,
        &[],
        &chat("alpha", "q")
            .as_object()
            .map(|o| {
                let mut o = o.clone();
                o.insert("model".into(), json!(5));
                Value::Object(o)
            })
            .unwrap(),
    )
    .await;
    assert_eq!(numeric.status, StatusCode::BAD_REQUEST, "{}", numeric.text);
    let models = get(&c, &format!("{}/v1/models", gw.url)).await.json;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["alpha", "beta", "gpt-x"]);

    // Per-model state: the same prompt on two models is cold on both under cache_aware.
    let ca = Proc::gateway(&[&both], &["--policy", "cache_aware"]);
    let long = "a shared system prompt, long enough to be indexed. ".repeat(40);
    for model in ["alpha", "beta"] {
        let reply = post(&c, &format!("{}/v1/chat/completions", ca.url), &[], &chat(model, &long)).await;
        assert_eq!(reply.status, StatusCode::OK);
    }
    let workers = get(&c, &format!("{}/workers", ca.url)).await.json;
    assert_eq!(
        workers["decisions"],
        json!({"cold": 2}),
        "a prefix on one model says nothing of another"
    );
}
