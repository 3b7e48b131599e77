//! End-to-end routing: `dprouter serve` in front of real `dprouter mock-engine` processes on loopback. Every policy
//! routes; the cache-affine ones send a repeated prompt to its cache; a client's rank override is checked; each
//! backend gets its rank its own way (SGLang's body field, vLLM's header, none for plain OpenAI servers); load
//! reports, sessions and models steer the choice.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{client, eventually, get, post, read, send, Proc};
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

/// Each endpoint's prefill costs are learned from its own requests: two mock engines four times apart in prefill
/// rate behind one gateway; after 40 requests of 200 to 4,000 tokens to each, `/workers` and `/metrics` show each
/// endpoint's fitted rate within 15% of its engine's (the fit is robust to the network's and the engine's jitter);
/// answers sent whole are not sampled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_endpoints_prefill_costs_are_learned_from_its_requests() {
    let fast = Proc::engine(&["--dp-size", "1", "--prefill-rate", "100000", "--base-ms", "5"]);
    let slow = Proc::engine(&["--dp-size", "1", "--prefill-rate", "25000", "--base-ms", "5"]);
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        &fast.url,
        "--worker",
        &slow.url,
        "--policy",
        "cache_aware",
    ]);
    let c = client();
    let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
    assert_eq!(
        workers["workers"][0]["endpoints"][0]["prefill_costs"]["fitted"],
        Value::Null
    );
    common::spread_prompts(&c, &gw.url, 0, 40).await;
    common::spread_prompts(&c, &gw.url, 1, 40).await;
    // Answers sent whole are no samples: their first byte comes after the whole decode.
    for i in 0..5u32 {
        let ids: Vec<u32> = (0..500).map(|t| 900_000_000 + i * 1_000 + t).collect();
        let body = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 16}, "routed_dp_rank": 0});
        let reply = post(&c, &format!("{}/generate", gw.url), &[], &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    }
    let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
    for (w, rate) in [(0, 100_000.0), (1, 25_000.0)] {
        let costs = &workers["workers"][w]["endpoints"][0]["prefill_costs"];
        let fitted = costs["fitted"]["tokens_per_s"]
            .as_f64()
            .unwrap_or_else(|| panic!("no fit: {costs}"));
        assert!(
            (fitted / rate - 1.0).abs() < 0.15,
            "worker {w}: fitted {fitted} tokens/s for {rate}: {costs}"
        );
        assert_eq!(costs["samples"], 40);
    }
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    assert_eq!(
        metrics
            .lines()
            .filter(|l| l.starts_with("dprouter_endpoint_prefill_tokens_per_second{"))
            .count(),
        2,
        "{metrics}"
    );
}
