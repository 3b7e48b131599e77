//! End-to-end: a real Envoy (1.40, from PyPI) in front of `dprouter epp` replicas, with mock engines as the pool.
//! Envoy's own header `x-upstream-address` (`%UPSTREAM_REMOTE_ADDRESS%`, `deploy/envoy.yaml`) says where it
//! connected and the engine's `x-dp-rank` which rank served: both must be what the picker chose
//! (`x-dprouter-endpoint`).
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::envoy::Envoy;
use common::{client, get, post, send, Proc};
use hyper::StatusCode;
use serde_json::{json, Value};

/// A `dprouter epp` process: its gRPC address and its HTTP side.
struct Picker {
    proc: Proc,
    grpc: String,
}

impl Picker {
    fn start(engines: &[&Proc], extra: &[&str]) -> Picker {
        let bin = std::env::var("DPROUTER_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dprouter").to_string());
        let mut command = Command::new(bin);
        command.args(["epp", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]);
        for e in engines {
            command.args(["--worker", &e.url]);
        }
        command
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("DPROUTER_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        // "dprouter epp listening on grpc://ADDR and http://ADDR"
        let words: Vec<&str> = line.split_whitespace().collect();
        let grpc = words
            .iter()
            .find_map(|w| w.strip_prefix("grpc://"))
            .unwrap()
            .to_string();
        let url = words.iter().find(|w| w.starts_with("http://")).unwrap().to_string();
        Picker {
            proc: Proc { child, url },
            grpc,
        }
    }
}

/// The engine behind `url` (its port) and the rank, as the picker labels endpoints (`w{worker}r{rank}`).
fn label_of(reply: &common::Reply) -> (usize, u32) {
    let label = reply.headers["x-dprouter-endpoint"].to_str().unwrap();
    let (w, r) = label.trim_start_matches('w').split_once('r').unwrap();
    (w.parse().unwrap(), r.parse().unwrap())
}

fn header<'a>(reply: &'a common::Reply, name: &str) -> &'a str {
    reply
        .headers
        .get(name)
        .unwrap_or_else(|| panic!("no {name} in {:?}", reply.headers))
        .to_str()
        .unwrap()
}

/// Checks that Envoy connected to the worker the picker named and the engine ran the request on the named rank.
fn check_route(reply: &common::Reply, engines: &[&Proc]) {
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let (worker, rank) = label_of(reply);
    let expected = engines[worker].url.trim_start_matches("http://");
    assert_eq!(
        header(reply, "x-upstream-address"),
        expected,
        "Envoy connected elsewhere"
    );
    assert_eq!(header(reply, "x-dp-rank"), rank.to_string(), "another rank served");
}

fn chat(n: usize, system: &str) -> Value {
    json!({"model": "dprouter/mock", "max_tokens": 4,
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("Question {n}?")}]})
}

/// Requests through Envoy reach the worker and the rank the picker chose, streamed or not; a 1 MB body arrives
/// whole (the engine counts the same prompt tokens as when the body is sent to it directly); the picker learns each
/// response's usage (its token counters are what the clients saw); a GET with no body is routed; a request for no
/// endpoint gets the picker's JSON error through Envoy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_sends_each_request_to_the_endpoint_and_rank_the_picker_chose() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let b = Proc::engine(&["--dp-size", "2"]);
    let engines = [&a, &b];
    let picker = Picker::start(&engines, &["--policy", "round_robin"]);
    let envoy = Envoy::start("routes", &[&picker.grpc]).await;
    envoy.wait_for_healthy_pickers(1).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", envoy.url);
    let mut seen = std::collections::BTreeSet::new();
    let (mut prompt, mut cached) = (0, 0);
    for n in 0..8 {
        let reply = post(&c, &url, &[], &chat(n, "You are terse.")).await;
        check_route(&reply, &engines);
        seen.insert(label_of(&reply));
        prompt += reply.json["usage"]["prompt_tokens"].as_u64().unwrap();
        cached += reply.json["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
    }
    assert_eq!(
        seen.len(),
        4,
        "round robin reached every rank of both workers: {seen:?}"
    );
    // Streamed: every event and the end marker arrive.
    let mut body = chat(9, "You are terse.");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let reply = post(&c, &url, &[], &body).await;
    check_route(&reply, &engines);
    assert!(reply.text.trim_end().ends_with("data: [DONE]"), "{}", reply.text);
    let usage_line = reply.text.lines().rev().find(|l| l.contains("\"usage\":{")).unwrap();
    let usage: Value = serde_json::from_str(usage_line.trim_start_matches("data: ")).unwrap();
    prompt += usage["usage"]["prompt_tokens"].as_u64().unwrap();
    cached += usage["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    // 1 MB: the same prompt tokens as the engine counts when it gets the body itself.
    let big = chat(10, &"All work and no play makes a dull model. ".repeat(25_000));
    let direct = post(&c, &format!("{}/v1/chat/completions", a.url), &[], &big).await;
    assert_eq!(direct.status, StatusCode::OK, "{}", direct.text);
    let through = post(&c, &url, &[], &big).await;
    check_route(&through, &engines);
    assert!(serde_json::to_vec(&big).unwrap().len() > 1_000_000);
    assert_eq!(
        through.json["usage"]["prompt_tokens"],
        direct.json["usage"]["prompt_tokens"]
    );
    prompt += through.json["usage"]["prompt_tokens"].as_u64().unwrap();
    cached += through.json["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            common::token_counters(&c, &picker.proc.url).await == (prompt, cached)
        })
        .await,
        "the picker's token counters: {:?}, the clients saw {:?}",
        common::token_counters(&c, &picker.proc.url).await,
        (prompt, cached)
    );
    // A GET (no body) reaches an engine.
    let models = get(&c, &format!("{}/v1/models", envoy.url)).await;
    assert_eq!(models.status, StatusCode::OK, "{}", models.text);
    assert_eq!(models.json["data"][0]["id"], "dprouter/mock");
    // The client's own errors come back as the picker's JSON.
    let bad = send(&c, &url, &[], "{not json").await;
    let bad = common::read(bad).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.text);
    assert_eq!(bad.json["error"]["type"], "invalid_request_error", "{}", bad.text);
    let pinned = post(&c, &url, &[("x-data-parallel-rank", "9")], &chat(11, "x")).await;
    assert_eq!(pinned.status, StatusCode::BAD_REQUEST, "{}", pinned.text);
    // A pinned rank is honoured, and the engine gets it from the picker, not from the client's header.
    let pinned = post(&c, &url, &[("x-data-parallel-rank", "3")], &chat(12, "x")).await;
    check_route(&pinned, &engines);
    assert_eq!(label_of(&pinned), (1, 1));
}

/// The OpenAI Python SDK, every call it makes, through Envoy and the picker (`tests/openai_client.py`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_works_through_envoy_and_the_picker() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let picker = Picker::start(&[&a], &[]);
    let envoy = Envoy::start("openai", &[&picker.grpc]).await;
    envoy.wait_for_healthy_pickers(1).await;
    let python = common::python();
    let url = format!("{}/v1", envoy.url);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py"))
            .arg(url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two picker replicas behind Envoy's health-checked cluster: when one stops, only the requests in flight on it
/// may fail; the others, and every later one, are served by the other replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_of_two_pickers_costs_at_most_its_requests_in_flight() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let b = Proc::engine(&["--dp-size", "2"]);
    let engines = [&a, &b];
    let first = Picker::start(&engines, &[]);
    let mut second = Picker::start(&engines, &[]);
    let envoy = Envoy::start("replicas", &[&first.grpc, &second.grpc]).await;
    envoy.wait_for_healthy_pickers(2).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", envoy.url);
    // Sequential requests: at most one is in flight when the replica is killed.
    let mut failed = 0;
    for n in 0..60 {
        if n == 20 {
            second.proc.kill();
        }
        let reply = post(&c, &url, &[], &chat(n, "You are terse.")).await;
        if reply.status == StatusCode::OK {
            check_route(&reply, &engines);
        } else {
            failed += 1;
        }
    }
    assert!(failed <= 1, "{failed} requests failed after one replica stopped");
}

/// Envoy's own validation of the plain config the deploy folder ships (every field known to Envoy 1.40, the
/// clusters and filters constructible), as it is, ports included.
#[test]
fn envoy_validates_the_deploy_folders_config() {
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/envoy.yaml");
    let out = Command::new(common::envoy::binary())
        .args(["--mode", "validate", "--log-level", "warn", "-c"])
        .arg(&config)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "Envoy refuses deploy/envoy.yaml: {text}");
    assert!(text.contains("configuration") && text.contains("OK"), "{text}");
}

/// The proxy's subset hint, as a Gateway API implementation sets it (`envoy.lb.subset_hint`, here from Envoy's
/// `set_metadata` filter ahead of ext_proc, forwarded by `metadata_options`): every request goes to the allowed
/// endpoint even under round robin, and a hint that allows none of the picker's endpoints is its JSON 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_subset_hint_restricts_the_pickers_choice() {
    let a = Proc::engine(&[]);
    let b = Proc::engine(&[]);
    let engines = [&a, &b];
    let picker = Picker::start(&engines, &["--policy", "round_robin"]);
    let with_hint = |allowed: String| {
        move |config: String| {
            let filter = format!(
                "          - name: envoy.filters.http.set_metadata\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n              metadata:\n              - metadata_namespace: envoy.lb.subset_hint\n                value: {{ x-gateway-destination-endpoint-subset: [\"{allowed}\"] }}\n"
            );
            let ext_proc = "          - name: envoy.filters.http.ext_proc\n";
            assert!(config.contains(ext_proc), "deploy/envoy.yaml changed its filters");
            config.replacen(ext_proc, &format!("{filter}{ext_proc}"), 1)
        }
    };
    let b_address = b.url.trim_start_matches("http://").to_string();
    let envoy = Envoy::start_edited("subset", &[&picker.grpc], with_hint(b_address.clone())).await;
    envoy.wait_for_healthy_pickers(1).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", envoy.url);
    for n in 0..4 {
        let reply = post(&c, &url, &[], &chat(n, "You are terse.")).await;
        check_route(&reply, &engines);
        assert_eq!(
            header(&reply, "x-upstream-address"),
            b_address,
            "the hint allowed only b"
        );
    }
    drop(envoy);
    let nowhere = Envoy::start_edited("subset-none", &[&picker.grpc], with_hint("127.0.0.2:1".into())).await;
    nowhere.wait_for_healthy_pickers(1).await;
    let refused = post(&c, &format!("{}/v1/chat/completions", nowhere.url), &[], &chat(5, "x")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE, "{}", refused.text);
    assert!(refused.json["error"]["message"].is_string(), "{}", refused.text);
}
